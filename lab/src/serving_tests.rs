//! Split fleets: roles and transfer time, and the two halves of a disaggregated
//! request through the simulator (TTFT = prefill + transfer + the decode rank's
//! admission step; a prefix the decode rank holds is not transferred; bookings of
//! both halves released).

use super::*;
use crate::config::{LabPolicy, Setting, SimConfig, Speedup};
use crate::sim::{PreparedTrace, RunResult, simulate};
use engine_model::trace::{BlockMapping, TraceRequest};
use engine_model::{KvTransferConfig, StepWork};
use kv_events::routing::PolicyKind;

#[test]
fn roles_put_the_prefill_engines_first_and_need_both_sides() {
    let split = |prefill_engines, mode| {
        Serving::Split(SplitFleet {
            prefill_engines,
            mode,
        })
    };
    let s = split(2, SplitMode::Conditional);
    let roles = s.roles(5).unwrap();
    assert_eq!(roles[..2], [WorkerRole::Prefill; 2]);
    assert_eq!(roles[2..], [WorkerRole::Decode; 3]);
    assert_eq!(s.label(5), "conditional 2P+3D");
    assert_eq!(Serving::Aggregated.roles(3).unwrap(), [WorkerRole::Both; 3]);
    assert_eq!(Serving::Aggregated.label(3), "aggregated");
    for bad in [0, 5, 6] {
        let err = split(bad, SplitMode::Disaggregated).roles(5).unwrap_err();
        assert!(matches!(err, LabError::Split { .. }), "{bad}: {err}");
    }
}

fn split(prefill_engines: u32, mode: SplitMode) -> Serving {
    Serving::Split(SplitFleet {
        prefill_engines,
        mode,
    })
}

fn config(serving: Serving) -> SimConfig {
    SimConfig {
        event_lag_ms: 0.0,
        serving,
        // 0.25 ms per 64-token block.
        transfer: KvTransferConfig {
            transfer_ms_per_token: 0.25 / 64.0,
        },
        ..SimConfig::default()
    }
}

fn run(trace: &[TraceRequest], workers: u32, config: &SimConfig) -> RunResult {
    let prepared = PreparedTrace::new(trace, BlockMapping::new(64).unwrap());
    let setting = Setting {
        workers,
        speedup: Speedup::new(1.0).unwrap(),
    };
    simulate(
        &prepared,
        setting,
        LabPolicy::Scheduler(PolicyKind::PredictedTtft),
        config,
    )
    .unwrap()
}

/// A 1,000-token prompt (15 full 64-token blocks and a partial one), 3 output tokens.
fn prompt(timestamp_ms: u64) -> TraceRequest {
    TraceRequest {
        timestamp_ms,
        input_length: 1_000,
        output_length: 3,
        hash_ids: vec![1, 2],
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn ttft(r: &RunResult, i: usize) -> f64 {
    let rec = r.records[i];
    ms(rec.first_token_ns.unwrap() - rec.arrival_ns)
}

fn step(prefill_tokens: u64, decode_seqs: u64, decode_context_tokens: u64) -> f64 {
    SimConfig::default().timing.step_duration_ms(&StepWork {
        prefill_tokens,
        decode_seqs,
        decode_context_tokens,
    })
}

#[test]
fn a_disaggregated_ttft_is_prefill_then_transfer_then_the_decode_step() {
    let c = config(split(1, SplitMode::Disaggregated));
    let r = run(&[prompt(1_000)], 2, &c);
    let rec = r.records[0];
    assert_eq!((rec.prefill_worker, rec.worker), (Some(0), Some(1)));
    assert_eq!(
        rec.transferred_blocks, 16,
        "every block, the partial one too"
    );
    // The prefill rank computes the prompt; 16 blocks move at 0.25 ms each; the decode
    // rank's admission step recomputes the last token only (the KV arrived) and
    // emits the first token.
    let want = step(1_000, 0, 0) + 16.0 * 0.25 + step(1, 0, 0);
    assert!(
        (ttft(&r, 0) - want).abs() < 1e-5,
        "{} vs {want}",
        ttft(&r, 0)
    );
    // Then two decode steps on the decode rank, as on an aggregated engine.
    let decode = ms(rec.finish_ns.unwrap() - rec.first_token_ns.unwrap());
    assert!((decode - step(0, 1, 1_001) - step(0, 1, 1_002)).abs() < 1e-5);
    assert_eq!((rec.output_tokens, rec.cached_tokens), (3, 0));
    assert_eq!(r.open_bookings, 0);
    // Aggregated, the same request takes the prefill alone.
    let agg = run(&[prompt(1_000)], 2, &config(Serving::Aggregated));
    assert!((ttft(&agg, 0) - step(1_000, 0, 0)).abs() < 1e-5);
    assert_eq!(agg.records[0].prefill_worker, None);
}

#[test]
fn a_prefix_held_by_the_decode_engine_is_not_transferred() {
    let c = config(split(1, SplitMode::Disaggregated));
    let r = run(&[prompt(0), prompt(60_000)], 2, &c);
    let again = r.records[1];
    assert_eq!(again.worker, Some(1));
    // The decode rank stored the 15 full blocks it received; only the partial block
    // moves. The prefill rank holds them too: it computes the last token only.
    assert_eq!(again.transferred_blocks, 1);
    assert_eq!(again.cached_tokens, 960);
    let want = step(40, 0, 0) + 0.25 + step(1, 0, 0);
    assert!(
        (ttft(&r, 1) - want).abs() < 1e-5,
        "{} vs {want}",
        ttft(&r, 1)
    );
    assert_eq!(r.open_bookings, 0);
}

#[test]
fn every_booking_of_both_halves_is_released_when_requests_end() {
    // Three conversations of four turns, a turn every 300 ms, and a prompt no
    // engine can hold (refused by the engine it is routed to).
    let mut trace: Vec<TraceRequest> = (0..12u64)
        .map(|i| {
            let (turn, conv) = (i / 3, i % 3);
            TraceRequest {
                timestamp_ms: i * 100,
                input_length: 1_500 * (turn + 1),
                output_length: 20,
                hash_ids: (0..3 * (turn + 1)).map(|b| conv * 100 + b).collect(),
            }
        })
        .collect();
    trace.push(TraceRequest {
        timestamp_ms: 50,
        input_length: 20_000,
        output_length: 1,
        hash_ids: (1_000..1_040).collect(),
    });
    for serving in [
        Serving::Aggregated,
        split(1, SplitMode::Disaggregated),
        split(2, SplitMode::Conditional),
    ] {
        let mut c = config(serving);
        c.engine.num_gpu_blocks = 300; // the 20,000-token prompt needs 313
        let r = run(&trace, 3, &c);
        let m = r.metrics(3);
        assert_eq!((m.completed, m.rejected), (12, 1), "{serving:?}");
        assert_eq!(r.open_bookings, 0, "{serving:?}");
        if serving != Serving::Aggregated {
            assert!(m.disaggregated > 0, "{serving:?}");
        }
    }
}

/// A prompt of `tokens` tokens whose 512-token trace blocks are `ids`.
fn request(timestamp_ms: u64, tokens: u64, ids: std::ops::Range<u64>) -> TraceRequest {
    TraceRequest {
        timestamp_ms,
        input_length: tokens,
        output_length: 2,
        hash_ids: ids.collect(),
    }
}

#[test]
fn conditional_keeps_short_and_mostly_cached_prompts_on_the_decode_engine() {
    use kv_events::disaggregation::DisaggregationReason as Reason;
    // A short prompt; a long one (6,000 tokens, 94 blocks); then 7,000 tokens sharing
    // its first 11 trace blocks (5,632 tokens, 88 of 110 blocks): 80% held by the
    // decode engine that decoded the long one, 1,368 tokens uncached.
    let trace = [
        request(0, 500, 0..1),
        request(10_000, 6_000, 10..22),
        request(60_000, 7_000, 10..24),
    ];
    let mut trace = trace.to_vec();
    trace[2].hash_ids[11] = 99; // the long prompt's 12th block was partial
    let r = run(&trace, 2, &config(split(1, SplitMode::Conditional)));
    let reasons: Vec<_> = r.records.iter().map(|x| x.reason).collect();
    assert_eq!(
        reasons,
        [
            Some(Reason::ShortUncached),
            Some(Reason::LongUncached),
            Some(Reason::DecodeHoldsPrefix)
        ]
    );
    let prefill: Vec<_> = r.records.iter().map(|x| x.prefill_worker).collect();
    assert_eq!(prefill, [None, Some(0), None]);
    assert!(r.records.iter().all(|x| x.worker == Some(1)));
    // A local prompt costs its prefill on the decode engine, as on an aggregated one.
    assert!(
        (ttft(&r, 0) - step(500, 0, 0)).abs() < 1e-5,
        "{}",
        ttft(&r, 0)
    );
    assert_eq!(r.records[1].transferred_blocks, 94);
    assert_eq!(r.records[2].cached_tokens, 5_632);
    assert!(
        (ttft(&r, 2) - step(1_368, 0, 0)).abs() < 1e-5,
        "{}",
        ttft(&r, 2)
    );
    assert_eq!(r.open_bookings, 0);
    // Forced disaggregation sends all three to the prefill engine; the decode engine
    // still saves the transfer of the 88 blocks it holds.
    let forced = run(&trace, 2, &config(split(1, SplitMode::Disaggregated)));
    assert!(
        forced
            .records
            .iter()
            .all(|x| x.reason == Some(Reason::LongUncached) && x.prefill_worker == Some(0))
    );
    assert_eq!(forced.records[2].transferred_blocks, 110 - 88);
}
