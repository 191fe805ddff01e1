//! The metrics trellis exports, registered once per process: each role registers the families
//! it records ([`Role`]), plus `trellis_build_info` and the standard `process_*` metrics.
//!
//! Labels are bounded: listener and route names and fixed reason strings, never raw SNI or
//! client addresses. Hot paths resolve per-route handles once per connection
//! ([`Metrics::route`]) and then only touch atomics.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// `listener` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ListenerLabel {
    /// Listener name.
    pub listener: String,
}

/// `listener`, `outcome` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabels {
    /// Listener name.
    pub listener: String,
    /// `routed`, `no_route`, `not_tls`, `bad_request`, `timeout`, `limited`, `denied`,
    /// `closed_early`.
    pub outcome: &'static str,
}

/// `listener`, `result` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ListenerResultLabels {
    /// Listener name.
    pub listener: String,
    /// Result of parsing.
    pub result: &'static str,
}

/// `route` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RouteLabel {
    /// Route name.
    pub route: String,
}

/// `route`, `direction` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RouteDirectionLabels {
    /// Route name.
    pub route: String,
    /// `rx` (from client) or `tx` (to client).
    pub direction: &'static str,
}

/// `route`, `reason` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RouteReasonLabels {
    /// Route name.
    pub route: String,
    /// Failure reason.
    pub reason: &'static str,
}

/// `route`, `result` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RouteResultLabels {
    /// Route name; empty when no route was chosen.
    pub route: String,
    /// What became of the request.
    pub result: &'static str,
}

/// `result` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ResultLabel {
    /// `applied`, `rejected` or `unchanged` (gateway reloads); `written`, `unchanged` or
    /// `failed` (controller writes).
    pub result: &'static str,
}

/// `kind` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindLabel {
    /// An object kind (`Gateway`, `EndpointSlice`, …).
    pub kind: &'static str,
}

/// `kind`, `version` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindVersionLabels {
    /// An object kind (`Gateway`, `EndpointSlice`, …).
    pub kind: &'static str,
    /// The API version it is read at, or `none` when the API server serves none of those
    /// the controller reads.
    pub version: &'static str,
}

/// `reason` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabel {
    /// Why something was skipped.
    pub reason: &'static str,
}

/// The controller's families (registered for [`Role::Controller`] only).
#[derive(Debug)]
pub(crate) struct ControllerMetrics {
    /// `trellis_controller_objects`: objects in the stores, per kind.
    pub objects: Family<KindLabel, Gauge>,
    /// `trellis_controller_routes`: routes in the last table rendered.
    pub routes: Gauge,
    /// `trellis_controller_skipped`: what the last render skipped, per reason.
    pub skipped: Family<ReasonLabel, Gauge>,
    /// `trellis_controller_renders_total`.
    pub renders: Counter,
    /// `trellis_controller_writes_total` by result: `written`, `unchanged`, `failed`.
    pub writes: Family<ResultLabel, Counter>,
    /// `trellis_controller_change_to_write_seconds`: from the first object change a table
    /// holds to that table written.
    pub change_to_write: Histogram,
    /// `trellis_controller_watch_errors_total`, per kind: failed lists and watches (each is
    /// retried with a backoff).
    pub watch_errors: Family<KindLabel, Counter>,
    /// `trellis_controller_served`: 1 for the version each kind is watched at (`none` while
    /// the API server serves it at none the controller reads); one series per kind.
    pub served: Family<KindVersionLabels, Gauge>,
}

impl ControllerMetrics {
    fn new() -> Self {
        ControllerMetrics {
            objects: Family::default(),
            routes: Gauge::default(),
            skipped: Family::default(),
            renders: Counter::default(),
            writes: Family::default(),
            // 1 ms .. ~65 s.
            change_to_write: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            watch_errors: Family::default(),
            served: Family::default(),
        }
    }
}

/// Which role's families a [`Metrics`] exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Everything: the shared connection families, ClientHello sizes, PROXY headers and the
    /// routing table.
    Gateway,
    /// The shared connection families only (what `serve/` records).
    Node,
    /// The controller's families only ([`ControllerMetrics`]).
    Controller,
    /// The agent: the shared connection families and the tunnel's ([`TunnelMetrics`]).
    Agent,
    /// The extension: no shared family; its own are registered by [`Metrics::extension`].
    #[cfg(feature = "extension")]
    Extension,
}

/// `route`, `peer` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RoutePeerLabels {
    /// Route name.
    pub route: String,
    /// The peer's position in the route.
    pub peer: String,
}

/// The WireGuard tunnel's families (gateway and agent).
#[derive(Debug, Default)]
pub(crate) struct TunnelMetrics {
    /// `trellis_tunnel_handshakes_total`: completed handshakes by route (`result="ok"`) and
    /// recovery handshakes started (`result="recovery"`).
    pub handshakes: Family<RouteResultLabels, Counter>,
    /// `trellis_tunnel_last_handshake_timestamp_seconds`.
    pub last_handshake: Family<RoutePeerLabels, Gauge<f64, AtomicU64>>,
    /// `trellis_tunnel_bytes_total`: stream bytes, `rx` from the shoot, `tx` into it.
    pub bytes: Family<RouteDirectionLabels, Counter>,
    /// `trellis_tunnel_streams_active`.
    pub streams: Family<RouteLabel, Gauge>,
    /// `trellis_tunnel_dial_failures_total`.
    pub dial_failures: Family<RouteReasonLabels, Counter>,
    /// `trellis_tunnel_packets_dropped_total`.
    pub dropped: Family<ReasonLabel, Counter>,
    /// `trellis_tunnel_tcp_endpoints_active`: TCP streams that are endpoints of the device
    /// (WireGuard over TCP).
    pub tcp_endpoints: Gauge,
    /// `trellis_tunnel_endpoint`: the agent's current endpoint kind per lane (1 for the kind
    /// in use, 0 for the other).
    pub endpoint: Family<LaneKindLabels, Gauge>,
    /// `trellis_tunnel_endpoint_changes_total`: the agent's switches to an endpoint kind.
    pub endpoint_changes: Family<LaneKindLabels, Counter>,
}

/// `lane`, `kind` labels (the agent's endpoints).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct LaneKindLabels {
    /// The lane (one session with one gateway), by position.
    pub lane: String,
    /// `udp` or `connect`.
    pub kind: &'static str,
}

impl TunnelMetrics {
    fn register(&self, r: &mut Registry) {
        listed(
            r,
            "tunnel_handshakes",
            "WireGuard handshakes by route and result (ok: completed; recovery: started by trellis for a session it did not hold)",
            self.handshakes.clone(),
        );
        listed(
            r,
            "tunnel_last_handshake_timestamp_seconds",
            "When each peer's last handshake completed (Unix time)",
            self.last_handshake.clone(),
        );
        listed(
            r,
            "tunnel_bytes",
            "Bytes of tunneled streams by route and direction (rx from the shoot, tx into it)",
            self.bytes.clone(),
        );
        listed(
            r,
            "tunnel_streams_active",
            "Tunneled streams open now, by route",
            self.streams.clone(),
        );
        listed(
            r,
            "tunnel_dial_failures",
            "Streams that could not be opened through a tunnel, by route and reason",
            self.dial_failures.clone(),
        );
        listed(
            r,
            "tunnel_packets_dropped",
            "Tunnel packets dropped, by reason",
            self.dropped.clone(),
        );
        listed(
            r,
            "tunnel_tcp_endpoints_active",
            "TCP streams carrying WireGuard (endpoints of the device) open now",
            self.tcp_endpoints.clone(),
        );
        listed(
            r,
            "tunnel_endpoint",
            "The agent's endpoint kind in use per lane (1), the other kind (0)",
            self.endpoint.clone(),
        );
        listed(
            r,
            "tunnel_endpoint_changes",
            "The agent's switches to an endpoint kind, per lane",
            self.endpoint_changes.clone(),
        );
    }
}

/// A family whose `# HELP` and `# TYPE` lines are encoded also before its first series
/// (prometheus-client leaves out empty families), so `/metrics` of a fresh process names every
/// family its role records: what dashboards and alerts may query is visible from the start.
#[derive(Debug)]
struct Listed<M>(M);

impl<M: EncodeMetric> EncodeMetric for Listed<M> {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }
}

/// Registers `metric` under `name` as a [`Listed`] family.
pub(crate) fn listed(
    r: &mut Registry,
    name: &str,
    help: &str,
    metric: impl EncodeMetric + Send + Sync + std::fmt::Debug + 'static,
) {
    r.register(name, help, Listed(metric));
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn seconds_histogram() -> Histogram {
    // 1 ms .. ~9 h.
    Histogram::new(exponential_buckets(0.001, 4.0, 13))
}

fn bytes_histogram() -> Histogram {
    // 128 B .. 64 KiB.
    Histogram::new(exponential_buckets(128.0, 2.0, 10))
}

fn connect_histogram() -> Histogram {
    // 100 µs .. ~13 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 18))
}

/// All metrics of the process.
#[derive(Debug)]
pub(crate) struct Metrics {
    /// The registry that `/metrics` encodes.
    pub registry: Registry,
    /// `trellis_downstream_connections_total`.
    pub downstream_total: Family<OutcomeLabels, Counter>,
    /// `trellis_downstream_connections_active`.
    pub downstream_active: Family<ListenerLabel, Gauge>,
    /// `trellis_downstream_accept_paused_seconds_total`.
    pub accept_paused: Family<ListenerLabel, Counter<f64, AtomicU64>>,
    /// `trellis_route_connections_total`.
    pub route_total: Family<RouteLabel, Counter>,
    /// `trellis_route_connections_active`.
    pub route_active: Family<RouteLabel, Gauge>,
    /// `trellis_route_bytes_total`.
    pub route_bytes: Family<RouteDirectionLabels, Counter>,
    /// `trellis_upstream_connect_failures_total`.
    pub connect_failures: Family<RouteReasonLabels, Counter>,
    /// `trellis_upstream_connect_duration_seconds`.
    pub connect_duration: HistogramFamily<RouteLabel>,
    /// `trellis_client_hello_bytes`.
    pub client_hello_bytes: HistogramFamily<ListenerLabel>,
    /// `trellis_connection_duration_seconds`.
    pub connection_duration: HistogramFamily<ListenerLabel>,
    /// `trellis_proxy_protocol_headers_total`.
    pub proxy_headers: Family<ListenerResultLabels, Counter>,
    /// `trellis_routing_table_routes`.
    pub table_routes: Gauge,
    /// `trellis_routing_table_generation`.
    pub table_generation: Gauge,
    /// `trellis_routing_table_reloads_total`.
    pub table_reloads: Family<ResultLabel, Counter>,
    /// `trellis_half_closed_connections`.
    pub half_closed: Gauge,
    /// `trellis_egress_requests_total`: egress connections by route and result.
    pub egress_requests: Family<RouteResultLabels, Counter>,
    /// `trellis_tls_material_loads_total`: certificate, key and CA sets (re)loaded, by result.
    pub tls_loads: Family<ResultLabel, Counter>,
    /// `trellis_default_route_missing`: 1 while a listener's `defaultRoute` is not in the
    /// active table (set at every load).
    pub default_route_missing: Family<ListenerLabel, Gauge>,
    /// `trellis_ready`: 1 while `/ready` answers 200, 0 otherwise (every role).
    pub ready: Gauge,
    /// Per-route handles by route name, so a connection resolves them with one lookup.
    route_cache: std::sync::RwLock<std::collections::HashMap<String, std::sync::Arc<RouteMetrics>>>,
    /// The `(route, reason)` label sets of `connect_failures`, so a gone route's can be
    /// dropped (written on the failure path only).
    failure_labels: std::sync::Mutex<std::collections::HashSet<(String, &'static str)>>,
    /// The `(route, result)` label sets of `egress_requests`, for the same purpose.
    /// Looked up by route name, so a request that repeats a known pair allocates nothing.
    egress_labels: std::sync::Mutex<std::collections::HashMap<String, Vec<&'static str>>>,
    /// The controller's families.
    pub controller: ControllerMetrics,
    /// The tunnel's families (gateway and agent).
    pub tunnel: std::sync::Arc<TunnelMetrics>,
}

/// Per-route handles, resolved once per connection.
#[derive(Debug, Clone)]
pub(crate) struct RouteMetrics {
    /// Route name.
    pub route: String,
    /// Connections routed here.
    pub total: Counter,
    /// Connections open now.
    pub active: Gauge,
    /// Bytes from clients.
    pub rx: Counter,
    /// Bytes to clients.
    pub tx: Counter,
    /// Backend connect time.
    pub connect_duration: Histogram,
}

/// Per-listener handles, resolved once per listener.
#[derive(Debug, Clone)]
pub(crate) struct ListenerMetrics {
    /// Listener name.
    pub listener: String,
    /// Connections open now on this listener.
    pub active: Gauge,
    /// ClientHello sizes.
    pub client_hello_bytes: Histogram,
    /// Connection lifetimes.
    pub connection_duration: Histogram,
    /// `trellis_downstream_connections_total{outcome="routed"}` of this listener.
    pub routed: Counter,
    /// Seconds this listener stopped accepting at the connection limit.
    pub accept_paused: Counter<f64, AtomicU64>,
}

impl Metrics {
    /// The gateway's metrics.
    pub(crate) fn gateway() -> Self {
        Self::new(Role::Gateway)
    }

    /// The node's metrics.
    pub(crate) fn node() -> Self {
        Self::new(Role::Node)
    }

    /// The controller's metrics.
    #[cfg(any(test, feature = "controller"))]
    pub(crate) fn controller() -> Self {
        Self::new(Role::Controller)
    }

    /// The extension's metrics: `register` adds its families to the root registry (beside
    /// `trellis_ready`, `trellis_build_info` and `process_*`).
    #[cfg(feature = "extension")]
    pub(crate) fn extension(register: impl FnOnce(&mut Registry)) -> Self {
        let mut m = Self::new(Role::Extension);
        register(&mut m.registry);
        m
    }

    /// Creates every handle and registers, under the `trellis_` prefix, the families `role`
    /// records (the others are never encoded), then `trellis_build_info` and, unprefixed, the
    /// `process_*` metrics.
    pub(crate) fn new(role: Role) -> Self {
        let mut registry = Registry::default();
        let m = Metrics {
            downstream_total: Family::default(),
            downstream_active: Family::default(),
            accept_paused: Family::default(),
            route_total: Family::default(),
            route_active: Family::default(),
            route_bytes: Family::default(),
            connect_failures: Family::default(),
            connect_duration: Family::new_with_constructor(connect_histogram),
            client_hello_bytes: Family::new_with_constructor(bytes_histogram),
            connection_duration: Family::new_with_constructor(seconds_histogram),
            proxy_headers: Family::default(),
            table_routes: Gauge::default(),
            table_generation: Gauge::default(),
            table_reloads: Family::default(),
            half_closed: Gauge::default(),
            egress_requests: Family::default(),
            tls_loads: Family::default(),
            default_route_missing: Family::default(),
            ready: Gauge::default(),
            registry: Registry::default(),
            route_cache: Default::default(),
            failure_labels: Default::default(),
            egress_labels: Default::default(),
            controller: ControllerMetrics::new(),
            tunnel: Default::default(),
        };
        let r = registry.sub_registry_with_prefix("trellis");
        if role == Role::Controller {
            m.register_controller(r);
        } else if matches!(role, Role::Gateway | Role::Node | Role::Agent) {
            m.register_connections(r);
        }
        if matches!(role, Role::Gateway | Role::Agent) {
            m.tunnel.register(r);
        }
        if role == Role::Gateway {
            listed(
                r,
                "client_hello_bytes",
                "Size of ClientHellos, record headers included",
                m.client_hello_bytes.clone(),
            );
            listed(
                r,
                "proxy_protocol_headers",
                "PROXY protocol headers by result",
                m.proxy_headers.clone(),
            );
            listed(
                r,
                "routing_table_routes",
                "Routes in the active table",
                m.table_routes.clone(),
            );
            listed(
                r,
                "routing_table_generation",
                "Generation of the active table",
                m.table_generation.clone(),
            );
            listed(
                r,
                "routing_table_reloads",
                "Routing table reloads by result",
                m.table_reloads.clone(),
            );
            listed(
                r,
                "egress_requests",
                "Egress (CONNECT over mutual TLS) requests by route and result",
                m.egress_requests.clone(),
            );
            listed(
                r,
                "tls_material_loads",
                "Certificate, key and client CA sets loaded (at start, on a table change or a file change), by result",
                m.tls_loads.clone(),
            );
            listed(
                r,
                "default_route_missing",
                "1 while a listener's defaultRoute is not in the active routing table",
                m.default_route_missing.clone(),
            );
        }
        listed(
            r,
            "ready",
            "1 while the process answers /ready with 200 (serving), 0 while starting or draining",
            m.ready.clone(),
        );
        let build_info = Family::<[(&'static str, &'static str); 1], Gauge>::default();
        build_info
            .get_or_create(&[("version", crate::VERSION)])
            .set(1);
        listed(
            r,
            "build_info",
            "The running trellis version (always 1)",
            build_info,
        );
        registry.register_collector(Box::new(super::process::ProcessCollector::new()));
        Metrics { registry, ..m }
    }

    /// Registers the connection families every proxying role records.
    fn register_connections(&self, r: &mut Registry) {
        let m = self;
        listed(
            r,
            "downstream_connections",
            "Client connections by listener and outcome",
            m.downstream_total.clone(),
        );
        listed(
            r,
            "downstream_connections_active",
            "Client connections open now",
            m.downstream_active.clone(),
        );
        listed(
            r,
            "downstream_accept_paused_seconds",
            "Seconds a listener did not accept because the connection limit was reached, summed over its worker loops",
            m.accept_paused.clone(),
        );
        listed(
            r,
            "route_connections",
            "Connections routed, by route",
            m.route_total.clone(),
        );
        listed(
            r,
            "route_connections_active",
            "Routed connections open now",
            m.route_active.clone(),
        );
        listed(
            r,
            "route_bytes",
            "Bytes relayed, rx from client, tx to client",
            m.route_bytes.clone(),
        );
        listed(
            r,
            "upstream_connect_failures",
            "Failed backend connects by reason",
            m.connect_failures.clone(),
        );
        listed(
            r,
            "upstream_connect_duration_seconds",
            "Time to connect to a backend",
            m.connect_duration.clone(),
        );
        listed(
            r,
            "connection_duration_seconds",
            "Lifetime of client connections",
            m.connection_duration.clone(),
        );
        listed(
            r,
            "half_closed_connections",
            "Connections with one direction closed",
            m.half_closed.clone(),
        );
    }

    /// Registers the controller's families.
    fn register_controller(&self, r: &mut Registry) {
        let c = &self.controller;
        listed(
            r,
            "controller_objects",
            "Objects in the controller's stores, per kind",
            c.objects.clone(),
        );
        listed(
            r,
            "controller_routes",
            "Routes in the last table rendered",
            c.routes.clone(),
        );
        listed(
            r,
            "controller_skipped",
            "What the last render left out, per reason",
            c.skipped.clone(),
        );
        listed(
            r,
            "controller_renders",
            "Tables rendered",
            c.renders.clone(),
        );
        listed(
            r,
            "controller_writes",
            "Table writes by result (written, unchanged, failed)",
            c.writes.clone(),
        );
        listed(
            r,
            "controller_change_to_write_seconds",
            "From the first object change a table holds to that table written",
            c.change_to_write.clone(),
        );
        listed(
            r,
            "controller_watch_errors",
            "Failed lists and watches per kind (each retried with a backoff)",
            c.watch_errors.clone(),
        );
        listed(
            r,
            "controller_served",
            "1 for the API version each kind is watched at (none: not served)",
            c.served.clone(),
        );
    }

    /// Counts a finished or rejected downstream connection.
    pub(crate) fn outcome(&self, listener: &str, outcome: &'static str) {
        self.downstream_total
            .get_or_create(&OutcomeLabels {
                listener: listener.to_owned(),
                outcome,
            })
            .inc();
    }

    /// Counts a PROXY protocol header by result.
    pub(crate) fn proxy_header(&self, listener: &str, result: &'static str) {
        self.proxy_headers
            .get_or_create(&ListenerResultLabels {
                listener: listener.to_owned(),
                result,
            })
            .inc();
    }

    /// Counts a failed backend connect.
    pub(crate) fn connect_failure(&self, route: &str, reason: &'static str) {
        self.failure_labels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((route.to_owned(), reason));
        self.connect_failures
            .get_or_create(&RouteReasonLabels {
                route: route.to_owned(),
                reason,
            })
            .inc();
    }

    /// Counts an egress request's result (`route` empty when none was chosen).
    pub(crate) fn egress(&self, route: &str, result: &'static str) {
        if !route.is_empty() {
            let mut labels = self.egress_labels.lock().unwrap_or_else(|e| e.into_inner());
            match labels.get_mut(route) {
                Some(results) if results.contains(&result) => {}
                Some(results) => results.push(result),
                None => {
                    labels.insert(route.to_owned(), vec![result]);
                }
            }
        }
        self.egress_requests
            .get_or_create(&RouteResultLabels {
                route: route.to_owned(),
                result,
            })
            .inc();
    }

    /// Counts a TLS material load (`loaded` or `rejected`).
    pub(crate) fn tls_load(&self, result: &'static str) {
        self.tls_loads.get_or_create(&ResultLabel { result }).inc();
    }

    /// Counts a routing table reload.
    pub(crate) fn reload(&self, result: &'static str) {
        self.table_reloads
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    /// Drops the series of routes that are no longer in the table and have no open
    /// connections, so the families do not keep every route ever seen (shoots come and go).
    /// A route that comes back starts its counters from zero, which Prometheus reads as a
    /// reset. Returns how many routes were dropped.
    pub(crate) fn forget_routes(&self, exists: impl Fn(&str) -> bool) -> usize {
        let idle_and_gone = |name: &str, m: &RouteMetrics| !exists(name) && m.active.get() == 0;
        // Looked for under the read lock: connections resolving their handles are not held
        // up while a 10,000-route cache is scanned on every periodic check.
        let candidates: Vec<String> = {
            let cache = self.route_cache.read().unwrap_or_else(|e| e.into_inner());
            cache
                .iter()
                .filter(|(name, m)| idle_and_gone(name, m))
                .map(|(name, _)| name.clone())
                .collect()
        };
        if candidates.is_empty() {
            return 0;
        }
        let mut cache = self.route_cache.write().unwrap_or_else(|e| e.into_inner());
        // Checked again: a connection may have opened meanwhile.
        let gone: Vec<String> = candidates
            .into_iter()
            .filter(|name| cache.get(name).is_some_and(|m| idle_and_gone(name, m)))
            .collect();
        for name in &gone {
            cache.remove(name);
            let label = RouteLabel {
                route: name.clone(),
            };
            self.route_total.remove(&label);
            self.route_active.remove(&label);
            self.connect_duration.remove(&label);
            for direction in ["rx", "tx"] {
                self.route_bytes.remove(&RouteDirectionLabels {
                    route: name.clone(),
                    direction,
                });
            }
        }
        if !gone.is_empty() {
            let gone: std::collections::HashSet<&String> = gone.iter().collect();
            self.failure_labels
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|(route, reason)| {
                    let keep = !gone.contains(route);
                    if !keep {
                        self.connect_failures.remove(&RouteReasonLabels {
                            route: route.clone(),
                            reason,
                        });
                    }
                    keep
                });
            self.egress_labels
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|route, results| {
                    let keep = !gone.contains(route);
                    if !keep {
                        for &result in results.iter() {
                            self.egress_requests.remove(&RouteResultLabels {
                                route: route.clone(),
                                result,
                            });
                        }
                    }
                    keep
                });
        }
        gone.len()
    }

    /// Handles for one route (cached: one map lookup per connection).
    pub(crate) fn route(&self, route: &str) -> std::sync::Arc<RouteMetrics> {
        // A poisoned cache is still a valid cache.
        if let Some(m) = self
            .route_cache
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(route)
        {
            return m.clone();
        }
        let m = std::sync::Arc::new(self.route_uncached(route));
        let mut cache = self.route_cache.write().unwrap_or_else(|e| e.into_inner());
        cache.entry(route.to_owned()).or_insert(m).clone()
    }

    fn route_uncached(&self, route: &str) -> RouteMetrics {
        let label = RouteLabel {
            route: route.to_owned(),
        };
        let dir = |direction| RouteDirectionLabels {
            route: route.to_owned(),
            direction,
        };
        RouteMetrics {
            route: route.to_owned(),
            total: self.route_total.get_or_create_owned(&label),
            active: self.route_active.get_or_create_owned(&label),
            rx: self.route_bytes.get_or_create_owned(&dir("rx")),
            tx: self.route_bytes.get_or_create_owned(&dir("tx")),
            connect_duration: self.connect_duration.get_or_create_owned(&label),
        }
    }

    /// Handles for one listener.
    pub(crate) fn listener(&self, listener: &str) -> ListenerMetrics {
        let label = ListenerLabel {
            listener: listener.to_owned(),
        };
        ListenerMetrics {
            listener: listener.to_owned(),
            active: self.downstream_active.get_or_create_owned(&label),
            client_hello_bytes: self.client_hello_bytes.get_or_create_owned(&label),
            connection_duration: self.connection_duration.get_or_create_owned(&label),
            routed: self.downstream_total.get_or_create_owned(&OutcomeLabels {
                listener: listener.to_owned(),
                outcome: "routed",
            }),
            accept_paused: self.accept_paused.get_or_create_owned(&label),
        }
    }

    /// The Prometheus text exposition of every metric.
    pub(crate) fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The family names (`# TYPE` lines) an encoding declares.
    fn families(text: &str) -> Vec<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .map(str::to_owned)
            .collect()
    }

    const GATEWAY_ONLY: [&str; 5] = [
        "trellis_client_hello_bytes",
        "trellis_proxy_protocol_headers",
        "trellis_routing_table_routes",
        "trellis_routing_table_generation",
        "trellis_routing_table_reloads",
    ];

    /// A role's metrics with a series in every family (empty families are not encoded).
    fn touched(role: Role) -> String {
        let m = Metrics::new(role);
        let _ = m.listener("l");
        let _ = m.route("r");
        m.outcome("l", "routed");
        m.connect_failure("r", "refused");
        m.proxy_header("l", "absent");
        m.reload("applied");
        m.encode()
    }

    #[test]
    fn each_role_exports_its_own_families() {
        let gateway = families(&touched(Role::Gateway));
        let node = families(&touched(Role::Node));
        for name in GATEWAY_ONLY {
            assert!(gateway.iter().any(|f| f == name), "gateway lacks {name}");
            assert!(!node.iter().any(|f| f == name), "node exports {name}");
        }
        for name in [
            "trellis_downstream_connections",
            "trellis_route_bytes",
            "trellis_upstream_connect_failures",
            "trellis_connection_duration_seconds",
            "trellis_half_closed_connections",
            "trellis_build_info",
            "process_cpu_seconds",
            "process_resident_memory_bytes",
            "process_virtual_memory_bytes",
            "process_open_fds",
            "process_max_fds",
            "process_start_time_seconds",
            "process_threads",
        ] {
            assert!(gateway.iter().any(|f| f == name), "gateway lacks {name}");
            assert!(node.iter().any(|f| f == name), "node lacks {name}");
        }
    }

    #[test]
    fn the_controller_exports_its_families_and_no_connection_family() {
        let m = Metrics::controller();
        let c = &m.controller;
        c.objects
            .get_or_create(&KindLabel { kind: "Gateway" })
            .set(1);
        c.skipped
            .get_or_create(&ReasonLabel { reason: "l7" })
            .set(1);
        c.writes
            .get_or_create(&ResultLabel { result: "written" })
            .inc();
        c.watch_errors
            .get_or_create(&KindLabel { kind: "Service" })
            .inc();
        c.served
            .get_or_create(&KindVersionLabels {
                kind: "Gateway",
                version: "v1",
            })
            .set(1);
        let controller = families(&m.encode());
        for name in [
            "trellis_controller_objects",
            "trellis_controller_routes",
            "trellis_controller_skipped",
            "trellis_controller_renders",
            "trellis_controller_writes",
            "trellis_controller_change_to_write_seconds",
            "trellis_controller_watch_errors",
            "trellis_controller_served",
            "trellis_build_info",
            "process_open_fds",
        ] {
            assert!(
                controller.iter().any(|f| f == name),
                "controller lacks {name}"
            );
        }
        let gateway = families(&touched(Role::Gateway));
        for name in ["trellis_downstream_connections", "trellis_route_bytes"]
            .into_iter()
            .chain(GATEWAY_ONLY)
        {
            assert!(
                !controller.iter().any(|f| f == name),
                "controller exports {name}"
            );
        }
        assert!(!gateway.iter().any(|f| f.starts_with("trellis_controller")));
    }

    #[test]
    fn build_info_carries_the_version() {
        let text = Metrics::node().encode();
        let line = format!("trellis_build_info{{version=\"{}\"}} 1", crate::VERSION);
        assert!(text.lines().any(|l| l == line), "{text}");
        assert!(text.contains("\nprocess_cpu_seconds_total "), "{text}");
    }
}
