//! The standard `process_*` metrics (CPU time, memory, descriptors, threads, start time),
//! read from `/proc/self` at scrape time. A file that cannot be read (out of descriptors)
//! leaves its metrics out of that scrape; it never fails the scrape.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// What `/proc/self/stat` says, in its units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stat {
    /// User CPU time, in clock ticks.
    pub utime: u64,
    /// System CPU time, in clock ticks.
    pub stime: u64,
    /// Threads.
    pub threads: u64,
    /// Start time, in clock ticks after boot.
    pub start_ticks: u64,
    /// Virtual memory, bytes.
    pub vsize: u64,
    /// Resident set, pages.
    pub rss_pages: u64,
}

/// Parses `/proc/<pid>/stat`. The command name (field 2, in parentheses) may hold spaces
/// and parentheses itself, so fields are counted from the last `)`.
pub(crate) fn parse_stat(text: &str) -> Option<Stat> {
    let (_, rest) = text.rsplit_once(')')?;
    // `rest` starts at field 3 (state): field N is at index N - 3.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        utime: field(14)?,
        stime: field(15)?,
        threads: field(20)?,
        start_ticks: field(22)?,
        vsize: field(23)?,
        rss_pages: field(24)?,
    })
}

/// The boot time (`btime`, seconds since the epoch) from `/proc/stat`.
pub(crate) fn parse_boot_time(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// Encodes the `process_*` metrics on every scrape.
#[derive(Debug)]
pub(crate) struct ProcessCollector {
    /// Seconds since the epoch when the process started (it never changes: read once).
    start_time: Option<f64>,
}

fn ticks_per_second() -> f64 {
    rustix::param::clock_ticks_per_second() as f64
}

impl ProcessCollector {
    pub(crate) fn new() -> Self {
        let boot = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|t| parse_boot_time(&t));
        let stat = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|t| parse_stat(&t));
        let start_time = match (boot, stat) {
            (Some(boot), Some(stat)) => {
                Some(boot as f64 + stat.start_ticks as f64 / ticks_per_second())
            }
            _ => None,
        };
        ProcessCollector { start_time }
    }
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: f64,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(value);
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let e = &mut encoder;
        if let Some(stat) = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|t| parse_stat(&t))
        {
            let cpu = ConstCounter::new((stat.utime + stat.stime) as f64 / ticks_per_second());
            cpu.encode(e.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                cpu.metric_type(),
            )?)?;
            let page = rustix::param::page_size() as f64;
            gauge(
                e,
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                stat.rss_pages as f64 * page,
            )?;
            gauge(
                e,
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                stat.vsize as f64,
            )?;
            gauge(
                e,
                "process_threads",
                "Number of OS threads",
                stat.threads as f64,
            )?;
        }
        if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
            // The directory's own descriptor is among the entries.
            let open = dir.count().saturating_sub(1);
            gauge(
                e,
                "process_open_fds",
                "Number of open file descriptors",
                open as f64,
            )?;
        }
        if let Some(max) = rustix::process::getrlimit(rustix::process::Resource::Nofile).current {
            gauge(
                e,
                "process_max_fds",
                "Maximum number of open file descriptors",
                max as f64,
            )?;
        }
        if let Some(start) = self.start_time {
            gauge(
                e,
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                start,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        let line = "4242 (tre) (llis x) S 1 4242 4242 0 -1 4194560 1500 0 0 0 \
                    37 12 0 0 20 0 9 0 123456 987654321 2048 18446744073709551615 \
                    1 1 0 0 0 0 0 4096 17475 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                utime: 37,
                stime: 12,
                threads: 9,
                start_ticks: 123456,
                vsize: 987654321,
                rss_pages: 2048,
            })
        );
        assert_eq!(parse_stat("4242 (cut short) S 1 2"), None);
        assert_eq!(parse_stat(""), None);
    }

    #[test]
    fn this_process_has_a_stat_and_a_boot_time() {
        let stat = parse_stat(&std::fs::read_to_string("/proc/self/stat").unwrap()).unwrap();
        assert!(stat.threads >= 1 && stat.rss_pages > 0 && stat.vsize > 0);
        let boot = parse_boot_time(&std::fs::read_to_string("/proc/stat").unwrap()).unwrap();
        assert!(boot > 1_000_000_000);
        assert_eq!(
            parse_boot_time("cpu 1 2\nbtime 1700000000\n"),
            Some(1_700_000_000)
        );
    }
}
