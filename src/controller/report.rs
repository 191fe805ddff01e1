//! What a translation saw and left out ([`Report`]): objects per kind, routes rendered,
//! every skip with its [`Reason`] and every network an object wrote with host bits set
//! ([`Normalised`]), for `render`'s stderr, the controller's logs and its metrics. Filled by every translation step; pure data, no I/O.

use std::collections::BTreeMap;

use serde::Serialize;

/// Why something was not routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Istio terminates the shoot's TLS; it falls through to the fallback.
    L7,
    /// Another, older object claims the same key.
    Conflict,
    /// The destination has no ready endpoint; for a shoot's egress, its kube-apiserver has
    /// no endpoint address at all.
    NoEndpoints,
    /// The namespace is being deleted.
    NamespaceDeleting,
    /// The destination Service or its port does not exist.
    NoService,
    /// An HTTPS host that is not a shoot API server (left to the fallback).
    Https,
    /// A shape trellis does not translate (several destinations, a host outside the cluster,
    /// a cross-namespace or non-Service backend).
    Unsupported,
    /// A source allow-list (RBAC EnvoyFilter) trellis cannot enforce exactly as Envoy does:
    /// the route admits fewer clients, or the traffic is not routed, or (server names left
    /// to the fallback) not enforced.
    AclUnsupported,
    /// A shoot without tunnel peers (no peers Secret, or none of its peers usable): no
    /// tunnel and no egress route.
    NoTunnelPeers,
    /// A tunnel peer left out: its key or addresses are not valid.
    InvalidPeer,
    /// A shoot whose egress server certificate or client CA bundle is missing: no egress.
    NoEgressTls,
}

impl Reason {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::L7 => "l7",
            Reason::Conflict => "conflict",
            Reason::NoEndpoints => "no_endpoints",
            Reason::NamespaceDeleting => "namespace_deleting",
            Reason::NoService => "no_service",
            Reason::Https => "https",
            Reason::Unsupported => "unsupported",
            Reason::AclUnsupported => "acl_unsupported",
            Reason::NoTunnelPeers => "no_tunnel_peers",
            Reason::InvalidPeer => "invalid_peer",
            Reason::NoEgressTls => "no_egress_tls",
        }
    }
}

/// One thing not routed, with the object it comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skip {
    /// Why.
    pub reason: Reason,
    /// `Kind namespace/name` of the object.
    pub object: String,
    /// What exactly.
    pub detail: String,
}

/// A network an object wrote with host bits set, which translation used with them cleared
/// (a shoot is not failed for it; a typo may have widened what its network admits or
/// reaches, and the operator is told).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Normalised {
    /// `Kind namespace/name` of the object (`Cluster name` for a cluster-scoped one).
    pub object: String,
    /// The field, in the object.
    pub field: String,
    /// The network as written.
    pub given: String,
    /// The network used.
    pub used: String,
}

/// What a translation saw and left out: for logs and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// Objects in the snapshot, per kind.
    pub objects: BTreeMap<&'static str, usize>,
    /// Routes rendered (the fallback included).
    pub routes: usize,
    /// Skips per reason.
    pub skipped: BTreeMap<Reason, usize>,
    /// Every skip, in the order found.
    pub skips: Vec<Skip>,
    /// Every network used with its host bits cleared, in the order found (left out of the
    /// JSON when there is none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub normalised: Vec<Normalised>,
}

impl Report {
    /// The skips per reason as the metrics label them, for a log line: `l7=3
    /// no_endpoints=1`, or `none`.
    pub fn skipped_text(&self) -> String {
        if self.skipped.is_empty() {
            return "none".into();
        }
        let counts: Vec<String> = self
            .skipped
            .iter()
            .map(|(reason, n)| format!("{}={n}", reason.as_str()))
            .collect();
        counts.join(" ")
    }

    /// Records the networks `object` wrote with host bits set.
    pub(super) fn normalised(&mut self, object: &str, host_bits: &[super::model::HostBits]) {
        self.normalised.extend(host_bits.iter().map(|h| Normalised {
            object: object.to_owned(),
            field: h.field.clone(),
            given: h.given.clone(),
            used: h.used.to_string(),
        }));
    }

    /// Records one skip.
    pub(super) fn skip(&mut self, reason: Reason, object: String, detail: impl Into<String>) {
        *self.skipped.entry(reason).or_default() += 1;
        self.skips.push(Skip {
            reason,
            object,
            detail: detail.into(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log line names the reasons as the metrics and `render`'s report do (`no_endpoints`),
    /// never as Rust writes the enum (`NoEndpoints`).
    #[test]
    fn skipped_text_uses_the_metric_labels() {
        let mut report = Report::default();
        assert_eq!(report.skipped_text(), "none");
        report.skip(
            Reason::NoEndpoints,
            "Service a/b".into(),
            "no ready endpoint",
        );
        report.skip(Reason::L7, "Gateway a/c".into(), "terminates TLS");
        report.skip(
            Reason::NoEndpoints,
            "Service a/d".into(),
            "no ready endpoint",
        );
        assert_eq!(report.skipped_text(), "l7=1 no_endpoints=2");
    }
}
