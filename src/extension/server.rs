//! The webhooks' HTTPS server: TLS (rustls, ring) with the key pair [`Published`] holds now
//! (a renewed pair is served to new handshakes, open connections keep theirs), HTTP/1.1 with
//! keep-alive (hyper), and the bounds that keep bad input from holding it: the TLS handshake
//! within [`HANDSHAKE_TIMEOUT`], a request head within [`REQUEST_TIMEOUT`] (an idle
//! keep-alive connection is closed after it too) and the whole request, head, body and
//! review, within one [`REQUEST_TIMEOUT`] from its first byte,
//! bodies up to [`MAX_BODY`] (413 beyond, from `Content-Length` at once or while streaming),
//! `POST` only (405), webhook paths only (404), at most [`MAX_CONNECTIONS`] connections
//! (more are closed at once). Every refusal is counted
//! (`trellis_extension_rejections_total{reason}`). What a request means is
//! [`admission`]'s; this module does the I/O.
//!
//! On `stop` it closes the listener, lets every connection finish its request (keep-alive
//! ones are closed after their answer) for up to [`DRAIN_TIMEOUT`], then cuts the rest.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::ServerConfig;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

use super::admission::{self, Answer};
use super::certs::Published;
use super::metrics::{ExtensionMetrics, Rejection};
use super::role;
use super::state::State;
use crate::StartError;

/// Deadline of a TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Deadline of a request head (from the connection's previous answer, or its handshake),
/// and of the whole request (head, body read and review) from its first byte.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request body (the API server sends whole objects; 4 MiB is far above any
/// DaemonSet).
pub const MAX_BODY: usize = 4 << 20;
/// Largest request head.
pub const MAX_HEAD: usize = 16 << 10;
/// Most connections held at once (the API servers of every shoot of the seed, each with a
/// few).
pub const MAX_CONNECTIONS: usize = 1024;
/// How long connections may finish after `stop`.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a failed accept (out of descriptors) before the next.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// The server's socket, bound and not yet serving.
#[derive(Debug)]
pub struct Bound {
    listener: TcpListener,
    address: SocketAddr,
}

/// Binds `address` (`webhook.address`).
pub async fn bind(address: SocketAddr) -> Result<Bound, StartError> {
    let listener = TcpListener::bind(address)
        .await
        .map_err(|e| StartError::bind("webhook server", address, e))?;
    let address = listener
        .local_addr()
        .map_err(|e| StartError::bind("webhook server", address, e))?;
    Ok(Bound { listener, address })
}

/// Serves the key pair [`Published`] holds when a handshake asks.
#[derive(Debug)]
struct Resolver(Arc<Published>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.key()
    }
}

/// The TLS configuration: TLS 1.3 and 1.2, HTTP/1.1, the key pair `certs` holds now.
pub fn tls_config(certs: Arc<Published>) -> Result<Arc<ServerConfig>, rustls::Error> {
    let mut config = ServerConfig::builder_with_provider(crate::net::tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(Resolver(certs)));
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

impl Bound {
    /// The bound address (the port chosen for `:0`).
    pub fn local_addr(&self) -> SocketAddr {
        self.address
    }

    /// Serves until `stop` turns true, then drains (see the module's text).
    pub async fn serve(
        self,
        state: Arc<State>,
        certs: Arc<Published>,
        metrics: Arc<ExtensionMetrics>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<(), rustls::Error> {
        let acceptor = TlsAcceptor::from(tls_config(certs)?);
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let mut tasks = JoinSet::new();
        tracing::info!(address = %self.address, "webhook server listening");
        loop {
            tokio::select! {
                () = stopped(&mut stop) => break,
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                accepted = self.listener.accept() => match accepted {
                    Ok((tcp, peer)) => {
                        let Ok(slot) = slots.clone().try_acquire_owned() else {
                            metrics.reject(Rejection::Limited);
                            drop(tcp);
                            continue;
                        };
                        let c = Connection {
                            acceptor: acceptor.clone(),
                            state: state.clone(),
                            metrics: metrics.clone(),
                            stop: stop.clone(),
                        };
                        tasks.spawn(async move {
                            c.run(tcp, peer.ip()).await;
                            drop(slot);
                        });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "webhook server: accept failed");
                        tokio::time::sleep(ACCEPT_RETRY).await;
                    }
                },
            }
        }
        drop(self.listener);
        let open = tasks.len();
        tracing::info!(open, "webhook server stopped listening; draining");
        let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(open = tasks.len(), "webhook server: cutting connections");
            tasks.shutdown().await;
        }
        Ok(())
    }
}

/// What a connection's task holds.
struct Connection {
    acceptor: TlsAcceptor,
    state: Arc<State>,
    metrics: Arc<ExtensionMetrics>,
    stop: watch::Receiver<bool>,
}

/// Keeps `trellis_extension_connections_active` while alive.
struct Active(Arc<ExtensionMetrics>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.connections.dec();
    }
}

impl Connection {
    async fn run(mut self, tcp: TcpStream, peer: IpAddr) {
        self.metrics.connections.inc();
        let _active = Active(self.metrics.clone());
        let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, self.acceptor.accept(tcp)).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "webhook TLS handshake failed");
                self.metrics.reject(Rejection::HandshakeFailed);
                return;
            }
            Err(_) => {
                self.metrics.reject(Rejection::HandshakeTimeout);
                return;
            }
        };
        let (state, metrics) = (self.state.clone(), self.metrics.clone());
        let clock = Arc::new(RequestClock::default());
        let io = Clocked {
            io: tls,
            clock: clock.clone(),
        };
        let service = hyper::service::service_fn(move |req| {
            handle(req, peer, state.clone(), metrics.clone(), clock.clone())
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(REQUEST_TIMEOUT)
            .max_buf_size(MAX_HEAD.max(8192))
            .keep_alive(true);
        let conn = builder.serve_connection(TokioIo::new(io), service);
        tokio::pin!(conn);
        let result = tokio::select! {
            r = conn.as_mut() => r,
            () = stopped(&mut self.stop) => {
                conn.as_mut().graceful_shutdown();
                conn.await
            }
        };
        if let Err(e) = result {
            if e.is_timeout() {
                self.metrics.reject(Rejection::RequestTimeout);
            } else {
                tracing::debug!(%peer, error = %e, "webhook connection ended with an error");
            }
        }
    }
}

/// When the current request's first byte arrived (`None`: none has since the previous
/// request was answered).
#[derive(Debug, Default)]
struct RequestClock(Mutex<Option<Instant>>);

impl RequestClock {
    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes arrived: the first since the last answer starts the request.
    fn mark(&self) {
        self.slot().get_or_insert_with(Instant::now);
    }

    /// When the current request began, if its first byte was seen.
    fn began(&self) -> Option<Instant> {
        *self.slot()
    }

    /// The request is answered: the next bytes begin the next one.
    fn rearm(&self) {
        *self.slot() = None;
    }
}

/// Re-arms the clock when a request's handling ends, however it ends.
struct Rearm(Arc<RequestClock>);

impl Drop for Rearm {
    fn drop(&mut self) {
        self.0.rearm();
    }
}

/// The connection's stream, noting in its [`RequestClock`] when a request's first
/// (decrypted) byte is read.
struct Clocked<T> {
    io: T,
    clock: Arc<RequestClock>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Clocked<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.clock.mark();
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Clocked<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// Returns once `stop` is true (or its sender is gone).
pub(crate) async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

type Reply = Response<Full<Bytes>>;

fn reply(answer: Answer, close: bool) -> Reply {
    let mut r = Response::new(Full::new(Bytes::from(answer.body)));
    *r.status_mut() = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::BAD_REQUEST);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(answer.content_type));
    if close {
        r.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    r
}

/// Answers one request (the deadline of its head is hyper's; the body must be read within
/// [`REQUEST_TIMEOUT`] of the head's first byte, as `clock` noted it).
async fn handle(
    req: Request<Incoming>,
    peer: IpAddr,
    state: Arc<State>,
    metrics: Arc<ExtensionMetrics>,
    clock: Arc<RequestClock>,
) -> Result<Reply, Infallible> {
    let started = Instant::now();
    let deadline = clock.began().unwrap_or(started) + REQUEST_TIMEOUT;
    let _rearm = Rearm(clock);
    let refuse = |why: Rejection, status: u16, text: &str, close: bool| {
        metrics.reject(why);
        Ok(reply(Answer::refuse(why, status, text), close))
    };
    if req.method() != Method::POST {
        let mut r = refuse(Rejection::Method, 405, "only POST", true)?;
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("POST"));
        return Ok(r);
    }
    if role::parse_path(req.uri().path()).is_none() {
        return refuse(Rejection::NotFound, 404, "no webhook at this path", true);
    }
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return refuse(Rejection::TooLarge, 413, "body too large", true);
    }
    let path = req.uri().path().to_owned();
    let body = Limited::new(req.into_body(), MAX_BODY);
    let bytes = match tokio::time::timeout_at(deadline.into(), body.collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return refuse(Rejection::TooLarge, 413, "body too large", true);
        }
        Ok(Err(_)) => return refuse(Rejection::NotAReview, 400, "body not read", true),
        Err(_) => return refuse(Rejection::RequestTimeout, 408, "body too slow", true),
    };
    let answer = admission::answer(&path, peer, &bytes, &state, &metrics);
    if let Some(why) = answer.rejection {
        metrics.reject(why);
    }
    let close = answer.rejection.is_some();
    let r = reply(answer, close);
    metrics
        .review_duration
        .observe(started.elapsed().as_secs_f64());
    Ok(r)
}
