//! The whole path on loopback, shared by `tests/controller_e2e.rs` and
//! `benches/controller_e2e.rs`: the fake API server, the real `trellis controller` writing
//! its table into a directory, a real `trellis gateway` whose `routes.file` is that table,
//! and shoots whose EndpointSlices point at backends on 127.0.0.x.
#![expect(
    dead_code,
    reason = "each test crate uses a part of the shared helpers"
)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::common::{self, Gateway, TestDir, free_port, http_get};
use crate::fakekube::FakeKube;

/// The name of the route the controller renders for the fallback backend.
pub(crate) const FALLBACK: &str = "fallback";

/// The labels of the seed's default ingress gateway (the controller's default target).
const SELECTOR: &str = "{app: istio-ingressgateway, istio: ingressgateway, istio-role: seed}";

/// A running `trellis controller --config`, killed when dropped.
pub(crate) struct Controller {
    pub(crate) child: Child,
    pub(crate) dir: TestDir,
    pub(crate) admin: SocketAddr,
}

impl Controller {
    /// Starts the controller against `kube`, rendering the seed's default gateway with
    /// `fallback` as its fallback backend, writing `out/routes.json`.
    pub(crate) fn start(kube: &FakeKube, fallback: SocketAddr) -> Controller {
        Self::start_with(
            kube,
            &format!("gateway: {{selector: {SELECTOR}}}\nfallback: {{address: \"{fallback}\"}}"),
        )
    }

    /// [`Controller::start`] with the shoots' tunnels turned on (`tunnel.enabled: true`).
    pub(crate) fn start_tunnels(kube: &FakeKube, fallback: SocketAddr) -> Controller {
        Self::start_with(
            kube,
            &format!(
                "gateway: {{selector: {SELECTOR}}}\nfallback: {{address: \"{fallback}\"}}\n\
                 tunnel: {{enabled: true}}"
            ),
        )
    }

    /// Starts the controller against `kube` with `settings` (the configuration's
    /// `gateway` and `fallback` lines), writing `out/routes.json`.
    pub(crate) fn start_with(kube: &FakeKube, settings: &str) -> Controller {
        let dir = TestDir::new("controller");
        kube.write_kubeconfig(&dir.path("kubeconfig"));
        let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
        std::fs::write(
            dir.path("controller.yaml"),
            format!(
                "apiVersion: trellis.gardener.cloud/v1alpha1
kind: ControllerConfiguration
kubeconfig: kubeconfig
{settings}
output: {{file: out/routes.json}}
admin: {{address: \"{admin}\"}}
"
            ),
        )
        .unwrap();
        std::fs::create_dir(dir.path("out")).unwrap();
        let log = std::fs::File::create(dir.path("controller.log")).unwrap();
        let child = Command::new(common::BIN)
            .args(["--log-format", "json", "controller", "--config"])
            .arg(dir.path("controller.yaml"))
            .env("TRELLIS_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Controller { child, dir, admin }
    }

    pub(crate) fn table_path(&self) -> PathBuf {
        self.dir.path("out/routes.json")
    }

    pub(crate) fn table(&self) -> Option<Value> {
        let text = std::fs::read_to_string(self.table_path()).ok()?;
        serde_json::from_str(&text).ok()
    }

    pub(crate) fn logs(&self) -> String {
        std::fs::read_to_string(self.dir.path("controller.log")).unwrap_or_default()
    }

    /// The log lines (JSON objects) whose message is `message`.
    pub(crate) fn logged(&self, message: &str) -> Vec<Value> {
        self.logs()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["message"] == message)
            .collect()
    }

    /// Waits (at most `limit`) until the table satisfies `pred`; returns it.
    pub(crate) fn wait_table(
        &self,
        what: &str,
        limit: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        common::wait_for(limit, || self.table().filter(&pred)).unwrap_or_else(|| {
            panic!(
                "no table with {what} within {limit:?}; last: {:?}\n{}",
                self.table(),
                self.logs()
            )
        })
    }

    /// `GET path` on the controller's admin address.
    pub(crate) fn get(&self, path: &str) -> Option<(u16, String)> {
        http_get(self.admin, path)
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The names of a table's routes (the controller's file or the gateway's `/routes`).
pub(crate) fn route_names(table: &Value) -> Vec<String> {
    table["routes"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .filter_map(|r| r["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// A gateway with one `sni` listener whose table is the controller's output and whose
/// default route is the fallback. The controller must have written its first table.
pub(crate) fn gateway_for(c: &Controller, extra: &str) -> Gateway {
    Gateway::start_opts(
        "",
        extra,
        &format!("  defaultRoute: {FALLBACK}"),
        &format!(
            "routes: {{file: {:?}}}",
            c.table_path().display().to_string()
        ),
    )
}

/// The route names the gateway serves now (its debug `/routes`).
pub(crate) fn served_routes(gw: &Gateway) -> Vec<String> {
    http_get(gw.debug, "/routes")
        .and_then(|(_, body)| serde_json::from_str::<Value>(&body).ok())
        .map(|t| route_names(&t))
        .unwrap_or_default()
}

/// The public keys of route `route`'s tunnel peers as the gateway serves them (its debug
/// `/routes`).
pub(crate) fn served_peer_keys(gw: &Gateway, route: &str) -> Vec<String> {
    http_get(gw.debug, "/routes")
        .and_then(|(_, body)| serde_json::from_str::<Value>(&body).ok())
        .and_then(|t| {
            let routes = t["routes"].as_array()?.clone();
            let r = routes.into_iter().find(|r| r["name"] == route)?;
            let peers = r["tunnel"]["wireguard"]["peers"].as_array()?.clone();
            Some(
                peers
                    .iter()
                    .filter_map(|p| p["publicKey"].as_str().map(str::to_owned))
                    .collect(),
            )
        })
        .unwrap_or_default()
}

/// The API server host name of shoot `name` (namespace `shoot--e2e--<name>`).
pub(crate) fn host(name: &str) -> String {
    format!("api.{name}.e2e.example.com")
}

/// The namespace of shoot `name`.
pub(crate) fn namespace(name: &str) -> String {
    format!("shoot--e2e--{name}")
}

const ISTIO: &str = "networking.istio.io/v1";

fn meta(ns: &str, name: &str) -> Value {
    let mut m = json!({"name": name, "creationTimestamp": "2024-03-01T10:00:00Z"});
    if !ns.is_empty() {
        m["namespace"] = json!(ns);
    }
    m
}

/// The EndpointSlice of shoot `name`'s `kube-apiserver` Service: one ready endpoint,
/// `backend`.
pub(crate) fn endpoint_slice(name: &str, backend: SocketAddr) -> Value {
    let ns = namespace(name);
    let mut m = meta(&ns, "kube-apiserver-e2e");
    m["labels"] = json!({"kubernetes.io/service-name": "kube-apiserver"});
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": m,
        "addressType": "IPv4",
        "endpoints": [{"addresses": [backend.ip().to_string()],
            "conditions": {"ready": true, "serving": true, "terminating": false}}],
        "ports": [{"name": "kube-apiserver", "port": backend.port(), "protocol": "TCP"}]})
}

/// The Istio VirtualService of shoot `name` (passthrough of its host to `kube-apiserver`).
pub(crate) fn virtual_service(name: &str, api_version: &str) -> Value {
    let ns = namespace(name);
    let host = host(name);
    json!({"apiVersion": api_version, "kind": "VirtualService",
        "metadata": meta(&ns, "kube-apiserver"),
        "spec": {"exportTo": ["istio-ingress"], "gateways": ["kube-apiserver"], "hosts": [host],
            "tls": [{"match": [{"port": 443, "sniHosts": [host]}],
                "route": [{"destination": {"host": format!("kube-apiserver.{ns}.svc.cluster.local"),
                    "port": {"number": 443}}}]}]}})
}

/// What gardenlet writes for a shoot exposed by TLS passthrough (Namespace, Gateway,
/// VirtualService, Service `kube-apiserver` and its EndpointSlice), reduced to one host,
/// its API server at `backend`; the Istio objects at `istio` (`networking.istio.io/v1` or
/// `v1beta1`).
pub(crate) fn shoot_at(name: &str, backend: SocketAddr, istio: &str) -> Vec<Value> {
    let ns = namespace(name);
    let mut ns_meta = meta("", &ns);
    ns_meta["labels"] = json!({"gardener.cloud/role": "shoot"});
    vec![
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": ns_meta}),
        json!({"apiVersion": istio, "kind": "Gateway", "metadata": meta(&ns, "kube-apiserver"),
            "spec": {"selector": {"app": "istio-ingressgateway", "istio": "ingressgateway",
                    "istio-role": "seed"},
                "servers": [{"hosts": [host(name)],
                    "port": {"name": "tls", "number": 443, "protocol": "TLS"},
                    "tls": {"mode": "PASSTHROUGH"}}]}}),
        virtual_service(name, istio),
        json!({"apiVersion": "v1", "kind": "Service", "metadata": meta(&ns, "kube-apiserver"),
            // No cluster IP: no PROXY destination to keep unique across shoots.
            "spec": {"type": "ClusterIP",
                "ports": [{"name": "kube-apiserver", "port": 443, "protocol": "TCP",
                    "targetPort": backend.port()}]}}),
        endpoint_slice(name, backend),
    ]
}

/// [`shoot_at`] with the Istio objects at `networking.istio.io/v1`.
pub(crate) fn shoot(name: &str, backend: SocketAddr) -> Vec<Value> {
    shoot_at(name, backend, ISTIO)
}

/// Puts every object of `objects`.
pub(crate) fn put_all(kube: &FakeKube, objects: Vec<Value>) {
    for o in objects {
        kube.put(o);
    }
}

/// Deletes shoot `name`'s objects, VirtualService first (as its route goes with it).
pub(crate) fn delete_shoot(kube: &FakeKube, name: &str) {
    let ns = namespace(name);
    kube.delete(ISTIO, "VirtualService", &ns, "kube-apiserver");
    kube.delete(ISTIO, "Gateway", &ns, "kube-apiserver");
    kube.delete(
        "discovery.k8s.io/v1",
        "EndpointSlice",
        &ns,
        "kube-apiserver-e2e",
    );
    kube.delete("v1", "Service", &ns, "kube-apiserver");
    kube.delete("v1", "Namespace", "", &ns);
}

/// The Gardener `Cluster` of shoot `name`: its shoot's node, pod and service networks.
pub(crate) fn cluster(name: &str) -> Value {
    let ns = namespace(name);
    json!({"apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Cluster",
        "metadata": meta("", &ns),
        "spec": {"shoot": {"apiVersion": "core.gardener.cloud/v1beta1", "kind": "Shoot",
            "metadata": {"name": name, "namespace": "garden-e2e"},
            "spec": {"networking": {"type": "calico", "nodes": "10.250.0.0/16",
                "pods": "100.96.0.0/11", "services": "100.64.0.0/13"}}}}})
}

/// Shoot `name`'s tunnel peers Secret: one agent, `agent-0`, with `key` (base64) at
/// 192.168.128.5.
pub(crate) fn peers_secret(name: &str, key: &str) -> Value {
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let mut m = meta(&namespace(name), "trellis-tunnel-peers");
    m["labels"] = json!({"trellis.gardener.cloud/role": "tunnel-peers"});
    json!({"apiVersion": "v1", "kind": "Secret", "metadata": m, "type": "Opaque",
        "data": {"agent-0.publicKey": b64(key), "agent-0.addresses": b64("192.168.128.5")}})
}

/// One of gardenlet's secrets-manager Secrets in shoot `name`'s namespace: `secret` (the
/// hashed object name) of config name `config` (`vpn-seed-server`, `ca-vpn-bundle`),
/// created at `created`, with `data` (PEM by key).
pub(crate) fn managed_secret(
    name: &str,
    secret: &str,
    config: &str,
    created: &str,
    data: &[(&str, &str)],
) -> Value {
    use base64::Engine;
    let mut m = meta(&namespace(name), secret);
    m["creationTimestamp"] = json!(created);
    m["labels"] = json!({"name": config, "managed-by": "secrets-manager",
        "manager-identity": "gardenlet", "persist": "true"});
    let data: serde_json::Map<String, Value> = data
        .iter()
        .map(|(k, v)| {
            let v = base64::engine::general_purpose::STANDARD.encode(v);
            ((*k).to_owned(), Value::String(v))
        })
        .collect();
    json!({"apiVersion": "v1", "kind": "Secret", "metadata": m, "type": "Opaque", "data": data})
}

/// The server names every test backend's certificate holds.
pub(crate) fn test_names(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| host(n)).collect()
}

/// A TLS server (rustls) that answers every connection with its name and closes.
pub(crate) struct NamedBackend {
    pub(crate) addr: SocketAddr,
    pub(crate) name: String,
    pub(crate) cert_der: Vec<u8>,
}

impl NamedBackend {
    /// Listens on `ip`:0 with a certificate for `sans`.
    pub(crate) async fn start(name: &str, ip: [u8; 4], sans: &[String]) -> NamedBackend {
        let ck = rcgen::generate_simple_self_signed(sans.to_vec()).unwrap();
        let cert_der = ck.cert.der().to_vec();
        let key =
            rustls::pki_types::PrivateKeyDer::try_from(ck.signing_key.serialize_der()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(common::crypto())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![ck.cert.der().clone()], key)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind(SocketAddr::from((ip, 0))).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let body = name.to_owned();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, body) = (acceptor.clone(), body.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let _ = tls.write_all(body.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        NamedBackend {
            addr,
            name: name.to_owned(),
            cert_der,
        }
    }
}

/// A rustls client trusting exactly `backends`' certificates.
pub(crate) fn client(backends: &[&NamedBackend]) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for b in backends {
        roots
            .add(rustls::pki_types::CertificateDer::from(b.cert_der.clone()))
            .unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(common::crypto())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// Connects through `gateway` with server name `sni`; the name of the backend that
/// completed a verified TLS handshake and answered, or the error.
pub(crate) async fn who(
    connector: &tokio_rustls::TlsConnector,
    gateway: SocketAddr,
    sni: &str,
) -> Result<String, String> {
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect(gateway).await?;
        let name = rustls::pki_types::ServerName::try_from(sni.to_owned())
            .map_err(std::io::Error::other)?;
        let mut tls = connector.connect(name, tcp).await?;
        let mut out = String::new();
        tls.read_to_string(&mut out).await?;
        Ok::<_, std::io::Error>(out)
    };
    match tokio::time::timeout(Duration::from_secs(5), attempt).await {
        Ok(Ok(name)) => Ok(name),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("timed out".to_owned()),
    }
}

/// Polls (every 5 ms, at most `limit`) until a client with server name `sni` reaches the
/// backend named `expected`; the time it took. Panics with the last answer otherwise.
pub(crate) async fn wait_served(
    connector: &tokio_rustls::TlsConnector,
    gateway: SocketAddr,
    sni: &str,
    expected: &str,
    limit: Duration,
) -> Duration {
    let start = Instant::now();
    loop {
        let got = who(connector, gateway, sni).await;
        if got.as_deref() == Ok(expected) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "{sni} did not reach {expected} within {limit:?}; last: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
