//! The sections several kinds share, decoded the same way wherever they appear: the admin
//! endpoint, timeouts and TCP keepalive. A kind imports them from here, never from another
//! kind. This module reads no files.

use std::time::Duration;

use serde::Deserialize;

use super::decode::{Derived, MappingOnly};
use super::error::Errors;
use super::value::{Address, Positive, Span, plain, plain_option};

mapping_only!(Admin, Timeouts);

/// The admin endpoint.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct Admin {
    /// `IP:port` to bind: probes and metrics.
    pub address: Address,
    /// `IP:port` for `/routes` and other state (the gateway only; loopback port 15000 by
    /// default).
    #[serde(default)]
    pub debug_address: Option<Address>,
}

impl Admin {
    /// Records that a role without a routing table has no debug endpoint (`why`).
    pub(crate) fn no_debug_address(&self, errors: &mut Errors, why: &str) {
        if self.debug_address.is_some() {
            errors.push("admin.debugAddress", why);
        }
    }
}

/// Timeouts of the gateway and the node daemon.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase", default)]
pub struct Timeouts {
    /// Budget to connect to a backend, failover included (default `5s`).
    #[serde(deserialize_with = "plain::<Positive, _>")]
    pub connect: Duration,
    /// Time for a client to send its ClientHello or request head (default `10s`).
    #[serde(deserialize_with = "plain::<Positive, _>")]
    pub handshake: Duration,
    /// Close connections idle this long (default `1h`).
    #[serde(deserialize_with = "plain::<Positive, _>")]
    pub idle: Duration,
    /// How long a half-closed connection may stay open (default `1m`).
    #[serde(deserialize_with = "plain::<Positive, _>")]
    pub half_close: Duration,
    /// How long listeners keep accepting after SIGTERM while readiness fails (the gateway
    /// only; default `5s`, see [`Timeouts::drain_delay`]).
    #[serde(deserialize_with = "plain_option::<Span, _>")]
    pub drain_delay: Option<Duration>,
    /// How long established connections may finish on shutdown (default `60s`).
    #[serde(deserialize_with = "plain::<Span, _>")]
    pub drain: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(5),
            handshake: Duration::from_secs(10),
            idle: Duration::from_secs(3600),
            half_close: Duration::from_secs(60),
            drain_delay: None,
            drain: Duration::from_secs(60),
        }
    }
}

impl Timeouts {
    /// How long listeners keep accepting after SIGTERM (readiness already failing).
    pub fn drain_delay(&self) -> Duration {
        self.drain_delay.unwrap_or(Duration::from_secs(5))
    }
}

/// TCP keepalive on both legs: towards clients (idle `55s`, interval `55s` by default) and
/// towards backends (`U`: each kind's own defaults).
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase", default)]
pub struct Keepalive<U: Default> {
    /// Towards clients.
    pub downstream: Downstream,
    /// Towards backends.
    pub upstream: U,
}

impl<'de, U: Default + Deserialize<'de>> Deserialize<'de> for Keepalive<U> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(MappingOnly::<Self>::new())
    }
}

impl<'de, U: Default + Deserialize<'de>> Derived<'de> for Keepalive<U> {
    fn derived<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Keepalive::<U>::deserialize(d)
    }
}

/// A keepalive side: idle time before the first probe and time between probes, each with
/// its default in seconds.
macro_rules! keepalive_side {
    ($($(#[$doc:meta])* $name:ident($idle:literal, $interval:literal);)*) => {$(
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Deserialize)]
        #[serde(remote = "Self", rename_all = "camelCase", default)]
        pub struct $name {
            /// Idle time before the first probe.
            #[serde(deserialize_with = "plain::<Positive, _>")]
            pub idle: Duration,
            /// Time between probes.
            #[serde(deserialize_with = "plain::<Positive, _>")]
            pub interval: Duration,
        }

        impl Default for $name {
            fn default() -> Self {
                $name {
                    idle: Duration::from_secs($idle),
                    interval: Duration::from_secs($interval),
                }
            }
        }

        mapping_only!($name);
    )*};
}

keepalive_side! {
    /// Keepalive towards clients (default idle `55s`, interval `55s`).
    Downstream(55, 55);
    /// The gateway's keepalive towards backends (default idle `2h`, interval `75s`).
    GatewayUpstream(7200, 75);
    /// The node's keepalive towards the gateway (default idle `2h`, interval `55s`, as in
    /// Gardener).
    NodeUpstream(7200, 55);
}
