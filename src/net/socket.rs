//! Socket setup with socket2: listeners with SO_REUSEADDR and a deep backlog, TCP keepalive
//! and `TCP_NODELAY` on proxied connections.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::time::Duration;

use socket2::{Domain, SockRef, Socket, TcpKeepalive, Type};
use tokio::net::{TcpListener, TcpStream};

/// Default listen backlog for proxy listeners (the kernel caps it at `somaxconn`).
pub const LISTEN_BACKLOG: i32 = 4096;

/// Binds a TCP listener. Must run inside a tokio runtime.
pub fn bind_tcp(addr: SocketAddr, backlog: i32) -> io::Result<TcpListener> {
    TcpListener::from_std(bind_std(addr, backlog, false)?)
}

/// Binds a non-blocking std listener; with `reuse_port` several sockets (one per worker
/// thread) share the address and the kernel spreads connections across them.
pub fn bind_std(
    addr: SocketAddr,
    backlog: i32,
    reuse_port: bool,
) -> io::Result<std::net::TcpListener> {
    bind_std_with(addr, backlog, reuse_port, None)
}

/// Like [`bind_std`], with `TCP_NODELAY` and keepalive `(idle, interval)` set on the
/// listening socket: Linux copies them to every accepted socket, which saves the syscalls
/// per connection.
pub fn bind_std_with(
    addr: SocketAddr,
    backlog: i32,
    reuse_port: bool,
    keepalive: Option<(Duration, Duration)>,
) -> io::Result<std::net::TcpListener> {
    bind_listener(
        addr,
        &ListenOptions {
            backlog,
            reuse_port,
            freebind: false,
            keepalive,
        },
    )
}

/// How a listening socket is set up.
#[derive(Debug, Clone, Copy)]
pub struct ListenOptions {
    /// Listen backlog (the kernel caps it at `somaxconn`).
    pub backlog: i32,
    /// `SO_REUSEPORT`: several sockets (one per worker thread) share the address and the
    /// kernel spreads connections across them.
    pub reuse_port: bool,
    /// `IP_FREEBIND`: the address may appear on a link only later (the node's advertise
    /// address).
    pub freebind: bool,
    /// `TCP_NODELAY` and keepalive `(idle, interval)`, inherited by accepted sockets.
    pub keepalive: Option<(Duration, Duration)>,
}

/// Binds a non-blocking std listener with `SO_REUSEADDR`, urgent data inline, and `options`.
pub fn bind_listener(
    addr: SocketAddr,
    options: &ListenOptions,
) -> io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    if options.reuse_port {
        socket.set_reuse_port(true)?;
    }
    if options.freebind {
        if addr.is_ipv4() {
            socket.set_freebind_v4(true)?;
        } else {
            socket.set_freebind_v6(true)?;
        }
    }
    // TCP urgent data is read inline, as the next byte of the stream (inherited by accepted
    // sockets): a proxy forwards it in place instead of dropping it.
    socket.set_out_of_band_inline(true)?;
    // Every read reports what it left unread (inherited): the relay tells a drained socket
    // from a read that stopped at urgent data. Kernels before 4.18 lack it; reads then
    // work the slower way.
    let _ = crate::net::relay::report_unread(socket.as_fd());
    if let Some((idle, interval)) = options.keepalive {
        socket.set_tcp_nodelay(true)?;
        let ka = TcpKeepalive::new().with_time(idle).with_interval(interval);
        socket.set_tcp_keepalive(&ka)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(options.backlog)?;
    Ok(socket.into())
}

/// Binds `addr` without `SO_REUSEPORT` and without listening, to find out whether another
/// process already listens there: `SO_REUSEPORT` listeners of the same user would otherwise
/// share the address with it silently. Any listening socket on the port, of any process and
/// either family (a dual-stack `[::]` listener covers `0.0.0.0`, a wildcard covers every
/// address), makes the bind fail with `EADDRINUSE`; connections in `TIME_WAIT` and sockets
/// bound but not listening do not (`SO_REUSEADDR`). Keep the returned socket until the real
/// listeners are bound (they may join it: it does not listen) and bind them on its port,
/// which for port 0 is the one the kernel chose.
pub fn claim(addr: SocketAddr) -> io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    Ok(socket)
}

/// The port `claim` bound (the kernel's choice for port 0).
pub fn claimed_addr(addr: SocketAddr, claim: &Socket) -> SocketAddr {
    claim
        .local_addr()
        .ok()
        .and_then(|a| a.as_socket())
        .map_or(addr, |a| SocketAddr::new(addr.ip(), a.port()))
}

/// Maps IPv4-mapped IPv6 addresses to IPv4.
pub fn normalize(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(std::net::IpAddr::V4(v4), v6.port()),
            None => addr,
        },
        v4 => v4,
    }
}

/// Applies `TCP_NODELAY` and keepalive (`idle` before the first probe, then every
/// `interval`) to a proxied connection. Failures are logged, not fatal: the connection still
/// works without them.
pub fn tune(stream: &TcpStream, idle: Duration, interval: Duration) {
    let sock = SockRef::from(stream);
    // The probe count stays at the kernel default: one syscall less per connection.
    let keepalive = TcpKeepalive::new().with_time(idle).with_interval(interval);
    if let Err(e) = sock
        .set_tcp_nodelay(true)
        .and_then(|_| sock.set_tcp_keepalive(&keepalive))
    {
        tracing::debug!(error = %e, "could not set socket options");
    }
}

/// Raises the soft open-files limit to the hard limit, as a proxy needs two descriptors per
/// connection (see [`super::fds`]). Returns the new soft limit.
pub fn raise_nofile_limit() -> io::Result<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        limit.current = limit.maximum;
        setrlimit(Resource::Nofile, limit).map_err(io::Error::from)?;
    }
    Ok(limit.current.unwrap_or(u64::MAX))
}

/// Socket buffer size asked for on tunnel (UDP) sockets: a burst of full-size datagrams
/// must not overflow them while the task that reads them is busy (the kernel caps it at
/// `net.core.rmem_max`/`wmem_max`).
pub(crate) const UDP_BUFFER: usize = 4 << 20;

/// A non-blocking UDP socket bound to `addr` (no `SO_REUSEPORT`: an address another process
/// holds fails with `EADDRINUSE`), with large buffers; IPv6 wildcards accept IPv4 too.
pub(crate) fn bind_udp(addr: SocketAddr) -> io::Result<std::net::UdpSocket> {
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, None)?;
    if addr.is_ipv6() {
        socket.set_only_v6(false)?;
    }
    // Best effort: the kernel's caps apply.
    let _ = socket.set_recv_buffer_size(UDP_BUFFER);
    let _ = socket.set_send_buffer_size(UDP_BUFFER);
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_v6_is_normalized() {
        let a: SocketAddr = "[::ffff:10.1.2.3]:5".parse().unwrap();
        assert_eq!(normalize(a), "10.1.2.3:5".parse::<SocketAddr>().unwrap());
        let v6: SocketAddr = "[2001:db8::1]:5".parse().unwrap();
        assert_eq!(normalize(v6), v6);
    }

    #[test]
    fn accepted_sockets_inherit_nodelay_and_keepalive() {
        let idle = Duration::from_secs(55);
        let l = bind_std_with(
            "127.0.0.1:0".parse().unwrap(),
            16,
            false,
            Some((idle, Duration::from_secs(17))),
        )
        .unwrap();
        let addr = l.local_addr().unwrap();
        let _c = std::net::TcpStream::connect(addr).unwrap();
        l.set_nonblocking(false).unwrap();
        let (s, _) = l.accept().unwrap();
        let s = SockRef::from(&s);
        assert!(s.tcp_nodelay().unwrap(), "TCP_NODELAY inherited");
        assert!(s.keepalive().unwrap(), "SO_KEEPALIVE inherited");
        assert_eq!(s.tcp_keepalive_time().unwrap(), idle);
        assert_eq!(s.tcp_keepalive_interval().unwrap(), Duration::from_secs(17));
        assert!(s.out_of_band_inline().unwrap(), "SO_OOBINLINE inherited");
        assert!(
            crate::net::relay::reports_unread(s.as_fd()),
            "TCP_INQ inherited"
        );
    }
    /// A listener with `SO_REUSEPORT` (another instance) makes the claim fail, for the same
    /// address, a specific address under its wildcard, and the dual-stack wildcard; a claim
    /// held does not keep the real listeners off its port.
    #[test]
    fn a_claim_fails_where_another_socket_listens() {
        let other = bind_std("0.0.0.0:0".parse().unwrap(), 16, true).unwrap();
        let port = other.local_addr().unwrap().port();
        for addr in ["0.0.0.0", "127.0.0.1", "[::]"] {
            let addr: SocketAddr = format!("{addr}:{port}").parse().unwrap();
            let e = claim(addr)
                .err()
                .unwrap_or_else(|| panic!("{addr} claimed"));
            assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{addr}");
        }
        // Port 0: the claim picks the port, and workers' listeners share it while it is held.
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let held = claim(any).unwrap();
        let addr = claimed_addr(any, &held);
        assert_ne!(addr.port(), 0);
        let a = bind_std(addr, 16, true).unwrap();
        let b = bind_std(addr, 16, true).unwrap();
        drop(held);
        assert_eq!(a.local_addr().unwrap(), b.local_addr().unwrap());
        // Once they listen, a second claim on that port fails.
        assert_eq!(
            claim(addr).err().map(|e| e.kind()),
            Some(io::ErrorKind::AddrInUse)
        );
    }
}
