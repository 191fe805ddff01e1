//! The extension's controller against the fake Kubernetes API server: Gardener's extension
//! contract (finalizer first, status Processing → Succeeded or Error, observedGeneration,
//! the operation annotation removed, lastUpdateTime not before gardener.cloud/timestamp),
//! errors retried, delete waiting for the ManagedResource, migrate, restore, what it leaves
//! alone, the heartbeat Lease, and what reaches the webhooks' state. The rendering is a
//! stand-in (the real one is tested with the mutations).

#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod fakekube;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine;
use fakekube::{FakeKube, Fault};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde_json::{Value, json};
use tokio::sync::{oneshot, watch};
use trellis::config::extension::ExtensionConfig;
use trellis::extension::reconcile::{FINALIZER, OPERATION, TIMESTAMP};
use trellis::extension::render::{NodeInput, RenderError, Rendered};
use trellis::extension::role::ExtensionType;
use trellis::extension::state::{NodeShoot, State};
use trellis::extension::watch::{Controller, Timing};
use trellis::extension::{heartbeat, watch as ext_watch};

const NS: &str = "shoot--dev--alpha";
const EXT: &str = "extensions.gardener.cloud/v1alpha1";
const MR: &str = "resources.gardener.cloud/v1alpha1";
const NAME: &str = "extension-trellis-node";

fn config(heartbeat: &str) -> Arc<ExtensionConfig> {
    let yaml = format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: ExtensionConfiguration\n\
         namespace: extension-trellis\nimage: example.org/trellis:test\n\
         webhook:\n  address: 127.0.0.1:9443\nadmin:\n  address: 127.0.0.1:0\n\
         heartbeat:\n  renewInterval: {heartbeat}\n"
    );
    Arc::new(
        trellis::config::parse::<ExtensionConfig>(Path::new("ext.yaml"), yaml.as_bytes()).unwrap(),
    )
}

async fn client(kube: &FakeKube) -> kube::Client {
    let path = std::env::temp_dir().join(format!(
        "trellis-ext-kubeconfig-{}-{}",
        std::process::id(),
        kube.addr().port()
    ));
    kube.write_kubeconfig(&path);
    let client = ext_watch::client(Some(&path)).await.unwrap();
    let _ = std::fs::remove_file(&path);
    client
}

/// The rendering stand-in: a webhook configuration carrying the CA bundle and a ConfigMap;
/// fails while `failures` is above zero.
fn renderer(
    failures: Arc<AtomicUsize>,
) -> impl Fn(&NodeInput<'_>) -> Result<Rendered, RenderError> {
    move |input| {
        if failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(RenderError("providerConfig: unknown field `bogus`".into()));
        }
        let mwc = json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "trellis-node"},
            "webhooks": [{"name": "apiserver-proxy.trellis.gardener.cloud",
                "clientConfig": {"caBundle": input.ca_bundle,
                    "url": format!("https://{}.{}:443/shoot/{}/apiserver-proxy",
                        input.service, input.extension_namespace, input.shoot_namespace)}}],
        });
        let cm = json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "trellis-node", "namespace": "kube-system"},
            "data": {"node.yaml": "kind: NodeConfiguration\n"},
        });
        Ok(Rendered {
            objects: vec![mwc, cm],
            node: NodeShoot {
                image: input.image.to_owned(),
                config_map: "trellis-node".into(),
                config_digest: "digest".into(),
            },
        })
    }
}

/// The fake API server with a shoot namespace and its Cluster, and the controller running.
struct Env {
    kube: FakeKube,
    state: Arc<State>,
    ca: watch::Sender<String>,
    render_failures: Arc<AtomicUsize>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    synced: Option<oneshot::Receiver<()>>,
}

impl Env {
    /// The shoot's `trellis-node` Extension, annotated with `operation`.
    fn put_node_extension(&self, operation: &str) {
        self.kube.put(extension(
            NS,
            "trellis-node",
            "trellis-node",
            json!({OPERATION: operation}),
        ));
    }

    async fn start() -> Env {
        Env::start_with(|_| {}).await
    }

    /// The controller started against a fake API server that `before` filled.
    async fn start_with(before: impl FnOnce(&FakeKube)) -> Env {
        let kube = FakeKube::start().await;
        kube.put(namespace(NS, true));
        kube.put(cluster(NS, "Succeeded"));
        before(&kube);
        let (synced_tx, synced) = oneshot::channel();
        let state = State::new();
        let (ca, ca_rx) = watch::channel("CA1".to_owned());
        let render_failures = Arc::new(AtomicUsize::new(0));
        let controller = Controller::new(client(&kube).await, config("1s"), state.clone())
            .with_renderer(Arc::new(renderer(render_failures.clone())))
            .with_timing(Timing {
                retry_base: Duration::from_millis(50),
                retry_max: Duration::from_millis(400),
                wait: Duration::from_millis(50),
                workers: 4,
            })
            .on_synced(synced_tx);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(controller.run(ca_rx, async move {
            let _ = stopped.await;
        }));
        Env {
            kube,
            state,
            ca,
            render_failures,
            stop: Some(stop),
            task,
            synced: Some(synced),
        }
    }

    /// Waits (at most 10 s) for the controller's synced signal.
    async fn synced(&mut self) {
        let synced = self.synced.take().unwrap();
        tokio::time::timeout(Duration::from_secs(10), synced)
            .await
            .unwrap()
            .unwrap();
    }

    fn ext(&self, ns: &str, name: &str) -> Option<Value> {
        self.kube.get(EXT, "Extension", ns, name)
    }

    /// Writes `f` of the stored object back (as another client would).
    fn edit(&self, api_version: &str, kind: &str, ns: &str, name: &str, f: impl Fn(&mut Value)) {
        let mut o = self.kube.get(api_version, kind, ns, name).unwrap();
        f(&mut o);
        self.kube.put(o);
    }

    fn writes_to(&self, part: &str) -> Vec<(String, Value)> {
        self.kube
            .writes()
            .into_iter()
            .filter(|(line, _)| line.contains(part))
            .collect()
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(5), &mut self.task)
            .await
            .unwrap()
            .unwrap();
    }
}

fn namespace(name: &str, labelled: bool) -> Value {
    let mut labels = json!({"gardener.cloud/role": "shoot"});
    if labelled {
        labels["extensions.gardener.cloud/trellis-node"] = json!("true");
    }
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
}

fn cluster(name: &str, shoot_state: &str) -> Value {
    json!({"apiVersion": EXT, "kind": "Cluster", "metadata": {"name": name},
        "spec": {"shoot": {"apiVersion": "core.gardener.cloud/v1beta1", "kind": "Shoot",
            "metadata": {"name": "alpha", "namespace": "garden-dev"},
            "status": {"lastOperation": {"type": "Reconcile", "state": shoot_state}}}}})
}

fn extension(ns: &str, name: &str, ty: &str, annotations: Value) -> Value {
    json!({"apiVersion": EXT, "kind": "Extension",
        "metadata": {"name": name, "namespace": ns, "annotations": annotations},
        "spec": {"type": ty}})
}

/// Waits (at most 10 s) until `f` holds.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let wait = async {
        while !f() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .is_err()
    {
        panic!("not within 10 s: {what}");
    }
}

fn state_of(ext: &Option<Value>) -> (String, String) {
    let s = |p: &str| {
        ext.as_ref()
            .and_then(|e| e.pointer(p))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    (
        s("/status/lastOperation/type"),
        s("/status/lastOperation/state"),
    )
}

async fn succeeded(env: &Env, ty: &str) -> Value {
    until(&format!("{ty} Succeeded"), || {
        state_of(&env.ext(NS, "trellis-node")) == (ty.to_owned(), "Succeeded".to_owned())
    })
    .await;
    env.ext(NS, "trellis-node").unwrap()
}

fn decoded(secret: &Value, key: &str) -> Value {
    let b64 = secret["data"][key].as_str().unwrap();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

#[tokio::test]
async fn reconcile_writes_the_finalizer_first_then_status_secret_and_managed_resource() {
    let env = Env::start().await;
    // gardenlet's clock is ahead: lastUpdateTime must not be before its timestamp.
    let ahead = Timestamp::now() + SignedDuration::from_secs(120);
    let ahead_text = format!("{ahead:.9}");
    env.kube.put(extension(
        NS,
        "trellis-node",
        "trellis-node",
        json!({OPERATION: "reconcile", TIMESTAMP: ahead_text}),
    ));
    let ext = succeeded(&env, "Create").await;

    let writes = env.kube.writes();
    let (first, body) = &writes[0];
    assert!(
        first.starts_with("PATCH /apis/extensions.gardener.cloud/v1alpha1/namespaces/shoot--dev--alpha/extensions/trellis-node?"),
        "{writes:#?}"
    );
    assert_eq!(body["metadata"]["finalizers"], json!([FINALIZER]));
    assert_eq!(body["metadata"]["annotations"][OPERATION], Value::Null);
    assert!(
        body["metadata"]["resourceVersion"].is_string(),
        "a precondition"
    );
    let pos = |part: &str, state: Option<&str>| {
        writes
            .iter()
            .position(|(l, b)| {
                l.contains(part) && state.is_none_or(|s| b["status"]["lastOperation"]["state"] == s)
            })
            .unwrap_or_else(|| panic!("no write to {part} {state:?}: {writes:#?}"))
    };
    let processing = pos("/status", Some("Processing"));
    let secret_at = pos("/secrets/extension-trellis-node", None);
    let mr_at = pos("/managedresources/extension-trellis-node", None);
    let done = pos("/status", Some("Succeeded"));
    assert!(0 < processing && processing < secret_at && secret_at < mr_at && mr_at < done);

    assert_eq!(ext["metadata"]["finalizers"], json!([FINALIZER]));
    assert!(ext["metadata"]["annotations"].get(OPERATION).is_none());
    assert_eq!(ext["metadata"]["annotations"][TIMESTAMP], json!(ahead_text));
    assert_eq!(
        ext["status"]["observedGeneration"],
        ext["metadata"]["generation"]
    );
    assert!(ext["status"].get("lastError").is_none());
    let expected = Timestamp::from_second(ahead.as_second())
        .unwrap()
        .to_string();
    assert_eq!(
        ext["status"]["lastOperation"]["lastUpdateTime"],
        json!(expected)
    );
    assert_eq!(ext["status"]["lastOperation"]["progress"], 100);

    let secret = env.kube.get("v1", "Secret", NS, NAME).unwrap();
    assert_eq!(
        secret["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "trellis-extension"
    );
    let keys: BTreeSet<&str> = secret["data"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        BTreeSet::from([
            "configmap__kube-system__trellis-node.yaml",
            "mutatingwebhookconfiguration__trellis-node.yaml"
        ])
    );
    let mwc = decoded(&secret, "mutatingwebhookconfiguration__trellis-node.yaml");
    assert_eq!(mwc["webhooks"][0]["clientConfig"]["caBundle"], "CA1");
    let mr = env.kube.get(MR, "ManagedResource", NS, NAME).unwrap();
    assert_eq!(mr["spec"]["secretRefs"], json!([{"name": NAME}]));
    assert_eq!(mr["spec"]["keepObjects"], false);
    assert!(mr["spec"].get("class").is_none(), "no class: for the shoot");
    assert_eq!(
        mr["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "trellis-extension"
    );

    let shoot = env.state.shoot(NS).unwrap();
    assert!(shoot.enabled(ExtensionType::Node));
    assert_eq!(
        shoot.node.as_ref().unwrap().image,
        "example.org/trellis:test"
    );

    // Without an annotation, an update (a spec change, a new generation) is not acted on.
    let n = env.kube.writes().len();
    env.edit(EXT, "Extension", NS, "trellis-node", |e| {
        e["spec"]["providerConfig"] = json!({"a": 1});
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        env.kube.writes().len(),
        n,
        "no write for a new generation alone"
    );
    // With one, it is, and the status follows the generation.
    env.edit(EXT, "Extension", NS, "trellis-node", |e| {
        e["metadata"]["annotations"][OPERATION] = json!("reconcile");
    });
    until("observedGeneration 2", || {
        let e = env.ext(NS, "trellis-node").unwrap();
        e["status"]["observedGeneration"] == 2
            && e["metadata"]["annotations"].get(OPERATION).is_none()
            && e["status"]["lastOperation"]["type"] == "Reconcile"
    })
    .await;
    env.stop().await;
}

#[tokio::test]
async fn errors_are_written_to_the_status_and_retried_until_success() {
    let env = Env::start().await;
    env.render_failures.store(2, Ordering::SeqCst);
    env.put_node_extension("reconcile");
    let ext = succeeded(&env, "Create").await;
    assert!(
        ext["status"].get("lastError").is_none(),
        "cleared on success"
    );
    let errors: Vec<Value> = env
        .writes_to("/extensions/trellis-node/status")
        .into_iter()
        .map(|(_, b)| b["status"].clone())
        .filter(|s| s["lastOperation"]["state"] == "Error")
        .collect();
    assert_eq!(errors.len(), 2, "two failed renders, two Error statuses");
    assert!(
        errors[0]["lastError"]["description"]
            .as_str()
            .unwrap()
            .contains("unknown field `bogus`"),
        "{errors:#?}"
    );
    assert_eq!(
        errors[0]["lastError"]["codes"],
        json!(["ERR_CONFIGURATION_PROBLEM"])
    );
    assert!(errors[0]["lastError"]["lastUpdateTime"].is_string());
    assert_eq!(env.render_failures.load(Ordering::SeqCst), 0);

    // A failed write to the API server: Error, then retried.
    env.kube.fail_next_where(1, Fault::Internal, |l| {
        l.starts_with("PATCH") && l.contains("/managedresources/")
    });
    env.edit(EXT, "Extension", NS, "trellis-node", |e| {
        e["metadata"]["annotations"][OPERATION] = json!("reconcile");
    });
    until("an Error naming the ManagedResource", || {
        env.writes_to("/extensions/trellis-node/status")
            .iter()
            .any(|(_, b)| {
                b["status"]["lastError"]["description"]
                    .as_str()
                    .is_some_and(|d| d.contains("ManagedResource"))
            })
    })
    .await;
    succeeded(&env, "Reconcile").await;
    env.stop().await;
}

/// Reconciled, with gardener-resource-manager's finalizer on the ManagedResource.
async fn reconciled_with_resource_manager(env: &Env) {
    env.put_node_extension("reconcile");
    succeeded(env, "Create").await;
    env.edit(MR, "ManagedResource", NS, NAME, |mr| {
        mr["metadata"]["finalizers"] =
            json!(["resources.gardener.cloud/gardener-resource-manager"]);
    });
}

fn resource_manager_done(env: &Env) {
    env.edit(MR, "ManagedResource", NS, NAME, |mr| {
        mr["metadata"]["finalizers"] = json!([]);
    });
}

#[tokio::test]
async fn delete_waits_for_the_managed_resource_then_removes_the_finalizer() {
    let env = Env::start().await;
    reconciled_with_resource_manager(&env).await;
    env.kube.delete(EXT, "Extension", NS, "trellis-node");
    until("the ManagedResource deleting", || {
        env.kube
            .get(MR, "ManagedResource", NS, NAME)
            .is_some_and(|mr| mr["metadata"]["deletionTimestamp"].is_string())
    })
    .await;
    assert!(env.kube.get("v1", "Secret", NS, NAME).is_none());
    assert!(
        !env.state
            .shoot(NS)
            .unwrap()
            .configured
            .contains(&ExtensionType::Node),
        "the webhooks stop first"
    );
    // Several polls later, the Extension is still there, its finalizer kept.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let ext = env.ext(NS, "trellis-node").unwrap();
    assert_eq!(ext["metadata"]["finalizers"], json!([FINALIZER]));
    assert_eq!(
        state_of(&Some(ext)),
        ("Delete".to_owned(), "Processing".to_owned())
    );
    resource_manager_done(&env);
    until("the Extension gone", || {
        env.ext(NS, "trellis-node").is_none()
    })
    .await;
    let last = env.writes_to("/extensions/trellis-node/status");
    let (_, body) = last.last().unwrap();
    assert_eq!(body["status"]["lastOperation"]["type"], "Delete");
    assert_eq!(body["status"]["lastOperation"]["state"], "Succeeded");
    env.stop().await;
}

#[tokio::test]
async fn migrate_keeps_the_shoot_objects_and_drops_the_finalizers_then_restore() {
    let env = Env::start().await;
    reconciled_with_resource_manager(&env).await;
    env.edit(EXT, "Extension", NS, "trellis-node", |e| {
        e["metadata"]["annotations"][OPERATION] = json!("migrate");
    });
    until("the ManagedResource deleting, objects kept", || {
        env.kube
            .get(MR, "ManagedResource", NS, NAME)
            .is_some_and(|mr| {
                mr["metadata"]["deletionTimestamp"].is_string() && mr["spec"]["keepObjects"] == true
            })
    })
    .await;
    let keep = env.writes_to("/managedresources/extension-trellis-node");
    let keep_at = keep
        .iter()
        .position(|(l, b)| l.starts_with("PATCH") && b["spec"]["keepObjects"] == true)
        .unwrap();
    let delete_at = keep
        .iter()
        .position(|(l, _)| l.starts_with("DELETE"))
        .unwrap();
    assert!(keep_at < delete_at, "keepObjects before the delete");
    assert!(env.ext(NS, "trellis-node").unwrap()["metadata"]["finalizers"] == json!([FINALIZER]));
    resource_manager_done(&env);
    let ext = succeeded(&env, "Migrate").await;
    until("finalizers and annotation gone", || {
        let e = env.ext(NS, "trellis-node").unwrap();
        e["metadata"].get("finalizers").is_none()
            && e["metadata"]["annotations"].get(OPERATION).is_none()
    })
    .await;
    drop(ext);
    assert!(env.state.shoot(NS).is_none_or(|s| s.node.is_none()));

    // Migrated: a reconcile is skipped (the annotation removed, nothing else written).
    env.edit(EXT, "Extension", NS, "trellis-node", |e| {
        e["metadata"]["annotations"][OPERATION] = json!("reconcile");
    });
    until("the reconcile annotation removed", || {
        env.ext(NS, "trellis-node").unwrap()["metadata"]["annotations"]
            .get(OPERATION)
            .is_none()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let e = env.ext(NS, "trellis-node").unwrap();
    assert!(e["metadata"].get("finalizers").is_none());
    assert!(env.kube.get(MR, "ManagedResource", NS, NAME).is_none());

    // Restore: reconciled again (finalizer, objects, state), the annotation removed.
    env.edit(EXT, "Extension", NS, "trellis-node", |e| {
        e["metadata"]["annotations"][OPERATION] = json!("restore");
    });
    let ext = succeeded(&env, "Restore").await;
    until("the restore annotation removed", || {
        env.ext(NS, "trellis-node").unwrap()["metadata"]["annotations"]
            .get(OPERATION)
            .is_none()
    })
    .await;
    assert_eq!(ext["metadata"]["finalizers"], json!([FINALIZER]));
    assert!(env.kube.get(MR, "ManagedResource", NS, NAME).is_some());
    assert!(env.state.shoot(NS).unwrap().enabled(ExtensionType::Node));
    env.stop().await;
}

#[tokio::test]
async fn foreign_types_other_classes_and_failed_shoots_are_left_alone() {
    let env = Env::start().await;
    let failed = "shoot--dev--failed";
    env.kube.put(namespace(failed, true));
    env.kube.put(cluster(failed, "Failed"));
    let ann = json!({OPERATION: "reconcile"});
    env.kube
        .put(extension(NS, "dns", "shoot-dns-service", ann.clone()));
    let mut seed = extension(NS, "seed-class", "trellis-node", ann.clone());
    seed["spec"]["class"] = json!("seed");
    env.kube.put(seed);
    env.kube.put(extension(
        failed,
        "trellis-node",
        "trellis-node",
        ann.clone(),
    ));
    // The control: served, so the others had their turn.
    env.kube
        .put(extension(NS, "trellis-node", "trellis-node", ann.clone()));
    succeeded(&env, "Create").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for part in [
        "/extensions/dns",
        "/extensions/seed-class",
        "/namespaces/shoot--dev--failed/",
    ] {
        let writes = env.writes_to(part);
        assert!(writes.is_empty(), "{part}: {writes:#?}");
    }
    let failed_ext = env.ext(failed, "trellis-node").unwrap();
    assert_eq!(
        failed_ext["metadata"]["annotations"][OPERATION],
        "reconcile"
    );
    assert!(env.state.shoot(failed).unwrap().configured.is_empty());
    env.stop().await;
}

#[tokio::test]
async fn a_new_ca_bundle_reconciles_every_extension_again() {
    let env = Env::start().await;
    env.put_node_extension("reconcile");
    succeeded(&env, "Create").await;
    env.ca.send_replace("CA2".to_owned());
    until("the webhook configuration carrying CA2", || {
        env.kube
            .get("v1", "Secret", NS, NAME)
            .is_some_and(|s| {
                decoded(&s, "mutatingwebhookconfiguration__trellis-node.yaml")["webhooks"][0]
                    ["clientConfig"]["caBundle"]
                    == "CA2"
            })
    })
    .await;
    env.stop().await;
}

#[tokio::test]
async fn namespace_labels_and_apiserver_pods_reach_the_state() {
    let env = Env::start().await;
    until("the namespace label", || {
        env.state
            .shoot(NS)
            .is_some_and(|s| s.labelled.contains(&ExtensionType::Node))
    })
    .await;
    env.kube.put(namespace(NS, false));
    until("the label gone", || env.state.shoot(NS).is_none()).await;

    let pod = |name: &str, role: &str, ip: &str| {
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"app": "kubernetes", "role": role}},
            "status": {"podIP": ip, "podIPs": [{"ip": ip}]}})
    };
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    env.kube
        .put(pod("kube-apiserver-a", "apiserver", "10.1.0.5"));
    env.kube.put(pod("other", "controller-manager", "10.1.0.6"));
    until("the apiserver pod a caller", || {
        env.state.caller_allowed(NS, ip("10.1.0.5"))
    })
    .await;
    assert!(!env.state.caller_allowed(NS, ip("10.1.0.6")));
    assert!(!env.state.caller_allowed("shoot--other", ip("10.1.0.5")));
    env.kube.delete("v1", "Pod", NS, "kube-apiserver-a");
    until("the deleted pod no caller", || {
        !env.state.caller_allowed(NS, ip("10.1.0.5"))
    })
    .await;
    env.stop().await;
}

#[tokio::test]
async fn heartbeat_lease_is_created_and_renewed() {
    let kube = FakeKube::start().await;
    let config = config("200ms");
    let client = client(&kube).await;
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(heartbeat::run(
        client,
        config.namespace.clone(),
        "trellis".into(),
        config.heartbeat.interval(),
        async move {
            let _ = stopped.await;
        },
    ));
    let lease = || {
        kube.get(
            "coordination.k8s.io/v1",
            "Lease",
            "extension-trellis",
            heartbeat::LEASE,
        )
    };
    until("the Lease created", || lease().is_some()).await;
    let first = lease().unwrap();
    assert_eq!(first["spec"]["holderIdentity"], "trellis");
    assert_eq!(first["spec"]["leaseDurationSeconds"], 1);
    let t1: Timestamp = first["spec"]["renewTime"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    until("the Lease renewed", || {
        lease()
            .and_then(|l| l["spec"]["renewTime"].as_str()?.parse::<Timestamp>().ok())
            .is_some_and(|t2| t2 > t1)
    })
    .await;
    let posts = kube
        .writes()
        .iter()
        .filter(|(l, _)| l.starts_with("POST"))
        .count();
    assert_eq!(posts, 1, "created once, then patched");
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
}

/// An Extension reconciled by an earlier process: Succeeded, our finalizer, its Secret and
/// ManagedResource.
fn reconciled_before(kube: &FakeKube) {
    let mut ext = extension(NS, "trellis-node", "trellis-node", json!({}));
    ext["metadata"]["finalizers"] = json!([FINALIZER]);
    ext["status"] = json!({"lastOperation": {"type": "Create", "state": "Succeeded",
        "progress": 100, "description": "done", "lastUpdateTime": "2025-01-01T00:00:00Z"}});
    kube.put(ext);
    kube.put(json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": NAME, "namespace": NS}, "type": "Opaque", "data": {}}));
    kube.put(json!({"apiVersion": MR, "kind": "ManagedResource",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {"secretRefs": [{"name": NAME}], "keepObjects": false}}));
}

#[tokio::test]
async fn a_restart_rebuilds_the_state_of_succeeded_extensions_without_a_write() {
    let mut env = Env::start_with(reconciled_before).await;
    let writes = env.kube.write_count();
    env.synced().await;
    let shoot = env.state.shoot(NS).unwrap();
    assert!(shoot.enabled(ExtensionType::Node), "{shoot:?}");
    assert_eq!(
        shoot.node.as_ref().unwrap().image,
        "example.org/trellis:test"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        env.kube.write_count(),
        writes,
        "{:#?}",
        env.kube.writes_from(writes)
    );
    env.stop().await;
}

#[tokio::test]
async fn synced_comes_after_the_watches_listed() {
    let pod = |name: &str, ip: &str, phase: &str| {
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"app": "kubernetes", "role": "apiserver"}},
            "status": {"phase": phase, "podIP": ip, "podIPs": [{"ip": ip}]}})
    };
    let mut env = Env::start_with(|kube| {
        reconciled_before(kube);
        kube.put(pod("kube-apiserver-a", "10.1.0.5", "Running"));
        kube.put(pod("kube-apiserver-evicted", "10.1.0.9", "Failed"));
    })
    .await;
    env.synced().await;
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    assert!(env.state.caller_allowed(NS, ip("10.1.0.5")));
    assert!(
        !env.state.caller_allowed(NS, ip("10.1.0.9")),
        "an ended pod's address is no caller"
    );
    let shoot = env.state.shoot(NS).unwrap();
    assert!(shoot.labelled.contains(&ExtensionType::Node));
    assert!(shoot.enabled(ExtensionType::Node));
    env.stop().await;
}

#[tokio::test]
async fn a_failed_first_patch_writes_no_status_before_the_finalizer() {
    let env = Env::start().await;
    env.kube.fail_next_where(1, Fault::Internal, |l| {
        l.starts_with("PATCH") && l.contains("/extensions/trellis-node?")
    });
    env.put_node_extension("reconcile");
    succeeded(&env, "Create").await;
    let writes = env.writes_to("/extensions/trellis-node");
    let first_status = writes
        .iter()
        .position(|(l, _)| l.contains("/status"))
        .unwrap();
    let finalizer = writes
        .iter()
        .rposition(|(l, b)| {
            !l.contains("/status") && b["metadata"]["finalizers"] == json!([FINALIZER])
        })
        .unwrap();
    assert!(finalizer < first_status, "{writes:#?}");
    assert!(
        writes
            .iter()
            .all(|(_, b)| b["status"]["lastOperation"]["state"] != "Error"),
        "{writes:#?}"
    );
    env.stop().await;
}

#[tokio::test]
async fn a_restore_is_not_followed_by_a_reconcile_of_its_own_writes() {
    let env = Env::start().await;
    env.put_node_extension("restore");
    succeeded(&env, "Restore").await;
    until("the restore annotation removed", || {
        env.ext(NS, "trellis-node").unwrap()["metadata"]["annotations"]
            .get(OPERATION)
            .is_none()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let statuses = env.writes_to("/extensions/trellis-node/status");
    assert!(
        statuses
            .iter()
            .all(|(_, b)| b["status"]["lastOperation"]["type"] == "Restore"),
        "{statuses:#?}"
    );
    assert_eq!(statuses.len(), 2, "Processing, Succeeded: {statuses:#?}");
    env.stop().await;
}

#[tokio::test]
async fn an_extension_gone_without_its_finalizer_clears_the_state() {
    let env = Env::start().await;
    env.put_node_extension("reconcile");
    succeeded(&env, "Create").await;
    assert!(env.state.shoot(NS).unwrap().enabled(ExtensionType::Node));
    // The finalizer removed by force, then deleted: gone at once, never reconciled.
    env.edit(EXT, "Extension", NS, "trellis-node", |e| {
        e["metadata"]["finalizers"] = json!([]);
    });
    env.kube.delete(EXT, "Extension", NS, "trellis-node");
    assert!(env.ext(NS, "trellis-node").is_none());
    until("the webhooks stop", || {
        env.state
            .shoot(NS)
            .is_some_and(|s| !s.enabled(ExtensionType::Node) && s.node.is_none())
    })
    .await;
    env.stop().await;
}
