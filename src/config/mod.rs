//! Configuration files: raw serde types and their conversion into validated domain types.
//!
//! Every file is YAML (JSON is YAML too) with `apiVersion: trellis.gardener.cloud/v1alpha1`
//! and a `kind`. Parsing happens in two steps: serde reads the structure in one pass into the
//! raw types of the file's kind (a syntax error stops it; type errors, missing fields and
//! unknown fields are collected, the file decoded again past each type error), then
//! `TryFrom`-style validation checks every value and collects *all* problems with their
//! paths. Each problem is reported with line, column and field path.
//! `trellis check` and the processes themselves run exactly this path, so what `check`
//! accepts is what runs. This module reads files but never opens sockets.

/// Implements `Deserialize` for raw types whose derive is `#[serde(remote = "Self")]`, so
/// that they take a mapping and nothing else. serde's derived structs also take a sequence
/// of their fields' values in declaration order, which would make `timeouts: [5s, 1h]` mean
/// `connect: 5s, idle: 1h`. A type listed here must derive
/// `Deserialize` with `remote = "Self"`: without that inherent `deserialize`, the impl would
/// call itself. It asks for any value, not a mapping, so that both parsers leave the refusal
/// to the visitor ("invalid type: sequence, expected a mapping"): the YAML parser would
/// refuse a sequence with its own words otherwise.
///
/// The raw types do not `deny_unknown_fields`: the decoder collects every field nothing
/// read and reports them with the validation errors, instead of stopping at the first.
macro_rules! mapping_only {
    ($($ty:ident),* $(,)?) => {$(
        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_any($crate::config::MappingOnly::<$ty>::new())
            }
        }
        impl<'de> $crate::config::Derived<'de> for $ty {
            fn derived<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                $ty::deserialize(d)
            }
        }
    )*};
}

/// Implements `Serialize` for raw types whose derive is `#[serde(remote = "Self")]` (see
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

pub mod agent;
pub mod controller;
mod decode;
pub mod gateway;
mod locate;
pub mod node;
mod recover;
pub mod routes;
pub mod tls;

use std::fmt;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::value::MapAccessDeserializer;
use serde::de::{MapAccess, Visitor};
use thiserror::Error;

use decode::Raw;
pub(crate) use decode::whole_number;

/// The only API version this build understands.
pub const API_VERSION: &str = "trellis.gardener.cloud/v1alpha1";

/// Largest config or routing file we read (a 10,000-route table is ~2 MB).
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// Longest a name lookup may take by default, retries and search-list names included: below
/// the default connect budget (5 s), so a backend whose name never answers leaves time for
/// the next.
pub const DEFAULT_RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// How backend names are resolved (the gateway's `resolver`; the node uses the defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolverSettings {
    /// Name servers asked instead of `/etc/resolv.conf`'s (its search list and `ndots` still
    /// apply); empty: its own.
    pub nameservers: Vec<std::net::SocketAddr>,
    /// Longest a lookup may take, retries and search-list names included.
    pub timeout: Duration,
}

impl Default for ResolverSettings {
    fn default() -> Self {
        ResolverSettings {
            nameservers: Vec::new(),
            timeout: DEFAULT_RESOLVE_TIMEOUT,
        }
    }
}

/// One problem in a file, at a field path such as `listeners[2].address`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Field path; empty for the document itself.
    pub path: String,
    /// What is wrong.
    pub message: String,
    /// Line and column (from 1) of a parse or type error; validation errors have none.
    pub position: Option<(u64, u64)>,
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
            write!(f, "{}", self.0.display())?;
            if let Some((line, column)) = e.position {
                write!(f, ":{line}:{column}")?;
            }
            write!(f, ": {e}")?;
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
pub struct Errors {
    /// The problems, in the order found.
    found: Vec<FieldError>,
    /// Paths whose value was of the wrong type and was decoded as a stand-in (an empty
    /// string, an empty list): what validation finds there is not another problem.
    shadowed: Vec<String>,
}

impl Errors {
    /// What decoding found: type errors (whose values were decoded as stand-ins at the
    /// `shadowed` paths) and unknown fields.
    pub(crate) fn found(
        wrong: Vec<FieldError>,
        unknown: Vec<FieldError>,
        shadowed: Vec<String>,
    ) -> Self {
        let mut found = wrong;
        found.extend(unknown);
        Errors { found, shadowed }
    }

    /// How many problems are recorded.
    pub fn len(&self) -> usize {
        self.found.len()
    }

    /// Whether no problem is recorded.
    pub fn is_empty(&self) -> bool {
        self.found.is_empty()
    }

    /// Records a problem at `path`, unless the value there (or around it) had the wrong
    /// type: that was reported when the file was decoded.
    pub fn push(&mut self, path: impl fmt::Display, message: impl fmt::Display) {
        let path = path.to_string();
        if self.shadowed.iter().any(|s| recover::within(&path, s)) {
            return;
        }
        self.found.push(FieldError {
            path,
            message: message.to_string(),
            position: None,
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
        if self.found.is_empty() {
            Ok(value)
        } else {
            Err(ConfigError::Invalid {
                file: file.to_owned(),
                errors: self.found,
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
            position: None,
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

/// Records an error unless `api_version` is the one this build understands.
fn check_api_version(errors: &mut Errors, api_version: &str) {
    if api_version != API_VERSION {
        errors.push(
            "apiVersion",
            format!("unsupported {api_version:?}, expected {API_VERSION:?}"),
        );
    }
}

/// Any file `trellis check` understands, validated.
#[derive(Debug)]
pub enum AnyFile {
    /// `kind: GatewayConfiguration`.
    Gateway(gateway::GatewayConfig),
    /// `kind: RoutingTable` (boxed: an indexed table is the largest of them).
    Routes(Box<routes::LoadedTable>),
    /// `kind: NodeConfiguration`.
    Node(node::NodeConfig),
    /// `kind: ControllerConfiguration`.
    Controller(controller::ControllerConfig),
    /// `kind: AgentConfiguration`.
    Agent(agent::AgentConfig),
}

impl AnyFile {
    /// The file's kind, as written in it.
    pub fn kind(&self) -> &'static str {
        match self {
            AnyFile::Gateway(_) => gateway::KIND,
            AnyFile::Routes(_) => routes::KIND,
            AnyFile::Node(_) => node::KIND,
            AnyFile::Controller(_) => controller::KIND,
            AnyFile::Agent(_) => agent::KIND,
        }
    }
}

/// Reads and validates any trellis file, as the kind it names; a gateway configuration
/// together with its routing table ([`gateway::check_routes`]).
pub fn check_file(file: &Path) -> Result<AnyFile, ConfigError> {
    let bytes = read_file(file)?;
    let (raw, errors) = decode::decode(file, &bytes)?;
    let result = check_decoded(file, &bytes, raw, errors);
    decode::located(file, &bytes, result)
}

/// [`check_file`] after the decode.
fn check_decoded(
    file: &Path,
    bytes: &[u8],
    raw: Raw,
    errors: Errors,
) -> Result<AnyFile, ConfigError> {
    match raw {
        Raw::Gateway(raw) => {
            let dir = file.parent().unwrap_or(Path::new("."));
            let mut errors = errors;
            // A `tls` on another protocol is an error of its own: its files are not read.
            for (i, l) in raw.listeners.iter().enumerate() {
                if let Some(t) = l.tls.as_ref().filter(|_| l.protocol == "egress-connect") {
                    tls::check_material(&mut errors, &format!("listeners[{i}].tls"), dir, t);
                }
            }
            let config = gateway::validate(file, raw, errors)?;
            gateway::check_routes(file, &config)?;
            Ok(AnyFile::Gateway(config))
        }
        Raw::Node(raw) => node::validate(file, raw, errors).map(AnyFile::Node),
        Raw::Controller(raw) => controller::validate(file, raw, errors).map(AnyFile::Controller),
        Raw::Agent(raw) => agent::validate(file, raw, errors).map(AnyFile::Agent),
        Raw::Routes(raw) => {
            let dir = file.parent().unwrap_or(Path::new("."));
            let mut errors = errors;
            for (i, r) in raw.routes.iter().enumerate() {
                if let Some(t) = r.egress.as_ref().and_then(|e| e.tls.as_ref()) {
                    tls::check_material(&mut errors, &format!("routes[{i}].egress.tls"), dir, t);
                }
            }
            let registry = crate::route::BackendRegistry::default();
            let hash = routes::content_hash(bytes);
            routes::validate(file, raw, errors, hash, &registry)
                .map(|t| AnyFile::Routes(Box::new(t)))
        }
    }
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
        for kind in [
            gateway::KIND,
            routes::KIND,
            node::KIND,
            controller::KIND,
            agent::KIND,
        ] {
            assert!(err.contains(kind), "{kind} not in {err}");
        }
    }

    #[test]
    fn json_and_yaml_documents_are_the_same() {
        let yaml = b"apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes: []\n";
        let json = br#"{"apiVersion": "trellis.gardener.cloud/v1alpha1", "kind": "RoutingTable", "routes": []}"#;
        let f = Path::new("x");
        let table = |bytes: &[u8]| match decode::decode(f, bytes).unwrap().0 {
            Raw::Routes(t) => t,
            _ => panic!("not a table"),
        };
        assert_eq!(table(yaml), table(json));
        let err = decode::decode(f, br#"{"kind": "#)
            .err()
            .unwrap()
            .to_string();
        assert_eq!(
            err,
            "x:1:9: kind: EOF while parsing a value (a file that starts with '{' is read as JSON)"
        );
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

    /// `kind` is read first to choose the types to decode into; a file that names it after
    /// other fields is read a second time, as that kind, and still gets every check.
    #[test]
    fn the_kind_may_come_after_other_fields() {
        let f = Path::new("x");
        let kind = |text: &str| decode::decode(f, text.as_bytes()).map(|(raw, _)| raw.kind());
        let text = |r: Result<decode::Kind, ConfigError>| r.unwrap_err().to_string();
        for doc in [
            "{\"routes\": [], \"kind\": \"RoutingTable\", \"apiVersion\": \"v\"}",
            "routes: []\nkind: RoutingTable\napiVersion: v\n",
            "kind: &k RoutingTable\nroutes: []\napiVersion: v\n",
        ] {
            assert_eq!(kind(doc).ok(), Some(decode::Kind::Routes), "{doc}");
        }
        assert_eq!(text(kind("routes: []\n")), "x: kind: missing");
        assert_eq!(
            text(kind("{\"kind\": 1}")),
            "x:1:10: kind: invalid type: integer `1`, expected a string"
        );
        // Late or early, unknown fields and missing fields are found, all of them.
        for (doc, unknown) in [
            (
                "kind: GatewayConfiguration\nlisteners: []\nrouts: {}\n",
                (3, 1),
            ),
            (
                "listeners: []\nrouts: {}\nkind: GatewayConfiguration\n",
                (2, 1),
            ),
        ] {
            let (_, errors) = decode::decode(f, doc.as_bytes()).unwrap();
            let found: Vec<_> = errors
                .found
                .iter()
                .map(|e| (e.path.as_str(), e.message.as_str(), e.position))
                .collect();
            assert_eq!(
                found,
                [
                    ("", "missing field `apiVersion`", Some((3, 1))),
                    ("", "missing field `routes`", Some((3, 1))),
                    ("", "missing field `admin`", Some((3, 1))),
                    ("routs", "unknown field `routs`", Some(unknown)),
                ],
                "{doc}"
            );
        }
        // An unknown field at the top, the only one in the file, whether it is read after
        // `kind` (by the dispatch) or before it (by the second decode).
        for doc in [
            "kind: RoutingTable\napiVersion: v\nrouts: {}\nroutes: []\n",
            "routes: []\nkind: RoutingTable\napiVersion: v\nrouts: {}\n",
            "{\"kind\": \"RoutingTable\", \"apiVersion\": \"v\", \"routs\": {}}",
        ] {
            let (_, errors) = decode::decode(f, doc.as_bytes()).unwrap();
            assert_eq!(
                errors.found,
                [FieldError {
                    path: "routs".into(),
                    message: "unknown field `routs`".into(),
                    position: errors.found[0].position,
                }],
                "{doc}"
            );
        }
    }

    /// Past [`recover::MAX_FIXES`] type errors, the decode stops and says so: each costs a
    /// decode of the whole file. Up to it, every one is reported, in file order.
    #[test]
    fn type_errors_are_reported_up_to_the_bound() {
        let table = |n: usize| {
            let mut text = format!("apiVersion: {API_VERSION}\nkind: RoutingTable\nroutes:\n");
            for i in 0..n {
                text += &format!(
                    "- {{name: [r{i}], sni: [r{i}.example.com], backends: [{{address: \"10.0.0.1:1\"}}]}}\n"
                );
            }
            text
        };
        let errors = |text: String| match decode::decode(Path::new("x"), text.as_bytes()) {
            Ok((_, errors)) => errors.found,
            Err(ConfigError::Invalid { errors, .. }) => errors,
            Err(e) => panic!("{e}"),
        };
        let under = errors(table(recover::MAX_FIXES));
        assert_eq!(under.len(), recover::MAX_FIXES, "{under:?}");
        for (i, e) in under.iter().enumerate() {
            assert_eq!(e.path, format!("routes[{i}].name"));
            assert_eq!(e.position, Some((4 + i as u64, 10)));
        }
        let over = errors(table(recover::MAX_FIXES + 5));
        assert_eq!(over.len(), recover::MAX_FIXES + 2, "{over:?}");
        assert_eq!(
            over.last().map(|e| e.message.as_str()),
            Some("stopped after 25 type errors and missing fields; fix these and check again")
        );
    }

    /// Every value in the example files, one at a time, replaced by a value of the wrong
    /// type: the one type error is reported at its path, in JSON and YAML, and the decode
    /// goes on past it (the stand-in's own missing fields are added, not reported).
    #[test]
    fn a_wrong_type_anywhere_is_reported_and_decoding_goes_on() {
        use serde_json::Value;
        let examples = [
            include_str!("../../config/gateway.yaml"),
            include_str!("../../config/node.yaml"),
            include_str!("../../config/controller.yaml"),
            include_str!("../../config/routes.yaml"),
            include_str!("../../config/agent.yaml"),
            include_str!("../../config/tunnel-routes.yaml"),
        ];
        let mut tried = 0;
        for example in examples {
            let doc: Value = serde_saphyr::from_str(example).unwrap();
            let mut leaves = Vec::new();
            scalars(&doc, String::new(), String::new(), &mut leaves);
            for (pointer, path) in leaves {
                if path == "kind" {
                    continue;
                }
                let mut mutant = doc.clone();
                *mutant.pointer_mut(&pointer).unwrap() = serde_json::json!([[true]]);
                let yaml = serde_saphyr::to_string(&mutant).unwrap();
                for text in [mutant.to_string(), yaml] {
                    let found = match decode::decode(Path::new("x"), text.as_bytes()) {
                        Ok((_, errors)) => errors.found,
                        Err(e) => panic!(
                            "{path}: {e}
{text}"
                        ),
                    };
                    let wrong: Vec<_> = found.iter().filter(|e| e.path == path).collect();
                    assert_eq!(
                        wrong.len(),
                        1,
                        "{path}: {found:?}
{text}"
                    );
                    assert!(wrong[0].position.is_some(), "{path}: {found:?}");
                    assert!(
                        !found.iter().any(|e| e.message.contains("missing field")),
                        "{path}: {found:?}"
                    );
                    tried += 1;
                }
            }
        }
        assert!(tried > 100, "{tried}");

        /// Every scalar: its JSON pointer and its field path.
        fn scalars(v: &Value, pointer: String, path: String, out: &mut Vec<(String, String)>) {
            match v {
                Value::Object(m) => {
                    for (k, v) in m {
                        let p = if path.is_empty() {
                            k.clone()
                        } else {
                            format!("{path}.{k}")
                        };
                        scalars(v, format!("{pointer}/{k}"), p, out);
                    }
                }
                Value::Array(a) => {
                    for (i, v) in a.iter().enumerate() {
                        scalars(v, format!("{pointer}/{i}"), format!("{path}[{i}]"), out);
                    }
                }
                _ => out.push((pointer, path)),
            }
        }
    }

    /// `check` and the gateway read a routing table the same way: what one accepts the
    /// other does, and a file one refuses the other refuses with the same message. A flow
    /// mapping that is YAML but not JSON starts with `{`, so it is read as JSON (and refused
    /// by both); `.inf` next to an anchor is text.
    #[test]
    fn check_accepts_what_the_gateway_loads() {
        let dir = std::env::temp_dir().join(format!("trellis-agree-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let head = format!("apiVersion: {API_VERSION}, kind: RoutingTable");
        for (i, (text, valid)) in [
            (format!("{{{head}, routes: [{{name: x, backends: [{{address: 'a:1'}}]}}]}}"), false),
            (format!("{{\"apiVersion\": \"{API_VERSION}\", \"kind\": \"RoutingTable\", \"routes\": [],}}"), false),
            (format!("apiVersion: {API_VERSION}\nkind: RoutingTable\nroutes:\n- &r\n  name: x\n  backends: [{{address: 'a:1', zone: .inf}}]\n"), true),
        ]
        .iter()
        .enumerate()
        {
            let file = dir.join(format!("table-{i}.yaml"));
            std::fs::write(&file, text).unwrap();
            let registry = crate::route::BackendRegistry::default();
            let gateway = routes::load(&file, &registry).map(|_| ()).map_err(|e| e.to_string());
            let check = check_file(&file).map(|_| ()).map_err(|e| e.to_string());
            assert_eq!(gateway, check, "{text}");
            assert_eq!(gateway.is_ok(), *valid, "{gateway:?}\n{text}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Every mapping in the example files, replaced by the sequence of its values (which
    /// serde's derived structs read field by field: `timeouts: [5s, 1h]` as connect and
    /// idle), is refused on both paths, JSON and YAML, whether `kind` comes first (the
    /// examples) or not (JSON written with sorted keys).
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
            ("controller", include_str!("../../config/controller.yaml")),
            ("routes", routes),
            ("agent", include_str!("../../config/agent.yaml")),
            (
                "tunnel-routes",
                include_str!("../../config/tunnel-routes.yaml"),
            ),
        ];
        let mut refused = 0;
        for (kind, example) in examples {
            let doc: Value = serde_saphyr::from_str(example).unwrap();
            let mut pointers = Vec::new();
            mappings(&doc, String::new(), &mut pointers);
            for pointer in pointers {
                let mut mutant = doc.clone();
                let node = mutant.pointer_mut(&pointer).unwrap();
                *node = Value::Array(node.as_object().unwrap().values().cloned().collect());
                for (ext, text) in [("json", mutant.to_string()), ("yaml", block(&mutant))] {
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
