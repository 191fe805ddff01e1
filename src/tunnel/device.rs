//! The device: one private key, the shoots, and the maps from a datagram to its peer.
//!
//! A handshake initiation names its sender only inside the encrypted static key, so it is
//! checked against the device-wide cookie limiter first (MAC1, and under load a cookie reply
//! instead of a Diffie-Hellman) and then opened with the device key to find the peer by
//! public key. Every other message carries the receiver index this device chose: its upper
//! 24 bits ([`super::index`]) name the peer, even for a session this process never had — a
//! data packet for such a session makes the device start a handshake towards its source
//! ("recovery"), at most once per [`RECOVERY_PER_PEER`] per peer and [`RECOVERY_RATE`] in
//! all, so a shoot that keeps sending is usable again after a restart without waiting for
//! its own timers. Sans-IO; the maps are replaced as a whole on every table change.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use boringtun::noise::handshake::parse_handshake_anon;
use boringtun::noise::rate_limiter::RateLimiter;
use boringtun::noise::{Packet, TunnResult};
use boringtun::x25519::{PublicKey, StaticSecret};

use super::index::{
    Bucket, RECOVERY_BURST, RECOVERY_PER_PEER, RECOVERY_RATE, index_peer, peer_index,
};
use super::peer::{Endpoint, Peer};
use super::shoot::{Drop, Io, Shoot};
use crate::route::{Net, WgKey};

/// Handshake messages per second the whole device takes before it asks for cookies. Each
/// is counted twice (the device's check and the peer's session check share the limiter), so
/// this is 2,000 handshakes a second.
pub(crate) const HANDSHAKES_BEFORE_COOKIES: u64 = 4000;

/// A shoot shared between the device and its streams.
pub(crate) type ShootCell = Arc<Mutex<Shoot>>;

/// The device's key material.
pub(crate) struct Keys {
    /// The private key.
    pub(crate) secret: StaticSecret,
    /// Its public key.
    pub(crate) public: PublicKey,
    /// The cookie limiter shared by every peer.
    pub(crate) limiter: Arc<RateLimiter>,
}

impl Keys {
    /// Key material for a private key.
    pub(crate) fn new(private: WgKey) -> Keys {
        let secret = StaticSecret::from(private.0);
        let public = PublicKey::from(&secret);
        let limiter = Arc::new(RateLimiter::new(&public, HANDSHAKES_BEFORE_COOKIES));
        Keys {
            secret,
            public,
            limiter,
        }
    }

    /// The same key material (and cookie secret), shared: for a table change that keeps the
    /// key.
    pub(crate) fn share(&self) -> Keys {
        Keys {
            secret: self.secret.clone(),
            public: self.public,
            limiter: self.limiter.clone(),
        }
    }

    /// The upper 24 bits of `peer`'s receiver indexes under this key.
    pub(crate) fn index_of(&self, peer: &WgKey) -> u32 {
        peer_index(&self.secret.to_bytes(), peer)
    }

    /// A peer of `route` under this key, sharing the device's handshake limiter (one budget
    /// for the device; a replayed initiation cannot push one peer into cookies on its own).
    pub(crate) fn new_peer(
        &self,
        route: &str,
        key: WgKey,
        allowed: &[Net],
        keepalive: Option<u16>,
    ) -> Peer {
        Peer::new(
            route,
            &self.secret,
            key,
            allowed.into(),
            self.index_of(&key),
            keepalive,
            Some(self.limiter.clone()),
        )
    }
}

/// Which shoot holds each peer, by public key and by index; replaced as a whole.
#[derive(Default)]
pub(crate) struct Maps {
    /// Shoots by route name.
    pub(crate) shoots: HashMap<Arc<str>, ShootCell>,
    /// Peers by public key.
    pub(crate) by_key: HashMap<WgKey, ShootCell>,
    /// Peers by the upper 24 bits of their receiver indexes (collisions possible).
    pub(crate) by_index: HashMap<u32, Vec<(ShootCell, WgKey)>>,
}

impl Maps {
    /// Adds a shoot and its peers.
    pub(crate) fn insert(&mut self, keys: &Keys, shoot: ShootCell) {
        let (name, peers): (Arc<str>, Vec<WgKey>) = {
            let s = lock(&shoot);
            (s.name.clone(), s.peers.iter().map(|p| p.key).collect())
        };
        for key in peers {
            self.by_key.insert(key, shoot.clone());
            self.by_index
                .entry(keys.index_of(&key))
                .or_default()
                .push((shoot.clone(), key));
        }
        self.shoots.insert(name, shoot);
    }
}

/// Locks a shoot; a panic while it was held leaves it usable (its state is plain data).
pub(crate) fn lock(shoot: &ShootCell) -> std::sync::MutexGuard<'_, Shoot> {
    shoot.lock().unwrap_or_else(|e| e.into_inner())
}

/// The global recovery limit.
#[derive(Debug)]
pub(crate) struct Recovery(Mutex<Bucket>);

impl Default for Recovery {
    fn default() -> Self {
        Recovery(Mutex::new(Bucket::new(RECOVERY_RATE, RECOVERY_BURST)))
    }
}

impl Recovery {
    fn take(&self, now: Instant) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take(now)
    }
}

/// Handles one datagram from `from`; returns the shoot it was delivered to, whose stack the
/// caller runs ([`Shoot::flush`]) once per batch.
pub(crate) fn receive(
    keys: &Keys,
    maps: &Maps,
    recovery: &Recovery,
    now: Instant,
    from: Endpoint,
    datagram: &[u8],
    io: &mut impl Io,
) -> Option<ShootCell> {
    let mut cookie = [0u8; 64];
    let packet = match keys
        .limiter
        .verify_packet(Some(from.ip()), datagram, &mut cookie)
    {
        Ok(p) => p,
        Err(TunnResult::WriteToNetwork(reply)) => {
            io.send(from, reply);
            io.dropped(Drop::Cookie);
            return None;
        }
        Err(_) => {
            io.dropped(Drop::Invalid);
            return None;
        }
    };
    let indexed = match packet {
        Packet::HandshakeInit(init) => {
            let Ok(half) = parse_handshake_anon(&keys.secret, &keys.public, &init) else {
                io.dropped(Drop::Invalid);
                return None;
            };
            let key = WgKey(half.peer_static_public);
            let Some(cell) = maps.by_key.get(&key) else {
                io.dropped(Drop::UnknownPeer);
                return None;
            };
            let mut shoot = lock(cell);
            let Some(i) = shoot.peer_position(&key) else {
                io.dropped(Drop::UnknownPeer);
                return None;
            };
            return match shoot.receive(now, i, from, datagram, io) {
                Ok(()) => Some(cell.clone()),
                Err(e) => {
                    io.dropped(Drop::from_error(&e));
                    None
                }
            };
        }
        Packet::HandshakeResponse(p) => (p.receiver_idx, false),
        Packet::PacketCookieReply(p) => (p.receiver_idx, false),
        Packet::PacketData(p) => (p.receiver_idx, true),
    };
    by_index(maps, recovery, now, indexed, from, datagram, io)
}

/// A message addressed by `receiver` (index, whether it is a data packet).
fn by_index(
    maps: &Maps,
    recovery: &Recovery,
    now: Instant,
    (receiver, data): (u32, bool),
    from: Endpoint,
    datagram: &[u8],
    io: &mut impl Io,
) -> Option<ShootCell> {
    let Some(candidates) = maps.by_index.get(&index_peer(receiver)) else {
        io.dropped(Drop::UnknownPeer);
        return None;
    };
    let mut last = Drop::UnknownPeer;
    let mut orphan: Option<(&ShootCell, WgKey)> = None;
    for (cell, key) in candidates {
        let mut shoot = lock(cell);
        let Some(i) = shoot.peer_position(key) else {
            continue;
        };
        match shoot.receive(now, i, from, datagram, io) {
            Ok(()) => return Some(cell.clone()),
            Err(e) => {
                last = Drop::from_error(&e);
                if data && last == Drop::NoSession && orphan.is_none() {
                    orphan = Some((cell, *key));
                }
            }
        }
    }
    io.dropped(last);
    // A data packet for a session this process does not hold: the peer is sending, so a
    // handshake from here makes it usable again at once (rate limited; see the module docs).
    if let Some((cell, key)) = orphan
        && candidates.len() == 1
    {
        let mut shoot = lock(cell);
        let i = shoot.peer_position(&key)?;
        // A live peer needs no recovery (an old packet replayed against it must not make
        // the gateway send anything).
        let due = !shoot.peers[i].live(now)
            && shoot.peers[i]
                .recovery_at
                .is_none_or(|at| now.saturating_duration_since(at) >= RECOVERY_PER_PEER);
        if due && recovery.take(now) {
            shoot.initiate(now, i, Some(from), io);
        }
    }
    None
}
