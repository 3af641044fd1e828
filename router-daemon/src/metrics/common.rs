//! Bucket layouts and label helpers shared by the daemon's metric groups.

use kv_events::WorkerRank;

/// Label names of per-rank metrics.
pub(crate) const RANK_LABELS: &[&str] = &["worker_id", "dp_rank"];

/// Latency buckets from 50 µs to 10 s, in seconds: routing is sub-millisecond when
/// healthy, and queueing or a stalled shard shows up in the upper buckets.
pub(crate) fn latency_buckets() -> Vec<f64> {
    vec![
        0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
        0.5, 1.0, 2.5, 5.0, 10.0,
    ]
}

/// Overlap buckets in blocks: 0, then powers of two up to 4096 blocks (256k tokens at
/// 64 tokens per block).
pub(crate) fn overlap_buckets() -> Vec<f64> {
    std::iter::once(0.0)
        .chain((0..=12).map(|e| f64::from(1u32 << e)))
        .collect()
}

/// The label values of a rank, in [`RANK_LABELS`] order.
pub(crate) fn rank_labels(rank: WorkerRank) -> [String; 2] {
    [rank.worker_id.0.to_string(), rank.dp_rank.0.to_string()]
}

/// A gauge value, saturating at `i64::MAX`.
pub(crate) fn to_i64(n: impl TryInto<i64>) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}
