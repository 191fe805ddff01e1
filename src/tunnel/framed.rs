//! WireGuard over TCP: a TCP stream as one more endpoint of the device. Datagrams arrive
//! framed with a 16-bit big-endian length ([`crate::wire::udp_over_tcp`]) and go through
//! the device exactly as UDP datagrams do, from [`Endpoint::Stream`]; a peer whose last
//! authenticated packet came on the stream is answered on it (roaming works both ways
//! between UDP and streams). Replies are framed into the stream's bounded queue
//! ([`super::queues`]), which its writer drains: a full queue drops the datagram and counts it (`stream_full`), so a slow
//! stream never blocks the device (WireGuard's inner TCP sees a loss, as over UDP). A stream ends when its peer closes it, after `idle`
//! without a byte from it, on an I/O error, when its owner closes it, or when the device
//! closes every stream (the gateway's drain); then it is no endpoint any more.
//!
//! It knows nothing of CONNECT or of who opened the stream: the gateway hands it a stream
//! it answered `200` on, the agent one it dialed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::device::ShootCell;
use super::device::lock;
use super::peer::Endpoint;
use super::queues::{KEEP_IDLE, Queue, Take};
use super::shared::Tunnels;
use super::shoot::{Drop, Io};
use crate::net::relay::{End, IoKind, Stats};
use crate::wire::udp_over_tcp::{self, MAX_FRAME};

/// What a stream's read buffer starts with (and returns to when the traffic goes quiet).
const READ_MIN: usize = 4 * 1024;

/// What a stream's read buffer grows to when reads keep filling it.
const READ_MAX: usize = 128 * 1024;

/// A stream registered as an endpoint of the device, not yet (or no longer) carried. Dropping
/// it removes the endpoint: what the device sends there from then on is dropped
/// (`no_endpoint`), and peers whose endpoint it was have none until they send again.
#[derive(Debug)]
pub(crate) struct StreamEndpoint {
    endpoint: Endpoint,
    queue: Arc<Queue>,
    tunnels: Tunnels,
}

/// Ends a carried stream from outside (the agent's lane leaving a `connect` endpoint).
#[derive(Debug, Clone)]
pub(crate) struct StreamCloser(Arc<Queue>);

impl StreamCloser {
    /// Asks the stream to end; its carry returns [`End::BackendClosed`].
    pub(crate) fn close(&self) {
        self.0.close();
    }
}

impl StreamEndpoint {
    /// The endpoint peers are pointed at.
    pub(crate) fn endpoint(&self) -> Endpoint {
        self.endpoint
    }

    /// A handle that ends the stream.
    pub(crate) fn closer(&self) -> StreamCloser {
        StreamCloser(self.queue.clone())
    }
}

impl std::ops::Drop for StreamEndpoint {
    fn drop(&mut self) {
        let Endpoint::Stream { id, .. } = self.endpoint else {
            return;
        };
        let inner = &self.tunnels.inner;
        inner.streams.remove(id);
        inner.metrics.tcp_endpoints.dec();
        let state = inner.state.load();
        for cell in state.maps.shoots.values() {
            for p in lock(cell).peers.iter_mut() {
                if p.endpoint == Some(self.endpoint) {
                    p.endpoint = None;
                }
                if p.recovery_to == Some(self.endpoint) {
                    p.recovery_to = None;
                }
            }
        }
    }
}

/// What became of a carried stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Carried {
    /// Why it ended: [`End::ClientClosed`] when its peer closed it, [`End::BackendClosed`]
    /// when its owner did, [`End::IdleTimeout`], [`End::Drain`] when the device closed every
    /// stream, or the I/O error.
    pub(crate) end: End,
    /// Bytes read from it (`rx`) and written to it (`tx`), frame headers included.
    pub(crate) stats: Stats,
}

impl Tunnels {
    /// Registers a stream from `peer` as an endpoint (see [`StreamEndpoint`]).
    pub(crate) fn open_stream(&self, peer: SocketAddr) -> StreamEndpoint {
        let (id, queue) = self.inner.streams.open();
        self.inner.metrics.tcp_endpoints.inc();
        StreamEndpoint {
            endpoint: Endpoint::Stream { id, peer },
            queue,
            tunnels: self.clone(),
        }
    }

    /// Ends every stream endpoint (the gateway's drain, once no tunneled stream is left).
    pub(crate) fn close_streams(&self) {
        self.inner.streams.close_all();
    }

    /// Stream endpoints open now.
    #[cfg(test)]
    pub(crate) fn stream_count(&self) -> usize {
        self.inner.streams.len()
    }

    /// Carries `endpoint`'s datagrams over `stream` until it ends (see the module docs).
    /// `early` holds bytes already read from the stream (behind a CONNECT head). With
    /// `authenticate_within`, a stream that has brought no packet a peer's key authenticates
    /// by then ends ([`End::NotAuthenticated`]): whoever can open a CONNECT cannot hold a
    /// stream, or fill its queue with the device's answers, without a peer's key. The
    /// endpoint is gone when this returns.
    pub(crate) async fn carry(
        &self,
        endpoint: StreamEndpoint,
        mut stream: TcpStream,
        early: Vec<u8>,
        idle: Duration,
        authenticate_within: Option<Duration>,
    ) -> Carried {
        let (rx, tx) = (AtomicU64::new(0), AtomicU64::new(0));
        let from = endpoint.endpoint;
        let queue = endpoint.queue.clone();
        let mut closing = self.inner.streams.closing();
        let (mut r, mut w) = stream.split();
        let read = async {
            let mut buf = early;
            buf.reserve(READ_MIN.saturating_sub(buf.len()));
            let mut touched = Vec::new();
            let mut authenticate_by = authenticate_within.map(|d| tokio::time::Instant::now() + d);
            // Whether the last read filled all the room it had, and how much it brought.
            let (mut filled, mut last) = (false, 0);
            loop {
                if self.receive_frames(&mut buf, from, &mut touched) {
                    authenticate_by = None;
                }
                if filled || buf.capacity() == buf.len() {
                    // Reads fill the buffer: let it grow with the traffic (what is left in it
                    // is one partial frame, far shorter than READ_MAX).
                    let grown = (buf.capacity() * 2).clamp(READ_MIN, READ_MAX);
                    buf.reserve(grown.saturating_sub(buf.len()).max(1));
                } else if buf.is_empty() && last < READ_MIN && buf.capacity() > KEEP_IDLE {
                    // The traffic has gone quiet: back to the small buffer.
                    buf = Vec::with_capacity(READ_MIN);
                }
                let room = buf.capacity() - buf.len();
                let by = tokio::time::Instant::now() + idle;
                let by = authenticate_by.map_or(by, |a| a.min(by));
                match tokio::time::timeout_at(by, r.read_buf(&mut buf)).await {
                    Err(_) if authenticate_by.is_some_and(|a| a <= by) => {
                        return End::NotAuthenticated;
                    }
                    Err(_) => return End::IdleTimeout,
                    Ok(Ok(0)) => return End::ClientClosed,
                    Ok(Ok(n)) => {
                        rx.fetch_add(n as u64, Ordering::Relaxed);
                        (filled, last) = (n == room, n);
                    }
                    Ok(Err(e)) => return End::Error(IoKind::of(&e)),
                }
            }
        };
        let write = async {
            let mut out: Vec<u8> = Vec::new();
            loop {
                match queue.take(&mut out) {
                    Take::Closed => return End::BackendClosed,
                    // A push between the check and here left a permit: no wake-up lost.
                    Take::Empty => queue.ready.notified().await,
                    Take::Frames => {
                        if let Err(e) = w.write_all(&out).await {
                            return End::Error(IoKind::of(&e));
                        }
                        tx.fetch_add(out.len() as u64, Ordering::Relaxed);
                        out.clear();
                    }
                }
            }
        };
        let end = tokio::select! {
            end = read => end,
            end = write => end,
            () = queue.closed() => End::BackendClosed,
            _ = closing.wait_for(|c| *c) => End::Drain,
        };
        queue.close();
        drop(endpoint);
        let _ = stream.shutdown().await;
        Carried {
            end,
            stats: Stats {
                rx: rx.into_inner(),
                tx: tx.into_inner(),
            },
        }
    }

    /// Hands every complete frame in `buf` to the device (one batch) and keeps the partial
    /// frame at its end; whether a peer's key authenticated any of them.
    fn receive_frames(
        &self,
        buf: &mut Vec<u8>,
        from: Endpoint,
        touched: &mut Vec<ShootCell>,
    ) -> bool {
        let mut authenticated = false;
        let mut frames = udp_over_tcp::frames(buf, MAX_FRAME);
        let Some(first) = frames.next() else {
            return false;
        };
        let mut batch = self.batch(touched);
        for frame in std::iter::once(first).chain(frames.by_ref()) {
            match frame {
                Ok(datagram) if !datagram.is_empty() => {
                    authenticated |= batch.receive(from, datagram);
                }
                // An empty datagram is no WireGuard message; MAX_FRAME is the format's own
                // cap, so no frame is too large.
                _ => self.inner.io().dropped(Drop::Invalid),
            }
        }
        let used = frames.consumed();
        batch.finish();
        buf.drain(..used);
        authenticated
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use tokio::net::{TcpListener, UdpSocket};

    use super::*;
    use crate::admin::metrics::{ReasonLabel, TunnelMetrics};
    use crate::route::WgKey;
    use crate::tunnel::queues::QUEUE_BYTES;

    fn dropped(m: &TunnelMetrics, reason: &'static str) -> u64 {
        m.dropped.get_or_create(&ReasonLabel { reason }).get()
    }

    /// A stream whose peer stops reading: its queue fills and further datagrams are dropped
    /// and counted at once (the device's send never waits); what was queued arrives whole and
    /// in order once the peer reads, and the queue takes datagrams again. The stream's end
    /// removes the endpoint.
    #[tokio::test]
    async fn a_stream_that_is_not_read_drops_and_counts_instead_of_blocking() {
        let metrics = Arc::new(TunnelMetrics::default());
        let udp = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let t = Tunnels::gateway(udp, WgKey([7; 32]), metrics.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut peer = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, from) = listener.accept().await.unwrap();
        // Small kernel buffers: the queue, not the kernel, holds what is not read.
        socket2::SockRef::from(&server)
            .set_send_buffer_size(8192)
            .unwrap();
        socket2::SockRef::from(&peer)
            .set_recv_buffer_size(8192)
            .unwrap();
        let stream = t.open_stream(from);
        let endpoint = stream.endpoint();
        assert_eq!(t.stream_count(), 1);
        let carry = tokio::spawn({
            let t = t.clone();
            async move {
                t.carry(stream, server, Vec::new(), Duration::from_secs(60), None)
                    .await
            }
        });
        let datagram = |seq: u32| {
            let mut d = vec![0x42u8; 1400];
            d[..4].copy_from_slice(&seq.to_be_bytes());
            d
        };
        let mut accepted = 0u32;
        let start = Instant::now();
        while dropped(&metrics, "stream_full") == 0 {
            assert!(accepted < 100_000, "the queue never filled");
            t.inner.io().send(endpoint, &datagram(accepted));
            if dropped(&metrics, "stream_full") == 0 {
                accepted += 1;
            }
            if accepted.is_multiple_of(32) {
                tokio::task::yield_now().await;
            }
        }
        let filled = start.elapsed();
        // Full: every further send returns at once, dropped and counted.
        let full = Instant::now();
        for _ in 0..1000 {
            t.inner.io().send(endpoint, &datagram(u32::MAX));
        }
        assert!(full.elapsed() < Duration::from_millis(500));
        assert_eq!(dropped(&metrics, "stream_full"), 1001);
        let queued = u64::from(accepted) * 1402;
        // A full queue and the write in progress, and what the kernel's small buffers took.
        let bound = 2 * QUEUE_BYTES as u64 + (256 << 10);
        assert!(
            queued >= QUEUE_BYTES as u64 && queued <= bound,
            "{accepted} datagrams queued in {filled:?}"
        );

        // The peer reads: exactly the accepted datagrams, framed, in order.
        let mut buf = vec![0u8; 1402];
        for seq in 0..accepted {
            peer.read_exact(&mut buf).await.unwrap();
            assert_eq!(&buf[..2], &1400u16.to_be_bytes());
            assert_eq!(buf[2..], datagram(seq)[..], "datagram {seq}");
        }
        t.inner.io().send(endpoint, &datagram(7));
        peer.read_exact(&mut buf).await.unwrap();
        assert_eq!(buf[2..], datagram(7)[..]);

        drop(peer);
        let carried = carry.await.unwrap();
        assert_eq!(carried.end, End::ClientClosed);
        assert_eq!(carried.stats.tx, (u64::from(accepted) + 1) * 1402);
        assert_eq!(t.stream_count(), 0);
        t.inner.io().send(endpoint, &datagram(8));
        assert_eq!(dropped(&metrics, "no_endpoint"), 1);
    }
}
