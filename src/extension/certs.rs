//! The extension's own CA and the webhook server's certificate (rcgen, ECDSA P-256), kept in
//! two Secrets of the extension's namespace and renewed without a restart.
//!
//! The pure part, [`plan`], decides from `now` and the Secrets' current PEMs what to
//! generate; the I/O part, [`check`] and [`run`], reads and writes the Secrets with
//! optimistic concurrency (a `409` re-reads and decides again, so replicas converge on one
//! writer's material) and publishes what is stored ([`Published`]): the served
//! [`CertifiedKey`] (new handshakes get it, open connections keep theirs) and the CA bundle
//! the webhook configurations carry.
//!
//! The rules, every time taken from the certificates themselves (a CA's *creation* is its
//! `notBefore` plus [`BACKDATE`]):
//! - a signing CA that is missing, unreadable or expired is replaced: while the served
//!   server certificate is still valid and its CA still in the bundle, the new CA is only
//!   announced as *next* (the server certificate kept) and promoted as in a rotation; only
//!   when nothing valid can be served are both replaced at once (logged as a warning);
//! - at [`RENEW_PERCENT`] of the signing CA's life a *next* CA is generated and put into the
//!   bundle, but nothing is signed with it yet, so API servers learn it before they meet it;
//! - [`PROMOTE_AFTER`] after its creation the next CA becomes the signing CA (the
//!   *rotation*) and the server certificate is re-signed by it;
//! - a CA that is neither signing nor next stays in the bundle until `caOverlap` after the
//!   rotation, and never once expired;
//! - the server certificate (for `<service>`, `<service>.<ns>`, `<service>.<ns>.svc`) is
//!   renewed at [`RENEW_PERCENT`] of its life, when it is not signed by the signing CA, when
//!   its names or key do not match, and never outlives its CA.
//!
//! Never logged or counted: keys.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwapOption;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::sync::watch;

use super::metrics::{CertificateLabel, ExtensionMetrics};
use crate::config::extension::ExtensionConfig;

/// The CA Secret: `ca.crt`/`ca.key` (signing), `next.crt`/`next.key` (while a rotation is
/// announced), `bundle.crt` (every CA trusted now).
pub const CA_SECRET: &str = "trellis-extension-ca";
/// The server certificate's Secret (`kubernetes.io/tls`: `tls.crt`, `tls.key`).
pub const SERVER_SECRET: &str = "trellis-extension-server";
/// Share of its life after which a CA gets a successor and a server certificate is renewed.
pub const RENEW_PERCENT: u32 = 80;
/// How far `notBefore` is set back from the moment of creation (clocks of API servers that
/// lag a little still accept a new certificate).
pub const BACKDATE: Duration = Duration::from_secs(5 * 60);
/// How long a next CA is only announced (in the bundle, signing nothing) before it signs:
/// time for the controller to re-render the webhook configurations and for them to reach
/// the API servers.
pub const PROMOTE_AFTER: Duration = Duration::from_secs(10 * 60);
/// Attempts of one check when writes conflict.
const ATTEMPTS: usize = 5;

/// What the certificates are made for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The extension's namespace (of the Secrets and the Service).
    pub namespace: String,
    /// The webhook Service's name.
    pub service: String,
    /// Life of a CA.
    pub ca_validity: Duration,
    /// How long a replaced CA stays in the bundle after the rotation.
    pub ca_overlap: Duration,
    /// Life of a server certificate.
    pub server_validity: Duration,
    /// How often [`run`] checks.
    pub check_interval: Duration,
}

impl Settings {
    /// The settings of `config`.
    pub fn new(config: &ExtensionConfig) -> Settings {
        let c = &config.webhook.certificates;
        Settings {
            namespace: config.namespace.clone(),
            service: config.webhook.service.clone(),
            ca_validity: c.ca_validity,
            ca_overlap: c.ca_overlap,
            server_validity: c.server_validity,
            check_interval: c.check_interval,
        }
    }

    /// The server certificate's DNS names.
    pub fn dns_names(&self) -> Vec<String> {
        let (s, ns) = (&self.service, &self.namespace);
        vec![s.clone(), format!("{s}.{ns}"), format!("{s}.{ns}.svc")]
    }
}

/// The CA Secret's contents (PEM).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CaPems {
    /// The signing CA's certificate.
    pub cert: String,
    /// Its key.
    pub key: String,
    /// The announced next CA and its key, during a rotation.
    pub next: Option<(String, String)>,
    /// Every CA trusted now (signing first, then next, then replaced ones).
    pub bundle: String,
}

/// The server certificate's Secret contents (PEM).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerPems {
    /// The certificate.
    pub cert: String,
    /// Its key.
    pub key: String,
}

/// What [`plan`] decided: the contents to store (`None`: keep as is) and the results.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// New CA Secret contents, when they change.
    pub ca_changed: bool,
    /// New server Secret contents, when they change.
    pub server_changed: bool,
    /// The CA material after the plan.
    pub ca: CaPems,
    /// The server material after the plan.
    pub server: ServerPems,
}

/// Why certificates could not be made, read or stored.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// rcgen could not generate or sign.
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// Stored material that should have been valid is not (a just-generated certificate,
    /// the served key).
    #[error("certificate material: {0}")]
    Material(String),
    /// The API server refused or failed a read or a write.
    #[error("Secret {name}: {source}")]
    Api {
        /// The Secret.
        name: &'static str,
        /// kube's error.
        source: Box<kube::Error>,
    },
    /// Writes kept conflicting with another writer.
    #[error("Secrets kept changing under {ATTEMPTS} attempts")]
    Conflicts,
}

/// A certificate's facts the rules read.
struct Parsed {
    not_before: i64,
    not_after: i64,
    subject: Vec<u8>,
    issuer: Vec<u8>,
    common_name: Option<String>,
    dns_names: Vec<String>,
    public_key: Vec<u8>,
}

fn parse_pem(pem: &str) -> Vec<Parsed> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .filter_map(Result::ok)
        .filter_map(|der| parse_der(&der))
        .collect()
}

fn parse_der(der: &[u8]) -> Option<Parsed> {
    let (_, c) = x509_parser::parse_x509_certificate(der).ok()?;
    let dns_names = match c.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                x509_parser::extensions::GeneralName::DNSName(d) => Some((*d).to_owned()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    Some(Parsed {
        not_before: c.validity().not_before.timestamp(),
        not_after: c.validity().not_after.timestamp(),
        subject: c.subject().as_raw().to_vec(),
        issuer: c.issuer().as_raw().to_vec(),
        common_name: c
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .map(str::to_owned),
        dns_names,
        public_key: c.public_key().subject_public_key.data.to_vec(),
    })
}

fn unix(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(_) => 0,
    }
}

fn secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

impl Parsed {
    fn created(&self) -> i64 {
        self.not_before.saturating_add(secs(BACKDATE))
    }

    /// When [`RENEW_PERCENT`] of its life has passed.
    fn renew_at(&self) -> i64 {
        let life = self.not_after.saturating_sub(self.not_before).max(0);
        self.not_before
            + life / 100 * i64::from(RENEW_PERCENT)
            + life % 100 * i64::from(RENEW_PERCENT) / 100
    }
}

/// A CA certificate and key that belong together, or `None`.
fn ca_pair(cert: &str, key: &str) -> Option<(Parsed, KeyPair)> {
    let parsed = parse_pem(cert).into_iter().next()?;
    let key = KeyPair::from_pem(key).ok()?;
    (key.public_key_raw() == parsed.public_key.as_slice()).then_some((parsed, key))
}

/// Decides, at `now`, what the CA and server Secrets must hold given what they hold
/// (`None`: absent or unreadable).
pub fn plan(
    settings: &Settings,
    now: SystemTime,
    ca: Option<&CaPems>,
    server: Option<&ServerPems>,
) -> Result<Plan, CertError> {
    let t = unix(now);
    let mut ca_changed = false;
    let mut out = ca.cloned().unwrap_or_default();
    let signing = ca
        .and_then(|c| ca_pair(&c.cert, &c.key))
        .filter(|(p, _)| p.not_after > t);
    let mut rotated = false;
    if signing.is_none() {
        // No usable signing CA. If the served certificate is still good and its CA is still
        // trusted, keep serving it and only announce a new CA (as `next`, promoted after
        // PROMOTE_AFTER like any rotation): replacing both at once would break TLS for every
        // API server until the new bundle reaches it.
        let next = out
            .next
            .as_ref()
            .and_then(|(c, k)| ca_pair(c, k))
            .filter(|(p, _)| p.not_after > t)
            .map(|(p, _)| p);
        let servable = server.is_some_and(|s| still_servable(settings, t, s, ca));
        match next {
            Some(next) if servable && t < next.created().saturating_add(secs(PROMOTE_AFTER)) => {
                return Ok(announcing(t, out, ca, server, ca_changed));
            }
            Some(_) => {
                // Announced long enough (or nothing valid is served): it signs now.
                if !servable {
                    tracing::warn!(
                        "webhook certificates: the signing CA is unusable and no valid server certificate can be served: the announced next CA signs at once"
                    );
                }
                if let Some((next_cert, next_key)) = out.next.take() {
                    out.cert = next_cert;
                    out.key = next_key;
                }
                ca_changed = true;
                rotated = true;
            }
            None if servable => {
                tracing::warn!(
                    "webhook certificates: the signing CA is unusable: a new CA is announced; the current server certificate is served until it signs"
                );
                out.next = Some(new_ca(settings, now)?);
                return Ok(announcing(t, out, ca, server, true));
            }
            None => {
                tracing::warn!(
                    "webhook certificates: the signing CA is unusable and no valid server certificate can be served: replacing the CA and the server certificate at once (TLS fails until the new bundle reaches the API servers)"
                );
                let (cert, key) = new_ca(settings, now)?;
                out = CaPems {
                    bundle: String::new(),
                    cert,
                    key,
                    next: None,
                };
                ca_changed = true;
                rotated = true;
            }
        }
    } else if let Some((next_cert, next_key)) = out.next.clone() {
        match ca_pair(&next_cert, &next_key) {
            Some((next, _)) if t >= next.created().saturating_add(secs(PROMOTE_AFTER)) => {
                out.cert = next_cert;
                out.key = next_key;
                out.next = None;
                ca_changed = true;
                rotated = true;
            }
            Some(_) => {}
            None => {
                out.next = None;
                ca_changed = true;
            }
        }
    }
    let (signing, signing_key) = ca_pair(&out.cert, &out.key)
        .ok_or_else(|| CertError::Material("the signing CA does not parse".into()))?;
    if out.next.is_none() && t >= signing.renew_at() {
        out.next = Some(new_ca(settings, now)?);
        ca_changed = true;
    }
    // The bundle: signing, next, then the replaced ones still within the overlap.
    let keep_until = signing
        .created()
        .saturating_add(secs(PROMOTE_AFTER))
        .saturating_add(secs(settings.ca_overlap));
    let mut bundle = vec![out.cert.trim_end().to_owned()];
    if let Some((next, _)) = &out.next {
        bundle.push(next.trim_end().to_owned());
    }
    let mut seen: Vec<Vec<u8>> = parse_pem(&bundle.join("\n"))
        .into_iter()
        .map(|p| p.subject)
        .collect();
    if t < keep_until {
        keep_old(&mut bundle, &mut seen, ca, t);
    }
    let bundle = bundle.join("\n") + "\n";
    if bundle != out.bundle {
        out.bundle = bundle;
        ca_changed = true;
    }

    let names = settings.dns_names();
    let current = server.and_then(|s| {
        let p = parse_pem(&s.cert).into_iter().next()?;
        let key = KeyPair::from_pem(&s.key).ok()?;
        let fine = key.public_key_raw() == p.public_key.as_slice()
            && p.issuer == signing.subject
            && p.dns_names == names
            && t < p.renew_at()
            && p.not_after > t;
        fine.then(|| s.clone())
    });
    let (server, server_changed) = match current {
        Some(s) if !rotated => (s, false),
        _ => (new_server(settings, now, &signing, signing_key)?, true),
    };
    Ok(Plan {
        ca_changed,
        server_changed,
        ca: out,
        server,
    })
}

/// Appends to `bundle` the CAs of `ca`'s bundle that are unexpired at `t` and not `seen`.
fn keep_old(bundle: &mut Vec<String>, seen: &mut Vec<Vec<u8>>, ca: Option<&CaPems>, t: i64) {
    let old = ca.map(|c| c.bundle.as_str()).unwrap_or("");
    for der in CertificateDer::pem_slice_iter(old.as_bytes()).filter_map(Result::ok) {
        if let Some(p) = parse_der(&der)
            && p.not_after > t
            && !seen.contains(&p.subject)
        {
            seen.push(p.subject);
            bundle.push(pem_of(&der).trim_end().to_owned());
        }
    }
}

/// Whether `server` can still be served at `t` although no CA can sign: its key is its
/// own, its names are the service's, it has not expired, and its issuer is an unexpired CA
/// of the stored bundle (so API servers still trust it).
fn still_servable(settings: &Settings, t: i64, server: &ServerPems, ca: Option<&CaPems>) -> bool {
    let Some(p) = parse_pem(&server.cert).into_iter().next() else {
        return false;
    };
    let Ok(key) = KeyPair::from_pem(&server.key) else {
        return false;
    };
    key.public_key_raw() == p.public_key.as_slice()
        && p.dns_names == settings.dns_names()
        && p.not_before <= t
        && p.not_after > t
        && ca.is_some_and(|c| {
            parse_pem(&c.bundle)
                .iter()
                .any(|b| b.subject == p.issuer && b.not_after > t)
        })
}

/// The plan while a new CA is announced in place of an unusable signing one: the CA Secret
/// keeps what it holds but for `next` and a bundle of the next CA and the still valid CAs
/// trusted now; the server certificate is kept.
fn announcing(
    t: i64,
    mut out: CaPems,
    ca: Option<&CaPems>,
    server: Option<&ServerPems>,
    mut ca_changed: bool,
) -> Plan {
    let mut bundle: Vec<String> = out
        .next
        .iter()
        .map(|(c, _)| c.trim_end().to_owned())
        .collect();
    let mut seen: Vec<Vec<u8>> = parse_pem(&bundle.join("\n"))
        .into_iter()
        .map(|p| p.subject)
        .collect();
    keep_old(&mut bundle, &mut seen, ca, t);
    let bundle = bundle.join("\n") + "\n";
    if bundle != out.bundle {
        out.bundle = bundle;
        ca_changed = true;
    }
    Plan {
        ca_changed,
        server_changed: false,
        ca: out,
        // Only called when `server` is servable.
        server: server.cloned().unwrap_or(ServerPems {
            cert: String::new(),
            key: String::new(),
        }),
    }
}

fn pem_of(der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut s = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(64) {
        s.push_str(&String::from_utf8_lossy(line));
        s.push('\n');
    }
    s.push_str("-----END CERTIFICATE-----\n");
    s
}

fn at(t: SystemTime, back: Duration) -> Duration {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .saturating_sub(back)
}

fn ca_params(common_name: &str) -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p
}

/// A new CA (certificate, key), created at `now`; its name carries the creation time and a
/// piece of its public key, so that every CA has a subject of its own.
fn new_ca(settings: &Settings, now: SystemTime) -> Result<(String, String), CertError> {
    let key = KeyPair::generate()?;
    let tag: String = key
        .public_key_raw()
        .iter()
        .skip(1)
        .take(4)
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut p = ca_params(&format!("trellis-extension-ca {} {tag}", unix(now)));
    p.not_before = rcgen::date_time_ymd(1970, 1, 1) + at(now, BACKDATE);
    p.not_after = rcgen::date_time_ymd(1970, 1, 1) + at(now, Duration::ZERO) + settings.ca_validity;
    let cert = p.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn new_server(
    settings: &Settings,
    now: SystemTime,
    ca: &Parsed,
    ca_key: KeyPair,
) -> Result<ServerPems, CertError> {
    let cn = ca
        .common_name
        .clone()
        .ok_or_else(|| CertError::Material("the signing CA has no common name".into()))?;
    let issuer = Issuer::new(ca_params(&cn), ca_key);
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::new(settings.dns_names())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, settings.service.as_str());
    p.distinguished_name = dn;
    p.use_authority_key_identifier_extension = true;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let until = at(now, Duration::ZERO) + settings.server_validity;
    let ca_end = Duration::from_secs(u64::try_from(ca.not_after).unwrap_or(0));
    p.not_before = rcgen::date_time_ymd(1970, 1, 1) + at(now, BACKDATE);
    p.not_after = rcgen::date_time_ymd(1970, 1, 1) + until.min(ca_end);
    let cert = p.signed_by(&key, &issuer)?;
    Ok(ServerPems {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// What the webhook server serves and the controller renders, as last stored.
#[derive(Debug)]
pub struct Published {
    key: ArcSwapOption<CertifiedKey>,
    bundle: watch::Sender<String>,
}

impl Published {
    /// Nothing published yet: handshakes fail until the first [`Published::publish`].
    pub fn new() -> Arc<Published> {
        Arc::new(Published {
            key: ArcSwapOption::empty(),
            bundle: watch::Sender::new(String::new()),
        })
    }

    /// The key pair new handshakes get.
    pub fn key(&self) -> Option<Arc<CertifiedKey>> {
        self.key.load_full()
    }

    /// The CA bundle (PEM; empty until the first publish); changes on every new bundle.
    pub fn bundle(&self) -> watch::Receiver<String> {
        self.bundle.subscribe()
    }

    /// Serves `server` to new handshakes and publishes `bundle` when it changed.
    pub fn publish(&self, server: &ServerPems, bundle: &str) -> Result<(), CertError> {
        let key = certified_key(server)?;
        self.key.store(Some(Arc::new(key)));
        self.bundle.send_if_modified(|b| {
            if b == bundle {
                false
            } else {
                bundle.clone_into(b);
                true
            }
        });
        Ok(())
    }
}

/// The rustls key pair of `server` (ring, named explicitly).
pub fn certified_key(server: &ServerPems) -> Result<CertifiedKey, CertError> {
    let bad = |what: &str| CertError::Material(format!("the server {what} does not load"));
    let chain = CertificateDer::pem_slice_iter(server.cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| bad("certificate"))?;
    let key = PrivateKeyDer::from_pem_slice(server.key.as_bytes()).map_err(|_| bad("key"))?;
    let signing = crate::net::tls::provider()
        .key_provider
        .load_private_key(key)
        .map_err(|_| bad("key"))?;
    let ck = CertifiedKey::new(chain, signing);
    ck.keys_match().map_err(|_| bad("key pair"))?;
    Ok(ck)
}

fn text(s: &Secret, key: &str) -> Option<String> {
    let data = s.data.as_ref()?.get(key)?;
    String::from_utf8(data.0.clone()).ok()
}

fn ca_of(s: &Secret) -> Option<CaPems> {
    Some(CaPems {
        // A missing signing CA is replaced, but the bundle API servers trust is still read.
        cert: text(s, "ca.crt").unwrap_or_default(),
        key: text(s, "ca.key").unwrap_or_default(),
        next: text(s, "next.crt").zip(text(s, "next.key")),
        bundle: text(s, "bundle.crt").unwrap_or_default(),
    })
}

fn server_of(s: &Secret) -> Option<ServerPems> {
    Some(ServerPems {
        cert: text(s, "tls.crt")?,
        key: text(s, "tls.key")?,
    })
}

fn secret(
    name: &str,
    namespace: &str,
    current: Option<&Secret>,
    type_: &str,
    data: &[(&str, &str)],
) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            resource_version: current.and_then(|c| c.metadata.resource_version.clone()),
            labels: Some(
                [(
                    "app.kubernetes.io/managed-by".to_owned(),
                    "trellis-extension".to_owned(),
                )]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        type_: Some(type_.to_owned()),
        data: Some(
            data.iter()
                .map(|(k, v)| ((*k).to_owned(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        ),
        ..Secret::default()
    }
}

/// What a write came to.
enum Wrote {
    Done,
    Conflict,
}

async fn write(
    api: &Api<Secret>,
    name: &'static str,
    current: Option<&Secret>,
    new: Secret,
) -> Result<Wrote, CertError> {
    let result = match current {
        None => api.create(&PostParams::default(), &new).await,
        Some(_) => api.replace(name, &PostParams::default(), &new).await,
    };
    match result {
        Ok(_) => Ok(Wrote::Done),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(Wrote::Conflict),
        Err(e) => Err(CertError::Api {
            name,
            source: Box::new(e),
        }),
    }
}

/// One check at `now`: reads both Secrets, writes what [`plan`] changes (re-reading on a
/// conflict) and returns what is stored.
pub async fn check(
    api: &Api<Secret>,
    settings: &Settings,
    now: SystemTime,
    metrics: &ExtensionMetrics,
) -> Result<Plan, CertError> {
    let read = |name: &'static str| async move {
        api.get_opt(name).await.map_err(|e| CertError::Api {
            name,
            source: Box::new(e),
        })
    };
    for _ in 0..ATTEMPTS {
        let ca_secret = read(CA_SECRET).await?;
        let server_secret = read(SERVER_SECRET).await?;
        let ca = ca_secret.as_ref().and_then(ca_of);
        let server = server_secret.as_ref().and_then(server_of);
        let p = plan(settings, now, ca.as_ref(), server.as_ref())?;
        if p.ca_changed {
            let mut data = vec![
                ("ca.crt", p.ca.cert.as_str()),
                ("ca.key", p.ca.key.as_str()),
                ("bundle.crt", p.ca.bundle.as_str()),
            ];
            if let Some((c, k)) = &p.ca.next {
                data.extend([("next.crt", c.as_str()), ("next.key", k.as_str())]);
            }
            let new = secret(
                CA_SECRET,
                &settings.namespace,
                ca_secret.as_ref(),
                "Opaque",
                &data,
            );
            if let Wrote::Conflict = write(api, CA_SECRET, ca_secret.as_ref(), new).await? {
                continue;
            }
            if ca.as_ref().map(|c| &c.cert) != Some(&p.ca.cert) {
                count_rotation(metrics, "ca");
            }
        }
        if p.server_changed {
            let data = [
                ("tls.crt", p.server.cert.as_str()),
                ("tls.key", p.server.key.as_str()),
            ];
            let new = secret(
                SERVER_SECRET,
                &settings.namespace,
                server_secret.as_ref(),
                "kubernetes.io/tls",
                &data,
            );
            if let Wrote::Conflict = write(api, SERVER_SECRET, server_secret.as_ref(), new).await? {
                continue;
            }
            count_rotation(metrics, "server");
        }
        for (label, pem) in [("ca", &p.ca.cert), ("server", &p.server.cert)] {
            if let Some(c) = parse_pem(pem).first() {
                #[expect(
                    clippy::cast_precision_loss,
                    reason = "Unix seconds fit a float's mantissa"
                )]
                let when = c.not_after as f64;
                metrics
                    .expiry
                    .get_or_create(&CertificateLabel { certificate: label })
                    .set(when);
            }
        }
        return Ok(p);
    }
    Err(CertError::Conflicts)
}

fn count_rotation(metrics: &ExtensionMetrics, certificate: &'static str) {
    metrics
        .rotations
        .get_or_create(&CertificateLabel { certificate })
        .inc();
}

/// [`check`] now and publish; the first call the integrator awaits before serving.
pub async fn check_and_publish(
    api: &Api<Secret>,
    settings: &Settings,
    published: &Published,
    metrics: &ExtensionMetrics,
) -> Result<(), CertError> {
    let p = check(api, settings, SystemTime::now(), metrics).await?;
    published.publish(&p.server, &p.ca.bundle)
}

/// Checks every `check_interval` (failures counted, logged and retried at the next check)
/// until `stop` completes.
pub async fn run(
    api: Api<Secret>,
    settings: Settings,
    published: Arc<Published>,
    metrics: Arc<ExtensionMetrics>,
    stop: impl std::future::Future<Output = ()>,
) {
    let mut stop = std::pin::pin!(stop);
    loop {
        if let Err(e) = check_and_publish(&api, &settings, &published, &metrics).await {
            metrics.certificate_errors.inc();
            tracing::warn!(error = %e, "webhook certificates: check failed; retried at the next");
        }
        tokio::select! {
            () = tokio::time::sleep(settings.check_interval) => {}
            () = &mut stop => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(24 * 3600);
    const HOUR: Duration = Duration::from_secs(3600);

    fn settings() -> Settings {
        Settings {
            namespace: "garden-trellis".into(),
            service: "gardener-extension-trellis".into(),
            ca_validity: 30 * DAY,
            ca_overlap: DAY,
            server_validity: 7 * DAY,
            check_interval: Duration::from_secs(60),
        }
    }

    fn t0() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_800_000_000)
    }

    fn subjects(bundle: &str) -> Vec<Vec<u8>> {
        parse_pem(bundle).into_iter().map(|p| p.subject).collect()
    }

    fn subject(pem: &str) -> Vec<u8> {
        parse_pem(pem).remove(0).subject
    }

    fn issuer(pem: &str) -> Vec<u8> {
        parse_pem(pem).remove(0).issuer
    }

    /// Steps `plan` from `from` to `to` every `step`, feeding each result back.
    fn step(p: Plan, from: SystemTime, to: SystemTime, every: Duration) -> Plan {
        let (mut p, mut t) = (p, from);
        while t < to {
            t += every;
            p = plan(&settings(), t, Some(&p.ca), Some(&p.server)).unwrap();
        }
        p
    }

    #[test]
    fn a_first_plan_makes_a_ca_and_a_server_certificate_for_the_service() {
        let p = plan(&settings(), t0(), None, None).unwrap();
        assert!(p.ca_changed && p.server_changed);
        let server = parse_pem(&p.server.cert).remove(0);
        assert_eq!(
            server.dns_names,
            [
                "gardener-extension-trellis",
                "gardener-extension-trellis.garden-trellis",
                "gardener-extension-trellis.garden-trellis.svc"
            ]
        );
        assert_eq!(server.issuer, subject(&p.ca.cert));
        assert_eq!(subjects(&p.ca.bundle), [subject(&p.ca.cert)]);
        assert_eq!(
            server.not_after - server.not_before,
            secs(7 * DAY + BACKDATE)
        );
        // Nothing to do a minute later.
        let again = plan(
            &settings(),
            t0() + Duration::from_secs(60),
            Some(&p.ca),
            Some(&p.server),
        )
        .unwrap();
        assert!(!again.ca_changed && !again.server_changed);
        assert_eq!(again.ca, p.ca);
    }

    #[test]
    fn a_rotation_announces_promotes_and_drops_the_old_ca_after_the_overlap() {
        let first = plan(&settings(), t0(), None, None).unwrap();
        let old = subject(&first.ca.cert);
        // Just before 80 %: one CA.
        let before = step(first.clone(), t0(), t0() + 24 * DAY - HOUR, HOUR);
        assert!(before.ca.next.is_none());
        assert_eq!(subjects(&before.ca.bundle), std::slice::from_ref(&old));
        // At 80 %: the next CA is announced, nothing signed by it yet.
        let announced = step(before, t0() + 24 * DAY - HOUR, t0() + 24 * DAY, HOUR);
        let (next_cert, _) = announced.ca.next.clone().unwrap();
        let next = subject(&next_cert);
        assert_eq!(subjects(&announced.ca.bundle), [old.clone(), next.clone()]);
        assert_eq!(subject(&announced.ca.cert), old);
        assert_eq!(issuer(&announced.server.cert), old);
        // PROMOTE_AFTER later: it signs, the server certificate is re-signed by it, and the
        // bundle holds both.
        let t_rot = t0() + 24 * DAY + PROMOTE_AFTER;
        let rotated = step(announced, t0() + 24 * DAY, t_rot, Duration::from_secs(60));
        assert_eq!(subject(&rotated.ca.cert), next);
        assert!(rotated.ca.next.is_none());
        assert_eq!(issuer(&rotated.server.cert), next);
        assert_eq!(subjects(&rotated.ca.bundle), [next.clone(), old.clone()]);
        // Within the overlap: both.
        let during = step(rotated, t_rot, t_rot + DAY - HOUR, HOUR);
        assert_eq!(subjects(&during.ca.bundle), [next.clone(), old]);
        // 24 h after the rotation: the old one is gone.
        let after = step(during, t_rot + DAY - HOUR, t_rot + DAY + HOUR, HOUR);
        assert_eq!(subjects(&after.ca.bundle), [next]);
    }

    #[test]
    fn a_server_certificate_is_renewed_at_80_percent_and_never_outlives_its_ca() {
        let first = plan(&settings(), t0(), None, None).unwrap();
        let p = plan(
            &settings(),
            t0() + Duration::from_secs(5 * 24 * 3600),
            Some(&first.ca),
            Some(&first.server),
        )
        .unwrap();
        assert!(!p.server_changed);
        // 80 % of 7 d and the backdate: 134.4 h after notBefore, 5 min before t0.
        let before = t0() + Duration::from_secs(134 * 3600);
        let p = plan(&settings(), before, Some(&first.ca), Some(&first.server)).unwrap();
        assert!(!p.server_changed);
        let t = t0() + Duration::from_secs(135 * 3600);
        let p = plan(&settings(), t, Some(&first.ca), Some(&first.server)).unwrap();
        assert!(p.server_changed && !p.ca_changed);
        let s = parse_pem(&p.server.cert).remove(0);
        let ca = parse_pem(&p.ca.cert).remove(0);
        assert!(s.not_after <= ca.not_after);
    }

    #[test]
    fn broken_or_foreign_material_is_replaced() {
        let first = plan(&settings(), t0(), None, None).unwrap();
        let other = plan(&settings(), t0(), None, None).unwrap();
        // A server certificate of another CA, a key of another certificate, other names.
        let foreign = plan(&settings(), t0(), Some(&first.ca), Some(&other.server)).unwrap();
        assert!(foreign.server_changed);
        let mixed = ServerPems {
            cert: first.server.cert.clone(),
            key: other.server.key.clone(),
        };
        assert!(
            plan(&settings(), t0(), Some(&first.ca), Some(&mixed))
                .unwrap()
                .server_changed
        );
        let mut renamed = settings();
        renamed.service = "other".into();
        assert!(
            plan(&renamed, t0(), Some(&first.ca), Some(&first.server))
                .unwrap()
                .server_changed
        );
        // A CA whose key is not its own and no server certificate it trusts: a new CA
        // signing at once.
        let bad = CaPems {
            key: other.ca.key.clone(),
            ..first.ca.clone()
        };
        for server in [None, Some(&other.server)] {
            let p = plan(&settings(), t0(), Some(&bad), server).unwrap();
            assert!(p.ca_changed && p.server_changed);
            assert_ne!(subject(&p.ca.cert), subject(&first.ca.cert));
            assert_eq!(issuer(&p.server.cert), subject(&p.ca.cert));
            assert!(certified_key(&p.server).is_ok());
        }
    }

    #[test]
    fn an_unusable_ca_with_a_valid_server_certificate_is_replaced_by_announcing_first() {
        let first = plan(&settings(), t0(), None, None).unwrap();
        let other = plan(&settings(), t0(), None, None).unwrap();
        let old = subject(&first.ca.cert);
        let t1 = t0() + DAY;
        for broken in [
            // A key that is not the CA's.
            CaPems {
                key: other.ca.key.clone(),
                ..first.ca.clone()
            },
            // Garbage in both.
            CaPems {
                cert: "garbage".into(),
                key: "garbage".into(),
                ..first.ca.clone()
            },
        ] {
            // The served certificate is kept; a new CA is only announced, next to the one
            // that issued it.
            let p = plan(&settings(), t1, Some(&broken), Some(&first.server)).unwrap();
            assert!(p.ca_changed && !p.server_changed);
            assert_eq!(p.server, first.server);
            let (next_cert, _) = p.ca.next.clone().unwrap();
            let next = subject(&next_cert);
            assert_ne!(next, old);
            assert_eq!(subjects(&p.ca.bundle), [next.clone(), old.clone()]);
            // Just before PROMOTE_AFTER: still announced, nothing re-signed, nothing changed.
            let t_wait = t1 + PROMOTE_AFTER - Duration::from_secs(60);
            let waiting = step(p, t1, t_wait, Duration::from_secs(60));
            assert_eq!(waiting.server, first.server);
            assert_eq!(subjects(&waiting.ca.bundle), [next.clone(), old.clone()]);
            let again = plan(
                &settings(),
                t_wait,
                Some(&waiting.ca),
                Some(&waiting.server),
            )
            .unwrap();
            assert!(!again.ca_changed && !again.server_changed);
            // PROMOTE_AFTER after the announcement: it signs, the server certificate is
            // re-signed, and the old CA stays in the bundle for the overlap.
            let promoted = step(waiting, t_wait, t1 + PROMOTE_AFTER, Duration::from_secs(60));
            assert_eq!(subject(&promoted.ca.cert), next);
            assert!(promoted.ca.next.is_none());
            assert_eq!(issuer(&promoted.server.cert), next);
            assert_eq!(subjects(&promoted.ca.bundle), [next.clone(), old.clone()]);
            assert!(certified_key(&promoted.server).is_ok());
        }
    }

    #[test]
    fn an_unusable_ca_with_nothing_valid_to_serve_is_replaced_at_once() {
        let first = plan(&settings(), t0(), None, None).unwrap();
        let other = plan(&settings(), t0(), None, None).unwrap();
        // Expired: the CA (30 d) and with it the server certificate (7 d).
        let t = t0() + 31 * DAY;
        let p = plan(&settings(), t, Some(&first.ca), Some(&first.server)).unwrap();
        assert!(p.ca_changed && p.server_changed && p.ca.next.is_none());
        assert_eq!(issuer(&p.server.cert), subject(&p.ca.cert));
        assert_eq!(subjects(&p.ca.bundle), [subject(&p.ca.cert)]);
        let broken = CaPems {
            key: other.ca.key.clone(),
            ..first.ca.clone()
        };
        // A broken CA key and an expired server certificate (7 d).
        let t = t0() + 8 * DAY;
        let p = plan(&settings(), t, Some(&broken), Some(&first.server)).unwrap();
        assert!(p.ca_changed && p.server_changed && p.ca.next.is_none());
        assert_eq!(issuer(&p.server.cert), subject(&p.ca.cert));
        // A valid server certificate whose CA is not in the bundle.
        let unknown = CaPems {
            bundle: other.ca.bundle.clone(),
            ..broken.clone()
        };
        let p = plan(&settings(), t0() + DAY, Some(&unknown), Some(&first.server)).unwrap();
        assert!(p.ca_changed && p.server_changed && p.ca.next.is_none());
        assert_ne!(subject(&p.ca.cert), subject(&first.ca.cert));
        assert_eq!(issuer(&p.server.cert), subject(&p.ca.cert));
        // A missing server certificate.
        let p = plan(&settings(), t0() + DAY, Some(&broken), None).unwrap();
        assert!(p.server_changed && p.ca.next.is_none());
    }
}
