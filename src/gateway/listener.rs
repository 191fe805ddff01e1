//! The accept loop shared by every listener protocol: limits, accept-error back-off, and one
//! task per connection. Protocol detection and handshakes never run here; they run in the
//! connection's own task under a deadline.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};

use super::Shared;
use crate::config::gateway::ListenerConfig;

/// Longest pause after a resource-exhaustion accept error (EMFILE and friends).
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// Counts open connections, globally and per source, and wakes the drain when none is left.
#[derive(Debug, Default)]
pub struct Tracker {
    active: AtomicUsize,
    per_source: Mutex<HashMap<IpAddr, usize>>,
    idle: Notify,
}

/// One open connection in the [`Tracker`]; released on drop.
#[derive(Debug)]
pub struct ConnGuard {
    tracker: Arc<Tracker>,
    source: Option<IpAddr>,
}

impl Tracker {
    /// Connections open now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    /// Admits a connection unless `max` are open.
    pub fn admit(self: &Arc<Self>, max: usize) -> Option<ConnGuard> {
        if self.active.fetch_add(1, Ordering::SeqCst) >= max {
            self.release(None);
            return None;
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
    }

    /// Waits until no connection is open.
    pub async fn wait_idle(&self) {
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
    pub fn limit_source(&mut self, source: IpAddr, per_source: usize) -> bool {
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

/// What a connection task gets besides its socket.
pub struct Accepted {
    /// The client connection.
    pub stream: TcpStream,
    /// The TCP peer.
    pub peer: SocketAddr,
    /// Keeps the connection counted.
    pub guard: ConnGuard,
    /// When it was accepted.
    pub accepted_at: std::time::Instant,
}

/// Accepts on `listener` until `stop` turns true, then closes the socket.
pub async fn accept_loop(
    listener: TcpListener,
    config: Arc<ListenerConfig>,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    let lm = Arc::new(shared.metrics.listener(&config.name));
    let limits = shared.config.limits;
    let mut backoff = Duration::from_millis(5);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.wait_for(|s| *s) => break,
        };
        let (stream, peer) = match accepted {
            Ok(x) => {
                backoff = Duration::from_millis(5);
                x
            }
            Err(e) => {
                if is_resource_error(&e) {
                    tracing::warn!(listener = %config.name, error = %e, ?backoff, "accept failed; backing off");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_ACCEPT_BACKOFF);
                } else {
                    tracing::debug!(listener = %config.name, error = %e, "accept failed");
                }
                continue;
            }
        };
        let peer = normalize(peer);
        let Some(guard) = shared.tracker.admit(limits.max_connections) else {
            super::access::AccessLog::new(&config.name, peer, std::time::Instant::now()).reject(
                &shared,
                "limited",
                "connection limit reached",
            );
            drop(stream);
            continue;
        };
        let accepted = Accepted {
            stream,
            peer,
            guard,
            accepted_at: std::time::Instant::now(),
        };
        let (config, shared, lm) = (config.clone(), shared.clone(), lm.clone());
        tokio::spawn(async move {
            lm.active.inc();
            let accepted_at = accepted.accepted_at;
            super::conn::serve(accepted, &config, &shared, &lm).await;
            lm.connection_duration
                .observe(accepted_at.elapsed().as_secs_f64());
            lm.active.dec();
        });
    }
    tracing::info!(listener = %config.name, "listener closed");
}

/// Maps IPv4-mapped IPv6 addresses to IPv4.
pub fn normalize(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => addr,
        },
        v4 => v4,
    }
}

fn is_resource_error(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(code) if code == rustix::io::Errno::MFILE.raw_os_error()
            || code == rustix::io::Errno::NFILE.raw_os_error()
            || code == rustix::io::Errno::NOBUFS.raw_os_error()
            || code == rustix::io::Errno::NOMEM.raw_os_error()
    )
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

    #[test]
    fn mapped_v6_is_normalized() {
        let a: SocketAddr = "[::ffff:10.1.2.3]:5".parse().unwrap();
        assert_eq!(normalize(a), "10.1.2.3:5".parse::<SocketAddr>().unwrap());
    }
}
