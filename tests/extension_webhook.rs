//! The extension's webhook server over real TLS on loopback, to a rustls client that trusts
//! only the CA bundle the certificates module publishes: the server certificate's names,
//! a rotation with a keep-alive connection open across it, and the answers to bad input
//! (size, shape, path, method, caller, stalled handshakes and requests). And the
//! certificates' Secrets against the fake API server: two replicas converge on one CA.

#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod fakekube;

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use fakekube::FakeKube;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls_pki_types::pem::PemObject;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use trellis::extension::certs::{self, Published, Settings};
use trellis::extension::metrics::ExtensionMetrics;
use trellis::extension::role::Target;
use trellis::extension::server;
use trellis::extension::state::State;

const NS: &str = "shoot--dev--alpha";
const EXT_NS: &str = "garden-trellis";
const SERVICE: &str = "gardener-extension-trellis";
const DAY: Duration = Duration::from_secs(24 * 3600);

fn settings() -> Settings {
    Settings {
        namespace: EXT_NS.into(),
        service: SERVICE.into(),
        ca_validity: 30 * DAY,
        ca_overlap: DAY,
        server_validity: 7 * DAY,
        check_interval: Duration::from_millis(200),
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A running server; stopped when dropped.
struct Server {
    addr: SocketAddr,
    published: Arc<Published>,
    state: Arc<State>,
    _stop: watch::Sender<bool>,
}

async fn start(plan: &certs::Plan) -> Server {
    let published = Published::new();
    published.publish(&plan.server, &plan.ca.bundle).unwrap();
    let state = State::new();
    state.set_callers(NS, BTreeSet::from([IpAddr::from([127, 0, 0, 1])]));
    let bound = server::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = bound.local_addr();
    let (stop, stopped) = watch::channel(false);
    tokio::spawn(bound.serve(
        state.clone(),
        published.clone(),
        Arc::new(ExtensionMetrics::new()),
        stopped,
    ));
    Server {
        addr,
        published,
        state,
        _stop: stop,
    }
}

fn fresh() -> certs::Plan {
    certs::plan(&settings(), SystemTime::now(), None, None).unwrap()
}

/// A client that trusts `bundle` only.
async fn connect(
    addr: SocketAddr,
    bundle: &str,
    name: &str,
) -> std::io::Result<TlsStream<TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = TcpStream::connect(addr).await?;
    TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from(name.to_owned()).unwrap(), tcp)
        .await
}

fn svc_name() -> String {
    format!("{SERVICE}.{EXT_NS}.svc")
}

/// An answer: status, head, body.
#[derive(Debug)]
struct Reply {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// Writes one request and reads its answer (Content-Length bodies only, as the server
/// writes them).
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    method: &str,
    path: &str,
    body: &[u8],
) -> Reply {
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {SERVICE}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    s.flush().await.unwrap();
    read_reply(s).await
}

async fn read_reply<S: AsyncRead + Unpin>(s: &mut S) -> Reply {
    let mut buf = Vec::new();
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.unwrap();
        assert!(
            n > 0,
            "closed before an answer: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let status = head[9..12].parse().unwrap();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().unwrap())
        })
        .unwrap_or(0);
    let mut body = buf[end..].to_vec();
    while body.len() < length {
        let mut chunk = vec![0u8; length - body.len()];
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0);
        body.extend_from_slice(&chunk[..n]);
    }
    Reply { status, head, body }
}

fn review(uid: &str, object: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "resource": {"group": "", "version": "v1", "resource": "configmaps"},
            "namespace": "kube-system", "name": "other", "operation": "CREATE",
            "userInfo": {"username": "admin"},
            "object": object,
        }
    }))
    .unwrap()
}

/// A kind the webhook does not handle: allowed, no patch, whatever the mutation does.
fn config_map(uid: &str) -> Vec<u8> {
    review(
        uid,
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "other", "namespace": "kube-system"}, "data": {"a": "b"}}),
    )
}

fn path() -> String {
    Target::ApiserverProxy.path(NS)
}

fn assert_admitted_unchanged(r: &Reply, uid: &str) {
    assert_eq!(r.status, 200, "{r:?}");
    let v = r.json();
    assert_eq!(v["response"]["uid"], uid);
    assert_eq!(v["response"]["allowed"], true);
    assert!(v["response"].get("patch").is_none(), "{v}");
}

fn peer_cert(s: &TlsStream<TcpStream>) -> Vec<u8> {
    s.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

#[tokio::test]
async fn the_server_certificate_names_the_service_and_verifies_with_the_bundle() {
    let plan = fresh();
    let srv = start(&plan).await;
    for name in [
        SERVICE.to_owned(),
        format!("{SERVICE}.{EXT_NS}"),
        svc_name(),
    ] {
        let mut s = connect(srv.addr, &plan.ca.bundle, &name).await.unwrap();
        assert_admitted_unchanged(
            &exchange(&mut s, "POST", &path(), &config_map("u1")).await,
            "u1",
        );
    }
    let der = peer_cert(
        &connect(srv.addr, &plan.ca.bundle, &svc_name())
            .await
            .unwrap(),
    );
    let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
    let names: Vec<String> = cert
        .subject_alternative_name()
        .unwrap()
        .unwrap()
        .value
        .general_names
        .iter()
        .map(|n| n.to_string())
        .collect();
    assert_eq!(
        names,
        [
            format!("DNSName({SERVICE})"),
            format!("DNSName({SERVICE}.{EXT_NS})"),
            format!("DNSName({SERVICE}.{EXT_NS}.svc)")
        ]
    );
    // Another name, or another CA: refused by the client.
    assert!(
        connect(srv.addr, &plan.ca.bundle, "kubernetes.default.svc")
            .await
            .is_err()
    );
    assert!(
        connect(srv.addr, &fresh().ca.bundle, &svc_name())
            .await
            .is_err()
    );
}

#[tokio::test]
async fn a_rotation_keeps_the_open_connection_and_new_ones_get_the_new_certificate() {
    let now = SystemTime::now();
    // A CA made 24 days ago, its successor announced 20 minutes ago: served now is a
    // certificate of the old CA, and the bundle holds both.
    let old = certs::plan(
        &settings(),
        now - 24 * DAY - Duration::from_secs(3600),
        None,
        None,
    )
    .unwrap();
    let announced = certs::plan(
        &settings(),
        now - Duration::from_secs(20 * 60),
        Some(&old.ca),
        Some(&old.server),
    )
    .unwrap();
    let next_ca = announced.ca.next.clone().unwrap().0;
    let srv = start(&announced).await;
    let mut open = connect(srv.addr, &announced.ca.bundle, &svc_name())
        .await
        .unwrap();
    assert_admitted_unchanged(
        &exchange(&mut open, "POST", &path(), &config_map("a")).await,
        "a",
    );
    let before = peer_cert(&open);

    // The rotation: the next CA signs a new server certificate, published while `open` is.
    let rotated = certs::plan(
        &settings(),
        now,
        Some(&announced.ca),
        Some(&announced.server),
    )
    .unwrap();
    assert!(rotated.server_changed);
    assert_eq!(rotated.ca.cert, next_ca);
    srv.published
        .publish(&rotated.server, &rotated.ca.bundle)
        .unwrap();

    // The open keep-alive connection goes on with its handshake's certificate.
    assert_admitted_unchanged(
        &exchange(&mut open, "POST", &path(), &config_map("b")).await,
        "b",
    );
    assert_eq!(peer_cert(&open), before);
    // A new connection gets the new certificate, trusted by the new bundle and by the one
    // published before the rotation (the next CA was announced in it).
    for bundle in [&rotated.ca.bundle, &announced.ca.bundle] {
        let mut fresh_conn = connect(srv.addr, bundle, &svc_name()).await.unwrap();
        let after = peer_cert(&fresh_conn);
        assert_ne!(after, before);
        let (_, cert) = x509_parser::parse_x509_certificate(&after).unwrap();
        let next_der = CertificateDer::from_pem_slice(next_ca.as_bytes()).unwrap();
        let (_, ca) = x509_parser::parse_x509_certificate(&next_der).unwrap();
        assert_eq!(cert.issuer().as_raw(), ca.subject().as_raw());
        assert_admitted_unchanged(
            &exchange(&mut fresh_conn, "POST", &path(), &config_map("c")).await,
            "c",
        );
    }
}

#[tokio::test]
async fn bad_input_gets_its_status_and_never_a_patch() {
    let plan = fresh();
    let srv = start(&plan).await;
    let conn = || connect(srv.addr, &plan.ca.bundle, SERVICE);
    // Declared too large: 413 before the body is read.
    let mut s = conn().await.unwrap();
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        path(),
        5 << 20
    );
    s.write_all(head.as_bytes()).await.unwrap();
    assert_eq!(read_reply(&mut s).await.status, 413);
    // Streamed too large (chunked, no length): 413 once past 4 MiB.
    let mut s = conn().await.unwrap();
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        path()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    // 4 MiB in 64 KiB chunks, then one byte more: everything sent is read by the time the
    // limit is passed (nothing left unread that would turn the close into a reset).
    let chunk = vec![b' '; 64 << 10];
    let frame = [format!("{:x}\r\n", chunk.len()).as_bytes(), &chunk, b"\r\n"].concat();
    for _ in 0..64 {
        s.write_all(&frame).await.unwrap();
    }
    s.write_all(b"1\r\n \r\n").await.unwrap();
    s.flush().await.unwrap();
    assert_eq!(read_reply(&mut s).await.status, 413);
    // Not a review, an unknown path, a GET: 400, 404, 405.
    let mut s = conn().await.unwrap();
    assert_eq!(
        exchange(&mut s, "POST", &path(), b"{\"kind\":\"Pod\"}")
            .await
            .status,
        400
    );
    let mut s = conn().await.unwrap();
    let r = exchange(
        &mut s,
        "POST",
        &format!("/shoot/{NS}/vpn"),
        &config_map("x"),
    )
    .await;
    assert_eq!(r.status, 404);
    let mut s = conn().await.unwrap();
    let r = exchange(&mut s, "GET", &path(), b"").await;
    assert_eq!(r.status, 405);
    assert!(
        r.head.to_ascii_lowercase().contains("allow: post"),
        "{}",
        r.head
    );
    // A caller that is no kube-apiserver of the path's namespace: denied, with the uid.
    srv.state
        .set_callers(NS, BTreeSet::from([IpAddr::from([10, 1, 2, 3])]));
    srv.state.set_callers(
        "shoot--dev--beta",
        BTreeSet::from([IpAddr::from([127, 0, 0, 1])]),
    );
    let mut s = conn().await.unwrap();
    let r = exchange(&mut s, "POST", &path(), &config_map("d")).await;
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["response"]["uid"], "d");
    assert_eq!(v["response"]["allowed"], false);
    assert!(v["response"].get("patch").is_none());
}

/// Waits for the server to close `s` (EOF or reset), for at most 20 s; how long it took.
async fn closed_after<S: AsyncRead + Unpin>(s: &mut S, since: Instant) -> Duration {
    let mut buf = [0u8; 1024];
    let waited = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(waited.is_ok(), "still open after 20 s");
    since.elapsed()
}

#[tokio::test]
async fn a_stalled_handshake_is_closed_after_about_5_s() {
    let plan = fresh();
    let srv = start(&plan).await;
    let since = Instant::now();
    let mut tcp = TcpStream::connect(srv.addr).await.unwrap();
    let took = closed_after(&mut tcp, since).await;
    // 5 s; a 15 s deadline would fail.
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(8),
        "closed after {took:?}"
    );
}

#[tokio::test]
async fn half_a_request_is_closed_after_about_10_s() {
    let plan = fresh();
    let srv = start(&plan).await;
    // Half a head.
    let mut head = connect(srv.addr, &plan.ca.bundle, SERVICE).await.unwrap();
    let since = Instant::now();
    head.write_all(format!("POST {} HTTP/1.1\r\nHost: x\r\n", path()).as_bytes())
        .await
        .unwrap();
    head.flush().await.unwrap();
    // A whole head and half its body.
    let mut body = connect(srv.addr, &plan.ca.bundle, SERVICE).await.unwrap();
    let full = config_map("h");
    body.write_all(
        format!(
            "POST {} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
            path(),
            full.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    body.write_all(&full[..full.len() / 2]).await.unwrap();
    body.flush().await.unwrap();
    let (a, b) = tokio::join!(closed_after(&mut head, since), async {
        let r = read_reply(&mut body).await;
        assert_eq!(r.status, 408);
        closed_after(&mut body, since).await
    });
    // 10 s; a 20 s deadline would fail.
    for took in [a, b] {
        assert!(
            took >= Duration::from_secs(9) && took < Duration::from_secs(14),
            "closed after {took:?}"
        );
    }
}

#[tokio::test]
async fn a_request_trickled_in_is_cut_10_s_after_its_first_byte_not_per_phase() {
    let plan = fresh();
    let srv = start(&plan).await;
    let s = connect(srv.addr, &plan.ca.bundle, SERVICE).await.unwrap();
    let (mut rd, mut wr) = tokio::io::split(s);
    let full = config_map("t");
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        path(),
        full.len()
    );
    let since = Instant::now();
    // The head over ~6 s (within the head's deadline), then the body a byte every 500 ms
    // (never all of it): per phase, the body would get 10 s more and be cut at ~16 s.
    let writer = tokio::spawn(async move {
        let head = head.into_bytes();
        for chunk in head.chunks(head.len().div_ceil(12)) {
            if wr.write_all(chunk).await.is_err() || wr.flush().await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        for b in &full[..full.len() - 1] {
            if wr.write_all(&[*b]).await.is_err() || wr.flush().await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    let r = read_reply(&mut rd).await;
    assert_eq!(r.status, 408, "{r:?}");
    let took = closed_after(&mut rd, since).await;
    assert!(
        took >= Duration::from_secs(9) && took < Duration::from_secs(13),
        "closed after {took:?}"
    );
    writer.abort();
}

fn kube_client(kube: &FakeKube) -> kube::Client {
    // kube's client takes the process default (tests link both providers).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = kube::Config::new(kube.url().parse().unwrap());
    kube::Client::try_from(config).unwrap()
}

#[tokio::test]
async fn two_replicas_converge_on_one_ca_in_the_secrets_and_publish_it() {
    let kube = FakeKube::start().await;
    let api: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(kube_client(&kube), EXT_NS);
    let metrics = ExtensionMetrics::new();
    let now = SystemTime::now();
    let set = settings();
    let (a, b) = tokio::join!(
        certs::check(&api, &set, now, &metrics),
        certs::check(&api, &set, now, &metrics)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.ca.cert, b.ca.cert);
    assert_eq!(a.server, b.server);
    let stored = kube.get("v1", "Secret", EXT_NS, certs::CA_SECRET).unwrap();
    for key in ["ca.crt", "ca.key", "bundle.crt"] {
        assert!(stored["data"][key].is_string(), "{key}: {stored}");
    }
    let server = kube
        .get("v1", "Secret", EXT_NS, certs::SERVER_SECRET)
        .unwrap();
    assert_eq!(server["type"], "kubernetes.io/tls");
    let rv = kube.resource_version();
    // A later check with nothing due writes nothing.
    let again = certs::check(&api, &settings(), now + Duration::from_secs(60), &metrics)
        .await
        .unwrap();
    assert_eq!(again.ca, a.ca);
    assert_eq!(kube.resource_version(), rv);

    // The loop publishes the key pair and the bundle.
    let published = Published::new();
    let mut bundle = published.bundle();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(certs::run(
        api,
        settings(),
        published.clone(),
        Arc::new(ExtensionMetrics::new()),
        async {
            let _ = stopped.await;
        },
    ));
    tokio::time::timeout(Duration::from_secs(10), bundle.changed())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(*bundle.borrow(), a.ca.bundle);
    assert!(published.key().is_some());
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .unwrap()
        .unwrap();
}
