//! Side-by-side runner: trellis, HAProxy and nginx doing the same SNI passthrough job on
//! loopback, in one run, against the same TCP backend; prints each figure and the
//! trellis ÷ best-peer ratio.
//!
//! `cargo bench --bench side_by_side` (installs the peers with apt-get when missing).
//! Environment: `BENCH_SECONDS` (per figure, default 3), `BENCH_PEERS` (default
//! `haproxy,nginx`).
//!
//! Backend protocol (port 7001, as the peer configs expect): the client sends a ClientHello
//! for `api.alpha.example.com`, then one command byte: `U` = upload (the backend reads to
//! EOF and answers the byte count as 8 bytes), `E` = echo everything.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const BACKEND: &str = "127.0.0.1:7001";
const SNI: &str = "api.alpha.example.com";
const TRELLIS_SNI: &str = "127.0.0.1:8440";
const TRELLIS_ADMIN: &str = "127.0.0.1:8449";
const HAPROXY_SNI: &str = "127.0.0.1:8441";
const NGINX_SNI: &str = "127.0.0.1:8442";
const CONN_WORKERS: usize = 8;

struct Proxy {
    name: &'static str,
    addr: SocketAddr,
    child: Option<Child>,
    pidfile: Option<PathBuf>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
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
            match rec[len] {
                b'U' => {
                    let mut buf = vec![0u8; 256 * 1024];
                    let mut total = 0u64;
                    loop {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => total += n as u64,
                        }
                    }
                    let _ = s.write_all(&total.to_be_bytes()).await;
                }
                _ => {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                }
            }
        });
    }
}

async fn wait_port(addr: SocketAddr) -> bool {
    for _ in 0..200 {
        if let Ok(mut s) = TcpStream::connect(addr).await {
            // A proxy is up when a routed round trip works.
            let mut msg = hello();
            msg.extend_from_slice(b"Ex");
            if s.write_all(&msg).await.is_ok() {
                let mut back = vec![0u8; 1];
                if tokio::time::timeout(Duration::from_secs(1), s.read_exact(&mut back))
                    .await
                    .is_ok()
                {
                    return true;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

async fn single_stream(addr: SocketAddr, secs: f64) -> f64 {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut msg = hello();
    msg.push(b'U');
    s.write_all(&msg).await.unwrap();
    let chunk = vec![0x5au8; 256 * 1024];
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < secs {
        s.write_all(&chunk).await.unwrap();
    }
    s.shutdown().await.unwrap();
    let mut count = [0u8; 8];
    s.read_exact(&mut count).await.unwrap();
    let elapsed = start.elapsed().as_secs_f64();
    u64::from_be_bytes(count) as f64 * 8.0 / elapsed / 1e9
}

async fn conn_rate(addr: SocketAddr, secs: f64) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut msg = hello();
    msg.extend_from_slice(b"Ex");
    let msg = Arc::new(msg);
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..CONN_WORKERS {
        let (done, stop, msg) = (done.clone(), stop.clone(), msg.clone());
        workers.push(tokio::spawn(async move {
            let mut back = vec![0u8; 1];
            while !stop.load(Ordering::Relaxed) {
                let Ok(mut s) = TcpStream::connect(addr).await else {
                    continue;
                };
                let _ = s.set_nodelay(true);
                if s.write_all(&msg).await.is_err() {
                    continue;
                }
                if s.read_exact(&mut back).await.is_ok() {
                    done.fetch_add(1, Ordering::Relaxed);
                }
                // Close with RST-free FIN from the client side.
                drop(s);
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

fn start_trellis(dir: &Path) -> Proxy {
    std::fs::write(
        dir.join("routes.yaml"),
        format!("apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n- name: alpha\n  sni: [{SNI}]\n  backends: [{{address: \"{BACKEND}\"}}]\n"),
    )
    .unwrap();
    std::fs::write(
        dir.join("gateway.yaml"),
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: GatewayConfiguration\nroutes: {{file: routes.yaml}}\nlisteners:\n- {{name: tls, address: \"{TRELLIS_SNI}\", protocol: sni}}\nadmin: {{address: \"{TRELLIS_ADMIN}\"}}\n"
        ),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args(["gateway", "--config"])
        .arg(dir.join("gateway.yaml"))
        .env("TRELLIS_LOG", "warn")
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    Proxy {
        name: "trellis",
        addr: TRELLIS_SNI.parse().unwrap(),
        child: Some(child),
        pidfile: None,
    }
}

fn start_haproxy(peers: &Path) -> Option<Proxy> {
    if !ensure_installed("haproxy", &["haproxy"]) {
        return None;
    }
    let pidfile = PathBuf::from("/tmp/peer-haproxy.pid");
    let ok = Command::new("haproxy")
        .args(["-f"])
        .arg(peers.join("haproxy.cfg"))
        .args(["-D", "-p"])
        .arg(&pidfile)
        .status()
        .is_ok_and(|s| s.success());
    ok.then(|| Proxy {
        name: "haproxy",
        addr: HAPROXY_SNI.parse().unwrap(),
        child: None,
        pidfile: Some(pidfile),
    })
}

fn start_nginx(peers: &Path) -> Option<Proxy> {
    if !ensure_installed("nginx", &["nginx", "libnginx-mod-stream"]) {
        return None;
    }
    let child = Command::new("nginx")
        .arg("-c")
        .arg(peers.join("nginx.conf"))
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    Some(Proxy {
        name: "nginx",
        addr: NGINX_SNI.parse().unwrap(),
        child: Some(child),
        pidfile: None,
    })
}

fn main() {
    // `cargo bench` passes `--bench`; a bench filter that excludes us means skip.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if !args.is_empty() && !args.iter().any(|a| "side_by_side".contains(a.as_str())) {
        return;
    }
    let secs: f64 = std::env::var("BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    let peers_wanted = std::env::var("BENCH_PEERS").unwrap_or_else(|_| "haproxy,nginx".into());
    let peers_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/peers");
    let work = std::env::temp_dir().join(format!("trellis-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::spawn(backend());
        let mut proxies = vec![start_trellis(&work)];
        if peers_dir.exists() {
            if peers_wanted.contains("haproxy")
                && let Some(p) = start_haproxy(&peers_dir)
            {
                proxies.push(p);
            }
            if peers_wanted.contains("nginx")
                && let Some(p) = start_nginx(&peers_dir)
            {
                proxies.push(p);
            }
        } else {
            eprintln!(
                "no peer configs at {}; measuring trellis only",
                peers_dir.display()
            );
        }
        let mut results: Vec<(&str, f64, f64)> = Vec::new();
        for p in &proxies {
            if !wait_port(p.addr).await {
                eprintln!("{} did not come up on {}; skipped", p.name, p.addr);
                continue;
            }
            let tput = single_stream(p.addr, secs).await;
            let rate = conn_rate(p.addr, secs).await;
            eprintln!(
                "{:8} single-stream {tput:6.2} Gbit/s, {rate:8.0} conn/s",
                p.name
            );
            results.push((p.name, tput, rate));
        }
        print_table(&results, secs);
    });
    let _ = std::fs::remove_dir_all(&work);
}

fn print_table(results: &[(&str, f64, f64)], secs: f64) {
    println!();
    println!(
        "side-by-side, SNI passthrough, loopback, {secs} s per figure, {} cores shared by client, proxy, backend",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    print!("{:32}", "figure");
    for (name, ..) in results {
        print!("{name:>12}");
    }
    println!("{:>16}", "trellis/best");
    type Pick = fn(&(&str, f64, f64)) -> f64;
    let figures: [(&str, Pick); 2] = [
        ("single-stream throughput Gbit/s", |r| r.1),
        ("new connections per second", |r| r.2),
    ];
    for (label, pick) in figures {
        print!("{label:32}");
        for r in results {
            print!("{:>12.2}", pick(r));
        }
        let trellis = results.iter().find(|r| r.0 == "trellis").map(pick);
        let best_peer = results
            .iter()
            .filter(|r| r.0 != "trellis")
            .map(pick)
            .fold(f64::NAN, f64::max);
        match (trellis, best_peer.is_nan()) {
            (Some(t), false) => println!("{:>15.2}x", t / best_peer),
            _ => println!("{:>16}", "-"),
        }
    }
}
