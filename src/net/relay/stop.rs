//! Cutting every relay at once at the end of a drain, without a future per connection:
//! each relay leaves its task's waker here and [`Stop::stop`] wakes them all. It never
//! touches a socket.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Waker;

/// Cuts every relay at once (the end of a drain) without a future per connection: each
/// relay leaves its task's waker here, and [`Stop::stop`] wakes them all.
#[derive(Debug, Default)]
pub(crate) struct Stop {
    stopped: AtomicBool,
    slots: Mutex<Slots>,
}

#[derive(Debug, Default)]
struct Slots {
    wakers: Vec<Option<Waker>>,
    free: Vec<usize>,
}

impl Stop {
    /// Ends every relay, present and future, with [`End::Drain`].
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let wakers: Vec<Waker> = {
            let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            s.free.clear();
            s.wakers.drain(..).flatten().collect()
        };
        for w in wakers {
            w.wake();
        }
    }

    /// Whether [`Stop::stop`] was called.
    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Leaves `waker` to be woken by `stop`; `None` if already stopped. Checked under the
    /// lock `stop` takes after setting the flag, so no registration is missed.
    pub(super) fn register(&self, waker: &Waker) -> Option<usize> {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if self.is_stopped() {
            return None;
        }
        Some(match s.free.pop() {
            Some(k) => {
                s.wakers[k] = Some(waker.clone());
                k
            }
            None => {
                s.wakers.push(Some(waker.clone()));
                s.wakers.len() - 1
            }
        })
    }

    /// Points a registration at another waker (no-op after `stop`).
    pub(super) fn replace(&self, key: usize, waker: &Waker) {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot @ Some(_)) = s.wakers.get_mut(key) {
            *slot = Some(waker.clone());
        }
    }

    pub(super) fn unregister(&self, key: usize) {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        // After `stop` the slots are gone and every key is stale.
        if let Some(slot) = s.wakers.get_mut(key)
            && slot.take().is_some()
        {
            s.free.push(key);
        }
    }
}
