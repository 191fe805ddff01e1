//! The container image (needs root): `scripts/build-image` packs the test binary into an OCI
//! image FROM scratch; the image's config names the non-root user and the binary as its
//! entrypoint, the image holds the binary (stripped, its symbols kept beside the image) and
//! exactly the libraries it loads, and runc runs
//! `trellis --version` and `trellis check` in it as user 65532. Skipped with a printed reason
//! when not root or when umoci or runc is missing (scripts/test installs them).
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{BIN, TestDir, run};
use serde_json::Value;

const ENTRYPOINT: &str = "/usr/local/bin/trellis";
const NONROOT: u32 = 65532;

fn skip_reason() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root".into());
    }
    for tool in ["umoci", "runc", "jq", "ldd", "objcopy", "readelf"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output();
        if !found.is_ok_and(|o| o.status.success()) {
            return Some(format!(
                "{tool} is not installed (scripts/test installs it)"
            ));
        }
    }
    None
}

/// A runc container, deleted (killed if still running) on drop.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("runc")
            .args(["delete", "--force", &self.0])
            .output();
    }
}

/// Runs `args` in the unpacked bundle with runc; returns (exit 0, stdout + stderr).
fn run_in(bundle: &Path, id: &str, args: &[&str], config_dir: &Path) -> (bool, String) {
    let spec_path = bundle.join("config.json");
    let mut spec: Value = serde_json::from_slice(&std::fs::read(&spec_path).unwrap()).unwrap();
    spec["process"]["terminal"] = false.into();
    spec["process"]["args"] = args.iter().map(|a| Value::from(*a)).collect();
    let mounts = spec["mounts"].as_array_mut().unwrap();
    mounts.retain(|m| m["destination"] != "/config");
    mounts.push(serde_json::json!({
        "destination": "/config", "type": "bind",
        "source": config_dir, "options": ["rbind", "ro"],
    }));
    std::fs::write(&spec_path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    let _container = Container(id.to_string());
    run(
        Command::new("runc")
            .args(["run", "--bundle"])
            .arg(bundle)
            .arg(id),
        b"",
        Duration::from_secs(60),
    )
}

fn blob(layout: &Path, digest: &str) -> Value {
    let hex = digest.strip_prefix("sha256:").unwrap();
    serde_json::from_slice(&std::fs::read(layout.join("blobs/sha256").join(hex)).unwrap()).unwrap()
}

/// Absolute paths of the files under `root`, as seen from inside it.
fn files(root: &Path, dir: &Path, out: &mut BTreeSet<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() && !path.is_symlink() {
            files(root, &path, out);
        } else {
            out.insert(Path::new("/").join(path.strip_prefix(root).unwrap()));
        }
    }
}

/// The files the dynamic loader maps for `bin` (libraries and the loader), as ldd names them.
fn loaded_by(bin: &str) -> BTreeSet<PathBuf> {
    let out = Command::new("ldd").arg(bin).output().unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .flat_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            let mut paths = vec![];
            if fields.first().is_some_and(|f| f.starts_with('/')) {
                paths.push(PathBuf::from(fields[0]));
            }
            if fields.get(1) == Some(&"=>") {
                paths.push(PathBuf::from(fields[2]));
            }
            paths
        })
        .collect()
}

#[test]
fn image_is_nonroot_minimal_and_runs_version_and_check_in_runc_needs_root() {
    if let Some(why) = skip_reason() {
        common::skip(
            "image_is_nonroot_minimal_and_runs_version_and_check_in_runc_needs_root",
            &why,
        );
        return;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = TestDir::new("image");
    let out_dir = dir.path("out");
    let built = Command::new("timeout")
        .arg("300")
        .arg(repo.join("scripts/build-image"))
        .args(["--binary", BIN, "--out"])
        .arg(&out_dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&built.stdout);
    assert!(
        built.status.success(),
        "build-image failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let printed = |key: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap_or_else(|| panic!("build-image printed no {key}:\n{stdout}"))
            .to_string()
    };
    let (tag, digest) = (printed("tag: "), printed("digest: "));
    assert_eq!(tag, trellis::VERSION.replace('+', "-"));

    // The layout's tag points at the printed manifest; its config is the image's contract.
    let layout = out_dir.join("oci");
    let index = blob_file(&layout.join("index.json"));
    let manifests = index["manifests"].as_array().unwrap();
    assert_eq!(manifests.len(), 1, "{index}");
    assert_eq!(
        manifests[0]["annotations"]["org.opencontainers.image.ref.name"],
        tag.as_str()
    );
    assert_eq!(manifests[0]["digest"], digest.as_str());
    let manifest = blob(&layout, &digest);
    assert_eq!(
        manifest["layers"].as_array().unwrap().len(),
        1,
        "{manifest}"
    );
    let image = blob(&layout, manifest["config"]["digest"].as_str().unwrap());
    let config = &image["config"];
    assert_eq!(config["User"], format!("{NONROOT}:{NONROOT}"), "{image}");
    assert_eq!(
        config["Entrypoint"],
        serde_json::json!([ENTRYPOINT]),
        "{image}"
    );
    assert!(config["Cmd"].is_null(), "{image}");
    assert_eq!(
        config["Labels"]["org.opencontainers.image.version"],
        trellis::VERSION,
        "{image}"
    );
    let (listed, tar) = run(
        Command::new("tar")
            .arg("-tf")
            .arg(out_dir.join("trellis-oci.tar")),
        b"",
        Duration::from_secs(30),
    );
    assert!(
        listed && tar.contains("./index.json") && tar.contains(&digest[7..]),
        "{tar}"
    );

    // FROM scratch: the binary, what the loader maps for it, and the nonroot user; no shell.
    let bundle = dir.path("bundle");
    let (unpacked, log) = run(
        Command::new("umoci")
            .args(["unpack", "--image"])
            .arg(format!("{}:{tag}", layout.display()))
            .arg(&bundle),
        b"",
        Duration::from_secs(120),
    );
    assert!(unpacked, "{log}");
    let rootfs = bundle.join("rootfs");
    let mut found = BTreeSet::new();
    files(&rootfs, &rootfs, &mut found);
    let libs = loaded_by(BIN);
    assert!(!libs.is_empty(), "ldd named nothing for {BIN}");
    let mut expected: BTreeSet<PathBuf> = libs.clone();
    expected.extend(
        [
            ENTRYPOINT,
            "/etc/passwd",
            "/etc/group",
            "/etc/nsswitch.conf",
        ]
        .map(PathBuf::from),
    );
    assert_eq!(found, expected);
    // The image's binary is stripped; its symbols are beside the image, named by it.
    let sections = |file: &Path| {
        let (ok, out) = run(
            Command::new("readelf").args(["-S", "-W"]).arg(file),
            b"",
            Duration::from_secs(30),
        );
        assert!(ok, "readelf -S {}: {out}", file.display());
        out
    };
    let shipped = rootfs.join(&ENTRYPOINT[1..]);
    let shipped_sections = sections(&shipped);
    for gone in [".symtab", ".debug_line"] {
        assert!(
            !shipped_sections.contains(gone),
            "{gone} in the image's binary:\n{shipped_sections}"
        );
    }
    assert!(
        shipped_sections.contains(".gnu_debuglink"),
        "{shipped_sections}"
    );
    let (shipped_size, built_size) = (
        std::fs::metadata(&shipped).unwrap().len(),
        std::fs::metadata(BIN).unwrap().len(),
    );
    assert!(
        shipped_size * 2 < built_size,
        "stripped {shipped_size} bytes, built {built_size}"
    );
    assert!(
        stdout.contains(&format!("binary: {shipped_size} bytes stripped")),
        "{stdout}"
    );
    let debug_sections = sections(&out_dir.join("trellis.debug"));
    for kept in [".symtab", ".debug_line"] {
        assert!(
            debug_sections.contains(kept),
            "{kept} not kept:\n{debug_sections}"
        );
    }
    let passwd = std::fs::read_to_string(rootfs.join("etc/passwd")).unwrap();
    assert!(
        passwd.contains(&format!("nonroot:x:{NONROOT}:{NONROOT}:")),
        "{passwd}"
    );

    // Config files only user 65532 may read (mode 0400 in a 0500 directory, owned by it):
    // root in the container has no CAP_DAC_OVERRIDE, so `check` passes only as that user.
    let config_dir = dir.path("config");
    std::fs::create_dir(&config_dir).unwrap();
    let shipped = ["gateway.yaml", "routes.yaml", "node.yaml"];
    for name in shipped {
        std::fs::copy(repo.join("config").join(name), config_dir.join(name)).unwrap();
    }
    std::fs::write(
        config_dir.join("bad.yaml"),
        "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes: [{name: x, bogus: 1}]\n",
    )
    .unwrap();
    for entry in std::fs::read_dir(&config_dir).unwrap() {
        let path = entry.unwrap().path();
        std::os::unix::fs::chown(&path, Some(NONROOT), Some(NONROOT)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
    }
    std::os::unix::fs::chown(&config_dir, Some(NONROOT), Some(NONROOT)).unwrap();
    std::fs::set_permissions(&config_dir, std::fs::Permissions::from_mode(0o500)).unwrap();

    let id = format!("trellis-image-test-{}", std::process::id());
    let (ok, out) = run_in(&bundle, &id, &[ENTRYPOINT, "--version"], &config_dir);
    assert!(ok, "{out}");
    assert_eq!(out, format!("trellis {}\n", trellis::VERSION));

    let mut check = vec![ENTRYPOINT, "check"];
    let paths: Vec<String> = shipped.iter().map(|n| format!("/config/{n}")).collect();
    check.extend(paths.iter().map(String::as_str));
    let (ok, out) = run_in(&bundle, &id, &check, &config_dir);
    assert!(ok, "{out}");
    for p in &paths {
        assert!(out.contains(&format!("{p}: valid")), "{out}");
    }

    let (ok, out) = run_in(
        &bundle,
        &id,
        &[ENTRYPOINT, "check", "/config/bad.yaml"],
        &config_dir,
    );
    assert!(!ok, "{out}");
    assert!(
        out.contains("/config/bad.yaml") && out.contains("bogus"),
        "{out}"
    );

    // The runtime state is gone with the container.
    assert!(!Path::new("/run/runc").join(&id).exists());
}

fn blob_file(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}
