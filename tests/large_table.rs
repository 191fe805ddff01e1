//! A gateway holding a 100,000-route table, with the real binary on loopback: `/ready`
//! answers within a second while clients keep `/routes` rendering the whole table, and
//! resident memory returns once the huge table is replaced by a small one.
// A test fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;

/// Routes in the huge table.
const ROUTES: usize = 100_000;
/// How long a probe may take (kubelet's default `timeoutSeconds`).
const PROBE_LIMIT: Duration = Duration::from_secs(1);

/// A table of `n` routes `r<i>` for `r<i>.example.com`, each with one backend, in JSON
/// (the gateway reads it as it reads YAML; a debug build parses JSON ten times faster).
fn table(n: usize) -> String {
    let routes: Vec<_> = (0..n)
        .map(|i| {
            serde_json::json!({
                "name": format!("r{i}"),
                "sni": [format!("r{i}.example.com")],
                "backends": [{"address": format!("10.{}.{}.{}:443", (i >> 16) & 255, (i >> 8) & 255, i & 255)}],
            })
        })
        .collect();
    serde_json::json!({
        "apiVersion": "trellis.gardener.cloud/v1alpha1",
        "kind": "RoutingTable",
        "routes": routes,
    })
    .to_string()
}

/// `GET path` on `addr` with the whole answer read; the answer's length, or why none came.
fn get_all(addr: SocketAddr, path: &str, limit: Duration) -> Result<(u16, Vec<u8>), String> {
    let start = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, limit).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(limit)).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").map_err(|e| format!("write: {e}"))?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)
        .map_err(|e| format!("read after {:?}: {e}", start.elapsed()))?;
    let status = std::str::from_utf8(&out[..out.len().min(16)])
        .ok()
        .and_then(|h| h.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer after {:?}", start.elapsed()))?;
    Ok((status, out))
}

#[test]
fn ready_answers_within_a_second_while_routes_renders_a_100000_route_table() {
    let gw = Gateway::start(&table(ROUTES), "");
    let stop = Arc::new(AtomicBool::new(false));
    let rendered = Arc::new(AtomicUsize::new(0));
    // Six clients keep asking for the whole table, more than may render at once.
    let clients: Vec<_> = (0..6)
        .map(|_| {
            let (stop, rendered, debug) = (stop.clone(), rendered.clone(), gw.debug);
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    if let Ok((200, body)) = get_all(debug, "/routes", Duration::from_secs(60)) {
                        // The last route is in it: the whole table was rendered.
                        let tail = &body[body.len().saturating_sub(4096)..];
                        if String::from_utf8_lossy(tail)
                            .contains(&format!("r{}.example.com", ROUTES - 1))
                        {
                            rendered.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            })
        })
        .collect();
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut probes = 0;
    // Probes for 10 s once the first render has started, and until two have finished.
    while started.elapsed() < Duration::from_secs(10)
        || (rendered.load(Ordering::SeqCst) < 2 && started.elapsed() < Duration::from_secs(120))
    {
        let t = Instant::now();
        match get_all(gw.admin, "/ready", PROBE_LIMIT) {
            Ok((200, _)) if t.elapsed() <= PROBE_LIMIT => slowest = slowest.max(t.elapsed()),
            Ok((status, _)) => panic!(
                "probe {probes}: /ready answered {status} after {:?}",
                t.elapsed()
            ),
            Err(e) => panic!("probe {probes}: /ready: {e}"),
        }
        probes += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.join().unwrap();
    }
    let rendered = rendered.load(Ordering::SeqCst);
    // Without finished renders the probes proved nothing.
    assert!(
        rendered >= 2,
        "only {rendered} whole tables were served from /routes"
    );
    eprintln!(
        "{probes} probes, slowest {slowest:?}, {rendered} renders of {ROUTES} routes in {:?}",
        started.elapsed()
    );
}

#[test]
fn memory_returns_after_a_huge_table_is_replaced_by_a_small_one() {
    let small = table(1);
    let gw = Gateway::start(&small, "");
    // Settled: the first scrape has run.
    std::thread::sleep(Duration::from_secs(1));
    let fresh = rss_kib(gw.pid());

    gw.write_routes(&table(ROUTES));
    gw.wait_metric("trellis_routing_table_routes ", |n| n == ROUTES as f64);
    // Served once: the render's memory counts too.
    let (status, body) = get_all(gw.debug, "/routes", Duration::from_secs(60)).unwrap();
    assert_eq!(status, 200);
    drop(body);
    let during = rss_kib(gw.pid());
    // The table must have cost memory, or the check below proves nothing.
    assert!(
        during >= fresh + 50 * 1024,
        "a {ROUTES}-route table should cost at least 50 MiB: fresh {fresh} KiB, with it {during} KiB"
    );

    gw.write_routes(&small);
    gw.wait_metric("trellis_routing_table_routes ", |n| n == 1.0);
    let limit = fresh + fresh / 4;
    let settled = wait_for(Duration::from_secs(30), || {
        let now = rss_kib(gw.pid());
        (now <= limit).then_some(now)
    });
    let after = rss_kib(gw.pid());
    assert!(
        settled.is_some(),
        "resident memory 30 s after the huge table was replaced: {after} KiB; fresh {fresh} KiB, \
         with the huge table {during} KiB; expected at most {limit} KiB"
    );
    eprintln!(
        "resident memory: fresh {fresh} KiB, with {ROUTES} routes {during} KiB, after {after} KiB"
    );
}
