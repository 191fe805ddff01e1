//! Records a skipped test for the test command's summary (see [`record_skip`]).

use std::io::Write as _;

/// Appends `SKIP test: reason` to the file `TRELLIS_SKIPPED` names, if it names one.
pub(crate) fn record_skip(test: &str, reason: &str) {
    let Some(path) = std::env::var_os("TRELLIS_SKIPPED") else {
        return;
    };
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(f, "SKIP {test}: {reason}");
    }
}
