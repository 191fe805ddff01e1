//! Side-by-side runner: trellis, HAProxy, nginx and Envoy doing the same jobs on loopback, in
//! one run, against the same TCP backend; prints each figure and the trellis ÷ best-peer ratio.
//!
//! `cargo bench --bench side_by_side` (installs HAProxy and nginx with apt-get and Envoy with
//! pip when missing; see `envoy.rs`). Environment: `BENCH_SECONDS` (per figure and round,
//! default 2), `BENCH_PEERS` (default `haproxy,nginx,envoy,floor,trellis-log`; `floor` is a
//! reference, not a peer: see `floor.rs`; `haproxy-b` adds a second HAProxy, the A/A row;
//! `trellis-log` is trellis writing its access log to a file, with the cost printed;
//! `trellis-base` is the binary `BENCH_TRELLIS_BASE` names, e.g. the previous commit's build,
//! on ports of its own, with the ratio to this build printed), `BENCH_ENVOY` (the
//! Envoy binary to run), `BENCH_IDLE` (idle connections for the memory figure, default
//! 5000), `BENCH_JOBS` (default
//! `sni,proxy-destination,http-connect,egress,egress-1000,tunnel,ha`; `ha` runs two gateway and
//! two agent replicas and kills each in turn, see `ha.rs`),
//! `BENCH_ROUNDS` (default 9), `BENCH_TRELLIS_WORKERS` (default 1, like the peers' single
//! thread), `BENCH_TRELLIS_BIN` (another trellis binary to measure, e.g. a previous build),
//! `BENCH_FIGURES` (default `throughput,rate,latency,syscalls,storm`: which figures to
//! measure; rows of figures not measured are left out), `BENCH_STORM` (clients of the reconnect storm,
//! default 20000), `BENCH_PIN=1` (each proxy on CPU 0, clients and backend on CPU 1, and
//! the A/A row), `BENCH_SYSCALLS_DETAIL=1` (also a per-syscall breakdown from `strace -c`),
//! `BENCH_TUNNEL_MB` (bytes per throughput run of the `tunnel` job, default 200),
//! `BENCH_TUNNEL_PEERS` (peers of its many-peer part, default 1000; 0 = none),
//! `BENCH_TUNNEL_PERF` (a directory: `perf record -g` of the gateway in its phases, there).
//!
//! The headline figures are what the proxy itself spends, from its own CPU time in
//! `/proc/PID/stat` (children included): CPU per new connection (and its user-space part),
//! per round trip on long-lived connections, per GB relayed, and system calls per new
//! connection (`perf stat -e raw_syscalls:sys_enter` in a separate pass, so counting costs
//! no other figure anything). On a 2-core machine shared by client, backend and proxy, the
//! wall-clock figures (throughput, connections per second, latency) are set largely by the
//! client and the backend; they are printed as information, as is the resident memory at
//! rest (after one connection, before the idle ones) and, for jobs that start with a
//! CONNECT, the time from sending it to the `200`, one client at a time (p50, p99).
//!
//! The reconnect storm: `BENCH_STORM` clients (in processes of 4,000, so no process runs
//! out of descriptors) connect at one instant, as after a gateway rollout, each until it
//! has made one round trip (a failed attempt is retried after 50 ms); the figures are the
//! time until the last has, and the proxy's CPU time meanwhile.
//!
//! Jobs: `sni` (TLS passthrough by SNI), `proxy-destination` (routed by a PROXY v2 header's
//! destination), `http-connect` (CONNECT relay by the `X-Gardener-Destination` header; of the
//! peers only Envoy does this), `egress` (kube-apiserver egress as to Gardener's
//! vpn-seed-server: TLS with a client certificate, `CONNECT 127.0.0.1:7001` with
//! `Host: 127.0.0.1`, then the backend; trellis's `egress-connect` listener and Envoy
//! configured as vpn-seed-server configures it; certificates shaped like Gardener's, see
//! `egress.rs`), `egress-1000` (trellis only: 1,000 egress routes, each chosen by its server
//! name and with its own CA and server certificate; the connections take the routes in turn;
//! compared with `egress`'s one route after the tables). trellis serves the egress jobs from
//! a process of their own and is skipped, with the reason, while it refuses the
//! configuration. Envoy runs with one worker, as HAProxy and nginx do, with a configuration
//! the bench writes for each job on a port chosen at run time. `tunnel` (root only; SKIP
//! otherwise) is trellis's WireGuard against a wireguard-go pair in two network namespaces,
//! with a report of its own after the tables: see `tunnel.rs`.
//! Backend protocol (port 7001, as the peer configs expect): after the ClientHello record the
//! client sends one command byte: `U` = upload (frames of a 4-byte big-endian length and that
//! many bytes; after an empty frame the backend answers the byte count as 8 bytes: a count
//! asked for in-band, since a proxy that relays CONNECT over HTTP, as Envoy does, closes the
//! whole connection at the client's half-close), `E` = echo everything.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    unreachable_pub,
    reason = "a test or bench fails loudly on what it did not expect; its helpers are its own"
)]

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

#[path = "side_by_side/egress.rs"]
mod egress;
#[path = "side_by_side/envoy.rs"]
mod envoy;
#[path = "side_by_side/floor.rs"]
mod floor;
#[path = "side_by_side/ha.rs"]
mod ha;
#[path = "side_by_side/lab.rs"]
mod lab;
#[path = "side_by_side/tunnel.rs"]
mod tunnel;

const BACKEND: &str = "127.0.0.1:7001";
const SNI: &str = "api.alpha.example.com";
const PP_DEST: &str = "10.0.1.10:443";
const CONNECT_DEST: &str = "outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local";
const TRELLIS_ADMIN: &str = "127.0.0.1:8449";
/// The admin address of the `trellis-log` row's gateway.
const TRELLIS_LOG_ADMIN: &str = "127.0.0.1:8649";
const TRELLIS_BASE_ADMIN: &str = "127.0.0.1:8749";
const FLOOR_SNI: &str = "127.0.0.1:8448";
const FLOOR_PP: &str = "127.0.0.1:8458";
const FLOOR_CONNECT: &str = "127.0.0.1:8468";
/// Connections per storm client process.
const STORM_PER_PROCESS: usize = 4000;
const CONN_WORKERS: usize = 8;
const STREAMS: usize = 8;
const LATENCY_CONNS: usize = 8;
const LATENCY_MSG: usize = 64;
/// Bytes per frame of an upload.
const UPLOAD_CHUNK: usize = 256 * 1024;

#[derive(Clone, Copy, PartialEq)]
enum Preamble {
    None,
    ProxyV2,
    Connect,
    /// TLS with a client certificate, then `CONNECT 127.0.0.1:7001` (the egress jobs).
    Egress,
}

impl Preamble {
    fn name(self) -> &'static str {
        match self {
            Preamble::None => "none",
            Preamble::ProxyV2 => "proxy",
            Preamble::Connect => "connect",
            Preamble::Egress => "egress",
        }
    }

    fn parse(s: &str) -> Self {
        match s {
            "proxy" => Preamble::ProxyV2,
            "connect" => Preamble::Connect,
            "egress" => Preamble::Egress,
            _ => Preamble::None,
        }
    }
}

/// `BENCH_PIN=1`: proxies on CPU 0, the bench (clients, backend) on CPU 1.
fn pinned() -> bool {
    std::env::var("BENCH_PIN").is_ok_and(|v| v == "1")
}

/// A command for a proxy: under `BENCH_PIN=1` run by `taskset -c 0` (which execs it, so
/// the process is the proxy).
fn proxy_command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    if pinned() {
        let mut c = Command::new("taskset");
        c.args(["-c", "0"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

#[derive(Clone)]
struct Target {
    proxy: &'static str,
    job: &'static str,
    addr: SocketAddr,
    preamble: Preamble,
    /// The TLS client of an egress target.
    egress: Option<Arc<egress::Client>>,
}

struct Proxy {
    name: &'static str,
    child: Option<Child>,
    pidfile: Option<PathBuf>,
    /// Where the proxy's own log goes, shown when it does not work.
    log: Option<PathBuf>,
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
    // The proxies' backlog (4096), so a storm finds no shorter queue here than at the proxy.
    let listener = trellis::net::socket::bind_std_with(
        BACKEND.parse().unwrap(),
        trellis::net::socket::LISTEN_BACKLOG,
        false,
        None,
    )
    .expect("backend port 7001 must be free");
    let listener = TcpListener::from_std(listener).unwrap();
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
                // Frames of a 4-byte length and that many bytes, until an empty one.
                let mut buf = vec![0u8; UPLOAD_CHUNK];
                let mut total = 0u64;
                loop {
                    let mut len = [0u8; 4];
                    if s.read_exact(&mut len).await.is_err() {
                        return;
                    }
                    let len = u32::from_be_bytes(len) as usize;
                    if len == 0 {
                        break;
                    }
                    if len > buf.len() || s.read_exact(&mut buf[..len]).await.is_err() {
                        return;
                    }
                    total += len as u64;
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

/// A client's connection through a proxy: TCP, or TLS to the proxy (the egress jobs).
enum Stream {
    /// Plain TCP.
    Tcp(TcpStream),
    /// TLS over TCP, terminated by the proxy.
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl Stream {
    /// Writes all of `data` and flushes it (a TLS stream may hold written bytes until then).
    async fn send(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.write_all(data).await?;
        self.flush().await
    }

    /// Closes the connection as kube-apiserver (Go) does: TLS with a `close_notify` first.
    async fn close(mut self) {
        if let Stream::Tls(_) = self {
            let _ = self.shutdown().await;
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Connects through `t`, sends its preamble, the ClientHello and `cmd`.
async fn open(t: &Target, cmd: u8) -> std::io::Result<Stream> {
    Ok(open_timed(t, cmd).await?.0)
}

/// [`open`], and for a CONNECT the time from sending it to its `200` (else zero).
async fn open_timed(t: &Target, cmd: u8) -> std::io::Result<(Stream, Duration)> {
    let mut tcp = TcpStream::connect(t.addr).await?;
    tcp.set_nodelay(true)?;
    let mut msg = Vec::with_capacity(1600);
    let mut waited = Duration::ZERO;
    let mut s = match t.preamble {
        Preamble::None => Stream::Tcp(tcp),
        Preamble::ProxyV2 => {
            msg.extend(trellis::wire::proxy::encode_v2(
                tcp.local_addr()?,
                PP_DEST.parse().unwrap(),
            ));
            Stream::Tcp(tcp)
        }
        Preamble::Connect => {
            let start = Instant::now();
            tcp.write_all(
                format!(
                    "CONNECT {SNI}:443 HTTP/1.1\r\nX-Gardener-Destination: {CONNECT_DEST}\r\n\r\n"
                )
                .as_bytes(),
            )
            .await?;
            connect_reply(&mut tcp).await?;
            waited = start.elapsed();
            Stream::Tcp(tcp)
        }
        Preamble::Egress => {
            let client = t
                .egress
                .as_ref()
                .ok_or_else(|| std::io::Error::other("an egress target without a client"))?;
            let (name, config) = client.next();
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await?;
            let mut s = Stream::Tls(Box::new(tls));
            // What kube-apiserver sends (EgressSelectorConfiguration, HTTPConnect).
            let start = Instant::now();
            s.send(format!("CONNECT {BACKEND} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
                .await?;
            connect_reply(&mut s).await?;
            waited = start.elapsed();
            s
        }
    };
    msg.extend(hello());
    msg.push(cmd);
    s.send(&msg).await?;
    Ok((s, waited))
}

/// Reads the answer to a CONNECT: a `200` response head, and not a byte more (the client
/// sends first after it, so anything else is the proxy's).
async fn connect_reply<S: AsyncRead + Unpin>(s: &mut S) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 512];
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        head.extend_from_slice(&buf[..n]);
        if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            if end + 4 != head.len() {
                return Err(std::io::Error::other(
                    "bytes after the CONNECT response head",
                ));
            }
            break;
        }
        if head.len() > 4096 {
            return Err(std::io::Error::other("CONNECT response head too long"));
        }
    }
    if head.starts_with(b"HTTP/1.1 200 ") || head.starts_with(b"HTTP/1.0 200 ") {
        Ok(())
    } else {
        Err(std::io::Error::other("CONNECT refused"))
    }
}

async fn works(t: &Target) -> bool {
    for _ in 0..100 {
        if let Ok(Ok(mut s)) = tokio::time::timeout(Duration::from_secs(1), open(t, b'E')).await
            && s.send(b"x").await.is_ok()
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

/// Gbit/s over `streams` parallel uploads, and the bytes relayed.
async fn throughput(t: &Target, streams: usize, secs: f64) -> (f64, u64) {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..streams {
        let t = t.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = open(&t, b'U').await.ok()?;
            let mut frame = (UPLOAD_CHUNK as u32).to_be_bytes().to_vec();
            frame.resize(4 + UPLOAD_CHUNK, 0x5a);
            let start = Instant::now();
            while start.elapsed().as_secs_f64() < secs {
                s.send(&frame).await.ok()?;
            }
            s.send(&[0; 4]).await.ok()?;
            let mut count = [0u8; 8];
            s.read_exact(&mut count).await.ok()?;
            Some(u64::from_be_bytes(count))
        }));
    }
    let mut bytes = 0;
    for t in tasks {
        bytes += t.await.ok().flatten().unwrap_or(0);
    }
    (
        bytes as f64 * 8.0 / start.elapsed().as_secs_f64() / 1e9,
        bytes,
    )
}

/// A running connection load: `CONN_WORKERS` clients each connecting, sending the preamble
/// and ClientHello, making one round trip and closing, over and over.
struct ConnLoad {
    done: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

impl ConnLoad {
    fn start(t: &Target) -> Self {
        let done = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::new();
        for _ in 0..CONN_WORKERS {
            let (done, stop, t) = (done.clone(), stop.clone(), t.clone());
            workers.push(tokio::spawn(async move {
                let mut back = [0u8; 1];
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut s) = open(&t, b'E').await else {
                        continue;
                    };
                    if s.send(b"x").await.is_ok() && s.read_exact(&mut back).await.is_ok() {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    s.close().await;
                }
            }));
        }
        ConnLoad {
            done,
            stop,
            workers,
        }
    }

    fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for w in self.workers {
            let _ = w.await;
        }
    }
}

/// New connections per second: connect, preamble + ClientHello, one round trip, close.
async fn conn_rate(t: &Target, secs: f64) -> f64 {
    let start = Instant::now();
    let load = ConnLoad::start(t);
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let done = load.done();
    let elapsed = start.elapsed().as_secs_f64();
    load.stop().await;
    done as f64 / elapsed
}

/// Request/response round-trip times on long-lived connections: (p50, p99, p99.9) in µs,
/// and how many round trips were made.
async fn latency(t: &Target, secs: f64) -> (f64, f64, f64, usize) {
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
                if s.send(&msg).await.is_err() || s.read_exact(&mut back).await.is_err() {
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
        return (f64::NAN, f64::NAN, f64::NAN, 0);
    }
    all.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| all[((all.len() as f64 * p) as usize).min(all.len() - 1)];
    (pct(0.50), pct(0.99), pct(0.999), all.len())
}

/// Bytes of proxy RSS per idle proxied connection, with `n` open; and the RSS before.
async fn idle_memory(t: &Target, pid: u32, n: usize) -> (f64, u64) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = tree_rss(pid);
    let mut conns = Vec::with_capacity(n);
    for chunk in 0..n.div_ceil(200) {
        let mut batch = Vec::new();
        for _ in 0..200.min(n - chunk * 200) {
            let t = t.clone();
            batch.push(tokio::spawn(async move {
                let mut s = open(&t, b'E').await.ok()?;
                s.send(b"x").await.ok()?;
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
    (
        after.saturating_sub(before) as f64 / opened.max(1) as f64,
        before,
    )
}

/// CONNECT → `200` times with one client at a time (connect, TLS handshake if any, CONNECT,
/// one round trip, close): (p50, p99) in µs.
async fn connect_times(t: &Target, secs: f64) -> (f64, f64) {
    let mut all = Vec::new();
    let start = Instant::now();
    let mut back = [0u8; 1];
    while start.elapsed().as_secs_f64() < secs {
        let Ok((mut s, waited)) = open_timed(t, b'E').await else {
            continue;
        };
        if s.send(b"x").await.is_ok() && s.read_exact(&mut back).await.is_ok() {
            all.push(waited.as_nanos() as f64 / 1000.0);
        }
        s.close().await;
    }
    if all.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    all.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| all[((all.len() as f64 * p) as usize).min(all.len() - 1)];
    (pct(0.50), pct(0.99))
}

/// System calls the proxy makes per new connection: `perf stat -e raw_syscalls:sys_enter`
/// on all its processes for `secs` while the connection load runs (NaN without `perf`).
/// With `BENCH_SYSCALLS_DETAIL=1` also `strace -c` for the same load, printed per call.
async fn syscalls_per_conn(t: &Target, pid: u32, secs: f64) -> f64 {
    let pids: Vec<String> = tree(pid).iter().map(u32::to_string).collect();
    let pids = pids.join(",");
    let out = std::env::temp_dir().join(format!("trellis-bench-perf-{}.txt", std::process::id()));
    let load = ConnLoad::start(t);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = load.done();
    let perf = Command::new("perf")
        .args([
            "stat",
            "-x",
            ",",
            "-e",
            "raw_syscalls:sys_enter",
            "-p",
            &pids,
            "-o",
        ])
        .arg(&out)
        .args(["--", "sleep", &secs.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let counted = match perf {
        Ok(mut perf) => {
            let _ = tokio::task::spawn_blocking(move || perf.wait()).await;
            std::fs::read_to_string(&out).ok().and_then(|text| {
                text.lines()
                    .find(|l| l.contains("raw_syscalls:sys_enter"))
                    .and_then(|l| l.split(',').next())
                    .and_then(|n| n.trim().parse::<f64>().ok())
            })
        }
        Err(_) => None,
    };
    let conns = load.done() - before;
    let _ = std::fs::remove_file(&out);
    if std::env::var("BENCH_SYSCALLS_DETAIL").is_ok_and(|v| v == "1") {
        let detail = out.with_extension("strace");
        if let Ok(mut strace) = Command::new("strace")
            .args(["-c", "-f", "-o"])
            .arg(&detail)
            .args(pids.split(',').flat_map(|p| ["-p", p]))
            .stderr(Stdio::null())
            .spawn()
        {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let before = load.done();
            tokio::time::sleep(Duration::from_secs_f64(secs)).await;
            let conns = load.done() - before;
            let _ = Command::new("kill")
                .args(["-INT", &strace.id().to_string()])
                .status();
            let _ = tokio::task::spawn_blocking(move || strace.wait()).await;
            let text = std::fs::read_to_string(&detail).unwrap_or_default();
            eprintln!(
                "  {} {}: strace -c over {conns} connections:",
                t.proxy, t.job
            );
            for line in text.lines().filter(|l| !l.starts_with('-')).take(16) {
                eprintln!("    {line}");
            }
            let _ = std::fs::remove_file(&detail);
        }
    }
    load.stop().await;
    match counted {
        Some(n) if conns > 0 => n / conns as f64,
        _ => f64::NAN,
    }
}

/// The reconnect storm against `t` (see the module documentation): the time until every
/// client has made its round trip (ms) and the proxy's CPU time meanwhile (ms).
async fn storm(t: &Target, pid: Option<u32>, clients: usize) -> (f64, f64) {
    let start_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        + 1500;
    let mut children = Vec::new();
    for k in 0..clients.div_ceil(STORM_PER_PROCESS) {
        let n = STORM_PER_PROCESS.min(clients - k * STORM_PER_PROCESS);
        let child = Command::new(std::env::current_exe().unwrap())
            .env(
                "BENCH_STORM_CLIENT",
                match &t.egress {
                    Some(c) => format!(
                        "{},{},{n},{start_ms},{},{}",
                        t.addr,
                        t.preamble.name(),
                        c.routes(),
                        c.dir().display()
                    ),
                    None => format!("{},{},{n},{start_ms}", t.addr, t.preamble.name()),
                },
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        children.push(child);
    }
    let before = pid.map(tree_cpu);
    let outputs = tokio::task::spawn_blocking(move || {
        children
            .into_iter()
            .map(|c| {
                c.wait_with_output()
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let cpu_ms = match (before, pid.map(tree_cpu)) {
        (Some(a), Some(b)) => (b.0 + b.1 - a.0 - a.1) * 1e3,
        _ => f64::NAN,
    };
    let (mut last_ms, mut retries, mut failed) = (0f64, 0u64, 0u64);
    for out in outputs {
        let f: Vec<f64> = out
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|v| v.parse().ok())
            .collect();
        if let [ms, r, x] = f[..] {
            last_ms = last_ms.max(ms);
            retries += r as u64;
            failed += x as u64;
        } else {
            failed += STORM_PER_PROCESS as u64;
        }
    }
    eprintln!(
        "  storm {:8} {:18} {clients} clients: all served after {last_ms:.0} ms, {retries} retried attempts, {failed} never served, proxy CPU {cpu_ms:.0} ms",
        t.proxy, t.job
    );
    if failed > 0 {
        (f64::NAN, cpu_ms)
    } else {
        (last_ms, cpu_ms)
    }
}

/// A storm client process (`BENCH_STORM_CLIENT=addr,preamble,n,start_unix_ms` and for an
/// egress target `,routes,pki_dir`): at the start instant opens `n` connections at once, each
/// retried until it has made one round trip; prints the ms from the start until the last
/// did, the retried attempts and the clients that gave up (after 60 s).
fn storm_client(spec: &str) -> ! {
    let f: Vec<&str> = spec.splitn(6, ',').collect();
    let t = Target {
        proxy: "storm",
        job: "storm",
        addr: f[0].parse().unwrap(),
        preamble: Preamble::parse(f[1]),
        egress: (f.len() == 6).then(|| {
            Arc::new(egress::Client::load(Path::new(f[5]), f[4].parse().unwrap()).unwrap())
        }),
    };
    let n: usize = f[2].parse().unwrap();
    let start_ms: u128 = f[3].parse().unwrap();
    let _ = trellis::net::socket::raise_nofile_limit();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (last, retries, failed) = rt.block_on(async move {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis();
        tokio::time::sleep(Duration::from_millis(start_ms.saturating_sub(now) as u64)).await;
        let start = Instant::now();
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let t = t.clone();
                tokio::spawn(async move {
                    let mut retries = 0u64;
                    while start.elapsed() < Duration::from_secs(60) {
                        let attempt = async {
                            let mut s = open(&t, b'E').await?;
                            s.send(b"x").await?;
                            let mut b = [0u8; 1];
                            s.read_exact(&mut b).await?;
                            s.close().await;
                            std::io::Result::Ok(())
                        };
                        if let Ok(Ok(())) =
                            tokio::time::timeout(Duration::from_secs(30), attempt).await
                        {
                            return (Some(start.elapsed()), retries);
                        }
                        retries += 1;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    (None, retries)
                })
            })
            .collect();
        let (mut last, mut retries, mut failed) = (Duration::ZERO, 0, 0);
        for task in tasks {
            match task.await.unwrap() {
                (Some(d), r) => {
                    last = last.max(d);
                    retries += r;
                }
                (None, r) => {
                    failed += 1;
                    retries += r;
                }
            }
        }
        (last, retries, failed)
    });
    println!("{} {retries} {failed}", last.as_secs_f64() * 1e3);
    std::process::exit(0)
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
#[expect(unsafe_code, reason = "pre_exec is unsafe by contract")]
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

/// Which trellis row a gateway is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TrellisRow {
    /// This build, at level `warn` (no access log).
    Plain,
    /// This build writing its access log.
    Log,
    /// `BENCH_TRELLIS_BASE`, at level `warn`.
    Base,
}

/// trellis for the plain jobs. `TrellisRow::Log` is the `trellis-log` row: the same gateway on
/// ports of its own, writing its access log (`--log-format json`, level info) to a file, as
/// a gateway in production does; `TrellisRow::Base` the `trellis-base` row, another build on ports
/// of its own; otherwise at level `warn`, which writes no access log.
fn start_trellis(dir: &Path, row: TrellisRow) -> (Proxy, Vec<Target>) {
    let logging = row == TrellisRow::Log;
    let (name, shift, admin) = match row {
        TrellisRow::Log => ("trellis-log", 200, TRELLIS_LOG_ADMIN),
        TrellisRow::Base => ("trellis-base", 300, TRELLIS_BASE_ADMIN),
        TrellisRow::Plain => ("trellis", 0, TRELLIS_ADMIN),
    };
    let dir = dir.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let port = |base: u16| SocketAddr::from(([127, 0, 0, 1], base + shift));
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
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: GatewayConfiguration\nroutes: {{file: routes.yaml}}\nlisteners:\n- {{name: tls, address: \"{}\", protocol: sni}}\n- {{name: pp, address: \"{}\", protocol: proxy-destination}}\n- {{name: connect, address: \"{}\", protocol: http-connect}}\nadmin: {{address: \"{admin}\", debugAddress: \"127.0.0.1:0\"}}\nlimits: {{maxConnections: {}, maxConnectionsPerSource: 0}}\nworkers: {}\ntimeouts: {{drainDelay: 0s}}\n",
            port(8440),
            port(8450),
            port(8460),
            // Room for the idle connections and the storm, within the open files the host
            // allows (the gateway caps it to that).
            idle_connections().max(storm_clients()) + 1000,
            std::env::var("BENCH_TRELLIS_WORKERS").unwrap_or_else(|_| "1".into())
        ),
    )
    .unwrap();
    let log = logging.then(|| dir.join("access.log"));
    let bin = match row {
        TrellisRow::Base => std::env::var("BENCH_TRELLIS_BASE")
            .expect("the trellis-base row runs the binary BENCH_TRELLIS_BASE names"),
        TrellisRow::Plain | TrellisRow::Log => trellis_bin(),
    };
    let child = spawn_trellis(&bin, &dir.join("gateway.yaml"), log.as_deref());
    let target = |job, base, preamble| Target {
        proxy: name,
        job,
        addr: port(base),
        preamble,
        egress: None,
    };
    let targets = vec![
        target("sni", 8440, Preamble::None),
        target("proxy-destination", 8450, Preamble::ProxyV2),
        target("http-connect", 8460, Preamble::Connect),
    ];
    (
        Proxy {
            name,
            child: Some(child),
            pidfile: None,
            log,
        },
        targets,
    )
}

/// The trellis binary measured: `BENCH_TRELLIS_BIN` (another build, e.g. the previous
/// commit's, in the same run) or this build's.
fn trellis_bin() -> String {
    std::env::var("BENCH_TRELLIS_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_trellis").to_string())
}

/// `trellis gateway --config config`, in a session of its own: at level `warn`, or with
/// its log (access lines included, in JSON) going to `log`.
fn spawn_trellis(bin: &str, config: &Path, log: Option<&Path>) -> Child {
    let mut cmd = proxy_command(bin);
    own_session(&mut cmd)
        .args(["gateway", "--config"])
        .arg(config);
    match log {
        Some(log) => cmd
            .args(["--log-format", "json"])
            .env("TRELLIS_LOG", "info")
            .stderr(std::fs::File::create(log).unwrap()),
        None => cmd.env("TRELLIS_LOG", "warn").stderr(Stdio::inherit()),
    };
    cmd.spawn().unwrap()
}

/// The floor (`floor.rs`): this bench binary again, in a session of its own.
fn start_floor() -> Option<(Proxy, Vec<Target>)> {
    let child = own_session(&mut proxy_command(std::env::current_exe().ok()?))
        .env("BENCH_FLOOR_SERVE", "1")
        .stderr(Stdio::inherit())
        .spawn()
        .ok()?;
    let target = |job, addr: &str, preamble| Target {
        proxy: "floor",
        job,
        addr: addr.parse().unwrap(),
        preamble,
        egress: None,
    };
    Some((
        Proxy {
            name: "floor",
            child: Some(child),
            pidfile: None,
            log: None,
        },
        vec![
            target("sni", FLOOR_SNI, Preamble::None),
            target("proxy-destination", FLOOR_PP, Preamble::ProxyV2),
            target("http-connect", FLOOR_CONNECT, Preamble::Connect),
        ],
    ))
}

/// Clients of the reconnect storm (`BENCH_STORM`, 0 = none).
fn storm_clients() -> usize {
    std::env::var("BENCH_STORM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20000)
}

/// HAProxy with the peer config; `second` runs another instance of it on ports + 100 (the
/// A/A row: what the runner's own spread is).
fn start_haproxy(peers: &Path, second: bool) -> Option<(Proxy, Vec<Target>)> {
    if !ensure_installed("haproxy", &["haproxy"]) {
        return None;
    }
    let (name, shift, suffix) = if second {
        ("haproxy-b", 100, "-b")
    } else {
        ("haproxy", 0, "")
    };
    let mut config = peers.join("haproxy.cfg");
    if second {
        let text = std::fs::read_to_string(&config).ok()?;
        config = std::env::temp_dir().join(format!("peer-haproxy-b-{}.cfg", std::process::id()));
        std::fs::write(
            &config,
            text.replace(":8441", ":8541").replace(":8451", ":8551"),
        )
        .ok()?;
    }
    let pidfile = PathBuf::from(format!("/tmp/peer-haproxy{suffix}.pid"));
    let ok = proxy_command("haproxy")
        .arg("-f")
        .arg(&config)
        .args(["-D", "-p"])
        .arg(&pidfile)
        .status()
        .is_ok_and(|s| s.success());
    let targets = vec![
        Target {
            proxy: name,
            job: "sni",
            addr: SocketAddr::from(([127, 0, 0, 1], 8441 + shift)),
            preamble: Preamble::None,
            egress: None,
        },
        Target {
            proxy: name,
            job: "proxy-destination",
            addr: SocketAddr::from(([127, 0, 0, 1], 8451 + shift)),
            preamble: Preamble::ProxyV2,
            egress: None,
        },
    ];
    ok.then(|| {
        (
            Proxy {
                name,
                child: None,
                pidfile: Some(pidfile),
                log: None,
            },
            targets,
        )
    })
}

fn start_nginx(peers: &Path) -> Option<(Proxy, Vec<Target>)> {
    if !ensure_installed("nginx", &["nginx", "libnginx-mod-stream"]) {
        return None;
    }
    let child = own_session(&mut proxy_command("nginx"))
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
            egress: None,
        },
        Target {
            proxy: "nginx",
            job: "proxy-destination",
            addr: "127.0.0.1:8452".parse().unwrap(),
            preamble: Preamble::ProxyV2,
            egress: None,
        },
    ];
    Some((
        Proxy {
            name: "nginx",
            child: Some(child),
            pidfile: None,
            log: None,
        },
        targets,
    ))
}

/// Routes of the `egress-1000` job.
const EGRESS_ROUTES: usize = 1000;
/// trellis's egress listener.
const TRELLIS_EGRESS: &str = "127.0.0.1:8470";

/// The egress jobs' certificates (`egress.rs`), made when a job first needs them.
struct EgressPki {
    /// Where the PKIs are written (the run's own directory).
    work: PathBuf,
    /// Where the RSA keys are kept between runs.
    cache: PathBuf,
    /// The clients of the PKIs made so far, by number of routes.
    made: std::sync::Mutex<Vec<(usize, Arc<egress::Client>)>>,
}

impl EgressPki {
    /// The directory of the PKI with `routes` routes.
    fn dir(&self, routes: usize) -> PathBuf {
        self.work.join(format!("egress-pki-{routes}"))
    }

    /// The client of the PKI with `routes` routes, made first if need be.
    fn client(&self, routes: usize) -> Option<Arc<egress::Client>> {
        let mut made = self.made.lock().unwrap();
        if let Some((_, c)) = made.iter().find(|(r, _)| *r == routes) {
            return Some(c.clone());
        }
        let dir = self.dir(routes);
        let start = Instant::now();
        match egress::generate(&dir, routes, &self.cache)
            .and_then(|()| egress::Client::load(&dir, routes))
        {
            Ok(c) => {
                eprintln!(
                    "egress certificates for {routes} route(s) made in {:.1} s",
                    start.elapsed().as_secs_f64()
                );
                let c = Arc::new(c);
                made.push((routes, c.clone()));
                Some(c)
            }
            Err(e) => {
                eprintln!("egress certificates for {routes} route(s): {e}; skipped");
                None
            }
        }
    }
}

/// Writes trellis's egress configuration for the PKI at `pki` with `routes` routes into
/// `dir`: the listener `protocol: egress-connect` with route 0's certificate, and the
/// routes (`egress::trellis_routes`). Returns the configuration file.
fn write_trellis_egress(dir: &Path, pki: &Path, routes: usize) -> PathBuf {
    let table = dir.join(format!("routes-egress-{routes}.yaml"));
    std::fs::write(&table, egress::trellis_routes(pki, routes)).unwrap();
    let r0 = egress::route_dir(pki, 0);
    let config = dir.join(format!("gateway-egress-{routes}.yaml"));
    std::fs::write(
        &config,
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: GatewayConfiguration\nroutes: {{file: \"{}\"}}\nlisteners:\n- name: egress\n  address: \"{TRELLIS_EGRESS}\"\n  protocol: egress-connect\n  tls: {{certificateFile: \"{}\", keyFile: \"{}\", clientCAFile: \"{}\"}}\nadmin: {{address: \"{TRELLIS_ADMIN}\"}}\nlimits: {{maxConnections: {}, maxConnectionsPerSource: 0}}\nworkers: {}\ntimeouts: {{drainDelay: 0s}}\n",
            table.display(),
            r0.join("tls.crt").display(),
            r0.join("tls.key").display(),
            r0.join("ca.crt").display(),
            idle_connections().max(storm_clients()) + 1000,
            std::env::var("BENCH_TRELLIS_WORKERS").unwrap_or_else(|_| "1".into())
        ),
    )
    .unwrap();
    config
}

/// Whether trellis accepts the configuration `config` (`trellis check`); if not, says why.
fn trellis_accepts(config: &Path, job: &str) -> bool {
    let out = Command::new(trellis_bin())
        .arg("check")
        .arg(config)
        .output();
    match out {
        Ok(o) if o.status.success() => true,
        Ok(o) => {
            let why = String::from_utf8_lossy(&o.stderr);
            eprintln!("trellis {job} skipped: the gateway refuses its configuration:");
            for line in why.lines().take(4) {
                eprintln!("  {line}");
            }
            false
        }
        Err(e) => {
            eprintln!("trellis {job} skipped: trellis check: {e}");
            false
        }
    }
}

/// trellis with only an egress listener: `egress` with one route chosen by the client
/// address, `egress-1000` with [`EGRESS_ROUTES`] routes each chosen by its server name, with
/// its own CA and certificate. Skipped, saying why, while the gateway refuses the
/// configuration; the 1,000 routes' certificates are made only once it accepts one route.
fn start_trellis_egress(dir: &Path, pki: &EgressPki, job: &str) -> Option<(Proxy, Vec<Target>)> {
    let (job, routes) = match job {
        "egress" => ("egress", 1),
        _ => ("egress-1000", EGRESS_ROUTES),
    };
    let one = pki.client(1)?;
    if !trellis_accepts(&write_trellis_egress(dir, &pki.dir(1), 1), job) {
        return None;
    }
    let client = if routes == 1 {
        one
    } else {
        pki.client(routes)?
    };
    let config = write_trellis_egress(dir, &pki.dir(routes), routes);
    if routes > 1 && !trellis_accepts(&config, job) {
        return None;
    }
    let child = spawn_trellis(&trellis_bin(), &config, None);
    Some((
        Proxy {
            name: "trellis",
            child: Some(child),
            pidfile: None,
            log: None,
        },
        vec![Target {
            proxy: "trellis",
            job,
            addr: TRELLIS_EGRESS.parse().unwrap(),
            preamble: Preamble::Egress,
            egress: Some(client),
        }],
    ))
}

/// Envoy (`envoy.rs`) for `job`, with a configuration written for it on a port free now.
fn start_envoy(
    binary: &Path,
    dir: &Path,
    job: &str,
    pki: &EgressPki,
) -> Option<(Proxy, Vec<Target>)> {
    let backend: SocketAddr = BACKEND.parse().unwrap();
    let mut client = None;
    let files = |name| egress::route_dir(&pki.dir(1), 0).join(name);
    let (certificate, key, client_ca) = (files("tls.crt"), files("tls.key"), files("ca.crt"));
    let (job, spec, preamble) = match job {
        "sni" => (
            "sni",
            envoy::Job::Sni {
                server_name: SNI,
                backend,
            },
            Preamble::None,
        ),
        "proxy-destination" => (
            "proxy-destination",
            envoy::Job::ProxyDestination {
                destination: PP_DEST.parse().unwrap(),
                backend,
            },
            Preamble::ProxyV2,
        ),
        "http-connect" => (
            "http-connect",
            envoy::Job::HttpConnect {
                destination: CONNECT_DEST,
                backend,
            },
            Preamble::Connect,
        ),
        "egress" => {
            client = Some(pki.client(1)?);
            (
                "egress",
                envoy::Job::Egress(envoy::TlsFiles {
                    certificate: &certificate,
                    key: &key,
                    client_ca: &client_ca,
                }),
                Preamble::Egress,
            )
        }
        _ => return None,
    };
    let addr = SocketAddr::from(([127, 0, 0, 1], envoy::free_port().ok()?));
    let config = dir.join(format!("envoy-{job}.yaml"));
    std::fs::write(&config, envoy::config(&spec, addr)).ok()?;
    let log = dir.join(format!("envoy-{job}.log"));
    let child = own_session(&mut proxy_command(binary))
        .arg("-c")
        .arg(&config)
        .args(["--concurrency", "1", "--disable-hot-restart", "-l", "warn"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).ok()?)
        .spawn()
        .ok()?;
    Some((
        Proxy {
            name: "envoy",
            child: Some(child),
            pidfile: None,
            log: Some(log),
        },
        vec![Target {
            proxy: "envoy",
            job,
            addr,
            preamble,
            egress: client,
        }],
    ))
}

/// One row of results.
struct Row {
    proxy: &'static str,
    job: &'static str,
    figures: [f64; NFIG],
}

const NFIG: usize = 17;
// Indices into a row's figures.
const CPU_CONN: usize = 0;
const USER_CONN: usize = 1;
const CPU_TRIP: usize = 2;
const CPU_GB: usize = 3;
const SYSCALLS: usize = 4;
const MEMORY: usize = 5;
const STORM_MS: usize = 6;
const STORM_CPU: usize = 7;
const TPUT1: usize = 8;
const TPUT8: usize = 9;
const RATE: usize = 10;
const P50: usize = 11;
const P99: usize = 12;
const P999: usize = 13;
const CONNECT_P50: usize = 14;
const CONNECT_P99: usize = 15;
const REST: usize = 16;

/// Label, whether higher is better, and whether it is a headline figure (what the proxy
/// spends) rather than information (what the shared machine allows).
const FIGURES: [(&str, bool, bool); NFIG] = [
    ("CPU per new connection (µs)", false, true),
    ("  of that in user space (µs)", false, true),
    ("CPU per round trip (µs)", false, true),
    ("CPU per GB, 8 streams (ms)", false, true),
    ("system calls per new connection", false, true),
    ("memory per idle connection (bytes)", false, true),
    ("storm: until all served (ms)", false, true),
    ("storm: proxy CPU (ms)", false, true),
    ("throughput, 1 stream (Gbit/s)", true, false),
    ("throughput, 8 streams (Gbit/s)", true, false),
    ("new connections per second", true, false),
    ("latency p50 (µs)", false, false),
    ("latency p99 (µs)", false, false),
    ("latency p99.9 (µs)", false, false),
    ("CONNECT to 200, p50 (µs)", false, false),
    ("CONNECT to 200, p99 (µs)", false, false),
    ("memory at rest (MiB)", false, false),
];

/// Rows that are not peers: left out of "best".
fn reference(proxy: &str) -> bool {
    matches!(
        proxy,
        "trellis" | "trellis-log" | "trellis-base" | "floor" | "haproxy-b"
    )
}

fn main() {
    if std::env::var("BENCH_FLOOR_SERVE").is_ok() {
        floor::serve(
            &[
                (FLOOR_SNI.parse().unwrap(), floor::Mode::Sni),
                (FLOOR_PP.parse().unwrap(), floor::Mode::ProxyV2),
                (FLOOR_CONNECT.parse().unwrap(), floor::Mode::Connect),
            ],
            BACKEND.parse().unwrap(),
        );
    }
    if let Ok(spec) = std::env::var("BENCH_STORM_CLIENT") {
        storm_client(&spec);
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
    if pinned() {
        // Before any other thread exists: every thread of the bench (clients, backend) and
        // the storm's client processes inherit CPU 1.
        let ok = Command::new("taskset")
            .args(["-p", "-c", "1", &std::process::id().to_string()])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "BENCH_PIN=1 needs taskset and two CPUs");
    }
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let secs: f64 = env("BENCH_SECONDS", "2").parse().unwrap_or(2.0);
    let rounds: usize = env("BENCH_ROUNDS", "9").parse().unwrap_or(9);
    let idle = idle_connections();
    let storm_n = storm_clients();
    let peers_wanted = env("BENCH_PEERS", "haproxy,nginx,envoy,floor,trellis-log");
    let jobs = env(
        "BENCH_JOBS",
        "sni,proxy-destination,http-connect,egress,egress-1000,tunnel,ha",
    );
    let figures = env("BENCH_FIGURES", "throughput,rate,latency,syscalls,storm");
    let want = |f: &str| figures.split(',').any(|g| g == f);
    let (want_tput, want_rate, want_lat) = (want("throughput"), want("rate"), want("latency"));
    let (want_sys, want_storm) = (want("syscalls"), want("storm") && storm_n > 0);
    let peers_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/side_by_side/peers");
    // What the bench installs or keeps between runs (Envoy's virtual environment).
    let target_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let work = std::env::temp_dir().join(format!("trellis-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let rows = rt.block_on(async {
        // Only the tunnel job, which brings its own servers and proxies: nothing to start.
        if jobs.split(',').all(|j| j == "tunnel" || j == "ha") {
            return Vec::new();
        }
        tokio::spawn(backend());
        // Each starter starts its proxy for one job (most serve every job they can).
        type Starter<'a> = Box<dyn Fn(&str) -> Option<(Proxy, Vec<Target>)> + 'a>;
        let pki = EgressPki {
            work: work.clone(),
            cache: target_dir.join("bench-keys"),
            made: Default::default(),
        };
        let pki = &pki;
        let mut starters: Vec<Starter> = vec![Box::new(|job| match job {
            "egress" | "egress-1000" => start_trellis_egress(&work, pki, job),
            _ => Some(start_trellis(&work, TrellisRow::Plain)),
        })];
        let peer_list: Vec<&str> = peers_wanted.split(',').collect();
        if peer_list.contains(&"trellis-log") {
            starters.push(Box::new(|job| match job {
                "egress" | "egress-1000" => None,
                _ => Some(start_trellis(&work, TrellisRow::Log)),
            }));
        }
        if peer_list.contains(&"trellis-base") {
            starters.push(Box::new(|job| match job {
                "egress" | "egress-1000" => None,
                _ => Some(start_trellis(&work, TrellisRow::Base)),
            }));
        }
        if peers_dir.exists() {
            if peer_list.contains(&"haproxy") {
                starters.push(Box::new(|_| start_haproxy(&peers_dir, false)));
            }
            if peer_list.contains(&"haproxy-b") || pinned() {
                starters.push(Box::new(|_| start_haproxy(&peers_dir, true)));
            }
            if peer_list.contains(&"nginx") {
                starters.push(Box::new(|_| start_nginx(&peers_dir)));
            }
        } else {
            eprintln!(
                "no peer configs at {}; no HAProxy or nginx",
                peers_dir.display()
            );
        }
        if peer_list.contains(&"envoy") {
            match envoy::binary(&target_dir.join("envoy-venv")) {
                Ok(bin) => {
                    let work: &Path = &work;
                    starters.push(Box::new(move |job| start_envoy(&bin, work, job, pki)));
                }
                Err(why) => eprintln!("Envoy skipped: {why}"),
            }
        }
        if peer_list.contains(&"floor") {
            starters.push(Box::new(|_| start_floor()));
        }
        let mut rows = Vec::new();
        for job in jobs.split(',').filter(|j| *j != "tunnel" && *j != "ha") {
            // Fresh processes per job; memory first, so no figure inherits a heap another
            // one grew. Then the other figures in interleaved rounds, reported as medians,
            // because a 2-core machine shared by client, proxies and backend is noisy.
            let mut running = Vec::new();
            for start in &starters {
                let Some((mut proxy, targets)) = start(job) else { continue };
                let Some(t) = targets.into_iter().find(|t| t.job == job) else { continue };
                if !works(&t).await {
                    eprintln!("{} {} does not work on {}; skipped", t.proxy, t.job, t.addr);
                    if let Some(log) = &proxy.log {
                        let text = std::fs::read_to_string(log).unwrap_or_default();
                        let lines: Vec<&str> = text.lines().collect();
                        for line in &lines[lines.len().saturating_sub(5)..] {
                            eprintln!("  {}: {line}", t.proxy);
                        }
                    }
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
            let mut samples: Vec<[Vec<f64>; NFIG]> =
                running.iter().map(|_| Default::default()).collect();
            for (i, (proxy, t)) in running.iter().enumerate() {
                if let Some(pid) = proxy.pid() {
                    let (per_conn, rest) = idle_memory(t, pid, idle).await;
                    samples[i][MEMORY].push(per_conn);
                    samples[i][REST].push(rest as f64 / (1 << 20) as f64);
                }
            }
            for round in 0..rounds {
                // Each round starts with another proxy, so none always goes first (an A/A run
                // showed the first place costing 5-10 % of p99).
                for k in 0..running.len() {
                    let i = (k + round) % running.len();
                    let (proxy, t) = &running[i];
                    let cpu = || proxy.pid().map(tree_cpu);
                    // The proxy's CPU time (all, user space) since `before`, in µs per event.
                    let per = |before: Option<(f64, f64)>, n: f64| match (before, cpu()) {
                        (Some(a), Some(b)) if n > 0.0 => (
                            (b.0 + b.1 - a.0 - a.1) * 1e6 / n,
                            (b.0 - a.0) * 1e6 / n,
                        ),
                        _ => (f64::NAN, f64::NAN),
                    };
                    let (mut one, mut eight, mut per_gb) = (f64::NAN, f64::NAN, f64::NAN);
                    if want_tput {
                        one = throughput(t, 1, secs).await.0;
                        let before = cpu();
                        let (gbps, bytes) = throughput(t, STREAMS, secs).await;
                        eight = gbps;
                        // µs per byte × 1e9 bytes / 1e3 = ms per GB.
                        per_gb = per(before, bytes as f64).0 * 1e6;
                    }
                    let before = cpu();
                    let rate = if want_rate { conn_rate(t, secs).await } else { f64::NAN };
                    // The proxy's own CPU per proxied connection (and its user-space part):
                    // what the rate costs it.
                    let (cpu_us, user_us) = per(before, rate * secs);
                    let before = cpu();
                    let (p50, p99, p999, trips) = if want_lat {
                        latency(t, secs).await
                    } else {
                        (f64::NAN, f64::NAN, f64::NAN, 0)
                    };
                    let (trip_us, _) = per(before, trips as f64);
                    let (c50, c99) = if want_lat
                        && matches!(t.preamble, Preamble::Connect | Preamble::Egress)
                    {
                        connect_times(t, secs).await
                    } else {
                        (f64::NAN, f64::NAN)
                    };
                    eprintln!(
                        "round {round} {:9} {:18} {rate:7.0} conn/s, {cpu_us:5.1} µs CPU each ({user_us:4.1} user); {:6.0} trips/s, {trip_us:4.1} µs CPU each, p50 {p50:6.1} p99 {p99:7.1} p99.9 {p999:7.1} µs; {one:5.2} / {eight:5.2} Gbit/s, {per_gb:5.1} ms CPU per GB",
                        t.proxy,
                        t.job,
                        trips as f64 / secs,
                    );
                    for (k, v) in [
                        (CPU_CONN, cpu_us),
                        (USER_CONN, user_us),
                        (CPU_TRIP, trip_us),
                        (CPU_GB, per_gb),
                        (TPUT1, one),
                        (TPUT8, eight),
                        (RATE, rate),
                        (P50, p50),
                        (P99, p99),
                        (P999, p999),
                        (CONNECT_P50, c50),
                        (CONNECT_P99, c99),
                    ] {
                        samples[i][k].push(v);
                    }
                }
            }
            // Separate passes: counting system calls slows the proxy (a little with perf, a
            // lot with strace), and the storm leaves a heap and queues behind.
            if want_sys {
                for (i, (proxy, t)) in running.iter().enumerate() {
                    if let Some(pid) = proxy.pid() {
                        let n = syscalls_per_conn(t, pid, secs).await;
                        eprintln!("  syscalls {:9} {:18} {n:.1} per connection", t.proxy, t.job);
                        samples[i][SYSCALLS].push(n);
                    }
                }
            }
            if want_storm {
                for (i, (proxy, t)) in running.iter().enumerate() {
                    let (ms, cpu_ms) = storm(t, proxy.pid(), storm_n).await;
                    samples[i][STORM_MS].push(ms);
                    samples[i][STORM_CPU].push(cpu_ms);
                    tokio::time::sleep(Duration::from_millis(500)).await;
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
    if !rows.is_empty() {
        print_table(&rows, secs, rounds, idle, storm_n);
    }
    if jobs.split(',').any(|j| j == "tunnel") {
        drop(rt);
        tunnel::run(&work, &target_dir.join("bench-keys"));
    }
    if jobs.split(',').any(|j| j == "ha") {
        ha::run(&work, &target_dir.join("bench-keys"));
    }
    let _ = std::fs::remove_dir_all(&work);
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn print_table(rows: &[Row], secs: f64, rounds: usize, idle: usize, storm: usize) {
    // The bench's own affinity (one CPU when pinned) would not say what the machine has.
    let cores = std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| c.lines().filter(|l| l.starts_with("processor")).count())
        .unwrap_or(0);
    println!(
        "\nside-by-side on loopback: medians of {rounds} interleaved rounds of {secs} s per figure; {idle} idle connections; storm of {storm} clients; {cores} CPUs {}",
        if pinned() {
            "(pinned: each proxy on CPU 0, clients and backend on CPU 1)"
        } else {
            "shared by client, proxies and backend"
        }
    );
    let mut jobs: Vec<&str> = Vec::new();
    for r in rows {
        if !jobs.contains(&r.job) {
            jobs.push(r.job);
        }
    }
    let trellis_sni = rows
        .iter()
        .find(|r| r.proxy == "trellis" && r.job == "sni")
        .map(|r| r.figures[CPU_CONN]);
    for job in jobs {
        let in_job: Vec<&Row> = rows.iter().filter(|r| r.job == job).collect();
        let find = |name: &str| in_job.iter().find(|r| r.proxy == name).map(|r| r.figures);
        let (trellis, floor, aa, haproxy) = (
            find("trellis"),
            find("floor"),
            find("haproxy-b"),
            find("haproxy"),
        );
        println!("\n{job}");
        print!("{:38}", "figure");
        for r in &in_job {
            print!("{:>11}", r.proxy);
        }
        print!("{:>14}", "trellis/best");
        if floor.is_some() {
            print!("{:>15}{:>14}", "trellis/floor", "floor/best");
        }
        if aa.is_some() {
            print!("{:>10}", "A/A");
        }
        println!();
        for headline in [true, false] {
            println!(
                "{}",
                if headline {
                    "-- what the proxy spends (headline)"
                } else {
                    "-- what the shared machine allows (information)"
                }
            );
            for (i, &(label, higher_is_better, _)) in
                FIGURES.iter().enumerate().filter(|(_, f)| f.2 == headline)
            {
                // A figure this job does not have (CONNECT times without a CONNECT), or that
                // was not measured.
                if in_job.iter().all(|r| r.figures[i].is_nan()) {
                    continue;
                }
                print!("{label:38}");
                for r in &in_job {
                    print!("{:>11.2}", r.figures[i]);
                }
                let peers = in_job
                    .iter()
                    .filter(|r| !reference(r.proxy))
                    .map(|r| r.figures[i])
                    .filter(|v| v.is_finite());
                let best = if higher_is_better {
                    peers.fold(f64::NAN, f64::max)
                } else {
                    peers.fold(f64::NAN, f64::min)
                };
                let ratio = |a: Option<f64>, b: f64, w: usize| match a {
                    Some(a) if a.is_finite() && b.is_finite() => {
                        format!("{:>w$.2}x", a / b, w = w - 1)
                    }
                    _ => format!("{:>w$}", "-"),
                };
                print!("{}", ratio(trellis.map(|f| f[i]), best, 14));
                if let Some(f) = floor {
                    print!("{}", ratio(trellis.map(|t| t[i]), f[i], 15));
                    print!("{}", ratio(Some(f[i]), best, 14));
                }
                if let (Some(b), Some(a)) = (aa, haproxy) {
                    print!("{}", ratio(Some(b[i]), a[i], 10));
                }
                println!();
            }
        }
        if job == "http-connect"
            && let (Some(t), Some(sni)) = (trellis, trellis_sni)
        {
            println!(
                "trellis CPU per new connection, http-connect / sni: {:.2}x",
                t[CPU_CONN] / sni
            );
        }
    }
    let trellis_in = |job: &str| {
        rows.iter()
            .find(|r| r.proxy == "trellis" && r.job == job)
            .map(|r| r.figures)
    };
    if let (Some(one), Some(many)) = (trellis_in("egress"), trellis_in("egress-1000")) {
        let added = many[REST] - one[REST];
        println!(
            "\ntrellis egress with {EGRESS_ROUTES} routes (each chosen by its server name, with its own CA and server certificate) against one route: CPU per new connection (TLS handshake, CONNECT, one round trip) {:.2}x ({:.1} against {:.1} µs); memory at rest {added:+.1} MiB ({:.1} KiB per route)",
            many[CPU_CONN] / one[CPU_CONN],
            many[CPU_CONN],
            one[CPU_CONN],
            added * 1024.0 / EGRESS_ROUTES as f64,
        );
    }
    println!(
        "\nratios: for throughput and connections per second higher is better; for everything else lower is better"
    );
    if rows.iter().any(|r| r.proxy == "floor") {
        println!(
            "floor: a reference, not a peer (left out of \"best\"): one bare epoll loop that waits for the first bytes, connects and copies; no parsing, timers, limits or splice"
        );
    }
    if rows.iter().any(|r| r.proxy == "haproxy-b") {
        println!(
            "A/A: a second HAProxy with the same config (haproxy-b / haproxy): the runner's own spread"
        );
    }
    for b in rows.iter().filter(|r| r.proxy == "trellis-base") {
        if let Some(t) = rows.iter().find(|r| r.proxy == "trellis" && r.job == b.job) {
            println!(
                "this build / trellis-base ({}), {}: CPU per new connection {:.2} / {:.2} µs = {:.3}",
                std::env::var("BENCH_TRELLIS_BASE").unwrap_or_default(),
                b.job,
                t.figures[CPU_CONN],
                b.figures[CPU_CONN],
                t.figures[CPU_CONN] / b.figures[CPU_CONN]
            );
        }
    }
    let logged: Vec<_> = rows.iter().filter(|r| r.proxy == "trellis-log").collect();
    if !logged.is_empty() {
        println!(
            "trellis-log: trellis writing its access log (JSON, level info) to a file; the other trellis row logs at warn"
        );
    }
    for l in logged {
        if let Some(t) = rows.iter().find(|r| r.proxy == "trellis" && r.job == l.job) {
            println!(
                "access log cost, {}: CPU per new connection {:.2} µs with it, {:.2} µs without: {:+.1} %",
                l.job,
                l.figures[CPU_CONN],
                t.figures[CPU_CONN],
                (l.figures[CPU_CONN] / t.figures[CPU_CONN] - 1.0) * 100.0
            );
        }
    }
}
