//! Tests of the baseline policy functions (`baseline::tests`). They drive it through
//! [`super::super::Selector`], so they live in their own file: `baseline.rs` itself then
//! imports nothing from `policy/mod.rs`, which imports it.

use super::super::PolicyConfig;
use super::super::test_support::*;
use super::*;
use crate::sequences::RankLoad;

#[test]
fn round_robin_cycles_in_rank_order_across_dp_ranks() {
    let cands: Vec<Candidate> = [rank(1, 0), rank(1, 1), rank(4, 0), rank(4, 1)]
        .into_iter()
        .map(|rank| Candidate {
            rank,
            ..cand(0, 99, 0, 0, 4)
        })
        .collect();
    let c = ctx(shape(4, 64, 16), &cands);
    let mut s = selector(1);
    let picks: Vec<usize> = (0..9)
        .map(|_| s.select(&PolicyConfig::RoundRobin, &c).unwrap().index)
        .collect();
    assert_eq!(picks, vec![0, 1, 2, 3, 0, 1, 2, 3, 0]);
    // The last pick was rank 1/0; if it disappears, the turn passes to the next one.
    let shrunk = ctx(shape(4, 64, 16), &cands[1..]);
    let next = s.select(&PolicyConfig::RoundRobin, &shrunk).unwrap();
    assert_eq!(cands[1 + next.index].rank, rank(1, 1));
    assert_eq!(next.cost, None);
}

#[test]
fn random_covers_every_rank() {
    let cands: Vec<Candidate> = (0..5).map(|i| cand(i, 0, i * 100, 0, 3)).collect();
    let counts = histogram(&PolicyConfig::Random, &ctx(shape(3, 48, 16), &cands), 2000);
    for c in &counts {
        assert!(*c > 250, "{counts:?}");
    }
}

#[test]
fn least_loaded_counts_decode_blocks_and_queued_prefill() {
    let mut a = cand(1, 9, 10, 1, 4);
    a.load = RankLoad {
        active_prefill_tokens: 0,
        ..a.load
    };
    let mut b = cand(2, 0, 4, 1, 4);
    // 4 decode blocks + 128/16 = 8 prefill blocks = 12 > A's 10.
    b.load = RankLoad {
        active_prefill_tokens: 128,
        ..b.load
    };
    let c3 = cand(3, 0, 10, 3, 4);
    let cands = [a, b, c3];
    // A and C tie at 10 blocks; A has fewer requests.
    let counts = histogram(
        &PolicyConfig::LeastLoaded,
        &ctx(shape(4, 64, 16), &cands),
        100,
    );
    assert_eq!(counts, vec![100, 0, 0]);
    assert_eq!(load_blocks(&b, 16), 12.0);
}

#[test]
fn least_loaded_ties_are_random() {
    let cands = [cand(1, 0, 3, 1, 4), cand(2, 5, 3, 1, 4)];
    let counts = histogram(
        &PolicyConfig::LeastLoaded,
        &ctx(shape(4, 64, 16), &cands),
        1000,
    );
    assert!(counts[0] > 400 && counts[1] > 400, "{counts:?}");
}
