//! The realistic case: the Mooncake conversation trace (the bundled 2,000-request
//! excerpt, or `--trace PATH`) run through the mocker's lab on [`WORKERS`] simulated
//! engines, each request assigned to a worker by the scheduler's `kv` policy on our
//! own index as the requests arrive. The lab logs every KV event the engines publish
//! (chained engine hashes, `Removed` on eviction) and every prompt; both libraries
//! then get all those events, and every prompt (its first [`MAX_QUERY_BLOCKS`]
//! blocks) as a query, answered against the final state.

use crate::run::{Case, expected};
use engine_model::trace::{BlockMapping, bundled_excerpt, load_trace};
use engine_model::{EngineModelConfig, TimingModel};
use kv_events::routing::PolicyKind;
use kv_events::{KvEventBatch, LocalBlockHash};
use kv_lab::{LabPolicy, LogEntry, PreparedTrace, Setting, SimConfig, Speedup, simulate_logged};
use std::path::Path;
use std::sync::Arc;

/// Simulated workers (one dp rank each).
pub const WORKERS: u64 = 64;

/// Queries longer than this are cut (the synthetic queries have 128 blocks).
const MAX_QUERY_BLOCKS: usize = 256;

/// The trace case; `path` is the full trace, `None` the bundled excerpt.
pub fn case(path: Option<&Path>, workers: u64) -> Case {
    let (requests, name) = match path {
        Some(p) => (load_trace(p).expect("the trace loads"), "trace"),
        None => (
            bundled_excerpt().expect("the bundled excerpt parses"),
            "trace excerpt",
        ),
    };
    let engine = EngineModelConfig::default();
    let mapping =
        BlockMapping::new(engine.block_size).expect("the default block size splits trace blocks");
    let prepared = PreparedTrace::new(&requests, mapping);
    let config = SimConfig {
        engine,
        timing: TimingModel::H100_8B,
        event_lag_ms: 0.0,
        ..SimConfig::default()
    };
    let setting = Setting {
        workers: u32::try_from(workers).expect("a worker count fits u32"),
        speedup: Speedup::new(1.0).expect("1 is a valid speed-up"),
    };
    let (_, log) = simulate_logged(
        &prepared,
        setting,
        LabPolicy::Scheduler(PolicyKind::Kv),
        &config,
    )
    .expect("the simulation runs");
    let mut batches = Vec::new();
    let mut queries: Vec<Arc<[LocalBlockHash]>> = Vec::new();
    for entry in log {
        match entry {
            LogEntry::Events { worker_id, events } => batches.push(KvEventBatch {
                worker_id,
                epoch: 1,
                events,
            }),
            LogEntry::Route { block_hashes } if !block_hashes.is_empty() => {
                let n = block_hashes.len().min(MAX_QUERY_BLOCKS);
                queries.push(Arc::from(&block_hashes[..n]));
            }
            LogEntry::Route { .. } => {}
        }
    }
    let answers = expected(&batches, &queries);
    let mut reference = bench_workload::Reference::new();
    for b in &batches {
        for e in &b.events {
            reference.apply(b.worker_id, e);
        }
    }
    Case {
        name: format!("{name}, {workers} workers ({} blocks)", reference.entries()),
        blocks: reference.entries() as u64,
        batches,
        queries: queries.into_iter().zip(answers).collect(),
    }
}
