//! IP networks ([`Net`]) and tables of them with longest-prefix lookup ([`NetTable`],
//! [`NetSet`]): the one representation behind `trustedSources`, `allowedSourceRanges` and the
//! networks the controller reads from Envoy RBAC filters.
//!
//! An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) is the IPv4 address it carries, both as a
//! client looked up and as a network (`::ffff:10.0.0.0/104` is `10.0.0.0/8`), because
//! clients reach a dual-stack socket as mapped addresses. A network has no host bits, and
//! text or a pair with host bits is not a network: `10.1.2.3/8` is refused
//! ([`NetError::HostBits`], which names `10.0.0.0/8` and `10.1.2.3/32`), never widened
//! silently to `10.0.0.0/8` — in an allow-list that would hide a typo that admits more. A
//! reader of other programs' objects that must not refuse them takes the network the error
//! names, and says so. Pure data, no I/O.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

/// An IP network such as `10.0.0.0/8` or `2001:db8::/32`: the address with the host bits
/// cleared and a prefix length within its family. Ordered by address (IPv4 first), then
/// prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Net {
    /// The network address (host bits zero; never an IPv4-mapped IPv6 address once the prefix
    /// reaches into the IPv4 part).
    addr: IpAddr,
    /// The prefix length (at most 32 for IPv4, 128 for IPv6).
    prefix: u8,
}

/// Why text or an (address, prefix length) pair is not a network.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetError {
    /// The address part is not an IP address.
    #[error("invalid IP address {0:?}")]
    Address(String),
    /// The prefix part is not a number or is longer than the address (text as written).
    #[error("invalid prefix length {0:?}")]
    Prefix(String),
    /// A prefix length longer than the address.
    #[error("prefix length {prefix} is longer than the address of {addr}")]
    TooLong {
        /// The address.
        addr: IpAddr,
        /// The prefix length.
        prefix: u8,
    },
    /// The address has bits set beyond the prefix length: a typo for the network, or for the
    /// one address.
    #[error(
        "{given} has host bits set: did you mean {network} (or {} for the one address)?",
        Net::host(*address)
    )]
    HostBits {
        /// The network as written (`IP/prefix`).
        given: String,
        /// The network with the host bits cleared.
        network: Net,
        /// The address as written (an IPv4-mapped one as IPv4 where the network is IPv4).
        address: IpAddr,
    },
}

impl Net {
    /// Every IPv4 address, `0.0.0.0/0`.
    pub const ANY_V4: Net = Net {
        addr: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        prefix: 0,
    };

    /// Every IPv6 address, `::/0`.
    pub const ANY_V6: Net = Net {
        addr: IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        prefix: 0,
    };

    /// The network `addr/prefix`; host bits are an error ([`NetError::HostBits`]). An
    /// IPv4-mapped IPv6 address with a prefix of at least 96 is the IPv4 network it names
    /// (`::ffff:10.0.0.0/104` is `10.0.0.0/8`); with a shorter prefix it stays an IPv6
    /// network.
    pub fn new(addr: IpAddr, prefix: u8) -> Result<Net, NetError> {
        let (net, bits) = match addr {
            IpAddr::V6(a) if prefix >= 96 => match a.to_ipv4_mapped() {
                Some(v4) => (IpAddr::V4(v4), prefix - 96),
                None => (addr, prefix),
            },
            _ => (addr, prefix),
        };
        if bits > width(net) {
            return Err(NetError::TooLong { addr, prefix });
        }
        Net::exact(net, bits, || format!("{addr}/{prefix}"))
    }

    /// The network of one address (`/32` or `/128`; an IPv4-mapped address as IPv4).
    pub fn host(ip: IpAddr) -> Net {
        let ip = ip.to_canonical();
        Net {
            addr: ip,
            prefix: width(ip),
        }
    }

    /// Parses `IP/prefix` or a bare IP (a host network), as `trustedSources` and
    /// `allowedSourceRanges` are written. The address is read first, an IPv4-mapped one as
    /// the IPv4 address it carries, and the prefix length counts bits of that family:
    /// `::ffff:10.0.0.0/8` is `10.0.0.0/8` and `::ffff:10.0.0.0/104` is an error here, unlike
    /// [`Net::new`], which takes the pair as IPv6 until the prefix reaches the IPv4 part.
    /// Host bits are an error ([`NetError::HostBits`]); a bare address is the network of
    /// that one address.
    pub fn parse(s: &str) -> Result<Net, NetError> {
        let (ip, prefix) = match s.split_once('/') {
            Some((ip, p)) => (ip, Some(p)),
            None => (s, None),
        };
        let addr = ip
            .parse::<IpAddr>()
            .map_err(|_| NetError::Address(ip.to_owned()))?
            .to_canonical();
        let max = width(addr);
        let prefix = match prefix {
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|&p| p <= max)
                .ok_or_else(|| NetError::Prefix(p.to_owned()))?,
            None => max,
        };
        Net::exact(addr, prefix, || s.to_owned())
    }

    /// The network address (host bits zero).
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Whether this is an IPv4 network.
    pub fn is_ipv4(&self) -> bool {
        self.addr.is_ipv4()
    }

    /// Whether `ip` is in this network (an IPv4-mapped IPv6 address counts as IPv4; an IPv4
    /// network never holds an IPv6 address with the same bits, nor the reverse).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let (family, bits) = key(ip.to_canonical());
        let (own, net) = key(self.addr);
        family == own && bits & mask(self.prefix) == net
    }

    /// Whether every address of `other` is in this network (a network contains itself).
    pub fn contains_net(&self, other: &Net) -> bool {
        self.prefix <= other.prefix && self.contains(other.addr)
    }

    /// Whether the two networks share an address: one contains the other.
    pub fn overlaps(&self, other: &Net) -> bool {
        self.contains_net(other) || other.contains_net(self)
    }

    /// `addr/prefix`, or [`NetError::HostBits`] naming the network as `given` writes it;
    /// `addr` is canonical and `prefix` fits it.
    fn exact(addr: IpAddr, prefix: u8, given: impl FnOnce() -> String) -> Result<Net, NetError> {
        let net = Net::masked(addr, prefix);
        if net.addr == addr {
            Ok(net)
        } else {
            Err(NetError::HostBits {
                given: given(),
                network: net,
                address: addr,
            })
        }
    }

    /// `addr/prefix` with the host bits cleared; `addr` is canonical and `prefix` fits it.
    fn masked(addr: IpAddr, prefix: u8) -> Net {
        let addr = match addr {
            IpAddr::V4(a) => IpAddr::V4(Ipv4Addr::from(
                u32::from(a) & u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0),
            )),
            IpAddr::V6(a) => IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask(prefix))),
        };
        Net { addr, prefix }
    }
}

impl fmt::Display for Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for Net {
    type Err = NetError;

    /// [`Net::parse`].
    fn from_str(s: &str) -> Result<Net, NetError> {
        Net::parse(s)
    }
}

/// The address length of `ip`'s family in bits.
fn width(ip: IpAddr) -> u8 {
    if ip.is_ipv4() { 32 } else { 128 }
}

/// An address family, kept apart in tables: IPv4 bits never match IPv6 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

/// An address as its family and its bits, IPv4 in the top 32 bits so that one mask per
/// prefix length serves both families.
fn key(ip: IpAddr) -> (Family, u128) {
    match ip {
        IpAddr::V4(a) => (Family::V4, u128::from(u32::from(a)) << 96),
        IpAddr::V6(a) => (Family::V6, u128::from(a)),
    }
}

/// The mask of a prefix length over [`key`] bits (at most 128).
fn mask(prefix: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0)
}

/// Networks with a value each, looked up by address: the longest prefix holding the address
/// wins. A lookup costs one ordered-map search per distinct prefix length in the address's
/// family (at most 33 for IPv4, 129 for IPv6), however many networks there are; inserting
/// costs the same. Iteration follows insertion order.
#[derive(Clone, PartialEq, Eq)]
pub struct NetTable<T> {
    /// Every network and its value, in insertion order.
    entries: Vec<(Net, T)>,
    /// The IPv4 networks' index.
    v4: Vec<Level>,
    /// The IPv6 networks' index.
    v6: Vec<Level>,
}

/// The networks of one prefix length in one family.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Level {
    /// The prefix length.
    prefix: u8,
    /// Its mask over [`key`] bits.
    mask: u128,
    /// Network bits to the entry's index.
    nets: BTreeMap<u128, usize>,
}

impl<T> Default for NetTable<T> {
    fn default() -> Self {
        NetTable {
            entries: Vec::new(),
            v4: Vec::new(),
            v6: Vec::new(),
        }
    }
}

impl<T> NetTable<T> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many networks it holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds no network.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Adds `net` with `value`; a network already present keeps its place and gets the new
    /// value, and the old one is returned.
    pub fn insert(&mut self, net: Net, value: T) -> Option<T> {
        let (family, bits) = key(net.addr);
        let levels = match family {
            Family::V4 => &mut self.v4,
            Family::V6 => &mut self.v6,
        };
        // Longest prefix first.
        let at = levels
            .iter()
            .position(|l| l.prefix <= net.prefix)
            .unwrap_or(levels.len());
        if levels.get(at).is_none_or(|l| l.prefix != net.prefix) {
            levels.insert(
                at,
                Level {
                    prefix: net.prefix,
                    mask: mask(net.prefix),
                    nets: BTreeMap::new(),
                },
            );
        }
        match levels[at].nets.entry(bits) {
            std::collections::btree_map::Entry::Occupied(e) => {
                Some(std::mem::replace(&mut self.entries[*e.get()].1, value))
            }
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(self.entries.len());
                self.entries.push((net, value));
                None
            }
        }
    }

    /// The value of exactly `net`.
    pub fn get(&self, net: &Net) -> Option<&T> {
        let (family, bits) = key(net.addr);
        let level = self
            .levels(family)
            .iter()
            .find(|l| l.prefix == net.prefix)?;
        level.nets.get(&bits).map(|&i| &self.entries[i].1)
    }

    /// The longest network holding `ip` (an IPv4-mapped IPv6 address looked up as IPv4),
    /// with its value.
    pub fn lookup(&self, ip: IpAddr) -> Option<(&Net, &T)> {
        let (family, bits) = key(ip.to_canonical());
        self.levels(family)
            .iter()
            .find_map(|l| l.nets.get(&(bits & l.mask)))
            .map(|&i| self.entry(i))
    }

    /// Whether a network holds `ip`.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.lookup(ip).is_some()
    }

    /// A network that shares an address with `net` (holds it, equals it or lies inside it),
    /// with its value; the longest such network when one holds `net`.
    pub fn overlapping(&self, net: &Net) -> Option<(&Net, &T)> {
        let (family, bits) = key(net.addr);
        let last = bits | !mask(net.prefix);
        self.levels(family)
            .iter()
            .find_map(|l| {
                if l.prefix <= net.prefix {
                    l.nets.get(&(bits & l.mask))
                } else {
                    l.nets.range(bits..=last).next().map(|(_, i)| i)
                }
            })
            .map(|&i| self.entry(i))
    }

    /// A pair of overlapping networks, one of this table's and one of `other`'s, if any:
    /// what "these lists never overlap" is checked with.
    pub fn overlaps<'a, U>(&'a self, other: &'a NetTable<U>) -> Option<(&'a Net, &'a Net)> {
        self.entries
            .iter()
            .find_map(|(net, _)| Some((net, other.overlapping(net)?.0)))
    }

    /// The networks and their values, in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&Net, &T)> {
        self.entries.iter().map(|(n, v)| (n, v))
    }

    fn levels(&self, family: Family) -> &[Level] {
        match family {
            Family::V4 => &self.v4,
            Family::V6 => &self.v6,
        }
    }

    fn entry(&self, i: usize) -> (&Net, &T) {
        let (net, value) = &self.entries[i];
        (net, value)
    }
}

impl<T> FromIterator<(Net, T)> for NetTable<T> {
    fn from_iter<I: IntoIterator<Item = (Net, T)>>(iter: I) -> Self {
        let mut table = NetTable::new();
        for (net, value) in iter {
            table.insert(net, value);
        }
        table
    }
}

impl<T: fmt::Debug> fmt::Debug for NetTable<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.entries.iter().map(|(n, v)| (DisplayNet(n), v)))
            .finish()
    }
}

/// A set of networks, looked up by address like a [`NetTable`] without values.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct NetSet(NetTable<()>);

impl NetSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many networks it holds.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it holds no network.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds `net`; false if it was there already.
    pub fn insert(&mut self, net: Net) -> bool {
        self.0.insert(net, ()).is_none()
    }

    /// Whether a network holds `ip` (an IPv4-mapped IPv6 address looked up as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.contains(ip)
    }

    /// The longest network holding `ip`.
    pub fn lookup(&self, ip: IpAddr) -> Option<&Net> {
        self.0.lookup(ip).map(|(n, ())| n)
    }

    /// A network that shares an address with `net` (see [`NetTable::overlapping`]).
    pub fn overlapping(&self, net: &Net) -> Option<&Net> {
        self.0.overlapping(net).map(|(n, ())| n)
    }

    /// A pair of overlapping networks, one of this set's and one of `other`'s, if any.
    pub fn overlaps<'a>(&'a self, other: &'a NetSet) -> Option<(&'a Net, &'a Net)> {
        self.0.overlaps(&other.0)
    }

    /// The networks, in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = &Net> {
        self.0.iter().map(|(n, ())| n)
    }
}

impl FromIterator<Net> for NetSet {
    fn from_iter<I: IntoIterator<Item = Net>>(iter: I) -> Self {
        NetSet(iter.into_iter().map(|n| (n, ())).collect())
    }
}

impl fmt::Debug for NetSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter().map(DisplayNet)).finish()
    }
}

/// A network debug-printed as `10.0.0.0/8`.
struct DisplayNet<'a>(&'a Net);

impl fmt::Debug for DisplayNet<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn net(s: &str) -> Net {
        Net::parse(s).unwrap()
    }

    fn set(list: &[&str]) -> NetSet {
        list.iter().map(|s| net(s)).collect()
    }

    #[test]
    fn parses_networks_and_bare_addresses() {
        assert_eq!(net("10.0.0.0/8").to_string(), "10.0.0.0/8");
        assert_eq!(net("10.1.2.3").to_string(), "10.1.2.3/32");
        assert_eq!(net("10.1.2.3/32").to_string(), "10.1.2.3/32");
        assert_eq!(net("fd00::/64").to_string(), "fd00::/64");
        assert_eq!(net("::1").to_string(), "::1/128");
        assert_eq!(net("0.0.0.0/0"), Net::ANY_V4);
        assert_eq!(net("::/0"), Net::ANY_V6);
        // A mapped address is read as IPv4, its prefix counted in IPv4 bits.
        assert_eq!(net("::ffff:10.1.0.0/16").to_string(), "10.1.0.0/16");
        assert_eq!(net("::ffff:127.0.0.1").to_string(), "127.0.0.1/32");
        assert_eq!(
            Net::parse("::ffff:10.0.0.0/104"),
            Err(NetError::Prefix("104".into()))
        );
        assert_eq!(
            Net::parse("10.0.0.0/33"),
            Err(NetError::Prefix("33".into()))
        );
        assert!(Net::parse("::/129").is_err());
        assert!(Net::parse("::/-1").is_err());
        assert!(Net::parse("10.0.0.0/").is_err());
        assert_eq!(Net::parse("nope/8"), Err(NetError::Address("nope".into())));
        assert_eq!(
            Net::parse("10.0.0.0/x").unwrap_err().to_string(),
            "invalid prefix length \"x\""
        );
        assert_eq!("10.0.0.0/8".parse::<Net>(), Ok(net("10.0.0.0/8")));
    }

    /// Host bits are refused, never cleared: the error names the network and the one
    /// address either reading would have meant.
    #[test]
    fn host_bits_are_an_error_naming_what_was_meant() {
        let refused = |s: &str| Net::parse(s).unwrap_err().to_string();
        assert_eq!(
            refused("127.0.0.1/8"),
            "127.0.0.1/8 has host bits set: did you mean 127.0.0.0/8 (or 127.0.0.1/32 for the one address)?"
        );
        assert_eq!(
            Net::parse("10.1.2.3/8"),
            Err(NetError::HostBits {
                given: "10.1.2.3/8".into(),
                network: net("10.0.0.0/8"),
                address: ip("10.1.2.3"),
            })
        );
        assert_eq!(
            refused("fd00::1/64"),
            "fd00::1/64 has host bits set: did you mean fd00::/64 (or fd00::1/128 for the one address)?"
        );
        assert_eq!(
            refused("2001:db8::8000/112"),
            "2001:db8::8000/112 has host bits set: did you mean 2001:db8::/112 (or 2001:db8::8000/128 for the one address)?"
        );
        // A mapped address is written as given, the networks meant as IPv4.
        assert_eq!(
            refused("::ffff:10.1.2.3/16"),
            "::ffff:10.1.2.3/16 has host bits set: did you mean 10.1.0.0/16 (or 10.1.2.3/32 for the one address)?"
        );
        assert!(Net::parse("2001:db8::8000/113").is_ok());
        assert!(Net::parse("0.0.0.1/0").is_err());
        assert!(Net::parse("::1/0").is_err());
        // The last bit before the prefix is the network's; the first after it a host bit.
        assert!(Net::parse("10.0.0.128/25").is_ok());
        assert!(Net::parse("10.0.0.64/25").is_err());
        // Pairs are refused alike.
        assert_eq!(
            Net::new(ip("::ffff:10.1.2.3"), 104)
                .unwrap_err()
                .to_string(),
            "::ffff:10.1.2.3/104 has host bits set: did you mean 10.0.0.0/8 (or 10.1.2.3/32 for the one address)?"
        );
        assert!(Net::new(ip("10.1.2.3"), 8).is_err());
        assert!(Net::new(ip("10.1.2.3"), 32).is_ok());
    }

    #[test]
    fn pairs_take_mapped_networks_from_prefix_96() {
        let new = |a: &str, p| Net::new(ip(a), p);
        assert_eq!(
            new("::ffff:10.0.0.0", 104).unwrap().to_string(),
            "10.0.0.0/8"
        );
        assert_eq!(new("::ffff:0.0.0.0", 96).unwrap(), Net::ANY_V4);
        // Shorter: an IPv6 network (which no client normalised to IPv4 is in), whose
        // `ffff` bits are host bits.
        assert!(matches!(
            new("::ffff:10.0.0.0", 80),
            Err(NetError::HostBits { network, .. }) if network.to_string() == "::/80"
        ));
        let v6 = new("::", 80).unwrap();
        assert!(!v6.contains(ip("10.0.0.1")) && !v6.contains(ip("::ffff:10.0.0.1")));
        assert_eq!(
            new("::ffff:10.0.0.0", 129),
            Err(NetError::TooLong {
                addr: ip("::ffff:10.0.0.0"),
                prefix: 129
            })
        );
        assert!(new("10.0.0.0", 33).is_err());
        assert!(new("2001:db8::", 128).is_ok());
        assert_eq!(Net::host(ip("::ffff:1.2.3.4")).to_string(), "1.2.3.4/32");
        assert_eq!(Net::host(ip("::1")).to_string(), "::1/128");
    }

    #[test]
    fn prefix_edges() {
        let all4 = net("0.0.0.0/0");
        assert!(all4.contains(ip("0.0.0.0")) && all4.contains(ip("255.255.255.255")));
        assert!(all4.contains(ip("::ffff:1.2.3.4")));
        assert!(!all4.contains(ip("::1")) && !all4.contains(ip("::")));
        let all6 = net("::/0");
        assert!(all6.contains(ip("::")) && all6.contains(ip("ffff::1")));
        assert!(!all6.contains(ip("1.2.3.4")) && !all6.contains(ip("::ffff:1.2.3.4")));
        let host4 = net("10.0.0.1/32");
        assert!(host4.contains(ip("10.0.0.1")) && !host4.contains(ip("10.0.0.0")));
        assert!(!host4.contains(ip("10.0.0.2")));
        let host6 = net("2001:db8::1/128");
        assert!(host6.contains(ip("2001:db8::1")) && !host6.contains(ip("2001:db8::")));
        // Same bits, other family.
        assert!(!net("0.0.0.0/8").contains(ip("::1")));
        assert!(!net("::/8").contains(ip("0.0.0.1")));
        let v4 = net("203.0.113.0/24");
        assert!(v4.contains(ip("203.0.113.255")) && !v4.contains(ip("203.0.114.0")));
        assert!(!v4.contains(ip("203.0.112.255")));
        assert!(
            !v4.contains(ip("::cb00:7101")),
            "v4-compatible is not mapped"
        );
    }

    #[test]
    fn the_longest_prefix_wins() {
        let table: NetTable<&str> = [
            (net("10.0.0.0/8"), "eight"),
            (net("10.1.2.0/24"), "twenty-four"),
            (net("10.1.0.0/16"), "sixteen"),
            (net("0.0.0.0/0"), "v4"),
            (net("10.1.2.3/32"), "host"),
            (net("2001:db8::/32"), "doc"),
            (net("2001:db8:1::/48"), "doc48"),
            (net("::/0"), "v6"),
        ]
        .into_iter()
        .collect();
        let at = |s: &str| table.lookup(ip(s)).map(|(n, v)| (n.to_string(), *v));
        assert_eq!(at("10.1.2.3"), Some(("10.1.2.3/32".into(), "host")));
        assert_eq!(at("10.1.2.4"), Some(("10.1.2.0/24".into(), "twenty-four")));
        assert_eq!(at("10.1.3.4"), Some(("10.1.0.0/16".into(), "sixteen")));
        assert_eq!(at("10.2.0.0"), Some(("10.0.0.0/8".into(), "eight")));
        assert_eq!(at("11.0.0.0"), Some(("0.0.0.0/0".into(), "v4")));
        assert_eq!(at("::ffff:10.1.2.3").unwrap().1, "host");
        assert_eq!(at("2001:db8:1::5").unwrap().1, "doc48");
        assert_eq!(at("2001:db8:2::5").unwrap().1, "doc");
        assert_eq!(at("::1").unwrap().1, "v6");
        // Insertion order is kept for iteration; a network inserted again keeps its place.
        let mut table = table;
        assert_eq!(table.insert(net("10.0.0.0/8"), "again"), Some("eight"));
        assert_eq!(table.len(), 8);
        assert_eq!(table.iter().next().map(|(_, v)| *v), Some("again"));
        assert_eq!(table.get(&net("10.1.0.0/16")), Some(&"sixteen"));
        assert_eq!(table.get(&net("10.1.0.0/17")), None);

        let v4_only: NetTable<u8> = [(net("10.0.0.0/8"), 1)].into_iter().collect();
        assert_eq!(v4_only.lookup(ip("11.0.0.0")), None);
        assert_eq!(v4_only.lookup(ip("::a00:1")), None, "same bits, IPv6");
        assert!(NetTable::<()>::new().lookup(ip("1.2.3.4")).is_none());
    }

    #[test]
    fn lookups_in_thousands_of_networks() {
        // 4096 /24s and 4096 /32s beside them: every address finds its own.
        let mut table = NetTable::new();
        for i in 0..4096u32 {
            let base = Ipv4Addr::from(0x0a00_0000 | (i << 8));
            table.insert(Net::new(IpAddr::V4(base), 24).unwrap(), i);
            let host = Ipv4Addr::from(0x0a00_0000 | (i << 8) | 7);
            table.insert(Net::host(IpAddr::V4(host)), i + 10_000);
        }
        for i in (0..4096u32).step_by(97) {
            let host = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 | (i << 8) | 7));
            let other = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 | (i << 8) | 8));
            assert_eq!(table.lookup(host).map(|(_, v)| *v), Some(i + 10_000));
            assert_eq!(table.lookup(other).map(|(_, v)| *v), Some(i));
        }
        assert!(!table.contains(ip("10.16.0.1")));
    }

    #[test]
    fn overlaps_need_one_network_inside_the_other() {
        let a = net("10.0.0.0/8");
        assert!(a.overlaps(&net("10.1.0.0/16")) && net("10.1.0.0/16").overlaps(&a));
        assert!(a.overlaps(&a));
        assert!(a.contains_net(&net("10.255.255.255/32")));
        assert!(!net("10.1.0.0/16").contains_net(&a));
        assert!(
            !net("10.0.0.0/16").contains_net(&a),
            "shorter is never inside longer"
        );
        // Same first bits, disjoint: only the prefix length tells.
        assert!(!net("10.0.0.0/16").overlaps(&net("10.1.0.0/16")));
        assert!(!net("10.0.0.0/24").overlaps(&net("10.0.1.0/24")));
        assert!(!a.overlaps(&net("11.0.0.0/8")));
        assert!(!net("0.0.0.0/0").overlaps(&net("::/0")));
        assert!(net("0.0.0.0/0").overlaps(&net("1.2.3.4/32")));

        let routes = set(&["10.0.0.0/16", "10.2.0.0/16", "2001:db8::/48"]);
        let overlap = |list: &[&str]| {
            routes
                .overlaps(&set(list))
                .map(|(a, b)| (a.to_string(), b.to_string()))
        };
        assert_eq!(
            overlap(&["10.1.0.0/16", "10.3.0.0/16", "2001:db8:1::/48"]),
            None
        );
        // Inside one of them, around one of them, equal to one.
        assert_eq!(
            overlap(&["10.3.0.0/16", "10.2.7.0/24"]),
            Some(("10.2.0.0/16".into(), "10.2.7.0/24".into()))
        );
        assert_eq!(
            overlap(&["10.0.0.0/8"]),
            Some(("10.0.0.0/16".into(), "10.0.0.0/8".into()))
        );
        assert!(overlap(&["2001:db8::/48"]).is_some());
        assert!(overlap(&["2001:db8::ff/128"]).is_some());
        assert!(overlap(&["2001:db8:0:1::/64"]).is_some());
        assert!(overlap(&["2001:db8:1::/64"]).is_none());
        assert!(overlap(&["0.0.0.0/0"]).is_some());
        assert!(overlap(&["::/0"]).is_some());
        assert!(overlap(&["10.1.255.255/32", "10.2.0.0/15"]).is_some());
        assert!(overlap(&["10.1.255.255/32", "10.4.0.0/15"]).is_none());
        // Mapped networks overlap the IPv4 networks they name.
        assert!(
            routes
                .overlapping(&Net::new(ip("::ffff:10.0.1.0"), 120).unwrap())
                .is_some()
        );
    }

    #[test]
    fn overlapping_finds_the_network_around_or_inside() {
        let s = set(&["10.0.0.0/8", "10.1.0.0/16", "192.168.1.0/24", "fd00::/8"]);
        let at = |n: &str| s.overlapping(&net(n)).map(Net::to_string);
        assert_eq!(at("10.1.2.0/24").as_deref(), Some("10.1.0.0/16"));
        assert_eq!(at("10.2.0.0/16").as_deref(), Some("10.0.0.0/8"));
        assert_eq!(at("192.168.0.0/16").as_deref(), Some("192.168.1.0/24"));
        assert_eq!(at("192.168.0.0/24"), None);
        assert_eq!(at("192.168.2.0/23"), None);
        assert_eq!(at("192.168.0.0/23").as_deref(), Some("192.168.1.0/24"));
        assert_eq!(at("fd12::/16").as_deref(), Some("fd00::/8"));
        assert_eq!(at("fe00::/8"), None);
        assert_eq!(at("::/0").as_deref(), Some("fd00::/8"));
    }

    #[test]
    fn sets_count_each_network_once_and_debug_print_as_text() {
        let mut s = set(&["10.0.0.0/8", "2001:db8::/32"]);
        assert!(!s.insert(net("10.0.0.0/8")), "the same network");
        assert!(s.insert(net("10.0.0.0/9")));
        assert_eq!(s.len(), 3);
        assert_eq!(format!("{s:?}"), "{10.0.0.0/8, 2001:db8::/32, 10.0.0.0/9}");
        assert_eq!(s.lookup(ip("10.1.0.0")), Some(&net("10.0.0.0/9")));
        assert!(NetSet::new().is_empty());
    }
}
