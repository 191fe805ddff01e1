//! The controller role: the seed's objects -> a routing table.
//!
//! [`model`] holds compact projections of the objects translation reads, [`manifest`] fills
//! them from manifest files (`trellis controller render`), and [`translate`] turns a
//! snapshot of them into a table for one gateway: a pure function, no I/O, no runtime;
//! [`acl`] renders the source allow-lists of RBAC EnvoyFilters onto its routes.
//! [`watch`] (cargo feature `controller`) is the live path: kube-rs watches feeding the same
//! projections and translation, the table written to a file.

pub mod acl;
pub mod manifest;
pub mod model;
pub mod translate;
#[cfg(feature = "controller")]
pub mod watch;

use std::path::Path;

use crate::config::controller::ControllerConfig;

pub use translate::{Report, Table, Target, translate};

/// Reads the manifests in `dir` and renders the table `config` asks for: the table as JSON
/// (what the gateway loads) and the report.
pub fn render(
    dir: &Path,
    config: &ControllerConfig,
) -> Result<(String, Report), manifest::ManifestError> {
    let snapshot = manifest::read_dir(dir)?;
    let (table, report) = translate(&snapshot, &Target::from_config(config));
    Ok((to_json(&table), report))
}

/// The table as the controller writes it: pretty JSON, one trailing newline.
pub fn to_json(table: &Table) -> String {
    // Serialising plain strings, numbers and lists cannot fail.
    let mut json = serde_json::to_string_pretty(table).unwrap_or_default();
    json.push('\n');
    json
}
