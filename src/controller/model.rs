//! Compact typed projections of the seed's objects: exactly what translation reads from
//! each kind, nothing else. The manifest reader ([`super::manifest`]) fills them from YAML;
//! a watch fills the same types from the API. This module does no I/O.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::route::Net;

/// What every projection keeps of `metadata`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Meta {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace` (empty for cluster-scoped objects).
    pub namespace: String,
    /// `metadata.uid`.
    pub uid: String,
    /// `metadata.creationTimestamp` as the API writes it (RFC 3339, UTC, whole seconds:
    /// `2024-05-01T10:00:00Z`), so that text order is time order; `None` when absent.
    pub created: Option<String>,
}

impl Meta {
    /// The order "oldest object first": creation time (objects without one last), then
    /// namespace and name, then uid. Conflicts keep the first.
    pub fn age(&self) -> (bool, &str, &str, &str, &str) {
        (
            self.created.is_none(),
            self.created.as_deref().unwrap_or(""),
            &self.namespace,
            &self.name,
            &self.uid,
        )
    }

    /// `namespace/name`, for reports.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// An Istio `Gateway` (`networking.istio.io/v1` or `v1beta1`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gateway {
    /// Metadata.
    pub meta: Meta,
    /// `spec.selector`: the gateway workloads it applies to.
    pub selector: BTreeMap<String, String>,
    /// `spec.servers`.
    pub servers: Vec<Server>,
}

/// One `spec.servers[]` entry of a Gateway.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Server {
    /// `port.number`.
    pub port: u32,
    /// `port.protocol`, upper case (`TLS`, `HTTPS`, `HTTP`, `TCP`).
    pub protocol: String,
    /// `tls.mode`, upper case (`PASSTHROUGH`, `SIMPLE`, `OPTIONAL_MUTUAL`, …), if any.
    pub tls_mode: Option<String>,
    /// `hosts`, lower case, without a `namespace/` prefix and a trailing dot.
    pub hosts: Vec<String>,
}

impl Server {
    /// TLS passed through unterminated: what trellis routes by SNI.
    pub fn is_passthrough(&self) -> bool {
        self.protocol == "TLS" && self.tls_mode.as_deref() == Some("PASSTHROUGH")
    }
}

/// An Istio `VirtualService` (`networking.istio.io/v1` or `v1beta1`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VirtualService {
    /// Metadata.
    pub meta: Meta,
    /// `spec.gateways`: `name` (same namespace) or `namespace/name`.
    pub gateways: Vec<String>,
    /// `spec.tls[]`: SNI routes.
    pub tls: Vec<TlsRoute>,
    /// Destinations of `spec.http[].route[]` (TLS-terminated traffic).
    pub http_destinations: Vec<Destination>,
}

/// One `spec.tls[]` entry of a VirtualService.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsRoute {
    /// Every `match[].sniHosts` entry.
    pub sni_hosts: Vec<String>,
    /// `route[].destination`.
    pub destinations: Vec<Destination>,
}

/// A `destination` of a VirtualService route.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Destination {
    /// `host`: a Service name, short (`svc`, `svc.ns`) or full (`svc.ns.svc.cluster.local`).
    pub host: String,
    /// `port.number`, if given.
    pub port: Option<u32>,
}

/// An Istio `DestinationRule`: the traffic policy for one host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DestinationRule {
    /// Metadata.
    pub meta: Meta,
    /// `spec.host`.
    pub host: String,
    /// `spec.trafficPolicy.connectionPool.tcp.maxConnectionDuration`.
    pub max_connection_duration: Option<Duration>,
}

/// An Istio `EnvoyFilter`: its name (`<namespace>-istio-tls-termination` marks a shoot whose
/// API server Istio exposes with TLS termination) and the RBAC filters it inserts (the ACL
/// extension's source allow-lists); every other patch is dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvoyFilter {
    /// Metadata.
    pub meta: Meta,
    /// `spec.workloadSelector.labels`; `None` when absent (every workload of its namespace).
    pub workload_selector: Option<BTreeMap<String, String>>,
    /// `spec.configPatches[]` whose value is an Envoy RBAC filter (network or HTTP), in order.
    pub rbac: Vec<Rbac>,
}

/// One RBAC filter an EnvoyFilter patch inserts: where, and whom it admits to what.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rbac {
    /// What the patch's `match` selects.
    pub at: RbacAt,
    /// `typed_config.rules.action`, upper case (`ALLOW`, `DENY`, …); Envoy's default `ALLOW`
    /// when absent.
    pub action: String,
    /// `typed_config.rules.policies`, ordered by name.
    pub policies: Vec<RbacPolicy>,
}

/// Where an RBAC patch applies.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum RbacAt {
    /// A network filter of the filter chain that serves this TLS server name
    /// (`match.listener.filterChain.sni`).
    Sni(String),
    /// An HTTP filter of the listener with this name (`match.listener.name`, e.g.
    /// `0.0.0.0_8132`).
    Listener(String),
    /// Anything else.
    #[default]
    Other,
}

/// One policy of an RBAC filter: it matches a request when one of its permissions and one of
/// its principals match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RbacPolicy {
    /// The policy's name.
    pub name: String,
    /// `permissions[]`.
    pub permissions: Vec<Permission>,
    /// `principals[]`.
    pub principals: Vec<Principal>,
}

/// An RBAC permission, as far as translation understands it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Permission {
    /// `any: true`.
    Any,
    /// `header` with `string_match.contains` (header name lower case); `negated` for a
    /// `not_rule` around it.
    HeaderContains {
        /// The header name, lower case.
        header: String,
        /// The substring.
        value: String,
        /// Wrapped in `not_rule`.
        negated: bool,
    },
    /// Anything else (another matcher, `and_rules`, …).
    Other,
}

/// An RBAC principal, as far as translation understands it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// `remote_ip` or `source_ip`: the client address, which honours the PROXY protocol
    /// (trellis' client address: the PROXY source when the peer is trusted, else the peer).
    Client(Net),
    /// `direct_remote_ip`: the physical peer even when a PROXY header names another source.
    Peer(Net),
    /// Anything else (`any`, `and_ids`, `not_id`, headers, an invalid address, …).
    Other,
}

/// A core `Service`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Service {
    /// Metadata.
    pub meta: Meta,
    /// `spec.clusterIPs` (or `spec.clusterIP`), `None` entries left out.
    pub cluster_ips: Vec<String>,
    /// `spec.ports`.
    pub ports: Vec<ServicePort>,
}

/// One `spec.ports[]` entry of a Service.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServicePort {
    /// `name` (EndpointSlice ports carry the same name); empty when unnamed.
    pub name: String,
    /// `port`.
    pub port: u16,
}

/// A `discovery.k8s.io/v1` `EndpointSlice`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointSlice {
    /// Metadata.
    pub meta: Meta,
    /// The `kubernetes.io/service-name` label.
    pub service: String,
    /// `addressType`: `IPv4`, `IPv6` or `FQDN`.
    pub address_type: String,
    /// `ports[]`: name (empty when unnamed) and port number.
    pub ports: Vec<(String, Option<u16>)>,
    /// `endpoints[]`.
    pub endpoints: Vec<Endpoint>,
}

/// One endpoint of an EndpointSlice.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Endpoint {
    /// The first of `addresses` (the one to use), read as an IP address; `None` when there is
    /// none or it is not one (an `FQDN` slice's host name).
    pub address: Option<std::net::IpAddr>,
    /// `conditions.ready` (absent means ready).
    pub ready: Option<bool>,
    /// `conditions.terminating` (absent means not terminating).
    pub terminating: Option<bool>,
    /// `zone`.
    pub zone: Option<String>,
}

impl Endpoint {
    /// Ready to take new connections, as the API defines it: `ready` true or absent, and
    /// not `terminating`.
    pub fn is_ready(&self) -> bool {
        self.ready != Some(false) && self.terminating != Some(true)
    }
}

/// A `Namespace`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Namespace {
    /// Metadata.
    pub meta: Meta,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
}

/// A Gateway API `TLSRoute` (`gateway.networking.k8s.io/v1`, also `v1alpha2`/`v1alpha3`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsRouteObject {
    /// Metadata.
    pub meta: Meta,
    /// `spec.hostnames`.
    pub hostnames: Vec<String>,
    /// `spec.parentRefs` that name a Gateway API `Gateway`: (namespace, name), the
    /// namespace defaulted to the route's.
    pub parents: Vec<(String, String)>,
    /// Every `spec.rules[].backendRefs[]`.
    pub backends: Vec<BackendRef>,
}

/// A `backendRefs[]` entry of a TLSRoute.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendRef {
    /// `group`/`kind` other than core `Service` (empty for a Service).
    pub other_kind: String,
    /// `name`.
    pub name: String,
    /// `namespace`, defaulted to the route's.
    pub namespace: String,
    /// `port`.
    pub port: Option<u32>,
}

/// Every object translation reads, as the stores hold them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Istio Gateways.
    pub gateways: Vec<Gateway>,
    /// Istio VirtualServices.
    pub virtual_services: Vec<VirtualService>,
    /// Istio DestinationRules.
    pub destination_rules: Vec<DestinationRule>,
    /// Istio EnvoyFilters (names, selectors and RBAC filters).
    pub envoy_filters: Vec<EnvoyFilter>,
    /// Services.
    pub services: Vec<Service>,
    /// EndpointSlices.
    pub endpoint_slices: Vec<EndpointSlice>,
    /// Namespaces.
    pub namespaces: Vec<Namespace>,
    /// Gateway API TLSRoutes.
    pub tls_routes: Vec<TlsRouteObject>,
}

impl Snapshot {
    /// Objects per kind, in a fixed order: what the report and the metrics count.
    pub fn counts(&self) -> [(&'static str, usize); 8] {
        [
            ("Gateway", self.gateways.len()),
            ("VirtualService", self.virtual_services.len()),
            ("DestinationRule", self.destination_rules.len()),
            ("EnvoyFilter", self.envoy_filters.len()),
            ("Service", self.services.len()),
            ("EndpointSlice", self.endpoint_slices.len()),
            ("Namespace", self.namespaces.len()),
            ("TLSRoute", self.tls_routes.len()),
        ]
    }
}

/// One object of any kind translation reads: what a watch event or a manifest document
/// becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Object {
    /// An Istio Gateway.
    Gateway(Gateway),
    /// An Istio VirtualService.
    VirtualService(VirtualService),
    /// An Istio DestinationRule.
    DestinationRule(DestinationRule),
    /// An Istio EnvoyFilter (name only).
    EnvoyFilter(EnvoyFilter),
    /// A Service.
    Service(Service),
    /// An EndpointSlice.
    EndpointSlice(EndpointSlice),
    /// A Namespace.
    Namespace(Namespace),
    /// A Gateway API TLSRoute.
    TlsRoute(TlsRouteObject),
}

impl Snapshot {
    /// Adds one object to the list of its kind.
    pub fn push(&mut self, object: Object) {
        match object {
            Object::Gateway(o) => self.gateways.push(o),
            Object::VirtualService(o) => self.virtual_services.push(o),
            Object::DestinationRule(o) => self.destination_rules.push(o),
            Object::EnvoyFilter(o) => self.envoy_filters.push(o),
            Object::Service(o) => self.services.push(o),
            Object::EndpointSlice(o) => self.endpoint_slices.push(o),
            Object::Namespace(o) => self.namespaces.push(o),
            Object::TlsRoute(o) => self.tls_routes.push(o),
        }
    }
}
