//! The bounds of one relayed connection as a pure type: idle timeout, maximum lifetime,
//! half-close window and the periodic progress call. It never reads a clock: the relay
//! passes `now` in, so the rules are unit-tested without sleeping.

use std::time::Duration;

use tokio::time::Instant;

use super::Limits;

/// Far enough to mean "never" for a deadline that would overflow.
const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `t + d`, saturating at "never" instead of panicking on overflow.
pub(crate) fn later(t: Instant, d: Duration) -> Instant {
    t.checked_add(d).or_else(|| t.checked_add(FAR)).unwrap_or(t)
}

/// Which bound a timer firing at `now` hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Due {
    /// The connection has lived `max_duration`.
    MaxDuration,
    /// One direction ended `half_close` ago and the other has not.
    HalfClose,
    /// No bytes moved for `idle`.
    Idle,
    /// Time for a progress line (the next one is scheduled).
    Progress,
}

/// Every deadline of one relay.
#[derive(Debug, Clone)]
pub(crate) struct Deadlines {
    idle: Duration,
    half_close: Duration,
    progress_every: Option<Duration>,
    /// When bytes last moved in either direction.
    pub(crate) activity: Instant,
    max_at: Option<Instant>,
    half_at: Option<Instant>,
    progress_at: Option<Instant>,
}

impl Deadlines {
    /// The deadlines of a relay that starts at `start`.
    pub(crate) fn new(start: Instant, limits: &Limits) -> Self {
        let bound = |d: Option<Duration>| d.map(|d| later(start, d));
        Deadlines {
            idle: limits.idle,
            half_close: limits.half_close,
            progress_every: limits.progress,
            activity: start,
            max_at: bound(limits.max_duration),
            half_at: None,
            progress_at: bound(limits.progress),
        }
    }

    /// One direction ended at `now`: the other has `half_close` left. Later calls keep the
    /// first window.
    pub(crate) fn half_closed(&mut self, now: Instant) {
        if self.half_at.is_none() {
            self.half_at = Some(later(now, self.half_close));
        }
    }

    /// Whether the half-close window runs.
    pub(crate) fn is_half_closed(&self) -> bool {
        self.half_at.is_some()
    }

    /// The earliest deadline: when the timer must fire next.
    pub(crate) fn next(&self) -> Instant {
        let idle = later(self.activity, self.idle);
        [self.max_at, self.half_at, self.progress_at]
            .into_iter()
            .flatten()
            .fold(idle, std::cmp::min)
    }

    /// The bound hit at `now`, if any, in order of precedence: lifetime, half-close, idle,
    /// progress. A due progress call is rescheduled `every` after `now`.
    pub(crate) fn due(&mut self, now: Instant) -> Option<Due> {
        if self.max_at.is_some_and(|t| t <= now) {
            return Some(Due::MaxDuration);
        }
        if self.half_at.is_some_and(|t| t <= now) {
            return Some(Due::HalfClose);
        }
        if later(self.activity, self.idle) <= now {
            return Some(Due::Idle);
        }
        if let (Some(t), Some(every)) = (self.progress_at, self.progress_every)
            && t <= now
        {
            self.progress_at = Some(later(now, every));
            return Some(Due::Progress);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn limits(idle: u64, half: u64, max: Option<u64>, progress: Option<u64>) -> Limits {
        Limits {
            idle: S * idle as u32,
            half_close: S * half as u32,
            max_duration: max.map(|m| S * m as u32),
            progress: progress.map(|p| S * p as u32),
        }
    }

    #[test]
    fn idle_counts_from_the_last_activity() {
        let t0 = Instant::now();
        let mut d = Deadlines::new(t0, &limits(10, 5, None, None));
        assert_eq!(d.next(), t0 + 10 * S);
        assert_eq!(d.due(t0 + 9 * S), None);
        d.activity = t0 + 8 * S;
        assert_eq!(d.next(), t0 + 18 * S);
        assert_eq!(d.due(t0 + 17 * S), None);
        assert_eq!(d.due(t0 + 18 * S), Some(Due::Idle));
    }

    #[test]
    fn half_close_window_starts_once_and_beats_idle() {
        let t0 = Instant::now();
        let mut d = Deadlines::new(t0, &limits(100, 3, None, None));
        assert!(!d.is_half_closed());
        d.half_closed(t0 + S);
        assert!(d.is_half_closed());
        // A second end (or a repeated call) does not move the window.
        d.half_closed(t0 + 2 * S);
        assert_eq!(d.next(), t0 + 4 * S);
        // Activity keeps the idle bound away but not the half-close one.
        d.activity = t0 + 3 * S;
        assert_eq!(d.due(t0 + 3 * S), None);
        assert_eq!(d.due(t0 + 4 * S), Some(Due::HalfClose));
    }

    /// Both due at once: the half-close window, which says how the connection ended, wins
    /// over idle; the lifetime wins over both.
    #[test]
    fn precedence_when_bounds_are_due_together() {
        let t0 = Instant::now();
        let mut d = Deadlines::new(t0, &limits(10, 10, None, None));
        d.half_closed(t0);
        assert_eq!(d.due(t0 + 10 * S), Some(Due::HalfClose));
        let mut d = Deadlines::new(t0, &limits(10, 10, Some(10), None));
        d.half_closed(t0);
        assert_eq!(d.due(t0 + 10 * S), Some(Due::MaxDuration));
        let mut d = Deadlines::new(t0, &limits(10, 10, None, Some(10)));
        assert_eq!(
            d.due(t0 + 10 * S),
            Some(Due::Idle),
            "a progress call never hides idle"
        );
    }

    #[test]
    fn lifetime_takes_precedence_and_ignores_activity() {
        let t0 = Instant::now();
        let mut d = Deadlines::new(t0, &limits(10, 5, Some(20), None));
        d.half_closed(t0 + 15 * S);
        d.activity = t0 + 19 * S;
        assert_eq!(d.next(), t0 + 20 * S);
        assert_eq!(d.due(t0 + 20 * S), Some(Due::MaxDuration));
    }

    #[test]
    fn progress_is_periodic_and_never_ends_the_relay() {
        let t0 = Instant::now();
        let mut d = Deadlines::new(t0, &limits(100, 5, None, Some(7)));
        assert_eq!(d.next(), t0 + 7 * S);
        assert_eq!(d.due(t0 + 6 * S), None);
        // Late by a second: the next one is `every` after the call, not after the slot.
        assert_eq!(d.due(t0 + 8 * S), Some(Due::Progress));
        assert_eq!(d.next(), t0 + 15 * S);
        assert_eq!(d.due(t0 + 9 * S), None);
    }

    #[test]
    fn huge_bounds_saturate_instead_of_overflowing() {
        let t0 = Instant::now();
        let huge = Duration::from_secs(u64::MAX / 4);
        let mut d = Deadlines::new(
            t0,
            &Limits {
                idle: huge,
                half_close: huge,
                max_duration: Some(huge),
                progress: None,
            },
        );
        d.half_closed(t0);
        assert!(d.next() > t0 + 50 * 365 * 24 * 3600 * S);
        assert_eq!(d.due(t0 + 3600 * S), None);
    }
}
