//! The bounded set of connections an admin listener holds. A new connection is always
//! admitted; when the set is full, room is made by evicting, among the connections still
//! waiting for their request, the one held longest by the peer address holding the most.
//! A flood of idle connections therefore only ever evicts its own, a connection whose
//! request has come is answered, and a fresh probe — the newest connection, from an
//! address holding one at most — is the last to go. It never touches a socket: the values
//! are whatever closes a connection when dropped or told to.

use std::collections::VecDeque;
use std::net::IpAddr;

/// Connections held, oldest first.
#[derive(Debug)]
pub(crate) struct Held<V> {
    cap: usize,
    next_id: u64,
    entries: VecDeque<(u64, IpAddr, V)>,
}

/// What the set needs to know of a held connection.
pub(crate) trait Waiting {
    /// Whether the connection is still waiting for its request (idle so far).
    fn waiting(&self) -> bool;
}

impl<V: Waiting> Held<V> {
    /// A set of at most `cap` connections (at least one).
    pub(crate) fn new(cap: usize) -> Self {
        Held {
            cap: cap.max(1),
            next_id: 0,
            entries: VecDeque::new(),
        }
    }

    /// Connections held now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Admits a connection from `peer`: `make` gets its id (for [`Held::remove`]) and gives
    /// what is held for it. Returns the evicted connection when the set was full.
    pub(crate) fn admit(&mut self, peer: IpAddr, make: impl FnOnce(u64) -> V) -> Option<V> {
        let evicted = if self.entries.len() >= self.cap {
            self.evict()
        } else {
            None
        };
        let id = self.next_id;
        self.next_id += 1;
        self.entries.push_back((id, peer, make(id)));
        evicted
    }

    /// Forgets connection `id` (it ended by itself).
    pub(crate) fn remove(&mut self, id: u64) {
        if let Some(i) = self.entries.iter().position(|(e, _, _)| *e == id) {
            self.entries.remove(i);
        }
    }

    /// Removes and returns the connection held longest by the peer holding the most, among
    /// those still waiting for their request if any is.
    pub(crate) fn evict(&mut self) -> Option<V> {
        let any_waiting = self.entries.iter().any(|(_, _, v)| v.waiting());
        let candidate = |v: &V| !any_waiting || v.waiting();
        let mut counts: std::collections::HashMap<IpAddr, usize> = Default::default();
        for (_, peer, _) in self.entries.iter().filter(|(_, _, v)| candidate(v)) {
            *counts.entry(*peer).or_default() += 1;
        }
        let most = counts.values().copied().max()?;
        // Oldest first: the first candidate of a peer holding `most` is the oldest of all.
        let i = self
            .entries
            .iter()
            .position(|(_, peer, v)| candidate(v) && counts.get(peer) == Some(&most))?;
        self.entries.remove(i).map(|(_, _, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Waiting for &str {
        fn waiting(&self) -> bool {
            !self.starts_with("busy")
        }
    }

    impl Waiting for i32 {
        fn waiting(&self) -> bool {
            true
        }
    }

    impl Waiting for () {
        fn waiting(&self) -> bool {
            true
        }
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn a_new_connection_is_always_admitted_and_the_oldest_goes() {
        let mut h = Held::new(3);
        for n in 0..3 {
            assert_eq!(h.admit(ip(1), |_| n), None);
        }
        // Full: the newcomer (same peer) evicts the oldest.
        assert_eq!(h.admit(ip(1), |_| 3), Some(0));
        assert_eq!(h.admit(ip(1), |_| 4), Some(1));
        assert_eq!(h.len(), 3);
    }

    #[test]
    fn the_peer_holding_most_loses_its_oldest() {
        let mut h = Held::new(4);
        assert_eq!(h.admit(ip(2), |_| "probe, old"), None);
        for _ in 0..3 {
            h.admit(ip(1), |_| "flood");
        }
        // The probe's connection is the oldest, but the flooding peer holds three.
        assert_eq!(h.admit(ip(3), |_| "probe, new"), Some("flood"));
        assert_eq!(h.admit(ip(1), |_| "flood"), Some("flood"));
        // 127.0.0.1 still holds the most (2 of 4).
        assert_eq!(h.admit(ip(4), |_| "x"), Some("flood"));
        // Now each holds one: the oldest of all goes.
        assert_eq!(h.admit(ip(5), |_| "y"), Some("probe, old"));
    }

    #[test]
    fn connections_whose_request_came_go_last() {
        let mut h = Held::new(3);
        h.admit(ip(1), |_| "busy, old");
        h.admit(ip(1), |_| "busy, newer");
        h.admit(ip(2), |_| "idle");
        // 127.0.0.1 holds the most, but its connections are being answered.
        assert_eq!(h.admit(ip(1), |_| "idle, new"), Some("idle"));
        assert_eq!(h.admit(ip(3), |_| "busy, newest"), Some("idle, new"));
        // None is waiting: the oldest of the peer holding the most goes.
        assert_eq!(h.admit(ip(3), |_| "x"), Some("busy, old"));
    }

    #[test]
    fn removed_connections_free_their_place() {
        let mut h = Held::new(2);
        let mut ids = Vec::new();
        h.admit(ip(1), |id| ids.push(id));
        h.admit(ip(1), |id| ids.push(id));
        h.remove(ids[0]);
        h.remove(ids[0]);
        assert_eq!(h.len(), 1);
        assert_eq!(h.admit(ip(1), |_| ()), None, "room without eviction");
        assert!(h.evict().is_some() && h.evict().is_some() && h.evict().is_none());
    }
}
