//! The connection helpers every listener protocol uses between accept and routing: a
//! connection's state ([`Conn`]), reads into its buffer under the handshake deadline until a
//! parser completes (never past a cap), rejections, and linking a route's backend (a route
//! with `sendProxyProtocol` gets a PROXY header in front of the first bytes replayed to its
//! backend). It never decides which protocol serves a connection (`dispatch` does) and never
//! parses bytes itself.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpStream;
use tokio::time::Instant;

use super::Shared;
use crate::net::dial::{Dest, Dialer};
use crate::net::relay::Leg;
use crate::net::socket::normalize;
use crate::net::stream::{ClientStream, READ_CHUNK, read_appending};
use crate::route::Route;
use crate::serve::forward::{self, Linked, Reply, Routed};
use crate::serve::record::{ConnRecord, Outcome};
use crate::serve::tracker::ConnGuard;
use crate::wire::Parsed;
use crate::wire::http::{self, RequestHead};
use crate::wire::proxy::{self, ProxyInfo};
use crate::wire::tls::{self, ClientHello};

/// A connection between accept and routing, over its client stream `S`: the accepted
/// socket, or a stream over it (TLS) for a listener that terminates one.
pub(super) struct Conn<S> {
    /// The client stream.
    pub stream: S,
    /// Bytes read and not yet consumed by an earlier stage.
    pub buf: Vec<u8>,
    /// Handshake deadline: everything before routing must finish by then.
    pub deadline: Instant,
    /// The connection's record (access log and metrics).
    pub record: ConnRecord,
    /// Keeps the connection counted.
    pub guard: ConnGuard,
    /// The client address routes' `allowedSourceRanges` are matched against: the PROXY
    /// source from a trusted load balancer, else the peer. Never a listener's own header
    /// (`proxy-destination`), whose source the client writes itself. Also the source of a
    /// PROXY header sent to backends.
    pub source: SocketAddr,
    /// The destination of the last PROXY header received (a load balancer's, then a
    /// `proxy-destination` listener's): the address the client reached, for a PROXY header
    /// sent to backends. `None`: the listener socket's own address.
    pub destination: Option<SocketAddr>,
}

/// Why a stage could not read what it needs.
pub(super) enum ReadError<E> {
    /// The client closed (or reset) first, after sending `bytes`.
    Closed {
        /// Bytes received in this stage.
        bytes: usize,
    },
    /// The handshake deadline passed.
    Timeout,
    /// The parser rejected the bytes.
    Reject(E),
}

impl<S: Leg> Conn<S> {
    /// Reads until `parse` completes on the buffered bytes, reading at most `max` bytes in
    /// all. Returns the value and how many buffered bytes it consumed.
    pub(super) async fn read_until<T, E>(
        &mut self,
        max: usize,
        parse: impl Fn(&[u8]) -> Result<Parsed<T>, E>,
    ) -> Result<(T, usize), ReadError<E>> {
        loop {
            if !self.buf.is_empty() {
                match parse(&self.buf) {
                    Ok(Parsed::Complete { value, consumed }) => return Ok((value, consumed)),
                    Ok(Parsed::Incomplete) => {}
                    Err(e) => return Err(ReadError::Reject(e)),
                }
            }
            self.read_more(max).await?;
        }
    }

    /// Reads once more into the buffer (never past `max` bytes buffered). The buffer grows
    /// by what arrived, not by a read's worth: a client that sends a few bytes and then
    /// waits holds a few bytes, not a 4 KiB buffer, until its deadline.
    async fn read_more<E>(&mut self, max: usize) -> Result<(), ReadError<E>> {
        let room = max.saturating_sub(self.buf.len()).min(READ_CHUNK);
        if room == 0 {
            // Parsers reject before their cap; this is a guard, not a path.
            return Err(ReadError::Closed {
                bytes: self.buf.len(),
            });
        }
        let start = self.buf.len();
        let read = tokio::time::timeout_at(
            self.deadline,
            read_appending(&mut self.stream, &mut self.buf, room),
        )
        .await;
        let n = match read {
            Ok(Ok(n)) => n,
            Ok(Err(_)) => 0,
            Err(_) => return Err(ReadError::Timeout),
        };
        if n == 0 {
            return Err(ReadError::Closed { bytes: start });
        }
        Ok(())
    }

    /// Writes `bytes` (an alert or an error response), half-closes, and lets the client read
    /// them before the stream closes.
    pub(super) async fn reject_with(&mut self, bytes: &[u8]) {
        forward::reject_with(&mut self.stream, bytes).await;
    }

    /// Reads a ClientHello of at most `max` bytes and leaves it in the buffer (every byte
    /// read goes on, to a backend or into a TLS handshake); its size is observed.
    pub(super) async fn client_hello(&mut self, max: usize) -> Result<ClientHello, Refusal> {
        match self
            .read_until(max, |b| tls::parse_client_hello(b, max))
            .await
        {
            Ok((hello, consumed)) => {
                self.record
                    .listener_metrics()
                    .client_hello_bytes
                    .observe(consumed as f64);
                Ok(hello)
            }
            Err(ReadError::Closed { bytes }) => Err(Refusal::closed(bytes)),
            Err(ReadError::Reject(r)) => Err(Refusal {
                outcome: if r == tls::Reject::NotTls {
                    Outcome::NotTls
                } else {
                    Outcome::BadRequest
                },
                detail: r.to_string(),
                status: None,
            }),
            Err(ReadError::Timeout) => Err(Refusal {
                outcome: Outcome::Timeout,
                detail: "no complete ClientHello in time".into(),
                status: None,
            }),
        }
    }

    /// Reads an HTTP request head of at most `max` bytes: the head and how many buffered
    /// bytes it took (not consumed).
    pub(super) async fn request_head(
        &mut self,
        max: usize,
    ) -> Result<(RequestHead, usize), Refusal> {
        match self
            .read_until(max, |b| http::parse_request_head(b, max))
            .await
        {
            Ok(x) => Ok(x),
            Err(ReadError::Closed { bytes }) => Err(Refusal::closed(bytes)),
            Err(ReadError::Timeout) => Err(Refusal {
                outcome: Outcome::Timeout,
                detail: "no request head in time".into(),
                status: Some(408),
            }),
            Err(ReadError::Reject(r)) => Err(Refusal {
                outcome: Outcome::BadRequest,
                detail: r.to_string(),
                status: Some(r.status()),
            }),
        }
    }

    /// Ends the connection with `refusal`: its status answered (if any), counted, logged.
    /// `None`, like [`Conn::reject`].
    pub(super) async fn refuse<R>(mut self: Box<Self>, refusal: Refusal) -> Option<R> {
        if let Some(status) = refusal.status {
            self.reject_with(&http::response(status, &refusal.detail))
                .await;
        }
        self.reject(refusal.outcome, &refusal.detail)
    }
}

/// Why a stage ended a connection before routing.
#[derive(Debug)]
pub(super) struct Refusal {
    /// What it is counted as.
    pub outcome: Outcome,
    /// For the debug log (and the body of `status`: it names no address).
    pub detail: String,
    /// The HTTP status to answer, on listeners that speak HTTP.
    pub status: Option<u16>,
}

impl Refusal {
    /// The client closed after sending `bytes`.
    fn closed(bytes: usize) -> Refusal {
        Refusal {
            outcome: Outcome::ClosedEarly,
            detail: format!("client closed after {bytes} bytes"),
            status: None,
        }
    }
}

impl<S> Conn<S> {
    /// Drops the first `n` buffered bytes (consumed by a stage).
    pub(super) fn consume(&mut self, n: usize) {
        self.buf.drain(..n);
    }

    /// Takes the connection apart and frees its box (in a plain function: a box moved out
    /// of inside an async fn stays allocated until that future ends).
    #[expect(clippy::boxed_local, reason = "callers hold the connection boxed")]
    fn into_parts(
        self: Box<Self>,
    ) -> (
        S,
        Vec<u8>,
        ConnRecord,
        ConnGuard,
        SocketAddr,
        Option<SocketAddr>,
    ) {
        let Conn {
            stream,
            buf,
            record,
            guard,
            source,
            destination,
            ..
        } = *self;
        (stream, buf, record, guard, source, destination)
    }

    /// The client stream, the bytes buffered from it, its record and its guard: for a
    /// connection the gateway serves itself rather than links to a backend.
    pub(super) fn into_stream(self: Box<Self>) -> (S, Vec<u8>, ConnRecord, ConnGuard) {
        let (stream, buf, record, guard, ..) = self.into_parts();
        (stream, buf, record, guard)
    }

    /// Rejects the connection before routing: counts `outcome`, logs, closes. `None`, for
    /// a stage's `return`: nothing to relay.
    #[expect(clippy::boxed_local, reason = "callers hold the connection boxed")]
    pub(super) fn reject<R>(self: Box<Self>, outcome: Outcome, detail: &str) -> Option<R> {
        let Conn { record, .. } = *self;
        record.reject(outcome, detail);
        None
    }

    /// Refuses a client that `route` does not admit: counts `denied`, logs, closes. `None`,
    /// like [`Conn::reject`].
    #[expect(clippy::boxed_local, reason = "callers hold the connection boxed")]
    pub(super) fn deny<R>(self: Box<Self>, route: Arc<Route>) -> Option<R> {
        let Conn { record, .. } = *self;
        record.deny(route);
        None
    }
}

impl<S: ClientStream> Conn<S> {
    /// Links the connection on `route` to `to` (the route's backends, or an explicit
    /// address) with the gateway's dialer: dial, reply (and, for a forwarded CONNECT, have
    /// the head accepted). `None` when it ended there; else the caller relays it.
    pub(super) async fn link(
        self: Box<Self>,
        route: &Arc<Route>,
        to: Dest<'_>,
        reply: Reply,
        shared: &Shared,
    ) -> Option<Ready<S>> {
        self.link_with(route, to, reply, shared, &shared.dialer)
            .await
    }

    /// [`Conn::link`] with another dialer (egress through a tunnel).
    pub(super) async fn link_with<D: Dialer>(
        self: Box<Self>,
        route: &Arc<Route>,
        to: Dest<'_>,
        mut reply: Reply,
        shared: &Shared,
        dialer: &D,
    ) -> Option<Ready<S, D::Stream>> {
        let cfg = &shared.config;
        let (stream, mut buf, record, guard, source, destination) = self.into_parts();
        if let Some(version) = route.send_proxy_protocol {
            // In front of the replayed bytes: the relay writes header and first bytes at once.
            let destination = destination.unwrap_or_else(|| {
                stream
                    .local_addr()
                    .map(normalize)
                    // Not seen on a connected socket; the header still carries the client.
                    .unwrap_or_else(|_| SocketAddr::new(unspecified(source), 0))
            });
            let mut out = proxy::encode(version, source, destination);
            if let Reply::HttpForwarded(f) = &mut reply {
                // The header goes with the request head, before the backend's answer.
                f.head += out.len();
            }
            out.extend_from_slice(&buf);
            buf = out;
        }
        let routed = Routed {
            client: stream,
            // Written first and then freed: an idle connection keeps no ClientHello or
            // request head around.
            to_backend: buf,
            record,
            guard,
            route,
            to,
            limits: crate::net::relay::Limits {
                idle: route.timeouts.idle.unwrap_or(cfg.timeouts.idle),
                half_close: cfg.timeouts.half_close,
                max_duration: route.max_connection_duration,
                progress: cfg.access_log.interval,
            },
        };
        forward::link(routed, dialer, reply).await
    }
}

/// A gateway connection ready to relay: its client stream `S` (the accepted socket unless
/// named) and its backend stream `B` (a kernel socket unless named).
pub(super) type Ready<S = TcpStream, B = TcpStream> = Linked<S, B>;

/// The metric result for a parsed header.
pub(super) fn header_result(info: &ProxyInfo) -> &'static str {
    match (info.addresses, info.version) {
        (None, _) => "local",
        (Some(_), 1) => "v1",
        (Some(_), _) => "v2",
    }
}

/// The unspecified address of `addr`'s family.
fn unspecified(addr: SocketAddr) -> std::net::IpAddr {
    match addr {
        SocketAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
    }
}

/// A rejection: downstream outcome, proxy-header metric result (if any), detail.
pub(super) type StageReject = (Outcome, Option<&'static str>, String);

/// Maps a failed PROXY header read to a rejection (shared with `proxy-destination`).
pub(super) fn proxy_stage_error(e: ReadError<proxy::Reject>) -> StageReject {
    match e {
        ReadError::Closed { bytes: 0 } => (
            Outcome::ClosedEarly,
            None,
            "closed without sending anything".into(),
        ),
        ReadError::Closed { bytes } => (
            Outcome::ClosedEarly,
            Some("invalid"),
            format!("closed after {bytes} bytes of a PROXY header"),
        ),
        ReadError::Timeout => (
            Outcome::Timeout,
            Some("timeout"),
            "no PROXY header in time".into(),
        ),
        ReadError::Reject(r) => (Outcome::BadRequest, Some(r.kind()), r.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio_rustls::server::TlsStream;

    use super::*;
    use crate::admin::Metrics;
    use crate::gateway::table::Tables;
    use crate::net::IpFamily;
    use crate::net::dial::Direct;
    use crate::route::BackendAddress;
    use crate::wire::http;

    impl Leg for TlsStream<TcpStream> {}

    impl ClientStream for TlsStream<TcpStream> {
        fn local_addr(&self) -> std::io::Result<SocketAddr> {
            self.get_ref().0.local_addr()
        }
    }

    /// What a gateway's connections share, with an empty routing table.
    fn shared(name: &str) -> Shared {
        let dir = std::env::temp_dir().join(format!("trellis-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let routes = dir.join("routes.yaml");
        std::fs::write(
            &routes,
            "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\nroutes: []\n",
        )
        .unwrap();
        let config = crate::config::parse::<crate::config::gateway::GatewayConfig>(
            &dir.join("gateway.yaml"),
            b"apiVersion: trellis.gardener.cloud/v1alpha1
kind: GatewayConfiguration
routes: {file: routes.yaml}
listeners:
- {name: plain, address: \"127.0.0.1:1\", protocol: http-connect}
admin: {address: \"127.0.0.1:2\"}
",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let metrics = Arc::new(Metrics::gateway());
        let metrics_for_certs = metrics.clone();
        let tables = Arc::new(Tables::load(&routes, metrics.clone()).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
        Shared {
            dialer: Direct {
                zone: None,
                connect_timeout: config.timeouts.connect,
                keepalive: (Duration::from_secs(60), Duration::from_secs(10)),
                family: IpFamily::Any,
                resolver: crate::net::resolve::Resolver::for_tests(),
            },
            destination_headers: Vec::new(),
            config,
            metrics,
            tables,
            drain: Default::default(),
            certs: Arc::new(crate::gateway::certs::Certs::new([], metrics_for_certs).unwrap()),
            tunnels: None,
            connect_destination: None,
        }
    }

    /// A TLS server and client configuration for `egress.test`.
    fn tls_configs() -> (tokio_rustls::TlsAcceptor, tokio_rustls::TlsConnector) {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let ck = rcgen::generate_simple_self_signed(vec!["egress.test".to_string()]).unwrap();
        let key =
            rustls::pki_types::PrivateKeyDer::try_from(ck.signing_key.serialize_der()).unwrap();
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![ck.cert.der().clone()], key)
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ck.cert.der().clone()).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        (
            tokio_rustls::TlsAcceptor::from(Arc::new(server)),
            tokio_rustls::TlsConnector::from(Arc::new(client)),
        )
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
    }

    /// A connection over a stream that is not a socket (the server side of a TLS session)
    /// goes through the pipeline's stages: the CONNECT head is read from inside TLS, the
    /// connection is linked to the head's own address on a route without backends, the
    /// client gets exactly the `200` head, and the relay carries every byte both ways (the
    /// bytes the client sent right behind the head first), half-closes included.
    #[tokio::test]
    async fn a_connect_inside_tls_is_linked_to_its_own_address() {
        let shared = shared("conn-tls");
        let (acceptor, connector) = tls_configs();
        let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = backend.local_addr().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gateway_addr = listener.local_addr().unwrap();
        let (up, down) = (pattern(1 << 20, 0x21), pattern(3 << 19, 0x42));
        let early = b"sent right behind the head".to_vec();

        let gateway = async {
            let (tcp, peer) = listener.accept().await.unwrap();
            let stream = acceptor.accept(tcp).await.unwrap();
            let record = ConnRecord::new(
                shared.metrics.clone(),
                Arc::new(shared.metrics.listener("egress")),
                peer,
                std::time::Instant::now(),
            );
            let mut conn = Box::new(Conn {
                stream,
                buf: Vec::new(),
                deadline: Instant::now() + Duration::from_secs(10),
                record,
                guard: shared.drain.tracker.admit(10).unwrap(),
                source: peer,
                destination: None,
            });
            let max = shared.config.limits.max_header_bytes;
            let Ok((head, consumed)) = conn
                .read_until(max, |b| http::parse_request_head(b, max))
                .await
            else {
                panic!("no request head");
            };
            assert_eq!(head.method, "CONNECT");
            conn.consume(consumed);
            let address = BackendAddress::Ip(head.target.parse().unwrap());
            let route =
                Arc::new(Route::new::<&str, &str>("egress", &[], &[], vec![], vec![]).unwrap());
            let ready = conn
                .link(&route, Dest::Address(&address), Reply::Http, &shared)
                .await
                .expect("linked");
            ready.relay(&shared.drain.hard_stop).await;
        };
        let client = async {
            let tcp = TcpStream::connect(gateway_addr).await.unwrap();
            let name = rustls::pki_types::ServerName::try_from("egress.test").unwrap();
            let mut tls = connector.connect(name, tcp).await.unwrap();
            let mut first =
                format!("CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").into_bytes();
            first.extend_from_slice(&early);
            tls.write_all(&first).await.unwrap();
            let answer = b"HTTP/1.1 200 Connection established\r\n\r\n";
            let mut got = vec![0u8; answer.len()];
            tls.read_exact(&mut got).await.unwrap();
            assert_eq!(got, answer);
            let (mut r, mut w) = tokio::io::split(tls);
            let send = async {
                w.write_all(&up).await.unwrap();
                w.shutdown().await.unwrap();
            };
            let receive = async {
                let mut got = Vec::new();
                r.read_to_end(&mut got).await.unwrap();
                got
            };
            tokio::join!(send, receive).1
        };
        let serve = async {
            let (mut s, _) = backend.accept().await.unwrap();
            let (mut r, mut w) = s.split();
            let receive = async {
                let mut got = Vec::new();
                r.read_to_end(&mut got).await.unwrap();
                got
            };
            let send = async {
                w.write_all(&down).await.unwrap();
                w.shutdown().await.unwrap();
            };
            tokio::join!(receive, send).0
        };
        let ((), got_down, got_up) = tokio::time::timeout(Duration::from_secs(30), async {
            tokio::join!(gateway, client, serve)
        })
        .await
        .expect("the connection ends");
        assert!(
            got_up[..early.len()] == early[..],
            "the early bytes go first"
        );
        assert!(
            got_up[early.len()..] == up[..],
            "bytes to the backend differ"
        );
        assert!(got_down == down, "bytes to the client differ");
    }
}
