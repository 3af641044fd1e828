//! The ranks a stand-in decision prices apart (`Scheduler::price_apart`) against the
//! full scan: fleets where a few ranks learned their own timing (faster or slower than
//! the prior the others share, so a rank left idle may undercut the stand-in), and the
//! delay cap's mean backlog decided by ranks left out of the candidates.

use super::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Most ranks cold (so decisions take the stand-in), `warm` of them with their
    /// own multipliers, sharing them by rank index (ties).
    #[test]
    fn a_few_warm_ranks_among_cold_ones_choose_what_the_full_scan_would(
        workers in 4..40u64,
        dp_size in 1..3u32,
        kv_reuse in any::<bool>(),
        ttfts in prop::collection::vec(prop_oneof![Just(12u64), Just(20), 3..60u64], 1..4),
        warm in 1..4usize,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let ranks = (workers * u64::from(dp_size)) as usize;
        let cold = ranks.saturating_sub(warm);
        replay_from(workers, dp_size, kv_reuse, false, Some((&ttfts, cold)), &ops);
    }
}

/// Two of 16 ranks learned their own timing, one faster and one slower than the
/// prior (their geometric mean) the 14 cold ranks share: with nothing booked and
/// nothing cached, the fast one, priced apart, undercuts the stand-in and wins.
#[test]
fn a_fast_idle_warm_rank_beats_the_stand_in() {
    let mut s = Scheduler::new(config(true, false), Some(7)).unwrap();
    for id in 0..16 {
        s.add_worker(reg(id, 1)).unwrap();
    }
    let now = Instant::now();
    warm_up(&mut s, &[3, 60], 14, now); // rank 14: 3 ms, rank 15: 60 ms
    let now = now + Duration::from_secs(1);
    let hashes = (0..4).map(LocalBlockHash).collect();
    let req = ScheduleRequest::new("q", hashes, 4 * u64::from(BLOCK), BLOCK);
    let overlaps = OverlapScores::default();
    let (best, tied) = full_scan(&mut s, &req, &overlaps, now).unwrap();
    s.touched.clear();
    let sel = s.schedule(&req, &overlaps, now).unwrap();
    assert!(!s.touched.is_empty(), "the shortcut decided");
    assert_eq!(sel.cost, Some(best));
    assert_eq!(tied, vec![s.ranks()[14]], "the fast rank alone is cheapest");
    assert_eq!(sel.rank, s.ranks()[14]);
}

/// A scheduler over `workers` workers of one rank each.
fn fleet(workers: u64, seed: u64) -> Scheduler {
    let mut s = Scheduler::new(config(true, false), Some(seed)).unwrap();
    for id in 0..workers {
        s.add_worker(reg(id, 1)).unwrap();
    }
    s
}

/// Routes a 4-block prompt that rank 0 caches whole, through the shortcut, and checks
/// the choice against the full scan; returns the chosen rank and the full scan's cost
/// of every rank (ms, by registry position; every rank is a candidate here).
fn route_cached_on_rank_0(s: &mut Scheduler, now: Instant, what: &str) -> (WorkerRank, Vec<f64>) {
    let hashes = (0..4).map(LocalBlockHash).collect();
    let req = ScheduleRequest::new("q", hashes, 4 * u64::from(BLOCK), BLOCK);
    let mut overlaps = OverlapScores::default();
    overlaps.scores.insert(s.ranks()[0], 4);
    let (best, tied) = full_scan(s, &req, &overlaps, now).unwrap();
    let cost = |i: usize| s.selector.cost_of(&s.config.policy, i).unwrap();
    let costs: Vec<f64> = (0..s.candidates.len()).map(cost).collect();
    s.touched.clear();
    let sel = s.schedule(&req, &overlaps, now).unwrap();
    assert!(!s.touched.is_empty(), "{what}: the shortcut decided");
    assert_eq!(sel.cost, Some(best), "{what}: costs {costs:?}");
    assert!(tied.contains(&sel.rank), "{what}: {}", sel.rank);
    (sel.rank, costs)
}

/// Rank 0 caches the whole prompt behind a queue long enough that, while the delay
/// cap applies, it is capped and an idle rank wins; rank 1, which holds none of the
/// prompt, is left out of the candidates, but its backlog of `left_out_tokens` still
/// counts in the cap's mean. Ranks 2 and 3 are idle (the stand-in and its twin).
fn decide(left_out_tokens: u64) -> WorkerRank {
    let mut s = fleet(4, 11);
    let now = Instant::now();
    let minute = Duration::from_secs(60);
    book_prefill(&mut s, ("queued", 0), 160, minute, now);
    book_prefill(&mut s, ("other", 1), left_out_tokens, minute, now);
    route_cached_on_rank_0(&mut s, now, &format!("{left_out_tokens} tokens on rank 1")).0
}

/// The cap's gate counts the ranks left out: with a small backlog on rank 1 the mean
/// is under 3 steps (the cap applies, rank 0 is capped), with a large one it is not
/// (rank 0 wins on its cached prompt), and the shortcut agrees with the full scan on
/// both.
#[test]
fn ranks_left_out_still_count_in_the_delay_caps_mean() {
    let rank0 = WorkerRank::new(WorkerId(0), kv_events::DpRank(0));
    assert_ne!(decide(16), rank0, "cap applies: an idle rank");
    assert_eq!(
        decide(400),
        rank0,
        "mean backlog of 3 steps or more: no cap"
    );
}

/// A fleet with no timings of its own where most ranks are booked no longer falls to
/// the full scan: 80 of 100 ranks hold a request (spread over both words of the
/// touched-rank bit set), and every decision takes the shortcut and spreads evenly
/// over the 20 idle ranks, whose stand-in is drawn from the bit set.
#[test]
fn few_idle_ranks_share_the_work_evenly() {
    let mut s = fleet(100, 13);
    let now = Instant::now();
    for i in (0..100).filter(|i| i % 5 != 0) {
        let id = format!("booked-{i}");
        book_prefill(&mut s, (&id, i), 64, Duration::from_secs(60), now);
    }
    let mut chosen: HashMap<u64, u32> = HashMap::new();
    for n in 0..4_000 {
        let id = format!("t{n}");
        let req = ScheduleRequest::new(id.as_str(), vec![LocalBlockHash(n)], 16, BLOCK);
        s.touched.clear();
        let sel = s.schedule(&req, &NoOverlap, now).unwrap();
        assert!(!s.touched.is_empty(), "decision {n}: the shortcut decided");
        *chosen.entry(sel.rank.worker_id.0).or_insert(0) += 1;
        s.free(&RequestId::from(id.as_str()), now).unwrap();
    }
    assert!(
        chosen.keys().all(|w| w % 5 == 0),
        "only idle ranks: {chosen:?}"
    );
    assert_eq!(chosen.len(), 20, "every idle rank: {chosen:?}");
    assert!(
        chosen.values().all(|&c| (120..=280).contains(&c)),
        "about 200 each: {chosen:?}"
    );
}

/// Every rank booked (no idle rank, no stand-in): the rank priced apart with the
/// smallest backlog stays a candidate, since the matching rank's credit reads it,
/// though it is not the cheapest of them. Rank 0 caches the prompt behind a queue;
/// rank 1 has a small backlog and one request; rank 2 no backlog but 400 requests in
/// decode (each step costs more); rank 3 a large backlog.
#[test]
fn with_every_rank_touched_the_smallest_backlog_stays() {
    let mut s = fleet(4, 17);
    let now = Instant::now();
    let minute = Duration::from_secs(60);
    book_prefill(&mut s, ("queued", 0), 100, minute, now);
    book_prefill(&mut s, ("small", 1), 40, minute, now);
    for i in 0..400 {
        book_prefill(&mut s, (&format!("decoding-{i}"), 2), 0, minute, now);
    }
    book_prefill(&mut s, ("large", 3), 3_000, minute, now);
    let (rank, costs) = route_cached_on_rank_0(&mut s, now, "every rank touched");
    assert_eq!(rank, s.ranks()[0], "the cached prompt wins, credited");
    assert!(
        costs[1] < costs[2],
        "the smallest backlog is not the cheapest: {costs:?}"
    );
}
