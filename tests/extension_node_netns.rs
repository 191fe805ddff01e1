//! The `apiserver-proxy` DaemonSet as the `trellis-node` webhook returns it, run as written
//! in network namespaces the test creates: the `trellis-node` container's command line from
//! the JSON (the binary and the config path mapped to this build and a temp file with the
//! rendered ConfigMap's `node.yaml`) in a "node" namespace whose hosts file sends the
//! shoot's internal API name to a "seed" namespace, where a trellis gateway's CONNECT
//! listener routes the rendered destination to a kube-apiserver stand-in (openssl
//! s_server). A TLS client dialling the advertise address `:443` for
//! `kubernetes.default.svc.cluster.local` must get the stand-in's certificate, and the
//! container's probes must answer. Needs root, `ip`, `openssl` and `curl`; skipped with a
//! printed reason otherwise.
#![cfg(feature = "extension")]
#![expect(
    clippy::unwrap_used,
    reason = "the shared helpers of tests/common fail loudly on what they did not expect"
)]

mod common;
mod extension_common;

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use common::netns::{self, Lab};
use common::{BIN, wait_for};
use serde_json::Value;
use trellis::extension::mutate::{self, apiserver_proxy as ap};
use trellis::extension::role::Target;

const SNI: &str = "kubernetes.default.svc.cluster.local";
const UPSTREAM_HOST: &str = "api.alpha.dev.internal.example.com";

/// The container's command line, runnable here: the image's binary is this build's, the
/// mounted config file is `config`; every other argument as the JSON has it.
fn command_line(container: &Value, config: &Path) -> Vec<String> {
    let command: Vec<String> = container["command"]
        .as_array()
        .expect("command")
        .iter()
        .map(|a| a.as_str().expect("text").to_owned())
        .collect();
    assert_eq!(command[0], ap::BINARY, "the image's binary");
    let at = command
        .iter()
        .position(|a| a == "--config")
        .expect("--config");
    assert_eq!(command[at + 1], ap::CONFIG_PATH);
    let mut out = command.clone();
    out[0] = BIN.to_owned();
    out[at + 1] = config.to_str().expect("utf-8 path").to_owned();
    out
}

#[test]
fn mutated_daemonset_ipv4_serves_kubernetes_default_needs_root_netns() {
    run_as_written(
        "mutated_daemonset_ipv4_serves_kubernetes_default_needs_root_netns",
        "apiserver-proxy-ipv4",
    );
}

/// The IPv6 advertise address Gardener writes (`64:ff9b:1::` + the seed's IPv4 ClusterIP),
/// with the gateway still reached over IPv4 (the shoot's `ipFamilies` is `[IPv4]` here).
#[test]
fn mutated_daemonset_ipv6_serves_kubernetes_default_needs_root_netns() {
    run_as_written(
        "mutated_daemonset_ipv6_serves_kubernetes_default_needs_root_netns",
        "apiserver-proxy-ipv6",
    );
}

fn run_as_written(test: &str, golden: &str) {
    if let Some(reason) = netns::skip_reason(&["openssl", "curl"]) {
        common::skip(test, &reason);
        return;
    }
    // The webhook's answer for Gardener's DaemonSet (and the golden file agrees).
    let r = extension_common::rendered();
    let shoot = extension_common::enabled_shoot(&r);
    let input =
        extension_common::json(&format!("{golden}.review.json"))["request"]["object"].clone();
    let d = mutate::review(Target::ApiserverProxy, Some(&shoot), &input);
    let mut pod = input.clone();
    json_patch::patch(&mut pod, d.patch.as_ref().expect("a patch")).expect("applies");
    assert_eq!(
        pod,
        extension_common::json(&format!("expected/{golden}.json"))
    );
    let spec = &pod["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"], true, "runs in the node's network");
    let container = spec["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == ap::CONTAINER)
        .expect("the trellis container");
    let command = container["command"].as_array().expect("command");
    let vip = command
        .iter()
        .position(|a| a == "--advertise-address")
        .and_then(|i| command[i + 1].as_str())
        .and_then(|a| a.parse::<IpAddr>().ok())
        .expect("the advertise address");
    let (prefix, dial) = match vip {
        IpAddr::V4(_) => (32, vip.to_string()),
        IpAddr::V6(_) => (128, format!("[{vip}]")),
    };
    let yaml = extension_common::node_yaml(&r);
    let destination = yaml
        .lines()
        .find_map(|l| l.trim().strip_prefix("destination: "))
        .map(|d| d.trim_matches('"').to_owned())
        .expect("a destination");

    let mut lab = Lab::new(&["node", "seed"]);
    let dir = lab.dir.0.clone();
    let (node_ns, seed) = (lab.ns(0), lab.ns(1));
    lab.veth(0, "10.250.67.2/24", 1, "10.250.67.1/24");
    lab.hosts(&node_ns, &format!("10.250.67.1 {UPSTREAM_HOST}\n"));

    // The seed: the kube-apiserver stand-in and a gateway relaying the CONNECT to it.
    let ck = rcgen::generate_simple_self_signed(vec![SNI.to_string()]).expect("cert");
    std::fs::write(dir.join("apiserver.pem"), ck.cert.pem()).expect("write");
    std::fs::write(dir.join("apiserver.key"), ck.signing_key.serialize_pem()).expect("write");
    let (pem, key) = (dir.join("apiserver.pem"), dir.join("apiserver.key"));
    lab.spawn(
        &seed,
        &[
            "openssl",
            "s_server",
            "-accept",
            "127.0.0.1:7443",
            "-cert",
            pem.to_str().expect("path"),
            "-key",
            key.to_str().expect("path"),
            "-www",
            "-quiet",
        ],
        &dir.join("apiserver.log"),
    );
    std::fs::write(
        dir.join("routes.yaml"),
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n- name: shoot--dev--alpha\n  destinations: [\"{destination}\"]\n  backends: [{{address: \"127.0.0.1:7443\"}}]\n"
        ),
    )
    .expect("write");
    std::fs::write(
        dir.join("gateway.yaml"),
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {file: routes.yaml}
listeners:
- {name: http-proxy, address: \"10.250.67.1:8443\", protocol: http-connect}
admin: {address: \"127.0.0.1:15021\"}
",
    )
    .expect("write");
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
        "gateway did not start:\n{}",
        std::fs::read_to_string(dir.join("gateway.log")).unwrap_or_default()
    );
    let stand_in_up = wait_for(Duration::from_secs(20), || {
        lab.sh(&seed, &["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/7443"])
            .then_some(())
    });
    assert!(stand_in_up.is_some(), "openssl s_server did not start");

    // The node: the container's command line as written.
    let config = dir.join("node.yaml");
    std::fs::write(&config, &yaml).expect("write");
    let args = command_line(container, &config);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let log = dir.join("node.log");
    lab.spawn(&node_ns, &args, &log);
    let node_log = || std::fs::read_to_string(&log).unwrap_or_default();
    for probe in ["readinessProbe", "livenessProbe"] {
        let get = &container[probe]["httpGet"];
        let addr = format!("127.0.0.1:{}", get["port"]);
        let path = get["path"].as_str().expect("path").to_owned();
        let ok = wait_for(Duration::from_secs(20), || {
            (lab.http_get(&node_ns, &addr, &path).0 == 200).then_some(())
        });
        assert!(ok.is_some(), "{probe} {path} failed:\n{}", node_log());
    }
    // On the dummy link `apiserver-proxy`, or on `lo` where the kernel has no dummy driver
    // (the node logs that fallback).
    let addrs = lab.output(&node_ns, &["ip", "-o", "addr", "show"]);
    let link = if node_log().contains("using the fallback link") {
        " lo "
    } else {
        " apiserver-proxy "
    };
    assert!(
        addrs
            .lines()
            .any(|l| l.contains(link) && l.contains(&format!(" {vip}/{prefix} "))),
        "the advertise address on the dummy link:\n{addrs}\nnode:\n{}",
        node_log()
    );

    // `kubernetes.default` traffic: TLS to the advertise address's port 443.
    let out = lab
        .exec(
            &node_ns,
            &[
                "sh",
                "-c",
                &format!(
                    "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | timeout 20 openssl s_client -ign_eof -connect {dial}:443 -servername {SNI} -CAfile {}",
                    pem.display()
                ),
            ],
        )
        .output()
        .expect("openssl s_client runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("Verify return code: 0 (ok)") && text.contains("HTTP/1.0 200 ok"),
        "the client must reach the kube-apiserver stand-in:\n{text}\nnode:\n{}\ngateway:\n{}",
        node_log(),
        std::fs::read_to_string(dir.join("gateway.log")).unwrap_or_default()
    );
}
