//! Worker discovery: what the daemon does with the registrations of the
//! [`kv_cluster::directory::WorkerDirectory`] (load, then watch; reconnect with
//! backoff and reconcile after an etcd outage — all in `kv-cluster`).
//!
//! A put adds (or updates) the worker in the scheduler and the worker directory of
//! `/debug/workers`; a delete — including the one etcd generates when a lease expires,
//! and a worker a resync found gone — removes the worker from the scheduler (dropping
//! its in-flight requests) and from every indexer shard. A registration whose block
//! size differs from the router's is rejected. Each outcome is counted
//! (`kv_router_messages_total{kind="registration"}`), and the directory's connection
//! state drives `kv_router_etcd_connected` and the `etcd` readiness check. While etcd
//! is lost the daemon keeps routing to the workers it knows.

use crate::directory::DirectoryEntry;
use crate::metrics::counters::{MessageKind, Outcome};
use crate::state::RouterState;
use indexer::IndexerApi as _;
use kv_cluster::directory::{EtcdStatus, Registered, Registrations, Rejection};
use kv_events::WorkerId;
use kv_events::discovery::WorkerRegistration;
use std::collections::BTreeMap;
use std::sync::Arc;
use tracing::{error, info, warn};

/// Workers the daemon currently knows (accepted by its scheduler), by id.
pub type KnownWorkers = BTreeMap<WorkerId, WorkerRegistration>;

/// Applies the directory's registrations to the router state.
pub struct Discovery {
    state: Arc<RouterState>,
    known: KnownWorkers,
}

impl Discovery {
    /// Knows no worker yet.
    pub fn new(state: Arc<RouterState>) -> Self {
        Self {
            state,
            known: KnownWorkers::new(),
        }
    }

    /// The workers the scheduler accepted.
    pub fn known(&self) -> &KnownWorkers {
        &self.known
    }

    fn reject(&self, outcome: Outcome) {
        self.state
            .counters
            .message(MessageKind::Registration, outcome);
    }
}

impl Registrations for Discovery {
    fn check(&self, reg: &WorkerRegistration) -> Result<(), String> {
        if reg.block_size == self.state.block_size {
            Ok(())
        } else {
            Err(format!(
                "block_size {} differs from the router's {} tokens",
                reg.block_size, self.state.block_size
            ))
        }
    }

    async fn put(&mut self, worker: Registered) {
        let state = &self.state;
        let reg = worker.registration;
        let entry = DirectoryEntry {
            registration: reg.clone(),
            lease_id: worker.lease_id,
            mod_revision: worker.mod_revision,
        };
        if self.known.get(&reg.worker_id) == Some(&reg) {
            state.directory.upsert(entry);
            return;
        }
        if let Err(e) = state.scheduler().add_worker(reg.clone()) {
            self.reject(Outcome::Rejected);
            error!(worker_id = %reg.worker_id, error = %e, "worker registration rejected");
            return;
        }
        let (worker_id, dp_size, total_kv_blocks) =
            (reg.worker_id, reg.dp_size, reg.total_kv_blocks);
        state.publishers.register(worker_id, reg.epoch);
        self.known.insert(worker_id, reg);
        state.directory.upsert(entry);
        state
            .counters
            .message(MessageKind::Registration, Outcome::Ok);
        state.counters.set_workers(self.known.len());
        info!(worker_id = %worker_id, dp_size, total_kv_blocks, "worker registered");
        // New ranks may take requests waiting for room.
        state.admission.release_waiters();
    }

    async fn delete(&mut self, id: WorkerId) {
        let state = &self.state;
        let Some(reg) = self.known.remove(&id) else {
            return;
        };
        state.directory.remove(id);
        state.publishers.remove(id);
        state.counters.metrics.route.forget_worker(id, reg.dp_size);
        state.scheduler().remove_worker(id);
        // Waiters pinned to a rank that left, or with no worker left, get their answer.
        state.admission.release_waiters();
        if let Err(e) = state.indexer.remove_worker(id).await {
            warn!(worker_id = %id, error = %e, "indexer could not drop the worker's blocks");
        }
        state.counters.set_workers(self.known.len());
        info!(worker_id = %id, "worker removed (key deleted or lease expired)");
    }

    fn rejected(&mut self, _key: &str, rejection: &Rejection) {
        self.reject(match rejection {
            Rejection::Malformed(_) => Outcome::Malformed,
            Rejection::Refused(_) => Outcome::Rejected,
        });
    }

    fn status(&mut self, status: EtcdStatus) {
        match status {
            EtcdStatus::Up(detail) => self.state.health.etcd_ok(detail),
            EtcdStatus::Down { stage, error } => self.state.health.etcd_failed(stage, &error),
        }
    }
}
