//! `trellis check` and startup validation: every shipped config is valid; invalid files are
//! reported with file, field path and problem, exit non-zero, and bind nothing.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![allow(clippy::unwrap_used, unreachable_pub)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

#[test]
fn every_file_in_config_passes_check() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "json"))
        .collect();
    assert!(
        files.len() >= 2,
        "config/ must hold the example gateway config and routing table"
    );
    let (ok, out) = run(
        Command::new(BIN).arg("check").args(&files),
        b"",
        Duration::from_secs(20),
    );
    assert!(ok, "{out}");
    for f in &files {
        assert!(out.contains(&format!("{}: valid", f.display())), "{out}");
    }
}

#[test]
fn invalid_files_report_every_error_with_path_and_exit_1() {
    let dir = TestDir::new("check");
    let bad = dir.path("gateway.yaml");
    std::fs::write(
        &bad,
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {file: routes.yaml}
listeners:
- {name: tls, address: \"127.0.0.1:1\", protocol: sni}
- {name: tls2, address: \"127.0.0.1:99999\", protocol: sni}
- {name: tls3, address: \"127.0.0.1:2\", protocol: telnet}
admin: {address: \"127.0.0.1:3\"}
timeouts: {drain: forever}
",
    )
    .unwrap();
    let unknown = dir.path("routes.yaml");
    std::fs::write(&unknown, "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n- name: a\n  bakends: []\n").unwrap();
    let (ok, out) = run(
        Command::new(BIN).arg("check").arg(&bad).arg(&unknown),
        b"",
        Duration::from_secs(20),
    );
    assert!(!ok);
    let b = bad.display();
    for needle in [
        format!("{b}: listeners[1].address: expected IP:port, got \"127.0.0.1:99999\""),
        format!("{b}: listeners[2].protocol: unknown protocol \"telnet\""),
        format!("{b}: timeouts.drain: invalid duration \"forever\""),
        format!(
            "{}: routes[0].bakends: unknown field `bakends`",
            unknown.display()
        ),
    ] {
        assert!(out.contains(&needle), "missing {needle:?} in:\n{out}");
    }
    let status = Command::new(BIN)
        .arg("check")
        .arg(&bad)
        .output()
        .unwrap()
        .status;
    assert_eq!(status.code(), Some(1));
}

#[test]
fn invalid_config_or_table_binds_nothing_and_exits_non_zero() {
    let dir = TestDir::new("nobind");
    let ports = free_ports(2);
    let (port, admin) = (ports[0], ports[1]);
    let config = format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {{file: routes.yaml}}
listeners:
- {{name: tls, address: \"127.0.0.1:{port}\", protocol: sni}}
admin: {{address: \"127.0.0.1:{admin}\"}}
limits: {{maxClientHelloBytes: 1}}
"
    );
    std::fs::write(dir.path("gateway.yaml"), &config).unwrap();
    std::fs::write(
        dir.path("routes.yaml"),
        "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["gateway", "--config"])
        .arg(dir.path("gateway.yaml"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("gateway.yaml: limits.maxClientHelloBytes: 1 is out of range"),
        "{err}"
    );

    // A valid config whose routing table is invalid does not start either.
    std::fs::write(
        dir.path("gateway.yaml"),
        config.replace("limits: {maxClientHelloBytes: 1}\n", ""),
    )
    .unwrap();
    std::fs::write(dir.path("routes.yaml"), "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes: [{name: x, backends: [{address: \"1.2.3.4\"}]}]\n").unwrap();
    let out = Command::new(BIN)
        .args(["gateway", "--config"])
        .arg(dir.path("gateway.yaml"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("routes.yaml: routes[0].backends[0].address"),
        "{err}"
    );
    // Nothing was bound: both ports are still free.
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("listener port must be free");
    std::net::TcpListener::bind(("127.0.0.1", admin)).expect("admin port must be free");
}

/// Writes a gateway config whose one listener is on `port` (taken by the test, so the gateway
/// exits after its start-up checks), with `extra` YAML lines, and an empty routing table.
fn busy_gateway(dir: &TestDir, port: u16, extra: &str) {
    std::fs::write(
        dir.path("gateway.yaml"),
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: GatewayConfiguration\nroutes: {{file: routes.yaml}}\nlisteners:\n- {{name: tls, address: \"127.0.0.1:{port}\", protocol: sni}}\nadmin: {{address: \"127.0.0.1:{}\"}}\n{extra}",
            free_port()
        ),
    )
    .unwrap();
    std::fs::write(
        dir.path("routes.yaml"),
        "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\n",
    )
    .unwrap();
}

#[test]
fn gateway_that_cannot_bind_exits_non_zero() {
    let dir = TestDir::new("busy");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    busy_gateway(&dir, port, "");
    // Logged at error level; with errors filtered out of the log, said on stderr instead.
    for log in ["info", "off"] {
        let out = Command::new(BIN)
            .args(["gateway", "--config"])
            .arg(dir.path("gateway.yaml"))
            .env("TRELLIS_LOG", log)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("cannot bind listener tls on 127.0.0.1:{port}")),
            "{log}: {err}"
        );
        // Said once: one line, and the cause is not repeated after itself.
        assert_eq!(err.matches("cannot bind").count(), 1, "{log}: {err}");
        assert_eq!(err.matches("Address already in use").count(), 1, "{err}");
    }
}

#[allow(unsafe_code)] // pre_exec: setting a limit in the child before exec
#[test]
fn gateway_warns_when_open_files_cannot_cover_max_connections() {
    use std::os::unix::process::CommandExt;
    let dir = TestDir::new("nofile");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    // The listener's port is taken, so the gateway exits by itself after its start-up checks.
    for (max, warned) in [(1000, true), (50, false)] {
        busy_gateway(&dir, port, &format!("limits: {{maxConnections: {max}}}\n"));
        let mut cmd = Command::new(BIN);
        cmd.args(["gateway", "--config"])
            .arg(dir.path("gateway.yaml"))
            .env("TRELLIS_LOG", "warn");
        // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                let limit = libc::rlimit {
                    rlim_cur: 512,
                    rlim_max: 512,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("cannot bind"), "{err}");
        assert_eq!(
            err.contains("open files limit is below what limits.maxConnections needs"),
            warned,
            "maxConnections {max}: {err}"
        );
        if warned {
            assert!(
                err.contains("nofile=512") && err.contains("needed=2064"),
                "{err}"
            );
        }
    }
}

#[test]
fn daemonset_config_is_valid_and_pod_is_locked_down() {
    let manifest = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/node-daemonset.yaml"),
    )
    .unwrap();
    // The node.yaml embedded in the ConfigMap passes `trellis check`.
    let start = manifest
        .find("node.yaml: |\n")
        .expect("ConfigMap with node.yaml")
        + "node.yaml: |\n".len();
    let embedded: String = manifest[start..]
        .lines()
        .take_while(|l| l.starts_with("    ") || l.is_empty())
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect();
    let dir = TestDir::new("daemonset");
    std::fs::write(dir.path("node.yaml"), embedded).unwrap();
    let (ok, out) = run(
        Command::new(BIN).arg("check").arg(dir.path("node.yaml")),
        b"",
        Duration::from_secs(20),
    );
    assert!(ok, "{out}");
    for needle in [
        "hostNetwork: true",
        "priorityClassName: system-node-critical",
        "- operator: Exists",
        "drop: [\"ALL\"]",
        "add: [\"NET_ADMIN\", \"NET_BIND_SERVICE\"]",
        "httpGet: {path: /ready, port: 16910}",
        "httpGet: {path: /live, port: 16910}",
    ] {
        assert!(manifest.contains(needle), "DaemonSet lacks {needle:?}");
    }
}
