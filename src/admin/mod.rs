//! Admin endpoint: readiness, liveness, Prometheus metrics and (gateway) the active routes.
//!
//! A deliberately small HTTP/1.1 server: `GET` only, one request per connection, request
//! heads capped at [`MAX_REQUEST_BYTES`] and read under [`REQUEST_TIMEOUT`], so that a
//! scraper or prober can never hold resources. It never touches proxied traffic.

pub mod metrics;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub use metrics::Metrics;

/// Largest admin request head.
pub const MAX_REQUEST_BYTES: usize = 8192;
/// Deadline for reading an admin request and writing the answer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Most admin requests served at once; more are refused at accept.
pub const MAX_CONCURRENT: usize = 64;

/// Produces the JSON body of `/routes`.
pub type RoutesJson = Box<dyn Fn() -> String + Send + Sync>;

/// What the admin endpoint serves.
pub struct AdminState {
    /// 200 on `/ready` when true, 503 otherwise.
    pub ready: AtomicBool,
    /// The process' metrics.
    pub metrics: Arc<Metrics>,
    /// `/routes`, for roles that have a routing table.
    pub routes: Option<RoutesJson>,
}

impl AdminState {
    /// A state that is not ready yet.
    pub fn new(metrics: Arc<Metrics>, routes: Option<RoutesJson>) -> Self {
        AdminState {
            ready: AtomicBool::new(false),
            metrics,
            routes,
        }
    }

    /// Sets readiness.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }
}

/// Serves admin requests on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, state: Arc<AdminState>) {
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = tokio::time::timeout(REQUEST_TIMEOUT, handle(stream, &state)).await {
                tracing::debug!(%peer, error = %e, "admin request timed out");
            }
        });
    }
}

async fn handle(mut stream: TcpStream, state: &AdminState) {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    let head_end = loop {
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos;
        }
        if buf.len() > MAX_REQUEST_BYTES {
            let _ = respond(&mut stream, 431, "text/plain", "request head too large\n").await;
            return;
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]);
    let mut parts = head.lines().next().unwrap_or("").split(' ');
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    if method != "GET" && method != "HEAD" {
        let _ = respond(&mut stream, 405, "text/plain", "only GET\n").await;
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
        "/metrics" | "/stats/prometheus" => (
            200,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            state.metrics.encode(),
        ),
        "/routes" => match &state.routes {
            Some(f) => (200, "application/json", f()),
            None => (404, "text/plain", "not found\n".to_string()),
        },
        _ => (404, "text/plain", "not found\n".to_string()),
    };
    let body = if method == "HEAD" {
        String::new()
    } else {
        body
    };
    let _ = respond(&mut stream, status, ctype, &body).await;
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
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    crate::net::socket::bind_tcp(addr, 128)
}
