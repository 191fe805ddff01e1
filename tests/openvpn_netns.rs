//! Real OpenVPN 2.6 tunnels through trellis' `http-connect` listeners, configured the way
//! Gardener's vpn-shoot is (`http-proxy` + `CUSTOM-HEADER X-Gardener-Destination`, and the
//! legacy `Reversed-VPN` header), in two network namespaces this test creates: "seed" (trellis
//! and the OpenVPN servers) and "shoot" (the OpenVPN clients), joined by a veth pair. A ping
//! crosses each tunnel; the routing table is rewritten while the tunnels are up and OpenVPN's
//! logs show no restart. Needs root, `ip`, `openvpn` and /dev/net/tun; skipped otherwise.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::netns::{self, Lab};
use common::*;

const VPN_DEST: &str = "outbound|1194||vpn-seed-server.shoot--dev--alpha.svc.cluster.local";
const VPN_DEST_1: &str = "outbound|1194||vpn-seed-server-1.shoot--dev--alpha.svc.cluster.local";

fn setup() -> Option<Lab> {
    let mut reason = netns::skip_reason(&["openvpn", "curl", "ping"]);
    if reason.is_none() && !Path::new("/dev/net/tun").exists() {
        reason = Some("no /dev/net/tun".into());
    }
    if let Some(reason) = reason {
        common::skip("openvpn_tunnels_through_gateway_needs_root_netns", &reason);
        return None;
    }
    let lab = Lab::new(&["seed", "shoot"]);
    lab.veth(0, "10.250.77.1/24", 1, "10.250.77.2/24");
    // The shoot resolves the seed's API name, as in Gardener (`remote api.<domain>`).
    lab.hosts(&lab.ns(1), "10.250.77.1 api.alpha.example.com\n");
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
    lab.spawn_trellis(&lab.ns(0), "gateway", &dir.join("gateway.yaml"), &gw_log);

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
        let seed = lab.ns(0);
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
        let shoot = lab.ns(1);
        // Give the servers and trellis a moment; the clients retry anyway.
        std::thread::sleep(Duration::from_millis(300));
        lab.spawn(
            &shoot,
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
            &tunnels.last().unwrap().1,
        );
    }

    let ping =
        |lab: &Lab, target: &str| lab.sh(&lab.ns(1), &["ping", "-c", "1", "-W", "1", target]);
    let metrics = |lab: &Lab| lab.http_get(&lab.ns(0), admin, "/metrics").1;
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
    let m = metrics(&lab);
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
                &metrics(&lab),
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
    let m = metrics(&lab);
    assert_eq!(
        metric_in(
            &m,
            "trellis_route_connections_total{route=\"shoot--dev--alpha--vpn-seed-server\"}"
        ),
        1.0,
        "{m}"
    );
}
