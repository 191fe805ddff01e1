//! The Extension controller's contract with Gardener: which `extensions.gardener.cloud/v1alpha1
//! Extension`s it acts on and when, and what one reconciliation of one Extension writes.
//! It follows gardener/gardener v1.149.3: `extensions/pkg/controller/extension/reconciler.go`
//! (finalizer, then status `Processing`, the actuator, then `Succeeded` or `Error`; delete,
//! migrate, restore), `extensions/pkg/predicate/default.go` (when an event is acted on),
//! `pkg/controllerutils/reconciler/operation_annotation_wrapper.go` (the `reconcile`
//! annotation removed first), `extensions/pkg/controller/status.go` (the status written),
//! `pkg/api/core/v1beta1/helper/common.go` (`ComputeOperationType`) and
//! `extensions/pkg/controller/shoot.go` (`IsShootFailed`).
//!
//! The decisions are pure functions of the objects ([`admit`], [`operation`], [`served_type`],
//! [`shoot_failed`], [`update_time`]); [`Reconciler`] does the I/O of one key. It never
//! watches: [`super::watch`] feeds it keys and retries it.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams};
use serde_json::{Map, Value, json};
use tokio::sync::watch;

use super::render::{self, NodeInput, RenderError, Rendered};
use super::role::ExtensionType;
use super::state::{NodeShoot, State};
use crate::config::extension::ExtensionConfig;

/// The finalizer the controller puts on the Extensions it acts on.
pub const FINALIZER: &str = "extensions.gardener.cloud/trellis";
/// The annotation gardenlet sets to ask for an operation.
pub const OPERATION: &str = "gardener.cloud/operation";
/// The annotation gardenlet sets with the time it asked (RFC 3339, nanoseconds).
pub const TIMESTAMP: &str = "gardener.cloud/timestamp";
/// The label on every object the controller writes, and its value.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "trellis-extension");
/// The field manager of the controller's server-side applies.
pub const FIELD_MANAGER: &str = "trellis-extension";

/// `extensions.gardener.cloud/v1alpha1 Extension`.
pub fn extension_resource() -> ApiResource {
    resource(
        "extensions.gardener.cloud",
        "v1alpha1",
        "Extension",
        "extensions",
    )
}

/// `extensions.gardener.cloud/v1alpha1 Cluster` (cluster-scoped, named after the shoot
/// namespace).
pub fn cluster_resource() -> ApiResource {
    resource(
        "extensions.gardener.cloud",
        "v1alpha1",
        "Cluster",
        "clusters",
    )
}

/// `resources.gardener.cloud/v1alpha1 ManagedResource`.
pub fn managed_resource_resource() -> ApiResource {
    resource(
        "resources.gardener.cloud",
        "v1alpha1",
        "ManagedResource",
        "managedresources",
    )
}

/// `v1 Secret`.
pub fn secret_resource() -> ApiResource {
    resource("", "v1", "Secret", "secrets")
}

/// A resource by its names.
pub fn resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: group.to_owned(),
        version: version.to_owned(),
        api_version: if group.is_empty() {
            version.to_owned()
        } else {
            format!("{group}/{version}")
        },
        kind: kind.to_owned(),
        plural: plural.to_owned(),
    }
}

/// What a reconciliation does (`status.lastOperation.type`), as Gardener's
/// `ComputeOperationType` decides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// No last operation yet, or a create that has not succeeded.
    Create,
    /// Anything else.
    Reconcile,
    /// The Extension is being deleted.
    Delete,
    /// `gardener.cloud/operation: migrate`, or a migration not yet succeeded.
    Migrate,
    /// `gardener.cloud/operation: restore`, or a restoration not yet succeeded.
    Restore,
}

impl Operation {
    /// As written in `lastOperation.type`.
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Create => "Create",
            Operation::Reconcile => "Reconcile",
            Operation::Delete => "Delete",
            Operation::Migrate => "Migrate",
            Operation::Restore => "Restore",
        }
    }
}

fn text<'a>(v: &'a Value, pointer: &str) -> Option<&'a str> {
    v.pointer(pointer).and_then(Value::as_str)
}

fn annotation<'a>(ext: &'a Value, key: &str) -> Option<&'a str> {
    ext.pointer("/metadata/annotations")
        .and_then(|a| a.get(key))
        .and_then(Value::as_str)
}

fn deleting(ext: &Value) -> bool {
    ext.pointer("/metadata/deletionTimestamp")
        .is_some_and(|v| !v.is_null())
}

/// The operation a reconciliation of `ext` performs (Gardener's `ComputeOperationType`).
pub fn operation(ext: &Value) -> Operation {
    let op = annotation(ext, OPERATION);
    let last_type = text(ext, "/status/lastOperation/type");
    let succeeded = text(ext, "/status/lastOperation/state") == Some("Succeeded");
    match (op, last_type) {
        (Some("migrate"), _) => Operation::Migrate,
        _ if deleting(ext) => Operation::Delete,
        (Some("restore"), _) => Operation::Restore,
        (_, None) => Operation::Create,
        (_, Some("Create")) if !succeeded => Operation::Create,
        (_, Some("Migrate")) if !succeeded => Operation::Migrate,
        (_, Some("Restore")) if !succeeded => Operation::Restore,
        _ => Operation::Reconcile,
    }
}

/// Whether `ext` was migrated away (its last operation a succeeded Migrate): then only a
/// migrate or restore is done (Gardener's `ShouldSkipOperation`).
pub fn skip(op: Operation, ext: &Value) -> bool {
    let migrated = text(ext, "/status/lastOperation/type") == Some("Migrate")
        && text(ext, "/status/lastOperation/state") == Some("Succeeded");
    migrated && !matches!(op, Operation::Migrate | Operation::Restore)
}

/// Whether a watch event of an Extension starts a reconciliation (Gardener's default
/// controller predicate, the operation annotation honoured): `old` is the object as last
/// seen (`None`: first seen, a create event, as on a controller's start). A create is acted
/// on with an operation annotation (`reconcile`, `migrate`, `restore`), a deletion timestamp,
/// or a last operation that did not succeed (or none); an update only with an operation
/// annotation, or a deletion timestamp and an unchanged status. A newer generation alone
/// is not acted on: gardenlet annotates what it wants reconciled.
///
/// On an update the annotation counts only when it was added or changed (its value, or
/// `gardener.cloud/timestamp`, gardenlet asking again): `migrate` and `restore` stay on the
/// object while they run, and the controller's own status writes must not queue the key
/// again (a full Reconcile would follow every Restore). A missing status and a `null` one
/// are the same.
pub fn admit(old: Option<&Value>, new: &Value) -> bool {
    let asked = matches!(
        annotation(new, OPERATION),
        Some("reconcile" | "migrate" | "restore")
    );
    let status = |v: &Value| v.get("status").filter(|s| !s.is_null()).cloned();
    match old {
        None => {
            asked || deleting(new) || text(new, "/status/lastOperation/state") != Some("Succeeded")
        }
        Some(old) => {
            let asked_anew = asked
                && (annotation(old, OPERATION) != annotation(new, OPERATION)
                    || annotation(old, TIMESTAMP) != annotation(new, TIMESTAMP));
            asked_anew || (deleting(new) && status(old) == status(new))
        }
    }
}

/// Whether the webhooks' state of `ext` is rebuilt from it on a start (without a write):
/// reconciled by this controller (its finalizer on), its last operation Succeeded, not being
/// deleted, not migrated away and no migration asked for.
pub fn restorable(ext: &Value) -> bool {
    let ours = ext
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| f.iter().any(|f| f.as_str() == Some(FINALIZER)));
    let op = operation(ext);
    ours && text(ext, "/status/lastOperation/state") == Some("Succeeded")
        && !deleting(ext)
        && !matches!(op, Operation::Migrate | Operation::Delete)
        && !skip(op, ext)
}

/// The type of `ext` if it is one this controller serves (`types`) and of class `shoot`
/// (or none, which means `shoot`).
pub fn served_type(ext: &Value, types: &[String]) -> Option<ExtensionType> {
    let name = text(ext, "/spec/type")?;
    if !types.iter().any(|t| t == name) {
        return None;
    }
    match ext.pointer("/spec/class") {
        None | Some(Value::Null) => {}
        Some(c) if c.as_str() == Some("shoot") => {}
        Some(_) => return None,
    }
    ExtensionType::from_name(name)
}

/// Whether the shoot of a `Cluster` failed (`spec.shoot.status.lastOperation.state` is
/// `Failed`, Gardener's `IsShootFailed`): its Extensions are left alone.
pub fn shoot_failed(cluster: &Value) -> bool {
    text(cluster, "/spec/shoot/status/lastOperation/state") == Some("Failed")
}

/// The `lastUpdateTime` written at `now` for an Extension whose `gardener.cloud/timestamp`
/// is `timestamp`: whole seconds (as Kubernetes writes times), and never before the
/// timestamp (gardenlet's health check wants `lastUpdateTime` ≥ the timestamp truncated to
/// seconds; a gardenlet clock ahead of ours would otherwise never see the operation done).
pub fn update_time(now: Timestamp, timestamp: Option<&str>) -> String {
    let asked = timestamp.and_then(|t| t.parse::<Timestamp>().ok());
    let at = asked.map_or(now, |a| a.max(now));
    Timestamp::from_second(at.as_second())
        .unwrap_or(now)
        .to_string()
}

/// The rendering of a shoot's objects, replaceable for tests.
pub trait Renderer: Send + Sync {
    /// Renders the node role's objects (as [`render::node`]).
    fn node(&self, input: &NodeInput<'_>) -> Result<Rendered, RenderError>;
}

impl<F> Renderer for F
where
    F: Fn(&NodeInput<'_>) -> Result<Rendered, RenderError> + Send + Sync,
{
    fn node(&self, input: &NodeInput<'_>) -> Result<Rendered, RenderError> {
        self(input)
    }
}

/// The renderer of production: [`render::node`].
pub fn production_renderer() -> Arc<dyn Renderer> {
    Arc::new(render::node)
}

/// Why a reconciliation failed: said in `lastError` and retried.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// A request to the API server failed.
    #[error("{what}: {source}")]
    Api {
        /// What was asked (verb and object).
        what: String,
        /// The client's error.
        source: kube::Error,
    },
    /// The shoot's `Cluster` does not exist.
    #[error("Cluster {0} not found")]
    NoCluster(String),
    /// The objects could not be rendered (the shoot's or the Extension's configuration).
    #[error("rendering: {0}")]
    Render(#[from] RenderError),
    /// An object could not be encoded.
    #[error("encoding: {0}")]
    Encode(#[from] serde_json::Error),
}

impl ReconcileError {
    /// Gardener's error codes for `lastError.codes`.
    fn codes(&self) -> Vec<&'static str> {
        match self {
            ReconcileError::Render(_) => vec!["ERR_CONFIGURATION_PROBLEM"],
            _ => Vec::new(),
        }
    }
}

fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> ReconcileError {
    let what = what.into();
    move |source| ReconcileError::Api { what, source }
}

fn not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// What is next for a key after a reconciliation that did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing until the next event.
    Done,
    /// Again after this long (waiting for something, e.g. a ManagedResource to go).
    Requeue(Duration),
}

/// One reconciliation of one Extension at a time: reads it and its `Cluster`, writes its
/// finalizer, status, the shoot's Secret and ManagedResource, and the shared [`State`].
pub struct Reconciler {
    client: kube::Client,
    config: Arc<ExtensionConfig>,
    state: Arc<State>,
    renderer: Arc<dyn Renderer>,
    ca_bundle: watch::Receiver<String>,
    wait: Duration,
}

impl Reconciler {
    /// A reconciler writing through `client`, rendering with `renderer` and the current CA
    /// bundle of `ca_bundle`, polling a ManagedResource being deleted every `wait`.
    pub fn new(
        client: kube::Client,
        config: Arc<ExtensionConfig>,
        state: Arc<State>,
        renderer: Arc<dyn Renderer>,
        ca_bundle: watch::Receiver<String>,
        wait: Duration,
    ) -> Reconciler {
        Reconciler {
            client,
            config,
            state,
            renderer,
            ca_bundle,
            wait,
        }
    }

    fn extensions(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), ns, &extension_resource())
    }

    fn managed_resources(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), ns, &managed_resource_resource())
    }

    fn secrets(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), ns, &secret_resource())
    }

    /// Renders the objects of `ext` (of type `t`, in `ns`) with the current CA bundle.
    fn render(
        &self,
        ns: &str,
        t: ExtensionType,
        ext: &Value,
        cluster: &Value,
    ) -> Result<Rendered, ReconcileError> {
        let config = &self.config;
        let ca = self.ca_bundle.borrow().clone();
        let input = NodeInput {
            extension_namespace: &config.namespace,
            service: &config.webhook.service,
            shoot_namespace: ns,
            ca_bundle: &ca,
            image: &config.image,
            cluster,
            provider_config: ext.pointer("/spec/providerConfig").filter(|v| !v.is_null()),
        };
        Ok(match t {
            ExtensionType::Node => self.renderer.node(&input)?,
        })
    }

    /// The webhooks of `t` mutate the shoot of `ns` with `node`.
    fn configured(&self, ns: &str, t: ExtensionType, node: NodeShoot) {
        self.state.update_shoot(ns, |s| {
            s.configured.insert(t);
            s.node = Some(node.clone());
        });
    }

    /// Rebuilds the webhooks' state of `ext` (as listed on a start) if it is [`restorable`],
    /// writing nothing to the API server: reads its Cluster, renders with the current CA
    /// bundle. The Extensions whose last operation succeeded are not reconciled on a start
    /// (Gardener's predicate), so without this the webhooks would not mutate their shoots
    /// until gardenlet annotates them again. True if the state was set.
    pub async fn rebuild(&self, ext: &Value) -> Result<bool, ReconcileError> {
        let Some(t) = served_type(ext, &self.config.types) else {
            return Ok(false);
        };
        if !restorable(ext) {
            return Ok(false);
        }
        let ns = text(ext, "/metadata/namespace").unwrap_or("");
        let Some(cluster) =
            Api::<DynamicObject>::all_with(self.client.clone(), &cluster_resource())
                .get_opt(ns)
                .await
                .map_err(api(format!("get Cluster {ns}")))?
        else {
            return Err(ReconcileError::NoCluster(ns.to_owned()));
        };
        let cluster = serde_json::to_value(&cluster)?;
        let rendered = self.render(ns, t, ext, &cluster)?;
        self.configured(ns, t, rendered.node);
        Ok(true)
    }

    /// Reconciles the Extension `ns/name` as it is now.
    pub async fn reconcile(&self, ns: &str, name: &str) -> Result<Outcome, ReconcileError> {
        let exts = self.extensions(ns);
        let Some(ext) = exts
            .get_opt(name)
            .await
            .map_err(api(format!("get Extension {ns}/{name}")))?
        else {
            return Ok(Outcome::Done);
        };
        let ext = serde_json::to_value(&ext)?;
        let Some(t) = served_type(&ext, &self.config.types) else {
            return Ok(Outcome::Done);
        };
        if annotation(&ext, OPERATION) == Some("wait-for-state") {
            return Ok(Outcome::Done);
        }
        let cluster = Api::<DynamicObject>::all_with(self.client.clone(), &cluster_resource())
            .get_opt(ns)
            .await
            .map_err(api(format!("get Cluster {ns}")))?
            .map(|c| serde_json::to_value(&c))
            .transpose()?;
        if cluster.as_ref().is_some_and(shoot_failed) {
            tracing::info!(
                namespace = ns,
                name,
                "skipping the Extension of a failed shoot"
            );
            return Ok(Outcome::Done);
        }
        let op = operation(&ext);
        let mut job = Job {
            r: self,
            exts,
            ns,
            name,
            t,
            op,
            ext,
        };
        if skip(op, &job.ext) {
            // Migrated away: only the `reconcile` annotation goes (Gardener's wrapper removes
            // it before the reconciler skips).
            job.start(false).await?;
            return Ok(Outcome::Done);
        }
        let result = match op {
            Operation::Migrate => job.migrate().await,
            Operation::Delete => job.delete().await,
            _ => job.reconcile(cluster.as_ref()).await,
        };
        // An Error status only on an Extension carrying the finalizer (or one being deleted
        // or migrated): a first patch that failed (a conflict) is just retried, the status
        // of an Extension this controller has not taken yet stays untouched.
        let taken = job.finalizers().iter().any(|f| f == FINALIZER)
            || matches!(op, Operation::Delete | Operation::Migrate);
        if let (Err(e), true) = (&result, taken) {
            let description = format!("Error during {}: {e}", op.as_str().to_lowercase());
            let lost = job.status_error(&description, e.codes()).await;
            if let Err(status) = lost {
                tracing::warn!(namespace = ns, name, error = %status, "writing the error status");
            }
        }
        result
    }
}

/// One reconciliation in progress.
struct Job<'a> {
    r: &'a Reconciler,
    exts: Api<DynamicObject>,
    ns: &'a str,
    name: &'a str,
    t: ExtensionType,
    op: Operation,
    /// The Extension as last read or written.
    ext: Value,
}

impl Job<'_> {
    fn finalizers(&self) -> Vec<String> {
        self.ext
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .map(|f| {
                f.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// A merge patch of the Extension's metadata, on the version read (a concurrent change
    /// of the finalizers is a conflict, retried, never overwritten).
    async fn patch_meta(&mut self, mut metadata: Map<String, Value>) -> Result<(), ReconcileError> {
        if let Some(rv) = self.ext.pointer("/metadata/resourceVersion") {
            metadata.insert("resourceVersion".into(), rv.clone());
        }
        let patch = json!({ "metadata": metadata });
        let what = format!("patch Extension {}/{}", self.ns, self.name);
        let obj = self
            .exts
            .patch(self.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await;
        self.patched(obj, what)
    }

    /// Keeps the Extension as a patch returned it.
    fn patched(
        &mut self,
        obj: Result<DynamicObject, kube::Error>,
        what: String,
    ) -> Result<(), ReconcileError> {
        self.ext = serde_json::to_value(&obj.map_err(api(what))?)?;
        Ok(())
    }

    /// The first write: the `reconcile` annotation removed (as Gardener's wrapper does before
    /// anything else) and, with `finalizer`, the finalizer added, in one patch.
    async fn start(&mut self, finalizer: bool) -> Result<(), ReconcileError> {
        let mut metadata = Map::new();
        if annotation(&self.ext, OPERATION) == Some("reconcile") {
            metadata.insert("annotations".into(), json!({ OPERATION: null }));
        }
        let mut finalizers = self.finalizers();
        if finalizer && !finalizers.iter().any(|f| f == FINALIZER) {
            finalizers.push(FINALIZER.to_owned());
            metadata.insert("finalizers".into(), json!(finalizers));
        }
        if metadata.is_empty() {
            return Ok(());
        }
        self.patch_meta(metadata).await
    }

    fn last_operation(&self, state: &str, progress: u32, description: &str) -> Value {
        json!({
            "type": self.op.as_str(),
            "state": state,
            "progress": progress,
            "description": description,
            "lastUpdateTime": update_time(Timestamp::now(), annotation(&self.ext, TIMESTAMP)),
        })
    }

    async fn status(&mut self, status: Value) -> Result<(), ReconcileError> {
        let patch = json!({ "status": status });
        let what = format!("patch status of Extension {}/{}", self.ns, self.name);
        let obj = self
            .exts
            .patch_status(self.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await;
        self.patched(obj, what)
    }

    /// `Processing`, unless the last operation already says so (a deletion waiting for its
    /// ManagedResource writes it once).
    async fn processing(&mut self, description: &str) -> Result<(), ReconcileError> {
        if text(&self.ext, "/status/lastOperation/type") == Some(self.op.as_str())
            && text(&self.ext, "/status/lastOperation/state") == Some("Processing")
        {
            return Ok(());
        }
        let last = self.last_operation("Processing", 1, description);
        self.status(json!({ "lastOperation": last })).await
    }

    async fn succeeded(&mut self, description: &str) -> Result<(), ReconcileError> {
        let last = self.last_operation("Succeeded", 100, description);
        let generation = self.ext.pointer("/metadata/generation").cloned();
        self.status(json!({
            "lastOperation": last,
            "lastError": null,
            "observedGeneration": generation,
        }))
        .await
    }

    async fn status_error(
        &mut self,
        description: &str,
        codes: Vec<&'static str>,
    ) -> Result<(), ReconcileError> {
        let last = self.last_operation("Error", 50, description);
        let mut error = json!({
            "description": description,
            "lastUpdateTime": last["lastUpdateTime"].clone(),
        });
        if !codes.is_empty() {
            error["codes"] = json!(codes);
        }
        let generation = self.ext.pointer("/metadata/generation").cloned();
        self.status(json!({
            "lastOperation": last,
            "lastError": error,
            "observedGeneration": generation,
        }))
        .await
    }

    /// Create, Reconcile, Restore.
    async fn reconcile(&mut self, cluster: Option<&Value>) -> Result<Outcome, ReconcileError> {
        self.start(true).await?;
        let what = match self.op {
            Operation::Restore => "Restoring the Extension",
            _ => "Reconciling the Extension",
        };
        self.processing(what).await?;
        if self.op == Operation::Restore {
            self.restore_keys();
        }
        let cluster = cluster.ok_or_else(|| ReconcileError::NoCluster(self.ns.to_owned()))?;
        let rendered = self.r.render(self.ns, self.t, &self.ext, cluster)?;
        self.write_managed_resource(&rendered.objects).await?;
        self.r.configured(self.ns, self.t, rendered.node);
        let done = match self.op {
            Operation::Restore => "Successfully restored the Extension",
            _ => "Successfully reconciled the Extension",
        };
        self.succeeded(done).await?;
        if self.op == Operation::Restore && annotation(&self.ext, OPERATION) == Some("restore") {
            self.patch_meta(Map::from_iter([(
                "annotations".to_owned(),
                json!({ OPERATION: null }),
            )]))
            .await?;
        }
        Ok(Outcome::Done)
    }

    /// Regenerates the type's key material on a restore. The node role holds none; a role
    /// with keys (the VPN's) regenerates them here.
    fn restore_keys(&self) {
        match self.t {
            ExtensionType::Node => {}
        }
    }

    /// The Secret holding `objects` and the ManagedResource delivering it to the shoot.
    async fn write_managed_resource(&self, objects: &[Value]) -> Result<(), ReconcileError> {
        let name = self.t.managed_resource();
        let labels = json!({ MANAGED_BY.0: MANAGED_BY.1 });
        let secret = json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": { "name": name, "namespace": self.ns, "labels": labels },
            "type": "Opaque",
            "data": secret_data(objects)?,
        });
        let apply = PatchParams::apply(FIELD_MANAGER).force();
        self.r
            .secrets(self.ns)
            .patch(&name, &apply, &Patch::Apply(&secret))
            .await
            .map_err(api(format!("apply Secret {}/{name}", self.ns)))?;
        let mut mr_labels = labels.clone();
        mr_labels["origin"] = json!(MANAGED_BY.1);
        let mr = json!({
            "apiVersion": "resources.gardener.cloud/v1alpha1",
            "kind": "ManagedResource",
            "metadata": { "name": name, "namespace": self.ns, "labels": mr_labels },
            "spec": {
                "secretRefs": [{ "name": name }],
                "keepObjects": false,
                "injectLabels": { "shoot.gardener.cloud/no-cleanup": "true" },
            },
        });
        self.r
            .managed_resources(self.ns)
            .patch(&name, &apply, &Patch::Apply(&mr))
            .await
            .map_err(api(format!("apply ManagedResource {}/{name}", self.ns)))?;
        Ok(())
    }

    /// Deletes the Secret, then the ManagedResource (Gardener's order); true once the
    /// ManagedResource is gone (gardener-resource-manager removes its finalizer when it has
    /// deleted, or with `keep` left, the shoot's objects).
    async fn remove_managed_resource(&self, keep: bool) -> Result<bool, ReconcileError> {
        let name = self.t.managed_resource();
        let mrs = self.r.managed_resources(self.ns);
        if keep {
            let patch = json!({ "spec": { "keepObjects": true } });
            match mrs
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Err(e) if !not_found(&e) => {
                    return Err(api(format!("keep objects of ManagedResource {name}"))(e));
                }
                _ => {}
            }
        }
        match self
            .r
            .secrets(self.ns)
            .delete(&name, &DeleteParams::default())
            .await
        {
            Err(e) if !not_found(&e) => {
                return Err(api(format!("delete Secret {}/{name}", self.ns))(e));
            }
            _ => {}
        }
        match mrs.delete(&name, &DeleteParams::default()).await {
            Err(e) if !not_found(&e) => {
                return Err(api(format!("delete ManagedResource {}/{name}", self.ns))(e));
            }
            _ => {}
        }
        let left = mrs
            .get_opt(&name)
            .await
            .map_err(api(format!("get ManagedResource {}/{name}", self.ns)))?;
        Ok(left.is_none())
    }

    /// The webhooks stop mutating this shoot for this type.
    fn forget(&self) {
        let t = self.t;
        self.r.state.update_shoot(self.ns, |s| {
            s.configured.remove(&t);
            match t {
                ExtensionType::Node => s.node = None,
            }
        });
    }

    async fn delete(&mut self) -> Result<Outcome, ReconcileError> {
        self.start(false).await?;
        if !self.finalizers().iter().any(|f| f == FINALIZER) {
            return Ok(Outcome::Done);
        }
        self.processing("Deleting the Extension").await?;
        self.forget();
        if !self.remove_managed_resource(false).await? {
            return Ok(Outcome::Requeue(self.r.wait));
        }
        self.succeeded("Successfully deleted the Extension").await?;
        let rest: Vec<String> = self
            .finalizers()
            .into_iter()
            .filter(|f| f != FINALIZER)
            .collect();
        self.patch_meta(Map::from_iter([("finalizers".to_owned(), json!(rest))]))
            .await?;
        Ok(Outcome::Done)
    }

    async fn migrate(&mut self) -> Result<Outcome, ReconcileError> {
        self.start(false).await?;
        self.processing("Migrating the Extension").await?;
        self.forget();
        if !self.remove_managed_resource(true).await? {
            return Ok(Outcome::Requeue(self.r.wait));
        }
        self.succeeded("Successfully migrated the Extension")
            .await?;
        let mut metadata = Map::new();
        metadata.insert("finalizers".into(), Value::Null);
        if annotation(&self.ext, OPERATION) == Some("migrate") {
            metadata.insert("annotations".into(), json!({ OPERATION: null }));
        }
        self.patch_meta(metadata).await?;
        Ok(Outcome::Done)
    }
}

/// The Secret's `data`: one key per object, `<kind>__<name>.yaml` (cluster-scoped) or
/// `<kind>__<namespace>__<name>.yaml` (kind in lower case), each the object as JSON (which
/// is YAML), base64-encoded.
pub fn secret_data(objects: &[Value]) -> Result<Map<String, Value>, serde_json::Error> {
    let mut data = Map::new();
    for o in objects {
        let kind = text(o, "/kind").unwrap_or("object").to_lowercase();
        let name = text(o, "/metadata/name").unwrap_or("").replace(':', "_");
        let key = match text(o, "/metadata/namespace") {
            Some(ns) if !ns.is_empty() => format!("{kind}__{ns}__{name}.yaml"),
            _ => format!("{kind}__{name}.yaml"),
        };
        let bytes = serde_json::to_vec_pretty(o)?;
        data.insert(
            key,
            Value::String(base64::engine::general_purpose::STANDARD.encode(bytes)),
        );
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(v: Value) -> Value {
        v
    }

    #[test]
    fn operation_follows_compute_operation_type() {
        let none = ext(json!({"metadata": {}}));
        assert_eq!(operation(&none), Operation::Create);
        let ok = json!({"metadata": {}, "status": {"lastOperation": {"type": "Create", "state": "Succeeded"}}});
        assert_eq!(operation(&ok), Operation::Reconcile);
        let failed_create = json!({"metadata": {}, "status": {"lastOperation": {"type": "Create", "state": "Error"}}});
        assert_eq!(operation(&failed_create), Operation::Create);
        let migrating =
            json!({"metadata": {"annotations": {OPERATION: "migrate"}, "deletionTimestamp": "x"}});
        assert_eq!(operation(&migrating), Operation::Migrate);
        let deleting =
            json!({"metadata": {"annotations": {OPERATION: "restore"}, "deletionTimestamp": "x"}});
        assert_eq!(operation(&deleting), Operation::Delete);
        let restore = json!({"metadata": {"annotations": {OPERATION: "restore"}}, "status": {"lastOperation": {"type": "Reconcile", "state": "Succeeded"}}});
        assert_eq!(operation(&restore), Operation::Restore);
        let unfinished = json!({"metadata": {}, "status": {"lastOperation": {"type": "Restore", "state": "Error"}}});
        assert_eq!(operation(&unfinished), Operation::Restore);
        let migrated = json!({"metadata": {}, "status": {"lastOperation": {"type": "Migrate", "state": "Succeeded"}}});
        assert!(skip(operation(&migrated), &migrated));
        assert!(!skip(Operation::Restore, &migrated));
    }

    #[test]
    fn admit_is_gardeners_default_predicate() {
        let succeeded =
            json!({"metadata": {}, "status": {"lastOperation": {"state": "Succeeded"}}});
        let failed = json!({"metadata": {}, "status": {"lastOperation": {"state": "Error"}}});
        // Create events: failed or never run, deleting, annotated.
        assert!(!admit(None, &succeeded));
        assert!(admit(None, &failed));
        assert!(admit(None, &json!({"metadata": {}})));
        // Update events: a failed one is not retried by events (that is the queue's job).
        assert!(!admit(Some(&failed), &failed));
        let mut annotated = succeeded.clone();
        annotated["metadata"]["annotations"] = json!({OPERATION: "reconcile"});
        assert!(admit(Some(&succeeded), &annotated));
        annotated["metadata"]["annotations"] = json!({OPERATION: "wait-for-state"});
        assert!(!admit(Some(&succeeded), &annotated));
        // A generation bump alone is not acted on.
        let mut bumped = succeeded.clone();
        bumped["metadata"]["generation"] = json!(2);
        assert!(!admit(Some(&succeeded), &bumped));
        let mut deleting = succeeded.clone();
        deleting["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
        assert!(admit(Some(&succeeded), &deleting));
        assert!(
            !admit(Some(&failed), &deleting),
            "status changed: our own write"
        );
        // An annotation that stays (migrate, restore) does not admit our own status writes.
        let mut restoring = succeeded.clone();
        restoring["metadata"]["annotations"] = json!({OPERATION: "restore"});
        let mut written = restoring.clone();
        written["status"]["lastOperation"]["state"] = json!("Processing");
        assert!(admit(None, &restoring));
        assert!(admit(Some(&succeeded), &restoring), "newly added");
        assert!(!admit(Some(&restoring), &written), "unchanged");
        let mut again = written.clone();
        again["metadata"]["annotations"][TIMESTAMP] = json!("2025-01-01T00:00:00Z");
        assert!(admit(Some(&written), &again), "asked again");
        // A missing status is a null one.
        let mut gone = json!({"metadata": {"deletionTimestamp": "x"}});
        assert!(admit(Some(&json!({"metadata": {}, "status": null})), &gone));
        gone["status"] = Value::Null;
        assert!(admit(Some(&json!({"metadata": {}})), &gone));
    }

    #[test]
    fn served_types_and_classes() {
        let types = vec!["trellis-node".to_owned()];
        let e = |spec: Value| json!({"spec": spec});
        assert_eq!(
            served_type(&e(json!({"type": "trellis-node"})), &types),
            Some(ExtensionType::Node)
        );
        assert_eq!(
            served_type(
                &e(json!({"type": "trellis-node", "class": "shoot"})),
                &types
            ),
            Some(ExtensionType::Node)
        );
        assert_eq!(
            served_type(&e(json!({"type": "trellis-node", "class": "seed"})), &types),
            None
        );
        assert_eq!(
            served_type(&e(json!({"type": "shoot-dns-service"})), &types),
            None
        );
        assert_eq!(served_type(&e(json!({"type": "trellis-node"})), &[]), None);
    }

    #[test]
    fn update_time_is_never_before_the_timestamp() {
        let now: Timestamp = "2025-03-01T10:00:00.700Z"
            .parse()
            .unwrap_or(Timestamp::UNIX_EPOCH);
        assert_eq!(update_time(now, None), "2025-03-01T10:00:00Z");
        assert_eq!(
            update_time(now, Some("2025-03-01T09:00:00.123456789Z")),
            "2025-03-01T10:00:00Z"
        );
        assert_eq!(
            update_time(now, Some("2025-03-01T10:00:05.999999999Z")),
            "2025-03-01T10:00:05Z"
        );
        assert_eq!(update_time(now, Some("not a time")), "2025-03-01T10:00:00Z");
    }

    #[test]
    fn failed_shoots() {
        let c = |state: &str| json!({"spec": {"shoot": {"status": {"lastOperation": {"state": state}}}}});
        assert!(shoot_failed(&c("Failed")));
        assert!(!shoot_failed(&c("Error")));
        assert!(!shoot_failed(&json!({"spec": {}})));
    }

    #[test]
    fn secret_keys_name_kind_namespace_and_name() {
        let objects = [
            json!({"kind": "MutatingWebhookConfiguration", "metadata": {"name": "trellis-node"}}),
            json!({"kind": "ConfigMap", "metadata": {"name": "trellis-node", "namespace": "kube-system"}}),
        ];
        let data = secret_data(&objects).unwrap_or_default();
        let keys: Vec<&String> = data.keys().collect();
        assert_eq!(
            keys,
            [
                "configmap__kube-system__trellis-node.yaml",
                "mutatingwebhookconfiguration__trellis-node.yaml"
            ]
        );
    }
}
