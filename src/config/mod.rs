//! Configuration files: raw serde types and their conversion into validated domain types.
//!
//! Every file is YAML (JSON is YAML too) with `apiVersion: trellis.gardener.cloud/v1alpha1`
//! and a `kind`. Parsing happens in two steps: serde reads the structure (unknown fields and
//! wrong types are errors, reported with their field path), then `TryFrom`-style validation
//! checks every value and collects *all* problems with their paths. `trellis check` and the
//! processes themselves run exactly this path, so what `check` accepts is what runs. This
//! module reads files but never opens sockets.

/// Implements `Deserialize` for raw types whose derive is `#[serde(remote = "Self")]`, so
/// that they take a mapping and nothing else. serde's derived structs also take a sequence
/// of their fields' values in declaration order, which would make `timeouts: [5s, 1h]` mean
/// `connect: 5s, idle: 1h` in a JSON table or a gateway configuration; the YAML parser's
/// typed path refused that, every other path took it. A type listed here must derive
/// `Deserialize` with `remote = "Self"`: without that inherent `deserialize`, the impl would
/// call itself.
macro_rules! mapping_only {
    ($($ty:ident),* $(,)?) => {$(
        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_map($crate::config::MappingOnly::<$ty>::new())
            }
        }
        impl<'de> $crate::config::Derived<'de> for $ty {
            fn derived<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                $ty::deserialize(d)
            }
        }
    )*};
}

pub mod block_yaml;
pub mod cidr;
pub mod gateway;
pub mod node;
pub mod routes;

use std::fmt;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::value::MapAccessDeserializer;
use serde::de::{DeserializeOwned, MapAccess, Visitor};
use thiserror::Error;

/// The only API version this build understands.
pub const API_VERSION: &str = "trellis.gardener.cloud/v1alpha1";

/// Largest config or routing file we read (a 10,000-route table is ~2 MB).
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// One problem in a file, at a field path such as `listeners[2].address`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Field path; empty for the document itself.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Why a file could not be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{}: {source}", file.display())]
    Read {
        /// The file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file was read but is not valid; every problem found is listed.
    #[error("{}", Invalid(file, errors))]
    Invalid {
        /// The file.
        file: PathBuf,
        /// Every problem, each with its field path.
        errors: Vec<FieldError>,
    },
}

struct Invalid<'a>(&'a Path, &'a [FieldError]);

impl fmt::Display for Invalid<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.1.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{}: {e}", self.0.display())?;
        }
        Ok(())
    }
}

impl ConfigError {
    /// Stable short name for metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            ConfigError::Read { .. } => "read",
            ConfigError::Invalid { .. } => "invalid",
        }
    }
}

/// Collects validation errors with their paths.
#[derive(Debug, Default)]
pub struct Errors(Vec<FieldError>);

impl Errors {
    /// Records a problem at `path`.
    pub fn push(&mut self, path: impl fmt::Display, message: impl fmt::Display) {
        self.0.push(FieldError {
            path: path.to_string(),
            message: message.to_string(),
        });
    }

    /// Parses a duration at `path`, recording an error and returning `None` if invalid.
    pub fn duration(&mut self, path: impl fmt::Display, value: &str) -> Option<Duration> {
        parse_duration(value).map_err(|e| self.push(path, e)).ok()
    }

    /// Parses an optional duration, falling back to `default`.
    pub fn duration_or(
        &mut self,
        path: impl fmt::Display,
        value: Option<&str>,
        default: Duration,
    ) -> Duration {
        match value {
            Some(v) => self.duration(path, v).unwrap_or(default),
            None => default,
        }
    }

    /// Turns the collected errors into a result for `file`.
    pub fn finish<T>(self, file: &Path, value: T) -> Result<T, ConfigError> {
        if self.0.is_empty() {
            Ok(value)
        } else {
            Err(ConfigError::Invalid {
                file: file.to_owned(),
                errors: self.0,
            })
        }
    }
}

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

/// Reads a file with a size cap.
pub fn read_file(file: &Path) -> Result<Vec<u8>, ConfigError> {
    use std::io::Read;
    let read_err = |source| ConfigError::Read {
        file: file.to_owned(),
        source,
    };
    let f = std::fs::File::open(file).map_err(read_err)?;
    // Sized up front (the file may still change between stat and read; read_to_end grows
    // the buffer then): a buffer grown by doubling is reallocated inside the heap, and a
    // routing table's megabytes stay resident after it is freed; one allocation this large
    // gets its own mapping and is returned on free.
    let hint = f.metadata().map_or(0, |m| m.len());
    if hint > MAX_FILE_BYTES {
        // Rejected before reading: a watch event must not read 64 MiB each time.
        return Err(too_large(file));
    }
    let mut bytes = Vec::with_capacity(hint as usize + 1);
    f.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_err)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large(file));
    }
    Ok(bytes)
}

fn too_large(file: &Path) -> ConfigError {
    invalid(file, "", format!("file larger than {MAX_FILE_BYTES} bytes"))
}

fn invalid(file: &Path, path: &str, message: impl fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        file: file.to_owned(),
        errors: vec![FieldError {
            path: path.into(),
            message: message.to_string(),
        }],
    }
}

/// A raw type's derived decoder (`#[serde(remote = "Self")]`), for [`mapping_only!`].
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
        T::derived(MapAccessDeserializer::new(map))
    }
}

/// The YAML parser's options. Its node and event limits are sized to the largest file we
/// read: by default it stops at 250,000 nodes, ~10,400 routes. It keeps no comments; if
/// it kept them, it would refuse more than 32 comment lines between a key and its value.
/// The limits on alias expansion, nesting depth and key length stay as they are.
pub(crate) fn yaml_options() -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_nodes = MAX_FILE_BYTES as usize;
    budget.max_events = MAX_FILE_BYTES as usize;
    // `.inf` and `.nan` reach a generic document as text (a typed string field takes them as
    // text anyway), instead of failing the whole file.
    serde_saphyr::options! {
        budget: Some(budget),
        emit_comments: false,
        non_finite_float_policy: serde_saphyr::NonFiniteFloatPolicy::AsString,
    }
}

/// Parses YAML into a generic document, for kind detection and typed decoding.
fn parse_document(file: &Path, bytes: &[u8]) -> Result<serde_json::Value, ConfigError> {
    let text =
        std::str::from_utf8(bytes).map_err(|e| invalid(file, "", format!("not UTF-8: {e}")))?;
    // JSON is YAML too, and a JSON parser is several times faster on the large tables a
    // controller writes; hand-written YAML takes the YAML parser.
    let yaml = || serde_saphyr::from_str_with_options::<serde_json::Value>(text, yaml_options());
    let doc = if text.trim_start().starts_with('{') {
        // A flow mapping that is YAML but not JSON is read as the gateway reads it; when
        // neither parser takes the file, the JSON parser's error is the one to show.
        match serde_json::from_str(text) {
            Ok(doc) => doc,
            Err(e) => yaml().map_err(|_| invalid(file, "", format!("JSON: {e}")))?,
        }
    } else {
        yaml().map_err(|e| invalid(file, "", format!("YAML: {e}")))?
    };
    if !doc.is_object() {
        return Err(invalid(
            file,
            "",
            "expected a mapping with apiVersion and kind",
        ));
    }
    let mut errors = Errors::default();
    match doc.get("apiVersion").and_then(|v| v.as_str()) {
        Some(API_VERSION) => {}
        Some(other) => errors.push(
            "apiVersion",
            format!("unsupported {other:?}, expected {API_VERSION:?}"),
        ),
        None => errors.push("apiVersion", format!("missing, expected {API_VERSION:?}")),
    }
    if doc.get("kind").and_then(|v| v.as_str()).is_none() {
        errors.push("kind", "missing");
    }
    errors.finish(file, doc)
}

/// Reads `file` and hands its document to a kind's `from_document`.
pub(crate) fn load_with<T>(
    file: &Path,
    from_document: fn(&Path, serde_json::Value) -> Result<T, ConfigError>,
) -> Result<T, ConfigError> {
    let bytes = read_file(file)?;
    parse_with(file, &bytes, from_document)
}

/// Parses the bytes of `file` and hands its document to a kind's `from_document`.
pub(crate) fn parse_with<T>(
    file: &Path,
    bytes: &[u8],
    from_document: fn(&Path, serde_json::Value) -> Result<T, ConfigError>,
) -> Result<T, ConfigError> {
    from_document(file, parse_document(file, bytes)?)
}

/// Decodes file bytes straight into raw serde types, without the generic document in
/// between (several times faster and leaner on a 10,000-route table). Only when that fails
/// does the slow path run, to report the error with its field path; `apiVersion` and `kind`
/// are the caller's to check.
///
/// `T` must read every scalar through `deserialize_str`-like calls (strings, options and
/// containers of them, as the routing table's raw types do): the block-YAML fast path
/// hands scalars over as JSON strings, which an untagged enum or a `serde_json::Value`
/// field would take as text where the YAML parser gives a number.
fn decode_bytes<T: DeserializeOwned>(file: &Path, bytes: &[u8]) -> Result<T, ConfigError> {
    let text =
        std::str::from_utf8(bytes).map_err(|e| invalid(file, "", format!("not UTF-8: {e}")))?;
    let fast = if text.trim_start().starts_with('{') {
        serde_json::from_str::<T>(text).ok()
    } else {
        // Block YAML of one-line scalars (what tables are written in) goes through JSON;
        // the YAML parser takes the rest, and anything that does not decode from the JSON.
        block_yaml::to_json(text).and_then(|json| serde_json::from_str::<T>(&json).ok())
    };
    match fast {
        Some(value) => Ok(value),
        None => decode_yaml(file, text),
    }
}

/// [`decode_bytes`] without its JSON fast paths: the YAML parser straight into `T`, and the
/// generic document when that fails.
fn decode_yaml<T: DeserializeOwned>(file: &Path, text: &str) -> Result<T, ConfigError> {
    match serde_saphyr::from_str_with_options::<T>(text, yaml_options()) {
        Ok(value) => Ok(value),
        Err(_) => decode(file, parse_document(file, text.as_bytes())?),
    }
}

/// Records an error unless `api_version` is the one this build understands.
fn check_api_version(errors: &mut Errors, api_version: &str) {
    if api_version != API_VERSION {
        errors.push(
            "apiVersion",
            format!("unsupported {api_version:?}, expected {API_VERSION:?}"),
        );
    }
}

/// Decodes a document into raw serde types; structural errors carry the field path.
fn decode<T: DeserializeOwned>(file: &Path, doc: serde_json::Value) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(doc).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." { String::new() } else { path };
        invalid(file, &path, e.into_inner())
    })
}

/// Any file `trellis check` understands, validated.
#[derive(Debug)]
pub enum AnyFile {
    /// `kind: GatewayConfiguration`.
    Gateway(gateway::GatewayConfig),
    /// `kind: RoutingTable`.
    Routes(routes::LoadedTable),
    /// `kind: NodeConfiguration`.
    Node(node::NodeConfig),
}

impl AnyFile {
    /// The file's kind, as written in it.
    pub fn kind(&self) -> &'static str {
        match self {
            AnyFile::Gateway(_) => gateway::KIND,
            AnyFile::Routes(_) => routes::KIND,
            AnyFile::Node(_) => node::KIND,
        }
    }
}

/// Reads and validates any trellis file, dispatching on its `kind`.
pub fn check_file(file: &Path) -> Result<AnyFile, ConfigError> {
    let bytes = read_file(file)?;
    // A routing table, the kind that runs to megabytes, is decoded once, without a generic
    // document, when its kind can be read on a fast path.
    if quick_kind(&bytes).as_deref() == Some(routes::KIND) {
        let registry = crate::route::BackendRegistry::default();
        return routes::parse(file, &bytes, &registry).map(AnyFile::Routes);
    }
    let doc = parse_document(file, &bytes)?;
    match doc.get("kind").and_then(|v| v.as_str()) {
        Some(gateway::KIND) => gateway::from_document(file, doc).map(AnyFile::Gateway),
        Some(node::KIND) => node::from_document(file, doc).map(AnyFile::Node),
        Some(routes::KIND) => {
            let registry = crate::route::BackendRegistry::default();
            routes::parse(file, &bytes, &registry).map(AnyFile::Routes)
        }
        Some(other) => Err(invalid(
            file,
            "kind",
            format!(
                "unknown kind {other:?}, expected one of {:?}",
                [gateway::KIND, routes::KIND, node::KIND]
            ),
        )),
        None => Err(invalid(file, "kind", "missing")),
    }
}

/// The `kind` of a JSON document or of block YAML the fast path takes; `None` for anything
/// else, which then goes through the generic document.
fn quick_kind(bytes: &[u8]) -> Option<String> {
    /// Every other field is skipped unread.
    #[derive(serde::Deserialize)]
    struct Head {
        kind: Option<String>,
    }
    let text = std::str::from_utf8(bytes).ok()?;
    let head: Head = if text.trim_start().starts_with('{') {
        serde_json::from_str(text).ok()?
    } else {
        serde_json::from_str(&block_yaml::to_json(text)?).ok()?
    };
    head.kind
}

/// Joins `name[index]` or `name.field` paths.
pub(crate) fn at(base: impl fmt::Display, field: impl fmt::Display) -> String {
    format!("{base}.{field}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_read_whole_and_capped() {
        let dir = std::env::temp_dir().join(format!("trellis-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let big = dir.join("big");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(MAX_FILE_BYTES + 1).unwrap(); // sparse: nothing is written
        let err = read_file(&big).unwrap_err().to_string();
        assert!(err.contains("larger than"), "{err}");
        f.set_len(3 * 4096 + 7).unwrap();
        assert_eq!(read_file(&big).unwrap().len(), 3 * 4096 + 7);
        // A file that reports no size (procfs) is still read to its end.
        let status = read_file(Path::new("/proc/self/status")).unwrap();
        assert!(String::from_utf8_lossy(&status).contains("VmRSS"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unknown_kind_names_every_kind() {
        let file = std::env::temp_dir().join(format!("trellis-kind-{}.yaml", std::process::id()));
        std::fs::write(&file, format!("apiVersion: {API_VERSION}\nkind: Shoot\n")).unwrap();
        let err = check_file(&file).unwrap_err().to_string();
        std::fs::remove_file(&file).unwrap();
        for kind in [gateway::KIND, routes::KIND, node::KIND] {
            assert!(err.contains(kind), "{kind} not in {err}");
        }
    }

    #[test]
    fn json_and_yaml_documents_are_the_same() {
        let yaml = b"apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes: []\n";
        let json = br#"{"apiVersion": "trellis.gardener.cloud/v1alpha1", "kind": "RoutingTable", "routes": []}"#;
        let f = Path::new("x");
        assert_eq!(
            parse_document(f, yaml).unwrap(),
            parse_document(f, json).unwrap()
        );
        let err = parse_document(f, br#"{"kind": "#).unwrap_err().to_string();
        assert!(err.contains("x: JSON:"), "{err}");
    }

    #[test]
    fn duration_text_reads_back() {
        for d in [
            Duration::from_secs(90),
            Duration::from_millis(1500),
            Duration::from_micros(250),
            Duration::from_nanos(7),
            Duration::ZERO,
        ] {
            assert_eq!(parse_duration(&duration_text(d)), Ok(d), "{d:?}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for bad in [
            "",
            "5",
            "s",
            "5 s",
            "-1s",
            "1d",
            "1.2.3s",
            "10000000000000000000s10000000000000000000s",
            "18000000000000000000s",
            "8761h",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    /// `check` reads a routing table's kind without building a generic document when the
    /// file is JSON or block YAML the fast path takes, and leaves the rest to it.
    #[test]
    fn kinds_are_read_on_the_fast_paths() {
        let kind = |text: &str| quick_kind(text.as_bytes());
        assert_eq!(
            kind("{\"routes\": [], \"kind\": \"RoutingTable\"}").as_deref(),
            Some(routes::KIND)
        );
        assert_eq!(
            kind("routes: []\nkind: RoutingTable\n").as_deref(),
            Some(routes::KIND)
        );
        assert_eq!(
            kind("kind: GatewayConfiguration\n").as_deref(),
            Some(gateway::KIND)
        );
        assert_eq!(kind("routes: []\n"), None);
        assert_eq!(kind("kind: &k RoutingTable\n"), None); // anchors: the YAML parser's
        assert_eq!(kind("{\"kind\": 1}"), None);
    }

    /// `check` accepts the routing tables the gateway loads, whichever path reads them: a
    /// flow mapping that is YAML but not JSON, a trailing comma, `.inf` as text next to an
    /// anchor (which keeps the file off the fast path).
    #[test]
    fn check_accepts_what_the_gateway_loads() {
        let dir = std::env::temp_dir().join(format!("trellis-agree-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let head = format!("apiVersion: {API_VERSION}, kind: RoutingTable");
        for (i, text) in [
            format!("{{{head}, routes: [{{name: x, backends: [{{address: 'a:1'}}]}}]}}"),
            format!("{{\"apiVersion\": \"{API_VERSION}\", \"kind\": \"RoutingTable\", \"routes\": [],}}"),
            format!("apiVersion: {API_VERSION}\nkind: RoutingTable\nroutes:\n- &r\n  name: x\n  backends: [{{address: 'a:1', zone: .inf}}]\n"),
        ]
        .iter()
        .enumerate()
        {
            let file = dir.join(format!("table-{i}.yaml"));
            std::fs::write(&file, text).unwrap();
            let registry = crate::route::BackendRegistry::default();
            routes::load(&file, &registry).unwrap_or_else(|e| panic!("gateway: {e}\n{text}"));
            check_file(&file).unwrap_or_else(|e| panic!("check: {e}\n{text}"));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Every mapping in the example files, replaced by the sequence of its values (which
    /// serde's derived structs read field by field: `timeouts: [5s, 1h]` as connect and
    /// idle), is refused on every path: JSON and block-YAML fast paths, the YAML parser's
    /// typed path, and the generic document.
    #[test]
    fn a_sequence_is_never_read_as_a_mapping() {
        use serde_json::Value;
        let dir = std::env::temp_dir().join(format!("trellis-seq-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let routes = include_str!("../../config/routes.yaml");
        std::fs::write(dir.join("routes.yaml"), routes).unwrap();
        let gateway =
            include_str!("../../config/gateway.yaml").to_string() + "accessLog: {interval: 1m}\n";
        let examples = [
            ("gateway", gateway.as_str()),
            ("node", include_str!("../../config/node.yaml")),
            ("routes", routes),
        ];
        let (mut refused, mut fast) = (0, 0);
        for (kind, example) in examples {
            let doc: Value = serde_saphyr::from_str(example).unwrap();
            let mut pointers = Vec::new();
            mappings(&doc, String::new(), &mut pointers);
            for pointer in pointers {
                let mut mutant = doc.clone();
                let node = mutant.pointer_mut(&pointer).unwrap();
                *node = Value::Array(node.as_object().unwrap().values().cloned().collect());
                for (ext, text) in [("json", mutant.to_string()), ("yaml", block(&mutant))] {
                    if kind == "routes" && ext == "yaml" && !pointer.is_empty() {
                        assert!(block_yaml::to_json(&text).is_some(), "not taken:\n{text}");
                        fast += 1;
                    }
                    let file = dir.join(format!("{kind}-mutant.{ext}"));
                    std::fs::write(&file, &text).unwrap();
                    let expected = if pointer.is_empty() {
                        "expected a mapping with apiVersion and kind"
                    } else {
                        "invalid type: sequence, expected a mapping"
                    };
                    match check_file(&file) {
                        Ok(_) => panic!("{kind} with {pointer:?} as a sequence accepted:\n{text}"),
                        Err(e) => assert!(e.to_string().contains(expected), "{e}"),
                    }
                    refused += 1;
                }
            }
            // The example itself passes, in both forms.
            for (ext, text) in [("json", doc.to_string()), ("yaml", block(&doc))] {
                let file = dir.join(format!("{kind}-example.{ext}"));
                std::fs::write(&file, &text).unwrap();
                check_file(&file).unwrap_or_else(|e| panic!("{e}\n{text}"));
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(refused > 40, "{refused}");
        assert_eq!(
            fast, 8,
            "routes, backends and timeouts of config/routes.yaml"
        );

        fn mappings(v: &Value, at: String, out: &mut Vec<String>) {
            match v {
                Value::Object(m) => {
                    out.push(at.clone());
                    for (k, v) in m {
                        mappings(v, format!("{at}/{k}"), out);
                    }
                }
                Value::Array(a) => {
                    for (i, v) in a.iter().enumerate() {
                        mappings(v, format!("{at}/{i}"), out);
                    }
                }
                _ => {}
            }
        }

        /// Block YAML as written by hand: nested collections in block style, sequences
        /// inside sequences in flow style, quoted strings.
        fn block(v: &Value) -> String {
            fn scalar(v: &Value) -> String {
                match v {
                    Value::Object(m) => {
                        let entries: Vec<_> = m
                            .iter()
                            .map(|(k, v)| format!("{k}: {}", scalar(v)))
                            .collect();
                        format!("{{{}}}", entries.join(", "))
                    }
                    Value::Array(a) => {
                        let items: Vec<_> = a.iter().map(scalar).collect();
                        format!("[{}]", items.join(", "))
                    }
                    _ => v.to_string(),
                }
            }
            fn nested(v: &Value) -> bool {
                matches!(v, Value::Object(m) if !m.is_empty())
                    || matches!(v, Value::Array(a) if !a.is_empty())
            }
            fn body(v: &Value, indent: usize, out: &mut String) {
                let pad = " ".repeat(indent);
                match v {
                    Value::Object(m) => {
                        for (k, v) in m {
                            if !nested(v) {
                                out.push_str(&format!("{pad}{k}: {}\n", scalar(v)));
                            } else if v.is_object() {
                                out.push_str(&format!("{pad}{k}:\n"));
                                body(v, indent + 2, out);
                            } else {
                                out.push_str(&format!("{pad}{k}:\n"));
                                body(v, indent, out);
                            }
                        }
                    }
                    Value::Array(a) => {
                        for v in a {
                            if v.is_object() && nested(v) {
                                let mut inner = String::new();
                                body(v, indent + 2, &mut inner);
                                out.push_str(&format!("{pad}- {}", &inner[indent + 2..]));
                            } else {
                                out.push_str(&format!("{pad}- {}\n", scalar(v)));
                            }
                        }
                    }
                    _ => out.push_str(&format!("{pad}{}\n", scalar(v))),
                }
            }
            let mut out = String::new();
            body(v, 0, &mut out);
            out
        }
    }
}
