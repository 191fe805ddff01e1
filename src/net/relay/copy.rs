//! One direction of a relay: moves bytes from a source leg to a destination leg, counts
//! them, and forwards end of stream as a half-close.
//!
//! Two paths, chosen per relay:
//! - **kernel TCP to kernel TCP**: wait for readability without holding a buffer, read into a
//!   pooled buffer sized by what the direction has carried, and switch to `splice(2)` for
//!   bulk flows (see [`super`] for the rules);
//! - **any other stream** (TLS, a user-space TCP socket, an in-memory pipe): `poll_read` into
//!   a pooled buffer that is given back whenever the read is pending, `poll_write`,
//!   `poll_flush` once the buffer is written, `poll_shutdown` at end of stream.
//!
//! A kernel TCP source is read through [`super::read`] on either path, so that a read that
//! stops at TCP urgent data keeps the socket readable for the urgent byte.
//!
//! It never parses the bytes and owns no timer.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::pool::{LARGE_BUF, MEDIUM_BUF, SMALL_BUF};
use super::{Leg, pool, read, splice};
use crate::net::fds::{self, PipeBudget};

const GROW_AFTER: u64 = 128 * 1024;
const BULK_AFTER: u64 = 4 * 1024 * 1024;
/// A direction that has carried this much, and whose last read filled its buffer (more was
/// waiting), is a bulk flow: it switches to `splice(2)`.
pub(crate) const SPLICE_AFTER: u64 = 1024 * 1024;
/// A splice that moves less than this finds an interactive flow (small messages, as on a
/// long-lived watch or exec stream): once the pipe is drained it copies again, which moves a
/// message in one read and one write where splicing takes two splices, an empty splice and
/// the urgent-mark check. Only a splice made after waiting for data counts: the one right
/// after a drain only finds what arrived meanwhile, which is little on a bulk flow that the
/// relay keeps up with, and would make it give up and re-create its pipe over and over.
const SMALL_SPLICE: usize = 4 * 1024;
/// Most bytes one direction moves in one poll before it yields to other connections: a
/// safety net only, since every round already takes cooperative budget through its
/// readiness poll. A low cap costs bulk throughput (2 MiB cut 8-stream throughput by a
/// quarter: more task switches between the flows).
const MAX_PER_POLL: u64 = 64 * 1024 * 1024;

/// The operation an I/O error happened in, which tells on which leg it happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Reading the source.
    Read,
    /// Writing (or flushing, or shutting down) the destination.
    Write,
}

/// An I/O error and the operation it happened in.
pub(crate) type DirError = (Op, io::Error);

/// One direction of a relay.
pub(crate) struct Dir {
    /// Bytes written to the destination.
    pub(crate) carried: u64,
    /// A pipe could not be had (e.g. past the per-user pipe quota): copy from now on rather
    /// than retry on every readable event.
    no_splice: bool,
    /// The last read filled its buffer: more data was waiting.
    full_read: bool,
    /// Bytes of `carried` that went through a pipe (for tests and debugging).
    pub(crate) spliced: u64,
    /// Where pipes are counted: the process's budget ([`fds::PIPES`]).
    pub(crate) pipes: &'static PipeBudget,
    state: State,
}

enum State {
    /// Waiting for the source to become readable; no buffer is held.
    Read,
    /// Writing `buf[off..]` to the destination (the buffer is held only meanwhile).
    Write { buf: Vec<u8>, off: usize },
    /// Generic path: the buffer is written; flushing the destination.
    Flush,
    /// Generic path: end of stream from the source; shutting the destination's write side.
    Shutdown,
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

/// Where a direction counts what it moves, and which direction it is.
pub(crate) struct Meter<'a> {
    /// The per-route byte counter of this direction.
    pub(crate) counter: &'a Counter,
    /// When bytes last moved in either direction.
    pub(crate) activity: &'a mut Instant,
    /// The leg the direction reads (`client` or `backend`), for its debug lines.
    pub(crate) from: &'static str,
}

impl Meter<'_> {
    /// Counts `n` bytes written by the direction.
    fn count(&mut self, carried: &mut u64, n: usize) {
        *carried += n as u64;
        self.counter.inc_by(n as u64);
        *self.activity = Instant::now();
    }
}

impl Dir {
    /// A direction that first writes `initial` (bytes already read), then copies.
    pub(crate) fn new(initial: Vec<u8>) -> Self {
        Dir {
            carried: 0,
            no_splice: false,
            full_read: false,
            spliced: 0,
            pipes: &fds::PIPES,
            state: if initial.is_empty() {
                State::Read
            } else {
                State::Write {
                    buf: initial,
                    off: 0,
                }
            },
        }
    }

    /// Whether end of stream has been forwarded.
    pub(crate) fn done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// Whether end of stream has been read, even if forwarding it (a TLS `close_notify`)
    /// has not finished: the half-close bound runs from here.
    pub(crate) fn ended(&self) -> bool {
        matches!(self.state, State::Shutdown | State::Done)
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

    /// Gives back a buffer still held (the relay is dropped mid-write).
    pub(crate) fn release(&mut self) {
        if let State::Write { buf, .. } = std::mem::replace(&mut self.state, State::Done) {
            pool::give(buf);
        }
    }

    /// A write finished `buf`: back to reading (through a flush on the generic path).
    fn written(&mut self, then: State) {
        if let State::Write { buf, .. } = std::mem::replace(&mut self.state, then) {
            pool::give(buf);
        }
    }

    /// Kernel TCP to kernel TCP: moves what can be moved from `src` to `dst`. `Ready(Ok)`
    /// once end of stream has been forwarded (as a half-close, unless `other_done`: then
    /// both sockets close right after and the close itself sends the FIN).
    pub(crate) fn poll_tcp(
        &mut self,
        cx: &mut Context<'_>,
        src: &TcpStream,
        dst: &TcpStream,
        meter: &mut Meter<'_>,
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
                    ready!(src.poll_read_ready(cx)).map_err(|e| (Op::Read, e))?;
                    if self.carried >= SPLICE_AFTER && self.full_read && !self.no_splice {
                        match splice::Pipe::new(self.pipes) {
                            Ok(pipe) => {
                                // Bulk flow: from here on, bytes go socket -> pipe -> socket
                                // inside the kernel.
                                tracing::debug!(
                                    from = meter.from,
                                    carried = self.carried,
                                    "splicing a bulk flow"
                                );
                                self.state = State::Splice {
                                    pipe,
                                    filled: 0,
                                    then_copy: false,
                                };
                                continue;
                            }
                            // Copied for now: the budget may have room for the next read.
                            Err(splice::NoPipe::Budget) => {}
                            Err(splice::NoPipe::Kernel) => self.no_splice = true,
                        }
                    }
                    let mut buf = pool::take(self.buf_size());
                    let room = buf.capacity();
                    match read::read_tcp(src, &mut buf, room) {
                        Ok(0) => {
                            pool::give(buf);
                            self.state = State::Done;
                            if !other_done {
                                let _ =
                                    socket2::SockRef::from(dst).shutdown(std::net::Shutdown::Write);
                            }
                            return Poll::Ready(Ok(()));
                        }
                        Ok(n) => {
                            self.full_read = n == buf.capacity();
                            self.state = State::Write { buf, off: 0 };
                        }
                        Err(e) => {
                            pool::give(buf);
                            if !retry(&e) {
                                return Poll::Ready(Err((Op::Read, e)));
                            }
                        }
                    }
                }
                State::Write { buf, off } => {
                    ready!(dst.poll_write_ready(cx)).map_err(|e| (Op::Write, e))?;
                    match dst.try_write(&buf[*off..]) {
                        Ok(0) => {
                            return Poll::Ready(Err((Op::Write, io::ErrorKind::WriteZero.into())));
                        }
                        Ok(n) => {
                            *off += n;
                            let finished = *off == buf.len();
                            // Counted per write, so a slow reader still taking bytes is
                            // activity (a whole buffer may take longer than the idle timeout).
                            meter.count(&mut self.carried, n);
                            moved += n as u64;
                            if finished {
                                self.written(State::Read);
                            }
                        }
                        Err(e) if retry(&e) => {}
                        Err(e) => return Poll::Ready(Err((Op::Write, e))),
                    }
                }
                State::Splice {
                    pipe,
                    filled,
                    then_copy,
                } if *filled == 0 => {
                    ready!(src.poll_read_ready(cx)).map_err(|e| (Op::Read, e))?;
                    match src.try_io(Interest::READABLE, || pipe.fill(src)) {
                        Ok(0) => {
                            self.state = State::Done;
                            if !other_done {
                                let _ =
                                    socket2::SockRef::from(dst).shutdown(std::net::Shutdown::Write);
                            }
                            return Poll::Ready(Ok(()));
                        }
                        Ok(n) => {
                            *filled = n;
                            *then_copy = n < SMALL_SPLICE && !refill;
                        }
                        Err(e) if splice::is_urgent_mark(&e) => {
                            // The pipe is empty: copying carries on where splicing stopped.
                            tracing::debug!(
                                from = meter.from,
                                "splice stopped at TCP urgent data; copying from here on"
                            );
                            self.no_splice = true;
                            self.state = State::Read;
                        }
                        Err(e) if retry(&e) => {}
                        Err(e) => return Poll::Ready(Err((Op::Read, e))),
                    }
                }
                State::Splice {
                    pipe,
                    filled,
                    then_copy,
                } => {
                    ready!(dst.poll_write_ready(cx)).map_err(|e| (Op::Write, e))?;
                    match dst.try_io(Interest::WRITABLE, || pipe.drain(dst, *filled)) {
                        Ok(0) => {
                            return Poll::Ready(Err((Op::Write, io::ErrorKind::WriteZero.into())));
                        }
                        Ok(n) => {
                            *filled -= n;
                            self.spliced += n as u64;
                            meter.count(&mut self.carried, n);
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
                        Err(e) => return Poll::Ready(Err((Op::Write, e))),
                    }
                }
                // Generic-path states never occur between two TCP sockets.
                State::Flush | State::Shutdown => self.state = State::Read,
            }
        }
    }

    /// Any stream to any stream: moves what can be moved from `src` to `dst` through a
    /// pooled buffer. `Ready(Ok)` once end of stream has been forwarded with
    /// `poll_shutdown` (a failed shutdown still ends the direction: the peer is gone).
    pub(crate) fn poll_generic<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        src: &mut R,
        dst: &mut W,
        meter: &mut Meter<'_>,
    ) -> Poll<Result<(), DirError>>
    where
        R: Leg + ?Sized,
        W: AsyncWrite + Unpin + ?Sized,
    {
        let mut moved = 0u64;
        loop {
            if moved >= MAX_PER_POLL {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            match &mut self.state {
                State::Done => return Poll::Ready(Ok(())),
                State::Read => {
                    if let Some(tcp) = src.as_tcp() {
                        // A kernel TCP source is read as on the TCP path: tokio's
                        // `poll_read` takes a read that stops at the urgent mark for a
                        // drained socket and is never woken for the urgent byte.
                        ready!(tcp.poll_read_ready(cx)).map_err(|e| (Op::Read, e))?;
                        let mut buf = pool::take(self.buf_size());
                        let room = buf.capacity();
                        match read::read_tcp(tcp, &mut buf, room) {
                            Ok(0) => {
                                pool::give(buf);
                                self.state = State::Shutdown;
                            }
                            Ok(_) => self.state = State::Write { buf, off: 0 },
                            Err(e) => {
                                pool::give(buf);
                                if !retry(&e) {
                                    return Poll::Ready(Err((Op::Read, e)));
                                }
                            }
                        }
                        continue;
                    }
                    let mut buf = pool::take(self.buf_size());
                    // Initialised once per read: the generic path is not the hot one, and
                    // this keeps it free of unsafe code.
                    buf.resize(buf.capacity(), 0);
                    let mut rb = ReadBuf::new(&mut buf);
                    match Pin::new(&mut *src).poll_read(cx, &mut rb) {
                        Poll::Pending => {
                            // Nothing to hold while the source is quiet.
                            pool::give(buf);
                            return Poll::Pending;
                        }
                        Poll::Ready(Err(e)) => {
                            pool::give(buf);
                            if let Some(poll) = not_now(cx, &e) {
                                return poll;
                            }
                            return Poll::Ready(Err((Op::Read, e)));
                        }
                        Poll::Ready(Ok(())) => {
                            let n = rb.filled().len();
                            buf.truncate(n);
                            if n == 0 {
                                pool::give(buf);
                                self.state = State::Shutdown;
                            } else {
                                self.state = State::Write { buf, off: 0 };
                            }
                        }
                    }
                }
                State::Write { buf, off } => {
                    match ready!(Pin::new(&mut *dst).poll_write(cx, &buf[*off..])) {
                        Ok(0) => {
                            return Poll::Ready(Err((Op::Write, io::ErrorKind::WriteZero.into())));
                        }
                        Ok(n) => {
                            *off += n;
                            let finished = *off == buf.len();
                            meter.count(&mut self.carried, n);
                            moved += n as u64;
                            if finished {
                                self.written(State::Flush);
                            }
                        }
                        Err(e) => {
                            if let Some(poll) = not_now(cx, &e) {
                                return poll;
                            }
                            return Poll::Ready(Err((Op::Write, e)));
                        }
                    }
                }
                State::Flush => {
                    ready!(Pin::new(&mut *dst).poll_flush(cx)).map_err(|e| (Op::Write, e))?;
                    self.state = State::Read;
                }
                State::Shutdown => {
                    if let Err(e) = ready!(Pin::new(&mut *dst).poll_shutdown(cx)) {
                        tracing::debug!(error = %e, "half-close not forwarded");
                    }
                    self.state = State::Done;
                    return Poll::Ready(Ok(()));
                }
                // Only between two TCP sockets.
                State::Splice { .. } => self.state = State::Read,
            }
        }
    }
}

/// A stream that answers a poll with `WouldBlock` or `Interrupted` (which an `AsyncRead` or
/// `AsyncWrite` should not) is polled again on the next turn of the event loop, not in a
/// loop here: that could spin on one leg forever. `None` for any other error.
fn not_now<T>(cx: &mut Context<'_>, e: &io::Error) -> Option<Poll<T>> {
    retry(e).then(|| {
        cx.waker().wake_by_ref();
        Poll::Pending
    })
}

/// Whether an I/O error only means "not now".
fn retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}
