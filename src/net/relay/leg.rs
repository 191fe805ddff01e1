//! What a relay can carry: any byte stream, with a way to tell that a leg is a kernel TCP
//! socket so that the relay can take its fast path (wait for readiness without holding a
//! buffer, `splice(2)` for bulk flows, urgent data in place).
//!
//! A TLS client stream (egress over mTLS) or a socket of a user-space TCP stack implements
//! [`Leg`] with the default [`Leg::as_tcp`] and is copied through a pooled buffer. A kernel
//! TCP leg is read only through [`super::read`], before the relay as in it: tokio's own
//! reads lose the socket's readiness at TCP urgent data.

use tokio::io::{AsyncRead, AsyncWrite};
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
