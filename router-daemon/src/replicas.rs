//! Sequence sync between router replicas.
//!
//! Replicas share the route queue group, so each books only the requests NATS hands
//! it. To let every replica see the whole cluster's booked load, each publishes the
//! changes to the requests it booked (its *own* requests) on `{ns}.router.sequences`
//! as `SequenceSync` messages tagged with its [`RouterId`], and applies the others'
//! (ignoring its own):
//!
//! ```text
//!   replica A                          NATS {ns}.router.sequences            replica B
//!   route → book (Local) ─ booked ───────────────►─────────────── apply AddRequest (Peer A)
//!   lifecycle prefill_done on own ─ prefill_done ►─────────────── apply MarkPrefillCompleted
//!   lifecycle freed / expiry ─ freed ────────────►─────────────── apply Free
//!   apply Free (Peer B) ◄────────────────────────◄─ freed ──────── lifecycle freed on own
//! ```
//!
//! Ordering: messages are queued for publication while the scheduler lock is held,
//! in the order the bookings and steps were applied, and one task publishes them in
//! that order; NATS keeps one connection's messages on one subject in order. So a
//! peer applies a booking before its later steps. Frontends publish lifecycle
//! messages to every replica directly as well; applying a step twice is harmless,
//! and the owner's relayed copy repairs the race where a peer sees `freed` from the
//! frontend before the owner's `booked`.
//!
//! Costs: one small message per booking and per lifecycle step of a replica's own
//! requests, fanned out to every replica. The outbound buffer is bounded; when it is
//! full a message is dropped and counted (peers then under-count that request until
//! its TTL), never blocking routing.

use crate::counters::{MessageKind, Outcome};
use crate::state::RouterState;
use anyhow::Context;
use kv_events::replicas::{BookedSequence, SequenceSync, SequenceUpdate};
use kv_events::{RequestId, RouterId, WorkerRank, decode, encode};
use prometheus::{IntCounterVec, Opts, Registry};
use scheduler::SequenceEvent;
use scheduler::{AddRequest, Origin, PrefillLoadHint, ScheduleRequest, SchedulerError, Selection};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

/// Outbound sync messages buffered before the publisher task; beyond this they are
/// dropped (and counted).
const OUTBOX_CAPACITY: usize = 8192;

/// Replica settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicaConfig {
    /// This replica's id; must differ between replicas of a namespace. Default:
    /// random at start-up.
    pub router_id: RouterId,
    /// Publish own bookings and apply peers'. Turn off only for a single replica
    /// that wants no sync traffic. Default true.
    pub sync: bool,
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        Self {
            router_id: RouterId(rand::random()),
            sync: true,
        }
    }
}

/// This replica's side of the sync: its id, the outbound queue, and counters.
pub struct Replicas {
    config: ReplicaConfig,
    outbox: mpsc::Sender<SequenceSync>,
    /// Taken once by the publisher task at start-up.
    outbox_rx: Mutex<Option<mpsc::Receiver<SequenceSync>>>,
    metrics: SyncMetrics,
}

impl Replicas {
    /// The sync side of one replica.
    pub fn new(config: ReplicaConfig, metrics: SyncMetrics) -> Self {
        let (outbox, rx) = mpsc::channel(OUTBOX_CAPACITY);
        Self {
            config,
            outbox,
            outbox_rx: Mutex::new(Some(rx)),
            metrics,
        }
    }

    /// This replica's id.
    pub fn router_id(&self) -> RouterId {
        self.config.router_id
    }

    /// Whether sync is on.
    pub fn enabled(&self) -> bool {
        self.config.sync
    }

    /// The counters.
    pub fn metrics(&self) -> &SyncMetrics {
        &self.metrics
    }

    /// Queues the booking of one of our own requests. Call under the scheduler lock.
    pub fn booked(&self, request: &ScheduleRequest, selection: &Selection) {
        self.send(
            request.request_id.clone(),
            SequenceUpdate::Booked(BookedSequence {
                worker_id: selection.rank.worker_id,
                dp_rank: selection.rank.dp_rank,
                block_hashes: request.block_hashes.clone(),
                request_blocks: request.request_blocks,
                prefill_tokens: selection.prefill.initial_effective_prefill_tokens,
                expected_prefill_ms: selection
                    .prefill
                    .expected_prefill_duration
                    .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            }),
        );
    }

    /// Queues a lifecycle step of one of our own requests. Call under the scheduler
    /// lock.
    pub fn step(&self, request_id: &RequestId, update: SequenceUpdate) {
        self.send(request_id.clone(), update);
    }

    fn send(&self, request_id: RequestId, update: SequenceUpdate) {
        if !self.config.sync {
            return;
        }
        let msg = SequenceSync {
            router_id: self.config.router_id,
            request_id,
            update,
        };
        let outcome = match self.outbox.try_send(msg) {
            Ok(()) => "queued",
            Err(e) => {
                warn!(error = %e, "sequence sync outbox full; a message to peer replicas is dropped");
                "dropped"
            }
        };
        self.metrics.count("out", outcome);
    }

    /// Takes the outbound receiver (once) for the publisher task.
    pub fn take_outbox(&self) -> Option<mpsc::Receiver<SequenceSync>> {
        self.outbox_rx
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
    }
}

/// Subscribes to the sequences subject and spawns the sync tasks on `tasks` (until
/// `stop`): one applying peers' messages, one publishing ours. Does nothing when sync
/// is off.
///
/// # Errors
/// When the subscription fails, or sync was already started.
pub async fn start(
    state: &Arc<RouterState>,
    nats: &async_nats::Client,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let replicas = &state.admission.replicas;
    if !replicas.enabled() {
        info!("sequence sync with peer replicas is off");
        return Ok(());
    }
    let outbox = replicas
        .take_outbox()
        .context("sequence sync was already started")?;
    let subject = state.subjects.sequences();
    let peers = nats
        .subscribe(subject.clone())
        .await
        .context("subscribing to sequence sync")?;
    tasks.spawn(crate::intake::serve_with(
        state.clone(),
        peers,
        stop.child_token(),
        handle_sync,
    ));
    tasks.spawn(publish(
        nats.clone(),
        subject,
        outbox,
        replicas.metrics().clone(),
        stop.child_token(),
    ));
    info!(router_id = %replicas.router_id(), "sequence sync with peer replicas on");
    Ok(())
}

/// Publishes queued sync messages on `subject` in order until `stop`, then publishes
/// what is still queued and returns.
pub async fn publish(
    client: async_nats::Client,
    subject: String,
    mut outbox: mpsc::Receiver<SequenceSync>,
    metrics: SyncMetrics,
    stop: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            biased;
            msg = outbox.recv() => msg,
            () = stop.cancelled() => None,
        };
        let Some(msg) = msg.or_else(|| outbox.try_recv().ok()) else {
            return;
        };
        match encode(&msg) {
            Ok(bytes) => {
                if let Err(e) = client.publish(subject.clone(), bytes.into()).await {
                    warn!(error = %e, "failed to publish sequence sync");
                    metrics.count("out", "failed");
                } else {
                    metrics.count("out", "published");
                }
            }
            Err(e) => warn!(error = %e, "failed to encode sequence sync"),
        }
    }
}

/// Applies one sync payload received on `subject`.
pub fn handle_sync(state: &RouterState, subject: &str, payload: &[u8]) {
    let replicas = &state.admission.replicas;
    let msg: SequenceSync = match decode(payload) {
        Ok(m) => m,
        Err(e) => {
            state
                .counters
                .message(MessageKind::Sequences, Outcome::Malformed);
            replicas.metrics.count("in", "malformed");
            warn!(subject, error = %e, "malformed sequence sync skipped");
            return;
        }
    };
    if msg.router_id == replicas.router_id() {
        replicas.metrics.count("in", "own");
        return;
    }
    let peer = Origin::Peer(msg.router_id);
    let (event, frees_load) = match msg.update {
        SequenceUpdate::Booked(b) => (
            SequenceEvent::AddRequest(AddRequest {
                request_id: msg.request_id.clone(),
                rank: WorkerRank::new(b.worker_id, b.dp_rank),
                block_hashes: b.block_hashes,
                request_blocks: b.request_blocks,
                prefill: PrefillLoadHint {
                    initial_effective_prefill_tokens: b.prefill_tokens,
                    expected_prefill_duration: b.expected_prefill_ms.map(Duration::from_millis),
                },
                origin: peer,
            }),
            false,
        ),
        SequenceUpdate::PrefillDone => (
            SequenceEvent::MarkPrefillCompleted(msg.request_id.clone()),
            true,
        ),
        SequenceUpdate::KeepAlive => (SequenceEvent::KeepAlive(msg.request_id.clone()), false),
        SequenceUpdate::Freed => (SequenceEvent::Free(msg.request_id.clone()), true),
    };
    let booking = matches!(event, SequenceEvent::AddRequest(_));
    let result = state.scheduler().apply(event, Instant::now());
    match result {
        Ok(_) => {
            replicas.metrics.count("in", "applied");
            state.counters.message(MessageKind::Sequences, Outcome::Ok);
        }
        // The frontend's own lifecycle message got here first (or the request
        // expired): the step is already applied.
        Err(SchedulerError::UnknownRequest(_)) => {
            replicas.metrics.count("in", "duplicate");
            state.counters.message(MessageKind::Sequences, Outcome::Ok);
        }
        Err(e) => {
            replicas.metrics.count("in", "rejected");
            state
                .counters
                .message(MessageKind::Sequences, Outcome::Rejected);
            debug!(subject, request_id = %msg.request_id, router_id = %msg.router_id, error = %e, "sequence sync refused");
        }
    }
    if booking {
        state.admission.expiry.notify_one();
    }
    if frees_load {
        crate::admission::release_waiters(state);
    }
}

/// Sync message counters.
#[derive(Clone)]
pub struct SyncMetrics {
    /// `kv_router_sequence_sync_total{direction, outcome}`. Out: `queued`, `dropped`
    /// (outbox full), `published`, `failed`. In: `applied`, `duplicate` (already
    /// applied), `own` (our own message, ignored), `rejected` (e.g. unknown rank),
    /// `malformed`.
    pub messages: IntCounterVec,
}

impl SyncMetrics {
    /// Creates the counters and registers them in `registry`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let metrics = Self::unregistered();
        registry.register(Box::new(metrics.messages.clone()))?;
        Ok(metrics)
    }

    /// Counters that are not registered anywhere.
    pub fn unregistered() -> Self {
        // The name and labels are static and valid: construction cannot fail.
        #[allow(clippy::expect_used)]
        let messages = IntCounterVec::new(
            Opts::new(
                "kv_router_sequence_sync_total",
                "Sequence sync messages between router replicas, by direction and outcome",
            ),
            &["direction", "outcome"],
        )
        .expect("static metric definition is valid");
        Self { messages }
    }

    fn count(&self, direction: &str, outcome: &str) {
        self.messages.with_label_values(&[direction, outcome]).inc();
    }

    /// Messages counted so far for (direction, outcome).
    pub fn get(&self, direction: &str, outcome: &str) -> u64 {
        self.messages.with_label_values(&[direction, outcome]).get()
    }
}
