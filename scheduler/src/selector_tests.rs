//! Unit tests of [`super`]: cost formula, tie-breaking, temperature and baselines.

use super::*;
use kv_events::{DpRank, WorkerId};
use proptest::prelude::*;
use rand::SeedableRng;

fn rank(id: u64, dp: u32) -> WorkerRank {
    WorkerRank::new(WorkerId(id), DpRank(dp))
}

fn cand(id: u64, overlap_blocks: u32, active_decode_blocks: u64) -> Candidate {
    Candidate {
        rank: rank(id, 0),
        overlap_blocks,
        active_decode_blocks,
    }
}

fn kv(overlap_weight: f64, temperature: f64) -> PolicyConfig {
    PolicyConfig::Kv(KvPolicyConfig {
        overlap_weight,
        temperature,
    })
}

fn selector(seed: u64) -> Selector {
    Selector::new(StdRng::seed_from_u64(seed))
}

/// How often each candidate wins over `trials` selections.
fn histogram(
    policy: &PolicyConfig,
    request_blocks: u32,
    cands: &[Candidate],
    trials: usize,
) -> Vec<usize> {
    let mut s = selector(7);
    let mut counts = vec![0; cands.len()];
    for _ in 0..trials {
        counts[s.select(policy, request_blocks, cands).unwrap().index] += 1;
    }
    counts
}

#[test]
fn kv_cost_matches_hand_computation() {
    assert_eq!(kv_cost(1.0, 10, 8, 10), 12.0);
    assert_eq!(kv_cost(1.0, 10, 2, 0), 8.0);
    assert_eq!(kv_cost(2.0, 10, 0, 3), 23.0);
    assert_eq!(kv_cost(0.5, 7, 3, 1), 3.0);
    // Overlap beyond the prompt is a full hit, never negative prefill.
    assert_eq!(kv_cost(1.0, 4, 9, 5), 5.0);
}

#[test]
fn kv_picks_lowest_cost_and_reports_it() {
    // request_blocks 10; costs at weight 1: A 2+10=12, B 8+0=8, C 10+3=13.
    let cands = [cand(1, 8, 10), cand(2, 2, 0), cand(3, 0, 3)];
    let choice = selector(1).select(&kv(1.0, 0.0), 10, &cands).unwrap();
    assert_eq!(
        choice,
        Choice {
            index: 1,
            cost: Some(8.0)
        }
    );
    // At weight 2: A 4+10=14, B 16+0=16, C 20+3=23, so cache wins.
    let choice = selector(1).select(&kv(2.0, 0.0), 10, &cands).unwrap();
    assert_eq!(
        choice,
        Choice {
            index: 0,
            cost: Some(14.0)
        }
    );
}

#[test]
fn best_cache_rank_loses_when_its_decode_load_is_high() {
    // A caches the whole 10-block prompt; B caches nothing and is idle (cost 10).
    let policy = kv(1.0, 0.0);
    let busy = [cand(1, 10, 11), cand(2, 0, 0)];
    assert_eq!(selector(1).select(&policy, 10, &busy).unwrap().index, 1);
    let lighter = [cand(1, 10, 9), cand(2, 0, 0)];
    assert_eq!(selector(1).select(&policy, 10, &lighter).unwrap().index, 0);
}

#[test]
fn zero_overlap_weight_is_pure_load_balance() {
    let cands = [cand(1, 50, 6), cand(2, 0, 2), cand(3, 25, 4)];
    let choice = selector(1).select(&kv(0.0, 0.0), 50, &cands).unwrap();
    assert_eq!(
        choice,
        Choice {
            index: 1,
            cost: Some(2.0)
        }
    );
}

#[test]
fn exact_ties_are_broken_at_random_and_the_worse_rank_never_wins() {
    // request_blocks 5; costs: 0+5=5, 5+0=5, 5+1=6.
    let cands = [cand(1, 5, 5), cand(2, 0, 0), cand(3, 0, 1)];
    let counts = histogram(&kv(1.0, 0.0), 5, &cands, 2000);
    assert_eq!(counts[2], 0);
    assert!(counts[0] > 800 && counts[1] > 800, "{counts:?}");
}

#[test]
fn zero_temperature_is_deterministic_without_ties() {
    let cands = [cand(1, 0, 3), cand(2, 4, 1), cand(3, 2, 0)];
    // Costs at request_blocks 6: 9, 3, 4.
    let counts = histogram(&kv(1.0, 0.0), 6, &cands, 500);
    assert_eq!(counts, vec![0, 500, 0]);
}

#[test]
fn positive_temperature_sometimes_picks_a_worse_rank() {
    // Costs 9, 3, 4 normalize to 1, 0, 1/6; at T=0.5 the weights are
    // e^-2 ≈ 0.135, 1, e^-1/3 ≈ 0.717, so the best wins about 54% of the time.
    let cands = [cand(1, 0, 3), cand(2, 4, 1), cand(3, 2, 0)];
    let counts = histogram(&kv(1.0, 0.5), 6, &cands, 4000);
    assert!(counts[1] > counts[2] && counts[2] > counts[0], "{counts:?}");
    assert!(counts[0] > 100, "{counts:?}");
    assert!((1800..2600).contains(&counts[1]), "{counts:?}");
}

#[test]
fn very_high_temperature_is_roughly_uniform() {
    let cands = [cand(1, 0, 30), cand(2, 4, 1), cand(3, 2, 0), cand(4, 0, 0)];
    let counts = histogram(&kv(1.0, 1e6), 6, &cands, 8000);
    for c in &counts {
        assert!((1600..2400).contains(c), "{counts:?}");
    }
}

#[test]
fn positive_temperature_with_equal_costs_still_covers_all() {
    let cands = [cand(1, 0, 0), cand(2, 0, 0)];
    let counts = histogram(&kv(1.0, 2.0), 3, &cands, 1000);
    assert!(counts[0] > 350 && counts[1] > 350, "{counts:?}");
}

#[test]
fn round_robin_cycles_in_rank_order_across_dp_ranks() {
    let cands: Vec<Candidate> = [rank(1, 0), rank(1, 1), rank(4, 0), rank(4, 1)]
        .into_iter()
        .map(|rank| Candidate {
            rank,
            overlap_blocks: 99,
            active_decode_blocks: 0,
        })
        .collect();
    let mut s = selector(1);
    let picks: Vec<usize> = (0..9)
        .map(|_| {
            s.select(&PolicyConfig::RoundRobin, 4, &cands)
                .unwrap()
                .index
        })
        .collect();
    assert_eq!(picks, vec![0, 1, 2, 3, 0, 1, 2, 3, 0]);

    // The last pick was rank 1/0; if it disappears, the turn passes to the next one.
    let shrunk = &cands[1..];
    let next = s.select(&PolicyConfig::RoundRobin, 4, shrunk).unwrap();
    assert_eq!(shrunk[next.index].rank, rank(1, 1));
    assert_eq!(next.cost, None);
}

#[test]
fn random_covers_every_rank() {
    let cands: Vec<Candidate> = (0..5).map(|i| cand(i, 0, i * 100)).collect();
    let counts = histogram(&PolicyConfig::Random, 3, &cands, 2000);
    for c in &counts {
        assert!(*c > 250, "{counts:?}");
    }
}

#[test]
fn empty_candidate_set_is_no_workers() {
    for policy in [
        kv(1.0, 0.0),
        kv(1.0, 1.0),
        PolicyConfig::RoundRobin,
        PolicyConfig::Random,
    ] {
        assert_eq!(
            selector(1).select(&policy, 3, &[]),
            Err(SchedulerError::NoWorkers)
        );
    }
}

#[test]
fn same_seed_same_choices() {
    let cands = [cand(1, 0, 3), cand(2, 4, 1), cand(3, 2, 0)];
    let run = |seed| {
        let mut s = selector(seed);
        (0..50)
            .map(|_| s.select(&kv(1.0, 0.7), 6, &cands).unwrap().index)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(42), run(42));
}

proptest! {
    /// At temperature 0 the chosen rank always has the minimum cost.
    #[test]
    fn zero_temperature_choice_is_a_minimum(
        loads in proptest::collection::vec((0u32..20, 0u64..50), 1..12),
        request_blocks in 0u32..20,
        weight in 0.0f64..4.0,
        seed in any::<u64>(),
    ) {
        let cands: Vec<Candidate> = loads
            .iter()
            .enumerate()
            .map(|(i, &(o, d))| cand(i as u64, o, d))
            .collect();
        let choice = selector(seed).select(&kv(weight, 0.0), request_blocks, &cands).unwrap();
        let min = cands
            .iter()
            .map(|c| kv_cost(weight, request_blocks, c.overlap_blocks, c.active_decode_blocks))
            .fold(f64::INFINITY, f64::min);
        prop_assert_eq!(choice.cost, Some(min));
    }

    /// With any temperature the choice is in range and its reported cost is its own.
    #[test]
    fn sampled_choice_reports_its_cost(
        loads in proptest::collection::vec((0u32..20, 0u64..50), 1..12),
        temperature in 0.0f64..100.0,
        seed in any::<u64>(),
    ) {
        let cands: Vec<Candidate> = loads
            .iter()
            .enumerate()
            .map(|(i, &(o, d))| cand(i as u64, o, d))
            .collect();
        let choice = selector(seed).select(&kv(1.0, temperature), 10, &cands).unwrap();
        let c = cands[choice.index];
        prop_assert_eq!(choice.cost, Some(kv_cost(1.0, 10, c.overlap_blocks, c.active_decode_blocks)));
    }
}
