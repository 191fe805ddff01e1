//! `http-connect` listener: CONNECT relay for the reversed VPN and the shoot apiserver proxy.
//!
//! The route is chosen by the value of the listener's destination header (compared exactly,
//! header name case-insensitive); the request target is ignored. `200` is sent only once the
//! backend connection is up; bytes the client sent after the request head are relayed. Every
//! error answers a status and closes (`403` for a client outside the route's
//! `allowedSourceRanges`). A head without the destination header goes to the listener's
//! `defaultRoute` when that route answers CONNECTs here (its backend sees only the tunnel).
//!
//! A route with `forwardConnect` leads to CONNECT proxies (Envoy's CONNECT listeners behind
//! a `defaultRoute`): the gateway does not answer the request; once a backend is connected
//! it sends the head as received, less the `X-Forwarded-*` and `X-Envoy-*` headers a client
//! wrote (the proxy behind trusts them from its peer), and waits for the backend's answer, which reaches
//! the client; the bytes after the head follow only if the backend accepted (see
//! [`crate::serve::forward`]). Only a failed connect, or no valid answer, is answered here
//! (`502`/`504`). Such a head is forwarded only when it names its destination the way this
//! listener routes it — the listener's header exactly once, and no other destination header
//! the gateway knows — since the proxy behind may route by another header (Envoy's `8132`
//! takes `X-Gardener-Destination` as well as `Reversed-VPN`), or the same header repeated,
//! to a destination the gateway never matched: otherwise `403`, counted `no_route`.
//!
//! A CONNECT whose destination is the `wireguard` listener's `connectDestination` reaches no
//! route: it is answered `200` and its stream carries WireGuard to the device
//! ([`super::tunnel::carry`]).

use tokio::net::TcpStream;

use super::conn::{Conn, Ready};
use super::{Pick, Shared};
use crate::config::gateway::{Listener, ListenerKind};
use crate::config::value::DEFAULT_DESTINATION_HEADER;
use crate::net::dial::Dest;
use crate::serve::forward::{Forwarded, Reply};
use crate::serve::record::Outcome;
use crate::wire::http::{self, RequestHead};

/// The header Gardener's legacy reversed-VPN clients route by (Envoy's port `8132`).
const REVERSED_VPN_HEADER: &str = "Reversed-VPN";

/// Every CONNECT destination header the gateway knows, each once (compared
/// case-insensitively): the `destinationHeader` of every `http-connect` listener, and
/// always Gardener's two, which the CONNECT proxies a route may forward to route by.
pub(super) fn known_destination_headers(listeners: &[Listener]) -> Vec<String> {
    let configured = listeners.iter().filter_map(|l| match l.kind() {
        ListenerKind::HttpConnect { destination_header } => Some(destination_header),
        _ => None,
    });
    let mut known: Vec<String> = Vec::new();
    for name in [DEFAULT_DESTINATION_HEADER, REVERSED_VPN_HEADER]
        .into_iter()
        .chain(configured)
    {
        if !known.iter().any(|k| k.eq_ignore_ascii_case(name)) {
            known.push(name.to_owned());
        }
    }
    known
}

/// Whether a request head may be forwarded as received to a CONNECT proxy behind a listener
/// that routes by `own`: `own` exactly once, and none of the `known` destination headers
/// besides (names compared case-insensitively). `Err`: why not, for the `403`.
fn forwardable(head: &RequestHead, own: &str, known: &[String]) -> Result<(), &'static str> {
    let mut own_count = 0;
    for (name, _) in &head.headers {
        if name.eq_ignore_ascii_case(own) {
            own_count += 1;
        } else if known.iter().any(|k| k.eq_ignore_ascii_case(name)) {
            return Err("unexpected destination header");
        }
    }
    match own_count {
        0 => Err("missing destination header"),
        1 => Ok(()),
        _ => Err("repeated destination header"),
    }
}

/// Header name prefixes a CONNECT proxy behind trusts from its own peer (Envoy takes
/// `X-Forwarded-*` and `X-Envoy-*` from an internal one), compared case-insensitively.
const TRUSTED_HEADER_PREFIXES: [&str; 2] = ["x-forwarded-", "x-envoy-"];

/// Removes from the request head in `buf[..head_len]` every header line a client could use
/// to speak for the gateway to the proxy behind ([`TRUSTED_HEADER_PREFIXES`]); the bytes
/// after the head stay as they are. Returns the head's new length.
fn strip_trusted_headers(buf: &mut Vec<u8>, head_len: usize) -> usize {
    let trusted = |line: &[u8]| {
        let name = line.split(|b| *b == b':').next().unwrap_or(b"");
        TRUSTED_HEADER_PREFIXES
            .iter()
            .any(|p| name.len() >= p.len() && name[..p.len()].eq_ignore_ascii_case(p.as_bytes()))
    };
    let head = &buf[..head_len.min(buf.len())];
    if !head.split(|b| *b == b'\n').skip(1).any(trusted) {
        return head_len;
    }
    let mut kept = Vec::with_capacity(head.len());
    // Lines with their terminators; the request line first, never a header.
    for (i, line) in head.split_inclusive(|b| *b == b'\n').enumerate() {
        if i == 0 || !trusted(line) {
            kept.extend_from_slice(line);
        }
    }
    let new_len = kept.len();
    buf.splice(..head_len, kept);
    new_len
}

/// Takes one `http-connect` connection from its request head to a linked backend (`None`:
/// it ended before).
pub(super) async fn handle(
    mut conn: Box<Conn<TcpStream>>,
    config: &Listener,
    destination_header: &str,
    shared: &Shared,
) -> Option<Ready> {
    let max = shared.config.limits.max_header_bytes;
    let (head, consumed) = match conn.request_head(max).await {
        Ok(x) => x,
        Err(refusal) => return conn.refuse(refusal).await,
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
    if let (Some(tunnels), Some((wanted, listener))) =
        (&shared.tunnels, &shared.connect_destination)
        && destination.as_deref() == Some(wanted.as_str())
    {
        conn.consume(consumed);
        super::tunnel::carry(conn, tunnels, listener, shared).await;
        return None;
    }

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
        if let Err(detail) = forwardable(&head, destination_header, &shared.destination_headers) {
            conn.reject_with(&http::response(403, detail)).await;
            return conn.reject(Outcome::NoRoute, detail);
        }
        // Every byte read stays in the buffer: the head goes to the backend as received
        // (less the headers a proxy behind would trust, see `strip_trusted_headers`), the
        // bytes after it once the backend accepted. The backend answers after its own
        // upstream connect: it gets the handshake allowance, from when it is connected.
        let consumed = strip_trusted_headers(&mut conn.buf, consumed);
        Reply::HttpForwarded(Forwarded {
            head: consumed,
            max_answer: max,
            answer_timeout: shared.config.timeouts.handshake,
        })
    } else {
        conn.consume(consumed);
        Reply::Http
    };
    conn.link(&route, Dest::Backends, reply, shared).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Parsed;

    fn head(headers: &str) -> RequestHead {
        let raw = format!("CONNECT x:1 HTTP/1.1\r\n{headers}\r\n");
        match http::parse_request_head(raw.as_bytes(), 8192) {
            Ok(Parsed::Complete { value, .. }) => value,
            other => panic!("{other:?}"),
        }
    }

    fn known() -> Vec<String> {
        vec![
            "X-Gardener-Destination".into(),
            "Reversed-VPN".into(),
            "X-Custom".into(),
        ]
    }

    /// `X-Forwarded-*` and `X-Envoy-*` lines go (any case), everything else stays byte for
    /// byte, the bytes after the head included.
    #[test]
    fn trusted_headers_are_stripped_from_a_forwarded_head() {
        let head = "CONNECT x:1 HTTP/1.1\r\nX-Gardener-Destination: a\r\nx-forwarded-for: 1.2.3.4\r\nX-Envoy-Original-Dst-Host: 10.0.0.1:443\r\nX-Other:  kept \r\nX-Forwardedness: kept\r\n\r\n";
        let mut buf = format!("{head}tail").into_bytes();
        let len = strip_trusted_headers(&mut buf, head.len());
        let want = "CONNECT x:1 HTTP/1.1\r\nX-Gardener-Destination: a\r\nX-Other:  kept \r\nX-Forwardedness: kept\r\n\r\n";
        assert_eq!(String::from_utf8_lossy(&buf[..len]), want);
        assert_eq!(&buf[len..], b"tail");
        // Nothing to strip: untouched.
        let mut plain = want.as_bytes().to_vec();
        assert_eq!(strip_trusted_headers(&mut plain, want.len()), want.len());
        assert_eq!(plain, want.as_bytes());
    }

    #[test]
    fn only_the_listeners_own_header_once_is_forwarded() {
        let own = "Reversed-VPN";
        let cases = [
            ("reversed-vpn: a\r\nHost: x\r\n", Ok(())),
            ("Host: x\r\n", Err("missing destination header")),
            (
                "Reversed-VPN: a\r\nREVERSED-VPN: a\r\n",
                Err("repeated destination header"),
            ),
            (
                "x-gardener-destination: b\r\n",
                Err("unexpected destination header"),
            ),
            (
                "Reversed-VPN: a\r\nX-Gardener-Destination: b\r\n",
                Err("unexpected destination header"),
            ),
            (
                "Reversed-VPN: a\r\nx-custom: b\r\n",
                Err("unexpected destination header"),
            ),
        ];
        for (headers, want) in cases {
            assert_eq!(
                forwardable(&head(headers), own, &known()),
                want,
                "{headers}"
            );
        }
    }

    #[test]
    fn every_configured_header_is_known_once() {
        let config = crate::config::parse::<crate::config::gateway::GatewayConfig>(
            std::path::Path::new("gateway.yaml"),
            b"apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {file: r.yaml}
listeners:
- {name: a, address: \"127.0.0.1:1\", protocol: http-connect}
- {name: b, address: \"127.0.0.1:2\", protocol: http-connect, destinationHeader: reversed-vpn}
- {name: c, address: \"127.0.0.1:3\", protocol: http-connect, destinationHeader: X-Custom}
- {name: d, address: \"127.0.0.1:4\", protocol: sni}
admin: {address: \"127.0.0.1:5\"}
",
        );
        let config = config.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(known_destination_headers(&config.listeners), known());
        // Gardener's two are known without a listener of their own.
        let config = crate::config::parse::<crate::config::gateway::GatewayConfig>(
            std::path::Path::new("gateway.yaml"),
            b"apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {file: r.yaml}
listeners:
- {name: c, address: \"127.0.0.1:3\", protocol: http-connect, destinationHeader: X-Custom}
admin: {address: \"127.0.0.1:5\"}
",
        );
        let config = config.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(known_destination_headers(&config.listeners), known());
    }
}
