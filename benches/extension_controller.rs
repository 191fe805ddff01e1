//! `trellis extension` (the process, as deployed) against the fake API server on loopback,
//! rendering the real objects from a real Cluster (`tests/data/extension/cluster.json`):
//! - the memory of serving 500 shoots: the process's VmRSS once all 500 Extensions are
//!   `Succeeded`, and its peak (VmHWM), with the time from start to the last `Succeeded`;
//! - the time from setting `gardener.cloud/operation: reconcile` on one Extension to its
//!   status `Succeeded` (p50/p99 over N), with 500 shoots in the store;
//! - the size of what each shoot's ManagedResource Secret carries.
//!
//! `cargo bench --bench extension_controller [-- N]` (default N = 200)

// A bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

#[path = "../tests/fakekube/mod.rs"]
mod fakekube;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fakekube::FakeKube;
use serde_json::{Value, json};
use trellis::extension::reconcile::OPERATION;

const EXT: &str = "extensions.gardener.cloud/v1alpha1";
const SHOOTS: usize = 500;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn shoot(kube: &FakeKube, cluster: &Value, ns: &str) {
    kube.put(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns,
        "labels": {"gardener.cloud/role": "shoot", "extensions.gardener.cloud/trellis-node": "true"}}}));
    let mut cluster = cluster.clone();
    cluster["metadata"]["name"] = json!(ns);
    kube.put(cluster);
    kube.put(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "kube-apiserver-0", "namespace": ns,
            "labels": {"app": "kubernetes", "role": "apiserver"}},
        "status": {"podIP": "10.1.2.3", "podIPs": [{"ip": "10.1.2.3"}]}}));
    kube.put(json!({"apiVersion": EXT, "kind": "Extension",
        "metadata": {"name": "trellis-node", "namespace": ns, "annotations": {OPERATION: "reconcile"}},
        "spec": {"type": "trellis-node"}}));
}

fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
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

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn spawn(dir: &std::path::Path, kube: &FakeKube) -> Child {
    kube.write_kubeconfig(&dir.join("kubeconfig"));
    std::fs::write(
        dir.join("extension.yaml"),
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: ExtensionConfiguration\n\
             kubeconfig: kubeconfig\nnamespace: extension-trellis-bench\n\
             image: ghcr.io/gardener/trellis:v0.9.0\n\
             webhook: {{address: \"127.0.0.1:{}\"}}\nadmin: {{address: \"127.0.0.1:{}\"}}\n",
            free_port(),
            free_port()
        ),
    )
    .unwrap();
    Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args(["extension", "--config"])
        .arg(dir.join("extension.yaml"))
        .env("TRELLIS_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

async fn run(n: usize) {
    let kube = FakeKube::start().await;
    let dir = std::env::temp_dir().join(format!("trellis-ext-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cluster: Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/data/extension/cluster.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let names: Vec<String> = (0..SHOOTS)
        .map(|i| format!("shoot--bench--s{i:04}"))
        .collect();
    for ns in &names {
        shoot(&kube, &cluster, ns);
    }
    let t0 = Instant::now();
    let mut child = spawn(&dir, &kube);
    let pid = child.id();
    while !names.iter().all(|ns| succeeded(&kube, ns)) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = t0.elapsed();
    // Settle: the work queue idle, the allocator's caches as they stay.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss = status_kib(pid, "VmRSS:");
    let hwm = status_kib(pid, "VmHWM:");
    let secret = kube
        .get("v1", "Secret", &names[0], "extension-trellis-node")
        .unwrap();
    let carried: usize = secret["data"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().len() * 3 / 4)
        .sum();
    println!(
        "{SHOOTS} shoots: all Succeeded {:.2} s after start; the process's VmRSS {rss} kB \
         ({:.1} kB per shoot), peak VmHWM {hwm} kB; a ManagedResource Secret carries {carried} B",
        took.as_secs_f64(),
        rss as f64 / SHOOTS as f64
    );

    // Annotation -> Succeeded, on one shoot among 500.
    let ns = &names[0];
    let succeeded_since = |kube: &FakeKube, from: usize| {
        kube.writes_from(from).iter().any(|(l, b)| {
            l.contains(ns.as_str())
                && l.contains("/status")
                && b["status"]["lastOperation"]["state"] == "Succeeded"
        })
    };
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let from = kube.write_count();
        let mut e: Value = kube.get(EXT, "Extension", ns, "trellis-node").unwrap();
        e["metadata"]["annotations"][OPERATION] = json!("reconcile");
        let t0 = Instant::now();
        kube.put(e);
        while !succeeded_since(&kube, from) {
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
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
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
    rt.block_on(run(n));
}
