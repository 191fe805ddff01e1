//! The live routing table: loaded at start, re-read on file change, SIGHUP and a timer, and
//! published in one atomic swap. A table that fails to parse or validate is never applied;
//! the last good one stays. Connections take one snapshot when they are accepted.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::admin::Metrics;
use crate::config::ConfigError;
use crate::config::duration_text;
use crate::config::routes::{self, LoadedTable};
use crate::route::{BackendRegistry, RoutingTable};
use crate::route::{RouteKeyList, RouteTimeouts};

/// One published table.
#[derive(Debug)]
pub struct Snapshot {
    /// Increments with every applied change, starting at 1.
    pub generation: u64,
    /// The table and what it was built from.
    pub loaded: LoadedTable,
    /// When it was applied.
    pub applied_at: SystemTime,
}

impl Snapshot {
    /// The indexed table.
    pub fn table(&self) -> &RoutingTable {
        &self.loaded.table
    }
}

/// Result of one reload attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reload {
    /// A new table is active.
    Applied,
    /// The file is byte-for-byte what is active.
    Unchanged,
    /// The file is invalid or unreadable; the previous table stays.
    Rejected,
}

impl Reload {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            Reload::Applied => "applied",
            Reload::Unchanged => "unchanged",
            Reload::Rejected => "rejected",
        }
    }
}

/// Holds the active table and reloads it.
pub struct Tables {
    current: ArcSwap<Snapshot>,
    file: PathBuf,
    registry: BackendRegistry,
    metrics: Arc<Metrics>,
    /// Serialises reloads so generations are applied in order; holds the hash of the last
    /// rejected file, so an unchanged bad file is not re-parsed and re-counted on every tick.
    reload_lock: Mutex<Option<String>>,
}

impl Tables {
    /// Loads the initial table; an invalid table is an error (nothing to fall back to).
    pub fn load(file: &Path, metrics: Arc<Metrics>) -> Result<Self, ConfigError> {
        let registry = BackendRegistry::default();
        let loaded = routes::load(file, &registry)?;
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
        Ok(Tables {
            current: ArcSwap::from_pointee(snapshot),
            file: file.to_owned(),
            registry,
            metrics,
            reload_lock: Mutex::new(None),
        })
    }

    /// The table new connections use now.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// Re-reads the file and applies it if it changed and is valid.
    pub fn reload(&self) -> Reload {
        // A poisoned lock still holds a usable hash.
        let mut last_rejected = self.reload_lock.lock().unwrap_or_else(|e| e.into_inner());
        let result = self.try_reload(&mut last_rejected);
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

    fn try_reload(&self, last_rejected: &mut Option<String>) -> Reload {
        let started = std::time::Instant::now();
        let bytes = match crate::config::read_file(&self.file) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "routing table not reloaded; keeping the last good table");
                return Reload::Rejected;
            }
        };
        let current = self.current.load();
        let hash = routes::content_hash(&bytes);
        if hash == current.loaded.hash || last_rejected.as_deref() == Some(hash.as_str()) {
            return Reload::Unchanged;
        }
        // Hashed once: the hash that decided "changed" is the new table's.
        match routes::parse_hashed(&self.file, &bytes, hash.clone(), &self.registry) {
            Ok(loaded) => {
                let generation = current.generation + 1;
                let count = loaded.table.routes().len();
                let hash = loaded.hash.clone();
                self.current.store(Arc::new(Snapshot {
                    generation,
                    loaded,
                    applied_at: SystemTime::now(),
                }));
                self.metrics.table_generation.set(generation as i64);
                self.metrics.table_routes.set(count as i64);
                // Read, hash, parse, validate, index and swap: what a reload costs before new
                // connections see the table (the old table is freed afterwards).
                let apply_ms = started.elapsed().as_secs_f64() * 1000.0;
                tracing::info!(
                    generation,
                    routes = count,
                    hash,
                    apply_ms,
                    "routing table applied"
                );
                Reload::Applied
            }
            Err(e) => {
                tracing::error!(error = %e, "routing table rejected; keeping the last good table");
                *last_rejected = Some(hash);
                Reload::Rejected
            }
        }
    }

    /// The active table as JSON, for `/routes`: rendered from the indexed table (names
    /// normalised, durations canonical), so no copy of the file stays in memory.
    pub fn to_json(&self) -> String {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct View<'a> {
            generation: u64,
            hash: &'a str,
            applied_at: u64,
            file: &'a Path,
            api_version: &'static str,
            kind: &'static str,
            routes: Vec<RouteView<'a>>,
        }
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct RouteView<'a> {
            name: &'a str,
            #[serde(skip_serializing_if = "RouteKeyList::is_empty")]
            sni: RouteKeyList<'a>,
            #[serde(skip_serializing_if = "RouteKeyList::is_empty")]
            destinations: RouteKeyList<'a>,
            #[serde(skip_serializing_if = "<[_]>::is_empty")]
            proxy_destinations: &'a [std::net::SocketAddr],
            backends: Vec<BackendView<'a>>,
            #[serde(skip_serializing_if = "Option::is_none")]
            timeouts: Option<TimeoutsView>,
            #[serde(skip_serializing_if = "Option::is_none")]
            max_connection_duration: Option<String>,
        }
        #[derive(Serialize)]
        struct BackendView<'a> {
            address: String,
            #[serde(skip_serializing_if = "Option::is_none")]
            zone: Option<&'a str>,
        }
        #[derive(Serialize)]
        struct TimeoutsView {
            #[serde(skip_serializing_if = "Option::is_none")]
            connect: Option<String>,
            #[serde(skip_serializing_if = "Option::is_none")]
            idle: Option<String>,
        }
        let s = self.snapshot();
        let routes = s
            .table()
            .routes()
            .iter()
            .map(|r| RouteView {
                name: r.name(),
                sni: r.sni(),
                destinations: r.destinations(),
                proxy_destinations: &r.proxy_destinations,
                backends: r
                    .backends
                    .iter()
                    .map(|b| BackendView {
                        address: b.address.to_string(),
                        zone: b.zone.as_deref(),
                    })
                    .collect(),
                timeouts: (r.timeouts != RouteTimeouts::default()).then(|| TimeoutsView {
                    connect: r.timeouts.connect.map(duration_text),
                    idle: r.timeouts.idle.map(duration_text),
                }),
                max_connection_duration: r.max_connection_duration.map(duration_text),
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
            api_version: crate::config::API_VERSION,
            kind: routes::KIND,
            routes,
        };
        serde_json::to_string_pretty(&view).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// Reloads whenever the file's directory changes (ConfigMap volumes swap a symlink in
    /// it), every `interval`, and whenever `hup` fires. Runs until the task is dropped.
    pub async fn watch(self: Arc<Self>, interval: Duration, mut hup: mpsc::Receiver<()>) {
        let (tx, mut events) = mpsc::channel::<()>(1);
        let _watcher = match self.start_watcher(tx) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, dir = %self.dir().display(), "cannot watch the routing table directory; relying on SIGHUP and the periodic re-read");
                None
            }
        };
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                Some(()) = events.recv() => {
                    // Let a burst of events (write, rename, symlink swap) settle.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    while events.try_recv().is_ok() {}
                }
                Some(()) = hup.recv() => tracing::info!("SIGHUP: re-reading the routing table"),
                _ = tick.tick() => {}
            }
            // This runs on the control-plane thread, not on a connection worker, so parsing a
            // large table here delays no traffic; staying on one thread also keeps glibc from
            // growing a new heap arena per reload thread.
            if self.reload() == Reload::Applied {
                release_free_memory();
            }
        }
    }

    fn dir(&self) -> PathBuf {
        match self.file.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        }
    }

    fn start_watcher(&self, tx: mpsc::Sender<()>) -> notify::Result<notify::RecommendedWatcher> {
        use notify::{RecursiveMode, Watcher};
        let mut watcher =
            notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
                if let Ok(ev) = res
                    && !ev.kind.is_access()
                {
                    // A full channel already holds a pending reload.
                    let _ = tx.try_send(());
                }
            })?;
        watcher.watch(&self.dir(), RecursiveMode::NonRecursive)?;
        Ok(watcher)
    }
}

/// Keeps large allocations (a table's route list and indexes, a file's bytes) out of the
/// heap: glibc otherwise raises its mmap threshold after the first such block is freed, and
/// from then on every reload's large blocks fragment the heap so it never shrinks back.
pub fn fix_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a glibc allocator parameter; it has no preconditions.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

/// Returns heap memory freed by the previous table (and by parsing) to the operating system.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks and shrinks glibc's own heaps; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}
