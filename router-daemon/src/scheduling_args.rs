//! The `serve` flags of scheduling and admission: policy and its knobs, booked-load
//! accounting, busy thresholds, the wait queue and replica sync. Flattened into
//! [`crate::ServeArgs`] and turned into [`scheduler::SchedulerConfig`] and
//! [`AdmissionConfig`] once, at start-up.
//!
//! A policy knob flag given for a policy that does not have the knob is an error
//! naming the flag, not silently ignored. Knob defaults are those of
//! `PolicyConfig::default_for` (documented with their sources in the scheduler).

use crate::admission::AdmissionConfig;
use crate::config::ConfigError;
use crate::queue::QueueConfig;
use crate::replicas::ReplicaConfig;
use clap::{ArgAction, Args};
use kv_events::RouterId;
use kv_events::routing::PolicyKind;
use scheduler::{
    BusyThresholds, PolicyConfig, PrefillDurationModel, SchedulerConfig, SequencesConfig, Threshold,
};
use std::time::Duration;

/// Scheduling and admission flags.
#[derive(Debug, Clone, Args)]
pub struct SchedulingArgs {
    /// Default routing policy: kv, kv-normalized, cache-aware-threshold, round-robin,
    /// random or least-loaded (overridable per request).
    #[arg(long, env = "KV_ROUTER_POLICY", default_value = "kv")]
    pub policy: PolicyKind,
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
    /// kv, kv-normalized: softmax temperature over normalized costs; 0 always picks
    /// the cheapest [default: 0].
    #[arg(long, env = "KV_ROUTER_TEMPERATURE", allow_negative_numbers = true)]
    pub temperature: Option<f64>,
    /// kv-normalized: β, weight of the normalized-load term [default: 1.0].
    #[arg(
        long,
        env = "KV_ROUTER_LOAD_BALANCE_WEIGHT",
        allow_negative_numbers = true
    )]
    pub load_balance_weight: Option<f64>,
    /// kv-normalized: cache affinity counts only above this match fraction
    /// [default: 0.1].
    #[arg(
        long,
        env = "KV_ROUTER_MATCH_RATE_THRESHOLD",
        allow_negative_numbers = true
    )]
    pub match_rate_threshold: Option<f64>,
    /// kv-normalized: per-rank cap in multiples of the fair share [default: 2.0].
    #[arg(
        long,
        env = "KV_ROUTER_FAIR_SHARE_MULTIPLIER",
        allow_negative_numbers = true
    )]
    pub fair_share_multiplier: Option<f64>,
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
    /// Count prefix blocks shared by concurrent requests on one rank once (engines
    /// with prefix sharing during decode); false counts every request's blocks.
    #[arg(long, env = "KV_ROUTER_ASSUME_KV_REUSE", default_value_t = true, action = ArgAction::Set)]
    pub assume_kv_reuse: bool,
    /// Drop a booked request after this many milliseconds without a lifecycle
    /// message (prefill_done, keep_alive, freed).
    #[arg(long, env = "KV_ROUTER_REQUEST_TTL_MS", default_value_t = 600_000)]
    pub request_ttl_ms: u64,
    /// Prefill speed of one rank, tokens per second; when set, the oldest in-flight
    /// prefill of a rank decays linearly over its expected duration.
    #[arg(
        long,
        env = "KV_ROUTER_PREFILL_TOKENS_PER_SECOND",
        allow_negative_numbers = true
    )]
    pub prefill_tokens_per_second: Option<f64>,
    /// A rank is busy at this many active decode blocks (`1500`) or this share of its
    /// KV blocks (`90%`).
    #[arg(long, env = "KV_ROUTER_BUSY_DECODE_BLOCKS")]
    pub busy_decode_blocks: Option<Threshold>,
    /// A rank is busy at this many in-flight prefill tokens (`8192`) or this share of
    /// its KV capacity in tokens (`10%`).
    #[arg(long, env = "KV_ROUTER_BUSY_PREFILL_TOKENS")]
    pub busy_prefill_tokens: Option<Threshold>,
    /// Most route requests waiting when every rank is busy; 0 answers overloaded at
    /// once. Must be below --max-inflight-routes (a waiting request holds a slot).
    #[arg(long, env = "KV_ROUTER_QUEUE_CAPACITY", default_value_t = 128)]
    pub queue_capacity: usize,
    /// Longest wait in the queue before answering overloaded, in milliseconds.
    #[arg(long, env = "KV_ROUTER_QUEUE_MAX_WAIT_MS", default_value_t = 5000)]
    pub queue_max_wait_ms: u64,
    /// This replica's id in sequence sync (default: random).
    #[arg(long, env = "KV_ROUTER_ROUTER_ID")]
    pub router_id: Option<u64>,
    /// Share booked load with the other replicas on the sequences subject.
    #[arg(long, env = "KV_ROUTER_REPLICA_SYNC", default_value_t = true, action = ArgAction::Set)]
    pub replica_sync: bool,
}

impl SchedulingArgs {
    /// The scheduler and admission configs these flags describe.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first bad flag or field.
    pub fn to_configs(&self) -> Result<(SchedulerConfig, AdmissionConfig), ConfigError> {
        let invalid = |field: &'static str, reason: String| ConfigError::Invalid { field, reason };
        if self.request_ttl_ms == 0 {
            return Err(invalid("request-ttl-ms", "must be at least 1 ms".into()));
        }
        let scheduler = SchedulerConfig {
            policy: self.policy_config()?,
            sequences: SequencesConfig {
                assume_kv_reuse: self.assume_kv_reuse,
                request_ttl: Duration::from_millis(self.request_ttl_ms),
            },
            busy: BusyThresholds {
                decode_blocks: self.busy_decode_blocks,
                prefill_tokens: self.busy_prefill_tokens,
            },
            prefill_duration: match self.prefill_tokens_per_second {
                None => PrefillDurationModel::Unknown,
                Some(tokens_per_second) => PrefillDurationModel::Throughput { tokens_per_second },
            },
        };
        scheduler.validate()?;
        let admission = AdmissionConfig {
            queue: QueueConfig {
                capacity: self.queue_capacity,
                max_wait: Duration::from_millis(self.queue_max_wait_ms),
            },
            replicas: ReplicaConfig {
                router_id: self
                    .router_id
                    .map_or_else(|| ReplicaConfig::default().router_id, RouterId),
                sync: self.replica_sync,
            },
        };
        Ok((scheduler, admission))
    }

    /// The default policy with the knob flags applied; a knob of another policy is
    /// an error.
    fn policy_config(&self) -> Result<PolicyConfig, ConfigError> {
        use PolicyKind::{CacheAwareThreshold, Kv, KvNormalized};
        let knobs: [(&'static str, bool, &[PolicyKind]); 9] = [
            (
                "prefill-load-scale",
                self.prefill_load_scale.is_some(),
                &[Kv],
            ),
            ("overlap-credit", self.overlap_credit.is_some(), &[Kv]),
            (
                "temperature",
                self.temperature.is_some(),
                &[Kv, KvNormalized],
            ),
            (
                "load-balance-weight",
                self.load_balance_weight.is_some(),
                &[KvNormalized],
            ),
            (
                "match-rate-threshold",
                self.match_rate_threshold.is_some(),
                &[KvNormalized],
            ),
            (
                "fair-share-multiplier",
                self.fair_share_multiplier.is_some(),
                &[KvNormalized],
            ),
            (
                "cache-threshold",
                self.cache_threshold.is_some(),
                &[CacheAwareThreshold],
            ),
            (
                "balance-abs-threshold",
                self.balance_abs_threshold.is_some(),
                &[CacheAwareThreshold],
            ),
            (
                "balance-rel-threshold",
                self.balance_rel_threshold.is_some(),
                &[CacheAwareThreshold],
            ),
        ];
        for (flag, set, policies) in knobs {
            if set && !policies.contains(&self.policy) {
                let names: Vec<&str> = policies.iter().map(|p| p.as_str()).collect();
                return Err(ConfigError::Invalid {
                    field: flag,
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
                set(&mut c.prefill_load_scale, self.prefill_load_scale);
                set(&mut c.overlap_credit, self.overlap_credit);
                set(&mut c.temperature, self.temperature);
            }
            PolicyConfig::KvNormalized(c) => {
                set(&mut c.load_balance_weight, self.load_balance_weight);
                set(&mut c.match_rate_threshold, self.match_rate_threshold);
                set(&mut c.fair_share_multiplier, self.fair_share_multiplier);
                set(&mut c.temperature, self.temperature);
            }
            PolicyConfig::CacheAwareThreshold(c) => {
                set(&mut c.cache_threshold, self.cache_threshold);
                set(&mut c.balance_abs_threshold, self.balance_abs_threshold);
                set(&mut c.balance_rel_threshold, self.balance_rel_threshold);
            }
            PolicyConfig::RoundRobin
            | PolicyConfig::Random
            | PolicyConfig::LeastLoaded
            | PolicyConfig::PredictedTtft(_) => {}
        }
        Ok(policy)
    }
}

fn set<T: Copy>(knob: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *knob = v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: SchedulingArgs,
    }

    fn parse(args: &[&str]) -> SchedulingArgs {
        Cli::try_parse_from(std::iter::once("kv-router").chain(args.iter().copied()))
            .expect("flags parse")
            .args
    }

    #[test]
    fn defaults_are_kv_with_documented_knobs_and_no_busy_thresholds() {
        let (scheduler, admission) = parse(&[]).to_configs().unwrap();
        assert_eq!(scheduler.policy, PolicyConfig::default());
        assert_eq!(scheduler.sequences, SequencesConfig::default());
        assert_eq!(scheduler.busy, BusyThresholds::default());
        assert_eq!(admission.queue, QueueConfig::default());
        assert!(admission.replicas.sync);
        let (_, other) = parse(&[]).to_configs().unwrap();
        assert_ne!(
            admission.replicas.router_id, other.replicas.router_id,
            "random router ids"
        );
    }

    #[test]
    fn every_flag_reaches_its_field() {
        let (scheduler, admission) = parse(&[
            "--policy",
            "kv-normalized",
            "--load-balance-weight",
            "0.5",
            "--match-rate-threshold",
            "0.2",
            "--fair-share-multiplier",
            "3",
            "--temperature",
            "0.1",
            "--assume-kv-reuse",
            "false",
            "--request-ttl-ms",
            "1500",
            "--prefill-tokens-per-second",
            "8000",
            "--busy-decode-blocks",
            "90%",
            "--busy-prefill-tokens",
            "4096",
            "--queue-capacity",
            "7",
            "--queue-max-wait-ms",
            "250",
            "--router-id",
            "42",
            "--replica-sync",
            "false",
        ])
        .to_configs()
        .unwrap();
        assert_eq!(
            scheduler.policy,
            PolicyConfig::KvNormalized(scheduler::KvNormalizedConfig {
                load_balance_weight: 0.5,
                match_rate_threshold: 0.2,
                fair_share_multiplier: 3.0,
                temperature: 0.1,
            })
        );
        assert!(!scheduler.sequences.assume_kv_reuse);
        assert_eq!(scheduler.sequences.request_ttl, Duration::from_millis(1500));
        assert_eq!(
            scheduler.prefill_duration,
            PrefillDurationModel::Throughput {
                tokens_per_second: 8000.0
            }
        );
        assert_eq!(scheduler.busy.decode_blocks, Some(Threshold::Fraction(0.9)));
        assert_eq!(
            scheduler.busy.prefill_tokens,
            Some(Threshold::Absolute(4096))
        );
        assert_eq!(admission.queue.capacity, 7);
        assert_eq!(admission.queue.max_wait, Duration::from_millis(250));
        assert_eq!(admission.replicas.router_id, RouterId(42));
        assert!(!admission.replicas.sync);

        let (scheduler, _) = parse(&[
            "--policy",
            "cache-aware-threshold",
            "--cache-threshold",
            "0.5",
            "--balance-abs-threshold",
            "8",
            "--balance-rel-threshold",
            "1.1",
        ])
        .to_configs()
        .unwrap();
        assert_eq!(
            scheduler.policy,
            PolicyConfig::CacheAwareThreshold(scheduler::CacheAwareThresholdConfig {
                cache_threshold: 0.5,
                balance_abs_threshold: 8,
                balance_rel_threshold: 1.1,
            })
        );
        // The old flag name still sets the kv weight.
        let (scheduler, _) = parse(&["--overlap-weight", "2", "--overlap-credit", "0.5"])
            .to_configs()
            .unwrap();
        assert_eq!(
            scheduler.policy,
            PolicyConfig::Kv(scheduler::KvPolicyConfig {
                prefill_load_scale: 2.0,
                overlap_credit: 0.5,
                temperature: 0.0,
            })
        );
    }

    #[test]
    fn knobs_of_another_policy_and_bad_values_name_their_flag() {
        let err = parse(&["--policy", "round-robin", "--temperature", "1"])
            .to_configs()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid --temperature: applies to policy kv and kv-normalized, not round-robin"
        );
        let err = parse(&["--cache-threshold", "0.5"])
            .to_configs()
            .unwrap_err();
        assert!(err.to_string().contains("--cache-threshold"), "{err}");
        let err = parse(&["--prefill-load-scale", "-1"])
            .to_configs()
            .unwrap_err();
        assert!(err.to_string().contains("prefill_load_scale"), "{err}");
        let err = parse(&["--request-ttl-ms", "0"]).to_configs().unwrap_err();
        assert!(err.to_string().contains("--request-ttl-ms"), "{err}");
        let err = parse(&["--busy-decode-blocks", "0"])
            .to_configs()
            .unwrap_err();
        assert!(err.to_string().contains("busy.decode_blocks"), "{err}");
        assert!(Cli::try_parse_from(["kv-router", "--busy-decode-blocks", "lots"]).is_err());
        assert!(Cli::try_parse_from(["kv-router", "--policy", "best"]).is_err());
    }
}
