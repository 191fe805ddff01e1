//! The live routing table: loaded at start, re-read on file change, SIGHUP and a timer (as
//! [`crate::serve::watch`] decides), and published in one atomic swap. A table that fails to
//! parse or validate is never applied; the last good one stays. Connections take one
//! snapshot when they are accepted.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use serde::Serialize;
use tokio::sync::watch;

use crate::admin::Metrics;
use crate::config::ConfigError;
use crate::config::routes::{self, LoadedTable, RawRoute, RawRoutingTable};
use crate::route::{BackendRegistry, RoutingTable};
use crate::serve::watch::{Clock, DirWatches, Tracked, Trigger, Watched};
#[cfg(test)]
use crate::serve::watch::{RACY_STAMP, Stamp};

/// The live state of a route's tunnel peer (route name, the peer's index), for `/routes`.
pub(crate) type LiveState<'a> = dyn Fn(&str, usize) -> Option<serde_json::Value> + 'a;

/// One published table.
#[derive(Debug)]
pub(crate) struct Snapshot {
    /// Increments with every applied change, starting at 1.
    pub generation: u64,
    /// The table and what it was built from.
    pub loaded: LoadedTable,
    /// When it was applied.
    pub applied_at: SystemTime,
}

impl Snapshot {
    /// The indexed table.
    pub(crate) fn table(&self) -> &RoutingTable {
        &self.loaded.table
    }
}

/// Result of one reload attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reload {
    /// A new table is active.
    Applied,
    /// The file is byte-for-byte what is active.
    Unchanged,
    /// The file is invalid or unreadable; the previous table stays.
    Rejected,
}

impl Reload {
    /// Metric label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Reload::Applied => "applied",
            Reload::Unchanged => "unchanged",
            Reload::Rejected => "rejected",
        }
    }
}

/// Holds the active table and reloads it.
pub(crate) struct Tables {
    /// What connections read (one atomic load per connection).
    current: ArcSwap<Snapshot>,
    /// The same snapshots for subscribers ([`Tables::subscribe`]).
    changes: watch::Sender<Arc<Snapshot>>,
    clock: Clock,
    file: PathBuf,
    registry: BackendRegistry,
    metrics: Arc<Metrics>,
    /// Serialises reloads so generations are applied in order, and remembers what was read.
    reload_lock: Mutex<ReadState>,
    /// Times the file was read (for tests: a skipped read is the point of a file's stamp).
    reads: std::sync::atomic::AtomicU64,
    /// `(listener, route)` for every listener with a `defaultRoute`: checked against every
    /// table loaded.
    default_routes: Vec<(String, String)>,
    /// `(listener, destination)`: CONNECT destinations no route may have (the `wireguard`
    /// listener's `connectDestination`); a table with one is refused.
    reserved: Vec<(String, String)>,
}

/// Every route destination of `table` that is in `reserved`, as errors against `file`.
fn check_reserved(
    reserved: &[(String, String)],
    table: &RoutingTable,
    file: &Path,
) -> Result<(), ConfigError> {
    let mut errors = crate::config::Errors::default();
    for (i, route) in table.routes().iter().enumerate() {
        for (j, d) in route.destinations().enumerate() {
            if let Some((listener, _)) = reserved.iter().find(|(_, r)| r == d) {
                errors.push(
                    format!("routes[{i}].destinations[{j}]"),
                    format!(
                        "{d:?} is the connectDestination of wireguard listener {listener:?} (WireGuard over TCP); no route may have it"
                    ),
                );
            }
        }
    }
    errors.finish(file, ())
}

/// What the last reload attempt learned about the file.
#[derive(Debug)]
struct ReadState {
    /// Hash of the last rejected file, so an unchanged bad file is not re-parsed and
    /// re-counted on every tick.
    last_rejected: Option<String>,
    /// The file and its stamp as last read.
    file: Tracked,
}

impl Tables {
    /// Loads the initial table; an invalid table is an error (nothing to fall back to). Says
    /// nothing: see [`Tables::say_started`].
    pub(crate) fn load(file: &Path, metrics: Arc<Metrics>) -> Result<Self, ConfigError> {
        Self::load_with_clock(file, metrics, Arc::new(SystemTime::now))
    }

    /// [`Tables::load`] with a wall clock of the caller's.
    pub(crate) fn load_with_clock(
        file: &Path,
        metrics: Arc<Metrics>,
        clock: Clock,
    ) -> Result<Self, ConfigError> {
        let registry = BackendRegistry::default();
        let mut tracked = Tracked::new(file);
        let loaded = tracked.read_now(clock(), |file| routes::load(file, &registry))?;
        let snapshot = Snapshot {
            generation: 1,
            loaded,
            applied_at: SystemTime::now(),
        };
        metrics.table_generation.set(1);
        metrics
            .table_routes
            .set(snapshot.table().routes().len() as i64);
        metrics.reload(Reload::Applied.label());
        // Said by `say_started` once the gateway starts: a gateway that then refuses to
        // start (a key it cannot read) must not have said that a table is in force.
        let snapshot = Arc::new(snapshot);
        Ok(Tables {
            current: ArcSwap::new(snapshot.clone()),
            changes: watch::Sender::new(snapshot),
            clock,
            file: file.to_owned(),
            registry,
            metrics,
            reload_lock: Mutex::new(ReadState {
                last_rejected: None,
                file: tracked,
            }),
            reads: 1.into(),
            default_routes: Vec::new(),
            reserved: Vec::new(),
        })
    }

    /// Reserves CONNECT destinations (`(listener, destination)`) that no route may have: the
    /// active table is checked now (an error if it has one: the gateway does not start) and
    /// every table loaded later is refused if it has one (the last good table stays).
    pub(crate) fn reserve_destinations(
        &mut self,
        reserved: Vec<(String, String)>,
    ) -> Result<(), ConfigError> {
        self.reserved = reserved;
        check_reserved(&self.reserved, self.snapshot().table(), &self.file)
    }

    /// Names the listeners' default routes (`(listener, route)`), checks them against the
    /// active table now and against every table applied later: one missing is warned about
    /// and shown in `trellis_default_route_missing` (unmatched traffic on that listener is
    /// rejected while it is missing).
    pub(crate) fn set_default_routes(&mut self, defaults: Vec<(String, String)>) {
        self.default_routes = defaults;
        self.check_default_routes(&self.snapshot());
    }

    fn check_default_routes(&self, snapshot: &Snapshot) {
        for (listener, route) in &self.default_routes {
            let missing = snapshot.table().by_name(route).is_none();
            if missing {
                tracing::warn!(
                    listener,
                    default_route = route,
                    generation = snapshot.generation,
                    "the listener's defaultRoute is not in the routing table; unmatched \
                     connections are rejected"
                );
            }
            self.metrics
                .default_route_missing
                .get_or_create(&crate::admin::metrics::ListenerLabel {
                    listener: listener.clone(),
                })
                .set(i64::from(missing));
        }
    }

    /// Says that the table loaded at start (`snapshot`, taken before the table watcher
    /// runs, which may apply a newer one meanwhile) is in force: called once the gateway
    /// has everything it needs to start.
    pub(crate) fn say_started(snapshot: &Snapshot) {
        tracing::info!(
            result = Reload::Applied.label(),
            trigger = "start",
            generation = snapshot.generation,
            routes = snapshot.table().routes().len(),
            hash = snapshot.loaded.hash,
            "routing table applied"
        );
    }

    /// The table new connections use now.
    pub(crate) fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// Every table applied from now on, starting with the current one: for parts that
    /// reconcile state with the table (tunnel peers) rather than read it per connection.
    /// A slow subscriber sees the latest table, not every one in between.
    pub(crate) fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.changes.subscribe()
    }

    /// Re-reads the file (as on SIGHUP) and applies it if it changed and is valid.
    #[cfg(test)]
    pub(crate) fn reload(&self) -> Reload {
        self.reload_with(Trigger::Hup)
    }

    /// Like [`Tables::reload`], but the file is not even read when its stamp shows it
    /// unchanged since the last read: for directory events, which a file written next to the
    /// table raises too.
    #[cfg(test)]
    pub(crate) fn reload_if_changed(&self) -> Reload {
        self.reload_with(Trigger::Watch)
    }

    /// One reload attempt; every outcome is counted and logged with the generation and
    /// route count in force afterwards.
    fn reload_with(&self, trigger: Trigger) -> Reload {
        // A poisoned lock still holds a usable state.
        let mut state = self.reload_lock.lock().unwrap_or_else(|e| e.into_inner());
        let result = self.try_reload(&mut state, trigger);
        self.metrics.reload(result.label());
        // Also on unchanged ticks: a removed route's series go once its last connection has.
        let current = self.snapshot();
        let dropped = self
            .metrics
            .forget_routes(|name| current.table().by_name(name).is_some());
        if dropped > 0 {
            tracing::debug!(
                routes = dropped,
                "dropped the metric series of removed routes"
            );
        }
        result
    }

    fn try_reload(&self, state: &mut ReadState, trigger: Trigger) -> Reload {
        let started = std::time::Instant::now();
        let read = state.file.read(trigger, (self.clock)(), |file| {
            self.reads
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            crate::config::read_file(file)
        });
        let Some(read) = read else {
            // A file written next to the table; not worth a line.
            return Reload::Unchanged;
        };
        let bytes = match read {
            Ok(b) => b,
            Err(e) => {
                let current = self.snapshot();
                tracing::error!(
                    result = Reload::Rejected.label(),
                    trigger = trigger.as_str(),
                    generation = current.generation,
                    routes = current.table().routes().len(),
                    error = %e,
                    "routing table not reloaded; keeping the last good table"
                );
                // The stamp is kept: an unreadable or oversized file is not re-read (and
                // re-logged) on every event until its stamp changes.
                return Reload::Rejected;
            }
        };
        let last_rejected = &mut state.last_rejected;
        let current = self.current.load();
        let hash = routes::content_hash(&bytes);
        let same_as = if hash == current.loaded.hash {
            Some("the active table")
        } else if last_rejected.as_deref() == Some(hash.as_str()) {
            Some("the version rejected before")
        } else {
            None
        };
        if let Some(same_as) = same_as {
            let (generation, routes) = (current.generation, current.table().routes().len());
            let trigger = trigger.as_str();
            let result = Reload::Unchanged.label();
            // An operator asked (SIGHUP): every outcome gets an info line. The periodic
            // re-read would add one every `routes.checkInterval`: debug level only.
            if trigger == Trigger::Hup.as_str() {
                tracing::info!(
                    result,
                    trigger,
                    generation,
                    routes,
                    same_as,
                    "routing table unchanged"
                );
            } else {
                tracing::debug!(
                    result,
                    trigger,
                    generation,
                    routes,
                    same_as,
                    "routing table unchanged"
                );
            }
            return Reload::Unchanged;
        }
        // Hashed once: the hash that decided "changed" is the new table's.
        let parsed = routes::parse_hashed(&self.file, &bytes, hash.clone(), &self.registry)
            .and_then(|loaded| {
                check_reserved(&self.reserved, &loaded.table, &self.file)?;
                Ok(loaded)
            });
        match parsed {
            Ok(loaded) => {
                let generation = current.generation + 1;
                let count = loaded.table.routes().len();
                let hash = loaded.hash.clone();
                let snapshot = Arc::new(Snapshot {
                    generation,
                    loaded,
                    applied_at: SystemTime::now(),
                });
                self.current.store(snapshot.clone());
                self.changes.send_replace(snapshot);
                self.metrics.table_generation.set(generation as i64);
                self.metrics.table_routes.set(count as i64);
                // Read, hash, parse, validate, index and swap: what a reload costs before new
                // connections see the table (the old table is freed afterwards).
                let apply_ms = started.elapsed().as_secs_f64() * 1000.0;
                tracing::info!(
                    result = Reload::Applied.label(),
                    trigger = trigger.as_str(),
                    generation,
                    routes = count,
                    hash,
                    apply_ms,
                    "routing table applied"
                );
                self.check_default_routes(&self.snapshot());
                Reload::Applied
            }
            Err(e) => {
                tracing::error!(
                    result = Reload::Rejected.label(),
                    trigger = trigger.as_str(),
                    generation = current.generation,
                    routes = current.table().routes().len(),
                    error = %e,
                    "routing table rejected; keeping the last good table"
                );
                *last_rejected = Some(hash);
                Reload::Rejected
            }
        }
    }

    /// The active table as JSON, for `/routes`: rendered from the indexed table (names
    /// normalised, durations canonical), so no copy of the file stays in memory.
    pub(crate) fn to_json(&self) -> String {
        self.to_json_live(None)
    }

    /// [`Tables::to_json`] with each tunnel peer's live state from `live(route, peer)`: the
    /// table in the file's schema ([`RawRoute`]), after what was applied when.
    pub(crate) fn to_json_live(&self, live: Option<&LiveState<'_>>) -> String {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct View<'a> {
            generation: u64,
            hash: &'a str,
            applied_at: u64,
            file: &'a Path,
            #[serde(flatten)]
            table: RawRoutingTable,
        }
        let s = self.snapshot();
        let routes = s
            .table()
            .routes()
            .iter()
            .map(|r| {
                let mut raw = RawRoute::from(&**r);
                if let (Some(tunnel), Some(live)) = (&mut raw.tunnel, live) {
                    for (i, peer) in tunnel.wireguard.peers.iter_mut().enumerate() {
                        peer.state = live(r.name(), i);
                    }
                }
                raw
            })
            .collect();
        let view = View {
            generation: s.generation,
            hash: &s.loaded.hash,
            applied_at: s
                .applied_at
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            file: &self.file,
            table: RawRoutingTable::new(routes),
        };
        serde_json::to_string_pretty(&view).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// Reloads whenever the file's directory changes (ConfigMap volumes swap a symlink in
    /// it), every `interval`, and whenever `hup` changes (SIGHUP). Runs until the task is
    /// dropped.
    pub(crate) async fn watch(
        self: Arc<Self>,
        watches: DirWatches,
        interval: Duration,
        hup: watch::Receiver<()>,
    ) {
        let mut watched = Watched::new(
            &watches,
            "routing table",
            [self.file.as_path()],
            interval,
            hup,
        );
        loop {
            let trigger = watched.next().await;
            if trigger == Trigger::Hup {
                tracing::info!("SIGHUP: re-reading the routing table");
            }
            // This runs on the control-plane thread, not on a connection worker, so parsing a
            // large table here delays no traffic; staying on one thread also keeps glibc from
            // growing a new heap arena per reload thread.
            match self.reload_with(trigger) {
                Reload::Applied => {
                    // The old table is gone unless a connection still holds it: its
                    // backends' states go with it, and the next sweep takes the rest.
                    let backends = self.registry.sweep();
                    tracing::debug!(backends, "backend states swept");
                    crate::serve::memory::release_free_memory();
                }
                // Validating a rejected table registered a state per address it names.
                Reload::Rejected => {
                    self.registry.sweep();
                }
                Reload::Unchanged => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    fn table(port: u16) -> String {
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n- name: r\n  sni: [r.example.com]\n  backends:\n  - address: \"127.0.0.1:{port}\"\n"
        )
    }

    #[test]
    fn checks_skip_reading_a_file_whose_stamp_is_unchanged() {
        let dir = std::env::temp_dir().join(format!("trellis-stamp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("routes.yaml");
        std::fs::write(&file, table(7001)).unwrap();
        // The wall clock plus an offset the test moves instead of sleeping.
        let offset = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let clock: Clock = {
            let offset = offset.clone();
            Arc::new(move || {
                SystemTime::now() + Duration::from_millis(offset.load(Ordering::Relaxed))
            })
        };
        let t = Tables::load_with_clock(&file, Arc::new(Metrics::gateway()), clock).unwrap();
        let reads = || t.reads.load(Ordering::Relaxed);
        let port = |t: &Tables| {
            t.snapshot().table().routes()[0].backends[0]
                .address
                .to_string()
        };

        // A rewrite of the same size right away is seen (its stamp is not trusted yet, or
        // differs, depending on the file system's timestamp granularity).
        std::fs::write(&file, table(7002)).unwrap();
        assert_eq!(t.reload_if_changed(), Reload::Applied);
        assert_eq!(port(&t), "127.0.0.1:7002");
        // The next version, ConfigMap style: written now, swapped in by a symlink later.
        std::fs::write(dir.join("v3.yaml"), table(7003)).unwrap();

        let quiet = || {
            let step = (RACY_STAMP + Duration::from_millis(100)).as_millis() as u64;
            offset.fetch_add(step, Ordering::Relaxed);
        };
        quiet();
        // Now trusted: at most one more read takes the stamp, then checks read nothing.
        assert_eq!(t.reload_if_changed(), Reload::Unchanged);
        let seen = reads();
        assert_eq!(t.reload_if_changed(), Reload::Unchanged);
        assert_eq!(t.reload_if_changed(), Reload::Unchanged);
        assert_eq!(reads(), seen, "an unchanged stamp skips the read");
        // SIGHUP and the periodic check read regardless.
        assert_eq!(t.reload(), Reload::Unchanged);
        assert_eq!(reads(), seen + 1);

        // Swapped to another inode whose times are old: the stamp differs.
        std::os::unix::fs::symlink(dir.join("v3.yaml"), dir.join("next")).unwrap();
        std::fs::rename(dir.join("next"), &file).unwrap();
        assert_eq!(t.reload_if_changed(), Reload::Applied);
        assert_eq!(port(&t), "127.0.0.1:7003");
        // Rewritten in place with the same size, and checked only once that stamp is trusted
        // too: the times differ.
        quiet();
        assert_eq!(t.reload_if_changed(), Reload::Unchanged);
        std::fs::write(dir.join("v3.yaml"), table(7004)).unwrap();
        // On a file system whose times move once per clock tick, a rewrite this soon could
        // keep every part of the stamp: the modification time is set apart explicitly, as
        // the next tick would.
        std::fs::File::options()
            .write(true)
            .open(dir.join("v3.yaml"))
            .unwrap()
            .set_modified(SystemTime::now() + Duration::from_secs(5))
            .unwrap();
        quiet();
        assert_eq!(t.reload_if_changed(), Reload::Applied);
        assert_eq!(port(&t), "127.0.0.1:7004");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A route destination equal to the `wireguard` listener's `connectDestination` is a
    /// clear error at start (the table the gateway would start with) and on every reload
    /// (refused; the last good table stays), naming the route, the listener and the file.
    #[test]
    fn a_route_with_the_connect_destination_is_refused_at_start_and_on_reload() {
        let dir = std::env::temp_dir().join(format!("trellis-reserved-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("routes.yaml");
        let with = |destination: &str| {
            format!(
                "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n- name: a\n  sni: [a.example.com]\n  backends: [{{address: \"127.0.0.1:1\"}}]\n- name: b\n  destinations: [\"other:1\", \"{destination}\"]\n  backends: [{{address: \"127.0.0.1:2\"}}]\n"
            )
        };
        let reserved = || vec![("wg".to_string(), "trellis-wireguard:51820".to_string())];
        std::fs::write(&file, with("trellis-wireguard:51820")).unwrap();
        let mut t = Tables::load(&file, Arc::new(Metrics::gateway())).unwrap();
        let err = t.reserve_destinations(reserved()).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "{}: routes[1].destinations[1]: \"trellis-wireguard:51820\" is the connectDestination of wireguard listener \"wg\" (WireGuard over TCP); no route may have it",
                file.display()
            )
        );

        std::fs::write(&file, with("vpn:1194")).unwrap();
        let mut t = Tables::load(&file, Arc::new(Metrics::gateway())).unwrap();
        t.reserve_destinations(reserved()).unwrap();
        std::fs::write(&file, with("trellis-wireguard:51820")).unwrap();
        assert_eq!(t.reload(), Reload::Rejected);
        assert!(t.snapshot().table().by_destination("vpn:1194").is_some());
        assert!(
            t.snapshot()
                .table()
                .by_destination("trellis-wireguard:51820")
                .is_none()
        );
        std::fs::write(&file, with("vpn:1195")).unwrap();
        assert_eq!(t.reload(), Reload::Applied);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file changed within the racy window is read on every check: its stamp may not move
    /// with a second write in the same clock tick.
    #[test]
    fn a_fresh_stamp_is_not_trusted() {
        let dir = std::env::temp_dir().join(format!("trellis-racy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("routes.yaml");
        std::fs::write(&file, table(7001)).unwrap();
        let now = SystemTime::now();
        assert_eq!(Stamp::of(&file, now), None, "changed just now");
        let later = now + RACY_STAMP + Duration::from_millis(10);
        let stamp = Stamp::of(&file, later).expect("trusted once the window has passed");
        assert_eq!(stamp.len, table(7001).len() as u64);
        assert_eq!(Stamp::of(&dir.join("missing"), later), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `/routes` is the table in the file's schema, each tunnel peer with the state the hook
    /// has for its route and index (none where it has nothing).
    #[test]
    fn the_routes_view_adds_each_peers_live_state() {
        let dir = std::env::temp_dir().join(format!("trellis-view-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("routes.yaml");
        let key = |b: u8| crate::route::WgKey([b; 32]).to_base64();
        std::fs::write(
            &file,
            format!(
                "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n- name: t\n  tunnel:\n    wireguard:\n      peers:\n      - {{publicKey: \"{}\", allowedIPs: [\"10.250.0.0/16\"]}}\n      - {{publicKey: \"{}\", allowedIPs: [192.168.128.6]}}\n      localAddresses: [192.168.128.1]\n",
                key(1),
                key(2)
            ),
        )
        .unwrap();
        let t = Tables::load(&file, Arc::new(Metrics::gateway())).unwrap();
        let live = |route: &str, i: usize| {
            (route == "t" && i == 1).then(|| serde_json::json!({"endpoint": "203.0.113.9:1"}))
        };
        let shown: serde_json::Value = serde_json::from_str(&t.to_json_live(Some(&live))).unwrap();
        assert_eq!(shown["generation"], 1);
        assert_eq!(shown["kind"], "RoutingTable");
        assert_eq!(
            shown["routes"][0],
            serde_json::json!({"name": "t", "tunnel": {"wireguard": {
                "peers": [
                    {"publicKey": key(1), "allowedIPs": ["10.250.0.0/16"]},
                    {"publicKey": key(2), "allowedIPs": ["192.168.128.6/32"],
                        "state": {"endpoint": "203.0.113.9:1"}},
                ],
                "localAddresses": ["192.168.128.1"],
            }}})
        );
        let plain: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
        assert!(
            plain["routes"][0]["tunnel"]["wireguard"]["peers"][1]
                .get("state")
                .is_none()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Subscribers see every applied table, and nothing for unchanged or rejected ones.
    #[test]
    fn subscribers_see_applied_tables_only() {
        let dir = std::env::temp_dir().join(format!("trellis-sub-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("routes.yaml");
        std::fs::write(&file, table(7001)).unwrap();
        let t = Tables::load(&file, Arc::new(Metrics::gateway())).unwrap();
        let mut rx = t.subscribe();
        assert_eq!(rx.borrow_and_update().generation, 1);
        assert_eq!(t.reload(), Reload::Unchanged);
        assert!(!rx.has_changed().unwrap());
        std::fs::write(&file, "routes: [").unwrap();
        assert_eq!(t.reload(), Reload::Rejected);
        assert!(
            !rx.has_changed().unwrap(),
            "a rejected table is never published"
        );
        std::fs::write(&file, table(7002)).unwrap();
        assert_eq!(t.reload(), Reload::Applied);
        assert!(rx.has_changed().unwrap());
        let snapshot = rx.borrow_and_update().clone();
        assert_eq!(snapshot.generation, 2);
        assert!(
            Arc::ptr_eq(&snapshot, &t.snapshot()),
            "the table connections use"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
