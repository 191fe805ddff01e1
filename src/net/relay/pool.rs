//! Per-thread free lists of relay buffers: buffers follow traffic, and a buffer released by
//! one connection is reused by the next without a trip through the allocator.

use std::cell::RefCell;

/// Buffer for a direction that has carried little (interactive traffic).
pub(crate) const SMALL_BUF: usize = 4 * 1024;
/// Buffer once a direction has carried 128 KiB (the copy loop's `GROW_AFTER`).
pub(crate) const MEDIUM_BUF: usize = 16 * 1024;
/// Buffer once a direction has carried 4 MiB (the copy loop's `BULK_AFTER`).
pub(crate) const LARGE_BUF: usize = 64 * 1024;

/// Buffers kept per size class and thread.
const KEEP: usize = 64;

thread_local! {
    static FREE: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// A buffer with at least `size` bytes of capacity and no contents.
pub(crate) fn take(size: usize) -> Vec<u8> {
    FREE.with(|f| {
        let mut f = f.borrow_mut();
        match f.iter().position(|b| b.capacity() == size) {
            Some(i) => f.swap_remove(i),
            None => Vec::with_capacity(size),
        }
    })
}

/// Returns a buffer for reuse (one of another size, such as a replay buffer, is freed).
pub(crate) fn give(mut buf: Vec<u8>) {
    if ![SMALL_BUF, MEDIUM_BUF, LARGE_BUF].contains(&buf.capacity()) {
        return;
    }
    buf.clear();
    FREE.with(|f| {
        let mut f = f.borrow_mut();
        if f.len() < KEEP {
            f.push(buf);
        }
    })
}
