//! Source allow-lists from RBAC EnvoyFilters (what the ACL extension writes) -> routes'
//! `allowedSourceRanges`. Pure, no I/O.
//!
//! Envoy's rule for one RBAC filter: with action `ALLOW` a request passes when some policy
//! matches it (one of its permissions and one of its principals); with `DENY` when none
//! does. Several filters on one path must all pass. Translated per route and per path:
//! - **SNI**: a network filter patched into the filter chain that serves server name `h`
//!   (`match.listener.filterChain.sni`) restricts the route holding `h`.
//! - **CONNECT**: an HTTP filter on Gardener's listener `0.0.0.0_8132` (header
//!   `Reversed-VPN`) or `0.0.0.0_8443` (`X-Gardener-Destination`) is evaluated with each of a
//!   route's `destinations` as that header's value (`header` permissions with
//!   `string_match.contains`, also under `not_rule`; `any`).
//! - Principals `remote_ip` and `source_ip` are the client address as trellis sees it (the
//!   PROXY source when the peer is trusted, else the peer); `direct_remote_ip` and anything
//!   else cannot be matched by a route. A principal's network with host bits set
//!   (`10.1.2.3/16`) is its network (`10.1.0.0/16`), as Envoy reads it; the report names
//!   each one (`normalised`) of a filter that applies to the gateway.
//!
//! A route serves every path its keys are on, but has one list: it gets the intersection of
//! what its paths admit. Where that is not exactly what Envoy enforces (a principal or
//! permission trellis cannot match, paths that admit different clients, an action other
//! than `ALLOW`/`DENY`), the result is narrowed, never widened — what cannot be matched
//! admits nobody in an `ALLOW` filter and everybody is denied by it in a `DENY` filter — and
//! the route is reported as `acl_unsupported`. A route left with no admitted client gets
//! [`ADMIT_NONE`] (an empty list is not a valid table). PROXY destinations (GEP-08) share the
//! kube-apiserver route and its list.
//!
//! Traffic trellis hands to the fallback (L7 shoots, server names and CONNECT keys no route
//! holds) is Envoy's to restrict. With the fallback routes' `sendProxyProtocol` Envoy sees
//! the client and applies its own filters: nothing is done here. Without it Envoy sees
//! trellis' own address, which the extension always admits (the seed's pod and node
//! networks): the L7 shoots' CONNECT keys a filter restricts are claimed by
//! [`CLOSED_ROUTE`], which admits nobody (else the CONNECT fallback would take them
//! unrestricted), and such server names are reported as `acl_unsupported` (still open).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::model::{EnvoyFilter, Permission, Principal, Rbac, RbacAt, Snapshot};
use super::report::{Reason, Report};
use super::target::Target;
use crate::config::routes::{RawBackend, RawRoute};
use crate::route::Net;

/// The route that claims CONNECT keys a filter restricts which would otherwise reach the
/// fallback from trellis' own address: it admits nobody. Added after route names are settled,
/// so its name must be reserved ([`super::target::is_reserved`]): no shoot's route has it.
pub const CLOSED_ROUTE: &str = "fallback-closed";

/// The name of the route that takes a restricted server name `host` no route holds to the
/// fallback: `fallback-acl-<host>` (`*` spelt `_`, which no DNS name has), within the 253
/// characters a route name may have.
pub fn acl_route_name(host: &str) -> String {
    let name = format!("fallback-acl-{}", host.replace('*', "_"));
    if name.len() <= 253 {
        return name;
    }
    // FNV-1a: stable across runs and builds, unlike the standard library's hasher.
    let hash = host.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let mut cut = 253 - 17;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}-{hash:016x}", &name[..cut])
}

/// What a route that admits no client gets: the unspecified addresses, which no TCP client
/// has.
pub const ADMIT_NONE: [&str; 2] = ["0.0.0.0/32", "::/128"];

/// Gardener's CONNECT listeners as Istio names them, with the header each routes by.
const CONNECT_LISTENERS: [(&str, &str, &str); 2] = [
    ("0.0.0.0_8132", "reversed-vpn", "Reversed-VPN"),
    (
        "0.0.0.0_8443",
        "x-gardener-destination",
        "X-Gardener-Destination",
    ),
];

/// A set of client addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sources {
    /// Every client.
    All,
    /// Only clients in these networks (none contains another; may be empty).
    Only(BTreeSet<Net>),
}

/// A network as (family, bits, prefix): IPv4 in the top 32 bits, so one mask rule serves both.
fn bits(n: &Net) -> (bool, u128, u8) {
    match n.addr() {
        IpAddr::V4(a) => (true, u128::from(u32::from(a)) << 96, n.prefix()),
        IpAddr::V6(a) => (false, u128::from(a), n.prefix()),
    }
}

/// The network of [`bits`]' form, or `None` for a prefix longer than the family.
fn from_bits(v4: bool, value: u128, prefix: u8) -> Option<Net> {
    let addr = if v4 {
        IpAddr::V4(Ipv4Addr::from(u32::try_from(value >> 96).unwrap_or(0)))
    } else {
        IpAddr::V6(Ipv6Addr::from(value))
    };
    Net::new(addr, prefix).ok()
}

fn mask(prefix: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0)
}

/// Whether network `a` contains network `b`.
fn contains(a: &Net, b: &Net) -> bool {
    a.contains_net(b)
}

impl Sources {
    /// The clients in any of `nets`.
    pub fn of(nets: impl IntoIterator<Item = Net>) -> Sources {
        let nets: BTreeSet<Net> = nets.into_iter().collect();
        let kept: BTreeSet<Net> = nets
            .iter()
            .filter(|n| !nets.iter().any(|m| m != *n && contains(m, n)))
            .copied()
            .collect();
        if [Net::ANY_V4, Net::ANY_V6].iter().all(|e| kept.contains(e)) {
            Sources::All
        } else {
            Sources::Only(kept)
        }
    }

    /// The clients in both.
    pub fn intersect(&self, other: &Sources) -> Sources {
        match (self, other) {
            (Sources::All, x) | (x, Sources::All) => x.clone(),
            (Sources::Only(a), Sources::Only(b)) => Sources::of(a.iter().flat_map(|x| {
                b.iter().filter_map(move |y| {
                    if contains(x, y) {
                        Some(*y)
                    } else if contains(y, x) {
                        Some(*x)
                    } else {
                        None
                    }
                })
            })),
        }
    }

    /// The clients in none of `nets`.
    pub fn complement(nets: &BTreeSet<Net>) -> Sources {
        fn walk(v4: bool, value: u128, prefix: u8, nets: &[(u128, u8)], out: &mut Vec<Net>) {
            let here = (value, prefix);
            if nets
                .iter()
                .any(|&(v, p)| p <= here.1 && here.0 & mask(p) == v)
            {
                return;
            }
            let width = if v4 { 32 } else { 128 };
            if prefix == width
                || !nets
                    .iter()
                    .any(|&(v, p)| p > prefix && v & mask(prefix) == value)
            {
                // Within the family: the walk stops at the address length.
                out.extend(from_bits(v4, value, prefix));
                return;
            }
            let bit = 1u128 << (127 - u32::from(prefix));
            walk(v4, value, prefix + 1, nets, out);
            walk(v4, value | bit, prefix + 1, nets, out);
        }
        let mut out = Vec::new();
        for v4 in [true, false] {
            let family: Vec<(u128, u8)> = nets
                .iter()
                .map(bits)
                .filter(|(f, _, _)| *f == v4)
                .map(|(_, v, p)| (v, p))
                .collect();
            walk(v4, 0, 0, &family, &mut out);
        }
        Sources::of(out)
    }

    /// The list a route carries: `None` for every client.
    pub fn to_list(&self) -> Option<Vec<String>> {
        match self {
            Sources::All => None,
            Sources::Only(nets) if nets.is_empty() => {
                Some(ADMIT_NONE.iter().map(|s| (*s).to_owned()).collect())
            }
            Sources::Only(nets) => Some(nets.iter().map(Net::to_string).collect()),
        }
    }
}

/// Which clients one RBAC filter admits to a request — on a CONNECT listener, one whose
/// `header` is `value`; on an SNI filter chain (`None`), any — and why that is not exact
/// (empty when it is).
pub fn admitted(rbac: &Rbac, request: Option<(&str, &str)>) -> (Sources, Vec<String>) {
    let mut inexact = Vec::new();
    let deny = match rbac.action.as_str() {
        "ALLOW" => false,
        "DENY" => true,
        other => {
            inexact.push(format!("action {other:?} is not translated"));
            return (Sources::Only(BTreeSet::new()), inexact);
        }
    };
    let mut nets = BTreeSet::new();
    let mut everyone = false;
    for policy in &rbac.policies {
        let mut matched = Some(false);
        for p in &policy.permissions {
            let m = match (p, request) {
                (Permission::Any, _) => Some(true),
                (
                    Permission::HeaderContains {
                        header,
                        value,
                        negated,
                    },
                    Some((h, v)),
                ) => Some((header == h && v.contains(value.as_str())) != *negated),
                _ => None,
            };
            matched = match (matched, m) {
                (Some(true), _) | (_, Some(true)) => Some(true),
                (Some(false), Some(false)) => Some(false),
                _ => None,
            };
        }
        let matched = match matched {
            Some(m) => m,
            None => {
                inexact.push(format!(
                    "policy {:?} has a permission trellis cannot match",
                    policy.name
                ));
                // Narrow: an ALLOW policy that may not match admits nobody; a DENY one
                // that may match denies.
                deny
            }
        };
        if !matched {
            continue;
        }
        for p in &policy.principals {
            match p {
                Principal::Client(net) => {
                    nets.insert(*net);
                }
                Principal::Peer(net) => {
                    inexact.push(format!(
                        "policy {:?}: direct_remote_ip {net} (the physical peer) cannot be matched",
                        policy.name
                    ));
                    everyone |= deny;
                }
                Principal::Other => {
                    inexact.push(format!(
                        "policy {:?} has a principal trellis cannot match",
                        policy.name
                    ));
                    everyone |= deny;
                }
            }
        }
    }
    let sources = match (deny, everyone) {
        (false, _) => Sources::of(nets),
        (true, true) => Sources::Only(BTreeSet::new()),
        (true, false) => Sources::complement(&nets),
    };
    (sources, inexact)
}

/// What one path of a route admits, and why that is not exact.
struct Path {
    label: &'static str,
    sources: Sources,
    inexact: Vec<String>,
}

impl Path {
    fn new(label: &'static str) -> Path {
        Path {
            label,
            sources: Sources::All,
            inexact: Vec::new(),
        }
    }

    fn add(&mut self, filter: &EnvoyFilter, (sources, inexact): (Sources, Vec<String>)) {
        self.sources = self.sources.intersect(&sources);
        self.inexact.extend(
            inexact
                .into_iter()
                .map(|why| format!("EnvoyFilter {}: {why}", filter.meta.key())),
        );
    }
}

/// The inner dot-separated labels of a CONNECT key (`outbound|443||svc.<ns>.svc.cluster.local`
/// -> `<ns>`, `svc`, `cluster`): a `contains: ".<label>."` matches exactly these.
fn inner_labels(key: &str) -> impl Iterator<Item = &str> {
    let parts: Vec<&str> = key.split('.').collect();
    let n = parts.len();
    parts.into_iter().skip(1).take(n.saturating_sub(2))
}

/// Sets `allowed_source_ranges` on `routes` (sorted by name) from the RBAC EnvoyFilters
/// that apply to `target`. `fallback_keys` are the CONNECT keys no route holds that reach
/// the fallback's CONNECT proxy (the L7 shoots'): without a PROXY header to the fallback,
/// those a filter restricts are claimed by [`CLOSED_ROUTE`].
pub fn apply(
    snapshot: &Snapshot,
    target: &Target,
    fallback_keys: &BTreeSet<String>,
    routes: &mut Vec<RawRoute>,
    report: &mut Report,
) {
    let filters: Vec<&EnvoyFilter> = snapshot
        .envoy_filters
        .iter()
        .filter(|f| !f.rbac.is_empty())
        // Without a workload selector a filter applies to every workload of its namespace,
        // which may be this gateway's: counted.
        .filter(|f| {
            f.workload_selector
                .as_ref()
                .is_none_or(|s| s.iter().all(|(k, v)| target.selector.get(k) == Some(v)))
        })
        .collect();
    if filters.is_empty() {
        return;
    }
    for f in &filters {
        report.normalised(&format!("EnvoyFilter {}", f.meta.key()), &f.host_bits);
    }
    // Envoy applies its own filters when it is told the client.
    let enforced_by_fallback = target.fallback_proxy_protocol.is_some();
    // Routes added for restricted server names no route holds, and those of them dropped
    // again (see below).
    let mut added = BTreeSet::new();
    let mut dropped = BTreeSet::new();
    if !enforced_by_fallback && let Some(address) = &target.fallback {
        added = restricted_names_to_fallback(snapshot, target, &filters, address, routes);
    }
    // Evaluated as one more route; left with the keys it must close.
    let closing = match target.connect_fallback() {
        Some(address) if !enforced_by_fallback && !fallback_keys.is_empty() => {
            routes.push(RawRoute {
                name: CLOSED_ROUTE.to_owned(),
                destinations: fallback_keys.iter().cloned().collect(),
                backends: vec![RawBackend {
                    address: address.to_owned(),
                    zone: None,
                }],
                allowed_source_ranges: Some(ADMIT_NONE.map(str::to_owned).to_vec()),
                ..RawRoute::default()
            });
            Some(routes.len() - 1)
        }
        _ => None,
    };
    let mut by_sni: BTreeMap<&str, usize> = BTreeMap::new();
    let mut by_label: BTreeMap<&str, BTreeSet<usize>> = BTreeMap::new();
    for (i, r) in routes.iter().enumerate() {
        for h in &r.sni {
            by_sni.insert(h.as_str(), i);
        }
        for d in &r.destinations {
            for label in inner_labels(d) {
                by_label.entry(label).or_default().insert(i);
            }
        }
    }
    // Per route: the SNI path and each CONNECT listener's.
    let mut paths: BTreeMap<usize, [Path; 3]> = BTreeMap::new();
    let fresh = || {
        [
            Path::new("SNI"),
            Path::new(CONNECT_LISTENERS[0].2),
            Path::new(CONNECT_LISTENERS[1].2),
        ]
    };
    let mut unenforced: Vec<(String, String)> = Vec::new();
    let mut closed: BTreeSet<String> = BTreeSet::new();
    for f in &filters {
        let object = format!("EnvoyFilter {}", f.meta.key());
        for rbac in &f.rbac {
            match &rbac.at {
                RbacAt::Sni(h) => {
                    let h = h.trim_end_matches('.').to_ascii_lowercase();
                    // No route: Envoy enforces it (PROXY header), or nothing routes the name
                    // at all (no fallback).
                    if let Some(&i) = by_sni.get(h.as_str()) {
                        paths.entry(i).or_insert_with(fresh)[0].add(f, admitted(rbac, None));
                    }
                }
                RbacAt::Listener(name) => {
                    let Some(slot) = CONNECT_LISTENERS.iter().position(|l| l.0 == name) else {
                        unenforced.push((
                            object.clone(),
                            format!("an RBAC filter on listener {name:?}, which trellis does not serve, is not translated"),
                        ));
                        continue;
                    };
                    let header = CONNECT_LISTENERS[slot].1;
                    // Routes whose keys contain none of the filter's substrings all get the
                    // same answer: evaluate it once, and for each route only when it
                    // restricts.
                    let mut values = Vec::new();
                    for p in rbac.policies.iter().flat_map(|p| &p.permissions) {
                        if let Permission::HeaderContains { header: h, value, .. } = p
                            && h == header
                        {
                            values.push(value.as_str());
                        }
                    }
                    let neutral = admitted(rbac, Some((header, "")));
                    let candidates: BTreeSet<usize> = if neutral.0 == Sources::All
                        && neutral.1.is_empty()
                    {
                        let mut c = BTreeSet::new();
                        for v in &values {
                            match v.strip_prefix('.').and_then(|v| v.strip_suffix('.')) {
                                Some(label) if !label.contains('.') && !label.is_empty() => {
                                    c.extend(by_label.get(label).into_iter().flatten());
                                }
                                _ => c.extend(0..routes.len()),
                            }
                        }
                        c
                    } else {
                        (0..routes.len()).collect()
                    };
                    for i in candidates {
                        if routes[i].destinations.is_empty() {
                            continue;
                        }
                        let fallback = closing == Some(i);
                        for d in &routes[i].destinations {
                            let result = admitted(rbac, Some((header, d)));
                            if fallback {
                                if result.0 != Sources::All || !result.1.is_empty() {
                                    closed.insert(d.clone());
                                    unenforced.push((object.clone(), format!(
                                        "CONNECT key {d:?} would go to the fallback, which sees trellis' address: closed"
                                    )));
                                }
                                continue;
                            }
                            paths.entry(i).or_insert_with(fresh)[1 + slot].add(f, result);
                        }
                    }
                }
                RbacAt::Other => unenforced.push((
                    object.clone(),
                    "an RBAC filter patched elsewhere than an SNI filter chain or a CONNECT listener is not translated".to_owned(),
                )),
            }
        }
    }
    // The closing route is the last: taken out, the indexes in `paths` still hold.
    let closing = closing.map(|i| routes.remove(i));
    for (object, detail) in unenforced {
        report.skip(Reason::AclUnsupported, object, detail);
    }
    for (i, paths) in paths {
        let route = &mut routes[i];
        let served = [
            !route.sni.is_empty(),
            !route.destinations.is_empty(),
            !route.destinations.is_empty(),
        ];
        let mut sources = Sources::All;
        let mut inexact = Vec::new();
        for (path, _) in paths.iter().zip(served).filter(|(_, s)| *s) {
            sources = sources.intersect(&path.sources);
            inexact.extend(path.inexact.iter().cloned());
        }
        let served_paths: Vec<&Path> = paths
            .iter()
            .zip(served)
            .filter(|(_, s)| *s)
            .map(|(p, _)| p)
            .collect();
        for p in &served_paths {
            if p.sources != sources {
                let list = |s: &Sources| match s {
                    Sources::All => "every client".to_owned(),
                    Sources::Only(nets) if nets.is_empty() => "no client".to_owned(),
                    Sources::Only(nets) => nets
                        .iter()
                        .map(Net::to_string)
                        .collect::<Vec<_>>()
                        .join(", "),
                };
                inexact.push(format!(
                    "{} admits {}, the route {}",
                    p.label,
                    list(&p.sources),
                    list(&sources)
                ));
            }
        }
        if added.contains(&route.name) && !inexact.is_empty() {
            // A rule trellis cannot match at L4 (e.g. on the HTTP host, as the extension's
            // filters for the shared observability wildcard have) would narrow the route to
            // nobody, closing every name of that filter chain for every shoot: left open to
            // the fallback instead, and reported.
            report.skip(
                Reason::AclUnsupported,
                format!("route {}", route.name),
                format!(
                    "server names {} left to the fallback, which sees trellis' address: not enforced ({})",
                    route.sni.join(", "),
                    inexact.join("; ")
                ),
            );
            dropped.insert(route.name.clone());
            continue;
        }
        route.allowed_source_ranges = sources.to_list();
        if !inexact.is_empty() {
            report.skip(
                Reason::AclUnsupported,
                format!("route {}", route.name),
                format!("narrowed: {}", inexact.join("; ")),
            );
        }
    }
    if let Some(mut route) = closing
        && !closed.is_empty()
    {
        route.destinations = closed.into_iter().collect();
        routes.push(route);
    }
    routes.retain(|r| !dropped.contains(&r.name));
    routes.sort_by(|a, b| a.name.cmp(&b.name));
}

/// Adds, for every server name a filter restricts that no route holds, a route to the
/// fallback `address` (see the module documentation), appended to `routes`; returns their
/// names.
fn restricted_names_to_fallback(
    snapshot: &Snapshot,
    target: &Target,
    filters: &[&EnvoyFilter],
    address: &str,
    routes: &mut Vec<RawRoute>,
) -> BTreeSet<String> {
    let mut held: BTreeSet<String> = routes.iter().flat_map(|r| r.sni.iter().cloned()).collect();
    let mut added: BTreeMap<String, RawRoute> = BTreeMap::new();
    for f in filters {
        for rbac in &f.rbac {
            let RbacAt::Sni(h) = &rbac.at else { continue };
            let h = h.trim_end_matches('.').to_ascii_lowercase();
            if held.contains(&h) {
                continue;
            }
            // Every name of a selected Gateway server that lists `h`: Envoy's filter chain
            // for `h` serves them all.
            let mut names: BTreeSet<String> = snapshot
                .gateways
                .iter()
                .filter(|g| target.serves(g))
                .flat_map(|g| &g.servers)
                .filter(|s| s.hosts.contains(&h))
                .flat_map(|s| s.hosts.iter().cloned())
                .filter(|n| !held.contains(n))
                .collect();
            names.insert(h.clone());
            held.extend(names.iter().cloned());
            let name = acl_route_name(&h);
            added.insert(
                name.clone(),
                RawRoute {
                    name,
                    sni: names.into_iter().collect(),
                    backends: vec![RawBackend {
                        address: address.to_owned(),
                        zone: None,
                    }],
                    ..RawRoute::default()
                },
            );
        }
    }
    let names = added.keys().cloned().collect();
    routes.extend(added.into_values());
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::model::{Meta, RbacPolicy};

    fn net(s: &str) -> Net {
        let (a, p) = s.split_once('/').unwrap();
        Net::new(a.parse().unwrap(), p.parse().unwrap()).unwrap()
    }

    fn client(nets: &[&str]) -> Vec<Principal> {
        nets.iter().map(|n| Principal::Client(net(n))).collect()
    }

    fn header(value: &str, negated: bool) -> Permission {
        Permission::HeaderContains {
            header: "reversed-vpn".into(),
            value: value.into(),
            negated,
        }
    }

    fn policy(name: &str, permissions: Vec<Permission>, principals: Vec<Principal>) -> RbacPolicy {
        RbacPolicy {
            name: name.into(),
            permissions,
            principals,
        }
    }

    fn filter(name: &str, rbac: Rbac) -> EnvoyFilter {
        EnvoyFilter {
            meta: Meta {
                name: name.into(),
                namespace: "istio-ingress".into(),
                ..Meta::default()
            },
            workload_selector: Some(
                crate::config::controller::ControllerConfig::default().selector,
            ),
            rbac: vec![rbac],
            host_bits: Vec::new(),
        }
    }

    /// What the extension writes for the API server: one policy, any permission.
    fn api(ns: &str, action: &str, principals: Vec<Principal>) -> EnvoyFilter {
        filter(
            &format!("acl-api-{ns}"),
            Rbac {
                at: RbacAt::Sni(format!("api.{ns}.example.com")),
                action: action.into(),
                policies: vec![policy("acl-api", vec![Permission::Any], principals)],
            },
        )
    }

    /// What the extension writes for a CONNECT listener: the shoot's policy and its inverse.
    fn connect(ns: &str, listener: &str, principals: Vec<Principal>) -> EnvoyFilter {
        let key = format!(".{ns}.");
        let header = |negated| match listener {
            "0.0.0.0_8443" => Permission::HeaderContains {
                header: "x-gardener-destination".into(),
                value: key.clone(),
                negated,
            },
            _ => self::tests::header(&key, negated),
        };
        filter(
            &format!("acl-{listener}-{ns}"),
            Rbac {
                at: RbacAt::Listener(listener.into()),
                action: "ALLOW".into(),
                policies: vec![
                    policy(ns, vec![header(false)], principals),
                    policy(
                        &format!("{ns}-inverse"),
                        vec![header(true)],
                        client(&["0.0.0.0/0", "::/0"]),
                    ),
                ],
            },
        )
    }

    fn both_connect(ns: &str, principals: Vec<Principal>) -> [EnvoyFilter; 2] {
        [
            connect(ns, "0.0.0.0_8132", principals.clone()),
            connect(ns, "0.0.0.0_8443", principals),
        ]
    }

    fn route(name: &str, sni: &[&str], destinations: &[&str]) -> RawRoute {
        RawRoute {
            name: name.into(),
            sni: sni.iter().map(|s| (*s).to_owned()).collect(),
            destinations: destinations.iter().map(|s| (*s).to_owned()).collect(),
            backends: vec![RawBackend {
                address: "10.0.0.1:443".into(),
                zone: None,
            }],
            ..RawRoute::default()
        }
    }

    /// A shoot's two routes as translation renders them.
    fn shoot(ns: &str) -> [RawRoute; 2] {
        [
            route(
                ns,
                &[
                    &format!("api.{ns}.example.com"),
                    &format!("api.{ns}.internal"),
                ],
                &[&format!(
                    "outbound|443||kube-apiserver.{ns}.svc.cluster.local"
                )],
            ),
            route(
                &format!("{ns}--vpn-seed-server"),
                &[],
                &[&format!(
                    "outbound|1194||vpn-seed-server.{ns}.svc.cluster.local"
                )],
            ),
        ]
    }

    fn target() -> Target {
        Target {
            selector: crate::config::controller::ControllerConfig::default().selector,
            parent_refs: Vec::new(),
            fallback: Some("envoy:443".into()),
            fallback_connect: Some("envoy:8443".into()),
            ..Target::default()
        }
    }

    fn run(filters: Vec<EnvoyFilter>, routes: &mut Vec<RawRoute>) -> Report {
        run_with(&target(), &BTreeSet::new(), filters, routes)
    }

    fn run_with(
        target: &Target,
        fallback_keys: &BTreeSet<String>,
        filters: Vec<EnvoyFilter>,
        routes: &mut Vec<RawRoute>,
    ) -> Report {
        let snapshot = Snapshot {
            envoy_filters: filters,
            ..Snapshot::default()
        };
        let mut report = Report::default();
        apply(&snapshot, target, fallback_keys, routes, &mut report);
        report
    }

    fn ranges(r: &RawRoute) -> Vec<&str> {
        r.allowed_source_ranges
            .iter()
            .flatten()
            .map(String::as_str)
            .collect()
    }

    fn skips(report: &Report) -> Vec<&str> {
        report.skips.iter().map(|s| s.object.as_str()).collect()
    }

    const LOCKED: [&str; 3] = ["203.0.113.0/24", "10.250.0.0/16", "2001:db8::/32"];

    #[test]
    fn the_routes_added_here_have_reserved_names() {
        assert!(crate::controller::target::is_reserved(CLOSED_ROUTE));
    }

    #[test]
    fn an_allow_list_on_every_path_is_rendered_exactly_and_only_on_its_shoot() {
        let mut routes: Vec<RawRoute> = [shoot("shoot--a--locked"), shoot("shoot--a--open")]
            .into_iter()
            .flatten()
            .collect();
        let mut filters = vec![api("shoot--a--locked", "ALLOW", client(&LOCKED))];
        filters.extend(both_connect("shoot--a--locked", client(&LOCKED)));
        let report = run(filters, &mut routes);
        let sorted = ["10.250.0.0/16", "203.0.113.0/24", "2001:db8::/32"];
        assert_eq!(ranges(&routes[0]), sorted);
        assert_eq!(ranges(&routes[1]), sorted);
        // The neighbour passes the inverse policies: no list.
        assert!(routes[2].allowed_source_ranges.is_none());
        assert!(routes[3].allowed_source_ranges.is_none());
        assert!(report.skips.is_empty(), "{:?}", report.skips);
    }

    #[test]
    fn a_sni_filter_restricts_the_route_holding_that_name_case_insensitively() {
        let mut routes = shoot("shoot--a--b").to_vec();
        let mut f = api("shoot--a--b", "ALLOW", client(&["192.0.2.0/24"]));
        f.rbac[0].at = RbacAt::Sni("API.shoot--a--b.example.com.".into());
        let report = run(vec![f], &mut routes);
        assert_eq!(ranges(&routes[0]), ["192.0.2.0/24"]);
        // The VPN route is on no SNI path; the API route's CONNECT paths are open in Envoy.
        assert!(routes[1].allowed_source_ranges.is_none());
        assert_eq!(skips(&report), ["route shoot--a--b"]);
        assert!(
            report.skips[0]
                .detail
                .contains("Reversed-VPN admits every client")
        );
    }

    #[test]
    fn a_route_gets_the_intersection_of_its_paths_and_is_reported_when_they_differ() {
        let mut routes = shoot("shoot--a--b").to_vec();
        let mut filters = vec![api(
            "shoot--a--b",
            "ALLOW",
            client(&["10.0.0.0/8", "192.0.2.0/24"]),
        )];
        filters.extend(both_connect("shoot--a--b", client(&["10.1.0.0/16"])));
        let report = run(filters, &mut routes);
        assert_eq!(ranges(&routes[0]), ["10.1.0.0/16"]);
        assert_eq!(ranges(&routes[1]), ["10.1.0.0/16"]);
        assert_eq!(skips(&report), ["route shoot--a--b"]);
        assert_eq!(report.skipped.get(&Reason::AclUnsupported), Some(&1));
    }

    #[test]
    fn a_connect_filter_on_one_listener_only_narrows_the_other() {
        let mut routes = shoot("shoot--a--b").to_vec();
        let report = run(
            vec![connect(
                "shoot--a--b",
                "0.0.0.0_8132",
                client(&["192.0.2.0/24"]),
            )],
            &mut routes,
        );
        assert_eq!(ranges(&routes[1]), ["192.0.2.0/24"]);
        assert_eq!(
            skips(&report),
            ["route shoot--a--b", "route shoot--a--b--vpn-seed-server"]
        );
    }

    #[test]
    fn a_header_filter_matches_whole_labels_only() {
        // `.shoot--a--b.` must not restrict `shoot--a--b-c` (the extension's own reason for
        // the dots).
        let mut routes = shoot("shoot--a--b-c").to_vec();
        let report = run(
            both_connect("shoot--a--b", client(&["192.0.2.0/24"])).to_vec(),
            &mut routes,
        );
        assert!(routes.iter().all(|r| r.allowed_source_ranges.is_none()));
        assert!(report.skips.is_empty());
    }

    #[test]
    fn an_inverse_policy_that_admits_only_ipv4_restricts_every_other_shoot() {
        // Before the extension's commit 5bee91dd the inverse policy listed 0.0.0.0/0 only:
        // Envoy then denied IPv6 clients every other shoot's CONNECT keys.
        let mut routes: Vec<RawRoute> = [shoot("shoot--a--b"), shoot("shoot--a--b-c")]
            .into_iter()
            .flatten()
            .collect();
        let mut filters = both_connect("shoot--a--b", client(&["192.0.2.0/24"])).to_vec();
        for f in &mut filters {
            f.rbac[0].policies[1].principals = client(&["0.0.0.0/0"]);
        }
        run(filters, &mut routes);
        assert_eq!(ranges(&routes[1]), ["192.0.2.0/24"]);
        // `.shoot--a--b.` is not in `shoot--a--b-c`'s keys: the inverse policy decides.
        assert_eq!(ranges(&routes[2]), ["0.0.0.0/0"]);
        assert_eq!(ranges(&routes[3]), ["0.0.0.0/0"]);
    }

    #[test]
    fn direct_remote_ip_admits_nobody_and_is_reported() {
        let mut routes = shoot("shoot--a--b").to_vec();
        let mut principals = vec![Principal::Peer(net("192.0.2.0/24"))];
        principals.extend(client(&["10.250.0.0/16"]));
        let mut filters = vec![api("shoot--a--b", "ALLOW", principals.clone())];
        filters.extend(both_connect("shoot--a--b", principals));
        let report = run(filters, &mut routes);
        assert_eq!(ranges(&routes[0]), ["10.250.0.0/16"]);
        assert_eq!(ranges(&routes[1]), ["10.250.0.0/16"]);
        assert!(report.skips[0].detail.contains("direct_remote_ip"));
    }

    #[test]
    fn deny_admits_the_complement_and_unknown_principals_deny_everyone() {
        let (sources, inexact) = admitted(
            &api("x", "DENY", client(&["0.0.0.0/1", "::/0"])).rbac[0],
            None,
        );
        assert_eq!(sources, Sources::of([net("128.0.0.0/1")]));
        assert!(inexact.is_empty());
        let (sources, inexact) = admitted(&api("x", "DENY", vec![Principal::Other]).rbac[0], None);
        assert_eq!(sources, Sources::Only(BTreeSet::new()));
        assert_eq!(inexact.len(), 1);
    }

    #[test]
    fn the_complement_covers_exactly_what_the_networks_do_not() {
        let denied = Sources::of([net("10.0.0.0/8"), net("10.1.0.0/16"), net("2001:db8::/32")]);
        let Sources::Only(denied) = denied else {
            panic!()
        };
        let Sources::Only(admitted) = Sources::complement(&denied) else {
            panic!("not everyone is admitted")
        };
        // 8 IPv4 networks beside 10/8, 32 IPv6 ones beside 2001:db8::/32.
        assert_eq!(admitted.len(), 8 + 32);
        for ip in [
            "9.255.255.255",
            "11.0.0.0",
            "0.0.0.0",
            "255.255.255.255",
            "2001:db9::",
            "::1",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            let host = Net::new(ip, if ip.is_ipv4() { 32 } else { 128 }).unwrap();
            assert!(admitted.iter().any(|n| contains(n, &host)), "{ip}");
        }
        for ip in ["10.0.0.0", "10.255.255.255", "2001:db8:ffff::1"] {
            let ip: IpAddr = ip.parse().unwrap();
            let host = Net::new(ip, if ip.is_ipv4() { 32 } else { 128 }).unwrap();
            assert!(!admitted.iter().any(|n| contains(n, &host)), "{ip}");
        }
        assert_eq!(Sources::complement(&BTreeSet::new()), Sources::All);
    }

    #[test]
    fn a_route_admitting_nobody_gets_the_unspecified_addresses_and_loads() {
        let mut routes = shoot("shoot--a--b").to_vec();
        let mut filters = vec![api("shoot--a--b", "ALLOW", client(&["10.0.0.0/8"]))];
        filters.extend(both_connect("shoot--a--b", client(&["192.0.2.0/24"])));
        run(filters, &mut routes);
        assert_eq!(ranges(&routes[0]), ADMIT_NONE);
        let table = crate::controller::Table::new(routes);
        let json = crate::controller::to_json(&table);
        crate::config::routes::parse(
            std::path::Path::new("rendered.json"),
            json.as_bytes(),
            &crate::route::BackendRegistry::default(),
        )
        .unwrap_or_else(|e| panic!("{e}\n{json}"));
        // Nobody is inside: not a client address, not an IPv4-mapped one.
        let r = crate::route::SourceRanges::new(
            ADMIT_NONE.iter().map(|s| (net(s).addr(), net(s).prefix())),
        )
        .unwrap();
        for ip in ["1.2.3.4", "::ffff:1.2.3.4", "2001:db8::1", "127.0.0.1"] {
            assert!(!r.contains(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn filters_for_another_gateway_do_not_apply() {
        let mut routes = shoot("shoot--a--b").to_vec();
        let mut f = api("shoot--a--b", "ALLOW", client(&["192.0.2.0/24"]));
        f.workload_selector = Some(
            [("istio".to_owned(), "ingressgateway--zone--a".to_owned())]
                .into_iter()
                .collect(),
        );
        run(vec![f], &mut routes);
        assert!(routes[0].allowed_source_ranges.is_none());
    }

    #[test]
    fn restricted_connect_keys_are_closed_when_the_fallback_cannot_see_the_client() {
        let keys: BTreeSet<String> = [
            "outbound|443||kube-apiserver.shoot--a--l7.svc.cluster.local",
            "outbound|1194||vpn-seed-server.shoot--a--l7.svc.cluster.local",
            "outbound|443||kube-apiserver.shoot--a--open.svc.cluster.local",
        ]
        .map(str::to_owned)
        .into();
        let filters = both_connect("shoot--a--l7", client(&["192.0.2.0/24"])).to_vec();
        let mut routes = vec![route("a", &[], &[]), route("z", &[], &[])];
        let report = run_with(&target(), &keys, filters.clone(), &mut routes);
        let names: Vec<&str> = routes.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["a", CLOSED_ROUTE, "z"]);
        let closed = &routes[1];
        assert_eq!(
            closed.destinations,
            [
                "outbound|1194||vpn-seed-server.shoot--a--l7.svc.cluster.local",
                "outbound|443||kube-apiserver.shoot--a--l7.svc.cluster.local",
            ]
        );
        assert_eq!(ranges(closed), ADMIT_NONE);
        assert_eq!(closed.backends[0].address, "envoy:8443");
        assert_eq!(
            (&closed.send_proxy_protocol, closed.forward_connect),
            (&None, false)
        );
        assert_eq!(report.skipped.get(&Reason::AclUnsupported), Some(&4));

        // Envoy told the client: its filters hold, nothing is closed or reported.
        let proxied = Target {
            fallback_proxy_protocol: Some(crate::route::ProxyVersion::V2),
            ..target()
        };
        let mut routes = vec![route("a", &[], &[])];
        let report = run_with(&proxied, &keys, filters.clone(), &mut routes);
        assert_eq!(routes.len(), 1);
        assert!(report.skipped.is_empty(), "{:?}", report.skipped);
        // No CONNECT fallback: the keys are not routed at all.
        let no_connect = Target {
            fallback_connect: None,
            ..target()
        };
        let mut routes = vec![route("a", &[], &[])];
        run_with(&no_connect, &keys, filters.clone(), &mut routes);
        assert_eq!(routes.len(), 1);
        // Nothing restricted: no closing route.
        let open: BTreeSet<String> = keys
            .iter()
            .filter(|k| k.contains("open"))
            .cloned()
            .collect();
        let mut routes = vec![route("a", &[], &[])];
        run_with(&target(), &open, filters, &mut routes);
        assert_eq!(routes.len(), 1);
    }

    #[test]
    fn a_restricted_server_name_left_to_the_fallback_gets_a_route_with_the_list() {
        use crate::controller::model::{Gateway, Server};
        let ns = "shoot--a--l7";
        let filters = vec![api(ns, "ALLOW", client(&["192.0.2.0/24"]))];
        // The L7 shoot's Gateway server lists the filter's name and another one; a Gateway
        // of another ingress gateway lists a third, which stays out.
        let gateway = |selector: BTreeMap<String, String>, hosts: &[&str]| Gateway {
            meta: Meta {
                name: "kube-apiserver".into(),
                namespace: ns.into(),
                ..Meta::default()
            },
            selector,
            servers: vec![Server {
                port: 443,
                protocol: "HTTPS".into(),
                tls_mode: Some("OPTIONAL_MUTUAL".into()),
                hosts: hosts.iter().map(|h| (*h).to_owned()).collect(),
            }],
        };
        let zonal: BTreeMap<String, String> =
            [("istio".to_owned(), "ingressgateway--zone--z".to_owned())].into();
        let snapshot = Snapshot {
            envoy_filters: filters.clone(),
            gateways: vec![
                gateway(
                    target().selector,
                    &[
                        &format!("api.{ns}.example.com"),
                        &format!("api.{ns}.internal"),
                    ],
                ),
                gateway(
                    zonal,
                    &[&format!("api.{ns}.example.com"), "other.example.com"],
                ),
            ],
            ..Snapshot::default()
        };
        let mut routes = shoot("shoot--a--b").to_vec();
        let mut report = Report::default();
        apply(
            &snapshot,
            &target(),
            &BTreeSet::new(),
            &mut routes,
            &mut report,
        );
        assert!(report.skipped.is_empty(), "{:?}", report.skipped);
        let names: Vec<&str> = routes.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "fallback-acl-api.shoot--a--l7.example.com",
                "shoot--a--b",
                "shoot--a--b--vpn-seed-server"
            ]
        );
        let added = &routes[0];
        assert_eq!(
            added.sni,
            [
                format!("api.{ns}.example.com"),
                format!("api.{ns}.internal")
            ]
        );
        assert_eq!(ranges(added), ["192.0.2.0/24"]);
        assert_eq!(added.backends[0].address, "envoy:443");
        assert!(
            routes[1..]
                .iter()
                .all(|r| r.allowed_source_ranges.is_none())
        );
        // Envoy told the client enforces it itself: nothing added.
        let proxied = Target {
            fallback_proxy_protocol: Some(crate::route::ProxyVersion::V1),
            ..target()
        };
        let mut routes = shoot("shoot--a--b").to_vec();
        apply(
            &snapshot,
            &proxied,
            &BTreeSet::new(),
            &mut routes,
            &mut Report::default(),
        );
        assert_eq!(routes.len(), 2);
        // No fallback: the name is not routed at all.
        let none = Target {
            fallback: None,
            ..target()
        };
        let mut routes = shoot("shoot--a--b").to_vec();
        apply(
            &snapshot,
            &none,
            &BTreeSet::new(),
            &mut routes,
            &mut Report::default(),
        );
        assert_eq!(routes.len(), 2);
    }

    #[test]
    fn acl_route_names_are_valid_and_distinct() {
        assert_eq!(
            acl_route_name("*.x.example.com"),
            "fallback-acl-_.x.example.com"
        );
        assert_ne!(
            acl_route_name("*.x.example.com"),
            acl_route_name("wildcard.x.example.com")
        );
        let long = format!("{}.example.com", "a".repeat(240));
        let (a, b) = (acl_route_name(&long), acl_route_name(&format!("b{long}")));
        assert!(a.len() <= 253 && b.len() <= 253 && a != b, "{a} {b}");
    }
}
