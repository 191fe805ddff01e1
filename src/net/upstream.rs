//! Connecting to a route's backends with failover inside one connect budget.
//!
//! Backends are tried in the order [`Route::backend_order`] gives. Each attempt gets an equal
//! share of what is left of the budget, so a backend that swallows SYNs cannot use up the
//! time the next one needs. A failed backend is put into passive back-off.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use socket2::{Domain, Socket, Type};
use thiserror::Error;
use tokio::net::TcpStream;

use crate::route::{BackendAddress, BackendGuard, Route};

/// Shortest time given to one connect attempt, even when the budget is nearly used up.
pub const MIN_ATTEMPT: Duration = Duration::from_millis(100);
/// Most resolved addresses tried per DNS backend.
pub const MAX_ADDRS_PER_BACKEND: usize = 4;

/// Why no backend connection could be made.
#[derive(Debug, Error)]
pub enum ConnectError {
    /// The route has no backends.
    #[error("route {route:?} has no backends")]
    NoBackends {
        /// Route name.
        route: String,
    },
    /// Every attempt failed; the last failure is kept.
    #[error("all backends of route {route:?} failed, last {backend}: {reason}")]
    Failed {
        /// Route name.
        route: String,
        /// The backend tried last.
        backend: String,
        /// Reason of the last failure (a metric reason string).
        reason: &'static str,
        /// Whether the budget ran out (the last failure was a timeout).
        timed_out: bool,
    },
}

impl ConnectError {
    /// Stable short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ConnectError::NoBackends { .. } => "no_backends",
            ConnectError::Failed {
                timed_out: true, ..
            } => "connect_timeout",
            ConnectError::Failed { .. } => "connect_failed",
        }
    }
}

/// A connected backend.
#[derive(Debug)]
pub struct Connected {
    /// The connection.
    pub stream: TcpStream,
    /// The backend as written in the table.
    pub backend: String,
    /// The address actually connected to.
    pub addr: SocketAddr,
    /// Keeps the backend's active count while the connection lives.
    pub guard: BackendGuard,
    /// Time spent connecting, failover included.
    pub elapsed: Duration,
}

/// The metric reason for a failed connect.
pub fn failure_reason(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => "refused",
        io::ErrorKind::TimedOut => "timeout",
        io::ErrorKind::HostUnreachable | io::ErrorKind::NetworkUnreachable => "unreachable",
        io::ErrorKind::ConnectionReset => "reset",
        _ => "error",
    }
}

/// Connects to one of `route`'s backends within `budget`; `on_failure(reason)` is called for
/// every failed attempt (for metrics).
pub async fn connect(
    route: &Route,
    zone: Option<&str>,
    budget: Duration,
    mut on_failure: impl FnMut(&'static str),
) -> Result<Connected, ConnectError> {
    let start = Instant::now();
    let deadline = start + budget;
    let order = route.backend_order(zone);
    if order.is_empty() {
        return Err(ConnectError::NoBackends {
            route: route.name().to_owned(),
        });
    }
    let mut last = ("", String::new());
    for (i, backend) in order.iter().enumerate() {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            break;
        }
        let share = (remaining / (order.len() - i) as u32)
            .max(MIN_ATTEMPT)
            .min(remaining);
        let attempt_deadline = Instant::now() + share;
        let name = backend.address.to_string();
        let result = attempt(&backend.address, attempt_deadline).await;
        match result {
            Ok((stream, addr)) => {
                backend.state.record_success();
                return Ok(Connected {
                    stream,
                    backend: name,
                    addr,
                    guard: backend.state.track(),
                    elapsed: start.elapsed(),
                });
            }
            Err(reason) => {
                tracing::debug!(route = %route.name(), backend = %name, reason, "backend connect failed");
                backend.state.record_failure();
                on_failure(reason);
                last = (reason, name);
            }
        }
    }
    Err(ConnectError::Failed {
        route: route.name().to_owned(),
        timed_out: last.0 == "timeout" || Instant::now() >= deadline,
        reason: if last.0.is_empty() { "timeout" } else { last.0 },
        backend: last.1,
    })
}

async fn attempt(
    address: &BackendAddress,
    deadline: Instant,
) -> Result<(TcpStream, SocketAddr), &'static str> {
    let deadline = tokio::time::Instant::from_std(deadline);
    let addrs: Vec<SocketAddr> = match address {
        BackendAddress::Ip(a) => vec![*a],
        BackendAddress::Dns { host, port } => {
            match tokio::time::timeout_at(deadline, tokio::net::lookup_host((host.as_str(), *port)))
                .await
            {
                Ok(Ok(addrs)) => addrs.take(MAX_ADDRS_PER_BACKEND).collect(),
                Ok(Err(_)) => return Err("resolve"),
                Err(_) => return Err("timeout"),
            }
        }
    };
    let mut reason = "resolve";
    for addr in addrs {
        match connect_addr(addr, deadline).await {
            Ok(stream) => return Ok((stream, addr)),
            // The budget is spent: no time for the next address.
            Err(Failure::Deadline) => return Err("timeout"),
            // Refused, unreachable, or the kernel gave up (its own `ETIMEDOUT`): try the next.
            Err(Failure::Io(e)) => reason = failure_reason(&e),
        }
    }
    Err(reason)
}

/// Why one connect attempt failed.
#[derive(Debug)]
enum Failure {
    /// The deadline passed first.
    Deadline,
    /// The kernel's answer.
    Io(io::Error),
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        Failure::Io(e)
    }
}

/// Connects to `addr` by `deadline`. A backend on the same host or node has accepted by the
/// time `connect(2)` returns: that is seen at once (`getpeername` succeeds), without a
/// round through the event loop or a timer; only a connect still in progress waits for the
/// socket to become writable.
async fn connect_addr(
    addr: SocketAddr,
    deadline: tokio::time::Instant,
) -> Result<TcpStream, Failure> {
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking().cloexec(),
        None,
    )?;
    // The backend's TCP urgent data is read inline, as the next byte of the stream, and so
    // forwarded in place (listeners set the same for clients); without it the kernel keeps
    // the byte out of band and the client's stream would silently lose it.
    socket.set_out_of_band_inline(true)?;
    match socket.connect(&addr.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e.into()),
    }
    let stream = TcpStream::from_std(socket.into())?;
    if stream.peer_addr().is_ok() {
        return Ok(stream);
    }
    match tokio::time::timeout_at(deadline, stream.writable()).await {
        Err(_) => Err(Failure::Deadline),
        Ok(ready) => {
            ready?;
            match stream.take_error()? {
                Some(e) => Err(e.into()),
                None => Ok(stream),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A loopback listener with room for one unaccepted connection (`listen(0)`): once it
    /// is queued, Linux drops further SYNs and their connects stay in progress.
    fn one_slot_listener() -> (Socket, SocketAddr) {
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        socket
            .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        socket.listen(0).unwrap();
        let addr = socket.local_addr().unwrap().as_socket().unwrap();
        (socket, addr)
    }

    fn soon(ms: u64) -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_millis(ms)
    }

    #[tokio::test]
    async fn a_local_backend_is_connected_without_waiting() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut stream = connect_addr(addr, soon(2000)).await.unwrap();
        assert_eq!(stream.peer_addr().unwrap(), addr);
        let (mut accepted, _) = listener.accept().await.unwrap();
        stream.write_all(b"hello").await.unwrap();
        let mut got = [0u8; 5];
        accepted.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");
    }

    #[tokio::test]
    async fn a_closed_port_is_refused() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        match connect_addr(port, soon(2000)).await {
            Err(Failure::Io(e)) => assert_eq!(failure_reason(&e), "refused", "{e}"),
            other => panic!("expected refused, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_backend_that_drops_syns_times_out_at_the_deadline() {
        // A full accept queue makes Linux drop further SYNs: the connect stays in progress.
        let (_listener, addr) = one_slot_listener();
        let mut queued = Vec::new();
        let started = Instant::now();
        let e = loop {
            match connect_addr(addr, soon(300)).await {
                Ok(s) => queued.push(s),
                Err(e) => break e,
            }
            assert!(queued.len() < 16, "the accept queue never filled");
        };
        assert!(matches!(e, Failure::Deadline), "{e:?}");
        assert!(started.elapsed() >= Duration::from_millis(300));
    }

    #[tokio::test]
    async fn a_connect_in_progress_completes_once_the_backend_accepts() {
        let (socket, addr) = one_slot_listener();
        let first = connect_addr(addr, soon(2000)).await.unwrap();
        // The queue is full, so this SYN is dropped; make room, and its retransmission
        // (about a second later) is accepted.
        let listener = std::net::TcpListener::from(socket);
        let room = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let queued = listener.accept().unwrap();
            let second = listener.accept().unwrap();
            (listener, queued, second)
        });
        let started = Instant::now();
        let mut stream = connect_addr(addr, soon(5000)).await.unwrap();
        // It waited for the retransmission: the connect really was in progress.
        assert!(started.elapsed() >= Duration::from_millis(500));
        let (_listener, _queued, (mut second, _)) = room.join().unwrap();
        assert_eq!(stream.peer_addr().unwrap(), addr);
        stream.write_all(b"late").await.unwrap();
        let mut got = [0u8; 4];
        std::io::Read::read_exact(&mut second, &mut got).unwrap();
        assert_eq!(&got, b"late");
        drop(first);
    }
}
