//! Routes' `allowedSourceRanges` through the real gateway on every listener kind: clients
//! outside are refused before any backend is dialed (an `access_denied` alert, a `403`, a
//! close), counted as `denied` and access-logged; the address matched is a trusted load
//! balancer's PROXY source, else the peer, never a header the client writes itself.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use trellis::wire::proxy::encode_v2;
use trellis::wire::tls::testing::client_hello;

/// What an `sni` listener answers a refused client: a fatal `access_denied` alert.
const ACCESS_DENIED: [u8; 7] = [21, 3, 1, 0, 2, 2, 49];

/// An echo backend that counts the connections it accepted.
async fn counting_echo() -> (SocketAddr, Arc<AtomicUsize>) {
    counting_echo_at("127.0.0.1", b"").await
}

/// Connects, sends `bytes`, half-closes, and returns everything the gateway answers.
async fn send(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    s.shutdown().await.unwrap();
    read_all(&mut s, Duration::from_secs(10))
        .await
        .unwrap_or_default()
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

fn outcome(listener: &str, outcome: &str) -> String {
    format!("trellis_downstream_connections_total{{listener=\"{listener}\",outcome=\"{outcome}\"}}")
}

const HEAD: &str = "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n";

#[tokio::test(flavor = "multi_thread")]
async fn every_listener_kind_refuses_clients_outside_before_dialing() {
    let (closed_backend, closed_dials) = counting_echo().await;
    let (open_backend, _) = counting_echo().await;
    // The peer is always 127.0.0.1: `closed` and `fallback` leave it out, `open` has it.
    let routes = format!(
        "{HEAD}- name: closed
  sni: [closed.example.com]
  destinations: [closed]
  proxyDestinations: [\"240.0.0.1:443\"]
  backends: [{{address: \"{closed_backend}\"}}]
  allowedSourceRanges: [\"10.0.0.0/8\", \"2001:db8::/32\"]
- name: open
  sni: [open.example.com]
  destinations: [open]
  proxyDestinations: [\"240.0.0.2:443\"]
  backends: [{{address: \"{open_backend}\"}}]
  allowedSourceRanges: [\"127.0.0.0/8\"]
- name: fallback
  backends: [{{address: \"{closed_backend}\"}}]
  allowedSourceRanges: [\"192.0.2.0/24\"]
"
    );
    let gw = Gateway::start_listeners(
        &routes,
        &[
            ("sni", "sni", "  defaultRoute: fallback"),
            ("connect", "http-connect", ""),
            ("pd", "proxy-destination", ""),
        ],
        "",
    );

    // sni: an access_denied alert, for a matched route and for the default route alike.
    let closed = client_hello(Some("closed.example.com"), &[], 0);
    assert_eq!(send(gw.addr("sni"), &closed).await, ACCESS_DENIED);
    let unknown = client_hello(Some("unknown.example.com"), &[], 0);
    assert_eq!(send(gw.addr("sni"), &unknown).await, ACCESS_DENIED);
    let open = client_hello(Some("open.example.com"), &[], 0);
    assert_eq!(send(gw.addr("sni"), &open).await, open);
    // A real TLS client reports the alert as such.
    let (_, out) = run(
        Command::new("openssl").args([
            "s_client",
            "-connect",
            &gw.addr("sni").to_string(),
            "-servername",
            "closed.example.com",
        ]),
        b"",
        Duration::from_secs(20),
    );
    assert!(out.contains("access denied"), "openssl output:\n{out}");

    // http-connect: 403 naming no route, destination or address.
    let denied = send(
        gw.addr("connect"),
        b"CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: closed\r\n\r\nhi",
    )
    .await;
    let denied = String::from_utf8_lossy(&denied).into_owned();
    assert!(denied.starts_with("HTTP/1.1 403 "), "{denied}");
    for secret in [
        "closed".to_string(),
        "route".into(),
        "127.0.0.1".into(),
        closed_backend.port().to_string(),
        "10.0.0.0".into(),
    ] {
        assert!(!denied.contains(&secret), "{secret:?} in {denied}");
    }
    let served = send(
        gw.addr("connect"),
        b"CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: open\r\n\r\nhi",
    )
    .await;
    assert_eq!(served, b"HTTP/1.1 200 Connection established\r\n\r\nhi");

    // proxy-destination: closed. The header's source is the client's own claim: one inside
    // `closed`'s ranges does not open it, one outside `open`'s does not close it.
    let header = encode_v2(
        "10.0.0.5:40000".parse().unwrap(),
        "240.0.0.1:443".parse().unwrap(),
    );
    assert_eq!(send(gw.addr("pd"), &cat(&[&header, b"hi"])).await, b"");
    let header = encode_v2(
        "203.0.113.9:40000".parse().unwrap(),
        "240.0.0.2:443".parse().unwrap(),
    );
    assert_eq!(send(gw.addr("pd"), &cat(&[&header, b"hi"])).await, b"hi");

    for (listener, denied, routed) in [("sni", 3.0, 1.0), ("connect", 1.0, 1.0), ("pd", 1.0, 1.0)] {
        gw.wait_metric(&outcome(listener, "denied"), |v| v == denied);
        gw.wait_metric(&outcome(listener, "routed"), |v| v == routed);
    }
    assert_eq!(
        closed_dials.load(Ordering::SeqCst),
        0,
        "a refused client must not reach the backend"
    );
    assert_eq!(
        gw.metric("trellis_route_connections_total{route=\"closed\"}"),
        0.0
    );
    for (listener, route, target) in [
        ("sni", "closed", "closed.example.com"),
        ("sni", "fallback", "unknown.example.com"),
        ("connect", "closed", "closed"),
        ("pd", "closed", "240.0.0.1:443"),
    ] {
        let line = gw.wait_access_log(|l| {
            l["listener"] == listener && l["route"] == route && l["target_name"] == target
        });
        assert_eq!(line["reason"], "denied", "{line}");
        assert_eq!(line["backend"], "-", "{line}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trusted_load_balancers_proxy_source_decides() {
    let (remote_backend, remote_dials) = counting_echo().await;
    let (local_backend, _) = counting_echo().await;
    let routes = format!(
        "{HEAD}- name: remote
  sni: [remote.example.com]
  proxyDestinations: [\"240.0.0.3:443\"]
  backends: [{{address: \"{remote_backend}\"}}]
  allowedSourceRanges: [\"192.0.2.0/24\", \"2001:db8::/32\"]
- name: local
  sni: [local.example.com]
  backends: [{{address: \"{local_backend}\"}}]
  allowedSourceRanges: [\"127.0.0.0/8\"]
"
    );
    let gw = Gateway::start_listeners(
        &routes,
        &[
            (
                "lb",
                "sni",
                "  proxyProtocol: {mode: optional, trustedSources: [\"127.0.0.0/8\"]}",
            ),
            (
                "untrusted",
                "sni",
                "  proxyProtocol: {mode: optional, trustedSources: [\"10.0.0.0/8\"]}",
            ),
            (
                "lbpd",
                "proxy-destination",
                "  proxyProtocol: {mode: required, trustedSources: [\"127.0.0.0/8\"]}",
            ),
        ],
        "",
    );
    let remote = client_hello(Some("remote.example.com"), &[], 0);
    let local = client_hello(Some("local.example.com"), &[], 0);
    let v2 = |source: &str, destination: &str| {
        encode_v2(source.parse().unwrap(), destination.parse().unwrap())
    };
    let lb = gw.addr("lb");
    // (header, hello, served): the peer is 127.0.0.1 throughout; only the source counts.
    let cases: Vec<(Vec<u8>, &[u8], bool)> = vec![
        (
            b"PROXY TCP4 192.0.2.5 127.0.0.1 1234 443\r\n".to_vec(),
            &remote,
            true,
        ),
        (
            b"PROXY TCP4 198.51.100.1 127.0.0.1 1234 443\r\n".to_vec(),
            &remote,
            false,
        ),
        (v2("192.0.2.6:1", "127.0.0.1:443"), &remote, true),
        (v2("198.51.100.2:1", "127.0.0.1:443"), &remote, false),
        (v2("[2001:db8::7]:1", "[::1]:443"), &remote, true),
        (v2("[2001:db9::7]:1", "[::1]:443"), &remote, false),
        // IPv4-mapped IPv6 is matched as the IPv4 address it carries.
        (
            v2("[::ffff:192.0.2.9]:1", "[::ffff:127.0.0.1]:443"),
            &remote,
            true,
        ),
        (
            b"PROXY TCP6 ::ffff:198.51.100.3 ::1 1 443\r\n".to_vec(),
            &remote,
            false,
        ),
        // The peer is inside `local`'s ranges, the PROXY source is not: refused.
        (
            b"PROXY TCP4 192.0.2.5 127.0.0.1 1234 443\r\n".to_vec(),
            &local,
            false,
        ),
        (v2("192.0.2.6:1", "127.0.0.1:443"), &local, false),
        // No header (optional mode): the peer is the client.
        (Vec::new(), &local, true),
        (Vec::new(), &remote, false),
    ];
    let (mut served, mut denied) = (0.0, 0.0);
    for (i, (header, hello, ok)) in cases.iter().enumerate() {
        let got = send(lb, &cat(&[header, hello])).await;
        if *ok {
            assert_eq!(got, *hello, "case {i} must be served");
            served += 1.0;
        } else {
            assert_eq!(got, ACCESS_DENIED, "case {i} must be refused");
            denied += 1.0;
        }
    }
    gw.wait_metric(&outcome("lb", "denied"), |v| v == denied);
    gw.wait_metric(&outcome("lb", "routed"), |v| v == served);
    let line = gw.wait_access_log(|l| {
        l["listener"] == "lb" && l["reason"] == "denied" && l["client"] == "198.51.100.1:1234"
    });
    assert_eq!(line["route"], "remote");
    assert!(line["peer"].as_str().unwrap().starts_with("127.0.0.1:"));

    // An untrusted peer's header is not honoured (the listener treats it as off): it is
    // not TLS, and never reaches the route it names a source for.
    let dials = remote_dials.load(Ordering::SeqCst);
    let spoofed = cat(&[b"PROXY TCP4 192.0.2.5 127.0.0.1 1234 443\r\n", &remote]);
    assert_eq!(send(gw.addr("untrusted"), &spoofed).await, b"");
    gw.wait_metric(&outcome("untrusted", "not_tls"), |v| v == 1.0);
    assert_eq!(gw.metric(&outcome("untrusted", "routed")), 0.0);

    // proxy-destination behind a trusted load balancer: its PROXY source decides, not the
    // source in the GEP-08 header that follows.
    let gep08 = |source: &str| v2(source, "240.0.0.3:443");
    let inside = cat(&[
        b"PROXY TCP4 192.0.2.5 127.0.0.1 1 443\r\n",
        &gep08("10.96.0.1:40000"),
        b"hi",
    ]);
    assert_eq!(send(gw.addr("lbpd"), &inside).await, b"hi");
    let outside = cat(&[
        b"PROXY TCP4 198.51.100.1 127.0.0.1 1 443\r\n",
        &gep08("192.0.2.5:40000"),
        b"hi",
    ]);
    assert_eq!(send(gw.addr("lbpd"), &outside).await, b"");
    gw.wait_metric(&outcome("lbpd", "denied"), |v| v == 1.0);
    gw.wait_metric(&outcome("lbpd", "routed"), |v| v == 1.0);
    // The served ones only: the refused and the spoofed never dialed.
    assert_eq!(
        remote_dials.load(Ordering::SeqCst),
        dials + 1,
        "only the admitted proxy-destination client reaches the backend"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn ipv6_peers_match_ipv6_ranges() {
    let (backend, _) = counting_echo().await;
    let routes = format!(
        "{HEAD}- name: six
  sni: [six.example.com]
  backends: [{{address: \"{backend}\"}}]
  allowedSourceRanges: [\"::1/128\"]
- name: four
  sni: [four.example.com]
  backends: [{{address: \"{backend}\"}}]
  allowedSourceRanges: [\"127.0.0.0/8\", \"0.0.0.0/0\"]
"
    );
    let gw = Gateway::start_listeners(&routes, &[("v6", "sni", ""), ("v4", "sni", "")], "");
    assert!(gw.addr("v6").is_ipv6());
    let six = client_hello(Some("six.example.com"), &[], 0);
    let four = client_hello(Some("four.example.com"), &[], 0);
    assert_eq!(send(gw.addr("v6"), &six).await, six);
    // IPv4 networks, even 0.0.0.0/0, admit no IPv6 client; ::1/128 admits no IPv4 one.
    assert_eq!(send(gw.addr("v6"), &four).await, ACCESS_DENIED);
    assert_eq!(send(gw.addr("v4"), &six).await, ACCESS_DENIED);
    assert_eq!(send(gw.addr("v4"), &four).await, four);
    gw.wait_metric(&outcome("v6", "denied"), |v| v == 1.0);
    gw.wait_metric(&outcome("v4", "denied"), |v| v == 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn reloaded_ranges_apply_to_new_connections_only() {
    let (backend, _) = counting_echo().await;
    let table = |ranges: &str| {
        format!(
            "{HEAD}- name: r\n  sni: [r.example.com]\n  backends: [{{address: \"{backend}\"}}]\n{ranges}"
        )
    };
    let gw = Gateway::start(&table("  allowedSourceRanges: [\"127.0.0.0/8\"]\n"), "");
    let hello = client_hello(Some("r.example.com"), &[], 0);
    // An established connection, admitted by the first table.
    let mut held = TcpStream::connect(gw.tls).await.unwrap();
    held.write_all(&hello).await.unwrap();
    let mut echo = vec![0u8; hello.len()];
    tokio::io::AsyncReadExt::read_exact(&mut held, &mut echo)
        .await
        .unwrap();

    gw.write_routes(&table("  allowedSourceRanges: [\"10.0.0.0/8\"]\n"));
    gw.wait_metric("trellis_routing_table_generation", |v| v == 2.0);
    assert_eq!(send(gw.tls, &hello).await, ACCESS_DENIED);
    let (_, body) = http_get(gw.debug, "/routes").unwrap();
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        json["routes"][0]["allowedSourceRanges"],
        serde_json::json!(["10.0.0.0/8"])
    );
    // An empty list is rejected: the last good table (still closed to us) stays.
    gw.write_routes(&table("  allowedSourceRanges: []\n"));
    gw.wait_metric(
        "trellis_routing_table_reloads_total{result=\"rejected\"}",
        |v| v == 1.0,
    );
    assert_eq!(send(gw.tls, &hello).await, ACCESS_DENIED);
    // The held connection keeps the route it was accepted with.
    held.write_all(b"still").await.unwrap();
    let mut more = [0u8; 5];
    tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::AsyncReadExt::read_exact(&mut held, &mut more),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(&more, b"still");

    // Without the field, every client is admitted again.
    gw.write_routes(&table(""));
    gw.wait_metric("trellis_routing_table_generation", |v| v == 3.0);
    assert_eq!(send(gw.tls, &hello).await, hello);
    let (_, body) = http_get(gw.debug, "/routes").unwrap();
    assert!(!body.contains("allowedSourceRanges"), "{body}");
    gw.wait_metric(&outcome("tls", "denied"), |v| v == 2.0);
}
