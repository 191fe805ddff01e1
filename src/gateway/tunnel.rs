//! The `wireguard` listener's wiring: its UDP socket and key, a task that keeps the
//! tunnel's shoots in step with the routing table (each applied table's `tunnel` sections)
//! and with the key file (re-read on change; a new key restarts every tunnel), and the
//! CONNECTs to its `connectDestination` whose streams carry WireGuard over TCP.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::Shared;
use super::conn::Conn;
use super::table::Snapshot;
use crate::config::gateway::{Listener, ListenerKind};
use crate::net::relay::{End, IoKind, Stats};
use crate::route::{Tunnel, read_key_file};
use crate::serve::record::Reason;
use crate::serve::watch::{DirWatches, Watched};
use crate::tunnel::Tunnels;

/// The answer to a CONNECT that carries WireGuard.
const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";

/// The `wireguard` listener's `connectDestination` and the listener's name, if it has one.
pub(super) fn connect_destination(listeners: &[Listener]) -> Option<(String, String)> {
    listeners.iter().find_map(|l| match l.kind() {
        ListenerKind::WireGuard {
            connect_destination: Some(d),
            ..
        } => Some((d.to_owned(), l.name.0.clone())),
        _ => None,
    })
}

/// Serves a CONNECT to the device's `connectDestination` (its head consumed): answers `200`
/// and carries the stream as an endpoint of the device until it ends, for as long as it
/// sends something within `timeouts.idle`; one that brings no packet a peer's key
/// authenticates within `timeouts.handshake` is closed (`not_authenticated`). It is counted `routed` on its listener, and the
/// drain does not wait for it: it ends once the tunneled streams have. One access-log line:
/// backend `wireguard:<listener>`, the bytes each way (frame headers included) and why it
/// ended.
pub(super) async fn carry(
    conn: Box<Conn<TcpStream>>,
    tunnels: &Tunnels,
    listener: &str,
    shared: &Shared,
) {
    let (mut stream, early, mut record, mut guard) = conn.into_stream();
    record.backend = Some(format!("wireguard:{listener}"));
    if let Err(e) = stream.write_all(ESTABLISHED).await {
        record.finish(Reason::Relay(End::Error(IoKind::of(&e))), Stats::default());
        return;
    }
    record.listener_metrics().routed.inc();
    guard.background();
    let endpoint = tunnels.open_stream(record.client);
    tracing::debug!(client = %record.client, endpoint = %endpoint.endpoint(), "WireGuard over TCP: stream opened");
    let idle = shared.config.timeouts.idle;
    let handshake = shared.config.timeouts.handshake;
    let carried = tunnels
        .carry(endpoint, stream, early, idle, Some(handshake))
        .await;
    record.finish(Reason::Relay(carried.end), carried.stats);
    drop(guard);
}

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
