//! The parts of the daemon, bundled for the start-up code and the services on top.
//!
//! Each part is built on its own and knows nothing of this bundle: admission owns the
//! scheduler lock, health is shared with the NATS connection's event callback, and
//! the metrics live in the counters. Tasks take the parts they use (cheap handles or
//! `Arc`s). Only the services that use most of it — routing, discovery, index
//! recovery, the HTTP endpoint — take the whole bundle, and no part imports it, so
//! the module graph stays one-way: parts → state → services → daemon.

use crate::admission::Admission;
use crate::block_size::BlockSize;
use crate::directory::RegistrationDirectory;
use crate::health::Health;
use crate::metrics::counters::Counters;
use crate::publishers::Publishers;
use crate::recovery_status::RecoveryStatus;
use crate::removals::Removals;
use indexer::Indexer;
use kv_events::Subjects;
use kv_events::limits::Limits;
use scheduler::Scheduler;
use std::sync::{Arc, MutexGuard};

/// Shared router state.
pub struct RouterState {
    /// Subjects and etcd keys of the namespace.
    pub subjects: Subjects,
    /// Tokens per KV block in this namespace: pinned, or adopted by discovery from
    /// the registrations (one atomic load to read).
    pub block_size: BlockSize,
    /// The block index (either backend, see `indexer::Indexer`); a cheap handle.
    pub indexer: Indexer,
    /// Message counters and every other metric group (cheap handles).
    pub counters: Counters,
    /// Registered workers with their etcd leases (written by discovery).
    pub directory: RegistrationDirectory,
    /// Readiness: NATS and etcd connection, discovery, recovery, phase.
    pub health: Arc<Health>,
    /// The scheduler lock, wait queue, replica sync and request expiry.
    pub admission: Arc<Admission>,
    /// Bounds on every message decoded (`crate::gate`).
    pub limits: Limits,
    /// Registered publishers and their epochs (written by discovery, read by intake).
    pub publishers: Publishers,
    /// Ranks with recovery trouble (written by the recovery service).
    pub recovery: RecoveryStatus,
    /// Recent removals per rank (written by event intake, read by routing and the
    /// removals service).
    pub(crate) removals: Arc<Removals>,
}

impl RouterState {
    /// Bundles the parts; health starts as "starting, nothing connected".
    pub(crate) fn new(
        subjects: Subjects,
        block_size: BlockSize,
        indexer: Indexer,
        counters: Counters,
        admission: Admission,
        limits: Limits,
        removals: Removals,
    ) -> Self {
        Self {
            subjects,
            block_size,
            indexer,
            health: Arc::new(Health::new(counters.metrics.connections.clone())),
            counters,
            directory: RegistrationDirectory::new(),
            admission: Arc::new(admission),
            limits,
            publishers: Publishers::default(),
            recovery: RecoveryStatus::default(),
            removals: Arc::new(removals),
        }
    }

    /// Locks the scheduler (the admission's, so booking and reading share one lock).
    pub fn scheduler(&self) -> MutexGuard<'_, Scheduler> {
        self.admission.scheduler()
    }
}
