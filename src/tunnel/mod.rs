//! WireGuard terminated in user space, with one isolated TCP/IP stack per shoot.
//!
//! The core is sans-IO: [`peer::Peer`] wraps boringtun's noise session with its endpoint and
//! allowed networks, [`stack::Stack`] is one smoltcp interface and socket set, and
//! [`shoot::Shoot`] joins a shoot's peers to its stack (cryptokey routing in both directions).
//! [`device::Device`] maps a datagram to its shoot and peer: handshake initiations by the
//! sender's public key, everything else by the receiver index, whose upper 24 bits are keyed
//! by the device's private key so that a restarted process (or another replica) still knows
//! which peer a data packet belongs to. [`reconcile`] plans what a new table does to the
//! shoots and carries the plan out; [`failover`] chooses the peer each attempt of a dial goes
//! through and when the next joins. Every call takes `now` and writes datagrams through
//! a [`shoot::Io`]; none of these uses tokio.
//!
//! [`driver`] is the thin tokio layer: the UDP socket, the one timer, dials from the gateway
//! (`egress-connect` with `via: tunnel`) and accepted connections on the agent; [`framed`]
//! makes a TCP stream one more endpoint of the device (WireGuard over TCP); [`stream`] is a
//! tunneled stream. All three reach the device through [`shared`] (the handle and the state
//! its tasks share) and [`queues`] (the stream endpoints' queues), which import none of them;
//! only the driver imports the other two. None imports a role or the serving layer.

pub(crate) mod device;
pub(crate) mod dialer;
pub(crate) mod driver;
pub(crate) mod failover;
pub(crate) mod framed;
pub(crate) mod index;
pub(crate) mod peer;
pub(crate) mod queues;
pub(crate) mod reconcile;
pub(crate) mod shared;
pub(crate) mod shoot;
pub(crate) mod stack;
pub(crate) mod stream;

#[cfg(test)]
mod testing;

pub(crate) use driver::AgentSide;
pub(crate) use shared::Tunnels;
pub(crate) use stream::TunnelStream;
