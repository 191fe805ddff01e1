//! A tunneled TCP stream as a relay leg: reads and writes go straight into the shoot's
//! smoltcp socket under the shoot's lock, and whatever the stack sends as a result (data,
//! window updates, FIN) is encrypted and sent before the call returns. smoltcp's wakers wake
//! the task when the socket changes.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use smoltcp::iface::SocketHandle;
use smoltcp::socket::tcp;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::device::{ShootCell, lock};
use super::failover::DialError;
use super::shared::Inner;
use crate::net::relay::{Leg, ROUTE_REMOVED};

/// Per-stream metric handles.
#[derive(Debug, Clone)]
pub(crate) struct StreamMetrics {
    /// Bytes from the shoot.
    pub(crate) rx: Counter,
    /// Bytes into the shoot.
    pub(crate) tx: Counter,
    /// Streams open in this route.
    pub(crate) active: Gauge,
}

/// One tunneled stream.
pub(crate) struct TunnelStream {
    pub(crate) shoot: ShootCell,
    pub(crate) handle: SocketHandle,
    pub(crate) inner: Arc<Inner>,
    pub(crate) metrics: StreamMetrics,
    /// Whether this end sent its FIN.
    shut: bool,
}

impl std::fmt::Debug for TunnelStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelStream")
            .field("handle", &self.handle)
            .finish()
    }
}

fn removed() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, ROUTE_REMOVED)
}

impl TunnelStream {
    pub(crate) fn new(
        shoot: ShootCell,
        handle: SocketHandle,
        inner: Arc<Inner>,
        metrics: StreamMetrics,
    ) -> TunnelStream {
        metrics.active.inc();
        TunnelStream {
            shoot,
            handle,
            inner,
            metrics,
            shut: false,
        }
    }
}

impl AsyncRead for TunnelStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let mut s = lock(&this.shoot);
        if s.removed || s.stack.flow(this.handle).is_some_and(|f| f.killed) {
            return Poll::Ready(Err(removed()));
        }
        let sock = s.stack.socket(this.handle);
        if sock.can_recv() {
            let n = match sock.recv_slice(buf.initialize_unfilled()) {
                Ok(n) => n,
                Err(_) => return Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
            };
            buf.advance(n);
            this.metrics.rx.inc_by(n as u64);
            // The window opened: let the stack say so.
            s.flush(Instant::now(), &mut this.inner.io());
            return Poll::Ready(Ok(()));
        }
        match sock.state() {
            tcp::State::Established
            | tcp::State::FinWait1
            | tcp::State::FinWait2
            | tcp::State::SynSent
            | tcp::State::SynReceived => {
                sock.register_recv_waker(cx.waker());
                Poll::Pending
            }
            tcp::State::Closed if !this.shut => {
                Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()))
            }
            // The shoot sent its FIN (or the connection closed after ours).
            _ => Poll::Ready(Ok(())),
        }
    }
}

impl AsyncWrite for TunnelStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let mut s = lock(&this.shoot);
        if s.removed || s.stack.flow(this.handle).is_some_and(|f| f.killed) {
            return Poll::Ready(Err(removed()));
        }
        let sock = s.stack.socket(this.handle);
        if !sock.may_send() {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        if !sock.can_send() {
            sock.register_send_waker(cx.waker());
            return Poll::Pending;
        }
        let n = match sock.send_slice(data) {
            Ok(n) => n,
            Err(_) => return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
        };
        this.metrics.tx.inc_by(n as u64);
        s.flush(Instant::now(), &mut this.inner.io());
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let mut s = lock(&this.shoot);
        this.shut = true;
        s.stack.socket(this.handle).close();
        s.flush(Instant::now(), &mut this.inner.io());
        Poll::Ready(Ok(()))
    }
}

impl TunnelStream {
    /// Waits until the connection is established: `Refused` when it was reset (or closed)
    /// first, `RouteRemoved` when its route or peer went away.
    pub(crate) async fn established(&self) -> Result<(), DialError> {
        std::future::poll_fn(|cx| self.poll_established(cx)).await
    }

    /// [`TunnelStream::established`] as a poll (a dial waits on several at once).
    pub(crate) fn poll_established(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Result<(), DialError>> {
        let mut s = lock(&self.shoot);
        if s.removed || s.stack.flow(self.handle).is_some_and(|f| f.killed) {
            return Poll::Ready(Err(DialError::RouteRemoved));
        }
        let sock = s.stack.socket(self.handle);
        match sock.state() {
            tcp::State::SynSent | tcp::State::SynReceived | tcp::State::Listen => {
                sock.register_send_waker(cx.waker());
                Poll::Pending
            }
            tcp::State::Closed => Poll::Ready(Err(DialError::Refused)),
            _ => Poll::Ready(Ok(())),
        }
    }
}

impl Leg for TunnelStream {}

impl Drop for TunnelStream {
    fn drop(&mut self) {
        self.metrics.active.dec();
        let mut s = lock(&self.shoot);
        let now = Instant::now();
        // Not shut down by the relay: it ended on an error, a timeout or a drain, and the
        // shoot side is told with a reset rather than a clean FIN.
        s.stack.release(self.handle, !self.shut, now);
        s.flush(now, &mut self.inner.io());
    }
}
