//! The floor: the least a proxy can do for a TLS passthrough connection, as a reference for
//! what the kernel's TCP work alone allows on the host it runs on.
//!
//! One thread, one level-triggered epoll loop, no parsing, no timers, no limits, no splice:
//! accept; wait for the first bytes (a real proxy must, to route by SNI); connect to the one
//! backend; forward them; then copy both ways, with half-close, until both sides are done.
//! Bytes that cannot be written at once wait in a buffer while reading from the other side
//! pauses. It is started by the bench binary itself (`BENCH_FLOOR_SERVE=<listen address>`)
//! in a session of its own, like the proxies, and runs only the `sni` job.

use std::net::{SocketAddr, TcpListener};
use std::os::fd::OwnedFd;

use rustix::event::epoll::{self, CreateFlags, Event, EventData, EventFlags};
use rustix::io::Errno;
use rustix::net::{RecvFlags, SendFlags, Shutdown, SocketFlags};
use socket2::{Domain, SockRef, Socket, Type};

const LISTENER: u64 = u64::MAX;
/// `armed` of an fd taken out of the epoll set for good (see `EPOLLHUP` below); a sentinel
/// rather than an `Option`, which would make every connection 8 bytes larger.
const GONE: EventFlags = EventFlags::from_bits_retain(u32::MAX);

/// One proxied connection: side 0 is the client, side 1 the backend (`None` until the first
/// bytes arrive). Dropping it closes its sockets, which removes them from the epoll set.
struct Conn {
    fds: [Option<OwnedFd>; 2],
    /// Bytes waiting to be written to `fds[i]`.
    pending: [Vec<u8>; 2],
    /// `fds[i]` has reached its end of stream.
    eof: [bool; 2],
    /// `fds[i]` has been shut down for writing.
    shut: [bool; 2],
    /// The events each fd is registered for.
    armed: [EventFlags; 2],
}

/// The epoll data of side `side` of the connection in `slot`.
fn conn_data(slot: usize, side: usize) -> EventData {
    EventData::new_u64((slot as u64) << 1 | side as u64)
}

/// A non-blocking connect to `to` with `TCP_NODELAY`; the socket, connected or connecting.
fn connect(to: SocketAddr) -> Option<OwnedFd> {
    let socket = Socket::new(
        Domain::for_address(to),
        Type::STREAM.nonblocking().cloexec(),
        None,
    )
    .ok()?;
    socket.set_tcp_nodelay(true).ok()?;
    match socket.connect(&to.into()) {
        Ok(()) => {}
        Err(e) if Errno::from_io_error(&e) == Some(Errno::INPROGRESS) => {}
        Err(_) => return None,
    }
    Some(socket.into())
}

/// Writes as much of `data` as the socket takes; the rest, or `None` on an error.
fn send(fd: &OwnedFd, data: &[u8]) -> Option<usize> {
    match rustix::net::send(fd, data, SendFlags::NOSIGNAL) {
        Ok(n) => Some(n),
        Err(Errno::AGAIN) => Some(0),
        Err(_) => None,
    }
}

impl Conn {
    /// The socket of side `i`, which is set before it is registered with epoll (so before any
    /// event for it) and stays until the connection is dropped.
    fn fd(&self, i: usize) -> &OwnedFd {
        self.fds[i]
            .as_ref()
            .expect("floor: a side with events has a socket")
    }

    /// Flushes what waits for side `i`; false on an error.
    fn flush(&mut self, i: usize) -> bool {
        if self.pending[i].is_empty() {
            return true;
        }
        let Some(n) = send(self.fd(i), &self.pending[i]) else {
            return false;
        };
        self.pending[i].drain(..n);
        true
    }

    /// Shuts side `i` for writing once the other side has ended and nothing waits for `i`
    /// (unless the connection is about to close, which sends the FIN anyway).
    fn forward_eof(&mut self, i: usize) {
        if self.eof[1 - i] && self.pending[i].is_empty() && !self.shut[i] {
            let Some(fd) = &self.fds[i] else { return };
            if self.eof[i] && self.pending[1 - i].is_empty() {
                return;
            }
            let _ = rustix::net::shutdown(fd, Shutdown::Write);
            self.shut[i] = true;
        }
    }

    fn done(&self) -> bool {
        self.eof[0]
            && (self.fds[1].is_none() || (self.eof[1] && self.pending.iter().all(Vec::is_empty)))
    }

    /// The events side `i` needs now.
    fn wanted(&self, i: usize) -> EventFlags {
        let mut events = EventFlags::empty();
        if !self.eof[i] && self.pending[1 - i].is_empty() {
            events |= EventFlags::IN;
        }
        if !self.pending[i].is_empty() {
            events |= EventFlags::OUT;
        }
        events
    }
}

/// Runs the floor proxy on `listen`, forwarding to `backend`; never returns.
pub fn serve(listen: &str, backend: SocketAddr) -> ! {
    // trellis's own listener set-up (backlog 4096, non-blocking), without its socket options.
    let addr: SocketAddr = listen.parse().expect("floor: listen address");
    let listener: TcpListener = trellis::net::socket::bind_std_with(
        addr,
        trellis::net::socket::LISTEN_BACKLOG,
        false,
        None,
    )
    .expect("floor: bind");
    SockRef::from(&listener)
        .set_tcp_nodelay(true) // inherited by accepted sockets
        .expect("floor: TCP_NODELAY");
    let ep = epoll::create(CreateFlags::CLOEXEC).expect("floor: epoll_create1");
    epoll::add(&ep, &listener, EventData::new_u64(LISTENER), EventFlags::IN)
        .expect("floor: epoll_ctl");
    let mut conns: Vec<Option<Conn>> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut freed: Vec<usize> = Vec::new();
    let mut events = vec![
        Event {
            flags: EventFlags::empty(),
            data: EventData::new_u64(0),
        };
        256
    ];
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // No timeout; an error (EINTR) is an empty batch.
        let n = epoll::wait(&ep, &mut events[..], None).unwrap_or(0);
        for &ev in &events[..n] {
            let (token, what) = (ev.data.u64(), ev.flags);
            if token == LISTENER {
                loop {
                    let fd = match rustix::net::accept_with(
                        &listener,
                        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
                    ) {
                        Ok(fd) => fd,
                        Err(e) => {
                            if e != Errno::AGAIN {
                                // Out of descriptors: the level-triggered listener would spin.
                                std::thread::sleep(std::time::Duration::from_millis(1));
                            }
                            break;
                        }
                    };
                    let slot = free.pop().unwrap_or_else(|| {
                        conns.push(None);
                        conns.len() - 1
                    });
                    let _ = epoll::add(&ep, &fd, conn_data(slot, 0), EventFlags::IN);
                    conns[slot] = Some(Conn {
                        fds: [Some(fd), None],
                        pending: [Vec::new(), Vec::new()],
                        eof: [false; 2],
                        shut: [false; 2],
                        armed: [EventFlags::IN, EventFlags::empty()],
                    });
                }
                continue;
            }
            let (slot, i) = ((token >> 1) as usize, (token & 1) as usize);
            let Some(c) = conns.get_mut(slot).and_then(Option::as_mut) else {
                continue;
            };
            let mut ok = !what.contains(EventFlags::ERR);
            if ok && what.contains(EventFlags::OUT) {
                ok = c.flush(i);
                c.forward_eof(i);
            }
            // EPOLLHUP cannot be masked: once both directions of a socket are shut it is
            // reported on every wait. Its peer has finished, so what is left is read even
            // while reading is paused (bounded by the receive buffer), and a socket already
            // read to its end leaves the epoll set.
            let hup = what.contains(EventFlags::HUP);
            if ok && hup && c.eof[i] && c.armed[i] != GONE {
                let _ = epoll::delete(&ep, c.fd(i));
                c.armed[i] = GONE;
            }
            let readable = what.contains(EventFlags::IN) || hup;
            if ok && readable && !c.eof[i] && (c.pending[1 - i].is_empty() || hup) {
                match rustix::net::recv(c.fd(i), &mut buf[..], RecvFlags::empty()) {
                    Ok((0, _)) => {
                        c.eof[i] = true;
                        c.forward_eof(1 - i);
                    }
                    Ok((r, _)) => {
                        let data = &buf[..r];
                        let o = 1 - i;
                        if c.fds[o].is_none() {
                            // The first bytes: now the backend.
                            match connect(backend) {
                                Some(fd) => {
                                    c.fds[1] = Some(fd);
                                    c.pending[1].extend_from_slice(data);
                                    ok = c.flush(1);
                                    let want = c.wanted(1);
                                    c.armed[1] = want;
                                    let _ = epoll::add(&ep, c.fd(1), conn_data(slot, 1), want);
                                }
                                None => ok = false,
                            }
                        } else if c.pending[o].is_empty() {
                            match send(c.fd(o), data) {
                                Some(sent) => c.pending[o].extend_from_slice(&data[sent..]),
                                None => ok = false,
                            }
                        } else {
                            c.pending[o].extend_from_slice(data);
                        }
                    }
                    Err(Errno::AGAIN) => {}
                    Err(_) => ok = false,
                }
            }
            if !ok || c.done() {
                // Dropping the connection closes its sockets (client first), which removes
                // them from the epoll set; the slot is reused only after this batch, so a
                // later event in it cannot reach a new connection.
                conns[slot] = None;
                freed.push(slot);
                continue;
            }
            for side in 0..2 {
                let want = c.wanted(side);
                if let Some(fd) = &c.fds[side]
                    && c.armed[side] != GONE
                    && want != c.armed[side]
                {
                    c.armed[side] = want;
                    let _ = epoll::modify(&ep, fd, conn_data(slot, side), want);
                }
            }
        }
        free.append(&mut freed);
    }
}
