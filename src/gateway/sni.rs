//! `sni` listener: TLS passthrough routed by the ClientHello's server name.
//!
//! Reads the ClientHello under the handshake deadline (however it is split over segments and
//! records), picks the route, connects a backend, replays every byte read, and relays. TLS is
//! never terminated. Unroutable hellos get a fatal `unrecognized_name` alert, clients outside the route's
//! `allowedSourceRanges` an `access_denied` alert.

use tokio::net::TcpStream;

use super::conn::{Conn, Ready};
use super::{Pick, Shared};
use crate::config::gateway::Listener;
use crate::net::dial::Dest;
use crate::serve::forward::Reply;
use crate::serve::record::Outcome;
use crate::wire::tls;

/// Takes one `sni` connection from its ClientHello to a linked backend (`None`: it ended
/// before).
pub(super) async fn handle(
    mut conn: Box<Conn<TcpStream>>,
    config: &Listener,
    shared: &Shared,
) -> Option<Ready> {
    let max = shared.config.limits.max_client_hello_bytes;
    let hello = match conn.client_hello(max).await {
        Ok(hello) => hello,
        Err(refusal) => return conn.refuse(refusal).await,
    };
    let record_version = hello.record_version;
    conn.record.target = hello.server_name;

    // One snapshot of the route for the whole connection.
    let pick = super::pick_route(shared, config, conn.source.ip(), |t| {
        conn.record.target.as_deref().and_then(|n| t.by_sni(n))
    });
    let route = match pick {
        Pick::Route(route) => route,
        Pick::Denied(route) => {
            // An alert rather than a reset: the client learns it was refused, not why or by
            // which route.
            conn.reject_with(&tls::access_denied_alert(record_version))
                .await;
            return conn.deny(route);
        }
        Pick::NoRoute => {
            conn.reject_with(&tls::unrecognized_name_alert(record_version))
                .await;
            return conn.reject(Outcome::NoRoute, "no route for server name");
        }
    };
    // Every byte read, the ClientHello included, goes to the backend unchanged.
    conn.link(&route, Dest::Backends, Reply::None, shared).await
}
