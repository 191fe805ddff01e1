//! TCP urgent data for the tests: a burst that ends in an urgent byte and arrives in one
//! segment, and the check that all of it arrived with the urgent byte in place; and the
//! wait for a flow to be spliced, before an urgent byte comes.
//!
//! A read stops at the urgent mark (the kernel ends it before the urgent byte). A relay that
//! then takes the socket for drained is never woken again for the urgent byte: it came in
//! the same segment as the bytes before it, and the sender adds nothing until the receiver
//! has the whole burst. So a burst that does not arrive whole within the time limit is a
//! relay stalled at the mark.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The urgent byte.
pub(crate) const URGENT: u8 = b'!';
/// How long a burst may take to arrive.
const LIMIT: Duration = Duration::from_secs(5);
/// Bytes sent each way once the urgent bytes crossed: the streams go on past them.
pub(crate) const BULK: usize = 200_000;

/// Sends `prefix`, `before` bytes of `fill` and the urgent byte corked: they leave as one
/// segment (the urgent byte pushes it out), so the receiver finds them queued together.
pub(crate) fn send_burst(s: &TcpStream, prefix: &[u8], fill: u8, before: usize) {
    let sock = socket2::SockRef::from(s);
    sock.set_tcp_cork(true).unwrap();
    let mut head = prefix.to_vec();
    head.resize(prefix.len() + before, fill);
    assert_eq!(sock.send(&head).unwrap(), head.len());
    assert_eq!(sock.send_out_of_band(&[URGENT]).unwrap(), 1);
    sock.set_tcp_cork(false).unwrap();
}

/// Reads a burst that [`send_burst`] sent (past its prefix): `before` bytes of `fill` and
/// the urgent byte. `Err` says what came instead, or where it stalled.
pub(crate) async fn read_burst(s: &mut TcpStream, fill: u8, before: usize) -> Result<(), String> {
    let mut got = vec![0u8; before + 1];
    let mut n = 0;
    let read = tokio::time::timeout(LIMIT, async {
        while n < got.len() {
            match s.read(&mut got[n..]).await {
                Ok(0) => return Err("end of stream".to_string()),
                Ok(k) => n += k,
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    })
    .await;
    match read {
        Err(_) => return Err(format!("stalled after {n} of {} bytes", got.len())),
        Ok(Err(e)) => return Err(format!("{e} after {n} of {} bytes", got.len())),
        Ok(Ok(())) => {}
    }
    let mut want = vec![fill; before];
    want.push(URGENT);
    if got != want {
        let urgent_at = got.iter().position(|&b| b == URGENT);
        return Err(format!(
            "bytes differ (urgent byte at {urgent_at:?}, not {before})"
        ));
    }
    Ok(())
}

/// [`BULK`] bytes each way between the two ends of a relayed connection, then half-closes:
/// every byte arrives.
pub(crate) async fn bulk_both_ways(client: &mut TcpStream, server: &mut TcpStream) {
    async fn send_and_read(s: &mut TcpStream, fill: u8) -> Vec<u8> {
        let (mut r, mut w) = s.split();
        let send = async {
            w.write_all(&vec![fill; BULK]).await.unwrap();
            w.shutdown().await.unwrap();
        };
        let read = async {
            let mut got = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), r.read_to_end(&mut got))
                .await
                .expect("the stream ends")
                .unwrap();
            got
        };
        tokio::join!(send, read).1
    }
    let (down, up) = tokio::join!(send_and_read(client, b'u'), send_and_read(server, b'd'));
    assert!(up == vec![b'u'; BULK], "upload: {} bytes", up.len());
    assert!(down == vec![b'd'; BULK], "download: {} bytes", down.len());
}

/// Waits until `logs` (a process's JSON log) show its relay splicing the flow it reads from
/// `from` (`client` or `backend`): the flow is a spliced bulk flow before its urgent byte.
pub(crate) async fn spliced(logs: impl Fn() -> String, from: &str) {
    let limit = Instant::now() + Duration::from_secs(20);
    let field = format!("\"from\":\"{from}\"");
    while !logs()
        .lines()
        .any(|l| l.contains("\"message\":\"splicing a bulk flow\"") && l.contains(&field))
    {
        assert!(
            Instant::now() < limit,
            "the flow from the {from} was never spliced"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
