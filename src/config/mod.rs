//! Configuration files: one typed structure per kind, one loader, the sections kinds share.
//!
//! Every file is YAML (JSON is YAML too) with `apiVersion: trellis.gardener.cloud/v1alpha1`
//! and a `kind`. A file is decoded in one pass straight into its kind's types, whose values
//! are typed from their text ([`value`]: a duration, an address, a network, a key, a header
//! name), so a bad value is a type error at its path; a syntax error stops the file, while
//! type errors, missing fields and unknown fields are collected, the file decoded again past
//! each ([`decode`], [`recover`]). Then the kind's validation applies the rules across
//! fields ([`ConfigKind::validate`]). Every problem is reported with line, column and field
//! path. `trellis check` and the processes themselves run exactly this path, so what `check`
//! accepts is what runs. This module reads files but never opens sockets.
//!
//! Layers, each importing only those below it (`scripts/test` keeps it so): `error`,
//! `recover`, `locate`, `value`, `mounts` at the bottom; `decode` (kind-agnostic); `load` (the
//! [`ConfigKind`] trait and the one loader); the shared sections `common`, `tls` and `table`
//! (the routing table's schema); the kinds `gateway`, `node`, `agent`, `controller`,
//! `extension` and `routes`, none importing another; `check`, the one place that names every kind.

#[macro_use]
mod decode;
#[macro_use]
pub mod value;
mod check;
mod common;
mod error;
mod load;
mod locate;
mod mounts;
mod recover;
pub mod table;

pub mod agent;
pub mod controller;
pub mod extension;
pub mod gateway;
pub mod node;
pub mod routes;
pub mod tls;

pub use check::{
    AnyFile, CheckError, Checked, KINDS, LoadKubeconfig, NO_KUBERNETES_CLIENT, Referenced, SKIPPED,
    Unread, check_file,
};
pub use common::{Admin, Downstream, GatewayUpstream, Keepalive, NodeUpstream, Timeouts};
pub(crate) use decode::yaml_options_with;
pub use decode::{MAX_FILE_BYTES, Recovery};
pub use error::{ConfigError, Errors, FieldError};
pub use load::{ConfigKind, Source, load, parse, parse_with, read_file};
pub use mounts::Mounts;
pub use value::{API_VERSION, MAX_DURATION, duration_text, parse_duration};
