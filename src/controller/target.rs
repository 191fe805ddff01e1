//! The gateway a table is rendered for ([`Target`]) and the names of the routes the
//! controller adds itself (the fallbacks, and every name reserved for them). Shared by the
//! translation steps and the ACL code; pure data, no I/O.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::model::Gateway;
use crate::config::controller::ControllerConfig;
use crate::config::routes::RawRoute;
use crate::route::ProxyVersion;

/// Name of the route that takes everything trellis does not route itself by SNI (the `sni`
/// listener's `defaultRoute`), and the PROXY destinations of L7 shoots.
pub const FALLBACK_ROUTE: &str = "fallback";

/// Name of the route to the fallback's CONNECT proxy for `X-Gardener-Destination` (the
/// `defaultRoute` of the `http-connect` listener on 8443).
pub const FALLBACK_CONNECT_ROUTE: &str = "fallback-connect";

/// Name of the route to the fallback's CONNECT proxy for `Reversed-VPN` (the `defaultRoute`
/// of the `http-connect` listener on 8132).
pub const FALLBACK_CONNECT_LEGACY_ROUTE: &str = "fallback-connect-legacy";

/// Whether `name` is one of the fallback routes, which are kept without keys.
pub fn is_fallback(name: &str) -> bool {
    [
        FALLBACK_ROUTE,
        FALLBACK_CONNECT_ROUTE,
        FALLBACK_CONNECT_LEGACY_ROUTE,
    ]
    .contains(&name)
}

/// Whether `name` is reserved for the controller's own routes: [`FALLBACK_ROUTE`] and every
/// name that starts with `fallback-` (the CONNECT fallbacks, [`super::acl::CLOSED_ROUTE`], and
/// any the controller adds later). A route built from a namespace's objects never gets one
/// (see [`shoot_route_name`]), so a namespace named `fallback-closed` cannot take the name
/// of a route the ACL code adds after naming is settled.
pub fn is_reserved(name: &str) -> bool {
    // The configuration refuses extra routes with these names by the same rule.
    crate::config::controller::is_reserved_route_name(name)
}

/// What a route built from a namespace's objects is named when its name would be reserved.
pub const RENAMED_PREFIX: &str = "ns.";

/// The name of a route built from a namespace's objects: `name`, or [`RENAMED_PREFIX`] +
/// `name` when that is reserved ([`is_reserved`]). Namespace and Service names are DNS
/// labels, which have no `.`, so a renamed route collides with no other.
pub fn shoot_route_name(name: String) -> String {
    if is_reserved(&name) {
        format!("{RENAMED_PREFIX}{name}")
    } else {
        name
    }
}

/// The gateway a table is rendered for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Target {
    /// Labels of the gateway workload: an Istio Gateway whose selector is a subset is served.
    pub selector: BTreeMap<String, String>,
    /// Gateway API parents (namespace, name) whose TLSRoutes are served.
    pub parent_refs: Vec<(String, String)>,
    /// The fallback backend (`host:port`), if any.
    pub fallback: Option<String>,
    /// The fallback's CONNECT proxy for `X-Gardener-Destination` (`host:port`), if any.
    pub fallback_connect: Option<String>,
    /// The fallback's CONNECT proxy for `Reversed-VPN` (`host:port`), if any.
    pub fallback_connect_legacy: Option<String>,
    /// The PROXY header the fallback routes send, if any.
    pub fallback_proxy_protocol: Option<ProxyVersion>,
    /// The gateway's addresses inside every shoot's tunnel (`localAddresses`); none (tunnels
    /// off in the configuration): no tunnel routes.
    pub tunnel_local_addresses: Vec<IpAddr>,
    /// Routes added as written (`extraRoutes`, validated), before the rendered ones.
    pub extra_routes: Vec<RawRoute>,
}

impl Target {
    /// The target a controller configuration names.
    pub fn from_config(config: &ControllerConfig) -> Target {
        Target {
            selector: config.selector.clone(),
            parent_refs: config.parent_refs.clone(),
            fallback: config.fallback.as_ref().map(|f| f.to_string()),
            fallback_connect: config.fallback_connect.as_ref().map(|f| f.to_string()),
            fallback_connect_legacy: config
                .fallback_connect_legacy
                .as_ref()
                .map(|f| f.to_string()),
            fallback_proxy_protocol: config.fallback_proxy_protocol,
            tunnel_local_addresses: config
                .tunnel
                .as_ref()
                .map(|t| t.local_addresses.clone())
                .unwrap_or_default(),
            extra_routes: config.extra_routes.clone(),
        }
    }

    /// Whether a CONNECT no route holds reaches the fallback (by a listener's default route).
    pub fn connect_fallback(&self) -> Option<&str> {
        self.fallback_connect
            .as_deref()
            .or(self.fallback_connect_legacy.as_deref())
    }

    /// Whether this gateway serves `gateway` (Istio's rule: the selector is a subset of the
    /// workload's labels).
    pub fn serves(&self, gateway: &Gateway) -> bool {
        gateway
            .selector
            .iter()
            .all(|(k, v)| self.selector.get(k) == Some(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_controllers_own_route_names_are_reserved_and_shoots_renamed_off_them() {
        for name in [
            FALLBACK_ROUTE,
            FALLBACK_CONNECT_ROUTE,
            FALLBACK_CONNECT_LEGACY_ROUTE,
            "fallback-anything-later",
        ] {
            assert!(is_reserved(name), "{name}");
            let renamed = shoot_route_name(name.to_owned());
            assert_eq!(renamed, format!("ns.{name}"));
            assert!(!is_reserved(&renamed), "{renamed}");
        }
        for name in [
            "fallbacks",
            "shoot--p--fallback",
            "ns.fallback",
            "fallback_x",
        ] {
            assert!(!is_reserved(name), "{name}");
            assert_eq!(shoot_route_name(name.to_owned()), name);
        }
    }
}
