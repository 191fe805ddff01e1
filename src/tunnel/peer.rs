//! One WireGuard peer: boringtun's noise session, the endpoint learnt from authenticated
//! packets (roaming), the inner networks it may send from, and its handshake times; and
//! [`Endpoint`], where a peer's datagrams go (a UDP address or a TCP stream carrying them).
//!
//! boringtun logs its timers and handshakes (`HANDSHAKE(REKEY_TIMEOUT)`, target
//! `boringtun::noise::timers`) with no context: every call into a peer's session goes through
//! [`Peer`]'s methods, which run it inside the peer's span (route and public key), and the
//! log formatters print the current span's fields with each line. On the packet path
//! (encrypt, decrypt), where boringtun writes only debug and trace lines, the span is entered
//! only while those are enabled: entering it costs about 70 ns (two thread-local stacks and
//! the filter's read lock; twice that with two threads at once), 4 % of encrypting a
//! 1,400-byte packet, while the check costs 1–3 ns.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use boringtun::noise::rate_limiter::RateLimiter;
use boringtun::noise::{Tunn, TunnResult};
use boringtun::x25519::{PublicKey, StaticSecret};

use crate::route::{Net, WgKey};

/// How long a session is usable after its handshake (WireGuard's REJECT_AFTER_TIME).
pub(crate) const REJECT_AFTER: Duration = Duration::from_secs(180);
/// When an initiator starts its next handshake (WireGuard's REKEY_AFTER_TIME). boringtun
/// rekeys only a session that carries data; the agent rekeys an idle one too, so its tunnel
/// never lapses between keepalives.
pub(crate) const REKEY_AFTER: Duration = Duration::from_secs(120);

/// Which TCP stream (a WireGuard-over-TCP endpoint of the device) a datagram came on or goes
/// to: unique for the life of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct StreamId(pub(crate) u64);

/// Where a peer's datagrams go, and where one came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Endpoint {
    /// A UDP address (the device's socket sends there).
    Udp(SocketAddr),
    /// A TCP stream carrying framed datagrams, from `peer`.
    Stream {
        /// The stream.
        id: StreamId,
        /// The stream's remote address (the client, or the PROXY source before it).
        peer: SocketAddr,
    },
}

impl Endpoint {
    /// The address of the other end (the cookie limiter keys on its IP).
    pub(crate) fn addr(&self) -> SocketAddr {
        match self {
            Endpoint::Udp(a) => *a,
            Endpoint::Stream { peer, .. } => *peer,
        }
    }

    /// The IP of the other end.
    pub(crate) fn ip(&self) -> IpAddr {
        self.addr().ip()
    }
}

impl std::fmt::Display for Endpoint {
    /// A UDP endpoint as its address (`10.0.0.2:51820`), a stream as `tcp:` and its peer.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Udp(a) => write!(f, "{a}"),
            Endpoint::Stream { peer, .. } => write!(f, "tcp:{peer}"),
        }
    }
}

/// One peer.
pub(crate) struct Peer {
    /// Its public key.
    pub(crate) key: WgKey,
    /// The noise session (called through [`Peer`]'s methods, inside `span`).
    pub(crate) tunn: Tunn,
    /// The span boringtun's log lines about this peer are written in.
    span: tracing::Span,
    /// Whether its session was live when last looked at (a change is reported once, see
    /// [`super::shoot::Session`]).
    pub(crate) up: bool,
    /// The inner source addresses it may send from (and the targets it is chosen for).
    pub(crate) allowed: Box<[Net]>,
    /// Where its last authenticated packet came from (or the configured endpoint).
    pub(crate) endpoint: Option<Endpoint>,
    /// When its last handshake completed.
    pub(crate) handshake_at: Option<Instant>,
    /// When it last sent an authenticated packet of any kind.
    pub(crate) heard_at: Option<Instant>,
    /// When a recovery handshake was last sent to it.
    pub(crate) recovery_at: Option<Instant>,
    /// Where that recovery handshake went (the source of the orphan packet): boringtun's own
    /// retries of it go there too while the endpoint is not known.
    pub(crate) recovery_to: Option<Endpoint>,
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

/// The span of a peer of `route`. Its target is boringtun's and its level the most severe,
/// so that any filter that lets one of boringtun's lines through lets the span through too;
/// it is created once per peer (its fields formatted then).
fn span(route: &str, key: &WgKey) -> tracing::Span {
    tracing::span!(
        target: "boringtun::noise",
        parent: None,
        tracing::Level::ERROR,
        "wireguard",
        route = %route,
        peer = %key.to_base64()
    )
}

/// Whether boringtun's lines on the packet path (debug and trace) are enabled.
fn packet_lines() -> bool {
    tracing::enabled!(target: "boringtun::noise", tracing::Level::DEBUG)
}

impl Peer {
    /// A peer of `route` with no session yet. `index` is the upper 24 bits of its receiver
    /// indexes.
    pub(crate) fn new(
        route: &str,
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
            span: span(route, &key),
            up: false,
            key,
            tunn,
            allowed,
            endpoint: None,
            handshake_at: None,
            heard_at: None,
            recovery_at: None,
            recovery_to: None,
            suspect: false,
        }
    }

    /// Decrypts (or answers) one datagram from `src` ([`Tunn::decapsulate`]); an empty
    /// datagram sends what boringtun queued.
    pub(crate) fn decapsulate<'a>(
        &mut self,
        src: Option<IpAddr>,
        datagram: &[u8],
        dst: &'a mut [u8],
    ) -> TunnResult<'a> {
        let _in = packet_lines().then(|| self.span.enter());
        self.tunn.decapsulate(src, datagram, dst)
    }

    /// Encrypts one IP packet ([`Tunn::encapsulate`]).
    pub(crate) fn encapsulate<'a>(&mut self, packet: &[u8], dst: &'a mut [u8]) -> TunnResult<'a> {
        let _in = packet_lines().then(|| self.span.enter());
        self.tunn.encapsulate(packet, dst)
    }

    /// Runs the session's timers ([`Tunn::update_timers`]).
    pub(crate) fn update_timers<'a>(&mut self, dst: &'a mut [u8]) -> TunnResult<'a> {
        let _in = self.span.enter();
        self.tunn.update_timers(dst)
    }

    /// A handshake initiation ([`Tunn::format_handshake_initiation`]).
    pub(crate) fn format_handshake_initiation<'a>(
        &mut self,
        dst: &'a mut [u8],
        force: bool,
    ) -> TunnResult<'a> {
        let _in = self.span.enter();
        self.tunn.format_handshake_initiation(dst, force)
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
