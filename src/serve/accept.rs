//! The accept loop every role runs on its stream listeners: admission against the
//! connection limit, a back-off when the process runs out of descriptors or memory, and one
//! task per connection.
//!
//! At the connection limit a loop stops accepting until a connection ends, as HAProxy and
//! nginx do: new clients wait in the kernel's backlog (past it, their kernels retry the SYN
//! with a growing back-off) instead of being accepted and closed. Under overload, refusing
//! costs the CPU the open connections need, and a refused client comes back at once (see
//! the reconnect storm in `docs/performance.md`). The pause is counted
//! (`trellis_downstream_accept_paused_seconds_total`) and said in a warning. A loop that
//! took a connection in a race past the limit holds it until a connection ends.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::record::ConnRecord;
use super::tracker::{ConnGuard, Tracker};
use crate::admin::Metrics;
use crate::admin::metrics::ListenerMetrics;
use crate::net::fds::{FailureLog, is_resource_error};
use crate::net::socket::normalize;

/// A source of accepted streams: a kernel TCP listener today; a user-space stack's listener
/// can implement it too.
pub(crate) trait Listener {
    /// The accepted stream.
    type Stream;

    /// Waits for the next connection and its peer address.
    fn accept(&self) -> impl Future<Output = io::Result<(Self::Stream, SocketAddr)>>;
}

impl Listener for TcpListener {
    type Stream = TcpStream;

    fn accept(&self) -> impl Future<Output = io::Result<(TcpStream, SocketAddr)>> {
        TcpListener::accept(self)
    }
}

/// Pauses after accept errors that mean "out of resources" (`EMFILE`, `ENFILE`,
/// `ENOBUFS`, `ENOMEM`): retrying at once would spin on the same error. Doubles per failure
/// in a row, from [`Backoff::FIRST`] to [`Backoff::MAX`], and starts over after a success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { next: Self::FIRST }
    }
}

impl Backoff {
    /// The first pause.
    pub(crate) const FIRST: Duration = Duration::from_millis(5);
    /// The longest pause.
    pub(crate) const MAX: Duration = Duration::from_secs(1);

    /// The pause after another failure in a row.
    pub(crate) fn failed(&mut self) -> Duration {
        let pause = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        pause
    }

    /// An accept succeeded: the next failure pauses [`Backoff::FIRST`] again.
    pub(crate) fn succeeded(&mut self) {
        self.next = Self::FIRST;
    }
}

/// What a connection task gets.
pub(crate) struct Accepted<S> {
    /// The client stream.
    pub stream: S,
    /// Keeps the connection counted in the tracker.
    pub guard: ConnGuard,
    /// The connection's record (its peer, when it was accepted).
    pub record: ConnRecord,
}

/// Where accepted connections are counted and admitted.
#[derive(Clone)]
pub(crate) struct Admission {
    /// Process metrics.
    pub metrics: Arc<Metrics>,
    /// The listener's handles (its name labels every line and metric).
    pub listener: Arc<ListenerMetrics>,
    /// Open connections of the role.
    pub tracker: Arc<Tracker>,
    /// Most connections open at once.
    pub max_connections: usize,
}

/// Accepts on `listener` until `stop` turns true, then drops (closes) it. Every admitted
/// connection runs `handle` in a task of its own.
pub(crate) async fn accept_loop<L, F, Fut>(
    listener: L,
    admission: Admission,
    mut stop: watch::Receiver<bool>,
    handle: F,
) where
    L: Listener,
    F: Fn(Accepted<L::Stream>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let name = admission.listener.listener.clone();
    let mut backoff = Backoff::default();
    let mut failures = FailureLog::default();
    let mut pauses = FailureLog::default();
    loop {
        // Armed before the count is read: an admission that reaches the limit after this
        // read wakes the loop out of `accept`.
        let reached = admission.tracker.limit_reached();
        tokio::pin!(reached);
        reached.as_mut().enable();
        if admission.tracker.active() >= admission.max_connections {
            if !pause(&admission, &mut stop, &mut pauses).await {
                break;
            }
            continue;
        }
        let accepted = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => break,
            // Another loop took the last connection: pause at the top instead.
            () = &mut reached => continue,
            r = listener.accept() => r,
        };
        let (stream, peer) = match accepted {
            Ok(x) => {
                backoff.succeeded();
                if failures.unsaid() > 0
                    && let Some(n) = failures.succeeded(tokio::time::Instant::now())
                {
                    tracing::warn!(listener = %name, failures = n, "accepting again after failed accepts");
                }
                x
            }
            Err(e) if is_resource_error(&e) => {
                let pause = backoff.failed();
                if let Some(n) = failures.failed(tokio::time::Instant::now()) {
                    tracing::warn!(
                        listener = %name,
                        error = %e,
                        failures = n,
                        pause_ms = pause.as_millis() as u64,
                        "accept failed; backing off (one line per {} s, with the failures since \
                         the last)",
                        FailureLog::INTERVAL.as_secs()
                    );
                }
                tokio::time::sleep(pause).await;
                continue;
            }
            Err(e) => {
                // Aborted handshakes and the like: the next connection is unaffected.
                tracing::debug!(listener = %name, error = %e, "accept failed");
                continue;
            }
        };
        // A loop that took a connection in a race past the limit (another loop admitted the
        // last one meanwhile) holds it until a connection ends rather than refusing it.
        let guard = loop {
            if let Some(guard) = admission.tracker.admit(admission.max_connections) {
                break Some(guard);
            }
            if !pause(&admission, &mut stop, &mut pauses).await {
                break None;
            }
        };
        let Some(guard) = guard else {
            break;
        };
        // From admission: a connection held above counts its handshake deadline, duration
        // and access-log time from when it could be served, as one waiting in the backlog.
        let accepted_at = std::time::Instant::now();
        let peer = normalize(peer);
        let record = ConnRecord::new(
            admission.metrics.clone(),
            admission.listener.clone(),
            peer,
            accepted_at,
        );
        tokio::spawn(handle(Accepted {
            stream,
            guard,
            record,
        }));
    }
    tracing::info!(listener = %name, "listener closed");
}

/// Waits until fewer than `maxConnections` are open, saying so in a warning (at most one
/// line per [`FailureLog::INTERVAL`] per loop, with the pauses since the last) and adding
/// the time to the listener's `trellis_downstream_accept_paused_seconds_total` every second
/// and at the end (so the counter rises during a long pause; it sums the listener's worker
/// loops, so it can rise faster than the clock). `false`: `stop` came first.
async fn pause(
    admission: &Admission,
    stop: &mut watch::Receiver<bool>,
    pauses: &mut FailureLog,
) -> bool {
    const TICK: Duration = Duration::from_secs(1);
    let mut since = tokio::time::Instant::now();
    if let Some(n) = pauses.failed(since) {
        tracing::warn!(
            listener = %admission.listener.listener,
            max_connections = admission.max_connections,
            pauses = n,
            "connection limit reached: not accepting until a connection ends (one line per {} \
             s, with the pauses since the last)",
            FailureLog::INTERVAL.as_secs()
        );
    }
    let mut ticks = tokio::time::interval_at(since + TICK, TICK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let resumed = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => Some(false),
            _ = admission.tracker.wait_below(admission.max_connections) => Some(true),
            _ = ticks.tick() => None,
        };
        let now = tokio::time::Instant::now();
        admission
            .listener
            .accept_paused
            .inc_by((now - since).as_secs_f64());
        since = now;
        if let Some(resumed) = resumed {
            return resumed;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_and_starts_over_after_a_success() {
        let mut b = Backoff::default();
        let pauses: Vec<u64> = (0..10).map(|_| b.failed().as_millis() as u64).collect();
        assert_eq!(pauses, [5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        b.succeeded();
        assert_eq!(b.failed(), Backoff::FIRST);
    }

    /// Out of descriptors, the loop pauses instead of spinning, and accepts again once a
    /// descriptor is free.
    #[tokio::test(start_paused = true)]
    async fn emfile_pauses_the_loop() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        /// Fails with EMFILE `fail` times, then stays pending.
        struct Exhausted {
            calls: Arc<AtomicUsize>,
            fail: usize,
        }
        impl Listener for Exhausted {
            type Stream = ();
            fn accept(&self) -> impl Future<Output = io::Result<((), SocketAddr)>> {
                let n = self.calls.fetch_add(1, Ordering::SeqCst);
                let fail = self.fail;
                async move {
                    if n < fail {
                        Err(io::Error::from_raw_os_error(libc::EMFILE))
                    } else {
                        std::future::pending().await
                    }
                }
            }
        }
        let calls = Arc::new(AtomicUsize::new(0));
        let metrics = Arc::new(Metrics::gateway());
        let admission = Admission {
            listener: Arc::new(metrics.listener("l")),
            metrics,
            tracker: Arc::new(Tracker::default()),
            max_connections: 10,
        };
        let (stop_tx, stop) = watch::channel(false);
        let listener = Exhausted {
            calls: calls.clone(),
            fail: 4,
        };
        let started = tokio::time::Instant::now();
        let task = tokio::spawn(accept_loop(listener, admission, stop, |_| async {}));
        // 5 + 10 + 20 + 40 ms of pauses before the fifth call.
        tokio::time::sleep(Duration::from_millis(74)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 4, "paused, not spinning");
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 5);
        assert!(started.elapsed() >= Duration::from_millis(75));
        stop_tx.send(true).unwrap();
        task.await.unwrap();
    }

    /// A listener whose first 50 accepts succeed at once (then none comes), counting the
    /// calls.
    struct Eager {
        calls: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Listener for Eager {
        type Stream = ();
        fn accept(&self) -> impl Future<Output = io::Result<((), SocketAddr)>> {
            let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                if n >= 50 {
                    std::future::pending::<()>().await;
                }
                Ok(((), SocketAddr::from(([127, 0, 0, 1], 1))))
            }
        }
    }

    /// A listener fed by a channel: each message is one connection.
    struct Fed {
        rx: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<()>>,
        taken: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Listener for Fed {
        type Stream = ();
        async fn accept(&self) -> io::Result<((), SocketAddr)> {
            match self.rx.lock().await.recv().await {
                Some(()) => {
                    self.taken.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    Ok(((), SocketAddr::from(([127, 0, 0, 1], 1))))
                }
                None => std::future::pending().await,
            }
        }
    }

    /// Two loops (two workers' sockets) share the limit: when one takes the last
    /// connection, the other stops waiting in `accept`, so a client arriving on its socket
    /// waits there too instead of being accepted and closed; it is taken once a connection
    /// ends.
    #[tokio::test(start_paused = true)]
    async fn a_loop_waiting_in_accept_pauses_when_another_reaches_the_limit() {
        let metrics = Arc::new(Metrics::gateway());
        let tracker = Arc::new(Tracker::default());
        let end = Arc::new(tokio::sync::Semaphore::new(0));
        let (stop_tx, stop) = watch::channel(false);
        let mut feeds = Vec::new();
        let mut taken = Vec::new();
        let mut tasks = Vec::new();
        for name in ["a", "b"] {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            feeds.push(tx);
            let admission = Admission {
                listener: Arc::new(metrics.listener(name)),
                metrics: metrics.clone(),
                tracker: tracker.clone(),
                max_connections: 2,
            };
            let end = end.clone();
            let handle = move |acc: Accepted<()>| {
                let end = end.clone();
                async move {
                    end.acquire().await.unwrap().forget();
                    drop(acc);
                }
            };
            let listener = Fed {
                rx: tokio::sync::Mutex::new(rx),
                taken: Arc::default(),
            };
            taken.push(listener.taken.clone());
            tasks.push(tokio::spawn(accept_loop(
                listener,
                admission,
                stop.clone(),
                handle,
            )));
        }
        // Both loops wait in accept; the first socket gets the two allowed connections.
        tokio::time::sleep(Duration::from_millis(10)).await;
        feeds[0].send(()).unwrap();
        feeds[0].send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(tracker.active(), 2);
        // A client on the second socket is left waiting, not refused.
        feeds[1].send(()).unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let text = metrics.encode();
        assert!(!text.contains("outcome=\"limited\""), "{text}");
        let second = || taken[1].load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(second(), 0, "still in the second socket's backlog");
        end.add_permits(1);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(second(), 1, "taken once a connection ended");
        assert_eq!(tracker.active(), 2);
        stop_tx.send(true).unwrap();
        for t in tasks {
            t.await.unwrap();
        }
    }

    /// A connection taken past the limit (the loop was already in `accept` when the last
    /// slot went, without being told) is held until a connection ends, not refused.
    #[tokio::test(start_paused = true)]
    async fn a_connection_taken_past_the_limit_is_held_not_refused() {
        let metrics = Arc::new(Metrics::gateway());
        let tracker = Arc::new(Tracker::default());
        let (feed, rx) = tokio::sync::mpsc::unbounded_channel();
        let listener = Fed {
            rx: tokio::sync::Mutex::new(rx),
            taken: Arc::default(),
        };
        let taken = listener.taken.clone();
        let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let handle = {
            let served = served.clone();
            move |acc: Accepted<()>| {
                served.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async move {
                    std::future::pending::<()>().await;
                    drop(acc)
                }
            }
        };
        let admission = Admission {
            listener: Arc::new(metrics.listener("l")),
            metrics: metrics.clone(),
            tracker: tracker.clone(),
            max_connections: 1,
        };
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, admission, stop, handle));
        tokio::time::sleep(Duration::from_millis(10)).await;
        // The slot goes elsewhere without the loop being told (an admission under another
        // limit does not signal this one's), then a client comes.
        let other = tracker.admit(2).unwrap();
        feed.send(()).unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let count =
            |a: &std::sync::atomic::AtomicUsize| a.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(count(&taken), 1, "taken from the socket");
        assert_eq!(count(&served), 0, "held, not served past the limit");
        let text = metrics.encode();
        assert!(!text.contains("outcome=\"limited\""), "{text}");
        drop(other);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(count(&served), 1, "served once a connection ended");
        assert_eq!(tracker.active(), 1);
        stop_tx.send(true).unwrap();
        task.await.unwrap();
    }

    /// At the limit the loop stops calling accept (no accept-and-close, no spinning), counts
    /// the pause, accepts again as soon as a connection ends, and still stops on `stop`.
    #[tokio::test(start_paused = true)]
    async fn at_the_limit_the_loop_waits_for_a_connection_to_end() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let calls = Arc::new(AtomicUsize::new(0));
        let metrics = Arc::new(Metrics::gateway());
        let listener_metrics = Arc::new(metrics.listener("l"));
        let admission = Admission {
            listener: listener_metrics.clone(),
            metrics: metrics.clone(),
            tracker: Arc::new(Tracker::default()),
            max_connections: 2,
        };
        let tracker = admission.tracker.clone();
        // Each connection is held until `end` lets one go.
        let end = Arc::new(tokio::sync::Semaphore::new(0));
        let handle = {
            let end = end.clone();
            move |acc: Accepted<()>| {
                let end = end.clone();
                async move {
                    end.acquire().await.unwrap().forget();
                    drop(acc);
                }
            }
        };
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(accept_loop(
            Eager {
                calls: calls.clone(),
            },
            admission,
            stop,
            handle,
        ));
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 2, "accepts stop at the limit");
        assert_eq!(tracker.active(), 2);
        let limited = metrics.encode();
        assert!(
            !limited.contains("outcome=\"limited\""),
            "nobody was accepted and closed: {limited}"
        );
        // Counted while the pause lasts, not only when it ends.
        let paused = listener_metrics.accept_paused.get();
        assert!((2.0..=3.0).contains(&paused), "{paused} s paused");
        end.add_permits(1);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(
            calls.load(Ordering::SeqCst),
            3,
            "one ended, one more accepted"
        );
        assert_eq!(tracker.active(), 2);
        assert!(listener_metrics.accept_paused.get() >= 3.0);
        stop_tx.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("a paused loop stops")
            .unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }
}
