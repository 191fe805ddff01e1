//! What every role shares to serve connections: the accept loop with its admission and
//! back-off ([`accept`]), connection tracking and limits ([`tracker`]), the per-connection
//! record that feeds the access log and the metrics exactly once ([`record`]) and the
//! access log's writer ([`access_log`]), the path of
//! a routed connection — dial, relay, record ([`forward`]) — the drain ([`drain`]),
//! handing freed memory back to the system ([`memory`]), re-reading files when they
//! change ([`watch`]), and the process skeleton every role runs in — admin endpoint,
//! signals, readiness, drain, start errors ([`process`]).
//!
//! Roles (gateway, node, agent, controller) are wiring on top of this; nothing here knows a
//! listener protocol or a configuration file format.

pub(crate) mod accept;
pub mod access_log;
pub(crate) mod drain;
pub(crate) mod forward;
pub(crate) mod memory;
pub(crate) mod process;
pub(crate) mod record;
pub(crate) mod tracker;
pub(crate) mod watch;
