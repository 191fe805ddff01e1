//! `http-connect` listener: CONNECT relay for the reversed VPN and the shoot apiserver proxy.
//!
//! The route is chosen by the value of the listener's destination header (compared exactly,
//! header name case-insensitive); the request target is ignored. `200` is sent only once the
//! backend connection is up; bytes the client sent after the request head are relayed. Every
//! error answers a status and closes (`403` for a client outside the route's
//! `allowedSourceRanges`).
//!
//! A route with `forwardConnect` leads to CONNECT proxies (Envoy's CONNECT listeners behind
//! a `defaultRoute`): the gateway does not answer the request; once a backend is connected
//! it sends the head exactly as received, with any bytes after it, and the backend's answer
//! reaches the client through the relay. Only a failed connect is answered here
//! (`502`/`504`).

use super::conn::{Conn, ReadError};
use super::{Pick, Shared};
use crate::config::gateway::ListenerConfig;
use crate::serve::forward::Reply;
use crate::serve::record::Outcome;
use crate::wire::http;

/// Handles one `http-connect` connection from its request head to close.
pub(super) async fn handle(
    mut conn: Box<Conn>,
    config: &ListenerConfig,
    destination_header: &str,
    shared: &Shared,
) {
    let max = shared.config.limits.max_header_bytes;
    let (head, consumed) =
        match Box::pin(conn.read_until(max, |b| http::parse_request_head(b, max))).await {
            Ok(x) => x,
            Err(ReadError::Closed { bytes }) => {
                return conn.reject(
                    Outcome::ClosedEarly,
                    &format!("client closed after {bytes} bytes"),
                );
            }
            Err(ReadError::Timeout) => {
                conn.reject_with(&http::response(408, "no request head in time"))
                    .await;
                return conn.reject(Outcome::Timeout, "no request head in time");
            }
            Err(ReadError::Reject(r)) => {
                conn.reject_with(&http::response(r.status(), &r.to_string()))
                    .await;
                return conn.reject(Outcome::BadRequest, &r.to_string());
            }
        };
    if head.method != "CONNECT" {
        conn.reject_with(&http::response(405, "only CONNECT is supported"))
            .await;
        return conn.reject(Outcome::BadRequest, &format!("method {}", head.method));
    }
    let mut values = head.header_values(destination_header);
    let destination = values.next().map(str::to_owned);
    if values.any(|v| Some(v) != destination.as_deref()) {
        conn.reject_with(&http::response(400, "conflicting destination headers"))
            .await;
        return conn.reject(Outcome::BadRequest, "conflicting destination headers");
    }
    conn.record.target = destination.clone();

    let pick = super::pick_route(shared, config, conn.source.ip(), |t| {
        destination.as_deref().and_then(|d| t.by_destination(d))
    });
    let route = match pick {
        Pick::Route(route) => route,
        Pick::Denied(route) => {
            conn.reject_with(&http::response(403, "client address not allowed"))
                .await;
            return conn.deny(route);
        }
        Pick::NoRoute => {
            let detail = match &destination {
                Some(_) => "unknown destination",
                None => "missing destination header",
            };
            conn.reject_with(&http::response(403, detail)).await;
            return conn.reject(Outcome::NoRoute, detail);
        }
    };
    let reply = if route.forward_connect {
        // Every byte read stays in the buffer: the head goes to the backend as received.
        conn.record.forwarded = true;
        Reply::HttpForwarded
    } else {
        conn.consume(consumed);
        Reply::Http
    };
    conn.forward(&route, reply, shared).await;
}
