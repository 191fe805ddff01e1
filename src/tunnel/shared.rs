//! What every task of a tunnel device shares: [`Tunnels`], the handle, and its [`Inner`]
//! (the UDP socket, the device state a table change replaces, the stream endpoints'
//! queues, the metrics); [`UdpIo`], through which the device sends; and [`Batch`], datagrams
//! received together from any endpoint.
//!
//! It sits below the tokio layer's modules that reach the device ([`super::driver`] spawns
//! the tasks and changes the state, [`super::framed`] carries stream endpoints,
//! [`super::stream`] is a tunneled stream) and imports none of them, so they import it and
//! not each other. It spawns nothing and reads the clock only where a batch starts.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::ArcSwap;
use rustix::net::SendFlags;
use tokio::net::UdpSocket;
use tokio::sync::{Notify, mpsc};

use super::device::{self, Keys, Maps, Recovery, ShootCell, lock};
use super::peer::{Endpoint, Peer};
use super::queues::Streams;
use super::shoot::{Accept, Dialed, Drop, Io, Mode, Session};
use crate::admin::metrics::{ReasonLabel, RouteResultLabels, TunnelMetrics};
use crate::route::WgKey;

/// The device state a table change replaces as a whole.
pub(crate) struct State {
    /// The device's key material.
    pub(super) keys: Keys,
    /// Its shoots and the maps to their peers.
    pub(super) maps: Maps,
}

/// What every task of the tunnel shares.
pub(crate) struct Inner {
    /// The UDP socket.
    pub(super) socket: Arc<UdpSocket>,
    /// The device state, replaced as a whole on a table change.
    pub(super) state: ArcSwap<State>,
    /// The device-wide recovery limit.
    pub(super) recovery: Recovery,
    /// The tunnel's metrics.
    pub(super) metrics: Arc<TunnelMetrics>,
    /// The TCP streams that are endpoints of the device.
    pub(super) streams: Streams,
    /// Wakes the timer (a shoot may need its stack run sooner).
    pub(super) wake: Notify,
    /// Serializes table changes.
    pub(super) apply: Mutex<()>,
    /// The agent's accepted connections, for its dialer.
    pub(super) accepts: Option<mpsc::Sender<Incoming>>,
    /// Gateway or agent.
    pub(super) mode: Mode,
}

/// Sends through the UDP socket and counts.
pub(crate) struct UdpIo<'a> {
    inner: &'a Inner,
}

impl Io for UdpIo<'_> {
    fn send(&mut self, to: Endpoint, datagram: &[u8]) {
        let sent = match to {
            // Straight to the (non-blocking) socket: tokio's `try_send_to` refuses until
            // its reactor has seen the socket writable, so a new socket's first datagram (an
            // agent's first handshake initiation) would be dropped.
            Endpoint::Udp(to) => {
                match rustix::net::sendto(&*self.inner.socket, datagram, SendFlags::empty(), &to) {
                    Ok(_) => Ok(()),
                    Err(_) => Err(Drop::Busy),
                }
            }
            Endpoint::Stream { id, .. } => self.inner.streams.send(id, datagram),
        };
        if let Err(reason) = sent {
            self.dropped(reason);
        }
    }

    fn dropped(&mut self, reason: Drop) {
        self.inner
            .metrics
            .dropped
            .get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            })
            .inc();
    }

    fn handshake(&mut self, route: &str, _peer: &WgKey) {
        self.count(route, "ok");
    }

    fn recovery(&mut self, route: &str) {
        self.count(route, "recovery");
    }

    fn session(&mut self, route: &str, peer: &Peer, change: Session) {
        let key = peer.key.to_base64();
        let endpoint = peer
            .endpoint
            .map_or_else(|| "-".to_owned(), |e| e.to_string());
        match change {
            Session::Up => {
                tracing::info!(route, peer = %key, %endpoint, "tunnel session up");
            }
            Session::Lapsed { silent } => {
                let last_packet_seconds_ago = silent.map(|d| d.as_secs());
                tracing::info!(
                    route,
                    peer = %key,
                    %endpoint,
                    last_packet_seconds_ago,
                    "tunnel session lapsed"
                );
            }
        }
    }
}

impl UdpIo<'_> {
    fn count(&self, route: &str, result: &'static str) {
        self.inner
            .metrics
            .handshakes
            .get_or_create(&RouteResultLabels {
                route: route.to_string(),
                result,
            })
            .inc();
    }
}

impl Inner {
    /// Sends through the socket (or a stream endpoint's queue) and counts.
    pub(crate) fn io(&self) -> UdpIo<'_> {
        UdpIo { inner: self }
    }
}

/// Datagrams received together, from any endpoint: each is handled at once (decrypted,
/// queued for its shoot's stack), and [`Batch::finish`] runs every shoot they touched once
/// and hands the agent's new connections on.
pub(crate) struct Batch<'a> {
    tunnels: &'a Tunnels,
    state: arc_swap::Guard<Arc<State>>,
    now: Instant,
    touched: &'a mut Vec<ShootCell>,
}

impl Batch<'_> {
    /// Handles one datagram from `from`; whether a peer's key authenticated it.
    pub(crate) fn receive(&mut self, from: Endpoint, datagram: &[u8]) -> bool {
        let inner = &self.tunnels.inner;
        let Some(cell) = device::receive(
            &self.state.keys,
            &self.state.maps,
            &inner.recovery,
            self.now,
            from,
            datagram,
            &mut inner.io(),
        ) else {
            return false;
        };
        if !self.touched.iter().any(|c| Arc::ptr_eq(c, &cell)) {
            self.touched.push(cell);
        }
        true
    }

    /// Runs the touched shoots' stacks and sends what they produced.
    pub(crate) fn finish(self) {
        let inner = &self.tunnels.inner;
        let mut io = inner.io();
        for cell in self.touched.drain(..) {
            let mut s = lock(&cell);
            s.flush(self.now, &mut io);
            if let Some(tx) = &inner.accepts {
                for a in s.take_accepts() {
                    // More connections waiting for their dial than the agent takes on,
                    // or the agent draining: refused (reset) at once.
                    let incoming = Incoming {
                        tunnels: self.tunnels.clone(),
                        cell: cell.clone(),
                        accept: a,
                    };
                    if tx.try_send(incoming).is_err() {
                        io.dropped(Drop::Busy);
                        s.accepted(self.now, &a, Dialed::Refused, &mut io);
                    }
                }
            }
        }
        inner.wake.notify_one();
    }
}

/// The tunnel device of a gateway or an agent.
#[derive(Clone)]
pub(crate) struct Tunnels {
    /// What its tasks share.
    pub(super) inner: Arc<Inner>,
}

impl std::fmt::Debug for Tunnels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tunnels").finish_non_exhaustive()
    }
}

/// A connection an agent's device opened (its SYN paused), for the agent's dialer.
#[derive(Debug)]
pub(crate) struct Incoming {
    /// The device it arrived on.
    pub(crate) tunnels: Tunnels,
    /// Its shoot.
    pub(crate) cell: ShootCell,
    /// The paused socket and its ends.
    pub(crate) accept: Accept,
}

impl Tunnels {
    /// A batch of received datagrams (see [`Batch`]); `touched` is the caller's scratch.
    pub(crate) fn batch<'a>(&'a self, touched: &'a mut Vec<ShootCell>) -> Batch<'a> {
        touched.clear();
        Batch {
            tunnels: self,
            state: self.inner.state.load(),
            now: Instant::now(),
            touched,
        }
    }
}
