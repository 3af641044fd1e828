//! The sync tasks: publishing this replica's bookings and steps on
//! `{ns}.router.sequences`, and applying its peers' (see the [`super`] docs for the
//! protocol and its ordering).
//!
//! Applying a peer's message takes the scheduler lock once and may release waiters;
//! publishing is one NATS publish per message, from one task so the order holds.

use super::bookings::booked_event;
use crate::admission::Admission;
use crate::gate::admit;
use crate::metrics::SyncMetrics;
use crate::metrics::counters::{Counters, MessageKind, Outcome};
use anyhow::Context;
use kv_cluster::nats::NatsConfig;
use kv_events::limits::Limits;
use kv_events::replicas::{SequenceSync, SequenceUpdate};
use kv_events::{Subjects, encode};
use scheduler::{SchedulerError, SequenceEvent};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

/// Opens the sync connection ([`crate::nats::connect_sync`]: without echo, so this
/// replica never reads its own messages), subscribes to the sequences subject and
/// spawns the sync tasks on `tasks` (until `stop`): one applying peers' messages, one
/// publishing ours. Starts recording steps for the start-up snapshot when it is on.
/// Does nothing when sync is off.
///
/// # Errors
/// When the connection options are unusable, the subscription fails, or sync was
/// already started.
pub async fn start(
    admission: &Arc<Admission>,
    counters: &Counters,
    limits: Limits,
    subjects: &Subjects,
    nats: &NatsConfig,
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
    let nats = crate::nats::connect_sync(nats)
        .await
        .context("configuring the replica sync connection")?;
    let peers = nats
        .subscribe(subject.clone())
        .await
        .context("subscribing to sequence sync")?;
    let (admission, counters) = (admission.clone(), counters.clone());
    tasks.spawn(crate::intake::serve_with(
        peers,
        stop.child_token(),
        move |subject, payload| handle_sync(&admission, &counters, &limits, subject, payload),
    ));
    tasks.spawn(publish(
        nats,
        subject,
        outbox,
        replicas.metrics().clone(),
        stop.child_token(),
    ));
    info!(router_id = %replicas.router_id(), "sequence sync with peer replicas on");
    Ok(())
}

/// Publishes queued sync messages on `subject` in order until `stop`, then publishes
/// what is still queued, flushes the connection (bounded by
/// [`crate::nats::DRAIN_TIMEOUT`]) and returns.
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
            if tokio::time::timeout(crate::nats::DRAIN_TIMEOUT, client.flush())
                .await
                .is_err()
            {
                warn!("the last sequence sync messages may be lost: flush timed out");
            }
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
pub fn handle_sync(
    admission: &Admission,
    counters: &Counters,
    limits: &Limits,
    subject: &str,
    payload: &[u8],
) {
    let replicas = &admission.replicas;
    let msg: SequenceSync = match admit(counters, limits, MessageKind::Sequences, subject, payload)
    {
        Ok(m) => m,
        Err(refusal) => {
            replicas.metrics().count("in", refusal.reason());
            return;
        }
    };
    // The sync connection has no echo, so our own messages never come back; this
    // guards against a peer that (wrongly) shares our router id.
    if msg.router_id == replicas.router_id() {
        replicas.metrics().count("in", "own");
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
            debug!(subject, request_id = %msg.request_id, router_id = %msg.router_id, error = %e, "sequence sync refused");
        }
    }
    if booking {
        admission.expiry.notify_one();
    }
    if frees_load {
        admission.release_waiters();
    }
}
