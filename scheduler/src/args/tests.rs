//! The scheduler's flags: defaults match the scheduler's, every flag reaches its
//! field, and a knob given for a policy without it names the flag.
#![allow(clippy::unwrap_used)]

use super::*;
use crate::{CalibrationConfig, PolicyConfig};
use kv_cluster::args::parse_flags;

fn parse(args: &[&str]) -> SchedulerArgs {
    parse_flags::<SchedulerArgs, _, _>(std::iter::once("kv-router").chain(args.iter().copied()))
        .expect("flags parse")
}

#[test]
fn defaults_are_predicted_ttft_with_documented_knobs_and_no_busy_thresholds() {
    let scheduler = parse(&[]).to_config().unwrap();
    assert_eq!(scheduler.policy, PolicyConfig::default());
    assert_eq!(scheduler.sequences, SequencesConfig::default());
    assert_eq!(scheduler.busy, BusyThresholds::default());
    assert_eq!(scheduler.liveness, crate::LivenessConfig::default());
    assert_eq!(scheduler.sessions, crate::SessionConfig::default());
}

#[test]
fn every_flag_reaches_its_field() {
    let scheduler = parse(&[
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
        "--metrics-interval-ms",
        "50",
        "--metrics-quiet-intervals",
        "2",
        "--metrics-silent-intervals",
        "5",
        "--metrics-liveness",
        "false",
    ])
    .to_config()
    .unwrap();
    assert_eq!(
        scheduler.policy,
        PolicyConfig::KvNormalized(crate::KvNormalizedConfig {
            load_balance_weight: 0.5,
            match_rate_threshold: 0.2,
            fair_share_multiplier: 3.0,
            temperature: 0.1,
        })
    );
    assert_eq!(
        scheduler.liveness,
        crate::LivenessConfig {
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

    let scheduler = parse(&[
        "--policy",
        "cache-aware-threshold",
        "--cache-threshold",
        "0.5",
        "--balance-abs-threshold",
        "8",
        "--balance-rel-threshold",
        "1.1",
    ])
    .to_config()
    .unwrap();
    assert_eq!(
        scheduler.policy,
        PolicyConfig::CacheAwareThreshold(crate::CacheAwareThresholdConfig {
            cache_threshold: 0.5,
            balance_abs_threshold: 8,
            balance_rel_threshold: 1.1,
        })
    );
    // The old flag name still sets the kv weight.
    let scheduler = parse(&[
        "--policy",
        "kv",
        "--overlap-weight",
        "2",
        "--overlap-credit",
        "0.5",
        "--lower-tier-credit",
        "0.25",
    ])
    .to_config()
    .unwrap();
    assert_eq!(
        scheduler.policy,
        PolicyConfig::Kv(crate::KvPolicyConfig {
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
        .to_config()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid --temperature: applies to policy kv and kv-normalized, not round-robin"
    );
    let err = parse(&["--cache-threshold", "0.5"])
        .to_config()
        .unwrap_err();
    assert!(err.to_string().contains("--cache-threshold"), "{err}");
    let err = parse(&["--policy", "kv", "--prefill-load-scale", "-1"])
        .to_config()
        .unwrap_err();
    assert!(err.to_string().contains("prefill_load_scale"), "{err}");
    let err = parse(&["--policy", "kv", "--reuse-credit", "3"])
        .to_config()
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
    .to_config()
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid --match-rate-threshold: applies to policy kv-normalized and \
         predicted-ttft, not cache-aware-threshold"
    );
    let err = parse(&["--match-rate-threshold", "1.5"])
        .to_config()
        .unwrap_err();
    assert!(err.to_string().contains("min_match_ratio"), "{err}");
    let err = parse(&["--max-num-batched-tokens", "0"])
        .to_config()
        .unwrap_err();
    assert!(err.to_string().contains("max_num_batched_tokens"), "{err}");
    let err = parse(&["--request-ttl-ms", "0"]).to_config().unwrap_err();
    assert!(err.to_string().contains("--request-ttl-ms"), "{err}");
    let err = parse(&["--busy-decode-blocks", "0"])
        .to_config()
        .unwrap_err();
    assert!(err.to_string().contains("busy.decode_blocks"), "{err}");
    assert!(
        parse_flags::<SchedulerArgs, _, _>(["kv-router", "--busy-decode-blocks", "lots"]).is_err()
    );
    assert!(parse_flags::<SchedulerArgs, _, _>(["kv-router", "--policy", "best"]).is_err());
}

#[test]
fn predicted_ttft_knobs_reach_timing_and_credit() {
    use crate::policy::delay_cap::DelayCap;
    use crate::policy::predicted_ttft::{PredictedTtftConfig, ReuseCredit, StepTimeModel};
    let scheduler = parse(&[
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
    .to_config()
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
    let scheduler = parse(&["--policy", "kv-normalized", "--match-rate-threshold", "0.3"])
        .to_config()
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
    let scheduler = parse(&flags.split_whitespace().collect::<Vec<_>>())
        .to_config()
        .unwrap();
    let expected = crate::SessionConfig {
        enabled: false,
        capacity: 10,
        ttl: Duration::from_millis(1500),
        margin_ms: 20.0,
        relative_margin: 0.4,
    };
    assert_eq!(scheduler.sessions, expected);
    let zero = parse(&["--session-capacity", "0"]).to_config();
    assert!(zero.is_err(), "capacity 0 is refused");
}

#[test]
fn calibration_defaults_match_the_scheduler_and_every_flag_reaches_its_field() {
    let defaults = parse_flags::<CalibrationArgs, _, _>(["kv-router"]).expect("no flags");
    assert_eq!(defaults.to_config(), CalibrationConfig::default());
    let flags = "kv-router --calibration false --calibration-forgetting 0.98 \
                 --calibration-max-factor 5 --calibration-outlier-ratio 3 \
                 --calibration-warmup-samples 7 --calibration-max-queue-steps 2";
    let set = parse_flags::<CalibrationArgs, _, _>(flags.split_whitespace()).expect("flags");
    let expected = CalibrationConfig {
        enabled: false,
        forgetting: 0.98,
        max_factor: 5.0,
        outlier_ratio: 3.0,
        warmup_samples: 7,
        max_queue_steps: 2,
    };
    assert_eq!(set.to_config(), expected);
}

#[test]
fn disaggregation_defaults_match_the_scheduler_and_the_flags_reach_their_fields() {
    assert_eq!(
        parse(&[]).to_config().unwrap().disaggregation,
        crate::DisaggregationConfig::default()
    );
    let flags = "--disagg-max-local-prefill-tokens 256 --disagg-min-decode-overlap 0.5";
    let scheduler = parse(&flags.split_whitespace().collect::<Vec<_>>())
        .to_config()
        .unwrap();
    let expected = crate::DisaggregationConfig {
        max_local_prefill_tokens: 256,
        min_decode_overlap: 0.5,
    };
    assert_eq!(scheduler.disaggregation, expected);
    let err = parse(&["--disagg-min-decode-overlap", "-0.5"])
        .to_config()
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("disaggregation.min_decode_overlap"),
        "{err}"
    );
}
