//! What the extension tests share: the golden files under `tests/data/extension/`, the
//! shoot's Cluster and what the node role renders from it.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::Value;
use trellis::extension::render::{self, NodeInput, Rendered};
use trellis::extension::role::ExtensionType;
use trellis::extension::state::Shoot;

/// `tests/data/extension/<name>`.
pub(crate) fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/extension")
        .join(name)
}

/// A JSON file of `tests/data/extension/`.
pub(crate) fn json(name: &str) -> Value {
    let text = std::fs::read_to_string(data(name)).expect("golden file readable");
    serde_json::from_str(&text).expect("golden file is JSON")
}

/// The node role rendered for the shoot of `cluster.json` (with `provider_config`).
pub(crate) fn rendered_with(cluster: &Value, provider_config: Option<&Value>) -> Rendered {
    render::node(&NodeInput {
        extension_namespace: "extension-trellis-x1",
        service: "gardener-extension-trellis",
        shoot_namespace: "shoot--dev--alpha",
        ca_bundle: "-----BEGIN CERTIFICATE-----\nMIIBtest\n-----END CERTIFICATE-----\n",
        image: "ghcr.io/gardener/trellis:v0.9.0",
        cluster,
        provider_config,
    })
    .expect("the golden Cluster renders")
}

/// The node role rendered for `cluster.json` with no providerConfig.
pub(crate) fn rendered() -> Rendered {
    rendered_with(&json("cluster.json"), None)
}

/// The rendered ConfigMap's `node.yaml`.
pub(crate) fn node_yaml(r: &Rendered) -> String {
    r.objects
        .iter()
        .find(|o| o["kind"] == "ConfigMap")
        .and_then(|cm| cm["data"]["node.yaml"].as_str())
        .expect("a ConfigMap with node.yaml")
        .to_owned()
}

/// A shoot with `trellis-node` configured and labelled, and the webhook's data of `r`.
pub(crate) fn enabled_shoot(r: &Rendered) -> Shoot {
    Shoot {
        configured: BTreeSet::from([ExtensionType::Node]),
        labelled: BTreeSet::from([ExtensionType::Node]),
        node: Some(r.node.clone()),
    }
}
