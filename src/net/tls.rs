//! Server-side TLS with client certificates: a certificate chain, its private key and a
//! client CA bundle, read from PEM, become one rustls [`ServerConfig`] that speaks TLS 1.2
//! and 1.3 and requires a client certificate chaining to that bundle and nothing else; and
//! a verified leaf's identities (its subject CN and DNS SANs).
//!
//! One bundle per config is what lets hundreds of shoots share a CA subject (`CN=vpn`):
//! webpki gives up after 100 signature checks when one root store holds every candidate with
//! the same subject, so the caller picks the route, and with it the one bundle, before the
//! client's certificate is verified. Nothing here watches files or knows about routes.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::server::{ServerConfig, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use thiserror::Error;

use tokio::net::TcpStream;

use super::prefixed::Prefixed;
use super::relay::Leg;
use super::stream::ClientStream;
use crate::route::TlsFiles;

/// Largest PEM file read (a CA bundle during a rotation holds a few certificates).
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// The process' one TLS provider (ring), named explicitly rather than installed globally.
pub fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: LazyLock<Arc<CryptoProvider>> =
        LazyLock::new(|| Arc::new(rustls::crypto::ring::default_provider()));
    PROVIDER.clone()
}

/// Why TLS material could not be loaded.
#[derive(Debug, Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A file is larger than [`MAX_PEM_BYTES`].
    #[error("{}: larger than {MAX_PEM_BYTES} bytes", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// A file holds no PEM block of the kind expected, or a malformed one.
    #[error("{}: {detail}", path.display())]
    Pem {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        detail: String,
    },
    /// The private key is not the certificate's.
    #[error("{} does not match the certificate in {}: {detail}", key.display(), certificate.display())]
    KeyMismatch {
        /// The certificate file.
        certificate: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls' words.
        detail: String,
    },
    /// rustls refused the material (an unsupported key type, a CA it cannot use).
    #[error("{}: {detail}", path.display())]
    Refused {
        /// The file at fault.
        path: PathBuf,
        /// rustls' words.
        detail: String,
    },
}

impl TlsError {
    /// The metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            TlsError::Read { .. } => "read",
            TlsError::TooLarge { .. } => "too_large",
            TlsError::Pem { .. } => "pem",
            TlsError::KeyMismatch { .. } => "key_mismatch",
            TlsError::Refused { .. } => "refused",
        }
    }
}

/// The contents of a [`TlsFiles`] set, as read at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TlsBytes {
    /// The certificate chain PEM.
    pub certificate: Vec<u8>,
    /// The private key PEM.
    pub key: Vec<u8>,
    /// The client CA bundle PEM.
    pub client_ca: Vec<u8>,
}

/// Reads the three files of `files`.
pub fn read(files: &TlsFiles) -> Result<TlsBytes, TlsError> {
    Ok(TlsBytes {
        certificate: read_one(&files.certificate_file)?,
        key: read_one(&files.key_file)?,
        client_ca: read_one(&files.client_ca_file)?,
    })
}

fn read_one(path: &Path) -> Result<Vec<u8>, TlsError> {
    use std::io::Read;
    let err = |source| TlsError::Read {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(err)?;
    let mut bytes = Vec::new();
    file.take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(err)?;
    if bytes.len() as u64 > MAX_PEM_BYTES {
        return Err(TlsError::TooLarge {
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}

/// Builds the server config for `bytes` (read from `files`, which name the errors): the
/// chain and key presented, a client certificate required that chains to the CA bundle,
/// TLS 1.2 and 1.3, no session resumption.
pub fn server_config(files: &TlsFiles, bytes: &TlsBytes) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = provider();
    let pem = |path: &Path, detail: String| TlsError::Pem {
        path: path.to_owned(),
        detail,
    };
    let chain = certificates(&bytes.certificate).map_err(|d| pem(&files.certificate_file, d))?;
    let key = PrivateKeyDer::from_pem_slice(&bytes.key).map_err(|e| {
        pem(
            &files.key_file,
            format!("no private key (PKCS#8, PKCS#1 or SEC1 PEM): {e}"),
        )
    })?;
    let signing = provider
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|e| TlsError::Refused {
            path: files.key_file.clone(),
            detail: e.to_string(),
        })?;
    CertifiedKey::new(chain.clone(), signing)
        .keys_match()
        .map_err(|e| TlsError::KeyMismatch {
            certificate: files.certificate_file.clone(),
            key: files.key_file.clone(),
            detail: e.to_string(),
        })?;
    let cas = certificates(&bytes.client_ca).map_err(|d| pem(&files.client_ca_file, d))?;
    let mut roots = RootCertStore::empty();
    for ca in cas {
        roots.add(ca).map_err(|e| TlsError::Refused {
            path: files.client_ca_file.clone(),
            detail: format!("not a usable CA certificate: {e}"),
        })?;
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| TlsError::Refused {
            path: files.client_ca_file.clone(),
            detail: e.to_string(),
        })?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .and_then(|b| {
            b.with_client_cert_verifier(verifier)
                .with_single_cert(chain, key)
        })
        .map_err(|e| TlsError::Refused {
            path: files.certificate_file.clone(),
            detail: e.to_string(),
        })?;
    // No resumption: a resumed session skips the client certificate check of the config it
    // is resumed on, and each config has its own client CA.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}

/// Every certificate in a PEM file; at least one.
fn certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("malformed PEM: {e}"))?;
    if certs.is_empty() {
        return Err("no CERTIFICATE block".into());
    }
    for (i, cert) in certs.iter().enumerate() {
        if let Err(e) = x509_parser::parse_x509_certificate(cert) {
            return Err(format!(
                "certificate {} is not an X.509 certificate: {e}",
                i + 1
            ));
        }
    }
    Ok(certs)
}

/// A client's TLS stream on a listener that terminates TLS: over the accepted socket, with
/// the bytes read before the handshake (PROXY header, ClientHello) replayed in front.
pub type ServerStream = tokio_rustls::server::TlsStream<Prefixed<TcpStream>>;

impl Leg for ServerStream {}

impl ClientStream for ServerStream {
    fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.get_ref().0.get_ref().local_addr()
    }
}

/// Loads `files` into a server config ([`read`], then [`server_config`]).
pub fn load(files: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    server_config(files, &read(files)?)
}

/// The identities of a certificate (DER): its subject's common names, then its DNS
/// subject alternative names. Empty when it cannot be parsed (a verified leaf always can).
pub fn identities(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let mut names: Vec<String> = cert
        .subject()
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok().map(str::to_owned))
        .collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(dns) = name {
                names.push((*dns).to_owned());
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Pki {
        ca: rcgen::Certificate,
        params: rcgen::CertificateParams,
        ca_key: rcgen::KeyPair,
    }

    fn ca(cn: &str) -> Pki {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let ca = params.self_signed(&ca_key).unwrap();
        Pki { ca, params, ca_key }
    }

    fn leaf(pki: &Pki, cn: &str, sans: &[&str]) -> (String, String) {
        let mut params =
            rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        let key = rcgen::KeyPair::generate().unwrap();
        let issuer = rcgen::Issuer::from_params(&pki.params, &pki.ca_key);
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn files() -> TlsFiles {
        TlsFiles {
            certificate_file: "tls.crt".into(),
            key_file: "tls.key".into(),
            client_ca_file: "ca.crt".into(),
        }
    }

    #[test]
    fn builds_from_matching_material_and_names_the_file_at_fault() {
        let pki = ca("vpn");
        let (cert, key) = leaf(&pki, "vpn-seed-server", &["vpn-seed-server"]);
        let good = TlsBytes {
            certificate: cert.clone().into_bytes(),
            key: key.into_bytes(),
            client_ca: pki.ca.pem().into_bytes(),
        };
        server_config(&files(), &good).unwrap();

        // Another certificate's key.
        let (_, other_key) = leaf(&pki, "other", &[]);
        let bad = TlsBytes {
            key: other_key.into_bytes(),
            ..good.clone()
        };
        let e = server_config(&files(), &bad).unwrap_err();
        assert!(matches!(e, TlsError::KeyMismatch { .. }), "{e}");

        // No CA in the bundle; garbage as the certificate.
        let e = server_config(
            &files(),
            &TlsBytes {
                client_ca: b"nothing".to_vec(),
                ..good.clone()
            },
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("ca.crt: "), "{e}");
        let e = server_config(
            &files(),
            &TlsBytes {
                certificate: b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
                    .to_vec(),
                ..good
            },
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("tls.crt: "), "{e}");
    }

    #[test]
    fn identities_are_the_common_name_then_dns_names() {
        let pki = ca("vpn");
        let (cert, _) = leaf(
            &pki,
            "kube-apiserver-http-proxy",
            &["a.example", "b.example"],
        );
        let der = CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
        assert_eq!(
            identities(&der),
            vec!["kube-apiserver-http-proxy", "a.example", "b.example"]
        );
        assert!(identities(b"garbage").is_empty());
    }
}
