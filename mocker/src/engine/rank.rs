//! One live dp rank: an [`EngineCore`] behind a mutex, the reply inboxes of its
//! requests, its KV event sequence, and the real-time loop that steps it.
//!
//! The loop steps the core, waits the step's model duration divided by the time scale,
//! then publishes the step's KV events and responses. tokio's timer rounds deadlines
//! up to whole milliseconds, which at a large time scale is longer than a step: the
//! wait is therefore against model time (the end of the previous step while busy, see
//! [`step_start`]), so rounding never accumulates, and a step shorter than the timer's
//! resolution is not slept for at all. Model time and wall time stay within 1 ms of
//! each other, either way, while the CPU keeps up. When the core is idle the loop parks
//! on a [`Notify`] until a request arrives — no polling. All publication happens under
//! the rank's lock via the ordered [`Outbox`]; event ids come from the worker's
//! [`WorkerJournal`], which keeps them gap-free and in order per (worker, dp_rank) and
//! remembers the events for recovery requests.
//!
//! Cost: one short lock per request, per step and per metrics sample; no allocation
//! beyond the step's outputs.

use super::config::RuntimeArgs;
use super::journal::WorkerJournal;
use super::outbox::Outbox;
use super::progress::{Progress, Reply};
use super::vllm::{self, VllmPublisher};
use crate::protocol::{ClearReply, GenerateResponse};
use async_nats::Subject;
use engine_model::EngineRequest;
use engine_model::{EngineCore, GroupStore, StepOutput};
use kv_events::{
    ExternalBlockHash, KvCacheEventData, LoadMetrics, LocalBlockHash, RequestId, WorkerRank,
};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// tokio's timer resolution. A step that would end sooner than this is not slept
/// for, and waking up this much after a deadline is timer rounding, not the engine
/// falling behind.
const TIMER_RESOLUTION: Duration = Duration::from_millis(1);

/// When a step taken at `now` starts in model time: right after the previous step
/// (`clock`) while the rank is busy, so a timer that fires late by its rounding does
/// not push every later step back; `now` when the rank was idle or fell behind by
/// more than [`TIMER_RESOLUTION`] (then the engine really is late: the CPU was busy).
fn step_start(clock: Option<Instant>, now: Instant) -> Instant {
    let forgiven = now.checked_sub(TIMER_RESOLUTION).unwrap_or(now);
    clock.filter(|end| *end >= forgiven).unwrap_or(now)
}

/// The error message sent to requests still in flight when the engines shut down.
pub(super) const SHUTTING_DOWN: &str = "engine shutting down";

/// Why a vLLM-mode rank refuses a request without token ids: its `BlockStored`
/// events must carry each block's tokens.
pub(super) const NEEDS_TOKEN_IDS: &str =
    "this engine publishes vllm kv events, which need the prompt's token ids";

/// Mutable state of one rank, guarded by [`Rank::lock`].
#[derive(Debug)]
pub(super) struct EngineRankState {
    core: EngineCore,
    /// Reply destination of every accepted request whose `finished` is not yet sent.
    replies: HashMap<RequestId, Reply>,
    accepting: bool,
    /// vLLM mode: the events of a cache reset, which vLLM publishes only with its next
    /// engine step (so the router keeps the old picture until a request runs).
    held: Vec<KvCacheEventData>,
}

impl EngineRankState {
    /// Requests accepted whose `finished` has not been published yet (waiting, running,
    /// or done in a step whose outputs are still being timed).
    pub fn in_flight(&self) -> u64 {
        (self.replies.len() as u64).max(self.core.active_requests())
    }
}

/// A rank's load as the HTTP `/metrics` page reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct RankUsage {
    /// Requests in the running batch.
    pub running: u64,
    /// Requests in the waiting queue.
    pub waiting: u64,
    /// Blocks referenced or reserved by requests over capacity, a fraction in 0..=1.
    pub kv_cache_usage: f64,
}

/// Where a rank's KV events (and load metrics) go.
#[derive(Debug)]
pub(super) enum RankSink {
    /// The router's protocol: KV event batches numbered by the worker's journal and
    /// load metrics, on NATS through the outbox (which also carries NATS replies).
    Nats {
        /// The ordered NATS publication path.
        outbox: Outbox,
        /// The worker's KV event journal.
        journal: WorkerJournal,
        /// `{ns}.kv.events.{worker_id}`.
        kv_subject: String,
        /// `{ns}.load.metrics.{worker_id}`.
        metrics_subject: String,
    },
    /// vLLM's ZMQ wire; no load metrics (a relay scrapes the HTTP `/metrics`).
    Vllm(VllmPublisher),
}

/// Clears every rank of one worker atomically: all locks are taken (in rank order)
/// and the caches dropped, each with its `Cleared` KV event, only if no rank has a
/// request in flight; otherwise nothing changes and the reply says how many are.
/// Used by the NATS clear subject and by `POST /reset_prefix_cache`.
pub(super) fn clear_all(ranks: &[std::sync::Arc<Rank>]) -> ClearReply {
    let mut guards: Vec<_> = ranks.iter().map(|r| r.lock()).collect();
    let active_requests: u64 = guards.iter().map(|g| g.in_flight()).sum();
    if active_requests > 0 {
        return ClearReply::Busy { active_requests };
    }
    for (rank, guard) in ranks.iter().zip(guards.iter_mut()) {
        // Cannot refuse: the rank is idle and its lock is held.
        rank.clear_locked(guard);
    }
    ClearReply::Cleared
}

/// One dp rank of one worker. See the module docs.
#[derive(Debug)]
pub(super) struct Rank {
    id: WorkerRank,
    state: Mutex<EngineRankState>,
    notify: Notify,
    sink: RankSink,
}

impl Rank {
    /// A rank serving `core`, publishing its KV events through `sink`.
    pub fn new(id: WorkerRank, core: EngineCore, sink: RankSink) -> Self {
        Self {
            id,
            state: Mutex::new(EngineRankState {
                core,
                replies: HashMap::new(),
                accepting: true,
                held: Vec::new(),
            }),
            notify: Notify::new(),
            sink,
        }
    }

    /// The NATS outbox, in NATS mode. NATS replies only exist in that mode (vLLM-mode
    /// engines take no NATS requests), so a missing outbox drops nothing real.
    fn outbox(&self) -> Option<&Outbox> {
        match &self.sink {
            RankSink::Nats { outbox, .. } => Some(outbox),
            RankSink::Vllm(_) => None,
        }
    }

    /// Locks the rank state. A poisoned lock (a panic elsewhere while holding it) is
    /// recovered: the state is plain data and stays consistent between statements.
    pub fn lock(&self) -> MutexGuard<'_, EngineRankState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues `req`, answering on `reply`. A rejected request (or any request after
    /// shutdown began) gets an `error` response immediately.
    pub fn submit(&self, req: EngineRequest, reply: Subject) {
        if let Err(message) = self.accept(req, false, |_| Reply::Nats(reply.clone())) {
            self.send_error(reply, message);
        }
    }

    /// Queues `req` for the HTTP front end and returns the channel its [`Progress`]
    /// arrives on. The caller must [`Self::abort`] the request if it stops reading
    /// before `finished` (a client disconnect), or its KV space stays held.
    ///
    /// # Errors
    /// The lowercase reason when the request is rejected (malformed, never fits the
    /// cache, duplicate id, engine shutting down).
    pub fn submit_stream(&self, req: EngineRequest) -> Result<watch::Receiver<Progress>, String> {
        self.submit_stream_as(req, false)
    }

    /// [`Self::submit_stream`] for a request whose prompt KV was pulled over a KV
    /// transfer (a disaggregated decode, see [`EngineCore::add_transferred_request`]):
    /// the caller has charged the transfer time.
    ///
    /// # Errors
    /// As [`Self::submit_stream`].
    pub fn submit_transferred(
        &self,
        req: EngineRequest,
    ) -> Result<watch::Receiver<Progress>, String> {
        self.submit_stream_as(req, true)
    }

    /// Whole prompt blocks a KV transfer of this prompt would pull to this rank now
    /// (see [`EngineCore::transfer_blocks`]).
    pub fn transfer_blocks(&self, block_hashes: &[LocalBlockHash], prompt_tokens: u64) -> u64 {
        self.lock()
            .core
            .transfer_blocks(block_hashes, prompt_tokens)
    }

    fn submit_stream_as(
        &self,
        req: EngineRequest,
        transferred: bool,
    ) -> Result<watch::Receiver<Progress>, String> {
        let (tx, rx) = watch::channel(Progress::default());
        self.accept(req, transferred, move |_| Reply::Stream(tx))?;
        Ok(rx)
    }

    fn accept(
        &self,
        req: EngineRequest,
        transferred: bool,
        reply: impl FnOnce(&RequestId) -> Reply,
    ) -> Result<(), String> {
        let mut st = self.lock();
        if !st.accepting {
            return Err(SHUTTING_DOWN.to_owned());
        }
        let id = req.request_id.clone();
        if matches!(self.sink, RankSink::Vllm(_)) && req.token_ids.is_none() {
            return Err(NEEDS_TOKEN_IDS.to_owned());
        }
        if st.replies.contains_key(&id) {
            return Err(format!("request {id} is already active"));
        }
        let added = if transferred {
            st.core.add_transferred_request(req)
        } else {
            st.core.add_request(req)
        };
        match added {
            Ok(()) => {
                let reply = reply(&id);
                st.replies.insert(id, reply);
                drop(st);
                self.notify.notify_one();
                Ok(())
            }
            Err(reason) => {
                debug!(rank = %self.id, request_id = %id, %reason, "request rejected");
                Err(reason.to_string())
            }
        }
    }

    /// Stops a request wherever it is and frees its KV space (see
    /// [`EngineCore::abort`]); nothing more is sent for it. A no-op for a request that
    /// already finished.
    pub fn abort(&self, request_id: &RequestId) {
        let mut st = self.lock();
        if st.replies.remove(request_id).is_some() {
            st.core.abort(request_id);
            debug!(rank = %self.id, %request_id, "request aborted");
        }
    }

    /// Requests running and waiting, and the KV cache usage as vLLM reports it
    /// (`1 - free / total`, where unreferenced cached blocks count as free), a
    /// fraction in 0..=1.
    pub fn usage(&self) -> RankUsage {
        let st = self.lock();
        let cache = st.core.cache();
        let busy = cache.used_blocks() - cache.evictable_blocks();
        RankUsage {
            running: st.core.running_requests() as u64,
            waiting: st.core.waiting_requests() as u64,
            kv_cache_usage: busy as f64 / cache.capacity().max(1) as f64,
        }
    }

    /// Drops the cache of the locked, idle rank and enqueues its `Cleared` event: at
    /// once in NATS mode; in vLLM mode with the next engine step, as vLLM publishes
    /// `AllBlocksCleared`. Returns false (changing nothing) if the rank has requests
    /// in flight.
    pub fn clear_locked(&self, st: &mut EngineRankState) -> bool {
        if st.in_flight() > 0 {
            return false;
        }
        match st.core.clear() {
            Ok(events) => {
                if matches!(self.sink, RankSink::Vllm(_)) {
                    st.held.extend(events);
                } else {
                    self.publish_events(st, events, &[], &HashMap::new());
                }
                true
            }
            Err(_) => false,
        }
    }

    /// Enqueues this rank's current load metrics (NATS mode; a no-op in vLLM mode,
    /// where the relay scrapes `/metrics`).
    pub fn publish_metrics(&self) {
        if let RankSink::Nats {
            outbox,
            metrics_subject,
            ..
        } = &self.sink
        {
            let metrics: LoadMetrics = self.lock().core.load_metrics(self.id);
            outbox.send(metrics_subject.clone(), &metrics);
        }
    }

    /// Steps the core in real time until `shutdown`, then fails the requests left.
    pub async fn run(&self, runtime: RuntimeArgs, shutdown: CancellationToken) {
        // Where model time stands while the rank is busy: the end of the last step.
        // `None` when idle, so a step after a pause starts at the arrival.
        let mut clock: Option<Instant> = None;
        loop {
            let output = {
                let mut st = self.lock();
                st.core.has_work().then(|| st.core.step())
            };
            let Some(output) = output else {
                clock = None;
                tokio::select! {
                    () = self.notify.notified() => continue,
                    () = shutdown.cancelled() => break,
                }
            };
            let now = Instant::now();
            let end = step_start(clock, now) + runtime.wall_duration(output.duration_ms);
            clock = Some(end);
            let cancelled = if end > now + TIMER_RESOLUTION {
                tokio::select! {
                    () = tokio::time::sleep_until(end) => false,
                    () = shutdown.cancelled() => true,
                }
            } else {
                // Shorter than the timer can measure: publish now (at most one
                // resolution early; the clock keeps the debt, so the next sleep
                // repays it) but let other tasks run first.
                tokio::task::yield_now().await;
                shutdown.is_cancelled()
            };
            self.finish_step(output);
            if cancelled {
                break;
            }
        }
        self.fail_pending();
    }

    /// Publishes a step's KV events, first tokens, streamed tokens and finished
    /// requests, in that order.
    fn finish_step(&self, out: StepOutput) {
        let mut st = self.lock();
        let mut events = std::mem::take(&mut st.held);
        events.extend(out.kv_events);
        self.publish_events(&mut st, events, &out.group_stores, &out.block_tokens);
        for ft in out.first_tokens {
            match st.replies.get(&ft.request_id) {
                Some(Reply::Nats(reply)) => {
                    let resp = GenerateResponse::FirstToken {
                        cached_tokens: ft.cached_tokens,
                        prompt_tokens: ft.prompt_tokens,
                    };
                    self.send_reply(reply.clone(), &resp);
                }
                Some(Reply::Stream(tx)) => {
                    tx.send_modify(|p| {
                        p.cached_tokens = Some(ft.cached_tokens);
                        p.output_tokens = p.output_tokens.max(1);
                    });
                }
                None => {}
            }
        }
        let st = &mut *st;
        // Token-by-token progress only matters to HTTP streams; NATS-only ranks (the
        // replay, the lab) skip the O(batch) pass.
        if st.replies.values().any(|r| matches!(r, Reply::Stream(_))) {
            for (id, tokens) in st.core.output_progress() {
                if let Some(Reply::Stream(tx)) = st.replies.get(id) {
                    tx.send_if_modified(|p| {
                        let newer = tokens > p.output_tokens;
                        p.output_tokens = p.output_tokens.max(tokens);
                        newer
                    });
                }
            }
        }
        for f in out.finished {
            match st.replies.remove(&f.request_id) {
                Some(Reply::Nats(reply)) => {
                    let resp = GenerateResponse::Finished {
                        output_tokens: f.output_tokens,
                    };
                    self.send_reply(reply, &resp);
                }
                Some(Reply::Stream(tx)) => tx.send_modify(|p| {
                    p.output_tokens = f.output_tokens;
                    p.finished = true;
                }),
                None => {}
            }
        }
    }

    /// Stops intake and answers every request still in flight with an error.
    fn fail_pending(&self) {
        let mut st = self.lock();
        st.accepting = false;
        for (_, reply) in st.replies.drain() {
            match reply {
                Reply::Nats(reply) => self.send_error(reply, SHUTTING_DOWN.to_owned()),
                Reply::Stream(tx) => tx.send_modify(|p| p.error = Some(SHUTTING_DOWN.to_owned())),
            }
        }
    }

    /// Publishes the events as one batch: in NATS mode recorded in the worker's
    /// journal (which numbers them) and enqueued on the outbox; in vLLM mode encoded
    /// as vLLM's `KVEventBatch` (with each stored block's tokens from `block_tokens`;
    /// a hybrid rank's stores from `group_stores`, one per group, as vLLM 0.32
    /// publishes them) and handed to the rank's ZMQ publisher, which numbers it.
    /// Called with the rank's lock held, so batches go out in order.
    fn publish_events(
        &self,
        st: &mut EngineRankState,
        events: Vec<KvCacheEventData>,
        group_stores: &[GroupStore],
        block_tokens: &HashMap<ExternalBlockHash, Vec<u32>>,
    ) {
        if events.is_empty() {
            return;
        }
        match &self.sink {
            RankSink::Nats {
                outbox,
                journal,
                kv_subject,
                ..
            } => {
                let batch = journal.record(self.id.dp_rank, events);
                outbox.send(kv_subject.clone(), &batch);
            }
            RankSink::Vllm(publisher) => {
                let block_size = st.core.config().block_size;
                let hybrid = st.core.hybrid();
                let converted = if hybrid.is_hybrid() {
                    let window = hybrid.sliding_window;
                    vllm::to_vllm_hybrid(&events, group_stores, block_tokens, block_size, window)
                } else {
                    vllm::to_vllm(&events, block_tokens, block_size)
                };
                match converted {
                    Ok(events) => {
                        let ts = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0.0, |d| d.as_secs_f64());
                        publisher.send(vllm::encode_batch(ts, &events, self.id.dp_rank));
                    }
                    // Requests without token ids are refused at intake in this mode.
                    Err(err) => warn!(rank = %self.id, %err, "kv events not published"),
                }
            }
        }
    }

    fn send_reply(&self, reply: Subject, response: &GenerateResponse) {
        if let Some(outbox) = self.outbox() {
            outbox.send(reply, response);
        }
    }

    fn send_error(&self, reply: Subject, message: String) {
        self.send_reply(reply, &GenerateResponse::Error { message });
    }
}

#[cfg(test)]
mod tests;
