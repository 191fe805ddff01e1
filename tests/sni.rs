//! `sni` listener end to end: real TLS clients (rustls with post-quantum key exchange,
//! openssl s_client, curl) reach real TLS backends through the gateway binary.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LABEL_NO_ROUTE: &str =
    "trellis_downstream_connections_total{listener=\"tls\",outcome=\"no_route\"}";

async fn two_backends() -> (TlsBackend, TlsBackend) {
    (
        TlsBackend::start("alpha", &["api.alpha.example.com"]).await,
        TlsBackend::start("beta", &["api.beta.example.com"]).await,
    )
}

/// A backend for one connection: reads to the client's half-close, writes `answer(bytes)`,
/// closes.
async fn answering_backend(
    answer: impl FnOnce(Vec<u8>) -> Vec<u8> + Send + 'static,
) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.unwrap();
        s.write_all(&answer(got)).await.unwrap();
        s.shutdown().await.unwrap();
    });
    addr
}

/// A table with one route, `name`, for server name `sni`, to `backend`.
fn one_route(name: &str, sni: &str, backend: std::net::SocketAddr) -> String {
    routes_yaml(&[R {
        name,
        sni: &[sni],
        backends: &[backend],
    }])
}

fn two_routes(a: &TlsBackend, b: &TlsBackend) -> String {
    routes_yaml(&[
        R {
            name: "alpha",
            sni: &["api.alpha.example.com"],
            backends: &[a.addr],
        },
        R {
            name: "beta",
            sni: &["api.beta.example.com"],
            backends: &[b.addr],
        },
    ])
}

#[tokio::test(flavor = "multi_thread")]
async fn rustls_post_quantum_hello_over_small_segments_reaches_each_backend() {
    let (a, b) = two_backends().await;
    let gw = Gateway::start(&two_routes(&a, &b), "");
    for backend in [&a, &b] {
        let sni = format!("api.{}.example.com", backend.name);
        // MSS 536: the ~1.3 KB post-quantum ClientHello crosses three TCP segments.
        let r = tls_get(gw.tls, &sni, backend, Some(536)).await.unwrap();
        assert_eq!(r.body, backend.name);
        assert_eq!(
            r.peer_cert, backend.cert_der,
            "client must see the backend's own certificate"
        );
        assert_eq!(
            r.group,
            Some(rustls::NamedGroup::X25519MLKEM768),
            "post-quantum key exchange"
        );
    }
    let sum = gw.metric("trellis_client_hello_bytes_sum{listener=\"tls\"}");
    assert!(
        sum > 2.0 * 1100.0,
        "ClientHellos should be post-quantum sized, sum {sum}"
    );
    assert_eq!(
        gw.metric("trellis_route_connections_total{route=\"alpha\"}"),
        1.0
    );
    assert_eq!(
        gw.metric("trellis_route_connections_total{route=\"beta\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn openssl_and_curl_reach_backends_by_sni() {
    let (a, b) = two_backends().await;
    let gw = Gateway::start(&two_routes(&a, &b), "");
    for backend in [&a, &b] {
        let sni = format!("api.{}.example.com", backend.name);
        let pem = backend.write_pem(&gw.dir);
        let (ok, out) = run(
            Command::new("openssl")
                .args([
                    "s_client",
                    "-ign_eof",
                    "-connect",
                    &gw.tls.to_string(),
                    "-servername",
                    &sni,
                    "-CAfile",
                ])
                .arg(&pem),
            format!("GET / HTTP/1.1\r\nHost: {sni}\r\n\r\n").as_bytes(),
            Duration::from_secs(20),
        );
        assert!(ok, "{out}");
        assert!(
            out.contains("Server certificate") && out.contains("Verify return code: 0 (ok)"),
            "openssl must verify the backend's certificate:\n{out}"
        );
        assert!(out.contains(&backend.name), "{out}");

        let port = gw.tls.port();
        let (ok, out) = run(
            Command::new("curl")
                .args([
                    "-sS",
                    "--max-time",
                    "10",
                    "--resolve",
                    &format!("{sni}:{port}:127.0.0.1"),
                    "--cacert",
                ])
                .arg(&pem)
                .arg(format!("https://{sni}:{port}/")),
            b"",
            Duration::from_secs(20),
        );
        assert!(ok, "curl failed: {out}");
        assert_eq!(
            out, backend.name,
            "curl verified against only this backend's certificate"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn hello_one_byte_per_write_and_three_records_is_routed_byte_exact() {
    let mut backend = RawBackend::start(b"from-backend", usize::MAX).await;
    let gw = Gateway::start(&one_route("raw", "api.raw.example.com", backend.addr), "");
    let hello = rustls_client_hello("api.raw.example.com");
    assert!(
        hello.len() > 1100,
        "rustls sends a post-quantum sized hello"
    );

    // One byte per write.
    let mut s = connect_with_mss(gw.tls, None).await.unwrap();
    for byte in &hello {
        s.write_all(std::slice::from_ref(byte)).await.unwrap();
        s.flush().await.unwrap();
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    s.write_all(b"trailing").await.unwrap();
    s.shutdown().await.unwrap();
    assert_eq!(
        read_all(&mut s, Duration::from_secs(10)).await.unwrap(),
        b"from-backend"
    );
    let mut expected = hello.clone();
    expected.extend_from_slice(b"trailing");
    assert_eq!(
        backend.next().await,
        expected,
        "every byte forwarded unchanged"
    );

    // The same hello re-split into three TLS records.
    let three = trellis::wire::tls::testing::resplit(&hello, 3);
    assert_eq!(three.len(), hello.len() + 10);
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    s.write_all(&three).await.unwrap();
    s.shutdown().await.unwrap();
    assert_eq!(
        read_all(&mut s, Duration::from_secs(10)).await.unwrap(),
        b"from-backend"
    );
    assert_eq!(backend.next().await, three);
}

#[tokio::test(flavor = "multi_thread")]
async fn wildcard_precedence_case_and_trailing_dot() {
    let mut exact = RawBackend::start(b"exact", 0).await;
    let mut long = RawBackend::start(b"long", 0).await;
    let mut short = RawBackend::start(b"short", 0).await;
    let routes = routes_yaml(&[
        R {
            name: "short",
            sni: &["*.example.com"],
            backends: &[short.addr],
        },
        R {
            name: "long",
            sni: &["*.Alpha.example.com"],
            backends: &[long.addr],
        },
        R {
            name: "exact",
            sni: &["api.alpha.example.com."],
            backends: &[exact.addr],
        },
    ]);
    let gw = Gateway::start(&routes, "");
    for (sni, want) in [
        ("API.ALPHA.example.com", "exact"),
        ("api.alpha.example.com.", "exact"),
        ("x.alpha.example.com", "long"),
        ("a.b.ALPHA.example.com.", "long"),
        ("beta.example.com", "short"),
    ] {
        let hello = trellis::wire::tls::testing::client_hello(Some(sni), &[], 0);
        let mut s = TcpStream::connect(gw.tls).await.unwrap();
        s.write_all(&hello).await.unwrap();
        let got = read_all(&mut s, Duration::from_secs(10)).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&got), want, "{sni}");
    }
    let _ = (exact.next().await, long.next().await, short.next().await);
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_sni_gets_unrecognized_name_alert_and_is_counted() {
    let (a, b) = two_backends().await;
    let gw = Gateway::start(&two_routes(&a, &b), "");
    let (_, out) = run(
        Command::new("openssl").args([
            "s_client",
            "-connect",
            &gw.tls.to_string(),
            "-servername",
            "nobody.example.com",
        ]),
        b"",
        Duration::from_secs(20),
    );
    assert!(
        out.contains("unrecognized name"),
        "openssl must report the alert:\n{out}"
    );
    gw.wait_metric(LABEL_NO_ROUTE, |v| v == 1.0);
    // No SNI at all, no default route: same answer.
    let hello = trellis::wire::tls::testing::client_hello(None, &[], 0);
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    s.write_all(&hello).await.unwrap();
    let got = read_all(&mut s, Duration::from_secs(5)).await.unwrap();
    assert_eq!(got, [21, 3, 1, 0, 2, 2, 112]);
    gw.wait_metric(LABEL_NO_ROUTE, |v| v == 2.0);
    assert_eq!(a.connections.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn default_route_takes_unmatched_traffic() {
    let mut fallback = RawBackend::start(b"fallback", 0).await;
    let routes = routes_yaml(&[R {
        name: "fallback",
        sni: &[],
        backends: &[fallback.addr],
    }]);
    let gw = Gateway::start_with(&routes, "", "  defaultRoute: fallback");
    let hello = trellis::wire::tls::testing::client_hello(Some("whatever.example.org"), &[], 0);
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    s.write_all(&hello).await.unwrap();
    assert_eq!(
        read_all(&mut s, Duration::from_secs(10)).await.unwrap(),
        b"fallback"
    );
    fallback.next().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn non_tls_is_closed_promptly_and_silent_client_times_out() {
    let (a, b) = two_backends().await;
    // The handshake timeout is long, so a prompt close cannot be the timeout.
    let gw = Gateway::start(&two_routes(&a, &b), "timeouts: {handshake: 30s}");
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let start = Instant::now();
    assert_eq!(read_all(&mut s, Duration::from_secs(5)).await.unwrap(), b"");
    assert!(start.elapsed() < Duration::from_secs(5));
    gw.wait_metric(
        "trellis_downstream_connections_total{listener=\"tls\",outcome=\"not_tls\"}",
        |v| v == 1.0,
    );

    // Malformed TLS: a handshake record that is not a ClientHello.
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    s.write_all(&[22, 3, 1, 0, 50, 2, 0, 0, 46]).await.unwrap();
    assert_eq!(read_all(&mut s, Duration::from_secs(5)).await.unwrap(), b"");
    gw.wait_metric(
        "trellis_downstream_connections_total{listener=\"tls\",outcome=\"bad_request\"}",
        |v| v == 1.0,
    );

    // An oversized hello (over maxClientHelloBytes = 16384 by default).
    let big = trellis::wire::tls::testing::client_hello(Some("api.alpha.example.com"), &[], 20_000);
    let big = trellis::wire::tls::testing::resplit(&big, 2);
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    let _ = s.write_all(&big).await;
    let _ = read_all(&mut s, Duration::from_secs(5)).await;
    gw.wait_metric(
        "trellis_downstream_connections_total{listener=\"tls\",outcome=\"bad_request\"}",
        |v| v == 2.0,
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn silent_client_is_closed_after_handshake_timeout() {
    let (a, b) = two_backends().await;
    let gw = Gateway::start(&two_routes(&a, &b), "timeouts: {handshake: 1s}");
    let mut silent = TcpStream::connect(gw.tls).await.unwrap();
    // Half a hello, then nothing.
    let mut partial = TcpStream::connect(gw.tls).await.unwrap();
    partial
        .write_all(&rustls_client_hello("api.alpha.example.com")[..300])
        .await
        .unwrap();
    let start = Instant::now();
    assert_eq!(
        read_all(&mut silent, Duration::from_secs(10))
            .await
            .unwrap(),
        b""
    );
    assert_eq!(
        read_all(&mut partial, Duration::from_secs(10))
            .await
            .unwrap(),
        b""
    );
    assert!(
        start.elapsed() >= Duration::from_millis(900),
        "closed by the timeout, not before"
    );
    gw.wait_metric(
        "trellis_downstream_connections_total{listener=\"tls\",outcome=\"timeout\"}",
        |v| v == 2.0,
    );
    // A client that connects and closes is counted as closed early.
    drop(TcpStream::connect(gw.tls).await.unwrap());
    gw.wait_metric(
        "trellis_downstream_connections_total{listener=\"tls\",outcome=\"closed_early\"}",
        |v| v == 1.0,
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn first_backend_refuses_second_serves() {
    let good = TlsBackend::start("good", &["api.fail.example.com"]).await;
    let dead = format!("127.0.0.1:{}", free_port());
    // The dead backend is in the gateway's own zone, so it is always tried first.
    let routes = format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- name: fail
  sni: [api.fail.example.com]
  backends:
  - {{address: \"{dead}\", zone: a}}
  - {{address: \"{}\", zone: b}}
",
        good.addr
    );
    let gw = Gateway::start(&routes, "zone: a");
    let r = tls_get(gw.tls, "api.fail.example.com", &good, None)
        .await
        .unwrap();
    assert_eq!(r.body, "good");
    assert_eq!(
        gw.metric("trellis_upstream_connect_failures_total{route=\"fail\",reason=\"refused\"}"),
        1.0
    );
    // The failed backend is now in back-off: the next connection goes straight to the good one.
    let r = tls_get(gw.tls, "api.fail.example.com", &good, None)
        .await
        .unwrap();
    assert_eq!(r.body, "good");
    assert_eq!(
        gw.metric("trellis_upstream_connect_failures_total{route=\"fail\",reason=\"refused\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn all_backends_down_closes_the_client() {
    let dead = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let gw = Gateway::start(&one_route("down", "down.example.com", dead), "");
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    s.write_all(&trellis::wire::tls::testing::client_hello(
        Some("down.example.com"),
        &[],
        0,
    ))
    .await
    .unwrap();
    assert_eq!(
        read_all(&mut s, Duration::from_secs(10)).await.unwrap(),
        b""
    );
    gw.wait_metric(
        "trellis_upstream_connect_failures_total{route=\"down\"",
        |v| v >= 1.0,
    );
    gw.wait_access_log(|l| l["reason"] == "error:connect_failed");
}

#[tokio::test(flavor = "multi_thread")]
async fn half_close_delivers_full_response() {
    // Backend: read to EOF, then answer with 1 MiB and close.
    let addr = answering_backend(|got| {
        let mut answer = format!("{}\n", got.len()).into_bytes();
        answer.extend(vec![b'x'; 1 << 20]);
        answer
    })
    .await;
    let gw = Gateway::start(&one_route("hc", "hc.example.com", addr), "");
    let hello = rustls_client_hello("hc.example.com");
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    s.write_all(&hello).await.unwrap();
    s.write_all(b"request").await.unwrap();
    s.shutdown().await.unwrap();
    let got = read_all(&mut s, Duration::from_secs(10)).await.unwrap();
    let header = format!("{}\n", hello.len() + 7);
    assert!(got.starts_with(header.as_bytes()));
    assert_eq!(
        got.len(),
        header.len() + (1 << 20),
        "the whole response after the client's half-close"
    );
    gw.wait_metric(
        "trellis_route_bytes_total{route=\"hc\",direction=\"tx\"}",
        |v| v == got.len() as f64,
    );
    assert_eq!(gw.metric("trellis_half_closed_connections"), 0.0);
}

/// A backend that never answers and never closes.
async fn holding_backend() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (s, _) = listener.accept().await.unwrap();
            held.push(s);
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread")]
async fn half_close_is_bounded_and_idle_connections_time_out() {
    let addr = holding_backend().await;
    let gw = Gateway::start(
        &one_route("hold", "hold.example.com", addr),
        "timeouts: {halfClose: 1s, idle: 2s}",
    );
    let hello = trellis::wire::tls::testing::client_hello(Some("hold.example.com"), &[], 0);
    // Half-closed by the client: closed by the half-close bound.
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    s.write_all(&hello).await.unwrap();
    s.shutdown().await.unwrap();
    gw.wait_metric("trellis_half_closed_connections", |v| v == 1.0);
    assert_eq!(
        read_all(&mut s, Duration::from_secs(10)).await.unwrap(),
        b""
    );
    gw.wait_metric("trellis_half_closed_connections", |v| v == 0.0);
    // Idle in both directions: closed by the idle timeout.
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    s.write_all(&hello).await.unwrap();
    let start = Instant::now();
    assert_eq!(
        read_all(&mut s, Duration::from_secs(10)).await.unwrap(),
        b""
    );
    assert!(start.elapsed() >= Duration::from_millis(1500));
    let logs = wait_for(Duration::from_secs(5), || {
        let l = gw.logs();
        l.contains("\"reason\":\"idle_timeout\"").then_some(l)
    });
    assert!(logs.is_some(), "{}", gw.logs());
}

/// A connection from `source` (a loopback address) to `to`, with `hello` sent.
async fn hello_from(source: &str, to: std::net::SocketAddr, hello: &[u8]) -> TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(format!("{source}:0").parse().unwrap()).unwrap();
    let mut s = sock.connect(to).await.unwrap();
    s.write_all(hello).await.unwrap();
    s
}

/// Whether `s` echoes `hello` back within two seconds.
async fn echoed(s: &mut TcpStream, hello: &[u8]) -> bool {
    let mut back = vec![0u8; hello.len()];
    matches!(
        tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut back)).await,
        Ok(Ok(_))
    ) && back == hello
}

/// Without `maxConnectionsPerSource`, one client address may hold half of `maxConnections`:
/// its other connections are refused and counted `limited`, and another address still gets
/// in at once. Set to 0, the first address takes the whole cap and the other waits.
#[tokio::test(flavor = "multi_thread")]
async fn one_address_holds_at_most_half_the_connection_cap_by_default() {
    let echo = echo_backend().await;
    let routes = routes_yaml(&[R {
        name: "r",
        sni: &["r.example.com"],
        backends: &[echo],
    }]);
    let hello = trellis::wire::tls::testing::client_hello(Some("r.example.com"), &[], 0);
    let limited = "trellis_downstream_connections_total{listener=\"tls\",outcome=\"limited\"}";

    let gw = Gateway::start(&routes, "limits: {maxConnections: 10}");
    let mut held = Vec::new();
    for _ in 0..10 {
        held.push(hello_from("127.0.0.2", gw.tls, &hello).await);
    }
    let mut served = 0;
    for s in &mut held {
        served += usize::from(echoed(s, &hello).await);
    }
    assert_eq!(served, 5, "connections served from one address");
    gw.wait_metric(limited, |v| v == 5.0);
    let mut other = hello_from("127.0.0.3", gw.tls, &hello).await;
    assert!(
        echoed(&mut other, &hello).await,
        "another address is kept out"
    );
    let logs = gw.logs();
    assert!(
        logs.contains("\"max_connections_per_source\":5"),
        "the start line says the limit: {logs}"
    );
    drop((held, other, gw));

    // Unlimited: the first address takes every place, the next waits in the backlog.
    let gw = Gateway::start(
        &routes,
        "limits: {maxConnections: 10, maxConnectionsPerSource: 0}",
    );
    let mut held = Vec::new();
    for _ in 0..10 {
        let mut s = hello_from("127.0.0.2", gw.tls, &hello).await;
        assert!(echoed(&mut s, &hello).await);
        held.push(s);
    }
    let mut other = hello_from("127.0.0.3", gw.tls, &hello).await;
    assert!(!echoed(&mut other, &hello).await, "served past the cap");
    assert_eq!(gw.metric(limited), 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn max_connection_duration_and_max_connections() {
    let echo = echo_backend().await;
    let routes = format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- name: short
  sni: [short.example.com]
  backends: [{{address: \"{echo}\"}}]
  maxConnectionDuration: 1s
"
    );
    // One client address opens all: without a per-source limit (0), it may take the cap.
    let gw = Gateway::start(
        &routes,
        "limits: {maxConnections: 2, maxConnectionsPerSource: 0}",
    );
    let hello = trellis::wire::tls::testing::client_hello(Some("short.example.com"), &[], 0);
    let mut a = TcpStream::connect(gw.tls).await.unwrap();
    a.write_all(&hello).await.unwrap();
    let mut b = TcpStream::connect(gw.tls).await.unwrap();
    b.write_all(&hello).await.unwrap();
    gw.wait_metric(
        "trellis_downstream_connections_active{listener=\"tls\"}",
        |v| v == 2.0,
    );
    // A third is over the limit: it is not accepted (it waits in the kernel's backlog, its
    // ClientHello unread), not accepted and closed, until a connection ends.
    let mut c = TcpStream::connect(gw.tls).await.unwrap();
    c.write_all(&hello).await.unwrap();
    let mut first = [0u8; 1];
    assert!(
        tokio::time::timeout(Duration::from_millis(500), c.read(&mut first))
            .await
            .is_err(),
        "answered or closed at the limit"
    );
    gw.wait_metric(
        "trellis_downstream_accept_paused_seconds_total{listener=\"tls\"}",
        |v| v > 0.0,
    );
    // Both echo connections are cut at their maximum lifetime.
    let mut buf = vec![0u8; hello.len()];
    a.read_exact(&mut buf).await.unwrap();
    assert_eq!(
        read_all(&mut a, Duration::from_secs(10)).await.unwrap(),
        b""
    );
    // Then the third is accepted and served, within its own lifetime.
    c.read_exact(&mut buf).await.unwrap();
    assert_eq!(buf, hello);
    assert_eq!(
        read_all(&mut c, Duration::from_secs(10)).await.unwrap(),
        b""
    );
    assert_eq!(
        gw.metric("trellis_downstream_connections_total{listener=\"tls\",outcome=\"limited\"}"),
        0.0
    );
    let _ = read_all(&mut b, Duration::from_secs(10)).await;
    gw.wait_access_log(|l| l["reason"] == "max_duration");
}

#[tokio::test(flavor = "multi_thread")]
async fn long_lived_connections_log_periodic_lines() {
    let echo = echo_backend().await;
    let gw = Gateway::start(
        &one_route("long", "long.example.com", echo),
        "accessLog: {interval: 1s}",
    );
    let hello = trellis::wire::tls::testing::client_hello(Some("long.example.com"), &[], 0);
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    s.write_all(&hello).await.unwrap();
    let mut back = vec![0u8; hello.len()];
    s.read_exact(&mut back).await.unwrap();
    // Open and active for a few intervals: interim lines carry the bytes so far.
    for _ in 0..5 {
        s.write_all(b"ping").await.unwrap();
        let mut b = [0u8; 4];
        s.read_exact(&mut b).await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let periodic = |gw: &Gateway| {
        gw.access_logs()
            .into_iter()
            .filter(|l| l["periodic"] == true)
            .collect::<Vec<_>>()
    };
    let lines = periodic(&gw);
    assert!(lines.len() >= 2, "{}", gw.logs());
    for l in &lines {
        assert_eq!(l["route"], "long");
        assert_eq!(l["reason"], "open");
        assert!(l["rx_bytes"].as_u64().unwrap() >= hello.len() as u64, "{l}");
    }
    drop(s);
    // The final line follows, and interim lines stop with the connection.
    let last = wait_for(Duration::from_secs(5), || {
        gw.access_logs()
            .into_iter()
            .find(|l| l["route"] == "long" && l["periodic"] == false)
    })
    .expect("a final line");
    assert_eq!(last["rx_bytes"].as_u64().unwrap(), hello.len() as u64 + 20);
    let count = periodic(&gw).len();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(periodic(&gw).len(), count, "no lines after the end");
}

/// The same in the other direction: a backend's urgent byte on a spliced download reaches
/// the client in place.
#[tokio::test(flavor = "multi_thread")]
async fn a_backends_urgent_data_is_forwarded_inline() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hello = rustls_client_hello("urg.example.com");
    let hello_len = hello.len();
    let (spliced_tx, spliced_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut got = vec![0u8; hello_len];
        s.read_exact(&mut got).await.unwrap();
        // 2 MiB: the download becomes a spliced bulk flow before the urgent byte comes.
        let bulk = vec![b'y'; 2 << 20];
        s.write_all(&bulk).await.unwrap();
        spliced_rx.await.unwrap();
        assert_eq!(
            socket2::SockRef::from(&s).send_out_of_band(b"!").unwrap(),
            1
        );
        s.write_all(&bulk).await.unwrap();
        s.shutdown().await.unwrap();
    });
    let gw = Gateway::start(&one_route("urg", "urg.example.com", addr), "");
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    s.write_all(&hello).await.unwrap();
    let spliced = async {
        urgent::spliced(|| gw.logs(), "backend").await;
        spliced_tx.send(()).unwrap();
    };
    let (got, ()) = tokio::join!(read_all(&mut s, Duration::from_secs(20)), spliced);
    let got = got.unwrap();
    let urgent_at = got.iter().position(|&b| b == b'!');
    assert_eq!(
        (got.len(), urgent_at),
        ((4 << 20) + 1, Some(2 << 20)),
        "every byte, the urgent one in place"
    );
}

/// A client's urgent byte on a spliced upload reaches the backend in place, and the upload
/// goes on.
#[tokio::test(flavor = "multi_thread")]
async fn urgent_data_on_a_spliced_flow_is_forwarded_inline() {
    // Backend: counts what it receives until the client's half-close, answers the count.
    let addr = answering_backend(|got| {
        // After the ClientHello (whose random bytes may contain anything).
        let hello_len = 5 + u16::from_be_bytes([got[3], got[4]]) as usize;
        let urgent_at = got[hello_len..].iter().position(|&b| b == b'!');
        format!("{} {urgent_at:?}", got.len()).into_bytes()
    })
    .await;
    let gw = Gateway::start(&one_route("urg", "urg.example.com", addr), "");
    let hello = rustls_client_hello("urg.example.com");
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    s.write_all(&hello).await.unwrap();
    // 2 MiB: the upload becomes a spliced bulk flow before the urgent byte comes.
    let bulk = vec![b'x'; 2 << 20];
    s.write_all(&bulk).await.unwrap();
    urgent::spliced(|| gw.logs(), "client").await;
    let sent = socket2::SockRef::from(&s).send_out_of_band(b"!").unwrap();
    assert_eq!(sent, 1);
    s.write_all(&bulk).await.unwrap();
    s.shutdown().await.unwrap();
    let got = read_all(&mut s, Duration::from_secs(10)).await.unwrap();
    let expected = hello.len() + (4 << 20) + 1;
    assert_eq!(
        String::from_utf8_lossy(&got),
        format!("{expected} Some({})", 2 << 20),
        "every byte, the urgent one in place, and no stall"
    );
}

/// The half-close bound is its own rule, not the idle timeout's: with `halfClose` far below
/// `idle`, a client that half-closes against a backend that neither answers nor closes is
/// closed one `halfClose` later, as `client_closed`.
#[tokio::test(flavor = "multi_thread")]
async fn half_close_bound_is_not_the_idle_timeout() {
    let addr = holding_backend().await;
    let gw = Gateway::start(
        &one_route("hold", "hold.example.com", addr),
        "timeouts: {halfClose: 2s, idle: 60s}",
    );
    let hello = trellis::wire::tls::testing::client_hello(Some("hold.example.com"), &[], 0);
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    s.write_all(&hello).await.unwrap();
    s.shutdown().await.unwrap();
    let start = Instant::now();
    assert_eq!(
        read_all(&mut s, Duration::from_secs(30)).await.unwrap(),
        b"",
        "closed long before the idle timeout"
    );
    let window = start.elapsed();
    assert!(
        window >= Duration::from_millis(1500) && window <= Duration::from_secs(10),
        "closed after {window:?}"
    );
    let line = gw.wait_access_log(|l| l["route"] == "hold" && l["periodic"] == false);
    assert_eq!(line["reason"], "client_closed", "{line}");
    let duration = line["duration_ms"].as_u64().unwrap();
    assert!(
        (2000..10_000).contains(&duration),
        "the connection lived one halfClose: {line}"
    );
    gw.wait_metric("trellis_half_closed_connections", |v| v == 0.0);
}

/// `TRELLIS_ZONE` wins over the file's `zone`: with it set, connections go to the backend in
/// its zone, not to the one in the file's; set but empty, the file's zone applies.
#[tokio::test(flavor = "multi_thread")]
async fn trellis_zone_in_the_environment_wins_over_the_files_zone() {
    let mut in_file_zone = RawBackend::start(b"FILE", 0).await;
    let mut in_env_zone = RawBackend::start(b"ENV", 0).await;
    let routes = format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- name: z
  sni: [z.example.com]
  backends:
  - {{address: \"{}\", zone: file-zone}}
  - {{address: \"{}\", zone: env-zone}}
",
        in_file_zone.addr, in_env_zone.addr
    );
    let answer = async |gw: &Gateway| {
        let mut s = TcpStream::connect(gw.tls).await.unwrap();
        s.write_all(&trellis::wire::tls::testing::client_hello(
            Some("z.example.com"),
            &[],
            0,
        ))
        .await
        .unwrap();
        read_all(&mut s, Duration::from_secs(10)).await.unwrap()
    };
    for (env, expected) in [("env-zone", &b"ENV"[..]), ("", &b"FILE"[..])] {
        let gw = Gateway::start_env(&routes, "zone: file-zone", &[("TRELLIS_ZONE", env)]);
        // Fewest active connections would alternate; the zone decides every time.
        for _ in 0..6 {
            assert_eq!(answer(&gw).await, expected, "TRELLIS_ZONE={env:?}");
        }
        let backend = if env.is_empty() {
            &mut in_file_zone
        } else {
            &mut in_env_zone
        };
        for _ in 0..6 {
            backend.next().await;
        }
    }
}
