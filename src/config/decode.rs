//! One pass from file bytes to a kind's raw serde types.
//!
//! A file whose first non-blank character is `{` is JSON and goes through serde_json; every
//! other file goes through the YAML parser. Either way the document is decoded once, straight
//! into the raw types of the kind it names: `apiVersion` and `kind` are read first, and the
//! rest of the mapping is handed to that kind's derived decoder (a file that names its kind
//! after other fields is read a second time, as that kind). A parse or type error stops the
//! decode and is reported as `FILE:LINE:COL: field.path: message`; an unknown field does
//! not: it is collected with its path and reported with the validation errors, so that one
//! run shows every problem. This module never opens files.

use std::fmt;
use std::marker::PhantomData;
use std::path::Path;

use serde::de::value::{MapAccessDeserializer, StrDeserializer, StringDeserializer};
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_saphyr::MessageFormatter as _;

use super::{ConfigError, Derived, Errors, FieldError, agent, controller, gateway, node, routes};

/// The kinds of file this build reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `GatewayConfiguration`.
    Gateway,
    /// `RoutingTable`.
    Routes,
    /// `NodeConfiguration`.
    Node,
    /// `ControllerConfiguration`.
    Controller,
    /// `AgentConfiguration`.
    Agent,
}

impl Kind {
    /// Every kind, in the order error messages list them.
    pub(crate) const ALL: [Kind; 5] = [
        Kind::Gateway,
        Kind::Routes,
        Kind::Node,
        Kind::Controller,
        Kind::Agent,
    ];

    /// The `kind` as written in files.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Gateway => gateway::KIND,
            Kind::Routes => routes::KIND,
            Kind::Node => node::KIND,
            Kind::Controller => controller::KIND,
            Kind::Agent => agent::KIND,
        }
    }

    fn parse(kind: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == kind)
    }
}

/// A file's raw content, decoded as the kind it names.
pub(crate) enum Raw {
    /// `kind: GatewayConfiguration`.
    Gateway(gateway::RawGateway),
    /// `kind: RoutingTable`.
    Routes(routes::RawRoutingTable),
    /// `kind: NodeConfiguration`.
    Node(node::RawNode),
    /// `kind: ControllerConfiguration`.
    Controller(controller::RawController),
    /// `kind: AgentConfiguration`.
    Agent(agent::RawAgent),
}

impl Raw {
    /// The kind it was decoded as.
    pub(crate) fn kind(&self) -> Kind {
        match self {
            Raw::Gateway(_) => Kind::Gateway,
            Raw::Routes(_) => Kind::Routes,
            Raw::Node(_) => Kind::Node,
            Raw::Controller(_) => Kind::Controller,
            Raw::Agent(_) => Kind::Agent,
        }
    }
}

/// Decodes a file's bytes into the raw types of the kind it names. The returned [`Errors`]
/// hold the unknown fields found on the way; validation adds its own.
pub(crate) fn decode(file: &Path, bytes: &[u8]) -> Result<(Raw, Errors), ConfigError> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let (line, column) = position(&bytes[..e.valid_up_to()]);
        parse_error(file, String::new(), Some((line, column)), "not UTF-8 text")
    })?;
    let json = text.trim_start().starts_with('{');
    let (outcome, unknown) = run(file, text, json, Dispatch)?;
    let (raw, unknown) = match outcome {
        Outcome::Decoded(raw) => (*raw, unknown),
        // Only the second pass knew what to do with the fields before `kind`.
        Outcome::KindLate(Kind::Gateway) => {
            let (raw, unknown) = run(file, text, json, PhantomData)?;
            (Raw::Gateway(raw), unknown)
        }
        Outcome::KindLate(Kind::Routes) => {
            let (raw, unknown) = run(file, text, json, PhantomData)?;
            (Raw::Routes(raw), unknown)
        }
        Outcome::KindLate(Kind::Node) => {
            let (raw, unknown) = run(file, text, json, PhantomData)?;
            (Raw::Node(raw), unknown)
        }
        Outcome::KindLate(Kind::Controller) => {
            let (raw, unknown) = run(file, text, json, PhantomData)?;
            (Raw::Controller(raw), unknown)
        }
        Outcome::KindLate(Kind::Agent) => {
            let (raw, unknown) = run(file, text, json, PhantomData)?;
            (Raw::Agent(raw), unknown)
        }
        Outcome::UnknownKind(kind) => {
            let kinds: Vec<_> = Kind::ALL.iter().map(|k| k.as_str()).collect();
            return Err(super::invalid(
                file,
                "kind",
                format!("unknown kind {kind:?}, expected one of {kinds:?}"),
            ));
        }
        Outcome::NoKind => return Err(super::invalid(file, "kind", "missing")),
    };
    let mut errors = Errors::default();
    for (path, field) in unknown {
        errors.push(path, format!("unknown field `{field}`"));
    }
    Ok((raw, errors))
}

/// The error for a file of the wrong kind: `kind RoutingTable, but 'trellis gateway' needs a
/// GatewayConfiguration`.
pub(crate) fn wrong_kind(file: &Path, found: Kind, needed: Kind, by: &str) -> ConfigError {
    super::invalid(
        file,
        "",
        format!(
            "kind {}, but {by} needs {} {}",
            found.as_str(),
            if needed.as_str().starts_with(['A', 'E', 'I', 'O', 'U']) {
                "an"
            } else {
                "a"
            },
            needed.as_str()
        ),
    )
}

/// Runs `seed` over the whole document and lists the fields nothing read (unknown fields)
/// by their paths and names. A document that fails is run a second time with path tracking, to name
/// the field the error is in (the same decoder fails at the same place): tracking paths
/// costs a third of the decode of a 10,000-route JSON table, which valid files need not pay.
fn run<S, T>(
    file: &Path,
    text: &str,
    json: bool,
    seed: S,
) -> Result<(T, Vec<(String, String)>), ConfigError>
where
    S: Copy + for<'de> DeserializeSeed<'de, Value = T>,
{
    let mut unknown = Vec::new();
    let first = pass(
        text,
        json,
        seed,
        &mut |path| {
            let field = match &path {
                serde_ignored::Path::Map { key, .. } => key.clone(),
                _ => String::new(),
            };
            unknown.push((field_path(&path), field));
        },
        None,
    );
    let failure = match first {
        Ok(value) => return Ok((value, unknown)),
        Err(failure) => failure,
    };
    let mut track = serde_path_to_error::Track::new();
    let failure = match pass(text, json, seed, &mut |_| {}, Some(&mut track)) {
        Err(again) => again,
        Ok(_) => failure,
    };
    // Errors after the document itself (trailing characters, a second document) have no
    // field path.
    let path = if failure.in_document {
        error_path(track)
    } else {
        String::new()
    };
    Err(match &failure.error {
        ParseError::Json(e) => json_error(file, path, e),
        ParseError::Yaml(e) => yaml_error(file, path, text, e),
    })
}

/// Why a pass over the document failed.
struct Failure {
    error: ParseError,
    /// Inside the document, where a field path means something.
    in_document: bool,
}

enum ParseError {
    Json(serde_json::Error),
    Yaml(serde_saphyr::Error),
}

/// One decode of the whole document: serde_json or the YAML parser, reporting unread fields
/// to `on_ignored`, and tracking field paths for errors when `track` is given.
fn pass<S, T, F>(
    text: &str,
    json: bool,
    seed: S,
    on_ignored: &mut F,
    track: Option<&mut serde_path_to_error::Track>,
) -> Result<T, Failure>
where
    S: for<'de> DeserializeSeed<'de, Value = T>,
    F: FnMut(serde_ignored::Path<'_>),
{
    if json {
        let mut de = serde_json::Deserializer::from_str(text);
        let value = run_seed(&mut de, seed, on_ignored, track).map_err(|e| Failure {
            error: ParseError::Json(e),
            in_document: true,
        })?;
        // Trailing characters after the document.
        de.end().map_err(|e| Failure {
            error: ParseError::Json(e),
            in_document: false,
        })?;
        Ok(value)
    } else {
        let mut in_document = false;
        serde_saphyr::with_deserializer_from_str_with_options(text, super::yaml_options(), |de| {
            let value = run_seed(de, seed, on_ignored, track);
            in_document = value.is_err();
            value
        })
        .map_err(|e| Failure {
            error: ParseError::Yaml(e),
            in_document,
        })
    }
}

fn run_seed<'de, D, S, F>(
    de: D,
    seed: S,
    on_ignored: &mut F,
    track: Option<&mut serde_path_to_error::Track>,
) -> Result<S::Value, D::Error>
where
    D: Deserializer<'de>,
    S: DeserializeSeed<'de>,
    F: FnMut(serde_ignored::Path<'_>),
{
    let de = serde_ignored::Deserializer::new(de, on_ignored);
    match track {
        Some(track) => seed.deserialize(serde_path_to_error::Deserializer::new(de, track)),
        None => seed.deserialize(de),
    }
}

/// A serde_path_to_error path as the validation errors write it: `routes[0].backends`, empty
/// for the document itself. A key that could not be read (`?`) is left out: the error is
/// about the mapping that holds it.
fn error_path(track: serde_path_to_error::Track) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in &track.path() {
        match segment {
            Segment::Seq { index } => out += &format!("[{index}]"),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out += key;
            }
            Segment::Unknown => {}
        }
    }
    out
}

/// A serde_ignored path in the same form.
fn field_path(path: &serde_ignored::Path<'_>) -> String {
    use serde_ignored::Path as P;
    match path {
        P::Root => String::new(),
        P::Seq { parent, index } => format!("{}[{index}]", field_path(parent)),
        P::Map { parent, key } => {
            let parent = field_path(parent);
            if parent.is_empty() {
                key.clone()
            } else {
                format!("{parent}.{key}")
            }
        }
        P::Some { parent } | P::NewtypeStruct { parent } | P::NewtypeVariant { parent } => {
            field_path(parent)
        }
    }
}

fn parse_error(
    file: &Path,
    path: String,
    position: Option<(u64, u64)>,
    message: impl fmt::Display,
) -> ConfigError {
    ConfigError::Invalid {
        file: file.to_owned(),
        errors: vec![FieldError {
            path,
            message: one_line(&message.to_string()),
            position,
        }],
    }
}

/// serde_json's message without its ` at line L column C` (the position goes in front).
fn json_error(file: &Path, path: String, e: &serde_json::Error) -> ConfigError {
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let message = text.strip_suffix(&suffix).unwrap_or(&text);
    let position = (e.line() > 0).then(|| (e.line() as u64, e.column() as u64));
    let message = match e.classify() {
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
            format!("{message} (a file that starts with '{{' is read as JSON)")
        }
        _ => message.to_owned(),
    };
    parse_error(file, path, position, message)
}

/// The YAML parser's message in the words it has for users (no source snippet, no advice
/// about its API), with a count for a file of several documents.
fn yaml_error(file: &Path, path: String, text: &str, e: &serde_saphyr::Error) -> ConfigError {
    let position = e
        .location()
        .filter(|l| l.line() > 0)
        .map(|l| (l.line(), l.column()));
    let message = match e.without_snippet() {
        serde_saphyr::Error::MultipleDocuments { .. } => {
            let documents =
                serde_saphyr::from_multiple_with_options::<IgnoredAny>(text, super::yaml_options())
                    .map_or(0, |d| d.len());
            if documents > 1 {
                format!("the file holds {documents} YAML documents; trellis reads one per file")
            } else {
                "the file holds more than one YAML document; trellis reads one per file".into()
            }
        }
        // The parser's words for a value of the wrong shape.
        serde_saphyr::Error::Unexpected { expected, .. } => match *expected {
            "string scalar" => "expected a string".into(),
            "sequence start" => "expected a sequence".into(),
            "mapping start" => "expected a mapping".into(),
            other => format!("expected {other}"),
        },
        e => serde_saphyr::UserMessageFormatter
            .format_message(e)
            .into_owned(),
    };
    parse_error(file, path, position, message)
}

/// Line breaks and runs of blanks in a parser's message become one space.
fn one_line(message: &str) -> String {
    message.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// 1-based line and column of the end of `bytes`.
fn position(bytes: &[u8]) -> (u64, u64) {
    let line = bytes.iter().filter(|&&b| b == b'\n').count() + 1;
    let column = bytes.len() - bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) + 1;
    (line as u64, column as u64)
}

/// What the first pass found.
enum Outcome {
    /// `kind` came before any other field: the file is decoded.
    Decoded(Box<Raw>),
    /// `kind` came after other fields, which were skipped: decode again as this kind.
    KindLate(Kind),
    /// A kind this build does not know.
    UnknownKind(String),
    /// No `kind` at all.
    NoKind,
}

/// Reads `apiVersion` and `kind`, then hands the rest of the mapping, with those two
/// replayed in front, to the derived decoder of the kind.
#[derive(Clone, Copy)]
struct Dispatch;

impl<'de> DeserializeSeed<'de> for Dispatch {
    type Value = Outcome;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Outcome, D::Error> {
        // Not `deserialize_map`: the YAML parser would refuse anything else with its own
        // words ("expected mapping start") instead of the visitor's.
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Dispatch {
    type Value = Outcome;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a mapping with apiVersion and kind")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Outcome, A::Error> {
        // `apiVersion` and `kind` as read, in file order.
        let mut head: Vec<(&'static str, String)> = Vec::with_capacity(2);
        let kind = |head: &[(&str, String)]| {
            head.iter()
                .find(|(k, _)| *k == "kind")
                .map(|(_, v)| v.clone())
        };
        let mut skipped = false;
        while let Some(key) = map.next_key::<String>()? {
            let field = match key.as_str() {
                "apiVersion" => Some("apiVersion"),
                "kind" => Some("kind"),
                _ => None,
            };
            if let Some(field) = field
                && !head.iter().any(|(k, _)| *k == field)
            {
                head.push((field, map.next_value()?));
                continue;
            }
            match kind(&head).as_deref().map(|k| (k, Kind::parse(k))) {
                Some((_, Some(kind))) if !skipped => {
                    let rest = Prefixed {
                        head: head.into_iter(),
                        value: None,
                        pending: Some(key),
                        map,
                    };
                    return Ok(Outcome::Decoded(Box::new(decode_rest(kind, rest)?)));
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    skipped = true;
                }
            }
        }
        Ok(match kind(&head) {
            None => Outcome::NoKind,
            Some(k) => match Kind::parse(&k) {
                None => Outcome::UnknownKind(k),
                Some(kind) if skipped => Outcome::KindLate(kind),
                // Nothing but the head: the derived decoder reports the missing fields.
                Some(kind) => Outcome::Decoded(Box::new(decode_rest(
                    kind,
                    Prefixed {
                        head: head.into_iter(),
                        value: None,
                        pending: None,
                        map,
                    },
                )?)),
            },
        })
    }
}

fn decode_rest<'de, A: MapAccess<'de>>(kind: Kind, rest: Prefixed<A>) -> Result<Raw, A::Error> {
    let d = MapAccessDeserializer::new(rest);
    Ok(match kind {
        Kind::Gateway => Raw::Gateway(Derived::derived(d)?),
        Kind::Routes => Raw::Routes(Derived::derived(d)?),
        Kind::Node => Raw::Node(Derived::derived(d)?),
        Kind::Controller => Raw::Controller(Derived::derived(d)?),
        Kind::Agent => Raw::Agent(Derived::derived(d)?),
    })
}

/// A mapping whose first entries were already read: they are replayed, then the key read
/// last, then the rest of the mapping.
struct Prefixed<A> {
    head: std::vec::IntoIter<(&'static str, String)>,
    /// The value of the head entry whose key was handed out last.
    value: Option<String>,
    /// A key read from `map` whose value is still there.
    pending: Option<String>,
    map: A,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Prefixed<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        if let Some((key, value)) = self.head.next() {
            self.value = Some(value);
            return seed.deserialize(StrDeserializer::new(key)).map(Some);
        }
        if let Some(key) = self.pending.take() {
            return seed.deserialize(StringDeserializer::new(key)).map(Some);
        }
        self.map.next_key_seed(seed)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        match self.value.take() {
            Some(value) => seed.deserialize(StringDeserializer::new(value)),
            None => self.map.next_value_seed(seed),
        }
    }
}

/// For `#[serde(default, deserialize_with = "...")]` on an `Option<u64>` field: a whole
/// number, said so in errors (serde's own message names the Rust type, `u64`).
pub(crate) fn whole_number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    struct Whole;
    impl Visitor<'_> for Whole {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a whole number")
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| {
                E::invalid_value(serde::de::Unexpected::Signed(v), &"a whole number from 0")
            })
        }
    }
    struct Optional;
    impl<'de> Visitor<'de> for Optional {
        type Value = Option<u64>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a whole number")
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Option<u64>, E> {
            Ok(None)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Option<u64>, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<u64>, D::Error> {
            // Whatever the scalar is (a quoted number is text): the visitor says what fits.
            d.deserialize_any(Whole).map(Some)
        }
    }
    d.deserialize_option(Optional)
}
