//! The event log of one simulated run: what the router's index saw, in order.
//!
//! A run of the lab is a realistic source of index traffic: real prompts (the trace's
//! block-hash chains), assigned to ranks by a real policy as they arrive, and the KV
//! events (`Stored` with chained engine hashes, `Removed` on eviction) that the
//! simulated engines then publish. [`simulate_logged`] records that traffic so that
//! other indexes can be fed the very same stream — the side-by-side indexer bench
//! (`benches/peer-dynamo`) replays it into ours and Dynamo's.
//!
//! What it costs: a copy of every delivered event and every prompt's block hashes,
//! about `8 b` bytes for `b` logged block hashes; nothing when not asked for.

use super::LabError;
use super::config::{LabPolicy, Setting, SimConfig};
use super::sim::{PreparedTrace, RunResult, run_sim};
use kv_events::{KvCacheEvent, LocalBlockHash, WorkerId};

/// One thing the index saw during a run, in simulated-time order.
#[derive(Debug, Clone, PartialEq)]
pub enum LogEntry {
    /// A request arrived and its prompt was looked up (before the policy chose a
    /// rank): the prompt's engine block hashes.
    Route {
        /// The prompt's block hashes, one per engine block.
        block_hashes: Vec<LocalBlockHash>,
    },
    /// A worker's KV events reached the index (worker ids are 1-based, one dp rank 0
    /// per worker); event ids count from 0 per worker.
    Events {
        /// The publishing worker.
        worker_id: WorkerId,
        /// Its events, in publication order.
        events: Vec<KvCacheEvent>,
    },
}

/// [`super::simulate`], also returning every route lookup and KV event delivery of
/// the run, in the order the index saw them.
///
/// # Errors
/// As [`super::simulate`].
pub fn simulate_logged(
    trace: &PreparedTrace,
    setting: Setting,
    policy: LabPolicy,
    config: &SimConfig,
) -> Result<(RunResult, Vec<LogEntry>), LabError> {
    let mut log = Vec::new();
    let result = run_sim(trace, setting, policy, config, Some(&mut log))?;
    Ok((result, log))
}
