//! `egress-connect` listeners with Gardener's certificates as Gardener issues them: per shoot a
//! `ca-vpn` (CN `vpn`), a `vpn-seed-server` server certificate and a
//! `kube-apiserver-http-proxy` client certificate. Clients are rustls, Python's `ssl` and
//! curl, speaking kube-apiserver's bytes (`CONNECT 10.x.y.z:port HTTP/1.1`,
//! `Host: 127.0.0.1`); targets are plain TCP servers on loopback.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::egress::*;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::client::TlsStream;

/// A target that counts its connections and echoes; `greeting` is sent first.
struct Target {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
}

async fn target_at(ip: &str, greeting: &'static [u8]) -> Target {
    let (addr, connections) = counting_echo_at(ip, greeting).await;
    Target { addr, connections }
}

impl Target {
    /// The connections it accepted once `n` arrived (or 10 s passed): a CONNECT is answered
    /// once the gateway's dial completes, a moment before the target's accept loop counts it.
    async fn accepted(&self, n: usize) -> usize {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let seen = self.connections.load(Ordering::SeqCst);
            if seen >= n || tokio::time::Instant::now() >= deadline {
                return seen;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn listener_tls(shoot: &Shoot) -> String {
    format!("  tls: {}", shoot.tls_yaml())
}

/// A gateway with one `egress-connect` listener named `egress` whose own `tls` is
/// `default`'s.
fn gateway(routes: &str, default: &Shoot) -> Gateway {
    Gateway::start_listeners(
        routes,
        &[("egress", "egress-connect", &listener_tls(default))],
        "",
    )
}

fn table(routes: &str) -> String {
    format!("apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n{routes}")
}

/// Three shoots, each with Gardener's certificates, told apart by their kube-apiserver's
/// address; each reaches its own target, and a certificate of one presented from another's
/// address is refused.
#[tokio::test(flavor = "multi_thread")]
async fn gardener_shoots_told_apart_by_client_address_each_reach_their_own_target() {
    let dir = TestDir::new("egress-gardener");
    let shoots: Vec<Shoot> = (0..3)
        .map(|i| Shoot::new(&dir, &format!("shoot--dev--s{i}")))
        .collect();
    // Each shoot's target on its own loopback address; each route allows only its own.
    let mut targets = Vec::new();
    let mut routes = String::new();
    for (i, s) in shoots.iter().enumerate() {
        let t = target_at(&format!("127.0.{}.1", 10 + i), b"").await;
        routes += &format!(
            "- name: {ns}\n  egress:\n    clientSources: [\"127.0.0.{src}/32\"]\n    tls: {tls}\n    directNetworks: [\"127.0.{net}.0/24\"]\n",
            ns = s.namespace,
            src = 21 + i,
            tls = s.tls_yaml(),
            net = 10 + i,
        );
        targets.push(t);
    }
    // The listener's own material is a fourth CA: no shoot's client certificate chains to it.
    let other = Shoot::new(&dir, "listener");
    let gw = gateway(&table(&routes), &other);
    let addr = gw.addr("egress");
    for (i, s) in shoots.iter().enumerate() {
        let source: IpAddr = format!("127.0.0.{}", 21 + i).parse().unwrap();
        let mut tls = handshake(addr, Some(source), "vpn-seed-server", &s.client(), false)
            .await
            .unwrap();
        let answer = connect_to(&mut tls, &targets[i].addr.to_string()).await;
        assert_eq!(answer, OK, "shoot {i}");
        tls.write_all(b"ping").await.unwrap();
        let mut echo = [0u8; 4];
        tls.read_exact(&mut echo).await.unwrap();
        assert_eq!(&echo, b"ping");
        // Another shoot's target is outside this route's networks.
        let mut tls = handshake(addr, Some(source), "vpn-seed-server", &s.client(), false)
            .await
            .unwrap();
        let other_target = targets[(i + 1) % 3].addr.to_string();
        assert_eq!(status(&connect_to(&mut tls, &other_target).await), 403);
    }
    // Shoot 0's certificate from shoot 1's address: shoot 1's route accepts only its own CA
    // (and presents shoot 1's server certificate, which shoot 0's CA does not trust).
    let source: IpAddr = "127.0.0.22".parse().unwrap();
    let crossed = Client {
        trust: shoots[1].ca.pem.clone(),
        cert: shoots[0].client().cert,
    };
    let refused = match handshake(addr, Some(source), "vpn-seed-server", &crossed, false).await {
        Err(_) => true,
        Ok(mut tls) => status(&connect_to(&mut tls, &targets[1].addr.to_string()).await) == 0,
    };
    assert!(refused, "a certificate of another shoot's CA was accepted");
    for (i, t) in targets.iter().enumerate() {
        assert_eq!(t.accepted(1).await, 1, "target {i}");
    }
    let m = gw.metrics();
    assert!(
        metric_in(
            &m,
            "trellis_egress_requests_total{route=\"shoot--dev--s1\",result=\"connected\"}"
        ) >= 1.0,
        "{m}"
    );
}

/// The three ways a connection finds its route: server name (with the route's own
/// certificate), client address, and the client certificate's identity under the listener's
/// CA; a route chosen before the handshake that lists identities requires one.
#[tokio::test(flavor = "multi_thread")]
async fn each_selection_mode() {
    let dir = TestDir::new("egress-modes");
    let by_name = Shoot::new(&dir, "by-name");
    let by_source = Shoot::new(&dir, "by-source");
    let listener = Shoot::new(&dir, "listener");
    let target = target_at("127.0.0.1", b"").await;
    let routes = table(&format!(
        "- name: by-name
  egress:
    serverNames: [vpn-seed-server.by-name]
    tls: {by_name}
    directNetworks: [\"127.0.0.1/32\"]
- name: by-source
  egress:
    clientSources: [\"127.0.0.31/32\"]
    tls: {by_source}
    clientIdentities: [kube-apiserver-http-proxy]
    directNetworks: [\"127.0.0.1/32\"]
- name: by-identity
  egress:
    clientIdentities: [shoot--dev--id]
    directNetworks: [\"127.0.0.1/32\"]
",
        by_name = by_name.tls_yaml(),
        by_source = by_source.tls_yaml(),
    ));
    let gw = gateway(&routes, &listener);
    let addr = gw.addr("egress");
    let t = target.addr.to_string();

    // By server name: that route's own certificate and CA, from any address, TLS 1.2 too.
    for tls12 in [false, true] {
        let mut tls = handshake(
            addr,
            None,
            "vpn-seed-server.by-name",
            &by_name.client(),
            tls12,
        )
        .await
        .unwrap();
        assert_eq!(connect_to(&mut tls, &t).await, OK, "tls12 {tls12}");
    }
    // By source, with the identity the route requires.
    let source = Some("127.0.0.31".parse().unwrap());
    let mut tls = handshake(addr, source, "vpn-seed-server", &by_source.client(), false)
        .await
        .unwrap();
    assert_eq!(connect_to(&mut tls, &t).await, OK);
    // By source, but the leaf lacks the required identity: 403.
    let (cert, key) = by_source.ca.issue("someone-else", &[], false);
    let lacking = Client {
        trust: by_source.ca.pem.clone(),
        cert: Some((cert, key)),
    };
    let mut tls = handshake(addr, source, "vpn-seed-server", &lacking, false)
        .await
        .unwrap();
    assert_eq!(status(&connect_to(&mut tls, &t).await), 403);
    // By identity (listener CA): CN, and a DNS SAN.
    for (cn, sans) in [
        ("shoot--dev--id", vec![]),
        ("x", vec!["shoot--dev--id".to_string()]),
    ] {
        let (cert, key) = listener.ca.issue(cn, &sans, false);
        let c = Client {
            trust: listener.ca.pem.clone(),
            cert: Some((cert, key)),
        };
        let mut tls = handshake(addr, None, "vpn-seed-server", &c, false)
            .await
            .unwrap();
        assert_eq!(connect_to(&mut tls, &t).await, OK, "{cn}");
    }
    // An identity no route has: 403.
    let (cert, key) = listener.ca.issue("shoot--dev--unknown", &[], false);
    let unknown = Client {
        trust: listener.ca.pem.clone(),
        cert: Some((cert, key)),
    };
    let mut tls = handshake(addr, None, "vpn-seed-server", &unknown, false)
        .await
        .unwrap();
    assert_eq!(status(&connect_to(&mut tls, &t).await), 403);
    // No client certificate, and one from a CA the listener does not accept: no handshake.
    let anonymous = Client {
        trust: listener.ca.pem.clone(),
        cert: None,
    };
    let wrong_ca = Client {
        trust: listener.ca.pem.clone(),
        cert: by_name.client().cert,
    };
    for (what, c) in [("no certificate", &anonymous), ("wrong CA", &wrong_ca)] {
        let refused = match handshake(addr, None, "vpn-seed-server", c, false).await {
            Err(_) => true,
            Ok(mut tls) => status(&connect_to(&mut tls, &t).await) == 0,
        };
        assert!(refused, "{what} was accepted");
    }
    assert_eq!(target.accepted(5).await, 5);
    let m = gw.metrics();
    for (route, result) in [
        ("by-source", "identity_mismatch"),
        ("", "no_route"),
        ("", "handshake_failed"),
    ] {
        assert!(
            metric_in(
                &m,
                &format!("trellis_egress_requests_total{{route=\"{route}\",result=\"{result}\"}}")
            ) >= 1.0,
            "{route} {result}: {m}"
        );
    }
}

/// Targets: an allowed IP, a host name resolved by the gateway, one outside the lists, a
/// refused port (`502`), a black hole (`504`), `via: tunnel` with no tunnel yet (`504`); 10 MB
/// each way byte-exact and half-close.
#[tokio::test(flavor = "multi_thread")]
async fn targets_answers_and_bulk() {
    let dir = TestDir::new("egress-targets");
    let shoot = Shoot::new(&dir, "shoot--dev--t");
    let target = target_at("127.0.0.1", b"").await;
    // A port nobody listens on, and a listener that never accepts, its backlog full: SYNs to
    // it are dropped.
    let refused = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let hole = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    hole.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    hole.listen(0).unwrap();
    let hole_addr = hole.local_addr().unwrap().as_socket().unwrap();
    let mut fillers = Vec::new();
    for _ in 0..4 {
        // Fills the accept queue (a backlog of 0 holds one, the kernel adds slack).
        if let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(hole_addr)).await
        {
            fillers.push(s);
        }
    }
    let routes = table(&format!(
        "- name: t
  timeouts: {{connect: 1s}}
  egress:
    serverNames: [vpn-seed-server]
    tls: {tls}
    directNetworks: [\"127.0.0.1/32\"]
- name: tunnel
  egress:
    serverNames: [vpn-seed-server.shoot--dev--t]
    tls: {tls}
    allowedNetworks: [\"10.250.0.0/16\"]
",
        tls = shoot.tls_yaml()
    ));
    let gw = gateway(&routes, &shoot);
    let addr = gw.addr("egress");
    let c = shoot.client();
    let ask = |sni: &'static str, target: String| {
        let c = c.clone();
        async move {
            let mut tls = handshake(addr, None, sni, &c, false).await.unwrap();
            let answer = connect_to(&mut tls, &target).await;
            (tls, answer)
        }
    };
    let port = target.addr.port();
    assert_eq!(
        ask("vpn-seed-server", format!("localhost:{port}")).await.1,
        OK
    );
    let (_, a) = ask("vpn-seed-server", format!("127.0.0.2:{port}")).await;
    assert_eq!(status(&a), 403);
    assert!(!String::from_utf8_lossy(&a).contains("127.0.0"), "{a:?}");
    let (_, a) = ask("vpn-seed-server", format!("no-such-name.invalid:{port}")).await;
    assert_eq!(status(&a), 403, "{a:?}");
    let (_, a) = ask("vpn-seed-server", refused.to_string()).await;
    assert_eq!(status(&a), 502);
    let (_, a) = ask("vpn-seed-server", hole_addr.to_string()).await;
    assert_eq!(status(&a), 504);
    let (_, a) = ask("vpn-seed-server.shoot--dev--t", "10.250.1.2:443".into()).await;
    assert_eq!(status(&a), 504);
    // A non-2xx answer closes the connection.
    let (mut tls, a) = ask("vpn-seed-server", format!("127.0.0.2:{port}")).await;
    assert_eq!(status(&a), 403);
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut rest))
        .await
        .expect("not closed after a 403");

    // 10 MB each way, byte-exact, then half-close: the client's FIN reaches the target,
    // whose echo ends, and the target's FIN reaches the client.
    let (tls, a) = ask("vpn-seed-server", target.addr.to_string()).await;
    assert_eq!(a, OK);
    let data: Vec<u8> = (0..10 * 1024 * 1024u32)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    let (mut r, mut w) = tokio::io::split(tls);
    let sent = data.clone();
    let writer = tokio::spawn(async move {
        w.write_all(&sent).await.unwrap();
        w.shutdown().await.unwrap();
        w
    });
    let mut back = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), r.read_to_end(&mut back))
        .await
        .expect("echo did not end after the half-close")
        .unwrap();
    writer.await.unwrap();
    assert!(
        back == data,
        "echo differs ({} of {} bytes)",
        back.len(),
        data.len()
    );
    let m = gw.metrics();
    for (route, result) in [
        ("t", "target_denied"),
        ("t", "dial_failed"),
        ("tunnel", "no_tunnel"),
    ] {
        assert!(
            metric_in(
                &m,
                &format!("trellis_egress_requests_total{{route=\"{route}\",result=\"{result}\"}}")
            ) >= 1.0,
            "{route} {result}: {m}"
        );
    }
    for reason in ["refused", "timeout"] {
        assert!(
            metric_in(
                &m,
                &format!(
                    "trellis_upstream_connect_failures_total{{route=\"t\",reason=\"{reason}\"}}"
                )
            ) >= 1.0,
            "{reason}: {m}"
        );
    }
    drop(fillers);
}

/// Python's `ssl`, as kube-apiserver's egress dialer does it: the answer is read with a
/// buffered reader, and any byte buffered past the response head is an error. A target that
/// sends first, and one that sends nothing.
#[tokio::test(flavor = "multi_thread")]
async fn no_byte_follows_the_200_until_the_target_sends_one() {
    let dir = TestDir::new("egress-python");
    let shoot = Shoot::new(&dir, "shoot--dev--py");
    let talker = target_at("127.0.0.1", b"SSH-2.0-banner\r\n").await;
    let silent = target_at("127.0.0.1", b"").await;
    let routes = table(&format!(
        "- name: py\n  egress:\n    serverNames: [vpn-seed-server]\n    tls: {}\n    directNetworks: [\"127.0.0.1/32\"]\n",
        shoot.tls_yaml()
    ));
    let gw = gateway(&routes, &shoot);
    let ca = dir.path("client-ca.pem");
    let cert = dir.path("client.crt");
    let key = dir.path("client.key");
    std::fs::write(&ca, &shoot.ca.pem).unwrap();
    std::fs::write(&cert, &shoot.client_cert).unwrap();
    std::fs::write(&key, &shoot.client_key).unwrap();
    // Reads the response head the way Go's http.ReadResponse over a bufio.Reader does: one
    // TLS record at a time; whatever that read returned past the head is "buffered data".
    let script = r#"
import socket, ssl, sys
host, port, ca, cert, key, target = sys.argv[1:7]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.load_verify_locations(ca)
ctx.load_cert_chain(cert, key)
s = ctx.wrap_socket(socket.create_connection((host, int(port))), server_hostname="vpn-seed-server")
s.sendall(("CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" % target).encode())
first = s.recv(4096)
head, sep, extra = first.partition(b"\r\n\r\n")
print("head", repr(head + sep))
print("buffered", len(extra))
s.settimeout(0.5)
try:
    later = s.recv(4096)
except socket.timeout:
    later = b""
print("later", repr(later))
s.settimeout(5)
s.sendall(b"hello")
echo = b""
while len(echo) < 5:
    echo += s.recv(4096)
print("echo", repr(echo[-5:]))
"#;
    let egress = gw.addr("egress");
    for (name, t, later) in [
        ("talker", &talker, "b'SSH-2.0-banner\\r\\n'"),
        ("silent", &silent, "b''"),
    ] {
        let (ok, out) = run(
            Command::new("python3").args([
                "-c",
                script,
                "127.0.0.1",
                &egress.port().to_string(),
                ca.to_str().unwrap(),
                cert.to_str().unwrap(),
                key.to_str().unwrap(),
                &t.addr.to_string(),
            ]),
            b"",
            Duration::from_secs(30),
        );
        assert!(ok, "{name}: {out}");
        assert!(
            out.contains("head b'HTTP/1.1 200 Connection established\\r\\n\\r\\n'"),
            "{name}: {out}"
        );
        assert!(out.contains("buffered 0"), "{name}: {out}");
        assert!(out.contains(&format!("later {later}")), "{name}: {out}");
        assert!(out.contains("echo b'hello'"), "{name}: {out}");
    }
}

/// curl as the README shows it: `--proxy https://…` with the client certificate.
#[tokio::test(flavor = "multi_thread")]
async fn curl_through_the_egress_proxy() {
    let dir = TestDir::new("egress-curl");
    let shoot = Shoot::new(&dir, "shoot--dev--curl");
    // Answers one request once its head is in.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let web = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nshoot",
                    )
                    .await;
            });
        }
    });
    let routes = table(
        "- name: curl\n  egress:\n    clientIdentities: [kube-apiserver-http-proxy]\n    directNetworks: [\"127.0.0.1/32\"]\n",
    );
    let gw = gateway(&routes, &shoot);
    let ca = dir.path("client-ca.pem");
    let cert = dir.path("client.crt");
    let key = dir.path("client.key");
    std::fs::write(&ca, &shoot.ca.pem).unwrap();
    std::fs::write(&cert, &shoot.client_cert).unwrap();
    std::fs::write(&key, &shoot.client_key).unwrap();
    let egress = gw.addr("egress");
    let (ok, out) = run(
        Command::new("curl").args([
            "-sSv",
            "--max-time",
            "20",
            "--proxy",
            &format!("https://vpn-seed-server:{}", egress.port()),
            "--proxy-cacert",
            ca.to_str().unwrap(),
            "--proxy-cert",
            cert.to_str().unwrap(),
            "--proxy-key",
            key.to_str().unwrap(),
            "--proxytunnel",
            "--resolve",
            &format!("vpn-seed-server:{}:127.0.0.1", egress.port()),
            &format!("http://{web}/"),
        ]),
        b"",
        Duration::from_secs(30),
    );
    assert!(ok && out.starts_with("shoot"), "{out}\n{}", gw.logs());
    let log = gw.wait_access_log(|l| l["listener"] == "egress" && l["route"] == "curl");
    assert_eq!(log["identity"], "kube-apiserver-http-proxy", "{log}");
    assert_eq!(log["target_name"], web.to_string(), "{log}");
}

/// The leaf certificate a handshake was answered with.
fn server_leaf(tls: &TlsStream<TcpStream>) -> Vec<u8> {
    tls.get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap()
}

/// Rotating a route's server certificate and then its client CA while a connection stays
/// open: new handshakes get the new material, the open connection goes on; a bad file keeps
/// the last good material and is counted.
#[tokio::test(flavor = "multi_thread")]
async fn rotation_of_certificate_and_ca_keeps_open_connections() {
    let dir = TestDir::new("egress-rotation");
    let shoot = Shoot::new(&dir, "shoot--dev--rot");
    let listener = Shoot::new(&dir, "listener");
    let target = target_at("127.0.0.1", b"").await;
    let routes = table(&format!(
        "- name: rot\n  egress:\n    serverNames: [vpn-seed-server]\n    tls: {}\n    directNetworks: [\"127.0.0.1/32\"]\n",
        shoot.tls_yaml()
    ));
    let gw = Gateway::start_listeners_source(
        &routes,
        &[("egress", "egress-connect", &listener_tls(&listener))],
        "",
        "routes: {file: routes.yaml, checkInterval: 1s}",
    );
    let addr = gw.addr("egress");
    let t = target.addr.to_string();
    let mut open = handshake(addr, None, "vpn-seed-server", &shoot.client(), false)
        .await
        .unwrap();
    assert_eq!(connect_to(&mut open, &t).await, OK);
    let first = server_leaf(&open);
    let echo = |mut tls: TlsStream<TcpStream>, what: &'static str| async move {
        tls.write_all(what.as_bytes()).await.unwrap();
        let mut back = vec![0u8; what.len()];
        tokio::time::timeout(Duration::from_secs(10), tls.read_exact(&mut back))
            .await
            .expect("the open connection stopped relaying")
            .unwrap();
        assert_eq!(back, what.as_bytes());
        tls
    };

    // A new server certificate (same CA), written as a rotation does: a new file renamed over.
    let sans = vec!["vpn-seed-server".to_string()];
    let (cert, key) = shoot.ca.issue("vpn-seed-server", &sans, true);
    let swap = |path: &std::path::Path, content: &str| {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, content).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    };
    swap(&shoot.files[1], &key);
    swap(&shoot.files[0], &cert);
    let rotated = wait_for(Duration::from_secs(15), || {
        let leaf = futures_block(handshake(
            addr,
            None,
            "vpn-seed-server",
            &shoot.client(),
            false,
        ))
        .ok()
        .map(|tls| server_leaf(&tls))?;
        (leaf != first).then_some(leaf)
    });
    assert!(
        rotated.is_some(),
        "the new server certificate was never presented"
    );
    open = echo(open, "still here").await;

    // A new client CA: the old CA's client certificates are refused, the new one's accepted.
    let ca2 = Ca::new("vpn");
    let (cert2, key2) = ca2.issue("kube-apiserver-http-proxy", &[], false);
    swap(&shoot.files[2], &ca2.pem);
    let new_client = Client {
        trust: shoot.ca.pem.clone(),
        cert: Some((cert2, key2)),
    };
    let accepted = wait_for(Duration::from_secs(15), || {
        futures_block(async {
            let mut tls = handshake(addr, None, "vpn-seed-server", &new_client, false)
                .await
                .ok()?;
            (connect_to(&mut tls, &t).await == OK).then_some(())
        })
    });
    assert!(accepted.is_some(), "the new client CA was never used");
    let old = match handshake(addr, None, "vpn-seed-server", &shoot.client(), false).await {
        Err(_) => true,
        Ok(mut tls) => status(&connect_to(&mut tls, &t).await) == 0,
    };
    assert!(old, "a certificate of the replaced CA was still accepted");
    open = echo(open, "and still").await;

    // A broken key: the last good material stays in use, and the rejection is counted.
    swap(
        &shoot.files[1],
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    );
    gw.wait_metric(
        "trellis_tls_material_loads_total{result=\"rejected\"}",
        |v| v >= 1.0,
    );
    let mut tls = handshake(addr, None, "vpn-seed-server", &new_client, false)
        .await
        .unwrap();
    assert_eq!(connect_to(&mut tls, &t).await, OK);
    echo(open, "to the end").await;
}

/// Runs a future to completion from a synchronous poll loop (for [`wait_for`]).
fn futures_block<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}

/// 1,000 routes, each with its own `CN=vpn` CA and `vpn-seed-server` certificate, chosen by
/// server name: every shoot's handshake succeeds with its own certificate and CA.
#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_shoots_with_their_own_vpn_ca() {
    const N: usize = 1000;
    let dir = TestDir::new("egress-1000");
    let target = target_at("127.0.0.1", b"").await;
    let mut routes = String::new();
    let mut clients = Vec::new();
    for i in 0..N {
        let ca = Ca::new("vpn");
        let name = format!("vpn-seed-server.shoot--p--s{i}");
        let (cert, key) = ca.issue("vpn-seed-server", std::slice::from_ref(&name), true);
        let (ccert, ckey) = ca.issue("kube-apiserver-http-proxy", &[], false);
        let files = [
            dir.path(&format!("s{i}.crt")),
            dir.path(&format!("s{i}.key")),
            dir.path(&format!("s{i}-ca.crt")),
        ];
        std::fs::write(&files[0], cert).unwrap();
        std::fs::write(&files[1], key).unwrap();
        std::fs::write(&files[2], &ca.pem).unwrap();
        routes += &format!(
            "- name: shoot--p--s{i}\n  egress:\n    serverNames: [{name}]\n    tls: {{certificateFile: {:?}, keyFile: {:?}, clientCAFile: {:?}}}\n    directNetworks: [\"127.0.0.1/32\"]\n",
            files[0], files[1], files[2]
        );
        clients.push((
            name,
            Client {
                trust: ca.pem,
                cert: Some((ccert, ckey)),
            },
        ));
    }
    let listener = Shoot::new(&dir, "listener");
    let gw = gateway(&table(&routes), &listener);
    let addr = gw.addr("egress");
    let t = target.addr.to_string();
    let clients = Arc::new(clients);
    let mut tasks = Vec::new();
    for w in 0..8 {
        let clients = clients.clone();
        let t = t.clone();
        tasks.push(tokio::spawn(async move {
            let mut ok = 0;
            for (name, c) in clients.iter().skip(w).step_by(8) {
                let mut tls = handshake(addr, None, name, c, false)
                    .await
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(connect_to(&mut tls, &t).await, OK, "{name}");
                ok += 1;
            }
            ok
        }));
    }
    let mut ok = 0;
    for task in tasks {
        ok += task.await.unwrap();
    }
    assert_eq!(ok, N);
    assert_eq!(target.accepted(N).await, N);
}

/// Malformed input is refused as counted and nothing is dialed: two canaries — one the
/// route allows, one it does not — see no connection.
#[tokio::test(flavor = "multi_thread")]
async fn malformed_requests_are_refused_and_nothing_is_dialed() {
    let dir = TestDir::new("egress-malformed");
    let shoot = Shoot::new(&dir, "shoot--dev--bad");
    let allowed = target_at("127.0.0.1", b"").await;
    let outside = target_at("127.0.0.7", b"").await;
    let routes = table(&format!(
        "- name: bad\n  egress:\n    serverNames: [vpn-seed-server]\n    tls: {}\n    directNetworks: [\"127.0.0.1/32\"]\n",
        shoot.tls_yaml()
    ));
    let gw = Gateway::start_listeners(
        &routes,
        &[("egress", "egress-connect", &listener_tls(&shoot))],
        "timeouts: {handshake: 2s}\nlimits: {maxHeaderBytes: 4096}",
    );
    let addr = gw.addr("egress");
    let a = allowed.addr;
    let o = outside.addr;
    let send = |bytes: Vec<u8>| {
        let c = shoot.client();
        async move {
            let mut tls = handshake(addr, None, "vpn-seed-server", &c, false)
                .await
                .unwrap();
            tls.write_all(&bytes).await.unwrap();
            let mut out = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out)).await;
            out
        }
    };
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        (
            "head over the cap",
            format!(
                "CONNECT {a} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: {}\r\n\r\n",
                "p".repeat(5000)
            )
            .into_bytes(),
            431,
        ),
        (
            "absolute form",
            format!("CONNECT http://{a}/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").into_bytes(),
            400,
        ),
        (
            "not CONNECT",
            format!("GET http://{a}/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").into_bytes(),
            405,
        ),
        (
            "pipelined",
            format!("CONNECT {a} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nCONNECT {a} HTTP/1.1\r\n\r\n")
                .into_bytes(),
            400,
        ),
        (
            "bytes right behind the head",
            format!("CONNECT {a} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n\x16\x03\x01").into_bytes(),
            400,
        ),
        ("garbage", b"\x00\x01\x02\r\n\r\n".to_vec(), 400),
        (
            "outside the lists",
            format!("CONNECT {o} HTTP/1.1\r\n\r\n").into_bytes(),
            403,
        ),
        (
            "unspecified address",
            format!("CONNECT 0.0.0.0:{} HTTP/1.1\r\n\r\n", a.port()).into_bytes(),
            403,
        ),
        (
            "port 0",
            "CONNECT 127.0.0.1:0 HTTP/1.1\r\n\r\n"
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            "slow head",
            format!("CONNECT {a} HTTP/1.1\r\n").into_bytes(),
            408,
        ),
    ];
    for (what, bytes, want) in cases {
        let out = send(bytes).await;
        assert_eq!(
            status(&out),
            want,
            "{what}: {:?}",
            String::from_utf8_lossy(&out)
        );
        let text = String::from_utf8_lossy(&out);
        assert!(
            !text.contains("127.0.0"),
            "{what}: the answer names an address: {text}"
        );
    }
    // Not TLS at all, and a ClientHello that is garbage past its record header.
    for bytes in [
        format!("CONNECT {a} HTTP/1.1\r\n\r\n").into_bytes(),
        b"\x16\x03\x01\x00\x05hello".to_vec(),
    ] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&bytes).await.unwrap();
        let out = read_all(&mut s, Duration::from_secs(10))
            .await
            .unwrap_or_default();
        assert!(!out.starts_with(b"HTTP"), "{out:?}");
    }
    assert_eq!(allowed.connections.load(Ordering::SeqCst), 0);
    assert_eq!(outside.connections.load(Ordering::SeqCst), 0);
    let m = gw.metrics();
    for (result, at_least) in [
        ("bad_request", 5.0),
        ("not_connect", 1.0),
        ("timeout", 1.0),
        ("target_denied", 1.0),
    ] {
        let v = metric_in(
            &m,
            &format!("trellis_egress_requests_total{{route=\"bad\",result=\"{result}\"}}"),
        );
        assert!(v >= at_least, "{result}: {v}\n{m}");
    }
    assert!(
        metric_in(
            &m,
            "trellis_downstream_connections_total{listener=\"egress\",outcome=\"not_tls\"}"
        ) >= 1.0,
        "{m}"
    );
}

/// `trellis check` reports every problem of an egress configuration at once, with its path.
#[test]
fn check_reports_every_egress_problem() {
    let dir = TestDir::new("egress-check");
    let a = Shoot::new(&dir, "a");
    let b = Shoot::new(&dir, "b");
    // b's key with a's certificate; a missing CA file.
    let mismatched = format!(
        "{{certificateFile: {:?}, keyFile: {:?}, clientCAFile: {:?}}}",
        a.files[0], b.files[1], a.files[2]
    );
    let missing = format!(
        "{{certificateFile: {:?}, keyFile: {:?}, clientCAFile: {:?}}}",
        a.files[0],
        a.files[1],
        dir.path("nope.crt")
    );
    let routes = table(&format!(
        "- name: one
  egress:
    serverNames: [vpn-seed-server]
    tls: {mismatched}
    allowedNetworks: [\"10.250.0.0/33\"]
    via: sideways
- name: two
  egress:
    serverNames: [vpn-seed-server]
    clientSources: [\"10.64.0.0/16\"]
    tls: {missing}
- name: three
  egress:
    serverNames: [vpn-seed-server]
    clientSources: [\"10.64.1.0/24\"]
- name: four
  egress: {{}}
"
    ));
    let file = dir.path("routes.yaml");
    std::fs::write(&file, routes).unwrap();
    let (ok, out) = run(
        Command::new(BIN).arg("check").arg(&file),
        b"",
        Duration::from_secs(20),
    );
    assert!(!ok, "{out}");
    for want in [
        "routes[0].egress.tls.keyFile: ",
        "does not match the certificate",
        "routes[1].egress.tls.clientCAFile: ",
        "nope.crt",
        "routes[0].egress.allowedNetworks[0]",
        "routes[0].egress.via",
        "routes[3].egress",
        "egress.serverName",
        "egress.clientSource",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
    // A listener without tls, and one whose files do not load.
    let config = format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {{file: routes.yaml}}
listeners:
- {{name: e1, address: \"127.0.0.1:1\", protocol: egress-connect}}
- {{name: e2, address: \"127.0.0.1:2\", protocol: egress-connect, tls: {missing}}}
- {{name: e3, address: \"127.0.0.1:3\", protocol: sni, tls: {missing}}}
- {{name: e4, address: \"127.0.0.1:5\", protocol: egress-connect, tls: {missing}, proxyProtocol: {{mode: optional}}}}
admin: {{address: \"127.0.0.1:4\"}}
"
    );
    let file = dir.path("gateway.yaml");
    std::fs::write(&file, config).unwrap();
    let (ok, out) = run(
        Command::new(BIN).arg("check").arg(&file),
        b"",
        Duration::from_secs(20),
    );
    assert!(!ok, "{out}");
    for want in [
        "listeners[0].tls: required",
        "listeners[1].tls.clientCAFile: ",
        "nope.crt",
        "listeners[2].tls: only valid for egress-connect",
        "listeners[3].proxyProtocol.trustedSources: required",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
}

/// A PROXY header from a trusted load balancer comes before TLS; its source is the client
/// address `clientSources` select by. `/routes` shows the egress selectors.
#[tokio::test(flavor = "multi_thread")]
async fn proxy_header_source_selects_the_route_and_routes_shows_egress() {
    let dir = TestDir::new("egress-proxy");
    let shoot = Shoot::new(&dir, "shoot--dev--lb");
    let listener = Shoot::new(&dir, "listener");
    let target = target_at("127.0.0.1", b"").await;
    let routes = table(&format!(
        "- name: lb\n  egress:\n    clientSources: [\"10.64.1.10/32\"]\n    tls: {}\n    directNetworks: [\"127.0.0.1/32\"]\n",
        shoot.tls_yaml()
    ));
    let gw = Gateway::start_listeners(
        &routes,
        &[(
            "egress",
            "egress-connect",
            &format!(
                "{}\n  proxyProtocol: {{mode: optional, trustedSources: [\"127.0.0.0/8\"]}}",
                listener_tls(&listener)
            ),
        )],
        "",
    );
    let addr = gw.addr("egress");
    let name = rustls::pki_types::ServerName::try_from("vpn-seed-server").unwrap();
    for (source, want_ok) in [("10.64.1.10", true), ("10.64.1.11", false)] {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        tcp.write_all(
            format!("PROXY TCP4 {source} 127.0.0.1 40000 {}\r\n", addr.port()).as_bytes(),
        )
        .await
        .unwrap();
        let result = tokio::time::timeout(
            Duration::from_secs(10),
            shoot.client().connector(false).connect(name.clone(), tcp),
        )
        .await
        .unwrap();
        let ok = match result {
            Ok(mut tls) => connect_to(&mut tls, &target.addr.to_string()).await == OK,
            Err(_) => false,
        };
        assert_eq!(ok, want_ok, "PROXY source {source}");
    }
    let (code, body) = http_get(gw.debug, "/routes").unwrap();
    assert_eq!(code, 200);
    for want in [
        "\"egress\"",
        "\"clientSources\"",
        "10.64.1.10/32",
        "\"directNetworks\"",
        "\"via\": \"tunnel\"",
    ] {
        assert!(body.contains(want), "{want} not in {body}");
    }
}
