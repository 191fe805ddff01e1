//! The controller and the gateway together, on loopback: the fake Kubernetes API server,
//! the real `trellis controller` writing its table, a real `trellis gateway` serving it.
//! A shoot's objects created, changed and deleted in the API move what a TLS client with
//! its server name reaches.

#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;
mod e2e;
mod fakekube;

use std::sync::Arc;
use std::time::Duration;

use e2e::{Controller, NamedBackend, gateway_for, host, namespace, wait_served};
use fakekube::FakeKube;

/// How long a change may take to reach a client before the test gives up (the target is a
/// second at p99; this is a deadline, not a measurement).
const LIMIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_fed_by_the_controller_serves_a_shoot_created_moved_and_deleted() {
    let names = e2e::test_names(&["alpha", "unknown"]);
    let fallback = NamedBackend::start("fallback", [127, 0, 0, 1], &names).await;
    let first = NamedBackend::start("first", [127, 0, 0, 2], &names).await;
    let second = NamedBackend::start("second", [127, 0, 0, 3], &names).await;
    let client = e2e::client(&[&fallback, &first, &second]);

    let kube = FakeKube::start().await;
    let c = Controller::start(&kube, fallback.addr);
    // An empty seed: the table is the fallback alone, which lets the gateway start.
    let t = c.wait_table("the fallback", LIMIT, |t| {
        e2e::route_names(t) == [e2e::FALLBACK]
    });
    assert_eq!(
        t["routes"][0]["backends"][0]["address"],
        fallback.addr.to_string()
    );
    let gw = gateway_for(&c, "");
    let alpha = host("alpha");
    assert_eq!(
        e2e::who(&client, gw.tls, &alpha).await.as_deref(),
        Ok("fallback")
    );

    // The shoot's objects created: its name reaches its API server.
    e2e::put_all(&kube, e2e::shoot("alpha", first.addr));
    wait_served(&client, gw.tls, &alpha, "first", LIMIT).await;
    // Other names still go to the fallback.
    assert_eq!(
        e2e::who(&client, gw.tls, &host("unknown")).await.as_deref(),
        Ok("fallback")
    );

    // Its EndpointSlice now points at another pod: new connections reach that one.
    kube.put(e2e::endpoint_slice("alpha", second.addr));
    wait_served(&client, gw.tls, &alpha, "second", LIMIT).await;
    for _ in 0..5 {
        assert_eq!(
            e2e::who(&client, gw.tls, &alpha).await.as_deref(),
            Ok("second")
        );
    }

    // Its VirtualService deleted: the name falls through to the fallback.
    kube.delete(
        "networking.istio.io/v1",
        "VirtualService",
        &namespace("alpha"),
        "kube-apiserver",
    )
    .unwrap();
    wait_served(&client, gw.tls, &alpha, "fallback", LIMIT).await;
    assert!(
        !e2e::served_routes(&gw).contains(&namespace("alpha")),
        "{:?}",
        e2e::served_routes(&gw)
    );
    assert!(
        gw.metric("trellis_routing_table_reloads_total{result=\"applied\"}") >= 3.0,
        "{}",
        gw.metrics()
    );
}

/// Shoots whose connections stream through the churn.
const STEADY_SHOOTS: usize = 10;
/// Long-lived connections, spread evenly over the steady shoots.
const CONNECTIONS: usize = 1_000;
/// Shoots created and deleted, one after the other, while they stream.
const CHURN_SHOOTS: usize = 50;
/// Bytes per round trip on each connection; one round every [`PACE`].
const CHUNK: usize = 512;
const PACE: Duration = Duration::from_millis(100);

/// A shoot's API server for the streaming connections: reads the ClientHello record the
/// client sends (the gateway routed on it and replayed it), then echoes every byte back and
/// half-closes after the client does.
async fn echo_after_hello(ip: [u8; 4]) -> std::net::SocketAddr {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind(std::net::SocketAddr::from((ip, 0)))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut header = [0u8; 5];
                if s.read_exact(&mut header).await.is_err() || header[0] != 0x16 {
                    return;
                }
                let mut hello = vec![0u8; u16::from_be_bytes([header[3], header[4]]) as usize];
                if s.read_exact(&mut hello).await.is_err() {
                    return;
                }
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = tokio::io::AsyncWriteExt::shutdown(&mut w).await;
            });
        }
    });
    addr
}

/// The byte at `offset` of connection `id`'s stream: a counter pattern that differs per
/// connection, so a byte lost, repeated, reordered or from another connection shows.
fn pattern(id: usize, offset: u64) -> u8 {
    (offset.wrapping_mul(7).wrapping_add(id as u64 * 13) % 251) as u8
}

/// One streaming connection: its round trips so far, and how it ended if it did.
struct Stream {
    rounds: std::sync::atomic::AtomicU64,
    failed: std::sync::Mutex<Option<String>>,
}

/// Sends a ClientHello for `sni`, then every [`PACE`] a [`CHUNK`] of its pattern, reads it
/// back and checks it, until `stop`; then half-closes and expects a clean end of stream.
async fn stream(
    id: usize,
    gateway: std::net::SocketAddr,
    hello: Arc<Vec<u8>>,
    state: Arc<Stream>,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let run = async {
        let mut s = tokio::net::TcpStream::connect(gateway).await?;
        s.write_all(&hello).await?;
        let (mut offset, mut out, mut back) = (0u64, vec![0u8; CHUNK], vec![0u8; CHUNK]);
        let mut tick = tokio::time::interval(PACE);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !*stop.borrow() {
            tick.tick().await;
            for (i, b) in out.iter_mut().enumerate() {
                *b = pattern(id, offset + i as u64);
            }
            s.write_all(&out).await?;
            tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back))
                .await
                .map_err(|_| std::io::Error::other("no echo within 10 s"))??;
            if back != out {
                let at = back.iter().zip(&out).position(|(a, b)| a != b).unwrap_or(0);
                return Err(std::io::Error::other(format!(
                    "corrupted at byte {}",
                    offset + at as u64
                )));
            }
            offset += CHUNK as u64;
            state.rounds.fetch_add(1, Ordering::SeqCst);
        }
        s.shutdown().await?;
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest))
            .await
            .map_err(|_| std::io::Error::other("no end of stream within 10 s"))??;
        if !rest.is_empty() {
            return Err(std::io::Error::other(format!(
                "{} bytes after the end",
                rest.len()
            )));
        }
        Ok::<_, std::io::Error>(())
    };
    if let Err(e) = run.await {
        let rounds = state.rounds.load(Ordering::SeqCst);
        *state.failed.lock().unwrap() =
            Some(format!("{e} (kind {:?}) after {rounds} rounds", e.kind()));
    }
}

/// Every connection's round count now.
fn rounds(streams: &[Arc<Stream>]) -> Vec<u64> {
    streams
        .iter()
        .map(|s| s.rounds.load(std::sync::atomic::Ordering::SeqCst))
        .collect()
}

/// Fails with the connections that failed, and with those that did not move since `before`.
fn check_moving(streams: &[Arc<Stream>], before: &[u64], when: &str) -> Vec<u64> {
    let failed: Vec<String> = streams
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            s.failed
                .lock()
                .unwrap()
                .clone()
                .map(|e| format!("#{i}: {e}"))
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {CONNECTIONS} connections failed {when}; first: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    let now = rounds(streams);
    let stalled = now.iter().zip(before).filter(|(n, b)| n <= b).count();
    assert_eq!(stalled, 0, "{stalled} connections moved no bytes {when}");
    now
}

/// Waits (at most `limit`) until every connection has made a round trip since `before`;
/// fails at once when one failed, and at the deadline with those that did not move.
async fn wait_moving(
    streams: &[Arc<Stream>],
    before: &[u64],
    when: &str,
    limit: Duration,
) -> Vec<u64> {
    let start = std::time::Instant::now();
    loop {
        let failed = streams.iter().any(|s| s.failed.lock().unwrap().is_some());
        let moved = rounds(streams).iter().zip(before).all(|(n, b)| n > b);
        if failed || moved || start.elapsed() > limit {
            return check_moving(streams, before, when);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shoots_created_and_deleted_leave_other_shoots_connections_untouched() {
    // Here a descriptor per client and per echo, in the gateway two per connection.
    let needed = 2 * CONNECTIONS as u64 + 1_000;
    let limit = common::raise_nofile(16_384);
    assert!(
        limit >= needed,
        "this test needs an open-files limit of {needed} and this process may raise its own \
         only to {limit}: raise the hard limit (`ulimit -Hn`, or LimitNOFILE for a service) \
         and run it again"
    );
    let churn_names: Vec<String> = (0..CHURN_SHOOTS).map(|j| format!("churn-{j}")).collect();
    let sans: Vec<String> = churn_names.iter().map(|n| host(n)).collect();
    let fallback = NamedBackend::start("fallback", [127, 0, 0, 1], &sans).await;
    let churn_backend = NamedBackend::start("churn", [127, 0, 0, 4], &sans).await;
    let client = e2e::client(&[&fallback, &churn_backend]);

    let kube = FakeKube::start().await;
    for i in 0..STEADY_SHOOTS {
        let echo = echo_after_hello([127, 0, 0, 10 + i as u8]).await;
        e2e::put_all(&kube, e2e::shoot(&format!("steady-{i}"), echo));
    }
    let c = Controller::start(&kube, fallback.addr);
    c.wait_table("the steady shoots", LIMIT, |t| {
        e2e::route_names(t).len() == STEADY_SHOOTS + 1
    });
    let gw = gateway_for(&c, "");

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let hellos: Vec<Arc<Vec<u8>>> = (0..STEADY_SHOOTS)
        .map(|i| Arc::new(common::rustls_client_hello(&host(&format!("steady-{i}")))))
        .collect();
    let mut streams = Vec::new();
    let mut tasks = Vec::new();
    for id in 0..CONNECTIONS {
        let state = Arc::new(Stream {
            rounds: Default::default(),
            failed: Default::default(),
        });
        streams.push(state.clone());
        let hello = hellos[id % STEADY_SHOOTS].clone();
        tasks.push(tokio::spawn(stream(
            id,
            gw.tls,
            hello,
            state,
            stop_rx.clone(),
        )));
    }
    // Every connection established and streaming before the churn starts.
    let start = std::time::Instant::now();
    while rounds(&streams).contains(&0) {
        let idle = rounds(&streams).iter().filter(|r| **r == 0).count();
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{idle} connections never completed a round trip"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut seen = check_moving(&streams, &vec![0; CONNECTIONS], "before the churn");
    assert!(
        gw.metric("trellis_downstream_connections_active{") >= CONNECTIONS as f64,
        "{}",
        gw.metrics()
    );
    let reloads = || gw.metric("trellis_routing_table_reloads_total{result=\"applied\"}");
    let reloads_before = reloads();

    // Each churn shoot: objects created, its route served by the gateway, objects deleted,
    // its name back at the fallback. Every tenth shoot, each connection must have moved.
    for (j, name) in churn_names.iter().enumerate() {
        e2e::put_all(&kube, e2e::shoot(name, churn_backend.addr));
        wait_served(&client, gw.tls, &host(name), "churn", LIMIT).await;
        e2e::delete_shoot(&kube, name);
        wait_served(&client, gw.tls, &host(name), "fallback", LIMIT).await;
        if j % 10 == 9 {
            seen = check_moving(
                &streams,
                &seen,
                &format!("during churn shoots {}..={j}", j - 9),
            );
        }
    }
    let reloaded = reloads() - reloads_before;
    assert!(
        reloaded >= 2.0 * CHURN_SHOOTS as f64,
        "the gateway applied only {reloaded} tables during the churn"
    );
    // A last stretch after the churn, then every connection ends cleanly.
    wait_moving(&streams, &seen, "after the churn", LIMIT).await;
    stop_tx.send(true).unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    check_moving(&streams, &vec![0; CONNECTIONS], "at their end");
    assert_eq!(
        e2e::route_names(&c.table().unwrap()).len(),
        STEADY_SHOOTS + 1,
        "the churn left routes behind"
    );
}

/// The first certificate the server presented.
fn server_leaf(tls: &tokio_rustls::client::TlsStream<tokio::net::TcpStream>) -> Vec<u8> {
    tls.get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap()
}

/// A shoot's tunnel and egress from the controller: an agent's key rotated in its peers
/// Secret and its egress server certificate renewed by the secrets manager (a second Secret
/// of that name, newer) reach the running gateway without a restart: `/routes` shows the new
/// key, a kube-apiserver (a TLS client from its pod address with its egress client
/// certificate) is shown the new certificate; the first certificate's Secret cleaned up
/// changes nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_key_and_egress_certificate_rotations_reach_the_running_gateway() {
    use common::egress::{Ca, Client, handshake, pem_certs};
    use trellis::route::WgKey;
    let kube = FakeKube::start().await;
    let name = "rotating";
    let ns = namespace(name);
    // The kube-apiserver pod: its address is the egress client's.
    let pod: std::net::IpAddr = [127, 0, 0, 7].into();
    let ca = Ca::new("vpn");
    let sans = [
        "vpn-seed-server".to_owned(),
        format!("vpn-seed-server.{ns}"),
    ];
    let first = ca.issue("vpn-seed-server", &sans, true);
    let second = ca.issue("vpn-seed-server", &sans, true);
    // The CN Gardener 1.124 and later give the egress client certificate.
    let (client_cert, client_key) = ca.issue("kube-apiserver-http-proxy-client", &[], false);
    let kube_apiserver = Client {
        trust: ca.pem.clone(),
        cert: Some((client_cert, client_key)),
    };
    let (key1, key2) = (WgKey([1; 32]).to_base64(), WgKey([2; 32]).to_base64());
    e2e::put_all(
        &kube,
        vec![
            e2e::cluster(name),
            e2e::endpoint_slice(name, std::net::SocketAddr::new(pod, 443)),
            e2e::peers_secret(name, &key1),
            e2e::managed_secret(
                name,
                "vpn-seed-server-aaaa",
                "vpn-seed-server",
                "2024-03-01T10:00:00Z",
                &[("tls.crt", &first.0), ("tls.key", &first.1)],
            ),
            e2e::managed_secret(
                name,
                "ca-vpn-bundle-aaaa",
                "ca-vpn-bundle",
                "2024-03-01T10:00:00Z",
                &[("bundle.crt", &ca.pem)],
            ),
        ],
    );
    let fallback = std::net::SocketAddr::from(([127, 0, 0, 1], 9));
    let c = Controller::start_tunnels(&kube, fallback);
    let route = format!("{ns}.tunnel");
    c.wait_table("the shoot's tunnel and egress", LIMIT, |t| {
        t["routes"].as_array().is_some_and(|rs| {
            rs.iter()
                .any(|r| r["name"] == route && r["egress"].is_object())
        })
    });
    for file in ["crt", "key", "ca.crt"] {
        let path = c.dir.path(&format!("out/egress.{ns}.{file}"));
        assert!(path.exists(), "{} not written", path.display());
    }
    // The listener's own material: another shoot's PKI (the route's own is presented).
    let listener_dir = common::TestDir::new("egress-listener");
    let listener = common::egress::Shoot::new(&listener_dir, "listener");
    let mut gw = common::Gateway::start_listeners_source(
        "",
        &[(
            "egress",
            "egress-connect",
            &format!("  tls: {}", listener.tls_yaml()),
        )],
        "",
        &format!(
            "routes: {{file: {:?}}}",
            c.table_path().display().to_string()
        ),
    );
    let egress = gw.addr("egress");
    let shown = |tls: &_| server_leaf(tls);
    let presented = || async {
        let tls = handshake(egress, Some(pod), "vpn-seed-server", &kube_apiserver, false).await;
        tls.map(|t| shown(&t))
    };
    assert_eq!(e2e::served_peer_keys(&gw, &route), [key1]);
    assert_eq!(
        presented().await.unwrap(),
        pem_certs(&first.0)[0].to_vec(),
        "the shoot's vpn-seed-server certificate"
    );

    // The agent's key rotated: the Secret changes in place.
    kube.put(e2e::peers_secret(name, &key2));
    let keys = common::wait_for(LIMIT, || {
        let keys = e2e::served_peer_keys(&gw, &route);
        (keys == [key2.clone()]).then_some(keys)
    });
    assert!(
        keys.is_some(),
        "{:?}\n{}",
        e2e::served_peer_keys(&gw, &route),
        c.logs()
    );

    // The server certificate renewed: a newer Secret of the same name.
    kube.put(e2e::managed_secret(
        name,
        "vpn-seed-server-bbbb",
        "vpn-seed-server",
        "2024-03-02T10:00:00Z",
        &[("tls.crt", &second.0), ("tls.key", &second.1)],
    ));
    let new_leaf = pem_certs(&second.0)[0].to_vec();
    let start = std::time::Instant::now();
    loop {
        if presented().await.ok().as_deref() == Some(&new_leaf[..]) {
            break;
        }
        assert!(
            start.elapsed() < LIMIT,
            "the new certificate was not presented within {LIMIT:?}\n{}",
            c.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The old Secret cleaned up: the newer stays in use.
    kube.delete("v1", "Secret", &ns, "vpn-seed-server-aaaa")
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(presented().await.unwrap(), new_leaf);
    // One gateway process throughout: the key came with a reloaded table, the certificate
    // with a re-read file.
    assert!(matches!(gw.child.try_wait(), Ok(None)), "{}", gw.logs());
    assert!(
        gw.metric("trellis_routing_table_reloads_total{result=\"applied\"}") >= 1.0,
        "{}",
        gw.metrics()
    );
    assert!(
        gw.metric("trellis_tls_material_loads_total{result=\"loaded\"}") >= 2.0,
        "{}",
        gw.metrics()
    );
}
