//! Giving heap memory back to the operating system: after a table reload, and after a flood
//! of connections has ended. glibc keeps what it freed in its per-thread arenas for reuse
//! and returns little of it by itself, so a gateway that once held 10,000 slow clients
//! would keep their memory for good. It never touches a connection.

use std::sync::Arc;
use std::time::Duration;

use super::tracker::Tracker;

/// How often the connection count is looked at.
const CHECK_EVERY: Duration = Duration::from_secs(5);

/// How far the connection count must have fallen from its peak since the last check (or
/// trim) for a trim to pay: a few hundred connections' buffers and tasks, about a megabyte.
const TRIM_AFTER_DROP: usize = 256;

/// Keeps large allocations (a table's route list and indexes, a file's bytes) out of the
/// heap: glibc otherwise raises its mmap threshold after the first such block is freed, and
/// from then on every reload's large blocks fragment the heap so it never shrinks back.
#[expect(
    unsafe_code,
    reason = "glibc's allocator settings have no safe wrapper"
)]
pub(crate) fn fix_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a glibc allocator parameter; it has no preconditions.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

/// Returns free heap memory of every arena to the operating system.
#[expect(unsafe_code, reason = "glibc's malloc_trim has no safe wrapper")]
pub(crate) fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks and shrinks glibc's own heaps; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Whether a fall from `peak` to `active` connections is worth a trim.
fn worth_trimming(peak: usize, active: usize) -> bool {
    peak.saturating_sub(active) >= TRIM_AFTER_DROP
}

/// Every [`CHECK_EVERY`], trims the heap when the connection count has fallen by at least
/// [`TRIM_AFTER_DROP`] from its peak since the last look. The trim runs on a blocking
/// thread: it walks every arena, which takes milliseconds on a large heap.
pub(crate) async fn return_after_floods(tracker: Arc<Tracker>) {
    let mut tick = tokio::time::interval(CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (peak, active) = tracker.take_peak();
        if worth_trimming(peak, active) {
            let started = std::time::Instant::now();
            let _ = tokio::task::spawn_blocking(release_free_memory).await;
            tracing::debug!(
                peak,
                active,
                took_us = started.elapsed().as_micros() as u64,
                "connections fell; freed heap memory returned"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_only_after_a_large_enough_fall() {
        assert!(!worth_trimming(0, 0));
        assert!(!worth_trimming(TRIM_AFTER_DROP - 1, 0));
        assert!(worth_trimming(TRIM_AFTER_DROP, 0));
        assert!(worth_trimming(10_000, 9_000));
        // A rise is not a fall.
        assert!(!worth_trimming(100, 10_000));
    }

    #[test]
    fn the_peak_is_the_highest_count_since_the_last_look() {
        let t = Arc::new(Tracker::default());
        let guards: Vec<_> = (0..5).map(|_| t.admit(10).unwrap()).collect();
        drop(guards);
        let g = t.admit(10).unwrap();
        assert_eq!(t.take_peak(), (5, 1));
        // The next look starts from the count at this one.
        assert_eq!(t.take_peak(), (1, 1));
        drop(g);
        assert_eq!(t.take_peak(), (1, 0));
        assert_eq!(t.take_peak(), (0, 0));
    }
}
