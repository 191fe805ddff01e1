//! `trellis check`: any file, as the kind it names, through the same steps a process takes
//! to load it, then every file it names, read by the functions its role reads them with at
//! start: a gateway's routing table (and every listener's `defaultRoute` in it), TLS material
//! (certificate chain, the key that matches it, client CA bundle), WireGuard private keys,
//! and kubeconfigs (through the caller: the Kubernetes client lives above this module). A
//! named file that is missing, unreadable or unusable is reported at the field that names
//! it. The files of a configuration meant for a pod are read where [`Mounts`] put them, or
//! left unread and listed. The one place that knows every kind.

use std::path::{Path, PathBuf};

use serde::Deserializer;

use super::agent::AgentConfig;
use super::controller::ControllerConfig;
use super::decode::{self, Kinds, Recovery};
use super::error::{ConfigError, Errors};
use super::extension::ExtensionConfig;
use super::gateway::{GatewayConfig, ListenerKind};
use super::load::{ConfigKind, One, Source, read_file};
use super::mounts::Mounts;
use super::node::NodeConfig;
use super::routes::{self, LoadedTable, Tables};
use crate::net::tls::TlsError;
use crate::route::{BackendRegistry, TlsFiles};

/// Every kind `trellis check` reads, as written in files.
pub const KINDS: [&str; 6] = [
    GatewayConfig::KIND,
    LoadedTable::KIND,
    NodeConfig::KIND,
    ControllerConfig::KIND,
    AgentConfig::KIND,
    ExtensionConfig::KIND,
];

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

/// How [`check_file`] treats the files a configuration names.
#[derive(Default)]
pub struct Referenced<'a> {
    /// Where the files a configuration meant for a pod names are here.
    pub mounts: Mounts,
    /// Whether named files are left unread (each is listed in [`Checked::unread`]).
    pub skip: bool,
    /// Loads a kubeconfig as `trellis controller` and `trellis extension` do at start and
    /// says why it cannot be used; `None`: kubeconfigs are listed unread.
    pub kubeconfig: Option<&'a LoadKubeconfig>,
}

/// Loads the kubeconfig in a file, or says why it cannot be used.
pub type LoadKubeconfig = dyn Fn(&Path) -> Result<(), String>;

/// Why a file did not pass `check`: its problems, and those of a file it names that is a
/// file of its own (a gateway's routing table), each file's in its own error.
#[derive(Debug)]
pub struct CheckError(pub Vec<ConfigError>);

impl std::fmt::Display for CheckError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for CheckError {}

impl From<ConfigError> for CheckError {
    fn from(e: ConfigError) -> Self {
        CheckError(vec![e])
    }
}

/// A file valid as its kind, with the named files that were not read.
#[derive(Debug)]
pub struct Checked {
    /// The file.
    pub file: AnyFile,
    /// What it names and was not read, in the file's order.
    pub unread: Vec<Unread>,
}

/// A file a configuration names that `check` did not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unread {
    /// The field that names it (`listeners[1].tls.keyFile`).
    pub field: String,
    /// The file, as the role would read it (relative names resolved).
    pub path: PathBuf,
    /// Why it was not read.
    pub why: &'static str,
}

/// Why named files are left unread with [`Referenced::skip`].
pub const SKIPPED: &str = "skipped";
/// Why a kubeconfig is left unread without [`Referenced::kubeconfig`].
pub const NO_KUBERNETES_CLIENT: &str = "this trellis was built without the `controller` feature";

/// A file a configuration names, by how its role reads it.
enum Reference {
    /// A gateway's routing table: loaded, and checked against the configuration, by
    /// [`check_routes`] once the configuration is valid.
    Table(PathBuf),
    /// A WireGuard private key, as `wg genkey` writes it.
    Key(PathBuf),
    /// A server certificate chain, its key and a client CA bundle, loaded together.
    Tls(TlsFiles),
    /// A kubeconfig.
    Kubeconfig(PathBuf),
}

impl Reference {
    /// The files, each with its field below `at`.
    fn files(&self, at: &str) -> Vec<(String, &Path)> {
        match self {
            Reference::Table(p) | Reference::Key(p) | Reference::Kubeconfig(p) => {
                vec![(at.to_owned(), p)]
            }
            Reference::Tls(files) => TLS_FIELDS
                .iter()
                .zip(files.paths())
                .map(|(field, p)| (format!("{at}.{field}"), p))
                .collect(),
        }
    }
}

/// A `tls` section's fields, in [`TlsFiles::paths`]' order.
const TLS_FIELDS: [&str; 3] = ["certificateFile", "keyFile", "clientCAFile"];

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
        KINDS.to_vec()
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

/// Reads and validates any trellis file, as the kind it names, and the files it names as
/// `referenced` says; a gateway configuration together with its routing table
/// ([`check_routes`]). A file under a mount is taken to be where the mount puts it in the
/// pod: names relative to it are resolved there, then read where the mounts put them.
pub fn check_file(file: &Path, referenced: &Referenced<'_>) -> Result<Checked, CheckError> {
    let bytes = read_file(file)?;
    let in_pod = referenced.mounts.in_pod(file);
    let source = Source {
        path: in_pod.as_deref().unwrap_or(file),
        bytes: &bytes,
    };
    let mut unread = Vec::new();
    let result = decode_any(file, &bytes).and_then(|(decoded, mut errors)| {
        let (any, named) = validate(decoded, &source, &mut errors);
        unread = read_named(named, referenced, &mut errors);
        errors.finish(file, any)
    });
    let any = decode::located(file, &bytes, result)?;
    if let AnyFile::Gateway(config) = &any
        && !referenced.skip
    {
        check_routes(file, &bytes, config, referenced)?;
    }
    Ok(Checked { file: any, unread })
}

/// Each kind's validation, and the files the file names, each with the field naming it.
fn validate(
    decoded: Decoded,
    source: &Source<'_>,
    errors: &mut Errors,
) -> (AnyFile, Vec<(String, Reference)>) {
    let mut named = Vec::new();
    let any = match decoded {
        Decoded::Gateway(file) => {
            let config = GatewayConfig::validate(file, source, (), errors);
            named.push((
                "routes.file".into(),
                Reference::Table(config.routes.file.clone()),
            ));
            // What the gateway reads at start: the TLS material of egress-connect listeners
            // and the key of the wireguard listener.
            for (i, l) in config.listeners.iter().enumerate() {
                match l.kind() {
                    ListenerKind::EgressConnect { tls } if l.tls.is_some() => {
                        named.push((format!("listeners[{i}].tls"), Reference::Tls(tls.clone())));
                    }
                    ListenerKind::WireGuard {
                        private_key_file, ..
                    } if l.wireguard.is_some() => named.push((
                        format!("listeners[{i}].wireguard.privateKeyFile"),
                        Reference::Key(private_key_file.to_owned()),
                    )),
                    _ => {}
                }
            }
            AnyFile::Gateway(config)
        }
        Decoded::Routes(file) => {
            let dir = source.dir();
            for (i, r) in file.routes.iter().enumerate() {
                let path = format!("routes[{i}].egress.tls");
                // The table's validation reports a section that names no file.
                if let Some(t) = r.egress.as_ref().and_then(|e| e.tls.as_ref())
                    && let Some(files) = super::tls::files(&mut Errors::default(), &path, dir, t)
                {
                    named.push((path, Reference::Tls(files)));
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
            let config = ControllerConfig::validate(file, source, (), errors);
            if let Some(k) = &config.kubeconfig {
                named.push(("kubeconfig".into(), Reference::Kubeconfig(k.clone())));
            }
            AnyFile::Controller(config)
        }
        Decoded::Agent(file) => {
            let config = AgentConfig::validate(file, source, (), errors);
            named.push((
                "wireguard.privateKeyFile".into(),
                Reference::Key(config.wireguard.private_key_file.clone()),
            ));
            AnyFile::Agent(config)
        }
        Decoded::Extension(file) => {
            let config = ExtensionConfig::validate(file, source, (), errors);
            if let Some(k) = &config.kubeconfig {
                named.push(("kubeconfig".into(), Reference::Kubeconfig(k.clone())));
            }
            AnyFile::Extension(config)
        }
    };
    (any, named)
}

/// Reads every file in `named` (but a gateway's table, see [`check_routes`]) with the function
/// its role reads it with at start, where `referenced.mounts` put it, and records why one
/// cannot be used at the field naming it; a field that has a problem already is not read.
/// Returns what was left unread.
fn read_named(
    named: Vec<(String, Reference)>,
    referenced: &Referenced<'_>,
    errors: &mut Errors,
) -> Vec<Unread> {
    let mut unread = Vec::new();
    let mut leave = |at: &str, r: &Reference, why| {
        for (field, path) in r.files(at) {
            unread.push(Unread {
                field,
                path: path.to_owned(),
                why,
            });
        }
    };
    for (at, reference) in named {
        if errors.at_or_in(&at) {
            continue;
        }
        if referenced.skip {
            leave(&at, &reference, SKIPPED);
            continue;
        }
        let mounts = &referenced.mounts;
        match &reference {
            Reference::Table(_) => {}
            Reference::Key(path) => {
                let here = Here::new(mounts, path);
                if let Err(e) = crate::route::read_key_file(&here.local) {
                    errors.push(&at, here.said(e));
                }
            }
            Reference::Tls(files) => {
                let local = local_tls(mounts, files);
                if let Err(e) = crate::net::tls::load(&local) {
                    let (field, path) = tls_field(files, &local, &e);
                    errors.push(format!("{at}.{field}"), Here::new(mounts, path).said(e));
                }
            }
            Reference::Kubeconfig(path) => match referenced.kubeconfig {
                Some(load) => {
                    let here = Here::new(mounts, path);
                    if let Err(e) = load(&here.local) {
                        errors.push(&at, here.said(e));
                    }
                }
                None => leave(&at, &reference, NO_KUBERNETES_CLIENT),
            },
        }
    }
    unread
}

/// Which field of a `tls` section `e` is about, and the file there as the configuration
/// names it (`files`; `local` is where it was read).
fn tls_field<'a>(files: &'a TlsFiles, local: &TlsFiles, e: &TlsError) -> (&'static str, &'a Path) {
    let path = match e {
        TlsError::Read { path, .. }
        | TlsError::TooLarge { path }
        | TlsError::Pem { path, .. }
        | TlsError::Refused { path, .. } => path,
        // The key is what does not fit the certificate.
        TlsError::KeyMismatch { .. } => &local.key_file,
    };
    let at = local.paths().iter().position(|p| p == path).unwrap_or(0);
    (TLS_FIELDS[at], files.paths()[at])
}

/// Where the files of a `tls` section are read here.
fn local_tls(mounts: &Mounts, files: &TlsFiles) -> TlsFiles {
    let here = |p: &Path| Here::new(mounts, p).local;
    TlsFiles {
        certificate_file: here(&files.certificate_file),
        key_file: here(&files.key_file),
        client_ca_file: here(&files.client_ca_file),
    }
}

/// A named file: where the role reads it, and where `check` reads it.
struct Here<'a> {
    /// As the configuration names it (relative names resolved).
    named: &'a Path,
    /// Where it is read here.
    local: PathBuf,
}

impl<'a> Here<'a> {
    fn new(mounts: &Mounts, named: &'a Path) -> Self {
        let local = mounts.local(named).unwrap_or_else(|| named.to_owned());
        Here { named, local }
    }

    /// The loading function's error, which names the file read, and the file as the pod
    /// names it when a mount moved it.
    fn said(&self, e: impl std::fmt::Display) -> String {
        if self.local == self.named {
            e.to_string()
        } else {
            let pod = super::mounts::normal(self.named);
            format!("{e} (the pod's {})", pod.display())
        }
    }
}

/// What `trellis check` adds for a gateway configuration: its routing table is loaded from
/// `routes.file` as the gateway resolves it (relative to the configuration's directory) and
/// validated, and every listener's `defaultRoute` must be in it. The gateway itself refuses
/// to start without a valid table, but starts with a missing default route (warning and
/// counting it at every load): the table may gain the route later, and a restart must not
/// fail meanwhile. A table's own errors are reported against the table's file; the TLS
/// material its routes name, against `routes.file`.
fn check_routes(
    file: &Path,
    bytes: &[u8],
    config: &GatewayConfig,
    referenced: &Referenced<'_>,
) -> Result<LoadedTable, CheckError> {
    let registry = BackendRegistry::default();
    let routes = Here::new(&referenced.mounts, &config.routes.file);
    // Parsed as where the gateway reads it, so that the files it names are resolved there;
    // its problems are the file's here.
    let loaded = read_file(&routes.local).and_then(|table| {
        routes::parse(routes.named, &table, &registry).map_err(|e| match e {
            ConfigError::Invalid { errors, .. } => ConfigError::Invalid {
                file: routes.local.clone(),
                errors,
            },
            other => other,
        })
    });
    // A table that cannot be used is a problem at `routes.file`, and the table's own
    // problems follow, at their places in it.
    let at_routes = |message: String| {
        let mut errors = Errors::default();
        errors.push("routes.file", routes.said(message));
        decode::located(file, bytes, errors.finish(file, ()))
            .err()
            .into_iter()
            .collect::<Vec<_>>()
    };
    let table = match loaded {
        Ok(t) => t,
        Err(ConfigError::Read { source, .. }) => {
            return Err(CheckError(at_routes(format!(
                "cannot read the routing table {}: {source}",
                routes.local.display()
            ))));
        }
        Err(e) => {
            let mut errors = at_routes(format!(
                "the routing table {} is not valid; its problems follow",
                routes.local.display()
            ));
            errors.push(e);
            return Err(CheckError(errors));
        }
    };
    let mut errors = Errors::default();
    for (i, route) in table.table.routes().iter().enumerate() {
        if let Some(files) = route.egress.as_ref().and_then(|e| e.tls.as_ref()) {
            let local = local_tls(&referenced.mounts, files);
            if let Err(e) = crate::net::tls::load(&local) {
                let (field, _) = tls_field(files, &local, &e);
                errors.push(
                    "routes.file",
                    format!(
                        "routes[{i}].egress.tls.{field} in {}: {e}",
                        routes.local.display()
                    ),
                );
            }
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
                    routes.local.display()
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
                    routes.local.display()
                ),
            );
        }
    }
    Ok(decode::located(file, bytes, errors.finish(file, table))?)
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
        let err = check_file(&file, &Referenced::default())
            .unwrap_err()
            .to_string();
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
            let check = check_file(&file, &Referenced::default()).map(|_| ()).map_err(|e| e.to_string());
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
        // The agent's key, which `check` reads.
        std::fs::create_dir_all(dir.join("wireguard")).unwrap();
        let key = include_str!("../../config/wireguard/agent.key");
        std::fs::write(dir.join("wireguard/agent.key"), key).unwrap();
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
                    match check_file(&file, &Referenced::default()) {
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
                check_file(&file, &Referenced::default()).unwrap_or_else(|e| panic!("{e}\n{text}"));
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
