//! The WireGuard lab the tunnel tests are built on, proven with wireguard-go on both sides:
//! two namespaces joined by a veth pair (IPv4 and IPv6), a wireguard-go device in each,
//! pings both ways over both families, a TCP echo and a byte-exact 10 MiB transfer through
//! the tunnel, the handshake and the byte counters in `wg show`, and nothing left behind
//! (namespace, process or control socket) once the lab is dropped. Needs root,
//! `wireguard-go`, `wg`, `socat`, `ping`, `ss` and /dev/net/tun; skipped otherwise.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::netns::{self, Lab};
use common::wait_for;
use common::wg::{self, WgConfig, WgGo, WgPeer, parse_dump};

fn skip(test: &str) -> bool {
    let mut reason = netns::skip_reason(&["wireguard-go", "wg", "socat", "ping", "ss"]);
    if reason.is_none() && !Path::new("/dev/net/tun").exists() {
        reason = Some("no /dev/net/tun".into());
    }
    if let Some(reason) = &reason {
        common::skip(test, reason);
    }
    reason.is_some()
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// True while `pid` is a process that has not exited.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| !stat.rsplit(')').next().unwrap_or("").starts_with(" Z"))
}

#[test]
fn wireguard_go_pair_needs_root_netns() {
    if skip("wireguard_go_pair_needs_root_netns") {
        return;
    }
    let start = Instant::now();
    let mut lab = Lab::new(&["wga", "wgb"]);
    lab.veth_addrs(
        0,
        &["10.250.0.1/24", "fd00:250::1/64"],
        1,
        &["10.250.0.2/24", "fd00:250::2/64"],
    );
    let (na, nb) = (lab.ns(0), lab.ns(1));
    // Behind b, reached only through a's route into the tunnel.
    assert!(lab.sh(&nb, &["ip", "addr", "add", "192.168.129.5/32", "dev", "lo"]));
    let (ka, kb) = (wg::keypair(), wg::keypair());
    let a = WgGo::start(
        &lab,
        &na,
        &WgConfig {
            private: ka.private.clone(),
            listen_port: Some(51820),
            addresses: strings(&["192.168.128.1/24", "fd8f::1/64"]),
            peers: vec![WgPeer {
                public: kb.public.clone(),
                allowed_ips: strings(&["192.168.128.5/32", "fd8f::5/128", "192.168.129.0/24"]),
                endpoint: Some("10.250.0.2:51821".into()),
                keepalive: None,
            }],
            routes: strings(&["192.168.129.0/24"]),
        },
    );
    // b reaches a over the IPv6 underlay, with keepalives.
    let b = WgGo::start(
        &lab,
        &nb,
        &WgConfig {
            private: kb.private.clone(),
            listen_port: Some(51821),
            addresses: strings(&["192.168.128.5/24", "fd8f::5/64"]),
            peers: vec![WgPeer {
                public: ka.public.clone(),
                allowed_ips: strings(&["192.168.128.1/32", "fd8f::1/128"]),
                endpoint: Some("[fd00:250::1]:51820".into()),
                keepalive: Some(25),
            }],
            routes: Vec::new(),
        },
    );
    assert!(lab.ping(&na, "192.168.128.5"), "{}\n{}", a.log(), b.log());
    eprintln!(
        "lab set-up (namespaces, veth, keys, two wireguard-go, first ping): {:?}",
        start.elapsed()
    );

    for (ns, ip) in [
        (&na, "fd8f::5"),
        (&nb, "192.168.128.1"),
        (&nb, "fd8f::1"),
        (&na, "192.168.129.5"),
    ] {
        assert!(lab.ping(ns, ip), "ping {ip} from {ns}");
    }

    // Both sides saw the handshake; each knows where the other is.
    let peer_b = a
        .wait_handshake(&kb.public, Duration::from_secs(5))
        .unwrap();
    let peer_a = b
        .wait_handshake(&ka.public, Duration::from_secs(5))
        .unwrap();
    assert!(peer_b.endpoint.is_some() && peer_a.endpoint.is_some());
    assert_eq!(peer_a.keepalive, Some(25));
    assert_eq!(peer_b.keepalive, None);
    assert_eq!(a.show().listen_port, 51820);
    assert_eq!(b.show().public, kb.public);

    // An echo over IPv6 through the tunnel, and 10 MiB byte-exact over IPv4.
    let echo: SocketAddr = "[fd8f::5]:7001".parse().unwrap();
    lab.echo_server(&nb, echo);
    assert_eq!(
        lab.tcp_exchange(&na, echo, b"over the tunnel"),
        b"over the tunnel"
    );
    let tx_before = a.show().peer(&kb.public).unwrap().tx;
    let to: SocketAddr = "192.168.128.5:7000".parse().unwrap();
    let bytes = 10 << 20;
    let took = lab.transfer((&na, to), (&nb, to), bytes, Duration::from_secs(60));
    let tx = a.show().peer(&kb.public).unwrap().tx - tx_before;
    assert!(tx >= bytes as u64, "only {tx} bytes went into the tunnel");
    eprintln!(
        "10 MiB through wireguard-go in {took:?} ({:.0} Mbit/s)",
        bytes as f64 * 8.0 / took.as_secs_f64() / 1e6
    );

    // b moves to another port; a follows it with b's next packet (roaming).
    b.set_listen_port(51822);
    assert_eq!(b.show().listen_port, 51822);
    assert!(lab.ping(&nb, "192.168.128.1"));
    let moved = a.show().peer(&kb.public).unwrap().endpoint.unwrap();
    assert_eq!(moved, "[fd00:250::2]:51822".parse().unwrap());

    // A connection held open, so that an echo handler (forked by socat) is running at drop.
    let held = format!("sleep 60 | socat - TCP6:{echo}");
    let log = lab.dir.path("held.log");
    let client = lab.spawn_server(&na, &["sh", "-c", &held], &log);
    let handler = wait_for(Duration::from_secs(5), || {
        let pids = lab.output(&nb, &["ip", "netns", "pids", &nb]);
        // wireguard-go, the echo server, and its handler.
        (pids.lines().count() >= 3).then_some(())
    });
    assert!(handler.is_some(), "no echo handler for the held connection");
    assert!(lab.children[client].try_wait().unwrap().is_none());

    a.remove_peer(&kb.public);
    assert!(a.show().peers.is_empty());

    // Everything started goes with the lab.
    let mut pids: Vec<u32> = [&na, &nb]
        .iter()
        .flat_map(|ns| {
            lab.output(ns, &["ip", "netns", "pids", ns])
                .lines()
                .map(String::from)
                .collect::<Vec<_>>()
        })
        .filter_map(|p| p.trim().parse().ok())
        .collect();
    pids.extend([a.pid(), b.pid()]);
    let sockets = [a.socket(), b.socket()];
    assert!(sockets.iter().all(|s| s.exists()));
    assert!(pids.len() >= 6, "processes in the lab: {pids:?}");
    drop((a, b));
    drop(lab);
    let left = wait_for(Duration::from_secs(5), || {
        (!pids.iter().any(|p| alive(*p))).then_some(())
    });
    assert!(
        left.is_some(),
        "still running: {:?}",
        pids.iter().filter(|p| alive(**p)).collect::<Vec<_>>()
    );
    assert!(sockets.iter().all(|s| !s.exists()), "control sockets left");
    let namespaces = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    let namespaces = String::from_utf8_lossy(&namespaces.stdout);
    assert!(
        !namespaces.contains(&na) && !namespaces.contains(&nb),
        "{namespaces}"
    );
}

/// `wg show <if> dump` as wireguard-go's `wg` prints it: a peer that has shaken hands (IPv6
/// endpoint, keepalive) and one that never has (no endpoint, no allowed IPs).
#[test]
fn wg_show_dump_parses() {
    let dump = "oDs0Z6Y8J3wRRnCu4aNsZkK7Cb2W+XwKZ0Kq9m4pLWk=\tdNtj5OggR6KNX8mW1fHJl169XjOVhNmjaZjF4JopI0k=\t51820\toff\n\
        NI9Av/ktWnqXfR9CuG44GqvUtfT39twUNX625w/z1zA=\t(none)\t[fd00:250::2]:51821\t192.168.128.5/32,fd8f::5/128\t1795679581\t452\t364\t25\n\
        wHdrduP4jT6Ltl8yHWvVTvApYwFSQPNEAg2eqGOJCWQ=\t(none)\t(none)\t(none)\t0\t0\t0\toff\n";
    let show = parse_dump(dump).unwrap();
    assert_eq!(show.public, "dNtj5OggR6KNX8mW1fHJl169XjOVhNmjaZjF4JopI0k=");
    assert_eq!(show.listen_port, 51820);
    let p = show
        .peer("NI9Av/ktWnqXfR9CuG44GqvUtfT39twUNX625w/z1zA=")
        .unwrap();
    assert_eq!(p.endpoint, Some("[fd00:250::2]:51821".parse().unwrap()));
    assert_eq!(p.allowed_ips, ["192.168.128.5/32", "fd8f::5/128"]);
    let at = p.latest_handshake.unwrap();
    assert_eq!(
        at.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs(),
        1795679581
    );
    assert_eq!((p.rx, p.tx, p.keepalive), (452, 364, Some(25)));
    let q = &show.peers[1];
    assert_eq!(
        (q.endpoint, q.latest_handshake, q.keepalive),
        (None, None, None)
    );
    assert!(q.allowed_ips.is_empty());
    assert!(parse_dump("").is_none());
    assert!(parse_dump("a\tb\tnot-a-port\toff\n").is_none());
}
