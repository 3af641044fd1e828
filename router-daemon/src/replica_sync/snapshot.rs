//! The start-up snapshot: a replica that starts while others serve learns the
//! bookings they made before it subscribed to `{ns}.router.sequences`.
//!
//! ```text
//!  starting replica B                                   every other replica (A, …)
//!  subscribe {ns}.router.sequences; record steps ─┐
//!  discovery loaded (ranks known)                 │
//!  SnapshotRequest ──► {ns}.router.sequences.snapshot ──► lock scheduler, copy own
//!                      (plain subscription: all answer)    (Local) bookings, unlock
//!  apply each chunk ◄── SnapshotReply chunks ◄──────────── chunked under the byte budget
//!   (skip known; skip freed since subscribing;             to the reply inbox
//!    mark prefill done as the reply or a step says)
//!  window over (--replica-snapshot-timeout-ms, or "no responders" at once):
//!  stop recording; serve {ns}.router.sequences.snapshot; join route group; ready
//! ```
//!
//! Ordering and consistency. B subscribes to the live subject before it publishes
//! the request, and one connection's commands are handled by the server in order, so
//! every `SequenceSync` a peer publishes after it received the request reaches B. A
//! peer answers from its scheduler state at one instant T; what it books or steps
//! after T reaches B on the live subject. What it did before T is in the reply, and
//! may also reach B live (a booking whose sync message was still queued): a booking
//! B already knows is skipped (counted `duplicate`), in either order. The live step
//! and the reply race only in one harmful way: a request freed (or prefill done)
//! after T, whose step B handles before the reply. So from the subscription until
//! the window closes, B records the ids of every prefill-done and freed step it sees
//! (live sync and frontend lifecycle, noted before the scheduler lock is taken), and
//! applies a reply entry under the scheduler lock after checking that record: freed
//! ids are skipped, prefill-done ids are booked with their prefill completed. Either
//! the step is recorded before the entry is checked, or the step is applied after
//! the entry, and undoes it.
//!
//! What the snapshot does not guarantee: answers arriving after the window are
//! dropped (B under-counts those bookings until they are freed); bookings on ranks B
//! has not registered are refused; the TTL and any prefill decay of a learned booking
//! restart when B applies it; peers running a version without the snapshot do not
//! answer; the record keeps at most [`crate::replicas::bookings::RECENT_STEPS_CAPACITY`] steps (the oldest are
//! forgotten — only steps around the request matter); in a NATS cluster, B's
//! subscription reaches a node other than its two connections' over that node's own
//! route, so a peer whose sync connection is there can publish a step in the first
//! route delay after the barrier (milliseconds) that B misses, as any lost sync
//! message ([`crate::replica_sync::sync`]). Load accounting is advisory:
//! each of these only makes B count differently for a while, never fails a request.
//!
//! Costs: at start-up one request, a wait of at most the window (overlapped with the
//! index recovery; none for the first replica, which gets "no responders"), and
//! replies of about 9 bytes per prompt block of every in-flight request. Each replica
//! keeps a copy of its own bookings to answer from
//! ([`crate::replicas::bookings::OwnBookings`]).

use crate::admission::Admission;
use crate::gate::admit;
use crate::metrics::counters::{Counters, MessageKind, Outcome};
use crate::replicas::bookings::{RecentStep, booked_event};
use anyhow::Context;
use futures::StreamExt;
use kv_events::limits::Limits;
use kv_events::replicas::{
    BookedSequence, SNAPSHOT_CHUNK_BYTES, SnapshotEntry, SnapshotReply, SnapshotRequest,
};
use kv_events::{RouterId, Subjects, decode, encode};
use scheduler::SchedulerError;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

/// What one start-up snapshot learned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SnapshotSummary {
    /// Whether a request was sent (false: snapshot off, or NATS failed).
    pub requested: bool,
    /// Chunks received per answering peer, and whether its last chunk arrived.
    pub peers: BTreeMap<RouterId, (u32, bool)>,
    /// Bookings applied as peer bookings.
    pub applied: u64,
    /// Bookings already known (from the live subject), skipped.
    pub duplicate: u64,
    /// Bookings freed since the subscription started, skipped.
    pub freed: u64,
    /// Bookings the scheduler refused (e.g. unknown rank).
    pub rejected: u64,
    /// Replies that did not decode.
    pub malformed: u64,
}

impl SnapshotSummary {
    /// Peers that answered, and how many of them completely (last chunk seen).
    pub(crate) fn peer_counts(&self) -> (usize, usize) {
        let complete = self.peers.values().filter(|(_, last)| *last).count();
        (self.peers.len(), complete)
    }
}

impl fmt::Display for SnapshotSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (peers, complete) = self.peer_counts();
        write!(
            f,
            "{peers} peers ({complete} complete), {} bookings applied, {} duplicate, {} freed meanwhile, {} rejected, {} malformed replies",
            self.applied, self.duplicate, self.freed, self.rejected, self.malformed
        )
    }
}

/// Asks every peer for its bookings and applies the answers that arrive within the
/// snapshot window; stops recording steps afterwards. Call after discovery loaded
/// (bookings need their ranks registered) and before serving routes. Never fails:
/// no peers, no answers or a NATS error leave the replica with what the live
/// subject brings.
pub(crate) async fn gather(
    admission: &Admission,
    counters: &Counters,
    limits: &Limits,
    subjects: &Subjects,
    nats: &async_nats::Client,
) -> SnapshotSummary {
    let replicas = &admission.replicas;
    let window = replicas.snapshot_timeout();
    let mut summary = SnapshotSummary::default();
    if window.is_zero() {
        replicas.end_recording();
        if replicas.enabled() {
            info!("replica snapshot off: learning peers' bookings from the live subject only");
        }
        return summary;
    }
    let subject = subjects.sequences_snapshot();
    match collect(
        admission,
        counters,
        limits,
        nats,
        &subject,
        window,
        &mut summary,
    )
    .await
    {
        Ok(()) => {
            let (peers, complete) = summary.peer_counts();
            info!(
                peers,
                complete,
                requests = summary.applied,
                duplicate = summary.duplicate,
                freed = summary.freed,
                rejected = summary.rejected,
                malformed = summary.malformed,
                "replica snapshot: learned peers' bookings"
            );
            if complete < peers {
                warn!(
                    subject,
                    incomplete = peers - complete,
                    "replica snapshot: some peers' answers were cut by the window; their other bookings show up when they change"
                );
            }
        }
        Err(e) => {
            warn!(subject, error = %format!("{e:#}"), "replica snapshot failed; learning peers' bookings from the live subject only");
        }
    }
    replicas.end_recording();
    summary
}

async fn collect(
    admission: &Admission,
    counters: &Counters,
    limits: &Limits,
    nats: &async_nats::Client,
    subject: &str,
    window: std::time::Duration,
    summary: &mut SnapshotSummary,
) -> anyhow::Result<()> {
    let request = SnapshotRequest {
        router_id: admission.replicas.router_id(),
        accepts_packed: true,
    };
    let payload = encode(&request).context("encoding the snapshot request")?;
    let inbox = nats.new_inbox();
    let mut replies = nats
        .subscribe(inbox.clone())
        .await
        .context("subscribing to the snapshot inbox")?;
    nats.publish_with_reply(subject.to_owned(), inbox, payload.into())
        .await
        .context("publishing the snapshot request")?;
    summary.requested = true;
    let deadline = tokio::time::Instant::now() + window;
    loop {
        let message = tokio::select! {
            () = tokio::time::sleep_until(deadline) => break,
            message = replies.next() => message,
        };
        let Some(message) = message else { break };
        // Nobody serves the subject: the first replica of the namespace.
        if message.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
            debug!(subject, "replica snapshot: no peers answer");
            break;
        }
        apply_reply(
            admission,
            counters,
            limits,
            &message.subject,
            &message.payload,
            summary,
        );
    }
    Ok(())
}

/// Applies one snapshot reply chunk received on `subject`, as peer bookings, through
/// the same path as a live `booked` (`booked_event`). Skips bookings already known
/// and requests freed since the sequences subscription started; books with the
/// prefill completed when the reply or a recorded step says so. Malformed replies are
/// counted, logged with their subject and skipped.
pub fn apply_reply(
    admission: &Admission,
    counters: &Counters,
    limits: &Limits,
    subject: &str,
    payload: &[u8],
    summary: &mut SnapshotSummary,
) {
    let replicas = &admission.replicas;
    let metrics = replicas.metrics();
    let kind = MessageKind::SequenceSnapshot;
    let reply: SnapshotReply = match admit(counters, limits, kind, subject, payload) {
        Ok(r) => r,
        Err(refusal) => {
            summary.malformed += 1;
            metrics.count("snapshot_in", refusal.reason());
            return;
        }
    };
    counters.message(MessageKind::SequenceSnapshot, Outcome::Ok);
    if reply.router_id == replicas.router_id() {
        return;
    }
    replicas.heard_from(reply.router_id, reply.accepts_packed);
    let peer = summary.peers.entry(reply.router_id).or_default();
    peer.0 += 1;
    peer.1 |= reply.last;
    let now = Instant::now();
    let mut applied = false;
    {
        let mut scheduler = admission.scheduler();
        let recent = replicas.recent_steps();
        for entry in reply.requests {
            let step = recent.get(&entry.request_id);
            let outcome = if step == Some(RecentStep::Freed) {
                summary.freed += 1;
                "freed"
            } else {
                let id = entry.request_id.clone();
                match scheduler.apply(booked_event(reply.router_id, id.clone(), entry.booked), now)
                {
                    Ok(_) => {
                        if entry.prefill_done || step == Some(RecentStep::PrefillDone) {
                            // Just booked under this lock: it is known.
                            let _ = scheduler.mark_prefill_completed(&id, now);
                        }
                        applied = true;
                        summary.applied += 1;
                        "applied"
                    }
                    Err(SchedulerError::DuplicateRequest(_)) => {
                        summary.duplicate += 1;
                        "duplicate"
                    }
                    Err(e) => {
                        summary.rejected += 1;
                        debug!(subject, request_id = %id, router_id = %reply.router_id, error = %e, "replica snapshot booking refused");
                        "rejected"
                    }
                }
            };
            metrics.count("snapshot_in", outcome);
        }
    }
    if applied {
        admission.expiry.booked(&admission.scheduler());
    }
}

/// Subscribes to the snapshot subject (a plain subscription: every replica answers)
/// and spawns the task answering peers' requests on `tasks` until `stop`; the same
/// task prunes the own bookings when they grow. Does nothing when sync is off.
///
/// # Errors
/// When the subscription fails.
pub(crate) async fn serve(
    admission: &Arc<Admission>,
    counters: &Counters,
    subjects: &Subjects,
    nats: &async_nats::Client,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    if !admission.replicas.enabled() {
        return Ok(());
    }
    let requests = nats
        .subscribe(subjects.sequences_snapshot())
        .await
        .context("subscribing to replica snapshot requests")?;
    tasks.spawn(answer_requests(
        admission.clone(),
        counters.clone(),
        nats.clone(),
        requests,
        stop.child_token(),
    ));
    Ok(())
}

async fn answer_requests(
    admission: Arc<Admission>,
    counters: Counters,
    nats: async_nats::Client,
    requests: async_nats::Subscriber,
    stop: CancellationToken,
) {
    let replicas = &admission.replicas;
    let mut requests = std::pin::pin!(crate::nats::drain_on_cancel(requests, stop));
    loop {
        let message = tokio::select! {
            message = requests.next() => message,
            () = replicas.prune_wanted() => {
                let scheduler = admission.scheduler();
                let mut own = replicas.own_bookings();
                let before = own.len();
                own.prune(&scheduler);
                debug!(before, after = own.len(), "pruned own bookings kept for snapshots");
                continue;
            }
        };
        let Some(message) = message else { return };
        answer(&admission, &counters, &nats, &message).await;
    }
}

/// Counts and logs an undecodable snapshot `what` ("request" or "reply") received on
/// `subject`; the caller skips it.
fn skip_malformed(
    admission: &Admission,
    counters: &Counters,
    subject: &str,
    what: &str,
    error: &dyn std::fmt::Display,
) {
    counters.message(MessageKind::SequenceSnapshot, Outcome::Malformed);
    admission
        .replicas
        .metrics()
        .count("snapshot_in", "malformed");
    warn!(subject, what, error = %error, "malformed replica snapshot message skipped");
}

/// Answers one snapshot request with our own bookings, chunked, to its reply inbox.
async fn answer(
    admission: &Admission,
    counters: &Counters,
    nats: &async_nats::Client,
    message: &async_nats::Message,
) {
    let replicas = &admission.replicas;
    let metrics = replicas.metrics();
    let subject = message.subject.as_str();
    let request: SnapshotRequest = match decode(&message.payload) {
        Ok(r) => r,
        Err(e) => return skip_malformed(admission, counters, subject, "request", &e),
    };
    if request.router_id == replicas.router_id() {
        return;
    }
    // Before the answer's instant: every step after it is then published.
    replicas.heard_from(request.router_id, request.accepts_packed);
    let Some(reply_to) = message.reply.clone() else {
        counters.message(MessageKind::SequenceSnapshot, Outcome::Rejected);
        warn!(subject, router_id = %request.router_id, "replica snapshot request without a reply inbox skipped");
        return;
    };
    counters.message(MessageKind::SequenceSnapshot, Outcome::Ok);
    let current = {
        let scheduler = admission.scheduler();
        replicas.own_bookings().current(&scheduler)
    };
    let entries: Vec<SnapshotEntry> = current
        .into_iter()
        .map(|(request_id, booked, prefill_done)| SnapshotEntry {
            request_id,
            booked: BookedSequence::clone(&booked),
            prefill_done,
        })
        .collect();
    let requests = entries.len();
    let max_payload = nats.server_info().max_payload;
    let budget = if max_payload == 0 {
        SNAPSHOT_CHUNK_BYTES
    } else {
        SNAPSHOT_CHUNK_BYTES.min(max_payload / 2)
    };
    let chunks = SnapshotReply::chunked(replicas.router_id(), entries, budget);
    let count = chunks.len();
    for chunk in chunks {
        let sent = match encode(&chunk) {
            Ok(bytes) => nats
                .publish(reply_to.clone(), bytes.into())
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(error) = sent {
            metrics.count("snapshot_out", "failed");
            warn!(subject, router_id = %request.router_id, error, "cannot send a replica snapshot reply; the peer gets a partial answer");
            return;
        }
        metrics.count("snapshot_out", "published");
    }
    metrics.count("snapshot_out", "answered");
    info!(peer = %request.router_id, requests, chunks = count, "answered a replica snapshot request");
}

#[cfg(test)]
#[path = "snapshot_tests.rs"]
mod tests;
