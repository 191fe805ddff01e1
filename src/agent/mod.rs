//! `trellis agent`: the shoot side of the tunnel, a user-space WireGuard peer without a TUN
//! device, capabilities or root.
//!
//! It initiates to the gateway over the gateway's endpoints in order (UDP preferred, then
//! WireGuard over TCP through a CONNECT; see [`lane`]), terminates the inner TCP connections
//! the gateway opens to any address and port inside its `networks` in its own stack, and
//! dials each with an ordinary socket from its pod. The SYN is answered only once that dial
//! succeeded; a refused dial resets the inner connection, a dial with no answer leaves it
//! unanswered, and targets outside `networks` are reset and counted. `/ready` is 200 while a
//! lane has a live session. Imports no other role.

mod lane;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use thiserror::Error;
use tokio::net::TcpStream;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use crate::admin::metrics::{Metrics, Role, RouteReasonLabels};
use crate::admin::{self, AdminState};
use crate::config::agent::AgentConfig;
use crate::net::relay::{self, Counters, Limits, Stop};
use crate::route::{KeyFileError, read_key_file};
use crate::tunnel::driver::{ACCEPT_QUEUE, Incoming};
use crate::tunnel::shoot::Dialed;
use lane::{Lane, LaneSpec};

/// Why the agent could not start.
#[derive(Debug, Error)]
pub enum AgentError {
    /// The private key could not be read.
    #[error("private key: {0}")]
    Key(#[from] KeyFileError),
    /// A socket could not be bound.
    #[error("cannot bind {what} on {address}: {source}")]
    Bind {
        /// `tunnel socket` or `admin`.
        what: &'static str,
        /// The address.
        address: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// Signal handlers could not be installed.
    #[error("signal handling: {0}")]
    Signals(std::io::Error),
}

/// Runs the agent until SIGTERM/SIGINT and a drain.
pub async fn run(config: AgentConfig) -> Result<(), AgentError> {
    let metrics = Arc::new(Metrics::new(Role::Agent));
    let private = read_key_file(&config.wireguard.private_key_file)?;
    let admin_sock = admin::bind(config.admin.address.0).map_err(|source| AgentError::Bind {
        what: "admin",
        address: config.admin.address.0,
        source,
    })?;
    let admin_state = Arc::new(AdminState::new(metrics.clone()));
    let _admin = admin::Server::start(admin_sock, None, admin_state.clone()).map_err(|source| {
        AgentError::Bind {
            what: "admin",
            address: config.admin.address.0,
            source,
        }
    })?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(AgentError::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(AgentError::Signals)?;
    let keepalive = config
        .wireguard
        .gateway
        .persistent_keepalive
        .0
        .map(|d| d.as_secs().clamp(1, u64::from(u16::MAX)) as u16);
    // One lane per gateway replica (one for a single gateway), each over its endpoints.
    let (tx, mut accepts) = mpsc::channel::<Incoming>(ACCEPT_QUEUE);
    let lanes_config = config.lanes();
    let mut lanes = Vec::with_capacity(lanes_config.len());
    for (index, endpoints) in lanes_config.iter().enumerate() {
        let spec = LaneSpec {
            index,
            gateway: config.wireguard.gateway.public_key,
            endpoints: endpoints.clone(),
            addresses: config.wireguard.addresses.clone(),
            networks: config.networks.clone().into(),
            keepalive,
            connect: config.timeouts.connect,
            idle: config.timeouts.idle,
        };
        lanes.push(Lane::start(spec, private, metrics.tunnel.clone(), tx.clone()).await?);
    }
    drop(tx);
    let lanes = Arc::new(lanes);
    tracing::info!(lanes = lanes.len(), admin = %config.admin.address.0, "agent started");
    let ready = {
        let (lanes, state) = (lanes.clone(), admin_state.clone());
        tokio::spawn(async move {
            let mut was = false;
            loop {
                let up = lanes.iter().any(Lane::up);
                if up != was {
                    tracing::info!(up, "tunnel");
                    was = up;
                }
                state.set_ready(up);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let shared = Arc::new(Serving {
        metrics: metrics.clone(),
        stop: Stop::default(),
        active: AtomicUsize::new(0),
        limits: Limits {
            idle: config.timeouts.idle,
            half_close: config.timeouts.half_close,
            max_duration: None,
            progress: None,
        },
        connect: config.timeouts.connect,
    });
    loop {
        tokio::select! {
            accepted = accepts.recv() => {
                let Some(incoming) = accepted else { break };
                tokio::spawn(serve(shared.clone(), incoming));
            }
            _ = sigterm.recv() => { tracing::info!("SIGTERM: draining"); break; }
            _ = sigint.recv() => { tracing::info!("SIGINT: draining"); break; }
        }
    }
    // New connections are refused from now on; those relaying may finish.
    drop(accepts);
    ready.abort();
    admin_state.set_ready(false);
    let deadline = tokio::time::Instant::now() + config.timeouts.drain;
    while shared.active.load(Ordering::Relaxed) > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shared.stop.stop();
    tracing::info!("agent stopped");
    Ok(())
}

/// What every accepted connection shares.
struct Serving {
    metrics: Arc<Metrics>,
    stop: Stop,
    active: AtomicUsize,
    limits: Limits,
    connect: Duration,
}

/// Dials one accepted connection's target and relays it.
async fn serve(shared: Arc<Serving>, incoming: Incoming) {
    let Incoming {
        tunnels,
        cell,
        accept,
    } = incoming;
    let dial = tokio::time::timeout(shared.connect, TcpStream::connect(accept.target)).await;
    // What the seed sees mirrors what the dial met: a refusal is a reset; no route or no
    // answer is silence (the seed's own connect times out); a local failure (descriptors,
    // ports) is a reset too, so the seed does not wait for nothing.
    let (dialed, reason, tcp) = match dial {
        Ok(Ok(tcp)) => (Dialed::Connected, None, Some(tcp)),
        Ok(Err(e)) => match e.kind() {
            std::io::ErrorKind::ConnectionRefused => (Dialed::Refused, Some("refused"), None),
            std::io::ErrorKind::HostUnreachable
            | std::io::ErrorKind::NetworkUnreachable
            | std::io::ErrorKind::TimedOut => (Dialed::Silent, Some("unreachable"), None),
            _ => (Dialed::Refused, Some("error"), None),
        },
        Err(_) => (Dialed::Silent, Some("timeout"), None),
    };
    if let Some(reason) = reason {
        shared
            .metrics
            .tunnel
            .dial_failures
            .get_or_create(&RouteReasonLabels {
                route: "agent".into(),
                reason,
            })
            .inc();
        tracing::debug!(target_addr = %accept.target, reason, "agent dial failed");
    }
    let (Some(mut tcp), Some(mut stream)) = (tcp, tunnels.accepted(&cell, &accept, dialed)) else {
        return;
    };
    if tokio::time::timeout(shared.connect, stream.established())
        .await
        .map_or(true, |r| r.is_err())
    {
        return;
    }
    shared.active.fetch_add(1, Ordering::Relaxed);
    let m = &shared.metrics;
    let route = m.route("agent");
    let counters = Counters {
        rx: &route.rx,
        tx: &route.tx,
        half_closed: &m.half_closed,
    };
    let (end, stats) = relay::relay(
        &mut stream,
        &mut tcp,
        Vec::new(),
        Vec::new(),
        shared.limits,
        counters,
        &|_| {},
        &shared.stop,
    )
    .await;
    tracing::debug!(target_addr = %accept.target, client = %accept.client, end = %end, rx = stats.rx, tx = stats.tx, "connection ended");
    shared.active.fetch_sub(1, Ordering::Relaxed);
}
