//! The fake API server's state: objects as JSON, one resourceVersion counter for all of them
//! (as etcd has), the event log that watches replay, label and field selectors, merge patch and
//! a small server-side apply. No networking here.

use std::collections::{BTreeMap, HashMap};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};

/// One resource the fake serves. Every version of a resource reads and writes the same objects
/// (as the API server's storage does); `apiVersion` is rewritten to the version asked for.
#[derive(Debug)]
pub(crate) struct Resource {
    pub(crate) group: &'static str,
    /// Served versions, preferred first.
    pub(crate) versions: &'static [&'static str],
    pub(crate) plural: &'static str,
    pub(crate) kind: &'static str,
    pub(crate) namespaced: bool,
    pub(crate) short: &'static [&'static str],
    /// Whether it has a `status` subresource: writes to the object keep its status, writes to
    /// `/status` change only the status, and `metadata.generation` counts spec changes.
    pub(crate) status: bool,
}

impl Resource {
    const fn with_status(self) -> Resource {
        Resource {
            status: true,
            ..self
        }
    }
}

/// Which part of an object a write may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// The object through its main resource: its `status` is kept where there is a status
    /// subresource.
    Main,
    /// The `/status` subresource: only `status` changes.
    Status,
    /// Everything (the test's own writes).
    All,
}

const fn r(
    group: &'static str,
    versions: &'static [&'static str],
    plural: &'static str,
    kind: &'static str,
    namespaced: bool,
    short: &'static [&'static str],
) -> Resource {
    Resource {
        group,
        versions,
        plural,
        kind,
        namespaced,
        short,
        status: false,
    }
}

/// What the controller reads and writes in a seed. Add a line to serve another resource.
#[rustfmt::skip]
pub(crate) const RESOURCES: &[Resource] = &[
    r("", &["v1"], "namespaces", "Namespace", false, &["ns"]),
    r("", &["v1"], "services", "Service", true, &["svc"]),
    r("", &["v1"], "configmaps", "ConfigMap", true, &["cm"]),
    r("", &["v1"], "secrets", "Secret", true, &[]),
    r("discovery.k8s.io", &["v1"], "endpointslices", "EndpointSlice", true, &[]),
    r("networking.istio.io", &["v1", "v1beta1"], "gateways", "Gateway", true, &["gw"]),
    r("networking.istio.io", &["v1", "v1beta1"], "virtualservices", "VirtualService", true, &["vs"]),
    r("networking.istio.io", &["v1", "v1beta1"], "destinationrules", "DestinationRule", true, &["dr"]),
    // Istio serves EnvoyFilter only as v1alpha3.
    r("networking.istio.io", &["v1alpha3"], "envoyfilters", "EnvoyFilter", true, &[]),
    r("gateway.networking.k8s.io", &["v1", "v1alpha2"], "tlsroutes", "TLSRoute", true, &[]),
    r("coordination.k8s.io", &["v1"], "leases", "Lease", true, &[]),
    r("extensions.gardener.cloud", &["v1alpha1"], "clusters", "Cluster", false, &[]),
    // What the Gardener extension reads and writes.
    r("extensions.gardener.cloud", &["v1alpha1"], "extensions", "Extension", true, &[]).with_status(),
    r("resources.gardener.cloud", &["v1alpha1"], "managedresources", "ManagedResource", true, &["mr"]),
    r("admissionregistration.k8s.io", &["v1"], "mutatingwebhookconfigurations", "MutatingWebhookConfiguration", false, &[]),
    r("apps", &["v1"], "daemonsets", "DaemonSet", true, &["ds"]),
    r("apps", &["v1"], "deployments", "Deployment", true, &["deploy"]),
    r("apps", &["v1"], "statefulsets", "StatefulSet", true, &["sts"]),
    r("", &["v1"], "pods", "Pod", true, &["po"]),
];

/// Index into [`RESOURCES`].
pub(crate) type Rid = usize;

/// The resource served at `group`/`version` under `plural`.
pub(crate) fn find(group: &str, version: &str, plural: &str) -> Option<Rid> {
    RESOURCES
        .iter()
        .position(|r| r.group == group && r.plural == plural && r.versions.contains(&version))
}

/// The resource of an object's `apiVersion` and `kind`.
pub(crate) fn find_kind(api_version: &str, kind: &str) -> Option<Rid> {
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    RESOURCES
        .iter()
        .position(|r| r.group == group && r.kind == kind && r.versions.contains(&version))
}

/// `group/version`, or `version` for the core group.
pub(crate) fn group_version(group: &str, version: &str) -> String {
    if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    }
}

/// An error the API answers with a `Status` object.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub(crate) code: u16,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

impl ApiError {
    pub(crate) fn new(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            reason,
            message: message.into(),
        }
    }
    pub(crate) fn gone(message: impl Into<String>) -> ApiError {
        ApiError::new(410, "Expired", message)
    }
    pub(crate) fn not_found(rid: Rid, name: &str) -> ApiError {
        let r = &RESOURCES[rid];
        let what = if r.group.is_empty() {
            r.plural.to_string()
        } else {
            format!("{}.{}", r.plural, r.group)
        };
        ApiError::new(404, "NotFound", format!("{what} \"{name}\" not found"))
    }
    /// The `Status` object.
    pub(crate) fn status(&self) -> Value {
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": self.message, "reason": self.reason, "code": self.code})
    }
}

/// What a watch event says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, as watches replay it.
#[derive(Debug)]
pub(crate) struct Event {
    pub(crate) rv: u64,
    pub(crate) rid: Rid,
    pub(crate) kind: EventType,
    /// The object after the change (for a deletion: the last state, with the new version).
    pub(crate) object: Value,
    /// The object before a modification, so that a filtered watch can tell an object that
    /// leaves the selection (DELETED) from one that enters it (ADDED).
    pub(crate) prev: Option<Value>,
}

type Key = (String, String);

/// Every object, the counter and the log.
#[derive(Debug, Default)]
pub(crate) struct Store {
    /// The last resourceVersion handed out.
    pub(crate) rv: u64,
    /// Watches and continue tokens from before this version get 410.
    pub(crate) compacted: u64,
    uids: u64,
    objects: HashMap<Rid, BTreeMap<Key, Value>>,
    pub(crate) log: Vec<Event>,
    /// Per object and field manager: the configuration it last applied.
    applied: HashMap<(Rid, Key), BTreeMap<String, Value>>,
}

fn meta(obj: &Value, field: &str) -> Option<String> {
    obj.pointer(&format!("/metadata/{field}"))?
        .as_str()
        .map(str::to_string)
}

fn set_meta(obj: &mut Value, field: &str, value: Value) {
    if !obj.is_object() {
        *obj = json!({});
    }
    let m = obj
        .as_object_mut()
        .map(|o| o.entry("metadata").or_insert_with(|| json!({})));
    if let Some(Value::Object(m)) = m {
        m.insert(field.to_string(), value);
    }
}

impl Store {
    pub(crate) fn get(&self, rid: Rid, ns: &str, name: &str) -> Option<&Value> {
        self.objects
            .get(&rid)?
            .get(&(ns.to_string(), name.to_string()))
    }

    /// Stores `new` (or deletes, with `None`) under the next resourceVersion and logs the event.
    fn commit(&mut self, rid: Rid, key: Key, new: Option<Value>) -> Value {
        self.rv += 1;
        let rv = Value::String(self.rv.to_string());
        let objects = self.objects.entry(rid).or_default();
        let prev = objects.get(&key).cloned();
        let (kind, object) = match (new, prev.clone()) {
            (Some(mut obj), prev) => {
                set_meta(&mut obj, "resourceVersion", rv);
                let kind = if prev.is_some() {
                    EventType::Modified
                } else {
                    EventType::Added
                };
                objects.insert(key, obj.clone());
                (kind, obj)
            }
            (None, Some(mut old)) => {
                set_meta(&mut old, "resourceVersion", rv);
                objects.remove(&key);
                self.applied.remove(&(rid, key));
                (EventType::Deleted, old)
            }
            (None, None) => unreachable!("commit deletes only objects that exist"),
        };
        let prev = if kind == EventType::Modified {
            prev
        } else {
            None
        };
        self.log.push(Event {
            rv: self.rv,
            rid,
            kind,
            object: object.clone(),
            prev,
        });
        object
    }

    /// Fills in what the server owns on a new object: namespace, uid, creation time.
    fn admit(&mut self, rid: Rid, ns: &str, obj: &mut Value) -> Result<Key, ApiError> {
        let r = &RESOURCES[rid];
        let name = meta(obj, "name").filter(|n| !n.is_empty());
        let name =
            name.ok_or_else(|| ApiError::new(422, "Invalid", "metadata.name: Required value"))?;
        let ns = match meta(obj, "namespace") {
            _ if !r.namespaced => String::new(),
            Some(body) if !ns.is_empty() && body != ns => {
                let msg = "the namespace of the object does not match the namespace of the URL";
                return Err(ApiError::new(400, "BadRequest", msg));
            }
            body => body.unwrap_or_else(|| ns.to_string()),
        };
        if r.namespaced && ns.is_empty() {
            return Err(ApiError::new(
                422,
                "Invalid",
                "metadata.namespace: Required value",
            ));
        }
        if r.namespaced {
            set_meta(obj, "namespace", Value::String(ns.clone()));
        }
        if let Some(o) = obj.as_object_mut() {
            o.insert("kind".into(), Value::String(r.kind.into()));
            o.insert(
                "apiVersion".into(),
                Value::String(group_version(r.group, r.versions[0])),
            );
        }
        Ok((ns, name))
    }

    /// POST: a new object; 409 AlreadyExists if the name is taken. Through the main resource
    /// (`part` [`Part::Main`]) of a resource with a status subresource, the status is dropped.
    pub(crate) fn create(
        &mut self,
        rid: Rid,
        ns: &str,
        mut obj: Value,
        part: Part,
    ) -> Result<Value, ApiError> {
        let key = self.admit(rid, ns, &mut obj)?;
        if self.get(rid, &key.0, &key.1).is_some() {
            let msg = format!("{} \"{}\" already exists", RESOURCES[rid].plural, key.1);
            return Err(ApiError::new(409, "AlreadyExists", msg));
        }
        if part == Part::Status {
            return Err(ApiError::not_found(rid, &key.1));
        }
        self.uids += 1;
        set_meta(
            &mut obj,
            "uid",
            Value::String(format!("00000000-0000-4000-8000-{:012x}", self.uids)),
        );
        set_meta(&mut obj, "creationTimestamp", Value::String(now_rfc3339()));
        if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
            m.remove("deletionTimestamp");
        }
        if RESOURCES[rid].status {
            if part == Part::Main
                && let Some(o) = obj.as_object_mut()
            {
                o.remove("status");
            }
            set_meta(&mut obj, "generation", json!(1));
        }
        Ok(self.commit(rid, key, Some(obj)))
    }

    /// PUT: replaces an object; 409 Conflict if the body names a resourceVersion that is not
    /// the current one (optimistic concurrency, what leader election relies on). With a status
    /// subresource, [`Part::Main`] keeps the stored status and counts a changed spec in
    /// `metadata.generation`, [`Part::Status`] changes the status only. `deletionTimestamp` is
    /// the server's; an object being deleted whose last finalizer this removes is deleted.
    pub(crate) fn update(
        &mut self,
        rid: Rid,
        ns: &str,
        name: &str,
        mut obj: Value,
        part: Part,
    ) -> Result<Value, ApiError> {
        let key = self.admit(rid, ns, &mut obj)?;
        if key.1 != name {
            return Err(ApiError::new(
                400,
                "BadRequest",
                "the name of the object does not match the URL",
            ));
        }
        let old = self
            .get(rid, &key.0, name)
            .ok_or_else(|| ApiError::not_found(rid, name))?;
        if let Some(rv) = meta(&obj, "resourceVersion")
            && Some(rv) != meta(old, "resourceVersion")
        {
            let msg = format!(
                "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                RESOURCES[rid].plural
            );
            return Err(ApiError::new(409, "Conflict", msg));
        }
        let old = old.clone();
        if RESOURCES[rid].status {
            match part {
                Part::Status => {
                    let status = obj.get("status").cloned();
                    obj = old.clone();
                    if let Some(o) = obj.as_object_mut() {
                        match status {
                            Some(s) => o.insert("status".into(), s),
                            None => o.remove("status"),
                        };
                    }
                }
                Part::Main | Part::All => {
                    if part == Part::Main
                        && let Some(o) = obj.as_object_mut()
                    {
                        match old.get("status") {
                            Some(s) => o.insert("status".into(), s.clone()),
                            None => o.remove("status"),
                        };
                    }
                    let generation = old
                        .pointer("/metadata/generation")
                        .and_then(Value::as_i64)
                        .unwrap_or(1);
                    let bump = i64::from(spec(&obj) != spec(&old));
                    set_meta(&mut obj, "generation", json!(generation + bump));
                }
            }
        }
        for field in ["uid", "creationTimestamp", "deletionTimestamp"] {
            match old.pointer(&format!("/metadata/{field}")).cloned() {
                Some(v) => set_meta(&mut obj, field, v),
                None => {
                    if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                        m.remove(field);
                    }
                }
            }
        }
        let done = obj.pointer("/metadata/deletionTimestamp").is_some() && finalizers(&obj) == 0;
        let stored = self.commit(rid, key.clone(), Some(obj));
        if done {
            self.commit(rid, key, None);
        }
        Ok(stored)
    }

    /// Create or replace, whatever the version: the handle's write.
    pub(crate) fn upsert(&mut self, rid: Rid, obj: Value) -> Result<Value, ApiError> {
        let (ns, name) = (
            meta(&obj, "namespace").unwrap_or_default(),
            meta(&obj, "name").unwrap_or_default(),
        );
        match self.get(rid, &ns, &name) {
            Some(_) => {
                let mut obj = obj;
                if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                    m.remove("resourceVersion");
                }
                self.update(rid, &ns, &name, obj, Part::All)
            }
            None => self.create(rid, &ns, obj, Part::All),
        }
    }

    /// DELETE: an object with finalizers gets a `deletionTimestamp` (once) and stays until an
    /// update removes the last of them; any other goes at once.
    pub(crate) fn delete(&mut self, rid: Rid, ns: &str, name: &str) -> Result<Value, ApiError> {
        let key = (ns.to_string(), name.to_string());
        let Some(obj) = self.get(rid, ns, name).cloned() else {
            return Err(ApiError::not_found(rid, name));
        };
        if finalizers(&obj) == 0 {
            return Ok(self.commit(rid, key, None));
        }
        if obj.pointer("/metadata/deletionTimestamp").is_some() {
            return Ok(obj);
        }
        let mut obj = obj;
        set_meta(&mut obj, "deletionTimestamp", Value::String(now_rfc3339()));
        if RESOURCES[rid].status {
            let generation = obj
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            set_meta(&mut obj, "generation", json!(generation + 1));
        }
        Ok(self.commit(rid, key, Some(obj)))
    }

    /// `application/merge-patch+json` (RFC 7386).
    pub(crate) fn merge_patch(
        &mut self,
        rid: Rid,
        ns: &str,
        name: &str,
        patch: &Value,
        part: Part,
    ) -> Result<Value, ApiError> {
        let mut obj = self
            .get(rid, ns, name)
            .cloned()
            .ok_or_else(|| ApiError::not_found(rid, name))?;
        merge(&mut obj, patch, true);
        if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
            // A patch that names a version is a precondition; one that does not is not.
            if patch.pointer("/metadata/resourceVersion").is_none() {
                m.remove("resourceVersion");
            }
        }
        self.update(rid, ns, name, obj, part)
    }

    /// Server-side apply: creates the object or merges the applied fields into it. A field
    /// another manager applied with a different value is a 409 Conflict unless `force`, which
    /// takes the field over. Fields this manager applied before and applies no more are removed
    /// unless another manager applied them too. Lists are atomic (replaced whole).
    pub(crate) fn apply(
        &mut self,
        rid: Rid,
        ns: &str,
        name: &str,
        mut patch: Value,
        manager: &str,
        force: bool,
    ) -> Result<(Value, bool), ApiError> {
        if !patch.is_object() {
            return Err(ApiError::new(
                400,
                "BadRequest",
                "apply patch is not an object",
            ));
        }
        if meta(&patch, "name").is_some_and(|n| n != name) {
            return Err(ApiError::new(
                400,
                "BadRequest",
                "the name of the object does not match the URL",
            ));
        }
        let precondition = meta(&patch, "resourceVersion");
        if let Some(m) = patch.get_mut("metadata").and_then(Value::as_object_mut) {
            for server_owned in [
                "resourceVersion",
                "uid",
                "creationTimestamp",
                "managedFields",
            ] {
                m.remove(server_owned);
            }
        }
        let key = (
            if RESOURCES[rid].namespaced {
                ns.to_string()
            } else {
                String::new()
            },
            name.to_string(),
        );
        let managers = self
            .applied
            .get(&(rid, key.clone()))
            .cloned()
            .unwrap_or_default();
        let mut leaves = Vec::new();
        paths(&patch, &mut Vec::new(), &mut leaves);
        let mut conflicts = Vec::new();
        let mut managers_after = managers.clone();
        for (other, config) in managers.iter().filter(|(m, _)| *m != manager) {
            for (path, value) in &leaves {
                if let Some(theirs) = at(config, path)
                    && theirs != *value
                {
                    if force {
                        if let Some(c) = managers_after.get_mut(other) {
                            remove(c, path);
                        }
                    } else {
                        conflicts.push(format!("conflict with \"{other}\": .{}", path.join(".")));
                    }
                }
            }
        }
        if !conflicts.is_empty() {
            let msg = format!(
                "Apply failed with {} conflict(s): {}",
                conflicts.len(),
                conflicts.join(", ")
            );
            return Err(ApiError::new(409, "Conflict", msg));
        }
        let existing = self.get(rid, &key.0, name).cloned();
        if let (Some(want), Some(cur)) = (&precondition, &existing)
            && Some(want) != meta(cur, "resourceVersion").as_ref()
        {
            return Err(ApiError::new(
                409,
                "Conflict",
                "the object has been modified",
            ));
        }
        let created = existing.is_none();
        let mut obj = existing.unwrap_or_else(|| json!({"metadata": {"name": name}}));
        if let Some(before) = managers.get(manager) {
            let mut dropped = Vec::new();
            paths(before, &mut Vec::new(), &mut dropped);
            for (path, _) in dropped {
                let kept = at(&patch, &path).is_some()
                    || managers_after
                        .iter()
                        .any(|(m, c)| m != manager && at(c, &path).is_some());
                if !kept {
                    remove(&mut obj, &path);
                }
            }
        }
        merge(&mut obj, &patch, false);
        managers_after.insert(manager.to_string(), patch);
        let fields: Vec<Value> = managers_after
            .iter()
            .map(|(m, c)| {
                json!({"manager": m, "operation": "Apply", "apiVersion": c.get("apiVersion"),
                                 "fieldsType": "FieldsV1", "fieldsV1": fields_v1(c)})
            })
            .collect();
        set_meta(&mut obj, "managedFields", Value::Array(fields));
        let result = if created {
            self.create(rid, &key.0, obj, Part::Main)?
        } else {
            if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                m.remove("resourceVersion");
            }
            self.update(rid, &key.0, name, obj, Part::Main)?
        };
        self.applied.insert((rid, key), managers_after);
        Ok((result, created))
    }

    /// Objects of one resource, in one namespace or all (`ns` empty), in key order.
    pub(crate) fn list<'a>(
        &'a self,
        rid: Rid,
        ns: &'a str,
    ) -> impl Iterator<Item = (&'a Key, &'a Value)> + 'a {
        self.objects
            .get(&rid)
            .into_iter()
            .flatten()
            .filter(move |(k, _)| ns.is_empty() || k.0 == ns)
    }

    /// Forgets the log: watches and continue tokens from before now get 410.
    pub(crate) fn compact(&mut self) {
        self.log.clear();
        self.compacted = self.rv;
    }
}

/// How many finalizers an object has.
fn finalizers(obj: &Value) -> usize {
    obj.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map_or(0, Vec::len)
}

/// What `metadata.generation` counts: everything but metadata and status.
fn spec(obj: &Value) -> Value {
    let mut obj = obj.clone();
    if let Some(o) = obj.as_object_mut() {
        for k in ["metadata", "status", "apiVersion", "kind"] {
            o.remove(k);
        }
    }
    obj
}

/// Merges `patch` into `obj`: objects recursively, everything else replaced; with `nulls`
/// (merge patch), a null deletes the field.
fn merge(obj: &mut Value, patch: &Value, nulls: bool) {
    match (obj, patch) {
        (Value::Object(o), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() && nulls {
                    o.remove(k);
                } else if v.is_object() && o.get(k).is_some_and(Value::is_object) {
                    if let Some(slot) = o.get_mut(k) {
                        merge(slot, v, nulls);
                    }
                } else {
                    o.insert(k.clone(), v.clone());
                }
            }
        }
        (obj, patch) => *obj = patch.clone(),
    }
}

/// Every leaf of `v` (scalars and lists) with its path.
fn paths(v: &Value, prefix: &mut Vec<String>, out: &mut Vec<(Vec<String>, Value)>) {
    match v {
        Value::Object(o) if !o.is_empty() => {
            for (k, v) in o {
                if prefix.is_empty() && (k == "apiVersion" || k == "kind") {
                    continue;
                }
                prefix.push(k.clone());
                paths(v, prefix, out);
                prefix.pop();
            }
        }
        v => out.push((prefix.clone(), v.clone())),
    }
}

fn at(v: &Value, path: &[String]) -> Option<Value> {
    path.iter().try_fold(v, |v, k| v.get(k)).cloned()
}

fn remove(v: &mut Value, path: &[String]) {
    if let Some((last, parents)) = path.split_last() {
        let parent = parents.iter().try_fold(v, |v, k| v.get_mut(k));
        if let Some(Value::Object(o)) = parent {
            o.remove(last);
        }
    }
}

/// The `fieldsV1` form of an applied configuration: `{"f:data": {"f:key": {}}}`.
fn fields_v1(v: &Value) -> Value {
    let mut out = Map::new();
    if let Value::Object(o) = v {
        for (k, v) in o.iter().filter(|(k, _)| *k != "apiVersion" && *k != "kind") {
            out.insert(format!("f:{k}"), fields_v1(v));
        }
    }
    Value::Object(out)
}

/// One requirement of a label selector.
#[derive(Debug, Clone)]
enum LabelReq {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    Absent(String),
}

/// A parsed `labelSelector` and `fieldSelector` (`metadata.name`, `metadata.namespace`).
#[derive(Debug, Clone, Default)]
pub(crate) struct Selector {
    labels: Vec<LabelReq>,
    /// (field, value, equal)
    fields: Vec<(String, String, bool)>,
}

impl Selector {
    pub(crate) fn parse(labels: &str, fields: &str) -> Result<Selector, ApiError> {
        let bad = |m: String| ApiError::new(400, "BadRequest", m);
        let mut sel = Selector::default();
        let (mut depth, mut start, mut terms) = (0, 0, Vec::new());
        for (i, c) in labels.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    terms.push(&labels[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        terms.push(&labels[start..]);
        for t in terms.into_iter().map(str::trim).filter(|t| !t.is_empty()) {
            let set = |rest: &str| -> Result<Vec<String>, ApiError> {
                let inner = rest
                    .trim()
                    .strip_prefix('(')
                    .and_then(|r| r.strip_suffix(')'));
                let inner =
                    inner.ok_or_else(|| bad(format!("unable to parse requirement: {t}")))?;
                Ok(inner.split(',').map(|v| v.trim().to_string()).collect())
            };
            let req = if let Some((k, rest)) = t.split_once(" notin ") {
                LabelReq::NotIn(k.trim().into(), set(rest)?)
            } else if let Some((k, rest)) = t.split_once(" in ") {
                LabelReq::In(k.trim().into(), set(rest)?)
            } else if let Some((k, v)) = t.split_once("!=") {
                LabelReq::Ne(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
                LabelReq::Eq(k.trim().into(), v.trim().into())
            } else if let Some(k) = t.strip_prefix('!') {
                LabelReq::Absent(k.trim().into())
            } else if t.contains([' ', '(', ')']) {
                return Err(bad(format!("unable to parse requirement: {t}")));
            } else {
                LabelReq::Exists(t.into())
            };
            sel.labels.push(req);
        }
        for t in fields.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let (f, v, eq) = match t.split_once("!=") {
                Some((f, v)) => (f, v, false),
                None => match t.split_once("==").or_else(|| t.split_once('=')) {
                    Some((f, v)) => (f, v, true),
                    None => return Err(bad(format!("invalid selector: '{t}'"))),
                },
            };
            if f != "metadata.name" && f != "metadata.namespace" {
                return Err(bad(format!("field label not supported: {f}")));
            }
            sel.fields.push((f.to_string(), v.to_string(), eq));
        }
        Ok(sel)
    }

    pub(crate) fn matches(&self, obj: &Value) -> bool {
        let label = |k: &str| {
            obj.pointer("/metadata/labels")
                .and_then(|l| l.get(k))
                .and_then(Value::as_str)
        };
        let labels_ok = self.labels.iter().all(|req| match req {
            LabelReq::Eq(k, v) => label(k) == Some(v.as_str()),
            LabelReq::Ne(k, v) => label(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelReq::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
            LabelReq::Exists(k) => label(k).is_some(),
            LabelReq::Absent(k) => label(k).is_none(),
        });
        labels_ok
            && self.fields.iter().all(|(f, v, eq)| {
                let field = f.strip_prefix("metadata.").unwrap_or(f);
                (meta(obj, field).unwrap_or_default() == *v) == *eq
            })
    }

    /// What a watch with this selector sees of `ev`: objects entering the selection are
    /// ADDED, leaving it DELETED.
    pub(crate) fn view(&self, ev: &Event) -> Option<EventType> {
        let now = self.matches(&ev.object);
        match (ev.kind, ev.prev.as_ref().map(|p| self.matches(p))) {
            (EventType::Modified, Some(true)) if !now => Some(EventType::Deleted),
            (EventType::Modified, Some(false)) if now => Some(EventType::Added),
            (EventType::Modified, Some(false)) => None,
            (kind, _) => now.then_some(kind),
        }
    }
}

/// Now as RFC 3339 in UTC, to the second (what `creationTimestamp` holds).
fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = ((secs / 86400) as i64, secs % 86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}
