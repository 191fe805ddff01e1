//! trellis: the L4 data plane between hosted Kubernetes control planes and their shoots.
//!
//! Layers, dependencies pointing down: `gateway` (listeners, lifecycle) uses `net` (sockets,
//! connect, relay), `route` (immutable routing table), `config` (validated files), `wire`
//! (sans-IO codecs) and `admin` (metrics, health). `main.rs` only parses the command line.

pub mod admin;
pub mod config;
pub mod gateway;
pub mod net;
pub mod node;
pub mod route;
pub mod wire;
