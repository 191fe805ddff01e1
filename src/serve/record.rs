//! The per-connection record: what is known about a connection (client, target, route,
//! backend, PROXY header), turned into exactly one access-log line and one set of metric
//! updates when the connection ends — or when the record is dropped without being finished
//! (a task cut at shutdown), so no connection goes unrecorded and none is recorded twice.
//! Long-lived connections may also log periodic lines.
//!
//! The lines go through the access log's own writer ([`super::access_log`]) as target
//! `trellis::access`, in the shape `--log-format json` gives every event.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use crate::admin::Metrics;
use crate::admin::metrics::{ListenerMetrics, RouteMetrics};
use crate::net::dial::DialError;
use crate::net::relay::{End, Stats};
use crate::route::Route;
use crate::wire::proxy::ProxyInfo;

/// Why a downstream connection was rejected (metric label `outcome`; the `routed` outcome
/// is counted through [`ListenerMetrics::routed`], resolved once per listener).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// No route for the name, destination or PROXY destination.
    NoRoute,
    /// An `sni` listener got something that is not TLS.
    NotTls,
    /// Malformed, oversized or not allowed (a PROXY header, a request head, a ClientHello).
    BadRequest,
    /// Nothing complete within the handshake deadline.
    Timeout,
    /// A connection limit (global or per source).
    Limited,
    /// The route's `allowedSourceRanges` do not include the client.
    Denied,
    /// The client closed before routing.
    ClosedEarly,
}

impl Outcome {
    /// The metric label and access-log reason.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::NoRoute => "no_route",
            Outcome::NotTls => "not_tls",
            Outcome::BadRequest => "bad_request",
            Outcome::Timeout => "timeout",
            Outcome::Limited => "limited",
            Outcome::Denied => "denied",
            Outcome::ClosedEarly => "closed_early",
        }
    }
}

/// Why a connection ended (access log `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// Rejected before routing.
    Rejected(Outcome),
    /// Routed, but no backend stream could be had (`error:<kind>`).
    Dial(&'static str),
    /// A forwarded CONNECT that the backend answered with a status other than `2xx`: the
    /// client got that answer and the connection closed.
    RefusedByBackend,
    /// Relayed until this end.
    Relay(End),
    /// The record was dropped unfinished: the task was cut (runtime shutdown).
    Aborted,
}

impl From<&DialError> for Reason {
    fn from(e: &DialError) -> Self {
        Reason::Dial(e.kind())
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Rejected(o) => f.write_str(o.as_str()),
            Reason::Dial(kind) => write!(f, "error:{kind}"),
            Reason::RefusedByBackend => f.write_str("refused_by_backend"),
            Reason::Relay(end) => end.fmt(f),
            Reason::Aborted => f.write_str("error:aborted"),
        }
    }
}

/// One connection's record: a pointer to [`Record`], so that the record costs the futures
/// that carry it (accept loop, handshake stages, forward) eight bytes each, and is allocated
/// once per connection.
#[derive(Debug)]
pub(crate) struct ConnRecord(Box<Record>);

impl std::ops::Deref for ConnRecord {
    type Target = Record;
    fn deref(&self) -> &Record {
        &self.0
    }
}

impl std::ops::DerefMut for ConnRecord {
    fn deref_mut(&mut self) -> &mut Record {
        &mut self.0
    }
}

/// What a [`ConnRecord`] knows.
#[derive(Debug)]
pub(crate) struct Record {
    metrics: Arc<Metrics>,
    listener: Arc<ListenerMetrics>,
    /// Client address (the PROXY source when present).
    pub client: SocketAddr,
    /// TCP peer address.
    pub peer: SocketAddr,
    /// The address the client connected to, where a dialer needs it (PROXY v2 towards the
    /// gateway); not looked up otherwise.
    pub local: Option<SocketAddr>,
    /// SNI, CONNECT destination or PROXY destination.
    pub target: Option<String>,
    /// The client certificate's identity (its CN, else its first DNS SAN), on listeners that
    /// verify one.
    pub identity: Option<String>,
    /// Backend as written in the table (or the address reached).
    pub backend: Option<String>,
    /// PROXY header version and TLVs, when one was received.
    pub proxy: Option<String>,
    /// The WireGuard peer a tunneled backend stream went through (`key@endpoint`).
    pub tunnel_peer: Option<String>,
    /// The CONNECT request head was forwarded to the backend, which answered it (a route
    /// with `forwardConnect`), rather than answered by the gateway. Set once a backend
    /// connection is up: a `502`/`504` the gateway answered itself is not forwarded.
    pub forwarded: bool,
    accepted_at: Instant,
    /// The route's handles, once routed (its active gauge is held until the end).
    route: Option<Arc<RouteMetrics>>,
    /// The route that refused the client, for the access log (its metrics are untouched:
    /// the refusal counts on the listener).
    denied_by: Option<Arc<Route>>,
    finished: bool,
}

impl ConnRecord {
    /// Starts the record of a connection from `peer` accepted at `accepted_at`; it counts
    /// in the listener's active gauge until finished.
    pub(crate) fn new(
        metrics: Arc<Metrics>,
        listener: Arc<ListenerMetrics>,
        peer: SocketAddr,
        accepted_at: Instant,
    ) -> Self {
        listener.active.inc();
        ConnRecord(Box::new(Record {
            metrics,
            listener,
            client: peer,
            peer,
            local: None,
            target: None,
            identity: None,
            tunnel_peer: None,
            backend: None,
            proxy: None,
            forwarded: false,
            accepted_at,
            route: None,
            denied_by: None,
            finished: false,
        }))
    }

    /// When the connection was accepted.
    pub(crate) fn accepted_at(&self) -> Instant {
        self.accepted_at
    }

    /// The listener's name.
    pub(crate) fn listener(&self) -> &str {
        &self.listener.listener
    }

    /// The listener's handles.
    pub(crate) fn listener_metrics(&self) -> &ListenerMetrics {
        &self.listener
    }

    /// The process's metrics.
    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Records a PROXY header: its source becomes the client address.
    pub(crate) fn set_proxy(&mut self, info: &ProxyInfo) {
        if let Some(source) = info.source() {
            self.client = crate::net::socket::normalize(source);
        }
        let mut s = format!("v{}", info.version);
        for tlv in &info.tlvs {
            s.push(' ');
            s.push_str(tlv);
        }
        self.proxy = Some(s);
    }

    /// Marks the connection routed to `route`: counts it (outcome `routed`, the route's
    /// total and active) and returns the route's handles.
    pub(crate) fn routed(&mut self, route: &str) -> Arc<RouteMetrics> {
        self.listener.routed.inc();
        let rm = self.metrics.route(route);
        rm.total.inc();
        rm.active.inc();
        self.route = Some(rm.clone());
        rm
    }

    /// The route's name, once routed (or the route that refused the client).
    pub(crate) fn route(&self) -> Option<&str> {
        match (&self.route, &self.denied_by) {
            (Some(r), _) => Some(r.route.as_str()),
            (None, Some(r)) => Some(r.name()),
            (None, None) => None,
        }
    }

    /// Refuses a client that `route` does not admit: counts outcome `denied` on the
    /// listener and logs the line with the route's name.
    pub(crate) fn deny(mut self, route: Arc<Route>) {
        self.denied_by = Some(route);
        self.reject(
            Outcome::Denied,
            "client not in the route's allowedSourceRanges",
        );
    }

    /// Rejects the connection before routing: counts `outcome` and finishes the record.
    pub(crate) fn reject(mut self, outcome: Outcome, detail: &str) {
        self.metrics.outcome(self.listener(), outcome.as_str());
        tracing::debug!(listener = %self.listener(), client = %self.client, outcome = outcome.as_str(), detail, "connection rejected");
        self.record(Reason::Rejected(outcome), Stats::default());
    }

    /// Finishes the record: the access-log line and the end-of-connection metrics.
    pub(crate) fn finish(mut self, reason: Reason, stats: Stats) {
        self.record(reason, stats);
    }

    /// A periodic line for a connection still open.
    pub(crate) fn progress(&self, stats: Stats) {
        self.line(stats, Reason::Relay(End::ClientClosed), true);
    }

    fn line(&self, stats: Stats, reason: Reason, periodic: bool) {
        use super::access_log::{self, Value};
        if !access_log::enabled() {
            return;
        }
        // A periodic line says `open`: the connection has not ended.
        let reason: &dyn fmt::Display = if periodic { &"open" } else { &reason };
        fn or_dash(s: &Option<String>) -> Value<'_> {
            Value::Str(s.as_deref().unwrap_or("-"))
        }
        access_log::line(
            "access",
            &[
                ("listener", Value::Str(self.listener())),
                ("route", Value::Str(self.route().unwrap_or("-"))),
                ("client", Value::Fmt(&self.client)),
                ("peer", Value::Fmt(&self.peer)),
                ("target_name", or_dash(&self.target)),
                ("identity", or_dash(&self.identity)),
                ("backend", or_dash(&self.backend)),
                ("proxy", or_dash(&self.proxy)),
                ("tunnel_peer", or_dash(&self.tunnel_peer)),
                ("forwarded", Value::Bool(self.forwarded)),
                ("rx_bytes", Value::U64(stats.rx)),
                ("tx_bytes", Value::U64(stats.tx)),
                (
                    "duration_ms",
                    Value::U64(self.accepted_at.elapsed().as_millis() as u64),
                ),
                ("reason", Value::Fmt(reason)),
                ("periodic", Value::Bool(periodic)),
            ],
        );
    }

    fn record(&mut self, reason: Reason, stats: Stats) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        if let Some(rm) = &self.route {
            rm.active.dec();
        }
        self.listener
            .connection_duration
            .observe(self.accepted_at.elapsed().as_secs_f64());
        self.listener.active.dec();
        self.line(stats, reason, false);
    }
}

impl Drop for ConnRecord {
    fn drop(&mut self) {
        self.record(Reason::Aborted, Stats::default());
    }
}
