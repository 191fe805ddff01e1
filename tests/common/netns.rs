//! Network namespaces for tests that need root: created per test, removed on drop, with the
//! processes started in them; veth links between them, and the traffic tools the tunnel tests
//! drive inside them (ping, socat echo and sink servers, byte-exact transfers). It never
//! touches the host's own namespace beyond creating and deleting its namespaces.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process_group};

use super::{TestDir, wait_for};

/// Numbers the labs and links of this process: tests run in parallel threads, and two labs
/// with the same namespace names would delete each other's namespaces.
static SERIAL: AtomicUsize = AtomicUsize::new(0);

/// A number no other lab or link of this process has.
pub(crate) fn serial() -> usize {
    SERIAL.fetch_add(1, Ordering::SeqCst)
}

/// Namespaces, processes and files of one test; all removed on drop.
pub(crate) struct Lab {
    pub namespaces: Vec<String>,
    pub children: Vec<Child>,
    pub dir: TestDir,
}

impl Drop for Lab {
    fn drop(&mut self) {
        for c in &mut self.children {
            // A server started by `spawn_server` leads its own process group: socat's forked
            // connection handlers outlive their parent otherwise.
            let _ = kill_process_group(Pid::from_child(c), Signal::KILL);
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
            let _ = std::fs::remove_dir_all(format!("/etc/netns/{ns}"));
        }
    }
}

/// Runs `f` on a new thread moved into namespace `ns` and returns what it returns (its panic
/// is the caller's). What `f` opens there stays there: a socket it creates keeps `ns`'s
/// network wherever it is used later, and the threads and processes it starts (a tokio
/// runtime's workers, `Command`s) begin in `ns`.
pub(crate) fn in_ns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    use rustix::thread::{LinkNameSpaceType, move_into_link_name_space};
    use std::os::fd::AsFd;
    let file = std::fs::File::open(format!("/var/run/netns/{ns}"))
        .unwrap_or_else(|e| panic!("namespace {ns}: {e}"));
    std::thread::scope(|scope| {
        let thread = scope.spawn(move || {
            move_into_link_name_space(file.as_fd(), Some(LinkNameSpaceType::Network))
                .unwrap_or_else(|e| panic!("setns {ns}: {e}"));
            f()
        });
        thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// A TCP listener on `addr` inside namespace `ns`, non-blocking (for tokio's `from_std`).
pub(crate) fn listen_in(ns: &str, addr: SocketAddr) -> std::net::TcpListener {
    let listener = in_ns(ns, || std::net::TcpListener::bind(addr))
        .unwrap_or_else(|e| panic!("listen on {addr} in {ns}: {e}"));
    listener.set_nonblocking(true).unwrap();
    listener
}

/// `ip addr add <cidr> dev <dev>`, with `nodad` for IPv6 (no wait for duplicate address
/// detection before the address can be used).
pub(crate) fn add_address<'a>(cidr: &'a str, dev: &'a str) -> Vec<&'a str> {
    let mut args = vec!["ip", "addr", "add", cidr, "dev", dev];
    if cidr.contains(':') {
        args.push("nodad");
    }
    args
}

/// Why namespace tests cannot run here, if they cannot.
pub(crate) fn skip_reason(tools: &[&str]) -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root".into());
    }
    for tool in tools.iter().chain(&["ip"]) {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status();
        if !found.is_ok_and(|s| s.success()) {
            return Some(format!(
                "{tool} is not installed (scripts/test installs it)"
            ));
        }
    }
    None
}

fn ok(c: &mut Command) -> bool {
    c.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Lab {
    /// Creates namespaces named `trellis-<name>-<pid>-<serial>` with `lo` up.
    pub(crate) fn new(names: &[&str]) -> Lab {
        let (id, k) = (std::process::id() % 100_000, serial());
        let lab = Lab {
            namespaces: names
                .iter()
                .map(|n| format!("trellis-{n}-{id}-{k}"))
                .collect(),
            children: Vec::new(),
            dir: TestDir::new("netns"),
        };
        for ns in &lab.namespaces {
            // One left by an earlier process with this pid, if any.
            let _ = ok(Command::new("ip").args(["netns", "del", ns]));
            assert!(
                ok(Command::new("ip").args(["netns", "add", ns])),
                "ip netns add {ns}"
            );
            assert!(lab.sh(ns, &["ip", "link", "set", "lo", "up"]));
        }
        lab
    }

    /// The full name of namespace `i`.
    pub(crate) fn ns(&self, i: usize) -> String {
        self.namespaces[i].clone()
    }

    /// Joins namespaces `a` and `b` with a veth pair; `addr_a`/`addr_b` are CIDRs.
    pub(crate) fn veth(&self, a: usize, addr_a: &str, b: usize, addr_b: &str) {
        self.veth_addrs(a, &[addr_a], b, &[addr_b]);
    }

    /// Joins namespaces `a` and `b` with a veth pair carrying the CIDRs `addrs_a`/`addrs_b`
    /// (IPv4 and IPv6; IPv6 without duplicate address detection, so usable at once).
    pub(crate) fn veth_addrs(&self, a: usize, addrs_a: &[&str], b: usize, addrs_b: &[&str]) {
        let (id, k) = (std::process::id() % 100_000, serial());
        let (va, vb) = (format!("tv{id}-{k}a"), format!("tv{id}-{k}b"));
        assert!(ok(Command::new("ip").args([
            "link",
            "add",
            &va,
            "netns",
            &self.namespaces[a],
            "type",
            "veth",
            "peer",
            "name",
            &vb,
            "netns",
            &self.namespaces[b]
        ])));
        for (ns, dev, addrs) in [
            (&self.namespaces[a], &va, addrs_a),
            (&self.namespaces[b], &vb, addrs_b),
        ] {
            for addr in addrs {
                assert!(self.sh(ns, &add_address(addr, dev)), "{addr} on {dev}");
            }
            assert!(self.sh(ns, &["ip", "link", "set", dev, "up"]));
        }
    }

    /// Makes `name` resolve to `ip` inside namespace `ns` (`ip netns exec` bind-mounts it).
    pub(crate) fn hosts(&self, ns: &str, entries: &str) {
        std::fs::create_dir_all(format!("/etc/netns/{ns}")).unwrap();
        std::fs::write(format!("/etc/netns/{ns}/hosts"), entries).unwrap();
    }

    pub(crate) fn exec(&self, ns: &str, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).args(args);
        c
    }

    /// Runs a command in `ns`; true if it succeeded.
    pub(crate) fn sh(&self, ns: &str, args: &[&str]) -> bool {
        ok(&mut self.exec(ns, args))
    }

    /// Runs a command in `ns` and returns its stdout.
    pub(crate) fn output(&self, ns: &str, args: &[&str]) -> String {
        let out = self.exec(ns, args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Starts a long-running process in `ns`, logging to `log`; returns its index.
    pub(crate) fn spawn(&mut self, ns: &str, args: &[&str], log: &Path) -> usize {
        let log = std::fs::File::create(log).unwrap();
        let child = self
            .exec(ns, args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.children.push(child);
        self.children.len() - 1
    }

    /// Starts `trellis <role> --config <config>` (JSON logs) in `ns`, logging to `log`.
    pub(crate) fn spawn_trellis(
        &mut self,
        ns: &str,
        role: &str,
        config: &Path,
        log: &Path,
    ) -> usize {
        let config = config.to_str().unwrap();
        let args = [super::BIN, "--log-format", "json", role, "--config", config];
        self.spawn(ns, &args, log)
    }

    /// GET `http://addr/path` from inside `ns`.
    pub(crate) fn http_get(&self, ns: &str, addr: &str, path: &str) -> (u16, String) {
        let out = self.output(
            ns,
            &[
                "curl",
                "-s",
                "-w",
                "\n%{http_code}",
                &format!("http://{addr}{path}"),
            ],
        );
        let (body, code) = out.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }

    /// Starts a server in `ns` as the leader of its own process group, so that drop kills
    /// the processes it forks too; returns its index in `children`.
    pub(crate) fn spawn_server(&mut self, ns: &str, args: &[&str], log: &Path) -> usize {
        use std::os::unix::process::CommandExt;
        let log = std::fs::File::create(log).unwrap();
        let child = self
            .exec(ns, args)
            .process_group(0)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.children.push(child);
        self.children.len() - 1
    }

    /// Waits up to `limit` for child `idx` to exit.
    pub(crate) fn wait_exit(&mut self, idx: usize, limit: Duration) -> Option<ExitStatus> {
        let child = &mut self.children[idx];
        wait_for(limit, || child.try_wait().ok().flatten())
    }

    /// True once one ping from `ns` to `ip` (IPv4 or IPv6) is answered within 5 s.
    pub(crate) fn ping(&self, ns: &str, ip: &str) -> bool {
        let args = ["ping", "-n", "-c", "1", "-W", "1", ip];
        wait_for(Duration::from_secs(5), || self.sh(ns, &args).then_some(())).is_some()
    }

    /// Waits until something in `ns` listens on TCP `port`.
    fn wait_listening(&self, ns: &str, port: u16) {
        let sport = format!(":{port}");
        let up = wait_for(Duration::from_secs(5), || {
            let out = self.output(ns, &["ss", "-Htln", "sport", "=", &sport]);
            (!out.trim().is_empty()).then_some(())
        });
        assert!(up.is_some(), "nothing listens on {sport} in {ns}");
    }

    /// Starts a TCP echo server (socat, one process per connection) on `listen` in `ns`;
    /// returns once it listens.
    pub(crate) fn echo_server(&mut self, ns: &str, listen: SocketAddr) -> usize {
        let spec = format!("{},fork,reuseaddr", socat_listen(listen));
        let log = self.dir.path(&format!("echo-{}.log", listen.port()));
        let idx = self.spawn_server(ns, &["socat", &spec, "PIPE"], &log);
        self.wait_listening(ns, listen.port());
        idx
    }

    /// Starts a TCP sink on `listen` in `ns` that writes the bytes of one connection to `out`
    /// and exits at its end; returns once it listens.
    pub(crate) fn sink(&mut self, ns: &str, listen: SocketAddr, out: &Path) -> usize {
        let file = format!("OPEN:{},creat,trunc", out.display());
        let log = self.dir.path(&format!("sink-{}.log", listen.port()));
        let spec = format!("{},reuseaddr", socat_listen(listen));
        let idx = self.spawn_server(ns, &["socat", "-u", &spec, &file], &log);
        self.wait_listening(ns, listen.port());
        idx
    }

    /// Connects from `ns` to `to`, sends `data`, half-closes, and returns what came back
    /// before the peer closed (socat; waits up to 5 s for the peer after sending, 30 s in
    /// all).
    pub(crate) fn tcp_exchange(&self, ns: &str, to: SocketAddr, data: &[u8]) -> Vec<u8> {
        let connect = socat_connect(to);
        let mut child = self
            .exec(ns, &["timeout", "30", "socat", "-t", "5", "-", &connect])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        let data = data.to_vec();
        // Written beside the reading: an echo answers while the rest is still being sent.
        let writer = std::thread::spawn(move || input.write_all(&data));
        let out = child.wait_with_output().unwrap();
        let _ = writer.join();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "socat to {to} from {ns}: {err}");
        out.stdout
    }

    /// Sends `bytes` random bytes over one TCP connection from `client_ns` to `connect`,
    /// received by a sink listening on `listen` in `server_ns` (the same address, or where a
    /// forwarder between them delivers); asserts that the sink got exactly those bytes
    /// (SHA-256 at both ends) within `limit`, and returns how long it took.
    pub(crate) fn transfer(
        &mut self,
        (client_ns, connect): (&str, SocketAddr),
        (server_ns, listen): (&str, SocketAddr),
        bytes: usize,
        limit: Duration,
    ) -> Duration {
        let k = serial();
        let (src, dst) = (
            self.dir.path(&format!("tx-{k}")),
            self.dir.path(&format!("rx-{k}")),
        );
        write_random(&src, bytes);
        let sink = self.sink(server_ns, listen, &dst);
        let start = Instant::now();
        let from = format!("OPEN:{}", src.display());
        let (ok, out) = super::run(
            &mut self.exec(client_ns, &["socat", "-u", &from, &socat_connect(connect)]),
            b"",
            limit,
        );
        assert!(ok, "socat {client_ns} -> {connect}: {out}");
        let done = self.wait_exit(sink, limit.saturating_sub(start.elapsed()));
        assert!(
            done.is_some(),
            "the sink on {listen} did not see the end in {limit:?}"
        );
        let took = start.elapsed();
        let got = std::fs::read(&dst).unwrap_or_default();
        assert_eq!(got.len(), bytes, "bytes received on {listen}");
        assert_eq!(
            sha256(&got),
            sha256(&std::fs::read(&src).unwrap()),
            "payload changed"
        );
        let _ = (std::fs::remove_file(&src), std::fs::remove_file(&dst));
        took
    }
}

/// socat's listening address for `addr` (`TCP4-LISTEN`/`TCP6-LISTEN` bound to its IP).
fn socat_listen(addr: SocketAddr) -> String {
    match addr {
        SocketAddr::V4(a) => format!("TCP4-LISTEN:{},bind={}", a.port(), a.ip()),
        SocketAddr::V6(a) => format!("TCP6-LISTEN:{},bind=[{}]", a.port(), a.ip()),
    }
}

/// socat's connecting address for `addr`.
fn socat_connect(addr: SocketAddr) -> String {
    match addr {
        SocketAddr::V4(a) => format!("TCP4:{a}"),
        SocketAddr::V6(a) => format!("TCP6:{a}"),
    }
}

/// Writes `bytes` pseudo-random bytes (xorshift, no two files alike) to `path`.
pub(crate) fn write_random(path: &Path, bytes: usize) {
    let mut x =
        0x9e37_79b9_7f4a_7c15u64 ^ ((serial() as u64 + 1) << 32) ^ u64::from(std::process::id());
    let mut data = Vec::with_capacity(bytes + 8);
    while data.len() < bytes {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.extend_from_slice(&x.to_le_bytes());
    }
    data.truncate(bytes);
    std::fs::write(path, data).unwrap();
}

/// The SHA-256 of `data`.
pub(crate) fn sha256(data: &[u8]) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, data)
        .as_ref()
        .to_vec()
}

/// The command line of `trellis agent --config CONFIG` (JSON logs) as nobody with no
/// capabilities at all, as the agent runs in a shoot.
pub(crate) fn agent_as_nobody(config: &Path) -> Vec<String> {
    let nobody = "setpriv --reuid 65534 --regid 65534 --clear-groups --bounding-set=-all \
                  --inh-caps=-all";
    let mut args: Vec<String> = nobody.split_whitespace().map(String::from).collect();
    for a in [super::BIN, "--log-format", "json", "agent", "--config"] {
        args.push(a.to_string());
    }
    args.push(config.to_string_lossy().into_owned());
    args
}
