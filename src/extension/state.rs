//! What the controller has established, read by the webhook server: per shoot namespace, the
//! types whose configuration exists and what their webhooks need to mutate, and the
//! addresses of the namespace's kube-apiserver pods (once known, the only callers a path of
//! that namespace admits; while none are known, reviews are admitted unchanged). Written by the controller's tasks, read lock-free on every review.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;

use super::role::ExtensionType;

/// One shoot namespace, as the controller last reconciled it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shoot {
    /// Types whose configuration for this shoot exists (its ManagedResource written).
    pub configured: BTreeSet<ExtensionType>,
    /// Types whose namespace label (`extensions.gardener.cloud/<type>`) is `true`.
    pub labelled: BTreeSet<ExtensionType>,
    /// What the node role's webhook writes (when `trellis-node` is configured).
    pub node: Option<NodeShoot>,
}

impl Shoot {
    /// Whether the webhooks of `t` may mutate this shoot's objects: its configuration exists
    /// and the namespace carries the type's label.
    pub fn enabled(&self, t: ExtensionType) -> bool {
        self.configured.contains(&t) && self.labelled.contains(&t)
    }
}

/// What the `apiserver-proxy` webhook writes into a shoot's DaemonSet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeShoot {
    /// The image of the `trellis node` container.
    pub image: String,
    /// The ConfigMap (in the shoot's `kube-system`) holding `node.yaml`.
    pub config_map: String,
    /// A digest of the ConfigMap's data, put on the pod template so that a changed config
    /// rolls the DaemonSet.
    pub config_digest: String,
}

/// The shared state: shoots and callers, each swapped whole on a change.
#[derive(Debug, Default)]
pub struct State {
    shoots: ArcSwap<BTreeMap<String, Arc<Shoot>>>,
    callers: ArcSwap<BTreeMap<String, BTreeSet<IpAddr>>>,
}

impl State {
    /// An empty state: every webhook admits unchanged, no caller is known.
    pub fn new() -> Arc<State> {
        Arc::new(State::default())
    }

    /// The shoot of `namespace`, if the controller knows it.
    pub fn shoot(&self, namespace: &str) -> Option<Arc<Shoot>> {
        self.shoots.load().get(namespace).cloned()
    }

    /// Changes the shoot of `namespace` (`f` gets the current one or a default; an entry
    /// left with nothing configured or labelled is removed).
    pub fn update_shoot(&self, namespace: &str, f: impl Fn(&mut Shoot)) {
        self.shoots.rcu(|all| {
            let mut all = BTreeMap::clone(all);
            let mut shoot = all
                .get(namespace)
                .map(|s| Shoot::clone(s))
                .unwrap_or_default();
            f(&mut shoot);
            if shoot.configured.is_empty() && shoot.labelled.is_empty() {
                all.remove(namespace);
            } else {
                all.insert(namespace.to_owned(), Arc::new(shoot));
            }
            all
        });
    }

    /// Whether `ip` is the address of a kube-apiserver pod of `namespace`.
    pub fn caller_allowed(&self, namespace: &str, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.callers
            .load()
            .get(namespace)
            .is_some_and(|ips| ips.contains(&ip))
    }

    /// Whether any kube-apiserver pod address of `namespace` is known (`false` before the
    /// Pod watch has listed, or while the namespace's pods have no address yet).
    pub fn callers_known(&self, namespace: &str) -> bool {
        self.callers
            .load()
            .get(namespace)
            .is_some_and(|ips| !ips.is_empty())
    }

    /// What is known of `ip` as a caller of `namespace`, from one snapshot.
    pub fn caller(&self, namespace: &str, ip: IpAddr) -> Caller {
        let ip = canonical(ip);
        match self.callers.load().get(namespace) {
            Some(ips) if ips.contains(&ip) => Caller::Allowed,
            Some(ips) if !ips.is_empty() => Caller::Denied,
            _ => Caller::Unknown,
        }
    }

    /// Replaces the kube-apiserver pod addresses of `namespace` (empty: none).
    pub fn set_callers(&self, namespace: &str, ips: BTreeSet<IpAddr>) {
        let ips: BTreeSet<IpAddr> = ips.into_iter().map(canonical).collect();
        self.callers.rcu(|all| {
            let mut all = BTreeMap::clone(all);
            if ips.is_empty() {
                all.remove(namespace);
            } else {
                all.insert(namespace.to_owned(), ips.clone());
            }
            all
        });
    }
}

/// What [`State::caller`] knows of a caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    /// An address of one of the namespace's kube-apiserver pods.
    Allowed,
    /// The namespace's kube-apiserver pods are known and this is none of them.
    Denied,
    /// No kube-apiserver pod address of the namespace is known (yet).
    Unknown,
}

/// An IPv4 address as itself, also when it arrives as `::ffff:a.b.c.d` on a dual-stack socket.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enabled_needs_both_config_and_label() {
        let state = State::new();
        state.update_shoot("ns", |s| {
            s.configured.insert(ExtensionType::Node);
        });
        assert!(
            !state
                .shoot("ns")
                .is_some_and(|s| s.enabled(ExtensionType::Node))
        );
        state.update_shoot("ns", |s| {
            s.labelled.insert(ExtensionType::Node);
        });
        assert!(
            state
                .shoot("ns")
                .is_some_and(|s| s.enabled(ExtensionType::Node))
        );
        state.update_shoot("ns", |s| {
            s.configured.clear();
            s.labelled.clear();
        });
        assert!(state.shoot("ns").is_none());
    }

    #[test]
    fn callers_are_per_namespace_and_mapped_v4_counts_as_v4() {
        let state = State::new();
        let ip: IpAddr = "10.1.2.3".parse().unwrap_or(IpAddr::from([0, 0, 0, 0]));
        state.set_callers("a", BTreeSet::from([ip]));
        assert!(state.caller_allowed("a", ip));
        assert!(state.caller_allowed("a", "::ffff:10.1.2.3".parse().unwrap_or(ip)));
        assert!(!state.caller_allowed("b", ip));
        assert!(!state.caller_allowed("a", "10.1.2.4".parse().unwrap_or(ip)));
        assert_eq!(state.caller("a", ip), Caller::Allowed);
        assert_eq!(
            state.caller("a", "10.1.2.4".parse().unwrap_or(ip)),
            Caller::Denied
        );
        assert_eq!(state.caller("b", ip), Caller::Unknown);
        assert!(state.callers_known("a") && !state.callers_known("b"));
        state.set_callers("a", BTreeSet::new());
        assert!(!state.caller_allowed("a", ip));
        assert!(!state.callers_known("a"));
        assert_eq!(state.caller("a", ip), Caller::Unknown);
    }
}
