//! The contract every capped `wire` parser keeps (`src/wire/mod.rs`, STYLE "Parsers are pure
//! functions"), checked for one input and one cap. Targets add their own oracles on top.
use std::fmt::Debug;

use trellis::wire::Parsed;

/// Bytes appended to an input to check that more input changes nothing: filler, and line
/// ends that would complete a header if the parser had not already decided.
const SUFFIXES: [&[u8]; 2] = [&[0; 16], b"\r\n\r\n"];

/// Strict prefixes checked after a complete answer: every one below 48 bytes, then a spread.
fn prefix_points(consumed: usize) -> impl Iterator<Item = usize> {
    let spread = (1..16).map(move |i| consumed * i / 16);
    (0..consumed.min(48))
        .chain(spread)
        .chain([consumed.saturating_sub(1)])
        .filter(move |&k| k < consumed)
}

/// Checks `parse(data, limit)` against the shared contract and returns its answer.
///
/// - `Incomplete` only below the cap: at `limit` bytes the parser has decided.
/// - `Complete { consumed }`: `0 < consumed <= min(len, limit)`; strict prefixes (sampled) are
///   `Incomplete`; more bytes give the same answer; the cap is exact (`consumed` fits,
///   `consumed - 1` is too large).
/// - A rejection is final: more bytes never turn it into anything else, and while the input
///   is under the cap (all a driver ever shows the parser) the reason stays the same too.
///
/// `cap_of` returns the limit named by a too-large rejection, `None` for other rejections.
pub fn check<T, E>(
    data: &[u8],
    limit: usize,
    parse: impl Fn(&[u8], usize) -> Result<Parsed<T>, E>,
    cap_of: impl Fn(&E) -> Option<usize>,
) -> Result<Parsed<T>, E>
where
    T: PartialEq + Debug,
    E: PartialEq + Debug,
{
    let whole = parse(data, limit);
    let longer = |suffix: &[u8]| [data, suffix].concat();
    match &whole {
        Ok(Parsed::Incomplete) => {
            assert!(
                data.len() < limit,
                "Incomplete at {} bytes, cap {limit}",
                data.len()
            );
        }
        Ok(Parsed::Complete { consumed, .. }) => {
            let consumed = *consumed;
            assert!(consumed > 0, "empty value");
            assert!(
                consumed <= data.len(),
                "consumed {consumed} of {}",
                data.len()
            );
            assert!(
                consumed <= limit,
                "consumed {consumed} over the cap {limit}"
            );
            assert_eq!(
                parse(&data[..consumed], limit),
                whole,
                "the value's own bytes"
            );
            for suffix in SUFFIXES {
                assert_eq!(parse(&longer(suffix), limit), whole, "more input");
            }
            for k in prefix_points(consumed) {
                assert_eq!(
                    parse(&data[..k], limit),
                    Ok(Parsed::Incomplete),
                    "prefix {k} of a value of {consumed} bytes"
                );
            }
            assert_eq!(parse(data, consumed), whole, "cap equal to the value");
            let under = parse(data, consumed - 1);
            assert_eq!(
                under.as_ref().err().and_then(&cap_of),
                Some(consumed - 1),
                "cap one byte under the value: {under:?}"
            );
        }
        Err(e) => {
            if let Some(cap) = cap_of(e) {
                assert_eq!(cap, limit, "a too-large rejection names the cap");
            }
            for suffix in SUFFIXES {
                let again = parse(&longer(suffix), limit);
                assert!(again.is_err(), "{e:?} turned into {again:?} by more input");
                if data.len() < limit {
                    assert_eq!(
                        again.as_ref().err(),
                        Some(e),
                        "reason changed by more input"
                    );
                }
            }
        }
    }
    whole
}

/// The caps every target checks: a driver's usual cap, the smallest one configuration
/// allows, and the input's own length and one less (the input exactly at and over the cap).
pub fn limits(default: usize, data: &[u8]) -> [usize; 4] {
    [default, 256, data.len(), data.len().saturating_sub(1)]
}

/// Offset just past the first empty line (LF or CRLF) of an HTTP head, if any.
#[allow(dead_code)] // used by the HTTP targets only
pub fn head_end(data: &[u8]) -> Option<usize> {
    let mut start = 0;
    for line in data.split_inclusive(|&b| b == b'\n') {
        start += line.len();
        if line == b"\n" || line == b"\r\n" {
            return Some(start);
        }
        if !line.ends_with(b"\n") {
            return None;
        }
    }
    None
}
