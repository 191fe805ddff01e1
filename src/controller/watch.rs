//! The live path of `trellis controller`: one kube-rs watcher per kind (per label selector
//! for Secrets), the controller's own stores of projections, a debounced render through
//! [`translate`], the table and the egress TLS files it names written beside it by
//! [`super::output`] (temporary file + rename) only when their bytes change.
//!
//! Each kind's store is a map of projections keyed by namespace and name; an object is
//! projected ([`manifest::project`], the same function `render` uses) as soon as it arrives
//! and never held whole. A (re)list fills a buffer (`Init`, `InitApply`) that replaces the
//! kind's map only at `InitDone`, so a relist after `410 Gone` or an API server restart never
//! renders from a half-listed kind. Nothing is rendered before every kind's first `InitDone`;
//! `/ready` answers 200 once the first table is written. Access to the API is read-only.
//! The kinds only the shoots' tunnels need (Clusters, Secrets) are never watched, nor
//! looked for, unless the configuration turns tunnels on: their stores stay empty.
//!
//! Which version each kind is read at comes from API discovery, at start and again whenever
//! a list or watch of the kind gets `404 Not Found` (its CRD deleted, or the version watched
//! no longer served): served at another version, its watcher is replaced (the new one's list
//! replaces the store at its `InitDone`); served at none, its objects are gone (the store is
//! emptied) — except EnvoyFilters, whose source allow-lists restrict shoots: those are kept.
//! Kinds not served are looked for again every [`RECHECK`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{AbortHandle, BoxStream, SelectAll};
use futures_util::{StreamExt, TryStreamExt};
use kube::api::{Api, ApiResource, DynamicObject};
use kube::discovery::Discovery;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use serde::Serialize;
use serde_json::Value;
use thiserror::Error;
use tokio::time::Instant;

use super::kinds::{WATCHED, WatchedKind};
use super::model::{Object, Snapshot};
use super::output::{Writer, Written};
use super::report::Normalised;
use super::{Target, manifest, to_json, translate};
use crate::admin::metrics::{KindLabel, KindVersionLabels, ReasonLabel, ResultLabel};
use crate::admin::{AdminState, Metrics};
use crate::config::controller::{ControllerConfig, Output};
use crate::serve::process::{self, Context, Role, Spec, StartError};

/// How long a render waits after the first change (a shoot's objects change together).
pub const DEBOUNCE: Duration = Duration::from_millis(20);

/// How long after a failed write the table is written again.
const WRITE_RETRY: Duration = Duration::from_secs(1);

/// Why the controller could not start or stopped.
#[derive(Debug, Error)]
pub enum WatchError {
    /// The configuration names no output file.
    #[error("output.file is required to run the controller")]
    NoOutput,
    /// The kubeconfig file could not be read (the message names it).
    #[error("kubeconfig: {source}")]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// What was wrong with it.
        source: kube::config::KubeconfigError,
    },
    /// No in-cluster configuration and no `KUBECONFIG`.
    #[error("no kubeconfig given and none found: {0}")]
    Infer(#[from] kube::config::InferConfigError),
    /// The client could not be built from the configuration.
    #[error("Kubernetes client: {0}")]
    Client(#[from] kube::Error),
    /// The admin address could not be bound (the controller's own wording of
    /// [`StartError::InUse`] and [`StartError::Bind`]).
    #[error("admin endpoint {address}: {source}")]
    Admin {
        /// The address.
        address: std::net::SocketAddr,
        /// The bind error.
        source: std::io::Error,
    },
    /// A failure every role shares: signal handling.
    #[error(transparent)]
    Start(StartError),
}

impl From<StartError> for WatchError {
    /// The controller binds only its admin endpoint, and has always said so in its own words.
    fn from(e: StartError) -> Self {
        match e {
            StartError::InUse {
                address, source, ..
            }
            | StartError::Bind {
                address, source, ..
            } => WatchError::Admin { address, source },
            e => WatchError::Start(e),
        }
    }
}

/// Where and how a watched kind is read (its entry in [`WATCHED`]).
impl WatchedKind {
    /// The resource at `version`.
    fn resource(&self, version: &str) -> ApiResource {
        ApiResource {
            group: self.group.to_owned(),
            version: version.to_owned(),
            api_version: self.api_version(version),
            kind: self.kind.to_owned(),
            plural: self.plural.to_owned(),
        }
    }

    /// The first of this kind's versions that `discovery` found served, if any.
    fn served(&self, discovery: &Discovery) -> Option<ApiResource> {
        let group = discovery.get(self.group)?;
        self.versions.iter().find_map(|v| {
            group
                .versioned_resources(v)
                .into_iter()
                .any(|(ar, _)| ar.kind == self.kind && ar.plural == self.plural)
                .then(|| self.resource(v))
        })
    }

    /// The key and projection of an object of this kind as the API sent it (`None`: an
    /// object translation does not read, such as a Secret whose labels changed). List items
    /// and metadata-only objects carry no (or another) `apiVersion` and `kind`: the watch
    /// knows them.
    fn project(&self, version: &str, object: &impl Serialize) -> Option<(Key, Option<Object>)> {
        let mut doc = serde_json::to_value(object).ok()?;
        let map = doc.as_object_mut()?;
        map.insert(
            "apiVersion".into(),
            Value::String(self.api_version(version)),
        );
        map.insert("kind".into(), Value::String(self.kind.to_owned()));
        let key = (
            text(&doc, "/metadata/namespace"),
            text(&doc, "/metadata/name"),
        );
        Some((key, manifest::project(&doc)))
    }
}

fn text(doc: &Value, pointer: &str) -> String {
    doc.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned()
}

/// Namespace (empty for cluster-scoped objects) and name.
type Key = (String, String);

/// One watch event, its object already projected.
#[derive(Debug)]
pub enum Change {
    /// A list starts: a new buffer.
    Init,
    /// An object of the list.
    InitApply(Key, Object),
    /// The list is complete: the buffer replaces the store.
    InitDone,
    /// An object was added or changed.
    Apply(Key, Object),
    /// An object was deleted.
    Delete(Key),
}

/// One kind's objects: the map translation reads, and the list being received.
#[derive(Debug, Default)]
pub struct Store {
    live: BTreeMap<Key, Object>,
    buffer: Option<BTreeMap<Key, Object>>,
    synced: bool,
}

impl Store {
    /// Applies one change; true when the objects translation reads changed.
    pub fn apply(&mut self, change: Change) -> bool {
        match change {
            Change::Init => {
                self.buffer = Some(BTreeMap::new());
                false
            }
            Change::InitApply(key, object) => {
                self.buffer
                    .get_or_insert_with(BTreeMap::new)
                    .insert(key, object);
                false
            }
            Change::InitDone => {
                let listed = self.buffer.take().unwrap_or_default();
                let changed = !self.synced || listed != self.live;
                self.live = listed;
                self.synced = true;
                changed
            }
            Change::Apply(key, object) => {
                self.live.get(&key) != Some(&object) && {
                    self.live.insert(key, object);
                    true
                }
            }
            Change::Delete(key) => self.live.remove(&key).is_some(),
        }
    }

    /// The API server does not serve the kind: it has no objects, and that is as good as
    /// listed.
    pub fn absent(&mut self) {
        self.synced = true;
    }

    /// The API server no longer serves the kind: its objects no longer exist. True when the
    /// objects translation reads changed.
    pub fn clear(&mut self) -> bool {
        let changed = !self.live.is_empty() || !self.synced;
        self.live.clear();
        self.buffer = None;
        self.synced = true;
        changed
    }

    /// Whether the first list has completed.
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// Objects in the store.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether the store is empty.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    fn objects(&self) -> impl Iterator<Item = &Object> {
        self.live.values()
    }
}

/// The snapshot of every store, in key order.
fn snapshot(stores: &[Store]) -> Snapshot {
    let mut snapshot = Snapshot::default();
    for object in stores.iter().flat_map(Store::objects) {
        snapshot.push(object.clone());
    }
    snapshot
}

type Events = BoxStream<'static, (usize, Result<Change, watcher::Error>)>;

fn convert<K: Serialize>(kind: &WatchedKind, version: &str, event: Event<K>) -> Option<Change> {
    Some(match event {
        Event::Init => Change::Init,
        Event::InitDone => Change::InitDone,
        Event::InitApply(o) => {
            let (key, object) = kind.project(version, &o)?;
            Change::InitApply(key, object?)
        }
        // An object that no longer projects is gone as far as translation is concerned.
        Event::Apply(o) => match kind.project(version, &o)? {
            (key, Some(object)) => Change::Apply(key, object),
            (key, None) => Change::Delete(key),
        },
        // Only the key: a deleted object may no longer project (a Secret whose labels left
        // the selection is deleted from the watch's point of view).
        Event::Delete(o) => Change::Delete(kind.project(version, &o)?.0),
    })
}

/// The watcher of kind `i` at `resource` (through its label selector and in its list page
/// size, if it has them), retried with kube's default backoff (0.8 s doubling to 30 s).
fn watch(client: &kube::Client, i: usize, resource: &ApiResource) -> Events {
    let api = Api::<DynamicObject>::all_with(client.clone(), resource);
    let version = resource.version.clone();
    let mut config = watcher::Config::default();
    if let Some(selector) = WATCHED[i].selector {
        config = config.labels(selector);
    }
    if let Some(n) = WATCHED[i].page_size {
        config = config.page_size(n);
    }
    watcher::watcher(api, config)
        .default_backoff()
        .map_ok(move |e| convert(&WATCHED[i], &version, e))
        .filter_map(move |r| async move { r.transpose().map(|r| (i, r)) })
        .boxed()
}

/// How often kinds the API server does not serve are looked for again.
pub const RECHECK: Duration = Duration::from_secs(10);

/// The kind whose objects are kept when the API server stops serving it: the ACL
/// extension's RBAC EnvoyFilters restrict shoots, and forgetting them would open those
/// shoots to everyone (the restrictive choice; Envoy keeps its last filters too).
const KEPT_WHEN_NOT_SERVED: &str = "EnvoyFilter";

/// Whether a failed list or watch says the resource is not there at all (`404`): the kind
/// may be served at another version now, or not at all.
fn not_found(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => s.code == 404,
        watcher::Error::WatchError(s) => s.code == 404,
        _ => false,
    }
}

/// What discovery's answer for a kind means for its watcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Served where it is watched (or still not served): nothing to do.
    Keep,
    /// Served, at another version than the one watched or newly: watch it there.
    Watch,
    /// No longer served at all: stop its watcher; its objects are gone.
    Stop,
}

/// The next step for a kind watched at `current` (`None`: not watched) that discovery found
/// served at `found`.
fn next(current: Option<&str>, found: Option<&str>) -> Next {
    match (current, found) {
        (c, f) if c == f => Next::Keep,
        (_, Some(_)) => Next::Watch,
        (Some(_), None) => Next::Stop,
        (None, None) => Next::Keep,
    }
}

/// Every kind's watcher: which version it reads, and how to stop it.
struct Watchers {
    client: kube::Client,
    events: SelectAll<Events>,
    /// Per kind: the version watched and the handle that ends its watcher; `None` while the
    /// API server does not serve the kind.
    current: Vec<Option<(&'static str, AbortHandle)>>,
    metrics: Arc<Metrics>,
}

impl Watchers {
    fn new(client: kube::Client, metrics: Arc<Metrics>) -> Self {
        Watchers {
            client,
            events: SelectAll::new(),
            current: WATCHED.iter().map(|_| None).collect(),
            metrics,
        }
    }

    /// The version kind `i` is watched at.
    fn version(&self, i: usize) -> Option<&'static str> {
        self.current[i].as_ref().map(|(v, _)| *v)
    }

    /// Watches kind `i` at `resource`, ending the watcher it had.
    fn start(&mut self, i: usize, resource: &ApiResource) {
        self.stop(i);
        let kind = &WATCHED[i];
        // Discovery only finds the versions the kind lists.
        let Some(version) = kind.versions.iter().find(|v| **v == resource.version) else {
            return;
        };
        let (events, handle) = futures_util::stream::abortable(watch(&self.client, i, resource));
        self.events.push(events.boxed());
        self.current[i] = Some((version, handle));
        self.set_served(i, version);
    }

    /// Ends kind `i`'s watcher: not served.
    fn stop(&mut self, i: usize) {
        if let Some((_, handle)) = self.current[i].take() {
            handle.abort();
        }
        self.set_served(i, "none");
    }

    /// `trellis_controller_served`: one series per kind, at `version`.
    fn set_served(&self, i: usize, version: &'static str) {
        let kind = WATCHED[i].kind;
        let served = &self.metrics.controller.served;
        for v in WATCHED[i].versions.iter().chain(&["none"]) {
            if *v != version {
                served.remove(&KindVersionLabels { kind, version: v });
            }
        }
        served
            .get_or_create(&KindVersionLabels { kind, version })
            .set(1);
    }
}

/// What a discovery task answers: the kinds asked for, and where each is served.
type Discovered = (
    Vec<usize>,
    Result<Vec<(usize, Option<ApiResource>)>, kube::Error>,
);

/// Discovery of the groups of `kinds` (indices into [`WATCHED`]): the resource each is served
/// at, `None` for a kind none of whose versions is served.
async fn discover(
    client: &kube::Client,
    kinds: &[usize],
) -> Result<Vec<(usize, Option<ApiResource>)>, kube::Error> {
    let mut groups: Vec<&str> = kinds.iter().map(|&i| WATCHED[i].group).collect();
    groups.sort_unstable();
    groups.dedup();
    let discovery = Discovery::new(client.clone()).filter(&groups).run().await?;
    Ok(kinds
        .iter()
        .map(|&i| (i, WATCHED[i].served(&discovery)))
        .collect())
}

/// Discovery of `kinds` (indices into [`WATCHED`]), retried (1 s doubling to 30 s) until
/// the API server answers.
async fn discover_all(client: &kube::Client, kinds: &[usize]) -> Vec<(usize, Option<ApiResource>)> {
    let mut wait = Duration::from_secs(1);
    loop {
        match discover(client, kinds).await {
            Ok(found) => return found,
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?wait, "API discovery failed; retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// A Kubernetes client from a kubeconfig file, or from the in-cluster configuration (or
/// `KUBECONFIG`) without one.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> Result<kube::Client, WatchError> {
    // kube's TLS uses the process' provider; a build linking more than one has no default.
    // An error means one is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kube_config = match kubeconfig {
        Some(path) => {
            let wrap = |source| WatchError::Kubeconfig {
                path: path.to_owned(),
                source,
            };
            let file = kube::config::Kubeconfig::read_from(path).map_err(wrap)?;
            kube::Config::from_custom_kubeconfig(file, &Default::default())
                .await
                .map_err(wrap)?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(kube_config)?)
}

/// The output and when the first change not yet written came.
struct Rendering {
    writer: Writer,
    /// When the first change not yet in a written table came.
    pending_since: Option<Instant>,
    /// The networks with host bits set the last render used cleared: each is logged when
    /// a render first finds it, not again with every render.
    normalised: BTreeSet<Normalised>,
}

impl Rendering {
    /// Renders the stores and writes the table and its files if their bytes changed; false
    /// when a write failed (it is tried again).
    fn render(&mut self, stores: &[Store], target: &Target, metrics: &Metrics) -> bool {
        let rendered = translate(&snapshot(stores), target);
        let report = &rendered.report;
        for n in &report.normalised {
            if !self.normalised.contains(n) {
                tracing::warn!(
                    object = %n.object,
                    field = %n.field,
                    given = %n.given,
                    used = %n.used,
                    "a network with host bits set: its network is used"
                );
            }
        }
        self.normalised = report.normalised.iter().cloned().collect();
        let json = to_json(&rendered.table);
        let c = &metrics.controller;
        c.renders.inc();
        c.routes.set(report.routes as i64);
        c.skipped.clear();
        for (reason, n) in &report.skipped {
            c.skipped
                .get_or_create(&ReasonLabel {
                    reason: reason.as_str(),
                })
                .set(*n as i64);
        }
        let result = |result| ResultLabel { result };
        match self.writer.write(&json, &rendered.files) {
            Ok(written) if !written.changed() => {
                c.writes.get_or_create(&result("unchanged")).inc();
                self.pending_since = None;
                tracing::debug!(routes = report.routes, "table unchanged");
                true
            }
            Ok(Written {
                table,
                files,
                removed,
            }) => {
                c.writes.get_or_create(&result("written")).inc();
                if let Some(since) = self.pending_since.take() {
                    c.change_to_write.observe(since.elapsed().as_secs_f64());
                }
                tracing::info!(
                    routes = report.routes,
                    bytes = json.len(),
                    table,
                    files_written = files,
                    files_removed = removed,
                    skipped = %report.skipped_text(),
                    file = %self.writer.path().display(),
                    "routing table written"
                );
                true
            }
            Err(e) => {
                c.writes.get_or_create(&result("failed")).inc();
                tracing::error!(file = %self.writer.path().display(), error = %e, "writing the routing table failed");
                false
            }
        }
    }
}

/// Runs the controller until SIGTERM or SIGINT.
pub async fn run(config: ControllerConfig) -> Result<(), WatchError> {
    let Output::File(path) = config.output.clone() else {
        return Err(WatchError::NoOutput);
    };
    // The kubeconfig is read before the admin endpoint answers: a start that cannot use it
    // fails before anything is said to have started.
    let client = client(config.kubeconfig.as_deref()).await?;
    let metrics = Arc::new(Metrics::controller());
    let spec = Spec {
        metrics: metrics.clone(),
        admin: config.admin,
        debug: None,
        hangup: false,
        // Nothing to drain: the controller serves no connections.
        drain: None,
    };
    process::run(spec, move || {
        Ok(Starting {
            config,
            path,
            metrics,
            client,
        })
    })
    .await
}

/// The controller before it watches (its Kubernetes client built).
struct Starting {
    config: ControllerConfig,
    path: PathBuf,
    metrics: Arc<Metrics>,
    client: kube::Client,
}

impl Role for Starting {
    type Error = WatchError;
    type Serving = Watching;

    async fn serve(self, cx: &Context) -> Result<Watching, WatchError> {
        Ok(Watching {
            running: Some(Running {
                config: self.config,
                path: self.path,
                metrics: self.metrics,
                admin: cx.admin.clone(),
                client: self.client,
            }),
            discovered: false,
        })
    }
}

/// The watching controller.
struct Watching {
    /// What the watch loop takes when it starts.
    running: Option<Running>,
    /// Whether API discovery answered (the controller then says that it stopped).
    discovered: bool,
}

impl process::Serving for Watching {
    async fn run(&mut self) {
        if let Some(running) = self.running.take() {
            running.watch(&mut self.discovered).await;
        }
    }

    async fn stop(self) {
        if self.discovered {
            tracing::info!("controller stopped");
        }
    }
}

/// What the watch loop runs with.
struct Running {
    config: ControllerConfig,
    path: PathBuf,
    metrics: Arc<Metrics>,
    admin: Arc<AdminState>,
    client: kube::Client,
}

impl Running {
    /// Discovers the kinds, watches them and writes the table, until cancelled (at SIGTERM
    /// or SIGINT); `discovered` turns true once discovery answered.
    async fn watch(self, discovered_flag: &mut bool) {
        let Running {
            config,
            path,
            metrics,
            admin,
            client,
        } = self;
        let target = Target::from_config(&config);
        let mut stores: Vec<Store> = WATCHED.iter().map(|_| Store::default()).collect();
        // The kinds this configuration reads; the others are as good as listed, and empty.
        let watched: Vec<usize> = (0..WATCHED.len())
            .filter(|&i| WATCHED[i].is_watched(config.tunnel.is_some()))
            .collect();
        for (i, store) in stores.iter_mut().enumerate() {
            if !watched.contains(&i) {
                store.absent();
            }
        }
        let discovered = discover_all(&client, &watched).await;
        *discovered_flag = true;
        let mut watchers = Watchers::new(client.clone(), metrics.clone());
        for (i, resource) in discovered {
            let kind = WATCHED[i];
            match resource {
                Some(resource) => {
                    tracing::info!(kind = kind.kind, api_version = %resource.api_version, selector = kind.selector, "watching");
                    watchers.start(i, &resource);
                }
                None => {
                    tracing::warn!(
                        kind = kind.kind,
                        group = kind.group,
                        versions = ?kind.versions,
                        recheck = ?RECHECK,
                        "not served by the API server; treated as empty until it is"
                    );
                    stores[i].absent();
                    watchers.stop(i);
                }
            }
        }
        // Discovery of kinds not served (every RECHECK) and of kinds whose list or watch found
        // nothing (404), one task per question, at most one per kind at a time.
        let mut discoveries: tokio::task::JoinSet<Discovered> = tokio::task::JoinSet::new();
        let mut asking = vec![false; WATCHED.len()];
        let ask = |discoveries: &mut tokio::task::JoinSet<Discovered>, kinds: Vec<usize>| {
            let client = client.clone();
            discoveries.spawn(async move {
                let found = discover(&client, &kinds).await;
                (kinds, found)
            });
        };
        let mut recheck = tokio::time::interval_at(Instant::now() + RECHECK, RECHECK);
        recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut writer = Rendering {
            writer: Writer::new(path),
            pending_since: None,
            normalised: BTreeSet::new(),
        };
        let mut render_at: Option<Instant> = None;
        tracing::info!(
            kinds = watched.len(),
            tunnels = config.tunnel.is_some(),
            file = %writer.writer.path().display(),
            "controller watching"
        );
        // Nothing to wait for when no kind is served at all.
        if stores.iter().all(Store::synced) {
            render_at = Some(Instant::now());
        }
        loop {
            let mut changed = Vec::new();
            tokio::select! {
                Some((i, event)) = watchers.events.next() => {
                    let kind = WATCHED[i].kind;
                    let change = match event {
                        Ok(change) => change,
                        Err(e) => {
                            metrics.controller.watch_errors.get_or_create(&KindLabel { kind }).inc();
                            tracing::warn!(kind, error = %e, "watch failed; retrying");
                            if not_found(&e) && !asking[i] {
                                tracing::info!(kind, "not found at the version watched; looking for it again");
                                asking[i] = true;
                                ask(&mut discoveries, vec![i]);
                            }
                            continue;
                        }
                    };
                    let first_sync = matches!(change, Change::InitDone) && !stores[i].synced();
                    if stores[i].apply(change) {
                        changed.push(i);
                    }
                    if first_sync {
                        tracing::info!(kind, objects = stores[i].len(), "listed");
                    }
                }
                Some(Ok((kinds, found))) = discoveries.join_next() => {
                    for &i in &kinds {
                        asking[i] = false;
                    }
                    let found = match found {
                        Ok(found) => found,
                        Err(e) => {
                            tracing::warn!(error = %e, "API discovery failed; asking again later");
                            continue;
                        }
                    };
                    for (i, resource) in found {
                        let kind = WATCHED[i].kind;
                        let was = watchers.version(i);
                        match next(was, resource.as_ref().map(|r| r.version.as_str())) {
                            Next::Keep => {}
                            Next::Watch => {
                                let Some(resource) = resource else { continue };
                                match was {
                                    None => tracing::info!(kind, api_version = %resource.api_version, "now served; watching"),
                                    Some(was) => tracing::warn!(
                                        kind,
                                        was,
                                        api_version = %resource.api_version,
                                        "served at another version; watching it there"
                                    ),
                                }
                                // The store keeps its objects until the new watcher's list is done.
                                watchers.start(i, &resource);
                            }
                            Next::Stop => {
                                watchers.stop(i);
                                if kind == KEPT_WHEN_NOT_SERVED {
                                    tracing::warn!(
                                        kind,
                                        objects = stores[i].len(),
                                        recheck = ?RECHECK,
                                        "no longer served; keeping its last objects, which restrict shoots"
                                    );
                                    // Its relist, if one was under way, is abandoned.
                                    stores[i].buffer = None;
                                } else {
                                    tracing::warn!(
                                        kind,
                                        objects = stores[i].len(),
                                        recheck = ?RECHECK,
                                        "no longer served; its objects are gone"
                                    );
                                    if stores[i].clear() {
                                        changed.push(i);
                                    }
                                }
                            }
                        }
                    }
                }
                _ = recheck.tick() => {
                    let missing: Vec<usize> = watched
                        .iter()
                        .copied()
                        .filter(|&i| watchers.version(i).is_none() && !asking[i])
                        .collect();
                    if !missing.is_empty() {
                        for &i in &missing {
                            asking[i] = true;
                        }
                        ask(&mut discoveries, missing);
                    }
                }
                () = tokio::time::sleep_until(render_at.unwrap_or_else(Instant::now)), if render_at.is_some() => {
                    render_at = None;
                    if writer.render(&stores, &target, &metrics) {
                        admin.set_ready(true);
                    } else {
                        render_at = Some(Instant::now() + WRITE_RETRY);
                    }
                }
            }
            for &i in &changed {
                // A kind watched through several selectors: their objects together.
                let kind = WATCHED[i].kind;
                let objects: usize = (0..WATCHED.len())
                    .filter(|&j| WATCHED[j].kind == kind)
                    .map(|j| stores[j].len())
                    .sum();
                metrics
                    .controller
                    .objects
                    .get_or_create(&KindLabel { kind })
                    .set(objects as i64);
            }
            if !changed.is_empty() {
                writer.pending_since.get_or_insert_with(Instant::now);
                if stores.iter().all(Store::synced) {
                    render_at.get_or_insert_with(|| Instant::now() + DEBOUNCE);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::model::{Meta, Namespace};

    fn ns(name: &str, deleting: bool) -> (Key, Object) {
        let meta = Meta {
            name: name.into(),
            ..Meta::default()
        };
        (
            (String::new(), name.into()),
            Object::Namespace(Namespace { meta, deleting }),
        )
    }

    fn names(store: &Store) -> Vec<&str> {
        store.live.keys().map(|(_, n)| n.as_str()).collect()
    }

    #[test]
    fn a_relist_replaces_the_store_only_when_done() {
        let mut s = Store::default();
        assert!(!s.apply(Change::Init));
        let (k, o) = ns("a", false);
        assert!(!s.apply(Change::InitApply(k, o)));
        assert!(!s.synced() && s.is_empty(), "nothing before InitDone");
        assert!(s.apply(Change::InitDone), "the first list is a change");
        assert!(s.synced());
        let (k, o) = ns("b", false);
        assert!(s.apply(Change::Apply(k, o)));
        // A relist: a and b still exist, c is new. Until InitDone the store is unchanged.
        s.apply(Change::Init);
        for name in ["a", "b"] {
            let (k, o) = ns(name, false);
            s.apply(Change::InitApply(k, o));
        }
        assert_eq!(names(&s), ["a", "b"]);
        assert!(
            !s.apply(Change::InitDone),
            "the same objects listed again: no change"
        );
        // A relist that misses b (deleted while the watch was down) drops it at InitDone.
        s.apply(Change::Init);
        let (k, o) = ns("a", false);
        s.apply(Change::InitApply(k, o));
        assert_eq!(names(&s), ["a", "b"]);
        assert!(s.apply(Change::InitDone));
        assert_eq!(names(&s), ["a"]);
    }

    #[test]
    fn a_kind_no_longer_served_has_no_objects_and_counts_as_listed() {
        let mut s = Store::default();
        assert!(s.clear(), "never listed: now it is, empty");
        assert!(s.synced() && s.is_empty());
        assert!(!s.clear(), "already empty");
        let (k, o) = ns("a", false);
        s.apply(Change::Apply(k, o));
        // A relist under way is dropped with the objects.
        s.apply(Change::Init);
        let (k, o) = ns("b", false);
        s.apply(Change::InitApply(k, o));
        assert!(s.clear());
        assert!(s.is_empty());
        assert!(!s.apply(Change::InitDone), "nothing buffered");
    }

    #[test]
    fn discovery_moves_a_watcher_only_when_the_version_served_changes() {
        assert_eq!(next(Some("v1"), Some("v1")), Next::Keep);
        assert_eq!(next(None, None), Next::Keep);
        assert_eq!(next(Some("v1"), Some("v1beta1")), Next::Watch);
        assert_eq!(next(None, Some("v1")), Next::Watch);
        assert_eq!(next(Some("v1"), None), Next::Stop);
    }

    #[test]
    fn only_not_found_asks_discovery_again() {
        let status = |code| {
            Box::new(kube::core::Status {
                code,
                ..kube::core::Status::failure("x", "NotFound")
            })
        };
        let api = |code| kube::Error::Api(status(code));
        assert!(not_found(&watcher::Error::InitialListFailed(api(404))));
        assert!(not_found(&watcher::Error::WatchStartFailed(api(404))));
        assert!(not_found(&watcher::Error::WatchError(status(404))));
        assert!(!not_found(&watcher::Error::InitialListFailed(api(500))));
        assert!(!not_found(&watcher::Error::WatchError(status(410))));
        assert!(!not_found(&watcher::Error::NoResourceVersion));
    }

    #[test]
    fn unchanged_projections_are_no_change() {
        let mut s = Store::default();
        s.apply(Change::InitDone);
        let (k, o) = ns("a", false);
        assert!(s.apply(Change::Apply(k.clone(), o.clone())));
        assert!(!s.apply(Change::Apply(k.clone(), o)), "same projection");
        let (_, o) = ns("a", true);
        assert!(s.apply(Change::Apply(k.clone(), o)));
        assert!(s.apply(Change::Delete(k.clone())));
        assert!(!s.apply(Change::Delete(k)));
    }

    /// A Secret whose labels leave what translation reads is gone from its store, whether
    /// the watch says so (DELETED, the selector's view) or sends it changed.
    #[test]
    fn a_secret_that_no_longer_projects_is_deleted() {
        let peers = &WATCHED[9];
        assert_eq!(
            peers.selector,
            Some(super::super::kinds::TUNNEL_PEERS_SELECTOR)
        );
        let secret = |role: &str| {
            serde_json::json!({"metadata": {"name": "p", "namespace": "shoot--a--b",
                "labels": {"trellis.gardener.cloud/role": role}}, "data": {}})
        };
        let mut store = Store::default();
        store.apply(Change::InitDone);
        let add = convert(peers, "v1", Event::Apply(secret("tunnel-peers"))).unwrap();
        assert!(store.apply(add));
        assert_eq!(store.len(), 1);
        let changed = convert(peers, "v1", Event::Apply(secret("other"))).unwrap();
        assert!(matches!(changed, Change::Delete(_)), "{changed:?}");
        assert!(store.apply(changed));
        assert!(store.is_empty());
        store.apply(convert(peers, "v1", Event::Apply(secret("tunnel-peers"))).unwrap());
        let deleted = convert(peers, "v1", Event::Delete(secret("other"))).unwrap();
        assert!(store.apply(deleted));
        assert!(store.is_empty());
        // A list item that does not project is left out of the list.
        assert!(convert(peers, "v1", Event::InitApply(secret("other"))).is_none());
    }

    #[test]
    fn list_items_without_types_are_projected_as_their_kind() {
        let item = serde_json::json!({
            "metadata": {"name": "a", "creationTimestamp": "2024-01-01T00:00:00Z"},
        });
        let namespace = &WATCHED[6];
        assert_eq!(namespace.kind, "Namespace");
        let (key, object) = namespace.project("v1", &item).unwrap();
        assert_eq!(key, (String::new(), "a".to_owned()));
        let Some(Object::Namespace(n)) = object else {
            panic!("{object:?}")
        };
        assert_eq!(n.meta.created.as_deref(), Some("2024-01-01T00:00:00Z"));
        // A metadata-only object says `PartialObjectMetadata`; the watch knows better.
        let meta = serde_json::json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": "x-istio-tls-termination", "namespace": "x"}});
        let (_, object) = WATCHED[3].project("v1alpha3", &meta).unwrap();
        assert!(matches!(object, Some(Object::EnvoyFilter(_))), "{object:?}");
    }
}
