//! What a shoot's ManagedResource delivers, per type: pure rendering from the shoot's
//! `Cluster` and the Extension's `providerConfig`, no I/O, no tokio, no kube client.
//!
//! The node role (`trellis-node`) delivers a `MutatingWebhookConfiguration` that sends the
//! shoot's `apiserver-proxy` DaemonSet to the extension, and the `kube-system` ConfigMap
//! whose `node.yaml` the mutated DaemonSet runs with. Gardener facts (v1.149):
//! - upstream: `api.<internal domain>` port 8443, as gardenlet's `ProxySeedServerHost`
//!   (`outOfClusterAPIServerFQDN()`, the internal domain preferred) and
//!   `vpnseedserver.HTTPProxyGatewayPort`; the Cluster's Shoot carries it as
//!   `status.advertisedAddresses[name=internal].url` (`https://api.<internal domain>`).
//! - destination: `outbound|443||kube-apiserver.<ns>.svc.cluster.local`, or
//!   `<ns>--kube-apiserver-socket` when Istio terminates TLS (`computeResourcesData` in
//!   `pkg/component/networking/apiserverproxy/apiserver_proxy.go`), which gardenlet decides
//!   as feature gate `IstioTLSTermination` (Beta, default on) and not the Shoot annotation
//!   `shoot.gardener.cloud/disable-istio-tls-termination` parsed true
//!   (`ShootUsesIstioTLSTermination`, `IsShootIstioTLSTerminationEnabled`). The extension
//!   cannot see gardenlet's gates: `providerConfig.istioTLSTermination` says it (default
//!   `true`, the gate's default).
//! - address family: Envoy resolves `V6_ONLY` for IPv6 single-stack shoots, else `V4_ONLY`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use base64::Engine as _;
use serde_json::{Value, json};

use super::mutate::apiserver_proxy;
use super::role::Target;
use super::state::NodeShoot;

/// Why a shoot's objects could not be rendered: said in the Extension's `lastError`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RenderError(pub String);

/// What the node role's objects are rendered from.
#[derive(Debug, Clone)]
pub struct NodeInput<'a> {
    /// The extension's namespace (the webhook Service's).
    pub extension_namespace: &'a str,
    /// The webhook Service's name.
    pub service: &'a str,
    /// The shoot's namespace in the seed (`shoot--<project>--<name>`).
    pub shoot_namespace: &'a str,
    /// The CA bundle (PEM) the shoot's API server verifies the webhook with.
    pub ca_bundle: &'a str,
    /// The image of the `trellis node` container.
    pub image: &'a str,
    /// The `Cluster` object of the shoot (its `spec.shoot` is the Shoot).
    pub cluster: &'a Value,
    /// The Extension's `spec.providerConfig`, if any.
    pub provider_config: Option<&'a Value>,
}

/// The objects for the shoot (applied there by gardener-resource-manager) and what the
/// webhook needs.
#[derive(Debug, Clone)]
pub struct Rendered {
    /// The objects, each a complete manifest (apiVersion, kind, metadata).
    pub objects: Vec<Value>,
    /// What the `apiserver-proxy` webhook writes.
    pub node: NodeShoot,
}

/// The name of the `MutatingWebhookConfiguration` in the shoot.
pub const WEBHOOK_CONFIGURATION: &str = "trellis-node";
/// The name of its one webhook.
pub const WEBHOOK: &str = "apiserver-proxy.trellis.gardener.cloud";
/// The ConfigMap (in the shoot's `kube-system`) with `node.yaml`.
pub const CONFIG_MAP: &str = "trellis-node-config";
/// The key of the config in the ConfigMap.
pub const CONFIG_KEY: &str = "node.yaml";
/// The port of the seed's API server endpoint that relays CONNECTs (Gardener's
/// `vpnseedserver.HTTPProxyGatewayPort`).
pub const UPSTREAM_PORT: u16 = 8443;
/// The Shoot annotation that turns Istio TLS termination off for one shoot.
pub const DISABLE_TLS_TERMINATION: &str = "shoot.gardener.cloud/disable-istio-tls-termination";
/// How long the node drains on SIGTERM: inside the pod's default grace period of 30 s
/// (Gardener's DaemonSet sets none).
pub const DRAIN: &str = "25s";

/// The node role's `providerConfig` (every field optional; unknown fields refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeProviderConfig {
    /// Whether gardenlet runs with its feature gate `IstioTLSTermination` on (default
    /// `true`, the gate's default in Gardener v1.149). With it on, a shoot without the
    /// annotation `shoot.gardener.cloud/disable-istio-tls-termination: "true"` is reached
    /// through `<ns>--kube-apiserver-socket`.
    pub istio_tls_termination: bool,
}

impl Default for NodeProviderConfig {
    fn default() -> Self {
        NodeProviderConfig {
            istio_tls_termination: true,
        }
    }
}

/// The `apiVersion` a `providerConfig` may carry.
pub const PROVIDER_CONFIG_API_VERSION: &str = "trellis.gardener.cloud/v1alpha1";
/// The `kind` a `providerConfig` may carry.
pub const PROVIDER_CONFIG_KIND: &str = "NodeProviderConfig";

impl NodeProviderConfig {
    /// Parses `providerConfig` (`None`: defaults); an unknown field or a wrong type is an
    /// error naming its path (`providerConfig.foo: unknown field`).
    pub fn parse(v: Option<&Value>) -> Result<Self, RenderError> {
        let mut config = NodeProviderConfig::default();
        let Some(v) = v else { return Ok(config) };
        let Some(map) = v.as_object() else {
            return Err(RenderError("providerConfig: expected an object".into()));
        };
        for (key, value) in map {
            match key.as_str() {
                "apiVersion" => expect_text(key, value, PROVIDER_CONFIG_API_VERSION)?,
                "kind" => expect_text(key, value, PROVIDER_CONFIG_KIND)?,
                "istioTLSTermination" => {
                    config.istio_tls_termination = value.as_bool().ok_or_else(|| {
                        RenderError(format!("providerConfig.{key}: expected true or false"))
                    })?;
                }
                _ => {
                    return Err(RenderError(format!(
                        "providerConfig.{key}: unknown field (known: apiVersion, kind, istioTLSTermination)"
                    )));
                }
            }
        }
        Ok(config)
    }
}

fn expect_text(key: &str, value: &Value, want: &str) -> Result<(), RenderError> {
    if value.as_str() == Some(want) {
        Ok(())
    } else {
        Err(RenderError(format!(
            "providerConfig.{key}: expected {want:?}, got {value}"
        )))
    }
}

/// What the node's config is made of, read from the Cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFacts {
    /// `api.<internal domain>` (no port, no trailing dot).
    pub upstream_host: String,
    /// The CONNECT destination.
    pub destination: String,
    /// The shoot is IPv6 single-stack (`spec.networking.ipFamilies: [IPv6]`).
    pub ipv6_only: bool,
}

/// Reads what the node's config needs from the `Cluster` of the shoot in `shoot_namespace`.
pub fn node_facts(
    cluster: &Value,
    shoot_namespace: &str,
    provider: &NodeProviderConfig,
) -> Result<NodeFacts, RenderError> {
    let Some(shoot) = cluster.pointer("/spec/shoot").filter(|s| s.is_object()) else {
        return Err(RenderError("cluster: spec.shoot missing".into()));
    };
    let addresses = shoot
        .pointer("/status/advertisedAddresses")
        .and_then(Value::as_array);
    let Some(url) = addresses
        .into_iter()
        .flatten()
        .find(|a| a.get("name").and_then(Value::as_str) == Some("internal"))
        .and_then(|a| a.get("url"))
    else {
        return Err(RenderError(
            "cluster: spec.shoot.status.advertisedAddresses has no entry named internal (not yet reconciled, or a shoot without an internal domain)".into(),
        ));
    };
    let host = url
        .as_str()
        .and_then(|u| u.strip_prefix("https://"))
        .unwrap_or_default();
    if host.is_empty()
        || !host.starts_with("api.")
        || !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
    {
        return Err(RenderError(format!(
            "cluster: spec.shoot.status.advertisedAddresses[internal].url {url}: expected https://api.<internal domain>"
        )));
    }
    let annotations = shoot.pointer("/metadata/annotations");
    let disabled = annotations
        .and_then(|a| a.get(DISABLE_TLS_TERMINATION))
        .and_then(Value::as_str)
        .is_some_and(|v| parse_go_bool(v) == Some(true));
    let destination = if provider.istio_tls_termination && !disabled {
        format!("{shoot_namespace}--kube-apiserver-socket")
    } else {
        format!("outbound|443||kube-apiserver.{shoot_namespace}.svc.cluster.local")
    };
    let families = shoot
        .pointer("/spec/networking/ipFamilies")
        .and_then(Value::as_array);
    let ipv6_only = families.is_some_and(|f| f.len() == 1 && f[0].as_str() == Some("IPv6"));
    Ok(NodeFacts {
        upstream_host: host.trim_end_matches('.').to_owned(),
        destination,
        ipv6_only,
    })
}

/// Go's `strconv.ParseBool` (what Gardener reads the annotation with; an invalid value is
/// false there, `None` here).
fn parse_go_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// The `node.yaml` for `facts`: no `listen` and no `interface.address` (the DaemonSet's
/// `--advertise-address` supplies both).
pub fn node_yaml(facts: &NodeFacts) -> String {
    let q = |s: &str| Value::String(s.to_owned()).to_string();
    let mut out = String::new();
    let _ = write!(
        out,
        "# Rendered by the trellis extension for the shoot's apiserver-proxy DaemonSet.\n\
         # listen and interface.address: from `trellis node --advertise-address`.\n\
         apiVersion: {PROVIDER_CONFIG_API_VERSION}\n\
         kind: NodeConfiguration\n\
         interface:\n  name: {}\n\
         upstream:\n  address: {}\n  protocol: http-connect\n  destination: {}\n  ipFamily: {}\n\
         admin:\n  address: {}\n\
         timeouts:\n  drain: {DRAIN}\n",
        apiserver_proxy::NAME,
        q(&format!("{}:{UPSTREAM_PORT}", facts.upstream_host)),
        q(&facts.destination),
        if facts.ipv6_only { "v6" } else { "v4" },
        q(if facts.ipv6_only {
            "[::]:16910"
        } else {
            "0.0.0.0:16910"
        }),
    );
    out
}

/// The hex SHA-256 of a ConfigMap's `data`: each key and value in key order, each followed
/// by a NUL byte.
pub fn config_digest(data: &BTreeMap<String, String>) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for (k, v) in data {
        ctx.update(k.as_bytes());
        ctx.update(&[0]);
        ctx.update(v.as_bytes());
        ctx.update(&[0]);
    }
    ctx.finish()
        .as_ref()
        .iter()
        .fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// Renders the node role's objects: the `MutatingWebhookConfiguration` and the
/// `kube-system` ConfigMap with `node.yaml`.
pub fn node(input: &NodeInput<'_>) -> Result<Rendered, RenderError> {
    let provider = NodeProviderConfig::parse(input.provider_config)?;
    let facts = node_facts(input.cluster, input.shoot_namespace, &provider)?;
    if input.ca_bundle.trim().is_empty() {
        return Err(RenderError("no CA bundle for the webhook".into()));
    }
    let data = BTreeMap::from([(CONFIG_KEY.to_owned(), node_yaml(&facts))]);
    let digest = config_digest(&data);
    let labels = json!({"app.kubernetes.io/managed-by": "gardener-extension-trellis"});
    let config_map = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIG_MAP, "namespace": apiserver_proxy::NAMESPACE, "labels": labels},
        "data": data,
    });
    let url = format!(
        "https://{}.{}:443{}",
        input.service,
        input.extension_namespace,
        Target::ApiserverProxy.path(input.shoot_namespace)
    );
    let webhooks = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": WEBHOOK_CONFIGURATION, "labels": labels},
        "webhooks": [{
            "name": WEBHOOK,
            "clientConfig": {
                "url": url,
                "caBundle": base64::engine::general_purpose::STANDARD.encode(input.ca_bundle),
            },
            "rules": [{
                "apiGroups": ["apps"],
                "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"],
                "resources": ["daemonsets"],
                "scope": "Namespaced",
            }],
            "namespaceSelector": {"matchLabels": {"gardener.cloud/purpose": "kube-system"}},
            "objectSelector": {"matchLabels": {"app": "kubernetes", "role": "apiserver-proxy"}},
            "failurePolicy": Target::ApiserverProxy.failure_policy().name(),
            "matchPolicy": "Equivalent",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 5,
            "reinvocationPolicy": "IfNeeded",
        }],
    });
    Ok(Rendered {
        objects: vec![webhooks, config_map],
        node: NodeShoot {
            image: input.image.to_owned(),
            config_map: CONFIG_MAP.to_owned(),
            config_digest: digest,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn cluster(annotations: Value, families: Value) -> Value {
        json!({
            "apiVersion": "extensions.gardener.cloud/v1alpha1",
            "kind": "Cluster",
            "metadata": {"name": "shoot--dev--alpha"},
            "spec": {
                "cloudProfile": {}, "seed": {},
                "shoot": {
                    "apiVersion": "core.gardener.cloud/v1beta1",
                    "kind": "Shoot",
                    "metadata": {"name": "alpha", "namespace": "garden-dev", "annotations": annotations},
                    "spec": {"networking": {"type": "calico", "ipFamilies": families}},
                    "status": {"advertisedAddresses": [
                        {"name": "external", "url": "https://api.alpha.dev.example.com"},
                        {"name": "internal", "url": "https://api.alpha.dev.internal.example.com"},
                    ]},
                },
            },
        })
    }

    fn input<'a>(cluster: &'a Value, provider: Option<&'a Value>) -> NodeInput<'a> {
        NodeInput {
            extension_namespace: "extension-trellis-x1",
            service: "gardener-extension-trellis",
            shoot_namespace: "shoot--dev--alpha",
            ca_bundle: "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
            image: "ghcr.io/gardener/trellis:v1",
            cluster,
            provider_config: provider,
        }
    }

    #[test]
    fn destination_follows_gardeners_rule() {
        let ns = "shoot--dev--alpha";
        let socket = format!("{ns}--kube-apiserver-socket");
        let outbound = format!("outbound|443||kube-apiserver.{ns}.svc.cluster.local");
        let on = NodeProviderConfig::default();
        let off = NodeProviderConfig {
            istio_tls_termination: false,
        };
        let v4 = json!(["IPv4"]);
        for (annotations, provider, want) in [
            (json!({}), on, &socket),
            (json!({DISABLE_TLS_TERMINATION: "true"}), on, &outbound),
            (json!({DISABLE_TLS_TERMINATION: "True"}), on, &outbound),
            (json!({DISABLE_TLS_TERMINATION: "false"}), on, &socket),
            (json!({DISABLE_TLS_TERMINATION: "nonsense"}), on, &socket),
            (json!({}), off, &outbound),
        ] {
            let f = node_facts(&cluster(annotations.clone(), v4.clone()), ns, &provider)
                .expect("facts");
            assert_eq!(&f.destination, want, "{annotations} {provider:?}");
            assert_eq!(f.upstream_host, "api.alpha.dev.internal.example.com");
            assert!(!f.ipv6_only);
        }
        let f = node_facts(&cluster(json!({}), json!(["IPv6"])), ns, &on).expect("facts");
        assert!(f.ipv6_only);
        let f = node_facts(&cluster(json!({}), json!(["IPv6", "IPv4"])), ns, &on).expect("facts");
        assert!(!f.ipv6_only);
    }

    #[test]
    fn provider_config_refuses_unknown_fields_by_path() {
        let c = cluster(json!({}), json!(["IPv4"]));
        let bad = json!({"apiVersion": PROVIDER_CONFIG_API_VERSION, "foo": 1});
        let e = node(&input(&c, Some(&bad))).expect_err("unknown field");
        assert!(e.0.starts_with("providerConfig.foo: unknown field"), "{e}");
        let bad = json!({"istioTLSTermination": "yes"});
        let e = node(&input(&c, Some(&bad))).expect_err("wrong type");
        assert!(
            e.0.starts_with("providerConfig.istioTLSTermination: expected"),
            "{e}"
        );
        let bad = json!({"kind": "Other"});
        assert!(node(&input(&c, Some(&bad))).is_err());
        let good = json!({"apiVersion": PROVIDER_CONFIG_API_VERSION, "kind": PROVIDER_CONFIG_KIND, "istioTLSTermination": false});
        let r = node(&input(&c, Some(&good))).expect("rendered");
        let yaml = r.objects[1]["data"][CONFIG_KEY].as_str().expect("yaml");
        assert!(yaml.contains("outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local"));
    }

    #[test]
    fn missing_cluster_data_says_what() {
        let e = node(&input(&json!({"spec": {}}), None)).expect_err("no shoot");
        assert!(e.0.contains("spec.shoot missing"), "{e}");
        let mut c = cluster(json!({}), json!(["IPv4"]));
        c["spec"]["shoot"]["status"]["advertisedAddresses"] =
            json!([{"name": "external", "url": "https://api.x"}]);
        let e = node(&input(&c, None)).expect_err("no internal");
        assert!(e.0.contains("no entry named internal"), "{e}");
        c["spec"]["shoot"]["status"]["advertisedAddresses"] =
            json!([{"name": "internal", "url": "http://api.x"}]);
        let e = node(&input(&c, None)).expect_err("bad url");
        assert!(e.0.contains("expected https://api."), "{e}");
    }

    #[test]
    fn webhook_configuration_and_digest() {
        let c = cluster(json!({}), json!(["IPv4"]));
        let r = node(&input(&c, None)).expect("rendered");
        let w = &r.objects[0]["webhooks"][0];
        assert_eq!(
            w["clientConfig"]["url"],
            "https://gardener-extension-trellis.extension-trellis-x1:443/shoot/shoot--dev--alpha/apiserver-proxy"
        );
        let ca = base64::engine::general_purpose::STANDARD
            .decode(w["clientConfig"]["caBundle"].as_str().expect("caBundle"))
            .expect("base64");
        assert!(ca.starts_with(b"-----BEGIN CERTIFICATE-----"));
        assert_eq!(w["failurePolicy"], "Ignore");
        assert_eq!(w["sideEffects"], "None");
        assert_eq!(w["rules"][0]["operations"], json!(["CREATE", "UPDATE"]));
        assert_eq!(w["rules"][0]["resources"], json!(["daemonsets"]));
        assert_eq!(
            w["objectSelector"]["matchLabels"],
            json!({"app": "kubernetes", "role": "apiserver-proxy"})
        );
        assert_eq!(
            w["namespaceSelector"]["matchLabels"],
            json!({"gardener.cloud/purpose": "kube-system"})
        );
        let cm = &r.objects[1];
        assert_eq!(cm["metadata"]["namespace"], "kube-system");
        assert_eq!(cm["metadata"]["name"], r.node.config_map);
        // The digest is of the data: a different destination changes it.
        let data: BTreeMap<String, String> =
            serde_json::from_value(cm["data"].clone()).expect("data");
        assert_eq!(r.node.config_digest, config_digest(&data));
        assert_eq!(r.node.config_digest.len(), 64);
        let off = json!({"istioTLSTermination": false});
        let r2 = node(&input(&c, Some(&off))).expect("rendered");
        assert_ne!(r.node.config_digest, r2.node.config_digest);
        // SHA-256 of two NUL bytes (an empty key and value), from Python's hashlib.
        let empty = BTreeMap::from([(String::new(), String::new())]);
        assert_eq!(
            config_digest(&empty),
            "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7"
        );
        assert!(!crate::extension::mutate::contains_key_material(&json!(
            r.objects
        )));
    }
}
