//! Rate limits for log lines that traffic can repeat without bound (a backend refusing every
//! connect): at most one line per key per interval, and the line that gets through says how
//! many were suppressed since the previous one. It decides; it never logs, and it takes the
//! time as an argument.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most one line per key per interval.
#[derive(Debug)]
pub(crate) struct LogRate {
    interval: Duration,
    max_keys: usize,
    keys: Mutex<Keys>,
}

#[derive(Debug, Default)]
struct Keys {
    each: HashMap<String, Last>,
    /// Shared by every key beyond `max_keys`.
    overflow: Option<Last>,
}

#[derive(Debug, Clone, Copy)]
struct Last {
    /// When a line for the key was last let through.
    at: Instant,
    /// Lines held back since.
    suppressed: u64,
}

impl Last {
    fn new(at: Instant) -> Self {
        Last { at, suppressed: 0 }
    }
}

impl LogRate {
    /// One line per key per `interval`; at most `max_keys` keys are tracked (further keys
    /// share one allowance).
    pub(crate) fn new(interval: Duration, max_keys: usize) -> Self {
        LogRate {
            interval,
            max_keys: max_keys.max(1),
            keys: Mutex::default(),
        }
    }

    /// Whether a line for `key` may be written at `now`: `Some(suppressed)` (lines held
    /// back for the key since the last one let through) or `None` (count it and stay quiet).
    pub(crate) fn check(&self, key: &str, now: Instant) -> Option<u64> {
        // Poisoning cannot leave the map inconsistent: every update is one statement.
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        let keys = &mut *keys;
        if let Some(last) = keys.each.get_mut(key) {
            return self.step(last, now);
        }
        if keys.each.len() >= self.max_keys {
            // Full: forget every key that is due. One with lines held back loses their count
            // (its next line says 0): a key that stopped failing must not keep its slot for
            // good, or after enough of them every new key would share the overflow line.
            let interval = self.interval;
            keys.each.retain(|_, l| now.duration_since(l.at) < interval);
        }
        if keys.each.len() < self.max_keys {
            keys.each.insert(key.to_owned(), Last::new(now));
            return Some(0);
        }
        match &mut keys.overflow {
            Some(last) => self.step(last, now),
            None => {
                keys.overflow = Some(Last::new(now));
                Some(0)
            }
        }
    }

    fn step(&self, last: &mut Last, now: Instant) -> Option<u64> {
        if now.duration_since(last.at) >= self.interval {
            let suppressed = last.suppressed;
            *last = Last::new(now);
            Some(suppressed)
        } else {
            last.suppressed += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_key_per_interval_with_the_count_held_back() {
        let rate = LogRate::new(Duration::from_secs(5), 16);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert_eq!(rate.check("a", at(0)), Some(0));
        assert_eq!(rate.check("a", at(1)), None);
        assert_eq!(rate.check("a", at(4999)), None);
        // Another key has its own allowance.
        assert_eq!(rate.check("b", at(10)), Some(0));
        assert_eq!(rate.check("a", at(5000)), Some(2), "two held back");
        assert_eq!(rate.check("a", at(5001)), None);
        assert_eq!(rate.check("a", at(20_000)), Some(1));
        assert_eq!(rate.check("a", at(40_000)), Some(0));
    }

    #[test]
    fn keys_beyond_the_cap_share_one_allowance() {
        let rate = LogRate::new(Duration::from_secs(5), 2);
        let t0 = Instant::now();
        assert_eq!(rate.check("a", t0), Some(0));
        assert_eq!(rate.check("b", t0), Some(0));
        assert_eq!(rate.check("a", t0), None);
        // Full: the next new keys share one line per interval.
        assert_eq!(rate.check("c", t0), Some(0));
        assert_eq!(rate.check("d", t0), None);
        // Once due, every key makes room, with lines held back (a) or not (b): keys that
        // stopped failing cannot fill the map for good.
        let later = t0 + Duration::from_secs(6);
        assert_eq!(rate.check("e", later), Some(0));
        assert_eq!(rate.check("f", later), Some(0));
        // "a" was forgotten with its held-back line; it starts over on the overflow
        // allowance now that "e" and "f" fill the map, whose line reports "d"'s.
        assert_eq!(rate.check("a", later), Some(1));
        assert_eq!(rate.check("g", later), None);
    }
}
