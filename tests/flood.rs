//! Memory after a flood: 8,000 slow clients each send part of a large ClientHello
//! and wait; once they are gone and the gateway has rested, its resident memory is back within
//! twice what it was fresh.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use common::{Gateway, R, routes_yaml, rss_kib, wait_for};

/// Slow clients in the flood: fewer than the 8,896 connections the gateway admits under an
/// open-files limit of 20,000 (a common container default that a process without
/// `CAP_SYS_RESOURCE` cannot raise): two sockets per connection, after its reserve and its
/// splice pipes.
const CLIENTS: usize = 8_000;

#[test]
fn memory_returns_after_a_flood_of_slow_clients() {
    let limit = common::raise_nofile(65_536);
    let needed = 2 * CLIENTS as u64 + 1_000;
    if limit < needed {
        // The gateway inherits the limit and would cap its connections below the flood.
        common::skip(
            "memory_returns_after_a_flood_of_slow_clients",
            &format!(
                "the flood needs an open-files limit of {needed}; this process may raise its \
                 own only to {limit}"
            ),
        );
        return;
    }
    let gw = Gateway::start(
        &routes_yaml(&[R {
            name: "r",
            sni: &["r.example.com"],
            backends: &["127.0.0.1:9".parse().unwrap()],
        }]),
        // One loopback address stands for thousands of clients.
        "timeouts: {handshake: 60s}\nlimits: {maxConnectionsPerSource: 0}\n",
    );
    // Settled: the first scrape and the first trim check have run.
    std::thread::sleep(Duration::from_secs(1));
    let fresh = rss_kib(gw.pid());

    // A ClientHello record announcing 16 KB, of which each client sends 3 KB and then waits.
    let mut hello = vec![
        0x16, 0x03, 0x01, 0x3f, 0xf0, 0x01, 0x00, 0x3f, 0xec, 0x03, 0x03,
    ];
    hello.resize(3_000, b'a');
    let mut clients = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        let mut c = TcpStream::connect(gw.tls).unwrap();
        c.write_all(&hello).unwrap();
        clients.push(c);
    }
    gw.wait_metric("trellis_downstream_connections_active{", |n| {
        n >= CLIENTS as f64
    });
    let during = rss_kib(gw.pid());
    // The flood must have cost memory, or the check below proves nothing.
    assert!(
        during >= 2 * fresh,
        "the flood should at least double resident memory: fresh {fresh} KiB, during {during} KiB"
    );
    drop(clients);
    gw.wait_metric("trellis_downstream_connections_active{", |n| n == 0.0);

    let settled = wait_for(Duration::from_secs(30), || {
        let now = rss_kib(gw.pid());
        (now <= 2 * fresh).then_some(now)
    });
    let after = rss_kib(gw.pid());
    assert!(
        settled.is_some(),
        "resident memory after the flood and 30 s of rest: {after} KiB; fresh {fresh} KiB, \
         during {during} KiB; expected at most twice fresh"
    );
    eprintln!("resident memory: fresh {fresh} KiB, during {during} KiB, after {after} KiB");
}
