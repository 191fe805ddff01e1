//! The fake Kubernetes API server speaks the real protocol: kubectl lists, watches and applies
//! against it; raw HTTP checks what kubectl does not show (410, selectors, faults).

#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod fakekube;
#[path = "common/skipped.rs"]
mod skipped;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use fakekube::{FakeKube, Fault};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::time::timeout;

/// kubectl with a kubeconfig and discovery cache of its own, in a temporary directory.
struct Kubectl {
    dir: PathBuf,
}

impl Kubectl {
    /// None (and a printed SKIP) when kubectl is not installed.
    fn new(kube: &FakeKube, test: &str) -> Option<Kubectl> {
        if std::process::Command::new("kubectl")
            .arg("version")
            .arg("--client")
            .output()
            .is_err()
        {
            println!("SKIP {test}: kubectl is not installed");
            skipped::record_skip(test, "kubectl is not installed");
            return None;
        }
        let dir =
            std::env::temp_dir().join(format!("trellis-fakekube-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        kube.write_kubeconfig(&dir.join("kubeconfig"));
        Some(Kubectl { dir })
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("kubectl");
        cmd.arg("--kubeconfig").arg(self.dir.join("kubeconfig"));
        cmd.arg("--cache-dir").arg(self.dir.join("cache"));
        cmd.args(args).kill_on_drop(true);
        cmd
    }

    /// Runs kubectl to the end (at most 30 s); returns stdout, panics with stderr on failure.
    async fn run(&self, args: &[&str]) -> String {
        let out = timeout(Duration::from_secs(30), self.command(args).output()).await;
        let out = out.expect("kubectl finished within 30 s").unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {stderr}\n{stdout}"
        );
        stdout.into_owned()
    }

    fn file(&self, name: &str, text: &str) -> String {
        let path = self.dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    }
}

impl Drop for Kubectl {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Lines of a running kubectl.
struct Lines {
    child: Child,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    seen: Vec<String>,
}

impl Lines {
    fn spawn(mut cmd: Command) -> Lines {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Lines {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The next line whose words start with `words` (within 10 s); panics with what was seen.
    async fn expect(&mut self, words: &[&str]) -> String {
        let found = timeout(Duration::from_secs(10), async {
            while let Ok(Some(line)) = self.lines.next_line().await {
                self.seen.push(line.clone());
                let got: Vec<&str> = line.split_whitespace().collect();
                if got.starts_with(words) {
                    return Some(line);
                }
            }
            None
        })
        .await;
        match found {
            Ok(Some(line)) => line,
            _ => panic!("no line starting with {words:?}; seen: {:#?}", self.seen),
        }
    }
}

fn cm(ns: &str, name: &str, labels: Value, value: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"namespace": ns, "name": name, "labels": labels}, "data": {"k": value}})
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_get_all_namespaces_pages_with_limit_and_continue() {
    let kube = FakeKube::start().await;
    let Some(kubectl) = Kubectl::new(&kube, "get") else {
        return;
    };
    for (ns, name) in [
        ("b", "two"),
        ("a", "one"),
        ("c", "five"),
        ("a", "three"),
        ("b", "four"),
    ] {
        kube.put(cm(ns, name, json!({}), "v"));
    }
    kube.put(json!({"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": "a", "name": "svc"}}));
    let out = kubectl
        .run(&["get", "-A", "configmaps", "--chunk-size=2"])
        .await;
    let rows: Vec<Vec<&str>> = out
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().take(2).collect())
        .collect();
    let want = [
        ["a", "one"],
        ["a", "three"],
        ["b", "four"],
        ["b", "two"],
        ["c", "five"],
    ];
    assert_eq!(rows, want, "{out}");
    let lists: Vec<String> = kube
        .requests()
        .into_iter()
        .filter(|r| r.starts_with("GET /api/v1/configmaps?"))
        .collect();
    assert_eq!(lists.len(), 3, "three pages of two: {lists:?}");
    assert!(lists.iter().all(|l| l.contains("limit=2")), "{lists:?}");
    assert!(
        lists[1..].iter().all(|l| l.contains("continue=")),
        "{lists:?}"
    );

    let out = kubectl.run(&["get", "cm", "-n", "b"]).await;
    let names: Vec<&str> = out
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(names, ["four", "two"], "{out}");
    let out = kubectl.run(&["get", "-A", "vs"]).await;
    assert!(out.is_empty(), "no virtual services: {out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_watch_shows_added_modified_deleted() {
    let kube = FakeKube::start().await;
    let Some(kubectl) = Kubectl::new(&kube, "watch") else {
        return;
    };
    kube.put(cm("a", "old", json!({}), "v"));
    kube.put(cm("b", "elsewhere", json!({}), "v"));
    let mut watch =
        Lines::spawn(kubectl.command(&["get", "cm", "-n", "a", "-w", "--output-watch-events"]));
    watch.expect(&["EVENT", "NAME"]).await;
    watch.expect(&["ADDED", "old"]).await;
    // The watch is open once kubectl has asked for it; changes after that arrive as events.
    kube.wait_for_request("watch=true").await;
    kube.put(cm("a", "new", json!({}), "v"));
    watch.expect(&["ADDED", "new"]).await;
    kube.put(cm("a", "old", json!({}), "changed"));
    watch.expect(&["MODIFIED", "old"]).await;
    kube.put(cm("b", "elsewhere", json!({}), "changed"));
    kube.delete("v1", "ConfigMap", "a", "new");
    watch.expect(&["DELETED", "new"]).await;
    assert!(
        !watch.seen.iter().any(|l| l.contains("elsewhere")),
        "other namespace leaked: {:#?}",
        watch.seen
    );
    watch.child.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_server_side_apply_creates_then_updates() {
    let kube = FakeKube::start().await;
    let Some(kubectl) = Kubectl::new(&kube, "apply") else {
        return;
    };
    let mut watch =
        Lines::spawn(kubectl.command(&["get", "cm", "-n", "a", "-w", "--output-watch-events"]));
    kube.wait_for_request("watch=true").await;
    let doc = |data: &str| {
        format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: applied\n  namespace: a\ndata:\n{data}"
        )
    };
    let file = kubectl.file("cm.yaml", &doc("  k: v1\n  gone: soon\n"));
    let out = kubectl.run(&["apply", "--server-side", "-f", &file]).await;
    assert_eq!(out.trim(), "configmap/applied serverside-applied");
    watch.expect(&["ADDED", "applied"]).await;
    let obj = kube.get("v1", "ConfigMap", "a", "applied").unwrap();
    assert_eq!(obj["data"], json!({"k": "v1", "gone": "soon"}));
    assert_eq!(obj["metadata"]["managedFields"][0]["manager"], "kubectl");

    // The second apply changes one field and drops one it owned: the field goes away.
    let file = kubectl.file("cm.yaml", &doc("  k: v2\n"));
    kubectl.run(&["apply", "--server-side", "-f", &file]).await;
    watch.expect(&["MODIFIED", "applied"]).await;
    let obj = kube.get("v1", "ConfigMap", "a", "applied").unwrap();
    assert_eq!(obj["data"], json!({"k": "v2"}));

    // Another manager's different value for an owned field conflicts unless forced.
    let mut cmd = kubectl.command(&[
        "apply",
        "--server-side",
        "--field-manager=other",
        "-f",
        &kubectl.file("o.yaml", &doc("  k: theirs\n")),
    ]);
    let out = cmd.output().await.unwrap();
    assert!(!out.status.success(), "a conflicting apply must fail");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("conflict"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        kube.get("v1", "ConfigMap", "a", "applied").unwrap()["data"]["k"],
        "v2"
    );
    let o = kubectl.file("o.yaml", &doc("  k: theirs\n"));
    kubectl
        .run(&[
            "apply",
            "--server-side",
            "--field-manager=other",
            "--force-conflicts",
            "-f",
            &o,
        ])
        .await;
    assert_eq!(
        kube.get("v1", "ConfigMap", "a", "applied").unwrap()["data"]["k"],
        "theirs"
    );
    watch.child.kill().await.unwrap();
}

/// One HTTP/1.1 exchange on a fresh connection: (status, decoded body), or None when the
/// server closed the connection without answering.
async fn http(
    kube: &FakeKube,
    method: &str,
    path: &str,
    content_type: &str,
    body: &str,
) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(kube.addr()).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    timeout(Duration::from_secs(10), s.read_to_end(&mut raw))
        .await
        .unwrap()
        .ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body.as_bytes()).0
    } else {
        body.to_string()
    };
    Some((status, body))
}

/// Decodes chunked data: (data, whether the final zero-size chunk was seen).
fn dechunk(mut b: &[u8]) -> (String, bool) {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let Ok(n) = usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap_or("x").trim(), 16)
        else {
            break;
        };
        if n == 0 {
            return (String::from_utf8_lossy(&out).into_owned(), true);
        }
        let Some(data) = b.get(eol + 2..eol + 2 + n) else {
            break;
        };
        out.extend_from_slice(data);
        b = &b[(eol + 4 + n).min(b.len())..];
    }
    (String::from_utf8_lossy(&out).into_owned(), false)
}

fn parse(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

/// A raw watch stream: the events as they arrive, and how the stream ended.
struct RawWatch {
    stream: TcpStream,
    raw: Vec<u8>,
    head_len: usize,
    taken: usize,
}

impl RawWatch {
    async fn open(kube: &FakeKube, path: &str) -> RawWatch {
        let mut stream = TcpStream::connect(kube.addr()).await.unwrap();
        stream
            .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut w = RawWatch {
            stream,
            raw: Vec::new(),
            head_len: 0,
            taken: 0,
        };
        while w.head_len == 0 {
            assert!(w.read().await, "no response head");
            if let Some(p) = w.raw.windows(4).position(|x| x == b"\r\n\r\n") {
                w.head_len = p + 4;
            }
        }
        let head = String::from_utf8_lossy(&w.raw[..w.head_len]).to_string();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        w
    }

    /// Reads more; false at end of stream.
    async fn read(&mut self) -> bool {
        let mut buf = [0u8; 4096];
        match timeout(Duration::from_secs(10), self.stream.read(&mut buf))
            .await
            .expect("watch data within 10 s")
        {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.raw.extend_from_slice(&buf[..n]);
                true
            }
        }
    }

    /// The next event, or None when the stream ended (see [`RawWatch::ended_cleanly`]).
    async fn next(&mut self) -> Option<Value> {
        loop {
            let (data, _) = dechunk(&self.raw[self.head_len..]);
            if let Some(line) = data[self.taken..]
                .split_inclusive('\n')
                .next()
                .filter(|l| l.ends_with('\n'))
            {
                self.taken += line.len();
                return Some(parse(line));
            }
            if self.ended_cleanly() || !self.read().await {
                return None;
            }
        }
    }

    fn ended_cleanly(&self) -> bool {
        dechunk(&self.raw[self.head_len..]).1
    }

    /// Event types and names until one of `kind` (inclusive).
    async fn until(&mut self, kind: &str) -> Vec<(String, String)> {
        let mut seen = Vec::new();
        loop {
            let ev = self
                .next()
                .await
                .unwrap_or_else(|| panic!("stream ended before {kind}: {seen:?}"));
            let t = ev["type"].as_str().unwrap().to_string();
            seen.push((
                t.clone(),
                ev["object"]["metadata"]["name"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
            ));
            if t == kind {
                return seen;
            }
        }
    }
}

fn names(list: &Value) -> Vec<&str> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["metadata"]["name"].as_str().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn watch_from_compacted_version_gets_410() {
    let kube = FakeKube::start().await;
    kube.put(cm("a", "one", json!({}), "v"));
    let old = kube.resource_version();
    kube.put(cm("a", "two", json!({}), "v"));
    let list = parse(
        &http(
            &kube,
            "GET",
            "/api/v1/namespaces/a/configmaps?limit=1",
            "",
            "",
        )
        .await
        .unwrap()
        .1,
    );
    let token = list["metadata"]["continue"].as_str().unwrap().to_string();
    kube.put(cm("a", "three", json!({}), "v")); // the token's version is history now
    let path = format!("/api/v1/namespaces/a/configmaps?watch=true&resourceVersion={old}");

    // Before compaction the watch from `old` replays what came after it.
    let mut w = RawWatch::open(&kube, &path).await;
    assert_eq!(w.until("ADDED").await, [("ADDED".into(), "two".into())]);
    drop(w);

    kube.compact();
    let mut w = RawWatch::open(&kube, &path).await;
    let ev = w.next().await.unwrap();
    assert_eq!(
        (
            ev["type"].as_str(),
            ev["object"]["kind"].as_str(),
            ev["object"]["code"].as_u64()
        ),
        (Some("ERROR"), Some("Status"), Some(410)),
        "{ev}"
    );
    assert_eq!(ev["object"]["reason"], "Expired");
    assert!(
        w.next().await.is_none() && w.ended_cleanly(),
        "the stream ends after the ERROR"
    );

    kube.set_gone_as_status(true);
    let (status, body) = http(&kube, "GET", &path, "", "").await.unwrap();
    assert_eq!(
        (status, parse(&body)["reason"].as_str()),
        (410, Some("Expired")),
        "{body}"
    );

    // A continue token from before the compaction is refused too; a watch from now is not.
    let (status, _) = http(
        &kube,
        "GET",
        &format!("/api/v1/namespaces/a/configmaps?limit=1&continue={token}"),
        "",
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, 410);
    let now = kube.resource_version();
    let mut w = RawWatch::open(
        &kube,
        &format!("/api/v1/namespaces/a/configmaps?watch=1&resourceVersion={now}"),
    )
    .await;
    kube.put(cm("a", "four", json!({}), "v"));
    assert_eq!(w.until("ADDED").await, [("ADDED".into(), "four".into())]);
}

#[tokio::test(flavor = "multi_thread")]
async fn label_and_field_selectors_filter_lists_and_watches() {
    let kube = FakeKube::start().await;
    kube.put(cm("a", "one", json!({"tier": "web", "zone": "x"}), "v"));
    kube.put(cm("a", "two", json!({"tier": "db"}), "v"));
    kube.put(cm("b", "three", json!({"tier": "web"}), "v"));
    kube.put(cm("b", "four", json!({}), "v"));
    let cases = [
        ("labelSelector=tier%3Dweb", vec!["one", "three"]),
        ("labelSelector=tier%3D%3Dweb", vec!["one", "three"]),
        ("labelSelector=tier!%3Dweb", vec!["two", "four"]),
        ("labelSelector=tier+in+(db,web),zone", vec!["one"]),
        ("labelSelector=tier%20notin%20(web)", vec!["two", "four"]),
        ("labelSelector=!tier", vec!["four"]),
        ("labelSelector=tier", vec!["one", "two", "three"]),
        ("fieldSelector=metadata.name%3Dtwo", vec!["two"]),
        (
            "fieldSelector=metadata.namespace!%3Da",
            vec!["four", "three"],
        ),
        (
            "fieldSelector=metadata.namespace%3Db&labelSelector=tier%3Dweb",
            vec!["three"],
        ),
    ];
    for (query, want) in cases {
        let (status, body) = http(&kube, "GET", &format!("/api/v1/configmaps?{query}"), "", "")
            .await
            .unwrap();
        assert_eq!(status, 200, "{query}: {body}");
        let list = parse(&body);
        let mut got = names(&list);
        let mut want = want;
        got.sort();
        want.sort();
        assert_eq!(got, want, "{query}");
    }
    let (status, body) = http(
        &kube,
        "GET",
        "/api/v1/configmaps?fieldSelector=spec.x%3Dy",
        "",
        "",
    )
    .await
    .unwrap();
    assert_eq!(
        (status, parse(&body)["reason"].as_str()),
        (400, Some("BadRequest"))
    );

    // A filtered watch: objects entering the selection are ADDED, leaving it DELETED.
    let rv = kube.resource_version();
    let mut w = RawWatch::open(
        &kube,
        &format!("/api/v1/configmaps?watch=true&resourceVersion={rv}&labelSelector=tier%3Dweb"),
    )
    .await;
    kube.put(cm("a", "two", json!({"tier": "web"}), "v"));
    kube.put(cm("a", "one", json!({"tier": "web"}), "changed"));
    kube.put(cm("b", "four", json!({"tier": "none"}), "v"));
    kube.put(cm("b", "three", json!({"tier": "db"}), "v"));
    assert_eq!(
        w.until("DELETED").await,
        [
            ("ADDED".into(), "two".into()),
            ("MODIFIED".into(), "one".into()),
            ("DELETED".into(), "three".into())
        ]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_retries_injected_429() {
    let kube = FakeKube::start().await;
    let Some(kubectl) = Kubectl::new(&kube, "retry") else {
        return;
    };
    kube.put(cm("a", "one", json!({}), "v"));
    kubectl.run(&["get", "cm", "-n", "a"]).await; // discovery cached; the next run only lists
    let before = kube.requests().len();
    kube.fail_next(2, Fault::TooManyRequests);
    let out = kubectl.run(&["get", "cm", "-n", "a"]).await;
    assert!(out.contains("one"), "{out}");
    let lists: Vec<String> = kube.requests()[before..]
        .iter()
        .filter(|r| r.contains("/configmaps"))
        .cloned()
        .collect();
    assert_eq!(lists.len(), 3, "two refused, the third served: {lists:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn faults_500_and_dropped_connections() {
    let kube = FakeKube::start().await;
    kube.fail_next(1, Fault::Internal);
    let (status, body) = http(&kube, "GET", "/api/v1/configmaps", "", "")
        .await
        .unwrap();
    assert_eq!((status, parse(&body)["code"].as_u64()), (500, Some(500)));
    kube.fail_next(1, Fault::Drop);
    assert_eq!(http(&kube, "GET", "/api/v1/configmaps", "", "").await, None);
    assert_eq!(
        http(&kube, "GET", "/api/v1/configmaps", "", "")
            .await
            .map(|r| r.0),
        Some(200),
        "one request each"
    );

    // A watch cut mid-stream ends without the final chunk; a restart closes it too.
    let mut w = RawWatch::open(&kube, "/api/v1/configmaps?watch=true").await;
    kube.put(cm("a", "one", json!({}), "v"));
    w.until("ADDED").await;
    kube.drop_watches();
    assert!(w.next().await.is_none());
    assert!(!w.ended_cleanly(), "a dropped watch must not look finished");
    let mut w = RawWatch::open(&kube, "/api/v1/configmaps?watch=true").await;
    w.until("ADDED").await;
    // An idle keep-alive connection that has been answered once.
    let mut idle = TcpStream::connect(kube.addr()).await.unwrap();
    idle.write_all(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 4096];
    assert!(idle.read(&mut buf).await.unwrap() > 0);
    kube.restart();
    assert!(w.next().await.is_none() && !w.ended_cleanly());
    let closed = timeout(Duration::from_secs(5), idle.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "a restart closes idle connections too"
    );
    assert!(
        kube.get("v1", "ConfigMap", "a", "one").is_some(),
        "a restart keeps the objects"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn watch_bookmarks_initial_events_expiry_and_timeout() {
    let kube = FakeKube::start().await;
    kube.set_bookmark_interval(Duration::from_millis(100));
    kube.put(cm("a", "one", json!({}), "v"));
    let rv = kube.resource_version();
    let mut w = RawWatch::open(&kube, "/api/v1/configmaps?watch=true&allowWatchBookmarks=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan").await;
    let initial = w.next().await.unwrap();
    assert_eq!(
        (
            initial["type"].as_str(),
            initial["object"]["metadata"]["name"].as_str()
        ),
        (Some("ADDED"), Some("one"))
    );
    let end = w.next().await.unwrap();
    assert_eq!(end["type"], "BOOKMARK");
    assert_eq!(
        end["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );
    assert_eq!(end["object"]["metadata"]["resourceVersion"], rv.to_string());
    kube.put(cm("a", "two", json!({}), "v"));
    w.until("ADDED").await;
    let bookmark = w.until("BOOKMARK").await;
    assert_eq!(bookmark.len(), 1, "{bookmark:?}");
    kube.expire_watches();
    let ev = w.until("ERROR").await;
    assert_eq!(ev.last().unwrap().0, "ERROR");
    assert!(w.next().await.is_none() && w.ended_cleanly());

    // No bookmarks unless asked; timeoutSeconds ends the stream cleanly.
    let mut w = RawWatch::open(
        &kube,
        &format!(
            "/api/v1/configmaps?watch=true&resourceVersion={}&timeoutSeconds=1",
            kube.resource_version()
        ),
    )
    .await;
    assert!(w.next().await.is_none() && w.ended_cleanly());
}

#[tokio::test(flavor = "multi_thread")]
async fn single_objects_answer_with_status_errors() {
    let kube = FakeKube::start().await;
    let body = cm("a", "one", json!({}), "v").to_string();
    let (status, created) = http(
        &kube,
        "POST",
        "/api/v1/namespaces/a/configmaps",
        "application/json",
        &body,
    )
    .await
    .unwrap();
    assert_eq!(status, 201, "{created}");
    let rv = parse(&created)["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, again) = http(
        &kube,
        "POST",
        "/api/v1/namespaces/a/configmaps",
        "application/json",
        &body,
    )
    .await
    .unwrap();
    assert_eq!(
        (status, parse(&again)["reason"].as_str()),
        (409, Some("AlreadyExists"))
    );
    let (status, _) = http(
        &kube,
        "POST",
        "/api/v1/namespaces/b/configmaps",
        "application/json",
        &body,
    )
    .await
    .unwrap();
    assert_eq!(status, 400, "the body's namespace must match the URL's");

    let mut stale = parse(&created);
    stale["data"]["k"] = json!("w");
    let (status, _) = http(
        &kube,
        "PUT",
        "/api/v1/namespaces/a/configmaps/one",
        "application/json",
        &stale.to_string(),
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "a PUT with the current version succeeds");
    let (status, conflict) = http(
        &kube,
        "PUT",
        "/api/v1/namespaces/a/configmaps/one",
        "application/json",
        &stale.to_string(),
    )
    .await
    .unwrap();
    assert_eq!(
        (status, parse(&conflict)["reason"].as_str()),
        (409, Some("Conflict")),
        "version {rv} is stale now"
    );

    let (status, patched) = http(
        &kube,
        "PATCH",
        "/api/v1/namespaces/a/configmaps/one",
        "application/merge-patch+json",
        r#"{"data":{"k":null,"n":"1"}}"#,
    )
    .await
    .unwrap();
    assert_eq!(
        (status, &parse(&patched)["data"]),
        (200, &json!({"n": "1"}))
    );
    let (status, _) = http(
        &kube,
        "PATCH",
        "/api/v1/namespaces/a/configmaps/one",
        "application/apply-patch+yaml",
        "data: {n: '2'}",
    )
    .await
    .unwrap();
    assert_eq!(status, 422, "apply needs a field manager");

    let (status, _) = http(
        &kube,
        "DELETE",
        "/api/v1/namespaces/a/configmaps/one",
        "",
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, 200);
    let (status, gone) = http(&kube, "GET", "/api/v1/namespaces/a/configmaps/one", "", "")
        .await
        .unwrap();
    assert_eq!(
        (
            status,
            parse(&gone)["kind"].as_str(),
            parse(&gone)["reason"].as_str()
        ),
        (404, Some("Status"), Some("NotFound"))
    );

    // Istio objects are served at v1 and v1beta1 alike, each read in the version asked for.
    kube.put(json!({"apiVersion": "networking.istio.io/v1beta1", "kind": "Gateway", "metadata": {"namespace": "a", "name": "gw"}}));
    let (_, v1) = http(
        &kube,
        "GET",
        "/apis/networking.istio.io/v1/namespaces/a/gateways/gw",
        "",
        "",
    )
    .await
    .unwrap();
    assert_eq!(parse(&v1)["apiVersion"], "networking.istio.io/v1");
    let (_, list) = http(
        &kube,
        "GET",
        "/apis/networking.istio.io/v1beta1/gateways",
        "",
        "",
    )
    .await
    .unwrap();
    assert_eq!(
        parse(&list)["items"][0]["apiVersion"],
        "networking.istio.io/v1beta1"
    );
}
