//! Decoding on past type errors, so that one run reports every one of them.
//!
//! A pass over a document goes through [`Value`], a deserializer wrapped around the parser's
//! that tracks the field path of every value it hands out (`routes[3].backends[0].address`)
//! and notes the path of the innermost value an error came out of. The [`Plan`] says what a
//! pass does differently from the file: a value whose type was wrong is skipped in the input
//! and a [stand-in](StandIn) is decoded in its place (an empty string, zero, `false`, an
//! empty list, no value for an option, an empty mapping for a structure), and a mapping that
//! lacked a required field gets that field, with a stand-in value, after its last entry. The
//! caller runs passes until one decodes the whole document, adding one fix to the plan after
//! each failure; every fix but those a stand-in itself needed (the required fields of a
//! stand-in structure) is one problem to report. Paths at or under a fix are
//! [shadowed](Plan::shadows): what is found there later (a stand-in's empty name, a field
//! the stand-in lacks) is a consequence, not another problem.
//!
//! Passes are whole decodes of the document: a streaming parser that failed inside a value
//! cannot say where that value ends, but a new pass can skip it from its start. A valid file
//! is decoded once, without this wrapper; only a file with a type error pays for its
//! passes, and [`MAX_FIXES`] bounds them. Enum values are passed through without paths (no
//! configuration field is an enum). This module never reads files and knows nothing of the
//! configuration's types.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::marker::PhantomData;

use serde::de::value::StrDeserializer;
use serde::de::{
    self, DeserializeSeed, Deserializer, EnumAccess, IgnoredAny, MapAccess, SeqAccess, Visitor,
};

/// The newtype name of a value that takes a stand-in of its own: a type decoded from text
/// would refuse the empty string a stand-in is, so it asks for a newtype of this name, and
/// the stand-in deserializer hands it `visit_unit` instead (which the parsers never do for
/// a newtype), to decode as its own stand-in.
pub(super) const SCALAR: &str = "$trellis::scalar";

/// Most fixes one document gets: after that many, decoding stops and the problems found so
/// far are reported (each fix costs a decode of the whole document).
pub(super) const MAX_FIXES: usize = 25;

/// What a pass decodes differently from the file.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Plan {
    /// Values replaced by a stand-in, by path.
    stand_ins: HashSet<String>,
    /// Of those, the values their type refused (a scalar of the right type but a wrong
    /// text): an optional field there was given, so its stand-in is `Some`.
    refused: HashSet<String>,
    /// Fields added after the last entry of the mapping at a path, with a stand-in value.
    inserts: HashMap<String, Vec<String>>,
    /// Fixes in the plan.
    fixes: usize,
}

impl Plan {
    /// Replaces the value at `path` with a stand-in; false if it already is one. A value
    /// its type `refused` (rather than one of the wrong type) was given: where the field is
    /// optional, its stand-in is present.
    pub(super) fn stand_in(&mut self, path: &str, refused: bool) -> bool {
        let new = self.stand_ins.insert(path.to_owned());
        if new && refused {
            self.refused.insert(path.to_owned());
        }
        self.fixes += usize::from(new);
        new
    }

    /// Adds `field` to the mapping at `path`; false if it already was.
    pub(super) fn insert(&mut self, path: &str, field: &str) -> bool {
        let fields = self.inserts.entry(path.to_owned()).or_default();
        if fields.iter().any(|f| f == field) {
            return false;
        }
        fields.push(field.to_owned());
        self.fixes += 1;
        true
    }

    /// Fixes so far.
    pub(super) fn fixes(&self) -> usize {
        self.fixes
    }

    /// Whether `path` is a stand-in, an added field, or inside one.
    pub(super) fn shadows(&self, path: &str) -> bool {
        self.shadowed().any(|s| within(path, &s))
    }

    /// Every stand-in and added field, by path.
    pub(super) fn shadowed(&self) -> impl Iterator<Item = String> + '_ {
        let inserted = self
            .inserts
            .iter()
            .flat_map(|(at, fields)| fields.iter().map(move |f| join(at, f)));
        self.stand_ins.iter().cloned().chain(inserted)
    }
}

/// Whether `path` is `root` or a path inside it (`a.b` and `a[1]` are inside `a`; `ab` is
/// not). The document's own path (empty) holds every path.
pub(super) fn within(path: &str, root: &str) -> bool {
    root.is_empty()
        || path
            .strip_prefix(root)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
}

/// `at.key`, or `key` at the top.
fn join(at: &str, key: &str) -> String {
    if at.is_empty() {
        key.to_owned()
    } else {
        format!("{at}.{key}")
    }
}

/// One pass's state, shared by the wrappers at every depth.
#[derive(Debug)]
pub(super) struct Track {
    plan: Plan,
    /// The path of the value being decoded.
    path: String,
    /// The text of the mapping key read last.
    key: Option<String>,
    /// The path of the innermost value an error came out of.
    failed_at: Option<String>,
}

impl Track {
    /// A pass following `plan`.
    pub(super) fn new(plan: Plan) -> RefCell<Track> {
        RefCell::new(Track {
            plan,
            path: String::new(),
            key: None,
            failed_at: None,
        })
    }

    /// The plan back, and where the pass failed (if it did inside the document).
    pub(super) fn finish(self) -> (Plan, Option<String>) {
        (self.plan, self.failed_at)
    }
}

/// Notes the current path as the error's unless an inner value already did.
fn fail<E>(t: &RefCell<Track>, e: E) -> E {
    let mut t = t.borrow_mut();
    if t.failed_at.is_none() {
        t.failed_at = Some(t.path.clone());
    }
    e
}

/// One step down a path.
#[derive(Clone, Copy)]
enum Segment<'a> {
    /// A mapping's value: `.key` (`key` at the top).
    Key(&'a str),
    /// A sequence's element: `[index]`.
    Index(usize),
}

/// Runs `f` one step down the path. An error that no value down there noted (the parser
/// failed before handing one out: a syntax error) is noted at the path above.
fn at<T, E>(
    t: &RefCell<Track>,
    segment: Segment<'_>,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let len = {
        let mut t = t.borrow_mut();
        let len = t.path.len();
        match segment {
            Segment::Key(key) => {
                if len > 0 {
                    t.path.push('.');
                }
                t.path.push_str(key);
            }
            Segment::Index(i) => {
                use std::fmt::Write as _;
                let _ = write!(t.path, "[{i}]");
            }
        }
        len
    };
    let r = f();
    t.borrow_mut().path.truncate(len);
    r.map_err(|e| fail(t, e))
}

/// Whether the value at the current path is a stand-in.
fn standing_in(t: &RefCell<Track>) -> bool {
    let t = t.borrow();
    t.plan.stand_ins.contains(&t.path)
}

/// The fields to add to the mapping at the current path.
fn inserts_here(t: &RefCell<Track>) -> std::vec::IntoIter<String> {
    let t = t.borrow();
    t.plan
        .inserts
        .get(&t.path)
        .cloned()
        .unwrap_or_default()
        .into_iter()
}

/// The deserializer of one value at the current path.
pub(super) struct Value<'t, D> {
    de: D,
    t: &'t RefCell<Track>,
}

impl<'t, D> Value<'t, D> {
    /// The document's root value.
    pub(super) fn new(de: D, t: &'t RefCell<Track>) -> Self {
        Value { de, t }
    }
}

/// Invokes `$forward!` with every `deserialize_*` method of serde's `Deserializer` and its
/// arguments besides the visitor: the one list both forwarding deserializers below use.
macro_rules! every_deserialize_method {
    ($forward:ident) => {
        $forward! {
            deserialize_any(), deserialize_bool(), deserialize_i8(), deserialize_i16(),
            deserialize_i32(), deserialize_i64(), deserialize_i128(), deserialize_u8(),
            deserialize_u16(), deserialize_u32(), deserialize_u64(), deserialize_u128(),
            deserialize_f32(), deserialize_f64(), deserialize_char(), deserialize_str(),
            deserialize_string(), deserialize_bytes(), deserialize_byte_buf(),
            deserialize_option(), deserialize_unit(), deserialize_unit_struct(name: &'static str),
            deserialize_newtype_struct(name: &'static str), deserialize_seq(),
            deserialize_tuple(len: usize),
            deserialize_tuple_struct(name: &'static str, len: usize), deserialize_map(),
            deserialize_struct(name: &'static str, fields: &'static [&'static str]),
            deserialize_enum(name: &'static str, variants: &'static [&'static str]),
            deserialize_identifier(), deserialize_ignored_any(),
        }
    };
}

/// Forwards `deserialize_*` methods, wrapping the visitor and noting errors.
macro_rules! forward_value {
    ($($method:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, D::Error> {
            let t = self.t;
            self.de
                .$method($($arg,)* Wrap { visitor, t })
                .map_err(|e| fail(t, e))
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Value<'_, D> {
    type Error = D::Error;

    every_deserialize_method!(forward_value);

    fn is_human_readable(&self) -> bool {
        self.de.is_human_readable()
    }
}

/// A visitor whose sequences, mappings and optional values are wrapped in turn.
struct Wrap<'t, V> {
    visitor: V,
    t: &'t RefCell<Track>,
}

/// Forwards scalar `visit_*` methods unchanged.
macro_rules! forward_visit {
    ($($method:ident($ty:ty)),* $(,)?) => {$(
        fn $method<E: de::Error>(self, v: $ty) -> Result<V::Value, E> {
            self.visitor.$method(v)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Wrap<'_, V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.visitor.expecting(f)
    }

    forward_visit! {
        visit_bool(bool), visit_i8(i8), visit_i16(i16), visit_i32(i32), visit_i64(i64),
        visit_i128(i128), visit_u8(u8), visit_u16(u16), visit_u32(u32), visit_u64(u64),
        visit_u128(u128), visit_f32(f32), visit_f64(f64), visit_char(char),
        visit_str(&str), visit_borrowed_str(&'de str), visit_string(String),
        visit_bytes(&[u8]), visit_borrowed_bytes(&'de [u8]), visit_byte_buf(Vec<u8>),
    }

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.visitor.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.visitor.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, de: D) -> Result<V::Value, D::Error> {
        self.visitor.visit_some(Value { de, t: self.t })
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, de: D) -> Result<V::Value, D::Error> {
        self.visitor.visit_newtype_struct(Value { de, t: self.t })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        self.visitor.visit_seq(Seq {
            seq,
            t: self.t,
            index: 0,
        })
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.visitor.visit_map(Map {
            map,
            t: self.t,
            inserting: None,
        })
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        self.visitor.visit_enum(data)
    }
}

/// A sequence whose elements are at `path[index]`.
struct Seq<'t, A> {
    seq: A,
    t: &'t RefCell<Track>,
    index: usize,
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Seq<'_, A> {
    type Error = A::Error;

    fn next_element_seed<S: DeserializeSeed<'de>>(
        &mut self,
        seed: S,
    ) -> Result<Option<S::Value>, A::Error> {
        let t = self.t;
        let r = at(t, Segment::Index(self.index), || {
            if standing_in(t) {
                match self.seq.next_element::<IgnoredAny>()? {
                    Some(_) => stand_in(t, seed).map(Some),
                    None => Ok(None),
                }
            } else {
                self.seq.next_element_seed(Seed { seed, t })
            }
        });
        self.index += 1;
        r
    }

    fn size_hint(&self) -> Option<usize> {
        self.seq.size_hint()
    }
}

/// A mapping whose values are at `path.key`, followed by the fields the plan adds to it.
struct Map<'t, A> {
    map: A,
    t: &'t RefCell<Track>,
    /// Once the file's entries are read: the added fields still to come.
    inserting: Option<std::vec::IntoIter<String>>,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Map<'_, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        let t = self.t;
        if self.inserting.is_none() {
            // The seed comes back if the mapping has no more entries: then it reads the
            // first added field.
            let mut slot = Some(seed);
            let key = self
                .map
                .next_key_seed(KeySeed { seed: &mut slot, t })
                .map_err(|e| fail(t, e))?;
            if key.is_some() {
                return Ok(key);
            }
            self.inserting = Some(inserts_here(t));
            let Some(seed) = slot else {
                return Ok(None);
            };
            return next_added(t, self.inserting.as_mut(), seed);
        }
        next_added(t, self.inserting.as_mut(), seed)
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
        let t = self.t;
        let key = t.borrow_mut().key.take().unwrap_or_default();
        if self.inserting.is_some() {
            return at(t, Segment::Key(&key), || stand_in(t, seed));
        }
        at(t, Segment::Key(&key), || {
            if standing_in(t) {
                self.map.next_value::<IgnoredAny>()?;
                stand_in(t, seed)
            } else {
                self.map.next_value_seed(Seed { seed, t })
            }
        })
    }

    fn size_hint(&self) -> Option<usize> {
        self.map.size_hint()
    }
}

/// The next added field as a key, or the end of the mapping.
fn next_added<'de, K: DeserializeSeed<'de>, E: de::Error>(
    t: &RefCell<Track>,
    added: Option<&mut std::vec::IntoIter<String>>,
    seed: K,
) -> Result<Option<K::Value>, E> {
    let Some(field) = added.and_then(Iterator::next) else {
        return Ok(None);
    };
    let key = seed.deserialize(StrDeserializer::<E>::new(&field))?;
    t.borrow_mut().key = Some(field);
    Ok(Some(key))
}

/// Decodes a stand-in at the current path; an error in it (a field it lacks) is noted there.
fn stand_in<'de, S: DeserializeSeed<'de>, E: de::Error>(
    t: &RefCell<Track>,
    seed: S,
) -> Result<S::Value, E> {
    seed.deserialize(StandIn::new(t)).map_err(|e| fail(t, e))
}

/// Decodes a value at the current path.
struct Seed<'t, S> {
    seed: S,
    t: &'t RefCell<Track>,
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Seed<'_, S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<S::Value, D::Error> {
        self.seed.deserialize(Value { de, t: self.t })
    }
}

/// Decodes a mapping key, keeping its text for the path of its value. The seed is taken
/// from its slot only when there is a key.
struct KeySeed<'s, 't, K> {
    seed: &'s mut Option<K>,
    t: &'t RefCell<Track>,
}

impl<'de, K: DeserializeSeed<'de>> DeserializeSeed<'de> for KeySeed<'_, '_, K> {
    type Value = K::Value;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<K::Value, D::Error> {
        match self.seed.take() {
            Some(seed) => seed.deserialize(Key { de, t: self.t }),
            // A parser reads one key per call.
            None => Err(de::Error::custom("a mapping key was read twice")),
        }
    }
}

/// The deserializer of a mapping key.
struct Key<'t, D> {
    de: D,
    t: &'t RefCell<Track>,
}

/// Forwards `deserialize_*` methods with a visitor that keeps the key's text.
macro_rules! forward_key {
    ($($method:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, D::Error> {
            self.de.$method($($arg,)* KeyText { visitor, t: self.t })
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Key<'_, D> {
    type Error = D::Error;

    every_deserialize_method!(forward_key);

    fn is_human_readable(&self) -> bool {
        self.de.is_human_readable()
    }
}

/// A key's visitor: notes the text of a string or number key, then visits it.
struct KeyText<'t, V> {
    visitor: V,
    t: &'t RefCell<Track>,
}

impl<V> KeyText<'_, V> {
    fn note(&self, key: impl fmt::Display) {
        self.t.borrow_mut().key = Some(key.to_string());
    }
}

/// Forwards `visit_*` methods, noting the key's text.
macro_rules! forward_key_text {
    ($($method:ident($ty:ty)),* $(,)?) => {$(
        fn $method<E: de::Error>(self, v: $ty) -> Result<V::Value, E> {
            self.note(&v);
            self.visitor.$method(v)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for KeyText<'_, V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.visitor.expecting(f)
    }

    forward_key_text! {
        visit_bool(bool), visit_i8(i8), visit_i16(i16), visit_i32(i32), visit_i64(i64),
        visit_i128(i128), visit_u8(u8), visit_u16(u16), visit_u32(u32), visit_u64(u64),
        visit_u128(u128), visit_f32(f32), visit_f64(f64), visit_char(char),
        visit_str(&str), visit_borrowed_str(&'de str),
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<V::Value, E> {
        self.note(&v);
        self.visitor.visit_string(v)
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<V::Value, E> {
        self.note(String::from_utf8_lossy(v));
        self.visitor.visit_bytes(v)
    }

    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<V::Value, E> {
        self.note(String::from_utf8_lossy(v));
        self.visitor.visit_borrowed_bytes(v)
    }

    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<V::Value, E> {
        self.note(String::from_utf8_lossy(&v));
        self.visitor.visit_byte_buf(v)
    }

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.visitor.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.visitor.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, de: D) -> Result<V::Value, D::Error> {
        self.visitor.visit_some(de)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, de: D) -> Result<V::Value, D::Error> {
        self.visitor.visit_newtype_struct(de)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        self.visitor.visit_seq(seq)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.visitor.visit_map(map)
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        self.visitor.visit_enum(data)
    }
}

/// The value decoded in place of one that was wrong, or of a missing field: whatever the
/// type asks for, at its emptiest. A structure is an empty mapping, plus the fields the
/// plan adds to it; an enum or a visitor that refuses these values fails again, which
/// stops the passes.
pub(super) struct StandIn<'t, E> {
    t: &'t RefCell<Track>,
    error: PhantomData<E>,
}

impl<'t, E> StandIn<'t, E> {
    fn new(t: &'t RefCell<Track>) -> Self {
        StandIn {
            t,
            error: PhantomData,
        }
    }
}

impl<'de, E: de::Error> Deserializer<'de> for StandIn<'_, E> {
    type Error = E;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        self.deserialize_map(visitor)
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_bool(false)
    }

    fn deserialize_i8<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_i8(0)
    }

    fn deserialize_i16<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_i16(0)
    }

    fn deserialize_i32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_i32(0)
    }

    fn deserialize_i64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_i64(0)
    }

    fn deserialize_u8<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_u8(0)
    }

    fn deserialize_u16<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_u16(0)
    }

    fn deserialize_u32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_u32(0)
    }

    fn deserialize_u64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_u64(0)
    }

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_f32(0.0)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_f64(0.0)
    }

    fn deserialize_char<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_char(' ')
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_str("")
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_str("")
    }

    fn deserialize_bytes<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_bytes(&[])
    }

    fn deserialize_byte_buf<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_bytes(&[])
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        let given = {
            let t = self.t.borrow();
            t.plan.refused.contains(&t.path)
        };
        if given {
            visitor.visit_some(self)
        } else {
            visitor.visit_none()
        }
    }

    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_unit()
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, E> {
        visitor.visit_unit()
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, E> {
        if name == SCALAR {
            visitor.visit_unit()
        } else {
            visitor.visit_newtype_struct(self)
        }
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_seq(de::value::SeqDeserializer::new(std::iter::empty::<()>()))
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, _len: usize, visitor: V) -> Result<V::Value, E> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, E> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_map(StandInMap {
            t: self.t,
            added: inserts_here(self.t),
            error: PhantomData,
        })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, E> {
        self.deserialize_map(visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        _variants: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, E> {
        Err(E::custom(format_args!("no stand-in for the enum {name}")))
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_str("")
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, E> {
        visitor.visit_unit()
    }
}

/// A stand-in structure: the fields the plan adds to it, each with a stand-in value.
struct StandInMap<'t, E> {
    t: &'t RefCell<Track>,
    added: std::vec::IntoIter<String>,
    error: PhantomData<E>,
}

impl<'de, E: de::Error> MapAccess<'de> for StandInMap<'_, E> {
    type Error = E;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, E> {
        next_added(self.t, Some(&mut self.added), seed)
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, E> {
        let t = self.t;
        let key = t.borrow_mut().key.take().unwrap_or_default();
        at(t, Segment::Key(&key), || stand_in(t, seed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_within_paths() {
        assert!(within("a", "a"));
        assert!(within("a.b", "a"));
        assert!(within("a[1].c", "a"));
        assert!(!within("ab", "a"));
        assert!(!within("a", "a.b"));
        assert!(within("anything", ""));
    }

    /// A fix is made once: a second stand-in or added field at the same place says so, which
    /// is what stops a pass that failed there again from looping.
    #[test]
    fn each_fix_counts_once() {
        let mut plan = Plan::default();
        assert!(plan.stand_in("routes[3].name", false));
        assert!(!plan.stand_in("routes[3].name", true));
        assert!(plan.insert("routes[4]", "name"));
        assert!(!plan.insert("routes[4]", "name"));
        assert!(plan.insert("", "apiVersion"));
        assert_eq!(plan.fixes(), 3);
        assert!(plan.shadows("routes[3].name"));
        assert!(plan.shadows("routes[4].name"));
        assert!(plan.shadows("apiVersion"));
        assert!(!plan.shadows("routes[4]"));
        assert!(!plan.shadows("routes[3].sni"));
    }
}
