//! `trellis check`: any file, as the kind it names, through the same steps a process takes
//! to load it, plus what only `check` reads: a gateway's routing table (and every listener's
//! `defaultRoute` in it) and the TLS material the files name. The one place that knows
//! every kind.

use std::path::Path;

use serde::Deserializer;

use super::agent::AgentConfig;
use super::controller::ControllerConfig;
use super::decode::{self, Kinds, Recovery};
use super::error::{ConfigError, Errors};
use super::extension::ExtensionConfig;
use super::gateway::{GatewayConfig, ListenerKind};
use super::load::{ConfigKind, One, Source, read_file};
use super::node::NodeConfig;
use super::routes::{self, LoadedTable, Tables};
use crate::route::BackendRegistry;

/// Any file `trellis check` understands, validated.
#[derive(Debug)]
pub enum AnyFile {
    /// `kind: GatewayConfiguration`.
    Gateway(GatewayConfig),
    /// `kind: RoutingTable` (boxed: an indexed table is the largest of them).
    Routes(Box<LoadedTable>),
    /// `kind: NodeConfiguration`.
    Node(NodeConfig),
    /// `kind: ControllerConfiguration`.
    Controller(ControllerConfig),
    /// `kind: AgentConfiguration`.
    Agent(AgentConfig),
    /// `kind: ExtensionConfiguration`.
    Extension(ExtensionConfig),
}

impl AnyFile {
    /// The file's kind, as written in it.
    pub fn kind(&self) -> &'static str {
        match self {
            AnyFile::Gateway(_) => GatewayConfig::KIND,
            AnyFile::Routes(_) => LoadedTable::KIND,
            AnyFile::Node(_) => NodeConfig::KIND,
            AnyFile::Controller(_) => ControllerConfig::KIND,
            AnyFile::Agent(_) => AgentConfig::KIND,
            AnyFile::Extension(_) => ExtensionConfig::KIND,
        }
    }
}

/// A file decoded as the kind it names.
enum Decoded {
    Gateway(<GatewayConfig as ConfigKind>::File),
    Routes(<LoadedTable as ConfigKind>::File),
    Node(<NodeConfig as ConfigKind>::File),
    Controller(<ControllerConfig as ConfigKind>::File),
    Agent(<AgentConfig as ConfigKind>::File),
    Extension(<ExtensionConfig as ConfigKind>::File),
}

/// A file whose kind is none of them: decoding it says so (unknown, missing, or not text),
/// with the type errors found on the way.
enum Unknown {}

impl Kinds for Unknown {
    fn names() -> Vec<&'static str> {
        vec![
            GatewayConfig::KIND,
            LoadedTable::KIND,
            NodeConfig::KIND,
            ControllerConfig::KIND,
            AgentConfig::KIND,
            ExtensionConfig::KIND,
        ]
    }

    fn decode<'de, D: Deserializer<'de>>(kind: &str, _: D) -> Result<Self, D::Error> {
        // `kind_of` finds every kind the decoder does: this is never reached.
        Err(serde::de::Error::custom(format_args!(
            "the kind {kind:?} could not be told apart"
        )))
    }
}

impl Decoded {
    /// The kind, as written in files.
    #[cfg(test)]
    fn kind(&self) -> &'static str {
        match self {
            Decoded::Gateway(_) => GatewayConfig::KIND,
            Decoded::Routes(_) => LoadedTable::KIND,
            Decoded::Node(_) => NodeConfig::KIND,
            Decoded::Controller(_) => ControllerConfig::KIND,
            Decoded::Agent(_) => AgentConfig::KIND,
            Decoded::Extension(_) => ExtensionConfig::KIND,
        }
    }
}

/// Decodes a file as the kind it names, with that kind's decoder.
fn decode_any(file: &Path, bytes: &[u8]) -> Result<(Decoded, Errors), ConfigError> {
    fn one<K: ConfigKind>(
        file: &Path,
        bytes: &[u8],
        wrap: fn(K::File) -> Decoded,
    ) -> Result<(Decoded, Errors), ConfigError> {
        decode::decode::<One<K>>(file, bytes, Recovery::All).map(|(one, e)| (wrap(one.0), e))
    }
    match decode::kind_of(bytes).as_deref() {
        Some(GatewayConfig::KIND) => one::<GatewayConfig>(file, bytes, Decoded::Gateway),
        Some(LoadedTable::KIND) => one::<LoadedTable>(file, bytes, Decoded::Routes),
        Some(NodeConfig::KIND) => one::<NodeConfig>(file, bytes, Decoded::Node),
        Some(ControllerConfig::KIND) => one::<ControllerConfig>(file, bytes, Decoded::Controller),
        Some(AgentConfig::KIND) => one::<AgentConfig>(file, bytes, Decoded::Agent),
        Some(ExtensionConfig::KIND) => one::<ExtensionConfig>(file, bytes, Decoded::Extension),
        _ => decode::decode::<Unknown>(file, bytes, Recovery::All).map(|(u, _)| match u {}),
    }
}

/// Reads and validates any trellis file, as the kind it names; a gateway configuration
/// together with its routing table ([`check_routes`]).
pub fn check_file(file: &Path) -> Result<AnyFile, ConfigError> {
    let bytes = read_file(file)?;
    let source = Source {
        path: file,
        bytes: &bytes,
    };
    let result = decode_any(file, &bytes).and_then(|(decoded, mut errors)| {
        let any = validate(decoded, &source, &mut errors);
        errors.finish(file, any)
    });
    let any = decode::located(file, &bytes, result)?;
    if let AnyFile::Gateway(config) = &any {
        decode::located(file, &bytes, check_routes(file, config))?;
    }
    Ok(any)
}

/// Each kind's validation, and the TLS material its files name.
fn validate(decoded: Decoded, source: &Source<'_>, errors: &mut Errors) -> AnyFile {
    match decoded {
        Decoded::Gateway(file) => {
            let config = GatewayConfig::validate(file, source, (), errors);
            for (i, l) in config.listeners.iter().enumerate() {
                let path = format!("listeners[{i}].tls");
                if let ListenerKind::EgressConnect { tls } = l.kind()
                    && l.tls.is_some()
                    && !errors.refused(&path)
                {
                    super::tls::check_material(errors, &path, tls);
                }
            }
            AnyFile::Gateway(config)
        }
        Decoded::Routes(file) => {
            let dir = source.dir();
            for (i, r) in file.routes.iter().enumerate() {
                let path = format!("routes[{i}].egress.tls");
                if let Some(t) = r.egress.as_ref().and_then(|e| e.tls.as_ref())
                    && let Some(files) = super::tls::files(&mut Errors::default(), &path, dir, t)
                {
                    super::tls::check_material(errors, &path, &files);
                }
            }
            let registry = BackendRegistry::default();
            let cx = Tables {
                registry: &registry,
                hash: None,
            };
            AnyFile::Routes(Box::new(LoadedTable::validate(file, source, cx, errors)))
        }
        Decoded::Node(file) => AnyFile::Node(NodeConfig::validate(file, source, (), errors)),
        Decoded::Controller(file) => {
            AnyFile::Controller(ControllerConfig::validate(file, source, (), errors))
        }
        Decoded::Agent(file) => AnyFile::Agent(AgentConfig::validate(file, source, (), errors)),
        Decoded::Extension(file) => {
            AnyFile::Extension(ExtensionConfig::validate(file, source, (), errors))
        }
    }
}

/// What `trellis check` adds for a gateway configuration: its routing table is loaded from
/// `routes.file` as the gateway resolves it (relative to the configuration's directory) and
/// validated, and every listener's `defaultRoute` must be in it. The gateway itself refuses
/// to start without a valid table, but starts with a missing default route (warning and
/// counting it at every load): the table may gain the route later, and a restart must not
/// fail meanwhile. A table's own errors are reported against the table's file.
pub fn check_routes(file: &Path, config: &GatewayConfig) -> Result<LoadedTable, ConfigError> {
    let registry = BackendRegistry::default();
    let routes = &config.routes.file;
    let table = match routes::load(routes, &registry) {
        Ok(t) => t,
        Err(ConfigError::Read { source, .. }) => {
            let mut errors = Errors::default();
            errors.push(
                "routes.file",
                format!(
                    "cannot read the routing table {}: {source}",
                    routes.display()
                ),
            );
            return errors.finish(file, table_placeholder());
        }
        Err(e) => return Err(e),
    };
    let mut errors = Errors::default();
    for (i, route) in table.table.routes().iter().enumerate() {
        if let Some(files) = route.egress.as_ref().and_then(|e| e.tls.as_ref())
            && let Err(e) = crate::net::tls::load(files)
        {
            errors.push(
                "routes.file",
                format!("routes[{i}].egress.tls in {}: {e}", routes.display()),
            );
        }
    }
    for (i, l) in config.listeners.iter().enumerate() {
        if let ListenerKind::WireGuard {
            connect_destination: Some(d),
            ..
        } = l.kind()
            && let Some(route) = table.table.by_destination(d)
        {
            errors.push(
                format!("listeners[{i}].wireguard.connectDestination"),
                format!(
                    "{d:?} is also a destination of route {:?} in {}; it must lead to one place",
                    route.name(),
                    routes.display()
                ),
            );
        }
        if let Some(r) = &l.default_route
            && table.table.by_name(r).is_none()
        {
            errors.push(
                format!("listeners[{i}].defaultRoute"),
                format!(
                    "route {r:?} is not in the routing table {}; unmatched connections would be rejected",
                    routes.display()
                ),
            );
        }
    }
    errors.finish(file, table)
}

/// Never returned: [`Errors::finish`] with a problem recorded is an error.
fn table_placeholder() -> LoadedTable {
    LoadedTable {
        table: Default::default(),
        hash: String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{
        API_VERSION, ConfigError, FieldError, MAX_FILE_BYTES, duration_text, parse_duration,
    };
    use std::time::Duration;

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
        for kind in Unknown::names() {
            assert!(err.contains(kind), "{kind} not in {err}");
        }
    }

    #[test]
    fn json_and_yaml_documents_are_the_same() {
        let yaml = b"apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes: []\n";
        let json = br#"{"apiVersion": "trellis.gardener.cloud/v1alpha1", "kind": "RoutingTable", "routes": []}"#;
        let f = Path::new("x");
        let table = |bytes: &[u8]| match decode_any(f, bytes).unwrap().0 {
            Decoded::Routes(t) => t,
            _ => panic!("not a table"),
        };
        assert_eq!(table(yaml), table(json));
        let err = decode_any(f, br#"{"kind": "#).err().unwrap().to_string();
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
        let kind = |text: &str| decode_any(f, text.as_bytes()).map(|(d, _)| d.kind());
        let text = |r: Result<&'static str, ConfigError>| r.unwrap_err().to_string();
        for doc in [
            "{\"routes\": [], \"kind\": \"RoutingTable\", \"apiVersion\": \"v\"}",
            "routes: []\nkind: RoutingTable\napiVersion: v\n",
            "kind: &k RoutingTable\nroutes: []\napiVersion: v\n",
        ] {
            assert_eq!(kind(doc).ok(), Some(LoadedTable::KIND), "{doc}");
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
            let (_, errors) = decode_any(f, doc.as_bytes()).unwrap();
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
                    (
                        "routs",
                        "unknown field `routs`: did you mean `routes`?",
                        Some(unknown)
                    ),
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
            let (_, errors) = decode_any(f, doc.as_bytes()).unwrap();
            assert_eq!(
                errors.found,
                [FieldError {
                    path: "routs".into(),
                    message: "unknown field `routs`: did you mean `routes`?".into(),
                    position: errors.found[0].position,
                }],
                "{doc}"
            );
        }
    }

    /// Past [`super::super::recover::MAX_FIXES`] type errors, the decode stops and says so: each costs a
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
        let errors = |text: String| match decode_any(Path::new("x"), text.as_bytes()) {
            Ok((_, errors)) => errors.found,
            Err(ConfigError::Invalid { errors, .. }) => errors,
            Err(e) => panic!("{e}"),
        };
        let under = errors(table(super::super::recover::MAX_FIXES));
        assert_eq!(under.len(), super::super::recover::MAX_FIXES, "{under:?}");
        for (i, e) in under.iter().enumerate() {
            assert_eq!(e.path, format!("routes[{i}].name"));
            assert_eq!(e.position, Some((4 + i as u64, 10)));
        }
        let over = errors(table(super::super::recover::MAX_FIXES + 5));
        assert_eq!(over.len(), super::super::recover::MAX_FIXES + 2, "{over:?}");
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
            include_str!("../../config/extension.yaml"),
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
                    let found = match decode_any(Path::new("x"), text.as_bytes()) {
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
            ("extension", include_str!("../../config/extension.yaml")),
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

    /// A value refused inside a YAML alias or merge key is reported at the value, with its
    /// message (the parser wraps such errors), and decoding goes on past it.
    #[test]
    fn a_value_refused_through_an_alias_is_reported_and_decoding_goes_on() {
        use crate::config::gateway::GatewayConfig;
        let head = format!("apiVersion: {API_VERSION}\nkind: GatewayConfiguration\n");
        let text = format!(
            "{head}routes: {{file: r.yaml}}
listeners:
- &l {{name: a, address: \"0.0.0.0:1\", protocol: snii}}
- <<: *l
  name: b
admin: {{address: \"127.0.0.1:2\"}}
timeouts: {{connect: &d 5x, idle: *d, halfClose: 5x}}
limits: {{maxConnections: 0, maxHeaderBytes: 1}}
workers: 300
"
        );
        let err = crate::config::parse::<GatewayConfig>(Path::new("g.yaml"), text.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(!err.contains('\u{1}'), "{err:?}");
        for needle in [
            "g.yaml:5:48: listeners[0].protocol: unknown protocol \"snii\"",
            "listeners[1].protocol: unknown protocol \"snii\"",
            "g.yaml:9:24: timeouts.connect: invalid duration \"5x\"",
            "timeouts.idle: invalid duration \"5x\"",
            "timeouts.halfClose: invalid duration \"5x\"",
            "limits.maxConnections: 0 is out of range",
            "limits.maxHeaderBytes: 1 is out of range",
            "workers: 300 is out of range",
        ] {
            assert!(err.contains(needle), "{needle} not in\n{err}");
        }
    }

    /// A role given its own kind's file whose `kind` has the wrong type is told that, where
    /// it is, not that the kind is another one.
    #[test]
    fn a_kind_of_the_wrong_type_is_a_type_error_for_a_role_too() {
        use crate::config::gateway::GatewayConfig;
        let text = format!("apiVersion: {API_VERSION}\nkind: [GatewayConfiguration]\n");
        let err = crate::config::parse::<GatewayConfig>(Path::new("k.yaml"), text.as_bytes())
            .unwrap_err()
            .to_string();
        assert_eq!(err, "k.yaml:2:7: kind: expected a string");
    }

    /// A rule across fields never reads a refused value's stand-in: each file below has one
    /// problem, the refused value, and nothing is reported about the stand-in.
    #[test]
    fn rules_across_fields_skip_refused_values() {
        use crate::config::agent::AgentConfig;
        use crate::config::gateway::GatewayConfig;
        use crate::config::node::NodeConfig;
        let v = API_VERSION;
        let gateway = |body: &str| {
            let text = format!(
                "apiVersion: {v}\nkind: GatewayConfiguration\nroutes: {{file: r.yaml}}\n{body}"
            );
            crate::config::parse::<GatewayConfig>(Path::new("g.yaml"), text.as_bytes())
                .unwrap_err()
                .to_string()
        };
        // The connect budget's stand-in is not what the resolver's timeout is compared with.
        let err = gateway(
            "listeners: [{name: a, address: \"0.0.0.0:1\", protocol: sni}]\nadmin: {address: \"127.0.0.1:2\"}\ntimeouts: {connect: 5x}\nresolver: {timeout: 2s}\n",
        );
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("timeouts.connect: invalid duration"), "{err}");
        // Nor is an address's stand-in another listener's, or the admin endpoint's.
        let err = gateway(
            "listeners: [{name: a, address: bogus, protocol: sni}, {name: b, address: \"0.0.0.0:0\", protocol: sni}]\nadmin: {address: \"0.0.0.0:0\", debugAddress: nope}\n",
        );
        assert!(
            err.contains("listeners[0].address: expected IP:port"),
            "{err}"
        );
        assert!(
            err.contains("admin.debugAddress: expected IP:port"),
            "{err}"
        );
        assert!(
            err.contains("admin.address: address 0.0.0.0:0 is used by a listener"),
            "{err}"
        );
        assert_eq!(err.lines().count(), 3, "{err}");
        // A node's mistyped protocol says nothing of which settings belong.
        let text = format!(
            "apiVersion: {v}\nkind: NodeConfiguration\nlisten: [\"127.0.0.1:1\"]\nupstream: {{address: \"gw:8132\", protocol: http-conect, destination: \"outbound|443||x\"}}\nadmin: {{address: \"127.0.0.1:2\"}}\n"
        );
        let err = crate::config::parse::<NodeConfig>(Path::new("n.yaml"), text.as_bytes())
            .unwrap_err()
            .to_string();
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains("upstream.protocol: expected http-connect or proxy-v2"),
            "{err}"
        );
        // A refused address is no address of its family.
        let key = crate::route::WgKey([9; 32]).to_base64();
        let text = format!(
            "apiVersion: {v}\nkind: AgentConfiguration\nwireguard: {{privateKeyFile: k, addresses: [bogus, 10.0.0.1], gateway: {{publicKey: \"{key}\", endpoints: [{{udp: \"gw:1\"}}]}}}}\nnetworks: [10.0.0.0/8]\nadmin: {{address: \"127.0.0.1:2\"}}\n"
        );
        let err = crate::config::parse::<AgentConfig>(Path::new("a.yaml"), text.as_bytes())
            .unwrap_err()
            .to_string();
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains("wireguard.addresses[0]: expected an IP address"),
            "{err}"
        );
    }
}
