//! What a listener needs of a client stream before routing: reads that append to the
//! connection's own buffer by what arrived ([`read_appending`]), and the address the client
//! connected to ([`ClientStream`]).
//!
//! A slow client holds only the bytes it sent, never a read buffer: a kernel TCP socket is
//! waited on for readiness without any buffer and then read through a per-thread scratch
//! buffer; any other stream (TLS over a socket, a user-space stack's socket) is polled with
//! `poll_read` into that same scratch buffer, which is borrowed only within one poll.
//! Nothing here parses the bytes.

use std::cell::RefCell;
use std::future::poll_fn;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::TcpStream;

use super::relay::Leg;

/// Most bytes one read appends.
pub(crate) const READ_CHUNK: usize = 4096;

thread_local! {
    /// Where reads before routing land before they are appended to their connection's
    /// buffer; one per worker thread, as a connection never changes threads.
    static SCRATCH: RefCell<[u8; READ_CHUNK]> = const { RefCell::new([0; READ_CHUNK]) };
}

/// A client stream a listener serves: any relay [`Leg`] that knows where the client
/// connected to.
pub(crate) trait ClientStream: Leg + Send {
    /// The address the client connected to: a PROXY header sent to a backend carries it as
    /// its destination when no earlier header named one.
    fn local_addr(&self) -> io::Result<SocketAddr>;
}

impl ClientStream for TcpStream {
    fn local_addr(&self) -> io::Result<SocketAddr> {
        TcpStream::local_addr(self)
    }
}

/// Waits until `stream` has bytes, then appends at most `room` of them (and at most
/// [`READ_CHUNK`]) to `buf`. Returns how many (0: end of stream, or no room).
pub(crate) async fn read_appending<S: Leg + ?Sized>(
    stream: &mut S,
    buf: &mut Vec<u8>,
    room: usize,
) -> io::Result<usize> {
    let room = room.min(READ_CHUNK);
    if room == 0 {
        return Ok(0);
    }
    if let Some(tcp) = stream.as_tcp() {
        return read_socket(tcp, buf, room).await;
    }
    poll_fn(|cx| poll_read_appending(Pin::new(&mut *stream), cx, buf, room)).await
}

/// A kernel socket: readiness first, so no buffer is held while the client is silent.
async fn read_socket(stream: &TcpStream, buf: &mut Vec<u8>, room: usize) -> io::Result<usize> {
    loop {
        stream.readable().await?;
        let read = SCRATCH.with_borrow_mut(|scratch| {
            let n = stream.try_read(&mut scratch[..room])?;
            buf.extend_from_slice(&scratch[..n]);
            Ok::<_, io::Error>(n)
        });
        match read {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            other => return other,
        }
    }
}

/// Any other stream: one `poll_read` into the scratch buffer, whose bytes are appended
/// before the poll returns.
fn poll_read_appending<S: AsyncRead + ?Sized>(
    stream: Pin<&mut S>,
    cx: &mut Context<'_>,
    buf: &mut Vec<u8>,
    room: usize,
) -> Poll<io::Result<usize>> {
    SCRATCH.with_borrow_mut(|scratch| {
        let mut read = ReadBuf::new(&mut scratch[..room]);
        ready!(stream.poll_read(cx, &mut read))?;
        buf.extend_from_slice(read.filled());
        Poll::Ready(Ok(read.filled().len()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A stream that is not a socket grows the buffer by what arrived, never past `room`,
    /// and reads end of stream as 0.
    #[tokio::test]
    async fn a_stream_that_is_not_a_socket_appends_what_arrived() {
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        let mut buf = b"held".to_vec();
        client.write_all(b"abc").await.unwrap();
        assert_eq!(read_appending(&mut server, &mut buf, 100).await.unwrap(), 3);
        assert_eq!(buf, b"heldabc");
        assert!(
            buf.capacity() < 64,
            "grew by what arrived, not by a read's worth"
        );
        client.write_all(&[7; 10_000]).await.unwrap();
        assert_eq!(read_appending(&mut server, &mut buf, 5).await.unwrap(), 5);
        assert_eq!(&buf[7..], &[7; 5]);
        let n = read_appending(&mut server, &mut buf, usize::MAX)
            .await
            .unwrap();
        assert_eq!(n, READ_CHUNK, "one read takes at most a chunk");
        drop(client);
        let mut rest = Vec::new();
        while read_appending(&mut server, &mut rest, usize::MAX)
            .await
            .unwrap()
            > 0
        {}
        assert_eq!(rest.len(), 10_000 - 5 - READ_CHUNK);
        assert_eq!(read_appending(&mut server, &mut buf, 100).await.unwrap(), 0);
    }

    /// A kernel socket takes the readiness path and appends the same way.
    #[tokio::test]
    async fn a_socket_appends_what_arrived() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        let mut buf = Vec::new();
        client.write_all(b"hello").await.unwrap();
        assert_eq!(read_appending(&mut server, &mut buf, 3).await.unwrap(), 3);
        assert_eq!(read_appending(&mut server, &mut buf, 3).await.unwrap(), 2);
        assert_eq!(buf, b"hello");
        drop(client);
        assert_eq!(read_appending(&mut server, &mut buf, 3).await.unwrap(), 0);
    }
}
