//! The egress admission decisions, as pure functions of what a connection has shown so far:
//! the route chosen before the handshake ([`route_before_handshake`]), the route a
//! handshaken client is admitted on ([`admit`]), what its request head asks for
//! ([`request`]) and where an allowed target is dialed ([`destination`]). Every way an
//! `egress-connect` connection is refused is one [`Refusal`], which says what the client is
//! answered, what is counted and what is logged.
//!
//! This module does no I/O and knows nothing about tokio, sockets or the clock: the shell in
//! `egress.rs` reads, resolves, handshakes, dials and writes. The decision comes in stages,
//! in the order the shell learns its inputs, because that order is part of the behaviour: a
//! client whose address the route does not admit is refused before it sends a request head.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use thiserror::Error;

use super::super::conn;
use crate::route::{BackendAddress, Egress, EgressPath, Route, RoutingTable};
use crate::serve::record::Outcome;
use crate::wire::http::RequestHead;

/// Most addresses of a resolved name looked at for one the route allows.
pub(super) const MAX_RESOLVED: usize = 16;

/// What became of an egress request (metric label `result`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EgressResult {
    /// The target is connected and the `200` sent.
    Connected,
    /// The TLS handshake failed (no client certificate, one no accepted CA issued, not TLS).
    HandshakeFailed,
    /// The route's TLS material never loaded.
    NoMaterial,
    /// No route for the connection.
    NoRoute,
    /// The route requires an identity the certificate does not carry.
    IdentityMismatch,
    /// The route's `allowedSourceRanges` do not hold the client.
    SourceDenied,
    /// Not a CONNECT.
    NotConnect,
    /// A malformed, oversized or pipelined request.
    BadRequest,
    /// No complete request in time.
    Timeout,
    /// The client closed before a complete request.
    ClosedEarly,
    /// The target is in none of the route's networks.
    TargetDenied,
    /// The target's name did not resolve (answered as `403`, like a target not allowed).
    ResolveFailed,
    /// The target is reached through a tunnel, which is not up.
    NoTunnel,
    /// The target could not be connected (`502`/`504`).
    DialFailed,
}

impl EgressResult {
    /// The result of a ClientHello or request head that could not be read.
    fn before_request(outcome: Outcome) -> Self {
        match outcome {
            Outcome::ClosedEarly => EgressResult::ClosedEarly,
            Outcome::Timeout => EgressResult::Timeout,
            _ => EgressResult::BadRequest,
        }
    }

    /// The metric label.
    pub(super) fn as_str(self) -> &'static str {
        match self {
            EgressResult::Connected => "connected",
            EgressResult::HandshakeFailed => "handshake_failed",
            EgressResult::NoMaterial => "no_material",
            EgressResult::NoRoute => "no_route",
            EgressResult::IdentityMismatch => "identity_mismatch",
            EgressResult::SourceDenied => "source_denied",
            EgressResult::NotConnect => "not_connect",
            EgressResult::BadRequest => "bad_request",
            EgressResult::Timeout => "timeout",
            EgressResult::ClosedEarly => "closed_early",
            EgressResult::TargetDenied => "target_denied",
            EgressResult::ResolveFailed => "resolve_failed",
            EgressResult::NoTunnel => "no_tunnel",
            EgressResult::DialFailed => "dial_failed",
        }
    }
}

/// Why an `egress-connect` connection is refused. Its `Display` is the detail logged (and,
/// but for [`Refusal::SourceDenied`], the body of its status): it names no address.
///
/// The variants the decision functions return come with those the shell meets on its own
/// (a stream that could not be read, a handshake or a dial that failed), so that every
/// refusal is counted, answered and recorded through one path.
#[derive(Debug, Error)]
pub(super) enum Refusal {
    /// No complete ClientHello (the client closed, timed out or sent something else).
    #[error("{}", .0.detail)]
    HelloUnread(conn::Refusal),
    /// The TLS material of the route chosen before the handshake (or the listener's) has
    /// not loaded.
    #[error("the route's TLS material has not loaded")]
    NoMaterial {
        /// The route chosen before the handshake, if any.
        route: Option<Arc<Route>>,
    },
    /// The TLS handshake failed.
    #[error("TLS handshake failed: {error}")]
    HandshakeFailed {
        /// The route chosen before the handshake, if any.
        route: Option<Arc<Route>>,
        /// What the handshake failed with.
        error: std::io::Error,
    },
    /// No TLS handshake before the deadline.
    #[error("no TLS handshake in time")]
    HandshakeTimeout {
        /// The route chosen before the handshake, if any.
        route: Option<Arc<Route>>,
    },
    /// The route chosen before the handshake lists identities, and the leaf carries none.
    #[error("client certificate not accepted")]
    IdentityMismatch {
        /// The route chosen before the handshake.
        route: Arc<Route>,
    },
    /// No route was chosen before the handshake, and the leaf's names select none.
    #[error("no route for this client")]
    NoRoute,
    /// The route's `allowedSourceRanges` do not hold the client.
    #[error("client not in the route's allowedSourceRanges")]
    SourceDenied {
        /// The route that refuses the client.
        route: Arc<Route>,
        /// The client address.
        client: IpAddr,
    },
    /// No complete request head (closed, timed out, malformed or oversized).
    #[error("{}", .refusal.detail)]
    HeadUnread {
        /// The client's route.
        route: Arc<Route>,
        /// What the read stage found.
        refusal: conn::Refusal,
    },
    /// The request is not a CONNECT.
    #[error("only CONNECT is supported")]
    NotConnect {
        /// The client's route.
        route: Arc<Route>,
        /// The method sent.
        method: String,
    },
    /// The client sent bytes after the request head before it was answered.
    #[error("bytes after the request head before the answer")]
    Pipelined {
        /// The client's route.
        route: Arc<Route>,
        /// How many bytes followed the head.
        extra: usize,
    },
    /// The request target is not `host:port` (or its port is 0).
    #[error("the request target must be host:port")]
    BadTarget {
        /// The client's route.
        route: Arc<Route>,
        /// The target as sent.
        target: String,
    },
    /// The route has no `egress` (routes are found through it: not seen in practice).
    #[error("no route for this client")]
    NoEgress {
        /// The client's route.
        route: Arc<Route>,
    },
    /// The target's name did not resolve: answered like a target not allowed, so that a
    /// client does not learn which names exist in the seed's resolver.
    #[error("target not allowed")]
    ResolveFailed {
        /// The client's route.
        route: Arc<Route>,
        /// The name.
        host: String,
    },
    /// No address of the target is in the route's networks.
    #[error("target not allowed")]
    TargetDenied {
        /// The client's route.
        route: Arc<Route>,
        /// How many addresses were looked at (at most [`MAX_RESOLVED`]).
        considered: usize,
    },
    /// The target is reached through a tunnel: the route has none, or the gateway has no
    /// `wireguard` listener.
    #[error("no tunnel to the target's network")]
    NoTunnel {
        /// The client's route.
        route: Arc<Route>,
        /// The allowed address that would have been dialed.
        target: SocketAddr,
    },
    /// The target could not be connected: the dial answered `502`/`504` and finished the
    /// record itself; only the egress result is left to count.
    #[error("the target could not be connected")]
    DialFailed {
        /// The client's route.
        route: Arc<Route>,
    },
}

impl Refusal {
    /// The route it is counted for (`None`: none chosen, the empty label).
    pub(super) fn route(&self) -> Option<&Arc<Route>> {
        match self {
            Refusal::HelloUnread(_) | Refusal::NoRoute => None,
            Refusal::NoMaterial { route }
            | Refusal::HandshakeFailed { route, .. }
            | Refusal::HandshakeTimeout { route } => route.as_ref(),
            Refusal::IdentityMismatch { route }
            | Refusal::SourceDenied { route, .. }
            | Refusal::HeadUnread { route, .. }
            | Refusal::NotConnect { route, .. }
            | Refusal::Pipelined { route, .. }
            | Refusal::BadTarget { route, .. }
            | Refusal::NoEgress { route }
            | Refusal::ResolveFailed { route, .. }
            | Refusal::TargetDenied { route, .. }
            | Refusal::NoTunnel { route, .. }
            | Refusal::DialFailed { route } => Some(route),
        }
    }

    /// The metric label `route` (empty: none chosen).
    pub(super) fn route_label(&self) -> &str {
        self.route().map_or("", |r| r.name())
    }

    /// The metric label `result`.
    pub(super) fn result(&self) -> EgressResult {
        match self {
            Refusal::HelloUnread(r) | Refusal::HeadUnread { refusal: r, .. } => {
                EgressResult::before_request(r.outcome)
            }
            Refusal::NoMaterial { .. } => EgressResult::NoMaterial,
            Refusal::HandshakeFailed { .. } => EgressResult::HandshakeFailed,
            Refusal::HandshakeTimeout { .. } => EgressResult::Timeout,
            Refusal::IdentityMismatch { .. } => EgressResult::IdentityMismatch,
            Refusal::NoRoute | Refusal::NoEgress { .. } => EgressResult::NoRoute,
            Refusal::SourceDenied { .. } => EgressResult::SourceDenied,
            Refusal::NotConnect { .. } => EgressResult::NotConnect,
            Refusal::Pipelined { .. } | Refusal::BadTarget { .. } => EgressResult::BadRequest,
            Refusal::ResolveFailed { .. } => EgressResult::ResolveFailed,
            Refusal::TargetDenied { .. } => EgressResult::TargetDenied,
            Refusal::NoTunnel { .. } => EgressResult::NoTunnel,
            Refusal::DialFailed { .. } => EgressResult::DialFailed,
        }
    }

    /// The downstream outcome the connection is recorded with; `None` for
    /// [`Refusal::DialFailed`], whose record the dial finished (reason `error:<kind>`).
    pub(super) fn outcome(&self) -> Option<Outcome> {
        Some(match self {
            Refusal::HelloUnread(r) | Refusal::HeadUnread { refusal: r, .. } => r.outcome,
            Refusal::HandshakeFailed { error, .. } => {
                match error
                    .get_ref()
                    .and_then(|e| e.downcast_ref::<rustls::Error>())
                {
                    Some(rustls::Error::NoCertificatesPresented)
                    | Some(rustls::Error::InvalidCertificate(_)) => Outcome::Denied,
                    _ => Outcome::BadRequest,
                }
            }
            Refusal::HandshakeTimeout { .. } => Outcome::Timeout,
            Refusal::NoRoute | Refusal::NoEgress { .. } | Refusal::NoTunnel { .. } => {
                Outcome::NoRoute
            }
            Refusal::IdentityMismatch { .. }
            | Refusal::SourceDenied { .. }
            | Refusal::ResolveFailed { .. }
            | Refusal::TargetDenied { .. } => Outcome::Denied,
            Refusal::NoMaterial { .. }
            | Refusal::NotConnect { .. }
            | Refusal::Pipelined { .. }
            | Refusal::BadTarget { .. } => Outcome::BadRequest,
            Refusal::DialFailed { .. } => return None,
        })
    }

    /// The HTTP status the client is answered inside TLS; `None`: nothing is answered
    /// (before or during the handshake there is no TLS to answer in; a failed dial answered
    /// itself).
    pub(super) fn status(&self) -> Option<u16> {
        match self {
            Refusal::HelloUnread(r) | Refusal::HeadUnread { refusal: r, .. } => r.status,
            Refusal::NoMaterial { .. }
            | Refusal::HandshakeFailed { .. }
            | Refusal::HandshakeTimeout { .. }
            | Refusal::DialFailed { .. } => None,
            Refusal::IdentityMismatch { .. }
            | Refusal::NoRoute
            | Refusal::SourceDenied { .. }
            | Refusal::NoEgress { .. }
            | Refusal::ResolveFailed { .. }
            | Refusal::TargetDenied { .. } => Some(403),
            Refusal::NotConnect { .. } => Some(405),
            Refusal::Pipelined { .. } | Refusal::BadTarget { .. } => Some(400),
            Refusal::NoTunnel { .. } => Some(504),
        }
    }

    /// The body of [`Refusal::status`]: the logged detail, but for a client address not
    /// admitted (its log line is the route's `allowedSourceRanges` refusal).
    pub(super) fn body(&self) -> String {
        match self {
            Refusal::SourceDenied { .. } => "client address not allowed".to_owned(),
            other => other.to_string(),
        }
    }
}

/// The route chosen before the handshake, whose certificate is presented and whose client
/// CA alone is accepted: the one whose `serverNames` hold the SNI, else the one whose
/// `clientSources` hold the client address.
pub(super) fn route_before_handshake(
    table: &RoutingTable,
    server_name: Option<&str>,
    source: IpAddr,
) -> Option<Arc<Route>> {
    server_name
        .and_then(|n| table.egress_by_server_name(n))
        .or_else(|| table.egress_by_source(source))
        .cloned()
}

/// The route a handshaken client is admitted on: the one chosen before the handshake
/// (whose identities, if it lists any, the leaf's `names` must hold one of), else the one
/// the leaf's names select; and its `allowedSourceRanges` must hold the client's `source`.
pub(super) fn admit(
    table: &RoutingTable,
    chosen: Option<Arc<Route>>,
    names: &[String],
    source: IpAddr,
) -> Result<Arc<Route>, Refusal> {
    let names = || names.iter().map(String::as_str);
    let route = match chosen {
        Some(route) => {
            let egress = route.egress.as_deref();
            let required = egress.is_some_and(|e| !e.client_identities.is_empty());
            if required && !egress.is_some_and(|e| e.identified_by(names())) {
                return Err(Refusal::IdentityMismatch { route });
            }
            route
        }
        None => table
            .egress_by_identity(names())
            .cloned()
            .ok_or(Refusal::NoRoute)?,
    };
    if !route.admits(source) {
        return Err(Refusal::SourceDenied {
            route,
            client: source,
        });
    }
    Ok(route)
}

/// What a request head asks the route for.
#[derive(Debug)]
pub(super) struct Request<'r> {
    /// The route's egress, which decides the target.
    pub egress: &'r Egress,
    /// The target: an address, or a name for the shell to resolve.
    pub target: BackendAddress,
}

/// Checks a request head of `consumed` bytes, of `buffered` bytes read: one CONNECT with a
/// `host:port` target (port not 0) and nothing after it until it is answered, on a route
/// with an egress.
pub(super) fn request<'r>(
    route: &'r Arc<Route>,
    head: &RequestHead,
    consumed: usize,
    buffered: usize,
) -> Result<Request<'r>, Refusal> {
    if head.method != "CONNECT" {
        return Err(Refusal::NotConnect {
            route: route.clone(),
            method: head.method.clone(),
        });
    }
    if consumed != buffered {
        return Err(Refusal::Pipelined {
            route: route.clone(),
            extra: buffered.saturating_sub(consumed),
        });
    }
    let target = match BackendAddress::parse(&head.target) {
        Ok(BackendAddress::Ip(a)) if a.port() == 0 => None,
        Ok(t) => Some(t),
        Err(_) => None,
    };
    let Some(target) = target else {
        return Err(Refusal::BadTarget {
            route: route.clone(),
            target: head.target.clone(),
        });
    };
    // Routes are found through their egress; a route without one is never chosen.
    let Some(egress) = route.egress.as_deref() else {
        return Err(Refusal::NoEgress {
            route: route.clone(),
        });
    };
    Ok(Request { egress, target })
}

/// Where an allowed target is dialed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan<T> {
    /// The address dialed (an IPv4-mapped IPv6 address as IPv4).
    pub addr: SocketAddr,
    /// The tunnels it is dialed through; `None`: from the gateway's own network.
    pub tunnel: Option<T>,
}

/// The first of the target's `candidates` (its address, or its name's first
/// [`MAX_RESOLVED`] addresses) that `egress` allows, and how it is dialed: through the
/// gateway's `tunnels` (`None`: it has no `wireguard` listener) when the network is reached
/// through the tunnel, which `route` must then have.
pub(super) fn destination<T>(
    route: &Arc<Route>,
    egress: &Egress,
    candidates: &[SocketAddr],
    tunnels: Option<T>,
) -> Result<Plan<T>, Refusal> {
    let considered = candidates.len().min(MAX_RESOLVED);
    let allowed = candidates[..considered].iter().find_map(|a| {
        let ip = match a.ip() {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(a.ip(), IpAddr::V4),
            v4 => v4,
        };
        // `0.0.0.0` and `::` reach the gateway's own host, whatever the lists say.
        if ip.is_unspecified() {
            return None;
        }
        egress
            .path_for(ip)
            .map(|p| (SocketAddr::new(ip, a.port()), p))
    });
    let Some((addr, path)) = allowed else {
        return Err(Refusal::TargetDenied {
            route: route.clone(),
            considered,
        });
    };
    let tunnel = match (path, tunnels) {
        (EgressPath::Tunnel, Some(t)) if route.tunnel.is_some() => Some(t),
        (EgressPath::Tunnel, _) => {
            return Err(Refusal::NoTunnel {
                route: route.clone(),
                target: addr,
            });
        }
        (EgressPath::Direct, _) => None,
    };
    Ok(Plan { addr, tunnel })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::{Net, NetSet, SourceRanges, Tunnel, Via};

    fn net(s: &str) -> Net {
        s.parse().unwrap()
    }

    fn nets(list: &[&str]) -> NetSet {
        list.iter().map(|s| net(s)).collect()
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// A route named `name` with this egress.
    fn route(name: &str, egress: Egress) -> Route {
        let mut r = Route::new::<&str, &str>(name, &[], &[], vec![], vec![]).unwrap();
        r.egress = Some(Box::new(egress));
        r
    }

    /// A route that reaches `10.250.0.0/16` through its tunnel and `10.1.0.0/16` directly.
    fn networks(name: &str) -> Arc<Route> {
        let mut r = route(
            name,
            Egress {
                allowed_networks: nets(&["10.250.0.0/16"]),
                direct_networks: nets(&["10.1.0.0/16"]),
                ..Egress::default()
            },
        );
        r.tunnel = Some(Box::new(Tunnel {
            peers: Box::new([]),
            local_addresses: Box::new([]),
        }));
        Arc::new(r)
    }

    /// Three routes: `by-name` chosen by SNI (requiring `vpn-a`), `by-source` by client
    /// address (requiring nothing, admitting only `10.64.1.0/25`) and `by-identity` by the
    /// leaf's `vpn-c`.
    fn table() -> RoutingTable {
        let by_name = route(
            "by-name",
            Egress {
                server_names: names(&["shoot-a.example"]).into(),
                client_identities: names(&["vpn-a"]).into(),
                ..Egress::default()
            },
        );
        let mut by_source = route(
            "by-source",
            Egress {
                client_sources: vec![net("10.64.1.0/24")].into(),
                ..Egress::default()
            },
        );
        by_source.allowed_sources = Some(SourceRanges::from_nets([net("10.64.1.0/25")]).unwrap());
        let mut by_identity = route(
            "by-identity",
            Egress {
                client_identities: names(&["vpn-c"]).into(),
                ..Egress::default()
            },
        );
        by_identity.allowed_sources = Some(SourceRanges::from_nets([net("10.64.9.0/24")]).unwrap());
        RoutingTable::new(vec![by_name, by_source, by_identity]).unwrap()
    }

    fn head(method: &str, target: &str) -> RequestHead {
        RequestHead {
            method: method.into(),
            target: target.into(),
            minor_version: 1,
            headers: vec![],
        }
    }

    /// What a refusal sends and records: (route label, result label, outcome, status, body,
    /// log detail).
    type Sent = (
        String,
        &'static str,
        Option<&'static str>,
        Option<u16>,
        String,
        String,
    );

    fn sent(r: &Refusal) -> Sent {
        (
            r.route_label().to_owned(),
            r.result().as_str(),
            r.outcome().map(Outcome::as_str),
            r.status(),
            r.body(),
            r.to_string(),
        )
    }

    /// What a refusal on route `route` answers `status` with `text` (body and log alike).
    fn answered(
        route: &str,
        result: &'static str,
        outcome: &'static str,
        status: u16,
        text: &str,
    ) -> Sent {
        (
            route.into(),
            result,
            Some(outcome),
            Some(status),
            text.into(),
            text.into(),
        )
    }

    fn route_name(r: &Result<Arc<Route>, Refusal>) -> &str {
        r.as_ref().map_or("(refused)", |r| r.name())
    }

    /// SNI first, the client address only when the SNI selects nothing (or there is none):
    /// a mutant that asks the address first, or gives up on an unknown SNI, picks wrongly.
    #[test]
    fn a_route_is_chosen_before_the_handshake_by_server_name_then_source() {
        let t = table();
        let chosen = |sni: Option<&str>, source: &str| {
            route_before_handshake(&t, sni, ip(source)).map(|r| r.name().to_owned())
        };
        let client = "10.64.1.5";
        assert_eq!(
            chosen(Some("shoot-a.example"), client).as_deref(),
            Some("by-name")
        );
        assert_eq!(
            chosen(Some("unknown.example"), client).as_deref(),
            Some("by-source")
        );
        assert_eq!(chosen(None, client).as_deref(), Some("by-source"));
        assert_eq!(chosen(None, "10.9.9.9"), None);
        // The identity routes are not chosen before the handshake.
        assert_eq!(chosen(Some("vpn-c"), "10.64.9.1"), None);
    }

    /// A route chosen before the handshake that lists identities admits a leaf carrying one
    /// of them among any of its names, and refuses one that carries none: an inverted check
    /// fails both, a check of the first name only fails the second case.
    #[test]
    fn a_route_chosen_before_the_handshake_requires_one_of_its_identities() {
        let t = table();
        let chosen = t.by_name("by-name").cloned();
        let client = ip("10.64.5.5");
        let refused = admit(&t, chosen.clone(), &names(&["vpn-b", "other"]), client);
        let Err(refusal) = &refused else {
            panic!("admitted on {}", route_name(&refused))
        };
        assert!(
            matches!(refusal, Refusal::IdentityMismatch { route } if route.name() == "by-name")
        );
        assert_eq!(
            sent(refusal),
            answered(
                "by-name",
                "identity_mismatch",
                "denied",
                403,
                "client certificate not accepted"
            )
        );
        let admitted = admit(&t, chosen.clone(), &names(&["other", "vpn-a"]), client);
        assert_eq!(route_name(&admitted), "by-name");
        // No leaf names at all: refused too.
        assert!(matches!(
            admit(&t, chosen, &[], client),
            Err(Refusal::IdentityMismatch { .. })
        ));
    }

    /// A route chosen before the handshake that lists no identities admits any leaf (a
    /// mutant that always requires one refuses it).
    #[test]
    fn a_route_without_identities_admits_any_leaf() {
        let t = table();
        let chosen = t.by_name("by-source").cloned();
        let admitted = admit(&t, chosen, &names(&["anything"]), ip("10.64.1.5"));
        assert_eq!(route_name(&admitted), "by-source");
    }

    /// Without a route chosen before the handshake, one of the leaf's names must select one;
    /// an identity that only a route chosen before the handshake requires selects nothing.
    #[test]
    fn without_a_chosen_route_the_leaf_selects_one_or_none() {
        let t = table();
        let client = ip("10.64.9.7");
        for leaf in [&["vpn-x"][..], &["vpn-a"], &[]] {
            let refused = admit(&t, None, &names(leaf), client);
            let Err(refusal) = &refused else {
                panic!("{leaf:?} admitted on {}", route_name(&refused))
            };
            assert!(matches!(refusal, Refusal::NoRoute), "{refusal:?}");
            assert_eq!(
                sent(refusal),
                answered("", "no_route", "no_route", 403, "no route for this client")
            );
        }
        let admitted = admit(&t, None, &names(&["vpn-x", "vpn-c"]), client);
        assert_eq!(route_name(&admitted), "by-identity");
    }

    /// The route's `allowedSourceRanges` hold the client or refuse it, on a route chosen
    /// before the handshake and on one chosen by identity alike (a mutant that checks one
    /// branch only, or none, is caught); the identity is checked first.
    #[test]
    fn the_route_must_admit_the_client_address() {
        let t = table();
        let by_source = t.by_name("by-source").cloned();
        let admitted = admit(&t, by_source.clone(), &[], ip("10.64.1.126"));
        assert_eq!(route_name(&admitted), "by-source");
        let refused = admit(&t, by_source, &[], ip("10.64.1.200"));
        let Err(refusal) = &refused else {
            panic!("admitted on {}", route_name(&refused))
        };
        assert!(matches!(
            refusal,
            Refusal::SourceDenied { route, client }
                if route.name() == "by-source" && *client == ip("10.64.1.200")
        ));
        // The client reads one text, the log says which rule refused it.
        assert_eq!(
            sent(refusal),
            (
                "by-source".into(),
                "source_denied",
                Some("denied"),
                Some(403),
                "client address not allowed".into(),
                "client not in the route's allowedSourceRanges".into(),
            )
        );

        let leaf = names(&["vpn-c"]);
        let admitted = admit(&t, None, &leaf, ip("10.64.9.1"));
        assert_eq!(route_name(&admitted), "by-identity");
        assert!(matches!(
            admit(&t, None, &leaf, ip("10.64.1.1")),
            Err(Refusal::SourceDenied { route, .. }) if route.name() == "by-identity"
        ));

        // A leaf the chosen route does not accept, from an address it does not admit: the
        // identity is what the client is told.
        let mut strict = route(
            "strict",
            Egress {
                server_names: names(&["strict.example"]).into(),
                client_identities: names(&["vpn-s"]).into(),
                ..Egress::default()
            },
        );
        strict.allowed_sources = Some(SourceRanges::from_nets([net("10.0.0.0/8")]).unwrap());
        let strict = Some(Arc::new(strict));
        assert!(matches!(
            admit(&t, strict, &names(&["vpn-x"]), ip("192.0.2.1")),
            Err(Refusal::IdentityMismatch { .. })
        ));
    }

    /// One CONNECT head and nothing after it: a method other than CONNECT is `405`.
    #[test]
    fn only_connect_is_accepted() {
        let r = networks("r");
        let refusal = request(&r, &head("GET", "10.250.0.1:443"), 40, 40).unwrap_err();
        assert!(matches!(&refusal, Refusal::NotConnect { method, .. } if method == "GET"));
        assert_eq!(
            sent(&refusal),
            answered(
                "r",
                "not_connect",
                "bad_request",
                405,
                "only CONNECT is supported"
            )
        );
        // Methods are case-sensitive (RFC 9110 §9.1).
        assert!(matches!(
            request(&r, &head("connect", "10.250.0.1:443"), 40, 40),
            Err(Refusal::NotConnect { .. })
        ));
        // The method is checked before anything else about the request.
        assert!(matches!(
            request(&r, &head("GET", "nonsense"), 40, 41),
            Err(Refusal::NotConnect { .. })
        ));
    }

    /// A byte after the head before the answer is `400` (a mutant that lets it through, or
    /// that only counts a surplus of more than one byte, is caught).
    #[test]
    fn bytes_after_the_head_are_refused() {
        let r = networks("r");
        let refusal = request(&r, &head("CONNECT", "10.250.0.1:443"), 40, 41).unwrap_err();
        assert!(matches!(refusal, Refusal::Pipelined { extra: 1, .. }));
        assert_eq!(
            sent(&refusal),
            answered(
                "r",
                "bad_request",
                "bad_request",
                400,
                "bytes after the request head before the answer"
            )
        );
        let ok = request(&r, &head("CONNECT", "10.250.0.1:443"), 40, 40).unwrap();
        assert_eq!(ok.target, BackendAddress::Ip(addr("10.250.0.1:443")));
        // Checked before the target.
        assert!(matches!(
            request(&r, &head("CONNECT", "nonsense"), 40, 41),
            Err(Refusal::Pipelined { .. })
        ));
    }

    /// The target is `host:port` with a port other than 0: an address or a name; port 1 is
    /// a port (an off-by-one bound would refuse it).
    #[test]
    fn the_target_must_be_host_and_port() {
        let r = networks("r");
        for bad in [
            "10.250.0.1:0",
            "[::1]:0",
            "kube.example:0",
            "kube.example",
            "10.250.0.1",
            "kube.example:http",
            "kube.example:65536",
            "/api",
        ] {
            let refusal = request(&r, &head("CONNECT", bad), 40, 40).unwrap_err();
            assert!(
                matches!(&refusal, Refusal::BadTarget { target, .. } if target == bad),
                "{bad}: {refusal:?}"
            );
            assert_eq!(
                sent(&refusal),
                answered(
                    "r",
                    "bad_request",
                    "bad_request",
                    400,
                    "the request target must be host:port"
                ),
                "{bad}"
            );
        }
        let target = |t: &str| request(&r, &head("CONNECT", t), 40, 40).unwrap().target;
        assert_eq!(
            target("10.250.0.1:1"),
            BackendAddress::Ip(addr("10.250.0.1:1"))
        );
        assert_eq!(target("[::1]:443"), BackendAddress::Ip(addr("[::1]:443")));
        assert_eq!(
            target("kube.example:1"),
            BackendAddress::Dns {
                host: "kube.example".into(),
                port: 1
            }
        );
    }

    /// A route without egress (never chosen: routes are found through it) refuses as a
    /// missing route, counted for that route; the request is checked first.
    #[test]
    fn a_route_without_egress_has_no_route_for_the_client() {
        let r = Arc::new(Route::new::<&str, &str>("plain", &[], &[], vec![], vec![]).unwrap());
        let refusal = request(&r, &head("CONNECT", "10.250.0.1:443"), 40, 40).unwrap_err();
        assert!(matches!(refusal, Refusal::NoEgress { .. }));
        assert_eq!(
            sent(&refusal),
            answered(
                "plain",
                "no_route",
                "no_route",
                403,
                "no route for this client"
            )
        );
        assert!(matches!(
            request(&r, &head("CONNECT", "nonsense"), 40, 40),
            Err(Refusal::BadTarget { .. })
        ));
    }

    /// `allowedNetworks` go through the tunnel, `directNetworks` (and `allowedNetworks` with
    /// `via: direct`) from the gateway's network: a mutant that dials everything one way is
    /// caught.
    #[test]
    fn allowed_targets_are_dialed_on_their_path() {
        let r = networks("r");
        let egress = r.egress.as_deref().unwrap();
        let plan = |target: &str| destination(&r, egress, &[addr(target)], Some("wg"));
        assert_eq!(
            plan("10.250.3.4:443").unwrap(),
            Plan {
                addr: addr("10.250.3.4:443"),
                tunnel: Some("wg")
            }
        );
        assert_eq!(
            plan("10.1.3.4:443").unwrap(),
            Plan {
                addr: addr("10.1.3.4:443"),
                tunnel: None
            }
        );
        let mut direct = (*r).clone();
        direct.egress.as_mut().unwrap().via = Via::Direct;
        let direct = Arc::new(direct);
        let egress = direct.egress.as_deref().unwrap();
        assert_eq!(
            destination(&direct, egress, &[addr("10.250.3.4:443")], Some("wg")).unwrap(),
            Plan {
                addr: addr("10.250.3.4:443"),
                tunnel: None
            }
        );
    }

    /// A target in none of the route's networks is `403`; so are the unspecified addresses,
    /// even inside an allowed network (they reach the gateway's own host).
    #[test]
    fn targets_outside_the_networks_are_denied() {
        let r = Arc::new(route(
            "r",
            Egress {
                direct_networks: nets(&["10.1.0.0/16"]),
                ..Egress::default()
            },
        ));
        let egress = r.egress.as_deref().unwrap();
        let refusal = destination(&r, egress, &[addr("10.2.0.1:443")], Some(())).unwrap_err();
        assert!(matches!(
            refusal,
            Refusal::TargetDenied { considered: 1, .. }
        ));
        assert_eq!(
            sent(&refusal),
            answered("r", "target_denied", "denied", 403, "target not allowed")
        );
        assert!(matches!(
            destination(&r, egress, &[], Some(())),
            Err(Refusal::TargetDenied { considered: 0, .. })
        ));

        let everything = Arc::new(route(
            "everything",
            Egress {
                direct_networks: nets(&["0.0.0.0/0", "::/0"]),
                ..Egress::default()
            },
        ));
        let egress = everything.egress.as_deref().unwrap();
        for unspecified in ["0.0.0.0:443", "[::]:443", "[::ffff:0.0.0.0]:443"] {
            assert!(
                matches!(
                    destination(&everything, egress, &[addr(unspecified)], None::<()>),
                    Err(Refusal::TargetDenied { .. })
                ),
                "{unspecified}"
            );
        }
        assert!(destination(&everything, egress, &[addr("[::1]:443")], None::<()>).is_ok());
    }

    /// An IPv4-mapped IPv6 target is matched and dialed as IPv4.
    #[test]
    fn a_mapped_address_is_dialed_as_ipv4() {
        let r = networks("r");
        let egress = r.egress.as_deref().unwrap();
        let plan = destination(&r, egress, &[addr("[::ffff:10.1.2.3]:443")], None::<()>);
        assert_eq!(
            plan.unwrap(),
            Plan {
                addr: addr("10.1.2.3:443"),
                tunnel: None
            }
        );
    }

    /// A name's first allowed address is dialed, among its first [`MAX_RESOLVED`]: the
    /// sixteenth counts, the seventeenth does not (either off-by-one is caught).
    #[test]
    fn a_name_goes_to_its_first_allowed_address_among_the_first_sixteen() {
        let r = networks("r");
        let egress = r.egress.as_deref().unwrap();
        let resolved = [
            addr("10.2.0.1:443"),
            addr("10.1.0.7:443"),
            addr("10.1.0.8:443"),
        ];
        assert_eq!(
            destination(&r, egress, &resolved, None::<()>).unwrap().addr,
            addr("10.1.0.7:443")
        );

        let denied: Vec<SocketAddr> = (1..=16).map(|i| addr(&format!("10.2.0.{i}:443"))).collect();
        let mut sixteenth = denied[..15].to_vec();
        sixteenth.push(addr("10.1.0.16:443"));
        assert_eq!(
            destination(&r, egress, &sixteenth, None::<()>)
                .unwrap()
                .addr,
            addr("10.1.0.16:443")
        );
        let mut seventeenth = denied.clone();
        seventeenth.push(addr("10.1.0.17:443"));
        assert!(matches!(
            destination(&r, egress, &seventeenth, None::<()>),
            Err(Refusal::TargetDenied { considered: 16, .. })
        ));
    }

    /// A target through the tunnel needs the gateway's tunnels and the route's tunnel: with
    /// either missing it is `504` (a mutant that drops either condition dials directly).
    #[test]
    fn a_tunnel_target_needs_a_tunnel() {
        let r = networks("r");
        let egress = r.egress.as_deref().unwrap();
        let target = addr("10.250.0.9:443");
        let refusal = destination(&r, egress, &[target], None::<()>).unwrap_err();
        assert!(matches!(refusal, Refusal::NoTunnel { target: t, .. } if t == target));
        assert_eq!(
            sent(&refusal),
            answered(
                "r",
                "no_tunnel",
                "no_route",
                504,
                "no tunnel to the target's network"
            )
        );
        let mut untunneled = (*r).clone();
        untunneled.tunnel = None;
        let untunneled = Arc::new(untunneled);
        let egress = untunneled.egress.as_deref().unwrap();
        assert!(matches!(
            destination(&untunneled, egress, &[target], Some(())),
            Err(Refusal::NoTunnel { .. })
        ));
        // Its direct networks need neither.
        assert!(destination(&untunneled, egress, &[addr("10.1.0.9:443")], None::<()>).is_ok());
    }

    /// What the shell's own refusals send and record: nothing is answered outside TLS or
    /// after a failed dial; a read stage's status, outcome and detail are kept.
    #[test]
    fn refusals_met_by_the_shell() {
        let r = networks("r");
        let read = |outcome: Outcome, status: Option<u16>, detail: &str| conn::Refusal {
            outcome,
            detail: detail.into(),
            status,
        };
        let unanswered = |route: &str, result, outcome: Option<&'static str>, text: &str| {
            (
                route.to_owned(),
                result,
                outcome,
                None,
                text.to_owned(),
                text.to_owned(),
            )
        };
        let cases: Vec<(Refusal, Sent)> = vec![
            (
                Refusal::HelloUnread(read(Outcome::ClosedEarly, None, "client closed")),
                unanswered("", "closed_early", Some("closed_early"), "client closed"),
            ),
            (
                Refusal::HelloUnread(read(Outcome::Timeout, None, "late")),
                unanswered("", "timeout", Some("timeout"), "late"),
            ),
            (
                Refusal::HelloUnread(read(Outcome::NotTls, None, "not TLS")),
                unanswered("", "bad_request", Some("not_tls"), "not TLS"),
            ),
            (
                Refusal::NoMaterial { route: None },
                unanswered(
                    "",
                    "no_material",
                    Some("bad_request"),
                    "the route's TLS material has not loaded",
                ),
            ),
            (
                Refusal::NoMaterial {
                    route: Some(r.clone()),
                },
                unanswered(
                    "r",
                    "no_material",
                    Some("bad_request"),
                    "the route's TLS material has not loaded",
                ),
            ),
            (
                Refusal::HandshakeFailed {
                    route: Some(r.clone()),
                    error: std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        rustls::Error::NoCertificatesPresented,
                    ),
                },
                unanswered(
                    "r",
                    "handshake_failed",
                    Some("denied"),
                    "TLS handshake failed: peer sent no certificates",
                ),
            ),
            (
                Refusal::HandshakeFailed {
                    route: None,
                    error: std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
                    ),
                },
                unanswered(
                    "",
                    "handshake_failed",
                    Some("denied"),
                    "TLS handshake failed: invalid peer certificate: UnknownIssuer",
                ),
            ),
            (
                Refusal::HandshakeFailed {
                    route: None,
                    error: std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "eof"),
                },
                unanswered(
                    "",
                    "handshake_failed",
                    Some("bad_request"),
                    "TLS handshake failed: eof",
                ),
            ),
            (
                Refusal::HandshakeTimeout { route: None },
                unanswered("", "timeout", Some("timeout"), "no TLS handshake in time"),
            ),
            (
                Refusal::HeadUnread {
                    route: r.clone(),
                    refusal: read(Outcome::Timeout, Some(408), "no request head in time"),
                },
                answered("r", "timeout", "timeout", 408, "no request head in time"),
            ),
            (
                Refusal::HeadUnread {
                    route: r.clone(),
                    refusal: read(Outcome::BadRequest, Some(431), "too large"),
                },
                answered("r", "bad_request", "bad_request", 431, "too large"),
            ),
            (
                Refusal::HeadUnread {
                    route: r.clone(),
                    refusal: read(Outcome::ClosedEarly, None, "client closed"),
                },
                unanswered("r", "closed_early", Some("closed_early"), "client closed"),
            ),
            (
                Refusal::ResolveFailed {
                    route: r.clone(),
                    host: "nowhere.invalid".into(),
                },
                answered("r", "resolve_failed", "denied", 403, "target not allowed"),
            ),
            (
                Refusal::DialFailed { route: r.clone() },
                unanswered(
                    "r",
                    "dial_failed",
                    None,
                    "the target could not be connected",
                ),
            ),
        ];
        for (refusal, expected) in &cases {
            assert_eq!(&sent(refusal), expected, "{refusal:?}");
        }
    }
}
