//! The device's TCP stream endpoints, by id: each a bounded queue of framed datagrams
//! between the device, which pushes what it sends to a stream endpoint, and the stream's
//! writer, which drains it. A full queue drops the datagram (`stream_full`) rather than wait:
//! the device never blocks on a slow stream. It never touches a socket; carrying the streams
//! is [`super::framed`]'s work.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::{Notify, watch};

use super::peer::StreamId;
use super::shoot::Drop;
use crate::wire::udp_over_tcp::{self, EncodeError};

/// Framed bytes a stream's queue holds at most; a datagram that does not fit is dropped.
/// Over UDP the kernel's socket buffer absorbs a burst; here this queue does, and a burst
/// is a window's worth of every stream the peer carries (128 KiB each): a drop costs the
/// stream behind it a retransmission timeout (smoltcp waits at least 1 s). The writer takes
/// the whole queue at once, so a stalled stream holds at most twice this (the write in
/// progress and a full queue); an idle one holds none of it.
pub(crate) const QUEUE_BYTES: usize = 1024 * 1024;

/// Buffers of an idle stream above this are freed.
pub(super) const KEEP_IDLE: usize = 16 * 1024;

/// A stream's outgoing frames, between the device and the stream's writer.
#[derive(Debug, Default)]
pub(super) struct Queue {
    state: Mutex<QueueState>,
    /// Wakes the writer: frames were queued, or the stream is to close.
    pub(super) ready: Notify,
    /// Wakes the carry when the owner closes the stream (a writer blocked on a peer that
    /// does not read would never see `closed`).
    gone: Notify,
}

#[derive(Debug, Default)]
struct QueueState {
    /// Framed datagrams not written yet.
    frames: Vec<u8>,
    /// The owner asked the stream to end.
    closed: bool,
}

impl Queue {
    fn state(&self) -> std::sync::MutexGuard<'_, QueueState> {
        // Every update is one statement on plain data: a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, datagram: &[u8]) -> Result<(), Drop> {
        let mut q = self.state();
        if q.closed {
            return Err(Drop::NoEndpoint);
        }
        if q.frames.len() + udp_over_tcp::HEADER_LEN + datagram.len() > QUEUE_BYTES {
            return Err(Drop::StreamFull);
        }
        match udp_over_tcp::encode(datagram, &mut q.frames) {
            Ok(()) => {}
            Err(EncodeError::Empty | EncodeError::TooLarge { .. }) => return Err(Drop::Invalid),
        }
        drop(q);
        self.ready.notify_one();
        Ok(())
    }

    pub(super) fn close(&self) {
        self.state().closed = true;
        self.ready.notify_one();
        self.gone.notify_waiters();
    }

    /// Resolves once the owner closed the stream.
    pub(super) async fn closed(&self) {
        loop {
            // Created before the check: a close in between still wakes it.
            let gone = self.gone.notified();
            if self.state().closed {
                return;
            }
            gone.await;
        }
    }

    /// Swaps the queued frames into `out` (empty, its capacity reused); an idle queue keeps
    /// no large buffer, in it or in `out`.
    pub(super) fn take(&self, out: &mut Vec<u8>) -> Take {
        let mut q = self.state();
        if q.closed {
            return Take::Closed;
        }
        if q.frames.is_empty() {
            if q.frames.capacity() > KEEP_IDLE {
                q.frames = Vec::new();
            }
            if out.capacity() > KEEP_IDLE {
                *out = Vec::new();
            }
            return Take::Empty;
        }
        std::mem::swap(&mut q.frames, out);
        Take::Frames
    }
}

/// What the writer found in the queue.
pub(super) enum Take {
    /// The owner closed the stream.
    Closed,
    /// Nothing to write.
    Empty,
    /// Frames, now in the writer's buffer.
    Frames,
}

/// The device's stream endpoints, by id.
#[derive(Debug)]
pub(crate) struct Streams {
    next: AtomicU64,
    queues: RwLock<HashMap<StreamId, Arc<Queue>>>,
    /// Turns true when every stream is to end (the gateway's drain is over).
    closing: watch::Sender<bool>,
}

impl Default for Streams {
    fn default() -> Self {
        Streams {
            next: AtomicU64::new(1),
            queues: RwLock::default(),
            closing: watch::Sender::new(false),
        }
    }
}

impl Streams {
    /// Queues `datagram` on stream `id`: [`Drop::NoEndpoint`] if it has ended,
    /// [`Drop::StreamFull`] if its queue is full.
    pub(crate) fn send(&self, id: StreamId, datagram: &[u8]) -> Result<(), Drop> {
        let queues = self.queues.read().unwrap_or_else(|e| e.into_inner());
        match queues.get(&id) {
            Some(q) => q.push(datagram),
            None => Err(Drop::NoEndpoint),
        }
    }

    /// Ends every stream (and every one opened from now on).
    pub(crate) fn close_all(&self) {
        self.closing.send_replace(true);
    }

    /// Registers a new stream: its id and its queue.
    pub(super) fn open(&self) -> (StreamId, Arc<Queue>) {
        let id = StreamId(self.next.fetch_add(1, Ordering::Relaxed));
        let queue = Arc::new(Queue::default());
        self.queues
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, queue.clone());
        (id, queue)
    }

    /// Forgets stream `id`: what is sent there from now on is dropped.
    pub(super) fn remove(&self, id: StreamId) {
        self.queues
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }

    /// Turns true when every stream is to end.
    pub(super) fn closing(&self) -> watch::Receiver<bool> {
        self.closing.subscribe()
    }

    /// Streams registered now.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        let queues = self.queues.read();
        queues.unwrap_or_else(|e| e.into_inner()).len()
    }
}
