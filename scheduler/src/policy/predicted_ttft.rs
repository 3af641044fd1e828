//! `predicted-ttft`: route to the rank with the lowest predicted time to first token,
//! crediting prefix reuse beyond the request's own saving.
//!
//! For a prompt of `N` tokens, each candidate rank gets, in model ms:
//!
//! ```text
//! O      = min(N, block_size × overlap)        overlap = max(indexed overlap blocks,
//!                                                            in-flight overlap blocks)
//! credit = 1                                                    if O < min_match_ratio × N
//!        = base + balanced / (1 + (P − P_min) / B) + backlog × P_min / B   otherwise
//! L      = min(N, block_size × any_tier_blocks) − O, at least 0
//! steps  = max(1, ceil((P + N − O − L) / B))
//! w      = ½ if R > 0, else 0                   the wait for the step the rank runs
//! cost   = prefill_ms_per_token × (P + N − credit × O − L) + tier_load_ms_per_token × L
//!        + (steps + w) × (step_base_ms + decode_ms_per_seq × R + kv_read_ms_per_token × D × block_size)
//! ```
//!
//! where `P` is the rank's in-flight prefill tokens (`active_prefill_tokens`), `P_min`
//! the smallest `P` over the candidates, `B` the engine's `max_num_batched_tokens`,
//! `R` its active requests and `D` its active context blocks (every active request's
//! blocks, a shared prefix counted per request: decode attention reads each running
//! sequence's whole context, whatever the cache shares). A rank with active requests
//! is running a step, which a new request waits out before its own first step starts:
//! half a step on average (`w`), what an idle rank does not pay. Without `w` an
//! idle rank priced a little higher by calibration (its per-step multiplier read
//! 0.85 against its peers' 0.6) lost every decision to a decoding one, and at light
//! load three of eight identical engines took 95% of the requests at a 10% higher
//! TTFT than round robin's (`docs/benchmarks.md`, "Calibration that starved
//! ranks"). The in-flight overlap is
//! the leading prompt blocks already held by requests booked on the rank and not yet
//! freed (`request_blocks − new_blocks`, non-zero only when KV reuse is assumed): the
//! index learns a prefix only after the rank has prefilled it, and under load the
//! next turn of a conversation arrives before that.
//!
//! With `credit = 1` the cost is a prediction of the request's TTFT from a linear
//! step-time model (NVIDIA Dynamo-style prefill-then-decode accounting, in time units
//! instead of blocks): the rank prefills everything booked before the request (FCFS)
//! and the request's uncached tokens, `B` tokens per step, and every step also carries
//! the running decodes. The credits value a cached token above its own prefill:
//! `base` always (a hit keeps the rank's cache useful and its queue short for later
//! requests too); `balanced` on ranks whose queue is as short as the shortest, halving
//! per `B` tokens of excess queue (decay of overlap credit under load, so a hot prefix
//! does not make requests queue); `backlog` per step of queue that even the least
//! loaded rank has (when every rank is backlogged, a saved token saves time for every
//! request behind this one). The credits only apply when the rank caches at least
//! `min_match_ratio` of the prompt (default 0.2; SGLang's cache-aware router gates on
//! a match ratio too, at 0.3): a short shared prefix such as a system prompt must not
//! pull every request to the rank that holds it.
//!
//! The credit may make a rank with a long queue the cheapest even though *this*
//! request's first token comes later there. While the fleet has spare capacity (the
//! candidates' mean `P` below `spare_steps × B`, default 3 steps), the delay cap
//! leaves out every rank whose uncredited cost (`credit = 1`: the request's own
//! predicted TTFT) is more than `max_ratio` (default 2) times the lowest
//! ([`super::delay_cap`]; it fixed the light-load p99 in the lab).
//!
//! `L` is how the router prices a block held on a lower storage tier: engines that
//! offload KV (vLLM's CPU offloading, LMCache) keep blocks evicted from the GPU on
//! CPU or disk, and the index reports per rank the leading prompt blocks held on
//! *any* tier (`any_tier_blocks` ≥ the GPU overlap). Those `L` tokens beyond the GPU
//! overlap are copied back instead of prefilled: they cost `tier_load_ms_per_token`
//! each (default 0.005 ms, ~12× cheaper than the 0.06 ms prefill; see
//! [`StepTimeModel::tier_load_ms_per_token`]) and take no room in the step's token
//! budget. They earn no reuse credit and do not count towards `min_match_ratio`:
//! the credits value keeping a prefix hot on the GPU. The index gives one combined
//! any-tier count, so CPU and disk share one load cost. On a cluster without
//! offloading `L` = 0 and the cost is unchanged. Online calibration (below) still
//! sees lower-tier tokens as uncached ([`TtftFeatures`] counts only `O` as cached),
//! so on an offloading cluster it learns a somewhat smaller prefill multiplier.
//!
//! Source: designed and tuned with the routing-quality lab (`kv-mocker lab`, the
//! `ttft-credit` prototype, retired in issue 26) on the Mooncake FAST'25
//! conversation trace; the step-time defaults are the mock engine's
//! `TimingModel::H100_8B` (`docs/engine-model.md`), and `docs/studies/routing-quality.md` has the
//! ablation and the comparison with every other policy. Calibrate the timing knobs to
//! the real engine, or turn on online calibration (`crate::calibration`): it learns
//! per-rank multipliers of the step-time constants ([`TimingScale`]) from observed
//! TTFTs, and the selection then prices each rank with its own model. Exact ties are
//! broken uniformly at random.

use super::context::check_non_negative;
use super::context::{Candidate, Choice, SelectContext, TimingScale};
use super::delay_cap::DelayCap;
use super::sampling::pick_by_cost;
use crate::error::SchedulerError;
use crate::request::RequestShape;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

/// The engine's step-time model, as the policy predicts with it (per rank).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StepTimeModel {
    /// Fixed cost of a step, in ms. Default 9.0.
    pub step_base_ms: f64,
    /// Prefill cost per prompt token, in ms. Default 0.06 (~16.7k tokens/s).
    pub prefill_ms_per_token: f64,
    /// Cost per decoding sequence in a step, in ms. Default 0.04.
    pub decode_ms_per_seq: f64,
    /// Cost per KV token read by decode attention, in ms. Default 4e-5.
    pub kv_read_ms_per_token: f64,
    /// Tokens per step (the engine's `max_num_batched_tokens`); at least 1.
    /// Default 8,192.
    pub max_num_batched_tokens: u64,
    /// Cost of loading one prompt token's KV from a lower storage tier (CPU or disk,
    /// one value for both: the index reports one combined any-tier prefix) instead of
    /// prefilling it, in ms. Not learned by calibration. Default 0.005: a PCIe Gen4
    /// x16 link moves ≈ 25 GB/s host-to-device in practice (31.5 GB/s per direction
    /// by the PCI-SIG 4.0 spec: 16 GT/s × 16 lanes, 128b/130b), and Llama-3-8B's KV
    /// cache is 128 KiB per token in fp16 (its `config.json`: 32 layers × 8 KV heads
    /// × 128 head dim × K and V × 2 bytes), so 131,072 B / 25 GB/s ≈ 0.0052 ms per
    /// token. Raise it for disk tiers (NVMe Gen4 ≈ 7 GB/s: ≈ 0.019 ms per token).
    pub tier_load_ms_per_token: f64,
}

impl Default for StepTimeModel {
    /// The mock engine's `TimingModel::H100_8B` and default batch budget.
    fn default() -> Self {
        Self {
            step_base_ms: 9.0,
            prefill_ms_per_token: 0.06,
            decode_ms_per_seq: 0.04,
            kv_read_ms_per_token: 4e-5,
            max_num_batched_tokens: 8_192,
            tier_load_ms_per_token: 0.005,
        }
    }
}

impl StepTimeModel {
    /// This model with its constants multiplied by `scale` (the batch budget is the
    /// engine's setting and the tier load cost a link's, neither learned).
    pub fn scaled(&self, scale: TimingScale) -> Self {
        Self {
            step_base_ms: self.step_base_ms * scale.step_base,
            prefill_ms_per_token: self.prefill_ms_per_token * scale.prefill,
            decode_ms_per_seq: self.decode_ms_per_seq * scale.decode,
            kv_read_ms_per_token: self.kv_read_ms_per_token * scale.decode,
            max_num_batched_tokens: self.max_num_batched_tokens,
            tier_load_ms_per_token: self.tier_load_ms_per_token,
        }
    }

    /// One step of a rank running `requests` sequences over `context_tokens` KV
    /// tokens: `step_base_ms + decode_ms_per_seq × R + kv_read_ms_per_token × D ×
    /// block_size`, in ms.
    pub(crate) fn step_ms(&self, requests: u64, context_tokens: u64) -> f64 {
        self.step_base_ms
            + self.decode_ms_per_seq * requests as f64
            + self.kv_read_ms_per_token * context_tokens as f64
    }
}

/// What the uncredited (`credit = 1`) TTFT prediction of a request on one rank is
/// made of; online calibration regresses observed TTFTs on these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TtftFeatures {
    /// Prefill tokens ahead of and in the request: `P + N − O`, in tokens.
    pub prefill_tokens: u64,
    /// The request's own prefill tokens: `N − O`, in tokens (what it adds to the
    /// rank's queue).
    pub uncached_tokens: u64,
    /// Engine steps until its first token: `max(1, ceil((P + N − O) / B))`.
    pub steps: u64,
    /// Active requests on the rank (`R`), decoding in every one of those steps.
    pub active_requests: u64,
    /// KV tokens decode attention reads per step (`D × block_size`), in tokens.
    pub context_tokens: u64,
    /// The rank had active requests at booking, so it was most likely mid-step: the
    /// request first waits for that step to end, half a step on average (an engine
    /// fixes a step's batch when the step starts).
    pub mid_step: bool,
}

impl TtftFeatures {
    /// The features of a request with `uncached` tokens to prefill on a rank with
    /// `load`, at `block_size` tokens per block and `budget` tokens per step.
    pub fn new(uncached: u64, load: &crate::load::RankLoad, block_size: u32, budget: u64) -> Self {
        let prefill_tokens = load.active_prefill_tokens.saturating_add(uncached);
        Self {
            prefill_tokens,
            uncached_tokens: uncached,
            steps: prefill_tokens.div_ceil(budget.max(1)).max(1),
            active_requests: load.active_requests as u64,
            context_tokens: load
                .active_context_blocks
                .saturating_mul(u64::from(block_size.max(1))),
            mid_step: load.active_requests > 0,
        }
    }

    /// The features of `request` on candidate `c`, with the overlap the policy
    /// credits (indexed or in flight, see the module docs).
    pub fn of(config: &PredictedTtftConfig, request: &RequestShape, c: &Candidate) -> Self {
        let uncached = request.num_tokens - cached_tokens(config, request, c);
        Self::new(
            uncached,
            &c.load,
            request.block_size,
            config.timing.max_num_batched_tokens,
        )
    }

    /// The TTFT calibration expects under `t`, in two parts, in ms: prefill
    /// (`prefill_ms_per_token × (P + N − O)`) and per step (`(steps + w) ×
    /// (step_base_ms + decode_ms_per_seq × R + kv_read_ms_per_token × D × bs)`), with
    /// `w` = ½ when [`Self::mid_step`] (the wait for the running step), else 0, as
    /// the policy's cost counts it ([`predicted_ttft_cost`]).
    pub fn parts(&self, t: &StepTimeModel) -> [f64; 2] {
        let per_step = t.step_ms(self.active_requests, self.context_tokens);
        [
            t.prefill_ms_per_token * self.prefill_tokens as f64,
            (self.steps as f64 + step_wait(self.mid_step)) * per_step,
        ]
    }
}

/// Prompt tokens the policy counts as cached on `c`: the larger of the indexed and
/// the in-flight overlap, in tokens, at most the prompt.
fn cached_tokens(config: &PredictedTtftConfig, request: &RequestShape, c: &Candidate) -> u64 {
    let bs = u64::from(request.block_size.max(1));
    let in_flight = if config.credit.in_flight {
        request.request_blocks.saturating_sub(c.new_blocks)
    } else {
        0
    };
    let overlap = c.overlap_blocks.max(in_flight);
    (u64::from(overlap) * bs).min(request.num_tokens)
}

/// Prompt tokens held on `c` beyond `cached` on a lower storage tier only (`L` in the
/// module docs), in tokens: loaded, not prefilled.
fn lower_tier_tokens(request: &RequestShape, c: &Candidate, cached: u64) -> u64 {
    let bs = u64::from(request.block_size.max(1));
    (u64::from(c.any_tier_blocks) * bs)
        .min(request.num_tokens)
        .saturating_sub(cached)
}

/// How much a cached prompt token is worth, in prefill tokens (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReuseCredit {
    /// Credit on every rank; 1 = a cached token saves exactly its own prefill.
    /// Default 12.
    pub base: f64,
    /// Extra credit on a rank whose in-flight prefill is the smallest, halving per
    /// `max_num_batched_tokens` of excess. Default 40.
    pub balanced: f64,
    /// Extra credit per step of in-flight prefill on the least-loaded rank.
    /// Default 0.5.
    pub backlog: f64,
    /// Count blocks of requests in flight on the rank as cached (needs the
    /// scheduler's `assume_kv_reuse`). Default true.
    pub in_flight: bool,
    /// The extra credits apply only when the rank caches at least this fraction of
    /// the prompt, in `[0, 1]`; below it the credit is 1. Default 0.2 (tuned with the
    /// lab; SGLang's cache-aware router gates at `cache_threshold` 0.3).
    pub min_match_ratio: f64,
}

impl Default for ReuseCredit {
    /// The values the lab found best on the Mooncake conversation trace.
    fn default() -> Self {
        Self {
            base: 12.0,
            balanced: 40.0,
            backlog: 0.5,
            in_flight: true,
            min_match_ratio: 0.2,
        }
    }
}

/// Knobs of the `predicted-ttft` policy.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PredictedTtftConfig {
    /// The engine's step-time model.
    pub timing: StepTimeModel,
    /// The value of reuse.
    pub credit: ReuseCredit,
    /// How much the credit may delay the request itself while the fleet has spare
    /// capacity ([`super::delay_cap`]).
    pub delay_cap: DelayCap,
}

impl PredictedTtftConfig {
    /// Checks every knob: finite and ≥ 0, and a batch budget of at least 1 token.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] with field `policy.predicted_ttft.<knob>`.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        let t = &self.timing;
        check_non_negative("policy.predicted_ttft.timing.step_base_ms", t.step_base_ms)?;
        check_non_negative(
            "policy.predicted_ttft.timing.prefill_ms_per_token",
            t.prefill_ms_per_token,
        )?;
        check_non_negative(
            "policy.predicted_ttft.timing.decode_ms_per_seq",
            t.decode_ms_per_seq,
        )?;
        check_non_negative(
            "policy.predicted_ttft.timing.kv_read_ms_per_token",
            t.kv_read_ms_per_token,
        )?;
        check_non_negative(
            "policy.predicted_ttft.timing.tier_load_ms_per_token",
            t.tier_load_ms_per_token,
        )?;
        if t.max_num_batched_tokens == 0 {
            return Err(SchedulerError::InvalidConfig {
                field: "policy.predicted_ttft.timing.max_num_batched_tokens",
                reason: "must be at least 1".into(),
            });
        }
        let c = &self.credit;
        check_non_negative("policy.predicted_ttft.credit.base", c.base)?;
        check_non_negative("policy.predicted_ttft.credit.balanced", c.balanced)?;
        check_non_negative("policy.predicted_ttft.credit.backlog", c.backlog)?;
        if !(0.0..=1.0).contains(&c.min_match_ratio) {
            return Err(SchedulerError::InvalidConfig {
                field: "policy.predicted_ttft.credit.min_match_ratio",
                reason: format!("must be in [0, 1], got {}", c.min_match_ratio),
            });
        }
        self.delay_cap.validate()
    }
}

/// The predicted cost of one candidate, in model ms, when the least-loaded candidate
/// has `min_pending` in-flight prefill tokens (module docs give the formula).
pub fn predicted_ttft_cost(
    config: &PredictedTtftConfig,
    request: &RequestShape,
    c: &Candidate,
    min_pending: u64,
) -> f64 {
    let t = &config.timing;
    let k = &config.credit;
    let bs = u64::from(request.block_size.max(1));
    let budget = t.max_num_batched_tokens.max(1);
    let n = request.num_tokens;
    let cached = cached_tokens(config, request, c);
    let loaded = lower_tier_tokens(request, c, cached);
    let pending = c.load.active_prefill_tokens;
    let excess = pending.saturating_sub(min_pending) as f64 / budget as f64;
    let credit = if (cached as f64) < k.min_match_ratio * n as f64 {
        1.0
    } else {
        k.base + k.balanced / (1.0 + excess) + k.backlog * min_pending as f64 / budget as f64
    };
    let steps = pending
        .saturating_add(n - cached - loaded)
        .div_ceil(budget)
        .max(1);
    let active = c.load.active_requests as u64;
    let per_step = t.step_ms(active, c.load.active_context_blocks.saturating_mul(bs));
    t.prefill_ms_per_token * (pending as f64 + n as f64 - credit * cached as f64 - loaded as f64)
        + t.tier_load_ms_per_token * loaded as f64
        + (steps as f64 + step_wait(active > 0)) * per_step
}

/// `w` of the module docs: the steps a new request waits for the one a rank is
/// running when it is `busy` (has active requests): half of one on average; none on
/// an idle rank.
pub(crate) fn step_wait(busy: bool) -> f64 {
    if busy { 0.5 } else { 0.0 }
}

/// [`predicted_ttft_cost`] with `config`'s timing scaled by a rank's calibrated
/// multipliers (`None` or [`TimingScale::ONE`]: the configured timing), in model ms:
/// how [`select`] prices every candidate, so that a caller pricing a rank ahead of it
/// gets the same value to the bit.
pub(crate) fn scaled_cost(
    config: &PredictedTtftConfig,
    scale: Option<TimingScale>,
    request: &RequestShape,
    c: &Candidate,
    min_pending: u64,
) -> f64 {
    match scale {
        Some(scale) if scale != TimingScale::ONE => {
            let own = PredictedTtftConfig {
                timing: config.timing.scaled(scale),
                ..*config
            };
            predicted_ttft_cost(&own, request, c, min_pending)
        }
        _ => predicted_ttft_cost(config, request, c, min_pending),
    }
}

pub(super) fn select(
    config: &PredictedTtftConfig,
    ctx: &SelectContext<'_>,
    costs: &mut Vec<f64>,
    own: &mut Vec<f64>,
    rng: &mut StdRng,
) -> Choice {
    let min_pending = ctx
        .candidates
        .iter()
        .map(|c| c.load.active_prefill_tokens)
        .min()
        .unwrap_or(0);
    // Each candidate priced with its own (calibrated) timing under `config`'s credit.
    let cost_under = |config: &PredictedTtftConfig, i: usize, c: &Candidate| {
        let scale = ctx.timing_scales.get(i).copied();
        scaled_cost(config, scale, &ctx.request, c, min_pending)
    };
    costs.clear();
    costs.extend(
        ctx.candidates
            .iter()
            .enumerate()
            .map(|(i, c)| cost_under(config, i, c)),
    );
    let cap = &config.delay_cap;
    let pending = ctx.candidates.iter().map(|c| c.load.active_prefill_tokens);
    let applies = ctx
        .delay_cap_gate
        .unwrap_or_else(|| cap.applies(pending, config.timing.max_num_batched_tokens));
    if applies {
        // The request's own predicted TTFT: no credit beyond its own saving.
        let plain = PredictedTtftConfig {
            credit: ReuseCredit {
                base: 1.0,
                balanced: 0.0,
                backlog: 0.0,
                ..config.credit
            },
            ..*config
        };
        own.clear();
        own.extend(
            ctx.candidates
                .iter()
                .enumerate()
                .map(|(i, c)| cost_under(&plain, i, c)),
        );
        cap.apply(costs, own);
    }
    let index = pick_by_cost(rng, costs, 0.0);
    Choice {
        index,
        cost: Some(costs[index]),
    }
}

#[cfg(test)]
#[path = "predicted_ttft_tests.rs"]
mod tests;
