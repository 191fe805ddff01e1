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

// The release path: .github/workflows/release.yml builds the image with scripts/build-image
// on a pushed tag `v*` and publishes it; deploy/, the chart and the docs name that release.
// These run without root or network.

/// The repository.
fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The image the release publishes.
const RELEASED_IMAGE: &str = "ghcr.io/gardener/trellis";

/// The options `scripts/build-image` accepts, from its argument loop (`--name) ...`), each
/// with whether it takes a value (`shift 2`).
fn script_options(script: &str) -> Vec<(String, bool)> {
    let body = &script[script.find("while [ $# -gt 0 ]").unwrap()..];
    let body = &body[..body.find("\ndone").unwrap()];
    body.lines()
        .filter_map(|l| {
            let (patterns, action) = l.trim().split_once(')')?;
            patterns.starts_with('-').then(|| {
                patterns
                    .split('|')
                    .map(|p| (p.to_owned(), action.contains("shift 2")))
                    .collect::<Vec<_>>()
            })
        })
        .flatten()
        .collect()
}

/// A shell command line's words: whitespace-separated, single and double quotes kept
/// together (and removed), backslash-newline continuations joined.
fn shell_words(line: &str) -> Vec<String> {
    let line = line.replace("\\\n", " ");
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quote = None;
    let mut in_word = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, c) => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// The workflow's steps of job `image`, in order.
fn steps(workflow: &Value) -> Vec<&Value> {
    workflow["jobs"]["image"]["steps"]
        .as_array()
        .map(|s| s.iter().collect())
        .unwrap_or_default()
}

/// What the release workflow must do, `Err` naming the first rule broken: run on pushed tags
/// `v*` only; build the release binary with `TRELLIS_VERSION` set, then call
/// `scripts/build-image` as root with only options the script accepts (each value option
/// with a value), `--version` among them (the script then checks the binary prints it) and
/// `--binary` naming the binary built before; push the archive the script writes to
/// `ghcr.io/gardener/trellis` with the tag's name; give the digest as a job output; and have
/// the right to push packages.
fn release_rules(workflow: &Value, script: &str) -> Result<(), String> {
    let on = &workflow["on"];
    let keys: Vec<&String> = on
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    if keys != ["push"] {
        return Err(format!("the workflow runs on {keys:?}, not on push alone"));
    }
    if on["push"]["tags"] != serde_json::json!(["v*"]) || !on["push"]["branches"].is_null() {
        return Err(format!("push triggers {}, not tags v* alone", on["push"]));
    }
    if workflow["permissions"]["packages"] != "write" {
        return Err("no permission to write packages".into());
    }
    let steps = steps(workflow);
    let run = |s: &Value| s["run"].as_str().unwrap_or("").to_owned();
    let Some(at) = steps
        .iter()
        .position(|s| run(s).contains("scripts/build-image"))
    else {
        return Err("no step runs scripts/build-image".into());
    };
    let text = run(steps[at]);
    let line = text
        .replace("\\\n", " ")
        .lines()
        .find(|l| l.contains("scripts/build-image"))
        .unwrap()
        .to_owned();
    let words = shell_words(&line);
    let script_at = words
        .iter()
        .position(|w| w.ends_with("scripts/build-image"))
        .unwrap();
    if script_at == 0 || words[script_at - 1] != "sudo" {
        return Err(format!("scripts/build-image is not run as root: {line}"));
    }
    let options = script_options(script);
    let mut given = std::collections::BTreeMap::new();
    let mut args = words[script_at + 1..].iter();
    while let Some(arg) = args.next() {
        if ["|", "&&", ";", ">", "||"].contains(&arg.as_str()) {
            break;
        }
        let Some((_, takes_value)) = options.iter().find(|(o, _)| o == arg) else {
            return Err(format!("scripts/build-image does not accept {arg:?}"));
        };
        let value = if *takes_value {
            match args.next() {
                Some(v) if !v.starts_with('-') => v.clone(),
                _ => return Err(format!("{arg} without a value")),
            }
        } else {
            String::new()
        };
        given.insert(arg.clone(), value);
    }
    if !given.contains_key("--version") {
        return Err("no --version: the script would not check the binary's version".into());
    }
    if let Some(binary) = given.get("--binary") {
        let built = steps[..at].iter().any(|s| {
            run(s).contains("cargo build --release")
                && !s["env"]["TRELLIS_VERSION"].is_null()
                && binary == "target/release/trellis"
        });
        if !built {
            return Err(format!(
                "--binary {binary}: no earlier step builds it with TRELLIS_VERSION"
            ));
        }
    }
    let archive = format!(
        "{}/trellis-oci.tar",
        given.get("--out").map_or("target/image", String::as_str)
    );
    let push = steps[at + 1..].iter().find(|s| {
        let r = run(s);
        r.contains(&archive) && r.contains("docker://$IMAGE:$GITHUB_REF_NAME")
    });
    let Some(push) = push else {
        return Err(format!(
            "no later step pushes {archive} as $IMAGE:$GITHUB_REF_NAME"
        ));
    };
    let job = &workflow["jobs"]["image"];
    if job["env"]["IMAGE"] != RELEASED_IMAGE {
        return Err(format!(
            "IMAGE is {}, not {RELEASED_IMAGE}",
            job["env"]["IMAGE"]
        ));
    }
    let id = push["id"].as_str().unwrap_or("");
    let digest = job["outputs"]["digest"].as_str().unwrap_or("");
    if id.is_empty() || !digest.contains(&format!("steps.{id}.outputs.digest")) {
        return Err(format!(
            "the job's output digest is {digest:?}, not the push step's"
        ));
    }
    Ok(())
}

fn release_workflow() -> (Value, String) {
    let text = std::fs::read_to_string(repo().join(".github/workflows/release.yml")).unwrap();
    let workflow: Value = serde_saphyr::from_str(&text).unwrap();
    let script = std::fs::read_to_string(repo().join("scripts/build-image")).unwrap();
    (workflow, script)
}

#[test]
fn release_workflow_builds_the_image_with_build_image_on_version_tags() {
    let (workflow, script) = release_workflow();
    release_rules(&workflow, &script).unwrap();
    // The options read from the script are its own.
    let options = script_options(&script);
    for (option, value) in [("--binary", true), ("--version", true), ("--out", true)] {
        assert!(options.contains(&(option.to_owned(), value)), "{options:?}");
    }
    assert!(
        options.contains(&("--help".to_owned(), false)),
        "{options:?}"
    );
}

/// The control: each way of breaking the workflow fails the rule that names it.
#[test]
fn a_broken_release_workflow_fails() {
    let (workflow, script) = release_workflow();
    fn build_step(w: &mut Value) -> &mut Value {
        w["jobs"]["image"]["steps"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|s| {
                s["run"]
                    .as_str()
                    .is_some_and(|r| r.contains("scripts/build-image"))
            })
            .unwrap()
    }
    fn edit_run(w: &mut Value, from: &str, to: &str) {
        let step = build_step(w);
        let run = step["run"].as_str().unwrap();
        assert!(run.contains(from), "{from:?} not in {run}");
        step["run"] = run.replacen(from, to, 1).into();
    }
    type Break = fn(&mut Value);
    let breaks: [(&str, Break, &str); 9] = [
        (
            "on every push",
            |w| w["on"]["push"] = serde_json::json!({"branches": ["main"]}),
            "not tags v* alone",
        ),
        (
            "also on pull requests",
            |w| w["on"]["pull_request"] = serde_json::json!({}),
            "not on push alone",
        ),
        (
            "an option the script lacks",
            |w| edit_run(w, "--out target/image", "--platform linux/amd64"),
            "does not accept \"--platform\"",
        ),
        (
            "a value option without its value",
            |w| edit_run(w, "--out target/image", "--out"),
            "--out without a value",
        ),
        (
            "no version",
            |w| edit_run(w, "--version", "--source"),
            "no --version",
        ),
        (
            "not as root",
            |w| edit_run(w, "sudo scripts/build-image", "scripts/build-image"),
            "not run as root",
        ),
        (
            "the archive pushed from elsewhere",
            |w| edit_run(w, "--out target/image", "--out target/release-image"),
            "no later step pushes target/release-image/trellis-oci.tar",
        ),
        (
            "another image",
            |w| w["jobs"]["image"]["env"]["IMAGE"] = "ghcr.io/someone/trellis".into(),
            "not ghcr.io/gardener/trellis",
        ),
        (
            "no digest output",
            |w| {
                w["jobs"]["image"]["outputs"]
                    .as_object_mut()
                    .unwrap()
                    .remove("digest");
            },
            "output digest",
        ),
    ];
    for (what, break_it, message) in breaks {
        let mut broken = workflow.clone();
        break_it(&mut broken);
        match release_rules(&broken, &script) {
            Ok(()) => panic!("{what}: passed"),
            Err(e) => assert!(e.contains(message), "{what}: {e}"),
        }
    }
}

/// Every image tag in `text` (`ghcr.io/gardener/trellis:<tag>`, `newTag: <tag>`): `Err`
/// unless each is `v<crate version>`, the release the workflow publishes for that version's
/// tag, or a placeholder (a word in capitals such as `TAG`, or one with `<...>`).
fn tags_are_real(file: &str, text: &str) -> Result<(), String> {
    let release = format!("v{}", env!("CARGO_PKG_VERSION"));
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("rawChart:") {
            continue;
        }
        let mut tags = Vec::new();
        for (i, _) in line.match_indices(&format!("{RELEASED_IMAGE}:")) {
            tags.push(&line[i + RELEASED_IMAGE.len() + 1..]);
        }
        if let Some(i) = line.find("newTag:") {
            tags.push(line[i + "newTag:".len()..].trim_start());
        }
        for rest in tags {
            let tag: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || "._-<>".contains(*c))
                .collect();
            let placeholder = tag.contains('<')
                || (!tag.is_empty() && tag.chars().all(|c| c.is_ascii_uppercase() || c == '_'));
            if tag != release && !placeholder {
                return Err(format!(
                    "{file}:{}: the tag {tag:?} is neither {release} (the release of the crate \
                     version) nor a placeholder",
                    n + 1
                ));
            }
        }
    }
    Ok(())
}

/// The files whose image tags [`tags_are_real`] checks: the README, `docs/`, `deploy/` and
/// the chart.
fn tagged_files() -> Vec<PathBuf> {
    let mut files = vec![repo().join("README.md")];
    let mut dirs = vec![
        repo().join("docs"),
        repo().join("deploy"),
        repo().join("charts"),
        repo().join("config"),
    ];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path
                .extension()
                .is_some_and(|e| e == "md" || e == "yaml" || e == "yml")
            {
                files.push(path);
            }
        }
    }
    files
}

#[test]
fn every_image_tag_is_the_release_of_the_crate_version_or_a_placeholder() {
    let mut seen = 0;
    for file in tagged_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(repo()).unwrap().display().to_string();
        tags_are_real(&name, &text).unwrap();
        seen += text.matches("newTag:").count();
    }
    assert!(
        seen >= 4,
        "only {seen} newTag: lines: the scan misses deploy/"
    );
    // The control: a tag nothing publishes fails, a placeholder and the release pass.
    let release = format!("v{}", env!("CARGO_PKG_VERSION"));
    for bad in [
        "  newTag: latest",
        "image: ghcr.io/gardener/trellis:latest",
        "newTag: v9.9.9",
    ] {
        let e = tags_are_real("x", bad).unwrap_err();
        assert!(e.contains("neither"), "{bad}: {e}");
    }
    for good in [
        format!("  newTag: {release}"),
        format!("image: ghcr.io/gardener/trellis:{release}"),
        "newTag: TAG".to_owned(),
        "`ghcr.io/gardener/trellis:v<version>`".to_owned(),
    ] {
        tags_are_real("x", &good).unwrap();
    }
}
