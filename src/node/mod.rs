//! `trellis node`: the shoot node daemon that is `kubernetes.default` on every node.
//!
//! Listens on the kube-apiserver advertise address and forwards every connection to the
//! seed gateway: either as an HTTP CONNECT tunnel with the destination header (current
//! Gardener) or behind a PROXY v2 header whose destination is the address the client dialled
//! (GEP-08). The client's TLS passes through untouched. With `interface` configured it also
//! keeps the advertise address on its link ([`link`]). Readiness reflects local state only:
//! listeners bound and address in place, never the gateway's health.

pub mod link;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use socket2::{Domain, Socket, Type};
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

use crate::admin::metrics::{ListenerMetrics, RouteMetrics};
use crate::admin::{self, AdminState, Metrics};
use crate::config::node::{NodeConfig, UpstreamProtocol};
use crate::gateway::access::AccessLog;
use crate::gateway::listener::{Tracker, normalize};
use crate::net::{relay, socket, upstream};
use crate::wire::{Parsed, http, proxy};

/// Listener name in metrics and logs.
pub const LISTENER: &str = "apiserver-proxy";
/// Route name in metrics and logs (the node has one upstream).
pub const ROUTE: &str = "upstream";
/// Largest CONNECT response head accepted from the gateway.
const MAX_RESPONSE_HEAD: usize = 8192;

/// Why the node could not start.
#[derive(Debug, Error)]
pub enum NodeError {
    /// A listener or the admin endpoint could not be bound.
    #[error("cannot bind {what} on {address}: {source}")]
    Bind {
        /// `listener` or `admin`.
        what: &'static str,
        /// The address.
        address: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// Netlink could not be opened or the address could not be managed.
    #[error("link management: {0}")]
    Link(String),
    /// Signal handlers could not be installed.
    #[error("signal handling: {0}")]
    Signals(std::io::Error),
}

/// Local readiness: listeners bound, address in place (when managed), not draining.
#[derive(Default)]
struct Readiness {
    bound: AtomicBool,
    address: AtomicBool,
    draining: AtomicBool,
}

impl Readiness {
    fn publish(&self, admin: &AdminState) {
        let ready = self.bound.load(Ordering::SeqCst)
            && self.address.load(Ordering::SeqCst)
            && !self.draining.load(Ordering::SeqCst);
        admin.set_ready(ready);
    }
}

/// Removes the managed address (`trellis node --cleanup`).
pub async fn cleanup(config: &NodeConfig) -> Result<(), NodeError> {
    let Some(iface) = &config.interface else {
        tracing::info!("no interface configured; nothing to clean up");
        return Ok(());
    };
    let handle = link::connect().map_err(|e| NodeError::Link(e.to_string()))?;
    let manager = link::LinkManager::new(handle, &iface.name, iface.address);
    let n = manager
        .remove()
        .await
        .map_err(|e| NodeError::Link(e.to_string()))?;
    tracing::info!(address = %iface.address, removed = n, "address removed");
    Ok(())
}

/// Binds with `IP_FREEBIND`, so the advertise address may appear on its link later.
fn bind_freebind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    if addr.is_ipv4() {
        s.set_freebind_v4(true)?;
    } else {
        s.set_freebind_v6(true)?;
    }
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(socket::LISTEN_BACKLOG)?;
    TcpListener::from_std(s.into())
}

/// Runs the node daemon until SIGTERM/SIGINT and a completed drain.
pub async fn run(config: NodeConfig) -> Result<(), NodeError> {
    let config = Arc::new(config);
    let metrics = Arc::new(Metrics::new());
    let readiness = Arc::new(Readiness::default());
    let mut sigterm = signal(SignalKind::terminate()).map_err(NodeError::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(NodeError::Signals)?;

    let admin_sock = admin::bind(config.admin)
        .await
        .map_err(|source| NodeError::Bind {
            what: "admin",
            address: config.admin,
            source,
        })?;
    let admin_state = Arc::new(AdminState::new(metrics.clone(), None));
    let admin_task = tokio::spawn(admin::serve(admin_sock, admin_state.clone()));

    // Link management first: the address should be in place before we report ready.
    let link_task = match &config.interface {
        None => {
            readiness.address.store(true, Ordering::SeqCst);
            None
        }
        Some(iface) => {
            let handle = link::connect().map_err(|e| NodeError::Link(e.to_string()))?;
            let events = link::subscribe().map_err(|e| NodeError::Link(e.to_string()))?;
            let manager = link::LinkManager::new(handle, &iface.name, iface.address);
            Some(tokio::spawn(manage_link(
                manager,
                iface.check_interval,
                events,
                readiness.clone(),
                admin_state.clone(),
            )))
        }
    };

    let mut listeners = Vec::new();
    for &addr in &config.listen {
        let l = bind_freebind(addr).map_err(|source| NodeError::Bind {
            what: "listener",
            address: addr,
            source,
        })?;
        listeners.push(l);
    }
    readiness.bound.store(true, Ordering::SeqCst);
    readiness.publish(&admin_state);

    let (stop_tx, stop_rx) = watch::channel(false);
    let hard_stop = Arc::new(relay::Stop::default());
    let tracker = Arc::new(Tracker::default());
    let lm = Arc::new(metrics.listener(LISTENER));
    let rm = metrics.route(ROUTE);
    let mut accept_tasks = Vec::new();
    for l in listeners {
        tracing::info!(address = ?l.local_addr().ok(), "listening");
        let ctx = Ctx {
            config: config.clone(),
            metrics: metrics.clone(),
            lm: lm.clone(),
            rm: rm.clone(),
            hard_stop: hard_stop.clone(),
        };
        accept_tasks.push(tokio::spawn(accept_loop(
            l,
            ctx,
            tracker.clone(),
            stop_rx.clone(),
        )));
    }
    tracing::info!(upstream = %format!("{}:{}", config.upstream_host, config.upstream_port), "node ready");

    tokio::select! {
        _ = sigterm.recv() => tracing::info!("SIGTERM: draining"),
        _ = sigint.recv() => tracing::info!("SIGINT: draining"),
    }
    readiness.draining.store(true, Ordering::SeqCst);
    readiness.publish(&admin_state);
    let _ = stop_tx.send(true);
    for t in accept_tasks {
        let _ = t.await;
    }
    if tokio::time::timeout(config.drain_timeout, tracker.wait_idle())
        .await
        .is_err()
    {
        hard_stop.stop();
        let _ = tokio::time::timeout(Duration::from_secs(2), tracker.wait_idle()).await;
    }
    if let Some(t) = link_task {
        t.abort();
    }
    admin_task.abort();
    tracing::info!("node stopped; the address stays in place (use --cleanup to remove it)");
    Ok(())
}

async fn manage_link(
    mut manager: link::LinkManager,
    interval: Duration,
    mut events: tokio::sync::mpsc::Receiver<()>,
    readiness: Arc<Readiness>,
    admin: Arc<AdminState>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        match manager.reconcile().await {
            Ok(changes) => {
                if changes != link::Changes::default() {
                    tracing::info!(?changes, link = manager.link(), "address reconciled");
                }
                readiness.address.store(true, Ordering::SeqCst);
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot manage the advertise address");
                let in_place = manager.is_in_place().await.unwrap_or(false);
                readiness.address.store(in_place, Ordering::SeqCst);
            }
        }
        readiness.publish(&admin);
        tokio::select! {
            _ = tick.tick() => {}
            Some(()) = events.recv() => {
                // Let a burst of events settle, then check once.
                tokio::time::sleep(Duration::from_millis(50)).await;
                while events.try_recv().is_ok() {}
            }
        }
    }
}

#[derive(Clone)]
struct Ctx {
    config: Arc<NodeConfig>,
    metrics: Arc<Metrics>,
    lm: Arc<ListenerMetrics>,
    rm: Arc<RouteMetrics>,
    hard_stop: Arc<relay::Stop>,
}

async fn accept_loop(
    listener: TcpListener,
    ctx: Ctx,
    tracker: Arc<Tracker>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.wait_for(|s| *s) => break,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(guard) = tracker.admit(ctx.config.max_connections) else {
            AccessLog::new(LISTENER, normalize(peer), Instant::now()).emit(
                relay::Stats::default(),
                "limited",
                false,
            );
            ctx.metrics.outcome(LISTENER, "limited");
            continue;
        };
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let _guard = guard;
            ctx.lm.active.inc();
            handle(stream, normalize(peer), &ctx).await;
            ctx.lm.active.dec();
        });
    }
}

/// Why the upstream leg could not be set up.
#[derive(Debug)]
struct UpstreamFailure {
    reason: &'static str,
    detail: String,
}

/// Connects to the gateway (resolving its name now, with the configured family).
async fn dial(config: &NodeConfig) -> Result<(TcpStream, SocketAddr), UpstreamFailure> {
    let deadline = tokio::time::Instant::now() + config.connect_timeout;
    let host = (config.upstream_host.as_str(), config.upstream_port);
    let addrs: Vec<SocketAddr> =
        match tokio::time::timeout_at(deadline, tokio::net::lookup_host(host)).await {
            Ok(Ok(a)) => a
                .filter(|a| config.ip_family.allows(a))
                .take(upstream::MAX_ADDRS_PER_BACKEND)
                .collect(),
            Ok(Err(e)) => {
                return Err(UpstreamFailure {
                    reason: "resolve",
                    detail: e.to_string(),
                });
            }
            Err(_) => {
                return Err(UpstreamFailure {
                    reason: "timeout",
                    detail: "resolving the gateway".into(),
                });
            }
        };
    if addrs.is_empty() {
        return Err(UpstreamFailure {
            reason: "resolve",
            detail: format!(
                "no {:?} address for {}",
                config.ip_family, config.upstream_host
            ),
        });
    }
    let mut last = UpstreamFailure {
        reason: "timeout",
        detail: String::new(),
    };
    for (i, addr) in addrs.iter().enumerate() {
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        let share = remaining / (addrs.len() - i) as u32;
        match tokio::time::timeout(share, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => return Ok((s, *addr)),
            Ok(Err(e)) => {
                last = UpstreamFailure {
                    reason: upstream::failure_reason(&e),
                    detail: format!("{addr}: {e}"),
                }
            }
            Err(_) => {
                last = UpstreamFailure {
                    reason: "timeout",
                    detail: format!("{addr}: connect timed out"),
                }
            }
        }
    }
    Err(last)
}

/// Sends the CONNECT request and waits for `200`; returns bytes read past the response head.
async fn connect_tunnel(
    up: &mut TcpStream,
    config: &NodeConfig,
    header: &str,
    destination: &str,
) -> Result<Vec<u8>, UpstreamFailure> {
    let authority = format!("{}:443", config.upstream_host);
    let request = format!(
        "CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{header}: {destination}\r\n\r\n"
    );
    let exchange = async {
        up.write_all(request.as_bytes())
            .await
            .map_err(|e| UpstreamFailure {
                reason: "error",
                detail: e.to_string(),
            })?;
        let mut buf = Vec::with_capacity(256);
        let mut chunk = [0u8; 1024];
        loop {
            let n = up.read(&mut chunk).await.map_err(|e| UpstreamFailure {
                reason: "reset",
                detail: e.to_string(),
            })?;
            if n == 0 {
                return Err(UpstreamFailure {
                    reason: "rejected",
                    detail: "gateway closed before answering".into(),
                });
            }
            buf.extend_from_slice(&chunk[..n]);
            match http::parse_response_status(&buf, MAX_RESPONSE_HEAD) {
                Ok(Parsed::Incomplete) => continue,
                Ok(Parsed::Complete {
                    value: 200,
                    consumed,
                }) => return Ok(buf.split_off(consumed)),
                Ok(Parsed::Complete { value, .. }) => {
                    return Err(UpstreamFailure {
                        reason: "rejected",
                        detail: format!("gateway answered {value}"),
                    });
                }
                Err(e) => {
                    return Err(UpstreamFailure {
                        reason: "rejected",
                        detail: e.to_string(),
                    });
                }
            }
        }
    };
    match tokio::time::timeout(config.handshake_timeout, exchange).await {
        Ok(r) => r,
        Err(_) => Err(UpstreamFailure {
            reason: "timeout",
            detail: "no CONNECT answer in time".into(),
        }),
    }
}

async fn handle(mut client: TcpStream, peer: SocketAddr, ctx: &Ctx) {
    let config = &ctx.config;
    let start = Instant::now();
    let mut log = AccessLog::new(LISTENER, peer, start);
    log.route = Some(ROUTE.into());
    let local = client.local_addr().map(normalize).unwrap_or(peer);
    log.target = Some(local.to_string());
    socket::tune(
        &client,
        config.keepalive_downstream.idle,
        config.keepalive_downstream.interval,
    );

    let setup = async {
        let (mut up, addr) = dial(config).await?;
        let early = match &config.protocol {
            UpstreamProtocol::HttpConnect {
                header,
                destination,
            } => connect_tunnel(&mut up, config, header, destination).await?,
            UpstreamProtocol::ProxyV2 => {
                let header = proxy::encode_v2(peer, local);
                up.write_all(&header).await.map_err(|e| UpstreamFailure {
                    reason: "error",
                    detail: e.to_string(),
                })?;
                Vec::new()
            }
        };
        Ok::<_, UpstreamFailure>((up, addr, early))
    };
    let (up, addr, early) = match setup.await {
        Ok(x) => x,
        Err(f) => {
            ctx.metrics.connect_failure(ROUTE, f.reason);
            tracing::debug!(reason = f.reason, detail = %f.detail, "gateway not reachable; closing the client");
            return log.emit(
                relay::Stats::default(),
                &format!("error:upstream_{}", f.reason),
                false,
            );
        }
    };
    ctx.lm.routed.inc();
    ctx.rm.total.inc();
    ctx.rm.active.inc();
    ctx.rm
        .connect_duration
        .observe(start.elapsed().as_secs_f64());
    log.backend = Some(addr.to_string());
    socket::tune(
        &up,
        config.keepalive_upstream.idle,
        config.keepalive_upstream.interval,
    );
    if !early.is_empty() {
        ctx.rm.tx.inc_by(early.len() as u64);
    }
    let (end, mut stats) = if !early.is_empty() && client.write_all(&early).await.is_err() {
        (relay::End::Error("write"), relay::Stats::default())
    } else {
        let limits = relay::Limits {
            idle: config.idle_timeout,
            half_close: config.half_close_timeout,
            max_duration: None,
            progress: None,
        };
        let counters = relay::Counters {
            rx: &ctx.rm.rx,
            tx: &ctx.rm.tx,
            half_closed: &ctx.metrics.half_closed,
        };
        relay::relay(
            &client,
            &up,
            Vec::new(),
            limits,
            counters,
            &|_| {},
            &ctx.hard_stop,
        )
        .await
    };
    stats.tx += early.len() as u64;
    ctx.rm.active.dec();
    ctx.lm
        .connection_duration
        .observe(start.elapsed().as_secs_f64());
    log.emit(stats, &end.reason(), false);
}
