//! `egress-connect` listener: kube-apiserver egress, HTTP CONNECT over mutual TLS.
//!
//! The route is chosen before the handshake when it can be — a route whose `serverNames`
//! hold the ClientHello's SNI, else one whose `clientSources` hold the client address — so
//! that route's own server certificate is presented and its client CA is the only one
//! accepted (hundreds of shoots' CAs share the subject `CN=vpn`; one trust store holding them
//! all would not verify). Otherwise the listener's certificate and CA are used and, after the
//! handshake, the route is the one whose `clientIdentities` hold the leaf's CN or a DNS SAN.
//! A route chosen before the handshake that lists identities requires the leaf to carry one.
//!
//! Inside TLS the client sends `CONNECT <ip-or-name>:<port>` and nothing else until it is
//! answered: the target must be in the route's `allowedNetworks` or `directNetworks` (a name
//! is resolved here, and its first allowed address dialed); the answer is exactly
//! `HTTP/1.1 200 Connection established` with a blank line, written and flushed on its own,
//! once the target is connected. Every refusal answers a status whose body names no address
//! and closes. `allowedNetworks` go through the shoot's WireGuard tunnel (a reset there is
//! `502`, no live peer or no answer `504`); a route without a tunnel, or a gateway without a
//! `wireguard` listener, answers `504`, counted `no_tunnel` (with `via: direct` they are
//! dialed from the gateway's network). Each result is counted in
//! `trellis_egress_requests_total{route, result}`.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tokio::net::TcpStream;

use super::Shared;
use super::conn::{Conn, Ready};
use crate::net::dial::Dest;
use crate::net::prefixed::Prefixed;
use crate::net::relay::Either;
use crate::net::tls::{ServerStream, identities};
use crate::route::{BackendAddress, EgressPath, Route, TlsFiles};
use crate::serve::forward::Reply;
use crate::serve::record::Outcome;
use crate::tunnel::TunnelStream;
use crate::tunnel::dialer::ViaTunnel;
use crate::wire::http;

/// A linked egress connection: TLS to the client, TCP to the target.
pub(super) type EgressReady = Ready<ServerStream, Either<TcpStream, TunnelStream>>;

/// Most addresses of a resolved name looked at for one the route allows.
const MAX_RESOLVED: usize = 16;

/// What became of an egress request (metric label `result`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EgressResult {
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

    /// The downstream outcome a refusal with this result is counted as.
    fn outcome(self) -> Outcome {
        match self {
            EgressResult::NoRoute | EgressResult::NoTunnel => Outcome::NoRoute,
            EgressResult::IdentityMismatch
            | EgressResult::SourceDenied
            | EgressResult::TargetDenied
            | EgressResult::ResolveFailed => Outcome::Denied,
            EgressResult::Timeout => Outcome::Timeout,
            EgressResult::ClosedEarly => Outcome::ClosedEarly,
            EgressResult::Connected
            | EgressResult::HandshakeFailed
            | EgressResult::NoMaterial
            | EgressResult::NotConnect
            | EgressResult::BadRequest
            | EgressResult::DialFailed => Outcome::BadRequest,
        }
    }

    fn as_str(self) -> &'static str {
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

/// Takes one `egress-connect` connection from its ClientHello to a linked target (`None`:
/// it ended before).
pub(super) async fn handle(
    mut conn: Box<Conn<TcpStream>>,
    listener_tls: &TlsFiles,
    shared: &Shared,
) -> Option<Box<EgressReady>> {
    let count = |route: &str, result: EgressResult| shared.metrics.egress(route, result.as_str());

    // The ClientHello, read and left in the buffer for the handshake: its SNI may choose the
    // route, and with it the certificate to present.
    let max = shared.config.limits.max_client_hello_bytes;
    let server_name = match conn.client_hello(max).await {
        Ok(hello) => hello.server_name,
        Err(refusal) => {
            count("", EgressResult::before_request(refusal.outcome));
            return conn.refuse(refusal).await;
        }
    };

    let snapshot = shared.tables.snapshot();
    let table = snapshot.table();
    let chosen: Option<Arc<Route>> = server_name
        .as_deref()
        .and_then(|n| table.egress_by_server_name(n))
        .or_else(|| table.egress_by_source(conn.source.ip()))
        .cloned();
    let files = chosen
        .as_ref()
        .and_then(|r| r.egress.as_ref()?.tls.as_ref())
        .unwrap_or(listener_tls);
    let route_name = chosen.as_ref().map_or("", |r| r.name());
    let server_config = match shared.certs.get(files) {
        Some(config) => Some(config),
        // A route of a table published a moment ago: its set is loaded here, off the event
        // loop, rather than refused until the reload task takes the table in.
        None if chosen.is_some() => {
            let (certs, files) = (shared.certs.clone(), files.clone());
            tokio::task::spawn_blocking(move || certs.load_missing(&files))
                .await
                .ok()
                .flatten()
        }
        None => None,
    };
    let Some(server_config) = server_config else {
        count(route_name, EgressResult::NoMaterial);
        return conn.reject(
            Outcome::BadRequest,
            "the route's TLS material has not loaded",
        );
    };

    // The handshake, on the bytes read so far and then the socket, under the same deadline.
    let Conn {
        stream,
        buf,
        deadline,
        mut record,
        guard,
        source,
        destination,
    } = *conn;
    let acceptor = tokio_rustls::TlsAcceptor::from(server_config);
    let accepted =
        tokio::time::timeout_at(deadline, acceptor.accept(Prefixed::new(buf, stream))).await;
    let tls = match accepted {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            count(route_name, EgressResult::HandshakeFailed);
            let outcome = match e.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) {
                Some(rustls::Error::NoCertificatesPresented)
                | Some(rustls::Error::InvalidCertificate(_)) => Outcome::Denied,
                _ => Outcome::BadRequest,
            };
            record.reject(outcome, &format!("TLS handshake failed: {e}"));
            return None;
        }
        Err(_) => {
            count(route_name, EgressResult::Timeout);
            record.reject(Outcome::Timeout, "no TLS handshake in time");
            return None;
        }
    };
    let names = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|leaf| identities(leaf))
        .unwrap_or_default();
    record.identity = names.first().cloned();
    let mut conn = Box::new(Conn {
        stream: tls,
        buf: Vec::new(),
        deadline,
        record,
        guard,
        source,
        destination,
    });

    // The route: the one chosen before the handshake (whose identities, if listed, the leaf
    // must carry), else the one the leaf's identity selects.
    let route = match chosen {
        Some(route) => {
            let egress = route.egress.as_deref();
            let required = egress.is_some_and(|e| !e.client_identities.is_empty());
            if required
                && !egress.is_some_and(|e| e.identified_by(names.iter().map(String::as_str)))
            {
                return refuse(
                    conn,
                    shared,
                    route.name(),
                    EgressResult::IdentityMismatch,
                    403,
                    "client certificate not accepted",
                )
                .await;
            }
            route
        }
        None => match table.egress_by_identity(names.iter().map(String::as_str)) {
            Some(route) => route.clone(),
            None => {
                return refuse(
                    conn,
                    shared,
                    "",
                    EgressResult::NoRoute,
                    403,
                    "no route for this client",
                )
                .await;
            }
        },
    };
    drop(snapshot);
    if !route.admits(conn.source.ip()) {
        count(route.name(), EgressResult::SourceDenied);
        conn.reject_with(&http::response(403, "client address not allowed"))
            .await;
        return conn.deny(route);
    }
    let name = route.name();

    // The request: one CONNECT head, and nothing after it until it is answered.
    let max = shared.config.limits.max_header_bytes;
    let (head, consumed) = match conn.request_head(max).await {
        Ok(x) => x,
        Err(refusal) => {
            count(name, EgressResult::before_request(refusal.outcome));
            return conn.refuse(refusal).await;
        }
    };
    conn.record.target = Some(head.target.clone());
    if head.method != "CONNECT" {
        return refuse(
            conn,
            shared,
            name,
            EgressResult::NotConnect,
            405,
            "only CONNECT is supported",
        )
        .await;
    }
    if consumed != conn.buf.len() {
        return refuse(
            conn,
            shared,
            name,
            EgressResult::BadRequest,
            400,
            "bytes after the request head before the answer",
        )
        .await;
    }
    conn.consume(consumed);
    let target = match BackendAddress::parse(&head.target) {
        Ok(BackendAddress::Ip(a)) if a.port() == 0 => None,
        Ok(t) => Some(t),
        Err(_) => None,
    };
    let Some(target) = target else {
        return refuse(
            conn,
            shared,
            name,
            EgressResult::BadRequest,
            400,
            "the request target must be host:port",
        )
        .await;
    };

    // Where it may go: an allowed address, a name's first allowed address.
    let Some(egress) = route.egress.as_deref() else {
        // Routes are found through their egress; a route without one is never chosen.
        return refuse(
            conn,
            shared,
            name,
            EgressResult::NoRoute,
            403,
            "no route for this client",
        )
        .await;
    };
    let candidates: Vec<SocketAddr> = match &target {
        BackendAddress::Ip(a) => vec![*a],
        BackendAddress::Dns { host, port } => {
            // The process's resolver: cached, one lookup per name in flight, bounded.
            match shared.dialer.resolver.resolve(host, conn.deadline).await {
                Ok(ips) => ips
                    .iter()
                    .take(MAX_RESOLVED)
                    .map(|ip| SocketAddr::new(*ip, *port))
                    .collect(),
                Err(_) => {
                    // Answered like a name that resolves to nothing allowed: a client must
                    // not learn which names exist in the seed's resolver.
                    return refuse(
                        conn,
                        shared,
                        name,
                        EgressResult::ResolveFailed,
                        403,
                        "target not allowed",
                    )
                    .await;
                }
            }
        }
    };
    let allowed = candidates.into_iter().find_map(|a| {
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
    let (addr, path) = match allowed {
        Some(x) => x,
        None => {
            return refuse(
                conn,
                shared,
                name,
                EgressResult::TargetDenied,
                403,
                "target not allowed",
            )
            .await;
        }
    };
    let tunnels = match (path, &shared.tunnels) {
        (EgressPath::Tunnel, Some(t)) if route.tunnel.is_some() => Some(t),
        (EgressPath::Tunnel, _) => {
            return refuse(
                conn,
                shared,
                name,
                EgressResult::NoTunnel,
                504,
                "no tunnel to the target's network",
            )
            .await;
        }
        _ => None,
    };
    let dest = BackendAddress::Ip(addr);
    let dialer = ViaTunnel {
        direct: &shared.dialer,
        tunnels,
    };
    match conn
        .link_with(&route, Dest::Address(&dest), Reply::Http, shared, &dialer)
        .await
    {
        Some(ready) => {
            count(name, EgressResult::Connected);
            Some(Box::new(ready))
        }
        None => {
            count(name, EgressResult::DialFailed);
            None
        }
    }
}

/// Counts `result` for `route` (empty: none chosen), answers `status` (with `detail`, which
/// names no address), closes, and counts the connection's outcome.
async fn refuse(
    mut conn: Box<Conn<ServerStream>>,
    shared: &Shared,
    route: &str,
    result: EgressResult,
    status: u16,
    detail: &str,
) -> Option<Box<EgressReady>> {
    shared.metrics.egress(route, result.as_str());
    conn.reject_with(&http::response(status, detail)).await;
    conn.reject(result.outcome(), detail)
}
