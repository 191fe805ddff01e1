//! The extension controller's live path: kube-rs watchers of Extensions (all namespaces),
//! Namespaces (their `extensions.gardener.cloud/<type>` labels) and kube-apiserver Pods
//! (`app=kubernetes,role=apiserver`, their addresses the webhooks' allowed callers), a work
//! queue of Extension keys with per-key exponential backoff, and a few workers running
//! [`Reconciler::reconcile`]. A key is never reconciled by two workers at once. A new CA
//! bundle reconciles every Extension served again (the webhook configurations carry it).
//! Watchers retry with kube's default backoff; a relist replaces what it lists.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use kube::api::{Api, DynamicObject};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use serde_json::Value;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::reconcile::{self, Outcome, ReconcileError, Reconciler, Renderer};
use super::role::ExtensionType;
use super::state::State;
use crate::config::extension::ExtensionConfig;

/// The label selector of the kube-apiserver pods of shoot namespaces.
pub const APISERVER_PODS: &str = "app=kubernetes,role=apiserver";

/// The queue's timing.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// The first retry after a failure; doubled per failure in a row.
    pub retry_base: Duration,
    /// The longest wait between retries.
    pub retry_max: Duration,
    /// How often a ManagedResource being deleted is looked at again (Gardener: 2 s).
    pub wait: Duration,
    /// Reconciliations at once.
    pub workers: usize,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(300),
            wait: Duration::from_secs(2),
            workers: 4,
        }
    }
}

impl Timing {
    /// The wait before retry number `failures` (1 for the first).
    pub fn backoff(&self, failures: u32) -> Duration {
        let factor = 1u32 << failures.saturating_sub(1).min(20);
        self.retry_base.saturating_mul(factor).min(self.retry_max)
    }
}

pub use crate::controller::watch::client;

/// The Extension controller, ready to run.
pub struct Controller {
    client: kube::Client,
    config: Arc<ExtensionConfig>,
    state: Arc<State>,
    renderer: Arc<dyn Renderer>,
    timing: Timing,
    synced: Option<oneshot::Sender<()>>,
}

impl Controller {
    /// A controller rendering with [`super::render::node`] and the default [`Timing`].
    pub fn new(client: kube::Client, config: Arc<ExtensionConfig>, state: Arc<State>) -> Self {
        Controller {
            client,
            config,
            state,
            renderer: reconcile::production_renderer(),
            timing: Timing::default(),
            synced: None,
        }
    }

    /// Says on `synced` when the controller is in step with the API server: the Extensions,
    /// Namespaces and kube-apiserver Pods watches have each listed, their contents are in the
    /// [`State`], and the state of the Extensions reconciled before (by an earlier process)
    /// was rebuilt (see [`Reconciler::rebuild`]). Until then the webhooks know no callers, no
    /// labels and no configured shoots: the process is not ready before.
    pub fn on_synced(mut self, synced: oneshot::Sender<()>) -> Self {
        self.synced = Some(synced);
        self
    }

    /// Renders with `renderer` instead.
    pub fn with_renderer(mut self, renderer: Arc<dyn Renderer>) -> Self {
        self.renderer = renderer;
        self
    }

    /// Uses `timing` instead.
    pub fn with_timing(mut self, timing: Timing) -> Self {
        self.timing = timing;
        self
    }

    /// Watches and reconciles until `stop` completes.
    pub async fn run(self, mut ca_bundle: watch::Receiver<String>, stop: impl Future<Output = ()>) {
        let Controller {
            client,
            config,
            state,
            renderer,
            timing,
            mut synced,
        } = self;
        let reconciler = Arc::new(Reconciler::new(
            client.clone(),
            config.clone(),
            state.clone(),
            renderer,
            ca_bundle.clone(),
            timing.wait,
        ));
        let all = |ar: &kube::api::ApiResource| Api::<DynamicObject>::all_with(client.clone(), ar);
        let mut extensions = watcher::watcher(
            all(&reconcile::extension_resource()),
            watcher::Config::default(),
        )
        .default_backoff()
        .boxed();
        let mut namespaces = watcher::watcher(
            all(&reconcile::resource("", "v1", "Namespace", "namespaces")),
            watcher::Config::default(),
        )
        .default_backoff()
        .boxed();
        let mut pods = watcher::watcher(
            all(&reconcile::resource("", "v1", "Pod", "pods")),
            watcher::Config::default().labels(APISERVER_PODS),
        )
        .default_backoff()
        .boxed();
        let types: Vec<ExtensionType> = config
            .types
            .iter()
            .filter_map(|t| ExtensionType::from_name(t))
            .collect();
        let mut seen = Seen::default();
        let mut labels = Labels::default();
        let mut callers = Callers::default();
        let mut queue = Queue::new(timing);
        let mut running: JoinSet<(Key, Result<Outcome, ReconcileError>)> = JoinSet::new();
        let mut ca_open = true;
        // The first list of Extensions done and the state rebuilt from it; no reconciliation
        // starts before (none races the rebuild).
        let mut extensions_synced = false;
        let mut rebuilding: Option<futures_util::future::BoxFuture<'static, ()>> = None;
        let (mut namespaces_listed, mut pods_listed) = (false, false);
        let mut stop = std::pin::pin!(stop);
        loop {
            if extensions_synced
                && namespaces_listed
                && pods_listed
                && let Some(synced) = synced.take()
            {
                let _ = synced.send(());
            }
            while extensions_synced && running.len() < timing.workers.max(1) {
                let Some(key) = queue.next() else { break };
                let r = reconciler.clone();
                running.spawn(async move {
                    let result = r.reconcile(&key.0, &key.1).await;
                    (key, result)
                });
            }
            let timer = queue.next_timer();
            tokio::select! {
                () = &mut stop => break,
                Some(e) = extensions.next() => match e {
                    Ok(e) => {
                        let changes = seen.apply(e, &config.types);
                        for ((ns, _), t) in changes.gone {
                            forget(&state, &ns, t);
                        }
                        if let Some(listed) = changes.first_list {
                            rebuilding = Some(Box::pin(rebuild(
                                reconciler.clone(),
                                listed,
                                timing.workers.max(1),
                            )));
                        }
                        for key in changes.queue {
                            queue.push(key);
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "watching Extensions"),
                },
                () = maybe(&mut rebuilding) => {
                    rebuilding = None;
                    extensions_synced = true;
                }
                Some(e) = namespaces.next() => match e {
                    Ok(e) => {
                        namespaces_listed |= matches!(e, Event::InitDone);
                        labels.apply(e, &types, &state);
                    }
                    Err(e) => tracing::warn!(error = %e, "watching Namespaces"),
                },
                Some(e) = pods.next() => match e {
                    Ok(e) => {
                        pods_listed |= matches!(e, Event::InitDone);
                        callers.apply(e, &state);
                    }
                    Err(e) => tracing::warn!(error = %e, "watching kube-apiserver Pods"),
                },
                changed = ca_bundle.changed(), if ca_open => match changed {
                    Ok(()) => {
                        for key in seen.keys() {
                            queue.push(key);
                        }
                    }
                    Err(_) => ca_open = false,
                },
                Some(done) = running.join_next() => match done {
                    Ok((key, result)) => queue.done(key, result),
                    Err(e) => tracing::error!(error = %e, "a reconciliation panicked"),
                },
                () = sleep_until(timer) => queue.fire(Instant::now()),
            }
        }
        running.abort_all();
    }
}

/// Completes with `f`, never without one.
async fn maybe(f: &mut Option<futures_util::future::BoxFuture<'static, ()>>) {
    match f {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// Rebuilds the state of each of `listed` (the first list of Extensions), `at_once` at a
/// time, writing nothing. One that fails is left to its next reconciliation.
async fn rebuild(reconciler: Arc<Reconciler>, listed: Vec<Value>, at_once: usize) {
    let n = futures_util::stream::iter(listed)
        .map(|ext| {
            let r = reconciler.clone();
            async move {
                let result = r.rebuild(&ext).await;
                if let Err(e) = &result {
                    let (ns, name) = key_of(&ext);
                    tracing::warn!(namespace = ns, name, error = %e, "rebuilding the webhooks' state");
                }
                matches!(result, Ok(true))
            }
        })
        .buffer_unordered(at_once)
        .filter(|ok| std::future::ready(*ok))
        .count()
        .await;
    tracing::info!(shoots = n, "webhooks' state rebuilt from the Extensions");
}

/// The webhooks of `t` stop mutating the shoot of `ns` (its Extension is gone).
fn forget(state: &State, ns: &str, t: ExtensionType) {
    state.update_shoot(ns, |s| {
        s.configured.remove(&t);
        match t {
            ExtensionType::Node => s.node = None,
        }
    });
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Runs the controller with production rendering and timing until `stop` completes.
pub async fn run(
    client: kube::Client,
    config: Arc<ExtensionConfig>,
    state: Arc<State>,
    ca_bundle: watch::Receiver<String>,
    synced: oneshot::Sender<()>,
    stop: impl Future<Output = ()>,
) {
    Controller::new(client, config, state)
        .on_synced(synced)
        .run(ca_bundle, stop)
        .await;
}

/// Namespace and name of an Extension.
type Key = (String, String);

fn key_of(o: &Value) -> Key {
    let s = |p: &str| {
        o.pointer(p)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    (s("/metadata/namespace"), s("/metadata/name"))
}

/// What the predicate compares of an Extension: its operation annotations and its status (a
/// missing status and a `null` one alike).
fn predicate_view(v: &Value) -> Value {
    let mut annotations = serde_json::Map::new();
    for k in [reconcile::OPERATION, reconcile::TIMESTAMP] {
        if let Some(a) = v.pointer("/metadata/annotations").and_then(|a| a.get(k)) {
            annotations.insert(k.to_owned(), a.clone());
        }
    }
    let mut view = serde_json::json!({ "metadata": { "annotations": annotations } });
    if let Some(s) = v.get("status").filter(|s| !s.is_null()) {
        view["status"] = s.clone();
    }
    view
}

/// What one Extensions watch event means.
#[derive(Debug, Default)]
struct Changes {
    /// Keys to reconcile.
    queue: Vec<Key>,
    /// Extensions gone (deleted, or missing from a relist): their shoots' state is cleared.
    gone: Vec<(Key, ExtensionType)>,
    /// The first list is done: the Extensions it listed (served ones), to rebuild the state.
    first_list: Option<Vec<Value>>,
}

/// The Extensions served, as last seen: their type and what the update predicate compares.
#[derive(Debug, Default)]
struct Seen {
    seen: HashMap<Key, (ExtensionType, Value)>,
    relist: Option<HashMap<Key, (ExtensionType, Value)>>,
    /// The objects of the first list, until it is done.
    first: Option<Vec<Value>>,
    listed: bool,
}

impl Seen {
    /// Applies one watch event.
    fn apply(&mut self, e: Event<DynamicObject>, types: &[String]) -> Changes {
        let mut out = Changes::default();
        let mut saw = |o: DynamicObject, into_relist: bool, this: &mut Seen| {
            let Ok(v) = serde_json::to_value(&o) else {
                return;
            };
            let Some(t) = reconcile::served_type(&v, types) else {
                return;
            };
            let key = key_of(&v);
            let old = this.seen.get(&key).map(|(_, old)| old);
            if reconcile::admit(old, &v) {
                out.queue.push(key.clone());
            }
            let view = predicate_view(&v);
            if into_relist {
                this.relist
                    .get_or_insert_with(HashMap::new)
                    .insert(key.clone(), (t, view.clone()));
                if !this.listed {
                    this.first.get_or_insert_with(Vec::new).push(v);
                }
            }
            this.seen.insert(key, (t, view));
        };
        match e {
            Event::Init => self.relist = Some(HashMap::new()),
            Event::InitApply(o) => saw(o, true, self),
            Event::InitDone => {
                let listed = self.relist.take().unwrap_or_default();
                out.gone = self
                    .seen
                    .iter()
                    .filter(|(k, _)| !listed.contains_key(*k))
                    .map(|(k, (t, _))| (k.clone(), *t))
                    .collect();
                self.seen = listed;
                if !self.listed {
                    self.listed = true;
                    out.first_list = Some(self.first.take().unwrap_or_default());
                }
            }
            Event::Apply(o) => saw(o, false, self),
            Event::Delete(o) => {
                if let Ok(v) = serde_json::to_value(&o) {
                    let key = key_of(&v);
                    if let Some((t, _)) = self.seen.remove(&key) {
                        out.gone.push((key, t));
                    }
                }
            }
        }
        out
    }

    fn keys(&self) -> Vec<Key> {
        self.seen.keys().cloned().collect()
    }
}

/// The types whose label each namespace carries.
#[derive(Debug, Default)]
struct Labels {
    labelled: BTreeMap<String, BTreeSet<ExtensionType>>,
    relist: Option<BTreeMap<String, BTreeSet<ExtensionType>>>,
}

impl Labels {
    fn apply(&mut self, e: Event<DynamicObject>, types: &[ExtensionType], state: &State) {
        let of = |o: &DynamicObject| -> (String, BTreeSet<ExtensionType>) {
            let labels = o.metadata.labels.as_ref();
            let set = types
                .iter()
                .copied()
                .filter(|t| {
                    labels
                        .and_then(|l| l.get(&t.namespace_label()))
                        .is_some_and(|v| v == "true")
                })
                .collect();
            (o.metadata.name.clone().unwrap_or_default(), set)
        };
        match e {
            Event::Init => self.relist = Some(BTreeMap::new()),
            Event::InitApply(o) => {
                let (ns, set) = of(&o);
                if !set.is_empty() {
                    self.relist
                        .get_or_insert_with(BTreeMap::new)
                        .insert(ns, set);
                }
            }
            Event::InitDone => {
                let listed = self.relist.take().unwrap_or_default();
                let gone: Vec<String> = self
                    .labelled
                    .keys()
                    .filter(|ns| !listed.contains_key(*ns))
                    .cloned()
                    .collect();
                for ns in gone {
                    self.set(&ns, BTreeSet::new(), state);
                }
                for (ns, set) in listed {
                    self.set(&ns, set, state);
                }
            }
            Event::Apply(o) => {
                let (ns, set) = of(&o);
                self.set(&ns, set, state);
            }
            Event::Delete(o) => {
                let (ns, _) = of(&o);
                self.set(&ns, BTreeSet::new(), state);
            }
        }
    }

    fn set(&mut self, ns: &str, set: BTreeSet<ExtensionType>, state: &State) {
        let now = state
            .shoot(ns)
            .map(|s| s.labelled.clone())
            .unwrap_or_default();
        if now != set {
            let new = set.clone();
            state.update_shoot(ns, |s| s.labelled = new.clone());
        }
        if set.is_empty() {
            self.labelled.remove(ns);
        } else {
            self.labelled.insert(ns.to_owned(), set);
        }
    }
}

/// The addresses of each namespace's kube-apiserver pods.
#[derive(Debug, Default)]
struct Callers {
    pods: BTreeMap<String, BTreeMap<String, BTreeSet<IpAddr>>>,
    relist: Option<BTreeMap<String, BTreeMap<String, BTreeSet<IpAddr>>>>,
}

/// The addresses of a kube-apiserver pod. A pod that has ended (phase `Failed`, e.g.
/// evicted, or `Succeeded`) has none: it keeps its `podIP`, which the network may give to
/// another pod. A pod being deleted (a `deletionTimestamp`) keeps its addresses: it serves,
/// and calls the webhooks, until its graceful termination ends; it goes with its Delete event.
fn pod_ips(o: &DynamicObject) -> BTreeSet<IpAddr> {
    let status = o.data.get("status");
    if matches!(
        status.and_then(|s| s.get("phase")).and_then(Value::as_str),
        Some("Failed" | "Succeeded")
    ) {
        return BTreeSet::new();
    }
    let mut ips: BTreeSet<IpAddr> = status
        .and_then(|s| s.get("podIPs"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|p| p.get("ip").and_then(Value::as_str)?.parse().ok())
        .collect();
    if let Some(ip) = status
        .and_then(|s| s.get("podIP"))
        .and_then(Value::as_str)
        .and_then(|s| s.parse().ok())
    {
        ips.insert(ip);
    }
    ips
}

impl Callers {
    fn apply(&mut self, e: Event<DynamicObject>, state: &State) {
        let id = |o: &DynamicObject| {
            (
                o.metadata.namespace.clone().unwrap_or_default(),
                o.metadata.name.clone().unwrap_or_default(),
            )
        };
        match e {
            Event::Init => self.relist = Some(BTreeMap::new()),
            Event::InitApply(o) => {
                let (ns, name) = id(&o);
                self.relist
                    .get_or_insert_with(BTreeMap::new)
                    .entry(ns)
                    .or_default()
                    .insert(name, pod_ips(&o));
            }
            Event::InitDone => {
                let listed = self.relist.take().unwrap_or_default();
                let namespaces: BTreeSet<String> =
                    self.pods.keys().chain(listed.keys()).cloned().collect();
                self.pods = listed;
                for ns in namespaces {
                    self.publish(&ns, state);
                }
            }
            Event::Apply(o) => {
                let (ns, name) = id(&o);
                self.pods
                    .entry(ns.clone())
                    .or_default()
                    .insert(name, pod_ips(&o));
                self.publish(&ns, state);
            }
            Event::Delete(o) => {
                let (ns, name) = id(&o);
                if let Some(pods) = self.pods.get_mut(&ns) {
                    pods.remove(&name);
                    if pods.is_empty() {
                        self.pods.remove(&ns);
                    }
                }
                self.publish(&ns, state);
            }
        }
    }

    fn publish(&self, ns: &str, state: &State) {
        let ips = self
            .pods
            .get(ns)
            .map(|pods| pods.values().flatten().copied().collect())
            .unwrap_or_default();
        state.set_callers(ns, ips);
    }
}

/// Keys to reconcile: ready ones in order, delayed ones by time, none twice at once.
#[derive(Debug)]
struct Queue {
    timing: Timing,
    ready: VecDeque<Key>,
    queued: HashSet<Key>,
    running: HashSet<Key>,
    /// Keys that came again while running: queued when they finish.
    again: HashSet<Key>,
    delayed: BTreeMap<(Instant, u64), Key>,
    seq: u64,
    failures: HashMap<Key, u32>,
}

impl Queue {
    fn new(timing: Timing) -> Queue {
        Queue {
            timing,
            ready: VecDeque::new(),
            queued: HashSet::new(),
            running: HashSet::new(),
            again: HashSet::new(),
            delayed: BTreeMap::new(),
            seq: 0,
            failures: HashMap::new(),
        }
    }

    fn push(&mut self, key: Key) {
        if self.running.contains(&key) {
            self.again.insert(key);
        } else if self.queued.insert(key.clone()) {
            self.ready.push_back(key);
        }
    }

    fn next(&mut self) -> Option<Key> {
        let key = self.ready.pop_front()?;
        self.queued.remove(&key);
        self.running.insert(key.clone());
        Some(key)
    }

    fn later(&mut self, key: Key, after: Duration) {
        self.seq += 1;
        self.delayed.insert((Instant::now() + after, self.seq), key);
    }

    fn done(&mut self, key: Key, result: Result<Outcome, ReconcileError>) {
        self.running.remove(&key);
        match result {
            Ok(Outcome::Done) => {
                self.failures.remove(&key);
            }
            Ok(Outcome::Requeue(after)) => {
                self.failures.remove(&key);
                self.later(key.clone(), after);
            }
            Err(e) => {
                let n = self.failures.entry(key.clone()).or_insert(0);
                *n += 1;
                let after = self.timing.backoff(*n);
                tracing::warn!(namespace = key.0, name = key.1, error = %e, retry_in = ?after, "reconciling the Extension");
                self.later(key.clone(), after);
            }
        }
        if self.again.remove(&key) {
            self.push(key);
        }
    }

    fn next_timer(&self) -> Option<Instant> {
        self.delayed.keys().next().map(|(at, _)| *at)
    }

    fn fire(&mut self, now: Instant) {
        while let Some(entry) = self.delayed.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let key = entry.remove();
            self.push(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: &str) -> Key {
        ("ns".into(), n.into())
    }

    #[test]
    fn a_running_key_is_not_handed_out_twice_and_runs_again_after() {
        let mut q = Queue::new(Timing::default());
        q.push(key("a"));
        q.push(key("a"));
        assert_eq!(q.next(), Some(key("a")));
        assert_eq!(q.next(), None);
        q.push(key("a"));
        assert_eq!(q.next(), None, "running");
        q.done(key("a"), Ok(Outcome::Done));
        assert_eq!(q.next(), Some(key("a")));
    }

    #[test]
    fn backoff_doubles_up_to_the_maximum() {
        let t = Timing {
            retry_base: Duration::from_millis(100),
            retry_max: Duration::from_secs(1),
            ..Timing::default()
        };
        assert_eq!(t.backoff(1), Duration::from_millis(100));
        assert_eq!(t.backoff(2), Duration::from_millis(200));
        assert_eq!(t.backoff(4), Duration::from_millis(800));
        assert_eq!(t.backoff(5), Duration::from_secs(1));
        assert_eq!(t.backoff(100), Duration::from_secs(1));
    }
}
