//! Admin endpoint: readiness, liveness, Prometheus metrics and (gateway) the active routes.
//!
//! A deliberately small HTTP/1.1 server: `GET` only, one request per connection, request
//! heads capped at [`MAX_REQUEST_BYTES`] and read under [`HEAD_TIMEOUT`]. Idle connections
//! cannot starve the probes: at most [`MAX_PER_PEER`] connections per peer address and
//! [`MAX_CONNECTIONS`] in all are held, and only the costly `/metrics` and `/routes` take one
//! of [`MAX_EXPENSIVE`] permits. It never touches proxied traffic.

pub(crate) mod metrics;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub(crate) use metrics::Metrics;

/// Largest admin request head.
pub(crate) const MAX_REQUEST_BYTES: usize = 8192;
/// Deadline for reading an admin request head.
pub(crate) const HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// Deadline for writing an answer.
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most admin connections held at once; more are closed at accept.
pub(crate) const MAX_CONNECTIONS: usize = 4096;
/// Most admin connections held for one peer address.
pub(crate) const MAX_PER_PEER: usize = 16;
/// Most `/metrics` and `/routes` answers rendered at once.
pub(crate) const MAX_EXPENSIVE: usize = 8;

/// Produces the JSON body of `/routes`.
pub(crate) type RoutesJson = Box<dyn Fn() -> String + Send + Sync>;

/// What the admin endpoint serves.
pub(crate) struct AdminState {
    /// 200 on `/ready` when true, 503 otherwise.
    pub ready: AtomicBool,
    /// The process' metrics.
    pub metrics: Arc<Metrics>,
    /// `/routes`, for roles that have a routing table.
    pub routes: Option<RoutesJson>,
}

impl AdminState {
    /// A state that is not ready yet.
    pub(crate) fn new(metrics: Arc<Metrics>, routes: Option<RoutesJson>) -> Self {
        AdminState {
            ready: AtomicBool::new(false),
            metrics,
            routes,
        }
    }

    /// Sets readiness.
    pub(crate) fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }
}

/// Serves admin requests on `listener` until the task is dropped.
pub(crate) async fn serve(listener: TcpListener, state: Arc<AdminState>) {
    let expensive = Arc::new(tokio::sync::Semaphore::new(MAX_EXPENSIVE));
    let peers: Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>> =
        Arc::default();
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        {
            // Counting only: a poisoned map is still consistent.
            let mut map = peers.lock().unwrap_or_else(|e| e.into_inner());
            let n = map.entry(peer.ip()).or_insert(0);
            if *n >= MAX_PER_PEER || open.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
                continue;
            }
            *n += 1;
            open.fetch_add(1, Ordering::SeqCst);
        }
        let (state, expensive, peers, open) = (
            state.clone(),
            expensive.clone(),
            peers.clone(),
            open.clone(),
        );
        tokio::spawn(async move {
            handle(stream, &state, &expensive).await;
            open.fetch_sub(1, Ordering::SeqCst);
            let mut map = peers.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = map.get_mut(&peer.ip()) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&peer.ip());
                }
            }
        });
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

async fn handle(mut stream: TcpStream, state: &AdminState, expensive: &tokio::sync::Semaphore) {
    let Ok(Some(buf)) = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream)).await else {
        return;
    };
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
    let (status, ctype, body) = match path {
        "/ready" | "/healthz/ready" => {
            if state.ready.load(Ordering::SeqCst) {
                (200, "text/plain", "ready\n".to_string())
            } else {
                (503, "text/plain", "not ready\n".to_string())
            }
        }
        "/live" | "/healthz/live" => (200, "text/plain", "live\n".to_string()),
        "/metrics" | "/stats/prometheus" | "/routes" => {
            let Ok(_permit) = expensive.acquire().await else {
                return;
            };
            match path {
                "/routes" => match &state.routes {
                    Some(f) => (200, "application/json", f()),
                    None => (404, "text/plain", "not found\n".to_string()),
                },
                _ => (
                    200,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    state.metrics.encode(),
                ),
            }
        }
        _ => (404, "text/plain", "not found\n".to_string()),
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

/// Binds the admin address (errors name the address).
pub(crate) async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    crate::net::socket::bind_tcp(addr, 128)
}
