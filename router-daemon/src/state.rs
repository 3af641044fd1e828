//! The state every daemon task shares.
//!
//! The indexer is a handle to shard tasks (cheap to clone, internally ordered); the
//! scheduler sits behind one mutex so that *select* and *book* are a single atomic
//! step: two concurrent queries can never both see a worker as idle and pile onto it.
//! The critical section is a scan over registered ranks (microseconds), so the lock is
//! not a throughput limit at the query rates a router replica sees.

use crate::admission::Admission;
use crate::counters::Counters;
use crate::directory::WorkerDirectory;
use crate::health::Health;
use indexer::Indexer;
use kv_events::Subjects;
use scheduler::Scheduler;
use std::sync::{Mutex, MutexGuard};

/// Shared router state.
pub struct RouterState {
    /// Subjects and etcd keys of the namespace.
    pub subjects: Subjects,
    /// Tokens per KV block in this namespace.
    pub block_size: u32,
    /// The block index (either backend, see `indexer::Indexer`).
    pub indexer: Indexer,
    /// Worker selection and active-request load.
    scheduler: Mutex<Scheduler>,
    /// Message counters.
    pub counters: Counters,
    /// Registered workers with their etcd leases (written by discovery).
    pub directory: WorkerDirectory,
    /// Readiness: NATS and etcd connection, discovery, recovery, phase.
    pub health: Health,
    /// Wait queue, replica sync and request expiry.
    pub admission: Admission,
}

impl RouterState {
    /// Bundles the parts.
    pub fn new(
        subjects: Subjects,
        block_size: u32,
        indexer: Indexer,
        scheduler: Scheduler,
        counters: Counters,
        admission: Admission,
    ) -> Self {
        Self {
            subjects,
            block_size,
            indexer,
            scheduler: Mutex::new(scheduler),
            health: Health::new(counters.metrics.connections.clone()),
            counters,
            directory: WorkerDirectory::new(),
            admission,
        }
    }

    /// Locks the scheduler. A panic while holding the lock cannot leave the scheduler
    /// half-updated in a way that matters more than stopping routing would, so a
    /// poisoned lock is recovered rather than propagated.
    pub fn scheduler(&self) -> MutexGuard<'_, Scheduler> {
        self.scheduler
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
