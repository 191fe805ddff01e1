//! Peer reconciliation: what a new routing table's tunnels do to a device's shoots.
//!
//! [`reconcile`] compares the shoots the device has now ([`Current`]) with the table's
//! tunnels and plans [`Changes`]: a route that is new, whose addresses changed, or any route
//! after the device's private key changed, gets a new shoot; every other route keeps its
//! shoot, its stack, its streams and the sessions of the peers it keeps, with peers the table
//! dropped removed (their streams end) and peers it added joined; a current shoot that is not
//! kept ends (`route_removed`). No other shoot is touched: a table change never resets an
//! unrelated tunnel. [`Changes::execute`] carries the plan out on the shoots. Sans-IO: no
//! clock read (execution takes `now`), no socket; what the shoots send goes through an
//! [`Io`].

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::device::{Keys, Maps, lock};
use super::shoot::{Io, Mode, Shoot};
use crate::route::{Net, Tunnel, WgKey};

/// What reconciliation reads of a shoot the device has now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Present {
    /// The gateway's addresses inside the shoot.
    pub(crate) addresses: Vec<IpAddr>,
    /// Its peers' public keys, in order.
    pub(crate) peers: Vec<WgKey>,
}

/// The device's shoots now, by route.
pub(crate) type Current = HashMap<Arc<str>, Present>;

/// What the device's `maps` hold now (each shoot locked in turn).
pub(crate) fn current(maps: &Maps) -> Current {
    maps.shoots
        .iter()
        .map(|(name, cell)| {
            let s = lock(cell);
            let present = Present {
                addresses: s.stack.addresses().to_vec(),
                peers: s.peers.iter().map(|p| p.key).collect(),
            };
            (name.clone(), present)
        })
        .collect()
}

/// What becomes of one of the table's tunnels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ShootChange {
    /// A new shoot whose peers are all new: the route is new, its addresses changed, or the
    /// device's key did.
    New,
    /// The current shoot stays, with its stack, its streams and the sessions of the peers it
    /// keeps (their `allowedIPs` follow the table).
    Keep {
        /// Peers that leave: their streams end.
        remove: Vec<WgKey>,
        /// Peers that join, with no session yet.
        add: Vec<WgKey>,
    },
}

/// A current shoot that ends: its streams end (`route_removed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ended {
    /// Its route.
    pub(crate) route: Arc<str>,
    /// The route left the table (rather than getting a new shoot): its metric series go.
    pub(crate) gone: bool,
}

/// The plan for one table change.
#[derive(Debug)]
pub(crate) struct Changes<'t> {
    /// The device's new private key, if it changed (every shoot is new then).
    pub(crate) rekey: Option<WgKey>,
    /// The table's tunnels, in its order, and what becomes of each.
    pub(crate) shoots: Vec<(Arc<str>, &'t Tunnel, ShootChange)>,
    /// Current shoots that end.
    pub(crate) ended: Vec<Ended>,
}

/// Plans the change from the device's shoots (`current`, under `keys`) to `wanted` (a table's
/// tunnels, one per route name) and, when it is `Some`, the private key `private`.
pub(crate) fn reconcile<'t>(
    current: &Current,
    keys: &Keys,
    wanted: &[(Arc<str>, &'t Tunnel)],
    private: Option<WgKey>,
) -> Changes<'t> {
    let rekey = private.filter(|k| k.0 != keys.secret.to_bytes());
    let shoots: Vec<(Arc<str>, &Tunnel, ShootChange)> = wanted
        .iter()
        .map(|(name, tunnel)| {
            let keep = current
                .get(name)
                .filter(|p| rekey.is_none() && p.addresses[..] == tunnel.local_addresses[..]);
            let change = match keep {
                None => ShootChange::New,
                Some(present) => ShootChange::Keep {
                    remove: present
                        .peers
                        .iter()
                        .copied()
                        .filter(|k| !tunnel.peers.iter().any(|tp| tp.public_key == *k))
                        .collect(),
                    add: tunnel
                        .peers
                        .iter()
                        .map(|tp| tp.public_key)
                        .filter(|k| !present.peers.contains(k))
                        .collect(),
                },
            };
            (name.clone(), *tunnel, change)
        })
        .collect();
    let ended = current
        .keys()
        .filter(|name| {
            !shoots
                .iter()
                .any(|(n, _, c)| n == *name && matches!(c, ShootChange::Keep { .. }))
        })
        .map(|name| Ended {
            route: name.clone(),
            gone: !shoots.iter().any(|(n, _, _)| n == name),
        })
        .collect();
    Changes {
        rekey,
        shoots,
        ended,
    }
}

/// The device after a table change.
pub(crate) struct Applied {
    /// Its key material (the same, shared, unless the key changed).
    pub(crate) keys: Keys,
    /// Its shoots.
    pub(crate) maps: Maps,
    /// Routes that left the table, with the number of peers their shoot had: their metric
    /// series go.
    pub(crate) gone: Vec<(Arc<str>, usize)>,
}

impl Changes<'_> {
    /// Carries the plan out on the device's shoots (`old`, under `keys`) at `now`: kept shoots
    /// are changed in place, new ones built (`mode`, a stack seed from `seed` each), ended
    /// ones marked removed with their streams reset; what their stacks send goes to `io`.
    pub(crate) fn execute(
        self,
        keys: &Keys,
        old: &Maps,
        mode: &Mode,
        now: Instant,
        seed: &mut impl FnMut() -> u64,
        io: &mut impl Io,
    ) -> Applied {
        let keys = match self.rekey {
            Some(k) => Keys::new(k),
            // The cookie secret and the handshake count carry over.
            None => keys.share(),
        };
        let mut maps = Maps::default();
        for (name, tunnel, change) in self.shoots {
            let kept = match change {
                ShootChange::Keep { remove, add } => {
                    old.shoots.get(&name).map(|c| (c, remove, add))
                }
                ShootChange::New => None,
            };
            let cell = match kept {
                Some((cell, remove, add)) => {
                    let mut s = lock(cell);
                    for k in &remove {
                        s.stack.reset_flows(Some(k));
                    }
                    s.peers.retain(|p| !remove.contains(&p.key));
                    let allowed: HashMap<WgKey, &[Net]> = tunnel
                        .peers
                        .iter()
                        .map(|p| (p.public_key, &p.allowed_ips[..]))
                        .collect();
                    for p in s.peers.iter_mut() {
                        if let Some(a) = allowed.get(&p.key) {
                            p.allowed = (*a).into();
                        }
                    }
                    for k in &add {
                        if s.peer_position(k).is_none()
                            && let Some(a) = allowed.get(k)
                        {
                            s.peers.push(keys.new_peer(&name, *k, a, None));
                        }
                    }
                    // The table's order: a peer's index is the same in /routes and metrics.
                    s.peers
                        .sort_by_key(|p| tunnel.peers.iter().position(|tp| tp.public_key == p.key));
                    s.flush(now, io);
                    drop(s);
                    cell.clone()
                }
                None => {
                    let peers = tunnel
                        .peers
                        .iter()
                        .map(|tp| keys.new_peer(&name, tp.public_key, &tp.allowed_ips, None))
                        .collect();
                    let shoot = Shoot::new(
                        name.clone(),
                        peers,
                        &tunnel.local_addresses,
                        mode.clone(),
                        now,
                        seed(),
                    );
                    Arc::new(Mutex::new(shoot))
                }
            };
            maps.insert(&keys, cell);
        }
        let mut gone = Vec::new();
        for ended in self.ended {
            let Some(cell) = old.shoots.get(&ended.route) else {
                continue;
            };
            let mut s = lock(cell);
            s.removed = true;
            s.stack.reset_flows(None);
            s.flush(now, io);
            if ended.gone {
                gone.push((ended.route, s.peers.len()));
            }
        }
        Applied { keys, maps, gone }
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use smoltcp::iface::SocketHandle;

    use super::*;
    use crate::route::TunnelPeer;
    use crate::tunnel::device::ShootCell;
    use crate::tunnel::testing::{Recorder, bring_up, key, net, public};

    /// A tunnel with these agent replicas (private key byte, `allowedIPs`) and the gateway at
    /// `address` inside the shoot.
    fn tunnel(replicas: &[(u8, &str)], address: &str) -> Tunnel {
        Tunnel {
            peers: replicas
                .iter()
                .map(|(b, allowed)| TunnelPeer {
                    public_key: public(key(*b)),
                    allowed_ips: vec![net(allowed)].into(),
                })
                .collect(),
            local_addresses: vec![address.parse().unwrap()].into(),
        }
    }

    /// A gateway device in memory, changed as the driver changes it.
    struct Device {
        private: WgKey,
        keys: Keys,
        maps: Maps,
        io: Recorder,
        now: Instant,
    }

    /// What one table change planned and left behind.
    struct Outcome {
        /// Each route's change, in the table's order.
        plan: Vec<(Arc<str>, ShootChange)>,
        /// The shoots that ended, by route.
        ended: Vec<Ended>,
        /// The routes whose metric series go, with their peer counts.
        gone: Vec<(Arc<str>, usize)>,
    }

    impl Device {
        fn new() -> Device {
            Device {
                private: key(1),
                keys: Keys::new(key(1)),
                maps: Maps::default(),
                io: Recorder::default(),
                now: Instant::now(),
            }
        }

        /// Plans and executes a table change, as `Tunnels::apply` does.
        fn apply(&mut self, wanted: &[(&str, &Tunnel)], private: Option<WgKey>) -> Outcome {
            let wanted: Vec<(Arc<str>, &Tunnel)> =
                wanted.iter().map(|(n, t)| (Arc::from(*n), *t)).collect();
            let changes = reconcile(&current(&self.maps), &self.keys, &wanted, private);
            let plan = changes
                .shoots
                .iter()
                .map(|(n, _, c)| (n.clone(), c.clone()))
                .collect();
            let mut ended = changes.ended.clone();
            ended.sort_by(|a, b| a.route.cmp(&b.route));
            let applied = changes.execute(
                &self.keys,
                &self.maps,
                &Mode::Gateway,
                self.now,
                &mut || 1,
                &mut self.io,
            );
            if let Some(k) = private {
                self.private = k;
            }
            self.keys = applied.keys;
            self.maps = applied.maps;
            Outcome {
                plan,
                ended,
                gone: applied.gone,
            }
        }

        fn cell(&self, route: &str) -> ShootCell {
            self.maps.shoots[route].clone()
        }

        /// Gives replica `b` of `route` a session.
        fn up(&self, route: &str, b: u8) {
            let from = SocketAddr::from(([10, 0, 0, b], 40000));
            bring_up(
                &mut lock(&self.cell(route)),
                self.private,
                key(b),
                from,
                self.now,
            );
        }

        /// Whether replica `b` of `route` has a live session.
        fn live(&self, route: &str, b: u8) -> bool {
            let cell = self.cell(route);
            let s = lock(&cell);
            let i = s.peer_position(&public(key(b))).expect("a peer");
            s.peers[i].live(self.now)
        }

        /// Opens a stream through replica `b` of `route`.
        fn dial(&self, route: &str, b: u8) -> SocketHandle {
            let cell = self.cell(route);
            let mut s = lock(&cell);
            let to: SocketAddr = "10.250.0.10:443".parse().unwrap();
            s.stack.connect(to, Some(public(key(b)))).unwrap()
        }
    }

    /// Whether stream `h` of `cell` goes on (its shoot not removed, the stream not reset).
    fn open(cell: &ShootCell, h: SocketHandle) -> bool {
        let s = lock(cell);
        !s.removed && s.stack.flow(h).is_some_and(|f| !f.killed)
    }

    fn keep(remove: &[u8], add: &[u8]) -> ShootChange {
        ShootChange::Keep {
            remove: remove.iter().map(|b| public(key(*b))).collect(),
            add: add.iter().map(|b| public(key(*b))).collect(),
        }
    }

    /// The product promise: a table that did not change a tunnel leaves its sessions and
    /// streams alone, also when the key file is read again unchanged.
    /// Mutants caught: the reuse condition left out (every route a new shoot: sessions
    /// and streams lost); a kept shoot resetting all its flows (`reset_flows(None)` on every
    /// kept shoot); a kept shoot counted as ended (marked removed); the same key read again
    /// taken for a new one (`rekey` without its comparison).
    #[test]
    fn an_unchanged_table_keeps_every_session_and_stream() {
        let a = tunnel(
            &[(2, "10.250.0.0/16"), (3, "10.250.0.0/16")],
            "192.168.128.1",
        );
        let b = tunnel(&[(4, "10.250.0.0/16")], "192.168.128.1");
        let table = [("a", &a), ("b", &b)];
        let mut d = Device::new();
        let first = d.apply(&table, None);
        let new = |n: &str| (Arc::<str>::from(n), ShootChange::New);
        assert_eq!(first.plan, vec![new("a"), new("b")]);
        assert!(first.ended.is_empty());
        d.up("a", 2);
        d.up("a", 3);
        d.up("b", 4);
        let (ha2, ha3, hb) = (d.dial("a", 2), d.dial("a", 3), d.dial("b", 4));
        let (ca, cb) = (d.cell("a"), d.cell("b"));

        for private in [None, Some(key(1))] {
            let again = d.apply(&table, private);
            let kept = |n: &str| (Arc::<str>::from(n), keep(&[], &[]));
            assert_eq!(again.plan, vec![kept("a"), kept("b")]);
            assert!(again.ended.is_empty() && again.gone.is_empty());
            assert!(Arc::ptr_eq(&ca, &d.cell("a")) && Arc::ptr_eq(&cb, &d.cell("b")));
            assert!(d.live("a", 2) && d.live("a", 3) && d.live("b", 4));
            assert!(open(&ca, ha2) && open(&ca, ha3) && open(&cb, hb));
            assert!(Arc::ptr_eq(&d.maps.by_key[&public(key(3))], &ca));
        }
    }

    /// A replica's key changed: that peer goes (its streams end) and the new one joins; the
    /// other replica of the route and the other route keep their sessions and streams.
    /// Mutants caught: the removed peer left in the shoot (`retain` left out); the removed
    /// peer's streams reset as `reset_flows(None)` (the kept replica's stream ends too).
    #[test]
    fn a_changed_key_replaces_only_that_peer() {
        let a = tunnel(
            &[(2, "10.250.0.0/16"), (3, "10.250.0.0/16")],
            "192.168.128.1",
        );
        let b = tunnel(&[(4, "10.250.0.0/16")], "192.168.128.1");
        let mut d = Device::new();
        d.apply(&[("a", &a), ("b", &b)], None);
        d.up("a", 2);
        d.up("a", 3);
        d.up("b", 4);
        let (ha2, ha3, hb) = (d.dial("a", 2), d.dial("a", 3), d.dial("b", 4));
        let (ca, cb) = (d.cell("a"), d.cell("b"));

        let a2 = tunnel(
            &[(2, "10.250.0.0/16"), (5, "10.250.0.0/16")],
            "192.168.128.1",
        );
        let out = d.apply(&[("a", &a2), ("b", &b)], None);
        assert_eq!(
            out.plan,
            vec![("a".into(), keep(&[3], &[5])), ("b".into(), keep(&[], &[]))]
        );
        assert!(out.ended.is_empty());
        let keys: Vec<WgKey> = lock(&ca).peers.iter().map(|p| p.key).collect();
        assert_eq!(keys, vec![public(key(2)), public(key(5))]);
        assert!(d.live("a", 2) && !d.live("a", 5) && d.live("b", 4));
        assert!(open(&ca, ha2) && !open(&ca, ha3) && open(&cb, hb));
        assert!(Arc::ptr_eq(&ca, &d.cell("a")) && Arc::ptr_eq(&cb, &d.cell("b")));
        assert!(!d.maps.by_key.contains_key(&public(key(3))));
        assert!(Arc::ptr_eq(&d.maps.by_key[&public(key(5))], &ca));
    }

    /// A peer's `allowedIPs` changed and the peers were reordered: same peers, same
    /// sessions, the new networks, the table's order.
    /// Mutants caught: the `allowedIPs` update left out (the peer keeps its old networks);
    /// the sort left out (peer indexes in /routes and metrics no longer the table's); a
    /// peer compared by key and networks (replaced: its session lost).
    #[test]
    fn changed_allowed_ips_and_order_keep_the_sessions() {
        let a = tunnel(
            &[(2, "10.250.0.0/16"), (3, "10.250.0.0/16")],
            "192.168.128.1",
        );
        let mut d = Device::new();
        d.apply(&[("a", &a)], None);
        d.up("a", 2);
        d.up("a", 3);
        let h = d.dial("a", 2);
        let ca = d.cell("a");

        let a2 = tunnel(
            &[(3, "10.250.0.0/16"), (2, "10.250.0.0/24")],
            "192.168.128.1",
        );
        let out = d.apply(&[("a", &a2)], None);
        assert_eq!(out.plan, vec![("a".into(), keep(&[], &[]))]);
        let s = lock(&ca);
        let keys: Vec<WgKey> = s.peers.iter().map(|p| p.key).collect();
        assert_eq!(keys, vec![public(key(3)), public(key(2))]);
        assert_eq!(&s.peers[1].allowed[..], &[net("10.250.0.0/24")][..]);
        drop(s);
        assert!(d.live("a", 2) && d.live("a", 3));
        assert!(open(&ca, h));
    }

    /// The gateway's addresses inside a shoot changed: the route gets a new shoot and the old
    /// one ends (its streams end), but its metric series stay; the other route is untouched.
    /// Mutants caught: the address comparison left out (the old shoot kept on its old
    /// addresses); an ended shoot whose route stays counted as gone (its series dropped).
    #[test]
    fn changed_addresses_give_the_route_a_new_shoot() {
        let a = tunnel(&[(2, "10.250.0.0/16")], "192.168.128.1");
        let b = tunnel(&[(4, "10.250.0.0/16")], "192.168.128.1");
        let mut d = Device::new();
        d.apply(&[("a", &a), ("b", &b)], None);
        d.up("a", 2);
        d.up("b", 4);
        let (ha, hb) = (d.dial("a", 2), d.dial("b", 4));
        let (ca, cb) = (d.cell("a"), d.cell("b"));

        let a2 = tunnel(&[(2, "10.250.0.0/16")], "192.168.128.9");
        let out = d.apply(&[("a", &a2), ("b", &b)], None);
        assert_eq!(
            out.plan,
            vec![("a".into(), ShootChange::New), ("b".into(), keep(&[], &[]))]
        );
        assert_eq!(
            out.ended,
            vec![Ended {
                route: "a".into(),
                gone: false
            }]
        );
        assert!(out.gone.is_empty());
        assert!(!Arc::ptr_eq(&ca, &d.cell("a")));
        assert!(lock(&ca).removed && !open(&ca, ha));
        assert!(!d.live("a", 2));
        assert!(Arc::ptr_eq(&cb, &d.cell("b")) && open(&cb, hb) && d.live("b", 4));
    }

    /// A route left the table: its shoot ends (streams end) and its series go; the other
    /// route is untouched.
    /// Mutants caught: the ended filter turned around (the kept route ended, the removed one
    /// left running); `gone` left out (the removed route's series kept forever); the wrong
    /// peer count (a series per peer left behind).
    #[test]
    fn a_removed_route_ends_its_shoot_and_its_series() {
        let a = tunnel(&[(2, "10.250.0.0/16")], "192.168.128.1");
        let b = tunnel(
            &[(4, "10.250.0.0/16"), (5, "10.250.0.0/16")],
            "192.168.128.1",
        );
        let mut d = Device::new();
        d.apply(&[("a", &a), ("b", &b)], None);
        d.up("a", 2);
        d.up("b", 4);
        let (ha, hb) = (d.dial("a", 2), d.dial("b", 4));
        let (ca, cb) = (d.cell("a"), d.cell("b"));

        let out = d.apply(&[("a", &a)], None);
        assert_eq!(out.plan, vec![("a".into(), keep(&[], &[]))]);
        assert_eq!(
            out.ended,
            vec![Ended {
                route: "b".into(),
                gone: true
            }]
        );
        assert_eq!(out.gone, vec![("b".into(), 2)]);
        assert!(lock(&cb).removed && !open(&cb, hb));
        assert!(!d.maps.shoots.contains_key("b"));
        assert!(!d.maps.by_key.contains_key(&public(key(4))));
        assert!(Arc::ptr_eq(&ca, &d.cell("a")) && open(&ca, ha) && d.live("a", 2));
    }

    /// A new private key: every shoot is new (the receiver indexes and sessions belonged to
    /// the old key) and every old one ends, its series kept.
    /// Mutant caught: a key change ignored (shoots kept with sessions under the old key, the
    /// device still on the old key).
    #[test]
    fn a_new_private_key_rebuilds_every_shoot() {
        let a = tunnel(&[(2, "10.250.0.0/16")], "192.168.128.1");
        let mut d = Device::new();
        d.apply(&[("a", &a)], None);
        d.up("a", 2);
        let h = d.dial("a", 2);
        let ca = d.cell("a");

        let out = d.apply(&[("a", &a)], Some(key(9)));
        assert_eq!(out.plan, vec![("a".into(), ShootChange::New)]);
        assert_eq!(
            out.ended,
            vec![Ended {
                route: "a".into(),
                gone: false
            }]
        );
        assert_eq!(d.keys.public.to_bytes(), public(key(9)).0);
        assert!(lock(&ca).removed && !open(&ca, h));
        assert!(!Arc::ptr_eq(&ca, &d.cell("a")) && !d.live("a", 2));
    }
}
