//! `kind: AgentConfiguration`: the shoot side of a WireGuard tunnel (`trellis agent`),
//! decoded into [`AgentConfig`].
//!
//! The agent is a user-space WireGuard peer of the gateway: its own addresses inside the
//! tunnel, the gateway's public key and where to reach it, and the networks it dials for the
//! seed. Validation names the private key file but never reads it (the agent does, when it
//! starts), and never resolves the endpoints' host names.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::common::Admin;
use super::error::Errors;
use super::load::{ConfigKind, Source};
use super::value::{
    ApiVersion, DEFAULT_DESTINATION_HEADER, Destination, FilePath, HeaderName, Ip, Positive, Span,
    Text, parse_duration, plain, plain_list,
};
use crate::route::{Net, WgKey};

mapping_only!(
    AgentConfig,
    AgentWireGuard,
    AgentGateway,
    AgentReplica,
    EndpointEntry,
    ConnectEndpoint,
    AgentTimeouts
);
text_values!(HostPort, PersistentKeepalive);

/// `persistentKeepalive` when none is written, as Gardener's VPN keeps NAT state alive.
pub const DEFAULT_PERSISTENT_KEEPALIVE: Duration = Duration::from_secs(25);

/// Longest `persistentKeepalive`: WireGuard carries it as 16-bit seconds.
pub const MAX_PERSISTENT_KEEPALIVE: Duration = Duration::from_secs(u16::MAX as u64);

/// Most gateway replicas an agent keeps a session with (each is a socket and a stack).
pub const MAX_REPLICAS: usize = 8;

/// An agent configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct AgentConfig {
    /// Always `trellis.gardener.cloud/v1alpha1`.
    pub api_version: ApiVersion,
    /// Always `AgentConfiguration`.
    pub kind: String,
    /// The agent's WireGuard peer.
    pub wireguard: AgentWireGuard,
    /// What the agent dials (`IP/prefix` or a bare IP): at least one; other targets are
    /// refused.
    #[serde(default)]
    pub networks: Vec<Net>,
    /// Admin endpoint (`/ready` once the tunnel is up, `/live`, `/metrics`).
    pub admin: Admin,
    /// Timeouts (defaults: connect 5s, idle 1h, halfClose 1m, drain 30s).
    #[serde(default)]
    pub timeouts: AgentTimeouts,
}

/// The agent's `wireguard` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct AgentWireGuard {
    /// The agent's private key, as `wg genkey` writes it; relative to this config file
    /// until validated. Read by the agent when it starts, and by `trellis check`.
    #[serde(deserialize_with = "plain::<FilePath, _>")]
    pub private_key_file: PathBuf,
    /// The agent's addresses inside the tunnel (its peer entry's `allowedIPs` at the
    /// gateway): one or two, at most one per family.
    #[serde(default, deserialize_with = "plain_list::<Ip, _>")]
    pub addresses: Vec<IpAddr>,
    /// The gateway: its key and where to reach it.
    pub gateway: AgentGateway,
}

/// The gateway as the agent sees it.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct AgentGateway {
    /// The gateway device's public key, base64 as `wg pubkey` prints it.
    pub public_key: WgKey,
    /// Where the gateway is, tried in order (UDP preferred: while on a `connect` endpoint the
    /// agent probes the `udp` ones): at least one.
    #[serde(default)]
    pub endpoints: Vec<EndpointEntry>,
    /// Instead of `endpoints`: the gateway's replicas, one session with each (every replica
    /// then has a session with every agent), each with its endpoints in order.
    #[serde(default)]
    pub replicas: Vec<AgentReplica>,
    /// How often to send a keepalive when nothing else is sent (default `25s`; `0s` = off):
    /// whole seconds up to 65535.
    #[serde(default)]
    pub persistent_keepalive: PersistentKeepalive,
}

/// One gateway replica.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct AgentReplica {
    /// Where this replica is, tried in order (UDP preferred): at least one.
    #[serde(default)]
    pub endpoints: Vec<EndpointEntry>,
}

/// One gateway endpoint as the file has it: exactly one of `udp` and `connect`
/// ([`AgentEndpoint`] once validated).
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct EndpointEntry {
    /// `HOST:PORT` of the gateway's `wireguard` listener (the host resolved by the agent).
    #[serde(default)]
    pub udp: Option<HostPort>,
    /// WireGuard over TCP through a CONNECT to an `http-connect` listener of the gateway
    /// (for load balancers without UDP); the agent goes back to a `udp` endpoint as soon as
    /// one answers again.
    #[serde(default)]
    pub connect: Option<ConnectEndpoint>,
}

/// A `connect` endpoint.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct ConnectEndpoint {
    /// `HOST:PORT` of an `http-connect` listener of the gateway.
    pub address: HostPort,
    /// The destination header value the gateway's `wireguard.connectDestination` names.
    pub destination: Destination,
    /// The destination header's name (default `X-Gardener-Destination`).
    #[serde(default)]
    pub destination_header: Option<HeaderName>,
}

/// `HOST:PORT`: the host an IP address or a DNS name (brackets and a trailing dot taken
/// off), the port above 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    /// As written.
    pub text: String,
    /// The host.
    pub host: String,
    /// The port.
    pub port: u16,
}

impl Text for HostPort {
    fn from_text(value: &str) -> Result<Self, String> {
        value
            .rsplit_once(':')
            .and_then(|(host, port)| {
                let host = host
                    .strip_prefix('[')
                    .and_then(|h| h.strip_suffix(']'))
                    .unwrap_or(host)
                    .trim_end_matches('.');
                let port = port.parse::<u16>().ok().filter(|&p| p > 0)?;
                let host_ok = !host.is_empty()
                    && (host.parse::<IpAddr>().is_ok()
                        || crate::wire::tls::normalize_host(host.as_bytes()).is_some());
                host_ok.then(|| HostPort {
                    text: value.to_owned(),
                    host: host.to_owned(),
                    port,
                })
            })
            .ok_or_else(|| format!("expected HOST:PORT, got {value:?}"))
    }
    fn stand_in() -> Self {
        HostPort {
            text: String::new(),
            host: String::new(),
            port: 0,
        }
    }
}

/// `persistentKeepalive`: `None` = off (`0s`); whole seconds up to 65535.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PersistentKeepalive(pub Option<Duration>);

impl Default for PersistentKeepalive {
    fn default() -> Self {
        PersistentKeepalive(Some(DEFAULT_PERSISTENT_KEEPALIVE))
    }
}

impl Text for PersistentKeepalive {
    fn from_text(text: &str) -> Result<Self, String> {
        match parse_duration(text)? {
            d if d.is_zero() => Ok(PersistentKeepalive(None)),
            d if d.subsec_nanos() != 0 || d > MAX_PERSISTENT_KEEPALIVE => Err(format!(
                "{text:?}: whole seconds from 1s to 65535s, or 0s for off"
            )),
            d => Ok(PersistentKeepalive(Some(d))),
        }
    }
    fn stand_in() -> Self {
        PersistentKeepalive::default()
    }
}

/// The agent's timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase", default)]
pub struct AgentTimeouts {
    /// Budget for dialing a target (default `5s`).
    #[serde(deserialize_with = "plain::<Positive, _>")]
    pub connect: Duration,
    /// Close connections idle this long (default `1h`).
    #[serde(deserialize_with = "plain::<Positive, _>")]
    pub idle: Duration,
    /// How long a half-closed connection may stay open (default `1m`).
    #[serde(deserialize_with = "plain::<Positive, _>")]
    pub half_close: Duration,
    /// How long connections may finish on shutdown (default `30s`).
    #[serde(deserialize_with = "plain::<Span, _>")]
    pub drain: Duration,
}

impl Default for AgentTimeouts {
    fn default() -> Self {
        AgentTimeouts {
            connect: Duration::from_secs(5),
            idle: Duration::from_secs(3600),
            half_close: Duration::from_secs(60),
            drain: Duration::from_secs(30),
        }
    }
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

impl EndpointEntry {
    /// The endpoint, if the entry names exactly one.
    fn endpoint(&self) -> Option<AgentEndpoint> {
        match (&self.udp, &self.connect) {
            // A port of 0 is a stand-in for a value refused when the file was decoded.
            (Some(udp), None) if udp.port != 0 => Some(AgentEndpoint::Udp {
                host: udp.host.clone(),
                port: udp.port,
            }),
            (None, Some(c)) if c.address.port != 0 => Some(AgentEndpoint::Connect {
                address: c.address.text.clone(),
                destination: c.destination.0.clone(),
                destination_header: c
                    .destination_header
                    .as_ref()
                    .map_or(DEFAULT_DESTINATION_HEADER, |h| h.as_str())
                    .to_owned(),
            }),
            _ => None,
        }
    }
}

impl AgentConfig {
    /// One entry per session the agent keeps (one per gateway replica; one for a single
    /// gateway): where that gateway is, in the order to try.
    pub fn lanes(&self) -> Vec<Vec<AgentEndpoint>> {
        let gateway = &self.wireguard.gateway;
        let lane = |entries: &[EndpointEntry]| -> Vec<AgentEndpoint> {
            entries.iter().filter_map(EndpointEntry::endpoint).collect()
        };
        if gateway.replicas.is_empty() {
            vec![lane(&gateway.endpoints)]
        } else {
            gateway
                .replicas
                .iter()
                .map(|r| lane(&r.endpoints))
                .collect()
        }
    }
}

impl ConfigKind for AgentConfig {
    const KIND: &'static str = "AgentConfiguration";
    const READ_BY: &'static str = "'trellis agent'";
    type File = AgentConfig;
    type Context<'a> = ();

    fn validate(mut c: AgentConfig, source: &Source<'_>, (): (), errors: &mut Errors) -> Self {
        c.api_version.check(errors);
        let wg = &mut c.wireguard;
        if wg.private_key_file.is_relative() {
            wg.private_key_file = source.dir().join(&wg.private_key_file);
        }
        addresses(errors, &mut wg.addresses);
        lanes(errors, &wg.gateway);
        if c.networks.is_empty() {
            errors.push(
                "networks",
                "at least one network is required (what the agent dials for the seed)",
            );
        }
        c.admin.no_debug_address(
            errors,
            "the agent serves no routing table; only the gateway has a debug endpoint",
        );
        c
    }
}

/// The agent's tunnel addresses: one or two, at most one per family, unicast.
fn addresses(errors: &mut Errors, addresses: &mut [IpAddr]) {
    let path = "wireguard.addresses";
    if addresses.is_empty() || addresses.len() > 2 {
        errors.push(
            path,
            format!(
                "one or two addresses are required (at most one per family), got {}",
                addresses.len()
            ),
        );
    }
    // Refused addresses (decoded as stand-ins) take part in no rule.
    let refused: Vec<bool> = (0..addresses.len())
        .map(|i| errors.refused(&format!("{path}[{i}]")))
        .collect();
    for i in 0..addresses.len() {
        let ip = addresses[i].to_canonical();
        addresses[i] = ip;
        if refused[i] {
            continue;
        }
        let at_i = format!("{path}[{i}]");
        if ip.is_unspecified()
            || ip.is_multicast()
            || matches!(ip, IpAddr::V4(v4) if v4.is_broadcast())
        {
            errors.push(&at_i, format!("{ip} is not a unicast address"));
        }
        if let Some(other) = (0..i).find(|&o| !refused[o] && addresses[o].is_ipv4() == ip.is_ipv4())
        {
            let family = if ip.is_ipv4() { "IPv4" } else { "IPv6" };
            errors.push(
                &at_i,
                format!("a second {family} address (addresses[{other}]): at most one per family"),
            );
        }
    }
}

/// The sessions to keep: `endpoints` (one gateway) or `replicas` (one per replica), each
/// with at least one endpoint, none shared between replicas.
fn lanes(errors: &mut Errors, gateway: &AgentGateway) {
    if gateway.replicas.is_empty() {
        endpoints(errors, "wireguard.gateway.endpoints", &gateway.endpoints);
        return;
    }
    if !gateway.endpoints.is_empty() {
        errors.push(
            "wireguard.gateway",
            "either endpoints (one gateway) or replicas (a session with each replica), not both",
        );
    }
    if gateway.replicas.len() > MAX_REPLICAS {
        errors.push(
            "wireguard.gateway.replicas",
            format!(
                "at most {MAX_REPLICAS} replicas, got {}",
                gateway.replicas.len()
            ),
        );
    }
    for (i, r) in gateway.replicas.iter().enumerate() {
        let path = format!("wireguard.gateway.replicas[{i}].endpoints");
        endpoints(errors, &path, &r.endpoints);
    }
    // Two sessions with one replica (one key) would take the peer's session from each
    // other at every handshake.
    let lanes: Vec<Vec<Option<AgentEndpoint>>> = gateway
        .replicas
        .iter()
        .map(|r| r.endpoints.iter().map(EndpointEntry::endpoint).collect())
        .collect();
    for (j, lane) in lanes.iter().enumerate() {
        for (k, e) in lane.iter().enumerate() {
            let Some(e) = e else { continue };
            if let Some(i) = lanes[..j]
                .iter()
                .position(|l| l.iter().any(|o| o.as_ref() == Some(e)))
            {
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
}

/// A gateway's endpoints: at least one, each exactly one of `udp` and `connect`.
fn endpoints(errors: &mut Errors, path: &str, entries: &[EndpointEntry]) {
    for (i, e) in entries.iter().enumerate() {
        let at_i = format!("{path}[{i}]");
        match (&e.udp, &e.connect) {
            (Some(_), Some(_)) => errors.push(&at_i, "either udp or connect, not both"),
            (None, None) => errors.push(&at_i, "expected udp: HOST:PORT or connect: {...}"),
            _ => {}
        }
    }
    if entries.is_empty() {
        errors.push(
            path,
            "at least one endpoint is required (udp: HOST:PORT or connect: {...})",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn check(yaml: &str) -> Result<AgentConfig, String> {
        crate::config::parse::<AgentConfig>(Path::new("/etc/trellis/agent.yaml"), yaml.as_bytes())
            .map_err(|e| e.to_string())
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
        assert_eq!(
            c.wireguard.private_key_file,
            Path::new("/etc/trellis/agent.key")
        );
        assert_eq!(c.wireguard.gateway.public_key, WgKey([9; 32]));
        assert_eq!(c.wireguard.addresses.len(), 2);
        assert_eq!(
            c.lanes()[0],
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
        assert_eq!(
            c.wireguard.gateway.persistent_keepalive.0,
            Some(Duration::from_secs(25))
        );
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
        assert_eq!(
            c.wireguard.private_key_file,
            Path::new("/etc/trellis/agent.key")
        );
        assert_eq!(
            c.wireguard.gateway.persistent_keepalive.0,
            Some(DEFAULT_PERSISTENT_KEEPALIVE)
        );
        let c = check(&agent(&format!("{UDP}    persistentKeepalive: 0s\n"), "")).unwrap();
        assert_eq!(c.wireguard.gateway.persistent_keepalive.0, None);
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
            c.lanes()[0],
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
            &c.lanes()[0][0],
            AgentEndpoint::Connect { destination_header, .. } if destination_header == "Reversed-VPN"
        ));
        assert!(matches!(
            &c.lanes()[0][1],
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
        assert_eq!(c.lanes().len(), 2);
        assert_eq!(c.lanes()[0].len(), 2);
        assert_eq!(
            c.lanes()[1],
            [AgentEndpoint::Udp {
                host: "vpn.seed.example.com".into(),
                port: 51821
            }]
        );
        let single = check(&agent(UDP, "")).unwrap();
        assert_eq!(single.lanes().len(), 1);

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
        let err = crate::config::parse::<AgentConfig>(
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
