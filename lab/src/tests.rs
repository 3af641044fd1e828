//! Lab tests on small generated traces (and a slice of the bundled excerpt): timing,
//! chunked prefill and prefix reuse through the simulator, eviction, determinism,
//! event lag, the oracle bound, refusals, the report's JSON shape and the charts.

use super::*;
use engine_model::StepWork;
use engine_model::trace::{self, BlockMapping, TraceRequest};
use kv_events::routing::PolicyKind;

/// `sessions` conversations of `turns` turns each; turn `k` of session `s` repeats the
/// session's earlier blocks and adds one: `k + 2` trace blocks, the last partial.
/// Turns arrive round-robin over sessions, `gap_ms` apart.
fn conversations(sessions: u64, turns: u64, gap_ms: u64) -> Vec<TraceRequest> {
    let mut trace = Vec::new();
    for k in 0..turns {
        for s in 0..sessions {
            trace.push(TraceRequest {
                timestamp_ms: (k * sessions + s) * gap_ms,
                input_length: (k + 2) * 512 - 100,
                output_length: 8,
                hash_ids: (0..k + 2).map(|b| s * 1_000 + b).collect(),
            });
        }
    }
    trace
}

fn prepared(trace: &[TraceRequest]) -> PreparedTrace {
    PreparedTrace::new(trace, BlockMapping::new(64).unwrap())
}

fn setting(workers: u32, speedup: f64) -> Setting {
    Setting {
        workers,
        speedup: Speedup::new(speedup).unwrap(),
    }
}

fn config(event_lag_ms: f64, seed: u64) -> SimConfig {
    SimConfig {
        event_lag_ms,
        seed,
        ..SimConfig::default()
    }
}

fn run(trace: &PreparedTrace, workers: u32, policy: LabPolicy, config: &SimConfig) -> RunResult {
    simulate(trace, setting(workers, 1.0), policy, config).unwrap()
}

const KV: LabPolicy = LabPolicy::Scheduler(PolicyKind::Kv);

#[test]
fn a_lone_request_takes_exactly_the_timing_model() {
    let trace = [TraceRequest {
        timestamp_ms: 1_000,
        input_length: 1_000,
        output_length: 3,
        hash_ids: vec![1, 2],
    }];
    let config = config(0.0, 1);
    let r = run(&prepared(&trace), 1, KV, &config);
    let t = config.timing;
    let prefill = t.step_duration_ms(&StepWork {
        prefill_tokens: 1_000,
        ..StepWork::default()
    });
    let decode = |context: u64| {
        t.step_duration_ms(&StepWork {
            prefill_tokens: 0,
            decode_seqs: 1,
            decode_context_tokens: context,
        })
    };
    let rec = r.records[0];
    let ms = |ns: u64| ns as f64 / 1e6;
    assert_eq!(rec.arrival_ns, 1_000_000_000);
    assert!((ms(rec.first_token_ns.unwrap() - rec.arrival_ns) - prefill).abs() < 1e-6);
    // Two decode steps after the first token, reading 1,001 then 1,002 tokens of KV.
    let e2e = prefill + decode(1_001) + decode(1_002);
    assert!((ms(rec.finish_ns.unwrap() - rec.arrival_ns) - e2e).abs() < 1e-5);
    assert_eq!((rec.output_tokens, rec.cached_tokens), (3, 0));
    assert_eq!(r.steps, 3);
}

#[test]
fn chunked_prefill_then_prefix_reuse_through_the_simulator() {
    // 2,048 tokens at a 512-token budget: 4 prefill steps. The same prompt again, after
    // the first finished: block-aligned, so as in vLLM 31 of its 32 blocks hit and the
    // last block (64 tokens, the one holding the last prompt token) is computed again.
    let trace = [
        TraceRequest {
            timestamp_ms: 0,
            input_length: 2_048,
            output_length: 1,
            hash_ids: vec![7, 8, 9, 10],
        },
        TraceRequest {
            timestamp_ms: 60_000,
            input_length: 2_048,
            output_length: 1,
            hash_ids: vec![7, 8, 9, 10],
        },
    ];
    let mut config = config(0.0, 1);
    config.engine.max_num_batched_tokens = 512;
    let r = run(&prepared(&trace), 1, KV, &config);
    let chunk = config.timing.step_duration_ms(&StepWork {
        prefill_tokens: 512,
        ..StepWork::default()
    });
    let ttft =
        |i: usize| (r.records[i].first_token_ns.unwrap() - r.records[i].arrival_ns) as f64 / 1e6;
    assert!((ttft(0) - 4.0 * chunk).abs() < 1e-6, "{}", ttft(0));
    assert_eq!(r.records[1].cached_tokens, 2_048 - 64);
    let last_block = config.timing.step_duration_ms(&StepWork {
        prefill_tokens: 64,
        ..StepWork::default()
    });
    assert!((ttft(1) - last_block).abs() < 1e-6, "{}", ttft(1));
    assert_eq!(r.steps, 5);
}

#[test]
fn a_small_cache_evicts_from_the_tail_and_loses_hits() {
    // Sessions 0 and 1 (924 tokens: 14 full blocks each), then both again with one more
    // trace block (1,436 tokens, 22 full blocks). A big cache keeps everything: each
    // second turn hits its 14 blocks. With 24 blocks, session 1's first turn (15
    // blocks reserved) evicts the last 5 blocks of session 0, so session 0's second
    // turn hits only 9 blocks, and then evicts most of session 1.
    let trace = conversations(2, 2, 30_000);
    let mut small = config(0.0, 1);
    small.engine.num_gpu_blocks = 24;
    let big = config(0.0, 1);
    let cached = |c: &SimConfig| {
        let r = run(&prepared(&trace), 1, KV, c);
        r.records
            .iter()
            .map(|x| x.cached_tokens)
            .collect::<Vec<_>>()
    };
    assert_eq!(cached(&big), vec![0, 0, 14 * 64, 14 * 64]);
    let small_hits = cached(&small);
    assert_eq!(small_hits[..3], [0, 0, 9 * 64]);
    assert!(small_hits[3] < 14 * 64, "{small_hits:?}");
}

#[test]
fn simulation_is_deterministic_under_a_seed() {
    let trace = prepared(&conversations(12, 4, 40));
    for policy in [
        KV,
        LabPolicy::Scheduler(PolicyKind::Random),
        LabPolicy::Scheduler(PolicyKind::PredictedTtft),
    ] {
        let a = run(&trace, 4, policy, &config(5.0, 9));
        let b = run(&trace, 4, policy, &config(5.0, 9));
        assert_eq!(a, b, "{}", policy.name());
    }
    // Another seed changes the random policy's choices.
    let random = LabPolicy::Scheduler(PolicyKind::Random);
    let a = run(&trace, 4, random, &config(5.0, 9));
    let c = run(&trace, 4, random, &config(5.0, 10));
    let workers = |r: &RunResult| r.records.iter().map(|x| x.worker).collect::<Vec<_>>();
    assert_ne!(workers(&a), workers(&c));
}

#[test]
fn stale_kv_events_cost_cache_hits() {
    // Turns 2 s apart per session: each turn has finished before the next arrives.
    let trace = prepared(&conversations(8, 6, 250));
    let hit = |lag_ms: f64| {
        run(&trace, 4, KV, &config(lag_ms, 3))
            .metrics(4)
            .hit_rate
            .unwrap()
    };
    let fresh = hit(0.0);
    let stale = hit(1e9);
    assert!(fresh > stale + 0.15, "fresh {fresh}, stale {stale}");
    // The index never refuses an event delivered in order.
    assert_eq!(run(&trace, 4, KV, &config(50.0, 3)).refused_events, 0);
}

#[test]
fn no_policy_beats_the_oracle_bound() {
    let mut trace = trace::bundled_excerpt().unwrap();
    trace.truncate(150);
    trace.extend(conversations(4, 3, 10).into_iter().map(|mut r| {
        r.timestamp_ms += 200_000;
        r
    }));
    let prepared = prepared(&trace);
    let bound = oracle_bound(&prepared).hit_rate;
    assert!(bound > 0.0);
    for policy in LabPolicy::all_scheduler() {
        let m = run(&prepared, 2, policy, &config(0.0, 1)).metrics(2);
        let hit = m.hit_rate.unwrap();
        assert!(hit <= bound + 1e-12, "{}: {hit} > {bound}", policy.name());
        assert_eq!(m.completed, prepared.len() as u64, "{}", policy.name());
    }
}

#[test]
fn oversized_requests_are_rejected_and_counted() {
    let mut trace = conversations(2, 1, 10);
    trace.push(TraceRequest {
        timestamp_ms: 100,
        input_length: 5_000,
        output_length: 1,
        hash_ids: (0..10).collect(),
    });
    let mut c = config(0.0, 1);
    c.engine.num_gpu_blocks = 50; // 5,000 tokens need 79 blocks
    let m = run(&prepared(&trace), 2, KV, &c).metrics(2);
    assert_eq!((m.completed, m.rejected), (2, 1));
}

#[test]
fn mismatched_block_size_and_bad_settings_are_errors() {
    let trace = prepared(&conversations(1, 1, 1));
    let mut c = config(0.0, 1);
    c.engine.block_size = 128;
    assert!(matches!(
        simulate(&trace, setting(1, 1.0), KV, &c),
        Err(LabError::BlockSizeMismatch { .. })
    ));
    assert!(matches!(
        simulate(&trace, setting(0, 1.0), KV, &config(0.0, 1)),
        Err(LabError::NoWorkers)
    ));
    assert!(matches!(
        simulate(&trace, setting(1, 1.0), KV, &config(-1.0, 1)),
        Err(LabError::EventLag(_))
    ));
}

fn small_sweep(jobs: usize) -> Sweep {
    Sweep {
        settings: vec![setting(2, 1.0), setting(2, 2.0), setting(3, 1.0)],
        policies: vec![KV, LabPolicy::Scheduler(PolicyKind::PredictedTtft)],
        config: config(5.0, 4),
        jobs,
    }
}

#[test]
fn sweep_results_do_not_depend_on_threads() {
    let trace = prepared(&conversations(6, 3, 100));
    let hidden = indicatif::ProgressBar::hidden();
    let strip = |mut runs: Vec<RunReport>| {
        for r in &mut runs {
            r.wall_ms = 0.0;
        }
        runs
    };
    let one = strip(run_sweep(&trace, &small_sweep(1), &hidden).unwrap());
    let two = strip(run_sweep(&trace, &small_sweep(2), &hidden).unwrap());
    assert_eq!(one, two);
    assert_eq!(one.len(), 6);
    assert_eq!(one[1].policy, "predicted-ttft");
    assert_eq!(one[2].setting, setting(2, 2.0));
}

#[test]
fn report_json_has_the_documented_shape_and_charts_are_pngs() {
    let trace = prepared(&conversations(6, 3, 100));
    let hidden = indicatif::ProgressBar::hidden();
    let report = run_lab_with(&trace, "generated", &small_sweep(2), &hidden).unwrap();
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["trace"]["name"], "generated");
    assert_eq!(json["trace"]["requests"], 18);
    assert_eq!(json["config"]["block_size"], 64);
    assert_eq!(json["config"]["event_lag_ms"], 5.0);
    assert!(json["config"]["timing"]["prefill_ms_per_token"].is_number());
    assert!(json["oracle"]["hit_rate"].as_f64().unwrap() > 0.0);
    let runs = json["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 6);
    let run = &runs[0];
    assert_eq!(
        (run["workers"].as_u64(), run["speedup"].as_f64()),
        (Some(2), Some(1.0))
    );
    assert_eq!(run["policy"], "kv");
    for key in [
        "requests",
        "completed",
        "rejected",
        "steps",
        "refused_events",
    ] {
        assert!(run[key].is_u64(), "{key}");
    }
    for key in [
        "hit_rate",
        "throughput_tokens_per_s",
        "throughput_requests_per_s",
        "wall_ms",
    ] {
        assert!(run[key].is_number(), "{key}");
    }
    for stat in ["ttft_ms", "itl_ms", "e2e_ms"] {
        for q in ["mean", "p50", "p90", "p99"] {
            assert!(run[stat][q].is_number(), "{stat}.{q}");
        }
    }
    assert_eq!(
        run["ttft_cdf_ms"].as_array().unwrap().len(),
        metrics::CDF_POINTS
    );
    assert_eq!(run["requests_per_worker"].as_array().unwrap().len(), 2);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nested/report.json");
    report.write_json(&path).unwrap();
    let back: LabReport = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(back.trace, report.trace);
    assert_eq!(back.runs.len(), report.runs.len());
    for (a, b) in back.runs.iter().zip(&report.runs) {
        assert_eq!(
            (&a.policy, a.setting, a.metrics.completed),
            (&b.policy, b.setting, b.metrics.completed)
        );
        assert!((a.metrics.hit_rate.unwrap() - b.metrics.hit_rate.unwrap()).abs() < 1e-12);
    }
    assert!(report.render_table().contains("predicted-ttft"));

    let charts = charts::write_charts(&report, dir.path()).unwrap();
    assert_eq!(charts.len(), charts::CHART_FILES.len());
    for chart in charts {
        let bytes = std::fs::read(&chart).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{}", chart.display());
    }
}

#[test]
fn an_empty_sweep_is_an_error() {
    let trace = prepared(&conversations(1, 1, 1));
    let hidden = indicatif::ProgressBar::hidden();
    let mut sweep = small_sweep(1);
    sweep.policies.clear();
    assert!(matches!(
        run_lab_with(&trace, "x", &sweep, &hidden),
        Err(LabError::NoWorkers)
    ));
}
