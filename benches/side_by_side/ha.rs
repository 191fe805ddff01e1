//! The `ha` job: the tunnel with two gateway replicas and two `trellis agent` replicas, and
//! the agent's memory.
//!
//! Lab: namespaces `haseed` (two gateways sharing one key and one table, and a third
//! trellis in front of their egress listeners, an `sni` route with both as backends,
//! standing in for the Service) and `hashoot` (two agents, each with one session per
//! gateway replica, and the target server on 10.98.0.2:7101), joined by a veth pair.
//!
//! Figures:
//! - agent RSS with its sessions up and idle, then with 1,000 tunneled streams open
//!   through it (only one agent runs for this part, so every stream is its);
//! - the HA gap: a client opens a new connection (CONNECT + one echo) every 20 ms while
//!   each replica in turn is killed with SIGKILL (gateway 0, gateway 1, agent 0, agent 1;
//!   each started again and its sessions back before the next); the longest time between
//!   two successful connections after each kill, against 2 s.
//!
//! Needs root; prints SKIP otherwise. It never sends a packet outside its namespaces.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;

use crate::lab::{self, Keypair, Lab, Proc};
use crate::{Stream, connect_reply, egress, tree_rss};

/// The target server (shoot namespace).
const TARGET: &str = "10.98.0.2:7101";
/// The gateways' wireguard listeners (seed namespace).
const WG: [&str; 2] = ["10.98.0.1:51840", "10.98.0.1:51841"];
/// The gateways' egress listeners.
const EGRESS: [&str; 2] = ["127.0.0.1:9450", "127.0.0.1:9451"];
/// The gateways' admin and debug listeners.
const ADMIN: [(&str, &str); 2] = [
    ("127.0.0.1:15040", "127.0.0.1:15042"),
    ("127.0.0.1:15041", "127.0.0.1:15043"),
];
/// The first agent's admin port (the second's is the next).
const AGENT_ADMIN: u16 = 16921;
/// The front (load balancer) in front of the egress listeners.
const FRONT: &str = "127.0.0.1:9449";
/// Tunneled streams held open for the memory figure.
const STREAMS: usize = 1000;
/// How often the client opens a connection during the kills.
const EVERY: Duration = Duration::from_millis(20);
/// How long each kill is watched.
const WATCH: Duration = Duration::from_secs(5);
/// The target for the longest gap.
const GAP_TARGET: Duration = Duration::from_secs(2);

/// Runs `f` on `rt` and waits for it.
async fn on<F, T>(rt: &Handle, f: F) -> T
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    rt.spawn(f).await.unwrap()
}

/// The server: echoes whatever it reads.
async fn serve(listener: TcpListener) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let (mut r, mut w) = s.split();
            let _ = tokio::io::copy(&mut r, &mut w).await;
        });
    }
}

/// Connects through the front, CONNECTs to the target and makes one echo round trip.
async fn attempt(tls: Arc<egress::Client>) -> std::io::Result<Stream> {
    let tcp = TcpStream::connect(FRONT).await?;
    tcp.set_nodelay(true)?;
    let (name, config) = tls.next();
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await?;
    let mut s = Stream::Tls(Box::new(tls));
    s.send(format!("CONNECT {TARGET} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    connect_reply(&mut s).await?;
    s.send(b"e").await?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await?;
    Ok(s)
}

/// The body of `GET path` at `addr` (empty on any failure).
async fn get(addr: String, path: &str) -> String {
    let Ok(mut s) = TcpStream::connect(&addr).await else {
        return String::new();
    };
    use tokio::io::AsyncWriteExt;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut body = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut body)).await;
    let text = String::from_utf8_lossy(&body);
    text.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

/// Lanes of the agent whose admin port is `port` (in the shoot) that have a session.
async fn lanes_up(port: u16) -> usize {
    let text = get(format!("127.0.0.1:{port}"), "/metrics").await;
    text.lines()
        .filter(|l| l.starts_with("trellis_tunnel_endpoint{") && l.ends_with(" 1"))
        .count()
}

/// Peers with a live session at the gateway whose debug endpoint is `debug`.
async fn live_peers(debug: &str) -> usize {
    let json = get(debug.to_string(), "/routes").await;
    fn count(v: &serde_json::Value) -> usize {
        match v {
            serde_json::Value::Object(m) => {
                usize::from(
                    m.get("live") == Some(&serde_json::Value::Bool(true))
                        && m.contains_key("publicKey"),
                ) + m.values().map(count).sum::<usize>()
            }
            serde_json::Value::Array(a) => a.iter().map(count).sum(),
            _ => 0,
        }
    }
    serde_json::from_str(&json).map(|v| count(&v)).unwrap_or(0)
}

/// Waits up to `limit` until every gateway has `n` live peers.
async fn sessions(seed: &Handle, n: usize, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        let mut all = true;
        for (_, debug) in ADMIN {
            all &= on(seed, live_peers(debug)).await == n;
        }
        if all {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The configurations: keys, one table for both gateways, the gateways', the front's and
/// the agents'.
struct Setup {
    gateways: [PathBuf; 2],
    front: PathBuf,
    agents: [PathBuf; 2],
}

fn write_configs(dir: &Path, pki: &Path, gw: &Keypair, agents: &[Keypair; 2]) -> Setup {
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let gw_key = write("gateway.key", format!("{}\n", gw.private));
    let peers: String = agents
        .iter()
        .enumerate()
        .map(|(i, k)| {
            format!(
                "      - publicKey: \"{}\"\n        allowedIPs: [\"192.168.132.{}/32\", \"10.98.0.0/24\"]\n",
                k.public,
                5 + i
            )
        })
        .collect();
    let routes = write(
        "routes.yaml",
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- name: shoot--bench--ha
  tunnel:
    wireguard:
      peers:
{peers}      localAddresses: [192.168.132.1]
  egress:
    clientSources: [\"127.0.0.1/32\"]
    allowedNetworks: [\"10.98.0.0/24\"]
"
        ),
    );
    let r0 = egress::route_dir(pki, 0);
    let gateway = |i: usize| {
        write(
            &format!("gateway-{i}.yaml"),
            format!(
                "apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {{file: \"{}\"}}
listeners:
- name: wireguard
  address: \"{}\"
  protocol: wireguard
  wireguard: {{privateKeyFile: \"{}\"}}
- name: egress
  address: \"{}\"
  protocol: egress-connect
  tls: {{certificateFile: \"{}\", keyFile: \"{}\", clientCAFile: \"{}\"}}
admin: {{address: \"{}\", debugAddress: \"{}\"}}
limits: {{maxConnections: 10000, maxConnectionsPerSource: 0}}
timeouts: {{drainDelay: 0s}}
",
                routes.display(),
                WG[i],
                gw_key.display(),
                EGRESS[i],
                r0.join("tls.crt").display(),
                r0.join("tls.key").display(),
                r0.join("ca.crt").display(),
                ADMIN[i].0,
                ADMIN[i].1,
            ),
        )
    };
    let front_routes = write(
        "front-routes.yaml",
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- name: egress-replicas
  sni: [\"{}\"]
  backends: [{{address: \"{}\"}}, {{address: \"{}\"}}]
",
            egress::SERVER_NAME,
            EGRESS[0],
            EGRESS[1]
        ),
    );
    let front = write(
        "front.yaml",
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {{file: \"{}\"}}
listeners:
- name: front
  address: \"{FRONT}\"
  protocol: sni
admin: {{address: \"127.0.0.1:15044\"}}
limits: {{maxConnections: 10000, maxConnectionsPerSource: 0}}
timeouts: {{drainDelay: 0s}}
",
            front_routes.display()
        ),
    );
    let agent = |i: usize| {
        let key = write(
            &format!("agent-{i}.key"),
            format!("{}\n", agents[i].private),
        );
        write(
            &format!("agent-{i}.yaml"),
            format!(
                "apiVersion: trellis.gardener.cloud/v1alpha1
kind: AgentConfiguration
wireguard:
  privateKeyFile: \"{}\"
  addresses: [192.168.132.{}]
  gateway:
    publicKey: \"{}\"
    replicas:
    - endpoints: [{{udp: \"{}\"}}]
    - endpoints: [{{udp: \"{}\"}}]
    persistentKeepalive: 10s
networks: [\"10.98.0.0/24\"]
admin: {{address: \"127.0.0.1:{}\"}}
",
                key.display(),
                5 + i,
                gw.public,
                WG[0],
                WG[1],
                usize::from(AGENT_ADMIN) + i
            ),
        )
    };
    Setup {
        gateways: [gateway(0), gateway(1)],
        front,
        agents: [agent(0), agent(1)],
    }
}

/// Starts `trellis <role> --config <config>` in `ns`.
fn start(lab: &Lab, ns: &str, role: &str, config: &Path, log: &Path) -> Proc {
    let bin = crate::trellis_bin();
    lab::spawn(
        lab,
        ns,
        &[&bin, role, "--config", config.to_str().unwrap()],
        log,
    )
}

/// The longest time between two successive successes in `[from, to]`.
fn longest_gap(successes: &[Instant], from: Instant, to: Instant) -> Duration {
    let mut times: Vec<Instant> = successes.to_vec();
    times.sort();
    let mut last = from;
    let mut gap = Duration::ZERO;
    for t in times.iter().filter(|t| **t >= from && **t <= to) {
        gap = gap.max(t.saturating_duration_since(last));
        last = *t;
    }
    gap.max(to.saturating_duration_since(last))
}

/// The `ha` job (see the module documentation); prints its own report.
pub fn run(work: &Path, cache: &Path) {
    if let Some(why) = lab::skip_reason(&[]) {
        println!("\nSKIP ha: {why}");
        return;
    }
    let dir = work.join("ha");
    let lab = Lab::new(&["haseed", "hashoot"], &dir);
    let (seed_ns, shoot_ns) = (lab.ns(0).to_string(), lab.ns(1).to_string());
    lab.veth(0, "10.98.0.1/24", 1, "10.98.0.2/24");
    let pki = dir.join("pki");
    if let Err(e) = egress::generate(&pki, 1, cache) {
        println!("\nSKIP ha: egress certificates: {e}");
        return;
    }
    let tls = Arc::new(egress::Client::load(&pki, 1).unwrap());
    let gw_keys = lab::keypair();
    let agent_keys = [lab::keypair(), lab::keypair()];
    let setup = write_configs(&dir, &pki, &gw_keys, &agent_keys);
    let seed_rt = lab::runtime_in(&seed_ns, 2);
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
    });
    let log = |name: &str| dir.join(format!("{name}.log"));
    let mut gateways: Vec<Proc> = (0..2)
        .map(|i| {
            start(
                &lab,
                &seed_ns,
                "gateway",
                &setup.gateways[i],
                &log(&format!("gateway-{i}")),
            )
        })
        .collect();
    let _front = start(&lab, &seed_ns, "gateway", &setup.front, &log("front"));
    let mut agents: Vec<Option<Proc>> = vec![
        Some(start(
            &lab,
            &shoot_ns,
            "agent",
            &setup.agents[0],
            &log("agent-0"),
        )),
        None,
    ];

    println!("\n## ha: two gateway replicas, two agent replicas (one run)\n");
    ctl.block_on(async {
        if !sessions(&seed, 1, Duration::from_secs(30)).await {
            println!("SKIP ha: agent 0 got no session with both gateways (logs in {})", dir.display());
            return;
        }
        // The agent's memory: idle, then with STREAMS streams through it.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let pid = agents[0].as_ref().map(Proc::pid).unwrap_or(0);
        let idle = tree_rss(pid);
        let mut held = Vec::with_capacity(STREAMS);
        let mut failed = 0;
        let mut first_error: Option<String> = None;
        for _ in 0..STREAMS / 50 {
            let opened = (0..50).map(|_| {
                let tls = tls.clone();
                seed.spawn(attempt(tls))
            });
            for h in opened.collect::<Vec<_>>() {
                match h.await.unwrap() {
                    Ok(s) => held.push(s),
                    Err(e) => {
                        failed += 1;
                        first_error.get_or_insert_with(|| e.to_string());
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let busy = tree_rss(pid);
        let per = (busy.saturating_sub(idle)) as f64 / held.len().max(1) as f64;
        println!("| agent | RSS |");
        println!("|---|---|");
        println!("| idle, sessions with both gateways | {:.1} MiB |", idle as f64 / 1048576.0);
        println!(
            "| {} tunneled streams open ({failed} failed to open) | {:.1} MiB ({:.1} KiB per stream) |",
            held.len(),
            busy as f64 / 1048576.0,
            per / 1024.0
        );
        if let Some(e) = first_error {
            println!("\n(first failure to open: {e})");
            for name in ["front", "gateway-0", "agent-0"] {
                let text = std::fs::read_to_string(log(name)).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(4).collect();
                println!("{name}: {}", tail.join("\n  "));
            }
        }
        for s in held.drain(..) {
            s.close().await;
        }
    });

    agents[1] = Some(start(
        &lab,
        &shoot_ns,
        "agent",
        &setup.agents[1],
        &log("agent-1"),
    ));
    let ready = ctl.block_on(sessions(&seed, 2, Duration::from_secs(30)));
    if !ready {
        println!(
            "SKIP ha gap: not every session came up (logs in {})",
            dir.display()
        );
        return;
    }
    let successes: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let client = {
        let (successes, stop, tls) = (successes.clone(), stop.clone(), tls.clone());
        seed.spawn(async move {
            let mut tick = tokio::time::interval(EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let tls = tls.clone();
                let successes = successes.clone();
                // Each attempt on its own: a slow one does not hold the next back.
                tokio::spawn(async move {
                    let ok = tokio::time::timeout(Duration::from_secs(10), attempt(tls)).await;
                    if let Ok(Ok(s)) = ok {
                        successes.lock().unwrap().push(Instant::now());
                        s.close().await;
                    }
                });
            }
        })
    };
    let mut rows = Vec::new();
    for what in ["gateway 0", "gateway 1", "agent 0", "agent 1"] {
        let i = usize::from(what.ends_with('1'));
        let from = Instant::now();
        if what.starts_with("gateway") {
            gateways[i].kill9();
        } else if let Some(a) = agents[i].as_mut() {
            a.kill9();
        }
        std::thread::sleep(WATCH);
        let gap = {
            let mut s = successes.lock().unwrap().clone();
            s.sort();
            longest_gap(&s, from, Instant::now())
        };
        rows.push((what, gap));
        if what.starts_with("gateway") {
            gateways[i] = start(
                &lab,
                &seed_ns,
                "gateway",
                &setup.gateways[i],
                &log(&format!("gateway-{i}-again")),
            );
        } else {
            agents[i] = Some(start(
                &lab,
                &shoot_ns,
                "agent",
                &setup.agents[i],
                &log(&format!("agent-{i}-again")),
            ));
        }
        // A restarted agent's old sessions still look live at the gateways: wait for the
        // new process's own, with each replica.
        ctl.block_on(async {
            let start = Instant::now();
            while what.starts_with("agent")
                && on(&shoot, lanes_up(AGENT_ADMIN + u16::from(i == 1))).await < 2
                && start.elapsed() < Duration::from_secs(60)
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        if !ctl.block_on(sessions(&seed, 2, Duration::from_secs(60))) {
            println!(
                "(sessions not all back after {what} restarted; logs in {})",
                dir.display()
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    let _ = ctl.block_on(client);
    println!(
        "\n| killed (SIGKILL), a new connection every {} ms | longest gap | target | verdict |",
        EVERY.as_millis()
    );
    println!("|---|---|---|---|");
    for (what, gap) in rows {
        println!(
            "| {what} | {:.2} s | ≤ {} s | {} |",
            gap.as_secs_f64(),
            GAP_TARGET.as_secs(),
            if gap <= GAP_TARGET { "met" } else { "not met" }
        );
    }
}
