//! kube-apiserver's side of egress: Gardener's per-shoot egress PKI (rcgen) and a TLS
//! client that speaks its CONNECT, shared by the egress and tunnel tests.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::client::TlsStream;

use super::{TestDir, crypto};

/// The 200 a kube-apiserver accepts, exactly.
pub(crate) const OK: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";

/// A certificate authority (rcgen).
pub(crate) struct Ca {
    pub(crate) params: rcgen::CertificateParams,
    pub(crate) key: rcgen::KeyPair,
    pub(crate) pem: String,
}

impl Ca {
    pub(crate) fn new(cn: &str) -> Ca {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate().unwrap();
        let pem = params.self_signed(&key).unwrap().pem();
        Ca { params, key, pem }
    }

    /// A leaf (certificate PEM, key PEM) for `cn` with DNS SANs `sans`.
    pub(crate) fn issue(&self, cn: &str, sans: &[String], server: bool) -> (String, String) {
        let mut params = rcgen::CertificateParams::new(sans.to_vec()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.extended_key_usages = vec![if server {
            rcgen::ExtendedKeyUsagePurpose::ServerAuth
        } else {
            rcgen::ExtendedKeyUsagePurpose::ClientAuth
        }];
        let key = rcgen::KeyPair::generate().unwrap();
        let issuer = rcgen::Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// One shoot's egress PKI as Gardener issues it, written to files.
pub(crate) struct Shoot {
    pub(crate) namespace: String,
    pub(crate) ca: Ca,
    /// `tls.crt`, `tls.key`, `ca.crt` of the vpn-seed-server certificate, in `dir`.
    pub(crate) files: [std::path::PathBuf; 3],
    pub(crate) client_cert: String,
    pub(crate) client_key: String,
}

impl Shoot {
    pub(crate) fn new(dir: &TestDir, namespace: &str) -> Shoot {
        let ca = Ca::new("vpn");
        // kutil.DNSNamesForService("vpn-seed-server", namespace).
        let sans: Vec<String> = [
            "vpn-seed-server".to_string(),
            format!("vpn-seed-server.{namespace}"),
            format!("vpn-seed-server.{namespace}.svc"),
            format!("vpn-seed-server.{namespace}.svc.cluster.local"),
        ]
        .into();
        let (cert, key) = ca.issue("vpn-seed-server", &sans, true);
        let (client_cert, client_key) = ca.issue("kube-apiserver-http-proxy", &[], false);
        let files = [
            dir.path(&format!("{namespace}-tls.crt")),
            dir.path(&format!("{namespace}-tls.key")),
            dir.path(&format!("{namespace}-ca.crt")),
        ];
        std::fs::write(&files[0], &cert).unwrap();
        std::fs::write(&files[1], &key).unwrap();
        std::fs::write(&files[2], &ca.pem).unwrap();
        Shoot {
            namespace: namespace.to_string(),
            ca,
            files,
            client_cert,
            client_key,
        }
    }

    /// The `tls:` section naming this shoot's files.
    pub(crate) fn tls_yaml(&self) -> String {
        format!(
            "{{certificateFile: {:?}, keyFile: {:?}, clientCAFile: {:?}}}",
            self.files[0], self.files[1], self.files[2]
        )
    }

    pub(crate) fn client(&self) -> Client {
        Client {
            trust: self.ca.pem.clone(),
            cert: Some((self.client_cert.clone(), self.client_key.clone())),
        }
    }
}

/// What a TLS client presents and trusts.
#[derive(Clone)]
pub(crate) struct Client {
    /// CA PEM the server certificate must chain to.
    pub(crate) trust: String,
    /// Client certificate and key PEM.
    pub(crate) cert: Option<(String, String)>,
}

pub(crate) fn pem_certs(pem: &str) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap()
}

impl Client {
    pub(crate) fn connector(&self, tls12: bool) -> tokio_rustls::TlsConnector {
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for c in pem_certs(&self.trust) {
            roots.add(c).unwrap();
        }
        let versions: &[&rustls::SupportedProtocolVersion] = if tls12 {
            &[&rustls::version::TLS12]
        } else {
            &[&rustls::version::TLS13]
        };
        let builder = rustls::ClientConfig::builder_with_provider(crypto())
            .with_protocol_versions(versions)
            .unwrap()
            .with_root_certificates(roots);
        let config = match &self.cert {
            Some((cert, key)) => builder
                .with_client_auth_cert(
                    pem_certs(cert),
                    rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }
}

/// A TCP connection to `gw` from `source` (a loopback address).
pub(crate) async fn tcp_from(gw: SocketAddr, source: Option<IpAddr>) -> std::io::Result<TcpStream> {
    let sock = TcpSocket::new_v4()?;
    if let Some(ip) = source {
        sock.bind(SocketAddr::new(ip, 0))?;
    }
    sock.connect(gw).await
}

/// A TLS handshake with SNI `sni` (what kube-apiserver sends: `vpn-seed-server`).
pub(crate) async fn handshake(
    gw: SocketAddr,
    source: Option<IpAddr>,
    sni: &str,
    client: &Client,
    tls12: bool,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = tcp_from(gw, source).await?;
    let name = rustls::pki_types::ServerName::try_from(sni.to_string()).unwrap();
    let mut tls = tokio::time::timeout(
        Duration::from_secs(10),
        client.connector(tls12).connect(name, tcp),
    )
    .await??;
    // TLS 1.3 servers refuse a client certificate after the client's handshake is done:
    // a read makes the refusal (an alert) show.
    tls.flush().await?;
    Ok(tls)
}

/// Sends kube-apiserver's CONNECT for `target` and reads the first read's worth of answer.
pub(crate) async fn connect_to(tls: &mut TlsStream<TcpStream>, target: &str) -> Vec<u8> {
    tls.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(15), tls.read(&mut buf))
        .await
        .expect("no answer")
        .unwrap_or(0);
    buf.truncate(n);
    buf
}

/// The status of an answer (0 when none).
pub(crate) fn status(answer: &[u8]) -> u16 {
    String::from_utf8_lossy(answer)
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}
