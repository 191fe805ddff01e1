//! The Gardener extension (`trellis extension`, cargo feature `extension`): one process with
//! a controller for `extensions.gardener.cloud/v1alpha1 Extension`s of trellis' types and
//! the HTTPS server of their mutating webhooks.
//!
//! - [`role`]: the types (`trellis-node`) and their webhook targets, generic over the role.
//! - [`state`]: what the controller established, read by the webhooks.
//! - [`mutate`]: the pure mutations of admitted objects (raw JSON in, raw JSON out).
//! - [`render`]: the pure rendering of what a shoot's ManagedResource delivers.
//! - [`admission`]: one AdmissionReview in, its response out (checks, counting, warnings).
//! - [`server`]: the HTTPS server (limits, deadlines, callers), [`certs`]: its CA and
//!   server certificate, rotated without a restart; [`metrics`]: the extension's families.
//! - [`reconcile`]: the Extension controller (Gardener's contract), [`watch`]: its watches
//!   and work queue, [`heartbeat`]: its Lease.
//! - `run`: all of them in one process on the role skeleton.

pub mod admission;
pub mod certs;
pub mod heartbeat;
pub mod metrics;
pub mod mutate;
pub mod reconcile;
pub mod render;
pub mod role;
mod run;
pub mod server;
pub mod state;
pub mod watch;

pub use run::{ExtensionError, run};
