//! `http-connect` and `proxy-destination` listeners and PROXY protocol input, with real
//! peers: curl (CONNECT tunnels, `--haproxy-protocol`), HAProxy (`send-proxy-v2`), rustls;
//! TCP urgent data across a forwarded CONNECT.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const DEST: &str = "outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local";
const VPN_DEST: &str = "outbound|1194||vpn-seed-server.shoot--dev--alpha.svc.cluster.local";

fn table(api: SocketAddr, vpn: SocketAddr) -> String {
    format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- name: alpha
  sni: [api.alpha.example.com]
  destinations: [\"{DEST}\"]
  proxyDestinations: [\"240.168.102.23:443\"]
  backends: [{{address: \"{api}\"}}]
- name: alpha-vpn
  destinations: [\"{VPN_DEST}\"]
  backends: [{{address: \"{vpn}\"}}]
"
    )
}

/// Sends `request` and returns everything the gateway answers until it closes.
async fn exchange(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(request).await;
    let out = read_all(&mut s, Duration::from_secs(10))
        .await
        .unwrap_or_default();
    String::from_utf8_lossy(&out).into_owned()
}

fn status_of(response: &str) -> u16 {
    response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn curl_proxytunnel_reaches_tls_backend() {
    let api = TlsBackend::start("alpha", &["api.alpha.example.com"]).await;
    let vpn = echo_backend().await;
    let gw = Gateway::start_listeners(
        &table(api.addr, vpn),
        &[("connect", "http-connect", "")],
        "",
    );
    let pem = api.write_pem(&gw.dir);
    let (ok, out) = run(
        Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "10",
                "-p",
                "-x",
                &format!("http://{}", gw.tls),
            ])
            .args([
                "--proxy-header",
                &format!("X-Gardener-Destination: {DEST}"),
                "--cacert",
            ])
            .arg(&pem)
            .arg("https://api.alpha.example.com/"),
        b"",
        Duration::from_secs(20),
    );
    assert!(ok, "curl through the CONNECT tunnel failed: {out}");
    assert_eq!(out, "alpha");
    let line = gw.wait_access_log(|l| l["route"] == "alpha");
    assert_eq!(line["target_name"], DEST);
    // curl and the backend both close once the response is complete; either may be first.
    assert!(
        matches!(
            line["reason"].as_str(),
            Some("backend_closed" | "client_closed")
        ),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn connect_200_only_after_backend_and_early_bytes_relayed() {
    let api = echo_backend().await;
    let vpn = echo_backend().await;
    let gw = Gateway::start_listeners(
        &table(api, vpn),
        &[
            ("connect", "http-connect", ""),
            (
                "legacy",
                "http-connect",
                "  destinationHeader: Reversed-VPN",
            ),
        ],
        "",
    );
    for (listener, version, header) in [
        ("connect", "1.1", "X-Gardener-Destination"),
        ("connect", "1.0", "x-gardener-destination"),
        ("legacy", "1.0", "reversed-vpn"),
    ] {
        let mut s = TcpStream::connect(gw.addr(listener)).await.unwrap();
        // The request head and the first tunnel bytes in one write.
        let req = format!(
            "CONNECT api.alpha.example.com.:1194 HTTP/{version}\r\n{header}: {VPN_DEST}\r\n\r\nEARLY"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let expected = b"HTTP/1.1 200 Connection established\r\n\r\nEARLY";
        let mut got = vec![0u8; expected.len()];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            got, expected,
            "exactly the 200 head, then the relayed bytes ({listener}, HTTP/{version})"
        );
        s.write_all(b" more").await.unwrap();
        let mut more = [0u8; 5];
        s.read_exact(&mut more).await.unwrap();
        assert_eq!(&more, b" more");
    }
    assert_eq!(
        gw.metric("trellis_route_connections_total{route=\"alpha-vpn\"}"),
        3.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn every_error_status_is_produced_and_closes() {
    let api = echo_backend().await;
    // Bound but not listening: connects are refused, and no other test can take the port.
    let held = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    held.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    let refused = held.local_addr().unwrap().as_socket().unwrap();
    // A listener whose accept queue is full: further SYNs are dropped, connects time out.
    let full = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    full.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    full.listen(0).unwrap();
    let full_addr = full.local_addr().unwrap().as_socket().unwrap();
    let mut fillers = Vec::new();
    for _ in 0..4 {
        if let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(full_addr)).await
        {
            fillers.push(s);
        }
    }
    let routes = format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- {{name: ok, destinations: [ok], backends: [{{address: \"{api}\"}}]}}
- {{name: refused, destinations: [refused], backends: [{{address: \"{refused}\"}}]}}
- {{name: blackhole, destinations: [blackhole], backends: [{{address: \"{full_addr}\"}}], timeouts: {{connect: 1s}}}}
"
    );
    let gw = Gateway::start_listeners(
        &routes,
        &[("connect", "http-connect", "")],
        "timeouts: {handshake: 1s}\nlimits: {maxHeaderBytes: 1024}",
    );
    let addr = gw.tls;
    let cases: Vec<(u16, Vec<u8>)> = vec![
        (403, b"CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: nowhere\r\n\r\n".to_vec()),
        (403, b"CONNECT x:443 HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),
        (405, b"GET / HTTP/1.1\r\nX-Gardener-Destination: ok\r\n\r\n".to_vec()),
        (431, format!("CONNECT x:443 HTTP/1.1\r\nX-Pad: {}\r\n\r\n", "a".repeat(2000)).into_bytes()),
        (400, b"CONNECT x:443 HTTP/2.0\r\n\r\n".to_vec()),
        (400, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03".to_vec()),
        (400, b"CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: ok\r\nX-Gardener-Destination: refused\r\n\r\n".to_vec()),
        (502, b"CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: refused\r\n\r\n".to_vec()),
        (504, b"CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: blackhole\r\n\r\n".to_vec()),
    ];
    // No answer names a route, a backend, an address or what the client asked for: the
    // access log and the metrics carry those.
    let leaks = |response: &str| {
        let secret = [
            "127.0.0.1".to_string(),
            api.port().to_string(),
            refused.port().to_string(),
            full_addr.port().to_string(),
            "route".into(),
            "\"refused\"".into(),
            "blackhole".into(),
            "nowhere".into(),
        ];
        secret
            .into_iter()
            .filter(|s| response.contains(s.as_str()))
            .collect::<Vec<_>>()
    };
    for (status, request) in cases {
        let response = exchange(addr, &request).await;
        assert_eq!(
            status_of(&response),
            status,
            "for {:?}: {response}",
            String::from_utf8_lossy(&request[..request.len().min(60)])
        );
        assert!(response.contains("Connection: close"), "{response}");
        assert_eq!(leaks(&response), Vec::<String>::new(), "{response}");
    }
    // 408: a head that never completes.
    let start = Instant::now();
    let response = exchange(addr, b"CONNECT x:443 HTTP/1.1\r\nX-Gar").await;
    assert_eq!(status_of(&response), 408, "{response}");
    assert_eq!(leaks(&response), Vec::<String>::new(), "{response}");
    assert!(start.elapsed() >= Duration::from_millis(900));
    // The access log names the backend each failed connect tried.
    for (route, backend) in [("refused", refused), ("blackhole", full_addr)] {
        gw.wait_access_log(|l| {
            l["route"] == route && l["backend"] == backend.to_string() && l["reason"] != "open"
        });
    }
    // Counted by outcome.
    let outcome = |o: &str| {
        format!("trellis_downstream_connections_total{{listener=\"connect\",outcome=\"{o}\"}}")
    };
    gw.wait_metric(&outcome("no_route"), |v| v == 2.0);
    gw.wait_metric(&outcome("bad_request"), |v| v == 5.0);
    gw.wait_metric(&outcome("timeout"), |v| v == 1.0);
    gw.wait_metric(&outcome("routed"), |v| v == 2.0);
    gw.wait_metric(
        "trellis_upstream_connect_failures_total{route=\"blackhole\",reason=\"timeout\"}",
        |v| v == 1.0,
    );
    // Each failure is logged with the backend, once per backend and interval: two more
    // refusals within it add no warning.
    for _ in 0..2 {
        let request = b"CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: refused\r\n\r\n";
        assert_eq!(status_of(&exchange(addr, request).await), 502);
    }
    let warnings = || {
        gw.logs()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|l| {
                l["level"] == "WARN"
                    && l["message"] == "connect failed"
                    && l["backend"] == refused.to_string()
            })
            .count()
    };
    let lines = wait_for(Duration::from_secs(10), || {
        let n = gw
            .access_logs()
            .iter()
            .filter(|l| l["route"] == "refused")
            .count();
        (n == 3).then_some(n)
    });
    assert_eq!(lines, Some(3), "{}", gw.logs());
    assert_eq!(warnings(), 1, "{}", gw.logs());
    drop(fillers);
}

/// HAProxy and the directory holding its config (removed on drop).
struct HaProxy(
    Child,
    #[expect(dead_code, reason = "held so that the directory outlives the process")] TestDir,
);

impl Drop for HaProxy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// HAProxy in TCP mode on `listen`, forwarding to `to` with `send-proxy-v2`.
fn haproxy_send_proxy_v2(listen: SocketAddr, to: SocketAddr) -> Option<HaProxy> {
    if Command::new("haproxy")
        .arg("-v")
        .stdout(Stdio::null())
        .status()
        .is_err()
    {
        common::skip(
            "haproxy_send_proxy_v2",
            "haproxy is not installed (scripts/test installs it)",
        );
        return None;
    }
    let dir = TestDir::new("haproxy");
    let cfg = dir.path("haproxy.cfg");
    std::fs::write(
        &cfg,
        format!(
            "global\n    maxconn 100\ndefaults\n    mode tcp\n    timeout connect 5s\n    timeout client 30s\n    timeout server 30s\n\
             frontend fe\n    bind {listen}\n    default_backend be\nbackend be\n    server gw {to} send-proxy-v2\n"
        ),
    )
    .unwrap();
    let child = Command::new("haproxy")
        .arg("-db")
        .arg("-f")
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Some(HaProxy(child, dir))
}

async fn connect_from(source: &str, to: SocketAddr) -> TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(format!("{source}:0").parse().unwrap()).unwrap();
    sock.connect(to).await.unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn haproxy_send_proxy_v2_source_is_the_client() {
    let api = echo_backend().await;
    let vpn = echo_backend().await;
    let gw = Gateway::start_listeners(
        &table(api, vpn),
        &[(
            "tls",
            "sni",
            "  proxyProtocol: {mode: required, trustedSources: [\"127.0.0.1/32\"]}",
        )],
        "limits: {maxConnectionsPerSource: 1}",
    );
    let front: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let Some(_haproxy) = haproxy_send_proxy_v2(front, gw.tls) else {
        return;
    };
    let up = wait_for(Duration::from_secs(10), || {
        std::net::TcpStream::connect(front).ok()
    });
    assert!(up.is_some(), "haproxy did not start");
    drop(up);

    let hello = trellis::wire::tls::testing::client_hello(Some("api.alpha.example.com"), &[], 0);
    // A client on 127.0.0.2: HAProxy connects from 127.0.0.1, the PROXY source is 127.0.0.2.
    let mut first = connect_from("127.0.0.2", front).await;
    first.write_all(&hello).await.unwrap();
    let mut back = vec![0u8; hello.len()];
    first.read_exact(&mut back).await.unwrap();
    assert_eq!(back, hello);
    // The per-source limit counts the PROXY source: a second client on 127.0.0.2 is refused,
    // one on 127.0.0.3 is not (all arrive from HAProxy's 127.0.0.1).
    let mut second = connect_from("127.0.0.2", front).await;
    second.write_all(&hello).await.unwrap();
    assert_eq!(
        read_all(&mut second, Duration::from_secs(10))
            .await
            .unwrap_or_default(),
        b""
    );
    gw.wait_metric(
        "trellis_downstream_connections_total{listener=\"tls\",outcome=\"limited\"}",
        |v| v == 1.0,
    );
    let mut third = connect_from("127.0.0.3", front).await;
    third.write_all(&hello).await.unwrap();
    third.read_exact(&mut back).await.unwrap();
    drop((first, third));
    let line = gw.wait_access_log(|l| {
        l["route"] == "alpha"
            && l["client"]
                .as_str()
                .is_some_and(|c| c.starts_with("127.0.0.2:"))
    });
    assert!(
        line["peer"].as_str().unwrap().starts_with("127.0.0.1:"),
        "{line}"
    );
    assert!(line["proxy"].as_str().unwrap().starts_with("v2"), "{line}");
    assert!(
        gw.metric("trellis_proxy_protocol_headers_total{listener=\"tls\",result=\"v2\"}") >= 3.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn curl_haproxy_protocol_v1_trusted_untrusted_and_required() {
    let api = TlsBackend::start("alpha", &["api.alpha.example.com"]).await;
    let vpn = echo_backend().await;
    let gw = Gateway::start_listeners(
        &table(api.addr, vpn),
        &[
            (
                "trusted",
                "sni",
                "  proxyProtocol: {mode: optional, trustedSources: [\"127.0.0.0/8\"]}",
            ),
            (
                "untrusted",
                "sni",
                "  proxyProtocol: {mode: optional, trustedSources: [\"10.0.0.0/8\"]}",
            ),
            (
                "required",
                "sni",
                "  proxyProtocol: {mode: required, trustedSources: [\"127.0.0.0/8\"]}",
            ),
        ],
        "",
    );
    let pem = api.write_pem(&gw.dir);
    // curl from 127.0.0.5 sends "PROXY TCP4 127.0.0.5 ..." before its ClientHello.
    let curl = |listener: SocketAddr, haproxy_protocol: bool| {
        let mut cmd = Command::new("curl");
        cmd.args(["-sS", "--max-time", "10", "--interface", "127.0.0.5"]);
        if haproxy_protocol {
            cmd.arg("--haproxy-protocol");
        }
        cmd.args([
            "--resolve",
            &format!("api.alpha.example.com:{}:127.0.0.1", listener.port()),
            "--cacert",
        ])
        .arg(&pem)
        .arg(format!(
            "https://api.alpha.example.com:{}/",
            listener.port()
        ));
        run(&mut cmd, b"", Duration::from_secs(20))
    };
    // Trusted: the v1 header is honoured and its source is the client.
    let (ok, out) = curl(gw.addr("trusted"), true);
    assert!(ok, "{out}");
    assert_eq!(out, "alpha");
    let line = gw.wait_access_log(|l| l["listener"] == "trusted" && l["route"] == "alpha");
    assert!(
        line["client"].as_str().unwrap().starts_with("127.0.0.5:"),
        "{line}"
    );
    assert_eq!(line["proxy"], "v1");
    gw.wait_metric(
        "trellis_proxy_protocol_headers_total{listener=\"trusted\",result=\"v1\"}",
        |v| v == 1.0,
    );
    // Optional mode without a header still works.
    let (ok, out) = curl(gw.addr("trusted"), false);
    assert!(ok && out == "alpha", "{out}");
    gw.wait_metric(
        "trellis_proxy_protocol_headers_total{listener=\"trusted\",result=\"absent\"}",
        |v| v == 1.0,
    );
    // Untrusted peer: the header is not honoured, so the stream is not TLS.
    let (ok, _) = curl(gw.addr("untrusted"), true);
    assert!(!ok);
    gw.wait_metric(
        "trellis_downstream_connections_total{listener=\"untrusted\",outcome=\"not_tls\"}",
        |v| v == 1.0,
    );
    assert_eq!(
        gw.metric("trellis_proxy_protocol_headers_total{listener=\"untrusted\""),
        0.0
    );
    // Required: a plain connection is rejected and counted; with the header it works.
    let (ok, _) = curl(gw.addr("required"), false);
    assert!(!ok);
    gw.wait_metric(
        "trellis_proxy_protocol_headers_total{listener=\"required\",result=\"missing\"}",
        |v| v == 1.0,
    );
    gw.wait_metric(
        "trellis_downstream_connections_total{listener=\"required\",outcome=\"bad_request\"}",
        |v| v == 1.0,
    );
    let (ok, out) = curl(gw.addr("required"), true);
    assert!(ok && out == "alpha", "{out}");
    // A load balancer health check (connect, close) is counted, not logged as an error.
    drop(TcpStream::connect(gw.addr("required")).await.unwrap());
    gw.wait_metric(
        "trellis_downstream_connections_total{listener=\"required\",outcome=\"closed_early\"}",
        |v| v == 1.0,
    );
    assert!(!gw.logs().contains("\"level\":\"ERROR\""), "{}", gw.logs());
}

/// A TLS client whose connection starts with `preamble` (a PROXY header).
async fn tls_after_preamble(
    addr: SocketAddr,
    preamble: &[u8],
    trust: &TlsBackend,
) -> std::io::Result<String> {
    let mut tcp = TcpStream::connect(addr).await?;
    tcp.write_all(preamble).await?;
    let connector = trusting(trust);
    let name = rustls::pki_types::ServerName::try_from("api.alpha.example.com").unwrap();
    let mut tls =
        tokio::time::timeout(Duration::from_secs(10), connector.connect(name, tcp)).await??;
    tls.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await?;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out)).await?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn proxy_destination_routes_by_header_destination() {
    let api = TlsBackend::start("alpha", &["api.alpha.example.com"]).await;
    let vpn = echo_backend().await;
    let gw = Gateway::start_listeners(
        &table(api.addr, vpn),
        &[("pd", "proxy-destination", "")],
        "",
    );
    // v2 header as trellis node sends it: source = the pod, destination = the advertise address.
    let v2 = trellis::wire::proxy::encode_v2(
        "10.96.0.10:40000".parse().unwrap(),
        "240.168.102.23:443".parse().unwrap(),
    );
    let body = tls_after_preamble(gw.tls, &v2, &api).await.unwrap();
    assert!(body.ends_with("alpha"), "{body}");
    // v1 works the same.
    let v1 = b"PROXY TCP4 10.96.0.11 240.168.102.23 40001 443\r\n";
    let body = tls_after_preamble(gw.tls, v1, &api).await.unwrap();
    assert!(body.ends_with("alpha"), "{body}");
    let line = gw.wait_access_log(|l| l["listener"] == "pd" && l["client"] == "10.96.0.11:40001");
    assert_eq!(line["target_name"], "240.168.102.23:443");

    // Unknown destination and LOCAL are rejected and counted.
    let unknown = trellis::wire::proxy::encode_v2(
        "10.96.0.10:40000".parse().unwrap(),
        "240.1.1.1:443".parse().unwrap(),
    );
    assert_eq!(exchange(gw.tls, &unknown).await, "");
    let local = b"\r\n\r\n\x00\r\nQUIT\n\x20\x00\x00\x00";
    assert_eq!(exchange(gw.tls, local).await, "");
    assert_eq!(exchange(gw.tls, b"\x16\x03\x01\x00\x05hello").await, "");
    let outcome = |o: &str| {
        format!("trellis_downstream_connections_total{{listener=\"pd\",outcome=\"{o}\"}}")
    };
    gw.wait_metric(&outcome("routed"), |v| v == 2.0);
    gw.wait_metric(&outcome("no_route"), |v| v == 1.0);
    gw.wait_metric(&outcome("bad_request"), |v| v == 2.0);
    gw.wait_metric(
        "trellis_proxy_protocol_headers_total{listener=\"pd\",result=\"local\"}",
        |v| v == 1.0,
    );
    gw.wait_metric(
        "trellis_proxy_protocol_headers_total{listener=\"pd\",result=\"missing\"}",
        |v| v == 1.0,
    );
}

/// A CONNECT proxy's answer.
const ANSWER: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";

/// A gateway whose `http-connect` listener forwards CONNECTs for `DEST` to `proxy`, a CONNECT
/// proxy.
fn forwarding_gateway(proxy: SocketAddr) -> Gateway {
    Gateway::start_listeners(
        &format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- name: proxied
  destinations: [\"{DEST}\"]
  backends: [{{address: \"{proxy}\"}}]
  forwardConnect: true
"
        ),
        &[("connect", "http-connect", "")],
        "",
    )
}

/// A CONNECT proxy that takes one connection, reads its request head and hands the stream
/// over without answering.
async fn connect_proxy() -> (SocketAddr, tokio::sync::oneshot::Receiver<TcpStream>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            s.read_exact(&mut byte).await.unwrap();
            head.push(byte[0]);
        }
        let _ = tx.send(s);
    });
    (addr, rx)
}

/// Opens a forwarded CONNECT through `gw`: the proxy's end once it has the request head.
async fn forwarded_connect(
    gw: &Gateway,
    proxy: tokio::sync::oneshot::Receiver<TcpStream>,
) -> (TcpStream, TcpStream) {
    let mut client = TcpStream::connect(gw.addr("connect")).await.unwrap();
    let head = format!("CONNECT api:443 HTTP/1.1\r\nX-Gardener-Destination: {DEST}\r\n\r\n");
    client.write_all(head.as_bytes()).await.unwrap();
    let proxy = tokio::time::timeout(Duration::from_secs(10), proxy)
        .await
        .expect("no forwarded CONNECT")
        .unwrap();
    (client, proxy)
}

/// Urgent data queued at the gateway before its backend, a CONNECT proxy, has accepted a
/// forwarded CONNECT: the client's 1,000 bytes and urgent byte wait at the gateway, and the
/// proxy's answer comes in one segment with its first tunnel bytes and its own urgent byte,
/// which the gateway reads before its relay starts. Every byte crosses in place, and the
/// streams go on.
#[tokio::test(flavor = "multi_thread")]
async fn urgent_data_queued_before_the_backend_accepted_crosses_the_gateway() {
    let (addr, proxy) = connect_proxy().await;
    let gw = forwarding_gateway(addr);
    let (mut client, mut proxy) = forwarded_connect(&gw, proxy).await;
    // A loopback send has reached the gateway's socket when it returns; the gateway reads
    // the client again only once the proxy has accepted.
    urgent::send_burst(&client, b"", b'x', 1000);
    urgent::send_burst(&proxy, ANSWER, b'y', 100);
    let mut answer = vec![0u8; ANSWER.len()];
    tokio::time::timeout(Duration::from_secs(10), client.read_exact(&mut answer))
        .await
        .expect("the answer in time")
        .unwrap();
    assert_eq!(answer, ANSWER);
    let (up, down) = tokio::join!(
        urgent::read_burst(&mut proxy, b'x', 1000),
        urgent::read_burst(&mut client, b'y', 100),
    );
    assert_eq!((&up, &down), (&Ok(()), &Ok(())), "{}", gw.logs());
    urgent::bulk_both_ways(&mut client, &mut proxy).await;
}

/// Urgent data arriving while the gateway relays, each way in one segment with 1,000 bytes
/// before it: every byte crosses in place, and the streams go on.
#[tokio::test(flavor = "multi_thread")]
async fn urgent_data_in_mid_stream_crosses_the_gateway() {
    let (addr, proxy) = connect_proxy().await;
    let gw = forwarding_gateway(addr);
    let (mut client, mut proxy) = forwarded_connect(&gw, proxy).await;
    proxy.write_all(ANSWER).await.unwrap();
    let mut answer = vec![0u8; ANSWER.len()];
    client.read_exact(&mut answer).await.unwrap();
    // The relay is running: a first exchange crosses each way.
    let mut four = [0u8; 4];
    client.write_all(b"ping").await.unwrap();
    proxy.read_exact(&mut four).await.unwrap();
    proxy.write_all(b"pong").await.unwrap();
    client.read_exact(&mut four).await.unwrap();
    assert_eq!(&four, b"pong");
    urgent::send_burst(&client, b"", b'x', 1000);
    urgent::send_burst(&proxy, b"", b'y', 1000);
    let (up, down) = tokio::join!(
        urgent::read_burst(&mut proxy, b'x', 1000),
        urgent::read_burst(&mut client, b'y', 1000),
    );
    assert_eq!((&up, &down), (&Ok(()), &Ok(())), "{}", gw.logs());
    urgent::bulk_both_ways(&mut client, &mut proxy).await;
}
