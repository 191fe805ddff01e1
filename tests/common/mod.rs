//! Shared harness for integration tests: runs the real `trellis` binary on loopback with
//! real peers (rustls clients and servers, plain TCP backends, openssl, curl).
#![expect(
    dead_code,
    reason = "each test crate uses a part of the shared helpers"
)]

pub(crate) mod dns;
pub(crate) mod egress;
pub(crate) mod netns;
pub(crate) mod skipped;
pub(crate) mod urgent;
pub(crate) mod wg;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream as StdTcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub(crate) use skipped::record_skip;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_trellis");

/// The TLS provider of the test peers, named: with the `controller` feature, kube brings
/// rustls's `ring` provider next to the default `aws-lc-rs` one, and rustls then has no
/// process default.
pub(crate) fn crypto() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A directory removed when dropped.
pub(crate) struct TestDir(pub PathBuf);

impl TestDir {
    pub(crate) fn new(name: &str) -> TestDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "trellis-test-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TestDir(dir)
    }
    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A port that was free a moment ago.
pub(crate) fn free_port() -> u16 {
    free_ports(1)[0]
}

/// `n` distinct free ports: the probes stay bound until all are picked, so the kernel cannot
/// hand out one port twice (which once gave a gateway's admin and a listener the same port).
pub(crate) fn free_ports(n: usize) -> Vec<u16> {
    let probes: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    probes
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

/// The JSON lines of a log.
pub(crate) fn json_lines(logs: &str) -> Vec<serde_json::Value> {
    logs.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The JSON lines of a log whose message is `message`.
pub(crate) fn lines_saying(logs: &str, message: &str) -> Vec<serde_json::Value> {
    json_lines(logs)
        .into_iter()
        .filter(|l| l["message"] == message)
        .collect()
}

/// Polls `f` until it returns `Some` or `limit` passes.
pub(crate) fn wait_for<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `GET path` on `addr`; returns (status, body).
pub(crate) fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = StdTcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split(' ').nth(1)?.parse().ok()?;
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((status, body))
}

/// One route for [`routes_yaml`].
pub(crate) struct R<'a> {
    pub name: &'a str,
    pub sni: &'a [&'a str],
    pub backends: &'a [SocketAddr],
}

/// Renders a routing table.
pub(crate) fn routes_yaml(routes: &[R]) -> String {
    let mut out =
        String::from("apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n");
    for r in routes {
        out += &format!(
            "- name: {}\n  sni: [{}]\n  backends:\n",
            r.name,
            r.sni
                .iter()
                .map(|s| format!("{s:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for b in r.backends {
            out += &format!("  - address: \"{b}\"\n");
        }
    }
    out
}

/// `extra` (top-level configuration YAML) with `timeouts.drainDelay: 0s` unless it sets a
/// drain delay: the default of 5 s would hold up every test that stops a gateway. Each
/// top-level key is written back as one line of JSON (which is YAML).
pub(crate) fn no_drain_delay(extra: &str) -> String {
    let parsed: Result<serde_json::Value, _> = serde_saphyr::from_str(extra);
    let mut map = match parsed {
        Ok(serde_json::Value::Object(map)) => map,
        Ok(serde_json::Value::Null) => serde_json::Map::new(),
        // Not a mapping: the test means to pass it as it is.
        _ => return extra.to_string(),
    };
    let timeouts = map
        .entry("timeouts")
        .or_insert_with(|| serde_json::json!({}));
    if let Some(t) = timeouts.as_object_mut() {
        t.entry("drainDelay").or_insert_with(|| "0s".into());
    }
    map.iter().map(|(k, v)| format!("{k}: {v}\n")).collect()
}

/// A running gateway process.
pub(crate) struct Gateway {
    pub child: Child,
    pub tls: SocketAddr,
    pub admin: SocketAddr,
    /// The debug endpoint (`/routes`), on the port the gateway got for `127.0.0.1:0`.
    pub debug: SocketAddr,
    pub dir: TestDir,
    /// Holds the log, outside `dir`: the gateway watches `dir`, and a log written there
    /// would raise a directory event with every line.
    pub log_dir: TestDir,
    pub listeners: Vec<(String, SocketAddr)>,
}

impl Gateway {
    /// Starts `trellis gateway` with one `sni` listener named `tls`; `extra` is appended to
    /// the configuration (timeouts, limits, ...), `listener_extra` to the listener.
    pub(crate) fn start(routes: &str, extra: &str) -> Gateway {
        Self::start_with(routes, extra, "")
    }

    pub(crate) fn start_with(routes: &str, extra: &str, listener_extra: &str) -> Gateway {
        Self::start_opts(routes, extra, listener_extra, "routes: {file: routes.yaml}")
    }

    /// Full control: `routes_source` is the `routes:` line of the configuration.
    pub(crate) fn start_opts(
        routes: &str,
        extra: &str,
        listener_extra: &str,
        routes_source: &str,
    ) -> Gateway {
        Self::start_full(
            routes,
            &[("tls", "sni", listener_extra)],
            extra,
            routes_source,
            None,
            &[],
        )
    }

    /// Starts with one `sni` listener named `tls` under an open-files limit (soft and hard)
    /// of `nofile`.
    pub(crate) fn start_with_nofile(routes: &str, extra: &str, nofile: u64) -> Gateway {
        Self::start_full(
            routes,
            &[("tls", "sni", "")],
            extra,
            "routes: {file: routes.yaml}",
            Some(nofile),
            &[],
        )
    }

    /// Like [`Gateway::start`], with `env` set for the process.
    pub(crate) fn start_env(routes: &str, extra: &str, env: &[(&str, &str)]) -> Gateway {
        Self::start_full(
            routes,
            &[("tls", "sni", "")],
            extra,
            "routes: {file: routes.yaml}",
            None,
            env,
        )
    }

    /// Starts with the given listeners: (name, protocol, extra listener fields as YAML lines
    /// indented by two spaces). `tls` is the first listener's address. A listener whose
    /// name starts with `v6` listens on `[::1]`, one whose name starts with `any` on
    /// `0.0.0.0` (reached from other network namespaces), every other one on `127.0.0.1`.
    pub(crate) fn start_listeners(
        routes: &str,
        listeners: &[(&str, &str, &str)],
        extra: &str,
    ) -> Gateway {
        Self::start_full(
            routes,
            listeners,
            extra,
            "routes: {file: routes.yaml}",
            None,
            &[],
        )
    }

    /// Like [`Gateway::start_listeners`], with `routes_source` as the configuration's
    /// `routes:` line (e.g. a shorter `checkInterval`).
    pub(crate) fn start_listeners_source(
        routes: &str,
        listeners: &[(&str, &str, &str)],
        extra: &str,
        routes_source: &str,
    ) -> Gateway {
        Self::start_full(routes, listeners, extra, routes_source, None, &[])
    }

    fn start_full(
        routes: &str,
        listeners: &[(&str, &str, &str)],
        extra: &str,
        routes_source: &str,
        nofile: Option<u64>,
        env: &[(&str, &str)],
    ) -> Gateway {
        // A port found free can be taken before the gateway binds it (by another test's
        // outgoing connection, whose ephemeral port is drawn from the same range): then
        // the gateway refuses to start, and it is started again on other ports.
        for _ in 0..4 {
            if let Some(gw) = Self::start_once(routes, listeners, extra, routes_source, nofile, env)
            {
                return gw;
            }
        }
        panic!("gateway could not bind free ports in four attempts");
    }

    fn start_once(
        routes: &str,
        listeners: &[(&str, &str, &str)],
        extra: &str,
        routes_source: &str,
        nofile: Option<u64>,
        env: &[(&str, &str)],
    ) -> Option<Gateway> {
        let dir = TestDir::new("gw");
        let mut ports = free_ports(1 + listeners.len()).into_iter();
        let mut next_addr = || SocketAddr::from(([127, 0, 0, 1], ports.next().unwrap()));
        let admin = next_addr();
        std::fs::write(dir.path("routes.yaml"), routes).unwrap();
        let mut addrs = Vec::new();
        let mut listeners_yaml = String::new();
        for (name, protocol, more) in listeners {
            let mut addr = next_addr();
            if name.starts_with("v6") {
                addr.set_ip(std::net::Ipv6Addr::LOCALHOST.into());
            } else if name.starts_with("any") {
                addr.set_ip(std::net::Ipv4Addr::UNSPECIFIED.into());
            }
            listeners_yaml +=
                &format!("- name: {name}\n  address: \"{addr}\"\n  protocol: {protocol}\n{more}\n");
            addrs.push((name.to_string(), addr));
        }
        let config = format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
{routes_source}
listeners:
{listeners_yaml}
admin: {{address: \"{admin}\", debugAddress: \"127.0.0.1:0\"}}
{}
",
            no_drain_delay(extra)
        );
        std::fs::write(dir.path("gateway.yaml"), config).unwrap();
        let log_dir = TestDir::new("gwlog");
        let child = spawn_gateway(&dir, &log_dir, nofile, env);
        let mut gw = Gateway {
            child,
            tls: addrs[0].1,
            admin,
            debug: SocketAddr::from(([127, 0, 0, 1], 0)),
            dir,
            log_dir,
            listeners: addrs,
        };
        if !gw.wait_ready() {
            let _ = gw.child.kill();
            let logs = gw.logs();
            if logs.contains("another process already listens there") {
                return None;
            }
            panic!("gateway did not become ready:\n{logs}");
        }
        gw.debug = gw
            .logged_address("debug endpoint listening")
            .unwrap_or_else(|| panic!("no debug endpoint in the log:\n{}", gw.logs()));
        Some(gw)
    }

    /// Waits up to 20 s for `/ready` to answer 200; false if it did not or the process exited.
    fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Some((200, _)) = http_get(self.admin, "/ready") {
                return true;
            }
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Kills the gateway (SIGKILL: no drain, nothing saved) and starts it again on the same
    /// configuration, table, files and ports; returns once it is ready. The log starts
    /// afresh (the earlier one is kept beside it as `gateway-killed.log`).
    pub(crate) fn kill_and_restart(&mut self) {
        self.kill_only();
        self.restart();
    }

    /// Kills the gateway (SIGKILL) and reaps it.
    pub(crate) fn kill_only(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts a killed gateway again on the same configuration, table, files and ports
    /// (see [`Gateway::kill_and_restart`]).
    pub(crate) fn restart(&mut self) {
        let log = self.log_dir.path("gateway.log");
        let _ = std::fs::rename(&log, self.log_dir.path("gateway-killed.log"));
        self.child = spawn_gateway(&self.dir, &self.log_dir, None, &[]);
        assert!(
            self.wait_ready(),
            "restarted gateway not ready:\n{}",
            self.logs()
        );
        self.debug = self
            .logged_address("debug endpoint listening")
            .unwrap_or_else(|| panic!("no debug endpoint in the log:\n{}", self.logs()));
    }

    /// The `address` of the first log line whose message is `message`.
    pub(crate) fn logged_address(&self, message: &str) -> Option<SocketAddr> {
        self.logs()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["message"] == message)
            .and_then(|v| v["address"].as_str()?.parse().ok())
    }

    /// The address of listener `name`.
    pub(crate) fn addr(&self, name: &str) -> SocketAddr {
        self.listeners
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| *a)
            .unwrap_or_else(|| panic!("no listener {name}"))
    }

    /// Access-log lines (JSON objects) written so far.
    pub(crate) fn access_logs(&self) -> Vec<serde_json::Value> {
        self.logs()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["target"] == "trellis::access")
            .collect()
    }

    /// Waits for an access-log line for which `pred` holds.
    pub(crate) fn wait_access_log(
        &self,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        wait_for(Duration::from_secs(10), || {
            self.access_logs().into_iter().find(|v| pred(v))
        })
        .unwrap_or_else(|| panic!("no matching access log line in:\n{}", self.logs()))
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn logs(&self) -> String {
        std::fs::read_to_string(self.log_dir.path("gateway.log")).unwrap_or_default()
    }

    /// Replaces the routing table atomically (write, rename), as the controller does.
    pub(crate) fn write_routes(&self, yaml: &str) {
        let tmp = self.dir.path(".routes.yaml.tmp");
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, self.dir.path("routes.yaml")).unwrap();
    }

    pub(crate) fn metrics(&self) -> String {
        http_get(self.admin, "/metrics")
            .map(|(_, b)| b)
            .unwrap_or_default()
    }

    /// The value of the sample whose name and labels start with `prefix` (0 if absent).
    pub(crate) fn metric(&self, prefix: &str) -> f64 {
        metric_in(&self.metrics(), prefix)
    }

    /// Waits until the metric satisfies `pred`; returns its value.
    pub(crate) fn wait_metric(&self, prefix: &str, pred: impl Fn(f64) -> bool) -> f64 {
        let v = wait_for(Duration::from_secs(10), || {
            let v = self.metric(prefix);
            pred(v).then_some(v)
        });
        v.unwrap_or_else(|| {
            panic!(
                "metric {prefix} = {} never satisfied the condition\n{}",
                self.metric(prefix),
                self.metrics()
            )
        })
    }

    pub(crate) fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Open file descriptors of the gateway process.
    pub(crate) fn fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }
}

/// Starts `trellis gateway` on `dir`'s `gateway.yaml`, logging (JSON) to `log_dir`'s
/// `gateway.log`, under an open-files limit of `nofile` (if any) and with `env` set.
fn spawn_gateway(
    dir: &TestDir,
    log_dir: &TestDir,
    nofile: Option<u64>,
    env: &[(&str, &str)],
) -> Child {
    let log = std::fs::File::create(log_dir.path("gateway.log")).unwrap();
    let mut command = match nofile {
        None => Command::new(BIN),
        Some(n) => {
            // `ulimit -n` sets the soft and the hard limit: the gateway cannot raise it.
            let mut c = Command::new("sh");
            c.args(["-c", &format!("ulimit -n {n} && exec \"$0\" \"$@\""), BIN]);
            c
        }
    };
    command
        .args(["--log-format", "json", "gateway", "--config"])
        .arg(dir.path("gateway.yaml"))
        .env("TRELLIS_LOG", "info,trellis=debug")
        // The zone is the file's unless a test sets it.
        .env_remove("TRELLIS_ZONE")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn metric_in(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A TLS server (rustls) with its own self-signed certificate; answers any request with an
/// HTTP response whose body is its name.
pub(crate) struct TlsBackend {
    pub addr: SocketAddr,
    pub name: String,
    pub cert_der: Vec<u8>,
    pub cert_pem: String,
    pub connections: Arc<AtomicUsize>,
}

impl TlsBackend {
    pub(crate) async fn start(name: &str, sans: &[&str]) -> TlsBackend {
        let ck = rcgen::generate_simple_self_signed(
            sans.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
        .unwrap();
        let cert_der = ck.cert.der().to_vec();
        let key =
            rustls::pki_types::PrivateKeyDer::try_from(ck.signing_key.serialize_der()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(crypto())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![ck.cert.der().clone()], key)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let body = name.to_string();
        let count = connections.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                count.fetch_add(1, Ordering::SeqCst);
                let acceptor = acceptor.clone();
                let body = body.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut req = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => req.extend_from_slice(&buf[..n]),
                        }
                    }
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = tls.write_all(resp.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        TlsBackend {
            addr,
            name: name.to_string(),
            cert_der,
            cert_pem: ck.cert.pem(),
            connections,
        }
    }

    pub(crate) fn write_pem(&self, dir: &TestDir) -> PathBuf {
        let p = dir.path(&format!("{}.pem", self.name));
        std::fs::write(&p, &self.cert_pem).unwrap();
        p
    }
}

/// What a rustls client saw.
pub(crate) struct TlsResult {
    pub body: String,
    pub peer_cert: Vec<u8>,
    pub group: Option<rustls::NamedGroup>,
}

/// Connects through `addr` with SNI `sni`, trusting only `trust`'s certificate, and sends a
/// GET. `mss` forces small TCP segments so the ClientHello spans several of them.
pub(crate) async fn tls_get(
    addr: SocketAddr,
    sni: &str,
    trust: &TlsBackend,
    mss: Option<u32>,
) -> std::io::Result<TlsResult> {
    let connector = trusting(trust);
    let tcp = connect_with_mss(addr, mss).await?;
    let name = rustls::pki_types::ServerName::try_from(sni.to_string()).unwrap();
    let mut tls =
        tokio::time::timeout(Duration::from_secs(10), connector.connect(name, tcp)).await??;
    tls.write_all(format!("GET / HTTP/1.1\r\nHost: {sni}\r\n\r\n").as_bytes())
        .await?;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out)).await?;
    let (_, conn) = tls.get_ref();
    let peer_cert = conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap_or_default();
    let group = conn.negotiated_key_exchange_group().map(|g| g.name());
    let text = String::from_utf8_lossy(&out).to_string();
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok(TlsResult {
        body,
        peer_cert,
        group,
    })
}

/// A rustls connector that trusts only `backend`'s certificate.
pub(crate) fn trusting(backend: &TlsBackend) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from(
            backend.cert_der.clone(),
        ))
        .unwrap();
    let config = rustls::ClientConfig::builder_with_provider(crypto())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

pub(crate) async fn connect_with_mss(
    addr: SocketAddr,
    mss: Option<u32>,
) -> std::io::Result<TcpStream> {
    let sock = tokio::net::TcpSocket::new_v4()?;
    if let Some(mss) = mss {
        socket2::SockRef::from(&sock).set_tcp_mss(mss)?;
    }
    sock.set_nodelay(true)?;
    sock.connect(addr).await
}

/// A real ClientHello, as rustls (with its default post-quantum key share) writes it.
pub(crate) fn rustls_client_hello(sni: &str) -> Vec<u8> {
    let config = rustls::ClientConfig::builder_with_provider(crypto())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(sni.to_string()).unwrap();
    let mut conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let mut out = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut out).unwrap();
    }
    out
}

/// A plain TCP backend: reads each connection to EOF (or `limit` bytes), reports what it
/// read, answers `reply` and closes.
pub(crate) struct RawBackend {
    pub addr: SocketAddr,
    pub received: mpsc::UnboundedReceiver<Vec<u8>>,
}

impl RawBackend {
    pub(crate) async fn start(reply: &'static [u8], limit: usize) -> RawBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, received) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    continue;
                };
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut got = Vec::new();
                    let mut buf = [0u8; 8192];
                    while got.len() < limit {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                    }
                    let _ = tx.send(got);
                    let _ = s.write_all(reply).await;
                    let _ = s.shutdown().await;
                });
            }
        });
        RawBackend { addr, received }
    }

    pub(crate) async fn next(&mut self) -> Vec<u8> {
        tokio::time::timeout(Duration::from_secs(10), self.received.recv())
            .await
            .expect("backend got no connection")
            .unwrap()
    }
}

/// An echo backend: writes back everything, half-closes after the client does.
pub(crate) async fn echo_backend() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    addr
}

/// An echo backend on `ip` (port chosen by the kernel) that counts the connections it
/// accepted and sends `greeting` first (if any); half-closes after the client does.
pub(crate) async fn counting_echo_at(
    ip: &str,
    greeting: &'static [u8],
) -> (SocketAddr, Arc<AtomicUsize>) {
    counting_echo_on(
        TcpListener::bind(format!("{ip}:0")).await.unwrap(),
        greeting,
    )
}

/// [`counting_echo_at`] on a listener of the caller's (one bound in another network
/// namespace, for example).
pub(crate) fn counting_echo_on(
    listener: TcpListener,
    greeting: &'static [u8],
) -> (SocketAddr, Arc<AtomicUsize>) {
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                if !greeting.is_empty() {
                    let _ = s.write_all(greeting).await;
                }
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    (addr, accepted)
}

/// Reads until EOF with a time limit.
pub(crate) async fn read_all(s: &mut TcpStream, limit: Duration) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    tokio::time::timeout(limit, s.read_to_end(&mut out)).await??;
    Ok(out)
}

/// Runs a command with a time limit; returns (status success, stdout + stderr).
pub(crate) fn run(cmd: &mut Command, stdin: &[u8], limit: Duration) -> (bool, String) {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin).unwrap();
    drop(input);
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut out = String::new();
            child
                .stdout
                .take()
                .unwrap()
                .read_to_string(&mut out)
                .unwrap();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut out)
                .unwrap();
            return (status.success(), out);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("command {cmd:?} did not finish in {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(crate) fn exists(path: &Path) -> bool {
    path.exists()
}

/// Raises this process' open-files limit to `want` (gateways started from here inherit it)
/// as far as allowed; returns the soft limit now.
pub(crate) fn raise_nofile(want: u64) -> u64 {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let now = getrlimit(Resource::Nofile);
    let raised = Rlimit {
        current: Some(want),
        maximum: Some(want.max(now.maximum.unwrap_or(want))),
    };
    // Raising the hard limit needs root; without it, up to the hard limit.
    if setrlimit(Resource::Nofile, raised).is_err() {
        let soft = Rlimit {
            current: now.maximum,
            maximum: now.maximum,
        };
        let _ = setrlimit(Resource::Nofile, soft);
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// Says why `test` does not run here: on stderr (shown with `--nocapture` or when it fails)
/// and, when `TRELLIS_SKIPPED` names a file (`scripts/test` sets it), as a line appended to
/// it, so the test command's summary lists every skip however the output was captured.
pub(crate) fn skip(test: &str, reason: &str) {
    eprintln!("SKIP {test}: {reason}");
    record_skip(test, reason);
}

/// Resident memory of `pid` in KiB.
pub(crate) fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}
