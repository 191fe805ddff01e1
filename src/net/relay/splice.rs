//! Zero-copy relaying of bulk flows with `splice(2)` through a pipe, for two kernel TCP
//! sockets. Every pipe holds a place in the process's pipe budget ([`crate::net::fds`]), so
//! spliced connections never take descriptors the budget did not count. It never sees the
//! bytes it moves.

// The one `ioctl` (SIOCATMARK) that neither rustix nor socket2 offers.
#![expect(unsafe_code, reason = "system calls the safe crates do not wrap")]

use std::io;
use std::os::fd::OwnedFd;

use rustix::pipe::{PipeFlags, SpliceFlags, pipe_with, splice};
use tokio::net::TcpStream;

use super::SPLICE_CHUNK;
use crate::net::fds::{PipeBudget, PipeSlot};

/// Smallest pipe worth splicing through (the default pipe size).
const MIN_PIPE: usize = 64 * 1024;

/// A pipe used as the in-kernel buffer of one direction.
pub(crate) struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    /// Given back to the budget when the pipe is closed.
    _slot: PipeSlot,
}

/// Why no pipe was made.
#[derive(Debug)]
pub(crate) enum NoPipe {
    /// The pipe budget is used up for now; a later try may succeed.
    Budget,
    /// The kernel gave none, or one too small to be worth it (past the per-user pipe
    /// quota); trying again soon would fail the same way.
    Kernel,
}

impl Pipe {
    /// A pipe, if `budget` has room and the kernel gives a large enough one.
    pub(crate) fn new(budget: &'static PipeBudget) -> Result<Pipe, NoPipe> {
        let slot = budget.take().ok_or(NoPipe::Budget)?;
        let (read, write) =
            pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK).map_err(|_| NoPipe::Kernel)?;
        // Past the per-user pipe quota the kernel hands out tiny pipes, and splicing
        // through one is slower than copying: then the copy path is used instead.
        let size =
            rustix::pipe::fcntl_setpipe_size(&write, SPLICE_CHUNK).map_err(|_| NoPipe::Kernel)?;
        if size < MIN_PIPE {
            return Err(NoPipe::Kernel);
        }
        Ok(Pipe {
            read,
            write,
            _slot: slot,
        })
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
pub(crate) struct AtUrgentMark;

impl std::fmt::Display for AtUrgentMark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("at TCP urgent data")
    }
}

impl std::error::Error for AtUrgentMark {}

/// Whether `e` is [`AtUrgentMark`].
pub(crate) fn is_urgent_mark(e: &io::Error) -> bool {
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
    pub(crate) fn fill(&self, src: &TcpStream) -> io::Result<usize> {
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
    pub(crate) fn drain(&self, dst: &TcpStream, len: usize) -> io::Result<usize> {
        Ok(splice(&self.read, None, dst, None, len, flags())?)
    }
}
