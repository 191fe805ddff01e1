//! A dialer for explicit addresses that reach a shoot either directly (kernel TCP) or
//! through the route's tunnel, as one stream type for the relay.

use std::time::Instant;

use tokio::net::TcpStream;

use super::failover::DialError as TunnelDialError;
use super::shared::Tunnels;
use super::stream::TunnelStream;
use crate::net::dial::{ConnectFailure, Dest, DialError, Dialed, Dialer, Direct, Target};
use crate::net::relay::Either;
use crate::route::BackendAddress;

/// Dials `Dest::Address` targets through `tunnels` (the route's shoot) or, without them,
/// with `direct`.
pub(crate) struct ViaTunnel<'a> {
    /// The direct dialer (and the connect budget for tunnel dials).
    pub(crate) direct: &'a Direct,
    /// The tunnel to dial through; `None` dials directly.
    pub(crate) tunnels: Option<&'a Tunnels>,
}

impl TunnelDialError {
    /// The connect failure it stands for: a reset is a refusal (`502`), everything else
    /// (no tunnel, no live peer, no answer) a timeout (`504`).
    pub(crate) fn failure(&self) -> ConnectFailure {
        match self {
            TunnelDialError::Refused => ConnectFailure::Refused,
            _ => ConnectFailure::Timeout,
        }
    }
}

impl Dialer for ViaTunnel<'_> {
    type Stream = Either<TcpStream, TunnelStream>;

    async fn dial(&self, target: Target<'_>) -> Result<Dialed<Self::Stream>, DialError> {
        let Some(tunnels) = self.tunnels else {
            return self.direct.dial(target).await.map(|d| Dialed {
                stream: Either::A(d.stream),
                backend: d.backend,
                addr: d.addr,
                guard: d.guard,
                elapsed: d.elapsed,
                early: d.early,
                via: d.via,
            });
        };
        let route = target.route;
        let addr = match target.to {
            Dest::Address(BackendAddress::Ip(a)) => *a,
            // Names are resolved (and checked) by the caller before a tunnel dial.
            _ => {
                return Err(DialError::NoBackends {
                    route: route.name().to_owned(),
                });
            }
        };
        let budget = route
            .timeouts
            .connect
            .unwrap_or(self.direct.connect_timeout);
        let start = Instant::now();
        match tunnels.dial(route.name(), addr, budget).await {
            Ok((stream, peer)) => Ok(Dialed {
                stream: Either::B(stream),
                backend: addr.to_string(),
                addr,
                guard: None,
                elapsed: start.elapsed(),
                early: Vec::new(),
                via: Some(peer),
            }),
            Err(e) => {
                let reason = e.failure();
                (target.on_failure)(reason);
                tracing::debug!(route = route.name(), target = %addr, error = %e, "tunnel dial failed");
                Err(DialError::Failed {
                    route: route.name().to_owned(),
                    backend: addr.to_string(),
                    reason,
                    timed_out: reason == ConnectFailure::Timeout,
                    tunnel: Some(e.as_str()),
                })
            }
        }
    }
}
