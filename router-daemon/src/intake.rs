//! KV event and load-metric intake.
//!
//! One task per subscription. Events are decoded here and applied to the indexer's
//! shard in this task, so a slow shard slows this loop (and NATS buffers for us)
//! rather than growing memory without bound. A payload that is
//! too large, does not decode, is over a limit (`crate::gate`), or whose worker id
//! disagrees with its subject, is counted, logged with its subject, and skipped; the
//! loop goes on. KV events from either intake (core NATS here, or the JetStream
//! consumer) pass through one [`EventDoor`]: decode → hold for the registration →
//! apply, so both enforce the same registration and epoch rules.

use crate::admission::Admission;
use crate::gate::admit;
use crate::metrics::counters::{Counters, MessageKind, Outcome};
use crate::publishers::{Dropped, Hold, HoldConfig, HoldReason, RegisteredEpochs};
use crate::removals::Removals;
use futures::StreamExt;
use indexer::{Indexer, IndexerApi as _};
use kv_events::limits::Limits;
use kv_events::{KvEventBatch, LoadMetrics, Subjects};
use std::sync::Arc;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Decodes and checks one KV event payload from `subject`.
///
/// Returns `None` (after counting and logging) when it must be skipped.
pub fn decode_events(
    counters: &Counters,
    limits: &Limits,
    subject: &str,
    payload: &[u8],
) -> Option<KvEventBatch> {
    let batch: KvEventBatch =
        admit(counters, limits, MessageKind::Events, subject, payload).ok()?;
    if Subjects::worker_id_from_subject(subject) != Some(batch.worker_id) {
        counters.message(MessageKind::Events, Outcome::Rejected);
        warn!(subject, worker_id = %batch.worker_id, "kv event batch published on another worker's subject skipped");
        return None;
    }
    Some(batch)
}

/// What a KV event intake uses.
pub(crate) struct IntakeParts {
    /// Where batches go.
    pub indexer: Indexer,
    /// Message counters.
    pub counters: Counters,
    /// Bounds on each payload.
    pub limits: Limits,
    /// The registered publishers and their epochs (`crate::publishers`).
    pub publishers: watch::Receiver<RegisteredEpochs>,
    /// How long and how many batches wait for their registration.
    pub hold: HoldConfig,
    /// Subject names, for logging.
    pub subjects: Subjects,
    /// Where removals are remembered (`crate::removals`).
    pub removals: Arc<Removals>,
}

/// The one door every KV event message goes through, whichever intake received it
/// (the core subscription, [`serve_events`], or the JetStream consumer,
/// `crate::durability::jetstream`): decode and bound it ([`decode_events`]), apply it
/// if its worker is registered at (or after) its epoch, and otherwise hold it for its
/// registration (`crate::publishers`). Registrations are looked at before each
/// message, so held batches of a worker are applied before its later ones.
///
/// `P` is where a message came from (`()` for core NATS, the stream sequence for
/// JetStream), kept with each held batch ([`EventDoor::oldest_held`]).
///
/// The intake's loop waits on its messages and on [`EventDoor::wake`] in one
/// `select!`, then calls [`EventDoor::take`] or [`EventDoor::handle`]; both return
/// false once the indexer is gone, and the intake must stop.
pub(crate) struct EventDoor<P> {
    parts: IntakeParts,
    hold: Hold<(KvEventBatch, P)>,
}

/// Why [`EventDoor::wake`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wake {
    /// The registrations changed: held batches may be applied now.
    Registrations,
    /// The oldest held batch's grace ended.
    Expired,
}

impl<P: Copy> EventDoor<P> {
    /// A door with nothing held.
    pub(crate) fn new(parts: IntakeParts) -> Self {
        let hold = Hold::new(parts.hold);
        Self { parts, hold }
    }

    /// Waits until the registrations change or a held batch's grace ends. Cancel-safe:
    /// it only waits; [`Self::handle`] acts.
    pub(crate) async fn wake(&mut self) -> Wake {
        let deadline = self.hold.next_deadline();
        let expired = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            Ok(()) = self.parts.publishers.changed() => Wake::Registrations,
            () = expired => Wake::Expired,
        }
    }

    /// Acts on `wake`: applies the held batches the registrations now allow, in
    /// arrival order, or drops (and counts) those whose grace ended. False when the
    /// indexer is gone.
    pub(crate) async fn handle(&mut self, wake: Wake) -> bool {
        match wake {
            Wake::Registrations => self.release().await,
            Wake::Expired => {
                let dropped = self
                    .hold
                    .expire(Instant::now(), &self.parts.publishers.borrow());
                for dropped in dropped {
                    self.drop_held(dropped);
                }
                true
            }
        }
    }

    /// Takes one message received on `subject` from `position`: skips it if it does
    /// not decode or is over a limit (counted and logged), applies it, or holds it.
    /// False when the indexer is gone.
    pub(crate) async fn take(&mut self, subject: &str, payload: &[u8], position: P) -> bool {
        let received = std::time::Instant::now();
        let Some(batch) = decode_events(&self.parts.counters, &self.parts.limits, subject, payload)
        else {
            return true;
        };
        if self.parts.publishers.has_changed().unwrap_or(false) && !self.release().await {
            return false;
        }
        let admitted = self.hold.admit(
            (batch, position),
            &self.parts.publishers.borrow(),
            Instant::now(),
        );
        match admitted {
            Ok((batch, _)) => {
                if !self.apply(batch).await {
                    return false;
                }
                (self.parts.counters.metrics.events).observe_lag(received.elapsed());
            }
            Err(evicted) => evicted.into_iter().for_each(|d| self.drop_held(d)),
        }
        true
    }

    /// Where the batch held longest came from; `None` when nothing is held.
    pub(crate) fn oldest_held(&self) -> Option<P> {
        self.hold.oldest().map(|(_, position)| *position)
    }

    /// Applies one batch; false when the indexer is gone (intake must stop).
    async fn apply(&self, batch: KvEventBatch) -> bool {
        self.parts.removals.record(&batch);
        if let Err(e) = self.parts.indexer.apply(batch).await {
            warn!(error = %e, "indexer refused events; stopping event intake");
            return false;
        }
        (self.parts.counters).message(MessageKind::Events, Outcome::Ok);
        true
    }

    /// Applies the held batches the current registrations allow, in arrival order.
    async fn release(&mut self) -> bool {
        let released = self
            .hold
            .release(&self.parts.publishers.borrow_and_update());
        for (batch, _) in released {
            if !self.apply(batch).await {
                return false;
            }
        }
        true
    }

    /// Counts and logs (rate-limited) a held batch given up on.
    fn drop_held(&self, dropped: Dropped) {
        let outcome = match dropped.reason {
            HoldReason::Unregistered => Outcome::Unregistered,
            HoldReason::FutureEpoch => Outcome::FutureEpoch,
        };
        let detail = format!(
            "worker {} (epoch {}) is not registered at that epoch",
            dropped.worker_id, dropped.epoch
        );
        let subject = self.parts.subjects.kv_events(dropped.worker_id);
        (self.parts.counters).skipped(MessageKind::Events, outcome, &subject, &detail);
    }
}

/// The core NATS intake: consumes KV events from `subscriber` through an
/// [`EventDoor`] until `intake` is cancelled (then drains the subscription).
pub(crate) async fn serve_events(
    parts: IntakeParts,
    subscriber: async_nats::Subscriber,
    intake: CancellationToken,
) {
    let mut messages = std::pin::pin!(crate::nats::drain_on_cancel(subscriber, intake));
    let mut door = EventDoor::new(parts);
    loop {
        tokio::select! {
            biased;
            wake = door.wake() => {
                if !door.handle(wake).await {
                    return;
                }
            }
            msg = messages.next() => {
                let Some(msg) = msg else { return };
                if !door.take(&msg.subject, &msg.payload, ()).await {
                    return;
                }
            }
        }
    }
}

/// Applies one load-metrics payload from `subject` to the scheduler.
pub fn handle_metrics(
    admission: &Admission,
    counters: &Counters,
    limits: &Limits,
    subject: &str,
    payload: &[u8],
) {
    match admit::<LoadMetrics>(counters, limits, MessageKind::Metrics, subject, payload) {
        Ok(m) if Subjects::worker_id_from_subject(subject) == Some(m.worker_id) => {
            admission
                .scheduler()
                .update_load_metrics(m, std::time::Instant::now());
            counters.message(MessageKind::Metrics, Outcome::Ok);
            // Engine-reported load counts toward busy: a lower sample may free room.
            admission.release_waiters();
        }
        Ok(m) => {
            counters.message(MessageKind::Metrics, Outcome::Rejected);
            warn!(subject, worker_id = %m.worker_id, "load metrics published on another worker's subject skipped");
        }
        Err(_) => {} // counted and logged by `admit`
    }
}

/// Feeds the subject and payload of every message of `subscriber` to `handler` until
/// `intake` is cancelled. Used for load metrics ([`handle_metrics`]) and peers'
/// sequence sync (`replica_sync::sync::handle_sync`), whose handling never awaits; the handler
/// captures the parts of the daemon it uses.
pub(crate) async fn serve_with(
    subscriber: async_nats::Subscriber,
    intake: CancellationToken,
    mut handler: impl FnMut(&str, &[u8]) + Send,
) {
    let mut messages = std::pin::pin!(crate::nats::drain_on_cancel(subscriber, intake));
    while let Some(msg) = messages.next().await {
        handler(&msg.subject, &msg.payload);
    }
}

/// Most messages [`serve_batches_with`] hands over at once.
const MAX_BATCH: usize = 256;

/// Like [`serve_with`], but hands `handler` every message already received (up to
/// [`MAX_BATCH`]), in order, so it can apply them under one lock. Waits only for the
/// first message of a batch; never delays one to fill a batch.
pub(crate) async fn serve_batches_with(
    subscriber: async_nats::Subscriber,
    intake: CancellationToken,
    mut handler: impl FnMut(&[async_nats::Message]) + Send,
) {
    let messages = crate::nats::drain_on_cancel(subscriber, intake).ready_chunks(MAX_BATCH);
    let mut messages = std::pin::pin!(messages);
    while let Some(batch) = messages.next().await {
        handler(&batch);
    }
}
