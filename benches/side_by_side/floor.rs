//! The floor: the least a proxy can do for a TLS passthrough connection, as a reference for
//! what the kernel's TCP work alone allows on this machine.
//!
//! One thread, one level-triggered epoll loop, no parsing, no timers, no limits, no splice:
//! accept; wait for the first bytes (a real proxy must, to route by SNI); connect to the one
//! backend; forward them; then copy both ways, with half-close, until both sides are done.
//! Bytes that cannot be written at once wait in a buffer while reading from the other side
//! pauses. It is started by the bench binary itself (`BENCH_FLOOR_SERVE=<listen address>`)
//! in a session of its own, like the proxies, and runs only the `sni` job.

use std::net::SocketAddr;
use std::os::fd::{IntoRawFd, RawFd};

use socket2::{Domain, SockRef, Socket, Type};

const LISTENER: u64 = u64::MAX;
/// `armed` of an fd taken out of the epoll set for good (see `EPOLLHUP` below).
const GONE: u32 = u32::MAX;

/// One proxied connection: side 0 is the client, side 1 the backend (-1 until the first
/// bytes arrive).
struct Conn {
    fds: [RawFd; 2],
    /// Bytes waiting to be written to `fds[i]`.
    pending: [Vec<u8>; 2],
    /// `fds[i]` has reached its end of stream.
    eof: [bool; 2],
    /// `fds[i]` has been shut down for writing.
    shut: [bool; 2],
    /// The events each fd is registered for.
    armed: [u32; 2],
}

fn os_err() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn ctl(ep: RawFd, op: i32, fd: RawFd, events: u32, token: u64) {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: `ev` is a valid epoll_event for the call's duration.
    unsafe { libc::epoll_ctl(ep, op, fd, &mut ev) };
}

/// A non-blocking connect to `to` with `TCP_NODELAY`; the socket, connected or connecting.
fn connect(to: SocketAddr) -> Option<RawFd> {
    let socket = Socket::new(
        Domain::for_address(to),
        Type::STREAM.nonblocking().cloexec(),
        None,
    )
    .ok()?;
    socket.set_tcp_nodelay(true).ok()?;
    match socket.connect(&to.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(_) => return None,
    }
    Some(socket.into_raw_fd())
}

/// Writes as much of `data` as the socket takes; the rest, or `None` on an error.
fn send(fd: RawFd, data: &[u8]) -> Option<usize> {
    // SAFETY: `data` is a live slice.
    let n = unsafe { libc::send(fd, data.as_ptr().cast(), data.len(), libc::MSG_NOSIGNAL) };
    if n >= 0 {
        Some(n as usize)
    } else if os_err() == libc::EAGAIN {
        Some(0)
    } else {
        None
    }
}

impl Conn {
    /// Flushes what waits for side `i`; false on an error.
    fn flush(&mut self, i: usize) -> bool {
        if self.pending[i].is_empty() {
            return true;
        }
        let Some(n) = send(self.fds[i], &self.pending[i]) else {
            return false;
        };
        self.pending[i].drain(..n);
        true
    }

    /// Shuts side `i` for writing once the other side has ended and nothing waits for `i`
    /// (unless the connection is about to close, which sends the FIN anyway).
    fn forward_eof(&mut self, i: usize) {
        if self.eof[1 - i] && self.pending[i].is_empty() && !self.shut[i] && self.fds[i] >= 0 {
            if self.eof[i] && self.pending[1 - i].is_empty() {
                return;
            }
            // SAFETY: `fds[i]` is an open socket owned by this connection.
            unsafe { libc::shutdown(self.fds[i], libc::SHUT_WR) };
            self.shut[i] = true;
        }
    }

    fn done(&self) -> bool {
        self.eof[0] && (self.fds[1] < 0 || (self.eof[1] && self.pending.iter().all(Vec::is_empty)))
    }

    /// The events side `i` needs now.
    fn wanted(&self, i: usize) -> u32 {
        let mut events = 0;
        if !self.eof[i] && self.pending[1 - i].is_empty() {
            events |= libc::EPOLLIN as u32;
        }
        if !self.pending[i].is_empty() {
            events |= libc::EPOLLOUT as u32;
        }
        events
    }

    fn close(&self) {
        for fd in self.fds {
            if fd >= 0 {
                // SAFETY: each fd is owned by this connection and closed once.
                unsafe { libc::close(fd) };
            }
        }
    }
}

/// Runs the floor proxy on `listen`, forwarding to `backend`; never returns.
pub fn serve(listen: &str, backend: SocketAddr) -> ! {
    // trellis's own listener set-up (backlog 4096, non-blocking), without its socket options.
    let addr: SocketAddr = listen.parse().expect("floor: listen address");
    let listener = trellis::net::socket::bind_std_with(
        addr,
        trellis::net::socket::LISTEN_BACKLOG,
        false,
        None,
    )
    .expect("floor: bind");
    SockRef::from(&listener)
        .set_tcp_nodelay(true) // inherited by accepted sockets
        .expect("floor: TCP_NODELAY");
    let lfd = listener.into_raw_fd();
    // SAFETY: creating an epoll instance has no preconditions.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    assert!(ep >= 0, "floor: epoll_create1");
    ctl(ep, libc::EPOLL_CTL_ADD, lfd, libc::EPOLLIN as u32, LISTENER);
    let mut conns: Vec<Option<Conn>> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut freed: Vec<usize> = Vec::new();
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: `events` has room for the given count.
        let n = unsafe { libc::epoll_wait(ep, events.as_mut_ptr(), events.len() as i32, -1) };
        for ev in events.iter().take(n.max(0) as usize) {
            let (token, what) = (ev.u64, ev.events);
            if token == LISTENER {
                loop {
                    // SAFETY: accept4 with no address out-parameters.
                    let fd = unsafe {
                        libc::accept4(
                            lfd,
                            std::ptr::null_mut(),
                            std::ptr::null_mut(),
                            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                        )
                    };
                    if fd < 0 {
                        if os_err() != libc::EAGAIN {
                            // Out of descriptors: the level-triggered listener would spin.
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                        break;
                    }
                    let slot = free.pop().unwrap_or_else(|| {
                        conns.push(None);
                        conns.len() - 1
                    });
                    conns[slot] = Some(Conn {
                        fds: [fd, -1],
                        pending: [Vec::new(), Vec::new()],
                        eof: [false; 2],
                        shut: [false; 2],
                        armed: [libc::EPOLLIN as u32, 0],
                    });
                    ctl(
                        ep,
                        libc::EPOLL_CTL_ADD,
                        fd,
                        libc::EPOLLIN as u32,
                        (slot as u64) << 1,
                    );
                }
                continue;
            }
            let (slot, i) = ((token >> 1) as usize, (token & 1) as usize);
            let Some(c) = conns.get_mut(slot).and_then(Option::as_mut) else {
                continue;
            };
            let mut ok = what & libc::EPOLLERR as u32 == 0;
            if ok && what & libc::EPOLLOUT as u32 != 0 {
                ok = c.flush(i);
                c.forward_eof(i);
            }
            // EPOLLHUP cannot be masked: once both directions of a socket are shut it is
            // reported on every wait. Its peer has finished, so what is left is read even
            // while reading is paused (bounded by the receive buffer), and a socket already
            // read to its end leaves the epoll set.
            let hup = what & libc::EPOLLHUP as u32 != 0;
            if ok && hup && c.eof[i] && c.armed[i] != GONE {
                ctl(ep, libc::EPOLL_CTL_DEL, c.fds[i], 0, 0);
                c.armed[i] = GONE;
            }
            let readable = what & libc::EPOLLIN as u32 != 0 || hup;
            if ok && readable && !c.eof[i] && (c.pending[1 - i].is_empty() || hup) {
                // SAFETY: `buf` is a live buffer of the given length.
                let r = unsafe { libc::recv(c.fds[i], buf.as_mut_ptr().cast(), buf.len(), 0) };
                if r > 0 {
                    let data = &buf[..r as usize];
                    let o = 1 - i;
                    if c.fds[o] < 0 {
                        // The first bytes: now the backend.
                        match connect(backend) {
                            Some(fd) => {
                                c.fds[1] = fd;
                                c.pending[1].extend_from_slice(data);
                                ok = c.flush(1);
                                c.armed[1] = c.wanted(1);
                                let token = (slot as u64) << 1 | 1;
                                ctl(ep, libc::EPOLL_CTL_ADD, fd, c.armed[1], token);
                            }
                            None => ok = false,
                        }
                    } else if c.pending[o].is_empty() {
                        match send(c.fds[o], data) {
                            Some(sent) => c.pending[o].extend_from_slice(&data[sent..]),
                            None => ok = false,
                        }
                    } else {
                        c.pending[o].extend_from_slice(data);
                    }
                } else if r == 0 {
                    c.eof[i] = true;
                    c.forward_eof(1 - i);
                } else if os_err() != libc::EAGAIN {
                    ok = false;
                }
            }
            if !ok || c.done() {
                // Closing removes the fds from the epoll set; the slot is reused only after
                // this batch, so a later event in it cannot reach a new connection.
                c.close();
                conns[slot] = None;
                freed.push(slot);
                continue;
            }
            for side in 0..2 {
                let want = c.wanted(side);
                if c.fds[side] >= 0 && c.armed[side] != GONE && want != c.armed[side] {
                    c.armed[side] = want;
                    let token = (slot as u64) << 1 | side as u64;
                    ctl(ep, libc::EPOLL_CTL_MOD, c.fds[side], want, token);
                }
            }
        }
        free.append(&mut freed);
    }
}
