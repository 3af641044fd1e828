//! Sequence sync between router replicas.
//!
//! Replicas share the route queue group, so each books only the requests NATS hands
//! it. To let every replica see the whole cluster's booked load, each publishes the
//! changes to the requests it booked (its *own* requests) on `{ns}.router.sequences`
//! as `SequenceSync` messages tagged with its [`RouterId`], and applies the others'
//! (ignoring its own). A replica that starts while others serve first learns what
//! they booked earlier from a start-up snapshot ([`crate::replica_snapshot`]):
//!
//! ```text
//!   replica A                          NATS {ns}.router.sequences            replica B
//!   route → book (Local) ─ booked ───────────────►─────────────── apply AddRequest (Peer A)
//!   lifecycle prefill_done on own ─ prefill_done ►─────────────── apply MarkPrefillCompleted
//!   lifecycle freed / expiry ─ freed ────────────►─────────────── apply Free
//!   apply Free (Peer B) ◄────────────────────────◄─ freed ──────── lifecycle freed on own
//!
//!                                  NATS {ns}.router.sequences.snapshot   replica C (starting)
//!                                                            1. subscribe {ns}.router.sequences
//!   answer: own bookings, chunked ◄────────── SnapshotRequest ◄─ 2. request, reply inbox
//!        └──────────────────── SnapshotReply chunks ─────────► 3. apply as Peer A bookings
//!                                                              (skip known / freed meanwhile)
//!                                                            4. answer others; join route group; ready
//! ```
//!
//! Ordering: messages are queued for publication while the scheduler lock is held,
//! in the order the bookings and steps were applied, and one task publishes them in
//! that order; NATS keeps one connection's messages on one subject in order. So a
//! peer applies a booking before its later steps. Frontends publish lifecycle
//! messages to every replica directly as well; applying a step twice is harmless,
//! and the owner's relayed copy repairs the race where a peer sees `freed` from the
//! frontend before the owner's `booked`. A `booked` that finds the request already
//! known (learned from a snapshot reply first) is counted as a duplicate.
//!
//! Costs: one small message per booking and per lifecycle step of a replica's own
//! requests, fanned out to every replica. The outbound buffer is bounded; when it is
//! full a message is dropped and counted (peers then under-count that request until
//! its TTL), never blocking routing. To answer snapshots, each replica keeps a copy
//! of its own in-flight bookings (8 bytes per prompt block hash of each own request).

use crate::counters::{MessageKind, Outcome};
use crate::replica_snapshot::{OwnBookings, RecentStep, RecentSteps};
use crate::state::RouterState;
use anyhow::Context;
use kv_events::replicas::{BookedSequence, SequenceSync, SequenceUpdate};
use kv_events::routing::LifecycleEvent;
use kv_events::{RequestId, RouterId, WorkerRank, decode, encode};
use prometheus::{IntCounterVec, Opts, Registry};
use scheduler::SequenceEvent;
use scheduler::{AddRequest, Origin, PrefillLoadHint, ScheduleRequest, SchedulerError, Selection};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, mpsc};
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
    /// How long a starting replica collects its peers' answers to its snapshot
    /// request (with sync on); zero sends none. Default 500 ms.
    #[serde(
        rename = "snapshot_timeout_ms",
        with = "scheduler::config::duration_ms"
    )]
    pub snapshot_timeout: Duration,
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        Self {
            router_id: RouterId(rand::random()),
            sync: true,
            snapshot_timeout: Duration::from_millis(500),
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
    /// Our own in-flight bookings, to answer peers' snapshot requests. Locked under
    /// the scheduler lock (scheduler first).
    own: Mutex<OwnBookings>,
    /// Woken when `own` may hold enough stale entries to be worth pruning.
    prune: Notify,
    /// Whether `recent` records steps (from the sequences subscription until the
    /// start-up snapshot is applied).
    recording: AtomicBool,
    /// Prefill-done and freed steps seen while recording. Locked on its own before
    /// the scheduler lock, or under it (scheduler first).
    recent: Mutex<RecentSteps>,
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
            own: Mutex::new(OwnBookings::default()),
            prune: Notify::new(),
            recording: AtomicBool::new(false),
            recent: Mutex::new(RecentSteps::default()),
        }
    }

    /// How long the start-up snapshot collects answers; zero when it is off (also
    /// when sync is off).
    pub fn snapshot_timeout(&self) -> Duration {
        if self.config.sync {
            self.config.snapshot_timeout
        } else {
            Duration::ZERO
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

    /// Queues the booking of one of our own requests and keeps it for snapshot
    /// answers. Call under the scheduler lock.
    pub fn booked(&self, request: &ScheduleRequest, selection: &Selection) {
        if !self.config.sync {
            return;
        }
        let booked = BookedSequence {
            worker_id: selection.rank.worker_id,
            dp_rank: selection.rank.dp_rank,
            block_hashes: request.block_hashes.clone(),
            request_blocks: request.request_blocks,
            prefill_tokens: selection.prefill.initial_effective_prefill_tokens,
            expected_prefill_ms: selection
                .prefill
                .expected_prefill_duration
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        };
        if self
            .own_bookings()
            .insert(request.request_id.clone(), Arc::new(booked.clone()))
        {
            self.prune.notify_one();
        }
        self.send(request.request_id.clone(), SequenceUpdate::Booked(booked));
    }

    /// Queues a lifecycle step of one of our own requests. Call under the scheduler
    /// lock.
    pub fn step(&self, request_id: &RequestId, update: SequenceUpdate) {
        if !self.config.sync {
            return;
        }
        if update == SequenceUpdate::Freed {
            self.own_bookings().remove(request_id);
        }
        self.send(request_id.clone(), update);
    }

    /// Our own in-flight bookings (possibly with stale entries: requests dropped with
    /// their worker). Lock only under the scheduler lock.
    pub(crate) fn own_bookings(&self) -> MutexGuard<'_, OwnBookings> {
        self.own
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Resolves when the own bookings should be pruned.
    pub(crate) async fn prune_wanted(&self) {
        self.prune.notified().await;
    }

    /// Starts recording prefill-done and freed steps for the start-up snapshot.
    pub(crate) fn begin_recording(&self) {
        self.recording.store(true, Ordering::Release);
    }

    /// Stops recording and forgets what was recorded.
    pub(crate) fn end_recording(&self) {
        self.recording.store(false, Ordering::Release);
        *self.recent_steps() = RecentSteps::default();
    }

    /// Notes a step of any request (own, a peer's, or unknown yet) while the
    /// start-up snapshot is pending, so a snapshot reply taken before the step does
    /// not undo it. Call *before* applying the step to the scheduler: a reply applied
    /// after this call sees the step, one applied before it is undone by the step.
    pub fn note_step(&self, request_id: &RequestId, update: &SequenceUpdate) {
        let step = match update {
            SequenceUpdate::PrefillDone => RecentStep::PrefillDone,
            SequenceUpdate::Freed => RecentStep::Freed,
            SequenceUpdate::Booked(_) | SequenceUpdate::KeepAlive => return,
        };
        if self.recording.load(Ordering::Acquire) {
            self.recent_steps().note(request_id, step);
        }
    }

    /// [`Self::note_step`] for a frontend's lifecycle message.
    pub fn note_lifecycle(&self, request_id: &RequestId, event: LifecycleEvent) {
        let update = match event {
            LifecycleEvent::PrefillDone => SequenceUpdate::PrefillDone,
            LifecycleEvent::Freed => SequenceUpdate::Freed,
            LifecycleEvent::KeepAlive => return,
        };
        self.note_step(request_id, &update);
    }

    /// The steps recorded since recording began.
    pub(crate) fn recent_steps(&self) -> MutexGuard<'_, RecentSteps> {
        self.recent
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn send(&self, request_id: RequestId, update: SequenceUpdate) {
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
/// `stop`): one applying peers' messages, one publishing ours. Starts recording steps
/// for the start-up snapshot when it is on. Does nothing when sync is off.
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
    if !replicas.snapshot_timeout().is_zero() {
        replicas.begin_recording();
    }
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
    replicas.note_step(&msg.request_id, &msg.update);
    let (event, frees_load) = match msg.update {
        SequenceUpdate::Booked(b) => (
            booked_event(msg.router_id, msg.request_id.clone(), b),
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
        // expired): the step is already applied. Or a start-up snapshot reply
        // carried the booking before its live `booked`.
        Err(SchedulerError::UnknownRequest(_) | SchedulerError::DuplicateRequest(_)) => {
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

/// The write-model event booking `booked` for the peer `router_id`: a live `booked`
/// message and a snapshot reply entry take this same path.
pub fn booked_event(
    router_id: RouterId,
    request_id: RequestId,
    b: BookedSequence,
) -> SequenceEvent {
    SequenceEvent::AddRequest(AddRequest {
        request_id,
        rank: WorkerRank::new(b.worker_id, b.dp_rank),
        block_hashes: b.block_hashes,
        request_blocks: b.request_blocks,
        prefill: PrefillLoadHint {
            initial_effective_prefill_tokens: b.prefill_tokens,
            expected_prefill_duration: b.expected_prefill_ms.map(Duration::from_millis),
        },
        origin: Origin::Peer(router_id),
    })
}

/// Sync message counters.
#[derive(Clone)]
pub struct SyncMetrics {
    /// `kv_router_sequence_sync_total{direction, outcome}`. Out: `queued`, `dropped`
    /// (outbox full), `published`, `failed`. In: `applied`, `duplicate` (already
    /// applied), `own` (our own message, ignored), `rejected` (e.g. unknown rank),
    /// `malformed`. Start-up snapshot, `snapshot_out` (answering a peer):
    /// `answered` (requests), `published` and `failed` (reply chunks);
    /// `snapshot_in` (our own snapshot): `applied`, `duplicate` (already known from
    /// the live subject), `freed` (freed meanwhile, skipped), `rejected` (e.g.
    /// unknown rank), all in bookings, and `malformed` (undecodable requests and
    /// replies).
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

    pub(crate) fn count(&self, direction: &str, outcome: &str) {
        self.messages.with_label_values(&[direction, outcome]).inc();
    }

    /// Messages counted so far for (direction, outcome).
    pub fn get(&self, direction: &str, outcome: &str) -> u64 {
        self.messages.with_label_values(&[direction, outcome]).get()
    }
}
