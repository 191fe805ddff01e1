//! Golden tests of `trellis controller render`: the real binary renders the seed manifests in
//! `tests/data/controller/seed/` (or the case's own `seed/`) for each case's gateway
//! (`tests/data/controller/<case>/`, `controller.yaml` when present) into a directory
//! (`--output`); the table must equal `expected.json`, the files written beside it those in
//! `expected-files/` (names and bytes; none when it is absent), the report on stderr
//! `expected-report.json`, and `trellis check` must accept the table with its files.
//! `TRELLIS_BLESS=1` rewrites the expected files instead (review every change by hand).

#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

use std::path::{Path, PathBuf};
use std::process::Command;

const CASES: [&str; 6] = [
    "default",
    "zonal",
    "exposure-class",
    "defaults",
    "acl",
    "tunnels",
];

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/controller")
}

fn trellis() -> Command {
    Command::new(env!("CARGO_BIN_EXE_trellis"))
}

/// A line diff: what a failing golden test prints.
fn diff(expected: &str, actual: &str) -> String {
    let e: Vec<&str> = expected.lines().collect();
    let a: Vec<&str> = actual.lines().collect();
    // Longest common subsequence, so that one inserted route shows as its lines only.
    let mut lcs = vec![vec![0usize; a.len() + 1]; e.len() + 1];
    for i in (0..e.len()).rev() {
        for j in (0..a.len()).rev() {
            lcs[i][j] = if e[i] == a[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, String::new());
    while i < e.len() || j < a.len() {
        if i < e.len() && j < a.len() && e[i] == a[j] {
            i += 1;
            j += 1;
        } else if j < a.len() && (i == e.len() || lcs[i][j + 1] >= lcs[i + 1][j]) {
            out += &format!("+{:5} {}\n", j + 1, a[j]);
            j += 1;
        } else {
            out += &format!("-{:5} {}\n", i + 1, e[i]);
            i += 1;
        }
    }
    out
}

fn golden(file: &Path, actual: &str) -> Result<(), String> {
    if std::env::var_os("TRELLIS_BLESS").is_some() {
        std::fs::write(file, actual).unwrap();
        return Ok(());
    }
    let expected = std::fs::read_to_string(file)
        .map_err(|e| format!("{}: {e} (TRELLIS_BLESS=1 writes it)", file.display()))?;
    if expected == actual {
        return Ok(());
    }
    Err(format!(
        "{} differs (- expected, + rendered; TRELLIS_BLESS=1 rewrites it):\n{}",
        file.display(),
        diff(&expected, actual)
    ))
}

/// The files in `dir` but `table`, by name.
fn files_beside(dir: &Path, table: &str) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .map(|e| e.unwrap())
            .filter(|e| e.file_name() != table)
            .map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                (name, std::fs::read(e.path()).unwrap())
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    files.sort();
    files
}

/// The files `render --output` wrote beside the table equal those in `expected` (names and
/// bytes).
fn golden_files(expected: &Path, written: &Path) -> Result<(), String> {
    let actual = files_beside(written, "routes.json");
    if std::env::var_os("TRELLIS_BLESS").is_some() {
        let _ = std::fs::remove_dir_all(expected);
        if !actual.is_empty() {
            std::fs::create_dir_all(expected).unwrap();
        }
        for (name, bytes) in &actual {
            std::fs::write(expected.join(name), bytes).unwrap();
        }
        return Ok(());
    }
    let wanted = files_beside(expected, "");
    let names = |l: &[(String, Vec<u8>)]| l.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    if names(&wanted) != names(&actual) {
        return Err(format!(
            "files written {:?}, expected {:?} (TRELLIS_BLESS=1 rewrites them)",
            names(&actual),
            names(&wanted)
        ));
    }
    for ((name, want), (_, got)) in wanted.iter().zip(&actual) {
        if want != got {
            return Err(format!(
                "{name} differs from {}",
                expected.join(name).display()
            ));
        }
    }
    Ok(())
}

#[test]
fn rendered_tables_match_the_expected_ones_and_pass_check() {
    let mut failures = Vec::new();
    let out = std::env::temp_dir().join(format!("trellis-render-{}", std::process::id()));
    for case in CASES {
        let dir = data().join(case);
        let own = dir.join("seed");
        let seed = if own.is_dir() {
            own
        } else {
            data().join("seed")
        };
        let written = out.join(case);
        std::fs::create_dir_all(&written).unwrap();
        let table = written.join("routes.json");
        let mut render = trellis();
        render
            .args(["controller", "render", "--manifests"])
            .arg(seed)
            .arg("--output")
            .arg(&table);
        let config = dir.join("controller.yaml");
        if config.exists() {
            // The configuration is a file `trellis check` accepts too.
            let check = trellis().arg("check").arg(&config).output().unwrap();
            assert!(
                check.status.success(),
                "{case}: {}",
                String::from_utf8_lossy(&check.stderr)
            );
            render.arg("--config").arg(&config);
        }
        let output = render.output().unwrap();
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert!(output.status.success(), "{case}: {stderr}");
        assert!(
            output.stdout.is_empty(),
            "{case}: the table went to --output"
        );
        let rendered = std::fs::read_to_string(&table).unwrap();
        for (file, actual) in [
            ("expected.json", &rendered),
            ("expected-report.json", &stderr),
        ] {
            if let Err(e) = golden(&dir.join(file), actual) {
                failures.push(format!("{case}: {e}"));
            }
        }
        if let Err(e) = golden_files(&dir.join("expected-files"), &written) {
            failures.push(format!("{case}: {e}"));
        }
        let check = trellis().arg("check").arg(&table).output().unwrap();
        if !check.status.success() {
            failures.push(format!(
                "{case}: trellis check refuses the table: {}",
                String::from_utf8_lossy(&check.stderr)
            ));
        }
    }
    std::fs::remove_dir_all(&out).unwrap();
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

/// Without `--output` the same table goes to stdout (its files are not written).
#[test]
fn without_output_the_table_goes_to_stdout() {
    let case = data().join("tunnels");
    let out = std::env::temp_dir().join(format!("trellis-render-stdout-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let render = |output: Option<&Path>| {
        let mut c = trellis();
        c.args(["controller", "render", "--manifests"])
            .arg(case.join("seed"))
            .arg("--config")
            .arg(case.join("controller.yaml"));
        if let Some(o) = output {
            c.arg("--output").arg(o);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let stdout = render(None);
    render(Some(&out.join("routes.json")));
    let written = std::fs::read_to_string(out.join("routes.json")).unwrap();
    std::fs::remove_dir_all(&out).unwrap();
    assert_eq!(stdout, written);
}

/// Tunnels are opt-in: the tunnels seed rendered with its configuration but without the
/// `tunnel` section (or with `enabled: false`) has no tunnel route and writes no file, and
/// its report counts no Cluster or Secret (the live controller would not read them).
#[test]
fn without_tunnels_on_no_tunnel_route_or_file_is_rendered() {
    let case = data().join("tunnels");
    let config = std::fs::read_to_string(case.join("controller.yaml")).unwrap();
    let (head, _) = config.split_once("tunnel:").unwrap();
    let out = std::env::temp_dir().join(format!("trellis-render-off-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    for (what, text) in [
        ("no tunnel section", head.to_owned()),
        (
            "enabled: false",
            format!("{head}tunnel: {{enabled: false}}\n"),
        ),
    ] {
        let file = out.join("controller.yaml");
        std::fs::write(&file, &text).unwrap();
        let written = out.join("written");
        std::fs::create_dir_all(&written).unwrap();
        let output = trellis()
            .args(["controller", "render", "--manifests"])
            .arg(case.join("seed"))
            .arg("--config")
            .arg(&file)
            .arg("--output")
            .arg(written.join("routes.json"))
            .output()
            .unwrap();
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert!(output.status.success(), "{what}: {stderr}");
        let table: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(written.join("routes.json")).unwrap())
                .unwrap();
        let names: Vec<&str> = table["routes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["fallback", "shoot--dev--alpha"], "{what}");
        assert!(
            files_beside(&written, "routes.json").is_empty(),
            "{what}: files written"
        );
        let report: serde_json::Value = serde_json::from_str(&stderr).unwrap();
        assert_eq!(report["objects"]["Cluster"], 0, "{what}: {stderr}");
        assert_eq!(report["objects"]["Secret"], 0, "{what}: {stderr}");
        std::fs::remove_dir_all(&written).unwrap();
    }
    std::fs::remove_dir_all(&out).unwrap();
}

/// `config/gardener/shape-b/routes.yaml`, the example of a shoot's route in the tunnel
/// gateway's table, is what the tunnel replicas' controller (`deploy/seed/tunnel/tunnel-controller.yaml`)
/// renders of the `tunnels` case's alpha shoot, field for field: nothing else in its table.
#[test]
fn the_shape_b_example_route_is_what_the_tunnel_controller_renders() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let seed = std::env::temp_dir().join(format!("trellis-render-shape-b-{}", std::process::id()));
    std::fs::create_dir_all(&seed).unwrap();
    let alpha = "shoot--dev--alpha.yaml";
    std::fs::copy(data().join("tunnels/seed").join(alpha), seed.join(alpha)).unwrap();
    let output = trellis()
        .args(["controller", "render", "--manifests"])
        .arg(&seed)
        .arg("--config")
        .arg(repo.join("deploy/seed/tunnel/tunnel-controller.yaml"))
        .output()
        .unwrap();
    std::fs::remove_dir_all(&seed).unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let rendered: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let example =
        std::fs::read_to_string(repo.join("config/gardener/shape-b/routes.yaml")).unwrap();
    let example: serde_json::Value = serde_saphyr::from_str(&example).unwrap();
    assert_eq!(
        example,
        rendered,
        "config/gardener/shape-b/routes.yaml is not what the controller renders:\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
}

#[test]
fn a_bad_manifest_or_config_fails_with_its_name() {
    let dir = std::env::temp_dir().join(format!("trellis-render-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("broken.yaml"), "kind: [\n").unwrap();
    let output = trellis()
        .args(["controller", "render", "--manifests"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("broken.yaml"), "{stderr}");
    std::fs::remove_file(dir.join("broken.yaml")).unwrap();
    let config = dir.join("controller.yaml");
    std::fs::write(
        &config,
        "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: ControllerConfiguration\nfallbak: {}\n",
    )
    .unwrap();
    let output = trellis()
        .args(["controller", "render", "--manifests"])
        .arg(&dir)
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("fallbak: unknown field"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A namespace named like one of the controller's own routes (`fallback-closed` is added by
/// the ACL code after route names are settled) neither breaks the table nor takes that
/// route's place: its routes are renamed `ns.<name>`, the controller's keep their name.
#[test]
fn a_namespace_named_like_a_controller_route_keeps_the_table_valid() {
    let acl = data().join("acl");
    let open = std::fs::read_to_string(acl.join("seed/shoot--acl--open.yaml")).unwrap();
    for reserved in [
        "fallback",
        "fallback-connect",
        "fallback-connect-legacy",
        "fallback-closed",
    ] {
        let dir = std::env::temp_dir().join(format!(
            "trellis-render-reserved-{reserved}-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        // The ACL seed (its L7 shoot's restricted CONNECT keys make `fallback-closed`),
        // its open shoot moved to the namespace `reserved`.
        for entry in std::fs::read_dir(acl.join("seed")).unwrap() {
            let path = entry.unwrap().path();
            if !path.ends_with("shoot--acl--open.yaml") {
                std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
            }
        }
        std::fs::write(
            dir.join("reserved.yaml"),
            open.replace("shoot--acl--open", reserved),
        )
        .unwrap();
        let output = trellis()
            .args(["controller", "render", "--manifests"])
            .arg(&dir)
            .arg("--config")
            .arg(acl.join("controller.yaml"))
            .output()
            .unwrap();
        let stdout = String::from_utf8(output.stdout).unwrap();
        assert!(
            output.status.success(),
            "{reserved}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let table_file = dir.join("table.json");
        std::fs::write(&table_file, &stdout).unwrap();
        let check = trellis().arg("check").arg(&table_file).output().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            check.status.success(),
            "{reserved}: trellis check refuses the table: {}\n{stdout}",
            String::from_utf8_lossy(&check.stderr)
        );

        let table: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let routes = table["routes"].as_array().unwrap();
        let route = |name: &str| {
            routes
                .iter()
                .find(|r| r["name"] == name)
                .unwrap_or_else(|| panic!("{reserved}: no route {name}:\n{stdout}"))
        };
        // The shoot is routed, under its new names.
        let api = route(&format!("ns.{reserved}"));
        assert_eq!(
            api["destinations"][0],
            format!("outbound|443||kube-apiserver.{reserved}.svc.cluster.local"),
            "{stdout}"
        );
        assert_eq!(api["backends"][0]["address"], "100.96.52.10:443");
        assert!(
            api["sni"]
                .as_array()
                .unwrap()
                .contains(&"api.open.acl.example.com".into()),
            "{stdout}"
        );
        let vpn = route(&format!("ns.{reserved}--vpn-seed-server"));
        assert_eq!(vpn["backends"][0]["address"], "100.96.52.20:1194");
        // The controller's own routes are all there, each leading to the Envoy gateway.
        for own in [
            "fallback",
            "fallback-connect",
            "fallback-connect-legacy",
            "fallback-closed",
        ] {
            let address = route(own)["backends"][0]["address"].as_str().unwrap();
            assert!(
                address.starts_with("istio-ingressgateway.istio-ingress."),
                "{reserved}: {own} leads to {address}"
            );
        }
    }
}

/// An allow-list network an RBAC EnvoyFilter writes with host bits set (`203.0.113.9/24`)
/// is the network Envoy enforces (`203.0.113.0/24`): the table is the one the clean filter
/// renders, nothing is skipped for it, and the report names the filter, the field, the text
/// and the network used (no such entry for the clean filter).
#[test]
fn an_acl_network_with_host_bits_renders_as_its_network_and_is_reported() {
    let acl = data().join("acl");
    let file = "shoot--acl--locked.yaml";
    let locked = std::fs::read_to_string(acl.join("seed").join(file)).unwrap();
    let clean = "- remote_ip: {address_prefix: 203.0.113.0, prefix_len: 24}";
    assert!(locked.contains(clean), "the fixture changed");
    let dir = std::env::temp_dir().join(format!("trellis-render-host-bits-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(acl.join("seed")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let render = || {
        let output = trellis()
            .args(["controller", "render", "--manifests"])
            .arg(&dir)
            .arg("--config")
            .arg(acl.join("controller.yaml"))
            .output()
            .unwrap();
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert!(output.status.success(), "{stderr}");
        let report: serde_json::Value = serde_json::from_str(&stderr).unwrap();
        (String::from_utf8(output.stdout).unwrap(), report)
    };
    let (clean_table, clean_report) = render();
    // Only the filter's first patch, the API server's.
    std::fs::write(
        dir.join(file),
        locked.replacen(
            clean,
            "- remote_ip: {address_prefix: 203.0.113.9, prefix_len: 24}",
            1,
        ),
    )
    .unwrap();
    let (table, report) = render();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(clean_report.get("normalised").is_none(), "{clean_report}");
    assert_eq!(
        table, clean_table,
        "the network used is the one Envoy enforces"
    );
    assert_eq!(report["skips"], clean_report["skips"]);
    assert_eq!(
        report["normalised"],
        serde_json::json!([{
            "object": "EnvoyFilter istio-ingress/acl-api-shoot--acl--locked",
            "field": "spec.configPatches[0].patch.value.typed_config.rules.policies.acl-api.principals[0].remote_ip",
            "given": "203.0.113.9/24",
            "used": "203.0.113.0/24",
        }]),
        "{report}"
    );
}
