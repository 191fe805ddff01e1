//! The relay over real loopback sockets (the TCP path, splice included) and over in-memory
//! streams (the generic path), the latter with tokio's paused clock.

use super::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A connected pair of sockets: (outside end, relay end).
async fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let outside = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (inside, _) = l.accept().await.unwrap();
    (outside, inside)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

/// The metrics a relay updates.
#[derive(Default)]
struct Meters {
    rx: Counter,
    tx: Counter,
    half: Gauge,
}

impl Meters {
    fn counters(&self) -> Counters<'_> {
        Counters {
            rx: &self.rx,
            tx: &self.tx,
            half_closed: &self.half,
        }
    }
}

fn no_progress(_: Stats) {}

/// A relay with nothing to replay and no progress callback.
fn plain<'a>(
    client: &'a mut TcpStream,
    backend: &'a mut TcpStream,
    idle: Duration,
    meters: &'a Meters,
    stop: &'a Stop,
) -> Relay<'a, TcpStream, TcpStream> {
    bare(client, backend, limits(idle), meters, stop)
}

/// A relay over any legs with nothing to replay and no progress callback.
fn bare<'a, C: Leg, B: Leg>(
    client: &'a mut C,
    backend: &'a mut B,
    limits: Limits,
    meters: &'a Meters,
    stop: &'a Stop,
) -> Relay<'a, C, B> {
    relay(
        client,
        backend,
        Vec::new(),
        Vec::new(),
        limits,
        meters.counters(),
        &no_progress,
        stop,
    )
}

fn limits(idle: Duration) -> Limits {
    Limits {
        idle,
        half_close: Duration::from_secs(10),
        max_duration: None,
        progress: None,
    }
}

/// Bulk both ways at once (past the splice threshold), the replayed prefix first, and
/// the client's half-close forwarded while the backend is still sending.
#[tokio::test]
async fn bulk_both_ways_with_replay_and_half_close() {
    let (mut client, mut client_in) = pair().await;
    let (mut backend, mut backend_in) = pair().await;
    let meters = Meters::default();
    let stop = Stop::default();
    let up = pattern(9 << 20, 0x11);
    let down = pattern(7 << 20, 0x22);
    let replay = b"replayed-first".to_vec();

    let relay = {
        let (stop, replay, meters) = (&stop, replay.clone(), &meters);
        async move {
            let result = relay(
                &mut client_in,
                &mut backend_in,
                replay,
                Vec::new(),
                limits(Duration::from_secs(30)),
                meters.counters(),
                &no_progress,
                stop,
            )
            .await;
            // As the gateway does: the sockets close right after, which sends the
            // last FIN (the relay skips the half-close when both directions ended).
            drop((client_in, backend_in));
            result
        }
    };
    let send_up = {
        let up = up.clone();
        async move {
            client.write_all(&up).await.unwrap();
            client.shutdown().await.unwrap();
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.unwrap();
            got
        }
    };
    let serve = {
        let down = down.clone();
        async move {
            let (mut r, mut w) = backend.split();
            let read = async {
                let mut got = Vec::new();
                r.read_to_end(&mut got).await.unwrap();
                got
            };
            let write = async {
                w.write_all(&down).await.unwrap();
                w.shutdown().await.unwrap();
            };
            let (got, ()) = tokio::join!(read, write);
            got
        }
    };
    let ((end, stats), got_down, got_up) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(relay, send_up, serve)
    })
    .await
    .expect("relay finishes");
    let mut want_up = replay.clone();
    want_up.extend(&up);
    assert!(got_up == want_up, "upstream bytes differ");
    assert!(got_down == down, "downstream bytes differ");
    assert!(matches!(end, End::ClientClosed | End::BackendClosed));
    assert_eq!(stats.rx, want_up.len() as u64);
    assert_eq!(stats.tx, down.len() as u64);
    assert_eq!(meters.rx.get(), stats.rx);
    assert_eq!(meters.tx.get(), stats.tx);
    assert_eq!(meters.half.get(), 0, "the half-closed gauge is released");
}

/// A long-lived interactive flow (small messages, as on a watch or exec stream) copies
/// even past the splice threshold, and a bulk flow that turns interactive copies again:
/// one read and one write per message instead of two splices, an empty splice and the
/// urgent-mark check.
#[tokio::test]
async fn interactive_flows_copy_past_the_splice_threshold() {
    const MSG: usize = 1024;
    const BEFORE: usize = 1536; // 1.5 MiB of messages each way, past SPLICE_AFTER
    const AFTER: usize = 256;
    const BULK: usize = 3 << 20;
    let (mut client, mut client_in) = pair().await;
    let (mut backend, mut backend_in) = pair().await;
    let meters = Meters::default();
    let stop = Stop::default();
    let mut relay = plain(
        &mut client_in,
        &mut backend_in,
        Duration::from_secs(30),
        &meters,
        &stop,
    );
    async fn ping_pong(client: &mut TcpStream, backend: &mut TcpStream, n: usize) {
        let msg = pattern(MSG, 0x33);
        let mut back = vec![0u8; MSG];
        for _ in 0..n {
            client.write_all(&msg).await.unwrap();
            backend.read_exact(&mut back).await.unwrap();
            assert!(back == msg);
            backend.write_all(&msg).await.unwrap();
            client.read_exact(&mut back).await.unwrap();
            assert!(back == msg);
        }
    }
    let peers = async {
        ping_pong(&mut client, &mut backend, BEFORE).await;
        let bulk = pattern(BULK, 0x44);
        let mut got = vec![0u8; BULK];
        let (w, r) = tokio::join!(client.write_all(&bulk), backend.read_exact(&mut got));
        w.unwrap();
        r.unwrap();
        assert!(got == bulk, "bulk bytes differ");
        ping_pong(&mut client, &mut backend, AFTER).await;
        client.shutdown().await.unwrap();
        backend.shutdown().await.unwrap();
    };
    let ((end, stats), ()) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(&mut relay, peers)
    })
    .await
    .expect("relay finishes");
    assert!(matches!(end, End::ClientClosed | End::BackendClosed));
    assert_eq!(stats.rx, ((BEFORE + AFTER) * MSG + BULK) as u64);
    assert_eq!(relay.down.spliced, 0, "small messages only: never spliced");
    assert!(relay.up.spliced >= 2 << 20, "the bulk upload was spliced");
    // All the messages were copied but at most one (the first after the bulk upload).
    let copied = relay.up.carried - relay.up.spliced;
    assert!(
        copied >= ((BEFORE + AFTER - 1) * MSG) as u64,
        "copied {copied} of {} message bytes",
        (BEFORE + AFTER) * MSG
    );
}

/// `Stop` ends idle relays at once, and a relay started after it ends immediately.
#[tokio::test]
async fn stop_cuts_idle_relays() {
    let (_client, mut client_in) = pair().await;
    let (_backend, mut backend_in) = pair().await;
    let meters = Meters::default();
    let stop = Stop::default();
    let first = plain(
        &mut client_in,
        &mut backend_in,
        Duration::from_secs(3600),
        &meters,
        &stop,
    );
    let stopper = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.stop();
    };
    let ((end, _), ()) = tokio::time::timeout(Duration::from_secs(5), async {
        tokio::join!(first, stopper)
    })
    .await
    .expect("stop wakes the relay");
    assert_eq!(end, End::Drain);
    let later = plain(
        &mut client_in,
        &mut backend_in,
        Duration::from_secs(3600),
        &meters,
        &stop,
    );
    assert_eq!(later.await.0, End::Drain);
}

/// `Stop::cut(n)` ends exactly `n` running relays, each in its own task, and leaves the
/// others running until more are cut or `stop` ends the rest; a relay started between cuts
/// runs until then too.
#[tokio::test]
async fn cut_ends_only_as_many_relays_as_asked() {
    let stop = std::sync::Arc::new(Stop::default());
    let (ended_tx, mut ended) = tokio::sync::mpsc::unbounded_channel();
    let mut outside = Vec::new();
    let spawn = async |outside: &mut Vec<_>, i: usize| {
        let (stop, ended_tx) = (stop.clone(), ended_tx.clone());
        let (client, mut client_in) = pair().await;
        let (backend, mut backend_in) = pair().await;
        outside.push((client, backend));
        tokio::spawn(async move {
            let meters = Meters::default();
            let hour = Duration::from_secs(3600);
            let r = plain(&mut client_in, &mut backend_in, hour, &meters, &stop);
            let _ = ended_tx.send((i, r.await.0));
        });
    };
    for i in 0..5 {
        spawn(&mut outside, i).await;
    }
    let registered = async |n: usize| {
        let wait = async {
            while stop.running() < n {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .unwrap();
    };
    registered(5).await;
    let quiet =
        |ended: &mut tokio::sync::mpsc::UnboundedReceiver<(usize, End)>| ended.try_recv().is_err();
    let next = async |ended: &mut tokio::sync::mpsc::UnboundedReceiver<(usize, End)>| {
        tokio::time::timeout(Duration::from_secs(5), ended.recv())
            .await
            .expect("a cut relay ends")
            .unwrap()
    };
    assert_eq!(stop.cut(2), 2);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..2 {
        let (i, end) = next(&mut ended).await;
        assert_eq!(end, End::Drain);
        assert!(seen.insert(i));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(quiet(&mut ended), "only two were cut");
    assert_eq!(stop.running(), 3);
    // One more relay while cutting: it runs until it is cut in turn.
    spawn(&mut outside, 5).await;
    registered(4).await;
    assert_eq!(stop.cut(10), 4, "every running relay, the new one included");
    for _ in 0..4 {
        let (i, end) = next(&mut ended).await;
        assert_eq!(end, End::Drain);
        assert!(seen.insert(i));
    }
    assert_eq!(stop.cut(1), 0);
    // After a partial cut, `stop` still ends relays started later.
    spawn(&mut outside, 6).await;
    registered(1).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(quiet(&mut ended), "started after the cuts: still running");
    stop.stop();
    assert_eq!(next(&mut ended).await, (6, End::Drain));
}

/// A relay first polled by one waker and then awaited by another task is still cut by
/// `Stop` (the registration follows the waker).
#[tokio::test]
async fn stop_follows_a_changed_waker() {
    let (_client, mut client_in) = pair().await;
    let (_backend, mut backend_in) = pair().await;
    let stop = std::sync::Arc::new(Stop::default());
    // Its own task: nothing but the stop may wake it.
    let task = tokio::spawn({
        let stop = stop.clone();
        async move {
            let meters = Meters::default();
            let mut r = plain(
                &mut client_in,
                &mut backend_in,
                Duration::from_secs(3600),
                &meters,
                &stop,
            );
            {
                let mut noop = Context::from_waker(Waker::noop());
                assert!(Pin::new(&mut r).poll(&mut noop).is_pending());
            }
            r.await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.stop();
    let (end, _) = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("stop wakes the task that awaits the relay now")
        .unwrap();
    assert_eq!(end, End::Drain);
}

/// Many small request/response exchanges with the relay on a multi-thread runtime (as
/// the node daemon runs it), where the I/O driver may record new data on another thread
/// while the relay reads: a lost readiness event would hang an exchange.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_pong_on_a_multi_thread_runtime() {
    let (mut client, mut client_in) = pair().await;
    let (mut backend, mut backend_in) = pair().await;
    let relay_task = tokio::spawn(async move {
        let meters = Meters::default();
        let stop = Stop::default();
        plain(
            &mut client_in,
            &mut backend_in,
            Duration::from_secs(30),
            &meters,
            &stop,
        )
        .await
    });
    let echo = tokio::spawn(async move {
        let mut buf = [0u8; 64];
        loop {
            match backend.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => backend.write_all(&buf[..n]).await.unwrap(),
            }
        }
    });
    let exchanges = async {
        for i in 0..3000u32 {
            // Two writes per exchange, so data often arrives while the relay is reading.
            let msg = i.to_be_bytes();
            client.write_all(&msg[..2]).await.unwrap();
            client.write_all(&msg[2..]).await.unwrap();
            let mut back = [0u8; 4];
            client.read_exact(&mut back).await.unwrap();
            assert_eq!(back, msg);
        }
        client.shutdown().await.unwrap();
    };
    tokio::time::timeout(Duration::from_secs(60), exchanges)
        .await
        .expect("no exchange hangs");
    let (end, stats) = relay_task.await.unwrap();
    assert_eq!(end, End::ClientClosed);
    assert_eq!((stats.rx, stats.tx), (12_000, 12_000));
    echo.await.unwrap();
}

/// The backend answers and closes; the client's late bytes are reset by the backend's
/// kernel. The relay ends as `backend_closed`, not as an error.
#[tokio::test]
async fn reset_after_the_backend_closed_is_its_close() {
    let (mut client, mut client_in) = pair().await;
    let (mut backend, mut backend_in) = pair().await;
    let stop = Stop::default();
    let meters = Meters::default();
    let r = plain(
        &mut client_in,
        &mut backend_in,
        Duration::from_secs(30),
        &meters,
        &stop,
    );
    let peers = async move {
        backend.write_all(b"bye").await.unwrap();
        drop(backend);
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"bye");
        // Late bytes (a TLS close_notify, say) until the relay gives up on them.
        for _ in 0..50 {
            if client.write_all(b"late").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let ((end, stats), ()) =
        tokio::time::timeout(Duration::from_secs(10), async { tokio::join!(r, peers) })
            .await
            .expect("the relay ends");
    assert_eq!(end, End::BackendClosed);
    assert_eq!(stats.tx, 3);
}

/// No bytes for `idle`: the relay ends with `IdleTimeout`.
#[tokio::test]
async fn idle_timeout() {
    let (_client, mut client_in) = pair().await;
    let (_backend, mut backend_in) = pair().await;
    let meters = Meters::default();
    let stop = Stop::default();
    let r = plain(
        &mut client_in,
        &mut backend_in,
        Duration::from_millis(200),
        &meters,
        &stop,
    );
    let (end, _) = tokio::time::timeout(Duration::from_secs(5), r)
        .await
        .expect("idle bound");
    assert_eq!(end, End::IdleTimeout);
}

// The generic path, over in-memory streams, with tokio's paused clock: every bound is
// checked at the exact instant it is due, without sleeping.

use tokio::io::{DuplexStream, duplex};

/// A relay over in-memory streams: (client outside end, backend outside end, relay legs).
fn memory_legs() -> (DuplexStream, DuplexStream, DuplexStream, DuplexStream) {
    let (client, client_in) = duplex(64 * 1024);
    let (backend, backend_in) = duplex(64 * 1024);
    (client, backend, client_in, backend_in)
}

fn bounds(idle: u64, half_close: u64, max: Option<u64>, progress: Option<u64>) -> Limits {
    Limits {
        idle: Duration::from_secs(idle),
        half_close: Duration::from_secs(half_close),
        max_duration: max.map(Duration::from_secs),
        progress: progress.map(Duration::from_secs),
    }
}

/// Runs a relay over the legs with `limits` to its end; returns the end, the stats and
/// how long it ran on the (paused) clock.
async fn run_memory(
    mut client_in: DuplexStream,
    mut backend_in: DuplexStream,
    to_backend: &[u8],
    to_client: &[u8],
    limits: Limits,
    meters: &Meters,
    stop: &Stop,
) -> (End, Stats, Duration) {
    let start = tokio::time::Instant::now();
    let (end, stats) = relay(
        &mut client_in,
        &mut backend_in,
        to_backend.to_vec(),
        to_client.to_vec(),
        limits,
        meters.counters(),
        &no_progress,
        stop,
    )
    .await;
    (end, stats, start.elapsed())
}

/// The client half-closes first: the backend sees end of stream, keeps answering, and
/// the relay ends as `client_closed` once the backend closes too; every byte is counted,
/// the replayed prefixes included.
#[tokio::test(start_paused = true)]
async fn generic_half_close_from_the_client() {
    let (mut client, mut backend, client_in, backend_in) = memory_legs();
    let meters = Meters::default();
    let stop = Stop::default();
    let peers = async {
        client.write_all(b"request").await.unwrap();
        client.shutdown().await.unwrap();
        let mut got = Vec::new();
        backend.read_to_end(&mut got).await.unwrap();
        assert_eq!(
            got, b"head:request",
            "replay first, then the client's bytes, then EOF"
        );
        // Half-closed: the other direction still flows.
        backend.write_all(b"response").await.unwrap();
        backend.shutdown().await.unwrap();
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"early:response");
    };
    let limits = bounds(3600, 60, None, None);
    let run = run_memory(
        client_in, backend_in, b"head:", b"early:", limits, &meters, &stop,
    );
    let ((end, stats, _), ()) = tokio::join!(run, peers);
    assert_eq!(end, End::ClientClosed);
    assert_eq!(stats, Stats { rx: 12, tx: 14 });
    assert_eq!((meters.rx.get(), meters.tx.get()), (12, 14));
    assert_eq!(meters.half.get(), 0, "released at the end");
}

/// The backend closes first: the relay ends as `backend_closed`.
#[tokio::test(start_paused = true)]
async fn generic_half_close_from_the_backend() {
    let (mut client, mut backend, client_in, backend_in) = memory_legs();
    let meters = Meters::default();
    let stop = Stop::default();
    let peers = async {
        backend.write_all(b"bye").await.unwrap();
        backend.shutdown().await.unwrap();
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"bye");
        client.write_all(b"ok").await.unwrap();
        client.shutdown().await.unwrap();
        let mut got = Vec::new();
        backend.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"ok");
    };
    let limits = bounds(3600, 60, None, None);
    let run = run_memory(client_in, backend_in, b"", b"", limits, &meters, &stop);
    let ((end, stats, _), ()) = tokio::join!(run, peers);
    assert_eq!(end, End::BackendClosed);
    assert_eq!(stats, Stats { rx: 2, tx: 3 });
}

/// One direction ended and the other never does: the relay ends exactly `half_close`
/// after the first end, although bytes keep moving (so the idle bound, far larger, is not
/// what ends it), and the half-closed gauge counts it meanwhile.
#[tokio::test(start_paused = true)]
async fn generic_half_close_bound_ends_the_relay() {
    let (mut client, mut backend, client_in, backend_in) = memory_legs();
    let meters = Meters::default();
    let stop = Stop::default();
    let half_close = Duration::from_secs(30);
    let limits = Limits {
        idle: Duration::from_secs(20),
        half_close,
        max_duration: None,
        progress: None,
    };
    let closed_at = std::sync::Mutex::new(None);
    let peers = async {
        client.shutdown().await.unwrap();
        let mut eof = [0u8; 1];
        assert_eq!(backend.read(&mut eof).await.unwrap(), 0);
        *closed_at.lock().unwrap() = Some(tokio::time::Instant::now());
        // Activity at 5, 15, 25, 35 s: below the idle bound, and longer than the window.
        let mut sink = [0u8; 16];
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_secs(5)).await;
            if backend.write_all(b"tick").await.is_err() {
                break;
            }
            if client.read(&mut sink).await.unwrap_or(0) == 0 {
                break;
            }
            assert!(meters.half.get() == 1, "counted as half-closed");
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    };
    let start = tokio::time::Instant::now();
    let run = run_memory(client_in, backend_in, b"", b"", limits, &meters, &stop);
    let ((end, stats, took), ()) = tokio::join!(run, peers);
    let closed_at = closed_at
        .lock()
        .unwrap()
        .expect("the client's end was seen");
    assert_eq!(end, End::ClientClosed, "the first end, not idle_timeout");
    assert_eq!(
        start + took - closed_at,
        half_close,
        "ends exactly when the window closes"
    );
    assert_eq!(stats.tx, 3 * 4, "ticks at 5, 15 and 25 s");
    assert_eq!(meters.half.get(), 0);
}

/// No bytes for `idle`: `idle_timeout`, exactly then; activity pushes it out.
#[tokio::test(start_paused = true)]
async fn generic_idle_bound() {
    let (mut client, mut backend, client_in, backend_in) = memory_legs();
    let meters = Meters::default();
    let stop = Stop::default();
    let peers = async {
        tokio::time::sleep(Duration::from_secs(50)).await;
        client.write_all(b"x").await.unwrap();
        let mut b = [0u8; 1];
        backend.read_exact(&mut b).await.unwrap();
        // Keep both outside ends open past the end of the relay.
        tokio::time::sleep(Duration::from_secs(1000)).await;
    };
    let limits = bounds(60, 5, None, None);
    let run = run_memory(client_in, backend_in, b"", b"", limits, &meters, &stop);
    let (end, stats, took) = tokio::select! {
        r = run => r,
        () = peers => panic!("the relay outlived its idle bound"),
    };
    assert_eq!(end, End::IdleTimeout);
    assert_eq!(
        took,
        Duration::from_secs(110),
        "60 s after the last byte at 50 s"
    );
    assert_eq!(stats.rx, 1);
}

/// `max_duration` ends a busy relay, and progress is reported on its period meanwhile.
#[tokio::test(start_paused = true)]
async fn generic_lifetime_bound_and_progress() {
    let (mut client, mut backend, mut client_in, mut backend_in) = memory_legs();
    let meters = Meters::default();
    let stop = Stop::default();
    let calls = std::sync::Mutex::new(Vec::new());
    let progress = |s: Stats| {
        calls
            .lock()
            .unwrap()
            .push((tokio::time::Instant::now(), s.rx))
    };
    let start = tokio::time::Instant::now();
    let run = relay(
        &mut client_in,
        &mut backend_in,
        Vec::new(),
        Vec::new(),
        bounds(10, 5, Some(95), Some(30)),
        meters.counters(),
        &progress,
        &stop,
    );
    let peers = async {
        let mut b = [0u8; 1];
        // A byte at 2, 7, ... 92 s: never at the instant of a bound.
        tokio::time::sleep(Duration::from_secs(2)).await;
        loop {
            client.write_all(b"y").await.unwrap();
            backend.read_exact(&mut b).await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    };
    let (end, stats) = tokio::select! {
        r = run => r,
        () = peers => unreachable!(),
    };
    assert_eq!(end, End::MaxDuration);
    assert_eq!(start.elapsed(), Duration::from_secs(95));
    assert_eq!(stats.rx, 19, "a byte every 5 s from 2 to 92 s");
    let calls = calls.lock().unwrap();
    let at: Vec<u64> = calls.iter().map(|(t, _)| (*t - start).as_secs()).collect();
    assert_eq!(at, [30, 60, 90]);
    assert_eq!(calls[0].1, 6, "bytes carried by then");
}

/// A stop ends an idle in-memory relay at once with `drain`.
#[tokio::test(start_paused = true)]
async fn generic_stop() {
    let (_client, _backend, client_in, backend_in) = memory_legs();
    let meters = Meters::default();
    let stop = Stop::default();
    let stopper = async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        stop.stop();
    };
    let run = run_memory(
        client_in,
        backend_in,
        b"",
        b"",
        bounds(3600, 5, None, None),
        &meters,
        &stop,
    );
    let ((end, _, took), ()) = tokio::join!(run, stopper);
    assert_eq!(end, End::Drain);
    assert_eq!(took, Duration::from_secs(3));
}

/// A kernel TCP client and an in-memory backend: the generic path carries bulk both ways
/// (no splice, since one leg is not a socket) and forwards the half-close.
#[tokio::test]
async fn generic_path_between_a_socket_and_a_stream() {
    let (mut client, mut client_in) = pair().await;
    let (mut backend, mut backend_in) = duplex(64 * 1024);
    let meters = Meters::default();
    let stop = Stop::default();
    let up = pattern(3 << 20, 0x55);
    let down = pattern(2 << 20, 0x66);
    let mut relay = bare(
        &mut client_in,
        &mut backend_in,
        limits(Duration::from_secs(30)),
        &meters,
        &stop,
    );
    let peers = async {
        let send = async {
            client.write_all(&up).await.unwrap();
            client.shutdown().await.unwrap();
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.unwrap();
            got
        };
        let serve = async {
            let mut got = Vec::new();
            backend.read_to_end(&mut got).await.unwrap();
            backend.write_all(&down).await.unwrap();
            backend.shutdown().await.unwrap();
            got
        };
        tokio::join!(send, serve)
    };
    let ((end, stats), (got_down, got_up)) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(&mut relay, peers)
    })
    .await
    .expect("relay finishes");
    assert!(got_up == up && got_down == down, "bytes differ");
    assert_eq!(end, End::ClientClosed);
    assert_eq!((stats.rx, stats.tx), (up.len() as u64, down.len() as u64));
    assert_eq!(relay.up.spliced + relay.down.spliced, 0);
}

impl Leg for tokio::io::BufWriter<DuplexStream> {}

/// A leg that buffers writes until flushed (as a TLS stream does): request and response
/// cross only if the relay flushes after each write, with no end of stream to help.
#[tokio::test(start_paused = true)]
async fn generic_path_flushes_a_buffering_leg() {
    let (mut client, client_in) = duplex(64 * 1024);
    let (mut backend, backend_in) = duplex(64 * 1024);
    let mut client_in = client_in;
    let mut backend_in = tokio::io::BufWriter::new(backend_in);
    let meters = Meters::default();
    let stop = Stop::default();
    let relay = bare(
        &mut client_in,
        &mut backend_in,
        bounds(3600, 60, None, None),
        &meters,
        &stop,
    );
    let exchange = async {
        for i in 0..3u8 {
            client.write_all(&[b'q', i]).await.unwrap();
            let mut got = [0u8; 2];
            backend.read_exact(&mut got).await.unwrap();
            assert_eq!(got, [b'q', i]);
            backend.write_all(&[b'a', i]).await.unwrap();
            client.read_exact(&mut got).await.unwrap();
            assert_eq!(got, [b'a', i]);
        }
    };
    tokio::select! {
        _ = relay => panic!("the relay ended early"),
        r = tokio::time::timeout(Duration::from_secs(10), exchange) => r.expect("no flush: stalled"),
    }
}

/// An in-memory leg with the quirks of real streams: a shutdown that never completes (a
/// `close_notify` that cannot be flushed), or a `WouldBlock` answer to every other read.
struct Quirky {
    inner: DuplexStream,
    never_shuts: bool,
    would_block: bool,
    reads: u32,
}

impl Quirky {
    fn new(inner: DuplexStream) -> Self {
        Quirky {
            inner,
            never_shuts: false,
            would_block: false,
            reads: 0,
        }
    }
}

impl tokio::io::AsyncRead for Quirky {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.reads += 1;
        if self.would_block && self.reads % 2 == 1 {
            return Poll::Ready(Err(std::io::ErrorKind::WouldBlock.into()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Quirky {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.never_shuts {
            return Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Leg for Quirky {}

/// A leg whose end-of-stream forwarding never completes (a `close_notify` that cannot be
/// flushed): the half-close bound still runs from the end of stream, with traffic the
/// other way keeping the idle bound away.
#[tokio::test(start_paused = true)]
async fn generic_half_close_bound_runs_while_the_shutdown_is_pending() {
    let (mut client, mut client_in) = duplex(64 * 1024);
    let (mut backend, backend_in) = duplex(64 * 1024);
    let mut backend_in = Quirky::new(backend_in);
    backend_in.never_shuts = true;
    let meters = Meters::default();
    let stop = Stop::default();
    let start = tokio::time::Instant::now();
    let relay = bare(
        &mut client_in,
        &mut backend_in,
        bounds(20, 30, None, None),
        &meters,
        &stop,
    );
    let ticks = async {
        client.shutdown().await.unwrap();
        let mut sink = [0u8; 16];
        // 100 s of ticks, far past the window.
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_secs(5)).await;
            if backend.write_all(b"tick").await.is_err() || client.read(&mut sink).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    };
    let (end, _) = tokio::select! {
        r = relay => r,
        () = ticks => panic!("the relay outlived its half-close bound"),
    };
    assert_eq!(end, End::ClientClosed);
    assert_eq!(
        start.elapsed(),
        Duration::from_secs(30),
        "one half_close after the end"
    );
    assert_eq!(meters.half.get(), 0);
}

/// A leg that answers a read with `WouldBlock` (which an `AsyncRead` should not) does not
/// make the relay spin inside one poll: it is polled again on a later turn, and the bytes
/// still cross.
#[tokio::test]
async fn generic_path_does_not_spin_on_would_block() {
    let (mut client, client_in) = duplex(1024);
    let (mut backend, mut backend_in) = duplex(1024);
    let mut client_in = Quirky::new(client_in);
    client_in.would_block = true;
    let meters = Meters::default();
    let stop = Stop::default();
    let relay = bare(
        &mut client_in,
        &mut backend_in,
        limits(Duration::from_secs(30)),
        &meters,
        &stop,
    );
    let peers = async {
        client.write_all(b"hello").await.unwrap();
        client.shutdown().await.unwrap();
        let mut got = Vec::new();
        backend.read_to_end(&mut got).await.unwrap();
        backend.shutdown().await.unwrap();
        got
    };
    let ((end, stats), got) = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(relay, peers)
    })
    .await
    .expect("no spin, no hang");
    assert_eq!(got, b"hello");
    assert_eq!((end, stats.rx), (End::ClientClosed, 5));
    assert!(
        client_in.reads < 100,
        "{} reads for one message and its end",
        client_in.reads
    );
}

/// Pipes come from the budget: a direction that finds it used up copies its bulk flow (every
/// byte intact), one that finds room splices, and the pipe's place is given back when the
/// relay ends.
#[tokio::test]
async fn bulk_flows_splice_only_within_the_pipe_budget() {
    use crate::net::fds::PipeBudget;
    static NONE_LEFT: PipeBudget = PipeBudget::new(0);
    static ONE: PipeBudget = PipeBudget::new(1);
    const BULK: usize = 4 << 20;
    let (mut client, mut client_in) = pair().await;
    let (mut backend, mut backend_in) = pair().await;
    let meters = Meters::default();
    let stop = Stop::default();
    let mut relay = plain(
        &mut client_in,
        &mut backend_in,
        Duration::from_secs(30),
        &meters,
        &stop,
    );
    relay.up.pipes = &NONE_LEFT;
    relay.down.pipes = &ONE;
    let peers = async {
        let (up, down) = (pattern(BULK, 0x51), pattern(BULK, 0x52));
        let (mut got_up, mut got_down) = (vec![0u8; BULK], vec![0u8; BULK]);
        let ((mut client_r, mut client_w), (mut backend_r, mut backend_w)) =
            (client.split(), backend.split());
        let (a, b, c, d) = tokio::join!(
            client_w.write_all(&up),
            backend_r.read_exact(&mut got_up),
            backend_w.write_all(&down),
            client_r.read_exact(&mut got_down),
        );
        a.unwrap();
        b.unwrap();
        c.unwrap();
        d.unwrap();
        assert!(got_up == up && got_down == down, "bytes differ");
        client.shutdown().await.unwrap();
        backend.shutdown().await.unwrap();
    };
    let ((_, stats), ()) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(&mut relay, peers)
    })
    .await
    .expect("relay finishes");
    assert_eq!((stats.rx, stats.tx), (BULK as u64, BULK as u64));
    assert_eq!(relay.up.spliced, 0, "no pipe in the budget: copied");
    assert!(relay.down.spliced > 0, "a pipe in the budget: spliced");
    drop(relay);
    assert!(ONE.take().is_some(), "the pipe's place was given back");
}

/// An [`Either`] leg holding kernel sockets on both sides is relayed on the socket path: a
/// bulk upload is spliced. Holding an in-memory stream on one side, it goes through the
/// generic copy: every byte both ways, the half-close forwarded, nothing spliced.
#[tokio::test]
async fn either_legs_splice_sockets_and_copy_other_streams() {
    use crate::net::fds::PipeBudget;
    static PIPES: PipeBudget = PipeBudget::new(2);
    const BULK: usize = 4 << 20;
    type Dialed = Either<TcpStream, DuplexStream>;

    let (mut client, client_in) = pair().await;
    let (mut backend, backend_in) = pair().await;
    let (mut client_in, mut backend_in) = (Dialed::A(client_in), Dialed::A(backend_in));
    let meters = Meters::default();
    let stop = Stop::default();
    let mut relay = bare(
        &mut client_in,
        &mut backend_in,
        limits(Duration::from_secs(30)),
        &meters,
        &stop,
    );
    relay.up.pipes = &PIPES;
    relay.down.pipes = &PIPES;
    let peers = async {
        let up = pattern(BULK, 0x71);
        let mut got = vec![0u8; BULK];
        let (w, r) = tokio::join!(client.write_all(&up), backend.read_exact(&mut got));
        w.unwrap();
        r.unwrap();
        assert!(got == up, "bulk bytes differ");
        client.shutdown().await.unwrap();
        backend.shutdown().await.unwrap();
    };
    let ((_, stats), ()) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(&mut relay, peers)
    })
    .await
    .expect("relay finishes");
    assert_eq!(stats.rx, BULK as u64);
    assert!(
        relay.up.spliced > 0,
        "sockets in Either legs were not spliced"
    );
    drop(relay);

    let (mut client, client_in) = pair().await;
    let (mut backend, backend_in) = duplex(64 * 1024);
    let (mut client_in, mut backend_in) = (Dialed::A(client_in), Dialed::B(backend_in));
    let mut relay = bare(
        &mut client_in,
        &mut backend_in,
        limits(Duration::from_secs(30)),
        &meters,
        &stop,
    );
    let (up, down) = (pattern(3 << 20, 0x72), pattern(2 << 20, 0x73));
    let peers = async {
        let send = async {
            client.write_all(&up).await.unwrap();
            client.shutdown().await.unwrap();
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.unwrap();
            got
        };
        let serve = async {
            let mut got = Vec::new();
            backend.read_to_end(&mut got).await.unwrap();
            backend.write_all(&down).await.unwrap();
            backend.shutdown().await.unwrap();
            got
        };
        tokio::join!(send, serve)
    };
    let ((end, stats), (got_down, got_up)) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(&mut relay, peers)
    })
    .await
    .expect("relay finishes");
    assert!(got_up == up && got_down == down, "bytes differ");
    assert_eq!(end, End::ClientClosed);
    assert_eq!((stats.rx, stats.tx), (up.len() as u64, down.len() as u64));
    assert_eq!(relay.up.spliced + relay.down.spliced, 0);
}

// TCP urgent data. A read stops at the urgent mark: the kernel ends it before the urgent
// byte. A burst that ends in an urgent byte and arrives in one segment is then read whole
// only by a relay that does not take the short read before the mark for a drained socket:
// nothing else wakes it for the urgent byte.

/// How the relay's sockets are set up in a test.
#[derive(Debug, Clone, Copy)]
enum Sockets {
    /// As the roles set them up: accepted from a listener [`crate::net::socket`] binds.
    Served,
    /// Urgent data inline and nothing more (a socket set up anywhere else).
    Inline,
}

/// A connected pair whose relay end reads urgent data inline: (outside end, relay end).
async fn urgent_pair(sockets: Sockets) -> (TcpStream, TcpStream) {
    let l = match sockets {
        Sockets::Served => {
            let options = crate::net::socket::ListenOptions {
                backlog: 16,
                reuse_port: false,
                freebind: false,
                keepalive: None,
            };
            let addr = "127.0.0.1:0".parse().unwrap();
            TcpListener::from_std(crate::net::socket::bind_listener(addr, &options).unwrap())
                .unwrap()
        }
        Sockets::Inline => TcpListener::bind("127.0.0.1:0").await.unwrap(),
    };
    let outside = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (inside, _) = l.accept().await.unwrap();
    socket2::SockRef::from(&inside)
        .set_out_of_band_inline(true)
        .unwrap();
    (outside, inside)
}

const URGENT: u8 = b'!';

/// Sends `before` bytes of `fill` and an urgent byte corked: one segment.
fn send_burst(s: &TcpStream, fill: u8, before: usize) {
    let sock = socket2::SockRef::from(s);
    sock.set_tcp_cork(true).unwrap();
    assert_eq!(sock.send(&vec![fill; before]).unwrap(), before);
    assert_eq!(sock.send_out_of_band(&[URGENT]).unwrap(), 1);
    sock.set_tcp_cork(false).unwrap();
}

/// Waits until `n` bytes are queued at `s` and the event loop has taken in what their
/// arrival raised, as when data waits for a busy relay (or one not started yet). The loop
/// may report one arrival more than once within a few hundred microseconds; a later report
/// would wake a relay stalled at the urgent mark, so the wait lasts 20 ms past the first.
async fn queued(s: &TcpStream, n: u64) {
    let limit = tokio::time::Instant::now() + Duration::from_secs(5);
    while rustix::io::ioctl_fionread(s).unwrap() < n {
        assert!(
            tokio::time::Instant::now() < limit,
            "{n} bytes never queued"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    s.readable().await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// Reads `before` bytes of `fill` and the urgent byte within 5 s: `Err` says where it
/// stalled or what came instead.
async fn read_burst(s: &mut TcpStream, fill: u8, before: usize) -> Result<(), String> {
    let mut got = vec![0u8; before + 1];
    let mut n = 0;
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        while n < got.len() {
            match s.read(&mut got[n..]).await.unwrap() {
                0 => return Err(format!("end of stream after {n} bytes")),
                k => n += k,
            }
        }
        Ok(())
    })
    .await;
    read.map_err(|_| format!("stalled after {n} of {} bytes", got.len()))??;
    let mut want = vec![fill; before];
    want.push(URGENT);
    if got != want {
        let at = got.iter().position(|&b| b == URGENT);
        return Err(format!("urgent byte at {at:?}, not {before}"));
    }
    Ok(())
}

/// Reads `want.len()` bytes within 5 s and compares them with `want`.
async fn expect(s: &mut TcpStream, want: &[u8]) {
    let mut got = vec![0u8; want.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got))
        .await
        .expect("bytes in time")
        .unwrap();
    assert_eq!(got, want);
}

/// `len` bytes each way, then half-closes; every byte arrives.
async fn bulk_both_ways(client: &mut TcpStream, backend: &mut TcpStream, len: usize) {
    async fn send_and_read(s: &mut TcpStream, out: Vec<u8>) -> Vec<u8> {
        let (mut r, mut w) = s.split();
        let send = async {
            w.write_all(&out).await.unwrap();
            w.shutdown().await.unwrap();
        };
        // Exactly `len`: the relay forwards the last end of stream by closing the sockets,
        // which the tests keep.
        let mut got = vec![0u8; out.len()];
        let read = r.read_exact(&mut got);
        let ((), read) = tokio::join!(send, read);
        read.unwrap();
        got
    }
    let (up, down) = (pattern(len, 0x71), pattern(len, 0x72));
    let (got_down, got_up) = tokio::join!(
        send_and_read(client, up.clone()),
        send_and_read(backend, down.clone())
    );
    assert!(got_up == up && got_down == down, "bulk bytes differ");
}

/// Urgent data already queued at both relay ends when the relay starts (after bytes the
/// relay replays, as a role hands it bytes read before): each direction carries the bytes
/// before the urgent byte, the urgent byte in place, and the stream goes on. With the
/// sockets the roles set up and with others; with a burst shorter than one read's buffer and
/// with one that fills several.
#[tokio::test]
async fn urgent_data_queued_before_the_relay_starts_crosses_in_place() {
    for sockets in [Sockets::Served, Sockets::Inline] {
        for before in [1000, 30_000] {
            let (mut client, mut client_in) = urgent_pair(sockets).await;
            let (mut backend, mut backend_in) = urgent_pair(sockets).await;
            send_burst(&client, b'x', before);
            send_burst(&backend, b'y', before);
            queued(&client_in, before as u64 + 1).await;
            queued(&backend_in, before as u64 + 1).await;
            let meters = Meters::default();
            let stop = Stop::default();
            let relay = relay(
                &mut client_in,
                &mut backend_in,
                b"replayed".to_vec(),
                b"early".to_vec(),
                limits(Duration::from_secs(30)),
                meters.counters(),
                &no_progress,
                &stop,
            );
            let peers = async {
                expect(&mut backend, b"replayed").await;
                expect(&mut client, b"early").await;
                let (up, down) = tokio::join!(
                    read_burst(&mut backend, b'x', before),
                    read_burst(&mut client, b'y', before)
                );
                assert_eq!((&up, &down), (&Ok(()), &Ok(())), "{sockets:?}, {before}");
                bulk_both_ways(&mut client, &mut backend, 1 << 20).await;
            };
            let ((_, stats), ()) = tokio::time::timeout(Duration::from_secs(30), async {
                tokio::join!(relay, peers)
            })
            .await
            .expect("relay finishes");
            let each = (before + 1 + (1 << 20)) as u64;
            assert_eq!((stats.rx, stats.tx), (8 + each, 5 + each));
        }
    }
}

/// Runs `relay` until `peers` are done (the relay must not end meanwhile).
async fn alongside<R: Future + Unpin, T>(relay: &mut R, peers: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), async {
        tokio::select! {
            _ = relay => panic!("the relay ended"),
            t = peers => t,
        }
    })
    .await
    .expect("the peers finish")
}

/// Urgent data arriving while the relay runs, each way, and waiting until the relay reads
/// it (as on a busy worker): after a first exchange (the directions copy) and after a bulk
/// transfer each way (the directions splice). Every byte crosses in place, and the streams
/// go on.
#[tokio::test]
async fn urgent_data_in_mid_stream_crosses_in_place() {
    const BULK: usize = 2 << 20;
    for sockets in [Sockets::Served, Sockets::Inline] {
        let (mut client, mut client_in) = urgent_pair(sockets).await;
        let (mut backend, mut backend_in) = urgent_pair(sockets).await;
        let meters = Meters::default();
        let stop = Stop::default();
        let mut relay = plain(
            &mut client_in,
            &mut backend_in,
            Duration::from_secs(30),
            &meters,
            &stop,
        );
        alongside(&mut relay, async {
            client.write_all(b"ping").await.unwrap();
            expect(&mut backend, b"ping").await;
            backend.write_all(b"pong").await.unwrap();
            expect(&mut client, b"pong").await;
        })
        .await;
        // The relay is not polled while the bursts arrive.
        send_burst(&client, b'x', 1000);
        send_burst(&backend, b'y', 1000);
        queued(relay.client, 1001).await;
        queued(relay.backend, 1001).await;
        let (up, down) = alongside(&mut relay, async {
            tokio::join!(
                read_burst(&mut backend, b'x', 1000),
                read_burst(&mut client, b'y', 1000)
            )
        })
        .await;
        assert_eq!((&up, &down), (&Ok(()), &Ok(())), "{sockets:?}, copying");
        // Bulk each way: both directions splice.
        let (up, down) = (pattern(BULK, 0x61), pattern(BULK, 0x62));
        alongside(&mut relay, async {
            let (mut up_got, mut down_got) = (vec![0u8; BULK], vec![0u8; BULK]);
            let ((mut cr, mut cw), (mut br, mut bw)) = (client.split(), backend.split());
            let (a, b, c, d) = tokio::join!(
                cw.write_all(&up),
                br.read_exact(&mut up_got),
                bw.write_all(&down),
                cr.read_exact(&mut down_got),
            );
            a.unwrap();
            b.unwrap();
            c.unwrap();
            d.unwrap();
            assert!(up_got == up && down_got == down, "bulk bytes differ");
        })
        .await;
        assert!(
            relay.up.spliced > 0 && relay.down.spliced > 0,
            "the bulk transfers were spliced"
        );
        send_burst(&client, b'x', 1000);
        send_burst(&backend, b'y', 1000);
        queued(relay.client, 1001).await;
        queued(relay.backend, 1001).await;
        let (up, down) = alongside(&mut relay, async {
            tokio::join!(
                read_burst(&mut backend, b'x', 1000),
                read_burst(&mut client, b'y', 1000)
            )
        })
        .await;
        assert_eq!(
            (&up, &down),
            (&Ok(()), &Ok(())),
            "{sockets:?}, after splicing"
        );
        let ((_, stats), ()) = tokio::time::timeout(Duration::from_secs(30), async {
            tokio::join!(
                &mut relay,
                bulk_both_ways(&mut client, &mut backend, 64 * 1024)
            )
        })
        .await
        .expect("relay finishes");
        let each = (4 + 2 * 1001 + BULK + 64 * 1024) as u64;
        assert_eq!((stats.rx, stats.tx), (each, each));
    }
}

/// A kernel TCP client and an in-memory backend (the generic path): the client's urgent
/// data, queued when the relay starts, crosses in place, and the stream goes on.
#[tokio::test]
async fn generic_path_carries_urgent_data_queued_before_the_relay() {
    let (mut client, mut client_in) = urgent_pair(Sockets::Served).await;
    let (mut backend, mut backend_in) = duplex(64 * 1024);
    send_burst(&client, b'x', 1000);
    queued(&client_in, 1001).await;
    let meters = Meters::default();
    let stop = Stop::default();
    let relay = relay(
        &mut client_in,
        &mut backend_in,
        b"replayed".to_vec(),
        Vec::new(),
        limits(Duration::from_secs(30)),
        meters.counters(),
        &no_progress,
        &stop,
    );
    let peers = async {
        let mut want = b"replayed".to_vec();
        want.extend(vec![b'x'; 1000]);
        want.push(URGENT);
        let mut got = vec![0u8; want.len()];
        tokio::time::timeout(Duration::from_secs(5), backend.read_exact(&mut got))
            .await
            .expect("the urgent byte in time: the relay stalled at the mark")
            .unwrap();
        assert!(got == want, "bytes differ");
        client.write_all(b"more").await.unwrap();
        client.shutdown().await.unwrap();
        let mut rest = Vec::new();
        backend.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"more");
        backend.shutdown().await.unwrap();
    };
    let ((_, stats), ()) = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(relay, peers)
    })
    .await
    .expect("relay finishes");
    assert_eq!(stats.rx, 8 + 1001 + 4);
}
