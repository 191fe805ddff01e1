//! The TLS material of the `egress-connect` listeners and of every route's `egress.tls`: one
//! rustls server config per set of files, kept current as the files and the table change.
//!
//! Reads never wait: handshakes look their config up in a map published behind an
//! `ArcSwap`. [`Certs::refresh`] re-reads every file set (on a file change, a table change,
//! `SIGHUP` and periodically) and rebuilds only sets whose bytes changed; a set that fails to
//! load keeps its last good config (logged and counted in
//! `trellis_tls_material_loads_total{result="rejected"}`), so a half-written rotation never
//! takes a shoot down. A set that never loaded has no config: its handshakes are refused.
//! Established connections are never touched: they hold the config they started with.

use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use rustls::ServerConfig;

use crate::admin::metrics::Metrics;
use crate::net::tls::{self, TlsBytes, TlsError};
use crate::route::{RoutingTable, TlsFiles};
use crate::serve::watch::{DirWatches, Watched};

/// One loaded set of files.
#[derive(Debug, Clone)]
struct Loaded {
    /// The config handshakes use; `None` until the files loaded once.
    config: Option<Arc<ServerConfig>>,
    /// A hash of the bytes `config` was built from (or that last failed), to skip unchanged
    /// files.
    hash: u64,
}

/// The configs by file set.
#[derive(Debug)]
pub(crate) struct Certs {
    current: ArcSwap<HashMap<TlsFiles, Loaded>>,
    /// The listeners' sets, always kept.
    listeners: BTreeSet<TlsFiles>,
    /// The sets the active table names.
    routes: Mutex<BTreeSet<TlsFiles>>,
    /// Serialises refreshes (a table change and a file change at once).
    refreshing: Mutex<()>,
    /// When a connection last had a set loaded that the store did not hold yet
    /// ([`Certs::load_missing`]), per set.
    tried: Mutex<HashMap<TlsFiles, std::time::Instant>>,
    metrics: Arc<Metrics>,
}

impl Certs {
    /// Loads the listeners' sets; any that fails is an error (a gateway does not start
    /// with a listener it cannot serve).
    pub(crate) fn new(
        listeners: impl IntoIterator<Item = TlsFiles>,
        metrics: Arc<Metrics>,
    ) -> Result<Certs, TlsError> {
        let listeners: BTreeSet<TlsFiles> = listeners.into_iter().collect();
        let mut map = HashMap::new();
        for files in &listeners {
            let bytes = tls::read(files)?;
            let config = tls::server_config(files, &bytes)?;
            metrics.tls_load("loaded");
            map.insert(
                files.clone(),
                Loaded {
                    config: Some(config),
                    hash: hash(&bytes),
                },
            );
        }
        Ok(Certs {
            current: ArcSwap::from_pointee(map),
            listeners,
            routes: Mutex::new(BTreeSet::new()),
            refreshing: Mutex::new(()),
            tried: Mutex::new(HashMap::new()),
            metrics,
        })
    }

    /// Every file of every set.
    pub(crate) fn paths(&self) -> Vec<std::path::PathBuf> {
        let routes = self.routes.lock().unwrap_or_else(|e| e.into_inner());
        self.listeners
            .union(&routes)
            .flat_map(|f| f.paths().map(|p| p.to_owned()))
            .collect()
    }

    /// The config for `files`, if they ever loaded.
    pub(crate) fn get(&self, files: &TlsFiles) -> Option<Arc<ServerConfig>> {
        self.current.load().get(files)?.config.clone()
    }

    /// Loads `files` for a connection whose route names a set the store does not hold yet
    /// (its table was published a moment before the reload task took the table's sets in).
    /// At most one attempt per set and [`RETRY`]: a client cannot make the gateway read
    /// files for every connection. Blocks on file reads and key parsing.
    pub(crate) fn load_missing(&self, files: &TlsFiles) -> Option<Arc<ServerConfig>> {
        {
            let mut tried = self.tried.lock().unwrap_or_else(|e| e.into_inner());
            let now = std::time::Instant::now();
            if tried
                .get(files)
                .is_some_and(|t| now.duration_since(*t) < RETRY)
            {
                return None;
            }
            tried.insert(files.clone(), now);
        }
        let _one = self.refreshing.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(config) = self.get(files) {
            return Some(config);
        }
        let loaded = match tls::read(files) {
            Ok(bytes) => self.build(files, &bytes, None, hash(&bytes)),
            Err(e) => {
                self.reject(files, &e);
                return None;
            }
        };
        let config = loaded.config.clone()?;
        let mut next = (*self.current.load_full()).clone();
        next.insert(files.clone(), loaded);
        self.current.store(Arc::new(next));
        Some(config)
    }

    /// Takes the file sets `table` names (sets no longer named are dropped) and loads the
    /// new ones.
    pub(crate) fn set_table(&self, table: &RoutingTable) {
        let sets: BTreeSet<TlsFiles> = table
            .routes()
            .iter()
            .filter_map(|r| r.egress.as_ref()?.tls.clone())
            .collect();
        self.tried
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|f, _| sets.contains(f));
        *self.routes.lock().unwrap_or_else(|e| e.into_inner()) = sets;
        self.refresh();
    }

    /// Re-reads every set and rebuilds those whose bytes changed (see the module docs).
    /// Returns how many sets are without a config (never loaded).
    pub(crate) fn refresh(&self) -> usize {
        let _one = self.refreshing.lock().unwrap_or_else(|e| e.into_inner());
        let wanted: Vec<TlsFiles> = {
            let routes = self.routes.lock().unwrap_or_else(|e| e.into_inner());
            self.listeners.union(&routes).cloned().collect()
        };
        let old = self.current.load_full();
        let mut next = HashMap::with_capacity(wanted.len());
        let mut changed = wanted.len() != old.len();
        for files in wanted {
            let prev = old.get(&files);
            let loaded = match tls::read(&files) {
                Ok(bytes) => {
                    let h = hash(&bytes);
                    match prev {
                        Some(p) if p.hash == h => p.clone(),
                        _ => {
                            changed = true;
                            self.build(&files, &bytes, prev, h)
                        }
                    }
                }
                Err(e) => {
                    // Unreadable (a rotation in progress, a removed secret): the last good
                    // config stays. Logged once per change of state, not per refresh.
                    if prev.is_none_or(|p| p.hash != 0) {
                        self.reject(&files, &e);
                    }
                    changed |= prev.is_none_or(|p| p.hash != 0);
                    Loaded {
                        config: prev.and_then(|p| p.config.clone()),
                        hash: 0,
                    }
                }
            };
            next.insert(files, loaded);
        }
        let missing = next.values().filter(|l| l.config.is_none()).count();
        if changed {
            self.current.store(Arc::new(next));
        }
        missing
    }

    fn build(&self, files: &TlsFiles, bytes: &TlsBytes, prev: Option<&Loaded>, h: u64) -> Loaded {
        match tls::server_config(files, bytes) {
            Ok(config) => {
                self.metrics.tls_load("loaded");
                if prev.is_some() {
                    tracing::info!(certificate = %files.certificate_file.display(), "TLS material reloaded");
                }
                Loaded {
                    config: Some(config),
                    hash: h,
                }
            }
            Err(e) => {
                self.reject(files, &e);
                Loaded {
                    config: prev.and_then(|p| p.config.clone()),
                    hash: h,
                }
            }
        }
    }

    fn reject(&self, files: &TlsFiles, e: &TlsError) {
        self.metrics.tls_load("rejected");
        tracing::warn!(
            certificate = %files.certificate_file.display(),
            error = %e,
            kind = e.kind(),
            "TLS material not loaded; the last good material stays in use"
        );
    }
}

/// How long a set that [`Certs::load_missing`] tried is not tried again.
const RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// A hash of a set's bytes (never 0, which marks an unreadable set).
fn hash(bytes: &TlsBytes) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish().max(1)
}

/// Keeps `certs` current: the file sets of every applied table, and every set re-read when
/// a file in their directories changes (ConfigMap and Secret volumes swap a symlink), on
/// SIGHUP, and every `interval`.
pub(crate) async fn keep_current(
    certs: Arc<Certs>,
    mut tables: tokio::sync::watch::Receiver<Arc<crate::gateway::table::Snapshot>>,
    watches: DirWatches,
    interval: std::time::Duration,
    hup: tokio::sync::watch::Receiver<()>,
) {
    let mut watched = Watched::new(
        &watches,
        "TLS material",
        certs.paths().iter().map(|p| p.as_path()),
        interval,
        hup,
    );
    loop {
        tokio::select! {
            changed = tables.changed() => {
                if changed.is_err() {
                    return;
                }
                let snapshot = tables.borrow_and_update().clone();
                let c = certs.clone();
                // File reads and key parsing off the event loop.
                let _ = tokio::task::spawn_blocking(move || c.set_table(snapshot.table())).await;
                watched.set_files(certs.paths().iter().map(|p| p.as_path()));
            }
            _ = watched.next() => {
                let c = certs.clone();
                let _ = tokio::task::spawn_blocking(move || c.refresh()).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::metrics::ResultLabel;

    /// A CA, and a server certificate and key it issued, written into `dir`.
    fn write_set(dir: &std::path::Path) -> TlsFiles {
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
        let cert = rcgen::CertificateParams::new(vec!["vpn-seed-server".to_string()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        let files = TlsFiles {
            certificate_file: dir.join("tls.crt"),
            key_file: dir.join("tls.key"),
            client_ca_file: dir.join("ca.crt"),
        };
        std::fs::write(&files.certificate_file, cert.pem()).unwrap();
        std::fs::write(&files.key_file, key.serialize_pem()).unwrap();
        std::fs::write(&files.client_ca_file, ca.pem()).unwrap();
        files
    }

    #[test]
    fn a_set_missing_from_the_store_is_loaded_for_a_connection_at_most_once_a_second() {
        let dir = std::env::temp_dir().join(format!("trellis-certs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = write_set(&dir);
        let metrics = Arc::new(Metrics::gateway());
        let certs = Certs::new([], metrics.clone()).unwrap();
        assert!(certs.get(&good).is_none());
        assert!(certs.load_missing(&good).is_some());
        assert!(certs.get(&good).is_some(), "the loaded set is kept");

        let missing = TlsFiles {
            client_ca_file: dir.join("nope.crt"),
            ..good.clone()
        };
        let rejected = || {
            metrics
                .tls_loads
                .get_or_create(&ResultLabel { result: "rejected" })
                .get()
        };
        assert!(certs.load_missing(&missing).is_none());
        assert_eq!(rejected(), 1);
        // Tried again at once: not read again.
        assert!(certs.load_missing(&missing).is_none());
        assert_eq!(rejected(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
