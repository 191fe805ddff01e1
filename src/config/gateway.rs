//! `kind: GatewayConfiguration`: raw schema and the validated [`GatewayConfig`].

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::decode::{Kind, Raw};
use super::routes::positive;
use super::{ConfigError, DEFAULT_RESOLVE_TIMEOUT, Errors, ResolverSettings, at};
use crate::route::TlsFiles;
use crate::route::{Net, NetSet};

mapping_only!(
    RawGateway,
    RawRoutesSource,
    RawListener,
    RawProxyProtocol,
    RawAdmin,
    RawTimeouts,
    RawKeepalive,
    RawKeepaliveSide,
    RawLimits,
    RawAccessLog,
    RawWireGuardListener,
    RawResolver
);

/// The `kind` of gateway configuration files.
pub const KIND: &str = "GatewayConfiguration";

/// Smallest accepted `maxClientHelloBytes`: a minimal ClientHello with one record header.
pub const MIN_CLIENT_HELLO_BYTES: usize = 512;
/// Largest accepted `maxClientHelloBytes`: four full TLS records.
pub const MAX_CLIENT_HELLO_BYTES: usize = 65_536;

/// A gateway configuration file as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawGateway {
    /// Always `trellis.gardener.cloud/v1alpha1`.
    pub api_version: String,
    /// Always `GatewayConfiguration`.
    pub kind: String,
    /// The gateway's own availability zone, for zone-preferring backend choice.
    #[serde(default)]
    pub zone: Option<String>,
    /// Where the routing table comes from.
    pub routes: RawRoutesSource,
    /// The listeners; names and addresses must be unique.
    pub listeners: Vec<RawListener>,
    /// Admin endpoint (`/ready`, `/metrics`, `/routes`).
    pub admin: RawAdmin,
    /// Timeouts for all listeners.
    #[serde(default)]
    pub timeouts: RawTimeouts,
    /// TCP keepalive on both legs.
    #[serde(default)]
    pub keepalive: RawKeepalive,
    /// Resource limits.
    #[serde(default)]
    pub limits: RawLimits,
    /// Access log settings.
    #[serde(default)]
    pub access_log: RawAccessLog,
    /// How backend names (and CONNECT targets) are resolved.
    #[serde(default)]
    pub resolver: RawResolver,
    /// Worker threads, each with its own event loop and `SO_REUSEPORT` sockets (default 0 =
    /// one per CPU).
    #[serde(default, deserialize_with = "super::whole_number")]
    pub workers: Option<u64>,
}

/// Where the routing table is read from.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawRoutesSource {
    /// Path of the `RoutingTable` file; relative paths are relative to this config file.
    pub file: String,
    /// How often the file is re-read even without a change event (default `10s`).
    #[serde(default)]
    pub check_interval: Option<String>,
}

/// One listener as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawListener {
    /// Unique name, used in metrics and logs.
    pub name: String,
    /// `IP:port` to bind.
    pub address: String,
    /// `sni`, `http-connect`, `proxy-destination`, `egress-connect` or `wireguard`.
    pub protocol: String,
    /// PROXY protocol from a load balancer in front.
    #[serde(default)]
    pub proxy_protocol: Option<RawProxyProtocol>,
    /// Route for traffic that matches no route.
    #[serde(default)]
    pub default_route: Option<String>,
    /// CONNECT destination header name (`http-connect` only).
    #[serde(default)]
    pub destination_header: Option<String>,
    /// Server certificate and client CA of an `egress-connect` listener (required there):
    /// used for connections no route selects before the handshake, and for routes that have
    /// no `tls` of their own. Relative paths are relative to this config file.
    #[serde(default)]
    pub tls: Option<super::tls::RawTls>,
    /// The WireGuard device of a `wireguard` listener (required there; the address is UDP).
    #[serde(default)]
    pub wireguard: Option<RawWireGuardListener>,
}

/// A `wireguard` listener's device as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawWireGuardListener {
    /// The device's private key, as `wg genkey` writes it; relative paths are relative to
    /// this config file. Read by the gateway when it starts (and re-read on change), not by
    /// `trellis check`.
    pub private_key_file: String,
    /// A CONNECT destination header value: a CONNECT with it, on any `http-connect`
    /// listener, carries WireGuard over TCP to this device. Left out: UDP only.
    #[serde(default)]
    pub connect_destination: Option<String>,
}

/// PROXY protocol settings as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawProxyProtocol {
    /// `off` (default), `optional` or `required`.
    #[serde(default)]
    pub mode: Option<String>,
    /// Peers (CIDRs) that may send a PROXY header.
    #[serde(default)]
    pub trusted_sources: Vec<String>,
}

/// Admin endpoint as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawAdmin {
    /// `IP:port` to bind: probes and metrics.
    pub address: String,
    /// `IP:port` for `/routes` and other state (gateway only; default `127.0.0.1:15000`).
    pub debug_address: Option<String>,
}

/// Timeouts as written.
#[derive(Debug, Default, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawTimeouts {
    /// Budget to connect to a backend, failover included (default `5s`).
    pub connect: Option<String>,
    /// Time for a client to send its ClientHello or request head (default `10s`).
    pub handshake: Option<String>,
    /// Close connections idle this long (default `1h`).
    pub idle: Option<String>,
    /// How long a half-closed connection may stay open (default `1m`).
    pub half_close: Option<String>,
    /// How long listeners keep accepting after SIGTERM while readiness fails (default `5s`).
    pub drain_delay: Option<String>,
    /// How long established connections may finish on shutdown (default `60s`).
    pub drain: Option<String>,
}

/// TCP keepalive as written.
#[derive(Debug, Default, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawKeepalive {
    /// Towards clients (default idle `55s`, interval `55s`).
    pub downstream: Option<RawKeepaliveSide>,
    /// Towards backends (default idle `2h`, interval `75s`).
    pub upstream: Option<RawKeepaliveSide>,
}

/// Keepalive of one leg as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawKeepaliveSide {
    /// Idle time before the first probe.
    pub idle: Option<String>,
    /// Time between probes.
    pub interval: Option<String>,
}

/// Limits as written.
#[derive(Debug, Default, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawLimits {
    /// Most client connections open at once (default 100000).
    #[serde(default, deserialize_with = "super::whole_number")]
    pub max_connections: Option<u64>,
    /// Most connections from one client address (0 = unlimited; by default half of
    /// `maxConnections` as admitted, see [`Limits::per_source`]).
    #[serde(default, deserialize_with = "super::whole_number")]
    pub max_connections_per_source: Option<u64>,
    /// Largest ClientHello, record headers included (default 16384).
    #[serde(default, deserialize_with = "super::whole_number")]
    pub max_client_hello_bytes: Option<u64>,
    /// Largest CONNECT request head (default 8192).
    #[serde(default, deserialize_with = "super::whole_number")]
    pub max_header_bytes: Option<u64>,
}

/// Access log settings as written.
#[derive(Debug, Default, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawAccessLog {
    /// Log a line for long-lived connections this often (off by default).
    pub interval: Option<String>,
}

/// Name resolution as written.
#[derive(Debug, Default, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawResolver {
    /// Name servers (`IP` or `IP:port`, port 53 by default) asked instead of
    /// `/etc/resolv.conf`'s; its search list and `ndots` still apply. At most three.
    #[serde(default)]
    pub nameservers: Vec<String>,
    /// Longest a lookup may take, retries included (default `2s`, or half of
    /// `timeouts.connect` when that is less); below `timeouts.connect`.
    pub timeout: Option<String>,
}

/// What a listener speaks, with the settings only that protocol has: a setting is carried by
/// the kind that uses it, so a listener can never hold one its protocol ignores. The file
/// keeps its flat form (`protocol: http-connect` next to `destinationHeader`); validation
/// builds the kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenerKind {
    /// TLS passthrough routed by SNI.
    Sni,
    /// HTTP CONNECT relay routed by a destination header.
    HttpConnect {
        /// The header whose value is matched against route `destinations`.
        destination_header: String,
    },
    /// Routed by the destination address of a PROXY header (GEP-08).
    ProxyDestination,
    /// kube-apiserver egress: CONNECT over mutual TLS, the route chosen by server name,
    /// client address or client certificate (SPEC `egress-connect`).
    EgressConnect {
        /// The listener's server certificate and client CA.
        tls: TlsFiles,
    },
    /// The gateway's one WireGuard device: shoot peers over UDP on the listener's address
    /// (the routes' `tunnel.wireguard`), terminated in user space (SPEC `wireguard`). It
    /// takes no TCP connections, so no PROXY header, TLS or default route.
    WireGuard {
        /// The device's private key file (absolute, or relative to the working directory).
        private_key_file: PathBuf,
        /// The CONNECT destination header value that carries WireGuard over TCP to the
        /// device through an `http-connect` listener.
        connect_destination: Option<String>,
    },
}

impl ListenerKind {
    /// The `protocol` as written in the file.
    pub fn as_str(&self) -> &'static str {
        match self {
            ListenerKind::Sni => "sni",
            ListenerKind::HttpConnect { .. } => "http-connect",
            ListenerKind::ProxyDestination => "proxy-destination",
            ListenerKind::EgressConnect { .. } => "egress-connect",
            ListenerKind::WireGuard { .. } => "wireguard",
        }
    }

    /// Whether the listener takes TCP connections (every protocol but `wireguard`, whose
    /// address is UDP).
    pub fn is_tcp(&self) -> bool {
        !matches!(self, ListenerKind::WireGuard { .. })
    }
}

/// Whether a PROXY header from a load balancer is expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// Never parsed.
    Off,
    /// Parsed when a trusted peer sends one.
    Optional,
    /// Trusted peers must send one.
    Required,
}

/// PROXY protocol settings of a listener.
#[derive(Debug, Clone)]
pub struct ProxyProtocol {
    /// The mode.
    pub mode: ProxyMode,
    /// Peers allowed to send a header (never empty with a mode other than off: the
    /// configuration requires it; empty trusts nobody).
    pub trusted_sources: NetSet,
}

impl ProxyProtocol {
    /// The effective mode for a connection from `peer`: untrusted peers are treated as off.
    pub fn mode_for(&self, peer: std::net::IpAddr) -> ProxyMode {
        if self.mode == ProxyMode::Off || !self.trusted_sources.contains(peer) {
            ProxyMode::Off
        } else {
            self.mode
        }
    }
}

/// The default CONNECT destination header.
pub const DEFAULT_DESTINATION_HEADER: &str = "X-Gardener-Destination";

/// A validated listener.
#[derive(Debug, Clone)]
pub struct ListenerConfig {
    /// Unique name.
    pub name: String,
    /// Bind address.
    pub address: SocketAddr,
    /// Protocol and its own settings.
    pub kind: ListenerKind,
    /// Route for unmatched traffic.
    pub default_route: Option<String>,
    /// PROXY protocol from a load balancer in front.
    pub proxy_protocol: ProxyProtocol,
}

/// Validated timeouts.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Backend connect budget.
    pub connect: Duration,
    /// ClientHello / request head deadline.
    pub handshake: Duration,
    /// Idle timeout.
    pub idle: Duration,
    /// Half-close bound.
    pub half_close: Duration,
    /// How long listeners keep accepting after SIGTERM (readiness already failing).
    pub drain_delay: Duration,
    /// Drain deadline.
    pub drain: Duration,
}

/// TCP keepalive of one leg.
#[derive(Debug, Clone, Copy)]
pub struct KeepaliveSide {
    /// Idle time before the first probe.
    pub idle: Duration,
    /// Time between probes.
    pub interval: Duration,
}

/// Validated limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most connections at once.
    pub max_connections: usize,
    /// Most connections per client address as configured: `Some(0)` = unlimited, `None` =
    /// the default ([`Limits::per_source`]).
    pub max_connections_per_source: Option<usize>,
    /// Largest ClientHello.
    pub max_client_hello_bytes: usize,
    /// Largest request head.
    pub max_header_bytes: usize,
}

impl Limits {
    /// Most connections one client address may hold (0 = unlimited): as configured, or by
    /// default half of `maxConnections` (as the descriptor budget admitted it), so that one
    /// address holding all it may leaves the other half to everyone else. Set it to 0 where
    /// many clients share one address the gateway sees (a load balancer that rewrites
    /// sources without a PROXY header).
    pub fn per_source(&self) -> usize {
        self.max_connections_per_source
            .unwrap_or((self.max_connections / 2).max(1))
    }
}

/// A validated gateway configuration.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Own zone.
    pub zone: Option<String>,
    /// Routing table file (absolute, or relative to the working directory).
    pub routes_file: PathBuf,
    /// Periodic re-read interval of the routing table.
    pub routes_check_interval: Duration,
    /// Listeners.
    pub listeners: Vec<ListenerConfig>,
    /// Admin bind address.
    pub admin: SocketAddr,
    /// Where `/routes` and other state are served (loopback by default).
    pub debug_address: SocketAddr,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// Keepalive towards clients.
    pub keepalive_downstream: KeepaliveSide,
    /// Keepalive towards backends.
    pub keepalive_upstream: KeepaliveSide,
    /// Limits.
    pub limits: Limits,
    /// Periodic access log interval.
    pub access_log_interval: Option<Duration>,
    /// How names are resolved.
    pub resolver: ResolverSettings,
    /// Worker threads (at least 1).
    pub workers: usize,
}

/// Reads and validates a gateway configuration file.
pub fn load(file: &Path) -> Result<GatewayConfig, ConfigError> {
    parse(file, &super::read_file(file)?)
}

/// Parses and validates the bytes of a gateway configuration file.
pub fn parse(file: &Path, bytes: &[u8]) -> Result<GatewayConfig, ConfigError> {
    let result = match super::decode::decode(file, bytes)? {
        (Raw::Gateway(raw), errors) => validate(file, raw, errors),
        (other, _) => Err(super::decode::wrong_kind(
            file,
            other.kind(),
            Kind::Gateway,
            "'trellis gateway'",
        )),
    };
    super::decode::located(file, bytes, result)
}

/// What `trellis check` adds for a gateway configuration: its routing table is loaded from
/// `routes.file` as the gateway resolves it (relative to the configuration's directory) and
/// validated, and every listener's `defaultRoute` must be in it. The gateway itself refuses
/// to start without a valid table, but starts with a missing default route (warning and
/// counting it at every load): the table may gain the route later, and a restart must not
/// fail meanwhile. A table's own errors are reported against the table's file.
pub fn check_routes(
    file: &Path,
    config: &GatewayConfig,
) -> Result<super::routes::LoadedTable, ConfigError> {
    let registry = crate::route::BackendRegistry::default();
    let routes = &config.routes_file;
    let table = match super::routes::load(routes, &registry) {
        Ok(t) => t,
        Err(ConfigError::Read { source, .. }) => {
            let mut errors = Errors::default();
            errors.push(
                "routes.file",
                format!(
                    "cannot read the routing table {}: {source}",
                    routes.display()
                ),
            );
            return Err(ConfigError::Invalid {
                file: file.to_owned(),
                errors: errors.found,
            });
        }
        Err(e) => return Err(e),
    };
    let mut errors = Errors::default();
    for (i, route) in table.table.routes().iter().enumerate() {
        if let Some(files) = route.egress.as_ref().and_then(|e| e.tls.as_ref())
            && let Err(e) = crate::net::tls::load(files)
        {
            errors.push(
                "routes.file",
                format!("routes[{i}].egress.tls in {}: {e}", routes.display()),
            );
        }
    }
    for (i, l) in config.listeners.iter().enumerate() {
        if let ListenerKind::WireGuard {
            connect_destination: Some(d),
            ..
        } = &l.kind
            && let Some(route) = table.table.by_destination(d)
        {
            errors.push(
                format!("listeners[{i}].wireguard.connectDestination"),
                format!(
                    "{d:?} is also a destination of route {:?} in {}; it must lead to one place",
                    route.name(),
                    routes.display()
                ),
            );
        }
        if let Some(r) = &l.default_route
            && table.table.by_name(r).is_none()
        {
            errors.push(
                format!("listeners[{i}].defaultRoute"),
                format!(
                    "route {r:?} is not in the routing table {}; unmatched connections would be rejected",
                    routes.display()
                ),
            );
        }
    }
    errors.finish(file, table)
}

/// Validates a decoded configuration; `errors` already holds the unknown fields.
pub(super) fn validate(
    file: &Path,
    raw: RawGateway,
    mut errors: Errors,
) -> Result<GatewayConfig, ConfigError> {
    let config = build(file, raw, &mut errors);
    errors.finish(file, config)
}

fn build(file: &Path, raw: RawGateway, errors: &mut Errors) -> GatewayConfig {
    super::check_api_version(errors, &raw.api_version);
    let dir = file.parent().unwrap_or(Path::new("."));
    let (listeners, addresses) = listeners(errors, dir, &raw.listeners);
    let admin = admin(errors, &raw.admin, &addresses);
    let debug_address = debug_address(errors, &raw.admin, &addresses, admin);
    let (routes_file, routes_check_interval) = routes_source(errors, file, &raw.routes);
    let timeouts = timeouts(errors, &raw.timeouts);
    let resolver = resolver(errors, &raw.resolver, timeouts.connect);
    GatewayConfig {
        zone: zone(raw.zone),
        routes_file,
        routes_check_interval,
        listeners,
        admin,
        debug_address,
        timeouts,
        keepalive_downstream: keepalive(
            errors,
            "keepalive.downstream",
            raw.keepalive.downstream.as_ref(),
            (55, 55),
        ),
        keepalive_upstream: keepalive(
            errors,
            "keepalive.upstream",
            raw.keepalive.upstream.as_ref(),
            (7200, 75),
        ),
        limits: limits(errors, &raw.limits),
        access_log_interval: raw
            .access_log
            .interval
            .as_deref()
            .and_then(|v| positive(errors, "accessLog.interval", v)),
        workers: workers(errors, raw.workers),
        resolver,
    }
}

/// The valid listeners, and every TCP address the listeners take (for the admin endpoint's).
fn listeners(
    errors: &mut Errors,
    dir: &Path,
    raw: &[RawListener],
) -> (Vec<ListenerConfig>, HashSet<SocketAddr>) {
    if raw.is_empty() {
        errors.push("listeners", "at least one listener is required");
    }
    let mut names = HashSet::new();
    let mut addresses = HashSet::new();
    let listeners: Vec<ListenerConfig> = raw
        .iter()
        .enumerate()
        .filter_map(|(i, l)| {
            listener(
                errors,
                &format!("listeners[{i}]"),
                dir,
                l,
                &mut names,
                &mut addresses,
            )
        })
        .collect();
    // One WireGuard device: a peer's key must lead to one place.
    let mut wireguard = raw
        .iter()
        .enumerate()
        .filter(|(_, l)| l.protocol == "wireguard");
    if let Some((first, _)) = wireguard.next() {
        for (i, _) in wireguard {
            errors.push(
                format!("listeners[{i}].protocol"),
                format!("a second wireguard listener (listeners[{first}]): the gateway has one WireGuard device"),
            );
        }
    }
    let has_connect = listeners
        .iter()
        .any(|l| matches!(l.kind, ListenerKind::HttpConnect { .. }));
    for (i, l) in raw.iter().enumerate() {
        if l.wireguard
            .as_ref()
            .is_some_and(|w| w.connect_destination.is_some())
            && !has_connect
        {
            errors.push(
                format!("listeners[{i}].wireguard.connectDestination"),
                "needs an http-connect listener for the CONNECTs to arrive on",
            );
        }
    }
    (listeners, addresses)
}

/// One listener, unless its address or protocol is invalid; names and addresses must not
/// repeat those in `names` and `addresses`, which it adds to.
fn listener(
    errors: &mut Errors,
    path: &str,
    dir: &Path,
    l: &RawListener,
    names: &mut HashSet<String>,
    addresses: &mut HashSet<SocketAddr>,
) -> Option<ListenerConfig> {
    if l.name.is_empty()
        || !l
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
    {
        errors.push(
            at(path, "name"),
            format!(
                "invalid listener name {:?} (letters, digits, '-', '_')",
                l.name
            ),
        );
    } else if !names.insert(l.name.clone()) {
        errors.push(
            at(path, "name"),
            format!("duplicate listener name {:?}", l.name),
        );
    }
    let address = socket_addr(errors, &at(path, "address"), &l.address);
    // A wireguard listener's address is UDP: a TCP listener may have the same.
    if let Some(a) = address
        && l.protocol != "wireguard"
        && !addresses.insert(a)
    {
        errors.push(
            at(path, "address"),
            format!("address {a} is used by another listener"),
        );
    }
    let kind = listener_kind(errors, path, dir, l);
    let proxy_protocol = proxy_protocol(errors, path, l.proxy_protocol.as_ref());
    if proxy_protocol.mode != ProxyMode::Off
        && proxy_protocol.trusted_sources.is_empty()
        && !matches!(kind, Some(ListenerKind::WireGuard { .. }))
    {
        // Whoever may write a PROXY header picks its own source address: past
        // `allowedSourceRanges`, into `sendProxyProtocol` and, on egress listeners, into any
        // shoot's route (`clientSources`). Nobody is trusted by default.
        let why = if matches!(kind, Some(ListenerKind::EgressConnect { .. })) {
            "the PROXY source selects egress routes by clientSources"
        } else {
            "the PROXY source is what allowedSourceRanges check and sendProxyProtocol passes on"
        };
        errors.push(
            at(path, "proxyProtocol.trustedSources"),
            format!(
                "required with a PROXY header mode: list the networks of the load balancers that \
                 send the header, e.g. trustedSources: [\"10.0.0.0/8\"] ({why}; a peer outside \
                 them may not send one)"
            ),
        );
    }
    if let Some(r) = &l.default_route
        && r.is_empty()
    {
        errors.push(at(path, "defaultRoute"), "must not be empty");
    }
    Some(ListenerConfig {
        name: l.name.clone(),
        address: address?,
        kind: kind?,
        default_route: l.default_route.clone(),
        proxy_protocol,
    })
}

/// The listener's protocol with its own settings; a setting of another protocol is an error.
fn listener_kind(
    errors: &mut Errors,
    path: &str,
    dir: &Path,
    l: &RawListener,
) -> Option<ListenerKind> {
    let kind = match l.protocol.as_str() {
        "sni" => Some(ListenerKind::Sni),
        "http-connect" => Some(ListenerKind::HttpConnect {
            destination_header: destination_header(errors, path, l.destination_header.as_deref()),
        }),
        "proxy-destination" => Some(ListenerKind::ProxyDestination),
        "egress-connect" => match &l.tls {
            Some(raw) => super::tls::files(errors, &at(path, "tls"), dir, raw)
                .map(|tls| ListenerKind::EgressConnect { tls }),
            None => {
                errors.push(
                    at(path, "tls"),
                    "required for egress-connect listeners: {certificateFile, keyFile, clientCAFile}",
                );
                None
            }
        },
        "wireguard" => wireguard(errors, path, dir, l),
        other => {
            errors.push(
                at(path, "protocol"),
                format!("unknown protocol {other:?}, expected one of sni, http-connect, proxy-destination, egress-connect, wireguard"),
            );
            None
        }
    };
    if l.tls.is_some() && l.protocol != "egress-connect" {
        errors.push(at(path, "tls"), "only valid for egress-connect listeners");
    }
    if l.destination_header.is_some() && !matches!(kind, Some(ListenerKind::HttpConnect { .. })) {
        errors.push(
            at(path, "destinationHeader"),
            "only valid for http-connect listeners",
        );
    }
    if l.wireguard.is_some() && l.protocol != "wireguard" {
        errors.push(at(path, "wireguard"), "only valid for wireguard listeners");
    }
    kind
}

/// A `wireguard` listener's device; the settings of TCP listeners are errors on it.
fn wireguard(errors: &mut Errors, path: &str, dir: &Path, l: &RawListener) -> Option<ListenerKind> {
    let tcp_only = [
        ("proxyProtocol", l.proxy_protocol.is_some()),
        ("defaultRoute", l.default_route.is_some()),
    ];
    for (field, set) in tcp_only {
        if set {
            errors.push(
                at(path, field),
                "not valid for wireguard listeners: they take no TCP connections (the address is UDP)",
            );
        }
    }
    let Some(raw) = &l.wireguard else {
        errors.push(
            at(path, "wireguard"),
            "required for wireguard listeners: {privateKeyFile}",
        );
        return None;
    };
    let before = errors.len();
    if raw.private_key_file.is_empty() {
        errors.push(at(path, "wireguard.privateKeyFile"), "must not be empty");
    }
    let private_key_file = PathBuf::from(&raw.private_key_file);
    let private_key_file = if private_key_file.is_relative() {
        dir.join(private_key_file)
    } else {
        private_key_file
    };
    if let Some(d) = &raw.connect_destination
        && !super::routes::valid_destination(d)
    {
        errors.push(
            at(path, "wireguard.connectDestination"),
            format!("invalid destination {d:?}"),
        );
    }
    (errors.len() == before).then(|| ListenerKind::WireGuard {
        private_key_file,
        connect_destination: raw.connect_destination.clone(),
    })
}

/// An `http-connect` listener's destination header name (an HTTP token).
fn destination_header(errors: &mut Errors, path: &str, raw: Option<&str>) -> String {
    let Some(h) = raw else {
        return DEFAULT_DESTINATION_HEADER.to_owned();
    };
    if !valid_header_name(h) {
        errors.push(
            at(path, "destinationHeader"),
            format!("invalid header name {h:?}"),
        );
    }
    h.to_owned()
}

/// Whether `h` is an HTTP header name (a token).
pub(super) fn valid_header_name(h: &str) -> bool {
    !h.is_empty()
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// The admin endpoint's address, which no listener may take.
fn admin(errors: &mut Errors, raw: &RawAdmin, listeners: &HashSet<SocketAddr>) -> SocketAddr {
    let admin = socket_addr(errors, "admin.address", &raw.address);
    if let Some(a) = admin
        && listeners.contains(&a)
    {
        errors.push(
            "admin.address",
            format!("address {a} is used by a listener"),
        );
    }
    admin.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)))
}

/// Where `/routes` and other state are served: `admin.debugAddress`, loopback port 15000 by
/// default; neither a listener's address nor the admin address.
fn debug_address(
    errors: &mut Errors,
    raw: &RawAdmin,
    listeners: &HashSet<SocketAddr>,
    admin: SocketAddr,
) -> SocketAddr {
    let Some(text) = raw.debug_address.as_deref() else {
        return DEFAULT_DEBUG_ADDRESS;
    };
    let debug = socket_addr(errors, "admin.debugAddress", text);
    if let Some(a) = debug {
        if listeners.contains(&a) {
            errors.push(
                "admin.debugAddress",
                format!("address {a} is used by a listener"),
            );
        } else if a == admin && a.port() != 0 {
            errors.push(
                "admin.debugAddress",
                format!("address {a} is admin.address; the debug endpoint needs its own"),
            );
        }
    }
    debug.unwrap_or(DEFAULT_DEBUG_ADDRESS)
}

/// `admin.debugAddress` when none is written: loopback only, as Envoy's admin port.
pub const DEFAULT_DEBUG_ADDRESS: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 15000);

/// The environment variable that sets the gateway's zone (the manifests fill it from the
/// pod's zone); it wins over `zone` in the file, which all replicas share.
pub const ZONE_ENV: &str = "TRELLIS_ZONE";

/// The zone: `TRELLIS_ZONE` when set and not empty, else the file's `zone`.
fn zone(file: Option<String>) -> Option<String> {
    match std::env::var(ZONE_ENV) {
        Ok(z) if !z.trim().is_empty() => Some(z.trim().to_owned()),
        _ => file,
    }
}

/// The routing table file (a relative path is relative to the directory of `file`) and how
/// often it is re-read.
fn routes_source(errors: &mut Errors, file: &Path, raw: &RawRoutesSource) -> (PathBuf, Duration) {
    if raw.file.is_empty() {
        errors.push("routes.file", "must not be empty");
    }
    let check_interval = raw
        .check_interval
        .as_deref()
        .and_then(|v| positive(errors, "routes.checkInterval", v))
        .unwrap_or(Duration::from_secs(10));
    let routes_file = PathBuf::from(&raw.file);
    let routes_file = if routes_file.is_relative() {
        file.parent().unwrap_or(Path::new(".")).join(routes_file)
    } else {
        routes_file
    };
    (routes_file, check_interval)
}

/// Timeouts with their defaults; every one but `drain` must be greater than zero. The node
/// daemon's are the same.
pub(super) fn timeouts(errors: &mut Errors, raw: &RawTimeouts) -> Timeouts {
    let mut positive_or = |path: &str, v: Option<&str>, default: u64| {
        v.and_then(|v| positive(errors, path, v))
            .unwrap_or(Duration::from_secs(default))
    };
    let connect = positive_or("timeouts.connect", raw.connect.as_deref(), 5);
    let handshake = positive_or("timeouts.handshake", raw.handshake.as_deref(), 10);
    let idle = positive_or("timeouts.idle", raw.idle.as_deref(), 3600);
    let half_close = positive_or("timeouts.halfClose", raw.half_close.as_deref(), 60);
    Timeouts {
        connect,
        handshake,
        idle,
        half_close,
        drain_delay: errors.duration_or(
            "timeouts.drainDelay",
            raw.drain_delay.as_deref(),
            Duration::from_secs(5),
        ),
        drain: errors.duration_or(
            "timeouts.drain",
            raw.drain.as_deref(),
            Duration::from_secs(60),
        ),
    }
}

/// Most name servers (glibc's `MAXNS`; the descriptor budget keeps a TCP socket for each).
pub const MAX_NAMESERVERS: usize = 3;

/// The resolver settings; the timeout must leave the connect budget time to connect.
fn resolver(errors: &mut Errors, raw: &RawResolver, connect: Duration) -> ResolverSettings {
    if raw.nameservers.len() > MAX_NAMESERVERS {
        errors.push(
            "resolver.nameservers",
            format!(
                "{} name servers; at most {MAX_NAMESERVERS} are asked",
                raw.nameservers.len()
            ),
        );
    }
    let nameservers = raw
        .nameservers
        .iter()
        .enumerate()
        .filter_map(|(i, v)| {
            let parsed = v
                .parse::<SocketAddr>()
                .ok()
                .or_else(|| v.parse::<std::net::IpAddr>().ok().map(|ip| (ip, 53).into()));
            if parsed.is_none() {
                errors.push(
                    format!("resolver.nameservers[{i}]"),
                    format!("expected IP or IP:port, got {v:?}"),
                );
            }
            parsed
        })
        .collect();
    let timeout = match raw.timeout.as_deref() {
        Some(v) => positive(errors, "resolver.timeout", v).unwrap_or(DEFAULT_RESOLVE_TIMEOUT),
        None => DEFAULT_RESOLVE_TIMEOUT.min(connect / 2),
    };
    if raw.timeout.is_some() && timeout >= connect {
        errors.push(
            "resolver.timeout",
            format!(
                "{timeout:?} is not below timeouts.connect ({connect:?}): a backend whose name \
                 never answers would leave no time to connect to the next"
            ),
        );
    }
    ResolverSettings {
        nameservers,
        timeout,
    }
}

fn limits(errors: &mut Errors, raw: &RawLimits) -> Limits {
    Limits {
        max_connections: bounded(
            errors,
            "limits.maxConnections",
            raw.max_connections,
            100_000,
            1..=10_000_000,
        ),
        max_connections_per_source: raw.max_connections_per_source.map(|v| {
            bounded(
                errors,
                "limits.maxConnectionsPerSource",
                Some(v),
                0,
                0..=10_000_000,
            )
        }),
        max_client_hello_bytes: bounded(
            errors,
            "limits.maxClientHelloBytes",
            raw.max_client_hello_bytes,
            16_384,
            MIN_CLIENT_HELLO_BYTES..=MAX_CLIENT_HELLO_BYTES,
        ),
        max_header_bytes: bounded(
            errors,
            "limits.maxHeaderBytes",
            raw.max_header_bytes,
            8192,
            256..=65_536,
        ),
    }
}

/// Worker threads: as written, or one per CPU for 0 (the default).
fn workers(errors: &mut Errors, raw: Option<u64>) -> usize {
    match bounded(errors, "workers", raw, 0, 0..=256) {
        0 => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        n => n,
    }
}

fn proxy_protocol(
    errors: &mut Errors,
    path: &str,
    raw: Option<&RawProxyProtocol>,
) -> ProxyProtocol {
    let Some(raw) = raw else {
        return ProxyProtocol {
            mode: ProxyMode::Off,
            trusted_sources: NetSet::new(),
        };
    };
    let mode = match raw.mode.as_deref() {
        None | Some("off") => ProxyMode::Off,
        Some("optional") => ProxyMode::Optional,
        Some("required") => ProxyMode::Required,
        Some(other) => {
            errors.push(
                format!("{path}.proxyProtocol.mode"),
                format!("expected off, optional or required, got {other:?}"),
            );
            ProxyMode::Off
        }
    };
    let trusted_sources = raw
        .trusted_sources
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            Net::parse(s)
                .map_err(|e| errors.push(format!("{path}.proxyProtocol.trustedSources[{i}]"), e))
                .ok()
        })
        .collect();
    ProxyProtocol {
        mode,
        trusted_sources,
    }
}

pub(super) fn socket_addr(errors: &mut Errors, path: &str, value: &str) -> Option<SocketAddr> {
    value
        .parse()
        .map_err(|_| errors.push(path, format!("expected IP:port, got {value:?}")))
        .ok()
}

pub(super) fn keepalive(
    errors: &mut Errors,
    path: &str,
    raw: Option<&RawKeepaliveSide>,
    default: (u64, u64),
) -> KeepaliveSide {
    let (idle, interval) = raw
        .map(|r| (r.idle.as_deref(), r.interval.as_deref()))
        .unwrap_or_default();
    let mut get = |field: &str, v: Option<&str>, d: u64| match v {
        Some(v) => positive(errors, &at(path, field), v).unwrap_or(Duration::from_secs(d)),
        None => Duration::from_secs(d),
    };
    KeepaliveSide {
        idle: get("idle", idle, default.0),
        interval: get("interval", interval, default.1),
    }
}

fn bounded(
    errors: &mut Errors,
    path: &str,
    value: Option<u64>,
    default: usize,
    range: std::ops::RangeInclusive<usize>,
) -> usize {
    let Some(v) = value else { return default };
    match usize::try_from(v) {
        Ok(v) if range.contains(&v) => v,
        _ => {
            errors.push(
                path,
                format!("{v} is out of range {}..={}", range.start(), range.end()),
            );
            default
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PROXY mode with no trusted sources trusts nobody (the configuration refuses it;
    /// this is the second line).
    #[test]
    fn an_empty_trusted_set_trusts_nobody() {
        let p = ProxyProtocol {
            mode: ProxyMode::Required,
            trusted_sources: NetSet::new(),
        };
        assert_eq!(p.mode_for("127.0.0.1".parse().unwrap()), ProxyMode::Off);
    }

    fn check(yaml: &str) -> Result<GatewayConfig, String> {
        parse(Path::new("/etc/trellis/gateway.yaml"), yaml.as_bytes()).map_err(|e| e.to_string())
    }

    const HEAD: &str = "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: GatewayConfiguration\n";

    #[test]
    fn minimal_with_defaults() {
        let c = check(&format!(
            "{HEAD}routes: {{file: routes.yaml}}\nlisteners:\n- {{name: tls, address: \"0.0.0.0:9443\", protocol: sni}}\nadmin: {{address: \"127.0.0.1:15021\"}}\n"
        ))
        .unwrap();
        assert_eq!(c.routes_file, Path::new("/etc/trellis/routes.yaml"));
        assert_eq!(c.timeouts.connect, Duration::from_secs(5));
        assert_eq!(c.limits.max_client_hello_bytes, 16_384);
        assert_eq!(c.keepalive_upstream.idle, Duration::from_secs(7200));
    }

    /// The resolver's name servers take `IP` or `IP:port`; its timeout defaults below the
    /// connect budget and must stay below it; every mistake is named with its path.
    #[test]
    fn resolver_settings() {
        let base = format!(
            "{HEAD}routes: {{file: r.yaml}}\nlisteners:\n- {{name: a, address: \"0.0.0.0:1\", protocol: sni}}\nadmin: {{address: \"127.0.0.1:5\"}}\n"
        );
        let c = check(&base).unwrap();
        assert_eq!(c.resolver, ResolverSettings::default());
        assert!(c.resolver.timeout < c.timeouts.connect);
        let c = check(&format!(
            "{base}resolver: {{nameservers: [\"10.96.0.10\", \"127.0.0.2:5353\", \"[::1]:53\"], timeout: 1s}}\n"
        ))
        .unwrap();
        let ns: Vec<String> = c
            .resolver
            .nameservers
            .iter()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(ns, ["10.96.0.10:53", "127.0.0.2:5353", "[::1]:53"]);
        assert_eq!(c.resolver.timeout, Duration::from_secs(1));
        // A shorter connect budget shortens the default.
        let c = check(&format!("{base}timeouts: {{connect: 1s}}\n")).unwrap();
        assert_eq!(c.resolver.timeout, Duration::from_millis(500));
        let err = check(&format!(
            "{base}timeouts: {{connect: 2s}}\nresolver: {{nameservers: [dns.local, \"1.1.1.1\", \"1.0.0.1\", \"8.8.8.8\"], timeout: 3s}}\n"
        ))
        .unwrap_err();
        for want in [
            "resolver.nameservers: 4 name servers; at most 3",
            "resolver.nameservers[0]: expected IP or IP:port, got \"dns.local\"",
            "resolver.timeout: 3s is not below timeouts.connect (2s)",
        ] {
            assert!(err.contains(want), "{want:?} in {err}");
        }
    }

    /// Each protocol's settings live in its kind: an `http-connect` listener carries its
    /// destination header (or the default), and another protocol may not name one.
    #[test]
    fn listener_kinds_carry_their_settings() {
        let c = check(&format!(
            "{HEAD}routes: {{file: r.yaml}}
listeners:
- {{name: a, address: \"0.0.0.0:1\", protocol: sni}}
- {{name: b, address: \"0.0.0.0:2\", protocol: http-connect}}
- {{name: c, address: \"0.0.0.0:3\", protocol: http-connect, destinationHeader: Reversed-VPN}}
- {{name: d, address: \"0.0.0.0:4\", protocol: proxy-destination}}
admin: {{address: \"127.0.0.1:5\"}}
"
        ))
        .unwrap();
        let kinds: Vec<_> = c.listeners.iter().map(|l| l.kind.clone()).collect();
        assert_eq!(
            kinds,
            [
                ListenerKind::Sni,
                ListenerKind::HttpConnect {
                    destination_header: DEFAULT_DESTINATION_HEADER.into()
                },
                ListenerKind::HttpConnect {
                    destination_header: "Reversed-VPN".into()
                },
                ListenerKind::ProxyDestination,
            ]
        );
        let err = check(&format!(
            "{HEAD}routes: {{file: r.yaml}}
listeners:
- {{name: a, address: \"0.0.0.0:1\", protocol: sni, destinationHeader: X-D}}
- {{name: b, address: \"0.0.0.0:2\", protocol: http-connect, destinationHeader: \"X D\"}}
admin: {{address: \"127.0.0.1:5\"}}
"
        ))
        .unwrap_err();
        assert_eq!(
            err,
            "/etc/trellis/gateway.yaml:5:69: listeners[0].destinationHeader: only valid for http-connect listeners
/etc/trellis/gateway.yaml:6:78: listeners[1].destinationHeader: invalid header name \"X D\""
        );
    }

    #[test]
    fn every_error_has_a_path() {
        let err = check(&format!(
            "{HEAD}routes: {{file: routes.yaml}}
listeners:
- {{name: tls, address: \"0.0.0.0:9443\", protocol: sni}}
- {{name: tls, address: \"0.0.0.0:9443\", protocol: sni}}
- {{name: x, address: \"nope\", protocol: gopher}}
admin: {{address: \"0.0.0.0:9443\"}}
timeouts: {{connect: 0s, idle: soon}}
limits: {{maxClientHelloBytes: 10}}
"
        ))
        .unwrap_err();
        for needle in [
            "gateway.yaml:6:10: listeners[1].name: duplicate listener name",
            "gateway.yaml:6:24: listeners[1].address: address 0.0.0.0:9443 is used",
            "gateway.yaml:7:22: listeners[2].address: expected IP:port",
            "gateway.yaml:7:40: listeners[2].protocol: unknown protocol \"gopher\"",
            "gateway.yaml:8:18: admin.address: address 0.0.0.0:9443 is used by a listener",
            "gateway.yaml:9:21: timeouts.connect: must be greater than 0",
            "gateway.yaml:9:31: timeouts.idle: invalid duration",
            "gateway.yaml:10:31: limits.maxClientHelloBytes: 10 is out of range",
        ] {
            assert!(err.contains(needle), "{needle} not in:\n{err}");
        }
    }

    /// A `wireguard` listener: its device's key file (relative to the config), an optional
    /// CONNECT destination; its UDP address may be a TCP listener's too.
    #[test]
    fn a_wireguard_listener_is_one_udp_device() {
        let c = check(&format!(
            "{HEAD}routes: {{file: r.yaml}}
listeners:
- {{name: tls, address: \"0.0.0.0:9443\", protocol: sni}}
- {{name: connect, address: \"0.0.0.0:8443\", protocol: http-connect}}
- name: wg
  address: \"0.0.0.0:9443\"
  protocol: wireguard
  wireguard: {{privateKeyFile: wireguard.key, connectDestination: \"trellis-wireguard:51820\"}}
admin: {{address: \"127.0.0.1:5\"}}
"
        ))
        .unwrap();
        assert_eq!(
            c.listeners[2].kind,
            ListenerKind::WireGuard {
                private_key_file: "/etc/trellis/wireguard.key".into(),
                connect_destination: Some("trellis-wireguard:51820".into()),
            }
        );
        assert!(!c.listeners[2].kind.is_tcp() && c.listeners[0].kind.is_tcp());
        assert_eq!(c.listeners[2].kind.as_str(), "wireguard");
        let c = check(&format!(
            "{HEAD}routes: {{file: r.yaml}}\nlisteners:\n- {{name: wg, address: \"[::]:51820\", protocol: wireguard, wireguard: {{privateKeyFile: /k}}}}\nadmin: {{address: \"127.0.0.1:5\"}}\n"
        ))
        .unwrap();
        assert_eq!(
            c.listeners[0].kind,
            ListenerKind::WireGuard {
                private_key_file: "/k".into(),
                connect_destination: None
            }
        );
    }

    /// The settings of TCP listeners are errors on a `wireguard` listener, its own section
    /// is an error elsewhere, and a gateway has one device.
    #[test]
    fn wireguard_listener_errors() {
        let err = check(&format!(
            "{HEAD}routes: {{file: r.yaml}}
listeners:
- name: wg
  address: \"0.0.0.0:51820\"
  protocol: wireguard
  wireguard: {{privateKeyFile: k}}
  tls: {{certificateFile: a, keyFile: b, clientCAFile: c}}
  proxyProtocol: {{mode: optional}}
  defaultRoute: r
  destinationHeader: X-D
- {{name: wg2, address: \"0.0.0.0:51821\", protocol: wireguard}}
- {{name: tls, address: \"0.0.0.0:1\", protocol: sni, wireguard: {{privateKeyFile: k}}}}
- {{name: wg3, address: \"0.0.0.0:51822\", protocol: wireguard, wireguard: {{privateKeyFile: \"\", connectDestination: \"a b\", listenPort: 1}}}}
admin: {{address: \"127.0.0.1:5\"}}
"
        ))
        .unwrap_err();
        let f = "/etc/trellis/gateway.yaml";
        for needle in [
            format!("{f}:9:8: listeners[0].tls: only valid for egress-connect listeners"),
            format!(
                "{f}:10:18: listeners[0].proxyProtocol: not valid for wireguard listeners: they take no TCP connections"
            ),
            format!("{f}:11:17: listeners[0].defaultRoute: not valid for wireguard listeners"),
            format!(
                "{f}:12:22: listeners[0].destinationHeader: only valid for http-connect listeners"
            ),
            format!("{f}:13:3: listeners[1].wireguard: required for wireguard listeners"),
            format!("{f}:13:51: listeners[1].protocol: a second wireguard listener (listeners[0])"),
            format!("{f}:14:63: listeners[2].wireguard: only valid for wireguard listeners"),
            format!("{f}:15:90: listeners[3].wireguard.privateKeyFile: must not be empty"),
            format!(
                "{f}:15:114: listeners[3].wireguard.connectDestination: invalid destination \"a b\""
            ),
            format!("{f}:15:121: listeners[3].wireguard.listenPort: unknown field `listenPort`"),
            format!("{f}:15:51: listeners[3].protocol: a second wireguard listener (listeners[0])"),
            format!(
                "{f}:15:114: listeners[3].wireguard.connectDestination: needs an http-connect listener"
            ),
        ] {
            assert!(err.contains(&needle), "{needle}\nnot in:\n{err}");
        }
        assert_eq!(err.lines().count(), 12, "{err}");
    }

    #[test]
    fn unknown_and_mistyped_fields() {
        let err = check(&format!(
            "{HEAD}routes: {{file: r.yaml}}\nlisteners: []\nadmin: {{address: x, port: 1}}\n"
        ))
        .unwrap_err();
        assert!(err.contains("admin.port: unknown field `port`"), "{err}");
        let err = check(&format!("{HEAD}routes: {{file: r.yaml}}\nlisteners: []\nadmin: {{address: x}}\nlimits: {{maxConnections: lots}}\n"))
            .unwrap_err();
        assert!(err.contains("limits.maxConnections: invalid type"), "{err}");
    }
}
