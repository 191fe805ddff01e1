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
//!
//! This file is the I/O shell: it reads the ClientHello and the request head, handshakes,
//! resolves and dials. Every decision is a pure function in [`decide`], and every refusal a
//! [`Refusal`] that [`refuse`] counts, answers and records in one place.

mod decide;

use std::net::SocketAddr;

use tokio::net::TcpStream;

use super::Shared;
use super::conn::{Conn, Ready};
use crate::net::dial::Dest;
use crate::net::prefixed::Prefixed;
use crate::net::relay::{Either, Leg};
use crate::net::tls::{ServerStream, identities};
use crate::route::{BackendAddress, TlsFiles};
use crate::serve::forward::Reply;
use crate::serve::record::ConnRecord;
use crate::serve::tracker::ConnGuard;
use crate::tunnel::TunnelStream;
use crate::tunnel::dialer::ViaTunnel;
use crate::wire::http;
use decide::{EgressResult, Refusal};

/// A linked egress connection: TLS to the client, TCP to the target.
pub(super) type EgressReady = Ready<ServerStream, Either<TcpStream, TunnelStream>>;

/// What is left of a refused connection: what its answer is written on and its record
/// finished with.
enum Leftover {
    /// Before the handshake: the accepted connection (nothing is answered on it).
    Tcp(Box<Conn<TcpStream>>),
    /// A handshake that failed or timed out: the stream is gone, its record and guard stay.
    Handshake(ConnRecord, ConnGuard),
    /// Inside TLS: the client is answered there.
    Tls(Box<Conn<ServerStream>>),
    /// Nothing: the dial answered the client and finished the record.
    Finished,
}

/// A refused connection: what is left of it, and why.
type Refused = (Leftover, Refusal);

/// Takes one `egress-connect` connection from its ClientHello to a linked target (`None`:
/// it ended before).
pub(super) async fn handle(
    conn: Box<Conn<TcpStream>>,
    listener_tls: &TlsFiles,
    shared: &Shared,
) -> Option<Box<EgressReady>> {
    match link(conn, listener_tls, shared).await {
        Ok(ready) => Some(ready),
        Err((left, refusal)) => {
            refuse(left, refusal, shared).await;
            None
        }
    }
}

/// The stages, each read followed by its decision: ClientHello, route before the
/// handshake, handshake, admission, request head, request, resolution, destination, dial.
async fn link(
    mut conn: Box<Conn<TcpStream>>,
    listener_tls: &TlsFiles,
    shared: &Shared,
) -> Result<Box<EgressReady>, Refused> {
    // The ClientHello, read and left in the buffer for the handshake: its SNI may choose the
    // route, and with it the certificate to present.
    let max = shared.config.limits.max_client_hello_bytes;
    let server_name = match conn.client_hello(max).await {
        Ok(hello) => hello.server_name,
        Err(refusal) => return Err((Leftover::Tcp(conn), Refusal::HelloUnread(refusal))),
    };

    let snapshot = shared.tables.snapshot();
    let table = snapshot.table();
    let chosen = decide::route_before_handshake(table, server_name.as_deref(), conn.source.ip());
    let files = chosen
        .as_ref()
        .and_then(|r| r.egress.as_ref()?.tls.as_ref())
        .unwrap_or(listener_tls);
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
        return Err((Leftover::Tcp(conn), Refusal::NoMaterial { route: chosen }));
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
        Ok(Err(error)) => {
            let refusal = Refusal::HandshakeFailed {
                route: chosen,
                error,
            };
            return Err((Leftover::Handshake(record, guard), refusal));
        }
        Err(_) => {
            let refusal = Refusal::HandshakeTimeout { route: chosen };
            return Err((Leftover::Handshake(record, guard), refusal));
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

    // The route, and whether it admits the client, before any request is read.
    let route = match decide::admit(table, chosen, &names, conn.source.ip()) {
        Ok(route) => route,
        Err(refusal) => return Err((Leftover::Tls(conn), refusal)),
    };
    drop(snapshot);

    // The request: one CONNECT head, and nothing after it until it is answered.
    let max = shared.config.limits.max_header_bytes;
    let (head, consumed) = match conn.request_head(max).await {
        Ok(x) => x,
        Err(refusal) => return Err((Leftover::Tls(conn), Refusal::HeadUnread { route, refusal })),
    };
    conn.record.target = Some(head.target.clone());
    let request = match decide::request(&route, &head, consumed, conn.buf.len()) {
        Ok(request) => request,
        Err(refusal) => return Err((Leftover::Tls(conn), refusal)),
    };
    conn.consume(consumed);

    // Where it may go: an allowed address, a name's first allowed address.
    let candidates: Vec<SocketAddr> = match &request.target {
        BackendAddress::Ip(a) => vec![*a],
        BackendAddress::Dns { host, port } => {
            // The process's resolver: cached, one lookup per name in flight, bounded.
            match shared.dialer.resolver.resolve(host, conn.deadline).await {
                Ok(ips) => ips.iter().map(|ip| SocketAddr::new(*ip, *port)).collect(),
                Err(_) => {
                    let refusal = Refusal::ResolveFailed {
                        route: route.clone(),
                        host: host.clone(),
                    };
                    return Err((Leftover::Tls(conn), refusal));
                }
            }
        }
    };
    let plan =
        match decide::destination(&route, request.egress, &candidates, shared.tunnels.as_ref()) {
            Ok(plan) => plan,
            Err(refusal) => return Err((Leftover::Tls(conn), refusal)),
        };
    let dest = BackendAddress::Ip(plan.addr);
    let dialer = ViaTunnel {
        direct: &shared.dialer,
        tunnels: plan.tunnel,
    };
    match conn
        .link_with(&route, Dest::Address(&dest), Reply::Http, shared, &dialer)
        .await
    {
        Some(ready) => {
            shared
                .metrics
                .egress(route.name(), EgressResult::Connected.as_str());
            Ok(Box::new(ready))
        }
        None => Err((Leftover::Finished, Refusal::DialFailed { route })),
    }
}

/// Ends a refused connection: counts its egress result for its route (empty: none chosen),
/// answers its status (if any, with a body that names no address), closes, and finishes the
/// record with its outcome.
async fn refuse(left: Leftover, refusal: Refusal, shared: &Shared) {
    shared
        .metrics
        .egress(refusal.route_label(), refusal.result().as_str());
    match left {
        Leftover::Tcp(conn) => close(conn, refusal).await,
        Leftover::Tls(conn) => close(conn, refusal).await,
        Leftover::Handshake(record, guard) => {
            finish(record, refusal);
            drop(guard);
        }
        Leftover::Finished => {}
    }
}

/// Answers `refusal`'s status on `conn` (if it has one), closes, and finishes the record.
async fn close<S: Leg>(mut conn: Box<Conn<S>>, refusal: Refusal) {
    if let Some(status) = refusal.status() {
        conn.reject_with(&http::response(status, &refusal.body()))
            .await;
    }
    let (stream, _, record, guard) = conn.into_stream();
    finish(record, refusal);
    // Closed and uncounted once the record is finished.
    drop((stream, guard));
}

/// Finishes the record of a refused connection: denied by its route, or rejected.
fn finish(record: ConnRecord, refusal: Refusal) {
    let detail = refusal.to_string();
    match (refusal.outcome(), refusal) {
        (_, Refusal::SourceDenied { route, .. }) => record.deny(route),
        (Some(outcome), _) => record.reject(outcome, &detail),
        // A failed dial finished its record itself.
        (None, _) => {}
    }
}
