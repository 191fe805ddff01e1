//! The `tunnel` job: trellis's user-space WireGuard against a wireguard-go pair with kernel
//! TCP, in one run and in the same two namespaces (seed and shoot, joined by a veth pair;
//! the target server listens in the shoot namespace on 100.64.0.10:7001).
//!
//! Paths to the same server (a Rust client and server of the bench, the same for all):
//! - (a) anchor: kernel TCP from the seed namespace through wireguard-go (seed) ↔
//!   wireguard-go (shoot);
//! - (b) trellis: an egress client (TLS with a client certificate, `CONNECT`) → the trellis
//!   gateway → its tunnel → wireguard-go (the same shoot-side device as (a), which has both
//!   peers) → the server;
//! - (c) ceiling: the same egress client → the gateway → `trellis agent` in the shoot
//!   namespace, which dials the server with an ordinary socket;
//! - (d) the same as (c) with WireGuard over TCP: a second `trellis agent` whose only
//!   endpoint is the gateway's CONNECT port (`connect`, the datagrams framed with a 16-bit
//!   length on one TCP stream);
//! - direct: the same egress client → the gateway → a server in the seed namespace
//!   (`via: direct`), to tell the tunnel's own share of a figure from the egress leg's.
//!
//! The gateway's tunnels are reached only through its egress listener, so (b) and (c)
//! always carry TLS on the seed-side leg (loopback in the seed namespace); (a) has none.
//!
//! Figures: single-stream throughput each way (`BENCH_TUNNEL_MB`, default 200 MB, 3 runs
//! interleaved, median) with CPU seconds per GB of the processes on each side
//! (`/proc/PID/stat`); the tunnel round trip (ping); CONNECT → `200` over 500 CONNECTs one
//! at a time with 1,000 idle tunneled streams open, and the gateway's RSS before and after
//! opening them; the time until an egress CONNECT succeeds after `kill -9` of the gateway
//! while the shoot keeps sending (a ping every 100 ms); and 1,000 peers (one route each, an
//! in-bench boringtun initiator per peer with a UDP socket of its own) coming up cold and
//! again after a `kill -9`, with the RSS of 1,000 idle sessions. Needs root; prints SKIP
//! otherwise. It never sends a packet outside the namespaces it creates.
//!
//! `BENCH_TUNNEL_PERF=<dir>` records the gateway with `perf record -g` while the CONNECTs
//! with idle streams, the first (b) transfer each way and the 1,000-peer restart run
//! (`<dir>/<phase>.data`; the figures of those phases then carry perf's cost).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UdpSocket};
use tokio::runtime::Handle;

use crate::lab::{self, Keypair, Lab, Proc, WgDevice, WgGo, WgPeer};
use crate::{Stream, connect_reply, egress, tree_cpu, tree_rss};

/// The server in the shoot namespace.
const TARGET: &str = "100.64.0.10:7001";
/// The server in the seed namespace, for the `via: direct` route.
const DIRECT_TARGET: &str = "127.0.0.1:7002";
/// The gateway's wireguard listener (seed namespace).
const GATEWAY_WG: &str = "10.99.0.1:51820";
/// The gateway's egress listener (seed namespace).
const EGRESS: &str = "127.0.0.1:9443";
/// The gateway's CONNECT port (an `http-connect` listener), reached from the shoot.
const GATEWAY_CONNECT: &str = "10.99.0.1:8443";
/// The `wireguard` listener's `connectDestination`.
const CONNECT_DESTINATION: &str = "trellis-wireguard:51820";
/// The gateway's admin listener (seed namespace).
const ADMIN: &str = "127.0.0.1:15024";
/// The gateway's wireguard listener in the 1,000-peer part (seed namespace).
const PEERS_WG: &str = "127.0.0.1:51830";
/// The trellis gateway inside the shoot's tunnel (route `wg`).
const GATEWAY_INNER: &str = "192.168.130.1";
/// Idle tunneled streams held open for the latency and memory figures.
const IDLE: usize = 1000;
/// CONNECTs timed one at a time.
const CONNECTS: usize = 500;
/// Throughput runs per path and direction.
const RUNS: usize = 3;
/// Peers (routes) of the 1,000-peer part.
const PEERS: usize = 1000;
/// Bytes per write or read of a transfer.
const CHUNK: usize = 256 * 1024;

/// One way to reach a server from the seed namespace.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Via {
    /// Kernel TCP through the wireguard-go pair.
    Anchor,
    /// Egress → trellis gateway → tunnel → wireguard-go.
    Trellis,
    /// Egress → trellis gateway → tunnel → trellis agent.
    Agent,
    /// The same, the tunnel over TCP through the gateway's CONNECT port.
    AgentTcp,
    /// Egress → trellis gateway → a server in the seed namespace.
    Direct,
}

impl Via {
    /// The client address that selects the egress route (`clientSources`).
    fn source(self) -> IpAddr {
        match self {
            Via::Anchor | Via::Trellis => Ipv4Addr::new(127, 0, 0, 1),
            Via::Agent => Ipv4Addr::new(127, 0, 0, 2),
            Via::Direct => Ipv4Addr::new(127, 0, 0, 3),
            Via::AgentTcp => Ipv4Addr::new(127, 0, 0, 4),
        }
        .into()
    }

    /// The address the CONNECT names (the server this path reaches).
    fn target(self) -> &'static str {
        if self == Via::Direct {
            DIRECT_TARGET
        } else {
            TARGET
        }
    }
}

/// Connects along `via` (run it on the seed runtime); for an egress path returns the time
/// from sending the CONNECT to its `200` too.
async fn open(via: Via, tls: &egress::Client) -> std::io::Result<(Stream, Duration)> {
    if via == Via::Anchor {
        let s = TcpStream::connect(TARGET).await?;
        s.set_nodelay(true)?;
        return Ok((Stream::Tcp(s), Duration::ZERO));
    }
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(via.source(), 0))?;
    let tcp = socket.connect(EGRESS.parse().unwrap()).await?;
    tcp.set_nodelay(true)?;
    let (name, config) = tls.next();
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await?;
    let mut s = Stream::Tls(Box::new(tls));
    let start = Instant::now();
    s.send(
        format!(
            "CONNECT {} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
            via.target()
        )
        .as_bytes(),
    )
    .await?;
    connect_reply(&mut s).await?;
    Ok((s, start.elapsed()))
}

/// One echo round trip of one byte.
async fn echo(s: &mut Stream) -> std::io::Result<()> {
    s.send(b"Ex").await?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await?;
    Ok(())
}

/// Opens a stream along `via` and makes one echo round trip, within 2 s.
async fn probe(via: Via, tls: Arc<egress::Client>) -> bool {
    let attempt = async {
        let (mut s, _) = open(via, &tls).await?;
        echo(&mut s).await?;
        s.close().await;
        std::io::Result::Ok(())
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), attempt).await,
        Ok(Ok(()))
    )
}

/// The bench's server: one command byte, then `U` + u64 n: reads n bytes and answers n;
/// `D` + u64 n: sends n bytes, then waits for the client's end; `E`: echoes.
async fn serve(listener: TcpListener) {
    loop {
        let Ok((s, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let _ = handle(s).await;
        });
    }
}

/// Serves one connection of [`serve`].
async fn handle(mut s: TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut cmd = [0u8; 1];
    s.read_exact(&mut cmd).await?;
    match cmd[0] {
        b'U' => {
            let n = s.read_u64().await?;
            let mut buf = vec![0u8; CHUNK];
            let mut left = n;
            while left > 0 {
                let k = s.read(&mut buf[..CHUNK.min(left as usize)]).await?;
                if k == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                left -= k as u64;
            }
            s.write_u64(n).await?;
        }
        b'D' => {
            let n = s.read_u64().await?;
            let buf = vec![0xa5u8; CHUNK];
            let mut left = n;
            while left > 0 {
                let k = CHUNK.min(left as usize);
                s.write_all(&buf[..k]).await?;
                left -= k as u64;
            }
            let _ = s.read(&mut cmd).await;
        }
        _ => {
            let mut buf = vec![0u8; 4096];
            loop {
                let n = s.read(&mut buf).await?;
                if n == 0 {
                    return Ok(());
                }
                s.write_all(&buf[..n]).await?;
            }
        }
    }
    Ok(())
}

/// Which way a transfer goes.
#[derive(Clone, Copy, PartialEq)]
enum Dir {
    /// Seed → shoot (the client uploads).
    Up,
    /// Shoot → seed (the client downloads).
    Down,
}

/// Moves `n` bytes along `via` one way; the time from the request to the last byte (or
/// the server's count).
async fn transfer(via: Via, dir: Dir, n: u64, tls: &egress::Client) -> std::io::Result<Duration> {
    let (mut s, _) = open(via, tls).await?;
    let mut head = vec![if dir == Dir::Up { b'U' } else { b'D' }];
    head.extend(n.to_be_bytes());
    let start = Instant::now();
    s.send(&head).await?;
    let mut buf = vec![0x5au8; CHUNK];
    if dir == Dir::Up {
        let mut left = n;
        while left > 0 {
            let k = CHUNK.min(left as usize);
            s.write_all(&buf[..k]).await?;
            left -= k as u64;
        }
        s.flush().await?;
        let got = s.read_u64().await?;
        if got != n {
            return Err(std::io::Error::other(format!(
                "server counted {got} of {n}"
            )));
        }
    } else {
        let mut left = n;
        while left > 0 {
            let k = s.read(&mut buf).await?;
            if k == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            left = left.saturating_sub(k as u64);
        }
    }
    let took = start.elapsed();
    s.close().await;
    Ok(took)
}

/// CPU seconds (user + system) of `pid` and its children.
fn cpu(pid: u32) -> f64 {
    let (u, s) = tree_cpu(pid);
    u + s
}

/// CPU seconds (user + system) of the bench process itself (its client and server), not
/// of its children.
fn own_cpu() -> f64 {
    let tick = rustix::param::clock_ticks_per_second() as f64;
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    stat.rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|s| s.parse::<f64>().ok())
        .sum::<f64>()
        / tick
}

/// `perf record -g` of a process while it lives, when `BENCH_TUNNEL_PERF` names a
/// directory (`<name>.data` there); stopped with SIGINT on drop.
struct Perf(Option<std::process::Child>);

impl Perf {
    fn start(pid: u32, name: &str) -> Perf {
        let Ok(dir) = std::env::var("BENCH_TUNNEL_PERF") else {
            return Perf(None);
        };
        let _ = std::fs::create_dir_all(&dir);
        let out = Path::new(&dir).join(format!("{name}.data"));
        let child = std::process::Command::new("perf")
            .args(["record", "-g", "-p", &pid.to_string(), "-o"])
            .arg(&out)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok();
        // perf needs a moment to attach.
        std::thread::sleep(Duration::from_millis(300));
        Perf(child)
    }
}

impl Drop for Perf {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let pid = rustix::process::Pid::from_child(c);
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
            let _ = c.wait();
        }
    }
}

/// The median of the finite values of `v`.
fn median(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// The `p` quantile of sorted `v`.
fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() as f64 * p) as usize).min(v.len() - 1)]
}

/// How a target figure reads in the report.
fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "NOT met" }
}

/// One throughput run: Gbit/s, and CPU seconds per GB of the path's seed side, its shoot
/// side and the bench itself (client and server).
#[derive(Clone, Copy)]
struct Sample {
    gbps: f64,
    seed_cpu: f64,
    shoot_cpu: f64,
    bench_cpu: f64,
}

/// The processes of the lab.
struct Procs {
    gateway: Proc,
    agent: Proc,
    /// The agent whose tunnel runs over TCP.
    agent_tcp: Proc,
    seed_wg: WgGo,
    shoot_wg: WgGo,
    /// The shoot device's interface name.
    shoot_if: String,
    /// The seed device's public key (a peer of the shoot device).
    seed_public: String,
    /// The gateway's public key (the other peer of the shoot device).
    gw_public: String,
}

/// `wg show <if> transfer` in `ns`: (peer, received bytes, sent bytes).
fn wg_transfer(lab: &Lab, ns: &str, ifname: &str) -> Vec<(String, u64, u64)> {
    lab.sh_input(ns, &["wg", "show", ifname, "transfer"], "")
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.first()?.to_string(),
                f.get(1)?.parse().ok()?,
                f.get(2)?.parse().ok()?,
            ))
        })
        .collect()
}

/// Files and keys the gateway and agent are started with.
struct Setup {
    gateway_config: std::path::PathBuf,
    agent_config: std::path::PathBuf,
    agent_tcp_config: std::path::PathBuf,
    workers: String,
}

/// Writes the keys, the routing table, the gateway's and the agent's configurations into
/// `dir` (the egress listener presents route 0 of the PKI at `pki`).
fn write_configs(
    dir: &Path,
    pki: &Path,
    gw: &Keypair,
    shoot: &Keypair,
    (agent, agent_tcp): (&Keypair, &Keypair),
) -> Setup {
    let key = |name: &str, k: &Keypair| {
        let p = dir.join(name);
        std::fs::write(&p, format!("{}\n", k.private)).unwrap();
        p
    };
    let (gw_key, agent_key) = (key("gateway.key", gw), key("agent.key", agent));
    let agent_tcp_key = key("agent-tcp.key", agent_tcp);
    let routes = dir.join("routes.yaml");
    std::fs::write(
        &routes,
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- name: shoot--bench--wg
  tunnel:
    wireguard:
      peers:
      - publicKey: \"{}\"
        allowedIPs: [\"192.168.128.5/32\", \"100.64.0.0/13\"]
      localAddresses: [{GATEWAY_INNER}]
  egress:
    clientSources: [\"127.0.0.1/32\"]
    allowedNetworks: [\"100.64.0.0/13\"]
- name: shoot--bench--agent
  tunnel:
    wireguard:
      peers:
      - publicKey: \"{}\"
        allowedIPs: [\"192.168.131.5/32\", \"100.64.0.0/13\"]
      localAddresses: [192.168.131.1]
  egress:
    clientSources: [\"127.0.0.2/32\"]
    allowedNetworks: [\"100.64.0.0/13\"]
- name: shoot--bench--direct
  egress:
    clientSources: [\"127.0.0.3/32\"]
    allowedNetworks: []
    directNetworks: [\"127.0.0.0/8\"]
    via: direct
- name: shoot--bench--agent-tcp
  tunnel:
    wireguard:
      peers:
      - publicKey: \"{}\"
        allowedIPs: [\"192.168.132.5/32\", \"100.64.0.0/13\"]
      localAddresses: [192.168.132.1]
  egress:
    clientSources: [\"127.0.0.4/32\"]
    allowedNetworks: [\"100.64.0.0/13\"]
",
            shoot.public, agent.public, agent_tcp.public
        ),
    )
    .unwrap();
    let r0 = egress::route_dir(pki, 0);
    // wireguard-go uses every CPU; so does the gateway here, by default (0 = one worker per
    // CPU), unlike the other jobs' single worker beside single-threaded peers.
    let workers = std::env::var("BENCH_TRELLIS_WORKERS").unwrap_or_else(|_| "0".into());
    let gateway_config = dir.join("gateway.yaml");
    std::fs::write(
        &gateway_config,
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {{file: \"{}\"}}
listeners:
- name: wireguard
  address: \"{GATEWAY_WG}\"
  protocol: wireguard
  wireguard: {{privateKeyFile: \"{}\", connectDestination: \"{CONNECT_DESTINATION}\"}}
- name: connect
  address: \"{GATEWAY_CONNECT}\"
  protocol: http-connect
- name: egress
  address: \"{EGRESS}\"
  protocol: egress-connect
  tls: {{certificateFile: \"{}\", keyFile: \"{}\", clientCAFile: \"{}\"}}
admin: {{address: \"{ADMIN}\", debugAddress: \"127.0.0.1:15003\"}}
limits: {{maxConnections: 10000, maxConnectionsPerSource: 0}}
workers: {workers}
timeouts: {{drainDelay: 0s}}
",
            routes.display(),
            gw_key.display(),
            r0.join("tls.crt").display(),
            r0.join("tls.key").display(),
            r0.join("ca.crt").display(),
        ),
    )
    .unwrap();
    // The agent over UDP, and one reaching the gateway only through its CONNECT port.
    let agent = |file: &str, key: &Path, address: &str, endpoints: &str, admin: u16| {
        let config = dir.join(file);
        std::fs::write(
            &config,
            format!(
                "apiVersion: trellis.gardener.cloud/v1alpha1
kind: AgentConfiguration
wireguard:
  privateKeyFile: \"{}\"
  addresses: [{address}]
  gateway:
    publicKey: \"{}\"
    endpoints: [{endpoints}]
    persistentKeepalive: 25s
networks: [\"100.64.0.0/13\"]
admin: {{address: \"127.0.0.1:{admin}\"}}
",
                key.display(),
                gw.public
            ),
        )
        .unwrap();
        config
    };
    let agent_config = agent(
        "agent.yaml",
        &agent_key,
        "192.168.131.5",
        &format!("{{udp: \"{GATEWAY_WG}\"}}"),
        16911,
    );
    let agent_tcp_config = agent(
        "agent-tcp.yaml",
        &agent_tcp_key,
        "192.168.132.5",
        &format!(
            "{{connect: {{address: \"{GATEWAY_CONNECT}\", destination: \"{CONNECT_DESTINATION}\"}}}}"
        ),
        16912,
    );
    Setup {
        gateway_config,
        agent_config,
        agent_tcp_config,
        workers,
    }
}

/// `trellis gateway` in the seed namespace.
fn start_gateway(lab: &Lab, config: &Path, log: &Path) -> Proc {
    let bin = crate::trellis_bin();
    let config = config.to_str().unwrap();
    lab::spawn(lab, lab.ns(0), &[&bin, "gateway", "--config", config], log)
}

/// Runs `f` on `rt` and waits for it.
async fn on<F, T>(rt: &Handle, f: F) -> T
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    rt.spawn(f).await.unwrap()
}

/// Waits up to `limit` until `via` carries an echo.
async fn wait_path(seed: &Handle, via: Via, tls: &Arc<egress::Client>, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if on(seed, probe(via, tls.clone())).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The tunnel job (see the module documentation); prints its own report. `work` is the
/// run's directory, `cache` where RSA keys are kept between runs.
pub fn run(work: &Path, cache: &Path) {
    if let Some(why) = lab::skip_reason(&[]) {
        println!("\nSKIP tunnel: {why}");
        return;
    }
    let dir = work.join("tunnel");
    let lab = Lab::new(&["seed", "shoot"], &dir);
    let (seed_ns, shoot_ns) = (lab.ns(0).to_string(), lab.ns(1).to_string());
    lab.veth(0, "10.99.0.1/24", 1, "10.99.0.2/24");
    lab.sh(
        &shoot_ns,
        &["ip", "addr", "add", "100.64.0.10/32", "dev", "lo"],
    );
    let pki = dir.join("pki");
    if let Err(e) = egress::generate(&pki, 1, cache) {
        println!("\nSKIP tunnel: egress certificates: {e}");
        return;
    }
    let tls = Arc::new(egress::Client::load(&pki, 1).unwrap());
    let (gw_keys, shoot_keys, seed_keys, agent_keys, agent_tcp_keys) = (
        lab::keypair(),
        lab::keypair(),
        lab::keypair(),
        lab::keypair(),
        lab::keypair(),
    );
    let setup = write_configs(
        &dir,
        &pki,
        &gw_keys,
        &shoot_keys,
        (&agent_keys, &agent_tcp_keys),
    );
    let seed_rt = lab::runtime_in(&seed_ns, 1);
    let shoot_rt = lab::runtime_in(&shoot_ns, 1);
    let ctl = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (seed, shoot) = (seed_rt.handle().clone(), shoot_rt.handle().clone());
    ctl.block_on(async {
        let l = on(&shoot, async { TcpListener::bind(TARGET).await })
            .await
            .unwrap();
        shoot.spawn(serve(l));
        let l = on(&seed, async { TcpListener::bind(DIRECT_TARGET).await })
            .await
            .unwrap();
        seed.spawn(serve(l));
    });

    let gateway = start_gateway(&lab, &setup.gateway_config, &dir.join("gateway.log"));
    let agent = lab::spawn(
        &lab,
        &shoot_ns,
        &[
            &crate::trellis_bin(),
            "agent",
            "--config",
            setup.agent_config.to_str().unwrap(),
        ],
        &dir.join("agent.log"),
    );
    let agent_tcp = lab::spawn(
        &lab,
        &shoot_ns,
        &[
            &crate::trellis_bin(),
            "agent",
            "--config",
            setup.agent_tcp_config.to_str().unwrap(),
        ],
        &dir.join("agent-tcp.log"),
    );
    let id = std::process::id() % 100_000;
    let seed_wg = WgGo::start(
        &lab,
        &seed_ns,
        &WgDevice {
            ifname: &format!("tbA{id}"),
            keys: &seed_keys,
            port: 51821,
            address: "192.168.128.1/24",
            peers: &[WgPeer {
                public: &shoot_keys.public,
                allowed_ips: &["192.168.128.5/32", "100.64.0.0/13"],
                endpoint: Some("10.99.0.2:51822"),
                keepalive: None,
            }],
            routes: &["100.64.0.0/13"],
        },
    );
    let inner = format!("{GATEWAY_INNER}/32");
    let shoot_wg = WgGo::start(
        &lab,
        &shoot_ns,
        &WgDevice {
            ifname: &format!("tbS{id}"),
            keys: &shoot_keys,
            port: 51822,
            address: "192.168.128.5/24",
            peers: &[
                WgPeer {
                    public: &seed_keys.public,
                    allowed_ips: &["192.168.128.1/32"],
                    endpoint: Some("10.99.0.1:51821"),
                    keepalive: None,
                },
                WgPeer {
                    public: &gw_keys.public,
                    allowed_ips: &[&inner],
                    endpoint: Some(GATEWAY_WG),
                    keepalive: Some(25),
                },
            ],
            routes: &[&inner],
        },
    );
    let mut procs = Procs {
        gateway,
        agent,
        agent_tcp,
        seed_wg,
        shoot_wg,
        shoot_if: format!("tbS{id}"),
        seed_public: seed_keys.public.clone(),
        gw_public: gw_keys.public.clone(),
    };
    let mb: u64 = std::env::var("BENCH_TUNNEL_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let peers: usize = std::env::var("BENCH_TUNNEL_PEERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(PEERS);
    let report = ctl.block_on(measure(
        &lab, &seed, &tls, &setup, &mut procs, mb, peers, &gw_keys,
    ));
    drop(procs);
    seed_rt.shutdown_background();
    shoot_rt.shutdown_background();
    match report {
        Ok(r) => print!("{r}"),
        Err(e) => {
            println!("\ntunnel: {e}");
            for log in ["gateway.log", "agent.log", "agent-tcp.log"] {
                let text = std::fs::read_to_string(dir.join(log)).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                for line in &lines[lines.len().saturating_sub(8)..] {
                    println!("  {log}: {line}");
                }
            }
        }
    }
}

/// Everything measured, as the report's text.
#[expect(clippy::too_many_arguments, reason = "the lab and each measured part")]
async fn measure(
    lab: &Lab,
    seed: &Handle,
    tls: &Arc<egress::Client>,
    setup: &Setup,
    procs: &mut Procs,
    mb: u64,
    peers: usize,
    gw_keys: &Keypair,
) -> Result<String, String> {
    use std::fmt::Write;
    let shoot_ns = lab.ns(1).to_string();
    let mut out = String::new();
    let cores = std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| c.lines().filter(|l| l.starts_with("processor")).count())
        .unwrap_or(0);
    let _ = writeln!(
        out,
        "\ntunnel: seed and shoot namespaces joined by a veth pair, {cores} CPUs shared by everything; trellis gateway with workers: {} (0 = one per CPU)",
        setup.workers
    );

    // Bring every path up: the shoot's wireguard-go initiates to the gateway on its first
    // packet (and its keepalive).
    let _ = lab
        .exec(
            &shoot_ns,
            &["ping", "-n", "-c", "3", "-i", "0.2", GATEWAY_INNER],
        )
        .output();
    for via in [
        Via::Anchor,
        Via::Trellis,
        Via::Agent,
        Via::AgentTcp,
        Via::Direct,
    ] {
        if !wait_path(seed, via, tls, Duration::from_secs(20)).await {
            return Err(format!("{via:?} path does not carry an echo"));
        }
    }

    // Round trips through each tunnel.
    let anchor_rtt = lab.ping_rtts(lab.ns(0), "192.168.128.5", 50);
    let trellis_rtt = lab.ping_rtts(&shoot_ns, GATEWAY_INNER, 50);
    let rtt = pct(&trellis_rtt, 0.5);
    let _ = writeln!(
        out,
        "tunnel round trip (ping, 50, p50/p99): anchor seed → 192.168.128.5 {:.0}/{:.0} µs; trellis shoot → {GATEWAY_INNER} through wireguard-go {rtt:.0}/{:.0} µs",
        pct(&anchor_rtt, 0.5),
        pct(&anchor_rtt, 0.99),
        pct(&trellis_rtt, 0.99),
    );

    // Idle tunneled streams, then CONNECT → 200 one at a time with them open.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let gw = procs.gateway.pid();
    let rss0 = tree_rss(gw);
    let idle = open_idle(seed, Via::Trellis, tls, IDLE).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss1 = tree_rss(gw);
    let per_stream = rss1.saturating_sub(rss0) as f64 / idle.max(1) as f64;
    let perf = Perf::start(gw, "connect-idle");
    let tunneled = connect_times(seed, Via::Trellis, tls, CONNECTS).await;
    drop(perf);
    let direct = connect_times(seed, Via::Direct, tls, CONNECTS).await;
    close_idle(seed).await;
    let alone = connect_times(seed, Via::Trellis, tls, CONNECTS).await;
    let (p50, p99) = (pct(&tunneled, 0.5), pct(&tunneled, 0.99));
    let _ = writeln!(
        out,
        "CONNECT → 200 with {idle} idle tunneled streams open, {} CONNECTs one at a time: tunneled p50 {p50:.0} µs, p99 {p99:.0} µs (target p99 ≤ 1,000 µs + one tunnel round trip = {:.0} µs: {}); via: direct on the same gateway p50 {:.0} µs, p99 {:.0} µs; tunneled once the idle streams are closed p50 {:.0} µs, p99 {:.0} µs",
        tunneled.len(),
        1000.0 + rtt,
        met(p99 <= 1000.0 + rtt),
        pct(&direct, 0.5),
        pct(&direct, 0.99),
        pct(&alone, 0.5),
        pct(&alone, 0.99),
    );
    if idle < IDLE {
        let _ = writeln!(out, "  only {idle} of {IDLE} idle streams opened");
    }

    // Restarts: kill -9 while the shoot keeps sending (a ping every 100 ms, and wireguard-go's
    // 25 s keepalive), start again, time until an egress CONNECT through the tunnel works.
    let mut pinger = lab::spawn(
        lab,
        &shoot_ns,
        &["ping", "-n", "-i", "0.1", GATEWAY_INNER],
        &lab.dir.join("pinger.log"),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut restarts = Vec::new();
    for k in 0..3 {
        procs.gateway.kill9();
        let spawned = Instant::now();
        procs.gateway = start_gateway(
            lab,
            &setup.gateway_config,
            &lab.dir.join(format!("gateway-{k}.log")),
        );
        let (listening, works) = until_connect(seed, tls, spawned).await;
        restarts.push((listening, works));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    pinger.kill9();
    let worst =
        restarts.iter().map(|r| r.1).fold(
            0f64,
            |a, b| if b.is_nan() { f64::INFINITY } else { a.max(b) },
        );
    let _ = writeln!(
        out,
        "restart (kill -9 while the shoot pings every 100 ms; from the new process's start), 3 times: egress listener accepting after {} ms; CONNECT through the tunnel answered 200 after {} ms (target ≤ 2,000 ms: {})",
        restarts
            .iter()
            .map(|r| format!("{:.0}", r.0))
            .collect::<Vec<_>>()
            .join("/"),
        restarts
            .iter()
            .map(|r| format!("{:.0}", r.1))
            .collect::<Vec<_>>()
            .join("/"),
        met(worst <= 2000.0),
    );

    // The egress leg's own share of the memory per stream: the same 1,000 idle streams
    // through the fresh gateway's `via: direct` route.
    for via in [Via::Trellis, Via::Direct] {
        wait_path(seed, via, tls, Duration::from_secs(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let gw = procs.gateway.pid();
    let d0 = tree_rss(gw);
    let direct_idle = open_idle(seed, Via::Direct, tls, IDLE).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let d1 = tree_rss(gw);
    close_idle(seed).await;
    let per_direct = d1.saturating_sub(d0) as f64 / direct_idle.max(1) as f64;
    let _ = writeln!(
        out,
        "gateway RSS with idle streams: {:.1} → {:.1} MiB for {idle} tunneled, {:.0} B per stream (target ≤ 16 KiB = 16,384 B: {}); {:.1} → {:.1} MiB for {direct_idle} via: direct, {:.0} B per stream; the tunnel's own share {:.0} B",
        rss0 as f64 / 1048576.0,
        rss1 as f64 / 1048576.0,
        per_stream,
        met(per_stream <= 16384.0),
        d0 as f64 / 1048576.0,
        d1 as f64 / 1048576.0,
        per_direct,
        per_stream - per_direct,
    );

    // Single-stream throughput, interleaved runs; the agents found the restarted gateway
    // again (the one over TCP through a new stream).
    for via in [Via::Agent, Via::AgentTcp] {
        if !wait_path(seed, via, tls, Duration::from_secs(30)).await {
            return Err(format!(
                "{via:?} path does not carry an echo after the restarts"
            ));
        }
    }
    let n = mb * 1_000_000;
    let paths = [Via::Anchor, Via::Trellis, Via::Agent, Via::AgentTcp];
    // [dir][path] → one sample per run.
    let mut samples: Vec<Vec<Vec<Sample>>> = vec![vec![Vec::new(); paths.len()]; 2];
    // [dir][anchor, trellis] → the shoot device's bytes per GB against the direction.
    let mut reverse: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); 2]; 2];
    for run in 0..RUNS {
        for (d, dir) in [Dir::Up, Dir::Down].into_iter().enumerate() {
            for (p, &via) in paths.iter().enumerate() {
                let (seed_pid, shoot_pid) = match via {
                    Via::Anchor => (procs.seed_wg.pid(), procs.shoot_wg.pid()),
                    Via::Trellis => (procs.gateway.pid(), procs.shoot_wg.pid()),
                    Via::AgentTcp => (procs.gateway.pid(), procs.agent_tcp.pid()),
                    _ => (procs.gateway.pid(), procs.agent.pid()),
                };
                let way = if dir == Dir::Up { "up" } else { "down" };
                let perf = (run == 0 && via == Via::Trellis)
                    .then(|| Perf::start(procs.gateway.pid(), &format!("transfer-{way}")));
                let w0 = wg_transfer(lab, &shoot_ns, &procs.shoot_if);
                let (a0, b0, c0) = (cpu(seed_pid), cpu(shoot_pid), own_cpu());
                let tls2 = tls.clone();
                let r = on(seed, async move { transfer(via, dir, n, &tls2).await }).await;
                let (a1, b1, c1) = (cpu(seed_pid), cpu(shoot_pid), own_cpu());
                let w1 = wg_transfer(lab, &shoot_ns, &procs.shoot_if);
                if matches!(via, Via::Anchor | Via::Trellis) {
                    // The shoot device's bytes against the transfer's direction (ACKs,
                    // with WireGuard's overhead) towards this path's seed side.
                    let key = if via == Via::Anchor {
                        &procs.seed_public
                    } else {
                        &procs.gw_public
                    };
                    let back = |w: &[(String, u64, u64)]| {
                        w.iter()
                            .find(|(k, _, _)| k == key)
                            .map_or(0, |(_, rx, tx)| if dir == Dir::Up { *tx } else { *rx })
                    };
                    reverse[d][usize::from(via == Via::Trellis)]
                        .push(back(&w1).saturating_sub(back(&w0)) as f64 / (n as f64 / 1e9));
                }
                drop(perf);
                let gb = n as f64 / 1e9;
                match r {
                    Ok(took) => {
                        let gbps = n as f64 * 8.0 / took.as_secs_f64() / 1e9;
                        eprintln!("  tunnel run {run} {via:?} {way}: {gbps:.2} Gbit/s");
                        samples[d][p].push(Sample {
                            gbps,
                            seed_cpu: (a1 - a0) / gb,
                            shoot_cpu: (b1 - b0) / gb,
                            bench_cpu: (c1 - c0) / gb,
                        });
                    }
                    Err(e) => eprintln!("  tunnel run {run} {via:?}: {e}"),
                }
            }
        }
    }
    // The median of one figure over the runs of direction `d` and path `p`.
    let m = |d: usize, p: usize, k: usize| {
        let v: Vec<f64> = samples[d][p]
            .iter()
            .map(|s| [s.gbps, s.seed_cpu, s.shoot_cpu, s.bench_cpu][k])
            .collect();
        median(&v)
    };
    let _ = writeln!(
        out,
        "single stream, {mb} MB, median of {RUNS} interleaved runs     seed→shoot  shoot→seed   (Gbit/s)"
    );
    for (p, label) in [
        "(a) anchor: kernel TCP, wireguard-go ↔ wireguard-go",
        "(b) trellis: egress (TLS) → gateway → wireguard-go",
        "(c) ceiling: egress (TLS) → gateway → trellis agent",
        "(d) as (c), WireGuard over TCP (CONNECT port)",
    ]
    .iter()
    .enumerate()
    {
        let _ = writeln!(out, "  {label:52} {:9.2} {:11.2}", m(0, p, 0), m(1, p, 0));
    }
    for (p, label) in [
        (1, "(b)/(a)"),
        (2, "(c)/(a)"),
        (3, "(d)/(a)"),
        (3, "(d)/(c)"),
    ] {
        let base = if label == "(d)/(c)" { 2 } else { 0 };
        let (up, down) = (m(0, p, 0) / m(0, base, 0), m(1, p, 0) / m(1, base, 0));
        let target = if p == 1 {
            format!(
                " (target ≥ 0.90 each way: {})",
                met(up >= 0.9 && down >= 0.9)
            )
        } else {
            String::new()
        };
        let _ = writeln!(out, "  {label:52} {up:9.2}x {down:10.2}x{target}");
    }
    let _ = writeln!(
        out,
        "CPU seconds per GB, same transfers                       seed→shoot  shoot→seed"
    );
    for (p, seed_label, shoot_label) in [
        (0, "(a) seed wireguard-go", "(a) shoot wireguard-go"),
        (
            1,
            "(b) trellis gateway (incl. TLS)",
            "(b) shoot wireguard-go",
        ),
        (2, "(c) trellis gateway (incl. TLS)", "(c) trellis agent"),
        (
            3,
            "(d) trellis gateway (incl. TLS), TCP framing",
            "(d) trellis agent, TCP framing",
        ),
    ] {
        let _ = writeln!(
            out,
            "  {seed_label:52} {:9.2} {:11.2}",
            m(0, p, 1),
            m(1, p, 1)
        );
        let _ = writeln!(
            out,
            "  {shoot_label:52} {:9.2} {:11.2}",
            m(0, p, 2),
            m(1, p, 2)
        );
        let bench = ["(a)", "(b)", "(c)", "(d)"][p];
        let bench = format!("{bench} the bench: client (TLS for (b)-(d)) and server");
        let _ = writeln!(out, "  {bench:52} {:9.2} {:11.2}", m(0, p, 3), m(1, p, 3));
    }
    let _ = writeln!(
        out,
        "  shoot wireguard-go's bytes against the direction (ACKs), MB per GB: anchor {:.1} / {:.1}, trellis {:.1} / {:.1}",
        median(&reverse[0][0]) / 1e6,
        median(&reverse[1][0]) / 1e6,
        median(&reverse[0][1]) / 1e6,
        median(&reverse[1][1]) / 1e6,
    );
    let (up, down) = (m(0, 1, 1) / m(0, 1, 2), m(1, 1, 1) / m(1, 1, 2));
    let _ = writeln!(
        out,
        "  (b) gateway ÷ shoot wireguard-go                     {up:9.2}x {down:10.2}x (target ≤ 1: {})",
        met(up <= 1.0 && down <= 1.0)
    );

    // 1,000 peers, one route each, on a gateway of their own; the first one and the agent
    // are stopped first.
    procs.gateway.stop();
    procs.agent.stop();
    procs.agent_tcp.stop();
    if peers > 0 {
        match many_peers(lab, seed, peers, gw_keys, &setup.workers).await {
            Ok(text) => out += &text,
            Err(e) => {
                let _ = writeln!(out, "{peers} peers: {e}");
            }
        }
    }
    Ok(out)
}

/// The idle streams held open between [`open_idle`] and [`close_idle`] (they live on the
/// seed runtime).
static IDLE_STREAMS: std::sync::Mutex<Vec<Stream>> = std::sync::Mutex::new(Vec::new());

/// Opens `n` streams along `via`, each with one echo, 100 at a time; keeps them open.
/// Returns how many opened.
async fn open_idle(seed: &Handle, via: Via, tls: &Arc<egress::Client>, n: usize) -> usize {
    let mut opened = 0;
    for chunk in 0..n.div_ceil(100) {
        let mut batch = Vec::new();
        for _ in 0..100.min(n - chunk * 100) {
            let tls = tls.clone();
            batch.push(seed.spawn(async move {
                let attempt = async {
                    let (mut s, _) = open(via, &tls).await?;
                    echo(&mut s).await?;
                    std::io::Result::Ok(s)
                };
                tokio::time::timeout(Duration::from_secs(10), attempt)
                    .await
                    .ok()?
                    .ok()
            }));
        }
        for b in batch {
            if let Ok(Some(s)) = b.await {
                IDLE_STREAMS.lock().unwrap().push(s);
                opened += 1;
            }
        }
    }
    opened
}

/// Closes the idle streams (on the seed runtime, whose reactor they belong to).
async fn close_idle(seed: &Handle) {
    let streams = std::mem::take(&mut *IDLE_STREAMS.lock().unwrap());
    on(seed, async move { drop(streams) }).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// CONNECT → 200 times (µs, sorted) of `n` streams along `via`, one at a time, each with
/// one echo and a close.
async fn connect_times(seed: &Handle, via: Via, tls: &Arc<egress::Client>, n: usize) -> Vec<f64> {
    let tls = tls.clone();
    on(seed, async move {
        let mut all = Vec::with_capacity(n);
        for _ in 0..n {
            let attempt = async {
                let (mut s, waited) = open(via, &tls).await?;
                echo(&mut s).await?;
                s.close().await;
                std::io::Result::Ok(waited)
            };
            if let Ok(Ok(w)) = tokio::time::timeout(Duration::from_secs(5), attempt).await {
                all.push(w.as_nanos() as f64 / 1000.0);
            }
        }
        all.sort_by(|a, b| a.total_cmp(b));
        all
    })
    .await
}

/// After a restart begun at `spawned`: ms until the egress listener accepted a connection,
/// and until a CONNECT through the tunnel was answered 200 and carried an echo (NaN if not
/// within 30 s). Attempts every 10 ms.
async fn until_connect(seed: &Handle, tls: &Arc<egress::Client>, spawned: Instant) -> (f64, f64) {
    let tls = tls.clone();
    on(seed, async move {
        let mut listening = f64::NAN;
        while spawned.elapsed() < Duration::from_secs(30) {
            if listening.is_nan() && TcpStream::connect(EGRESS).await.is_ok() {
                listening = spawned.elapsed().as_secs_f64() * 1e3;
            }
            if !listening.is_nan() && probe(Via::Trellis, tls.clone()).await {
                return (listening, spawned.elapsed().as_secs_f64() * 1e3);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (listening, f64::NAN)
    })
    .await
}

/// An IPv4 ICMP echo request from 192.168.128.5 to 192.168.128.1.
fn echo_request(id: u16, seq: u16) -> Vec<u8> {
    fn checksum(b: &[u8]) -> u16 {
        let mut sum = 0u32;
        for c in b.chunks(2) {
            sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }
    let mut icmp = vec![8, 0, 0, 0];
    icmp.extend(id.to_be_bytes());
    icmp.extend(seq.to_be_bytes());
    icmp.extend(*b"trellis!");
    let c = checksum(&icmp);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let len = (20 + icmp.len()) as u16;
    let mut ip = vec![0x45, 0];
    ip.extend(len.to_be_bytes());
    ip.extend([0, 0, 0x40, 0, 64, 1, 0, 0]);
    ip.extend([192, 168, 128, 5, 192, 168, 128, 1]);
    let c = checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    ip.extend(icmp);
    ip
}

/// Whether `p` is an IPv4 ICMP echo reply.
fn is_echo_reply(p: &[u8]) -> bool {
    let ihl = usize::from(p.first().map_or(0, |b| b & 15)) * 4;
    p.len() > ihl && p[0] >> 4 == 4 && p.get(9) == Some(&1) && p[ihl] == 0
}

/// One in-bench WireGuard peer: a boringtun initiator with a UDP socket of its own. Each
/// time the generation changes it sends an echo request to the route's local address every
/// 100 ms (the first after a staggered offset) until one is answered, and records when.
async fn peer(
    i: usize,
    secret: [u8; 32],
    gateway: [u8; 32],
    mut generation: tokio::sync::watch::Receiver<u64>,
    up: Arc<Vec<AtomicU64>>,
    epoch: Instant,
) -> std::io::Result<()> {
    use boringtun::noise::{Tunn, TunnResult};
    let sock = UdpSocket::bind("127.0.0.1:0").await?;
    let to: SocketAddr = PEERS_WG.parse().unwrap();
    let mut tunn = Tunn::new(
        boringtun::x25519::StaticSecret::from(secret),
        boringtun::x25519::PublicKey::from(gateway),
        None,
        None,
        i as u32,
        None,
    );
    let (mut buf, mut out) = (vec![0u8; 2048], vec![0u8; 2048]);
    let mut seq = 0u16;
    let mut waiting = false;
    let offset = Duration::from_micros((i as u64 * 100_000 / PEERS as u64) % 100_000);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut timers = tokio::time::interval(Duration::from_millis(250));
    loop {
        let send_echo = tokio::select! {
            changed = generation.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
                waiting = true;
                tick.reset_at(tokio::time::Instant::now() + offset);
                false
            }
            _ = tick.tick(), if waiting => true,
            _ = timers.tick() => {
                if let TunnResult::WriteToNetwork(p) = tunn.update_timers(&mut out) {
                    let _ = sock.send_to(p, to).await;
                }
                false
            }
            r = sock.recv(&mut buf) => {
                let n = r?;
                let mut res = tunn.decapsulate(None, &buf[..n], &mut out);
                loop {
                    match res {
                        TunnResult::WriteToNetwork(p) => {
                            let _ = sock.send_to(p, to).await;
                            res = tunn.decapsulate(None, &[], &mut out);
                        }
                        TunnResult::WriteToTunnelV4(p, _) => {
                            if waiting && is_echo_reply(p) {
                                waiting = false;
                                up[i].store(epoch.elapsed().as_micros() as u64, Ordering::Relaxed);
                            }
                            break;
                        }
                        _ => break,
                    }
                }
                false
            }
        };
        if send_echo {
            seq = seq.wrapping_add(1);
            if let TunnResult::WriteToNetwork(p) =
                tunn.encapsulate(&echo_request(i as u16, seq), &mut out)
            {
                let _ = sock.send_to(p, to).await;
            }
        }
    }
}

/// The 1,000-peer part: its own gateway (a wireguard listener, `peers` routes with one
/// peer each); every peer comes up cold, then the gateway is killed with `kill -9` and
/// started again while the peers keep sending. Returns the report's lines.
async fn many_peers(
    lab: &Lab,
    seed: &Handle,
    peers: usize,
    gw_keys: &Keypair,
    workers: &str,
) -> Result<String, String> {
    use std::fmt::Write;
    let dir = lab.dir.join("peers");
    std::fs::create_dir_all(&dir).unwrap();
    let keys: Vec<Keypair> = (0..peers).map(|_| lab::keypair()).collect();
    let mut routes =
        String::from("apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n");
    for (i, k) in keys.iter().enumerate() {
        let _ = write!(
            routes,
            "- name: shoot--bench--p{i}\n  tunnel:\n    wireguard:\n      peers:\n      - publicKey: \"{}\"\n        allowedIPs: [\"192.168.128.5/32\", \"100.64.0.0/13\"]\n      localAddresses: [192.168.128.1]\n",
            k.public
        );
    }
    std::fs::write(dir.join("routes.yaml"), routes).unwrap();
    let key = dir.join("gateway.key");
    std::fs::write(&key, format!("{}\n", gw_keys.private)).unwrap();
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {{file: \"{}\"}}
listeners:
- name: wireguard
  address: \"{PEERS_WG}\"
  protocol: wireguard
  wireguard: {{privateKeyFile: \"{}\"}}
admin: {{address: \"127.0.0.1:15025\", debugAddress: \"127.0.0.1:15004\"}}
workers: {workers}
timeouts: {{drainDelay: 0s}}
",
            dir.join("routes.yaml").display(),
            key.display()
        ),
    )
    .unwrap();
    let mut gateway = start_gateway(lab, &config, &dir.join("gateway.log"));
    let bound = until_bound(lab).await;
    if !bound {
        let log = std::fs::read_to_string(dir.join("gateway.log")).unwrap_or_default();
        return Err(format!(
            "the gateway's wireguard listener did not bind in 10 s: {}",
            log.lines().rev().take(3).collect::<Vec<_>>().join(" / ")
        ));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rest = tree_rss(gateway.pid());

    let epoch = Instant::now();
    let up: Arc<Vec<AtomicU64>> = Arc::new((0..peers).map(|_| AtomicU64::new(0)).collect());
    let (generation, rx) = tokio::sync::watch::channel(0u64);
    let public =
        boringtun::x25519::PublicKey::from(&boringtun::x25519::StaticSecret::from(gw_keys.secret))
            .to_bytes();
    let mut tasks = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let (rx, up, secret) = (rx.clone(), up.clone(), k.secret);
        tasks.push(seed.spawn(async move {
            if let Err(e) = peer(i, secret, public, rx, up, epoch).await {
                eprintln!("  peer {i}: {e}");
            }
        }));
    }
    drop(rx);
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Cold: every peer handshakes and pings once.
    // The ms from `since` at which each peer came up since then, sorted; waits up to 30 s.
    let all_up = |since: Instant| {
        let up = up.clone();
        async move {
            let since_us = since.duration_since(epoch).as_micros() as u64;
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let mut done: Vec<f64> = up
                    .iter()
                    .map(|u| u.load(Ordering::Relaxed))
                    .filter(|&t| t >= since_us)
                    .map(|t| (t - since_us) as f64 / 1e3)
                    .collect();
                if done.len() == up.len() || Instant::now() > deadline {
                    done.sort_by(|a, b| a.total_cmp(b));
                    return done;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    let cold_start = Instant::now();
    let (gw0, own0) = (cpu(gateway.pid()), own_cpu());
    generation.send_replace(1);
    let cold = all_up(cold_start).await;
    let (cold_gw, cold_own) = (cpu(gateway.pid()) - gw0, own_cpu() - own0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle_rss = tree_rss(gateway.pid());

    // kill -9, then the peers keep sending (from the kill on) to the new process.
    gateway.kill9();
    generation.send_replace(2);
    let spawned = Instant::now();
    let own0 = own_cpu();
    let gateway = start_gateway(lab, &config, &dir.join("gateway-2.log"));
    let bound = udp_bound(gateway.pid(), PEERS_WG, spawned);
    let perf = Perf::start(gateway.pid(), "peers-restart");
    let warm = all_up(spawned).await;
    let (warm_gw, warm_own) = (cpu(gateway.pid()), own_cpu() - own0);
    drop(perf);
    let bound_ms = bound
        .join()
        .ok()
        .flatten()
        .map_or(f64::NAN, |d| d.as_secs_f64() * 1e3);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after_rss = tree_rss(gateway.pid());
    drop(generation);
    for t in tasks {
        t.abort();
    }
    drop(gateway);

    let mut out = String::new();
    let mib = |b: u64| b as f64 / 1048576.0;
    let _ = writeln!(
        out,
        "{peers} peers, one route each (in-bench boringtun initiators, a UDP socket each, one echo to the route's local address every 100 ms while waiting):"
    );
    let spread = |v: &[f64]| {
        format!(
            "{} of {peers} up (echo answered): first {:.0} ms, p50 {:.0} ms, p90 {:.0} ms, last {:.0} ms",
            v.len(),
            pct(v, 0.0),
            pct(v, 0.5),
            pct(v, 0.9),
            v.last().copied().unwrap_or(f64::NAN)
        )
    };
    let _ = writeln!(
        out,
        "  cold: {}; CPU meanwhile: gateway {:.0} ms, the bench's peers {:.0} ms; gateway RSS {:.1} MiB at rest with the table, {:.1} MiB with {peers} idle sessions ({:.0} B per session; target ≤ 64 MiB: {})",
        spread(&cold),
        cold_gw * 1e3,
        cold_own * 1e3,
        mib(rest),
        mib(idle_rss),
        idle_rss.saturating_sub(rest) as f64 / peers as f64,
        met(idle_rss <= 64 << 20),
    );
    let last = warm.last().copied().unwrap_or(f64::NAN);
    let _ = writeln!(
        out,
        "  after kill -9 and a restart, from the new process's start: UDP port bound after {bound_ms:.0} ms; {} (target ≤ 2,000 ms: {}); CPU until then: gateway (all of it, start included) {:.0} ms, the bench's peers {:.0} ms; RSS then {:.1} MiB",
        spread(&warm),
        met(warm.len() == peers && last <= 2000.0),
        warm_gw * 1e3,
        warm_own * 1e3,
        mib(after_rss),
    );
    Ok(out)
}

/// Watches (every 2 ms, up to 10 s) for process `pid`'s network namespace to have a UDP
/// socket bound to `addr`; the thread answers how long after `since` it appeared.
fn udp_bound(pid: u32, addr: &str, since: Instant) -> std::thread::JoinHandle<Option<Duration>> {
    let addr: SocketAddr = addr.parse().unwrap();
    let IpAddr::V4(ip) = addr.ip() else {
        unreachable!("an IPv4 address")
    };
    // /proc/net/udp writes the address as the u32 in host order, then the port.
    let local = format!(
        "{:08X}:{:04X}",
        u32::from_le_bytes(ip.octets()),
        addr.port()
    );
    std::thread::spawn(move || {
        while since.elapsed() < Duration::from_secs(10) {
            let table = std::fs::read_to_string(format!("/proc/{pid}/net/udp")).unwrap_or_default();
            if table
                .lines()
                .any(|l| l.split_whitespace().nth(1) == Some(local.as_str()))
            {
                return Some(since.elapsed());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        None
    })
}

/// Waits up to 10 s for the 1,000-peer gateway's UDP port in the seed namespace.
async fn until_bound(lab: &Lab) -> bool {
    let port = PEERS_WG.rsplit(':').next().unwrap_or("0");
    let sport = format!(":{port}");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        let out = lab
            .exec(lab.ns(0), &["ss", "-Huln", "sport", "=", &sport])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        if !out.trim().is_empty() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}
