//! Admin endpoints: readiness, liveness and Prometheus metrics on `admin.address`, and
//! (gateway) the active routing table on the debug address, which defaults to loopback.
//!
//! Probes are answered whatever else the process is doing:
//! - the server runs on a thread and event loop of its own ([`Server`]), so neither the
//!   data plane nor the control plane (a big table reload) delays an answer; `/metrics` and
//!   `/routes` are rendered on its blocking threads, at most [`MAX_EXPENSIVE`] at once;
//! - every new connection is admitted: when [`MAX_HELD`] are held, the one held longest by
//!   the peer holding the most is closed ([`held`]), so idle connections, from one address
//!   or from many, never keep a fresh probe out;
//! - it keeps [`SPARE_DESCRIPTORS`] descriptors open (`/dev/null`): when the process is out
//!   of descriptors, accept closes one and takes the connection in its place, and the spare
//!   is taken back when the connection ends.
//!
//! A deliberately small HTTP/1.1 server: `GET` and `HEAD` only, one request per connection,
//! request heads capped at [`MAX_REQUEST_BYTES`] and read under [`HEAD_TIMEOUT`]. It never
//! touches proxied traffic.

mod held;
pub(crate) mod metrics;
mod process;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, oneshot};

use crate::net::fds::{ADMIN_RESERVE, FailureLog, is_resource_error};
use held::Held;
pub(crate) use metrics::Metrics;

/// Largest admin request head.
pub(crate) const MAX_REQUEST_BYTES: usize = 8192;
/// Deadline for reading an admin request head.
pub(crate) const HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// Deadline for writing an answer.
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections the admin listener holds; a new one closes the oldest of the peer
/// holding the most.
pub(crate) const MAX_HELD: usize = 64;
/// Most connections the debug listener holds.
pub(crate) const DEBUG_MAX_HELD: usize = 8;
/// Descriptors kept open to take probes in when the process has no other left.
pub(crate) const SPARE_DESCRIPTORS: usize = 4;
/// Most `/metrics` and `/routes` answers rendered at once.
pub(crate) const MAX_EXPENSIVE: usize = 4;
/// Threads that render `/metrics` and `/routes`.
const RENDER_THREADS: usize = 2;
/// Pause before accepting again when no descriptor could be freed.
const RETRY: Duration = Duration::from_millis(10);
/// Listen backlog of the admin sockets.
const BACKLOG: i32 = 1024;

// Everything the admin server may hold fits in the reserve the descriptor budget sets
// aside for it: its connections, spares, two listeners, its event loop's own descriptors
// (epoll, a waker) and one `/proc` file per render thread.
const _: () = assert!(
    (MAX_HELD + DEBUG_MAX_HELD + SPARE_DESCRIPTORS + 2 + 2 + RENDER_THREADS) as u64
        <= ADMIN_RESERVE
);

/// Produces the JSON body of `/routes`.
pub(crate) type RoutesJson = Box<dyn Fn() -> String + Send + Sync>;

/// What the admin endpoint serves.
pub(crate) struct AdminState {
    /// 200 on `/ready` when true, 503 otherwise.
    pub ready: AtomicBool,
    /// The process' metrics.
    pub metrics: Arc<Metrics>,
}

impl AdminState {
    /// A state that is not ready yet.
    pub(crate) fn new(metrics: Arc<Metrics>) -> Self {
        AdminState {
            ready: AtomicBool::new(false),
            metrics,
        }
    }

    /// Sets readiness, and the `trellis_ready` gauge with it.
    pub(crate) fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
        self.metrics.ready.set(i64::from(ready));
    }
}

/// What one listener serves.
enum Endpoint {
    /// Probes and metrics.
    Admin(Arc<AdminState>),
    /// `/routes`.
    Debug(RoutesJson),
}

/// Binds an admin or debug address (errors name the address).
pub(crate) fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    crate::net::socket::bind_std(addr, BACKLOG, false)
}

/// The admin server's thread; dropping it stops the server.
pub(crate) struct Server {
    _stop: oneshot::Sender<()>,
}

impl Server {
    /// Serves probes and metrics on `admin`, and `/routes` on `debug` when given, on a
    /// thread and event loop of their own.
    pub(crate) fn start(
        admin: std::net::TcpListener,
        debug: Option<(std::net::TcpListener, RoutesJson)>,
        state: Arc<AdminState>,
    ) -> std::io::Result<Server> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .max_blocking_threads(RENDER_THREADS)
            .thread_name("trellis-admin-render")
            .build()?;
        let (admin, debug) = {
            let _context = runtime.enter();
            let admin = TcpListener::from_std(admin)?;
            let debug = match debug {
                Some((l, routes)) => Some((TcpListener::from_std(l)?, routes)),
                None => None,
            };
            (admin, debug)
        };
        let address = |l: &TcpListener| {
            l.local_addr()
                .map_or_else(|e| e.to_string(), |a| a.to_string())
        };
        tracing::info!(address = address(&admin), "admin endpoint listening");
        if let Some((l, _)) = &debug {
            tracing::info!(address = address(l), "debug endpoint listening");
        }
        let spares = Arc::new(Mutex::new(Spares::new(SPARE_DESCRIPTORS)));
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("trellis-admin".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let endpoint = Arc::new(Endpoint::Admin(state));
                    tokio::spawn(serve(admin, endpoint, MAX_HELD, Some(spares)));
                    if let Some((l, routes)) = debug {
                        let endpoint = Arc::new(Endpoint::Debug(routes));
                        tokio::spawn(serve(l, endpoint, DEBUG_MAX_HELD, None));
                    }
                    // The sender is dropped with the `Server`.
                    let _ = stopped.await;
                });
                // Dropping the runtime closes the listeners and held connections.
            })?;
        Ok(Server { _stop: stop })
    }
}

/// Descriptors held open so that a probe can be taken in when the process has none left.
struct Spares {
    files: Vec<std::fs::File>,
    want: usize,
}

impl Spares {
    fn new(want: usize) -> Self {
        let mut s = Spares {
            files: Vec::with_capacity(want),
            want,
        };
        s.refill();
        s
    }

    /// Opens spares up to the number wanted, as far as descriptors allow.
    fn refill(&mut self) {
        while self.files.len() < self.want {
            match std::fs::File::open("/dev/null") {
                Ok(f) => self.files.push(f),
                Err(_) => break,
            }
        }
    }

    /// Closes one spare; false if none is left.
    fn release_one(&mut self) -> bool {
        self.files.pop().is_some()
    }
}

/// Locks `m`. A poisoned lock still guards consistent data: every critical section here is
/// one call that cannot panic halfway.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Out of descriptors, frees one — a spare, else the connection held longest (the peer
/// holding the most, idle first) — and accepts once more without waiting. `None` when no
/// connection was waiting: Linux takes a descriptor before it looks at the queue, so
/// `EMFILE` comes with an empty queue too; the spare is then taken back.
async fn accept_with_room(
    listener: &TcpListener,
    spares: Option<&Mutex<Spares>>,
    held: &Mutex<Held<Handle>>,
) -> Option<std::io::Result<(TcpStream, SocketAddr)>> {
    use futures_util::FutureExt;
    let released = spares.is_some_and(|s| lock(s).release_one());
    if !released {
        // No spare left: evict a held connection only for a connection that is waiting
        // (poll needs no descriptor), never for the `EMFILE` of an empty queue.
        if !connection_waiting(listener) {
            return Some(Err(std::io::Error::from_raw_os_error(libc::EMFILE)));
        }
        let victim = lock(held).evict();
        match victim {
            Some(victim) => {
                victim.task.abort();
                // Let the runtime drop the aborted task, which closes its socket.
                tokio::task::yield_now().await;
            }
            None => return Some(Err(std::io::Error::from_raw_os_error(libc::EMFILE))),
        }
    }
    // The descriptor freed goes to this accept unless another thread opens one first.
    let accepted = tokio::task::unconstrained(listener.accept()).now_or_never();
    if !matches!(accepted, Some(Ok(_)))
        && let Some(s) = spares
    {
        lock(s).refill();
    }
    accepted
}

/// Whether a connection waits in `listener`'s queue (a zero-timeout `poll`, which takes no
/// descriptor). An error says yes: then the accept that follows tells.
fn connection_waiting(listener: &TcpListener) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut fds = [PollFd::new(listener, PollFlags::IN)];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut fds, Some(&zero)) {
        Ok(_) => fds[0].revents().contains(PollFlags::IN),
        Err(_) => true,
    }
}

/// Whether an accept error means the process or the system is out of descriptors, which
/// closing one of ours can cure (not `ENOMEM` or `ENOBUFS`).
fn is_descriptor_error(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// A held connection: its task, aborted when it is evicted, and whether its request has
/// come (then it is being answered, and evicted only when no connection is idle).
struct Handle {
    task: tokio::task::AbortHandle,
    answering: Arc<AtomicBool>,
}

impl held::Waiting for Handle {
    fn waiting(&self) -> bool {
        !self.answering.load(Ordering::Relaxed)
    }
}

/// Accepts on `listener` and serves each connection in a task of its own, holding at most
/// `cap` at once. With `spares`, out of descriptors it closes a spare (or the connection
/// held longest) and accepts in its place.
async fn serve(
    listener: TcpListener,
    endpoint: Arc<Endpoint>,
    cap: usize,
    spares: Option<Arc<Mutex<Spares>>>,
) {
    let held: Arc<Mutex<Held<Handle>>> = Arc::new(Mutex::new(Held::new(cap)));
    let expensive = Arc::new(Semaphore::new(MAX_EXPENSIVE));
    let mut failures = FailureLog::default();
    loop {
        let accepted = match listener.accept().await {
            Err(e) if is_resource_error(&e) && !is_descriptor_error(&e) => {
                // Out of memory or buffers: nothing to free here; wait and try again.
                if let Some(n) = failures.failed(tokio::time::Instant::now()) {
                    tracing::warn!(
                        error = %e,
                        failures = n,
                        "admin accept failed (one line per {} s, with the failures since the \
                         last)",
                        FailureLog::INTERVAL.as_secs()
                    );
                }
                tokio::time::sleep(RETRY).await;
                continue;
            }
            Err(e) if is_descriptor_error(&e) => {
                match accept_with_room(&listener, spares.as_deref(), &held).await {
                    Some(Err(e)) if is_resource_error(&e) => {
                        if let Some(n) = failures.failed(tokio::time::Instant::now()) {
                            tracing::warn!(
                                error = %e,
                                failures = n,
                                "admin accept failed: no descriptor could be freed (one line per \
                                 {} s, with the failures since the last)",
                                FailureLog::INTERVAL.as_secs()
                            );
                        }
                        tokio::time::sleep(RETRY).await;
                        continue;
                    }
                    Some(r) => r,
                    // Nothing was waiting (accept takes a descriptor before it looks).
                    None => continue,
                }
            }
            r => r,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(error = %e, "admin accept failed");
                continue;
            }
        };
        let evicted = lock(&held).admit(peer.ip(), |id| {
            let (endpoint, expensive, held, spares) = (
                endpoint.clone(),
                expensive.clone(),
                held.clone(),
                spares.clone(),
            );
            let answering = Arc::new(AtomicBool::new(false));
            let answered = answering.clone();
            let task = tokio::spawn(async move {
                handle(stream, &endpoint, &expensive, &answered).await;
                lock(&held).remove(id);
                // The connection's descriptor is closed: a spare can take its place.
                if let Some(s) = spares {
                    lock(&s).refill();
                }
            })
            .abort_handle();
            Handle { task, answering }
        });
        if let Some(victim) = evicted {
            victim.task.abort();
        }
        // Let the new connection's task read its request before the next accept can
        // evict it: a burst of accepts would otherwise run without a pause.
        tokio::task::yield_now().await;
    }
}

async fn read_head(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.len() > MAX_REQUEST_BYTES {
            return Some(buf);
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Renders `render` on a blocking thread, at most [`MAX_EXPENSIVE`] at once. The permit
/// goes with the render, not with the request: a request evicted or dropped mid-render
/// frees its permit only when the render ends, so requests that come and go cannot queue
/// renders without bound.
async fn expensive_render(
    expensive: &Arc<Semaphore>,
    endpoint: &Arc<Endpoint>,
    render: fn(&Endpoint) -> String,
) -> Option<String> {
    let permit = expensive.clone().acquire_owned().await.ok()?;
    let endpoint = endpoint.clone();
    tokio::task::spawn_blocking(move || {
        let body = render(&endpoint);
        drop(permit);
        body
    })
    .await
    .ok()
}

fn render_metrics(endpoint: &Endpoint) -> String {
    match endpoint {
        Endpoint::Admin(state) => state.metrics.encode(),
        Endpoint::Debug(_) => String::new(),
    }
}

fn render_routes(endpoint: &Endpoint) -> String {
    match endpoint {
        Endpoint::Debug(routes) => routes(),
        Endpoint::Admin(_) => String::new(),
    }
}

const METRICS_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

async fn handle(
    mut stream: TcpStream,
    endpoint: &Arc<Endpoint>,
    expensive: &Arc<Semaphore>,
    answering: &AtomicBool,
) {
    let Ok(Some(buf)) = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream)).await else {
        return;
    };
    answering.store(true, Ordering::Relaxed);
    if buf.len() > MAX_REQUEST_BYTES {
        let _ = tokio::time::timeout(
            WRITE_TIMEOUT,
            respond(&mut stream, 431, "text/plain", "request head too large\n"),
        )
        .await;
        return;
    }
    let head = String::from_utf8_lossy(&buf);
    let mut parts = head.lines().next().unwrap_or("").split(' ');
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    if method != "GET" && method != "HEAD" {
        let _ = tokio::time::timeout(
            WRITE_TIMEOUT,
            respond(&mut stream, 405, "text/plain", "only GET\n"),
        )
        .await;
        return;
    }
    let not_found = || (404, "text/plain", "not found\n".to_string());
    let (status, ctype, body) = match (&**endpoint, path) {
        (Endpoint::Admin(state), "/ready" | "/healthz/ready") => {
            if state.ready.load(Ordering::SeqCst) {
                (200, "text/plain", "ready\n".to_string())
            } else {
                (503, "text/plain", "not ready\n".to_string())
            }
        }
        (Endpoint::Admin(_), "/live" | "/healthz/live") => {
            (200, "text/plain", "live\n".to_string())
        }
        (Endpoint::Admin(_), "/metrics" | "/stats/prometheus") => {
            let Some(body) = expensive_render(expensive, endpoint, render_metrics).await else {
                return;
            };
            (200, METRICS_TYPE, body)
        }
        (Endpoint::Debug(_), "/routes") => {
            let Some(body) = expensive_render(expensive, endpoint, render_routes).await else {
                return;
            };
            (200, "application/json", body)
        }
        _ => not_found(),
    };
    let body = if method == "HEAD" {
        String::new()
    } else {
        body
    };
    let _ = tokio::time::timeout(WRITE_TIMEOUT, respond(&mut stream, status, ctype, &body)).await;
}

async fn respond(
    stream: &mut TcpStream,
    status: u16,
    ctype: &str,
    body: &str,
) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
