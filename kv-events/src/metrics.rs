//! Load metrics: what an engine tells the router about how busy one dp_rank is.
//!
//! Published on `{ns}.kv.metrics.{worker_id}`, typically every 100 ms to 1 s and on
//! significant change. The router keeps only the latest sample per (worker, dp_rank).

use crate::ids::{DpRank, WorkerId};
use serde::{Deserialize, Serialize};

/// A snapshot of one (worker, dp_rank)'s load, as the engine sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LoadMetrics {
    /// The reporting worker.
    pub worker_id: WorkerId,
    /// The reporting data-parallel rank.
    #[serde(default)]
    pub dp_rank: DpRank,
    /// KV blocks held by running (decoding or prefilling) requests, in blocks.
    pub active_decode_blocks: u64,
    /// Prompt tokens admitted but not yet prefilled, in tokens.
    pub active_prefill_tokens: u64,
    /// KV blocks in use (referenced or cached), in blocks.
    pub kv_used_blocks: u64,
    /// KV cache capacity, in blocks.
    pub kv_total_blocks: u64,
    /// Requests in the running batch.
    pub num_requests_running: u32,
    /// Requests admitted to the engine but waiting for a batch slot or KV space.
    pub num_requests_waiting: u32,
}

impl LoadMetrics {
    /// Fraction of the KV cache in use, in `[0, 1]`; 0 when capacity is unknown.
    pub fn kv_usage(&self) -> f64 {
        if self.kv_total_blocks == 0 {
            0.0
        } else {
            self.kv_used_blocks as f64 / self.kv_total_blocks as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};

    #[test]
    fn round_trips_and_reports_usage() {
        let m = LoadMetrics {
            worker_id: WorkerId(3),
            dp_rank: DpRank(1),
            active_decode_blocks: 10,
            active_prefill_tokens: 512,
            kv_used_blocks: 25,
            kv_total_blocks: 100,
            num_requests_running: 4,
            num_requests_waiting: 1,
        };
        let back: LoadMetrics = decode(&encode(&m).unwrap()).unwrap();
        assert_eq!(back, m);
        assert!((m.kv_usage() - 0.25).abs() < 1e-12);
        assert_eq!(LoadMetrics::default().kv_usage(), 0.0);
    }
}
