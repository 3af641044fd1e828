//! One entry of a simulated run's event log ([`crate::log`]), in its own module so
//! the simulation can write entries without importing the log's runner (which calls
//! the simulation).

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
