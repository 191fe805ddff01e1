//! Process lifecycle: graceful drain on SIGTERM, the drain deadline, and no descriptor leak
//! after thousands of concurrent connections.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn hello(sni: &str) -> Vec<u8> {
    trellis::wire::tls::testing::client_hello(Some(sni), &[], 0)
}

async fn open_echo(gw: &Gateway, sni: &str) -> TcpStream {
    let mut s = TcpStream::connect(gw.tls).await.unwrap();
    let h = hello(sni);
    s.write_all(&h).await.unwrap();
    let mut back = vec![0u8; h.len()];
    s.read_exact(&mut back).await.unwrap();
    s
}

async fn roundtrip(s: &mut TcpStream, msg: &[u8]) {
    s.write_all(msg).await.unwrap();
    let mut back = vec![0u8; msg.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back, msg);
}

fn wait_exit(gw: &mut Gateway, limit: Duration) -> std::process::ExitStatus {
    wait_for(limit, || gw.child.try_wait().unwrap())
        .unwrap_or_else(|| panic!("gateway did not exit:\n{}", gw.logs()))
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_then_exits_zero() {
    let echo = echo_backend().await;
    let mut gw = Gateway::start(
        &routes_yaml(&[R {
            name: "e",
            sni: &["e.example.com"],
            backends: &[echo],
        }]),
        "timeouts: {drain: 30s}",
    );
    let mut conn = open_echo(&gw, "e.example.com").await;
    roundtrip(&mut conn, b"before").await;

    gw.signal("TERM");
    // Readiness fails at once (the admin endpoint stays up during the drain).
    let not_ready = wait_for(Duration::from_secs(5), || {
        (http_get(gw.admin, "/ready")?.0 == 503).then_some(())
    });
    assert!(not_ready.is_some(), "/ready must turn 503 on SIGTERM");
    // Listeners are closed: new connections are refused.
    let refused = wait_for(Duration::from_secs(5), || {
        std::net::TcpStream::connect(gw.tls).is_err().then_some(())
    });
    assert!(refused.is_some(), "listener must close on SIGTERM");
    // The established connection still works.
    roundtrip(&mut conn, b"during drain").await;
    assert!(
        gw.child.try_wait().unwrap().is_none(),
        "must wait for the open connection"
    );
    conn.shutdown().await.unwrap();
    assert_eq!(
        read_all(&mut conn, Duration::from_secs(5)).await.unwrap(),
        b""
    );
    let status = wait_exit(&mut gw, Duration::from_secs(10));
    assert!(status.success(), "exit status {status}");
}

#[tokio::test(flavor = "multi_thread")]
async fn drain_deadline_closes_remaining_connections() {
    let echo = echo_backend().await;
    let mut gw = Gateway::start(
        &routes_yaml(&[R {
            name: "e",
            sni: &["e.example.com"],
            backends: &[echo],
        }]),
        "timeouts: {drain: 1s}",
    );
    let mut conn = open_echo(&gw, "e.example.com").await;
    let start = Instant::now();
    gw.signal("TERM");
    assert_eq!(
        read_all(&mut conn, Duration::from_secs(10)).await.unwrap(),
        b""
    );
    assert!(
        start.elapsed() >= Duration::from_millis(900),
        "not before the drain deadline"
    );
    let status = wait_exit(&mut gw, Duration::from_secs(10));
    assert!(status.success(), "exit status {status}");
    assert!(gw.logs().contains("\"reason\":\"drain\""), "{}", gw.logs());
}

/// After SIGTERM, readiness fails at once but the listeners keep accepting for the drain
/// delay: a client connecting every 50 ms (as a load balancer still sends them) is never
/// refused and is served; after the delay the listeners close.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_keeps_accepting_for_the_drain_delay() {
    let echo = echo_backend().await;
    let mut gw = Gateway::start(
        &routes_yaml(&[R {
            name: "e",
            sni: &["e.example.com"],
            backends: &[echo],
        }]),
        "timeouts: {drainDelay: 3s, drain: 30s}",
    );
    let start = Instant::now();
    gw.signal("TERM");
    let not_ready = wait_for(Duration::from_secs(2), || {
        (http_get(gw.admin, "/ready")?.0 == 503).then_some(())
    });
    assert!(not_ready.is_some(), "/ready must turn 503 at once");
    // Well inside the delay (which starts when the signal is handled, after `start`).
    let mut served = 0;
    while start.elapsed() < Duration::from_secs(2) {
        let mut s = TcpStream::connect(gw.tls).await.unwrap_or_else(|e| {
            panic!(
                "refused {:?} after SIGTERM, within the drain delay: {e}\n{}",
                start.elapsed(),
                gw.logs()
            )
        });
        let h = hello("e.example.com");
        s.write_all(&h).await.unwrap();
        let mut back = vec![0u8; h.len()];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(back, h, "served during the drain delay");
        served += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(served >= 10, "{served} clients");
    // Then the listeners close, and with no connection left the process exits.
    let refused = wait_for(Duration::from_secs(10), || {
        std::net::TcpStream::connect(gw.tls).is_err().then_some(())
    });
    assert!(refused.is_some(), "listeners close after the drain delay");
    let status = wait_exit(&mut gw, Duration::from_secs(10));
    assert!(status.success(), "exit status {status}");
}

/// Connections still open at the drain deadline are not all cut in the same instant: their
/// closes are spread over the window (1 s for a drain of 1 s), and the process still exits
/// within drain + window + its grace.
#[tokio::test(flavor = "multi_thread")]
async fn connections_left_at_the_deadline_are_closed_spread_over_a_window() {
    const N: usize = 40;
    let echo = echo_backend().await;
    let mut gw = Gateway::start(
        &routes_yaml(&[R {
            name: "e",
            sni: &["e.example.com"],
            backends: &[echo],
        }]),
        "timeouts: {drain: 1s}",
    );
    let mut conns = Vec::new();
    for _ in 0..N {
        conns.push(open_echo(&gw, "e.example.com").await);
    }
    let start = Instant::now();
    gw.signal("TERM");
    let closes: Vec<_> = conns
        .into_iter()
        .map(|mut c| {
            tokio::spawn(async move {
                assert_eq!(
                    read_all(&mut c, Duration::from_secs(20)).await.unwrap(),
                    b""
                );
                start.elapsed()
            })
        })
        .collect();
    let mut at = Vec::new();
    for c in closes {
        at.push(c.await.unwrap());
    }
    at.sort();
    let (first, last) = (at[0], at[N - 1]);
    assert!(
        first >= Duration::from_millis(900),
        "not before the deadline: {at:?}"
    );
    assert!(
        last - first >= Duration::from_millis(500),
        "closes spread over the 1 s window, not in one instant: {at:?}"
    );
    // Half of them neither in the first nor in the last quarter of the spread alone.
    let quarter = first + (last - first) / 4;
    assert!(
        at.iter().filter(|t| **t <= quarter).count() <= N / 2,
        "{at:?}"
    );
    // drain 1 s + window 1 s + grace 2 s, with room for a loaded machine.
    assert!(last < Duration::from_secs(8), "{at:?}");
    let status = wait_exit(&mut gw, Duration::from_secs(10));
    assert!(status.success(), "exit status {status}");
    let drained = gw
        .access_logs()
        .iter()
        .filter(|l| l["reason"] == "drain")
        .count();
    assert_eq!(drained, N, "{}", gw.logs());
}

/// A second gateway started with the same listener addresses (its own admin port) refuses to
/// start with a clear error instead of sharing the port through SO_REUSEPORT; the first keeps
/// serving, old and new connections alike.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_instance_on_the_same_addresses_refuses_to_start() {
    let echo = echo_backend().await;
    let gw = Gateway::start_listeners(
        &routes_yaml(&[R {
            name: "e",
            sni: &["e.example.com"],
            backends: &[echo],
        }]),
        &[("tls", "sni", ""), ("connect", "http-connect", "")],
        "workers: 2",
    );
    let mut before = open_echo(&gw, "e.example.com").await;
    let config = std::fs::read_to_string(gw.dir.path("gateway.yaml")).unwrap();
    let second_admin = format!("127.0.0.1:{}", free_port());
    let second = config.replace(&gw.admin.to_string(), &second_admin);
    assert_ne!(second, config);
    std::fs::write(gw.dir.path("second.yaml"), second).unwrap();
    let mut child = std::process::Command::new(BIN)
        .args(["gateway", "--config"])
        .arg(gw.dir.path("second.yaml"))
        .env("TRELLIS_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_for(Duration::from_secs(10), || child.try_wait().unwrap());
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the second gateway started next to the first");
    }
    assert!(!status.unwrap().success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(
        err.contains(&format!(
            "cannot bind listener tls on {}: another process already listens there",
            gw.tls
        )),
        "{err}"
    );
    // It never bound its admin port either.
    assert!(std::net::TcpStream::connect(&second_admin).is_err());
    // The first serves on: its ready probe, the old connection and every new one.
    assert_eq!(http_get(gw.admin, "/ready").unwrap().0, 200);
    roundtrip(&mut before, b"still here").await;
    for _ in 0..20 {
        let mut c = open_echo(&gw, "e.example.com").await;
        roundtrip(&mut c, b"new").await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_thousand_connections_leave_no_descriptors_behind() {
    trellis::net::socket::raise_nofile_limit().unwrap();
    let echo = echo_backend().await;
    let gw = Gateway::start(
        &routes_yaml(&[R {
            name: "e",
            sni: &["e.example.com"],
            backends: &[echo],
        }]),
        "",
    );
    let before = gw.fd_count();
    let h = hello("e.example.com");
    let mut conns = Vec::new();
    for chunk in 0..20 {
        let mut batch = Vec::new();
        for _ in 0..100 {
            let addr = gw.tls;
            let h = h.clone();
            batch.push(tokio::spawn(async move {
                let mut s = TcpStream::connect(addr).await.unwrap();
                s.write_all(&h).await.unwrap();
                let mut back = vec![0u8; h.len()];
                tokio::time::timeout(Duration::from_secs(20), s.read_exact(&mut back))
                    .await
                    .unwrap()
                    .unwrap();
                s
            }));
        }
        for t in batch {
            conns.push(t.await.unwrap_or_else(|e| panic!("batch {chunk}: {e}")));
        }
    }
    assert_eq!(conns.len(), 2000);
    gw.wait_metric(
        "trellis_downstream_connections_active{listener=\"tls\"}",
        |v| v == 2000.0,
    );
    assert!(
        gw.fd_count() >= 4000,
        "two descriptors per proxied connection: before {before}, now {}",
        gw.fd_count()
    );
    // Half close by the client, others by dropping.
    for (i, mut c) in conns.into_iter().enumerate() {
        if i % 2 == 0 {
            let _ = c.shutdown().await;
        }
    }
    gw.wait_metric(
        "trellis_downstream_connections_active{listener=\"tls\"}",
        |v| v == 0.0,
    );
    let after = wait_for(Duration::from_secs(10), || {
        let n = gw.fd_count();
        (n <= before).then_some(n)
    });
    assert!(
        after.is_some(),
        "descriptors before {before}, after {}",
        gw.fd_count()
    );
    assert_eq!(
        gw.metric("trellis_route_connections_total{route=\"e\"}"),
        2000.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_admin_connections_cannot_starve_readiness_probes() {
    let echo = echo_backend().await;
    let gw = Gateway::start(
        &routes_yaml(&[R {
            name: "e",
            sni: &["e.example.com"],
            backends: &[echo],
        }]),
        "",
    );
    // 200 idle connections from 127.0.0.1 that never send a request.
    let mut idle = Vec::new();
    for _ in 0..200 {
        if let Ok(s) = TcpStream::connect(gw.admin).await {
            idle.push(s);
        }
    }
    // A prober on another address is still answered, at once.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut probe = sock.connect(gw.admin).await.unwrap();
    probe
        .write_all(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let answer = read_all(&mut probe, Duration::from_secs(5)).await.unwrap();
    assert!(
        String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    // The idle ones are closed after the head deadline.
    let closed = tokio::time::timeout(Duration::from_secs(10), idle[0].read(&mut [0u8; 1])).await;
    assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
}

/// What a role says once something started: none of it may come before the error of a
/// start that fails.
const STARTED: [&str; 6] = [
    "applied",
    "listening",
    "ready",
    "started",
    "serving",
    "written",
];

/// `trellis --log-format json ROLE --config FILE`, which must fail to start (well within
/// the limit): its log, checked to hold `error` in an ERROR line and no line that says
/// something started.
fn fails_to_start_saying_nothing_started(role: &str, config: &std::path::Path, error: &[&str]) {
    let (ok, out) = run(
        std::process::Command::new(BIN)
            .args(["--log-format", "json", role, "--config"])
            .arg(config),
        b"",
        Duration::from_secs(30),
    );
    assert!(!ok, "{role} started:\n{out}");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|_| serde_json::json!({"message": l})))
        .collect();
    let failed = lines.iter().any(|l| {
        l["level"] == "ERROR"
            && l["message"]
                .as_str()
                .is_some_and(|m| error.iter().all(|e| m.contains(e)))
    });
    assert!(failed, "{role}: no ERROR line with {error:?}:\n{out}");
    for l in &lines {
        let message = l["message"].as_str().unwrap_or_default();
        assert!(
            l["level"] != "INFO" || !STARTED.iter().any(|s| message.contains(s)),
            "{role}: {message:?} said before the start failed:\n{out}"
        );
    }
}

/// Every role reads what it needs (keys, certificates, kubeconfigs, the resolver's
/// configuration) and binds its listeners before it says that anything started: a start
/// that fails on a missing or garbage key, a garbage certificate, a kubeconfig or a taken
/// port exits non-zero with the reason, and no line before it says "routing table applied",
/// "listening", "ready" or "started".
#[test]
fn a_start_that_fails_says_nothing_started_before_its_error() {
    let dir = TestDir::new("failed-start");
    let head = "apiVersion: trellis.gardener.cloud/v1alpha1\n";
    let ports = free_ports(8);
    std::fs::write(
        dir.path("routes.yaml"),
        routes_yaml(&[R {
            name: "e",
            sni: &["e.example.com"],
            backends: &["127.0.0.1:9".parse().unwrap()],
        }]),
    )
    .unwrap();
    std::fs::write(dir.path("garbage"), "garbage\n").unwrap();
    let gateway = |name: &str, listener: &str| {
        let file = dir.path(name);
        std::fs::write(
            &file,
            format!(
                "{head}kind: GatewayConfiguration
routes: {{file: routes.yaml}}
listeners:
- {{name: tls, address: \"127.0.0.1:{}\", protocol: sni}}
- {listener}
admin: {{address: \"127.0.0.1:{}\"}}
",
                ports[0], ports[1]
            ),
        )
        .unwrap();
        file
    };
    let wireguard = |key: &str| {
        format!(
            "{{name: wg, address: \"127.0.0.1:{}\", protocol: wireguard, wireguard: {{privateKeyFile: {key}}}}}",
            ports[2]
        )
    };
    fails_to_start_saying_nothing_started(
        "gateway",
        &gateway("missing-key.yaml", &wireguard("missing.key")),
        &["wireguard private key", "missing.key", "No such file"],
    );
    fails_to_start_saying_nothing_started(
        "gateway",
        &gateway("garbage-key.yaml", &wireguard("garbage")),
        &["wireguard private key", "not base64"],
    );
    let egress = format!(
        "{{name: egress, address: \"127.0.0.1:{}\", protocol: egress-connect, tls: {{certificateFile: garbage, keyFile: garbage, clientCAFile: garbage}}}}",
        ports[3]
    );
    fails_to_start_saying_nothing_started(
        "gateway",
        &gateway("garbage-certificate.yaml", &egress),
        &["listener TLS material", "no CERTIFICATE block"],
    );

    let agent = dir.path("agent.yaml");
    std::fs::write(
        &agent,
        format!(
            "{head}kind: AgentConfiguration
wireguard:
  privateKeyFile: missing.key
  addresses: [192.168.128.5]
  gateway:
    publicKey: \"VpmxjMXfskaV6NYIj5+qqYlGAzjGY3dLJYYw3f+mNVc=\"
    endpoints: [{{udp: \"127.0.0.1:{}\"}}]
networks: [\"10.0.0.0/8\"]
admin: {{address: \"127.0.0.1:{}\"}}
",
            ports[4], ports[5]
        ),
    )
    .unwrap();
    fails_to_start_saying_nothing_started("agent", &agent, &["private key", "No such file"]);

    // The node's listener is taken: it fails before its admin endpoint says it listens.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let node = dir.path("node.yaml");
    std::fs::write(
        &node,
        format!(
            "{head}kind: NodeConfiguration
listen: [\"{}\"]
upstream: {{address: \"127.0.0.1:9\", protocol: http-connect, destination: x}}
admin: {{address: \"127.0.0.1:{}\"}}
",
            taken.local_addr().unwrap(),
            ports[6]
        ),
    )
    .unwrap();
    fails_to_start_saying_nothing_started("node", &node, &["cannot bind listener"]);

    // The controller and the extension build their client before the admin endpoint.
    let controller = dir.path("controller.yaml");
    std::fs::write(
        &controller,
        format!(
            "{head}kind: ControllerConfiguration
kubeconfig: missing.kubeconfig
output: {{file: routes.json}}
admin: {{address: \"127.0.0.1:{}\"}}
",
            ports[7]
        ),
    )
    .unwrap();
    fails_to_start_saying_nothing_started(
        "controller",
        &controller,
        &["kubeconfig", "missing.kubeconfig"],
    );
    let extension = dir.path("extension.yaml");
    std::fs::write(
        &extension,
        format!(
            "{head}kind: ExtensionConfiguration
kubeconfig: garbage
namespace: extension-trellis
image: trellis
webhook: {{address: \"127.0.0.1:0\"}}
admin: {{address: \"127.0.0.1:{}\"}}
",
            ports[7]
        ),
    )
    .unwrap();
    fails_to_start_saying_nothing_started("extension", &extension, &["kubeconfig"]);
}
