//! Cutting relays at the end of a drain, without a future per connection: each relay leaves
//! its task's waker here. [`Stop::cut`] ends some of them (a drain spreads the cuts over a
//! window, so clients do not all reconnect in the same instant) and [`Stop::stop`] ends the
//! rest, present and future. It never touches a socket.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::Waker;

/// Nothing cut: relays check no slot (one atomic load per poll).
const RUNNING: u8 = 0;
/// Some relays are cut: a relay checks its own slot.
const CUTTING: u8 = 1;
/// Every relay is cut, and every later one at once.
const STOPPED: u8 = 2;

/// Ends relays at the end of a drain: each relay leaves its task's waker here, and
/// [`Stop::cut`] or [`Stop::stop`] wake the relays they end.
#[derive(Debug, Default)]
pub(crate) struct Stop {
    state: AtomicU8,
    slots: Mutex<Slots>,
}

#[derive(Debug, Default)]
struct Slots {
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// Slots holding a waker (relays still running).
    armed: usize,
    /// Where the next [`Stop::cut`] starts looking, so the cuts of one drain make one pass.
    cursor: usize,
}

#[derive(Debug, Default)]
enum Slot {
    #[default]
    Vacant,
    /// A running relay's waker.
    Armed(Waker),
    /// The relay was cut; it ends when it is next polled.
    Cut,
}

impl Stop {
    /// Ends every relay, present and future, with [`End::Drain`](super::End::Drain).
    pub(crate) fn stop(&self) {
        self.state.store(STOPPED, Ordering::SeqCst);
        let wakers: Vec<Waker> = {
            let mut s = self.lock();
            s.free.clear();
            s.armed = 0;
            s.slots
                .drain(..)
                .filter_map(|slot| match slot {
                    Slot::Armed(w) => Some(w),
                    _ => None,
                })
                .collect()
        };
        for w in wakers {
            w.wake();
        }
    }

    /// Ends up to `n` running relays (in the order of their slots, continuing where the
    /// previous cut stopped); returns how many it ended. Relays started later are not
    /// affected until [`Stop::stop`].
    pub(crate) fn cut(&self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        // Not after `stop`: every relay is cut already.
        let _ = self
            .state
            .compare_exchange(RUNNING, CUTTING, Ordering::SeqCst, Ordering::SeqCst);
        let mut wakers = Vec::new();
        {
            let mut s = self.lock();
            let len = s.slots.len();
            let mut looked = 0;
            while wakers.len() < n && looked < len && s.armed > 0 {
                let i = s.cursor % len;
                s.cursor = i + 1;
                looked += 1;
                if let Slot::Armed(_) = s.slots[i]
                    && let Slot::Armed(w) = std::mem::replace(&mut s.slots[i], Slot::Cut)
                {
                    s.armed -= 1;
                    wakers.push(w);
                }
            }
        }
        let cut = wakers.len();
        for w in wakers {
            w.wake();
        }
        cut
    }

    /// Relays running and not cut.
    pub(crate) fn running(&self) -> usize {
        self.lock().armed
    }

    /// Whether [`Stop::stop`] was called.
    pub(crate) fn is_stopped(&self) -> bool {
        self.state.load(Ordering::SeqCst) == STOPPED
    }

    /// Whether the relay registered under `key` must end: one atomic load until a drain
    /// starts cutting.
    pub(super) fn is_cut(&self, key: usize) -> bool {
        match self.state.load(Ordering::SeqCst) {
            RUNNING => false,
            STOPPED => true,
            _ => matches!(self.lock().slots.get(key), Some(Slot::Cut)),
        }
    }

    /// Leaves `waker` to be woken when the relay is cut; `None` if already stopped. Checked
    /// under the lock `stop` takes after setting its state, so no registration is missed.
    pub(super) fn register(&self, waker: &Waker) -> Option<usize> {
        let mut s = self.lock();
        if self.is_stopped() {
            return None;
        }
        s.armed += 1;
        let slot = Slot::Armed(waker.clone());
        Some(match s.free.pop() {
            Some(k) => {
                s.slots[k] = slot;
                k
            }
            None => {
                s.slots.push(slot);
                s.slots.len() - 1
            }
        })
    }

    /// Points a registration at another waker (no-op once cut).
    pub(super) fn replace(&self, key: usize, waker: &Waker) {
        let mut s = self.lock();
        if let Some(Slot::Armed(w)) = s.slots.get_mut(key) {
            *w = waker.clone();
        }
    }

    pub(super) fn unregister(&self, key: usize) {
        let mut s = self.lock();
        // After `stop` the slots are gone and every key is stale.
        let Some(slot) = s.slots.get_mut(key) else {
            return;
        };
        match std::mem::take(slot) {
            Slot::Vacant => return,
            Slot::Armed(_) => s.armed -= 1,
            Slot::Cut => {}
        }
        s.free.push(key);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        // Poisoning cannot leave the slots inconsistent: no update panics half-way.
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }
}
