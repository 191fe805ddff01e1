//! trellis: the L4 data plane between hosted Kubernetes control planes and their shoots.
//!
//! Layers, dependencies pointing down: the roles `gateway` (listener protocols, routing
//! table) and `node` (the shoot's `kubernetes.default` endpoint) are wiring on `serve` (accept
//! loop, connection tracking and record, forward, drain), which uses `net` (sockets, dialers,
//! the relay), `route` (immutable routing table), `config` (validated files), `wire` (sans-IO
//! codecs) and `admin` (metrics, health). `main.rs` only parses the command line.

pub(crate) mod admin;
pub mod config;
pub mod gateway;
pub mod net;
pub mod node;
pub mod route;
pub(crate) mod serve;
pub mod wire;
