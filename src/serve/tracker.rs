//! Open connections, globally and per source: admission against the limits, and the wait
//! for none to be left that a drain needs. A connection that serves others (a TCP stream
//! carrying a tunnel the other connections go through) can be marked as one the drain does
//! not wait for: it still counts against the limits. It never touches a socket.

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
    /// Open connections the drain does not wait for ([`ConnGuard::background`]).
    background: AtomicUsize,
}

/// One open connection in the [`Tracker`]; released on drop.
#[derive(Debug)]
pub(crate) struct ConnGuard {
    tracker: Arc<Tracker>,
    source: Option<IpAddr>,
    background: bool,
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
            self.release(None, false);
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
            background: false,
        })
    }

    /// Whether only background connections are open.
    fn idle(&self) -> bool {
        self.active() <= self.background.load(Ordering::SeqCst)
    }

    fn release(&self, source: Option<IpAddr>, background: bool) {
        if let Some(ip) = source {
            let mut map = self.per_source.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = map.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&ip);
                }
            }
        }
        if background {
            self.background.fetch_sub(1, Ordering::SeqCst);
        }
        let left = self.active.fetch_sub(1, Ordering::SeqCst) - 1;
        if left <= self.background.load(Ordering::SeqCst) {
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

    /// Waits until no connection is open but background ones (see
    /// [`ConnGuard::background`]).
    pub(crate) async fn wait_idle(&self) {
        self.wait_until(Self::idle).await
    }

    /// Waits until no connection at all is open.
    pub(crate) async fn wait_empty(&self) {
        self.wait_until(|t| t.active() == 0).await
    }

    async fn wait_until(&self, done: impl Fn(&Self) -> bool) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if done(self) {
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

impl ConnGuard {
    /// Marks the connection as one the drain does not wait for: it serves the other
    /// connections (a stream carrying a tunnel) and is ended by its owner once they have.
    pub(crate) fn background(&mut self) {
        if std::mem::replace(&mut self.background, true) {
            return;
        }
        self.tracker.background.fetch_add(1, Ordering::SeqCst);
        if self.tracker.idle() {
            self.tracker.idle.notify_waiters();
        }
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.tracker.release(self.source, self.background);
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

    /// The drain's wait ends when only background connections are left (and when one
    /// becomes background); waiting for none at all also waits for those.
    #[tokio::test(start_paused = true)]
    async fn background_connections_are_not_waited_for_by_the_drain() {
        let t = Arc::new(Tracker::default());
        let relay = t.admit(3).unwrap();
        let mut stream = t.admit(3).unwrap();
        stream.background();
        let mut late = t.admit(3).unwrap();
        let idle = tokio::spawn({
            let t = t.clone();
            async move { t.wait_idle().await }
        });
        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
        assert!(!idle.is_finished(), "woke with a relay open");
        drop(relay);
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        assert!(!idle.is_finished(), "woke with a second relay open");
        late.background();
        tokio::time::timeout(std::time::Duration::from_secs(1), idle)
            .await
            .expect("woken once only background connections are left")
            .unwrap();
        assert_eq!(t.active(), 2, "background connections still count");
        assert!(t.admit(2).is_none(), "and against the limit");
        let empty = tokio::spawn({
            let t = t.clone();
            async move { t.wait_empty().await }
        });
        drop(stream);
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        assert!(!empty.is_finished());
        drop(late);
        tokio::time::timeout(std::time::Duration::from_secs(1), empty)
            .await
            .expect("woken when the last connection ends")
            .unwrap();
        t.wait_idle().await;
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
