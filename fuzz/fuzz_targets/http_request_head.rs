#![no_main]
//! The CONNECT request head parser keeps the shared contract (see `contract`) under every
//! cap, never waits for a head whose blank line it has already seen, and a head it accepts
//! is what the module docs promise: one request line of token, target and HTTP/1.0 or 1.1,
//! at most `MAX_HEADERS` fields with token names and trimmed values, no control characters
//! other than tabs in values and CRLF or LF line ends. Header lookup finds exactly the
//! fields whose names match regardless of case.
use libfuzzer_sys::fuzz_target;
use trellis::wire::Parsed;
use trellis::wire::http::{self, MAX_HEADERS, Reject, RequestHead};

mod contract;

/// The gateway's default `maxHeaderBytes`.
const DEFAULT_LIMIT: usize = 8192;

fuzz_target!(|data: &[u8]| {
    for limit in contract::limits(DEFAULT_LIMIT, data) {
        let answer = contract::check(data, limit, http::parse_request_head, too_large);
        match answer {
            Ok(Parsed::Incomplete) => assert_eq!(
                contract::head_end(data),
                None,
                "Incomplete after a blank line"
            ),
            Ok(Parsed::Complete { value, consumed }) => {
                assert_eq!(
                    contract::head_end(data),
                    Some(consumed),
                    "the first blank line ends the head"
                );
                accepted_head(&data[..consumed], &value);
                lookup(data, &value);
            }
            Err(e) => assert!(matches!(e.status(), 400 | 431), "{e:?}"),
        }
    }
});

fn too_large(e: &Reject) -> Option<usize> {
    match e {
        Reject::TooLarge { limit } => Some(*limit),
        Reject::Malformed(_) => None,
    }
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn accepted_head(head: &[u8], value: &RequestHead) {
    // Control characters: tabs, and LF optionally preceded by one CR, nothing else.
    for (i, &b) in head.iter().enumerate() {
        let allowed = match b {
            b'\t' | b'\n' => true,
            b'\r' => head.get(i + 1) == Some(&b'\n'),
            _ => b >= 0x20 && b != 0x7f,
        };
        assert!(allowed, "control byte {b:#04x} at {i} in an accepted head");
    }
    let lines: Vec<&[u8]> = head
        .split_inclusive(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\n").unwrap())
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .collect();
    let (request_line, fields) = (lines[0], &lines[1..lines.len() - 1]);
    let expected = format!(
        "{} {} HTTP/1.{}",
        value.method, value.target, value.minor_version
    );
    assert_eq!(request_line, expected.as_bytes(), "request line");
    assert!(!value.method.is_empty() && value.method.bytes().all(is_tchar));
    assert!(!value.target.is_empty() && value.target.bytes().all(|b| b.is_ascii_graphic()));
    assert!(value.minor_version <= 1);
    assert!(
        value.headers.len() <= MAX_HEADERS,
        "{} fields",
        value.headers.len()
    );
    assert_eq!(value.headers.len(), fields.len(), "one field per line");
    for ((name, v), line) in value.headers.iter().zip(fields) {
        assert!(
            !name.is_empty() && name.bytes().all(is_tchar),
            "name {name:?}"
        );
        let trimmed = |s: &str| s.trim_matches([' ', '\t']).len() == s.len();
        assert!(trimmed(v), "value {v:?} keeps surrounding whitespace");
        assert!(
            line.starts_with(name.as_bytes()) && line.get(name.len()) == Some(&b':'),
            "{line:?}"
        );
    }
}

fn lookup(data: &[u8], value: &RequestHead) {
    // Names to look up: every field's, in both cases, and one made of the input's bytes.
    let mut names: Vec<String> = value.headers.iter().map(|(n, _)| n.clone()).collect();
    names.extend(value.headers.iter().map(|(n, _)| n.to_ascii_uppercase()));
    names.push(String::from_utf8_lossy(&data[..data.len().min(8)]).into_owned());
    for name in names {
        // Lower-cased copies, not `eq_ignore_ascii_case`: the oracle differs from the code.
        #[allow(clippy::manual_ignore_case_cmp)]
        let expected: Vec<&str> = value
            .headers
            .iter()
            .filter(|(n, _)| n.to_ascii_lowercase() == name.to_ascii_lowercase())
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(
            value.header_values(&name).collect::<Vec<_>>(),
            expected,
            "{name:?}"
        );
    }
}
