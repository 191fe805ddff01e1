#![no_main]
//! The PROXY header parser keeps the shared contract (see `contract`) under every cap,
//! `detect` agrees with the two signatures, a complete header says what its bytes say, and
//! headers built from the input's bytes (by `encode_v2`, and as v1 text written to the
//! spec) parse back to the same addresses.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use libfuzzer_sys::fuzz_target;
use trellis::wire::Parsed;
use trellis::wire::proxy::{
    self, Detect, MAX_TLVS_LOGGED, ProxyInfo, Reject, V1_MAX, V1_SIGNATURE, V2_SIGNATURE,
};

mod contract;

/// The gateway's default `maxHeaderBytes`.
const DEFAULT_LIMIT: usize = 8192;
/// Longest TLV summary: a name and at most 64 characters of value.
const MAX_TLV_SUMMARY: usize = 80;

fuzz_target!(|data: &[u8]| {
    assert_eq!(proxy::detect(data), expected_detect(data), "detect");
    for limit in contract::limits(DEFAULT_LIMIT, data) {
        let answer = contract::check(data, limit, proxy::parse, too_large);
        match answer {
            Err(Reject::NotProxy) => assert_eq!(proxy::detect(data), Detect::NotProxy),
            Ok(Parsed::Complete { value, consumed }) => {
                says_what_its_bytes_say(&data[..consumed], &value)
            }
            _ => {}
        }
    }
    round_trips(data);
});

fn too_large(e: &Reject) -> Option<usize> {
    match e {
        Reject::TooLarge { limit } => Some(*limit),
        _ => None,
    }
}

fn expected_detect(data: &[u8]) -> Detect {
    let sigs = [V1_SIGNATURE, V2_SIGNATURE];
    if sigs.iter().any(|s| data.starts_with(s)) {
        Detect::Proxy
    } else if sigs.iter().any(|s| s.starts_with(data)) {
        Detect::NeedMore
    } else {
        Detect::NotProxy
    }
}

/// Checks a complete header's value against its bytes, decoded here independently.
fn says_what_its_bytes_say(header: &[u8], value: &ProxyInfo) {
    if header.starts_with(V1_SIGNATURE) {
        assert_eq!(value.version, 1);
        assert!(value.tlvs.is_empty(), "v1 has no TLVs");
        assert!(
            header.len() <= V1_MAX,
            "v1 header of {} bytes",
            header.len()
        );
        let line = header.strip_suffix(b"\r\n").expect("v1 ends in CRLF");
        let fields: Vec<&[u8]> = line[V1_SIGNATURE.len()..].split(|&b| b == b' ').collect();
        match value.addresses {
            None => assert!(fields[0].starts_with(b"UNKNOWN"), "{fields:?}"),
            Some((source, destination)) => {
                let ip = |f: &[u8]| std::str::from_utf8(f).unwrap().parse::<IpAddr>().unwrap();
                let family = if source.is_ipv4() {
                    &b"TCP4"[..]
                } else {
                    b"TCP6"
                };
                assert_eq!(fields.len(), 5, "{fields:?}");
                assert_eq!(fields[0], family);
                assert_eq!(ip(fields[1]), source.ip());
                assert_eq!(ip(fields[2]), destination.ip());
            }
        }
        return;
    }
    assert!(header.starts_with(V2_SIGNATURE));
    assert_eq!(value.version, 2);
    assert_eq!(
        header.len(),
        16 + usize::from(u16::from_be_bytes([header[14], header[15]]))
    );
    let block = &header[16..];
    let expected = match (header[12], header[13]) {
        (0x21, 0x11 | 0x12) => {
            let ip = |at: usize| {
                IpAddr::V4(Ipv4Addr::from(
                    <[u8; 4]>::try_from(&block[at..at + 4]).unwrap(),
                ))
            };
            Some(addresses(block, ip, 4))
        }
        (0x21, 0x21 | 0x22) => {
            let ip = |at: usize| {
                IpAddr::V6(Ipv6Addr::from(
                    <[u8; 16]>::try_from(&block[at..at + 16]).unwrap(),
                ))
            };
            Some(addresses(block, ip, 16))
        }
        (0x20 | 0x21, _) => None,
        (command, _) => panic!("accepted version/command byte {command:#04x}"),
    };
    assert_eq!(value.addresses, expected);
    assert!(
        value.tlvs.len() <= MAX_TLVS_LOGGED,
        "{} TLVs kept",
        value.tlvs.len()
    );
    for tlv in &value.tlvs {
        assert!(
            tlv.len() <= MAX_TLV_SUMMARY && tlv.bytes().all(|b| b.is_ascii_graphic()),
            "TLV summary for logs is not short printable text: {tlv:?}"
        );
    }
}

fn addresses(block: &[u8], ip: impl Fn(usize) -> IpAddr, n: usize) -> (SocketAddr, SocketAddr) {
    let port = |at: usize| u16::from_be_bytes([block[at], block[at + 1]]);
    (
        SocketAddr::new(ip(0), port(2 * n)),
        SocketAddr::new(ip(n), port(2 * n + 2)),
    )
}

/// Builds an IPv4, an IPv6 and a mixed pair of addresses from the input's bytes, encodes
/// them and parses them back.
fn round_trips(data: &[u8]) {
    let byte = |i: usize| data.get(i).copied().unwrap_or(0);
    let bytes = |at: usize| -> [u8; 16] { std::array::from_fn(|i| byte(at + i)) };
    let port = |at: usize| u16::from_be_bytes([byte(at), byte(at + 1)]);
    let [a, b, c, d, ..] = bytes(0);
    let [e, f, g, h, ..] = bytes(4);
    let v4 = (
        SocketAddr::new(Ipv4Addr::new(a, b, c, d).into(), port(8)),
        SocketAddr::new(Ipv4Addr::new(e, f, g, h).into(), port(10)),
    );
    let v6 = (
        SocketAddr::new(Ipv6Addr::from(bytes(12)).into(), port(44)),
        SocketAddr::new(Ipv6Addr::from(bytes(28)).into(), port(46)),
    );
    let mixed = (v4.0, v6.1);
    for (source, destination) in [v4, v6, mixed] {
        let same_family = source.is_ipv4() == destination.is_ipv4();
        // encode_v2 falls back to LOCAL for mixed families.
        let addresses = same_family.then_some((source, destination));
        let v2 = proxy::encode_v2(source, destination);
        let value = ProxyInfo {
            version: 2,
            addresses,
            tlvs: Vec::new(),
        };
        let answer = contract::check(&v2, DEFAULT_LIMIT, proxy::parse, too_large);
        assert_eq!(
            answer,
            Ok(Parsed::Complete {
                value,
                consumed: v2.len()
            }),
            "v2 round trip"
        );
        if same_family {
            let family = if source.is_ipv4() { "TCP4" } else { "TCP6" };
            let v1 = format!(
                "PROXY {family} {} {} {} {}\r\n",
                source.ip(),
                destination.ip(),
                source.port(),
                destination.port()
            );
            let value = ProxyInfo {
                version: 1,
                addresses,
                tlvs: Vec::new(),
            };
            let answer = contract::check(v1.as_bytes(), DEFAULT_LIMIT, proxy::parse, too_large);
            assert_eq!(
                answer,
                Ok(Parsed::Complete {
                    value,
                    consumed: v1.len()
                }),
                "v1 {v1:?}"
            );
        }
    }
}
