//! Latency statistics of a run of the model: mean and percentiles, in model ms.
//!
//! The online replay (`kv-mocker replay`) and the offline lab report the same
//! statistics of the same quantities (TTFT, ITL, end-to-end latency), so they are
//! computed once, here, with an HDR histogram (`hdrhistogram`) rather than by sorting
//! every sample. Samples are recorded in whole microseconds with 3 significant digits:
//! a percentile is reported as the middle of the histogram bucket holding the
//! nearest-rank sample (the smallest sample with at least `q · n` samples at or below
//! it), so it is within 0.1% (plus 1 µs of rounding) of that sample. The mean is
//! exact. Negative and non-finite samples count as 0 ms. Cost: `O(1)` per sample and a
//! few tens of KiB per histogram, whatever the number of samples.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Significant decimal digits the histogram keeps: relative error at most 10⁻³.
const SIGNIFICANT_DIGITS: u8 = 3;

/// Histogram units (µs) per model ms.
const US_PER_MS: f64 = 1_000.0;

/// Mean and percentiles of a latency distribution, in model ms.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LatencyStats {
    /// Arithmetic mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl LatencyStats {
    /// Statistics of `samples` (model ms, any order); `None` when empty.
    pub fn from_samples(samples: impl IntoIterator<Item = f64>) -> Option<Self> {
        samples.into_iter().collect::<LatencyHistogram>().stats()
    }
}

/// A distribution of latencies in model ms, recorded one sample at a time (see the
/// module docs for its precision).
#[derive(Debug, Clone)]
pub struct LatencyHistogram {
    histogram: Histogram<u64>,
    sum_ms: f64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self {
            // Only more than 5 significant digits are refused; auto-resizing covers
            // every u64 value.
            histogram: Histogram::new(SIGNIFICANT_DIGITS).expect("3 significant digits are valid"),
            sum_ms: 0.0,
        }
    }
}

impl LatencyHistogram {
    /// Records one sample, in model ms.
    pub fn record(&mut self, ms: f64) {
        let ms = if ms.is_finite() { ms.max(0.0) } else { 0.0 };
        self.sum_ms += ms;
        // Saturating float-to-int conversion is the intent: u64::MAX µs is 584,000 years.
        let us = (ms * US_PER_MS).round() as u64;
        // The histogram grows to fit; only values too large to grow to are clamped.
        if self.histogram.record(us).is_err() {
            self.histogram.saturating_record(us);
        }
    }

    /// Samples recorded.
    pub fn len(&self) -> u64 {
        self.histogram.len()
    }

    /// Whether no sample was recorded.
    pub fn is_empty(&self) -> bool {
        self.histogram.is_empty()
    }

    /// The `q` quantile (`0 ≤ q ≤ 1`, clamped), in model ms; `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.is_empty() {
            return None;
        }
        let value = self.histogram.value_at_quantile(q.clamp(0.0, 1.0));
        Some(self.histogram.median_equivalent(value) as f64 / US_PER_MS)
    }

    /// Mean, p50, p90 and p99; `None` when empty.
    pub fn stats(&self) -> Option<LatencyStats> {
        Some(LatencyStats {
            mean: self.sum_ms / self.len() as f64,
            p50: self.quantile(0.50)?,
            p90: self.quantile(0.90)?,
            p99: self.quantile(0.99)?,
        })
    }
}

impl FromIterator<f64> for LatencyHistogram {
    fn from_iter<I: IntoIterator<Item = f64>>(samples: I) -> Self {
        let mut histogram = Self::default();
        samples.into_iter().for_each(|ms| histogram.record(ms));
        histogram
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `got` is `want` within the histogram's documented precision.
    fn close(got: f64, want: f64) -> bool {
        (got - want).abs() <= want * 1e-3 + 1e-3
    }

    #[test]
    fn percentiles_are_nearest_rank_within_the_documented_precision() {
        let five: LatencyHistogram = [5.0, 1.0, 4.0, 2.0, 3.0].into_iter().collect();
        assert_eq!(five.len(), 5);
        for (q, want) in [(0.0, 1.0), (0.5, 3.0), (0.9, 5.0), (1.0, 5.0)] {
            let got = five.quantile(q).unwrap();
            assert!(close(got, want), "q {q}: {got} vs {want}");
        }
        // 1..=1000 ms: the p99 is the 990th sample, the p50 the 500th.
        let thousand: LatencyHistogram = (1..=1000).map(f64::from).collect();
        let p99 = thousand.quantile(0.99).unwrap();
        assert!(close(p99, 990.0), "{p99}");
        let p50 = thousand.quantile(0.5).unwrap();
        assert!(close(p50, 500.0), "{p50}");
        // Large values keep their relative precision.
        let big = LatencyHistogram::from_iter([123_456.7]);
        assert!(close(big.quantile(0.5).unwrap(), 123_456.7));
        assert_eq!(LatencyHistogram::default().quantile(0.5), None);
    }

    #[test]
    fn latency_stats_take_any_order_and_keep_an_exact_mean() {
        let stats = LatencyStats::from_samples(vec![30.0, 10.0, 20.0]).unwrap();
        assert_eq!(stats.mean, 20.0);
        assert!(close(stats.p50, 20.0), "{stats:?}");
        assert!(close(stats.p90, 30.0), "{stats:?}");
        assert!(close(stats.p99, 30.0), "{stats:?}");
        assert_eq!(LatencyStats::from_samples(Vec::new()), None);
    }

    #[test]
    fn bad_samples_count_as_zero() {
        let stats = LatencyStats::from_samples([-5.0, f64::NAN, f64::INFINITY, 3.0]).unwrap();
        assert_eq!(stats.mean, 0.75);
        assert_eq!(stats.p50, 0.0);
        assert!(close(stats.p99, 3.0), "{stats:?}");
    }
}
