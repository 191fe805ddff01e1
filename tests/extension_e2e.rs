//! `trellis extension` as a process, against the fake Kubernetes API server: it writes its
//! CA and server certificate into Secrets and turns ready, reconciles a shoot's Extension
//! into the ManagedResource whose webhook configuration carries that CA, and its webhook,
//! reached over TLS by curl exactly as that configuration says (URL, CA bundle), turns
//! Gardener's apiserver-proxy DaemonSet into the golden one; its metrics count it; SIGTERM
//! stops it.

#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;
mod fakekube;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use base64::Engine;
use common::{BIN, TestDir, free_ports, http_get, metric_in, wait_for};
use fakekube::FakeKube;
use serde_json::{Value, json};

const NS: &str = "shoot--dev--alpha";
const EXT_NS: &str = "extension-trellis-x1";
const EXT: &str = "extensions.gardener.cloud/v1alpha1";
const IMAGE: &str = "ghcr.io/gardener/trellis:v0.9.0";

/// A JSON file of `tests/data/extension/` (the golden AdmissionReviews).
fn golden(name: &str) -> Value {
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/extension")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap()
}

fn b64(s: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

/// Runs blocking `f` off the runtime (the fake API server runs on it).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extension_process_reconciles_and_its_webhook_mutates_apiserver_proxy() {
    let kube = FakeKube::start().await;
    let dir = TestDir::new("extension-e2e");
    kube.write_kubeconfig(&dir.path("kubeconfig"));
    let ports = free_ports(2);
    let (webhook, admin): (SocketAddr, SocketAddr) = (
        format!("127.0.0.1:{}", ports[0]).parse().unwrap(),
        format!("127.0.0.1:{}", ports[1]).parse().unwrap(),
    );
    std::fs::write(
        dir.path("extension.yaml"),
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: ExtensionConfiguration\n\
             kubeconfig: kubeconfig\nnamespace: {EXT_NS}\nimage: {IMAGE}\n\
             webhook: {{address: \"{webhook}\"}}\nadmin: {{address: \"{admin}\"}}\n\
             heartbeat: {{renewInterval: 1s}}\n"
        ),
    )
    .unwrap();

    // The seed: the shoot's namespace (labelled by gardenlet), its Cluster, its
    // kube-apiserver pod (the caller: this test, from 127.0.0.1) and its Extension.
    kube.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS,
        "labels": {"gardener.cloud/role": "shoot", "extensions.gardener.cloud/trellis-node": "true"}}}));
    let mut cluster = golden("cluster.json");
    cluster["metadata"]["name"] = json!(NS);
    kube.put(cluster);
    kube.put(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "kube-apiserver-0", "namespace": NS,
            "labels": {"app": "kubernetes", "role": "apiserver"}},
        "status": {"podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}}));
    kube.put(json!({"apiVersion": EXT, "kind": "Extension",
        "metadata": {"name": "trellis-node", "namespace": NS,
            "annotations": {"gardener.cloud/operation": "reconcile"}},
        "spec": {"type": "trellis-node"}}));

    let log = std::fs::File::create(dir.path("extension.log")).unwrap();
    let mut child = Command::new(BIN)
        .args(["--log-format", "json", "extension", "--config"])
        .arg(dir.path("extension.yaml"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let logs = {
        let file = dir.path("extension.log");
        move || std::fs::read_to_string(&file).unwrap_or_default()
    };

    // Ready once its key pair is served; the certificates are in its namespace's Secrets.
    let ready = blocking(move || {
        wait_for(Duration::from_secs(30), || {
            http_get(admin, "/ready").and_then(|(s, _)| (s == 200).then_some(()))
        })
    })
    .await;
    assert!(ready.is_some(), "never ready:\n{}", logs());
    let ca = kube.get("v1", "Secret", EXT_NS, "trellis-extension-ca");
    let bundle = String::from_utf8(b64(ca.as_ref().unwrap()["data"]["bundle.crt"]
        .as_str()
        .unwrap()))
    .unwrap();
    assert!(bundle.contains("BEGIN CERTIFICATE"), "{bundle}");
    assert!(!bundle.contains("PRIVATE KEY"), "the bundle carries no key");

    // The Extension reconciled: the ManagedResource's Secret holds the webhook
    // configuration with that bundle, and the ConfigMap.
    let reconciled = async {
        loop {
            let ext = kube.get(EXT, "Extension", NS, "trellis-node");
            if let Some(ext) = ext
                && ext["status"]["lastOperation"]["state"] == "Succeeded"
                && let Some(secret) = kube.get("v1", "Secret", NS, "extension-trellis-node")
            {
                return secret;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let secret = tokio::time::timeout(Duration::from_secs(30), reconciled)
        .await
        .unwrap_or_else(|_| panic!("not reconciled:\n{}", logs()));
    let objects: Vec<Value> = secret["data"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| serde_json::from_slice(&b64(v.as_str().unwrap())).unwrap())
        .collect();
    let config = objects
        .iter()
        .find(|o| o["kind"] == "MutatingWebhookConfiguration")
        .unwrap();
    let hook = &config["webhooks"][0];
    assert_eq!(
        String::from_utf8(b64(hook["clientConfig"]["caBundle"].as_str().unwrap())).unwrap(),
        bundle,
        "the webhook configuration carries the served CA bundle"
    );
    let url = hook["clientConfig"]["url"].as_str().unwrap().to_owned();
    let host = format!("gardener-extension-trellis.{EXT_NS}");
    assert_eq!(
        url,
        format!("https://{host}:443/shoot/{NS}/apiserver-proxy")
    );
    let config_map = objects.iter().find(|o| o["kind"] == "ConfigMap").unwrap();

    // The shoot's API server calls the URL (resolved here to the webhook's address) and
    // verifies the server with the bundle, as its webhook configuration says.
    std::fs::write(dir.path("bundle.pem"), &bundle).unwrap();
    let review = golden("apiserver-proxy-ipv4.review.json");
    std::fs::write(dir.path("review.json"), review.to_string()).unwrap();
    let url_here = url.replace(":443", &format!(":{}", webhook.port()));
    let out = Command::new("curl")
        .args(["-sS", "--fail-with-body", "--max-time", "10", "--cacert"])
        .arg(dir.path("bundle.pem"))
        .args(["--resolve", &format!("{host}:{}:127.0.0.1", webhook.port())])
        .args(["-H", "Content-Type: application/json", "--data-binary"])
        .arg(format!("@{}", dir.path("review.json").display()))
        .arg(&url_here)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "curl: {}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
    let response = &answer["response"];
    assert_eq!(response["uid"], review["request"]["uid"]);
    assert_eq!(response["allowed"], true);
    assert_eq!(response["patchType"], "JSONPatch");
    let patch: json_patch::Patch =
        serde_json::from_slice(&b64(response["patch"].as_str().unwrap())).unwrap();
    let mut object = review["request"]["object"].clone();
    json_patch::patch(&mut object, &patch).unwrap();
    assert_eq!(object, golden("expected/apiserver-proxy-ipv4.json"));
    // The DaemonSet mounts the ConfigMap the ManagedResource delivers.
    let volumes = object["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap();
    assert!(
        volumes
            .iter()
            .any(|v| v["configMap"]["name"] == config_map["metadata"]["name"]),
        "{volumes:?}"
    );

    // Counted; the heartbeat Lease is there.
    let metrics = blocking(move || http_get(admin, "/metrics").unwrap().1).await;
    assert_eq!(
        metric_in(
            &metrics,
            "trellis_extension_admissions_total{target=\"apiserver-proxy\",result=\"mutated\"}"
        ),
        1.0,
        "{metrics}"
    );
    assert!(
        kube.get(
            "coordination.k8s.io/v1",
            "Lease",
            EXT_NS,
            "gardener-extension-heartbeat"
        )
        .is_some()
    );

    // SIGTERM: it stops, exit 0.
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = blocking(move || {
        let exited = wait_for(Duration::from_secs(20), || child.try_wait().unwrap());
        if exited.is_none() {
            let _ = child.kill();
        }
        exited
    })
    .await;
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}:\n{}",
        logs()
    );
}
