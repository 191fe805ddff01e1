//! The controller's whole path, measured on loopback with the release binary: the fake
//! Kubernetes API server (`tests/fakekube/`), the real `trellis controller` writing its
//! table into a directory, a real `trellis gateway` whose `routes.file` is that table.
//!
//! `cargo bench --bench controller_e2e` prints
//! - **change → served**: with 500 shoots in the seed, one shoot's EndpointSlice is moved
//!   between two API server pods (TLS backends on 127.0.0.x) [`CHANGES`] times; each time,
//!   from the write in the API server until a TLS client with the shoot's server name
//!   completes a verified handshake with the new pod: p50, p99 and max, against the target
//!   (p99 ≤ 1 s);
//! - **tunnel key → served**: with 500 shoots that each have a tunnel (their `Cluster` and
//!   tunnel peers Secret besides the 5 objects), one shoot's agent key is changed in its
//!   peers Secret [`KEY_CHANGES`] times; each time, from the write in the API server until the
//!   gateway's `/routes` shows the new key (the table applied, the peer replaced): p50, p99
//!   and max, against the target (p99 ≤ 1 s);
//! - **cold start**: with 500 shoots' objects in the API server, from the controller's
//!   start to its stores synced (the last kind's `listed` log line) and to its first table
//!   written (`routing table written`), over [`STARTS`] starts, against the target (first
//!   table ≤ 5 s after synced).
//!
//! A shoot here is what `tests/e2e/` writes: Namespace, Gateway, VirtualService, Service
//! `kube-apiserver` and its EndpointSlice (5 objects, one route).
// A bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/e2e/mod.rs"]
mod e2e;
#[path = "../tests/fakekube/mod.rs"]
mod fakekube;

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use e2e::{Controller, NamedBackend};
use fakekube::FakeKube;

/// Shoots in the seed.
const SHOOTS: usize = 500;
/// Changes measured from the API to a served route.
const CHANGES: usize = 120;
/// Tunnel key changes measured.
const KEY_CHANGES: usize = 60;
/// Cold starts measured.
const STARTS: usize = 5;
/// Targets (the figures).
const CHANGE_P99_TARGET: Duration = Duration::from_secs(1);
const FIRST_TABLE_TARGET: Duration = Duration::from_secs(5);

/// The seed's shoots; their API servers are addresses nothing listens on (only the
/// measured shoot is connected to).
fn seed(kube: &FakeKube) {
    for i in 0..SHOOTS {
        let backend = SocketAddr::from(([127, 1, (i >> 8) as u8, i as u8], 9));
        e2e::put_all(kube, e2e::shoot(&format!("seed-{i}"), backend));
    }
}

/// A key for seed shoot `i`, unique in the table.
fn seed_key(i: usize) -> String {
    let mut key = [0x5e_u8; 32];
    key[0] = i as u8;
    key[1] = (i >> 8) as u8;
    trellis::route::WgKey(key).to_base64()
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

async fn change_to_served() {
    let names = e2e::test_names(&["measured"]);
    let fallback = NamedBackend::start("fallback", [127, 0, 0, 1], &names).await;
    let pods = [
        NamedBackend::start("pod-a", [127, 0, 0, 2], &names).await,
        NamedBackend::start("pod-b", [127, 0, 0, 3], &names).await,
    ];
    let client = e2e::client(&[&fallback, &pods[0], &pods[1]]);
    let kube = FakeKube::start().await;
    seed(&kube);
    e2e::put_all(&kube, e2e::shoot("measured", pods[0].addr));
    let c = Controller::start(&kube, fallback.addr);
    c.wait_table("the seed", Duration::from_secs(60), |t| {
        e2e::route_names(t).len() == SHOOTS + 2
    });
    let gw = e2e::gateway_for(&c, "");
    let host = e2e::host("measured");
    e2e::wait_served(&client, gw.tls, &host, "pod-a", Duration::from_secs(10)).await;
    let controller_seconds = || {
        let m = c.get("/metrics").map(|m| m.1).unwrap_or_default();
        (
            common::metric_in(&m, "trellis_controller_change_to_write_seconds_sum"),
            common::metric_in(&m, "trellis_controller_change_to_write_seconds_count"),
        )
    };
    let before = controller_seconds();
    let mut times = Vec::with_capacity(CHANGES);
    for n in 1..=CHANGES {
        let pod = &pods[n % 2];
        let start = Instant::now();
        kube.put(e2e::endpoint_slice("measured", pod.addr));
        // Polls as fast as TLS handshakes go; the limit is a deadline, not the target.
        e2e::wait_served(&client, gw.tls, &host, &pod.name, Duration::from_secs(30)).await;
        times.push(start.elapsed());
    }
    times.sort();
    let (p50, p99, max) = (
        percentile(&times, 0.5),
        percentile(&times, 0.99),
        times[times.len() - 1],
    );
    println!(
        "\ncontroller end to end, {SHOOTS} shoots: an EndpointSlice change in the API → a TLS \
         client reaches the new pod through the gateway ({CHANGES} changes)"
    );
    println!(
        "  p50 {}, p99 {}, max {}, min {}; target p99 ≤ {}: {:.2}x",
        ms(p50),
        ms(p99),
        ms(max),
        ms(times[0]),
        ms(CHANGE_P99_TARGET),
        p99.as_secs_f64() / CHANGE_P99_TARGET.as_secs_f64()
    );
    let after = controller_seconds();
    let (sum, count) = (after.0 - before.0, after.1 - before.1);
    println!(
        "  of which the controller (first change to table written, mean of its histogram over \
         {count} writes): {}",
        ms(Duration::from_secs_f64(sum / count.max(1.0)))
    );
}

async fn tunnel_key_to_served() {
    let kube = FakeKube::start().await;
    for i in 0..SHOOTS {
        let name = format!("seed-{i}");
        let backend = SocketAddr::from(([127, 1, (i >> 8) as u8, i as u8], 9));
        e2e::put_all(&kube, e2e::shoot(&name, backend));
        kube.put(e2e::cluster(&name));
        kube.put(e2e::peers_secret(&name, &seed_key(i)));
    }
    let keys = [
        trellis::route::WgKey([0xf1; 32]).to_base64(),
        trellis::route::WgKey([0xf2; 32]).to_base64(),
    ];
    kube.put(e2e::cluster("measured"));
    kube.put(e2e::peers_secret("measured", &keys[0]));
    let c = Controller::start_tunnels(&kube, SocketAddr::from(([127, 0, 0, 1], 9)));
    c.wait_table("the seed's tunnels", Duration::from_secs(60), |t| {
        e2e::route_names(t).len() == 2 * SHOOTS + 2
    });
    let gw = e2e::gateway_for(&c, "");
    let route = format!("{}.tunnel", e2e::namespace("measured"));
    let served = |key: &str| e2e::served_peer_keys(&gw, &route) == [key.to_owned()];
    common::wait_for(Duration::from_secs(10), || served(&keys[0]).then_some(())).unwrap();
    let mut times = Vec::with_capacity(KEY_CHANGES);
    for n in 1..=KEY_CHANGES {
        let key = &keys[n % 2];
        let start = Instant::now();
        kube.put(e2e::peers_secret("measured", key));
        // Polls `/routes` (the whole table, ~1,000 routes) every 2 ms; the limit is a
        // deadline, not the target.
        while !served(key) {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the new key was not served within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        times.push(start.elapsed());
    }
    times.sort();
    let (p50, p99, max) = (
        percentile(&times, 0.5),
        percentile(&times, 0.99),
        times[times.len() - 1],
    );
    println!(
        "\ncontroller end to end, {SHOOTS} shoots with tunnels: an agent key changed in the \
         API → the gateway's /routes shows it ({KEY_CHANGES} changes)"
    );
    println!(
        "  p50 {}, p99 {}, max {}, min {}; target p99 ≤ {}: {:.2}x",
        ms(p50),
        ms(p99),
        ms(max),
        ms(times[0]),
        ms(CHANGE_P99_TARGET),
        p99.as_secs_f64() / CHANGE_P99_TARGET.as_secs_f64()
    );
}

/// Seconds since the epoch of a log line's `timestamp` (RFC 3339, UTC, `Z`).
fn timestamp(line: &serde_json::Value) -> f64 {
    let t = line["timestamp"].as_str().unwrap();
    let (date, time) = t.trim_end_matches('Z').split_once('T').unwrap();
    let d: Vec<i64> = date.split('-').map(|p| p.parse().unwrap()).collect();
    // Days since the epoch of a civil date (Howard Hinnant's algorithm).
    let (y, m) = if d[1] <= 2 {
        (d[0] - 1, d[1] + 9)
    } else {
        (d[0], d[1] - 3)
    };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + d[2] - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    let hms: Vec<f64> = time.split(':').map(|p| p.parse().unwrap()).collect();
    days as f64 * 86_400.0 + hms[0] * 3_600.0 + hms[1] * 60.0 + hms[2]
}

async fn cold_start() {
    let kube = FakeKube::start().await;
    seed(&kube);
    let fallback = SocketAddr::from(([127, 0, 0, 1], 9));
    let (mut synced, mut first) = (Vec::new(), Vec::new());
    for _ in 0..STARTS {
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let c = Controller::start(&kube, fallback);
        c.wait_table("the seed", Duration::from_secs(60), |t| {
            e2e::route_names(t).len() == SHOOTS + 1
        });
        let listed = c.logged("listed");
        assert_eq!(
            listed.len(),
            trellis::controller::kinds::WATCHED.len(),
            "{}",
            c.logs()
        );
        let last_listed = listed.iter().map(timestamp).fold(f64::MIN, f64::max);
        let written = timestamp(&c.logged("routing table written")[0]);
        synced.push(last_listed - started);
        first.push(written - last_listed);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[v.len() - 1])
    };
    let (synced_p50, synced_max) = median(&mut synced);
    let (first_p50, first_max) = median(&mut first);
    let d = Duration::from_secs_f64;
    println!(
        "\ncontroller cold start, {SHOOTS} shoots ({} objects), {STARTS} starts (median, max)",
        SHOOTS * 5
    );
    println!(
        "  start → stores synced: {}, {}",
        ms(d(synced_p50)),
        ms(d(synced_max))
    );
    println!(
        "  synced → first table written: {}, {}; target ≤ {}: {:.3}x",
        ms(d(first_p50)),
        ms(d(first_max)),
        ms(FIRST_TABLE_TARGET),
        first_max / FIRST_TABLE_TARGET.as_secs_f64()
    );
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument selects by name.
    let filter = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    let wanted = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    if wanted("change_to_served") {
        rt.block_on(change_to_served());
    }
    if wanted("tunnel_key_to_served") {
        rt.block_on(tunnel_key_to_served());
    }
    if wanted("cold_start") {
        rt.block_on(cold_start());
    }
}
