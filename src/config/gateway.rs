//! `kind: GatewayConfiguration`: the gateway's listeners, routing table source, admin
//! endpoint, timeouts, limits and name resolution, decoded into [`GatewayConfig`] with every
//! value typed; validation keeps the rules across fields (unique names and addresses, each
//! protocol's own settings, one WireGuard device).

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use super::common::{Admin, GatewayUpstream, Keepalive, Timeouts};
use super::error::{Errors, at};
use super::load::{ConfigKind, Source};
use super::value::{
    ApiVersion, Count, DEFAULT_DESTINATION_HEADER, Destination, FilePath, HeaderName, Positive,
    Text, plain, secs,
};
use crate::net::resolve::{DEFAULT_RESOLVE_TIMEOUT, ResolverSettings};
use crate::route::{NetSet, TlsFiles};

mapping_only!(
    GatewayConfig,
    RoutesSource,
    Listener,
    ProxyProtocol,
    Limits,
    AccessLog,
    WireGuardListener,
    Resolver
);
text_values!(ListenerName, Protocol, ProxyMode, Nameserver);

/// Smallest accepted `maxClientHelloBytes`: a minimal ClientHello with one record header.
pub const MIN_CLIENT_HELLO_BYTES: usize = 512;
/// Largest accepted `maxClientHelloBytes`: four full TLS records.
pub const MAX_CLIENT_HELLO_BYTES: usize = 65_536;

/// A gateway configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct GatewayConfig {
    /// Always `trellis.gardener.cloud/v1alpha1`.
    pub api_version: ApiVersion,
    /// Always `GatewayConfiguration`.
    pub kind: String,
    /// The gateway's own availability zone, for zone-preferring backend choice
    /// (`TRELLIS_ZONE` wins over it).
    #[serde(default)]
    pub zone: Option<String>,
    /// Where the routing table comes from.
    pub routes: RoutesSource,
    /// The listeners; names and addresses must be unique.
    pub listeners: Vec<Listener>,
    /// Admin endpoint (`/ready`, `/metrics`; `/routes` on `debugAddress`).
    pub admin: Admin,
    /// Timeouts for all listeners.
    #[serde(default)]
    pub timeouts: Timeouts,
    /// TCP keepalive on both legs (towards backends: idle `2h`, interval `75s`).
    #[serde(default)]
    pub keepalive: Keepalive<GatewayUpstream>,
    /// Resource limits.
    #[serde(default)]
    pub limits: Limits,
    /// Access log settings.
    #[serde(default)]
    pub access_log: AccessLog,
    /// How backend names (and CONNECT targets) are resolved.
    #[serde(default)]
    pub resolver: Resolver,
    /// Worker threads, each with its own event loop and `SO_REUSEPORT` sockets (default 0 =
    /// one per CPU, which validation puts in its place).
    #[serde(default, deserialize_with = "plain::<Count<0, 256>, _>")]
    pub workers: usize,
}

/// Where the routing table is read from.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RoutesSource {
    /// The `RoutingTable` file; relative to this config file until validated, then absolute
    /// or relative to the working directory.
    #[serde(deserialize_with = "plain::<FilePath, _>")]
    pub file: std::path::PathBuf,
    /// How often the file is re-read even without a change event (default `10s`).
    #[serde(default = "secs::<10>", deserialize_with = "plain::<Positive, _>")]
    pub check_interval: Duration,
}

/// One listener as the file has it: its protocol and that protocol's own settings side by
/// side ([`Listener::kind`] puts them together).
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct Listener {
    /// Unique name, used in metrics and logs.
    pub name: ListenerName,
    /// `IP:port` to bind.
    #[serde(deserialize_with = "plain::<super::value::Address, _>")]
    pub address: SocketAddr,
    /// `sni`, `http-connect`, `proxy-destination`, `egress-connect` or `wireguard`.
    pub protocol: Protocol,
    /// PROXY protocol from a load balancer in front.
    #[serde(default)]
    pub proxy_protocol: Option<ProxyProtocol>,
    /// Route for traffic that matches no route.
    #[serde(default)]
    pub default_route: Option<String>,
    /// CONNECT destination header name (`http-connect` only).
    #[serde(default)]
    pub destination_header: Option<HeaderName>,
    /// Server certificate and client CA of an `egress-connect` listener (required there):
    /// used for connections no route selects before the handshake, and for routes that have
    /// no `tls` of their own. Relative paths are relative to this config file.
    #[serde(default)]
    pub tls: Option<TlsFiles>,
    /// The WireGuard device of a `wireguard` listener (required there; the address is UDP).
    #[serde(default)]
    pub wireguard: Option<WireGuardListener>,
}

/// A listener's name: letters, digits, `-` and `_`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ListenerName(pub String);

impl std::fmt::Display for ListenerName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::ops::Deref for ListenerName {
    type Target = String;
    fn deref(&self) -> &String {
        &self.0
    }
}

impl Text for ListenerName {
    fn from_text(text: &str) -> Result<Self, String> {
        let valid = !text.is_empty()
            && text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'));
        if valid {
            Ok(ListenerName(text.to_owned()))
        } else {
            Err(format!(
                "invalid listener name {text:?} (letters, digits, '-', '_')"
            ))
        }
    }
    fn stand_in() -> Self {
        ListenerName(String::new())
    }
}

/// What a listener speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `sni`.
    Sni,
    /// `http-connect`.
    HttpConnect,
    /// `proxy-destination`.
    ProxyDestination,
    /// `egress-connect`.
    EgressConnect,
    /// `wireguard`.
    WireGuard,
}

impl Protocol {
    const ALL: [Protocol; 5] = [
        Protocol::Sni,
        Protocol::HttpConnect,
        Protocol::ProxyDestination,
        Protocol::EgressConnect,
        Protocol::WireGuard,
    ];

    /// The `protocol` as written in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Sni => "sni",
            Protocol::HttpConnect => "http-connect",
            Protocol::ProxyDestination => "proxy-destination",
            Protocol::EgressConnect => "egress-connect",
            Protocol::WireGuard => "wireguard",
        }
    }
}

impl Text for Protocol {
    fn from_text(text: &str) -> Result<Self, String> {
        Protocol::ALL.into_iter().find(|p| p.as_str() == text).ok_or_else(|| {
            format!("unknown protocol {text:?}, expected one of sni, http-connect, proxy-destination, egress-connect, wireguard")
        })
    }
    fn stand_in() -> Self {
        Protocol::Sni
    }
}

/// A `wireguard` listener's device.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct WireGuardListener {
    /// The device's private key, as `wg genkey` writes it; relative to this config file
    /// until validated. Read by the gateway when it starts (and re-read on change), and by
    /// `trellis check`.
    #[serde(deserialize_with = "plain::<FilePath, _>")]
    pub private_key_file: std::path::PathBuf,
    /// A CONNECT destination header value: a CONNECT with it, on any `http-connect`
    /// listener, carries WireGuard over TCP to this device. Left out: UDP only.
    #[serde(default)]
    pub connect_destination: Option<Destination>,
}

/// What a listener speaks, with the settings only that protocol has (validation makes sure
/// a listener holds no setting its protocol ignores, and every one it needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenerKind<'a> {
    /// TLS passthrough routed by SNI.
    Sni,
    /// HTTP CONNECT relay routed by a destination header.
    HttpConnect {
        /// The header whose value is matched against route `destinations`.
        destination_header: &'a str,
    },
    /// Routed by the destination address of a PROXY header (GEP-08).
    ProxyDestination,
    /// kube-apiserver egress: CONNECT over mutual TLS, the route chosen by server name,
    /// client address or client certificate (SPEC `egress-connect`).
    EgressConnect {
        /// The listener's server certificate and client CA.
        tls: &'a TlsFiles,
    },
    /// The gateway's one WireGuard device: shoot peers over UDP on the listener's address
    /// (the routes' `tunnel.wireguard`), terminated in user space (SPEC `wireguard`). It
    /// takes no TCP connections, so no PROXY header, TLS or default route.
    WireGuard {
        /// The device's private key file (absolute, or relative to the working directory).
        private_key_file: &'a Path,
        /// The CONNECT destination header value that carries WireGuard over TCP to the
        /// device through an `http-connect` listener.
        connect_destination: Option<&'a str>,
    },
}

impl ListenerKind<'_> {
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

/// An `egress-connect` listener's `tls` when validation found none (never served: such a
/// configuration is refused).
static NO_TLS: std::sync::LazyLock<TlsFiles> = std::sync::LazyLock::new(|| TlsFiles {
    certificate_file: Default::default(),
    key_file: Default::default(),
    client_ca_file: Default::default(),
});

impl Listener {
    /// The protocol with its own settings.
    pub fn kind(&self) -> ListenerKind<'_> {
        match self.protocol {
            Protocol::Sni => ListenerKind::Sni,
            Protocol::HttpConnect => ListenerKind::HttpConnect {
                destination_header: self
                    .destination_header
                    .as_ref()
                    .map_or(DEFAULT_DESTINATION_HEADER, |h| h.as_str()),
            },
            Protocol::ProxyDestination => ListenerKind::ProxyDestination,
            // Validation refuses an egress-connect listener without `tls`.
            Protocol::EgressConnect => ListenerKind::EgressConnect {
                tls: self.tls.as_ref().unwrap_or(&NO_TLS),
            },
            // Validation refuses a wireguard listener without `wireguard`.
            Protocol::WireGuard => ListenerKind::WireGuard {
                private_key_file: self
                    .wireguard
                    .as_ref()
                    .map_or(Path::new(""), |w| &w.private_key_file),
                connect_destination: self
                    .wireguard
                    .as_ref()
                    .and_then(|w| w.connect_destination.as_ref())
                    .map(|d| d.as_str()),
            },
        }
    }

    /// The effective PROXY mode for a connection from `peer` (off without a
    /// `proxyProtocol`, and for untrusted peers).
    pub fn proxy_mode_for(&self, peer: IpAddr) -> ProxyMode {
        self.proxy_protocol
            .as_ref()
            .map_or(ProxyMode::Off, |p| p.mode_for(peer))
    }
}

/// Whether a PROXY header from a load balancer is expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProxyMode {
    /// Never parsed.
    #[default]
    Off,
    /// Parsed when a trusted peer sends one.
    Optional,
    /// Trusted peers must send one.
    Required,
}

impl Text for ProxyMode {
    fn from_text(text: &str) -> Result<Self, String> {
        match text {
            "off" => Ok(ProxyMode::Off),
            "optional" => Ok(ProxyMode::Optional),
            "required" => Ok(ProxyMode::Required),
            other => Err(format!("expected off, optional or required, got {other:?}")),
        }
    }
    fn stand_in() -> Self {
        ProxyMode::Off
    }
}

/// PROXY protocol settings of a listener.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct ProxyProtocol {
    /// `off` (default), `optional` or `required`.
    #[serde(default)]
    pub mode: ProxyMode,
    /// Peers (CIDRs) allowed to send a header: required with a mode other than off (empty
    /// trusts nobody).
    #[serde(default)]
    pub trusted_sources: NetSet,
}

impl ProxyProtocol {
    /// The effective mode for a connection from `peer`: untrusted peers are treated as off.
    pub fn mode_for(&self, peer: IpAddr) -> ProxyMode {
        if self.mode == ProxyMode::Off || !self.trusted_sources.contains(peer) {
            ProxyMode::Off
        } else {
            self.mode
        }
    }
}

/// Limits.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase", default)]
pub struct Limits {
    /// Most client connections open at once (default 100000).
    #[serde(deserialize_with = "plain::<Count<1, 10_000_000>, _>")]
    pub max_connections: usize,
    /// Most connections per client address as configured: `Some(0)` = unlimited, `None` =
    /// the default ([`Limits::per_source`]).
    #[serde(deserialize_with = "super::value::plain_option::<Count<0, 10_000_000>, _>")]
    pub max_connections_per_source: Option<usize>,
    /// Largest ClientHello, record headers included (default 16384).
    #[serde(
        deserialize_with = "plain::<Count<MIN_CLIENT_HELLO_BYTES, MAX_CLIENT_HELLO_BYTES>, _>"
    )]
    pub max_client_hello_bytes: usize,
    /// Largest CONNECT request head (default 8192).
    #[serde(deserialize_with = "plain::<Count<256, 65_536>, _>")]
    pub max_header_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 100_000,
            max_connections_per_source: None,
            max_client_hello_bytes: 16_384,
            max_header_bytes: 8192,
        }
    }
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

/// Access log settings.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct AccessLog {
    /// Log a line for long-lived connections this often (off by default).
    #[serde(
        default,
        deserialize_with = "super::value::plain_option::<Positive, _>"
    )]
    pub interval: Option<Duration>,
}

/// Name resolution.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct Resolver {
    /// Name servers (`IP` or `IP:port`, port 53 by default) asked instead of
    /// `/etc/resolv.conf`'s; its search list and `ndots` still apply. At most three.
    #[serde(default)]
    pub nameservers: Vec<Nameserver>,
    /// Longest a lookup may take, retries included (default `2s`, or half of
    /// `timeouts.connect` when that is less); below `timeouts.connect`.
    #[serde(
        default,
        deserialize_with = "super::value::plain_option::<Positive, _>"
    )]
    pub timeout: Option<Duration>,
}

/// A name server: `IP` (port 53) or `IP:port`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nameserver(pub SocketAddr);

impl Text for Nameserver {
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse::<SocketAddr>()
            .ok()
            .or_else(|| text.parse::<IpAddr>().ok().map(|ip| (ip, 53).into()))
            .map(Nameserver)
            .ok_or_else(|| format!("expected IP or IP:port, got {text:?}"))
    }
    fn stand_in() -> Self {
        Nameserver(SocketAddr::from(([127, 0, 0, 1], 53)))
    }
}

/// Most name servers (glibc's `MAXNS`; the descriptor budget keeps a TCP socket for each).
pub const MAX_NAMESERVERS: usize = 3;

/// `admin.debugAddress` when none is written: loopback only, as Envoy's admin port.
pub const DEFAULT_DEBUG_ADDRESS: SocketAddr =
    SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 15000);

/// The environment variable that sets the gateway's zone (the manifests fill it from the
/// pod's zone); it wins over `zone` in the file, which all replicas share.
pub const ZONE_ENV: &str = "TRELLIS_ZONE";

impl GatewayConfig {
    /// Where `/routes` and other state are served (loopback by default).
    pub fn debug_address(&self) -> SocketAddr {
        self.admin
            .debug_address
            .map_or(DEFAULT_DEBUG_ADDRESS, |a| a.0)
    }

    /// How names are resolved: the timeout defaults to 2 s, or half the connect budget
    /// when that is less.
    pub(crate) fn resolver_settings(&self) -> ResolverSettings {
        ResolverSettings {
            nameservers: self.resolver.nameservers.iter().map(|n| n.0).collect(),
            timeout: self
                .resolver
                .timeout
                .unwrap_or(DEFAULT_RESOLVE_TIMEOUT.min(self.timeouts.connect / 2)),
        }
    }
}

impl ConfigKind for GatewayConfig {
    const KIND: &'static str = "GatewayConfiguration";
    const READ_BY: &'static str = "'trellis gateway'";
    type File = GatewayConfig;
    type Context<'a> = ();

    fn validate(mut c: GatewayConfig, source: &Source<'_>, (): (), errors: &mut Errors) -> Self {
        c.api_version.check(errors);
        let dir = source.dir();
        if let Ok(z) = std::env::var(ZONE_ENV)
            && !z.trim().is_empty()
        {
            c.zone = Some(z.trim().to_owned());
        }
        resolve(&mut c.routes.file, dir);
        if c.workers == 0 {
            c.workers = std::thread::available_parallelism().map_or(1, |n| n.get());
        }
        let addresses = listeners(errors, dir, &mut c.listeners);
        // What a rule reads must be what the file says, not a refused value's stand-in.
        let admin = (!errors.refused("admin.address")).then_some(c.admin.address.0);
        if let Some(admin) = admin
            && addresses.contains(&admin)
        {
            errors.push(
                "admin.address",
                format!("address {admin} is used by a listener"),
            );
        }
        let debug = c.admin.debug_address.map(|a| a.0);
        if let Some(debug) = debug.filter(|_| !errors.refused("admin.debugAddress")) {
            if addresses.contains(&debug) {
                errors.push(
                    "admin.debugAddress",
                    format!("address {debug} is used by a listener"),
                );
            } else if Some(debug) == admin && debug.port() != 0 {
                errors.push(
                    "admin.debugAddress",
                    format!("address {debug} is admin.address; the debug endpoint needs its own"),
                );
            }
        }
        let resolver = &c.resolver;
        if resolver.nameservers.len() > MAX_NAMESERVERS {
            errors.push(
                "resolver.nameservers",
                format!(
                    "{} name servers; at most {MAX_NAMESERVERS} are asked",
                    resolver.nameservers.len()
                ),
            );
        }
        let connect = c.timeouts.connect;
        if let Some(timeout) = resolver.timeout
            && timeout >= connect
            && !errors.refused("timeouts.connect")
        {
            errors.push(
                "resolver.timeout",
                format!(
                    "{timeout:?} is not below timeouts.connect ({connect:?}): a backend whose name \
                     never answers would leave no time to connect to the next"
                ),
            );
        }
        c
    }
}

/// Makes a relative file name relative to `dir`.
fn resolve(file: &mut std::path::PathBuf, dir: &Path) {
    if file.is_relative() {
        *file = dir.join(&*file);
    }
}

/// The rules across listeners and each listener's protocol settings; every TCP address the
/// listeners take (for the admin endpoint's).
fn listeners(errors: &mut Errors, dir: &Path, listeners: &mut [Listener]) -> HashSet<SocketAddr> {
    if listeners.is_empty() {
        errors.push("listeners", "at least one listener is required");
    }
    let mut names = HashSet::new();
    let mut addresses = HashSet::new();
    let mut first_wireguard: Option<usize> = None;
    let has_connect = listeners
        .iter()
        .any(|l| l.protocol == Protocol::HttpConnect);
    for (i, l) in listeners.iter_mut().enumerate() {
        let path = format!("listeners[{i}]");
        if !errors.refused(&at(&path, "name")) && !names.insert(l.name.0.clone()) {
            errors.push(
                at(&path, "name"),
                format!("duplicate listener name {:?}", l.name.0),
            );
        }
        // A wireguard listener's address is UDP: a TCP listener may have the same.
        if l.protocol != Protocol::WireGuard
            && !errors.refused(&at(&path, "address"))
            && !addresses.insert(l.address)
        {
            errors.push(
                at(&path, "address"),
                format!("address {} is used by another listener", l.address),
            );
        }
        protocol_settings(errors, &path, l);
        if let Some(tls) = &mut l.tls {
            resolve(&mut tls.certificate_file, dir);
            resolve(&mut tls.key_file, dir);
            resolve(&mut tls.client_ca_file, dir);
        }
        if l.protocol == Protocol::WireGuard {
            match first_wireguard {
                // One WireGuard device: a peer's key must lead to one place.
                Some(first) => errors.push(
                    at(&path, "protocol"),
                    format!("a second wireguard listener (listeners[{first}]): the gateway has one WireGuard device"),
                ),
                None => first_wireguard = Some(i),
            }
        }
        if let Some(w) = &mut l.wireguard {
            resolve(&mut w.private_key_file, dir);
            if w.connect_destination.is_some() && !has_connect {
                errors.push(
                    at(&path, "wireguard.connectDestination"),
                    "needs an http-connect listener for the CONNECTs to arrive on",
                );
            }
        }
        if let Some(r) = &l.default_route
            && r.is_empty()
        {
            errors.push(at(&path, "defaultRoute"), "must not be empty");
        }
    }
    addresses
}

/// Each protocol's own settings: required where the protocol needs them, errors elsewhere.
fn protocol_settings(errors: &mut Errors, path: &str, l: &Listener) {
    let only = |field: &str, protocol: Protocol, set: bool, errors: &mut Errors| {
        if set && l.protocol != protocol {
            errors.push(
                at(path, field),
                format!("only valid for {} listeners", protocol.as_str()),
            );
        }
    };
    only("tls", Protocol::EgressConnect, l.tls.is_some(), errors);
    only(
        "destinationHeader",
        Protocol::HttpConnect,
        l.destination_header.is_some(),
        errors,
    );
    only(
        "wireguard",
        Protocol::WireGuard,
        l.wireguard.is_some(),
        errors,
    );
    match l.protocol {
        Protocol::EgressConnect if l.tls.is_none() => errors.push(
            at(path, "tls"),
            "required for egress-connect listeners: {certificateFile, keyFile, clientCAFile}",
        ),
        Protocol::WireGuard => {
            for (field, set) in [
                ("proxyProtocol", l.proxy_protocol.is_some()),
                ("defaultRoute", l.default_route.is_some()),
            ] {
                if set {
                    errors.push(
                        at(path, field),
                        "not valid for wireguard listeners: they take no TCP connections (the address is UDP)",
                    );
                }
            }
            if l.wireguard.is_none() {
                errors.push(
                    at(path, "wireguard"),
                    "required for wireguard listeners: {privateKeyFile}",
                );
            }
        }
        _ => {}
    }
    let proxy = l.proxy_protocol.as_ref();
    if l.protocol != Protocol::WireGuard
        && proxy.is_some_and(|p| p.mode != ProxyMode::Off && p.trusted_sources.is_empty())
    {
        // Whoever may write a PROXY header picks its own source address: past
        // `allowedSourceRanges`, into `sendProxyProtocol` and, on egress listeners, into any
        // shoot's route (`clientSources`). Nobody is trusted by default.
        let why = if l.protocol == Protocol::EgressConnect {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::value::DEFAULT_DESTINATION_HEADER;

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
        crate::config::parse::<GatewayConfig>(
            Path::new("/etc/trellis/gateway.yaml"),
            yaml.as_bytes(),
        )
        .map_err(|e| e.to_string())
    }

    const HEAD: &str = "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: GatewayConfiguration\n";

    #[test]
    fn minimal_with_defaults() {
        let c = check(&format!(
            "{HEAD}routes: {{file: routes.yaml}}\nlisteners:\n- {{name: tls, address: \"0.0.0.0:9443\", protocol: sni}}\nadmin: {{address: \"127.0.0.1:15021\"}}\n"
        ))
        .unwrap();
        assert_eq!(c.routes.file, Path::new("/etc/trellis/routes.yaml"));
        assert_eq!(c.timeouts.connect, Duration::from_secs(5));
        assert_eq!(c.limits.max_client_hello_bytes, 16_384);
        assert_eq!(c.keepalive.upstream.idle, Duration::from_secs(7200));
    }

    /// The resolver's name servers take `IP` or `IP:port`; its timeout defaults below the
    /// connect budget and must stay below it; every mistake is named with its path.
    #[test]
    fn resolver_settings() {
        let base = format!(
            "{HEAD}routes: {{file: r.yaml}}\nlisteners:\n- {{name: a, address: \"0.0.0.0:1\", protocol: sni}}\nadmin: {{address: \"127.0.0.1:5\"}}\n"
        );
        let c = check(&base).unwrap();
        assert_eq!(c.resolver_settings(), ResolverSettings::default());
        assert!(c.resolver_settings().timeout < c.timeouts.connect);
        let c = check(&format!(
            "{base}resolver: {{nameservers: [\"10.96.0.10\", \"127.0.0.2:5353\", \"[::1]:53\"], timeout: 1s}}\n"
        ))
        .unwrap();
        let ns: Vec<String> = c
            .resolver_settings()
            .nameservers
            .iter()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(ns, ["10.96.0.10:53", "127.0.0.2:5353", "[::1]:53"]);
        assert_eq!(c.resolver_settings().timeout, Duration::from_secs(1));
        // A shorter connect budget shortens the default.
        let c = check(&format!("{base}timeouts: {{connect: 1s}}\n")).unwrap();
        assert_eq!(c.resolver_settings().timeout, Duration::from_millis(500));
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
        let kinds: Vec<_> = c.listeners.iter().map(|l| l.kind()).collect();
        assert_eq!(
            kinds,
            [
                ListenerKind::Sni,
                ListenerKind::HttpConnect {
                    destination_header: DEFAULT_DESTINATION_HEADER
                },
                ListenerKind::HttpConnect {
                    destination_header: "Reversed-VPN"
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
            c.listeners[2].kind(),
            ListenerKind::WireGuard {
                private_key_file: Path::new("/etc/trellis/wireguard.key"),
                connect_destination: Some("trellis-wireguard:51820"),
            }
        );
        assert!(!c.listeners[2].kind().is_tcp() && c.listeners[0].kind().is_tcp());
        assert_eq!(c.listeners[2].kind().as_str(), "wireguard");
        let c = check(&format!(
            "{HEAD}routes: {{file: r.yaml}}\nlisteners:\n- {{name: wg, address: \"[::]:51820\", protocol: wireguard, wireguard: {{privateKeyFile: /k}}}}\nadmin: {{address: \"127.0.0.1:5\"}}\n"
        ))
        .unwrap();
        assert_eq!(
            c.listeners[0].kind(),
            ListenerKind::WireGuard {
                private_key_file: Path::new("/k"),
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
        ] {
            assert!(err.contains(&needle), "{needle}\nnot in:\n{err}");
        }
        // A refused value is one problem: the rules across fields do not read its stand-in.
        assert_eq!(err.lines().count(), 11, "{err}");
        // A CONNECT destination needs an http-connect listener for the CONNECTs.
        let err = check(&format!(
            "{HEAD}routes: {{file: r.yaml}}
listeners:
- {{name: tls, address: \"0.0.0.0:1\", protocol: sni}}
- {{name: wg, address: \"0.0.0.0:51822\", protocol: wireguard, wireguard: {{privateKeyFile: k, connectDestination: \"trellis:51820\"}}}}
admin: {{address: \"127.0.0.1:5\"}}
"
        ))
        .unwrap_err();
        assert_eq!(
            err,
            format!(
                "{f}:6:112: listeners[1].wireguard.connectDestination: needs an http-connect listener for the CONNECTs to arrive on"
            )
        );
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
