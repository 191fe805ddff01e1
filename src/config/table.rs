//! The routing table's schema: the routes of a `RoutingTable` file (and of a controller's
//! `extraRoutes`), as written, and their validation into an indexed [`RoutingTable`].
//!
//! The types here are the one schema of a route: the gateway reads files into them, the
//! controller writes its tables from them, and `/routes` shows the active table in them
//! ([`RawRoute::from`] a validated route), so a field is added in one place. They serialize
//! as the file is written: empty lists and absent options are left out. Their values are
//! text, checked route by route: a table of 100,000 routes is decoded in one pass and every
//! problem of every route reported with its path.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::error::{Errors, at};
use super::value::{Destination, Positive, Text, duration_text};
use crate::route::{
    Backend, BackendAddress, BackendRegistry, Egress, Net, NetSet, ProxyVersion, Route,
    RouteTimeouts, RoutingTable, SourceRanges, Tunnel, TunnelPeer, Via, WgKey,
};

mapping_only!(
    RawRoute,
    RawBackend,
    RawRouteTimeouts,
    RawEgress,
    RawTunnel,
    RawWireGuardRoute,
    RawTunnelPeer
);
serialize_derived!(
    RawRoute,
    RawBackend,
    RawRouteTimeouts,
    RawEgress,
    RawTunnel,
    RawWireGuardRoute,
    RawTunnelPeer
);

/// Longest route name (it ends up in metric labels).
pub const MAX_ROUTE_NAME: usize = 253;

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
                connect: r.timeouts.connect.map(duration_text),
                idle: r.timeouts.idle.map(duration_text),
            }),
            max_connection_duration: r.max_connection_duration.map(duration_text),
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

/// The routes of the list `field` (a table's `routes`, or another file's list of routes in
/// the same schema) validated as a table's routes are and indexed; every problem recorded
/// in `errors` at `field[i]…`. Relative file names are relative to `dir`. The table is
/// empty when two routes claim one key.
pub(crate) fn table_of(
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
        if !Destination::valid(d) {
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
fn positive(errors: &mut Errors, path: &str, value: &str) -> Option<std::time::Duration> {
    Positive::from_text(value)
        .map_err(|e| errors.push(path, e))
        .ok()
        .map(|p| p.0)
}
