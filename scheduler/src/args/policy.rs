//! The flags that choose the routing policy and set its knobs.
//!
//! Each policy's knobs are one flag group ([`KvArgs`], [`KvNormalizedArgs`],
//! [`CacheAwareArgs`], [`PredictedTtftArgs`]) that knows its flag names and writes
//! only its own `PolicyConfig` variant; two knobs with one meaning in two policies
//! (`--temperature`, `--match-rate-threshold`) are shared. A knob given for a policy
//! that does not have it is an error naming the flag, not silently ignored: an
//! operator who sets `--cache-threshold` while running `predicted-ttft` has a wrong
//! belief about what the router does. Unset knobs keep `PolicyConfig::default_for`'s
//! values (documented with their sources in the scheduler).

use crate::PolicyConfig;
use crate::SchedulerError;
use crate::policy::predicted_ttft::PredictedTtftConfig;
use clap::Args;
use kv_events::routing::PolicyKind;

/// The default policy and every policy's knobs.
#[derive(Debug, Clone, Args)]
pub struct PolicyArgs {
    /// Default routing policy (overridable per request): predicted-ttft (lowest
    /// predicted time to first token, crediting reuse; the best on the Mooncake trace,
    /// see docs/benchmarks.md), kv (prefill + decode blocks, NVIDIA Dynamo's cost),
    /// kv-normalized, cache-aware-threshold (SGLang's), round-robin, random or
    /// least-loaded.
    #[arg(long, env = "KV_ROUTER_POLICY", default_value = "predicted-ttft")]
    pub policy: PolicyKind,
    /// kv, kv-normalized: softmax temperature over normalized costs; 0 always picks
    /// the cheapest [default: 0].
    #[arg(long, env = "KV_ROUTER_TEMPERATURE", allow_negative_numbers = true)]
    pub temperature: Option<f64>,
    /// kv-normalized: cache affinity counts only above this match fraction [default:
    /// 0.1]; predicted-ttft: reuse credits apply only above it [default: 0.2].
    #[arg(
        long,
        env = "KV_ROUTER_MATCH_RATE_THRESHOLD",
        allow_negative_numbers = true
    )]
    pub match_rate_threshold: Option<f64>,
    /// Knobs of `kv`.
    #[command(flatten)]
    pub kv: KvArgs,
    /// Knobs of `kv-normalized`.
    #[command(flatten)]
    pub kv_normalized: KvNormalizedArgs,
    /// Knobs of `cache-aware-threshold`.
    #[command(flatten)]
    pub cache_aware: CacheAwareArgs,
    /// Knobs of `predicted-ttft`.
    #[command(flatten)]
    pub predicted_ttft: PredictedTtftArgs,
}

/// Knobs of the `kv` policy.
#[derive(Debug, Clone, Args)]
pub struct KvArgs {
    /// kv: weight of prefill blocks against decode blocks [default: 1.0].
    #[arg(
        long,
        visible_alias = "overlap-weight",
        env = "KV_ROUTER_PREFILL_LOAD_SCALE",
        allow_negative_numbers = true
    )]
    pub prefill_load_scale: Option<f64>,
    /// kv: prefill blocks saved per cached block [default: 1.0].
    #[arg(long, env = "KV_ROUTER_OVERLAP_CREDIT", allow_negative_numbers = true)]
    pub overlap_credit: Option<f64>,
    /// kv: prefill blocks saved per block held beyond the GPU overlap only on a
    /// lower storage tier (CPU or disk), in [0, 1] [default: 0.5].
    #[arg(
        long,
        env = "KV_ROUTER_LOWER_TIER_CREDIT",
        allow_negative_numbers = true
    )]
    pub lower_tier_credit: Option<f64>,
}

/// Knobs of the `kv-normalized` policy.
#[derive(Debug, Clone, Args)]
pub struct KvNormalizedArgs {
    /// kv-normalized: β, weight of the normalized-load term [default: 1.0].
    #[arg(
        long,
        env = "KV_ROUTER_LOAD_BALANCE_WEIGHT",
        allow_negative_numbers = true
    )]
    pub load_balance_weight: Option<f64>,
    /// kv-normalized: per-rank cap in multiples of the fair share [default: 2.0].
    #[arg(
        long,
        env = "KV_ROUTER_FAIR_SHARE_MULTIPLIER",
        allow_negative_numbers = true
    )]
    pub fair_share_multiplier: Option<f64>,
}

/// Knobs of the `cache-aware-threshold` policy.
#[derive(Debug, Clone, Args)]
pub struct CacheAwareArgs {
    /// cache-aware-threshold: route to the best match above this match fraction
    /// [default: 0.3].
    #[arg(long, env = "KV_ROUTER_CACHE_THRESHOLD", allow_negative_numbers = true)]
    pub cache_threshold: Option<f64>,
    /// cache-aware-threshold: imbalance when max − min active requests exceeds this
    /// [default: 64].
    #[arg(long, env = "KV_ROUTER_BALANCE_ABS_THRESHOLD")]
    pub balance_abs_threshold: Option<u64>,
    /// cache-aware-threshold: imbalance when max > min × this [default: 1.5].
    #[arg(
        long,
        env = "KV_ROUTER_BALANCE_REL_THRESHOLD",
        allow_negative_numbers = true
    )]
    pub balance_rel_threshold: Option<f64>,
}

/// Knobs of the `predicted-ttft` policy: the engine's step-time model (calibrate it
/// to the engine: the defaults are the mock engine's `H100_8B` timing) and the value
/// of reuse (tuned with `kv-mocker lab`).
#[derive(Debug, Clone, Args)]
pub struct PredictedTtftArgs {
    /// predicted-ttft: fixed cost of one engine step, in ms [default: 9.0].
    #[arg(long, env = "KV_ROUTER_STEP_BASE_MS", allow_negative_numbers = true)]
    pub step_base_ms: Option<f64>,
    /// predicted-ttft: prefill cost per prompt token, in ms [default: 0.06, about
    /// 16.7k tokens/s].
    #[arg(
        long,
        env = "KV_ROUTER_PREFILL_MS_PER_TOKEN",
        allow_negative_numbers = true
    )]
    pub prefill_ms_per_token: Option<f64>,
    /// predicted-ttft: step cost per decoding sequence, in ms [default: 0.04].
    #[arg(
        long,
        env = "KV_ROUTER_DECODE_MS_PER_SEQ",
        allow_negative_numbers = true
    )]
    pub decode_ms_per_seq: Option<f64>,
    /// predicted-ttft: step cost per KV token read by decode attention, in ms
    /// [default: 0.00004].
    #[arg(
        long,
        env = "KV_ROUTER_KV_READ_MS_PER_TOKEN",
        allow_negative_numbers = true
    )]
    pub kv_read_ms_per_token: Option<f64>,
    /// predicted-ttft: tokens per engine step, the engine's max_num_batched_tokens
    /// [default: 8192].
    #[arg(long, env = "KV_ROUTER_MAX_NUM_BATCHED_TOKENS")]
    pub max_num_batched_tokens: Option<u64>,
    /// predicted-ttft: cost of loading one prompt token's KV from a lower storage
    /// tier (CPU or disk) instead of prefilling it, in ms [default: 0.005, PCIe Gen4
    /// x16 for Llama-3-8B].
    #[arg(
        long,
        env = "KV_ROUTER_TIER_LOAD_MS_PER_TOKEN",
        allow_negative_numbers = true
    )]
    pub tier_load_ms_per_token: Option<f64>,
    /// The value of reuse.
    #[command(flatten)]
    pub credit: ReuseCreditArgs,
    /// The delay cap.
    #[command(flatten)]
    pub delay_cap: DelayCapArgs,
}

/// `predicted-ttft`'s reuse credits (tuned with the lab, which flattens this group).
#[derive(Debug, Clone, Args)]
pub struct ReuseCreditArgs {
    /// predicted-ttft: prefill tokens a cached token is worth on every rank
    /// [default: 12].
    #[arg(long, env = "KV_ROUTER_REUSE_CREDIT", allow_negative_numbers = true)]
    pub reuse_credit: Option<f64>,
    /// predicted-ttft: extra credit on the ranks with the shortest prefill queue,
    /// halving per max_num_batched_tokens of excess queue [default: 40].
    #[arg(
        long,
        env = "KV_ROUTER_BALANCED_REUSE_CREDIT",
        allow_negative_numbers = true
    )]
    pub balanced_reuse_credit: Option<f64>,
    /// predicted-ttft: extra credit per step of prefill queued on the least-loaded
    /// rank [default: 0.5].
    #[arg(
        long,
        env = "KV_ROUTER_BACKLOG_REUSE_CREDIT",
        allow_negative_numbers = true
    )]
    pub backlog_reuse_credit: Option<f64>,
    /// predicted-ttft: count prompt blocks of requests in flight on a rank as cached
    /// there (needs --assume-kv-reuse) [default: true].
    #[arg(long, env = "KV_ROUTER_IN_FLIGHT_REUSE")]
    pub in_flight_reuse: Option<bool>,
}

/// `predicted-ttft`'s delay cap (the lab flattens this group too).
#[derive(Debug, Clone, Args)]
pub struct DelayCapArgs {
    /// predicted-ttft: while the fleet has spare capacity, leave out ranks where the
    /// request's own predicted TTFT exceeds --delay-cap-ratio times the lowest
    /// [default: true].
    #[arg(long, env = "KV_ROUTER_DELAY_CAP")]
    pub delay_cap: Option<bool>,
    /// predicted-ttft: the delay cap's ratio, ≥ 1 [default: 2].
    #[arg(long, env = "KV_ROUTER_DELAY_CAP_RATIO")]
    pub delay_cap_ratio: Option<f64>,
    /// predicted-ttft: the delay cap applies while the ranks' mean prefill queue is
    /// below this many steps of max_num_batched_tokens [default: 3].
    #[arg(long, env = "KV_ROUTER_DELAY_CAP_SPARE_STEPS")]
    pub delay_cap_spare_steps: Option<f64>,
}

impl KvArgs {
    fn given(&self) -> Vec<&'static str> {
        given(&[
            ("prefill-load-scale", self.prefill_load_scale.is_some()),
            ("overlap-credit", self.overlap_credit.is_some()),
            ("lower-tier-credit", self.lower_tier_credit.is_some()),
        ])
    }
}

impl KvNormalizedArgs {
    fn given(&self) -> Vec<&'static str> {
        given(&[
            ("load-balance-weight", self.load_balance_weight.is_some()),
            (
                "fair-share-multiplier",
                self.fair_share_multiplier.is_some(),
            ),
        ])
    }
}

impl CacheAwareArgs {
    fn given(&self) -> Vec<&'static str> {
        given(&[
            ("cache-threshold", self.cache_threshold.is_some()),
            (
                "balance-abs-threshold",
                self.balance_abs_threshold.is_some(),
            ),
            (
                "balance-rel-threshold",
                self.balance_rel_threshold.is_some(),
            ),
        ])
    }
}

impl PredictedTtftArgs {
    fn given(&self) -> Vec<&'static str> {
        let mut flags = given(&[
            ("step-base-ms", self.step_base_ms.is_some()),
            ("prefill-ms-per-token", self.prefill_ms_per_token.is_some()),
            ("decode-ms-per-seq", self.decode_ms_per_seq.is_some()),
            ("kv-read-ms-per-token", self.kv_read_ms_per_token.is_some()),
            (
                "max-num-batched-tokens",
                self.max_num_batched_tokens.is_some(),
            ),
            (
                "tier-load-ms-per-token",
                self.tier_load_ms_per_token.is_some(),
            ),
        ]);
        flags.extend(self.credit.given());
        flags.extend(self.delay_cap.given());
        flags
    }

    /// Writes the knobs that were given into `c`; the others keep their values.
    pub fn apply(&self, c: &mut PredictedTtftConfig) {
        set(&mut c.timing.step_base_ms, self.step_base_ms);
        set(
            &mut c.timing.prefill_ms_per_token,
            self.prefill_ms_per_token,
        );
        set(&mut c.timing.decode_ms_per_seq, self.decode_ms_per_seq);
        set(
            &mut c.timing.kv_read_ms_per_token,
            self.kv_read_ms_per_token,
        );
        set(
            &mut c.timing.max_num_batched_tokens,
            self.max_num_batched_tokens,
        );
        set(
            &mut c.timing.tier_load_ms_per_token,
            self.tier_load_ms_per_token,
        );
        self.credit.apply(c);
        self.delay_cap.apply(c);
    }
}

impl ReuseCreditArgs {
    fn given(&self) -> Vec<&'static str> {
        given(&[
            ("reuse-credit", self.reuse_credit.is_some()),
            (
                "balanced-reuse-credit",
                self.balanced_reuse_credit.is_some(),
            ),
            ("backlog-reuse-credit", self.backlog_reuse_credit.is_some()),
            ("in-flight-reuse", self.in_flight_reuse.is_some()),
        ])
    }

    /// Writes the credits that were given into `c`; the others keep their values.
    pub fn apply(&self, c: &mut PredictedTtftConfig) {
        set(&mut c.credit.base, self.reuse_credit);
        set(&mut c.credit.balanced, self.balanced_reuse_credit);
        set(&mut c.credit.backlog, self.backlog_reuse_credit);
        set(&mut c.credit.in_flight, self.in_flight_reuse);
    }
}

impl DelayCapArgs {
    fn given(&self) -> Vec<&'static str> {
        given(&[
            ("delay-cap", self.delay_cap.is_some()),
            ("delay-cap-ratio", self.delay_cap_ratio.is_some()),
            (
                "delay-cap-spare-steps",
                self.delay_cap_spare_steps.is_some(),
            ),
        ])
    }

    /// Writes the delay cap knobs that were given into `c`.
    pub fn apply(&self, c: &mut PredictedTtftConfig) {
        set(&mut c.delay_cap.enabled, self.delay_cap);
        set(&mut c.delay_cap.max_ratio, self.delay_cap_ratio);
        set(&mut c.delay_cap.spare_steps, self.delay_cap_spare_steps);
    }
}

impl PolicyArgs {
    /// The default policy with the knob flags applied. Values are validated later,
    /// with the rest of the scheduler config.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidFlag`] naming the first flag given for a policy that does
    /// not have that knob.
    pub fn policy_config(&self) -> Result<PolicyConfig, SchedulerError> {
        use PolicyKind::{CacheAwareThreshold, Kv, KvNormalized, PredictedTtft};
        let groups: [(Vec<&'static str>, &[PolicyKind]); 6] = [
            (self.kv.given(), &[Kv]),
            (self.kv_normalized.given(), &[KvNormalized]),
            (self.cache_aware.given(), &[CacheAwareThreshold]),
            (self.predicted_ttft.given(), &[PredictedTtft]),
            (
                given(&[("temperature", self.temperature.is_some())]),
                &[Kv, KvNormalized],
            ),
            (
                given(&[("match-rate-threshold", self.match_rate_threshold.is_some())]),
                &[KvNormalized, PredictedTtft],
            ),
        ];
        for (flags, policies) in groups {
            if let Some(flag) = flags.first()
                && !policies.contains(&self.policy)
            {
                let names: Vec<&str> = policies.iter().map(|p| p.as_str()).collect();
                return Err(SchedulerError::InvalidFlag {
                    flag,
                    reason: format!(
                        "applies to policy {}, not {}",
                        names.join(" and "),
                        self.policy
                    ),
                });
            }
        }
        let mut policy = PolicyConfig::default_for(self.policy);
        match &mut policy {
            PolicyConfig::Kv(c) => {
                set(&mut c.prefill_load_scale, self.kv.prefill_load_scale);
                set(&mut c.overlap_credit, self.kv.overlap_credit);
                set(&mut c.lower_tier_credit, self.kv.lower_tier_credit);
                set(&mut c.temperature, self.temperature);
            }
            PolicyConfig::KvNormalized(c) => {
                let k = &self.kv_normalized;
                set(&mut c.load_balance_weight, k.load_balance_weight);
                set(&mut c.match_rate_threshold, self.match_rate_threshold);
                set(&mut c.fair_share_multiplier, k.fair_share_multiplier);
                set(&mut c.temperature, self.temperature);
            }
            PolicyConfig::CacheAwareThreshold(c) => {
                let k = &self.cache_aware;
                set(&mut c.cache_threshold, k.cache_threshold);
                set(&mut c.balance_abs_threshold, k.balance_abs_threshold);
                set(&mut c.balance_rel_threshold, k.balance_rel_threshold);
            }
            PolicyConfig::PredictedTtft(c) => {
                self.predicted_ttft.apply(c);
                set(&mut c.credit.min_match_ratio, self.match_rate_threshold);
            }
            PolicyConfig::RoundRobin | PolicyConfig::Random | PolicyConfig::LeastLoaded => {}
        }
        Ok(policy)
    }
}

/// The names of the flags that were given.
fn given(flags: &[(&'static str, bool)]) -> Vec<&'static str> {
    flags
        .iter()
        .filter(|(_, set)| *set)
        .map(|(name, _)| *name)
        .collect()
}

fn set<T: Copy>(knob: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *knob = v;
    }
}
