//! Which listener protocol serves a connection: the per-connection task of every gateway
//! listener. It runs the stages all listeners share (the load balancer's PROXY header, the
//! per-source limit) and hands the connection to its listener's protocol file (`sni`,
//! `connect`, `proxydst`), which routes and links it; then it relays. It never parses a
//! listener's own protocol and never dials.

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpStream;
use tokio::time::Instant;

use super::Shared;
use super::conn::{Conn, Ready, StageReject, header_result, proxy_stage_error};
use super::egress::EgressReady;
use crate::config::gateway::{Listener, ListenerKind, ProxyMode};
use crate::net::socket::normalize;
use crate::serve::accept::Accepted;
use crate::serve::record::Outcome;
use crate::wire::Parsed;
use crate::wire::proxy::{self, Detect, ProxyInfo};
use futures_util::future::Either;

/// Runs one accepted connection: the pipeline up to a linked backend, in a box that is
/// freed before the relay, then the relay (see [`Linked`](crate::serve::forward::Linked)
/// for why). The box is made here, so the task's own future holds the box, the relay and
/// nothing else. An `egress-connect` connection's relay (TLS to the client) is boxed too:
/// the task of every other connection would otherwise keep room for its larger state.
pub(super) fn serve(
    acc: Accepted<TcpStream>,
    config: Arc<Listener>,
    shared: Arc<Shared>,
) -> impl Future<Output = ()> + Send + 'static {
    if let ListenerKind::EgressConnect { .. } = config.kind() {
        let pipeline = Box::pin(egress_pipeline(acc, config, shared.clone()));
        return Either::Right(async move {
            if let Some(ready) = pipeline.await {
                Box::pin((*ready).relay(&shared.drain.hard_stop)).await;
            }
        });
    }
    let pipeline = Box::pin(pipeline(acc, config, shared.clone()));
    Either::Left(async move {
        let Some(ready) = pipeline.await else {
            return;
        };
        ready.relay(&shared.drain.hard_stop).await;
    })
}

/// An `egress-connect` connection before its relay: the shared stages, then the listener's.
async fn egress_pipeline(
    acc: Accepted<TcpStream>,
    config: Arc<Listener>,
    shared: Arc<Shared>,
) -> Option<Box<EgressReady>> {
    let (config, shared) = (&*config, &*shared);
    let conn = admit(acc, config, shared).await?;
    match config.kind() {
        ListenerKind::EgressConnect { tls } => super::egress::handle(conn, tls, shared).await,
        // `serve` sends only egress-connect listeners here.
        _ => conn.reject(Outcome::BadRequest, "not an egress-connect listener"),
    }
}

/// Everything before the relay: the stages every listener shares ([`admit`]), the
/// listener's protocol, routing and [`Conn::link`].
async fn pipeline(
    acc: Accepted<TcpStream>,
    config: Arc<Listener>,
    shared: Arc<Shared>,
) -> Option<Ready> {
    let (config, shared) = (&*config, &*shared);
    let conn = admit(acc, config, shared).await?;
    match config.kind() {
        ListenerKind::Sni => super::sni::handle(conn, config, shared).await,
        ListenerKind::HttpConnect { destination_header } => {
            super::connect::handle(conn, config, destination_header, shared).await
        }
        ListenerKind::ProxyDestination => super::proxydst::handle(conn, config, shared).await,
        // `serve` sends egress-connect listeners to `egress_pipeline`.
        ListenerKind::EgressConnect { .. } => {
            conn.reject(Outcome::BadRequest, "egress-connect served elsewhere")
        }
        // bound by the tunnel driver
        ListenerKind::WireGuard { .. } => conn.reject(Outcome::BadRequest, "not a TCP listener"),
    }
}

/// The stages every listener shares: the load balancer's PROXY header (per the listener's
/// mode and trusted sources) and the per-source limit (the PROXY source counts as the
/// client). `None`: the connection ended there.
async fn admit(
    acc: Accepted<TcpStream>,
    config: &Listener,
    shared: &Shared,
) -> Option<Box<Conn<TcpStream>>> {
    let Accepted {
        stream,
        guard,
        record,
    } = acc;
    let deadline = Instant::from_std(record.accepted_at()) + shared.config.timeouts.handshake;
    let peer = record.peer;
    // Boxed: the connection state crosses three async layers as one pointer instead of
    // being copied into each layer's future.
    let mut conn = Box::new(Conn {
        stream,
        buf: Vec::new(),
        deadline,
        record,
        guard,
        source: peer,
        destination: None,
    });

    let mode = config.proxy_mode_for(peer.ip());
    if mode != ProxyMode::Off {
        match load_balancer_header(&mut conn, mode, shared).await {
            Ok(Some(info)) => {
                shared
                    .metrics
                    .proxy_header(&config.name, header_result(&info));
                conn.record.set_proxy(&info);
                conn.destination = info.destination().map(normalize);
            }
            Ok(None) => shared.metrics.proxy_header(&config.name, "absent"),
            Err((outcome, result, detail)) => {
                if let Some(result) = result {
                    shared.metrics.proxy_header(&config.name, result);
                }
                return conn.reject(outcome, &detail);
            }
        }
    }

    // Set here, before the listener's own protocol: what a client writes after this point
    // (a `proxy-destination` header) never decides which routes admit it.
    conn.source = conn.record.client;
    let per_source = shared.config.limits.per_source();
    let client = conn.source.ip();
    if !conn.guard.limit_source(client, per_source) {
        return conn.reject(Outcome::Limited, "per-source connection limit");
    }

    Some(conn)
}

/// Reads the load balancer's PROXY header. `Ok(None)`: optional mode and none was sent.
async fn load_balancer_header(
    conn: &mut Conn<TcpStream>,
    mode: ProxyMode,
    shared: &Shared,
) -> Result<Option<ProxyInfo>, StageReject> {
    let limit = shared.config.limits.max_header_bytes;
    if mode == ProxyMode::Optional {
        let detected = conn
            .read_until(proxy::V2_SIGNATURE.len(), |b| {
                Ok::<_, proxy::Reject>(match proxy::detect(b) {
                    Detect::NeedMore => Parsed::Incomplete,
                    d => Parsed::Complete {
                        value: d,
                        consumed: 0,
                    },
                })
            })
            .await;
        match detected {
            Ok((Detect::Proxy, _)) => {}
            Ok(_) => return Ok(None),
            Err(e) => return Err(proxy_stage_error(e)),
        }
    }
    let (info, consumed) = conn
        .read_until(limit, |b| proxy::parse(b, limit))
        .await
        .map_err(proxy_stage_error)?;
    conn.consume(consumed);
    Ok(Some(info))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of what `f` returns, without calling it.
    fn returned_size<A, B, C, R>(_: impl FnOnce(A, B, C) -> R) -> usize {
        std::mem::size_of::<R>()
    }

    /// An idle connection lives in its task's future: that future must hold the relay's
    /// state and a pointer to the pipeline, not the pipeline's locals beside the relay
    /// (1,900 bytes and a 2 KiB task when the relay was awaited inside the pipeline).
    #[test]
    fn a_connection_task_holds_the_relay_not_the_pipeline() {
        let future = returned_size(serve);
        let pipeline = returned_size(pipeline);
        eprintln!("task future {future} B, pipeline {pipeline} B");
        assert!(future <= 700, "the task's future is {future} bytes");
        // A connection in its handshake holds the boxed stage: it stays small too (the dial,
        // large and short-lived, is boxed within it).
        assert!(pipeline <= 2048, "the boxed stage is {pipeline} bytes");
    }
}
