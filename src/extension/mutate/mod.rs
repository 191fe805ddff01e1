//! The webhooks' mutations: pure functions of the admitted object (raw JSON, unknown fields
//! kept) and the shoot's state. A mutation works on a copy and returns the whole result or
//! nothing; the patch is the difference of the two. No I/O, no tokio, no kube client.
//!
//! The admission handler calls only [`review`].

pub mod apiserver_proxy;

use serde_json::Value;

use super::role::{ExtensionType, Target};
use super::state::Shoot;

/// `result`: the object was changed.
pub const MUTATED: &str = "mutated";
/// `result`: the object is already as the webhook writes it.
pub const UNCHANGED: &str = "unchanged";
/// `result`: the shoot has no configuration for the type or its namespace lacks the label.
pub const NOT_ENABLED: &str = "not_enabled";
/// `result`: the object is of the handled kind and name but not of the shape expected.
pub const UNEXPECTED_SHAPE: &str = "unexpected_shape";
/// `result`: a kind or name the target does not handle.
pub const NOT_HANDLED: &str = "not_handled";

/// What a review decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The JSON patch to return (`None`: admitted unchanged).
    pub patch: Option<json_patch::Patch>,
    /// The `result` label of `trellis_extension_admissions_total`: `mutated`,
    /// `unchanged` (already as the webhook writes it), `not_enabled` (no configuration or
    /// no namespace label), `unexpected_shape`, `not_handled` (a kind or name it does not
    /// handle).
    pub result: &'static str,
    /// A warning for the API server to pass on (`None` for `mutated` and `unchanged`).
    pub warning: Option<String>,
}

impl Decision {
    /// Admitted unchanged with `result` and a warning.
    fn unchanged_with(result: &'static str, warning: String) -> Decision {
        Decision {
            patch: None,
            result,
            warning: Some(warning),
        }
    }
}

/// Decides what `target`'s webhook does with `object` (the review's `request.object`) of
/// the shoot whose state is `shoot`.
pub fn review(target: Target, shoot: Option<&Shoot>, object: &Value) -> Decision {
    match target {
        Target::ApiserverProxy => {
            if !apiserver_proxy::handles(object) {
                return Decision::unchanged_with(
                    NOT_HANDLED,
                    format!(
                        "trellis {}: not the DaemonSet kube-system/{} (apps/v1): admitted unchanged",
                        target.name(),
                        apiserver_proxy::NAME,
                    ),
                );
            }
            let ty = ExtensionType::Node;
            let node = match shoot {
                Some(s) if s.enabled(ty) => s.node.as_ref(),
                _ => None,
            };
            let Some(node) = node else {
                return Decision::unchanged_with(
                    NOT_ENABLED,
                    format!(
                        "trellis {}: {ty} is not configured or not labelled for this shoot: admitted unchanged",
                        target.name()
                    ),
                );
            };
            match apiserver_proxy::mutate(node, object) {
                Err(e) => Decision::unchanged_with(
                    UNEXPECTED_SHAPE,
                    format!("trellis {}: admitted unchanged: {e}", target.name()),
                ),
                Ok(new) => finish(target, object, &new),
            }
        }
    }
}

/// The decision for `old` becoming `new`: unchanged when equal, else the patch, which must
/// never carry key material.
fn finish(target: Target, old: &Value, new: &Value) -> Decision {
    if old == new {
        return Decision {
            patch: None,
            result: UNCHANGED,
            warning: None,
        };
    }
    let patch = json_patch::diff(old, new);
    if patch.0.is_empty() {
        return Decision {
            patch: None,
            result: UNCHANGED,
            warning: None,
        };
    }
    // The node role writes no secrets; a patch that carries one is a bug, refused here.
    if serde_json::to_value(&patch).is_ok_and(|v| contains_key_material(&v)) {
        return Decision::unchanged_with(
            UNEXPECTED_SHAPE,
            format!(
                "trellis {}: refused a patch carrying key material: admitted unchanged",
                target.name()
            ),
        );
    }
    Decision {
        patch: Some(patch),
        result: MUTATED,
        warning: None,
    }
}

/// Whether any string in `v` looks like a PEM private key.
pub fn contains_key_material(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains("PRIVATE KEY"),
        Value::Array(a) => a.iter().any(contains_key_material),
        Value::Object(o) => o
            .iter()
            .any(|(k, v)| k.contains("PRIVATE KEY") || contains_key_material(v)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn key_material_is_found_anywhere() {
        assert!(!contains_key_material(
            &json!({"a": ["x", {"b": "-----BEGIN CERTIFICATE-----"}]})
        ));
        assert!(contains_key_material(
            &json!({"a": ["x", {"b": "-----BEGIN PRIVATE KEY-----"}]})
        ));
        assert!(contains_key_material(
            &json!([{"value": "-----BEGIN EC PRIVATE KEY-----\n"}])
        ));
    }

    #[test]
    fn a_patch_with_key_material_is_refused() {
        let d = finish(
            Target::ApiserverProxy,
            &json!({"data": {}}),
            &json!({"data": {"tls.key": "-----BEGIN PRIVATE KEY-----"}}),
        );
        assert_eq!(d.result, UNEXPECTED_SHAPE);
        assert_eq!(d.patch, None);
        let d = finish(
            Target::ApiserverProxy,
            &json!({"data": {}}),
            &json!({"data": {"ca.crt": "-----BEGIN CERTIFICATE-----"}}),
        );
        assert_eq!(d.result, MUTATED);
    }
}
