//! The bound search (`cost_bound.rs`) against pricing every rank: on random warmed-up
//! fleets (every rank with its own multipliers, bookings whose oldest prefill has
//! decayed by a random fraction at `now`), the search finds the lowest exact
//! `predicted-ttft` cost of a rank that holds none of the prompt, and exactly the
//! ranks at it.

#![allow(clippy::unwrap_used)]

use super::*;
use crate::load::RankLoad;
use crate::policy::Candidate;
use crate::policy::predicted_ttft::{PredictedTtftConfig, predicted_ttft_cost};
use crate::request::RequestShape;
use kv_events::{DpRank, WorkerId};
use proptest::prelude::*;

const BLOCK: u32 = 16;

/// One rank's state: (oldest prefill tokens, fraction of it left at `now` in
/// sixteenths, tokens behind it, active requests, context blocks, multipliers).
type RankState = (u64, u64, u64, u64, u64, (f64, f64, f64));

fn rank_state() -> impl Strategy<Value = RankState> {
    // Few distinct values, so exact ties across ranks and groups are common.
    let multiplier = prop_oneof![Just(1.0), Just(0.8), Just(1.25), 0.5f64..2.0];
    (
        prop_oneof![Just(0u64), 1u64..20_000],
        // Fully left or fully decayed heads often, so bounds are often near exact.
        prop_oneof![Just(0u64), Just(16), 0u64..=16],
        // Short queues too: with a prompt that fits one step, a rank with a fully
        // decayed head has a bound within 1% of its cost, so a search that stops
        // early (at 0.97× the best cost) misses it.
        prop_oneof![Just(0u64), 1u64..20_000, 1u64..2_000],
        0u64..40,
        0u64..2_000,
        (multiplier.clone(), multiplier.clone(), multiplier),
    )
}

/// The exact cost of `state` for a prompt of `n` tokens, as the policy prices a rank
/// with no overlap.
fn exact(config: &PredictedTtftConfig, n: u64, rank: WorkerRank, s: &RankState) -> f64 {
    let &(head, left, rest, requests, context, (p, b, d)) = s;
    let scale = TimingScale {
        prefill: p,
        step_base: b,
        decode: d,
    };
    let own = PredictedTtftConfig {
        timing: config.timing.scaled(scale),
        ..*config
    };
    let request = RequestShape {
        request_blocks: n.div_ceil(u64::from(BLOCK)) as u32,
        num_tokens: n,
        block_size: BLOCK,
    };
    let c = Candidate {
        rank,
        overlap_blocks: 0,
        any_tier_blocks: 0,
        load: RankLoad {
            active_prefill_tokens: rest + head * left / 16,
            active_requests: requests as usize,
            active_context_blocks: context,
            ..RankLoad::default()
        },
        new_blocks: request.request_blocks,
    };
    predicted_ttft_cost(&own, &request, &c, 0)
}

fn terms(s: &RankState) -> RankTerms {
    let &(_, _, rest, requests, context, (p, b, d)) = s;
    RankTerms {
        floor_prefill_tokens: rest,
        total_prefill_tokens: rest + s.0,
        active_requests: requests,
        context_tokens: context * u64::from(BLOCK),
        scale: TimingScale {
            prefill: p,
            step_base: b,
            decode: d,
        },
    }
}

fn rank(i: usize) -> WorkerRank {
    WorkerRank::new(WorkerId(i as u64 / 2), DpRank(i as u32 % 2))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_search_finds_the_exact_lowest_cost_and_its_tie_set(
        states in proptest::collection::vec(rank_state(), 1..120),
        moved in proptest::collection::vec((any::<prop::sample::Index>(), rank_state()), 0..20),
        removed in proptest::collection::vec(any::<prop::sample::Index>(), 0..5),
        skipped in proptest::collection::vec(any::<prop::sample::Index>(), 0..10),
        n in prop_oneof![1u64..30_000, 1u64..4_000],
    ) {
        let config = PredictedTtftConfig::default();
        let timing = config.timing;
        let mut states: Vec<Option<RankState>> = states.into_iter().map(Some).collect();
        let mut index = BoundIndex::default();
        for (i, s) in states.iter().enumerate() {
            index.set(rank(i), &timing, &terms(s.as_ref().unwrap()));
        }
        // Bookings and calibration change some ranks; some are deregistered.
        for (at, s) in moved {
            let i = at.index(states.len());
            index.set(rank(i), &timing, &terms(&s));
            states[i] = Some(s);
        }
        for at in removed {
            let i = at.index(states.len());
            index.remove(rank(i));
            states[i] = None;
        }
        let skipped: Vec<usize> = skipped.iter().map(|at| at.index(states.len())).collect();
        let is_candidate = |i: usize| states[i].is_some() && !skipped.contains(&i);
        let found = index.search(&timing, n, |r| {
            let i = (r.worker_id.0 * 2 + u64::from(r.dp_rank.0)) as usize;
            is_candidate(i).then(|| exact(&config, n, r, states[i].as_ref().unwrap()))
        });
        let costs: Vec<(WorkerRank, f64)> = (0..states.len())
            .filter(|&i| is_candidate(i))
            .map(|i| (rank(i), exact(&config, n, rank(i), states[i].as_ref().unwrap())))
            .collect();
        prop_assert_eq!(index.len(), states.iter().flatten().count());
        let Some(best) = costs.iter().map(|&(_, c)| c).min_by(f64::total_cmp) else {
            prop_assert!(found.is_none());
            return Ok(());
        };
        let found = found.unwrap();
        prop_assert_eq!(found.cost, best);
        let mut want: Vec<WorkerRank> =
            costs.iter().filter(|&&(_, c)| c == best).map(|&(r, _)| r).collect();
        let mut got = found.ranks.clone();
        want.sort_unstable();
        got.sort_unstable();
        prop_assert_eq!(got, want);
    }
}

#[test]
fn a_warmed_fleet_prices_few_ranks() {
    // 4,096 ranks with queues spread over 0..4,095 steps' worth of tokens behind their
    // oldest prefill: only the ranks with the shortest floors are priced.
    let timing = PredictedTtftConfig::default().timing;
    let mut index = BoundIndex::default();
    for i in 0..4_096usize {
        let s: RankState = (
            500,
            8,
            100 * i as u64,
            4,
            100,
            (1.0 + (i % 7) as f64 / 100.0, 1.0, 1.0),
        );
        index.set(rank(i), &timing, &terms(&s));
    }
    let config = PredictedTtftConfig::default();
    let found = index
        .search(&timing, 2_000, |r| {
            let i = (r.worker_id.0 * 2 + u64::from(r.dp_rank.0)) as usize;
            let s: RankState = (
                500,
                8,
                100 * i as u64,
                4,
                100,
                (1.0 + (i % 7) as f64 / 100.0, 1.0, 1.0),
            );
            Some(exact(&config, 2_000, r, &s))
        })
        .unwrap();
    assert_eq!(found.ranks, vec![rank(0)]);
    assert!(found.priced < 16, "priced {} of 4,096", found.priced);
}

#[test]
fn a_rank_popped_later_can_be_the_cheapest_and_ties_are_all_found() {
    // A's bound is the lowest (nothing behind its oldest prefill) but its oldest
    // prefill is still whole at `now`: 0.06 × (1,600 + 1,000) + 9 = 165 ms. B and C
    // have 1,590 tokens queued behind a finished head: 0.06 × 2,590 + 9 = 164.4 ms,
    // a bound within 0.5% of A's cost, so a search that stops early misses them.
    let config = PredictedTtftConfig::default();
    let unit = (1.0, 1.0, 1.0);
    let states: [RankState; 3] = [
        (1_600, 16, 0, 0, 0, unit),
        (0, 0, 1_590, 0, 0, unit),
        (0, 0, 1_590, 0, 0, unit),
    ];
    let mut index = BoundIndex::default();
    for (i, s) in states.iter().enumerate() {
        index.set(rank(i), &config.timing, &terms(s));
    }
    let found = index
        .search(&config.timing, 1_000, |r| {
            let i = (r.worker_id.0 * 2 + u64::from(r.dp_rank.0)) as usize;
            Some(exact(&config, 1_000, r, &states[i]))
        })
        .unwrap();
    let mut got = found.ranks.clone();
    got.sort_unstable();
    assert_eq!(got, vec![rank(1), rank(2)]);
    assert!((found.cost - 164.4).abs() < 1e-9, "cost {}", found.cost);
    assert_eq!(found.priced, 3);
}
