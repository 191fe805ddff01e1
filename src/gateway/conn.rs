//! The per-connection pipeline every listener shares: a PROXY header from a load balancer
//! (per the listener's mode and trusted sources), the per-source limit (the PROXY source
//! counts as the client), then the listener's own protocol. Everything before routing runs
//! under one handshake deadline, with bounded buffers.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::Shared;
use super::access::AccessLog;
use super::listener::{Accepted, ConnGuard};
use crate::admin::metrics::ListenerMetrics;
use crate::config::gateway::{ListenerConfig, ListenerKind, ProxyMode};
use crate::wire::Parsed;
use crate::wire::proxy::{self, Detect, ProxyInfo};

/// How long to wait for the client to read a rejection before closing.
const REJECT_LINGER: std::time::Duration = std::time::Duration::from_secs(1);

/// A connection between accept and routing.
pub struct Conn {
    /// The client socket.
    pub stream: TcpStream,
    /// Bytes read and not yet consumed by an earlier stage.
    pub buf: Vec<u8>,
    /// Handshake deadline: everything before routing must finish by then.
    pub deadline: Instant,
    /// The access-log record.
    pub log: AccessLog,
    /// Keeps the connection counted.
    pub guard: ConnGuard,
}

/// Why a stage could not read what it needs.
pub enum ReadError<E> {
    /// The client closed (or reset) first, after sending `bytes`.
    Closed {
        /// Bytes received in this stage.
        bytes: usize,
    },
    /// The handshake deadline passed.
    Timeout,
    /// The parser rejected the bytes.
    Reject(E),
}

impl Conn {
    /// Reads until `parse` completes on the buffered bytes, reading at most `max` bytes in
    /// all. Returns the value and how many buffered bytes it consumed.
    pub async fn read_until<T, E>(
        &mut self,
        max: usize,
        parse: impl Fn(&[u8]) -> Result<Parsed<T>, E>,
    ) -> Result<(T, usize), ReadError<E>> {
        loop {
            if !self.buf.is_empty() {
                match parse(&self.buf) {
                    Ok(Parsed::Complete { value, consumed }) => return Ok((value, consumed)),
                    Ok(Parsed::Incomplete) => {}
                    Err(e) => return Err(ReadError::Reject(e)),
                }
            }
            self.read_more(max).await?;
        }
    }

    /// Reads once more into the buffer (never past `max` bytes buffered).
    async fn read_more<E>(&mut self, max: usize) -> Result<(), ReadError<E>> {
        let room = max.saturating_sub(self.buf.len()).min(4096);
        if room == 0 {
            // Parsers reject before their cap; this is a guard, not a path.
            return Err(ReadError::Closed {
                bytes: self.buf.len(),
            });
        }
        let start = self.buf.len();
        self.buf.resize(start + room, 0);
        let read =
            tokio::time::timeout_at(self.deadline, self.stream.read(&mut self.buf[start..])).await;
        let n = match read {
            Ok(Ok(n)) => n,
            Ok(Err(_)) => 0,
            Err(_) => {
                self.buf.truncate(start);
                return Err(ReadError::Timeout);
            }
        };
        self.buf.truncate(start + n);
        if n == 0 {
            return Err(ReadError::Closed { bytes: start });
        }
        Ok(())
    }

    /// Drops the first `n` buffered bytes (consumed by a stage).
    pub fn consume(&mut self, n: usize) {
        self.buf.drain(..n);
    }

    /// Writes `bytes` (an alert or an error response), half-closes, and lets the client read
    /// them before the socket closes (closing with unread input would send a reset).
    pub async fn reject_with(&mut self, bytes: &[u8]) {
        let stream = &mut self.stream;
        // Boxed: this rarely taken path must not enlarge every connection's task.
        let _ = Box::pin(tokio::time::timeout(REJECT_LINGER, async {
            stream.write_all(bytes).await?;
            stream.shutdown().await?;
            let mut sink = vec![0u8; 1024];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<_, std::io::Error>(())
        }))
        .await;
    }
}

/// Runs one accepted connection through the pipeline.
pub async fn serve(acc: Accepted, config: &ListenerConfig, shared: &Shared, lm: &ListenerMetrics) {
    let Accepted {
        stream,
        peer,
        guard,
        accepted_at,
    } = acc;
    let deadline = Instant::from_std(accepted_at) + shared.config.timeouts.handshake;
    // Boxed: the connection state crosses three async layers as one pointer instead of
    // being copied into each layer's future.
    let mut conn = Box::new(Conn {
        stream,
        buf: Vec::new(),
        deadline,
        log: AccessLog::new(&config.name, peer, accepted_at),
        guard,
    });

    let mode = config.proxy_protocol.mode_for(peer.ip());
    if mode != ProxyMode::Off {
        // Boxed, like every pre-routing stage: the task keeps only what the relay needs.
        match Box::pin(load_balancer_header(&mut conn, mode, shared)).await {
            Ok(Some(info)) => {
                shared
                    .metrics
                    .proxy_header(&config.name, header_result(&info));
                conn.log.set_proxy(&info);
            }
            Ok(None) => shared.metrics.proxy_header(&config.name, "absent"),
            Err((outcome, result, detail)) => {
                if let Some(result) = result {
                    shared.metrics.proxy_header(&config.name, result);
                }
                return conn.log.reject(shared, outcome, &detail);
            }
        }
    }

    let per_source = shared.config.limits.max_connections_per_source;
    if !conn.guard.limit_source(conn.log.client.ip(), per_source) {
        return conn
            .log
            .reject(shared, "limited", "per-source connection limit");
    }

    match &config.kind {
        ListenerKind::Sni => super::sni::handle(conn, config, shared, lm).await,
        ListenerKind::HttpConnect { destination_header } => {
            super::connect::handle(conn, config, destination_header, shared, lm).await
        }
        ListenerKind::ProxyDestination => super::proxydst::handle(conn, config, shared, lm).await,
    }
}

/// The metric result for a parsed header.
pub fn header_result(info: &ProxyInfo) -> &'static str {
    match (info.addresses, info.version) {
        (None, _) => "local",
        (Some(_), 1) => "v1",
        (Some(_), _) => "v2",
    }
}

/// A rejection: downstream outcome, proxy-header metric result (if any), detail.
pub type StageReject = (&'static str, Option<&'static str>, String);

/// Reads the load balancer's PROXY header. `Ok(None)`: optional mode and none was sent.
async fn load_balancer_header(
    conn: &mut Conn,
    mode: ProxyMode,
    shared: &Shared,
) -> Result<Option<ProxyInfo>, StageReject> {
    let limit = shared.config.limits.max_header_bytes;
    if mode == ProxyMode::Optional {
        let detected = conn
            .read_until(proxy::V2_SIGNATURE.len(), |b| {
                Ok::<_, proxy::Reject>(match proxy::detect(b) {
                    Detect::NeedMore => Parsed::Incomplete,
                    d => Parsed::Complete {
                        value: d,
                        consumed: 0,
                    },
                })
            })
            .await;
        match detected {
            Ok((Detect::Proxy, _)) => {}
            Ok(_) => return Ok(None),
            Err(e) => return Err(proxy_stage_error(e)),
        }
    }
    let (info, consumed) = conn
        .read_until(limit, |b| proxy::parse(b, limit))
        .await
        .map_err(proxy_stage_error)?;
    conn.consume(consumed);
    Ok(Some(info))
}

/// Maps a failed PROXY header read to a rejection (shared with `proxy-destination`).
pub fn proxy_stage_error(e: ReadError<proxy::Reject>) -> StageReject {
    match e {
        ReadError::Closed { bytes: 0 } => (
            "closed_early",
            None,
            "closed without sending anything".into(),
        ),
        ReadError::Closed { bytes } => (
            "closed_early",
            Some("invalid"),
            format!("closed after {bytes} bytes of a PROXY header"),
        ),
        ReadError::Timeout => ("timeout", Some("timeout"), "no PROXY header in time".into()),
        ReadError::Reject(r) => ("bad_request", Some(r.kind()), r.to_string()),
    }
}
