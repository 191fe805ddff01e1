//! The duplex copy loop between a client leg and a backend leg, for any pair of byte
//! streams ([`Leg`]).
//!
//! Each direction ([`copy`]) moves bytes through a buffer that is only held while data is in
//! flight (pooled per thread, sized by how much the direction has carried) and counts them.
//! When both legs are kernel TCP sockets, a direction waits for readiness without any
//! buffer, and one that has carried a bulk amount and still finds its buffer filled by a
//! read switches to `splice(2)` through a pipe ([`splice`]), so its bytes never enter user
//! space, and copies again when it turns interactive. End of stream in one direction is
//! forwarded as a half-close and the other direction may continue for at most
//! `half_close`. The relay also ends on idle timeout, maximum lifetime ([`deadline`]), or a
//! [`Stop`] (the end of a drain). TCP urgent data is carried in place, as the byte of the
//! stream it is: every read of a kernel TCP leg, the relay's and those before it
//! ([`read_leg`]), tells a read that stopped at the urgent mark from a drained socket
//! ([`read`]), and a splice that reaches the mark hands over to copying. It never parses the
//! bytes.

mod copy;
mod deadline;
mod leg;
mod pool;
mod read;
mod splice;
mod stop;

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::time::{Instant, Sleep, sleep_until};

use copy::{Dir, Meter, Op};
use deadline::{Deadlines, Due};
pub(crate) use leg::Either;
pub(crate) use leg::Leg;
#[cfg(test)]
pub(crate) use read::reports_unread;
pub(crate) use read::{read_leg, report_unread};
pub(crate) use stop::Stop;

/// Most bytes moved by one splice call (also the pipe size asked for).
const SPLICE_CHUNK: usize = 1024 * 1024;

/// Bounds of one relayed connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Close after this long without bytes in either direction.
    pub idle: Duration,
    /// Close this long after the first direction ended, if the other has not.
    pub half_close: Duration,
    /// Close after this total lifetime.
    pub max_duration: Option<Duration>,
    /// Call the progress callback this often (periodic access log lines).
    pub progress: Option<Duration>,
}

/// Counters a relay updates per write.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counters<'a> {
    /// Bytes from the client.
    pub rx: &'a Counter,
    /// Bytes to the client.
    pub tx: &'a Counter,
    /// Connections with one direction closed.
    pub half_closed: &'a Gauge,
}

/// The kind of an I/O error that ended a relay (access log `error:<kind>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IoKind {
    /// Connection reset by the peer.
    Reset,
    /// Writing to a peer that has gone.
    BrokenPipe,
    /// Connection aborted.
    Aborted,
    /// The kernel gave up (keepalive or retransmission timeout).
    TimedOut,
    /// A user-space stream ended because its route (or its tunnel peer) was removed.
    RouteRemoved,
    /// Any other I/O error.
    Io,
}

/// The error message a user-space leg (a tunneled stream) ends with when a table change
/// removed its route or peer: the relay reports it as `error:route_removed`.
pub(crate) const ROUTE_REMOVED: &str = "route_removed";

impl IoKind {
    /// The kind of `e`.
    pub(crate) fn of(e: &io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::ConnectionReset => IoKind::Reset,
            io::ErrorKind::BrokenPipe => IoKind::BrokenPipe,
            io::ErrorKind::ConnectionAborted
                if e.get_ref()
                    .is_some_and(|inner| inner.to_string() == ROUTE_REMOVED) =>
            {
                IoKind::RouteRemoved
            }
            io::ErrorKind::ConnectionAborted => IoKind::Aborted,
            io::ErrorKind::TimedOut => IoKind::TimedOut,
            _ => IoKind::Io,
        }
    }

    /// The stable name.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            IoKind::Reset => "reset",
            IoKind::BrokenPipe => "broken_pipe",
            IoKind::Aborted => "aborted",
            IoKind::TimedOut => "timed_out",
            IoKind::RouteRemoved => "route_removed",
            IoKind::Io => "io",
        }
    }
}

/// Why a relayed connection ended (access log `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// The client finished first (and then the backend, or the half-close bound hit).
    ClientClosed,
    /// The backend finished first.
    BackendClosed,
    /// No bytes for `idle`.
    IdleTimeout,
    /// Lived for `max_duration`.
    MaxDuration,
    /// Cut at the end of a drain.
    Drain,
    /// A WireGuard-over-TCP stream that carried no authenticated packet in time.
    NotAuthenticated,
    /// An I/O error.
    Error(IoKind),
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            End::ClientClosed => "client_closed",
            End::BackendClosed => "backend_closed",
            End::IdleTimeout => "idle_timeout",
            End::MaxDuration => "max_duration",
            End::Drain => "drain",
            End::NotAuthenticated => "not_authenticated",
            End::Error(kind) => return write!(f, "error:{}", kind.as_str()),
        })
    }
}

/// Bytes moved by a relay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Stats {
    /// From the client to the backend (including replayed bytes).
    pub rx: u64,
    /// From the backend to the client.
    pub tx: u64,
}

/// Relays between `client` and `backend` until both directions end or a bound hits.
/// `to_backend` (bytes already read from the client) is written to the backend first, and
/// `to_client` (bytes already read from the backend, e.g. past a tunnel's response head) to
/// the client; both are counted.
///
/// The returned future is a hand-written state machine rather than an `async fn`: an idle
/// connection's task then holds a few hundred bytes of relay state instead of two nested
/// copy futures, a drain future and their wait-list nodes.
#[expect(
    clippy::too_many_arguments,
    reason = "both legs, what each owes the other, the counters, the limits and the stop: one call per connection"
)]
pub(crate) fn relay<'a, C: Leg, B: Leg>(
    client: &'a mut C,
    backend: &'a mut B,
    to_backend: Vec<u8>,
    to_client: Vec<u8>,
    limits: Limits,
    counters: Counters<'a>,
    progress: &'a (dyn Fn(Stats) + Sync),
    stop: &'a Stop,
) -> Relay<'a, C, B> {
    let start = Instant::now();
    let deadlines = Deadlines::new(start, &limits);
    let first_deadline = deadlines.next();
    Relay {
        client,
        backend,
        up: Dir::new(to_backend),
        down: Dir::new(to_client),
        counters,
        progress,
        stop,
        stop_key: None,
        stop_waker: None,
        up_first: false,
        timer: Box::pin(sleep_until(first_deadline)),
        deadlines,
        first: None,
    }
}

/// The future [`relay`] returns; resolves to why the relay ended and what it carried.
pub(crate) struct Relay<'a, C, B> {
    client: &'a mut C,
    backend: &'a mut B,
    /// Client to backend.
    up: Dir,
    /// Backend to client.
    down: Dir,
    counters: Counters<'a>,
    progress: &'a (dyn Fn(Stats) + Sync),
    stop: &'a Stop,
    stop_key: Option<usize>,
    /// The waker left with `stop`, to notice when the relay is polled by another task.
    stop_waker: Option<Waker>,
    /// Which direction goes first in the next poll.
    up_first: bool,
    /// One timer for every bound: it fires at the earliest deadline, and the relay works
    /// out which one it was.
    timer: Pin<Box<Sleep>>,
    deadlines: Deadlines,
    /// The direction that finished first.
    first: Option<End>,
}

impl<C: Leg, B: Leg> Relay<'_, C, B> {
    /// Moves one direction along; `Ready(Err)` when the relay must end.
    fn poll_direction(&mut self, cx: &mut Context<'_>, up: bool) -> Poll<Result<(), End>> {
        let (dir, other) = if up {
            (&mut self.up, &self.down)
        } else {
            (&mut self.down, &self.up)
        };
        if dir.done() {
            return Poll::Ready(Ok(()));
        }
        let other_done = other.done();
        let mut meter = Meter {
            counter: if up {
                self.counters.rx
            } else {
                self.counters.tx
            },
            activity: &mut self.deadlines.activity,
            from: if up { "client" } else { "backend" },
        };
        let polled = match (self.client.as_tcp(), self.backend.as_tcp()) {
            (Some(c), Some(b)) => {
                let (src, dst) = if up { (c, b) } else { (b, c) };
                dir.poll_tcp(cx, src, dst, &mut meter, other_done)
            }
            _ if up => dir.poll_generic(cx, &mut *self.client, &mut *self.backend, &mut meter),
            _ => dir.poll_generic(cx, &mut *self.backend, &mut *self.client, &mut meter),
        };
        match polled {
            Poll::Ready(Err((_, e)))
                if other_done
                    && matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
                    ) =>
            {
                // One side has already closed (its end of stream was forwarded) and now
                // resets the bytes still coming its way, or the other side aborts after
                // that close: the usual end of a TLS session (a close_notify sent after
                // the server closed), so the connection ended the way `first` says.
                tracing::debug!(error = %e, "reset after a close");
                Poll::Ready(Err(self.first.unwrap_or(End::ClientClosed)))
            }
            Poll::Ready(Ok(())) => {
                let end = if up {
                    End::ClientClosed
                } else {
                    End::BackendClosed
                };
                self.first.get_or_insert(end);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err((op, e))) => {
                let side = match (op, up) {
                    (Op::Read, true) | (Op::Write, false) => "client",
                    _ => "backend",
                };
                tracing::debug!(side, error = %e, "relay error");
                Poll::Ready(Err(End::Error(IoKind::of(&e))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn stats(&self) -> Stats {
        Stats {
            rx: self.up.carried,
            tx: self.down.carried,
        }
    }

    /// Polls the timer; `Ready` with the end when a bound was hit.
    fn poll_bounds(&mut self, cx: &mut Context<'_>) -> Poll<End> {
        while self.timer.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            loop {
                match self.deadlines.due(now) {
                    Some(Due::MaxDuration) => return Poll::Ready(End::MaxDuration),
                    Some(Due::HalfClose) => {
                        return Poll::Ready(self.first.unwrap_or(End::ClientClosed));
                    }
                    Some(Due::Idle) => return Poll::Ready(End::IdleTimeout),
                    Some(Due::Progress) => (self.progress)(self.stats()),
                    None => break,
                }
            }
            let next = self.deadlines.next();
            self.timer.as_mut().reset(next);
        }
        Poll::Pending
    }

    /// Leaves the task's waker with `stop`; `false` if the relay is cut.
    fn watch_stop(&mut self, cx: &Context<'_>) -> bool {
        match &self.stop_waker {
            None => match self.stop.register(cx.waker()) {
                Some(k) => {
                    self.stop_key = Some(k);
                    self.stop_waker = Some(cx.waker().clone());
                }
                None => return false,
            },
            Some(w) if !w.will_wake(cx.waker()) => {
                // Polled from another task than before (not how the roles await a relay,
                // but allowed): the stop must wake this one.
                if let Some(k) = self.stop_key {
                    self.stop.replace(k, cx.waker());
                }
                self.stop_waker = Some(cx.waker().clone());
            }
            Some(_) => {}
        }
        // Registered whenever a waker is kept: `register` answered `None` otherwise.
        !self.stop_key.is_some_and(|k| self.stop.is_cut(k))
    }
}

impl<C: Leg, B: Leg> Future for Relay<'_, C, B> {
    type Output = (End, Stats);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<(End, Stats)> {
        let this = self.get_mut();
        if !this.watch_stop(cx) {
            return Poll::Ready((End::Drain, this.stats()));
        }
        // Data first, then bounds; the directions take turns going first, so neither can
        // spend the task's cooperative budget before the other is polled.
        this.up_first = !this.up_first;
        let order = if this.up_first {
            [true, false]
        } else {
            [false, true]
        };
        for up in order {
            if let Poll::Ready(Err(end)) = this.poll_direction(cx, up) {
                return Poll::Ready((end, this.stats()));
            }
        }
        if this.up.done() && this.down.done() {
            let end = this.first.unwrap_or(End::ClientClosed);
            return Poll::Ready((end, this.stats()));
        }
        // A direction still forwarding its end of stream (a pending `poll_shutdown`) has
        // ended all the same: the other one gets `half_close` from now, not from whenever
        // the shutdown completes.
        if this.first.is_none() {
            if this.up.ended() {
                this.first = Some(End::ClientClosed);
            } else if this.down.ended() {
                this.first = Some(End::BackendClosed);
            }
        }
        if this.first.is_some() && !this.deadlines.is_half_closed() {
            this.counters.half_closed.inc();
            this.deadlines.half_closed(Instant::now());
            let next = this.deadlines.next();
            this.timer.as_mut().reset(next);
        }
        match this.poll_bounds(cx) {
            Poll::Ready(end) => Poll::Ready((end, this.stats())),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<C, B> Drop for Relay<'_, C, B> {
    fn drop(&mut self) {
        if self.deadlines.is_half_closed() {
            self.counters.half_closed.dec();
        }
        if let Some(k) = self.stop_key {
            self.stop.unregister(k);
        }
        self.up.release();
        self.down.release();
    }
}

#[cfg(test)]
mod tests;
