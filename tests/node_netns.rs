//! `trellis node` end to end, in network namespaces the tests create: a "node" namespace
//! (the node daemon and a TLS client) and a "seed" namespace (the gateway and a TLS backend)
//! joined by a veth pair; and link management on a veth pair in its own namespace. Needs
//! root and `ip`; skipped with a printed reason otherwise.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::netns::{self, Lab};
use common::*;

const DEST: &str = "outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local";
const VIP: &str = "240.168.102.23";
const SNI: &str = "kubernetes.default.svc.cluster.local";

fn skip(test: &str, tools: &[&str]) -> bool {
    match netns::skip_reason(tools) {
        Some(reason) => {
            common::skip(test, &reason);
            true
        }
        None => false,
    }
}

fn node_config(
    dir: &Path,
    name: &str,
    upstream: &str,
    interface: &str,
    admin: &str,
) -> std::path::PathBuf {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &path,
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1
kind: NodeConfiguration
listen: [\"{VIP}:443\"]
{interface}
upstream:
{upstream}
admin: {{address: \"{admin}\"}}
timeouts: {{connect: 2s}}
"
        ),
    )
    .unwrap();
    assert!(
        std::process::Command::new(BIN)
            .arg("check")
            .arg(&path)
            .status()
            .unwrap()
            .success(),
        "node config must pass check"
    );
    path
}

/// Seed: gateway (CONNECT on :8443, PROXY-destination on :8444) and an openssl TLS backend.
/// Node: resolves api.alpha.example.com to the seed.
fn seed_and_node(lab: &mut Lab) -> (std::path::PathBuf, String) {
    lab.veth(0, "10.250.66.2/24", 1, "10.250.66.1/24");
    lab.hosts(&lab.ns(0), "10.250.66.1 api.alpha.example.com\n");
    let dir = lab.dir.0.clone();
    let ck = rcgen::generate_simple_self_signed(vec![SNI.to_string()]).unwrap();
    std::fs::write(dir.join("backend.pem"), ck.cert.pem()).unwrap();
    std::fs::write(dir.join("backend.key"), ck.signing_key.serialize_pem()).unwrap();
    let seed = lab.ns(1);
    lab.spawn(
        &seed,
        &[
            "openssl",
            "s_server",
            "-accept",
            "127.0.0.1:7443",
            "-cert",
            dir.join("backend.pem").to_str().unwrap(),
            "-key",
            dir.join("backend.key").to_str().unwrap(),
            "-www",
            "-quiet",
        ],
        &dir.join("backend.log"),
    );
    std::fs::write(
        dir.join("routes.yaml"),
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n- name: shoot--dev--alpha\n  destinations: [\"{DEST}\"]\n  proxyDestinations: [\"{VIP}:443\"]\n  backends: [{{address: \"127.0.0.1:7443\"}}]\n"
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("gateway.yaml"),
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {file: routes.yaml}
listeners:
- {name: http-proxy, address: \"10.250.66.1:8443\", protocol: http-connect}
- {name: apiserver-proxy-legacy, address: \"10.250.66.1:8444\", protocol: proxy-destination}
admin: {address: \"127.0.0.1:15021\"}
",
    )
    .unwrap();
    lab.spawn_trellis(
        &seed,
        "gateway",
        &dir.join("gateway.yaml"),
        &dir.join("gateway.log"),
    );
    let up = wait_for(Duration::from_secs(20), || {
        (lab.http_get(&seed, "127.0.0.1:15021", "/ready").0 == 200).then_some(())
    });
    assert!(
        up.is_some(),
        "gateway in the seed namespace did not start:\n{}",
        std::fs::read_to_string(dir.join("gateway.log")).unwrap_or_default()
    );
    // The TLS backend must be listening too before any client is sent at it.
    let backend_up = wait_for(Duration::from_secs(20), || {
        lab.sh(&seed, &["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/7443"])
            .then_some(())
    });
    assert!(
        backend_up.is_some(),
        "openssl s_server did not start:\n{}",
        std::fs::read_to_string(dir.join("backend.log")).unwrap_or_default()
    );
    (dir.join("backend.pem"), seed)
}

/// A TLS client in the node namespace dialling the advertise address; returns openssl's output.
fn tls_client(lab: &Lab, ca: &Path) -> String {
    let out = lab
        .exec(&lab.ns(0), &["sh", "-c", &format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | timeout 20 openssl s_client -ign_eof -connect {VIP}:443 -servername {SNI} -CAfile {}", ca.display())])
        .output()
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn wait_ready(lab: &Lab, admin: &str, log: &Path) {
    let ready = wait_for(Duration::from_secs(20), || {
        (lab.http_get(&lab.ns(0), admin, "/ready").0 == 200).then_some(())
    });
    assert!(
        ready.is_some(),
        "node not ready:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

#[test]
fn node_forwards_to_gateway_in_both_modes_needs_root_netns() {
    if skip(
        "node_forwards_to_gateway_in_both_modes_needs_root_netns",
        &["openssl", "curl"],
    ) {
        return;
    }
    let mut lab = Lab::new(&["node", "seed"]);
    let (ca, seed) = seed_and_node(&mut lab);
    let dir = lab.dir.0.clone();
    let node_ns = lab.ns(0);
    let admin = "127.0.0.1:16910";
    let iface = format!("interface: {{name: apiserver-proxy, address: {VIP}}}");

    for (mode, upstream) in [
        (
            "http-connect",
            format!(
                "  address: \"api.alpha.example.com.:8443\"\n  protocol: http-connect\n  destination: \"{DEST}\""
            ),
        ),
        (
            "proxy-v2",
            "  address: \"api.alpha.example.com:8444\"\n  protocol: proxy-v2\n  ipFamily: v4"
                .to_string(),
        ),
    ] {
        let config = node_config(&dir, mode, &upstream, &iface, admin);
        let log = dir.join(format!("node-{mode}.log"));
        let idx = lab.spawn_trellis(&node_ns, "node", &config, &log);
        wait_ready(&lab, admin, &log);
        let out = tls_client(&lab, &ca);
        assert!(
            out.contains("Verify return code: 0 (ok)"),
            "{mode}: the client must see the backend's certificate:\n{out}\nnode:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        assert!(out.contains("HTTP/1.0 200 ok"), "{mode}: {out}");
        let m = lab.http_get(&node_ns, admin, "/metrics").1;
        assert_eq!(
            metric_in(&m, "trellis_route_connections_total{route=\"upstream\"}"),
            1.0,
            "{m}"
        );
        assert_eq!(
            metric_in(
                &m,
                "trellis_downstream_connections_total{listener=\"apiserver-proxy\",outcome=\"routed\"}"
            ),
            1.0,
            "{m}"
        );
        let gm = lab.http_get(&seed, "127.0.0.1:15021", "/metrics").1;
        let listener = if mode == "proxy-v2" {
            "apiserver-proxy-legacy"
        } else {
            "http-proxy"
        };
        assert_eq!(
            metric_in(
                &gm,
                &format!(
                    "trellis_downstream_connections_total{{listener=\"{listener}\",outcome=\"routed\"}}"
                )
            ),
            1.0,
            "{gm}"
        );
        let mut child = lab.children.remove(idx);
        let _ = child.kill();
        let _ = child.wait();
    }
    // In proxy-v2 mode the gateway logs the client's own address (the PROXY source), not the
    // node's, and the destination the client dialled.
    // Access lines are written in batches, up to 100 ms after the connection ended.
    let gw_log = || std::fs::read_to_string(dir.join("gateway.log")).unwrap();
    let line = wait_for(Duration::from_secs(5), || {
        gw_log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|l| {
                l["listener"] == "apiserver-proxy-legacy" && l["route"] == "shoot--dev--alpha"
            })
    })
    .unwrap_or_else(|| panic!("{}", gw_log()));
    assert!(
        line["client"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{VIP}:")),
        "{line}"
    );
    assert!(
        line["peer"].as_str().unwrap().starts_with("10.250.66.2:"),
        "{line}"
    );
    assert_eq!(line["target_name"], format!("{VIP}:443"));

    // Gateway unreachable: nothing listens on :9999. The client is closed promptly and the
    // failure counted; readiness still reflects only local state.
    let upstream = format!(
        "  address: \"api.alpha.example.com:9999\"\n  protocol: http-connect\n  destination: \"{DEST}\""
    );
    let config = node_config(&dir, "unreachable", &upstream, &iface, admin);
    let log = dir.join("node-unreachable.log");
    lab.spawn_trellis(&node_ns, "node", &config, &log);
    wait_ready(&lab, admin, &log);
    let start = std::time::Instant::now();
    let out = tls_client(&lab, &ca);
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "closed promptly, not after a hang"
    );
    assert!(out.contains("no peer certificate available"), "{out}");
    let m = lab.http_get(&node_ns, admin, "/metrics").1;
    assert_eq!(
        metric_in(
            &m,
            "trellis_upstream_connect_failures_total{route=\"upstream\",reason=\"refused\"}"
        ),
        1.0,
        "{m}"
    );
    assert_eq!(lab.http_get(&node_ns, admin, "/ready").0, 200);
}

/// Addresses (CIDR, scope) per link in `ns`, from `ip -j addr`.
fn addresses(lab: &Lab, ns: &str, ip: &str) -> Vec<(String, String, String)> {
    let json: serde_json::Value =
        serde_json::from_str(&lab.output(ns, &["ip", "-j", "addr", "show"])).unwrap_or_default();
    let mut out = Vec::new();
    for link in json.as_array().into_iter().flatten() {
        for a in link["addr_info"].as_array().into_iter().flatten() {
            if a["local"] == ip {
                out.push((
                    link["ifname"].as_str().unwrap_or("").to_string(),
                    format!("{}/{}", ip, a["prefixlen"]),
                    a["scope"].as_str().unwrap_or("").to_string(),
                ));
            }
        }
    }
    out
}

#[test]
fn link_management_on_veth_needs_root_netns() {
    if skip("link_management_on_veth_needs_root_netns", &["curl"]) {
        return;
    }
    let mut lab = Lab::new(&["links"]);
    let ns = lab.ns(0);
    let dir = lab.dir.0.clone();
    let ip = "240.1.2.3";
    assert!(lab.sh(
        &ns,
        &[
            "ip", "link", "add", "tla", "type", "veth", "peer", "name", "tlb"
        ]
    ));
    // Someone else already has the address: it must move to our link.
    assert!(lab.sh(
        &ns,
        &["ip", "addr", "add", &format!("{ip}/24"), "dev", "tlb"]
    ));
    let admin = "127.0.0.1:16911";
    // A long check interval: restoring the address below must come from netlink events.
    let upstream = format!("  address: \"127.0.0.1:1\"\n  destination: \"{DEST}\"");
    let config = dir.join("links.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: NodeConfiguration\nlisten: [\"{ip}:443\"]\ninterface: {{name: tla, address: {ip}, checkInterval: 1h}}\nupstream:\n{upstream}\nadmin: {{address: \"{admin}\"}}\n"
        ),
    )
    .unwrap();
    let log = dir.join("node.log");
    let idx = lab.spawn_trellis(&ns, "node", &config, &log);
    wait_ready(&lab, admin, &log);
    let want = vec![("tla".to_string(), format!("{ip}/32"), "global".to_string())];
    let placed = wait_for(Duration::from_secs(10), || {
        (addresses(&lab, &ns, ip) == want).then_some(())
    });
    assert!(
        placed.is_some(),
        "{:?}\n{}",
        addresses(&lab, &ns, ip),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert!(
        lab.output(&ns, &["ip", "-j", "link", "show", "tla"])
            .contains("\"UP\""),
        "link brought up"
    );

    // Someone deletes it: restored from the netlink event.
    assert!(lab.sh(
        &ns,
        &["ip", "addr", "del", &format!("{ip}/32"), "dev", "tla"]
    ));
    let restored = wait_for(Duration::from_secs(10), || {
        (addresses(&lab, &ns, ip) == want).then_some(())
    });
    assert!(restored.is_some(), "{:?}", addresses(&lab, &ns, ip));
    // Someone adds it elsewhere: removed there again.
    assert!(lab.sh(
        &ns,
        &["ip", "addr", "add", &format!("{ip}/32"), "dev", "lo"]
    ));
    let moved = wait_for(Duration::from_secs(10), || {
        (addresses(&lab, &ns, ip) == want).then_some(())
    });
    assert!(moved.is_some(), "{:?}", addresses(&lab, &ns, ip));

    // Stop, then --cleanup removes it.
    let mut child = lab.children.remove(idx);
    let _ = child.kill();
    let _ = child.wait();
    let out = lab
        .exec(
            &ns,
            &[
                BIN,
                "node",
                "--config",
                config.to_str().unwrap(),
                "--cleanup",
            ],
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(addresses(&lab, &ns, ip), vec![]);

    // A missing link is created as a dummy, or (no dummy driver here) the address goes to lo
    // and the log says so.
    let config2 = dir.join("dummy.yaml");
    std::fs::write(
        &config2,
        std::fs::read_to_string(&config)
            .unwrap()
            .replace("name: tla", "name: apiserver-proxy"),
    )
    .unwrap();
    let log2 = dir.join("node2.log");
    lab.spawn_trellis(&ns, "node", &config2, &log2);
    wait_ready(&lab, admin, &log2);
    let got = addresses(&lab, &ns, ip);
    let logs = std::fs::read_to_string(&log2).unwrap_or_default();
    let dummy = vec![(
        "apiserver-proxy".to_string(),
        format!("{ip}/32"),
        "global".to_string(),
    )];
    let fallback = vec![("lo".to_string(), format!("{ip}/32"), "global".to_string())];
    assert!(
        got == dummy || (got == fallback && logs.contains("cannot create a dummy link")),
        "{got:?}\n{logs}"
    );
}

/// Without `CAP_NET_ADMIN` the node cannot put its address on a link: it says which
/// capability it lacks and stays not ready (`/ready` 503) while listening, instead of
/// claiming to be ready.
#[test]
fn node_without_net_admin_names_the_capability_and_stays_unready_needs_root_netns() {
    let test = "node_without_net_admin_names_the_capability_and_stays_unready_needs_root_netns";
    if skip(test, &["curl", "setpriv"]) {
        return;
    }
    let mut lab = Lab::new(&["nocap"]);
    let ns = lab.ns(0);
    let dir = lab.dir.0.clone();
    let ip = "240.1.2.4";
    let admin = "127.0.0.1:16912";
    let config = dir.join("nocap.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: NodeConfiguration\nlisten: [\"{ip}:443\"]\ninterface: {{name: apiserver-proxy, address: {ip}}}\nupstream:\n  address: \"127.0.0.1:1\"\n  destination: \"{DEST}\"\nadmin: {{address: \"{admin}\"}}\n"
        ),
    )
    .unwrap();
    let log = dir.join("node.log");
    let config = config.to_str().unwrap();
    lab.spawn(
        &ns,
        &[
            "setpriv",
            "--inh-caps=-all",
            "--bounding-set=-net_admin",
            "--",
            BIN,
            "--log-format",
            "json",
            "node",
            "--config",
            config,
        ],
        &log,
    );
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();
    let said = wait_for(Duration::from_secs(20), || {
        logs()
            .lines()
            .find(|l| l.contains("\"level\":\"ERROR\"") && l.contains("CAP_NET_ADMIN"))
            .map(str::to_owned)
    });
    assert!(
        said.is_some(),
        "the missing capability is named:\n{}",
        logs()
    );
    // Serving its admin endpoint, but not ready, and it stays so.
    for _ in 0..5 {
        assert_eq!(lab.http_get(&ns, admin, "/ready").0, 503, "{}", logs());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(addresses(&lab, &ns, ip), vec![]);
    assert!(!logs().contains("\"node ready\""), "{}", logs());
}
