//! PROXY protocol v1 and v2 headers (HAProxy's spec), detected automatically.
//!
//! Decoding is done by the `proxy-header` crate; this module puts it behind the
//! [`Parsed`] interface, adds the size cap and signature detection needed for `optional`
//! mode, and turns TLVs into short strings for logs. No I/O.

use std::fmt::Write as _;
use std::net::SocketAddr;

use proxy_header::{ParseConfig, ProxyHeader, Tlv};
use thiserror::Error;

use super::Parsed;

/// The v1 signature.
pub const V1_SIGNATURE: &[u8] = b"PROXY ";
/// The v2 signature.
pub const V2_SIGNATURE: &[u8] = b"\r\n\r\n\x00\r\nQUIT\n";
/// Longest v1 header (spec: 107 bytes).
pub const V1_MAX: usize = 107;
/// Most TLV entries kept for logs.
pub const MAX_TLVS_LOGGED: usize = 8;
/// Longest TLV value kept for logs.
const MAX_TLV_VALUE_LOGGED: usize = 64;

/// A parsed PROXY header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyInfo {
    /// 1 or 2.
    pub version: u8,
    /// Source and destination; `None` for `LOCAL` (v2) and `UNKNOWN` (v1).
    pub addresses: Option<(SocketAddr, SocketAddr)>,
    /// TLVs (v2) as `name=value` strings for logs.
    pub tlvs: Vec<String>,
}

impl ProxyInfo {
    /// The original client address, if the header carries one.
    pub fn source(&self) -> Option<SocketAddr> {
        self.addresses.map(|a| a.0)
    }

    /// The original destination address, if the header carries one.
    pub fn destination(&self) -> Option<SocketAddr> {
        self.addresses.map(|a| a.1)
    }
}

/// Why bytes are not an acceptable PROXY header.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Reject {
    /// The bytes do not start with a PROXY signature.
    #[error("no PROXY protocol signature")]
    NotProxy,
    /// The header is longer than allowed.
    #[error("PROXY header longer than {limit} bytes")]
    TooLarge {
        /// The configured cap.
        limit: usize,
    },
    /// The header is malformed.
    #[error("malformed PROXY header")]
    Malformed,
}

impl Reject {
    /// Stable short name for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Reject::NotProxy => "missing",
            Reject::TooLarge { .. } => "too_large",
            Reject::Malformed => "invalid",
        }
    }
}

/// Whether the first bytes of a connection are a PROXY header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detect {
    /// Too few bytes to tell.
    NeedMore,
    /// A PROXY v1 or v2 signature.
    Proxy,
    /// Something else.
    NotProxy,
}

/// Tells from the first bytes whether a PROXY header follows.
pub fn detect(buf: &[u8]) -> Detect {
    for sig in [V1_SIGNATURE, V2_SIGNATURE] {
        let n = buf.len().min(sig.len());
        if buf[..n] == sig[..n] {
            return if n == sig.len() {
                Detect::Proxy
            } else {
                Detect::NeedMore
            };
        }
    }
    Detect::NotProxy
}

/// Parses a PROXY v1 or v2 header of at most `limit` bytes from the start of `buf`.
pub fn parse(buf: &[u8], limit: usize) -> Result<Parsed<ProxyInfo>, Reject> {
    match detect(buf) {
        Detect::NotProxy => return Err(Reject::NotProxy),
        Detect::NeedMore if buf.len() >= limit => return Err(Reject::TooLarge { limit }),
        Detect::NeedMore => return Ok(Parsed::Incomplete),
        Detect::Proxy => {}
    }
    let version = if buf.starts_with(V1_SIGNATURE) { 1 } else { 2 };
    if version == 2 && buf.len() >= 16 {
        let declared = 16 + usize::from(u16::from_be_bytes([buf[14], buf[15]]));
        if declared > limit {
            return Err(Reject::TooLarge { limit });
        }
    }
    // proxy-header stops waiting for a v1 line at 107 bytes but takes a longer one that
    // arrives whole; it sees no more than the spec allows, so a split cannot change the answer.
    let input = if version == 1 {
        &buf[..buf.len().min(V1_MAX)]
    } else {
        buf
    };
    match ProxyHeader::parse(input, ParseConfig::default()) {
        Ok((_, consumed)) if consumed > limit => Err(Reject::TooLarge { limit }),
        Ok((header, consumed)) => {
            let addresses = header.proxied_address().map(|a| (a.source, a.destination));
            let tlvs = if version == 2 {
                summarize_tlvs(&header)?
            } else {
                Vec::new()
            };
            Ok(Parsed::Complete {
                value: ProxyInfo {
                    version,
                    addresses,
                    tlvs,
                },
                consumed,
            })
        }
        Err(proxy_header::Error::BufferTooShort) => {
            if buf.len() >= limit.min(if version == 1 { V1_MAX } else { usize::MAX }) {
                Err(Reject::TooLarge { limit })
            } else {
                Ok(Parsed::Incomplete)
            }
        }
        Err(_) => Err(Reject::Malformed),
    }
}

fn summarize_tlvs(header: &ProxyHeader<'_>) -> Result<Vec<String>, Reject> {
    let mut out = Vec::new();
    for tlv in header.tlvs() {
        let tlv = tlv.map_err(|_| Reject::Malformed)?;
        if out.len() >= MAX_TLVS_LOGGED {
            continue;
        }
        let s = match &tlv {
            Tlv::Alpn(v) => format!("alpn={}", printable(v)),
            Tlv::Authority(v) => format!("authority={}", printable(v.as_bytes())),
            Tlv::Crc32c(v) => format!("crc32c={v:08x}"),
            Tlv::Noop(_) => "noop".into(),
            Tlv::UniqueId(v) => format!("unique_id={}", hex(v)),
            Tlv::Ssl(info) => format!(
                "ssl={}",
                info.version()
                    .map_or("?".into(), |v| printable(v.as_bytes()))
            ),
            Tlv::Netns(v) => format!("netns={}", printable(v.as_bytes())),
            Tlv::Custom(kind, v) => format!("0x{kind:02x}={}", hex(v)),
            other => format!("0x{:02x}", other.kind()),
        };
        out.push(s);
    }
    Ok(out)
}

fn printable(v: &[u8]) -> String {
    v.iter()
        .take(MAX_TLV_VALUE_LOGGED)
        .map(|&b| if b.is_ascii_graphic() { b as char } else { '?' })
        .collect()
}

fn hex(v: &[u8]) -> String {
    let mut s = String::new();
    for b in v.iter().take(MAX_TLV_VALUE_LOGGED / 2) {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Which PROXY header a route sends its backends (`sendProxyProtocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProxyVersion {
    /// The text header, `PROXY TCP4|TCP6 ...\r\n`.
    V1,
    /// The binary header.
    V2,
}

impl ProxyVersion {
    /// The name in routing tables and configuration: `v1` or `v2`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyVersion::V1 => "v1",
            ProxyVersion::V2 => "v2",
        }
    }

    /// The version a routing table or configuration names (`v1`, `v2`).
    pub fn parse(s: &str) -> Option<ProxyVersion> {
        match s {
            "v1" => Some(ProxyVersion::V1),
            "v2" => Some(ProxyVersion::V2),
            _ => None,
        }
    }
}

/// Encodes a PROXY header of `version` for a TCP connection from `source` to
/// `destination`. IPv4-mapped IPv6 addresses are written as IPv4. The header has the family
/// of the source, which is never altered (it is what the receiver's allow-lists match); a
/// destination of the other family is written in the source's: an IPv4 destination behind an
/// IPv6 source as its IPv4-mapped IPv6 address, an IPv6 destination behind an IPv4 source as
/// `0.0.0.0` with its port (an IPv4 header cannot carry it).
pub fn encode(version: ProxyVersion, source: SocketAddr, destination: SocketAddr) -> Vec<u8> {
    let canonical = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    let (source, destination) = (canonical(source), canonical(destination));
    let destination = match (source, destination) {
        (SocketAddr::V6(_), SocketAddr::V4(d)) => {
            SocketAddr::new(d.ip().to_ipv6_mapped().into(), d.port())
        }
        (SocketAddr::V4(_), SocketAddr::V6(d)) => {
            SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), d.port())
        }
        _ => destination,
    };
    let header =
        ProxyHeader::with_address(proxy_header::ProxiedAddress::stream(source, destination));
    let mut out = Vec::with_capacity(V1_MAX);
    // The families match and there are no TLVs: the encoder has nothing to refuse.
    let _ = match version {
        ProxyVersion::V1 => header.encode_v1(&mut out),
        ProxyVersion::V2 => header.encode_v2(&mut out),
    };
    out
}

/// Encodes a v2 `PROXY` header for a TCP connection from `source` to `destination`.
pub fn encode_v2(source: SocketAddr, destination: SocketAddr) -> Vec<u8> {
    let mut out = Vec::with_capacity(52);
    let header =
        ProxyHeader::with_address(proxy_header::ProxiedAddress::stream(source, destination));
    // Only fails for mismatched address families, which callers normalise first; fall back
    // to LOCAL in that case rather than sending garbage.
    if header.encode_v2(&mut out).is_err() {
        out.clear();
        let _ = ProxyHeader::with_local().encode_v2(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: usize = 4096;

    fn v2_with_tlvs() -> Vec<u8> {
        let mut out = Vec::new();
        let header = ProxyHeader::with_tlvs(
            Some(proxy_header::ProxiedAddress::stream(
                "10.1.2.3:51234".parse().unwrap(),
                "240.168.102.23:443".parse().unwrap(),
            )),
            [
                Tlv::Authority("api.example.com".into()),
                Tlv::UniqueId(vec![1, 2, 3].into()),
                Tlv::Custom(0xea, vec![0xaa].into()),
            ],
        );
        header.encode_v2(&mut out).unwrap();
        out
    }

    fn v1() -> Vec<u8> {
        b"PROXY TCP4 192.168.1.10 10.0.1.10 56324 443\r\n".to_vec()
    }

    fn v1_v6() -> Vec<u8> {
        b"PROXY TCP6 2001:db8::1 2001:db8::2 56324 443\r\n".to_vec()
    }

    fn v2_local() -> Vec<u8> {
        let mut out = Vec::new();
        ProxyHeader::with_local().encode_v2(&mut out).unwrap();
        out
    }

    #[test]
    fn every_prefix_is_incomplete_then_complete() {
        for header in [
            v1(),
            v1_v6(),
            v2_with_tlvs(),
            v2_local(),
            b"PROXY UNKNOWN\r\n".to_vec(),
        ] {
            for i in 0..header.len() {
                assert_eq!(
                    parse(&header[..i], LIMIT),
                    Ok(Parsed::Incomplete),
                    "prefix {i} of {:?}",
                    String::from_utf8_lossy(&header)
                );
            }
            let mut longer = header.clone();
            longer.extend_from_slice(b"\x16\x03\x01 payload");
            let whole = parse(&header, LIMIT).unwrap();
            assert_eq!(parse(&longer, LIMIT).unwrap(), whole);
            let Parsed::Complete { consumed, .. } = whole else {
                panic!()
            };
            assert_eq!(consumed, header.len());
        }
    }

    #[test]
    fn split_at_every_offset() {
        // What a driver does: accumulate two reads, parse after each.
        for header in [v1(), v2_with_tlvs()] {
            let mut input = header.clone();
            input.extend_from_slice(b"rest");
            for at in 0..input.len() {
                let first = parse(&input[..at], LIMIT).unwrap();
                if at < header.len() {
                    assert_eq!(first, Parsed::Incomplete);
                }
                let Parsed::Complete { consumed, .. } = parse(&input, LIMIT).unwrap() else {
                    panic!()
                };
                assert_eq!(&input[consumed..], b"rest");
            }
        }
    }

    #[test]
    fn v1_split_right_after_source_port_is_incomplete() {
        assert_eq!(
            parse(b"PROXY TCP4 192.168.1.10 10.0.1.10 56324", LIMIT),
            Ok(Parsed::Incomplete)
        );
        assert_eq!(
            parse(b"PROXY TCP4 192.168.1.10 10.0.1.10 56324 ", LIMIT),
            Ok(Parsed::Incomplete)
        );
    }

    #[test]
    fn values_and_tlvs() {
        let Parsed::Complete { value, .. } = parse(&v1(), LIMIT).unwrap() else {
            panic!()
        };
        assert_eq!(value.version, 1);
        assert_eq!(value.source(), Some("192.168.1.10:56324".parse().unwrap()));
        assert_eq!(value.destination(), Some("10.0.1.10:443".parse().unwrap()));
        let Parsed::Complete { value, .. } = parse(&v2_with_tlvs(), LIMIT).unwrap() else {
            panic!()
        };
        assert_eq!(value.version, 2);
        assert_eq!(
            value.destination(),
            Some("240.168.102.23:443".parse().unwrap())
        );
        assert_eq!(
            value.tlvs,
            vec!["authority=api.example.com", "unique_id=010203", "0xea=aa"]
        );
        let Parsed::Complete { value, .. } = parse(&v2_local(), LIMIT).unwrap() else {
            panic!()
        };
        assert_eq!(value.addresses, None);
    }

    #[test]
    fn rejects() {
        assert_eq!(parse(b"\x16\x03\x01", LIMIT), Err(Reject::NotProxy));
        assert_eq!(parse(b"CONNECT x", LIMIT), Err(Reject::NotProxy));
        assert_eq!(
            parse(b"PROXY TCP9 1 2 3 4\r\n", LIMIT),
            Err(Reject::Malformed)
        );
        let mut long = b"PROXY TCP4 ".to_vec();
        long.extend_from_slice(&[b'1'; 200]);
        assert!(parse(&long, LIMIT).is_err());
        let mut big = V2_SIGNATURE.to_vec();
        big.extend_from_slice(&[0x21, 0x11, 0xff, 0xff]);
        assert_eq!(parse(&big, LIMIT), Err(Reject::TooLarge { limit: LIMIT }));
    }

    #[test]
    fn caps_below_a_header_are_honoured() {
        // Configuration allows no cap under 256 bytes; the function's contract holds anyway:
        // at the cap the answer is final, and a header longer than the cap is too large.
        assert_eq!(parse(b"PRO", 3), Err(Reject::TooLarge { limit: 3 }));
        assert_eq!(parse(b"PRO", 4), Ok(Parsed::Incomplete));
        let h = v1();
        let under = h.len() - 1;
        assert_eq!(parse(&h, under), Err(Reject::TooLarge { limit: under }));
        assert!(matches!(parse(&h, h.len()), Ok(Parsed::Complete { .. })));
    }

    #[test]
    fn v1_is_at_most_107_bytes_however_it_arrives() {
        let line = |n: usize| {
            let mut l = b"PROXY UNKNOWN ".to_vec();
            l.resize(n - 2, b'x');
            l.extend_from_slice(b"\r\n");
            l
        };
        let (fits, over) = (line(V1_MAX), line(V1_MAX + 1));
        assert!(matches!(
            parse(&fits, LIMIT),
            Ok(Parsed::Complete {
                consumed: V1_MAX,
                ..
            })
        ));
        // Whole, or split after 107 bytes: the same answer.
        assert_eq!(parse(&over, LIMIT), Err(Reject::Malformed));
        assert_eq!(parse(&over[..V1_MAX], LIMIT), Err(Reject::Malformed));
    }

    #[test]
    fn ssl_version_summary_is_short_printable_text() {
        let mut ssl = proxy_header::SslInfo::new(true, false, false, 0);
        let version = format!("TLSv1.3\n{}", "x".repeat(200));
        ssl.append_tlv(Tlv::SslVersion(version.into()));
        let mut header = Vec::new();
        ProxyHeader::with_tlvs(None, [Tlv::Ssl(ssl)])
            .encode_v2(&mut header)
            .unwrap();
        let Parsed::Complete { value, .. } = parse(&header, LIMIT).unwrap() else {
            panic!()
        };
        assert_eq!(value.tlvs, [format!("ssl=TLSv1.3?{}", "x".repeat(56))]);
    }

    #[test]
    fn detection() {
        assert_eq!(detect(b""), Detect::NeedMore);
        assert_eq!(detect(b"PRO"), Detect::NeedMore);
        assert_eq!(detect(b"\r\n\r\n"), Detect::NeedMore);
        assert_eq!(detect(b"PROXY "), Detect::Proxy);
        assert_eq!(detect(b"\x16"), Detect::NotProxy);
        assert_eq!(detect(b"PRX"), Detect::NotProxy);
    }

    #[test]
    fn encode_round_trip() {
        let h = encode_v2(
            "10.0.0.1:1234".parse().unwrap(),
            "240.1.2.3:443".parse().unwrap(),
        );
        let Parsed::Complete { value, consumed } = parse(&h, LIMIT).unwrap() else {
            panic!()
        };
        assert_eq!(consumed, h.len());
        assert_eq!(value.destination(), Some("240.1.2.3:443".parse().unwrap()));
    }

    /// Both versions round-trip through the parser, the family of the source decides the
    /// header's, and IPv4-mapped addresses are written as IPv4.
    #[test]
    fn encode_keeps_the_source_and_reconciles_families() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let cases = [
            (
                "10.0.0.1:1234",
                "240.1.2.3:443",
                "10.0.0.1:1234",
                "240.1.2.3:443",
            ),
            (
                "[2001:db8::1]:5",
                "[2001:db8::2]:443",
                "[2001:db8::1]:5",
                "[2001:db8::2]:443",
            ),
            (
                "[::ffff:10.0.0.1]:7",
                "[::ffff:10.0.0.2]:8443",
                "10.0.0.1:7",
                "10.0.0.2:8443",
            ),
            (
                "[2001:db8::1]:5",
                "10.0.0.2:8443",
                "[2001:db8::1]:5",
                "[::ffff:10.0.0.2]:8443",
            ),
            (
                "10.0.0.1:7",
                "[2001:db8::2]:443",
                "10.0.0.1:7",
                "0.0.0.0:443",
            ),
        ];
        for version in [ProxyVersion::V1, ProxyVersion::V2] {
            for (src, dst, want_src, want_dst) in cases {
                let h = encode(version, a(src), a(dst));
                let Parsed::Complete { value, consumed } = parse(&h, LIMIT).unwrap() else {
                    panic!("{version:?} {src} {dst}")
                };
                assert_eq!(consumed, h.len());
                assert_eq!(
                    value.version,
                    if version == ProxyVersion::V1 { 1 } else { 2 }
                );
                assert_eq!(
                    value.addresses,
                    Some((a(want_src), a(want_dst))),
                    "{src} {dst}"
                );
            }
        }
        assert_eq!(
            encode(ProxyVersion::V1, a("192.0.2.7:51000"), a("127.0.0.1:8443")),
            b"PROXY TCP4 192.0.2.7 127.0.0.1 51000 8443\r\n"
        );
        assert_eq!(ProxyVersion::parse("v2"), Some(ProxyVersion::V2));
        assert_eq!(ProxyVersion::parse("V2"), None);
        assert_eq!(ProxyVersion::V1.as_str(), "v1");
    }
}
