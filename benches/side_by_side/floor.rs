//! The floor: the least a proxy can do for a TLS passthrough connection, as a reference for
//! what the kernel's TCP work alone allows on the host it runs on.
//!
//! One thread, one level-triggered epoll loop, no parsing, no timers, no limits, no splice:
//! accept; wait for the first bytes (a real proxy must, to route by SNI); connect to the one
//! backend; forward them; then copy both ways, with half-close, until both sides are done.
//! Bytes that cannot be written at once wait in a buffer while reading from the other side
//! pauses. It is started by the bench binary itself (`BENCH_FLOOR_SERVE=1`) in a session of
//! its own, like the proxies, with one listener per job:
//! - `sni`: the first bytes go to the backend as they are;
//! - `proxy-destination`: the PROXY v2 header at the start of the first bytes (the bench
//!   client writes it together with the ClientHello) is dropped, the rest forwarded;
//! - `http-connect`: the first bytes are the request head (the bench client waits for the
//!   answer before it sends more); `200 Connection established` goes back once the backend
//!   connection is up, the head itself nowhere.
//!
//! `BENCH_FLOOR_DEFER=1` sets `TCP_DEFER_ACCEPT` on its listeners, so a connection is
//! accepted only with its first bytes: the floor rebuilt with that technique.

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

/// What a listener's connections start with (see the module documentation).
#[derive(Clone, Copy, PartialEq)]
pub enum Mode {
    /// A TLS ClientHello.
    Sni,
    /// A PROXY v2 header, then the ClientHello.
    ProxyV2,
    /// An HTTP CONNECT request head.
    Connect,
}

const CONNECTED: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";

/// One proxied connection: side 0 is the client, side 1 the backend (`None` until the first
/// bytes arrive). Dropping it closes its sockets, which removes them from the epoll set.
struct Conn {
    /// `http-connect`: the answer still owed to the client once the backend is connected.
    reply: bool,
    /// What the connection starts with.
    mode: Mode,
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
        if !self.pending[i].is_empty() || (i == 1 && self.reply) {
            events |= EventFlags::OUT;
        }
        events
    }
}

/// Sets `TCP_DEFER_ACCEPT` (seconds to wait for a connection's first bytes before it is
/// accepted anyway), which neither rustix nor socket2 wraps.
#[expect(unsafe_code, reason = "setsockopt has no safe wrapper for this option")]
fn set_defer_accept(listener: &TcpListener, secs: libc::c_int) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is open for the call, and the option value is a c_int whose
    // size is passed with it.
    let r = unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            (&secs as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The length of the PROXY v2 header at the start of `data` (0 if there is none).
fn proxy_v2_len(data: &[u8]) -> usize {
    const SIG: &[u8] = b"\r\n\r\n\0\r\nQUIT\n";
    if data.len() >= 16 && data.starts_with(SIG) {
        (16 + u16::from_be_bytes([data[14], data[15]]) as usize).min(data.len())
    } else {
        0
    }
}

/// Runs the floor proxy on `listens` (address and what its connections start with),
/// forwarding to `backend`; never returns.
pub fn serve(listens: &[(SocketAddr, Mode)], backend: SocketAddr) -> ! {
    let defer = std::env::var("BENCH_FLOOR_DEFER").is_ok_and(|v| v == "1");
    let ep = epoll::create(CreateFlags::CLOEXEC).expect("floor: epoll_create1");
    let mut listeners = Vec::new();
    for (k, &(addr, mode)) in listens.iter().enumerate() {
        // trellis's own listener set-up (backlog 4096, non-blocking), without its socket
        // options.
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
        if defer {
            set_defer_accept(&listener, 10).expect("floor: TCP_DEFER_ACCEPT");
        }
        epoll::add(
            &ep,
            &listener,
            EventData::new_u64(LISTENER - k as u64),
            EventFlags::IN,
        )
        .expect("floor: epoll_ctl");
        listeners.push((listener, mode));
    }
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
            if token > LISTENER - listeners.len() as u64 {
                let (listener, mode) = &listeners[(LISTENER - token) as usize];
                loop {
                    let fd = match rustix::net::accept_with(
                        listener,
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
                        reply: false,
                        mode: *mode,
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
                if i == 1 && c.reply {
                    // Connected: now the client may start.
                    c.reply = false;
                    c.pending[0].extend_from_slice(CONNECTED);
                    ok = c.flush(0);
                }
                ok = ok && c.flush(i);
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
                                    match c.mode {
                                        Mode::Sni => c.pending[1].extend_from_slice(data),
                                        Mode::ProxyV2 => c.pending[1]
                                            .extend_from_slice(&data[proxy_v2_len(data)..]),
                                        Mode::Connect => c.reply = true,
                                    }
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
