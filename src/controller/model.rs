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
    /// The principals' networks written with host bits set, in order: each is used with
    /// them cleared (as Envoy reads them), and reported.
    pub host_bits: Vec<HostBits>,
}

/// A network an object writes with host bits set (`10.250.0.1/16`). Objects are the API
/// server's, not trellis' own files: the network with the host bits cleared is used, never
/// the object refused, and translation reports each one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostBits {
    /// Where in the object (`spec.shoot.spec.networking.nodes`).
    pub field: String,
    /// The network as written.
    pub given: String,
    /// The network used.
    pub used: Net,
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

/// A Gardener `Cluster` (`extensions.gardener.cloud/v1alpha1`, cluster-scoped, named like
/// the shoot's namespace): the shoot's networks, which its tunnel reaches.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cluster {
    /// Metadata (`name` is the shoot namespace).
    pub meta: Meta,
    /// The node, pod and service networks of the embedded Shoot (`spec.shoot`): its
    /// `spec.networking.nodes/pods/services` (one network each, the primary family) and its
    /// `status.networking.nodes/pods/services` (every family of a dual-stack shoot), sorted
    /// and unique; what is not a network is left out, a network with host bits set is
    /// there with them cleared.
    pub networks: Vec<Net>,
    /// The networks written with host bits set, in order.
    pub host_bits: Vec<HostBits>,
}

/// Bytes from a Secret (certificates, private keys): shared, not copied, from the store's
/// projection to the files rendered and the writer's record of them (so an unchanged file
/// compares equal by pointer); never printed ([`std::fmt::Debug`] shows their length only).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct SecretBytes(pub std::sync::Arc<[u8]>);

impl SecretBytes {
    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl From<Vec<u8>> for SecretBytes {
    fn from(bytes: Vec<u8>) -> Self {
        SecretBytes(bytes.into())
    }
}

impl std::fmt::Debug for SecretBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<{} bytes>", self.0.len())
    }
}

/// A `Secret` the controller reads (a watch selects them by label; see
/// [`super::kinds::WATCHED`]): what each kind of them holds for translation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Secret {
    /// Metadata.
    pub meta: Meta,
    /// What it holds.
    pub content: SecretContent,
}

/// What a [`Secret`] holds for translation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum SecretContent {
    /// trellis' tunnel peers of the shoot (label [`TUNNEL_PEERS_LABEL`]): per peer name, the
    /// texts of `<peer>.publicKey` and `<peer>.addresses`, ordered by peer name.
    TunnelPeers(Vec<PeerEntry>),
    /// Gardener's `vpn-seed-server` server certificate (`tls.crt`, `tls.key`).
    EgressCertificate {
        /// The `issued-at-time` label (Unix seconds), if any.
        issued_at: Option<u64>,
        /// `tls.crt`: the certificate chain, PEM.
        certificate: SecretBytes,
        /// `tls.key`: its private key, PEM.
        key: SecretBytes,
    },
    /// Gardener's `ca-vpn` bundle (`bundle.crt`): the CAs egress client certificates chain to.
    EgressClientCa {
        /// The `issued-at-time` label (Unix seconds), if any.
        issued_at: Option<u64>,
        /// `bundle.crt`: the CA certificates, PEM.
        bundle: SecretBytes,
    },
    /// None of these.
    #[default]
    Other,
}

/// The label that marks a Secret of tunnel peers, and its value.
pub const TUNNEL_PEERS_LABEL: (&str, &str) = ("trellis.gardener.cloud/role", "tunnel-peers");

/// One peer of a tunnel peers Secret, as written (checked by translation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerEntry {
    /// The peer's name: the data keys' common prefix (`agent-0` of `agent-0.publicKey`).
    pub name: String,
    /// `<name>.publicKey`, if present and text.
    pub public_key: Option<String>,
    /// `<name>.addresses`, if present and text.
    pub addresses: Option<String>,
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
    /// Gardener Clusters.
    pub clusters: Vec<Cluster>,
    /// Secrets selected by label (tunnel peers, egress certificates and CA bundles).
    pub secrets: Vec<Secret>,
}

impl Snapshot {
    /// Objects per kind, in a fixed order: what the report and the metrics count.
    pub fn counts(&self) -> [(&'static str, usize); 10] {
        [
            ("Gateway", self.gateways.len()),
            ("VirtualService", self.virtual_services.len()),
            ("DestinationRule", self.destination_rules.len()),
            ("EnvoyFilter", self.envoy_filters.len()),
            ("Service", self.services.len()),
            ("EndpointSlice", self.endpoint_slices.len()),
            ("Namespace", self.namespaces.len()),
            ("TLSRoute", self.tls_routes.len()),
            ("Cluster", self.clusters.len()),
            ("Secret", self.secrets.len()),
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
    /// A Gardener Cluster.
    Cluster(Cluster),
    /// A Secret of one of the kinds translation reads.
    Secret(Secret),
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
            Object::Cluster(o) => self.clusters.push(o),
            Object::Secret(o) => self.secrets.push(o),
        }
    }
}
