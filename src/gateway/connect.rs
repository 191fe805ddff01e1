//! `http-connect` listener: CONNECT relay for the reversed VPN and the shoot apiserver proxy.
//!
//! The route is chosen by the value of the listener's destination header (compared exactly,
//! header name case-insensitive); the request target is ignored. `200` is sent only once the
//! backend connection is up; bytes the client sent after the request head are relayed. Every
//! error answers a status and closes.

use super::conn::{Conn, ReadError};
use super::{Reply, Shared};
use crate::admin::metrics::ListenerMetrics;
use crate::config::gateway::ListenerConfig;
use crate::wire::http;

/// Handles one `http-connect` connection from its request head to close.
pub async fn handle(
    mut conn: Box<Conn>,
    config: &ListenerConfig,
    destination_header: &str,
    shared: &Shared,
    lm: &ListenerMetrics,
) {
    let max = shared.config.limits.max_header_bytes;
    let (head, consumed) =
        match Box::pin(conn.read_until(max, |b| http::parse_request_head(b, max))).await {
            Ok(x) => x,
            Err(ReadError::Closed { bytes }) => {
                return conn.log.reject(
                    shared,
                    "closed_early",
                    &format!("client closed after {bytes} bytes"),
                );
            }
            Err(ReadError::Timeout) => {
                conn.reject_with(&http::response(408, "no request head in time"))
                    .await;
                return conn
                    .log
                    .reject(shared, "timeout", "no request head in time");
            }
            Err(ReadError::Reject(r)) => {
                conn.reject_with(&http::response(r.status(), &r.to_string()))
                    .await;
                return conn.log.reject(shared, "bad_request", &r.to_string());
            }
        };
    conn.consume(consumed);
    if head.method != "CONNECT" {
        conn.reject_with(&http::response(405, "only CONNECT is supported"))
            .await;
        return conn
            .log
            .reject(shared, "bad_request", &format!("method {}", head.method));
    }
    let mut values = head.header_values(destination_header);
    let destination = values.next().map(str::to_owned);
    if values.any(|v| Some(v) != destination.as_deref()) {
        conn.reject_with(&http::response(400, "conflicting destination headers"))
            .await;
        return conn
            .log
            .reject(shared, "bad_request", "conflicting destination headers");
    }
    conn.log.target = destination.clone();

    let route = super::pick_route(shared, config, |t| {
        destination.as_deref().and_then(|d| t.by_destination(d))
    });
    let Some(route) = route else {
        let detail = match &destination {
            Some(_) => "unknown destination",
            None => "missing destination header",
        };
        conn.reject_with(&http::response(403, detail)).await;
        return conn.log.reject(shared, "no_route", detail);
    };
    super::forward(conn, &route, Reply::Http, shared, lm).await;
}
