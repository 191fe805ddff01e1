//! Networks and field names in trellis' own files, through the real binary: a network
//! written with host bits set (`127.0.0.1/8`) is an error at its field's FILE:LINE:COL in
//! every kind that holds networks (never silently widened to `127.0.0.0/8`), also in a
//! table the gateway reloads (as the controller's tables reach it); an unknown field is
//! told the known field it is closest to, in every kind, at its position.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

/// A copy of `config/` (the files the examples name included) in a directory of its own.
fn examples(dir: &TestDir) -> PathBuf {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let path = entry.unwrap().path();
            let target = to.join(path.file_name().unwrap());
            if path.is_dir() {
                copy(&path, &target);
            } else {
                std::fs::copy(&path, &target).unwrap();
            }
        }
    }
    let config = dir.path("config");
    copy(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("config"),
        &config,
    );
    config
}

/// `trellis check FILE`: whether it passed, and what it said.
fn check(file: &Path) -> (bool, String) {
    run(
        Command::new(BIN).arg("check").arg(file),
        b"",
        Duration::from_secs(20),
    )
}

/// `text` with `from` (which it holds once) replaced by `to`.
fn edit(text: &str, from: &str, to: &str) -> String {
    assert_eq!(text.matches(from).count(), 1, "{from:?} in:\n{text}");
    text.replacen(from, to, 1)
}

/// The 1-based line and column of `needle`'s first occurrence in `text`.
fn position(text: &str, needle: &str) -> (usize, usize) {
    let at = text
        .find(needle)
        .unwrap_or_else(|| panic!("{needle:?} in:\n{text}"));
    let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    (text[..at].matches('\n').count() + 1, at - line_start + 1)
}

/// A network with host bits set in any file of any kind: `check` refuses the file at the
/// value, naming the network and the one address meant; the same file with the network
/// as meant passes. IPv4, IPv6 and IPv4-mapped forms; a bare address stays the one
/// address.
#[test]
fn a_network_with_host_bits_is_refused_at_its_field_in_every_kind() {
    let dir = TestDir::new("host-bits");
    let config = examples(&dir);
    let meant = |given: &str, network: &str, host: &str| {
        format!(
            "{given} has host bits set: did you mean {network} (or {host} for the one address)?"
        )
    };
    // (file, text replaced, by this with host bits, by this without, the bad value,
    // its path, the message).
    let cases = [
        (
            "gateway.yaml",
            "trustedSources: [\"127.0.0.0/8\"]",
            "trustedSources: [\"127.0.0.1/8\"]",
            "trustedSources: [\"127.0.0.0/8\", 127.0.0.1]",
            "\"127.0.0.1/8\"",
            "listeners[0].proxyProtocol.trustedSources[0]",
            meant("127.0.0.1/8", "127.0.0.0/8", "127.0.0.1/32"),
        ),
        (
            "agent.yaml",
            "networks: [\"127.0.0.0/8\"]",
            "networks: [\"10.250.0.0/16\", \"100.96.0.1/11\"]",
            "networks: [\"10.250.0.0/16\", \"100.96.0.0/11\", 100.96.0.1]",
            "\"100.96.0.1/11\"",
            "networks[1]",
            meant("100.96.0.1/11", "100.96.0.0/11", "100.96.0.1/32"),
        ),
        (
            "routes.yaml",
            "allowedSourceRanges: [\"127.0.0.0/8\", \"::1/128\"]",
            "allowedSourceRanges: [\"127.0.0.0/8\", \"::1/64\"]",
            "allowedSourceRanges: [\"127.0.0.0/8\", \"::/64\", \"::1\"]",
            "\"::1/64\"",
            "routes[0].allowedSourceRanges[1]",
            meant("::1/64", "::/64", "::1/128"),
        ),
        (
            "tunnel-routes.yaml",
            "allowedIPs: [\"192.168.128.5/32\", \"127.0.0.0/8\"]",
            "allowedIPs: [\"::ffff:192.168.128.5/24\", \"127.0.0.0/8\"]",
            "allowedIPs: [\"::ffff:192.168.128.5\", \"127.0.0.0/8\"]",
            "\"::ffff:192.168.128.5/24\"",
            "routes[0].tunnel.wireguard.peers[0].allowedIPs[0]",
            meant(
                "::ffff:192.168.128.5/24",
                "192.168.128.0/24",
                "192.168.128.5/32",
            ),
        ),
        (
            "tunnel-routes.yaml",
            "allowedNetworks: [\"127.0.0.0/8\"]",
            "allowedNetworks: [\"127.0.0.1/8\"]",
            "allowedNetworks: [\"127.0.0.0/8\"]",
            "\"127.0.0.1/8\"",
            "routes[0].egress.allowedNetworks[0]",
            meant("127.0.0.1/8", "127.0.0.0/8", "127.0.0.1/32"),
        ),
        (
            "egress-routes.yaml",
            "allowedNetworks: [\"127.0.0.0/8\"]",
            "allowedNetworks: [\"127.0.0.0/8\"]\n    directNetworks: [\"fd00::1:0/96\"]",
            "allowedNetworks: [\"127.0.0.0/8\"]\n    directNetworks: [\"fd00::/96\"]",
            "\"fd00::1:0/96\"",
            "routes[0].egress.directNetworks[0]",
            meant("fd00::1:0/96", "fd00::/96", "fd00::1:0/128"),
        ),
        (
            "egress-routes.yaml",
            "clientIdentities: [kube-apiserver-http-proxy]",
            "clientIdentities: [kube-apiserver-http-proxy]\n    clientSources: [10.64.1.10/24]",
            "clientIdentities: [kube-apiserver-http-proxy]\n    clientSources: [10.64.1.0/24, 10.64.2.10]",
            "10.64.1.10/24",
            "routes[0].egress.clientSources[0]",
            meant("10.64.1.10/24", "10.64.1.0/24", "10.64.1.10/32"),
        ),
        (
            "controller.yaml",
            "extraRoutes: []",
            "extraRoutes: [{name: extra, backends: [{address: \"127.0.0.1:1\"}], allowedSourceRanges: [\"10.0.0.1/8\"]}]",
            "extraRoutes: [{name: extra, backends: [{address: \"127.0.0.1:1\"}], allowedSourceRanges: [\"10.0.0.0/8\"]}]",
            "\"10.0.0.1/8\"",
            "extraRoutes[0].allowedSourceRanges[0]",
            meant("10.0.0.1/8", "10.0.0.0/8", "10.0.0.1/32"),
        ),
    ];
    for (name, from, bad, good, value, path, message) in cases {
        let file = config.join(name);
        let original = std::fs::read_to_string(&file).unwrap();
        let text = edit(&original, from, bad);
        std::fs::write(&file, &text).unwrap();
        let (ok, out) = check(&file);
        let (line, column) = position(&text, value);
        let want = format!("{}:{line}:{column}: {path}: {message}", file.display());
        assert!(
            !ok && out.contains(&want),
            "{name}: missing {want:?} in:\n{out}"
        );
        std::fs::write(&file, edit(&original, from, good)).unwrap();
        let (ok, out) = check(&file);
        assert!(ok, "{name} with {good:?}:\n{out}");
        std::fs::write(&file, &original).unwrap();
    }
}

/// A table the gateway reloads (the controller writes its tables to the file the gateway
/// watches) with a network with host bits set is rejected at the value, and the last good
/// table stays; with the network as meant, the next table is applied.
#[tokio::test(flavor = "multi_thread")]
async fn a_reloaded_table_with_host_bits_is_rejected_and_the_last_good_one_kept() {
    let backend: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let table = routes_yaml(&[R {
        name: "a",
        sni: &["a.example.com"],
        backends: &[backend],
    }]);
    let gw = Gateway::start(&table, "");
    let with = |ranges: &str| format!("{table}  allowedSourceRanges: [{ranges}]\n");
    let bad = with("\"10.0.0.0/8\", \"192.168.1.1/16\"");
    gw.write_routes(&bad);
    let rejected = wait_for(Duration::from_secs(10), || {
        lines_saying(
            &gw.logs(),
            "routing table rejected; keeping the last good table",
        )
        .pop()
    })
    .unwrap_or_else(|| panic!("{}", gw.logs()));
    let (line, column) = position(&bad, "\"192.168.1.1/16\"");
    let want = format!(
        "routes.yaml:{line}:{column}: routes[0].allowedSourceRanges[1]: 192.168.1.1/16 has host bits set: did you mean 192.168.0.0/16 (or 192.168.1.1/32 for the one address)?"
    );
    let error = rejected["error"].as_str().unwrap();
    assert!(error.contains(&want), "{want:?} in {error}");
    assert_eq!(rejected["generation"], 1, "the table kept: {rejected}");
    assert!(
        lines_saying(&gw.logs(), "routing table applied")
            .iter()
            .all(|l| l["generation"] == 1),
        "{}",
        gw.logs()
    );
    gw.write_routes(&with("\"10.0.0.0/8\", \"192.168.0.0/16\""));
    wait_for(Duration::from_secs(10), || {
        lines_saying(&gw.logs(), "routing table applied")
            .into_iter()
            .find(|l| l["generation"] == 2)
    })
    .unwrap_or_else(|| panic!("{}", gw.logs()));
}

/// An unknown field in any kind is told the known field of its structure it is closest
/// to, at the field's position: a typo, a swap of two letters, a difference in case, at the
/// top or nested; a field close to no known one gets no suggestion.
#[test]
fn an_unknown_field_is_told_the_closest_known_one_in_every_kind() {
    let dir = TestDir::new("did-you-mean");
    let config = examples(&dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&config)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut kinds = std::collections::BTreeSet::new();
    // At the top of every file: a swap of two letters.
    for file in &files {
        let original = std::fs::read_to_string(file).unwrap();
        let kind = original
            .lines()
            .find_map(|l| l.strip_prefix("kind: "))
            .unwrap()
            .to_owned();
        kinds.insert(kind);
        let text = format!("{original}apiVersoin: x\nzzzzzz: 1\n");
        std::fs::write(file, &text).unwrap();
        let (ok, out) = check(file);
        std::fs::write(file, &original).unwrap();
        let lines = original.lines().count();
        let f = file.display();
        for want in [
            format!(
                "{f}:{}:1: apiVersoin: unknown field `apiVersoin`: did you mean `apiVersion`?",
                lines + 1
            ),
            format!("{f}:{}:1: zzzzzz: unknown field `zzzzzz`\n", lines + 2),
        ] {
            assert!(!ok && out.contains(&want), "missing {want:?} in:\n{out}");
        }
    }
    assert_eq!(
        kinds.into_iter().collect::<Vec<_>>(),
        [
            "AgentConfiguration",
            "ControllerConfiguration",
            "ExtensionConfiguration",
            "GatewayConfiguration",
            "NodeConfiguration",
            "RoutingTable"
        ],
        "every kind"
    );
    // Nested: (file, text replaced, by this, the unknown field's path, the suggestion).
    let cases = [
        (
            "egress-routes.yaml",
            "allowedNetworks:",
            "allowedNetwork:",
            "routes[0].egress.allowedNetwork",
            "allowedNetworks",
        ),
        (
            "gateway.yaml",
            "trustedSources:",
            "TrustedSources:",
            "listeners[0].proxyProtocol.TrustedSources",
            "trustedSources",
        ),
        (
            "agent.yaml",
            "persistentKeepalive:",
            "persistentKeepAlive:",
            "wireguard.gateway.persistentKeepAlive",
            "persistentKeepalive",
        ),
        (
            "controller.yaml",
            "connectLegacy:",
            "conectLegacy:",
            "fallback.conectLegacy",
            "connectLegacy",
        ),
        (
            "node.yaml",
            "checkInterval:",
            "checkIntervall:",
            "interface.checkIntervall",
            "checkInterval",
        ),
        (
            "extension.yaml",
            "renewInterval:",
            "renewInterwal:",
            "heartbeat.renewInterwal",
            "renewInterval",
        ),
        (
            "routes.yaml",
            "  timeouts: {connect: 2s, idle: 1h}",
            "  timeouts: {connect: 2s, idel: 1h}",
            "routes[0].timeouts.idel",
            "idle",
        ),
    ];
    for (name, from, to, path, like) in cases {
        let file = config.join(name);
        let original = std::fs::read_to_string(&file).unwrap();
        let text = edit(&original, from, to);
        std::fs::write(&file, &text).unwrap();
        let (ok, out) = check(&file);
        std::fs::write(&file, &original).unwrap();
        let field = path.rsplit('.').next().unwrap();
        let (line, column) = position(&text, &format!("{field}:"));
        let want = format!(
            "{}:{line}:{column}: {path}: unknown field `{field}`: did you mean `{like}`?",
            file.display()
        );
        assert!(!ok && out.contains(&want), "missing {want:?} in:\n{out}");
    }
    // JSON too, at the field's position.
    let file = config.join("table.json");
    std::fs::write(
        &file,
        "{\"apiVersion\": \"trellis.gardener.cloud/v1alpha1\", \"kind\": \"RoutingTable\", \"routs\": []}",
    )
    .unwrap();
    let (ok, out) = check(&file);
    let (line, column) = position(&std::fs::read_to_string(&file).unwrap(), "\"routs\"");
    let want = format!(
        "{}:{line}:{column}: routs: unknown field `routs`: did you mean `routes`?",
        file.display()
    );
    assert!(!ok && out.contains(&want), "missing {want:?} in:\n{out}");
}
