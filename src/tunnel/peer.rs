//! One WireGuard peer: boringtun's noise session, the endpoint learnt from authenticated
//! packets (roaming), the inner networks it may send from, and its handshake times.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use boringtun::noise::Tunn;
use boringtun::noise::rate_limiter::RateLimiter;
use boringtun::x25519::{PublicKey, StaticSecret};

use crate::route::{Net, WgKey};

/// How long a session is usable after its handshake (WireGuard's REJECT_AFTER_TIME).
pub(crate) const REJECT_AFTER: Duration = Duration::from_secs(180);
/// When an initiator starts its next handshake (WireGuard's REKEY_AFTER_TIME). boringtun
/// rekeys only a session that carries data; the agent rekeys an idle one too, so its tunnel
/// never lapses between keepalives.
pub(crate) const REKEY_AFTER: Duration = Duration::from_secs(120);

/// One peer.
pub(crate) struct Peer {
    /// Its public key.
    pub(crate) key: WgKey,
    /// The noise session.
    pub(crate) tunn: Tunn,
    /// The inner source addresses it may send from (and the targets it is chosen for).
    pub(crate) allowed: Box<[Net]>,
    /// Where its last authenticated packet came from (or the configured endpoint).
    pub(crate) endpoint: Option<SocketAddr>,
    /// When its last handshake completed.
    pub(crate) handshake_at: Option<Instant>,
    /// When a recovery handshake was last sent to it.
    pub(crate) recovery_at: Option<Instant>,
    /// Where that recovery handshake went (the source of the orphan packet): boringtun's own
    /// retries of it go there too while the endpoint is not known.
    pub(crate) recovery_to: Option<SocketAddr>,
    /// A dial through it went unanswered while another peer could be tried: it is chosen
    /// last until it sends an authenticated packet again (a replica that died, whose
    /// session still looks live).
    pub(crate) suspect: bool,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("key", &self.key)
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl Peer {
    /// A peer with no session yet. `index` is the upper 24 bits of its receiver indexes.
    pub(crate) fn new(
        secret: &StaticSecret,
        key: WgKey,
        allowed: Box<[Net]>,
        index: u32,
        keepalive: Option<u16>,
        limiter: Option<Arc<RateLimiter>>,
    ) -> Peer {
        let tunn = Tunn::new(
            secret.clone(),
            PublicKey::from(key.0),
            None,
            keepalive,
            index,
            limiter,
        );
        Peer {
            key,
            tunn,
            allowed,
            endpoint: None,
            handshake_at: None,
            recovery_at: None,
            recovery_to: None,
            suspect: false,
        }
    }

    /// Whether `ip` is inside its allowed networks.
    pub(crate) fn allows(&self, ip: IpAddr) -> bool {
        self.allowed.iter().any(|n| n.contains(ip))
    }

    /// The longest of its allowed networks holding `ip`.
    pub(crate) fn match_len(&self, ip: IpAddr) -> Option<u8> {
        self.allowed
            .iter()
            .filter(|n| n.contains(ip))
            .map(|n| n.prefix())
            .max()
    }

    /// Whether it has a session young enough to carry data.
    pub(crate) fn live(&self, now: Instant) -> bool {
        self.tunn.time_since_last_handshake().is_some()
            && self
                .handshake_at
                .is_some_and(|at| now.saturating_duration_since(at) < REJECT_AFTER)
    }
}
