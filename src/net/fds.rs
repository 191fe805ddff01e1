//! The process's descriptor budget: how many connections the open-files limit allows once
//! what else the process holds is set aside, the budget of pipes that spliced connections
//! take on top of their two sockets, and a summary log for accepts that fail because the
//! process is out of descriptors.
//!
//! Name lookups hold sockets while in flight: the resolver looks up at most
//! [`Budget::lookups`] names at once, [`SOCKETS_PER_LOOKUP`] sockets each, and those come
//! out of the limit before connections do.
//!
//! A relayed connection holds two sockets (client and backend); a direction that splices
//! holds a pipe as well, two descriptors more. Pipes come from a budget of their own
//! ([`PipeSlot`]): a direction splices only when a pipe fits in it, and copies otherwise, so
//! `maxConnections` connections with every pipe in use still fit under the limit. It never
//! opens a socket.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// Sockets a relayed connection holds: the client's and the backend's.
pub const SOCKETS_PER_CONNECTION: u64 = 2;
/// Descriptors a pipe holds (read and write end).
pub const DESCRIPTORS_PER_PIPE: u64 = 2;
/// Descriptors set aside for what is not a connection and does not grow with the workers:
/// the routing-table watch, name lookups, logs, the control plane's event loop. The
/// listening sockets and the workers' event loops are counted apart ([`Budget::plan`]'s
/// `fixed`), as they grow with `workers`.
pub const BASE_RESERVE: u64 = 64;
/// Descriptors each event loop holds for itself (its epoll instance and its wake-up
/// eventfd).
pub const PER_EVENT_LOOP: u64 = 2;
/// Descriptors set aside for the admin server: its listeners, the connections it holds and
/// the spare descriptors it keeps to answer probes when everything else is taken.
pub const ADMIN_RESERVE: u64 = 96;
/// Most pipes in use at once, however high the limit: past a few hundred bulk flows more
/// pipes only add pipe memory.
pub const MAX_PIPES: usize = 1024;
/// Share of the descriptors left for connections that pipes may take: one in
/// `PIPE_SHARE`.
const PIPE_SHARE: u64 = 8;
/// Sockets one name lookup may hold at once: A and AAAA are asked together, and hickory's
/// resolver sends a query again, on a fresh UDP socket, up to three times within its timeout.
pub const SOCKETS_PER_LOOKUP: u64 = 2 * 3;
/// Most names looked up at once, however high the limit.
pub const MAX_LOOKUPS: usize = 64;
/// Share of the descriptors left after the reserve that name lookups may take: one in
/// `LOOKUP_SHARE`.
const LOOKUP_SHARE: u64 = 16;

/// How the open-files limit is divided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// The open-files limit (soft).
    pub nofile: u64,
    /// Descriptors set aside ([`BASE_RESERVE`] + [`ADMIN_RESERVE`] + the role's listening
    /// sockets and event loops).
    pub reserve: u64,
    /// Names that may be looked up at once ([`SOCKETS_PER_LOOKUP`] sockets each).
    pub lookups: usize,
    /// Pipes that may be in use at once.
    pub pipes: usize,
    /// `limits.maxConnections` as configured.
    pub requested: usize,
    /// The connections the process admits: the configured number, or fewer when the limit
    /// cannot hold that many.
    pub max_connections: usize,
}

impl Budget {
    /// Divides `nofile` descriptors: the reserve first, then at most one in [`LOOKUP_SHARE`]
    /// of the rest for name lookups (at most [`MAX_LOOKUPS`]), one in [`PIPE_SHARE`] of what
    /// is left for pipes (at most [`MAX_PIPES`]), then [`SOCKETS_PER_CONNECTION`] per
    /// connection, up to `requested`. `fixed` is what the role holds whatever its load: its
    /// listening sockets and its event loops' own descriptors ([`Budget::fixed`]).
    pub fn plan(nofile: u64, requested: usize, fixed: u64) -> Budget {
        let reserve = BASE_RESERVE + ADMIN_RESERVE + fixed;
        let left = nofile.saturating_sub(reserve);
        let lookups = (left / LOOKUP_SHARE / SOCKETS_PER_LOOKUP).min(MAX_LOOKUPS as u64);
        let left = left - lookups * SOCKETS_PER_LOOKUP;
        let pipes = (left / PIPE_SHARE / DESCRIPTORS_PER_PIPE).min(MAX_PIPES as u64);
        let for_sockets = left - pipes * DESCRIPTORS_PER_PIPE;
        let fit = for_sockets / SOCKETS_PER_CONNECTION;
        Budget {
            nofile,
            reserve,
            lookups: lookups as usize,
            pipes: pipes as usize,
            requested,
            max_connections: (requested as u64).min(fit) as usize,
        }
    }

    /// What a role with `event_loops` event loops, each with its own socket for each of
    /// `listeners` listeners (the gateway's `SO_REUSEPORT` sockets per worker), holds
    /// whatever its load.
    pub fn fixed(event_loops: usize, listeners: usize) -> u64 {
        (event_loops as u64).saturating_mul(listeners as u64 + PER_EVENT_LOOP)
    }

    /// Whether `maxConnections` had to be lowered.
    pub fn capped(&self) -> bool {
        self.max_connections < self.requested
    }

    /// Descriptors the process may hold with every connection, pipe and lookup in use.
    pub fn descriptors(&self) -> u64 {
        self.reserve
            + self.lookups as u64 * SOCKETS_PER_LOOKUP
            + self.max_connections as u64 * SOCKETS_PER_CONNECTION
            + self.pipes as u64 * DESCRIPTORS_PER_PIPE
    }
}

/// Raises the open-files limit as far as allowed, divides it ([`Budget::plan`]), installs
/// the pipe budget, and says at start what the process will admit: at info when
/// `maxConnections` fits, as a warning with the numbers when it is lowered.
pub fn apply(requested: usize, fixed: u64) -> Budget {
    let nofile = match super::socket::raise_nofile_limit() {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(error = %e, "could not raise the open files limit");
            rustix::process::getrlimit(rustix::process::Resource::Nofile)
                .current
                .unwrap_or(u64::MAX)
        }
    };
    let budget = Budget::plan(nofile, requested, fixed);
    set_pipe_budget(budget.pipes);
    LOOKUPS.store(budget.lookups, Ordering::SeqCst);
    if budget.capped() {
        tracing::warn!(
            nofile,
            requested,
            max_connections = budget.max_connections,
            per_connection = SOCKETS_PER_CONNECTION,
            pipes = budget.pipes,
            reserve = budget.reserve,
            "limits.maxConnections lowered to what the open files limit holds ({} sockets per \
             connection, {} descriptors per pipe, a reserve for listeners and the admin \
             server); raise the limit to admit more",
            SOCKETS_PER_CONNECTION,
            DESCRIPTORS_PER_PIPE,
        );
    } else {
        tracing::info!(
            nofile,
            max_connections = budget.max_connections,
            pipes = budget.pipes,
            lookups = budget.lookups,
            reserve = budget.reserve,
            "descriptor budget"
        );
    }
    budget
}

/// Names the process may look up at once ([`apply`]; [`MAX_LOOKUPS`] until then).
static LOOKUPS: AtomicUsize = AtomicUsize::new(MAX_LOOKUPS);

/// How many names the process's resolver may look up at once: the budget's share, and one
/// at least (out of [`BASE_RESERVE`]) when the limit is too low for a share.
pub fn lookup_budget() -> usize {
    LOOKUPS.load(Ordering::SeqCst).max(1)
}

/// A bound on the pipes in use at once.
#[derive(Debug)]
pub(crate) struct PipeBudget {
    in_use: AtomicUsize,
    limit: AtomicUsize,
}

/// The process's pipe budget ([`set_pipe_budget`]; [`MAX_PIPES`] until then).
pub(crate) static PIPES: PipeBudget = PipeBudget::new(MAX_PIPES);

/// Sets how many pipes the process may have in use at once.
pub fn set_pipe_budget(pipes: usize) {
    PIPES.limit.store(pipes, Ordering::SeqCst);
}

/// Pipes the process has in use now.
pub fn pipes_in_use() -> usize {
    PIPES.in_use.load(Ordering::SeqCst)
}

impl PipeBudget {
    /// A budget of `limit` pipes, none in use.
    pub(crate) const fn new(limit: usize) -> Self {
        PipeBudget {
            in_use: AtomicUsize::new(0),
            limit: AtomicUsize::new(limit),
        }
    }

    /// A place for one more pipe, if the budget has one.
    pub(crate) fn take(&'static self) -> Option<PipeSlot> {
        let limit = self.limit.load(Ordering::Relaxed);
        self.in_use
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| PipeSlot(self))
    }
}

/// One pipe's place in a [`PipeBudget`], given back on drop.
#[derive(Debug)]
pub(crate) struct PipeSlot(&'static PipeBudget);

impl Drop for PipeSlot {
    fn drop(&mut self) {
        self.0.in_use.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether an accept error means the process or system is out of resources (`EMFILE`,
/// `ENFILE`, `ENOBUFS`, `ENOMEM`).
pub fn is_resource_error(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(code) if code == rustix::io::Errno::MFILE.raw_os_error()
            || code == rustix::io::Errno::NFILE.raw_os_error()
            || code == rustix::io::Errno::NOBUFS.raw_os_error()
            || code == rustix::io::Errno::NOMEM.raw_os_error()
    )
}

/// Says that accepts fail at most once per interval, with the number of failures since the
/// last line, instead of once per failure: out of descriptors, a loop that retries every
/// few milliseconds would otherwise fill the log.
#[derive(Debug, Clone)]
pub struct FailureLog {
    interval: Duration,
    /// Before this, failures are counted, not said.
    quiet_until: Option<Instant>,
    unsaid: u64,
}

impl FailureLog {
    /// The usual interval between two lines.
    pub const INTERVAL: Duration = Duration::from_secs(10);

    /// A log that says at most one line per `interval`.
    pub fn new(interval: Duration) -> Self {
        FailureLog {
            interval,
            quiet_until: None,
            unsaid: 0,
        }
    }

    /// Counts a failure at `now`. When a line is due, returns the failures to report in it
    /// (this one included): the first failure is said at once, later ones once `interval`
    /// has passed since the last line.
    pub fn failed(&mut self, now: Instant) -> Option<u64> {
        self.unsaid += 1;
        self.due(now)
    }

    /// Failures counted but not said yet.
    pub fn unsaid(&self) -> u64 {
        self.unsaid
    }

    /// An accept succeeded at `now`: returns the failures not said yet when a line is due
    /// (so the end of a bad spell is said with its count), `None` otherwise.
    pub fn succeeded(&mut self, now: Instant) -> Option<u64> {
        if self.unsaid == 0 {
            return None;
        }
        self.due(now)
    }

    fn due(&mut self, now: Instant) -> Option<u64> {
        if self.quiet_until.is_some_and(|t| now < t) {
            return None;
        }
        self.quiet_until = Some(now + self.interval);
        Some(std::mem::take(&mut self.unsaid))
    }
}

impl Default for FailureLog {
    fn default() -> Self {
        Self::new(Self::INTERVAL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_counts_pipes_and_the_reserve() {
        // The usual limit cannot hold the 750,000 connections of a large seed's config at
        // two sockets each.
        let b = Budget::plan(1_048_576, 750_000, 0);
        assert!(b.capped());
        assert_eq!(b.pipes, MAX_PIPES);
        assert_eq!(b.lookups, MAX_LOOKUPS);
        assert_eq!(b.max_connections, (1_048_576 - 160 - 64 * 6 - 2 * 1024) / 2);
        assert!(b.descriptors() <= b.nofile);
        // A limit that holds the request leaves it alone.
        let b = Budget::plan(1_048_576, 10_000, 0);
        assert!(!b.capped());
        assert_eq!(b.max_connections, 10_000);
        // A low limit: reserve first, a sixteenth of the rest for lookups, an eighth of what
        // is left for pipes.
        let b = Budget::plan(256, 750_000, 0);
        assert_eq!(
            (b.reserve, b.lookups, b.pipes, b.max_connections),
            (160, 1, 5, 40)
        );
        assert!(b.descriptors() <= 256);
        // Below the reserve, nothing is admitted.
        assert_eq!(Budget::plan(100, 10, 0).max_connections, 0);
        // Every worker's listening sockets and event loop come out of the limit: 64
        // workers with 3 listeners hold 320 descriptors before the first connection.
        assert_eq!(Budget::fixed(64, 3), 320);
        let b = Budget::plan(1_048_576, 750_000, Budget::fixed(64, 3));
        assert_eq!(b.reserve, 160 + 320);
        assert_eq!(b.max_connections, (1_048_576 - 480 - 64 * 6 - 2 * 1024) / 2);
    }

    #[test]
    fn every_plan_fits_under_its_limit() {
        for nofile in (0..5000).chain([65_536, 1_048_576, u64::from(u32::MAX)]) {
            let b = Budget::plan(nofile, usize::MAX, Budget::fixed(64, 3));
            assert!(
                b.descriptors() <= nofile.max(b.reserve),
                "{nofile}: {b:?} needs {}",
                b.descriptors()
            );
        }
    }

    #[test]
    fn pipe_slots_stop_at_the_budget() {
        static BUDGET: PipeBudget = PipeBudget::new(2);
        let a = BUDGET.take().unwrap();
        let b = BUDGET.take().unwrap();
        assert!(BUDGET.take().is_none(), "budget exhausted");
        drop(a);
        let c = BUDGET.take().expect("a returned slot is taken again");
        drop((b, c));
        assert_eq!(BUDGET.in_use.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn only_resource_errors_count() {
        for errno in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM] {
            assert!(is_resource_error(&io::Error::from_raw_os_error(errno)));
        }
        for errno in [libc::ECONNABORTED, libc::EPERM, libc::EINTR] {
            assert!(!is_resource_error(&io::Error::from_raw_os_error(errno)));
        }
    }

    /// One line per interval with the count since the last one, whatever the failure rate.
    #[tokio::test(start_paused = true)]
    async fn failures_are_said_once_per_interval() {
        let mut log = FailureLog::new(Duration::from_secs(10));
        let mut lines = Vec::new();
        // A failure every 5 ms for 25 s.
        for _ in 0..5000 {
            if let Some(n) = log.failed(Instant::now()) {
                lines.push(n);
            }
            tokio::time::advance(Duration::from_millis(5)).await;
        }
        // At 0 s (the first), 10 s and 20 s; each counts the failures since the last.
        assert_eq!(lines, [1, 2000, 2000]);
        assert_eq!(log.unsaid(), 999);
        // A success before the interval is up says nothing...
        assert_eq!(log.succeeded(Instant::now()), None);
        // ...one after it says the rest, once.
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(log.succeeded(Instant::now()), Some(999));
        assert_eq!(log.succeeded(Instant::now()), None);
        // Successes alone never log.
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(log.succeeded(Instant::now()), None);
        // The next bad spell starts with a line at once.
        assert_eq!(log.failed(Instant::now()), Some(1));
    }
}
