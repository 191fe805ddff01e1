//! `deploy/`: the kustomize bases render with `kubectl kustomize`; every rendered object
//! validates against the Kubernetes OpenAPI schemas (the `kubernetes-validate` package,
//! `--strict`, so unknown fields fail); the configs in the rendered ConfigMaps pass `trellis
//! check` laid out as the pods mount them; and the pods keep the rules a rollout without
//! refusals depends on (grace period above the drain, probes on the admin port, the Service
//! ports on the listeners). Skipped with a printed reason without kubectl or
//! kubernetes-validate (`scripts/test` installs the latter into `target/deploy-venv`).
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![allow(clippy::unwrap_used, unreachable_pub)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

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

/// A pod's ConfigMap volumes as the container sees them: every key of the ConfigMap written
/// under `root` + the mount path. Returns the path inside `root` of the `--config` argument.
fn lay_out_config(objects: &[Value], workload: &Value, root: &Path) -> PathBuf {
    let pod = &workload["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    for mount in container["volumeMounts"].as_array().unwrap() {
        let volume = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap();
        let cm_name = volume["configMap"]["name"]
            .as_str()
            .expect("every mounted volume is a ConfigMap");
        let cm = find(objects, "ConfigMap", cm_name);
        let dir = root.join(mount["mountPath"].as_str().unwrap().trim_start_matches('/'));
        std::fs::create_dir_all(&dir).unwrap();
        for (key, value) in cm["data"].as_object().unwrap() {
            std::fs::write(dir.join(key), value.as_str().unwrap()).unwrap();
        }
    }
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let at = args.iter().position(|a| *a == "--config").unwrap();
    root.join(args[at + 1].trim_start_matches('/'))
}

/// `trellis check FILE`: whether it passed, and what it printed.
fn check(file: &Path) -> (bool, String) {
    run(
        Command::new(BIN).arg("check").arg(file),
        b"",
        Duration::from_secs(20),
    )
}

/// The config file the workload runs with, parsed.
fn config_of(objects: &[Value], workload: &Value) -> Value {
    let dir = TestDir::new("deploy-config");
    let file = lay_out_config(objects, workload, &dir.0);
    serde_saphyr::from_str(&std::fs::read_to_string(file).unwrap()).unwrap()
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

/// Each workload's config, laid out as its volumes mount it, passes `trellis check`; the
/// gateway's routing table is found where the gateway looks for it (relative to its config
/// file) and passes too.
#[test]
fn embedded_configs_pass_check_where_the_pods_mount_them() {
    if !kubectl("embedded_configs_pass_check_where_the_pods_mount_them") {
        return;
    }
    for (base, kind) in [
        ("seed", "GatewayConfiguration"),
        ("shoot", "NodeConfiguration"),
    ] {
        let objects = render(base);
        let workload = workloads(&objects).next().unwrap();
        let root = TestDir::new("deploy-mounts");
        let file = lay_out_config(&objects, workload, &root.0);
        assert!(
            file.exists(),
            "deploy/{base}: --config {file:?} is not mounted"
        );
        let (ok, out) = check(&file);
        assert!(
            ok && out.contains(&format!("valid {kind}")),
            "{base}: {out}"
        );
        if kind == "GatewayConfiguration" {
            let config: Value =
                serde_saphyr::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
            let routes = file
                .parent()
                .unwrap()
                .join(config["routes"]["file"].as_str().unwrap());
            assert!(
                routes.exists(),
                "routes.file {routes:?} is not on a mounted volume"
            );
            let (ok, out) = check(&routes);
            assert!(ok && out.contains("valid RoutingTable"), "{out}");
        }
    }
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
    assert_eq!(hpa["spec"]["metrics"][0]["resource"]["name"], "cpu");

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
