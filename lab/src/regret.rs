//! Per-decision regret: how much TTFT each routing decision cost against the best
//! rank in hindsight, so a policy change shows where it loses.
//!
//! **Definition.** At a sampled decision (request `i` arriving at `t`, aggregated
//! fleet), for every rank `r` the simulator takes a copy of `r`'s engine core as it is
//! at `t` (queue, running batch, KV cache), adds request `i` to it and steps the copy
//! alone until `i`'s first token. `i`'s counterfactual TTFT on `r` is the time from
//! `t` to that step's end: the rest of `r`'s step in flight (a new step starts at its
//! end, as in the simulator), then each copied step's duration. Requests arriving
//! after `t` are left out on every rank alike, and so is the event lag (the engine
//! sees its own cache exactly). The decision's **regret** is the counterfactual TTFT
//! on the chosen rank minus the smallest counterfactual TTFT over all ranks: ≥ 0, and
//! 0 when the chosen rank was the best one (always with one worker). Comparing
//! counterfactuals on both sides keeps the figure about the decision, not about the
//! later traffic the chosen rank happened to get.
//!
//! **Cost.** Per sampled decision, one core copy per rank (O(cached blocks +
//! requests) each) plus the steps until the request's first token there (its queue
//! ahead of it and its own prefill chunks). `--regret-every N` samples every `N`-th
//! request (by trace order) to bound it; off by default.
//!
//! **Where it concentrates.** Each sample keeps the prompt length, the router's
//! predicted overlap on the chosen rank (as a share of the prompt) and the fleet's
//! load (requests waiting or running per rank at `t`); [`RegretStats`] groups the
//! samples by each into fixed buckets.

use crate::config::ns_to_ms;
use engine_model::{EngineCore, EngineRequest};
use serde::{Deserialize, Serialize};

/// Steps a counterfactual copy may take before it is abandoned (no input reaches it:
/// the model gives every admitted request its first token well before).
const MAX_COUNTERFACTUAL_STEPS: usize = 1_000_000;

/// One sampled decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RegretSample {
    /// Prompt length, in tokens.
    pub prompt_tokens: u64,
    /// The router's predicted overlap on the chosen rank over the prompt, in [0, 1].
    pub overlap_share: f64,
    /// Requests waiting or running per rank over the fleet at the decision.
    pub load_per_rank: f64,
    /// Counterfactual TTFT on the chosen rank minus the best rank's, in ns.
    pub regret_ns: u64,
}

/// The counterfactual TTFT of `request` on a rank whose core is `core` at `now_ns`,
/// its current step (if any) ending at `step_end_ns`, in ns; `None` if the core
/// refuses the request or gives no first token within the step bound.
pub(crate) fn counterfactual_ttft_ns(
    core: &EngineCore,
    step_end_ns: Option<u64>,
    now_ns: u64,
    request: EngineRequest,
) -> Option<u64> {
    let id = request.request_id.clone();
    let mut copy = core.clone();
    copy.add_request(request).ok()?;
    let mut at = step_end_ns.map_or(now_ns, |end| end.max(now_ns));
    for _ in 0..MAX_COUNTERFACTUAL_STEPS {
        if !copy.has_work() {
            return None;
        }
        let out = copy.step();
        // As the simulator does: a step takes at least 1 ns.
        at += crate::config::ms_to_ns(out.duration_ms).max(1);
        if out.first_tokens.iter().any(|f| f.request_id == id) {
            return Some(at - now_ns);
        }
    }
    None
}

/// A dimension samples are grouped by, with its bucket bounds.
#[derive(Debug, Clone, Copy)]
struct Dimension {
    name: &'static str,
    /// Upper bounds (exclusive) of every bucket but the last, ascending.
    bounds: &'static [f64],
    labels: &'static [&'static str],
    value: fn(&RegretSample) -> f64,
}

const DIMENSIONS: [Dimension; 3] = [
    Dimension {
        name: "prompt_tokens",
        bounds: &[1_024.0, 4_096.0, 16_384.0],
        labels: &["<1k", "1k-4k", "4k-16k", ">=16k"],
        value: |s| s.prompt_tokens as f64,
    },
    Dimension {
        name: "predicted_overlap",
        bounds: &[f64::MIN_POSITIVE, 0.5, 0.9],
        labels: &["0", "0-50%", "50-90%", ">=90%"],
        value: |s| s.overlap_share,
    },
    Dimension {
        name: "load_per_rank",
        bounds: &[1.0, 4.0, 16.0],
        labels: &["<1", "1-4", "4-16", ">=16"],
        value: |s| s.load_per_rank,
    },
];

/// Regret of the sampled decisions of one group (all, or one bucket), in model ms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegretFigures {
    /// Sampled decisions in the group.
    pub decisions: u64,
    /// Mean regret, in ms.
    pub mean_ms: f64,
    /// 99th percentile (nearest rank) of the regret, in ms.
    pub p99_ms: f64,
    /// Share of the decisions that picked a best rank (regret 0), in [0, 1].
    pub best_share: f64,
    /// This group's share of the run's total regret, in [0, 1] (1 for the whole run).
    pub regret_share: f64,
}

/// One bucket of one dimension.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegretBucket {
    /// `prompt_tokens`, `predicted_overlap` or `load_per_rank`.
    pub dimension: String,
    /// The bucket's range, e.g. `1k-4k`.
    pub bucket: String,
    /// Its figures.
    #[serde(flatten)]
    pub figures: RegretFigures,
}

/// A run's regret: over every sampled decision and per bucket (empty buckets left
/// out). JSON: `{ "sample_every", "decisions", "mean_ms", "p99_ms", "best_share",
/// "regret_share", "buckets": [{ "dimension", "bucket", …same figures }] }`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegretStats {
    /// Every how many requests a decision was sampled.
    pub sample_every: u64,
    /// The figures over all sampled decisions.
    #[serde(flatten)]
    pub all: RegretFigures,
    /// Per dimension, per bucket.
    pub buckets: Vec<RegretBucket>,
}

impl RegretStats {
    /// The statistics of `samples` taken every `sample_every` requests; `None` when
    /// there are none.
    pub(crate) fn of(samples: &[RegretSample], sample_every: u64) -> Option<Self> {
        let total: u64 = samples.iter().map(|s| s.regret_ns).sum();
        let all = figures(samples.iter(), total)?;
        let buckets = DIMENSIONS
            .iter()
            .flat_map(|d| {
                d.labels.iter().enumerate().filter_map(move |(i, label)| {
                    let in_bucket = samples.iter().filter(move |s| bucket_of(d, s) == i);
                    figures(in_bucket, total).map(|figures| RegretBucket {
                        dimension: d.name.to_owned(),
                        bucket: (*label).to_owned(),
                        figures,
                    })
                })
            })
            .collect();
        Some(Self {
            sample_every,
            all,
            buckets,
        })
    }
}

fn bucket_of(d: &Dimension, s: &RegretSample) -> usize {
    let v = (d.value)(s);
    d.bounds.iter().take_while(|&&b| v >= b).count()
}

/// The figures of `samples` (out of a run total of `total_ns`); `None` if empty.
fn figures<'a>(
    samples: impl Iterator<Item = &'a RegretSample>,
    total_ns: u64,
) -> Option<RegretFigures> {
    let mut regrets: Vec<u64> = samples.map(|s| s.regret_ns).collect();
    if regrets.is_empty() {
        return None;
    }
    regrets.sort_unstable();
    let n = regrets.len();
    let sum: u64 = regrets.iter().sum();
    // Nearest rank: the ceil(0.99 n)-th smallest, 1-based.
    let p99 = regrets[(n * 99).div_ceil(100).saturating_sub(1)];
    Some(RegretFigures {
        decisions: n as u64,
        mean_ms: ns_to_ms(sum) / n as f64,
        p99_ms: ns_to_ms(p99),
        best_share: regrets.iter().filter(|&&r| r == 0).count() as f64 / n as f64,
        regret_share: if total_ns == 0 {
            0.0
        } else {
            sum as f64 / total_ns as f64
        },
    })
}
