//! The webhooks' mutations: pure functions of the admitted object (raw JSON, unknown fields
//! kept) and the shoot's state. A mutation works on a copy and returns the whole result or
//! nothing; the patch is the difference of the two.
//!
//! INTERFACE (filled in by the mutation work; the admission handler calls only this).

use serde_json::Value;

use super::role::Target;
use super::state::Shoot;

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

/// Decides what `target`'s webhook does with `object` (the review's `request.object`) of
/// the shoot whose state is `shoot`.
pub fn review(target: Target, shoot: Option<&Shoot>, object: &Value) -> Decision {
    let _ = (target, shoot, object);
    Decision {
        patch: None,
        result: "not_enabled",
        warning: Some("not implemented yet".into()),
    }
}
