//! `proxy-destination` listener (GEP-08): every connection starts with a PROXY v1/v2 header
//! whose destination address:port selects the route; the bytes after it (the client's own
//! TLS) are relayed unchanged. `LOCAL`/`UNKNOWN` headers and unknown destinations are
//! rejected and counted. Routes' `allowedSourceRanges` are matched against the peer (or a
//! trusted load balancer's PROXY source), never against this header's source, which the
//! client writes itself. A route that sends its backends a PROXY header puts this header's
//! destination in it.

use tokio::net::TcpStream;

use super::conn::{Conn, Ready, header_result, proxy_stage_error};
use super::{Pick, Shared};
use crate::config::gateway::Listener;
use crate::net::dial::Dest;
use crate::net::socket::normalize;
use crate::serve::forward::Reply;
use crate::serve::record::Outcome;
use crate::wire::proxy;

/// Takes one `proxy-destination` connection from its PROXY header to a linked backend
/// (`None`: it ended before).
pub(super) async fn handle(
    mut conn: Box<Conn<TcpStream>>,
    config: &Listener,
    shared: &Shared,
) -> Option<Ready> {
    let limit = shared.config.limits.max_header_bytes;
    let (info, consumed) = match conn.read_until(limit, |b| proxy::parse(b, limit)).await {
        Ok(x) => x,
        Err(e) => {
            let (outcome, result, detail) = proxy_stage_error(e);
            if let Some(result) = result {
                shared.metrics.proxy_header(&config.name, result);
            }
            return conn.reject(outcome, &detail);
        }
    };
    conn.consume(consumed);
    shared
        .metrics
        .proxy_header(&config.name, header_result(&info));
    conn.record.set_proxy(&info);
    let Some(destination) = info.destination().map(normalize) else {
        return conn.reject(
            Outcome::BadRequest,
            "PROXY header without addresses (LOCAL/UNKNOWN)",
        );
    };
    conn.record.target = Some(destination.to_string());
    // What a route's own PROXY header carries on: the address the client meant.
    conn.destination = Some(destination);

    // The header's source is the client's own claim: routes admit by `conn.source`.
    let pick = super::pick_route(shared, config, conn.source.ip(), |t| {
        t.by_proxy_destination(&destination)
    });
    let route = match pick {
        Pick::Route(route) => route,
        Pick::Denied(route) => return conn.deny(route),
        Pick::NoRoute => return conn.reject(Outcome::NoRoute, "unknown PROXY destination"),
    };
    conn.link(&route, Dest::Backends, Reply::None, shared).await
}
