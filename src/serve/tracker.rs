//! Open connections, globally and per source: admission against the limits, and the wait
//! for none to be left that a drain needs. It never touches a socket.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use tokio::sync::futures::Notified;

/// Counts open connections, globally and per source, and wakes the drain when none is left.
#[derive(Debug, Default)]
pub(crate) struct Tracker {
    active: AtomicUsize,
    /// The highest `active` since the last [`Tracker::take_peak`].
    peak: AtomicUsize,
    per_source: Mutex<HashMap<IpAddr, usize>>,
    idle: Notify,
    /// Accept loops waiting for a connection to end ([`Tracker::wait_below`]).
    slot: Notify,
    /// Accept loops waiting in `accept`, to be told that the limit was reached
    /// ([`Tracker::limit_reached`]).
    reached: Notify,
    /// Whether one may be waiting: a release notifies only then.
    waiting: AtomicBool,
}

/// One open connection in the [`Tracker`]; released on drop.
#[derive(Debug)]
pub(crate) struct ConnGuard {
    tracker: Arc<Tracker>,
    source: Option<IpAddr>,
}

impl Tracker {
    /// Connections open now.
    pub(crate) fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    /// Admits a connection unless `max` are open.
    pub(crate) fn admit(self: &Arc<Self>, max: usize) -> Option<ConnGuard> {
        let before = self.active.fetch_add(1, Ordering::SeqCst);
        if before >= max {
            self.release(None);
            return None;
        }
        if before + 1 == max {
            self.reached.notify_waiters();
        }
        // Written only while the count climbs past its peak: no extra shared write per
        // connection at a steady load.
        if before >= self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(before + 1, Ordering::Relaxed);
        }
        Some(ConnGuard {
            tracker: self.clone(),
            source: None,
        })
    }

    fn release(&self, source: Option<IpAddr>) {
        if let Some(ip) = source {
            let mut map = self.per_source.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = map.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&ip);
                }
            }
        }
        if self.active.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
        // A waiter sets `waiting` before it looks at `active`, and this looks at `waiting`
        // after lowering `active` (both sequentially consistent): either the waiter sees the
        // lower count or this sees it waiting.
        if self.waiting.load(Ordering::SeqCst) && self.waiting.swap(false, Ordering::SeqCst) {
            self.slot.notify_waiters();
        }
    }

    /// Resolves when an admission reaches the limit (from when it is enabled or first
    /// polled): accept loops waiting in `accept` on other sockets stop waiting there, so
    /// that none takes a connection past the limit.
    pub(crate) fn limit_reached(&self) -> Notified<'_> {
        self.reached.notified()
    }

    /// Waits until fewer than `max` connections are open.
    pub(crate) async fn wait_below(&self, max: usize) {
        loop {
            let notified = self.slot.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            self.waiting.store(true, Ordering::SeqCst);
            if self.active() < max {
                return;
            }
            notified.await;
        }
    }

    /// The highest count of open connections since the last call, and the count now; the
    /// next call's peak starts from the count now.
    pub(crate) fn take_peak(&self) -> (usize, usize) {
        let active = self.active();
        (
            self.peak.swap(active, Ordering::Relaxed).max(active),
            active,
        )
    }

    /// Waits until no connection is open.
    pub(crate) async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.active() == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl ConnGuard {
    /// Counts the connection against `source` (the PROXY source when present); false if
    /// `source` already has `per_source` connections (0 = unlimited).
    pub(crate) fn limit_source(&mut self, source: IpAddr, per_source: usize) -> bool {
        if per_source == 0 || self.source.is_some() {
            return true;
        }
        // Poisoning cannot leave the map inconsistent: every update is one statement.
        let mut map = self
            .tracker
            .per_source
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let n = map.entry(source).or_insert(0);
        if *n >= per_source {
            return false;
        }
        *n += 1;
        self.source = Some(source);
        true
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.tracker.release(self.source);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_global_and_per_source() {
        let t = Arc::new(Tracker::default());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let mut g1 = t.admit(3).unwrap();
        assert!(g1.limit_source(a, 1));
        let mut g2 = t.admit(3).unwrap();
        assert!(!g2.limit_source(a, 1));
        assert!(g2.limit_source(b, 1));
        assert_eq!(t.active(), 2);
        drop(g1);
        let mut g3 = t.admit(2).unwrap();
        assert!(g3.limit_source(a, 1));
        assert!(t.admit(2).is_none());
        drop(g2);
        assert_eq!(t.active(), 1);
        assert!(t.admit(0).is_none());
    }

    /// A waiter wakes when a connection ends, not before; with none open it does not wait.
    #[tokio::test(start_paused = true)]
    async fn wait_below_wakes_when_a_connection_ends() {
        let t = Arc::new(Tracker::default());
        let a = t.admit(2).unwrap();
        let _b = t.admit(2).unwrap();
        let waiter = tokio::spawn({
            let t = t.clone();
            async move { t.wait_below(2).await }
        });
        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
        assert!(!waiter.is_finished(), "woke with the limit still reached");
        drop(a);
        tokio::time::timeout(std::time::Duration::from_secs(1), waiter)
            .await
            .expect("woken by the end of a connection")
            .unwrap();
        t.wait_below(2).await;
    }
}
