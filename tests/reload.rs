//! Routing table reloads under traffic: established connections keep their snapshot, new
//! connections follow the new table, invalid tables are rejected and counted. Covers the
//! directory watch (plain rename and ConfigMap-style symlink swap), SIGHUP, and the periodic
//! re-read.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const APPLIED: &str = "trellis_routing_table_reloads_total{result=\"applied\"}";
const REJECTED: &str = "trellis_routing_table_reloads_total{result=\"rejected\"}";

fn hello(sni: &str) -> Vec<u8> {
    trellis::wire::tls::testing::client_hello(Some(sni), &[], 0)
}

/// Streams a deterministic byte pattern through an echo route and checks every byte that
/// comes back, until `stop`; returns the number of bytes verified.
async fn stream_through(gateway: SocketAddr, sni: &str, stop: Arc<AtomicBool>) -> u64 {
    let mut s = TcpStream::connect(gateway).await.unwrap();
    let h = hello(sni);
    s.write_all(&h).await.unwrap();
    let mut echoed = vec![0u8; h.len()];
    s.read_exact(&mut echoed).await.unwrap();
    assert_eq!(echoed, h);
    let (mut r, mut w) = s.into_split();
    let writer = tokio::spawn(async move {
        let mut sent = 0u64;
        let mut chunk = vec![0u8; 16 * 1024];
        while !stop.load(Ordering::SeqCst) {
            for (i, b) in chunk.iter_mut().enumerate() {
                *b = ((sent + i as u64) % 251) as u8;
            }
            w.write_all(&chunk)
                .await
                .expect("stream broken while writing");
            sent += chunk.len() as u64;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        w.shutdown().await.unwrap();
        sent
    });
    let mut got = 0u64;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), r.read(&mut buf))
            .await
            .expect("stream stalled")
            .expect("stream broken");
        if n == 0 {
            break;
        }
        for &b in &buf[..n] {
            assert_eq!(b, (got % 251) as u8, "corrupted byte at offset {got}");
            got += 1;
        }
    }
    let sent = writer.await.unwrap();
    assert_eq!(got, sent, "every byte sent came back");
    got
}

async fn answer(gateway: SocketAddr, sni: &str) -> Vec<u8> {
    let mut s = TcpStream::connect(gateway).await.unwrap();
    s.write_all(&hello(sni)).await.unwrap();
    read_all(&mut s, Duration::from_secs(10)).await.unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn streams_survive_route_change_removal_and_invalid_table() {
    let echo1 = echo_backend().await;
    let echo2 = RawBackend::start(b"echo2", 0).await;
    let x = RawBackend::start(b"X", 0).await;
    let y = RawBackend::start(b"Y", 0).await;
    let gw = Gateway::start(
        &routes_yaml(&[
            R {
                name: "stream",
                sni: &["stream.example.com"],
                backends: &[echo1],
            },
            R {
                name: "other",
                sni: &["other.example.com"],
                backends: &[x.addr],
            },
        ]),
        "",
    );
    let stop = Arc::new(AtomicBool::new(false));
    let streaming = tokio::spawn(stream_through(gw.tls, "stream.example.com", stop.clone()));
    gw.wait_metric(
        "trellis_route_bytes_total{route=\"stream\",direction=\"tx\"}",
        |v| v > 100_000.0,
    );
    assert_eq!(answer(gw.tls, "other.example.com").await, b"X");

    // 1. Routes changed: both routes point elsewhere now.
    gw.write_routes(&routes_yaml(&[
        R {
            name: "stream",
            sni: &["stream.example.com"],
            backends: &[echo2.addr],
        },
        R {
            name: "other",
            sni: &["other.example.com"],
            backends: &[y.addr],
        },
    ]));
    gw.wait_metric(APPLIED, |v| v == 2.0);
    assert_eq!(answer(gw.tls, "other.example.com").await, b"Y");
    assert_eq!(answer(gw.tls, "stream.example.com").await, b"echo2");

    // 2. The streaming route is removed: new connections get no route.
    gw.write_routes(&routes_yaml(&[R {
        name: "other",
        sni: &["other.example.com"],
        backends: &[y.addr],
    }]));
    gw.wait_metric(APPLIED, |v| v == 3.0);
    assert_eq!(
        answer(gw.tls, "stream.example.com").await,
        [21, 3, 1, 0, 2, 2, 112]
    );

    // 3. An invalid table is rejected; the last good one stays.
    gw.write_routes("apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n- name: broken\n  backends: [{address: nowhere}]\n");
    gw.wait_metric(REJECTED, |v| v >= 1.0);
    assert_eq!(gw.metric("trellis_routing_table_generation"), 3.0);
    assert_eq!(answer(gw.tls, "other.example.com").await, b"Y");
    let logs = gw.logs();
    assert!(
        logs.contains("routes[0].backends[0].address"),
        "rejection names the field:\n{logs}"
    );

    // The stream carried on through all of it, every byte intact.
    let before = gw.metric("trellis_route_bytes_total{route=\"stream\",direction=\"tx\"}");
    gw.wait_metric(
        "trellis_route_bytes_total{route=\"stream\",direction=\"tx\"}",
        |v| v > before + 100_000.0,
    );
    stop.store(true, Ordering::SeqCst);
    let verified = streaming.await.unwrap();
    assert!(verified > 200_000, "verified {verified} bytes");
    let (status, body) = http_get(gw.debug, "/routes").unwrap();
    assert_eq!(status, 200);
    assert!(
        body.contains("\"generation\": 3")
            && body.contains("\"name\": \"other\"")
            && body.contains("\"backends\""),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn configmap_symlink_swap_is_watched() {
    let a = RawBackend::start(b"A", 0).await;
    let b = RawBackend::start(b"B", 0).await;
    let c = RawBackend::start(b"C", 0).await;
    let table = |addr| {
        routes_yaml(&[R {
            name: "r",
            sni: &["r.example.com"],
            backends: &[addr],
        }])
    };
    let gw = Gateway::start(&table(a.addr), "");
    assert_eq!(answer(gw.tls, "r.example.com").await, b"A");

    // Kubelet's ConfigMap layout: routes.yaml -> ..data/routes.yaml, ..data -> ..v1.
    let d = &gw.dir;
    std::fs::create_dir(d.path("..v1")).unwrap();
    std::fs::write(d.path("..v1/routes.yaml"), table(b.addr)).unwrap();
    std::os::unix::fs::symlink("..v1", d.path("..data_tmp")).unwrap();
    std::fs::rename(d.path("..data_tmp"), d.path("..data")).unwrap();
    std::os::unix::fs::symlink("..data/routes.yaml", d.path("routes.yaml.new")).unwrap();
    std::fs::rename(d.path("routes.yaml.new"), d.path("routes.yaml")).unwrap();
    gw.wait_metric(APPLIED, |v| v == 2.0);
    assert_eq!(answer(gw.tls, "r.example.com").await, b"B");

    // Swap ..data to a new version, as kubelet does on a ConfigMap update.
    std::fs::create_dir(d.path("..v2")).unwrap();
    std::fs::write(d.path("..v2/routes.yaml"), table(c.addr)).unwrap();
    std::os::unix::fs::symlink("..v2", d.path("..data_tmp")).unwrap();
    std::fs::rename(d.path("..data_tmp"), d.path("..data")).unwrap();
    gw.wait_metric(APPLIED, |v| v == 3.0);
    assert_eq!(answer(gw.tls, "r.example.com").await, b"C");
}

#[tokio::test(flavor = "multi_thread")]
async fn sighup_and_timer_pick_up_changes_the_watch_cannot_see() {
    let a = RawBackend::start(b"A", 0).await;
    let b = RawBackend::start(b"B", 0).await;
    let c = RawBackend::start(b"C", 0).await;
    let table = |addr| {
        routes_yaml(&[R {
            name: "r",
            sni: &["r.example.com"],
            backends: &[addr],
        }])
    };
    // The routing file lives in another directory behind a symlink, so writes to it raise no
    // event in the watched directory.
    let hidden = TestDir::new("hidden");
    std::fs::write(hidden.path("routes.yaml"), table(a.addr)).unwrap();
    let gw = Gateway::start(&table(a.addr), "");
    std::os::unix::fs::symlink(hidden.path("routes.yaml"), gw.dir.path("routes.yaml.new")).unwrap();
    std::fs::rename(gw.dir.path("routes.yaml.new"), gw.dir.path("routes.yaml")).unwrap();
    // Same content: the symlink swap is seen and found unchanged.
    gw.wait_metric(
        "trellis_routing_table_reloads_total{result=\"unchanged\"}",
        |v| v >= 1.0,
    );

    std::fs::write(hidden.path("routes.yaml"), table(b.addr)).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(gw.metric(APPLIED), 1.0, "the watch cannot see this write");
    gw.signal("HUP");
    gw.wait_metric(APPLIED, |v| v == 2.0);
    assert_eq!(answer(gw.tls, "r.example.com").await, b"B");
    drop(gw);

    // With a short check interval the timer finds the change by itself.
    // Again behind a symlink from another directory, so only the timer can notice.
    std::fs::write(hidden.path("routes.yaml"), table(a.addr)).unwrap();
    let links = TestDir::new("links");
    std::os::unix::fs::symlink(hidden.path("routes.yaml"), links.path("routes.yaml")).unwrap();
    let source = format!(
        "routes: {{file: \"{}\", checkInterval: 300ms}}",
        links.path("routes.yaml").display()
    );
    let gw = Gateway::start_opts("unused", "", "", &source);
    assert_eq!(answer(gw.tls, "r.example.com").await, b"A");
    std::fs::write(hidden.path("routes.yaml"), table(c.addr)).unwrap();
    gw.wait_metric(APPLIED, |v| v == 2.0);
    assert_eq!(answer(gw.tls, "r.example.com").await, b"C");
}

/// Removed routes do not keep their metric series forever (shoots come and go): a route
/// without connections loses them at the reload, one with an open connection once that
/// connection has ended (at a later periodic check).
#[tokio::test(flavor = "multi_thread")]
async fn removed_routes_drop_their_metric_series() {
    let x = RawBackend::start(b"X", 0).await;
    let echo = echo_backend().await;
    let route = |name, sni, backend| R {
        name,
        sni: std::slice::from_ref(sni),
        backends: std::slice::from_ref(backend),
    };
    let gw = Gateway::start_opts(
        &routes_yaml(&[
            route("keep", &"keep.example.com", &x.addr),
            route("gone", &"gone.example.com", &x.addr),
            route("held", &"held.example.com", &echo),
        ]),
        "",
        "",
        "routes: {file: routes.yaml, checkInterval: 1s}",
    );
    assert_eq!(answer(gw.tls, "keep.example.com").await, b"X");
    assert_eq!(answer(gw.tls, "gone.example.com").await, b"X");
    let mut held = TcpStream::connect(gw.tls).await.unwrap();
    held.write_all(&hello("held.example.com")).await.unwrap();
    gw.wait_metric("trellis_route_connections_active{route=\"held\"}", |v| {
        v == 1.0
    });
    let metrics = || http_get(gw.admin, "/metrics").unwrap().1;
    assert!(metrics().contains("route=\"gone\""));

    gw.write_routes(&routes_yaml(&[route("keep", &"keep.example.com", &x.addr)]));
    gw.wait_metric(APPLIED, |v| v == 2.0);
    let text = metrics();
    assert!(!text.contains("route=\"gone\""), "{text}");
    assert!(
        text.contains("trellis_route_connections_active{route=\"held\"} 1"),
        "{text}"
    );
    assert!(text.contains("route=\"keep\""), "{text}");

    drop(held);
    let dropped = wait_for(Duration::from_secs(10), || {
        let text = metrics();
        (!text.contains("route=\"held\"")).then_some(text)
    });
    let text = dropped.unwrap_or_else(|| panic!("held's series stay:\n{}", metrics()));
    assert!(text.contains("route=\"keep\""), "{text}");
}

/// Every reload says its outcome with the generation and route count in force: applied,
/// unchanged (at info level on SIGHUP, at debug level on the periodic re-read) and
/// rejected.
#[tokio::test(flavor = "multi_thread")]
async fn every_reload_logs_its_outcome_generation_and_route_count() {
    let a: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let one = routes_yaml(&[R {
        name: "a",
        sni: &["a.example.com"],
        backends: &[a],
    }]);
    let two = routes_yaml(&[
        R {
            name: "a",
            sni: &["a.example.com"],
            backends: &[a],
        },
        R {
            name: "b",
            sni: &["b.example.com"],
            backends: &[a],
        },
    ]);
    let gw = Gateway::start_opts(
        &one,
        "",
        "",
        "routes: {file: routes.yaml, checkInterval: 200ms}",
    );
    let start = &lines_saying(&gw.logs(), "routing table applied")[0];
    assert_eq!(
        (&start["trigger"], &start["generation"], &start["routes"]),
        (&"start".into(), &1.into(), &1.into()),
        "{start}"
    );
    // SIGHUP with the file as it is: said at info level.
    gw.signal("HUP");
    let unchanged = |gw: &Gateway, trigger: &str| {
        lines_saying(&gw.logs(), "routing table unchanged")
            .into_iter()
            .filter(|l| l["trigger"] == trigger)
            .collect::<Vec<_>>()
    };
    let line = wait_for(Duration::from_secs(10), || unchanged(&gw, "sighup").pop())
        .unwrap_or_else(|| panic!("{}", gw.logs()));
    assert_eq!(line["level"], "INFO", "{line}");
    assert_eq!(
        (&line["generation"], &line["routes"]),
        (&1.into(), &1.into())
    );
    assert_eq!(line["result"], "unchanged");
    // The periodic re-read of an unchanged file: debug level only.
    let line = wait_for(Duration::from_secs(10), || unchanged(&gw, "timer").pop())
        .unwrap_or_else(|| panic!("{}", gw.logs()));
    assert_eq!(line["level"], "DEBUG", "{line}");

    gw.write_routes(&two);
    let line = wait_for(Duration::from_secs(10), || {
        lines_saying(&gw.logs(), "routing table applied")
            .into_iter()
            .find(|l| l["generation"] == 2)
    })
    .unwrap_or_else(|| panic!("{}", gw.logs()));
    assert_eq!(
        (&line["routes"], &line["result"]),
        (&2.into(), &"applied".into())
    );

    gw.write_routes("routes: [");
    let line = wait_for(Duration::from_secs(10), || {
        lines_saying(
            &gw.logs(),
            "routing table rejected; keeping the last good table",
        )
        .pop()
    })
    .unwrap_or_else(|| panic!("{}", gw.logs()));
    assert_eq!(line["level"], "ERROR");
    assert_eq!(
        (&line["generation"], &line["routes"], &line["result"]),
        (&2.into(), &2.into(), &"rejected".into()),
        "the table kept: {line}"
    );
    // SIGHUP with the same bad file: still said, at info level, as the rejected version.
    gw.signal("HUP");
    let line = wait_for(Duration::from_secs(10), || {
        unchanged(&gw, "sighup")
            .into_iter()
            .find(|l| l["same_as"] == "the version rejected before")
    })
    .unwrap_or_else(|| panic!("{}", gw.logs()));
    assert_eq!(
        (&line["generation"], &line["routes"]),
        (&2.into(), &2.into())
    );
}

/// A listener's `defaultRoute` missing from the table: the gateway starts, warns and shows
/// it in `trellis_default_route_missing` at every load, until a table has the route.
#[tokio::test(flavor = "multi_thread")]
async fn a_missing_default_route_is_warned_and_counted_at_every_load() {
    let a: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let without = routes_yaml(&[R {
        name: "a",
        sni: &["a.example.com"],
        backends: &[a],
    }]);
    let with = routes_yaml(&[
        R {
            name: "a",
            sni: &["a.example.com"],
            backends: &[a],
        },
        R {
            name: "fallback",
            sni: &[],
            backends: &[a],
        },
    ]);
    let missing = "trellis_default_route_missing{listener=\"tls\"}";
    let gw = Gateway::start_with(&without, "", "  defaultRoute: fallback");
    let warnings = |gw: &Gateway| {
        gw.logs()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|l| {
                l["level"] == "WARN" && l["listener"] == "tls" && l["default_route"] == "fallback"
            })
            .count()
    };
    assert_eq!(gw.metric(missing), 1.0, "{}", gw.metrics());
    assert_eq!(warnings(&gw), 1, "{}", gw.logs());
    gw.write_routes(&with);
    gw.wait_metric(missing, |v| v == 0.0);
    assert!(gw.metrics().contains(&format!("{missing} 0")));
    assert_eq!(warnings(&gw), 1);
    // Another table without it: warned again.
    gw.write_routes(&format!("{without}# v3\n"));
    gw.wait_metric(missing, |v| v == 1.0);
    assert_eq!(warnings(&gw), 2, "{}", gw.logs());
}
