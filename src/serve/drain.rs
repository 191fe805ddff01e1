//! Graceful drain, shared by every role: keep accepting for a delay (load balancers and
//! kube-proxy go on sending new clients for a few seconds after readiness fails), stop the
//! accept loops, let open connections finish until a deadline, then cut the relays still
//! running spread over a window, so their clients do not all reconnect in the same instant,
//! and give their tasks a moment to write their records. Readiness is the caller's to fail
//! first.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::tracker::Tracker;
use crate::config::duration_text;
use crate::net::relay::Stop;

/// How long connections cut at the end of the drain get to write their records.
const HARD_STOP_GRACE: Duration = Duration::from_secs(2);

/// Shortest and longest window the cuts at the drain deadline are spread over.
const SPREAD_MIN: Duration = Duration::from_secs(1);
const SPREAD_MAX: Duration = Duration::from_secs(10);

/// How many steps the cuts are spread in (each step cuts an equal share).
const SPREAD_STEPS: u32 = 100;

/// The window over which connections still open at the drain deadline are cut: a tenth of
/// the drain timeout, at least 1 s and at most 10 s; none for a drain timeout of 0 (cut at
/// once).
pub(crate) fn spread_window(drain: Duration) -> Duration {
    if drain.is_zero() {
        return Duration::ZERO;
    }
    (drain / 10).clamp(SPREAD_MIN, SPREAD_MAX)
}

/// How a drain runs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DrainTimes {
    /// Listeners keep accepting this long after the drain starts.
    pub delay: Duration,
    /// Open connections may finish this long after the listeners close.
    pub timeout: Duration,
}

/// The drain of one process.
#[derive(Debug)]
pub(crate) struct Drain {
    listeners: watch::Sender<bool>,
    /// Open connections.
    pub tracker: Arc<Tracker>,
    /// Cuts the relays at the deadline.
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

    /// Keeps the listeners open for `times.delay`, closes them and waits up to
    /// `times.timeout` for the open connections; then cuts the rest, spread over
    /// [`spread_window`]. Returns how many were open at the deadline. Takes at most delay +
    /// timeout + window + a grace of 2 s.
    pub(crate) async fn run(&self, times: DrainTimes) -> usize {
        if !times.delay.is_zero() {
            tracing::info!(
                active = self.tracker.active(),
                delay = %duration_text(times.delay),
                "draining: listeners keep accepting for the drain delay"
            );
            tokio::time::sleep(times.delay).await;
        }
        self.listeners.send_replace(true);
        tracing::info!(
            active = self.tracker.active(),
            timeout = %duration_text(times.timeout),
            "listeners closed; waiting for connections"
        );
        if tokio::time::timeout(times.timeout, self.tracker.wait_idle())
            .await
            .is_ok()
        {
            return 0;
        }
        let open = self.tracker.active();
        let window = spread_window(times.timeout);
        tracing::warn!(
            active = open,
            window = %duration_text(window),
            "drain deadline reached; closing the remaining connections over the window"
        );
        self.cut_spread(window).await;
        self.hard_stop.stop();
        let _ = tokio::time::timeout(HARD_STOP_GRACE, self.tracker.wait_idle()).await;
        open
    }

    /// Cuts the running relays in [`SPREAD_STEPS`] equal shares over `window` (the first
    /// share at once), stopping early when none is left.
    async fn cut_spread(&self, window: Duration) {
        if window.is_zero() {
            return;
        }
        let start = Instant::now();
        let total = self.hard_stop.running();
        let mut cut = 0;
        for step in 1..=SPREAD_STEPS {
            let due = (total * step as usize).div_ceil(SPREAD_STEPS as usize);
            cut += self.hard_stop.cut(due.saturating_sub(cut));
            if self.hard_stop.running() == 0 {
                return;
            }
            tokio::time::sleep_until(start + window * step / SPREAD_STEPS).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_is_a_tenth_of_the_drain_within_bounds() {
        let s = Duration::from_secs;
        assert_eq!(spread_window(Duration::ZERO), Duration::ZERO);
        assert_eq!(spread_window(Duration::from_millis(200)), s(1));
        assert_eq!(spread_window(s(60)), s(6));
        assert_eq!(spread_window(s(3600)), s(10));
    }
}
