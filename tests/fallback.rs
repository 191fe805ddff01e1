//! Handing traffic to a fallback proxy (the seed's Envoy gateway) with real peers: a route's
//! `forwardConnect` (the CONNECT head goes to the backend as the client sent it, and the
//! backend answers) and `sendProxyProtocol` (the backend learns the client and the address
//! it reached). A second trellis gateway stands in for Envoy: it takes the PROXY header
//! from the front gateway as a trusted load balancer's and admits by its source.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![allow(clippy::unwrap_used, unreachable_pub)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use trellis::wire::{Parsed, proxy};

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
/// exactly as received and the bytes after it. The client hears the backend's answer only;
/// a backend that cannot be reached gets the front's own 502.
#[tokio::test(flavor = "multi_thread")]
async fn a_forwarded_connect_is_replayed_byte_for_byte_after_the_header() {
    const REPLY: &[u8] = b"HTTP/1.1 407 Proxy Authentication Required\r\ncontent-length: 0\r\n\r\n";
    let head = format!(
        "CONNECT x:1 HTTP/1.0\r\nx-gardener-destination: {UNKNOWN}\r\nX-Other:  kept  as is\r\n\r\n"
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
        let mut backend = RawBackend::start(REPLY, usize::MAX).await;
        let front = front_gateway(
            backend.addr,
            "  forwardConnect: true\n  sendProxyProtocol: v1\n",
            "  proxyProtocol: {mode: optional, trustedSources: [\"127.0.0.0/8\"]}",
        );
        let addr = front.addr("connect");
        let mut c = connect_from([127, 0, 0, 5], addr).await;
        let client = c.local_addr().unwrap();
        let sent = format!("{}{head}tail", lb.unwrap_or(""));
        c.write_all(sent.as_bytes()).await.unwrap();
        c.shutdown().await.unwrap();
        let answer = read_all(&mut c, Duration::from_secs(10)).await.unwrap();
        assert_eq!(
            String::from_utf8_lossy(&answer),
            String::from_utf8_lossy(REPLY)
        );
        let got = String::from_utf8(backend.next().await).unwrap();
        let want = want.map(str::to_owned).unwrap_or_else(|| {
            format!(
                "PROXY TCP4 127.0.0.5 127.0.0.1 {} {}\r\n",
                client.port(),
                addr.port()
            )
        });
        assert_eq!(got, format!("{want}{head}tail"));
    }

    // Nothing listens: the front answers itself.
    let closed = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let front = front_gateway(closed, "  forwardConnect: true\n", "");
    let mut c = connect_from([127, 0, 0, 5], front.addr("connect")).await;
    c.write_all(head.as_bytes()).await.unwrap();
    let answer = read_all(&mut c, Duration::from_secs(10)).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 502 "), "{answer}");
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
