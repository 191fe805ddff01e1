//! `kind: ControllerConfiguration`: which gateway the controller renders for, the fallback
//! backend, whether it renders the shoots' tunnels (and their addresses), the routes it adds
//! as written (`extraRoutes`), the output. The file decodes into [`ControllerFile`] with
//! every value typed; validation builds the [`ControllerConfig`] the controller runs on
//! (the defaults of absent sections filled in).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::common::Admin;
use super::error::Errors;
use super::load::{ConfigKind, Source};
use super::table::RawRoute;
use super::value::{ApiVersion, FilePath, Ip, Text, plain_option};
use crate::route::{BackendAddress, BackendRegistry, ProxyVersion};

mapping_only!(
    ControllerFile,
    Target,
    Fallback,
    TunnelSection,
    OutputSection
);
text_values!(ParentRef);

/// The `spec.selector` of the Istio Gateways gardenlet writes for the seed's default ingress
/// gateway (gardenlet's default `app`/`istio` labels plus `istio-role: seed`).
pub const DEFAULT_SELECTOR: [(&str, &str); 3] = [
    ("app", "istio-ingressgateway"),
    ("istio", "ingressgateway"),
    ("istio-role", "seed"),
];

/// The gateway's addresses inside every shoot's tunnel when the configuration names none:
/// the first address of the VPN ranges the examples use, `192.168.128.1` and
/// `fd8f:6d53:b97a:1::1` (Gardener's default IPv6 VPN range). They must be outside every
/// shoot's networks and its agents' addresses.
pub const DEFAULT_TUNNEL_LOCAL_ADDRESSES: [IpAddr; 2] = [
    IpAddr::V4(Ipv4Addr::new(192, 168, 128, 1)),
    IpAddr::V6(Ipv6Addr::new(0xfd8f, 0x6d53, 0xb97a, 1, 0, 0, 0, 1)),
];

/// A controller configuration file.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct ControllerFile {
    /// Always `trellis.gardener.cloud/v1alpha1`.
    pub api_version: ApiVersion,
    /// Always `ControllerConfiguration`.
    pub kind: String,
    /// Kubeconfig file of the seed (relative to this file); in-cluster configuration (or
    /// `KUBECONFIG`) when absent.
    #[serde(default)]
    pub kubeconfig: Option<String>,
    /// The gateway the table is rendered for (default: the seed's default ingress gateway).
    #[serde(default)]
    pub gateway: Option<Target>,
    /// Where everything trellis does not route itself goes (the Envoy gateway's Service).
    #[serde(default)]
    pub fallback: Option<Fallback>,
    /// Shoots' tunnel and egress routes: rendered only with `enabled: true` (absent: none,
    /// and neither Clusters nor Secrets are read).
    #[serde(default)]
    pub tunnel: Option<TunnelSection>,
    /// Routes added to every table as written, in the routing table's schema (routes with
    /// backends: no `tunnel` or `egress`, no name of the controller's own). They are settled
    /// before the rendered routes: a rendered route with one's name is left out, and one
    /// holding one's server name, destination or PROXY destination loses it (`conflict`).
    #[serde(default)]
    pub extra_routes: Vec<RawRoute>,
    /// Where the table is written.
    #[serde(default)]
    pub output: Option<OutputSection>,
    /// Probes and metrics of `trellis controller` (none when absent).
    #[serde(default)]
    pub admin: Option<Admin>,
}

/// The gateway the table is rendered for.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct Target {
    /// The labels of the gateway workload trellis stands in for: an Istio `Gateway` is served
    /// when every label of its `spec.selector` is among them (Istio's own rule). Zonal
    /// gateways (`istio: ingressgateway--zone--<zone>`) and exposure-class gateways
    /// (`handler.exposureclass.gardener.cloud/name: <handler>`) each get their own table.
    #[serde(default, deserialize_with = "labels")]
    pub selector: Option<BTreeMap<String, String>>,
    /// Gateway API `Gateway`s (`namespace/name`) whose `TLSRoute`s this gateway serves.
    #[serde(default)]
    pub parent_refs: Vec<ParentRef>,
}

/// A Gateway API parent: `namespace/name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParentRef(pub String, pub String);

impl Text for ParentRef {
    fn from_text(parent: &str) -> Result<Self, String> {
        match parent.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(ParentRef(ns.to_owned(), name.to_owned()))
            }
            _ => Err(format!("expected NAMESPACE/NAME, got {parent:?}")),
        }
    }
    fn stand_in() -> Self {
        ParentRef(String::new(), String::new())
    }
}

/// A mapping of label keys to values, said so in errors (serde's own message for a map is
/// "expected a map"; every other mapping in trellis' files is "a mapping").
fn labels<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    struct Labels;
    impl<'de> serde::de::Visitor<'de> for Labels {
        type Value = BTreeMap<String, String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a mapping")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some((k, v)) = map.next_entry()? {
                out.insert(k, v);
            }
            Ok(out)
        }
    }
    d.deserialize_any(Labels).map(Some)
}

/// The fallback backends.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct Fallback {
    /// `IP:port` or `DNS-name:port` of the fallback for TLS (e.g. the Envoy gateway's
    /// Service, port 443): route `fallback`, the `sni` listener's `defaultRoute`.
    pub address: BackendAddress,
    /// The fallback's CONNECT proxy for `X-Gardener-Destination` (Envoy's port 8443): route
    /// `fallback-connect`, which forwards the CONNECT as received; the `defaultRoute` of the
    /// gateway's `http-connect` listener on 8443.
    #[serde(default)]
    pub connect: Option<BackendAddress>,
    /// The fallback's CONNECT proxy for the legacy `Reversed-VPN` header (Envoy's port
    /// 8132): route `fallback-connect-legacy`, the `defaultRoute` of the listener on 8132.
    #[serde(default)]
    pub connect_legacy: Option<BackendAddress>,
    /// `v1` or `v2`: the fallback routes start every connection with a PROXY header, so
    /// the fallback sees the client (Gardener's Envoy takes one with
    /// `terminateLoadBalancerProxyProtocol`). Left out: none, and the fallback sees trellis.
    #[serde(default)]
    pub send_proxy_protocol: Option<ProxyVersion>,
}

/// The `tunnel` section.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct TunnelSection {
    /// Required in the section: `true` renders every shoot's tunnel and egress route (and
    /// reads Clusters and Secrets for them), `false` none, as when the section is absent.
    #[serde(default)]
    pub enabled: Option<bool>,
    /// The gateway's addresses inside every shoot's tunnel (a route's
    /// `tunnel.wireguard.localAddresses`): one or two, at most one per family, outside every
    /// shoot's networks and agent addresses (default: [`DEFAULT_TUNNEL_LOCAL_ADDRESSES`]).
    /// Only with `enabled: true`.
    #[serde(default)]
    pub local_addresses: Option<Vec<Ip>>,
}

/// The output.
#[derive(Debug, Deserialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct OutputSection {
    /// A routing table file, replaced atomically on change.
    #[serde(default, deserialize_with = "plain_option::<FilePath, _>")]
    pub file: Option<PathBuf>,
}

/// A validated controller configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerConfig {
    /// Kubeconfig file; in-cluster configuration when `None`.
    pub kubeconfig: Option<PathBuf>,
    /// Labels of the gateway workload: Gateways whose selector is a subset are served.
    pub selector: BTreeMap<String, String>,
    /// Gateway API parents (`namespace`, `name`) whose TLSRoutes are served.
    pub parent_refs: Vec<(String, String)>,
    /// The fallback backend, if any.
    pub fallback: Option<BackendAddress>,
    /// The fallback's CONNECT proxy for `X-Gardener-Destination`, if any.
    pub fallback_connect: Option<BackendAddress>,
    /// The fallback's CONNECT proxy for `Reversed-VPN`, if any.
    pub fallback_connect_legacy: Option<BackendAddress>,
    /// The PROXY header the fallback routes send, if any.
    pub fallback_proxy_protocol: Option<ProxyVersion>,
    /// The shoots' tunnels, when the configuration turns them on (`tunnel.enabled: true`);
    /// `None`: no tunnel or egress routes, no Cluster or Secret read.
    pub tunnel: Option<TunnelConfig>,
    /// Routes added to every table as written (validated as a table's routes are).
    pub extra_routes: Vec<RawRoute>,
    /// Where the table goes.
    pub output: Output,
    /// Address of `/ready`, `/live` and `/metrics`, if any.
    pub admin: Option<SocketAddr>,
}

/// The `tunnel` section of a configuration that turns tunnels on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelConfig {
    /// The gateway's addresses inside every shoot's tunnel, at most one per family.
    pub local_addresses: Vec<IpAddr>,
}

impl Default for TunnelConfig {
    /// [`DEFAULT_TUNNEL_LOCAL_ADDRESSES`].
    fn default() -> Self {
        TunnelConfig {
            local_addresses: DEFAULT_TUNNEL_LOCAL_ADDRESSES.to_vec(),
        }
    }
}

/// Where the rendered table goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Not configured (`render` prints the table).
    None,
    /// A file, replaced atomically.
    File(PathBuf),
}

impl Default for ControllerConfig {
    /// The seed's default ingress gateway, no fallback, no tunnels, no output.
    fn default() -> Self {
        ControllerConfig {
            kubeconfig: None,
            selector: DEFAULT_SELECTOR
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            parent_refs: Vec::new(),
            fallback: None,
            fallback_connect: None,
            fallback_connect_legacy: None,
            fallback_proxy_protocol: None,
            tunnel: None,
            extra_routes: Vec::new(),
            output: Output::None,
            admin: None,
        }
    }
}

impl ConfigKind for ControllerConfig {
    const KIND: &'static str = "ControllerConfiguration";
    const READ_BY: &'static str = "'trellis controller'";
    type File = ControllerFile;
    type Context<'a> = ();

    fn validate(file: ControllerFile, source: &Source<'_>, (): (), errors: &mut Errors) -> Self {
        file.api_version.check(errors);
        // Relative paths are relative to the configuration file, like a gateway's `routes.file`.
        let dir = source.dir();
        let mut config = ControllerConfig {
            kubeconfig: file.kubeconfig.map(|k| dir.join(k)),
            ..ControllerConfig::default()
        };
        if let Some(target) = file.gateway {
            if let Some(selector) = target.selector {
                if selector.is_empty() {
                    errors.push("gateway.selector", "must name at least one label");
                }
                if selector.keys().any(String::is_empty) {
                    errors.push("gateway.selector", "a label key may not be empty");
                }
                config.selector = selector;
            }
            config.parent_refs = target.parent_refs.into_iter().map(|p| (p.0, p.1)).collect();
        }
        if let Some(fallback) = file.fallback {
            config.fallback = Some(fallback.address);
            config.fallback_connect = fallback.connect;
            config.fallback_connect_legacy = fallback.connect_legacy;
            config.fallback_proxy_protocol = fallback.send_proxy_protocol;
        }
        if let Some(tunnel) = file.tunnel {
            config.tunnel = self::tunnel(errors, tunnel);
        }
        extra_routes(errors, &file.extra_routes, dir);
        config.extra_routes = file.extra_routes;
        if let Some(output) = file.output {
            match output.file {
                Some(f) => config.output = Output::File(dir.join(f)),
                // At the field's own path: a `file` of the wrong type was reported already.
                None => errors.push("output.file", "required: where the table goes"),
            }
        }
        if let Some(admin) = file.admin {
            config.admin = Some(admin.address.0);
            admin.no_debug_address(
                errors,
                "the controller has no debug endpoint (the table is its output)",
            );
        }
        config
    }
}

/// Whether `name` is reserved for the routes the controller adds itself: `fallback` and
/// every name that starts with `fallback-` (the CONNECT fallbacks, the ACL code's
/// `fallback-closed` and `fallback-acl-…`, and any the controller adds later).
pub fn is_reserved_route_name(name: &str) -> bool {
    name.strip_prefix("fallback")
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('-'))
}

/// `extraRoutes`: valid as a table's routes (names, keys unique among them, backends,
/// timeouts, …), and routes with backends only, none named like the controller's own.
fn extra_routes(errors: &mut Errors, routes: &[RawRoute], dir: &Path) {
    // Validated and indexed as a table's routes are; the controller writes them as given.
    let _ = super::table::table_of(
        "extraRoutes",
        routes,
        dir,
        &BackendRegistry::default(),
        errors,
    );
    for (i, route) in routes.iter().enumerate() {
        if is_reserved_route_name(&route.name) {
            errors.push(
                format!("extraRoutes[{i}].name"),
                format!(
                    "{:?} is reserved for the controller's own routes (fallback, fallback-…)",
                    route.name
                ),
            );
        }
        for (field, set) in [
            ("tunnel", route.tunnel.is_some()),
            ("egress", route.egress.is_some()),
        ] {
            if set {
                errors.push(
                    format!("extraRoutes[{i}].{field}"),
                    "not in extraRoutes: the controller renders the shoots' tunnel and egress \
                     routes itself (tunnel.enabled)",
                );
            }
        }
    }
}

/// The `tunnel` section: on with `enabled: true`, off with `false`; anything else, or
/// addresses for tunnels that are off, is an error (a section that names addresses but
/// leaves out `enabled` says neither).
fn tunnel(errors: &mut Errors, raw: TunnelSection) -> Option<TunnelConfig> {
    match (raw.enabled, raw.local_addresses) {
        (Some(true), addresses) => Some(TunnelConfig {
            local_addresses: match addresses {
                Some(list) => local_addresses(errors, &list),
                None => DEFAULT_TUNNEL_LOCAL_ADDRESSES.to_vec(),
            },
        }),
        (Some(false), None) => None,
        (Some(false), Some(_)) => {
            errors.push(
                "tunnel.localAddresses",
                "set, but tunnels are off (tunnel.enabled: false): remove it, or turn tunnels on",
            );
            None
        }
        (None, _) => {
            errors.push(
                "tunnel.enabled",
                "required in a tunnel section: true renders the shoots' tunnel and egress routes, \
                 false (or no tunnel section) renders none",
            );
            None
        }
    }
}

/// `tunnel.localAddresses`: one or two unicast addresses, at most one per family.
fn local_addresses(errors: &mut Errors, list: &[Ip]) -> Vec<IpAddr> {
    let path = "tunnel.localAddresses";
    if list.is_empty() || list.len() > 2 {
        errors.push(
            path,
            format!(
                "one or two addresses are required (at most one per family), got {}",
                list.len()
            ),
        );
    }
    let mut out: Vec<IpAddr> = Vec::with_capacity(list.len());
    // Refused addresses (decoded as stand-ins) take part in no rule.
    let mut valid: Vec<IpAddr> = Vec::with_capacity(list.len());
    for (i, ip) in list.iter().enumerate() {
        let at = format!("{path}[{i}]");
        let ip = ip.0.to_canonical();
        out.push(ip);
        if errors.refused(&at) {
            continue;
        }
        if ip.is_unspecified()
            || ip.is_multicast()
            || matches!(ip, IpAddr::V4(v4) if v4.is_broadcast())
        {
            errors.push(&at, format!("{ip} is not a unicast address"));
        }
        if valid.iter().any(|o| o.is_ipv4() == ip.is_ipv4()) {
            errors.push(
                &at,
                "a second address of its family: at most one per family",
            );
        }
        valid.push(ip);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(yaml: &str) -> Result<ControllerConfig, String> {
        crate::config::parse::<ControllerConfig>(
            Path::new("/etc/trellis/controller.yaml"),
            yaml.as_bytes(),
        )
        .map_err(|e| e.to_string())
    }

    const HEAD: &str =
        "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: ControllerConfiguration\n";

    #[test]
    fn defaults_are_the_seed_default_gateway() {
        let c = check(HEAD).unwrap();
        assert_eq!(c, ControllerConfig::default());
        assert_eq!(
            c.selector.get("istio").map(String::as_str),
            Some("ingressgateway")
        );
        assert_eq!(c.fallback, None);
        assert_eq!(c.tunnel, None, "tunnels are opt-in");
    }

    /// Tunnels are rendered only when the configuration says so; the default addresses come
    /// with `enabled: true` alone; a section that says something else is refused.
    #[test]
    fn tunnels_are_on_only_with_enabled_true() {
        let on = check(&format!("{HEAD}tunnel: {{enabled: true}}\n")).unwrap();
        assert_eq!(
            on.tunnel.unwrap().local_addresses,
            [
                "192.168.128.1".parse::<IpAddr>().unwrap(),
                "fd8f:6d53:b97a:1::1".parse().unwrap()
            ]
        );
        let off = check(&format!("{HEAD}tunnel: {{enabled: false}}\n")).unwrap();
        assert_eq!(off, ControllerConfig::default());
        for (yaml, needle) in [
            (
                "tunnel: {localAddresses: [10.99.0.1]}",
                "tunnel.enabled: required in a tunnel section",
            ),
            ("tunnel: {}", "tunnel.enabled: required in a tunnel section"),
            (
                "tunnel: {enabled: false, localAddresses: [10.99.0.1]}",
                "tunnel.localAddresses: set, but tunnels are off",
            ),
            ("tunnel: {enabled: maybe}", "tunnel.enabled"),
        ] {
            let err = check(&format!("{HEAD}{yaml}\n")).unwrap_err();
            assert!(err.contains(needle), "{yaml}: {needle} not in {err}");
        }
    }

    /// `extraRoutes` are routes of the table's schema, validated as a table's routes are
    /// (paths under `extraRoutes`), with backends only and none of the controller's names.
    #[test]
    fn extra_routes_are_validated_as_a_tables_routes() {
        let c = check(&format!(
            "{HEAD}extraRoutes:
- name: trellis-wireguard-0
  destinations: [\"trellis-wireguard-0:51820\"]
  backends: [{{address: \"trellis-tunnel-0.trellis-ingress.svc.cluster.local:8443\"}}]
  forwardConnect: true
  timeouts: {{idle: 1h}}
"
        ))
        .unwrap();
        assert_eq!(c.extra_routes.len(), 1);
        let r = &c.extra_routes[0];
        assert_eq!(r.destinations, ["trellis-wireguard-0:51820"]);
        assert!(r.forward_connect);
        assert_eq!(r.timeouts.as_ref().unwrap().idle.as_deref(), Some("1h"));
        let err = check(&format!(
            "{HEAD}extraRoutes:
- {{name: a, destinations: [x], backends: [{{address: nope}}], bogus: 1}}
- {{name: b, destinations: [x], backends: [{{address: \"10.0.0.1:1\"}}]}}
- {{name: fallback-connect, sni: [a.example.com], backends: [{{address: \"10.0.0.1:1\"}}]}}
- {{name: c, backends: [], tunnel: {{wireguard: {{peers: [], localAddresses: []}}}}}}
- {{name: d, backends: [{{address: \"10.0.0.1:1\"}}], egress: {{clientIdentities: [x]}}}}
- {{name: \"e f\", sni: [a.example.com], backends: [{{address: \"10.0.0.1:1\"}}]}}
"
        ))
        .unwrap_err();
        for needle in [
            "extraRoutes[0].bogus: unknown field `bogus`",
            "extraRoutes[0].backends[0].address: expected HOST:PORT",
            "extraRoutes[1]: ",
            "(extraRoutes[0])",
            "extraRoutes[2].name: \"fallback-connect\" is reserved",
            "extraRoutes[3].tunnel: not in extraRoutes",
            "extraRoutes[4].egress: not in extraRoutes",
            "extraRoutes[5].name: invalid route name",
        ] {
            assert!(err.contains(needle), "{needle} not in {err}");
        }
    }

    #[test]
    fn reads_every_field() {
        let c = check(&format!(
            "{HEAD}kubeconfig: /k
gateway:
  selector: {{istio: ingressgateway--zone--eu-1a}}
  parentRefs: [infra/public]
fallback:
  address: \"istio-ingressgateway.istio-ingress.svc.cluster.local:443\"
  connect: \"istio-ingressgateway.istio-ingress.svc.cluster.local:8443\"
  connectLegacy: \"istio-ingressgateway.istio-ingress.svc.cluster.local:8132\"
  sendProxyProtocol: v2
tunnel: {{enabled: true, localAddresses: [\"fd00::1\", 10.99.0.1]}}
output: {{file: routes.json}}
admin: {{address: \"127.0.0.1:15022\"}}
"
        ))
        .unwrap();
        assert_eq!(
            c.tunnel.unwrap().local_addresses,
            [
                "fd00::1".parse::<IpAddr>().unwrap(),
                "10.99.0.1".parse().unwrap()
            ]
        );
        assert_eq!(c.kubeconfig, Some(PathBuf::from("/k")));
        assert_eq!(c.selector.len(), 1);
        assert_eq!(c.parent_refs, [("infra".into(), "public".into())]);
        assert_eq!(
            c.fallback.unwrap().to_string(),
            "istio-ingressgateway.istio-ingress.svc.cluster.local:443"
        );
        assert_eq!(
            c.fallback_connect.unwrap().to_string(),
            "istio-ingressgateway.istio-ingress.svc.cluster.local:8443"
        );
        assert_eq!(
            c.fallback_connect_legacy.unwrap().to_string(),
            "istio-ingressgateway.istio-ingress.svc.cluster.local:8132"
        );
        assert_eq!(c.fallback_proxy_protocol, Some(ProxyVersion::V2));
        assert_eq!(c.output, Output::File("/etc/trellis/routes.json".into()));
        assert_eq!(c.admin, Some(SocketAddr::from(([127, 0, 0, 1], 15022))));
        let c = check(&format!("{HEAD}kubeconfig: seed.kubeconfig\n")).unwrap();
        assert_eq!(
            c.kubeconfig,
            Some(PathBuf::from("/etc/trellis/seed.kubeconfig"))
        );
    }

    #[test]
    fn reports_every_error_with_path() {
        let err = check(&format!(
            "{HEAD}gateway: {{selector: {{}}, parentRefs: [nope], extra: 1}}
fallback: {{address: nope, connect: \"envoy\", connectLegacy: \"envoy:x\", sendProxyProtocol: v9}}
output: {{}}
admin: {{address: nope, debugAddress: \"127.0.0.1:1\"}}
tunnel: {{enabled: true, localAddresses: [10.0.0.1, 10.0.0.2, nope]}}
"
        ))
        .unwrap_err();
        for needle in [
            "gateway.selector: must name at least one label",
            "gateway.parentRefs[0]: expected NAMESPACE/NAME",
            "fallback.address: expected HOST:PORT",
            "fallback.connect: expected HOST:PORT",
            "fallback.connectLegacy: ",
            "fallback.sendProxyProtocol: expected v1 or v2, got \"v9\"",
            "output.file: required: where the table goes",
            "gateway.extra: unknown field `extra`",
            "admin.address: expected IP:port",
            "admin.debugAddress: the controller has no debug endpoint",
            "tunnel.localAddresses: one or two addresses are required (at most one per family), got 3",
            "tunnel.localAddresses[1]: a second address of its family",
            "tunnel.localAddresses[2]: expected an IP address, got \"nope\"",
        ] {
            assert!(err.contains(needle), "{needle} not in {err}");
        }
    }
}
