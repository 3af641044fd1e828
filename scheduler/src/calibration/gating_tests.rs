//! Tests of what an observation is made of: the step fill a chunked-prefill engine
//! adds to a request's last step, and the samples of a saturated rank, which are
//! not learned from.

use super::*;
use kv_events::{DpRank, WorkerId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;

fn rank() -> WorkerRank {
    WorkerRank::new(WorkerId(1), DpRank(0))
}

fn calibration() -> Calibration {
    Calibration::new(
        CalibrationConfig {
            enabled: true,
            ..CalibrationConfig::default()
        },
        &PolicyConfig::default(),
    )
}

fn ms(v: f64) -> Duration {
    Duration::from_secs_f64(v / 1e3)
}

#[test]
fn a_step_filled_by_later_bookings_is_not_mistaken_for_slow_steps() {
    // The lab's finding: two requests booked together on a busy rank, A (short)
    // then B (longer than a step's budget). The engine, whose constants are the
    // router's (truth: both multipliers 1), waits for the running decode step, then
    // runs one full step: A's whole prompt and B's first chunk, 8,192 tokens. A's
    // first token comes after that full step, ~500 ms, while its booking-time
    // features predict ~75 ms. Without the step fill, A's samples drive the
    // multipliers far from 1.
    let seed = StepTimeModel::default();
    let budget = seed.max_num_batched_tokens;
    let mut rng = StdRng::seed_from_u64(11);
    let mut c = calibration();
    let mut now = Instant::now();
    for i in 0..400 {
        let a_tokens = u64::from(rng.random_range(200..3_000_u32));
        let b_tokens = u64::from(rng.random_range(9_000..12_000_u32));
        let running = u64::from(rng.random_range(1..8_u32));
        let context_tokens = running * 4_000;
        let a = TtftFeatures {
            prefill_tokens: a_tokens,
            uncached_tokens: a_tokens,
            steps: 1,
            active_requests: running,
            context_tokens,
            mid_step: true,
        };
        let b = TtftFeatures {
            prefill_tokens: a_tokens + b_tokens,
            uncached_tokens: b_tokens,
            steps: (a_tokens + b_tokens).div_ceil(budget),
            active_requests: running + 1,
            ..a
        };
        let (ida, idb) = (
            RequestId::from(format!("a{i}")),
            RequestId::from(format!("b{i}")),
        );
        c.book(&ida, rank(), a, now);
        c.book(&idb, rank(), b, now);
        let decode_step = seed.step_base_ms
            + seed.decode_ms_per_seq * running as f64
            + seed.kv_read_ms_per_token * context_tokens as f64;
        let wait = rng.random_range(0.0..decode_step);
        let full_step = decode_step + seed.prefill_ms_per_token * budget as f64;
        let a_done = now + ms(wait + full_step);
        assert!(c.prefill_done(&ida, a_done));
        // B as its features predict (its own samples are not the point here).
        let b_done = now + ms(b.parts(&seed).iter().sum());
        assert!(c.prefill_done(&idb, b_done.max(a_done)));
        now = b_done.max(a_done) + Duration::from_secs(1);
    }
    let scale = c.scale(rank());
    assert!((scale.prefill - 1.0).abs() < 0.1, "{scale:?}");
    assert!((scale.step_base - 1.0).abs() < 0.25, "{scale:?}");
}

#[test]
fn bookings_after_the_last_step_began_are_not_fill() {
    // A alone on an idle rank, B booked 1 ms before A's first token: B cannot have
    // shared A's step, so A's sample is its own prediction and leaves θ at 1.
    let seed = StepTimeModel::default();
    let mut c = calibration();
    let mut now = Instant::now();
    for i in 0..200 {
        let a = TtftFeatures {
            prefill_tokens: 1_000,
            uncached_tokens: 1_000,
            steps: 1,
            ..TtftFeatures::default()
        };
        let (ida, idb) = (
            RequestId::from(format!("a{i}")),
            RequestId::from(format!("b{i}")),
        );
        c.book(&ida, rank(), a, now);
        let done = now + ms(a.parts(&seed).iter().sum());
        c.book(&idb, rank(), a, done - ms(1.0));
        assert!(c.prefill_done(&ida, done));
        c.forget(&idb);
        now = done + Duration::from_secs(1);
    }
    let scale = c.scale(rank());
    assert!((scale.prefill - 1.0).abs() < 1e-6, "{scale:?}");
    assert!((scale.step_base - 1.0).abs() < 1e-6, "{scale:?}");
}

#[test]
fn a_saturated_rank_is_not_learned_from() {
    // Queueing beyond `max_queue_steps` is not what the features describe: a sample
    // booked behind 5 steps of prefill (default limit 4) is skipped, however far
    // off it is, and one behind exactly 4 is taken.
    let mut c = calibration();
    let t = Instant::now();
    let behind = |steps: u64| TtftFeatures {
        prefill_tokens: steps * 8_192,
        uncached_tokens: 1_000,
        steps,
        active_requests: 200,
        context_tokens: 1_000_000,
        mid_step: true,
    };
    let saturated = RequestId::from("saturated");
    c.book(&saturated, rank(), behind(5), t);
    assert!(!c.prefill_done(&saturated, t + Duration::from_secs(600)));
    let report = c.report(rank()).expect("calibration is on");
    assert_eq!(report.samples, 0);
    assert_eq!(report.scale, TimingScale::ONE);
    let queued = RequestId::from("queued");
    c.book(&queued, rank(), behind(4), t);
    assert!(c.prefill_done(&queued, t + Duration::from_secs(3)));
    assert_eq!(c.report(rank()).expect("on").samples, 1);
}
