//! The cache-parity monitor: on every engine answer, the prefix overlap the router
//! predicted against the cached prompt tokens the engine reports, so a wrong cache
//! picture shows instead of silently costing prefill.
//!
//! **Why.** The router's overlap comes from KV events it indexed; the engine's
//! `usage.prompt_tokens_details.cached_tokens` (vLLM with
//! `--enable-prompt-tokens-details`, SGLang with `--enable-cache-report`, the mock
//! engine always) is what its prefix cache actually served. In a healthy cluster they
//! agree exactly; a wrong block size, a publisher whose events never arrive or never
//! match (hash seed or salt), or a tokenizer that differs from the engine's make the
//! router score 0 everywhere or claim blocks the engine does not have, and nothing
//! else says so.
//!
//! **What is compared.** The prediction is `overlap_blocks × block_size` (the
//! worker's registered block size) for the worker that prefilled the prompt: the
//! routed worker, or the prefill worker of a disaggregated request (its decode
//! worker loads the prompt over a transfer, so its count says nothing of the index).
//! An engine always computes the last prompt token (its logits give the first output
//! token), so vLLM never reports a block-aligned prompt's last block as cached; the
//! router caps its overlap the same way (`ScheduleRequest::reusable_blocks`: the full
//! blocks before the last token), so the prediction is compared as it comes, and a
//! router that claims more shows as an over-claim. The engine's count is capped there
//! too, so an engine that counts the block it recomputes is not judged. Outcomes: `agree` (equal), `over_claim` (predicted more),
//! `under_claim` (predicted less), `in_flight` (more than predicted, but no more than
//! the blocks requests booked on the same rank share with the prompt: the router
//! names them in its reply's `in_flight_blocks`; an engine that caches blocks as it
//! computes them served them before their KV events reached the index, so the
//! picture is not wrong; or more than that, but the router's index holds every
//! block the engine served once the answer is judged: their KV events arrived after
//! the decision, see module `race`), `evicted` (less than predicted, but the router says the
//! first block the engine did not serve was removed from the rank after the
//! decision: an eviction raced the route, see module `race`), `unreported` (the answer
//! had no cached count: no judgement).
//!
//! **Persistent mismatch.** A worker is flagged when at least [`FLAG_AT`] of its last
//! [`WINDOW`] informative answers (either side saw a cached prefix; a cold prompt on
//! both sides says nothing) disagree, and cleared when at most [`CLEAR_AT`] of them
//! do. Flagging logs one warning with the likely cause ([`Cause`]) and sets
//! `kv_gateway_cache_parity_mismatch{worker, cause}`; clearing logs one info line and
//! removes it. Isolated disagreements (a KV event still in flight when the next
//! request with the prefix is routed, an eviction racing a route) are counted but
//! never flag a worker; an over-claim the router shows to be such a race is counted
//! `evicted`, an under-claim the index confirms late `in_flight`, and neither is a
//! disagreement.
//!
//! **Cost.** Per answer: one mutex over a map of workers, ten judgements scanned, one
//! counter and one histogram observation through handles kept per worker (no label
//! hashing); the usage fields are read by the answer's existing peek. With a router
//! to ask, one reference to the prompt's token ids per answer (no copy), and per
//! over- or under-claim the hashes of the blocks asked
//! about and one NATS round trip off the answer's path (module `race`).

use crate::metrics::GatewayMetrics;
use crate::workers::WorkerUrls;
use kv_events::WorkerId;
use kv_events::routing::RouteDecision;
use prometheus::{Histogram, IntCounter};
use race::Race;
pub use race::{ASK_DEADLINE, RouterAsker};
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex};
use tracing::{debug, info, warn};
pub use window::Cause;
use window::{Change, Window};

/// Informative answers per worker a verdict looks back on.
pub const WINDOW: usize = 10;
/// Disagreements among the last [`WINDOW`] that flag a persistent mismatch.
pub const FLAG_AT: usize = 5;
/// Disagreements among the last [`WINDOW`] at or below which a flag is cleared.
pub const CLEAR_AT: usize = 1;

/// How one engine answer's cached tokens compare with the router's prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Equal (the engine's count capped at the full blocks before the last token).
    Agree = 0,
    /// The router predicted more than the engine had.
    OverClaim = 1,
    /// The router predicted less than the engine had.
    UnderClaim = 2,
    /// The engine reported no cached tokens count: no judgement.
    Unreported = 3,
    /// The engine had more than the router predicted, within the blocks requests
    /// booked on the same rank share with the prompt (not yet indexed), or more, but
    /// the router's index held every block the engine served when asked after the
    /// answer (their KV events arrived after the decision): not a disagreement.
    InFlight = 4,
    /// The router predicted more than the engine had, and says the first block the
    /// engine did not serve was removed from the rank after the decision (an
    /// eviction raced the route): not a disagreement.
    Evicted = 5,
}

impl Outcome {
    /// Every outcome, in discriminant order.
    const ALL: [Outcome; 6] = [
        Outcome::Agree,
        Outcome::OverClaim,
        Outcome::UnderClaim,
        Outcome::Unreported,
        Outcome::InFlight,
        Outcome::Evicted,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Agree => "agree",
            Outcome::OverClaim => "over_claim",
            Outcome::UnderClaim => "under_claim",
            Outcome::Unreported => "unreported",
            Outcome::InFlight => "in_flight",
            Outcome::Evicted => "evicted",
        }
    }
}

/// The router's prediction for the worker that prefilled one prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prediction {
    /// The worker the engine request went to.
    pub worker: WorkerId,
    /// The router's overlap on that worker, in blocks.
    pub overlap_blocks: u32,
    /// Blocks past the overlap that requests booked on that worker's rank share with
    /// the prompt (the reply's `in_flight_blocks`), in blocks.
    pub in_flight_blocks: u32,
    /// The worker's registered block size, in tokens (at least 1).
    pub block_size: u32,
    /// The prompt's length as the gateway tokenized it, in tokens.
    pub prompt_tokens: u64,
}

/// What an engine's `usage` said of the prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reported {
    /// `prompt_tokens_details.cached_tokens`, in tokens, when present.
    pub cached_tokens: Option<u64>,
    /// `prompt_tokens`, in tokens, when present.
    pub prompt_tokens: Option<u64>,
}

/// One judged answer, as its worker's window keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Judged {
    outcome: Outcome,
    /// Predicted tokens.
    predicted: u64,
    /// Reported cached tokens, capped.
    cached: u64,
    /// Reported cached tokens as the engine sent them.
    raw_cached: u64,
    prompt_tokens: u64,
    /// The engine's prompt count, when it differs from the gateway's.
    engine_prompt_tokens: Option<u64>,
}

impl Prediction {
    /// Judges `reported` against this prediction; `None` when nothing was reported.
    fn judge(&self, reported: Reported) -> Option<Judged> {
        let raw_cached = reported.cached_tokens?;
        let block = u64::from(self.block_size.max(1));
        // The most an engine serves from cache: the full blocks before the last token.
        let cap = self.prompt_tokens.saturating_sub(1) / block * block;
        let predicted = u64::from(self.overlap_blocks) * block;
        let cached = raw_cached.min(cap);
        let in_flight = predicted + u64::from(self.in_flight_blocks) * block;
        let outcome = match predicted.cmp(&cached) {
            std::cmp::Ordering::Equal => Outcome::Agree,
            std::cmp::Ordering::Greater => Outcome::OverClaim,
            std::cmp::Ordering::Less if cached <= in_flight => Outcome::InFlight,
            std::cmp::Ordering::Less => Outcome::UnderClaim,
        };
        Some(Judged {
            outcome,
            predicted,
            cached,
            raw_cached,
            prompt_tokens: self.prompt_tokens,
            engine_prompt_tokens: reported.prompt_tokens.filter(|&n| n != self.prompt_tokens),
        })
    }
}

/// One worker's window and its metric handles.
struct WorkerParity {
    label: String,
    outcomes: [IntCounter; 6],
    diff: Histogram,
    window: Window,
}

/// The monitor, shared by every request. Cheap to clone.
#[derive(Clone)]
pub struct ParityMonitor {
    inner: Arc<Inner>,
}

struct Inner {
    metrics: GatewayMetrics,
    workers: WorkerUrls,
    state: Mutex<HashMap<WorkerId, WorkerParity>>,
    /// Where mismatches are checked for a racing KV event; `None`: never.
    asker: Option<RouterAsker>,
}

/// An engine answer still to be judged: the prediction and the monitor it goes to.
pub struct Pending {
    monitor: ParityMonitor,
    prediction: Prediction,
    race: Option<Race>,
}

impl Pending {
    /// Lets a mismatch of this answer be checked against the router (module `race`):
    /// `decision` routed the prompt of `tokens`, which the check shares (one reference
    /// count, no copy). Keeps nothing when the monitor asks no router or the prompt
    /// has no full block before its last token.
    pub fn with_race(mut self, decision: &RouteDecision, tokens: &Arc<[u32]>) -> Self {
        if self.monitor.inner.asker.is_some() {
            self.race = Race::new(decision, tokens, self.prediction.block_size);
        }
        self
    }

    /// Judges the answer by what its engine reported. A mismatch with a race to
    /// check (module `race`) is settled by a spawned task once the router answered
    /// (or did not).
    pub fn judge(self, reported: Reported) {
        let Pending {
            monitor,
            prediction,
            race,
        } = self;
        let judged = prediction.judge(reported);
        let asker = monitor.inner.asker.clone();
        let runtime = tokio::runtime::Handle::try_current().ok();
        let check = (judged.as_ref().zip(race.as_ref()))
            .and_then(|(judged, race)| race.check(&prediction, judged));
        match (judged, check, asker, runtime) {
            (Some(mut judged), Some(check), Some(asker), Some(runtime)) => {
                runtime.spawn(async move {
                    let raced = asker.raced(&check).await;
                    if let Err(e) = &raced {
                        debug!(worker = %prediction.worker, outcome = judged.outcome.as_str(), error = %e, "cache parity: mismatch not checked for a racing KV event");
                    }
                    let mismatch = judged.outcome;
                    judged.outcome = race::settled(mismatch, raced);
                    if (mismatch, judged.outcome) == (Outcome::UnderClaim, Outcome::InFlight) {
                        debug!(worker = %prediction.worker, predicted_tokens = judged.predicted, cached_tokens = judged.raw_cached, "cache parity: under-claim confirmed late: the index now holds the prefix the engine served");
                    }
                    monitor.settle(&prediction, Some(judged));
                });
            }
            (judged, ..) => monitor.settle(&prediction, judged),
        }
    }
}

impl ParityMonitor {
    /// A monitor exporting through `metrics`; `workers` gives each worker's block size
    /// and says which workers are still registered.
    pub fn new(metrics: GatewayMetrics, workers: WorkerUrls) -> Self {
        Self::asking(metrics, workers, None)
    }

    /// Like [`ParityMonitor::new`], checking over- and under-claims with `asker`
    /// (module `race`).
    pub fn asking(
        metrics: GatewayMetrics,
        workers: WorkerUrls,
        asker: Option<RouterAsker>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                metrics,
                workers,
                state: Mutex::new(HashMap::new()),
                asker,
            }),
        }
    }

    /// The answer to judge for an engine request to `worker`, predicted to find
    /// `overlap_blocks` of a `prompt_tokens`-token prompt cached, and up to
    /// `in_flight_blocks` more shared by requests booked there; `None` when the worker
    /// is no longer registered (its block size is unknown).
    pub fn pending(
        &self,
        worker: WorkerId,
        overlap_blocks: u32,
        in_flight_blocks: u32,
        prompt_tokens: usize,
    ) -> Option<Pending> {
        let block_size = self.inner.workers.block_size_of(worker)?;
        Some(Pending {
            race: None,
            monitor: self.clone(),
            prediction: Prediction {
                worker,
                overlap_blocks,
                in_flight_blocks,
                block_size: block_size.max(1),
                prompt_tokens: prompt_tokens as u64,
            },
        })
    }

    /// Counts and judges one answer; logs a worker's flag when it changes.
    pub fn judge(&self, prediction: &Prediction, reported: Reported) {
        self.settle(prediction, prediction.judge(reported));
    }

    /// Counts `judged` and logs the worker's flag when it changes.
    fn settle(&self, prediction: &Prediction, judged: Option<Judged>) {
        if let Some(change) = self.record(prediction, judged) {
            self.report(change);
        }
    }

    /// Counts `judged` (`None`: unreported) for the predicted worker and adds it to its
    /// window; the worker's label and its flag's change, if any.
    fn record(&self, prediction: &Prediction, judged: Option<Judged>) -> Option<(String, Change)> {
        let mut state = self.lock();
        let worker = match state.entry(prediction.worker) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => {
                // A worker that left while its answer streamed is not brought back.
                self.inner.workers.block_size_of(prediction.worker)?;
                v.insert(self.worker_parity(prediction.worker))
            }
        };
        let outcome = judged.map_or(Outcome::Unreported, |j| j.outcome);
        worker.outcomes[outcome as usize].inc();
        let judged = judged?;
        if judged.outcome != Outcome::Agree {
            let what = match judged.outcome {
                Outcome::InFlight => "cache parity: hits on blocks not yet indexed at the decision",
                Outcome::Evicted => "cache parity: an eviction raced the route",
                _ => "cache parity disagreement",
            };
            debug!(worker = %worker.label, outcome = judged.outcome.as_str(), predicted_tokens = judged.predicted,
                cached_tokens = judged.raw_cached, prompt_tokens = judged.prompt_tokens, "{what}");
        }
        // Token counts of one prompt fit an f64 exactly (below 2^53).
        worker
            .diff
            .observe(judged.predicted as f64 - judged.cached as f64);
        let change = worker.window.push(judged, prediction.block_size)?;
        Some((worker.label.clone(), change))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<WorkerId, WorkerParity>> {
        // Every update leaves the map whole, so a poisoned one is still usable.
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn worker_parity(&self, worker: WorkerId) -> WorkerParity {
        let label = worker.0.to_string();
        let metrics = &self.inner.metrics;
        WorkerParity {
            outcomes: Outcome::ALL.map(|o| metrics.parity_outcome(&label, o.as_str())),
            diff: metrics.parity_diff(&label),
            label,
            window: Window::default(),
        }
    }

    fn report(&self, (worker, change): (String, Change)) {
        let metrics = &self.inner.metrics;
        match change {
            Change::Flagged(cause, why) => {
                metrics.parity_mismatch(&worker, cause.as_str(), true);
                warn!(worker = %worker, cause = cause.as_str(), "persistent cache parity mismatch ({FLAG_AT} or more of the last {WINDOW} answers with a cached prefix disagree): {why}");
            }
            Change::Cleared(cause) => {
                metrics.parity_mismatch(&worker, cause.as_str(), false);
                info!(worker = %worker, cause = cause.as_str(), "cache parity restored: the router's predictions match the engine's cached tokens again");
            }
        }
    }

    /// Forgets `worker` and drops its series (it left the directory).
    pub fn forget(&self, worker: WorkerId) {
        if self.lock().remove(&worker).is_some() {
            let outcomes = Outcome::ALL.map(Outcome::as_str);
            let causes = Cause::ALL.map(Cause::as_str);
            self.inner
                .metrics
                .forget_parity(&worker.0.to_string(), &outcomes, &causes);
        }
    }

    /// The cause `worker` is flagged with, if it is.
    pub fn flagged(&self, worker: WorkerId) -> Option<Cause> {
        self.lock().get(&worker).and_then(|w| w.window.flagged)
    }
}

mod race;
#[cfg(test)]
pub(crate) mod tests;
mod window;
