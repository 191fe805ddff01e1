//! The shoot's `kube-system/apiserver-proxy` DaemonSet (Gardener v1.149,
//! `pkg/component/networking/apiserverproxy/apiserver_proxy.go`) made to run `trellis node`:
//! the init container `setup`, the containers `sidecar` and `proxy` and the volumes
//! `proxy-config` and `admin-uds` become one container [`CONTAINER`] and one volume
//! [`VOLUME`] (the ConfigMap with `node.yaml`). Everything else — name, labels, annotations,
//! host network, priority class, tolerations, containers other webhooks added, fields this
//! code does not know — is kept as admitted.
//!
//! The advertise address is read from the admitted object (`--ip-address=` of `setup` and
//! `sidecar`, which must agree), never recomputed. An object already in trellis' shape is
//! brought up to date (image, config digest) the same way, so a review of the webhook's own
//! output changes nothing. Pure: JSON in, JSON out.

use std::net::IpAddr;

use serde_json::{Map, Value, json};

use crate::extension::state::NodeShoot;

/// The DaemonSet's name (and namespace [`NAMESPACE`]).
pub const NAME: &str = "apiserver-proxy";
/// The DaemonSet's namespace.
pub const NAMESPACE: &str = "kube-system";
/// The container that replaces Gardener's three: named after the Extension type, so that
/// `kubectl logs -c trellis-node` says which extension put it there.
pub const CONTAINER: &str = "trellis-node";
/// The volume with the ConfigMap of `node.yaml`.
pub const VOLUME: &str = "trellis-node-config";
/// Where the ConfigMap is mounted.
pub const CONFIG_DIR: &str = "/etc/trellis";
/// The config file inside the container.
pub const CONFIG_PATH: &str = "/etc/trellis/node.yaml";
/// The binary in the trellis image.
pub const BINARY: &str = "/usr/local/bin/trellis";
/// The pod-template annotation carrying the config digest (a changed config rolls the pods).
pub const DIGEST_ANNOTATION: &str = "trellis.gardener.cloud/config-digest";
/// The admin (probes, metrics) port: Gardener's `metrics` port, kept.
pub const ADMIN_PORT: u16 = 16910;
/// The name of the admin port.
pub const METRICS_PORT_NAME: &str = "metrics";

/// Gardener's init container.
const SETUP: &str = "setup";
/// Gardener's sidecar (keeps the address on the link).
const SIDECAR: &str = "sidecar";
/// Gardener's Envoy.
const PROXY: &str = "proxy";
/// Gardener's volumes the replacement drops.
const GARDENER_VOLUMES: [&str; 2] = ["proxy-config", "admin-uds"];
/// The argument that carries the advertise address in Gardener's `setup` and `sidecar`.
const IP_ARG: &str = "--ip-address=";
/// The flag that carries it in [`CONTAINER`]'s command.
const ADVERTISE_FLAG: &str = "--advertise-address";

/// Why an object of the right kind and name is not mutated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unexpected shape: {0}")]
pub struct Unexpected(pub String);

fn unexpected<T>(why: impl Into<String>) -> Result<T, Unexpected> {
    Err(Unexpected(why.into()))
}

/// Whether `object` is the DaemonSet this webhook handles (`apps/v1`, `kube-system`,
/// `apiserver-proxy`).
pub fn handles(object: &Value) -> bool {
    object.get("apiVersion").and_then(Value::as_str) == Some("apps/v1")
        && object.get("kind").and_then(Value::as_str) == Some("DaemonSet")
        && object.pointer("/metadata/name").and_then(Value::as_str) == Some(NAME)
        && object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            == Some(NAMESPACE)
}

/// The object as the webhook writes it, or why it is not mutated. The result is built on a
/// copy; `object` is never partly changed.
pub fn mutate(node: &NodeShoot, object: &Value) -> Result<Value, Unexpected> {
    let mut new = object.clone();
    let Some(pod) = new
        .pointer_mut("/spec/template/spec")
        .and_then(Value::as_object_mut)
    else {
        return unexpected("no spec.template.spec object");
    };
    let containers = names(pod, "containers")?;
    let inits = names(pod, "initContainers")?;
    let gardener = [
        inits.iter().any(|n| n == SETUP),
        containers.iter().any(|n| n == SIDECAR),
        containers.iter().any(|n| n == PROXY),
    ];
    let ours = containers.iter().any(|n| n == CONTAINER);
    match (gardener, ours) {
        ([true, true, true], false) => replace_gardener(node, pod)?,
        ([false, false, false], true) => refresh_ours(node, pod)?,
        (_, true) => {
            return unexpected(format!(
                "container {CONTAINER} beside Gardener's setup, sidecar or proxy"
            ));
        }
        ([setup, sidecar, _], false) => {
            let missing = if !setup {
                "init container setup"
            } else if !sidecar {
                "container sidecar"
            } else {
                "container proxy"
            };
            return unexpected(format!("{missing} missing"));
        }
    }
    set_digest(&mut new, &node.config_digest)?;
    Ok(new)
}

/// The names of the pod spec's `key` list (absent: none).
fn names(pod: &Map<String, Value>, key: &str) -> Result<Vec<String>, Unexpected> {
    let Some(list) = pod.get(key) else {
        return Ok(Vec::new());
    };
    let Some(list) = list.as_array() else {
        return unexpected(format!("{key} is not a list"));
    };
    list.iter()
        .map(|c| match c.get("name").and_then(Value::as_str) {
            Some(n) => Ok(n.to_owned()),
            None => unexpected(format!("an entry of {key} without a name")),
        })
        .collect()
}

/// The entry named `name` of the pod spec's `key` list.
fn find<'a>(pod: &'a Map<String, Value>, key: &str, name: &str) -> Option<&'a Value> {
    pod.get(key)?
        .as_array()?
        .iter()
        .find(|c| c.get("name").and_then(Value::as_str) == Some(name))
}

/// The one `--ip-address=` argument of container `name` (in `list`), as written and parsed.
fn ip_arg(
    pod: &Map<String, Value>,
    list: &str,
    name: &str,
) -> Result<(String, IpAddr), Unexpected> {
    let container = find(pod, list, name).unwrap_or(&Value::Null);
    let mut found = container
        .get("args")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .chain(
            container
                .get("command")
                .and_then(Value::as_array)
                .into_iter()
                .flatten(),
        )
        .filter_map(Value::as_str)
        .filter_map(|a| a.strip_prefix(IP_ARG));
    let (Some(text), None) = (found.next(), found.next()) else {
        return unexpected(format!("{name}: not exactly one {IP_ARG} argument"));
    };
    match text.parse::<IpAddr>() {
        Ok(ip) => Ok((text.to_owned(), ip)),
        Err(_) => unexpected(format!("{name}: {IP_ARG}{text} is not an IP address")),
    }
}

/// The `hostPort` of the port `metrics` 16910 of `container` (`None`: none set).
fn metrics_host_port(container: &Value, name: &str) -> Result<Option<Value>, Unexpected> {
    let port = container
        .get("ports")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|p| {
            p.get("name").and_then(Value::as_str) == Some(METRICS_PORT_NAME)
                && p.get("containerPort").and_then(Value::as_u64) == Some(u64::from(ADMIN_PORT))
        });
    match port {
        None => unexpected(format!("{name}: no port {METRICS_PORT_NAME} {ADMIN_PORT}")),
        Some(p) => Ok(p.get("hostPort").cloned()),
    }
}

/// Gardener's shape becomes trellis': `setup`, `sidecar`, `proxy`, `proxy-config` and
/// `admin-uds` out, [`CONTAINER`] and [`VOLUME`] in where the first of them was.
fn replace_gardener(node: &NodeShoot, pod: &mut Map<String, Value>) -> Result<(), Unexpected> {
    let (text, setup_ip) = ip_arg(pod, "initContainers", SETUP)?;
    let (sidecar_text, sidecar_ip) = ip_arg(pod, "containers", SIDECAR)?;
    if setup_ip != sidecar_ip {
        return unexpected(format!(
            "setup's {IP_ARG}{text} and sidecar's {IP_ARG}{sidecar_text} disagree"
        ));
    }
    let proxy = find(pod, "containers", PROXY).unwrap_or(&Value::Null);
    let host_port = metrics_host_port(proxy, PROXY)?;
    for volume in GARDENER_VOLUMES {
        if find(pod, "volumes", volume).is_none() {
            return unexpected(format!("volume {volume} missing"));
        }
    }
    if find(pod, "volumes", VOLUME).is_some() {
        return unexpected(format!("volume {VOLUME} beside Gardener's"));
    }
    // A container another webhook added is kept, unless it uses a volume that goes.
    for list in ["initContainers", "containers"] {
        for c in pod
            .get(list)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let name = c.get("name").and_then(Value::as_str).unwrap_or_default();
            if [SETUP, SIDECAR, PROXY].contains(&name) {
                continue;
            }
            let mounts = c.get("volumeMounts").and_then(Value::as_array);
            if let Some(v) = mounts.into_iter().flatten().find_map(|m| {
                m.get("name")
                    .and_then(Value::as_str)
                    .filter(|v| GARDENER_VOLUMES.contains(v))
            }) {
                return unexpected(format!("{list} {name} mounts volume {v}"));
            }
        }
    }

    let container = container(node, &text, host_port);
    replace_entries(pod, "containers", &[SIDECAR, PROXY], container);
    replace_entries(pod, "volumes", &GARDENER_VOLUMES, volume(node));
    if let Some(Value::Array(inits)) = pod.get_mut("initContainers") {
        inits.retain(|c| c.get("name").and_then(Value::as_str) != Some(SETUP));
        if inits.is_empty() {
            pod.remove("initContainers");
        }
    }
    Ok(())
}

/// trellis' shape brought up to date: [`CONTAINER`] and [`VOLUME`] rewritten unless what
/// they hold already includes all this code writes (fields the API server defaulted kept).
fn refresh_ours(node: &NodeShoot, pod: &mut Map<String, Value>) -> Result<(), Unexpected> {
    let current = find(pod, "containers", CONTAINER).unwrap_or(&Value::Null);
    let command = current
        .get("command")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let Some(text) = command
        .iter()
        .position(|a| a.as_str() == Some(ADVERTISE_FLAG))
        .and_then(|i| command.get(i + 1))
        .and_then(Value::as_str)
        .filter(|t| t.parse::<IpAddr>().is_ok())
        .map(str::to_owned)
    else {
        return unexpected(format!(
            "{CONTAINER}: no {ADVERTISE_FLAG} IP in its command"
        ));
    };
    let host_port = metrics_host_port(current, CONTAINER)?;
    let want = container(node, &text, host_port);
    if !includes(current, &want) {
        replace_entries(pod, "containers", &[CONTAINER], want);
    }
    let want = volume(node);
    match find(pod, "volumes", VOLUME) {
        Some(v) if includes(v, &want) => {}
        Some(_) => replace_entries(pod, "volumes", &[VOLUME], want),
        None => {
            let volumes = pod
                .entry("volumes")
                .or_insert_with(|| Value::Array(Vec::new()));
            let Some(volumes) = volumes.as_array_mut() else {
                return unexpected("volumes is not a list");
            };
            volumes.push(want);
        }
    }
    Ok(())
}

/// Whether `have` holds everything in `want` (objects: every key of `want`, recursively;
/// anything else: equal). Lists must match entry by entry.
fn includes(have: &Value, want: &Value) -> bool {
    match (have, want) {
        (Value::Object(h), Value::Object(w)) => w
            .iter()
            .all(|(k, wv)| h.get(k).is_some_and(|hv| includes(hv, wv))),
        (Value::Array(h), Value::Array(w)) => {
            h.len() == w.len() && h.iter().zip(w).all(|(hv, wv)| includes(hv, wv))
        }
        _ => have == want,
    }
}

/// Removes the entries of `key` named in `names` and puts `entry` where the first of them was.
fn replace_entries(pod: &mut Map<String, Value>, key: &str, names: &[&str], entry: Value) {
    let list = pod.entry(key).or_insert_with(|| Value::Array(Vec::new()));
    if let Value::Array(list) = list {
        let named = |c: &Value| {
            c.get("name")
                .and_then(Value::as_str)
                .is_some_and(|n| names.contains(&n))
        };
        let at = list.iter().position(named).unwrap_or(list.len());
        list.retain(|c| !named(c));
        list.insert(at.min(list.len()), entry);
    }
}

/// Puts the config digest on the pod template's annotations.
fn set_digest(object: &mut Value, digest: &str) -> Result<(), Unexpected> {
    let Some(template) = object
        .pointer_mut("/spec/template")
        .and_then(Value::as_object_mut)
    else {
        return unexpected("no spec.template object");
    };
    let metadata = template
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    let Some(metadata) = metadata.as_object_mut() else {
        return unexpected("spec.template.metadata is not an object");
    };
    let annotations = metadata
        .entry("annotations")
        .or_insert_with(|| Value::Object(Map::new()));
    let Some(annotations) = annotations.as_object_mut() else {
        return unexpected("spec.template.metadata.annotations is not an object");
    };
    annotations.insert(DIGEST_ANNOTATION.into(), Value::String(digest.into()));
    Ok(())
}

/// The volume with the ConfigMap (`defaultMode` written as the API server defaults it, so
/// that a review of the stored object finds it unchanged).
fn volume(node: &NodeShoot) -> Value {
    json!({
        "name": VOLUME,
        "configMap": {"name": node.config_map, "defaultMode": 420},
    })
}

/// An HTTP probe of the admin port, every field the API server would default written out.
fn probe(path: &str, initial: u32, period: u32, timeout: u32) -> Value {
    json!({
        "httpGet": {"path": path, "port": ADMIN_PORT, "scheme": "HTTP"},
        "initialDelaySeconds": initial,
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "successThreshold": 1,
        "failureThreshold": 3,
    })
}

/// The `trellis node` container for the advertise address `ip` (as the object wrote it).
///
/// Capabilities: `NET_ADMIN` for the address on the dummy link and `NET_BIND_SERVICE` for
/// port 443 (Gardener's Envoy has it too; without it the bind fails on a host whose
/// `ip_unprivileged_port_start` is the default 1024). User 0 because capabilities added to a
/// container reach only root's effective set.
fn container(node: &NodeShoot, ip: &str, host_port: Option<Value>) -> Value {
    let mut port = json!({
        "name": METRICS_PORT_NAME,
        "containerPort": ADMIN_PORT,
        "protocol": "TCP",
    });
    if let (Some(h), Some(p)) = (host_port, port.as_object_mut()) {
        p.insert("hostPort".into(), h);
    }
    json!({
        "name": CONTAINER,
        "image": node.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            BINARY, "--log-format", "json", "node",
            "--config", CONFIG_PATH, ADVERTISE_FLAG, ip,
        ],
        "ports": [port],
        "readinessProbe": probe("/ready", 1, 2, 1),
        "livenessProbe": probe("/live", 5, 10, 3),
        "resources": {
            "requests": {"cpu": "10m", "memory": "16Mi"},
            "limits": {"memory": "128Mi"},
        },
        "securityContext": {
            "runAsUser": 0,
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_BIND_SERVICE"]},
        },
        "volumeMounts": [{"name": VOLUME, "mountPath": CONFIG_DIR, "readOnly": true}],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn includes_is_a_recursive_subset_with_exact_lists() {
        let have = json!({"a": 1, "b": {"c": [1, {"d": 2, "e": 3}]}, "x": true});
        assert!(includes(&have, &json!({"b": {"c": [1, {"d": 2}]}})));
        assert!(!includes(&have, &json!({"b": {"c": [1]}})));
        assert!(!includes(&have, &json!({"a": 2})));
        assert!(!includes(&have, &json!({"y": 1})));
    }

    #[test]
    fn replace_keeps_position_and_others() {
        let mut pod = Map::new();
        pod.insert(
            "containers".into(),
            json!([{"name": "a"}, {"name": "sidecar"}, {"name": "b"}, {"name": "proxy"}]),
        );
        replace_entries(
            &mut pod,
            "containers",
            &[SIDECAR, PROXY],
            json!({"name": "t"}),
        );
        assert_eq!(
            pod["containers"],
            json!([{"name": "a"}, {"name": "t"}, {"name": "b"}])
        );
    }
}
