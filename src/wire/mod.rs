//! Sans-IO codecs for the bytes a client sends before routing (the TLS ClientHello, PROXY
//! headers, HTTP CONNECT heads) and for WireGuard's datagrams over TCP.
//!
//! Every parser here is a pure function over a byte slice: it never reads a socket, never
//! allocates more than the value it returns, and answers "need more bytes" as a state
//! ([`Parsed::Incomplete`]), not as an error. Size caps are parameters or named constants, so
//! a driver can bound how much it buffers. Nothing in this module knows about tokio.

pub mod http;
pub mod proxy;
pub mod tls;
pub mod udp_over_tcp;

/// The result of feeding a parser the bytes read so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed<T> {
    /// More bytes are needed before a decision can be made.
    Incomplete,
    /// A complete value was parsed from the first `consumed` bytes of the input.
    Complete {
        /// The parsed value.
        value: T,
        /// How many input bytes the value covers.
        consumed: usize,
    },
}

#[cfg(test)]
mod tests {
    //! Replays the regression inputs in `tests/data/{proxy,http,tls}/`. A file is named
    //! `<what>.<outcome>.bin`, the outcome being `complete`, `incomplete`, `too-large`,
    //! `malformed`, `not-proxy` or `not-tls`; `http/response-*` files are response heads, the
    //! other `http/` files request heads. Each is parsed under the gateway's default caps.
    //!
    //! Bugs these inputs caught, in words:
    //! - `tls/hello-in-one-byte-records`: a ClientHello split into one TLS record per byte
    //!   was accepted however many records it took, and the driver, which parses again after
    //!   every read, did work quadratic in the record count; now more than `MAX_RECORDS`
    //!   records are malformed.
    //! - `tls/server-name-with-two-trailing-dots`: `x.example.com..` lost one dot and was
    //!   accepted as the name `x.example.com.`.
    //! - `tls/server-name-of-254-bytes`: the length cap counted a trailing dot the name had
    //!   already lost, so a 254-byte name without one passed.
    //! - `proxy/v1-over-107-bytes-in-one-read` (the fuzz input that found it): a v1 line
    //!   longer than the spec's 107 bytes was accepted when it arrived in one read and
    //!   refused when a read ended at byte 107.
    //! - `proxy/v2-ssl-version-with-control-bytes` (the fuzz input that found it): the SSL
    //!   TLV's version went into the TLV summaries for logs as sent, control bytes and all,
    //!   and of any length, where every other value is cut to 64 printable characters.
    //! - `http/form-feed-trimmed-from-header-value` (the fuzz input that found it) and
    //!   `http/bare-cr-at-end-of-header-value`: header values were trimmed of all ASCII
    //!   whitespace, so a form feed or a bare CR at either end of a value vanished instead
    //!   of being refused as a control character.
    //! - `http/response-status-code-with-plus-sign` (the fuzz input that found it): the
    //!   node read the status code with `u16::from_str`, which takes a sign, so
    //!   `HTTP/1.0 +03` was status 3.
    //!
    //! The others are no past bug; they pin what the parsers' caps and splits turn on:
    //! `tls/hello-in-32-records` and `tls/server-name-of-253-bytes-and-a-trailing-dot` (the
    //! accepted side of the two caps above), `proxy/v1-unknown-of-107-bytes` (the longest v1
    //! line the spec allows), `proxy/v1-split-after-source-port` (a read ending where the
    //! source port could already look complete), `proxy/v2-declared-length-over-cap`
    //! (refused on its length field, before the bytes arrive),
    //! `proxy/v2-bad-tlv-after-the-logged-eight` (TLVs are checked past the ones kept for
    //! logs), `http/100-header-fields` and `http/101-header-fields` (`MAX_HEADERS`),
    //! `http/obsolete-line-folding`, and the `*-then-tunnel-bytes` heads, whose `consumed`
    //! leaves the tunnel's first bytes to be relayed.

    use std::fmt::Debug;
    use std::path::Path;

    use super::{Parsed, http, proxy, tls};

    /// The default `maxHeaderBytes`, also the node's cap on a CONNECT answer.
    const HEADER_LIMIT: usize = 8192;
    /// The default `maxClientHelloBytes`.
    const HELLO_LIMIT: usize = 16_384;

    /// Parses `data` and checks the outcome its file name states, that every strict prefix of
    /// a complete value is incomplete, that more bytes change no decision, and `check` on a
    /// complete value.
    fn replay<T: PartialEq + Debug, E: PartialEq + Debug>(
        file: &str,
        data: &[u8],
        parse: impl Fn(&[u8]) -> Result<Parsed<T>, E>,
        reject: impl Fn(&E) -> &'static str,
        check: impl Fn(&T),
    ) {
        let answer = parse(data);
        let outcome = match &answer {
            Ok(Parsed::Incomplete) => "incomplete",
            Ok(Parsed::Complete { .. }) => "complete",
            Err(e) => reject(e),
        };
        assert!(
            file.ends_with(&format!(".{outcome}.bin")),
            "{file}: {answer:?}"
        );
        if let Ok(Parsed::Complete { value, consumed }) = &answer {
            check(value);
            for k in 0..*consumed {
                assert_eq!(
                    parse(&data[..k]),
                    Ok(Parsed::Incomplete),
                    "{file}: prefix {k}"
                );
            }
        }
        if !matches!(answer, Ok(Parsed::Incomplete)) {
            let longer = [data, b"\r\n\r\n"].concat();
            assert_eq!(parse(&longer), answer, "{file}: more bytes");
        }
    }

    /// Replays one file under the parser its directory (and name) selects.
    fn replay_file(dir: &str, name: &str, data: &[u8]) {
        let file = format!("{dir}/{name}");
        match dir {
            "proxy" => {
                let parse = |b: &[u8]| proxy::parse(b, HEADER_LIMIT);
                let reject = |e: &proxy::Reject| match e {
                    proxy::Reject::NotProxy => "not-proxy",
                    proxy::Reject::TooLarge { .. } => "too-large",
                    proxy::Reject::Malformed => "malformed",
                };
                // TLV summaries go to logs: short, printable, one token each.
                let check = |value: &proxy::ProxyInfo| {
                    for tlv in &value.tlvs {
                        assert!(tlv.len() <= 80, "{file}: {tlv:?}");
                        assert!(tlv.bytes().all(|b| b.is_ascii_graphic()), "{file}: {tlv:?}");
                    }
                };
                replay(&file, data, parse, reject, check);
            }
            "http" => {
                let reject = |e: &http::Reject| match e {
                    http::Reject::TooLarge { .. } => "too-large",
                    http::Reject::Malformed(_) => "malformed",
                };
                if name.starts_with("response-") {
                    let parse = |b: &[u8]| http::parse_response_status(b, HEADER_LIMIT);
                    replay(&file, data, parse, reject, |_| {});
                } else {
                    let parse = |b: &[u8]| http::parse_request_head(b, HEADER_LIMIT);
                    replay(&file, data, parse, reject, |_| {});
                }
            }
            _ => {
                let parse = |b: &[u8]| tls::parse_client_hello(b, HELLO_LIMIT);
                let reject = |e: &tls::Reject| match e {
                    tls::Reject::NotTls => "not-tls",
                    tls::Reject::TooLarge { .. } => "too-large",
                    tls::Reject::Malformed(_) => "malformed",
                };
                replay(&file, data, parse, reject, |_| {});
            }
        }
    }

    #[test]
    fn regression_inputs_in_tests_data() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
        let (mut replayed, mut failed) = (0, Vec::new());
        for dir in ["proxy", "http", "tls"] {
            for entry in std::fs::read_dir(root.join(dir)).unwrap() {
                let path = entry.unwrap().path();
                let data = std::fs::read(&path).unwrap();
                let name = path.file_name().unwrap().to_str().unwrap().to_owned();
                // Every file is replayed; the failures are listed together at the end.
                if std::panic::catch_unwind(|| replay_file(dir, &name, &data)).is_err() {
                    failed.push(format!("{dir}/{name}"));
                }
                replayed += 1;
            }
        }
        assert!(replayed > 0, "no files under {root:?}");
        assert!(
            failed.is_empty(),
            "{} of {replayed} failed: {failed:#?}",
            failed.len()
        );
    }
}
