//! The `wireguard` listener's wiring: its UDP socket and key, and a task that keeps the
//! tunnel's shoots in step with the routing table (each applied table's `tunnel` sections)
//! and with the key file (re-read on change; a new key restarts every tunnel).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::table::Snapshot;
use crate::route::{Tunnel, read_key_file};
use crate::serve::watch::{DirWatches, Watched};
use crate::tunnel::Tunnels;

/// The `(route, tunnel)` pairs of a table.
fn tunnels_of(snapshot: &Snapshot) -> Vec<(Arc<str>, &Tunnel)> {
    snapshot
        .table()
        .routes()
        .iter()
        .filter_map(|r| Some((Arc::<str>::from(r.name()), r.tunnel.as_deref()?)))
        .collect()
}

/// Applies every table and key change to `tunnels` until the table channel closes.
pub(super) async fn keep_current(
    tunnels: Tunnels,
    key_file: PathBuf,
    mut tables: watch::Receiver<Arc<Snapshot>>,
    watches: DirWatches,
    interval: Duration,
    hup: watch::Receiver<()>,
) {
    let first = tables.borrow_and_update().clone();
    tunnels.apply(&tunnels_of(&first), None);
    let mut watched = Watched::new(
        &watches,
        "WireGuard private key",
        std::iter::once(key_file.as_path()),
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
                tunnels.apply(&tunnels_of(&snapshot), None);
            }
            _ = watched.next() => {
                match read_key_file(&key_file) {
                    Ok(key) => {
                        let snapshot = tables.borrow().clone();
                        tunnels.apply(&tunnels_of(&snapshot), Some(key));
                    }
                    Err(e) => tracing::warn!(error = %e, "WireGuard private key not reloaded; the current key stays"),
                }
            }
        }
    }
}
