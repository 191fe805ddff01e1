//! The controller's render at seed scale: a synthetic seed of N shoots shaped like what
//! gardenlet writes (≈8 objects per shoot), translated into the gateway's table.
//!
//! `cargo bench --bench controller` measures, with criterion, `translate` for 500 and 2,000
//! shoots and the table's JSON serialization for 2,000, then prints
//! - the same figures as medians, against the targets (render ≤ 3 ms for 500 shoots and
//!   ≤ 10 ms for 2,000);
//! - the resident memory of a fresh process holding the 2,000 shoots' snapshot (what the
//!   controller's stores keep), and with the rendered table and its JSON beside it (target:
//!   the controller ≤ 64 MiB);
//! - one offline render (`trellis controller render`'s path: manifest reader, translate,
//!   JSON) of the same 2,000 shoots written as YAML files, for information; with
//!   `TRELLIS_BENCH_CONTROLLER_MANIFESTS=DIR` the files are written to DIR and kept.
//!
//! Per shoot `shoot--<project>--<name>`: Namespace; Gateway, VirtualService and
//! DestinationRule `kube-apiserver` (3 server names); Service `kube-apiserver` and its
//! EndpointSlice; Service `vpn-seed-server` and its EndpointSlice (HA shoots: `-0` and `-1`,
//! each with its slice); every slice 3 ready IPv4 endpoints in 3 zones. One shoot in 10 is
//! exposed on a zonal gateway (not served by the default one), one in 20 is L7 (HTTPS
//! Gateway, HTTP routes, its `-istio-tls-termination` EnvoyFilter), one in 5 is HA.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

use std::hint::black_box;
use std::process::Command;
use std::time::{Duration, Instant};

use criterion::Criterion;
use serde_json::{Value, json};
use trellis::config::controller::ControllerConfig;
use trellis::controller::Reason;
use trellis::controller::model::Snapshot;
use trellis::controller::{Target, manifest, to_json, translate};
use trellis::route::BackendAddress;

/// Shoot counts measured, with the render target for each (the figures).
const SIZES: [(usize, Duration); 2] = [
    (500, Duration::from_millis(3)),
    (2_000, Duration::from_millis(10)),
];

/// The seed whose memory and offline render are measured.
const LARGE: usize = 2_000;

/// Resident memory target for the controller with [`LARGE`] shoots' objects.
const RSS_TARGET_MIB: f64 = 64.0;

/// Set in the child process that measures memory: the number of shoots to hold.
const MEMORY_CHILD: &str = "TRELLIS_BENCH_CONTROLLER_MEMORY";

/// When set, the directory the YAML seed is written to and left in.
const MANIFESTS_DIR: &str = "TRELLIS_BENCH_CONTROLLER_MANIFESTS";

/// The fallback backend of the target gateway (Gardener's Envoy ingress gateway).
const FALLBACK: &str = "istio-ingressgateway.istio-ingress.svc.cluster.local:443";

const PROJECTS: [&str; 8] = [
    "core", "dev", "prod", "ml", "data", "payments", "infra", "qa",
];
const NAMES: [&str; 6] = ["api", "web", "batch", "edge", "search", "stage"];
const ZONES: [&str; 3] = ["eu-1a", "eu-1b", "eu-1c"];

/// What kind of shoot number `i` is.
#[derive(Clone, Copy)]
struct Shape {
    /// Exposed on the zonal gateway of one zone (not served by the default gateway).
    zonal: bool,
    /// Istio terminates its TLS.
    l7: bool,
    /// HA VPN: `vpn-seed-server-0` and `-1`.
    ha: bool,
}

fn shape(i: usize) -> Shape {
    Shape {
        zonal: i % 10 == 5,
        l7: i % 20 == 7,
        ha: i % 5 == 1,
    }
}

fn metadata(ns: &str, name: &str, i: usize, object: usize) -> Value {
    // One shoot a minute from 2024-01-01; every object of a shoot created with it.
    let (day, minute) = (i / 1440, i % 1440);
    let created = format!(
        "2024-{:02}-{:02}T{:02}:{:02}:00Z",
        1 + day / 28,
        1 + day % 28,
        minute / 60,
        minute % 60
    );
    let uid = format!("{i:08x}-{object:04x}-4000-8000-{:012x}", i * 31 + object);
    let mut m = json!({"name": name, "uid": uid, "creationTimestamp": created});
    if !ns.is_empty() {
        m["namespace"] = json!(ns);
    }
    m
}

fn object(api_version: &str, kind: &str, metadata: Value, rest: Value) -> Value {
    let mut o = json!({"apiVersion": api_version, "kind": kind, "metadata": metadata});
    for (k, v) in rest.as_object().unwrap() {
        o[k] = v.clone();
    }
    o
}

/// A Service with its EndpointSlice (3 ready IPv4 endpoints in 3 zones).
fn service(
    out: &mut Vec<Value>,
    (ns, name, i, k): (&str, &str, usize, usize),
    cluster_ip: String,
    ports: &[(&str, u16)],
) {
    let service_ports: Vec<Value> = ports
        .iter()
        .map(|(n, p)| json!({"name": n, "port": p, "protocol": "TCP", "targetPort": p}))
        .collect();
    out.push(object(
        "v1",
        "Service",
        metadata(ns, name, i, k),
        json!({"spec": {
            "type": "ClusterIP",
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "ipFamilies": ["IPv4"],
            "ports": service_ports,
            "selector": {"app": name},
        }}),
    ));
    let endpoints: Vec<Value> = (0..3)
        .map(|e| {
            // Unique pod IPs in 100.96.0.0/11.
            let n = (i * 8 + k) * 4 + e;
            json!({
                "addresses": [format!("100.{}.{}.{}", 96 + (n >> 16), (n >> 8) & 255, n & 255)],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": format!("node-{}", (i + e) % 40),
                "zone": ZONES[e],
                "targetRef": {"kind": "Pod", "name": format!("{name}-{i:x}-{e}"), "namespace": ns},
            })
        })
        .collect();
    let mut meta = metadata(ns, &format!("{name}-{i:05x}"), i, k + 1);
    meta["labels"] = json!({
        "kubernetes.io/service-name": name,
        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
    });
    let slice_ports: Vec<Value> = ports
        .iter()
        .rev()
        .map(|(n, p)| json!({"name": n, "port": p, "protocol": "TCP"}))
        .collect();
    out.push(object(
        "discovery.k8s.io/v1",
        "EndpointSlice",
        meta,
        json!({"addressType": "IPv4", "endpoints": endpoints, "ports": slice_ports}),
    ));
}

/// The objects gardenlet writes for shoot number `i`.
fn shoot(i: usize) -> Vec<Value> {
    let Shape { zonal, l7, ha } = shape(i);
    let project = PROJECTS[i % PROJECTS.len()];
    let name = format!("{}-{i}", NAMES[(i / PROJECTS.len()) % NAMES.len()]);
    let ns = format!("shoot--{project}--{name}");
    let ns = ns.as_str();
    let hosts = [
        format!("api.{name}.{project}.internal.seed.example.com"),
        format!("api.{name}.{project}.example.com"),
        format!("api-{name}--{project}.ingress.seed.example.com"),
    ];
    let istio = if zonal {
        format!("ingressgateway--zone--{}", ZONES[i % 3])
    } else {
        "ingressgateway".to_owned()
    };
    let mut out = Vec::with_capacity(9);
    let mut meta = metadata("", ns, i, 0);
    meta["labels"] = json!({"gardener.cloud/role": "shoot"});
    out.push(object(
        "v1",
        "Namespace",
        meta,
        json!({"status": {"phase": "Active"}}),
    ));
    let server = if l7 {
        json!({"hosts": hosts, "port": {"name": "tls", "number": 443, "protocol": "HTTPS"},
               "tls": {"mode": "OPTIONAL_MUTUAL", "credentialName": format!("{ns}-kube-apiserver-tls")}})
    } else {
        json!({"hosts": hosts, "port": {"name": "tls", "number": 443, "protocol": "TLS"},
               "tls": {"mode": "PASSTHROUGH"}})
    };
    out.push(object(
        "networking.istio.io/v1",
        "Gateway",
        metadata(ns, "kube-apiserver", i, 1),
        json!({"spec": {
            "selector": {"app": "istio-ingressgateway", "istio": istio, "istio-role": "seed"},
            "servers": [server],
        }}),
    ));
    let api_server = format!("kube-apiserver.{ns}.svc.cluster.local");
    let routes = if l7 {
        json!({"http": [
            {"route": [{"destination": {
                "host": format!("kube-apiserver-connection-upgrade.{ns}.svc.cluster.local"),
                "port": {"number": 443}}}]},
            {"route": [{"destination": {"host": api_server, "port": {"number": 443}}}]},
        ]})
    } else {
        json!({"tls": [{
            "match": [{"port": 443, "sniHosts": hosts}],
            "route": [{"destination": {"host": api_server, "port": {"number": 443}}}],
        }]})
    };
    let mut vs =
        json!({"exportTo": ["istio-ingress"], "gateways": ["kube-apiserver"], "hosts": hosts});
    for (k, v) in routes.as_object().unwrap() {
        vs[k] = v.clone();
    }
    out.push(object(
        "networking.istio.io/v1",
        "VirtualService",
        metadata(ns, "kube-apiserver", i, 2),
        json!({"spec": vs}),
    ));
    out.push(object(
        "networking.istio.io/v1",
        "DestinationRule",
        metadata(ns, "kube-apiserver", i, 3),
        json!({"spec": {
            "exportTo": ["istio-ingress"],
            "host": api_server,
            "trafficPolicy": {
                "connectionPool": {"tcp": {
                    "maxConnectionDuration": "86400s",
                    "tcpKeepalive": {"interval": "75s", "time": "7200s"},
                }},
                "loadBalancer": {"localityLbSetting": {
                    "enabled": true,
                    "failoverPriority": ["topology.kubernetes.io/zone"],
                }},
                "outlierDetection": {"minHealthPercent": 0},
                "tls": {"mode": "DISABLE"},
            },
        }}),
    ));
    let ip = |net: usize| format!("10.{}.{}.{}", net * 8 + (i >> 16), (i >> 8) & 255, i & 255);
    service(
        &mut out,
        (ns, "kube-apiserver", i, 4),
        ip(1),
        &[("kube-apiserver", 443)],
    );
    let vpn_ports = [
        ("vpn-seed-server", 1194),
        ("http-proxy", 9443),
        ("metrics", 15000),
    ];
    if ha {
        for n in 0..2 {
            let name = format!("vpn-seed-server-{n}");
            service(&mut out, (ns, &name, i, 6 + 2 * n), ip(2 + n), &vpn_ports);
        }
    } else {
        service(&mut out, (ns, "vpn-seed-server", i, 6), ip(2), &vpn_ports);
    }
    if l7 {
        out.push(object(
            "networking.istio.io/v1alpha3",
            "EnvoyFilter",
            metadata(
                "istio-ingress",
                &format!("{ns}-istio-tls-termination"),
                i,
                10,
            ),
            json!({"spec": {"configPatches": []}}),
        ));
    }
    out
}

/// The projections of `n` shoots' objects, as the controller's stores will hold them.
fn snapshot(n: usize) -> Snapshot {
    let mut s = Snapshot::default();
    for i in 0..n {
        for doc in shoot(i) {
            manifest::add(&mut s, &doc);
        }
    }
    s
}

/// The gateway the tables are rendered for: the seed's default ingress gateway, with a
/// fallback.
fn config() -> ControllerConfig {
    ControllerConfig {
        fallback: Some(BackendAddress::parse(FALLBACK).unwrap()),
        ..ControllerConfig::default()
    }
}

/// Routes and L7 skips expected for `n` shoots: every default-gateway passthrough shoot
/// gets its API server route and one VPN route per VPN Service, plus the fallback.
fn expected(n: usize) -> (usize, usize) {
    let (mut routes, mut l7) = (1, 0);
    for i in 0..n {
        let s = shape(i);
        if s.l7 {
            l7 += 1;
        } else if !s.zonal {
            routes += if s.ha { 3 } else { 2 };
        }
    }
    (routes, l7)
}

fn check(snapshot: &Snapshot, target: &Target, n: usize) {
    let trellis::controller::Rendered { table, report, .. } = translate(snapshot, target);
    let (routes, l7) = expected(n);
    assert_eq!(table.routes.len(), routes, "{:?}", report.skipped);
    assert_eq!(
        report.skipped,
        std::collections::BTreeMap::from([(Reason::L7, l7)]),
        "{:?}",
        &report.skips[..report.skips.len().min(5)]
    );
}

fn median(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    times.sort();
    times[runs / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap()
}

/// In a fresh process: resident memory before and after building the snapshot of `n`
/// shoots, and after rendering its table and JSON (kept alive beside it), in KiB.
fn memory_child(n: usize) {
    let before = status_kib("VmRSS:");
    let s = snapshot(n);
    let with_snapshot = status_kib("VmRSS:");
    let target = Target::from_config(&config());
    let table = translate(&s, &target).table;
    let json = to_json(&table);
    let with_table = status_kib("VmRSS:");
    black_box((&s, &table, &json));
    println!(
        "{before} {with_snapshot} {with_table} {} {}",
        status_kib("VmHWM:"),
        json.len()
    );
}

fn render_benches(c: &mut Criterion) {
    let target = Target::from_config(&config());
    let mut g = c.benchmark_group("controller_render");
    for (n, _) in SIZES {
        let s = snapshot(n);
        check(&s, &target, n);
        g.bench_function(format!("translate_{n}_shoots"), |b| {
            b.iter(|| translate(black_box(&s), &target))
        });
    }
    let s = snapshot(LARGE);
    let table = translate(&s, &target).table;
    g.bench_function(format!("to_json_{LARGE}_shoots"), |b| {
        b.iter(|| to_json(black_box(&table)))
    });
    g.finish();
}

fn summary() {
    let target = Target::from_config(&config());
    println!("\ncontroller render (medians of 51 runs; targets from the controller's design)");
    for (n, goal) in SIZES {
        let s = snapshot(n);
        let objects: usize = s.counts().iter().map(|(_, c)| c).sum();
        let t = median(51, || {
            black_box(translate(black_box(&s), &target));
        });
        println!(
            "  translate, {n} shoots ({objects} objects): {} (target {}: {:.2}x)",
            ms(t),
            ms(goal),
            t.as_secs_f64() / goal.as_secs_f64()
        );
    }
    let s = snapshot(LARGE);
    let table = translate(&s, &target).table;
    let json = to_json(&table);
    let t = median(51, || {
        black_box(to_json(black_box(&table)));
    });
    println!(
        "  to_json, {LARGE} shoots ({} routes, {} KiB): {}",
        table.routes.len(),
        json.len() / 1024,
        ms(t)
    );

    let out = Command::new(std::env::current_exe().unwrap())
        .env(MEMORY_CHILD, LARGE.to_string())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let kib: Vec<u64> = String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    let [before, with_snapshot, with_table, peak, _] = kib[..] else {
        panic!("{kib:?}")
    };
    let mib = |k: u64| k as f64 / 1024.0;
    println!(
        "  memory, {LARGE} shoots (fresh process, VmRSS): {:.1} MiB before, {:.1} MiB with the snapshot (+{:.1} MiB), {:.1} MiB with table and JSON too (peak {:.1} MiB); target {RSS_TARGET_MIB} MiB: {:.2}x",
        mib(before),
        mib(with_snapshot),
        mib(with_snapshot - before),
        mib(with_table),
        mib(peak),
        mib(with_table) / RSS_TARGET_MIB
    );

    // Offline: the same seed as YAML files, one per shoot, through `render`; kept in
    // $TRELLIS_BENCH_CONTROLLER_MANIFESTS when set (to run `trellis controller render` on).
    let keep = std::env::var_os(MANIFESTS_DIR).map(std::path::PathBuf::from);
    let dir = keep.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("trellis-bench-controller-{}", std::process::id()))
    });
    std::fs::create_dir_all(&dir).unwrap();
    let mut bytes = 0;
    for i in 0..LARGE {
        let yaml = serde_saphyr::to_string_multiple(&shoot(i)).unwrap();
        bytes += yaml.len();
        std::fs::write(dir.join(format!("shoot-{i:05}.yaml")), yaml).unwrap();
    }
    let start = Instant::now();
    let rendered = trellis::controller::render(&dir, &config());
    let t = start.elapsed();
    if keep.is_none() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
    let rendered = to_json(&rendered.unwrap().table);
    assert_eq!(rendered, json, "the YAML seed renders the same table");
    println!(
        "  render from YAML (manifest reader, translate, JSON), {LARGE} shoots in {LARGE} files ({} MiB): {} (once)",
        bytes / (1024 * 1024),
        ms(t)
    );
}

fn main() {
    if let Ok(n) = std::env::var(MEMORY_CHILD) {
        memory_child(n.parse().unwrap());
        return;
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    render_benches(&mut c);
    c.final_summary();
    // `--profile-time N` (criterion's mode for profilers) runs the benches alone.
    if !args.iter().any(|a| a == "--profile-time") {
        summary();
    }
}
