//! Backend addresses, shared load/health state, and the order in which to try backends.
//!
//! Choice: backends in the gateway's zone first when any of them is healthy; within a group
//! the fewest active connections first, ties broken randomly; backends in passive back-off
//! after a failed connect come last (tried only when nothing else is left).

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use serde::{Serialize, Serializer};

use super::{Backend, Route};

/// First back-off after a failed connect; doubles per consecutive failure.
pub(crate) const BACKOFF_BASE: Duration = Duration::from_secs(1);
/// Longest back-off.
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// A backend address: a literal socket address or a DNS name resolved at connect time.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BackendAddress {
    /// `IP:port`.
    Ip(SocketAddr),
    /// `name:port`, resolved per connection.
    Dns {
        /// Host name (trailing dot kept as written: it means "absolute" to the resolver).
        host: String,
        /// TCP port.
        port: u16,
    },
}

impl BackendAddress {
    /// Parses `IP:port`, `[v6]:port` or `name:port`.
    pub fn parse(s: &str) -> Result<Self, String> {
        if let Ok(addr) = s.parse::<SocketAddr>() {
            return Ok(BackendAddress::Ip(addr));
        }
        let (host, port) = s.rsplit_once(':').ok_or("expected HOST:PORT")?;
        let port: u16 = port.parse().map_err(|_| format!("invalid port {port:?}"))?;
        if port == 0 {
            return Err("port 0".into());
        }
        if host.contains(':') || host.starts_with('[') {
            return Err(format!("invalid IPv6 address {host:?}"));
        }
        if crate::wire::tls::normalize_host(host.as_bytes()).is_none() {
            return Err(format!("invalid host name {host:?}"));
        }
        Ok(BackendAddress::Dns {
            host: host.to_owned(),
            port,
        })
    }
}

impl fmt::Display for BackendAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendAddress::Ip(a) => a.fmt(f),
            BackendAddress::Dns { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

impl Serialize for BackendAddress {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Milliseconds from [`epoch`] to `now` (0 for an instant before it).
fn ms_since_epoch(now: Instant) -> u64 {
    now.saturating_duration_since(epoch()).as_millis() as u64
}

/// Load and passive health of one backend address, shared by every route and table
/// generation that names it.
#[derive(Debug, Default)]
pub struct BackendState {
    active: AtomicUsize,
    consecutive_failures: AtomicU32,
    /// Milliseconds since [`epoch`] until which the backend is skipped.
    skip_until_ms: AtomicU64,
}

impl BackendState {
    /// Connections currently open to this backend.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Whether the backend is in back-off at `now`.
    pub fn in_backoff(&self, now: Instant) -> bool {
        self.skip_until_ms.load(Ordering::Relaxed) > ms_since_epoch(now)
    }

    /// Records a connect that failed at `now`: back off for a time that doubles per
    /// consecutive failure, from [`BACKOFF_BASE`] to [`BACKOFF_MAX`].
    pub fn record_failure(&self, now: Instant) {
        let n = self
            .consecutive_failures
            .fetch_add(1, Ordering::Relaxed)
            .min(16);
        let backoff = BACKOFF_BASE.saturating_mul(1 << n.min(5)).min(BACKOFF_MAX);
        self.skip_until_ms.store(
            ms_since_epoch(now) + backoff.as_millis() as u64,
            Ordering::Relaxed,
        );
    }

    /// Records a successful connect: clears the back-off.
    pub fn record_success(&self) {
        self.consecutive_failures.store(0, Ordering::Relaxed);
        self.skip_until_ms.store(0, Ordering::Relaxed);
    }

    /// Counts a connection as active until the guard is dropped.
    pub fn track(self: &Arc<Self>) -> BackendGuard {
        self.active.fetch_add(1, Ordering::Relaxed);
        BackendGuard(self.clone())
    }
}

/// Holds one active connection on a backend.
#[derive(Debug)]
pub struct BackendGuard(Arc<BackendState>);

impl Drop for BackendGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Hands out one [`BackendState`] per address, so that state survives table reloads.
#[derive(Debug, Default)]
pub struct BackendRegistry {
    states: Mutex<Registry>,
}

#[derive(Debug, Default)]
struct Registry {
    map: HashMap<BackendAddress, Weak<BackendState>>,
    /// Sweep dead entries when the map grows past this (twice its size after the last sweep),
    /// so sweeping stays amortised O(1) per insert.
    sweep_at: usize,
}

impl BackendRegistry {
    /// The state for `address`, shared with every live table that names it.
    pub fn state(&self, address: &BackendAddress) -> Arc<BackendState> {
        // A poisoned lock only means another thread panicked mid-insert; the map is still
        // consistent (insert is atomic from our point of view).
        let mut reg = self.states.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = reg.map.get(address).and_then(Weak::upgrade) {
            return s;
        }
        if reg.map.len() >= reg.sweep_at.max(1024) {
            reg.map.retain(|_, w| w.strong_count() > 0);
            reg.sweep_at = reg.map.len() * 2;
        }
        let s = Arc::new(BackendState::default());
        reg.map.insert(address.clone(), Arc::downgrade(&s));
        s
    }

    /// Drops the entries of addresses no live table names any more, and the map's spare
    /// room: after a huge table was replaced by a small one, its dead entries (each a weak
    /// reference that keeps its state's allocation) would otherwise stay until the map grew
    /// again. Returns the entries left.
    pub fn sweep(&self) -> usize {
        let mut reg = self.states.lock().unwrap_or_else(|e| e.into_inner());
        reg.map.retain(|_, w| w.strong_count() > 0);
        reg.map.shrink_to_fit();
        reg.sweep_at = reg.map.len() * 2;
        reg.map.len()
    }

    /// Entries held, dead or alive.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.states
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map
            .len()
    }
}

/// A small xorshift generator for tie-breaking; not for anything secret.
fn random_u64() -> u64 {
    use std::cell::Cell;
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            let seed = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0x9e37_79b9_7f4a_7c15);
            seed | 1
        });
    }
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        x
    })
}

impl Route {
    /// Backends in the order to try them at `now`, for a gateway in `zone`.
    pub fn backend_order(&self, zone: Option<&str>, now: Instant) -> Vec<&Backend> {
        // Rank: 0 = healthy in our zone, 1 = other healthy, 2 = in back-off.
        let any_local_healthy = zone.is_some()
            && self
                .backends
                .iter()
                .any(|b| b.zone.as_deref() == zone && !b.state.in_backoff(now));
        let mut ranked: Vec<(u8, usize, u64, &Backend)> = self
            .backends
            .iter()
            .map(|b| {
                let rank = if b.state.in_backoff(now) {
                    2
                } else if any_local_healthy && b.zone.as_deref() != zone {
                    1
                } else {
                    0
                };
                (rank, b.state.active(), random_u64(), b)
            })
            .collect();
        ranked.sort_unstable_by_key(|&(rank, active, tie, _)| (rank, active, tie));
        ranked.into_iter().map(|(.., b)| b).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(reg: &BackendRegistry, addr: &str, zone: Option<&str>) -> Backend {
        let address = BackendAddress::parse(addr).unwrap();
        Backend {
            state: reg.state(&address),
            address,
            zone: zone.map(Into::into),
        }
    }

    fn route(backends: Vec<Backend>) -> Route {
        Route::new::<&str, &str>("r", &[], &[], vec![], backends).unwrap()
    }

    fn order(r: &Route, zone: Option<&str>) -> Vec<String> {
        r.backend_order(zone, Instant::now())
            .iter()
            .map(|b| b.address.to_string())
            .collect()
    }

    #[test]
    fn parses_addresses() {
        assert!(matches!(
            BackendAddress::parse("10.1.2.3:443"),
            Ok(BackendAddress::Ip(_))
        ));
        assert!(matches!(
            BackendAddress::parse("[::1]:443"),
            Ok(BackendAddress::Ip(_))
        ));
        assert_eq!(
            BackendAddress::parse("kube-apiserver.ns.svc.cluster.local:443"),
            Ok(BackendAddress::Dns {
                host: "kube-apiserver.ns.svc.cluster.local".into(),
                port: 443
            })
        );
        for bad in ["10.1.2.3", "host:0", "host:x", "::1:443", "a b:1", ":443"] {
            assert!(BackendAddress::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn prefers_zone_then_least_active() {
        let reg = BackendRegistry::default();
        let r = route(vec![
            backend(&reg, "10.0.0.1:1", Some("a")),
            backend(&reg, "10.0.0.2:1", Some("b")),
            backend(&reg, "10.0.0.3:1", Some("b")),
        ]);
        assert_eq!(order(&r, Some("a"))[0], "10.0.0.1:1");
        assert_eq!(order(&r, Some("b"))[2], "10.0.0.1:1");
        let _g = r.backends[1].state.track();
        assert_eq!(order(&r, Some("b"))[0], "10.0.0.3:1");
        // Failed local backend: others first, the failed one last.
        r.backends[0].state.record_failure(Instant::now());
        assert_eq!(order(&r, Some("a"))[2], "10.0.0.1:1");
        r.backends[0].state.record_success();
        assert_eq!(order(&r, Some("a"))[0], "10.0.0.1:1");
    }

    #[test]
    fn backoff_doubles_per_failure_in_a_row_up_to_its_cap() {
        let state = BackendState::default();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut at = t0;
        let mut lengths = Vec::new();
        for _ in 0..8 {
            state.record_failure(at);
            assert!(state.in_backoff(at));
            // The back-off ends at the first millisecond it no longer covers.
            let mut len = 0;
            while state.in_backoff(at + ms(len)) {
                len += 250;
            }
            lengths.push(len / 1000);
            at += ms(len);
        }
        assert_eq!(lengths, [1, 2, 4, 8, 16, 30, 30, 30]);
        state.record_success();
        assert!(!state.in_backoff(at));
        state.record_failure(at);
        assert!(
            !state.in_backoff(at + BACKOFF_BASE),
            "a success starts over"
        );
    }

    #[test]
    fn ties_are_broken_randomly() {
        let reg = BackendRegistry::default();
        let r = route(vec![
            backend(&reg, "10.0.0.1:1", None),
            backend(&reg, "10.0.0.2:1", None),
        ]);
        let firsts: std::collections::HashSet<String> =
            (0..200).map(|_| order(&r, None)[0].clone()).collect();
        assert_eq!(firsts.len(), 2);
    }

    #[test]
    fn state_survives_in_registry() {
        let reg = BackendRegistry::default();
        let a = reg.state(&BackendAddress::parse("10.0.0.1:1").unwrap());
        let _g = a.track();
        let b = reg.state(&BackendAddress::parse("10.0.0.1:1").unwrap());
        assert_eq!(b.active(), 1);
    }

    #[test]
    fn a_sweep_drops_the_states_no_table_holds_and_keeps_the_rest() {
        let reg = BackendRegistry::default();
        let kept = reg.state(&BackendAddress::parse("10.0.0.1:1").unwrap());
        let _g = kept.track();
        for i in 0..500u16 {
            drop(reg.state(&BackendAddress::parse(&format!("10.1.0.1:{i}")).unwrap()));
        }
        // Fewer entries than the growth sweep needs: the dead ones are still held.
        assert_eq!(reg.len(), 501);
        assert_eq!(reg.sweep(), 1);
        assert_eq!(reg.len(), 1);
        // The live state is the one handed out again.
        let again = reg.state(&BackendAddress::parse("10.0.0.1:1").unwrap());
        assert_eq!(again.active(), 1);
    }
}
