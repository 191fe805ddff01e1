//! Backends named by DNS, against a DNS server the test runs on loopback
//! (`resolver.nameservers`): a name is asked once per record type per TTL however many
//! connections use it; a flood to a route whose name never answers leaves a healthy DNS route
//! serving every request, keeps the gateway's threads few, and is counted as
//! `resolve_timeout`, apart from connect timeouts and from names that do not exist.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::dns::{DnsServer, Zone};
use common::{Gateway, echo_backend, rustls_client_hello};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

/// A routing table of `(route, backend address)`; route `r` answers SNI `r.example.com`.
fn table(routes: &[(&str, String)]) -> String {
    let mut out =
        String::from("apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes:\n");
    for (name, backend) in routes {
        out += &format!(
            "- name: {name}\n  sni: [\"{name}.example.com\"]\n  backends:\n  - address: \"{backend}\"\n"
        );
    }
    out
}

/// Sends a ClientHello for `sni` and reads until the gateway or the backend closes (at most
/// `limit`): an echo backend returns the hello, a failed connect returns nothing.
async fn hello(gw: SocketAddr, sni: &str, limit: Duration) -> Vec<u8> {
    let attempt = async {
        let mut s = TcpStream::connect(gw).await.ok()?;
        s.write_all(&rustls_client_hello(sni)).await.ok()?;
        s.shutdown().await.ok()?;
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.ok()?;
        Some(got)
    };
    tokio::time::timeout(limit, attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Threads of process `pid` now.
fn threads(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

/// Twenty connections within the TTL cost one A and one AAAA query; after the TTL the next
/// connection asks again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_is_asked_once_per_ttl_however_many_connections_use_it() {
    let dns = DnsServer::start(&[("svc.test", Zone::Answer(vec![LOCAL], 3))]);
    let backend = echo_backend().await;
    let gw = Gateway::start(
        &table(&[("svc", format!("svc.test:{}", backend.port()))]),
        &format!("resolver: {{nameservers: [\"{}\"]}}\n", dns.addr),
    );
    let sni = "svc.example.com";
    let want = rustls_client_hello(sni).len();
    let started = Instant::now();
    let rounds: Vec<_> = (0..20)
        .map(|_| tokio::spawn(hello(gw.tls, sni, Duration::from_secs(5))))
        .collect();
    for r in rounds {
        assert_eq!(r.await.unwrap().len(), want, "{}", gw.logs());
    }
    for _ in 0..5 {
        assert_eq!(hello(gw.tls, sni, Duration::from_secs(5)).await.len(), want);
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "all within the TTL"
    );
    assert_eq!(dns.queries("svc.test", "A"), 1, "{}", gw.logs());
    assert_eq!(dns.queries("svc.test", "AAAA"), 1);

    tokio::time::sleep(Duration::from_secs(3).saturating_sub(started.elapsed())).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(hello(gw.tls, sni, Duration::from_secs(5)).await.len(), want);
    assert_eq!(dns.queries("svc.test", "A"), 2, "asked again after the TTL");
    assert_eq!(dns.queries("svc.test", "AAAA"), 2);
}

/// Two waves of 300 connections to a route whose name never answers: a route whose name
/// does answer (with a 1 s TTL, so it is looked up again during the flood) serves every
/// one of 25 requests meanwhile, the gateway stays under 64 threads, the never-answering
/// name is asked a few times (not once per connection) and its failures are
/// `resolve_timeout`; a name that does not exist is `resolve`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_never_answers_leaves_a_healthy_name_serving() {
    common::raise_nofile(16_384);
    let dns = DnsServer::start(&[
        ("healthy.test", Zone::Answer(vec![LOCAL], 1)),
        ("dark.test", Zone::Silent),
    ]);
    let backend = echo_backend().await;
    let port = backend.port();
    let gw = Gateway::start(
        &table(&[
            ("healthy", format!("healthy.test:{port}")),
            ("dark", format!("dark.test:{port}")),
            ("missing", format!("missing.test:{port}")),
        ]),
        &format!(
            "resolver: {{nameservers: [\"{}\"], timeout: 1s}}\ntimeouts: {{connect: 3s}}\n\
             limits: {{maxConnectionsPerSource: 0}}\n",
            dns.addr
        ),
    );
    let pid = gw.pid();
    let most_threads = Arc::new(AtomicUsize::new(threads(pid)));
    let flooding = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (most, flooding) = (most_threads.clone(), flooding.clone());
        std::thread::spawn(move || {
            while flooding.load(Ordering::SeqCst) {
                most.fetch_max(threads(pid), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    const WAVE: usize = 300;
    let flood = {
        let tls = gw.tls;
        tokio::spawn(async move {
            let mut closed_empty = 0;
            for _ in 0..2 {
                let wave: Vec<_> = (0..WAVE)
                    .map(|_| tokio::spawn(hello(tls, "dark.example.com", Duration::from_secs(10))))
                    .collect();
                for c in wave {
                    closed_empty += usize::from(c.await.unwrap().is_empty());
                }
            }
            closed_empty
        })
    };
    let sni = "healthy.example.com";
    let want = rustls_client_hello(sni).len();
    let mut served = 0;
    for _ in 0..25 {
        let started = Instant::now();
        if hello(gw.tls, sni, Duration::from_secs(5)).await.len() == want {
            served += 1;
        }
        tokio::time::sleep(Duration::from_millis(80).saturating_sub(started.elapsed())).await;
    }
    let closed_empty = flood.await.unwrap();
    flooding.store(false, Ordering::SeqCst);
    sampler.join().unwrap();

    assert_eq!(served, 25, "every healthy request served:\n{}", gw.logs());
    assert_eq!(
        closed_empty,
        2 * WAVE,
        "the never-answering route connects nowhere"
    );
    let most = most_threads.load(Ordering::SeqCst);
    assert!(most < 64, "{most} threads during the flood");
    let failures = |reason: &str| {
        gw.metric(&format!(
            "trellis_upstream_connect_failures_total{{route=\"dark\",reason=\"{reason}\"}}"
        ))
    };
    assert_eq!(
        failures("resolve_timeout"),
        (2 * WAVE) as f64,
        "{}",
        gw.metrics()
    );
    assert_eq!(failures("timeout"), 0.0);
    // One lookup per wave, each at most A and AAAA sent three times: not one per connection.
    let asked = dns.queries_for("dark.test");
    assert!((2..=24).contains(&asked), "dark.test asked {asked} times");

    assert!(
        hello(gw.tls, "missing.example.com", Duration::from_secs(5))
            .await
            .is_empty()
    );
    assert_eq!(
        gw.metric("trellis_upstream_connect_failures_total{route=\"missing\",reason=\"resolve\"}"),
        1.0
    );
}
