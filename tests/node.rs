//! `trellis node` on loopback, without root: no managed address, and a real gateway or a
//! scripted one behind it. Bytes cross the node's CONNECT tunnel unchanged, TCP urgent data
//! included, in both directions; the gateway's first tunnel bytes reach the client; a
//! refused tunnel is counted.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    reason = "a test or bench fails loudly on what it did not expect"
)]

mod common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

const DEST: &str = "outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local";

/// A running node process, killed on drop.
struct Node {
    child: Child,
    listen: SocketAddr,
    admin: SocketAddr,
    dir: TestDir,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    /// A node forwarding to the gateway's `http-connect` listener `connect`.
    fn start(gateway: SocketAddr) -> Node {
        let dir = TestDir::new("node");
        let ports = free_ports(2);
        let listen = SocketAddr::from(([127, 0, 0, 1], ports[0]));
        let admin = SocketAddr::from(([127, 0, 0, 1], ports[1]));
        let config = format!(
            "apiVersion: trellis.gardener.cloud/v1alpha1
kind: NodeConfiguration
listen: [\"{listen}\"]
upstream:
  address: \"{gateway}\"
  protocol: http-connect
  destination: \"{DEST}\"
admin: {{address: \"{admin}\"}}
"
        );
        std::fs::write(dir.path("node.yaml"), config).unwrap();
        let log = std::fs::File::create(dir.path("node.log")).unwrap();
        let child = Command::new(BIN)
            .args(["--log-format", "json", "node", "--config"])
            .arg(dir.path("node.yaml"))
            .env("TRELLIS_LOG", "info,trellis=debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let node = Node {
            child,
            listen,
            admin,
            dir,
        };
        let ready = wait_for(Duration::from_secs(20), || {
            matches!(http_get(admin, "/ready"), Some((200, _))).then_some(())
        });
        assert!(ready.is_some(), "node not ready:\n{}", node.logs());
        node
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(self.dir.path("node.log")).unwrap_or_default()
    }

    /// The first access-log line of a finished connection.
    fn wait_access_log(&self) -> serde_json::Value {
        wait_for(Duration::from_secs(10), || {
            self.logs()
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .find(|l| l["target"] == "trellis::access" && l["periodic"] == false)
        })
        .unwrap_or_else(|| panic!("no access log line:\n{}", self.logs()))
    }
}

/// A gateway with a CONNECT listener whose one route leads to `backend`.
fn gateway_to(backend: SocketAddr) -> Gateway {
    let routes = format!(
        "apiVersion: trellis.gardener.cloud/v1alpha1
kind: RoutingTable
routes:
- name: shoot--dev--alpha
  destinations: [\"{DEST}\"]
  backends: [{{address: \"{backend}\"}}]
"
    );
    Gateway::start_listeners(&routes, &[("connect", "http-connect", "")], "")
}

/// 2 MiB, an urgent `!` once `spliced` (the relay splices the flow), 2 MiB.
async fn send_with_urgent_byte(s: &mut TcpStream, fill: u8, spliced: impl Future<Output = ()>) {
    let bulk = vec![fill; 2 << 20];
    s.write_all(&bulk).await.unwrap();
    spliced.await;
    assert_eq!(
        socket2::SockRef::from(&*s).send_out_of_band(b"!").unwrap(),
        1
    );
    s.write_all(&bulk).await.unwrap();
}

/// A client's urgent byte on a spliced upload crosses the node and the gateway in place.
#[tokio::test(flavor = "multi_thread")]
async fn a_clients_urgent_data_crosses_the_node_inline() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.unwrap();
        let urgent_at = got.iter().position(|&b| b == b'!');
        let answer = format!("{} {urgent_at:?}", got.len());
        s.write_all(answer.as_bytes()).await.unwrap();
        s.shutdown().await.unwrap();
    });
    let gw = gateway_to(backend);
    let node = Node::start(gw.addr("connect"));
    let mut s = TcpStream::connect(node.listen).await.unwrap();
    let spliced = async {
        tokio::join!(
            urgent::spliced(|| node.logs(), "client"),
            urgent::spliced(|| gw.logs(), "client")
        );
    };
    send_with_urgent_byte(&mut s, b'x', spliced).await;
    s.shutdown().await.unwrap();
    let got = read_all(&mut s, Duration::from_secs(20)).await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&got),
        format!("{} Some({})", (4 << 20) + 1, 2 << 20),
        "every byte, the urgent one in place\n{}",
        node.logs()
    );
}

/// A scripted CONNECT gateway: reads the request head, then runs `script` on the socket.
async fn fake_gateway<F, Fut>(script: F) -> SocketAddr
where
    F: FnOnce(TcpStream, String) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            s.read_exact(&mut byte).await.unwrap();
            head.push(byte[0]);
        }
        script(s, String::from_utf8(head).unwrap()).await;
    });
    addr
}

/// The gateway's first tunnel bytes, sent with the `200` in one segment, reach the client
/// and are counted; then urgent data from the gateway's side on a spliced download crosses
/// the node's upstream socket in place.
#[tokio::test(flavor = "multi_thread")]
async fn early_bytes_and_urgent_data_from_the_gateway_reach_the_client() {
    let (spliced_tx, spliced_rx) = oneshot::channel::<()>();
    let gateway = fake_gateway(|mut s, head| async move {
        assert!(head.starts_with("CONNECT "), "{head}");
        assert!(
            head.contains(&format!("X-Gardener-Destination: {DEST}\r\n")),
            "{head}"
        );
        s.write_all(b"HTTP/1.1 200 Connection established\r\n\r\nearly")
            .await
            .unwrap();
        send_with_urgent_byte(&mut s, b'y', async { spliced_rx.await.unwrap() }).await;
        s.shutdown().await.unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest).await;
    })
    .await;
    let node = Node::start(gateway);
    let mut s = TcpStream::connect(node.listen).await.unwrap();
    let mut got = Vec::new();
    let spliced = async {
        urgent::spliced(|| node.logs(), "backend").await;
        spliced_tx.send(()).unwrap();
    };
    let (read, ()) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut got)),
        spliced
    );
    read.expect("the download ends").unwrap();
    assert!(
        got.starts_with(b"early"),
        "the bytes after the response head come first"
    );
    let got = &got[5..];
    let urgent_at = got.iter().position(|&b| b == b'!');
    assert_eq!(
        (got.len(), urgent_at),
        ((4 << 20) + 1, Some(2 << 20)),
        "every byte, the urgent one in place\n{}",
        node.logs()
    );
    drop(s);
    let line = node.wait_access_log();
    assert_eq!(line["tx_bytes"], 5 + (4 << 20) + 1, "{line}");
    assert_eq!(line["reason"], "backend_closed", "{line}");
}

/// The gateway's answer to the node's CONNECT.
const ANSWER: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";

/// The gateway's end of a tunnel a [`fake_gateway`] hands over once it has answered.
async fn tunnel_end(rx: oneshot::Receiver<TcpStream>) -> TcpStream {
    tokio::time::timeout(Duration::from_secs(10), rx)
        .await
        .expect("the node opened no tunnel")
        .unwrap()
}

/// Urgent data queued at the node before its tunnel is up, from both sides: the client's
/// 1,000 bytes and urgent byte wait while the gateway holds its answer back; the gateway's
/// answer comes in one segment with its first tunnel bytes and its own urgent byte, which
/// the node reads before its relay starts. Every byte crosses in place, and the streams go
/// on.
#[tokio::test(flavor = "multi_thread")]
async fn urgent_data_queued_before_the_tunnel_is_up_crosses_the_node() {
    let (queued_tx, queued_rx) = oneshot::channel::<()>();
    let (end_tx, end_rx) = oneshot::channel();
    let gateway = fake_gateway(|s, _| async move {
        // The tunnel is up only once the client's urgent byte waits at the node.
        queued_rx.await.unwrap();
        urgent::send_burst(&s, ANSWER, b'y', 100);
        let _ = end_tx.send(s);
    })
    .await;
    let node = Node::start(gateway);
    let mut client = TcpStream::connect(node.listen).await.unwrap();
    // A loopback send has reached the node's socket when it returns.
    urgent::send_burst(&client, b"", b'x', 1000);
    queued_tx.send(()).unwrap();
    let mut gateway = tunnel_end(end_rx).await;
    let (up, down) = tokio::join!(
        urgent::read_burst(&mut gateway, b'x', 1000),
        urgent::read_burst(&mut client, b'y', 100),
    );
    assert_eq!((&up, &down), (&Ok(()), &Ok(())), "{}", node.logs());
    urgent::bulk_both_ways(&mut client, &mut gateway).await;
}

/// Urgent data arriving while the relay runs, each way in one segment with 1,000 bytes
/// before it: every byte crosses in place, and the streams go on.
#[tokio::test(flavor = "multi_thread")]
async fn urgent_data_in_mid_stream_crosses_the_node() {
    let (end_tx, end_rx) = oneshot::channel();
    let gateway = fake_gateway(|mut s, _| async move {
        s.write_all(ANSWER).await.unwrap();
        let _ = end_tx.send(s);
    })
    .await;
    let node = Node::start(gateway);
    let mut client = TcpStream::connect(node.listen).await.unwrap();
    let mut gateway = tunnel_end(end_rx).await;
    // The relay is running: a first exchange crosses each way.
    let mut four = [0u8; 4];
    client.write_all(b"ping").await.unwrap();
    gateway.read_exact(&mut four).await.unwrap();
    gateway.write_all(b"pong").await.unwrap();
    client.read_exact(&mut four).await.unwrap();
    assert_eq!(&four, b"pong");
    urgent::send_burst(&client, b"", b'x', 1000);
    urgent::send_burst(&gateway, b"", b'y', 1000);
    let (up, down) = tokio::join!(
        urgent::read_burst(&mut gateway, b'x', 1000),
        urgent::read_burst(&mut client, b'y', 1000),
    );
    assert_eq!((&up, &down), (&Ok(()), &Ok(())), "{}", node.logs());
    urgent::bulk_both_ways(&mut client, &mut gateway).await;
}

/// A gateway that refuses the tunnel: the client is closed, and the failure is counted and
/// logged as the gateway's rejection.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_tunnel_closes_the_client_and_is_counted() {
    let gateway = fake_gateway(|mut s, _| async move {
        s.write_all(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            .await
            .unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest).await;
    })
    .await;
    let node = Node::start(gateway);
    let mut s = TcpStream::connect(node.listen).await.unwrap();
    let got = read_all(&mut s, Duration::from_secs(10)).await.unwrap();
    assert!(
        got.is_empty(),
        "nothing of the gateway's answer reaches the client"
    );
    let line = node.wait_access_log();
    assert_eq!(line["reason"], "error:upstream_rejected", "{line}");
    // The gateway tried is in the access log and in the (rate-limited) warning.
    assert_eq!(line["backend"], gateway.to_string(), "{line}");
    assert!(
        node.logs().lines().any(|l| l.contains("\"level\":\"WARN\"")
            && l.contains("connect failed")
            && l.contains(&format!("\"backend\":\"{gateway}\""))),
        "{}",
        node.logs()
    );
    let metrics = http_get(node.admin, "/metrics").unwrap().1;
    assert_eq!(
        metric_in(
            &metrics,
            "trellis_upstream_connect_failures_total{route=\"upstream\",reason=\"rejected\"}"
        ),
        1.0,
        "{metrics}"
    );
}

/// The node exports the shared connection families, `trellis_build_info` and the
/// `process_*` metrics, and none of the gateway's own (routing table, ClientHello sizes,
/// PROXY headers).
#[test]
fn node_metrics_are_its_own() {
    let node = Node::start("127.0.0.1:9".parse().unwrap());
    let (status, metrics) = http_get(node.admin, "/metrics").unwrap();
    assert_eq!(status, 200);
    let families: Vec<&str> = metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    for gateway_only in [
        "trellis_routing_table_routes",
        "trellis_routing_table_generation",
        "trellis_routing_table_reloads",
        "trellis_client_hello_bytes",
        "trellis_proxy_protocol_headers",
        "trellis_default_route_missing",
    ] {
        assert!(
            !families.contains(&gateway_only),
            "{gateway_only}\n{metrics}"
        );
    }
    for family in [
        "trellis_downstream_connections",
        "trellis_build_info",
        "process_resident_memory_bytes",
        "process_cpu_seconds",
    ] {
        assert!(families.contains(&family), "{family}\n{metrics}");
    }
    let build = format!("trellis_build_info{{version=\"{}\"}} 1", trellis::VERSION);
    assert!(metrics.lines().any(|l| l == build), "{metrics}");
    assert!(metric_in(&metrics, "process_resident_memory_bytes ") > 0.0);
    // The node has no routing table to show, on any address.
    assert_eq!(http_get(node.admin, "/routes").unwrap().0, 404);
}

/// A second node on the same listen address (its own admin port) refuses to start, saying
/// so; the first keeps answering its probes.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_node_on_the_same_address_refuses_to_start() {
    // Nothing is forwarded: any address will do as the gateway.
    let node = Node::start("127.0.0.1:9".parse().unwrap());
    let config = std::fs::read_to_string(node.dir.path("node.yaml")).unwrap();
    let second = config.replace(
        &node.admin.to_string(),
        &format!("127.0.0.1:{}", free_port()),
    );
    std::fs::write(node.dir.path("second.yaml"), second).unwrap();
    let (ok, out) = run(
        Command::new(BIN)
            .args(["node", "--config"])
            .arg(node.dir.path("second.yaml")),
        b"",
        Duration::from_secs(20),
    );
    assert!(!ok, "{out}");
    assert!(
        out.contains(&format!(
            "cannot bind listener on {}: another process already listens there",
            node.listen
        )),
        "{out}"
    );
    assert_eq!(http_get(node.admin, "/ready").unwrap().0, 200);
}
