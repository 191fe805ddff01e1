//! A stream with bytes already read from it put back in front: a reader gets those bytes
//! first, then the stream's own. Writes go straight to the stream. This is how a TLS
//! handshake starts on a connection whose ClientHello (and PROXY header) the gateway has
//! already read to choose a route. The replayed bytes are freed once read.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `inner` with `prefix` read first.
#[derive(Debug)]
pub struct Prefixed<S> {
    prefix: Vec<u8>,
    /// How much of `prefix` has been read.
    read: usize,
    inner: S,
}

impl<S> Prefixed<S> {
    /// `inner`, whose reads start with `prefix`.
    pub fn new(prefix: Vec<u8>, inner: S) -> Self {
        Prefixed {
            prefix,
            read: 0,
            inner,
        }
    }

    /// The stream (any replayed bytes not yet read are lost).
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// The stream.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.read < this.prefix.len() {
            let rest = &this.prefix[this.read..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.read += n;
            if this.read == this.prefix.len() {
                this.prefix = Vec::new();
                this.read = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn replays_then_reads_on_and_writes_through() {
        let (a, mut b) = tokio::io::duplex(64);
        let mut p = Prefixed::new(b"hello ".to_vec(), a);
        b.write_all(b"world").await.unwrap();
        drop(b.shutdown().await);
        let mut small = [0u8; 4];
        // A read smaller than the prefix takes part of it.
        p.read_exact(&mut small).await.unwrap();
        assert_eq!(&small, b"hell");
        let mut rest = Vec::new();
        p.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"o world");
        p.write_all(b"back").await.unwrap();
        let mut got = [0u8; 4];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"back");
    }
}
