//! One shoot: its peers and its stack, joined by cryptokey routing. Decrypted packets are
//! admitted only from inside their peer's `allowedIPs`; packets the stack sends go to the
//! peer their flow is pinned to, else to the live peer whose `allowedIPs` hold the target
//! most specifically.
//!
//! On the agent ([`Mode::Agent`]) the stack accepts connections for any address inside its
//! networks: a SYN creates a socket that answers only after the agent's own dial
//! ([`Shoot::accepted`]), is reset when the dial is refused, and gets no answer at all when
//! the target is unreachable. Sans-IO: every call takes `now` and sends through an [`Io`].

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use boringtun::noise::errors::WireGuardError;
use boringtun::noise::{Tunn, TunnResult};
use smoltcp::iface::SocketHandle;
use smoltcp::wire::{IpProtocol, Ipv4Packet, Ipv6Packet, TcpPacket};

use super::peer::{Endpoint, Peer, REKEY_AFTER};
use super::stack::Stack;
use crate::route::{Net, WgKey};

/// Why a packet was dropped (`trellis_tunnel_packets_dropped_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Drop {
    /// A decrypted packet from outside its peer's `allowedIPs`.
    AllowedIps,
    /// A handshake from a key no route lists, or an index no peer has.
    UnknownPeer,
    /// A data packet whose counter was seen before (or is too old).
    Replay,
    /// A handshake answered with a cookie (under load) instead of a response.
    Cookie,
    /// No room to queue or send it.
    Busy,
    /// A TCP stream endpoint's queue is full (the stream cannot keep up).
    StreamFull,
    /// Malformed, or failed authentication.
    Invalid,
    /// A data packet for a session this process does not have.
    NoSession,
    /// The stack sent a packet to a peer whose endpoint is not known yet (or a TCP stream
    /// endpoint that has ended).
    NoEndpoint,
    /// The stack sent a packet no peer's `allowedIPs` hold.
    NoPeer,
    /// The agent got a connection for a target outside its networks (answered with a reset).
    NotAllowed,
}

impl Drop {
    /// The metric label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Drop::AllowedIps => "allowed_ips",
            Drop::UnknownPeer => "unknown_peer",
            Drop::Replay => "replay",
            Drop::Cookie => "cookie",
            Drop::Busy => "busy",
            Drop::StreamFull => "stream_full",
            Drop::Invalid => "invalid",
            Drop::NoSession => "no_session",
            Drop::NoEndpoint => "no_endpoint",
            Drop::NoPeer => "no_peer",
            Drop::NotAllowed => "not_allowed",
        }
    }

    /// The drop a noise error stands for.
    pub(crate) fn from_error(e: &WireGuardError) -> Drop {
        match e {
            WireGuardError::DuplicateCounter | WireGuardError::InvalidCounter => Drop::Replay,
            WireGuardError::NoCurrentSession | WireGuardError::WrongIndex => Drop::NoSession,
            WireGuardError::UnderLoad => Drop::Cookie,
            _ => Drop::Invalid,
        }
    }
}

/// A change of a peer's session, reported once per change ([`Io::session`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Session {
    /// It has a live session, and had none.
    Up,
    /// Its session lapsed (no handshake within REJECT_AFTER_TIME, or boringtun gave up).
    Lapsed {
        /// How long since its last authenticated packet.
        silent: Option<Duration>,
    },
}

/// Where a shoot's datagrams go, and what it reports.
pub(crate) trait Io {
    /// Sends one datagram (a full socket drops it and reports [`Drop::Busy`] itself).
    fn send(&mut self, to: Endpoint, datagram: &[u8]);
    /// A packet was dropped.
    fn dropped(&mut self, reason: Drop);
    /// A handshake of a peer of `route` completed.
    fn handshake(&mut self, _route: &str, _peer: &WgKey) {}
    /// A recovery handshake was sent to a peer of `route`.
    fn recovery(&mut self, _route: &str) {}
    /// Peer `peer` of `route` came up or lapsed.
    fn session(&mut self, _route: &str, _peer: &Peer, _change: Session) {}
}

/// Which end of the tunnel the shoot is.
#[derive(Debug, Clone)]
pub(crate) enum Mode {
    /// The gateway: answers on its local addresses and dials out.
    Gateway,
    /// The agent: terminates connections to any address in `networks`.
    Agent {
        /// What the agent dials.
        networks: Arc<[Net]>,
    },
}

/// A connection the shoot opened towards the agent, waiting for the agent's own dial.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Accept {
    /// The paused socket.
    pub(crate) handle: SocketHandle,
    /// The target the shoot-side client asked for.
    pub(crate) target: SocketAddr,
    /// The shoot-side client.
    pub(crate) client: SocketAddr,
}

/// What became of an agent's dial.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialed {
    /// Connected: answer the SYN.
    Connected,
    /// Refused: reset.
    Refused,
    /// No answer: stay silent (the client times out as it would against the target).
    Silent,
}

/// How long a target the agent could not reach stays silent for the same client port.
const SILENT_FOR: Duration = Duration::from_secs(30);
/// Scratch for handshake messages and keepalives.
const SMALL: usize = 256;
/// Scratch for one packet of the tunnel's MTU, encrypted or not.
const PACKET: usize = super::stack::MTU + 128;

/// `buf` with at least `n` bytes (grown, never shrunk).
fn scratch(buf: &mut Vec<u8>, n: usize) -> &mut [u8] {
    if buf.len() < n {
        buf.resize(n, 0);
    }
    &mut buf[..]
}

/// One shoot.
pub(crate) struct Shoot {
    /// The route (or agent) name, for metrics and logs.
    pub(crate) name: Arc<str>,
    /// Its peers.
    pub(crate) peers: Vec<Peer>,
    /// Its stack.
    pub(crate) stack: Stack,
    mode: Mode,
    /// Scratch for one datagram, grown on demand: an idle shoot holds a handshake's worth.
    buf: Vec<u8>,
    accepts: Vec<Accept>,
    silent: HashMap<(SocketAddr, SocketAddr), Instant>,
    /// Set when the shoot was removed from the table: its streams end (`route_removed`).
    pub(crate) removed: bool,
}

impl std::fmt::Debug for Shoot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shoot")
            .field("name", &self.name)
            .field("peers", &self.peers)
            .finish()
    }
}

/// How often an initiator starts over (WireGuard's REKEY_TIMEOUT).
const RETRY: Duration = Duration::from_secs(5);

/// Sends a handshake initiation of `p` to `to`.
fn initiate_peer(
    p: &mut Peer,
    buf: &mut [u8],
    now: Instant,
    to: Option<Endpoint>,
    force: bool,
    io: &mut impl Io,
) {
    if let TunnResult::WriteToNetwork(out) = p.format_handshake_initiation(buf, force) {
        match to {
            Some(to) => io.send(to, out),
            None => io.dropped(Drop::NoEndpoint),
        }
    }
    p.recovery_at = Some(now);
}

/// The TCP ends and flags of an IP packet, if it is TCP: (source, destination, SYN, ACK).
fn tcp_ends(packet: &[u8]) -> Option<(SocketAddr, SocketAddr, bool, bool)> {
    let (src, dst, proto, payload): (IpAddr, IpAddr, IpProtocol, &[u8]) = match packet.first()? >> 4
    {
        4 => {
            let p = Ipv4Packet::new_checked(packet).ok()?;
            let hl = usize::from(p.header_len());
            let total = usize::from(p.total_len()).min(packet.len());
            (
                IpAddr::V4(p.src_addr()),
                IpAddr::V4(p.dst_addr()),
                p.next_header(),
                packet.get(hl..total)?,
            )
        }
        6 => {
            let p = Ipv6Packet::new_checked(packet).ok()?;
            let end = (40 + usize::from(p.payload_len())).min(packet.len());
            (
                IpAddr::V6(p.src_addr()),
                IpAddr::V6(p.dst_addr()),
                p.next_header(),
                packet.get(40..end)?,
            )
        }
        _ => return None,
    };
    if proto != IpProtocol::Tcp {
        return None;
    }
    let t = TcpPacket::new_checked(payload).ok()?;
    Some((
        SocketAddr::new(src, t.src_port()),
        SocketAddr::new(dst, t.dst_port()),
        t.syn(),
        t.ack(),
    ))
}

/// Whether an IP packet is an ICMP(v6) message, and its destination.
fn icmp_to(packet: &[u8]) -> Option<IpAddr> {
    match packet.first()? >> 4 {
        4 => {
            let p = Ipv4Packet::new_checked(packet).ok()?;
            (p.next_header() == IpProtocol::Icmp).then(|| IpAddr::V4(p.dst_addr()))
        }
        6 => {
            let p = Ipv6Packet::new_checked(packet).ok()?;
            (p.next_header() == IpProtocol::Icmpv6).then(|| IpAddr::V6(p.dst_addr()))
        }
        _ => None,
    }
}

impl Shoot {
    /// A shoot with these peers and a stack on `addresses`.
    pub(crate) fn new(
        name: Arc<str>,
        peers: Vec<Peer>,
        addresses: &[IpAddr],
        mode: Mode,
        now: Instant,
        seed: u64,
    ) -> Shoot {
        let any_ip = matches!(mode, Mode::Agent { .. });
        Shoot {
            name,
            peers,
            stack: Stack::new(addresses, any_ip, now, seed),
            mode,
            buf: Vec::new(),
            accepts: Vec::new(),
            silent: HashMap::new(),
            removed: false,
        }
    }

    /// The position of the peer with this key.
    pub(crate) fn peer_position(&self, key: &WgKey) -> Option<usize> {
        self.peers.iter().position(|p| &p.key == key)
    }

    /// Handles one datagram authenticated as (or addressed to) peer `peer`; a decrypted
    /// packet is queued for the stack, which the caller runs ([`Shoot::flush`]) once per
    /// batch of datagrams. An error is the noise layer's verdict; nothing was delivered.
    pub(crate) fn receive(
        &mut self,
        now: Instant,
        peer: usize,
        from: Endpoint,
        datagram: &[u8],
        io: &mut impl Io,
    ) -> Result<(), WireGuardError> {
        let kind = datagram.first().copied().unwrap_or(0);
        let name = self.name.clone();
        let Shoot { peers, buf, .. } = self;
        let Some(p) = peers.get_mut(peer) else {
            return Err(WireGuardError::WrongKey);
        };
        let mut inner: Option<(usize, IpAddr)> = None;
        let buf = scratch(buf, datagram.len().max(PACKET));
        match p.decapsulate(Some(from.ip()), datagram, buf) {
            TunnResult::Done => {}
            TunnResult::Err(e) => return Err(e),
            TunnResult::WriteToNetwork(out) => {
                // The peer's own limiter answered with a cookie: nothing was authenticated
                // (the caller counts it as `cookie`).
                if out.first() == Some(&3) {
                    io.send(from, out);
                    return Err(WireGuardError::UnderLoad);
                }
                io.send(from, out);
                while let TunnResult::WriteToNetwork(out) = p.decapsulate(None, &[], buf) {
                    io.send(from, out);
                }
            }
            TunnResult::WriteToTunnelV4(pkt, src) => inner = Some((pkt.len(), IpAddr::V4(src))),
            TunnResult::WriteToTunnelV6(pkt, src) => inner = Some((pkt.len(), IpAddr::V6(src))),
        }
        // Authenticated: the peer is alive, and where a data packet (or a handshake
        // response) came from is where it is now (roaming). An initiation moves it only when
        // it has no endpoint: its response goes to its source anyway, and the initiator's
        // first packet on the new session then moves the peer. So a path that carries
        // nothing back (an agent's UDP probe through a one-way firewall) never takes the
        // peer's traffic away from the path that works.
        if kind != 1 || p.endpoint.is_none() {
            p.endpoint = Some(from);
        }
        p.suspect = false;
        p.heard_at = Some(now);
        if kind == 1 || kind == 2 {
            p.handshake_at = Some(now);
            p.recovery_at = None;
            p.recovery_to = None;
            io.handshake(&name, &p.key);
        }
        // A responder's session is live from the initiator's first packet on it, after the
        // handshake; once up, only the timer looks again (a bool per packet).
        if !p.up && p.live(now) {
            p.up = true;
            io.session(&name, p, Session::Up);
        }
        if let Some((len, src)) = inner {
            if !p.allows(src) {
                io.dropped(Drop::AllowedIps);
            } else {
                let key = p.key;
                let packet = buf[..len].to_vec();
                if self.admit(now, &packet, key, io) && !self.stack.push(&packet) {
                    io.dropped(Drop::Busy);
                }
            }
        }
        Ok(())
    }

    /// Whether a decrypted packet goes on into the stack: on the agent, a SYN to a target
    /// inside its networks opens a paused socket (and is reported by [`Shoot::take_accepts`]),
    /// pings reach only its own addresses.
    fn admit(&mut self, now: Instant, packet: &[u8], peer: WgKey, io: &mut impl Io) -> bool {
        let Mode::Agent { networks } = &self.mode else {
            return true;
        };
        if let Some(dst) = icmp_to(packet) {
            return self.stack.addresses().contains(&dst);
        }
        let Some((client, target, syn, ack)) = tcp_ends(packet) else {
            return true;
        };
        if !syn || ack || self.stack.flow_for(target, client).is_some() {
            return true;
        }
        if let Some(until) = self.silent.get(&(target, client)) {
            if now < *until {
                return false;
            }
            self.silent.remove(&(target, client));
        }
        if !networks.iter().any(|n| n.contains(target.ip())) {
            // No socket listens: the stack answers with a reset.
            io.dropped(Drop::NotAllowed);
            return true;
        }
        match self.stack.listen(target, client, Some(peer)) {
            Ok(handle) => {
                self.accepts.push(Accept {
                    handle,
                    target,
                    client,
                });
                // The stack takes this SYN now, before another listener for the same target
                // (a second client's SYN in the same batch) could be handed it.
                if !self.stack.push(packet) {
                    io.dropped(Drop::Busy);
                }
                self.flush(now, io);
                false
            }
            Err(_) => false,
        }
    }

    /// Connections the shoot opened since the last call (the agent dials each).
    pub(crate) fn take_accepts(&mut self) -> Vec<Accept> {
        std::mem::take(&mut self.accepts)
    }

    /// The agent's dial for `accept` ended: answer, reset or stay silent.
    pub(crate) fn accepted(
        &mut self,
        now: Instant,
        accept: &Accept,
        dialed: Dialed,
        io: &mut impl Io,
    ) {
        match dialed {
            Dialed::Connected => self.stack.release_synack(accept.handle),
            Dialed::Refused => self.stack.release(accept.handle, true, now),
            Dialed::Silent => {
                self.stack.forget(accept.handle);
                self.silent
                    .insert((accept.target, accept.client), now + SILENT_FOR);
            }
        }
        self.flush(now, io);
    }

    /// Runs the stack and sends what it produced.
    pub(crate) fn flush(&mut self, now: Instant, io: &mut impl Io) {
        self.stack.poll(now);
        let sent: Vec<Vec<u8>> = self.stack.take_sent().collect();
        for packet in sent {
            self.send_packet(now, &packet, io);
        }
        self.stack.reap(now);
    }

    /// The peer a packet from the stack goes to.
    fn peer_for(&self, now: Instant, packet: &[u8]) -> Option<usize> {
        if let Some((local, remote, _, _)) = tcp_ends(packet)
            && let Some(key) = self.stack.pinned_peer(local, remote)
        {
            return self.peer_position(&key);
        }
        let dst = Tunn::dst_address(packet)?;
        self.best_peer(now, dst)
    }

    /// The peer whose `allowedIPs` hold `dst` most specifically, live ones first.
    pub(crate) fn best_peer(&self, now: Instant, dst: IpAddr) -> Option<usize> {
        self.best_peer_except(now, dst, &[])
    }

    /// The peer a new connection to `dst` goes through, leaving out `tried`: live before
    /// not live, then the most specific `allowedIPs`, then not suspect, then the one
    /// carrying the fewest flows (two agent replicas share the load), then the first.
    pub(crate) fn best_peer_except(
        &self,
        now: Instant,
        dst: IpAddr,
        tried: &[usize],
    ) -> Option<usize> {
        self.peers
            .iter()
            .enumerate()
            .filter(|(i, _)| !tried.contains(i))
            .filter_map(|(i, p)| {
                let len = p.match_len(dst)?;
                let flows = if self.peers.len() > 1 {
                    self.stack.flows_of(&p.key)
                } else {
                    0
                };
                Some((
                    (
                        p.live(now),
                        len,
                        !p.suspect,
                        std::cmp::Reverse(flows),
                        std::cmp::Reverse(i),
                    ),
                    i,
                ))
            })
            .max_by_key(|(rank, _)| *rank)
            .map(|(_, i)| i)
    }

    fn send_packet(&mut self, now: Instant, packet: &[u8], io: &mut impl Io) {
        let Some(i) = self.peer_for(now, packet) else {
            io.dropped(Drop::NoPeer);
            return;
        };
        let Shoot { peers, buf, .. } = self;
        let p = &mut peers[i];
        let buf = scratch(buf, (packet.len() + 32).max(SMALL));
        match p.encapsulate(packet, buf) {
            TunnResult::WriteToNetwork(out) => match p.endpoint {
                Some(to) => io.send(to, out),
                None => io.dropped(Drop::NoEndpoint),
            },
            TunnResult::Err(_) => io.dropped(Drop::Invalid),
            _ => {}
        }
    }

    /// Runs the peers' timers (handshake retries, rekeys, keepalives) and the stack's.
    pub(crate) fn tick(&mut self, now: Instant, io: &mut impl Io) {
        let initiator = matches!(self.mode, Mode::Agent { .. });
        let Shoot { peers, buf, .. } = self;
        // update_timers may also send a packet boringtun queued while it had no session.
        let buf = scratch(buf, PACKET);
        for p in peers.iter_mut() {
            let to = p.endpoint.or(p.recovery_to);
            match p.update_timers(buf) {
                TunnResult::WriteToNetwork(out) => match to {
                    Some(to) => io.send(to, out),
                    None => io.dropped(Drop::NoEndpoint),
                },
                TunnResult::Err(WireGuardError::ConnectionExpired) => {
                    p.handshake_at = None;
                    // boringtun gives up after 90 s of unanswered initiations and stays
                    // expired; the initiator starts over (a fresh handshake every 5 s, the
                    // retry period, through boringtun's own retries of it).
                    if initiator
                        && p.recovery_at
                            .is_none_or(|at| now.saturating_duration_since(at) >= RETRY)
                    {
                        initiate_peer(p, buf, now, to, true, io);
                    }
                }
                _ => {
                    // An idle session is not rekeyed by boringtun (keepalives are not
                    // data): the initiator rekeys it before it lapses.
                    if initiator
                        && p.handshake_at
                            .is_some_and(|at| now.saturating_duration_since(at) >= REKEY_AFTER)
                        && p.recovery_at
                            .is_none_or(|at| now.saturating_duration_since(at) >= RETRY)
                    {
                        initiate_peer(p, buf, now, to, false, io);
                    }
                }
            }
            if p.up && !p.live(now) {
                p.up = false;
                let silent = p.heard_at.map(|at| now.saturating_duration_since(at));
                io.session(&self.name, p, Session::Lapsed { silent });
            }
        }
        self.silent.retain(|_, until| *until > now);
        self.flush(now, io);
    }

    /// Starts a handshake with peer `peer`: the agent's first, and a restarted gateway's
    /// recovery towards `to` (forced: an initiation still in progress from an earlier
    /// attempt, whose packets may be lost, does not hold it back).
    pub(crate) fn initiate(
        &mut self,
        now: Instant,
        peer: usize,
        to: Option<Endpoint>,
        io: &mut impl Io,
    ) {
        let recovery = to.is_some();
        let Shoot { peers, buf, .. } = self;
        let Some(p) = peers.get_mut(peer) else {
            return;
        };
        if recovery {
            p.recovery_to = to;
            io.recovery(&self.name);
        }
        initiate_peer(p, scratch(buf, SMALL), now, to.or(p.endpoint), recovery, io);
    }

    /// When the stack next needs a poll without new packets.
    pub(crate) fn poll_at(&mut self, now: Instant) -> Option<Instant> {
        self.stack.poll_at(now)
    }
}
