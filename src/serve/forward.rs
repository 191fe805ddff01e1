//! The path every routed connection takes once its protocol has chosen a route: dial a
//! backend stream, tell the client (a CONNECT `200`, or an error status), replay the bytes
//! already read (after a PROXY header, when the route sends one: the caller puts it first),
//! relay until the end, and finish the connection's record.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::record::{ConnRecord, Reason};
use crate::net::dial::{ConnectFailure, Dialer, Target};
use crate::net::relay::{self, Leg, Stats, Stop};
use crate::route::Route;
use crate::wire::http;

/// How long to wait for the client to read a rejection before closing.
const REJECT_LINGER: Duration = Duration::from_secs(1);

/// What the client is told once the backend is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reply {
    /// Nothing (TLS passthrough, PROXY-destination, the node): a failure just closes.
    None,
    /// An HTTP status: `200` once connected, `502`/`504` when every backend failed.
    Http,
    /// A CONNECT forwarded to backends that are CONNECT proxies themselves: `502`/`504`
    /// when every backend failed, nothing once connected (the backend answers the request
    /// head, which is replayed to it, and its answer reaches the client through the relay).
    HttpForwarded,
}

/// How a forwarded connection is relayed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Relaying<'a> {
    /// Idle, half-close, lifetime and progress bounds (the route's overrides applied by
    /// the caller).
    pub limits: relay::Limits,
    /// Cuts the relay at the end of a drain.
    pub stop: &'a Stop,
}

/// Dials `route` with `dialer`, answers per `reply`, writes `to_backend` (bytes read from the
/// client so far) first, relays, and finishes `record`.
pub(crate) async fn forward<C: Leg, D: Dialer>(
    client: &mut C,
    to_backend: Vec<u8>,
    mut record: ConnRecord,
    route: &Route,
    dialer: &D,
    reply: Reply,
    relaying: Relaying<'_>,
) {
    let rm = record.routed(route.name());
    let metrics = record.metrics();
    let on_failure =
        |reason: ConnectFailure| metrics.connect_failure(route.name(), reason.as_str());
    let target = Target {
        route,
        client: record.client,
        local: record.local,
        on_failure: &on_failure,
    };
    let dialed = Box::pin(dialer.dial(target)).await;
    let mut up = match dialed {
        Ok(up) => up,
        Err(e) => {
            tracing::debug!(route = %route.name(), error = %e, "no backend");
            // The access log names the backend tried; the client's answer names nothing
            // (no route, backend or address leaves the process).
            record.backend = e.backend().map(str::to_owned);
            if reply != Reply::None {
                let (status, detail) = if e.timed_out() {
                    (504, "backend connection timed out")
                } else {
                    (502, "backend unavailable")
                };
                reject_with(client, &http::response(status, detail)).await;
            }
            return record.finish(Reason::from(&e), Stats::default());
        }
    };
    rm.connect_duration.observe(up.elapsed.as_secs_f64());
    record.backend = Some(std::mem::take(&mut up.backend));
    if reply == Reply::Http
        && let Err(e) = client.write_all(&http::response(200, "")).await
    {
        let end = relay::End::Error(relay::IoKind::of(&e));
        return record.finish(Reason::Relay(end), Stats::default());
    }
    let counters = relay::Counters {
        rx: &rm.rx,
        tx: &rm.tx,
        half_closed: &record.metrics().half_closed,
    };
    let (end, stats) = {
        let rec = &record;
        let progress = |s: Stats| rec.progress(s);
        let to_client = std::mem::take(&mut up.early);
        relay::relay(
            client,
            &mut up.stream,
            to_backend,
            to_client,
            relaying.limits,
            counters,
            &progress,
            relaying.stop,
        )
        .await
    };
    drop(up);
    record.finish(Reason::Relay(end), stats);
}

/// Writes `bytes` (an alert or an error response), half-closes, and lets the client read
/// them before the stream closes (closing with unread input would send a reset).
pub(crate) async fn reject_with<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, bytes: &[u8]) {
    // Boxed: this rarely taken path must not enlarge every connection's task.
    let _ = Box::pin(tokio::time::timeout(REJECT_LINGER, async {
        stream.write_all(bytes).await?;
        stream.shutdown().await?;
        let mut sink = vec![0u8; 1024];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    }))
    .await;
}
