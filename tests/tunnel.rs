//! WireGuard tunnels with real peers: the gateway's `wireguard` listener and `trellis agent`
//! on loopback (no root), kube-apiserver's egress (`CONNECT` over mutual TLS) dialing
//! through them to plain TCP servers the agent reaches with ordinary sockets; and WireGuard
//! over TCP through the gateway's CONNECT port (`connectDestination`, the agent's `connect`
//! endpoints), with a forwarder the test can cut and a UDP gate it can close in between.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine;
use common::egress::*;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A WireGuard key pair (base64), made in process.
struct Keys {
    private: String,
    public: String,
}

fn keys() -> Keys {
    let mut b = [0u8; 32];
    for (i, x) in b.iter_mut().enumerate() {
        *x = rand_byte(i);
    }
    let secret = boringtun::x25519::StaticSecret::from(b);
    let public = boringtun::x25519::PublicKey::from(&secret);
    let e = base64::engine::general_purpose::STANDARD;
    Keys {
        private: e.encode(secret.to_bytes()),
        public: e.encode(public.to_bytes()),
    }
}

/// Bytes that differ between keys of one test run.
fn rand_byte(i: usize) -> u8 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_usize(i);
    h.finish() as u8
}

/// A running `trellis agent`.
struct Agent {
    child: Child,
    dir: TestDir,
    admin: SocketAddr,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Agent {
    fn start(keys: &Keys, gateway_public: &str, endpoint: SocketAddr, networks: &str) -> Agent {
        Agent::start_at(keys, gateway_public, endpoint, networks, "192.168.128.5")
    }

    /// An agent with this address inside the tunnel.
    fn start_at(
        keys: &Keys,
        gateway_public: &str,
        endpoint: SocketAddr,
        networks: &str,
        address: &str,
    ) -> Agent {
        let endpoints = format!("[{{udp: \"{endpoint}\"}}]");
        Self::start_full(keys, gateway_public, &endpoints, networks, address)
    }

    /// An agent with `endpoints` (a YAML flow sequence) as its gateway's endpoints.
    fn start_endpoints(
        keys: &Keys,
        gateway_public: &str,
        endpoints: &str,
        networks: &str,
    ) -> Agent {
        Self::start_full(keys, gateway_public, endpoints, networks, "192.168.128.5")
    }

    /// An agent with `endpoints` and tunnel address `address`.
    fn start_full(
        keys: &Keys,
        gateway_public: &str,
        endpoints: &str,
        networks: &str,
        address: &str,
    ) -> Agent {
        let dir = TestDir::new("agent");
        let key: PathBuf = dir.path("agent.key");
        std::fs::write(&key, format!("{}\n", keys.private)).unwrap();
        let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let config = format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1
kind: AgentConfiguration
wireguard:
  privateKeyFile: {key:?}
  addresses: [{address}]
  gateway:
    publicKey: \"{gateway_public}\"
    endpoints: {endpoints}
    persistentKeepalive: 25s
networks: {networks}
admin: {{address: \"{admin}\"}}
"
        );
        std::fs::write(dir.path("agent.yaml"), config).unwrap();
        let log = std::fs::File::create(dir.path("agent.log")).unwrap();
        let child = Command::new(BIN)
            .args(["--log-format", "json", "agent", "--config"])
            .arg(dir.path("agent.yaml"))
            .env("RUST_LOG", "debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Agent { child, dir, admin }
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(self.dir.path("agent.log")).unwrap_or_default()
    }

    /// Sends the agent signal `sig` (`STOP` freezes it, as a node that stopped answering).
    fn signal(&self, sig: &str) {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill")
            .args([&format!("-{sig}"), &pid])
            .status();
        assert!(sent.unwrap().success());
    }

    /// Waits until `/ready` answers 200 (the tunnel is up).
    fn wait_ready(&self, limit: Duration) -> bool {
        wait_for(limit, || {
            (http_get(self.admin, "/ready").map(|(s, _)| s) == Some(200)).then_some(())
        })
        .is_some()
    }

    /// Waits up to 20 s for metric `prefix` to equal `want`.
    fn wait_metric(&self, prefix: &str, want: f64) {
        let seen = wait_for(Duration::from_secs(20), || {
            (self.metric(prefix) == want).then_some(())
        });
        assert!(seen.is_some(), "{prefix} is not {want}:\n{}", self.logs());
    }

    fn metric(&self, prefix: &str) -> f64 {
        metric_in(
            &http_get(self.admin, "/metrics")
                .map(|(_, b)| b)
                .unwrap_or_default(),
            prefix,
        )
    }
}

/// The first access-log line of a log (the agent's) for which `pred` holds, waited for.
fn wait_access_line(
    logs: impl Fn() -> String,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    wait_for(Duration::from_secs(10), || {
        json_lines(&logs())
            .into_iter()
            .find(|l| l["target"] == "trellis::access" && pred(l))
    })
    .unwrap_or_else(|| panic!("no matching access line in:\n{}", logs()))
}

/// A gateway with an `egress-connect` and a `wireguard` listener and one shoot whose route
/// tunnels `allowed` to the agent.
struct Lab {
    gw: Gateway,
    shoot: Shoot,
    gw_keys: Keys,
    agent_keys: Keys,
    _dir: TestDir,
}

fn route(shoot: &Shoot, agent_public: &str, peer_allowed: &str, allowed: &str) -> String {
    format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- name: shoot--local--a
  tunnel:
    wireguard:
      peers:
      - publicKey: \"{agent_public}\"
        allowedIPs: {peer_allowed}
      localAddresses: [192.168.128.1]
  egress:
    clientSources: [\"127.0.0.1/32\"]
    tls: {}
    allowedNetworks: {allowed}
",
        shoot.tls_yaml()
    )
}

/// The `wireguard` listener's `connectDestination` in these tests.
const CONNECT_DESTINATION: &str = "trellis-wireguard:51820";

impl Lab {
    fn start() -> Lab {
        Self::start_opts(false, "")
    }

    /// A lab whose gateway also has an `http-connect` listener (`connect`) and whose
    /// `wireguard` listener takes WireGuard over TCP from it (`CONNECT_DESTINATION`);
    /// `extra` is gateway configuration (timeouts).
    fn start_connect(extra: &str) -> Lab {
        Self::start_opts(true, extra)
    }

    fn start_opts(connect: bool, extra: &str) -> Lab {
        let dir = TestDir::new("tunnel-lab");
        let shoot = Shoot::new(&dir, "shoot--local--a");
        let (gw_keys, agent_keys) = (keys(), keys());
        let key = dir.path("gateway.key");
        std::fs::write(&key, format!("{}\n", gw_keys.private)).unwrap();
        let routes = route(
            &shoot,
            &agent_keys.public,
            "[\"192.168.128.5/32\", \"127.0.0.0/8\"]",
            "[\"127.0.0.0/8\"]",
        );
        let destination = if connect {
            format!(", connectDestination: {CONNECT_DESTINATION:?}")
        } else {
            String::new()
        };
        let listeners = [
            (
                "egress",
                "egress-connect",
                format!("  tls: {}", shoot.tls_yaml()),
            ),
            (
                "wireguard",
                "wireguard",
                format!("  wireguard: {{privateKeyFile: {key:?}{destination}}}"),
            ),
            ("connect", "http-connect", String::new()),
        ];
        let count = if connect { 3 } else { 2 };
        let listeners: Vec<(&str, &str, &str)> = listeners[..count]
            .iter()
            .map(|(n, p, e)| (*n, *p, e.as_str()))
            .collect();
        let gw = Gateway::start_listeners(&routes, &listeners, extra);
        Lab {
            gw,
            shoot,
            gw_keys,
            agent_keys,
            _dir: dir,
        }
    }

    fn agent(&self, networks: &str) -> Agent {
        let endpoints = format!("[{{udp: \"{}\"}}]", self.gw.addr("wireguard"));
        self.agent_with(&endpoints, networks)
    }

    /// An agent with `endpoints` (a YAML flow sequence), once ready.
    fn agent_with(&self, endpoints: &str, networks: &str) -> Agent {
        let agent =
            Agent::start_endpoints(&self.agent_keys, &self.gw_keys.public, endpoints, networks);
        assert!(
            agent.wait_ready(Duration::from_secs(20)),
            "agent not ready:\n{}\ngateway:\n{}",
            agent.logs(),
            self.gw.logs()
        );
        agent
    }

    /// CONNECTs to `target` as kube-apiserver does; returns the stream and the answer.
    async fn connect(
        &self,
        target: &str,
    ) -> (
        tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
        Vec<u8>,
    ) {
        let mut tls = handshake(
            self.gw.addr("egress"),
            None,
            "vpn-seed-server",
            &self.shoot.client(),
            false,
        )
        .await
        .unwrap();
        tls.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut buf = vec![0u8; 4096];
        let n = match tokio::time::timeout(Duration::from_secs(15), tls.read(&mut buf)).await {
            Ok(r) => r.unwrap_or(0),
            Err(_) => panic!(
                "no answer to CONNECT {target}; gateway:\n{}",
                self.gw.logs()
            ),
        };
        buf.truncate(n);
        (tls, buf)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn egress_reaches_a_server_behind_the_agent_byte_exact_each_way_with_half_close() {
    let lab = Lab::start();
    let agent = lab.agent("[\"127.0.0.0/8\"]");
    let (target, _) = counting_echo_at("127.0.0.1", b"").await;
    let (tls, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(answer, OK, "{}", String::from_utf8_lossy(&answer));

    // 4 MB each way, written and read concurrently; then the client half-closes and still
    // reads everything the echo sends back.
    echo_exact_with_half_close(tls, 4_000_000).await;
    assert!(
        lab.gw
            .metric("trellis_tunnel_handshakes_total{route=\"shoot--local--a\",result=\"ok\"}")
            >= 1.0
    );
    assert!(
        lab.gw
            .metric("trellis_tunnel_bytes_total{route=\"shoot--local--a\",direction=\"rx\"}")
            >= 4_000_000.0
    );
    drop(agent);
}

/// Each failed tunnel dial is answered as it failed, counted under its reason, and logged
/// in the access log under that same reason (`error:<reason>`), on the gateway and on the
/// agent.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_port_is_502_outside_the_agents_networks_is_502_and_counted_no_agent_is_504() {
    let lab = Lab::start();
    let gw_failures = |reason: &str| {
        lab.gw.metric(&format!(
            "trellis_tunnel_dial_failures_total{{route=\"shoot--local--a\",reason=\"{reason}\"}}"
        ))
    };
    // No agent yet: no live peer.
    let (_, answer) = lab.connect("127.0.0.1:9").await;
    assert_eq!(status(&answer), 504, "{}", String::from_utf8_lossy(&answer));
    assert_eq!(gw_failures("no_live_peer"), 1.0);
    let line = lab
        .gw
        .wait_access_log(|l| l["target_name"] == "127.0.0.1:9");
    assert_eq!(line["reason"], "error:no_live_peer", "{line}");

    let agent = lab.agent("[\"127.0.0.1/32\"]");
    // Nothing listens there: the agent's dial is refused, the inner SYN reset.
    let closed = format!("127.0.0.1:{}", free_port());
    let (_, answer) = lab.connect(&closed).await;
    assert_eq!(status(&answer), 502, "{}", String::from_utf8_lossy(&answer));
    assert_eq!(
        agent.metric("trellis_tunnel_dial_failures_total{route=\"agent\",reason=\"refused\"}"),
        1.0
    );
    assert_eq!(gw_failures("refused"), 1.0);
    let line = lab.gw.wait_access_log(|l| l["target_name"] == closed);
    assert_eq!(line["reason"], "error:refused", "{line}");
    let line = wait_access_line(|| agent.logs(), |l| l["target_name"] == closed);
    assert_eq!(line["reason"], "error:refused", "{line}");

    // Allowed by the route, outside the agent's networks: reset by the agent, counted.
    let (other, _) = counting_echo_at("127.0.0.2", b"").await;
    let (_, answer) = lab.connect(&other.to_string()).await;
    assert_eq!(status(&answer), 502, "{}", String::from_utf8_lossy(&answer));
    assert_eq!(
        agent.metric("trellis_tunnel_packets_dropped_total{reason=\"not_allowed\"}"),
        1.0
    );
    assert_eq!(gw_failures("refused"), 2.0);
    let line = lab
        .gw
        .wait_access_log(|l| l["target_name"] == other.to_string());
    assert_eq!(line["reason"], "error:refused", "{line}");
}

/// The gateway logs a peer's session coming up once (route, peer, endpoint), however many
/// packets follow; boringtun's warnings about the peer (here: data sent to an agent that
/// froze goes unanswered, and boringtun starts a handshake) name the route and the peer; and
/// the dial that went unanswered is logged under the reason it is counted under.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_up_is_logged_once_and_boringtuns_warnings_name_route_and_peer() {
    let lab = Lab::start();
    let agent = lab.agent("[\"127.0.0.0/8\"]");
    let (target, _) = counting_echo_at("127.0.0.1", b"").await;
    for round in 0..3u8 {
        let (mut tls, answer) = lab.connect(&target.to_string()).await;
        assert_eq!(answer, OK);
        let data = vec![round; 100_000];
        assert_eq!(echo_round(&mut tls, &data).await, data);
    }
    let (route, peer) = ("shoot--local--a", lab.agent_keys.public.as_str());
    let ups = lines_saying(&lab.gw.logs(), "tunnel session up");
    assert_eq!(ups.len(), 1, "{ups:?}");
    assert_eq!(
        (&ups[0]["route"], &ups[0]["peer"]),
        (&route.into(), &peer.into())
    );
    let endpoint: SocketAddr = ups[0]["endpoint"].as_str().unwrap().parse().unwrap();
    assert!(endpoint.ip().is_loopback(), "{endpoint}");
    // The agent logs its own session with the gateway, once.
    let ups = lines_saying(&agent.logs(), "tunnel session up");
    assert_eq!(ups.len(), 1, "{ups:?}");
    assert_eq!(ups[0]["peer"], lab.gw_keys.public.as_str());

    agent.signal("STOP");
    let (_, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(status(&answer), 504, "{}", String::from_utf8_lossy(&answer));
    assert_eq!(
        lab.gw.metric(
            "trellis_tunnel_dial_failures_total{route=\"shoot--local--a\",reason=\"timeout\"}"
        ),
        1.0
    );
    // The one connection no tunnel stream was opened for.
    let line = lab.gw.wait_access_log(|l| l["tunnel_peer"] == "-");
    assert_eq!(line["reason"], "error:timeout", "{line}");
    // boringtun starts a handshake 15 s after the unanswered data, and warns.
    let warned = wait_for(Duration::from_secs(40), || {
        json_lines(&lab.gw.logs()).into_iter().find(|l| {
            l["level"] == "WARN" && l["target"].as_str().unwrap_or("").starts_with("boringtun")
        })
    });
    let Some(warned) = warned else {
        panic!("no warning from boringtun:\n{}", lab.gw.logs());
    };
    assert_eq!(
        (&warned["span"]["route"], &warned["span"]["peer"]),
        (&route.into(), &peer.into()),
        "{warned}"
    );
    agent.signal("CONT");
}

/// An agent whose gateway never answers logs boringtun's handshake retries with its route
/// (`agent`) and the gateway's key.
#[test]
fn an_unanswered_agent_logs_boringtuns_retries_with_route_and_peer() {
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let (agent_keys, gw_keys) = (keys(), keys());
    let agent = Agent::start(
        &agent_keys,
        &gw_keys.public,
        silent.local_addr().unwrap(),
        "[\"127.0.0.0/8\"]",
    );
    let retried = wait_for(Duration::from_secs(20), || {
        lines_saying(&agent.logs(), "HANDSHAKE(REKEY_TIMEOUT)")
            .into_iter()
            .next()
    });
    let Some(retried) = retried else {
        panic!("no retry logged:\n{}", agent.logs());
    };
    assert_eq!(
        (
            &retried["target"],
            &retried["span"]["route"],
            &retried["span"]["peer"]
        ),
        (
            &"boringtun::noise::timers".into(),
            &"agent".into(),
            &gw_keys.public.as_str().into()
        ),
        "{retried}"
    );
}

/// Writes `data` and reads as many bytes back from an echo.
async fn echo_round<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    s: &mut S,
    data: &[u8],
) -> Vec<u8> {
    s.write_all(data).await.unwrap();
    s.flush().await.unwrap();
    let mut got = vec![0u8; data.len()];
    tokio::time::timeout(Duration::from_secs(20), s.read_exact(&mut got))
        .await
        .expect("echo in time")
        .unwrap();
    got
}

#[tokio::test(flavor = "multi_thread")]
async fn a_draining_gateway_keeps_its_tunnel_until_the_last_tunneled_stream_ended() {
    let lab = Lab::start();
    let _agent = lab.agent("[\"127.0.0.0/8\"]");
    let (target, _) = counting_echo_at("127.0.0.1", b"").await;
    let (mut tls, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(answer, OK);
    assert_eq!(echo_round(&mut tls, b"before").await, b"before");
    lab.gw.signal("TERM");
    // Readiness fails at once; the stream (and so the tunnel) still carries bytes.
    assert!(
        wait_for(Duration::from_secs(5), || {
            (http_get(lab.gw.admin, "/ready").map(|(s, _)| s) != Some(200)).then_some(())
        })
        .is_some()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let data = vec![7u8; 300_000];
    assert_eq!(echo_round(&mut tls, &data).await, data);
    drop(tls);
}

/// SIGTERM drains the agent as it drains the other roles: readiness fails at once, the
/// connection it relays still carries bytes and holds the process, which exits (0) once that
/// connection ended; the connection has its access-log line.
#[tokio::test(flavor = "multi_thread")]
async fn a_draining_agent_fails_readiness_and_exits_once_its_last_connection_ended() {
    let lab = Lab::start();
    let mut agent = lab.agent("[\"127.0.0.0/8\"]");
    let (target, _) = counting_echo_at("127.0.0.1", b"").await;
    let (mut tls, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(answer, OK);
    assert_eq!(echo_round(&mut tls, b"before").await, b"before");
    let pid = agent.child.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    assert!(
        wait_for(Duration::from_secs(5), || {
            (http_get(agent.admin, "/ready").map(|(s, _)| s) != Some(200)).then_some(())
        })
        .is_some(),
        "{}",
        agent.logs()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let data = vec![7u8; 300_000];
    assert_eq!(echo_round(&mut tls, &data).await, data);
    assert!(
        agent.child.try_wait().unwrap().is_none(),
        "the agent left before its open connection ended:\n{}",
        agent.logs()
    );
    drop(tls);
    let status = wait_for(Duration::from_secs(10), || agent.child.try_wait().unwrap());
    let logs = agent.logs();
    assert!(status.is_some_and(|s| s.success()), "{status:?}\n{logs}");
    assert!(logs.contains("\"agent stopped\""), "{logs}");
    let line = logs
        .lines()
        .find(|l| l.contains("\"message\":\"access\""))
        .unwrap_or_else(|| panic!("no access line:\n{logs}"));
    assert!(
        line.contains(&format!("\"target_name\":\"{target}\""))
            && line.contains("\"rx_bytes\":300006"),
        "{line}"
    );
}

/// A soak across WireGuard rekeys (the agent starts a new handshake 120 s into a session it
/// sends on): 210 s of new connections every 2 s plus one long stream, all byte-exact.
/// `cargo test --test tunnel -- --ignored soak --nocapture`.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "runs 210 s; see the doc comment for the command"]
async fn soak_across_rekeys_with_connections_opened_throughout() {
    let lab = Lab::start();
    let _agent = lab.agent("[\"127.0.0.0/8\"]");
    let (target, _) = counting_echo_at("127.0.0.1", b"").await;
    let (mut long, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(answer, OK);
    let start = std::time::Instant::now();
    let (mut opened, mut round) = (0, 0u32);
    while start.elapsed() < Duration::from_secs(210) {
        let (mut tls, answer) = lab.connect(&target.to_string()).await;
        assert_eq!(answer, OK, "connection {opened} at {:?}", start.elapsed());
        let data: Vec<u8> = (0..65_536u32).map(|i| (i ^ round) as u8).collect();
        assert_eq!(echo_round(&mut tls, &data).await, data);
        opened += 1;
        round += 1;
        let data = vec![round as u8; 10_000];
        assert_eq!(echo_round(&mut long, &data).await, data);
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let handshakes = lab
        .gw
        .metric("trellis_tunnel_handshakes_total{route=\"shoot--local--a\",result=\"ok\"}");
    println!(
        "soak: {opened} connections over {:?}, {handshakes} handshakes",
        start.elapsed()
    );
    assert!(handshakes >= 2.0, "a rekey happened");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_changed_peer_key_ends_its_streams_at_once_as_route_removed() {
    let lab = Lab::start();
    let _agent = lab.agent("[\"127.0.0.0/8\"]");
    let (target, _) = counting_echo_at("127.0.0.1", b"").await;
    let (mut tls, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(answer, OK);
    assert_eq!(echo_round(&mut tls, b"x").await, b"x");

    // The same route with another peer key: the old peer's streams end now, not at a timeout.
    let other = keys();
    lab.gw.write_routes(&route(
        &lab.shoot,
        &other.public,
        "[\"192.168.128.5/32\", \"127.0.0.0/8\"]",
        "[\"127.0.0.0/8\"]",
    ));
    let mut buf = [0u8; 16];
    let ended = tokio::time::timeout(Duration::from_secs(5), tls.read(&mut buf)).await;
    assert!(
        matches!(ended, Ok(Ok(0)) | Ok(Err(_))),
        "the stream did not end: {ended:?}"
    );
    lab.gw
        .wait_access_log(|l| l["reason"] == "error:route_removed");
    assert_eq!(
        lab.gw
            .metric("trellis_tunnel_streams_active{route=\"shoot--local--a\"}"),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_private_key_file_is_taken_in_and_restarts_the_tunnels() {
    let lab = Lab::start();
    let agent = lab.agent("[\"127.0.0.0/8\"]");
    let (target, _) = counting_echo_at("127.0.0.1", b"").await;
    let (mut tls, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(answer, OK);
    assert_eq!(echo_round(&mut tls, b"old key").await, b"old key");

    // The key file is replaced (a Secret update): the gateway takes the new key in, its
    // tunnels restart (the open stream ends), and the agent that still trusts the old key
    // no longer gets through.
    let fresh = keys();
    let key_file = lab._dir.path("gateway.key");
    let tmp = lab._dir.path(".gateway.key.tmp");
    std::fs::write(&tmp, format!("{}\n", fresh.private)).unwrap();
    std::fs::rename(&tmp, &key_file).unwrap();
    let mut buf = [0u8; 16];
    let ended = tokio::time::timeout(Duration::from_secs(15), tls.read(&mut buf)).await;
    assert!(
        matches!(ended, Ok(Ok(0)) | Ok(Err(_))),
        "the stream did not end: {ended:?}"
    );
    let (_, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(status(&answer), 504, "{}", String::from_utf8_lossy(&answer));
    drop(agent);

    // An agent given the new public key is let in.
    let agent = Agent::start(
        &lab.agent_keys,
        &fresh.public,
        lab.gw.addr("wireguard"),
        "[\"127.0.0.0/8\"]",
    );
    assert!(
        agent.wait_ready(Duration::from_secs(15)),
        "{}",
        agent.logs()
    );
    let (mut tls, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(answer, OK);
    assert_eq!(echo_round(&mut tls, b"new key").await, b"new key");
}

#[tokio::test(flavor = "multi_thread")]
async fn two_agents_share_new_streams_and_a_killed_one_is_passed_over_and_its_streams_end() {
    let lab = Lab::start();
    // A second agent replica: its own key, its own tunnel address, the same networks.
    let second = keys();
    let two_peers = format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- name: shoot--local--a
  tunnel:
    wireguard:
      peers:
      - publicKey: \"{}\"
        allowedIPs: [\"192.168.128.5/32\", \"127.0.0.0/8\"]
      - publicKey: \"{}\"
        allowedIPs: [\"192.168.128.6/32\", \"127.0.0.0/8\"]
      localAddresses: [192.168.128.1]
  egress:
    clientSources: [\"127.0.0.1/32\"]
    tls: {}
    allowedNetworks: [\"127.0.0.0/8\"]
",
        lab.agent_keys.public,
        second.public,
        lab.shoot.tls_yaml()
    );
    // The second agent becomes ready only once the gateway took this table in.
    lab.gw.write_routes(&two_peers);
    let mut first = lab.agent("[\"127.0.0.0/8\"]");
    let other = Agent::start_at(
        &second,
        &lab.gw_keys.public,
        lab.gw.addr("wireguard"),
        "[\"127.0.0.0/8\"]",
        "192.168.128.6",
    );
    assert!(
        other.wait_ready(Duration::from_secs(10)),
        "{}",
        other.logs()
    );
    let (target, _) = counting_echo_at("127.0.0.1", b"").await;
    let target = target.to_string();

    // Held streams are spread over both replicas.
    let mut held = Vec::new();
    for i in 0..8u8 {
        let (mut tls, answer) = lab.connect(&target).await;
        assert_eq!(answer, OK, "{}", String::from_utf8_lossy(&answer));
        assert_eq!(echo_round(&mut tls, &[i]).await, [i]);
        held.push(tls);
    }
    let streams = "trellis_tunnel_streams_active{route=\"agent\"}";
    let on_first = first.metric(streams);
    assert_eq!(on_first + other.metric(streams), 8.0);
    assert!(
        (3.0..=5.0).contains(&on_first),
        "not spread: {on_first} of 8 on the first agent"
    );

    // The first replica dies; its session still looks live to the gateway. New CONNECTs
    // every 100 ms all succeed: at most one waits for the failover.
    let _ = first.child.kill();
    let _ = first.child.wait();
    let mut slowest = Duration::ZERO;
    let mut slow = 0;
    for i in 0..20u8 {
        let t = std::time::Instant::now();
        let (mut tls, answer) = lab.connect(&target).await;
        assert_eq!(
            answer,
            OK,
            "connect {i}: {}",
            String::from_utf8_lossy(&answer)
        );
        assert_eq!(echo_round(&mut tls, &[i]).await, [i]);
        let took = t.elapsed();
        slowest = slowest.max(took);
        if took > Duration::from_millis(700) {
            slow += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("slowest CONNECT after the kill: {slowest:?}");
    assert!(
        slow <= 1,
        "{slow} CONNECTs waited for a failover; slowest {slowest:?}"
    );
    assert!(slowest < Duration::from_secs(3), "slowest {slowest:?}");

    // Streams through the dead replica end although nothing is sent on them (keepalive
    // probes go unanswered, and the gateway aborts after 60 s of silence); the others stay
    // open and still echo.
    let waits: Vec<_> = held
        .into_iter()
        .map(|mut tls| {
            tokio::spawn(async move {
                let mut buf = [0u8; 1];
                let read = tokio::time::timeout(Duration::from_secs(100), tls.read(&mut buf));
                (read.await.is_ok(), tls)
            })
        })
        .collect();
    let mut ended = 0;
    let mut alive = 0;
    for (i, wait) in waits.into_iter().enumerate() {
        let (done, mut tls) = wait.await.unwrap();
        if done {
            ended += 1;
            continue;
        }
        let byte = [100 + i as u8];
        assert_eq!(echo_round(&mut tls, &byte).await, byte, "stream {i}");
        alive += 1;
    }
    assert_eq!(
        ended as f64, on_first,
        "streams of the dead replica that ended"
    );
    assert_eq!(alive as f64, 8.0 - on_first);
}

/// Sends `len` bytes over `s` while reading the echo back, half-closes, and asserts that
/// exactly the bytes sent came back before the echo closed.
async fn echo_exact_with_half_close<S: tokio::io::AsyncRead + tokio::io::AsyncWrite>(
    s: S,
    len: u32,
) {
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
    let (mut r, mut w) = tokio::io::split(s);
    let (_, got) = tokio::join!(
        async {
            w.write_all(&data).await.unwrap();
            w.flush().await.unwrap();
            w.shutdown().await.unwrap();
        },
        async {
            let mut got = Vec::new();
            tokio::time::timeout(Duration::from_secs(60), r.read_to_end(&mut got))
                .await
                .expect("echo in time")
                .unwrap();
            got
        }
    );
    assert_eq!(got.len(), data.len());
    assert!(got == data, "bytes differ");
}

/// A TCP forwarder on loopback towards `to` whose connections the test can cut at once.
struct Cutter {
    addr: SocketAddr,
    cut: tokio::sync::watch::Sender<u32>,
    /// Connections forwarded so far.
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Cutter {
    async fn start(to: SocketAddr) -> Cutter {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, _) = tokio::sync::watch::channel(0u32);
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (cuts, count) = (cut.clone(), accepted.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut down, _)) = listener.accept().await else {
                    return;
                };
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut cuts = cuts.subscribe();
                tokio::spawn(async move {
                    let Ok(mut up) = tokio::net::TcpStream::connect(to).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                        _ = cuts.changed() => {}
                    }
                    // Dropped: both connections close.
                });
            }
        });
        Cutter {
            addr,
            cut,
            accepted,
        }
    }

    /// Ends every connection it forwards now.
    fn cut(&self) {
        self.cut.send_modify(|n| *n += 1);
    }
}

/// A UDP forwarder on loopback towards `to` that the test opens and closes: closed, every
/// datagram either way is dropped (as a firewall without UDP would).
struct UdpGate {
    addr: SocketAddr,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl UdpGate {
    async fn start(to: SocketAddr, open: bool) -> UdpGate {
        use std::sync::atomic::Ordering;
        let outer = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let inner = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        inner.connect(to).await.unwrap();
        let addr = outer.local_addr().unwrap();
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(open));
        let is_open = flag.clone();
        tokio::spawn(async move {
            let (mut a, mut b) = (vec![0u8; 65_536], vec![0u8; 65_536]);
            let mut client: Option<SocketAddr> = None;
            loop {
                tokio::select! {
                    got = outer.recv_from(&mut a) => {
                        let Ok((n, from)) = got else { continue };
                        client = Some(from);
                        if is_open.load(Ordering::SeqCst) {
                            let _ = inner.send(&a[..n]).await;
                        }
                    }
                    got = inner.recv(&mut b) => {
                        let Ok(n) = got else { continue };
                        if let (true, Some(c)) = (is_open.load(Ordering::SeqCst), client) {
                            let _ = outer.send_to(&b[..n], c).await;
                        }
                    }
                }
            }
        });
        UdpGate { addr, open: flag }
    }

    fn set_open(&self, open: bool) {
        self.open.store(open, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The YAML of a `connect` endpoint to `address`.
fn connect_endpoint(address: SocketAddr) -> String {
    format!("{{connect: {{address: \"{address}\", destination: \"{CONNECT_DESTINATION}\"}}}}")
}

/// The agent's `trellis_tunnel_endpoint` series of `kind`.
fn endpoint_kind(kind: &str) -> String {
    format!("trellis_tunnel_endpoint{{lane=\"0\",kind=\"{kind}\"}}")
}

/// WireGuard over TCP end to end: an agent whose only endpoint is the gateway's CONNECT port
/// brings the tunnel up through it (the gateway's UDP socket never hears from it), and
/// egress carries 4 MB each way byte-exact with half-close through that stream.
#[tokio::test(flavor = "multi_thread")]
async fn an_agent_with_only_a_connect_endpoint_carries_egress_through_the_connect_port() {
    let lab = Lab::start_connect("");
    let endpoints = format!("[{}]", connect_endpoint(lab.gw.addr("connect")));
    let agent = lab.agent_with(&endpoints, "[\"127.0.0.0/8\"]");
    agent.wait_metric(&endpoint_kind("connect"), 1.0);
    assert_eq!(agent.metric(&endpoint_kind("udp")), 0.0);
    assert_eq!(lab.gw.metric("trellis_tunnel_tcp_endpoints_active"), 1.0);
    let (target, _) = counting_echo_at("127.0.0.1", b"").await;
    let (tls, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(answer, OK, "{}", String::from_utf8_lossy(&answer));
    echo_exact_with_half_close(tls, 4_000_000).await;
    let rx = "trellis_tunnel_bytes_total{route=\"shoot--local--a\",direction=\"rx\"}";
    assert!(lab.gw.metric(rx) >= 4_000_000.0);
    // The peer's endpoint is the stream, as /routes shows it.
    let routes = http_get(lab.gw.debug, "/routes").unwrap().1;
    assert!(routes.contains("\"tcp:127.0.0.1:"), "{routes}");
    let routed = "trellis_downstream_connections_total{listener=\"connect\",outcome=\"routed\"}";
    assert_eq!(lab.gw.metric(routed), 1.0);
    drop(agent);
    // The agent is gone: its stream ends, and with it the endpoint.
    lab.gw
        .wait_metric("trellis_tunnel_tcp_endpoints_active", |v| v == 0.0);
    let line = lab
        .gw
        .wait_access_log(|l| l["listener"] == "connect" && l["periodic"] == false);
    assert_eq!(line["backend"], "wireguard:wireguard", "{line}");
    assert_eq!(line["target_name"], CONNECT_DESTINATION, "{line}");
    assert!(line["rx_bytes"].as_u64().unwrap() > 4_000_000, "{line}");
    assert!(line["tx_bytes"].as_u64().unwrap() > 4_000_000, "{line}");
}

/// The stream under the tunnel is cut: the agent connects again at once, the session goes
/// on over the new stream (a tunneled connection open across the cut still echoes), and the
/// gateway logs the old stream's end.
#[tokio::test(flavor = "multi_thread")]
async fn a_cut_connect_stream_is_reconnected_and_tunneled_connections_survive_it() {
    let lab = Lab::start_connect("");
    let cutter = Cutter::start(lab.gw.addr("connect")).await;
    let endpoints = format!("[{}]", connect_endpoint(cutter.addr));
    let agent = lab.agent_with(&endpoints, "[\"127.0.0.0/8\"]");
    let (target, _) = counting_echo_at("127.0.0.1", b"").await;
    let (mut tls, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(answer, OK);
    assert_eq!(
        echo_round(&mut tls, b"before the cut").await,
        b"before the cut"
    );

    cutter.cut();
    let reconnected = wait_for(Duration::from_secs(20), || {
        let again = cutter.accepted.load(std::sync::atomic::Ordering::SeqCst) >= 2;
        (again && agent.metric(&endpoint_kind("connect")) == 1.0).then_some(())
    });
    assert!(reconnected.is_some(), "no second stream:\n{}", agent.logs());
    assert!(
        agent.wait_ready(Duration::from_secs(20)),
        "{}",
        agent.logs()
    );
    // The connection opened before the cut carries on over the new stream.
    let data = vec![0x5a; 200_000];
    assert_eq!(echo_round(&mut tls, &data).await, data);
    let changes = "trellis_tunnel_endpoint_changes_total{lane=\"0\",kind=\"connect\"}";
    agent.wait_metric(changes, 2.0);
    lab.gw
        .wait_access_log(|l| l["listener"] == "connect" && l["periodic"] == false);
    assert_eq!(lab.gw.metric("trellis_tunnel_tcp_endpoints_active"), 1.0);
    // And new connections go through as well.
    let (tls, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(answer, OK);
    echo_exact_with_half_close(tls, 1_000_000).await;
}

/// UDP preferred: with UDP blocked the agent falls back to its `connect` endpoint within the
/// answer bound; once UDP answers again its probes bring it back there and the stream is
/// closed; when UDP is lost again, the silence makes the lane ask and move back to the
/// stream. A tunneled connection open throughout roams with it each time.
#[tokio::test(flavor = "multi_thread")]
async fn blocked_udp_falls_back_to_the_connect_port_and_comes_back_when_udp_answers() {
    let lab = Lab::start_connect("");
    let gate = UdpGate::start(lab.gw.addr("wireguard"), false).await;
    let endpoints = format!(
        "[{{udp: \"{}\"}}, {}]",
        gate.addr,
        connect_endpoint(lab.gw.addr("connect"))
    );
    let started = std::time::Instant::now();
    let agent = lab.agent_with(&endpoints, "[\"127.0.0.0/8\"]");
    eprintln!(
        "up over the CONNECT port {:?} after the start",
        started.elapsed()
    );
    agent.wait_metric(&endpoint_kind("connect"), 1.0);
    let (target, _) = counting_echo_at("127.0.0.1", b"").await;
    let (mut tls, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(answer, OK);
    assert_eq!(echo_round(&mut tls, b"over tcp").await, b"over tcp");

    gate.set_open(true);
    let opened = std::time::Instant::now();
    let back = wait_for(Duration::from_secs(60), || {
        (agent.metric(&endpoint_kind("udp")) == 1.0).then_some(())
    });
    assert!(back.is_some(), "not back on udp:\n{}", agent.logs());
    assert_eq!(agent.metric(&endpoint_kind("connect")), 0.0);
    eprintln!("back on udp {:?} after it answered again", opened.elapsed());
    lab.gw
        .wait_metric("trellis_tunnel_tcp_endpoints_active", |v| v == 0.0);
    let routes = http_get(lab.gw.debug, "/routes").unwrap().1;
    assert!(!routes.contains("\"tcp:"), "{routes}");
    let data = vec![0xa5; 300_000];
    assert_eq!(echo_round(&mut tls, &data).await, data);
    let (fresh, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(answer, OK);
    echo_exact_with_half_close(fresh, 1_000_000).await;

    // UDP lost while the lane is on it and idle: the lane asks after 20 s of silence and
    // moves to the CONNECT port when nobody answers (the session alone would keep it for
    // 140 s), and the connection open throughout follows it.
    gate.set_open(false);
    let closed = std::time::Instant::now();
    let moved = wait_for(Duration::from_secs(70), || {
        (agent.metric(&endpoint_kind("connect")) == 1.0).then_some(())
    });
    assert!(moved.is_some(), "still on udp:\n{}", agent.logs());
    eprintln!(
        "on the CONNECT port {:?} after udp was lost",
        closed.elapsed()
    );
    let data = vec![0x3c; 300_000];
    assert_eq!(echo_round(&mut tls, &data).await, data);
}

/// A CONNECT to the `connectDestination` is answered with exactly the `200` head; frames
/// that are no WireGuard message (an empty one, garbage) are dropped and counted, and a
/// stream that then stays silent ends at the idle timeout, logged as such.
#[tokio::test(flavor = "multi_thread")]
async fn a_silent_connect_stream_ends_at_the_idle_timeout_and_junk_frames_are_dropped() {
    let lab = Lab::start_connect("timeouts: {idle: 2s}\n");
    let mut s = tokio::net::TcpStream::connect(lab.gw.addr("connect"))
        .await
        .unwrap();
    let head = format!(
        "CONNECT {CONNECT_DESTINATION} HTTP/1.1\r\nHost: x\r\nX-Gardener-Destination: {CONNECT_DESTINATION}\r\n\r\n"
    );
    // The head and two frames in one write: the bytes behind the head are the stream's.
    let mut first = head.into_bytes();
    first.extend_from_slice(b"\x00\x00\x00\x05junk!");
    let start = std::time::Instant::now();
    s.write_all(&first).await.unwrap();
    let mut answer = vec![0u8; OK.len()];
    s.read_exact(&mut answer).await.unwrap();
    assert_eq!(answer, OK);
    let invalid = "trellis_tunnel_packets_dropped_total{reason=\"invalid\"}";
    lab.gw.wait_metric(invalid, |v| v >= 2.0);
    assert_eq!(lab.gw.metric("trellis_tunnel_tcp_endpoints_active"), 1.0);
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    assert!(matches!(read, Ok(Ok(0))), "{read:?}");
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(1500), "ended after {took:?}");
    let line = lab
        .gw
        .wait_access_log(|l| l["listener"] == "connect" && l["periodic"] == false);
    assert_eq!(line["reason"], "idle_timeout", "{line}");
    assert_eq!(lab.gw.metric("trellis_tunnel_tcp_endpoints_active"), 0.0);
}

/// Whoever can open a CONNECT but holds no peer's key cannot keep a stream: one that keeps
/// sending frames no key authenticates ends at `timeouts.handshake` (`not_authenticated`),
/// long before the idle timeout, while the agent's stream under the same bound stays (it is
/// the only other stream the CONNECT listener ever routed) and carries egress.
#[tokio::test(flavor = "multi_thread")]
async fn a_connect_stream_without_an_authenticated_packet_ends_at_the_handshake_timeout() {
    let lab = Lab::start_connect("timeouts: {handshake: 1s, idle: 60s}\n");
    let endpoints = format!("[{}]", connect_endpoint(lab.gw.addr("connect")));
    let agent = lab.agent_with(&endpoints, "[\"127.0.0.0/8\"]");
    agent.wait_metric(&endpoint_kind("connect"), 1.0);
    let up = std::time::Instant::now();
    let s = tokio::net::TcpStream::connect(lab.gw.addr("connect"))
        .await
        .unwrap();
    let (mut r, mut w) = s.into_split();
    let head = format!(
        "CONNECT {CONNECT_DESTINATION} HTTP/1.1\r\nHost: x\r\nX-Gardener-Destination: {CONNECT_DESTINATION}\r\n\r\n"
    );
    w.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; OK.len()];
    r.read_exact(&mut answer).await.unwrap();
    assert_eq!(answer, OK);
    let start = std::time::Instant::now();
    // A frame every 200 ms: never idle, never authenticated.
    let writer = tokio::spawn(async move {
        while w.write_all(b"\x00\x04junk").await.is_ok() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), r.read_to_end(&mut rest)).await;
    let took = start.elapsed();
    assert!(read.is_ok(), "the stream was not closed");
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_secs(10),
        "ended after {took:?}"
    );
    writer.abort();
    let line = lab.gw.wait_access_log(|l| {
        l["listener"] == "connect" && l["periodic"] == false && l["reason"] != "-"
    });
    assert_eq!(line["reason"], "not_authenticated", "{line}");
    // The agent's stream outlives the bound.
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(up.elapsed())).await;
    let routed = "trellis_downstream_connections_total{listener=\"connect\",outcome=\"routed\"}";
    assert_eq!(lab.gw.metric(routed), 2.0);
    assert_eq!(lab.gw.metric("trellis_tunnel_tcp_endpoints_active"), 1.0);
    let (target, _) = counting_echo_at("127.0.0.1", b"").await;
    let (tls, answer) = lab.connect(&target.to_string()).await;
    assert_eq!(answer, OK, "{}", String::from_utf8_lossy(&answer));
    echo_exact_with_half_close(tls, 100_000).await;
    drop(agent);
}
