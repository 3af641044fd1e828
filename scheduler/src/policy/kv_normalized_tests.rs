//! Tests of the `kv-normalized` policy (`kv_normalized::tests`). They drive it through
//! [`super::super::Selector`], so they live in their own file: `kv_normalized.rs` itself then
//! imports nothing from `policy/mod.rs`, which imports it.

use super::super::test_support::*;
use super::super::{Candidate, PolicyConfig};
use super::*;
use crate::sequences::RankLoad;

/// Candidate with overlap blocks, active requests and active (uncached) tokens.
fn rank_state(id: u64, overlap: u32, requests: usize, tokens: u64) -> Candidate {
    Candidate {
        load: RankLoad {
            active_requests: requests,
            active_uncached_tokens: tokens,
            ..RankLoad::default()
        },
        ..cand(id, overlap, 0, requests, 0)
    }
}

fn policy(beta: f64, temperature: f64) -> PolicyConfig {
    PolicyConfig::KvNormalized(KvNormalizedConfig {
        load_balance_weight: beta,
        temperature,
        ..KvNormalizedConfig::default()
    })
}

#[test]
fn score_matches_hand_computation() {
    let c = KvNormalizedConfig::default();
    // 1000 tokens, 600 cached, rank holds 300 of 1200 active tokens:
    // 400 + 1 × 300 / 1200 × 1000 = 650.
    assert_eq!(score(&c, 1000, 600, 300, 1200.0), 650.0);
    // Idle cluster: denominator floors at the request, load term 0.
    assert_eq!(score(&c, 1000, 0, 0, 1000.0), 1000.0);
    let half = KvNormalizedConfig {
        load_balance_weight: 0.5,
        ..c
    };
    assert_eq!(score(&half, 1000, 600, 300, 1200.0), 525.0);
}

#[test]
fn fair_share_cap_follows_tensorrt_llm() {
    let c = KvNormalizedConfig::default();
    // 4 ranks, 6 active + 2 new = 8 → fair 2 → cap 4.
    assert_eq!(fair_share_cap(&c, [3, 1, 2, 0].into_iter(), 2), 4);
    // The busiest rank already exceeds 2 × fair: cap = its count.
    assert_eq!(fair_share_cap(&c, [9, 0, 0, 0].into_iter(), 1), 9);
    // Idle cluster, one request: fair 1, cap 2.
    assert_eq!(fair_share_cap(&c, [0, 0].into_iter(), 1), 2);
}

#[test]
fn cache_wins_when_load_is_balanced_and_load_wins_when_not() {
    // 64 tokens per block; request of 4 blocks = 256 tokens.
    // A caches 3 blocks (192 tokens), both ranks hold 100 active tokens:
    // A: 64 + 100/256×256 = 164; B: 256 + 100 = 356.
    let cands = [rank_state(1, 3, 1, 100), rank_state(2, 0, 1, 100)];
    let c = ctx(shape(4, 256, 64), &cands);
    let choice = selector(1).select(&policy(1.0, 0.0), &c).unwrap();
    assert_eq!((choice.index, choice.cost), (0, Some(164.0)));
    // A holds 1000 active tokens, B none: denominator 1000;
    // A: 64 + 1000/1000×256 = 320; B: 256 + 0 = 256.
    let cands = [rank_state(1, 3, 1, 1000), rank_state(2, 0, 0, 0)];
    let c = ctx(shape(4, 256, 64), &cands);
    let choice = selector(1).select(&policy(1.0, 0.0), &c).unwrap();
    assert_eq!((choice.index, choice.cost), (1, Some(256.0)));
}

#[test]
fn weak_matches_are_ignored() {
    // 20 blocks of 16 tokens = 320 tokens; A matches 2 blocks = 32 tokens = 10%,
    // not above the 10% threshold, so both score as uncached: A 320 + 50,
    // B 320 + 40, and the lighter rank wins.
    let cands = [rank_state(1, 2, 1, 50), rank_state(2, 0, 1, 40)];
    let c = ctx(shape(20, 320, 16), &cands);
    assert_eq!(selector(1).select(&policy(1.0, 0.0), &c).unwrap().index, 1);
    // At 3 blocks (15%) the match counts: A 272 + 50/320×320 = 322 < B 320 + 40.
    let cands = [rank_state(1, 3, 1, 50), rank_state(2, 0, 1, 40)];
    let c = ctx(shape(20, 320, 16), &cands);
    assert_eq!(selector(1).select(&policy(1.0, 0.0), &c).unwrap().index, 0);
}

#[test]
fn capped_ranks_are_skipped_even_with_the_best_cache() {
    // 3 ranks, 6 active + 1 new → fair 3 → cap 6: A with 6 requests is out.
    let cands = [
        rank_state(1, 4, 6, 10),
        rank_state(2, 0, 0, 0),
        rank_state(3, 0, 0, 0),
    ];
    let c = ctx(shape(4, 64, 16), &cands);
    let counts = histogram(&policy(1.0, 0.0), &c, 400);
    assert_eq!(counts[0], 0);
    // Equal scores and equal active tokens: a uniform tie between B and C.
    assert!(counts[1] > 140 && counts[2] > 140, "{counts:?}");
}

#[test]
fn score_ties_prefer_fewer_active_tokens() {
    // β = 0: scores are just uncached tokens, equal; B has fewer active tokens.
    let cands = [rank_state(1, 0, 1, 90), rank_state(2, 0, 1, 10)];
    let c = ctx(shape(2, 32, 16), &cands);
    assert_eq!(histogram(&policy(0.0, 0.0), &c, 100), vec![0, 100]);
}

#[test]
fn temperature_samples_among_eligible_ranks() {
    let cands = [rank_state(1, 3, 1, 100), rank_state(2, 0, 1, 100)];
    let c = ctx(shape(4, 256, 64), &cands);
    let counts = histogram(&policy(1.0, 1.0), &c, 2000);
    // Normalized scores 0 and 1: P(B) = e^-1 / (1 + e^-1) ≈ 0.27.
    assert!((400..700).contains(&counts[1]), "{counts:?}");
}

#[test]
fn validation_names_the_knob() {
    let bad = KvNormalizedConfig {
        fair_share_multiplier: 0.5,
        ..KvNormalizedConfig::default()
    };
    assert!(matches!(
        bad.validate(),
        Err(SchedulerError::InvalidConfig {
            field: "policy.kv_normalized.fair_share_multiplier",
            ..
        })
    ));
    let bad = KvNormalizedConfig {
        match_rate_threshold: 1.5,
        ..KvNormalizedConfig::default()
    };
    assert!(bad.validate().is_err());
    assert!(KvNormalizedConfig::default().validate().is_ok());
}
