//! A fake Kubernetes API server for tests, speaking the real wire protocol over HTTP/1.1 on
//! loopback: legacy discovery, LIST with `limit`/`continue`, `resourceVersion` and selectors,
//! chunked WATCH streams (bookmarks when asked, `410 Gone` as an HTTP status or an in-stream
//! ERROR event), single-object GET/POST/PUT/DELETE, merge patch and server-side apply.
//! Tests change objects directly through [`FakeKube`] and break things on demand: compaction,
//! expired watches, 429/500 answers, dropped connections, a restart that keeps the objects.
//! It keeps every object in memory, serves no TLS and checks no credentials.
#![expect(
    dead_code,
    reason = "each test crate uses a part of the shared helpers"
)]

mod store;

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

pub(crate) use store::{ApiError, RESOURCES};
use store::{Part, Rid, Selector, Store, find, find_kind, group_version};

type Body = BoxBody<Bytes, io::Error>;

/// A failure the next requests get, one request each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// `429 Too Many Requests` with `Retry-After: 1`.
    TooManyRequests,
    /// `500 Internal Server Error`.
    Internal,
    /// The connection is closed without an answer.
    Drop,
}

/// Which requests a fault is for (given `METHOD /path?query`).
type Which = fn(&str) -> bool;

/// What every connection and watch listens to; each counter moves when that happens.
#[derive(Debug, Clone, Copy, Default)]
struct Signal {
    /// The store's resourceVersion: watches wake up on writes.
    rv: u64,
    /// Open watches end with an in-stream 410 ERROR.
    expire: u64,
    /// Open watches are cut mid-stream (connection closed, no final chunk).
    drop: u64,
    /// Every connection is closed.
    restart: u64,
    /// The versions served changed: watches of a resource no longer served at theirs end.
    served: u64,
}

#[derive(Debug)]
struct Shared {
    store: Mutex<Store>,
    signal: watch::Sender<Signal>,
    /// Faults to come, each for the first request its filter (if any) accepts.
    faults: Mutex<VecDeque<(Fault, Option<Which>)>>,
    /// Groups served at other versions than [`RESOURCES`] says (none: not served at all).
    served: Mutex<HashMap<&'static str, Vec<&'static str>>>,
    requests: Mutex<Vec<String>>,
    /// Every write (not GET) so far: `METHOD /path?query` and its body (JSON or YAML decoded;
    /// null if neither).
    writes: Mutex<Vec<(String, Value)>>,
    bookmark_every: Mutex<Duration>,
    gone_as_status: Mutex<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The running server and the test's handle on it. Dropping it closes every connection.
#[derive(Debug)]
pub(crate) struct FakeKube {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

impl FakeKube {
    /// Serves on a free port of 127.0.0.1 (call inside a tokio runtime).
    pub(crate) async fn start() -> FakeKube {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local address");
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::default()),
            signal: watch::Sender::new(Signal::default()),
            faults: Mutex::new(VecDeque::new()),
            served: Mutex::new(HashMap::new()),
            requests: Mutex::new(Vec::new()),
            writes: Mutex::new(Vec::new()),
            bookmark_every: Mutex::new(Duration::from_secs(1)),
            gone_as_status: Mutex::new(false),
        });
        let s = shared.clone();
        let accept = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let s = s.clone();
                tokio::spawn(serve_connection(s, stream));
            }
        });
        FakeKube {
            addr,
            shared,
            accept,
        }
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig for this server (plain HTTP, no credentials).
    pub(crate) fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.url()
        )
    }

    pub(crate) fn write_kubeconfig(&self, path: &Path) {
        std::fs::write(path, self.kubeconfig()).expect("write kubeconfig");
    }

    fn write<T>(&self, f: impl FnOnce(&mut Store) -> T) -> T {
        write(&self.shared, f)
    }

    /// Creates or replaces an object (any version), as another client would; returns it as
    /// stored. Panics on an unknown kind or an invalid object.
    pub(crate) fn put(&self, obj: Value) -> Value {
        let (av, kind) = (
            obj["apiVersion"].as_str().unwrap_or(""),
            obj["kind"].as_str().unwrap_or(""),
        );
        let rid = find_kind(av, kind)
            .unwrap_or_else(|| panic!("fake API server does not serve {av} {kind}"));
        self.write(|s| s.upsert(rid, obj)).expect("valid object")
    }

    /// Deletes an object; returns it if it existed.
    pub(crate) fn delete(
        &self,
        api_version: &str,
        kind: &str,
        ns: &str,
        name: &str,
    ) -> Option<Value> {
        let rid = find_kind(api_version, kind).expect("served kind");
        self.write(|s| s.delete(rid, ns, name).ok())
    }

    pub(crate) fn get(&self, api_version: &str, kind: &str, ns: &str, name: &str) -> Option<Value> {
        let rid = find_kind(api_version, kind).expect("served kind");
        lock(&self.shared.store).get(rid, ns, name).cloned()
    }

    /// The last resourceVersion handed out.
    pub(crate) fn resource_version(&self) -> u64 {
        lock(&self.shared.store).rv
    }

    /// Forgets the event log: watches and continue tokens from older versions get 410.
    pub(crate) fn compact(&self) {
        lock(&self.shared.store).compact();
    }

    /// Ends every open watch with an in-stream `410 Expired` ERROR (a watch cache that
    /// dropped its watchers): clients must relist.
    pub(crate) fn expire_watches(&self) {
        self.shared.signal.send_modify(|s| s.expire += 1);
    }

    /// Cuts every open watch mid-stream: the connection closes without the final chunk.
    pub(crate) fn drop_watches(&self) {
        self.shared.signal.send_modify(|s| s.drop += 1);
    }

    /// Closes every connection, as a restarting API server does; the objects stay.
    pub(crate) fn restart(&self) {
        self.shared.signal.send_modify(|s| s.restart += 1);
    }

    /// The next `n` requests fail with `fault`.
    pub(crate) fn fail_next(&self, n: usize, fault: Fault) {
        lock(&self.shared.faults).extend(std::iter::repeat_n((fault, None), n));
    }

    /// The next `n` requests for which `which` holds (given `METHOD /path?query`) fail with
    /// `fault`; others pass.
    pub(crate) fn fail_next_where(&self, n: usize, fault: Fault, which: fn(&str) -> bool) {
        lock(&self.shared.faults).extend(std::iter::repeat_n((fault, Some(which)), n));
    }

    /// Serves `group` only at `versions` (those of them [`RESOURCES`] lists), as an API
    /// server with older CRDs installed does; with none, the group is not served at all (its
    /// CRDs are not installed). Discovery and requests follow at once; objects stay. Open
    /// watches of a resource no longer served at their version end, as a real API server
    /// ends them when a CRD is deleted or stops serving a version.
    pub(crate) fn serve_group(&self, group: &'static str, versions: &[&'static str]) {
        lock(&self.shared.served).insert(group, versions.to_vec());
        self.shared.signal.send_modify(|s| s.served += 1);
    }

    /// How often watches that allow bookmarks get one (default 1 s).
    pub(crate) fn set_bookmark_interval(&self, every: Duration) {
        *lock(&self.shared.bookmark_every) = every;
    }

    /// Whether a watch from a compacted version is refused with HTTP 410 (true) or answered
    /// 200 with an ERROR event carrying the 410 Status (false, the default, as the watch cache
    /// of a real API server does).
    pub(crate) fn set_gone_as_status(&self, yes: bool) {
        *lock(&self.shared.gone_as_status) = yes;
    }

    /// Waits (at most 10 s) until a request containing `part` has come in; panics if none.
    pub(crate) async fn wait_for_request(&self, part: &str) {
        let seen = || lock(&self.shared.requests).iter().any(|r| r.contains(part));
        let wait = async {
            while !seen() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .is_err()
        {
            panic!(
                "no request containing {part:?} within 10 s: {:#?}",
                self.requests()
            );
        }
    }

    /// Every write request (not GET) so far, as `METHOD /path?query` and its decoded body.
    pub(crate) fn writes(&self) -> Vec<(String, Value)> {
        lock(&self.shared.writes).clone()
    }

    /// The writes after the first `from` (see [`FakeKube::writes`]).
    pub(crate) fn writes_from(&self, from: usize) -> Vec<(String, Value)> {
        lock(&self.shared.writes)
            .get(from..)
            .map(<[_]>::to_vec)
            .unwrap_or_default()
    }

    /// How many writes there were.
    pub(crate) fn write_count(&self) -> usize {
        lock(&self.shared.writes).len()
    }

    /// Every request so far, as `METHOD /path?query`.
    pub(crate) fn requests(&self) -> Vec<String> {
        lock(&self.shared.requests).clone()
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.accept.abort();
        self.restart();
    }
}

async fn serve_connection(shared: Arc<Shared>, stream: tokio::net::TcpStream) {
    let mut signal = shared.signal.subscribe();
    let restart = signal.borrow_and_update().restart;
    let s = shared.clone();
    let service = hyper::service::service_fn(move |req| handle(s.clone(), req));
    let conn =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        _ = conn => {}
        _ = signal.wait_for(|s| s.restart != restart) => {}
    }
}

fn full(status: StatusCode, body: &Value) -> Response<Body> {
    let mut resp = Response::new(
        Full::new(Bytes::from(body.to_string()))
            .map_err(|e| match e {})
            .boxed(),
    );
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn ok(body: &Value) -> Response<Body> {
    full(StatusCode::OK, body)
}

fn error(e: &ApiError) -> Response<Body> {
    full(
        StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        &e.status(),
    )
}

/// Percent-decodes a query component (`+` is a space).
fn decode(s: &str) -> String {
    let (b, mut out, mut i) = (s.as_bytes(), Vec::with_capacity(s.len()), 0);
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => match s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                Some(v) => {
                    out.push(v);
                    i += 2;
                }
                None => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, io::Error> {
    let line = format!(
        "{} {}",
        req.method(),
        req.uri()
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/")
    );
    let fault = {
        let mut faults = lock(&shared.faults);
        let at = faults
            .iter()
            .position(|(_, which)| which.is_none_or(|w| w(&line)));
        at.and_then(|i| faults.remove(i)).map(|(f, _)| f)
    };
    lock(&shared.requests).push(line);
    match fault {
        Some(Fault::Drop) => return Err(io::Error::other("fault injected: drop")),
        Some(Fault::TooManyRequests) => {
            let e = ApiError::new(
                429,
                "TooManyRequests",
                "fault injected: too many requests, please try again later",
            );
            let mut resp = error(&e);
            resp.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
            return Ok(resp);
        }
        Some(Fault::Internal) => {
            return Ok(error(&ApiError::new(
                500,
                "InternalError",
                "fault injected: internal error",
            )));
        }
        None => {}
    }
    let query: HashMap<String, String> = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (decode(k), decode(v))
        })
        .collect();
    let path = req.uri().path().to_string();
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let resp = match segs.as_slice() {
        ["version"] => ok(
            &json!({"major": "1", "minor": "32", "gitVersion": "v1.32.0-fake", "platform": "linux/amd64"}),
        ),
        ["api"] => ok(&json!({"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]})),
        ["apis"] => ok(&group_list(&shared)),
        ["openapi", "v3"] => ok(&openapi_index()),
        ["openapi", "v3", "api", "v1"] => ok(&openapi("", "v1")),
        ["openapi", "v3", "apis", group, version] => ok(&openapi(group, version)),
        ["api", "v1", rest @ ..] => resource(&shared, req, "", "v1", rest, &query).await,
        ["apis", group, version, rest @ ..] => {
            resource(&shared, req, group, version, rest, &query).await
        }
        _ => error(&ApiError::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )),
    };
    Ok(resp)
}

/// The versions `r` is served at now, preferred first.
fn served(shared: &Shared, r: &store::Resource) -> Vec<&'static str> {
    match lock(&shared.served).get(r.group) {
        Some(only) => r
            .versions
            .iter()
            .filter(|v| only.contains(v))
            .copied()
            .collect(),
        None => r.versions.to_vec(),
    }
}

/// Whether any resource is served at `group`/`version` now.
fn serves(shared: &Shared, group: &str, version: &str) -> bool {
    RESOURCES
        .iter()
        .any(|r| r.group == group && served(shared, r).contains(&version))
}

/// `/apis`: every group with its versions.
fn group_list(shared: &Shared) -> Value {
    let mut groups: Vec<(&str, Vec<&str>)> = Vec::new();
    for r in RESOURCES.iter().filter(|r| !r.group.is_empty()) {
        let versions = served(shared, r);
        if versions.is_empty() {
            continue;
        }
        match groups.iter_mut().find(|(g, _)| *g == r.group) {
            Some((_, vs)) => vs.extend(
                versions
                    .iter()
                    .filter(|v| !vs.contains(v))
                    .collect::<Vec<_>>(),
            ),
            None => groups.push((r.group, versions)),
        }
    }
    let groups: Vec<Value> = groups
        .iter()
        .map(|(g, vs)| {
            let gv = |v: &&str| json!({"groupVersion": group_version(g, v), "version": v});
            json!({"name": g, "versions": vs.iter().map(gv).collect::<Vec<_>>(), "preferredVersion": gv(&vs[0])})
        })
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// `/openapi/v3`: where each group version's document is. kubectl asks before `apply` to
/// learn whether the server validates fields itself (else it wants whole schemas).
fn openapi_index() -> Value {
    let mut paths = serde_json::Map::new();
    for r in RESOURCES {
        for v in r.versions {
            let gv = if r.group.is_empty() {
                format!("api/{v}")
            } else {
                format!("apis/{}/{v}", r.group)
            };
            let url = format!("/openapi/v3/{gv}?hash=0");
            paths.insert(gv, json!({"serverRelativeURL": url}));
        }
    }
    json!({"paths": paths})
}

/// `/openapi/v3/apis/<group>/<version>`: only the PATCH operations, saying that they take
/// `fieldValidation` (so kubectl leaves validation to the server, which here accepts all).
fn openapi(group: &str, version: &str) -> Value {
    let mut paths = serde_json::Map::new();
    for r in RESOURCES
        .iter()
        .filter(|r| r.group == group && r.versions.contains(&version))
    {
        let prefix = if group.is_empty() {
            format!("/api/{version}")
        } else {
            format!("/apis/{group}/{version}")
        };
        let ns = if r.namespaced {
            "/namespaces/{namespace}"
        } else {
            ""
        };
        let patch = json!({"patch": {
            "x-kubernetes-group-version-kind": {"group": group, "version": version, "kind": r.kind},
            "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}],
            "responses": {"200": {"description": "OK"}}}});
        paths.insert(format!("{prefix}{ns}/{}/{{name}}", r.plural), patch);
    }
    json!({"openapi": "3.0.0", "info": {"title": "fake", "version": version}, "paths": paths})
}

/// `/api/v1`, `/apis/<group>/<version>`: the resources served there.
fn resource_list(shared: &Shared, group: &str, version: &str) -> Value {
    let resources: Vec<Value> = RESOURCES
        .iter()
        .filter(|r| r.group == group && served(shared, r).contains(&version))
        .map(|r| {
            json!({"name": r.plural, "singularName": r.kind.to_lowercase(), "namespaced": r.namespaced, "kind": r.kind,
                   "shortNames": r.short,
                   "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]})
        })
        .collect();
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version(group, version), "resources": resources})
}

/// The object as a client of `version` sees it.
fn at_version(mut obj: Value, rid: Rid, version: &str) -> Value {
    obj["apiVersion"] = Value::String(group_version(RESOURCES[rid].group, version));
    obj
}

async fn resource(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    group: &str,
    version: &str,
    rest: &[&str],
    q: &HashMap<String, String>,
) -> Response<Body> {
    if rest.is_empty() {
        if serves(shared, group, version) {
            return ok(&resource_list(shared, group, version));
        }
        return error(&ApiError::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        ));
    }
    // namespaces/<ns>/<plural>[/<name>[/status]] or <plural>[/<name>[/status]] (cluster-wide,
    // or a namespace).
    let (ns, plural, name, status) = match rest {
        ["namespaces", ns, plural, name, "status"] => (*ns, *plural, Some(*name), true),
        ["namespaces", ns, plural, tail @ ..] if tail.len() <= 1 => {
            (*ns, *plural, tail.first().copied(), false)
        }
        [plural] => ("", *plural, None, false),
        [plural, name] => ("", *plural, Some(*name), false),
        [plural, name, "status"] => ("", *plural, Some(*name), true),
        _ => ("", "", None, false),
    };
    let not_found = || {
        error(&ApiError::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        ))
    };
    let Some(rid) = find(group, version, plural) else {
        return not_found();
    };
    if !served(shared, &RESOURCES[rid]).contains(&version) {
        return not_found();
    }
    if (!ns.is_empty() && !RESOURCES[rid].namespaced) || (status && !RESOURCES[rid].status) {
        return not_found();
    }
    let part = if status { Part::Status } else { Part::Main };
    let field = |k: &str| q.get(k).map(String::as_str).unwrap_or("");
    let selector = match Selector::parse(field("labelSelector"), field("fieldSelector")) {
        Ok(s) => s,
        Err(e) => return error(&e),
    };
    let method = req.method().clone();
    let uri = req.uri().clone();
    let content_type = req
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return error(&ApiError::new(400, "BadRequest", e.to_string())),
    };
    if method != Method::GET {
        let line = format!(
            "{method} {}",
            uri.path_and_query().map(|p| p.as_str()).unwrap_or("/")
        );
        let doc = serde_json::from_slice(&body)
            .or_else(|_| serde_saphyr::from_slice(&body))
            .unwrap_or(Value::Null);
        lock(&shared.writes).push((line, doc));
    }
    let parse = |yaml: bool| -> Result<Value, ApiError> {
        let bad = |e: String| ApiError::new(400, "BadRequest", format!("cannot decode body: {e}"));
        match serde_json::from_slice(&body) {
            Ok(v) => Ok(v),
            Err(e) if !yaml => Err(bad(e.to_string())),
            Err(_) => serde_saphyr::from_slice(&body).map_err(|e| bad(e.to_string())),
        }
    };
    let created = |(obj, new): (Value, bool)| {
        (
            if new {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            },
            obj,
        )
    };
    let result = match (&method, name) {
        (&Method::GET, None) if matches!(field("watch"), "1" | "true") => {
            return watch(shared, rid, version, ns, selector, q);
        }
        (&Method::GET, None) => {
            list(shared, rid, version, ns, &selector, q).map(|l| (StatusCode::OK, l))
        }
        (&Method::GET, Some(name)) => lock(&shared.store)
            .get(rid, ns, name)
            .cloned()
            .map(|o| (StatusCode::OK, o))
            .ok_or_else(|| ApiError::not_found(rid, name)),
        (&Method::POST, None) if !status => parse(false)
            .and_then(|obj| write(shared, |s| s.create(rid, ns, obj, part)))
            .map(|o| (StatusCode::CREATED, o)),
        (&Method::PUT, Some(name)) => parse(false)
            .and_then(|obj| write(shared, |s| s.update(rid, ns, name, obj, part)))
            .map(|o| (StatusCode::OK, o)),
        (&Method::DELETE, Some(name)) if !status => {
            write(shared, |s| s.delete(rid, ns, name)).map(|o| (StatusCode::OK, o))
        }
        (&Method::PATCH, Some(name))
            if content_type.starts_with("application/apply-patch+yaml") && !status =>
        {
            match q.get("fieldManager").filter(|m| !m.is_empty()) {
                None => Err(ApiError::new(
                    422,
                    "Invalid",
                    "fieldManager: Required value: is required for apply patch",
                )),
                Some(manager) => {
                    let force = field("force") == "true";
                    parse(true)
                        .and_then(|p| write(shared, |s| s.apply(rid, ns, name, p, manager, force)))
                        .map(created)
                }
            }
        }
        // Strategic merge patch is served as a merge patch: lists are replaced whole.
        (&Method::PATCH, Some(name))
            if content_type.starts_with("application/merge-patch+json")
                || content_type.starts_with("application/strategic-merge-patch+json") =>
        {
            parse(false)
                .and_then(|p| write(shared, |s| s.merge_patch(rid, ns, name, &p, part)))
                .map(|o| (StatusCode::OK, o))
        }
        (&Method::PATCH, _) => Err(ApiError::new(
            415,
            "UnsupportedMediaType",
            format!("unknown patch type: {content_type}"),
        )),
        _ => Err(ApiError::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )),
    };
    match result {
        Ok((status, obj)) => full(status, &at_version(obj, rid, version)),
        Err(e) => error(&e),
    }
}

/// Runs `f` on the store and wakes the watches.
fn write<T>(shared: &Shared, f: impl FnOnce(&mut Store) -> T) -> T {
    let mut store = lock(&shared.store);
    let out = f(&mut store);
    let rv = store.rv;
    drop(store);
    shared.signal.send_modify(|s| s.rv = rv);
    out
}

/// LIST: `limit` + `continue` pages in key order; the continue token carries the list's
/// resourceVersion and the last key, and is refused with 410 once that version is compacted.
fn list(
    shared: &Shared,
    rid: Rid,
    version: &str,
    ns: &str,
    sel: &Selector,
    q: &HashMap<String, String>,
) -> Result<Value, ApiError> {
    let store = lock(&shared.store);
    let limit: usize = q
        .get("limit")
        .and_then(|l| l.parse().ok())
        .filter(|l| *l > 0)
        .unwrap_or(usize::MAX);
    let (mut list_rv, mut after) = (store.rv, None);
    if let Some(token) = q.get("continue").filter(|t| !t.is_empty()) {
        let mut parts = token.splitn(3, '/');
        let (rv, tns, tname) = (parts.next(), parts.next(), parts.next());
        let rv = rv.and_then(|r| r.parse::<u64>().ok());
        let (Some(rv), Some(tns), Some(tname)) = (rv, tns, tname) else {
            return Err(ApiError::new(400, "BadRequest", "invalid continue token"));
        };
        if rv < store.compacted {
            return Err(ApiError::gone(
                "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
            ));
        }
        (list_rv, after) = (rv, Some((tns.to_string(), tname.to_string())));
    } else if let Some(rv) = q
        .get("resourceVersion")
        .filter(|r| !r.is_empty() && *r != "0")
    {
        let rv: u64 = rv
            .parse()
            .map_err(|_| ApiError::new(400, "BadRequest", "invalid resourceVersion"))?;
        let exact = q.get("resourceVersionMatch").is_some_and(|m| m == "Exact");
        if exact && rv < store.compacted {
            return Err(ApiError::gone(format!(
                "too old resource version: {rv} ({})",
                store.compacted
            )));
        }
        if exact && rv != store.rv {
            // The fake keeps no history of objects; only the current version lists exactly.
            return Err(ApiError::gone(format!(
                "fake API server lists only the current version {}",
                store.rv
            )));
        }
        if rv > store.rv {
            return Err(ApiError::new(
                504,
                "Timeout",
                format!("Too large resource version: {rv}, current: {}", store.rv),
            ));
        }
    }
    let mut items = store
        .list(rid, ns)
        .filter(|(k, _)| after.as_ref().is_none_or(|a| *k > a))
        .filter(|(_, o)| sel.matches(o))
        .map(|(k, o)| (k, o.clone()));
    let page: Vec<_> = items.by_ref().take(limit).collect();
    let remaining = items.count();
    let r = &RESOURCES[rid];
    let mut meta = json!({"resourceVersion": list_rv.to_string()});
    if remaining > 0
        && let Some(((kns, kname), _)) = page.last()
    {
        meta["continue"] = Value::String(format!("{list_rv}/{kns}/{kname}"));
        meta["remainingItemCount"] = json!(remaining);
    }
    let items: Vec<Value> = page
        .into_iter()
        .map(|(_, o)| at_version(o, rid, version))
        .collect();
    Ok(
        json!({"kind": format!("{}List", r.kind), "apiVersion": group_version(r.group, version), "metadata": meta, "items": items}),
    )
}

fn event_line(kind: &str, object: &Value) -> Result<Frame<Bytes>, io::Error> {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Ok(Frame::data(Bytes::from(line)))
}

/// WATCH: a chunked stream of one JSON event per line, from `resourceVersion` (or, without
/// one, the current objects as ADDED first), BOOKMARKs when allowed, ending after
/// `timeoutSeconds`, with an ERROR event (410) when the version is compacted or the watches
/// are expired.
fn watch(
    shared: &Arc<Shared>,
    rid: Rid,
    version: &str,
    ns: &str,
    sel: Selector,
    q: &HashMap<String, String>,
) -> Response<Body> {
    let field = |k: &str| q.get(k).map(String::as_str).unwrap_or("");
    let bookmarks = field("allowWatchBookmarks") == "true";
    let initial_events = field("sendInitialEvents") == "true";
    let timeout = field("timeoutSeconds")
        .parse()
        .ok()
        .map(Duration::from_secs);
    let mut signal = shared.signal.subscribe();
    let start = *signal.borrow_and_update();
    let gone_as_status = *lock(&shared.gone_as_status);
    let bookmark_every = *lock(&shared.bookmark_every);
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, io::Error>>(64);
    let (ns, shared) = (ns.to_string(), shared.clone());
    let r = &RESOURCES[rid];
    let api_version = Value::String(group_version(r.group, version));
    let watched_version = version.to_owned();
    let bookmark = {
        let api_version = api_version.clone();
        move |rv: u64, end: bool| {
            let mut meta = json!({"resourceVersion": rv.to_string()});
            if end {
                meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
            }
            json!({"kind": r.kind, "apiVersion": api_version, "metadata": meta})
        }
    };
    let gone = |last: u64, compacted: u64| {
        ApiError::gone(format!("too old resource version: {last} ({compacted})")).status()
    };
    let mut first = Vec::new();
    let mut last = {
        let store = lock(&shared.store);
        match field("resourceVersion") {
            rv if rv.is_empty() || rv == "0" || initial_events => {
                for (_, obj) in store.list(rid, &ns).filter(|(_, o)| sel.matches(o)) {
                    let mut obj = obj.clone();
                    obj["apiVersion"] = api_version.clone();
                    first.push(event_line("ADDED", &obj));
                }
                if initial_events && bookmarks {
                    first.push(event_line("BOOKMARK", &bookmark(store.rv, true)));
                }
                store.rv
            }
            rv => match rv.parse::<u64>() {
                Err(_) => {
                    return error(&ApiError::new(
                        400,
                        "BadRequest",
                        format!("invalid resourceVersion: {rv}"),
                    ));
                }
                Ok(rv) if rv < store.compacted && gone_as_status => {
                    return error(&ApiError::gone(format!(
                        "too old resource version: {rv} ({})",
                        store.compacted
                    )));
                }
                Ok(rv) => rv,
            },
        }
    };
    tokio::spawn(async move {
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        let mut tick =
            tokio::time::interval_at(tokio::time::Instant::now() + bookmark_every, bookmark_every);
        for frame in first {
            if tx.send(frame).await.is_err() {
                return;
            }
        }
        loop {
            let frames = {
                let store = lock(&shared.store);
                if last < store.compacted {
                    Err(gone(last, store.compacted))
                } else {
                    let from = store.log.partition_point(|e| e.rv <= last);
                    let frames: Vec<_> = store.log[from..]
                        .iter()
                        .filter(|e| {
                            e.rid == rid
                                && (ns.is_empty() || e.object["metadata"]["namespace"] == *ns)
                        })
                        .filter_map(|e| sel.view(e).map(|kind| (kind, e)))
                        .map(|(kind, e)| {
                            let mut obj = e.object.clone();
                            obj["apiVersion"] = api_version.clone();
                            event_line(kind.as_str(), &obj)
                        })
                        .collect();
                    last = last.max(store.rv);
                    Ok(frames)
                }
            };
            let frames = match frames {
                Ok(frames) => frames,
                Err(status) => {
                    let _ = tx.send(event_line("ERROR", &status)).await;
                    return;
                }
            };
            for frame in frames {
                if tx.send(frame).await.is_err() {
                    return;
                }
            }
            tokio::select! {
                changed = signal.changed() => {
                    let Ok(()) = changed else { return };
                    let now = *signal.borrow_and_update();
                    if now.restart != start.restart || now.drop != start.drop {
                        let _ = tx.send(Err(io::Error::other("fault injected: watch dropped"))).await;
                        return;
                    }
                    if now.expire != start.expire {
                        let _ = tx.send(event_line("ERROR", &gone(last, last))).await;
                        return;
                    }
                    if !served(&shared, r).iter().any(|v| *v == watched_version) {
                        return;
                    }
                }
                _ = tick.tick(), if bookmarks => {
                    if tx.send(event_line("BOOKMARK", &bookmark(last, false))).await.is_err() {
                        return;
                    }
                }
                _ = async { tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)).await }, if deadline.is_some() => return,
                _ = tx.closed() => return,
            }
        }
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
    let mut resp = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}
