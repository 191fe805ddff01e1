//! The tunnel job's network lab: namespaces joined by a veth pair, wireguard-go devices in
//! them (configured with `wg set` and `ip`), processes started inside them, WireGuard keys,
//! and tokio runtimes whose threads live in a namespace (so every socket they open is
//! there). A trimmed copy of the tests' lab (`tests/common/netns.rs`, `tests/common/wg.rs`),
//! which a bench cannot import. It never touches the host's own namespace beyond creating
//! and deleting its namespaces, and removes what it made on drop.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use rustix::process::{Pid, Signal, kill_process};

/// Where wireguard-go keeps its control sockets, one directory for all namespaces.
const SOCKET_DIR: &str = "/var/run/wireguard";

/// Why the lab cannot run here, if it cannot: not root, a tool or /dev/net/tun missing.
pub fn skip_reason(tools: &[&str]) -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root".into());
    }
    for tool in tools.iter().chain(&["ip", "wireguard-go", "wg", "ping"]) {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status();
        if !found.is_ok_and(|s| s.success()) {
            return Some(format!("{tool} is not installed"));
        }
    }
    if !Path::new("/dev/net/tun").exists() {
        return Some("no /dev/net/tun".into());
    }
    None
}

/// A WireGuard key pair, each half base64 as `wg` writes it.
#[derive(Clone, Debug)]
pub struct Keypair {
    /// The private key.
    pub private: String,
    /// The public key.
    pub public: String,
    /// The private key's bytes.
    pub secret: [u8; 32],
}

/// A fresh key pair from the system's random source.
pub fn keypair() -> Keypair {
    use ring::rand::SecureRandom;
    let mut secret = [0u8; 32];
    ring::rand::SystemRandom::new().fill(&mut secret).unwrap();
    let s = boringtun::x25519::StaticSecret::from(secret);
    let public = boringtun::x25519::PublicKey::from(&s);
    let e = base64::engine::general_purpose::STANDARD;
    Keypair {
        private: e.encode(s.to_bytes()),
        public: e.encode(public.to_bytes()),
        secret: s.to_bytes(),
    }
}

/// Namespaces and a directory; the namespaces are deleted on drop (processes started in
/// them are their owners' to stop first).
pub struct Lab {
    namespaces: Vec<String>,
    /// The lab's files.
    pub dir: PathBuf,
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `c` with its output discarded; true if it succeeded.
fn quiet(c: &mut Command) -> bool {
    c.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Lab {
    /// Creates namespaces named `tb-<name>-<pid>` with `lo` up, and the directory `dir`.
    pub fn new(names: &[&str], dir: &Path) -> Lab {
        let id = std::process::id() % 100_000;
        std::fs::create_dir_all(dir).unwrap();
        let lab = Lab {
            namespaces: names.iter().map(|n| format!("tb-{n}-{id}")).collect(),
            dir: dir.to_path_buf(),
        };
        for ns in &lab.namespaces {
            // One left by an earlier process with this pid, if any.
            let _ = quiet(Command::new("ip").args(["netns", "del", ns]));
            assert!(
                quiet(Command::new("ip").args(["netns", "add", ns])),
                "ip netns add {ns}"
            );
            lab.sh(ns, &["ip", "link", "set", "lo", "up"]);
        }
        lab
    }

    /// The full name of namespace `i`.
    pub fn ns(&self, i: usize) -> &str {
        &self.namespaces[i]
    }

    /// Joins namespaces `a` and `b` with a veth pair; `addr_a`/`addr_b` are CIDRs.
    pub fn veth(&self, a: usize, addr_a: &str, b: usize, addr_b: &str) {
        let id = std::process::id() % 100_000;
        let (va, vb) = (format!("tbv{id}a"), format!("tbv{id}b"));
        assert!(quiet(Command::new("ip").args([
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
        for (ns, dev, addr) in [
            (&self.namespaces[a], &va, addr_a),
            (&self.namespaces[b], &vb, addr_b),
        ] {
            self.sh(ns, &["ip", "addr", "add", addr, "dev", dev]);
            self.sh(ns, &["ip", "link", "set", dev, "up"]);
        }
    }

    /// `ip netns exec ns args…`.
    pub fn exec(&self, ns: &str, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).args(args);
        c
    }

    /// Runs a command in `ns`; panics with its output if it fails.
    pub fn sh(&self, ns: &str, args: &[&str]) {
        self.sh_input(ns, args, "");
    }

    /// Runs a command in `ns` with `input` on stdin; panics with its output if it fails.
    pub fn sh_input(&self, ns: &str, args: &[&str], input: &str) -> String {
        let mut child = self
            .exec(ns, args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{args:?} in {ns}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Round-trip times of `count` pings from `ns` to `ip`, 20 ms apart, in µs, sorted.
    pub fn ping_rtts(&self, ns: &str, ip: &str, count: usize) -> Vec<f64> {
        let out = self
            .exec(
                ns,
                &["ping", "-n", "-c", &count.to_string(), "-i", "0.02", ip],
            )
            .output()
            .unwrap();
        let mut rtts: Vec<f64> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split("time=").nth(1))
            .filter_map(|t| t.split_whitespace().next())
            .filter_map(|t| t.parse::<f64>().ok())
            .map(|ms| ms * 1000.0)
            .collect();
        rtts.sort_by(|a, b| a.total_cmp(b));
        rtts
    }
}

/// A process the bench started (in a session of its own, stopped with the bench): stopped
/// on drop.
pub struct Proc {
    /// The child.
    pub child: Child,
}

impl Proc {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills it with SIGKILL and reaps it.
    pub fn kill9(&mut self) {
        let _ = kill_process(Pid::from_child(&self.child), Signal::KILL);
        let _ = self.child.wait();
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Proc {
    /// Stops it: SIGTERM, SIGKILL after 2 s.
    pub fn stop(&mut self) {
        if self.running() {
            let _ = kill_process(Pid::from_child(&self.child), Signal::TERM);
            let deadline = Instant::now() + Duration::from_secs(2);
            while self.running() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if self.running() {
                self.kill9();
            }
        }
        let _ = self.child.wait();
    }
}

/// Starts `args` in `ns` in a session of its own (stopped when the bench exits), its output
/// into `log`. Call it from the main thread: the death signal follows the spawning thread.
pub fn spawn(lab: &Lab, ns: &str, args: &[&str], log: &Path) -> Proc {
    let log = std::fs::File::create(log).unwrap();
    let child = crate::own_session(&mut lab.exec(ns, args))
        // trellis logs warnings and errors only (the other jobs' setting).
        .env("TRELLIS_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    Proc { child }
}

/// One peer of a wireguard-go device, as `wg set … peer` takes it.
pub struct WgPeer<'a> {
    /// The peer's public key.
    pub public: &'a str,
    /// CIDRs routed to the peer and accepted from it.
    pub allowed_ips: &'a [&'a str],
    /// Where to send to first.
    pub endpoint: Option<&'a str>,
    /// Persistent keepalive in seconds.
    pub keepalive: Option<u16>,
}

/// A wireguard-go device in a namespace: stopped and its control socket removed on drop.
pub struct WgGo {
    /// The wireguard-go process.
    pub proc: Proc,
    socket: PathBuf,
}

impl Drop for WgGo {
    fn drop(&mut self) {
        let _ = kill_process(Pid::from_child(&self.proc.child), Signal::TERM);
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// What a wireguard-go device starts with.
pub struct WgDevice<'a> {
    /// The interface name (unique on the machine: the control sockets share a directory).
    pub ifname: &'a str,
    /// Its key pair.
    pub keys: &'a Keypair,
    /// Its UDP port.
    pub port: u16,
    /// Its address (CIDR) on the interface.
    pub address: &'a str,
    /// Its peers.
    pub peers: &'a [WgPeer<'a>],
    /// Destinations (CIDRs) routed into the interface beyond its address's prefix.
    pub routes: &'a [&'a str],
}

impl WgGo {
    /// Starts wireguard-go in `ns` and configures it: key, port, peers, address, link up,
    /// routes.
    pub fn start(lab: &Lab, ns: &str, device: &WgDevice) -> WgGo {
        let WgDevice {
            ifname,
            keys,
            port,
            address,
            peers,
            routes,
        } = *device;
        let socket = PathBuf::from(format!("{SOCKET_DIR}/{ifname}.sock"));
        let _ = std::fs::remove_file(&socket);
        let proc = spawn(
            lab,
            ns,
            &["wireguard-go", "-f", ifname],
            &lab.dir.join(format!("{ifname}.log")),
        );
        let wg = WgGo { proc, socket };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !wg.socket.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(wg.socket.exists(), "wireguard-go {ifname} did not start");
        let port = port.to_string();
        lab.sh_input(
            ns,
            &[
                "wg",
                "set",
                ifname,
                "private-key",
                "/dev/stdin",
                "listen-port",
                &port,
            ],
            &keys.private,
        );
        for p in peers {
            let allowed = p.allowed_ips.join(",");
            let keepalive = p.keepalive.map_or("off".into(), |k| k.to_string());
            let mut args = vec!["wg", "set", ifname, "peer", p.public];
            args.extend(["allowed-ips", &allowed, "persistent-keepalive", &keepalive]);
            if let Some(e) = p.endpoint {
                args.extend(["endpoint", e]);
            }
            lab.sh(ns, &args);
        }
        lab.sh(ns, &["ip", "addr", "add", address, "dev", ifname]);
        lab.sh(ns, &["ip", "link", "set", ifname, "up"]);
        for r in routes {
            lab.sh(ns, &["ip", "route", "add", r, "dev", ifname]);
        }
        wg
    }

    /// wireguard-go's process id.
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }
}

/// A tokio runtime with `threads` workers, each of them (and each blocking thread) inside
/// network namespace `ns`: every socket its tasks open is in `ns`. Spawn work onto it with
/// its handle (`block_on` would run on the caller's thread, in the caller's namespace).
pub fn runtime_in(ns: &str, threads: usize) -> tokio::runtime::Runtime {
    let path = format!("/var/run/netns/{ns}");
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .on_thread_start(move || enter_netns(&path))
        .build()
        .unwrap()
}

/// Moves the calling thread into the network namespace at `path` (a thread's namespace is
/// its own: the rest of the process stays where it is).
#[expect(
    unsafe_code,
    reason = "setns(2) has no safe wrapper among the crate's dependencies"
)]
fn enter_netns(path: &str) {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    // SAFETY: `file` is an open namespace file for the duration of the call; setns only
    // changes the calling thread's network namespace.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
}
