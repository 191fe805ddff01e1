//! Real OpenVPN 2.6 tunnels through trellis' `http-connect` listeners, configured the way
//! Gardener's vpn-shoot is (`http-proxy` + `CUSTOM-HEADER X-Gardener-Destination`, and the
//! legacy `Reversed-VPN` header), in two network namespaces this test creates: "seed" (trellis
//! and the OpenVPN servers) and "shoot" (the OpenVPN clients), joined by a veth pair. A ping
//! crosses each tunnel; the routing table is rewritten while the tunnels are up and OpenVPN's
//! logs show no restart. Needs root, `ip`, `openvpn` and /dev/net/tun; skipped otherwise.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

const VPN_DEST: &str = "outbound|1194||vpn-seed-server.shoot--dev--alpha.svc.cluster.local";
const VPN_DEST_1: &str = "outbound|1194||vpn-seed-server-1.shoot--dev--alpha.svc.cluster.local";

/// Network namespaces, processes and files of this test; all removed on drop.
struct Lab {
    seed: String,
    shoot: String,
    children: Vec<Child>,
    dir: TestDir,
}

impl Drop for Lab {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in [&self.seed, &self.shoot] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
            let _ = std::fs::remove_dir_all(format!("/etc/netns/{ns}"));
        }
    }
}

impl Lab {
    fn exec(&self, ns: &str, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).args(args);
        c
    }

    fn sh(&self, ns: &str, args: &[&str]) -> bool {
        self.exec(ns, args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    fn spawn(&mut self, ns: &str, args: &[&str], log: &Path) {
        let log = std::fs::File::create(log).unwrap();
        let child = self
            .exec(ns, args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.children.push(child);
    }

    fn metrics(&self, admin: &str) -> String {
        let out = self
            .exec(
                &self.seed,
                &["curl", "-s", &format!("http://{admin}/metrics")],
            )
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

fn skip_reason() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root".into());
    }
    for tool in ["ip", "openvpn", "curl", "ping"] {
        if Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status()
            .map_or(true, |s| !s.success())
        {
            return Some(format!(
                "{tool} is not installed (scripts/test installs it)"
            ));
        }
    }
    if !Path::new("/dev/net/tun").exists() {
        return Some("no /dev/net/tun".into());
    }
    None
}

fn setup() -> Option<Lab> {
    if let Some(reason) = skip_reason() {
        eprintln!("SKIP openvpn_tunnels_through_gateway_needs_root_netns: {reason}");
        return None;
    }
    let id = std::process::id() % 100_000;
    let lab = Lab {
        seed: format!("trellis-seed-{id}"),
        shoot: format!("trellis-shoot-{id}"),
        children: Vec::new(),
        dir: TestDir::new("ovpn"),
    };
    let (va, vb) = (format!("tvs{id}"), format!("tvh{id}"));
    let ok = |c: &mut Command| c.status().is_ok_and(|s| s.success());
    assert!(ok(Command::new("ip").args(["netns", "add", &lab.seed])));
    assert!(ok(Command::new("ip").args(["netns", "add", &lab.shoot])));
    assert!(ok(Command::new("ip").args([
        "link", "add", &va, "netns", &lab.seed, "type", "veth", "peer", "name", &vb, "netns",
        &lab.shoot
    ])));
    for (ns, dev, addr) in [
        (&lab.seed, &va, "10.250.77.1/24"),
        (&lab.shoot, &vb, "10.250.77.2/24"),
    ] {
        assert!(lab.sh(ns, &["ip", "link", "set", "lo", "up"]));
        assert!(lab.sh(ns, &["ip", "addr", "add", addr, "dev", dev]));
        assert!(lab.sh(ns, &["ip", "link", "set", dev, "up"]));
    }
    // The shoot resolves the seed's API name, as in Gardener (`remote api.<domain>`).
    std::fs::create_dir_all(format!("/etc/netns/{}", lab.shoot)).unwrap();
    std::fs::write(
        format!("/etc/netns/{}/hosts", lab.shoot),
        "10.250.77.1 api.alpha.example.com\n",
    )
    .unwrap();
    Some(lab)
}

fn routes(extra: &str) -> String {
    format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- name: shoot--dev--alpha--vpn-seed-server
  destinations: [\"{VPN_DEST}\"]
  backends: [{{address: \"127.0.0.1:1194\"}}]
- name: shoot--dev--alpha--vpn-seed-server-1
  destinations: [\"{VPN_DEST_1}\"]
  backends: [{{address: \"127.0.0.1:1195\"}}]
{extra}"
    )
}

fn openvpn_common(key: &Path) -> Vec<String> {
    [
        "--dev",
        "tun",
        "--secret",
        key.to_str().unwrap(),
        "--cipher",
        "AES-256-CBC",
        "--auth",
        "SHA256",
        "--verb",
        "3",
        "--ping",
        "2",
        "--ping-restart",
        "20",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn count(log: &Path, needle: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .matches(needle)
        .count()
}

#[test]
fn openvpn_tunnels_through_gateway_needs_root_netns() {
    let Some(mut lab) = setup() else { return };
    let dir: PathBuf = lab.dir.0.clone();
    let key = dir.join("static.key");
    assert!(
        Command::new("openvpn")
            .args(["--genkey", "secret"])
            .arg(&key)
            .status()
            .unwrap()
            .success()
    );

    // trellis in the seed namespace: the current and the legacy CONNECT listeners.
    std::fs::write(dir.join("routes.yaml"), routes("")).unwrap();
    let admin = "127.0.0.1:15021";
    std::fs::write(
        dir.join("gateway.yaml"),
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {{file: routes.yaml}}
listeners:
- {{name: http-proxy, address: \"10.250.77.1:8443\", protocol: http-connect}}
- {{name: reversed-vpn-legacy, address: \"10.250.77.1:8132\", protocol: http-connect, destinationHeader: Reversed-VPN}}
admin: {{address: \"{admin}\"}}
"
        ),
    )
    .unwrap();
    let gw_log = dir.join("gateway.log");
    lab.spawn(
        &lab.seed.clone(),
        &[
            BIN,
            "--log-format",
            "json",
            "gateway",
            "--config",
            dir.join("gateway.yaml").to_str().unwrap(),
        ],
        &gw_log,
    );

    // Two OpenVPN servers (vpn-seed-server and vpn-seed-server-1) behind trellis.
    let mut tunnels = Vec::new();
    for (i, (port, net, header, dest, listener)) in [
        (
            1194,
            "10.250.88",
            "X-Gardener-Destination",
            VPN_DEST,
            "10.250.77.1 8443",
        ),
        (
            1195,
            "10.250.89",
            "Reversed-VPN",
            VPN_DEST_1,
            "10.250.77.1 8132",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let server_log = dir.join(format!("server{i}.log"));
        let mut args: Vec<String> = vec![
            "openvpn".into(),
            "--proto".into(),
            "tcp-server".into(),
            "--local".into(),
            "127.0.0.1".into(),
        ];
        args.extend([
            "--lport".into(),
            port.to_string(),
            "--ifconfig".into(),
            format!("{net}.1"),
            format!("{net}.2"),
        ]);
        args.extend(openvpn_common(&key));
        let seed = lab.seed.clone();
        lab.spawn(
            &seed,
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
            &server_log,
        );

        let client_log = dir.join(format!("client{i}.log"));
        let (proxy_host, proxy_port) = listener.split_once(' ').unwrap();
        let mut args: Vec<String> = vec![
            "openvpn".into(),
            "--proto".into(),
            "tcp-client".into(),
            "--remote".into(),
            "api.alpha.example.com".into(),
            "1194".into(),
        ];
        args.extend(["--http-proxy".into(), proxy_host.into(), proxy_port.into()]);
        args.extend([
            "--http-proxy-option".into(),
            "CUSTOM-HEADER".into(),
            header.into(),
            dest.into(),
        ]);
        args.extend(["--ifconfig".into(), format!("{net}.2"), format!("{net}.1")]);
        args.extend(openvpn_common(&key));
        tunnels.push((format!("{net}.1"), client_log, server_log));
        let shoot = lab.shoot.clone();
        // Give the servers and trellis a moment; the clients retry anyway.
        std::thread::sleep(Duration::from_millis(300));
        lab.spawn(
            &shoot,
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
            &tunnels.last().unwrap().1,
        );
    }

    let ping =
        |lab: &Lab, target: &str| lab.sh(&lab.shoot, &["ping", "-c", "1", "-W", "1", target]);
    for (target, client_log, _) in &tunnels {
        let up = wait_for(Duration::from_secs(45), || ping(&lab, target).then_some(()));
        assert!(
            up.is_some(),
            "no ping through the tunnel to {target}\nclient:\n{}\ngateway:\n{}",
            std::fs::read_to_string(client_log).unwrap_or_default(),
            std::fs::read_to_string(&gw_log).unwrap_or_default()
        );
        assert_eq!(
            count(client_log, "Peer Connection Initiated"),
            1,
            "{}",
            std::fs::read_to_string(client_log).unwrap_or_default()
        );
    }
    let m = lab.metrics(admin);
    assert_eq!(
        metric_in(
            &m,
            "trellis_route_connections_active{route=\"shoot--dev--alpha--vpn-seed-server\"}"
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric_in(
            &m,
            "trellis_route_connections_active{route=\"shoot--dev--alpha--vpn-seed-server-1\"}"
        ),
        1.0,
        "{m}"
    );

    // Rewrite the routing table while the tunnels are up: add a shoot, then remove it.
    let write = |yaml: String| {
        std::fs::write(dir.join(".routes.tmp"), yaml).unwrap();
        std::fs::rename(dir.join(".routes.tmp"), dir.join("routes.yaml")).unwrap();
    };
    write(routes(
        "- name: shoot--dev--beta--vpn-seed-server\n  destinations: [\"outbound|1194||vpn-seed-server.shoot--dev--beta.svc.cluster.local\"]\n  backends: [{address: \"127.0.0.1:2194\"}]\n",
    ));
    let applied = |n: f64| {
        wait_for(Duration::from_secs(10), || {
            (metric_in(
                &lab.metrics(admin),
                "trellis_routing_table_reloads_total{result=\"applied\"}",
            ) == n)
                .then_some(())
        })
    };
    assert!(applied(2.0).is_some(), "table with the new route applied");
    write(routes(""));
    assert!(applied(3.0).is_some(), "table without it applied");
    for (target, client_log, server_log) in &tunnels {
        for _ in 0..3 {
            assert!(
                ping(&lab, target),
                "tunnel to {target} broken after the table changes"
            );
        }
        // No reconnect: still one initialisation, no restart, on both ends.
        assert_eq!(
            count(client_log, "Peer Connection Initiated"),
            1,
            "{}",
            std::fs::read_to_string(client_log).unwrap()
        );
        for log in [client_log, server_log] {
            for needle in ["Restart", "Connection reset", "SIGUSR1"] {
                assert_eq!(
                    count(log, needle),
                    0,
                    "{needle} in {}:\n{}",
                    log.display(),
                    std::fs::read_to_string(log).unwrap()
                );
            }
        }
    }
    let m = lab.metrics(admin);
    assert_eq!(
        metric_in(
            &m,
            "trellis_route_connections_total{route=\"shoot--dev--alpha--vpn-seed-server\"}"
        ),
        1.0,
        "{m}"
    );
}
