//! The immutable routing table: lookups by SNI, CONNECT destination and PROXY destination,
//! and the choice of backend for a route.
//!
//! A [`RoutingTable`] is built once, validated as a whole, and then only read: the gateway
//! publishes it behind an `ArcSwap` and every connection keeps the snapshot it was accepted
//! with. Backend health and load ([`BackendState`]) is the only mutable part; it lives in a
//! [`BackendRegistry`] so that it survives table reloads for backends that stay. This module
//! does no I/O and knows nothing about tokio.

mod backend;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use thiserror::Error;

pub use backend::{BackendAddress, BackendGuard, BackendRegistry, BackendState};

/// One backend of a route.
#[derive(Debug, Clone)]
pub struct Backend {
    /// Where to connect.
    pub address: BackendAddress,
    /// Availability zone, for zone preference.
    pub zone: Option<String>,
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
#[derive(Debug, Clone)]
pub struct Route {
    /// Unique name; used in metrics and logs.
    pub name: String,
    /// Server names: exact (lower case, no trailing dot) or `*.suffix`.
    pub sni: Vec<String>,
    /// CONNECT destination header values.
    pub destinations: Vec<String>,
    /// Original destinations carried in a PROXY header.
    pub proxy_destinations: Vec<SocketAddr>,
    /// Where connections go.
    pub backends: Vec<Backend>,
    /// Timeout overrides.
    pub timeouts: RouteTimeouts,
    /// Close connections that have lasted this long.
    pub max_connection_duration: Option<Duration>,
}

/// A key that two routes claim at once.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{kind} {key:?} of route {second:?} is already claimed by route {first:?}")]
pub struct Conflict {
    /// `sni`, `destination`, `proxyDestination` or `name`.
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

/// An immutable, validated set of routes with lookup indexes.
#[derive(Debug, Default)]
pub struct RoutingTable {
    routes: Vec<Arc<Route>>,
    by_name: HashMap<String, usize>,
    sni_exact: HashMap<String, usize>,
    /// Keyed by the suffix with its leading dot: `*.a.example.com` -> `.a.example.com`.
    sni_wildcard: HashMap<String, usize>,
    destinations: HashMap<String, usize>,
    proxy_destinations: HashMap<SocketAddr, usize>,
}

impl RoutingTable {
    /// Indexes `routes`; fails with every key claimed twice.
    pub fn new(routes: Vec<Route>) -> Result<Self, Vec<Conflict>> {
        let mut table = RoutingTable::default();
        let mut conflicts = Vec::new();
        for (i, route) in routes.iter().enumerate() {
            let mut claim = |kind: &'static str, key: String, map_first: Option<usize>| {
                if let Some(first) = map_first {
                    conflicts.push(Conflict {
                        kind,
                        key,
                        first_index: first,
                        first: routes[first].name.clone(),
                        second_index: i,
                        second: route.name.clone(),
                    });
                }
            };
            let prev = table.by_name.insert(route.name.clone(), i);
            claim("name", route.name.clone(), prev);
            for name in &route.sni {
                let prev = match name.strip_prefix('*') {
                    Some(suffix) => table.sni_wildcard.insert(suffix.to_owned(), i),
                    None => table.sni_exact.insert(name.clone(), i),
                };
                claim("sni", name.clone(), prev.filter(|&p| p != i));
            }
            for d in &route.destinations {
                let prev = table.destinations.insert(d.clone(), i);
                claim("destination", d.clone(), prev.filter(|&p| p != i));
            }
            for d in &route.proxy_destinations {
                let prev = table.proxy_destinations.insert(*d, i);
                claim("proxyDestination", d.to_string(), prev.filter(|&p| p != i));
            }
        }
        if !conflicts.is_empty() {
            return Err(conflicts);
        }
        table.routes = routes.into_iter().map(Arc::new).collect();
        Ok(table)
    }

    /// All routes in file order.
    pub fn routes(&self) -> &[Arc<Route>] {
        &self.routes
    }

    /// The route with this name.
    pub fn by_name(&self, name: &str) -> Option<&Arc<Route>> {
        self.by_name.get(name).map(|&i| &self.routes[i])
    }

    /// The route for a server name that is already normalised (lower case, no trailing dot):
    /// an exact match first, else the longest `*.` suffix.
    pub fn by_sni(&self, name: &str) -> Option<&Arc<Route>> {
        if let Some(&i) = self.sni_exact.get(name) {
            return Some(&self.routes[i]);
        }
        if self.sni_wildcard.is_empty() {
            return None;
        }
        // Suffixes from longest to shortest: ".b.c.com", ".c.com", ".com".
        name.match_indices('.')
            .find_map(|(pos, _)| self.sni_wildcard.get(&name[pos..]))
            .map(|&i| &self.routes[i])
    }

    /// The route for a CONNECT destination header value (compared exactly).
    pub fn by_destination(&self, destination: &str) -> Option<&Arc<Route>> {
        self.destinations.get(destination).map(|&i| &self.routes[i])
    }

    /// The route for an original destination carried in a PROXY header.
    pub fn by_proxy_destination(&self, addr: &SocketAddr) -> Option<&Arc<Route>> {
        self.proxy_destinations.get(addr).map(|&i| &self.routes[i])
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
        Route {
            name: name.into(),
            sni: sni
                .iter()
                .map(|s| normalize_sni_pattern(s).unwrap())
                .collect(),
            destinations: vec![],
            proxy_destinations: vec![],
            backends: vec![],
            timeouts: RouteTimeouts::default(),
            max_connection_duration: None,
        }
    }

    #[test]
    fn exact_beats_longest_wildcard() {
        let t = RoutingTable::new(vec![
            route("short", &["*.example.com"]),
            route("long", &["*.alpha.example.com"]),
            route("exact", &["API.alpha.example.com."]),
        ])
        .unwrap();
        let name = |n: &str| t.by_sni(n).map(|r| r.name.as_str());
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
        let err = RoutingTable::new(vec![route("a", &[]), route("a", &[])]).unwrap_err();
        assert_eq!(err[0].kind, "name");
    }

    #[test]
    fn patterns_normalise() {
        assert_eq!(normalize_sni_pattern("*.A.com."), Some("*.a.com".into()));
        assert_eq!(normalize_sni_pattern("a.*.com"), None);
        assert_eq!(normalize_sni_pattern("*"), None);
        assert_eq!(normalize_sni_pattern("*."), None);
    }
}
