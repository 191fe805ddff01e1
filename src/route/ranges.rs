//! A route's `allowedSourceRanges`: the client networks it admits, looked up per connection
//! without allocating in a [`NetSet`]. No I/O.

use std::net::IpAddr;

use serde::Serialize;

use super::net::{Net, NetError, NetSet};

/// The networks a route admits clients from. Never empty: a route that admits everyone
/// has none ([`Route::allowed_sources`](super::Route) is `None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceRanges {
    /// What clients are looked up in.
    set: NetSet,
    /// The networks as listed (masked, IPv4 first, a repeated one repeated): what is shown.
    listed: Box<[Net]>,
}

/// Why ranges cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangesError {
    /// The list is empty: it would admit nobody, which is more likely a mistake than meant.
    #[error(
        "an empty list would admit no client; leave the field out to admit every client, or list the networks to admit"
    )]
    Empty,
    /// A pair that is not a network: a prefix length longer than the address, or host bits.
    #[error("{0}")]
    Network(NetError),
}

impl SourceRanges {
    /// Ranges from (address, prefix length) pairs, read as [`Net::new`] does (host bits are
    /// an error): an IPv4-mapped IPv6 network (`::ffff:a.b.c.d/n`, n ≥ 96) is kept as the
    /// IPv4 network it names, as clients are matched normalised.
    pub fn new(networks: impl IntoIterator<Item = (IpAddr, u8)>) -> Result<Self, RangesError> {
        let nets = networks
            .into_iter()
            .map(|(addr, prefix)| Net::new(addr, prefix).map_err(RangesError::Network))
            .collect::<Result<Vec<_>, _>>()?;
        Self::from_nets(nets)
    }

    /// Ranges from networks.
    pub fn from_nets(networks: impl IntoIterator<Item = Net>) -> Result<Self, RangesError> {
        let (mut listed, v6): (Vec<Net>, Vec<Net>) = networks.into_iter().partition(Net::is_ipv4);
        listed.extend(v6);
        if listed.is_empty() {
            return Err(RangesError::Empty);
        }
        Ok(SourceRanges {
            set: listed.iter().copied().collect(),
            listed: listed.into_boxed_slice(),
        })
    }

    /// Whether `ip` is in one of the networks; an IPv4-mapped IPv6 address counts as the
    /// IPv4 address it carries. The unspecified address (`0.0.0.0`, `::`) is no client's
    /// address — only a PROXY header can claim it — and is never admitted, so `0.0.0.0/32`
    /// and `::/128` admit nobody.
    pub fn contains(&self, ip: IpAddr) -> bool {
        !ip.to_canonical().is_unspecified() && self.set.contains(ip)
    }

    /// The networks as listed, IPv4 first.
    pub fn networks(&self) -> impl Iterator<Item = Net> + '_ {
        self.listed.iter().copied()
    }
}

impl Serialize for SourceRanges {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.networks().map(|n| n.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(list: &[(&str, u8)]) -> SourceRanges {
        SourceRanges::new(list.iter().map(|&(a, p)| (a.parse().unwrap(), p))).unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn matches_v4_v6_and_mapped_clients() {
        let r = ranges(&[("2001:db8::", 32), ("203.0.113.0", 24)]);
        assert!(r.contains(ip("203.0.113.0")));
        assert!(r.contains(ip("203.0.113.255")));
        assert!(r.contains(ip("::ffff:203.0.113.9")));
        assert!(!r.contains(ip("203.0.114.1")));
        assert!(!r.contains(ip("203.0.112.255")));
        assert!(r.contains(ip("2001:db8:ffff::1")));
        assert!(!r.contains(ip("2001:db9::1")));
        // A v4 network never admits a v6 client with the same bits, nor the reverse.
        assert!(!r.contains(ip("::cb00:7101")));
        assert!(!ranges(&[("::", 96)]).contains(ip("203.0.113.1")));
        // Shown IPv4 first.
        assert_eq!(
            r.networks().map(|n| n.to_string()).collect::<Vec<_>>(),
            ["203.0.113.0/24", "2001:db8::/32"]
        );
    }

    #[test]
    fn the_unspecified_address_is_never_admitted() {
        let nobody = ranges(&[("0.0.0.0", 32), ("::", 128)]);
        for client in ["0.0.0.0", "::", "::ffff:0.0.0.0", "10.0.0.1", "::1"] {
            assert!(!nobody.contains(ip(client)), "{client}");
        }
        let everyone = ranges(&[("0.0.0.0", 0), ("::", 0)]);
        assert!(!everyone.contains(ip("0.0.0.0")) && !everyone.contains(ip("::")));
        assert!(everyone.contains(ip("10.0.0.1")) && everyone.contains(ip("2001:db8::1")));
    }

    #[test]
    fn bounds_of_prefix_lengths() {
        let everyone = ranges(&[("0.0.0.0", 0)]);
        assert!(everyone.contains(ip("255.255.255.255")));
        assert!(everyone.contains(ip("::ffff:1.2.3.4")));
        assert!(!everyone.contains(ip("::1")));
        let host = ranges(&[("127.0.0.1", 32), ("::1", 128)]);
        assert!(host.contains(ip("127.0.0.1")));
        assert!(!host.contains(ip("127.0.0.2")));
        assert!(host.contains(ip("::1")));
        assert!(!host.contains(ip("::2")));
        assert!(ranges(&[("::", 0)]).contains(ip("2001:db8::1")));
        // A mapped network is its IPv4 network.
        let mapped = ranges(&[("::ffff:10.0.0.0", 104)]);
        assert!(mapped.contains(ip("10.255.0.1")));
        assert!(!mapped.contains(ip("11.0.0.1")));
        assert_eq!(mapped.networks().next().unwrap().to_string(), "10.0.0.0/8");
    }

    #[test]
    fn rejects_empty_and_overlong() {
        assert_eq!(SourceRanges::new([]), Err(RangesError::Empty));
        assert!(matches!(
            SourceRanges::new([(ip("10.0.0.0"), 33)]),
            Err(RangesError::Network(NetError::TooLong { .. }))
        ));
        assert!(SourceRanges::new([(ip("::"), 129)]).is_err());
        assert!(matches!(
            SourceRanges::new([(ip("10.0.0.1"), 8)]),
            Err(RangesError::Network(NetError::HostBits { .. }))
        ));
    }

    #[test]
    fn serializes_as_cidr_strings() {
        let r = ranges(&[("10.1.0.0", 16), ("fd00::", 8)]);
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"["10.1.0.0/16","fd00::/8"]"#
        );
    }
}
