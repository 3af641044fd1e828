//! Sequence sync between router replicas, and the start-up snapshot.
//!
//! Replicas share the route queue group, so each books only the requests NATS hands
//! it. To let every replica see the whole cluster's booked load, each publishes the
//! changes to the requests it booked (its *own* requests) on `{ns}.router.sequences`
//! as `SequenceSyncBatch` messages tagged with its [`RouterId`] — every step queued
//! when the publisher wakes goes into one message — and applies the others'
//! (ignoring its own; a peer's older single-step `SequenceSync` decodes as a batch of
//! one). A disaggregated request is two bookings, its decode half under its id and
//! its prefill half under `{id}#prefill`, each published, applied and answered in
//! snapshots as an ordinary booking. A replica that starts while others serve first
//! learns what they booked earlier from a start-up snapshot ([`snapshot`]):
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
//! that order, a batch listing its steps in order; NATS keeps one connection's
//! messages on one subject in order. So a
//! peer applies a booking before its later steps. Frontends publish lifecycle
//! messages to every replica directly as well; applying a step twice is harmless,
//! and the owner's relayed copy repairs the race where a peer sees `freed` from the
//! frontend before the owner's `booked`. A `booked` that finds the request already
//! known (learned from a snapshot reply first) is counted as a duplicate.
//!
//! Silence until a peer speaks: a replica queues no step for publication until it
//! has heard from another replica ([`Replicas::heard_from`]: a sync message, a
//! snapshot request or a snapshot reply under another router id), so a lone replica
//! spends nothing on sync. Each replica publishes one empty batch when its sync
//! starts (its hello) and another whenever it hears a replica for the first time,
//! so two replicas always hear each other, whichever started first and whether or
//! not either asked for a snapshot (an empty batch answers each new peer once, so
//! the exchange ends). Nothing is lost to the silence: what a replica booked before
//! it heard a peer is in its answer to that peer's snapshot request, and it hears
//! the request before it answers it, so every step after the answer is published.
//! Only a peer that starts without a snapshot request misses the bookings made
//! before its hello was heard, as it misses every earlier booking.
//!
//! Costs: one small message per booking and per lifecycle step of a replica's own
//! requests at low load, fanned out to every replica; under load one message per
//! publisher wake-up carries all the steps queued since the last (up to 64 KiB), so
//! a route costs less than its two steps' publications (`route_bench`,
//! docs/benchmarks.md). The outbound buffer is bounded; when it is
//! full a message is dropped and counted (peers then under-count that request until
//! its TTL), never blocking routing. To answer snapshots, each replica keeps a copy
//! of its own in-flight bookings (8 bytes per prompt block hash of each own request).
//!
//! # Layout
//! One way down, so no file imports one above it:
//! - this file: [`ReplicaConfig`] and [`Replicas`], this replica's side of the sync
//!   (its id, the outbox, its own bookings, the steps recorded for the snapshot),
//!   which admission holds;
//! - [`bookings`]: the records behind it ([`bookings::OwnBookings`],
//!   [`bookings::RecentSteps`]) and the one way a peer's booking becomes a scheduler
//!   event;
//! - `crate::replica_sync` (a folder of its own): the tasks publishing our steps and
//!   applying our peers' (`sync`), and the start-up snapshot (`snapshot`).
//!
//! `replica_sync` sits above admission (it locks the scheduler and releases waiters
//! through it); this folder sits below it, so neither imports one above it.

pub(crate) mod bookings;

use crate::metrics::SyncMetrics;
use bookings::{OwnBookings, RecentStep, RecentSteps};
use kv_events::disaggregation::prefill_booking_id;
use kv_events::replicas::{BookedSequence, HashForm, SequenceStep, SequenceUpdate};
use kv_events::routing::SessionId;
use kv_events::{RequestId, RouterId, WorkerRank};
use scheduler::{PrefillLoadHint, ScheduleRequest, Selection};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{Notify, mpsc};
use tracing::{info, warn};

/// Outbound sync messages buffered before the publisher task; beyond this they are
/// dropped (and counted).
const OUTBOX_CAPACITY: usize = 8192;

/// Peer router ids remembered; beyond this the set starts over.
const MAX_PEERS: usize = 1024;

/// A step in the outbox, with when it was queued: the moment this replica decided
/// it, in microseconds since the Unix epoch (a batch carries its first step's, so
/// peers can measure the replication lag).
#[derive(Debug)]
pub(crate) struct QueuedStep {
    pub(crate) step: SequenceStep,
    pub(crate) queued_at_us: u64,
}

/// Now, in microseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Replica settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicaConfig {
    /// This replica's id; must differ between replicas of a namespace. Default:
    /// random at start-up.
    pub router_id: RouterId,
    /// Publish own bookings (once another replica has been heard) and apply peers'.
    /// A lone replica publishes only its hello, so turning this off saves little;
    /// turn it off only for a replica that must not share its load. Default true.
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
    outbox: mpsc::Sender<QueuedStep>,
    /// Taken once by the publisher task at start-up.
    outbox_rx: Mutex<Option<mpsc::Receiver<QueuedStep>>>,
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
    /// Whether another replica has spoken (a sync message, a snapshot request or a
    /// snapshot reply under another router id). Until then no step is queued for
    /// publication: nobody would apply it.
    peer_heard: AtomicBool,
    /// The peers heard so far, by router id (at most [`MAX_PEERS`]), and whether each
    /// accepts packed bookings (what its latest message said).
    peers: Mutex<HashMap<RouterId, bool>>,
    /// Whether every peer heard so far accepts packed bookings, so the publisher packs
    /// them ([`Self::hash_form`]).
    pack: AtomicBool,
    /// Woken when a peer is heard for the first time, for the publisher to announce
    /// this replica to it.
    announce: Notify,
}

impl Replicas {
    /// The sync side of one replica.
    pub(crate) fn new(config: ReplicaConfig, metrics: SyncMetrics) -> Self {
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
            peer_heard: AtomicBool::new(false),
            peers: Mutex::new(HashMap::new()),
            pack: AtomicBool::new(true),
            announce: Notify::new(),
        }
    }

    /// How long the start-up snapshot collects answers; zero when it is off (also
    /// when sync is off).
    pub(crate) fn snapshot_timeout(&self) -> Duration {
        if self.config.sync {
            self.config.snapshot_timeout
        } else {
            Duration::ZERO
        }
    }
    pub(crate) fn router_id(&self) -> RouterId {
        self.config.router_id
    }
    pub(crate) fn enabled(&self) -> bool {
        self.config.sync
    }

    /// The counters.
    pub fn metrics(&self) -> &SyncMetrics {
        &self.metrics
    }

    /// Queues the booking of one of our own requests — and of its prefill half, when
    /// it runs disaggregated, under `{id}#prefill` as a booking of its own — and
    /// keeps them for snapshot answers. Call under the scheduler lock.
    pub(crate) fn booked(&self, request: &ScheduleRequest, selection: &Selection) {
        if !self.config.sync {
            return;
        }
        let session = request.session_id.clone();
        self.book(
            request.request_id.clone(),
            request,
            selection.rank,
            selection.prefill,
            session,
        );
        if let Some(half) = selection.disaggregation.and_then(|d| d.prefill) {
            let id = prefill_booking_id(&request.request_id);
            self.book(id, request, half.rank, half.prefill, None);
        }
    }

    /// Queues and keeps one booking of `request`'s prompt on `rank`.
    fn book(
        &self,
        id: RequestId,
        request: &ScheduleRequest,
        rank: WorkerRank,
        prefill: PrefillLoadHint,
        session_id: Option<SessionId>,
    ) {
        let booked = Arc::new(BookedSequence {
            worker_id: rank.worker_id,
            dp_rank: rank.dp_rank,
            block_hashes: request.block_hashes.clone(),
            request_blocks: request.request_blocks,
            prefill_tokens: prefill.initial_effective_prefill_tokens,
            expected_prefill_ms: prefill
                .expected_prefill_duration
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            session_id,
        });
        let publish = self.peer_heard().then(|| BookedSequence::clone(&booked));
        if self.own_bookings().insert(id.clone(), booked) {
            self.prune.notify_one();
        }
        if let Some(booked) = publish {
            self.send(id, SequenceUpdate::Booked(booked));
        }
    }

    /// Queues a lifecycle step of one of our own requests. Call under the scheduler
    /// lock.
    pub(crate) fn step(&self, request_id: &RequestId, update: SequenceUpdate) {
        if !self.config.sync {
            return;
        }
        if update == SequenceUpdate::Freed {
            self.own_bookings().remove(request_id);
        }
        if self.peer_heard() {
            self.send(request_id.clone(), update);
        }
    }

    /// Whether another replica has been heard from, so our steps are published.
    pub(crate) fn peer_heard(&self) -> bool {
        self.peer_heard.load(Ordering::Acquire)
    }

    /// Notes that replica `peer` spoke: a sync message, a snapshot request or a
    /// snapshot reply carried its id, and whether it accepts packed bookings. The
    /// first time a peer (not us) is heard, this replica starts queueing its steps
    /// for publication; each time a new one is heard, the publisher announces this
    /// replica (so a peer that started without a snapshot request learns of it too,
    /// and a peer hearing our announcement for the first time answers it once: the
    /// exchange ends). Call it before answering a snapshot request (before the
    /// scheduler lock is taken): every step after the answer's instant is then
    /// published.
    pub(crate) fn heard_from(&self, peer: RouterId, accepts_packed: bool) {
        if peer == self.config.router_id {
            return;
        }
        let new = {
            let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
            if peers.len() >= MAX_PEERS && !peers.contains_key(&peer) {
                // Ids of replicas long gone (each restart draws one): start over;
                // live peers are re-added by their next message, at the cost of one
                // more announcement each.
                peers.clear();
            }
            let before = peers.insert(peer, accepts_packed);
            if before == Some(accepts_packed) {
                return;
            }
            // New, or restarted under its id with another version: recount.
            let array_only = peers.values().filter(|accepts| !**accepts).count();
            self.pack.store(array_only == 0, Ordering::Release);
            self.metrics.peers.set(peers.len() as i64);
            self.metrics.peers_array_only.set(array_only as i64);
            before.is_none()
        };
        if !accepts_packed {
            info!(%peer, "a peer replica decodes only array bookings: publishing block hashes as arrays while it is heard");
        }
        if !new {
            return;
        }
        if self.peer_heard.swap(true, Ordering::AcqRel) {
            info!(%peer, "heard from another peer replica");
        } else {
            info!(%peer, "heard from a peer replica: publishing this replica's bookings and steps from now on");
        }
        self.announce.notify_one();
    }

    /// How the publisher writes its bookings' block hashes: packed while every peer
    /// heard accepts them (all since the packed form), as arrays once a peer that
    /// does not has been heard.
    pub(crate) fn hash_form(&self) -> HashForm {
        if self.pack.load(Ordering::Acquire) {
            HashForm::Packed
        } else {
            HashForm::Array
        }
    }

    /// Resolves when a peer was heard for the first time since this was last
    /// awaited (several such peers may resolve it once).
    pub(crate) async fn new_peer_heard(&self) {
        self.announce.notified().await;
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

    /// Whether steps are being recorded (a start-up snapshot is pending): until then
    /// [`Self::note_step`] does nothing, and its caller may skip listing the steps.
    pub(crate) fn is_recording(&self) -> bool {
        self.recording.load(Ordering::Acquire)
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
    pub(crate) fn note_step(&self, request_id: &RequestId, update: &SequenceUpdate) {
        let step = match update {
            SequenceUpdate::PrefillDone => RecentStep::PrefillDone,
            SequenceUpdate::Freed => RecentStep::Freed,
            SequenceUpdate::Booked(_) | SequenceUpdate::KeepAlive => return,
        };
        if self.is_recording() {
            self.recent_steps().note(request_id, step);
        }
    }

    /// The steps recorded since recording began.
    pub(crate) fn recent_steps(&self) -> MutexGuard<'_, RecentSteps> {
        self.recent
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn send(&self, request_id: RequestId, update: SequenceUpdate) {
        let msg = QueuedStep {
            step: SequenceStep { request_id, update },
            queued_at_us: unix_micros(),
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
    pub(crate) fn take_outbox(&self) -> Option<mpsc::Receiver<QueuedStep>> {
        self.outbox_rx
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
    }
}
