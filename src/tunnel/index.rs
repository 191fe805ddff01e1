//! Receiver indexes a fresh process can map back to a peer, and the limits on the handshakes
//! that such a mapping lets trellis start.
//!
//! boringtun sets a session's local index to `peer << 8 | counter`, with `peer` (24 bits)
//! chosen by the caller. trellis derives it from HMAC-SHA256 under the device's private key
//! over the peer's public key: stable across restarts and identical on every replica that
//! holds the key, so a data packet for a session this process never saw still names its
//! peer; unpredictable without the private key, so an off-path sender cannot aim at a peer.
//! Collisions in 24 bits are possible and handled by the caller (several candidates).

use std::time::{Duration, Instant};

use crate::route::WgKey;

/// The caller-chosen upper 24 bits of every receiver index of `peer` under `secret`.
pub(crate) fn peer_index(secret: &[u8; 32], peer: &WgKey) -> u32 {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let mut ctx = ring::hmac::Context::with_key(&key);
    ctx.update(b"trellis receiver index v1");
    ctx.update(&peer.0);
    let tag = ctx.sign();
    let b = tag.as_ref();
    u32::from_be_bytes([0, b[0], b[1], b[2]])
}

/// The peer part of a receiver index found in a packet.
pub(crate) fn index_peer(receiver_index: u32) -> u32 {
    receiver_index >> 8
}

/// A token bucket: at most `burst` at once, refilled at `rate` per second.
#[derive(Debug)]
pub(crate) struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Option<Instant>,
}

impl Bucket {
    /// A full bucket.
    pub(crate) fn new(rate: f64, burst: f64) -> Bucket {
        Bucket {
            rate,
            burst,
            tokens: burst,
            at: None,
        }
    }

    /// Takes a token if there is one.
    pub(crate) fn take(&mut self, now: Instant) -> bool {
        if let Some(at) = self.at {
            let dt = now.saturating_duration_since(at).as_secs_f64();
            self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        }
        self.at = Some(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// How often one peer may be sent a recovery handshake (the initiation's own retry period,
/// WireGuard's REKEY_TIMEOUT).
pub(crate) const RECOVERY_PER_PEER: Duration = Duration::from_secs(5);
/// Recovery handshakes per second for the whole device, and the burst: a restart of a
/// gateway with a thousand busy shoots recovers them all in about a second, and a forged
/// packet stream cannot make trellis send more than this.
pub(crate) const RECOVERY_RATE: f64 = 1000.0;
/// See [`RECOVERY_RATE`].
pub(crate) const RECOVERY_BURST: f64 = 1000.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_are_keyed_stable_and_24_bits() {
        let a = WgKey([1; 32]);
        let b = WgKey([2; 32]);
        let s1 = [7u8; 32];
        let s2 = [8u8; 32];
        assert_eq!(peer_index(&s1, &a), peer_index(&s1, &a));
        assert_ne!(peer_index(&s1, &a), peer_index(&s1, &b));
        assert_ne!(peer_index(&s1, &a), peer_index(&s2, &a));
        for k in 0..200u8 {
            let i = peer_index(&s1, &WgKey([k; 32]));
            assert!(i < 1 << 24);
            assert_eq!(index_peer(i << 8 | 0x5a), i);
        }
    }

    #[test]
    fn the_bucket_refills_at_its_rate_and_caps_at_its_burst() {
        let t = Instant::now();
        let mut b = Bucket::new(2.0, 3.0);
        assert!((0..3).all(|_| b.take(t)));
        assert!(!b.take(t));
        assert!(b.take(t + Duration::from_millis(500)));
        assert!(!b.take(t + Duration::from_millis(500)));
        let later = t + Duration::from_secs(100);
        assert_eq!((0..10).filter(|_| b.take(later)).count(), 3);
    }
}
