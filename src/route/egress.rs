//! A route's `egress`: which kube-apiserver connections on an `egress-connect` listener
//! belong to it, and where their CONNECTs may go. The table indexes the selectors
//! ([`EgressIndex`]); the decision for a target ([`Egress::path_for`]) is a pure function.
//! No I/O: the TLS files are only named here.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::net::{Net, NetSet, NetTable};

/// A `tls` section: the server certificate chain, its key and the client CA bundle, as
/// three PEM files (relative paths already resolved).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TlsFiles {
    /// The server certificate chain, leaf first.
    pub certificate_file: PathBuf,
    /// The server certificate's private key.
    pub key_file: PathBuf,
    /// The CA bundle client certificates are verified against.
    #[serde(rename = "clientCAFile")]
    pub client_ca_file: PathBuf,
}

impl TlsFiles {
    /// The three files.
    pub fn paths(&self) -> [&Path; 3] {
        [&self.certificate_file, &self.key_file, &self.client_ca_file]
    }
}

/// How `allowedNetworks` are dialed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Via {
    /// Through the shoot's tunnel (the default).
    #[default]
    Tunnel,
    /// From the gateway's own network.
    Direct,
}

impl Via {
    /// As written in the table.
    pub fn as_str(self) -> &'static str {
        match self {
            Via::Tunnel => "tunnel",
            Via::Direct => "direct",
        }
    }

    /// Parses `tunnel` or `direct`.
    pub fn parse(s: &str) -> Option<Via> {
        match s {
            "tunnel" => Some(Via::Tunnel),
            "direct" => Some(Via::Direct),
            _ => None,
        }
    }
}

/// Where a CONNECT target is dialed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EgressPath {
    /// In the shoot's network stack, through its tunnel.
    Tunnel,
    /// From the gateway's own network.
    Direct,
}

/// A route's validated `egress`.
#[derive(Debug, Clone, Default)]
pub struct Egress {
    /// Leaf CNs or DNS SANs that select the route (or that a route selected before the
    /// handshake requires), compared exactly.
    pub client_identities: Box<[String]>,
    /// Server names (lower case, no trailing dot) that select the route before the handshake.
    pub server_names: Box<[String]>,
    /// Client networks that select the route before the handshake.
    pub client_sources: Box<[Net]>,
    /// The route's own server certificate and client CA; `None`: the listener's.
    pub tls: Option<TlsFiles>,
    /// Networks reached through the tunnel (or directly with [`Via::Direct`]); empty: none.
    pub allowed_networks: NetSet,
    /// Networks reached from the gateway's own network; empty: none.
    pub direct_networks: NetSet,
    /// How `allowed_networks` are dialed.
    pub via: Via,
}

impl Egress {
    /// Where a CONNECT to `ip` is dialed from, or `None` when no list allows it:
    /// `allowedNetworks` first (through the tunnel, or directly with `via: direct`), then
    /// `directNetworks`.
    pub fn path_for(&self, ip: IpAddr) -> Option<EgressPath> {
        if self.allowed_networks.contains(ip) {
            return Some(match self.via {
                Via::Tunnel => EgressPath::Tunnel,
                Via::Direct => EgressPath::Direct,
            });
        }
        if self.direct_networks.contains(ip) {
            return Some(EgressPath::Direct);
        }
        None
    }

    /// Whether a leaf with these names (its CN and DNS SANs) carries one of the route's
    /// identities.
    pub fn identified_by<'a>(&self, mut names: impl Iterator<Item = &'a str>) -> bool {
        names.any(|n| self.client_identities.iter().any(|i| i == n))
    }

    /// Whether the route is chosen before the handshake (by server name or client address)
    /// rather than by the client certificate's identity.
    pub fn selected_before_handshake(&self) -> bool {
        !self.server_names.is_empty() || !self.client_sources.is_empty()
    }
}

/// A key two egress routes claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressConflict {
    /// `egress.serverName`, `egress.clientSource` or `egress.clientIdentity`.
    pub kind: &'static str,
    /// The key (for sources: both networks).
    pub key: String,
    /// Index of the route that claimed it first.
    pub first: usize,
    /// Index of the route that claimed it again.
    pub second: usize,
}

/// The egress selectors of a table: server name and client address before the handshake,
/// identity after it.
#[derive(Debug, Default)]
pub struct EgressIndex {
    by_server_name: HashMap<Box<str>, u32>,
    /// Client networks with their route (sources never overlap across routes).
    by_source: NetTable<u32>,
    by_identity: HashMap<Box<str>, u32>,
}

impl EgressIndex {
    /// Indexes the egress of `routes` (route index, egress); every key claimed twice is
    /// returned instead.
    pub fn new<'a>(
        routes: impl Iterator<Item = (usize, &'a Egress)>,
    ) -> Result<EgressIndex, Vec<EgressConflict>> {
        let mut index = EgressIndex::default();
        let mut conflicts = Vec::new();
        for (i, egress) in routes {
            let n = i as u32;
            for name in egress.server_names.iter() {
                match index.by_server_name.get(name.as_str()) {
                    Some(&first) if first != n => conflicts.push(EgressConflict {
                        kind: "egress.serverName",
                        key: name.clone(),
                        first: first as usize,
                        second: i,
                    }),
                    Some(_) => {}
                    None => {
                        index.by_server_name.insert(name.as_str().into(), n);
                    }
                }
            }
            // Every network of the route is checked before any is inserted: an overlap with
            // one of the route's own networks must not hide one with another route's.
            let mut clashes = Vec::new();
            for net in egress.client_sources.iter() {
                for (other, &first) in index.by_source.iter() {
                    if first != n && other.overlaps(net) {
                        clashes.push(EgressConflict {
                            kind: "egress.clientSource",
                            key: format!("{other} and {net}"),
                            first: first as usize,
                            second: i,
                        });
                    }
                }
            }
            if clashes.is_empty() {
                for net in egress.client_sources.iter() {
                    index.by_source.insert(*net, n);
                }
            }
            conflicts.extend(clashes);
            if !egress.selected_before_handshake() {
                for id in egress.client_identities.iter() {
                    match index.by_identity.get(id.as_str()) {
                        Some(&first) if first != n => conflicts.push(EgressConflict {
                            kind: "egress.clientIdentity",
                            key: id.clone(),
                            first: first as usize,
                            second: i,
                        }),
                        Some(_) => {}
                        None => {
                            index.by_identity.insert(id.as_str().into(), n);
                        }
                    }
                }
            }
        }
        if !conflicts.is_empty() {
            return Err(conflicts);
        }
        Ok(index)
    }

    /// The route index for a server name already normalised (lower case, no trailing dot).
    pub fn by_server_name(&self, name: &str) -> Option<u32> {
        self.by_server_name.get(name).copied()
    }

    /// The route index whose `clientSources` hold `ip`.
    pub fn by_source(&self, ip: IpAddr) -> Option<u32> {
        self.by_source.lookup(ip).map(|(_, &n)| n)
    }

    /// The route index chosen by one of a leaf's names (CN, DNS SANs) among the routes
    /// chosen by identity; the first name that selects one wins.
    pub fn by_identity<'a>(&self, mut names: impl Iterator<Item = &'a str>) -> Option<u32> {
        names.find_map(|n| self.by_identity.get(n).copied())
    }

    /// Whether any route has egress selectors.
    pub fn is_empty(&self) -> bool {
        self.by_server_name.is_empty() && self.by_source.is_empty() && self.by_identity.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Net {
        s.parse().unwrap()
    }

    fn ranges(list: &[&str]) -> NetSet {
        list.iter().map(|s| net(s)).collect()
    }

    #[test]
    fn allowed_networks_go_via_their_path_and_direct_networks_directly() {
        let mut e = Egress {
            allowed_networks: ranges(&["10.250.0.0/16"]),
            direct_networks: ranges(&["10.1.0.0/16"]),
            ..Egress::default()
        };
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(e.path_for(ip("10.250.3.4")), Some(EgressPath::Tunnel));
        assert_eq!(e.path_for(ip("10.1.3.4")), Some(EgressPath::Direct));
        assert_eq!(e.path_for(ip("10.2.3.4")), None);
        assert_eq!(e.path_for(ip("::1")), None);
        e.via = Via::Direct;
        assert_eq!(e.path_for(ip("10.250.3.4")), Some(EgressPath::Direct));
        // Nothing listed: nothing allowed.
        assert_eq!(Egress::default().path_for(ip("10.250.3.4")), None);
    }

    #[test]
    fn selectors_index_and_conflict() {
        let a = Egress {
            server_names: vec!["a".into()].into(),
            client_sources: vec![net("10.64.0.0/24")].into(),
            client_identities: vec!["x".into()].into(),
            ..Egress::default()
        };
        let b = Egress {
            client_sources: vec![net("10.64.1.10/32")].into(),
            ..Egress::default()
        };
        let c = Egress {
            client_identities: vec!["x".into(), "y".into()].into(),
            ..Egress::default()
        };
        let index = EgressIndex::new([(0, &a), (1, &b), (2, &c)].into_iter()).unwrap();
        assert_eq!(index.by_server_name("a"), Some(0));
        assert_eq!(index.by_server_name("b"), None);
        assert_eq!(index.by_source("10.64.0.7".parse().unwrap()), Some(0));
        assert_eq!(index.by_source("10.64.1.10".parse().unwrap()), Some(1));
        assert_eq!(index.by_source("10.64.1.11".parse().unwrap()), None);
        // `x` of route 0 is only a requirement (it is selected before the handshake): the
        // identity selects route 2.
        assert_eq!(index.by_identity(["z", "x"].into_iter()), Some(2));
        assert_eq!(index.by_identity(["z"].into_iter()), None);

        // Overlapping sources, a shared server name and a shared identity each conflict.
        let d = Egress {
            server_names: vec!["a".into()].into(),
            client_sources: vec![net("10.64.0.128/25")].into(),
            ..Egress::default()
        };
        let e = Egress {
            client_identities: vec!["y".into()].into(),
            ..Egress::default()
        };
        let err = EgressIndex::new([(0, &a), (1, &c), (2, &d), (3, &e)].into_iter()).unwrap_err();
        let kinds: Vec<_> = err.iter().map(|c| (c.kind, c.first, c.second)).collect();
        assert_eq!(
            kinds,
            vec![
                ("egress.serverName", 0, 2),
                ("egress.clientSource", 0, 2),
                ("egress.clientIdentity", 1, 3)
            ]
        );
        // Disjoint neighbours do not conflict.
        let f = Egress {
            client_sources: vec![net("10.64.0.0/25")].into(),
            ..Egress::default()
        };
        let g = Egress {
            client_sources: vec![net("10.64.0.128/25")].into(),
            ..Egress::default()
        };
        EgressIndex::new([(0, &f), (1, &g)].into_iter()).unwrap();
        // A route's own longer network does not hide its overlap with another route's.
        let h = Egress {
            client_sources: vec![net("10.1.0.0/16")].into(),
            ..Egress::default()
        };
        let k = Egress {
            client_sources: vec![net("10.2.3.0/24"), net("10.0.0.0/8")].into(),
            ..Egress::default()
        };
        let err = EgressIndex::new([(0, &h), (1, &k)].into_iter()).unwrap_err();
        assert_eq!(err.len(), 1, "{err:?}");
        assert_eq!((err[0].first, err[0].second), (0, 1));
    }
}
