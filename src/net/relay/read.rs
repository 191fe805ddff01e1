//! Reads from a kernel TCP socket that keep its readiness true: a read clears the socket's
//! readiness only when the kernel says nothing is left unread, and every read of a relayed
//! socket, before the relay ([`read_leg`]) or in it, goes through here.
//!
//! A read that comes back short does not mean the socket is drained: the kernel ends a read
//! before TCP urgent data (the urgent mark), even with the urgent byte inline and more bytes
//! queued behind it. A reader that took a short read for a drained socket and cleared its
//! readiness, as tokio's own `AsyncRead` for `TcpStream` does, would never be woken for the
//! rest: it arrived together with the bytes before the mark. So each read asks the kernel how
//! many bytes it left unread (`recvmsg(2)` with the `TCP_INQ` control message, which the
//! sockets of every role ask for: [`report_unread`]); a read of a socket that does not
//! report them leaves the readiness to a later read that finds nothing (`EAGAIN`).
//!
//! It never waits, except [`read_leg`] for the first bytes.

// `recvmsg` with a control message and the `TCP_INQ` option: neither rustix nor socket2
// offers them.
#![expect(unsafe_code, reason = "system calls the safe crates do not wrap")]

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use tokio::io::{AsyncReadExt, Interest};
use tokio::net::TcpStream;

use super::Leg;

/// Room for one `TCP_CM_INQ` control message (an `int`), in words so that it is aligned
/// like the `cmsghdr` the kernel writes into it.
const CONTROL_WORDS: usize = {
    // SAFETY: arithmetic on a constant, no memory is touched.
    let space = unsafe { libc::CMSG_SPACE(size_of::<libc::c_int>() as libc::c_uint) } as usize;
    space.div_ceil(size_of::<u64>())
};

/// Asks the kernel to report, with every read of `socket`, how many bytes the read left
/// unread (`TCP_INQ`; accepted sockets inherit it from their listener). Without it, reads
/// still work, at the cost of one read that finds nothing per time the socket is drained.
pub(crate) fn report_unread(socket: BorrowedFd<'_>) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: `TCP_INQ` reads one `int` through the pointer, which points to `on`, alive for
    // the call; `socket` is an open descriptor for its lifetime.
    let r = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_TCP,
            libc::TCP_INQ,
            (&raw const on).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// One `recvmsg` into `spare`: how many bytes it read, and how many it left unread (`None`
/// when the socket does not report them).
fn recv_reporting(
    socket: BorrowedFd<'_>,
    spare: &mut [MaybeUninit<u8>],
) -> io::Result<(usize, Option<usize>)> {
    let mut iov = libc::iovec {
        iov_base: spare.as_mut_ptr().cast(),
        iov_len: spare.len(),
    };
    let mut control = [0u64; CONTROL_WORDS];
    // SAFETY: an all-zero `msghdr` is a valid value (no name, no buffers, no flags).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&control) as _;
    // SAFETY: `msg` points to `iov`, which points to `spare` (writable for its length), and
    // to `control` (writable for `msg_controllen` bytes); all three outlive the call, and
    // `socket` is an open descriptor.
    let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &raw mut msg, 0) };
    let Ok(n) = usize::try_from(n) else {
        return Err(io::Error::last_os_error());
    };
    // The kernel sends no other control message on a TCP socket unless asked to (receive
    // timestamps), so the report is the first one if there is one.
    // SAFETY: `CMSG_FIRSTHDR` returns null or a pointer into `control` with room for a
    // header (the kernel set `msg_controllen` to what it wrote); the header says how long
    // its data is before it is read, unaligned, from within `control`.
    let unread = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
        if !cmsg.is_null()
            && (*cmsg).cmsg_level == libc::SOL_TCP
            && (*cmsg).cmsg_type == libc::TCP_CM_INQ
            && (*cmsg).cmsg_len as usize
                >= libc::CMSG_LEN(size_of::<libc::c_int>() as libc::c_uint) as usize
        {
            let unread = libc::CMSG_DATA(cmsg).cast::<libc::c_int>().read_unaligned();
            usize::try_from(unread).ok()
        } else {
            None
        }
    };
    Ok((n, unread))
}

/// Reads what `src` has, at most `max` bytes, onto the end of `buf`; `Ok(0)` at end of
/// stream, `WouldBlock` when there was nothing (the readiness is then cleared).
///
/// When the kernel reports nothing left unread, the socket's readiness is cleared right
/// away instead of by a later read failing with `EAGAIN` (one wasted `recvfrom` per
/// message). The clear uses the readiness tick taken *before* the read: an event the I/O
/// driver records after it (possibly on another thread) is newer and survives, so data
/// arriving meanwhile is not lost to edge-triggered epoll. A read that stops at the urgent
/// mark leaves the urgent byte unread, and so keeps the readiness for the read that takes
/// it.
pub(crate) fn read_tcp(src: &TcpStream, buf: &mut Vec<u8>, max: usize) -> io::Result<usize> {
    buf.reserve(max);
    let mut drained = None;
    let result = src.try_io(Interest::READABLE, || {
        let (n, unread) = recv_reporting(src.as_fd(), &mut buf.spare_capacity_mut()[..max])?;
        // SAFETY: `recvmsg` initialised the first `n` bytes of the spare capacity (`n` is
        // at most `max`, which is within it).
        unsafe { buf.set_len(buf.len() + n) };
        if n > 0 && unread == Some(0) {
            drained = Some(n);
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    });
    match (result, drained) {
        (_, Some(n)) => Ok(n),
        (result, None) => result,
    }
}

/// Reads what `leg` has, at most `max` bytes, onto the end of `buf`, waiting for the first;
/// `Ok(0)` at end of stream. For whatever reads a leg before its relay starts (a tunnel's or
/// a CONNECT proxy's answer): the relay then finds the socket's readiness as it is, with
/// urgent data that came with those bytes still to be read.
pub(crate) async fn read_leg<L: Leg + ?Sized>(
    leg: &mut L,
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<usize> {
    let Some(tcp) = leg.as_tcp() else {
        let start = buf.len();
        buf.resize(start + max, 0);
        let read = leg.read(&mut buf[start..]).await;
        buf.truncate(start + *read.as_ref().unwrap_or(&0));
        return read;
    };
    loop {
        tcp.readable().await?;
        match read_tcp(tcp, buf, max) {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            read => return read,
        }
    }
}

/// Whether `socket` reports what reads leave unread ([`report_unread`]).
#[cfg(test)]
pub(crate) fn reports_unread(socket: BorrowedFd<'_>) -> bool {
    let mut on: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `TCP_INQ` writes one `int` through the pointer, which points to `on`, and
    // its length through `len`; both are alive for the call.
    let r = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_TCP,
            libc::TCP_INQ,
            (&raw mut on).cast(),
            &raw mut len,
        )
    };
    r == 0 && on != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::socket::{ListenOptions, bind_listener};
    use tokio::net::TcpListener;

    /// A connected pair: (sender, receiver), the receiver accepted from a listener `served`
    /// as the roles bind theirs, or from a plain one.
    async fn pair(served: bool) -> (TcpStream, TcpStream) {
        let addr = "127.0.0.1:0".parse().unwrap();
        let l = if served {
            let options = ListenOptions {
                backlog: 16,
                reuse_port: false,
                freebind: false,
                keepalive: None,
            };
            TcpListener::from_std(bind_listener(addr, &options).unwrap()).unwrap()
        } else {
            TcpListener::bind(addr).await.unwrap()
        };
        let sender = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (receiver, _) = l.accept().await.unwrap();
        socket2::SockRef::from(&receiver)
            .set_out_of_band_inline(true)
            .unwrap();
        (sender, receiver)
    }

    /// A read that stops at the urgent mark reports the urgent byte and what follows as
    /// unread, and the read that takes them reports nothing left; a socket that was not
    /// asked reports nothing at all.
    #[tokio::test]
    async fn a_read_reports_what_it_left_unread() {
        for served in [true, false] {
            let (sender, receiver) = pair(served).await;
            assert_eq!(reports_unread(receiver.as_fd()), served);
            let sock = socket2::SockRef::from(&sender);
            sock.set_tcp_cork(true).unwrap();
            sock.send(&[b'x'; 1000]).unwrap();
            sock.send_out_of_band(b"!").unwrap();
            sock.set_tcp_cork(false).unwrap();
            sock.send(&[b'y'; 10]).unwrap();
            let limit = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
            while rustix::io::ioctl_fionread(&receiver).unwrap() < 1011 {
                assert!(tokio::time::Instant::now() < limit, "never queued");
                tokio::task::yield_now().await;
            }
            let mut buf = Vec::with_capacity(4096);
            let reads = [(1000, 11), (11, 0)].map(|(n, left)| (n, served.then_some(left)));
            for (n, left) in reads {
                buf.clear();
                let got = recv_reporting(receiver.as_fd(), &mut buf.spare_capacity_mut()[..4096]);
                assert_eq!(got.unwrap(), (n, left), "served: {served}");
            }
        }
    }
}
