//! Sockets and byte moving: listener sockets, reads from client streams before routing, the
//! dial interface with its direct TCP dialer and tunnel layer, the process's resolver for
//! names (cached, bounded, on its own event loop), and the duplex copy loop with half-close,
//! idle and lifetime bounds.
//!
//! Nothing here knows about listeners' routing rules or metrics registries; callers hand in
//! a route (for backend choice), counters, and the bytes already read (to replay). The only
//! protocol bytes handled here are a tunnel's own handshake, through the `wire` codecs. Log
//! lines that traffic can repeat (connect failures) go through a rate limit ([`lograte`]).

pub(crate) mod dial;
pub mod fds;
pub(crate) mod lograte;
pub mod prefixed;
pub(crate) mod relay;
pub(crate) mod resolve;
pub mod socket;
pub(crate) mod stream;
pub mod tls;

pub use dial_family::IpFamily;

mod dial_family {
    use std::net::SocketAddr;

    /// Which resolved addresses a dialer uses.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum IpFamily {
        /// Both.
        #[default]
        Any,
        /// IPv4 only.
        V4,
        /// IPv6 only.
        V6,
    }

    impl IpFamily {
        /// Whether `addr` is acceptable.
        pub fn allows(self, addr: &SocketAddr) -> bool {
            match self {
                IpFamily::Any => true,
                IpFamily::V4 => addr.is_ipv4(),
                IpFamily::V6 => addr.is_ipv6(),
            }
        }
    }
}
