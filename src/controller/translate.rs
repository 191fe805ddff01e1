//! Snapshot -> routing table: a pure function of the objects and the target gateway.
//!
//! What gardenlet writes per shoot namespace becomes routes:
//! - **SNI**: a `VirtualService` bound (`spec.gateways`: `name` or `namespace/name`) to an
//!   Istio `Gateway` that the target serves (every label of the Gateway's `spec.selector` is
//!   one of the target's labels) and that has a TLS passthrough server (`protocol: TLS`,
//!   `tls.mode: PASSTHROUGH`): its `tls[].match[].sniHosts` route to `route[].destination`,
//!   a Service (`svc`, or `svc.ns.svc.cluster.local`) and port. Gateway API `TLSRoute`s
//!   attached to one of the target's parents route their `hostnames` to their backend.
//! - **Backends**: the Service's EndpointSlices (label `kubernetes.io/service-name`), the
//!   port whose name is the Service port's, every ready endpoint (`ready` true or absent,
//!   not `terminating`; IPv4 and IPv6) with its zone.
//! - **DestinationRule** of the destination host: `maxConnectionDuration`. Its TCP keepalive
//!   has no place in a route (the gateway's `keepalive.upstream` holds it for every route).
//! - **CONNECT**: the `kube-apiserver` route of a namespace carries
//!   `outbound|443||kube-apiserver.<ns>.svc.cluster.local` and, as `proxyDestinations`, the
//!   Service's IPv4 ClusterIP with its first octet replaced by 240, port 443. A namespace
//!   routed on the target also gets a route per `vpn-seed-server[-N]` Service, port 1194,
//!   keyed `outbound|1194||vpn-seed-server[-N].<ns>.svc.cluster.local`.
//! - **L7 shoots** (Istio terminates their TLS: a `<ns>-istio-tls-termination` EnvoyFilter,
//!   or a served VirtualService that sends HTTP to `kube-apiserver.<ns>`) are not routed by
//!   SNI; their CONNECT and PROXY keys go to the fallback route.
//! - **Fallback**: a route named [`FALLBACK_ROUTE`] with the fallback backend, the `sni`
//!   listener's `defaultRoute`. Other HTTPS hosts (Gardener's plutono, prometheus, the garden
//!   `kube-apiserver-ingress`) are left to it and counted as `https`.
//! - **Names**: a namespace's API server route is named after the namespace, its other
//!   routes `<ns>--<service>` (`--<port>` when it has several); names the controller keeps for
//!   its own routes ([`super::target::is_reserved`]: `fallback`, `fallback-…`) get the prefix
//!   [`super::target::RENAMED_PREFIX`], so no namespace can take one.
//! - **Conflicts**: two routes claiming one key (server name, destination, PROXY destination,
//!   route name): the oldest object wins (creation time, then namespace, name, uid); the
//!   other loses that key and is counted as `conflict`. Claims are settled before endpoints
//!   are looked at, so a restarting pod never hands a name to another namespace.
//! - **Source allow-lists**: RBAC EnvoyFilters (the ACL extension's) become routes'
//!   `allowedSourceRanges`, narrowed where not exact (see [`super::acl`]).
//! - **Tunnels**: a shoot's `Cluster`, tunnel peers Secret, egress certificate Secrets and
//!   `kube-apiserver` EndpointSlices become its route `<ns>.tunnel` with `tunnel` and
//!   `egress`, and the egress TLS files beside the table (see [`super::tunnel`]).
//! - **Extra routes** of the configuration (`extraRoutes`) are added as written and come
//!   first: a rendered route with one's name is left out, one holding one's server name,
//!   destination or PROXY destination loses that key (each `conflict`), and a rendered route
//!   left with no key is dropped.
//! - Namespaces being deleted are skipped (`namespace_deleting`); a route without a ready
//!   endpoint is left out (`no_endpoints`): a route must have a backend, and its server names
//!   fall through to the fallback, which may still reach it.
//!
//! [`translate`] applies these rules one step after the other, each a method of
//! `Translation`: claims, server names settled, fallback routes, server-name routes, VPN
//! routes, names and keys settled, the ACL code, the tunnel routes, then the extra routes.
//! The output is ordered by route name,
//! each list sorted: the same snapshot gives the same bytes. Nothing here does I/O.

use std::borrow::Cow;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr};

use super::model::{Cluster, Destination, EndpointSlice, Gateway, Meta, Service, Snapshot};
use super::report::{Reason, Report};
use super::target::{
    FALLBACK_CONNECT_LEGACY_ROUTE, FALLBACK_CONNECT_ROUTE, FALLBACK_ROUTE, Target, is_fallback,
    shoot_route_name,
};
use crate::config::routes::{RawBackend, RawRoute, RawRoutingTable};

/// The cluster domain of Service host names (Gardener's seeds use the default).
const CLUSTER_DOMAIN: &str = "svc.cluster.local";

/// The shoot API server's Service and port.
const KUBE_APISERVER: (&str, u16) = ("kube-apiserver", 443);

/// The VPN server's Service name (HA: `-0`, `-1`, …) and OpenVPN port.
const VPN_SEED_SERVER: (&str, u16) = ("vpn-seed-server", 1194);

/// Suffix of the EnvoyFilter that marks a namespace's API server as TLS-terminated by Istio.
const TLS_TERMINATION_FILTER: &str = "-istio-tls-termination";

/// A routing table as the controller writes it: the gateway's own schema.
pub type Table = RawRoutingTable;

pub use super::tunnel::Files;

/// What a translation renders: the table, the files beside it that the table names, and
/// what was left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// The routing table.
    pub table: Table,
    /// The egress TLS files the table names, by name relative to the table's directory.
    pub files: Files,
    /// What was left out, and why.
    pub report: Report,
}

/// A route being built: the Service and port it leads to (names borrowed from the
/// snapshot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct RouteKey<'a> {
    namespace: &'a str,
    service: &'a str,
    port: Option<u32>,
}

/// A [`Meta::age`]: the order in which routes keep contested keys.
type Age<'a> = (bool, &'a str, &'a str, &'a str, &'a str);

/// A server name claimed for a route by an object.
struct Claim<'a> {
    host: Cow<'a, str>,
    route: RouteKey<'a>,
    owner: &'a Meta,
    kind: &'static str,
}

/// The server names each route keeps ([`Translation::settle_server_names`]), sorted, with
/// the oldest object claiming one for it; names borrowed from the claims.
type ServerNames<'c, 'a> = BTreeMap<RouteKey<'a>, (Vec<&'c str>, &'a Meta)>;

/// Routes built, each with its owner (the oldest object behind it), before route names and
/// CONNECT/PROXY keys are settled ([`Translation::settle_keys`]).
type Built<'a> = Vec<(RawRoute, Age<'a>)>;

/// Renders the routing table for `target` from `snapshot`, and the files it names, one step
/// after the other (each a method of `Translation`, one rule of the module documentation).
pub fn translate(snapshot: &Snapshot, target: &Target) -> Rendered {
    let mut t = Translation::new(snapshot, target);
    let (claims, l7) = t.claims();
    let sni = t.settle_server_names(&claims);
    // Sized once: a route is a few hundred bytes, and growing moves them all.
    let vpn_routes: usize = t.index.vpn.values().map(Vec::len).sum();
    let mut built: Built<'_> = Vec::with_capacity(1 + sni.len() + vpn_routes);
    let fallback_keys = t.fallback_routes(&l7, &mut built);
    let routed = t.server_name_routes(sni, &mut built);
    t.vpn_routes(&routed, &mut built);
    let mut routes = t.settle_keys(built);
    super::acl::apply(snapshot, target, &fallback_keys, &mut routes, &mut t.report);
    let files = t.tunnel_routes(&mut routes);
    t.extra_routes(&mut routes);
    let mut report = t.report;
    report.routes = routes.len();
    Rendered {
        table: RawRoutingTable::new(routes),
        files,
        report,
    }
}

/// One translation under way: what it reads, and the report it fills.
struct Translation<'a> {
    snapshot: &'a Snapshot,
    target: &'a Target,
    index: Index<'a>,
    report: Report,
    /// Namespaces being deleted.
    deleting: BTreeSet<&'a str>,
    /// Those of them reported already (once each).
    deleting_seen: BTreeSet<&'a str>,
}

/// What the claims step found: the server names claimed, and the L7 namespaces (whose API
/// server Istio terminates).
type Claims<'a> = (Vec<Claim<'a>>, BTreeSet<String>);

impl<'a> Translation<'a> {
    fn new(snapshot: &'a Snapshot, target: &'a Target) -> Self {
        Translation {
            snapshot,
            target,
            index: Index::new(snapshot),
            report: Report {
                objects: snapshot.counts().into_iter().collect(),
                ..Report::default()
            },
            deleting: snapshot
                .namespaces
                .iter()
                .filter(|n| n.deleting)
                .map(|n| n.meta.name.as_str())
                .collect(),
            deleting_seen: BTreeSet::new(),
        }
    }

    /// Whether `ns` is being deleted; reported the first time it is asked about.
    fn deleting(&mut self, ns: &'a str) -> bool {
        let deleting = self.deleting.contains(ns);
        if deleting && self.deleting_seen.insert(ns) {
            self.report.skip(
                Reason::NamespaceDeleting,
                format!("Namespace {ns}"),
                "the namespace is being deleted",
            );
        }
        deleting
    }

    /// Server names claimed by VirtualServices bound to a served Gateway and by TLSRoutes of
    /// served parents, oldest object first; and the L7 namespaces, whose claims are dropped.
    fn claims(&mut self) -> Claims<'a> {
        let mut claims = Vec::new();
        let mut l7 = BTreeSet::new();
        self.virtual_service_claims(&mut claims, &mut l7);
        self.tls_route_claims(&mut claims);
        self.l7_by_filter(&claims, &mut l7);
        claims.retain(|c| !l7.contains(c.route.namespace));
        (claims, l7)
    }

    /// The SNI hosts of VirtualServices bound to a Gateway this target serves with a
    /// passthrough server; namespaces a served VirtualService sends HTTP to the API server
    /// of go to `l7`.
    fn virtual_service_claims(&mut self, claims: &mut Vec<Claim<'a>>, l7: &mut BTreeSet<String>) {
        let gateways: HashMap<(&str, &str), &Gateway> = self
            .snapshot
            .gateways
            .iter()
            .filter(|g| self.target.serves(g))
            .map(|g| ((g.meta.namespace.as_str(), g.meta.name.as_str()), g))
            .collect();
        let mut sorted: Vec<_> = self.snapshot.virtual_services.iter().collect();
        sorted.sort_by(|a, b| a.meta.age().cmp(&b.meta.age()));
        for vs in sorted {
            let ns = vs.meta.namespace.as_str();
            let bound: Vec<&Gateway> = vs
                .gateways
                .iter()
                .filter_map(|g| {
                    let (gns, name) = g.split_once('/').unwrap_or((ns, g));
                    gateways.get(&(gns, name)).copied()
                })
                .collect();
            if bound.is_empty() {
                continue;
            }
            // Formatted only for a skip: most objects are routed.
            let object = || format!("VirtualService {}", vs.meta.key());
            if self.deleting(ns) {
                continue;
            }
            let passthrough = bound
                .iter()
                .any(|g| g.servers.iter().any(|s| s.is_passthrough()));
            if passthrough {
                for tls in &vs.tls {
                    let [destination] = tls.destinations.as_slice() else {
                        self.report.skip(
                            Reason::Unsupported,
                            object(),
                            format!("{} destinations; one is supported", tls.destinations.len()),
                        );
                        continue;
                    };
                    let Some(route) = route_key(destination, ns) else {
                        self.report.skip(
                            Reason::Unsupported,
                            object(),
                            format!(
                                "host {:?} is not a Service of this cluster",
                                destination.host
                            ),
                        );
                        continue;
                    };
                    if self.deleting(route.namespace) {
                        continue;
                    }
                    for host in &tls.sni_hosts {
                        claims.push(Claim {
                            host: normalize(host),
                            route,
                            owner: &vs.meta,
                            kind: "VirtualService",
                        });
                    }
                }
            }
            // HTTP to a shoot's API server (besides its connection-upgrade Service) makes the
            // shoot L7; HTTP to anything else is one of Gardener's own HTTPS hosts.
            let api_servers: Vec<&str> = vs
                .http_destinations
                .iter()
                .filter_map(|d| route_key(d, ns))
                .filter(|k| k.service == KUBE_APISERVER.0)
                .map(|k| k.namespace)
                .collect();
            let https = api_servers.is_empty() && !vs.http_destinations.is_empty();
            l7.extend(api_servers.into_iter().map(str::to_owned));
            if https {
                self.report.skip(
                    Reason::Https,
                    object(),
                    "TLS terminated by Istio, left to the fallback",
                );
            }
        }
    }

    /// The hostnames of TLSRoutes attached to one of the target's parents, to their one
    /// Service backend in their own namespace.
    fn tls_route_claims(&mut self, claims: &mut Vec<Claim<'a>>) {
        let mut sorted: Vec<_> = self
            .snapshot
            .tls_routes
            .iter()
            .filter(|r| {
                r.parents
                    .iter()
                    .any(|p| self.target.parent_refs.contains(p))
            })
            .collect();
        sorted.sort_by(|a, b| a.meta.age().cmp(&b.meta.age()));
        for r in sorted {
            let ns = r.meta.namespace.as_str();
            let object = format!("TLSRoute {}", r.meta.key());
            if self.deleting(ns) {
                continue;
            }
            let [backend] = r.backends.as_slice() else {
                let n = r.backends.len();
                self.report.skip(
                    Reason::Unsupported,
                    object,
                    format!("{n} backendRefs; one is supported"),
                );
                continue;
            };
            if !backend.other_kind.is_empty() || backend.namespace != ns {
                self.report.skip(
                    Reason::Unsupported,
                    object,
                    "backendRefs to another namespace or kind than a Service (ReferenceGrants are not read)",
                );
                continue;
            }
            for host in &r.hostnames {
                claims.push(Claim {
                    host: normalize(host),
                    route: RouteKey {
                        namespace: ns,
                        service: &backend.name,
                        port: backend.port,
                    },
                    owner: &r.meta,
                    kind: "TLSRoute",
                });
            }
        }
    }

    /// Namespaces on this gateway that are L7 by their `<ns>-istio-tls-termination`
    /// EnvoyFilter (a shoot switching to TLS termination) join `l7`; namespaces being deleted
    /// leave it.
    fn l7_by_filter(&mut self, claims: &[Claim<'a>], l7: &mut BTreeSet<String>) {
        let filters: BTreeSet<&str> = self
            .snapshot
            .envoy_filters
            .iter()
            .filter_map(|f| f.meta.name.strip_suffix(TLS_TERMINATION_FILTER))
            .collect();
        // The claims of one object are neighbours: each namespace looked up once per object.
        let mut previous = None;
        for ns in claims.iter().map(|c| c.route.namespace) {
            if previous != Some(ns) && filters.contains(ns) {
                l7.insert(ns.to_owned());
            }
            previous = Some(ns);
        }
        // Owned names, so the report borrows nothing from `l7`.
        let deleting: Vec<&'a str> = self
            .deleting
            .iter()
            .copied()
            .filter(|ns| l7.contains(*ns))
            .collect();
        l7.retain(|ns| !self.deleting.contains(ns.as_str()));
        for ns in deleting {
            self.deleting(ns);
        }
    }

    /// Each server name goes to the route of its oldest claim; the others are reported.
    fn settle_server_names<'c>(&mut self, claims: &'c [Claim<'a>]) -> ServerNames<'c, 'a> {
        let mut order: Vec<&Claim<'a>> = claims.iter().collect();
        order.sort_by(|a, b| (&a.host, a.owner.age()).cmp(&(&b.host, b.owner.age())));
        // Claims come sorted by name, so each route's names arrive sorted, repeats together.
        let mut sni: ServerNames<'c, 'a> = BTreeMap::new();
        let mut winner: Option<(&str, RouteKey<'_>, &Meta, &str)> = None;
        for c in order {
            match winner {
                Some((host, route, owner, kind)) if host == c.host => {
                    if route != c.route {
                        // The route keeps what else it has (its CONNECT keys, other names).
                        sni.entry(c.route).or_insert((Vec::new(), c.owner));
                        self.report.skip(
                            Reason::Conflict,
                            format!("{} {}", c.kind, c.owner.key()),
                            format!(
                                "server name {:?} is claimed by the older {kind} {}",
                                c.host,
                                owner.key()
                            ),
                        );
                        continue;
                    }
                }
                _ => winner = Some((&c.host, c.route, c.owner, c.kind)),
            }
            let entry = sni.entry(c.route).or_insert((Vec::new(), c.owner));
            if entry.0.last() != Some(&&*c.host) {
                entry.0.push(&c.host);
            }
            if c.owner.age() < entry.1.age() {
                entry.1 = c.owner;
            }
        }
        sni
    }

    /// The fallback routes the target names; the L7 shoots are reported. L7 shoots' CONNECT
    /// keys are not rendered: no route holds them, so they reach the fallback's CONNECT
    /// proxy by the listeners' default routes, on the port of the header they came with;
    /// they are returned (for the ACL code). Their PROXY destinations stay on the `fallback`
    /// route.
    fn fallback_routes(
        &mut self,
        l7: &BTreeSet<String>,
        built: &mut Built<'a>,
    ) -> BTreeSet<String> {
        let mut fallback = (BTreeSet::new(), BTreeSet::new());
        for ns in l7 {
            let detail = if self.target.connect_fallback().is_some() {
                "Istio terminates its TLS: not routed by SNI, CONNECT forwarded to the fallback"
            } else {
                "Istio terminates its TLS: not routed by SNI; no CONNECT fallback, CONNECT not routed"
            };
            self.report
                .skip(Reason::L7, format!("Namespace {ns}"), detail);
            fallback
                .0
                .insert(connect_key(KUBE_APISERVER.0, ns, KUBE_APISERVER.1));
            if let Some(svc) = self.index.services.get(&(ns.as_str(), KUBE_APISERVER.0)) {
                fallback.1.extend(proxy_destination(svc));
            }
            for svc in self.index.vpn_services(ns) {
                fallback
                    .0
                    .insert(connect_key(&svc.meta.name, ns, VPN_SEED_SERVER.1));
            }
        }
        let target = self.target;
        let fallbacks = [
            (FALLBACK_ROUTE, &target.fallback, false),
            (FALLBACK_CONNECT_ROUTE, &target.fallback_connect, true),
            (
                FALLBACK_CONNECT_LEGACY_ROUTE,
                &target.fallback_connect_legacy,
                true,
            ),
        ];
        for (name, address, forward_connect) in fallbacks {
            let Some(address) = address else { continue };
            built.push((
                RawRoute {
                    name: name.to_owned(),
                    proxy_destinations: if forward_connect {
                        Vec::new()
                    } else {
                        std::mem::take(&mut fallback.1).into_iter().collect()
                    },
                    backends: vec![RawBackend {
                        address: address.clone(),
                        zone: None,
                    }],
                    send_proxy_protocol: target
                        .fallback_proxy_protocol
                        .map(|v| v.as_str().to_owned()),
                    forward_connect,
                    ..RawRoute::default()
                },
                // The fallback is set up by the operator: it wins every key it holds.
                (false, "", "", "", ""),
            ));
        }
        fallback.0
    }

    /// A route per Service a server name leads to, with its ready endpoints; the API
    /// server's also with its CONNECT key and PROXY destination. Returns the namespaces
    /// routed, in order.
    fn server_name_routes(
        &mut self,
        sni: ServerNames<'_, 'a>,
        built: &mut Built<'a>,
    ) -> Vec<&'a str> {
        // Keys are sorted: the ports of one Service are neighbours.
        let multi_port: BTreeSet<(&str, &str)> = {
            let keys: Vec<_> = sni.keys().collect();
            keys.windows(2)
                .filter(|w| (w[0].namespace, w[0].service) == (w[1].namespace, w[1].service))
                .map(|w| (w[0].namespace, w[0].service))
                .collect()
        };
        // In order, since the keys are.
        let mut routed_namespaces: Vec<&str> = Vec::new();
        for (key, (hosts, owner)) in sni {
            if routed_namespaces.last() != Some(&key.namespace) {
                routed_namespaces.push(key.namespace);
            }
            let object = || format!("Service {}/{}", key.namespace, key.service);
            let Some(service) = self.index.services.get(&(key.namespace, key.service)) else {
                self.report
                    .skip(Reason::NoService, object(), "the Service does not exist");
                continue;
            };
            let port = match key.port {
                Some(p) => service.ports.iter().find(|sp| u32::from(sp.port) == p),
                None if service.ports.len() == 1 => service.ports.first(),
                None => None,
            };
            let Some(port) = port else {
                let detail = match key.port {
                    Some(p) => format!("the Service has no port {p}"),
                    None => "no destination port, and the Service has several".to_owned(),
                };
                self.report.skip(Reason::NoService, object(), detail);
                continue;
            };
            let backends = self.index.backends(service, &port.name);
            if backends.is_empty() {
                self.report.skip(
                    Reason::NoEndpoints,
                    object(),
                    format!("no ready endpoint for port {}", port.port),
                );
                continue;
            }
            let kube_apiserver = (key.service, port.port) == KUBE_APISERVER;
            let name = shoot_route_name(if kube_apiserver {
                key.namespace.to_owned()
            } else if multi_port.contains(&(key.namespace, key.service)) {
                format!("{}--{}--{}", key.namespace, key.service, port.port)
            } else {
                [key.namespace, "--", key.service].concat()
            });
            let (destinations, proxy_destinations) = if kube_apiserver {
                (
                    vec![connect_key(key.service, key.namespace, port.port)],
                    proxy_destination(service).into_iter().collect(),
                )
            } else {
                (Vec::new(), Vec::new())
            };
            built.push((
                RawRoute {
                    name,
                    sni: hosts.into_iter().map(str::to_owned).collect(),
                    destinations,
                    proxy_destinations,
                    backends,
                    max_connection_duration: self
                        .index
                        .max_connection_duration(key.namespace, key.service),
                    ..RawRoute::default()
                },
                owner.age(),
            ));
        }
        routed_namespaces
    }

    /// A route per `vpn-seed-server[-N]` Service of each routed namespace, port 1194.
    fn vpn_routes(&mut self, routed: &[&'a str], built: &mut Built<'a>) {
        for &ns in routed {
            for &service in self.index.vpn_services(ns) {
                let object = || format!("Service {}", service.meta.key());
                let Some(port) = service.ports.iter().find(|p| p.port == VPN_SEED_SERVER.1) else {
                    self.report
                        .skip(Reason::NoService, object(), "the Service has no port 1194");
                    continue;
                };
                let backends = self.index.backends(service, &port.name);
                if backends.is_empty() {
                    self.report.skip(
                        Reason::NoEndpoints,
                        object(),
                        "no ready endpoint for port 1194",
                    );
                    continue;
                }
                built.push((
                    RawRoute {
                        name: shoot_route_name([ns, "--", &service.meta.name].concat()),
                        destinations: vec![connect_key(&service.meta.name, ns, port.port)],
                        backends,
                        max_connection_duration: self
                            .index
                            .max_connection_duration(ns, &service.meta.name),
                        ..RawRoute::default()
                    },
                    service.meta.age(),
                ));
            }
        }
    }

    /// The shoots' tunnel routes (namespaces being deleted left out), into `routes` in name
    /// order; their files.
    fn tunnel_routes(&mut self, routes: &mut Vec<RawRoute>) -> Files {
        let snapshot = self.snapshot;
        let mut clusters: Vec<&'a Cluster> = Vec::with_capacity(snapshot.clusters.len());
        for cluster in &snapshot.clusters {
            if !self.deleting(&cluster.meta.name) {
                clusters.push(cluster);
            }
        }
        let (tunnels, files) =
            super::tunnel::routes(snapshot, self.target, &clusters, &mut self.report);
        if !tunnels.is_empty() {
            routes.extend(tunnels);
            routes.sort_by(|a, b| a.name.cmp(&b.name));
        }
        files
    }

    /// The target's extra routes, as written, into `routes` in name order. They come first:
    /// a rendered route with an extra route's name is left out, and one holding a server
    /// name, destination or PROXY destination an extra route holds loses that key (each
    /// reported as `conflict`); a rendered route left with no key (and no tunnel or egress)
    /// is dropped, as [`Self::settle_keys`] drops one.
    fn extra_routes(&mut self, routes: &mut Vec<RawRoute>) {
        let extra = &self.target.extra_routes;
        if extra.is_empty() {
            return;
        }
        let names: HashSet<&str> = extra.iter().map(|r| r.name.as_str()).collect();
        let mut server_names: HashMap<String, &str> = HashMap::new();
        let mut destinations: HashMap<&str, &str> = HashMap::new();
        let mut proxy_destinations: HashMap<SocketAddr, &str> = HashMap::new();
        for r in extra {
            for s in &r.sni {
                if let Some(s) = crate::route::normalize_sni_pattern(s) {
                    server_names.insert(s, &r.name);
                }
            }
            for d in &r.destinations {
                destinations.insert(d, &r.name);
            }
            for d in &r.proxy_destinations {
                if let Ok(d) = d.parse() {
                    proxy_destinations.insert(d, &r.name);
                }
            }
        }
        let mut kept: Vec<RawRoute> = Vec::with_capacity(routes.len() + extra.len());
        for mut route in routes.drain(..) {
            let object = || format!("route {}", route.name);
            if names.contains(route.name.as_str()) {
                self.report.skip(
                    Reason::Conflict,
                    object(),
                    "the configuration's extraRoutes has a route of this name",
                );
                continue;
            }
            let keys =
                |r: &RawRoute| r.sni.len() + r.destinations.len() + r.proxy_destinations.len();
            let had = keys(&route);
            let mut lost: Vec<(String, &str)> = Vec::new();
            route.sni.retain(|s| {
                let holder = crate::route::normalize_sni_pattern(s)
                    .and_then(|n| server_names.get(&n).copied());
                holder.map(|h| lost.push((s.clone(), h))).is_none()
            });
            route.destinations.retain(|d| {
                let holder = destinations.get(d.as_str()).copied();
                holder.map(|h| lost.push((d.clone(), h))).is_none()
            });
            route.proxy_destinations.retain(|d| {
                let holder = d
                    .parse::<SocketAddr>()
                    .ok()
                    .and_then(|a| proxy_destinations.get(&a).copied());
                holder.map(|h| lost.push((d.clone(), h))).is_none()
            });
            for (key, holder) in lost {
                self.report.skip(
                    Reason::Conflict,
                    object(),
                    format!(
                        "{key:?} is held by the route {holder} of the configuration's extraRoutes"
                    ),
                );
            }
            let bare = had > 0
                && keys(&route) == 0
                && route.tunnel.is_none()
                && route.egress.is_none()
                && !is_fallback(&route.name);
            if !bare {
                kept.push(route);
            }
        }
        kept.extend(extra.iter().cloned());
        kept.sort_by(|a, b| a.name.cmp(&b.name));
        *routes = kept;
    }

    /// Route names and CONNECT/PROXY keys: the oldest route keeps each, the others lose it
    /// (reported); a route left with no key is dropped. The routes, ordered by name.
    fn settle_keys(&mut self, built: Built<'a>) -> Vec<RawRoute> {
        // Sorted by position: moving the routes themselves costs more than comparing them.
        let mut order: Vec<usize> = (0..built.len()).collect();
        order.sort_by(|&a, &b| {
            (&built[a].1, &built[a].0.name).cmp(&(&built[b].1, &built[b].0.name))
        });
        // Decided on borrowed names and keys; the routes are moved once, in name order.
        let mut names: HashSet<&str> = HashSet::with_capacity(built.len());
        let mut keys: HashMap<&str, &str> = HashMap::with_capacity(2 * built.len());
        let mut kept = Vec::with_capacity(built.len());
        // (route, position in its destinations followed by its PROXY destinations).
        let mut lost: Vec<(usize, usize)> = Vec::new();
        for &i in &order {
            let route = &built[i].0;
            let object = || format!("route {}", route.name);
            if !names.insert(&route.name) {
                self.report.skip(
                    Reason::Conflict,
                    object(),
                    "an older route has the same name",
                );
                continue;
            }
            let mut held = 0;
            let all = route.destinations.iter().chain(&route.proxy_destinations);
            for (position, k) in all.enumerate() {
                match keys.entry(k) {
                    Entry::Occupied(holder) => {
                        self.report.skip(
                            Reason::Conflict,
                            object(),
                            format!("{k:?} is held by the older route {}", holder.get()),
                        );
                        lost.push((i, position));
                    }
                    Entry::Vacant(free) => {
                        free.insert(&route.name);
                        held += 1;
                    }
                }
            }
            if route.sni.is_empty() && held == 0 && !is_fallback(&route.name) {
                // Every key it had went to older routes (already reported).
                continue;
            }
            kept.push(i);
        }
        kept.sort_by(|&a, &b| built[a].0.name.cmp(&built[b].0.name));
        let mut built: Vec<Option<RawRoute>> = built.into_iter().map(|(r, _)| Some(r)).collect();
        // Last first, so that the positions before each are unchanged.
        for (i, position) in lost.into_iter().rev() {
            if let Some(route) = &mut built[i] {
                let n = route.destinations.len();
                if position < n {
                    route.destinations.remove(position);
                } else {
                    route.proxy_destinations.remove(position - n);
                }
            }
        }
        let mut routes: Vec<RawRoute> = Vec::with_capacity(kept.len());
        routes.extend(kept.into_iter().filter_map(|i| built[i].take()));
        routes
    }
}

/// The Istio cluster name a CONNECT client sends.
fn connect_key(service: &str, namespace: &str, port: u16) -> String {
    // `format!("outbound|{port}||{service}.{namespace}.{CLUSTER_DOMAIN}")`, without the
    // formatting machinery (a render writes thousands).
    let mut out = String::with_capacity(
        "outbound|65535||..".len() + service.len() + namespace.len() + CLUSTER_DOMAIN.len(),
    );
    out.push_str("outbound|");
    decimal(&mut out, port);
    out.push_str("||");
    for part in [service, ".", namespace, ".", CLUSTER_DOMAIN] {
        out.push_str(part);
    }
    out
}

/// Writes `n` in decimal.
fn decimal(out: &mut String, n: u16) {
    if n >= 10 {
        decimal(out, n / 10);
    }
    out.push(char::from(b'0' + (n % 10) as u8));
}

/// GEP-08's address for a kube-apiserver Service: its IPv4 ClusterIP, first octet 240.
fn proxy_destination(service: &Service) -> Option<String> {
    let ip = service
        .cluster_ips
        .iter()
        .find_map(|ip| ip.parse::<Ipv4Addr>().ok())?;
    let [_, b, c, d] = ip.octets();
    Some(address_text(SocketAddr::from((
        Ipv4Addr::new(240, b, c, d),
        KUBE_APISERVER.1,
    ))))
}

/// `address.to_string()`, without the formatting machinery for IPv4 (a render writes
/// thousands).
fn address_text(address: SocketAddr) -> String {
    let SocketAddr::V4(v4) = address else {
        return address.to_string();
    };
    let mut out = String::with_capacity(21);
    for (i, octet) in v4.ip().octets().into_iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        decimal(&mut out, octet.into());
    }
    out.push(':');
    decimal(&mut out, v4.port());
    out
}

/// The Service a destination names, relative to the namespace of the object naming it.
fn route_key<'a>(destination: &'a Destination, namespace: &'a str) -> Option<RouteKey<'a>> {
    let (service, namespace) = service_host(&destination.host, namespace)?;
    Some(RouteKey {
        namespace,
        service,
        port: destination.port,
    })
}

/// The (service, namespace) a host names, relative to `namespace`; see [`route_key`].
fn service_host<'h>(host: &'h str, namespace: &'h str) -> Option<(&'h str, &'h str)> {
    let host = host.trim_end_matches('.');
    let (service, namespace) = match host.strip_suffix(CLUSTER_DOMAIN) {
        Some(rest) => rest.strip_suffix('.')?.split_once('.')?,
        None if !host.contains('.') => (host, namespace),
        None => return None,
    };
    if service.is_empty() || namespace.is_empty() || namespace.contains('.') {
        return None;
    }
    Some((service, namespace))
}

/// Server names compare case-insensitively, without a trailing dot; copied only when not
/// already written so.
fn normalize(host: &str) -> Cow<'_, str> {
    let host = host.trim_end_matches('.');
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(host.to_ascii_lowercase())
    } else {
        Cow::Borrowed(host)
    }
}

/// Lookups by namespace and name.
struct Index<'a> {
    services: HashMap<(&'a str, &'a str), &'a Service>,
    /// `vpn-seed-server` and `vpn-seed-server-<N>` per namespace, by name.
    vpn: HashMap<&'a str, Vec<&'a Service>>,
    slices: HashMap<(&'a str, &'a str), Vec<&'a EndpointSlice>>,
    /// The oldest DestinationRule per Service (namespace, name).
    max_duration: HashMap<(&'a str, &'a str), (&'a Meta, Option<std::time::Duration>)>,
}

impl<'a> Index<'a> {
    fn new(snapshot: &'a Snapshot) -> Self {
        // A name given twice: the last one counts.
        let services: HashMap<_, _> = snapshot
            .services
            .iter()
            .map(|s| ((s.meta.namespace.as_str(), s.meta.name.as_str()), s))
            .collect();
        let mut vpn: HashMap<_, Vec<&Service>> = HashMap::with_capacity(snapshot.namespaces.len());
        for (&(namespace, name), &service) in &services {
            let vpn_name = name.strip_prefix(VPN_SEED_SERVER.0).is_some_and(|rest| {
                rest.is_empty()
                    || rest
                        .strip_prefix('-')
                        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            });
            if vpn_name {
                vpn.entry(namespace).or_default().push(service);
            }
        }
        for list in vpn.values_mut() {
            list.sort_unstable_by(|a, b| a.meta.name.cmp(&b.meta.name));
        }
        let mut slices: HashMap<_, Vec<_>> = HashMap::with_capacity(snapshot.services.len());
        for s in &snapshot.endpoint_slices {
            slices
                .entry((s.meta.namespace.as_str(), s.service.as_str()))
                .or_default()
                .push(s);
        }
        let mut max_duration: HashMap<_, (&Meta, _)> =
            HashMap::with_capacity(snapshot.destination_rules.len());
        for dr in &snapshot.destination_rules {
            let Some((service, namespace)) = service_host(&dr.host, &dr.meta.namespace) else {
                continue;
            };
            let entry = max_duration
                .entry((namespace, service))
                .or_insert((&dr.meta, dr.max_connection_duration));
            if dr.meta.age() < entry.0.age() {
                *entry = (&dr.meta, dr.max_connection_duration);
            }
        }
        Index {
            services,
            vpn,
            slices,
            max_duration,
        }
    }

    /// `vpn-seed-server` and `vpn-seed-server-<N>` in `namespace`.
    fn vpn_services(&self, namespace: &str) -> &[&'a Service] {
        self.vpn.get(namespace).map_or(&[], Vec::as_slice)
    }

    /// Every ready endpoint of the Service's port named `port_name`, sorted and unique.
    fn backends(&self, service: &Service, port_name: &str) -> Vec<RawBackend> {
        let key = (service.meta.namespace.as_str(), service.meta.name.as_str());
        // Sorted and deduplicated at the end, the first endpoint of an address keeping it.
        let mut out: Vec<(SocketAddr, &Option<String>)> = Vec::new();
        for slice in self.slices.get(&key).into_iter().flatten() {
            if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
                continue;
            }
            let Some(port) = slice
                .ports
                .iter()
                .find(|(name, _)| name == port_name)
                .and_then(|(_, p)| *p)
            else {
                continue;
            };
            for endpoint in slice.endpoints.iter().filter(|e| e.is_ready()) {
                let Some(ip) = endpoint.address else {
                    continue;
                };
                out.push((SocketAddr::new(ip, port), &endpoint.zone));
            }
        }
        // `SocketAddr`'s order as plain integers: IPv4 first, then address, then port.
        out.sort_by_key(|(address, _)| match address {
            SocketAddr::V4(a) => (false, u128::from(a.ip().to_bits()), a.port()),
            SocketAddr::V6(a) => (true, a.ip().to_bits(), a.port()),
        });
        out.dedup_by_key(|(address, _)| *address);
        out.into_iter()
            .map(|(address, zone)| RawBackend {
                address: address_text(address),
                zone: zone.clone(),
            })
            .collect()
    }

    fn max_connection_duration(&self, namespace: &str, service: &str) -> Option<String> {
        self.max_duration
            .get(&(namespace, service))
            .and_then(|(_, d)| *d)
            .map(crate::config::duration_text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::model::{
        BackendRef, DestinationRule, Endpoint, EnvoyFilter, Namespace, Server, ServicePort,
        TlsRoute, TlsRouteObject, VirtualService,
    };
    use crate::route::ProxyVersion;

    /// The table and report (the files are the tunnel tests' business).
    fn translate(snapshot: &Snapshot, target: &Target) -> (Table, Report) {
        let rendered = super::translate(snapshot, target);
        (rendered.table, rendered.report)
    }

    fn meta(ns: &str, name: &str, created: &str) -> Meta {
        Meta {
            name: name.into(),
            namespace: ns.into(),
            uid: format!("uid-{ns}-{name}"),
            created: Some(created.into()),
        }
    }

    fn default_selector() -> BTreeMap<String, String> {
        crate::config::controller::ControllerConfig::default().selector
    }

    fn target() -> Target {
        Target {
            selector: default_selector(),
            parent_refs: vec![("infra".into(), "public".into())],
            fallback: Some("istio-ingressgateway.istio-ingress.svc.cluster.local:443".into()),
            ..Target::default()
        }
    }

    fn gateway(
        ns: &str,
        name: &str,
        selector: BTreeMap<String, String>,
        protocol: &str,
        mode: &str,
    ) -> Gateway {
        Gateway {
            meta: meta(ns, name, "2024-01-01T00:00:00Z"),
            selector,
            servers: vec![Server {
                port: 443,
                protocol: protocol.into(),
                tls_mode: Some(mode.into()),
                hosts: Vec::new(),
            }],
        }
    }

    fn endpoint(ip: &str, zone: &str) -> Endpoint {
        Endpoint {
            // An FQDN slice's host name projects to none, as the manifest reader does.
            address: ip.parse().ok(),
            ready: Some(true),
            terminating: None,
            zone: Some(zone.into()),
        }
    }

    fn service(ns: &str, name: &str, ip: &str, ports: &[(&str, u16)]) -> Service {
        Service {
            meta: meta(ns, name, "2024-01-01T00:00:00Z"),
            cluster_ips: vec![ip.into()],
            ports: ports
                .iter()
                .map(|(n, p)| ServicePort {
                    name: (*n).into(),
                    port: *p,
                })
                .collect(),
        }
    }

    fn slice(
        ns: &str,
        service: &str,
        family: &str,
        ports: &[(&str, u16)],
        endpoints: Vec<Endpoint>,
    ) -> EndpointSlice {
        EndpointSlice {
            meta: meta(ns, &format!("{service}-{family}"), "2024-01-01T00:00:00Z"),
            service: service.into(),
            address_type: family.into(),
            ports: ports.iter().map(|(n, p)| ((*n).into(), Some(*p))).collect(),
            endpoints,
        }
    }

    /// What gardenlet writes for one shoot with passthrough SNI: Gateway, VirtualService and
    /// DestinationRule `kube-apiserver`, the Services and EndpointSlices.
    fn shoot(s: &mut Snapshot, ns: &str, created: &str, hosts: &[&str], octet: u8) {
        s.namespaces.push(Namespace {
            meta: meta("", ns, created),
            deleting: false,
        });
        s.gateways.push(gateway(
            ns,
            "kube-apiserver",
            default_selector(),
            "TLS",
            "PASSTHROUGH",
        ));
        s.virtual_services.push(VirtualService {
            meta: meta(ns, "kube-apiserver", created),
            gateways: vec!["kube-apiserver".into()],
            tls: vec![TlsRoute {
                sni_hosts: hosts.iter().map(|h| h.to_string()).collect(),
                destinations: vec![Destination {
                    host: format!("kube-apiserver.{ns}.svc.cluster.local"),
                    port: Some(443),
                }],
            }],
            http_destinations: Vec::new(),
        });
        s.destination_rules.push(DestinationRule {
            meta: meta(ns, "kube-apiserver", created),
            host: format!("kube-apiserver.{ns}.svc.cluster.local"),
            max_connection_duration: Some(std::time::Duration::from_secs(86400)),
        });
        s.services.push(service(
            ns,
            "kube-apiserver",
            &format!("10.0.0.{octet}"),
            &[("kube-apiserver", 443)],
        ));
        s.endpoint_slices.push(slice(
            ns,
            "kube-apiserver",
            "IPv4",
            &[("kube-apiserver", 443)],
            vec![
                endpoint(&format!("100.64.{octet}.1"), "a"),
                endpoint(&format!("100.64.{octet}.2"), "b"),
            ],
        ));
        s.services.push(service(
            ns,
            "vpn-seed-server",
            &format!("10.0.1.{octet}"),
            &[("vpn-seed-server", 1194), ("http-proxy", 9443)],
        ));
        s.endpoint_slices.push(slice(
            ns,
            "vpn-seed-server",
            "IPv4",
            &[("http-proxy", 9443), ("vpn-seed-server", 1194)],
            vec![endpoint(&format!("100.64.{octet}.9"), "a")],
        ));
    }

    fn route<'a>(t: &'a Table, name: &str) -> &'a RawRoute {
        t.routes
            .iter()
            .find(|r| r.name == name)
            .unwrap_or_else(|| panic!("no route {name} in {:#?}", t.routes))
    }

    fn names(t: &Table) -> Vec<&str> {
        t.routes.iter().map(|r| r.name.as_str()).collect()
    }

    fn addresses(r: &RawRoute) -> Vec<&str> {
        r.backends.iter().map(|b| b.address.as_str()).collect()
    }

    /// The produced document is a table the gateway loads.
    /// The table as the gateway loads it from the controller's JSON.
    fn loads(t: &Table) -> crate::route::RoutingTable {
        let json = crate::controller::to_json(t);
        crate::config::routes::parse(
            std::path::Path::new("rendered.json"),
            json.as_bytes(),
            &crate::route::BackendRegistry::default(),
        )
        .unwrap_or_else(|e| panic!("{e}\n{json}"))
        .table
    }

    #[test]
    fn a_passthrough_shoot_is_routed_by_sni_and_connect() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.dev.example.com", "API.a.internal.example.com."],
            7,
        );
        let (t, report) = translate(&s, &target());
        loads(&t);
        assert_eq!(
            names(&t),
            [
                "fallback",
                "shoot--dev--a",
                "shoot--dev--a--vpn-seed-server"
            ]
        );
        let r = route(&t, "shoot--dev--a");
        assert_eq!(
            r.sni,
            ["api.a.dev.example.com", "api.a.internal.example.com"]
        );
        assert_eq!(
            r.destinations,
            ["outbound|443||kube-apiserver.shoot--dev--a.svc.cluster.local"]
        );
        assert_eq!(r.proxy_destinations, ["240.0.0.7:443"]);
        assert_eq!(addresses(r), ["100.64.7.1:443", "100.64.7.2:443"]);
        assert_eq!(r.backends[1].zone.as_deref(), Some("b"));
        assert_eq!(r.max_connection_duration.as_deref(), Some("86400s"));
        let vpn = route(&t, "shoot--dev--a--vpn-seed-server");
        assert_eq!(
            vpn.destinations,
            ["outbound|1194||vpn-seed-server.shoot--dev--a.svc.cluster.local"]
        );
        // The port named like the Service's 1194 port, not the slice's first one.
        assert_eq!(addresses(vpn), ["100.64.7.9:1194"]);
        assert!(vpn.sni.is_empty() && vpn.proxy_destinations.is_empty());
        let fallback = route(&t, FALLBACK_ROUTE);
        assert_eq!(
            addresses(fallback),
            ["istio-ingressgateway.istio-ingress.svc.cluster.local:443"]
        );
        assert!(fallback.sni.is_empty() && fallback.destinations.is_empty());
        assert_eq!(report.routes, 3);
        assert_eq!(report.skipped, BTreeMap::new());
        assert_eq!(report.objects["EndpointSlice"], 2);
    }

    /// Extra routes are written as given and come first: a rendered route of the same name
    /// is left out, one holding an extra route's key (a server name written otherwise, a
    /// destination, a PROXY destination) loses it, and one left with no key is dropped;
    /// each counted as a conflict. The table loads.
    #[test]
    fn extra_routes_are_added_as_written_and_keep_their_names_and_keys() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.example.com", "api.a2.example.com"],
            7,
        );
        shoot(
            &mut s,
            "shoot--dev--b",
            "2024-01-02T00:00:00Z",
            &["api.b.example.com"],
            8,
        );
        let extra = |name: &str, sni: &[&str], destinations: &[&str], proxy: &[&str]| RawRoute {
            name: name.into(),
            sni: sni.iter().map(|s| s.to_string()).collect(),
            destinations: destinations.iter().map(|s| s.to_string()).collect(),
            proxy_destinations: proxy.iter().map(|s| s.to_string()).collect(),
            backends: vec![RawBackend {
                address: format!("{name}.trellis-ingress.svc.cluster.local:8443"),
                zone: None,
            }],
            forward_connect: true,
            ..RawRoute::default()
        };
        let with_extra = Target {
            extra_routes: vec![
                extra(
                    "trellis-wireguard-0",
                    &[],
                    &["trellis-wireguard-0:51820"],
                    &[],
                ),
                // Takes a's second name (written otherwise) and its CONNECT key.
                extra(
                    "static-a",
                    &["API.A2.example.com."],
                    &["outbound|443||kube-apiserver.shoot--dev--a.svc.cluster.local"],
                    &[],
                ),
                // b's every key: b's route is left without one.
                extra(
                    "static-b",
                    &["api.b.example.com"],
                    &["outbound|443||kube-apiserver.shoot--dev--b.svc.cluster.local"],
                    &["240.0.0.8:443"],
                ),
                // The name of a's VPN route.
                extra("shoot--dev--a--vpn-seed-server", &[], &["static:1"], &[]),
            ],
            ..target()
        };
        let (t, report) = translate(&s, &with_extra);
        loads(&t);
        assert_eq!(
            names(&t),
            [
                "fallback",
                "shoot--dev--a",
                "shoot--dev--a--vpn-seed-server",
                "shoot--dev--b--vpn-seed-server",
                "static-a",
                "static-b",
                "trellis-wireguard-0",
            ]
        );
        for e in &with_extra.extra_routes {
            assert_eq!(route(&t, &e.name), e, "written as given");
        }
        let a = route(&t, "shoot--dev--a");
        assert_eq!(a.sni, ["api.a.example.com"]);
        assert!(a.destinations.is_empty());
        assert_eq!(a.proxy_destinations, ["240.0.0.7:443"]);
        // a's server name, a's CONNECT key, a's VPN route's name; b's three keys.
        assert_eq!(report.skipped, BTreeMap::from([(Reason::Conflict, 6)]));
        assert_eq!(report.routes, 7);
        // Without extra routes, nothing changes.
        let (plain, report) = translate(&s, &target());
        assert_eq!(names(&plain).len(), 5);
        assert_eq!(report.skipped, BTreeMap::new());
    }

    #[test]
    fn only_gateways_the_target_selects_are_served() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--zonal",
            "2024-01-01T00:00:00Z",
            &["api.zonal.example.com"],
            1,
        );
        shoot(
            &mut s,
            "shoot--dev--exposed",
            "2024-01-01T00:00:00Z",
            &["api.exposed.example.com"],
            2,
        );
        let mut zonal = default_selector();
        zonal.insert("istio".into(), "ingressgateway--zone--eu-1a".into());
        let mut exposed = default_selector();
        exposed.remove("istio");
        exposed.insert("gardener.cloud/role".into(), "exposureclass-handler".into());
        exposed.insert(
            "handler.exposureclass.gardener.cloud/name".into(),
            "internet".into(),
        );
        s.gateways[0].selector = zonal.clone();
        s.gateways[1].selector = exposed.clone();
        let (t, _) = translate(&s, &target());
        assert_eq!(
            names(&t),
            ["fallback"],
            "the default gateway routes neither"
        );
        let (t, _) = translate(
            &s,
            &Target {
                selector: zonal,
                ..target()
            },
        );
        assert_eq!(
            names(&t),
            [
                "fallback",
                "shoot--dev--zonal",
                "shoot--dev--zonal--vpn-seed-server"
            ]
        );
        let (t, _) = translate(
            &s,
            &Target {
                selector: exposed,
                ..target()
            },
        );
        assert_eq!(
            names(&t),
            [
                "fallback",
                "shoot--dev--exposed",
                "shoot--dev--exposed--vpn-seed-server"
            ]
        );
    }

    #[test]
    fn gateways_are_found_by_name_or_namespace_and_name() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.example.com"],
            1,
        );
        s.gateways[0].meta.namespace = "istio-ingress".into();
        let (t, _) = translate(&s, &target());
        assert_eq!(
            names(&t),
            ["fallback"],
            "a bare name is in the VirtualService's namespace"
        );
        s.virtual_services[0].gateways = vec!["istio-ingress/kube-apiserver".into()];
        let (t, _) = translate(&s, &target());
        assert_eq!(route(&t, "shoot--dev--a").sni, ["api.a.example.com"]);
    }

    #[test]
    fn only_passthrough_servers_route_by_sni() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.example.com"],
            1,
        );
        s.gateways[0].servers[0].tls_mode = Some("SIMPLE".into());
        let (t, _) = translate(&s, &target());
        assert_eq!(names(&t), ["fallback"]);
    }

    #[test]
    fn only_ready_endpoints_are_backends_ipv4_and_ipv6() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.example.com"],
            1,
        );
        let eps = &mut s.endpoint_slices[0].endpoints;
        eps[0].ready = Some(false); // not ready: out
        eps[1].ready = None; // absent: ready
        eps.push(Endpoint {
            terminating: Some(true), // terminating: out, even if ready
            ..endpoint("100.64.1.3", "a")
        });
        s.endpoint_slices.push(slice(
            "shoot--dev--a",
            "kube-apiserver",
            "IPv6",
            &[("kube-apiserver", 443)],
            vec![
                endpoint("fd00::2", "b"),
                Endpoint {
                    ready: Some(false),
                    ..endpoint("fd00::1", "a")
                },
            ],
        ));
        s.endpoint_slices.push(slice(
            "shoot--dev--a",
            "kube-apiserver",
            "FQDN",
            &[("kube-apiserver", 443)],
            vec![endpoint("api.example.com", "b")],
        ));
        let (t, _) = translate(&s, &target());
        loads(&t);
        assert_eq!(
            addresses(route(&t, "shoot--dev--a")),
            ["100.64.1.2:443", "[fd00::2]:443"]
        );
    }

    #[test]
    fn backends_are_in_address_order_ipv4_first_each_address_once() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.example.com"],
            1,
        );
        // `::1` is a smaller number than any IPv4 address; 10 sorts before 9 as text.
        s.endpoint_slices[0].endpoints = vec![
            endpoint("100.64.1.10", "a"),
            endpoint("100.64.1.9", "b"),
            endpoint("100.64.1.10", "c"),
        ];
        s.endpoint_slices.push(slice(
            "shoot--dev--a",
            "kube-apiserver",
            "IPv6",
            &[("kube-apiserver", 443)],
            vec![endpoint("::1", "a")],
        ));
        let (t, _) = translate(&s, &target());
        let backends = &route(&t, "shoot--dev--a").backends;
        let found: Vec<_> = backends
            .iter()
            .map(|b| (b.address.as_str(), b.zone.as_deref()))
            .collect();
        assert_eq!(
            found,
            [
                ("100.64.1.9:443", Some("b")),
                ("100.64.1.10:443", Some("a")),
                ("[::1]:443", Some("a")),
            ]
        );
    }

    #[test]
    fn a_server_name_written_several_ways_is_listed_once() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &[
                "api.a.example.com",
                "API.a.example.com.",
                "z.a.example.com",
                "api.a.example.com",
            ],
            1,
        );
        let (t, report) = translate(&s, &target());
        assert_eq!(
            route(&t, "shoot--dev--a").sni,
            ["api.a.example.com", "z.a.example.com"]
        );
        assert_eq!(report.skipped, BTreeMap::new());
    }

    #[test]
    fn a_route_without_ready_endpoints_is_left_out_and_counted() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.example.com"],
            1,
        );
        for e in &mut s.endpoint_slices[0].endpoints {
            e.ready = Some(false);
        }
        let (t, report) = translate(&s, &target());
        loads(&t);
        assert_eq!(names(&t), ["fallback", "shoot--dev--a--vpn-seed-server"]);
        assert_eq!(report.skipped, BTreeMap::from([(Reason::NoEndpoints, 1)]));
        assert_eq!(
            report.skips[0].object,
            "Service shoot--dev--a/kube-apiserver"
        );
    }

    #[test]
    fn ha_vpn_servers_each_get_a_route() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.example.com"],
            1,
        );
        s.services.retain(|svc| svc.meta.name != "vpn-seed-server");
        s.endpoint_slices.retain(|e| e.service != "vpn-seed-server");
        for (i, name) in [
            "vpn-seed-server-0",
            "vpn-seed-server-1",
            "vpn-seed-server-x",
            "vpn-seed-server-",
        ]
        .iter()
        .enumerate()
        {
            s.services.push(service(
                "shoot--dev--a",
                name,
                "10.0.2.1",
                &[("vpn-seed-server", 1194)],
            ));
            s.endpoint_slices.push(slice(
                "shoot--dev--a",
                name,
                "IPv4",
                &[("vpn-seed-server", 1194)],
                vec![endpoint(&format!("100.64.9.{i}"), "a")],
            ));
        }
        let (t, _) = translate(&s, &target());
        loads(&t);
        assert_eq!(
            names(&t),
            [
                "fallback",
                "shoot--dev--a",
                "shoot--dev--a--vpn-seed-server-0",
                "shoot--dev--a--vpn-seed-server-1"
            ]
        );
        assert_eq!(
            route(&t, "shoot--dev--a--vpn-seed-server-1").destinations,
            ["outbound|1194||vpn-seed-server-1.shoot--dev--a.svc.cluster.local"]
        );
        assert_eq!(
            addresses(route(&t, "shoot--dev--a--vpn-seed-server-1")),
            ["100.64.9.1:1194"]
        );
    }

    /// An L7 shoot: Gateway HTTPS/OPTIONAL_MUTUAL, VirtualService with `http:` routes, and the
    /// EnvoyFilter `<ns>-istio-tls-termination` in the gateway's namespace.
    fn l7(s: &mut Snapshot, ns: &str, octet: u8, by_filter: bool, by_gateway: bool) {
        shoot(
            s,
            ns,
            "2024-01-01T00:00:00Z",
            &[&format!("api.{octet}.example.com")],
            octet,
        );
        let vs = s
            .virtual_services
            .iter_mut()
            .find(|v| v.meta.namespace == ns)
            .unwrap();
        if by_gateway {
            let gw = s
                .gateways
                .iter_mut()
                .find(|g| g.meta.namespace == ns)
                .unwrap();
            *gw = gateway(
                ns,
                "kube-apiserver",
                default_selector(),
                "HTTPS",
                "OPTIONAL_MUTUAL",
            );
            // Gardener's connection-upgrade route comes first.
            vs.http_destinations = vec![Destination {
                host: format!("kube-apiserver-connection-upgrade.{ns}.svc.cluster.local"),
                port: Some(443),
            }];
            vs.http_destinations
                .extend(std::mem::take(&mut vs.tls)[0].destinations.clone());
        }
        if by_filter {
            s.envoy_filters.push(EnvoyFilter {
                meta: meta(
                    "istio-ingress",
                    &format!("{ns}-istio-tls-termination"),
                    "2024-01-01T00:00:00Z",
                ),
                ..EnvoyFilter::default()
            });
        }
    }

    #[test]
    fn l7_shoots_fall_through_to_the_fallback() {
        for (by_filter, by_gateway) in [(true, true), (true, false), (false, true)] {
            let mut s = Snapshot::default();
            l7(&mut s, "shoot--dev--l7", 3, by_filter, by_gateway);
            shoot(
                &mut s,
                "shoot--dev--a",
                "2024-01-01T00:00:00Z",
                &["api.a.example.com"],
                1,
            );
            let with_connect = Target {
                fallback_connect: Some("envoy:8443".into()),
                fallback_connect_legacy: Some("envoy:8132".into()),
                fallback_proxy_protocol: Some(ProxyVersion::V2),
                ..target()
            };
            let (t, report) = translate(&s, &with_connect);
            let loaded = loads(&t);
            let case = format!("filter {by_filter}, gateway {by_gateway}");
            assert_eq!(
                names(&t),
                [
                    "fallback",
                    "fallback-connect",
                    "fallback-connect-legacy",
                    "shoot--dev--a",
                    "shoot--dev--a--vpn-seed-server"
                ],
                "{case}"
            );
            // The L7 shoot's CONNECT keys are held by no route: the CONNECT listeners'
            // default routes forward them to Envoy.
            for key in [
                "outbound|1194||vpn-seed-server.shoot--dev--l7.svc.cluster.local",
                "outbound|443||kube-apiserver.shoot--dev--l7.svc.cluster.local",
            ] {
                assert!(loaded.by_destination(key).is_none(), "{case}: {key}");
            }
            let fallback = route(&t, FALLBACK_ROUTE);
            assert!(fallback.destinations.is_empty(), "{case}");
            assert_eq!(fallback.proxy_destinations, ["240.0.0.3:443"], "{case}");
            let sends = |name: &str| {
                loaded
                    .by_name(name)
                    .map(|r| (r.send_proxy_protocol, r.forward_connect))
            };
            let v2 = Some(ProxyVersion::V2);
            assert_eq!(sends(FALLBACK_ROUTE), Some((v2, false)), "{case}");
            assert_eq!(sends(FALLBACK_CONNECT_ROUTE), Some((v2, true)), "{case}");
            assert_eq!(
                sends(FALLBACK_CONNECT_LEGACY_ROUTE),
                Some((v2, true)),
                "{case}"
            );
            assert_eq!(sends("shoot--dev--a"), Some((None, false)), "{case}");
            let addresses = |name| route(&t, name).backends[0].address.clone();
            assert_eq!(addresses(FALLBACK_CONNECT_ROUTE), "envoy:8443");
            assert_eq!(addresses(FALLBACK_CONNECT_LEGACY_ROUTE), "envoy:8132");
            assert_eq!(report.skipped, BTreeMap::from([(Reason::L7, 1)]), "{case}");
            // Without a CONNECT fallback the keys are not routed either.
            let (t, _) = translate(&s, &target());
            assert_eq!(
                names(&t),
                [
                    "fallback",
                    "shoot--dev--a",
                    "shoot--dev--a--vpn-seed-server"
                ],
                "{case}"
            );
            assert!(route(&t, FALLBACK_ROUTE).destinations.is_empty(), "{case}");
            // Without a fallback, nothing of it is routed.
            let (t, report) = translate(
                &s,
                &Target {
                    fallback: None,
                    ..target()
                },
            );
            loads(&t);
            assert_eq!(
                names(&t),
                ["shoot--dev--a", "shoot--dev--a--vpn-seed-server"],
                "{case}"
            );
            assert_eq!(report.skipped, BTreeMap::from([(Reason::L7, 1)]), "{case}");
        }
    }

    #[test]
    fn an_l7_filter_for_a_shoot_on_another_gateway_is_not_counted_here() {
        let mut s = Snapshot::default();
        l7(&mut s, "shoot--dev--l7", 3, true, false);
        let mut zonal = default_selector();
        zonal.insert("istio".into(), "ingressgateway--zone--eu-1a".into());
        s.gateways[0].selector = zonal;
        let (t, report) = translate(&s, &target());
        assert_eq!(names(&t), ["fallback"]);
        assert!(route(&t, FALLBACK_ROUTE).destinations.is_empty());
        assert_eq!(report.skipped, BTreeMap::new());
    }

    #[test]
    fn https_hosts_that_are_not_shoot_api_servers_are_ignored() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.example.com"],
            1,
        );
        // Plutono in the shoot namespace, the seed's API server ingress in garden.
        for (ns, name, host) in [
            (
                "shoot--dev--a",
                "plutono",
                "plutono.shoot--dev--a.svc.cluster.local",
            ),
            (
                "garden",
                "kube-apiserver-ingress",
                "kubernetes.default.svc.cluster.local",
            ),
        ] {
            s.gateways
                .push(gateway(ns, name, default_selector(), "HTTPS", "SIMPLE"));
            s.virtual_services.push(VirtualService {
                meta: meta(ns, name, "2024-01-01T00:00:00Z"),
                gateways: vec![name.into()],
                tls: Vec::new(),
                http_destinations: vec![Destination {
                    host: host.into(),
                    port: Some(443),
                }],
            });
        }
        let (t, report) = translate(&s, &target());
        loads(&t);
        assert_eq!(
            names(&t),
            [
                "fallback",
                "shoot--dev--a",
                "shoot--dev--a--vpn-seed-server"
            ]
        );
        assert!(
            route(&t, FALLBACK_ROUTE).destinations.is_empty(),
            "shoot--dev--a is not L7"
        );
        assert_eq!(report.skipped, BTreeMap::from([(Reason::Https, 2)]));
    }

    #[test]
    fn the_oldest_claim_of_a_server_name_wins() {
        for reversed in [false, true] {
            let mut s = Snapshot::default();
            shoot(
                &mut s,
                "shoot--dev--new",
                "2024-02-01T00:00:00Z",
                &["api.shared.example.com", "api.new.example.com"],
                1,
            );
            shoot(
                &mut s,
                "shoot--dev--old",
                "2024-01-01T00:00:00Z",
                &["API.shared.example.com"],
                2,
            );
            if reversed {
                s.virtual_services.reverse();
            }
            let (t, report) = translate(&s, &target());
            loads(&t);
            assert_eq!(route(&t, "shoot--dev--old").sni, ["api.shared.example.com"]);
            assert_eq!(route(&t, "shoot--dev--new").sni, ["api.new.example.com"]);
            assert_eq!(report.skipped, BTreeMap::from([(Reason::Conflict, 1)]));
            assert_eq!(
                report.skips[0].object,
                "VirtualService shoot--dev--new/kube-apiserver"
            );
        }
        // Same creation time: namespace, then name, decides.
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--b",
            "2024-01-01T00:00:00Z",
            &["api.shared.example.com"],
            1,
        );
        shoot(
            &mut s,
            "shoot--a",
            "2024-01-01T00:00:00Z",
            &["api.shared.example.com"],
            2,
        );
        let (t, _) = translate(&s, &target());
        loads(&t);
        assert_eq!(route(&t, "shoot--a").sni, ["api.shared.example.com"]);
        // The loser keeps its CONNECT keys.
        let b = route(&t, "shoot--b");
        assert!(b.sni.is_empty());
        assert_eq!(
            b.destinations,
            ["outbound|443||kube-apiserver.shoot--b.svc.cluster.local"]
        );
        route(&t, "shoot--b--vpn-seed-server");
    }

    #[test]
    fn an_older_tls_route_keeps_its_name_against_a_younger_virtual_service() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-02-01T00:00:00Z",
            &["api.a.example.com", "web.apps.example.com"],
            1,
        );
        s.services
            .push(service("apps", "web", "10.0.3.1", &[("https", 8443)]));
        s.endpoint_slices.push(slice(
            "apps",
            "web",
            "IPv4",
            &[("https", 8443)],
            vec![endpoint("100.64.3.1", "a")],
        ));
        s.tls_routes.push(TlsRouteObject {
            meta: meta("apps", "web", "2024-01-01T00:00:00Z"),
            hostnames: vec!["web.apps.example.com".into()],
            parents: vec![("infra".into(), "public".into())],
            backends: vec![BackendRef {
                other_kind: String::new(),
                name: "web".into(),
                namespace: "apps".into(),
                port: Some(8443),
            }],
        });
        let (t, report) = translate(&s, &target());
        loads(&t);
        assert_eq!(route(&t, "apps--web").sni, ["web.apps.example.com"]);
        assert_eq!(route(&t, "shoot--dev--a").sni, ["api.a.example.com"]);
        assert_eq!(report.skipped, BTreeMap::from([(Reason::Conflict, 1)]));
    }

    #[test]
    fn a_virtual_service_in_a_namespace_being_deleted_is_skipped() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.example.com"],
            1,
        );
        // A second VirtualService, in a namespace being deleted, for a's API server.
        let mut vs = s.virtual_services[0].clone();
        vs.meta = meta("leaving", "kube-apiserver", "2023-01-01T00:00:00Z");
        vs.gateways = vec!["shoot--dev--a/kube-apiserver".into()];
        vs.tls[0].sni_hosts = vec!["api.leaving.example.com".into()];
        s.virtual_services.push(vs);
        s.namespaces.push(Namespace {
            meta: meta("", "leaving", "2023-01-01T00:00:00Z"),
            deleting: true,
        });
        let (t, report) = translate(&s, &target());
        assert_eq!(route(&t, "shoot--dev--a").sni, ["api.a.example.com"]);
        assert_eq!(
            report.skipped,
            BTreeMap::from([(Reason::NamespaceDeleting, 1)])
        );
    }

    #[test]
    fn a_proxy_destination_two_services_share_goes_to_the_older() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.example.com"],
            1,
        );
        shoot(
            &mut s,
            "shoot--dev--b",
            "2024-02-01T00:00:00Z",
            &["api.b.example.com"],
            2,
        );
        // 10.0.0.1 and 100.0.0.1 both become 240.0.0.1.
        s.services
            .iter_mut()
            .find(|x| x.meta.namespace == "shoot--dev--b" && x.meta.name == "kube-apiserver")
            .unwrap()
            .cluster_ips = vec!["100.0.0.1".into()];
        let (t, report) = translate(&s, &target());
        loads(&t);
        assert_eq!(
            route(&t, "shoot--dev--a").proxy_destinations,
            ["240.0.0.1:443"]
        );
        assert!(route(&t, "shoot--dev--b").proxy_destinations.is_empty());
        assert_eq!(report.skipped, BTreeMap::from([(Reason::Conflict, 1)]));
    }

    /// A route is as old as the oldest object claiming a name for it (here b's wildcard
    /// VirtualService, whose name sorts last).
    #[test]
    fn a_route_is_as_old_as_its_oldest_claim() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-15T00:00:00Z",
            &["api.a.example.com"],
            1,
        );
        shoot(
            &mut s,
            "shoot--dev--b",
            "2024-02-01T00:00:00Z",
            &["api.b.example.com"],
            2,
        );
        let mut wildcard = s.virtual_services[1].clone();
        wildcard.meta = meta(
            "shoot--dev--b",
            "kube-apiserver-wildcard",
            "2024-01-01T00:00:00Z",
        );
        wildcard.tls[0].sni_hosts = vec!["z.b.example.com".into()];
        s.virtual_services.push(wildcard);
        s.services
            .iter_mut()
            .find(|x| x.meta.namespace == "shoot--dev--a" && x.meta.name == "kube-apiserver")
            .unwrap()
            .cluster_ips = vec!["100.0.0.2".into()];
        let (t, _) = translate(&s, &target());
        assert_eq!(
            route(&t, "shoot--dev--b").sni,
            ["api.b.example.com", "z.b.example.com"]
        );
        assert_eq!(
            route(&t, "shoot--dev--b").proxy_destinations,
            ["240.0.0.2:443"]
        );
        assert!(route(&t, "shoot--dev--a").proxy_destinations.is_empty());
    }

    #[test]
    fn namespaces_being_deleted_are_skipped() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--gone",
            "2024-01-01T00:00:00Z",
            &["api.gone.example.com"],
            1,
        );
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.example.com"],
            2,
        );
        s.namespaces[0].deleting = true;
        let (t, report) = translate(&s, &target());
        assert_eq!(
            names(&t),
            [
                "fallback",
                "shoot--dev--a",
                "shoot--dev--a--vpn-seed-server"
            ]
        );
        assert_eq!(
            report.skipped,
            BTreeMap::from([(Reason::NamespaceDeleting, 1)])
        );
    }

    #[test]
    fn the_destination_rule_of_the_host_sets_the_maximum_duration() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.example.com"],
            1,
        );
        shoot(
            &mut s,
            "shoot--dev--b",
            "2024-01-01T00:00:00Z",
            &["api.b.example.com"],
            2,
        );
        // A short host is relative to the rule's namespace; b's rule is for another host.
        s.destination_rules[0].host = "kube-apiserver".into();
        s.destination_rules[0].max_connection_duration = Some(std::time::Duration::from_secs(3600));
        s.destination_rules[1].host = "kube-apiserver-mtls.shoot--dev--b.svc.cluster.local".into();
        let (t, _) = translate(&s, &target());
        assert_eq!(
            route(&t, "shoot--dev--a")
                .max_connection_duration
                .as_deref(),
            Some("3600s")
        );
        assert_eq!(route(&t, "shoot--dev--b").max_connection_duration, None);
    }

    #[test]
    fn tls_routes_of_the_targets_parents_are_routed() {
        let mut s = Snapshot::default();
        s.services.push(service(
            "apps",
            "web",
            "10.0.3.1",
            &[("https", 8443), ("http", 80)],
        ));
        s.endpoint_slices.push(slice(
            "apps",
            "web",
            "IPv4",
            &[("http", 8080), ("https", 8443)],
            vec![endpoint("100.64.3.1", "a")],
        ));
        for (name, parent, backend_ns) in [
            ("web", "public", "apps"),
            ("private", "internal", "apps"),
            ("cross", "public", "other"),
        ] {
            s.tls_routes.push(TlsRouteObject {
                meta: meta("apps", name, "2024-01-01T00:00:00Z"),
                hostnames: vec![format!("{name}.apps.example.com")],
                parents: vec![("infra".into(), parent.into())],
                backends: vec![BackendRef {
                    other_kind: String::new(),
                    name: "web".into(),
                    namespace: backend_ns.into(),
                    port: Some(8443),
                }],
            });
        }
        let (t, report) = translate(&s, &target());
        loads(&t);
        assert_eq!(names(&t), ["apps--web", "fallback"]);
        let r = route(&t, "apps--web");
        assert_eq!(r.sni, ["web.apps.example.com"]);
        assert_eq!(addresses(r), ["100.64.3.1:8443"]);
        assert!(r.destinations.is_empty() && r.proxy_destinations.is_empty());
        assert_eq!(report.skipped, BTreeMap::from([(Reason::Unsupported, 1)]));
    }

    #[test]
    fn the_output_does_not_depend_on_input_order() {
        let mut s = Snapshot::default();
        shoot(
            &mut s,
            "shoot--dev--b",
            "2024-01-01T00:00:00Z",
            &["api.b.example.com", "*.b.example.com"],
            2,
        );
        shoot(
            &mut s,
            "shoot--dev--a",
            "2024-01-01T00:00:00Z",
            &["api.a.example.com", "api.b.example.com"],
            1,
        );
        let (first, _) = translate(&s, &target());
        s.virtual_services.reverse();
        s.services.reverse();
        s.endpoint_slices.reverse();
        s.gateways.reverse();
        for e in &mut s.endpoint_slices {
            e.endpoints.reverse();
        }
        let (second, _) = translate(&s, &target());
        assert_eq!(
            crate::controller::to_json(&first),
            crate::controller::to_json(&second)
        );
    }

    #[test]
    fn connect_keys_are_written_as_format_writes_them() {
        for port in [0, 7, 443, 1194, 65535] {
            assert_eq!(
                connect_key("vpn-seed-server-0", "shoot--dev--a", port),
                format!("outbound|{port}||vpn-seed-server-0.shoot--dev--a.svc.cluster.local")
            );
        }
    }

    #[test]
    fn addresses_are_written_as_std_writes_them() {
        for ip in [
            "0.0.0.0",
            "1.2.3.4",
            "10.0.100.255",
            "255.255.255.255",
            "::1",
            "fd00::a:1",
        ] {
            for port in [0, 1, 9, 10, 99, 443, 1194, 9443, 65535] {
                let address = SocketAddr::new(ip.parse().unwrap(), port);
                assert_eq!(address_text(address), address.to_string());
            }
        }
    }
}
