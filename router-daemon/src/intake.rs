//! KV event and load-metric intake.
//!
//! One task per subscription. Events are decoded here and handed to the indexer,
//! whose bounded shard queues apply backpressure: a slow shard slows this loop (and
//! NATS buffers for us) rather than growing memory without bound. A payload that does
//! not decode, or whose worker id disagrees with its subject, is counted, logged with
//! its subject, and skipped; the loop goes on.

use crate::admission::Admission;
use crate::metrics::counters::{Counters, MessageKind, Outcome};
use futures::StreamExt;
use indexer::{Indexer, IndexerApi as _};
use kv_events::{KvEventBatch, LoadMetrics, Subjects, decode};
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Decodes and checks one KV event payload from `subject`.
///
/// Returns `None` (after counting and logging) when it must be skipped.
pub fn decode_events(counters: &Counters, subject: &str, payload: &[u8]) -> Option<KvEventBatch> {
    let batch: KvEventBatch = match decode(payload) {
        Ok(b) => b,
        Err(e) => {
            counters.message(MessageKind::Events, Outcome::Malformed);
            warn!(subject, error = %e, "malformed kv event batch skipped");
            return None;
        }
    };
    if Subjects::worker_id_from_subject(subject) != Some(batch.worker_id) {
        counters.message(MessageKind::Events, Outcome::Rejected);
        warn!(subject, worker_id = %batch.worker_id, "kv event batch published on another worker's subject skipped");
        return None;
    }
    Some(batch)
}

/// Consumes KV events into `indexer` until `intake` is cancelled.
pub async fn serve_events(
    indexer: Indexer,
    counters: Counters,
    subscriber: async_nats::Subscriber,
    intake: CancellationToken,
) {
    let mut messages = std::pin::pin!(crate::nats::drain_on_cancel(subscriber, intake));
    while let Some(msg) = messages.next().await {
        let received = std::time::Instant::now();
        let Some(batch) = decode_events(&counters, &msg.subject, &msg.payload) else {
            continue;
        };
        if let Err(e) = indexer.apply(batch).await {
            warn!(error = %e, "indexer refused events; stopping event intake");
            return;
        }
        counters.metrics.events.observe_lag(received.elapsed());
        counters.message(MessageKind::Events, Outcome::Ok);
    }
}

/// Applies one load-metrics payload from `subject` to the scheduler.
pub fn handle_metrics(admission: &Admission, counters: &Counters, subject: &str, payload: &[u8]) {
    match decode::<LoadMetrics>(payload) {
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
        Err(e) => {
            counters.message(MessageKind::Metrics, Outcome::Malformed);
            warn!(subject, error = %e, "malformed load metrics skipped");
        }
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
