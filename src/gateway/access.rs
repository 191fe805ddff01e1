//! The access log: one line per connection when it ends (and optionally periodic lines for
//! long-lived ones), emitted as a `tracing` event on target `trellis::access` so that
//! `--log-format json` turns it into one JSON object per line.

use std::net::SocketAddr;
use std::time::Instant;

use super::Shared;
use crate::net::relay::Stats;

/// What is known about a connection so far.
#[derive(Debug)]
pub struct AccessLog {
    /// Listener name.
    pub listener: String,
    /// Client address (the PROXY source when present).
    pub client: SocketAddr,
    /// TCP peer address.
    pub peer: SocketAddr,
    /// SNI or CONNECT destination.
    pub target: Option<String>,
    /// Route name.
    pub route: Option<String>,
    /// Backend as written in the table.
    pub backend: Option<String>,
    /// When the connection was accepted.
    pub accepted_at: Instant,
    /// PROXY header version and TLVs, when one was received.
    pub proxy: Option<String>,
}

impl AccessLog {
    /// Starts a record for a connection accepted now.
    pub fn new(listener: &str, peer: SocketAddr, accepted_at: Instant) -> Self {
        AccessLog {
            listener: listener.to_owned(),
            client: peer,
            peer,
            target: None,
            route: None,
            backend: None,
            accepted_at,
            proxy: None,
        }
    }

    /// Records a PROXY header: its source becomes the client address.
    pub fn set_proxy(&mut self, info: &crate::wire::proxy::ProxyInfo) {
        if let Some(source) = info.source() {
            self.client = crate::gateway::listener::normalize(source);
        }
        let mut s = format!("v{}", info.version);
        for tlv in &info.tlvs {
            s.push(' ');
            s.push_str(tlv);
        }
        self.proxy = Some(s);
    }

    /// Counts and logs a connection rejected before routing.
    pub fn reject(self, shared: &Shared, outcome: &'static str, detail: &str) {
        shared.metrics.outcome(&self.listener, outcome);
        tracing::debug!(listener = %self.listener, client = %self.client, outcome, detail, "connection rejected");
        self.emit(Stats::default(), outcome, false);
    }

    /// Writes the line: `reason` is the termination reason; `periodic` marks interim lines.
    pub fn emit(&self, stats: Stats, reason: &str, periodic: bool) {
        tracing::info!(
            target: "trellis::access",
            listener = %self.listener,
            route = self.route.as_deref().unwrap_or("-"),
            client = %self.client,
            peer = %self.peer,
            target_name = self.target.as_deref().unwrap_or("-"),
            backend = self.backend.as_deref().unwrap_or("-"),
            proxy = self.proxy.as_deref().unwrap_or("-"),
            rx_bytes = stats.rx,
            tx_bytes = stats.tx,
            duration_ms = self.accepted_at.elapsed().as_millis() as u64,
            reason,
            periodic,
            "access"
        );
    }
}
