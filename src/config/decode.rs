//! One pass from file bytes to a kind's raw serde types.
//!
//! A file whose first non-blank character is `{` is JSON and goes through serde_json; every
//! other file goes through the YAML parser. Either way the document is decoded once, straight
//! into the raw types of the kind it names: `apiVersion` and `kind` are read first, and the
//! rest of the mapping is handed to that kind's derived decoder (a file that names its kind
//! after other fields is read a second time, as that kind). An unknown field does not stop
//! the decode: it is collected with its path. Neither does a type error or a missing field:
//! the file is decoded again, past it ([`recover`]: the wrong value replaced by a stand-in, a
//! missing field added), until the whole document is read or [`recover::MAX_FIXES`] are
//! made, so that one run shows every problem: type errors, unknown fields, and what
//! validation then finds (except at the stand-ins). An unknown field is told the known
//! field of its structure it is closest to, when one is close ([`suggestion`]): every
//! structure is decoded through [`MappingOnly`], which makes its fields known meanwhile. Every problem is reported as
//! `FILE:LINE:COL: field.path: message`; those found after the parser ([`located`]) are
//! pointed at by reading the text again. A parse error (YAML or JSON syntax, a second
//! document) stops the file: what follows it cannot be read. A valid file is decoded once,
//! as before: recovery and locating cost only files with problems. This module never opens
//! files.

use std::cell::RefCell;
use std::fmt;
use std::marker::PhantomData;
use std::path::Path;

use serde::de::value::{MapAccessDeserializer, StrDeserializer, StringDeserializer};
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_saphyr::MessageFormatter as _;

use super::error::{ConfigError, Errors, FieldError};
use super::recover::{self, Plan};
use super::{locate, value};

/// Implements `Deserialize` for structures whose derive is `#[serde(remote = "Self")]`, so
/// that they take a mapping and nothing else. serde's derived structs also take a sequence
/// of their fields' values in declaration order, which would make `timeouts: [5s, 1h]` mean
/// `connect: 5s, idle: 1h`. A type listed here must derive `Deserialize` with
/// `remote = "Self"`: without that inherent `deserialize`, the impl would call itself. It
/// asks for any value, not a mapping, so that both parsers leave the refusal to the visitor
/// ("invalid type: sequence, expected a mapping"): the YAML parser would refuse a sequence
/// with its own words otherwise.
///
/// The structures do not `deny_unknown_fields`: the decoder collects every field nothing
/// read and reports them with the other problems, instead of stopping at the first.
macro_rules! mapping_only {
    ($($ty:ident),* $(,)?) => {$(
        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_any($crate::config::decode::MappingOnly::<$ty>::new())
            }
        }
        impl<'de> $crate::config::decode::Derived<'de> for $ty {
            fn derived<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                $ty::deserialize(d)
            }
        }
    )*};
}

/// Implements `Serialize` for structures whose derive is `#[serde(remote = "Self")]` (see
/// [`mapping_only!`]): the derived serializer is an inherent function then, which the trait
/// impl calls. Used for the files trellis writes as well as reads (the routing table, which
/// the controller writes and `/routes` shows in the same shape).
macro_rules! serialize_derived {
    ($($ty:ident),* $(,)?) => {$(
        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                $ty::serialize(self, s)
            }
        }
    )*};
}

/// A structure's derived decoder (`#[serde(remote = "Self")]`), for [`mapping_only!`].
pub(crate) trait Derived<'de>: Sized {
    /// The derived `deserialize`, which would also take a sequence.
    fn derived<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error>;
}

/// Takes a mapping and hands it to `T`'s derived decoder; anything else is an error.
pub(crate) struct MappingOnly<T>(PhantomData<T>);

impl<T> MappingOnly<T> {
    pub(crate) fn new() -> Self {
        MappingOnly(PhantomData)
    }
}

impl<'de, T: Derived<'de>> Visitor<'de> for MappingOnly<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a mapping")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
        // An unknown field of the mapping is found while it is decoded: then `T`'s fields
        // are the innermost ones.
        let _inside = Inside::enter(fields_of::<'de, T>);
        T::derived(MapAccessDeserializer::new(map))
    }
}

/// The fields of a structure, found when an unknown field needs them.
type FieldsOf = fn() -> &'static [&'static str];

thread_local! {
    /// The structures being decoded on this thread, innermost last.
    static INSIDE: RefCell<Vec<FieldsOf>> = const { RefCell::new(Vec::new()) };
}

/// A structure being decoded, from [`Inside::enter`] until dropped (also when its decode
/// fails or unwinds).
struct Inside;

impl Inside {
    fn enter(fields: FieldsOf) -> Inside {
        INSIDE.with_borrow_mut(|inside| inside.push(fields));
        Inside
    }

    /// The fields of the innermost structure being decoded.
    fn fields() -> &'static [&'static str] {
        INSIDE
            .with_borrow(|inside| inside.last().copied())
            .map_or(&[], |fields| fields())
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.with_borrow_mut(|inside| inside.pop());
    }
}

/// The fields `T`'s derived decoder knows (their names as written in files, without those
/// it never reads): what it asks its deserializer for, which here answers nothing else.
fn fields_of<'de, T: Derived<'de>>() -> &'static [&'static str] {
    struct Probe<'a>(&'a std::cell::Cell<&'static [&'static str]>);
    impl<'de> Deserializer<'de> for Probe<'_> {
        type Error = serde::de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(serde::de::Error::custom("fields only"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            self.0.set(fields);
            Err(serde::de::Error::custom("fields only"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let fields = std::cell::Cell::new(&[][..]);
    let _ = T::derived(Probe(&fields));
    fields.get()
}

/// The known field an unknown one is most likely a typo of: the closest of `known` by edit
/// distance (insertions, deletions, substitutions and swaps of two neighbours, letter case
/// ignored), when it is close: at most 2 edits, and at most one per three letters of the
/// known name (`x` is no typo of `via`). A difference in letter case only is always one.
/// The first of equally close names wins.
fn suggestion<'k>(unknown: &str, known: &[&'k str]) -> Option<&'k str> {
    let lower: Vec<char> = unknown.chars().flat_map(char::to_lowercase).collect();
    known
        .iter()
        .filter_map(|&k| {
            let name: Vec<char> = k.chars().flat_map(char::to_lowercase).collect();
            let d = distance(&lower, &name);
            (d <= 2 && d * 3 <= name.len()).then_some((d, k))
        })
        .min_by_key(|&(d, _)| d)
        .map(|(_, k)| k)
}

/// The optimal string alignment distance of `a` and `b`: insertions, deletions,
/// substitutions and transpositions of adjacent characters, each one edit.
fn distance(a: &[char], b: &[char]) -> usize {
    // Three rows of the matrix: two back, one back, this one.
    let mut before: Vec<usize> = vec![0; b.len() + 1];
    let mut last: Vec<usize> = (0..=b.len()).collect();
    let mut row: Vec<usize> = vec![0; b.len() + 1];
    for i in 1..=a.len() {
        row[0] = i;
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut d = (last[j] + 1).min(row[j - 1] + 1).min(last[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d = d.min(before[j - 2] + 1);
            }
            row[j] = d;
        }
        std::mem::swap(&mut before, &mut last);
        std::mem::swap(&mut last, &mut row);
    }
    last[b.len()]
}

/// Largest config or routing file we read (a 10,000-route table is ~2 MB).
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// The kinds a decode accepts: one kind for a process reading its file, every kind for
/// `trellis check`. The decoder reads `apiVersion` and `kind` and hands the rest of the
/// document to the kind named.
pub(crate) trait Kinds: Sized {
    /// The kinds, as written in files, in the order error messages list them.
    fn names() -> Vec<&'static str>;
    /// Decodes the document as `kind`, one of [`Kinds::names`].
    fn decode<'de, D: Deserializer<'de>>(kind: &str, d: D) -> Result<Self, D::Error>;
    /// The error for a file of `kind`, none of [`Kinds::names`]; `None`: the kind is
    /// reported as unknown, at its path.
    fn other(_file: &Path, _kind: &str) -> Option<ConfigError> {
        None
    }
}

/// How far decoding goes past type errors and missing fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// Past up to [`recover::MAX_FIXES`] of them (one more decode each), so that one run
    /// reports them all: `trellis check`, and loading a file at start.
    All,
    /// Not past the first: a running gateway's table reload, where each further decode of a
    /// large table would hold up its control thread (signals, drain, certificate reloads).
    /// The error says that `trellis check` lists the rest.
    First,
}

/// Decodes a file's bytes as one of the kinds `S` accepts, going past type errors as far as
/// `recovery` says. The returned [`Errors`] hold the unknown fields found on the way;
/// validation adds its own.
pub(crate) fn decode<S: Kinds>(
    file: &Path,
    bytes: &[u8],
    recovery: Recovery,
) -> Result<(S, Errors), ConfigError> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let (line, column) = position(&bytes[..e.valid_up_to()]);
        parse_error(file, String::new(), Some((line, column)), "not UTF-8 text")
    })?;
    let json = text.trim_start().starts_with('{');
    let (outcome, found) = run(file, text, json, Dispatch::<S>(PhantomData), recovery)?;
    let (decoded, found) = match outcome {
        Outcome::Decoded(decoded) => (decoded, found),
        // Only the second pass knew what to do with the fields before `kind`.
        Outcome::KindLate(kind) => run(file, text, json, Late::<S>(&kind, PhantomData), recovery)?,
        Outcome::Other(kind) => {
            // A `kind` of the wrong type was decoded as a stand-in: that is the problem.
            if !found.plan.shadows("kind")
                && let Some(e) = S::other(file, &kind)
            {
                return Err(e);
            }
            let message = format!("unknown kind {kind:?}, expected one of {:?}", S::names());
            return Err(kindless(file, found, message));
        }
        Outcome::NoKind => return Err(kindless(file, found, "missing")),
    };
    let mut unknown: Vec<FieldError> = found
        .unknown
        .into_iter()
        .map(|Unknown { path, field, like }| match like {
            Some(like) => field_error(
                path,
                None,
                format_args!("unknown field `{field}`: did you mean `{like}`?"),
            ),
            None => field_error(path, None, format_args!("unknown field `{field}`")),
        })
        .collect();
    if !unknown.is_empty() {
        // An unknown field is pointed at by its key.
        locate::locate(text, &mut unknown, locate::Anchor::Key);
    }
    let errors = Errors::found(found.wrong, unknown, found.plan.shadowed().collect());
    Ok((decoded, errors))
}

/// The `kind` a document names at its top (`None`: none, or not text), read without decoding
/// the rest: the read stops there. `trellis check` decodes a file as the kind it names with
/// that kind's own decoder, the one its process uses (one decoder per kind in the binary,
/// not a second one that knows every kind).
pub(crate) fn kind_of(bytes: &[u8]) -> Option<String> {
    struct Seek<'a>(&'a RefCell<Option<String>>);
    impl<'de> DeserializeSeed<'de> for Seek<'_> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> Visitor<'de> for Seek<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a mapping")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some(key) = map.next_key::<String>()? {
                if key == "kind" {
                    *self.0.borrow_mut() = map.next_value::<String>().ok();
                    // What follows is not needed: stop the parser here.
                    return Err(serde::de::Error::custom("kind read"));
                }
                map.next_value::<IgnoredAny>()?;
            }
            Ok(())
        }
    }
    let text = std::str::from_utf8(bytes).ok()?;
    let found = RefCell::new(None);
    if text.trim_start().starts_with('{') {
        let mut de = serde_json::Deserializer::from_str(text);
        let _ = Seek(&found).deserialize(&mut de);
    } else {
        let _ = serde_saphyr::with_deserializer_from_str_with_options(text, yaml_options(), |de| {
            Seek(&found).deserialize(de)
        });
    }
    found.into_inner()
}

/// The error for a file whose kind is not known: the type errors found on the way, and
/// `message` about `kind` unless its value was one of them.
fn kindless(file: &Path, found: Found, message: impl fmt::Display) -> ConfigError {
    let mut errors = found.wrong;
    if !found.plan.shadows("kind") {
        errors.push(field_error("kind".into(), None, message));
    }
    ConfigError::Invalid {
        file: file.to_owned(),
        errors,
    }
}

/// `result`, with each of its problems in `file` that has no position pointed at the value
/// its path names in `bytes` (or the nearest value around it that the file has), and the
/// problems in the order of the file.
pub(crate) fn located<T>(
    file: &Path,
    bytes: &[u8],
    result: Result<T, ConfigError>,
) -> Result<T, ConfigError> {
    match result {
        Err(ConfigError::Invalid {
            file: f,
            mut errors,
        }) if f == file => {
            if let Ok(text) = std::str::from_utf8(bytes)
                && errors.iter().any(|e| e.position.is_none())
            {
                locate::locate(text, &mut errors, locate::Anchor::Value);
            }
            // In file order; problems about the whole file last.
            errors.sort_by_key(|e| e.position.map_or((u64::MAX, 0), |p| p));
            Err(ConfigError::Invalid { file: f, errors })
        }
        other => other,
    }
}

/// A field nothing read.
pub(crate) struct Unknown {
    /// Its path.
    pub(crate) path: String,
    /// Its name.
    pub(crate) field: String,
    /// The known field of its structure it is close to ([`suggestion`]).
    pub(crate) like: Option<&'static str>,
}

/// What a decode found besides the value.
pub(crate) struct Found {
    /// Fields nothing read.
    pub(crate) unknown: Vec<Unknown>,
    /// Type errors, each with its path and position, in the order found.
    pub(crate) wrong: Vec<FieldError>,
    /// What was decoded in place of the wrong values: paths whose later problems are
    /// consequences of the ones in `wrong`.
    pub(crate) plan: Plan,
}

/// Runs `seed` over the whole document and lists the fields nothing read (unknown fields)
/// by their paths and names. A document that fails is decoded again with [`recover`]'s
/// wrapper, which names the field the error is in (the same decoder fails at the same
/// place) and decodes on past it, once per type error, until the whole document is read:
/// tracking paths costs a third of the decode of a 10,000-route JSON table, which valid
/// files need not pay. A parse error (YAML or JSON syntax, a second document) stops the
/// file: what follows it cannot be read.
fn run<S, T>(
    file: &Path,
    text: &str,
    json: bool,
    seed: S,
    recovery: Recovery,
) -> Result<(T, Found), ConfigError>
where
    S: Copy + for<'de> DeserializeSeed<'de, Value = T>,
{
    let mut unknown = Vec::new();
    let first = pass(text, json, seed, &mut collect(&mut unknown), None);
    if let Ok(value) = first {
        let found = Found {
            unknown,
            wrong: Vec::new(),
            plan: Plan::default(),
        };
        return Ok((value, found));
    }
    let mut plan = Plan::default();
    let mut wrong: Vec<FieldError> = Vec::new();
    loop {
        let mut unknown = Vec::new();
        let track = recover::Track::new(plan);
        let result = pass(text, json, seed, &mut collect(&mut unknown), Some(&track));
        let failed_at;
        (plan, failed_at) = track.into_inner().finish();
        let failure = match result {
            Ok(value) => {
                let found = Found {
                    unknown,
                    wrong,
                    plan,
                };
                return Ok((value, found));
            }
            Err(failure) => failure,
        };
        // Errors after the document itself (trailing characters, a second document) have
        // no field path.
        let path = match failed_at {
            Some(path) if failure.in_document => path,
            _ => String::new(),
        };
        let mut error = match &failure.error {
            ParseError::Json(e) => json_error(path, e),
            ParseError::Yaml(e) => yaml_error(path, text, e),
        };
        // A value its type refused is pointed at as the problems found after the parser
        // are: at the value, not where the parser stopped.
        let refused = error.message.starts_with(value::REFUSED);
        if refused {
            error.message.remove(0);
            error.position = None;
        }
        let fix = fix(&failure);
        // An error in a stand-in, or a field a stand-in lacks, is one the file does not have;
        // an error found again (a parse error, where a stand-in could not help) is one
        // already reported.
        let again = wrong.iter().any(|e| {
            e.path == error.path && e.position == error.position && e.message == error.message
        });
        let consequence = again || plan.shadows(&error.path);
        if !consequence {
            wrong.push(error.clone());
        }
        let most = match recovery {
            Recovery::All => recover::MAX_FIXES,
            Recovery::First => 0,
        };
        let room = plan.fixes() < most;
        let fixed = room
            && match fix {
                Fix::Add(field) => plan.insert(&error.path, &field),
                Fix::StandIn if !error.path.is_empty() && !consequence => {
                    plan.stand_in(&error.path, refused)
                }
                Fix::StandIn | Fix::Stop => false,
            };
        if !fixed {
            if !room {
                let message = match recovery {
                    Recovery::All => format!(
                        "stopped after {} type errors and missing fields; fix these and check again",
                        recover::MAX_FIXES
                    ),
                    Recovery::First => {
                        "stopped at the first type error or missing field; `trellis check` lists every problem".to_string()
                    }
                };
                wrong.push(FieldError {
                    path: String::new(),
                    message,
                    position: None,
                });
            }
            return Err(ConfigError::Invalid {
                file: file.to_owned(),
                errors: wrong,
            });
        }
    }
}

/// Records a field nothing read by its path and name, and the known field of the structure
/// being decoded (the one it is in) it is close to.
fn collect(unknown: &mut Vec<Unknown>) -> impl FnMut(serde_ignored::Path<'_>) + '_ {
    |path| {
        let field = match &path {
            serde_ignored::Path::Map { key, .. } => key.clone(),
            _ => String::new(),
        };
        let like = suggestion(&field, Inside::fields());
        unknown.push(Unknown {
            path: field_path(&path),
            field,
            like,
        });
    }
}

/// How a failed pass lets the next one go on.
enum Fix {
    /// A required field was missing: the next pass adds it to the mapping at the error's
    /// path.
    Add(String),
    /// A value of the wrong type or shape: the next pass decodes a stand-in in its place.
    StandIn,
    /// A parse error, or one outside the document: nothing after it can be read.
    Stop,
}

/// What the next pass does about `failure`.
fn fix(failure: &Failure) -> Fix {
    use serde_saphyr::Error as Y;
    if !failure.in_document {
        return Fix::Stop;
    }
    match &failure.error {
        ParseError::Json(e) => match e.classify() {
            serde_json::error::Category::Data => {
                let text = e.to_string();
                match text
                    .strip_prefix("missing field `")
                    .and_then(|rest| rest.split_once('`'))
                {
                    Some((field, _)) => Fix::Add(field.to_owned()),
                    None => Fix::StandIn,
                }
            }
            _ => Fix::Stop,
        },
        ParseError::Yaml(e) => match original(e) {
            Y::SerdeMissingField { field, .. } => Fix::Add((*field).to_owned()),
            Y::SerdeInvalidType { .. }
            | Y::SerdeInvalidValue { .. }
            | Y::SerdeInvalidLength { .. }
            | Y::SerdeUnknownVariant { .. }
            | Y::Message { .. }
            | Y::Unexpected { .. }
            | Y::InvalidScalar { .. }
            | Y::InvalidBooleanStrict { .. }
            | Y::NullIntoString { .. }
            | Y::NonFiniteFloat { .. }
            | Y::InvalidCharNull { .. }
            | Y::InvalidCharNotSingleScalar { .. }
            | Y::TaggedScalarCannotDeserializeIntoString { .. }
            | Y::BytesNotSupportedMissingBinaryTag { .. }
            | Y::UnexpectedValueForUnit { .. }
            | Y::ExpectedEmptyMappingForUnitStruct { .. }
            | Y::QuotingRequired { .. } => Fix::StandIn,
            _ => Fix::Stop,
        },
    }
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
/// to `on_ignored`, and tracking field paths and following a plan when `track` is given.
fn pass<S, T, F>(
    text: &str,
    json: bool,
    seed: S,
    on_ignored: &mut F,
    track: Option<&RefCell<recover::Track>>,
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
        serde_saphyr::with_deserializer_from_str_with_options(text, yaml_options(), |de| {
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
    track: Option<&RefCell<recover::Track>>,
) -> Result<S::Value, D::Error>
where
    D: Deserializer<'de>,
    S: DeserializeSeed<'de>,
    F: FnMut(serde_ignored::Path<'_>),
{
    match track {
        Some(track) => seed.deserialize(serde_ignored::Deserializer::new(
            recover::Value::new(de, track),
            on_ignored,
        )),
        None => seed.deserialize(serde_ignored::Deserializer::new(de, on_ignored)),
    }
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
        errors: vec![field_error(path, position, message)],
    }
}

fn field_error(
    path: String,
    position: Option<(u64, u64)>,
    message: impl fmt::Display,
) -> FieldError {
    FieldError {
        path,
        message: one_line(&message.to_string()),
        position,
    }
}

/// serde_json's message without its ` at line L column C` (the position goes in front).
fn json_error(path: String, e: &serde_json::Error) -> FieldError {
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
    field_error(path, position, message)
}

/// The YAML parser's message in the words it has for users (no source snippet, no advice
/// about its API), with a count for a file of several documents.
fn yaml_error(path: String, text: &str, e: &serde_saphyr::Error) -> FieldError {
    let position = e
        .location()
        .filter(|l| l.line() > 0)
        .map(|l| (l.line(), l.column()));
    let message = match original(e) {
        serde_saphyr::Error::MultipleDocuments { .. } => {
            let documents =
                serde_saphyr::from_multiple_with_options::<IgnoredAny>(text, yaml_options())
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
            .format_message(original(e))
            .into_owned(),
    };
    field_error(path, position, message)
}

/// The error itself, inside the wrappers that say where an alias was used or add a snippet.
fn original(mut e: &serde_saphyr::Error) -> &serde_saphyr::Error {
    while let serde_saphyr::Error::AliasError { error, .. }
    | serde_saphyr::Error::WithSnippet { error, .. } = e
    {
        e = error;
    }
    e
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
enum Outcome<S> {
    /// `kind` came before any other field: the file is decoded.
    Decoded(S),
    /// `kind` came after other fields, which were skipped: decode again as this kind.
    KindLate(String),
    /// A kind none of `S`.
    Other(String),
    /// No `kind` at all.
    NoKind,
}

/// Reads `apiVersion` and `kind`, then hands the rest of the mapping, with those two
/// replayed in front, to the decoder of the kind.
struct Dispatch<S>(PhantomData<S>);

impl<S> Clone for Dispatch<S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S> Copy for Dispatch<S> {}

impl<'de, S: Kinds> DeserializeSeed<'de> for Dispatch<S> {
    type Value = Outcome<S>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Outcome<S>, D::Error> {
        // Not `deserialize_map`: the YAML parser would refuse anything else with its own
        // words ("expected mapping start") instead of the visitor's.
        d.deserialize_any(self)
    }
}

impl<'de, S: Kinds> Visitor<'de> for Dispatch<S> {
    type Value = Outcome<S>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a mapping with apiVersion and kind")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Outcome<S>, A::Error> {
        // `apiVersion` and `kind` as read, in file order.
        let mut head: Vec<(&'static str, String)> = Vec::with_capacity(2);
        let kind = |head: &[(&str, String)]| {
            head.iter()
                .find(|(k, _)| *k == "kind")
                .map(|(_, v)| v.clone())
        };
        let known = |kind: &str| S::names().contains(&kind);
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
            match kind(&head) {
                Some(k) if known(&k) && !skipped => {
                    let rest = Prefixed {
                        head: head.into_iter(),
                        value: None,
                        pending: Some(key),
                        map,
                    };
                    return Ok(Outcome::Decoded(S::decode(
                        &k,
                        MapAccessDeserializer::new(rest),
                    )?));
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    skipped = true;
                }
            }
        }
        Ok(match kind(&head) {
            None => Outcome::NoKind,
            Some(k) if !known(&k) => Outcome::Other(k),
            Some(k) if skipped => Outcome::KindLate(k),
            // Nothing but the head: the kind's decoder reports the missing fields.
            Some(k) => {
                let rest = Prefixed {
                    head: head.into_iter(),
                    value: None,
                    pending: None,
                    map,
                };
                Outcome::Decoded(S::decode(&k, MapAccessDeserializer::new(rest))?)
            }
        })
    }
}

/// Decodes the whole document as `kind`, which it names after other fields.
struct Late<'k, S>(&'k str, PhantomData<S>);

impl<S> Clone for Late<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S> Copy for Late<'_, S> {}

impl<'de, S: Kinds> DeserializeSeed<'de> for Late<'_, S> {
    type Value = S;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<S, D::Error> {
        S::decode(self.0, d)
    }
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

/// The YAML parser's options. Its node and event limits are sized to the largest file we
/// read: by default it stops at 250,000 nodes, ~10,400 routes. It keeps no comments; if
/// it kept them, it would refuse more than 32 comment lines between a key and its value.
/// The limits on alias expansion, nesting depth and key length stay as they are.
pub(crate) fn yaml_options() -> serde_saphyr::Options {
    yaml_options_with(serde_saphyr::Budget::default().max_documents)
}

/// [`yaml_options`] taking up to `max_documents` documents in one stream (the parser's own
/// default, 1,024, for configuration files; manifests hold one per object).
pub(crate) fn yaml_options_with(max_documents: usize) -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_documents = max_documents;
    budget.max_nodes = MAX_FILE_BYTES as usize;
    budget.max_events = MAX_FILE_BYTES as usize;
    // `.inf` and `.nan` where no type is asked for (a value skipped while looking for
    // `kind`) are text, as a string field takes them, instead of failing the whole file.
    // Errors are shown on one line, without the source snippet the parser would attach.
    serde_saphyr::options! {
        budget: Some(budget),
        emit_comments: false,
        non_finite_float_policy: serde_saphyr::NonFiniteFloatPolicy::AsString,
        with_snippet: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROUTE: &[&str] = &[
        "name",
        "sni",
        "destinations",
        "backends",
        "timeouts",
        "allowedSourceRanges",
        "via",
    ];

    /// A typo, a swapped pair, a missing or extra letter or a difference in case is told the
    /// field meant; a name close to no field, or short and far, is told nothing.
    #[test]
    fn suggestions_are_the_closest_known_field_when_it_is_close() {
        for (unknown, like) in [
            ("allowedSourceRange", Some("allowedSourceRanges")),
            ("AllowedSourceRanges", Some("allowedSourceRanges")),
            ("ALLOWEDSOURCERANGES", Some("allowedSourceRanges")),
            ("alowedSourceRanges", Some("allowedSourceRanges")),
            ("allowedSuorceRanges", Some("allowedSourceRanges")),
            ("allowedSourcesRange", Some("allowedSourceRanges")),
            ("bakends", Some("backends")),
            ("nmae", Some("name")),
            ("snis", Some("sni")),
            ("vai", Some("via")),
            ("bcknds", Some("backends")),
            // Three edits, or two in a short name: no typo of anything.
            ("alowedSorceRange", None),
            ("bknds", None),
            ("x", None),
            ("ab", None),
            ("weight", None),
            ("", None),
        ] {
            assert_eq!(suggestion(unknown, ROUTE), like, "{unknown}");
        }
        assert_eq!(suggestion("name", &[]), None);
        // The closest wins, then the first of equally close ones.
        assert_eq!(suggestion("idel", &["idle", "id"]), Some("idle"));
        assert_eq!(suggestion("abcd", &["abce", "abcf"]), Some("abce"));
    }

    #[test]
    fn the_distance_counts_each_edit_once() {
        let d = |a: &str, b: &str| {
            let a: Vec<char> = a.chars().collect();
            let b: Vec<char> = b.chars().collect();
            distance(&a, &b)
        };
        assert_eq!(d("", ""), 0);
        assert_eq!(d("abc", ""), 3);
        assert_eq!(d("", "abc"), 3);
        assert_eq!(d("abc", "abc"), 0);
        assert_eq!(d("abc", "abd"), 1);
        assert_eq!(d("abc", "acb"), 1);
        assert_eq!(d("abc", "abcd"), 1);
        assert_eq!(d("kitten", "sitting"), 3);
        assert_eq!(d("ca", "abc"), 3);
    }

    /// The fields a structure's decoder knows are those written in files (renamed, skipped
    /// ones left out).
    #[test]
    fn a_structures_fields_are_its_names_in_files() {
        let fields = fields_of::<crate::config::table::RawTunnelPeer>();
        assert_eq!(fields, ["publicKey", "allowedIPs"]);
    }
}
