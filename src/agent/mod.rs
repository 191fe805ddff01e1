//! `trellis agent`: the shoot side of the tunnel, a user-space WireGuard peer without a TUN
//! device, capabilities or root.
//!
//! It initiates to the gateway (UDP; persistent keepalive), terminates the inner TCP
//! connections the gateway opens to any address and port inside its `networks` in its own
//! stack, and dials each with an ordinary socket from its pod. The SYN is answered only once
//! that dial succeeded; a refused dial resets the inner connection, a dial with no answer
//! leaves it unanswered, and targets outside `networks` are reset and counted. `/ready` is
//! 200 while the tunnel has a live session. Imports no other role.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use thiserror::Error;
use tokio::net::{TcpStream, UdpSocket};
use tokio::signal::unix::{SignalKind, signal};

use crate::admin::metrics::{Metrics, Role, RouteReasonLabels};
use crate::admin::{self, AdminState};
use crate::config::agent::{AgentConfig, AgentEndpoint};
use crate::net::relay::{self, Counters, Limits, Stop};
use crate::route::{KeyFileError, read_key_file};
use crate::tunnel::device::ShootCell;
use crate::tunnel::shoot::{Accept, Dialed};
use crate::tunnel::{AgentSide, Tunnels};

/// How long the tunnel may be down before the gateway's endpoints are resolved again.
const RESOLVE_AGAIN: Duration = Duration::from_secs(30);

/// Why the agent could not start.
#[derive(Debug, Error)]
pub enum AgentError {
    /// The private key could not be read.
    #[error("private key: {0}")]
    Key(#[from] KeyFileError),
    /// No UDP endpoint of the gateway resolved.
    #[error("gateway endpoint {endpoint}: {detail}")]
    Endpoint {
        /// The endpoint as written.
        endpoint: String,
        /// What failed.
        detail: String,
    },
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

/// Resolves the first UDP endpoint that resolves.
async fn gateway_endpoint(endpoints: &[AgentEndpoint]) -> Result<SocketAddr, AgentError> {
    let mut last = AgentError::Endpoint {
        endpoint: String::new(),
        detail: "no udp endpoint".into(),
    };
    for e in endpoints {
        let AgentEndpoint::Udp { host, port } = e else {
            continue;
        };
        match tokio::net::lookup_host((host.as_str(), *port)).await {
            Ok(mut addrs) => {
                if let Some(a) = addrs.next() {
                    return Ok(a);
                }
            }
            Err(err) => {
                last = AgentError::Endpoint {
                    endpoint: format!("{host}:{port}"),
                    detail: err.to_string(),
                }
            }
        }
    }
    Err(last)
}

/// Runs the agent until SIGTERM/SIGINT and a drain.
pub async fn run(config: AgentConfig) -> Result<(), AgentError> {
    let metrics = Arc::new(Metrics::new(Role::Agent));
    let private = read_key_file(&config.private_key_file)?;
    let endpoint = gateway_endpoint(&config.endpoints).await?;
    let bind: SocketAddr = if endpoint.is_ipv4() {
        "0.0.0.0:0".parse().unwrap_or_else(|_| unreachable!())
    } else {
        "[::]:0".parse().unwrap_or_else(|_| unreachable!())
    };
    let socket = UdpSocket::bind(bind)
        .await
        .map_err(|source| AgentError::Bind {
            what: "tunnel socket",
            address: bind,
            source,
        })?;
    let admin_sock = admin::bind(config.admin).map_err(|source| AgentError::Bind {
        what: "admin",
        address: config.admin,
        source,
    })?;
    let admin_state = Arc::new(AdminState::new(metrics.clone()));
    let _admin = admin::Server::start(admin_sock, None, admin_state.clone()).map_err(|source| {
        AgentError::Bind {
            what: "admin",
            address: config.admin,
            source,
        }
    })?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(AgentError::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(AgentError::Signals)?;
    let keepalive = config
        .persistent_keepalive
        .map(|d| d.as_secs().clamp(1, u64::from(u16::MAX)) as u16);
    let side = AgentSide {
        gateway: config.gateway_public_key,
        endpoint,
        addresses: config.addresses.clone(),
        networks: config.networks.clone().into(),
        keepalive,
    };
    let (tunnels, mut accepts) = Tunnels::agent(socket, private, side, metrics.tunnel.clone());
    tracing::info!(gateway = %endpoint, admin = %config.admin, "agent started");
    let ready = {
        let (tunnels, state) = (tunnels.clone(), admin_state.clone());
        let endpoints = config.endpoints.clone();
        tokio::spawn(async move {
            let mut was = false;
            let mut down_since = tokio::time::Instant::now();
            let mut current = endpoint;
            loop {
                let up = tunnels.up();
                if up != was {
                    tracing::info!(up, "tunnel");
                    was = up;
                    down_since = tokio::time::Instant::now();
                }
                state.set_ready(up);
                // Down for a while: the gateway's name may point elsewhere now.
                if !up && down_since.elapsed() >= RESOLVE_AGAIN {
                    down_since = tokio::time::Instant::now();
                    if let Ok(fresh) = gateway_endpoint(&endpoints).await
                        && fresh != current
                    {
                        tracing::info!(gateway = %fresh, "gateway endpoint resolved anew");
                        tunnels.set_endpoint(fresh);
                        current = fresh;
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let shared = Arc::new(Serving {
        tunnels: tunnels.clone(),
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
                let Some((cell, accept)) = accepted else { break };
                tokio::spawn(serve(shared.clone(), cell, accept));
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
    tunnels: Tunnels,
    metrics: Arc<Metrics>,
    stop: Stop,
    active: AtomicUsize,
    limits: Limits,
    connect: Duration,
}

/// Dials one accepted connection's target and relays it.
async fn serve(shared: Arc<Serving>, cell: ShootCell, accept: Accept) {
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
    let (Some(mut tcp), Some(mut stream)) = (tcp, shared.tunnels.accepted(&cell, &accept, dialed))
    else {
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
