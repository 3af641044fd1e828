//! The sync tasks: publishing this replica's bookings and steps on
//! `{ns}.router.sequences`, and applying its peers' (see the [`super`] docs for the
//! protocol and its ordering).
//!
//! Applying a peer's message takes the scheduler lock once per step and may release
//! waiters once per message; publishing is one NATS publish per publisher wake-up,
//! carrying every step queued by then (a [`SequenceSyncBatch`]), from one task so
//! the order holds. Steps are queued only once a peer has been heard; the publisher
//! says hello (an empty batch) when it starts and again when a new peer is heard
//! (see "Silence until a peer speaks" in [`crate::replicas`]).

use crate::admission::Admission;
use crate::gate::admit;
use crate::metrics::SyncMetrics;
use crate::metrics::counters::{Counters, MessageKind, Outcome};
use crate::replicas::bookings::booked_event;
use crate::replicas::{QueuedStep, Replicas, unix_micros};
use anyhow::Context;
use kv_cluster::nats::NatsConfig;
use kv_events::limits::Limits;
use kv_events::replicas::{
    HashForm, RouterId, SYNC_BATCH_BYTES, SequenceStep, SequenceSyncBatch, SequenceUpdate,
};
use kv_events::{Subjects, encode};
use scheduler::{SchedulerError, SequenceEvent};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

/// What the sync connection is made from.
#[derive(Clone, Copy)]
pub(crate) struct SyncNats<'a> {
    /// The daemon's NATS settings, for the sync connection's own.
    pub config: &'a NatsConfig,
    /// The daemon's main connection, the other end of the start-up barrier.
    pub main: &'a async_nats::Client,
    /// The route path's thread, where the sync connection and tasks run: every route
    /// queues a step for the publisher, which would otherwise wake a thread of the
    /// main runtime per route.
    pub thread: &'a crate::route_thread::RouteThread,
}

/// Opens the sync connection ([`crate::nats::connect_sync`]: without echo, so this
/// replica never reads its own messages) on the route thread, subscribes to the
/// sequences subject and spawns the sync tasks there, tracked by `tasks` (until
/// `stop`): one applying peers' messages, one publishing ours. Returns once the server has the subscription (a round trip to
/// the daemon's `main` connection, since the sync connection cannot read its own
/// messages). Starts recording steps for the start-up snapshot when it is on. Does
/// nothing when sync is off.
///
/// # Errors
/// When the connection options are unusable, the subscription fails, or sync was
/// already started.
pub(crate) async fn start(
    admission: &Arc<Admission>,
    counters: &Counters,
    limits: Limits,
    subjects: &Subjects,
    nats: SyncNats<'_>,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let replicas = &admission.replicas;
    if !replicas.enabled() {
        info!("sequence sync with peer replicas is off");
        return Ok(());
    }
    let outbox = replicas
        .take_outbox()
        .context("sequence sync was already started")?;
    let subject = subjects.sequences();
    if !replicas.snapshot_timeout().is_zero() {
        replicas.begin_recording();
    }
    let (main, thread, config) = (nats.main, nats.thread, nats.config.clone());
    let nats = thread
        .run(async move { crate::nats::connect_sync(&config).await })
        .await?
        .context("configuring the replica sync connection")?;
    let peers = nats
        .subscribe(subject.clone())
        .await
        .context("subscribing to sequence sync")?;
    // The subscription is on its own connection: make sure the server has it before
    // the daemon asks its peers for a snapshot (on the main connection), or a step
    // a peer publishes right after its snapshot could be missed and the snapshot's
    // copy of a freed request resurrected. In a NATS cluster the two connections may
    // be on different nodes: the barrier re-publishes until its message crosses, which
    // proves the subscription reached the main connection's node too (a route carries
    // a node's subscriptions before its later messages), and fails the start after
    // `kv_cluster::barrier::BARRIER_DEADLINE` of NATS being up.
    kv_cluster::barrier::server_barrier_between(&nats, main)
        .await
        .context("syncing the sequence sync subscription with NATS")?;
    let (applying, counters) = (admission.clone(), counters.clone());
    thread.spawn(
        tasks,
        crate::intake::serve_with(peers, stop.child_token(), move |subject, payload| {
            handle_sync(&applying, &counters, &limits, subject, payload)
        }),
    );
    let publisher = Publisher {
        client: nats,
        subject,
        router_id: replicas.router_id(),
        metrics: replicas.metrics().clone(),
    };
    let admission = admission.clone();
    let stop = stop.child_token();
    thread.spawn(tasks, async move {
        publisher.run(&admission.replicas, outbox, stop).await;
    });
    info!(router_id = %replicas.router_id(), "sequence sync with peer replicas on");
    Ok(())
}

/// This replica's sync publications: its steps, its hello and its announcement.
struct Publisher {
    client: async_nats::Client,
    subject: String,
    router_id: RouterId,
    metrics: SyncMetrics,
}

impl Publisher {
    /// Publishes this replica's hello (an empty batch), then queued steps in order
    /// until `stop`, and one more empty batch whenever a new peer is heard; at `stop`
    /// publishes what is still queued, flushes the connection (bounded by
    /// [`crate::nats::DRAIN_TIMEOUT`]) and returns. Each wake-up publishes one
    /// [`SequenceSyncBatch`] of every step queued by then ([`next_batch`]); the `out`
    /// counters count steps, and `announced` the empty batches.
    async fn run(
        &self,
        replicas: &Replicas,
        mut outbox: mpsc::Receiver<QueuedStep>,
        stop: CancellationToken,
    ) {
        self.announce().await;
        loop {
            let first = tokio::select! {
                biased;
                step = outbox.recv() => step,
                () = replicas.new_peer_heard() => {
                    self.announce().await;
                    continue;
                }
                () = stop.cancelled() => None,
            };
            let Some(first) = first.or_else(|| outbox.try_recv().ok()) else {
                if tokio::time::timeout(crate::nats::DRAIN_TIMEOUT, self.client.flush())
                    .await
                    .is_err()
                {
                    warn!("the last sequence sync messages may be lost: flush timed out");
                }
                return;
            };
            let batch = next_batch(self.router_id, first, &mut outbox);
            let steps = batch.steps.len() as u64;
            if self.send(&batch, replicas.hash_form()).await {
                self.metrics.count_steps("out", "published", steps);
            } else {
                self.metrics.count_steps("out", "failed", steps);
            }
        }
    }

    /// Publishes an empty batch: this replica's hello, or its answer to peers heard
    /// for the first time.
    async fn announce(&self) {
        let hello = SequenceSyncBatch {
            router_id: self.router_id,
            steps: Vec::new(),
            queued_at_us: None,
            accepts_packed: true,
        };
        if self.send(&hello, HashForm::Array).await {
            self.metrics.count("out", "announced");
        }
    }

    /// Encodes one batch with its bookings' block hashes in `form` and publishes it;
    /// false (logged) when it could not be sent.
    async fn send(&self, batch: &SequenceSyncBatch, form: HashForm) -> bool {
        let steps = batch.steps.len();
        match encode(&batch.with_hashes(form)) {
            Ok(bytes) => match self
                .client
                .publish(self.subject.clone(), bytes.into())
                .await
            {
                Ok(()) => true,
                Err(e) => {
                    warn!(error = %e, steps, "failed to publish sequence sync");
                    false
                }
            },
            Err(e) => {
                warn!(error = %e, steps, "failed to encode sequence sync");
                false
            }
        }
    }
}

/// `first` and the steps queued behind it, in order, until the outbox is empty or
/// the steps reach [`SYNC_BATCH_BYTES`] (by [`SequenceStep::encoded_len_bound`]; the
/// last step may go over), saying that this replica accepts packed bookings.
pub(crate) fn next_batch(
    router_id: RouterId,
    first: QueuedStep,
    outbox: &mut mpsc::Receiver<QueuedStep>,
) -> SequenceSyncBatch {
    let mut bytes = first.step.encoded_len_bound();
    let queued_at_us = Some(first.queued_at_us);
    let mut steps = vec![first.step];
    while bytes < SYNC_BATCH_BYTES
        && let Ok(queued) = outbox.try_recv()
    {
        bytes += queued.step.encoded_len_bound();
        steps.push(queued.step);
    }
    SequenceSyncBatch {
        router_id,
        steps,
        queued_at_us,
        accepts_packed: true,
    }
}

/// Applies one sync payload received on `subject`: a peer's batch of steps, or the
/// single step of an older peer, in order. The whole message is refused (counted
/// once) when it does not decode or any step is over a limit.
pub fn handle_sync(
    admission: &Admission,
    counters: &Counters,
    limits: &Limits,
    subject: &str,
    payload: &[u8],
) {
    let replicas = &admission.replicas;
    let msg: SequenceSyncBatch =
        match admit(counters, limits, MessageKind::Sequences, subject, payload) {
            Ok(m) => m,
            Err(refusal) => {
                replicas.metrics().count("in", refusal.reason());
                return;
            }
        };
    // The sync connection has no echo, so our own messages never come back; this
    // guards against a peer that (wrongly) shares our router id.
    if msg.router_id == replicas.router_id() {
        replicas
            .metrics()
            .count_steps("in", "own", msg.steps.len() as u64);
        return;
    }
    replicas.heard_from(msg.router_id, msg.accepts_packed);
    let (mut frees_load, mut booking) = (false, false);
    for step in msg.steps {
        let (frees, booked) = apply_step(admission, counters, subject, msg.router_id, step);
        frees_load |= frees;
        booking |= booked;
    }
    if let Some(queued_at_us) = msg.queued_at_us {
        replicas
            .metrics()
            .observe_lag_us(unix_micros().saturating_sub(queued_at_us));
    }
    if booking {
        admission.expiry.booked(&admission.scheduler());
    }
    if frees_load {
        admission.release_waiters();
    }
}

/// Applies one step of peer `router_id` under the scheduler lock and counts it.
/// Returns whether it may have freed load and whether it was a booking.
fn apply_step(
    admission: &Admission,
    counters: &Counters,
    subject: &str,
    router_id: RouterId,
    step: SequenceStep,
) -> (bool, bool) {
    let replicas = &admission.replicas;
    let SequenceStep { request_id, update } = step;
    replicas.note_step(&request_id, &update);
    let (event, frees_load) = match update {
        SequenceUpdate::Booked(b) => (booked_event(router_id, request_id.clone(), b), false),
        SequenceUpdate::PrefillDone => (
            SequenceEvent::MarkPrefillCompleted(request_id.clone()),
            true,
        ),
        SequenceUpdate::KeepAlive => (SequenceEvent::KeepAlive(request_id.clone()), false),
        SequenceUpdate::Freed => (SequenceEvent::Free(request_id.clone()), true),
    };
    let booking = matches!(event, SequenceEvent::AddRequest(_));
    let result = admission.scheduler().apply(event, Instant::now());
    match result {
        Ok(_) => {
            replicas.metrics().count("in", "applied");
            counters.message(MessageKind::Sequences, Outcome::Ok);
        }
        // The frontend's own lifecycle message got here first (or the request
        // expired): the step is already applied. Or a start-up snapshot reply
        // carried the booking before its live `booked`.
        Err(SchedulerError::UnknownRequest(_) | SchedulerError::DuplicateRequest(_)) => {
            replicas.metrics().count("in", "duplicate");
            counters.message(MessageKind::Sequences, Outcome::Ok);
        }
        Err(e) => {
            replicas.metrics().count("in", "rejected");
            counters.message(MessageKind::Sequences, Outcome::Rejected);
            debug!(subject, %request_id, %router_id, error = %e, "sequence sync refused");
        }
    }
    (frees_load, booking)
}
