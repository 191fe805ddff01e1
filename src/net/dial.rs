//! Dialing for a routed connection: the [`Dialer`] interface every role forwards through,
//! the direct TCP dialer, and a [`Tunneled`] layer that opens a CONNECT or PROXY v2 tunnel
//! over another dialer's stream (the node daemon towards the seed gateway). A dial goes to
//! one of the route's backends or to an explicit address ([`Dest`]).
//!
//! [`Direct`] tries backends in the order [`Route::backend_order`] gives. Each attempt gets
//! an equal share of what is left of the connect budget, so a backend that swallows SYNs
//! cannot use up the time the next one needs. A failed backend is put into passive
//! back-off. An explicit address is dialed the same way, as the only candidate, with no
//! back-off state. A backend named by DNS is resolved by the process's resolver
//! ([`super::resolve`]) within the attempt's share: a name that never answers fails as
//! `resolve_timeout`, not as a connect timeout. Nothing here knows about listeners or
//! metrics: failures are reported through the target's callback.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use socket2::{Domain, Socket, Type};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::lograte::LogRate;
use super::relay::{Leg, read_leg};
use super::resolve::{ResolveError, Resolver};
use super::socket;
use crate::net::IpFamily;
use crate::route::{BackendAddress, BackendGuard, BackendState, Route};
use crate::wire::{Parsed, http, proxy};

/// Shortest time given to one connect attempt, even when the budget is nearly used up.
pub(crate) const MIN_ATTEMPT: Duration = Duration::from_millis(100);
/// Most resolved addresses tried per DNS backend.
pub(crate) const MAX_ADDRS_PER_BACKEND: usize = 4;
/// Largest CONNECT response head accepted from an upstream proxy.
const MAX_RESPONSE_HEAD: usize = 8192;

/// Why one attempt to reach a backend failed (metric label `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ConnectFailure {
    /// The backend refused the connection.
    Refused,
    /// No answer within the attempt's share of the budget (or the kernel's own timeout).
    Timeout,
    /// No route to the backend's network or host.
    Unreachable,
    /// The connection was reset.
    Reset,
    /// The backend's name did not resolve (to an address of the allowed family).
    Resolve,
    /// The backend's name got no answer from the name servers in time.
    ResolveTimeout,
    /// The resolver was looking up as many names as it may at once.
    ResolveBusy,
    /// An upstream proxy refused the tunnel (non-`200` answer, malformed answer, or closed
    /// before answering).
    Rejected,
    /// The backend, a CONNECT proxy the gateway forwarded a client's CONNECT to, answered
    /// it with a status other than `2xx`: the client's request, not the backend, failed.
    RefusedByBackend,
    /// Any other error.
    Error,
}

impl ConnectFailure {
    /// The metric label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ConnectFailure::Refused => "refused",
            ConnectFailure::Timeout => "timeout",
            ConnectFailure::Unreachable => "unreachable",
            ConnectFailure::Reset => "reset",
            ConnectFailure::Resolve => "resolve",
            ConnectFailure::ResolveTimeout => "resolve_timeout",
            ConnectFailure::ResolveBusy => "resolve_busy",
            ConnectFailure::Rejected => "rejected",
            ConnectFailure::RefusedByBackend => "refused_by_backend",
            ConnectFailure::Error => "error",
        }
    }

    /// The failure a failed name lookup stands for.
    pub(crate) fn of_resolve(e: ResolveError) -> Self {
        match e {
            ResolveError::NotFound => ConnectFailure::Resolve,
            ResolveError::Timeout => ConnectFailure::ResolveTimeout,
            ResolveError::Busy => ConnectFailure::ResolveBusy,
        }
    }

    /// The failure a connect error stands for.
    pub(crate) fn of(e: &io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::ConnectionRefused => ConnectFailure::Refused,
            io::ErrorKind::TimedOut => ConnectFailure::Timeout,
            io::ErrorKind::HostUnreachable | io::ErrorKind::NetworkUnreachable => {
                ConnectFailure::Unreachable
            }
            io::ErrorKind::ConnectionReset => ConnectFailure::Reset,
            _ => ConnectFailure::Error,
        }
    }
}

/// Why no backend stream could be had.
#[derive(Debug, Error)]
pub(crate) enum DialError {
    /// The route has no backends.
    #[error("route {route:?} has no backends")]
    NoBackends {
        /// Route name.
        route: String,
    },
    /// Every attempt failed; the last failure is kept.
    #[error("all backends of route {route:?} failed, last {backend}: {}", reason.as_str())]
    Failed {
        /// Route name.
        route: String,
        /// The backend tried last.
        backend: String,
        /// Reason of the last failure.
        reason: ConnectFailure,
        /// Whether the budget ran out (the last failure was a timeout).
        timed_out: bool,
        /// Why a dial through a tunnel failed (its `trellis_tunnel_dial_failures_total`
        /// reason, which the access log writes as it is); `None` for a direct dial.
        tunnel: Option<&'static str>,
    },
    /// An upstream proxy could not be reached or refused the tunnel.
    #[error("upstream {}: {detail}", reason.as_str())]
    Upstream {
        /// What went wrong.
        reason: ConnectFailure,
        /// The upstream address tried last, if any was.
        backend: Option<String>,
        /// Details for the debug log.
        detail: String,
    },
}

impl DialError {
    /// The access log's `error:<kind>`.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            DialError::NoBackends { .. } => "no_backends",
            DialError::Failed {
                tunnel: Some(reason),
                ..
            } => reason,
            DialError::Failed {
                timed_out: true, ..
            } => "connect_timeout",
            DialError::Failed { .. } => "connect_failed",
            DialError::Upstream { reason, .. } => match reason {
                ConnectFailure::Refused => "upstream_refused",
                ConnectFailure::Timeout => "upstream_timeout",
                ConnectFailure::Unreachable => "upstream_unreachable",
                ConnectFailure::Reset => "upstream_reset",
                ConnectFailure::Resolve => "upstream_resolve",
                ConnectFailure::ResolveTimeout => "upstream_resolve_timeout",
                ConnectFailure::ResolveBusy => "upstream_resolve_busy",
                ConnectFailure::Rejected => "upstream_rejected",
                ConnectFailure::RefusedByBackend => "refused_by_backend",
                ConnectFailure::Error => "upstream_error",
            },
        }
    }

    /// The backend tried last (for the access log), if any was.
    pub(crate) fn backend(&self) -> Option<&str> {
        match self {
            DialError::Failed { backend, .. } => Some(backend).filter(|b| !b.is_empty()),
            DialError::Upstream { backend, .. } => backend.as_ref(),
            DialError::NoBackends { .. } => None,
        }
        .map(String::as_str)
    }

    /// Whether the connect budget ran out (a CONNECT client answers `504`, else `502`).
    pub(crate) fn timed_out(&self) -> bool {
        match self {
            DialError::Failed { timed_out, .. } => *timed_out,
            DialError::Upstream { reason, .. } => *reason == ConnectFailure::Timeout,
            DialError::NoBackends { .. } => false,
        }
    }
}

/// Where a dial goes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Dest<'a> {
    /// One of the route's backends, with failover and passive back-off.
    Backends,
    /// This address, whatever the route's backends are: an IP address, or a name resolved
    /// on every dial (a CONNECT's own target, the node's upstream).
    Address(&'a BackendAddress),
}

/// What a dial is for.
#[derive(Clone, Copy)]
pub(crate) struct Target<'a> {
    /// The route the connection belongs to: its name (logs, errors), its connect budget, and
    /// its backends when `to` is [`Dest::Backends`].
    pub route: &'a Route,
    /// Where to.
    pub to: Dest<'a>,
    /// The client (the PROXY source when one was received).
    pub client: SocketAddr,
    /// The address the client connected to, when the caller looked it up.
    pub local: Option<SocketAddr>,
    /// Called for every failed attempt (for metrics).
    pub on_failure: &'a (dyn Fn(ConnectFailure) + Sync),
}

/// A backend stream, ready for the relay.
#[derive(Debug)]
pub(crate) struct Dialed<S> {
    /// The stream.
    pub stream: S,
    /// The backend for logs: as written in the table, or the address reached.
    pub backend: String,
    /// The address actually connected to.
    pub addr: SocketAddr,
    /// Keeps the backend's active count while the connection lives (held for its drop).
    pub guard: Option<BackendGuard>,
    /// Time spent dialing, failover and tunnel set-up included.
    pub elapsed: Duration,
    /// Bytes the backend sent past a tunnel's handshake, for the client.
    pub early: Vec<u8>,
    /// The WireGuard peer a tunneled stream goes through (`key@endpoint`), for the log.
    pub via: Option<String>,
}

/// Yields a stream to a target's destination.
pub(crate) trait Dialer: Send + Sync {
    /// The stream it yields.
    type Stream: Leg + Send;

    /// Dials `target.to` (one of `target.route`'s backends, or an explicit address).
    fn dial<'a>(
        &'a self,
        target: Target<'a>,
    ) -> impl Future<Output = Result<Dialed<Self::Stream>, DialError>> + Send + 'a;
}

/// Dials backends directly over kernel TCP, with failover, back-off and zone preference.
#[derive(Debug, Clone)]
pub(crate) struct Direct {
    /// The caller's zone: backends there are preferred.
    pub zone: Option<String>,
    /// Connect budget, failover included, unless the route sets its own.
    pub connect_timeout: Duration,
    /// TCP keepalive `(idle, interval)` set on every backend socket.
    pub keepalive: (Duration, Duration),
    /// Which resolved addresses to use.
    pub family: IpFamily,
    /// Resolves backends named by DNS (the process's one resolver).
    pub resolver: Arc<Resolver>,
}

impl Dialer for Direct {
    type Stream = TcpStream;

    async fn dial(&self, target: Target<'_>) -> Result<Dialed<TcpStream>, DialError> {
        let route = target.route;
        let budget = route.timeouts.connect.unwrap_or(self.connect_timeout);
        let start = Instant::now();
        let deadline = start + budget;
        match target.to {
            Dest::Backends => {
                let order = route.backend_order(self.zone.as_deref(), std::time::Instant::now());
                if order.is_empty() {
                    return Err(DialError::NoBackends {
                        route: route.name().to_owned(),
                    });
                }
                let candidates = order.iter().map(|b| (&b.address, Some(&b.state)));
                self.in_turn(target, candidates, start, deadline).await
            }
            Dest::Address(address) => {
                let candidates = std::iter::once((address, None));
                self.in_turn(target, candidates, start, deadline).await
            }
        }
    }
}

impl Direct {
    /// Tries `candidates` in turn until one connects, each with an equal share of what is
    /// left of the budget; a candidate with back-off state has its success or failure
    /// recorded there and is tracked while connected.
    async fn in_turn<'b>(
        &self,
        target: Target<'_>,
        candidates: impl ExactSizeIterator<Item = (&'b BackendAddress, Option<&'b Arc<BackendState>>)>,
        start: Instant,
        deadline: Instant,
    ) -> Result<Dialed<TcpStream>, DialError> {
        let route = target.route;
        let count = candidates.len();
        let mut last = (None, String::new());
        for (i, (address, state)) in candidates.enumerate() {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            let share = (remaining / (count - i) as u32)
                .max(MIN_ATTEMPT)
                .min(remaining);
            let name = address.to_string();
            match attempt(&self.resolver, address, self.family, Instant::now() + share).await {
                Ok((stream, addr)) => {
                    let guard = state.map(|state| {
                        state.record_success();
                        state.track()
                    });
                    let (idle, interval) = self.keepalive;
                    socket::tune(&stream, idle, interval);
                    return Ok(Dialed {
                        stream,
                        backend: name,
                        addr,
                        guard,
                        elapsed: start.elapsed(),
                        early: Vec::new(),
                        via: None,
                    });
                }
                Err(reason) => {
                    log_failure(route.name(), &name, reason, "tcp connect");
                    // The resolver being full says nothing about this backend: no back-off.
                    if let Some(state) = state
                        && reason != ConnectFailure::ResolveBusy
                    {
                        state.record_failure(std::time::Instant::now());
                    }
                    (target.on_failure)(reason);
                    last = (Some(reason), name);
                }
            }
        }
        let reason = last.0.unwrap_or(ConnectFailure::Timeout);
        Err(DialError::Failed {
            route: route.name().to_owned(),
            timed_out: reason == ConnectFailure::Timeout || Instant::now() >= deadline,
            reason,
            backend: last.1,
            tunnel: None,
        })
    }
}

/// Connect-failure lines per backend: one per 10 s, with the count held back in between.
static FAILURE_LOG: LazyLock<LogRate> =
    LazyLock::new(|| LogRate::new(Duration::from_secs(10), 1024));

/// Logs a failed attempt on `backend` at warning level, rate limited per backend (the
/// lines held back are counted in the next; at debug level every one is logged).
fn log_failure(route: &str, backend: &str, reason: ConnectFailure, detail: &str) {
    let reason = reason.as_str();
    match FAILURE_LOG.check(backend, std::time::Instant::now()) {
        Some(suppressed) => {
            tracing::warn!(route, backend, reason, detail, suppressed, "connect failed")
        }
        None => tracing::debug!(route, backend, reason, detail, "connect failed"),
    }
}

/// One attempt on `address` by `deadline`: resolves a name (the resolver's timeout or the
/// deadline, whichever comes first), then connects to the addresses of `family` in turn.
async fn attempt(
    resolver: &Resolver,
    address: &BackendAddress,
    family: IpFamily,
    deadline: Instant,
) -> Result<(TcpStream, SocketAddr), ConnectFailure> {
    let addrs: Vec<SocketAddr> = match address {
        // A literal of the other family is as unusable as a name without such an address.
        BackendAddress::Ip(a) if !family.allows(a) => Vec::new(),
        BackendAddress::Ip(a) => vec![*a],
        BackendAddress::Dns { host, port } => match resolver.resolve(host, deadline).await {
            Ok(ips) => ips
                .iter()
                .map(|ip| SocketAddr::new(*ip, *port))
                .filter(|a| family.allows(a))
                .take(MAX_ADDRS_PER_BACKEND)
                .collect(),
            Err(e) => return Err(ConnectFailure::of_resolve(e)),
        },
    };
    connect_any(addrs, deadline).await
}

/// Connects to the first of `addrs` that answers by `deadline`; `Resolve` if there are none.
async fn connect_any(
    addrs: Vec<SocketAddr>,
    deadline: Instant,
) -> Result<(TcpStream, SocketAddr), ConnectFailure> {
    let mut reason = ConnectFailure::Resolve;
    let count = addrs.len();
    for (i, addr) in addrs.into_iter().enumerate() {
        // Each address gets an equal share of what is left, as backends do: an address that
        // swallows SYNs (one family black-holed) leaves time for the next.
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(ConnectFailure::Timeout);
        }
        let share = (remaining / (count - i) as u32)
            .max(MIN_ATTEMPT)
            .min(remaining);
        match connect_addr(addr, Instant::now() + share).await {
            Ok(stream) => return Ok((stream, addr)),
            // Its share is spent; the next address gets the rest.
            Err(Failure::Deadline) => reason = ConnectFailure::Timeout,
            // Refused, unreachable, or the kernel gave up (its own `ETIMEDOUT`): try the next.
            Err(Failure::Io(e)) => reason = ConnectFailure::of(&e),
        }
    }
    Err(reason)
}

/// What a [`Tunneled`] dialer sends first on the stream its inner dialer yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Hello {
    /// `CONNECT authority HTTP/1.1` with a destination header; the tunnel is up on `200`.
    Connect {
        /// The request target and `Host` (`host:port`).
        authority: String,
        /// Destination header name.
        header: String,
        /// Destination header value.
        destination: String,
    },
    /// A PROXY v2 header with the client as source and the address it dialled as
    /// destination (GEP-08).
    ProxyV2,
}

/// Opens a tunnel through an upstream proxy over the streams another dialer yields. Every
/// failure, the inner dialer's included, is a [`DialError::Upstream`].
#[derive(Debug, Clone)]
pub(crate) struct Tunneled<D> {
    /// Reaches the upstream proxy.
    pub inner: D,
    /// What to send first.
    pub hello: Hello,
    /// Deadline for the proxy's answer.
    pub handshake_timeout: Duration,
}

impl<D: Dialer> Dialer for Tunneled<D>
where
    D::Stream: AsyncRead + AsyncWrite + Unpin + Send,
{
    type Stream = D::Stream;

    async fn dial(&self, target: Target<'_>) -> Result<Dialed<D::Stream>, DialError> {
        {
            let start = Instant::now();
            let mut up = self.inner.dial(target).await.map_err(|e| match e {
                DialError::Failed {
                    reason,
                    ref backend,
                    ..
                } => DialError::Upstream {
                    reason,
                    backend: Some(backend.clone()).filter(|b| !b.is_empty()),
                    detail: e.to_string(),
                },
                DialError::NoBackends { .. } => DialError::Upstream {
                    reason: ConnectFailure::Resolve,
                    backend: None,
                    detail: e.to_string(),
                },
                e @ DialError::Upstream { .. } => e,
            })?;
            let handshake = async {
                match &self.hello {
                    Hello::Connect {
                        authority,
                        header,
                        destination,
                    } => connect_tunnel(&mut up.stream, authority, header, destination).await,
                    Hello::ProxyV2 => {
                        let local = target.local.ok_or((
                            ConnectFailure::Error,
                            "the client's destination is unknown".to_string(),
                        ))?;
                        let header = proxy::encode_v2(target.client, local);
                        up.stream.write_all(&header).await.map_err(|e| {
                            (
                                ConnectFailure::Error,
                                format!("sending the PROXY header: {e}"),
                            )
                        })?;
                        Ok(Vec::new())
                    }
                }
            };
            let early = match tokio::time::timeout(self.handshake_timeout, handshake).await {
                Ok(Ok(early)) => early,
                Ok(Err((reason, detail))) => {
                    let upstream = up.addr.to_string();
                    log_failure(target.route.name(), &upstream, reason, &detail);
                    (target.on_failure)(reason);
                    return Err(DialError::Upstream {
                        reason,
                        backend: Some(upstream),
                        detail,
                    });
                }
                Err(_) => {
                    let upstream = up.addr.to_string();
                    let reason = ConnectFailure::Timeout;
                    log_failure(
                        target.route.name(),
                        &upstream,
                        reason,
                        "no tunnel answer in time",
                    );
                    (target.on_failure)(ConnectFailure::Timeout);
                    return Err(DialError::Upstream {
                        backend: Some(upstream),
                        reason: ConnectFailure::Timeout,
                        detail: "no CONNECT answer in time".into(),
                    });
                }
            };
            Ok(Dialed {
                backend: up.addr.to_string(),
                early,
                elapsed: start.elapsed(),
                ..up
            })
        }
    }
}

/// Sends a CONNECT request and waits for `200`; returns the bytes read past the response
/// head (the tunnel's first bytes).
pub(crate) async fn connect_tunnel<S: Leg>(
    up: &mut S,
    authority: &str,
    header: &str,
    destination: &str,
) -> Result<Vec<u8>, (ConnectFailure, String)> {
    let request = format!(
        "CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{header}: {destination}\r\n\r\n"
    );
    up.write_all(request.as_bytes())
        .await
        .map_err(|e| (ConnectFailure::Error, e.to_string()))?;
    let mut buf = Vec::with_capacity(1024);
    loop {
        // Read as the relay reads: it then finds urgent data that came with the answer.
        let n = read_leg(up, &mut buf, 1024)
            .await
            .map_err(|e| (ConnectFailure::Reset, e.to_string()))?;
        if n == 0 {
            return Err((ConnectFailure::Rejected, "closed before answering".into()));
        }
        match http::parse_response_status(&buf, MAX_RESPONSE_HEAD) {
            Ok(Parsed::Incomplete) => continue,
            Ok(Parsed::Complete {
                value: 200,
                consumed,
            }) => return Ok(buf.split_off(consumed)),
            Ok(Parsed::Complete { value, .. }) => {
                return Err((ConnectFailure::Rejected, format!("answered {value}")));
            }
            Err(e) => return Err((ConnectFailure::Rejected, e.to_string())),
        }
    }
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
    // And every read reports what it left unread, which the relay needs to tell a drained
    // socket from a read that stopped at urgent data (kernels before 4.18 lack it).
    let _ = super::relay::report_unread(std::os::fd::AsFd::as_fd(&socket));
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
        let sock = std::os::fd::AsFd::as_fd(&stream);
        assert!(super::super::relay::reports_unread(sock), "TCP_INQ set");
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
            Err(Failure::Io(e)) => {
                assert_eq!(ConnectFailure::of(&e), ConnectFailure::Refused, "{e}")
            }
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

    /// A name whose first address swallows SYNs still reaches its second address within
    /// the budget, and a literal of the wrong family is not dialled.
    #[tokio::test]
    async fn every_address_of_a_backend_gets_a_share_of_the_budget() {
        let (_full, black_hole) = one_slot_listener();
        // Fill the one slot: from now on SYNs to `black_hole` are dropped.
        let _queued = connect_addr(black_hole, soon(2000)).await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let good = listener.local_addr().unwrap();
        let started = Instant::now();
        let (_, got) = connect_any(vec![black_hole, good], soon(1000))
            .await
            .expect("the second address within the budget");
        assert_eq!(got, good);
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(450) && took < Duration::from_millis(1000),
            "half the budget on the first address: {took:?}"
        );
        let v4 = BackendAddress::Ip(black_hole);
        assert_eq!(
            attempt(&Resolver::for_tests(), &v4, IpFamily::V6, soon(1000))
                .await
                .err(),
            Some(ConnectFailure::Resolve)
        );
    }

    /// A route named `name` whose one backend is `backend`.
    fn route_to(name: &str, backend: Option<SocketAddr>) -> Route {
        let registry = crate::route::BackendRegistry::default();
        let backends = backend
            .map(|a| {
                let address = BackendAddress::Ip(a);
                crate::route::Backend {
                    state: registry.state(&address),
                    address,
                    zone: None,
                }
            })
            .into_iter()
            .collect();
        Route::new::<&str, &str>(name, &[], &[], Vec::new(), backends).unwrap()
    }

    fn direct() -> Direct {
        Direct {
            zone: None,
            connect_timeout: Duration::from_secs(2),
            keepalive: (Duration::from_secs(60), Duration::from_secs(10)),
            family: IpFamily::Any,
            resolver: Resolver::for_tests(),
        }
    }

    /// An explicit address is dialed whatever the route's backends are (a route with none
    /// reaches it; one whose backend is elsewhere does not go there), a name is resolved on
    /// the dial, and a refused address fails as a backend does: its reason, the callback,
    /// the address named.
    #[tokio::test]
    async fn an_explicit_address_is_dialed_instead_of_the_backends() {
        let there = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let elsewhere = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (there_addr, elsewhere_addr) =
            (there.local_addr().unwrap(), elsewhere.local_addr().unwrap());
        let with_backend = route_to("with-backend", Some(elsewhere_addr));
        let without = route_to("without", None);
        let failures = std::sync::Mutex::new(Vec::new());
        let on_failure = |r: ConnectFailure| failures.lock().unwrap().push(r);
        let target = |route, to| Target {
            route,
            to,
            client: "127.0.0.1:1".parse().unwrap(),
            local: None,
            on_failure: &on_failure,
        };
        let dialer = direct();

        let address = BackendAddress::Ip(there_addr);
        for route in [&with_backend, &without] {
            let dialed = dialer
                .dial(target(route, Dest::Address(&address)))
                .await
                .unwrap();
            assert_eq!(dialed.addr, there_addr, "{}", route.name());
            assert_eq!(dialed.backend, there_addr.to_string());
            assert!(dialed.guard.is_none(), "no back-off state to track");
            there.accept().await.unwrap();
        }
        let dialed = dialer
            .dial(target(&with_backend, Dest::Backends))
            .await
            .unwrap();
        assert_eq!(dialed.addr, elsewhere_addr);
        let named = BackendAddress::Dns {
            host: "localhost".into(),
            port: there_addr.port(),
        };
        let dialed = dialer
            .dial(target(&without, Dest::Address(&named)))
            .await
            .unwrap();
        assert_eq!(dialed.addr, there_addr);
        assert_eq!(dialed.backend, format!("localhost:{}", there_addr.port()));
        failures.lock().unwrap().clear();

        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let refused = BackendAddress::Ip(closed);
        match dialer
            .dial(target(&with_backend, Dest::Address(&refused)))
            .await
        {
            Err(e @ DialError::Failed { .. }) => {
                assert_eq!(e.kind(), "connect_failed");
                assert_eq!(e.backend(), Some(closed.to_string().as_str()));
                assert!(!e.timed_out());
            }
            other => panic!("expected a refused connect, got {other:?}"),
        }
        assert_eq!(*failures.lock().unwrap(), [ConnectFailure::Refused]);
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
