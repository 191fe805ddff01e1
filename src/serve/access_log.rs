//! The access log's own writer: each line is formatted straight into a reused buffer (JSON
//! in the shape `--log-format json` gives every other line, or text) and appended to one
//! shared pending buffer, which a thread of its own writes to stderr at most every
//! [`FLUSH_EVERY`], or sooner once [`FLUSH_AT`] bytes wait. A connection's task therefore
//! never formats through the tracing layers nor makes a system call for its line: at tens
//! of thousands of connections a second, one `write` per line was most of what the log
//! cost.
//!
//! Whether lines are written still follows the log filter (`TRELLIS_LOG`): a line is formed
//! only when `trellis::access` is enabled at info. When stderr cannot keep up, at most
//! [`MAX_PENDING`] bytes wait; lines past that are dropped and the drop is said in a warning
//! with the count. A process killed outright loses at most the last [`FLUSH_EVERY`] of
//! lines; [`flush`] writes what waits (the roles' exit path calls it). Nothing here knows
//! what a connection is: [`super::record`] hands it the fields.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Longest a line waits before it is written.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// Pending bytes that wake the writer before [`FLUSH_EVERY`].
pub(crate) const FLUSH_AT: usize = 64 * 1024;
/// Most bytes waiting to be written; lines past it are dropped and counted.
pub(crate) const MAX_PENDING: usize = 4 * 1024 * 1024;

/// How lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON object per line, fields flattened, as `--log-format json` writes events.
    Json,
    /// `timestamp  INFO trellis::access: access key=value ...`, as the text format does.
    Text,
}

/// A field's value.
#[derive(Clone, Copy)]
pub(crate) enum Value<'a> {
    /// A string (escaped as needed).
    Str(&'a str),
    /// A whole number.
    U64(u64),
    /// A boolean.
    Bool(bool),
    /// Anything else that displays (an address, a reason), escaped as needed.
    Fmt(&'a dyn std::fmt::Display),
}

/// The lines waiting for the writer.
#[derive(Debug, Default)]
struct Pending {
    bytes: Vec<u8>,
    /// Lines dropped since the last warning.
    dropped: u64,
}

/// The process's access log.
#[derive(Debug)]
struct Sink {
    format: Format,
    pending: Mutex<Pending>,
    wake: Condvar,
    /// Held from taking lines to having written them, by the writer and by [`flush`]: lines
    /// are written in the order they were taken, and [`flush`] returns only after a batch
    /// the writer took is written.
    writing: Mutex<()>,
}

static SINK: OnceLock<Sink> = OnceLock::new();

thread_local! {
    /// Each thread's line buffer, reused for every line it forms.
    static LINE: RefCell<String> = RefCell::new(String::with_capacity(512));
}

/// Installs the access log in `format` and starts its writer thread. Lines formed before,
/// or when this was never called (a library user), are not written. A second call changes
/// nothing.
pub fn init(format: Format) {
    let mut started = false;
    SINK.get_or_init(|| {
        started = true;
        Sink {
            format,
            pending: Mutex::new(Pending::default()),
            wake: Condvar::new(),
            writing: Mutex::new(()),
        }
    });
    if started {
        let spawned = std::thread::Builder::new()
            .name("trellis-access-log".into())
            .spawn(|| {
                if let Some(sink) = SINK.get() {
                    writer(sink)
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the access log's writer; lines are written when the process exits");
        }
    }
}

/// Writes every line waiting, now.
pub fn flush() {
    if let Some(sink) = SINK.get() {
        let _writing = sink.writing.lock().unwrap_or_else(|e| e.into_inner());
        let (bytes, dropped) = sink.take();
        write_out(&bytes, dropped);
    }
}

/// Whether a line would be written: the log is installed and its filter admits it.
pub(crate) fn enabled() -> bool {
    SINK.get().is_some() && tracing::enabled!(target: "trellis::access", tracing::Level::INFO)
}

/// Forms one line of `fields` with `message` and queues it (when [`enabled`]).
pub(crate) fn line(message: &str, fields: &[(&str, Value<'_>)]) {
    let Some(sink) = SINK.get() else { return };
    if !tracing::enabled!(target: "trellis::access", tracing::Level::INFO) {
        return;
    }
    LINE.with(|buf| {
        // A reentrant use (impossible today) gets a fresh buffer instead of a panic.
        let mut fresh = String::new();
        let mut guard = buf.try_borrow_mut();
        let out: &mut String = match &mut guard {
            Ok(b) => b,
            Err(_) => &mut fresh,
        };
        out.clear();
        match sink.format {
            Format::Json => json_line(out, SystemTime::now(), message, fields),
            Format::Text => text_line(out, SystemTime::now(), message, fields),
        }
        sink.push(out.as_bytes());
    });
}

impl Sink {
    fn push(&self, line: &[u8]) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if p.bytes.len() + line.len() > MAX_PENDING {
            p.dropped += 1;
            return;
        }
        let before = p.bytes.len();
        p.bytes.extend_from_slice(line);
        // Once per batch, when it crosses the mark: not a wake-up call per line after it.
        if before < FLUSH_AT && p.bytes.len() >= FLUSH_AT {
            self.wake.notify_one();
        }
    }

    /// What waits, and the lines dropped since the last take.
    fn take(&self) -> (Vec<u8>, u64) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        (std::mem::take(&mut p.bytes), std::mem::take(&mut p.dropped))
    }
}

/// The writer thread: every [`FLUSH_EVERY`], or when woken, writes what waits.
fn writer(sink: &Sink) {
    loop {
        {
            let p = sink.pending.lock().unwrap_or_else(|e| e.into_inner());
            let _ = sink
                .wake
                .wait_timeout_while(p, FLUSH_EVERY, |p| p.bytes.len() < FLUSH_AT)
                .unwrap_or_else(|e| e.into_inner());
        }
        let _writing = sink.writing.lock().unwrap_or_else(|e| e.into_inner());
        // The spare room goes with the bytes: a burst's buffer is not kept for good.
        let (bytes, dropped) = sink.take();
        write_out(&bytes, dropped);
    }
}

fn write_out(bytes: &[u8], dropped: u64) {
    if !bytes.is_empty() {
        // Nowhere to say that stderr failed: the line is lost as the tracing writer's would be.
        let _ = std::io::stderr().lock().write_all(bytes);
    }
    if dropped > 0 {
        tracing::warn!(
            dropped,
            pending_limit = MAX_PENDING,
            "access log lines dropped: stderr did not keep up"
        );
    }
}

/// Appends `s` as a JSON string (quotes included).
fn json_str(out: &mut String, s: &str) {
    out.push('"');
    let mut start = 0;
    for (i, c) in s.char_indices() {
        let escaped = match c {
            '"' => "\\\"",
            '\\' => "\\\\",
            '\n' => "\\n",
            '\r' => "\\r",
            '\t' => "\\t",
            c if (c as u32) < 0x20 || c == '\u{7f}' => "",
            _ => continue,
        };
        out.push_str(&s[start..i]);
        if escaped.is_empty() {
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push_str(escaped);
        }
        start = i + c.len_utf8();
    }
    out.push_str(&s[start..]);
    out.push('"');
}

fn json_line(out: &mut String, now: SystemTime, message: &str, fields: &[(&str, Value<'_>)]) {
    out.push_str("{\"timestamp\":\"");
    timestamp(out, now);
    out.push_str("\",\"level\":\"INFO\",\"message\":");
    json_str(out, message);
    for (key, value) in fields {
        out.push(',');
        json_str(out, key);
        out.push(':');
        match value {
            Value::Str(s) => json_str(out, s),
            Value::U64(n) => {
                let _ = write!(out, "{n}");
            }
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Fmt(d) => {
                // Written in place; escaped only when it needs it (it never does for the
                // addresses and reasons it carries).
                let at = out.len();
                let _ = write!(out, "{d}");
                let plain = out[at..]
                    .chars()
                    .all(|c| c != '"' && c != '\\' && !c.is_control());
                if plain {
                    out.insert(at, '"');
                    out.push('"');
                } else {
                    let raw = out.split_off(at);
                    json_str(out, &raw);
                }
            }
        }
    }
    out.push_str(",\"target\":\"trellis::access\"}\n");
}

fn text_line(out: &mut String, now: SystemTime, message: &str, fields: &[(&str, Value<'_>)]) {
    timestamp(out, now);
    out.push_str("  INFO trellis::access: ");
    out.push_str(message);
    for (key, value) in fields {
        let _ = match value {
            // Quoted and escaped, as the text format writes strings: a client-chosen value
            // cannot break the line apart.
            Value::Str(s) => write!(out, " {key}={s:?}"),
            Value::U64(n) => write!(out, " {key}={n}"),
            Value::Bool(b) => write!(out, " {key}={b}"),
            Value::Fmt(d) => write!(out, " {key}={d}"),
        };
    }
    out.push('\n');
}

/// Appends `now` as RFC 3339 in UTC with microseconds (`2026-11-26T16:21:20.507163Z`), as
/// the other log lines have it.
fn timestamp(out: &mut String, now: SystemTime) {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    let _ = write!(
        out,
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        since.subsec_micros()
    );
}

/// The proleptic Gregorian date of `days` since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_match_known_days() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(59), (1970, 3, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_513), (2026, 3, 1));
        let mut s = String::new();
        timestamp(
            &mut s,
            UNIX_EPOCH + Duration::from_micros(1_795_710_080_507_163),
        );
        assert_eq!(s, "2026-11-26T16:21:20.507163Z");
    }

    /// Whatever a client put in a field, the line is one JSON object on one line with the
    /// field's exact value.
    #[test]
    fn a_json_line_carries_every_value_exactly() {
        let nasty = "a\"b\\c\nd\re\tf\u{1}g\u{7f}h ü 🙂";
        let mut out = String::new();
        json_line(
            &mut out,
            UNIX_EPOCH,
            "access",
            &[
                ("target_name", Value::Str(nasty)),
                ("rx_bytes", Value::U64(u64::MAX)),
                ("periodic", Value::Bool(false)),
                ("client", Value::Fmt(&"[::1]:443")),
                ("reason", Value::Fmt(&nasty)),
            ],
        );
        assert_eq!(out.matches('\n').count(), 1);
        assert!(out.ends_with('\n'));
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["target_name"], nasty);
        assert_eq!(v["rx_bytes"], u64::MAX);
        assert_eq!(v["periodic"], false);
        assert_eq!(v["client"], "[::1]:443");
        assert_eq!(v["reason"], nasty);
        assert_eq!(v["target"], "trellis::access");
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["message"], "access");
        assert_eq!(v["timestamp"], "1970-01-01T00:00:00.000000Z");
    }

    #[test]
    fn a_text_line_stays_one_line() {
        let mut out = String::new();
        text_line(
            &mut out,
            UNIX_EPOCH,
            "access",
            &[
                ("route", Value::Str("r")),
                ("target_name", Value::Str("x\ny z")),
                ("rx_bytes", Value::U64(7)),
            ],
        );
        assert_eq!(
            out,
            "1970-01-01T00:00:00.000000Z  INFO trellis::access: access route=\"r\" target_name=\"x\\ny z\" rx_bytes=7\n"
        );
    }

    /// Past [`MAX_PENDING`] lines are dropped and counted, never queued.
    #[test]
    fn a_full_buffer_drops_and_counts() {
        let sink = Sink {
            format: Format::Json,
            pending: Mutex::new(Pending::default()),
            wake: Condvar::new(),
            writing: Mutex::new(()),
        };
        let line = vec![b'x'; 1000];
        for _ in 0..(MAX_PENDING / 1000 + 10) {
            sink.push(&line);
        }
        let (bytes, dropped) = sink.take();
        assert!(bytes.len() <= MAX_PENDING);
        assert_eq!(bytes.len(), MAX_PENDING / 1000 * 1000);
        assert_eq!(dropped, 10);
        let (bytes, dropped) = sink.take();
        assert!(bytes.is_empty() && dropped == 0);
    }
}
