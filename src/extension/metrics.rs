//! The extension's metric families (`trellis_extension_*`): admissions per webhook target and
//! result, requests and connections the webhook server refused, and when its certificates
//! expire. Registered into the process's registry by [`ExtensionMetrics::register`]; labels
//! are fixed strings (targets, results, reasons), never paths, namespaces or addresses.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::admin::metrics::listed;

/// `target`, `result` labels of `trellis_extension_admissions_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabels {
    /// The webhook target (`apiserver-proxy`).
    pub target: &'static str,
    /// What the review decided: a [`super::mutate::Decision::result`], `denied_caller`,
    /// `callers_unknown` (no kube-apiserver pod of the namespace known: admitted unchanged),
    /// `failed` (a handler failure) or `no_object`.
    pub result: &'static str,
}

/// `reason` label of `trellis_extension_rejections_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// See [`Rejection`].
    pub reason: &'static str,
}

/// `certificate` label of `trellis_extension_certificate_expiry_timestamp_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CertificateLabel {
    /// `ca` (the signing CA) or `server`.
    pub certificate: &'static str,
}

/// Why the webhook server refused a request or a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// A path that is no webhook's (404).
    NotFound,
    /// A method other than `POST` (405).
    Method,
    /// A body over the limit (413).
    TooLarge,
    /// A body that is not an `admission.k8s.io/v1` AdmissionReview with a request (400).
    NotAReview,
    /// The TLS handshake did not finish within its deadline.
    HandshakeTimeout,
    /// The TLS handshake failed.
    HandshakeFailed,
    /// A request (head, body and answer) did not finish within its deadline.
    RequestTimeout,
    /// A connection closed at once because the server held its most connections.
    Limited,
}

impl Rejection {
    /// The `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Rejection::NotFound => "not_found",
            Rejection::Method => "method",
            Rejection::TooLarge => "too_large",
            Rejection::NotAReview => "not_a_review",
            Rejection::HandshakeTimeout => "handshake_timeout",
            Rejection::HandshakeFailed => "handshake_failed",
            Rejection::RequestTimeout => "request_timeout",
            Rejection::Limited => "limited",
        }
    }
}

/// The extension's families.
#[derive(Debug)]
pub struct ExtensionMetrics {
    /// `trellis_extension_admissions_total{target,result}`.
    pub admissions: Family<AdmissionLabels, Counter>,
    /// `trellis_extension_rejections_total{reason}`.
    pub rejections: Family<ReasonLabel, Counter>,
    /// `trellis_extension_review_duration_seconds`: from a request's head read to its answer
    /// written into the connection (body read, review, encoding).
    pub review_duration: Histogram,
    /// `trellis_extension_connections_active`.
    pub connections: Gauge,
    /// `trellis_extension_certificate_expiry_timestamp_seconds{certificate}`: when the
    /// signing CA and the served certificate expire (Unix time).
    pub expiry: Family<CertificateLabel, Gauge<f64, AtomicU64>>,
    /// `trellis_extension_certificate_rotations_total{certificate}`: CAs and server
    /// certificates this process generated and stored.
    pub rotations: Family<CertificateLabel, Counter>,
    /// `trellis_extension_certificate_errors_total`: certificate checks that failed (API
    /// errors, unreadable Secrets); retried at the next check.
    pub certificate_errors: Counter,
}

impl Default for ExtensionMetrics {
    fn default() -> Self {
        ExtensionMetrics {
            admissions: Family::default(),
            rejections: Family::default(),
            // 50 µs .. ~1.6 s.
            review_duration: Histogram::new(exponential_buckets(0.00005, 2.0, 16)),
            connections: Gauge::default(),
            expiry: Family::default(),
            rotations: Family::default(),
            certificate_errors: Counter::default(),
        }
    }
}

impl ExtensionMetrics {
    /// New handles, registered nowhere yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers every family under `trellis_extension_` in `registry` (the process's root
    /// registry, before it is shared).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("trellis_extension");
        listed(
            r,
            "admissions",
            "AdmissionReviews answered, by webhook target and result",
            self.admissions.clone(),
        );
        listed(
            r,
            "rejections",
            "Requests and connections the webhook server refused, by reason",
            self.rejections.clone(),
        );
        listed(
            r,
            "review_duration_seconds",
            "From a webhook request's head read to its answer",
            self.review_duration.clone(),
        );
        listed(
            r,
            "connections_active",
            "Webhook server connections open now",
            self.connections.clone(),
        );
        listed(
            r,
            "certificate_expiry_timestamp_seconds",
            "When the signing CA and the served certificate expire (Unix time)",
            self.expiry.clone(),
        );
        listed(
            r,
            "certificate_rotations",
            "CAs and server certificates generated and stored by this process",
            self.rotations.clone(),
        );
        listed(
            r,
            "certificate_errors",
            "Certificate checks that failed (retried at the next check)",
            self.certificate_errors.clone(),
        );
    }

    /// Counts an answered review.
    pub fn admission(&self, target: &'static str, result: &'static str) {
        self.admissions
            .get_or_create(&AdmissionLabels { target, result })
            .inc();
    }

    /// Counts a refusal.
    pub fn reject(&self, why: Rejection) {
        self.rejections
            .get_or_create(&ReasonLabel {
                reason: why.as_str(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_named_before_their_first_series() {
        let mut registry = Registry::default();
        let m = ExtensionMetrics::new();
        m.register(&mut registry);
        m.admission("apiserver-proxy", "denied_caller");
        m.reject(Rejection::TooLarge);
        let mut text = String::new();
        assert!(prometheus_client::encoding::text::encode(&mut text, &registry).is_ok());
        for want in [
            "trellis_extension_admissions_total{target=\"apiserver-proxy\",result=\"denied_caller\"} 1",
            "trellis_extension_rejections_total{reason=\"too_large\"} 1",
            "# TYPE trellis_extension_certificate_expiry_timestamp_seconds gauge",
            "# TYPE trellis_extension_certificate_rotations counter",
        ] {
            assert!(text.contains(want), "{want} missing in\n{text}");
        }
    }
}
