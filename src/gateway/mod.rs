//! The seed ingress gateway: binds every listener and the admin endpoint, keeps the routing
//! table current, serves connections, and drains on SIGTERM/SIGINT.
//!
//! Startup binds everything before it reports ready, so a configuration that cannot be
//! served fails before any traffic is accepted. One file per listener protocol; the accept
//! loop and the shared forwarding path (connect, relay, log) live here.

pub mod access;
pub mod conn;
pub mod connect;
pub mod listener;
pub mod proxydst;
pub mod sni;
pub mod table;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};

use crate::admin::metrics::ListenerMetrics;
use crate::admin::{self, AdminState, Metrics};
use crate::config::ConfigError;
use crate::config::gateway::{GatewayConfig, ListenerConfig};
use crate::net::{relay, socket, upstream};
use crate::route::Route;
use crate::wire::http;
use conn::Conn;
use listener::Tracker;
use table::Tables;
use tokio::io::AsyncWriteExt;

/// How long connections cut at the drain deadline get to write their log lines.
const HARD_STOP_GRACE: Duration = Duration::from_secs(2);

/// Why the gateway could not start or run.
#[derive(Debug, Error)]
pub enum GatewayError {
    /// The routing table could not be loaded at startup.
    #[error("routing table: {0}")]
    Routes(#[from] ConfigError),
    /// A listener or the admin endpoint could not be bound.
    #[error("cannot bind {what} on {address}: {source}")]
    Bind {
        /// `listener NAME` or `admin`.
        what: String,
        /// The address.
        address: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// Signal handlers could not be installed.
    #[error("signal handling: {0}")]
    Signals(std::io::Error),
}

/// What every connection task shares.
pub struct Shared {
    /// The validated configuration.
    pub config: GatewayConfig,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The live routing table.
    pub tables: Arc<Tables>,
    /// Open connections.
    pub tracker: Arc<Tracker>,
    /// Cuts every relay when the drain deadline has passed.
    pub hard_stop: relay::Stop,
}

/// Runs the gateway until SIGTERM/SIGINT and a completed drain.
pub async fn run(config: GatewayConfig) -> Result<(), GatewayError> {
    table::fix_mmap_threshold();
    let metrics = Arc::new(Metrics::new());
    let tables = Arc::new(Tables::load(&config.routes_file, metrics.clone())?);
    table::release_free_memory();
    let mut sigterm = signal(SignalKind::terminate()).map_err(GatewayError::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(GatewayError::Signals)?;
    let mut sighup = signal(SignalKind::hangup()).map_err(GatewayError::Signals)?;

    // Bind everything before serving anything: one SO_REUSEPORT socket per listener and
    // worker, so each worker thread accepts and serves its own connections.
    let workers = config.workers.max(1);
    let mut per_worker: Vec<Vec<(Arc<ListenerConfig>, std::net::TcpListener)>> =
        (0..workers).map(|_| Vec::new()).collect();
    for l in &config.listeners {
        let l = Arc::new(l.clone());
        let mut address = l.address;
        for sockets in per_worker.iter_mut() {
            let keepalive = (
                config.keepalive_downstream.idle,
                config.keepalive_downstream.interval,
            );
            let sock =
                socket::bind_std_with(address, socket::LISTEN_BACKLOG, true, Some(keepalive))
                    .map_err(|source| GatewayError::Bind {
                        what: format!("listener {}", l.name),
                        address: l.address,
                        source,
                    })?;
            // Port 0: every worker must share the port the first socket got.
            address = sock.local_addr().unwrap_or(address);
            sockets.push((l.clone(), sock));
        }
    }
    let admin_sock = admin::bind(config.admin)
        .await
        .map_err(|source| GatewayError::Bind {
            what: "admin".into(),
            address: config.admin,
            source,
        })?;

    let json_tables = tables.clone();
    let admin_state = Arc::new(AdminState::new(
        metrics.clone(),
        Some(Box::new(move || json_tables.to_json())),
    ));
    let admin_task = tokio::spawn(admin::serve(admin_sock, admin_state.clone()));

    let (hup_tx, hup_rx) = mpsc::channel(1);
    let watch_task = tokio::spawn(tables.clone().watch(config.routes_check_interval, hup_rx));

    let (stop_tx, stop_rx) = watch::channel(false);
    let drain_timeout = config.timeouts.drain;
    let shared = Arc::new(Shared {
        config,
        metrics: metrics.clone(),
        tables: tables.clone(),
        tracker: Arc::new(Tracker::default()),
        hard_stop: relay::Stop::default(),
    });
    let (exit_tx, exit_rx) = watch::channel(false);
    let mut threads = Vec::new();
    for (i, sockets) in per_worker.into_iter().enumerate() {
        if i == 0 {
            for (l, sock) in &sockets {
                tracing::info!(listener = %l.name, address = ?sock.local_addr().ok(), protocol = l.kind.as_str(), workers, "listening");
            }
        }
        let (shared, stop_rx, exit_rx) = (shared.clone(), stop_rx.clone(), exit_rx.clone());
        let thread = std::thread::Builder::new()
            .name(format!("trellis-w{i}"))
            .spawn(move || worker(sockets, shared, stop_rx, exit_rx))
            .map_err(GatewayError::Signals)?;
        threads.push(thread);
    }
    admin_state.set_ready(true);
    tracing::info!(admin = %shared.config.admin, generation = tables.snapshot().generation, "gateway ready");

    loop {
        tokio::select! {
            _ = sighup.recv() => { let _ = hup_tx.try_send(()); }
            _ = sigterm.recv() => { tracing::info!("SIGTERM: draining"); break; }
            _ = sigint.recv() => { tracing::info!("SIGINT: draining"); break; }
        }
    }

    // Drain: fail readiness, close listeners, let connections finish until the deadline.
    admin_state.set_ready(false);
    let _ = stop_tx.send(true);
    let active = shared.tracker.active();
    tracing::info!(active, timeout = ?drain_timeout, "listeners closed; waiting for connections");
    if tokio::time::timeout(drain_timeout, shared.tracker.wait_idle())
        .await
        .is_err()
    {
        tracing::warn!(
            active = shared.tracker.active(),
            "drain deadline reached; closing remaining connections"
        );
        shared.hard_stop.stop();
        let _ = tokio::time::timeout(HARD_STOP_GRACE, shared.tracker.wait_idle()).await;
    }
    let _ = exit_tx.send(true);
    let _ = tokio::task::spawn_blocking(move || {
        for t in threads {
            let _ = t.join();
        }
    })
    .await;
    watch_task.abort();
    admin_task.abort();
    tracing::info!("gateway stopped");
    Ok(())
}

/// One worker thread: a single-threaded event loop that accepts on its own sockets and runs
/// every connection it accepted to the end. A connection never changes threads.
fn worker(
    sockets: Vec<(Arc<ListenerConfig>, std::net::TcpListener)>,
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
    mut exit: watch::Receiver<bool>,
) {
    // Sockets and timers only: the signal and process drivers (signals are the control
    // plane's) would otherwise be checked on every turn of the loop.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "cannot start a worker event loop");
            return;
        }
    };
    runtime.block_on(async move {
        tokio::spawn(pacemaker());
        let mut loops = Vec::new();
        for (l, sock) in sockets {
            match tokio::net::TcpListener::from_std(sock) {
                Ok(sock) => loops.push(tokio::spawn(listener::accept_loop(
                    sock,
                    l,
                    shared.clone(),
                    stop.clone(),
                ))),
                Err(e) => {
                    tracing::error!(listener = %l.name, error = %e, "cannot register a listener")
                }
            }
        }
        for l in loops {
            let _ = l.await;
        }
        // Listeners are closed; connections on this thread finish before the loop stops.
        let _ = exit.wait_for(|e| *e).await;
    });
}

/// Keeps a timer at most [`PACE`] away on this worker's event loop. tokio writes its
/// wake-up eventfd whenever a new deadline is earlier than every armed one; with this one
/// armed, the connect, handshake, half-close and idle deadlines connections set (all longer)
/// never are, which saves a syscall and a spurious event-loop turn per connection.
async fn pacemaker() {
    let mut tick = tokio::time::interval(PACE);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
    }
}

/// How far ahead the pacemaker's timer is.
const PACE: Duration = Duration::from_secs(1);

/// The route a connection takes: `lookup` in the current table snapshot, else the listener's
/// `defaultRoute`. The returned `Arc` is the connection's snapshot of the route.
pub fn pick_route(
    shared: &Shared,
    listener: &ListenerConfig,
    lookup: impl FnOnce(&crate::route::RoutingTable) -> Option<&Arc<Route>>,
) -> Option<Arc<Route>> {
    let snapshot = shared.tables.snapshot();
    let table = snapshot.table();
    lookup(table)
        .or_else(|| {
            listener
                .default_route
                .as_deref()
                .and_then(|r| table.by_name(r))
        })
        .cloned()
}

/// What the client is told once the backend connect is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// Nothing (TLS passthrough, PROXY-destination): failures just close.
    None,
    /// An HTTP status: `200` once connected, `502`/`504` when every backend failed.
    Http,
}

/// Connects `route`'s backend, replays the bytes buffered in `conn`, relays until the end,
/// and logs: the path every routed connection takes after its protocol chose a route.
pub async fn forward(
    mut conn: Box<Conn>,
    route: &Arc<Route>,
    reply: Reply,
    shared: &Shared,
    lm: &ListenerMetrics,
) {
    let cfg = &shared.config;
    lm.routed.inc();
    conn.log.route = Some(route.name().to_owned());
    let rm = shared.metrics.route(route.name());
    rm.total.inc();
    rm.active.inc();
    // Downstream keepalive and nodelay are inherited from the listening socket.

    let budget = route.timeouts.connect.unwrap_or(cfg.timeouts.connect);
    let connected = Box::pin(upstream::connect(
        route,
        cfg.zone.as_deref(),
        budget,
        |reason| shared.metrics.connect_failure(route.name(), reason),
    ))
    .await;
    let (end, stats) = match connected {
        Err(e) => {
            tracing::debug!(error = %e, "no backend");
            if reply == Reply::Http {
                let status = if matches!(
                    e,
                    upstream::ConnectError::Failed {
                        timed_out: true,
                        ..
                    }
                ) {
                    504
                } else {
                    502
                };
                conn.reject_with(&http::response(status, &e.to_string()))
                    .await;
            }
            (format!("error:{}", e.kind()), relay::Stats::default())
        }
        Ok(up) => {
            rm.connect_duration.observe(up.elapsed.as_secs_f64());
            socket::tune(
                &up.stream,
                cfg.keepalive_upstream.idle,
                cfg.keepalive_upstream.interval,
            );
            conn.log.backend = Some(up.backend.clone());
            let replied = match reply {
                Reply::Http => conn.stream.write_all(&http::response(200, "")).await,
                Reply::None => Ok(()),
            };
            match replied {
                Err(e) => (
                    format!("error:{}", relay::io_kind(&e)),
                    relay::Stats::default(),
                ),
                Ok(()) => {
                    let limits = relay::Limits {
                        idle: route.timeouts.idle.unwrap_or(cfg.timeouts.idle),
                        half_close: cfg.timeouts.half_close,
                        max_duration: route.max_connection_duration,
                        progress: cfg.access_log_interval,
                    };
                    let counters = relay::Counters {
                        rx: &rm.rx,
                        tx: &rm.tx,
                        half_closed: &shared.metrics.half_closed,
                    };
                    let log = &conn.log;
                    let progress = |s: relay::Stats| log.emit(s, "open", true);
                    // The replay buffer is written first and then freed: an idle connection
                    // keeps no ClientHello or request head around.
                    let initial = std::mem::take(&mut conn.buf);
                    let (end, stats) = relay::relay(
                        &conn.stream,
                        &up.stream,
                        initial,
                        limits,
                        counters,
                        &progress,
                        &shared.hard_stop,
                    )
                    .await;
                    (end.reason(), stats)
                }
            }
        }
    };
    rm.active.dec();
    conn.log.emit(stats, &end, false);
}
