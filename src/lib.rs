//! trellis: the L4 data plane between hosted Kubernetes control planes and their shoots.
//!
//! Layers, dependencies pointing down: the roles `gateway` (listener protocols, routing
//! table), `node` (the shoot's `kubernetes.default` endpoint) and `controller` (seed objects
//! -> routing table) are wiring on `serve` (accept
//! loop, connection tracking and record, forward, drain, watched files), which uses `net` (sockets, dialers,
//! the relay), `route` (immutable routing table), `config` (validated files), `wire` (sans-IO
//! codecs) and `admin` (metrics, health). `main.rs` only parses the command line.

pub(crate) mod admin;
pub mod agent;
pub mod config;
pub mod controller;
#[cfg(feature = "extension")]
pub mod extension;
pub mod gateway;
pub mod net;
pub mod node;
pub mod route;
pub(crate) mod serve;
pub(crate) mod tunnel;
pub mod wire;

pub use serve::access_log;
pub use serve::process::StartError;

/// The version `trellis --version` prints and `trellis_build_info` carries: the crate
/// version, or `TRELLIS_VERSION` from the build environment when set (the container image
/// build sets it to the release or commit it was built from).
pub const VERSION: &str = match option_env!("TRELLIS_VERSION") {
    Some(v) => v,
    None => env!("CARGO_PKG_VERSION"),
};
