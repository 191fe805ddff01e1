//! `kind: RoutingTable` files: the schema and its conversion into a [`RoutingTable`].
//!
//! The raw types here are the one schema of a routing table: the gateway reads files into
//! them, the controller writes its tables from them, and `/routes` shows the active table
//! in them ([`RawRoute::from`] a validated route), so a field is added in one place. They
//! serialize as the file is written: empty lists and absent options are left out.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::decode::{Kind, Raw, Recovery};
use super::{ConfigError, Errors, at};
use crate::route::{
    Backend, BackendAddress, BackendRegistry, Egress, Net, NetSet, ProxyVersion, Route,
    RouteTimeouts, RoutingTable, SourceRanges, Tunnel, TunnelPeer, Via, WgKey,
};

mapping_only!(
    RawRoutingTable,
    RawRoute,
    RawBackend,
    RawRouteTimeouts,
    RawEgress,
    RawTunnel,
    RawWireGuardRoute,
    RawTunnelPeer
);
serialize_derived!(
    RawRoutingTable,
    RawRoute,
    RawBackend,
    RawRouteTimeouts,
    RawEgress,
    RawTunnel,
    RawWireGuardRoute,
    RawTunnelPeer
);

/// The `kind` of routing table files.
pub const KIND: &str = "RoutingTable";

/// Longest route name (it ends up in metric labels).
pub const MAX_ROUTE_NAME: usize = 253;

/// A routing table file as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
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

impl RawRoutingTable {
    /// A table of `routes` with this file kind's `apiVersion` and `kind`.
    pub fn new(routes: Vec<RawRoute>) -> RawRoutingTable {
        RawRoutingTable {
            api_version: super::API_VERSION.to_owned(),
            kind: KIND.to_owned(),
            routes,
        }
    }
}

/// One route as written.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawRoute {
    /// Unique name, used in metrics and logs.
    pub name: String,
    /// TLS server names: exact, or `*.` followed by a suffix.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sni: Vec<String>,
    /// Values of the CONNECT destination header.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub destinations: Vec<String>,
    /// Original destinations (`IP:port`) carried in a PROXY header.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub proxy_destinations: Vec<String>,
    /// Where connections go.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backends: Vec<RawBackend>,
    /// Per-route timeout overrides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeouts: Option<RawRouteTimeouts>,
    /// Close connections after this long (e.g. `24h`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connection_duration: Option<String>,
    /// Admit only clients in these networks (`IP/prefix` or a bare IP): the PROXY source
    /// when a trusted load balancer sent one, else the peer. Left out: every client. An
    /// empty list is an error (it would admit nobody).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_source_ranges: Option<Vec<String>>,
    /// Start every backend connection with a PROXY header of this version (`v1` or `v2`):
    /// source the client address routes admit by, destination the address the client
    /// reached (a received PROXY header's destination, else the listener's). Left out: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub send_proxy_protocol: Option<String>,
    /// The backends are CONNECT proxies: on `http-connect` listeners the request head is
    /// sent to them as received and they answer it (accepted, and ignored, elsewhere).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub forward_connect: bool,
    /// kube-apiserver egress on `egress-connect` listeners: which connections belong to this
    /// route and where their CONNECTs may go. A route with `egress` needs no backends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<RawEgress>,
    /// The shoot's tunnel: the peers the gateway's WireGuard device accepts for this route,
    /// and the gateway's own addresses inside the shoot. A route with `tunnel` needs no
    /// backends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tunnel: Option<RawTunnel>,
}

/// A route's `tunnel` as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawTunnel {
    /// A WireGuard tunnel, served by the gateway's `wireguard` listener.
    pub wireguard: RawWireGuardRoute,
}

/// A route's `tunnel.wireguard` as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawWireGuardRoute {
    /// The shoot-side peers (e.g. two agent replicas): at least one; a public key appears
    /// once in the whole table.
    #[serde(default)]
    pub peers: Vec<RawTunnelPeer>,
    /// The gateway's addresses inside the shoot: one or two, at most one per family, each
    /// outside every peer's `allowedIPs`.
    #[serde(default)]
    pub local_addresses: Vec<String>,
}

/// One peer of a route's tunnel as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawTunnelPeer {
    /// Its public key, base64 as `wg pubkey` prints it.
    pub public_key: String,
    /// The inner source addresses it may send from and the targets it is chosen for
    /// (`IP/prefix` or a bare IP): at least one.
    #[serde(default, rename = "allowedIPs")]
    pub allowed_ips: Vec<String>,
    /// The gateway's live state of the peer (endpoint, last handshake, streams), which
    /// `/routes` adds; never read from a file (a file naming it has an unknown field).
    #[serde(skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub state: Option<serde_json::Value>,
}

/// A route's `egress` as written.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawEgress {
    /// Client certificates (leaf CN or a DNS SAN) that select this route after a handshake
    /// with the listener's `tls`; with `serverNames` or `clientSources`, the leaf must carry
    /// one of them as well.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub client_identities: Vec<String>,
    /// TLS server names (exact) that select this route before the handshake.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub server_names: Vec<String>,
    /// Client addresses (`IP/prefix` or a bare IP) that select this route before the
    /// handshake, when no route claims the server name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub client_sources: Vec<String>,
    /// This route's own server certificate and the one client CA it accepts (for a route
    /// selected before the handshake). Left out: the listener's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<super::tls::RawTls>,
    /// Networks a CONNECT may reach through the shoot's tunnel (or directly, `via: direct`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_networks: Vec<String>,
    /// Networks a CONNECT may reach from the gateway's own network.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub direct_networks: Vec<String>,
    /// How `allowedNetworks` are dialed: `tunnel` (default) or `direct`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
}

/// One backend as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawBackend {
    /// `IP:port` or `DNS-name:port` (resolved at connect time).
    pub address: String,
    /// Availability zone, for zone-preferring backend choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
}

/// Per-route timeout overrides as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawRouteTimeouts {
    /// Connect budget for this route (failover included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect: Option<String>,
    /// Idle timeout for this route's connections.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle: Option<String>,
}

impl From<&Route> for RawRoute {
    /// The route as a file would have it: names and durations as validation normalised
    /// them, relative TLS paths resolved, `via` always written.
    fn from(r: &Route) -> RawRoute {
        let text = |n: &Net| n.to_string();
        RawRoute {
            name: r.name().to_owned(),
            sni: r.sni().map(str::to_owned).collect(),
            destinations: r.destinations().map(str::to_owned).collect(),
            proxy_destinations: r.proxy_destinations.iter().map(|a| a.to_string()).collect(),
            backends: r
                .backends
                .iter()
                .map(|b| RawBackend {
                    address: b.address.to_string(),
                    zone: b.zone.as_deref().map(str::to_owned),
                })
                .collect(),
            timeouts: (r.timeouts != RouteTimeouts::default()).then(|| RawRouteTimeouts {
                connect: r.timeouts.connect.map(super::duration_text),
                idle: r.timeouts.idle.map(super::duration_text),
            }),
            max_connection_duration: r.max_connection_duration.map(super::duration_text),
            allowed_source_ranges: r
                .allowed_sources
                .as_ref()
                .map(|s| s.networks().map(|n| n.to_string()).collect()),
            send_proxy_protocol: r.send_proxy_protocol.map(|v| v.as_str().to_owned()),
            forward_connect: r.forward_connect,
            egress: r.egress.as_deref().map(|e| RawEgress {
                client_identities: e.client_identities.to_vec(),
                server_names: e.server_names.to_vec(),
                client_sources: e.client_sources.iter().map(text).collect(),
                tls: e.tls.as_ref().map(|t| super::tls::RawTls {
                    certificate_file: t.certificate_file.to_string_lossy().into_owned(),
                    key_file: t.key_file.to_string_lossy().into_owned(),
                    client_ca_file: t.client_ca_file.to_string_lossy().into_owned(),
                }),
                allowed_networks: e.allowed_networks.iter().map(text).collect(),
                direct_networks: e.direct_networks.iter().map(text).collect(),
                via: Some(e.via.as_str().to_owned()),
            }),
            tunnel: r.tunnel.as_deref().map(|t| RawTunnel {
                wireguard: RawWireGuardRoute {
                    peers: t
                        .peers
                        .iter()
                        .map(|p| RawTunnelPeer {
                            public_key: p.public_key.to_base64(),
                            allowed_ips: p.allowed_ips.iter().map(text).collect(),
                            state: None,
                        })
                        .collect(),
                    local_addresses: t.local_addresses.iter().map(|a| a.to_string()).collect(),
                },
            }),
        }
    }
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
    parse_with(file, bytes, content_hash(bytes), registry, Recovery::All)
}

/// [`parse`] for a running gateway's reload, which has already hashed the bytes with
/// [`content_hash`]: decoding stops at the first type error (each further decode of a large
/// table would hold up the gateway's control thread); unknown fields and validation errors
/// are all reported as in [`parse`].
pub fn parse_hashed(
    file: &Path,
    bytes: &[u8],
    hash: String,
    registry: &BackendRegistry,
) -> Result<LoadedTable, ConfigError> {
    parse_with(file, bytes, hash, registry, Recovery::First)
}

fn parse_with(
    file: &Path,
    bytes: &[u8],
    hash: String,
    registry: &BackendRegistry,
    recovery: Recovery,
) -> Result<LoadedTable, ConfigError> {
    let result = match super::decode::decode_with(file, bytes, recovery)? {
        (Raw::Routes(raw), errors) => validate(file, raw, errors, hash, registry),
        (other, _) => Err(super::decode::wrong_kind(
            file,
            other.kind(),
            Kind::Routes,
            "routes.file of 'trellis gateway'",
        )),
    };
    super::decode::located(file, bytes, result)
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
    let dir = file.parent().unwrap_or(Path::new("."));
    let table = table_of("routes", &raw.routes, dir, registry, &mut errors);
    errors.finish(file, LoadedTable { table, hash })
}

/// The routes of the list `field` (a table's `routes`, or another file's list of routes in
/// the same schema) validated as a table's routes are and indexed; every problem recorded
/// in `errors` at `field[i]…`. Relative file names are relative to `dir`. The table is
/// empty when two routes claim one key.
pub(super) fn table_of(
    field: &'static str,
    raw: &[RawRoute],
    dir: &Path,
    registry: &BackendRegistry,
    errors: &mut Errors,
) -> RoutingTable {
    let mut zones = HashSet::new();
    let (indexes, routes): (Vec<usize>, Vec<Route>) = raw
        .iter()
        .enumerate()
        .filter_map(|(i, r)| {
            let path = RoutePath { field, index: i };
            validate_route(path, r, dir, registry, &mut zones, errors).map(|r| (i, r))
        })
        .unzip();
    // Indexed even when other errors were found, so that keys claimed twice are reported
    // with them; conflicts count routes as the file does, also when one was left out.
    match RoutingTable::new(routes) {
        Ok(t) => t,
        Err(conflicts) => {
            for c in conflicts {
                // A name claimed twice is a problem of the second route's name; any other
                // key, of the route that claims it.
                let at = if c.kind == "name" { ".name" } else { "" };
                errors.push(
                    format!("{field}[{}]{at}", indexes[c.second_index]),
                    format!("{c} ({field}[{}])", indexes[c.first_index]),
                );
            }
            RoutingTable::default()
        }
    }
}

/// `routes[i]` (or another list's `field[i]`), formatted only when an error needs it.
#[derive(Clone, Copy)]
struct RoutePath {
    /// The list's field.
    field: &'static str,
    /// The route's index in it.
    index: usize,
}

impl std::fmt::Display for RoutePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}[{}]", self.field, self.index)
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
        if !valid_destination(d) {
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
    if raw.backends.is_empty() && raw.egress.is_none() && raw.tunnel.is_none() {
        errors.push(
            at(path, "backends"),
            "at least one backend is required (a route without backends needs egress or tunnel)",
        );
    }
    let egress = raw
        .egress
        .as_ref()
        .and_then(|e| egress(path, e, dir, errors))
        .map(Box::new);
    let tunnel = raw
        .tunnel
        .as_ref()
        .map(|t| Box::new(tunnel(path, &t.wireguard, errors)));
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
            route.tunnel = tunnel;
            Some(route)
        }
        Err(e) => {
            errors.push(path.to_string(), e.to_string());
            None
        }
    }
}

/// Whether `d` can be a CONNECT destination header value: 1 to 1024 bytes, no control
/// characters or spaces.
pub(super) fn valid_destination(d: &str) -> bool {
    !d.is_empty() && d.len() <= 1024 && !d.bytes().any(|b| b.is_ascii_control() || b == b' ')
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

/// A route's `tunnel.wireguard`, every problem recorded in `errors`. A key listed twice in
/// this route is found here; one claimed by two routes when the table is indexed, which is
/// why the tunnel keeps its valid peers when others are not (the table is not used then).
fn tunnel(path: RoutePath, raw: &RawWireGuardRoute, errors: &mut Errors) -> Tunnel {
    let field = |f: &str| format!("{path}.tunnel.wireguard.{f}");
    if raw.peers.is_empty() {
        errors.push(
            field("peers"),
            "at least one peer is required (the shoot's agents)",
        );
    }
    let mut keys: HashMap<WgKey, usize> = HashMap::with_capacity(raw.peers.len());
    // Every peer as far as it is valid, in file order (for the local addresses' check).
    let mut parsed: Vec<(Option<WgKey>, Box<[Net]>)> = Vec::with_capacity(raw.peers.len());
    for (i, p) in raw.peers.iter().enumerate() {
        let peer = field(&format!("peers[{i}]"));
        let public_key = match WgKey::from_base64(&p.public_key) {
            Ok(k) => Some(k),
            Err(e) => {
                errors.push(at(&peer, "publicKey"), e);
                None
            }
        };
        if let Some(k) = public_key
            && let Some(first) = keys.insert(k, i)
        {
            errors.push(
                at(&peer, "publicKey"),
                format!("the key of peers[{first}] again: each peer has its own key"),
            );
        }
        if p.allowed_ips.is_empty() {
            errors.push(
                at(&peer, "allowedIPs"),
                "at least one network is required (the peer's own tunnel address)",
            );
        }
        let allowed_ips: Box<[Net]> = p
            .allowed_ips
            .iter()
            .enumerate()
            .filter_map(|(j, s)| {
                Net::parse(s)
                    .map_err(|e| errors.push(format!("{peer}.allowedIPs[{j}]"), e))
                    .ok()
            })
            .collect();
        parsed.push((public_key, allowed_ips));
    }
    let allowed: Vec<&[Net]> = parsed.iter().map(|(_, nets)| &nets[..]).collect();
    let local_addresses = local_addresses(&field("localAddresses"), raw, &allowed, errors);
    let peers = parsed
        .into_iter()
        .filter_map(|(key, allowed_ips)| {
            Some(TunnelPeer {
                public_key: key?,
                allowed_ips,
            })
        })
        .collect();
    Tunnel {
        peers,
        local_addresses: local_addresses.into(),
    }
}

/// A tunnel's `localAddresses`: one or two, at most one per family, unicast, each outside
/// every peer's `allowedIPs` (the gateway answers on them inside the shoot; a peer that may
/// send from one could pose as the gateway).
fn local_addresses(
    path: &str,
    raw: &RawWireGuardRoute,
    allowed: &[&[Net]],
    errors: &mut Errors,
) -> Vec<IpAddr> {
    if raw.local_addresses.is_empty() || raw.local_addresses.len() > 2 {
        errors.push(
            path,
            format!(
                "one or two addresses are required (at most one per family), got {}",
                raw.local_addresses.len()
            ),
        );
    }
    let mut out: Vec<IpAddr> = Vec::with_capacity(raw.local_addresses.len());
    for (i, s) in raw.local_addresses.iter().enumerate() {
        let at_i = format!("{path}[{i}]");
        let Ok(ip) = s.parse::<IpAddr>().map(|ip| ip.to_canonical()) else {
            errors.push(at_i, format!("expected an IP address, got {s:?}"));
            continue;
        };
        let unusable = ip.is_unspecified()
            || ip.is_multicast()
            || matches!(ip, IpAddr::V4(v4) if v4.is_broadcast());
        if unusable {
            errors.push(&at_i, format!("{ip} is not a unicast address"));
        }
        if let Some(other) = out.iter().position(|o| o.is_ipv4() == ip.is_ipv4()) {
            errors.push(
                &at_i,
                format!(
                    "a second {} address (localAddresses[{other}]): at most one per family",
                    if ip.is_ipv4() { "IPv4" } else { "IPv6" }
                ),
            );
        }
        for (p, nets) in allowed.iter().enumerate() {
            if let Some(net) = nets.iter().find(|n| n.contains(ip)) {
                errors.push(
                    &at_i,
                    format!("{ip} is inside {net}, an allowedIPs network of peers[{p}]: the gateway's address in the shoot must be outside every peer's"),
                );
            }
        }
        out.push(ip);
    }
    out
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
            "routes.yaml:5:9: routes[0].sni[0]: invalid server name",
            "routes.yaml:6:24: routes[0].backends[0].address: expected HOST:PORT",
            "routes.yaml:7:23: routes[0].timeouts.connect: invalid duration",
            "routes.yaml:9:13: routes[1].backends: at least one backend",
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

    /// `trellis check` (and a start) reports every type error; a running gateway's reload
    /// stops at the first and says where the rest are found.
    #[test]
    fn a_reload_stops_at_the_first_type_error() {
        let text = format!(
            "{HEAD}routes:
- {{name: a, sni: [a.example.com], backends: [{{address: \"1.2.3.4:1\", zone: [x]}}]}}
- {{name: b, sni: [b.example.com], backends: [{{address: \"1.2.3.4:2\", zone: [y]}}]}}
"
        );
        let file = Path::new("t.yaml");
        let registry = BackendRegistry::default();
        let all = parse(file, text.as_bytes(), &registry)
            .unwrap_err()
            .to_string();
        assert!(
            all.contains("routes[0].backends[0].zone")
                && all.contains("routes[1].backends[0].zone"),
            "{all}"
        );
        let hash = content_hash(text.as_bytes());
        let first = parse_hashed(file, text.as_bytes(), hash, &registry)
            .unwrap_err()
            .to_string();
        assert!(first.contains("routes[0].backends[0].zone"), "{first}");
        assert!(!first.contains("routes[1]"), "{first}");
        assert!(
            first.contains("`trellis check` lists every problem"),
            "{first}"
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

    /// A key as `wg pubkey` prints it.
    fn key(b: u8) -> String {
        WgKey([b; 32]).to_base64()
    }

    /// A table of one tunnel route with these peers (flow YAML) and local addresses.
    fn tunnel_table(peers: &str, local: &str) -> String {
        format!(
            "{HEAD}routes:\n- name: t\n  tunnel:\n    wireguard:\n      peers: {peers}\n      localAddresses: {local}\n"
        )
    }

    #[test]
    fn a_tunnel_route_needs_no_backends() {
        let t = check(&format!(
            "{HEAD}routes:
- name: shoot--dev--alpha
  tunnel:
    wireguard:
      peers:
      - publicKey: \"{}\"
        allowedIPs: [\"192.168.128.5/32\", \"10.250.0.0/16\"]
      - publicKey: \"{}\"
        allowedIPs: [192.168.128.6, \"10.250.0.0/16\", \"fd8f:6d53:b97a:1::6/128\"]
      localAddresses: [192.168.128.1, \"fd8f:6d53:b97a:1::1\"]
  egress:
    clientIdentities: [shoot--dev--alpha]
    allowedNetworks: [\"10.250.0.0/16\"]
    via: tunnel
- name: no-tunnel-yet
  egress: {{clientIdentities: [beta], allowedNetworks: [\"10.0.0.0/8\"]}}
",
            key(1),
            key(2)
        ))
        .unwrap();
        let r = t.table.by_name("shoot--dev--alpha").unwrap();
        let tunnel = r.tunnel.as_deref().unwrap();
        assert!(r.backends.is_empty());
        assert_eq!(tunnel.peers.len(), 2);
        assert_eq!(tunnel.peers[1].public_key, WgKey([2; 32]));
        assert_eq!(
            tunnel.peers[1].allowed_ips[0],
            Net::parse("192.168.128.6/32").unwrap()
        );
        assert_eq!(
            tunnel.local_addresses[..],
            [
                "192.168.128.1".parse::<IpAddr>().unwrap(),
                "fd8f:6d53:b97a:1::1".parse().unwrap()
            ]
        );
        assert_eq!(
            t.table
                .by_public_key(&WgKey([2; 32]))
                .map(|(r, p)| (r.name(), p)),
            Some(("shoot--dev--alpha", 1))
        );
        // Egress via the tunnel with no tunnel is valid: the gateway answers 504.
        assert!(t.table.by_name("no-tunnel-yet").unwrap().tunnel.is_none());
    }

    /// Each rule of `tunnel.wireguard`, broken once, is reported at its path; the same table
    /// with the rule kept is valid (so each assertion fails when its rule goes).
    #[test]
    fn tunnel_rules_each_have_an_error() {
        let ok_peer = format!(
            "[{{publicKey: \"{}\", allowedIPs: [\"10.250.0.0/16\"]}}]",
            key(1)
        );
        let ok_local = "[10.251.0.1, \"fd00::1\"]";
        check(&tunnel_table(&ok_peer, ok_local)).unwrap();
        let base64_31 =
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, [7u8; 31]);
        let cases = [
            (
                tunnel_table(
                    "[{publicKey: \"not a key!\", allowedIPs: [10.0.0.1]}]",
                    ok_local,
                ),
                "routes[0].tunnel.wireguard.peers[0].publicKey: not base64",
            ),
            (
                tunnel_table(
                    &format!("[{{publicKey: \"{base64_31}\", allowedIPs: [10.0.0.1]}}]"),
                    ok_local,
                ),
                "routes[0].tunnel.wireguard.peers[0].publicKey: a WireGuard key is 32 bytes, this is 31",
            ),
            (
                tunnel_table("[]", ok_local),
                "routes[0].tunnel.wireguard.peers: at least one peer is required",
            ),
            (
                tunnel_table(
                    &format!(
                        "[{{publicKey: \"{}\", allowedIPs: [\"10.250.0.0/16\"]}}, {{publicKey: \"{}\", allowedIPs: [10.0.0.1]}}]",
                        key(1),
                        key(1)
                    ),
                    ok_local,
                ),
                "routes[0].tunnel.wireguard.peers[1].publicKey: the key of peers[0] again",
            ),
            (
                tunnel_table(&format!("[{{publicKey: \"{}\"}}]", key(1)), ok_local),
                "routes[0].tunnel.wireguard.peers[0].allowedIPs: at least one network is required",
            ),
            (
                tunnel_table(
                    &format!(
                        "[{{publicKey: \"{}\", allowedIPs: [\"10.0.0.0/33\"]}}]",
                        key(1)
                    ),
                    ok_local,
                ),
                "routes[0].tunnel.wireguard.peers[0].allowedIPs[0]: invalid prefix length",
            ),
            (
                tunnel_table(&ok_peer, "[\"10.250.3.1\"]"),
                "routes[0].tunnel.wireguard.localAddresses[0]: 10.250.3.1 is inside 10.250.0.0/16, an allowedIPs network of peers[0]",
            ),
            (
                tunnel_table(&ok_peer, "[10.251.0.1, 10.251.0.2]"),
                "routes[0].tunnel.wireguard.localAddresses[1]: a second IPv4 address (localAddresses[0])",
            ),
            (
                tunnel_table(&ok_peer, "[\"fd00::1\", \"fd00::2\"]"),
                "routes[0].tunnel.wireguard.localAddresses[1]: a second IPv6 address (localAddresses[0])",
            ),
            (
                tunnel_table(&ok_peer, "[]"),
                "routes[0].tunnel.wireguard.localAddresses: one or two addresses are required (at most one per family), got 0",
            ),
            (
                tunnel_table(&ok_peer, "[10.251.0.1, \"fd00::1\", 10.251.0.2]"),
                "routes[0].tunnel.wireguard.localAddresses: one or two addresses are required (at most one per family), got 3",
            ),
            (
                tunnel_table(&ok_peer, "[gateway]"),
                "routes[0].tunnel.wireguard.localAddresses[0]: expected an IP address, got \"gateway\"",
            ),
            (
                tunnel_table(&ok_peer, "[0.0.0.0]"),
                "routes[0].tunnel.wireguard.localAddresses[0]: 0.0.0.0 is not a unicast address",
            ),
            (
                tunnel_table(
                    &format!(
                        "[{{publicKey: \"{}\", allowedIPs: [10.0.0.1], endpoint: \"1.2.3.4:51820\"}}]",
                        key(1)
                    ),
                    ok_local,
                ),
                "routes[0].tunnel.wireguard.peers[0].endpoint: unknown field `endpoint`",
            ),
        ];
        for (table, needle) in cases {
            let err = check(&table)
                .err()
                .unwrap_or_else(|| panic!("accepted:\n{table}"));
            assert!(err.contains(needle), "{needle}\nnot in:\n{err}");
        }
        // A key in two routes is refused, naming both.
        let err = check(&format!(
            "{HEAD}routes:
- {{name: a, tunnel: {{wireguard: {{peers: [{{publicKey: \"{k}\", allowedIPs: [10.0.0.1]}}], localAddresses: [10.9.0.1]}}}}}}
- {{name: b, tunnel: {{wireguard: {{peers: [{{publicKey: \"{k2}\", allowedIPs: [10.0.0.2]}}, {{publicKey: \"{k}\", allowedIPs: [10.0.0.1]}}], localAddresses: [10.9.0.1]}}}}}}
",
            k = key(1),
            k2 = key(2),
        ))
        .unwrap_err();
        assert_eq!(
            err,
            format!(
                "routes.yaml:5:3: routes[1]: tunnel.wireguard.publicKey \"{}\" of route \"b\" is already claimed by route \"a\" (routes[0])",
                key(1)
            )
        );
        // Found also when the first route's tunnel has another problem.
        let err = check(&format!(
            "{HEAD}routes:
- {{name: a, tunnel: {{wireguard: {{peers: [{{publicKey: \"{k}\", allowedIPs: [10.0.0.1]}}], localAddresses: [10.0.0.1]}}}}}}
- {{name: b, tunnel: {{wireguard: {{peers: [{{publicKey: \"{k}\", allowedIPs: [10.0.0.1]}}], localAddresses: [10.9.0.1]}}}}}}
",
            k = key(1),
        ))
        .unwrap_err();
        assert!(
            err.contains("routes[0].tunnel.wireguard.localAddresses[0]: 10.0.0.1 is inside"),
            "{err}"
        );
        assert!(
            err.contains("routes[1]: tunnel.wireguard.publicKey"),
            "{err}"
        );
        // Without backends, egress or tunnel, a route leads nowhere.
        let err = check(&format!("{HEAD}routes:\n- name: x\n")).unwrap_err();
        assert!(err.contains("routes[0].backends: at least one backend is required (a route without backends needs egress or tunnel)"), "{err}");
    }

    /// A validated route in the schema ([`RawRoute::from`], what `/routes` shows) reads back
    /// as the same route, every field included; the schema is also what is written.
    #[test]
    fn a_route_shown_in_the_schema_reads_back() {
        let dir = std::env::temp_dir().join(format!("trellis-schema-{}", std::process::id()));
        let file = dir.join("routes.yaml");
        let table = format!(
            "{HEAD}routes:
- name: all
  sni: [\"*.a.example.com\", API.a.example.com.]
  destinations: [\"outbound|443||kube-apiserver.a.svc.cluster.local\"]
  proxyDestinations: [\"240.0.0.1:443\"]
  backends: [{{address: \"10.1.2.3:443\", zone: eu-1a}}, {{address: \"kube-apiserver.a:443\"}}]
  timeouts: {{connect: 5000ms, idle: 1h}}
  maxConnectionDuration: 24h
  allowedSourceRanges: [\"203.0.113.9/24\", \"2001:db8::/32\"]
  sendProxyProtocol: v2
  forwardConnect: true
  egress:
    clientIdentities: [kube-apiserver-http-proxy]
    serverNames: [vpn.a.example.com]
    clientSources: [10.64.1.10]
    tls: {{certificateFile: a.crt, keyFile: a.key, clientCAFile: a-ca.crt}}
    allowedNetworks: [\"10.250.0.0/16\"]
    directNetworks: [\"10.1.0.0/16\"]
  tunnel:
    wireguard:
      peers: [{{publicKey: \"{}\", allowedIPs: [192.168.128.5, \"fd00:1::/64\"]}}]
      localAddresses: [\"fd00:2::1\", 192.168.128.1]
- name: plain
  backends: [{{address: \"10.1.2.4:443\"}}]
",
            key(1)
        );
        let first = parse(&file, table.as_bytes(), &BackendRegistry::default()).unwrap();
        let shown: Vec<RawRoute> = first
            .table
            .routes()
            .iter()
            .map(|r| RawRoute::from(&**r))
            .collect();
        let json = serde_json::to_string(&RawRoutingTable::new(shown.clone())).unwrap();
        let again = parse(&file, json.as_bytes(), &BackendRegistry::default())
            .unwrap_or_else(|e| panic!("{e}\n{json}"));
        let shown_again: Vec<RawRoute> = again
            .table
            .routes()
            .iter()
            .map(|r| RawRoute::from(&**r))
            .collect();
        assert_eq!(shown, shown_again);
        let all = &shown[0];
        assert_eq!(all.sni, ["*.a.example.com", "api.a.example.com"]);
        assert_eq!(
            all.timeouts.as_ref().and_then(|t| t.connect.as_deref()),
            Some("5s")
        );
        assert_eq!(
            all.allowed_source_ranges.as_deref(),
            Some(&["203.0.113.0/24".to_owned(), "2001:db8::/32".to_owned()][..])
        );
        let egress = all.egress.as_ref().unwrap();
        assert_eq!(egress.client_sources, ["10.64.1.10/32"]);
        assert_eq!(egress.via.as_deref(), Some("tunnel"));
        assert_eq!(
            egress.tls.as_ref().map(|t| t.key_file.as_str()),
            Some(dir.join("a.key").to_str().unwrap())
        );
        assert_eq!(
            again.table.routes()[0].tunnel,
            first.table.routes()[0].tunnel
        );
        // Left out when empty: a plain route is its name and backends.
        let plain = serde_json::to_value(&shown[1]).unwrap();
        assert_eq!(
            plain,
            serde_json::json!({"name": "plain", "backends": [{"address": "10.1.2.4:443"}]})
        );
    }

    /// A peer's live `state` is shown by `/routes` only: a file cannot set it.
    #[test]
    fn a_peer_state_is_not_read_from_a_file() {
        let err = check(&tunnel_table(
            &format!(
                "[{{publicKey: \"{}\", allowedIPs: [10.0.0.1], state: {{endpoint: \"1.2.3.4:5\"}}}}]",
                key(1)
            ),
            "[10.9.0.1]",
        ))
        .unwrap_err();
        assert!(
            err.contains("routes[0].tunnel.wireguard.peers[0].state: unknown field `state`"),
            "{err}"
        );
    }

    #[test]
    fn rejects_wrong_header() {
        let err = check("apiVersion: v1\nkind: RoutingTable\n").unwrap_err();
        assert!(err.contains("apiVersion: unsupported"), "{err}");
    }
}
