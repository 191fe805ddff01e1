//! `deploy/`: every `kubectl apply -k`, `delete -k` and `kustomize` the README and `docs/`
//! show renders with `kubectl kustomize` and creates exactly what its step says, on its own
//! (the ingress gateway without the tunnel gateway, monitoring without a zone); every
//! rendered object validates against the Kubernetes OpenAPI schemas (the
//! `kubernetes-validate` package, `--strict`, so unknown fields fail); the configs in the rendered ConfigMaps pass `trellis
//! check` laid out as the pods mount them (the seed gateway's once the table its controller
//! sidecar renders is where the controller writes it); the pods keep the rules a rollout
//! without refusals depends on (grace period above the drain, probes on the admin port, the
//! Service ports on the listeners); and the controller sidecar is wired to the gateway
//! (table volume, startup probe, token in the sidecar only, ClusterRoles of exactly the
//! kinds the controller watches with its configuration, read-only); only the tunnel
//! replicas render tunnels and may read Secrets. The README's examples run as written.
//! Skipped with a printed reason without kubectl or kubernetes-validate (`scripts/test`
//! installs the latter into `target/deploy-venv`).
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;
mod fakekube;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use trellis::controller::kinds::WatchedKind;

/// The Kubernetes versions the manifests are validated against: the oldest one they are
/// meant for and the first with the pod topology labels that fill `TRELLIS_ZONE` by default.
const KUBERNETES_VERSIONS: [&str; 2] = ["1.31.0", "1.35.0"];

/// What the grace period must leave beyond `drainDelay` + `drain`: the connections cut at
/// the drain deadline are closed over a window (a tenth of `drain`, 1 s to 10 s), their
/// records get 2 s, then the process exits; and some slack for the kubelet.
fn grace_margin(drain: Duration) -> Duration {
    let window = if drain.is_zero() {
        Duration::ZERO
    } else {
        (drain / 10).clamp(Duration::from_secs(1), Duration::from_secs(10))
    };
    window + Duration::from_secs(2) + Duration::from_secs(3)
}

const IMAGE: &str = "ghcr.io/gardener/trellis";

/// `Err(message)` unless `cond`.
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The `kubernetes-validate` command: the one `scripts/test` installs, else one on `PATH`.
fn validator() -> Option<PathBuf> {
    let venv = repo().join("target/deploy-venv/bin/kubernetes-validate");
    if venv.exists() {
        return Some(venv);
    }
    let on_path = Command::new("kubernetes-validate")
        .arg("--version")
        .output();
    on_path
        .is_ok_and(|o| o.status.success())
        .then(|| "kubernetes-validate".into())
}

/// Whether kubectl is here; prints why a test is skipped otherwise.
fn kubectl(test: &str) -> bool {
    let here = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !here {
        common::skip(test, "kubectl is not installed");
    }
    here
}

/// kubectl and the validator; prints why a test is skipped otherwise.
fn tools(test: &str) -> Option<PathBuf> {
    if !kubectl(test) {
        return None;
    }
    let v = validator();
    if v.is_none() {
        common::skip(
            test,
            "kubernetes-validate is not installed (scripts/test installs it into \
             target/deploy-venv)",
        );
    }
    v
}

/// `kubectl kustomize deploy/BASE`: the rendered objects.
fn render(base: &str) -> Vec<Value> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(repo().join("deploy").join(base))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl kustomize deploy/{base}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap()
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}

/// The ingress gateway's step: the exposure class handler's gateway and its controller.
const INGRESS: &str = "seed/gateway";

/// The seed with the tunnel gateway: the tunnel gateway's step (`seed/tunnel`) and the
/// ingress gateway with the hand-off to it (`seed/gateway-with-tunnel`), rendered together.
fn seed_with_tunnel() -> Vec<Value> {
    let mut objects = render("seed/gateway-with-tunnel");
    objects.extend(render("seed/tunnel"));
    objects
}

/// Validates `objects` against every version in [`KUBERNETES_VERSIONS`]; `Err` with the
/// validator's report when any object fails or was not checked against a schema (an
/// unknown kind only warns).
fn validate(validator: &Path, objects: &[Value]) -> Result<(), String> {
    let dir = TestDir::new("deploy-validate");
    let file = dir.path("rendered.yaml");
    // JSON is YAML: one document per object.
    let docs: Vec<String> = objects.iter().map(|o| o.to_string()).collect();
    std::fs::write(&file, docs.join("\n---\n")).unwrap();
    for version in KUBERNETES_VERSIONS {
        let out = Command::new(validator)
            .args(["--strict", "-k", version])
            .arg(&file)
            .output()
            .unwrap();
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let passed = report.matches(" passed for resource ").count();
        if !out.status.success() || passed != objects.len() {
            return Err(format!(
                "Kubernetes {version}: {passed} of {} objects passed:\n{report}",
                objects.len()
            ));
        }
    }
    Ok(())
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn workloads(objects: &[Value]) -> impl Iterator<Item = &Value> {
    objects.iter().filter(|o| {
        ["Deployment", "DaemonSet", "StatefulSet"].contains(&o["kind"].as_str().unwrap())
    })
}

/// Every container of a pod: its init containers (native sidecars among them) and the
/// main ones.
fn all_containers(pod: &Value) -> impl Iterator<Item = &Value> {
    ["initContainers", "containers"]
        .into_iter()
        .filter_map(move |k| pod[k].as_array())
        .flatten()
}

fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
    all_containers(pod)
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// What a Secret the manifests expect (and never hold) provides, for `trellis check`: the
/// demo material in `config/` for each file name the pod mounts (certificates, keys and CA
/// bundles from `config/egress-pki/`, `tls.key` among them; any other `*.key` a WireGuard
/// key from `config/wireguard/`).
fn demo_secret_file(name: &str) -> Vec<u8> {
    let config = repo().join("config");
    let file = if name.ends_with(".crt") || name == "tls.key" {
        config.join("egress-pki").join(name)
    } else if name.ends_with(".key") {
        config.join("wireguard/agent.key")
    } else {
        panic!("no demo material for a Secret's {name:?}")
    };
    std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

/// The name of pod `ordinal` of a workload: a StatefulSet's `<name>-<ordinal>`, any other's
/// an example (`<name>-pod`).
fn pod_name(workload: &Value, ordinal: usize) -> String {
    let name = workload["metadata"]["name"].as_str().unwrap();
    if workload["kind"] == "StatefulSet" {
        format!("{name}-{ordinal}")
    } else {
        format!("{name}-pod")
    }
}

/// A mount's path inside its volume, as the kubelet expands it for the pod named `pod`:
/// `subPath`, or `subPathExpr` with `$(VAR)` replaced by the container's environment
/// variables that name the pod (`fieldRef: metadata.name`); `None` for the whole volume.
fn sub_path(container: &Value, mount: &Value, pod: &str) -> Option<String> {
    if let Some(path) = mount["subPath"].as_str() {
        return Some(path.to_owned());
    }
    let mut path = mount["subPathExpr"].as_str()?.to_owned();
    for env in container["env"].as_array().into_iter().flatten() {
        if env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name" {
            path = path.replace(&format!("$({})", env["name"].as_str().unwrap()), pod);
        }
    }
    assert!(
        !path.contains("$("),
        "{path}: a variable the test does not expand"
    );
    Some(path)
}

/// The files of a volume: a ConfigMap's keys, a Secret's items (demo material, see
/// [`demo_secret_file`]); `None` for a volume that starts empty (emptyDir) or that the test
/// does not fill (a projected token).
fn volume_files(objects: &[Value], volume: &Value) -> Option<Vec<(String, Vec<u8>)>> {
    if let Some(cm_name) = volume["configMap"]["name"].as_str() {
        let data = find(objects, "ConfigMap", cm_name)["data"]
            .as_object()
            .unwrap();
        return Some(
            data.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().as_bytes().to_vec()))
                .collect(),
        );
    }
    let items = volume["secret"]["items"].as_array()?;
    Some(
        items
            .iter()
            .map(|i| {
                let path = i["path"].as_str().unwrap().to_owned();
                let data = demo_secret_file(i["key"].as_str().unwrap());
                (path, data)
            })
            .collect(),
    )
}

/// A pod as container `name` sees it, under `root/NAME`: every volume it mounts is a
/// directory at its mount path, with the keys of a ConfigMap or the items of a Secret (demo
/// material) written into it, or the one file a `subPath`/`subPathExpr` names (an emptyDir
/// starts empty; [`share`] copies what one container wrote to the others). Real
/// directories, not links, so `..` from a mount path leads where it does in the container.
/// Returns the path inside `root` of the container's `--config` argument.
fn lay_out(objects: &[Value], workload: &Value, name: &str, root: &Path) -> PathBuf {
    lay_out_pod(objects, workload, name, root, &pod_name(workload, 0))
}

/// [`lay_out`] for the pod named `pod` (a StatefulSet's pods mount files by their names).
fn lay_out_pod(objects: &[Value], workload: &Value, name: &str, root: &Path, pod: &str) -> PathBuf {
    let spec = &workload["spec"]["template"]["spec"];
    let container = container(spec, name);
    let own = root.join(name);
    for mount in container["volumeMounts"].as_array().unwrap() {
        let at = own.join(mount["mountPath"].as_str().unwrap().trim_start_matches('/'));
        let volume = spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap();
        let Some(files) = volume_files(objects, volume) else {
            std::fs::create_dir_all(&at).unwrap();
            continue;
        };
        match sub_path(container, mount, pod) {
            Some(key) => {
                let (_, data) = files
                    .iter()
                    .find(|(k, _)| *k == key)
                    .unwrap_or_else(|| panic!("{pod}: no {key:?} in volume {}", volume["name"]));
                std::fs::create_dir_all(at.parent().unwrap()).unwrap();
                std::fs::write(&at, data).unwrap();
            }
            None => {
                std::fs::create_dir_all(&at).unwrap();
                for (key, data) in files {
                    std::fs::write(at.join(key), data).unwrap();
                }
            }
        }
    }
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let at = args.iter().position(|a| *a == "--config").unwrap();
    own.join(args[at + 1].trim_start_matches('/'))
}

/// What the kubelet's shared volumes do, for the pod laid out under `root` by [`lay_out`]:
/// every file in an emptyDir as container `from` mounts it is copied to each other laid-out
/// container's mount of the same volume.
fn share(workload: &Value, from: &str, root: &Path) {
    let pod = &workload["spec"]["template"]["spec"];
    let mount_of = |container: &Value, volume: &Value| {
        container["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == volume["name"] && m["subPath"].is_null())
            .map(|m| {
                root.join(container["name"].as_str().unwrap())
                    .join(m["mountPath"].as_str().unwrap().trim_start_matches('/'))
            })
    };
    let source = container(pod, from);
    for volume in pod["volumes"].as_array().unwrap() {
        if volume["emptyDir"].is_null() {
            continue;
        }
        let Some(src) = mount_of(source, volume) else {
            continue;
        };
        for other in all_containers(pod).filter(|c| c["name"] != from) {
            let Some(dst) = mount_of(other, volume).filter(|d| d.exists()) else {
                continue;
            };
            for entry in std::fs::read_dir(&src).unwrap() {
                let entry = entry.unwrap();
                std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
            }
        }
    }
}

/// [`lay_out`] for the workload's first main container.
fn lay_out_config(objects: &[Value], workload: &Value, root: &Path) -> PathBuf {
    let name = workload["spec"]["template"]["spec"]["containers"][0]["name"]
        .as_str()
        .unwrap();
    lay_out(objects, workload, name, root)
}

/// `trellis check FILE`: whether it passed, and what it printed.
fn check(file: &Path) -> (bool, String) {
    run(
        Command::new(BIN).arg("check").arg(file),
        b"",
        Duration::from_secs(20),
    )
}

/// The config file the workload's first main container runs with, parsed.
fn config_of(objects: &[Value], workload: &Value) -> Value {
    let dir = TestDir::new("deploy-config");
    let file = lay_out_config(objects, workload, &dir.0);
    serde_saphyr::from_str(&std::fs::read_to_string(file).unwrap()).unwrap()
}

/// The config file container `name` runs with, parsed, and its path in the container.
fn config_in(objects: &[Value], workload: &Value, name: &str) -> (Value, PathBuf) {
    let dir = TestDir::new("deploy-config");
    let file = lay_out(objects, workload, name, &dir.0);
    let config = serde_saphyr::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let in_container = Path::new("/").join(file.strip_prefix(dir.0.join(name)).unwrap());
    (config, in_container)
}

/// `5s`, `1m`, `500ms`, `1h` as trellis writes them.
fn duration(v: &str) -> Duration {
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap();
    let n: u64 = v[..split].parse().unwrap();
    match &v[split..] {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        unit => panic!("unit {unit:?} in {v:?}"),
    }
}

fn port_of(address: &str) -> u64 {
    address.rsplit_once(':').unwrap().1.parse().unwrap()
}

/// A probe's or Service's port, by number or by the container's port name.
fn container_port(container: &Value, port: &Value) -> u64 {
    if let Some(n) = port.as_u64() {
        return n;
    }
    let name = port.as_str().unwrap();
    container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no container port named {name}"))["containerPort"]
        .as_u64()
        .unwrap()
}

/// Probes on the admin address's port (reachable by the kubelet, so not loopback), no
/// preStop hook, a grace period above drainDelay + drain + margin, the image from `images:`.
fn assert_lifecycle(workload: &Value, config: &Value, default_drain_delay: Duration) {
    let pod = &workload["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let admin = config["admin"]["address"].as_str().unwrap();
    assert!(
        !admin.starts_with("127.") && !admin.starts_with("[::1]"),
        "the kubelet cannot probe {admin}"
    );
    for (probe, paths) in [
        ("readinessProbe", &["/ready", "/healthz/ready"][..]),
        ("livenessProbe", &["/live"][..]),
    ] {
        let get = &container[probe]["httpGet"];
        assert!(
            paths.contains(&get["path"].as_str().unwrap()),
            "{probe}: {get}"
        );
        assert_eq!(
            container_port(container, &get["port"]),
            port_of(admin),
            "{probe}"
        );
    }
    assert!(
        container["lifecycle"]["preStop"].is_null(),
        "drainDelay replaces a preStop sleep"
    );
    let timeouts = &config["timeouts"];
    let drain_delay = timeouts["drainDelay"]
        .as_str()
        .map_or(default_drain_delay, duration);
    let drain = timeouts["drain"]
        .as_str()
        .map_or(Duration::from_secs(60), duration);
    let grace = Duration::from_secs(pod["terminationGracePeriodSeconds"].as_u64().unwrap());
    let margin = grace_margin(drain);
    assert!(
        grace >= drain_delay + drain + margin,
        "terminationGracePeriodSeconds {grace:?} < drainDelay {drain_delay:?} + drain \
         {drain:?} + {margin:?}"
    );
    let image = container["image"].as_str().unwrap();
    assert!(image.starts_with(&format!("{IMAGE}:")), "{image}");
    assert_eq!(
        container["securityContext"]["allowPrivilegeEscalation"],
        false
    );
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(
        container["securityContext"]["capabilities"]["drop"],
        json!(["ALL"])
    );
}

/// A `kubectl apply -k`, `delete -k` or `kustomize` of a directory of `deploy/` that the
/// README or a file of `docs/` shows: where, and the directory (`seed/gateway`).
#[derive(Debug)]
struct Documented {
    at: String,
    dir: String,
}

/// Every [`Documented`] command of the README and `docs/*.md`, found in their text (code
/// blocks and prose alike, also where a line break splits one): `kubectl`, then within the
/// next few words `-k DIR` or `kustomize DIR`, DIR under `deploy/`.
fn documented_kustomizations() -> Vec<Documented> {
    let mut files = vec![repo().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    documented_in(&files)
}

/// The [`Documented`] commands of `files`.
fn documented_in(files: &[PathBuf]) -> Vec<Documented> {
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(file).unwrap();
        let name = file
            .strip_prefix(repo())
            .unwrap_or(file)
            .display()
            .to_string();
        // (line, word) for every word, backticks and surrounding punctuation removed.
        let words: Vec<(usize, String)> = text
            .lines()
            .enumerate()
            .flat_map(|(n, l)| l.split_whitespace().map(move |w| (n + 1, w)))
            .map(|(n, w)| {
                let w = w.trim_matches(|c: char| "`()[],.;:\"'".contains(c));
                (n, w.trim_end_matches('/').to_owned())
            })
            .collect();
        for (i, (line, word)) in words.iter().enumerate() {
            if word != "kubectl" {
                continue;
            }
            // The command's words: up to a comment, the next kubectl, or 8 words.
            let command: Vec<&str> = words[i + 1..]
                .iter()
                .map(|(_, w)| w.as_str())
                .take_while(|w| !w.starts_with('#') && *w != "kubectl")
                .take(8)
                .collect();
            for pair in command.windows(2) {
                if (pair[0] == "-k" || pair[0] == "kustomize") && pair[1].starts_with("deploy/") {
                    found.push(Documented {
                        at: format!("{name}:{line}"),
                        dir: pair[1]["deploy/".len()..].to_owned(),
                    });
                }
            }
        }
    }
    found
}

/// A documented step: the kustomization's directory under `deploy/`, what it creates
/// (`Kind namespace/name`, cluster-scoped `Kind name`, a generated ConfigMap without its
/// hash suffix), the Secrets its pods mount that the operator creates (the README's `create
/// secret` commands), and the rule its text states.
struct Step {
    dir: &'static str,
    creates: &'static [&'static str],
    secrets: &'static [&'static str],
    rule: fn(&[Value]) -> Result<(), String>,
}

const INGRESS_OBJECTS: [&str; 10] = [
    "ServiceAccount istio-ingress-handler-trellis/trellis-gateway",
    "ClusterRole trellis-controller",
    "ClusterRoleBinding trellis-controller",
    "ConfigMap istio-ingress-handler-trellis/trellis-controller-config",
    "ConfigMap istio-ingress-handler-trellis/trellis-gateway-config",
    "Service istio-ingress-handler-trellis/trellis-gateway",
    "Service istio-ingress-handler-trellis/trellis-gateway-metrics",
    "Deployment istio-ingress-handler-trellis/trellis-gateway",
    "PodDisruptionBudget istio-ingress-handler-trellis/trellis-gateway",
    "HorizontalPodAutoscaler istio-ingress-handler-trellis/trellis-gateway",
];

/// The steps the README and `docs/` show, each with what it says it creates.
fn steps() -> Vec<Step> {
    let zone: Vec<String> = INGRESS_OBJECTS
        .iter()
        .map(|o| {
            o.replace(
                "istio-ingress-handler-trellis/",
                "istio-ingress-handler-trellis--eu-1a/",
            )
            .replace(
                "ClusterRoleBinding trellis-controller",
                "ClusterRoleBinding trellis-controller-eu-1a",
            )
        })
        .collect();
    let with_tunnel: Vec<String> = INGRESS_OBJECTS
        .iter()
        .map(|o| (*o).to_owned())
        .chain(["NetworkPolicy istio-ingress-handler-trellis/trellis-gateway-to-tunnel".to_owned()])
        .collect();
    let leak = |v: Vec<String>| -> &'static [&'static str] {
        Vec::leak(v.into_iter().map(|s| &*String::leak(s)).collect())
    };
    vec![
        Step {
            dir: "seed/gateway",
            creates: &INGRESS_OBJECTS,
            secrets: &[],
            rule: ingress_alone,
        },
        Step {
            dir: "seed/zone",
            creates: leak(zone),
            secrets: &[],
            rule: ingress_alone,
        },
        Step {
            dir: "seed/gateway-with-tunnel",
            creates: leak(with_tunnel),
            secrets: &[],
            rule: ingress_alone,
        },
        Step {
            dir: "seed/tunnel",
            creates: &[
                "Namespace trellis-ingress",
                "ServiceAccount trellis-ingress/trellis-tunnel",
                "ClusterRole trellis-tunnel-controller",
                "ClusterRoleBinding trellis-tunnel-controller",
                "ConfigMap trellis-ingress/trellis-tunnel-0-config",
                "ConfigMap trellis-ingress/trellis-tunnel-1-config",
                "ConfigMap trellis-ingress/trellis-tunnel-controller-config",
                "Service trellis-ingress/trellis-egress",
                "Service trellis-ingress/trellis-tunnel-0",
                "Service trellis-ingress/trellis-tunnel-1",
                "Service trellis-ingress/trellis-tunnel-metrics",
                "Service trellis-ingress/trellis-wireguard-0",
                "Service trellis-ingress/trellis-wireguard-1",
                "Deployment trellis-ingress/trellis-tunnel-0",
                "Deployment trellis-ingress/trellis-tunnel-1",
                "PodDisruptionBudget trellis-ingress/trellis-tunnel",
                "NetworkPolicy trellis-ingress/trellis-tunnel",
            ],
            secrets: &["trellis-egress-tls", "trellis-wireguard-key"],
            rule: tunnel_alone,
        },
        Step {
            dir: "monitoring",
            creates: &[
                "ConfigMap garden/trellis-dashboards",
                "PodMonitor garden/aggregate-trellis",
                "PrometheusRule garden/aggregate-trellis",
            ],
            secrets: &[],
            rule: |o| in_namespace(o, Some("garden")),
        },
        Step {
            dir: "monitoring/shoot",
            creates: &[
                "ConfigMap trellis-dashboards",
                "PrometheusRule shoot-trellis",
                "ScrapeConfig shoot-trellis-agent",
                "ScrapeConfig shoot-trellis-node",
            ],
            secrets: &[],
            rule: |o| in_namespace(o, None),
        },
        Step {
            dir: "extension",
            creates: &[
                "ControllerDeployment extension-trellis",
                "ControllerRegistration extension-trellis",
            ],
            secrets: &[],
            rule: |_| Ok(()),
        },
        Step {
            dir: "shoot",
            creates: &[
                "ConfigMap kube-system/trellis-node",
                "DaemonSet kube-system/trellis-node",
            ],
            secrets: &[],
            rule: |o| in_namespace(o, Some("kube-system")),
        },
        Step {
            dir: "agent",
            creates: &[
                "ServiceAccount kube-system/trellis-agent",
                "ConfigMap kube-system/trellis-agent",
                "StatefulSet kube-system/trellis-agent",
                "PodDisruptionBudget kube-system/trellis-agent",
                "NetworkPolicy kube-system/trellis-agent",
                "NetworkPolicy kube-system/trellis-allow-from-seed",
            ],
            secrets: &["trellis-agent-keys"],
            rule: |o| in_namespace(o, Some("kube-system")),
        },
    ]
}

/// `Kind namespace/name` of each object (cluster-scoped: `Kind name`), a ConfigMap whose
/// name carries kustomize's hash suffix without it, sorted.
fn inventory(objects: &[Value]) -> Vec<String> {
    let hashed: Vec<String> = objects
        .iter()
        .flat_map(all_pod_specs)
        .flat_map(|pod| pod["volumes"].as_array().into_iter().flatten())
        .filter_map(|v| v["configMap"]["name"].as_str().map(str::to_owned))
        .collect();
    let mut names: Vec<String> = objects
        .iter()
        .map(|o| {
            let mut name = o["metadata"]["name"].as_str().unwrap().to_owned();
            if o["kind"] == "ConfigMap"
                && hashed.contains(&name)
                && let Some((base, suffix)) = name.rsplit_once('-')
                && suffix.len() == 10
            {
                name = base.to_owned();
            }
            match o["metadata"]["namespace"].as_str() {
                Some(ns) => format!("{} {ns}/{name}", o["kind"].as_str().unwrap()),
                None => format!("{} {name}", o["kind"].as_str().unwrap()),
            }
        })
        .collect();
    names.sort();
    names
}

/// The pod spec of a workload, if `object` is one.
fn all_pod_specs(object: &Value) -> Option<&Value> {
    ["Deployment", "DaemonSet", "StatefulSet"]
        .contains(&object["kind"].as_str().unwrap_or(""))
        .then(|| &object["spec"]["template"]["spec"])
}

/// A step stands alone: what its objects refer to is among them (every ConfigMap a pod
/// mounts, every pod's service account, every binding's role), except the Secrets its pods
/// mount, which it returns (the operator creates them).
fn stands_alone(objects: &[Value]) -> Result<Vec<String>, String> {
    let has = |kind: &str, namespace: &Value, name: &str| {
        objects.iter().any(|o| {
            o["kind"] == kind
                && o["metadata"]["name"] == name
                && (namespace.is_null() || &o["metadata"]["namespace"] == namespace)
        })
    };
    let mut secrets = Vec::new();
    for workload in objects.iter().filter(|o| all_pod_specs(o).is_some()) {
        let namespace = &workload["metadata"]["namespace"];
        let pod = all_pod_specs(workload).unwrap();
        let account = pod["serviceAccountName"].as_str().unwrap_or("default");
        ensure!(
            account == "default" || has("ServiceAccount", namespace, account),
            "{} runs as service account {account}, which the step does not create",
            workload["metadata"]["name"]
        );
        for v in pod["volumes"].as_array().into_iter().flatten() {
            if let Some(cm) = v["configMap"]["name"].as_str() {
                ensure!(
                    has("ConfigMap", namespace, cm),
                    "{} mounts the ConfigMap {cm}, which the step does not create",
                    workload["metadata"]["name"]
                );
            }
            if let Some(secret) = v["secret"]["secretName"].as_str() {
                secrets.push(secret.to_owned());
            }
        }
    }
    for binding in objects
        .iter()
        .filter(|o| o["kind"] == "ClusterRoleBinding" || o["kind"] == "RoleBinding")
    {
        let role = &binding["roleRef"];
        let namespace = if role["kind"] == "Role" {
            &binding["metadata"]["namespace"]
        } else {
            &Value::Null
        };
        ensure!(
            has(
                role["kind"].as_str().unwrap(),
                namespace,
                role["name"].as_str().unwrap()
            ),
            "{} binds the {} {}, which the step does not create",
            binding["metadata"]["name"],
            role["kind"],
            role["name"]
        );
    }
    secrets.sort();
    secrets.dedup();
    Ok(secrets)
}

/// The (API group, resource) pairs any ClusterRole or Role among `objects` grants.
fn granted(objects: &[Value]) -> Vec<(String, String)> {
    objects
        .iter()
        .filter(|o| o["kind"] == "ClusterRole" || o["kind"] == "Role")
        .flat_map(|r| r["rules"].as_array().into_iter().flatten())
        .flat_map(rule_resources)
        .collect()
}

/// The ingress gateway's step (the handler's, a zone's, or with the hand-off to the tunnel
/// gateway) as docs/gardener.md says it: everything in the handler's namespaces, which
/// gardenlet owns (so no Namespace), no access to Secrets or Clusters, no UDP load balancer,
/// no pod waiting for a Secret, no workload but the gateway.
fn ingress_alone(objects: &[Value]) -> Result<(), String> {
    for o in objects {
        let what = format!("{} {}", o["kind"], o["metadata"]["name"]);
        ensure!(
            o["kind"] != "Namespace",
            "the ingress step creates the {what}"
        );
        if let Some(ns) = o["metadata"]["namespace"].as_str() {
            ensure!(
                ns.starts_with("istio-ingress-handler-trellis"),
                "the ingress step puts {what} into {ns}"
            );
        }
        for port in o["spec"]["ports"].as_array().into_iter().flatten() {
            ensure!(
                o["kind"] != "Service" || port["protocol"] != "UDP",
                "the ingress step's {what} has a UDP port: {port}"
            );
        }
        if all_pod_specs(o).is_some() {
            ensure!(
                o["metadata"]["name"] == "trellis-gateway",
                "the ingress step runs {what}"
            );
        }
    }
    for (group, resource) in granted(objects) {
        ensure!(
            !["secrets", "clusters", "*"].contains(&resource.as_str()),
            "the ingress step grants {resource} of group {group:?}"
        );
    }
    let secrets = stands_alone(objects)?;
    ensure!(
        secrets.is_empty(),
        "the ingress step's pods wait for the Secrets {secrets:?}"
    );
    Ok(())
}

/// The tunnel gateway's step: everything in its own namespace `trellis-ingress`, which it
/// creates, its accounts bound there, nothing in a handler's namespace.
fn tunnel_alone(objects: &[Value]) -> Result<(), String> {
    for o in objects {
        let what = format!("{} {}", o["kind"], o["metadata"]["name"]);
        if o["kind"] == "Namespace" {
            ensure!(
                o["metadata"]["name"] == "trellis-ingress",
                "the tunnel step creates the {what}"
            );
        } else if let Some(ns) = o["metadata"]["namespace"].as_str() {
            ensure!(
                ns == "trellis-ingress",
                "the tunnel step puts {what} into {ns}"
            );
        }
        for subject in o["subjects"].as_array().into_iter().flatten() {
            ensure!(
                subject["namespace"] == "trellis-ingress",
                "the tunnel step's {what} binds {subject}"
            );
        }
    }
    Ok(())
}

/// Every object in `namespace` (`None`: no object names one, so `kubectl -n` puts them where
/// the operator says), and no Namespace created.
fn in_namespace(objects: &[Value], namespace: Option<&str>) -> Result<(), String> {
    for o in objects {
        let what = format!("{} {}", o["kind"], o["metadata"]["name"]);
        ensure!(o["kind"] != "Namespace", "the step creates the {what}");
        ensure!(
            o["metadata"]["namespace"].as_str() == namespace,
            "the step puts {what} into {}, not {namespace:?}",
            o["metadata"]["namespace"]
        );
    }
    Ok(())
}

/// `Err` unless `objects`, rendered from `step.dir`, are exactly what the step says it
/// creates, keep its rule, stand alone, and mount no Secret but those it names.
fn step_rules(step: &Step, objects: &[Value]) -> Result<(), String> {
    let mut creates: Vec<String> = step.creates.iter().map(|c| (*c).to_owned()).collect();
    creates.sort();
    let made = inventory(objects);
    ensure!(
        made == creates,
        "deploy/{} creates {made:#?}, its step says {creates:#?}",
        step.dir
    );
    (step.rule)(objects).map_err(|e| format!("deploy/{}: {e}", step.dir))?;
    let secrets = stands_alone(objects).map_err(|e| format!("deploy/{}: {e}", step.dir))?;
    ensure!(
        secrets == step.secrets,
        "deploy/{}: its pods mount the Secrets {secrets:?}, its step names {:?}",
        step.dir,
        step.secrets
    );
    Ok(())
}

/// The objects of kinds the Kubernetes schemas know (not Gardener's or
/// prometheus-operator's custom resources).
fn core_objects(objects: &[Value]) -> Vec<Value> {
    objects
        .iter()
        .filter(|o| {
            let api = o["apiVersion"].as_str().unwrap();
            !api.starts_with("monitoring.coreos.com/") && !api.starts_with("core.gardener.cloud/")
        })
        .cloned()
        .collect()
}

/// Every `kubectl apply -k`, `delete -k` and `kustomize` the README and `docs/` show renders,
/// creates exactly what its step says and keeps the step's rule (the ingress step: no
/// namespace, no Secret access, no UDP Service, no pod waiting for a Secret; the tunnel
/// gateway's: its own namespace and RBAC; monitoring: nothing outside `garden`), stands
/// alone, and validates against the Kubernetes schemas. A documented command without a step
/// here fails, as does a step no document shows. The Secrets a step's pods wait for are the
/// ones the README says how to create, and a native sidecar's Kubernetes version is stated.
#[test]
fn documented_kustomizations_create_only_what_their_step_says_and_validate() {
    let Some(validator) =
        tools("documented_kustomizations_create_only_what_their_step_says_and_validate")
    else {
        return;
    };
    let documented = documented_kustomizations();
    let steps = steps();
    for d in &documented {
        assert!(
            steps.iter().any(|s| s.dir == d.dir),
            "{}: `deploy/{}` is documented but no step of this test says what it creates",
            d.at,
            d.dir
        );
    }
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let gardener = std::fs::read_to_string(repo().join("docs/gardener.md")).unwrap();
    let mut sidecars = false;
    for step in &steps {
        assert!(
            documented.iter().any(|d| d.dir == step.dir),
            "no `kubectl apply -k deploy/{}` or `kubectl kustomize deploy/{}` in the docs",
            step.dir,
            step.dir
        );
        let objects = render(step.dir);
        step_rules(step, &objects).unwrap();
        for secret in step.secrets {
            assert!(
                readme.contains(&format!("create secret generic {secret}")),
                "deploy/{}: the README does not say how to create the Secret {secret}",
                step.dir
            );
        }
        if let Err(report) = validate(&validator, &core_objects(&objects)) {
            panic!("deploy/{}: {report}", step.dir);
        }
        sidecars |= objects
            .iter()
            .filter_map(all_pod_specs)
            .flat_map(|pod| pod["initContainers"].as_array().into_iter().flatten())
            .any(|c| c["restartPolicy"] == "Always");
    }
    assert!(
        sidecars,
        "no step runs a native sidecar: update the Kubernetes version below"
    );
    for (doc, text) in [("README.md", &readme), ("docs/gardener.md", &gardener)] {
        assert!(
            text.contains("Kubernetes 1.29 or later"),
            "{doc} does not say the native sidecar needs Kubernetes 1.29 or later"
        );
    }
}

/// The control for the test above: the old all-in-one seed (ingress and tunnel gateway in
/// one step), the monitoring NetworkPolicy of an example zone, a tunnel gateway bound to
/// the ingress gateway's ClusterRole, an object more than the step says, and a command the
/// docs show without a step all fail; so does the extraction missing a wrapped command.
#[test]
fn a_step_that_applies_more_than_it_says_fails() {
    if !kubectl("a_step_that_applies_more_than_it_says_fails") {
        return;
    }
    let steps = steps();
    let step = |dir: &str| steps.iter().find(|s| s.dir == dir).unwrap();
    let ingress = step(INGRESS);
    // The ingress step that also applies the tunnel gateway.
    let mut both = render(INGRESS);
    both.extend(render("seed/tunnel"));
    let e = ingress_alone(&both).unwrap_err();
    assert!(e.contains("creates the \"Namespace\""), "{e}");
    let without_namespace: Vec<Value> = both
        .iter()
        .filter(|o| o["kind"] != "Namespace")
        .cloned()
        .collect();
    let e = ingress_alone(&without_namespace).unwrap_err();
    assert!(e.contains("into trellis-ingress"), "{e}");
    let e = step_rules(ingress, &both).unwrap_err();
    assert!(e.contains("its step says"), "{e}");
    // Each of the ingress rules on its own.
    let mut udp = render(INGRESS);
    find_mut(&mut udp, "Service", "trellis-gateway")["spec"]["ports"][0]["protocol"] = json!("UDP");
    assert!(ingress_alone(&udp).unwrap_err().contains("UDP port"));
    let mut secrets = render(INGRESS);
    rule_mut(&mut secrets, 1)["resources"]
        .as_array_mut()
        .unwrap()
        .push(json!("secrets"));
    assert!(
        ingress_alone(&secrets)
            .unwrap_err()
            .contains("grants secrets")
    );
    let mut waits = render(INGRESS);
    pod_mut(&mut waits)["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "key", "secret": {"secretName": "trellis-wireguard-key"}}));
    let e = ingress_alone(&waits).unwrap_err();
    assert!(e.contains("wait for the Secrets"), "{e}");
    // Monitoring with the NetworkPolicy of the example zone's namespace.
    let mut monitoring = render("monitoring");
    monitoring.push(
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "trellis-from-seed-prometheus",
            "namespace": "istio-ingress-handler-trellis--eu-1a"}, "spec": {"podSelector": {}}}),
    );
    let e = step_rules(step("monitoring"), &monitoring).unwrap_err();
    assert!(e.contains("its step says"), "{e}");
    let e = (step("monitoring").rule)(&monitoring).unwrap_err();
    assert!(e.contains("istio-ingress-handler-trellis--eu-1a"), "{e}");
    // The tunnel gateway bound to the ingress gateway's ClusterRole, which it does not bring.
    let mut tunnel = render("seed/tunnel");
    find_mut(
        &mut tunnel,
        "ClusterRoleBinding",
        "trellis-tunnel-controller",
    )["roleRef"]["name"] = json!("trellis-controller");
    let e = step_rules(step("seed/tunnel"), &tunnel).unwrap_err();
    assert!(e.contains("which the step does not create"), "{e}");
    // A Secret the step does not name.
    let mut tunnel = render("seed/tunnel");
    tunnel_pod_mut(&mut tunnel, "trellis-tunnel-0")["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "x", "secret": {"secretName": "trellis-more"}}));
    let e = step_rules(step("seed/tunnel"), &tunnel).unwrap_err();
    assert!(e.contains("trellis-more"), "{e}");
    // The extraction: one command split over two lines, another in a code block with a
    // comment after it.
    let dir = TestDir::new("documented");
    let words = "A `kubectl apply -k\n  deploy/seed/gateway` restores it.\n\n```sh\nkubectl -n x apply -k deploy/monitoring/shoot   # per shoot\nkubectl kustomize deploy/nothing-here\n```\n";
    std::fs::write(dir.path("x.md"), words).unwrap();
    let found = documented_in(&[dir.path("x.md")]);
    let dirs: Vec<&str> = found.iter().map(|d| d.dir.as_str()).collect();
    assert_eq!(dirs, ["seed/gateway", "monitoring/shoot", "nothing-here"]);
    assert!(
        !steps.iter().any(|s| s.dir == "nothing-here"),
        "a documented directory without a step is caught by the test above"
    );
}
/// The controller configuration of the gateway Deployment in `objects`, parsed.
fn ingress_controller_config(objects: &[Value]) -> Value {
    config_in(
        objects,
        find(objects, "Deployment", "trellis-gateway"),
        "controller",
    )
    .0
}

/// The tunnel gateway's hand-off (`deploy/seed/tunnel-handoff`, a Component) changes the
/// gateway it is applied with by its `extraRoutes` alone, the ones that lead to the tunnel
/// replicas, and adds the NetworkPolicy to them: for the handler's gateway
/// (`seed/gateway-with-tunnel`) and for a zone's copy (an overlay of `seed/zone` naming the
/// component, as the README says), whose own configuration it keeps.
#[test]
fn tunnel_handoff_adds_only_its_routes_to_any_ingress_gateway() {
    if !kubectl("tunnel_handoff_adds_only_its_routes_to_any_ingress_gateway") {
        return;
    }
    // A zone's overlay with the component, beside the repository (kustomize takes relative
    // paths only).
    let dir = TestDir::new("zone-handoff");
    let up = "../".repeat(dir.0.components().count() - 1);
    let deploy = format!(
        "{up}{}",
        repo()
            .join("deploy")
            .to_str()
            .unwrap()
            .trim_start_matches('/')
    );
    std::fs::write(
        dir.path("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
             namespace: istio-ingress-handler-trellis--eu-1a\n\
             resources: [{deploy}/seed/zone]\ncomponents: [{deploy}/seed/tunnel-handoff]\n"
        ),
    )
    .unwrap();
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(&dir.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let zone_with: Vec<Value> =
        serde_saphyr::from_multiple::<Value>(&String::from_utf8(out.stdout).unwrap())
            .unwrap()
            .into_iter()
            .filter(|v| !v.is_null())
            .collect();
    let tunnel = render("seed/tunnel");
    let destinations: Vec<Value> = ["trellis-tunnel-0", "trellis-tunnel-1"]
        .iter()
        .map(|n| {
            let config = config_in(&tunnel, find(&tunnel, "Deployment", n), "trellis").0;
            listener(&config, "wireguard").unwrap()["wireguard"]["connectDestination"].clone()
        })
        .collect();
    for (alone, with) in [
        (render(INGRESS), render("seed/gateway-with-tunnel")),
        (render("seed/zone"), zone_with),
    ] {
        let mut before = ingress_controller_config(&alone);
        let mut after = ingress_controller_config(&with);
        assert_eq!(
            before["extraRoutes"],
            json!([]),
            "the gateway alone hands nothing on"
        );
        let routes = after["extraRoutes"].as_array().unwrap().clone();
        let handed: Vec<Value> = routes
            .iter()
            .map(|r| r["destinations"][0].clone())
            .collect();
        assert_eq!(handed, destinations, "{routes:?}");
        for r in &routes {
            assert_eq!(r["forwardConnect"], true, "{r}");
            let backend = r["backends"][0]["address"].as_str().unwrap();
            assert!(backend.contains(".trellis-ingress.svc."), "{backend}");
        }
        before.as_object_mut().unwrap().remove("extraRoutes");
        after.as_object_mut().unwrap().remove("extraRoutes");
        assert_eq!(before, after, "the hand-off changes more than extraRoutes");
        let namespace =
            find(&alone, "Deployment", "trellis-gateway")["metadata"]["namespace"].clone();
        let policy = find(&with, "NetworkPolicy", "trellis-gateway-to-tunnel");
        assert_eq!(policy["metadata"]["namespace"], namespace);
        let (ok, out) = {
            let root = TestDir::new("handoff-check");
            let file = lay_out(
                &with,
                find(&with, "Deployment", "trellis-gateway"),
                "controller",
                &root.0,
            );
            check(&file)
        };
        assert!(ok, "{out}");
    }
}

/// The control: the validator rejects an unknown field in a container and a wrongly typed
/// value, and `trellis check` rejects a config with a misspelt field, so the test above
/// cannot pass by checking nothing.
#[test]
fn a_broken_manifest_or_config_fails() {
    let Some(validator) = tools("a_broken_manifest_or_config_fails") else {
        return;
    };
    let objects = render(INGRESS);
    let deployment = objects
        .iter()
        .position(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "trellis-gateway")
        .unwrap();
    let mut unknown = objects.clone();
    unknown[deployment]["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] =
        json!({"httpGet": {"path": "/ready", "port": "admin"}});
    let err = validate(&validator, &unknown).unwrap_err();
    assert!(err.contains("'readinesProbe' was unexpected"), "{err}");
    let mut mistyped = objects.clone();
    mistyped[deployment]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] =
        json!("90s");
    let err = validate(&validator, &mistyped).unwrap_err();
    assert!(err.contains("terminationGracePeriodSeconds"), "{err}");

    let dir = TestDir::new("deploy-typo");
    let file = lay_out_config(&objects, &objects[deployment], &dir.0);
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(
        &file,
        text.replacen("  maxConnections:", "  maxConection:", 1),
    )
    .unwrap();
    let (ok, out) = check(&file);
    assert!(
        !ok && out.contains("limits.maxConection: unknown field"),
        "{out}"
    );
}

/// Each container's config, laid out as its volumes mount it, passes `trellis check`. In the
/// seed pods a gateway's does only once a routing table is where the gateway looks for it:
/// the table `trellis controller render` makes with the controller's config, written where
/// that config says and shared through the pod's volumes as the kubelet shares them. Its
/// listeners' default routes are in that table (`check` requires it). The Secrets the
/// manifests name but never hold (the tunnel gateway's key and certificate, the agents'
/// keys) hold the demo material of `config/`. Each agent pod sees its own config.
#[test]
fn embedded_configs_pass_check_where_the_pods_mount_them() {
    if !kubectl("embedded_configs_pass_check_where_the_pods_mount_them") {
        return;
    }
    let objects = render("shoot");
    let root = TestDir::new("deploy-mounts");
    let file = lay_out_config(&objects, workloads(&objects).next().unwrap(), &root.0);
    let (ok, out) = check(&file);
    assert!(ok && out.contains("valid NodeConfiguration"), "{out}");

    let objects = render(INGRESS);
    check_seed_pod(&objects, "trellis-gateway");
    let objects = seed_with_tunnel();
    for name in ["trellis-gateway", "trellis-tunnel-0", "trellis-tunnel-1"] {
        check_seed_pod(&objects, name);
    }

    let objects = render("agent");
    let statefulset = find(&objects, "StatefulSet", "trellis-agent");
    for ordinal in 0..statefulset["spec"]["replicas"].as_u64().unwrap() as usize {
        let root = TestDir::new("deploy-mounts");
        let pod = pod_name(statefulset, ordinal);
        let file = lay_out_pod(&objects, statefulset, "trellis", &root.0, &pod);
        let (ok, out) = check(&file);
        assert!(
            ok && out.contains("valid AgentConfiguration"),
            "{pod}: {out}"
        );
    }
}

/// The seed Deployment `name`'s controller and gateway configs pass `check`, the gateway's
/// once the controller's table is where it reads it (and not before).
fn check_seed_pod(objects: &[Value], name: &str) {
    let deployment = find(objects, "Deployment", name);
    let root = TestDir::new("deploy-mounts");
    let controller = lay_out(objects, deployment, "controller", &root.0);
    let gateway = lay_out(objects, deployment, "trellis", &root.0);
    let (ok, out) = check(&controller);
    assert!(
        ok && out.contains("valid ControllerConfiguration"),
        "{name}: {out}"
    );
    let (ok, out) = check(&gateway);
    assert!(
        !ok && out.contains("cannot read the routing table"),
        "{name}: the gateway has a table before the controller wrote one: {out}"
    );

    let manifests = root.path("manifests");
    std::fs::create_dir(&manifests).unwrap();
    let rendered = Command::new(BIN)
        .args(["controller", "render", "--manifests"])
        .arg(&manifests)
        .arg("--config")
        .arg(&controller)
        .output()
        .unwrap();
    assert!(
        rendered.status.success(),
        "{}",
        String::from_utf8_lossy(&rendered.stderr)
    );
    let config: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(&controller).unwrap()).unwrap();
    let output = controller
        .parent()
        .unwrap()
        .join(config["output"]["file"].as_str().unwrap());
    std::fs::write(&output, &rendered.stdout).unwrap();
    share(deployment, "controller", &root.0);
    let (ok, out) = check(&gateway);
    assert!(
        ok && out.contains("valid GatewayConfiguration"),
        "{name}: {out}"
    );
}

#[test]
fn seed_gateway_survives_rollouts_zones_and_evictions() {
    if !kubectl("seed_gateway_survives_rollouts_zones_and_evictions") {
        return;
    }
    let objects = render(INGRESS);
    let deployment = find(&objects, "Deployment", "trellis-gateway");
    let config = config_of(&objects, deployment);
    let spec = &deployment["spec"];
    let pod = &spec["template"]["spec"];
    let container = &pod["containers"][0];
    assert!(spec["replicas"].as_u64().unwrap() >= 2);
    assert_eq!(
        spec["strategy"]["rollingUpdate"],
        json!({"maxUnavailable": 0, "maxSurge": 1})
    );
    let spread: Vec<&str> = pod["topologySpreadConstraints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["topologyKey"].as_str().unwrap())
        .collect();
    assert!(
        spread.contains(&"topology.kubernetes.io/zone"),
        "{spread:?}"
    );
    assert!(spread.contains(&"kubernetes.io/hostname"), "{spread:?}");
    assert_lifecycle(deployment, &config, Duration::from_secs(5));

    // Non-root, read-only, no capabilities, RuntimeDefault seccomp.
    let pod_security = &pod["securityContext"];
    assert_eq!(pod_security["runAsNonRoot"], true);
    assert_eq!(pod_security["runAsUser"], 65532);
    assert_eq!(pod_security["seccompProfile"]["type"], "RuntimeDefault");
    assert!(container["securityContext"]["capabilities"]["add"].is_null());
    assert!(container["securityContext"]["runAsUser"].is_null());

    // The zone comes from the pod's topology label, and the file sets none.
    let zone = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "TRELLIS_ZONE")
        .expect("TRELLIS_ZONE");
    assert_eq!(
        zone["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.labels['topology.kubernetes.io/zone']"
    );
    assert!(config["zone"].is_null());
    // /routes names every backend: loopback only.
    let debug = config["admin"]["debugAddress"].as_str().unwrap();
    assert!(debug.starts_with("127.0.0.1:"), "{debug}");

    // The load balancer: 443 -> the sni listener (9443), 8443 and 8132 -> the CONNECT
    // listeners; every port reaches a listener, the admin port is not on it.
    let lb = find(&objects, "Service", "trellis-gateway");
    assert_eq!(lb["spec"]["type"], "LoadBalancer");
    assert!(lb["spec"]["externalTrafficPolicy"].is_string());
    let listeners = config["listeners"].as_array().unwrap();
    let listener_on = |port: u64| {
        listeners
            .iter()
            .find(|l| port_of(l["address"].as_str().unwrap()) == port)
    };
    let mut exposed = Vec::new();
    for p in lb["spec"]["ports"].as_array().unwrap() {
        let target = container_port(container, &p["targetPort"]);
        let listener =
            listener_on(target).unwrap_or_else(|| panic!("Service port {p} reaches no listener"));
        let address = listener["address"].as_str().unwrap();
        assert!(address.starts_with("0.0.0.0:"), "{address}");
        exposed.push((
            p["port"].as_u64().unwrap(),
            target,
            listener["protocol"].as_str().unwrap(),
        ));
    }
    exposed.sort();
    assert_eq!(
        exposed,
        [
            (443, 9443, "sni"),
            (8132, 8132, "http-connect"),
            (8443, 8443, "http-connect")
        ]
    );
    let admin = port_of(config["admin"]["address"].as_str().unwrap());
    assert!(exposed.iter().all(|(_, target, _)| *target != admin));
    let metrics = find(&objects, "Service", "trellis-gateway-metrics");
    assert_eq!(metrics["spec"]["type"], "ClusterIP");
    assert_eq!(
        container_port(container, &metrics["spec"]["ports"][0]["targetPort"]),
        admin
    );

    // Every Service, the PDB and the HPA select or target these pods.
    let labels = &spec["template"]["metadata"]["labels"];
    let selects = |selector: &Value| {
        selector
            .as_object()
            .unwrap()
            .iter()
            .all(|(k, v)| &labels[k] == v)
    };
    assert!(selects(&lb["spec"]["selector"]));
    assert!(selects(&metrics["spec"]["selector"]));
    let pdb = find(&objects, "PodDisruptionBudget", "trellis-gateway");
    assert!(selects(&pdb["spec"]["selector"]["matchLabels"]));
    assert!(pdb["spec"]["maxUnavailable"] == 1 || pdb["spec"]["minAvailable"] == 1);
    let hpa = find(&objects, "HorizontalPodAutoscaler", "trellis-gateway");
    assert_eq!(hpa["apiVersion"], "autoscaling/v2");
    assert_eq!(
        hpa["spec"]["scaleTargetRef"],
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": "trellis-gateway"})
    );
    assert!(hpa["spec"]["minReplicas"].as_u64().unwrap() >= 2);
    let cpu = &hpa["spec"]["metrics"][0]["containerResource"];
    assert_eq!(cpu["name"], "cpu");
    assert_eq!(cpu["container"], container["name"], "the gateway's CPU");

    // The configs are mounted read-only.
    for m in container["volumeMounts"].as_array().unwrap() {
        assert_eq!(m["readOnly"], true, "{m}");
    }
}

#[test]
fn shoot_node_daemonset_manages_the_address_with_two_capabilities() {
    if !kubectl("shoot_node_daemonset_manages_the_address_with_two_capabilities") {
        return;
    }
    let objects = render("shoot");
    let daemonset = find(&objects, "DaemonSet", "trellis-node");
    let config = config_of(&objects, daemonset);
    let pod = &daemonset["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    assert_eq!(pod["tolerations"], json!([{"operator": "Exists"}]));
    let security = &pod["containers"][0]["securityContext"];
    assert_eq!(
        security["capabilities"]["add"],
        json!(["NET_ADMIN", "NET_BIND_SERVICE"])
    );
    assert_eq!(security["seccompProfile"]["type"], "RuntimeDefault");
    // The node rejects drainDelay: none to wait for.
    assert!(config["timeouts"]["drainDelay"].is_null());
    assert_lifecycle(daemonset, &config, Duration::ZERO);
}

/// `path` with `.` and `..` resolved as the kernel does where no component is a link.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// The mount of `container` that `path` is on (the longest mount path above it) and the
/// path inside the volume (after a `subPath`, if any).
fn mount_at<'a>(container: &'a Value, path: &Path) -> Option<(&'a Value, PathBuf)> {
    container["volumeMounts"]
        .as_array()?
        .iter()
        .filter(|m| path.starts_with(m["mountPath"].as_str().unwrap()))
        .max_by_key(|m| m["mountPath"].as_str().unwrap().len())
        .map(|m| {
            let rest = path.strip_prefix(m["mountPath"].as_str().unwrap()).unwrap();
            let inside = Path::new(m["subPath"].as_str().unwrap_or("")).join(rest);
            (m, inside)
        })
}

/// Where in-cluster clients read the token, the CA and the namespace.
const TOKEN_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The controller sidecar of the seed Deployment `name` and what it depends on; `Err` names
/// the first rule broken. `watched` is what the controller watches (the ClusterRole must
/// grant exactly that).
fn controller_wiring(objects: &[Value], name: &str, watched: &[WatchedKind]) -> Result<(), String> {
    let deployment = find(objects, "Deployment", name);
    let pod = &deployment["spec"]["template"]["spec"];
    let gateway = &pod["containers"][0];
    let Some(sidecar) = pod["initContainers"]
        .as_array()
        .and_then(|l| l.iter().find(|c| c["name"] == "controller"))
    else {
        return Err("no init container named controller".into());
    };
    // A native sidecar: started before the gateway, kept running, stopped after it.
    ensure!(
        sidecar["restartPolicy"] == "Always",
        "the controller is not a native sidecar (restartPolicy: Always)"
    );
    ensure!(sidecar["image"] == gateway["image"], "images differ");
    ensure!(
        sidecar["securityContext"] == gateway["securityContext"],
        "the controller's security context is not the gateway's: {}",
        sidecar["securityContext"]
    );
    ensure!(
        sidecar["resources"]["limits"]["memory"].is_string(),
        "the controller has no memory limit"
    );
    let (gw_config, gw_file) = config_in(objects, deployment, "trellis");
    let (ctl_config, ctl_file) = config_in(objects, deployment, "controller");

    // The table: the gateway reads it on a volume it mounts read-only, where the controller
    // writes it on the same volume, writable, and the temporary file renamed over it is
    // there too (the root file system is read-only, and a rename does not cross volumes).
    let routes = normalize(
        &gw_file
            .parent()
            .unwrap()
            .join(gw_config["routes"]["file"].as_str().unwrap()),
    );
    let output = normalize(
        &ctl_file
            .parent()
            .unwrap()
            .join(ctl_config["output"]["file"].as_str().unwrap()),
    );
    let temporary = trellis::controller::temporary_file(&output);
    let Some((gw_mount, gw_inside)) = mount_at(gateway, &routes) else {
        return Err(format!(
            "routes.file {routes:?} is on no volume of the gateway"
        ));
    };
    ensure!(
        gw_mount["readOnly"] == true,
        "the gateway mounts the table's volume writable"
    );
    let Some((ctl_mount, ctl_inside)) = mount_at(sidecar, &output) else {
        return Err(format!(
            "output.file {output:?} is on no volume of the controller"
        ));
    };
    ensure!(
        ctl_mount["name"] == gw_mount["name"] && ctl_inside == gw_inside,
        "the controller writes {ctl_inside:?} on volume {}, the gateway reads {gw_inside:?} \
         on volume {}",
        ctl_mount["name"],
        gw_mount["name"]
    );
    ensure!(
        ctl_mount["readOnly"] != true,
        "the controller mounts the table's volume read-only"
    );
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == ctl_mount["name"])
        .unwrap();
    ensure!(
        volume["emptyDir"].is_object(),
        "the table's volume is not a writable emptyDir: {volume}"
    );
    match mount_at(sidecar, &temporary) {
        Some((m, _)) if m["name"] == ctl_mount["name"] && m["subPath"].is_null() => {}
        _ => {
            return Err(format!(
                "the temporary file {temporary:?} is not on the table's volume"
            ));
        }
    }

    // The kubelet starts the gateway once the controller's /ready answers: the first table
    // is written. The controller's admin port is its own in the pod's network namespace.
    let admin = ctl_config["admin"]["address"].as_str().unwrap();
    ensure!(
        !admin.starts_with("127.") && !admin.starts_with("[::1]"),
        "the kubelet cannot probe {admin}"
    );
    let admin = port_of(admin);
    for (probe, path) in [("startupProbe", "/ready"), ("livenessProbe", "/live")] {
        let get = &sidecar[probe]["httpGet"];
        ensure!(get["path"] == path, "{probe}: {get}");
        ensure!(
            container_port(sidecar, &get["port"]) == admin,
            "the controller's {probe} port is not its admin port {admin}: {get}"
        );
    }
    ensure!(
        sidecar["readinessProbe"].is_null(),
        "a readiness probe on the sidecar takes the pod out of the Service while the \
         controller restarts"
    );
    let mut taken: Vec<u64> = gw_config["listeners"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| port_of(l["address"].as_str().unwrap()))
        .collect();
    taken.push(port_of(gw_config["admin"]["address"].as_str().unwrap()));
    if let Some(debug) = gw_config["admin"]["debugAddress"].as_str() {
        taken.push(port_of(debug));
    }
    ensure!(
        !taken.contains(&admin),
        "the controller's admin port {admin} is the gateway's too"
    );

    // The API token: in the controller only.
    ensure!(
        pod["automountServiceAccountToken"] == false,
        "the pod mounts the API token into every container"
    );
    let token_volumes: Vec<&Value> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| {
            v["projected"]["sources"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| s["serviceAccountToken"].is_object()))
        })
        .collect();
    for c in all_containers(pod) {
        for m in c["volumeMounts"].as_array().unwrap() {
            ensure!(
                c["name"] == "controller" || !token_volumes.iter().any(|v| v["name"] == m["name"]),
                "container {} mounts the API token ({})",
                c["name"],
                m["name"]
            );
        }
    }
    let Some((m, _)) = mount_at(sidecar, &Path::new(TOKEN_PATH).join("token")) else {
        return Err(format!("the controller has nothing at {TOKEN_PATH}"));
    };
    let Some(volume) = token_volumes.iter().find(|v| v["name"] == m["name"]) else {
        return Err(format!("{TOKEN_PATH} in the controller holds no token"));
    };
    let mut paths: Vec<&str> = volume["projected"]["sources"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| {
            let items = s["configMap"]["items"]
                .as_array()
                .or(s["downwardAPI"]["items"].as_array());
            items
                .into_iter()
                .flatten()
                .map(|i| &i["path"])
                .chain([&s["serviceAccountToken"]["path"]])
        })
        .filter_map(Value::as_str)
        .collect();
    paths.sort();
    ensure!(
        paths == ["ca.crt", "namespace", "token"],
        "{TOKEN_PATH} in the controller holds {paths:?}"
    );

    // RBAC: the pod's account is bound by ClusterRoleBindings (no RoleBinding) to
    // ClusterRoles that together grant list and watch (its watchers never `get`) on exactly
    // what the controller watches.
    let account = pod["serviceAccountName"].as_str().unwrap();
    let namespace = deployment["metadata"]["namespace"].as_str().unwrap();
    let bindings = bindings_of(objects, namespace, account);
    ensure!(
        !bindings.is_empty() && bindings.iter().all(|b| b["kind"] == "ClusterRoleBinding"),
        "service account {namespace}/{account} has {} bindings, not only ClusterRoleBindings",
        bindings.len()
    );
    let mut granted = std::collections::BTreeSet::new();
    for binding in bindings {
        let role_ref = &binding["roleRef"];
        ensure!(role_ref["kind"] == "ClusterRole", "{role_ref}");
        let role = find(objects, "ClusterRole", role_ref["name"].as_str().unwrap());
        for rule in role["rules"].as_array().unwrap() {
            let mut verbs: Vec<&str> = rule["verbs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            verbs.sort();
            ensure!(
                verbs == ["list", "watch"],
                "a rule grants {verbs:?}, not list and watch: {rule}"
            );
            ensure!(
                rule["resourceNames"].is_null() && rule["nonResourceURLs"].is_null(),
                "{rule}"
            );
            granted.extend(rule_resources(rule));
        }
    }
    let wanted: std::collections::BTreeSet<(String, String)> = watched
        .iter()
        .map(|k| (k.group.to_owned(), k.plural.to_owned()))
        .collect();
    ensure!(
        granted == wanted,
        "the ClusterRoles grant {granted:?}; the controller watches {wanted:?}"
    );
    Ok(())
}

/// The RoleBindings and ClusterRoleBindings of service account `namespace/account`.
fn bindings_of<'a>(objects: &'a [Value], namespace: &str, account: &str) -> Vec<&'a Value> {
    objects
        .iter()
        .filter(|o| o["kind"] == "ClusterRoleBinding" || o["kind"] == "RoleBinding")
        .filter(|o| {
            o["subjects"].as_array().is_some_and(|s| {
                s.iter().any(|s| {
                    s["kind"] == "ServiceAccount"
                        && s["name"] == account
                        && s["namespace"] == namespace
                })
            })
        })
        .collect()
}

/// The (API group, resource) pairs an RBAC rule names.
fn rule_resources(rule: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for group in rule["apiGroups"].as_array().unwrap() {
        for resource in rule["resources"].as_array().unwrap() {
            out.push((
                group.as_str().unwrap().to_owned(),
                resource.as_str().unwrap().to_owned(),
            ));
        }
    }
    out
}

/// The controller sidecar's configuration in the seed Deployment `name`, parsed by trellis
/// itself, as the pod mounts it.
fn controller_config(
    objects: &[Value],
    name: &str,
) -> trellis::config::controller::ControllerConfig {
    let deployment = find(objects, "Deployment", name);
    let root = TestDir::new("deploy-controller");
    let file = lay_out(objects, deployment, "controller", &root.0);
    trellis::config::load::<trellis::config::controller::ControllerConfig>(&file).unwrap()
}

/// What the controller sidecar of the seed Deployment `name` watches, with the
/// configuration the pod mounts.
fn watched_by(objects: &[Value], name: &str) -> Vec<WatchedKind> {
    let tunnels = controller_config(objects, name).tunnel.is_some();
    trellis::controller::kinds::watched(tunnels)
        .copied()
        .collect()
}

/// The controller runs beside each gateway, the ingress gateway's and each tunnel
/// replica's, as the deploy notes say: see [`controller_wiring`]. Each step brings the RBAC
/// its own controllers need: the ingress gateway's and the tunnel gateway's are rendered
/// apart.
#[test]
fn seed_controller_sidecar_writes_where_the_gateway_reads_with_read_only_access() {
    if !kubectl("seed_controller_sidecar_writes_where_the_gateway_reads_with_read_only_access") {
        return;
    }
    for (base, names) in [
        (INGRESS, &["trellis-gateway"][..]),
        ("seed/gateway-with-tunnel", &["trellis-gateway"][..]),
        ("seed/tunnel", &["trellis-tunnel-0", "trellis-tunnel-1"][..]),
    ] {
        let objects = render(base);
        for name in names {
            controller_wiring(&objects, name, &watched_by(&objects, name))
                .unwrap_or_else(|e| panic!("deploy/{base}: {name}: {e}"));
        }
    }
}

/// The deployment's pod spec, to break.
fn pod_mut(objects: &mut [Value]) -> &mut Value {
    let d = objects
        .iter_mut()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "trellis-gateway")
        .unwrap();
    &mut d["spec"]["template"]["spec"]
}

fn sidecar_mut(objects: &mut [Value]) -> &mut Value {
    &mut pod_mut(objects)["initContainers"][0]
}

fn mount_mut<'a>(container: &'a mut Value, name: &str) -> &'a mut Value {
    container["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|m| m["name"] == name)
        .unwrap()
}

/// Replaces `from` by `to` in each file of the ConfigMap named `prefix-<hash>` that has it.
fn edit_config(objects: &mut [Value], prefix: &str, from: &str, to: &str) {
    let cm = objects
        .iter_mut()
        .find(|o| {
            o["kind"] == "ConfigMap" && o["metadata"]["name"].as_str().unwrap().starts_with(prefix)
        })
        .unwrap();
    let mut edited = false;
    for value in cm["data"].as_object_mut().unwrap().values_mut() {
        let text = value.as_str().unwrap();
        if text.contains(from) {
            *value = Value::String(text.replacen(from, to, 1));
            edited = true;
        }
    }
    assert!(edited, "{from:?} not in {prefix}");
}

/// Rule `i` of the ClusterRole every controller's account is bound to.
fn rule_mut(objects: &mut [Value], i: usize) -> &mut Value {
    &mut find_mut(objects, "ClusterRole", "trellis-controller")["rules"][i]
}

/// The control for the test above: each way of breaking the wiring fails the check that
/// names it.
#[test]
fn a_miswired_controller_sidecar_fails() {
    if !kubectl("a_miswired_controller_sidecar_fails") {
        return;
    }
    let objects = render(INGRESS);
    let watched = watched_by(&objects, "trellis-gateway");
    type Break = fn(&mut Vec<Value>);
    let breaks: [(&str, Break, &str); 19] = [
        (
            "a regular init container",
            |o| {
                sidecar_mut(o)
                    .as_object_mut()
                    .unwrap()
                    .remove("restartPolicy");
            },
            "not a native sidecar",
        ),
        (
            "the gateway reads a table of its own",
            |o| {
                edit_config(
                    o,
                    "trellis-gateway-config",
                    "../routes/routes.json",
                    "../config/routes.json",
                )
            },
            "the gateway reads",
        ),
        (
            "the controller writes another file",
            |o| {
                edit_config(
                    o,
                    "trellis-controller-config",
                    "file: ../routes/routes.json",
                    "file: ../routes/table.json",
                )
            },
            "the controller writes",
        ),
        (
            "the controller writes off every volume",
            |o| {
                edit_config(
                    o,
                    "trellis-controller-config",
                    "file: ../routes/routes.json",
                    "file: /tmp/routes.json",
                )
            },
            "is on no volume of the controller",
        ),
        (
            "the gateway's mount writable",
            |o| {
                mount_mut(&mut pod_mut(o)["containers"][0], "routes")["readOnly"] = json!(false);
            },
            "the gateway mounts the table's volume writable",
        ),
        (
            "the controller's mount read-only",
            |o| {
                mount_mut(sidecar_mut(o), "routes")["readOnly"] = json!(true);
            },
            "the controller mounts the table's volume read-only",
        ),
        (
            "the table's volume a ConfigMap",
            |o| {
                let v = pod_mut(o)["volumes"].as_array_mut().unwrap();
                let config = v.iter().find(|v| v["name"] == "controller-config").unwrap();
                let cm = config["configMap"].clone();
                let routes = v.iter_mut().find(|v| v["name"] == "routes").unwrap();
                *routes = json!({"name": "routes", "configMap": cm});
            },
            "not a writable emptyDir",
        ),
        (
            "the volume mounted on the output file alone",
            |o| {
                let m = mount_mut(sidecar_mut(o), "routes");
                m["mountPath"] = json!("/etc/trellis/routes/routes.json");
                m["subPath"] = json!("routes.json");
            },
            "the temporary file",
        ),
        (
            "the startup probe on the gateway's admin port",
            |o| {
                sidecar_mut(o)["startupProbe"]["httpGet"]["port"] = json!(15021);
            },
            "startupProbe port",
        ),
        (
            "a readiness probe on the sidecar",
            |o| {
                sidecar_mut(o)["readinessProbe"] =
                    json!({"httpGet": {"path": "/ready", "port": 15022}});
            },
            "readiness probe on the sidecar",
        ),
        (
            "the token in every container",
            |o| {
                pod_mut(o)["automountServiceAccountToken"] = json!(true);
            },
            "into every container",
        ),
        (
            "the token in the gateway too",
            |o| {
                pod_mut(o)["containers"][0]["volumeMounts"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"name": "api-access", "mountPath": TOKEN_PATH, "readOnly": true}));
            },
            "container \"trellis\" mounts the API token",
        ),
        (
            "a kind not granted",
            |o| {
                rule_mut(o, 0)["resources"].as_array_mut().unwrap().pop();
            },
            "the ClusterRoles grant",
        ),
        (
            "a kind granted that is not watched",
            |o| {
                rule_mut(o, 1)["resources"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("configmaps"));
            },
            "the ClusterRoles grant",
        ),
        (
            "a write verb",
            |o| {
                rule_mut(o, 2)["verbs"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("create"));
            },
            "not list and watch",
        ),
        (
            "get, which no watcher needs",
            |o| {
                rule_mut(o, 3)["verbs"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("get"));
            },
            "not list and watch",
        ),
        (
            "no watch",
            |o| {
                rule_mut(o, 0)["verbs"] = json!(["list"]);
            },
            "not list and watch",
        ),
        (
            "the binding to another account",
            |o| {
                let b = find_mut(o, "ClusterRoleBinding", "trellis-controller");
                for subject in b["subjects"].as_array_mut().unwrap() {
                    subject["namespace"] = json!("default");
                }
            },
            "has 0 bindings",
        ),
        (
            "a RoleBinding besides",
            |o| {
                let mut b = find_mut(o, "ClusterRoleBinding", "trellis-controller").clone();
                b["kind"] = json!("RoleBinding");
                b["metadata"]["namespace"] = json!("trellis-ingress");
                o.push(b);
            },
            "not only ClusterRoleBindings",
        ),
    ];
    for (what, break_it, message) in breaks {
        let mut broken = objects.clone();
        break_it(&mut broken);
        match controller_wiring(&broken, "trellis-gateway", &watched) {
            Ok(()) => panic!("{what}: passed"),
            Err(e) => assert!(e.contains(message), "{what}: {e}"),
        }
    }
    // A kind the controller comes to watch without a rule for it.
    let mut more = watched.clone();
    more.push(WatchedKind {
        group: "gateway.networking.k8s.io",
        versions: &["v1alpha2"],
        kind: "TCPRoute",
        plural: "tcproutes",
        selector: None,
        tunnel: false,
        page_size: None,
    });
    let err = controller_wiring(&objects, "trellis-gateway", &more).unwrap_err();
    assert!(err.contains("the ClusterRoles grant"), "{err}");
}

/// Whether `namespace/account` is granted `resource` of `group` by any of its bindings.
fn may_read(
    objects: &[Value],
    namespace: &str,
    account: &str,
    group: &str,
    resource: &str,
) -> bool {
    bindings_of(objects, namespace, account).iter().any(|b| {
        let kind = b["roleRef"]["kind"].as_str().unwrap();
        let name = b["roleRef"]["name"].as_str().unwrap();
        objects
            .iter()
            .filter(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .flat_map(|r| r["rules"].as_array().into_iter().flatten())
            .flat_map(rule_resources)
            .any(|(g, r)| g == group && (r == resource || r == "*"))
    })
}

/// `trellis controller render` of the tunnels fixture seed with the controller config of
/// the seed Deployment `name`: the table.
fn table_rendered_by(objects: &[Value], name: &str) -> Value {
    let deployment = find(objects, "Deployment", name);
    let root = TestDir::new("deploy-render");
    let config = lay_out(objects, deployment, "controller", &root.0);
    let seed = repo().join("tests/data/controller/tunnels/seed");
    let out = Command::new(BIN)
        .args(["controller", "render", "--manifests"])
        .arg(&seed)
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The route names of [`table_rendered_by`].
fn routes_rendered_by(objects: &[Value], name: &str) -> Vec<String> {
    table_rendered_by(objects, name)["routes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_owned())
        .collect()
}

/// Tunnels are the tunnel replicas' alone: the ingress gateway's controller renders none
/// and its account may read neither Secrets nor Clusters; each tunnel replica runs under an
/// account of its own with a controller that renders the shoots' tunnels, and nothing but
/// them (its CONNECT listener then answers only its connectDestination). `Err` names the
/// first rule broken.
fn tunnel_access(objects: &[Value]) -> Result<(), String> {
    let ingress = find(objects, "Deployment", "trellis-gateway");
    let namespace = ingress["metadata"]["namespace"].as_str().unwrap();
    let account = ingress["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .unwrap();
    ensure!(
        controller_config(objects, "trellis-gateway")
            .tunnel
            .is_none(),
        "the ingress gateway's controller renders tunnels"
    );
    for (group, resource) in [("", "secrets"), ("extensions.gardener.cloud", "clusters")] {
        ensure!(
            !may_read(objects, namespace, account, group, resource),
            "the ingress gateway's account {account} may read {resource}"
        );
    }
    let routes = routes_rendered_by(objects, "trellis-gateway");
    ensure!(
        !routes.iter().any(|r| r.ends_with(".tunnel")),
        "the ingress gateway's table has tunnel routes: {routes:?}"
    );
    for name in ["trellis-tunnel-0", "trellis-tunnel-1"] {
        let pod = &find(objects, "Deployment", name)["spec"]["template"]["spec"];
        let tunnel_account = pod["serviceAccountName"].as_str().unwrap();
        ensure!(
            tunnel_account != account,
            "{name} runs under the ingress gateway's account {account}"
        );
        ensure!(
            controller_config(objects, name).tunnel.is_some(),
            "{name}'s controller does not render tunnels"
        );
        let routes = routes_rendered_by(objects, name);
        ensure!(
            !routes.is_empty() && routes.iter().all(|r| r.ends_with(".tunnel")),
            "{name}'s table has routes other than tunnels: {routes:?}"
        );
    }
    Ok(())
}

/// The seed's tunnel access keeps the rules of [`tunnel_access`].
#[test]
fn seed_only_the_tunnel_replicas_render_tunnels_and_read_secrets() {
    if !kubectl("seed_only_the_tunnel_replicas_render_tunnels_and_read_secrets") {
        return;
    }
    tunnel_access(&seed_with_tunnel()).unwrap();
}

/// The control for the test above: each way of giving the ingress gateway the tunnels (or
/// the tunnels more) fails the rule that names it.
#[test]
fn tunnels_or_secrets_in_the_ingress_gateway_fail() {
    if !kubectl("tunnels_or_secrets_in_the_ingress_gateway_fail") {
        return;
    }
    let objects = seed_with_tunnel();
    type Break = fn(&mut Vec<Value>);
    let breaks: [(&str, Break, &str); 5] = [
        (
            "tunnels on in the ingress gateway's controller",
            |o| {
                edit_config(
                    o,
                    "trellis-controller-config",
                    "output:",
                    "tunnel: {enabled: true}\noutput:",
                )
            },
            "the ingress gateway's controller renders tunnels",
        ),
        (
            "the ingress gateway's account bound to the tunnels' role",
            |o| {
                let b = find_mut(o, "ClusterRoleBinding", "trellis-tunnel-controller");
                b["subjects"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"kind": "ServiceAccount", "name": "trellis-gateway",
                        "namespace": "istio-ingress-handler-trellis"}));
            },
            "account trellis-gateway may read secrets",
        ),
        (
            "a tunnel replica under the ingress gateway's account",
            |o| {
                tunnel_pod_mut(o, "trellis-tunnel-1")["serviceAccountName"] =
                    json!("trellis-gateway")
            },
            "runs under the ingress gateway's account",
        ),
        (
            "tunnels off in the tunnel replicas' controller",
            |o| {
                edit_config(
                    o,
                    "trellis-tunnel-controller-config",
                    "enabled: true",
                    "enabled: false",
                );
                edit_config(
                    o,
                    "trellis-tunnel-controller-config",
                    "  localAddresses: [192.168.128.1, \"fd8f:6d53:b97a:1::1\"]\n",
                    "",
                );
            },
            "does not render tunnels",
        ),
        (
            "the tunnel replicas' controller serving the ingress gateway's Istio Gateways",
            |o| {
                edit_config(
                    o,
                    "trellis-tunnel-controller-config",
                    "trellis.gardener.cloud/gateway: tunnel",
                    "{app: istio-ingressgateway, istio: ingressgateway, istio-role: seed}",
                )
            },
            "has routes other than tunnels",
        ),
    ];
    for (what, break_it, message) in breaks {
        let mut broken = objects.clone();
        break_it(&mut broken);
        match tunnel_access(&broken) {
            Ok(()) => panic!("{what}: passed"),
            Err(e) => assert!(e.contains(message), "{what}: {e}"),
        }
    }
}

fn find_mut<'a>(objects: &'a mut [Value], kind: &str, name: &str) -> &'a mut Value {
    objects
        .iter_mut()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// Whether `selector` (a label map, not empty) selects `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|s| !s.is_empty() && s.iter().all(|(k, v)| &labels[k] == v))
}

/// A pod that runs as `uid` without privileges: non-root, the `RuntimeDefault` seccomp
/// profile, and in every container no privilege escalation, a read-only root, every
/// capability dropped and none added, nothing that overrides the pod's user or profile; no
/// host network and no host paths.
fn unprivileged(pod: &Value, uid: u64) -> Result<(), String> {
    let ps = &pod["securityContext"];
    ensure!(
        ps["runAsNonRoot"] == true,
        "the pod does not require a non-root user (runAsNonRoot): {ps}"
    );
    ensure!(
        ps["runAsUser"] == uid && ps["runAsGroup"] == uid,
        "the pod does not run as {uid}:{uid}: {ps}"
    );
    ensure!(
        ps["seccompProfile"]["type"] == "RuntimeDefault",
        "the pod has no RuntimeDefault seccomp profile: {ps}"
    );
    for c in all_containers(pod) {
        let name = &c["name"];
        let cs = &c["securityContext"];
        ensure!(
            cs["allowPrivilegeEscalation"] == false,
            "container {name} may escalate privileges: {cs}"
        );
        ensure!(
            cs["readOnlyRootFilesystem"] == true,
            "container {name} has a writable root file system: {cs}"
        );
        ensure!(
            cs["capabilities"]["drop"] == json!(["ALL"]),
            "container {name} keeps capabilities: {cs}"
        );
        ensure!(
            cs["capabilities"]["add"].is_null() && cs["privileged"] != true,
            "container {name} adds privileges: {cs}"
        );
        ensure!(
            ["runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile"]
                .iter()
                .all(|k| cs[k].is_null()),
            "container {name} overrides the pod's user or seccomp profile: {cs}"
        );
    }
    ensure!(
        pod["hostNetwork"] != true,
        "the pod uses the node's network"
    );
    for v in pod["volumes"].as_array().into_iter().flatten() {
        ensure!(
            v["hostPath"].is_null(),
            "volume {} is a host path",
            v["name"]
        );
    }
    Ok(())
}

/// The first main container's readiness (`/ready`) and liveness (`/live`) probes are on the
/// port of `config`'s admin address, which the kubelet can reach; the grace period covers
/// the drain.
fn probes_and_grace(pod: &Value, config: &Value, drain_delay: Duration) -> Result<(), String> {
    let container = &pod["containers"][0];
    let admin = config["admin"]["address"].as_str().unwrap();
    ensure!(
        !admin.starts_with("127.") && !admin.starts_with("[::1]"),
        "the kubelet cannot probe {admin}"
    );
    for (probe, path) in [("readinessProbe", "/ready"), ("livenessProbe", "/live")] {
        let get = &container[probe]["httpGet"];
        ensure!(get["path"] == path, "{probe}: {get}");
        ensure!(
            container_port(container, &get["port"]) == port_of(admin),
            "{probe} is not on the admin port {admin}: {get}"
        );
    }
    let drain = config["timeouts"]["drain"]
        .as_str()
        .map_or(Duration::from_secs(30), duration);
    let drain_delay = config["timeouts"]["drainDelay"]
        .as_str()
        .map_or(drain_delay, duration);
    let grace = Duration::from_secs(pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30));
    ensure!(
        grace >= drain_delay + drain + grace_margin(drain),
        "terminationGracePeriodSeconds {grace:?} does not cover the drain ({drain_delay:?} + {drain:?})"
    );
    Ok(())
}

/// Where `path` (a file in the container) comes from: the Secret's name and the file's path
/// in it, for the pod named `pod`; `Err` when it is on no Secret volume.
fn secret_file(
    pod_spec: &Value,
    container: &Value,
    path: &Path,
    pod: &str,
) -> Result<(String, PathBuf), String> {
    let Some((mount, _)) = mount_at(container, path) else {
        return Err(format!("{path:?} is on no volume"));
    };
    let rest = path
        .strip_prefix(mount["mountPath"].as_str().unwrap())
        .unwrap();
    let inside = match sub_path(container, mount, pod) {
        Some(sub) => Path::new(&sub).join(rest),
        None => rest.to_path_buf(),
    };
    let volume = pod_spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let Some(secret) = volume["secret"]["secretName"].as_str() else {
        return Err(format!("{path:?} is not from a Secret: {volume}"));
    };
    Ok((secret.to_owned(), inside))
}

/// A file the config at `config_file` (a path in the container) names, as the container
/// opens it: relative paths are relative to the config's directory.
fn named_file(config_file: &Path, named: &str) -> PathBuf {
    normalize(&config_file.parent().unwrap().join(named))
}

/// The agents in a shoot (`deploy/agent`), as the deploy notes say: two replicas, each a
/// peer of its own (a config and a private key no other pod mounts, a tunnel address of its
/// own), unprivileged, spread over nodes, one kept through evictions, probed on the admin
/// port, the gateway tried over UDP first, then over TCP through the seed's CONNECT port;
/// in a Gardener shoot, admitted where Gardener admits vpn-shoot (the from-seed pods) and
/// free to dial out. `Err` names the first rule broken.
fn agent_rules(objects: &[Value]) -> Result<(), String> {
    let statefulset = find(objects, "StatefulSet", "trellis-agent");
    let spec = &statefulset["spec"];
    let pod = &spec["template"]["spec"];
    let labels = &spec["template"]["metadata"]["labels"];
    let container = &pod["containers"][0];
    let replicas = spec["replicas"].as_u64().unwrap_or(1);
    ensure!(
        replicas == 2,
        "{replicas} replicas, not two peers of one route"
    );
    unprivileged(pod, 65534)?;
    ensure!(
        pod["automountServiceAccountToken"] == false,
        "the pod mounts an API token it never uses"
    );
    let anti = &pod["affinity"]["podAntiAffinity"];
    let required = anti["requiredDuringSchedulingIgnoredDuringExecution"]
        .as_array()
        .into_iter()
        .flatten();
    let preferred = anti["preferredDuringSchedulingIgnoredDuringExecution"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| &t["podAffinityTerm"]);
    ensure!(
        required.chain(preferred).any(|t| {
            t["topologyKey"] == "kubernetes.io/hostname"
                && selects(&t["labelSelector"]["matchLabels"], labels)
        }),
        "no pod anti-affinity of the agents on kubernetes.io/hostname"
    );
    let budgets: Vec<&Value> = objects
        .iter()
        .filter(|o| {
            o["kind"] == "PodDisruptionBudget"
                && selects(&o["spec"]["selector"]["matchLabels"], labels)
        })
        .collect();
    ensure!(
        budgets.len() == 1 && budgets[0]["spec"]["minAvailable"] == 1,
        "no PodDisruptionBudget keeping one agent (minAvailable: 1): {budgets:?}"
    );
    // In a Gardener shoot: the pods Gardener opens to the seed (from-seed=allowed, which its
    // gardener.cloud--allow-from-seed opens to vpn-shoot's pods alone) admit the agents on
    // every port, and the agents may dial out (kube-system denies all from Kubernetes 1.33).
    let namespace = statefulset["metadata"]["namespace"].as_str().unwrap();
    let policies: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "NetworkPolicy" && o["metadata"]["namespace"] == namespace)
        .collect();
    let from_seed = json!({"networking.gardener.cloud/from-seed": "allowed"});
    ensure!(
        policies.iter().any(|p| {
            p["spec"]["podSelector"]["matchLabels"] == from_seed
                && p["spec"]["ingress"].as_array().is_some_and(|rules| {
                    rules.iter().any(|r| {
                        r["ports"].is_null()
                            && r["from"].as_array().is_some_and(|from| {
                                from.iter().any(|f| {
                                    f["namespaceSelector"].is_null()
                                        && f["ipBlock"].is_null()
                                        && selects(&f["podSelector"]["matchLabels"], labels)
                                })
                            })
                    })
                })
        }),
        "no NetworkPolicy admits the agents into the pods labelled \
         networking.gardener.cloud/from-seed=allowed on every port"
    );
    ensure!(
        policies.iter().any(|p| {
            selects(&p["spec"]["podSelector"]["matchLabels"], labels)
                && p["spec"]["egress"]
                    .as_array()
                    .is_some_and(|rules| rules.iter().any(|r| r == &json!({})))
        }),
        "no NetworkPolicy lets the agents dial out"
    );
    let resources = &container["resources"];
    ensure!(
        resources["requests"]["cpu"].is_string()
            && resources["requests"]["memory"].is_string()
            && resources["limits"]["memory"].is_string(),
        "resources: {resources}"
    );

    let mut keys = std::collections::BTreeSet::new();
    let mut addresses = std::collections::BTreeSet::new();
    for ordinal in 0..replicas as usize {
        let name = pod_name(statefulset, ordinal);
        let root = TestDir::new("agent-pod");
        let file = lay_out_pod(objects, statefulset, "trellis", &root.0, &name);
        let config: Value =
            serde_saphyr::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        let in_container = Path::new("/").join(file.strip_prefix(root.0.join("trellis")).unwrap());
        probes_and_grace(pod, &config, Duration::ZERO).map_err(|e| format!("{name}: {e}"))?;
        let wg = &config["wireguard"];
        let key = named_file(&in_container, wg["privateKeyFile"].as_str().unwrap());
        let key =
            secret_file(pod, container, &key, &name).map_err(|e| format!("{name}: key {e}"))?;
        ensure!(
            keys.insert(key.clone()),
            "{name} mounts the private key {key:?}, another replica's too"
        );
        ensure!(
            addresses.insert(wg["addresses"].to_string()),
            "{name} has the tunnel addresses {} of another replica",
            wg["addresses"]
        );
        // A session with each gateway replica, each over UDP first, then over TCP through
        // the seed's CONNECT port to that replica's own destination.
        let Some(replicas) = wg["gateway"]["replicas"].as_array() else {
            return Err(format!("{name}: no session per gateway replica (replicas)"));
        };
        ensure!(
            replicas.len() == 2,
            "{name}: {} gateway replicas, not 2",
            replicas.len()
        );
        let mut seen = std::collections::BTreeSet::new();
        for replica in replicas {
            let endpoints = replica["endpoints"].as_array().unwrap();
            ensure!(
                endpoints[0]["udp"].is_string(),
                "{name}: the gateway is not tried over UDP first: {}",
                endpoints[0]
            );
            let Some(connect) = endpoints.iter().find_map(|e| e["connect"].as_object()) else {
                return Err(format!("{name}: no connect endpoint (WireGuard over TCP)"));
            };
            ensure!(
                port_of(connect["address"].as_str().unwrap()) == 8443,
                "{name}: the connect endpoint is not the seed's CONNECT port 8443: {connect:?}"
            );
            ensure!(
                connect
                    .get("destinationHeader")
                    .is_none_or(|h| h == "X-Gardener-Destination"),
                "{name}: {connect:?}"
            );
            let destination = connect["destination"].as_str().unwrap();
            ensure!(
                destination
                    .strip_prefix("trellis-wireguard-")
                    .and_then(|d| d.strip_suffix(":51820"))
                    .is_some_and(|n| n.parse::<usize>().is_ok()),
                "{name}: {destination:?} is no tunnel gateway replica's connectDestination"
            );
            ensure!(
                seen.insert(destination.to_owned()),
                "{name}: two sessions lead to {destination:?}"
            );
        }
    }
    Ok(())
}

/// The agent StatefulSet keeps the rules of [`agent_rules`].
#[test]
fn shoot_agents_run_unprivileged_with_a_key_each() {
    if !kubectl("shoot_agents_run_unprivileged_with_a_key_each") {
        return;
    }
    agent_rules(&render("agent")).unwrap();
}

fn agent_pod_mut(objects: &mut [Value]) -> &mut Value {
    &mut find_mut(objects, "StatefulSet", "trellis-agent")["spec"]["template"]["spec"]
}

/// The control for the test above: each way of weakening the agents fails the rule that
/// names it.
#[test]
fn a_weakened_agent_fails() {
    if !kubectl("a_weakened_agent_fails") {
        return;
    }
    let objects = render("agent");
    type Break = fn(&mut Vec<Value>);
    let breaks: [(&str, Break, &str); 20] = [
        (
            "no admission into the from-seed pods",
            |o| o.retain(|o| o["metadata"]["name"] != "trellis-allow-from-seed"),
            "from-seed=allowed",
        ),
        (
            "the from-seed pods open to other pods",
            |o| {
                let p = find_mut(o, "NetworkPolicy", "trellis-allow-from-seed");
                p["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] =
                    json!({"app": "vpn-shoot"});
            },
            "from-seed=allowed",
        ),
        (
            "the from-seed pods open on one port only",
            |o| {
                let p = find_mut(o, "NetworkPolicy", "trellis-allow-from-seed");
                p["spec"]["ingress"][0]["ports"] = json!([{"port": 443, "protocol": "TCP"}]);
            },
            "from-seed=allowed",
        ),
        (
            "no way out",
            |o| {
                o.retain(|o| {
                    !(o["kind"] == "NetworkPolicy" && o["metadata"]["name"] == "trellis-agent")
                })
            },
            "dial out",
        ),
        (
            "runAsNonRoot dropped",
            |o| {
                let sc = &mut agent_pod_mut(o)["securityContext"];
                sc.as_object_mut().unwrap().remove("runAsNonRoot");
            },
            "runAsNonRoot",
        ),
        (
            "root",
            |o| agent_pod_mut(o)["securityContext"]["runAsUser"] = json!(0),
            "does not run as 65534",
        ),
        (
            "no seccomp profile",
            |o| {
                let sc = &mut agent_pod_mut(o)["securityContext"];
                sc.as_object_mut().unwrap().remove("seccompProfile");
            },
            "seccomp",
        ),
        (
            "privilege escalation",
            |o| {
                agent_pod_mut(o)["containers"][0]["securityContext"]["allowPrivilegeEscalation"] =
                    json!(true)
            },
            "escalate",
        ),
        (
            "a writable root",
            |o| {
                agent_pod_mut(o)["containers"][0]["securityContext"]["readOnlyRootFilesystem"] =
                    json!(false)
            },
            "writable root",
        ),
        (
            "a capability added",
            |o| {
                agent_pod_mut(o)["containers"][0]["securityContext"]["capabilities"]["add"] =
                    json!(["NET_ADMIN"])
            },
            "adds privileges",
        ),
        (
            "capabilities kept",
            |o| agent_pod_mut(o)["containers"][0]["securityContext"]["capabilities"] = json!({}),
            "keeps capabilities",
        ),
        (
            "the container as root",
            |o| agent_pod_mut(o)["containers"][0]["securityContext"]["runAsUser"] = json!(0),
            "overrides the pod's user",
        ),
        (
            "the node's network",
            |o| agent_pod_mut(o)["hostNetwork"] = json!(true),
            "node's network",
        ),
        (
            "one replica",
            |o| find_mut(o, "StatefulSet", "trellis-agent")["spec"]["replicas"] = json!(1),
            "not two peers",
        ),
        (
            "both replicas on one key",
            |o| {
                let m = agent_pod_mut(o)["containers"][0]["volumeMounts"]
                    .as_array_mut()
                    .unwrap()
                    .iter_mut()
                    .find(|m| m["name"] == "keys")
                    .unwrap();
                m.as_object_mut().unwrap().remove("subPathExpr");
                m["subPath"] = json!("trellis-agent-0.key");
            },
            "another replica's too",
        ),
        (
            "no anti-affinity",
            |o| {
                agent_pod_mut(o).as_object_mut().unwrap().remove("affinity");
            },
            "anti-affinity",
        ),
        (
            "a budget of none",
            |o| {
                find_mut(o, "PodDisruptionBudget", "trellis-agent")["spec"]["minAvailable"] =
                    json!(0)
            },
            "PodDisruptionBudget",
        ),
        (
            "readiness on another port",
            |o| {
                agent_pod_mut(o)["containers"][0]["readinessProbe"]["httpGet"]["port"] =
                    json!(16912)
            },
            "not on the admin port",
        ),
        (
            "TCP before UDP",
            |o| {
                let cm = o.iter_mut().find(|o| o["kind"] == "ConfigMap").unwrap();
                for v in cm["data"].as_object_mut().unwrap().values_mut() {
                    // The first replica's udp endpoint moved after its connect one.
                    let mut lines: Vec<&str> = v.as_str().unwrap().lines().collect();
                    let udp = lines
                        .iter()
                        .position(|l| l.starts_with("      - udp:"))
                        .unwrap();
                    let line = lines.remove(udp);
                    let end = udp
                        + lines[udp..]
                            .iter()
                            .position(|l| l.starts_with("    - endpoints:"))
                            .unwrap();
                    lines.insert(end, line);
                    *v = Value::String(lines.join("\n"));
                }
            },
            "not tried over UDP first",
        ),
        (
            "an API token",
            |o| agent_pod_mut(o)["automountServiceAccountToken"] = json!(true),
            "API token",
        ),
    ];
    for (what, break_it, message) in breaks {
        let mut broken = objects.clone();
        break_it(&mut broken);
        match agent_rules(&broken) {
            Ok(()) => panic!("{what}: passed"),
            Err(e) => assert!(e.contains(message), "{what}: {e}"),
        }
    }
}

/// The listener of `config` with `protocol`, if one.
fn listener<'a>(config: &'a Value, protocol: &str) -> Option<&'a Value> {
    config["listeners"]
        .as_array()?
        .iter()
        .find(|l| l["protocol"] == protocol)
}

/// The tunnel gateway in the seed (`deploy/seed/tunnel`, Deployments `trellis-tunnel-<N>`), as the
/// deploy notes say: two replicas of one pod each, unprivileged, that share one WireGuard
/// key Secret and each have a connectDestination of their own; each reached over UDP
/// through a load balancer Service of its own (its own port, source addresses kept, health
/// checked through the healthCheckNodePort, never the admin port) and over TCP
/// through a ClusterIP Service of its own on its CONNECT listener, to which the ingress
/// gateway's table forwards its connectDestination as received; the kube-apiservers'
/// egress through one Service to both; a NetworkPolicy that admits every listener's port
/// and the egress port only from kube-apiserver pods of shoot namespaces; one replica kept
/// through evictions. `Err` names the first rule broken.
fn tunnel_rules(objects: &[Value]) -> Result<(), String> {
    let names = ["trellis-tunnel-0", "trellis-tunnel-1"];
    let services: Vec<&Value> = objects.iter().filter(|o| o["kind"] == "Service").collect();
    let pods: Vec<&Value> = names
        .iter()
        .map(|n| &find(objects, "Deployment", n)["spec"]["template"])
        .collect();
    let ingress_routes = table_rendered_by(objects, "trellis-gateway")["routes"].clone();
    let mut key_secrets = std::collections::BTreeSet::new();
    let mut destinations = std::collections::BTreeSet::new();
    let mut udp_ports = std::collections::BTreeSet::new();
    let mut egress_ports = std::collections::BTreeSet::new();
    let mut open_ports = Vec::new();
    for (n, name) in names.iter().enumerate() {
        let deployment = find(objects, "Deployment", name);
        ensure!(
            deployment["spec"]["replicas"] == 1,
            "{name}: not one pod (its Services address one replica)"
        );
        ensure!(
            deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0,
            "{name}: a rollout takes the replica away before its successor is ready"
        );
        let pod = &pods[n]["spec"];
        let labels = &pods[n]["metadata"]["labels"];
        let other = &pods[1 - n]["metadata"]["labels"];
        let container = &pod["containers"][0];
        unprivileged(pod, 65532).map_err(|e| format!("{name}: {e}"))?;
        let (config, file) = config_in(objects, deployment, "trellis");
        probes_and_grace(pod, &config, Duration::from_secs(5))
            .map_err(|e| format!("{name}: {e}"))?;
        let Some(wg) = listener(&config, "wireguard") else {
            return Err(format!("{name}: no wireguard listener"));
        };
        let key = named_file(&file, wg["wireguard"]["privateKeyFile"].as_str().unwrap());
        let (secret, _) =
            secret_file(pod, container, &key, name).map_err(|e| format!("{name}: key {e}"))?;
        key_secrets.insert(secret);
        let destination = wg["wireguard"]["connectDestination"].as_str().unwrap_or("");
        ensure!(
            destinations.insert(destination.to_owned()),
            "{name}: connectDestination {destination:?} is another replica's too"
        );
        let Some(egress) = listener(&config, "egress-connect") else {
            return Err(format!("{name}: no egress-connect listener"));
        };
        let Some(connect) = listener(&config, "http-connect") else {
            return Err(format!(
                "{name}: no http-connect listener for WireGuard over TCP"
            ));
        };
        let wg_port = port_of(wg["address"].as_str().unwrap());
        let egress_port = port_of(egress["address"].as_str().unwrap());
        let connect_port = port_of(connect["address"].as_str().unwrap());
        let admin_port = port_of(config["admin"]["address"].as_str().unwrap());
        egress_ports.insert(egress_port);
        open_ports.push((wg_port, "UDP"));
        for p in [egress_port, connect_port, admin_port] {
            open_ports.push((p, "TCP"));
        }

        // Its own UDP load balancer: this replica only, sources kept, its own port.
        let lbs: Vec<&&Value> = services
            .iter()
            .filter(|s| {
                s["spec"]["type"] == "LoadBalancer" && selects(&s["spec"]["selector"], labels)
            })
            .collect();
        ensure!(
            lbs.len() == 1,
            "{name}: {} load balancer Services lead to it, not one",
            lbs.len()
        );
        let lb = &lbs[0]["spec"];
        ensure!(
            !selects(&lb["selector"], other),
            "{name}: its load balancer leads to the other replica too"
        );
        ensure!(
            lb["externalTrafficPolicy"] == "Local",
            "{name}: its load balancer does not keep the shoots' addresses (externalTrafficPolicy Local)"
        );
        let ports = lb["ports"].as_array().unwrap();
        let Some(udp) = ports.iter().find(|p| {
            p["protocol"] == "UDP" && container_port(container, &p["targetPort"]) == wg_port
        }) else {
            return Err(format!(
                "{name}: no UDP port of its load balancer leads to the wireguard listener"
            ));
        };
        let number = udp["port"].as_u64().unwrap();
        ensure!(
            udp_ports.insert(number),
            "{name}: UDP port {number} is the other replica's too (no shared address possible)"
        );
        // Health checks go to the healthCheckNodePort Kubernetes allocates for Local (it
        // follows the pod's readiness); the admin port never faces the load balancer, whose
        // /metrics would name every shoot.
        ensure!(
            !ports.iter().any(|p| p["protocol"] == "TCP"
                && container_port(container, &p["targetPort"]) == admin_port),
            "{name}: its load balancer exposes the admin port"
        );
        // Its CONNECT listener, for the ingress's forwarded WireGuard over TCP.
        ensure!(
            services.iter().any(|s| s["spec"]["type"] == "ClusterIP"
                && selects(&s["spec"]["selector"], labels)
                && !selects(&s["spec"]["selector"], other)
                && s["spec"]["ports"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| container_port(container, &p["targetPort"]) == connect_port)),
            "{name}: no Service of its own leads to its http-connect listener"
        );
        // WireGuard over TCP: the ingress gateway forwards its connectDestination, as
        // received, to a Service of its own that leads to its CONNECT listener.
        let Some(handoff) = ingress_routes.as_array().unwrap().iter().find(|r| {
            r["destinations"]
                .as_array()
                .is_some_and(|d| d.iter().any(|d| d == destination))
        }) else {
            return Err(format!(
                "{name}: the ingress gateway's table has no route for its connectDestination {destination:?}"
            ));
        };
        ensure!(
            handoff["forwardConnect"] == true,
            "{name}: the ingress gateway answers its CONNECTs itself (no forwardConnect): {handoff}"
        );
        let backends = handoff["backends"].as_array().unwrap();
        let leads_here = |b: &Value| {
            let address = b["address"].as_str().unwrap();
            let (host, port) = address.rsplit_once(':').unwrap();
            let mut parts = host.split('.');
            let (service, namespace) = (parts.next().unwrap(), parts.next().unwrap_or(""));
            services.iter().any(|s| {
                s["metadata"]["name"] == service
                    && s["metadata"]["namespace"] == namespace
                    && selects(&s["spec"]["selector"], labels)
                    && !selects(&s["spec"]["selector"], other)
                    && s["spec"]["ports"].as_array().unwrap().iter().any(|p| {
                        p["port"].as_u64().map(|p| p.to_string()).as_deref() == Some(port)
                            && container_port(container, &p["targetPort"]) == connect_port
                    })
            })
        };
        ensure!(
            !backends.is_empty() && backends.iter().all(leads_here),
            "{name}: the ingress gateway's route for {destination:?} does not lead to its \
             CONNECT listener alone: {handoff}"
        );
    }
    ensure!(
        key_secrets.len() == 1,
        "the replicas hold different WireGuard keys: {key_secrets:?}"
    );
    ensure!(
        egress_ports.len() == 1,
        "the replicas' egress ports differ: {egress_ports:?}"
    );
    let egress_port = *egress_ports.first().unwrap();
    let container = &pods[0]["spec"]["containers"][0];
    ensure!(
        services.iter().any(|s| s["spec"]["type"] == "ClusterIP"
            && pods
                .iter()
                .all(|p| selects(&s["spec"]["selector"], &p["metadata"]["labels"]))
            && s["spec"]["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| container_port(container, &p["targetPort"]) == egress_port)),
        "no Service leads the kube-apiservers' egress to both replicas"
    );

    // Ingress: every listener's port admitted, the egress port only from kube-apiservers.
    let policies: Vec<&Value> = objects
        .iter()
        .filter(|o| {
            o["kind"] == "NetworkPolicy"
                && pods.iter().all(|p| {
                    selects(
                        &o["spec"]["podSelector"]["matchLabels"],
                        &p["metadata"]["labels"],
                    )
                })
        })
        .collect();
    ensure!(
        !policies.is_empty(),
        "no NetworkPolicy selects the tunnel gateway"
    );
    let rules: Vec<&Value> = policies
        .iter()
        .flat_map(|p| p["spec"]["ingress"].as_array().into_iter().flatten())
        .collect();
    let covers = |rule: &Value, port: u64, protocol: &str| {
        rule["ports"].as_array().is_some_and(|ps| {
            ps.iter()
                .any(|p| p["port"] == port && p["protocol"].as_str().unwrap_or("TCP") == protocol)
        })
    };
    for (port, protocol) in open_ports {
        ensure!(
            rules.iter().any(|r| covers(r, port, protocol)),
            "no NetworkPolicy rule admits {protocol} {port}"
        );
    }
    for rule in rules.iter().filter(|r| covers(r, egress_port, "TCP")) {
        let from = rule["from"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        ensure!(
            !from.is_empty()
                && from.iter().all(|f| {
                    f["namespaceSelector"]["matchLabels"] == json!({"gardener.cloud/role": "shoot"})
                        && f["podSelector"]["matchLabels"]
                            == json!({"app": "kubernetes", "role": "apiserver"})
                }),
            "the egress port {egress_port} is open to more than the shoots' kube-apiservers: {rule}"
        );
    }
    let budgets: Vec<&Value> = objects
        .iter()
        .filter(|o| {
            o["kind"] == "PodDisruptionBudget"
                && pods.iter().all(|p| {
                    selects(
                        &o["spec"]["selector"]["matchLabels"],
                        &p["metadata"]["labels"],
                    )
                })
        })
        .collect();
    ensure!(
        budgets.len() == 1 && budgets[0]["spec"]["minAvailable"] == 1,
        "no PodDisruptionBudget keeping one tunnel replica (minAvailable: 1): {budgets:?}"
    );
    Ok(())
}

/// The tunnel gateway keeps the rules of [`tunnel_rules`].
#[test]
fn seed_tunnel_replicas_share_a_key_and_each_has_its_own_entry() {
    if !kubectl("seed_tunnel_replicas_share_a_key_and_each_has_its_own_entry") {
        return;
    }
    tunnel_rules(&seed_with_tunnel()).unwrap();
}

fn tunnel_pod_mut<'a>(objects: &'a mut [Value], name: &str) -> &'a mut Value {
    &mut find_mut(objects, "Deployment", name)["spec"]["template"]["spec"]
}

/// The control for the test above: each way of breaking the tunnel gateway fails the rule
/// that names it.
#[test]
fn a_weakened_tunnel_gateway_fails() {
    if !kubectl("a_weakened_tunnel_gateway_fails") {
        return;
    }
    let objects = seed_with_tunnel();
    type Break = fn(&mut Vec<Value>);
    let breaks: [(&str, Break, &str); 15] = [
        (
            "the hand-off of replica 0 to replica 1",
            |o| {
                edit_config(
                    o,
                    "trellis-controller-config",
                    "trellis-tunnel-0.trellis-ingress",
                    "trellis-tunnel-1.trellis-ingress",
                )
            },
            "does not lead to its CONNECT listener alone",
        ),
        (
            "the hand-off answered by the ingress",
            |o| {
                edit_config(
                    o,
                    "trellis-controller-config",
                    "forwardConnect: true",
                    "forwardConnect: false",
                )
            },
            "no forwardConnect",
        ),
        (
            "runAsNonRoot dropped",
            |o| {
                let sc = &mut tunnel_pod_mut(o, "trellis-tunnel-1")["securityContext"];
                sc.as_object_mut().unwrap().remove("runAsNonRoot");
            },
            "runAsNonRoot",
        ),
        (
            "a capability added",
            |o| {
                tunnel_pod_mut(o, "trellis-tunnel-0")["containers"][0]["securityContext"]["capabilities"]
                    ["add"] = json!(["NET_ADMIN"])
            },
            "adds privileges",
        ),
        (
            "two pods in one replica",
            |o| find_mut(o, "Deployment", "trellis-tunnel-0")["spec"]["replicas"] = json!(2),
            "not one pod",
        ),
        (
            "one connectDestination for both",
            |o| {
                edit_config(
                    o,
                    "trellis-tunnel-1-config",
                    "trellis-wireguard-1:51820",
                    "trellis-wireguard-0:51820",
                )
            },
            "another replica's too",
        ),
        (
            "a key of its own",
            |o| {
                let v = tunnel_pod_mut(o, "trellis-tunnel-1")["volumes"]
                    .as_array_mut()
                    .unwrap()
                    .iter_mut()
                    .find(|v| v["name"] == "wireguard-key")
                    .unwrap();
                v["secret"]["secretName"] = json!("trellis-wireguard-key-1");
            },
            "different WireGuard keys",
        ),
        (
            "source addresses lost",
            |o| {
                find_mut(o, "Service", "trellis-wireguard-0")["spec"]["externalTrafficPolicy"] =
                    json!("Cluster")
            },
            "externalTrafficPolicy Local",
        ),
        (
            "one load balancer for both",
            |o| {
                let s = find_mut(o, "Service", "trellis-wireguard-1");
                s["spec"]["selector"]
                    .as_object_mut()
                    .unwrap()
                    .remove("trellis.gardener.cloud/tunnel-replica");
            },
            "load balancer Services lead to it",
        ),
        (
            "one UDP port for both",
            |o| {
                let s = find_mut(o, "Service", "trellis-wireguard-1");
                for p in s["spec"]["ports"].as_array_mut().unwrap() {
                    p["port"] = json!(51820);
                }
            },
            "the other replica's too",
        ),
        (
            "admin port on the load balancer",
            |o| {
                let s = find_mut(o, "Service", "trellis-wireguard-0");
                s["spec"]["ports"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"name": "health", "port": 51820, "targetPort": "admin", "protocol": "TCP"}));
            },
            "exposes the admin port",
        ),
        (
            "egress open to all",
            |o| {
                let p = find_mut(o, "NetworkPolicy", "trellis-tunnel");
                p["spec"]["ingress"][1]
                    .as_object_mut()
                    .unwrap()
                    .remove("from");
            },
            "open to more than",
        ),
        (
            "UDP not admitted",
            |o| {
                let p = find_mut(o, "NetworkPolicy", "trellis-tunnel");
                p["spec"]["ingress"].as_array_mut().unwrap().remove(0);
            },
            "admits UDP 51820",
        ),
        (
            "no forwarding Service",
            |o| {
                o.retain(|o| {
                    !(o["kind"] == "Service" && o["metadata"]["name"] == "trellis-tunnel-1")
                })
            },
            "http-connect listener",
        ),
        (
            "no budget",
            |o| {
                o.retain(|o| {
                    !(o["kind"] == "PodDisruptionBudget"
                        && o["metadata"]["name"] == "trellis-tunnel")
                })
            },
            "PodDisruptionBudget",
        ),
    ];
    for (what, break_it, message) in breaks {
        let mut broken = objects.clone();
        break_it(&mut broken);
        match tunnel_rules(&broken) {
            Ok(()) => panic!("{what}: passed"),
            Err(e) => assert!(e.contains(message), "{what}: {e}"),
        }
    }
}

/// The exposure class handler `deploy/seed/gateway` stands in for (gardenlet's
/// `exposureClassHandlers[].name`, the ExposureClass's `handler`).
const HANDLER: &str = "trellis";

/// The namespace gardenlet gives the handler's gateway, and in a zone of a multi-zonal seed
/// that zone's (`sni.ingress.namespace`'s default `istio-ingress-handler-<name>`, and
/// `<namespace>--<zone>` from `GetIstioNamespaceForZone` for short lowercase zones).
fn handler_namespace(zone: Option<&str>) -> String {
    let base = format!("istio-ingress-handler-{HANDLER}");
    zone.map_or(base.clone(), |z| format!("{base}--{z}"))
}

/// The labels of the handler's Envoy pods, the selector of its Service and of the Istio
/// Gateway gardenlet writes per shoot of the exposure class: the default `sni.ingress.labels`
/// with `GetMandatoryExposureClassHandlerSNILabels`, then `GetIstioZoneLabels` (whose zone
/// key is `gardener.cloud/role` where there is no `istio` label).
fn envoy_labels(zone: Option<&str>) -> Value {
    let role = zone.map_or("exposureclass-handler".to_owned(), |z| {
        format!("exposureclass-handler--zone--{z}")
    });
    json!({
        "app": "istio-ingressgateway",
        "gardener.cloud/role": role,
        "handler.exposureclass.gardener.cloud/name": HANDLER,
        "istio-role": "seed",
    })
}

/// Envoy's Service ports (port, target port) as gardenlet writes them for every ingress
/// gateway (`tcp`, `http-proxy`, `tls-tunnel`).
const ENVOY_PORTS: [(u64, u64); 3] = [(443, 9443), (8443, 8443), (8132, 8132)];

/// The labels gardenlet puts on the handler's namespace (`istio.go`'s gateway namespaces),
/// plus the one the operator adds (docs/gardener.md, the rollout).
fn handler_namespace_labels(zone: Option<&str>, operator_label: bool) -> Value {
    let mut labels = json!({
        "kubernetes.io/metadata.name": handler_namespace(zone),
        "istio-operator-managed": "Reconcile",
        "istio-injection": "disabled",
        "gardener.cloud/role": envoy_labels(zone)["gardener.cloud/role"],
        "handler.exposureclass.gardener.cloud/name": HANDLER,
        "pod-security.kubernetes.io/enforce": "baseline",
        "high-availability-config.resources.gardener.cloud/consider": "true",
    });
    if operator_label {
        labels["networking.gardener.cloud/access-target-apiserver"] = json!("allowed");
    }
    labels
}

/// A Service in every shoot namespace that trellis must reach, as gardener-resource-manager
/// reads it: its name, target port and the `networking.resources.gardener.cloud/
/// namespace-selectors` (a match-labels map, or a key that must exist) and pod label alias
/// it carries (`apiserverexposure/service.go`, `vpn/seedserver/seedserver.go`).
struct ShootService {
    name: &'static str,
    target_port: u64,
    selectors: &'static [Selector],
    alias: &'static str,
}

/// One namespace selector of a Service's annotation.
enum Selector {
    /// `matchLabels` of one label.
    Label(&'static str, &'static str),
    /// `matchExpressions` with `operator: Exists`.
    Exists(&'static str),
}

const KUBE_APISERVER_SELECTORS: &[Selector] = &[
    Selector::Label(
        "networking.gardener.cloud/access-target-apiserver",
        "allowed",
    ),
    Selector::Label("kubernetes.io/metadata.name", "garden"),
    Selector::Label("gardener.cloud/role", "extension"),
];
const VPN_SEED_SERVER_SELECTORS: &[Selector] = &[
    Selector::Label("gardener.cloud/role", "istio-ingress"),
    Selector::Exists("handler.exposureclass.gardener.cloud/name"),
];

/// The shoot Services trellis's routes lead to: the API server (SNI) and the VPN servers
/// (the reversed VPN's CONNECT to 1194; HA: one per replica).
const SHOOT_SERVICES: [ShootService; 4] = [
    ShootService {
        name: "kube-apiserver",
        target_port: 443,
        selectors: KUBE_APISERVER_SELECTORS,
        alias: "all-shoots",
    },
    ShootService {
        name: "vpn-seed-server",
        target_port: 1194,
        selectors: VPN_SEED_SERVER_SELECTORS,
        alias: "all-shoots",
    },
    ShootService {
        name: "vpn-seed-server-0",
        target_port: 1194,
        selectors: VPN_SEED_SERVER_SELECTORS,
        alias: "all-shoots",
    },
    ShootService {
        name: "vpn-seed-server-1",
        target_port: 1194,
        selectors: VPN_SEED_SERVER_SELECTORS,
        alias: "all-shoots",
    },
];

/// gardener-resource-manager's pod label for traffic to `service`'s `port` (TCP): in the
/// Service's namespace `to-<service>-tcp-<port>`, from another namespace with the alias
/// infix (`matchLabelsForServiceAndNamespace`).
fn policy_label(alias: Option<&str>, service: &str, port: u64) -> String {
    let infix = alias.map(|a| format!("{a}-")).unwrap_or_default();
    format!("networking.resources.gardener.cloud/to-{infix}{service}-tcp-{port}")
}

/// The port of an `address:port` string.
fn address_port(address: &str) -> u64 {
    address.rsplit(':').next().unwrap().parse().unwrap()
}

/// The seed ingress in the handler's namespace (`deploy/seed/gateway`, or a zone's copy):
/// the namespace gardenlet gives the handler (and `zone`); a `trellis-gateway` LoadBalancer
/// Service with Envoy's ports and numeric target ports (so that its selector can be pointed
/// at Envoy's pods) that are the gateway's listeners, admitted from the world by Gardener's
/// annotation, selecting trellis's pods and never Envoy's, and trellis's pods never
/// selected by Envoy's Service; the controller rendering for Envoy's selector with Envoy's
/// Service as every fallback; the pods labelled so that gardener-resource-manager's policies
/// let them reach every shoot's kube-apiserver and vpn-seed-server (given the namespace's
/// labels `namespace_labels`) and Envoy, and gardenlet's reach DNS and the seed's API
/// server. `Err` names the first rule broken.
fn handler_rules(
    objects: &[Value],
    zone: Option<&str>,
    namespace_labels: &Value,
) -> Result<(), String> {
    let deployment = find(objects, "Deployment", "trellis-gateway");
    let namespace = deployment["metadata"]["namespace"].as_str().unwrap();
    let expected_namespace = handler_namespace(zone);
    ensure!(
        namespace == expected_namespace,
        "the gateway runs in {namespace}, not in the handler's namespace {expected_namespace}"
    );
    let envoy = envoy_labels(zone);
    let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
    ensure!(
        !selects(&envoy, pod_labels),
        "Envoy's Service selects the trellis pods: {pod_labels}"
    );

    let service = objects
        .iter()
        .find(|o| {
            o["kind"] == "Service"
                && o["metadata"]["name"] == "trellis-gateway"
                && o["metadata"]["namespace"] == namespace
        })
        .ok_or("no Service trellis-gateway in the handler's namespace")?;
    ensure!(
        service["spec"]["type"] == "LoadBalancer",
        "trellis-gateway is not a LoadBalancer"
    );
    let selector = &service["spec"]["selector"];
    ensure!(
        selects(selector, pod_labels),
        "trellis-gateway does not select the trellis pods"
    );
    ensure!(
        !selects(selector, &envoy),
        "trellis-gateway selects Envoy's pods: {selector}"
    );
    let mut ports = Vec::new();
    for p in service["spec"]["ports"].as_array().unwrap() {
        let target = p["targetPort"].as_u64().ok_or_else(|| {
            format!(
                "port {}: target port {} is not numeric",
                p["port"], p["targetPort"]
            )
        })?;
        ports.push((p["port"].as_u64().unwrap(), target));
    }
    ports.sort_unstable();
    let mut envoy_ports = ENVOY_PORTS.to_vec();
    envoy_ports.sort_unstable();
    ensure!(
        ports == envoy_ports,
        "trellis-gateway's ports {ports:?} are not Envoy's {envoy_ports:?}"
    );
    let config = config_of(objects, deployment);
    let listening: Vec<u64> = config["listeners"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| port_of(l["address"].as_str().unwrap()))
        .collect();
    for (port, target) in &ports {
        ensure!(
            listening.contains(target),
            "port {port} leads to {target}, where no listener is"
        );
    }
    let world: Vec<Value> = service["metadata"]["annotations"]
        ["networking.resources.gardener.cloud/from-world-to-ports"]
        .as_str()
        .map(|a| serde_json::from_str(a).unwrap())
        .unwrap_or_default();
    for (port, target) in &ports {
        ensure!(
            world
                .iter()
                .any(|w| w["port"] == *target && w["protocol"] == "TCP"),
            "from-world-to-ports does not admit {target} (port {port}): {world:?}"
        );
    }

    let (controller, _) = config_in(objects, deployment, "controller");
    ensure!(
        controller["gateway"]["selector"] == envoy,
        "the controller renders for {}, not for the handler's Envoy {envoy}",
        controller["gateway"]["selector"]
    );
    let envoy_service = format!("istio-ingressgateway.{namespace}.svc.cluster.local");
    let fallback = &controller["fallback"];
    for (field, port) in [("address", 443), ("connect", 8443), ("connectLegacy", 8132)] {
        let expected = format!("{envoy_service}:{port}");
        ensure!(
            fallback[field].as_str() == Some(&expected),
            "fallback.{field} is {}, not the handler's Envoy {expected}",
            fallback[field]
        );
    }

    let has = |label: &str| pod_labels[label] == "allowed";
    for s in &SHOOT_SERVICES {
        let admitted = s.selectors.iter().any(|sel| match sel {
            Selector::Label(k, v) => namespace_labels[*k] == *v,
            Selector::Exists(k) => !namespace_labels[*k].is_null(),
        });
        ensure!(
            admitted,
            "{}'s namespace selectors admit no pod of namespace {namespace} ({namespace_labels})",
            s.name
        );
        let label = policy_label(Some(s.alias), s.name, s.target_port);
        ensure!(
            has(&label),
            "the pods lack {label}: {} is out of reach",
            s.name
        );
    }
    for field in ["address", "connect", "connectLegacy"] {
        let port = address_port(fallback[field].as_str().unwrap());
        let target = ENVOY_PORTS.iter().find(|(p, _)| *p == port).unwrap().1;
        let label = policy_label(None, "istio-ingressgateway", target);
        ensure!(
            has(&label),
            "the pods lack {label}: Envoy's {target} is out of reach"
        );
    }
    for label in [
        "networking.gardener.cloud/to-dns",
        "networking.gardener.cloud/to-runtime-apiserver",
    ] {
        ensure!(has(label), "the pods lack {label}");
    }
    Ok(())
}

/// What `deploy/seed/gateway`'s controller renders of a shoot exposed through the handler
/// (the `internet` fixture shoot moved to this handler and, with `zone`, to that zone's
/// gateway): the route names.
fn handler_routes(objects: &[Value], zone: Option<&str>) -> Vec<String> {
    let deployment = find(objects, "Deployment", "trellis-gateway");
    let root = TestDir::new("deploy-handler");
    let config = lay_out(objects, deployment, "controller", &root.0);
    let seed = root.path("seed");
    std::fs::create_dir_all(&seed).unwrap();
    let fixture =
        std::fs::read_to_string(repo().join("tests/data/controller/seed/shoot--dev--exposed.yaml"))
            .unwrap();
    let role = envoy_labels(zone)["gardener.cloud/role"]
        .as_str()
        .unwrap()
        .to_owned();
    let moved = fixture
        .replace(
            "\"handler.exposureclass.gardener.cloud/name\": \"internet\"",
            &format!("\"handler.exposureclass.gardener.cloud/name\": \"{HANDLER}\""),
        )
        .replace(
            "\"gardener.cloud/role\": \"exposureclass-handler\"",
            &format!("\"gardener.cloud/role\": \"{role}\""),
        );
    assert_ne!(moved, fixture);
    std::fs::write(seed.join("shoot.yaml"), moved).unwrap();
    let out = Command::new(BIN)
        .args(["controller", "render", "--manifests"])
        .arg(&seed)
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table: Value = serde_json::from_slice(&out.stdout).unwrap();
    table["routes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_owned())
        .collect()
}

/// The handler's gateway (`deploy/seed/gateway`) and a zone's (`deploy/seed/zone`, zone `eu-1a`)
/// keep [`handler_rules`] with the labels the rollout gives their namespaces, and each
/// renders the shoots gardenlet exposes through it. The rollout's commands say what the
/// rules assume: the namespace label, and a rollback patch selecting exactly Envoy's pods.
#[test]
fn seed_ingress_is_the_exposure_class_handlers_and_reaches_the_shoots() {
    if !kubectl("seed_ingress_is_the_exposure_class_handlers_and_reaches_the_shoots") {
        return;
    }
    for (base, zone) in [(INGRESS, None), ("seed/zone", Some("eu-1a"))] {
        let objects = render(base);
        handler_rules(&objects, zone, &handler_namespace_labels(zone, true))
            .unwrap_or_else(|e| panic!("deploy/{base}: {e}"));
        let routes = handler_routes(&objects, zone);
        assert!(
            routes.iter().any(|r| r == "shoot--dev--exposed"),
            "deploy/{base}: the handler's shoot is not routed: {routes:?}"
        );
        // The other zone's gateway, or the handler's own, does not take it.
        let other = if zone.is_some() { None } else { Some("eu-1a") };
        let routes = handler_routes(&objects, other);
        assert!(
            !routes.iter().any(|r| r == "shoot--dev--exposed"),
            "deploy/{base} routes another gateway's shoot: {routes:?}"
        );
    }
    let doc = std::fs::read_to_string(repo().join("docs/gardener.md")).unwrap();
    let label = format!(
        "kubectl label namespace {} networking.gardener.cloud/access-target-apiserver=allowed",
        handler_namespace(None)
    );
    assert!(
        doc.contains(&label),
        "docs/gardener.md does not say `{label}`"
    );
    let patch = doc
        .lines()
        .find(|l| l.contains("patch service trellis-gateway"))
        .expect("docs/gardener.md has no rollback patch");
    let json_text = patch.split('\'').nth(1).unwrap();
    let ops: Value = serde_json::from_str(json_text).unwrap();
    assert_eq!(ops[0]["path"], "/spec/selector", "{patch}");
    assert_eq!(
        ops[0]["value"],
        envoy_labels(None),
        "the rollback does not select Envoy"
    );
}

/// The control: each way of breaking [`handler_rules`] fails with the rule it breaks.
#[test]
fn a_seed_ingress_beside_the_handler_fails() {
    if !kubectl("a_seed_ingress_beside_the_handler_fails") {
        return;
    }
    let objects = render(INGRESS);
    fn gateway_service(o: &mut [Value]) -> &mut Value {
        find_mut(o, "Service", "trellis-gateway")
    }
    fn pod_labels(o: &mut [Value]) -> &mut Value {
        &mut find_mut(o, "Deployment", "trellis-gateway")["spec"]["template"]["metadata"]["labels"]
    }
    type Break = fn(&mut Vec<Value>);
    let breaks: Vec<(&str, Break, &str)> = vec![
        (
            "a named target port",
            |o| gateway_service(o)["spec"]["ports"][0]["targetPort"] = json!("tls"),
            "not numeric",
        ),
        (
            "a port Envoy does not have",
            |o| gateway_service(o)["spec"]["ports"][1]["port"] = json!(8444),
            "not Envoy's",
        ),
        (
            "Envoy's pods behind trellis's Service",
            |o| gateway_service(o)["spec"]["selector"] = envoy_labels(None),
            "does not select the trellis pods",
        ),
        (
            "Envoy's labels on the trellis pods",
            |o| {
                for (k, v) in envoy_labels(None).as_object().unwrap() {
                    pod_labels(o)[k] = v.clone();
                }
            },
            "Envoy's Service selects the trellis pods",
        ),
        (
            "no ingress from the world on 8132",
            |o| {
                gateway_service(o)["metadata"]["annotations"]["networking.resources.gardener.cloud/from-world-to-ports"] =
                    json!(r#"[{"port":9443,"protocol":"TCP"},{"port":8443,"protocol":"TCP"}]"#)
            },
            "does not admit 8132",
        ),
        (
            "another handler's selector",
            |o| {
                edit_config(
                    o,
                    "trellis-controller-config",
                    "handler.exposureclass.gardener.cloud/name: trellis",
                    "handler.exposureclass.gardener.cloud/name: internet",
                )
            },
            "not for the handler's Envoy",
        ),
        (
            "the default gateway's Envoy as fallback",
            |o| {
                edit_config(
                    o,
                    "trellis-controller-config",
                    "istio-ingressgateway.istio-ingress-handler-trellis.svc.cluster.local:443",
                    "istio-ingressgateway.istio-ingress.svc.cluster.local:443",
                )
            },
            "fallback.address",
        ),
        (
            "no label for the kube-apiservers",
            |o| {
                pod_labels(o).as_object_mut().unwrap().remove(
                    "networking.resources.gardener.cloud/to-all-shoots-kube-apiserver-tcp-443",
                );
            },
            "kube-apiserver is out of reach",
        ),
        (
            "no label for an HA shoot's second VPN server",
            |o| {
                pod_labels(o).as_object_mut().unwrap().remove(
                    "networking.resources.gardener.cloud/to-all-shoots-vpn-seed-server-1-tcp-1194",
                );
            },
            "vpn-seed-server-1 is out of reach",
        ),
        (
            "no label for Envoy's legacy CONNECT port",
            |o| {
                pod_labels(o)
                    .as_object_mut()
                    .unwrap()
                    .remove("networking.resources.gardener.cloud/to-istio-ingressgateway-tcp-8132");
            },
            "Envoy's 8132",
        ),
        (
            "no label for the seed's API server",
            |o| {
                pod_labels(o)
                    .as_object_mut()
                    .unwrap()
                    .remove("networking.gardener.cloud/to-runtime-apiserver");
            },
            "to-runtime-apiserver",
        ),
        (
            "the gateway in another namespace",
            |o| {
                for x in o.iter_mut() {
                    if x["metadata"]["namespace"] == "istio-ingress-handler-trellis" {
                        x["metadata"]["namespace"] = json!("trellis-ingress");
                    }
                }
            },
            "not in the handler's namespace",
        ),
    ];
    let labels = handler_namespace_labels(None, true);
    for (what, break_it, message) in breaks {
        let mut broken = objects.clone();
        break_it(&mut broken);
        match handler_rules(&broken, None, &labels) {
            Ok(()) => panic!("{what}: passed"),
            Err(e) => assert!(e.contains(message), "{what}: {e}"),
        }
    }
    // The namespace without the operator's label: kube-apiserver admits none of its pods.
    let e = handler_rules(&objects, None, &handler_namespace_labels(None, false)).unwrap_err();
    assert!(e.contains("kube-apiserver's namespace selectors"), "{e}");
    // A zone's overlay held to the handler's own namespace and selector fails.
    let e = handler_rules(&render("seed/zone"), None, &labels).unwrap_err();
    assert!(e.contains("not in the handler's namespace"), "{e}");
}

/// The README's lines from the one starting with `first` to the end of its code block.
fn readme_block(first: &str) -> Vec<String> {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let lines: Vec<&str> = readme.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.starts_with(first))
        .unwrap_or_else(|| panic!("the README has no line starting with {first:?}"));
    lines[start..]
        .iter()
        .take_while(|l| !l.starts_with("```"))
        .map(|l| (*l).to_owned())
        .collect()
}

/// A README command line as this test runs it: the binary the README names as cargo builds
/// it is the one under test.
fn as_tested(line: &str) -> String {
    line.replace("target/release/trellis", BIN)
        .replace("cargo run --release --", BIN)
}

/// A shell running a script in a process group of its own, its output in files; the group
/// is killed on drop (the script's background jobs with it).
struct Shell {
    child: std::process::Child,
    dir: TestDir,
}

impl Shell {
    fn start(script: &str) -> Shell {
        use std::os::unix::process::CommandExt;
        let dir = TestDir::new("readme-shell");
        let child = Command::new("bash")
            .arg("-c")
            .arg(script)
            .current_dir(repo())
            .process_group(0)
            .stdin(std::process::Stdio::null())
            .stdout(std::fs::File::create(dir.path("stdout")).unwrap())
            .stderr(std::fs::File::create(dir.path("stderr")).unwrap())
            .spawn()
            .unwrap();
        Shell { child, dir }
    }

    /// Waits up to `limit` for the script to end; its stdout and stderr.
    fn wait(&mut self, limit: Duration) -> (String, String) {
        let start = std::time::Instant::now();
        while self.child.try_wait().unwrap().is_none() {
            let read = |f: &str| std::fs::read_to_string(self.dir.path(f)).unwrap_or_default();
            assert!(
                start.elapsed() < limit,
                "the script did not end within {limit:?}:\n{}\n{}",
                read("stdout"),
                read("stderr")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let read = |f: &str| std::fs::read_to_string(self.dir.path(f)).unwrap();
        (read("stdout"), read("stderr"))
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        use rustix::process::{Pid, Signal, kill_process_group};
        let _ = kill_process_group(Pid::from_child(&self.child), Signal::KILL);
        let _ = self.child.wait();
    }
}

/// The README's Try block of a tunnel (gateway, agent, a target, then the egress CONNECT
/// through the tunnel) works pasted at once, as written: it waits for the processes itself,
/// and its CONNECT reaches the target through the agent, whose peer `/routes` then shows.
/// Only `cargo run --release --` is the binary under test; the block's background jobs are
/// stopped when it ends. Needs curl and python3; its ports (the example configs') free.
#[test]
fn readme_tunnel_try_block_works_pasted_at_once() {
    let test = "readme_tunnel_try_block_works_pasted_at_once";
    for tool in ["curl", "python3", "bash"] {
        let here = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !here {
            common::skip(test, &format!("{tool} is not installed"));
            return;
        }
    }
    let block = readme_block("cargo run --release -- gateway --config config/tunnel.yaml &");
    assert!(block.len() >= 6, "{block:?}");
    for port in [8000, 8446, 9445, 15003, 15024, 16911] {
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
            "port {port}, which the README's example configs use, is taken"
        );
    }
    let script = format!(
        "trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n{}\n",
        block
            .iter()
            .map(|l| as_tested(l))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(!script.contains("cargo "), "{script}");
    let mut shell = Shell::start(&script);
    let (stdout, stderr) = shell.wait(Duration::from_secs(120));
    assert!(
        stdout.contains("Directory listing for /"),
        "the CONNECT through the tunnel did not reach the target:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("\"live\": true"),
        "/routes shows no live peer:\n{stdout}\n{stderr}"
    );
}

/// The README's example of `controller render` on the repository's example seed prints what
/// the README shows of its output, run exactly as written.
#[test]
fn readme_render_example_prints_what_the_readme_shows() {
    let command = readme_block("target/release/trellis controller render --manifests tests/");
    assert_eq!(command.len(), 1, "{command:?}");
    let args: Vec<String> = as_tested(&command[0])
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let out = Command::new(&args[0])
        .args(&args[1..])
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let after = &readme[readme.find(&command[0]).unwrap()..];
    let shown = &after[after.find("```text\n").unwrap() + 8..];
    let shown = &shown[..shown.find("\n```").unwrap()];
    let chunks: Vec<&str> = shown.split("\n…\n").collect();
    assert!(chunks.len() >= 2, "{shown}");
    for chunk in chunks {
        assert!(
            printed.contains(chunk),
            "the README shows\n{chunk}\nwhich render does not print:\n{printed}"
        );
    }
}

/// The README's commands that save a seed's objects and render them work against an API
/// server as written (kubectl's current context from `KUBECONFIG`), also on a seed without
/// the Gateway API's or Gardener's extension CRDs: the table holds the shoot put there.
#[test]
fn readme_seed_export_renders_what_the_api_server_holds() {
    if !kubectl("readme_seed_export_renders_what_the_api_server_holds") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let kube = rt.block_on(fakekube::FakeKube::start());
    let _guard = rt.enter();
    let fixture =
        std::fs::read_to_string(repo().join("tests/data/controller/seed/shoot--dev--alpha.yaml"))
            .unwrap();
    for object in serde_saphyr::from_multiple::<Value>(&fixture).unwrap() {
        if !object.is_null() {
            kube.put(object);
        }
    }
    kube.serve_group("gateway.networking.k8s.io", &[]);
    kube.serve_group("extensions.gardener.cloud", &[]);
    let dir = TestDir::new("readme-export");
    kube.write_kubeconfig(&dir.path("kubeconfig"));
    let work = dir.path("work");
    std::fs::create_dir_all(&work).unwrap();
    std::os::unix::fs::symlink(repo().join("config"), work.join("config")).unwrap();
    let script: Vec<String> = readme_block("mkdir -p seed out")
        .iter()
        .map(|l| as_tested(l))
        .collect();
    assert!(script.len() >= 6, "{script:?}");
    let out = Command::new("sh")
        .args(["-e", "-c", &script.join("\n")])
        .current_dir(&work)
        .env("KUBECONFIG", dir.path("kubeconfig"))
        .env("HOME", dir.path("home"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!work.join("seed/tlsroutes.yaml").exists());
    let table: Value =
        serde_json::from_str(&std::fs::read_to_string(work.join("out/routes.json")).unwrap())
            .unwrap();
    let names: Vec<&str> = table["routes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"shoot--dev--alpha"), "{names:?}");
    drop(kube);
}

// The Gardener extension: the Helm chart gardenlet installs in a seed
// (charts/trellis-extension) and the garden's objects that register it (deploy/extension).

const EXTENSION_NAMESPACE: &str = "extension-trellis-x7k2p";

/// The chart's templates rendered as gardenlet's Helm would, by substitution: they use only
/// `.Release.Namespace` and `.Values.image` (any other template text fails the test).
fn render_chart(image: &str) -> Vec<Value> {
    let dir = repo().join("charts/trellis-extension/templates");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let mut objects = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let text = text
            .replace("{{ .Release.Namespace }}", EXTENSION_NAMESPACE)
            .replace("{{ .Values.image }}", image);
        assert!(
            !text.contains("{{"),
            "{}: template text other than .Release.Namespace and .Values.image",
            file.display()
        );
        objects.extend(
            serde_saphyr::from_multiple::<Value>(&text)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
                .into_iter()
                .filter(|v| !v.is_null()),
        );
    }
    objects
}

#[test]
fn extension_chart_renders_validates_and_its_config_passes_check() {
    let image = "registry.example.com/trellis:v9.9.9";
    let objects = render_chart(image);
    for o in &objects {
        if o["metadata"]["namespace"].is_string() {
            assert_eq!(o["metadata"]["namespace"], EXTENSION_NAMESPACE, "{o}");
        }
    }
    if let Some(v) = validator() {
        validate(&v, &objects).unwrap();
    } else {
        common::skip(
            "extension_chart_renders_validates_and_its_config_passes_check (schemas)",
            "kubernetes-validate is not installed",
        );
    }
    let deployment = find(&objects, "Deployment", "gardener-extension-trellis");
    let pod = &deployment["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(c["image"], image);
    // Its config, laid out as the pod mounts it, passes `trellis check` and is the one the
    // container runs with.
    let root = TestDir::new("extension-chart");
    let file = lay_out(&objects, deployment, "extension", &root.0);
    let (ok, out) = check(&file);
    assert!(ok, "{out}");
    assert!(out.contains("valid ExtensionConfiguration"), "{out}");
    let config: Value = serde_saphyr::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(config["namespace"], EXTENSION_NAMESPACE);
    assert_eq!(
        config["image"], image,
        "the shoots' nodes run the chart's image"
    );
    // The Service leads to the webhook server; probes go to the admin port.
    let service = find(&objects, "Service", "gardener-extension-trellis");
    assert_eq!(
        config["webhook"]["service"], service["metadata"]["name"],
        "the server certificate names the Service the API servers call"
    );
    let webhook = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["port"] == 443)
        .expect("the webhooks' URL is https://<service>.<namespace>:443");
    let webhook_port = port_of(config["webhook"]["address"].as_str().unwrap());
    assert_eq!(webhook["targetPort"], webhook_port);
    assert_eq!(
        port_of(config["admin"]["address"].as_str().unwrap()),
        c["readinessProbe"]["httpGet"]["port"].as_u64().unwrap()
    );
    // gardener-resource-manager admits the shoots' kube-apiservers to the webhook port.
    let annotations = &service["metadata"]["annotations"];
    let allowed: Value = serde_json::from_str(
        annotations["networking.resources.gardener.cloud/from-all-webhook-targets-allowed-ports"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(allowed, json!([{"protocol": "TCP", "port": webhook_port}]));
    let selectors: Value = serde_json::from_str(
        annotations["networking.resources.gardener.cloud/namespace-selectors"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert!(
        selectors
            .as_array()
            .unwrap()
            .contains(&json!({"matchLabels": {"gardener.cloud/role": "shoot"}})),
        "{selectors}"
    );
    // Every shoot namespace's Secrets hold keys: the extension reads and writes its own by
    // name, never lists or watches them.
    let role = find(&objects, "ClusterRole", "gardener-extension-trellis");
    for rule in role["rules"].as_array().unwrap() {
        if rule["resources"]
            .as_array()
            .unwrap()
            .contains(&json!("secrets"))
        {
            let verbs = rule["verbs"].as_array().unwrap();
            assert!(
                !verbs.contains(&json!("list")) && !verbs.contains(&json!("watch")),
                "{rule}"
            );
        }
    }
    // Unprivileged, and under its own account.
    assert_eq!(c["securityContext"]["runAsNonRoot"], true);
    assert_eq!(c["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(pod["serviceAccountName"], "gardener-extension-trellis");
}

#[test]
fn extension_registration_and_deployment_carry_the_chart() {
    let objects: Vec<Value> = ["controllerregistration.yaml", "controllerdeployment.yaml"]
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(repo().join("deploy/extension").join(f)).unwrap();
            serde_saphyr::from_multiple::<Value>(&text).unwrap()
        })
        .filter(|v| !v.is_null())
        .collect();
    let registration = find(&objects, "ControllerRegistration", "extension-trellis");
    assert_eq!(registration["apiVersion"], "core.gardener.cloud/v1beta1");
    let resources = registration["spec"]["resources"].as_array().unwrap();
    assert_eq!(resources.len(), 1);
    let r = &resources[0];
    assert_eq!(r["kind"], "Extension");
    assert_eq!(r["type"], "trellis-node");
    assert_eq!(r["workerlessSupported"], false);
    assert!(
        r.get("globallyEnabled").is_none() && r.get("autoEnable").is_none(),
        "a shoot opts in itself: {r}"
    );
    assert_eq!(
        registration["spec"]["deployment"]["deploymentRefs"],
        json!([{"name": "extension-trellis"}])
    );
    let deployment = find(&objects, "ControllerDeployment", "extension-trellis");
    assert_eq!(deployment["apiVersion"], "core.gardener.cloud/v1");
    // rawChart is the chart in the repository, file by file (scripts/extension-chart).
    let raw = deployment["helm"]["rawChart"].as_str().unwrap();
    let dir = TestDir::new("extension-raw-chart");
    let tgz = dir.path("chart.tgz");
    let decoded = Command::new("base64")
        .arg("-d")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(raw.as_bytes())?;
            child.wait_with_output()
        })
        .unwrap();
    assert!(decoded.status.success(), "rawChart is not base64");
    std::fs::write(&tgz, &decoded.stdout).unwrap();
    let out = Command::new("tar")
        .arg("-xzf")
        .arg(&tgz)
        .arg("-C")
        .arg(&dir.0)
        .output()
        .unwrap();
    assert!(out.status.success(), "rawChart is not a .tgz: {out:?}");
    let chart = repo().join("charts/trellis-extension");
    let unpacked = dir.path("trellis-extension");
    let list = |root: &Path| -> Vec<PathBuf> {
        let mut files = Vec::new();
        let mut dirs = vec![root.to_owned()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    dirs.push(p);
                } else {
                    files.push(p.strip_prefix(root).unwrap().to_owned());
                }
            }
        }
        files.sort();
        files
    };
    assert_eq!(
        list(&unpacked),
        list(&chart),
        "rawChart is stale: run scripts/extension-chart"
    );
    for f in list(&chart) {
        assert_eq!(
            std::fs::read(unpacked.join(&f)).unwrap(),
            std::fs::read(chart.join(&f)).unwrap(),
            "rawChart's {} is stale: run scripts/extension-chart",
            f.display()
        );
    }
    assert!(unpacked.join("Chart.yaml").exists());
    assert_eq!(
        deployment["helm"]["values"]["image"]
            .as_str()
            .unwrap()
            .split(':')
            .next(),
        Some("ghcr.io/gardener/trellis")
    );
}
