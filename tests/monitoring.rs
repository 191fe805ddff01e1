//! `deploy/monitoring/`: both kustomizations render with `kubectl kustomize`; the core objects
//! validate against the Kubernetes schemas (`kubernetes-validate --strict`) and the
//! prometheus-operator objects keep the rules that make them scrape what `deploy/` runs (the
//! PodMonitor's ports are the seed pods' admin ports, the seed's pieces admit Prometheus to
//! them in their own namespaces, the ScrapeConfigs find the node daemons' and agents' pods);
//! every alert carries a severity, a summary, a description and a `for`; Prometheus' own
//! `promtool check rules` accepts the alerting rules and every query of the dashboards; and
//! every metric they name is one that a real gateway, controller, node daemon or agent exports
//! (scraped here from the running processes, so a metric renamed in code fails), or `up`,
//! while every family a role exports is on its dashboard. Each check fails on a control.
//! `trellis_ready` follows `/ready` through a drain.
//!
//! Needs kubectl, promtool and kubernetes-validate (`scripts/test` installs the last two under
//! `target/`); skipped with a recorded reason without them.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;
mod e2e;
mod fakekube;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// Metric names the dashboards and rules may use that trellis does not export: Prometheus'
/// own per-target `up`.
const EXTERNAL_METRICS: [&str; 1] = ["up"];

/// The panel types Grafana 7.5 (and so Plutono) ships that the dashboards may use.
const PANEL_TYPES: [&str; 3] = ["row", "graph", "stat"];

/// Families the gateway registers with the tunnel's but only the agent records (its endpoint
/// per lane): on the shoot's dashboard, not the seed's.
const AGENT_ONLY: [&str; 2] = ["trellis_tunnel_endpoint", "trellis_tunnel_endpoint_changes"];

/// Grafana 7.5's dashboard schema version.
const SCHEMA_VERSION: u64 = 27;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

// ---------------------------------------------------------------------------------------
// Tools

/// The tools the test drives, or why it cannot run.
struct Tools {
    promtool: PathBuf,
    validator: PathBuf,
}

/// The first of `candidates` (under the repository) that exists, else `name` if it runs.
fn tool(name: &str, candidates: &[&str], probe: &str) -> Option<PathBuf> {
    for c in candidates {
        let p = repo().join(c);
        if p.exists() {
            return Some(p);
        }
    }
    Command::new(name)
        .arg(probe)
        .output()
        .is_ok_and(|o| o.status.success())
        .then(|| name.into())
}

fn tools(test: &str) -> Option<Tools> {
    let kubectl = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    let promtool = tool(
        "promtool",
        &["target/promtool/usr/bin/promtool"],
        "--version",
    );
    let validator = tool(
        "kubernetes-validate",
        &["target/deploy-venv/bin/kubernetes-validate"],
        "--version",
    );
    let missing: Vec<&str> = [
        (!kubectl).then_some("kubectl"),
        promtool.is_none().then_some("promtool"),
        validator.is_none().then_some("kubernetes-validate"),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !missing.is_empty() {
        skip(
            test,
            &format!(
                "{} not installed (scripts/test installs them)",
                missing.join(", ")
            ),
        );
        return None;
    }
    Some(Tools {
        promtool: promtool.unwrap(),
        validator: validator.unwrap(),
    })
}

/// `kubectl kustomize deploy/BASE`: the rendered objects.
fn render(base: &str) -> Vec<Value> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(repo().join("deploy").join(base))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl kustomize deploy/{base}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_saphyr::from_multiple::<Value>(&String::from_utf8(out.stdout).unwrap())
        .unwrap()
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}

// ---------------------------------------------------------------------------------------
// What the processes export

/// Metric families per role: family name -> the sample names Prometheus stores for it.
type Families = BTreeMap<String, BTreeSet<String>>;

/// The families of `/metrics` text, from its `# TYPE` lines (a family is listed even before
/// its first sample).
fn families(text: &str) -> Families {
    let mut out = Families::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            continue;
        };
        let samples: Vec<String> = match kind {
            "counter" => vec![format!("{name}_total")],
            "histogram" => ["_bucket", "_sum", "_count"]
                .iter()
                .map(|s| format!("{name}{s}"))
                .collect(),
            "summary" => vec![name.into(), format!("{name}_sum"), format!("{name}_count")],
            "info" => vec![format!("{name}_info")],
            _ => vec![name.into()],
        };
        out.insert(name.into(), samples.into_iter().collect());
    }
    out
}

/// A child process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET /metrics` on `admin` once it answers with the `trellis_build_info` family.
fn scrape(admin: SocketAddr, what: &str, log: &Path) -> Families {
    let text = wait_for(Duration::from_secs(30), || {
        http_get(admin, "/metrics").and_then(|(status, body)| {
            (status == 200 && body.contains("trellis_build_info")).then_some(body)
        })
    })
    .unwrap_or_else(|| {
        panic!(
            "{what} served no metrics on {admin}:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        )
    });
    families(&text)
}

/// Starts `trellis ROLE --config FILE` with `config` (which names `admin`) in `dir`.
fn spawn(dir: &TestDir, role: &str, config: &str) -> Killed {
    let file = dir.path(&format!("{role}.yaml"));
    std::fs::write(&file, config).unwrap();
    let log = std::fs::File::create(dir.path(&format!("{role}.log"))).unwrap();
    Killed(
        Command::new(BIN)
            .args(["--log-format", "json", role, "--config"])
            .arg(&file)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    )
}

/// What every role exports, scraped from a real process of each: a gateway, a controller
/// against the fake API server, a node daemon and an agent (scraped once per test binary).
fn exported() -> &'static BTreeMap<&'static str, Families> {
    static EXPORTED: OnceLock<BTreeMap<&'static str, Families>> = OnceLock::new();
    EXPORTED.get_or_init(|| {
        let mut out = BTreeMap::new();

        let nowhere = SocketAddr::from(([127, 0, 0, 1], 1));
        let table = routes_yaml(&[R {
            name: "a",
            sni: &["a.example.com"],
            backends: &[nowhere],
        }]);
        let gw = Gateway::start(&table, "");
        out.insert(
            "gateway",
            scrape(gw.admin, "the gateway", &gw.log_dir.path("gateway.log")),
        );
        drop(gw);

        let rt = tokio::runtime::Runtime::new().unwrap();
        let kube = rt.block_on(fakekube::FakeKube::start());
        let controller = {
            let _guard = rt.enter();
            e2e::Controller::start(&kube, nowhere)
        };
        out.insert(
            "controller",
            scrape(
                controller.admin,
                "the controller",
                &controller.dir.path("controller.log"),
            ),
        );
        drop(controller);
        drop(kube);

        let dir = TestDir::new("monitoring-node");
        let ports = free_ports(2);
        let admin = SocketAddr::from(([127, 0, 0, 1], ports[1]));
        let _node = spawn(
            &dir,
            "node",
            &format!(
                "apiVersion: trellis.gardener.cloud/v1alpha1
kind: NodeConfiguration
listen: [\"127.0.0.1:{}\"]
upstream:
  address: \"127.0.0.1:1\"
  protocol: http-connect
  destination: \"outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local\"
admin: {{address: \"{admin}\"}}
",
                ports[0]
            ),
        );
        out.insert(
            "node",
            scrape(admin, "the node daemon", &dir.path("node.log")),
        );

        let dir = TestDir::new("monitoring-agent");
        let key = dir.path("agent.key");
        std::fs::write(&key, "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=\n").unwrap();
        let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let _agent = spawn(
            &dir,
            "agent",
            &format!(
                "apiVersion: trellis.gardener.cloud/v1alpha1
kind: AgentConfiguration
wireguard:
  privateKeyFile: {key:?}
  addresses: [192.168.128.5]
  gateway:
    publicKey: \"KCkqKywtLi8wMTIzNDU2Nzg5Ojs8PT4/QEFCQ0RFRkc=\"
    endpoints: [{{udp: \"127.0.0.1:{}\"}}]
networks: [\"10.250.0.0/16\"]
admin: {{address: \"{admin}\"}}
",
                free_port()
            ),
        );
        out.insert("agent", scrape(admin, "the agent", &dir.path("agent.log")));
        out
    })
}

/// Every sample name some role exports.
fn all_samples(exported: &BTreeMap<&str, Families>) -> BTreeSet<String> {
    exported
        .values()
        .flat_map(|f| f.values().flatten().cloned())
        .collect()
}

// ---------------------------------------------------------------------------------------
// PromQL

/// PromQL's aggregation operators and keywords: never metric names where they stand.
const KEYWORDS: [&str; 26] = [
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "atan2",
];

/// The metric names `expr` selects. `expr` is valid PromQL (promtool checks that): a name is
/// an identifier outside label braces and ranges that is neither a function (followed by
/// `(`), a keyword, nor in the label list of `by`/`without`/`on`/`ignoring`/`group_*`;
/// `{__name__="x"}` names x.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let (mut i, mut braces, mut skip_list) = (0, 0usize, false);
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let next_non_space = |mut j: usize| {
        while j < chars.len() && chars[j].is_whitespace() {
            j += 1;
        }
        (j, chars.get(j).copied())
    };
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                let start = i + 1;
                i += 1;
                while i < chars.len() && chars[i] != c {
                    if chars[i] == '\\' && c != '`' {
                        i += 1;
                    }
                    i += 1;
                }
                let literal: String = chars[start..i.min(chars.len())].iter().collect();
                let before: String = chars[..start - 1].iter().collect();
                let before = before.trim_end();
                if braces > 0 && before.ends_with('=') {
                    let matcher = before.trim_end_matches(['=', '~', '!']).trim_end();
                    if matcher.ends_with("__name__") {
                        names.insert(literal);
                    }
                }
                i += 1;
            }
            '{' => {
                braces += 1;
                i += 1;
            }
            '}' => {
                braces = braces.saturating_sub(1);
                i += 1;
            }
            '[' => {
                while i < chars.len() && chars[i] != ']' {
                    i += 1;
                }
                i += 1;
            }
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '(' if skip_list => {
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
                skip_list = false;
                i += 1;
            }
            c if c.is_ascii_digit() || c == '.' => {
                while i < chars.len() && (ident(chars[i]) || chars[i] == '.') {
                    i += 1;
                }
            }
            c if ident(c) => {
                let start = i;
                while i < chars.len() && ident(chars[i]) {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let (_, next) = next_non_space(i);
                if braces > 0 {
                    continue;
                }
                if [
                    "by",
                    "without",
                    "on",
                    "ignoring",
                    "group_left",
                    "group_right",
                ]
                .contains(&word.as_str())
                {
                    skip_list = next == Some('(');
                    continue;
                }
                let lower = word.to_ascii_lowercase();
                if next == Some('(')
                    || KEYWORDS.contains(&word.as_str())
                    || lower == "inf"
                    || lower == "nan"
                {
                    continue;
                }
                names.insert(word);
            }
            _ => i += 1,
        }
    }
    names
}

/// A dashboard query with Grafana's variables replaced so Prometheus can parse it: the
/// interval variables by `5m`, every other `$var`, `${var}` or `[[var]]` by `.*` (they stand
/// in label matchers).
fn substitute(query: &str) -> String {
    let mut out = String::new();
    let mut rest = query;
    while let Some(at) = rest.find(['$', '[']) {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        let (name, len) = if let Some(t) = tail.strip_prefix("${") {
            let end = t.find('}').unwrap_or(t.len());
            (&t[..end], end + 3)
        } else if let Some(t) = tail.strip_prefix("[[") {
            let end = t.find("]]").unwrap_or(t.len());
            (&t[..end], end + 4)
        } else if let Some(t) = tail.strip_prefix('$') {
            let end = t
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(t.len());
            (&t[..end], end + 1)
        } else {
            out.push('[');
            rest = &tail[1..];
            continue;
        };
        if name.is_empty() {
            out.push_str(&tail[..1]);
            rest = &tail[1..];
            continue;
        }
        out.push_str(match name {
            "__rate_interval" | "__interval" | "__range" => "5m",
            _ => ".*",
        });
        rest = &tail[len..];
    }
    out.push_str(rest);
    out
}

/// The PromQL of a template variable's query: the selector of `label_values(SELECTOR,
/// label)` or `query_result(EXPR)`; none for `label_values(label)` and other kinds.
fn variable_query(query: &str) -> Option<String> {
    let inner = |prefix: &str| {
        query
            .trim()
            .strip_prefix(prefix)?
            .strip_suffix(')')
            .map(str::to_owned)
    };
    if let Some(args) = inner("label_values(") {
        let (selector, _label) = args.rsplit_once(',')?;
        return Some(selector.trim().to_owned());
    }
    inner("query_result(")
}

/// Every query of a dashboard: (where, PromQL after substitution).
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    fn panels<'a>(list: &'a Value, into: &mut Vec<&'a Value>) {
        for p in list.as_array().into_iter().flatten() {
            into.push(p);
            panels(&p["panels"], into);
        }
    }
    let mut all = Vec::new();
    panels(&dashboard["panels"], &mut all);
    for p in all {
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                out.push((format!("panel {:?}", p["title"]), substitute(e)));
            }
        }
    }
    for v in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if v["type"] == "query" {
            let q = v["query"].as_str().or(v["query"]["query"].as_str());
            if let Some(q) = q.and_then(variable_query) {
                out.push((format!("variable {:?}", v["name"]), substitute(&q)));
            }
        }
    }
    out
}

/// `promtool check rules` on `groups` (a rule file's `groups`); Err with its report.
fn promtool_check(promtool: &Path, groups: &Value) -> Result<(), String> {
    let dir = TestDir::new("monitoring-promtool");
    let file = dir.path("rules.yaml");
    // JSON is YAML.
    std::fs::write(&file, json!({"groups": groups}).to_string()).unwrap();
    let out = Command::new(promtool)
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "promtool check rules:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// The dashboard's queries as recording rules, for promtool.
fn dashboard_groups(queries: &[(String, String)]) -> Value {
    let rules: Vec<Value> = queries
        .iter()
        .enumerate()
        .map(|(i, (_, e))| json!({"record": format!("dashboard:query_{i}"), "expr": e}))
        .collect();
    json!([{"name": "dashboard", "rules": rules}])
}

/// Every (where, expr) of the alerting rules of a PrometheusRule.
fn rule_queries(rule: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for g in rule["spec"]["groups"].as_array().into_iter().flatten() {
        for r in g["rules"].as_array().into_iter().flatten() {
            let name = r["alert"].as_str().or(r["record"].as_str()).unwrap_or("?");
            out.push((
                format!("rule {name}"),
                r["expr"].as_str().unwrap_or("").to_owned(),
            ));
        }
    }
    out
}

/// Err naming each query that selects a metric nobody exports.
fn names_exist(queries: &[(String, String)], exported: &BTreeSet<String>) -> Result<(), String> {
    let mut unknown = Vec::new();
    for (at, e) in queries {
        let names = metric_names(e);
        if names.is_empty() && !e.contains("vector(") {
            unknown.push(format!("{at}: selects no metric: {e}"));
        }
        for n in names {
            if !exported.contains(&n) && !EXTERNAL_METRICS.contains(&n.as_str()) {
                unknown.push(format!("{at}: {n} is exported by no role"));
            }
        }
    }
    if unknown.is_empty() {
        Ok(())
    } else {
        Err(unknown.join("\n"))
    }
}

/// Err naming each family of `roles` that no query of the dashboard reads.
fn dashboard_covers(
    queries: &[(String, String)],
    exported: &BTreeMap<&str, Families>,
    roles: &[&str],
) -> Result<(), String> {
    let used: BTreeSet<String> = queries.iter().flat_map(|(_, e)| metric_names(e)).collect();
    let mut missing = BTreeSet::new();
    for role in roles {
        for (family, samples) in &exported[role] {
            if *role != "agent" && AGENT_ONLY.contains(&family.as_str()) {
                continue;
            }
            if !samples.iter().any(|s| used.contains(s)) {
                missing.insert(format!("{family} ({role})"));
            }
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "on no panel: {}",
            missing.into_iter().collect::<Vec<_>>().join(", ")
        ))
    }
}

// ---------------------------------------------------------------------------------------
// Objects

fn find<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn one<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    let found = find(objects, kind);
    assert_eq!(found.len(), 1, "one {kind} expected");
    found[0]
}

/// The dashboard JSON in a ConfigMap labelled for Plutono's sidecar (`cluster`: seed or
/// shoot); Err if the label or the JSON is wrong.
fn dashboard_in(objects: &[Value], cluster: &str) -> Result<Value, String> {
    let label = format!("dashboard.monitoring.gardener.cloud/{cluster}");
    let cm = find(objects, "ConfigMap")
        .into_iter()
        .find(|c| c["metadata"]["labels"][&label] == "true")
        .ok_or(format!("no ConfigMap labelled {label}=\"true\""))?;
    let data = cm["data"].as_object().ok_or("ConfigMap without data")?;
    let (_, text) = data.iter().next().ok_or("ConfigMap without data")?;
    serde_json::from_str(text.as_str().unwrap_or("")).map_err(|e| format!("dashboard JSON: {e}"))
}

/// Grafana 7.5 can load it: schema version, panel types, every panel on `$datasource`,
/// unique panel ids, a uid.
fn dashboard_schema(d: &Value) -> Result<(), String> {
    if d["schemaVersion"]
        .as_u64()
        .is_none_or(|v| v > SCHEMA_VERSION)
    {
        return Err(format!("schemaVersion must be at most {SCHEMA_VERSION}"));
    }
    if d["uid"].as_str().is_none_or(str::is_empty) {
        return Err("no uid".into());
    }
    let mut ids = BTreeSet::new();
    for p in d["panels"].as_array().ok_or("no panels")? {
        let kind = p["type"].as_str().unwrap_or("");
        if !PANEL_TYPES.contains(&kind) {
            return Err(format!("panel {:?}: type {kind:?}", p["title"]));
        }
        if kind != "row" && p["datasource"] != "$datasource" {
            return Err(format!("panel {:?}: datasource", p["title"]));
        }
        if !ids.insert(p["id"].as_u64().ok_or("panel without id")?) {
            return Err(format!("panel id {} twice", p["id"]));
        }
    }
    Ok(())
}

/// Every alert says how bad, what, what to check, and waits before it fires.
fn alerts_complete(rule: &Value, prometheus: &str) -> Result<(), String> {
    if rule["metadata"]["labels"]["prometheus"] != prometheus {
        return Err(format!(
            "PrometheusRule not labelled prometheus: {prometheus}"
        ));
    }
    let mut names = BTreeSet::new();
    for g in rule["spec"]["groups"].as_array().ok_or("no groups")? {
        for r in g["rules"].as_array().ok_or("group without rules")? {
            let name = r["alert"].as_str().ok_or("a rule without alert")?;
            if !names.insert(name) {
                return Err(format!("{name} twice"));
            }
            if !["critical", "warning"].contains(&r["labels"]["severity"].as_str().unwrap_or("")) {
                return Err(format!("{name}: severity critical or warning"));
            }
            for a in ["summary", "description"] {
                if r["annotations"][a].as_str().is_none_or(|s| s.len() < 10) {
                    return Err(format!("{name}: no {a}"));
                }
            }
            if r["for"].as_str().is_none_or(str::is_empty) {
                return Err(format!("{name}: no for"));
            }
        }
    }
    Ok(())
}

fn pod_template(workload: &Value) -> &Value {
    &workload["spec"]["template"]
}

fn containers(workload: &Value) -> impl Iterator<Item = &Value> {
    let spec = &pod_template(workload)["spec"];
    spec["initContainers"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(spec["containers"].as_array().into_iter().flatten())
}

/// Does `selector` (matchLabels and `In` matchExpressions) select `labels`?
fn selects(selector: &Value, labels: &Value) -> bool {
    let labels_ok = selector["matchLabels"]
        .as_object()
        .into_iter()
        .flatten()
        .all(|(k, v)| &labels[k] == v);
    let exprs_ok = selector["matchExpressions"]
        .as_array()
        .into_iter()
        .flatten()
        .all(|e| {
            e["operator"] == "In"
                && e["values"]
                    .as_array()
                    .is_some_and(|vs| vs.contains(&labels[e["key"].as_str().unwrap_or("")]))
        });
    labels_ok && exprs_ok
}

/// The seed's trellis pods are all scraped on their admin ports, and Prometheus may reach
/// those ports: the PodMonitor selects every trellis workload of deploy/seed's pieces in any
/// namespace and each of its ports is a container port of every such pod; that port's number
/// is admitted by the pieces themselves, never by deploy/monitoring (which must apply on a
/// seed whatever pieces run there): by a NetworkPolicy in the pod's namespace that selects it
/// and admits the seed's Prometheus pods, or by a Service there that selects it and carries
/// Gardener's `from-all-seed-scrape-targets-allowed-ports` annotation (from which
/// gardener-resource-manager writes that policy).
fn seed_scraped(monitoring: &[Value], seed: &[Value]) -> Result<(), String> {
    let pm = one(monitoring, "PodMonitor");
    if pm["metadata"]["labels"]["prometheus"] != "aggregate" {
        return Err("PodMonitor not labelled prometheus: aggregate".into());
    }
    if pm["spec"]["namespaceSelector"]["any"] != true {
        return Err("PodMonitor must look in any namespace".into());
    }
    let ports: Vec<&str> = pm["spec"]["podMetricsEndpoints"]
        .as_array()
        .ok_or("no podMetricsEndpoints")?
        .iter()
        .map(|e| e["port"].as_str().unwrap_or(""))
        .collect();
    let workloads: Vec<&Value> = seed
        .iter()
        .filter(|o| {
            ["Deployment", "StatefulSet", "DaemonSet"].contains(&o["kind"].as_str().unwrap_or(""))
        })
        .collect();
    if workloads.is_empty() {
        return Err("deploy/seed renders no workload".into());
    }
    for w in workloads {
        let name = w["metadata"]["name"].as_str().unwrap_or("");
        let labels = &pod_template(w)["metadata"]["labels"];
        if !selects(&pm["spec"]["selector"], labels) {
            return Err(format!("PodMonitor does not select {name}"));
        }
        for port in &ports {
            let number = containers(w)
                .flat_map(|c| c["ports"].as_array().into_iter().flatten())
                .find(|p| p["name"] == *port)
                .and_then(|p| p["containerPort"].as_u64())
                .ok_or(format!("{name} has no container port {port}"))?;
            if !prometheus_admitted(seed, w, number) {
                return Err(format!(
                    "nothing admits the seed's Prometheus to {name}'s {port} ({number})"
                ));
            }
        }
    }
    Ok(())
}

/// Whether the seed's Prometheus pods (in `garden`, labelled
/// `networking.resources.gardener.cloud/to-all-seed-scrape-targets: allowed`) may reach
/// `port` of the pods of `workload`, by the objects in `seed`: see [`seed_scraped`].
fn prometheus_admitted(seed: &[Value], workload: &Value, port: u64) -> bool {
    let namespace = &workload["metadata"]["namespace"];
    let labels = &pod_template(workload)["metadata"]["labels"];
    let here = |kind: &'static str| {
        seed.iter()
            .filter(move |o| o["kind"] == kind && &o["metadata"]["namespace"] == namespace)
    };
    let prometheus = json!({
        "namespace": {"kubernetes.io/metadata.name": "garden"},
        "pod": {"networking.resources.gardener.cloud/to-all-seed-scrape-targets": "allowed"},
    });
    let by_policy = here("NetworkPolicy").any(|np| {
        selects(&np["spec"]["podSelector"], labels)
            && np["spec"]["ingress"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|rule| {
                    let from_prometheus = rule["from"].as_array().is_none_or(|from| {
                        // Without a namespaceSelector a peer is in the policy's namespace.
                        from.iter().any(|f| {
                            f["namespaceSelector"].is_object()
                                && selects(&f["namespaceSelector"], &prometheus["namespace"])
                                && selects(&f["podSelector"], &prometheus["pod"])
                        })
                    });
                    let on_port = rule["ports"].as_array().is_none_or(|ports| {
                        ports.iter().any(|p| {
                            p["port"] == port && p["protocol"].as_str().unwrap_or("TCP") == "TCP"
                        })
                    });
                    from_prometheus && on_port
                })
    });
    let by_annotation = here("Service").any(|svc| {
        let selector = json!({"matchLabels": svc["spec"]["selector"]});
        let allowed: Vec<Value> = svc["metadata"]["annotations"]
            ["networking.resources.gardener.cloud/from-all-seed-scrape-targets-allowed-ports"]
            .as_str()
            .and_then(|a| serde_json::from_str(a).ok())
            .unwrap_or_default();
        svc["spec"]["selector"].is_object()
            && selects(&selector, labels)
            && allowed
                .iter()
                .any(|a| a["port"] == port && a["protocol"] == "TCP")
    });
    by_policy || by_annotation
}

/// Each shoot ScrapeConfig finds its workload's pods: pods in the workload's namespace, named
/// after it, with the container and port its keep rule names.
fn shoot_scraped(monitoring: &[Value], workloads: &[(&str, Value)]) -> Result<(), String> {
    for (job, w) in workloads {
        let sc = find(monitoring, "ScrapeConfig")
            .into_iter()
            .find(|s| {
                s["spec"]["relabelings"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|r| r["targetLabel"] == "job" && r["replacement"] == *job)
            })
            .ok_or(format!("no ScrapeConfig with job {job}"))?;
        if sc["metadata"]["labels"]["prometheus"] != "shoot" {
            return Err(format!("{job}: not labelled prometheus: shoot"));
        }
        let sd = &sc["spec"]["kubernetesSDConfigs"][0];
        let namespace = w["metadata"]["namespace"].as_str().unwrap_or("");
        if sd["role"] != "Pod" || sd["namespaces"]["names"] != json!([namespace]) {
            return Err(format!("{job}: discovers no pods in {namespace}"));
        }
        let keep = |source: &str| {
            sc["spec"]["relabelings"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|r| r["action"] == "keep" && r["sourceLabels"][0] == source)
                .and_then(|r| r["regex"].as_str())
                .map(str::to_owned)
        };
        let name = w["metadata"]["name"].as_str().unwrap_or("");
        let prefix =
            keep("__meta_kubernetes_pod_name").ok_or(format!("{job}: no pod name rule"))?;
        if prefix != format!("{name}-.*") {
            return Err(format!(
                "{job}: keeps pods {prefix:?}, the workload is {name}"
            ));
        }
        let pair = keep("__meta_kubernetes_pod_container_name")
            .ok_or(format!("{job}: no container rule"))?;
        let (container, port) = pair.split_once(';').ok_or(format!("{job}: {pair}"))?;
        let found = containers(w).any(|c| {
            c["name"] == container
                && c["ports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|p| p["name"] == port)
        });
        if !found {
            return Err(format!(
                "{job}: {name} has no container {container} with port {port}"
            ));
        }
    }
    Ok(())
}

/// `kubernetes-validate --strict` on the objects of core kinds (the operator's CRDs have no
/// schema there; [`seed_scraped`], [`shoot_scraped`] and [`alerts_complete`] check them).
fn validate_core(validator: &Path, objects: &[Value]) -> Result<(), String> {
    let core: Vec<&Value> = objects
        .iter()
        .filter(|o| {
            !o["apiVersion"]
                .as_str()
                .unwrap_or("")
                .starts_with("monitoring.coreos.com/")
        })
        .collect();
    let dir = TestDir::new("monitoring-validate");
    let file = dir.path("rendered.yaml");
    let docs: Vec<String> = core.iter().map(|o| o.to_string()).collect();
    std::fs::write(&file, docs.join("\n---\n")).unwrap();
    let out = Command::new(validator)
        .args(["--strict", "-k", "1.31.0"])
        .arg(&file)
        .output()
        .unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let passed = report.matches(" passed for resource ").count();
    if out.status.success() && passed == core.len() {
        Ok(())
    } else {
        Err(format!(
            "{passed} of {} objects passed:\n{report}",
            core.len()
        ))
    }
}

/// Everything rendered from deploy/monitoring and deploy/monitoring/shoot, checked together.
struct Rendered {
    seed_monitoring: Vec<Value>,
    shoot_monitoring: Vec<Value>,
    seed: Vec<Value>,
    shoot_workloads: Vec<(&'static str, Value)>,
}

impl Rendered {
    fn new() -> Rendered {
        let workload = |base: &str, kind: &str| {
            render(base)
                .into_iter()
                .find(|o| o["kind"] == kind)
                .unwrap_or_else(|| panic!("deploy/{base} renders no {kind}"))
        };
        Rendered {
            seed_monitoring: render("monitoring"),
            shoot_monitoring: render("monitoring/shoot"),
            seed: ["seed/gateway", "seed/tunnel", "seed/zone"]
                .into_iter()
                .flat_map(render)
                .collect(),
            shoot_workloads: vec![
                ("trellis-node", workload("shoot", "DaemonSet")),
                ("trellis-agent", workload("agent", "StatefulSet")),
            ],
        }
    }

    /// Every check; Err with the first failure.
    fn check(&self, tools: &Tools, exported: &BTreeMap<&str, Families>) -> Result<(), String> {
        let samples = all_samples(exported);
        for (objects, cluster, prometheus, roles) in [
            (
                &self.seed_monitoring,
                "seed",
                "aggregate",
                &["gateway", "controller"],
            ),
            (&self.shoot_monitoring, "shoot", "shoot", &["node", "agent"]),
        ] {
            let at = |e: String| format!("deploy/monitoring ({cluster}): {e}");
            validate_core(&tools.validator, objects).map_err(at)?;
            let dashboard = dashboard_in(objects, cluster).map_err(at)?;
            dashboard_schema(&dashboard).map_err(at)?;
            let queries = dashboard_queries(&dashboard);
            promtool_check(&tools.promtool, &dashboard_groups(&queries)).map_err(at)?;
            names_exist(&queries, &samples).map_err(at)?;
            dashboard_covers(&queries, exported, roles).map_err(at)?;
            let rule = one(objects, "PrometheusRule");
            alerts_complete(rule, prometheus).map_err(at)?;
            promtool_check(&tools.promtool, &rule["spec"]["groups"]).map_err(at)?;
            names_exist(&rule_queries(rule), &samples).map_err(at)?;
        }
        seed_scraped(&self.seed_monitoring, &self.seed)?;
        shoot_scraped(&self.shoot_monitoring, &self.shoot_workloads)?;
        Ok(())
    }

    /// The seed dashboard's JSON, to edit, and how to put it back.
    fn edit_seed_dashboard(&mut self, f: impl FnOnce(&mut Value)) {
        let cm = self
            .seed_monitoring
            .iter_mut()
            .find(|o| o["kind"] == "ConfigMap")
            .unwrap();
        let key = cm["data"]
            .as_object()
            .unwrap()
            .keys()
            .next()
            .unwrap()
            .clone();
        let mut d: Value = serde_json::from_str(cm["data"][&key].as_str().unwrap()).unwrap();
        f(&mut d);
        cm["data"][&key] = d.to_string().into();
    }

    fn seed_rule(&mut self) -> &mut Value {
        self.seed_monitoring
            .iter_mut()
            .find(|o| o["kind"] == "PrometheusRule")
            .unwrap()
    }
}

/// The first graph panel's first query.
fn first_expr(d: &mut Value) -> &mut Value {
    let p = d["panels"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|p| p["type"] == "graph")
        .unwrap();
    &mut p["targets"][0]["expr"]
}

#[test]
fn monitoring_renders_validates_and_names_only_metrics_trellis_exports() {
    let Some(tools) = tools("monitoring_renders_validates_and_names_only_metrics_trellis_exports")
    else {
        return;
    };
    let exported = exported();
    for role in ["gateway", "controller", "node", "agent"] {
        assert!(
            exported[role].contains_key("trellis_build_info")
                && exported[role].contains_key("trellis_ready"),
            "{role}: {:?}",
            exported[role].keys()
        );
    }
    Rendered::new().check(&tools, exported).unwrap();
}

#[test]
fn a_dashboard_or_rule_that_drifts_from_the_code_or_the_pods_fails() {
    let Some(tools) = tools("a_dashboard_or_rule_that_drifts_from_the_code_or_the_pods_fails")
    else {
        return;
    };
    let exported = exported();
    let fails = |what: &str, edit: &dyn Fn(&mut Rendered), expect: &str| {
        let mut r = Rendered::new();
        edit(&mut r);
        let e = r.check(&tools, exported).expect_err(what);
        assert!(e.contains(expect), "{what}: {e}");
    };
    // A metric renamed in code (or misspelt on a panel).
    fails(
        "a panel naming a metric nobody exports",
        &|r| {
            r.edit_seed_dashboard(|d| {
                let e = first_expr(d);
                *e = e
                    .as_str()
                    .unwrap()
                    .replace(
                        "trellis_downstream_connections_total",
                        "trellis_downstream_conns_total",
                    )
                    .into();
            })
        },
        "trellis_downstream_conns_total is exported by no role",
    );
    fails(
        "a variable naming a metric nobody exports",
        &|r| {
            r.edit_seed_dashboard(|d| {
                d["templating"]["list"][1]["query"] =
                    "label_values(trellis_nope{job=~\"trellis-.+\"}, namespace)".into();
            })
        },
        "trellis_nope is exported by no role",
    );
    // A family that no panel shows.
    fails(
        "a family on no panel",
        &|r| {
            r.edit_seed_dashboard(|d| {
                for p in d["panels"].as_array_mut().unwrap() {
                    p["targets"].as_array_mut().into_iter().for_each(|t| {
                        t.retain(|t| {
                            !t["expr"]
                                .as_str()
                                .unwrap()
                                .contains("trellis_half_closed_connections")
                        })
                    });
                }
            })
        },
        "trellis_half_closed_connections (gateway)",
    );
    // PromQL that Prometheus does not parse.
    fails(
        "a panel query that does not parse",
        &|r| r.edit_seed_dashboard(|d| *first_expr(d) = "sum by (outcome (rate(up[5m]))".into()),
        "promtool check rules",
    );
    fails(
        "a panel of a type Grafana 7.5 lacks",
        &|r| r.edit_seed_dashboard(|d| d["panels"][1]["type"] = "timeseries".into()),
        "type \"timeseries\"",
    );
    // Rules.
    fails(
        "a rule naming a metric nobody exports",
        &|r| {
            let rule = r.seed_rule();
            rule["spec"]["groups"][0]["rules"][1]["expr"] =
                "sum by (namespace, job) (trellis_readyness) == 0".into();
        },
        "trellis_readyness is exported by no role",
    );
    fails(
        "a rule Prometheus rejects",
        &|r| r.seed_rule()["spec"]["groups"][0]["rules"][0]["for"] = "soon".into(),
        "promtool check rules",
    );
    fails(
        "an alert without severity",
        &|r| {
            r.seed_rule()["spec"]["groups"][0]["rules"][0]["labels"]
                .as_object_mut()
                .unwrap()
                .remove("severity");
        },
        "severity",
    );
    // Scraping.
    fails(
        "a PodMonitor port the pods lack",
        &|r| {
            let pm = r
                .seed_monitoring
                .iter_mut()
                .find(|o| o["kind"] == "PodMonitor")
                .unwrap();
            pm["spec"]["podMetricsEndpoints"][1]["port"] = "controller-admin".into();
        },
        "no container port controller-admin",
    );
    fails(
        "the tunnel gateway's NetworkPolicy without Prometheus",
        &|r| {
            let np = r
                .seed
                .iter_mut()
                .find(|o| o["kind"] == "NetworkPolicy" && o["metadata"]["name"] == "trellis-tunnel")
                .unwrap();
            for rule in np["spec"]["ingress"].as_array_mut().unwrap() {
                if let Some(ports) = rule["ports"].as_array_mut() {
                    ports.retain(|p| p["port"] != 15022);
                }
            }
        },
        "nothing admits the seed's Prometheus to trellis-tunnel-0's ctl-admin (15022)",
    );
    fails(
        "the metrics Service without Gardener's scrape annotation",
        &|r| {
            for svc in r.seed.iter_mut().filter(|o| {
                o["kind"] == "Service" && o["metadata"]["name"] == "trellis-gateway-metrics"
            }) {
                svc["metadata"]["annotations"]
                    .as_object_mut()
                    .unwrap()
                    .clear();
            }
        },
        "nothing admits the seed's Prometheus to trellis-gateway's admin (15021)",
    );
    fails(
        "a ScrapeConfig for pods the shoot does not run",
        &|r| {
            let sc = r
                .shoot_monitoring
                .iter_mut()
                .find(|o| {
                    o["kind"] == "ScrapeConfig" && o["metadata"]["name"] == "shoot-trellis-node"
                })
                .unwrap();
            sc["spec"]["relabelings"][2]["regex"] = "apiserver-proxy-.*".into();
        },
        "keeps pods",
    );
}

#[test]
fn metric_names_are_the_selected_metrics_only() {
    let names = |e: &str| metric_names(e).into_iter().collect::<Vec<_>>();
    assert_eq!(
        names(
            "sum by (namespace, job) (rate(a_total{job=~\"x\", b=\"c\"}[5m])) / on (job) \
             group_left (d) clamp_min(b:c, 0.001) > 0.1 and ignoring (result) count(e offset 1h) \
             unless {__name__=\"f\"}"
        ),
        ["a_total", "b:c", "e", "f"]
    );
    assert_eq!(names("time() - max(x) > 300 or vector(0)"), ["x"]);
    assert_eq!(
        substitute("rate(x{a=~\"$a\", b=\"${b}\", c=~\"[[c]]\"}[$__rate_interval])"),
        "rate(x{a=~\".*\", b=\".*\", c=~\".*\"}[5m])"
    );
    assert_eq!(
        variable_query("label_values(trellis_build_info{job=\"x\"}, namespace)").as_deref(),
        Some("trellis_build_info{job=\"x\"}")
    );
    assert_eq!(variable_query("label_values(namespace)"), None);
}

#[test]
fn trellis_ready_follows_readiness_through_a_drain() {
    let table = routes_yaml(&[R {
        name: "a",
        sni: &["a.example.com"],
        backends: &[SocketAddr::from(([127, 0, 0, 1], 1))],
    }]);
    let gw = Gateway::start(&table, "timeouts: {drainDelay: 5s, drain: 5s}");
    let ready = |gw: &Gateway| {
        let status = http_get(gw.admin, "/ready").map(|(s, _)| s);
        let text = gw.metrics();
        let gauge = text
            .lines()
            .find(|l| l.starts_with("trellis_ready "))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
        (status, gauge)
    };
    assert_eq!(ready(&gw), (Some(200), Some(1.0)), "{}", gw.metrics());
    gw.signal("TERM");
    let drained = wait_for(Duration::from_secs(3), || {
        let r = ready(&gw);
        (r.0 == Some(503)).then_some(r)
    });
    assert_eq!(
        drained,
        Some((Some(503), Some(0.0))),
        "/ready 503 and trellis_ready 0 within the drain delay"
    );
}
