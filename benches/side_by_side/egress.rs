//! The egress jobs' certificates and TLS client, shaped like Gardener's kube-apiserver
//! egress to vpn-seed-server: per shoot a CA with CN `vpn`, a server certificate with CN
//! `vpn-seed-server` and a client certificate with CN `kube-apiserver-http-proxy`, all with
//! 2048-bit RSA keys as Gardener's secrets manager makes them. It writes files and builds
//! client configurations; it never opens a connection.
//!
//! Layout of a PKI directory: `r{i}/ca.crt`, `r{i}/tls.crt`, `r{i}/tls.key`,
//! `r{i}/client.crt`, `r{i}/client.key` for each route `i`.
//!
//! RSA key generation is slow (`openssl genpkey`, ~0.1–0.3 s per key here), so the keys are
//! made once and kept in a cache directory: every CA has a key of its own, while the leaf
//! keys are shared (route 0's server and client keys; every route still reads its own key
//! file). Neither a handshake's cost nor a route's memory depends on which key a leaf holds.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SerialNumber,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// The name every kube-apiserver sends and checks (SNI and server certificate).
pub const SERVER_NAME: &str = "vpn-seed-server";

/// The per-route server name of route `i` in a many-route PKI.
pub fn route_server_name(i: usize) -> String {
    format!("vpn-seed-server.shoot--bench--r{i}")
}

/// Route `i`'s directory in the PKI at `dir`.
pub fn route_dir(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("r{i}"))
}

/// `n` RSA-2048 keys (PKCS#8 PEM) from `cache`, generating the missing ones with openssl
/// (two at a time).
fn keys(cache: &Path, n: usize) -> std::io::Result<Vec<String>> {
    std::fs::create_dir_all(cache)?;
    let path = |i: usize| cache.join(format!("rsa2048-{i}.pem"));
    let missing: Vec<usize> = (0..n).filter(|&i| !path(i).exists()).collect();
    if !missing.is_empty() {
        eprintln!(
            "generating {} RSA-2048 keys into {} (once; they are kept) ...",
            missing.len(),
            cache.display()
        );
    }
    for pair in missing.chunks(2) {
        let children: Vec<_> = pair
            .iter()
            .map(|&i| {
                let tmp = path(i).with_extension("tmp");
                let child = std::process::Command::new("openssl")
                    .args(["genpkey", "-algorithm", "RSA", "-pkeyopt"])
                    .args(["rsa_keygen_bits:2048", "-out"])
                    .arg(&tmp)
                    .stderr(std::process::Stdio::null())
                    .spawn();
                (i, tmp, child)
            })
            .collect();
        for (i, tmp, child) in children {
            if !child?.wait()?.success() {
                return Err(std::io::Error::other("openssl genpkey failed"));
            }
            std::fs::rename(tmp, path(i))?;
        }
    }
    (0..n).map(|i| std::fs::read_to_string(path(i))).collect()
}

/// Writes a PKI of `routes` routes into `dir` (see the module documentation), with keys from
/// `cache`. With more than one route, route `i`'s server certificate also names
/// [`route_server_name`]`(i)`.
pub fn generate(dir: &Path, routes: usize, cache: &Path) -> std::io::Result<()> {
    let fail = |e: rcgen::Error| std::io::Error::other(e.to_string());
    // Key 0: route 0's server key, 1: every client key, 2 + i: route i's CA.
    let keys = keys(cache, 2 + routes)?;
    let server_key = KeyPair::from_pem(&keys[0]).map_err(fail)?;
    let client_key = KeyPair::from_pem(&keys[1]).map_err(fail)?;
    for i in 0..routes {
        let ca_key = KeyPair::from_pem(&keys[2 + i]).map_err(fail)?;
        let mut ca = CertificateParams::default();
        ca.distinguished_name = rcgen::DistinguishedName::new();
        ca.distinguished_name.push(DnType::CommonName, "vpn");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
        ];
        ca.serial_number = Some(SerialNumber::from(3 * i as u64 + 1));
        let ca_cert = ca.self_signed(&ca_key).map_err(fail)?;
        let issuer = Issuer::new(ca, ca_key);

        let mut names = vec![SERVER_NAME.to_string()];
        if routes > 1 {
            names.push(route_server_name(i));
        }
        let mut server = CertificateParams::new(names).map_err(fail)?;
        server.distinguished_name = rcgen::DistinguishedName::new();
        server
            .distinguished_name
            .push(DnType::CommonName, SERVER_NAME);
        server.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        server.use_authority_key_identifier_extension = true;
        server.serial_number = Some(SerialNumber::from(3 * i as u64 + 2));
        let server_cert = server.signed_by(&server_key, &issuer).map_err(fail)?;

        let mut client = CertificateParams::default();
        client.distinguished_name = rcgen::DistinguishedName::new();
        client
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver-http-proxy");
        client.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        client.use_authority_key_identifier_extension = true;
        client.serial_number = Some(SerialNumber::from(3 * i as u64 + 3));
        let client_cert = client.signed_by(&client_key, &issuer).map_err(fail)?;

        let d = route_dir(dir, i);
        std::fs::create_dir_all(&d)?;
        std::fs::write(d.join("ca.crt"), ca_cert.pem())?;
        std::fs::write(d.join("tls.crt"), server_cert.pem())?;
        std::fs::write(d.join("tls.key"), &keys[0])?;
        std::fs::write(d.join("client.crt"), client_cert.pem())?;
        std::fs::write(d.join("client.key"), &keys[1])?;
    }
    Ok(())
}

/// The client side of an egress job: for each route the server name to send and a TLS
/// configuration with that route's CA and client certificate; connections take the routes
/// in turn.
pub struct Client {
    dir: PathBuf,
    routes: Vec<(ServerName<'static>, Arc<rustls::ClientConfig>)>,
    next: AtomicUsize,
}

impl Client {
    /// The client for the PKI at `dir` with `routes` routes: one route sends
    /// [`SERVER_NAME`], as every kube-apiserver does; many send [`route_server_name`].
    /// Session resumption is off, as in kube-apiserver (Go's default).
    pub fn load(dir: &Path, routes: usize) -> std::io::Result<Client> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let fail = |e: &dyn std::fmt::Display| std::io::Error::other(e.to_string());
        let mut out = Vec::with_capacity(routes);
        for i in 0..routes {
            let d = route_dir(dir, i);
            let mut roots = rustls::RootCertStore::empty();
            for ca in CertificateDer::pem_file_iter(d.join("ca.crt")).map_err(|e| fail(&e))? {
                roots.add(ca.map_err(|e| fail(&e))?).map_err(|e| fail(&e))?;
            }
            let chain = CertificateDer::pem_file_iter(d.join("client.crt"))
                .map_err(|e| fail(&e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| fail(&e))?;
            let key = PrivateKeyDer::from_pem_file(d.join("client.key")).map_err(|e| fail(&e))?;
            let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| fail(&e))?
                .with_root_certificates(roots)
                .with_client_auth_cert(chain, key)
                .map_err(|e| fail(&e))?;
            config.resumption = rustls::client::Resumption::disabled();
            let name = if routes == 1 {
                SERVER_NAME.to_string()
            } else {
                route_server_name(i)
            };
            let name = ServerName::try_from(name).map_err(|e| fail(&e))?;
            out.push((name, Arc::new(config)));
        }
        Ok(Client {
            dir: dir.to_path_buf(),
            routes: out,
            next: AtomicUsize::new(0),
        })
    }

    /// The PKI directory it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How many routes it takes in turn.
    pub fn routes(&self) -> usize {
        self.routes.len()
    }

    /// The next route's server name and configuration.
    pub fn next(&self) -> (ServerName<'static>, Arc<rustls::ClientConfig>) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.routes.len();
        self.routes[i].clone()
    }
}

/// trellis's routing table for the PKI at `dir` with `routes` routes, reaching the bench's
/// backend directly: one route chosen by the client address (the listener's certificate);
/// or `routes` routes each chosen by its server name, with its own certificate and CA.
pub fn trellis_routes(dir: &Path, routes: usize) -> String {
    let mut out =
        String::from("apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n");
    let reach = "    allowedNetworks: []\n    directNetworks: [\"127.0.0.0/8\"]\n    via: direct\n";
    if routes == 1 {
        out += "- name: shoot--bench--egress\n  egress:\n    clientSources: [\"127.0.0.1/32\"]\n";
        out += reach;
        return out;
    }
    for i in 0..routes {
        let d = route_dir(dir, i);
        out += &format!(
            "- name: shoot--bench--r{i}\n  egress:\n    serverNames: [\"{}\"]\n    tls: {{certificateFile: \"{}\", keyFile: \"{}\", clientCAFile: \"{}\"}}\n",
            route_server_name(i),
            d.join("tls.crt").display(),
            d.join("tls.key").display(),
            d.join("ca.crt").display(),
        );
        out += reach;
    }
    out
}
