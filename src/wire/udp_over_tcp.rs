//! Datagrams over a TCP stream: each datagram is preceded by its length as a 16-bit
//! big-endian integer and nothing else — the framing of mullvad's `udp-over-tcp` and of
//! Debian's `udptunnel` (RTP-over-TCP's early drafts). WireGuard over TCP (`connect`
//! endpoints, `connectDestination`) uses it.
//!
//! [`parse`] reads one frame at the start of a buffer; [`frames`] walks every complete frame
//! of a buffer and says how many bytes they cover, so a driver that appends each read to a
//! buffer keeps only the partial frame at its end (an incremental decoder without state of
//! its own). [`encode`] appends one frame. No I/O, no allocation but the caller's.
//!
//! Zero-length frames: the framing allows them and the decoder returns them as empty
//! datagrams, as mullvad's `tcp2udp` and `udptunnel` do (both send them on as empty UDP
//! datagrams). The encoder never writes one: `udptunnel` takes a zero-length read for the
//! end of its peer, so an empty frame (or an empty datagram it would frame) ends its tunnel.
//! WireGuard never sends an empty datagram; a receiver drops one like any invalid message.

use thiserror::Error;

use super::Parsed;

/// Bytes of the length field in front of every datagram.
pub const HEADER_LEN: usize = 2;

/// The longest datagram the 16-bit length field can carry.
pub const MAX_DATAGRAM: usize = u16::MAX as usize;

/// The longest frame, length field included.
pub const MAX_FRAME: usize = HEADER_LEN + MAX_DATAGRAM;

/// Why bytes cannot be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Reject {
    /// The frame (length field included) is longer than the caller's cap, said by its
    /// length field before its datagram arrives.
    #[error("a frame longer than {limit} bytes")]
    TooLarge {
        /// The cap, in bytes of the whole frame.
        limit: usize,
    },
}

/// Why a datagram cannot be framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum EncodeError {
    /// An empty datagram (see the module docs: a peer may take it for the end).
    #[error("an empty datagram is never framed")]
    Empty,
    /// Longer than the length field can say.
    #[error("a datagram of {len} bytes does not fit a 16-bit length")]
    TooLarge {
        /// Its length.
        len: usize,
    },
}

/// One frame at the start of `buf`: its datagram, and the frame's length as `consumed`.
/// Frames longer than `limit` bytes (length field included) are refused as soon as the
/// length field is read.
pub fn parse(buf: &[u8], limit: usize) -> Result<Parsed<&[u8]>, Reject> {
    let Some(header) = buf.first_chunk::<HEADER_LEN>() else {
        // Every frame is at least the length field: under a cap that small, none fits.
        return if buf.len() >= limit {
            Err(Reject::TooLarge { limit })
        } else {
            Ok(Parsed::Incomplete)
        };
    };
    let frame = HEADER_LEN + usize::from(u16::from_be_bytes(*header));
    if frame > limit {
        return Err(Reject::TooLarge { limit });
    }
    match buf.get(HEADER_LEN..frame) {
        Some(datagram) => Ok(Parsed::Complete {
            value: datagram,
            consumed: frame,
        }),
        None => Ok(Parsed::Incomplete),
    }
}

/// Appends `datagram` to `out` as one frame.
pub fn encode(datagram: &[u8], out: &mut Vec<u8>) -> Result<(), EncodeError> {
    if datagram.is_empty() {
        return Err(EncodeError::Empty);
    }
    let len = u16::try_from(datagram.len()).map_err(|_| EncodeError::TooLarge {
        len: datagram.len(),
    })?;
    out.reserve(HEADER_LEN + datagram.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(datagram);
    Ok(())
}

/// The complete frames at the start of `buf`, in order (see [`Frames`]).
pub fn frames(buf: &[u8], limit: usize) -> Frames<'_> {
    Frames {
        buf,
        limit,
        consumed: 0,
        failed: false,
    }
}

/// An iterator over the datagrams of the complete frames of a buffer. It stops at the first
/// incomplete frame; [`Frames::consumed`] then says how many bytes the frames it yielded
/// cover, which the caller drops from the front of its buffer. A frame over the cap is
/// yielded as the error and ends the iteration (the stream cannot be resynchronised).
#[derive(Debug, Clone)]
pub struct Frames<'a> {
    buf: &'a [u8],
    limit: usize,
    consumed: usize,
    failed: bool,
}

impl Frames<'_> {
    /// Bytes covered by the frames yielded so far.
    pub fn consumed(&self) -> usize {
        self.consumed
    }
}

impl<'a> Iterator for Frames<'a> {
    type Item = Result<&'a [u8], Reject>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        let rest = &self.buf[self.consumed..];
        match parse(rest, self.limit) {
            Ok(Parsed::Complete { value, consumed }) => {
                self.consumed += consumed;
                Some(Ok(value))
            }
            Ok(Parsed::Incomplete) => None,
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift64*).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    fn framed(datagrams: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for d in datagrams {
            encode(d, &mut out).unwrap();
        }
        out
    }

    #[test]
    fn the_wire_format_is_a_big_endian_length_and_the_bytes() {
        let mut out = Vec::new();
        encode(b"hello", &mut out).unwrap();
        encode(&[7; 300], &mut out).unwrap();
        assert_eq!(&out[..7], b"\x00\x05hello");
        assert_eq!(&out[7..9], &[0x01, 0x2c]);
        assert_eq!(out.len(), 7 + 2 + 300);
        let max = vec![1u8; MAX_DATAGRAM];
        let mut out = Vec::new();
        encode(&max, &mut out).unwrap();
        assert_eq!(&out[..2], &[0xff, 0xff]);
        assert_eq!(
            parse(&out, MAX_FRAME),
            Ok(Parsed::Complete {
                value: &max[..],
                consumed: MAX_FRAME
            })
        );
    }

    #[test]
    fn empty_and_oversized_datagrams_are_never_framed() {
        let mut out = vec![9];
        assert_eq!(encode(b"", &mut out), Err(EncodeError::Empty));
        let big = vec![0u8; MAX_DATAGRAM + 1];
        assert_eq!(
            encode(&big, &mut out),
            Err(EncodeError::TooLarge {
                len: MAX_DATAGRAM + 1
            })
        );
        assert_eq!(out, [9], "nothing written");
    }

    /// What `udptunnel` and mullvad's `tcp2udp` do with a zero-length frame: an empty
    /// datagram, and the frame after it follows.
    #[test]
    fn a_zero_length_frame_is_an_empty_datagram() {
        let input = b"\x00\x00\x00\x02hi";
        let got: Vec<_> = frames(input, MAX_FRAME).collect();
        assert_eq!(got, [Ok(&b""[..]), Ok(&b"hi"[..])]);
        assert_eq!(
            parse(input, MAX_FRAME),
            Ok(Parsed::Complete {
                value: &b""[..],
                consumed: 2
            })
        );
    }

    #[test]
    fn every_prefix_is_incomplete_then_complete() {
        for datagram in [&b"x"[..], &[0xab; 148][..], &[3; 1452][..]] {
            let frame = framed(&[datagram]);
            for k in 0..frame.len() {
                assert_eq!(
                    parse(&frame[..k], MAX_FRAME),
                    Ok(Parsed::Incomplete),
                    "prefix {k}"
                );
            }
            let whole = Ok(Parsed::Complete {
                value: datagram,
                consumed: frame.len(),
            });
            assert_eq!(parse(&frame, MAX_FRAME), whole);
            let mut longer = frame.clone();
            longer.extend_from_slice(b"\x00\x10more bytes");
            assert_eq!(parse(&longer, MAX_FRAME), whole);
        }
    }

    /// Two reads split at every offset of three frames: every datagram comes out once, in
    /// order, and what is left is always the partial frame at the end.
    #[test]
    fn split_at_every_offset() {
        let datagrams: [&[u8]; 3] = [b"first", &[0x55; 200], b"x"];
        let stream = framed(&datagrams);
        for at in 0..=stream.len() {
            let mut got: Vec<Vec<u8>> = Vec::new();
            let mut buf = Vec::new();
            for read in [&stream[..at], &stream[at..]] {
                buf.extend_from_slice(read);
                let mut it = frames(&buf, MAX_FRAME);
                got.extend(it.by_ref().map(|f| f.unwrap().to_vec()));
                let used = it.consumed();
                buf.drain(..used);
            }
            assert!(buf.is_empty(), "split at {at}: {} bytes left", buf.len());
            assert_eq!(got, datagrams.map(<[u8]>::to_vec), "split at {at}");
        }
    }

    #[test]
    fn the_cap_covers_the_whole_frame_and_is_decided_on_the_length_field() {
        let frame = framed(&[&[1; 100]]);
        // Exactly the frame fits; a byte less is refused before the datagram arrives.
        assert!(matches!(
            parse(&frame, 102),
            Ok(Parsed::Complete { consumed: 102, .. })
        ));
        assert_eq!(
            parse(&frame[..2], 101),
            Err(Reject::TooLarge { limit: 101 })
        );
        // Under a cap below the length field nothing fits.
        assert_eq!(parse(b"", 1), Ok(Parsed::Incomplete));
        assert_eq!(parse(b"\x00", 1), Err(Reject::TooLarge { limit: 1 }));
        assert_eq!(parse(b"", 0), Err(Reject::TooLarge { limit: 0 }));
        // The iterator yields the frames before an oversized one, then the error, then stops.
        let mut input = framed(&[b"ok"]);
        input.extend_from_slice(b"\x01\x00");
        let mut it = frames(&input, 64);
        assert_eq!(it.next(), Some(Ok(&b"ok"[..])));
        assert_eq!(it.next(), Some(Err(Reject::TooLarge { limit: 64 })));
        assert_eq!(it.next(), None);
        assert_eq!(it.consumed(), 4);
    }

    /// Property: random datagrams framed into one stream and read back in random pieces (as
    /// TCP delivers them) come out unchanged, in order, with no bytes left over; and a stream
    /// cut anywhere yields exactly the datagrams whose frames ended before the cut.
    #[test]
    fn random_datagrams_survive_random_reads() {
        for seed in 1..=200u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let count = 1 + rng.below(40);
            let datagrams: Vec<Vec<u8>> = (0..count)
                .map(|_| {
                    let len = match rng.below(10) {
                        0 => 1 + rng.below(MAX_DATAGRAM),
                        1..=3 => 1 + rng.below(64),
                        _ => 1 + rng.below(1500),
                    };
                    (0..len).map(|_| rng.next() as u8).collect()
                })
                .collect();
            let refs: Vec<&[u8]> = datagrams.iter().map(Vec::as_slice).collect();
            let stream = framed(&refs);

            let mut got = Vec::new();
            let mut buf = Vec::new();
            let mut at = 0;
            while at < stream.len() {
                let n = match rng.below(4) {
                    0 => 1,
                    1 => 1 + rng.below(3),
                    _ => 1 + rng.below(4096),
                }
                .min(stream.len() - at);
                buf.extend_from_slice(&stream[at..at + n]);
                at += n;
                let mut it = frames(&buf, MAX_FRAME);
                got.extend(it.by_ref().map(|f| f.unwrap().to_vec()));
                let used = it.consumed();
                buf.drain(..used);
                assert!(
                    buf.len() < MAX_FRAME,
                    "seed {seed}: a partial frame at most"
                );
            }
            assert!(buf.is_empty(), "seed {seed}");
            assert_eq!(got, datagrams, "seed {seed}");

            let cut = rng.below(stream.len() + 1);
            let mut it = frames(&stream[..cut], MAX_FRAME);
            let before: Vec<Vec<u8>> = it.by_ref().map(|f| f.unwrap().to_vec()).collect();
            let mut ends = Vec::new();
            let mut end = 0;
            for d in &datagrams {
                end += HEADER_LEN + d.len();
                ends.push(end);
            }
            let whole = ends.iter().filter(|&&e| e <= cut).count();
            assert_eq!(before, datagrams[..whole], "seed {seed}, cut at {cut}");
            assert_eq!(it.consumed(), if whole == 0 { 0 } else { ends[whole - 1] });
        }
    }
}
