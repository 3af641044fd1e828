//! Tests of the `cache-aware-threshold` policy (`cache_aware::tests`). They drive it through
//! [`super::super::Selector`], so they live in their own file: `cache_aware.rs` itself then
//! imports nothing from `policy/mod.rs`, which imports it.

use super::super::PolicyConfig;
use super::super::test_support::*;
use super::*;

fn policy(cache_threshold: f64, abs: u64, rel: f64) -> PolicyConfig {
    PolicyConfig::CacheAwareThreshold(CacheAwareThresholdConfig {
        cache_threshold,
        balance_abs_threshold: abs,
        balance_rel_threshold: rel,
    })
}

#[test]
fn imbalance_needs_both_thresholds() {
    let c = CacheAwareThresholdConfig::default();
    assert!(!c.imbalanced(0, 64), "64 is not above the absolute 64");
    assert!(c.imbalanced(0, 65));
    assert!(!c.imbalanced(200, 280), "280 is not above 1.5 × 200");
    assert!(c.imbalanced(200, 301));
}

#[test]
fn balanced_load_and_a_good_match_go_to_the_best_match() {
    // 10-block prompt (160 tokens). A matches 4 blocks = 40% > 30%.
    let cands = [
        cand(1, 4, 50, 5, 10),
        cand(2, 1, 0, 0, 10),
        cand(3, 0, 0, 0, 10),
    ];
    let c = ctx(shape(10, 160, 16), &cands);
    let choice = selector(1).select(&policy(0.3, 64, 1.5), &c).unwrap();
    assert_eq!((choice.index, choice.cost), (0, None));
}

#[test]
fn a_weak_match_goes_to_the_least_loaded() {
    // A matches 3 of 10 blocks = 30%, not above 30%: least loaded (C, 0 requests
    // and fewer decode blocks than B).
    let cands = [
        cand(1, 3, 50, 5, 10),
        cand(2, 1, 9, 0, 10),
        cand(3, 0, 2, 0, 10),
    ];
    let c = ctx(shape(10, 160, 16), &cands);
    assert_eq!(histogram(&policy(0.3, 64, 1.5), &c, 50), vec![0, 0, 50]);
}

#[test]
fn imbalanced_load_ignores_even_a_full_match() {
    // Loads 5 and 0 with thresholds 4 (absolute) and 1.5 (relative): imbalanced.
    let cands = [cand(1, 10, 0, 5, 10), cand(2, 0, 0, 0, 10)];
    let c = ctx(shape(10, 160, 16), &cands);
    assert_eq!(
        selector(1).select(&policy(0.3, 4, 1.5), &c).unwrap().index,
        1
    );
    // Same loads under the default thresholds are balanced: the match wins.
    assert_eq!(
        selector(1)
            .select(
                &PolicyConfig::default_for(kv_events::routing::PolicyKind::CacheAwareThreshold),
                &c
            )
            .unwrap()
            .index,
        0
    );
}

#[test]
fn best_match_ties_go_to_the_least_loaded_then_at_random() {
    let cands = [
        cand(1, 6, 0, 3, 10),
        cand(2, 6, 0, 1, 10),
        cand(3, 6, 0, 1, 10),
    ];
    let c = ctx(shape(10, 160, 16), &cands);
    let counts = histogram(&policy(0.3, 64, 1.5), &c, 600);
    assert_eq!(counts[0], 0);
    assert!(counts[1] > 220 && counts[2] > 220, "{counts:?}");
}

#[test]
fn validation_names_the_knob() {
    let bad = CacheAwareThresholdConfig {
        cache_threshold: -0.1,
        ..CacheAwareThresholdConfig::default()
    };
    assert!(matches!(
        bad.validate(),
        Err(SchedulerError::InvalidConfig {
            field: "policy.cache_aware_threshold.cache_threshold",
            ..
        })
    ));
}
