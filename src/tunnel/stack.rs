//! One shoot's user-space TCP/IP stack: a smoltcp interface over two packet queues, its
//! TCP sockets, and the bookkeeping a tunnel needs around them (which peer a flow is pinned
//! to, which sockets are released and wait to be reaped).
//!
//! Sans-IO: the caller pushes decrypted IP packets in, calls [`Stack::poll`] with `now`, and
//! takes the packets to encrypt out. Socket buffers are allocated per stream when it opens
//! (see [`RX_BUFFER`]); an interface holds no buffers of its own besides the queues.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{self, DeviceCapabilities, Medium};
use smoltcp::socket::tcp;
use smoltcp::wire::{HardwareAddress, IpAddress, IpCidr};
use thiserror::Error;

use crate::route::WgKey;

/// The tunnel MTU (WireGuard's default over IPv4/IPv6 on a 1500-byte path).
pub(crate) const MTU: usize = 1420;
/// Receive buffer per tunneled stream: the window a shoot-side sender sees (with window
/// scaling). At 128 KiB the allocation is at glibc's mmap threshold (set to 128 KiB by the
/// serving layer), so its pages are the kernel's zero pages until data touches them: an idle
/// stream holds only the pages its first bytes used, a busy one the whole ring.
pub(crate) const RX_BUFFER: usize = 128 * 1024;
/// Send buffer per tunneled stream (same reasoning).
pub(crate) const TX_BUFFER: usize = 128 * 1024;
/// Inbound packets queued for one poll at most; more are dropped (counted `busy`).
pub(crate) const RX_QUEUE: usize = 4096;
/// An idle flow sends a keepalive probe this often.
pub(crate) const KEEPALIVE: Duration = Duration::from_secs(20);
/// A flow that hears nothing from the other end for this long is aborted.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(60);
/// How long a socket whose stream is gone may take to close (a FIN never acknowledged, a
/// peer that went away): then it is reset and removed.
pub(crate) const LINGER: Duration = Duration::from_secs(30);
/// Local ports for dials from this stack.
const EPHEMERAL: std::ops::RangeInclusive<u16> = 49152..=65535;

/// Why a stream could not be opened in the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub(crate) enum StackError {
    /// The stack has no address of the target's family.
    #[error("no local address of the target's family")]
    NoLocalAddress,
    /// Every ephemeral port towards that target is in use.
    #[error("no free local port")]
    NoPort,
    /// smoltcp refused the endpoints.
    #[error("unaddressable target")]
    Unaddressable,
}

/// The two packet queues smoltcp reads from and writes to.
#[derive(Debug, Default)]
pub(crate) struct Queues {
    rx: VecDeque<Vec<u8>>,
    tx: VecDeque<Vec<u8>>,
}

/// Hands smoltcp one received packet.
pub(crate) struct Rx(Vec<u8>);
/// Lets smoltcp write one packet.
pub(crate) struct Tx<'a>(&'a mut VecDeque<Vec<u8>>);

impl phy::RxToken for Rx {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

impl phy::TxToken for Tx<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut buf = vec![0; len];
        let r = f(&mut buf);
        self.0.push_back(buf);
        r
    }
}

impl phy::Device for Queues {
    type RxToken<'a> = Rx;
    type TxToken<'a> = Tx<'a>;

    fn receive(&mut self, _: smoltcp::time::Instant) -> Option<(Rx, Tx<'_>)> {
        let p = self.rx.pop_front()?;
        Some((Rx(p), Tx(&mut self.tx)))
    }

    fn transmit(&mut self, _: smoltcp::time::Instant) -> Option<Tx<'_>> {
        Some(Tx(&mut self.tx))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ip;
        caps.max_transmission_unit = MTU;
        caps
    }
}

/// One open (or closing) TCP flow of the stack.
#[derive(Debug, Clone)]
pub(crate) struct Flow {
    /// This stack's end.
    pub(crate) local: SocketAddr,
    /// The shoot's end.
    pub(crate) remote: SocketAddr,
    /// The peer whose tunnel carries it (the gateway pins a flow to the peer it was dialed
    /// through; the agent has one peer).
    pub(crate) peer: Option<WgKey>,
    /// When its stream went away; the socket is removed once closed, or after [`LINGER`].
    pub(crate) released: Option<Instant>,
    /// Ended by a table change (its peer or route went away).
    pub(crate) killed: bool,
}

/// One shoot's stack.
pub(crate) struct Stack {
    iface: Interface,
    sockets: SocketSet<'static>,
    queues: Queues,
    epoch: Instant,
    addresses: Vec<IpAddr>,
    flows: HashMap<SocketHandle, Flow>,
    by_tuple: HashMap<(SocketAddr, SocketAddr), SocketHandle>,
    next_port: u16,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack")
            .field("addresses", &self.addresses)
            .field("flows", &self.flows.len())
            .finish()
    }
}

fn smol(epoch: Instant, now: Instant) -> smoltcp::time::Instant {
    smoltcp::time::Instant::from_micros(now.saturating_duration_since(epoch).as_micros() as i64)
}

impl Stack {
    /// A stack answering on `addresses`; with `any_ip` it accepts packets for any address
    /// (the agent terminates connections to whatever its networks hold).
    pub(crate) fn new(addresses: &[IpAddr], any_ip: bool, now: Instant, seed: u64) -> Stack {
        let mut queues = Queues::default();
        let mut config = Config::new(HardwareAddress::Ip);
        config.random_seed = seed;
        let epoch = now;
        let mut iface = Interface::new(config, &mut queues, smol(epoch, now));
        iface.update_ip_addrs(|addrs| {
            for a in addresses {
                let prefix = if a.is_ipv4() { 32 } else { 128 };
                // Capacity is checked by the caller (one address per family).
                let _ = addrs.push(IpCidr::new(IpAddress::from(*a), prefix));
            }
        });
        for a in addresses {
            // Medium::Ip has no next hop: a default route through our own address makes every
            // destination routable.
            let _ = match a {
                IpAddr::V4(v4) => iface.routes_mut().add_default_ipv4_route(*v4).map(|_| ()),
                IpAddr::V6(v6) => iface.routes_mut().add_default_ipv6_route(*v6).map(|_| ()),
            };
        }
        iface.set_any_ip(any_ip);
        Stack {
            iface,
            sockets: SocketSet::new(Vec::new()),
            queues,
            epoch,
            addresses: addresses.to_vec(),
            flows: HashMap::new(),
            by_tuple: HashMap::new(),
            next_port: *EPHEMERAL.start() + (seed % 16384) as u16,
        }
    }

    /// The stack's own addresses.
    pub(crate) fn addresses(&self) -> &[IpAddr] {
        &self.addresses
    }

    /// Queues one decrypted IP packet; false (dropped) when the queue is full.
    pub(crate) fn push(&mut self, packet: &[u8]) -> bool {
        if self.queues.rx.len() >= RX_QUEUE {
            return false;
        }
        self.queues.rx.push_back(packet.to_vec());
        true
    }

    /// Runs the stack: processes queued packets and timers, queues what it sends.
    pub(crate) fn poll(&mut self, now: Instant) {
        let t = smol(self.epoch, now);
        self.iface.poll(t, &mut self.queues, &mut self.sockets);
    }

    /// The packets the stack sent since the last call.
    pub(crate) fn take_sent(&mut self) -> impl Iterator<Item = Vec<u8>> + '_ {
        self.queues.tx.drain(..)
    }

    /// When the stack next needs [`Stack::poll`] without new packets, if ever.
    pub(crate) fn poll_at(&mut self, now: Instant) -> Option<Instant> {
        let t = smol(self.epoch, now);
        self.iface
            .poll_at(t, &self.sockets)
            .map(|at| self.epoch + Duration::from_micros(at.total_micros().max(0) as u64))
    }

    fn new_socket() -> tcp::Socket<'static> {
        let rx = tcp::SocketBuffer::new(vec![0; RX_BUFFER]);
        let tx = tcp::SocketBuffer::new(vec![0; TX_BUFFER]);
        let mut s = tcp::Socket::new(rx, tx);
        // The relay writes whole reads; coalescing them only adds latency.
        s.set_nagle_enabled(false);
        // A peer that died (a killed replica) leaves its flows with nobody to answer: idle
        // ones probe, and a flow that hears nothing for TIMEOUT ends, so its relay does.
        s.set_keep_alive(Some(smoltcp::time::Duration::from_secs(
            KEEPALIVE.as_secs(),
        )));
        s.set_timeout(Some(smoltcp::time::Duration::from_secs(TIMEOUT.as_secs())));
        s
    }

    /// Opens a connection from this stack to `remote` through `peer`.
    pub(crate) fn connect(
        &mut self,
        remote: SocketAddr,
        peer: Option<WgKey>,
    ) -> Result<SocketHandle, StackError> {
        let local_ip = *self
            .addresses
            .iter()
            .find(|a| a.is_ipv4() == remote.is_ipv4())
            .ok_or(StackError::NoLocalAddress)?;
        let span = (EPHEMERAL.end() - EPHEMERAL.start()) as u32 + 1;
        let mut local = None;
        for _ in 0..span {
            let port = self.next_port;
            self.next_port = if port == *EPHEMERAL.end() {
                *EPHEMERAL.start()
            } else {
                port + 1
            };
            let candidate = SocketAddr::new(local_ip, port);
            if !self.by_tuple.contains_key(&(candidate, remote)) {
                local = Some(candidate);
                break;
            }
        }
        let local = local.ok_or(StackError::NoPort)?;
        let mut socket = Self::new_socket();
        socket
            .connect(self.iface.context(), remote, local)
            .map_err(|_| StackError::Unaddressable)?;
        let h = self.sockets.add(socket);
        self.track(h, local, remote, peer);
        Ok(h)
    }

    /// A socket for a connection the shoot opens to `local` (the agent): it answers the SYN
    /// only once [`Stack::release_synack`] is called, so that a refused target looks refused.
    pub(crate) fn listen(
        &mut self,
        local: SocketAddr,
        remote: SocketAddr,
        peer: Option<WgKey>,
    ) -> Result<SocketHandle, StackError> {
        let mut socket = Self::new_socket();
        socket.pause_synack(true);
        socket
            .listen(local)
            .map_err(|_| StackError::Unaddressable)?;
        let h = self.sockets.add(socket);
        self.track(h, local, remote, peer);
        Ok(h)
    }

    fn track(
        &mut self,
        h: SocketHandle,
        local: SocketAddr,
        remote: SocketAddr,
        peer: Option<WgKey>,
    ) {
        self.flows.insert(
            h,
            Flow {
                local,
                remote,
                peer,
                released: None,
                killed: false,
            },
        );
        self.by_tuple.insert((local, remote), h);
    }

    /// Lets a paused socket answer its SYN.
    pub(crate) fn release_synack(&mut self, h: SocketHandle) {
        self.socket(h).pause_synack(false);
    }

    /// The flow with these ends, if the stack has one.
    pub(crate) fn flow_for(&self, local: SocketAddr, remote: SocketAddr) -> Option<SocketHandle> {
        self.by_tuple.get(&(local, remote)).copied()
    }

    /// The flow of a socket.
    pub(crate) fn flow(&self, h: SocketHandle) -> Option<&Flow> {
        self.flows.get(&h)
    }

    /// The peer a flow with these ends is pinned to.
    pub(crate) fn pinned_peer(&self, local: SocketAddr, remote: SocketAddr) -> Option<WgKey> {
        self.by_tuple
            .get(&(local, remote))
            .and_then(|h| self.flows.get(h))
            .and_then(|f| f.peer)
    }

    /// A socket of the stack.
    pub(crate) fn socket(&mut self, h: SocketHandle) -> &mut tcp::Socket<'static> {
        self.sockets.get_mut::<tcp::Socket>(h)
    }

    /// Number of flows pinned to `peer`.
    pub(crate) fn flows_of(&self, peer: &WgKey) -> usize {
        self.flows
            .values()
            .filter(|f| f.peer.as_ref() == Some(peer))
            .count()
    }

    /// Number of flows (streams and sockets still closing).
    pub(crate) fn flow_count(&self) -> usize {
        self.flows.len()
    }

    /// The stream of a socket is gone: a connection its relay did not close cleanly
    /// (`reset`) is reset, a closing one may finish; the socket is removed once closed or
    /// after [`LINGER`].
    pub(crate) fn release(&mut self, h: SocketHandle, reset: bool, now: Instant) {
        if let Some(f) = self.flows.get_mut(&h) {
            f.released = Some(now);
        }
        let s = self.sockets.get_mut::<tcp::Socket>(h);
        match s.state() {
            tcp::State::Listen | tcp::State::SynSent | tcp::State::SynReceived => s.abort(),
            tcp::State::Established | tcp::State::CloseWait if reset => s.abort(),
            tcp::State::Established | tcp::State::CloseWait => s.close(),
            _ => {}
        }
    }

    /// Removes a socket at once, without a packet (a dial the agent gives no answer to).
    pub(crate) fn forget(&mut self, h: SocketHandle) {
        if let Some(f) = self.flows.remove(&h) {
            self.by_tuple.remove(&(f.local, f.remote));
        }
        self.sockets.remove(h);
    }

    /// Removes released sockets that have closed; resets those released longer than
    /// [`LINGER`] ago (removed on the next call, once the reset is out).
    pub(crate) fn reap(&mut self, now: Instant) {
        let mut gone = Vec::new();
        for (h, f) in &self.flows {
            let Some(at) = f.released else { continue };
            let s = self.sockets.get_mut::<tcp::Socket>(*h);
            if s.state() == tcp::State::Closed {
                gone.push(*h);
            } else if now.saturating_duration_since(at) >= LINGER {
                s.abort();
            }
        }
        for h in gone {
            self.forget(h);
        }
    }

    /// Resets every flow pinned to `peer` (or every flow, with `None`): its streams end.
    pub(crate) fn reset_flows(&mut self, peer: Option<&WgKey>) {
        for (h, f) in self.flows.iter_mut() {
            if peer.is_none() || f.peer.as_ref() == peer {
                f.killed = true;
                self.sockets.get_mut::<tcp::Socket>(*h).abort();
            }
        }
    }
}
