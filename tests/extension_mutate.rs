//! The `apiserver-proxy` webhook on AdmissionReviews built from Gardener v1.149.3's objects
//! (`tests/data/extension/`, see its README): patches applied and compared with the golden
//! objects, idempotence, what every mutation must keep, objects it does not handle, shapes
//! it refuses; and the rendered `node.yaml` against the real binary (`trellis check`,
//! `trellis node --advertise-address`).
//!
//! `TRELLIS_BLESS=1` rewrites `tests/data/extension/expected/` (review the diff).
#![cfg(feature = "extension")]

mod extension_common;

use std::collections::BTreeSet;
use std::process::Command;

use extension_common::*;
use serde_json::{Value, json};
use trellis::extension::mutate::{self, Decision, apiserver_proxy as ap};
use trellis::extension::role::{ExtensionType, Target};
use trellis::extension::state::{NodeShoot, Shoot};

const BIN: &str = env!("CARGO_BIN_EXE_trellis");

const MUTATED_INPUTS: [&str; 4] = [
    "apiserver-proxy-ipv4",
    "apiserver-proxy-ipv6",
    "apiserver-proxy-tls-termination",
    "apiserver-proxy-other-webhooks",
];

fn object(name: &str) -> Value {
    json(&format!("{name}.review.json"))["request"]["object"].clone()
}

fn review(shoot: Option<&Shoot>, object: &Value) -> Decision {
    mutate::review(Target::ApiserverProxy, shoot, object)
}

fn apply(object: &Value, d: &Decision) -> Value {
    let mut out = object.clone();
    if let Some(p) = &d.patch {
        json_patch::patch(&mut out, p).expect("the patch applies to its own input");
    }
    out
}

fn named<'a>(list: &'a Value, name: &str) -> Option<&'a Value> {
    list.as_array()?.iter().find(|c| c["name"] == name)
}

fn names(list: &Value) -> Vec<String> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["name"].as_str().map(str::to_owned))
        .collect()
}

/// The input without what the webhook replaces, and the output without what it adds:
/// everything else must be identical (names, labels, annotations, host network, priority,
/// tolerations, other webhooks' containers, unknown fields).
fn without_replaced(o: &Value) -> Value {
    let mut o = o.clone();
    let pod = o["spec"]["template"]["spec"]
        .as_object_mut()
        .expect("pod spec");
    for (key, gone) in [
        ("initContainers", &["setup"][..]),
        ("containers", &["sidecar", "proxy", ap::CONTAINER][..]),
        ("volumes", &["proxy-config", "admin-uds", ap::VOLUME][..]),
    ] {
        if let Some(Value::Array(list)) = pod.get_mut(key) {
            list.retain(|c| !gone.iter().any(|g| c["name"] == *g));
            if list.is_empty() {
                pod.remove(key);
            }
        }
    }
    if let Some(a) = o["spec"]["template"]["metadata"]["annotations"].as_object_mut() {
        a.remove(ap::DIGEST_ANNOTATION);
    }
    o
}

/// What must hold of every mutated object whatever the golden file says.
fn check_mutated(name: &str, input: &Value, out: &Value, node: &NodeShoot) {
    let pod = &input["spec"]["template"]["spec"];
    let setup = named(&pod["initContainers"], "setup").expect("input has setup");
    let ip = setup["args"]
        .as_array()
        .expect("args")
        .iter()
        .find_map(|a| a.as_str()?.strip_prefix("--ip-address="))
        .expect("setup's --ip-address=");
    let proxy = named(&pod["containers"], "proxy").expect("input has proxy");
    let host_port = &proxy["ports"][0]["hostPort"];

    let new = &out["spec"]["template"]["spec"];
    let containers = names(&new["containers"]);
    for gone in ["sidecar", "proxy"] {
        assert!(
            !containers.contains(&gone.to_owned()),
            "{name}: {gone} left"
        );
    }
    assert!(!names(&new["initContainers"]).contains(&"setup".to_owned()));
    assert_eq!(
        containers.iter().filter(|c| *c == ap::CONTAINER).count(),
        1,
        "{name}: one {}",
        ap::CONTAINER
    );
    let c = named(&new["containers"], ap::CONTAINER).expect("trellis container");
    let command: Vec<&str> = c["command"]
        .as_array()
        .expect("command")
        .iter()
        .map(|a| a.as_str().expect("text"))
        .collect();
    assert_eq!(
        &command[command.len() - 5..],
        [
            "node",
            "--config",
            "/etc/trellis/node.yaml",
            "--advertise-address",
            ip
        ],
        "{name}: the advertise address as the object wrote it"
    );
    assert_eq!(c["image"], node.image);
    assert_eq!(
        c["securityContext"]["capabilities"],
        json!({"drop": ["ALL"], "add": ["NET_ADMIN", "NET_BIND_SERVICE"]})
    );
    assert_eq!(c["ports"].as_array().map(Vec::len), Some(1));
    assert_eq!(c["ports"][0]["name"], "metrics");
    assert_eq!(c["ports"][0]["containerPort"], 16910);
    assert_eq!(
        &c["ports"][0]["hostPort"], host_port,
        "{name}: hostPort kept"
    );
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/ready");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/live");
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], 16910);
    let v = named(&new["volumes"], ap::VOLUME).expect("config volume");
    assert_eq!(v["configMap"]["name"], node.config_map);
    assert_eq!(
        c["volumeMounts"],
        json!([{"name": ap::VOLUME, "mountPath": "/etc/trellis", "readOnly": true}])
    );
    assert_eq!(
        out["spec"]["template"]["metadata"]["annotations"][ap::DIGEST_ANNOTATION],
        node.config_digest
    );
    assert_eq!(
        without_replaced(input),
        without_replaced(out),
        "{name}: everything but the replaced parts kept"
    );
}

#[test]
fn golden_apiserver_proxy_daemonsets_are_mutated_and_idempotent() {
    let r = rendered();
    let shoot = enabled_shoot(&r);
    let bless = std::env::var_os("TRELLIS_BLESS").is_some();
    for name in MUTATED_INPUTS {
        let input = object(name);
        let d = review(Some(&shoot), &input);
        assert_eq!(d.result, "mutated", "{name}: {:?}", d.warning);
        assert_eq!(d.warning, None);
        let patch = d.patch.as_ref().expect("a patch");
        let patch_json = serde_json::to_value(patch).expect("patch serializes");
        assert!(!mutate::contains_key_material(&patch_json), "{name}");
        let out = apply(&input, &d);
        let golden = data(&format!("expected/{name}.json"));
        if bless {
            let text = serde_json::to_string_pretty(&out).expect("json") + "\n";
            std::fs::write(&golden, text).expect("golden written");
        }
        assert_eq!(
            out,
            json(&format!("expected/{name}.json")),
            "{name}: golden"
        );
        check_mutated(name, &input, &out, &r.node);

        // Admitted again (a reinvocation, or the stored object on the next update).
        let again = review(Some(&shoot), &out);
        assert_eq!(
            (again.result, &again.patch, &again.warning),
            ("unchanged", &None, &None),
            "{name}: idempotent"
        );
    }
}

/// The API server defaults the object the webhook returned before it stores it (and hands
/// it to the next review): fields the webhook did not write must not make it patch again.
#[test]
fn a_defaulted_output_is_still_unchanged() {
    let r = rendered();
    let shoot = enabled_shoot(&r);
    let mut out = apply(
        &object("apiserver-proxy-ipv4"),
        &review(Some(&shoot), &object("apiserver-proxy-ipv4")),
    );
    let containers = out["spec"]["template"]["spec"]["containers"]
        .as_array_mut()
        .expect("containers");
    let c = containers
        .iter_mut()
        .find(|c| c["name"] == ap::CONTAINER)
        .expect("ours");
    c["stdin"] = json!(false);
    c["readinessProbe"]["terminationGracePeriodSeconds"] = json!(null);
    c["securityContext"]["procMount"] = json!("Default");
    let d = review(Some(&shoot), &out);
    assert_eq!((d.result, d.patch), ("unchanged", None));
}

/// A new image or config on an object already in trellis' shape: only what changed is
/// patched.
#[test]
fn an_outdated_output_is_brought_up_to_date() {
    let r = rendered();
    let shoot = enabled_shoot(&r);
    let input = object("apiserver-proxy-ipv6");
    let out = apply(&input, &review(Some(&shoot), &input));
    let mut newer = shoot.clone();
    let node = newer.node.as_mut().expect("node");
    node.image = "ghcr.io/gardener/trellis:v1.0.0".into();
    node.config_digest = "0".repeat(64);
    let d = review(Some(&newer), &out);
    assert_eq!(d.result, "mutated");
    let paths: BTreeSet<String> = d
        .patch
        .as_ref()
        .expect("patch")
        .0
        .iter()
        .map(|op| op.path().to_string())
        .collect();
    let containers = names(&out["spec"]["template"]["spec"]["containers"]);
    let i = containers
        .iter()
        .position(|c| c == ap::CONTAINER)
        .expect("ours");
    assert_eq!(
        paths,
        BTreeSet::from([
            format!("/spec/template/spec/containers/{i}/image"),
            "/spec/template/metadata/annotations/trellis.gardener.cloud~1config-digest".into(),
        ])
    );
    let updated = apply(&out, &d);
    check_mutated(
        "newer",
        &input,
        &updated,
        newer.node.as_ref().expect("node"),
    );
    assert_eq!(review(Some(&newer), &updated).result, "unchanged");
}

#[test]
fn other_objects_are_not_handled() {
    let shoot = enabled_shoot(&rendered());
    let mut others: Vec<(String, Value)> = ["vpn-seed-server", "vpn-shoot", "kube-apiserver"]
        .iter()
        .map(|n| (n.to_string(), object(n)))
        .collect();
    let base = object("apiserver-proxy-ipv4");
    for (what, pointer, value) in [
        ("other namespace", "/metadata/namespace", json!("default")),
        ("other name", "/metadata/name", json!("apiserver-proxy-2")),
        ("a Deployment", "/kind", json!("Deployment")),
        ("apps/v1beta2", "/apiVersion", json!("apps/v1beta2")),
    ] {
        let mut o = base.clone();
        *o.pointer_mut(pointer).expect("pointer") = value;
        others.push((what.into(), o));
    }
    for (name, o) in others {
        let d = review(Some(&shoot), &o);
        assert_eq!((d.result, &d.patch), ("not_handled", &None), "{name}");
        assert!(d.warning.is_some(), "{name}: a warning");
    }
}

#[test]
fn not_enabled_without_config_label_or_node_data() {
    let r = rendered();
    let input = object("apiserver-proxy-ipv4");
    let full = enabled_shoot(&r);
    let mut unlabelled = full.clone();
    unlabelled.labelled.clear();
    let mut unconfigured = full.clone();
    unconfigured.configured.clear();
    let mut no_node = full.clone();
    no_node.node = None;
    for (what, shoot) in [
        ("no shoot", None),
        ("no label", Some(&unlabelled)),
        ("not configured", Some(&unconfigured)),
        ("no node data", Some(&no_node)),
    ] {
        let d = review(shoot, &input);
        assert_eq!((d.result, &d.patch), ("not_enabled", &None), "{what}");
        assert!(d.warning.is_some(), "{what}");
    }
    assert!(full.enabled(ExtensionType::Node));
    assert_eq!(review(Some(&full), &input).result, "mutated");
}

/// Shapes the webhook refuses: unchanged, with a warning naming what was unexpected.
#[test]
fn unexpected_shapes_are_admitted_unchanged_with_a_warning() {
    let shoot = enabled_shoot(&rendered());
    let base = object("apiserver-proxy-ipv4");
    type Edit = fn(&mut Value);
    let cases: Vec<(&str, Edit)> = vec![
        ("init container setup missing", |o| {
            o["spec"]["template"]["spec"]["initContainers"] = json!([]);
        }),
        ("container sidecar missing", |o| {
            let c = o["spec"]["template"]["spec"]["containers"]
                .as_array_mut()
                .expect("list");
            c.retain(|c| c["name"] != "sidecar");
        }),
        ("container proxy missing", |o| {
            let c = o["spec"]["template"]["spec"]["containers"]
                .as_array_mut()
                .expect("list");
            c.retain(|c| c["name"] != "proxy");
        }),
        ("disagree", |o| {
            o["spec"]["template"]["spec"]["containers"][0]["args"][0] =
                json!("--ip-address=240.4.12.35");
        }),
        ("setup: not exactly one --ip-address=", |o| {
            let a = o["spec"]["template"]["spec"]["initContainers"][0]["args"]
                .as_array_mut()
                .expect("args");
            a.push(json!("--ip-address=240.4.12.34"));
        }),
        ("sidecar: not exactly one --ip-address=", |o| {
            o["spec"]["template"]["spec"]["containers"][0]["args"] = json!(["--interface=x"]);
        }),
        ("is not an IP address", |o| {
            o["spec"]["template"]["spec"]["initContainers"][0]["args"][0] =
                json!("--ip-address=kubernetes");
        }),
        ("volume admin-uds missing", |o| {
            let v = o["spec"]["template"]["spec"]["volumes"]
                .as_array_mut()
                .expect("list");
            v.retain(|v| v["name"] != "admin-uds");
        }),
        ("proxy: no port metrics 16910", |o| {
            o["spec"]["template"]["spec"]["containers"][1]["ports"][0]["containerPort"] =
                json!(16911);
        }),
        ("containers debug mounts volume proxy-config", |o| {
            let c = o["spec"]["template"]["spec"]["containers"]
                .as_array_mut()
                .expect("list");
            c.push(json!({"name": "debug", "image": "x", "volumeMounts": [{"name": "proxy-config", "mountPath": "/x"}]}));
        }),
        ("container trellis-node beside", |o| {
            let c = o["spec"]["template"]["spec"]["containers"]
                .as_array_mut()
                .expect("list");
            c.push(json!({"name": "trellis-node", "image": "x"}));
        }),
        ("containers is not a list", |o| {
            o["spec"]["template"]["spec"]["containers"] = json!({"proxy": {}});
        }),
        ("no spec.template.spec", |o| {
            o["spec"]["template"]["spec"] = json!(null);
        }),
    ];
    // The base is mutated: each case fails only through its edit.
    assert_eq!(review(Some(&shoot), &base).result, "mutated");
    for (needle, edit) in cases {
        let mut o = base.clone();
        edit(&mut o);
        let d = review(Some(&shoot), &o);
        assert_eq!(
            (d.result, &d.patch),
            ("unexpected_shape", &None),
            "{needle}: {:?}",
            d.warning
        );
        let w = d.warning.expect("a warning");
        assert!(w.contains(needle), "{needle} not in {w}");
    }
}

/// A container another webhook added stays where it was; Gardener's are replaced in place.
#[test]
fn foreign_containers_keep_their_places() {
    let shoot = enabled_shoot(&rendered());
    let input = object("apiserver-proxy-other-webhooks");
    let out = apply(&input, &review(Some(&shoot), &input));
    let spec = &out["spec"]["template"]["spec"];
    assert_eq!(names(&spec["containers"]), ["log-shipper", ap::CONTAINER]);
    assert_eq!(names(&spec["initContainers"]), ["prepare-shipper"]);
    assert_eq!(names(&spec["volumes"]), [ap::VOLUME, "shipper-state"]);
    assert_eq!(spec["futurePodField"], json!(["kept", {"nested": 1}]));
    assert_eq!(out["spec"]["futureSpecField"], json!({"enabled": true}));
    assert_eq!(
        named(&spec["containers"], "log-shipper").expect("kept")["futureContainerField"],
        "kept"
    );
    // Gardener's shape alone: setup was the only init container, so the list goes.
    let plain = object("apiserver-proxy-ipv4");
    let out = apply(&plain, &review(Some(&shoot), &plain));
    assert!(
        out["spec"]["template"]["spec"]
            .get("initContainers")
            .is_none()
    );
}

/// The `metrics` port's `hostPort` is kept as admitted: another value, or none.
#[test]
fn host_port_is_kept_as_it_was() {
    let shoot = enabled_shoot(&rendered());
    let base = object("apiserver-proxy-ipv4");
    let proxy_port = "/spec/template/spec/containers/1/ports/0";
    assert_eq!(base.pointer(proxy_port).expect("port")["name"], "metrics");
    for host_port in [Some(json!(26910)), None] {
        let mut input = base.clone();
        let port = input
            .pointer_mut(proxy_port)
            .and_then(Value::as_object_mut)
            .expect("port");
        match &host_port {
            Some(p) => port.insert("hostPort".into(), p.clone()),
            None => port.remove("hostPort"),
        };
        let d = review(Some(&shoot), &input);
        assert_eq!(d.result, "mutated");
        let out = apply(&input, &d);
        check_mutated("hostPort", &input, &out, shoot.node.as_ref().expect("node"));
        let ours = named(
            &out["spec"]["template"]["spec"]["containers"],
            ap::CONTAINER,
        )
        .expect("ours");
        assert_eq!(ours["ports"][0].get("hostPort"), host_port.as_ref());
        assert_eq!(review(Some(&shoot), &out).result, "unchanged");
    }
}

// --- the rendered config and the binary ---

fn temp(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "trellis-test-extension-{}-{name}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("node.yaml");
    std::fs::write(&path, text).expect("written");
    path
}

#[test]
fn rendered_node_yaml_passes_trellis_check() {
    let cluster = json("cluster.json");
    let mut v6 = cluster.clone();
    v6["spec"]["shoot"]["spec"]["networking"]["ipFamilies"] = json!(["IPv6"]);
    let mut disabled = cluster.clone();
    disabled["spec"]["shoot"]["metadata"]["annotations"]["shoot.gardener.cloud/disable-istio-tls-termination"] =
        json!("true");
    for (name, c, want) in [
        (
            "default",
            &cluster,
            "destination: \"shoot--dev--alpha--kube-apiserver-socket\"\n  ipFamily: v4\nadmin:\n  address: \"0.0.0.0:16910\"",
        ),
        ("v6", &v6, "ipFamily: v6\nadmin:\n  address: \"[::]:16910\""),
        (
            "no-tls-termination",
            &disabled,
            "\"outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local\"",
        ),
    ] {
        let yaml = node_yaml(&rendered_with(c, None));
        assert!(yaml.contains(want), "{name}: {want} not in\n{yaml}");
        assert!(yaml.contains("address: \"api.alpha.dev.internal.example.com:8443\""));
        assert!(!yaml.contains("\nlisten:"), "{name}: no listen in the file");
        let path = temp(name, &yaml);
        let out = Command::new(BIN)
            .arg("check")
            .arg(&path)
            .output()
            .expect("trellis check runs");
        assert!(
            out.status.success(),
            "{name}: trellis check refused\n{yaml}\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }
}

/// Without `--advertise-address` the rendered file has nothing to listen on: the node says
/// so and exits before binding anything; a flag that disagrees with the file is refused.
#[test]
fn node_needs_the_advertise_address_or_an_agreeing_file() {
    let yaml = node_yaml(&rendered());
    let path = temp("no-flag", &yaml);
    let out = Command::new(BIN)
        .args(["node", "--config"])
        .arg(&path)
        .output()
        .expect("trellis node runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "must fail: {err}");
    assert!(err.contains("give --advertise-address"), "{err}");

    let full = yaml.replace(
        "interface:\n  name: apiserver-proxy\n",
        "listen: [\"127.0.0.1:443\"]\ninterface:\n  name: apiserver-proxy\n  address: 127.0.0.1\n",
    );
    assert_ne!(full, yaml);
    let path = temp("disagree", &full);
    let out = Command::new(BIN)
        .args(["node", "--advertise-address", "127.0.0.2", "--config"])
        .arg(&path)
        .output()
        .expect("trellis node runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "must fail: {err}");
    assert!(
        err.contains("disagrees with --advertise-address 127.0.0.2"),
        "{err}"
    );
    for p in ["no-flag", "disagree"] {
        let _ = std::fs::remove_dir_all(temp(p, "").parent().expect("dir"));
    }
}
