//! The seed ingress gateway: binds every listener and the admin endpoint, keeps the routing
//! table current, serves connections, and drains on SIGTERM/SIGINT.
//!
//! Startup reads every file it needs (the routing table, the listeners' TLS material, the
//! WireGuard key, the resolver's configuration) and binds everything before it says that
//! anything started or reports ready, so a configuration that cannot be served fails before
//! any traffic is accepted, and without a success line before its error. One file per listener protocol, wired onto
//! the shared serving layer ([`crate::serve`]): its accept loop, record, forward and drain,
//! and the process skeleton (admin endpoint, signals, drain) it runs in.

mod certs;
mod conn;
mod connect;
mod dispatch;
mod egress;
mod proxydst;
mod sni;
pub(crate) mod table;
mod tunnel;

use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::sync::watch;

use crate::admin::{self, Metrics};
use crate::config::ConfigError;
use crate::config::gateway::{GatewayConfig, Listener, ListenerKind};
use crate::net::IpFamily;
use crate::net::dial::Direct;
use crate::net::resolve::Resolver;
use crate::net::socket;
use crate::route::Route;
use crate::serve::accept::{Admission, accept_loop};
use crate::serve::drain::{Drain, DrainTimes};
use crate::serve::process::{self, Context, Role, Spec, StartError};
use crate::serve::watch::DirWatches;
use table::Tables;

/// Why the gateway could not start or run.
#[derive(Debug, Error)]
pub enum GatewayError {
    /// A failure every role shares: an address that cannot be bound (a listener, `admin`,
    /// the `debug endpoint`), signal handling.
    #[error(transparent)]
    Start(#[from] StartError),
    /// The routing table could not be loaded at startup.
    #[error("routing table: {0}")]
    Routes(#[from] ConfigError),
    /// The `wireguard` listener's private key could not be read.
    #[error("wireguard private key: {0}")]
    WireGuardKey(#[from] crate::route::KeyFileError),
    /// A listener's TLS material could not be loaded.
    #[error("listener TLS material: {0}")]
    Tls(#[from] crate::net::tls::TlsError),
    /// The resolver (for backends named by DNS) could not be set up.
    #[error("resolver: {0}")]
    Resolver(String),
}

/// What every connection task shares.
pub(crate) struct Shared {
    /// The validated configuration.
    pub config: GatewayConfig,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The live routing table.
    pub tables: Arc<Tables>,
    /// Open connections, the listeners' stop and the relays' hard stop (the process's).
    pub drain: Arc<Drain>,
    /// Dials route backends.
    pub dialer: Direct,
    /// Every CONNECT destination header the gateway knows (see
    /// [`connect::known_destination_headers`]).
    pub destination_headers: Vec<String>,
    /// TLS configs of the `egress-connect` listeners and of routes' `egress.tls`.
    pub certs: Arc<certs::Certs>,
    /// The `wireguard` listener's device, if the gateway has one.
    pub tunnels: Option<crate::tunnel::Tunnels>,
    /// The destination header value whose CONNECTs carry WireGuard over TCP to the device
    /// (the `wireguard` listener's `connectDestination`), with that listener's name.
    pub connect_destination: Option<(String, String)>,
}

/// Runs the gateway until SIGTERM/SIGINT and a completed drain.
pub async fn run(config: GatewayConfig) -> Result<(), GatewayError> {
    crate::serve::memory::fix_mmap_threshold();
    let metrics = Arc::new(Metrics::gateway());
    let mut tables = Tables::load(&config.routes.file, metrics.clone())?;
    tables.set_default_routes(
        config
            .listeners
            .iter()
            .filter_map(|l| Some((l.name.0.clone(), l.default_route.clone()?)))
            .collect(),
    );
    tables.reserve_destinations(
        tunnel::connect_destination(&config.listeners)
            .map(|(d, listener)| (listener, d))
            .into_iter()
            .collect(),
    )?;
    let tables = Arc::new(tables);
    let listener_tls = config.listeners.iter().filter_map(|l| match l.kind() {
        ListenerKind::EgressConnect { tls } => Some(tls.clone()),
        _ => None,
    });
    let certs = Arc::new(certs::Certs::new(listener_tls, metrics.clone())?);
    certs.set_table(tables.snapshot().table());
    let key = wireguard_key(&config)?;
    // The process's one resolver, shared by every worker: backends named by DNS and
    // CONNECT targets.
    let resolver = Resolver::start(
        &config.resolver_settings(),
        crate::net::fds::lookup_budget(),
    )
    .map_err(|e| GatewayError::Resolver(e.to_string()))?;
    crate::serve::memory::release_free_memory();
    let drain = DrainTimes {
        delay: config.timeouts.drain_delay(),
        timeout: config.timeouts.drain,
    };
    let spec = Spec {
        debug: Some(config.debug_address()),
        hangup: true,
        ..Spec::new(metrics.clone(), config.admin.address.0, drain)
    };
    let loaded = Loaded {
        config,
        metrics,
        tables,
        certs,
        key,
        resolver,
    };
    process::run(spec, move || Bound::bind(loaded)).await
}

/// The `wireguard` listener's private key (at most one listener has one) and its file.
fn wireguard_key(
    config: &GatewayConfig,
) -> Result<Option<(crate::route::WgKey, std::path::PathBuf)>, GatewayError> {
    for l in &config.listeners {
        if let ListenerKind::WireGuard {
            private_key_file, ..
        } = l.kind()
        {
            let key = crate::route::read_key_file(private_key_file)?;
            return Ok(Some((key, private_key_file.to_owned())));
        }
    }
    Ok(None)
}

/// What the gateway read before it binds anything.
struct Loaded {
    config: GatewayConfig,
    metrics: Arc<Metrics>,
    tables: Arc<Tables>,
    certs: Arc<certs::Certs>,
    /// The `wireguard` listener's key and its file, if the gateway has one.
    key: Option<(crate::route::WgKey, std::path::PathBuf)>,
    resolver: Resolver,
}

/// The gateway with every listener bound, before the admin endpoint is.
struct Bound {
    config: GatewayConfig,
    metrics: Arc<Metrics>,
    tables: Arc<Tables>,
    certs: Arc<certs::Certs>,
    resolver: Resolver,
    /// Each worker's sockets.
    per_worker: Vec<Vec<(Arc<Listener>, std::net::TcpListener)>>,
    /// The `wireguard` listener's device and key file, if the gateway has one, with the
    /// listener's name and address (said once the gateway starts).
    tunnels: Option<Tunnel>,
}

/// The gateway's WireGuard device.
struct Tunnel {
    tunnels: crate::tunnel::Tunnels,
    key_file: std::path::PathBuf,
    listener: String,
    address: std::net::SocketAddr,
}

impl Bound {
    /// Binds everything before serving anything: one SO_REUSEPORT socket per listener and
    /// worker, so each worker thread accepts and serves its own connections. Each address is
    /// claimed first without SO_REUSEPORT, which fails if any other process listens there: an
    /// instance started twice would otherwise share the port with the first.
    fn bind(loaded: Loaded) -> Result<Self, GatewayError> {
        let Loaded {
            config,
            metrics,
            tables,
            certs,
            key,
            resolver,
        } = loaded;
        let workers = config.workers.max(1);
        let mut per_worker: Vec<Vec<(Arc<Listener>, std::net::TcpListener)>> =
            (0..workers).map(|_| Vec::new()).collect();
        let mut claims = Vec::new();
        // `wireguard` (UDP) is bound by the tunnel driver.
        for l in config.listeners.iter().filter(|l| l.kind().is_tcp()) {
            let l = Arc::new(l.clone());
            let bind_error = |source: std::io::Error| {
                StartError::bind(format!("listener {}", l.name), l.address, source)
            };
            let claim = socket::claim(l.address).map_err(bind_error)?;
            // Port 0: every worker binds the port the claim got.
            let address = socket::claimed_addr(l.address, &claim);
            claims.push(claim);
            for sockets in per_worker.iter_mut() {
                let keepalive = (
                    config.keepalive.downstream.idle,
                    config.keepalive.downstream.interval,
                );
                let sock =
                    socket::bind_std_with(address, socket::LISTEN_BACKLOG, true, Some(keepalive))
                        .map_err(bind_error)?;
                sockets.push((l.clone(), sock));
            }
        }
        // The listeners listen now: nobody else can claim their addresses.
        drop(claims);
        // The `wireguard` listener (at most one, its key read already): its UDP socket.
        let mut tunnels = None;
        let wireguard = config.listeners.iter().find(|l| !l.kind().is_tcp());
        if let (Some(l), Some((key, key_file))) = (wireguard, key) {
            let sock = socket::bind_udp(l.address).map_err(|source| {
                StartError::bind(format!("listener {}", l.name), l.address, source)
            })?;
            let address = sock.local_addr().map_or(l.address, |a| a);
            let sock = tokio::net::UdpSocket::from_std(sock).map_err(StartError::Signals)?;
            tunnels = Some(Tunnel {
                tunnels: crate::tunnel::Tunnels::gateway(sock, key, metrics.tunnel.clone()),
                key_file,
                listener: l.name.0.clone(),
                address,
            });
        }
        Ok(Bound {
            config,
            metrics,
            tables,
            certs,
            resolver,
            per_worker,
            tunnels,
        })
    }
}

impl Role for Bound {
    type Error = GatewayError;
    type Serving = Serving;

    fn routes(&self) -> Option<admin::RoutesJson> {
        let json_tables = self.tables.clone();
        let live_tunnels = self.tunnels.as_ref().map(|t| t.tunnels.clone());
        Some(Box::new(move || match &live_tunnels {
            Some(t) => {
                let status = t.status();
                let live = |route: &str, peer: usize| {
                    let p = status.get(route)?.peers.get(peer)?;
                    serde_json::to_value(p).ok()
                };
                json_tables.to_json_live(Some(&live))
            }
            None => json_tables.to_json(),
        }))
    }

    async fn serve(self, cx: &Context) -> Result<Serving, GatewayError> {
        let Bound {
            config,
            metrics,
            tables,
            certs,
            resolver,
            per_worker,
            tunnels,
        } = self;
        // One file-system watcher for every watched file; SIGHUP reaches each watcher.
        let watches = DirWatches::new();
        let hup_rx = cx.hangup.clone();
        let started = tables.snapshot();
        let mut tasks = vec![tokio::spawn(tables.clone().watch(
            watches.clone(),
            config.routes.check_interval,
            hup_rx.clone(),
        ))];
        tasks.push(tokio::spawn(certs::keep_current(
            certs.clone(),
            tables.subscribe(),
            watches.clone(),
            config.routes.check_interval,
            hup_rx.clone(),
        )));
        if let Some(t) = &tunnels {
            tasks.push(tokio::spawn(tunnel::keep_current(
                t.tunnels.clone(),
                t.key_file.clone(),
                tables.subscribe(),
                watches,
                config.routes.check_interval,
                hup_rx,
            )));
        }

        let dialer = Direct {
            zone: config.zone.clone(),
            connect_timeout: config.timeouts.connect,
            keepalive: (
                config.keepalive.upstream.idle,
                config.keepalive.upstream.interval,
            ),
            family: IpFamily::Any,
            resolver: Arc::new(resolver),
        };
        let destination_headers = connect::known_destination_headers(&config.listeners);
        let connect_destination = tunnel::connect_destination(&config.listeners);
        let workers = config.workers.max(1);
        let shared = Arc::new(Shared {
            connect_destination,
            destination_headers,
            config,
            metrics: metrics.clone(),
            tables: tables.clone(),
            drain: cx.drain.clone(),
            dialer,
            certs,
            tunnels: tunnels.as_ref().map(|t| t.tunnels.clone()),
        });
        let stop_rx = shared.drain.listeners_stop();
        let (exit_tx, exit_rx) = watch::channel(false);
        tasks.push(tokio::spawn(crate::serve::memory::return_after_floods(
            shared.drain.tracker.clone(),
        )));
        let listening: Vec<(Arc<Listener>, String)> = per_worker
            .first()
            .into_iter()
            .flatten()
            .map(|(l, sock)| {
                let address = sock
                    .local_addr()
                    .map_or_else(|_| l.address.to_string(), |a| a.to_string());
                (l.clone(), address)
            })
            .collect();
        let mut threads = Vec::new();
        for (i, sockets) in per_worker.into_iter().enumerate() {
            let (shared, stop_rx, exit_rx) = (shared.clone(), stop_rx.clone(), exit_rx.clone());
            let thread = std::thread::Builder::new()
                .name(format!("trellis-w{i}"))
                .spawn(move || worker(sockets, shared, stop_rx, exit_rx))
                .map_err(StartError::Signals)?;
            threads.push(thread);
        }
        // Nothing can fail the start any more: what started is said now.
        Tables::say_started(&started);
        for (l, address) in listening {
            tracing::info!(listener = %l.name, address, protocol = l.kind().as_str(), workers, "listening");
        }
        if let Some(t) = &tunnels {
            tracing::info!(listener = t.listener, address = %t.address, protocol = "wireguard", "listening");
        }
        cx.admin.set_ready(true);
        tracing::info!(
            admin = %shared.config.admin.address.0,
            generation = tables.snapshot().generation,
            max_connections = shared.config.limits.max_connections,
            max_connections_per_source = shared.config.limits.per_source(),
            "gateway ready"
        );
        Ok(Serving {
            shared,
            exit_tx,
            threads,
            tasks,
        })
    }
}

/// The serving gateway: its worker threads and the tasks that keep its table, TLS material
/// and tunnels current.
struct Serving {
    shared: Arc<Shared>,
    /// Tells the workers' event loops to stop once the drain is over.
    exit_tx: watch::Sender<bool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl process::Serving for Serving {
    async fn stop(self) {
        // The tunneled streams have ended: the streams carrying their tunnels end now.
        if let Some(t) = &self.shared.tunnels {
            t.close_streams();
            let _ =
                tokio::time::timeout(STREAMS_GRACE, self.shared.drain.tracker.wait_empty()).await;
        }
        let _ = self.exit_tx.send(true);
        let threads = self.threads;
        let _ = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await;
        for t in self.tasks {
            t.abort();
        }
        tracing::info!("gateway stopped");
    }
}

/// One worker thread: a single-threaded event loop that accepts on its own sockets and runs
/// every connection it accepted to the end. A connection never changes threads.
fn worker(
    sockets: Vec<(Arc<Listener>, std::net::TcpListener)>,
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
                Ok(sock) => {
                    let admission = Admission {
                        metrics: shared.metrics.clone(),
                        listener: Arc::new(shared.metrics.listener(&l.name)),
                        tracker: shared.drain.tracker.clone(),
                        max_connections: shared.config.limits.max_connections,
                    };
                    let shared = shared.clone();
                    // The connection's future itself, not one wrapping it: a wrapper would
                    // hold a second copy of what it hands on.
                    let serve =
                        move |accepted| dispatch::serve(accepted, l.clone(), shared.clone());
                    loops.push(tokio::spawn(accept_loop(
                        sock,
                        admission,
                        stop.clone(),
                        serve,
                    )));
                }
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
    // A blocking task still running (none is expected: names are resolved on the resolver's
    // own event loop) must not hold the process past its drain.
    runtime.shutdown_timeout(SHUTDOWN_GRACE);
}

/// How long the streams carrying tunnels get to end (and write their records) once the drain
/// is over.
const STREAMS_GRACE: Duration = Duration::from_secs(2);

/// How long a stopping event loop waits for its blocking tasks.
const SHUTDOWN_GRACE: Duration = Duration::from_millis(500);

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

/// What routing decided for a connection.
pub(crate) enum Pick {
    /// Forward on this route (the connection's snapshot of it).
    Route(Arc<Route>),
    /// The route matched (or is the listener's default), but its `allowedSourceRanges` do
    /// not include the client: close and count `denied`.
    Denied(Arc<Route>),
    /// No route and no default route.
    NoRoute,
}

/// The route a connection takes: `lookup` in the current table snapshot, else the listener's
/// `defaultRoute`; then whether that route admits `source`, the client address the gateway
/// trusts (the PROXY source from a trusted load balancer, else the peer). The returned `Arc`
/// is the connection's snapshot of the route.
pub(crate) fn pick_route(
    shared: &Shared,
    listener: &Listener,
    source: std::net::IpAddr,
    lookup: impl FnOnce(&crate::route::RoutingTable) -> Option<&Arc<Route>>,
) -> Pick {
    let snapshot = shared.tables.snapshot();
    let table = snapshot.table();
    let route = lookup(table).or_else(|| {
        listener
            .default_route
            .as_deref()
            .and_then(|r| table.by_name(r))
    });
    match route {
        Some(r) if r.admits(source) => Pick::Route(r.clone()),
        Some(r) => Pick::Denied(r.clone()),
        None => Pick::NoRoute,
    }
}
