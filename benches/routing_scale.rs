//! The gateway process with a seed-sized routing table (10,000 routes):
//!
//! `cargo bench --bench routing_scale` prints
//! - the gateway's resident memory with that table loaded and no connections (target: under
//!   30 MB), and after 10 reloads of changed tables;
//! - the reload cost the gateway itself logs (`apply_ms`: read, hash, parse, validate, index
//!   and swap; target: under 100 ms) for a JSON table (what a controller writes) and a YAML
//!   one (what an operator writes), and the wall time from the file's rename to the new
//!   generation in `/metrics` (that adds the 50 ms watch debounce and this runner's polling).
//!
//! Lookups and in-process parsing are criterion benches: `cargo bench --bench routing`.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    unreachable_pub,
    reason = "a test or bench fails loudly on what it did not expect; its helpers are its own"
)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{ROUTES, table_json, table_yaml};

/// Reloads per format.
const RELOADS: usize = 5;

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
    let dir = std::env::temp_dir().join(format!("trellis-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = table_json(ROUTES, 0);
    std::fs::write(dir.join("routes.yaml"), &json).unwrap();
    let admin = "127.0.0.1:8479";
    std::fs::write(
        dir.join("gateway.yaml"),
        format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: GatewayConfiguration\nroutes: {{file: routes.yaml, checkInterval: 1h}}\nlisteners: [{{name: tls, address: \"127.0.0.1:8478\", protocol: sni}}]\nadmin: {{address: \"{admin}\"}}\n"
        ),
    )
    .unwrap();
    // Outside the watched directory: a log line there would itself trigger re-reads.
    let log = std::env::temp_dir().join(format!("trellis-scale-{}.log", std::process::id()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_trellis"))
        .args(["--log-format", "json", "gateway", "--config"])
        .arg(dir.join("gateway.yaml"))
        .env("TRELLIS_LOG", "info")
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
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
    // Reload: a changed 10,000-route table, timed from the rename to the new generation;
    // 5 times in JSON, then 5 times in YAML.
    let mut wall_ms = Vec::new();
    for g in 1..=2 * RELOADS {
        let table = if g <= RELOADS {
            table_json(ROUTES, g)
        } else {
            table_yaml(ROUTES, g)
        };
        std::fs::write(dir.join(".tmp"), table).unwrap();
        let t0 = Instant::now();
        std::fs::rename(dir.join(".tmp"), dir.join("routes.yaml")).unwrap();
        while metric(admin, "trellis_routing_table_generation") < (g + 1) as f64
            && t0.elapsed() < Duration::from_secs(30)
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        wall_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
    }
    std::thread::sleep(Duration::from_millis(300));
    let rss_after_reloads = rss_kb(child.id()) as f64 / 1024.0;
    let _ = child.kill();
    let _ = child.wait();
    // By generation: 1 is the initial load, then the JSON reloads, then the YAML ones.
    let (mut json_ms, mut yaml_ms) = (Vec::new(), Vec::new());
    for line in std::fs::read_to_string(&log).unwrap_or_default().lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let (Some(g), Some(ms)) = (v["generation"].as_u64(), v["apply_ms"].as_f64()) else {
            continue;
        };
        match g as usize {
            g if (2..=RELOADS + 1).contains(&g) => json_ms.push(ms),
            g if g > RELOADS + 1 => yaml_ms.push(ms),
            _ => {}
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&log);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };

    println!(
        "\ngateway with {ROUTES} routes (2 SNI names, 2 destinations, 1 PROXY destination, 2 backends each; {} KiB of JSON)",
        json.len() / 1024
    );
    let row = |name: &str, v: f64| println!("{name:64}{v:>10.1}");
    row(
        "reload, JSON: read + parse + validate + index + swap (ms, median)",
        median(&mut json_ms),
    );
    row(
        "reload, YAML: read + parse + validate + index + swap (ms, median)",
        median(&mut yaml_ms),
    );
    row(
        "reload: rename to new generation in /metrics (ms, median of 10)",
        median(&mut wall_ms),
    );
    row("RSS, table loaded, no connections (MB)", rss_mb);
    row("RSS after 10 reloads (MB)", rss_after_reloads);
    println!("targets: apply under 100 ms, RSS under 30 MB");
}
