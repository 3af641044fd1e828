//! Gap recovery over NATS: the daemon side of `{ns}.kv.recovery.{worker_id}`.
//!
//! The indexer emits a [`RecoveryNeed`] when a worker rank's events have a gap, a
//! `Stored` names an unknown parent, a recovery buffer overflows, or the daemon asks
//! for a resync. [`spawn`] starts a task that sends each need's
//! [`RecoveryRequest`] to the publisher, collects the chunked reply
//! ([`RecoveryChunk`]s on a private inbox, reassembled by a [`ChunkAssembler`]) and
//! hands it back to the indexer with the need's token. Failures are retried with a
//! doubling backoff from 100 ms; "no responders" (nobody serves recovery for that
//! worker, e.g. an engine integration without a journal) gives up at once; after the
//! last attempt the recovery is abandoned, which makes the indexer apply its buffered
//! events past the hole. A need superseded by a newer one for the same rank is
//! dropped without a request.
//!
//! [`resync_registered`] is the start-up step: a dump request for every registered
//! rank, awaited until each is resolved, so the daemon only declares itself ready
//! once its index reflects every worker's state.
//!
//! Everything is logged with `worker_id`, `dp_rank`, `reason` and the subject, and
//! counted in `kv_router_recovery_runs_total{kind, outcome}` /
//! `kv_router_recovery_duration_seconds`. Cost per recovery: one request, one
//! subscription on a private inbox and the reply's bytes (about 45 bytes per block
//! of a dump).

use crate::durability::RecoveryConfig;
use crate::state::RouterState;
use futures::StreamExt;
use indexer::IndexerApi as _;
use indexer::{RecoveryNeed, RecoveryToken};
use kv_events::WorkerRank;
use kv_events::recovery::{
    ChunkAssembler, RecoveryBody, RecoveryChunk, RecoveryReply, RecoveryRequest,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

/// Why a recovery request got no usable reply.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Nobody is subscribed to the worker's recovery subject.
    #[error("no publisher serves recovery on {0}")]
    NoResponders(String),
    /// The reply (or its next chunk) did not arrive in time.
    #[error("timed out waiting for a recovery reply on {0}")]
    Timeout(String),
    /// A chunk did not decode or did not fit the chunks before it.
    #[error("malformed recovery reply on {subject}: {reason}")]
    Malformed {
        /// The recovery subject.
        subject: String,
        /// What was wrong, lowercase.
        reason: String,
    },
    /// The NATS client failed to subscribe or publish.
    #[error("nats error on {subject}: {reason}")]
    Nats {
        /// The recovery subject.
        subject: String,
        /// The client's error.
        reason: String,
    },
}

/// A reassembled reply and what it cost on the wire.
#[derive(Debug)]
pub struct Fetched {
    /// The reply.
    pub reply: RecoveryReply,
    /// Payload bytes received, over all chunks.
    pub bytes: usize,
    /// Chunks received.
    pub chunks: u32,
}

/// Sends `request` to `subject` and collects the chunked reply; `timeout` applies to
/// the first chunk and to each following one.
///
/// # Errors
/// [`FetchError`]; never panics on a malformed reply.
pub async fn fetch(
    nats: &async_nats::Client,
    subject: &str,
    request: &RecoveryRequest,
    timeout: Duration,
) -> Result<Fetched, FetchError> {
    let nats_error = |e: &dyn std::fmt::Display| FetchError::Nats {
        subject: subject.to_owned(),
        reason: e.to_string(),
    };
    let payload = kv_events::encode(request).map_err(|e| nats_error(&e))?;
    let inbox = nats.new_inbox();
    let mut replies = nats
        .subscribe(inbox.clone())
        .await
        .map_err(|e| nats_error(&e))?;
    nats.publish_with_reply(subject.to_owned(), inbox, payload.into())
        .await
        .map_err(|e| nats_error(&e))?;
    let mut assembler = ChunkAssembler::new();
    let mut fetched_bytes = 0;
    let mut chunks = 0;
    loop {
        let message = tokio::time::timeout(timeout, replies.next())
            .await
            .map_err(|_| FetchError::Timeout(subject.to_owned()))?
            .ok_or_else(|| FetchError::Timeout(subject.to_owned()))?;
        if message.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
            return Err(FetchError::NoResponders(subject.to_owned()));
        }
        fetched_bytes += message.payload.len();
        chunks += 1;
        let malformed = |reason: String| FetchError::Malformed {
            subject: subject.to_owned(),
            reason,
        };
        let chunk: RecoveryChunk =
            kv_events::decode(&message.payload).map_err(|e| malformed(e.to_string()))?;
        if let Some(reply) = assembler
            .push(chunk)
            .map_err(|e| malformed(e.to_string()))?
        {
            return Ok(Fetched {
                reply,
                bytes: fetched_bytes,
                chunks,
            });
        }
    }
}

/// Counts resolved recoveries so start-up can wait for the ones it caused.
#[derive(Debug, Default)]
pub struct RecoveryProgress {
    resolved: AtomicU64,
    changed: Notify,
}

impl RecoveryProgress {
    fn resolve(&self) {
        self.resolved.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_waiters();
    }

    /// Needs resolved so far (applied, abandoned or superseded).
    pub fn resolved(&self) -> u64 {
        self.resolved.load(Ordering::Acquire)
    }

    /// Waits until at least `target` needs have been resolved.
    pub async fn wait_for(&self, target: u64) {
        loop {
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            if self.resolved() >= target {
                return;
            }
            changed.await;
        }
    }
}

/// What a recovery task needs, shared by every in-flight request.
struct Service {
    state: Arc<RouterState>,
    nats: async_nats::Client,
    config: RecoveryConfig,
    progress: Arc<RecoveryProgress>,
    /// The newest token of each rank: older needs are superseded.
    latest: Mutex<HashMap<WorkerRank, RecoveryToken>>,
    stop: CancellationToken,
}

/// Takes the indexer's recovery needs and serves them on `tasks` until `stop`.
/// Returns the progress counter (which stays at 0 if the needs were already taken).
pub fn spawn(
    state: Arc<RouterState>,
    nats: async_nats::Client,
    config: RecoveryConfig,
    tasks: &TaskTracker,
    stop: CancellationToken,
) -> Arc<RecoveryProgress> {
    let progress = Arc::new(RecoveryProgress::default());
    let Some(needs) = state.indexer.take_recovery_needs() else {
        warn!("indexer recovery needs already taken; gap recovery is not served");
        return progress;
    };
    let service = Arc::new(Service {
        state,
        nats,
        config,
        progress: progress.clone(),
        latest: Mutex::new(HashMap::new()),
        stop,
    });
    tasks.spawn(serve(service, needs));
    progress
}

async fn serve(service: Arc<Service>, mut needs: mpsc::UnboundedReceiver<RecoveryNeed>) {
    let limit = Arc::new(Semaphore::new(service.config.concurrency));
    let in_flight = TaskTracker::new();
    loop {
        let need = tokio::select! {
            () = service.stop.cancelled() => break,
            need = needs.recv() => match need {
                Some(need) => need,
                None => break,
            },
        };
        service.latest().insert(need.rank, need.token);
        let permit = tokio::select! {
            () = service.stop.cancelled() => break,
            permit = limit.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break, // the semaphore is never closed
            },
        };
        let service = service.clone();
        in_flight.spawn(async move {
            service.handle(&need).await;
            service.progress.resolve();
            drop(permit);
        });
    }
    in_flight.close();
    in_flight.wait().await;
}

impl Service {
    fn latest(&self) -> std::sync::MutexGuard<'_, HashMap<WorkerRank, RecoveryToken>> {
        self.latest.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn superseded(&self, need: &RecoveryNeed) -> bool {
        self.latest().get(&need.rank) != Some(&need.token)
    }

    async fn handle(&self, need: &RecoveryNeed) {
        let subject = self.state.subjects.kv_recovery(need.rank.worker_id);
        let (worker_id, dp_rank, reason) =
            (need.rank.worker_id, need.rank.dp_rank, need.reason.label());
        let asked = if need.request.dump { "dump" } else { "range" };
        let started = Instant::now();
        let mut backoff = Duration::from_millis(100);
        for attempt in 1..=self.config.attempts {
            if self.superseded(need) {
                debug!(%worker_id, %dp_rank, reason, "recovery superseded by a newer one");
                return;
            }
            let result = tokio::select! {
                () = self.stop.cancelled() => return,
                r = fetch(&self.nats, &subject, &need.request, self.config.timeout) => r,
            };
            match result {
                Ok(fetched) => {
                    let kind = match &fetched.reply.body {
                        RecoveryBody::Events { .. } => "range",
                        RecoveryBody::Dump { .. } => "dump",
                        RecoveryBody::Error { .. } => "error",
                    };
                    let ok = kind != "error";
                    self.state
                        .counters
                        .metrics
                        .recovery
                        .observe(kind, ok, started.elapsed());
                    info!(
                        %worker_id, %dp_rank, reason, kind, subject,
                        bytes = fetched.bytes, chunks = fetched.chunks,
                        blocks = fetched.reply.body.block_count(),
                        next_event_id = fetched.reply.next_event_id,
                        ms = started.elapsed().as_millis() as u64,
                        "kv event recovery reply received"
                    );
                    if let Err(e) = self
                        .state
                        .indexer
                        .apply_recovered(need.rank, need.token, fetched.reply)
                        .await
                    {
                        warn!(%worker_id, %dp_rank, error = %e, "indexer refused a recovery reply");
                    }
                    return;
                }
                Err(e @ FetchError::NoResponders(_)) => {
                    warn!(%worker_id, %dp_rank, reason, subject, error = %e, "kv event recovery unavailable");
                    break;
                }
                Err(e) => {
                    warn!(%worker_id, %dp_rank, reason, subject, attempt, error = %e, "kv event recovery attempt failed");
                    if attempt < self.config.attempts {
                        tokio::select! {
                            () = self.stop.cancelled() => return,
                            () = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                    }
                }
            }
        }
        self.state
            .counters
            .metrics
            .recovery
            .observe(asked, false, started.elapsed());
        warn!(%worker_id, %dp_rank, reason, subject, "kv event recovery given up");
        if let Err(e) = self
            .state
            .indexer
            .abandon_recovery(need.rank, need.token)
            .await
        {
            warn!(%worker_id, %dp_rank, error = %e, "indexer stopped during recovery");
        }
    }
}

/// What the start-up resync did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResyncSummary {
    /// Ranks asked for their state.
    pub ranks: usize,
    /// Entries indexed once the replies were applied.
    pub entries: usize,
    /// How long it took.
    pub elapsed: Duration,
}

/// Asks every registered rank for a dump and waits until each request is resolved
/// (applied, or given up). Live events that arrive meanwhile are buffered by the
/// indexer and applied after each dump's position, so nothing published during
/// start-up is lost or applied twice.
///
/// # Errors
/// [`indexer::IndexerError::ShuttingDown`] if the indexer stopped.
pub async fn resync_registered(
    state: &RouterState,
    progress: &RecoveryProgress,
) -> Result<ResyncSummary, indexer::IndexerError> {
    let started = Instant::now();
    let ranks: Vec<WorkerRank> = state.scheduler().ranks().to_vec();
    for rank in &ranks {
        state.indexer.resync(*rank).await?;
    }
    // Stats are answered after every queued command: every resync need is emitted.
    state.indexer.stats().await?;
    let target = state.indexer.counters().snapshot().recovery_requests;
    progress.wait_for(target).await;
    let entries = state.indexer.stats().await?.entries;
    Ok(ResyncSummary {
        ranks: ranks.len(),
        entries,
        elapsed: started.elapsed(),
    })
}
