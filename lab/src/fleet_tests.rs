//! Fleet flags, their validation, and per-worker speed through the simulator.

use super::*;
use crate::config::{LabPolicy, Setting, SimConfig, Speedup};
use crate::sim::{PreparedTrace, simulate};
use clap::Parser;
use engine_model::trace::{BlockMapping, TraceRequest};
use kv_events::routing::PolicyKind;

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    fleet: SimulatedFleetArgs,
}

fn parse(args: &[&str]) -> Result<SimulatedFleetArgs, clap::Error> {
    Cli::try_parse_from(std::iter::once("lab").chain(args.iter().copied())).map(|c| c.fleet)
}

fn f(v: f64) -> Factor {
    Factor::new(v).expect("valid test factor")
}

#[test]
fn factors_must_be_finite_and_positive() {
    assert_eq!("0.5".parse::<Factor>().map(Factor::get), Ok(0.5));
    assert_eq!(" 4 ".parse::<Factor>().map(Factor::get), Ok(4.0));
    for bad in ["0", "-1", "inf", "NaN", "x", ""] {
        assert!(bad.parse::<Factor>().is_err(), "{bad:?} accepted");
    }
    assert!(matches!(Factor::new(0.0), Err(LabError::Factor(_))));
}

#[test]
fn defaults_are_the_router_constants_on_every_worker() {
    let args = parse(&[]).expect("no flags");
    assert_eq!(args.timing(), TimingModel::H100_8B);
    assert_eq!(args.speeds(), WorkerSpeeds::Uniform);
    assert_eq!(
        args.speeds()
            .for_workers(3)
            .expect("uniform fits any count"),
        vec![Factor::ONE; 3]
    );
}

#[test]
fn worker_speed_list_parses_and_must_match_the_workers() {
    let args = parse(&["--worker-speed", "1,1,1,1,0.5,0.5,0.5,0.5"]).expect("valid list");
    let speeds = args.speeds();
    let per_worker = speeds
        .for_workers(8)
        .expect("eight speeds for eight workers");
    assert_eq!(per_worker[3], f(1.0));
    assert_eq!(per_worker[4], f(0.5));
    let err = speeds
        .for_workers(4)
        .expect_err("eight speeds for four workers");
    assert!(matches!(
        err,
        LabError::WorkerSpeedCount {
            given: 8,
            workers: 4
        }
    ));
    assert!(err.to_string().contains("8 speeds"), "{err}");
    // One value applies to every worker.
    let all = parse(&["--worker-speed", "4"]).expect("one speed");
    assert_eq!(all.speeds(), WorkerSpeeds::All(f(4.0)));
    assert_eq!(all.speeds().for_workers(16).expect("any count")[15], f(4.0));
    for bad in ["1,0", "1,-0.5", "1,inf", "1,,1", "fast"] {
        assert!(parse(&["--worker-speed", bad]).is_err(), "{bad:?} accepted");
    }
}

#[test]
fn half_slow_preset_slows_the_second_half() {
    let args = parse(&["--fleet", "half-slow"]).expect("valid preset");
    let speeds = args.speeds().for_workers(8).expect("fits any count");
    assert_eq!(speeds[..4], [Factor::ONE; 4]);
    assert_eq!(speeds[4..], [f(HALF_SLOW_SPEED); 4]);
    // An odd count rounds the fast half up.
    let odd = args.speeds().for_workers(5).expect("fits any count");
    assert_eq!(odd.iter().filter(|s| **s == Factor::ONE).count(), 3);
    assert!(parse(&["--fleet", "half-slow", "--worker-speed", "1"]).is_err());
    assert!(parse(&["--fleet", "fast-and-furious"]).is_err());
}

#[test]
fn shape_factors_scale_one_constant_each() {
    let args = parse(&[
        "--engine-prefill-factor",
        "2",
        "--engine-step-base-factor",
        "0.25",
    ])
    .expect("valid factors");
    let t = args.timing();
    let base = TimingModel::H100_8B;
    assert_eq!(t.prefill_ms_per_token, base.prefill_ms_per_token * 2.0);
    assert_eq!(t.step_base_ms, base.step_base_ms * 0.25);
    assert_eq!(t.decode_ms_per_seq, base.decode_ms_per_seq);
    assert_eq!(t.kv_read_ms_per_token, base.kv_read_ms_per_token);
    for flag in ["--engine-prefill-factor", "--engine-step-base-factor"] {
        assert!(parse(&[flag, "0"]).is_err(), "{flag} 0 accepted");
        assert!(parse(&[flag, "-2"]).is_err(), "{flag} -2 accepted");
    }
}

#[test]
fn dynamo_preset_matches_its_source_at_a_full_chunk() {
    let args = parse(&["--engine-preset", "dynamo-polynomial"]).expect("valid preset");
    assert_eq!(args.timing(), DYNAMO_POLYNOMIAL);
    // Dynamo's polynomial for an 8,192-token prefill batch, in ms.
    let x = 8_192.0_f64;
    let polynomial = 4.209989e-7 * x * x + 1.518344e-2 * x + 16.50142;
    let ours = DYNAMO_POLYNOMIAL.step_duration_ms(&engine_model::StepWork {
        prefill_tokens: 8_192,
        ..Default::default()
    });
    assert!((ours - polynomial).abs() < 0.5, "{ours} vs {polynomial}");
    assert_eq!(EnginePreset::DynamoPolynomial.name(), "dynamo-polynomial");
}

#[test]
fn half_speed_doubles_every_step() {
    let work = engine_model::StepWork {
        prefill_tokens: 1_000,
        decode_seqs: 3,
        decode_context_tokens: 5_000,
    };
    let t = TimingModel::H100_8B;
    let slow = at_speed(t, f(0.5));
    assert!((slow.step_duration_ms(&work) - 2.0 * t.step_duration_ms(&work)).abs() < 1e-9);
    let fast = at_speed(t, f(4.0));
    assert!((fast.step_duration_ms(&work) - t.step_duration_ms(&work) / 4.0).abs() < 1e-9);
}

/// Two requests far apart, routed round-robin over two workers, the second at half
/// speed: the same prompt takes exactly twice as long to its first and last token there.
#[test]
fn a_worker_at_half_speed_takes_twice_as_long_in_the_simulator() {
    let request = |at_ms: u64, block: u64| TraceRequest {
        timestamp_ms: at_ms,
        input_length: 3_000,
        output_length: 4,
        hash_ids: vec![block, block + 1, block + 2, block + 3, block + 4, block + 5],
    };
    let trace = PreparedTrace::new(
        &[request(0, 100), request(60_000, 200)],
        BlockMapping::new(64).expect("valid block size"),
    );
    let config = SimConfig {
        speeds: WorkerSpeeds::PerWorker(vec![f(1.0), f(0.5)]),
        event_lag_ms: 0.0,
        ..SimConfig::default()
    };
    let setting = Setting {
        workers: 2,
        speedup: Speedup::new(1.0).expect("valid speed-up"),
    };
    let run = simulate(
        &trace,
        setting,
        LabPolicy::Scheduler(PolicyKind::RoundRobin),
        &config,
    )
    .expect("valid run");
    let ttft = |i: usize| {
        let r = run.records[i];
        (r.first_token_ns.expect("served") - r.arrival_ns) as f64
    };
    let e2e = |i: usize| {
        let r = run.records[i];
        (r.finish_ns.expect("finished") - r.arrival_ns) as f64
    };
    let (fast, slow) = match (run.records[0].worker, run.records[1].worker) {
        (Some(0), Some(1)) => (0, 1),
        (Some(1), Some(0)) => (1, 0),
        other => panic!("round robin should use both workers, got {other:?}"),
    };
    // Whole-ns rounding per step: within a few ns of exactly 2x.
    assert!(
        (ttft(slow) - 2.0 * ttft(fast)).abs() <= 2.0,
        "{} {}",
        ttft(slow),
        ttft(fast)
    );
    assert!(
        (e2e(slow) - 2.0 * e2e(fast)).abs() <= 8.0,
        "{} {}",
        e2e(slow),
        e2e(fast)
    );
    // A list of the wrong length is refused before anything runs.
    let three = Setting {
        workers: 3,
        ..setting
    };
    assert!(matches!(
        simulate(
            &trace,
            three,
            LabPolicy::Scheduler(PolicyKind::RoundRobin),
            &config
        ),
        Err(LabError::WorkerSpeedCount { .. })
    ));
}

#[test]
fn a_cpu_tier_serves_an_evicted_prompt_and_its_events_are_indexed() {
    let fleet = parse(&["--cpu-tier-blocks", "64", "--tier-pricing", "off"]).expect("parses");
    assert_eq!(fleet.cpu_tier.cpu_tier_blocks, 64);
    assert_eq!(fleet.tier_pricing, TierPricing::Off);
    assert_eq!(parse(&[]).expect("parses").cpu_tier.cpu_tier_blocks, 0);
    // Prompts of 3,000 tokens (46 full engine blocks, a 47-block footprint) on one
    // rank of 60 blocks: B evicts most of A, then A comes again.
    let request = |timestamp_ms, block| TraceRequest {
        timestamp_ms,
        input_length: 3_000,
        output_length: 4,
        hash_ids: (block..block + 6).collect(),
    };
    let trace = PreparedTrace::new(
        &[request(0, 100), request(60_000, 200), request(120_000, 100)],
        BlockMapping::new(64).expect("valid block size"),
    );
    let setting = Setting {
        workers: 1,
        speedup: Speedup::new(1.0).expect("valid speed-up"),
    };
    let run = |cpu_tier_blocks| {
        let mut config = SimConfig::default();
        config.engine.num_gpu_blocks = 60;
        config.cpu_tier.cpu_tier_blocks = cpu_tier_blocks;
        let policy = LabPolicy::Scheduler(PolicyKind::PredictedTtft);
        let run = simulate(&trace, setting, policy, &config).expect("valid run");
        assert_eq!(run.refused_events, 0, "the index takes every tier's events");
        let again = run.records[2];
        (again.cached_tokens / 64, again.loaded_tokens / 64)
    };
    let (gpu_only, _) = run(0);
    assert!(gpu_only < 46, "B evicted part of A ({gpu_only} blocks hit)");
    assert_eq!(run(0), (gpu_only, 0));
    assert_eq!(
        run(128),
        (46, 46 - gpu_only),
        "the rest comes back from the CPU"
    );
}
