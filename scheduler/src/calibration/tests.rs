//! Tests of the calibration estimator and its per-rank bookkeeping, on synthetic
//! observations with explicit `Instant`s.

use super::rls::TRACE_CAP;
use super::*;
use kv_events::{DpRank, WorkerId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;

fn bounds() -> Bounds {
    CalibrationConfig::default().bounds()
}

/// Varied features, like requests of 100–3,000 tokens behind 0–4 steps of queue on
/// ranks running 0–255 decodes over up to 200k KV tokens.
fn features_of(rng: &mut StdRng) -> TtftFeatures {
    let queued = u64::from(rng.random_range(0..5_u32)) * 8_192;
    let prefill_tokens = queued + u64::from(rng.random_range(100..3_000_u32));
    let active_requests = u64::from(rng.random_range(0..256_u32));
    TtftFeatures {
        prefill_tokens,
        uncached_tokens: prefill_tokens - queued,
        steps: prefill_tokens.div_ceil(8_192),
        active_requests,
        context_tokens: u64::from(rng.random_range(0..200_000_u32)),
        mid_step: active_requests > 0,
    }
}

/// The seed model's two parts of varied features, in ms.
fn parts(rng: &mut StdRng) -> [f64; 2] {
    features_of(rng).parts(&StepTimeModel::default())
}

fn observe(theta: [f64; 2], z: [f64; 2]) -> f64 {
    theta.iter().zip(z).map(|(t, v)| t * v).sum()
}

fn close(a: [f64; 2], b: [f64; 2], tol: f64) -> bool {
    a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol * y)
}

#[test]
fn converges_to_the_true_multipliers_on_exact_data() {
    let truth = [2.0, 0.5];
    let mut rng = StdRng::seed_from_u64(1);
    let mut rls = Rls::default();
    for _ in 0..1_000 {
        let z = parts(&mut rng);
        assert!(rls.update(z, observe(truth, z), &bounds()));
    }
    assert!(close(rls.theta(), truth, 0.02), "{:?}", rls.theta());
    assert_eq!(rls.samples(), 1_000);
}

#[test]
fn converges_on_noisy_data() {
    let truth = [0.5, 3.0];
    let mut rng = StdRng::seed_from_u64(2);
    let mut rls = Rls::default();
    for _ in 0..3_000 {
        let z = parts(&mut rng);
        // ±25% multiplicative noise on every observation.
        let y = observe(truth, z) * rng.random_range(0.75..1.25);
        rls.update(z, y, &bounds());
    }
    assert!(close(rls.theta(), truth, 0.1), "{:?}", rls.theta());
}

/// A TTFT from an engine whose constants are the seed's times `engine`
/// (`[prefill, step base, decode]`), with the mid-step wait.
fn engine_ttft(engine: [f64; 3], f: &TtftFeatures) -> f64 {
    let seed = StepTimeModel::default();
    let t = seed.scaled(TimingScale {
        prefill: engine[0],
        step_base: engine[1],
        decode: engine[2],
    });
    f.parts(&t).iter().sum()
}

#[test]
fn an_engine_with_another_step_base_settles_and_does_not_drift() {
    // The engines' step base is 4× the seed's, their decode cost is the seed's: the
    // finding that motivated two multipliers. Prefill must settle at 1, and the
    // per-step multiplier at the ratio of true to seed step cost at the load seen,
    // between 1 (decode-bound steps) and 4 (idle steps) — and stay there.
    let mut rng = StdRng::seed_from_u64(6);
    let mut rls = Rls::default();
    let seed = StepTimeModel::default();
    let (mut lo, mut hi) = (f64::INFINITY, 0.0_f64);
    let (mut fit, mut n) = (0.0, 0.0);
    for i in 0..20_000 {
        let f = features_of(&mut rng);
        let y = engine_ttft([1.0, 4.0, 1.0], &f);
        let z = f.parts(&seed);
        if i >= 2_000 {
            let theta = rls.theta();
            lo = lo.min(theta[1]);
            hi = hi.max(theta[1]);
            fit += (observe(theta, z) / y - 1.0).abs();
            n += 1.0;
        }
        rls.update(z, y, &bounds());
    }
    let theta = rls.theta();
    assert!((theta[0] - 1.0).abs() < 0.1, "{theta:?}");
    assert!(theta[1] > 1.0 && theta[1] < 4.0, "{theta:?}");
    assert!(
        hi - lo < 0.5,
        "per-step multiplier wandered over [{lo}, {hi}]"
    );
    assert!(fit / n < 0.2, "mean relative error {}", fit / n);
}

#[test]
fn an_engine_slower_in_every_constant_is_learned_exactly() {
    // A half-speed GPU: every constant 2×, so both multipliers are exactly 2.
    let mut rng = StdRng::seed_from_u64(7);
    let mut rls = Rls::default();
    for _ in 0..2_000 {
        let f = features_of(&mut rng);
        rls.update(
            f.parts(&StepTimeModel::default()),
            engine_ttft([2.0; 3], &f),
            &bounds(),
        );
    }
    assert!(close(rls.theta(), [2.0, 2.0], 0.01), "{:?}", rls.theta());
}

#[test]
fn the_mid_step_wait_is_half_a_step_on_a_busy_rank() {
    let seed = StepTimeModel::default();
    let idle = TtftFeatures {
        prefill_tokens: 1_000,
        uncached_tokens: 1_000,
        steps: 1,
        active_requests: 0,
        context_tokens: 0,
        mid_step: false,
    };
    assert_eq!(idle.parts(&seed), [60.0, 9.0]);
    let busy = TtftFeatures {
        active_requests: 10,
        context_tokens: 10_000,
        mid_step: true,
        ..idle
    };
    // Step: 9 + 0.04 × 10 + 4e-5 × 10,000 = 9.8 ms, paid 1.5 times.
    let [prefill, per_step] = busy.parts(&seed);
    assert_eq!(prefill, 60.0);
    assert!((per_step - 1.5 * 9.8).abs() < 1e-9, "{per_step}");
    let load = crate::load::RankLoad {
        active_requests: 3,
        ..Default::default()
    };
    assert!(TtftFeatures::new(100, &load, 16, 8_192).mid_step);
    assert!(!TtftFeatures::new(100, &Default::default(), 16, 8_192).mid_step);
}

#[test]
fn follows_a_step_change_through_forgetting() {
    let mut rng = StdRng::seed_from_u64(3);
    let mut rls = Rls::default();
    for _ in 0..1_000 {
        let z = parts(&mut rng);
        rls.update(z, observe([1.0; 2], z), &bounds());
    }
    assert!(close(rls.theta(), [1.0; 2], 0.01));
    // The engine becomes 2× slower in prefill and per step.
    let slower = [2.0, 2.0];
    for _ in 0..1_000 {
        let z = parts(&mut rng);
        rls.update(z, observe(slower, z), &bounds());
    }
    assert!(close(rls.theta(), slower, 0.05), "{:?}", rls.theta());
}

#[test]
fn learned_constants_stay_within_the_clamp() {
    let mut rng = StdRng::seed_from_u64(4);
    let (mut fast, mut slow) = (Rls::default(), Rls::default());
    for _ in 0..500 {
        let z = parts(&mut rng);
        fast.update(z, observe([0.01; 2], z), &bounds());
        slow.update(z, observe([50.0; 2], z), &bounds());
        for t in fast.theta().into_iter().chain(slow.theta()) {
            assert!((0.125..=8.0).contains(&t), "{t}");
        }
    }
    // At the bounds, or (the slow one's per-step part, winsorised at 4×) on the way.
    assert!(close(fast.theta(), [0.125; 2], 0.05), "{:?}", fast.theta());
    let slow = slow.theta();
    assert!((slow[0] - 8.0).abs() < 0.2 && slow[1] > 4.0, "{slow:?}");
    // The default clamp covers engines 4× faster or slower in either part.
    let mut rls = Rls::default();
    let truth = [0.25, 4.0];
    for _ in 0..2_000 {
        let z = parts(&mut rng);
        rls.update(z, observe(truth, z), &bounds());
    }
    assert!(close(rls.theta(), truth, 0.02), "{:?}", rls.theta());
}

#[test]
fn degenerate_samples_are_skipped_without_nan() {
    let mut rls = Rls::default();
    let b = bounds();
    assert!(!rls.update([0.0; 2], 10.0, &b), "all-zero features");
    assert!(!rls.update([1.0, 1.0], f64::NAN, &b));
    assert!(!rls.update([1.0, 1.0], f64::INFINITY, &b));
    assert!(!rls.update([f64::NAN, 1.0], 1.0, &b));
    assert!(!rls.update([-1.0, 2.0], 1.0, &b));
    assert!(!rls.update([f64::MAX, f64::MAX], 1.0, &b), "sum overflows");
    assert_eq!(rls, Rls::default(), "nothing changed");
    // A zero interval (prefill_done in the same instant) is winsorised, not a NaN.
    assert!(rls.update([6.0, 9.0], 0.0, &b));
    assert!(rls.theta().iter().all(|t| t.is_finite() && *t > 0.0));
}

#[test]
fn a_single_repeated_feature_vector_stays_bounded() {
    // Only one direction is excited (an idle rank serving one prompt size): the
    // other must not wind up, and the excited direction must fit the data.
    let mut rls = Rls::default();
    let z = [60.0, 9.0];
    for _ in 0..100_000 {
        rls.update(z, 2.0 * 69.0, &bounds());
    }
    let theta = rls.theta();
    assert!(theta.iter().all(|t| t.is_finite()), "{theta:?}");
    assert!((observe(theta, z) - 138.0).abs() < 1e-3, "{theta:?}");
    let trace = rls.covariance_trace();
    assert!(trace.is_finite() && trace <= TRACE_CAP + 1e-9, "{trace}");
}

#[test]
fn one_outlier_moves_a_converged_estimate_little() {
    let mut rng = StdRng::seed_from_u64(5);
    let mut rls = Rls::default();
    for _ in 0..500 {
        let z = parts(&mut rng);
        rls.update(z, observe([1.0; 2], z), &bounds());
    }
    let before = rls.theta();
    let z = parts(&mut rng);
    rls.update(z, observe([1.0; 2], z) * 1_000.0, &bounds());
    assert!(
        close(rls.theta(), before, 0.05),
        "{before:?} → {:?}",
        rls.theta()
    );
}

fn rank(w: u64) -> WorkerRank {
    WorkerRank::new(WorkerId(w), DpRank(0))
}

fn calibration(warmup_samples: u32) -> Calibration {
    Calibration::new(
        CalibrationConfig {
            enabled: true,
            warmup_samples,
            ..CalibrationConfig::default()
        },
        &PolicyConfig::default(),
    )
}

fn features(tokens: u64) -> TtftFeatures {
    TtftFeatures {
        prefill_tokens: tokens,
        uncached_tokens: tokens,
        steps: tokens.div_ceil(8_192).max(1),
        active_requests: 0,
        context_tokens: 0,
        mid_step: false,
    }
}

/// Books and completes `n` requests on `rank`, each taking `slowdown` × the seed's
/// prediction; returns the time after the last.
fn serve(c: &mut Calibration, rank: WorkerRank, n: u32, slowdown: f64, t: Instant) -> Instant {
    let mut now = t;
    for i in 0..n {
        let id = RequestId::from(format!("{rank}-{i}"));
        let f = features(500 + u64::from(i % 7) * 900);
        c.book(&id, rank, f, now);
        let ms = slowdown * f.parts(c.seed()).iter().sum::<f64>();
        now += Duration::from_secs_f64(ms / 1e3);
        assert!(c.prefill_done(&id, now));
    }
    now
}

#[test]
fn warm_up_falls_back_to_the_seed() {
    let mut c = calibration(10);
    let t = Instant::now();
    assert_eq!(
        c.scale(rank(1)),
        TimingScale::ONE,
        "an idle rank uses the seed"
    );
    let report = c.report(rank(1)).unwrap();
    assert_eq!((report.samples, report.in_use), (0, false));
    assert_eq!(report.model, *c.seed());
    let t = serve(&mut c, rank(1), 9, 2.0, t);
    assert_eq!(c.scale(rank(1)), TimingScale::ONE, "still warming up");
    assert!(!c.report(rank(1)).unwrap().in_use);
    serve(&mut c, rank(1), 1, 2.0, t);
    let scale = c.scale(rank(1));
    assert!((scale.prefill - 2.0).abs() < 0.3, "{scale:?}");
    let report = c.report(rank(1)).unwrap();
    assert!(report.in_use);
    assert_eq!(report.samples, 10);
    assert!((report.model.prefill_ms_per_token / 0.06 - scale.prefill).abs() < 1e-12);
    assert_eq!(
        c.report(rank(2)).unwrap().samples,
        0,
        "other ranks are untouched"
    );
}

#[test]
fn a_rank_still_warming_up_is_priced_like_the_warmed_up_ones() {
    // Ranks 1 and 2 are warm at 3× and 2× the seed; rank 3 has 5 samples and rank 9
    // none: both get the geometric mean, √6 ≈ 2.45, not the seed's 1 (which would
    // make them look cheapest, flood them, and, saturated, keep them cold).
    let mut c = calibration(20);
    let t = Instant::now();
    let t = serve(&mut c, rank(1), 200, 3.0, t);
    let t = serve(&mut c, rank(2), 200, 2.0, t);
    serve(&mut c, rank(3), 5, 1.0, t);
    let own = |c: &Calibration, w| c.report(rank(w)).unwrap().scale.prefill;
    let (own1, own2) = (own(&c, 1), own(&c, 2));
    let mean = (own1 * own2).sqrt();
    assert!((mean - 6.0_f64.sqrt()).abs() < 0.1, "{mean}");
    for cold in [3, 9] {
        let scale = c.scale(rank(cold));
        assert!((scale.prefill - mean).abs() < 1e-9, "{cold}: {scale:?}");
    }
    assert!(
        (c.scale(rank(1)).prefill - own1).abs() < 1e-12,
        "warm: its own"
    );
    // A warm rank leaving takes its estimate out of the mean.
    c.remove_ranks(|r| r == rank(1));
    assert!((c.scale(rank(9)).prefill - own2).abs() < 1e-9);
}

#[test]
fn without_warm_up_a_ranks_first_sample_prices_it_apart() {
    // Warm-up 0: every rank with an estimator uses its own multipliers at once
    // (no rank is ever listed as "warmed up" then, so that list must not decide).
    let mut c = calibration(0);
    let t = Instant::now();
    let t = serve(&mut c, rank(1), 3, 4.0, t);
    serve(&mut c, rank(2), 3, 1.0, t);
    let (slow, fast) = (c.report(rank(1)).unwrap(), c.report(rank(2)).unwrap());
    assert!(slow.scale.prefill > fast.scale.prefill, "{slow:?} {fast:?}");
    assert_eq!(
        c.scale(rank(1)),
        slow.scale,
        "its own, not the fleet's mean"
    );
    assert_eq!(c.scale(rank(2)), fast.scale);
    assert!(c.prices_apart(rank(1)) && c.prices_apart(rank(2)));
    // Still warming up with a warm-up of 10: the seed (none warm), no estimate read.
    let mut c = calibration(10);
    serve(&mut c, rank(1), 3, 4.0, t);
    assert_eq!(c.scale(rank(1)), TimingScale::ONE);
    assert!(!c.prices_apart(rank(1)));
}

#[test]
fn bookkeeping_is_bounded_and_off_means_off() {
    let mut c = calibration(1);
    let t = Instant::now();
    let id = RequestId::from("a");
    assert!(!c.prefill_done(&id, t), "unknown request");
    c.book(&id, rank(1), features(100), t);
    c.forget(&id);
    assert!(
        !c.prefill_done(&id, t + Duration::from_millis(5)),
        "freed first"
    );
    c.book(&id, rank(1), features(100), t);
    assert!(c.prefill_done(&id, t + Duration::from_millis(20)));
    assert!(
        !c.prefill_done(&id, t + Duration::from_millis(30)),
        "repeated"
    );
    c.book(&RequestId::from("b"), rank(1), features(100), t);
    c.book(&RequestId::from("c"), rank(2), features(100), t);
    c.remove_ranks(|r| r == rank(1));
    assert_eq!(c.pending(), 1);
    assert_eq!(c.report(rank(1)).unwrap().samples, 0, "estimator dropped");

    let disabled = CalibrationConfig {
        enabled: false,
        ..CalibrationConfig::default()
    };
    let mut off = Calibration::new(disabled, &PolicyConfig::default());
    off.book(&id, rank(1), features(100), t);
    assert_eq!(off.pending(), 0);
    assert!(!off.prefill_done(&id, t + Duration::from_millis(20)));
    assert_eq!(off.report(rank(1)), None);
    assert_eq!(off.scale(rank(1)), TimingScale::ONE);
}
