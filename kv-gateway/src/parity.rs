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
//! picture is not wrong), `unreported` (the answer had no cached count: no
//! judgement).
//!
//! **Persistent mismatch.** A worker is flagged when at least [`FLAG_AT`] of its last
//! [`WINDOW`] informative answers (either side saw a cached prefix; a cold prompt on
//! both sides says nothing) disagree, and cleared when at most [`CLEAR_AT`] of them
//! do. Flagging logs one warning with the likely cause ([`Cause`]) and sets
//! `kv_gateway_cache_parity_mismatch{worker, cause}`; clearing logs one info line and
//! removes it. Isolated disagreements (a KV event still in flight when the next
//! request with the prefix is routed, an eviction racing a route) are counted but
//! never flag a worker.
//!
//! **Cost.** Per answer: one mutex over a map of workers, ten judgements scanned, one
//! counter and one histogram observation through handles kept per worker (no label
//! hashing); the usage fields are read by the answer's existing peek.

use crate::metrics::GatewayMetrics;
use crate::workers::WorkerUrls;
use kv_events::WorkerId;
use prometheus::{Histogram, IntCounter};
use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use tracing::{debug, info, warn};

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
    /// booked on the same rank share with the prompt (not yet indexed): not a
    /// disagreement.
    InFlight = 4,
}

impl Outcome {
    /// Every outcome, in discriminant order.
    const ALL: [Outcome; 5] = [
        Outcome::Agree,
        Outcome::OverClaim,
        Outcome::UnderClaim,
        Outcome::Unreported,
        Outcome::InFlight,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Agree => "agree",
            Outcome::OverClaim => "over_claim",
            Outcome::UnderClaim => "under_claim",
            Outcome::Unreported => "unreported",
            Outcome::InFlight => "in_flight",
        }
    }
}

/// The likely cause of a worker's persistent mismatch, from the evidence of its
/// disagreeing answers, tried in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The engine counted the prompt's tokens differently from the gateway: its
    /// tokenizer or chat template differs.
    TokenizerMismatch,
    /// The engine reported cached tokens that are not a multiple of the worker's
    /// registered block size: it caches in blocks of another size.
    BlockSizeMismatch,
    /// The router predicted nothing cached while the engine reported hits: the
    /// worker's KV events do not reach the index, or never match the router's hashes
    /// (block size, hash seed or salt).
    NoMatchingEvents,
    /// Mostly over-claims with a prefix predicted.
    OverClaim,
    /// Mostly under-claims with a prefix predicted.
    UnderClaim,
}

impl Cause {
    const ALL: [Cause; 5] = [
        Cause::TokenizerMismatch,
        Cause::BlockSizeMismatch,
        Cause::NoMatchingEvents,
        Cause::OverClaim,
        Cause::UnderClaim,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::TokenizerMismatch => "tokenizer_mismatch",
            Cause::BlockSizeMismatch => "block_size_mismatch",
            Cause::NoMatchingEvents => "no_matching_events",
            Cause::OverClaim => "over_claim",
            Cause::UnderClaim => "under_claim",
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

/// What the last informative answers of one worker say.
#[derive(Debug, Default)]
struct Window {
    recent: VecDeque<Judged>,
    flagged: Option<Cause>,
}

/// A change of a worker's flag.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Change {
    Flagged(Cause, String),
    Cleared(Cause),
}

impl Window {
    /// Adds an answer; says whether the worker's flag changed.
    fn push(&mut self, judged: Judged, block_size: u32) -> Option<Change> {
        if judged.predicted == 0 && judged.raw_cached == 0 {
            return None;
        }
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(judged);
        let wrong = self.wrong().count();
        match self.flagged {
            None if wrong >= FLAG_AT => {
                let (cause, why) = self.likely_cause(block_size);
                self.flagged = Some(cause);
                Some(Change::Flagged(cause, why))
            }
            Some(cause) if wrong <= CLEAR_AT => {
                self.flagged = None;
                Some(Change::Cleared(cause))
            }
            _ => None,
        }
    }

    fn wrong(&self) -> impl Iterator<Item = &Judged> + Clone {
        (self.recent.iter()).filter(|j| !matches!(j.outcome, Outcome::Agree | Outcome::InFlight))
    }

    /// The likely cause of the disagreements in the window, and why, for the log.
    fn likely_cause(&self, block_size: u32) -> (Cause, String) {
        let block = u64::from(block_size.max(1));
        let wrong = self.wrong();
        let Some(last) = wrong.clone().last() else {
            return (Cause::UnderClaim, "no disagreement".into());
        };
        let seen = format!(
            "last: predicted {} cached tokens, the engine reported {} of a {}-token prompt",
            last.predicted, last.raw_cached, last.prompt_tokens
        );
        if let Some(j) = wrong.clone().find(|j| j.engine_prompt_tokens.is_some()) {
            let engine = j.engine_prompt_tokens.unwrap_or_default();
            return (
                Cause::TokenizerMismatch,
                format!(
                    "the engine counted {engine} prompt tokens where the gateway counted {}: its tokenizer or chat template differs from the gateway's (give the gateway the engines' model files, or forward token ids: --forward tokens, --chat-forward tokens, --tokenize-via render)",
                    j.prompt_tokens
                ),
            );
        }
        if let Some(j) = wrong.clone().find(|j| j.raw_cached % block != 0) {
            return (
                Cause::BlockSizeMismatch,
                format!(
                    "the engine reported {} cached tokens, not a multiple of the worker's registered block size of {block} tokens: the engine caches in blocks of another size than the registered one; {seen}",
                    j.raw_cached
                ),
            );
        }
        if wrong.clone().all(|j| j.predicted == 0) {
            let step = wrong.clone().fold(0, |g, j| gcd(g, j.raw_cached));
            let hint = if step != block && step > 0 {
                format!(" (every hit the engine reported is a multiple of {step} tokens)")
            } else {
                String::new()
            };
            return (
                Cause::NoMatchingEvents,
                format!(
                    "the router predicts no cached prefix while the engine reports hits: the worker publishes no KV events, or the router drops them or never matches their hashes (block size, hash seed or salt differ from the router's){hint}; {seen}"
                ),
            );
        }
        let over = wrong
            .clone()
            .filter(|j| j.outcome == Outcome::OverClaim)
            .count();
        if 2 * over >= wrong.count() {
            (
                Cause::OverClaim,
                format!(
                    "the router claims prefix blocks the engine does not have: a hybrid or sliding-window model indexed without its KV cache groups, a tokenizer that splits prompts differently from the engine's, or lost removal events; {seen}"
                ),
            )
        } else {
            (
                Cause::UnderClaim,
                format!(
                    "the engine has prefix blocks the router does not know: KV events late or lost (kv_router_indexer_event_order_total), or hits the engine counts from a CPU or offload tier; {seen}"
                ),
            )
        }
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// One worker's window and its metric handles.
struct WorkerParity {
    label: String,
    outcomes: [IntCounter; 5],
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
}

/// An engine answer still to be judged: the prediction and the monitor it goes to.
pub struct Pending {
    monitor: ParityMonitor,
    prediction: Prediction,
}

impl Pending {
    /// Judges the answer by what its engine reported.
    pub fn judge(self, reported: Reported) {
        self.monitor.judge(&self.prediction, reported);
    }
}

impl ParityMonitor {
    /// A monitor exporting through `metrics`; `workers` gives each worker's block size
    /// and says which workers are still registered.
    pub fn new(metrics: GatewayMetrics, workers: WorkerUrls) -> Self {
        Self {
            inner: Arc::new(Inner {
                metrics,
                workers,
                state: Mutex::new(HashMap::new()),
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
        if let Some(change) = self.record(prediction, prediction.judge(reported)) {
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
                Outcome::InFlight => {
                    "cache parity: hits on blocks booked in flight, not yet indexed"
                }
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

#[cfg(test)]
pub(crate) mod tests;
