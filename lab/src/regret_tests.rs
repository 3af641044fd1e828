//! Regret tests: through the simulator (one worker, a cold rank against a warm one)
//! and the statistics' arithmetic.

use super::*;
use crate::regret::{RegretSample, RegretStats};
use engine_model::StepWork;
use engine_model::trace::{BlockMapping, TraceRequest};
use kv_events::routing::PolicyKind;
use std::num::NonZeroU64;

fn sampled_config(every: u64) -> SimConfig {
    SimConfig {
        event_lag_ms: 0.0,
        regret_every: NonZeroU64::new(every),
        ..SimConfig::default()
    }
}

fn run(trace: &[TraceRequest], workers: u32, policy: PolicyKind, config: &SimConfig) -> RunResult {
    let prepared = PreparedTrace::new(trace, BlockMapping::new(64).unwrap());
    let setting = Setting {
        workers,
        speedup: Speedup::new(1.0).unwrap(),
    };
    simulate(&prepared, setting, LabPolicy::Scheduler(policy), config).unwrap()
}

fn request(timestamp_ms: u64, hash_ids: Vec<u64>) -> TraceRequest {
    TraceRequest {
        timestamp_ms,
        input_length: 2_000,
        output_length: 4,
        hash_ids,
    }
}

#[test]
fn regret_is_zero_with_one_worker_however_loaded() {
    // 40 requests 5 ms apart: a queue builds up on the one rank, yet it is always the
    // best (the only) choice.
    let trace: Vec<TraceRequest> = (0..40)
        .map(|i| request(i * 5, vec![i % 3, 100 + i]))
        .collect();
    for policy in [PolicyKind::Kv, PolicyKind::RoundRobin] {
        let r = run(&trace, 1, policy, &sampled_config(1));
        let regret = r.regret.expect("sampled");
        assert_eq!(regret.all.decisions, 40);
        assert_eq!(regret.all.mean_ms, 0.0);
        assert_eq!(regret.all.best_share, 1.0);
    }
}

#[test]
fn sending_a_cached_prompt_to_the_cold_rank_costs_its_prefill() {
    // Request 0 warms one rank with 4 blocks; request 1, a minute later, repeats its
    // prompt. kv sends it to the warm rank (regret 0); round-robin sends it to the
    // other, cold rank, whose counterfactual TTFT is the whole prefill instead of the
    // uncached tail's.
    let trace = [
        request(0, vec![1, 2, 3, 4]),
        request(60_000, vec![1, 2, 3, 4]),
    ];
    let config = sampled_config(1);
    let kv = run(&trace, 2, PolicyKind::Kv, &config);
    let rr = run(&trace, 2, PolicyKind::RoundRobin, &config);
    assert_ne!(
        rr.records[0].worker, rr.records[1].worker,
        "round-robin alternates"
    );
    assert_eq!(
        kv.records[0].worker, kv.records[1].worker,
        "kv follows the cache"
    );
    let (kv, rr) = (kv.regret.expect("sampled"), rr.regret.expect("sampled"));
    assert_eq!((kv.all.decisions, rr.all.decisions), (2, 2));
    assert_eq!(kv.all.mean_ms, 0.0, "kv picked a best rank each time");
    // Cold: 2,000 tokens; warm: 1,984 cached (31 blocks), 16 tokens computed.
    let step = |tokens| {
        config.timing.step_duration_ms(&StepWork {
            prefill_tokens: tokens,
            ..StepWork::default()
        })
    };
    let expected = step(2_000) - step(16);
    let worst = rr.all.p99_ms;
    assert!((worst - expected).abs() < 1e-3, "{worst} vs {expected}");
    assert!(rr.all.mean_ms > kv.all.mean_ms);
    assert_eq!(rr.all.best_share, 0.5);
}

#[test]
fn sampling_every_n_takes_every_nth_request_changes_nothing_else_and_is_off_by_default() {
    let trace: Vec<TraceRequest> = (0..10).map(|i| request(i * 1_000, vec![i])).collect();
    let sampled = run(&trace, 2, PolicyKind::Kv, &sampled_config(3));
    // Requests 0, 3, 6, 9.
    assert_eq!(sampled.regret.expect("sampled").all.decisions, 4);
    let plain = run(&trace, 2, PolicyKind::Kv, &sampled_config(0));
    assert_eq!(plain.regret, None);
    // The counterfactual copies leave the run itself untouched.
    assert_eq!(sampled.records, plain.records);
    assert_eq!(sampled.steps, plain.steps);
}

#[test]
fn statistics_bucket_samples_and_share_the_regret() {
    let sample = |prompt_tokens, overlap_share, regret_ms: u64| RegretSample {
        prompt_tokens,
        overlap_share,
        load_per_rank: 2.0,
        regret_ns: regret_ms * 1_000_000,
    };
    let mut samples: Vec<RegretSample> = (0..98).map(|_| sample(500, 0.0, 0)).collect();
    samples.push(sample(5_000, 0.6, 30));
    samples.push(sample(20_000, 1.0, 70));
    let stats = RegretStats::of(&samples, 2).expect("samples");
    assert_eq!(stats.sample_every, 2);
    assert_eq!(stats.all.decisions, 100);
    assert!((stats.all.mean_ms - 1.0).abs() < 1e-9);
    assert_eq!(stats.all.p99_ms, 30.0, "nearest rank: the 99th of 100");
    assert!((stats.all.best_share - 0.98).abs() < 1e-9);
    let bucket = |dimension: &str, bucket: &str| {
        stats
            .buckets
            .iter()
            .find(|b| b.dimension == dimension && b.bucket == bucket)
            .map(|b| (b.figures.decisions, b.figures.regret_share))
    };
    assert_eq!(bucket("prompt_tokens", "<1k"), Some((98, 0.0)));
    assert_eq!(bucket("prompt_tokens", "4k-16k"), Some((1, 0.3)));
    assert_eq!(bucket("prompt_tokens", ">=16k"), Some((1, 0.7)));
    assert_eq!(
        bucket("prompt_tokens", "1k-4k"),
        None,
        "empty buckets are left out"
    );
    assert_eq!(bucket("predicted_overlap", "0"), Some((98, 0.0)));
    assert_eq!(bucket("predicted_overlap", "50-90%"), Some((1, 0.3)));
    assert_eq!(bucket("predicted_overlap", ">=90%"), Some((1, 0.7)));
    assert_eq!(bucket("load_per_rank", "1-4"), Some((100, 1.0)));
    assert_eq!(RegretStats::of(&[], 1), None);
}
