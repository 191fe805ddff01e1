//! One lane: the agent's session with one gateway, over that gateway's endpoints in the order
//! written, UDP preferred. Each lane has a device of its own (its key, its UDP socket, its
//! stack); the agent serves the connections of every lane alike, and is ready while any
//! lane is up. Nothing here assumes that a lane is the only one.
//!
//! An endpoint is tried by pointing the gateway peer at it and starting a handshake: a `udp`
//! endpoint is its resolved address; a `connect` endpoint is a TCP connection to its
//! address, a `CONNECT` with the destination header, and after the `200` the stream itself
//! (datagrams framed with a 16-bit length). No handshake within [`ANSWER_WITHIN`] means the
//! next endpoint; when every one failed, the lane starts over after a backoff (1 s doubling
//! to 30 s). While on a `connect` endpoint, the lane sends a handshake initiation to each
//! `udp` endpoint every [`PROBE_EVERY`]: answered there, the peer roams back to UDP and the
//! stream is closed. A lane that was up and lost its endpoint (the stream ended, or no
//! handshake for [`STALE_AFTER`]) tries that endpoint again first, then the rest in order.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::{TcpStream, UdpSocket};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::AgentError;
use crate::admin::metrics::{LaneKindLabels, TunnelMetrics};
use crate::config::agent::AgentEndpoint;
use crate::net::relay::End;
use crate::route::{Net, WgKey};
use crate::serve::process::StartError;
use crate::tunnel::driver::Incoming;
use crate::tunnel::framed::StreamCloser;
use crate::tunnel::peer::{Endpoint, REKEY_AFTER};
use crate::tunnel::{AgentSide, Tunnels};

/// How long an endpoint has to complete a handshake before the next one is tried.
pub(crate) const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// How often a lane on a `connect` endpoint probes its `udp` endpoints.
pub(crate) const PROBE_EVERY: Duration = Duration::from_secs(15);

/// A session whose last handshake is this old has lost its endpoint: the agent starts a new
/// handshake every 120 s, and boringtun retries an unanswered one every 5 s.
pub(crate) const STALE_AFTER: Duration = Duration::from_secs(REKEY_AFTER.as_secs() + 20);

/// The first and the longest wait before a lane starts over after every endpoint failed.
const BACKOFF_MIN: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// A lane that stayed up this long was steady: when it is lost, it starts over at once (and
/// its backoff from the start); one lost sooner waits its backoff, so an endpoint that
/// answers a handshake and then drops every stream is not redialed in a tight loop.
const STEADY: Duration = Duration::from_secs(10);

/// A lane on UDP that has heard nothing from the gateway this long asks with a handshake.
const QUIET: Duration = Duration::from_secs(20);

/// How long a lane waits for a name to resolve.
const RESOLVE_WITHIN: Duration = Duration::from_secs(2);

/// How often a lane looks at its session.
const LOOK_EVERY: Duration = Duration::from_millis(100);

/// Which kind of endpoint a lane uses (metric label `kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A UDP endpoint.
    Udp,
    /// A `connect` endpoint (a TCP stream through a CONNECT).
    Connect,
}

impl Kind {
    /// The label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Udp => "udp",
            Kind::Connect => "connect",
        }
    }
}

/// What a lane is made of.
#[derive(Debug, Clone)]
pub(crate) struct LaneSpec {
    /// Its position among the agent's lanes (metric label `lane`).
    pub(crate) index: usize,
    /// The gateway's public key.
    pub(crate) gateway: WgKey,
    /// The gateway's endpoints, in order.
    pub(crate) endpoints: Vec<AgentEndpoint>,
    /// The agent's addresses inside the tunnel.
    pub(crate) addresses: Vec<std::net::IpAddr>,
    /// What the agent dials.
    pub(crate) networks: Arc<[Net]>,
    /// Persistent keepalive, seconds.
    pub(crate) keepalive: Option<u16>,
    /// Budget for the TCP connect and for the CONNECT answer of a `connect` endpoint.
    pub(crate) connect: Duration,
    /// A `connect` endpoint's stream ends after this long without a byte from the gateway.
    pub(crate) idle: Duration,
}

/// A running lane.
#[derive(Debug)]
pub(crate) struct Lane {
    tunnels: Tunnels,
    task: JoinHandle<()>,
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Lane {
    /// Starts a lane: binds its UDP socket (the family of the first `udp` endpoint that
    /// resolves, else IPv4), builds its device, and drives its endpoints. Connections the
    /// gateway opens through it arrive on `accepts`.
    pub(crate) async fn start(
        spec: LaneSpec,
        private: WgKey,
        metrics: Arc<TunnelMetrics>,
        accepts: mpsc::Sender<Incoming>,
    ) -> Result<Lane, AgentError> {
        let v6 = first_udp(&spec.endpoints)
            .await
            .is_some_and(|a| a.is_ipv6());
        let bind: SocketAddr = if v6 {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
        };
        let socket = UdpSocket::bind(bind)
            .await
            .map_err(|source| StartError::Bind {
                what: "tunnel socket".into(),
                address: bind,
                source,
            })?;
        let side = AgentSide {
            gateway: spec.gateway,
            addresses: spec.addresses.clone(),
            networks: spec.networks.clone(),
            keepalive: spec.keepalive,
        };
        let tunnels = Tunnels::agent(socket, private, side, metrics.clone(), accepts);
        let driver = Driver {
            spec,
            tunnels: tunnels.clone(),
            metrics,
            kind: None,
        };
        let task = tokio::spawn(driver.run());
        Ok(Lane { tunnels, task })
    }

    /// Whether the lane has a live session.
    pub(crate) fn up(&self) -> bool {
        self.tunnels.up()
    }
}

/// The first `udp` endpoint that resolves, resolved.
async fn first_udp(endpoints: &[AgentEndpoint]) -> Option<SocketAddr> {
    for e in endpoints {
        if let AgentEndpoint::Udp { host, port } = e
            && let Some(a) = resolve(host, *port).await
        {
            return Some(a);
        }
    }
    None
}

/// `host:port` resolved anew (its first address), or nothing after [`RESOLVE_WITHIN`]: a
/// slow resolver must not hold a lane that watches its stream and session.
async fn resolve(host: &str, port: u16) -> Option<SocketAddr> {
    let endpoint = || format!("{host}:{port}");
    match tokio::time::timeout(RESOLVE_WITHIN, tokio::net::lookup_host((host, port))).await {
        Ok(Ok(mut addrs)) => addrs.next(),
        Ok(Err(e)) => {
            tracing::debug!(endpoint = %endpoint(), error = %e, "cannot resolve");
            None
        }
        Err(_) => {
            tracing::debug!(endpoint = %endpoint(), "no answer from the resolver in time");
            None
        }
    }
}

/// How an endpoint that came up was left.
#[derive(Debug)]
enum Left {
    /// Its session went stale or its stream ended: try it again first.
    Lost(usize),
}

/// A `connect` endpoint's stream, carried by a task of its own.
struct Carrying {
    closer: StreamCloser,
    task: JoinHandle<End>,
    endpoint: Endpoint,
}

impl Carrying {
    /// Asks the stream to end (its task ends soon after).
    fn close(&self) {
        self.closer.close();
    }

    /// Whether the stream has ended.
    fn ended(&self) -> bool {
        self.task.is_finished()
    }
}

/// The task that drives one lane's endpoints.
struct Driver {
    spec: LaneSpec,
    tunnels: Tunnels,
    metrics: Arc<TunnelMetrics>,
    /// The kind in use, as last shown in the metrics.
    kind: Option<Kind>,
}

impl Driver {
    async fn run(mut self) {
        let n = self.spec.endpoints.len();
        let mut backoff = BACKOFF_MIN;
        let mut again: Option<usize> = None;
        loop {
            let first = again.take();
            let order = first
                .into_iter()
                .chain((0..n).filter(|i| Some(*i) != first));
            let mut was_up = false;
            for i in order {
                let began = Instant::now();
                match self.attempt(i).await {
                    Ok(Left::Lost(k)) => {
                        // Down until an endpoint answers again (a change, when it does).
                        self.show(None);
                        was_up = began.elapsed() >= STEADY;
                        again = Some(k);
                        break;
                    }
                    Err(why) => {
                        tracing::info!(
                            lane = self.spec.index,
                            endpoint = i,
                            why,
                            "gateway endpoint failed"
                        );
                    }
                }
            }
            if was_up {
                backoff = BACKOFF_MIN;
                continue;
            }
            self.show(None);
            tokio::time::sleep(jitter(backoff)).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// Tries endpoint `i`; `Ok` once it was up and has been lost, `Err` with the reason when
    /// it never came up.
    async fn attempt(&mut self, i: usize) -> Result<Left, String> {
        match self.spec.endpoints[i].clone() {
            AgentEndpoint::Udp { host, port } => {
                let addr = resolve(&host, port)
                    .await
                    .ok_or_else(|| format!("{host}:{port} does not resolve"))?;
                let since = Instant::now();
                self.tunnels.use_endpoint(Endpoint::Udp(addr));
                if !self.answered(since, None).await {
                    return Err("no handshake answer over udp".into());
                }
                Ok(self.hold_udp(i, addr).await)
            }
            AgentEndpoint::Connect {
                address,
                destination,
                destination_header,
            } => {
                let carrying = self
                    .open_connect(&address, &destination, &destination_header)
                    .await?;
                let since = Instant::now();
                self.tunnels.use_endpoint(carrying.endpoint);
                if !self.answered(since, Some(&carrying)).await {
                    carrying.close();
                    return Err("no handshake answer over the CONNECT stream".into());
                }
                self.hold_connect(i, carrying).await
            }
        }
    }

    /// Waits up to [`ANSWER_WITHIN`] for a handshake completed after `since` (false also
    /// when `stream` ended first).
    async fn answered(&self, since: Instant, stream: Option<&Carrying>) -> bool {
        let deadline = since + ANSWER_WITHIN;
        while Instant::now() < deadline {
            if self.handshake_after(since) {
                return true;
            }
            if stream.is_some_and(Carrying::ended) {
                return false;
            }
            tokio::time::sleep(LOOK_EVERY).await;
        }
        self.handshake_after(since)
    }

    fn handshake_after(&self, since: Instant) -> bool {
        self.tunnels
            .gateway_peer()
            .and_then(|p| p.handshake_at)
            .is_some_and(|at| at >= since)
    }

    /// Whether the session has not been renewed for [`STALE_AFTER`].
    fn stale(&self) -> bool {
        let now = Instant::now();
        self.tunnels
            .gateway_peer()
            .and_then(|p| p.handshake_at)
            .is_none_or(|at| now.saturating_duration_since(at) >= STALE_AFTER)
    }

    /// Stays on UDP endpoint `i` (at `addr`) until its session goes stale or the gateway
    /// stops answering: after [`QUIET`] without an authenticated packet from it, the lane
    /// asks with a handshake initiation, and one unanswered within [`ANSWER_WITHIN`] loses
    /// the endpoint (an idle tunnel hears nothing otherwise: keepalives go one way).
    async fn hold_udp(&mut self, i: usize, addr: SocketAddr) -> Left {
        self.show(Some(Kind::Udp));
        tracing::info!(lane = self.spec.index, endpoint = i, gateway = %addr, "tunnel over udp");
        let mut asked: Option<Instant> = None;
        loop {
            tokio::time::sleep(LOOK_EVERY).await;
            if self.stale() {
                tracing::info!(
                    lane = self.spec.index,
                    endpoint = i,
                    "udp session went stale"
                );
                return Left::Lost(i);
            }
            let now = Instant::now();
            let heard = self.tunnels.gateway_peer().and_then(|p| p.heard_at);
            match asked {
                Some(at) if heard.is_some_and(|h| h >= at) => asked = None,
                Some(at) if now.saturating_duration_since(at) >= ANSWER_WITHIN => {
                    tracing::info!(
                        lane = self.spec.index,
                        endpoint = i,
                        "udp endpoint stopped answering"
                    );
                    return Left::Lost(i);
                }
                None if heard.is_none_or(|h| now.saturating_duration_since(h) >= QUIET) => {
                    self.tunnels.probe(Endpoint::Udp(addr));
                    asked = Some(now);
                }
                _ => {}
            }
        }
    }

    /// Stays on `connect` endpoint `i` until its stream ends or its session goes stale,
    /// probing the `udp` endpoints meanwhile; a probe answered over UDP moves the lane there.
    async fn hold_connect(&mut self, i: usize, mut carrying: Carrying) -> Result<Left, String> {
        self.show(Some(Kind::Connect));
        tracing::info!(
            lane = self.spec.index,
            endpoint = i,
            "tunnel over a CONNECT stream"
        );
        let mut next_probe = Instant::now() + PROBE_EVERY;
        loop {
            tokio::time::sleep(LOOK_EVERY).await;
            if carrying.ended() {
                let end = (&mut carrying.task).await.map(|e| e.to_string());
                let end = end.unwrap_or_else(|e| e.to_string());
                tracing::info!(
                    lane = self.spec.index,
                    endpoint = i,
                    end,
                    "CONNECT stream ended"
                );
                return Ok(Left::Lost(i));
            }
            if self.stale() {
                tracing::info!(
                    lane = self.spec.index,
                    endpoint = i,
                    "session over the CONNECT stream went stale"
                );
                carrying.close();
                return Ok(Left::Lost(i));
            }
            let peer = self.tunnels.gateway_peer();
            if let Some(Endpoint::Udp(addr)) = peer.and_then(|p| p.endpoint) {
                // A probe was answered over UDP: the peer roamed there.
                // (Answered from an address no name gives: the first `udp` endpoint.)
                let first_udp = self
                    .spec
                    .endpoints
                    .iter()
                    .position(|e| matches!(e, AgentEndpoint::Udp { .. }));
                let j = self.udp_index(addr).await.or(first_udp).unwrap_or(i);
                carrying.close();
                let _ = (&mut carrying.task).await;
                tracing::info!(lane = self.spec.index, endpoint = j, gateway = %addr, "udp answers again: leaving the CONNECT stream");
                return Ok(self.hold_udp(j, addr).await);
            }
            if Instant::now() >= next_probe {
                next_probe = Instant::now() + PROBE_EVERY;
                for e in &self.spec.endpoints {
                    if let AgentEndpoint::Udp { host, port } = e
                        && let Some(addr) = resolve(host, *port).await
                    {
                        self.tunnels.probe(Endpoint::Udp(addr));
                    }
                }
            }
        }
    }

    /// The position of the `udp` endpoint that resolves to `addr`.
    async fn udp_index(&self, addr: SocketAddr) -> Option<usize> {
        for (j, e) in self.spec.endpoints.iter().enumerate() {
            if let AgentEndpoint::Udp { host, port } = e
                && resolve(host, *port).await == Some(addr)
            {
                return Some(j);
            }
        }
        None
    }

    /// Dials a `connect` endpoint, sends the CONNECT and, once answered `200`, carries the
    /// stream as an endpoint of the device in a task of its own.
    async fn open_connect(
        &self,
        address: &str,
        destination: &str,
        header: &str,
    ) -> Result<Carrying, String> {
        let budget = self.spec.connect;
        let mut stream = tokio::time::timeout(budget, TcpStream::connect(address))
            .await
            .map_err(|_| format!("no TCP connection to {address} in time"))?
            .map_err(|e| format!("TCP connect to {address}: {e}"))?;
        crate::net::socket::tune(&stream, KEEPALIVE_IDLE, KEEPALIVE_INTERVAL);
        let early = tokio::time::timeout(
            budget,
            crate::net::dial::connect_tunnel(&mut stream, address, header, destination),
        )
        .await
        .map_err(|_| format!("no CONNECT answer from {address} in time"))?
        .map_err(|(reason, detail)| {
            format!("CONNECT to {address}: {} ({detail})", reason.as_str())
        })?;
        let peer = stream
            .peer_addr()
            .map_err(|e| format!("CONNECT stream to {address}: {e}"))?;
        let endpoint = self.tunnels.open_stream(peer);
        let closer = endpoint.closer();
        let at = endpoint.endpoint();
        let tunnels = self.tunnels.clone();
        let idle = self.spec.idle;
        let task = tokio::spawn(async move {
            let carried = tunnels.carry(endpoint, stream, early, idle, None).await;
            carried.end
        });
        Ok(Carrying {
            closer,
            task,
            endpoint: at,
        })
    }

    /// Shows the kind in use (or none) in the lane's metrics, counting a change.
    fn show(&mut self, kind: Option<Kind>) {
        if self.kind == kind {
            return;
        }
        self.kind = kind;
        let lane = self.spec.index.to_string();
        for k in [Kind::Udp, Kind::Connect] {
            let labels = LaneKindLabels {
                lane: lane.clone(),
                kind: k.as_str(),
            };
            self.metrics
                .endpoint
                .get_or_create(&labels)
                .set(i64::from(kind == Some(k)));
            if kind == Some(k) {
                self.metrics.endpoint_changes.get_or_create(&labels).inc();
            }
        }
    }
}

/// TCP keepalive of a `connect` endpoint's stream: a dead gateway is noticed within a few
/// minutes even when the session is idle.
pub(super) const KEEPALIVE_IDLE: Duration = Duration::from_secs(55);
/// The interval of a `connect` endpoint's keepalive probes.
pub(super) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(15);

/// `d` give or take a fifth, so lanes of many agents do not retry in step.
fn jitter(d: Duration) -> Duration {
    let mut b = [0u8; 2];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
    let r = f64::from(u16::from_le_bytes(b)) / f64::from(u16::MAX);
    d.mul_f64(0.8 + 0.4 * r)
}
