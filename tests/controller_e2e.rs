//! The controller and the gateway together, on loopback: the fake Kubernetes API server,
//! the real `trellis controller` writing its table, a real `trellis gateway` serving it.
//! A shoot's objects created, changed and deleted in the API move what a TLS client with
//! its server name reaches.

#![allow(clippy::unwrap_used, unreachable_pub)]

mod common;
mod e2e;
mod fakekube;

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
