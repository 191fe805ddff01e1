//! Webhook latency: the extension's HTTPS server in-process on loopback with a real
//! certificate, 10,000 AdmissionReviews of an `apiserver-proxy` DaemonSet as Gardener writes
//! it (over 4 keep-alive connections, one request in flight on each), the time from writing
//! a request to reading its whole answer. Prints p50/p99/max and the patch size; the goal is
//! p99 under 5 ms (printed, not asserted).

#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use base64::Engine;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls_pki_types::pem::PemObject;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_rustls::TlsConnector;
use trellis::extension::certs::{self, Published, Settings};
use trellis::extension::metrics::ExtensionMetrics;
use trellis::extension::role::{ExtensionType, Target};
use trellis::extension::server;
use trellis::extension::state::{NodeShoot, State};

const REVIEWS: usize = 10_000;
const CONNECTIONS: usize = 4;
const NS: &str = "shoot--dev--alpha";

/// The `apiserver-proxy` DaemonSet as gardener v1.149 renders it (abridged to its shape).
fn daemon_set() -> Value {
    let ip = "--ip-address=240.0.0.1";
    json!({
      "apiVersion": "apps/v1", "kind": "DaemonSet",
      "metadata": {"name": "apiserver-proxy", "namespace": "kube-system",
        "labels": {"app": "kubernetes", "role": "apiserver-proxy", "gardener.cloud/role": "system-component",
                   "origin": "gardener", "resources.gardener.cloud/managed-by": "gardener"}},
      "spec": {
        "revisionHistoryLimit": 2,
        "selector": {"matchLabels": {"app": "kubernetes", "role": "apiserver-proxy"}},
        "template": {
          "metadata": {"labels": {"app": "kubernetes", "role": "apiserver-proxy",
            "gardener.cloud/role": "system-component", "origin": "gardener",
            "networking.gardener.cloud/to-apiserver": "allowed", "networking.gardener.cloud/to-dns": "allowed"},
            "annotations": {"checksum/config": "b1946ac92492d2347c6235b4d2611184"}},
          "spec": {
            "automountServiceAccountToken": false, "hostNetwork": true,
            "priorityClassName": "system-node-critical", "serviceAccountName": "apiserver-proxy",
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "tolerations": [{"effect": "NoSchedule", "operator": "Exists"}, {"effect": "NoExecute", "operator": "Exists"}],
            "initContainers": [{"name": "setup", "image": "europe-docker.pkg.dev/gardener-project/releases/gardener/apiserver-proxy-sidecar:v0.19.0",
              "args": [ip, "--daemon=false", "--interface=lo"],
              "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}}],
            "containers": [
              {"name": "sidecar", "image": "europe-docker.pkg.dev/gardener-project/releases/gardener/apiserver-proxy-sidecar:v0.19.0",
               "args": [ip, "--interface=lo"], "resources": {"requests": {"cpu": "5m", "memory": "15Mi"}},
               "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}},
              {"name": "proxy", "image": "europe-docker.pkg.dev/gardener-project/releases/3rd/envoyproxy/envoy-distroless:v1.35.0",
               "command": ["envoy", "--concurrency", "2", "--use-dynamic-base-id", "-c", "/etc/apiserver-proxy/envoy.yaml"],
               "ports": [{"name": "metrics", "containerPort": 16910, "hostPort": 16910, "protocol": "TCP"}],
               "livenessProbe": {"httpGet": {"path": "/ready", "port": 16910}, "initialDelaySeconds": 1},
               "resources": {"requests": {"cpu": "20m", "memory": "20Mi"}, "limits": {"memory": "1Gi"}},
               "volumeMounts": [{"name": "proxy-config", "mountPath": "/etc/apiserver-proxy"},
                                {"name": "admin-uds", "mountPath": "/etc/admin-uds"}]}],
            "volumes": [{"name": "proxy-config", "configMap": {"name": "apiserver-proxy-config-8a2b5c1e"}},
                        {"name": "admin-uds", "emptyDir": {}}]
          }
        },
        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
      }
    })
}

fn review(uid: usize, object: &Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": format!("00000000-0000-0000-0000-{uid:012}"),
            "kind": {"group": "apps", "version": "v1", "kind": "DaemonSet"},
            "resource": {"group": "apps", "version": "v1", "resource": "daemonsets"},
            "requestKind": {"group": "apps", "version": "v1", "kind": "DaemonSet"},
            "namespace": "kube-system", "name": "apiserver-proxy", "operation": "UPDATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:gardener-resource-manager",
                         "groups": ["system:serviceaccounts", "system:authenticated"]},
            "object": object, "oldObject": object, "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "UpdateOptions"}
        }
    }))
    .unwrap()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "an index into a list of 10,000"
    )]
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run());
}

async fn run() {
    let settings = Settings {
        namespace: "garden-trellis".into(),
        service: "gardener-extension-trellis".into(),
        ca_validity: Duration::from_secs(30 * 86400),
        ca_overlap: Duration::from_secs(86400),
        server_validity: Duration::from_secs(7 * 86400),
        check_interval: Duration::from_secs(60),
    };
    let plan = certs::plan(&settings, SystemTime::now(), None, None).unwrap();
    let published = Published::new();
    published.publish(&plan.server, &plan.ca.bundle).unwrap();
    let state = State::new();
    state.set_callers(NS, BTreeSet::from([IpAddr::from([127, 0, 0, 1])]));
    state.update_shoot(NS, |s| {
        s.configured.insert(ExtensionType::Node);
        s.labelled.insert(ExtensionType::Node);
        s.node = Some(NodeShoot {
            image: "europe-docker.pkg.dev/trellis/trellis:v0.1.0".into(),
            config_map: "trellis-node".into(),
            config_digest: "sha256:0123456789abcdef".into(),
        });
    });
    let bound = server::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = bound.local_addr();
    let (stop, stopped) = watch::channel(false);
    let served =
        tokio::spawn(bound.serve(state, published, Arc::new(ExtensionMetrics::new()), stopped));

    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(plan.ca.bundle.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let client = Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth(),
    );
    let object = daemon_set();
    let body_len = review(0, &object).len();
    let path = Target::ApiserverProxy.path(NS);
    let mut tasks = Vec::new();
    for c in 0..CONNECTIONS {
        let (client, object, path) = (client.clone(), object.clone(), path.clone());
        tasks.push(tokio::spawn(async move {
            let tcp = TcpStream::connect(addr).await.unwrap();
            tcp.set_nodelay(true).unwrap();
            let name = ServerName::try_from("gardener-extension-trellis.garden-trellis.svc").unwrap();
            let mut s = TlsConnector::from(client).connect(name, tcp).await.unwrap();
            let mut times = Vec::with_capacity(REVIEWS / CONNECTIONS);
            let mut patch_len = 0;
            let mut buf = vec![0u8; 256 << 10];
            for i in 0..REVIEWS / CONNECTIONS {
                let body = review(c * REVIEWS + i, &object);
                let mut req = format!(
                    "POST {path} HTTP/1.1\r\nHost: gardener-extension-trellis\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                )
                .into_bytes();
                req.extend_from_slice(&body);
                let started = Instant::now();
                s.write_all(&req).await.unwrap();
                let mut have = 0;
                let (head_end, length) = loop {
                    let n = s.read(&mut buf[have..]).await.unwrap();
                    assert!(n > 0, "closed");
                    have += n;
                    if let Some(e) = buf[..have].windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..e]).to_ascii_lowercase();
                        assert!(head.starts_with("http/1.1 200"), "{head}");
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .unwrap()
                            .trim()
                            .parse()
                            .unwrap();
                        break (e + 4, len);
                    }
                };
                while have < head_end + length {
                    let n = s.read(&mut buf[have..]).await.unwrap();
                    assert!(n > 0, "closed");
                    have += n;
                }
                times.push(started.elapsed());
                if i == 0 {
                    let v: Value = serde_json::from_slice(&buf[head_end..have]).unwrap();
                    assert_eq!(v["response"]["allowed"], true);
                    patch_len = v["response"]["patch"].as_str().map_or(0, |p| {
                        base64::engine::general_purpose::STANDARD
                            .decode(p)
                            .unwrap()
                            .len()
                    });
                }
            }
            (times, patch_len)
        }));
    }
    let mut all = Vec::with_capacity(REVIEWS);
    let mut patch_len = 0;
    let wall = Instant::now();
    for t in tasks {
        let (times, p) = t.await.unwrap();
        all.extend(times);
        patch_len = p;
    }
    let wall = wall.elapsed();
    all.sort();
    stop.send_replace(true);
    let _ = served.await;
    println!(
        "extension webhook: {} reviews over {CONNECTIONS} keep-alive TLS connections in {:.2?} ({:.0}/s)",
        all.len(),
        wall,
        all.len() as f64 / wall.as_secs_f64()
    );
    println!("  request body {body_len} B, patch {patch_len} B (JSON, decoded)");
    println!(
        "  latency p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms (goal: p99 under 5 ms)",
        percentile(&all, 0.50).as_secs_f64() * 1e3,
        percentile(&all, 0.99).as_secs_f64() * 1e3,
        all.last().map_or(0.0, |d| d.as_secs_f64() * 1e3)
    );
}
