//! KV event and load-metric intake.
//!
//! One task per subscription. Events are decoded here and handed to the indexer,
//! whose bounded shard queues apply backpressure: a slow shard slows this loop (and
//! NATS buffers for us) rather than growing memory without bound. A payload that is
//! too large, does not decode, is over a limit (`crate::gate`), or whose worker id
//! disagrees with its subject, is counted, logged with its subject, and skipped; the
//! loop goes on.

use crate::admission::Admission;
use crate::gate::admit;
use crate::metrics::counters::{Counters, MessageKind, Outcome};
use crate::publishers::{Dropped, Hold, HoldConfig, HoldReason, Registered};
use futures::StreamExt;
use indexer::{Indexer, IndexerApi as _};
use kv_events::limits::Limits;
use kv_events::{KvEventBatch, LoadMetrics, Subjects};
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

/// What the KV event intake task uses.
pub struct EventIntake {
    /// Where batches go.
    pub indexer: Indexer,
    /// Message counters.
    pub counters: Counters,
    /// Bounds on each payload.
    pub limits: Limits,
    /// The registered publishers and their epochs (`crate::publishers`).
    pub publishers: watch::Receiver<Registered>,
    /// How long and how many batches wait for their registration.
    pub hold: HoldConfig,
    /// Subject names, for logging.
    pub subjects: Subjects,
}

/// Consumes KV events into the indexer until `intake` is cancelled: decodes and bounds
/// each batch, applies it if its worker is registered at (or after) its epoch, and
/// otherwise holds it for its registration (`crate::publishers`). Registrations are
/// looked at before each message, so held batches of a worker are applied before
/// its later ones.
pub async fn serve_events(
    mut parts: EventIntake,
    subscriber: async_nats::Subscriber,
    intake: CancellationToken,
) {
    let mut messages = std::pin::pin!(crate::nats::drain_on_cancel(subscriber, intake));
    let mut hold = Hold::new(parts.hold);
    loop {
        let deadline = hold.next_deadline();
        let expired = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            Ok(()) = parts.publishers.changed() => {
                if !parts.release(&mut hold).await {
                    return;
                }
            }
            () = expired => {
                let dropped = hold.expire(Instant::now(), &parts.publishers.borrow());
                for dropped in dropped {
                    parts.drop_held(dropped);
                }
            }
            msg = messages.next() => {
                let Some(msg) = msg else { return };
                let received = std::time::Instant::now();
                let Some(batch) = decode_events(&parts.counters, &parts.limits, &msg.subject, &msg.payload) else {
                    continue;
                };
                if parts.publishers.has_changed().unwrap_or(false) && !parts.release(&mut hold).await {
                    return;
                }
                let admitted = hold.admit(batch, &parts.publishers.borrow(), Instant::now());
                match admitted {
                    Ok(batch) => {
                        if !parts.apply(batch).await {
                            return;
                        }
                        parts.counters.metrics.events.observe_lag(received.elapsed());
                    }
                    Err(evicted) => evicted.into_iter().for_each(|d| parts.drop_held(d)),
                }
            }
        }
    }
}

impl EventIntake {
    /// Applies one batch; false when the indexer is gone (intake must stop).
    async fn apply(&self, batch: KvEventBatch) -> bool {
        if let Err(e) = self.indexer.apply(batch).await {
            warn!(error = %e, "indexer refused events; stopping event intake");
            return false;
        }
        self.counters.message(MessageKind::Events, Outcome::Ok);
        true
    }

    /// Applies the held batches the current registrations allow, in arrival order.
    async fn release(&mut self, hold: &mut Hold) -> bool {
        let released = hold.release(&self.publishers.borrow_and_update());
        for batch in released {
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
        let subject = self.subjects.kv_events(dropped.worker_id);
        (self.counters).skipped(MessageKind::Events, outcome, &subject, &detail);
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
/// `intake` is cancelled. Used for load metrics ([`handle_metrics`]), lifecycle
/// messages ([`crate::lifecycle::handle_lifecycle`]) and peers' sequence sync
/// ([`crate::replicas::sync::handle_sync`]), whose handling never awaits; the handler
/// captures the parts of the daemon it uses.
pub async fn serve_with(
    subscriber: async_nats::Subscriber,
    intake: CancellationToken,
    mut handler: impl FnMut(&str, &[u8]) + Send,
) {
    let mut messages = std::pin::pin!(crate::nats::drain_on_cancel(subscriber, intake));
    while let Some(msg) = messages.next().await {
        handler(&msg.subject, &msg.payload);
    }
}
