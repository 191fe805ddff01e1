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
//!   else cannot be matched by a route.
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
//! Traffic a filter restricts that trellis hands to the fallback (L7 shoots, server names
//! no route holds) reaches Envoy from trellis' own address, which the extension always
//! admits (the seed's pod and node networks): such CONNECT keys are taken off the fallback
//! route (closed), such server names are reported as `acl_unsupported` (still open).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::model::{EnvoyFilter, Net, Permission, Principal, Rbac, RbacAt, Snapshot};
use super::translate::{FALLBACK_ROUTE, Reason, Report, RouteDoc, Target};

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
    match n.addr {
        IpAddr::V4(a) => (true, u128::from(u32::from(a)) << 96, n.prefix),
        IpAddr::V6(a) => (false, u128::from(a), n.prefix),
    }
}

fn from_bits(v4: bool, value: u128, prefix: u8) -> Net {
    // Bits below the prefix are zero: the value came from a masked network.
    let addr = if v4 {
        IpAddr::V4(Ipv4Addr::from(u32::try_from(value >> 96).unwrap_or(0)))
    } else {
        IpAddr::V6(Ipv6Addr::from(value))
    };
    Net { addr, prefix }
}

fn mask(prefix: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0)
}

/// Whether network `a` contains network `b`.
fn contains(a: &Net, b: &Net) -> bool {
    let ((fa, va, pa), (fb, vb, pb)) = (bits(a), bits(b));
    fa == fb && pa <= pb && vb & mask(pa) == va
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
        let everyone = [
            Net {
                addr: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                prefix: 0,
            },
            Net {
                addr: IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                prefix: 0,
            },
        ];
        if everyone.iter().all(|e| kept.contains(e)) {
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
                out.push(from_bits(v4, value, prefix));
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

/// Sets `allowed_source_ranges` on `routes` from the RBAC EnvoyFilters that apply to
/// `target`, and takes restricted CONNECT keys off the fallback route.
pub fn apply(snapshot: &Snapshot, target: &Target, routes: &mut [RouteDoc], report: &mut Report) {
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
    let mut closed: BTreeSet<(usize, String)> = BTreeSet::new();
    for f in &filters {
        let object = format!("EnvoyFilter {}", f.meta.key());
        for rbac in &f.rbac {
            match &rbac.at {
                RbacAt::Sni(h) => {
                    let h = h.trim_end_matches('.').to_ascii_lowercase();
                    match by_sni.get(h.as_str()) {
                        Some(&i) => paths.entry(i).or_insert_with(fresh)[0].add(f, admitted(rbac, None)),
                        None if target.fallback.is_some() => unenforced.push((
                            object.clone(),
                            format!(
                                "server name {h:?} is left to the fallback, which sees trellis' address: not enforced"
                            ),
                        )),
                        // Not routed at all: closed.
                        None => {}
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
                        let fallback = routes[i].name == FALLBACK_ROUTE;
                        for d in &routes[i].destinations {
                            let result = admitted(rbac, Some((header, d)));
                            if fallback {
                                if result.0 != Sources::All || !result.1.is_empty() {
                                    closed.insert((i, d.clone()));
                                    unenforced.push((object.clone(), format!(
                                        "CONNECT key {d:?} would go to the fallback, which sees trellis' address: not routed"
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
    for (i, key) in closed {
        routes[i].destinations.retain(|d| *d != key);
    }
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
        route.allowed_source_ranges = sources.to_list().unwrap_or_default();
        if !inexact.is_empty() {
            report.skip(
                Reason::AclUnsupported,
                format!("route {}", route.name),
                format!("narrowed: {}", inexact.join("; ")),
            );
        }
    }
}
