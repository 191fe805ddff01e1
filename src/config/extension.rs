//! `kind: ExtensionConfiguration`: the Gardener extension (`trellis extension`), decoded
//! into [`ExtensionConfig`].
//!
//! The extension runs in the seed, in a namespace of its own (the Helm release's): which
//! Extension types it serves, the image the containers it writes run, where its HTTPS
//! webhook server listens and under which Service name the API servers reach it, how long
//! its CA and server certificates live, and its heartbeat.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::common::Admin;
use super::error::Errors;
use super::load::{ConfigKind, Source};
use super::value::{Address, ApiVersion, Positive, plain, plain_option};

mapping_only!(ExtensionConfig, Webhook, Certificates, Heartbeat);

/// The Extension types trellis knows (`spec.type` of an `Extension`); each is one role.
pub const TYPES: [&str; 1] = ["trellis-node"];

/// The Service the API servers call the webhooks through (`<name>.<namespace>:443`).
pub const DEFAULT_SERVICE: &str = "gardener-extension-trellis";

/// An extension configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct ExtensionConfig {
    /// Always `trellis.gardener.cloud/v1alpha1`.
    pub api_version: ApiVersion,
    /// Always `ExtensionConfiguration`.
    pub kind: String,
    /// Kubeconfig file of the seed (relative to this file); in-cluster configuration (or
    /// `KUBECONFIG`) when absent.
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    /// The extension's own namespace: its Secrets (CA, server certificate), its Lease, its
    /// Service, and the owner of the webhook configurations it registers in the seed.
    pub namespace: String,
    /// The Extension types served (default: every type in [`TYPES`]).
    #[serde(default)]
    pub types: Vec<String>,
    /// The image of the containers the webhooks write (`trellis node`).
    pub image: String,
    /// The HTTPS webhook server.
    pub webhook: Webhook,
    /// Probes and metrics.
    pub admin: Admin,
    /// The heartbeat Lease.
    #[serde(default)]
    pub heartbeat: Heartbeat,
}

/// The webhook server.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct Webhook {
    /// `IP:port` the HTTPS server binds (the Service's target port).
    pub address: Address,
    /// The Service's name (default `gardener-extension-trellis`); the server certificate
    /// holds it, `.<namespace>` and `.<namespace>.svc`.
    #[serde(default = "default_service")]
    pub service: String,
    /// Lifetimes of the CA and the server certificate.
    #[serde(default)]
    pub certificates: Certificates,
}

fn default_service() -> String {
    DEFAULT_SERVICE.to_owned()
}

/// Lifetimes of the extension's own certificates.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase", default)]
pub struct Certificates {
    /// How long a CA is valid (default 720h, 30 days).
    #[serde(deserialize_with = "plain::<Positive, _>")]
    pub ca_validity: Duration,
    /// How long a replaced CA stays in the bundle (default 24h).
    #[serde(deserialize_with = "plain::<Positive, _>")]
    pub ca_overlap: Duration,
    /// How long a server certificate is valid (default 168h); renewed at 80 % of it.
    #[serde(deserialize_with = "plain::<Positive, _>")]
    pub server_validity: Duration,
    /// How often the Secrets are read and renewed when due (default 1m).
    #[serde(deserialize_with = "plain::<Positive, _>")]
    pub check_interval: Duration,
}

impl Default for Certificates {
    fn default() -> Self {
        Certificates {
            ca_validity: Duration::from_secs(30 * 24 * 3600),
            ca_overlap: Duration::from_secs(24 * 3600),
            server_validity: Duration::from_secs(7 * 24 * 3600),
            check_interval: Duration::from_secs(60),
        }
    }
}

/// The Lease `gardener-extension-heartbeat` in the extension's namespace.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase", default)]
pub struct Heartbeat {
    /// How often it is renewed (default 30s).
    #[serde(deserialize_with = "plain_option::<Positive, _>")]
    pub renew_interval: Option<Duration>,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Heartbeat {
            renew_interval: None,
        }
    }
}

impl Heartbeat {
    /// The renew interval (30 s unless written).
    pub fn interval(&self) -> Duration {
        self.renew_interval.unwrap_or(Duration::from_secs(30))
    }
}

impl ConfigKind for ExtensionConfig {
    const KIND: &'static str = "ExtensionConfiguration";
    const READ_BY: &'static str = "'trellis extension'";
    type File = Self;
    type Context<'a> = ();

    fn validate(mut c: ExtensionConfig, source: &Source<'_>, (): (), errors: &mut Errors) -> Self {
        c.api_version.check(errors);
        if let Some(k) = c.kubeconfig.as_mut()
            && k.is_relative()
        {
            *k = source.dir().join(&*k);
        }
        if !dns_label(&c.namespace) {
            errors.push(
                "namespace",
                format!(
                    "expected a namespace name (a DNS label), got {:?}",
                    c.namespace
                ),
            );
        }
        if !dns_label(&c.webhook.service) {
            errors.push(
                "webhook.service",
                format!(
                    "expected a Service name (a DNS label), got {:?}",
                    c.webhook.service
                ),
            );
        }
        if c.image.trim().is_empty() || c.image.contains(char::is_whitespace) {
            errors.push(
                "image",
                format!("expected an image reference, got {:?}", c.image),
            );
        }
        if c.types.is_empty() {
            c.types = TYPES.iter().map(|t| (*t).to_owned()).collect();
        }
        for (i, t) in c.types.iter().enumerate() {
            if !TYPES.contains(&t.as_str()) {
                errors.push(
                    format!("types[{i}]"),
                    format!("unknown Extension type {t:?} (known: {})", TYPES.join(", ")),
                );
            }
        }
        let certs = &c.webhook.certificates;
        if certs.ca_overlap >= certs.ca_validity {
            errors.push(
                "webhook.certificates.caOverlap",
                "must be shorter than caValidity (the old CA must still be valid while it is kept)",
            );
        }
        if certs.server_validity > certs.ca_validity {
            errors.push(
                "webhook.certificates.serverValidity",
                "must not be longer than caValidity",
            );
        }
        c.admin.no_debug_address(
            errors,
            "the extension serves no routing table; only the gateway has a debug endpoint",
        );
        c
    }
}

/// A DNS label (RFC 1123): what namespace and Service names are.
pub fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}
