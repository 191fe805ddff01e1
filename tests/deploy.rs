//! `deploy/`: the kustomize bases render with `kubectl kustomize`; every rendered object
//! validates against the Kubernetes OpenAPI schemas (the `kubernetes-validate` package,
//! `--strict`, so unknown fields fail); the configs in the rendered ConfigMaps pass `trellis
//! check` laid out as the pods mount them (the seed gateway's once the table its controller
//! sidecar renders is where the controller writes it); the pods keep the rules a rollout
//! without refusals depends on (grace period above the drain, probes on the admin port, the
//! Service ports on the listeners); and the controller sidecar is wired to the gateway
//! (table volume, startup probe, token in the sidecar only, a ClusterRole of exactly the
//! kinds the controller watches, read-only). Skipped with a printed reason without kubectl or
//! kubernetes-validate (`scripts/test` installs the latter into `target/deploy-venv`).
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![allow(clippy::unwrap_used, unreachable_pub)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use trellis::controller::kinds::{WATCHED, WatchedKind};

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
        eprintln!("SKIP {test}: kubectl is not installed");
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
        eprintln!(
            "SKIP {test}: kubernetes-validate is not installed (scripts/test installs it into \
             target/deploy-venv)"
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
    objects
        .iter()
        .filter(|o| o["kind"] == "Deployment" || o["kind"] == "DaemonSet")
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

/// A pod as container `name` sees it, under `root/NAME`: every volume it mounts is a
/// directory at its mount path, with the keys of a ConfigMap written into it (an emptyDir
/// starts empty; [`share`] copies what one container wrote to the others). Real directories,
/// not links, so `..` from a mount path leads where it does in the container. Returns the
/// path inside `root` of the container's `--config` argument.
fn lay_out(objects: &[Value], workload: &Value, name: &str, root: &Path) -> PathBuf {
    let pod = &workload["spec"]["template"]["spec"];
    let container = container(pod, name);
    let own = root.join(name);
    for mount in container["volumeMounts"].as_array().unwrap() {
        let at = own.join(mount["mountPath"].as_str().unwrap().trim_start_matches('/'));
        let volume = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap();
        let Some(cm_name) = volume["configMap"]["name"].as_str() else {
            std::fs::create_dir_all(&at).unwrap();
            continue;
        };
        let data = find(objects, "ConfigMap", cm_name)["data"]
            .as_object()
            .unwrap()
            .clone();
        match mount["subPath"].as_str() {
            Some(key) => {
                std::fs::create_dir_all(at.parent().unwrap()).unwrap();
                std::fs::write(&at, data[key].as_str().unwrap()).unwrap();
            }
            None => {
                std::fs::create_dir_all(&at).unwrap();
                for (key, value) in data {
                    std::fs::write(at.join(key), value.as_str().unwrap()).unwrap();
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

#[test]
fn seed_and_shoot_render_and_validate_against_kubernetes_schemas() {
    let Some(validator) = tools("seed_and_shoot_render_and_validate_against_kubernetes_schemas")
    else {
        return;
    };
    for (base, kinds) in [
        (
            "seed",
            &[
                "Namespace",
                "ServiceAccount",
                "ClusterRole",
                "ClusterRoleBinding",
                "ConfigMap",
                "Deployment",
                "Service",
                "PodDisruptionBudget",
                "HorizontalPodAutoscaler",
            ][..],
        ),
        ("shoot", &["ConfigMap", "DaemonSet"][..]),
    ] {
        let objects = render(base);
        for kind in kinds {
            assert!(
                objects.iter().any(|o| o["kind"] == *kind),
                "deploy/{base} renders no {kind}"
            );
        }
        if let Err(report) = validate(&validator, &objects) {
            panic!("deploy/{base}: {report}");
        }
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
    let objects = render("seed");
    let deployment = objects
        .iter()
        .position(|o| o["kind"] == "Deployment")
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
/// seed pod the gateway's does only once a routing table is where the gateway looks for it:
/// the table `trellis controller render` makes with the controller's config, written where
/// that config says and shared through the pod's volumes as the kubelet shares them. Its
/// listeners' default routes are in that table (`check` requires it).
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

    let objects = render("seed");
    let deployment = find(&objects, "Deployment", "trellis-gateway");
    let root = TestDir::new("deploy-mounts");
    let controller = lay_out(&objects, deployment, "controller", &root.0);
    let gateway = lay_out(&objects, deployment, "trellis", &root.0);
    let (ok, out) = check(&controller);
    assert!(ok && out.contains("valid ControllerConfiguration"), "{out}");
    let (ok, out) = check(&gateway);
    assert!(
        !ok && out.contains("cannot read the routing table"),
        "the gateway has a table before the controller wrote one: {out}"
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
    assert!(ok && out.contains("valid GatewayConfiguration"), "{out}");
}

#[test]
fn seed_gateway_survives_rollouts_zones_and_evictions() {
    if !kubectl("seed_gateway_survives_rollouts_zones_and_evictions") {
        return;
    }
    let objects = render("seed");
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

/// `Err(message)` unless `cond`.
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
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

/// The seed pod's controller sidecar and what it depends on; `Err` names the first rule
/// broken. `watched` is what the controller watches (the ClusterRole must grant exactly that).
fn controller_wiring(objects: &[Value], watched: &[WatchedKind]) -> Result<(), String> {
    let deployment = find(objects, "Deployment", "trellis-gateway");
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

    // RBAC: the pod's account is bound to one ClusterRole that grants list and watch (its
    // watchers never `get`) on exactly what the controller watches.
    let account = pod["serviceAccountName"].as_str().unwrap();
    let namespace = deployment["metadata"]["namespace"].as_str().unwrap();
    let bindings: Vec<&Value> = objects
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
        .collect();
    ensure!(
        bindings.len() == 1 && bindings[0]["kind"] == "ClusterRoleBinding",
        "service account {namespace}/{account} has {} bindings, not one ClusterRoleBinding",
        bindings.len()
    );
    let role_ref = &bindings[0]["roleRef"];
    ensure!(role_ref["kind"] == "ClusterRole", "{role_ref}");
    let role = find(objects, "ClusterRole", role_ref["name"].as_str().unwrap());
    let mut granted = std::collections::BTreeSet::new();
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
        for group in rule["apiGroups"].as_array().unwrap() {
            for resource in rule["resources"].as_array().unwrap() {
                granted.insert((
                    group.as_str().unwrap().to_owned(),
                    resource.as_str().unwrap().to_owned(),
                ));
            }
        }
    }
    let wanted: std::collections::BTreeSet<(String, String)> = watched
        .iter()
        .map(|k| (k.group.to_owned(), k.plural.to_owned()))
        .collect();
    ensure!(
        granted == wanted,
        "the ClusterRole grants {granted:?}; the controller watches {wanted:?}"
    );
    Ok(())
}

/// The controller runs beside each gateway as the deploy notes say: see
/// [`controller_wiring`].
#[test]
fn seed_controller_sidecar_writes_where_the_gateway_reads_with_read_only_access() {
    if !kubectl("seed_controller_sidecar_writes_where_the_gateway_reads_with_read_only_access") {
        return;
    }
    let objects = render("seed");
    controller_wiring(&objects, &WATCHED).unwrap();
}

/// The deployment's pod spec, to break.
fn pod_mut(objects: &mut [Value]) -> &mut Value {
    let d = objects
        .iter_mut()
        .find(|o| o["kind"] == "Deployment")
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

/// Replaces `from` by `to` in the ConfigMap named `prefix-<hash>`.
fn edit_config(objects: &mut [Value], prefix: &str, from: &str, to: &str) {
    let cm = objects
        .iter_mut()
        .find(|o| {
            o["kind"] == "ConfigMap" && o["metadata"]["name"].as_str().unwrap().starts_with(prefix)
        })
        .unwrap();
    for value in cm["data"].as_object_mut().unwrap().values_mut() {
        let text = value.as_str().unwrap();
        assert!(text.contains(from), "{from:?} not in {prefix}");
        *value = Value::String(text.replacen(from, to, 1));
    }
}

fn rule_mut(objects: &mut [Value], i: usize) -> &mut Value {
    let role = objects
        .iter_mut()
        .find(|o| o["kind"] == "ClusterRole")
        .unwrap();
    &mut role["rules"][i]
}

/// The control for the test above: each way of breaking the wiring fails the check that
/// names it.
#[test]
fn a_miswired_controller_sidecar_fails() {
    if !kubectl("a_miswired_controller_sidecar_fails") {
        return;
    }
    let objects = render("seed");
    type Break = fn(&mut Vec<Value>);
    let breaks: [(&str, Break, &str); 18] = [
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
            "the ClusterRole grants",
        ),
        (
            "a kind granted that is not watched",
            |o| {
                rule_mut(o, 1)["resources"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("configmaps"));
            },
            "the ClusterRole grants",
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
                let b = o
                    .iter_mut()
                    .find(|o| o["kind"] == "ClusterRoleBinding")
                    .unwrap();
                b["subjects"][0]["namespace"] = json!("default");
            },
            "has 0 bindings",
        ),
    ];
    for (what, break_it, message) in breaks {
        let mut broken = objects.clone();
        break_it(&mut broken);
        match controller_wiring(&broken, &WATCHED) {
            Ok(()) => panic!("{what}: passed"),
            Err(e) => assert!(e.contains(message), "{what}: {e}"),
        }
    }
    // A kind the controller comes to watch without a rule for it.
    let mut more = WATCHED.to_vec();
    more.push(WatchedKind {
        group: "gateway.networking.k8s.io",
        versions: &["v1alpha2"],
        kind: "TCPRoute",
        plural: "tcproutes",
        selector: None,
    });
    let err = controller_wiring(&objects, &more).unwrap_err();
    assert!(err.contains("the ClusterRole grants"), "{err}");
}
