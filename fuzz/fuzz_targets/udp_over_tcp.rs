#![no_main]
//! The UDP-over-TCP framing keeps the shared contract (see `contract`) under every cap; the
//! frames `frames` walks are the bytes they cover, read back from their own length fields;
//! and datagrams cut from the input, framed by `encode`, come back unchanged however the
//! stream is split.
use libfuzzer_sys::fuzz_target;
use trellis::wire::Parsed;
use trellis::wire::udp_over_tcp::{self, MAX_FRAME, Reject};

mod contract;

fuzz_target!(|data: &[u8]| {
    for limit in contract::limits(MAX_FRAME, data) {
        let answer = contract::check(data, limit, parse_owned, too_large);
        if let Ok(Parsed::Complete { value, consumed }) = answer {
            assert_eq!(consumed, 2 + value.len());
            assert_eq!(&data[2..consumed], value);
        }
    }
    walks_its_own_length_fields(data);
    round_trips(data);
});

/// `parse` with the datagram copied out (the contract compares answers for inputs that
/// outlive no call).
fn parse_owned(data: &[u8], limit: usize) -> Result<Parsed<Vec<u8>>, Reject> {
    udp_over_tcp::parse(data, limit).map(|p| match p {
        Parsed::Complete { value, consumed } => Parsed::Complete {
            value: value.to_vec(),
            consumed,
        },
        Parsed::Incomplete => Parsed::Incomplete,
    })
}

fn too_large(e: &Reject) -> Option<usize> {
    match e {
        Reject::TooLarge { limit } => Some(*limit),
    }
}

/// Every frame `frames` yields starts where the one before ended and is as long as its
/// length field says; what is left is shorter than the frame it starts.
fn walks_its_own_length_fields(data: &[u8]) {
    let mut it = udp_over_tcp::frames(data, MAX_FRAME);
    let mut at = 0;
    for frame in it.by_ref() {
        let datagram = frame.expect("no frame is over the format's own cap");
        let len = usize::from(u16::from_be_bytes([data[at], data[at + 1]]));
        assert_eq!(datagram, &data[at + 2..at + 2 + len]);
        at += 2 + len;
    }
    assert_eq!(it.consumed(), at);
    let rest = &data[at..];
    if rest.len() >= 2 {
        let len = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
        assert!(rest.len() < 2 + len, "a complete frame was left behind");
    }
}

/// Cuts the input into datagrams (each first byte says how long the next one is), frames
/// them, and reads them back in pieces whose sizes also come from the input.
fn round_trips(data: &[u8]) {
    let mut datagrams = Vec::new();
    let mut rest = data;
    while let Some((&n, tail)) = rest.split_first() {
        let n = (usize::from(n) + 1).min(tail.len());
        if n == 0 {
            break;
        }
        datagrams.push(&tail[..n]);
        rest = &tail[n..];
    }
    let mut stream = Vec::new();
    for d in &datagrams {
        udp_over_tcp::encode(d, &mut stream).expect("non-empty and short");
    }
    let mut got: Vec<&[u8]> = Vec::new();
    let mut buf = Vec::new();
    let mut at = 0;
    let mut sizes = data.iter().cycle();
    let mut owned: Vec<Vec<u8>> = Vec::new();
    while at < stream.len() {
        let n = (usize::from(*sizes.next().unwrap_or(&1)) % 7 + 1).min(stream.len() - at);
        buf.extend_from_slice(&stream[at..at + n]);
        at += n;
        let mut it = udp_over_tcp::frames(&buf, MAX_FRAME);
        owned.extend(it.by_ref().map(|f| f.unwrap().to_vec()));
        let used = it.consumed();
        buf.drain(..used);
    }
    got.extend(owned.iter().map(Vec::as_slice));
    assert!(buf.is_empty());
    assert_eq!(got, datagrams);
}
