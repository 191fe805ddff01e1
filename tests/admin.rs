//! The admin endpoint under attack, with the real binary on loopback: probes are answered
//! within a second while idle connections flood it from one address or from hundreds, while
//! an attacker keeps re-opening them, and while the data plane has taken every descriptor
//! the open-files limit allows. `/routes` is served on the debug address only.
// A test fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use socket2::{Domain, Socket, Type};

/// How long a probe may take (kubelet's default `timeoutSeconds`).
const PROBE_LIMIT: Duration = Duration::from_secs(1);

/// A TCP connection to `addr` from `from` (any loopback address) or the default source.
fn connect_from(
    addr: SocketAddr,
    from: Option<IpAddr>,
    limit: Duration,
) -> std::io::Result<TcpStream> {
    let sock = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    if let Some(ip) = from {
        sock.bind(&SocketAddr::new(ip, 0).into())?;
    }
    sock.connect_timeout(&addr.into(), limit)?;
    Ok(sock.into())
}

/// `GET path` from `from`; the status if the whole answer came within [`PROBE_LIMIT`].
fn probe(addr: SocketAddr, path: &str, from: Option<IpAddr>) -> Result<u16, String> {
    let start = Instant::now();
    let left = |start: Instant| {
        PROBE_LIMIT
            .checked_sub(start.elapsed())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| format!("no answer within {PROBE_LIMIT:?}"))
    };
    let mut s = connect_from(addr, from, left(start)?).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(left(start)?)).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: probe\r\n\r\n").map_err(|e| format!("write: {e}"))?;
    let mut out = String::new();
    s.read_to_string(&mut out)
        .map_err(|e| format!("read after {:?}: {e}", start.elapsed()))?;
    left(start)?;
    out.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {out:?}"))
}

/// Probes `path` `times` times, a tenth of a second apart; each must answer `want` in time.
fn probes_answer(addr: SocketAddr, path: &str, from: Option<IpAddr>, times: usize, want: u16) {
    for i in 0..times {
        match probe(addr, path, from) {
            Ok(status) => assert_eq!(status, want, "probe {i} of {path}"),
            Err(e) => panic!("probe {i} of {path} from {from:?}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `n` idle connections to `addr` from each of `sources` (none sends a byte).
fn idle_connections(addr: SocketAddr, sources: &[Option<IpAddr>], n: usize) -> Vec<TcpStream> {
    let mut held = Vec::new();
    for from in sources {
        for _ in 0..n {
            // Refused or dropped connections are fine: the attack is the attempt.
            if let Ok(s) = connect_from(addr, *from, Duration::from_secs(2)) {
                held.push(s);
            }
        }
    }
    held
}

/// 127.0.x.y for the `i`-th attacking address (127.0.0.1 excluded).
fn loopback(i: usize) -> IpAddr {
    IpAddr::from([127, 0, (i / 250) as u8, (i % 250 + 2) as u8])
}

fn one_route() -> String {
    routes_yaml(&[R {
        name: "r",
        sni: &["r.example.com"],
        backends: &["127.0.0.1:9".parse().unwrap()],
    }])
}

#[test]
fn idle_flood_from_one_address_leaves_the_probes_answered() {
    let gw = Gateway::start(&one_route(), "");
    let before = gw.fd_count();
    let flood = idle_connections(gw.admin, &[None], 1000);
    assert!(
        flood.len() >= 900,
        "only {} connections opened",
        flood.len()
    );
    probes_answer(gw.admin, "/ready", None, 5, 200);
    probes_answer(gw.admin, "/live", None, 3, 200);
    probes_answer(gw.admin, "/healthz/ready", None, 2, 200);
    // The gateway holds a bounded number of them, not a thousand descriptors.
    let held = gw.fd_count().saturating_sub(before);
    assert!(
        held <= 64 + 8,
        "the admin server holds {held} more descriptors"
    );
    drop(flood);
}

#[test]
fn idle_flood_from_many_addresses_leaves_a_fresh_address_answered() {
    let gw = Gateway::start(&one_route(), "");
    // 300 addresses with 16 connections each: past any per-address and total cap.
    let sources: Vec<Option<IpAddr>> = (0..300).map(|i| Some(loopback(i))).collect();
    let flood = idle_connections(gw.admin, &sources, 16);
    assert!(
        flood.len() >= 4000,
        "only {} connections opened",
        flood.len()
    );
    let fresh = Some(IpAddr::from([127, 0, 9, 9]));
    probes_answer(gw.admin, "/ready", fresh, 6, 200);
    // One of the flooding addresses is answered too.
    probes_answer(gw.admin, "/ready", sources[7], 2, 200);
    drop(flood);
}

#[test]
fn probes_are_answered_while_idle_connections_keep_coming() {
    let gw = Gateway::start(&one_route(), "");
    let admin = gw.admin;
    let stop = Arc::new(AtomicBool::new(false));
    // The attacker keeps 1,200 idle connections open, half from 127.0.0.1 and half from 20
    // other addresses, replacing the oldest as fast as it can.
    let attack = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut open = std::collections::VecDeque::new();
            let mut opened = 0usize;
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                i += 1;
                let from = (i % 2 == 0).then(|| loopback(i % 20));
                if let Ok(s) = connect_from(admin, from, Duration::from_secs(2)) {
                    open.push_back(s);
                    opened += 1;
                }
                if open.len() > 1200 {
                    open.pop_front();
                }
            }
            opened
        })
    };
    // Let the attack reach its full size first.
    std::thread::sleep(Duration::from_secs(2));
    probes_answer(admin, "/ready", None, 16, 200);
    probes_answer(admin, "/ready", Some(IpAddr::from([127, 0, 9, 9])), 16, 200);
    stop.store(true, Ordering::SeqCst);
    let opened = attack.join().unwrap();
    assert!(
        opened > 1200,
        "the attacker opened only {opened} connections"
    );
}

#[test]
fn routes_are_served_on_the_debug_address_only() {
    let gw = Gateway::start(&one_route(), "");
    assert!(gw.debug.ip().is_loopback() && gw.debug != gw.admin);
    let (status, body) = http_get(gw.debug, "/routes").unwrap();
    assert_eq!(status, 200);
    assert!(body.contains("\"name\": \"r\""), "{body}");
    assert_eq!(http_get(gw.admin, "/routes").unwrap().0, 404);
    // Probes and metrics are not on the debug address.
    assert_eq!(http_get(gw.debug, "/ready").unwrap().0, 404);
    assert_eq!(http_get(gw.debug, "/metrics").unwrap().0, 404);
    let metrics = gw.metrics();
    let build = format!("trellis_build_info{{version=\"{}\"}} 1", trellis::VERSION);
    assert!(metrics.lines().any(|l| l == build), "{metrics}");
    for family in [
        "process_resident_memory_bytes ",
        "process_open_fds ",
        "process_max_fds ",
        "trellis_routing_table_routes ",
    ] {
        assert!(metric_in(&metrics, family) > 0.0, "{family}\n{metrics}");
    }
}

/// `/routes` shows a route's WireGuard tunnel as the table file writes it: its peers' keys
/// and allowedIPs (networks in prefix form) and the gateway's local addresses.
#[test]
fn routes_show_each_tunnel_in_the_table_shape() {
    use base64::Engine;
    let key = |b: u8| base64::engine::general_purpose::STANDARD.encode([b; 32]);
    let table = format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- name: shoot
  tunnel:
    wireguard:
      peers:
      - {{publicKey: \"{}\", allowedIPs: [192.168.128.5, \"10.250.0.0/16\"]}}
      - {{publicKey: \"{}\", allowedIPs: [\"fd00::/64\"]}}
      localAddresses: [192.168.128.1, \"fd01::1\"]
",
        key(1),
        key(2)
    );
    let gw = Gateway::start(&table, "");
    let (status, body) = http_get(gw.debug, "/routes").unwrap();
    assert_eq!(status, 200);
    let routes: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        routes["routes"][0]["tunnel"],
        serde_json::json!({"wireguard": {
            "peers": [
                {"publicKey": key(1), "allowedIPs": ["192.168.128.5/32", "10.250.0.0/16"]},
                {"publicKey": key(2), "allowedIPs": ["fd00::/64"]},
            ],
            "localAddresses": ["192.168.128.1", "fd01::1"],
        }}),
        "{body}"
    );
}

/// `n` clients that connect to `addr` and never send a byte.
fn silent_clients(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n)
        .filter_map(|_| connect_from(addr, None, Duration::from_secs(2)).ok())
        .collect()
}

/// Lines of the gateway's log whose message starts with `prefix`.
fn log_lines(gw: &Gateway, prefix: &str) -> Vec<serde_json::Value> {
    gw.logs()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"].as_str().is_some_and(|m| m.starts_with(prefix)))
        .collect()
}

/// Under a low limit, `maxConnections` is lowered to what the limit holds (said at start),
/// so silent clients cannot take the descriptors the probes need.
#[test]
fn a_low_open_files_limit_caps_max_connections_and_probes_answer() {
    let nofile = 256;
    let gw = Gateway::start_with_nofile(
        &one_route(),
        // One loopback address stands for many clients.
        "limits: {maxConnections: 750000, maxConnectionsPerSource: 0}\ntimeouts: {handshake: 60s}\nworkers: 1",
        nofile,
    );
    // One worker with one listener.
    let fixed = trellis::net::fds::Budget::fixed(1, 1);
    let cap = trellis::net::fds::Budget::plan(nofile, 750_000, fixed).max_connections;
    let said = log_lines(&gw, "limits.maxConnections lowered");
    assert_eq!(said.len(), 1, "{}", gw.logs());
    assert_eq!(said[0]["nofile"], nofile);
    assert_eq!(said[0]["requested"], 750_000);
    assert_eq!(said[0]["max_connections"], cap as u64);
    let clients = silent_clients(gw.tls, 400);
    assert!(clients.len() >= 390, "{} clients", clients.len());
    gw.wait_metric(
        "trellis_downstream_connections_active{listener=\"tls\"}",
        |v| v == cap as f64,
    );
    probes_answer(gw.admin, "/ready", None, 5, 200);
    probes_answer(gw.admin, "/live", None, 5, 200);
    assert_eq!(
        gw.metric("trellis_downstream_connections_active{listener=\"tls\"}"),
        cap as f64,
        "never more than the cap"
    );
    assert!(gw.fd_count() < nofile as usize);
    drop(clients);
}

/// When the process does run out of descriptors (here: the limit is lowered under a running
/// gateway, so its budget no longer holds), the admin server takes probes in with a spare
/// descriptor, and the data plane's accept loop says so once per interval, not per failure.
#[test]
fn out_of_descriptors_probes_still_answer() {
    let gw = Gateway::start(
        &one_route(),
        "timeouts: {handshake: 60s}\nworkers: 1\nlimits: {maxConnectionsPerSource: 0}",
    );
    let nofile = gw.fd_count() as u64 + 100;
    let pid = rustix::process::Pid::from_raw(gw.pid() as i32).unwrap();
    let limit = rustix::process::Rlimit {
        current: Some(nofile),
        maximum: Some(nofile),
    };
    rustix::process::prlimit(Some(pid), rustix::process::Resource::Nofile, limit).unwrap();
    let clients = silent_clients(gw.tls, 400);
    // The data plane took every descriptor left.
    wait_for(Duration::from_secs(10), || {
        (!log_lines(&gw, "accept failed; backing off").is_empty()).then_some(())
    })
    .unwrap_or_else(|| panic!("the data plane never ran out:\n{}", gw.logs()));
    let exhausted = Instant::now();
    assert!(gw.fd_count() as u64 >= nofile - 2, "{} open", gw.fd_count());
    probes_answer(gw.admin, "/ready", None, 5, 200);
    probes_answer(gw.admin, "/live", None, 5, 200);
    probes_answer(gw.admin, "/ready", None, 5, 200);
    // Out of descriptors all along, and accepts failed every second at least: one line per
    // ten seconds for the data plane's one listener socket, not one per failure.
    let lines = log_lines(&gw, "accept failed; backing off");
    let due = 1 + exhausted.elapsed().as_secs() as usize / 10;
    assert!(lines.len() <= due, "{} lines: {lines:?}", lines.len());
    drop(clients);
}
