//! The path every routed connection takes once its protocol has chosen a route: dial a
//! backend stream (one of the route's backends or an explicit address), tell the client (a CONNECT `200`, or an error status), replay the bytes
//! already read (after a PROXY header, when the route sends one: the caller puts it first),
//! relay until the end, and finish the connection's record.
//!
//! A CONNECT forwarded to a backend that is a CONNECT proxy itself is an exchange first:
//! only the request head goes to the backend, and nothing else of the client's until the
//! backend's response head says it accepted (`2xx`). A refusal reaches the client and ends
//! the connection, so the backend never reads a second request from this client: it would
//! carry a destination that the gateway never checked.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::record::{ConnRecord, Reason};
use super::tracker::ConnGuard;
use crate::admin::metrics::RouteMetrics;
use crate::net::dial::{ConnectFailure, Dest, Dialer, Target};
use crate::net::relay::{self, Leg, Stats, Stop};
use crate::route::{BackendGuard, Route};
use crate::wire::{Parsed, http};

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
    /// when every backend failed; once connected, the backend answers the request head,
    /// which is replayed to it, and its answer reaches the client (see [`Forwarded`]).
    HttpForwarded(Forwarded),
}

/// How a CONNECT is forwarded to a backend that is a CONNECT proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Forwarded {
    /// How many of the bytes replayed to the backend go before its answer: the PROXY header
    /// (when the route sends one) and the request head. The rest, the bytes the client sent
    /// right after the head, is held with everything the client sends later until the
    /// backend accepted.
    pub head: usize,
    /// Largest response head taken from the backend (`maxHeaderBytes`).
    pub max_answer: usize,
    /// How long the backend may take to answer, from when its connection is up.
    pub answer_timeout: Duration,
}

/// Why a backend did not accept a forwarded CONNECT.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// A status other than `2xx`: the bytes read (the head and whatever came with it).
    Refused {
        /// The status code.
        status: u16,
        /// The bytes read from the backend.
        bytes: Vec<u8>,
    },
    /// No valid response head: the head could not be sent, the backend closed or reset
    /// first, answered something that is not HTTP, or a head larger than the cap.
    Invalid(String),
    /// No complete response head within the answer timeout.
    TimedOut,
}

/// A routed connection on its way to a backend: what [`link`] takes.
pub(crate) struct Routed<'a, C> {
    /// The client stream.
    pub client: C,
    /// Bytes read from the client so far (a PROXY header for the backend may lead them):
    /// written to the backend first.
    pub to_backend: Vec<u8>,
    /// The connection's record.
    pub record: ConnRecord,
    /// Keeps the connection counted until it ends.
    pub guard: ConnGuard,
    /// The route it belongs to (metrics, logs, connect budget).
    pub route: &'a Route,
    /// Where it goes: the route's backends or an explicit address.
    pub to: Dest<'a>,
    /// Idle, half-close, lifetime and progress bounds of its relay (the route's overrides
    /// applied by the caller).
    pub limits: relay::Limits,
}

/// A connection whose backend stream is up: everything its relay keeps, and nothing else.
///
/// A task is as large as its largest state, and an idle connection spends its life in the
/// relay. So the roles run everything before it (handshakes, routing, [`link`]) in a boxed
/// future that returns this, free that box, and only then relay ([`Linked::relay`]) at the
/// top of the task: the task then holds the relay's state, not the relay's state plus every
/// earlier stage's locals.
pub(crate) struct Linked<C, S> {
    client: C,
    backend: S,
    /// Bytes for the backend not yet written (replayed client bytes).
    to_backend: Vec<u8>,
    /// Bytes for the client not yet written (past a tunnel's or forwarded CONNECT's head).
    to_client: Vec<u8>,
    /// Bytes written to the backend before the relay (a forwarded request head).
    sent: u64,
    record: ConnRecord,
    route: Arc<RouteMetrics>,
    limits: relay::Limits,
    /// Keeps the backend's active count (held for its drop).
    _backend: Option<BackendGuard>,
    /// Keeps the connection counted (held for its drop).
    _guard: ConnGuard,
}

/// Dials `routed.to` with `dialer` and answers the client per `reply`; a forwarded CONNECT
/// also has its head accepted by the backend. `None` when the connection ended here (no
/// backend, a refusal, the client gone): the client was told and the record finished.
pub(crate) async fn link<C: Leg, D: Dialer>(
    routed: Routed<'_, C>,
    dialer: &D,
    reply: Reply,
) -> Option<Linked<C, D::Stream>> {
    let Routed {
        mut client,
        to_backend,
        mut record,
        guard,
        route,
        to,
        limits,
    } = routed;
    let rm = record.routed(route.name());
    let metrics = record.metrics();
    let on_failure =
        |reason: ConnectFailure| metrics.connect_failure(route.name(), reason.as_str());
    let target = Target {
        route,
        to,
        client: record.client,
        local: record.local,
        on_failure: &on_failure,
    };
    // Boxed: the dial's state is large and short-lived, and the connection's boxed stage
    // would otherwise keep room for it through the whole handshake.
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
                reject_with(&mut client, &http::response(status, detail)).await;
            }
            record.finish(Reason::from(&e), Stats::default());
            return None;
        }
    };
    rm.connect_duration.observe(up.elapsed.as_secs_f64());
    record.backend = Some(std::mem::take(&mut up.backend));
    record.tunnel_peer = up.via.take();
    // Flushed on its own: over TLS the answer is one record, and nothing follows it until
    // the backend sends (kube-apiserver fails on any byte read with the response head).
    if reply == Reply::Http
        && let Err(e) = async {
            client.write_all(&http::response(200, "")).await?;
            client.flush().await
        }
        .await
    {
        let end = relay::End::Error(relay::IoKind::of(&e));
        record.finish(Reason::Relay(end), Stats::default());
        return None;
    }
    let mut to_backend = to_backend;
    let mut to_client = std::mem::take(&mut up.early);
    let mut sent = 0;
    if let Reply::HttpForwarded(fwd) = reply {
        record.forwarded = true;
        let held = to_backend.split_off(fwd.head.min(to_backend.len()));
        let answer = Box::pin(exchange(&mut up.stream, &to_backend, to_client, fwd)).await;
        let head = to_backend.len() as u64;
        rm.rx.inc_by(head);
        match answer {
            Ok(accepted) => {
                sent = head;
                to_client = accepted;
                to_backend = held;
            }
            Err(refusal) => {
                // Closes the backend connection before the client hears the answer.
                drop(up);
                refused(&mut client, record, route, refusal, head, &rm.tx).await;
                return None;
            }
        }
    }
    Some(Linked {
        client,
        backend: up.stream,
        to_backend,
        to_client,
        sent,
        record,
        route: rm,
        limits,
        _backend: up.guard,
        _guard: guard,
    })
}

impl<C: Leg, S: Leg> Linked<C, S> {
    /// A connection whose backend stream the role had before its client stream (the agent
    /// dials a target before it answers the tunneled SYN), routed on `route` (`record`
    /// counted it there), with nothing to replay either way.
    pub(crate) fn new(
        client: C,
        backend: S,
        record: ConnRecord,
        route: Arc<RouteMetrics>,
        limits: relay::Limits,
        guard: ConnGuard,
    ) -> Self {
        Linked {
            client,
            backend,
            to_backend: Vec::new(),
            to_client: Vec::new(),
            sent: 0,
            record,
            route,
            limits,
            _backend: None,
            _guard: guard,
        }
    }

    /// Relays until the end (or `stop`, the end of a drain), closes the backend, and
    /// finishes the record; the client closes last.
    ///
    /// Takes `self` apart before the future starts: an `async fn` would keep the whole
    /// struct as an argument beside the relay's copy of its parts for the connection's life.
    pub(crate) fn relay<'a>(self, stop: &'a Stop) -> impl Future<Output = ()> + 'a
    where
        C: 'a,
        S: 'a,
    {
        let Linked {
            mut client,
            mut backend,
            to_backend,
            to_client,
            sent,
            record,
            route,
            limits,
            _backend,
            _guard,
        } = self;
        async move {
            let (end, mut stats) = {
                let counters = relay::Counters {
                    rx: &route.rx,
                    tx: &route.tx,
                    half_closed: &record.metrics().half_closed,
                };
                let progress = |s: Stats| record.progress(s);
                relay::relay(
                    &mut client,
                    &mut backend,
                    to_backend,
                    to_client,
                    limits,
                    counters,
                    &progress,
                    stop,
                )
                .await
            };
            stats.rx += sent;
            drop(backend);
            drop(_backend);
            record.finish(Reason::Relay(end), stats);
            drop(client);
            drop(_guard);
        }
    }
}

/// Sends a forwarded CONNECT's `head` to `backend` and reads its response head (after
/// `early`, bytes the dialer already read), under the answer timeout and size cap. `Ok`: a
/// `2xx` head, with the bytes read (the head and any tunnel bytes after it).
async fn exchange<B: Leg>(
    backend: &mut B,
    head: &[u8],
    early: Vec<u8>,
    fwd: Forwarded,
) -> Result<Vec<u8>, Refusal> {
    let deadline = tokio::time::Instant::now() + fwd.answer_timeout;
    match tokio::time::timeout_at(deadline, backend.write_all(head)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(Refusal::Invalid(format!("sending the head: {e}"))),
        Err(_) => return Err(Refusal::TimedOut),
    }
    let mut buf = early;
    loop {
        if !buf.is_empty() {
            match http::parse_response_status(&buf, fwd.max_answer) {
                Ok(Parsed::Incomplete) => {}
                Ok(Parsed::Complete { value, .. }) if (200..300).contains(&value) => {
                    return Ok(buf);
                }
                Ok(Parsed::Complete { value, .. }) => {
                    return Err(Refusal::Refused {
                        status: value,
                        bytes: buf,
                    });
                }
                Err(e) => return Err(Refusal::Invalid(e.to_string())),
            }
        }
        // Never past the cap: the parser rejects a head that reaches it.
        let room = fwd.max_answer.saturating_sub(buf.len()).clamp(1, 1024);
        // Read as the relay reads: it then finds urgent data that came with the answer.
        match tokio::time::timeout_at(deadline, relay::read_leg(backend, &mut buf, room)).await {
            Err(_) => return Err(Refusal::TimedOut),
            Ok(Ok(0)) => return Err(Refusal::Invalid("closed before answering".into())),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(Refusal::Invalid(e.to_string())),
        }
    }
}

/// Ends a forwarded CONNECT the backend did not accept: the client gets the backend's
/// answer (a status and what came with it), or the gateway's `502`/`504` when there was no
/// valid one, and the connection closes; nothing more of the client's reaches the backend.
/// `head` is how many bytes the backend was sent.
async fn refused<C: Leg>(
    client: &mut C,
    record: ConnRecord,
    route: &Route,
    refusal: Refusal,
    head: u64,
    tx: &prometheus_client::metrics::counter::Counter,
) {
    let metrics = record.metrics();
    let (bytes, failure, reason) = match refusal {
        Refusal::Refused { status, bytes } => {
            tracing::debug!(route = %route.name(), client = %record.client, status, "the backend refused a forwarded CONNECT");
            (
                bytes,
                ConnectFailure::RefusedByBackend,
                Reason::RefusedByBackend,
            )
        }
        Refusal::TimedOut => {
            tracing::debug!(route = %route.name(), client = %record.client, "no answer to a forwarded CONNECT in time");
            (
                http::response(504, "backend connection timed out"),
                ConnectFailure::Timeout,
                Reason::Dial("upstream_timeout"),
            )
        }
        Refusal::Invalid(detail) => {
            tracing::debug!(route = %route.name(), client = %record.client, detail, "no valid answer to a forwarded CONNECT");
            (
                http::response(502, "backend unavailable"),
                ConnectFailure::Rejected,
                Reason::Dial("upstream_rejected"),
            )
        }
    };
    metrics.connect_failure(route.name(), failure.as_str());
    tx.inc_by(bytes.len() as u64);
    reject_with(client, &bytes).await;
    let stats = Stats {
        rx: head,
        tx: bytes.len() as u64,
    };
    record.finish(reason, stats);
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
