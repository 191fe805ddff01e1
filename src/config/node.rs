//! `kind: NodeConfiguration`: the shoot node daemon's raw schema and validated [`NodeConfig`].

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use super::decode::{Kind, Raw};
use super::gateway::{
    DEFAULT_DESTINATION_HEADER, KeepaliveSide, RawAdmin, RawKeepalive, RawTimeouts,
};
use super::routes::positive;
use super::{ConfigError, Errors, at};

mapping_only!(RawNode, RawInterface, RawUpstream, RawNodeLimits);

/// The `kind` of node configuration files.
pub const KIND: &str = "NodeConfiguration";

/// A node configuration file as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawNode {
    /// Always `trellis.gardener.cloud/v1alpha1`.
    pub api_version: String,
    /// Always `NodeConfiguration`.
    pub kind: String,
    /// Addresses to listen on (the kube-apiserver advertise address, port 443).
    pub listen: Vec<String>,
    /// The link and address to manage (needs CAP_NET_ADMIN); optional.
    #[serde(default)]
    pub interface: Option<RawInterface>,
    /// Where connections go.
    pub upstream: RawUpstream,
    /// Admin endpoint (`/ready`, `/live`, `/metrics`).
    pub admin: RawAdmin,
    /// Timeouts (defaults: connect 5s, handshake 10s, idle 1h, halfClose 1m, drain 60s).
    #[serde(default)]
    pub timeouts: RawTimeouts,
    /// TCP keepalive (defaults: downstream 55s/55s, upstream 7200s/55s as in Gardener).
    #[serde(default)]
    pub keepalive: RawKeepalive,
    /// Limits.
    #[serde(default)]
    pub limits: RawNodeLimits,
}

/// The managed link and address as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawInterface {
    /// Link name; created as a dummy link if missing (default `apiserver-proxy`).
    #[serde(default)]
    pub name: Option<String>,
    /// The address, added as /32 (/128) with global scope.
    pub address: String,
    /// How often the address is re-checked besides netlink events (default `10s`).
    #[serde(default)]
    pub check_interval: Option<String>,
}

/// The upstream as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawUpstream {
    /// `host:port` of the seed gateway; the host is resolved per connection.
    pub address: String,
    /// `http-connect` (default) or `proxy-v2`.
    #[serde(default)]
    pub protocol: Option<String>,
    /// CONNECT destination header value (`http-connect`).
    #[serde(default)]
    pub destination: Option<String>,
    /// CONNECT destination header name (default `X-Gardener-Destination`).
    #[serde(default)]
    pub destination_header: Option<String>,
    /// `any` (default), `v4` or `v6`: which resolved addresses to use.
    #[serde(default)]
    pub ip_family: Option<String>,
}

/// Limits as written.
#[derive(Debug, Default, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawNodeLimits {
    /// Most client connections at once (default 10000, as in Gardener).
    #[serde(default, deserialize_with = "super::whole_number")]
    pub max_connections: Option<u64>,
}

/// How the node reaches the gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamProtocol {
    /// `CONNECT host:port HTTP/1.1` with a destination header; waits for `200`.
    HttpConnect {
        /// Header name.
        header: String,
        /// Header value.
        destination: String,
    },
    /// A PROXY v2 header whose destination is the address the client dialled (GEP-08).
    ProxyV2,
}

/// Which resolved upstream addresses to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpFamily {
    /// Both.
    Any,
    /// IPv4 only.
    V4,
    /// IPv6 only.
    V6,
}

impl IpFamily {
    /// Whether `addr` is acceptable.
    pub fn allows(self, addr: &SocketAddr) -> bool {
        match self {
            IpFamily::Any => true,
            IpFamily::V4 => addr.is_ipv4(),
            IpFamily::V6 => addr.is_ipv6(),
        }
    }
}

/// The managed link and address.
#[derive(Debug, Clone)]
pub struct InterfaceConfig {
    /// Link name.
    pub name: String,
    /// The address.
    pub address: IpAddr,
    /// Re-check interval.
    pub check_interval: Duration,
}

/// A validated node configuration.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Listen addresses.
    pub listen: Vec<SocketAddr>,
    /// Link management, if configured.
    pub interface: Option<InterfaceConfig>,
    /// Upstream host (no trailing dot) and port.
    pub upstream_host: String,
    /// Upstream port.
    pub upstream_port: u16,
    /// Upstream protocol.
    pub protocol: UpstreamProtocol,
    /// Address family filter.
    pub ip_family: IpFamily,
    /// Admin bind address.
    pub admin: SocketAddr,
    /// Upstream connect budget.
    pub connect_timeout: Duration,
    /// Deadline for the gateway's CONNECT answer.
    pub handshake_timeout: Duration,
    /// Idle timeout.
    pub idle_timeout: Duration,
    /// Half-close bound.
    pub half_close_timeout: Duration,
    /// Drain deadline.
    pub drain_timeout: Duration,
    /// Keepalive towards clients.
    pub keepalive_downstream: KeepaliveSide,
    /// Keepalive towards the gateway.
    pub keepalive_upstream: KeepaliveSide,
    /// Most connections at once.
    pub max_connections: usize,
}

/// Reads and validates a node configuration file.
pub fn load(file: &Path) -> Result<NodeConfig, ConfigError> {
    parse(file, &super::read_file(file)?)
}

/// Parses and validates the bytes of a node configuration file.
pub fn parse(file: &Path, bytes: &[u8]) -> Result<NodeConfig, ConfigError> {
    let result = match super::decode::decode(file, bytes)? {
        (Raw::Node(raw), errors) => validate(file, raw, errors),
        (other, _) => Err(super::decode::wrong_kind(
            file,
            other.kind(),
            Kind::Node,
            "'trellis node'",
        )),
    };
    super::decode::located(file, bytes, result)
}

/// Validates a decoded configuration; `errors` already holds the unknown fields.
pub(super) fn validate(
    file: &Path,
    raw: RawNode,
    mut errors: Errors,
) -> Result<NodeConfig, ConfigError> {
    let config = build(raw, &mut errors);
    errors.finish(file, config)
}

fn build(raw: RawNode, errors: &mut Errors) -> NodeConfig {
    super::check_api_version(errors, &raw.api_version);
    // In the file's order, so that errors are listed in it.
    let listen = listen(errors, &raw.listen);
    let interface = raw.interface.as_ref().and_then(|i| interface(errors, i));
    let u = &raw.upstream;
    let (upstream_host, upstream_port) = upstream_address(errors, &u.address);
    let protocol = upstream_protocol(errors, u);
    let ip_family = ip_family(errors, u.ip_family.as_deref());
    let admin = super::gateway::socket_addr(errors, "admin.address", &raw.admin.address)
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    if raw.admin.debug_address.is_some() {
        errors.push(
            "admin.debugAddress",
            "the node serves no routing table; only the gateway has a debug endpoint",
        );
    }
    if raw.timeouts.drain_delay.is_some() {
        errors.push(
            "timeouts.drainDelay",
            "no load balancer sends to the node; only the gateway delays closing its listeners",
        );
    }
    let timeouts = super::gateway::timeouts(errors, &raw.timeouts);
    NodeConfig {
        listen,
        interface,
        upstream_host,
        upstream_port,
        protocol,
        ip_family,
        admin,
        connect_timeout: timeouts.connect,
        handshake_timeout: timeouts.handshake,
        idle_timeout: timeouts.idle,
        half_close_timeout: timeouts.half_close,
        drain_timeout: timeouts.drain,
        keepalive_downstream: super::gateway::keepalive(
            errors,
            "keepalive.downstream",
            raw.keepalive.downstream.as_ref(),
            (55, 55),
        ),
        keepalive_upstream: super::gateway::keepalive(
            errors,
            "keepalive.upstream",
            raw.keepalive.upstream.as_ref(),
            (7200, 55),
        ),
        max_connections: max_connections(errors, raw.limits.max_connections),
    }
}

/// The listen addresses: at least one.
fn listen(errors: &mut Errors, raw: &[String]) -> Vec<SocketAddr> {
    if raw.is_empty() {
        errors.push("listen", "at least one address is required");
    }
    raw.iter()
        .enumerate()
        .filter_map(|(i, a)| super::gateway::socket_addr(errors, &format!("listen[{i}]"), a))
        .collect()
}

/// The managed link and address, unless the address is invalid.
fn interface(errors: &mut Errors, raw: &RawInterface) -> Option<InterfaceConfig> {
    let name = raw.name.clone().unwrap_or_else(|| "apiserver-proxy".into());
    if name.is_empty() || name.len() > 15 || name.contains(['/', ' ']) {
        errors.push(
            "interface.name",
            format!("invalid link name {name:?} (1-15 characters, no '/' or spaces)"),
        );
    }
    let check_interval = raw
        .check_interval
        .as_deref()
        .and_then(|v| positive(errors, "interface.checkInterval", v))
        .unwrap_or(Duration::from_secs(10));
    match raw.address.parse::<IpAddr>() {
        Ok(address) => Some(InterfaceConfig {
            name,
            address,
            check_interval,
        }),
        Err(_) => {
            errors.push(
                "interface.address",
                format!("expected an IP address, got {:?}", raw.address),
            );
            None
        }
    }
}

/// The gateway's host (without brackets or a trailing dot) and port.
fn upstream_address(errors: &mut Errors, address: &str) -> (String, u16) {
    match address.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() => match port.parse::<u16>() {
            Ok(p) if p > 0 => (
                host.trim_start_matches('[')
                    .trim_end_matches(']')
                    .trim_end_matches('.')
                    .to_owned(),
                p,
            ),
            _ => {
                errors.push("upstream.address", format!("invalid port in {address:?}"));
                (String::new(), 0)
            }
        },
        _ => {
            errors.push(
                "upstream.address",
                format!("expected HOST:PORT, got {address:?}"),
            );
            (String::new(), 0)
        }
    }
}

/// How the node reaches the gateway, with the settings of that protocol; a setting of the
/// other protocol is an error.
fn upstream_protocol(errors: &mut Errors, u: &RawUpstream) -> UpstreamProtocol {
    match u.protocol.as_deref() {
        None | Some("http-connect") => {
            let header = u
                .destination_header
                .clone()
                .unwrap_or_else(|| DEFAULT_DESTINATION_HEADER.into());
            if header.is_empty()
                || !header
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                errors.push(
                    "upstream.destinationHeader",
                    format!("invalid header name {header:?}"),
                );
            }
            let destination = u.destination.clone().unwrap_or_default();
            if destination.is_empty() || destination.bytes().any(|b| b.is_ascii_control()) {
                errors.push("upstream.destination", "required for http-connect (e.g. outbound|443||kube-apiserver.<ns>.svc.cluster.local)");
            }
            UpstreamProtocol::HttpConnect {
                header,
                destination,
            }
        }
        Some("proxy-v2") => {
            if u.destination.is_some() || u.destination_header.is_some() {
                errors.push(
                    "upstream.destination",
                    "only valid with protocol http-connect",
                );
            }
            UpstreamProtocol::ProxyV2
        }
        Some(other) => {
            errors.push(
                "upstream.protocol",
                format!("expected http-connect or proxy-v2, got {other:?}"),
            );
            UpstreamProtocol::ProxyV2
        }
    }
}

fn ip_family(errors: &mut Errors, raw: Option<&str>) -> IpFamily {
    match raw {
        None | Some("any") => IpFamily::Any,
        Some("v4") => IpFamily::V4,
        Some("v6") => IpFamily::V6,
        Some(other) => {
            errors.push(
                "upstream.ipFamily",
                format!("expected any, v4 or v6, got {other:?}"),
            );
            IpFamily::Any
        }
    }
}

fn max_connections(errors: &mut Errors, raw: Option<u64>) -> usize {
    match raw {
        None => 10_000,
        Some(n) if (1..=1_000_000).contains(&n) => n as usize,
        Some(n) => {
            errors.push(
                at("limits", "maxConnections"),
                format!("{n} is out of range 1..=1000000"),
            );
            10_000
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(yaml: &str) -> Result<NodeConfig, String> {
        parse(Path::new("node.yaml"), yaml.as_bytes()).map_err(|e| e.to_string())
    }

    const HEAD: &str = "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: NodeConfiguration\n";

    #[test]
    fn spec_example() {
        let c = check(&format!(
            "{HEAD}listen: [\"240.168.102.23:443\"]
interface: {{name: apiserver-proxy, address: 240.168.102.23}}
upstream:
  address: \"api.alpha.dev.internal.example.com.:8443\"
  protocol: http-connect
  destination: \"outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local\"
  destinationHeader: X-Gardener-Destination
  ipFamily: any
admin: {{address: \"0.0.0.0:16910\"}}
"
        ))
        .unwrap();
        assert_eq!(c.upstream_host, "api.alpha.dev.internal.example.com");
        assert_eq!(c.upstream_port, 8443);
        assert_eq!(c.max_connections, 10_000);
        assert_eq!(c.keepalive_upstream.idle, Duration::from_secs(7200));
        assert_eq!(c.connect_timeout, Duration::from_secs(5));
    }

    #[test]
    fn errors_with_paths() {
        let err = check(&format!(
            "{HEAD}listen: [\"nope\"]\ninterface: {{address: x}}\nupstream: {{address: \"h:99999\", protocol: carrier-pigeon}}\nadmin: {{address: \"0.0.0.0:16910\"}}\n"
        ))
        .unwrap_err();
        for needle in [
            "listen[0]: expected IP:port",
            "interface.address: expected an IP",
            "upstream.address: invalid port",
            "upstream.protocol: expected",
        ] {
            assert!(err.contains(needle), "{needle} not in {err}");
        }
        let err = check(&format!("{HEAD}listen: [\"1.2.3.4:443\"]\nupstream: {{address: \"h:8443\"}}\nadmin: {{address: \"0.0.0.0:16910\"}}\n"))
            .unwrap_err();
        assert!(err.contains("upstream.destination: required"), "{err}");
    }
}
