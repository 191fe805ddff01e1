//! The controller role: the seed's objects -> a routing table.
//!
//! [`model`] holds compact projections of the objects translation reads, [`manifest`] fills
//! them from manifest files (`trellis controller render`), and [`translate`] turns a
//! snapshot of them into a table for one [`target`] gateway, with a [`report`] of what it
//! left out: a pure function, no I/O, no runtime; [`acl`] renders the source allow-lists of
//! RBAC EnvoyFilters onto its routes, [`tunnel`] the shoots' tunnel and egress routes and
//! the egress TLS files; [`kinds`] lists the API kinds read. [`output`] writes a table and
//! its files beside it.
//! [`watch`] (cargo feature `controller`) is the live path: kube-rs watches feeding the same
//! projections and translation, the table written to a file.

pub mod acl;
pub mod kinds;
pub mod manifest;
pub mod model;
pub mod output;
pub mod report;
pub mod target;
pub mod translate;
pub mod tunnel;
#[cfg(feature = "controller")]
pub mod watch;

use std::path::{Path, PathBuf};

use crate::config::controller::ControllerConfig;

pub use report::{Reason, Report};
pub use target::Target;
pub use translate::{Files, Rendered, Table, translate};

/// Reads the manifests in `dir` and renders what `config` asks for: the table, the files it
/// names and the report. The objects of kinds the live controller would not watch with
/// `config` (Clusters and Secrets without tunnels) are left out, as it never sees them.
pub fn render(dir: &Path, config: &ControllerConfig) -> Result<Rendered, manifest::ManifestError> {
    let mut snapshot = manifest::read_dir(dir)?;
    if config.tunnel.is_none() {
        snapshot.clusters.clear();
        snapshot.secrets.clear();
    }
    Ok(translate(&snapshot, &Target::from_config(config)))
}

/// The table as the controller writes it: pretty JSON, one trailing newline.
pub fn to_json(table: &Table) -> String {
    // Serialising plain strings, numbers and lists cannot fail.
    let mut json = serde_json::to_string_pretty(table).unwrap_or_default();
    json.push('\n');
    json
}

/// The temporary file a table is written to before it is renamed over `output`: beside it,
/// so the rename stays on one file system (the volume the output is on), and named after
/// the process, so two writers never share one.
pub fn temporary_file(output: &Path) -> PathBuf {
    let name = output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    output.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}
