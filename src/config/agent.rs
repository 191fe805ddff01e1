//! `kind: AgentConfiguration`: the shoot side of a WireGuard tunnel (`trellis agent`), its
//! raw schema and the validated [`AgentConfig`].
//!
//! The agent is a user-space WireGuard peer of the gateway: its own addresses inside the
//! tunnel, the gateway's public key and where to reach it, and the networks it dials for the
//! seed. Validation names the private key file but never reads it (the agent does, when it
//! starts), and never resolves the endpoints' host names.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::decode::{Kind, Raw};
use super::gateway::{DEFAULT_DESTINATION_HEADER, RawAdmin};
use super::routes::positive;
use super::{ConfigError, Errors, at};
use crate::route::{Net, WgKey};

mapping_only!(
    RawAgent,
    RawAgentWireGuard,
    RawAgentGateway,
    RawAgentReplica,
    RawAgentEndpoint,
    RawConnectEndpoint,
    RawAgentTimeouts
);

/// The `kind` of agent configuration files.
pub const KIND: &str = "AgentConfiguration";

/// `persistentKeepalive` when none is written, as Gardener's VPN keeps NAT state alive.
pub const DEFAULT_PERSISTENT_KEEPALIVE: Duration = Duration::from_secs(25);

/// Longest `persistentKeepalive`: WireGuard carries it as 16-bit seconds.
pub const MAX_PERSISTENT_KEEPALIVE: Duration = Duration::from_secs(u16::MAX as u64);

/// An agent configuration file as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawAgent {
    /// Always `trellis.gardener.cloud/v1alpha1`.
    pub api_version: String,
    /// Always `AgentConfiguration`.
    pub kind: String,
    /// The agent's WireGuard peer.
    pub wireguard: RawAgentWireGuard,
    /// What the agent dials (`IP/prefix` or a bare IP): at least one; other targets are
    /// refused.
    #[serde(default)]
    pub networks: Vec<String>,
    /// Admin endpoint (`/ready` once the tunnel is up, `/live`, `/metrics`).
    pub admin: RawAdmin,
    /// Timeouts (defaults: connect 5s, idle 1h, halfClose 1m, drain 30s).
    #[serde(default)]
    pub timeouts: RawAgentTimeouts,
}

/// The agent's `wireguard` section as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawAgentWireGuard {
    /// The agent's private key, as `wg genkey` writes it; relative paths are relative to
    /// this config file. Read by the agent when it starts, not by `trellis check`.
    pub private_key_file: String,
    /// The agent's addresses inside the tunnel (its peer entry's `allowedIPs` at the
    /// gateway): one or two, at most one per family.
    #[serde(default)]
    pub addresses: Vec<String>,
    /// The gateway: its key and where to reach it.
    pub gateway: RawAgentGateway,
}

/// The gateway as the agent sees it, as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawAgentGateway {
    /// The gateway device's public key, base64 as `wg pubkey` prints it.
    pub public_key: String,
    /// Where the gateway is, tried in order (UDP preferred: while on a `connect` endpoint the
    /// agent probes the `udp` ones): at least one.
    #[serde(default)]
    pub endpoints: Vec<RawAgentEndpoint>,
    /// Instead of `endpoints`: the gateway's replicas, one session with each (every replica
    /// then has a session with every agent), each with its endpoints in order.
    #[serde(default)]
    pub replicas: Vec<RawAgentReplica>,
    /// How often to send a keepalive when nothing else is sent (default `25s`; `0s` = off):
    /// whole seconds up to 65535.
    #[serde(default)]
    pub persistent_keepalive: Option<String>,
}

/// One gateway replica as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawAgentReplica {
    /// Where this replica is, tried in order (UDP preferred): at least one.
    #[serde(default)]
    pub endpoints: Vec<RawAgentEndpoint>,
}

/// One gateway endpoint as written: exactly one of `udp` and `connect`.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawAgentEndpoint {
    /// `HOST:PORT` of the gateway's `wireguard` listener (the host resolved by the agent).
    #[serde(default)]
    pub udp: Option<String>,
    /// WireGuard over TCP through a CONNECT to an `http-connect` listener of the gateway
    /// (for load balancers without UDP); the agent goes back to a `udp` endpoint as soon as
    /// one answers again.
    #[serde(default)]
    pub connect: Option<RawConnectEndpoint>,
}

/// A `connect` endpoint as written.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawConnectEndpoint {
    /// `HOST:PORT` of an `http-connect` listener of the gateway.
    pub address: String,
    /// The destination header value the gateway's `wireguard.connectDestination` names.
    pub destination: String,
    /// The destination header's name (default `X-Gardener-Destination`).
    #[serde(default)]
    pub destination_header: Option<String>,
}

/// The agent's timeouts as written.
#[derive(Debug, Default, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawAgentTimeouts {
    /// Budget for dialing a target (default `5s`).
    pub connect: Option<String>,
    /// Close connections idle this long (default `1h`).
    pub idle: Option<String>,
    /// How long a half-closed connection may stay open (default `1m`).
    pub half_close: Option<String>,
    /// How long connections may finish on shutdown (default `30s`).
    pub drain: Option<String>,
}

/// Where the agent reaches the gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentEndpoint {
    /// WireGuard over UDP.
    Udp {
        /// Host name or IP address (no brackets, no trailing dot), resolved by the agent.
        host: String,
        /// UDP port.
        port: u16,
    },
    /// WireGuard over TCP through a CONNECT to an `http-connect` listener (the destination
    /// header naming the gateway's `connectDestination`), each datagram framed with a
    /// 16-bit big-endian length after the `200`.
    Connect {
        /// `HOST:PORT` of the `http-connect` listener.
        address: String,
        /// The destination header value.
        destination: String,
        /// The destination header's name.
        destination_header: String,
    },
}

/// The agent's validated timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentTimeouts {
    /// Budget for dialing a target.
    pub connect: Duration,
    /// Idle timeout of a relayed connection.
    pub idle: Duration,
    /// Half-close bound.
    pub half_close: Duration,
    /// Drain deadline.
    pub drain: Duration,
}

/// A validated agent configuration.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The agent's private key file (absolute, or relative to the working directory).
    pub private_key_file: PathBuf,
    /// The agent's addresses inside the tunnel: one or two, one per family.
    pub addresses: Vec<IpAddr>,
    /// The gateway device's public key.
    pub gateway_public_key: WgKey,
    /// One entry per session the agent keeps (one per gateway replica; one for a single
    /// gateway): where that gateway is, in the order to try, at least one endpoint each.
    pub lanes: Vec<Vec<AgentEndpoint>>,
    /// Keepalive interval; `None` = off.
    pub persistent_keepalive: Option<Duration>,
    /// What the agent dials: at least one network.
    pub networks: Vec<Net>,
    /// Admin bind address.
    pub admin: std::net::SocketAddr,
    /// Timeouts.
    pub timeouts: AgentTimeouts,
}

/// Reads and validates an agent configuration file.
pub fn load(file: &Path) -> Result<AgentConfig, ConfigError> {
    parse(file, &super::read_file(file)?)
}

/// Parses and validates the bytes of an agent configuration file.
pub fn parse(file: &Path, bytes: &[u8]) -> Result<AgentConfig, ConfigError> {
    let result = match super::decode::decode(file, bytes)? {
        (Raw::Agent(raw), errors) => validate(file, raw, errors),
        (other, _) => Err(super::decode::wrong_kind(
            file,
            other.kind(),
            Kind::Agent,
            "'trellis agent'",
        )),
    };
    super::decode::located(file, bytes, result)
}

/// Validates a decoded configuration; `errors` already holds the unknown fields.
pub(super) fn validate(
    file: &Path,
    raw: RawAgent,
    mut errors: Errors,
) -> Result<AgentConfig, ConfigError> {
    let config = build(file, raw, &mut errors);
    errors.finish(file, config)
}

fn build(file: &Path, raw: RawAgent, errors: &mut Errors) -> AgentConfig {
    super::check_api_version(errors, &raw.api_version);
    let wg = &raw.wireguard;
    if wg.private_key_file.is_empty() {
        errors.push("wireguard.privateKeyFile", "must not be empty");
    }
    let private_key_file = PathBuf::from(&wg.private_key_file);
    let private_key_file = if private_key_file.is_relative() {
        file.parent()
            .unwrap_or(Path::new("."))
            .join(private_key_file)
    } else {
        private_key_file
    };
    let addresses = addresses(errors, &wg.addresses);
    let gateway_public_key = WgKey::from_base64(&wg.gateway.public_key)
        .map_err(|e| errors.push("wireguard.gateway.publicKey", e))
        .unwrap_or(WgKey([0; 32]));
    let lanes = lanes(errors, &wg.gateway);
    let persistent_keepalive =
        persistent_keepalive(errors, wg.gateway.persistent_keepalive.as_deref());
    if raw.networks.is_empty() {
        errors.push(
            "networks",
            "at least one network is required (what the agent dials for the seed)",
        );
    }
    let networks = raw
        .networks
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            Net::parse(s)
                .map_err(|e| errors.push(format!("networks[{i}]"), e))
                .ok()
        })
        .collect();
    let admin = super::gateway::socket_addr(errors, "admin.address", &raw.admin.address)
        .unwrap_or_else(|| std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
    if raw.admin.debug_address.is_some() {
        errors.push(
            "admin.debugAddress",
            "the agent serves no routing table; only the gateway has a debug endpoint",
        );
    }
    AgentConfig {
        private_key_file,
        addresses,
        gateway_public_key,
        lanes,
        persistent_keepalive,
        networks,
        admin,
        timeouts: timeouts(errors, &raw.timeouts),
    }
}

/// The agent's tunnel addresses: one or two, at most one per family, unicast.
fn addresses(errors: &mut Errors, raw: &[String]) -> Vec<IpAddr> {
    let path = "wireguard.addresses";
    if raw.is_empty() || raw.len() > 2 {
        errors.push(
            path,
            format!(
                "one or two addresses are required (at most one per family), got {}",
                raw.len()
            ),
        );
    }
    let mut out: Vec<IpAddr> = Vec::with_capacity(raw.len());
    for (i, s) in raw.iter().enumerate() {
        let at_i = format!("{path}[{i}]");
        let Ok(ip) = s.parse::<IpAddr>().map(|ip| ip.to_canonical()) else {
            errors.push(at_i, format!("expected an IP address, got {s:?}"));
            continue;
        };
        if ip.is_unspecified()
            || ip.is_multicast()
            || matches!(ip, IpAddr::V4(v4) if v4.is_broadcast())
        {
            errors.push(&at_i, format!("{ip} is not a unicast address"));
        }
        if let Some(other) = out.iter().position(|o| o.is_ipv4() == ip.is_ipv4()) {
            let family = if ip.is_ipv4() { "IPv4" } else { "IPv6" };
            errors.push(
                &at_i,
                format!("a second {family} address (addresses[{other}]): at most one per family"),
            );
        }
        out.push(ip);
    }
    out
}

/// Most gateway replicas an agent keeps a session with (each is a socket and a stack).
pub const MAX_REPLICAS: usize = 8;

/// The sessions to keep: `endpoints` (one gateway) or `replicas` (one per replica).
fn lanes(errors: &mut Errors, raw: &RawAgentGateway) -> Vec<Vec<AgentEndpoint>> {
    if raw.replicas.is_empty() {
        return vec![endpoints(
            errors,
            "wireguard.gateway.endpoints",
            &raw.endpoints,
        )];
    }
    if !raw.endpoints.is_empty() {
        errors.push(
            "wireguard.gateway",
            "either endpoints (one gateway) or replicas (a session with each replica), not both",
        );
    }
    if raw.replicas.len() > MAX_REPLICAS {
        errors.push(
            "wireguard.gateway.replicas",
            format!(
                "at most {MAX_REPLICAS} replicas, got {}",
                raw.replicas.len()
            ),
        );
    }
    let lanes: Vec<Vec<AgentEndpoint>> = raw
        .replicas
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let path = format!("wireguard.gateway.replicas[{i}].endpoints");
            endpoints(errors, &path, &r.endpoints)
        })
        .collect();
    // Two sessions with one replica (one key) would take the peer's session from each
    // other at every handshake.
    for (j, lane) in lanes.iter().enumerate() {
        for (k, e) in lane.iter().enumerate() {
            if let Some(i) = lanes[..j].iter().position(|l| l.contains(e)) {
                errors.push(
                    format!("wireguard.gateway.replicas[{j}].endpoints[{k}]"),
                    format!(
                        "also an endpoint of replicas[{i}]: each replica is one gateway, reached \
                         by its own endpoints"
                    ),
                );
            }
        }
    }
    lanes
}

/// A gateway's endpoints in order; at least one.
fn endpoints(errors: &mut Errors, path: &str, raw: &[RawAgentEndpoint]) -> Vec<AgentEndpoint> {
    let mut out = Vec::with_capacity(raw.len());
    for (i, e) in raw.iter().enumerate() {
        let at_i = format!("{path}[{i}]");
        match (&e.udp, &e.connect) {
            (Some(udp), None) => {
                if let Some((host, port)) = host_port(errors, &at(&at_i, "udp"), udp) {
                    out.push(AgentEndpoint::Udp { host, port });
                }
            }
            (None, Some(c)) => {
                let ok = host_port(errors, &at(&at_i, "connect.address"), &c.address).is_some();
                if !super::routes::valid_destination(&c.destination) {
                    errors.push(
                        at(&at_i, "connect.destination"),
                        format!("invalid destination {:?}", c.destination),
                    );
                }
                let destination_header = match &c.destination_header {
                    Some(h) => {
                        if !super::gateway::valid_header_name(h) {
                            errors.push(
                                at(&at_i, "connect.destinationHeader"),
                                format!("invalid header name {h:?}"),
                            );
                        }
                        h.clone()
                    }
                    None => DEFAULT_DESTINATION_HEADER.to_owned(),
                };
                if ok {
                    out.push(AgentEndpoint::Connect {
                        address: c.address.clone(),
                        destination: c.destination.clone(),
                        destination_header,
                    });
                }
            }
            (Some(_), Some(_)) => errors.push(&at_i, "either udp or connect, not both"),
            (None, None) => errors.push(&at_i, "expected udp: HOST:PORT or connect: {...}"),
        }
    }
    if raw.is_empty() {
        errors.push(
            path,
            "at least one endpoint is required (udp: HOST:PORT or connect: {...})",
        );
    }
    out
}

/// `HOST:PORT`, the host without brackets or a trailing dot, the port above 0.
fn host_port(errors: &mut Errors, path: &str, value: &str) -> Option<(String, u16)> {
    let parsed = value.rsplit_once(':').and_then(|(host, port)| {
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host)
            .trim_end_matches('.');
        let port = port.parse::<u16>().ok().filter(|&p| p > 0)?;
        let host_ok = !host.is_empty()
            && (host.parse::<IpAddr>().is_ok()
                || crate::wire::tls::normalize_host(host.as_bytes()).is_some());
        host_ok.then(|| (host.to_owned(), port))
    });
    if parsed.is_none() {
        errors.push(path, format!("expected HOST:PORT, got {value:?}"));
    }
    parsed
}

/// `persistentKeepalive`: 25 s when left out, off for `0s`, else whole seconds up to 65535.
fn persistent_keepalive(errors: &mut Errors, raw: Option<&str>) -> Option<Duration> {
    let path = "wireguard.gateway.persistentKeepalive";
    let Some(text) = raw else {
        return Some(DEFAULT_PERSISTENT_KEEPALIVE);
    };
    let d = errors.duration(path, text)?;
    if d.is_zero() {
        return None;
    }
    if d.subsec_nanos() != 0 || d > MAX_PERSISTENT_KEEPALIVE {
        errors.push(
            path,
            format!("{text:?}: whole seconds from 1s to 65535s, or 0s for off"),
        );
        return Some(DEFAULT_PERSISTENT_KEEPALIVE);
    }
    Some(d)
}

/// The agent's timeouts with their defaults; each must be greater than zero but `drain`.
fn timeouts(errors: &mut Errors, raw: &RawAgentTimeouts) -> AgentTimeouts {
    let mut positive_or = |path: &str, v: Option<&str>, default: u64| {
        v.and_then(|v| positive(errors, path, v))
            .unwrap_or(Duration::from_secs(default))
    };
    let connect = positive_or("timeouts.connect", raw.connect.as_deref(), 5);
    let idle = positive_or("timeouts.idle", raw.idle.as_deref(), 3600);
    let half_close = positive_or("timeouts.halfClose", raw.half_close.as_deref(), 60);
    AgentTimeouts {
        connect,
        idle,
        half_close,
        drain: errors.duration_or(
            "timeouts.drain",
            raw.drain.as_deref(),
            Duration::from_secs(30),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(yaml: &str) -> Result<AgentConfig, String> {
        parse(Path::new("/etc/trellis/agent.yaml"), yaml.as_bytes()).map_err(|e| e.to_string())
    }

    const HEAD: &str = "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: AgentConfiguration\n";

    fn key() -> String {
        WgKey([9; 32]).to_base64()
    }

    /// An agent file with this `wireguard.gateway` body (after `publicKey`) and `extra`
    /// top-level lines.
    fn agent(gateway: &str, extra: &str) -> String {
        format!(
            "{HEAD}wireguard:
  privateKeyFile: agent.key
  addresses: [192.168.128.5]
  gateway:
    publicKey: \"{}\"
{gateway}networks: [\"10.250.0.0/16\"]
admin: {{address: \"0.0.0.0:16911\"}}
{extra}",
            key()
        )
    }

    const UDP: &str = "    endpoints: [{udp: \"vpn.seed.example.com:51820\"}]\n";

    #[test]
    fn spec_example_with_defaults() {
        let c = check(&format!(
            "{HEAD}wireguard:
  privateKeyFile: /etc/trellis/agent.key
  addresses: [192.168.128.5, \"fd8f:6d53:b97a:1::5\"]
  gateway:
    publicKey: \"{}\"
    endpoints:
    - udp: \"vpn.seed.example.com.:51820\"
    - udp: \"[2001:db8::1]:51820\"
    - connect: {{address: \"api.alpha.example.com:8443\", destination: \"trellis-wireguard:51820\"}}
    persistentKeepalive: 25s
networks: [\"10.250.0.0/16\", \"100.64.0.0/13\", 100.96.0.1]
admin: {{address: \"0.0.0.0:16911\"}}
",
            key()
        ))
        .unwrap();
        assert_eq!(c.private_key_file, Path::new("/etc/trellis/agent.key"));
        assert_eq!(c.gateway_public_key, WgKey([9; 32]));
        assert_eq!(c.addresses.len(), 2);
        assert_eq!(
            c.lanes[0],
            [
                AgentEndpoint::Udp {
                    host: "vpn.seed.example.com".into(),
                    port: 51820
                },
                AgentEndpoint::Udp {
                    host: "2001:db8::1".into(),
                    port: 51820
                },
                AgentEndpoint::Connect {
                    address: "api.alpha.example.com:8443".into(),
                    destination: "trellis-wireguard:51820".into(),
                    destination_header: DEFAULT_DESTINATION_HEADER.into(),
                },
            ]
        );
        assert_eq!(c.persistent_keepalive, Some(Duration::from_secs(25)));
        assert_eq!(c.networks[2], Net::parse("100.96.0.1/32").unwrap());
        assert_eq!(
            c.timeouts,
            AgentTimeouts {
                connect: Duration::from_secs(5),
                idle: Duration::from_secs(3600),
                half_close: Duration::from_secs(60),
                drain: Duration::from_secs(30),
            }
        );
        // Relative key files are relative to the config; keepalive defaults to 25s, 0s is off.
        let c = check(&agent(UDP, "")).unwrap();
        assert_eq!(c.private_key_file, Path::new("/etc/trellis/agent.key"));
        assert_eq!(c.persistent_keepalive, Some(DEFAULT_PERSISTENT_KEEPALIVE));
        let c = check(&agent(&format!("{UDP}    persistentKeepalive: 0s\n"), "")).unwrap();
        assert_eq!(c.persistent_keepalive, None);
        let c = check(&agent(
            UDP,
            "timeouts: {connect: 2s, idle: 10m, halfClose: 5s, drain: 0s}\n",
        ))
        .unwrap();
        assert_eq!(c.timeouts.drain, Duration::ZERO);
        assert_eq!(c.timeouts.half_close, Duration::from_secs(5));
    }

    /// `connect` endpoints validate and are kept, alone or beside `udp` ones, in order; no
    /// endpoint at all is an error.
    #[test]
    fn connect_endpoints_alone_or_beside_udp_ones() {
        let connect = "    endpoints: [{connect: {address: \"api.example.com:8443\", destination: \"trellis-wireguard:51820\", destinationHeader: Reversed-VPN}}]\n";
        let c = check(&agent(connect, "")).unwrap();
        assert_eq!(
            c.lanes[0],
            [AgentEndpoint::Connect {
                address: "api.example.com:8443".into(),
                destination: "trellis-wireguard:51820".into(),
                destination_header: "Reversed-VPN".into(),
            }]
        );
        let err = check(&agent("    endpoints: []\n", "")).unwrap_err();
        assert_eq!(
            err,
            "/etc/trellis/agent.yaml:8:16: wireguard.gateway.endpoints: at least one endpoint is required (udp: HOST:PORT or connect: {...})"
        );
        let both = connect.replace("}}]", "}}, {udp: \"192.0.2.1:51820\"}]");
        let c = check(&agent(&both, "")).unwrap();
        assert!(matches!(
            &c.lanes[0][0],
            AgentEndpoint::Connect { destination_header, .. } if destination_header == "Reversed-VPN"
        ));
        assert!(matches!(
            &c.lanes[0][1],
            AgentEndpoint::Udp { port: 51820, .. }
        ));
    }

    /// `replicas` gives one lane per replica, each with its endpoints in order; it excludes
    /// `endpoints`, needs endpoints in every replica and is bounded.
    #[test]
    fn replicas_give_one_lane_each() {
        let two = "    replicas:
    - endpoints: [{udp: \"vpn.seed.example.com:51820\"}, {connect: {address: \"api.example.com:8443\", destination: \"trellis-wireguard-0:51820\"}}]
    - endpoints: [{udp: \"vpn.seed.example.com:51821\"}]
";
        let c = check(&agent(two, "")).unwrap();
        assert_eq!(c.lanes.len(), 2);
        assert_eq!(c.lanes[0].len(), 2);
        assert_eq!(
            c.lanes[1],
            [AgentEndpoint::Udp {
                host: "vpn.seed.example.com".into(),
                port: 51821
            }]
        );
        let single = check(&agent(UDP, "")).unwrap();
        assert_eq!(single.lanes.len(), 1);

        let both = check(&agent(&format!("{UDP}{two}"), "")).unwrap_err();
        assert!(
            both.contains("wireguard.gateway: either endpoints (one gateway) or replicas"),
            "{both}"
        );
        let shared = "    replicas:
    - endpoints: [{udp: \"a:1\"}, {udp: \"b:1\"}]
    - endpoints: [{udp: \"c:1\"}, {udp: \"b:1\"}]
";
        let err = check(&agent(shared, "")).unwrap_err();
        assert!(
            err.contains(
                "wireguard.gateway.replicas[1].endpoints[1]: also an endpoint of replicas[0]"
            ),
            "{err}"
        );
        let empty = check(&agent("    replicas: [{endpoints: []}]\n", "")).unwrap_err();
        assert!(
            empty.contains(
                "wireguard.gateway.replicas[0].endpoints: at least one endpoint is required"
            ),
            "{empty}"
        );
        let many = format!(
            "    replicas:\n{}",
            "    - endpoints: [{udp: \"a:1\"}]\n".repeat(MAX_REPLICAS + 1)
        );
        let err = check(&agent(&many, "")).unwrap_err();
        assert!(err.contains("at most 8 replicas, got 9"), "{err}");
        let err = check(&agent("    replicas: [{endpoints: [{udp: nope}]}]\n", "")).unwrap_err();
        assert!(
            err.contains("wireguard.gateway.replicas[0].endpoints[0].udp: expected HOST:PORT"),
            "{err}"
        );
    }

    #[test]
    fn every_error_has_a_path() {
        let err = check(&format!(
            "{HEAD}wireguard:
  privateKeyFile: \"\"
  addresses: [192.168.128.5, 192.168.128.6, nope]
  gateway:
    publicKey: \"{}\"
    endpoints:
    - udp: \"vpn.example.com\"
    - {{udp: \"a:1\", connect: {{address: \"b:2\", destination: d}}}}
    - {{}}
    - connect: {{address: \"b\", destination: \"d d\", destinationHeader: \"X Y\"}}
    persistentKeepalive: 1.5s
    mtu: 1380
networks: []
admin: {{address: nope, debugAddress: \"127.0.0.1:1\"}}
timeouts: {{connect: 0s, handshake: 1s}}
",
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, [1u8; 31])
        ))
        .unwrap_err();
        let f = "/etc/trellis/agent.yaml";
        let expected = [
            "14:5: wireguard.gateway.mtu: unknown field `mtu`",
            "17:25: timeouts.handshake: unknown field `handshake`",
            "4:19: wireguard.privateKeyFile: must not be empty",
            "5:14: wireguard.addresses: one or two addresses are required (at most one per family), got 3",
            "5:30: wireguard.addresses[1]: a second IPv4 address (addresses[0]): at most one per family",
            "5:45: wireguard.addresses[2]: expected an IP address, got \"nope\"",
            "7:16: wireguard.gateway.publicKey: a WireGuard key is 32 bytes, this is 31",
            "9:12: wireguard.gateway.endpoints[0].udp: expected HOST:PORT, got \"vpn.example.com\"",
            "10:7: wireguard.gateway.endpoints[1]: either udp or connect, not both",
            "11:7: wireguard.gateway.endpoints[2]: expected udp: HOST:PORT or connect: {...}",
            "12:26: wireguard.gateway.endpoints[3].connect.address: expected HOST:PORT, got \"b\"",
            "12:44: wireguard.gateway.endpoints[3].connect.destination: invalid destination \"d d\"",
            "12:70: wireguard.gateway.endpoints[3].connect.destinationHeader: invalid header name \"X Y\"",
            "13:26: wireguard.gateway.persistentKeepalive: \"1.5s\": whole seconds from 1s to 65535s, or 0s for off",
            "15:11: networks: at least one network is required",
            "16:18: admin.address: expected IP:port, got \"nope\"",
            "16:38: admin.debugAddress: the agent serves no routing table",
            "17:21: timeouts.connect: must be greater than 0",
        ];
        for needle in expected {
            assert!(
                err.contains(&format!("{f}:{needle}")),
                "{needle}\nnot in:\n{err}"
            );
        }
        assert_eq!(err.lines().count(), expected.len(), "{err}");
        // Two addresses of different families are fine; a keepalive past 16 bits is not.
        let err = check(&agent(
            &format!("{UDP}    persistentKeepalive: 65536s\n"),
            "",
        ))
        .unwrap_err();
        assert!(err.contains("whole seconds from 1s to 65535s"), "{err}");
        check(&agent(
            &format!("{UDP}    persistentKeepalive: 65535s\n"),
            "",
        ))
        .unwrap();
    }

    #[test]
    fn another_kind_is_refused() {
        let err = parse(
            Path::new("a.yaml"),
            b"apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\n",
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "a.yaml: kind RoutingTable, but 'trellis agent' needs an AgentConfiguration"
        );
    }
}
