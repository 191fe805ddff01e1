//! The API kinds the controller reads: where the API server serves each one. The live watch
//! ([`super::watch`], cargo feature `controller`) opens one watcher per entry, and the
//! ClusterRoles in `deploy/seed/` grant list and watch on exactly these (group,
//! resource) pairs, checked against this list by the deploy tests. The kinds only the
//! shoots' tunnels need (Clusters, Secrets) are watched only when the configuration turns
//! tunnels on ([`WatchedKind::is_watched`]). Secrets are watched only
//! through label selectors, one watch per selector: the controller never lists every Secret
//! of a seed (RBAC cannot say so; the selectors here do). No Kubernetes client here: the
//! list is data, available in every build.

/// A kind the controller watches: where the API serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchedKind {
    /// API group; empty for the core group.
    pub group: &'static str,
    /// The versions translation reads, preferred first: the watch takes the first one the
    /// API server serves (discovery at start).
    pub versions: &'static [&'static str],
    /// Kind, as objects name it.
    pub kind: &'static str,
    /// Resource name in the API's paths (what RBAC rules name).
    pub plural: &'static str,
    /// The label selector of the watch (`key=value,key in (a,b)`); `None`: every object.
    pub selector: Option<&'static str>,
    /// Read only for the shoots' tunnels: watched only when the configuration turns them on.
    pub tunnel: bool,
    /// Objects per page of the watch's lists; `None`: the client's default (500).
    pub page_size: Option<u32>,
}

impl WatchedKind {
    /// Whether a controller watches this kind, with tunnels on or off.
    pub fn is_watched(&self, tunnels: bool) -> bool {
        tunnels || !self.tunnel
    }

    /// `group/version`, or `version` for the core group.
    pub fn api_version(&self, version: &str) -> String {
        if self.group.is_empty() {
            version.to_owned()
        } else {
            format!("{}/{version}", self.group)
        }
    }
}

/// Istio's Gateway, VirtualService and DestinationRule: `v1`, or `v1beta1` on seeds whose
/// Istio predates it (the fields translation reads are the same in both).
const ISTIO: &[&str] = &["v1", "v1beta1"];

/// The Secrets of tunnel peers ([`super::model::TUNNEL_PEERS_LABEL`]).
pub const TUNNEL_PEERS_SELECTOR: &str = "trellis.gardener.cloud/role=tunnel-peers";

/// Objects per page when Clusters are listed: each embeds the shoot's Shoot, Seed and
/// CloudProfile and can approach 1.5 MiB (a CloudProfile with many machine images and
/// versions), so a page of the client's default 500 could be hundreds of MiB in one
/// response, held whole by the API server and the controller; 20 keep a page near 30 MiB.
pub const CLUSTER_PAGE_SIZE: u32 = 20;

/// Gardener's secrets-manager Secrets an egress route is made of: the `vpn-seed-server`
/// server certificate and the `ca-vpn` bundle, as gardenlet's secrets manager labels them.
pub const EGRESS_TLS_SELECTOR: &str =
    "managed-by=secrets-manager,manager-identity=gardenlet,name in (ca-vpn-bundle,vpn-seed-server)";

/// Every kind translation reads, in [`super::model::Snapshot::counts`] order (a kind watched
/// through several selectors counts once, after its last watch).
pub const WATCHED: [WatchedKind; 11] = [
    kind("networking.istio.io", ISTIO, "Gateway", "gateways"),
    kind(
        "networking.istio.io",
        ISTIO,
        "VirtualService",
        "virtualservices",
    ),
    kind(
        "networking.istio.io",
        ISTIO,
        "DestinationRule",
        "destinationrules",
    ),
    // Istio serves EnvoyFilter only as v1alpha3. Whole objects: the ACL extension's RBAC
    // filters carry the source allow-lists in their spec.
    kind(
        "networking.istio.io",
        &["v1alpha3"],
        "EnvoyFilter",
        "envoyfilters",
    ),
    kind("", &["v1"], "Service", "services"),
    kind(
        "discovery.k8s.io",
        &["v1"],
        "EndpointSlice",
        "endpointslices",
    ),
    kind("", &["v1"], "Namespace", "namespaces"),
    // The standard channel serves v1; clusters with only the experimental channel of older
    // Gateway API releases serve v1alpha2 (or v1alpha3).
    kind(
        "gateway.networking.k8s.io",
        &["v1", "v1alpha3", "v1alpha2"],
        "TLSRoute",
        "tlsroutes",
    ),
    // Cluster-scoped, one per shoot namespace: the shoot's networks for its tunnel. Large:
    // listed in small pages.
    WatchedKind {
        page_size: Some(CLUSTER_PAGE_SIZE),
        ..tunnel(kind(
            "extensions.gardener.cloud",
            &["v1alpha1"],
            "Cluster",
            "clusters",
        ))
    },
    tunnel(selected(
        "",
        &["v1"],
        "Secret",
        "secrets",
        TUNNEL_PEERS_SELECTOR,
    )),
    tunnel(selected(
        "",
        &["v1"],
        "Secret",
        "secrets",
        EGRESS_TLS_SELECTOR,
    )),
];

/// The kinds a controller watches, tunnels on or off, in [`WATCHED`] order.
pub fn watched(tunnels: bool) -> impl Iterator<Item = &'static WatchedKind> {
    WATCHED.iter().filter(move |k| k.is_watched(tunnels))
}

const fn kind(
    group: &'static str,
    versions: &'static [&'static str],
    kind: &'static str,
    plural: &'static str,
) -> WatchedKind {
    WatchedKind {
        group,
        versions,
        kind,
        plural,
        selector: None,
        tunnel: false,
        page_size: None,
    }
}

/// `kind`, read only for the shoots' tunnels.
const fn tunnel(kind: WatchedKind) -> WatchedKind {
    WatchedKind {
        tunnel: true,
        ..kind
    }
}

/// A kind watched only through `selector`.
const fn selected(
    group: &'static str,
    versions: &'static [&'static str],
    kind: &'static str,
    plural: &'static str,
    selector: &'static str,
) -> WatchedKind {
    WatchedKind {
        selector: Some(selector),
        ..self::kind(group, versions, kind, plural)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::model::Snapshot;

    #[test]
    fn kinds_are_in_snapshot_order() {
        let mut names: Vec<_> = WATCHED.iter().map(|k| k.kind).collect();
        names.dedup();
        let counts: Vec<_> = Snapshot::default().counts().map(|c| c.0).to_vec();
        assert_eq!(names, counts);
    }

    #[test]
    fn secrets_are_only_watched_through_a_selector() {
        for k in WATCHED.iter().filter(|k| k.kind == "Secret") {
            assert!(k.selector.is_some_and(|s| !s.is_empty()), "{k:?}");
        }
        assert_eq!(WATCHED.iter().filter(|k| k.kind == "Secret").count(), 2);
    }

    /// Without tunnels no Secret and no Cluster is read: nothing the tunnels' RBAC grants.
    #[test]
    fn only_tunnels_read_secrets_and_clusters() {
        let off: Vec<&str> = watched(false).map(|k| k.kind).collect();
        assert!(
            !off.contains(&"Secret") && !off.contains(&"Cluster"),
            "{off:?}"
        );
        assert_eq!(off.len(), WATCHED.len() - 3);
        assert_eq!(watched(true).count(), WATCHED.len());
    }

    /// Clusters, and only they, are listed in small pages.
    #[test]
    fn clusters_are_listed_in_small_pages() {
        for k in WATCHED {
            let expected = (k.kind == "Cluster").then_some(CLUSTER_PAGE_SIZE);
            assert_eq!(k.page_size, expected, "{k:?}");
        }
    }

    #[test]
    fn api_versions() {
        assert_eq!(WATCHED[4].api_version("v1"), "v1");
        assert_eq!(WATCHED[5].api_version("v1"), "discovery.k8s.io/v1");
    }
}
