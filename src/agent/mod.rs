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

use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::admin::metrics::{ListenerMetrics, Metrics, Role as MetricsRole, RouteReasonLabels};
use crate::config::agent::AgentConfig;
use crate::net::IpFamily;
use crate::net::dial::{ConnectFailure, Dest, DialError, Dialer, Direct, Target};
use crate::net::fds;
use crate::net::relay::{Limits, Stats};
use crate::net::resolve::Resolver;
use crate::net::resolve::ResolverSettings;
use crate::route::{BackendAddress, KeyFileError, Route, WgKey, read_key_file};
use crate::serve::drain::{Drain, DrainTimes};
use crate::serve::forward::Linked;
use crate::serve::process::{self, Context, Spec, StartError};
use crate::serve::record::{ConnRecord, Outcome, Reason};
use crate::tunnel::driver::{ACCEPT_QUEUE, Incoming};
use crate::tunnel::shoot::Dialed;
use lane::{Lane, LaneSpec};

/// Listener name in metrics and the access log: the connections the gateway opens through
/// the tunnel.
pub const LISTENER: &str = "tunnel";
/// Route name in metrics and logs (every connection goes to the target it asked for).
pub const ROUTE: &str = "agent";

/// TCP keepalive of the sockets the agent dials, as on its `connect` endpoint's stream.
const KEEPALIVE: (Duration, Duration) = (lane::KEEPALIVE_IDLE, lane::KEEPALIVE_INTERVAL);

/// Why the agent could not start.
#[derive(Debug, Error)]
pub enum AgentError {
    /// A failure every role shares: a socket that cannot be bound (`tunnel socket`,
    /// `admin`), signal handling.
    #[error(transparent)]
    Start(#[from] StartError),
    /// The private key could not be read.
    #[error("private key: {0}")]
    Key(#[from] KeyFileError),
    /// The resolver the dialer carries could not be set up (the agent dials addresses
    /// only: it never asks it).
    #[error("resolver: {0}")]
    Resolver(String),
}

/// Runs the agent until SIGTERM/SIGINT and a drain.
pub async fn run(config: AgentConfig) -> Result<(), AgentError> {
    let metrics = Arc::new(Metrics::new(MetricsRole::Agent));
    // What can fail on a file comes before anything is bound or said to have started: the
    // key, and the resolver's configuration.
    let private = read_key_file(&config.wireguard.private_key_file)?;
    // The dialer's resolver is never asked (targets are addresses), but it is the
    // process's one, as on the other roles.
    let resolver = Resolver::start(&ResolverSettings::default(), fds::lookup_budget())
        .map_err(|e| AgentError::Resolver(e.to_string()))?;
    // No drain delay: the gateway stops opening connections through a tunnel whose agent
    // no longer accepts them.
    let drain = DrainTimes {
        delay: Duration::ZERO,
        timeout: config.timeouts.drain,
    };
    let spec = Spec::new(metrics.clone(), config.admin.address.0, drain);
    process::run(spec, move || {
        Ok(Starting {
            config,
            metrics,
            private,
            resolver,
        })
    })
    .await
}

/// The agent before it serves: its lanes start once the admin endpoint is up.
struct Starting {
    config: AgentConfig,
    metrics: Arc<Metrics>,
    private: WgKey,
    resolver: Resolver,
}

impl process::Role for Starting {
    type Error = AgentError;
    type Serving = Serving;

    async fn serve(self, cx: &Context) -> Result<Serving, AgentError> {
        let Starting {
            config,
            metrics,
            private,
            resolver,
        } = self;
        let keepalive = config
            .wireguard
            .gateway
            .persistent_keepalive
            .0
            .map(|d| d.as_secs().clamp(1, u64::from(u16::MAX)) as u16);
        // One lane per gateway replica (one for a single gateway), each over its endpoints.
        let (tx, accepts) = mpsc::channel::<Incoming>(ACCEPT_QUEUE);
        let mut lanes = Vec::with_capacity(config.lanes().len());
        for (index, endpoints) in config.lanes().iter().enumerate() {
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
        // Nothing can fail the start any more.
        tracing::info!(lanes = lanes.len(), admin = %config.admin.address.0, "agent started");
        let ready = {
            let (lanes, state) = (lanes.clone(), cx.admin.clone());
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
        let route = Route::new::<&str, &str>(ROUTE, &[], &[], Vec::new(), Vec::new())
            .unwrap_or_else(|_| unreachable!("a route without keys is never too long"));
        let agent = Arc::new(Agent {
            listener: Arc::new(metrics.listener(LISTENER)),
            metrics,
            drain: cx.drain.clone(),
            limits: Limits {
                idle: config.timeouts.idle,
                half_close: config.timeouts.half_close,
                max_duration: None,
                progress: None,
            },
            route,
            dialer: Direct {
                zone: None,
                connect_timeout: config.timeouts.connect,
                keepalive: KEEPALIVE,
                family: IpFamily::Any,
                resolver: Arc::new(resolver),
            },
        });
        Ok(Serving {
            agent,
            accepts: Some(accepts),
            _lanes: lanes,
            ready,
        })
    }
}

/// The serving agent: its lanes, and the connections they bring.
struct Serving {
    agent: Arc<Agent>,
    /// Connections the gateway opens, until the drain starts.
    accepts: Option<mpsc::Receiver<Incoming>>,
    /// Held until the agent stops.
    _lanes: Arc<Vec<Lane>>,
    /// Sets readiness from the lanes.
    ready: JoinHandle<()>,
}

impl process::Serving for Serving {
    /// Serves each connection the gateway opens; the channel goes with this future when
    /// the drain starts, so new connections are refused from then on.
    async fn run(&mut self) {
        let Some(mut accepts) = self.accepts.take() else {
            return;
        };
        while let Some(incoming) = accepts.recv().await {
            tokio::spawn(serve(self.agent.clone(), incoming));
        }
    }

    fn draining(&mut self) {
        self.ready.abort();
    }

    async fn stop(self) {
        tracing::info!("agent stopped");
    }
}

/// What every accepted connection shares.
struct Agent {
    metrics: Arc<Metrics>,
    /// What every connection is counted and logged under ([`LISTENER`]).
    listener: Arc<ListenerMetrics>,
    /// The process's drain: its tracker, and the hard stop at its deadline.
    drain: Arc<Drain>,
    limits: Limits,
    /// What every connection is counted and logged under ([`ROUTE`]): it has no backends,
    /// as every connection goes to its own target.
    route: Route,
    /// Dials the targets.
    dialer: Direct,
}

/// Why the agent's dial of a target failed (metric label `reason` of
/// `trellis_tunnel_dial_failures_total{route="agent"}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DialFailure {
    /// The target refused the connection.
    Refused,
    /// No route to the target's network or host.
    Unreachable,
    /// No answer within the connect budget.
    Timeout,
    /// A local failure (descriptors, ports) or a reset.
    Error,
}

impl DialFailure {
    /// The failure a failed dial stands for.
    fn of(e: &DialError) -> Self {
        match e {
            DialError::Failed { reason, .. } => match reason {
                ConnectFailure::Refused => DialFailure::Refused,
                ConnectFailure::Unreachable => DialFailure::Unreachable,
                ConnectFailure::Timeout => DialFailure::Timeout,
                _ => DialFailure::Error,
            },
            DialError::NoBackends { .. } | DialError::Upstream { .. } => DialFailure::Error,
        }
    }

    /// The metric label.
    fn as_str(self) -> &'static str {
        match self {
            DialFailure::Refused => "refused",
            DialFailure::Unreachable => "unreachable",
            DialFailure::Timeout => "timeout",
            DialFailure::Error => "error",
        }
    }

    /// What the seed sees: it mirrors what the dial met. A refusal is a reset; no route or
    /// no answer is silence (the seed's own connect times out); a local failure is a reset
    /// too, so the seed does not wait for nothing.
    fn answer(self) -> Dialed {
        match self {
            DialFailure::Refused | DialFailure::Error => Dialed::Refused,
            DialFailure::Unreachable | DialFailure::Timeout => Dialed::Silent,
        }
    }
}

/// Dials one accepted connection's target and relays it; one access-log line when it ends.
async fn serve(agent: Arc<Agent>, incoming: Incoming) {
    let Incoming {
        tunnels,
        cell,
        accept,
    } = incoming;
    // Counted from the dial on: the drain waits for it. (No limit: the gateway's is.)
    let Some(guard) = agent.drain.tracker.admit(usize::MAX) else {
        return;
    };
    let mut record = ConnRecord::new(
        agent.metrics.clone(),
        agent.listener.clone(),
        accept.client,
        Instant::now(),
    );
    record.target = Some(accept.target.to_string());
    let rm = record.routed(ROUTE);
    let to = BackendAddress::Ip(accept.target);
    let target = Target {
        route: &agent.route,
        to: Dest::Address(&to),
        client: accept.client,
        local: None,
        on_failure: &|_| {},
    };
    let tcp = match agent.dialer.dial(target).await {
        Ok(dialed) => {
            record.backend = Some(dialed.backend);
            dialed.stream
        }
        Err(e) => {
            let failure = DialFailure::of(&e);
            agent
                .metrics
                .tunnel
                .dial_failures
                .get_or_create(&RouteReasonLabels {
                    route: ROUTE.into(),
                    reason: failure.as_str(),
                })
                .inc();
            tracing::debug!(target_addr = %accept.target, reason = failure.as_str(), "agent dial failed");
            // Resets the inner connection or leaves it unanswered.
            let _ = tunnels.accepted(&cell, &accept, failure.answer());
            record.backend = e.backend().map(str::to_owned);
            // Logged under the metric's reason.
            record.finish(Reason::Dial(failure.as_str()), Stats::default());
            return;
        }
    };
    let Some(stream) = tunnels.accepted(&cell, &accept, Dialed::Connected) else {
        record.finish(Reason::Rejected(Outcome::ClosedEarly), Stats::default());
        return;
    };
    match tokio::time::timeout(agent.dialer.connect_timeout, stream.established()).await {
        Ok(Ok(())) => {}
        Ok(Err(_)) => {
            record.finish(Reason::Rejected(Outcome::ClosedEarly), Stats::default());
            return;
        }
        Err(_) => {
            record.finish(Reason::Rejected(Outcome::Timeout), Stats::default());
            return;
        }
    }
    Linked::new(stream, tcp, record, rm, agent.limits, guard)
        .relay(&agent.drain.hard_stop)
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(reason: ConnectFailure) -> DialError {
        DialError::Failed {
            route: ROUTE.into(),
            backend: "10.0.0.1:80".into(),
            reason,
            timed_out: reason == ConnectFailure::Timeout,
            tunnel: None,
        }
    }

    /// The seed sees what the dial met: a refusal or a local failure resets the inner
    /// connection, no route or no answer leaves it unanswered; each counted under its own
    /// reason.
    #[test]
    fn a_failed_dial_is_answered_as_it_failed() {
        for (reason, label, answer) in [
            (ConnectFailure::Refused, "refused", Dialed::Refused),
            (ConnectFailure::Unreachable, "unreachable", Dialed::Silent),
            (ConnectFailure::Timeout, "timeout", Dialed::Silent),
            (ConnectFailure::Reset, "error", Dialed::Refused),
            (ConnectFailure::Error, "error", Dialed::Refused),
        ] {
            let f = DialFailure::of(&failed(reason));
            assert_eq!((f.as_str(), f.answer()), (label, answer), "{reason:?}");
        }
    }
}
