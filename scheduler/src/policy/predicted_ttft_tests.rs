//! Tests of the `predicted-ttft` policy (`predicted_ttft::tests`). They drive it through
//! [`super::super::Selector`], so they live in their own file: `predicted_ttft.rs` itself then
//! imports nothing from `policy/mod.rs`, which imports it.

use super::super::PolicyConfig;
use super::super::test_support::*;
use super::*;
use crate::sequences::RankLoad;

/// Round numbers: 10 ms per step, 0.1 ms per prefill token, 1 ms per decoding
/// sequence, 0.001 ms per KV token read, 1,000 tokens per step.
fn config(base: f64, balanced: f64, backlog: f64, in_flight: bool) -> PredictedTtftConfig {
    PredictedTtftConfig {
        timing: StepTimeModel {
            step_base_ms: 10.0,
            prefill_ms_per_token: 0.1,
            decode_ms_per_seq: 1.0,
            kv_read_ms_per_token: 0.001,
            max_num_batched_tokens: 1_000,
            tier_load_ms_per_token: 0.01,
        },
        credit: ReuseCredit {
            base,
            balanced,
            backlog,
            in_flight,
            min_match_ratio: 0.0,
        },
        // Off, so the formula tests see the credited costs alone (the cap has its
        // own test below).
        delay_cap: DelayCap {
            enabled: false,
            ..DelayCap::default()
        },
    }
}

fn with_pending(mut c: Candidate, tokens: u64) -> Candidate {
    c.load = RankLoad {
        active_prefill_tokens: tokens,
        ..c.load
    };
    c
}

fn with_context(mut c: Candidate, blocks: u64) -> Candidate {
    c.load.active_context_blocks = blocks;
    c
}

#[test]
fn cost_matches_hand_computation() {
    // 640 tokens in 10 blocks of 64; 4 blocks cached; 1,500 tokens in flight; 2
    // requests holding 10 blocks of context; no in-flight overlap (all 10 blocks
    // new).
    let req = shape(10, 640, 64);
    let c = with_context(with_pending(cand(1, 4, 10, 2, 10), 1_500), 10);
    let cfg = config(1.0, 0.0, 0.0, true);
    // 1500 + 640 − 256 = 1884 tokens: 2 steps of 10 + 2 + 0.64 ms, and half of one
    // waited for the step the 2 requests run; 188.4 ms prefill.
    let cost = predicted_ttft_cost(&cfg, &req, &c, 0);
    assert!((cost - (188.4 + 2.5 * 12.64)).abs() < 1e-9, "{cost}");
    // Idle, the same rank starts at once: no half step.
    let mut idle = c;
    idle.load.active_requests = 0;
    let idle_cost = predicted_ttft_cost(&cfg, &req, &idle, 0);
    assert!(
        (idle_cost - (188.4 + 2.0 * 10.64)).abs() < 1e-9,
        "{idle_cost}"
    );
    // Credit 3 on the 256 cached tokens: 0.1 × 2 × 256 = 51.2 ms cheaper.
    let cfg3 = config(3.0, 0.0, 0.0, true);
    let cost3 = predicted_ttft_cost(&cfg3, &req, &c, 0);
    assert!((cost - cost3 - 51.2).abs() < 1e-9, "{cost3}");
    // Decode attention reads every sequence's context, shared prefixes included:
    // 10 more context blocks (same deduplicated decode blocks) cost 2.5 steps ×
    // 0.001 ms × 640 tokens more.
    let shared = with_context(c, 20);
    let cost_shared = predicted_ttft_cost(&cfg, &req, &shared, 0);
    assert!((cost_shared - cost - 1.6).abs() < 1e-9, "{cost_shared}");
}

#[test]
fn balanced_credit_halves_per_budget_of_excess_queue_and_backlog_adds() {
    let req = shape(10, 640, 64);
    let cfg = config(2.0, 4.0, 1.0, false);
    // Credit per cached token: cost with 0 vs 1 cached block, over 0.1 × 64.
    let credit = |pending: u64, min_pending: u64| {
        let none = with_pending(cand(1, 0, 0, 0, 10), pending);
        let one = with_pending(cand(1, 1, 0, 0, 10), pending);
        (predicted_ttft_cost(&cfg, &req, &none, min_pending)
            - predicted_ttft_cost(&cfg, &req, &one, min_pending))
            / 6.4
    };
    assert!((credit(0, 0) - 6.0).abs() < 1e-9, "2 + 4");
    assert!((credit(1_000, 0) - 4.0).abs() < 1e-9, "2 + 4 / 2");
    assert!(
        (credit(2_000, 2_000) - 8.0).abs() < 1e-9,
        "2 + 4 + 2 backlog steps"
    );
}

#[test]
fn credits_need_the_minimum_match_ratio() {
    let req = shape(10, 640, 64);
    let mut cfg = config(5.0, 0.0, 0.0, false);
    cfg.credit.min_match_ratio = 0.5;
    let saving = |overlap: u32| {
        predicted_ttft_cost(&cfg, &req, &cand(1, 0, 0, 0, 10), 0)
            - predicted_ttft_cost(&cfg, &req, &cand(1, overlap, 0, 0, 10), 0)
    };
    // 4 of 10 blocks (40%): credit 1; 5 blocks (50%): credit 5.
    assert!((saving(4) - 0.1 * 256.0).abs() < 1e-9);
    assert!((saving(5) - 0.1 * 5.0 * 320.0).abs() < 1e-9);
}

#[test]
fn in_flight_prefix_counts_as_cached_only_when_enabled() {
    // Nothing indexed, but requests in flight hold 8 of the 10 blocks.
    let req = shape(10, 640, 64);
    let c = cand(1, 0, 0, 0, 2);
    let on = predicted_ttft_cost(&config(1.0, 0.0, 0.0, true), &req, &c, 0);
    let off = predicted_ttft_cost(&config(1.0, 0.0, 0.0, false), &req, &c, 0);
    assert!((off - on - 0.1 * 512.0).abs() < 1e-9, "{on} {off}");
}

#[test]
fn picks_the_cached_rank_unless_its_queue_is_too_long() {
    let req = shape(10, 640, 64);
    let cfg = PolicyConfig::PredictedTtft(config(1.0, 0.0, 0.0, false));
    // Rank 1 caches everything but has 2,000 tokens queued; rank 2 is idle.
    let cands = [
        with_pending(cand(1, 10, 0, 0, 10), 2_000),
        cand(2, 0, 0, 0, 10),
    ];
    let choice = selector(1).select(&cfg, &ctx(req, &cands)).unwrap();
    // Rank 1: 0.1 × 2000 + 2 steps × 10 = 220 ms; rank 2: 0.1 × 640 + 10 = 74 ms.
    assert_eq!(choice.index, 1);
    // With only 300 queued tokens the cache wins: 30 + 10 = 40 < 74 ms.
    let cands = [
        with_pending(cand(1, 10, 0, 0, 10), 300),
        cand(2, 0, 0, 0, 10),
    ];
    let choice = selector(1).select(&cfg, &ctx(req, &cands)).unwrap();
    assert_eq!(choice.index, 0);
    assert!((choice.cost.unwrap() - 40.0).abs() < 1e-9);
}

#[test]
fn the_delay_cap_keeps_a_long_queue_from_delaying_the_request_with_spare_capacity() {
    let req = shape(10, 640, 64);
    // A big credit (base 10) makes rank 1's full cache worth its 1,500 queued tokens:
    // credited 0.1 × (1500 + 640 − 10 × 640) + 2 × 10 = −406 ms against rank 2's
    // 0.1 × 640 + 10 = 74 ms. Its own TTFT is 0.1 × 1500 + 20 = 170 ms, 2.3× rank 2's.
    let mut capped = config(10.0, 0.0, 0.0, false);
    capped.delay_cap = DelayCap::default();
    let uncapped = config(10.0, 0.0, 0.0, false);
    let fleet = |cached_rank: u64, other: u64| {
        [
            with_pending(cand(1, 10, 0, 0, 10), cached_rank),
            with_pending(cand(2, 0, 0, 0, 10), other),
        ]
    };
    let pick = |cfg: PredictedTtftConfig, cands: &[Candidate]| {
        selector(1)
            .select(&PolicyConfig::PredictedTtft(cfg), &ctx(req, cands))
            .unwrap()
            .index
    };
    // Mean queue 750 tokens, under 3 steps of 1,000: the cap sends it to rank 2.
    assert_eq!(pick(uncapped, &fleet(1_500, 0)), 0);
    assert_eq!(pick(capped, &fleet(1_500, 0)), 1);
    // Rank 1 with 6,000 queued, rank 2 with 500: its own TTFT is 660 ms against
    // 134 ms (4.9×), credited 84 against 134. The mean queue is 3,250 tokens, over 3
    // steps: the fleet is backlogged and the credit decides; with a higher gate the
    // cap would have applied.
    assert_eq!(pick(capped, &fleet(6_000, 500)), 0);
    let high_gate = PredictedTtftConfig {
        delay_cap: DelayCap {
            spare_steps: 4.0,
            ..DelayCap::default()
        },
        ..capped
    };
    assert_eq!(pick(high_gate, &fleet(6_000, 500)), 1);
}

#[test]
fn exact_ties_are_broken_at_random() {
    let cands = [cand(1, 0, 0, 0, 4), cand(2, 0, 0, 0, 4)];
    let c = ctx(shape(4, 256, 64), &cands);
    let counts = histogram(
        &PolicyConfig::PredictedTtft(PredictedTtftConfig::default()),
        &c,
        1000,
    );
    assert!(counts[0] > 350 && counts[1] > 350, "{counts:?}");
}

#[test]
fn validation_names_the_knob() {
    let mut bad = PredictedTtftConfig::default();
    bad.credit.balanced = -1.0;
    assert!(matches!(
        bad.validate(),
        Err(SchedulerError::InvalidConfig {
            field: "policy.predicted_ttft.credit.balanced",
            ..
        })
    ));
    let mut bad = PredictedTtftConfig::default();
    bad.credit.min_match_ratio = 1.5;
    assert!(bad.validate().is_err());
    let mut bad = PredictedTtftConfig::default();
    bad.timing.max_num_batched_tokens = 0;
    assert!(bad.validate().is_err());
    assert!(PredictedTtftConfig::default().validate().is_ok());
    let parsed: PredictedTtftConfig = serde_json::from_str(r#"{"credit": {"base": 2.0}}"#).unwrap();
    assert_eq!(parsed.credit.base, 2.0);
    assert_eq!(
        parsed.credit.balanced, 40.0,
        "unset knobs keep their defaults"
    );
}

#[test]
fn an_idle_rank_beats_a_decoding_one_that_calibration_reads_a_little_faster() {
    // The live case of `docs/benchmarks.md`, "Calibration that starved ranks", under
    // the default model: a 256-token prompt, rank 1 idle with a per-step multiplier
    // of 0.85, rank 2 decoding one request with 0.6 (both prefill 0.35). Leaving out
    // the wait for rank 2's running step, rank 2 priced 2.2 ms cheaper and won every
    // such decision; its new request then waited out that step.
    let req = shape(4, 256, 64);
    let idle = cand(1, 0, 4, 0, 4);
    let decoding = cand(2, 0, 4, 1, 4);
    let scale = |step: f64| TimingScale {
        prefill: 0.35,
        step_base: step,
        decode: step,
    };
    let scales = [scale(0.85), scale(0.6)];
    let policy = PolicyConfig::PredictedTtft(PredictedTtftConfig::default());
    let cands = [idle, decoding];
    let context = SelectContext {
        timing_scales: &scales,
        ..ctx(req, &cands)
    };
    let mut s = selector(1);
    for _ in 0..20 {
        assert_eq!(s.select(&policy, &context).unwrap().index, 0);
    }
    // Once rank 2 is idle too, its lower multiplier wins.
    let cands = [idle, cand(2, 0, 0, 0, 4)];
    let context = SelectContext {
        timing_scales: &scales,
        ..ctx(req, &cands)
    };
    assert_eq!(s.select(&policy, &context).unwrap().index, 1);
}

#[test]
fn a_lower_tier_block_costs_its_load_instead_of_a_prefill() {
    // 640 tokens in 10 blocks of 64; 2 decoding requests, no context: 12 ms a step.
    // A holds 8 blocks (512 tokens) on the GPU, B the same 8 only on a lower tier,
    // C nothing.
    let req = shape(10, 640, 64);
    let gpu = cand(1, 8, 0, 2, 10);
    let cpu = on_any_tier(cand(2, 0, 0, 2, 10), 8);
    let none = cand(3, 0, 0, 2, 10);
    let cfg = config(1.0, 0.0, 0.0, true);
    let cost = |c: &Candidate| predicted_ttft_cost(&cfg, &req, c, 0);
    // A: 128 tokens prefilled (12.8 ms); B: the same plus 512 loaded at 0.01 ms
    // (5.12 ms); C: 640 prefilled (64 ms). One step each, after half of the running
    // one (18 ms).
    assert!((cost(&gpu) - (12.8 + 18.0)).abs() < 1e-9, "{}", cost(&gpu));
    assert!(
        (cost(&cpu) - (12.8 + 5.12 + 18.0)).abs() < 1e-9,
        "{}",
        cost(&cpu)
    );
    assert!(
        (cost(&none) - (64.0 + 18.0)).abs() < 1e-9,
        "{}",
        cost(&none)
    );
    // Loaded tokens take no room in a step: with 800 tokens queued, B's 928 fit in
    // one step of 1,000, C's 1,440 need two.
    let cost = |c: Candidate| predicted_ttft_cost(&cfg, &req, &with_pending(c, 800), 0);
    assert!(
        (cost(cpu) - (92.8 + 5.12 + 18.0)).abs() < 1e-9,
        "{}",
        cost(cpu)
    );
    assert!((cost(none) - (144.0 + 30.0)).abs() < 1e-9, "{}", cost(none));
    // A lower-tier prefix under the in-flight overlap is not counted twice: with 8
    // blocks in flight (2 new of 10) B prices as a GPU hit.
    let in_flight = |mut c: Candidate| {
        c.new_blocks = 2;
        c
    };
    let cfg_cost = |c: &Candidate| predicted_ttft_cost(&cfg, &req, c, 0);
    assert_eq!(cfg_cost(&in_flight(cpu)), cfg_cost(&in_flight(gpu)));
}

#[test]
fn gpu_beats_cpu_beats_none_under_the_defaults() {
    let req = shape(10, 640, 64);
    let gpu = cand(1, 8, 4, 2, 10);
    let cpu = on_any_tier(cand(2, 0, 4, 2, 10), 8);
    let none = cand(3, 0, 4, 2, 10);
    let policy = PolicyConfig::PredictedTtft(PredictedTtftConfig::default());
    let mut s = selector(3);
    let mut pick = |cands: &[Candidate]| s.select(&policy, &ctx(req, cands)).unwrap().index;
    assert_eq!(pick(&[none, cpu, gpu]), 2, "GPU beats CPU and none");
    assert_eq!(pick(&[none, cpu]), 1, "CPU beats none");
    // Without lower-tier blocks the cost is the GPU-only one, whatever the load cost.
    let free_loads = PredictedTtftConfig {
        timing: StepTimeModel {
            tier_load_ms_per_token: 0.0,
            ..StepTimeModel::default()
        },
        ..PredictedTtftConfig::default()
    };
    for c in [gpu, none] {
        assert_eq!(
            predicted_ttft_cost(&free_loads, &req, &c, 0),
            predicted_ttft_cost(&PredictedTtftConfig::default(), &req, &c, 0)
        );
    }
}

#[test]
fn tier_load_cost_is_validated() {
    for bad in [-0.001, f64::NAN, f64::INFINITY] {
        let c = PredictedTtftConfig {
            timing: StepTimeModel {
                tier_load_ms_per_token: bad,
                ..StepTimeModel::default()
            },
            ..PredictedTtftConfig::default()
        };
        assert!(
            matches!(
                c.validate(),
                Err(SchedulerError::InvalidConfig {
                    field: "policy.predicted_ttft.timing.tier_load_ms_per_token",
                    ..
                })
            ),
            "{bad}"
        );
    }
}
