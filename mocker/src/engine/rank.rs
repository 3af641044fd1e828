//! One live dp rank: an [`EngineCore`] behind a mutex, the reply inboxes of its
//! requests, its KV event sequence, and the real-time loop that steps it.
//!
//! The loop steps the core, sleeps the step's model duration divided by the time scale
//! (a timer against an accumulated deadline, so timer rounding does not drift), then
//! publishes the step's KV events and responses. When the core is idle the loop parks
//! on a [`Notify`] until a request arrives — no polling. All publication happens under
//! the rank's lock via the ordered [`Outbox`]; event ids come from the worker's
//! [`SharedJournal`], which keeps them gap-free and in order per (worker, dp_rank) and
//! remembers the events for recovery requests.
//!
//! Cost: one short lock per request, per step and per metrics sample; no allocation
//! beyond the step's outputs.

use super::config::RuntimeArgs;
use super::core::{EngineCore, StepOutput};
use super::journal::SharedJournal;
use super::outbox::Outbox;
use super::request::EngineRequest;
use crate::protocol::GenerateResponse;
use async_nats::Subject;
use kv_events::{KvCacheEventData, LoadMetrics, RequestId, WorkerRank};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::debug;

/// The error message sent to requests still in flight when the engines shut down.
pub(super) const SHUTTING_DOWN: &str = "engine shutting down";

/// Mutable state of one rank, guarded by [`Rank::lock`].
#[derive(Debug)]
pub(super) struct RankState {
    core: EngineCore,
    /// Reply inbox of every accepted request whose `finished` is not yet published.
    replies: HashMap<RequestId, Subject>,
    accepting: bool,
}

impl RankState {
    /// Requests accepted whose `finished` has not been published yet (waiting, running,
    /// or done in a step whose outputs are still being timed).
    pub fn in_flight(&self) -> u64 {
        (self.replies.len() as u64).max(self.core.active_requests())
    }
}

/// One dp rank of one worker. See the module docs.
#[derive(Debug)]
pub(super) struct Rank {
    id: WorkerRank,
    state: Mutex<RankState>,
    notify: Notify,
    outbox: Outbox,
    journal: SharedJournal,
    kv_subject: String,
    metrics_subject: String,
}

impl Rank {
    /// A rank serving `core`, numbering its KV events in the worker's `journal` and
    /// publishing on the given KV events and metrics subjects.
    pub fn new(
        id: WorkerRank,
        core: EngineCore,
        outbox: Outbox,
        journal: SharedJournal,
        kv_subject: String,
        metrics_subject: String,
    ) -> Self {
        Self {
            id,
            state: Mutex::new(RankState {
                core,
                replies: HashMap::new(),
                accepting: true,
            }),
            notify: Notify::new(),
            outbox,
            journal,
            kv_subject,
            metrics_subject,
        }
    }

    /// Locks the rank state. A poisoned lock (a panic elsewhere while holding it) is
    /// recovered: the state is plain data and stays consistent between statements.
    pub fn lock(&self) -> MutexGuard<'_, RankState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues `req`, answering on `reply`. A rejected request (or any request after
    /// shutdown began) gets an `error` response immediately.
    pub fn submit(&self, req: EngineRequest, reply: Subject) {
        let mut st = self.lock();
        if !st.accepting {
            self.send_error(reply, SHUTTING_DOWN.to_owned());
            return;
        }
        let id = req.request_id.clone();
        if st.replies.contains_key(&id) {
            self.send_error(reply, format!("request {id} is already active"));
            return;
        }
        match st.core.add_request(req) {
            Ok(()) => {
                st.replies.insert(id, reply);
                drop(st);
                self.notify.notify_one();
            }
            Err(reason) => {
                debug!(rank = %self.id, request_id = %id, %reason, "request rejected");
                self.send_error(reply, reason.to_string());
            }
        }
    }

    /// Drops the cache of the locked, idle rank and enqueues its `Cleared` event.
    /// Returns false (changing nothing) if the rank has requests in flight.
    pub fn clear_locked(&self, st: &mut RankState) -> bool {
        if st.in_flight() > 0 {
            return false;
        }
        match st.core.clear() {
            Ok(events) => {
                self.publish_events(st, events);
                true
            }
            Err(_) => false,
        }
    }

    /// Enqueues this rank's current load metrics.
    pub fn publish_metrics(&self) {
        let metrics: LoadMetrics = self.lock().core.load_metrics(self.id);
        self.outbox.send(self.metrics_subject.clone(), &metrics);
    }

    /// Steps the core in real time until `shutdown`, then fails the requests left.
    pub async fn run(&self, runtime: RuntimeArgs, shutdown: CancellationToken) {
        let mut next_start = Instant::now();
        loop {
            let output = {
                let mut st = self.lock();
                st.core.has_work().then(|| st.core.step())
            };
            let Some(output) = output else {
                tokio::select! {
                    () = self.notify.notified() => continue,
                    () = shutdown.cancelled() => break,
                }
            };
            let start = next_start.max(Instant::now());
            next_start = start + runtime.wall_duration(output.duration_ms);
            let cancelled = tokio::select! {
                () = tokio::time::sleep_until(next_start) => false,
                () = shutdown.cancelled() => true,
            };
            self.finish_step(output);
            if cancelled {
                break;
            }
        }
        self.fail_pending();
    }

    /// Publishes a step's KV events, first tokens and finished requests, in that order.
    fn finish_step(&self, out: StepOutput) {
        let mut st = self.lock();
        self.publish_events(&mut st, out.kv_events);
        for ft in out.first_tokens {
            if let Some(reply) = st.replies.get(&ft.request_id) {
                let resp = GenerateResponse::FirstToken {
                    cached_tokens: ft.cached_tokens,
                    prompt_tokens: ft.prompt_tokens,
                };
                self.outbox.send(reply.clone(), &resp);
            }
        }
        for f in out.finished {
            if let Some(reply) = st.replies.remove(&f.request_id) {
                let resp = GenerateResponse::Finished {
                    output_tokens: f.output_tokens,
                };
                self.outbox.send(reply, &resp);
            }
        }
    }

    /// Stops intake and answers every request still in flight with an error.
    fn fail_pending(&self) {
        let mut st = self.lock();
        st.accepting = false;
        for (_, reply) in st.replies.drain() {
            self.send_error(reply, SHUTTING_DOWN.to_owned());
        }
    }

    /// Records the events in the worker's journal (which numbers them) and enqueues
    /// them as one batch. Called with the rank's lock held, so batches go out in
    /// event id order.
    fn publish_events(&self, _st: &mut RankState, events: Vec<KvCacheEventData>) {
        if events.is_empty() {
            return;
        }
        let batch = self.journal.record(self.id.dp_rank, events);
        self.outbox.send(self.kv_subject.clone(), &batch);
    }

    fn send_error(&self, reply: Subject, message: String) {
        self.outbox
            .send(reply, &GenerateResponse::Error { message });
    }
}
