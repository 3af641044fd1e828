//! Gap recovery over NATS: the daemon side of `{ns}.kv.recovery.{worker_id}`.
//!
//! The indexer emits a [`RecoveryNeed`] when a worker rank's events have a gap, a
//! `Stored` names an unknown parent, a recovery buffer overflows, or the daemon asks
//! for a resync. [`spawn`] starts a task that sends each need's
//! [`kv_events::recovery::RecoveryRequest`] to the publisher, collects the chunked
//! reply (`fetch.rs`: at most [`RecoveryConfig::reply_limits`] chunks and bytes,
//! checked before each chunk is decoded) and hands it back to the indexer with the
//! need's token. Failed attempts are retried after an exponential, jittered backoff
//! (`backon`); "no responders" (nobody serves recovery for that worker, e.g. an
//! engine integration without a journal) and an oversized reply give up at once;
//! after the last attempt the recovery is abandoned, which makes the indexer apply
//! its buffered events past the hole.
//!
//! Why a pacing layer (`ranks.rs`, [`RankBook`]): an applied reply can leave the hole
//! open (a batch numbered far ahead of what its publisher has), and the indexer then
//! asks again at once. Unpaced, that loop sent thousands of requests per second to
//! one engine. Now each (worker, dp_rank) has at most one recovery in flight, waits a
//! growing delay after every recovery that did not close its hole, and after a
//! budget of such failures is *degraded*: its needs are given up without a request
//! until a cool-down ends or its publisher restarts. Degraded ranks are counted in
//! `kv_router_recovery_degraded_ranks` and shown in `/debug/workers` (from
//! `crate::recovery_status::RecoveryStatus`).
//!
//! [`resync_registered`] is the start-up step: a dump request for every registered
//! rank, awaited until each is resolved, so the daemon only declares itself ready
//! once its index reflects every worker's state.
//!
//! Everything is logged with `worker_id`, `dp_rank`, `reason` and the subject (a
//! rank's failing streak: the first failure at `warn`, the others at `debug`, then
//! one summary when it is degraded), and counted in
//! `kv_router_recovery_runs_total{kind, outcome}` /
//! `kv_router_recovery_duration_seconds`. Cost per recovery: one request, one
//! subscription on a private inbox and the reply's bytes (about 45 bytes per block
//! of a dump), plus one indexer barrier (`stats`, O(ranks) per shard) after the reply
//! is applied, which tells whether it closed the hole.

mod fetch;
mod ranks;

pub(crate) use crate::durability::RecoveryConfig;
pub(crate) use fetch::{FetchError, fetch};
pub(crate) use ranks::{Pacing, RankBook, Release, RunOutcome, Start};

use crate::state::RouterState;
use backon::Retryable as _;
use indexer::IndexerApi as _;
use indexer::RecoveryNeed;
use kv_events::WorkerRank;
use kv_events::recovery::RecoveryBody;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

/// Counts resolved recoveries so start-up can wait for the ones it caused.
#[derive(Debug, Default)]
pub(crate) struct RecoveryProgress {
    resolved: AtomicU64,
    changed: Notify,
}

impl RecoveryProgress {
    fn resolve(&self) {
        self.resolved.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_waiters();
    }

    /// Needs resolved so far (applied, abandoned or superseded).
    pub(crate) fn resolved(&self) -> u64 {
        self.resolved.load(Ordering::Acquire)
    }

    /// Waits until at least `target` needs have been resolved.
    pub(crate) async fn wait_for(&self, target: u64) {
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

/// What a recovery run needs, shared by every run.
struct Service {
    state: Arc<RouterState>,
    nats: async_nats::Client,
    config: RecoveryConfig,
    progress: Arc<RecoveryProgress>,
    stop: CancellationToken,
}

/// Takes the indexer's recovery needs and serves them on `tasks` until `stop`.
/// Returns the progress counter (which stays at 0 if the needs were already taken).
pub(crate) fn spawn(
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
        stop,
    });
    tasks.spawn(serve(service, needs));
    progress
}

/// The pacing loop: needs in, runs out (at most `concurrency` at once, one per
/// rank), run outcomes back in. A run reports its outcome only after the indexer
/// has emitted every need its reply caused, and the loop takes those needs before
/// the outcome, so [`RankBook::on_done`] knows whether the hole was closed.
async fn serve(service: Arc<Service>, mut needs: mpsc::UnboundedReceiver<RecoveryNeed>) {
    let mut book = RankBook::new(service.config.pacing(), service.metrics().clone());
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(WorkerRank, RunOutcome)>();
    let runs = TaskTracker::new();
    let mut running = 0usize;
    loop {
        let wakeup = book.next_wakeup();
        tokio::select! {
            biased;
            () = service.stop.cancelled() => break,
            Some((rank, outcome)) = done_rx.recv() => {
                running = running.saturating_sub(1);
                while let Ok(need) = needs.try_recv() {
                    let released = book.on_need(need, tokio::time::Instant::now());
                    service.release(released).await;
                }
                let released = book.on_done(rank, &outcome, tokio::time::Instant::now());
                service.release(released).await;
            }
            need = needs.recv() => match need {
                Some(need) => {
                    let released = book.on_need(need, tokio::time::Instant::now());
                    service.release(released).await;
                }
                None => break,
            },
            () = tokio::time::sleep_until(wakeup.unwrap_or_else(tokio::time::Instant::now)),
                if wakeup.is_some() => book.expire(tokio::time::Instant::now()),
        }
        let slots = service.config.concurrency.saturating_sub(running);
        for start in book.start_ready(tokio::time::Instant::now(), slots) {
            running += 1;
            let quiet = book.failing(start.need.rank);
            let (service, done) = (service.clone(), done_tx.clone());
            runs.spawn(async move {
                let rank = start.need.rank;
                let outcome = service.run(&start, quiet).await;
                service.progress.resolve();
                let _ = done.send((rank, outcome)); // the loop may have stopped
            });
        }
        service.state.recovery.publish(book.statuses());
    }
    runs.close();
    runs.wait().await;
}

impl Service {
    fn metrics(&self) -> &crate::metrics::RecoveryMetrics {
        &self.state.counters.metrics.recovery
    }

    /// Resolves a need the book let go: superseded ones need nothing more; a
    /// degraded rank's is given up in the indexer without a request.
    async fn release(&self, released: Option<Release>) {
        match released {
            None => return,
            Some(Release::Superseded(_)) => {}
            Some(Release::GiveUp(need)) => {
                if let Err(e) = self
                    .state
                    .indexer
                    .abandon_recovery(need.rank, need.token)
                    .await
                {
                    debug!(worker_id = %need.rank.worker_id, error = %e, "indexer stopped during recovery");
                }
            }
        }
        self.progress.resolve();
    }

    /// Serves one need: fetches the reply (retrying with backoff), hands it to the
    /// indexer and waits until the indexer has emitted the needs it caused; or gives
    /// the recovery up. `quiet`: the rank is in a failing streak, log at debug.
    async fn run(&self, start: &Start, quiet: bool) -> RunOutcome {
        let need = &start.need;
        let subject = self.state.subjects.kv_recovery(need.rank.worker_id);
        let (worker_id, dp_rank, reason) =
            (need.rank.worker_id, need.rank.dp_rank, need.reason.label());
        let asked = if need.request.dump { "dump" } else { "range" };
        let started = Instant::now();
        let config = &self.config;
        let attempt = || {
            fetch(
                &self.nats,
                &subject,
                &need.request,
                config.timeout,
                config.reply_limits,
            )
        };
        let fetched = attempt
            .retry(config.attempt_backoff())
            .sleep(tokio::time::sleep)
            .when(|e: &FetchError| e.is_retryable() && !start.superseded.is_cancelled())
            .notify(|e: &FetchError, delay: Duration| {
                debug!(%worker_id, %dp_rank, reason, subject, error = %e, delay_ms = delay.as_millis() as u64, "kv event recovery attempt failed; retrying");
            });
        let result = tokio::select! {
            () = self.stop.cancelled() => return RunOutcome::Stopped,
            () = start.superseded.cancelled() => return RunOutcome::Superseded,
            r = fetched => r,
        };
        match result {
            Ok(fetched) => {
                let kind = match &fetched.reply.body {
                    RecoveryBody::Events { .. } => "range",
                    RecoveryBody::Dump { .. } => "dump",
                    RecoveryBody::Error { .. } => "error",
                };
                let usable = kind != "error";
                self.metrics().observe(kind, usable, started.elapsed());
                let fields = (
                    fetched.bytes,
                    fetched.chunks,
                    fetched.reply.body.block_count(),
                );
                let next_event_id = fetched.reply.next_event_id;
                let applied = self
                    .state
                    .indexer
                    .apply_recovered(need.rank, need.token, fetched.reply)
                    .await;
                // Answered after the reply: every need it caused is emitted by now.
                let barrier = self.state.indexer.stats().await;
                if let Err(e) = applied.and(barrier.map(drop)) {
                    debug!(%worker_id, %dp_rank, error = %e, "indexer stopped during recovery");
                    return RunOutcome::Stopped;
                }
                let (bytes, chunks, blocks) = fields;
                let ms = started.elapsed().as_millis() as u64;
                if quiet {
                    debug!(%worker_id, %dp_rank, reason, kind, subject, bytes, chunks, blocks, next_event_id, ms, "kv event recovery reply applied");
                } else {
                    info!(%worker_id, %dp_rank, reason, kind, subject, bytes, chunks, blocks, next_event_id, ms, "kv event recovery reply applied");
                }
                RunOutcome::Applied { usable }
            }
            Err(e) => {
                if let FetchError::Refused { error, .. } = &e {
                    self.metrics().refuse(error.reason());
                }
                self.metrics().observe(asked, false, started.elapsed());
                if quiet {
                    debug!(%worker_id, %dp_rank, reason, subject, error = %e, "kv event recovery given up");
                } else {
                    warn!(%worker_id, %dp_rank, reason, subject, error = %e, "kv event recovery given up");
                }
                if let Err(stopped) = self
                    .state
                    .indexer
                    .abandon_recovery(need.rank, need.token)
                    .await
                {
                    debug!(%worker_id, %dp_rank, error = %stopped, "indexer stopped during recovery");
                    return RunOutcome::Stopped;
                }
                RunOutcome::GaveUp(e.to_string())
            }
        }
    }
}

/// What the start-up resync did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResyncSummary {
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
pub(crate) async fn resync_registered(
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
