//! Field values that are decoded from their text form: durations, addresses, networks,
//! keys, header names, file names, bounded counts. A value that its type refuses is a type
//! error at its path, reported with the others when the file is decoded, so a decoded
//! configuration never holds one; what is left to a kind's validation are the rules across
//! fields. This module reads no files and knows no kind.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::ops::Deref;
use std::path::PathBuf;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};

use super::recover;
use serde::Deserialize as _;

use crate::route::{BackendAddress, Net, NetSet, ProxyVersion, WgKey};

/// The only API version this build understands.
pub const API_VERSION: &str = "trellis.gardener.cloud/v1alpha1";

/// Leads the message of a value its type refused: the decoder takes it off and points the
/// problem at the value (not where the parser stopped), as it points every problem it finds
/// after the parser.
pub(super) const REFUSED: char = '\u{1}';

/// The error for a value its type refused.
fn refuse<E: de::Error>(message: impl fmt::Display) -> E {
    E::custom(format_args!("{REFUSED}{message}"))
}

/// A value written as text.
pub trait Text: Sized {
    /// The value `text` stands for, or what is wrong with it.
    fn from_text(text: &str) -> Result<Self, String>;
    /// What is decoded in place of a value of the wrong type, so that decoding goes on (it
    /// is never used: the file is refused).
    fn stand_in() -> Self;
}

/// Implements `Deserialize` for [`Text`] types.
macro_rules! text_values {
    ($($ty:ty),* $(,)?) => {$(
        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                $crate::config::value::text(d)
            }
        }
    )*};
}

/// Decodes a [`Text`] value: a string, which the type parses. It asks for a newtype of the
/// name the stand-in deserializer knows ([`recover::SCALAR`]), which hands a stand-in the
/// type makes itself instead of an empty string it would refuse.
pub(crate) fn text<'de, T: Text, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
    let mut value: Option<T> = None;
    scalar(d, &mut |text| {
        value = Some(match text {
            Some(text) => T::from_text(text)?,
            None => T::stand_in(),
        });
        Ok(())
    })?;
    // A scalar that decoded handed its text (or the stand-in's absence) to the closure.
    Ok(value.unwrap_or_else(T::stand_in))
}

/// Hands a scalar's text to `parse` (`None` where a stand-in is decoded), inside the
/// value's decode so that its refusal has the value's path. One visitor for every [`Text`]
/// type: a visitor of each type's own would be built for every deserializer the decoder
/// stacks, megabytes of the binary.
fn scalar<'de, D: Deserializer<'de>>(
    d: D,
    parse: &mut dyn FnMut(Option<&str>) -> Result<(), String>,
) -> Result<(), D::Error> {
    struct Scalar<'p>(&'p mut dyn FnMut(Option<&str>) -> Result<(), String>);
    impl<'de> Visitor<'de> for Scalar<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string")
        }
        fn visit_unit<E: de::Error>(self) -> Result<(), E> {
            (self.0)(None).map_err(refuse)
        }
        fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_str(self)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
            (self.0)(Some(v)).map_err(refuse)
        }
    }
    d.deserialize_newtype_struct(recover::SCALAR, Scalar(parse))
}

/// A newtype whose value a field may hold plainly (`Duration`, `SocketAddr`), decoded
/// through the newtype: `#[serde(deserialize_with = "plain::<Positive, _>")]`.
pub trait Plain {
    /// The wrapped value.
    type Inner;
    /// Unwraps it.
    fn into_inner(self) -> Self::Inner;
}

/// Decodes `T` and unwraps it.
pub(crate) fn plain<'de, T, D>(d: D) -> Result<T::Inner, D::Error>
where
    T: Plain + serde::Deserialize<'de>,
    D: Deserializer<'de>,
{
    T::deserialize(d).map(T::into_inner)
}

/// [`plain`] for an optional field (`#[serde(default, ...)]`).
pub(crate) fn plain_option<'de, T, D>(d: D) -> Result<Option<T::Inner>, D::Error>
where
    T: Plain + serde::Deserialize<'de>,
    D: Deserializer<'de>,
{
    Option::<T>::deserialize(d).map(|v| v.map(T::into_inner))
}

/// [`plain`] for a list.
pub(crate) fn plain_list<'de, T, D>(d: D) -> Result<Vec<T::Inner>, D::Error>
where
    T: Plain + serde::Deserialize<'de>,
    D: Deserializer<'de>,
{
    Vec::<T>::deserialize(d).map(|v| v.into_iter().map(T::into_inner).collect())
}

/// Implements `Deref` to the wrapped value and [`Plain`].
macro_rules! newtype {
    ($($name:ident($inner:ty)),* $(,)?) => {$(
        impl Deref for $name {
            type Target = $inner;
            fn deref(&self) -> &$inner {
                &self.0
            }
        }
        impl Plain for $name {
            type Inner = $inner;
            fn into_inner(self) -> $inner {
                self.0
            }
        }
    )*};
}

/// `apiVersion`: [`API_VERSION`] is the only one a kind's validation accepts
/// ([`ApiVersion::check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiVersion(pub String);

impl Default for ApiVersion {
    fn default() -> Self {
        ApiVersion(API_VERSION.to_owned())
    }
}

impl ApiVersion {
    /// Records an error unless this is the version this build understands.
    pub(crate) fn check(&self, errors: &mut super::error::Errors) {
        if self.0 != API_VERSION {
            errors.push(
                "apiVersion",
                format!("unsupported {:?}, expected {API_VERSION:?}", self.0),
            );
        }
    }
}

impl Text for ApiVersion {
    fn from_text(text: &str) -> Result<Self, String> {
        Ok(ApiVersion(text.to_owned()))
    }
    fn stand_in() -> Self {
        ApiVersion::default()
    }
}

/// A duration such as `500ms`, `5s`, `1m30s` ([`parse_duration`]), zero included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Span(pub Duration);

impl Text for Span {
    fn from_text(text: &str) -> Result<Self, String> {
        parse_duration(text).map(Span)
    }
    fn stand_in() -> Self {
        Span(Duration::ZERO)
    }
}

/// A duration greater than zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Positive(pub Duration);

impl Positive {
    /// `secs` seconds, for defaults.
    pub const fn secs(secs: u64) -> Positive {
        Positive(Duration::from_secs(secs))
    }
}

/// `S` seconds: a default (`#[serde(default = "secs::<10>")]`).
pub(crate) fn secs<const S: u64>() -> Duration {
    Duration::from_secs(S)
}

impl Text for Positive {
    fn from_text(text: &str) -> Result<Self, String> {
        match parse_duration(text)? {
            d if d.is_zero() => Err("must be greater than 0".into()),
            d => Ok(Positive(d)),
        }
    }
    fn stand_in() -> Self {
        Positive::secs(1)
    }
}

/// `IP:port`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Address(pub SocketAddr);

impl Text for Address {
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse()
            .map(Address)
            .map_err(|_| format!("expected IP:port, got {text:?}"))
    }
    fn stand_in() -> Self {
        Address(SocketAddr::from(([0, 0, 0, 0], 0)))
    }
}

/// An IP address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ip(pub IpAddr);

impl Text for Ip {
    fn from_text(text: &str) -> Result<Self, String> {
        text.parse()
            .map(Ip)
            .map_err(|_| format!("expected an IP address, got {text:?}"))
    }
    fn stand_in() -> Self {
        Ip(IpAddr::from([0, 0, 0, 0]))
    }
}

/// An HTTP header name (a token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderName(pub String);

impl HeaderName {
    /// `X-Gardener-Destination`, the default CONNECT destination header.
    pub fn destination() -> HeaderName {
        HeaderName(DEFAULT_DESTINATION_HEADER.to_owned())
    }
}

/// The default CONNECT destination header.
pub const DEFAULT_DESTINATION_HEADER: &str = "X-Gardener-Destination";

impl Text for HeaderName {
    fn from_text(text: &str) -> Result<Self, String> {
        let token = !text.is_empty()
            && text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
        if token {
            Ok(HeaderName(text.to_owned()))
        } else {
            Err(format!("invalid header name {text:?}"))
        }
    }
    fn stand_in() -> Self {
        HeaderName::destination()
    }
}

/// A CONNECT destination header value: 1 to 1024 bytes, no control characters or spaces.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Destination(pub String);

impl Destination {
    /// Whether `d` can be a destination header value.
    pub fn valid(d: &str) -> bool {
        !d.is_empty() && d.len() <= 1024 && !d.bytes().any(|b| b.is_ascii_control() || b == b' ')
    }
}

impl Text for Destination {
    fn from_text(text: &str) -> Result<Self, String> {
        if Destination::valid(text) {
            Ok(Destination(text.to_owned()))
        } else {
            Err(format!("invalid destination {text:?}"))
        }
    }
    fn stand_in() -> Self {
        Destination("-".into())
    }
}

/// A file name, not empty (a relative one is made relative to the file that names it by the
/// kind's validation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilePath(pub PathBuf);

impl Text for FilePath {
    fn from_text(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            Err("must not be empty".into())
        } else {
            Ok(FilePath(text.into()))
        }
    }
    fn stand_in() -> Self {
        FilePath(PathBuf::new())
    }
}

/// A whole number from `MIN` to `MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count<const MIN: usize, const MAX: usize>(pub usize);

impl<'de, const MIN: usize, const MAX: usize> serde::Deserialize<'de> for Count<MIN, MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Scalar<const MIN: usize, const MAX: usize>;
        impl<'de, const MIN: usize, const MAX: usize> Visitor<'de> for Scalar<MIN, MAX> {
            type Value = Count<MIN, MAX>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a whole number")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Count(MIN))
            }
            fn visit_newtype_struct<D: Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<Self::Value, D::Error> {
                // Whatever the scalar is (a quoted number is text): the visitor says what fits.
                let v = d.deserialize_any(Whole)?;
                match usize::try_from(v) {
                    Ok(n) if (MIN..=MAX).contains(&n) => Ok(Count(n)),
                    _ => Err(refuse(format_args!("{v} is out of range {MIN}..={MAX}"))),
                }
            }
        }
        d.deserialize_newtype_struct(recover::SCALAR, Scalar::<MIN, MAX>)
    }
}

/// A whole number, said so in errors (serde's own message names the Rust type, `u64`).
struct Whole;

impl Visitor<'_> for Whole {
    type Value = u64;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a whole number")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v)
            .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &"a whole number from 0"))
    }
}

newtype!(
    Span(Duration),
    Positive(Duration),
    Address(SocketAddr),
    Ip(IpAddr),
    HeaderName(String),
    Destination(String),
    FilePath(PathBuf),
);

impl<const MIN: usize, const MAX: usize> Plain for Count<MIN, MAX> {
    type Inner = usize;
    fn into_inner(self) -> usize {
        self.0
    }
}

impl<'de> serde::Deserialize<'de> for NetSet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<Net>::deserialize(d).map(|nets| nets.into_iter().collect())
    }
}

impl Text for Net {
    fn from_text(text: &str) -> Result<Self, String> {
        Net::parse(text).map_err(|e| e.to_string())
    }
    fn stand_in() -> Self {
        Net::ANY_V4
    }
}

impl Text for WgKey {
    fn from_text(text: &str) -> Result<Self, String> {
        WgKey::from_base64(text).map_err(|e| e.to_string())
    }
    fn stand_in() -> Self {
        WgKey([0; 32])
    }
}

impl Text for BackendAddress {
    fn from_text(text: &str) -> Result<Self, String> {
        BackendAddress::parse(text).map_err(|e| format!("{e}: {text:?}"))
    }
    fn stand_in() -> Self {
        BackendAddress::Ip(SocketAddr::from(([0, 0, 0, 0], 0)))
    }
}

impl Text for ProxyVersion {
    fn from_text(text: &str) -> Result<Self, String> {
        ProxyVersion::parse(text).ok_or_else(|| format!("expected v1 or v2, got {text:?}"))
    }
    fn stand_in() -> Self {
        ProxyVersion::V2
    }
}

text_values!(
    ApiVersion,
    Span,
    Positive,
    Address,
    Ip,
    HeaderName,
    Destination,
    FilePath,
    Net,
    WgKey,
    BackendAddress,
    ProxyVersion,
);

/// Writes a duration the way [`parse_duration`] reads it back: `90s`, `1500ms`, `250us`.
pub fn duration_text(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d.subsec_nanos().is_multiple_of(1_000_000) {
        format!("{}ms", d.as_millis())
    } else if d.subsec_nanos().is_multiple_of(1_000) {
        format!("{}us", d.as_micros())
    } else {
        format!("{}ns", d.as_nanos())
    }
}

/// Longest duration accepted anywhere (one year): larger values are typos and would
/// overflow deadline arithmetic.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// Parses a duration such as `500ms`, `5s`, `1m30s`, `1h`, `1.5s` (Go-style units
/// `ns`, `us`, `ms`, `s`, `m`, `h`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let err = || format!("invalid duration {s:?} (expected e.g. 500ms, 5s, 1m, 1h)");
    if s.is_empty() {
        return Err(err());
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(err)?;
        let (num, tail) = rest.split_at(num_len);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let value: f64 = num.parse().map_err(|_| err())?;
        let unit_secs = match unit {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(err()),
        };
        let part = Duration::try_from_secs_f64(value * unit_secs).map_err(|_| err())?;
        total = total
            .checked_add(part)
            .filter(|t| *t <= MAX_DURATION)
            .ok_or_else(|| format!("duration {s:?} is longer than 8760h"))?;
        rest = tail;
    }
    Ok(total)
}

impl serde::Serialize for ApiVersion {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}
