//! Worker discovery: what the daemon does with the registrations of the
//! [`kv_cluster::directory::WorkerDirectory`] (load, then watch; reconnect with
//! backoff and reconcile after an etcd outage — all in `kv-cluster`).
//!
//! A put adds (or updates) the worker in the scheduler and the worker directory of
//! `/debug/workers`; a delete — including the one etcd generates when a lease expires,
//! and a worker a resync found gone — removes the worker from the scheduler (dropping
//! its in-flight requests) and from every indexer shard. A registration whose block
//! size the router cannot take ([`crate::block_size`]) is rejected: refused at parse
//! time against a pinned `--block-size`; against an adopted size, remembered while its
//! key exists and reconsidered (oldest registration first) when the last accepted
//! worker leaves and the adopted size is forgotten. A worker that re-registers at
//! another size leaves at the old one first. Each outcome is counted
//! (`kv_router_messages_total{kind="registration"}`), and the directory's connection
//! state drives `kv_router_etcd_connected` and the `etcd` readiness check. While etcd
//! is lost the daemon keeps routing to the workers it knows.
//!
//! A worker that joins once the daemon watches ([`Discovery::resync_joins`]) — a new
//! registration, or one that comes back after its key was deleted (its lease expired)
//! — is asked for a dump of every rank, so its index is exact as soon as the reply is
//! applied instead of empty until its next KV event (a worker that was dropped had its
//! blocks removed). The request is the indexer's resync need: at most one pending per
//! rank (a second join before the reply asks nothing more), served by the recovery
//! task with its timeout, attempts and `--recovery-concurrency` bound, so many workers
//! joining at once queue up rather than storm. Workers loaded at start-up are resynced
//! by the initial recovery instead. A worker whose registration only changes (a new
//! lease, a new capacity) keeps its index and is not asked. Cost: one dump per join and
//! rank (about 45 bytes per cached block).

use crate::directory::DirectoryEntry;
use crate::metrics::counters::{MessageKind, Outcome};
use crate::state::RouterState;
use indexer::IndexerApi as _;
use kv_cluster::directory::{EtcdStatus, Registered, Registrations, Rejection};
use kv_events::discovery::WorkerRegistration;
use kv_events::{DpRank, WorkerId, WorkerRank};
use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use tracing::{error, info, warn};

/// Workers the daemon currently knows (accepted by its scheduler), by id.
pub(crate) type KnownWorkers = BTreeMap<WorkerId, WorkerRegistration>;

/// Applies the directory's registrations to the router state.
pub(crate) struct Discovery {
    state: Arc<RouterState>,
    known: KnownWorkers,
    /// Present registrations rejected for their block size against an adopted size,
    /// by id: reconsidered when that size is forgotten.
    parked: BTreeMap<WorkerId, Registered>,
    /// Whether a worker that joins is asked for a dump ([`Self::resync_joins`]).
    resync_joins: bool,
    /// Workers that joined during the current put or delete, with their rank count:
    /// asked for a dump at its end.
    joined: Vec<(WorkerId, u32)>,
}

impl Discovery {
    /// Knows no worker yet.
    pub(crate) fn new(state: Arc<RouterState>) -> Self {
        Self {
            state,
            known: KnownWorkers::new(),
            parked: BTreeMap::new(),
            resync_joins: false,
            joined: Vec::new(),
        }
    }

    /// From now on, asks every worker that joins for a dump of its ranks (see the
    /// module docs); a no-op for an approximate index, which holds no events. Called
    /// once the registrations are loaded: the initial recovery resyncs those.
    pub(crate) fn resync_joins(&mut self) {
        self.resync_joins = !self.state.indexer.is_approximate();
    }

    /// The workers the scheduler accepted.
    pub(crate) fn known(&self) -> &KnownWorkers {
        &self.known
    }

    fn reject(&self, outcome: Outcome) {
        self.state
            .counters
            .message(MessageKind::Registration, outcome);
    }

    /// Accepts `worker` into the scheduler, or parks it when its block size differs
    /// from the router's (logged and counted when `report`).
    fn accept(&mut self, worker: Registered, report: bool) {
        let state = &self.state;
        let id = worker.registration.worker_id;
        let refused = match NonZeroU32::new(worker.registration.block_size) {
            Some(size) => state.block_size.accept(size).err().map(|e| e.to_string()),
            // Registrations are validated (`WorkerRegistration::validate`) first.
            None => Some("block_size 0".to_owned()),
        };
        if let Some(reason) = refused {
            if report {
                self.reject(Outcome::Rejected);
                error!(
                    worker_id = %id,
                    block_size = worker.registration.block_size,
                    router_block_size = state.block_size.get().map(NonZeroU32::get),
                    reason,
                    "worker registration rejected"
                );
            }
            self.parked.insert(id, worker);
            return;
        }
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
            if self.known.is_empty() {
                // Nothing registered holds the size this registration may have set.
                state.block_size.forget();
            }
            return;
        }
        let (worker_id, dp_size, total_kv_blocks, block_size) = (
            reg.worker_id,
            reg.dp_size,
            reg.total_kv_blocks,
            reg.block_size,
        );
        state.publishers.register(worker_id, reg.epoch);
        if self.known.insert(worker_id, reg).is_none() && self.resync_joins {
            self.joined.push((worker_id, dp_size));
        }
        state.directory.upsert(entry);
        state
            .counters
            .message(MessageKind::Registration, Outcome::Ok);
        state.counters.set_workers(self.known.len());
        info!(worker_id = %worker_id, dp_size, total_kv_blocks, block_size, "worker registered");
        // New ranks may take requests waiting for room.
        state.admission.release_waiters();
    }

    /// Removes an accepted worker from the scheduler, the directory and the index.
    async fn remove(&mut self, id: WorkerId) {
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
        state.removals.forget_worker(id);
        if let Err(e) = state.indexer.remove_worker(id).await {
            warn!(worker_id = %id, error = %e, "indexer could not drop the worker's blocks");
        }
        state.counters.set_workers(self.known.len());
        info!(worker_id = %id, "worker removed");
    }

    /// Asks the workers that joined for a dump of each rank, through the indexer's
    /// resync (which skips a rank whose recovery is already pending).
    async fn resync_joined(&mut self) {
        for (worker_id, dp_size) in std::mem::take(&mut self.joined) {
            for dp_rank in (0..dp_size).map(DpRank) {
                let rank = WorkerRank::new(worker_id, dp_rank);
                if let Err(e) = self.state.indexer.resync(rank).await {
                    warn!(%worker_id, error = %e, "indexer stopped; no dump requested");
                    return;
                }
            }
            info!(%worker_id, dp_size, "worker joined: dump of its ranks requested");
        }
    }

    /// When no worker is left, forgets an adopted block size and reconsiders the
    /// parked registrations, oldest first (as a replica loading etcd now would);
    /// `report` names the one whose rejection is still to be logged and counted.
    /// Returns whether a size was forgotten.
    async fn forget_if_empty(&mut self, report: Option<WorkerId>) -> bool {
        if !self.known.is_empty() || !self.state.block_size.forget() {
            return false;
        }
        info!(
            parked = self.parked.len(),
            "no worker registered: adopted block size forgotten"
        );
        let mut parked: Vec<Registered> = std::mem::take(&mut self.parked).into_values().collect();
        parked.sort_by_key(|w| (w.create_revision, w.registration.worker_id));
        for worker in parked {
            let report = report == Some(worker.registration.worker_id);
            self.accept(worker, report);
        }
        true
    }
}

impl Registrations for Discovery {
    fn check(&self, reg: &WorkerRegistration) -> Result<(), String> {
        // Only a pinned size refuses for good; an adopted one is checked on put.
        self.state
            .block_size
            .check_pinned(reg.block_size)
            .map_err(|e| e.to_string())
    }

    async fn put(&mut self, worker: Registered) {
        let id = worker.registration.worker_id;
        self.parked.remove(&id);
        let resized = self
            .known
            .get(&id)
            .is_some_and(|old| old.block_size != worker.registration.block_size);
        if resized {
            // It leaves at the old size. If it was the last worker, it joins the parked
            // registrations so that the oldest of them picks the new size.
            self.remove(id).await;
            if self.known.is_empty() {
                self.parked.insert(id, worker);
                if !self.forget_if_empty(Some(id)).await
                    && let Some(worker) = self.parked.remove(&id)
                {
                    self.accept(worker, true);
                }
                self.resync_joined().await;
                return;
            }
        }
        self.accept(worker, true);
        self.resync_joined().await;
    }

    async fn delete(&mut self, id: WorkerId) {
        self.parked.remove(&id);
        if !self.known.contains_key(&id) {
            return;
        }
        self.remove(id).await;
        info!(worker_id = %id, "worker left (key deleted or lease expired)");
        self.forget_if_empty(None).await;
        self.resync_joined().await;
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
