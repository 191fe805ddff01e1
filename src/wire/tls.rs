//! TLS ClientHello reader: finds the server name without terminating TLS.
//!
//! The ClientHello may arrive split over any number of TCP segments (the caller simply calls
//! again with more bytes) and over several TLS records (the handshake message is reassembled
//! from consecutive handshake records). The parser never looks past the first ClientHello,
//! never decrypts anything and never changes a byte: the caller forwards what it read as is.
//! It contains no I/O.

use std::borrow::Cow;

use thiserror::Error;

use super::Parsed;

/// Largest TLS plaintext record payload (RFC 8446 §5.1: 2^14).
pub const MAX_RECORD_PAYLOAD: usize = 16_384;
/// Length of a TLS record header: type, version, length.
const RECORD_HEADER: usize = 5;
/// Length of a handshake message header: type and 24-bit length.
const HANDSHAKE_HEADER: usize = 4;
const CONTENT_TYPE_HANDSHAKE: u8 = 22;
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: u16 = 0;
const EXT_ALPN: u16 = 16;
const SNI_HOST_NAME: u8 = 0;
/// Longest DNS name (RFC 1035), without the trailing dot.
const MAX_SERVER_NAME: usize = 253;
/// Most TLS records a ClientHello may span; real clients use one to three. The cap bounds
/// the work of re-parsing a hello that arrives in many tiny records.
pub const MAX_RECORDS: usize = 32;
/// The smallest valid ClientHello body: version, random, three empty-ish vectors.
const MIN_CLIENT_HELLO_BODY: usize = 2 + 32 + 1 + 2 + 2 + 1;

/// What the router needs from a ClientHello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientHello {
    /// The `host_name` of the server_name extension: lower-cased, trailing dot removed.
    pub server_name: Option<String>,
    /// ALPN protocols offered, for logs (at most [`MAX_ALPN_LOGGED`]).
    pub alpn: Vec<String>,
    /// Record-layer version of the first record (used to answer with an alert).
    pub record_version: u16,
    /// Number of TLS records the ClientHello spanned.
    pub records: usize,
}

/// How many ALPN names are kept for logs.
pub const MAX_ALPN_LOGGED: usize = 4;

/// Why bytes are not a usable ClientHello. Each variant maps to one metric reason.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Reject {
    /// The first bytes are not a TLS handshake record (plain HTTP, SSH, SSLv2, ...).
    #[error("not a TLS handshake record")]
    NotTls,
    /// The ClientHello (with its record headers) would exceed the configured limit.
    #[error("ClientHello needs {needed} bytes, more than the limit of {limit}")]
    TooLarge {
        /// Bytes the records or the handshake header declare (at least).
        needed: usize,
        /// The configured `maxClientHelloBytes`.
        limit: usize,
    },
    /// Structurally invalid TLS; the string names the part that is wrong.
    #[error("malformed ClientHello: {0}")]
    Malformed(&'static str),
}

impl Reject {
    /// Stable short name for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Reject::NotTls => "not_tls",
            Reject::TooLarge { .. } => "too_large",
            Reject::Malformed(_) => "malformed",
        }
    }
}

/// Parses the first ClientHello from `buf`, which holds every byte read so far.
///
/// Returns `Incomplete` while more bytes could complete a valid ClientHello of at most
/// `limit` bytes (record headers included), `Complete` with the number of bytes of the
/// records that carry it, or a [`Reject`]. The answer for a prefix never contradicts the
/// answer for a longer input: once complete or rejected, more bytes change nothing.
pub fn parse_client_hello(buf: &[u8], limit: usize) -> Result<Parsed<ClientHello>, Reject> {
    // Cheap early checks so that non-TLS traffic is rejected on its first bytes.
    if let Some(&t) = buf.first()
        && t != CONTENT_TYPE_HANDSHAKE
    {
        return Err(Reject::NotTls);
    }
    if let Some(&major) = buf.get(1)
        && major != 3
    {
        return Err(Reject::NotTls);
    }

    // Walk records, collecting handshake fragments. The common case is one record, which is
    // parsed in place; several records are joined into one buffer.
    let mut fragments: Vec<&[u8]> = Vec::new();
    let mut pos = 0;
    let mut handshake_len: Option<usize> = None;
    let mut collected = 0;
    let record_version = match buf.get(1..3) {
        Some(v) => u16::from_be_bytes([v[0], v[1]]),
        None => return Ok(Parsed::Incomplete),
    };
    loop {
        if pos + RECORD_HEADER > limit {
            return Err(Reject::TooLarge {
                needed: pos + RECORD_HEADER,
                limit,
            });
        }
        let Some(header) = buf.get(pos..pos + RECORD_HEADER) else {
            check_partial_header(buf.get(pos..).unwrap_or(&[]))?;
            return Ok(Parsed::Incomplete);
        };
        if header[0] != CONTENT_TYPE_HANDSHAKE {
            return Err(Reject::Malformed(
                "non-handshake record before ClientHello ended",
            ));
        }
        if header[1] != 3 {
            return Err(Reject::Malformed("record version"));
        }
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if len == 0 {
            return Err(Reject::Malformed("empty handshake record"));
        }
        if len > MAX_RECORD_PAYLOAD {
            return Err(Reject::Malformed("record longer than 2^14"));
        }
        let end = pos + RECORD_HEADER + len;
        if end > limit {
            return Err(Reject::TooLarge { needed: end, limit });
        }
        let available = &buf[pos + RECORD_HEADER..buf.len().min(end)];
        // Learn the handshake length as soon as its header is visible, even in a partial
        // record, so that oversized or non-ClientHello input is rejected early.
        if handshake_len.is_none() {
            let mut head = [0u8; HANDSHAKE_HEADER];
            let mut have = 0;
            for byte in fragments
                .iter()
                .flat_map(|f| f.iter())
                .chain(available.iter())
            {
                if have == HANDSHAKE_HEADER {
                    break;
                }
                head[have] = *byte;
                have += 1;
            }
            if have >= 1 && head[0] != HANDSHAKE_CLIENT_HELLO {
                return Err(Reject::Malformed(
                    "first handshake message is not a ClientHello",
                ));
            }
            if have == HANDSHAKE_HEADER {
                let body =
                    usize::from(head[1]) << 16 | usize::from(head[2]) << 8 | usize::from(head[3]);
                if body < MIN_CLIENT_HELLO_BODY {
                    return Err(Reject::Malformed("ClientHello too short"));
                }
                // Every record carries at least one byte, so the records need at least this.
                let needed = pos + RECORD_HEADER + (HANDSHAKE_HEADER + body - collected);
                if needed > limit {
                    return Err(Reject::TooLarge { needed, limit });
                }
                handshake_len = Some(HANDSHAKE_HEADER + body);
            }
        }
        if end > buf.len() {
            return Ok(Parsed::Incomplete);
        }
        if fragments.len() == MAX_RECORDS {
            return Err(Reject::Malformed("ClientHello spans too many records"));
        }
        fragments.push(available);
        collected += available.len();
        pos = end;
        if let Some(total) = handshake_len
            && collected >= total
        {
            let message: Cow<[u8]> = if fragments.len() == 1 {
                Cow::Borrowed(fragments[0])
            } else {
                Cow::Owned(fragments.concat())
            };
            let body = &message[HANDSHAKE_HEADER..total];
            let (server_name, alpn) = parse_body(body)?;
            return Ok(Parsed::Complete {
                value: ClientHello {
                    server_name,
                    alpn,
                    record_version,
                    records: fragments.len(),
                },
                consumed: pos,
            });
        }
    }
}

/// Validates what is visible of a record header that has not fully arrived.
fn check_partial_header(partial: &[u8]) -> Result<(), Reject> {
    if let Some(&t) = partial.first()
        && t != CONTENT_TYPE_HANDSHAKE
    {
        return Err(Reject::Malformed(
            "non-handshake record before ClientHello ended",
        ));
    }
    if let Some(&major) = partial.get(1)
        && major != 3
    {
        return Err(Reject::Malformed("record version"));
    }
    Ok(())
}

/// A bounds-checked big-endian reader over a byte slice.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], Reject> {
        if self.buf.len() < n {
            return Err(Reject::Malformed(what));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, Reject> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, Reject> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn vec8(&mut self, what: &'static str) -> Result<&'a [u8], Reject> {
        let n = usize::from(self.u8(what)?);
        self.take(n, what)
    }
    fn vec16(&mut self, what: &'static str) -> Result<&'a [u8], Reject> {
        let n = usize::from(self.u16(what)?);
        self.take(n, what)
    }
    fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// Parses a ClientHello body (after the handshake header) and returns SNI and ALPN.
fn parse_body(body: &[u8]) -> Result<(Option<String>, Vec<String>), Reject> {
    let mut r = Reader { buf: body };
    let version = r.u16("legacy_version")?;
    if version >> 8 != 3 {
        return Err(Reject::Malformed("legacy_version"));
    }
    r.take(32, "random")?;
    if r.vec8("session_id")?.len() > 32 {
        return Err(Reject::Malformed("session_id longer than 32"));
    }
    let suites = r.vec16("cipher_suites")?;
    if suites.is_empty() || suites.len() % 2 != 0 {
        return Err(Reject::Malformed("cipher_suites"));
    }
    if r.vec8("compression_methods")?.is_empty() {
        return Err(Reject::Malformed("compression_methods"));
    }
    let mut server_name = None;
    let mut alpn = Vec::new();
    if r.is_empty() {
        return Ok((server_name, alpn));
    }
    let mut exts = Reader {
        buf: r.vec16("extensions")?,
    };
    if !r.is_empty() {
        return Err(Reject::Malformed("bytes after extensions"));
    }
    let mut seen_sni = false;
    let mut seen_alpn = false;
    while !exts.is_empty() {
        let ty = exts.u16("extension type")?;
        let data = exts.vec16("extension data")?;
        match ty {
            EXT_SERVER_NAME => {
                if std::mem::replace(&mut seen_sni, true) {
                    return Err(Reject::Malformed("duplicate server_name extension"));
                }
                server_name = parse_server_name(data)?;
            }
            EXT_ALPN => {
                if std::mem::replace(&mut seen_alpn, true) {
                    return Err(Reject::Malformed("duplicate ALPN extension"));
                }
                alpn = parse_alpn(data)?;
            }
            _ => {}
        }
    }
    Ok((server_name, alpn))
}

/// Parses the server_name extension (RFC 6066 §3) and normalises the host name.
fn parse_server_name(data: &[u8]) -> Result<Option<String>, Reject> {
    let mut outer = Reader { buf: data };
    let mut list = Reader {
        buf: outer.vec16("server_name list")?,
    };
    if !outer.is_empty() || list.is_empty() {
        return Err(Reject::Malformed("server_name list length"));
    }
    let mut host = None;
    while !list.is_empty() {
        let ty = list.u8("server_name type")?;
        let name = list.vec16("server_name")?;
        if ty != SNI_HOST_NAME {
            continue;
        }
        if host.is_some() {
            return Err(Reject::Malformed("more than one host_name"));
        }
        host = Some(normalize_host(name).ok_or(Reject::Malformed("invalid host_name"))?);
    }
    Ok(host)
}

/// Lower-cases a DNS host name and strips one trailing dot; `None` if it is not a DNS name.
pub fn normalize_host(name: &[u8]) -> Option<String> {
    let name = name.strip_suffix(b".").unwrap_or(name);
    if name.is_empty() || name.len() > MAX_SERVER_NAME || name.ends_with(b".") {
        return None;
    }
    let valid = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_');
    if !name.iter().all(valid) || name.starts_with(b".") || name.windows(2).any(|w| w == b"..") {
        return None;
    }
    // Only ASCII bytes passed the check above, so this cannot fail.
    let s = std::str::from_utf8(name).ok()?;
    Some(s.to_ascii_lowercase())
}

fn parse_alpn(data: &[u8]) -> Result<Vec<String>, Reject> {
    let mut outer = Reader { buf: data };
    let mut list = Reader {
        buf: outer.vec16("ALPN list")?,
    };
    if !outer.is_empty() {
        return Err(Reject::Malformed("ALPN list length"));
    }
    let mut out = Vec::new();
    while !list.is_empty() {
        let proto = list.vec8("ALPN protocol")?;
        if proto.is_empty() {
            return Err(Reject::Malformed("empty ALPN protocol"));
        }
        if out.len() < MAX_ALPN_LOGGED {
            out.push(String::from_utf8_lossy(proto).into_owned());
        }
    }
    Ok(out)
}

/// A fatal `unrecognized_name` alert (RFC 6066 §3) in one plaintext record.
pub fn unrecognized_name_alert(record_version: u16) -> [u8; 7] {
    fatal_alert(record_version, 112)
}

/// A fatal `access_denied` alert (RFC 8446 §6.2: access control refused the peer) in one
/// plaintext record.
pub fn access_denied_alert(record_version: u16) -> [u8; 7] {
    fatal_alert(record_version, 49)
}

/// A fatal alert with `description` in one plaintext record.
fn fatal_alert(record_version: u16, description: u8) -> [u8; 7] {
    let v = record_version.to_be_bytes();
    // Alert record: type 21, version, length 2, level fatal (2), description.
    [21, v[0], v[1], 0, 2, 2, description]
}

/// Test helpers that build ClientHellos; also used by integration tests and benches.
pub mod testing {
    /// Builds a plausible ClientHello record with the given SNI, ALPN and `padding` extra
    /// bytes in an unknown extension (to make it large, like a post-quantum hello).
    pub fn client_hello(sni: Option<&str>, alpn: &[&str], padding: usize) -> Vec<u8> {
        let mut exts = Vec::new();
        if let Some(name) = sni {
            let mut list = vec![0u8];
            list.extend_from_slice(&(name.len() as u16).to_be_bytes());
            list.extend_from_slice(name.as_bytes());
            let mut data = (list.len() as u16).to_be_bytes().to_vec();
            data.extend_from_slice(&list);
            push_ext(&mut exts, 0, &data);
        }
        if !alpn.is_empty() {
            let mut list = Vec::new();
            for p in alpn {
                list.push(p.len() as u8);
                list.extend_from_slice(p.as_bytes());
            }
            let mut data = (list.len() as u16).to_be_bytes().to_vec();
            data.extend_from_slice(&list);
            push_ext(&mut exts, 16, &data);
        }
        if padding > 0 {
            push_ext(&mut exts, 0xfe0d, &vec![0xab; padding]);
        }
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7u8; 32]);
        body.push(32);
        body.extend_from_slice(&[9u8; 32]);
        body.extend_from_slice(&[0, 4, 0x13, 0x01, 0x13, 0x02]);
        body.extend_from_slice(&[1, 0]);
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend_from_slice(&exts);
        let mut hs = vec![1];
        hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend_from_slice(&body);
        records(&hs, &[hs.len()])
    }

    fn push_ext(out: &mut Vec<u8>, ty: u16, data: &[u8]) {
        out.extend_from_slice(&ty.to_be_bytes());
        out.extend_from_slice(&(data.len() as u16).to_be_bytes());
        out.extend_from_slice(data);
    }

    /// Wraps handshake bytes into records of the given payload sizes (the last takes the rest).
    pub fn records(handshake: &[u8], sizes: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut rest = handshake;
        for (i, &n) in sizes.iter().enumerate() {
            let n = if i + 1 == sizes.len() {
                rest.len()
            } else {
                n.min(rest.len())
            };
            let (chunk, tail) = rest.split_at(n);
            out.extend_from_slice(&[22, 3, 1]);
            out.extend_from_slice(&(chunk.len() as u16).to_be_bytes());
            out.extend_from_slice(chunk);
            rest = tail;
        }
        out
    }

    /// Re-splits a single-record ClientHello (as clients send it) into `n` records.
    pub fn resplit(record: &[u8], n: usize) -> Vec<u8> {
        let handshake = &record[5..];
        let size = handshake.len().div_ceil(n);
        records(handshake, &vec![size; n])
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    const LIMIT: usize = 16_384;

    fn complete(buf: &[u8]) -> (ClientHello, usize) {
        match parse_client_hello(buf, LIMIT) {
            Ok(Parsed::Complete { value, consumed }) => (value, consumed),
            other => panic!("expected complete, got {other:?}"),
        }
    }

    #[test]
    fn parses_sni_and_alpn() {
        let hello = client_hello(Some("API.Example.COM."), &["h2", "http/1.1"], 0);
        let (v, consumed) = complete(&hello);
        assert_eq!(v.server_name.as_deref(), Some("api.example.com"));
        assert_eq!(v.alpn, vec!["h2", "http/1.1"]);
        assert_eq!(consumed, hello.len());
        assert_eq!(v.records, 1);
    }

    #[test]
    fn no_sni_is_not_an_error() {
        let (v, _) = complete(&client_hello(None, &[], 0));
        assert_eq!(v.server_name, None);
    }

    #[test]
    fn every_prefix_is_incomplete_then_same_answer() {
        for pad in [0, 1500] {
            for split in [1, 3] {
                let hello = resplit(&client_hello(Some("a.example.com"), &["h2"], pad), split);
                for i in 0..hello.len() {
                    assert_eq!(
                        parse_client_hello(&hello[..i], LIMIT),
                        Ok(Parsed::Incomplete),
                        "prefix {i} of {}",
                        hello.len()
                    );
                }
                let expected = complete(&hello);
                let mut longer = hello.clone();
                longer.extend_from_slice(b"\x17\x03\x03\x00\x05trailing application data");
                assert_eq!(complete(&longer), expected);
            }
        }
    }

    #[test]
    fn split_at_every_offset_into_two_records() {
        let single = client_hello(Some("split.example.com"), &[], 300);
        let handshake = &single[5..];
        for at in 1..handshake.len() {
            let two = records(handshake, &[at, handshake.len() - at]);
            let (v, consumed) = complete(&two);
            assert_eq!(v.server_name.as_deref(), Some("split.example.com"));
            assert_eq!(v.records, 2);
            assert_eq!(consumed, two.len());
        }
    }

    #[test]
    fn record_count_is_capped() {
        let single = client_hello(Some("tiny.example.com"), &[], 0);
        let handshake = &single[5..];
        let mut sizes = vec![1; MAX_RECORDS - 1];
        sizes.push(handshake.len());
        let fits = records(handshake, &sizes);
        assert_eq!(complete(&fits).0.records, MAX_RECORDS);
        let many = records(handshake, &vec![1; handshake.len()]);
        assert_eq!(
            parse_client_hello(&many, LIMIT),
            Err(Reject::Malformed("ClientHello spans too many records"))
        );
    }

    #[test]
    fn rejects_non_tls_on_first_byte() {
        assert_eq!(parse_client_hello(b"G", LIMIT), Err(Reject::NotTls));
        assert_eq!(parse_client_hello(b"SSH-2.0", LIMIT), Err(Reject::NotTls));
        assert_eq!(
            parse_client_hello(&[0x16, 0x02], LIMIT),
            Err(Reject::NotTls)
        );
        assert_eq!(
            parse_client_hello(&[0x80, 0x2e, 0x01], LIMIT),
            Err(Reject::NotTls)
        );
    }

    #[test]
    fn rejects_oversized_early() {
        let hello = client_hello(Some("big.example.com"), &[], 5000);
        // The handshake header alone shows it cannot fit in 4096 bytes.
        let r = parse_client_hello(&hello[..9], 4096);
        assert!(matches!(r, Err(Reject::TooLarge { .. })), "{r:?}");
        assert!(complete(&hello).0.server_name.is_some());
        // Record headers push a hello that alone would fit past the limit.
        let hs = &hello[5..];
        let many = records(hs, &[hs.len().div_ceil(20); 20]);
        let r = parse_client_hello(&many, hs.len() + 50);
        assert!(matches!(r, Err(Reject::TooLarge { .. })), "{r:?}");
    }

    #[test]
    fn rejects_malformed() {
        let mut not_hello = client_hello(Some("x.example.com"), &[], 0);
        not_hello[5] = 2; // ServerHello
        assert_eq!(
            parse_client_hello(&not_hello[..6], LIMIT),
            Err(Reject::Malformed(
                "first handshake message is not a ClientHello"
            ))
        );
        // Alert record in the middle of a split hello.
        let mut two = records(
            &client_hello(Some("x.example.com"), &[], 0)[5..],
            &[10, 200],
        );
        two[15] = 21;
        assert!(matches!(
            parse_client_hello(&two, LIMIT),
            Err(Reject::Malformed(_))
        ));
        // Empty record.
        assert!(parse_client_hello(&[22, 3, 1, 0, 0], LIMIT).is_err());
        // Bad host name.
        let bad = client_hello(Some("bad name.example.com"), &[], 0);
        assert_eq!(
            parse_client_hello(&bad, LIMIT),
            Err(Reject::Malformed("invalid host_name"))
        );
    }

    #[test]
    fn truncated_lengths_never_panic() {
        let hello = client_hello(Some("fuzz.example.com"), &["h2"], 40);
        // Corrupt each byte in turn; the parser must answer without panicking.
        for i in 0..hello.len() {
            for v in [0u8, 1, 0x7f, 0xff] {
                let mut h = hello.clone();
                h[i] = v;
                let _ = parse_client_hello(&h, LIMIT);
            }
        }
    }

    #[test]
    fn host_normalisation() {
        assert_eq!(normalize_host(b"A.B.c."), Some("a.b.c".into()));
        assert_eq!(normalize_host(b"."), None);
        assert_eq!(normalize_host(b"a..b"), None);
        assert_eq!(normalize_host(b"x.example.com.."), None);
        assert_eq!(normalize_host(b""), None);
    }

    #[test]
    fn alert_bytes() {
        assert_eq!(unrecognized_name_alert(0x0301), [21, 3, 1, 0, 2, 2, 112]);
        assert_eq!(access_denied_alert(0x0303), [21, 3, 3, 0, 2, 2, 49]);
    }
}
