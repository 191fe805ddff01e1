//! The extension controller against the fake API server, in one process on loopback:
//! the time from setting `gardener.cloud/operation: reconcile` on an Extension to its status
//! `Succeeded` (p50/p99 over N), and the memory of reconciling 500 shoots' Extensions and
//! Clusters (VmRSS/VmHWM of the process, the fake API server's growth included: it holds
//! every object written). The rendering is a stand-in of the size of the real objects.
//!
//! `cargo bench --bench extension_controller [-- N]`

// A bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

#[path = "../tests/fakekube/mod.rs"]
mod fakekube;

use std::sync::Arc;
use std::time::{Duration, Instant};

use fakekube::FakeKube;
use serde_json::{Value, json};
use tokio::sync::{oneshot, watch};
use trellis::config::extension::ExtensionConfig;
use trellis::extension::reconcile::OPERATION;
use trellis::extension::render::{NodeInput, RenderError, Rendered};
use trellis::extension::state::{NodeShoot, State};
use trellis::extension::watch::{Controller, Timing};

const EXT: &str = "extensions.gardener.cloud/v1alpha1";

fn render(input: &NodeInput<'_>) -> Result<Rendered, RenderError> {
    let mwc = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "trellis-node"},
        "webhooks": [{"name": "apiserver-proxy.trellis.gardener.cloud", "failurePolicy": "Ignore",
            "sideEffects": "None", "admissionReviewVersions": ["v1"],
            "clientConfig": {"caBundle": input.ca_bundle,
                "url": format!("https://{}.{}:443/shoot/{}/apiserver-proxy",
                    input.service, input.extension_namespace, input.shoot_namespace)},
            "rules": [{"apiGroups": ["apps"], "apiVersions": ["v1"], "resources": ["daemonsets"],
                "operations": ["CREATE", "UPDATE"]}]}],
    });
    let cm = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "trellis-node", "namespace": "kube-system"},
        "data": {"node.yaml": "x".repeat(600)}});
    Ok(Rendered {
        objects: vec![mwc, cm],
        node: NodeShoot {
            image: input.image.to_owned(),
            config_map: "trellis-node".into(),
            config_digest: "0123456789abcdef".into(),
        },
    })
}

fn config() -> Arc<ExtensionConfig> {
    let yaml = "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: ExtensionConfiguration\n\
         namespace: extension-trellis\nimage: example.org/trellis:bench\n\
         webhook:\n  address: 127.0.0.1:9443\nadmin:\n  address: 127.0.0.1:0\n";
    Arc::new(
        trellis::config::parse::<ExtensionConfig>(std::path::Path::new("b.yaml"), yaml.as_bytes())
            .unwrap(),
    )
}

fn shoot(kube: &FakeKube, ns: &str) {
    kube.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns,
        "labels": {"gardener.cloud/role": "shoot", "extensions.gardener.cloud/trellis-node": "true"}}}));
    // A Cluster of roughly a real one's size (the Shoot, CloudProfile and Seed inline).
    kube.put(
        json!({"apiVersion": EXT, "kind": "Cluster", "metadata": {"name": ns},
        "spec": {"shoot": {"metadata": {"name": ns}, "spec": {"pad": "s".repeat(6000)},
            "status": {"lastOperation": {"type": "Reconcile", "state": "Succeeded"}}},
            "cloudProfile": {"pad": "c".repeat(4000)}, "seed": {"pad": "d".repeat(2000)}}}),
    );
    kube.put(json!({"apiVersion": EXT, "kind": "Extension",
        "metadata": {"name": "trellis-node", "namespace": ns, "annotations": {OPERATION: "reconcile"}},
        "spec": {"type": "trellis-node"}}));
}

fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

fn succeeded(kube: &FakeKube, ns: &str) -> bool {
    kube.get(EXT, "Extension", ns, "trellis-node")
        .is_some_and(|e| e["status"]["lastOperation"]["state"] == "Succeeded")
}

async fn start(kube: &FakeKube) -> (oneshot::Sender<()>, watch::Sender<String>) {
    let path = std::env::temp_dir().join(format!("trellis-ext-bench-{}", std::process::id()));
    kube.write_kubeconfig(&path);
    let client = trellis::extension::watch::client(Some(&path))
        .await
        .unwrap();
    let _ = std::fs::remove_file(&path);
    let (ca, ca_rx) = watch::channel("-----BEGIN CERTIFICATE-----\n".repeat(20));
    let (stop, stopped) = oneshot::channel::<()>();
    let controller = Controller::new(client, config(), State::new())
        .with_renderer(Arc::new(render))
        .with_timing(Timing::default());
    tokio::spawn(controller.run(ca_rx, async move {
        let _ = stopped.await;
    }));
    (stop, ca)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn latency(n: usize) {
    let kube = FakeKube::start().await;
    let ns = "shoot--bench--latency";
    shoot(&kube, ns);
    let (stop, _ca) = start(&kube).await;
    while !succeeded(&kube, ns) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let done = |kube: &FakeKube| {
        kube.writes()
            .iter()
            .filter(|(l, b)| {
                l.contains("/status") && b["status"]["lastOperation"]["state"] == "Succeeded"
            })
            .count()
    };
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let before = done(&kube);
        let mut e: Value = kube.get(EXT, "Extension", ns, "trellis-node").unwrap();
        e["metadata"]["annotations"][OPERATION] = json!("reconcile");
        let t0 = Instant::now();
        kube.put(e);
        while done(&kube) == before {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        times.push(t0.elapsed());
    }
    times.sort();
    println!(
        "annotation -> Succeeded over {n}: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        percentile(&times, 0.5).as_secs_f64() * 1e3,
        percentile(&times, 0.99).as_secs_f64() * 1e3,
        times.last().unwrap().as_secs_f64() * 1e3
    );
    let _ = stop.send(());
}

async fn memory(shoots: usize) {
    let kube = FakeKube::start().await;
    for i in 0..shoots {
        shoot(&kube, &format!("shoot--bench--s{i:04}"));
    }
    let rss_before = status_kib("VmRSS:");
    let hwm_before = status_kib("VmHWM:");
    let t0 = Instant::now();
    let (stop, _ca) = start(&kube).await;
    let all =
        |kube: &FakeKube| (0..shoots).all(|i| succeeded(kube, &format!("shoot--bench--s{i:04}")));
    while !all(&kube) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = t0.elapsed();
    let rss_after = status_kib("VmRSS:");
    let hwm_after = status_kib("VmHWM:");
    println!(
        "{shoots} shoots reconciled from start in {:.2} s; VmRSS {rss_before} -> {rss_after} kB \
         (+{} kB), VmHWM {hwm_before} -> {hwm_after} kB (+{} kB), fake API server's new objects \
         and event log included",
        took.as_secs_f64(),
        rss_after.saturating_sub(rss_before),
        hwm_after.saturating_sub(hwm_before)
    );
    let _ = stop.send(());
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(200);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // Memory first: the latency run's allocations would raise the high-water mark.
        memory(500).await;
        latency(n).await;
    });
}
