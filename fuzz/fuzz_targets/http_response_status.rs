#![no_main]
//! The response status parser (the node reads the gateway's CONNECT answer with it) keeps
//! the shared contract (see `contract`) under every cap, never waits for a head whose blank
//! line it has already seen, and the status it returns is the three-digit code after
//! `HTTP/1.0 ` or `HTTP/1.1 ` (RFC 9112 §4: status-code = 3DIGIT).
use libfuzzer_sys::fuzz_target;
use trellis::wire::Parsed;
use trellis::wire::http::{self, Reject};

mod contract;

/// The node's cap on the gateway's answer (`MAX_RESPONSE_HEAD`).
const NODE_LIMIT: usize = 8192;

fuzz_target!(|data: &[u8]| {
    for limit in contract::limits(NODE_LIMIT, data) {
        match contract::check(data, limit, http::parse_response_status, too_large) {
            Ok(Parsed::Incomplete) => {
                assert!(
                    b"HTTP/".starts_with(&data[..data.len().min(5)]),
                    "not HTTP, yet waiting"
                );
                assert_eq!(
                    contract::head_end(data),
                    None,
                    "Incomplete after a blank line"
                );
            }
            Ok(Parsed::Complete { value, consumed }) => {
                assert_eq!(
                    contract::head_end(data),
                    Some(consumed),
                    "the first blank line ends the head"
                );
                let line = &data[..consumed];
                assert!(line.starts_with(b"HTTP/1.1 ") || line.starts_with(b"HTTP/1.0 "));
                let code = line.get(9..12).expect("a status line of at least 12 bytes");
                assert!(code.iter().all(u8::is_ascii_digit), "status code {code:?}");
                let digits = code.iter().fold(0, |n, &d| n * 10 + u16::from(d - b'0'));
                assert_eq!(value, digits, "status code {code:?}");
                let after = &line[12..];
                assert!(
                    after.starts_with(b" ")
                        || after.starts_with(b"\n")
                        || after.starts_with(b"\r\n"),
                    "status code followed by {after:?}"
                );
            }
            Err(_) => {}
        }
    }
});

fn too_large(e: &Reject) -> Option<usize> {
    match e {
        Reject::TooLarge { limit } => Some(*limit),
        Reject::Malformed(_) => None,
    }
}
