//! The duplex copy loop between a client and a backend.
//!
//! Each direction waits for readability without holding a buffer, reads into a buffer that
//! is only held while data is in flight (pooled per thread, sized by how much the direction
//! has carried), writes everything on, and counts the bytes. A direction that has carried
//! a bulk amount switches to `splice(2)` through a pipe, so its bytes never enter user space. End of stream in one direction is
//! forwarded as a TCP half-close (`shutdown(SHUT_WR)`) and the other direction may continue
//! for at most `half_close`. The loop also ends on idle timeout, maximum lifetime, or a drain
//! signal. It never parses the bytes.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::sync::watch;
use tokio::time::sleep_until;

/// Buffer for a direction that has carried little (interactive traffic).
const SMALL_BUF: usize = 4 * 1024;
/// Buffer once a direction has carried [`GROW_AFTER`] bytes.
const MEDIUM_BUF: usize = 16 * 1024;
/// Buffer once a direction has carried [`BULK_AFTER`] bytes.
const LARGE_BUF: usize = 64 * 1024;
const GROW_AFTER: u64 = 128 * 1024;
const BULK_AFTER: u64 = 4 * 1024 * 1024;
/// A direction that has carried this much is a bulk flow: it switches to `splice(2)`.
const SPLICE_AFTER: u64 = 1024 * 1024;
/// Most bytes moved by one splice call.
const SPLICE_CHUNK: usize = 1024 * 1024;

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

/// Relays between `client` and `backend` until both directions end or a bound hits.
/// `initial` (bytes already read from the client) is written to the backend first.
pub async fn relay(
    client: &mut TcpStream,
    backend: &mut TcpStream,
    initial: Vec<u8>,
    limits: Limits,
    counters: Counters<'_>,
    progress: &(dyn Fn(Stats) + Sync),
    mut drain: watch::Receiver<bool>,
) -> (End, Stats) {
    if *drain.borrow() {
        return (End::Drain, Stats::default());
    }
    let start = Instant::now();
    let activity = AtomicU64::new(0);
    let rx = AtomicU64::new(0);
    let tx = AtomicU64::new(0);
    let stats = || Stats {
        rx: rx.load(Ordering::Relaxed),
        tx: tx.load(Ordering::Relaxed),
    };

    if !initial.is_empty() {
        // Bounded like everything else: a backend that accepts but never reads must not
        // hold the client past the idle timeout or the end of a drain.
        let write = tokio::time::timeout(limits.idle, backend.write_all(&initial));
        tokio::select! {
            r = write => match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return (side_error("backend", &e), stats()),
                Err(_) => return (End::IdleTimeout, stats()),
            },
            _ = drain.wait_for(|d| *d) => return (End::Drain, stats()),
        }
        rx.fetch_add(initial.len() as u64, Ordering::Relaxed);
        counters.rx.inc_by(initial.len() as u64);
    }
    drop(initial);

    let (mut cr, mut cw) = client.split();
    let (mut br, mut bw) = backend.split();
    let ended = [AtomicBool::new(false), AtomicBool::new(false)];
    let up = pump(
        &mut cr,
        &mut bw,
        counters.rx,
        &rx,
        &activity,
        start,
        (&ended[0], &ended[1]),
    );
    let down = pump(
        &mut br,
        &mut cw,
        counters.tx,
        &tx,
        &activity,
        start,
        (&ended[1], &ended[0]),
    );
    tokio::pin!(up, down);

    // One timer for every bound: it fires at the earliest of the idle, lifetime, half-close
    // and progress deadlines, and the loop works out which one it was.
    let tokio_start = tokio::time::Instant::from_std(start);
    let max_at = limits.max_duration.map(|d| tokio_start + d);
    let mut half_at: Option<tokio::time::Instant> = None;
    let mut progress_at = limits.progress.map(|p| tokio_start + p);
    let idle_at =
        || tokio_start + Duration::from_millis(activity.load(Ordering::Relaxed)) + limits.idle;
    let next = |half_at: Option<tokio::time::Instant>,
                progress_at: Option<tokio::time::Instant>,
                idle: tokio::time::Instant| {
        [max_at, half_at, progress_at]
            .into_iter()
            .flatten()
            .fold(idle, std::cmp::min)
    };
    let timer = sleep_until(next(half_at, progress_at, idle_at()));
    tokio::pin!(timer);

    // The drain signal, pinned once rather than re-created on every wake-up.
    let drained = drain.wait_for(|d| *d);
    tokio::pin!(drained);

    let mut up_done = false;
    let mut down_done = false;
    let mut first: Option<End> = None;
    let mut half_gauge = false;
    let end = loop {
        tokio::select! {
            // Fixed order (no per-poll randomisation): data first, then bounds.
            biased;
            r = &mut up, if !up_done => {
                up_done = true;
                if let Err((side, e)) = r { break side_error(side, &e); }
                first.get_or_insert(End::ClientClosed);
            }
            r = &mut down, if !down_done => {
                down_done = true;
                if let Err((side, e)) = r { break side_error(side, &e); }
                first.get_or_insert(End::BackendClosed);
            }
            _ = &mut timer => {
                let now = tokio::time::Instant::now();
                if max_at.is_some_and(|t| t <= now) {
                    break End::MaxDuration;
                }
                if half_at.is_some_and(|t| t <= now) {
                    break first.clone().unwrap_or(End::ClientClosed);
                }
                if idle_at() <= now {
                    break End::IdleTimeout;
                }
                if let (Some(t), Some(every)) = (progress_at, limits.progress)
                    && t <= now
                {
                    progress(stats());
                    progress_at = Some(now + every);
                }
                timer.as_mut().reset(next(half_at, progress_at, idle_at()));
                continue;
            }
            _ = &mut drained => break End::Drain,
        }
        if up_done && down_done {
            break first.clone().unwrap_or(End::ClientClosed);
        }
        if !half_gauge {
            half_gauge = true;
            counters.half_closed.inc();
            half_at = Some(tokio::time::Instant::now() + limits.half_close);
            timer.as_mut().reset(next(half_at, progress_at, idle_at()));
        }
    };
    if half_gauge {
        counters.half_closed.dec();
    }
    (end, stats())
}

/// Copies one direction until end of stream, then half-closes the writer.
/// Errors carry the side they happened on (`client` or `backend`).
async fn pump(
    r: &mut ReadHalf<'_>,
    w: &mut WriteHalf<'_>,
    counter: &Counter,
    total: &AtomicU64,
    activity: &AtomicU64,
    start: Instant,
    ended: (&AtomicBool, &AtomicBool),
) -> Result<(), (&'static str, io::Error)> {
    let src: &TcpStream = r.as_ref();
    loop {
        // Wait without a buffer: an idle connection holds none.
        src.readable().await.map_err(|e| ("read", e))?;
        let carried = total.load(Ordering::Relaxed);
        if carried >= SPLICE_AFTER
            && let Ok(pipe) = splice::Pipe::new()
        {
            // Bulk flow: from here on, bytes go socket -> pipe -> socket inside the kernel.
            let dst: &TcpStream = w.as_ref();
            let end = Box::pin(splice::pump(
                src, dst, &pipe, counter, total, activity, start,
            ))
            .await?;
            debug_assert!(end);
            half_close(w, ended).await;
            return Ok(());
        }
        let size = if carried >= BULK_AFTER {
            LARGE_BUF
        } else if carried >= GROW_AFTER {
            MEDIUM_BUF
        } else {
            SMALL_BUF
        };
        let mut buf = pool::take(size);
        // Boxed: the copy state exists only while bytes move, so an idle connection's task
        // does not carry it.
        let result = Box::pin(copy_ready(
            src, w, &mut buf, counter, total, activity, start,
        ))
        .await;
        pool::give(buf);
        match result {
            Ok(true) => {
                half_close(w, ended).await;
                return Ok(());
            }
            Ok(false) => {}
            Err(e) => return Err(e),
        }
    }
}

/// Forwards end of stream as a half-close, unless the other direction has ended too: then
/// both sockets are closed right after, and the close itself sends the FIN.
async fn half_close(w: &mut WriteHalf<'_>, (mine, other): (&AtomicBool, &AtomicBool)) {
    mine.store(true, Ordering::Relaxed);
    if !other.load(Ordering::Relaxed) {
        let _ = w.shutdown().await;
    }
}

/// Copies what `src` has ready (until it would block); `Ok(true)` at end of stream.
async fn copy_ready(
    src: &TcpStream,
    w: &mut WriteHalf<'_>,
    buf: &mut Vec<u8>,
    counter: &Counter,
    total: &AtomicU64,
    activity: &AtomicU64,
    start: Instant,
) -> Result<bool, (&'static str, io::Error)> {
    loop {
        buf.clear();
        let n = match src.try_read_buf(buf) {
            Ok(0) => return Ok(true),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(("read", e)),
        };
        // Write piecewise so that a slow reader that is still taking bytes counts as
        // activity (a whole buffer may take longer than the idle timeout to drain).
        let mut off = 0;
        while off < n {
            let written = w.write(&buf[off..n]).await.map_err(|e| ("write", e))?;
            if written == 0 {
                return Err(("write", io::ErrorKind::WriteZero.into()));
            }
            off += written;
            total.fetch_add(written as u64, Ordering::Relaxed);
            counter.inc_by(written as u64);
            activity.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
        }
        if n < buf.capacity() {
            // Short read: the socket is drained. Clear its readiness without a syscall (tokio
            // otherwise keeps it set until a read fails with EAGAIN, one wasted recvfrom per
            // message). Data arriving later raises a new edge-triggered event, and tokio's
            // readiness ticks keep this from clearing an event newer than our read.
            let _ = src.try_io(tokio::io::Interest::READABLE, || {
                Err::<(), _>(io::ErrorKind::WouldBlock.into())
            });
            return Ok(false);
        }
    }
}

/// Zero-copy relaying of bulk flows with `splice(2)` through a pipe.
mod splice {
    use std::io;
    use std::os::fd::OwnedFd;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Instant;

    use prometheus_client::metrics::counter::Counter;
    use rustix::pipe::{PipeFlags, SpliceFlags, pipe_with, splice};
    use tokio::io::Interest;
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

    /// Moves `src` to `dst` until end of stream (`Ok(true)`); the pipe is empty after every
    /// round, so a failure never strands bytes that were counted.
    pub async fn pump(
        src: &TcpStream,
        dst: &TcpStream,
        pipe: &Pipe,
        counter: &Counter,
        total: &AtomicU64,
        activity: &AtomicU64,
        start: Instant,
    ) -> Result<bool, (&'static str, io::Error)> {
        loop {
            // Readiness waits and try_io take no cooperative budget, so a saturated flow
            // would never yield: give the other connections on this thread their turn.
            tokio::task::consume_budget().await;
            let filled = loop {
                src.readable().await.map_err(|e| ("read", e))?;
                match src.try_io(Interest::READABLE, || {
                    Ok(splice(src, None, &pipe.write, None, SPLICE_CHUNK, flags())?)
                }) {
                    Ok(0) => return Ok(true),
                    Ok(n) => break n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(("read", e)),
                }
            };
            let mut left = filled;
            while left > 0 {
                dst.writable().await.map_err(|e| ("write", e))?;
                match dst.try_io(Interest::WRITABLE, || {
                    Ok(splice(&pipe.read, None, dst, None, left, flags())?)
                }) {
                    Ok(0) => return Err(("write", io::ErrorKind::WriteZero.into())),
                    Ok(n) => {
                        left -= n;
                        total.fetch_add(n as u64, Ordering::Relaxed);
                        counter.inc_by(n as u64);
                        activity.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(("write", e)),
                }
            }
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

    /// Returns a buffer for reuse.
    pub fn give(mut buf: Vec<u8>) {
        buf.clear();
        FREE.with(|f| {
            let mut f = f.borrow_mut();
            if f.len() < KEEP {
                f.push(buf);
            }
        })
    }
}
