//! `kind: NodeConfiguration`: the shoot node daemon's listen addresses, managed link,
//! upstream gateway, admin endpoint, timeouts and limits, decoded into [`NodeConfig`];
//! validation keeps the rules across fields (each upstream protocol's own settings).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use serde::Deserialize;

use super::common::{Admin, Keepalive, NodeUpstream, Timeouts};
use super::error::Errors;
use super::load::{ConfigKind, Source};
use super::value::{
    Address, ApiVersion, Count, DEFAULT_DESTINATION_HEADER, HeaderName, Ip, Positive, Text, plain,
    plain_list, plain_option, secs,
};
use crate::net::IpFamily;

mapping_only!(NodeConfig, Interface, Upstream, NodeLimits);
text_values!(LinkName, UpstreamAddress, ProtocolName, IpFamily);

/// A node configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct NodeConfig {
    /// Always `trellis.gardener.cloud/v1alpha1`.
    pub api_version: ApiVersion,
    /// Always `NodeConfiguration`.
    pub kind: String,
    /// Addresses to listen on (the kube-apiserver advertise address, port 443). May be left
    /// out of the file when `trellis node --advertise-address IP` supplies it (`IP:443`); see
    /// [`NodeConfig::with_advertise_address`].
    #[serde(default, deserialize_with = "plain_list::<Address, _>")]
    pub listen: Vec<SocketAddr>,
    /// The link and address to manage (needs CAP_NET_ADMIN); optional.
    #[serde(default)]
    pub interface: Option<Interface>,
    /// Where connections go.
    pub upstream: Upstream,
    /// Admin endpoint (`/ready`, `/live`, `/metrics`).
    pub admin: Admin,
    /// Timeouts (defaults: connect 5s, handshake 10s, idle 1h, halfClose 1m, drain 60s).
    #[serde(default)]
    pub timeouts: Timeouts,
    /// TCP keepalive (defaults: downstream 55s/55s, upstream 7200s/55s as in Gardener).
    #[serde(default)]
    pub keepalive: Keepalive<NodeUpstream>,
    /// Limits.
    #[serde(default)]
    pub limits: NodeLimits,
}

/// The managed link and address.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct Interface {
    /// Link name; created as a dummy link if missing (default `apiserver-proxy`).
    #[serde(
        default = "LinkName::default_name",
        deserialize_with = "plain::<LinkName, _>"
    )]
    pub name: String,
    /// The address, added as /32 (/128) with global scope. May be left out of the file when
    /// `trellis node --advertise-address IP` supplies it.
    #[serde(default, deserialize_with = "plain_option::<Ip, _>")]
    pub address: Option<IpAddr>,
    /// How often the address is re-checked besides netlink events (default `10s`).
    #[serde(default = "secs::<10>", deserialize_with = "plain::<Positive, _>")]
    pub check_interval: Duration,
}

/// A link name: 1 to 15 characters, no `/` or spaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkName(pub String);

impl LinkName {
    fn default_name() -> String {
        "apiserver-proxy".into()
    }
}

impl Text for LinkName {
    fn from_text(name: &str) -> Result<Self, String> {
        if name.is_empty() || name.len() > 15 || name.contains(['/', ' ']) {
            Err(format!(
                "invalid link name {name:?} (1-15 characters, no '/' or spaces)"
            ))
        } else {
            Ok(LinkName(name.to_owned()))
        }
    }
    fn stand_in() -> Self {
        LinkName(LinkName::default_name())
    }
}

impl super::value::Plain for LinkName {
    type Inner = String;
    fn into_inner(self) -> String {
        self.0
    }
}

/// The upstream.
#[derive(Debug, Clone, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct Upstream {
    /// `host:port` of the seed gateway; the host is resolved per connection.
    pub address: UpstreamAddress,
    /// `http-connect` (default) or `proxy-v2`.
    #[serde(default)]
    pub protocol: ProtocolName,
    /// CONNECT destination header value (`http-connect`).
    #[serde(default)]
    pub destination: Option<String>,
    /// CONNECT destination header name (default `X-Gardener-Destination`).
    #[serde(default)]
    pub destination_header: Option<HeaderName>,
    /// `any` (default), `v4` or `v6`: which resolved addresses to use.
    #[serde(default)]
    pub ip_family: IpFamily,
}

/// The gateway's host (without brackets or a trailing dot) and port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamAddress {
    /// Host name or IP address.
    pub host: String,
    /// Port, above 0.
    pub port: u16,
}

impl Text for UpstreamAddress {
    fn from_text(address: &str) -> Result<Self, String> {
        match address.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() => match port.parse::<u16>() {
                Ok(p) if p > 0 => Ok(UpstreamAddress {
                    host: host
                        .trim_start_matches('[')
                        .trim_end_matches(']')
                        .trim_end_matches('.')
                        .to_owned(),
                    port: p,
                }),
                _ => Err(format!("invalid port in {address:?}")),
            },
            _ => Err(format!("expected HOST:PORT, got {address:?}")),
        }
    }
    fn stand_in() -> Self {
        UpstreamAddress {
            host: String::new(),
            port: 0,
        }
    }
}

/// The `protocol` of the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProtocolName {
    /// `http-connect`.
    #[default]
    HttpConnect,
    /// `proxy-v2`.
    ProxyV2,
}

impl Text for ProtocolName {
    fn from_text(text: &str) -> Result<Self, String> {
        match text {
            "http-connect" => Ok(ProtocolName::HttpConnect),
            "proxy-v2" => Ok(ProtocolName::ProxyV2),
            other => Err(format!("expected http-connect or proxy-v2, got {other:?}")),
        }
    }
    fn stand_in() -> Self {
        ProtocolName::ProxyV2
    }
}

impl Text for IpFamily {
    fn from_text(text: &str) -> Result<Self, String> {
        match text {
            "any" => Ok(IpFamily::Any),
            "v4" => Ok(IpFamily::V4),
            "v6" => Ok(IpFamily::V6),
            other => Err(format!("expected any, v4 or v6, got {other:?}")),
        }
    }
    fn stand_in() -> Self {
        IpFamily::Any
    }
}

/// Limits.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase", default)]
pub struct NodeLimits {
    /// Most client connections at once (default 10000, as in Gardener).
    #[serde(deserialize_with = "plain::<Count<1, 1_000_000>, _>")]
    pub max_connections: usize,
}

impl Default for NodeLimits {
    fn default() -> Self {
        NodeLimits {
            max_connections: 10_000,
        }
    }
}

/// Why `--advertise-address` and the file cannot be combined into listen addresses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdvertiseError {
    /// The file has no `listen` and no `--advertise-address` was given.
    #[error("listen: no address to listen on: give --advertise-address IP or `listen` in the file")]
    NoListen,
    /// The file has an `interface` without `address` and no `--advertise-address` was given.
    #[error(
        "interface.address: no address to manage: give --advertise-address IP or `interface.address` in the file"
    )]
    NoInterfaceAddress,
    /// The file's `listen` is not exactly the flag's `IP:443`.
    #[error("listen: {file:?} disagrees with --advertise-address {flag} (expected [{expected}])")]
    ListenDisagrees {
        /// The file's addresses.
        file: Vec<SocketAddr>,
        /// The flag.
        flag: IpAddr,
        /// What the flag means.
        expected: SocketAddr,
    },
    /// The file's `interface.address` is not the flag's address.
    #[error("interface.address: {file} disagrees with --advertise-address {flag}")]
    InterfaceDisagrees {
        /// The file's address.
        file: IpAddr,
        /// The flag.
        flag: IpAddr,
    },
}

/// The port the advertise address is served on (the `kubernetes` Service's endpoint).
pub const ADVERTISE_PORT: u16 = 443;

impl NodeConfig {
    /// Completes the file with the advertise address (`trellis node --advertise-address`):
    /// `listen` becomes `[IP:443]` and `interface.address` `IP` (when the file has an
    /// `interface`; without one no link is managed, as before). A file that already has
    /// them must agree with the flag; without the flag the file must have them.
    pub fn with_advertise_address(mut self, flag: Option<IpAddr>) -> Result<Self, AdvertiseError> {
        match flag {
            None => {
                if self.listen.is_empty() {
                    return Err(AdvertiseError::NoListen);
                }
                if self.interface.as_ref().is_some_and(|i| i.address.is_none()) {
                    return Err(AdvertiseError::NoInterfaceAddress);
                }
            }
            Some(ip) => {
                let expected = SocketAddr::new(ip, ADVERTISE_PORT);
                if self.listen.is_empty() {
                    self.listen = vec![expected];
                } else if self.listen != [expected] {
                    return Err(AdvertiseError::ListenDisagrees {
                        file: self.listen,
                        flag: ip,
                        expected,
                    });
                }
                if let Some(iface) = &mut self.interface {
                    match iface.address {
                        None => iface.address = Some(ip),
                        Some(file) if file != ip => {
                            return Err(AdvertiseError::InterfaceDisagrees { file, flag: ip });
                        }
                        Some(_) => {}
                    }
                }
            }
        }
        Ok(self)
    }
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

impl Upstream {
    /// The protocol with its settings.
    pub fn protocol(&self) -> UpstreamProtocol {
        match self.protocol {
            ProtocolName::HttpConnect => UpstreamProtocol::HttpConnect {
                header: self
                    .destination_header
                    .as_ref()
                    .map_or(DEFAULT_DESTINATION_HEADER, |h| h.as_str())
                    .to_owned(),
                destination: self.destination.clone().unwrap_or_default(),
            },
            ProtocolName::ProxyV2 => UpstreamProtocol::ProxyV2,
        }
    }
}

impl ConfigKind for NodeConfig {
    const KIND: &'static str = "NodeConfiguration";
    const READ_BY: &'static str = "'trellis node'";
    type File = NodeConfig;
    type Context<'a> = ();

    fn validate(c: NodeConfig, _: &Source<'_>, (): (), errors: &mut Errors) -> Self {
        c.api_version.check(errors);
        // `listen` and `interface.address` may come from `--advertise-address` instead
        // (`NodeConfig::with_advertise_address`, checked at start).
        let u = &c.upstream;
        // A refused protocol's stand-in says nothing of which settings belong.
        let protocol = (!errors.refused("upstream.protocol")).then_some(u.protocol);
        match protocol {
            None => {}
            Some(ProtocolName::HttpConnect) => {
                if let Some(h) = &u.destination_header
                    && !h
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                {
                    errors.push(
                        "upstream.destinationHeader",
                        format!("invalid header name {:?}", h.as_str()),
                    );
                }
                let destination = u.destination.as_deref().unwrap_or_default();
                if destination.is_empty() || destination.bytes().any(|b| b.is_ascii_control()) {
                    errors.push("upstream.destination", "required for http-connect (e.g. outbound|443||kube-apiserver.<ns>.svc.cluster.local)");
                }
            }
            Some(ProtocolName::ProxyV2)
                if u.destination.is_some() || u.destination_header.is_some() =>
            {
                errors.push(
                    "upstream.destination",
                    "only valid with protocol http-connect",
                );
            }
            Some(ProtocolName::ProxyV2) => {}
        }
        c.admin.no_debug_address(
            errors,
            "the node serves no routing table; only the gateway has a debug endpoint",
        );
        if c.timeouts.drain_delay.is_some() {
            errors.push(
                "timeouts.drainDelay",
                "no load balancer sends to the node; only the gateway delays closing its listeners",
            );
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn check(yaml: &str) -> Result<NodeConfig, String> {
        crate::config::parse::<NodeConfig>(Path::new("node.yaml"), yaml.as_bytes())
            .map_err(|e| e.to_string())
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
        assert_eq!(
            c.upstream.address.host,
            "api.alpha.dev.internal.example.com"
        );
        assert_eq!(c.upstream.address.port, 8443);
        assert_eq!(c.limits.max_connections, 10_000);
        assert_eq!(c.keepalive.upstream.idle, Duration::from_secs(7200));
        assert_eq!(c.timeouts.connect, Duration::from_secs(5));
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

    #[test]
    fn advertise_address_completes_the_file_or_must_agree() {
        let base = format!(
            "{HEAD}interface: {{name: apiserver-proxy}}\nupstream: {{address: \"h:8443\", destination: d}}\nadmin: {{address: \"0.0.0.0:16910\"}}\n"
        );
        let c = check(&base).expect("listen and interface.address may be left out");
        assert!(c.listen.is_empty());
        let ip: IpAddr = "240.0.0.1".parse().expect("ip");
        let done = c
            .clone()
            .with_advertise_address(Some(ip))
            .expect("completed");
        assert_eq!(done.listen, vec![SocketAddr::new(ip, 443)]);
        assert_eq!(done.interface.as_ref().and_then(|i| i.address), Some(ip));
        assert_eq!(
            c.clone().with_advertise_address(None).unwrap_err(),
            AdvertiseError::NoListen
        );
        let v6: IpAddr = "64:ff9b:1::10.0.0.1".parse().expect("ip");
        let done = c.with_advertise_address(Some(v6)).expect("completed");
        assert_eq!(done.listen[0].to_string(), "[64:ff9b:1::a00:1]:443");

        let full = check(&format!(
            "{HEAD}listen: [\"240.0.0.1:443\"]\ninterface: {{address: 240.0.0.1}}\nupstream: {{address: \"h:8443\", destination: d}}\nadmin: {{address: \"0.0.0.0:16910\"}}\n"
        ))
        .expect("full");
        assert!(full.clone().with_advertise_address(None).is_ok());
        assert!(full.clone().with_advertise_address(Some(ip)).is_ok());
        let other: IpAddr = "240.0.0.2".parse().expect("ip");
        assert!(matches!(
            full.with_advertise_address(Some(other)),
            Err(AdvertiseError::ListenDisagrees { .. })
        ));
        let listen_only = check(&format!(
            "{HEAD}listen: [\"240.0.0.2:443\"]\ninterface: {{address: 240.0.0.1}}\nupstream: {{address: \"h:8443\", destination: d}}\nadmin: {{address: \"0.0.0.0:16910\"}}\n"
        ))
        .expect("file");
        assert!(matches!(
            listen_only.with_advertise_address(Some(other)),
            Err(AdvertiseError::InterfaceDisagrees { .. })
        ));
        let no_addr = check(&format!(
            "{HEAD}listen: [\"240.0.0.1:443\"]\ninterface: {{name: x}}\nupstream: {{address: \"h:8443\", destination: d}}\nadmin: {{address: \"0.0.0.0:16910\"}}\n"
        ))
        .expect("file");
        assert_eq!(
            no_addr.with_advertise_address(None).unwrap_err(),
            AdvertiseError::NoInterfaceAddress
        );
    }
}
