//! WireGuard peers for the namespace tests: key pairs from `wg genkey`/`wg pubkey`, and
//! wireguard-go devices ([`WgGo`]) inside a [`Lab`]'s namespaces, configured with `wg set` and
//! `ip`, read back with `wg show <if> dump`. wireguard-go's control sockets
//! (`/var/run/wireguard/<if>.sock`) are shared by every namespace, so each device gets an
//! interface name unique on the machine. It never uses a kernel WireGuard module, and it
//! leaves nothing behind: a dropped device is stopped and its control socket removed.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustix::process::{Pid, Signal, kill_process};

use super::netns::{Lab, add_address, serial};
use super::wait_for;

/// Where wireguard-go keeps its control sockets, one directory for all namespaces.
pub(crate) const SOCKET_DIR: &str = "/var/run/wireguard";

/// A WireGuard key pair, each half base64 as `wg` writes it.
#[derive(Clone, Debug)]
pub(crate) struct Keypair {
    /// The private key.
    pub private: String,
    /// The public key.
    pub public: String,
}

/// A fresh key pair (`wg genkey`, `wg pubkey`).
pub(crate) fn keypair() -> Keypair {
    let private = wg_tool(&["genkey"], "");
    let public = wg_tool(&["pubkey"], &private);
    Keypair { private, public }
}

/// Runs `wg <args>` with `input` on stdin; returns its trimmed stdout.
fn wg_tool(args: &[&str], input: &str) -> String {
    let mut child = Command::new("wg")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "wg {args:?}: {err}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// One peer of a device, as `wg set … peer` takes it.
#[derive(Clone, Debug, Default)]
pub(crate) struct WgPeer {
    /// The peer's public key.
    pub public: String,
    /// CIDRs routed to the peer and accepted from it.
    pub allowed_ips: Vec<String>,
    /// Where to send to first (`ip:port`, `[v6]:port`); none to wait for the peer.
    pub endpoint: Option<String>,
    /// Persistent keepalive in seconds; none for off.
    pub keepalive: Option<u16>,
}

/// What a device starts with.
#[derive(Clone, Debug, Default)]
pub(crate) struct WgConfig {
    /// The device's private key.
    pub private: String,
    /// The UDP port; none for one the device picks.
    pub listen_port: Option<u16>,
    /// CIDRs on the interface (IPv4 and IPv6).
    pub addresses: Vec<String>,
    /// The peers.
    pub peers: Vec<WgPeer>,
    /// Destinations (CIDRs) routed into the interface beyond its addresses' prefixes.
    pub routes: Vec<String>,
}

/// A peer as `wg show <if> dump` reports it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct WgPeerState {
    /// The peer's public key.
    pub public: String,
    /// Where the device sends to now (it follows the peer's roaming); none before any.
    pub endpoint: Option<SocketAddr>,
    /// The peer's allowed IPs.
    pub allowed_ips: Vec<String>,
    /// When the last handshake completed (to the second); none if never.
    pub latest_handshake: Option<SystemTime>,
    /// Bytes received from the peer.
    pub rx: u64,
    /// Bytes sent to the peer.
    pub tx: u64,
    /// Persistent keepalive in seconds; none for off.
    pub keepalive: Option<u16>,
}

/// A device as `wg show <if> dump` reports it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct WgShow {
    /// The device's public key.
    pub public: String,
    /// The UDP port it listens on.
    pub listen_port: u16,
    /// Its peers.
    pub peers: Vec<WgPeerState>,
}

impl WgShow {
    /// The peer with public key `public`.
    pub(crate) fn peer(&self, public: &str) -> Option<&WgPeerState> {
        self.peers.iter().find(|p| p.public == public)
    }
}

/// Parses `wg show <if> dump`: one tab-separated line for the interface (private key,
/// public key, port, fwmark), then one per peer (public key, preshared key, endpoint,
/// allowed IPs, latest handshake, rx, tx, keepalive).
pub(crate) fn parse_dump(text: &str) -> Option<WgShow> {
    let mut lines = text.lines();
    let interface: Vec<&str> = lines.next()?.split('\t').collect();
    let [_, public, port, _] = interface[..] else {
        return None;
    };
    let mut peers = Vec::new();
    for line in lines {
        let f: Vec<&str> = line.split('\t').collect();
        let [public, _, endpoint, allowed, handshake, rx, tx, keepalive] = f[..] else {
            return None;
        };
        let secs: u64 = handshake.parse().ok()?;
        peers.push(WgPeerState {
            public: public.to_string(),
            endpoint: endpoint.parse().ok(),
            allowed_ips: allowed
                .split(',')
                .filter(|a| *a != "(none)")
                .map(String::from)
                .collect(),
            latest_handshake: (secs != 0).then(|| UNIX_EPOCH + Duration::from_secs(secs)),
            rx: rx.parse().ok()?,
            tx: tx.parse().ok()?,
            keepalive: keepalive.parse().ok(),
        });
    }
    Some(WgShow {
        public: public.to_string(),
        listen_port: port.parse().ok()?,
        peers,
    })
}

/// A wireguard-go device in a namespace: stopped (SIGTERM, then SIGKILL) and its control
/// socket removed on drop.
pub(crate) struct WgGo {
    ns: String,
    ifname: String,
    child: Child,
    log: PathBuf,
}

impl WgGo {
    /// Starts wireguard-go in `ns` (a namespace of `lab`, logging verbosely into its
    /// directory), and configures it: key, port, peers, addresses, link up, routes.
    pub(crate) fn start(lab: &Lab, ns: &str, config: &WgConfig) -> WgGo {
        // "wg<pid>-<serial>": at most 15 bytes, unique on the machine while this process runs.
        let ifname = format!("wg{}-{}", std::process::id() % 100_000, serial());
        let log = lab.dir.path(&format!("{ifname}.log"));
        let socket = PathBuf::from(format!("{SOCKET_DIR}/{ifname}.sock"));
        // A socket left by an earlier process with this pid would pass for ours.
        let _ = std::fs::remove_file(&socket);
        let out = std::fs::File::create(&log).unwrap();
        let child = lab
            .exec(ns, &["wireguard-go", "-f", &ifname])
            .env("LOG_LEVEL", "verbose")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        // From here on, a panic stops the device.
        let mut wg = WgGo {
            ns: ns.to_string(),
            ifname,
            child,
            log,
        };
        let up = wait_for(Duration::from_secs(5), || {
            let exited = wg.child.try_wait().ok().flatten().is_some();
            (exited || socket.exists()).then_some(!exited)
        });
        assert_eq!(up, Some(true), "wireguard-go did not start: {}", wg.log());
        let mut set = vec!["set", &wg.ifname, "private-key", "/dev/stdin"];
        let port = config.listen_port.map(|p| p.to_string());
        if let Some(port) = &port {
            set.extend(["listen-port", port]);
        }
        wg.wg(&set, &config.private);
        for peer in &config.peers {
            wg.set_peer(peer);
        }
        for addr in &config.addresses {
            wg.ip(&add_address(addr, &wg.ifname));
        }
        wg.ip(&["ip", "link", "set", &wg.ifname, "up"]);
        for route in &config.routes {
            wg.ip(&["ip", "route", "add", route, "dev", &wg.ifname]);
        }
        wg
    }

    /// Runs `args` in the device's namespace; panics with its output if it fails.
    fn ip(&self, args: &[&str]) -> String {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns]).args(args);
        let (ok, out) = super::run(&mut cmd, b"", Duration::from_secs(10));
        assert!(ok, "{args:?} in {}: {out}", self.ns);
        out
    }

    /// Runs `wg <args>` in the device's namespace with `input` on stdin.
    fn wg(&self, args: &[&str], input: &str) -> String {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns, "wg"]).args(args);
        let (ok, out) = super::run(&mut cmd, input.as_bytes(), Duration::from_secs(10));
        assert!(ok, "wg {args:?} in {}: {out}", self.ns);
        out
    }

    /// The interface name (also the control socket's name).
    pub(crate) fn ifname(&self) -> &str {
        &self.ifname
    }

    /// The namespace the device runs in.
    pub(crate) fn ns(&self) -> &str {
        &self.ns
    }

    /// wireguard-go's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The control socket's path.
    pub(crate) fn socket(&self) -> PathBuf {
        PathBuf::from(format!("{SOCKET_DIR}/{}.sock", self.ifname))
    }

    /// What wireguard-go has logged so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Adds `peer` or replaces its allowed IPs and keepalive (and its endpoint, if given).
    pub(crate) fn set_peer(&self, peer: &WgPeer) {
        let allowed = peer.allowed_ips.join(",");
        let keepalive = peer.keepalive.map_or("off".into(), |k| k.to_string());
        let mut args = vec!["set", &self.ifname, "peer", &peer.public];
        args.extend(["allowed-ips", &allowed, "persistent-keepalive", &keepalive]);
        if let Some(endpoint) = &peer.endpoint {
            args.extend(["endpoint", endpoint]);
        }
        self.wg(&args, "");
    }

    /// Removes the peer with public key `public`.
    pub(crate) fn remove_peer(&self, public: &str) {
        self.wg(&["set", &self.ifname, "peer", public, "remove"], "");
    }

    /// Replaces the device's private key (its peers know it by the new public key from now).
    pub(crate) fn set_private_key(&self, private: &str) {
        self.wg(&["set", &self.ifname, "private-key", "/dev/stdin"], private);
    }

    /// Moves the device to UDP port `port` (the peers see it roam).
    pub(crate) fn set_listen_port(&self, port: u16) {
        self.wg(&["set", &self.ifname, "listen-port", &port.to_string()], "");
    }

    /// The device's state now.
    pub(crate) fn show(&self) -> WgShow {
        let dump = self.wg(&["show", &self.ifname, "dump"], "");
        parse_dump(&dump).unwrap_or_else(|| panic!("wg show dump: {dump:?}"))
    }

    /// Waits up to `limit` for a completed handshake with peer `public`; returns the peer.
    pub(crate) fn wait_handshake(&self, public: &str, limit: Duration) -> Option<WgPeerState> {
        wait_for(limit, || {
            let peer = self.show().peer(public)?.clone();
            peer.latest_handshake.is_some().then_some(peer)
        })
    }

    /// Stops the device (SIGTERM, SIGKILL after 2 s) and removes its control socket.
    pub(crate) fn stop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = kill_process(Pid::from_child(&self.child), Signal::TERM);
            let child = &mut self.child;
            if wait_for(Duration::from_secs(2), || child.try_wait().ok().flatten()).is_none() {
                let _ = self.child.kill();
            }
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_file(self.socket());
    }
}

impl Drop for WgGo {
    fn drop(&mut self) {
        self.stop();
    }
}
