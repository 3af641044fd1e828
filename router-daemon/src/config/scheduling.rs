//! The `serve` flags of scheduling and admission: policy and its knobs, booked-load
//! accounting, busy thresholds, the wait queue and replica sync. Flattened into
//! [`crate::ServeArgs`] and turned into [`scheduler::SchedulerConfig`] and
//! [`AdmissionConfig`] once, at start-up.
//!
//! The policy and its knobs are their own flag groups ([`PolicyArgs`]).

use super::calibration::CalibrationArgs;
use super::error::ConfigError;
use super::liveness::LivenessArgs;
use super::policy::PolicyArgs;
use super::sessions::SessionArgs;
use crate::admission::AdmissionConfig;
use crate::queue::QueueConfig;
use crate::replicas::ReplicaConfig;
use clap::{ArgAction, Args};
use kv_events::RouterId;
use scheduler::{
    BusyThresholds, PrefillDurationModel, SchedulerConfig, SequencesConfig, Threshold,
};
use std::time::Duration;

/// Scheduling and admission flags.
#[derive(Debug, Clone, Args)]
pub struct SchedulingArgs {
    /// The default policy and its knobs.
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Liveness from silence in the engines' load metrics.
    #[command(flatten)]
    pub liveness: LivenessArgs,
    /// Online calibration of `predicted-ttft`'s step-time constants.
    #[command(flatten)]
    pub calibration: CalibrationArgs,
    /// Session affinity for requests with a session id.
    #[command(flatten)]
    pub sessions: SessionArgs,
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
    /// At start-up, how long to collect the other replicas' in-flight bookings
    /// (answers to one snapshot request), in milliseconds; 0 skips the snapshot.
    /// Ends at once when no other replica runs.
    #[arg(
        long,
        env = "KV_ROUTER_REPLICA_SNAPSHOT_TIMEOUT_MS",
        default_value_t = 500
    )]
    pub replica_snapshot_timeout_ms: u64,
}

impl SchedulingArgs {
    /// The scheduler and admission configs these flags describe.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first bad flag or field.
    pub(crate) fn to_configs(&self) -> Result<(SchedulerConfig, AdmissionConfig), ConfigError> {
        let invalid = |field: &'static str, reason: String| ConfigError::Invalid { field, reason };
        if self.request_ttl_ms == 0 {
            return Err(invalid("request-ttl-ms", "must be at least 1 ms".into()));
        }
        let scheduler = SchedulerConfig {
            policy: self.policy.policy_config()?,
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
            liveness: self.liveness.to_config(),
            calibration: self.calibration.to_config(),
            sessions: self.sessions.to_config(),
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
                snapshot_timeout: Duration::from_millis(self.replica_snapshot_timeout_ms),
            },
        };
        Ok((scheduler, admission))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use scheduler::PolicyConfig;

    fn parse(args: &[&str]) -> SchedulingArgs {
        kv_cluster::args::parse_flags::<SchedulingArgs, _, _>(
            std::iter::once("kv-router").chain(args.iter().copied()),
        )
        .expect("flags parse")
    }

    #[test]
    fn defaults_are_predicted_ttft_with_documented_knobs_and_no_busy_thresholds() {
        let (scheduler, admission) = parse(&[]).to_configs().unwrap();
        assert_eq!(scheduler.policy, PolicyConfig::default());
        assert_eq!(scheduler.sequences, SequencesConfig::default());
        assert_eq!(scheduler.busy, BusyThresholds::default());
        assert_eq!(scheduler.liveness, scheduler::LivenessConfig::default());
        assert_eq!(scheduler.sessions, scheduler::SessionConfig::default());
        assert_eq!(admission.queue, QueueConfig::default());
        assert!(admission.replicas.sync);
        assert_eq!(
            admission.replicas.snapshot_timeout,
            ReplicaConfig::default().snapshot_timeout
        );
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
            "--replica-snapshot-timeout-ms",
            "0",
            "--metrics-interval-ms",
            "50",
            "--metrics-quiet-intervals",
            "2",
            "--metrics-silent-intervals",
            "5",
            "--metrics-liveness",
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
        assert_eq!(
            scheduler.liveness,
            scheduler::LivenessConfig {
                enabled: false,
                metrics_interval: Duration::from_millis(50),
                quiet_intervals: 2,
                silent_intervals: 5,
            }
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
        assert_eq!(admission.replicas.snapshot_timeout, Duration::ZERO);

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
        let (scheduler, _) = parse(&[
            "--policy",
            "kv",
            "--overlap-weight",
            "2",
            "--overlap-credit",
            "0.5",
            "--lower-tier-credit",
            "0.25",
        ])
        .to_configs()
        .unwrap();
        assert_eq!(
            scheduler.policy,
            PolicyConfig::Kv(scheduler::KvPolicyConfig {
                prefill_load_scale: 2.0,
                overlap_credit: 0.5,
                lower_tier_credit: 0.25,
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
        let err = parse(&["--policy", "kv", "--prefill-load-scale", "-1"])
            .to_configs()
            .unwrap_err();
        assert!(err.to_string().contains("prefill_load_scale"), "{err}");
        let err = parse(&["--policy", "kv", "--reuse-credit", "3"])
            .to_configs()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid --reuse-credit: applies to policy predicted-ttft, not kv"
        );
        let err = parse(&[
            "--policy",
            "cache-aware-threshold",
            "--match-rate-threshold",
            "0.5",
        ])
        .to_configs()
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid --match-rate-threshold: applies to policy kv-normalized and \
             predicted-ttft, not cache-aware-threshold"
        );
        let err = parse(&["--match-rate-threshold", "1.5"])
            .to_configs()
            .unwrap_err();
        assert!(err.to_string().contains("min_match_ratio"), "{err}");
        let err = parse(&["--max-num-batched-tokens", "0"])
            .to_configs()
            .unwrap_err();
        assert!(err.to_string().contains("max_num_batched_tokens"), "{err}");
        let err = parse(&["--request-ttl-ms", "0"]).to_configs().unwrap_err();
        assert!(err.to_string().contains("--request-ttl-ms"), "{err}");
        let err = parse(&["--busy-decode-blocks", "0"])
            .to_configs()
            .unwrap_err();
        assert!(err.to_string().contains("busy.decode_blocks"), "{err}");
        assert!(
            kv_cluster::args::parse_flags::<SchedulingArgs, _, _>([
                "kv-router",
                "--busy-decode-blocks",
                "lots"
            ])
            .is_err()
        );
        assert!(
            kv_cluster::args::parse_flags::<SchedulingArgs, _, _>([
                "kv-router",
                "--policy",
                "best"
            ])
            .is_err()
        );
    }

    #[test]
    fn predicted_ttft_knobs_reach_timing_and_credit() {
        use scheduler::policy::delay_cap::DelayCap;
        use scheduler::policy::predicted_ttft::{PredictedTtftConfig, ReuseCredit, StepTimeModel};
        let (scheduler, _) = parse(&[
            "--step-base-ms",
            "5",
            "--prefill-ms-per-token",
            "0.03",
            "--decode-ms-per-seq",
            "0.02",
            "--kv-read-ms-per-token",
            "0.00002",
            "--max-num-batched-tokens",
            "4096",
            "--tier-load-ms-per-token",
            "0.01",
            "--reuse-credit",
            "6",
            "--balanced-reuse-credit",
            "20",
            "--backlog-reuse-credit",
            "0.25",
            "--in-flight-reuse",
            "false",
            "--delay-cap",
            "false",
            "--delay-cap-ratio",
            "3",
            "--delay-cap-spare-steps",
            "1.5",
            "--match-rate-threshold",
            "0.4",
        ])
        .to_configs()
        .unwrap();
        assert_eq!(
            scheduler.policy,
            PolicyConfig::PredictedTtft(PredictedTtftConfig {
                timing: StepTimeModel {
                    step_base_ms: 5.0,
                    prefill_ms_per_token: 0.03,
                    decode_ms_per_seq: 0.02,
                    kv_read_ms_per_token: 0.00002,
                    max_num_batched_tokens: 4096,
                    tier_load_ms_per_token: 0.01,
                },
                credit: ReuseCredit {
                    base: 6.0,
                    balanced: 20.0,
                    backlog: 0.25,
                    in_flight: false,
                    min_match_ratio: 0.4,
                },
                delay_cap: DelayCap {
                    enabled: false,
                    max_ratio: 3.0,
                    spare_steps: 1.5,
                },
            })
        );
        // The shared threshold keeps its meaning for kv-normalized.
        let (scheduler, _) = parse(&["--policy", "kv-normalized", "--match-rate-threshold", "0.3"])
            .to_configs()
            .unwrap();
        let PolicyConfig::KvNormalized(c) = scheduler.policy else {
            panic!("expected kv-normalized, got {:?}", scheduler.policy);
        };
        assert_eq!(c.match_rate_threshold, 0.3);
    }

    #[test]
    fn every_session_flag_reaches_its_field() {
        let flags = "--session-affinity false --session-capacity 10 --session-ttl-ms 1500 \
                     --session-margin-ms 20 --session-relative-margin 0.4";
        let (scheduler, _) = parse(&flags.split_whitespace().collect::<Vec<_>>())
            .to_configs()
            .unwrap();
        let expected = scheduler::SessionConfig {
            enabled: false,
            capacity: 10,
            ttl: Duration::from_millis(1500),
            margin_ms: 20.0,
            relative_margin: 0.4,
        };
        assert_eq!(scheduler.sessions, expected);
        let zero = parse(&["--session-capacity", "0"]).to_configs();
        assert!(zero.is_err(), "capacity 0 is refused");
    }
}
