//! Measuring helpers shared by the benches and the measurement examples
//! (`tests/examples`): latency quantiles and the resident set.
//!
//! Quantiles come from an HDR histogram (`hdrhistogram`) of nanoseconds, 1 ns to
//! 1 hour, with 3 significant digits: within 0.1 % of the exact order statistic, at a
//! fixed cost per sample and about 300 KiB however many samples are recorded.

use hdrhistogram::Histogram;
use std::time::Duration;

/// Longest latency a [`latencies`] histogram tells apart: 1 hour, in nanoseconds.
const MAX_NANOS: u64 = 3_600_000_000_000;

/// A histogram of `samples`, in nanoseconds, 3 significant digits; a sample over
/// 1 hour is recorded as 1 hour.
pub fn latencies(samples: impl IntoIterator<Item = Duration>) -> Histogram<u64> {
    // Bounds 1 ≤ 2 ≤ MAX_NANOS and 3 significant digits are valid, so this cannot fail.
    let mut histogram =
        Histogram::new_with_bounds(1, MAX_NANOS, 3).expect("valid histogram bounds");
    for sample in samples {
        histogram.saturating_record(u64::try_from(sample.as_nanos()).unwrap_or(u64::MAX));
    }
    histogram
}

/// The `q` quantile (0 to 1) of a [`latencies`] histogram, in milliseconds; NaN when
/// it is empty.
pub fn quantile_ms(histogram: &Histogram<u64>, q: f64) -> f64 {
    if histogram.is_empty() {
        return f64::NAN;
    }
    histogram.value_at_quantile(q) as f64 / 1e6
}

/// p50 / p99 / max of a sample, in microseconds; zeros for an empty sample.
pub fn percentiles(samples: Vec<Duration>) -> (f64, f64, f64) {
    let histogram = latencies(samples);
    if histogram.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    let us = |q: f64| quantile_ms(&histogram, q) * 1e3;
    (us(0.50), us(0.99), histogram.max() as f64 / 1e3)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_a_thousandth_of_the_order_statistics() {
        let histogram = latencies((1..=1000).map(Duration::from_millis));
        let close = |got: f64, want: f64| (got - want).abs() <= want * 1e-3;
        assert!(close(quantile_ms(&histogram, 0.5), 500.0));
        assert!(close(quantile_ms(&histogram, 0.99), 990.0));
        let (p50, p99, max) = percentiles(vec![Duration::from_nanos(1500); 3]);
        assert!(close(p50, 1.5) && close(p99, 1.5) && close(max, 1.5));
        assert!(quantile_ms(&latencies([]), 0.5).is_nan());
        assert_eq!(percentiles(Vec::new()), (0.0, 0.0, 0.0));
    }
}
