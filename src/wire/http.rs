//! HTTP/1.x request head parser for CONNECT relays, and the status lines trellis answers.
//!
//! Parses a request line and header fields up to the blank line, under a byte cap. Lines may
//! end in CRLF or a bare LF (RFC 9112 §2.2). Obsolete line folding, control characters and
//! other HTTP versions are rejected. No I/O.

use thiserror::Error;

use super::Parsed;

/// Most header fields in a head.
pub const MAX_HEADERS: usize = 100;

/// A parsed request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    /// The method, as sent.
    pub method: String,
    /// The request target, as sent.
    pub target: String,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    /// Header fields in order: (name, value with surrounding whitespace removed).
    pub headers: Vec<(String, String)>,
}

impl RequestHead {
    /// Values of the header `name` (compared case-insensitively).
    pub fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Why a request head is rejected; each maps to an HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Reject {
    /// The head is larger than the cap (431).
    #[error("request head larger than {limit} bytes")]
    TooLarge {
        /// The configured `maxHeaderBytes`.
        limit: usize,
    },
    /// The head is not valid HTTP/1.x (400); the string names what is wrong.
    #[error("malformed request head: {0}")]
    Malformed(&'static str),
}

impl Reject {
    /// The status code to answer with.
    pub fn status(&self) -> u16 {
        match self {
            Reject::TooLarge { .. } => 431,
            Reject::Malformed(_) => 400,
        }
    }
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Parses a request head from the start of `buf`; `consumed` includes the blank line.
pub fn parse_request_head(buf: &[u8], limit: usize) -> Result<Parsed<RequestHead>, Reject> {
    // Reject garbage (e.g. TLS sent to a CONNECT port) on its first bytes.
    let method_end = buf.iter().position(|&b| b == b' ');
    let method_bytes = &buf[..method_end.unwrap_or(buf.len())];
    if !method_bytes.iter().all(|&b| is_tchar(b)) || method_end == Some(0) {
        return Err(Reject::Malformed("method"));
    }
    let mut lines = Vec::new();
    let mut start = 0;
    let end = loop {
        let Some(nl) = buf[start..].iter().position(|&b| b == b'\n') else {
            if buf.len() >= limit {
                return Err(Reject::TooLarge { limit });
            }
            return Ok(Parsed::Incomplete);
        };
        let line_end = start + nl;
        let line = buf[start..line_end]
            .strip_suffix(b"\r")
            .unwrap_or(&buf[start..line_end]);
        start = line_end + 1;
        if start > limit {
            return Err(Reject::TooLarge { limit });
        }
        if line.is_empty() {
            if lines.is_empty() {
                return Err(Reject::Malformed("empty request line"));
            }
            break start;
        }
        if lines.len() > MAX_HEADERS {
            return Err(Reject::TooLarge { limit });
        }
        lines.push(line);
    };
    let request_line = lines[0];
    let mut parts = request_line.split(|&b| b == b' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Reject::Malformed("request line"));
    };
    if target.is_empty() || !target.iter().all(|&b| b.is_ascii_graphic()) {
        return Err(Reject::Malformed("request target"));
    }
    let minor_version = match version {
        b"HTTP/1.1" => 1,
        b"HTTP/1.0" => 0,
        _ => return Err(Reject::Malformed("HTTP version")),
    };
    let mut headers = Vec::with_capacity(lines.len() - 1);
    for line in &lines[1..] {
        if line[0] == b' ' || line[0] == b'\t' {
            return Err(Reject::Malformed("obsolete line folding"));
        }
        let colon = line
            .iter()
            .position(|&b| b == b':')
            .ok_or(Reject::Malformed("header without colon"))?;
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
            return Err(Reject::Malformed("header name"));
        }
        let value = trim_ows(value);
        if value.iter().any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f) {
            return Err(Reject::Malformed("control character in header value"));
        }
        headers.push((ascii(name), String::from_utf8_lossy(value).into_owned()));
    }
    Ok(Parsed::Complete {
        value: RequestHead {
            method: ascii(method),
            target: ascii(target),
            minor_version,
            headers,
        },
        consumed: end,
    })
}

/// Strips optional whitespace (RFC 9110 §5.6.3: spaces and tabs) from both ends. Other
/// ASCII whitespace (CR, form feed) is left for the control character check.
fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

fn ascii(b: &[u8]) -> String {
    // Callers checked that these bytes are ASCII tokens.
    String::from_utf8_lossy(b).into_owned()
}

/// Parses a response head (`HTTP/1.x NNN reason` plus fields) and returns its status code;
/// `consumed` includes the blank line.
pub fn parse_response_status(buf: &[u8], limit: usize) -> Result<Parsed<u16>, Reject> {
    let prefix = &buf[..buf.len().min(5)];
    if prefix != &b"HTTP/"[..prefix.len()] {
        return Err(Reject::Malformed("not an HTTP response"));
    }
    let Some(end) = find_head_end(buf) else {
        return if buf.len() >= limit {
            Err(Reject::TooLarge { limit })
        } else {
            Ok(Parsed::Incomplete)
        };
    };
    if end > limit {
        return Err(Reject::TooLarge { limit });
    }
    let line_end = buf.iter().position(|&b| b == b'\n').unwrap_or(end);
    let line = buf[..line_end]
        .strip_suffix(b"\r")
        .unwrap_or(&buf[..line_end]);
    let mut parts = line.splitn(3, |&b| b == b' ');
    let (Some(version), Some(code)) = (parts.next(), parts.next()) else {
        return Err(Reject::Malformed("status line"));
    };
    if version != b"HTTP/1.1" && version != b"HTTP/1.0" {
        return Err(Reject::Malformed("HTTP version"));
    }
    // Three digits (RFC 9112 §4); `u16::from_str` alone would also take "+20".
    let status = std::str::from_utf8(code)
        .ok()
        .filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or(Reject::Malformed("status code"))?;
    Ok(Parsed::Complete {
        value: status,
        consumed: end,
    })
}

/// The offset just past the blank line that ends a head (CRLF or bare LF line ends).
fn find_head_end(buf: &[u8]) -> Option<usize> {
    let mut start = 0;
    while let Some(nl) = buf[start..].iter().position(|&b| b == b'\n') {
        let line = &buf[start..start + nl];
        if line.is_empty() || line == b"\r" {
            return Some(start + nl + 1);
        }
        start += nl + 1;
    }
    None
}

/// The reason phrase for a status trellis sends.
pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "Connection established",
        400 => "Bad Request",
        403 => "Forbidden",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Error",
    }
}

/// A complete response head: `200` has no body and no other fields (kube-apiserver's egress
/// client requires exactly that); errors carry a one-line text body and close.
pub fn response(status: u16, detail: &str) -> Vec<u8> {
    if status == 200 {
        return b"HTTP/1.1 200 Connection established\r\n\r\n".to_vec();
    }
    let body = format!("{detail}\n");
    format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        reason(status),
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPENVPN: &[u8] = b"CONNECT api.alpha.example.com.:1194 HTTP/1.0\r\nX-Gardener-Destination: outbound|1194||vpn-seed-server.shoot--dev--alpha.svc.cluster.local\r\n\r\n";

    fn complete(buf: &[u8]) -> (RequestHead, usize) {
        match parse_request_head(buf, 8192) {
            Ok(Parsed::Complete { value, consumed }) => (value, consumed),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn openvpn_style_request() {
        let (h, consumed) = complete(OPENVPN);
        assert_eq!(consumed, OPENVPN.len());
        assert_eq!(h.method, "CONNECT");
        assert_eq!(h.minor_version, 0);
        assert_eq!(
            h.header_values("x-gardener-destination")
                .collect::<Vec<_>>(),
            ["outbound|1194||vpn-seed-server.shoot--dev--alpha.svc.cluster.local"]
        );
    }

    #[test]
    fn every_prefix_is_incomplete() {
        let mut with_body = OPENVPN.to_vec();
        with_body.extend_from_slice(b"\x00\x0e\x38 openvpn bytes");
        for i in 0..OPENVPN.len() {
            assert_eq!(
                parse_request_head(&OPENVPN[..i], 8192),
                Ok(Parsed::Incomplete),
                "prefix {i}"
            );
        }
        assert_eq!(complete(&with_body), complete(OPENVPN));
    }

    #[test]
    fn bare_lf_and_whitespace() {
        let (h, _) = complete(b"CONNECT 10.0.0.1:443 HTTP/1.1\nHost: 127.0.0.1\nX-A:   v  \n\n");
        assert_eq!(h.header_values("x-a").next(), Some("v"));
    }

    #[test]
    fn control_characters_at_the_ends_of_values_are_rejected() {
        // Only spaces and tabs are trimmed (RFC 9110 OWS); a form feed or a bare CR is not
        // whitespace to strip but a control character.
        for field in [&b"X: v\x0c"[..], b"X: \x0cv", b"X: v\r", b"X:\r v"] {
            let mut head = b"CONNECT x HTTP/1.1\r\n".to_vec();
            head.extend_from_slice(field);
            head.extend_from_slice(b"\r\n\r\n");
            assert_eq!(
                parse_request_head(&head, 8192),
                Err(Reject::Malformed("control character in header value")),
                "{field:?}"
            );
        }
        let (h, _) = complete(b"CONNECT x HTTP/1.1\r\nX: \t v \t\r\n\r\n");
        assert_eq!(h.header_values("x").next(), Some("v"));
    }

    #[test]
    fn rejects() {
        let bad = |b: &[u8]| parse_request_head(b, 8192).unwrap_err();
        assert_eq!(bad(b"\x16\x03\x01").status(), 400);
        assert_eq!(bad(b"CONNECT x HTTP/2.0\r\n\r\n").status(), 400);
        assert_eq!(bad(b"CONNECT x HTTP/1.1\r\n folded\r\n\r\n").status(), 400);
        assert_eq!(bad(b"CONNECT x HTTP/1.1\r\nNoColon\r\n\r\n").status(), 400);
        assert_eq!(bad(b"CONNECT  x HTTP/1.1\r\n\r\n").status(), 400);
        assert_eq!(bad(b"\r\n\r\n").status(), 400);
        let mut big = b"CONNECT x HTTP/1.1\r\nX: ".to_vec();
        big.extend_from_slice(&[b'a'; 300]);
        assert_eq!(
            parse_request_head(&big, 256).unwrap_err(),
            Reject::TooLarge { limit: 256 }
        );
    }

    #[test]
    fn response_status() {
        let ok = b"HTTP/1.1 200 Connection established\r\n\r\nrest";
        for i in 0..ok.len() - 4 {
            assert_eq!(
                parse_response_status(&ok[..i], 8192),
                Ok(Parsed::Incomplete),
                "prefix {i}"
            );
        }
        assert_eq!(
            parse_response_status(ok, 8192),
            Ok(Parsed::Complete {
                value: 200,
                consumed: ok.len() - 4
            })
        );
        let denied = b"HTTP/1.0 403 Forbidden\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(
            parse_response_status(denied, 8192),
            Ok(Parsed::Complete {
                value: 403,
                consumed: denied.len()
            })
        );
        assert!(parse_response_status(b"SSH-2.0", 8192).is_err());
        assert!(parse_response_status(b"HTTP/1.1 2000 x\r\n\r\n", 8192).is_err());
        // Three digits: a sign is not one.
        assert_eq!(
            parse_response_status(b"HTTP/1.1 +20 x\r\n\r\n", 8192),
            Err(Reject::Malformed("status code"))
        );
    }

    #[test]
    fn responses() {
        assert_eq!(
            response(200, ""),
            b"HTTP/1.1 200 Connection established\r\n\r\n"
        );
        assert!(
            String::from_utf8(response(403, "unknown destination"))
                .unwrap()
                .starts_with("HTTP/1.1 403 Forbidden\r\n")
        );
    }
}
