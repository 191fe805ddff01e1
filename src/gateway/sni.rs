//! `sni` listener: TLS passthrough routed by the ClientHello's server name.
//!
//! Reads the ClientHello under the handshake deadline (however it is split over segments and
//! records), picks the route, connects a backend, replays every byte read, and relays. TLS is
//! never terminated. Unroutable hellos get a fatal `unrecognized_name` alert.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::Shared;
use super::access::AccessLog;
use super::listener::Accepted;
use crate::admin::metrics::ListenerMetrics;
use crate::config::gateway::ListenerConfig;
use crate::wire::Parsed;
use crate::wire::tls::{self, ClientHello, Reject};

/// How long to wait for the client to read an alert before closing.
const ALERT_LINGER: Duration = Duration::from_secs(1);

/// Why no ClientHello could be read.
enum HelloError {
    /// The client closed (or reset) before a complete ClientHello; `bytes` were read.
    Closed { bytes: usize },
    /// The bytes are not an acceptable ClientHello.
    Reject(Reject),
}

/// Reads until a complete ClientHello; returns it with every byte read (to replay).
async fn read_client_hello(
    stream: &mut TcpStream,
    max: usize,
) -> Result<(ClientHello, Vec<u8>), HelloError> {
    let mut buf = Vec::with_capacity(max.min(2048));
    let mut chunk = [0u8; 2048];
    loop {
        let room = max.saturating_sub(buf.len()).min(chunk.len());
        if room == 0 {
            return Err(HelloError::Reject(Reject::TooLarge {
                needed: buf.len() + 1,
                limit: max,
            }));
        }
        let n = match stream.read(&mut chunk[..room]).await {
            Ok(0) | Err(_) => return Err(HelloError::Closed { bytes: buf.len() }),
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        match tls::parse_client_hello(&buf, max) {
            Ok(Parsed::Incomplete) => continue,
            Ok(Parsed::Complete { value, .. }) => return Ok((value, buf)),
            Err(r) => return Err(HelloError::Reject(r)),
        }
    }
}

/// Handles one `sni` connection from accept to close.
pub async fn handle(acc: Accepted, config: &ListenerConfig, shared: &Shared, lm: &ListenerMetrics) {
    let Accepted {
        mut stream,
        peer,
        guard: _guard,
        accepted_at,
    } = acc;
    let mut log = AccessLog::new(&config.name, peer, accepted_at);
    let timeouts = shared.config.timeouts;
    let max = shared.config.limits.max_client_hello_bytes;

    let read = tokio::time::timeout(timeouts.handshake, read_client_hello(&mut stream, max)).await;
    let (hello, bytes) = match read {
        Ok(Ok(x)) => x,
        Ok(Err(HelloError::Closed { bytes })) => {
            return log.reject(
                shared,
                "closed_early",
                &format!("client closed after {bytes} bytes"),
            );
        }
        Ok(Err(HelloError::Reject(r))) => {
            let outcome = if r == Reject::NotTls {
                "not_tls"
            } else {
                "bad_request"
            };
            return log.reject(shared, outcome, &r.to_string());
        }
        Err(_) => return log.reject(shared, "timeout", "no complete ClientHello in time"),
    };
    lm.client_hello_bytes.observe(bytes.len() as f64);
    log.target = hello.server_name.clone();

    // One snapshot for the whole connection.
    let snapshot = shared.tables.snapshot();
    let table = snapshot.table();
    let route = hello
        .server_name
        .as_deref()
        .and_then(|name| table.by_sni(name))
        .or_else(|| {
            config
                .default_route
                .as_deref()
                .and_then(|r| table.by_name(r))
        });
    let Some(route) = route.cloned() else {
        send_alert(&mut stream, hello.record_version).await;
        return log.reject(shared, "no_route", "no route for server name");
    };
    drop(snapshot);

    super::forward(&mut stream, &route, &bytes, shared, log, lm).await;
}

/// Sends a fatal `unrecognized_name` alert, half-closes, and gives the client a moment to
/// read it (closing with unread input would turn the close into a reset).
async fn send_alert(stream: &mut TcpStream, record_version: u16) {
    let alert = tls::unrecognized_name_alert(record_version);
    let _ = tokio::time::timeout(ALERT_LINGER, async {
        stream.write_all(&alert).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 1024];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}
