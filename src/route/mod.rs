//! The immutable routing table: lookups by SNI, CONNECT destination and PROXY destination,
//! and the choice of backend for a route.
//!
//! A [`RoutingTable`] is built once, validated as a whole, and then only read: the gateway
//! publishes it behind an `ArcSwap` and every connection keeps the snapshot it was accepted
//! with. Backend health and load ([`BackendState`]) is the only mutable part; it lives in a
//! [`BackendRegistry`] so that it survives table reloads for backends that stay. This module
//! does no I/O and knows nothing about tokio.

mod backend;
mod egress;
mod index;
mod net;
mod ranges;
mod tunnel;

use std::collections::HashMap;

use index::{Index, Keys};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use thiserror::Error;

pub use backend::{BackendAddress, BackendGuard, BackendRegistry, BackendState};
pub use egress::{Egress, EgressConflict, EgressIndex, EgressPath, TlsFiles, Via};
pub use net::{Net, NetError, NetSet, NetTable};
pub use ranges::{RangesError, SourceRanges};
pub use tunnel::{KeyError, KeyFileError, Tunnel, TunnelPeer, WgKey, read_key_file};

pub use crate::wire::proxy::ProxyVersion;

/// One backend of a route.
#[derive(Debug, Clone)]
pub struct Backend {
    /// Where to connect.
    pub address: BackendAddress,
    /// Availability zone, for zone preference (one shared string per zone and table).
    pub zone: Option<Arc<str>>,
    /// Shared load and health, kept across reloads.
    pub state: Arc<BackendState>,
}

/// Per-route overrides of the listener timeouts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RouteTimeouts {
    /// Total budget for connecting to a backend, failover included.
    pub connect: Option<Duration>,
    /// Close the connection after this long without bytes in either direction.
    pub idle: Option<Duration>,
}

/// A validated route: the keys that select it and the backends it leads to.
///
/// The name, server names and CONNECT destinations are kept back to back in one string: a
/// seed's table has tens of thousands of routes, and one allocation instead of one per key
/// keeps the table small and a reload's two generations from fragmenting the heap.
#[derive(Debug, Clone)]
pub struct Route {
    /// The name, then the server names, then the destinations.
    keys: Box<str>,
    /// Where each key in `keys` ends.
    ends: Box<[u32]>,
    /// How many server names there are.
    sni_count: u32,
    /// Original destinations carried in a PROXY header.
    pub proxy_destinations: Box<[SocketAddr]>,
    /// Where connections go.
    pub backends: Box<[Backend]>,
    /// Timeout overrides.
    pub timeouts: RouteTimeouts,
    /// Close connections that have lasted this long.
    pub max_connection_duration: Option<Duration>,
    /// The only clients admitted (`allowedSourceRanges`); `None` admits every client.
    pub allowed_sources: Option<SourceRanges>,
    /// Every backend connection starts with a PROXY header of this version
    /// (`sendProxyProtocol`): the client the gateway admits by, and the address it reached.
    pub send_proxy_protocol: Option<ProxyVersion>,
    /// The backends are CONNECT proxies themselves (`forwardConnect`): an `http-connect`
    /// listener sends them the request head as received and lets them answer it. Other
    /// listeners ignore it.
    pub forward_connect: bool,
    /// kube-apiserver egress on `egress-connect` listeners (boxed: most routes have none).
    pub egress: Option<Box<Egress>>,
    /// The shoot's WireGuard tunnel (boxed: most routes have none).
    pub tunnel: Option<Box<Tunnel>>,
}

/// The keys of one kind of a route, in order.
#[derive(Debug, Clone)]
pub struct RouteKeyList<'a> {
    route: &'a Route,
    next: usize,
    end: usize,
}

impl<'a> Iterator for RouteKeyList<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        (self.next < self.end).then(|| {
            self.next += 1;
            self.route.key(self.next - 1)
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.end - self.next;
        (n, Some(n))
    }
}

impl ExactSizeIterator for RouteKeyList<'_> {}

impl RouteKeyList<'_> {
    /// Whether no keys are left.
    pub fn is_empty(&self) -> bool {
        self.next >= self.end
    }
}

impl Serialize for RouteKeyList<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.clone())
    }
}

/// Why a route cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("the route's name, server names and destinations exceed 4 GiB")]
pub struct KeysTooLong;

impl Route {
    /// A route with these keys (server names already normalised) and backends.
    pub fn new<S: AsRef<str>, D: AsRef<str>>(
        name: &str,
        sni: &[S],
        destinations: &[D],
        proxy_destinations: Vec<SocketAddr>,
        backends: Vec<Backend>,
    ) -> Result<Route, KeysTooLong> {
        let all = || {
            std::iter::once(name)
                .chain(sni.iter().map(AsRef::as_ref))
                .chain(destinations.iter().map(AsRef::as_ref))
        };
        let total: usize = all().map(str::len).sum();
        if u32::try_from(total).is_err() {
            return Err(KeysTooLong);
        }
        let mut keys = String::with_capacity(total);
        let mut ends = Vec::with_capacity(1 + sni.len() + destinations.len());
        for k in all() {
            keys.push_str(k);
            ends.push(keys.len() as u32);
        }
        Ok(Route {
            keys: keys.into_boxed_str(),
            ends: ends.into_boxed_slice(),
            sni_count: sni.len() as u32,
            proxy_destinations: proxy_destinations.into_boxed_slice(),
            backends: backends.into_boxed_slice(),
            timeouts: RouteTimeouts::default(),
            max_connection_duration: None,
            allowed_sources: None,
            send_proxy_protocol: None,
            forward_connect: false,
            egress: None,
            tunnel: None,
        })
    }

    /// Whether a client at `ip` may use this route: every client when the route has no
    /// `allowedSourceRanges`, else only clients inside them (IPv4-mapped IPv6 as IPv4).
    pub fn admits(&self, ip: std::net::IpAddr) -> bool {
        self.allowed_sources
            .as_ref()
            .is_none_or(|ranges| ranges.contains(ip))
    }

    fn key(&self, i: usize) -> &str {
        let start = match i {
            0 => 0,
            _ => self.ends[i - 1] as usize,
        };
        &self.keys[start..self.ends[i] as usize]
    }

    fn list(&self, next: usize, end: usize) -> RouteKeyList<'_> {
        RouteKeyList {
            route: self,
            next,
            end,
        }
    }

    /// Unique name; used in metrics and logs.
    pub fn name(&self) -> &str {
        self.key(0)
    }

    /// Server names: exact (lower case, no trailing dot) or `*.suffix`.
    pub fn sni(&self) -> RouteKeyList<'_> {
        self.list(1, 1 + self.sni_count as usize)
    }

    /// CONNECT destination header values.
    pub fn destinations(&self) -> RouteKeyList<'_> {
        self.list(1 + self.sni_count as usize, self.ends.len())
    }
}

/// A key that two routes claim at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    /// `sni`, `destination`, `proxyDestination`, `name`, an egress selector or
    /// `tunnel.wireguard.publicKey`.
    pub kind: &'static str,
    /// The key as written.
    pub key: String,
    /// Index of the route that claimed the key first.
    pub first_index: usize,
    /// Name of that route.
    pub first: String,
    /// Index of the route that claims it again.
    pub second_index: usize,
    /// Name of that route.
    pub second: String,
}

impl std::fmt::Display for Conflict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A name claimed twice is the route's own key: its name once is all there is to say.
        if self.kind == "name" {
            return write!(f, "duplicate route name {:?}", self.key);
        }
        write!(
            f,
            "{} {:?} of route {:?} is already claimed by route {:?}",
            self.kind, self.key, self.second, self.first
        )
    }
}

impl std::error::Error for Conflict {}

/// An immutable, validated set of routes with lookup indexes. The string indexes keep no
/// copy of their keys: they point into the routes.
#[derive(Debug, Default)]
pub struct RoutingTable {
    routes: Vec<Arc<Route>>,
    by_name: Index,
    sni_exact: Index,
    /// Keyed by the suffix with its leading dot: `*.a.example.com` -> `.a.example.com`.
    sni_wildcard: Index,
    destinations: Index,
    proxy_destinations: HashMap<SocketAddr, u32>,
    egress: EgressIndex,
    /// Every tunnel peer's public key: its route and its index in the route's peers.
    tunnel_peers: HashMap<WgKey, (u32, u32)>,
}

/// Which string of a route an index holds; `position` picks one of a list.
#[derive(Clone, Copy)]
enum KeyKind {
    Name,
    Sni,
    /// A `*.suffix` SNI pattern, keyed without the `*`.
    SniSuffix,
    Destination,
}

/// The routes seen as one kind of key.
struct RouteKeys<'a, R> {
    routes: &'a [R],
    kind: KeyKind,
}

impl<R: std::ops::Deref<Target = Route>> Keys for RouteKeys<'_, R> {
    fn key(&self, route: u32, position: u32) -> &str {
        let r: &Route = &self.routes[route as usize];
        let p = position as usize;
        let first_destination = 1 + r.sni_count as usize;
        match self.kind {
            KeyKind::Name => r.name(),
            KeyKind::Sni => r.key(1 + p),
            KeyKind::SniSuffix => &r.key(1 + p)[1..],
            KeyKind::Destination => r.key(first_destination + p),
        }
    }
}

impl RoutingTable {
    /// Indexes `routes`; fails with every key claimed twice.
    pub fn new(routes: Vec<Route>) -> Result<Self, Vec<Conflict>> {
        let routes: Vec<Arc<Route>> = routes.into_iter().map(Arc::new).collect();
        let count = |f: fn(&Route) -> usize| routes.iter().map(|r| f(r)).sum::<usize>();
        let wildcards = count(|r| r.sni().filter(|s| s.starts_with('*')).count());
        let mut table = RoutingTable {
            by_name: Index::with_capacity(routes.len()),
            sni_exact: Index::with_capacity(count(|r| r.sni().len()) - wildcards),
            sni_wildcard: Index::with_capacity(wildcards),
            destinations: Index::with_capacity(count(|r| r.destinations().len())),
            proxy_destinations: HashMap::with_capacity(count(|r| r.proxy_destinations.len())),
            egress: EgressIndex::default(),
            tunnel_peers: HashMap::with_capacity(count(|r| {
                r.tunnel.as_ref().map_or(0, |t| t.peers.len())
            })),
            routes: Vec::new(),
        };
        let keys = |kind| RouteKeys {
            routes: &routes,
            kind,
        };
        let mut conflicts: Vec<Conflict> = Vec::new();
        for (i, route) in routes.iter().enumerate() {
            let n = i as u32;
            let mut claim = |kind: &'static str, key: &dyn std::fmt::Display, prev: Option<u32>| {
                // A route may list a key twice; only another route's claim conflicts, and
                // it is reported once even when this route lists the key twice.
                let Some(first) = prev.filter(|&p| p != n) else {
                    return;
                };
                // Formatted only for a conflict: a valid table formats no keys.
                let key = key.to_string();
                if !conflicts
                    .iter()
                    .rev()
                    .take_while(|c| c.second_index == i)
                    .any(|c: &Conflict| {
                        c.kind == kind && c.first_index == first as usize && c.key == key
                    })
                {
                    conflicts.push(Conflict {
                        kind,
                        key,
                        first_index: first as usize,
                        first: routes[first as usize].name().to_owned(),
                        second_index: i,
                        second: route.name().to_owned(),
                    });
                }
            };
            let prev = table
                .by_name
                .insert(&keys(KeyKind::Name), route.name(), n, 0);
            claim("name", &route.name(), prev);
            for (p, name) in route.sni().enumerate() {
                let prev = match name.strip_prefix('*') {
                    Some(suffix) => {
                        table
                            .sni_wildcard
                            .insert(&keys(KeyKind::SniSuffix), suffix, n, p as u32)
                    }
                    None => table
                        .sni_exact
                        .insert(&keys(KeyKind::Sni), name, n, p as u32),
                };
                claim("sni", &name, prev);
            }
            for (p, d) in route.destinations().enumerate() {
                let prev = table
                    .destinations
                    .insert(&keys(KeyKind::Destination), d, n, p as u32);
                claim("destination", &d, prev);
            }
            for d in route.proxy_destinations.iter() {
                let prev = *table.proxy_destinations.entry(*d).or_insert(n);
                claim("proxyDestination", d, Some(prev));
            }
            // One WireGuard device serves every shoot: a key names one peer in the whole
            // table. A key listed twice in one route is the caller's to refuse (the config's
            // validation does); the index keeps its first peer.
            let peers = route.tunnel.as_ref().map_or(&[][..], |t| &t.peers[..]);
            for (p, peer) in peers.iter().enumerate() {
                let prev = table
                    .tunnel_peers
                    .entry(peer.public_key)
                    .or_insert((n, p as u32))
                    .0;
                claim(
                    "tunnel.wireguard.publicKey",
                    &peer.public_key.to_base64(),
                    Some(prev),
                );
            }
        }
        let with_egress = routes
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((i, r.egress.as_deref()?)));
        match EgressIndex::new(with_egress) {
            Ok(index) => table.egress = index,
            Err(found) => conflicts.extend(found.into_iter().map(|c| Conflict {
                kind: c.kind,
                key: c.key,
                first_index: c.first,
                first: routes[c.first].name().to_owned(),
                second_index: c.second,
                second: routes[c.second].name().to_owned(),
            })),
        }
        if !conflicts.is_empty() {
            return Err(conflicts);
        }
        table.routes = routes;
        Ok(table)
    }

    fn found(&self, i: Option<u32>) -> Option<&Arc<Route>> {
        i.map(|i| &self.routes[i as usize])
    }

    fn keys(&self, kind: KeyKind) -> RouteKeys<'_, Arc<Route>> {
        RouteKeys {
            routes: &self.routes,
            kind,
        }
    }

    /// All routes in file order.
    pub fn routes(&self) -> &[Arc<Route>] {
        &self.routes
    }

    /// The route with this name.
    pub fn by_name(&self, name: &str) -> Option<&Arc<Route>> {
        self.found(self.by_name.get(&self.keys(KeyKind::Name), name))
    }

    /// The route for a server name that is already normalised (lower case, no trailing dot):
    /// an exact match first, else the longest `*.` suffix.
    pub fn by_sni(&self, name: &str) -> Option<&Arc<Route>> {
        if let Some(i) = self.sni_exact.get(&self.keys(KeyKind::Sni), name) {
            return self.found(Some(i));
        }
        if self.sni_wildcard.is_empty() {
            return None;
        }
        // Suffixes from longest to shortest: ".b.c.com", ".c.com", ".com".
        let keys = self.keys(KeyKind::SniSuffix);
        self.found(
            name.match_indices('.')
                .find_map(|(pos, _)| self.sni_wildcard.get(&keys, &name[pos..])),
        )
    }

    /// The route for a CONNECT destination header value (compared exactly).
    pub fn by_destination(&self, destination: &str) -> Option<&Arc<Route>> {
        self.found(
            self.destinations
                .get(&self.keys(KeyKind::Destination), destination),
        )
    }

    /// The egress route for a TLS server name already normalised (lower case, no trailing
    /// dot): selected before the handshake.
    pub fn egress_by_server_name(&self, name: &str) -> Option<&Arc<Route>> {
        self.found(self.egress.by_server_name(name))
    }

    /// The egress route whose `clientSources` hold `ip`: selected before the handshake.
    pub fn egress_by_source(&self, ip: std::net::IpAddr) -> Option<&Arc<Route>> {
        self.found(self.egress.by_source(ip))
    }

    /// The egress route selected by a client certificate's names (CN, DNS SANs), among the
    /// routes that have neither `serverNames` nor `clientSources`.
    pub fn egress_by_identity<'a>(
        &self,
        names: impl Iterator<Item = &'a str>,
    ) -> Option<&Arc<Route>> {
        self.found(self.egress.by_identity(names))
    }

    /// The route whose tunnel has a peer with this public key, and the peer's index in the
    /// route's `tunnel.wireguard.peers`.
    pub fn by_public_key(&self, key: &WgKey) -> Option<(&Arc<Route>, usize)> {
        let &(route, peer) = self.tunnel_peers.get(key)?;
        Some((&self.routes[route as usize], peer as usize))
    }

    /// The route for an original destination carried in a PROXY header.
    pub fn by_proxy_destination(&self, addr: &SocketAddr) -> Option<&Arc<Route>> {
        self.found(self.proxy_destinations.get(addr).copied())
    }
}

/// Normalises an SNI pattern from a routing file: lower case, no trailing dot. Returns
/// `None` when it is neither a DNS name nor `*.` followed by one.
pub fn normalize_sni_pattern(pattern: &str) -> Option<String> {
    match pattern.strip_prefix("*.") {
        Some(suffix) => {
            crate::wire::tls::normalize_host(suffix.as_bytes()).map(|s| format!("*.{s}"))
        }
        None => crate::wire::tls::normalize_host(pattern.as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn route(name: &str, sni: &[&str]) -> Route {
        let sni: Vec<String> = sni
            .iter()
            .map(|s| normalize_sni_pattern(s).unwrap())
            .collect();
        Route::new::<_, &str>(name, &sni, &[], vec![], vec![]).unwrap()
    }

    #[test]
    fn keys_are_read_back_from_one_string() {
        let r = Route::new(
            "r",
            &["a.example.com", "*.b.example.com"],
            &["outbound|443||x", "y"],
            vec![],
            vec![],
        )
        .unwrap();
        assert_eq!(r.name(), "r");
        assert_eq!(
            r.sni().collect::<Vec<_>>(),
            ["a.example.com", "*.b.example.com"]
        );
        assert_eq!(r.sni().len(), 2);
        assert_eq!(
            r.destinations().collect::<Vec<_>>(),
            ["outbound|443||x", "y"]
        );
        let none = Route::new::<&str, &str>("n", &[], &[], vec![], vec![]).unwrap();
        assert_eq!(
            (none.name(), none.sni().len(), none.destinations().len()),
            ("n", 0, 0)
        );
        assert_eq!(
            serde_json::to_string(&r.destinations()).unwrap(),
            r#"["outbound|443||x","y"]"#
        );
    }

    #[test]
    fn exact_beats_longest_wildcard() {
        let t = RoutingTable::new(vec![
            route("short", &["*.example.com"]),
            route("long", &["*.alpha.example.com"]),
            route("exact", &["API.alpha.example.com."]),
        ])
        .unwrap();
        let name = |n: &str| t.by_sni(n).map(|r| r.name());
        assert_eq!(name("api.alpha.example.com"), Some("exact"));
        assert_eq!(name("x.alpha.example.com"), Some("long"));
        assert_eq!(name("x.y.alpha.example.com"), Some("long"));
        assert_eq!(name("beta.example.com"), Some("short"));
        assert_eq!(name("example.com"), None);
        assert_eq!(name("alpha.example.com"), Some("short"));
        assert_eq!(name("other.org"), None);
    }

    #[test]
    fn duplicates_name_both_routes() {
        let err = RoutingTable::new(vec![
            route("a", &["x.example.com"]),
            route("b", &["X.example.com."]),
        ])
        .unwrap_err();
        assert_eq!(err.len(), 1);
        assert_eq!(err[0].first, "a");
        assert_eq!(err[0].second, "b");
        assert!(err[0].to_string().contains("\"a\""));
        // Listed twice by the second route: still one conflict.
        let err = RoutingTable::new(vec![
            route("a", &["x.example.com"]),
            route("b", &["x.example.com", "X.example.com."]),
        ])
        .unwrap_err();
        assert_eq!(err.len(), 1, "{err:?}");
        let err = RoutingTable::new(vec![route("a", &[]), route("a", &[])]).unwrap_err();
        assert_eq!(err[0].kind, "name");
        // The name is said once, not as the key, the route and the route claiming it.
        assert_eq!(err[0].to_string(), "duplicate route name \"a\"");
    }

    #[test]
    fn a_public_key_names_one_peer_in_the_whole_table() {
        let with_peers = |name: &str, keys: &[u8]| {
            let mut r = route(name, &[]);
            r.tunnel = Some(Box::new(Tunnel {
                peers: keys
                    .iter()
                    .map(|&k| TunnelPeer {
                        public_key: WgKey([k; 32]),
                        allowed_ips: Box::new([]),
                    })
                    .collect(),
                local_addresses: Box::new([]),
            }));
            r
        };
        let t = RoutingTable::new(vec![
            route("plain", &[]),
            with_peers("a", &[1, 2]),
            with_peers("b", &[3]),
        ])
        .unwrap();
        let found = |k: u8| {
            t.by_public_key(&WgKey([k; 32]))
                .map(|(r, p)| (r.name().to_owned(), p))
        };
        assert_eq!(found(2), Some(("a".into(), 1)));
        assert_eq!(found(3), Some(("b".into(), 0)));
        assert_eq!(found(4), None);
        let err = RoutingTable::new(vec![with_peers("a", &[1, 2]), with_peers("b", &[3, 2])])
            .unwrap_err();
        assert_eq!(err.len(), 1, "{err:?}");
        assert_eq!(
            (err[0].kind, &*err[0].first, &*err[0].second),
            ("tunnel.wireguard.publicKey", "a", "b")
        );
        assert_eq!(err[0].key, WgKey([2; 32]).to_base64());
    }

    #[test]
    fn patterns_normalise() {
        assert_eq!(normalize_sni_pattern("*.A.com."), Some("*.a.com".into()));
        assert_eq!(normalize_sni_pattern("a.*.com"), None);
        assert_eq!(normalize_sni_pattern("*"), None);
        assert_eq!(normalize_sni_pattern("*."), None);
    }
}
