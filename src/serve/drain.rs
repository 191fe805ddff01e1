//! Graceful drain, shared by every role: stop the accept loops, let open connections finish
//! until a deadline, then cut the relays still running and give their tasks a moment to
//! write their records. Readiness is the caller's to fail first.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::tracker::Tracker;
use crate::config::duration_text;
use crate::net::relay::Stop;

/// How long connections cut at the drain deadline get to write their records.
const HARD_STOP_GRACE: Duration = Duration::from_secs(2);

/// The drain of one process.
#[derive(Debug)]
pub(crate) struct Drain {
    listeners: watch::Sender<bool>,
    /// Open connections.
    pub tracker: Arc<Tracker>,
    /// Cuts every relay at the deadline.
    pub hard_stop: Arc<Stop>,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            listeners: watch::Sender::new(false),
            tracker: Arc::default(),
            hard_stop: Arc::default(),
        }
    }
}

impl Drain {
    /// Turns true when the accept loops must close their listeners.
    pub(crate) fn listeners_stop(&self) -> watch::Receiver<bool> {
        self.listeners.subscribe()
    }

    /// Closes the listeners and waits up to `timeout` for the open connections; then cuts
    /// the rest. Returns how many were cut.
    pub(crate) async fn run(&self, timeout: Duration) -> usize {
        self.listeners.send_replace(true);
        tracing::info!(
            active = self.tracker.active(),
            timeout = %duration_text(timeout),
            "listeners closed; waiting for connections"
        );
        if tokio::time::timeout(timeout, self.tracker.wait_idle())
            .await
            .is_ok()
        {
            return 0;
        }
        let cut = self.tracker.active();
        tracing::warn!(
            active = cut,
            "drain deadline reached; closing remaining connections"
        );
        self.hard_stop.stop();
        let _ = tokio::time::timeout(HARD_STOP_GRACE, self.tracker.wait_idle()).await;
        cut
    }
}
