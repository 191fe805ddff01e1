//! What a relay can carry: any byte stream, with a way to tell that a leg is a kernel TCP
//! socket so that the relay can take its fast path (wait for readiness without holding a
//! buffer, `splice(2)` for bulk flows, urgent data in place).
//!
//! A TLS client stream (egress over mTLS) or a socket of a user-space TCP stack implements
//! [`Leg`] with the default [`Leg::as_tcp`] and is copied through a pooled buffer. A stream
//! that is one kind or the other per connection is an [`Either`], which is still a kernel
//! socket to the relay when it holds one. A kernel TCP leg is read only through
//! [`super::read`], before the relay as in it: tokio's own reads lose the socket's readiness
//! at TCP urgent data.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// One side of a relayed connection.
pub(crate) trait Leg: AsyncRead + AsyncWrite + Unpin {
    /// The kernel TCP socket this leg is, if it is one. When both legs are, the relay moves
    /// bytes with readiness-driven reads and writes and with `splice(2)`; otherwise it uses
    /// `poll_read`/`poll_write`/`poll_shutdown`.
    fn as_tcp(&self) -> Option<&TcpStream> {
        None
    }
}

impl Leg for TcpStream {
    fn as_tcp(&self) -> Option<&TcpStream> {
        Some(self)
    }
}

impl Leg for tokio::io::DuplexStream {}

impl<T: Leg + ?Sized> Leg for &mut T {
    fn as_tcp(&self) -> Option<&TcpStream> {
        (**self).as_tcp()
    }
}

impl<T: Leg + ?Sized> Leg for Box<T> {
    fn as_tcp(&self) -> Option<&TcpStream> {
        (**self).as_tcp()
    }
}

/// One leg type for two kinds of stream, such as a dialer's kernel socket or user-space
/// stream: each call goes to the stream it holds, [`Leg::as_tcp`] included, so a kernel
/// socket in it keeps the relay's fast path.
#[derive(Debug)]
pub(crate) enum Either<A, B> {
    /// The first kind.
    A(A),
    /// The second kind.
    B(B),
}

impl<A: AsyncRead + Unpin, B: AsyncRead + Unpin> AsyncRead for Either<A, B> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Either::A(a) => Pin::new(a).poll_read(cx, buf),
            Either::B(b) => Pin::new(b).poll_read(cx, buf),
        }
    }
}

impl<A: AsyncWrite + Unpin, B: AsyncWrite + Unpin> AsyncWrite for Either<A, B> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Either::A(a) => Pin::new(a).poll_write(cx, buf),
            Either::B(b) => Pin::new(b).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Either::A(a) => Pin::new(a).poll_write_vectored(cx, bufs),
            Either::B(b) => Pin::new(b).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Either::A(a) => a.is_write_vectored(),
            Either::B(b) => b.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Either::A(a) => Pin::new(a).poll_flush(cx),
            Either::B(b) => Pin::new(b).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Either::A(a) => Pin::new(a).poll_shutdown(cx),
            Either::B(b) => Pin::new(b).poll_shutdown(cx),
        }
    }
}

impl<A: Leg, B: Leg> Leg for Either<A, B> {
    fn as_tcp(&self) -> Option<&TcpStream> {
        match self {
            Either::A(a) => a.as_tcp(),
            Either::B(b) => b.as_tcp(),
        }
    }
}
