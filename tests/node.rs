//! `trellis node` on loopback, without root: no managed address, a real gateway behind it.
//! Bytes cross the node's CONNECT tunnel unchanged, TCP urgent data included, in both
//! directions.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![allow(clippy::unwrap_used, unreachable_pub)]

mod common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const DEST: &str = "outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local";

/// A running node process, killed on drop.
struct Node {
    child: Child,
    listen: SocketAddr,
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
        let node = Node { child, listen, dir };
        let ready = wait_for(Duration::from_secs(20), || {
            matches!(http_get(admin, "/ready"), Some((200, _))).then_some(())
        });
        assert!(ready.is_some(), "node not ready:\n{}", node.logs());
        node
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(self.dir.path("node.log")).unwrap_or_default()
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

/// 2 MiB, an urgent `!`, 2 MiB: past the relay's splice threshold before the urgent byte.
async fn send_with_urgent_byte(s: &mut TcpStream, fill: u8) {
    let bulk = vec![fill; 2 << 20];
    s.write_all(&bulk).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        socket2::SockRef::from(&*s).send_out_of_band(b"!").unwrap(),
        1
    );
    s.write_all(&bulk).await.unwrap();
}

/// A client's urgent byte crosses the node and the gateway in place.
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
    send_with_urgent_byte(&mut s, b'x').await;
    s.shutdown().await.unwrap();
    let got = read_all(&mut s, Duration::from_secs(20)).await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&got),
        format!("{} Some({})", (4 << 20) + 1, 2 << 20),
        "every byte, the urgent one in place\n{}",
        node.logs()
    );
}

/// A backend's urgent byte reaches the client through the gateway and the node in place.
#[tokio::test(flavor = "multi_thread")]
async fn a_backends_urgent_data_crosses_the_node_inline() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        send_with_urgent_byte(&mut s, b'y').await;
        s.shutdown().await.unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest).await;
    });
    let gw = gateway_to(backend);
    let node = Node::start(gw.addr("connect"));
    let mut s = TcpStream::connect(node.listen).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut got))
        .await
        .expect("the download ends")
        .unwrap();
    let urgent_at = got.iter().position(|&b| b == b'!');
    assert_eq!(
        (got.len(), urgent_at),
        ((4 << 20) + 1, Some(2 << 20)),
        "every byte, the urgent one in place\n{}",
        node.logs()
    );
}
