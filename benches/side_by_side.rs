//! Side-by-side runner: trellis, HAProxy and nginx doing the same jobs on loopback, in one
//! run, against the same TCP backend; prints each figure and the trellis ÷ best-peer ratio.
//!
//! `cargo bench --bench side_by_side` (installs the peers with apt-get when missing).
//! Environment: `BENCH_SECONDS` (per figure and round, default 2), `BENCH_PEERS` (default
//! `haproxy,nginx,floor`; `floor` is a reference, not a peer: see `floor.rs`), `BENCH_IDLE` (idle connections for the memory figure, default 5000),
//! `BENCH_JOBS` (default `sni,proxy-destination,http-connect`), `BENCH_ROUNDS` (default 5),
//! `BENCH_TRELLIS_WORKERS` (default 1, like the peers' single thread), `BENCH_TRELLIS_BIN`
//! (another trellis binary to measure, e.g. a previous build), `BENCH_FIGURES` (default
//! `throughput,rate,latency`: which round figures to measure; the others print as NaN).
//!
//! Jobs: `sni` (TLS passthrough by SNI), `proxy-destination` (routed by a PROXY v2 header's
//! destination), `http-connect` (CONNECT relay; no peer config does this, so trellis only).
//! Backend protocol (port 7001, as the peer configs expect): after the ClientHello record the
//! client sends one command byte: `U` = upload (the backend reads to EOF and answers the byte
//! count as 8 bytes), `E` = echo everything.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![allow(clippy::unwrap_used, unreachable_pub)]

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[path = "side_by_side/floor.rs"]
mod floor;

const BACKEND: &str = "127.0.0.1:7001";
const SNI: &str = "api.alpha.example.com";
const PP_DEST: &str = "10.0.1.10:443";
const CONNECT_DEST: &str = "outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local";
const TRELLIS_ADMIN: &str = "127.0.0.1:8449";
const FLOOR_SNI: &str = "127.0.0.1:8448";
const CONN_WORKERS: usize = 8;
const STREAMS: usize = 8;
const LATENCY_CONNS: usize = 8;
const LATENCY_MSG: usize = 64;

#[derive(Clone, Copy, PartialEq)]
enum Preamble {
    None,
    ProxyV2,
    Connect,
}

#[derive(Clone)]
struct Target {
    proxy: &'static str,
    job: &'static str,
    addr: SocketAddr,
    preamble: Preamble,
}

struct Proxy {
    name: &'static str,
    child: Option<Child>,
    pidfile: Option<PathBuf>,
}

impl Proxy {
    fn pid(&self) -> Option<u32> {
        match (&self.child, &self.pidfile) {
            (Some(c), _) => Some(c.id()),
            (None, Some(p)) => std::fs::read_to_string(p).ok()?.trim().parse().ok(),
            _ => None,
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child
            && matches!(c.try_wait(), Ok(None))
        {
            // SIGTERM, not SIGKILL: nginx's master must stop its workers.
            let _ = Command::new("kill").arg(c.id().to_string()).status();
            let _ = c.wait();
        }
        if let Some(p) = &self.pidfile
            && let Ok(pid) = std::fs::read_to_string(p)
        {
            let _ = Command::new("kill").arg(pid.trim()).status();
            let _ = std::fs::remove_file(p);
        }
    }
}

/// `pid` and its children.
fn tree(pid: u32) -> Vec<u32> {
    let mut pids = vec![pid];
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            let ppid = stat
                .rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().nth(1))
                .and_then(|s| s.parse::<u32>().ok());
            if ppid == Some(pid) {
                pids.push(p);
            }
        }
    }
    pids
}

/// CPU time (user, system) of `pid` and its children, in seconds.
fn tree_cpu(pid: u32) -> (f64, f64) {
    let tick = rustix::param::clock_ticks_per_second() as f64;
    tree(pid)
        .into_iter()
        .map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            let f: Vec<u64> = stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|s| s.parse().ok())
                .collect();
            let at = |k: usize| f.get(k).copied().unwrap_or(0) as f64 / tick;
            (at(0), at(1))
        })
        .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1))
}

/// Resident memory of `pid` and all its descendants, in bytes.
fn tree_rss(pid: u32) -> u64 {
    let mut total = 0;
    for p in tree(pid) {
        let status = std::fs::read_to_string(format!("/proc/{p}/status")).unwrap_or_default();
        if let Some(kb) = status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse::<u64>().ok())
        {
            total += kb * 1024;
        }
    }
    total
}

fn hello() -> Vec<u8> {
    trellis::wire::tls::testing::client_hello(Some(SNI), &["h2"], 1200)
}

async fn backend() {
    let listener = TcpListener::bind(BACKEND)
        .await
        .expect("backend port 7001 must be free");
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let _ = s.set_nodelay(true);
            // Skip the ClientHello record, then read the command byte.
            let mut head = [0u8; 5];
            if s.read_exact(&mut head).await.is_err() {
                return;
            }
            let len = u16::from_be_bytes([head[3], head[4]]) as usize;
            let mut rec = vec![0u8; len + 1];
            if s.read_exact(&mut rec).await.is_err() {
                return;
            }
            if rec[len] == b'U' {
                let mut buf = vec![0u8; 256 * 1024];
                let mut total = 0u64;
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => total += n as u64,
                    }
                }
                let _ = s.write_all(&total.to_be_bytes()).await;
            } else {
                let mut buf = vec![0u8; 16 * 1024];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if s.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    }
                }
            }
        });
    }
}

/// Connects through `t`, sends its preamble, the ClientHello and `cmd`.
async fn open(t: &Target, cmd: u8) -> std::io::Result<TcpStream> {
    let mut s = TcpStream::connect(t.addr).await?;
    s.set_nodelay(true)?;
    let mut msg = Vec::with_capacity(1600);
    match t.preamble {
        Preamble::None => {}
        Preamble::ProxyV2 => msg.extend(trellis::wire::proxy::encode_v2(
            s.local_addr()?,
            PP_DEST.parse().unwrap(),
        )),
        Preamble::Connect => {
            s.write_all(
                format!(
                    "CONNECT {SNI}:443 HTTP/1.1\r\nX-Gardener-Destination: {CONNECT_DEST}\r\n\r\n"
                )
                .as_bytes(),
            )
            .await?;
            let expected = b"HTTP/1.1 200 Connection established\r\n\r\n";
            let mut head = vec![0u8; expected.len()];
            s.read_exact(&mut head).await?;
            if head != expected {
                return Err(std::io::Error::other("CONNECT refused"));
            }
        }
    }
    msg.extend(hello());
    msg.push(cmd);
    s.write_all(&msg).await?;
    Ok(s)
}

async fn works(t: &Target) -> bool {
    for _ in 0..100 {
        if let Ok(Ok(mut s)) = tokio::time::timeout(Duration::from_secs(1), open(t, b'E')).await
            && s.write_all(b"x").await.is_ok()
        {
            let mut b = [0u8; 1];
            if let Ok(Ok(_)) =
                tokio::time::timeout(Duration::from_secs(1), s.read_exact(&mut b)).await
            {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Gbit/s over `streams` parallel uploads.
async fn throughput(t: &Target, streams: usize, secs: f64) -> f64 {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..streams {
        let t = t.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = open(&t, b'U').await.ok()?;
            let chunk = vec![0x5au8; 256 * 1024];
            let start = Instant::now();
            while start.elapsed().as_secs_f64() < secs {
                s.write_all(&chunk).await.ok()?;
            }
            s.shutdown().await.ok()?;
            let mut count = [0u8; 8];
            s.read_exact(&mut count).await.ok()?;
            Some(u64::from_be_bytes(count))
        }));
    }
    let mut bytes = 0;
    for t in tasks {
        bytes += t.await.ok().flatten().unwrap_or(0);
    }
    bytes as f64 * 8.0 / start.elapsed().as_secs_f64() / 1e9
}

/// New connections per second: connect, preamble + ClientHello, one round trip, close.
async fn conn_rate(t: &Target, secs: f64) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..CONN_WORKERS {
        let (done, stop, t) = (done.clone(), stop.clone(), t.clone());
        workers.push(tokio::spawn(async move {
            let mut back = [0u8; 1];
            while !stop.load(Ordering::Relaxed) {
                let Ok(mut s) = open(&t, b'E').await else {
                    continue;
                };
                if s.write_all(b"x").await.is_ok() && s.read_exact(&mut back).await.is_ok() {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let elapsed = start.elapsed().as_secs_f64();
    for w in workers {
        let _ = w.await;
    }
    done.load(Ordering::Relaxed) as f64 / elapsed
}

/// Request/response round-trip times on long-lived connections: (p50, p99) in µs, and how
/// many round trips were made.
async fn latency(t: &Target, secs: f64) -> (f64, f64, usize) {
    let mut tasks = Vec::new();
    for _ in 0..LATENCY_CONNS {
        let t = t.clone();
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            let Ok(mut s) = open(&t, b'E').await else {
                return samples;
            };
            let msg = [7u8; LATENCY_MSG];
            let mut back = [0u8; LATENCY_MSG];
            let start = Instant::now();
            while start.elapsed().as_secs_f64() < secs {
                let t0 = Instant::now();
                if s.write_all(&msg).await.is_err() || s.read_exact(&mut back).await.is_err() {
                    break;
                }
                samples.push(t0.elapsed().as_nanos() as f64 / 1000.0);
            }
            samples
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap_or_default());
    }
    if all.is_empty() {
        return (f64::NAN, f64::NAN, 0);
    }
    all.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| all[((all.len() as f64 * p) as usize).min(all.len() - 1)];
    (pct(0.50), pct(0.99), all.len())
}

/// Bytes of proxy RSS per idle proxied connection, with `n` open.
async fn idle_memory(t: &Target, pid: u32, n: usize) -> f64 {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = tree_rss(pid);
    let mut conns = Vec::with_capacity(n);
    for chunk in 0..n.div_ceil(200) {
        let mut batch = Vec::new();
        for _ in 0..200.min(n - chunk * 200) {
            let t = t.clone();
            batch.push(tokio::spawn(async move {
                let mut s = open(&t, b'E').await.ok()?;
                s.write_all(b"x").await.ok()?;
                let mut b = [0u8; 1];
                tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut b))
                    .await
                    .ok()?
                    .ok()?;
                Some(s)
            }));
        }
        for b in batch {
            if let Ok(Some(s)) = b.await {
                conns.push(s);
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = tree_rss(pid);
    let opened = conns.len();
    drop(conns);
    if opened < n {
        eprintln!(
            "  {}/{}: only {opened} of {n} idle connections opened",
            t.proxy, t.job
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    after.saturating_sub(before) as f64 / opened.max(1) as f64
}

fn ensure_installed(bin: &str, packages: &[&str]) -> bool {
    if Command::new("sh")
        .args(["-c", &format!("command -v {bin}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        return true;
    }
    eprintln!("installing {packages:?} ...");
    let _ = Command::new("apt-get").arg("update").arg("-qq").status();
    Command::new("apt-get")
        .args(["install", "-y", "-qq"])
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .is_ok_and(|s| s.success())
}

/// Starts the command in a session of its own, as HAProxy's `-D` and any service manager or
/// container runtime do. With the kernel's session autogroups (`sched_autogroup_enabled`, on
/// here) a proxy left in the bench's session shares one group's CPU share with the client
/// and backend threads, while a proxy in its own session gets a share of its own: in an A/A
/// run, HAProxy left in the bench's session made 0.78-0.96x the connections per second of
/// HAProxy in its own.
/// Out of the terminal's process group, the proxy no longer gets the Ctrl-C that stops the
/// bench, so it is told to stop (`SIGTERM`) when the bench exits, however it exits: a
/// leftover proxy would keep its ports and answer in place of the next run's.
#[allow(unsafe_code)] // pre_exec is unsafe by contract
fn own_session(cmd: &mut Command) -> &mut Command {
    use rustix::process::{Signal, getpid, getppid, set_parent_process_death_signal, setsid};
    let bench = getpid();
    // SAFETY: only async-signal-safe calls that do not allocate run in the forked child:
    // rustix makes these system calls directly.
    unsafe {
        cmd.pre_exec(move || {
            setsid()?;
            set_parent_process_death_signal(Some(Signal::TERM))?;
            if getppid() != Some(bench) {
                // The bench died before the death signal was armed.
                return Err(std::io::ErrorKind::Interrupted.into());
            }
            Ok(())
        })
    }
}

/// Idle connections held open for the memory figure (`BENCH_IDLE`).
fn idle_connections() -> usize {
    std::env::var("BENCH_IDLE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000)
}

fn start_trellis(dir: &Path) -> (Proxy, Vec<Target>) {
    std::fs::write(
        dir.join("routes.yaml"),
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n- name: alpha\n  sni: [{SNI}]\n  proxyDestinations: [\"{PP_DEST}\"]\n  destinations: [\"{CONNECT_DEST}\"]\n  backends: [{{address: \"{BACKEND}\"}}]\n"
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("gateway.yaml"),
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: GatewayConfiguration\nroutes: {{file: routes.yaml}}\nlisteners:\n- {{name: tls, address: \"127.0.0.1:8440\", protocol: sni}}\n- {{name: pp, address: \"127.0.0.1:8450\", protocol: proxy-destination}}\n- {{name: connect, address: \"127.0.0.1:8460\", protocol: http-connect}}\nadmin: {{address: \"{TRELLIS_ADMIN}\"}}\nlimits: {{maxConnections: {}}}\nworkers: {}\ntimeouts: {{drainDelay: 0s}}\n",
            // Room for the idle connections, within the open files the host allows.
            idle_connections() + 1000,
            std::env::var("BENCH_TRELLIS_WORKERS").unwrap_or_else(|_| "1".into())
        ),
    )
    .unwrap();
    // BENCH_TRELLIS_BIN compares another build (e.g. the previous commit's) in the same run.
    let bin = std::env::var("BENCH_TRELLIS_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_trellis").to_string());
    let child = own_session(&mut Command::new(bin))
        .args(["gateway", "--config"])
        .arg(dir.join("gateway.yaml"))
        .env("TRELLIS_LOG", "warn")
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let targets = vec![
        Target {
            proxy: "trellis",
            job: "sni",
            addr: "127.0.0.1:8440".parse().unwrap(),
            preamble: Preamble::None,
        },
        Target {
            proxy: "trellis",
            job: "proxy-destination",
            addr: "127.0.0.1:8450".parse().unwrap(),
            preamble: Preamble::ProxyV2,
        },
        Target {
            proxy: "trellis",
            job: "http-connect",
            addr: "127.0.0.1:8460".parse().unwrap(),
            preamble: Preamble::Connect,
        },
    ];
    (
        Proxy {
            name: "trellis",
            child: Some(child),
            pidfile: None,
        },
        targets,
    )
}

/// The floor (`floor.rs`): this bench binary again, in a session of its own.
fn start_floor() -> Option<(Proxy, Vec<Target>)> {
    let child = own_session(&mut Command::new(std::env::current_exe().ok()?))
        .env("BENCH_FLOOR_SERVE", FLOOR_SNI)
        .stderr(Stdio::inherit())
        .spawn()
        .ok()?;
    let target = Target {
        proxy: "floor",
        job: "sni",
        addr: FLOOR_SNI.parse().unwrap(),
        preamble: Preamble::None,
    };
    Some((
        Proxy {
            name: "floor",
            child: Some(child),
            pidfile: None,
        },
        vec![target],
    ))
}

fn start_haproxy(peers: &Path) -> Option<(Proxy, Vec<Target>)> {
    if !ensure_installed("haproxy", &["haproxy"]) {
        return None;
    }
    let pidfile = PathBuf::from("/tmp/peer-haproxy.pid");
    let ok = Command::new("haproxy")
        .arg("-f")
        .arg(peers.join("haproxy.cfg"))
        .args(["-D", "-p"])
        .arg(&pidfile)
        .status()
        .is_ok_and(|s| s.success());
    let targets = vec![
        Target {
            proxy: "haproxy",
            job: "sni",
            addr: "127.0.0.1:8441".parse().unwrap(),
            preamble: Preamble::None,
        },
        Target {
            proxy: "haproxy",
            job: "proxy-destination",
            addr: "127.0.0.1:8451".parse().unwrap(),
            preamble: Preamble::ProxyV2,
        },
    ];
    ok.then(|| {
        (
            Proxy {
                name: "haproxy",
                child: None,
                pidfile: Some(pidfile),
            },
            targets,
        )
    })
}

fn start_nginx(peers: &Path) -> Option<(Proxy, Vec<Target>)> {
    if !ensure_installed("nginx", &["nginx", "libnginx-mod-stream"]) {
        return None;
    }
    let child = own_session(&mut Command::new("nginx"))
        .arg("-c")
        .arg(peers.join("nginx.conf"))
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let targets = vec![
        Target {
            proxy: "nginx",
            job: "sni",
            addr: "127.0.0.1:8442".parse().unwrap(),
            preamble: Preamble::None,
        },
        Target {
            proxy: "nginx",
            job: "proxy-destination",
            addr: "127.0.0.1:8452".parse().unwrap(),
            preamble: Preamble::ProxyV2,
        },
    ];
    Some((
        Proxy {
            name: "nginx",
            child: Some(child),
            pidfile: None,
        },
        targets,
    ))
}

/// One row of results.
struct Row {
    proxy: &'static str,
    job: &'static str,
    figures: [f64; 6],
}

const FIGURES: [(&str, bool); 6] = [
    ("throughput, 1 stream (Gbit/s)", true),
    ("throughput, 8 streams (Gbit/s)", true),
    ("new connections per second", true),
    ("latency p50 (µs)", false),
    ("latency p99 (µs)", false),
    ("memory per idle connection (bytes)", false),
];

fn main() {
    if let Ok(listen) = std::env::var("BENCH_FLOOR_SERVE") {
        floor::serve(&listen, BACKEND.parse().unwrap());
    }
    // `cargo bench` passes `--bench`; a filter that excludes us means skip.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if !args.is_empty() && !args.iter().any(|a| "side_by_side".contains(a.as_str())) {
        return;
    }
    let _ = trellis::net::socket::raise_nofile_limit();
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let secs: f64 = env("BENCH_SECONDS", "2").parse().unwrap_or(2.0);
    let rounds: usize = env("BENCH_ROUNDS", "5").parse().unwrap_or(5);
    let idle = idle_connections();
    let peers_wanted = env("BENCH_PEERS", "haproxy,nginx,floor");
    let jobs = env("BENCH_JOBS", "sni,proxy-destination,http-connect");
    let figures = env("BENCH_FIGURES", "throughput,rate,latency");
    let (want_tput, want_rate, want_lat) = (
        figures.split(',').any(|f| f == "throughput"),
        figures.split(',').any(|f| f == "rate"),
        figures.split(',').any(|f| f == "latency"),
    );
    let peers_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/side_by_side/peers");
    let work = std::env::temp_dir().join(format!("trellis-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let rows = rt.block_on(async {
        tokio::spawn(backend());
        type Starter<'a> = Box<dyn Fn() -> Option<(Proxy, Vec<Target>)> + 'a>;
        let mut starters: Vec<Starter> = vec![Box::new(|| Some(start_trellis(&work)))];
        if peers_dir.exists() {
            if peers_wanted.contains("haproxy") {
                starters.push(Box::new(|| start_haproxy(&peers_dir)));
            }
            if peers_wanted.contains("nginx") {
                starters.push(Box::new(|| start_nginx(&peers_dir)));
            }
        } else {
            eprintln!("no peer configs at {}; measuring trellis only", peers_dir.display());
        }
        if peers_wanted.contains("floor") {
            starters.push(Box::new(start_floor));
        }
        let mut rows = Vec::new();
        for job in jobs.split(',') {
            // Fresh processes per job; memory first, so no figure inherits a heap another
            // one grew. Then the other figures in interleaved rounds, reported as medians,
            // because a 2-core machine shared by client, proxies and backend is noisy.
            let mut running = Vec::new();
            for start in &starters {
                let Some((mut proxy, targets)) = start() else { continue };
                let Some(t) = targets.into_iter().find(|t| t.job == job) else { continue };
                if !works(&t).await {
                    eprintln!("{} {} does not work on {}; skipped", t.proxy, t.job, t.addr);
                    continue;
                }
                // Answered, but not by the process just started (it could not bind and is
                // exiting, or has).
                tokio::time::sleep(Duration::from_millis(200)).await;
                if let Some(c) = &mut proxy.child
                    && !matches!(c.try_wait(), Ok(None))
                {
                    eprintln!(
                        "{} exited, yet {} answers: is an earlier one still running? skipped",
                        t.proxy, t.addr
                    );
                    continue;
                }
                running.push((proxy, t));
            }
            let mut samples: Vec<[Vec<f64>; 6]> = running.iter().map(|_| Default::default()).collect();
            for (i, (proxy, t)) in running.iter().enumerate() {
                if let Some(pid) = proxy.pid() {
                    samples[i][5].push(idle_memory(t, pid, idle).await);
                }
            }
            for round in 0..rounds {
                // Each round starts with another proxy, so none always goes first (an A/A run
                // showed the first place costing 5-10 % of p99).
                for k in 0..running.len() {
                    let i = (k + round) % running.len();
                    let (proxy, t) = &running[i];
                    let (one, eight) = if want_tput {
                        (throughput(t, 1, secs).await, throughput(t, STREAMS, secs).await)
                    } else {
                        (f64::NAN, f64::NAN)
                    };
                    // The proxy's CPU time (all, user space) in µs per event of a figure.
                    let per = |a: Option<(f64, f64)>, n: f64| match (a, proxy.pid().map(tree_cpu)) {
                        (Some(a), Some(b)) => (
                            (b.0 + b.1 - a.0 - a.1) * 1e6 / n.max(1.0),
                            (b.0 - a.0) * 1e6 / n.max(1.0),
                        ),
                        _ => (f64::NAN, f64::NAN),
                    };
                    let before = proxy.pid().map(tree_cpu).filter(|_| want_rate);
                    let rate = if want_rate { conn_rate(t, secs).await } else { f64::NAN };
                    // The proxy's own CPU per proxied connection (and its user-space part):
                    // what the rate costs it.
                    let (cpu_us, user_us) = per(before, rate * secs);
                    let before = proxy.pid().map(tree_cpu).filter(|_| want_lat);
                    let (p50, p99, trips) = if want_lat {
                        latency(t, secs).await
                    } else {
                        (f64::NAN, f64::NAN, 0)
                    };
                    let (trip_us, _) = per(before, trips as f64);
                    eprintln!(
                        "round {round} {:8} {:18} 1x {one:6.2} Gbit/s  8x {eight:6.2} Gbit/s  {rate:7.0} conn/s ({cpu_us:4.1} µs CPU each, {user_us:3.1} in user space)  p50 {p50:6.1} µs  p99 {p99:7.1} µs ({:.0} round trips/s, {trip_us:4.1} µs CPU each)",
                        t.proxy,
                        t.job,
                        trips as f64 / secs,
                    );
                    for (k, v) in [one, eight, rate, p50, p99].into_iter().enumerate() {
                        samples[i][k].push(v);
                    }
                }
            }
            for (i, (proxy, t)) in running.iter().enumerate() {
                let figures = std::array::from_fn(|k| median(&mut samples[i][k]));
                rows.push(Row { proxy: proxy.name, job: t.job, figures });
            }
            drop(running);
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        rows
    });
    let _ = std::fs::remove_dir_all(&work);
    print_table(&rows, secs, rounds, idle);
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn print_table(rows: &[Row], secs: f64, rounds: usize, idle: usize) {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    println!(
        "\nside-by-side on loopback: medians of {rounds} interleaved rounds of {secs} s per figure; {idle} idle connections; {cores} cores shared by client, proxies and backend"
    );
    let mut jobs: Vec<&str> = Vec::new();
    for r in rows {
        if !jobs.contains(&r.job) {
            jobs.push(r.job);
        }
    }
    for job in jobs {
        let in_job: Vec<&Row> = rows.iter().filter(|r| r.job == job).collect();
        println!("\n{job}");
        print!("{:38}", "figure");
        for r in &in_job {
            print!("{:>12}", r.proxy);
        }
        let floor = in_job.iter().find(|r| r.proxy == "floor");
        print!("{:>14}", "trellis/best");
        println!(
            "{}",
            if floor.is_some() {
                "    floor/best"
            } else {
                ""
            }
        );
        for (i, (label, higher_is_better)) in FIGURES.iter().enumerate() {
            print!("{label:38}");
            for r in &in_job {
                print!("{:>12.2}", r.figures[i]);
            }
            let trellis = in_job
                .iter()
                .find(|r| r.proxy == "trellis")
                .map(|r| r.figures[i]);
            let peers = in_job
                .iter()
                .filter(|r| r.proxy != "trellis" && r.proxy != "floor")
                .map(|r| r.figures[i])
                .filter(|v| v.is_finite());
            let best = if *higher_is_better {
                peers.fold(f64::NAN, f64::max)
            } else {
                peers.fold(f64::NAN, f64::min)
            };
            let ratio = |v: Option<f64>| match v {
                Some(v) if best.is_finite() && v.is_finite() => format!("{:>13.2}x", v / best),
                _ => format!("{:>14}", "-"),
            };
            print!("{}", ratio(trellis));
            println!(
                "{}",
                floor.map(|f| ratio(Some(f.figures[i]))).unwrap_or_default()
            );
        }
    }
    println!(
        "\nratios: for throughput and connections higher is better; for latency and memory lower is better"
    );
    if rows.iter().any(|r| r.proxy == "floor") {
        println!(
            "floor: a reference, not a peer (left out of \"best\"): one bare epoll loop that waits for the first bytes, connects and copies; no parsing, timers, limits or splice"
        );
    }
}
