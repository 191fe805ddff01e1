//! The real `trellis controller --config` against the fake Kubernetes API server: the live
//! table equals what `render` makes of the same objects; creating, changing and deleting a
//! shoot's objects changes it; a relist or a restart of the API server never shrinks it;
//! failed lists are retried and readiness waits for the first table; seeds that serve the
//! Istio kinds only as `v1beta1`, or not at all, are watched as they are, also when that
//! changes while the controller runs.

#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;
mod e2e;
mod fakekube;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{TestDir, http_get};
use fakekube::{FakeKube, Fault};
use serde_json::Value;

const ALPHA: &str = "shoot--dev--alpha";

fn seed_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/controller/seed")
}

/// The objects of one seed fixture file, `List`s unpacked.
fn objects(file: &str) -> Vec<Value> {
    let path = seed_dir().join(file);
    let bytes = std::fs::read(&path).unwrap();
    let mut out = Vec::new();
    for doc in trellis::controller::manifest::documents(&path, &bytes).unwrap() {
        match doc["items"].as_array() {
            Some(items) if doc["kind"].as_str().unwrap_or("").ends_with("List") => {
                out.extend(items.iter().cloned())
            }
            _ if doc.is_object() => out.push(doc),
            _ => {}
        }
    }
    out
}

/// Every seed fixture file but `except`.
fn seed_files(except: &[&str]) -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(seed_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".yaml") || f.ends_with(".json"))
        .filter(|f| !except.iter().any(|e| f.starts_with(e)))
        .collect();
    files.sort();
    files
}

/// A running `trellis controller --config` for the seed's default gateway and the Gateway
/// API parent `infra/public`, killed when dropped.
struct Controller(e2e::Controller);

impl std::ops::Deref for Controller {
    type Target = e2e::Controller;
    fn deref(&self) -> &e2e::Controller {
        &self.0
    }
}

impl Controller {
    fn start(kube: &FakeKube) -> Controller {
        Controller(e2e::Controller::start_with(
            kube,
            "gateway:
  selector: {app: istio-ingressgateway, istio: ingressgateway, istio-role: seed}
  parentRefs: [infra/public]
fallback: {address: \"istio-ingressgateway.istio-ingress.svc.cluster.local:443\"}",
        ))
    }

    /// The table file's text.
    fn table(&self) -> Option<String> {
        std::fs::read_to_string(self.table_path()).ok()
    }

    /// Waits (at most 10 s) until the table satisfies `pred`; returns it.
    async fn wait_table(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            if let Some(t) = self.table().and_then(|t| serde_json::from_str(&t).ok())
                && pred(&t)
            {
                return t;
            }
            if start.elapsed() > Duration::from_secs(10) {
                panic!(
                    "no table with {what} within 10 s; last: {:?}\n{}",
                    self.table(),
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn get(&self, path: &str) -> Option<(u16, String)> {
        let (addr, path) = (self.0.admin, path.to_owned());
        tokio::task::spawn_blocking(move || http_get(addr, &path))
            .await
            .unwrap()
    }
}

fn route<'a>(table: &'a Value, name: &str) -> Option<&'a Value> {
    table["routes"]
        .as_array()?
        .iter()
        .find(|r| r["name"] == name)
}

fn route_names(table: &Value) -> BTreeSet<String> {
    e2e::route_names(table).into_iter().collect()
}

fn backends(table: &Value, name: &str) -> Vec<String> {
    route(table, name).map_or_else(Vec::new, |r| {
        r["backends"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["address"].as_str().unwrap().to_owned())
            .collect()
    })
}

/// `trellis controller render` of `objects` (as the fake stores them) with the same target.
fn render(objects: &[Value], config: &Path) -> String {
    let dir = TestDir::new("render");
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": objects});
    std::fs::write(dir.path("objects.json"), list.to_string()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args(["controller", "render", "--manifests"])
        .arg(&dir.0)
        .arg("--config")
        .arg(config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Seeds the fake with every fixture file but `except`; returns the objects as stored.
fn seed(kube: &FakeKube, except: &[&str]) -> Vec<Value> {
    seed_files(except)
        .iter()
        .flat_map(|f| objects(f))
        .map(|o| kube.put(o))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_table_is_renders_and_follows_a_shoot_created_changed_and_deleted() {
    let kube = FakeKube::start().await;
    let mut stored = seed(&kube, &[ALPHA]);
    let c = Controller::start(&kube);
    let first = c
        .wait_table("the seed's shoots", |t| {
            route(t, "shoot--dev--beta").is_some()
        })
        .await;
    assert!(route(&first, ALPHA).is_none());
    // The same objects rendered offline give the same bytes.
    let config = c.dir.path("controller.yaml");
    let offline = render(&stored, &config);
    assert_eq!(
        c.table().unwrap(),
        offline,
        "live table differs from render's"
    );
    assert!(c.logs().contains("routing table written"), "{}", c.logs());

    // A shoot's objects created: its routes appear.
    let alpha: Vec<Value> = objects(&format!("{ALPHA}.yaml"))
        .into_iter()
        .map(|o| kube.put(o))
        .collect();
    // Its objects arrive on several watches: a table written between two of them has the
    // route without, say, the DestinationRule's settings. Waited for whole.
    stored.extend(alpha.iter().cloned());
    let whole = render(&stored, &config);
    let expected: Value = serde_json::from_str(&whole).unwrap();
    let t = c
        .wait_table("alpha, all of its objects", |t| *t == expected)
        .await;
    assert_eq!(backends(&t, ALPHA), ["100.96.1.10:443"]);
    assert!(route(&t, &format!("{ALPHA}--vpn-seed-server")).is_some());
    assert_eq!(c.table().unwrap(), whole);

    // Its EndpointSlice changes (the starting pod became ready): backends follow.
    let mut slice = alpha
        .iter()
        .find(|o| o["metadata"]["name"] == "kube-apiserver-x7k2p")
        .unwrap()
        .clone();
    slice["endpoints"][1]["conditions"]["ready"] = Value::Bool(true);
    kube.put(slice);
    let t = c
        .wait_table("alpha's second backend", |t| backends(t, ALPHA).len() == 2)
        .await;
    assert_eq!(backends(&t, ALPHA), ["100.96.1.10:443", "100.96.2.11:443"]);

    // A change the table does not show (a terminating endpoint moves zone): rendered, not
    // written; the file is the same file.
    use std::os::unix::fs::MetadataExt;
    let inode = std::fs::metadata(c.table_path()).unwrap().ino();
    let unchanged = || async {
        let m = c.get("/metrics").await.unwrap().1;
        common::metric_in(&m, "trellis_controller_writes_total{result=\"unchanged\"}")
    };
    let before_unchanged = unchanged().await;
    let mut slice = kube
        .get(
            "discovery.k8s.io/v1",
            "EndpointSlice",
            ALPHA,
            "kube-apiserver-x7k2p",
        )
        .unwrap();
    slice["endpoints"][2]["zone"] = Value::String("eu-1d".into());
    kube.put(slice);
    let start = Instant::now();
    while unchanged().await == before_unchanged {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no render left the table unchanged"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(std::fs::metadata(c.table_path()).unwrap().ino(), inode);

    // Its VirtualService deleted: the SNI route goes; other shoots stay.
    let before = route_names(&t);
    kube.delete(
        "networking.istio.io/v1",
        "VirtualService",
        ALPHA,
        "kube-apiserver",
    )
    .unwrap();
    let t = c
        .wait_table("alpha gone", |t| route(t, ALPHA).is_none())
        .await;
    let mut expected = before.clone();
    expected.remove(ALPHA);
    expected.remove(&format!("{ALPHA}--vpn-seed-server"));
    assert_eq!(route_names(&t), expected);

    // /ready after the first write, and the controller's metrics.
    assert_eq!(c.get("/ready").await.unwrap().0, 200);
    let metrics = c.get("/metrics").await.unwrap().1;
    for needle in [
        "trellis_controller_objects{kind=\"EndpointSlice\"}",
        "trellis_controller_writes_total{result=\"written\"}",
        "trellis_controller_routes ",
        "trellis_controller_skipped{reason=\"l7\"} 1",
    ] {
        assert!(metrics.contains(needle), "{needle} not in\n{metrics}");
    }
}

/// Reads the table file every millisecond until stopped (and once more then); returns every
/// distinct table seen. Returns once the thread runs.
fn watch_file(path: PathBuf, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Vec<String>> {
    let (running, started) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let _ = running.send(());
        let mut seen = Vec::<String>::new();
        loop {
            let stopped = stop.load(Ordering::SeqCst);
            if let Ok(t) = std::fs::read_to_string(&path)
                && seen.last() != Some(&t)
            {
                seen.push(t);
            }
            if stopped {
                return seen;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    started.recv().unwrap();
    thread
}

/// LIST requests (not watches) so far, per resource path.
fn lists(kube: &FakeKube, plural: &str) -> usize {
    kube.requests()
        .iter()
        .filter(|r| r.contains(&format!("/{plural}?")) && !r.contains("watch=true"))
        .count()
}

const PLURALS: [&str; 8] = [
    "gateways",
    "virtualservices",
    "destinationrules",
    "envoyfilters",
    "services",
    "endpointslices",
    "namespaces",
    "tlsroutes",
];

/// Breaks the API server with `disrupt` while the table file is watched; waits until every
/// kind has listed again, then checks that no table written meanwhile lost a route and that
/// the watches still deliver.
async fn survives(
    kube: &FakeKube,
    c: &Controller,
    new_backend: &str,
    disrupt: impl FnOnce(&FakeKube),
) {
    let baseline: Value = serde_json::from_str(&c.table().unwrap()).unwrap();
    let routes = route_names(&baseline);
    let listed: Vec<usize> = PLURALS.iter().map(|p| lists(kube, p)).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_file(c.table_path(), stop.clone());
    disrupt(kube);
    let start = Instant::now();
    while PLURALS
        .iter()
        .zip(&listed)
        .any(|(p, n)| lists(kube, p) <= *n)
    {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "not every kind listed again: {:#?}\n{}",
            kube.requests(),
            c.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The watches deliver again: a new ready endpoint for beta shows up.
    let mut slice = kube
        .get(
            "discovery.k8s.io/v1",
            "EndpointSlice",
            "shoot--dev--beta",
            "kube-apiserver-v4abc",
        )
        .unwrap();
    let n = backends(&baseline, "shoot--dev--beta").len();
    let mut endpoint = slice["endpoints"][0].clone();
    endpoint["addresses"] = serde_json::json!([new_backend]);
    slice["endpoints"].as_array_mut().unwrap().push(endpoint);
    kube.put(slice);
    c.wait_table("beta's new backend", |t| {
        backends(t, "shoot--dev--beta").len() == n + 1
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let seen = watcher.join().unwrap();
    for table in &seen {
        let t: Value = serde_json::from_str(table).unwrap_or_else(|e| panic!("{e}: {table}"));
        let names = route_names(&t);
        let missing: Vec<_> = routes.difference(&names).collect();
        assert!(missing.is_empty(), "a table lost {missing:?}:\n{table}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relist_or_an_api_server_restart_never_shrinks_the_table() {
    let kube = FakeKube::start().await;
    seed(&kube, &[]);
    let c = Controller::start(&kube);
    c.wait_table("every shoot", |t| route(t, ALPHA).is_some())
        .await;
    // Watches expire (410 in the stream) and the relists' first requests fail, so each kind
    // sits between `Init` and `InitDone` for a backoff (~1 s).
    survives(&kube, &c, "100.96.77.1", |k| {
        k.expire_watches();
        k.fail_next(12, Fault::Internal);
    })
    .await;
    // A write no watch sees, the log compacted and every connection closed: every watch
    // resumes from a version that is gone and must relist; some lists fail again.
    survives(&kube, &c, "100.96.77.2", |k| {
        k.put(serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "unwatched", "namespace": "default"}}));
        k.compact();
        k.restart();
        k.fail_next(12, Fault::TooManyRequests);
    })
    .await;
    let errors = c.get("/metrics").await.unwrap().1;
    assert!(
        common::metric_in(&errors, "trellis_controller_watch_errors_total") > 0.0,
        "{errors}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_lists_are_retried_and_nothing_is_written_or_ready_before_every_kind_listed() {
    let kube = FakeKube::start().await;
    seed(&kube, &[]);
    // Every kind's first lists fail (discovery passes); the kinds' retries (jittered
    // backoffs) list at different times.
    let is_list = |r: &str| r.contains('?') && !r.contains("watch=true");
    kube.fail_next_where(8, Fault::TooManyRequests, is_list);
    kube.fail_next_where(12, Fault::Internal, is_list);
    let c = Controller::start(&kube);
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_file(c.table_path(), stop.clone());
    let start = Instant::now();
    while c.table().is_none() {
        assert!(start.elapsed() < Duration::from_secs(20), "{}", c.logs());
        if let Some((status, _)) = c.get("/ready").await
            && c.table().is_none()
        {
            assert_eq!(status, 503, "ready before the first table");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let last = c
        .wait_table("every shoot", |t| route(t, ALPHA).is_some())
        .await;
    assert_eq!(c.get("/ready").await.unwrap().0, 200);
    stop.store(true, Ordering::SeqCst);
    let seen = watcher.join().unwrap();
    let all = route_names(&last);
    for table in &seen {
        let names = route_names(&serde_json::from_str(table).unwrap());
        assert_eq!(names, all, "a table before every kind listed:\n{table}");
    }
    let retried = PLURALS.iter().filter(|p| lists(&kube, p) >= 2).count();
    assert_eq!(retried, PLURALS.len(), "{:#?}", kube.requests());
}

/// The controller's JSON log lines whose message is `message`.
fn logged(c: &Controller, message: &str) -> Vec<Value> {
    c.logs()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == message)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_serving_istio_only_as_v1beta1_is_watched_at_v1beta1() {
    let kube = FakeKube::start().await;
    kube.serve_group("networking.istio.io", &["v1beta1", "v1alpha3"]);
    let mut stored = seed(&kube, &[ALPHA]);
    let c = Controller::start(&kube);
    c.wait_table("the seed's shoots", |t| {
        route(t, "shoot--dev--beta").is_some()
    })
    .await;
    let config = c.dir.path("controller.yaml");
    assert_eq!(c.table().unwrap(), render(&stored, &config));
    // Changes arrive through the v1beta1 watches.
    stored.extend(
        objects(&format!("{ALPHA}.yaml"))
            .into_iter()
            .map(|o| kube.put(o)),
    );
    c.wait_table("alpha", |t| route(t, ALPHA).is_some()).await;
    assert_eq!(c.table().unwrap(), render(&stored, &config));
    let watching: Vec<(String, String)> = logged(&c, "watching")
        .iter()
        .map(|l| (l["kind"].to_string(), l["api_version"].to_string()))
        .collect();
    for kind in ["Gateway", "VirtualService", "DestinationRule"] {
        let expected = (
            format!("{kind:?}"),
            "\"networking.istio.io/v1beta1\"".to_owned(),
        );
        assert!(watching.contains(&expected), "{watching:?}");
    }
    let requests = kube.requests();
    assert!(
        requests
            .iter()
            .any(|r| r.contains("/networking.istio.io/v1beta1/virtualservices?")),
        "{requests:#?}"
    );
    assert!(
        !requests
            .iter()
            .any(|r| r.contains("/networking.istio.io/v1/")),
        "{requests:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinds_not_served_are_empty_until_they_are_then_watched() {
    let kube = FakeKube::start().await;
    // No Gateway API CRDs and no Istio installed.
    kube.serve_group("gateway.networking.k8s.io", &[]);
    kube.serve_group("networking.istio.io", &[]);
    let stored = seed(&kube, &[]);
    let c = Controller::start(&kube);
    // Ready, with a table of what is there: no Istio objects, so no shoot routes.
    let t = c.wait_table("a first table", |_| true).await;
    assert_eq!(route_names(&t), BTreeSet::from(["fallback".to_owned()]));
    let start = Instant::now();
    while c.get("/ready").await.map(|r| r.0) != Some(200) {
        assert!(start.elapsed() < Duration::from_secs(10), "{}", c.logs());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let absent = || {
        let mut kinds: Vec<String> = logged(
            &c,
            "not served by the API server; treated as empty until it is",
        )
        .iter()
        .map(|l| l["kind"].as_str().unwrap_or("").to_owned())
        .collect();
        kinds.sort();
        kinds
    };
    let expected = [
        "DestinationRule",
        "EnvoyFilter",
        "Gateway",
        "TLSRoute",
        "VirtualService",
    ];
    assert_eq!(absent(), expected);
    // The CRDs installed: within a recheck the kinds are watched and the table complete.
    kube.serve_group("networking.istio.io", &["v1", "v1beta1", "v1alpha3"]);
    kube.serve_group("gateway.networking.k8s.io", &["v1", "v1alpha2"]);
    let complete = render(&stored, &c.dir.path("controller.yaml"));
    let start = Instant::now();
    while c.table().as_ref() != Some(&complete) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "kinds never watched:\n{}",
            c.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let now_served = logged(&c, "now served; watching").len();
    assert_eq!(now_served, expected.len(), "{}", c.logs());
    // Each absence was logged once, not at every recheck.
    assert_eq!(absent(), expected);
}

/// The kinds of the log lines with `message`, sorted.
fn logged_kinds(c: &Controller, message: &str) -> Vec<String> {
    let mut kinds: Vec<String> = logged(c, message)
        .iter()
        .map(|l| l["kind"].as_str().unwrap_or("").to_owned())
        .collect();
    kinds.sort();
    kinds
}

/// Waits (at most `limit`) until the table is `expected`.
async fn wait_exact(c: &Controller, what: &str, expected: &str, limit: Duration) {
    let start = Instant::now();
    while c.table().as_deref() != Some(expected) {
        assert!(
            start.elapsed() < limit,
            "no table with {what} within {limit:?}; last: {:?}\n{}",
            c.table(),
            c.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kind_that_stops_being_served_is_watched_where_it_is_served_or_emptied() {
    let kube = FakeKube::start().await;
    let mut stored = seed(&kube, &[]);
    let c = Controller::start(&kube);
    let config = c.dir.path("controller.yaml");
    let complete = render(&stored, &config);
    wait_exact(&c, "every shoot", &complete, Duration::from_secs(10)).await;
    let metrics = || async { c.get("/metrics").await.unwrap().1 };
    let served = |kind: &str, version: &str| {
        format!("trellis_controller_served{{kind=\"{kind}\",version=\"{version}\"}} 1")
    };
    let m = metrics().await;
    assert!(m.contains(&served("VirtualService", "v1")), "{m}");
    let envoy_filters = common::metric_in(&m, "trellis_controller_objects{kind=\"EnvoyFilter\"}");
    assert!(envoy_filters > 0.0, "{m}");

    // Istio's v1 goes (an Istio rolled back): the watches end, their restarts get 404, and
    // Gateway, VirtualService and DestinationRule are watched at v1beta1. Their first lists
    // there fail (each kind waits a backoff); the stores are replaced only when a list is
    // done, with the same objects: no table is written.
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_file(c.table_path(), stop.clone());
    kube.fail_next_where(3, Fault::Internal, |r| {
        r.contains("/networking.istio.io/v1beta1/") && !r.contains("watch=true")
    });
    kube.serve_group("networking.istio.io", &["v1beta1", "v1alpha3"]);
    for plural in ["gateways", "virtualservices", "destinationrules"] {
        let watch = format!("/networking.istio.io/v1beta1/{plural}?");
        let start = Instant::now();
        while !kube
            .requests()
            .iter()
            .any(|r| r.contains(&watch) && r.contains("watch=true"))
        {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "no watch of {plural} at v1beta1:\n{}",
                c.logs()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    tokio::time::sleep(2 * Duration::from_millis(20)).await;
    stop.store(true, Ordering::SeqCst);
    let seen = watcher.join().unwrap();
    assert_eq!(seen, [complete], "the move wrote tables");
    assert_eq!(
        logged_kinds(&c, "served at another version; watching it there"),
        ["DestinationRule", "Gateway", "VirtualService"],
        "{}",
        c.logs()
    );
    let m = metrics().await;
    assert!(m.contains(&served("VirtualService", "v1beta1")), "{m}");
    assert!(
        !m.contains("trellis_controller_served{kind=\"VirtualService\",version=\"v1\"}"),
        "{m}"
    );
    // Changes arrive through the new watches.
    kube.delete(
        "networking.istio.io/v1",
        "VirtualService",
        ALPHA,
        "kube-apiserver",
    )
    .unwrap();
    stored.retain(|o| !(o["kind"] == "VirtualService" && o["metadata"]["namespace"] == ALPHA));
    let without_alpha = render(&stored, &config);
    wait_exact(&c, "alpha gone", &without_alpha, Duration::from_secs(10)).await;

    // Istio uninstalled: its kinds' objects are gone, and the table is what the others
    // make — but the EnvoyFilters, whose ACLs restrict shoots, are kept.
    kube.serve_group("networking.istio.io", &[]);
    let istio_routing = ["Gateway", "VirtualService", "DestinationRule"];
    let rest: Vec<Value> = stored
        .iter()
        .filter(|o| {
            !(o["apiVersion"]
                .as_str()
                .unwrap()
                .starts_with("networking.istio.io/")
                && istio_routing.contains(&o["kind"].as_str().unwrap()))
        })
        .cloned()
        .collect();
    let without_istio = render(&rest, &config);
    assert_ne!(without_istio, without_alpha);
    wait_exact(
        &c,
        "no Istio routing",
        &without_istio,
        Duration::from_secs(10),
    )
    .await;
    let start = Instant::now();
    while logged_kinds(
        &c,
        "no longer served; keeping its last objects, which restrict shoots",
    )
    .is_empty()
    {
        assert!(start.elapsed() < Duration::from_secs(10), "{}", c.logs());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        logged_kinds(
            &c,
            "no longer served; keeping its last objects, which restrict shoots"
        ),
        ["EnvoyFilter"]
    );
    assert_eq!(
        logged_kinds(&c, "no longer served; its objects are gone"),
        ["DestinationRule", "Gateway", "VirtualService"]
    );
    let m = metrics().await;
    for kind in ["Gateway", "EnvoyFilter"] {
        assert!(m.contains(&served(kind, "none")), "{m}");
    }
    assert_eq!(
        common::metric_in(&m, "trellis_controller_objects{kind=\"VirtualService\"}"),
        0.0
    );
    assert_eq!(
        common::metric_in(&m, "trellis_controller_objects{kind=\"EnvoyFilter\"}"),
        envoy_filters,
        "{m}"
    );

    // Installed again: found at the next recheck, watched, and the table is whole.
    kube.serve_group("networking.istio.io", &["v1", "v1beta1", "v1alpha3"]);
    wait_exact(
        &c,
        "Istio's shoots back",
        &without_alpha,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        logged_kinds(&c, "now served; watching"),
        [
            "DestinationRule",
            "EnvoyFilter",
            "Gateway",
            "VirtualService"
        ]
    );
    assert!(metrics().await.contains(&served("Gateway", "v1")));
}

/// Requests (LIST or watch) for resource `plural` so far.
fn reads(kube: &FakeKube, plural: &str) -> Vec<String> {
    kube.requests()
        .into_iter()
        .filter(|r| r.contains(&format!("/{plural}?")) || r.ends_with(&format!("/{plural}")))
        .collect()
}

/// Tunnels are opt-in: a controller whose configuration does not turn them on never reads a
/// Secret or a Cluster (not even to look for them) and renders no tunnel route, however
/// many shoots have tunnel peers; one that does reads both and renders the shoot's route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_controller_with_tunnels_on_reads_secrets_and_clusters() {
    let kube = FakeKube::start().await;
    seed(&kube, &[]);
    let name = "tunneled";
    let ns = e2e::namespace(name);
    e2e::put_all(
        &kube,
        vec![
            e2e::cluster(name),
            e2e::peers_secret(name, &trellis::route::WgKey([7; 32]).to_base64()),
        ],
    );
    let tunnel_route = format!("{ns}.tunnel");
    let off = Controller::start(&kube);
    let table = off
        .wait_table("every shoot", |t| route(t, ALPHA).is_some())
        .await;
    assert!(route(&table, &tunnel_route).is_none(), "{table}");
    assert_eq!(off.get("/ready").await.unwrap().0, 200);
    for plural in ["secrets", "clusters"] {
        assert_eq!(reads(&kube, plural), Vec::<String>::new(), "{plural}");
    }
    drop(off);

    let on = Controller(e2e::Controller::start_with(
        &kube,
        "gateway:
  selector: {app: istio-ingressgateway, istio: ingressgateway, istio-role: seed}
fallback: {address: \"istio-ingressgateway.istio-ingress.svc.cluster.local:443\"}
tunnel: {enabled: true}",
    ));
    on.wait_table("the shoot's tunnel", |t| route(t, &tunnel_route).is_some())
        .await;
    for plural in ["secrets", "clusters"] {
        assert!(!reads(&kube, plural).is_empty(), "{plural} not read");
    }
}

/// A shoot whose Cluster writes its node network with host bits set (`10.250.0.1/16`) gets
/// its tunnel all the same, to the network meant (`10.250.0.0/16`): the controller never
/// fails a shoot for it, and logs it, naming the Cluster, the field, the text and the
/// network used, once (not again with every render while it stays).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_network_with_host_bits_is_used_cleared_and_logged_once() {
    let kube = FakeKube::start().await;
    seed(&kube, &[]);
    let name = "hostbits";
    let ns = e2e::namespace(name);
    let mut cluster = e2e::cluster(name);
    cluster["spec"]["shoot"]["spec"]["networking"]["nodes"] = "10.250.0.1/16".into();
    e2e::put_all(
        &kube,
        vec![
            cluster,
            e2e::peers_secret(name, &trellis::route::WgKey([9; 32]).to_base64()),
        ],
    );
    let c = Controller(e2e::Controller::start_with(
        &kube,
        "gateway:
  selector: {app: istio-ingressgateway, istio: ingressgateway, istio-role: seed}
fallback: {address: \"istio-ingressgateway.istio-ingress.svc.cluster.local:443\"}
tunnel: {enabled: true}",
    ));
    let tunnel_route = format!("{ns}.tunnel");
    let table = c
        .wait_table("the shoot's tunnel", |t| route(t, &tunnel_route).is_some())
        .await;
    let allowed =
        &route(&table, &tunnel_route).unwrap()["tunnel"]["wireguard"]["peers"][0]["allowedIPs"];
    assert_eq!(
        allowed,
        &serde_json::json!([
            "192.168.128.5/32",
            "10.250.0.0/16",
            "100.64.0.0/13",
            "100.96.0.0/11"
        ]),
        "{table}"
    );
    let message = "a network with host bits set: its network is used";
    let lines = logged(&c, message);
    let [line] = lines.as_slice() else {
        panic!("{}", c.logs())
    };
    assert_eq!(line["level"], "WARN", "{line}");
    assert_eq!(
        (
            &line["object"],
            &line["field"],
            &line["given"],
            &line["used"]
        ),
        (
            &format!("Cluster {ns}").into(),
            &"spec.shoot.spec.networking.nodes".into(),
            &"10.250.0.1/16".into(),
            &"10.250.0.0/16".into()
        ),
        "{line}"
    );
    // Another shoot: a render with the same Cluster again, which is not logged again.
    let other = "hostbits-other";
    e2e::put_all(
        &kube,
        vec![
            e2e::cluster(other),
            e2e::peers_secret(other, &trellis::route::WgKey([10; 32]).to_base64()),
        ],
    );
    let other_route = format!("{}.tunnel", e2e::namespace(other));
    c.wait_table("the other shoot's tunnel", |t| {
        route(t, &other_route).is_some()
    })
    .await;
    assert_eq!(logged(&c, message).len(), 1, "{}", c.logs());
}

/// Clusters (each can approach 1.5 MiB) are listed twenty at a time: 45 shoots with
/// tunnels take three pages, each asking for 20, and every shoot's route is rendered; the
/// other kinds keep the client's default page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusters_are_listed_in_pages_of_twenty() {
    let kube = FakeKube::start().await;
    seed(&kube, &[]);
    let shoots = 45;
    for i in 0..shoots {
        let name = format!("paged-{i}");
        let key = trellis::route::WgKey([i as u8 + 1; 32]).to_base64();
        e2e::put_all(
            &kube,
            vec![e2e::cluster(&name), e2e::peers_secret(&name, &key)],
        );
    }
    let c = Controller(e2e::Controller::start_with(
        &kube,
        "gateway:
  selector: {app: istio-ingressgateway, istio: ingressgateway, istio-role: seed}
fallback: {address: \"istio-ingressgateway.istio-ingress.svc.cluster.local:443\"}
tunnel: {enabled: true}",
    ));
    c.wait_table("every shoot's tunnel", |t| {
        route_names(t)
            .iter()
            .filter(|n| n.ends_with(".tunnel"))
            .count()
            == shoots
    })
    .await;
    let lists: Vec<String> = reads(&kube, "clusters")
        .into_iter()
        .filter(|r| !r.contains("watch=true"))
        .collect();
    assert_eq!(lists.len(), 3, "{lists:#?}");
    assert!(lists.iter().all(|r| r.contains("limit=20")), "{lists:#?}");
    assert_eq!(
        lists.iter().filter(|r| r.contains("continue=")).count(),
        2,
        "{lists:#?}"
    );
    let others: Vec<String> = reads(&kube, "namespaces")
        .into_iter()
        .filter(|r| !r.contains("watch=true"))
        .collect();
    assert!(
        others.iter().all(|r| r.contains("limit=500")),
        "{others:#?}"
    );
}

#[test]
fn without_a_config_or_with_no_output_it_says_so() {
    let dir = TestDir::new("controller-bad");
    let config = dir.path("c.yaml");
    std::fs::write(
        &config,
        "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: ControllerConfiguration\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args(["controller", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("output.file is required"), "{stderr}");
    let out = Command::new(env!("CARGO_BIN_EXE_trellis"))
        .arg("controller")
        .output()
        .unwrap();
    assert!(!out.status.success());
}
