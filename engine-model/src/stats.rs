//! Latency statistics of a run of the model: mean and percentiles, in model ms.
//!
//! The online replay (`kv-mocker replay`) and the offline lab report the same
//! statistics of the same quantities (TTFT, ITL, end-to-end latency), so they are
//! computed once, here. Percentiles use linear interpolation between closest ranks
//! (Hyndman & Fan type 7, numpy's default `method="linear"`): for sorted samples
//! `x[0..n]` and quantile `q`, rank `r = q (n - 1)`, result
//! `x[floor r] + (x[ceil r] - x[floor r]) (r - floor r)`. Cost: one sort, `O(n log n)`.

use serde::{Deserialize, Serialize};

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
    /// Statistics of `samples` (any order); `None` when empty.
    pub fn from_samples(mut samples: Vec<f64>) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_by(f64::total_cmp);
        let mean = samples.iter().sum::<f64>() / samples.len() as f64;
        Some(Self {
            mean,
            p50: percentile(&samples, 0.50),
            p90: percentile(&samples, 0.90),
            p99: percentile(&samples, 0.99),
        })
    }
}

/// The `q` quantile (`0 ≤ q ≤ 1`) of non-empty ascending `sorted`, by linear
/// interpolation (see the module docs).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    let Some(last) = sorted.len().checked_sub(1) else {
        return f64::NAN;
    };
    let rank = q.clamp(0.0, 1.0) * last as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_linearly() {
        let s = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(percentile(&s, 0.0), 1.0);
        assert_eq!(percentile(&s, 0.5), 3.0);
        assert_eq!(percentile(&s, 1.0), 5.0);
        // rank 0.9 * 4 = 3.6 → 4 + 0.6 * (5 - 4)
        assert!((percentile(&s, 0.9) - 4.6).abs() < 1e-12);
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        // numpy.percentile(range(1, 11), 99) == 9.91
        assert!((percentile(&ten, 0.99) - 9.91).abs() < 1e-12);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert!(percentile(&[], 0.5).is_nan());
    }

    #[test]
    fn latency_stats_sort_their_input() {
        let stats = LatencyStats::from_samples(vec![30.0, 10.0, 20.0]).unwrap();
        assert_eq!(stats.mean, 20.0);
        assert_eq!(stats.p50, 20.0);
        assert!((stats.p90 - 28.0).abs() < 1e-12);
        assert_eq!(LatencyStats::from_samples(Vec::new()), None);
    }
}
