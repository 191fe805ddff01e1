//! The duplex copy loop between a client and a backend.
//!
//! Each direction waits for readability without holding a buffer, reads into a buffer that
//! is only held while data is in flight (pooled per thread, sized by how much the direction
//! has carried), writes everything on, and counts the bytes. A direction that has carried
//! a bulk amount and still finds its buffer filled by a read switches to `splice(2)` through
//! a pipe, so its bytes never enter user space, and copies again when it turns interactive
//! (small messages). End of stream in one direction is forwarded as a TCP half-close
//! (`shutdown(SHUT_WR)`) and the other direction may continue for at most `half_close`. The
//! relay also ends on idle timeout, maximum lifetime, or a [`Stop`] (the end of a drain).
//! It never parses the bytes.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep, sleep_until};

/// Buffer for a direction that has carried little (interactive traffic).
const SMALL_BUF: usize = 4 * 1024;
/// Buffer once a direction has carried [`GROW_AFTER`] bytes.
const MEDIUM_BUF: usize = 16 * 1024;
/// Buffer once a direction has carried [`BULK_AFTER`] bytes.
const LARGE_BUF: usize = 64 * 1024;
const GROW_AFTER: u64 = 128 * 1024;
const BULK_AFTER: u64 = 4 * 1024 * 1024;
/// A direction that has carried this much, and whose last read filled its buffer (more was
/// waiting), is a bulk flow: it switches to `splice(2)`.
const SPLICE_AFTER: u64 = 1024 * 1024;
/// A splice that moves less than this finds an interactive flow (small messages, as on a
/// long-lived watch or exec stream): once the pipe is drained it copies again, which moves a
/// message in one read and one write where splicing takes two splices, an empty splice and
/// the urgent-mark check. Only a splice made after waiting for data counts: the one right
/// after a drain only finds what arrived meanwhile, which is little on a bulk flow that the
/// relay keeps up with, and would make it give up and re-create its pipe over and over.
const SMALL_SPLICE: usize = 4 * 1024;
/// Most bytes moved by one splice call.
const SPLICE_CHUNK: usize = 1024 * 1024;
/// Most bytes one direction moves in one poll before it yields to other connections: a
/// safety net only, since every round already takes cooperative budget through its
/// readiness poll. A low cap costs bulk throughput (2 MiB cut 8-stream throughput by a
/// quarter: more task switches between the flows).
const MAX_PER_POLL: u64 = 64 * 1024 * 1024;

/// Bounds of one relayed connection.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Close after this long without bytes in either direction.
    pub idle: Duration,
    /// Close this long after the first direction ended, if the other has not.
    pub half_close: Duration,
    /// Close after this total lifetime.
    pub max_duration: Option<Duration>,
    /// Call the progress callback this often (periodic access log lines).
    pub progress: Option<Duration>,
}

/// Counters a relay updates per read.
#[derive(Debug, Clone, Copy)]
pub struct Counters<'a> {
    /// Bytes from the client.
    pub rx: &'a Counter,
    /// Bytes to the client.
    pub tx: &'a Counter,
    /// Connections with one direction closed.
    pub half_closed: &'a Gauge,
}

/// Why a relayed connection ended (access log `reason`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
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
    /// An I/O error; the string is a stable kind.
    Error(&'static str),
}

impl End {
    /// The access-log reason string.
    pub fn reason(&self) -> String {
        match self {
            End::ClientClosed => "client_closed".into(),
            End::BackendClosed => "backend_closed".into(),
            End::IdleTimeout => "idle_timeout".into(),
            End::MaxDuration => "max_duration".into(),
            End::Drain => "drain".into(),
            End::Error(kind) => format!("error:{kind}"),
        }
    }
}

/// Bytes moved by a relay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// From the client to the backend (including replayed bytes).
    pub rx: u64,
    /// From the backend to the client.
    pub tx: u64,
}

/// A stable kind string for an I/O error, for `error:<kind>`.
pub fn io_kind(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::ConnectionReset => "reset",
        io::ErrorKind::BrokenPipe => "broken_pipe",
        io::ErrorKind::ConnectionAborted => "aborted",
        io::ErrorKind::TimedOut => "timed_out",
        _ => "io",
    }
}

/// Which side an I/O error happened on, for the access log.
fn side_error(side: &'static str, e: &io::Error) -> End {
    tracing::debug!(side, error = %e, "relay error");
    End::Error(io_kind(e))
}

/// Cuts every relay at once (the end of a drain) without a future per connection: each
/// relay leaves its task's waker here, and [`Stop::stop`] wakes them all.
#[derive(Debug, Default)]
pub struct Stop {
    stopped: AtomicBool,
    slots: Mutex<Slots>,
}

#[derive(Debug, Default)]
struct Slots {
    wakers: Vec<Option<Waker>>,
    free: Vec<usize>,
}

impl Stop {
    /// Ends every relay, present and future, with [`End::Drain`].
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let wakers: Vec<Waker> = {
            let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            s.free.clear();
            s.wakers.drain(..).flatten().collect()
        };
        for w in wakers {
            w.wake();
        }
    }

    /// Whether [`Stop::stop`] was called.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Leaves `waker` to be woken by `stop`; `None` if already stopped. Checked under the
    /// lock `stop` takes after setting the flag, so no registration is missed.
    fn register(&self, waker: &Waker) -> Option<usize> {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if self.is_stopped() {
            return None;
        }
        Some(match s.free.pop() {
            Some(k) => {
                s.wakers[k] = Some(waker.clone());
                k
            }
            None => {
                s.wakers.push(Some(waker.clone()));
                s.wakers.len() - 1
            }
        })
    }

    /// Points a registration at another waker (no-op after `stop`).
    fn replace(&self, key: usize, waker: &Waker) {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot @ Some(_)) = s.wakers.get_mut(key) {
            *slot = Some(waker.clone());
        }
    }

    fn unregister(&self, key: usize) {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        // After `stop` the slots are gone and every key is stale.
        if let Some(slot) = s.wakers.get_mut(key)
            && slot.take().is_some()
        {
            s.free.push(key);
        }
    }
}

/// Relays between `client` and `backend` until both directions end or a bound hits.
/// `initial` (bytes already read from the client) is written to the backend first.
///
/// The returned future is a hand-written state machine rather than an `async fn`: an idle
/// connection's task then holds a few hundred bytes of relay state instead of two nested
/// copy futures, a drain future and their wait-list nodes.
pub fn relay<'a>(
    client: &'a TcpStream,
    backend: &'a TcpStream,
    initial: Vec<u8>,
    limits: Limits,
    counters: Counters<'a>,
    progress: &'a (dyn Fn(Stats) + Sync),
    stop: &'a Stop,
) -> Relay<'a> {
    let start = Instant::now();
    let bound = |d: Option<Duration>| d.map(|d| later(start, d));
    let mut relay = Relay {
        client,
        backend,
        up: Dir {
            carried: 0,
            no_splice: false,
            full_read: false,
            spliced: 0,
            state: if initial.is_empty() {
                State::Read
            } else {
                State::Write {
                    buf: initial,
                    off: 0,
                }
            },
        },
        down: Dir {
            carried: 0,
            no_splice: false,
            full_read: false,
            spliced: 0,
            state: State::Read,
        },
        limits,
        counters,
        progress,
        stop,
        stop_key: None,
        stop_waker: None,
        up_first: false,
        timer: Box::pin(sleep_until(start)),
        activity: start,
        max_at: bound(limits.max_duration),
        half_at: None,
        progress_at: bound(limits.progress),
        first: None,
        half_gauge: false,
    };
    let first_deadline = relay.next_deadline();
    relay.timer.as_mut().reset(first_deadline);
    relay
}

/// Far enough to mean "never" for a deadline that would overflow.
const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `t + d`, saturating at "never" instead of panicking on overflow.
fn later(t: Instant, d: Duration) -> Instant {
    t.checked_add(d).or_else(|| t.checked_add(FAR)).unwrap_or(t)
}

/// The future [`relay`] returns; resolves to why the relay ended and what it carried.
pub struct Relay<'a> {
    client: &'a TcpStream,
    backend: &'a TcpStream,
    /// Client to backend.
    up: Dir,
    /// Backend to client.
    down: Dir,
    limits: Limits,
    counters: Counters<'a>,
    progress: &'a (dyn Fn(Stats) + Sync),
    stop: &'a Stop,
    stop_key: Option<usize>,
    /// The waker left with `stop`, to notice when the relay is polled by another task.
    stop_waker: Option<Waker>,
    /// Which direction goes first in the next poll.
    up_first: bool,
    /// One timer for every bound: it fires at the earliest of the idle, lifetime,
    /// half-close and progress deadlines, and the relay works out which one it was.
    timer: Pin<Box<Sleep>>,
    /// When bytes last moved in either direction.
    activity: Instant,
    max_at: Option<Instant>,
    half_at: Option<Instant>,
    progress_at: Option<Instant>,
    /// The direction that finished first.
    first: Option<End>,
    /// Whether this relay counts in the half-closed gauge.
    half_gauge: bool,
}

/// One direction of a relay.
struct Dir {
    /// Bytes written to the destination.
    carried: u64,
    /// A pipe could not be had (e.g. past the per-user pipe quota): copy from now on rather
    /// than retry on every readable event.
    no_splice: bool,
    /// The last read filled its buffer: more data was waiting.
    full_read: bool,
    /// Bytes of `carried` that went through a pipe (for tests and debugging).
    spliced: u64,
    state: State,
}

enum State {
    /// Waiting for the source to become readable; no buffer is held.
    Read,
    /// Writing `buf[off..]` to the destination (the buffer is held only meanwhile).
    Write { buf: Vec<u8>, off: usize },
    /// A bulk flow moving through a pipe; `filled` bytes are in the pipe. With `then_copy`,
    /// the last splice was small, and the direction copies again once they are written.
    Splice {
        pipe: splice::Pipe,
        filled: usize,
        then_copy: bool,
    },
    /// End of stream was forwarded.
    Done,
}

/// An I/O error and the operation (`read` or `write`) it happened in.
type DirError = (&'static str, io::Error);

impl Dir {
    fn done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// Moves what can be moved from `src` to `dst`. `Ready(Ok)` once end of stream has been
    /// forwarded (as a half-close, unless `other_done`: then both sockets close right after
    /// and the close itself sends the FIN).
    fn poll_move(
        &mut self,
        cx: &mut Context<'_>,
        src: &TcpStream,
        dst: &TcpStream,
        counter: &Counter,
        activity: &mut Instant,
        other_done: bool,
    ) -> Poll<Result<(), DirError>> {
        let mut moved = 0u64;
        // The next splice into the pipe follows a drain in this same poll, not a wait.
        let mut refill = false;
        loop {
            if moved >= MAX_PER_POLL {
                // Give the other connections on this thread their turn.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            match &mut self.state {
                State::Done => return Poll::Ready(Ok(())),
                State::Read => {
                    ready!(src.poll_read_ready(cx)).map_err(|e| ("read", e))?;
                    if self.carried >= SPLICE_AFTER && self.full_read && !self.no_splice {
                        match splice::Pipe::new() {
                            Ok(pipe) => {
                                // Bulk flow: from here on, bytes go socket -> pipe -> socket
                                // inside the kernel.
                                self.state = State::Splice {
                                    pipe,
                                    filled: 0,
                                    then_copy: false,
                                };
                                continue;
                            }
                            Err(_) => self.no_splice = true,
                        }
                    }
                    let mut buf = pool::take(self.buf_size());
                    match read_draining(src, &mut buf) {
                        Ok(0) => {
                            pool::give(buf);
                            self.finish(dst, other_done);
                            return Poll::Ready(Ok(()));
                        }
                        Ok(n) => {
                            self.full_read = n == buf.capacity();
                            self.state = State::Write { buf, off: 0 };
                        }
                        Err(e) => {
                            pool::give(buf);
                            if !retry(&e) {
                                return Poll::Ready(Err(("read", e)));
                            }
                        }
                    }
                }
                State::Write { buf, off } => {
                    ready!(dst.poll_write_ready(cx)).map_err(|e| ("write", e))?;
                    match dst.try_write(&buf[*off..]) {
                        Ok(0) => {
                            return Poll::Ready(Err(("write", io::ErrorKind::WriteZero.into())));
                        }
                        Ok(n) => {
                            *off += n;
                            // Counted per write, so a slow reader still taking bytes is
                            // activity (a whole buffer may take longer than the idle timeout).
                            count(&mut self.carried, n, counter, activity);
                            moved += n as u64;
                            if *off == buf.len() {
                                let State::Write { buf, .. } =
                                    std::mem::replace(&mut self.state, State::Read)
                                else {
                                    unreachable!("matched above")
                                };
                                pool::give(buf);
                            }
                        }
                        Err(e) if retry(&e) => {}
                        Err(e) => return Poll::Ready(Err(("write", e))),
                    }
                }
                State::Splice {
                    pipe,
                    filled,
                    then_copy,
                } if *filled == 0 => {
                    ready!(src.poll_read_ready(cx)).map_err(|e| ("read", e))?;
                    match src.try_io(Interest::READABLE, || pipe.fill(src)) {
                        Ok(0) => {
                            self.finish(dst, other_done);
                            return Poll::Ready(Ok(()));
                        }
                        Ok(n) => {
                            *filled = n;
                            *then_copy = n < SMALL_SPLICE && !refill;
                        }
                        Err(e) if splice::is_urgent_mark(&e) => {
                            // The pipe is empty: copying carries on where splicing stopped.
                            self.no_splice = true;
                            self.state = State::Read;
                        }
                        Err(e) if retry(&e) => {}
                        Err(e) => return Poll::Ready(Err(("read", e))),
                    }
                }
                State::Splice {
                    pipe,
                    filled,
                    then_copy,
                } => {
                    ready!(dst.poll_write_ready(cx)).map_err(|e| ("write", e))?;
                    match dst.try_io(Interest::WRITABLE, || pipe.drain(dst, *filled)) {
                        Ok(0) => {
                            return Poll::Ready(Err(("write", io::ErrorKind::WriteZero.into())));
                        }
                        Ok(n) => {
                            *filled -= n;
                            self.spliced += n as u64;
                            count(&mut self.carried, n, counter, activity);
                            moved += n as u64;
                            if *filled == 0 {
                                if *then_copy {
                                    // The pipe is empty and closes; copying carries on.
                                    self.full_read = false;
                                    self.state = State::Read;
                                } else {
                                    refill = true;
                                }
                            }
                        }
                        Err(e) if retry(&e) => {}
                        Err(e) => return Poll::Ready(Err(("write", e))),
                    }
                }
            }
        }
    }

    /// Buffer size for what this direction has carried: small for interactive traffic,
    /// larger as a flow proves to be bulk.
    fn buf_size(&self) -> usize {
        if self.carried >= BULK_AFTER {
            LARGE_BUF
        } else if self.carried >= GROW_AFTER {
            MEDIUM_BUF
        } else {
            SMALL_BUF
        }
    }

    /// End of stream from the source: forward it as a half-close.
    fn finish(&mut self, dst: &TcpStream, other_done: bool) {
        self.state = State::Done;
        if !other_done {
            let _ = socket2::SockRef::from(dst).shutdown(std::net::Shutdown::Write);
        }
    }
}

/// Counts `n` bytes written by a direction.
fn count(carried: &mut u64, n: usize, counter: &Counter, activity: &mut Instant) {
    *carried += n as u64;
    counter.inc_by(n as u64);
    *activity = Instant::now();
}

/// Whether an I/O error only means "not now".
fn retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

/// Reads what `src` has into `buf`'s spare capacity; `Ok(0)` at end of stream.
///
/// A short read means the socket is drained, so its readiness is cleared right away instead
/// of by a later read failing with EAGAIN (one wasted recvfrom per message). The clear uses
/// the readiness tick taken *before* the read: an event the I/O driver records after it
/// (possibly on another thread) is newer and survives, so data arriving meanwhile is not
/// lost to edge-triggered epoll.
fn read_draining(src: &TcpStream, buf: &mut Vec<u8>) -> io::Result<usize> {
    let room = buf.capacity() - buf.len();
    let mut short = None;
    let result = src.try_io(Interest::READABLE, || {
        let n = src.try_read_buf(buf)?;
        if n > 0 && n < room {
            short = Some(n);
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    });
    match (result, short) {
        (_, Some(n)) => Ok(n),
        (result, None) => result,
    }
}

impl Relay<'_> {
    /// Moves one direction along; `Ready(Err)` when the relay must end with an error.
    fn poll_direction(&mut self, cx: &mut Context<'_>, up: bool) -> Poll<Result<(), End>> {
        let (dir, other, src, dst, counter) = if up {
            (
                &mut self.up,
                &self.down,
                self.client,
                self.backend,
                self.counters.rx,
            )
        } else {
            (
                &mut self.down,
                &self.up,
                self.backend,
                self.client,
                self.counters.tx,
            )
        };
        if dir.done() {
            return Poll::Ready(Ok(()));
        }
        let (reader, writer) = if up {
            ("client", "backend")
        } else {
            ("backend", "client")
        };
        let other_done = other.done();
        match dir.poll_move(cx, src, dst, counter, &mut self.activity, other_done) {
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
                let first = self.first.clone().unwrap_or(End::ClientClosed);
                Poll::Ready(Err(first))
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
                let side = if op == "read" { reader } else { writer };
                Poll::Ready(Err(side_error(side, &e)))
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

    fn next_deadline(&self) -> Instant {
        let idle = later(self.activity, self.limits.idle);
        [self.max_at, self.half_at, self.progress_at]
            .into_iter()
            .flatten()
            .fold(idle, std::cmp::min)
    }

    /// Polls the timer; `Ready` with the end when a bound was hit.
    fn poll_bounds(&mut self, cx: &mut Context<'_>) -> Poll<End> {
        while self.timer.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            if self.max_at.is_some_and(|t| t <= now) {
                return Poll::Ready(End::MaxDuration);
            }
            if self.half_at.is_some_and(|t| t <= now) {
                return Poll::Ready(self.first.clone().unwrap_or(End::ClientClosed));
            }
            if later(self.activity, self.limits.idle) <= now {
                return Poll::Ready(End::IdleTimeout);
            }
            if let (Some(t), Some(every)) = (self.progress_at, self.limits.progress)
                && t <= now
            {
                (self.progress)(self.stats());
                self.progress_at = Some(later(now, every));
            }
            let next = self.next_deadline();
            self.timer.as_mut().reset(next);
        }
        Poll::Pending
    }
}

impl Future for Relay<'_> {
    type Output = (End, Stats);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<(End, Stats)> {
        let this = self.get_mut();
        match &this.stop_waker {
            None => match this.stop.register(cx.waker()) {
                Some(k) => {
                    this.stop_key = Some(k);
                    this.stop_waker = Some(cx.waker().clone());
                }
                None => return Poll::Ready((End::Drain, this.stats())),
            },
            Some(w) if !w.will_wake(cx.waker()) => {
                // Polled from another task than before (not how the gateway awaits a
                // relay, but allowed): the stop must wake this one.
                if let Some(k) = this.stop_key {
                    this.stop.replace(k, cx.waker());
                }
                this.stop_waker = Some(cx.waker().clone());
            }
            Some(_) => {}
        }
        if this.stop.is_stopped() {
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
            let end = this.first.clone().unwrap_or(End::ClientClosed);
            return Poll::Ready((end, this.stats()));
        }
        if this.first.is_some() && !this.half_gauge {
            this.half_gauge = true;
            this.counters.half_closed.inc();
            this.half_at = Some(later(Instant::now(), this.limits.half_close));
            let next = this.next_deadline();
            this.timer.as_mut().reset(next);
        }
        match this.poll_bounds(cx) {
            Poll::Ready(end) => Poll::Ready((end, this.stats())),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Relay<'_> {
    fn drop(&mut self) {
        if self.half_gauge {
            self.counters.half_closed.dec();
        }
        if let Some(k) = self.stop_key {
            self.stop.unregister(k);
        }
        for dir in [&mut self.up, &mut self.down] {
            if let State::Write { buf, .. } = std::mem::replace(&mut dir.state, State::Done) {
                pool::give(buf);
            }
        }
    }
}

/// Zero-copy relaying of bulk flows with `splice(2)` through a pipe.
mod splice {
    use std::io;
    use std::os::fd::OwnedFd;

    use rustix::pipe::{PipeFlags, SpliceFlags, pipe_with, splice};
    use tokio::net::TcpStream;

    use super::SPLICE_CHUNK;

    /// Smallest pipe worth splicing through (the default pipe size).
    const MIN_PIPE: usize = 64 * 1024;

    /// A pipe used as the in-kernel buffer of one direction.
    pub struct Pipe {
        read: OwnedFd,
        write: OwnedFd,
    }

    impl Pipe {
        pub fn new() -> io::Result<Pipe> {
            let (read, write) = pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK)?;
            // Past the per-user pipe quota the kernel hands out tiny pipes, and splicing
            // through one is slower than copying: then the copy path is used instead.
            let size = rustix::pipe::fcntl_setpipe_size(&write, SPLICE_CHUNK)?;
            if size < MIN_PIPE {
                return Err(io::Error::other("pipe too small"));
            }
            Ok(Pipe { read, write })
        }
    }

    fn flags() -> SpliceFlags {
        SpliceFlags::NONBLOCK | SpliceFlags::MOVE
    }

    /// `SIOCATMARK` from `<linux/sockios.h>` (not in the libc crate).
    const SIOCATMARK: libc::Ioctl = 0x8905;

    /// The socket's next byte is TCP urgent data.
    fn at_urgent_mark(src: &TcpStream) -> bool {
        use std::os::fd::AsRawFd;
        let mut at: libc::c_int = 0;
        // SAFETY: SIOCATMARK writes one int through the pointer, which points to `at`; the
        // descriptor is the open socket `src` borrows.
        let r = unsafe { libc::ioctl(src.as_raw_fd(), SIOCATMARK, &mut at) };
        r == 0 && at != 0
    }

    /// `fill` found TCP urgent data, which `splice` cannot move.
    #[derive(Debug)]
    pub struct AtUrgentMark;

    impl std::fmt::Display for AtUrgentMark {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("at TCP urgent data")
        }
    }

    impl std::error::Error for AtUrgentMark {}

    /// Whether `e` is [`AtUrgentMark`].
    pub fn is_urgent_mark(e: &io::Error) -> bool {
        e.get_ref().is_some_and(|e| e.is::<AtUrgentMark>())
    }

    impl Pipe {
        /// Moves what `src` has (at most a chunk) into the pipe; `Ok(0)` at end of stream.
        /// Called only when the pipe is empty, so a failure never strands counted bytes.
        ///
        /// `splice` stops at TCP urgent data and never moves past it: it returns nothing, as
        /// if at end of stream or as if no data had come. That is told apart by asking
        /// whether the socket is at the urgent mark, and reported as [`AtUrgentMark`]: the
        /// caller copies from then on (`recv` does move past the mark). Not a `WouldBlock`,
        /// so the socket's readiness stays set for that read.
        pub fn fill(&self, src: &TcpStream) -> io::Result<usize> {
            match splice(src, None, &self.write, None, SPLICE_CHUNK, flags()) {
                Ok(n) if n > 0 => Ok(n),
                Err(e) if e != rustix::io::Errno::AGAIN => Err(e.into()),
                nothing => {
                    if at_urgent_mark(src) {
                        return Err(io::Error::other(AtUrgentMark));
                    }
                    Ok(nothing?)
                }
            }
        }

        /// Moves up to `len` bytes from the pipe into `dst`.
        pub fn drain(&self, dst: &TcpStream, len: usize) -> io::Result<usize> {
            Ok(splice(&self.read, None, dst, None, len, flags())?)
        }
    }
}

/// Per-thread free lists of relay buffers: buffers follow traffic, and a buffer released by
/// one connection is reused by the next without a trip through the allocator.
mod pool {
    use std::cell::RefCell;

    /// Buffers kept per size class and thread.
    const KEEP: usize = 64;

    thread_local! {
        static FREE: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
    }

    /// A buffer with at least `size` bytes of capacity and no contents.
    pub fn take(size: usize) -> Vec<u8> {
        FREE.with(|f| {
            let mut f = f.borrow_mut();
            match f.iter().position(|b| b.capacity() == size) {
                Some(i) => f.swap_remove(i),
                None => Vec::with_capacity(size),
            }
        })
    }

    /// Returns a buffer for reuse (one of another size, such as a replay buffer, is freed).
    pub fn give(mut buf: Vec<u8>) {
        if ![super::SMALL_BUF, super::MEDIUM_BUF, super::LARGE_BUF].contains(&buf.capacity()) {
            return;
        }
        buf.clear();
        FREE.with(|f| {
            let mut f = f.borrow_mut();
            if f.len() < KEEP {
                f.push(buf);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A connected pair of sockets: (outside end, relay end).
    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let outside = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (inside, _) = l.accept().await.unwrap();
        (outside, inside)
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
    }

    /// The metrics a relay updates.
    #[derive(Default)]
    struct Meters {
        rx: Counter,
        tx: Counter,
        half: Gauge,
    }

    impl Meters {
        fn counters(&self) -> Counters<'_> {
            Counters {
                rx: &self.rx,
                tx: &self.tx,
                half_closed: &self.half,
            }
        }
    }

    fn no_progress(_: Stats) {}

    /// A relay with nothing to replay and no progress callback.
    fn plain<'a>(
        client: &'a TcpStream,
        backend: &'a TcpStream,
        idle: Duration,
        meters: &'a Meters,
        stop: &'a Stop,
    ) -> Relay<'a> {
        relay(
            client,
            backend,
            Vec::new(),
            limits(idle),
            meters.counters(),
            &no_progress,
            stop,
        )
    }

    fn limits(idle: Duration) -> Limits {
        Limits {
            idle,
            half_close: Duration::from_secs(10),
            max_duration: None,
            progress: None,
        }
    }

    /// Bulk both ways at once (past the splice threshold), the replayed prefix first, and
    /// the client's half-close forwarded while the backend is still sending.
    #[tokio::test]
    async fn bulk_both_ways_with_replay_and_half_close() {
        let (mut client, client_in) = pair().await;
        let (mut backend, backend_in) = pair().await;
        let meters = Meters::default();
        let stop = Stop::default();
        let up = pattern(9 << 20, 0x11);
        let down = pattern(7 << 20, 0x22);
        let replay = b"replayed-first".to_vec();

        let relay = {
            let (stop, replay, meters) = (&stop, replay.clone(), &meters);
            async move {
                let result = relay(
                    &client_in,
                    &backend_in,
                    replay,
                    limits(Duration::from_secs(30)),
                    meters.counters(),
                    &no_progress,
                    stop,
                )
                .await;
                // As the gateway does: the sockets close right after, which sends the
                // last FIN (the relay skips the half-close when both directions ended).
                drop((client_in, backend_in));
                result
            }
        };
        let send_up = {
            let up = up.clone();
            async move {
                client.write_all(&up).await.unwrap();
                client.shutdown().await.unwrap();
                let mut got = Vec::new();
                client.read_to_end(&mut got).await.unwrap();
                got
            }
        };
        let serve = {
            let down = down.clone();
            async move {
                let (mut r, mut w) = backend.split();
                let read = async {
                    let mut got = Vec::new();
                    r.read_to_end(&mut got).await.unwrap();
                    got
                };
                let write = async {
                    w.write_all(&down).await.unwrap();
                    w.shutdown().await.unwrap();
                };
                let (got, ()) = tokio::join!(read, write);
                got
            }
        };
        let ((end, stats), got_down, got_up) =
            tokio::time::timeout(Duration::from_secs(60), async {
                tokio::join!(relay, send_up, serve)
            })
            .await
            .expect("relay finishes");
        let mut want_up = replay.clone();
        want_up.extend(&up);
        assert!(got_up == want_up, "upstream bytes differ");
        assert!(got_down == down, "downstream bytes differ");
        assert!(matches!(end, End::ClientClosed | End::BackendClosed));
        assert_eq!(stats.rx, want_up.len() as u64);
        assert_eq!(stats.tx, down.len() as u64);
        assert_eq!(meters.rx.get(), stats.rx);
        assert_eq!(meters.tx.get(), stats.tx);
        assert_eq!(meters.half.get(), 0, "the half-closed gauge is released");
    }

    /// A long-lived interactive flow (small messages, as on a watch or exec stream) copies
    /// even past the splice threshold, and a bulk flow that turns interactive copies again:
    /// one read and one write per message instead of two splices, an empty splice and the
    /// urgent-mark check.
    #[tokio::test]
    async fn interactive_flows_copy_past_the_splice_threshold() {
        const MSG: usize = 1024;
        const BEFORE: usize = 1536; // 1.5 MiB of messages each way, past SPLICE_AFTER
        const AFTER: usize = 256;
        const BULK: usize = 3 << 20;
        let (mut client, client_in) = pair().await;
        let (mut backend, backend_in) = pair().await;
        let meters = Meters::default();
        let stop = Stop::default();
        let mut relay = plain(
            &client_in,
            &backend_in,
            Duration::from_secs(30),
            &meters,
            &stop,
        );
        async fn ping_pong(client: &mut TcpStream, backend: &mut TcpStream, n: usize) {
            let msg = pattern(MSG, 0x33);
            let mut back = vec![0u8; MSG];
            for _ in 0..n {
                client.write_all(&msg).await.unwrap();
                backend.read_exact(&mut back).await.unwrap();
                assert!(back == msg);
                backend.write_all(&msg).await.unwrap();
                client.read_exact(&mut back).await.unwrap();
                assert!(back == msg);
            }
        }
        let peers = async {
            ping_pong(&mut client, &mut backend, BEFORE).await;
            let bulk = pattern(BULK, 0x44);
            let mut got = vec![0u8; BULK];
            let (w, r) = tokio::join!(client.write_all(&bulk), backend.read_exact(&mut got));
            w.unwrap();
            r.unwrap();
            assert!(got == bulk, "bulk bytes differ");
            ping_pong(&mut client, &mut backend, AFTER).await;
            client.shutdown().await.unwrap();
            backend.shutdown().await.unwrap();
        };
        let ((end, stats), ()) = tokio::time::timeout(Duration::from_secs(60), async {
            tokio::join!(&mut relay, peers)
        })
        .await
        .expect("relay finishes");
        assert!(matches!(end, End::ClientClosed | End::BackendClosed));
        assert_eq!(stats.rx, ((BEFORE + AFTER) * MSG + BULK) as u64);
        assert_eq!(relay.down.spliced, 0, "small messages only: never spliced");
        assert!(relay.up.spliced >= 2 << 20, "the bulk upload was spliced");
        // All the messages were copied but at most one (the first after the bulk upload).
        let copied = relay.up.carried - relay.up.spliced;
        assert!(
            copied >= ((BEFORE + AFTER - 1) * MSG) as u64,
            "copied {copied} of {} message bytes",
            (BEFORE + AFTER) * MSG
        );
    }

    /// `Stop` ends idle relays at once, and a relay started after it ends immediately.
    #[tokio::test]
    async fn stop_cuts_idle_relays() {
        let (_client, client_in) = pair().await;
        let (_backend, backend_in) = pair().await;
        let meters = Meters::default();
        let stop = Stop::default();
        let first = plain(
            &client_in,
            &backend_in,
            Duration::from_secs(3600),
            &meters,
            &stop,
        );
        let stopper = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            stop.stop();
        };
        let ((end, _), ()) = tokio::time::timeout(Duration::from_secs(5), async {
            tokio::join!(first, stopper)
        })
        .await
        .expect("stop wakes the relay");
        assert_eq!(end, End::Drain);
        let later = plain(
            &client_in,
            &backend_in,
            Duration::from_secs(3600),
            &meters,
            &stop,
        );
        assert_eq!(later.await.0, End::Drain);
    }

    /// A relay first polled by one waker and then awaited by another task is still cut by
    /// `Stop` (the registration follows the waker).
    #[tokio::test]
    async fn stop_follows_a_changed_waker() {
        let (_client, client_in) = pair().await;
        let (_backend, backend_in) = pair().await;
        let stop = std::sync::Arc::new(Stop::default());
        // Its own task: nothing but the stop may wake it.
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                let meters = Meters::default();
                let mut r = plain(
                    &client_in,
                    &backend_in,
                    Duration::from_secs(3600),
                    &meters,
                    &stop,
                );
                {
                    let mut noop = Context::from_waker(Waker::noop());
                    assert!(Pin::new(&mut r).poll(&mut noop).is_pending());
                }
                r.await
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.stop();
        let (end, _) = tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("stop wakes the task that awaits the relay now")
            .unwrap();
        assert_eq!(end, End::Drain);
    }

    /// Many small request/response exchanges with the relay on a multi-thread runtime (as
    /// the node daemon runs it), where the I/O driver may record new data on another thread
    /// while the relay reads: a lost readiness event would hang an exchange.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ping_pong_on_a_multi_thread_runtime() {
        let (mut client, client_in) = pair().await;
        let (mut backend, backend_in) = pair().await;
        let relay_task = tokio::spawn(async move {
            let meters = Meters::default();
            let stop = Stop::default();
            plain(
                &client_in,
                &backend_in,
                Duration::from_secs(30),
                &meters,
                &stop,
            )
            .await
        });
        let echo = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            loop {
                match backend.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => backend.write_all(&buf[..n]).await.unwrap(),
                }
            }
        });
        let exchanges = async {
            for i in 0..3000u32 {
                // Two writes per exchange, so data often arrives while the relay is reading.
                let msg = i.to_be_bytes();
                client.write_all(&msg[..2]).await.unwrap();
                client.write_all(&msg[2..]).await.unwrap();
                let mut back = [0u8; 4];
                client.read_exact(&mut back).await.unwrap();
                assert_eq!(back, msg);
            }
            client.shutdown().await.unwrap();
        };
        tokio::time::timeout(Duration::from_secs(60), exchanges)
            .await
            .expect("no exchange hangs");
        let (end, stats) = relay_task.await.unwrap();
        assert_eq!(end, End::ClientClosed);
        assert_eq!((stats.rx, stats.tx), (12_000, 12_000));
        echo.await.unwrap();
    }

    /// The backend answers and closes; the client's late bytes are reset by the backend's
    /// kernel. The relay ends as `backend_closed`, not as an error.
    #[tokio::test]
    async fn reset_after_the_backend_closed_is_its_close() {
        let (mut client, client_in) = pair().await;
        let (mut backend, backend_in) = pair().await;
        let stop = Stop::default();
        let meters = Meters::default();
        let r = plain(
            &client_in,
            &backend_in,
            Duration::from_secs(30),
            &meters,
            &stop,
        );
        let peers = async move {
            backend.write_all(b"bye").await.unwrap();
            drop(backend);
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.unwrap();
            assert_eq!(got, b"bye");
            // Late bytes (a TLS close_notify, say) until the relay gives up on them.
            for _ in 0..50 {
                if client.write_all(b"late").await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let ((end, stats), ()) =
            tokio::time::timeout(Duration::from_secs(10), async { tokio::join!(r, peers) })
                .await
                .expect("the relay ends");
        assert_eq!(end, End::BackendClosed);
        assert_eq!(stats.tx, 3);
    }

    /// No bytes for `idle`: the relay ends with `IdleTimeout`.
    #[tokio::test]
    async fn idle_timeout() {
        let (_client, client_in) = pair().await;
        let (_backend, backend_in) = pair().await;
        let meters = Meters::default();
        let stop = Stop::default();
        let r = plain(
            &client_in,
            &backend_in,
            Duration::from_millis(200),
            &meters,
            &stop,
        );
        let (end, _) = tokio::time::timeout(Duration::from_secs(5), r)
            .await
            .expect("idle bound");
        assert_eq!(end, End::IdleTimeout);
    }
}
