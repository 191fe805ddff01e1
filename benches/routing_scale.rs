//! Routing at seed scale: 10,000 routes.
//!
//! `cargo bench --bench routing_scale` prints
//! - ns per lookup (SNI exact, SNI wildcard, SNI miss, CONNECT destination, PROXY destination),
//! - the time to parse, validate and index a 10,000-route table file, and the time the
//!   gateway takes to apply it on reload (target: under 100 ms),
//! - the gateway's resident memory with that table loaded and no connections (target: under
//!   30 MB).
//!
//! A plain harness (median of repeated timed batches) rather than criterion: the figures are
//! coarse targets, and the project keeps its dependencies few.

use std::hint::black_box;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use trellis::config::routes;
use trellis::route::BackendRegistry;

const ROUTES: usize = 10_000;

fn table_yaml(n: usize, generation: usize) -> String {
    let mut out =
        String::from("apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n");
    for i in 0..n {
        out += &format!(
            "- name: shoot--p{i}--s{i}\n  sni: [api.s{i}.p{i}.internal.example.com, \"*.s{i}.p{i}.example.com\"]\n  destinations: [\"outbound|443||kube-apiserver.shoot--p{i}--s{i}.svc.cluster.local\", \"outbound|1194||vpn-seed-server.shoot--p{i}--s{i}.svc.cluster.local\"]\n  proxyDestinations: [\"240.{}.{}.{}:443\"]\n  backends:\n  - {{address: \"10.{}.{}.{}:443\", zone: eu-1a}}\n  - {{address: \"kube-apiserver.shoot--p{i}--s{i}.svc.cluster.local:443\"}}\n",
            (i >> 16) & 255,
            (i >> 8) & 255,
            i & 255,
            (i >> 16) & 255,
            (i >> 8) & 255,
            (i + generation) & 255,
        );
    }
    out
}

/// Median ns per call of `f` over batches.
fn ns_per_op(mut f: impl FnMut(usize)) -> f64 {
    let batch = 200_000;
    let mut samples = Vec::new();
    for round in 0..7 {
        let start = Instant::now();
        for i in 0..batch {
            f(i + round);
        }
        samples.push(start.elapsed().as_nanos() as f64 / batch as f64);
    }
    samples.sort_by(|a, b| a.total_cmp(b));
    samples[samples.len() / 2]
}

fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

fn metric(admin: &str, name: &str) -> f64 {
    let out = Command::new("curl")
        .args(["-s", &format!("http://{admin}/metrics")])
        .output()
        .map(|o| o.stdout)
        .unwrap_or_default();
    String::from_utf8_lossy(&out)
        .lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if !args.is_empty() && !args.iter().any(|a| "routing_scale".contains(a.as_str())) {
        return;
    }
    let yaml = table_yaml(ROUTES, 0);
    let file = Path::new("routes.yaml");

    // Parse + validate + index, in process, from YAML and from the same table as JSON.
    let json = {
        let v: serde_json::Value = serde_saphyr::from_str(&yaml).unwrap();
        serde_json::to_string(&v).unwrap()
    };
    let time_parse = |bytes: &[u8]| {
        let mut ms = Vec::new();
        let mut loaded = None;
        for _ in 0..5 {
            let registry = BackendRegistry::default();
            let start = Instant::now();
            let t = routes::parse(file, bytes, &registry).expect("valid table");
            ms.push(start.elapsed().as_secs_f64() * 1000.0);
            loaded = Some((t, registry));
        }
        ms.sort_by(|a, b| a.total_cmp(b));
        (ms[ms.len() / 2], loaded.unwrap())
    };
    let (parse_json_ms, _) = time_parse(json.as_bytes());
    let (parse_yaml_ms, (loaded, _registry)) = time_parse(yaml.as_bytes());
    let table = &loaded.table;

    let exact: Vec<String> = (0..ROUTES)
        .map(|i| format!("api.s{i}.p{i}.internal.example.com"))
        .collect();
    let wild: Vec<String> = (0..ROUTES)
        .map(|i| format!("x.y.s{i}.p{i}.example.com"))
        .collect();
    let miss: Vec<String> = (0..ROUTES)
        .map(|i| format!("api.s{i}.p{i}.unknown.example.org"))
        .collect();
    let dest: Vec<String> = (0..ROUTES)
        .map(|i| format!("outbound|443||kube-apiserver.shoot--p{i}--s{i}.svc.cluster.local"))
        .collect();
    let pdst: Vec<std::net::SocketAddr> = (0..ROUTES)
        .map(|i| {
            format!("240.{}.{}.{}:443", (i >> 16) & 255, (i >> 8) & 255, i & 255)
                .parse()
                .unwrap()
        })
        .collect();
    let sni_exact = ns_per_op(|i| assert!(black_box(table.by_sni(&exact[i % ROUTES])).is_some()));
    let sni_wild = ns_per_op(|i| assert!(black_box(table.by_sni(&wild[i % ROUTES])).is_some()));
    let sni_miss = ns_per_op(|i| assert!(black_box(table.by_sni(&miss[i % ROUTES])).is_none()));
    let by_dest =
        ns_per_op(|i| assert!(black_box(table.by_destination(&dest[i % ROUTES])).is_some()));
    let by_pdst =
        ns_per_op(|i| assert!(black_box(table.by_proxy_destination(&pdst[i % ROUTES])).is_some()));

    // The gateway process: memory with the table and no connections, and the reload time.
    let dir = std::env::temp_dir().join(format!("trellis-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("routes.yaml"), &json).unwrap();
    let admin = "127.0.0.1:8479";
    std::fs::write(
        dir.join("gateway.yaml"),
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: GatewayConfiguration\nroutes: {{file: routes.yaml, checkInterval: 1h}}\nlisteners: [{{name: tls, address: \"127.0.0.1:8478\", protocol: sni}}]\nadmin: {{address: \"{admin}\"}}\n"
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args(["gateway", "--config"])
        .arg(dir.join("gateway.yaml"))
        .env("TRELLIS_LOG", "warn")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while metric(admin, "trellis_routing_table_routes") != ROUTES as f64
        && start.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    let rss_mb = rss_kb(child.id()) as f64 / 1024.0;
    // Reload: a changed 10,000-route table, timed from the rename to the new generation.
    let mut reload_ms = Vec::new();
    for g in 1..=5 {
        let v: serde_json::Value = serde_saphyr::from_str(&table_yaml(ROUTES, g)).unwrap();
        std::fs::write(dir.join(".tmp"), serde_json::to_string(&v).unwrap()).unwrap();
        let t0 = Instant::now();
        std::fs::rename(dir.join(".tmp"), dir.join("routes.yaml")).unwrap();
        while metric(admin, "trellis_routing_table_generation") < (g + 1) as f64
            && t0.elapsed() < Duration::from_secs(30)
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        reload_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
    }
    reload_ms.sort_by(|a, b| a.total_cmp(b));
    let rss_after_reloads = rss_kb(child.id()) as f64 / 1024.0;
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);

    println!(
        "\nrouting at scale: {ROUTES} routes (2 SNI names, 2 destinations, 1 PROXY destination, 2 backends each; {} KiB of YAML)",
        yaml.len() / 1024
    );
    println!(
        "{:52}{:>12}",
        "lookup: SNI exact (ns)",
        format!("{sni_exact:.0}")
    );
    println!(
        "{:52}{:>12}",
        "lookup: SNI wildcard, 2 labels deep (ns)",
        format!("{sni_wild:.0}")
    );
    println!(
        "{:52}{:>12}",
        "lookup: SNI miss (ns)",
        format!("{sni_miss:.0}")
    );
    println!(
        "{:52}{:>12}",
        "lookup: CONNECT destination (ns)",
        format!("{by_dest:.0}")
    );
    println!(
        "{:52}{:>12}",
        "lookup: PROXY destination (ns)",
        format!("{by_pdst:.0}")
    );
    println!(
        "{:52}{:>12}",
        "parse + validate + index, YAML (ms, median)",
        format!("{parse_yaml_ms:.1}")
    );
    println!(
        "{:52}{:>12}",
        "parse + validate + index, JSON (ms, median)",
        format!("{parse_json_ms:.1}")
    );
    println!(
        "{:52}{:>12}",
        "gateway reload of a JSON table: rename to new generation (ms)",
        format!("{:.1}", reload_ms[reload_ms.len() / 2])
    );
    println!(
        "{:52}{:>12}",
        "gateway RSS, table loaded, no connections (MB)",
        format!("{rss_mb:.1}")
    );
    println!(
        "{:52}{:>12}",
        "gateway RSS after 5 reloads (MB)",
        format!("{rss_after_reloads:.1}")
    );
    println!("targets: reload under 100 ms, RSS under 30 MB");
}
