//! What a shoot's ManagedResource delivers, per type: pure rendering from the shoot's
//! `Cluster` and the Extension's `providerConfig`, no I/O.
//!
//! INTERFACE (filled in by the mutation work; the controller calls only these).

use serde_json::Value;

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

/// Renders the node role's objects: the `MutatingWebhookConfiguration` and the
/// `kube-system` ConfigMap with `node.yaml`.
pub fn node(input: &NodeInput<'_>) -> Result<Rendered, RenderError> {
    let _ = input;
    Err(RenderError("not rendered yet".into()))
}
