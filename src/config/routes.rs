//! `kind: RoutingTable` files: raw schema and conversion into a [`RoutingTable`].

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;

use super::decode::{Kind, Raw};
use super::{ConfigError, Errors, at};
use crate::route::{
    Backend, BackendAddress, BackendRegistry, Egress, Net, NetSet, ProxyVersion, Route,
    RouteTimeouts, RoutingTable, SourceRanges, Via,
};

mapping_only!(
    RawRoutingTable,
    RawRoute,
    RawBackend,
    RawRouteTimeouts,
    RawEgress
);

/// The `kind` of routing table files.
pub const KIND: &str = "RoutingTable";

/// Longest route name (it ends up in metric labels).
pub const MAX_ROUTE_NAME: usize = 253;

/// A routing table file as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawRoutingTable {
    /// Always `trellis.gardener.cloud/v1alpha1`.
    pub api_version: String,
    /// Always `RoutingTable`.
    pub kind: String,
    /// The routes; names and keys must be unique.
    #[serde(default)]
    pub routes: Vec<RawRoute>,
}

/// One route as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawRoute {
    /// Unique name, used in metrics and logs.
    pub name: String,
    /// TLS server names: exact, or `*.` followed by a suffix.
    #[serde(default)]
    pub sni: Vec<String>,
    /// Values of the CONNECT destination header.
    #[serde(default)]
    pub destinations: Vec<String>,
    /// Original destinations (`IP:port`) carried in a PROXY header.
    #[serde(default)]
    pub proxy_destinations: Vec<String>,
    /// Where connections go.
    #[serde(default)]
    pub backends: Vec<RawBackend>,
    /// Per-route timeout overrides.
    #[serde(default)]
    pub timeouts: Option<RawRouteTimeouts>,
    /// Close connections after this long (e.g. `24h`).
    #[serde(default)]
    pub max_connection_duration: Option<String>,
    /// Admit only clients in these networks (`IP/prefix` or a bare IP): the PROXY source
    /// when a trusted load balancer sent one, else the peer. Left out: every client. An
    /// empty list is an error (it would admit nobody).
    #[serde(default)]
    pub allowed_source_ranges: Option<Vec<String>>,
    /// Start every backend connection with a PROXY header of this version (`v1` or `v2`):
    /// source the client address routes admit by, destination the address the client
    /// reached (a received PROXY header's destination, else the listener's). Left out: none.
    #[serde(default)]
    pub send_proxy_protocol: Option<String>,
    /// The backends are CONNECT proxies: on `http-connect` listeners the request head is
    /// sent to them as received and they answer it (accepted, and ignored, elsewhere).
    #[serde(default)]
    pub forward_connect: bool,
    /// kube-apiserver egress on `egress-connect` listeners: which connections belong to this
    /// route and where their CONNECTs may go. A route with `egress` needs no backends.
    #[serde(default)]
    pub egress: Option<RawEgress>,
}

/// A route's `egress` as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawEgress {
    /// Client certificates (leaf CN or a DNS SAN) that select this route after a handshake
    /// with the listener's `tls`; with `serverNames` or `clientSources`, the leaf must carry
    /// one of them as well.
    #[serde(default)]
    pub client_identities: Vec<String>,
    /// TLS server names (exact) that select this route before the handshake.
    #[serde(default)]
    pub server_names: Vec<String>,
    /// Client addresses (`IP/prefix` or a bare IP) that select this route before the
    /// handshake, when no route claims the server name.
    #[serde(default)]
    pub client_sources: Vec<String>,
    /// This route's own server certificate and the one client CA it accepts (for a route
    /// selected before the handshake). Left out: the listener's.
    #[serde(default)]
    pub tls: Option<super::tls::RawTls>,
    /// Networks a CONNECT may reach through the shoot's tunnel (or directly, `via: direct`).
    #[serde(default)]
    pub allowed_networks: Vec<String>,
    /// Networks a CONNECT may reach from the gateway's own network.
    #[serde(default)]
    pub direct_networks: Vec<String>,
    /// How `allowedNetworks` are dialed: `tunnel` (default) or `direct`.
    #[serde(default)]
    pub via: Option<String>,
}

/// One backend as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawBackend {
    /// `IP:port` or `DNS-name:port` (resolved at connect time).
    pub address: String,
    /// Availability zone, for zone-preferring backend choice.
    #[serde(default)]
    pub zone: Option<String>,
}

/// Per-route timeout overrides as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawRouteTimeouts {
    /// Connect budget for this route (failover included).
    #[serde(default)]
    pub connect: Option<String>,
    /// Idle timeout for this route's connections.
    #[serde(default)]
    pub idle: Option<String>,
}

/// A validated table and the hash of the file it was built from.
#[derive(Debug)]
pub struct LoadedTable {
    /// The indexed table (also what `/routes` shows: no second copy of the file is kept).
    pub table: RoutingTable,
    /// FNV-1a 64 hash of the file bytes, hex.
    pub hash: String,
}

/// FNV-1a, 64 bit: a stable content hash for "has the table changed" and `/routes`.
pub fn content_hash(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Reads, parses and validates a routing table file.
pub fn load(file: &Path, registry: &BackendRegistry) -> Result<LoadedTable, ConfigError> {
    let bytes = super::read_file(file)?;
    parse(file, &bytes, registry)
}

/// Parses and validates routing table bytes read from `file`.
pub fn parse(
    file: &Path,
    bytes: &[u8],
    registry: &BackendRegistry,
) -> Result<LoadedTable, ConfigError> {
    parse_hashed(file, bytes, content_hash(bytes), registry)
}

/// [`parse`] for a caller that has already hashed the bytes with [`content_hash`].
pub fn parse_hashed(
    file: &Path,
    bytes: &[u8],
    hash: String,
    registry: &BackendRegistry,
) -> Result<LoadedTable, ConfigError> {
    match super::decode::decode(file, bytes)? {
        (Raw::Routes(raw), errors) => validate(file, raw, errors, hash, registry),
        (other, _) => Err(super::decode::wrong_kind(
            file,
            other.kind(),
            Kind::Routes,
            "routes.file of 'trellis gateway'",
        )),
    }
}

/// Validates a decoded table; `errors` already holds the unknown fields.
pub(super) fn validate(
    file: &Path,
    raw: RawRoutingTable,
    mut errors: Errors,
    hash: String,
    registry: &BackendRegistry,
) -> Result<LoadedTable, ConfigError> {
    super::check_api_version(&mut errors, &raw.api_version);
    // The routes copy what they keep, and the decoded file is freed only after the last
    // one is built: the table's allocations then sit together instead of in the holes each
    // freed raw route would leave, so the previous generation's memory can be given back
    // whole after a reload.
    let mut zones = HashSet::new();
    let dir = file.parent().unwrap_or(Path::new("."));
    let (indexes, routes): (Vec<usize>, Vec<Route>) = raw
        .routes
        .iter()
        .enumerate()
        .filter_map(|(i, r)| {
            validate_route(RoutePath(i), r, dir, registry, &mut zones, &mut errors).map(|r| (i, r))
        })
        .unzip();
    // Indexed even when other errors were found, so that keys claimed twice are reported
    // with them; conflicts count routes as the file does, also when one was left out.
    let table = match RoutingTable::new(routes) {
        Ok(t) => t,
        Err(conflicts) => {
            for c in conflicts {
                errors.push(
                    format!("routes[{}]", indexes[c.second_index]),
                    format!("{c} (routes[{}])", indexes[c.first_index]),
                );
            }
            RoutingTable::default()
        }
    };
    errors.finish(file, LoadedTable { table, hash })
}

/// `routes[i]`, formatted only when an error needs it.
#[derive(Clone, Copy)]
struct RoutePath(usize);

impl std::fmt::Display for RoutePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "routes[{}]", self.0)
    }
}

/// The route, unless it is too large to build (every other problem is only recorded in
/// `errors`: the table is not built then). `zones` holds one shared string per zone.
fn validate_route(
    path: RoutePath,
    raw: &RawRoute,
    dir: &Path,
    registry: &BackendRegistry,
    zones: &mut HashSet<Arc<str>>,
    errors: &mut Errors,
) -> Option<Route> {
    let name_ok = !raw.name.is_empty()
        && raw.name.len() <= MAX_ROUTE_NAME
        && raw
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !name_ok {
        errors.push(
            at(path, "name"),
            format!(
                "invalid route name {:?} (letters, digits, '-', '_', '.'; 1-253)",
                raw.name
            ),
        );
    }
    let sni: Vec<String> = raw
        .sni
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let n = crate::route::normalize_sni_pattern(s);
            if n.is_none() {
                errors.push(
                    format!("{path}.sni[{i}]"),
                    format!("invalid server name {s:?} (a DNS name or \"*.\" + suffix)"),
                );
            }
            n
        })
        .collect();
    for (i, d) in raw.destinations.iter().enumerate() {
        if d.is_empty() || d.len() > 1024 || d.bytes().any(|b| b.is_ascii_control() || b == b' ') {
            errors.push(
                format!("{path}.destinations[{i}]"),
                format!("invalid destination {d:?}"),
            );
        }
    }
    let proxy_destinations = raw
        .proxy_destinations
        .iter()
        .enumerate()
        .filter_map(|(i, d)| {
            d.parse::<SocketAddr>()
                .map_err(|_| {
                    errors.push(
                        format!("{path}.proxyDestinations[{i}]"),
                        format!("expected IP:port, got {d:?}"),
                    )
                })
                .ok()
        })
        .collect();
    if raw.backends.is_empty() && raw.egress.is_none() {
        errors.push(
            at(path, "backends"),
            "at least one backend is required (a route without backends needs egress)",
        );
    }
    let egress = raw
        .egress
        .as_ref()
        .and_then(|e| egress(path, e, dir, errors))
        .map(Box::new);
    let backends = raw
        .backends
        .iter()
        .enumerate()
        .filter_map(|(i, b)| match BackendAddress::parse(&b.address) {
            Ok(address) => Some(Backend {
                state: registry.state(&address),
                address,
                zone: b.zone.as_deref().map(|z| intern(zones, z)),
            }),
            Err(e) => {
                errors.push(
                    format!("{path}.backends[{i}].address"),
                    format!("{e}: {:?}", b.address),
                );
                None
            }
        })
        .collect();
    let timeouts = match &raw.timeouts {
        Some(t) => RouteTimeouts {
            connect: t
                .connect
                .as_deref()
                .and_then(|v| positive(errors, &format!("{path}.timeouts.connect"), v)),
            idle: t
                .idle
                .as_deref()
                .and_then(|v| positive(errors, &format!("{path}.timeouts.idle"), v)),
        },
        None => RouteTimeouts::default(),
    };
    let max_connection_duration = raw
        .max_connection_duration
        .as_deref()
        .and_then(|v| positive(errors, &at(path, "maxConnectionDuration"), v));
    let allowed_sources = raw
        .allowed_source_ranges
        .as_deref()
        .and_then(|list| source_ranges(path, list, errors));
    let send_proxy_protocol = raw.send_proxy_protocol.as_deref().and_then(|v| {
        let version = ProxyVersion::parse(v);
        if version.is_none() {
            errors.push(
                at(path, "sendProxyProtocol"),
                format!("expected v1 or v2, got {v:?}"),
            );
        }
        version
    });
    match Route::new(
        &raw.name,
        &sni,
        &raw.destinations,
        proxy_destinations,
        backends,
    ) {
        Ok(mut route) => {
            route.timeouts = timeouts;
            route.max_connection_duration = max_connection_duration;
            route.allowed_sources = allowed_sources;
            route.send_proxy_protocol = send_proxy_protocol;
            route.forward_connect = raw.forward_connect;
            route.egress = egress;
            Some(route)
        }
        Err(e) => {
            errors.push(path.to_string(), e.to_string());
            None
        }
    }
}

/// A route's `egress`, or `None` with every problem recorded in `errors`.
fn egress(path: RoutePath, raw: &RawEgress, dir: &Path, errors: &mut Errors) -> Option<Egress> {
    let before = errors.len();
    let field = |f: &str| format!("{path}.egress.{f}");
    for (i, id) in raw.client_identities.iter().enumerate() {
        if id.is_empty() || id.len() > 1024 || id.bytes().any(|b| b.is_ascii_control()) {
            errors.push(
                format!("{}[{i}]", field("clientIdentities")),
                format!("invalid identity {id:?} (a certificate's CN or DNS SAN)"),
            );
        }
    }
    let server_names: Vec<String> = raw
        .server_names
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let n = crate::route::normalize_sni_pattern(s).filter(|n| !n.starts_with('*'));
            if n.is_none() {
                errors.push(
                    format!("{}[{i}]", field("serverNames")),
                    format!("invalid server name {s:?} (an exact DNS name)"),
                );
            }
            n
        })
        .collect();
    let client_sources: Vec<Net> = raw
        .client_sources
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match Net::parse(s) {
            Ok(n) => Some(n),
            Err(e) => {
                errors.push(format!("{}[{i}]", field("clientSources")), e);
                None
            }
        })
        .collect();
    if raw.client_identities.is_empty() && server_names.is_empty() && client_sources.is_empty() {
        errors.push(
            format!("{path}.egress"),
            "selects no connection: list clientIdentities, serverNames or clientSources",
        );
    }
    let tls = raw
        .tls
        .as_ref()
        .and_then(|t| super::tls::files(errors, &field("tls"), dir, t));
    if tls.is_some() && server_names.is_empty() && client_sources.is_empty() {
        errors.push(
            field("tls"),
            "a route's own tls needs serverNames or clientSources (it is chosen before the handshake)",
        );
    }
    let mut networks = |name: &str, list: &[String]| -> NetSet {
        list.iter()
            .enumerate()
            .filter_map(|(i, s)| match Net::parse(s) {
                Ok(n) => Some(n),
                Err(e) => {
                    errors.push(format!("{}[{i}]", field(name)), e);
                    None
                }
            })
            .collect()
    };
    let allowed_networks = networks("allowedNetworks", &raw.allowed_networks);
    let direct_networks = networks("directNetworks", &raw.direct_networks);
    let via = match raw.via.as_deref() {
        None => Via::default(),
        Some(v) => Via::parse(v).unwrap_or_else(|| {
            errors.push(
                field("via"),
                format!("expected tunnel or direct, got {v:?}"),
            );
            Via::default()
        }),
    };
    (errors.len() == before).then(|| Egress {
        client_identities: raw.client_identities.clone().into(),
        server_names: server_names.into(),
        client_sources: client_sources.into(),
        tls,
        allowed_networks,
        direct_networks,
        via,
    })
}

/// `allowedSourceRanges`, or `None` with every problem recorded in `errors`.
fn source_ranges(path: RoutePath, list: &[String], errors: &mut Errors) -> Option<SourceRanges> {
    let mut ok = true;
    let networks: Vec<_> = list
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match Net::parse(s) {
            Ok(net) => Some(net),
            Err(e) => {
                ok = false;
                errors.push(format!("{path}.allowedSourceRanges[{i}]"), e);
                None
            }
        })
        .collect();
    if !ok {
        return None;
    }
    SourceRanges::from_nets(networks)
        .map_err(|e| errors.push(at(path, "allowedSourceRanges"), e.to_string()))
        .ok()
}

/// The shared string for `zone` (a table names a handful of zones, tens of thousands of times).
fn intern(zones: &mut HashSet<Arc<str>>, zone: &str) -> Arc<str> {
    if let Some(z) = zones.get(zone) {
        return z.clone();
    }
    let z: Arc<str> = zone.into();
    zones.insert(z.clone());
    z
}

/// A duration that must be greater than zero.
pub(super) fn positive(
    errors: &mut Errors,
    path: &str,
    value: &str,
) -> Option<std::time::Duration> {
    let d = errors.duration(path, value)?;
    if d.is_zero() {
        errors.push(path, "must be greater than 0");
        return None;
    }
    Some(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(yaml: &str) -> Result<LoadedTable, String> {
        parse(
            Path::new("routes.yaml"),
            yaml.as_bytes(),
            &BackendRegistry::default(),
        )
        .map_err(|e| e.to_string())
    }

    const HEAD: &str = "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\n";

    #[test]
    fn accepts_spec_example() {
        let t = check(&format!(
            "{HEAD}routes:
- name: shoot--dev--alpha
  sni: [api.alpha.dev.internal.example.com, \"*.alpha.example.com\"]
  destinations: [\"outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local\"]
  proxyDestinations: [\"240.168.102.23:443\"]
  backends:
  - {{address: \"10.1.2.3:443\", zone: eu-1a}}
  - address: \"kube-apiserver.shoot--dev--alpha.svc.cluster.local:443\"
  timeouts: {{connect: 5s, idle: 1h}}
  maxConnectionDuration: 24h
"
        ))
        .unwrap();
        assert_eq!(t.table.routes().len(), 1);
        assert!(t.table.by_sni("x.alpha.example.com").is_some());
    }

    #[test]
    fn reports_every_error_with_path() {
        let err = check(&format!(
            "{HEAD}routes:
- name: a
  sni: [\"bad name\"]
  backends: [{{address: nope}}]
  timeouts: {{connect: 5x}}
- name: b
  backends: []
"
        ))
        .unwrap_err();
        for needle in [
            "routes.yaml: routes[0].sni[0]: invalid server name",
            "routes.yaml: routes[0].backends[0].address: expected HOST:PORT",
            "routes.yaml: routes[0].timeouts.connect: invalid duration",
            "routes.yaml: routes[1].backends: at least one backend",
        ] {
            assert!(err.contains(needle), "{needle} not in {err}");
        }
    }

    #[test]
    fn unknown_field_has_path() {
        let err = check(&format!(
            "{HEAD}routes:\n- name: a\n  backends: [{{address: \"1.2.3.4:1\", weight: 3}}]\n"
        ))
        .unwrap_err();
        assert!(
            err.contains("routes[0].backends[0].weight: unknown field `weight`"),
            "{err}"
        );
    }

    #[test]
    fn duplicate_keys_name_both_routes() {
        let err = check(&format!(
            "{HEAD}routes:
- {{name: a, sni: [x.example.com], backends: [{{address: \"1.2.3.4:1\"}}]}}
- {{name: b, sni: [X.example.com.], backends: [{{address: \"1.2.3.4:2\"}}]}}
"
        ))
        .unwrap_err();
        assert!(
            err.contains(
                "routes[1]: sni \"x.example.com\" of route \"b\" is already claimed by route \"a\""
            ),
            "{err}"
        );
    }

    #[test]
    fn the_yaml_parser_takes_large_commented_tables() {
        // The YAML parser's defaults refuse more than 32 comment lines before a value and
        // more than 250,000 nodes (~10,400 routes of the benches' shape; here 12 nodes a
        // route); an anchor and its aliases are read too.
        let mut doc = format!("{HEAD}routes:\n");
        doc += &"# a retired route\n".repeat(40);
        for i in 0..21_000 {
            let zone = match i {
                0 => "&z eu-1a",
                1 => "*z",
                _ => "eu-1a",
            };
            doc += &format!(
                "- name: r{i}\n  sni: [r{i}.example.com]\n  backends: [{{address: \"10.0.0.1:443\", zone: {zone}}}]\n"
            );
        }
        assert_eq!(check(&doc).unwrap().table.routes().len(), 21_000);
    }

    #[test]
    fn allowed_source_ranges() {
        let t = check(&format!(
            "{HEAD}routes:
- name: a
  backends: [{{address: \"1.2.3.4:1\"}}]
  allowedSourceRanges: [\"203.0.113.0/24\", 198.51.100.7, \"2001:db8::/32\"]
- name: b
  backends: [{{address: \"1.2.3.4:1\"}}]
"
        ))
        .unwrap();
        let (a, b) = (&t.table.routes()[0], &t.table.routes()[1]);
        let ip = |s: &str| s.parse().unwrap();
        assert!(a.admits(ip("203.0.113.200")));
        assert!(a.admits(ip("198.51.100.7")));
        assert!(!a.admits(ip("198.51.100.8")));
        assert!(a.admits(ip("2001:db8::5")));
        assert!(!a.admits(ip("127.0.0.1")));
        // Left out: every client.
        assert!(b.allowed_sources.is_none());
        assert!(b.admits(ip("127.0.0.1")) && b.admits(ip("::1")));

        let err = check(&format!(
            "{HEAD}routes:
- {{name: a, backends: [{{address: \"1.2.3.4:1\"}}], allowedSourceRanges: []}}
- {{name: b, backends: [{{address: \"1.2.3.4:1\"}}], allowedSourceRanges: [\"10.0.0.0/33\", nope, \"::/0\"]}}
"
        ))
        .unwrap_err();
        for needle in [
            "routes[0].allowedSourceRanges: an empty list would admit no client",
            "routes[1].allowedSourceRanges[0]: invalid prefix length",
            "routes[1].allowedSourceRanges[1]: invalid IP address",
        ] {
            assert!(err.contains(needle), "{needle} not in {err}");
        }
        assert!(!err.contains("allowedSourceRanges[2]"), "{err}");
    }

    #[test]
    fn send_proxy_protocol_and_forward_connect() {
        let t = check(&format!(
            "{HEAD}routes:
- {{name: a, backends: [{{address: \"1.2.3.4:1\"}}], sendProxyProtocol: v1}}
- {{name: b, backends: [{{address: \"1.2.3.4:1\"}}], sendProxyProtocol: v2, forwardConnect: true}}
- {{name: c, backends: [{{address: \"1.2.3.4:1\"}}]}}
"
        ))
        .unwrap();
        let r = t.table.routes();
        assert_eq!(
            r.iter()
                .map(|r| (r.send_proxy_protocol, r.forward_connect))
                .collect::<Vec<_>>(),
            [
                (Some(ProxyVersion::V1), false),
                (Some(ProxyVersion::V2), true),
                (None, false)
            ]
        );
        let err = check(&format!(
            "{HEAD}routes:
- {{name: a, backends: [{{address: \"1.2.3.4:1\"}}], sendProxyProtocol: v3}}
- {{name: b, backends: [{{address: \"1.2.3.4:1\"}}], sendProxyProtocol: \"\"}}
"
        ))
        .unwrap_err();
        for needle in [
            "routes[0].sendProxyProtocol: expected v1 or v2, got \"v3\"",
            "routes[1].sendProxyProtocol: expected v1 or v2, got \"\"",
        ] {
            assert!(err.contains(needle), "{needle} not in {err}");
        }
        let err = check(&format!(
            "{HEAD}routes:\n- {{name: c, backends: [{{address: \"1.2.3.4:1\"}}], forwardConnect: yes-please}}\n"
        ))
        .unwrap_err();
        assert!(
            err.contains("routes[0].forwardConnect: invalid boolean"),
            "{err}"
        );
    }

    #[test]
    fn rejects_wrong_header() {
        let err = check("apiVersion: v1\nkind: RoutingTable\n").unwrap_err();
        assert!(err.contains("apiVersion: unsupported"), "{err}");
    }
}
