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

use crate::config::{LabPolicy, Setting, SimConfig};
use crate::error::LabError;
pub use crate::log_entry::LogEntry;
use crate::sim::{PreparedTrace, RunResult, run_sim};

/// [`crate::simulate`], also returning every route lookup and KV event delivery of
/// the run, in the order the index saw them.
///
/// # Errors
/// As [`crate::simulate`].
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
