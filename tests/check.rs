//! `trellis check` and startup validation: every shipped config is valid; invalid files are
//! reported with file, field path and problem, exit non-zero, and bind nothing.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

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
        format!("{b}:6:25: listeners[1].address: expected IP:port, got \"127.0.0.1:99999\""),
        format!("{b}:7:50: listeners[2].protocol: unknown protocol \"telnet\""),
        format!("{b}:9:19: timeouts.drain: invalid duration \"forever\""),
        format!(
            "{}:5:3: routes[0].bakends: unknown field `bakends`",
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
        err.contains("gateway.yaml:7:31: limits.maxClientHelloBytes: 1 is out of range"),
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
        err.contains("routes.yaml:3:41: routes[0].backends[0].address"),
        "{err}"
    );
    // Nothing was bound: both ports are still free.
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("listener port must be free");
    std::net::TcpListener::bind(("127.0.0.1", admin)).expect("admin port must be free");
}

/// A listener that accepts PROXY headers from every peer would let any client pick its own
/// source address (past `allowedSourceRanges`, into `sendProxyProtocol`): without
/// `trustedSources` that is an error in `check` and at start, saying what to write; with
/// them the same listener passes.
#[test]
fn a_proxy_header_mode_without_trusted_sources_is_refused_by_check_and_at_start() {
    let dir = TestDir::new("proxytrust");
    let ports = free_ports(2);
    let (port, admin) = (ports[0], ports[1]);
    let config = |proxy: &str| {
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {{file: routes.yaml}}
listeners:
- {{name: tls, address: \"127.0.0.1:{port}\", protocol: sni, proxyProtocol: {proxy}}}
admin: {{address: \"127.0.0.1:{admin}\"}}
"
        )
    };
    std::fs::write(
        dir.path("routes.yaml"),
        "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\n",
    )
    .unwrap();
    let file = dir.path("gateway.yaml");
    let want = "gateway.yaml:5:73: listeners[0].proxyProtocol.trustedSources: required with a PROXY header mode: list the networks of the load balancers that send the header";
    for mode in ["optional", "required"] {
        std::fs::write(&file, config(&format!("{{mode: {mode}}}"))).unwrap();
        let (ok, out) = run(
            Command::new(BIN).arg("check").arg(&file),
            b"",
            Duration::from_secs(20),
        );
        assert!(!ok && out.contains(want), "{mode}: {out}");
        let started = Command::new(BIN)
            .args(["gateway", "--config"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(!started.status.success(), "{mode}: the gateway started");
        let err = String::from_utf8_lossy(&started.stderr);
        assert!(err.contains(want), "{mode}: {err}");
    }
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("listener port must be free");
    std::fs::write(
        &file,
        config("{mode: required, trustedSources: [\"10.0.0.0/8\"]}"),
    )
    .unwrap();
    let (ok, out) = run(
        Command::new(BIN).arg("check").arg(&file),
        b"",
        Duration::from_secs(20),
    );
    assert!(ok, "{out}");
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

#[expect(
    unsafe_code,
    reason = "pre_exec: setting a limit in the child before exec"
)]
#[test]
fn gateway_lowers_max_connections_to_what_open_files_hold() {
    use std::os::unix::process::CommandExt;
    let dir = TestDir::new("nofile");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    // The listener's port is taken, so the gateway exits by itself after its start-up checks.
    for (max, warned) in [(1000, true), (50, false)] {
        busy_gateway(
            &dir,
            port,
            &format!("limits: {{maxConnections: {max}}}\nworkers: 1\n"),
        );
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
            err.contains("limits.maxConnections lowered to what the open files limit holds"),
            warned,
            "maxConnections {max}: {err}"
        );
        if warned {
            // One worker with one listener.
            let fixed = trellis::net::fds::Budget::fixed(1, 1);
            let cap = trellis::net::fds::Budget::plan(512, 1000, fixed).max_connections;
            assert!(
                err.contains("nofile=512")
                    && err.contains("requested=1000")
                    && err.contains(&format!("max_connections={cap}")),
                "{err}"
            );
        }
    }
}

const HEAD: &str = "apiVersion: trellis.gardener.cloud/v1alpha1\n";

/// `trellis ARGS`: its exit code and what it printed on stderr.
fn stderr_of(args: &[&std::ffi::OsStr]) -> (Option<i32>, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `trellis check FILE`, which must fail: the lines it printed on stderr.
fn check_errors(file: &std::path::Path) -> Vec<String> {
    let (code, err) = stderr_of(&["check".as_ref(), file.as_os_str()]);
    assert_eq!(code, Some(1), "{err}");
    err.lines().map(str::to_owned).collect()
}

/// An unknown field does not stop the file being read: it is reported with every
/// validation problem, in YAML and in JSON. The duplicate server name is found although
/// other routes are invalid, and an unknown field at the top is found too.
#[test]
fn a_table_with_three_kinds_of_problems_reports_all_three() {
    let dir = TestDir::new("three");
    let yaml = format!(
        "{HEAD}kind: RoutingTable
routes:
- name: a
  sni: [x.example.com]
  backends: [{{address: \"10.0.0.1:443\", weight: 2}}]
- name: b
  backends: [{{address: nope}}]
- name: c
  sni: [X.example.com]
  backends: [{{address: \"10.0.0.2:443\"}}]
"
    );
    let as_json: serde_json::Value = serde_saphyr::from_str(&yaml).unwrap();
    for (name, text, [weight, address, sni]) in [
        ("routes.yaml", yaml.clone(), ["6:40", "8:24", "9:3"]),
        (
            "routes.json",
            as_json.to_string(),
            ["1:120", "1:193", "1:214"],
        ),
    ] {
        let file = dir.path(name);
        std::fs::write(&file, &text).unwrap();
        let f = file.display();
        let mut expected = vec![
            format!("{f}:{weight}: routes[0].backends[0].weight: unknown field `weight`"),
            format!("{f}:{address}: routes[1].backends[0].address: expected HOST:PORT: \"nope\""),
            format!(
                "{f}:{sni}: routes[2]: sni \"x.example.com\" of route \"c\" is already claimed by route \"a\" (routes[0])"
            ),
        ];
        let mut got = check_errors(&file);
        got.sort();
        expected.sort();
        assert_eq!(got, expected, "{text}");
    }
    // Unknown fields of a gateway and a node configuration come with their other errors.
    let gateway = dir.path("gateway.yaml");
    std::fs::write(&gateway, format!("{HEAD}kind: GatewayConfiguration\nroutes: {{file: routes.yaml}}\nlisteners:\n- {{name: tls, address: nope, protocol: sni, bogus: {{}}}}\nadmin: {{address: \"127.0.0.1:1\"}}\nlimit: {{}}\n")).unwrap();
    let g = gateway.display();
    let mut got = check_errors(&gateway);
    got.sort();
    assert_eq!(
        got,
        [
            format!("{g}:5:24: listeners[0].address: expected IP:port, got \"nope\""),
            format!("{g}:5:45: listeners[0].bogus: unknown field `bogus`"),
            format!("{g}:7:1: limit: unknown field `limit`: did you mean `limits`?"),
        ]
    );
    let node = dir.path("node.yaml");
    std::fs::write(&node, format!("{HEAD}kind: NodeConfiguration\nlisten: [nope]\nupstream: {{address: \"h:1\", destination: d, destinationHeaders: X}}\nadmin: {{address: \"127.0.0.1:1\"}}\n")).unwrap();
    let n = node.display();
    assert_eq!(
        check_errors(&node),
        [
            format!("{n}:3:10: listen[0]: expected IP:port, got \"nope\""),
            format!(
                "{n}:4:44: upstream.destinationHeaders: unknown field `destinationHeaders`: did you mean `destinationHeader`?"
            ),
        ]
    );
}

/// A process given a file of another kind says which kind it needs, before anything else.
#[test]
fn a_file_of_the_wrong_kind_says_which_kind_is_needed() {
    let dir = TestDir::new("kind");
    let routes = dir.path("routes.yaml");
    std::fs::write(&routes, format!("{HEAD}kind: RoutingTable\nroutes: []\n")).unwrap();
    let gateway = dir.path("gateway.yaml");
    std::fs::write(
        &gateway,
        format!(
            "{HEAD}kind: GatewayConfiguration\nroutes: {{file: gateway.yaml}}\nlisteners: [{{name: tls, address: \"127.0.0.1:{}\", protocol: sni}}]\nadmin: {{address: \"127.0.0.1:{}\"}}\n",
            free_port(),
            free_port()
        ),
    )
    .unwrap();
    for (role, file, expected) in [
        (
            "gateway",
            &routes,
            format!(
                "{}: kind RoutingTable, but 'trellis gateway' needs a GatewayConfiguration\n",
                routes.display()
            ),
        ),
        (
            "node",
            &gateway,
            format!(
                "{}: kind GatewayConfiguration, but 'trellis node' needs a NodeConfiguration\n",
                gateway.display()
            ),
        ),
        // The gateway's own file as its routing table.
        (
            "gateway",
            &gateway,
            format!(
                "{}: kind GatewayConfiguration, but routes.file of 'trellis gateway' needs a RoutingTable\n",
                gateway.display()
            ),
        ),
    ] {
        let (code, err) = stderr_of(&[role.as_ref(), "--config".as_ref(), file.as_os_str()]);
        assert_ne!(code, Some(0), "{err}");
        assert!(err.ends_with(&expected), "{role}: {err}");
    }
}

/// Parse and type errors are one line each: file, line, column, field path and a message
/// for users: no source snippet, no Rust type, no advice about a library's API.
#[test]
fn parse_errors_are_one_line_with_line_and_column() {
    let dir = TestDir::new("oneline");
    let gateway = |limits: &str| {
        format!(
            "{HEAD}kind: GatewayConfiguration\nroutes: {{file: r.yaml}}\nlisteners: [{{name: tls, address: \"127.0.0.1:1\", protocol: sni}}]\nadmin: {{address: \"127.0.0.1:2\"}}\nlimits: {limits}\n"
        )
    };
    let json = "{\"apiVersion\": \"trellis.gardener.cloud/v1alpha1\", \"kind\": \"GatewayConfiguration\", \"routes\": {\"file\": \"r.yaml\"}, \"listeners\": [{\"name\": \"tls\", \"address\": \"127.0.0.1:1\", \"protocol\": \"sni\"}], \"admin\": {\"address\": \"127.0.0.1:2\"},\n\"limits\": {\"maxConnections\": \"lots\"}}";
    for (name, text, expected) in [
        (
            "type.yaml",
            gateway("{maxConnections: lots}"),
            "6:10: limits.maxConnections: invalid type: string \"lots\", expected a whole number",
        ),
        (
            "negative.yaml",
            gateway("{maxHeaderBytes: -1}"),
            "6:10: limits.maxHeaderBytes: invalid value: integer `-1`, expected a whole number from 0",
        ),
        (
            "type.json",
            json.to_string(),
            "2:35: limits.maxConnections: invalid type: string \"lots\", expected a whole number",
        ),
        (
            "shape.yaml",
            gateway("{maxConnections: 1}\ntimeouts: {connect: [5s]}"),
            "7:21: timeouts.connect: expected a string",
        ),
        (
            "syntax.yaml",
            format!("{HEAD}kind: RoutingTable\nroutes:\n- name: a\n  sni: [a, b\n"),
            "5:8: routes[0].sni: unclosed bracket '['",
        ),
        (
            "syntax.json",
            "{\"kind\": \"RoutingTable\",\n \"routes\": [}".to_string(),
            "2:13: routes[0]: expected value (a file that starts with '{' is read as JSON)",
        ),
        (
            "documents.yaml",
            format!("{HEAD}kind: RoutingTable\n---\n{HEAD}kind: RoutingTable\n---\nkind: x\n"),
            "4:1: the file holds 3 YAML documents; trellis reads one per file",
        ),
    ] {
        let file = dir.path(name);
        std::fs::write(&file, &text).unwrap();
        assert_eq!(
            check_errors(&file),
            [format!("{}:{expected}", file.display())],
            "{text}"
        );
    }
}

/// `check` on a gateway configuration loads its routing table from `routes.file` resolved as
/// the gateway resolves it (relative to the configuration's directory, whatever the working
/// directory), refuses a missing or invalid one as the gateway does, and names a
/// `defaultRoute` that is not in it.
#[test]
fn check_loads_the_gateways_routing_table_as_the_gateway_does() {
    let dir = TestDir::new("checkroutes");
    std::fs::create_dir_all(dir.path("conf")).unwrap();
    let gateway = dir.path("conf/gateway.yaml");
    std::fs::write(
        &gateway,
        format!(
            "{HEAD}kind: GatewayConfiguration\nroutes: {{file: routes.yaml}}\nlisteners:\n- {{name: tls, address: \"127.0.0.1:{}\", protocol: sni}}\n- {{name: other, address: \"127.0.0.1:{}\", protocol: sni, defaultRoute: fallback}}\nadmin: {{address: \"127.0.0.1:{}\"}}\n",
            free_port(),
            free_port(),
            free_port()
        ),
    )
    .unwrap();
    let table = |names: &[&str]| {
        let mut t = format!("{HEAD}kind: RoutingTable\nroutes:\n");
        for n in names {
            t += &format!("- {{name: {n}, backends: [{{address: \"127.0.0.1:9\"}}]}}\n");
        }
        t
    };
    // A valid table in the working directory is not the gateway's.
    std::fs::write(dir.path("routes.yaml"), table(&["fallback"])).unwrap();
    let check = || {
        let out = Command::new(BIN)
            .arg("check")
            .arg(&gateway)
            .current_dir(&dir.0)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.code(), text)
    };
    let routes = dir.path("conf/routes.yaml");
    let (code, out) = check();
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(&format!(
            "{}:3:16: routes.file: cannot read the routing table {}: No such file",
            gateway.display(),
            routes.display()
        )),
        "{out}"
    );
    // The gateway refuses it too, naming the same file.
    let started = Command::new(BIN)
        .args(["gateway", "--config"])
        .arg(&gateway)
        .current_dir(&dir.0)
        .output()
        .unwrap();
    assert!(!started.status.success());
    let err = String::from_utf8_lossy(&started.stderr);
    assert!(err.contains(&routes.display().to_string()), "{err}");

    // An invalid table: its own errors, against its own file.
    std::fs::write(
        &routes,
        format!("{HEAD}kind: RoutingTable\nroutes: [{{name: a}}]\n"),
    )
    .unwrap();
    let (code, out) = check();
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(&format!("{}:3:10: routes[0].backends", routes.display())),
        "{out}"
    );

    // A valid table without the default route.
    std::fs::write(&routes, table(&["a"])).unwrap();
    let (code, out) = check();
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(&format!(
            "{}:6:74: listeners[1].defaultRoute: route \"fallback\" is not in the routing table {}",
            gateway.display(),
            routes.display()
        )),
        "{out}"
    );
    std::fs::write(&routes, table(&["a", "fallback"])).unwrap();
    let (code, out) = check();
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("valid GatewayConfiguration"), "{out}");
}

/// A WireGuard key as `wg pubkey` prints it (base64 of 32 bytes).
fn wg_key(byte: u8) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode([byte; 32])
}

/// Tunnels: every problem of a table's `tunnel.wireguard` sections, of an agent file and of a
/// wireguard listener is reported in one run, each at its path, and `check` exits 1.
#[test]
fn tunnel_files_report_every_error_with_path() {
    let dir = TestDir::new("tunnels");
    let routes = dir.path("routes.yaml");
    std::fs::write(
        &routes,
        format!(
            "{HEAD}kind: RoutingTable
routes:
- name: a
  tunnel:
    wireguard:
      peers:
      - {{publicKey: \"{k1}\", allowedIPs: [\"10.250.0.0/16\", 192.168.128.5]}}
      - {{publicKey: \"not-a-key\", allowedIPs: [10.250.0.300]}}
      localAddresses: [10.250.0.1, 192.168.128.2]
- name: b
  tunnel:
    wireguard:
      peers: [{{publicKey: \"{k1}\", allowedIPs: [10.0.0.1], persistentKeepalive: 25}}]
      localAddresses: [192.168.128.1]
- name: c
  tunnel: {{wireguard: {{localAddresses: [192.168.128.1]}}}}
",
            k1 = wg_key(1)
        ),
    )
    .unwrap();
    let agent = dir.path("agent.yaml");
    std::fs::write(
        &agent,
        format!(
            "{HEAD}kind: AgentConfiguration
wireguard:
  privateKeyFile: agent.key
  addresses: [192.168.128.5, 192.168.128.6]
  gateway:
    publicKey: \"{}\"
    endpoints: []
networks: [\"10.250.0.0/16\", \"10.0.0.0/40\"]
admin: {{address: \"127.0.0.1:16911\"}}
",
            wg_key(2)
        ),
    )
    .unwrap();
    let (r, a) = (routes.display(), agent.display());
    let mut expected = vec![
        format!(
            "{r}:14:99: routes[1].tunnel.wireguard.peers[0].persistentKeepalive: unknown field `persistentKeepalive`"
        ),
        format!(
            "{r}:9:21: routes[0].tunnel.wireguard.peers[1].publicKey: not base64 (a WireGuard key is 44 characters as `wg genkey` writes it)"
        ),
        format!(
            "{r}:9:47: routes[0].tunnel.wireguard.peers[1].allowedIPs[0]: invalid IP address \"10.250.0.300\""
        ),
        format!(
            "{r}:10:24: routes[0].tunnel.wireguard.localAddresses[0]: 10.250.0.1 is inside 10.250.0.0/16, an allowedIPs network of peers[0]: the gateway's address in the shoot must be outside every peer's"
        ),
        format!(
            "{r}:10:36: routes[0].tunnel.wireguard.localAddresses[1]: a second IPv4 address (localAddresses[0]): at most one per family"
        ),
        format!(
            "{r}:17:23: routes[2].tunnel.wireguard.peers: at least one peer is required (the shoot's agents)"
        ),
        format!(
            "{r}:11:3: routes[1]: tunnel.wireguard.publicKey \"{}\" of route \"b\" is already claimed by route \"a\" (routes[0])",
            wg_key(1)
        ),
        format!(
            "{a}:5:30: wireguard.addresses[1]: a second IPv4 address (addresses[0]): at most one per family"
        ),
        format!(
            "{a}:8:16: wireguard.gateway.endpoints: at least one endpoint is required (udp: HOST:PORT or connect: {{...}})"
        ),
        format!("{a}:9:29: networks[1]: invalid prefix length \"40\""),
        // The key file is read too, and its absence reported with the rest.
        format!(
            "{a}:4:19: wireguard.privateKeyFile: {}: No such file or directory (os error 2)",
            dir.path("agent.key").display()
        ),
    ];
    let (code, err) = stderr_of(&["check".as_ref(), routes.as_os_str(), agent.as_os_str()]);
    assert_eq!(code, Some(1), "{err}");
    let mut got: Vec<&str> = err.lines().collect();
    got.sort();
    expected.sort();
    assert_eq!(got, expected, "{err}");

    // A wireguard listener takes no TLS or PROXY header; its connectDestination must lead to
    // the device alone.
    std::fs::write(
        &routes,
        format!("{HEAD}kind: RoutingTable\nroutes:\n- {{name: x, destinations: [\"trellis-wireguard:51820\"], backends: [{{address: \"127.0.0.1:9\"}}]}}\n"),
    )
    .unwrap();
    let gateway = dir.path("gateway.yaml");
    std::fs::write(dir.path("wg.key"), wg_key(3)).unwrap();
    let write_gateway = |extra: &str| {
        std::fs::write(
            &gateway,
            format!(
                "{HEAD}kind: GatewayConfiguration
routes: {{file: routes.yaml}}
listeners:
- {{name: connect, address: \"127.0.0.1:8443\", protocol: http-connect}}
- name: wg
  address: \"127.0.0.1:51820\"
  protocol: wireguard
  wireguard: {{privateKeyFile: wg.key, connectDestination: \"trellis-wireguard:51820\"}}
{extra}admin: {{address: \"127.0.0.1:15021\"}}
"
            ),
        )
        .unwrap()
    };
    write_gateway(
        "  tls: {certificateFile: a, keyFile: b, clientCAFile: c}\n  proxyProtocol: {mode: required, trustedSources: [10.0.0.0/8]}\n",
    );
    let g = gateway.display();
    let mut got = check_errors(&gateway);
    got.sort();
    assert_eq!(
        got,
        [
            format!("{g}:10:8: listeners[1].tls: only valid for egress-connect listeners"),
            format!(
                "{g}:11:18: listeners[1].proxyProtocol: not valid for wireguard listeners: they take no TCP connections (the address is UDP)"
            ),
        ]
    );
    // Valid itself (its key file too), the configuration is checked against its table.
    write_gateway("");
    assert_eq!(
        check_errors(&gateway),
        [format!(
            "{g}:9:59: listeners[1].wireguard.connectDestination: \"trellis-wireguard:51820\" is also a destination of route \"x\" in {}; it must lead to one place",
            routes.display()
        )]
    );
    std::fs::write(&routes, format!("{HEAD}kind: RoutingTable\n")).unwrap();
    let (code, err) = stderr_of(&["check".as_ref(), gateway.as_os_str()]);
    assert_eq!(code, Some(0), "{err}");
}

/// `trellis agent` refuses an invalid configuration (or one of another kind) with every error
/// and its path, exit code 1, before binding anything.
#[test]
fn agent_with_invalid_config_binds_nothing_and_exits_1() {
    let dir = TestDir::new("agent");
    let admin = free_port();
    let file = dir.path("agent.yaml");
    std::fs::write(
        &file,
        format!(
            "{HEAD}kind: AgentConfiguration
wireguard:
  privateKeyFile: agent.key
  addresses: [192.168.128.5]
  gateway: {{publicKey: \"{}\", endpoints: [{{udp: \"127.0.0.1:0\"}}]}}
networks: []
admin: {{address: \"127.0.0.1:{admin}\"}}
",
            wg_key(3)
        ),
    )
    .unwrap();
    let (code, err) = stderr_of(&["agent".as_ref(), "--config".as_ref(), file.as_os_str()]);
    assert_eq!(code, Some(1), "{err}");
    let f = file.display();
    assert_eq!(
        err.lines().collect::<Vec<_>>(),
        [
            format!(
                "{f}:6:90: wireguard.gateway.endpoints[0].udp: expected HOST:PORT, got \"127.0.0.1:0\""
            ),
            format!(
                "{f}:7:11: networks: at least one network is required (what the agent dials for the seed)"
            ),
        ]
    );
    std::net::TcpListener::bind(("127.0.0.1", admin)).expect("admin port must be free");
    std::fs::write(&file, format!("{HEAD}kind: RoutingTable\n")).unwrap();
    let (code, err) = stderr_of(&["agent".as_ref(), "--config".as_ref(), file.as_os_str()]);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(
        err,
        format!("{f}: kind RoutingTable, but 'trellis agent' needs an AgentConfiguration\n")
    );
}

/// The configs the Gardener shapes need (`config/gardener/`, one directory per shape) pass
/// `check` where the pods mount them: their absolute paths (the pods' Secrets and the files
/// the controller writes) are moved under a scratch root that holds the demo material of
/// `config/egress-pki/` (certificates, keys and CA bundles by name) and `config/wireguard/`
/// (any other `*.key`); relative paths stay as they are, and the egress files a controller
/// writes beside its table (`egress.<ns>.crt`, `.key`, `.ca.crt`) are demo material too.
#[test]
fn gardener_shape_configs_pass_check_where_the_pods_mount_them() {
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let scratch = TestDir::new("gardener-configs");
    let root = scratch.path("root");
    let mut files = Vec::new();
    for shape in std::fs::read_dir(source.join("gardener")).unwrap() {
        let shape = shape.unwrap().path();
        let copy = scratch.path(shape.file_name().unwrap().to_str().unwrap());
        std::fs::create_dir_all(&copy).unwrap();
        for file in std::fs::read_dir(&shape).unwrap() {
            let file = file.unwrap().path();
            let mut text = std::fs::read_to_string(&file).unwrap();
            for prefix in ["/etc/trellis/", "/srv/secrets/"] {
                let mut at = 0;
                while let Some(found) = text[at..].find(prefix) {
                    let start = at + found;
                    let end = text[start..]
                        .find(|c: char| c.is_whitespace() || "\"',}]".contains(c))
                        .map_or(text.len(), |e| start + e);
                    let path = &text[start..end];
                    let name = path.rsplit('/').next().unwrap();
                    let demo = if name.ends_with(".crt") || name == "tls.key" {
                        Some(source.join("egress-pki").join(name))
                    } else if name.ends_with(".key") {
                        Some(source.join("wireguard/agent.key"))
                    } else {
                        None
                    };
                    if let Some(demo) = demo {
                        let target = root.join(path.trim_start_matches('/'));
                        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
                        std::fs::copy(&demo, &target).unwrap();
                    }
                    at = end;
                }
                text = text.replace(prefix, &format!("{}{prefix}", root.display()));
            }
            // The egress files the controller writes beside a table it renders, named
            // relative to it: demo material beside the copy.
            for word in text.split(|c: char| c.is_whitespace() || "\"',{}[]:".contains(c)) {
                use trellis::controller::tunnel::EgressFile;
                let demo = match EgressFile::of(word) {
                    Some(EgressFile::Certificate) => "tls.crt",
                    Some(EgressFile::Key) => "tls.key",
                    Some(EgressFile::ClientCa) => "ca.crt",
                    None => continue,
                };
                std::fs::copy(source.join("egress-pki").join(demo), copy.join(word)).unwrap();
            }
            let target = copy.join(file.file_name().unwrap());
            std::fs::write(&target, text).unwrap();
            files.push(target);
        }
    }
    let names: Vec<String> = files
        .iter()
        .map(|f| f.strip_prefix(&scratch.0).unwrap().display().to_string())
        .collect();
    for expected in [
        "shape-a/gateway.yaml",
        "shape-a/routes.yaml",
        "shape-a/agent.yaml",
        "shape-b/agent.yaml",
        "shape-b/routes.yaml",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "no {expected} in {names:?}"
        );
    }
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

/// A type error does not stop the file: a routing table or a gateway configuration with a
/// value of the wrong type, an unknown field and a bad address reports all three in one run,
/// each as FILE:LINE:COL: path: message, in YAML and in JSON, and exits 1.
#[test]
fn a_type_error_an_unknown_field_and_a_bad_address_are_reported_together() {
    let dir = TestDir::new("typeerrors");
    let table = format!(
        "{HEAD}kind: RoutingTable
routes:
- name: a
  sni: [a.example.com]
  forwardConnect: maybe
  backends: [{{address: \"10.0.0.1:443\", wieght: 2}}]
- name: b
  sni: [b.example.com]
  backends: [{{address: nope}}]
"
    );
    let as_json = serde_json::json!({
        "apiVersion": "trellis.gardener.cloud/v1alpha1",
        "kind": "RoutingTable",
        "routes": [
            {"name": "a", "sni": ["a.example.com"], "forwardConnect": "maybe",
             "backends": [{"address": "10.0.0.1:443", "wieght": 2}]},
            {"name": "b", "sni": ["b.example.com"], "backends": [{"address": "nope"}]}
        ]
    });
    for (name, text, [wrong, unknown, bad], message) in [
        (
            "routes.yaml",
            table,
            ["6:19", "7:40", "10:24"],
            "invalid boolean",
        ),
        (
            "routes.json",
            as_json.to_string(),
            ["1:156", "1:120", "1:218"],
            "invalid type: string \"maybe\", expected a boolean",
        ),
    ] {
        let file = dir.path(name);
        std::fs::write(&file, &text).unwrap();
        let f = file.display();
        // In file order, which differs: serde_json writes the keys sorted.
        let mut got = check_errors(&file);
        let mut expected = [
            format!("{f}:{wrong}: routes[0].forwardConnect: {message}"),
            format!("{f}:{unknown}: routes[0].backends[0].wieght: unknown field `wieght`"),
            format!("{f}:{bad}: routes[1].backends[0].address: expected HOST:PORT: \"nope\""),
        ];
        got.sort();
        expected.sort();
        assert_eq!(got, expected, "{text}");
    }
    let gateway = dir.path("gateway.yaml");
    std::fs::write(
        &gateway,
        format!(
            "{HEAD}kind: GatewayConfiguration
routes: {{file: routes.yaml}}
listeners:
- {{name: tls, address: \"127.0.0.1:99999\", protocol: sni, bogus: 1}}
admin: {{address: \"127.0.0.1:1\"}}
limits: {{maxConnections: lots}}
"
        ),
    )
    .unwrap();
    let g = gateway.display();
    assert_eq!(
        check_errors(&gateway),
        [
            format!("{g}:5:24: listeners[0].address: expected IP:port, got \"127.0.0.1:99999\""),
            format!("{g}:5:58: listeners[0].bogus: unknown field `bogus`"),
            format!(
                "{g}:7:10: limits.maxConnections: invalid type: string \"lots\", expected a whole number"
            ),
        ]
    );
}

/// Every kind goes on past a type error: two in one file are both reported, one inside a
/// list element has the element's path, and what validation finds elsewhere comes too; a
/// value replaced after its type error is not reported again (an empty name is not also
/// "invalid", a missing required field in a list element is reported once).
#[test]
fn every_kind_reports_every_type_error() {
    let dir = TestDir::new("everykind");
    let key = wg_key(1);
    for (name, text, expected) in [
        (
            "routes.yaml",
            format!(
                "{HEAD}kind: RoutingTable
routes:
- {{name: a, sni: [a.example.com], backends: [{{address: \"10.0.0.1:1\"}}]}}
- {{name: b, sni: [b.example.com], backends: [{{address: \"10.0.0.1:1\"}}]}}
- {{name: c, sni: [c.example.com], backends: [{{address: \"10.0.0.1:1\"}}]}}
- name: [d]
  sni: [d.example.com]
  backends:
  - {{address: \"10.0.0.1:1\", zone: [eu-1a]}}
  - {{zone: eu-1b}}
"
            ),
            vec![
                "7:9: routes[3].name: expected a string",
                "10:35: routes[3].backends[0].zone: expected a string",
                "11:6: routes[3].backends[1]: missing field `address`",
            ],
        ),
        (
            "gateway.yaml",
            format!(
                "{HEAD}kind: GatewayConfiguration
routes: {{file: routes.yaml}}
listeners: {{name: tls}}
admin: {{address: \"127.0.0.1:1\", debugAddress: [x]}}
zone: eu
"
            ),
            vec![
                "4:12: listeners: expected a sequence",
                "5:47: admin.debugAddress: expected a string",
            ],
        ),
        (
            "node.yaml",
            format!(
                "{HEAD}kind: NodeConfiguration
listen: [\"127.0.0.1:1\"]
upstream: {{address: [h], destination: d}}
admin: {{address: nope}}
"
            ),
            vec![
                "4:21: upstream.address: expected a string",
                "5:18: admin.address: expected IP:port, got \"nope\"",
            ],
        ),
        (
            "controller.yaml",
            format!(
                "{HEAD}kind: ControllerConfiguration
output: {{file: [x]}}
gateway: {{selector: [x]}}
"
            ),
            vec![
                "3:16: output.file: expected a string",
                "4:11: gateway.selector: invalid type: sequence, expected a mapping",
            ],
        ),
        (
            "agent.yaml",
            format!(
                "{HEAD}kind: AgentConfiguration
wireguard:
  privateKeyFile: [agent.key]
  addresses: [192.168.128.5]
  gateway: {{publicKey: \"{key}\", endpoints: [{{udp: \"127.0.0.1:1\"}}], mtu: 1}}
networks: 10.0.0.0/8
admin: {{address: \"127.0.0.1:1\"}}
"
            ),
            vec![
                "4:19: wireguard.privateKeyFile: expected a string",
                "6:107: wireguard.gateway.mtu: unknown field `mtu`",
                "7:11: networks: expected a sequence",
            ],
        ),
    ] {
        let file = dir.path(name);
        std::fs::write(&file, &text).unwrap();
        let f = file.display();
        let expected: Vec<String> = expected.iter().map(|e| format!("{f}:{e}")).collect();
        assert_eq!(check_errors(&file), expected, "{text}");
    }
}

/// Line and column (from 1) of `value` where `key: value` is written in `text` (a value may
/// also appear in a comment before it).
fn value_position(text: &str, key: &str, value: &str) -> (usize, usize) {
    for (i, line) in text.lines().enumerate() {
        if let Some(at) = line.find(&format!("{key}: {value}")) {
            return (i + 1, at + key.len() + 3);
        }
    }
    panic!("no `{key}: {value}` in\n{text}")
}

/// Good files of every kind a configuration names, generated in a directory of their own:
/// a server certificate, its key and its CA (rcgen), a WireGuard key, a kubeconfig and
/// (for a gateway) a routing table holding `routes` (each a route with one backend).
struct Material {
    dir: TestDir,
}

impl Material {
    fn new() -> Material {
        let dir = TestDir::new("material");
        let ca = common::egress::Ca::new("ca");
        let (cert, key) = ca.issue("server", &["server".to_owned()], true);
        let (_, other_key) = ca.issue("other", &[], true);
        std::fs::write(dir.path("tls.crt"), cert).unwrap();
        std::fs::write(dir.path("tls.key"), key).unwrap();
        std::fs::write(dir.path("other.key"), other_key).unwrap();
        std::fs::write(dir.path("ca.crt"), &ca.pem).unwrap();
        std::fs::write(dir.path("wg.key"), format!("{}\n", wg_key(7))).unwrap();
        std::fs::write(
            dir.path("kubeconfig"),
            "apiVersion: v1
kind: Config
clusters: [{name: seed, cluster: {server: \"https://127.0.0.1:6443\"}}]
users: [{name: trellis, user: {token: t}}]
contexts: [{name: seed, context: {cluster: seed, user: trellis}}]
current-context: seed
",
        )
        .unwrap();
        Material { dir }
    }

    /// The good file for a field that names one (by the field's last name).
    fn file(&self, field: &str) -> std::path::PathBuf {
        let name = match field.rsplit('.').next().unwrap() {
            "certificateFile" => "tls.crt",
            "keyFile" => "tls.key",
            "clientCAFile" => "ca.crt",
            "privateKeyFile" => "wg.key",
            "kubeconfig" => "kubeconfig",
            "file" => return self.table(&[]),
            other => panic!("no material for {other}"),
        };
        self.dir.path(name)
    }

    /// A routing table with one route named after each of `routes`.
    fn table(&self, routes: &[&str]) -> std::path::PathBuf {
        let mut text = format!("{HEAD}kind: RoutingTable\nroutes:\n");
        if routes.is_empty() {
            text = format!("{HEAD}kind: RoutingTable\nroutes: []\n");
        }
        for r in routes {
            text += &format!("- {{name: {r}, backends: [{{address: \"127.0.0.1:1\"}}]}}\n");
        }
        let file = self.dir.path(&format!("routes-{}.yaml", routes.join("-")));
        std::fs::write(&file, text).unwrap();
        file
    }
}

/// Every kind, written with `<field>` where a file is named (NodeConfiguration names none).
const NAMING: [(&str, &str); 5] = [
    (
        "gateway",
        "kind: GatewayConfiguration
routes:
  file: <routes.file>
listeners:
- name: egress
  address: \"127.0.0.1:1\"
  protocol: egress-connect
  tls:
    certificateFile: <listeners[0].tls.certificateFile>
    keyFile: <listeners[0].tls.keyFile>
    clientCAFile: <listeners[0].tls.clientCAFile>
- name: wg
  address: \"127.0.0.1:2\"
  protocol: wireguard
  wireguard:
    privateKeyFile: <listeners[1].wireguard.privateKeyFile>
admin: {address: \"127.0.0.1:3\"}
",
    ),
    (
        "routes",
        "kind: RoutingTable
routes:
- name: shoot
  egress:
    serverNames: [server]
    allowedNetworks: [\"10.0.0.0/8\"]
    tls:
      certificateFile: <routes[0].egress.tls.certificateFile>
      keyFile: <routes[0].egress.tls.keyFile>
      clientCAFile: <routes[0].egress.tls.clientCAFile>
",
    ),
    (
        "agent",
        "kind: AgentConfiguration
wireguard:
  privateKeyFile: <wireguard.privateKeyFile>
  addresses: [192.168.128.5]
  gateway:
    publicKey: \"VpmxjMXfskaV6NYIj5+qqYlGAzjGY3dLJYYw3f+mNVc=\"
    endpoints:
    - udp: \"127.0.0.1:51820\"
networks: [\"10.0.0.0/8\"]
admin: {address: \"127.0.0.1:4\"}
",
    ),
    (
        "controller",
        "kind: ControllerConfiguration
kubeconfig: <kubeconfig>
",
    ),
    (
        "extension",
        "kind: ExtensionConfiguration
kubeconfig: <kubeconfig>
namespace: extension-trellis
image: trellis
webhook: {address: \"127.0.0.1:5\"}
admin: {address: \"127.0.0.1:6\"}
",
    ),
];

/// The fields of a [`NAMING`] text.
fn named_fields(text: &str) -> Vec<&str> {
    text.split('<')
        .skip(1)
        .map(|s| s.split_once('>').unwrap().0)
        .collect()
}

/// `check` reads every file each kind names, with the function its role reads it with at
/// start: a missing file, a garbage file (and a key that is not the certificate's) is
/// reported at the field that names it, FILE:LINE:COL: field: why, and nothing else is
/// reported for that file; with every file good, each kind passes.
#[test]
fn every_named_file_is_read_and_a_bad_one_reported_at_its_field() {
    let material = Material::new();
    let dir = TestDir::new("named");
    let mut cases = Vec::new();
    let mut good = Vec::new();
    for (kind, template) in NAMING {
        let fields = named_fields(template);
        let write = |name: &str, bad: Option<(&str, &std::path::Path)>| {
            let mut text = format!("{HEAD}{template}");
            for field in &fields {
                let file = match bad {
                    Some((f, file)) if f == *field => file.to_owned(),
                    _ => material.file(field),
                };
                text = text.replace(&format!("<{field}>"), &file.display().to_string());
            }
            let path = dir.path(name);
            std::fs::write(&path, &text).unwrap();
            (path, text)
        };
        good.push(write(&format!("{kind}.yaml"), None).0);
        for (i, field) in fields.iter().enumerate() {
            let last = field.rsplit('.').next().unwrap();
            let garbage_reason = match last {
                "certificateFile" | "clientCAFile" => "no CERTIFICATE block",
                "keyFile" => "no private key",
                "privateKeyFile" => "not base64",
                "kubeconfig" => "failed to parse kubeconfig YAML",
                "file" => "is not valid; its problems follow",
                other => panic!("{other}"),
            };
            let missing_reason = match last {
                "kubeconfig" => "failed to read kubeconfig",
                "file" => "cannot read the routing table",
                _ => "No such file or directory",
            };
            let garbage = dir.path(&format!("garbage-{kind}-{i}"));
            std::fs::write(&garbage, "garbage: [\n").unwrap();
            let mut variants = vec![
                (
                    "missing",
                    dir.path(&format!("missing-{kind}-{i}")),
                    missing_reason,
                ),
                ("garbage", garbage, garbage_reason),
            ];
            if last == "keyFile" {
                variants.push((
                    "other-key",
                    material.dir.path("other.key"),
                    "does not match the certificate",
                ));
            }
            for (variant, bad, reason) in variants {
                let (path, text) =
                    write(&format!("{kind}-{i}-{variant}.yaml"), Some((field, &bad)));
                let (line, col) = value_position(&text, last, &bad.display().to_string());
                let at = format!("{}:{line}:{col}: {field}: ", path.display());
                cases.push((path, at, reason));
            }
        }
    }
    assert!(cases.len() >= 2 * 11, "{}", cases.len());

    let (ok, out) = run(
        Command::new(BIN).arg("check").args(&good),
        b"",
        Duration::from_secs(60),
    );
    assert!(ok, "{out}");
    for f in &good {
        assert!(out.contains(&format!("{}: valid", f.display())), "{out}");
    }
    assert!(!out.contains("not checked"), "{out}");

    let (ok, out) = run(
        Command::new(BIN)
            .arg("check")
            .args(cases.iter().map(|(p, _, _)| p)),
        b"",
        Duration::from_secs(60),
    );
    assert!(!ok, "{out}");
    for (path, at, reason) in &cases {
        let lines: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with(&format!("{}:", path.display())))
            .collect();
        assert_eq!(lines.len(), 1, "{at}{reason}\n{out}");
        assert!(
            lines[0].starts_with(at.as_str()) && lines[0].contains(reason),
            "expected {at}...{reason}, got:\n{}",
            lines[0]
        );
    }
}

/// `path` without `.` and `..` components.
fn normal(path: &std::path::Path) -> std::path::PathBuf {
    let mut out = std::path::PathBuf::new();
    for c in path.components() {
        match c {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// The trellis configurations in `deploy/` (the files the ConfigMaps are made of), each with
/// its text and the files it names: `(field, value as written)`.
#[expect(clippy::type_complexity, reason = "a test's own list")]
fn deploy_configs() -> Vec<(std::path::PathBuf, String, Vec<(String, String)>)> {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "yaml") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy"),
        &mut files,
    );
    files.sort();
    let mut configs = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let Ok(doc) = serde_saphyr::from_str::<serde_json::Value>(&text) else {
            continue;
        };
        if doc["apiVersion"] != "trellis.gardener.cloud/v1alpha1" {
            continue;
        }
        let mut named = Vec::new();
        let mut name = |field: String, v: &serde_json::Value| {
            if let Some(v) = v.as_str() {
                named.push((field, v.to_owned()));
            }
        };
        let tls = |at: &str,
                   tls: &serde_json::Value,
                   name: &mut dyn FnMut(String, &serde_json::Value)| {
            for f in ["certificateFile", "keyFile", "clientCAFile"] {
                name(format!("{at}.{f}"), &tls[f]);
            }
        };
        match doc["kind"].as_str().unwrap() {
            "GatewayConfiguration" => {
                name("routes.file".into(), &doc["routes"]["file"]);
                for (i, l) in doc["listeners"].as_array().unwrap().iter().enumerate() {
                    match l["protocol"].as_str().unwrap() {
                        "wireguard" => name(
                            format!("listeners[{i}].wireguard.privateKeyFile"),
                            &l["wireguard"]["privateKeyFile"],
                        ),
                        "egress-connect" => {
                            tls(&format!("listeners[{i}].tls"), &l["tls"], &mut name)
                        }
                        _ => {}
                    }
                }
            }
            "AgentConfiguration" => name(
                "wireguard.privateKeyFile".into(),
                &doc["wireguard"]["privateKeyFile"],
            ),
            "ControllerConfiguration" | "ExtensionConfiguration" => {
                name("kubeconfig".into(), &doc["kubeconfig"])
            }
            "RoutingTable" => {
                for (i, r) in doc["routes"].as_array().unwrap().iter().enumerate() {
                    if !r["egress"]["tls"].is_null() {
                        tls(
                            &format!("routes[{i}].egress.tls"),
                            &r["egress"]["tls"],
                            &mut name,
                        );
                    }
                }
            }
            _ => {}
        }
        configs.push((file, text, named));
    }
    configs
}

/// The configurations in `deploy/` name files that exist only in their pods. With
/// `--skip-files` each passes and its output lists every file it names as not checked; with
/// no option one that names files fails; with `--mount` (the file itself where the pod
/// mounts it, every other path under a scratch root holding generated good files)
/// each passes, and a garbage file there fails at the field naming it, FILE:LINE:COL.
#[test]
fn a_configuration_meant_for_a_pod_is_checked_through_mounts_or_without_its_files() {
    let configs = deploy_configs();
    let naming: Vec<_> = configs.iter().filter(|(_, _, n)| !n.is_empty()).collect();
    assert!(
        naming
            .iter()
            .any(|(_, text, _)| text.contains("kind: GatewayConfiguration"))
            && naming
                .iter()
                .any(|(_, text, _)| text.contains("privateKeyFile")),
        "deploy/ holds no gateway configuration that names files: {configs:?}"
    );

    let (ok, out) = run(
        Command::new(BIN)
            .args(["check", "--skip-files"])
            .args(configs.iter().map(|(f, _, _)| f)),
        b"",
        Duration::from_secs(60),
    );
    assert!(ok, "{out}");
    for (file, _, named) in &configs {
        let at = out
            .find(&format!("{}: valid", file.display()))
            .unwrap_or_else(|| panic!("{} not valid:\n{out}", file.display()));
        let said: Vec<&str> = out[at..]
            .lines()
            .skip(1)
            .take_while(|l| l.starts_with(' '))
            .collect();
        if named.is_empty() {
            assert!(said.is_empty(), "{}: {said:?}", file.display());
            continue;
        }
        assert_eq!(
            said.first().copied(),
            Some("  files it names, not checked (--skip-files):"),
            "{out}"
        );
        let dir = file.parent().unwrap();
        let expected: Vec<String> = named
            .iter()
            .map(|(field, v)| format!("    {field}: {}", dir.join(v).display()))
            .collect();
        assert_eq!(said[1..], expected, "{out}");
    }

    for (file, text, named) in naming {
        // Without the pod's files, the configuration does not pass.
        let (ok, out) = run(
            Command::new(BIN).arg("check").arg(file),
            b"",
            Duration::from_secs(60),
        );
        assert!(!ok, "{out}");

        let root = TestDir::new("pod");
        let material = Material::new();
        let config_dir = std::path::Path::new("/etc/trellis/config");
        let in_pod = |v: &str| normal(&config_dir.join(v));
        let doc: serde_json::Value = serde_saphyr::from_str(text).unwrap();
        let defaults: Vec<&str> = doc["listeners"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l["defaultRoute"].as_str())
            .collect();
        for (field, v) in named {
            let good = if field == "routes.file" {
                material.table(&defaults)
            } else {
                material.file(field)
            };
            let at = root.0.join(in_pod(v).strip_prefix("/").unwrap());
            std::fs::create_dir_all(at.parent().unwrap()).unwrap();
            std::fs::copy(good, at).unwrap();
        }
        // The configuration alone at its place in the pod (a file's mount, as a subPath
        // mounts it), everything else under the root.
        let mounts = [
            format!("/={}", root.0.display()),
            format!(
                "{}={}",
                config_dir.join(file.file_name().unwrap()).display(),
                file.display()
            ),
        ];
        let check = || {
            run(
                Command::new(BIN)
                    .arg("check")
                    .args(mounts.iter().flat_map(|m| ["--mount", m.as_str()]))
                    .arg(file),
                b"",
                Duration::from_secs(60),
            )
        };
        let (ok, out) = check();
        assert!(ok, "{out}");
        assert!(out.contains(&format!("{}: valid", file.display())), "{out}");

        // A garbage key (or the first file named) in the pod fails at its field.
        let (field, v) = named
            .iter()
            .find(|(f, _)| f.ends_with("Key") || f.ends_with("keyFile"))
            .unwrap_or(&named[0]);
        let pod = in_pod(v);
        std::fs::write(root.0.join(pod.strip_prefix("/").unwrap()), "garbage\n").unwrap();
        let (ok, out) = check();
        assert!(!ok, "{out}");
        let last = field.rsplit('.').next().unwrap();
        let (line, col) = value_position(text, last, v);
        let at = format!("{}:{line}:{col}: {field}: ", file.display());
        let said = format!("(the pod's {})", pod.display());
        assert!(
            out.lines()
                .any(|l| l.starts_with(&at) && l.ends_with(&said)),
            "expected {at}... {said} in:\n{out}"
        );
    }
}

/// `trellis --help` says how logging is filtered (`TRELLIS_LOG`), which kinds of files
/// there are and where their examples are (each example it names is in `config/` and
/// passes `check`); `trellis check --help` lists the kinds and its options.
#[test]
fn help_names_the_log_filter_the_kinds_and_the_examples() {
    let help = |args: &[&str]| {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let top = help(&["--help"]);
    assert!(top.contains("TRELLIS_LOG"), "{top}");
    assert!(top.contains("TRELLIS_ZONE"), "{top}");
    for kind in trellis::config::KINDS {
        assert!(top.contains(kind), "{kind} not in:\n{top}");
    }
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let examples: Vec<std::path::PathBuf> = top
        .split_whitespace()
        .filter(|w| w.starts_with("config/") && w.len() > "config/".len())
        .map(|w| repo.join(w))
        .collect();
    assert_eq!(examples.len(), trellis::config::KINDS.len(), "{top}");
    let (ok, out) = run(
        Command::new(BIN).arg("check").args(&examples),
        b"",
        Duration::from_secs(20),
    );
    assert!(ok, "{out}");
    for kind in trellis::config::KINDS {
        assert!(out.contains(&format!("valid {kind}")), "{kind}: {out}");
    }

    let check = help(&["check", "--help"]);
    for needle in trellis::config::KINDS.iter().copied().chain([
        "--mount",
        "MOUNT_PATH=LOCAL_PATH",
        "--skip-files",
    ]) {
        assert!(check.contains(needle), "{needle} not in:\n{check}");
    }
}
