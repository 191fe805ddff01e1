//! WireGuard tunnels with real peers in network namespaces (root only): the gateway in `seed`
//! terminating wireguard-go shoots for kube-apiserver's egress, `trellis agent` as the shoot
//! side of a wireguard-go seed, two shoots with identical networks, table changes while a
//! stream runs, a shoot that roams and a gateway killed and started again. Each shoot
//! forwards between its tunnel and a `targets` namespace that holds the shoot's addresses
//! (10.250.0.10, fd00:250::10); the seed reaches the shoot over a veth underlay
//! (10.99.<shoot>.0/24). The test's own thread moves into `seed` (setns), so the egress
//! client is the Rust client of the other egress tests and every socket it opens is the
//! seed's. WireGuard over TCP: `trellis agent` through the gateway's CONNECT port with UDP
//! dropped by nftables (and back on UDP once it is not), and wireguard-go through Debian's
//! `udptunnel` and a CONNECT relay. Needs root, wireguard-go, wg, ping, setpriv and
//! /dev/net/tun (and nft, udptunnel for the TCP ones); skipped otherwise.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::egress::*;
use common::netns::{self, Lab, in_ns, listen_in};
use common::wg::{self, Keypair, WgConfig, WgGo, WgPeer};
use common::*;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

/// An egress client's stream.
type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// What the gateway routes to each shoot peer: its tunnel addresses and the shoot's networks.
const PEER_ALLOWED: &str =
    r#"["192.168.128.5/32", "fd8f::5/128", "10.250.0.0/16", "fd00:250::/64"]"#;

/// The applied-reloads counter.
const APPLIED: &str = "trellis_routing_table_reloads_total{result=\"applied\"}";

/// A lab with namespaces `names`, or none (with the reason printed) if it cannot run here.
fn lab(test: &str, names: &[&str]) -> Option<Lab> {
    lab_with(test, names, &[])
}

/// [`lab`], when the tools `more` are installed too.
fn lab_with(test: &str, names: &[&str], more: &[&str]) -> Option<Lab> {
    let mut tools = vec!["wireguard-go", "wg", "ping", "setpriv"];
    tools.extend_from_slice(more);
    let mut reason = netns::skip_reason(&tools);
    if reason.is_none() && !Path::new("/dev/net/tun").exists() {
        reason = Some("no /dev/net/tun".into());
    }
    if let Some(reason) = &reason {
        common::skip(test, reason);
        return None;
    }
    Some(Lab::new(names))
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// A runtime whose worker threads start in the calling thread's namespace.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// True once a ping from `ns` to `ip` is answered within `limit`.
fn ping_within(lab: &Lab, ns: &str, ip: &str, limit: Duration) -> bool {
    let args = ["ping", "-n", "-c", "1", "-W", "1", ip];
    wait_for(limit, || lab.sh(ns, &args).then_some(())).is_some()
}

/// Joins namespaces `seed`–`shoot` with the underlay 10.99.`k`.0/24 and `shoot`–`targets`
/// with the shoot's network (10.250.0.0/24, fd00:250::/64, the targets at .10 and ::10); the
/// shoot forwards, and the targets answer through it.
fn wire_shoot(lab: &Lab, (seed, shoot, targets): (usize, usize, usize), k: usize) {
    lab.veth(
        seed,
        &format!("10.99.{k}.1/24"),
        shoot,
        &format!("10.99.{k}.2/24"),
    );
    lab.veth_addrs(
        shoot,
        &["10.250.0.1/24", "fd00:250::1/64"],
        targets,
        &["10.250.0.10/24", "fd00:250::10/64"],
    );
    let (s, t) = (lab.ns(shoot), lab.ns(targets));
    let forward = ["net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"];
    assert!(lab.sh(&s, &["sysctl", "-qw", forward[0], forward[1]]));
    assert!(lab.sh(&t, &["ip", "route", "add", "default", "via", "10.250.0.1"]));
    assert!(lab.sh(
        &t,
        &["ip", "-6", "route", "add", "default", "via", "fd00:250::1"]
    ));
}

/// An echo server on `addr` in namespace `ns` (port 0: one the kernel picks) that sends
/// `greeting` first; returns its address.
fn echo_in(ns: &str, addr: SocketAddr, greeting: &'static [u8]) -> SocketAddr {
    let listener = tokio::net::TcpListener::from_std(listen_in(ns, addr)).unwrap();
    counting_echo_on(listener, greeting).0
}

fn at(addr: &str) -> SocketAddr {
    addr.parse().unwrap()
}

/// A shoot behind wireguard-go: its namespaces, key, device, egress PKI and the client
/// address (on the seed's loopback) that selects its route.
struct WgShoot {
    ns: String,
    targets: String,
    keys: Keypair,
    wg: WgGo,
    pki: Shoot,
    source: String,
}

fn table(routes: &[String]) -> String {
    format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n{}",
        routes.concat()
    )
}

/// The gateway in `seed` (namespace 0) and wireguard-go shoots, each initiating to it.
struct World {
    gw: Gateway,
    shoots: Vec<WgShoot>,
}

impl World {
    /// `shoots` shoots in namespaces 1+2i (the shoot) and 2+2i (its targets) of `lab`; the
    /// first `routed` of them have their route in the table. Call it from inside `seed`.
    fn start(lab: &Lab, shoots: usize, routed: usize) -> World {
        let gw_keys = wg::keypair();
        let key = lab.dir.path("gateway.key");
        std::fs::write(&key, format!("{}\n", gw_keys.private)).unwrap();
        let planned: Vec<(Keypair, Shoot)> = (0..shoots)
            .map(|i| {
                wire_shoot(lab, (0, 1 + 2 * i, 2 + 2 * i), i);
                let name = format!("shoot--local--{}", ["a", "b"][i]);
                (wg::keypair(), Shoot::new(&lab.dir, &name))
            })
            .collect();
        let source = |i: usize| format!("127.0.0.{}", 2 + i);
        let routes: Vec<String> = planned[..routed]
            .iter()
            .enumerate()
            .map(|(i, (keys, pki))| route(pki, &source(i), &keys.public))
            .collect();
        let gw = Gateway::start_listeners(
            &table(&routes),
            &[
                (
                    "egress",
                    "egress-connect",
                    &format!("  tls: {}", planned[0].1.tls_yaml()),
                ),
                (
                    "any-wireguard",
                    "wireguard",
                    &format!("  wireguard: {{privateKeyFile: {key:?}}}"),
                ),
            ],
            "",
        );
        let port = gw.addr("any-wireguard").port();
        let shoots = planned
            .into_iter()
            .enumerate()
            .map(|(i, (keys, pki))| {
                let ns = lab.ns(1 + 2 * i);
                let wg = WgGo::start(
                    lab,
                    &ns,
                    &WgConfig {
                        private: keys.private.clone(),
                        listen_port: None,
                        addresses: strings(&["192.168.128.5/32", "fd8f::5/128"]),
                        peers: vec![WgPeer {
                            public: gw_keys.public.clone(),
                            allowed_ips: strings(&["192.168.128.1/32", "fd8f::1/128"]),
                            endpoint: Some(format!("10.99.{i}.1:{port}")),
                            keepalive: Some(25),
                        }],
                        routes: strings(&["192.168.128.1/32", "fd8f::1/128"]),
                    },
                );
                WgShoot {
                    ns,
                    targets: lab.ns(2 + 2 * i),
                    keys,
                    wg,
                    pki,
                    source: source(i),
                }
            })
            .collect();
        World { gw, shoots }
    }

    /// Publishes a table of `routes` and waits until the gateway applied it.
    fn reload(&self, routes: &[String]) {
        let before = self.gw.metric(APPLIED);
        self.gw.write_routes(&table(routes));
        self.gw.wait_metric(APPLIED, |v| v > before);
    }

    /// Asserts that a ping from shoot `i` to the gateway's `ip` is answered within 15 s.
    fn ping(&self, lab: &Lab, i: usize, ip: &str) {
        let answered = ping_within(lab, &self.shoots[i].ns, ip, Duration::from_secs(15));
        assert!(answered, "ping {ip} from shoot {i}\n{}", self.logs());
    }

    /// Connects as shoot `i` to the echo at `target`, asserts exactly the 200, and runs
    /// [`echo_exact`] on the stream in a task.
    async fn stream(
        &self,
        i: usize,
        target: SocketAddr,
        (bytes, rate): (usize, Option<usize>),
        limit: Duration,
    ) -> tokio::task::JoinHandle<Result<Duration, String>> {
        let (tls, head, rest) = connect(&self.gw, &self.shoots[i], target).await;
        assert_eq!(head, OK, "{}", String::from_utf8_lossy(&head));
        assert!(rest.is_empty(), "bytes after the 200: {rest:?}");
        tokio::spawn(echo_exact(tls, bytes, rate, limit))
    }

    /// The time a stream of [`World::stream`] took; panics with the logs if it failed.
    async fn done(&self, stream: tokio::task::JoinHandle<Result<Duration, String>>) -> Duration {
        let result = stream.await.unwrap();
        result.unwrap_or_else(|e| panic!("{e}\n{}", self.logs()))
    }

    /// What the gateway and the shoots' devices logged, for failure messages.
    fn logs(&self) -> String {
        let devices: Vec<String> = self.shoots.iter().map(|s| s.wg.log()).collect();
        format!(
            "gateway:\n{}\nwireguard-go:\n{}",
            self.gw.logs(),
            devices.join("\n")
        )
    }
}

/// Shoot `pki`'s route (selected by client address `source`) with its peer's key `public`.
fn route(pki: &Shoot, source: &str, public: &str) -> String {
    format!(
        "- name: {}
  tunnel:
    wireguard:
      peers:
      - publicKey: \"{public}\"
        allowedIPs: {PEER_ALLOWED}
      localAddresses: [192.168.128.1, \"fd8f::1\"]
  egress:
    clientSources: [\"{source}/32\"]
    tls: {}
    allowedNetworks: [\"10.250.0.0/16\", \"fd00:250::/64\"]
",
        pki.namespace,
        pki.tls_yaml()
    )
}

/// CONNECTs to `target` as shoot `s`'s kube-apiserver does (from its client address, with
/// its client certificate); returns the stream, the response head and the bytes after it.
async fn connect(gw: &Gateway, s: &WgShoot, target: SocketAddr) -> (Tls, Vec<u8>, Vec<u8>) {
    connect_as(gw, &s.pki, &s.source, target).await
}

/// [`connect`] as the kube-apiserver of the shoot with egress PKI `pki` at client address
/// `source`.
async fn connect_as(
    gw: &Gateway,
    pki: &Shoot,
    source: &str,
    target: SocketAddr,
) -> (Tls, Vec<u8>, Vec<u8>) {
    let source = Some(source.parse().unwrap());
    let client = pki.client();
    let mut tls = handshake(gw.addr("egress"), source, "vpn-seed-server", &client, false)
        .await
        .unwrap();
    let request = format!("CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let end = loop {
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let read = tokio::time::timeout(Duration::from_secs(15), tls.read(&mut buf)).await;
        let n = read.expect("an answer to CONNECT in 15 s").unwrap_or(0);
        if n == 0 {
            break got.len();
        }
        got.extend_from_slice(&buf[..n]);
    };
    let rest = got.split_off(end);
    (tls, got, rest)
}

/// Connects as `s` to `target`, asserts the 200 and reads the echo's `greeting`.
async fn open(gw: &Gateway, s: &WgShoot, target: SocketAddr, greeting: &[u8]) -> Tls {
    let (mut tls, head, mut rest) = connect(gw, s, target).await;
    assert_eq!(head, OK, "{}", String::from_utf8_lossy(&head));
    let mut buf = [0u8; 256];
    while rest.len() < greeting.len() {
        let read = tokio::time::timeout(Duration::from_secs(10), tls.read(&mut buf)).await;
        let n = read.expect("the greeting in time").unwrap();
        assert!(n > 0, "closed before the greeting");
        rest.extend_from_slice(&buf[..n]);
    }
    assert_eq!(rest, greeting);
    tls
}

/// True if `s` ends (EOF or an error) within `limit`.
async fn ends(s: &mut Tls, limit: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(limit, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    });
    read.await.is_ok()
}

/// Sends `bytes` pseudo-random bytes over `s` (at up to `rate` bytes a second), half-closes,
/// and meanwhile reads what the echo behind it sends back until it closes. Returns how long
/// it took if exactly the bytes sent came back (length and SHA-256) within `limit`, else
/// what went wrong.
async fn echo_exact<S: AsyncRead + AsyncWrite>(
    s: S,
    bytes: usize,
    rate: Option<usize>,
    limit: Duration,
) -> Result<Duration, String> {
    let start = Instant::now();
    let (sent, received) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let (mut r, mut w) = tokio::io::split(s);
    let send = async {
        let mut sha = ring::digest::Context::new(&ring::digest::SHA256);
        let mut x = 0x2545_f491_4f6c_dd1d_u64 ^ (bytes as u64);
        let mut chunk = vec![0u8; 64 * 1024];
        while sent.load(Ordering::Relaxed) < bytes {
            let n = chunk.len().min(bytes - sent.load(Ordering::Relaxed));
            for b in chunk[..n].chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
            }
            w.write_all(&chunk[..n]).await?;
            sha.update(&chunk[..n]);
            let done = sent.fetch_add(n, Ordering::Relaxed) + n;
            if let Some(rate) = rate {
                let due = Duration::from_secs_f64(done as f64 / rate as f64);
                tokio::time::sleep_until(start + due).await;
            }
        }
        w.shutdown().await?;
        Ok::<_, std::io::Error>(sha.finish().as_ref().to_vec())
    };
    let receive = async {
        let mut sha = ring::digest::Context::new(&ring::digest::SHA256);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = r.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(sha.finish().as_ref().to_vec());
            }
            sha.update(&buf[..n]);
            received.fetch_add(n, Ordering::Relaxed);
        }
    };
    let both = tokio::time::timeout(limit, async { tokio::join!(send, receive) }).await;
    let (s, r) = (sent.into_inner(), received.into_inner());
    let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let at = at.unwrap_or_default().as_secs_f64();
    let progress = format!(
        "{s} of {bytes} bytes sent, {r} echoed, after {:?} (unix time {at:.3})",
        start.elapsed()
    );
    match both {
        Err(_) => Err(format!("not done in {limit:?}: {progress}")),
        Ok((Err(e), _) | (_, Err(e))) => Err(format!("{e}: {progress}")),
        Ok((Ok(out), Ok(back))) if r == bytes && out == back => Ok(start.elapsed()),
        Ok(_) => Err(format!("payload changed: {progress}")),
    }
}

/// `trellis_tunnel_<name>_total` of route `shoot--local--<shoot>` with label `label`.
fn counter(name: &str, shoot: &str, label: &str) -> String {
    format!("trellis_tunnel_{name}_total{{route=\"shoot--local--{shoot}\",{label}}}")
}

#[test]
fn wireguard_go_shoot_reaches_through_egress_needs_root_netns() {
    let name = "wireguard_go_shoot_reaches_through_egress_needs_root_netns";
    let Some(lab) = lab(name, &["seed", "shoot", "targets"]) else {
        return;
    };
    in_ns(&lab.ns(0), || {
        runtime().block_on(async {
            let w = World::start(&lab, 1, 1);
            w.ping(&lab, 0, "192.168.128.1");
            w.ping(&lab, 0, "fd8f::1");
            let s = &w.shoots[0];
            let v4 = echo_in(&s.targets, at("10.250.0.10:0"), b"");
            let v6 = at(&format!("[fd00:250::10]:{}", v4.port()));
            echo_in(&s.targets, v6, b"");
            // 100 MB each way over IPv4, 10 MB over IPv6; the client half-closes, the rest
            // still comes back.
            for (target, bytes) in [(v4, 100_000_000), (v6, 10_000_000)] {
                let limit = Duration::from_secs(600);
                let took = w
                    .done(w.stream(0, target, (bytes, None), limit).await)
                    .await;
                let rate = bytes as f64 / took.as_secs_f64() / 1e6;
                eprintln!("{bytes} bytes each way to {target}: {took:?} ({rate:.1} MB/s)");
            }
            assert!(w.gw.metric(&counter("handshakes", "a", "result=\"ok\"")) >= 1.0);
            let rx = counter("bytes", "a", "direction=\"rx\"");
            assert!(w.gw.metric(&rx) >= 110e6, "{}", w.gw.metrics());
            let device = s.wg.show();
            assert!(device.peers[0].rx >= 110_000_000, "{device:?}");
        })
    });
}

#[test]
fn trellis_agent_interoperates_with_wireguard_go_as_the_seed_needs_root_netns() {
    let name = "trellis_agent_interoperates_with_wireguard_go_as_the_seed_needs_root_netns";
    let Some(mut lab) = lab(name, &["seed", "shoot", "targets"]) else {
        return;
    };
    wire_shoot(&lab, (0, 1, 2), 0);
    let (seed, shoot, targets) = (lab.ns(0), lab.ns(1), lab.ns(2));
    let (seed_keys, agent_keys) = (wg::keypair(), wg::keypair());
    // The seed routes the agent's network and one the agent does not serve into the
    // tunnel, and waits for the agent to initiate.
    let nets = ["192.168.128.5/32", "10.250.0.0/16", "10.251.0.0/16"];
    let seed_wg = WgGo::start(
        &lab,
        &seed,
        &WgConfig {
            private: seed_keys.private.clone(),
            listen_port: Some(51820),
            addresses: strings(&["192.168.128.1/32"]),
            peers: vec![WgPeer {
                public: agent_keys.public.clone(),
                allowed_ips: strings(&nets),
                ..WgPeer::default()
            }],
            routes: strings(&nets),
        },
    );
    // As nobody, with no capabilities at all.
    let (agent, log, admin) = spawn_agent(
        &mut lab,
        &shoot,
        &agent_keys,
        &seed_keys.public,
        "[{udp: \"10.99.0.1:51820\"}]",
    );
    let logs = || {
        let agent = std::fs::read_to_string(&log).unwrap_or_default();
        format!("agent:\n{agent}\nwireguard-go:\n{}", seed_wg.log())
    };
    let get = |path: &str| in_ns(&shoot, || http_get(admin, path)).unwrap_or_default();
    let ready = wait_for(Duration::from_secs(10), || {
        (get("/ready").0 == 200).then_some(())
    });
    assert!(ready.is_some(), "agent not ready\n{}", logs());
    let status = std::fs::read_to_string(format!("/proc/{}/status", lab.children[agent].id()));
    let status = status.unwrap();
    for line in [
        "Uid:\t65534\t65534\t65534\t65534",
        "CapEff:\t0000000000000000",
        "CapBnd:\t0000000000000000",
    ] {
        assert!(status.contains(&format!("\n{line}\n")), "{status}");
    }
    assert!(
        lab.ping(&seed, "192.168.128.5"),
        "ping the agent\n{}",
        logs()
    );

    in_ns(&seed, || {
        runtime().block_on(async {
            let target = echo_in(&targets, at("10.250.0.10:0"), b"");
            let dial = |to: SocketAddr| async move {
                let dial = tokio::net::TcpStream::connect(to);
                tokio::time::timeout(Duration::from_secs(10), dial)
                    .await
                    .expect("an answer")
            };
            // Kernel TCP in the seed, through wireguard-go's TUN, the agent's stack and its
            // own socket to the target; byte-exact each way, half-closed.
            let stream = dial(target).await.unwrap();
            let took = echo_exact(stream, 20_000_000, None, Duration::from_secs(300)).await;
            eprintln!("20 MB each way through the agent: {took:?}");
            took.unwrap_or_else(|e| panic!("{e}\n{}", logs()));

            // Nothing listens on port 9 there: the agent's dial is refused, the SYN reset;
            // and an address outside its networks is reset without a dial, and counted.
            let outside = at(&format!("10.251.0.10:{}", target.port()));
            for (to, counted) in [
                (
                    at("10.250.0.10:9"),
                    "dial_failures_total{route=\"agent\",reason=\"refused\"",
                ),
                (outside, "packets_dropped_total{reason=\"not_allowed\""),
            ] {
                let refused = dial(to).await.map(|_| ()).unwrap_err().kind();
                assert_eq!(refused, std::io::ErrorKind::ConnectionRefused, "{}", logs());
                let metric = format!("trellis_tunnel_{counted}}}");
                assert_eq!(metric_in(&get("/metrics").1, &metric), 1.0, "{}", logs());
            }
        })
    });
}

#[test]
fn two_shoots_with_identical_networks_each_reach_their_own_needs_root_netns() {
    let name = "two_shoots_with_identical_networks_each_reach_their_own_needs_root_netns";
    let names = ["seed", "shoot-a", "targets-a", "shoot-b", "targets-b"];
    let Some(lab) = lab(name, &names) else {
        return;
    };
    in_ns(&lab.ns(0), || {
        runtime().block_on(async {
            let w = World::start(&lab, 2, 2);
            // The same address and port in both shoots, each with its own greeting.
            let target = echo_in(&w.shoots[0].targets, at("10.250.0.10:0"), b"shoot a\n");
            echo_in(&w.shoots[1].targets, target, b"shoot b\n");
            for (i, greeting) in [b"shoot a\n", b"shoot b\n"].into_iter().enumerate() {
                w.ping(&lab, i, "192.168.128.1");
                let mut tls = open(&w.gw, &w.shoots[i], target, greeting).await;
                tls.write_all(b"ping").await.unwrap();
                tls.shutdown().await.unwrap();
                let mut back = Vec::new();
                let read =
                    tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut back));
                read.await.unwrap().unwrap();
                assert_eq!(back, b"ping");
            }
            for shoot in ["a", "b"] {
                let ok = counter("handshakes", shoot, "result=\"ok\"");
                assert!(w.gw.metric(&ok) >= 1.0, "{}", w.gw.metrics());
            }
        })
    });
}

#[test]
fn reloads_add_change_remove_peers_while_another_shoot_streams_needs_root_netns() {
    let name = "reloads_add_change_remove_peers_while_another_shoot_streams_needs_root_netns";
    let names = ["seed", "shoot-a", "targets-a", "shoot-b", "targets-b"];
    let Some(lab) = lab(name, &names) else {
        return;
    };
    in_ns(&lab.ns(0), || {
        runtime().block_on(async {
            // Only shoot a is in the table at first; b's device already knocks.
            let w = World::start(&lab, 2, 1);
            let (a, b) = (&w.shoots[0], &w.shoots[1]);
            let target_a = echo_in(&a.targets, at("10.250.0.10:0"), b"");
            let target_b = echo_in(&b.targets, at("10.250.0.10:0"), b"b\n");
            // 50 MB each way over 12.5 s, while the table changes three times.
            let limit = Duration::from_secs(60);
            let stream = w
                .stream(0, target_a, (50_000_000, Some(4_000_000)), limit)
                .await;
            let route_a = route(&a.pki, &a.source, &a.keys.public);
            let route_b = |key: &str| route(&b.pki, &b.source, key);

            w.reload(&[route_a.clone(), route_b(&b.keys.public)]);
            w.ping(&lab, 1, "192.168.128.1");
            let mut first = open(&w.gw, b, target_b, b"b\n").await;

            // B's peer gets a new key: its streams end at once; the device with the new
            // key is b again.
            let new_keys = wg::keypair();
            w.reload(&[route_a.clone(), route_b(&new_keys.public)]);
            let ended = ends(&mut first, Duration::from_secs(5)).await;
            assert!(ended, "b's stream outlived b's old key");
            b.wg.set_private_key(&new_keys.private);
            w.ping(&lab, 1, "192.168.128.1");
            let mut second = open(&w.gw, b, target_b, b"b\n").await;

            w.reload(&[route_a]);
            let ended = ends(&mut second, Duration::from_secs(5)).await;
            assert!(ended, "b's stream outlived b's route");
            assert!(
                !stream.is_finished(),
                "a's stream ended before the table changes did"
            );
            eprintln!("a's 50 MB each way: {:?}", w.done(stream).await);
        })
    });
}

#[test]
fn roaming_mid_stream_needs_root_netns() {
    let Some(lab) = lab(
        "roaming_mid_stream_needs_root_netns",
        &["seed", "shoot", "targets"],
    ) else {
        return;
    };
    in_ns(&lab.ns(0), || {
        runtime().block_on(async {
            let w = World::start(&lab, 1, 1);
            let s = &w.shoots[0];
            let target = echo_in(&s.targets, at("10.250.0.10:0"), b"");
            let limit = Duration::from_secs(60);
            let stream = w
                .stream(0, target, (30_000_000, Some(5_000_000)), limit)
                .await;
            w.gw.wait_metric(&counter("bytes", "a", "direction=\"tx\""), |v| v > 5e6);
            let before = s.wg.show().listen_port;
            let port = if before == 51999 { 51998 } else { 51999 };
            // wireguard-go closes its old socket: what the gateway sends there is lost
            // until it learns the new endpoint from the shoot's next packet.
            s.wg.set_listen_port(port);
            let endpoint = format!("10.99.0.2:{port}");
            let learnt = wait_for(Duration::from_secs(10), || {
                let routes = http_get(w.gw.debug, "/routes")?.1;
                routes.contains(&endpoint).then_some(())
            });
            assert!(learnt.is_some(), "{endpoint} not learnt\n{}", w.logs());
            assert!(
                !stream.is_finished(),
                "the stream ended before the shoot roamed"
            );
            let took = w.done(stream).await;
            eprintln!("30 MB each way, roaming from port {before} to {port}: {took:?}");
        })
    });
}

#[test]
fn gateway_restart_recovers_a_sending_shoot_needs_root_netns() {
    let name = "gateway_restart_recovers_a_sending_shoot_needs_root_netns";
    let Some(mut lab) = lab(name, &["seed", "shoot", "targets"]) else {
        return;
    };
    in_ns(&lab.ns(0), || {
        runtime().block_on(async {
            let mut w = World::start(&lab, 1, 1);
            let target = echo_in(&w.shoots[0].targets, at("10.250.0.10:0"), b"");
            // The shoot keeps sending (five pings a second), as a busy shoot does.
            let (ns, pings) = (w.shoots[0].ns.clone(), lab.dir.path("pings.log"));
            lab.spawn_server(
                &ns,
                &["ping", "-n", "-q", "-i", "0.2", "192.168.128.1"],
                &pings,
            );
            let limit = Duration::from_secs(600);
            let stream = w
                .stream(0, target, (1_000_000_000, Some(5_000_000)), limit)
                .await;
            w.gw.wait_metric(&counter("bytes", "a", "direction=\"tx\""), |v| v > 2e6);

            // SIGKILL mid-traffic; wireguard-go keeps its session and sends on it.
            w.gw.kill_and_restart();
            stream.abort();
            let restarted = Instant::now();
            let recovered = loop {
                let (tls, head, _) = connect(&w.gw, &w.shoots[0], target).await;
                if head == OK {
                    break tls;
                }
                assert_eq!(status(&head), 504, "{}", String::from_utf8_lossy(&head));
                let waited = restarted.elapsed();
                assert!(
                    waited < Duration::from_secs(10),
                    "no tunnel after {waited:?}\n{}",
                    w.logs()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            let took = restarted.elapsed();
            eprintln!("a new egress connection through the tunnel {took:?} after the restart");
            let echoed = echo_exact(recovered, 1_000_000, None, Duration::from_secs(30)).await;
            echoed.unwrap_or_else(|e| panic!("{e}\n{}", w.logs()));
            let recovery = counter("handshakes", "a", "result=\"recovery\"");
            assert!(w.gw.metric(&recovery) >= 1.0, "{}", w.gw.metrics());
        })
    });
}

/// The `connectDestination` of the gateways below.
const CONNECT_DESTINATION: &str = "trellis-wireguard:51820";

/// A route for `trellis agent` (or any peer) with key `public` in the shoot of `pki`,
/// selected by client address 127.0.0.2; its networks are the targets' 10.250.0.0/16.
fn agent_route(pki: &Shoot, public: &str) -> String {
    table(&[format!(
        "- name: {}
  tunnel:
    wireguard:
      peers:
      - publicKey: \"{public}\"
        allowedIPs: [\"192.168.128.5/32\", \"10.250.0.0/16\"]
      localAddresses: [192.168.128.1]
  egress:
    clientSources: [\"127.0.0.2/32\"]
    tls: {}
    allowedNetworks: [\"10.250.0.0/16\"]
",
        pki.namespace,
        pki.tls_yaml()
    )])
}

/// A gateway in `seed` (call it from there) with an egress listener, a `wireguard` listener
/// on every address whose `connectDestination` is [`CONNECT_DESTINATION`], and an
/// `http-connect` listener (`any-connect`, every address) for it.
fn connect_gateway(lab: &Lab, pki: &Shoot, agent_public: &str) -> (Gateway, Keypair) {
    let gw_keys = wg::keypair();
    let key = lab.dir.path("gateway.key");
    std::fs::write(&key, format!("{}\n", gw_keys.private)).unwrap();
    let gw = Gateway::start_listeners(
        &agent_route(pki, agent_public),
        &[
            (
                "egress",
                "egress-connect",
                &format!("  tls: {}", pki.tls_yaml()),
            ),
            (
                "any-wireguard",
                "wireguard",
                &format!(
                    "  wireguard: {{privateKeyFile: {key:?}, connectDestination: {CONNECT_DESTINATION:?}}}"
                ),
            ),
            ("any-connect", "http-connect", ""),
        ],
        "",
    );
    (gw, gw_keys)
}

/// Loads nftables `rules` into namespace `ns`.
fn nft(lab: &Lab, ns: &str, rules: &str) {
    let file = lab.dir.path(&format!("nft-{}.rules", netns::serial()));
    std::fs::write(&file, rules).unwrap();
    let out = lab
        .exec(ns, &["nft", "-f", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "nft: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `trellis agent` as nobody, its UDP to the gateway dropped by nftables in its namespace:
/// the tunnel comes up through the gateway's CONNECT port and carries 100 MB each way with
/// half-close; a refused target is 502 and one nobody answers 504. Once the rules are gone,
/// the agent's probes bring it back to UDP (metrics and `/routes`), which carries the same.
#[test]
fn agent_over_the_connect_port_with_udp_dropped_then_back_on_udp_needs_root_netns() {
    let name = "agent_over_the_connect_port_with_udp_dropped_then_back_on_udp_needs_root_netns";
    let Some(mut lab) = lab_with(name, &["seed", "shoot", "targets"], &["nft"]) else {
        return;
    };
    wire_shoot(&lab, (0, 1, 2), 0);
    let (seed, shoot, targets) = (lab.ns(0), lab.ns(1), lab.ns(2));
    let agent_keys = wg::keypair();
    let pki = Shoot::new(&lab.dir, "shoot--local--a");
    // The gateway runs in `seed`; its process outlives the closure (it is this test's).
    let (gw, gw_keys) = in_ns(&seed, || connect_gateway(&lab, &pki, &agent_keys.public));
    let (wg_port, connect_port) = (
        gw.addr("any-wireguard").port(),
        gw.addr("any-connect").port(),
    );
    nft(
        &lab,
        &shoot,
        &format!(
            "table inet trellis_no_udp {{
  chain out {{ type filter hook output priority 0; ip daddr 10.99.0.1 udp dport {wg_port} drop; }}
  chain in {{ type filter hook input priority 0; ip saddr 10.99.0.1 udp sport {wg_port} drop; }}
}}
"
        ),
    );
    let endpoints = format!(
        "[{{udp: \"10.99.0.1:{wg_port}\"}}, {{connect: {{address: \"10.99.0.1:{connect_port}\", \
         destination: \"{CONNECT_DESTINATION}\"}}}}]"
    );
    let (agent, log, admin) =
        spawn_agent(&mut lab, &shoot, &agent_keys, &gw_keys.public, &endpoints);
    let get = |path: &str| in_ns(&shoot, || http_get(admin, path)).unwrap_or_default();
    let logs = || {
        let agent = std::fs::read_to_string(&log).unwrap_or_default();
        let tunnel = |text: &str| -> String {
            let lines = text.lines().filter(|l| l.starts_with("trellis_tunnel_"));
            lines.map(|l| format!("{l}\n")).collect()
        };
        // The table timer's "unchanged" lines crowd out what tells (CI shows a part only).
        let gateway: String = gw
            .logs()
            .lines()
            .filter(|l| !l.contains("routing table unchanged"))
            .map(|l| format!("{l}\n"))
            .collect();
        format!(
            "agent:\n{agent}\ngateway:\n{gateway}\nagent metrics:\n{}gateway metrics:\n{}",
            tunnel(&get("/metrics").1),
            tunnel(&in_ns(&seed, || gw.metrics()))
        )
    };
    let kind = |k: &str| {
        let series = format!("trellis_tunnel_endpoint{{lane=\"0\",kind=\"{k}\"}}");
        metric_in(&get("/metrics").1, &series)
    };
    let ready = wait_for(Duration::from_secs(30), || {
        (get("/ready").0 == 200).then_some(())
    });
    assert!(ready.is_some(), "agent not ready\n{}", logs());
    // The session may come up a moment before the lane shows the endpoint's kind.
    let on_connect = wait_for(Duration::from_secs(10), || {
        (kind("connect") == 1.0).then_some(())
    });
    assert!(on_connect.is_some(), "{}", logs());
    let proc_status = std::fs::read_to_string(format!("/proc/{}/status", lab.children[agent].id()));
    let proc_status = proc_status.unwrap();
    for line in [
        "Uid:\t65534\t65534\t65534\t65534",
        "CapEff:\t0000000000000000",
        "CapBnd:\t0000000000000000",
    ] {
        assert!(
            proc_status.contains(&format!("\n{line}\n")),
            "{proc_status}"
        );
    }
    // Nothing came over UDP: the rules dropped it.
    let dropped = lab.output(&shoot, &["nft", "list", "table", "inet", "trellis_no_udp"]);
    assert!(!dropped.is_empty());

    in_ns(&seed, || {
        runtime().block_on(async {
            carries(&gw, &pki, &targets, "the CONNECT port", &logs).await;
            assert_eq!(gw.metric("trellis_tunnel_tcp_endpoints_active"), 1.0);
        })
    });

    // UDP allowed again: the agent's probes find it.
    assert!(lab.sh(
        &shoot,
        &["nft", "delete", "table", "inet", "trellis_no_udp"]
    ));
    let back = wait_for(Duration::from_secs(90), || {
        (kind("udp") == 1.0).then_some(())
    });
    assert!(back.is_some(), "not back on udp\n{}", logs());
    let udp_endpoint = wait_for(Duration::from_secs(10), || {
        let routes = in_ns(&seed, || http_get(gw.debug, "/routes"))?.1;
        routes.contains("\"10.99.0.2:").then_some(())
    });
    assert!(udp_endpoint.is_some(), "{}", logs());
    in_ns(&seed, || {
        // The agent left the stream: it ends, and with it the endpoint.
        gw.wait_metric("trellis_tunnel_tcp_endpoints_active", |v| v == 0.0);
        runtime().block_on(carries(&gw, &pki, &targets, "UDP", &logs));
    });
}

/// What the agent's tunnel must carry over `path`: 100 MB byte-exact each way with
/// half-close to a target in `targets`; a refused target is 502 and one nobody answers 504.
async fn carries(gw: &Gateway, pki: &Shoot, targets: &str, path: &str, logs: &dyn Fn() -> String) {
    let target = echo_in(targets, at("10.250.0.10:0"), b"");
    let (tls, head, rest) = connect_as(gw, pki, "127.0.0.2", target).await;
    assert_eq!(head, OK, "{}", String::from_utf8_lossy(&head));
    assert!(rest.is_empty());
    let took = echo_exact(tls, 100_000_000, None, Duration::from_secs(600)).await;
    let took = took.unwrap_or_else(|e| panic!("over {path}: {e}\n{}", logs()));
    let rate = 100e6 / took.as_secs_f64() / 1e6;
    eprintln!("100 MB each way over {path}: {took:?} ({rate:.1} MB/s)");
    // Nothing listens on port 9: refused in the shoot, 502. 10.250.7.7 is inside the
    // agent's networks but the shoot has no route there: nobody answers, 504.
    for (to, code) in [(at("10.250.0.10:9"), 502), (at("10.250.7.7:80"), 504)] {
        let (_, head, _) = connect_as(gw, pki, "127.0.0.2", to).await;
        assert_eq!(
            status(&head),
            code,
            "over {path}, {to}: {}",
            String::from_utf8_lossy(&head)
        );
    }
}

/// Starts `trellis agent` in `ns` as nobody with no capabilities (its key `keys`, the
/// gateway's `gateway_public` at `endpoints`, YAML flow list), dialing 10.250.0.0/16;
/// its process index in the lab, its log and its admin address.
fn spawn_agent(
    lab: &mut Lab,
    ns: &str,
    keys: &Keypair,
    gateway_public: &str,
    endpoints: &str,
) -> (usize, std::path::PathBuf, SocketAddr) {
    let key = lab.dir.path("agent.key");
    std::fs::write(&key, format!("{}\n", keys.private)).unwrap();
    let admin = at("127.0.0.1:16911");
    let config = lab.dir.path("agent.yaml");
    let yaml = format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: AgentConfiguration
wireguard:
  privateKeyFile: {key:?}
  addresses: [192.168.128.5]
  gateway:
    publicKey: \"{gateway_public}\"
    endpoints: {endpoints}
    persistentKeepalive: 25s
networks: [\"10.250.0.0/16\"]
admin: {{address: \"{admin}\"}}
"
    );
    std::fs::write(&config, yaml).unwrap();
    let log = lab.dir.path("agent.log");
    let args = netns::agent_as_nobody(&config);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let agent = lab.spawn(ns, &args, &log);
    (agent, log, admin)
}

/// Kills a process started by the test when dropped.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A relay in front of the gateway's CONNECT port for clients that speak only the framing:
/// each connection to its address is CONNECTed to `to` with the destination header, and once
/// answered `200`, relayed both ways. Returns its address.
async fn connect_relay(to: SocketAddr) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut down, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut up = tokio::net::TcpStream::connect(to).await.unwrap();
                let head = format!(
                    "CONNECT {to} HTTP/1.1\r\nHost: {to}\r\nX-Gardener-Destination: {CONNECT_DESTINATION}\r\n\r\n"
                );
                up.write_all(head.as_bytes()).await.unwrap();
                let mut got = Vec::new();
                let mut buf = [0u8; 1024];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = up.read(&mut buf).await.unwrap();
                    assert!(n > 0, "closed before answering");
                    got.extend_from_slice(&buf[..n]);
                }
                let end = got.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                assert_eq!(&got[..end], OK);
                down.write_all(&got[end..]).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
            });
        }
    });
    addr
}

/// Interop of the framing: a wireguard-go shoot reaches the gateway through Debian's
/// `udptunnel` (which frames each datagram with a 16-bit big-endian length) and a relay that
/// puts a CONNECT in front: handshakes, pings and an egress exchange go through, each
/// datagram decoded by the other side. `udptunnel` sends from an ephemeral port but reads
/// only its bound one, while WireGuard answers whatever address a packet came from: an
/// nftables rule in the seed rewrites its source port to the bound one (stateless), as an
/// RTP-style peer would send. And its reader (`tcp_to_udp`) sends one datagram per `read()`
/// and keeps the rest of what that read returned until the next one (a full buffer ends it):
/// under load it falls behind and exits, whoever frames the stream. So the exchange keeps
/// about one datagram in flight towards it: pings one at a time, a small request and its
/// echo at a time (a datagram left behind goes out with the next one, or the inner
/// connection's retransmission).
#[test]
fn wireguard_go_through_udptunnel_reaches_the_connect_port_needs_root_netns() {
    let name = "wireguard_go_through_udptunnel_reaches_the_connect_port_needs_root_netns";
    let Some(lab) = lab_with(name, &["seed", "shoot", "targets"], &["nft", "udptunnel"]) else {
        return;
    };
    wire_shoot(&lab, (0, 1, 2), 0);
    let (seed, shoot, targets) = (lab.ns(0), lab.ns(1), lab.ns(2));
    let shoot_keys = wg::keypair();
    let pki = Shoot::new(&lab.dir, "shoot--local--a");
    // udptunnel's UDP port in the seed and wireguard-go's in the shoot.
    let port: u16 = 51999;
    nft(
        &lab,
        &seed,
        &format!(
            "table ip trellis_udptunnel {{
  chain out {{ type filter hook output priority -300; ip daddr 10.99.0.2 udp dport {port} udp sport != {port} udp sport set {port}; }}
}}
"
        ),
    );
    in_ns(&seed, || {
        runtime().block_on(async {
            let (gw, gw_keys) = connect_gateway(&lab, &pki, &shoot_keys.public);
            let relay = connect_relay(gw.addr("any-connect")).await;
            let ut_log = std::fs::File::create(lab.dir.path("udptunnel.log")).unwrap();
            let udptunnel = std::process::Command::new("udptunnel")
                .args(["-c", &format!("127.0.0.1/{}", relay.port()), "-v"])
                .arg(format!("10.99.0.2/{port}"))
                .stdout(ut_log.try_clone().unwrap())
                .stderr(ut_log)
                .spawn()
                .unwrap();
            let _udptunnel = Killed(udptunnel);
            gw.wait_metric("trellis_tunnel_tcp_endpoints_active", |v| v == 1.0);
            let device = WgGo::start(
                &lab,
                &shoot,
                &WgConfig {
                    private: shoot_keys.private.clone(),
                    listen_port: Some(port),
                    addresses: strings(&["192.168.128.5/32"]),
                    peers: vec![WgPeer {
                        public: gw_keys.public.clone(),
                        allowed_ips: strings(&["192.168.128.1/32"]),
                        endpoint: Some(format!("10.99.0.1:{port}")),
                        keepalive: Some(25),
                    }],
                    routes: strings(&["192.168.128.1/32"]),
                },
            );
            let logs = || {
                let ut = std::fs::read_to_string(lab.dir.path("udptunnel.log"));
                let metrics: Vec<String> = gw
                    .metrics()
                    .lines()
                    .filter(|l| l.starts_with("trellis_tunnel"))
                    .map(str::to_owned)
                    .collect();
                format!(
                    "gateway:\n{}\n{}\nwireguard-go:\n{}\n{:?}\nudptunnel:\n{}",
                    gw.logs(),
                    metrics.join("\n"),
                    device.log(),
                    device.show(),
                    ut.unwrap_or_default()
                )
            };
            assert!(
                ping_within(&lab, &shoot, "192.168.128.1", Duration::from_secs(20)),
                "ping through udptunnel\n{}",
                logs()
            );
            for _ in 0..3 {
                let args = ["ping", "-n", "-c", "1", "-W", "5", "192.168.128.1"];
                assert!(lab.sh(&shoot, &args), "ping\n{}", logs());
            }
            let routes = http_get(gw.debug, "/routes").unwrap().1;
            assert!(routes.contains("\"tcp:127.0.0.1:"), "{routes}");
            let target = echo_in(&targets, at("10.250.0.10:0"), b"");
            let (mut tls, head, _) = connect_as(&gw, &pki, "127.0.0.2", target).await;
            assert_eq!(head, OK, "{}\n{}", String::from_utf8_lossy(&head), logs());
            for round in 0..3u8 {
                let data = vec![round; 1000];
                tls.write_all(&data).await.unwrap();
                let mut got = vec![0u8; data.len()];
                let read = tokio::time::timeout(Duration::from_secs(30), tls.read_exact(&mut got));
                let read = read.await;
                assert!(
                    matches!(read, Ok(Ok(_))),
                    "round {round}: {read:?}\n{}",
                    logs()
                );
                assert_eq!(got, data);
            }
            let invalid = "trellis_tunnel_packets_dropped_total{reason=\"invalid\"}";
            assert_eq!(gw.metric(invalid), 0.0, "{}", logs());
            let received = device.show().peers[0].rx;
            assert!(received >= 3000, "{received}");
        })
    });
}
