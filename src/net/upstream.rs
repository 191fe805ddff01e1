//! Connecting to a route's backends with failover inside one connect budget.
//!
//! Backends are tried in the order [`Route::backend_order`] gives. Each attempt gets an equal
//! share of what is left of the budget, so a backend that swallows SYNs cannot use up the
//! time the next one needs. A failed backend is put into passive back-off.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

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
            route: route.name.clone(),
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
                tracing::debug!(route = %route.name, backend = %name, reason, "backend connect failed");
                backend.state.record_failure();
                on_failure(reason);
                last = (reason, name);
            }
        }
    }
    Err(ConnectError::Failed {
        route: route.name.clone(),
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
        match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => return Ok((stream, addr)),
            Ok(Err(e)) => reason = failure_reason(&e),
            Err(_) => return Err("timeout"),
        }
    }
    Err(reason)
}
