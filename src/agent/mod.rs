//! The shoot side of a WireGuard tunnel (`trellis agent`): a user-space peer of the gateway
//! that dials the targets the seed asks for. Not in this build yet: [`run`] only refuses.

use crate::config::agent::AgentConfig;

/// Runs the agent until SIGTERM/SIGINT and a completed drain.
pub async fn run(config: AgentConfig) -> Result<(), std::io::Error> {
    let _ = config;
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "agent not implemented",
    ))
}
