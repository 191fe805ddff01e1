//! Two devices in memory: a gateway shoot and an agent joined by a lossless link that the
//! test steps by hand, so handshakes, dials, refusals, replays and a restart run in
//! microseconds with no sockets. Also helpers for other modules' tests: [`bring_up`] gives
//! a shoot's peer a session by a handshake in memory, [`Recorder`] is an [`Io`] that keeps
//! what it was handed.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use smoltcp::socket::tcp;

use super::device::{self, Keys, Maps, Recovery, ShootCell, lock};
use super::peer::{Endpoint, Peer, REJECT_AFTER};
use super::shoot::{Dialed, Drop, Io, Mode, Session, Shoot};
use crate::route::{Net, WgKey};

const GW: &str = "10.0.0.1:51820";
const AGENT: &str = "10.0.0.2:40000";

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

pub(super) fn net(s: &str) -> Net {
    Net::parse(s).unwrap()
}

/// Datagrams in flight and drops seen, per side.
#[derive(Default)]
struct Wire {
    to_gw: VecDeque<(SocketAddr, Vec<u8>)>,
    to_agent: VecDeque<(SocketAddr, Vec<u8>)>,
    drops: Vec<Drop>,
    /// Datagrams sent towards the gateway, ever.
    sent_to_gw: usize,
    /// The gateway cannot be reached: datagrams towards it are lost.
    gw_cut: bool,
    handshakes: usize,
    recoveries: usize,
    /// Session changes each side reported.
    gw_sessions: Vec<Session>,
    agent_sessions: Vec<Session>,
}

/// An [`Io`] that keeps every datagram sent and every drop.
#[derive(Debug, Default)]
pub(super) struct Recorder {
    /// Datagrams sent, in order.
    pub(super) sent: Vec<(Endpoint, Vec<u8>)>,
    /// Drops, in order.
    pub(super) drops: Vec<Drop>,
}

impl Io for Recorder {
    fn send(&mut self, to: Endpoint, datagram: &[u8]) {
        self.sent.push((to, datagram.to_vec()));
    }
    fn dropped(&mut self, reason: Drop) {
        self.drops.push(reason);
    }
}

/// Gives the peer of `shoot` whose private key is `peer` (an agent replica) a session at
/// `now`: its initiation from `from` and its first packet on the new session (a keepalive)
/// are handed to the shoot, as from the wire, with the shoot's device key `gw`.
pub(super) fn bring_up(shoot: &mut Shoot, gw: WgKey, peer: WgKey, from: SocketAddr, now: Instant) {
    use boringtun::noise::{Tunn, TunnResult};
    use boringtun::x25519::{PublicKey, StaticSecret};
    let i = shoot
        .peer_position(&public(peer))
        .expect("a peer of the shoot");
    let mut agent = Tunn::new(
        StaticSecret::from(peer.0),
        PublicKey::from(public(gw).0),
        None,
        None,
        7,
        None,
    );
    let mut buf = vec![0u8; 2048];
    let TunnResult::WriteToNetwork(init) = agent.format_handshake_initiation(&mut buf, true) else {
        panic!("no initiation");
    };
    let init = init.to_vec();
    let mut io = Recorder::default();
    shoot
        .receive(now, i, Endpoint::Udp(from), &init, &mut io)
        .expect("initiation taken");
    let (_, response) = io.sent.pop().expect("a handshake response");
    let TunnResult::WriteToNetwork(keepalive) = agent.decapsulate(None, &response, &mut buf) else {
        panic!("no keepalive after the response");
    };
    let keepalive = keepalive.to_vec();
    shoot
        .receive(now, i, Endpoint::Udp(from), &keepalive, &mut io)
        .expect("keepalive taken");
    assert!(shoot.peers[i].live(now), "session up");
}

struct SideIo<'a> {
    wire: &'a mut Wire,
    from: SocketAddr,
}

impl Io for SideIo<'_> {
    fn send(&mut self, to: Endpoint, datagram: &[u8]) {
        let item = (self.from, datagram.to_vec());
        if to == Endpoint::Udp(addr(GW)) {
            self.wire.sent_to_gw += 1;
            if !self.wire.gw_cut {
                self.wire.to_gw.push_back(item);
            }
        } else {
            self.wire.to_agent.push_back(item);
        }
    }
    fn dropped(&mut self, reason: Drop) {
        self.wire.drops.push(reason);
    }
    fn handshake(&mut self, _: &str, _: &WgKey) {
        self.wire.handshakes += 1;
    }
    fn recovery(&mut self, _: &str) {
        self.wire.recoveries += 1;
    }
    fn session(&mut self, _: &str, _: &Peer, change: Session) {
        if self.from == addr(GW) {
            self.wire.gw_sessions.push(change);
        } else {
            self.wire.agent_sessions.push(change);
        }
    }
}

struct Side {
    keys: Keys,
    maps: Maps,
    recovery: Recovery,
    cell: ShootCell,
}

struct Pair {
    gw: Side,
    agent: Side,
    wire: Wire,
    gw_key: WgKey,
    agent_key: WgKey,
    /// The simulated time every call gets.
    now: Instant,
    /// Where the agent sends from (changed to roam).
    agent_addr: SocketAddr,
}

pub(super) fn key(b: u8) -> WgKey {
    // Any 32 bytes are a valid x25519 private key (clamped when used).
    WgKey([b; 32])
}

pub(super) fn public(k: WgKey) -> WgKey {
    let s = boringtun::x25519::StaticSecret::from(k.0);
    WgKey(boringtun::x25519::PublicKey::from(&s).to_bytes())
}

fn gateway_side(gw_key: WgKey, agent_pub: WgKey, allowed: &[&str]) -> Side {
    let keys = Keys::new(gw_key);
    let allowed: Vec<Net> = allowed.iter().map(|s| net(s)).collect();
    let peer = Peer::new(
        "shoot--a",
        &keys.secret,
        agent_pub,
        allowed.into(),
        keys.index_of(&agent_pub),
        None,
        None,
    );
    let ip: IpAddr = "192.168.128.1".parse().unwrap();
    let shoot = Shoot::new(
        "shoot--a".into(),
        vec![peer],
        &[ip],
        Mode::Gateway,
        Instant::now(),
        1,
    );
    let cell = Arc::new(Mutex::new(shoot));
    let mut maps = Maps::default();
    maps.insert(&keys, cell.clone());
    Side {
        keys,
        maps,
        recovery: Recovery::default(),
        cell,
    }
}

impl Pair {
    fn new() -> Pair {
        let (gw_key, agent_key) = (key(1), key(2));
        let gw = gateway_side(
            gw_key,
            public(agent_key),
            &["192.168.128.5/32", "10.250.0.0/16"],
        );
        let keys = Keys::new(agent_key);
        let gw_pub = public(gw_key);
        let mut peer = Peer::new(
            "agent",
            &keys.secret,
            gw_pub,
            vec![net("0.0.0.0/0"), net("::/0")].into(),
            keys.index_of(&gw_pub),
            Some(25),
            Some(keys.limiter.clone()),
        );
        peer.endpoint = Some(Endpoint::Udp(addr(GW)));
        let ip: IpAddr = "192.168.128.5".parse().unwrap();
        let mode = Mode::Agent {
            networks: vec![net("10.250.0.0/16")].into(),
        };
        let shoot = Shoot::new("agent".into(), vec![peer], &[ip], mode, Instant::now(), 2);
        let cell = Arc::new(Mutex::new(shoot));
        let mut maps = Maps::default();
        maps.insert(&keys, cell.clone());
        Pair {
            gw,
            agent: Side {
                keys,
                maps,
                recovery: Recovery::default(),
                cell,
            },
            wire: Wire::default(),
            gw_key,
            agent_key,
            now: Instant::now(),
            agent_addr: addr(AGENT),
        }
    }

    /// Moves simulated time on (and boringtun's clock with it under `mock-clock`), running
    /// both sides' timers once a second.
    fn step(&mut self, by: std::time::Duration) {
        let tick = std::time::Duration::from_millis(250);
        let mut left = by;
        while !left.is_zero() {
            let d = left.min(tick);
            left -= d;
            self.now += d;
            #[cfg(feature = "mock-clock")]
            mock_instant::MockClock::advance(d);
            let (g, a) = (self.gw.cell.clone(), self.agent.cell.clone());
            let now = self.now;
            lock(&g).tick(now, &mut self.gw_io());
            lock(&a).tick(now, &mut self.agent_io());
            self.run();
        }
    }

    /// Delivers datagrams both ways until the link is quiet; returns how many moved.
    fn run(&mut self) -> usize {
        for moved in 0..10_000 {
            let now = self.now;
            if let Some((_, d)) = self.wire.to_gw.pop_front() {
                let from = self.agent_addr;
                let mut io = SideIo {
                    wire: &mut self.wire,
                    from: addr(GW),
                };
                if let Some(cell) = device::receive(
                    &self.gw.keys,
                    &self.gw.maps,
                    &self.gw.recovery,
                    now,
                    Endpoint::Udp(from),
                    &d,
                    &mut io,
                ) {
                    lock(&cell).flush(now, &mut io);
                }
            } else if let Some((from, d)) = self.wire.to_agent.pop_front() {
                let mut io = SideIo {
                    wire: &mut self.wire,
                    from: addr(AGENT),
                };
                if let Some(cell) = device::receive(
                    &self.agent.keys,
                    &self.agent.maps,
                    &self.agent.recovery,
                    now,
                    Endpoint::Udp(from),
                    &d,
                    &mut io,
                ) {
                    lock(&cell).flush(now, &mut io);
                }
            } else {
                return moved;
            }
        }
        panic!("the link never went quiet");
    }

    /// Hands the gateway one datagram from `from`, without running its stack.
    fn deliver_to_gw(&mut self, from: SocketAddr, datagram: &[u8]) {
        let now = self.now;
        let mut io = SideIo {
            wire: &mut self.wire,
            from: addr(GW),
        };
        device::receive(
            &self.gw.keys,
            &self.gw.maps,
            &self.gw.recovery,
            now,
            Endpoint::Udp(from),
            datagram,
            &mut io,
        );
    }

    /// A keepalive the agent encrypts on its current session (not sent).
    fn agent_keepalive(&self) -> Vec<u8> {
        let mut s = lock(&self.agent.cell);
        let mut buf = vec![0u8; 256];
        let boringtun::noise::TunnResult::WriteToNetwork(d) =
            s.peers[0].tunn.encapsulate(&[], &mut buf)
        else {
            panic!("no keepalive");
        };
        d.to_vec()
    }

    fn gw_io(&mut self) -> SideIo<'_> {
        SideIo {
            wire: &mut self.wire,
            from: addr(GW),
        }
    }

    fn agent_io(&mut self) -> SideIo<'_> {
        let from = self.agent_addr;
        SideIo {
            wire: &mut self.wire,
            from,
        }
    }

    fn handshake(&mut self) {
        let cell = self.agent.cell.clone();
        let now = self.now;
        lock(&cell).initiate(now, 0, None, &mut self.agent_io());
        self.run();
        assert!(
            lock(&self.gw.cell).peers[0].live(self.now),
            "gateway session up"
        );
    }

    /// The gateway dials `target`; the agent answers as `dialed`.
    fn dial(&mut self, target: &str, dialed: Dialed) -> smoltcp::iface::SocketHandle {
        let cell = self.gw.cell.clone();
        let now = self.now;
        let h = {
            let mut s = lock(&cell);
            let key = s.peers[0].key;
            let h = s.stack.connect(addr(target), Some(key)).unwrap();
            s.flush(now, &mut self.gw_io());
            h
        };
        self.run();
        let acell = self.agent.cell.clone();
        let accepts = lock(&acell).take_accepts();
        assert_eq!(accepts.len(), 1, "the agent saw one new connection");
        assert_eq!(accepts[0].target, addr(target));
        let now = self.now;
        lock(&acell).accepted(now, &accepts[0], dialed, &mut self.agent_io());
        self.run();
        h
    }
}

#[test]
fn a_handshake_makes_both_ends_live_and_a_dial_connects_end_to_end() {
    let mut p = Pair::new();
    p.handshake();
    assert!(lock(&p.agent.cell).peers[0].live(p.now));
    assert!(p.wire.handshakes >= 2);
    let h = p.dial("10.250.0.10:443", Dialed::Connected);
    let state = lock(&p.gw.cell).stack.socket(h).state();
    assert_eq!(state, tcp::State::Established);

    // Bytes each way, through both stacks and both noise sessions.
    let payload: Vec<u8> = (0..50_000u32).map(|i| i as u8).collect();
    let mut sent = 0;
    let mut got = Vec::new();
    let ah = lock(&p.agent.cell)
        .stack
        .flow_for(
            addr("10.250.0.10:443"),
            lock(&p.gw.cell).stack.flow(h).unwrap().local,
        )
        .unwrap();
    while got.len() < payload.len() {
        {
            let cell = p.gw.cell.clone();
            let mut s = lock(&cell);
            let sock = s.stack.socket(h);
            if sent < payload.len() && sock.can_send() {
                sent += sock.send_slice(&payload[sent..]).unwrap();
            }
            s.flush(p.now, &mut p.gw_io());
        }
        p.run();
        let cell = p.agent.cell.clone();
        let mut s = lock(&cell);
        let sock = s.stack.socket(ah);
        let mut buf = [0u8; 8192];
        while sock.can_recv() {
            let n = sock.recv_slice(&mut buf).unwrap();
            got.extend_from_slice(&buf[..n]);
        }
        s.flush(p.now, &mut p.agent_io());
        drop(s);
        p.run();
    }
    assert_eq!(got, payload);
    assert!(p.wire.drops.is_empty(), "{:?}", p.wire.drops);
}

/// The lines written in the JSON log format (`--log-format json`) while `f` runs, at every
/// level.
fn json_logs(f: impl FnOnce()) -> Vec<serde_json::Value> {
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Lines {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// boringtun's own lines (target `boringtun::…`, here its handshake on both ends), as
/// (route, peer) from the span the JSON format prints with each.
fn boringtun_lines(lines: &[serde_json::Value]) -> Vec<(&serde_json::Value, (String, String))> {
    lines
        .iter()
        .filter(|l| {
            l["target"]
                .as_str()
                .is_some_and(|t| t.starts_with("boringtun"))
        })
        .map(|l| {
            let field = |f: &str| l["span"][f].as_str().unwrap_or("-").to_owned();
            (l, (field("route"), field("peer")))
        })
        .collect()
}

/// Every line boringtun writes while handling packets names the route and the peer.
#[test]
fn boringtuns_lines_name_their_route_and_peer() {
    let lines = json_logs(|| Pair::new().handshake());
    let on_gw = ("shoot--a".to_owned(), public(key(2)).to_base64());
    let on_agent = ("agent".to_owned(), public(key(1)).to_base64());
    let boringtun = boringtun_lines(&lines);
    assert!(
        boringtun.iter().any(|(_, about)| *about == on_gw),
        "{lines:?}"
    );
    assert!(
        boringtun.iter().any(|(_, about)| *about == on_agent),
        "{lines:?}"
    );
    for (line, about) in &boringtun {
        assert!(*about == on_gw || *about == on_agent, "{line}");
    }
}

/// A peer's session coming up and lapsing is reported once per change, on each side: not
/// per packet, not across a rekey. The lapse comes REJECT_AFTER_TIME after the last
/// handshake of an agent that cannot get through, with the time since its last packet.
#[test]
fn a_session_coming_up_and_lapsing_is_reported_once_per_change() {
    use std::time::Duration;
    let mut p = Pair::new();
    p.handshake();
    assert_eq!(p.wire.gw_sessions, [Session::Up]);
    assert_eq!(p.wire.agent_sessions, [Session::Up]);

    // Traffic, and the agent's rekey 120 s in: still the one change.
    let h = p.dial("10.250.0.10:443", Dialed::Connected);
    let data: Vec<u8> = (0..5_000u32).map(|i| i as u8).collect();
    assert_eq!(transfer(&mut p, h, &data, None), data);
    let first = p.wire.handshakes;
    p.step(Duration::from_secs(125));
    assert!(p.wire.handshakes > first, "rekeyed");
    let rekeyed = lock(&p.gw.cell).peers[0].handshake_at.unwrap();
    assert_eq!(p.wire.gw_sessions, [Session::Up]);
    assert_eq!(p.wire.agent_sessions, [Session::Up]);

    // 30 s later the agent's last packet reaches the gateway; then nothing does.
    p.step(Duration::from_secs(30));
    let d = p.agent_keepalive();
    p.deliver_to_gw(p.agent_addr, &d);
    let last = p.now;
    p.wire.gw_cut = true;
    // Lapsed (REJECT_AFTER_TIME after the rekey, or sooner where boringtun gives up on a
    // handshake of its own) in one of these seconds, and reported with the time since that
    // packet (not since the handshake, which came about 35 s before it).
    let mut lapsed = None;
    for _ in 0..300 {
        p.step(Duration::from_secs(1));
        if lapsed.is_none() && p.wire.gw_sessions.len() > 1 {
            lapsed = Some(p.now);
        }
    }
    let [
        Session::Up,
        Session::Lapsed {
            silent: Some(silent),
        },
    ] = p.wire.gw_sessions[..]
    else {
        panic!("{:?}", p.wire.gw_sessions);
    };
    let by = lapsed.unwrap() - last;
    assert!(
        silent <= by && silent + Duration::from_secs(1) >= by,
        "{silent:?} since the last packet, lapsed by {by:?}"
    );
    assert!(by <= rekeyed + REJECT_AFTER - last + Duration::from_secs(1));
    assert_eq!(
        p.wire.agent_sessions.len(),
        2,
        "{:?}",
        p.wire.agent_sessions
    );

    // Reachable again, a new handshake (the agent's lane starts one, forced): up once more.
    p.wire.gw_cut = false;
    let cell = p.agent.cell.clone();
    let now = p.now;
    lock(&cell).initiate(now, 0, Some(Endpoint::Udp(addr(GW))), &mut p.agent_io());
    p.run();
    p.step(Duration::from_secs(30));
    assert_eq!(p.wire.gw_sessions.len(), 3, "{:?}", p.wire.gw_sessions);
    assert_eq!(p.wire.gw_sessions[2], Session::Up);
    assert_eq!(
        p.wire.agent_sessions.len(),
        3,
        "{:?}",
        p.wire.agent_sessions
    );
    assert_eq!(p.wire.agent_sessions[2], Session::Up);
}

#[test]
fn a_refused_target_resets_the_dial_and_outside_the_networks_is_refused_and_counted() {
    let mut p = Pair::new();
    p.handshake();
    let h = p.dial("10.250.0.11:80", Dialed::Refused);
    assert_eq!(lock(&p.gw.cell).stack.socket(h).state(), tcp::State::Closed);

    // A target outside the agent's networks: no accept, a reset, a drop counted.
    let cell = p.gw.cell.clone();
    let h = {
        let mut s = lock(&cell);
        let key = s.peers[0].key;
        // The gateway only dials what the peer allows; force the packet through anyway.
        s.peers[0].allowed = vec![net("0.0.0.0/0")].into();
        let h = s.stack.connect(addr("10.99.0.1:443"), Some(key)).unwrap();
        s.flush(p.now, &mut p.gw_io());
        h
    };
    p.run();
    assert!(lock(&p.agent.cell).take_accepts().is_empty());
    assert!(p.wire.drops.contains(&Drop::NotAllowed));
    assert_eq!(lock(&cell).stack.socket(h).state(), tcp::State::Closed);
}

#[test]
fn an_unreachable_target_gets_no_answer() {
    let mut p = Pair::new();
    p.handshake();
    let h = p.dial("10.250.0.12:443", Dialed::Silent);
    assert_eq!(
        lock(&p.gw.cell).stack.socket(h).state(),
        tcp::State::SynSent
    );
}

#[test]
fn packets_from_outside_the_peers_allowed_ips_are_dropped_and_counted() {
    let mut p = Pair::new();
    // The gateway allows the agent only its tunnel address: the agent's answer from a
    // shoot address is not admitted.
    p.gw = gateway_side(p.gw_key, public(p.agent_key), &["192.168.128.5/32"]);
    p.handshake();
    let cell = p.gw.cell.clone();
    {
        let mut s = lock(&cell);
        let key = s.peers[0].key;
        s.stack.connect(addr("10.250.0.10:443"), Some(key)).unwrap();
        s.flush(p.now, &mut p.gw_io());
    }
    p.run();
    let acell = p.agent.cell.clone();
    let a = lock(&acell).take_accepts();
    lock(&acell).accepted(p.now, &a[0], Dialed::Connected, &mut p.agent_io());
    p.run();
    assert!(
        p.wire.drops.contains(&Drop::AllowedIps),
        "{:?}",
        p.wire.drops
    );
}

#[test]
fn a_replayed_data_packet_is_dropped_and_counted() {
    let mut p = Pair::new();
    p.handshake();
    // A keepalive from the agent, captured and delivered twice.
    let d = p.agent_keepalive();
    p.wire.to_gw.push_back((addr(AGENT), d.clone()));
    p.wire.to_gw.push_back((addr(AGENT), d.clone()));
    p.run();
    assert_eq!(p.wire.drops, vec![Drop::Replay]);
}

#[test]
fn an_unknown_key_is_dropped_and_counted() {
    let mut p = Pair::new();
    // The gateway knows a different agent key.
    p.gw = gateway_side(p.gw_key, public(key(9)), &["192.168.128.5/32"]);
    let cell = p.agent.cell.clone();
    lock(&cell).initiate(p.now, 0, None, &mut p.agent_io());
    p.run();
    assert!(p.wire.drops.contains(&Drop::UnknownPeer));
    assert!(!lock(&p.gw.cell).peers[0].live(p.now));
}

#[test]
fn a_restarted_gateway_recovers_a_sending_shoot_with_one_handshake() {
    let mut p = Pair::new();
    p.handshake();
    // The gateway restarts: same key, no sessions.
    p.gw = gateway_side(
        p.gw_key,
        public(p.agent_key),
        &["192.168.128.5/32", "10.250.0.0/16"],
    );
    assert!(!lock(&p.gw.cell).peers[0].live(p.now));
    // The shoot sends a packet on its old session.
    let d = p.agent_keepalive();
    p.wire.to_gw.push_back((addr(AGENT), d.clone()));
    p.run();
    assert_eq!(p.wire.recoveries, 1);
    assert!(lock(&p.gw.cell).peers[0].live(p.now), "usable again");
    // A second orphan packet within the per-peer period starts no second handshake.
    let h = p.dial("10.250.0.10:443", Dialed::Connected);
    assert_eq!(
        lock(&p.gw.cell).stack.socket(h).state(),
        tcp::State::Established
    );
    assert_eq!(p.wire.recoveries, 1);
}

#[test]
fn recovery_is_limited_per_peer() {
    let mut p = Pair::new();
    p.handshake();
    p.gw = gateway_side(p.gw_key, public(p.agent_key), &["192.168.128.5/32"]);
    // Orphan packets from a forged source: only one handshake goes out in the period.
    for _ in 0..5 {
        let d = p.agent_keepalive();
        p.deliver_to_gw(addr("10.9.9.9:1"), &d);
    }
    assert_eq!(p.wire.recoveries, 1);
}

/// Sends `data` from the gateway's socket `h` to the agent's end and returns what the agent
/// read, stepping time `step` per round (so losses are repaired by retransmission).
fn transfer(
    p: &mut Pair,
    h: smoltcp::iface::SocketHandle,
    data: &[u8],
    lose: Option<usize>,
) -> Vec<u8> {
    let local = lock(&p.gw.cell).stack.flow(h).unwrap().local;
    let remote = lock(&p.gw.cell).stack.flow(h).unwrap().remote;
    let ah = lock(&p.agent.cell).stack.flow_for(remote, local).unwrap();
    let (mut sent, mut got, mut rounds) = (0, Vec::new(), 0);
    let mut datagrams = 0usize;
    while got.len() < data.len() {
        rounds += 1;
        assert!(
            rounds < 10_000,
            "transfer stalled at {} of {}",
            got.len(),
            data.len()
        );
        {
            let cell = p.gw.cell.clone();
            let mut s = lock(&cell);
            let sock = s.stack.socket(h);
            if sent < data.len() && sock.can_send() {
                sent += sock.send_slice(&data[sent..]).unwrap();
            }
            let now = p.now;
            s.flush(now, &mut p.gw_io());
        }
        if let Some(n) = lose {
            // Lose the n-th datagram towards the agent.
            let before = datagrams;
            datagrams += p.wire.to_agent.len();
            if before <= n && n < datagrams {
                p.wire.to_agent.remove(n - before);
            }
        }
        p.run();
        let cell = p.agent.cell.clone();
        let mut s = lock(&cell);
        let sock = s.stack.socket(ah);
        let mut buf = [0u8; 8192];
        while sock.can_recv() {
            let n = sock.recv_slice(&mut buf).unwrap();
            got.extend_from_slice(&buf[..n]);
        }
        let now = p.now;
        s.flush(now, &mut p.agent_io());
        drop(s);
        p.run();
        p.step(std::time::Duration::from_millis(250));
    }
    got
}

#[test]
fn a_lost_packet_is_retransmitted() {
    let mut p = Pair::new();
    p.handshake();
    let h = p.dial("10.250.0.10:443", Dialed::Connected);
    let data: Vec<u8> = (0..20_000u32).map(|i| (i % 253) as u8).collect();
    assert_eq!(transfer(&mut p, h, &data, Some(3)), data);
}

#[test]
fn a_roaming_shoot_is_followed_to_its_new_address() {
    let mut p = Pair::new();
    p.handshake();
    let h = p.dial("10.250.0.10:443", Dialed::Connected);
    assert_eq!(
        lock(&p.gw.cell).peers[0].endpoint,
        Some(Endpoint::Udp(addr(AGENT)))
    );
    // The shoot's source port changes (a NAT rebinding); its next packets authenticate.
    p.agent_addr = addr("10.0.0.2:40123");
    let d = p.agent_keepalive();
    p.wire.to_gw.push_back((p.agent_addr, d.clone()));
    p.run();
    assert_eq!(
        lock(&p.gw.cell).peers[0].endpoint,
        Some(Endpoint::Udp(addr("10.0.0.2:40123")))
    );
    // The stream goes on, towards the new address.
    let data: Vec<u8> = (0..5_000u32).map(|i| i as u8).collect();
    assert_eq!(transfer(&mut p, h, &data, None), data);
}

/// A handshake initiation from a new address (an agent probing UDP while its traffic goes
/// over a CONNECT stream, through a firewall that lets nothing back) is answered there but
/// does not move the peer; the initiator's first packet on the new session does.
#[test]
fn an_initiation_from_a_new_address_is_answered_but_only_data_moves_the_peer() {
    let mut p = Pair::new();
    p.handshake();
    let old = Some(Endpoint::Udp(addr(AGENT)));
    assert_eq!(lock(&p.gw.cell).peers[0].endpoint, old);
    // A later timestamp than the first initiation's, on either clock.
    #[cfg(not(feature = "mock-clock"))]
    std::thread::sleep(std::time::Duration::from_millis(2));
    #[cfg(feature = "mock-clock")]
    mock_instant::MockClock::advance(std::time::Duration::from_millis(10));
    let init = {
        let mut s = lock(&p.agent.cell);
        let mut buf = vec![0u8; 256];
        let boringtun::noise::TunnResult::WriteToNetwork(init) =
            s.peers[0].tunn.format_handshake_initiation(&mut buf, true)
        else {
            panic!("no initiation");
        };
        init.to_vec()
    };
    let new = addr("10.0.0.2:40999");
    p.deliver_to_gw(new, &init);
    assert_eq!(
        p.wire.to_agent.back().map(|(_, d)| d[0]),
        Some(2),
        "answered"
    );
    assert_eq!(lock(&p.gw.cell).peers[0].endpoint, old);
    // The answer reaches the agent, whose keepalive on the new session comes from the new
    // address: that moves the peer.
    p.agent_addr = new;
    p.run();
    assert_eq!(lock(&p.gw.cell).peers[0].endpoint, Some(Endpoint::Udp(new)));
}

#[test]
fn handshakes_beyond_the_device_limit_get_cookie_replies() {
    let mut p = Pair::new();
    let acell = p.agent.cell.clone();
    let mut buf = vec![0u8; 256];
    let mut cookies = 0;
    // Each initiation is counted twice (the device's check and the session's).
    for _ in 0..(super::device::HANDSHAKES_BEFORE_COOKIES / 2 + 5) {
        let mut s = lock(&acell);
        let boringtun::noise::TunnResult::WriteToNetwork(init) =
            s.peers[0].tunn.format_handshake_initiation(&mut buf, true)
        else {
            panic!("no initiation");
        };
        let init = init.to_vec();
        drop(s);
        p.deliver_to_gw(addr(AGENT), &init);
        cookies = p.wire.drops.iter().filter(|d| **d == Drop::Cookie).count();
        // Replies go nowhere: this is a flood.
        p.wire.to_agent.clear();
    }
    assert!(cookies >= 5, "{cookies} cookie replies");
    // A second later the limiter has been reset: the initiator's retransmission (after
    // REKEY_TIMEOUT) is answered again.
    #[cfg(not(feature = "mock-clock"))]
    std::thread::sleep(std::time::Duration::from_millis(1100));
    #[cfg(feature = "mock-clock")]
    mock_instant::MockClock::advance(std::time::Duration::from_millis(1100));
    p.gw.keys.limiter.reset_count();
    p.wire.drops.clear();
    p.step(std::time::Duration::from_secs(6));
    assert!(lock(&p.gw.cell).peers[0].live(p.now), "{:?}", p.wire.drops);
    assert!(!p.wire.drops.contains(&Drop::Cookie));
}

/// boringtun's timers on the stepped clock (`cargo test --features mock-clock`).
#[cfg(feature = "mock-clock")]
mod stepped {
    use super::*;
    use std::time::Duration;

    /// boringtun's timer warnings (an unanswered handshake retried) name the route and the
    /// peer too.
    #[test]
    fn boringtuns_timer_warnings_name_their_route_and_peer() {
        let lines = json_logs(|| {
            let mut p = Pair::new();
            p.handshake();
            // The agent's rekey 120 s in goes unanswered.
            p.wire.gw_cut = true;
            p.step(Duration::from_secs(130));
        });
        let on_agent = ("agent".to_owned(), public(key(1)).to_base64());
        let retried = boringtun_lines(&lines)
            .into_iter()
            .find(|(l, _)| l["message"] == "HANDSHAKE(REKEY_TIMEOUT)");
        let Some((line, about)) = retried else {
            panic!("no retry in {lines:?}");
        };
        assert_eq!((&line["level"], about), (&"WARN".into(), on_agent));
    }

    #[test]
    fn persistent_keepalives_flow_every_25_seconds() {
        let mut p = Pair::new();
        p.handshake();
        let before = p.gw.maps.by_key.len();
        assert_eq!(before, 1);
        // Count datagrams the gateway receives over 100 idle seconds.
        let before = p.wire.sent_to_gw;
        p.step(Duration::from_secs(100));
        let received = p.wire.sent_to_gw - before;
        assert!(
            (3..=6).contains(&received),
            "{received} keepalives in 100 s"
        );
        assert!(lock(&p.gw.cell).peers[0].live(p.now));
    }

    #[test]
    fn the_initiator_rekeys_after_120_seconds_of_traffic_and_streams_go_on() {
        let mut p = Pair::new();
        p.handshake();
        let h = p.dial("10.250.0.10:443", Dialed::Connected);
        let first = p.wire.handshakes;
        let data: Vec<u8> = (0..2_000u32).map(|i| i as u8).collect();
        // Traffic every 10 simulated seconds for 130 s.
        for _ in 0..13 {
            assert_eq!(transfer(&mut p, h, &data, None), data);
            p.step(Duration::from_secs(10));
        }
        assert!(
            p.wire.handshakes > first,
            "a new handshake after REKEY_AFTER_TIME"
        );
        assert_eq!(transfer(&mut p, h, &data, None), data);
    }

    #[test]
    fn the_agent_starts_over_after_the_gateway_was_unreachable_beyond_90_seconds() {
        let mut p = Pair::new();
        p.handshake();
        p.wire.gw_cut = true;
        p.step(Duration::from_secs(200));
        assert!(!lock(&p.agent.cell).peers[0].live(p.now));
        p.wire.gw_cut = false;
        p.step(Duration::from_secs(10));
        assert!(
            lock(&p.agent.cell).peers[0].live(p.now),
            "up again within 10 s"
        );
        assert!(lock(&p.gw.cell).peers[0].live(p.now));
    }

    #[test]
    fn an_idle_tunnel_never_lapses() {
        let mut p = Pair::new();
        p.handshake();
        for _ in 0..60 {
            p.step(Duration::from_secs(10));
            assert!(
                lock(&p.gw.cell).peers[0].live(p.now),
                "gateway at {:?}",
                p.now
            );
            assert!(
                lock(&p.agent.cell).peers[0].live(p.now),
                "agent at {:?}",
                p.now
            );
        }
    }

    #[test]
    fn a_lost_recovery_handshake_is_retried_without_waiting_90_seconds() {
        let mut p = Pair::new();
        p.handshake();
        p.gw = gateway_side(
            p.gw_key,
            public(p.agent_key),
            &["192.168.128.5/32", "10.250.0.0/16"],
        );
        let d = p.agent_keepalive();
        p.wire.to_gw.push_back((p.agent_addr, d.clone()));
        // The gateway's recovery initiation is lost on the way.
        let (_, d) = p.wire.to_gw.pop_front().unwrap();
        p.deliver_to_gw(addr(AGENT), &d);
        assert_eq!(p.wire.recoveries, 1);
        p.wire.to_agent.clear();
        // boringtun retries it after REKEY_TIMEOUT, to where the orphan packet came from.
        p.step(Duration::from_secs(7));
        assert!(lock(&p.gw.cell).peers[0].live(p.now), "{:?}", p.wire.drops);
    }
}
