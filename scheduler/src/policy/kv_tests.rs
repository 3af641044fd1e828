//! Tests of the `kv` policy (`kv::tests`). They drive it through
//! [`super::super::Selector`], so they live in their own file: `kv.rs` itself then
//! imports nothing from `policy/mod.rs`, which imports it.

use super::super::test_support::*;
use super::super::{PolicyConfig, Selector};
use super::*;
use crate::sequences::RankLoad;

fn kv(scale: f64, credit: f64, temperature: f64) -> PolicyConfig {
    PolicyConfig::Kv(KvPolicyConfig {
        prefill_load_scale: scale,
        overlap_credit: credit,
        temperature,
        ..KvPolicyConfig::default()
    })
}

fn cfg(scale: f64, credit: f64) -> KvPolicyConfig {
    KvPolicyConfig {
        prefill_load_scale: scale,
        overlap_credit: credit,
        temperature: 0.0,
        ..KvPolicyConfig::default()
    }
}

#[test]
fn cost_matches_hand_computation() {
    let req = shape(10, 160, 16);
    // No pending prefill, every request block new.
    assert_eq!(
        kv_cost(&cfg(1.0, 1.0), &req, &cand(1, 8, 10, 0, 10)),
        2.0 + 20.0
    );
    assert_eq!(
        kv_cost(&cfg(2.0, 1.0), &req, &cand(1, 0, 3, 0, 10)),
        20.0 + 13.0
    );
    assert_eq!(
        kv_cost(&cfg(0.5, 1.0), &req, &cand(1, 4, 1, 0, 10)),
        3.0 + 11.0
    );
    // Half credit per cached block: 10 − 0.5 × 8 = 6 uncached blocks.
    assert_eq!(
        kv_cost(&cfg(1.0, 0.5), &req, &cand(1, 8, 0, 0, 10)),
        6.0 + 10.0
    );
    // Credit beyond the prompt never goes negative.
    assert_eq!(kv_cost(&cfg(1.0, 3.0), &req, &cand(1, 8, 5, 0, 10)), 15.0);
    // Pending prefill: 96 tokens at 16 tokens per block = 6 blocks, weighted.
    let mut c = cand(1, 10, 2, 1, 4);
    c.load = RankLoad {
        active_prefill_tokens: 96,
        ..c.load
    };
    assert_eq!(kv_cost(&cfg(2.0, 1.0), &req, &c), 2.0 * 6.0 + 2.0 + 4.0);
}

#[test]
fn picks_lowest_cost_and_reports_it() {
    // Costs at scale 1: A 2+10+10=22, B 8+0+10=18, C 10+3+10=23.
    let cands = [
        cand(1, 8, 10, 0, 10),
        cand(2, 2, 0, 0, 10),
        cand(3, 0, 3, 0, 10),
    ];
    let c = ctx(shape(10, 160, 16), &cands);
    let choice = selector(1).select(&kv(1.0, 1.0, 0.0), &c).unwrap();
    assert_eq!((choice.index, choice.cost), (1, Some(18.0)));
    // At scale 2: A 4+20=24, B 16+10=26, C 20+13=33, so the cache wins.
    let choice = selector(1).select(&kv(2.0, 1.0, 0.0), &c).unwrap();
    assert_eq!((choice.index, choice.cost), (0, Some(24.0)));
}

#[test]
fn best_cache_rank_loses_when_its_decode_load_is_high() {
    // A caches the whole 10-block prompt; B caches nothing and is idle (cost 20).
    let busy = [cand(1, 10, 11, 0, 10), cand(2, 0, 0, 0, 10)];
    let c = ctx(shape(10, 160, 16), &busy);
    assert_eq!(selector(1).select(&kv(1.0, 1.0, 0.0), &c).unwrap().index, 1);
    let lighter = [cand(1, 10, 9, 0, 10), cand(2, 0, 0, 0, 10)];
    let c = ctx(shape(10, 160, 16), &lighter);
    assert_eq!(selector(1).select(&kv(1.0, 1.0, 0.0), &c).unwrap().index, 0);
}

#[test]
fn shared_active_prefix_makes_a_rank_cheaper_under_kv_reuse() {
    // Same cache and load, but rank 2 already runs 6 of this prompt's 8 blocks.
    let cands = [cand(1, 4, 12, 1, 8), cand(2, 4, 12, 1, 2)];
    let c = ctx(shape(8, 128, 16), &cands);
    let choice = selector(1).select(&kv(1.0, 1.0, 0.0), &c).unwrap();
    assert_eq!((choice.index, choice.cost), (1, Some(4.0 + 14.0)));
}

#[test]
fn ties_are_random_and_temperature_spreads() {
    // Costs: 0+5+5=10, 5+0+5=10, 5+1+5=11.
    let cands = [
        cand(1, 5, 5, 0, 5),
        cand(2, 0, 0, 0, 5),
        cand(3, 0, 1, 0, 5),
    ];
    let c = ctx(shape(5, 80, 16), &cands);
    let counts = histogram(&kv(1.0, 1.0, 0.0), &c, 2000);
    assert_eq!(counts[2], 0);
    assert!(counts[0] > 800 && counts[1] > 800, "{counts:?}");
    let counts = histogram(&kv(1.0, 1.0, 1.0), &c, 3000);
    assert!(
        counts[2] > 300,
        "temperature 1 sometimes picks the worse: {counts:?}"
    );
}

#[test]
fn validation_names_the_knob() {
    let bad = KvPolicyConfig {
        overlap_credit: -1.0,
        ..KvPolicyConfig::default()
    };
    assert!(matches!(
        bad.validate(),
        Err(SchedulerError::InvalidConfig {
            field: "policy.kv.overlap_credit",
            ..
        })
    ));
    let bad = KvPolicyConfig {
        temperature: f64::INFINITY,
        ..KvPolicyConfig::default()
    };
    assert!(bad.validate().is_err());
    let old: KvPolicyConfig = serde_json::from_str(r#"{"overlap_weight": 2.5}"#).unwrap();
    assert_eq!(old.prefill_load_scale, 2.5, "the old knob name still reads");
}

#[test]
fn a_gpu_prefix_beats_a_cpu_prefix_beats_none() {
    // Three level ranks; 8 of the 10 prompt blocks are held on the GPU by A, only on
    // a lower tier by B (offloaded to CPU, evicted from the GPU), nowhere by C.
    let req = shape(10, 160, 16);
    let gpu = cand(1, 8, 4, 1, 10);
    let cpu = on_any_tier(cand(2, 0, 4, 1, 10), 8);
    let none = cand(3, 0, 4, 1, 10);
    let k = KvPolicyConfig::default();
    // Prefill blocks: A 10 − 8 = 2, B 10 − 0.5 × 8 = 6, C 10; plus 4 + 10 decode.
    assert_eq!(kv_cost(&k, &req, &gpu), 2.0 + 14.0);
    assert_eq!(kv_cost(&k, &req, &cpu), 6.0 + 14.0);
    assert_eq!(kv_cost(&k, &req, &none), 10.0 + 14.0);
    let mut s = selector(5);
    let pick = |s: &mut Selector, cands: &[Candidate]| {
        s.select(&PolicyConfig::Kv(k), &ctx(req, cands))
            .unwrap()
            .index
    };
    assert_eq!(pick(&mut s, &[none, cpu, gpu]), 2, "GPU beats CPU and none");
    assert_eq!(pick(&mut s, &[none, cpu]), 1, "CPU beats none");
    // Blocks on the GPU beyond which more sit on CPU: 4 on the GPU and 4 more on CPU
    // cost 10 − 4 − 0.5 × 4 = 4 prefill blocks.
    let mixed = on_any_tier(cand(4, 4, 4, 1, 10), 8);
    assert_eq!(kv_cost(&k, &req, &mixed), 4.0 + 14.0);
    // Weight 0 ignores lower tiers: the GPU-only cost.
    let gpu_only = KvPolicyConfig {
        lower_tier_credit: 0.0,
        ..k
    };
    assert_eq!(kv_cost(&gpu_only, &req, &cpu), kv_cost(&k, &req, &none));
}

#[test]
fn lower_tier_credit_is_a_fraction() {
    for bad in [-0.1, 1.5, f64::NAN] {
        let c = KvPolicyConfig {
            lower_tier_credit: bad,
            ..KvPolicyConfig::default()
        };
        assert!(
            matches!(
                c.validate(),
                Err(SchedulerError::InvalidConfig {
                    field: "policy.kv.lower_tier_credit",
                    ..
                })
            ),
            "{bad}"
        );
    }
    let edge = KvPolicyConfig {
        lower_tier_credit: 1.0,
        ..KvPolicyConfig::default()
    };
    assert!(edge.validate().is_ok());
}
