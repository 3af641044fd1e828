//! Tests of the `kv` policy (`kv::tests`). They drive it through
//! [`super::super::Selector`], so they live in their own file: `kv.rs` itself then
//! imports nothing from `policy/mod.rs`, which imports it.

use super::super::PolicyConfig;
use super::super::test_support::*;
use super::*;
use crate::sequences::RankLoad;

fn kv(scale: f64, credit: f64, temperature: f64) -> PolicyConfig {
    PolicyConfig::Kv(KvPolicyConfig {
        prefill_load_scale: scale,
        overlap_credit: credit,
        temperature,
    })
}

fn cfg(scale: f64, credit: f64) -> KvPolicyConfig {
    KvPolicyConfig {
        prefill_load_scale: scale,
        overlap_credit: credit,
        temperature: 0.0,
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
