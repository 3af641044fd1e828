//! Tests of the lab's calibration sampling and the swing study's retiming.

use super::*;
use crate::config::Speedup;
use engine_model::EngineModelConfig;

fn request(timestamp_ms: u64) -> TraceRequest {
    TraceRequest {
        timestamp_ms,
        input_length: 100,
        output_length: 10,
        hash_ids: vec![timestamp_ms],
    }
}

fn speedups(v: &[f64]) -> Vec<Speedup> {
    v.iter()
        .map(|&s| Speedup::new(s).expect("valid speed-up"))
        .collect()
}

#[test]
fn retiming_compresses_each_phase_by_its_speedup() {
    let trace: Vec<TraceRequest> = (0..6).map(|i| request(i * 1_000)).collect();
    let (retimed, starts) = retime(&trace, &speedups(&[1.0, 4.0, 1.0]));
    let times: Vec<u64> = retimed.iter().map(|r| r.timestamp_ms).collect();
    // Phase 1: 0, 1000; phase 2 (4×): gaps of 250; phase 3 back to 1000.
    assert_eq!(times, vec![0, 1_000, 1_250, 1_500, 2_500, 3_500]);
    assert_eq!(starts, vec![0.0, 1_250.0, 2_500.0]);
    let (same, _) = retime(&trace, &speedups(&[1.0]));
    assert_eq!(same, trace, "one phase at 1× changes nothing");
}

#[test]
fn calibrated_runs_sample_every_rank_and_others_record_nothing() {
    let requests = engine_model::trace::bundled_excerpt().expect("bundled excerpt");
    let prepared = PreparedTrace::new(
        &requests[..400],
        BlockMapping::new(EngineModelConfig::default().block_size).expect("block size"),
    );
    let setting = Setting {
        workers: 4,
        speedup: Speedup::new(1.0).expect("valid speed-up"),
    };
    let config = SimConfig {
        calibration_sample_ms: Some(5_000.0),
        ..SimConfig::default()
    };
    let plain = simulate(
        &prepared,
        setting,
        LabPolicy::Scheduler(PolicyKind::PredictedTtft),
        &config,
    )
    .expect("run");
    assert!(plain.calibration.is_empty(), "no calibration, no points");
    let cal = simulate(
        &prepared,
        setting,
        LabPolicy::Calibrated(PolicyKind::PredictedTtft),
        &config,
    )
    .expect("run");
    assert!(
        cal.calibration.len() > 4,
        "{} points",
        cal.calibration.len()
    );
    assert!(cal.calibration.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
    let last = cal.final_calibration();
    assert_eq!(
        last.iter().map(|p| p.worker).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    let learned: u64 = last.iter().map(|p| p.samples).sum();
    assert!(
        learned > 300,
        "every prefill_done is an observation: {learned}"
    );
    // The engines are the router's constants: the prefill estimate stays near 1.
    // The per-step part is a few % of these TTFTs (prompts of thousands of tokens),
    // so its multiplier absorbs what the features miss and is only bounded here.
    for p in &last {
        assert!((0.8..1.25).contains(&p.prefill), "{p:?}");
        assert!((0.125..=8.0).contains(&p.per_step), "{p:?}");
    }
    assert!(
        SimConfig {
            calibration_sample_ms: Some(0.5),
            ..SimConfig::default()
        }
        .validate()
        .is_err()
    );
}
