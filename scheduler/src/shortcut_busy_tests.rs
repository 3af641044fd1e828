//! The bounded shortcut under busy thresholds (`shortcut_busy.rs`) against the full
//! scan: every threshold kind (decode blocks, prefill tokens; absolute or a fraction
//! of each rank's registered capacity), with engine reports of load and time passing
//! across the instants where decaying prefills fall below the prefill threshold.

use super::*;
use crate::config::PrefillDurationModel;

/// A threshold of `amount` units, or the same share of a capacity of `capacity`.
fn threshold(fraction: bool, amount: u64, capacity: u64) -> Threshold {
    if fraction {
        Threshold::Fraction(amount as f64 / capacity as f64)
    } else {
        Threshold::Absolute(amount)
    }
}

/// A warmed-up fleet's config with busy thresholds: decode blocks at `decode` and
/// prefill tokens at `prefill` (each absolute or as a share of 200 blocks / 3,200
/// tokens, about the registered capacity), prefills decaying at `tokens_per_s`.
fn busy_config(
    kv_reuse: bool,
    decode: Option<(bool, u64)>,
    prefill: Option<(bool, u64)>,
    tokens_per_s: f64,
) -> SchedulerConfig {
    let mut c = config(kv_reuse, false);
    c.busy.decode_blocks = decode.map(|(f, n)| threshold(f, n, 200));
    c.busy.prefill_tokens = prefill.map(|(f, n)| threshold(f, n, 200 * u64::from(BLOCK)));
    c.prefill_duration = PrefillDurationModel::Throughput {
        tokens_per_second: tokens_per_s,
    };
    c
}

/// Workers with capacities of 150, 200 or 250 blocks (so a fraction differs by rank).
fn regs(workers: u64, dp_size: u32) -> Vec<WorkerRegistration> {
    (0..workers)
        .map(|id| WorkerRegistration {
            total_kv_blocks: 150 + 50 * (id % 3),
            ..reg(id, dp_size)
        })
        .collect()
}

/// Steps of a busy fleet's history: [`op`]'s, plus short waits (a prefill of 16–190
/// tokens decays over 1–100 ms at the rates below), short steps back in time, and
/// reports of loads around the thresholds below.
fn busy_op() -> impl Strategy<Value = Op> {
    let report = |(rank, decode, prefill)| Op::Report {
        rank,
        decode,
        prefill,
    };
    let load = (
        prop_oneof![Just(0u64), 0..60u64],
        prop_oneof![Just(0u64), 0..300u64],
    );
    prop_oneof![
        6 => op(),
        3 => (0..60u64).prop_map(Op::Wait),
        1 => (0..20u64).prop_map(Op::Back),
        2 => (0..200usize, load.0, load.1).prop_map(report),
    ]
}

/// A busy threshold: off, absolute, or a fraction, of `lo..hi` units.
fn limit(lo: u64, hi: u64) -> impl Strategy<Value = Option<(bool, u64)>> {
    prop_oneof![
        1 => Just(None),
        3 => (any::<bool>(), lo..hi).prop_map(Some),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Under busy thresholds, warmed-up fleets' decisions take the bounded search and
    /// choose what the full scan would.
    #[test]
    fn the_bounded_shortcut_under_busy_thresholds_chooses_what_the_full_scan_would(
        workers in 4..40u64,
        dp_size in 1..3u32,
        kv_reuse in any::<bool>(),
        decode in limit(3, 40),
        prefill in limit(16, 400),
        tokens_per_s in prop_oneof![Just(2_000.0), 1_000.0..20_000.0f64],
        ttfts in prop::collection::vec(prop_oneof![Just(12u64), Just(20), 5..60u64], 1..4),
        cold in prop_oneof![Just(0usize), 1..3usize],
        ops in prop::collection::vec(busy_op(), 1..100),
    ) {
        let c = busy_config(kv_reuse, decode, prefill, tokens_per_s);
        replay_with(c, regs(workers, dp_size), Some((&ttfts, cold)), &ops);
    }
}

/// The busy generator reaches the bounded shortcut, and busy ranks (else the property
/// above checks the index alone).
#[test]
fn busy_warmed_up_histories_take_the_bounded_shortcut() {
    let ops: Vec<Op> = (0..90)
        .map(|i| match i % 6 {
            0..=3 => Op::Route {
                family: i % 4,
                blocks: 3 + i % 5,
                hits: vec![(i as usize, 2, 1)],
            },
            4 => Op::Report {
                rank: i as usize,
                decode: 40 * (i % 2),
                prefill: 0,
            },
            _ => Op::Wait(i % 9),
        })
        .collect();
    for (decode, prefill) in [
        (Some((false, 12)), None),
        (Some((true, 12)), None),
        (None, Some((false, 100))),
        (None, Some((true, 100))),
        (Some((false, 30)), Some((true, 150))),
    ] {
        let c = busy_config(true, decode, prefill, 2_000.0);
        let taken = replay_with(c, regs(16, 2), Some((&[12, 20, 31], 0)), &ops);
        assert!(taken > 45, "{decode:?} {prefill:?}: {taken} of 60");
    }
}

/// A fleet of 8 warmed ranks where rank 0 learned the fastest timing, with a prefill
/// threshold of 100 tokens and prefills decaying at 1,000 tokens/s.
fn fast_rank_fleet() -> (Scheduler, Instant) {
    fleet_of(&[6, 40, 40, 40, 40, 40, 40, 40], 100)
}

/// [`fast_rank_fleet`] with one rank per first token time of `ttfts_ms` and a
/// prefill threshold of `prefill` tokens.
fn fleet_of(ttfts_ms: &[u64], prefill: u64) -> (Scheduler, Instant) {
    let c = busy_config(false, Some((false, 50)), Some((false, prefill)), 1_000.0);
    let mut s = Scheduler::new(c, Some(2)).unwrap();
    for id in 0..ttfts_ms.len() as u64 {
        s.add_worker(reg(id, 1)).unwrap();
    }
    let now = Instant::now();
    warm_up(&mut s, ttfts_ms, 0, now);
    (s, now + Duration::from_secs(1))
}

/// Routes a 2-block prompt `id` at `now` through the shortcut, checked against the
/// full scan; returns the chosen rank index and frees the request.
fn route_checked(s: &mut Scheduler, id: &str, now: Instant) -> usize {
    let req = ScheduleRequest::new(id, vec![LocalBlockHash(9), LocalBlockHash(10)], 32, BLOCK);
    let overlaps = OverlapScores::default();
    let (best, tied) = full_scan(s, &req, &overlaps, now).unwrap();
    s.touched.clear();
    let sel = s.schedule(&req, &overlaps, now).unwrap();
    assert!(!s.touched.is_empty(), "{id}: the bounded search decided");
    assert_eq!(sel.cost, Some(best), "{id}: cost");
    assert!(tied.contains(&sel.rank), "{id}: {} not tied", sel.rank);
    s.free(&RequestId::from(id), now).unwrap();
    s.ranks().iter().position(|&r| r == sel.rank).unwrap()
}

/// Rank 0 (the fastest) is busy while a booked 150-token prefill decays past the
/// 100-token threshold (after 50 ms at 1,000 tokens/s), and is chosen again once it
/// has decayed further (1 token left at 149 ms):
/// a rank must come back to the index at its computed crossing, not at its next event.
#[test]
fn a_rank_busy_by_its_decaying_prefill_comes_back_after_its_crossing() {
    let (mut s, now) = fast_rank_fleet();
    // Every rank touched by a tiny booking elsewhere, so the bounded search decides.
    assert_eq!(route_checked(&mut s, "before", now), 0);
    book_prefill(&mut s, ("long", 0), 150, Duration::from_millis(150), now);
    let rank0 = s.ranks()[0];
    for (ms, busy) in [(0, true), (20, true), (49, true), (51, false), (80, false)] {
        let at = now + Duration::from_millis(ms);
        let chosen = route_checked(&mut s, &format!("at-{ms}"), at);
        assert!(!busy || chosen != 0, "at {ms} ms rank 0 is busy");
        assert_eq!(s.bounded.holds_busy(rank0), busy, "at {ms} ms");
    }
    // 1 token left: the fastest rank wins again.
    let at = now + Duration::from_millis(149);
    assert_eq!(route_checked(&mut s, "at-149", at), 0);
}

/// A report of decode blocks at the threshold takes rank 0 out; a report of none
/// brings it back at once (no booking of its own in between).
#[test]
fn reports_take_a_rank_out_and_bring_it_back() {
    let (mut s, mut now) = fast_rank_fleet();
    let report = |s: &mut Scheduler, decode: u64, prefill: u64, now: Instant| {
        let rank = s.ranks()[0];
        let m = LoadMetrics {
            worker_id: rank.worker_id,
            dp_rank: rank.dp_rank,
            active_decode_blocks: decode,
            active_prefill_tokens: prefill,
            ..LoadMetrics::default()
        };
        assert!(s.update_load_metrics(m, now));
    };
    for (n, (decode, prefill, busy)) in [
        (0, 0, false),
        (50, 0, true),
        (10, 0, false),
        (0, 100, true),
        (0, 99, false),
    ]
    .into_iter()
    .enumerate()
    {
        report(&mut s, decode, prefill, now);
        let chosen = route_checked(&mut s, &format!("r{n}"), now);
        assert_eq!(
            chosen != 0,
            busy,
            "report {decode}/{prefill}: rank 0 busy {busy}"
        );
        assert_eq!(s.bounded.holds_busy(s.ranks()[0]), busy);
        now += Duration::from_millis(5);
    }
}

/// A decision time earlier than one already decided (callers that read the clock
/// before the scheduler's lock): rank 0, back in the index after its decaying prefill
/// fell below the 20-token threshold at 1 ms, is busy again at 0.5 ms and must not be
/// chosen (it would be if free).
#[test]
fn an_earlier_decision_time_sees_a_rank_busy_again() {
    let (mut s, now) = fleet_of(&[6, 40, 40, 40, 40, 40, 40, 40, 400], 20);
    book_prefill(&mut s, ("long", 0), 21, Duration::from_millis(21), now);
    // Ranks 1–7 hold 1 token each, rank 8 (idle, the one added for the smallest
    // backlog) is slow: rank 0, the fastest, is the cheapest at 0.5 ms too when its
    // 20 tokens are not busy, and rank 8 is not the cheapest free rank.
    for i in 1..8 {
        let id = format!("queued-{i}");
        book_prefill(&mut s, (&id, i), 1, Duration::from_secs(100), now);
    }
    let us = |n| now + Duration::from_micros(n);
    assert_ne!(route_checked(&mut s, "at-0", us(0)), 0, "busy at 0 ms");
    // A decision at 20 ms without booking rank 0 (a booking there would re-evaluate
    // it at the next decision): its bound is synced.
    let PolicyConfig::PredictedTtft(policy) = s.config.policy else {
        unreachable!("predicted-ttft")
    };
    s.sync_bound(&policy, BLOCK, us(20_000));
    assert!(!s.bounded.holds_busy(s.ranks()[0]), "free at 20 ms");
    assert_ne!(
        route_checked(&mut s, "at-0.5", us(500)),
        0,
        "busy at 0.5 ms"
    );
    assert_eq!(
        route_checked(&mut s, "at-20", us(20_000)),
        0,
        "1 token left"
    );
}
