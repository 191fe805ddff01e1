//! Handing traffic to a fallback proxy (the seed's Envoy gateway) with real peers: a route's
//! `forwardConnect` (the CONNECT head goes to the backend as the client sent it, and the
//! backend answers) and `sendProxyProtocol` (the backend learns the client and the address
//! it reached). A second trellis gateway stands in for Envoy: it takes the PROXY header
//! from the front gateway as a trusted load balancer's and admits by its source. Where
//! Envoy's own parsing matters (it routes by either destination header, and reads the next
//! CONNECT on a connection after refusing one), [`FakeEnvoy`] does.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::mpsc;
use trellis::wire::{Parsed, http, proxy};

const DEST: &str = "outbound|443||kube-apiserver.shoot--dev--l7.svc.cluster.local";
const UNKNOWN: &str = "outbound|443||kube-apiserver.shoot--dev--gone.svc.cluster.local";
const OK: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";
/// The back gateway's listener: PROXY headers from loopback peers (the front) are trusted.
const TRUST_LOOPBACK: &str = "  proxyProtocol: {mode: required, trustedSources: [\"127.0.0.0/8\"]}";

/// Connects to `to` from `from` (any port).
async fn connect_from(from: [u8; 4], to: SocketAddr) -> TcpStream {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(SocketAddr::from((from, 0))).unwrap();
    sock.set_nodelay(true).unwrap();
    sock.connect(to).await.unwrap()
}

fn connect_head(destination: &str) -> String {
    format!(
        "CONNECT api.l7.example.com:443 HTTP/1.1\r\nHost: api.l7.example.com:443\r\n\
         X-Gardener-Destination: {destination}\r\n\r\n"
    )
}

fn table(routes: &str) -> String {
    format!("apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n{routes}")
}

/// The "Envoy": a CONNECT listener that trusts the front's PROXY header, with one
/// destination admitted only from 127.0.0.5.
fn back_gateway(echo: SocketAddr) -> Gateway {
    Gateway::start_listeners(
        &table(&format!(
            "- name: l7
  destinations: [\"{DEST}\"]
  backends: [{{address: \"{echo}\"}}]
  allowedSourceRanges: [\"127.0.0.5/32\"]
"
        )),
        &[("connect", "http-connect", TRUST_LOOPBACK)],
        "",
    )
}

/// The front: an `http-connect` listener whose unknown destinations go to `backend` by
/// the default route `fallback-connect`.
fn front_gateway(backend: SocketAddr, route_extra: &str, listener_extra: &str) -> Gateway {
    Gateway::start_listeners(
        &table(&format!(
            "- name: fallback-connect
  backends: [{{address: \"{backend}\"}}]
{route_extra}"
        )),
        &[(
            "connect",
            "http-connect",
            &format!("  defaultRoute: fallback-connect\n{listener_extra}"),
        )],
        "",
    )
}

/// Reads exactly `n` bytes (or fails after 10 s).
async fn read_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut out))
        .await
        .expect("no answer in time")
        .unwrap();
    out
}

/// A CONNECT the front does not know reaches the back gateway as the client sent it, with
/// the client's address in a PROXY header: the back admits 127.0.0.5 and nobody else, and
/// its answer (the only one the client gets) comes back through the front.
#[tokio::test(flavor = "multi_thread")]
async fn a_forwarded_connect_reaches_the_back_gateway_as_the_client() {
    let echo = echo_backend().await;
    let back = back_gateway(echo);
    let front = front_gateway(
        back.addr("connect"),
        "  forwardConnect: true\n  sendProxyProtocol: v2\n",
        "",
    );
    let addr = front.addr("connect");

    // Admitted: the head and the bytes right after it, in one write.
    let mut c = connect_from([127, 0, 0, 5], addr).await;
    let client = c.local_addr().unwrap();
    c.write_all(format!("{}early bytes", connect_head(DEST)).as_bytes())
        .await
        .unwrap();
    let got = read_n(&mut c, OK.len() + 11).await;
    assert_eq!(
        String::from_utf8_lossy(&got),
        format!("{}early bytes", String::from_utf8_lossy(OK))
    );
    c.write_all(b"and more").await.unwrap();
    assert_eq!(read_n(&mut c, 8).await, b"and more");
    c.shutdown().await.unwrap();
    // Nothing else: one 200, the back's.
    assert_eq!(
        read_all(&mut c, Duration::from_secs(10)).await.unwrap(),
        b""
    );
    let line = front.wait_access_log(|l| l["client"] == client.to_string());
    assert_eq!(line["route"], "fallback-connect");
    assert_eq!(line["forwarded"], true);
    assert_eq!(line["target_name"], DEST);
    // The back saw the client through the header, the front as its peer.
    let line = back.wait_access_log(|l| l["client"] == client.to_string());
    assert_eq!(line["route"], "l7", "{line}");
    assert_eq!(line["proxy"], "v2");
    assert_eq!(line["forwarded"], false);
    assert_ne!(line["peer"], client.to_string());

    // A destination the back does not know: its 403, through the front.
    let mut c = connect_from([127, 0, 0, 5], addr).await;
    let unknown = c.local_addr().unwrap();
    c.write_all(connect_head(UNKNOWN).as_bytes()).await.unwrap();
    let answer = read_all(&mut c, Duration::from_secs(10)).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 403 "), "{answer}");
    let line = back.wait_access_log(|l| l["client"] == unknown.to_string());
    assert_eq!(line["reason"], "no_route", "{line}");
    drop(c);
    let line = front.wait_access_log(|l| l["client"] == unknown.to_string());
    assert_eq!(line["route"], "fallback-connect");

    // Another client address: denied by the back.
    let mut c = connect_from([127, 0, 0, 6], addr).await;
    let other = c.local_addr().unwrap();
    c.write_all(format!("{}early bytes", connect_head(DEST)).as_bytes())
        .await
        .unwrap();
    let answer = read_all(&mut c, Duration::from_secs(10)).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 403 "), "{answer}");
    assert!(!answer.contains("200"), "{answer}");
    let line = back.wait_access_log(|l| l["client"] == other.to_string());
    assert_eq!(line["reason"], "denied", "{line}");
}

/// What the backend of a forwarding route receives, byte for byte: the PROXY header (v1
/// here) with the client the front admits by — a trusted load balancer's PROXY source and
/// destination when it sent them, else the peer and the listener's address — then the head
/// exactly as received less the `X-Forwarded-*` and `X-Envoy-*` headers a client wrote (the
/// proxy behind would trust them from the gateway), and nothing more while it has not
/// accepted: a refusal (its answer,
/// byte for byte, is all the client hears) closes both sides, so the bytes the client sent
/// after the head never reach it. A backend that cannot be reached gets the front's own
/// 502, which the access log does not call forwarded.
#[tokio::test(flavor = "multi_thread")]
async fn a_forwarded_connect_is_replayed_byte_for_byte_after_the_header() {
    const REPLY: &[u8] = b"HTTP/1.1 407 Proxy Authentication Required\r\ncontent-length: 0\r\n\r\n";
    let head = format!(
        "CONNECT x:1 HTTP/1.0\r\nx-gardener-destination: {UNKNOWN}\r\nX-Other:  kept  as is\r\n\r\n"
    );
    // What the client sends: the same head with headers that speak for the gateway.
    let written = head.replacen(
        "X-Other:",
        "X-Forwarded-For: 10.1.2.3\r\nx-envoy-original-dst-host: 10.9.9.9:443\r\nX-Other:",
        1,
    );
    let cases = [
        // (load balancer header the client sends, header the backend must receive)
        (
            Some("PROXY TCP4 203.0.113.9 198.51.100.1 4444 8443\r\n"),
            Some("PROXY TCP4 203.0.113.9 198.51.100.1 4444 8443\r\n"),
        ),
        (None, None),
    ];
    for (lb, want) in cases {
        let mut backend = FakeEnvoy::start(|_| Answer::Refuse(REPLY)).await;
        let front = front_gateway(
            backend.addr,
            "  forwardConnect: true\n  sendProxyProtocol: v1\n",
            "  proxyProtocol: {mode: optional, trustedSources: [\"127.0.0.0/8\"]}",
        );
        let addr = front.addr("connect");
        let mut c = connect_from([127, 0, 0, 5], addr).await;
        let client = c.local_addr().unwrap();
        let sent = format!("{}{written}tail", lb.unwrap_or(""));
        c.write_all(sent.as_bytes()).await.unwrap();
        let answer = read_all(&mut c, Duration::from_secs(10)).await.unwrap();
        assert_eq!(
            String::from_utf8_lossy(&answer),
            String::from_utf8_lossy(REPLY)
        );
        let seen = backend.next().await;
        let want = want.map(str::to_owned).unwrap_or_else(|| {
            format!(
                "PROXY TCP4 127.0.0.5 127.0.0.1 {} {}\r\n",
                client.port(),
                addr.port()
            )
        });
        assert_eq!(
            String::from_utf8(seen.raw).unwrap(),
            format!("{want}{head}")
        );
        let line = front.wait_access_log(|l| l["peer"] == client.to_string());
        assert_eq!(line["reason"], "refused_by_backend", "{line}");
        assert_eq!(line["forwarded"], true, "{line}");
    }

    // Nothing listens (a socket bound, never listening, held so no one else gets the
    // port): the front answers itself, and forwarded nothing.
    let refusing = TcpSocket::new_v4().unwrap();
    refusing.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let closed = refusing.local_addr().unwrap();
    let front = front_gateway(closed, "  forwardConnect: true\n", "");
    let mut c = connect_from([127, 0, 0, 5], front.addr("connect")).await;
    let client = c.local_addr().unwrap();
    c.write_all(head.as_bytes()).await.unwrap();
    let answer = read_all(&mut c, Duration::from_secs(10)).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 502 "), "{answer}");
    let line = front.wait_access_log(|l| l["client"] == client.to_string());
    assert_eq!(line["reason"], "error:connect_failed", "{line}");
    assert_eq!(line["forwarded"], false, "{line}");
    drop(refusing);
}

/// A route without `forwardConnect` still answers the CONNECT itself, also with a PROXY
/// header to its backend: the backend gets the header and the bytes after the head only.
#[tokio::test(flavor = "multi_thread")]
async fn a_connect_answered_by_the_gateway_sends_the_header_before_the_tunnel() {
    let mut backend = RawBackend::start(b"", usize::MAX).await;
    let front = front_gateway(backend.addr, "  sendProxyProtocol: v2\n", "");
    let addr = front.addr("connect");
    let mut c = connect_from([127, 0, 0, 5], addr).await;
    let client = c.local_addr().unwrap();
    c.write_all(format!("{}tunnel bytes", connect_head(DEST)).as_bytes())
        .await
        .unwrap();
    assert_eq!(read_n(&mut c, OK.len()).await, OK);
    c.shutdown().await.unwrap();
    let got = backend.next().await;
    let Ok(Parsed::Complete { value, consumed }) = proxy::parse(&got, 4096) else {
        panic!("no PROXY header: {got:?}")
    };
    assert_eq!((value.version, value.addresses), (2, Some((client, addr))));
    assert_eq!(&got[consumed..], b"tunnel bytes");
}

/// The `sni` listener's fallback with `sendProxyProtocol`: a TLS client completes its
/// handshake with a backend behind a second gateway that admits by the header's source.
#[tokio::test(flavor = "multi_thread")]
async fn the_sni_fallback_passes_the_client_on_to_the_next_proxy() {
    let api = TlsBackend::start("l7", &["api.l7.example.com"]).await;
    let back = Gateway::start_listeners(
        &table(&format!(
            "- name: l7
  sni: [api.l7.example.com]
  backends: [{{address: \"{}\"}}]
  allowedSourceRanges: [\"127.0.0.5/32\"]
",
            api.addr
        )),
        &[("tls", "sni", TRUST_LOOPBACK)],
        "",
    );
    let front = Gateway::start_listeners(
        &table(&format!(
            "- name: fallback
  backends: [{{address: \"{}\"}}]
  sendProxyProtocol: v1
",
            back.addr("tls")
        )),
        &[("tls", "sni", "  defaultRoute: fallback")],
        "",
    );
    let get = |from: [u8; 4]| {
        let connector = trusting(&api);
        let addr = front.tls;
        async move {
            let tcp = connect_from(from, addr).await;
            let local = tcp.local_addr().unwrap();
            let name = rustls::pki_types::ServerName::try_from("api.l7.example.com").unwrap();
            let result = async {
                let mut tls =
                    tokio::time::timeout(Duration::from_secs(10), connector.connect(name, tcp))
                        .await??;
                tls.write_all(b"GET / HTTP/1.1\r\nHost: api.l7.example.com\r\n\r\n")
                    .await?;
                let mut out = Vec::new();
                let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out))
                    .await?;
                Ok::<_, std::io::Error>(String::from_utf8_lossy(&out).into_owned())
            }
            .await;
            (local, result)
        }
    };
    let (client, answer) = get([127, 0, 0, 5]).await;
    let answer = answer.unwrap();
    assert!(answer.ends_with("l7"), "{answer}");
    let line = back.wait_access_log(|l| l["client"] == client.to_string());
    assert_eq!(line["route"], "l7");
    assert_eq!(line["proxy"], "v1");

    let (other, answer) = get([127, 0, 0, 6]).await;
    assert!(answer.is_err(), "{answer:?}");
    let line = back.wait_access_log(|l| l["client"] == other.to_string());
    assert_eq!(line["reason"], "denied", "{line}");
}

/// On a `proxy-destination` listener the header sent on carries the destination the
/// client's header named (the routed 240.x address) and, as source, the client the gateway
/// admits by — never the source the client wrote itself.
#[tokio::test(flavor = "multi_thread")]
async fn a_proxy_destination_is_carried_through() {
    let mut backend = RawBackend::start(b"", usize::MAX).await;
    let front = Gateway::start_listeners(
        &table(&format!(
            "- name: gep08
  proxyDestinations: [\"240.1.2.3:443\"]
  backends: [{{address: \"{}\"}}]
  sendProxyProtocol: v2
",
            backend.addr
        )),
        &[("pd", "proxy-destination", "")],
        "",
    );
    let mut c = connect_from([127, 0, 0, 5], front.addr("pd")).await;
    let client = c.local_addr().unwrap();
    let mut sent = proxy::encode(
        proxy::ProxyVersion::V2,
        "100.64.0.7:5555".parse().unwrap(),
        "240.1.2.3:443".parse().unwrap(),
    );
    sent.extend_from_slice(b"client hello");
    c.write_all(&sent).await.unwrap();
    c.shutdown().await.unwrap();
    let got = backend.next().await;
    let Ok(Parsed::Complete { value, consumed }) = proxy::parse(&got, 4096) else {
        panic!("no PROXY header: {got:?}")
    };
    assert_eq!(
        value.addresses,
        Some((client, "240.1.2.3:443".parse().unwrap()))
    );
    assert_eq!(&got[consumed..], b"client hello");
}

/// How [`FakeEnvoy`] answers a CONNECT, by its destination.
#[derive(Clone, Copy)]
enum Answer {
    /// `200`, then echo everything.
    Accept,
    /// These bytes, then read the next CONNECT on the same connection (as Envoy's HTTP/1.1
    /// codec does after a `403`/`404`).
    Refuse(&'static [u8]),
    /// Nothing, ever: read until the peer closes.
    Silent,
}

/// What [`FakeEnvoy`] saw on one connection, reported when it closed.
#[derive(Debug, Default)]
struct Seen {
    /// Every byte received (PROXY header included).
    raw: Vec<u8>,
    /// The PROXY header's source, if one came.
    source: Option<SocketAddr>,
    /// Each CONNECT's destination: `Reversed-VPN`, else `X-Gardener-Destination` (Envoy's
    /// 8132 routes by either).
    keys: Vec<String>,
    /// Per CONNECT, how many bytes past its head had arrived when it was answered.
    unread_at_answer: Vec<usize>,
}

/// An Envoy-like CONNECT proxy: an optional PROXY header, then CONNECT heads in a loop on
/// each connection, each answered per `answer`.
struct FakeEnvoy {
    addr: SocketAddr,
    seen: mpsc::UnboundedReceiver<Seen>,
}

impl FakeEnvoy {
    async fn start(answer: fn(&str) -> Answer) -> FakeEnvoy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, seen) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _ = tx.send(envoy_connection(s, answer).await);
                });
            }
        });
        FakeEnvoy { addr, seen }
    }

    /// What the next connection to close saw.
    async fn next(&mut self) -> Seen {
        tokio::time::timeout(Duration::from_secs(10), self.seen.recv())
            .await
            .expect("no connection reached the fake Envoy")
            .unwrap()
    }
}

async fn envoy_connection(mut s: TcpStream, answer: fn(&str) -> Answer) -> Seen {
    let mut seen = Seen::default();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let mut after_proxy = false;
    loop {
        if !after_proxy {
            match proxy::detect(&buf) {
                proxy::Detect::NeedMore => {}
                proxy::Detect::NotProxy => after_proxy = true,
                proxy::Detect::Proxy => match proxy::parse(&buf, 4096) {
                    Ok(Parsed::Complete { value, consumed }) => {
                        seen.source = value.addresses.map(|(s, _)| s);
                        buf.drain(..consumed);
                        after_proxy = true;
                    }
                    Ok(Parsed::Incomplete) => {}
                    Err(_) => return seen,
                },
            }
        }
        if after_proxy && !buf.is_empty() {
            match http::parse_request_head(&buf, 8192) {
                Ok(Parsed::Complete { value, consumed }) => {
                    buf.drain(..consumed);
                    let key = value
                        .header_values("Reversed-VPN")
                        .chain(value.header_values("X-Gardener-Destination"))
                        .next()
                        .unwrap_or("")
                        .to_owned();
                    seen.unread_at_answer.push(buf.len());
                    let answer = answer(&key);
                    seen.keys.push(key);
                    match answer {
                        Answer::Refuse(bytes) => {
                            if s.write_all(bytes).await.is_err() {
                                return seen;
                            }
                            continue;
                        }
                        Answer::Accept => {
                            let _ = s.write_all(OK).await;
                            let _ = s.write_all(&buf).await;
                            loop {
                                match s.read(&mut chunk).await {
                                    Ok(0) | Err(_) => break,
                                    Ok(n) => {
                                        seen.raw.extend_from_slice(&chunk[..n]);
                                        let _ = s.write_all(&chunk[..n]).await;
                                    }
                                }
                            }
                            let _ = s.shutdown().await;
                            return seen;
                        }
                        Answer::Silent => {
                            while let Ok(n @ 1..) = s.read(&mut chunk).await {
                                seen.raw.extend_from_slice(&chunk[..n]);
                            }
                            return seen;
                        }
                    }
                }
                Ok(Parsed::Incomplete) => {}
                Err(_) => return seen,
            }
        }
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return seen,
            Ok(n) => {
                seen.raw.extend_from_slice(&chunk[..n]);
                buf.extend_from_slice(&chunk[..n]);
            }
        }
    }
}

/// A key the fake Envoy tunnels, as Envoy does for an L7 shoot trellis has no route for.
const OPEN: &str = DEST;
/// A key the ACL restricts: the front's route for it admits 127.0.0.9 only; Envoy, which
/// sees the front's address (no PROXY header), would tunnel it for anyone.
const RESTRICTED: &str = "outbound|1194||vpn-seed-server.shoot--dev--acl.svc.cluster.local";
const NOT_FOUND: &[u8] = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";

/// Envoy's answers: the open and the restricted keys are tunnelled, anything else is a 404
/// after which it reads the next CONNECT.
fn envoy_answer(key: &str) -> Answer {
    match key {
        OPEN | RESTRICTED => Answer::Accept,
        "silent" => Answer::Silent,
        "garbage" => Answer::Refuse(b"SSH-2.0-OpenSSH_9.6\r\n"),
        _ => Answer::Refuse(NOT_FOUND),
    }
}

/// A CONNECT head with these header lines.
fn head_with(headers: &str) -> String {
    format!("CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443\r\n{headers}\r\n")
}

/// A seed's front: `connect` (X-Gardener-Destination) and `legacy` (Reversed-VPN) fall
/// back to the fake Envoy by forwarding default routes, `custom` routes by a third header,
/// `plain` falls back to an echo backend that the gateway answers for; the restricted key
/// has a route of its own that admits 127.0.0.9 only.
async fn seed_front(envoy: SocketAddr) -> Gateway {
    let echo = echo_backend().await;
    Gateway::start_listeners(
        &table(&format!(
            "- name: fallback-connect
  backends: [{{address: \"{envoy}\"}}]
  forwardConnect: true
- name: fallback-connect-legacy
  backends: [{{address: \"{envoy}\"}}]
  forwardConnect: true
- name: restricted
  destinations: [\"{RESTRICTED}\"]
  backends: [{{address: \"{echo}\"}}]
  allowedSourceRanges: [\"127.0.0.9/32\"]
- name: plain
  backends: [{{address: \"{echo}\"}}]
"
        )),
        &[
            (
                "connect",
                "http-connect",
                "  defaultRoute: fallback-connect",
            ),
            (
                "legacy",
                "http-connect",
                "  destinationHeader: Reversed-VPN\n  defaultRoute: fallback-connect-legacy",
            ),
            (
                "custom",
                "http-connect",
                "  destinationHeader: X-Custom-Destination",
            ),
            ("plain", "http-connect", "  defaultRoute: plain"),
        ],
        "",
    )
}

/// Sends `head` from 127.0.0.5 and returns the whole answer (the connection closes).
async fn answer_to(addr: SocketAddr, head: &str) -> String {
    let mut c = connect_from([127, 0, 0, 5], addr).await;
    c.write_all(head.as_bytes()).await.unwrap();
    let answer = read_all(&mut c, Duration::from_secs(10)).await.unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// A CONNECT is forwarded only when it names its destination the way its listener routes:
/// the listener's header exactly once, none of the other destination headers the gateway
/// knows. Otherwise the fake Envoy (which routes by either Gardener header) would tunnel a
/// key that the front restricts. A default route that the gateway answers for still takes
/// a CONNECT without the header.
#[tokio::test(flavor = "multi_thread")]
async fn a_forwarded_connect_names_its_destination_only_the_listeners_way() {
    let mut envoy = FakeEnvoy::start(envoy_answer).await;
    let front = seed_front(envoy.addr).await;
    let (connect, legacy) = (front.addr("connect"), front.addr("legacy"));

    // The front's own rule holds for the key in the listener's header.
    let answer = answer_to(
        legacy,
        &head_with(&format!("Reversed-VPN: {RESTRICTED}\r\n")),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 403 "), "{answer}");

    let refused = [
        (legacy, format!("X-Gardener-Destination: {RESTRICTED}\r\n")),
        (legacy, format!("x-gardener-destination: {RESTRICTED}\r\n")),
        (
            legacy,
            format!("Reversed-VPN: {OPEN}\r\nX-Gardener-Destination: {RESTRICTED}\r\n"),
        ),
        (
            legacy,
            format!("Reversed-VPN: {OPEN}\r\nreversed-vpn: {OPEN}\r\n"),
        ),
        (legacy, String::new()),
        (
            connect,
            format!("X-Gardener-Destination: {OPEN}\r\nReversed-VPN: {RESTRICTED}\r\n"),
        ),
        (
            connect,
            format!("X-Gardener-Destination: {OPEN}\r\nx-custom-destination: {RESTRICTED}\r\n"),
        ),
    ];
    for (addr, headers) in &refused {
        let answer = answer_to(*addr, &head_with(headers)).await;
        assert!(answer.starts_with("HTTP/1.1 403 "), "{headers:?}: {answer}");
        assert!(!answer.contains("200"), "{headers:?}: {answer}");
    }
    front.wait_metric(
        "trellis_downstream_connections_total{listener=\"legacy\",outcome=\"no_route\"}",
        |v| v == 5.0,
    );
    front.wait_metric(
        "trellis_downstream_connections_total{listener=\"connect\",outcome=\"no_route\"}",
        |v| v == 2.0,
    );

    // The listener's header alone is forwarded, and it is the first CONNECT Envoy sees.
    let mut c = connect_from([127, 0, 0, 5], legacy).await;
    c.write_all(head_with(&format!("Reversed-VPN: {OPEN}\r\n")).as_bytes())
        .await
        .unwrap();
    assert_eq!(read_n(&mut c, OK.len()).await, OK);
    c.write_all(b"ping").await.unwrap();
    assert_eq!(read_n(&mut c, 4).await, b"ping");
    drop(c);
    assert_eq!(envoy.next().await.keys, [OPEN]);

    // A default route the gateway answers for takes a CONNECT without the header.
    let mut c = connect_from([127, 0, 0, 5], front.addr("plain")).await;
    c.write_all(format!("{}tunnel", head_with("")).as_bytes())
        .await
        .unwrap();
    let got = read_n(&mut c, OK.len() + 6).await;
    assert_eq!(
        String::from_utf8_lossy(&got),
        format!("{}tunnel", String::from_utf8_lossy(OK))
    );
}

/// After the backend refuses a forwarded CONNECT (Envoy answers and would read the next
/// CONNECT on the same connection), nothing more of the client's reaches it: neither a
/// second CONNECT pipelined behind the first nor one sent after the answer. When it
/// accepts, the bytes the client sent after the head follow the answer.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_forwarded_connect_ends_the_connection() {
    let mut envoy = FakeEnvoy::start(envoy_answer).await;
    let front = front_gateway(envoy.addr, "  forwardConnect: true\n", "");
    let addr = front.addr("connect");
    let first = connect_head(UNKNOWN);
    let second = connect_head(RESTRICTED);

    // Pipelined: one write.
    let mut c = connect_from([127, 0, 0, 5], addr).await;
    let client = c.local_addr().unwrap();
    c.write_all(format!("{first}{second}after").as_bytes())
        .await
        .unwrap();
    let answer = read_all(&mut c, Duration::from_secs(10)).await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&answer),
        String::from_utf8_lossy(NOT_FOUND)
    );
    let seen = envoy.next().await;
    assert_eq!(seen.keys, [UNKNOWN]);
    assert_eq!(String::from_utf8(seen.raw).unwrap(), first);
    let line = front.wait_access_log(|l| l["client"] == client.to_string());
    assert_eq!(line["reason"], "refused_by_backend", "{line}");
    assert_eq!(line["forwarded"], true, "{line}");

    // After the answer.
    let mut c = connect_from([127, 0, 0, 5], addr).await;
    c.write_all(first.as_bytes()).await.unwrap();
    assert_eq!(read_n(&mut c, NOT_FOUND.len()).await, NOT_FOUND);
    // The front may have closed already: the write may fail, the read end in a reset.
    let _ = c.write_all(second.as_bytes()).await;
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut rest))
        .await
        .expect("the connection stayed open");
    assert_eq!(String::from_utf8_lossy(&rest), "");
    assert_eq!(envoy.next().await.keys, [UNKNOWN]);
    front.wait_metric(
        "trellis_upstream_connect_failures_total{route=\"fallback-connect\",reason=\"refused_by_backend\"}",
        |v| v == 2.0,
    );

    // Accepted: the answer first, then the bytes held since the head.
    let mut c = connect_from([127, 0, 0, 5], addr).await;
    let open = connect_head(OPEN);
    c.write_all(format!("{open}early").as_bytes())
        .await
        .unwrap();
    let got = read_n(&mut c, OK.len() + 5).await;
    assert_eq!(
        String::from_utf8_lossy(&got),
        format!("{}early", String::from_utf8_lossy(OK))
    );
    c.write_all(b"more").await.unwrap();
    assert_eq!(read_n(&mut c, 4).await, b"more");
    c.shutdown().await.unwrap();
    assert_eq!(
        read_all(&mut c, Duration::from_secs(10)).await.unwrap(),
        b""
    );
    let seen = envoy.next().await;
    assert_eq!(seen.keys, [OPEN]);
    assert_eq!(seen.unread_at_answer, [0], "bytes came before the answer");
    assert_eq!(
        String::from_utf8(seen.raw).unwrap(),
        format!("{open}earlymore")
    );
}

/// A backend that does not answer within the handshake timeout gets the client a `504`,
/// one that answers something that is not HTTP a `502`; neither gets more than the head.
#[tokio::test(flavor = "multi_thread")]
async fn a_forwarded_connect_without_a_valid_answer_is_answered_by_the_gateway() {
    let mut envoy = FakeEnvoy::start(envoy_answer).await;
    let front = Gateway::start_listeners(
        &table(&format!(
            "- name: fallback-connect
  backends: [{{address: \"{}\"}}]
  forwardConnect: true
",
            envoy.addr
        )),
        &[(
            "connect",
            "http-connect",
            "  defaultRoute: fallback-connect",
        )],
        "timeouts: {handshake: 1s}",
    );
    let addr = front.addr("connect");
    for (key, status) in [("silent", "504"), ("garbage", "502")] {
        let head = connect_head(key);
        let answer = answer_to(addr, &format!("{head}tail")).await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status} ")),
            "{key}: {answer}"
        );
        let seen = envoy.next().await;
        assert_eq!(String::from_utf8(seen.raw).unwrap(), head, "{key}");
    }
    front.wait_metric(
        "trellis_upstream_connect_failures_total{route=\"fallback-connect\",reason=\"timeout\"}",
        |v| v == 1.0,
    );
}

/// On a listener that takes PROXY headers from trusted peers only, a header from any other
/// peer is the start of its request head, which is malformed: `400`, nothing forwarded, and
/// the header a forwarding route sends on carries the peer.
#[tokio::test(flavor = "multi_thread")]
async fn an_untrusted_peers_proxy_header_never_becomes_the_source_sent_on() {
    let mut envoy = FakeEnvoy::start(envoy_answer).await;
    let front = front_gateway(
        envoy.addr,
        "  forwardConnect: true\n  sendProxyProtocol: v2\n",
        "  proxyProtocol: {mode: optional, trustedSources: [\"10.0.0.0/8\"]}",
    );
    let addr = front.addr("connect");
    let forged: SocketAddr = "10.1.2.3:4444".parse().unwrap();
    let headers = [
        proxy::encode(proxy::ProxyVersion::V1, forged, addr),
        proxy::encode(proxy::ProxyVersion::V2, forged, addr),
    ];
    for header in headers {
        let mut c = connect_from([127, 0, 0, 5], addr).await;
        let mut sent = header;
        sent.extend_from_slice(connect_head(OPEN).as_bytes());
        c.write_all(&sent).await.unwrap();
        let answer = read_all(&mut c, Duration::from_secs(10)).await.unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    }
    let mut c = connect_from([127, 0, 0, 5], addr).await;
    let client = c.local_addr().unwrap();
    c.write_all(connect_head(OPEN).as_bytes()).await.unwrap();
    assert_eq!(read_n(&mut c, OK.len()).await, OK);
    drop(c);
    let seen = envoy.next().await;
    assert_eq!(seen.source, Some(client));
    assert_eq!(seen.keys, [OPEN]);
}
