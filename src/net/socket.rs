//! Socket setup with socket2: listeners with SO_REUSEADDR and a deep backlog, TCP keepalive
//! and `TCP_NODELAY` on proxied connections.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use socket2::{Domain, SockRef, Socket, TcpKeepalive, Type};
use tokio::net::{TcpListener, TcpStream};

/// Default listen backlog for proxy listeners (the kernel caps it at `somaxconn`).
pub const LISTEN_BACKLOG: i32 = 4096;
/// Keepalive probes before the kernel declares a peer dead.
pub const KEEPALIVE_RETRIES: u32 = 3;

/// Binds a TCP listener. Must run inside a tokio runtime.
pub fn bind_tcp(addr: SocketAddr, backlog: i32) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(backlog)?;
    TcpListener::from_std(socket.into())
}

/// Applies `TCP_NODELAY` and keepalive (`idle` before the first probe, then every
/// `interval`) to a proxied connection. Failures are logged, not fatal: the connection still
/// works without them.
pub fn tune(stream: &TcpStream, idle: Duration, interval: Duration) {
    let sock = SockRef::from(stream);
    let keepalive = TcpKeepalive::new()
        .with_time(idle)
        .with_interval(interval)
        .with_retries(KEEPALIVE_RETRIES);
    if let Err(e) = sock
        .set_tcp_nodelay(true)
        .and_then(|_| sock.set_tcp_keepalive(&keepalive))
    {
        tracing::debug!(error = %e, "could not set socket options");
    }
}

/// Raises the soft open-files limit to the hard limit, as a proxy needs two descriptors per
/// connection. Returns the new soft limit.
pub fn raise_nofile_limit() -> io::Result<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        limit.current = limit.maximum;
        setrlimit(Resource::Nofile, limit).map_err(io::Error::from)?;
    }
    Ok(limit.current.unwrap_or(u64::MAX))
}
