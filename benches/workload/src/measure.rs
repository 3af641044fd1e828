//! Measuring helpers shared by the benches: latency percentiles and the resident set.

use std::time::Duration;

/// p50 / p99 / max of a sample, in microseconds; zeros for an empty sample.
pub fn percentiles(mut samples: Vec<Duration>) -> (f64, f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    samples.sort_unstable();
    let at = |q: f64| {
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples[i].as_secs_f64() * 1e6
    };
    (at(0.50), at(0.99), at(1.0))
}

/// Resident set size of this process, in bytes (from `/proc/self/status`; 0 where
/// that file does not exist).
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}
