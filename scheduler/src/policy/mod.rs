//! Routing policies: each a variant of [`PolicyConfig`] carrying its own typed knobs,
//! each in its own file with the source of its formula.
//!
//! | policy | file | chooses |
//! |---|---|---|
//! | `kv` | [`kv`] | lowest Dynamo-style cost: weighted prefill blocks + decode blocks |
//! | `kv-normalized` | [`kv_normalized`] | lowest TensorRT-LLM ADP score, fair-share capped |
//! | `cache-aware-threshold` | [`cache_aware`] | SGLang: balance if imbalanced, else best match over a threshold |
//! | `round-robin`, `random`, `least-loaded` | [`baseline`] | baselines |
//! | `predicted-ttft` (default) | [`predicted_ttft`] | lowest predicted TTFT, with credit for reuse (found with `kv-mocker lab`) |
//!
//! A policy sees only [`Candidate`]s — ranks that are registered, match a pinned
//! dp_rank and are not busy — and returns the index of one. Selection is
//! O(candidates); the selector reuses scratch buffers, so it does not allocate once
//! warm. Adding a policy is a new file, a variant, and one arm in each match below.
//! What the policy files share (the candidates, the choice, the knob check) is in
//! `context.rs`, below this file and `config.rs`, so the policy files depend only
//! downwards.

pub mod baseline;
pub mod cache_aware;
mod context;
pub mod delay_cap;
pub mod kv;
pub mod kv_normalized;
pub mod predicted_ttft;
pub mod sampling;

pub use cache_aware::CacheAwareThresholdConfig;
pub use context::{Candidate, Choice, SelectContext, TimingScale};
pub use kv::KvPolicyConfig;
pub use kv_normalized::KvNormalizedConfig;
pub use predicted_ttft::PredictedTtftConfig;

use crate::error::SchedulerError;
use kv_events::WorkerRank;
use kv_events::routing::{CostOverrides, PolicyKind};
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

/// A routing policy together with its settings. Serde form: a map tagged by `kind`
/// (the wire name) holding the variant's knobs, e.g.
/// `{"kind": "kv", "prefill_load_scale": 1.0, "overlap_credit": 1.0, "temperature": 0.0}`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum PolicyConfig {
    /// KV-cache-aware cost after NVIDIA Dynamo's KV router (see [`kv`]).
    Kv(KvPolicyConfig),
    /// TensorRT-LLM's KV-cache-aware ADP router score (see [`kv_normalized`]).
    KvNormalized(KvNormalizedConfig),
    /// SGLang's cache-aware router thresholds (see [`cache_aware`]).
    CacheAwareThreshold(CacheAwareThresholdConfig),
    /// Cycle through the eligible ranks in order, ignoring cache and load.
    RoundRobin,
    /// Pick an eligible rank uniformly at random.
    Random,
    /// Pick the eligible rank with the least booked load (see [`baseline`]).
    LeastLoaded,
    /// Lowest predicted time to first token, with credit for reuse (see
    /// [`predicted_ttft`]).
    PredictedTtft(PredictedTtftConfig),
}

impl Default for PolicyConfig {
    /// `predicted-ttft` with its defaults: on the Mooncake conversation trace it has
    /// the lowest mean and p99 TTFT of every policy at 1× and 4× arrivals, and the
    /// highest hit rate at 4× (at 1× cache-aware-threshold's is 1.3 points higher;
    /// `docs/benchmarks.md`, "The default policy against the baselines").
    fn default() -> Self {
        PolicyConfig::PredictedTtft(PredictedTtftConfig::default())
    }
}

impl PolicyConfig {
    /// The policy `kind` with its default knobs.
    pub fn default_for(kind: PolicyKind) -> Self {
        match kind {
            PolicyKind::Kv => PolicyConfig::Kv(KvPolicyConfig::default()),
            PolicyKind::KvNormalized => PolicyConfig::KvNormalized(KvNormalizedConfig::default()),
            PolicyKind::CacheAwareThreshold => {
                PolicyConfig::CacheAwareThreshold(CacheAwareThresholdConfig::default())
            }
            PolicyKind::RoundRobin => PolicyConfig::RoundRobin,
            PolicyKind::Random => PolicyConfig::Random,
            PolicyKind::LeastLoaded => PolicyConfig::LeastLoaded,
            PolicyKind::PredictedTtft => {
                PolicyConfig::PredictedTtft(PredictedTtftConfig::default())
            }
        }
    }

    /// The wire name of this policy.
    pub fn kind(&self) -> PolicyKind {
        match self {
            PolicyConfig::Kv(_) => PolicyKind::Kv,
            PolicyConfig::KvNormalized(_) => PolicyKind::KvNormalized,
            PolicyConfig::CacheAwareThreshold(_) => PolicyKind::CacheAwareThreshold,
            PolicyConfig::RoundRobin => PolicyKind::RoundRobin,
            PolicyConfig::Random => PolicyKind::Random,
            PolicyConfig::LeastLoaded => PolicyKind::LeastLoaded,
            PolicyConfig::PredictedTtft(_) => PolicyKind::PredictedTtft,
        }
    }

    /// Checks the policy's knobs.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] naming the bad field (`policy.<kind>.<knob>`).
    pub fn validate(&self) -> Result<(), SchedulerError> {
        match self {
            PolicyConfig::Kv(c) => c.validate(),
            PolicyConfig::KvNormalized(c) => c.validate(),
            PolicyConfig::CacheAwareThreshold(c) => c.validate(),
            PolicyConfig::PredictedTtft(c) => c.validate(),
            PolicyConfig::RoundRobin | PolicyConfig::Random | PolicyConfig::LeastLoaded => Ok(()),
        }
    }

    /// This policy with a request's cost overrides applied.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidOverride`] when an override names a knob this policy
    /// does not have, or its value is negative or not finite.
    pub fn with_overrides(mut self, o: &CostOverrides) -> Result<Self, SchedulerError> {
        if o.is_empty() {
            return Ok(self);
        }
        let kind = self.kind();
        let reject = |field: &'static str| SchedulerError::InvalidOverride {
            field,
            reason: format!("policy {kind} has no such knob"),
        };
        match &mut self {
            PolicyConfig::Kv(c) => {
                if o.load_balance_weight.is_some() {
                    return Err(reject("load_balance_weight"));
                }
                set(
                    "prefill_load_scale",
                    &mut c.prefill_load_scale,
                    o.prefill_load_scale,
                )?;
                set("overlap_credit", &mut c.overlap_credit, o.overlap_credit)?;
                set("temperature", &mut c.temperature, o.temperature)?;
            }
            PolicyConfig::KvNormalized(c) => {
                if o.prefill_load_scale.is_some() {
                    return Err(reject("prefill_load_scale"));
                }
                if o.overlap_credit.is_some() {
                    return Err(reject("overlap_credit"));
                }
                set(
                    "load_balance_weight",
                    &mut c.load_balance_weight,
                    o.load_balance_weight,
                )?;
                set("temperature", &mut c.temperature, o.temperature)?;
            }
            _ => {
                let field = if o.temperature.is_some() {
                    "temperature"
                } else if o.prefill_load_scale.is_some() {
                    "prefill_load_scale"
                } else if o.overlap_credit.is_some() {
                    "overlap_credit"
                } else {
                    "load_balance_weight"
                };
                return Err(reject(field));
            }
        }
        Ok(self)
    }
}

fn set(field: &'static str, knob: &mut f64, value: Option<f64>) -> Result<(), SchedulerError> {
    let Some(v) = value else { return Ok(()) };
    if !(v.is_finite() && v >= 0.0) {
        return Err(SchedulerError::InvalidOverride {
            field,
            reason: format!("must be finite and >= 0, got {v}"),
        });
    }
    *knob = v;
    Ok(())
}

/// Stateful selector: owns the RNG, the round-robin cursor and scratch buffers.
#[derive(Debug, Clone)]
pub struct Selector {
    rng: StdRng,
    /// The rank round-robin chose last; the next turn goes to the first rank after it.
    last_round_robin: Option<WorkerRank>,
    costs: Vec<f64>,
    /// `predicted-ttft`'s own TTFT per candidate, for the delay cap.
    own: Vec<f64>,
    keys: Vec<(f64, f64)>,
    eligible: Vec<usize>,
}

impl Selector {
    /// A selector drawing randomness from `rng`.
    pub fn new(rng: StdRng) -> Self {
        Self {
            rng,
            last_round_robin: None,
            costs: Vec::new(),
            own: Vec::new(),
            keys: Vec::new(),
            eligible: Vec::new(),
        }
    }

    /// The cost the last [`Selector::select`] under `policy` gave candidate `index`
    /// (`kv`: weighted blocks; `kv-normalized`: tokens; `predicted-ttft`: model ms);
    /// `None` for policies without per-candidate costs and for a `kv-normalized`
    /// candidate over its fair share. Session affinity compares these.
    pub fn cost_of(&self, policy: &PolicyConfig, index: usize) -> Option<f64> {
        match policy {
            PolicyConfig::Kv(_) | PolicyConfig::PredictedTtft(_) => self.costs.get(index).copied(),
            PolicyConfig::KvNormalized(_) => self
                .eligible
                .iter()
                .position(|&i| i == index)
                .and_then(|pos| self.keys.get(pos))
                .map(|k| k.0),
            _ => None,
        }
    }

    /// Every candidate the last [`Selector::select`] under `policy` priced, as
    /// `(candidate index, cost)` with the costs [`Selector::cost_of`] gives, in one
    /// pass (`kv-normalized` lists only the candidates within their fair share);
    /// empty for policies without per-candidate costs.
    pub(crate) fn priced<'a>(
        &'a self,
        policy: &PolicyConfig,
    ) -> Box<dyn Iterator<Item = (usize, f64)> + 'a> {
        match policy {
            PolicyConfig::Kv(_) | PolicyConfig::PredictedTtft(_) => {
                Box::new(self.costs.iter().copied().enumerate())
            }
            PolicyConfig::KvNormalized(_) => Box::new(
                self.eligible
                    .iter()
                    .zip(&self.keys)
                    .map(|(&index, key)| (index, key.0)),
            ),
            _ => Box::new(std::iter::empty()),
        }
    }

    /// The index of the lowest `(primary, secondary)` key, exact ties uniformly at
    /// random (see [`sampling::pick_min`]); `keys` must not be empty.
    pub fn pick_min(&mut self, keys: &[(f64, f64)]) -> usize {
        sampling::pick_min(&mut self.rng, keys)
    }

    /// A uniform draw from `0..n` (`n` ≥ 1).
    pub(crate) fn draw(&mut self, n: usize) -> usize {
        use rand::Rng;
        self.rng.random_range(0..n)
    }

    /// Chooses one of `ctx.candidates` under `policy`.
    ///
    /// # Errors
    /// [`SchedulerError::NoWorkers`] when there is no candidate.
    pub fn select(
        &mut self,
        policy: &PolicyConfig,
        ctx: &SelectContext<'_>,
    ) -> Result<Choice, SchedulerError> {
        if ctx.candidates.is_empty() {
            return Err(SchedulerError::NoWorkers);
        }
        Ok(match policy {
            PolicyConfig::Kv(c) => kv::select(c, ctx, &mut self.costs, &mut self.rng),
            PolicyConfig::KvNormalized(c) => kv_normalized::select(
                c,
                ctx,
                kv_normalized::Scratch {
                    eligible: &mut self.eligible,
                    keys: &mut self.keys,
                    costs: &mut self.costs,
                },
                &mut self.rng,
            ),
            PolicyConfig::CacheAwareThreshold(c) => {
                cache_aware::select(c, ctx, &mut self.eligible, &mut self.keys, &mut self.rng)
            }
            PolicyConfig::RoundRobin => {
                baseline::round_robin(ctx.candidates, &mut self.last_round_robin)
            }
            PolicyConfig::Random => baseline::random(ctx.candidates, &mut self.rng),
            PolicyConfig::LeastLoaded => baseline::least_loaded(ctx, &mut self.keys, &mut self.rng),
            PolicyConfig::PredictedTtft(c) => {
                predicted_ttft::select(c, ctx, &mut self.costs, &mut self.own, &mut self.rng)
            }
        })
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Candidate builders shared by the policy tests.
    use super::*;
    use crate::request::RequestShape;
    use crate::sequences::RankLoad;
    use kv_events::{DpRank, WorkerId};
    use rand::SeedableRng;

    pub fn rank(id: u64, dp: u32) -> WorkerRank {
        WorkerRank::new(WorkerId(id), DpRank(dp))
    }

    /// Candidate `id` with overlap, decode blocks and requests; new blocks = `new`.
    pub fn cand(id: u64, overlap: u32, decode: u64, requests: usize, new: u32) -> Candidate {
        Candidate {
            rank: rank(id, 0),
            overlap_blocks: overlap,
            any_tier_blocks: overlap,
            load: RankLoad {
                active_decode_blocks: decode,
                active_requests: requests,
                ..RankLoad::default()
            },
            new_blocks: new,
        }
    }

    /// `c` holding `blocks` leading prompt blocks on some tier (at least its GPU
    /// overlap).
    pub fn on_any_tier(mut c: Candidate, blocks: u32) -> Candidate {
        c.any_tier_blocks = blocks.max(c.overlap_blocks);
        c
    }

    pub fn shape(request_blocks: u32, num_tokens: u64, block_size: u32) -> RequestShape {
        RequestShape {
            request_blocks,
            num_tokens,
            block_size,
        }
    }

    pub fn ctx(request: RequestShape, candidates: &[Candidate]) -> SelectContext<'_> {
        SelectContext {
            request,
            candidates,
            batch_remaining: 1,
            timing_scales: &[],
            delay_cap_gate: None,
        }
    }

    pub fn selector(seed: u64) -> Selector {
        Selector::new(StdRng::seed_from_u64(seed))
    }

    /// How often each candidate wins over `trials` selections.
    pub fn histogram(policy: &PolicyConfig, c: &SelectContext<'_>, trials: usize) -> Vec<usize> {
        let mut s = selector(7);
        let mut counts = vec![0; c.candidates.len()];
        for _ in 0..trials {
            counts[s.select(policy, c).unwrap().index] += 1;
        }
        counts
    }
}

#[cfg(test)]
mod tests;
