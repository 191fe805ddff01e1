//! The tokio side of the tunnel: the UDP receive task, the one timer, table changes
//! ([`super::reconcile`] plans them, this publishes the result), dials from the gateway
//! ([`super::failover`] chooses the peers, this opens the attempts and waits) and connections
//! accepted on the agent.
//!
//! Threading: each shoot is one `Mutex` ([`super::device::ShootCell`]). The UDP task, the
//! timer and every stream's task lock the shoot they touch and do the work there and then
//! (decrypt, run the stack, encrypt, send), so a connection accepted on any worker reaches
//! its shoot with no hop and no channel; shoots never wait for each other.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use boringtun::noise::TunnResult;
use tokio::net::UdpSocket;
use tokio::sync::{Notify, mpsc};

use super::device::{Keys, Maps, Recovery, ShootCell, lock};
use super::failover::{Choice, DialError, Failover, Unanswered};
use super::peer::Endpoint;
use super::queues::Streams;
use super::reconcile::{current, reconcile};
// The agent takes `Incoming` from here.
pub(crate) use super::shared::Incoming;
use super::shared::{Inner, State, Tunnels};
use super::shoot::{Accept, Dialed, Io, Mode, Shoot};
use super::stream::{StreamMetrics, TunnelStream};
use crate::admin::metrics::{
    RouteDirectionLabels, RouteLabel, RoutePeerLabels, RouteReasonLabels, RouteResultLabels,
    TunnelMetrics,
};
use crate::route::{Net, Tunnel, WgKey};

/// Connections the agent accepted and has not started dialing yet, at most (across its
/// devices).
pub(crate) const ACCEPT_QUEUE: usize = 1024;

/// Datagrams handled before each touched shoot's stack runs.
const RECEIVE_BATCH: usize = 64;

/// How often every peer's timers run (WireGuard's own resolution is coarser).
const TIMER_TICK: Duration = Duration::from_millis(250);

/// The agent's view of its gateway peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GatewayPeer {
    /// Where its datagrams go now (the last authenticated packet's source, or where the
    /// agent pointed it).
    pub(crate) endpoint: Option<Endpoint>,
    /// When its last handshake completed.
    pub(crate) handshake_at: Option<Instant>,
    /// When it last sent an authenticated packet.
    pub(crate) heard_at: Option<Instant>,
    /// Whether it has a usable session.
    pub(crate) live: bool,
}

/// The agent's side of its one tunnel.
#[derive(Debug, Clone)]
pub(crate) struct AgentSide {
    /// The gateway's public key.
    pub(crate) gateway: WgKey,
    /// The agent's addresses inside the tunnel.
    pub(crate) addresses: Vec<std::net::IpAddr>,
    /// What the agent dials.
    pub(crate) networks: Arc<[Net]>,
    /// Persistent keepalive, seconds.
    pub(crate) keepalive: Option<u16>,
}

/// The live state of one peer, for `/routes`.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PeerStatus {
    /// The peer's public key.
    pub(crate) public_key: String,
    /// Where its packets come from.
    pub(crate) endpoint: Option<String>,
    /// Seconds since its last handshake.
    pub(crate) last_handshake_seconds_ago: Option<u64>,
    /// Whether it has a usable session.
    pub(crate) live: bool,
    /// A dial through it went unanswered and nothing came from it since: new streams go
    /// through other peers first.
    pub(crate) suspect: bool,
    /// Tunneled streams through it (and sockets still closing).
    pub(crate) streams: usize,
}

/// One shoot's live state, for `/routes`.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ShootStatus {
    /// Its peers.
    pub(crate) peers: Vec<PeerStatus>,
    /// Streams (and closing sockets) in its stack.
    pub(crate) streams: usize,
}

fn seed() -> u64 {
    let mut b = [0u8; 8];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
    u64::from_le_bytes(b)
}

impl Tunnels {
    /// A gateway device on `socket` with `private` as its key and no shoots yet.
    pub(crate) fn gateway(
        socket: UdpSocket,
        private: WgKey,
        metrics: Arc<TunnelMetrics>,
    ) -> Tunnels {
        Self::new(socket, private, metrics, Mode::Gateway, None)
    }

    fn new(
        socket: UdpSocket,
        private: WgKey,
        metrics: Arc<TunnelMetrics>,
        mode: Mode,
        accepts: Option<mpsc::Sender<Incoming>>,
    ) -> Tunnels {
        let inner = Arc::new(Inner {
            socket: Arc::new(socket),
            state: ArcSwap::from_pointee(State {
                keys: Keys::new(private),
                maps: Maps::default(),
            }),
            recovery: Recovery::default(),
            metrics,
            streams: Streams::default(),
            wake: Notify::new(),
            apply: Mutex::new(()),
            accepts,
            mode,
        });
        let t = Tunnels { inner };
        tokio::spawn(t.clone().receive_loop());
        tokio::spawn(t.clone().timer_loop());
        t
    }

    /// An agent device: one shoot with the gateway as its one peer, which has no endpoint
    /// until [`Tunnels::use_endpoint`] names one; connections the gateway opens arrive on
    /// `accepts` (which several devices may share).
    pub(crate) fn agent(
        socket: UdpSocket,
        private: WgKey,
        side: AgentSide,
        metrics: Arc<TunnelMetrics>,
        accepts: mpsc::Sender<Incoming>,
    ) -> Tunnels {
        let mode = Mode::Agent {
            networks: side.networks,
        };
        let t = Self::new(socket, private, metrics, mode.clone(), Some(accepts));
        let now = Instant::now();
        {
            let state = t.inner.state.load();
            // The agent dials only its networks; what the gateway sends from is the
            // gateway's business (its own cryptokey routing).
            let everything: Vec<Net> = [
                std::net::IpAddr::from(std::net::Ipv4Addr::UNSPECIFIED),
                std::net::IpAddr::from(std::net::Ipv6Addr::UNSPECIFIED),
            ]
            .into_iter()
            .filter_map(|a| Net::new(a, 0).ok())
            .collect();
            let route: Arc<str> = "agent".into();
            let peer = state
                .keys
                .new_peer(&route, side.gateway, &everything, side.keepalive);
            let shoot = Shoot::new(route, vec![peer], &side.addresses, mode, now, seed());
            let cell: ShootCell = Arc::new(Mutex::new(shoot));
            let mut maps = Maps::default();
            maps.insert(&state.keys, cell.clone());
            t.inner.state.store(Arc::new(State {
                keys: state.keys.share(),
                maps,
            }));
        }
        t
    }

    /// The agent's gateway peer as it is now (`None` on a gateway device).
    pub(crate) fn gateway_peer(&self) -> Option<GatewayPeer> {
        if !matches!(self.inner.mode, Mode::Agent { .. }) {
            return None;
        }
        let now = Instant::now();
        let state = self.inner.state.load();
        let cell = state.maps.shoots.values().next()?;
        let s = lock(cell);
        let p = s.peers.first()?;
        Some(GatewayPeer {
            endpoint: p.endpoint,
            handshake_at: p.handshake_at,
            heard_at: p.heard_at,
            live: p.live(now),
        })
    }

    /// Points the agent's peer (the gateway) at `endpoint` and starts a handshake there at
    /// once (one still in progress elsewhere is abandoned).
    pub(crate) fn use_endpoint(&self, endpoint: Endpoint) {
        self.initiate_to(endpoint, true);
    }

    /// Sends the agent's peer a handshake initiation at `to` without pointing it there: if
    /// the answer comes from there, the peer roams to it (the agent on a `connect` endpoint
    /// probing UDP). Unanswered, boringtun's retry goes to the peer's endpoint.
    pub(crate) fn probe(&self, to: Endpoint) {
        self.initiate_to(to, false);
    }

    fn initiate_to(&self, to: Endpoint, point: bool) {
        let now = Instant::now();
        let state = self.inner.state.load();
        let mut io = self.inner.io();
        let mut buf = [0u8; 256];
        for cell in state.maps.shoots.values() {
            for p in lock(cell).peers.iter_mut() {
                if point {
                    p.endpoint = Some(to);
                }
                if let TunnResult::WriteToNetwork(out) =
                    p.format_handshake_initiation(&mut buf, true)
                {
                    io.send(to, out);
                }
                // The initiator's retry timer starts from here (see `Shoot::tick`).
                p.recovery_at = Some(now);
            }
        }
        self.inner.wake.notify_one();
    }

    /// Whether any peer of the (agent's) device has a live session.
    pub(crate) fn up(&self) -> bool {
        let now = Instant::now();
        let state = self.inner.state.load();
        state
            .maps
            .shoots
            .values()
            .any(|c| lock(c).peers.iter().any(|p| p.live(now)))
    }

    /// The live state of every shoot, by route.
    pub(crate) fn status(&self) -> HashMap<String, ShootStatus> {
        let now = Instant::now();
        let state = self.inner.state.load();
        state
            .maps
            .shoots
            .iter()
            .map(|(name, cell)| {
                let s = lock(cell);
                let peers = s
                    .peers
                    .iter()
                    .map(|p| PeerStatus {
                        public_key: p.key.to_base64(),
                        endpoint: p.endpoint.map(|e| e.to_string()),
                        last_handshake_seconds_ago: p
                            .handshake_at
                            .map(|at| now.saturating_duration_since(at).as_secs()),
                        live: p.live(now),
                        suspect: p.suspect,
                        streams: s.stack.flows_of(&p.key),
                    })
                    .collect();
                (
                    name.to_string(),
                    ShootStatus {
                        peers,
                        streams: s.stack.flow_count(),
                    },
                )
            })
            .collect()
    }

    /// Reconciles the shoots with a table's tunnels: new routes get a shoot, changed peers are
    /// added, updated or removed (a removed peer's streams end), a route whose addresses
    /// changed or that is gone ends its streams (`route_removed`). Other shoots are not
    /// touched. A new private key rebuilds every shoot.
    pub(crate) fn apply(&self, tunnels: &[(Arc<str>, &Tunnel)], private: Option<WgKey>) {
        let _serial = self.inner.apply.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let old = self.inner.state.load_full();
        let changes = reconcile(&current(&old.maps), &old.keys, tunnels, private);
        let applied = changes.execute(
            &old.keys,
            &old.maps,
            &self.inner.mode,
            now,
            &mut seed,
            &mut self.inner.io(),
        );
        for (route, peers) in &applied.gone {
            self.forget_metrics(route, *peers);
        }
        self.inner.state.store(Arc::new(State {
            keys: applied.keys,
            maps: applied.maps,
        }));
        self.inner.wake.notify_one();
    }

    /// Drops a removed route's tunnel series (its streams still count down on handles
    /// they hold).
    fn forget_metrics(&self, route: &str, peers: usize) {
        let m = &self.inner.metrics;
        let route = route.to_string();
        for result in ["ok", "recovery"] {
            m.handshakes.remove(&RouteResultLabels {
                route: route.clone(),
                result,
            });
        }
        for direction in ["rx", "tx"] {
            m.bytes.remove(&RouteDirectionLabels {
                route: route.clone(),
                direction,
            });
        }
        for peer in 0..peers {
            m.last_handshake.remove(&RoutePeerLabels {
                route: route.clone(),
                peer: peer.to_string(),
            });
        }
        for reason in DialError::REASONS {
            m.dial_failures.remove(&RouteReasonLabels {
                route: route.clone(),
                reason,
            });
        }
        m.streams.remove(&RouteLabel { route });
    }

    /// Opens a stream from the route's shoot to `target` through a live peer whose
    /// `allowedIPs` hold it; also says which peer (`key@endpoint`, for the access log).
    pub(crate) async fn dial(
        &self,
        route: &str,
        target: SocketAddr,
        timeout: Duration,
    ) -> Result<(TunnelStream, String), DialError> {
        let result = self.try_dial(route, target, timeout).await;
        if let Err(e) = &result {
            self.inner
                .metrics
                .dial_failures
                .get_or_create(&RouteReasonLabels {
                    route: route.to_string(),
                    reason: e.as_str(),
                })
                .inc();
        }
        result
    }

    /// [`Tunnels::dial`] without the failure count: a thin loop carrying out the
    /// [`Failover`] policy's choices.
    async fn try_dial(
        &self,
        route: &str,
        target: SocketAddr,
        timeout: Duration,
    ) -> Result<(TunnelStream, String), DialError> {
        let cell = {
            let state = self.inner.state.load();
            state
                .maps
                .shoots
                .get(route)
                .cloned()
                .ok_or(DialError::NoTunnel)?
        };
        let mut failover = Failover::new(Instant::now() + timeout);
        // Attempts still waiting for an answer: (peer, stream, label). An earlier attempt
        // keeps running when the next starts, and the first answer wins.
        let mut pending: Vec<(usize, TunnelStream, String)> = Vec::new();
        loop {
            let (next, until) = {
                let now = Instant::now();
                let mut s = lock(&cell);
                match failover.choose(&s, target.ip(), now) {
                    Choice::NoLivePeer => return Err(DialError::NoLivePeer),
                    Choice::Wait { until } => (None, until),
                    Choice::Dial { peer, until } => {
                        let key = s.peers[peer].key;
                        let label = match s.peers[peer].endpoint {
                            Some(e) => format!("{}@{e}", key.to_base64()),
                            None => key.to_base64(),
                        };
                        let h = s.stack.connect(target, Some(key))?;
                        s.flush(now, &mut self.inner.io());
                        (Some((peer, h, label)), until)
                    }
                }
            };
            if let Some((peer, handle, label)) = next {
                self.inner.wake.notify_one();
                let stream = TunnelStream::new(
                    cell.clone(),
                    handle,
                    self.inner.clone(),
                    self.stream_metrics(route),
                );
                pending.push((peer, stream, label));
            }
            let answer = tokio::time::timeout_at(
                tokio::time::Instant::from_std(until),
                std::future::poll_fn(|cx| {
                    for (k, (_, stream, _)) in pending.iter().enumerate() {
                        if let Poll::Ready(r) = stream.poll_established(cx) {
                            return Poll::Ready((k, r));
                        }
                    }
                    Poll::Pending
                }),
            )
            .await;
            match answer {
                // An answer of any kind (a reset included) ends the dial; the other attempts
                // are dropped (reset).
                Ok((k, Ok(()))) => {
                    let (_, stream, label) = pending.swap_remove(k);
                    return Ok((stream, label));
                }
                Ok((_, Err(e))) => return Err(e),
                Err(_) => {
                    let mut s = lock(&cell);
                    match failover.unanswered(&mut s, Instant::now()) {
                        Unanswered::Timeout => return Err(DialError::Timeout),
                        Unanswered::Suspect(newly) => {
                            for (_, _, label) in pending.iter().filter(|(p, ..)| newly.contains(p))
                            {
                                tracing::debug!(route, peer = %label, "dial unanswered, trying another peer");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Per-stream metric handles of a route.
    pub(crate) fn stream_metrics(&self, route: &str) -> StreamMetrics {
        let m = &self.inner.metrics;
        let dir = |direction| RouteDirectionLabels {
            route: route.to_string(),
            direction,
        };
        // One family lock at a time: a guard lives to the end of its statement.
        let rx = m.bytes.get_or_create(&dir("rx")).clone();
        let tx = m.bytes.get_or_create(&dir("tx")).clone();
        let active = m
            .streams
            .get_or_create(&RouteLabel {
                route: route.to_string(),
            })
            .clone();
        StreamMetrics { rx, tx, active }
    }

    /// A stream for a connection the agent accepted, once its own dial ended.
    pub(crate) fn accepted(
        &self,
        cell: &ShootCell,
        accept: &Accept,
        dialed: Dialed,
    ) -> Option<TunnelStream> {
        lock(cell).accepted(Instant::now(), accept, dialed, &mut self.inner.io());
        self.inner.wake.notify_one();
        (dialed == Dialed::Connected).then(|| {
            TunnelStream::new(
                cell.clone(),
                accept.handle,
                self.inner.clone(),
                self.stream_metrics("agent"),
            )
        })
    }

    async fn receive_loop(self) {
        let mut buf = vec![0u8; 65_536];
        let mut touched: Vec<ShootCell> = Vec::new();
        loop {
            let first = match self.inner.socket.recv_from(&mut buf).await {
                Ok(r) => r,
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "wireguard socket receive failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            // A batch: whatever else is queued already (up to RECEIVE_BATCH datagrams), each
            // shoot's stack run once for all of its packets.
            let mut batch = self.batch(&mut touched);
            let mut next = Some(first);
            let mut count = 0;
            while let Some((n, from)) = next.take() {
                count += 1;
                batch.receive(Endpoint::Udp(from), &buf[..n]);
                if count < RECEIVE_BATCH {
                    next = self.inner.socket.try_recv_from(&mut buf).ok();
                }
            }
            batch.finish();
        }
    }

    async fn timer_loop(self) {
        let mut last_tick = Instant::now();
        let mut last_reset = Instant::now();
        loop {
            let now = Instant::now();
            let state = self.inner.state.load();
            let tick = now.saturating_duration_since(last_tick) >= TIMER_TICK;
            if tick {
                last_tick = now;
            }
            if now.saturating_duration_since(last_reset) >= Duration::from_secs(1) {
                state.keys.limiter.reset_count();
                last_reset = now;
            }
            let mut next = last_tick + TIMER_TICK;
            let wall = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0);
            for (name, cell) in &state.maps.shoots {
                let mut s = lock(cell);
                let mut io = self.inner.io();
                if tick {
                    s.tick(now, &mut io);
                    for (i, p) in s.peers.iter().enumerate() {
                        if let Some(at) = p.handshake_at {
                            let ago = now.saturating_duration_since(at).as_secs_f64();
                            self.inner
                                .metrics
                                .last_handshake
                                .get_or_create(&RoutePeerLabels {
                                    route: name.to_string(),
                                    peer: i.to_string(),
                                })
                                .set(wall - ago);
                        }
                    }
                } else if s.poll_at(now).is_some_and(|at| at <= now) {
                    s.flush(now, &mut io);
                }
                if let Some(at) = s.poll_at(now) {
                    next = next.min(at.max(now + Duration::from_millis(1)));
                }
            }
            drop(state);
            tokio::select! {
                _ = tokio::time::sleep_until(next.into()) => {}
                _ = self.inner.wake.notified() => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::metrics::ReasonLabel;

    /// A new agent device's first handshake initiation leaves at once, before the runtime's
    /// reactor has looked at the new socket (tokio's own `try_send_to` refuses then, and the
    /// lane came up only on boringtun's retry 5 s later). The test holds the runtime's only
    /// thread while it waits, so nothing but that first send can deliver.
    #[tokio::test(flavor = "current_thread")]
    async fn a_new_agent_sends_its_first_handshake_initiation_at_once() {
        let gateway = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        gateway
            .set_read_timeout(Some(Duration::from_secs(3)))
            .unwrap();
        let metrics = Arc::new(TunnelMetrics::default());
        let socket = UdpSocket::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .unwrap();
        let (accepts, _rx) = mpsc::channel(1);
        let side = AgentSide {
            gateway: WgKey([9; 32]),
            addresses: vec!["192.168.128.5".parse().unwrap()],
            networks: Arc::from(Vec::new()),
            keepalive: None,
        };
        let t = Tunnels::agent(socket, WgKey([7; 32]), side, metrics.clone(), accepts);
        t.use_endpoint(Endpoint::Udp(gateway.local_addr().unwrap()));
        let mut buf = [0u8; 256];
        let got = gateway.recv_from(&mut buf).map(|(n, _)| (n, buf[0]));
        let busy = metrics
            .dropped
            .get_or_create(&ReasonLabel { reason: "busy" })
            .get();
        assert_eq!((got.ok(), busy), (Some((148, 1)), 0));
    }
}
