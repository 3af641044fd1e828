//! Unit tests of the race checks: which question a mismatch asks the router, and how
//! its answer settles the outcome.

use super::*;
use crate::parity::tests::{cached, monitor, outcome};
use kv_events::WorkerId;
use kv_events::routing::PolicyKind;

const BLOCK: u32 = 16;

fn decision(overlap_blocks: u32, kv_position: Option<EventPosition>) -> RouteDecision {
    RouteDecision {
        request_id: "r".into(),
        worker_id: WorkerId(1),
        dp_rank: DpRank(2),
        overlap_blocks,
        request_blocks: 7,
        in_flight_blocks: 0,
        kv_position: kv_position.map(Box::new),
        policy: PolicyKind::Kv,
        disaggregation: None,
        fallbacks: Vec::new(),
    }
}

fn prediction(overlap_blocks: u32, prompt_tokens: u64) -> Prediction {
    Prediction {
        worker: WorkerId(1),
        overlap_blocks,
        in_flight_blocks: 0,
        block_size: BLOCK,
        prompt_tokens,
    }
}

/// The check `prediction` asks about an answer reporting `cached` tokens.
fn check_of(race: &Race, prediction: &Prediction, cached: u64) -> Option<Check> {
    let judged = prediction.judge(super::super::tests::cached(
        cached,
        prediction.prompt_tokens,
    ));
    race.check(prediction, &judged.expect("reported"))
}

const AFTER: EventPosition = EventPosition {
    epoch: 1,
    event_id: 5,
};

/// Without a router to ask, a mismatch is judged at once; an over-claim asks from the
/// first block the engine did not serve, at most `MAX_REMOVAL_HASHES` of them, and
/// only with a position to ask after.
#[test]
fn an_over_claim_asks_from_the_first_unserved_block() {
    let (m, registry, _) = monitor(BLOCK);
    let tokens: Arc<[u32]> = (0..100).collect();
    let pending = m.pending(WorkerId(1), 4, 0, 100).expect("registered");
    let pending = pending.with_race(&decision(4, Some(AFTER)), &tokens);
    assert!(
        pending.race.is_none(),
        "a monitor without a router keeps nothing"
    );
    pending.judge(cached(32, 100));
    assert_eq!(outcome(&registry, "over_claim"), 1.0);

    let race = Race::new(&decision(4, Some(AFTER)), &tokens, BLOCK).expect("6 full blocks");
    let Some(Check::Removals(query)) = check_of(&race, &prediction(4, 100), 32) else {
        panic!("an over-claim asks about removals");
    };
    assert_eq!((query.dp_rank, query.after), (DpRank(2), AFTER));
    let hashes = kv_events::compute_block_hashes(&tokens[32..64], BLOCK);
    assert_eq!(query.block_hashes, hashes);
    let unplaced = Race::new(&decision(4, None), &tokens, BLOCK).expect("6 full blocks");
    assert_eq!(check_of(&unplaced, &prediction(4, 100), 32), None);

    let blocks = MAX_REMOVAL_HASHES as u32 + 10;
    let long: Arc<[u32]> = (0..(blocks + 1) * BLOCK).collect();
    let race = Race::new(&decision(blocks, Some(AFTER)), &long, BLOCK).expect("a prefix");
    let asked = |served: u32| match check_of(
        &race,
        &prediction(blocks, long.len() as u64),
        u64::from(served * BLOCK),
    ) {
        Some(Check::Removals(q)) => q.block_hashes.len(),
        other => panic!("{other:?}"),
    };
    assert_eq!(asked(0), MAX_REMOVAL_HASHES);
    assert_eq!(asked(20), MAX_REMOVAL_HASHES - 10);
}

/// An under-claim asks for the prefix the engine served (rounded up to whole blocks),
/// with no position needed and from a 0-block prediction too; a prefix longer than the
/// hashes kept is not asked about. Agreement and hits in flight ask nothing.
#[test]
fn an_under_claim_asks_for_the_prefix_the_engine_served() {
    let tokens: Arc<[u32]> = (0..100).collect();
    let race = Race::new(&decision(0, None), &tokens, BLOCK).expect("6 full blocks");
    let Some(Check::Overlap(query)) = check_of(&race, &prediction(0, 100), 48) else {
        panic!("an under-claim asks about the overlap now");
    };
    assert_eq!((query.worker_id, query.dp_rank), (WorkerId(1), DpRank(2)));
    let hashes = kv_events::compute_block_hashes(&tokens[..48], BLOCK);
    assert_eq!(query.block_hashes, hashes);
    let Some(Check::Overlap(query)) = check_of(&race, &prediction(1, 100), 40) else {
        panic!("an under-claim");
    };
    assert_eq!(query.block_hashes.len(), 3, "40 tokens need 3 blocks");
    assert_eq!(check_of(&race, &prediction(3, 100), 48), None, "agreement");
    let mut booked = prediction(1, 100);
    booked.in_flight_blocks = 2;
    assert_eq!(check_of(&race, &booked, 48), None, "in flight");

    let blocks = MAX_OVERLAP_HASHES as u32 + 2;
    let long: Arc<[u32]> = (0..blocks * BLOCK).collect();
    let race = Race::new(&decision(0, None), &long, BLOCK).expect("a prefix");
    assert_eq!(
        race.reusable,
        MAX_OVERLAP_HASHES * BLOCK as usize,
        "the tokens kept are bounded"
    );
    let served = |blocks: usize| {
        prediction(0, long.len() as u64).judge(cached(
            (blocks as u64) * u64::from(BLOCK),
            long.len() as u64,
        ))
    };
    let at_bound = served(MAX_OVERLAP_HASHES).expect("reported");
    assert!(
        race.check(&prediction(0, long.len() as u64), &at_bound)
            .is_some()
    );
    let past = served(MAX_OVERLAP_HASHES + 1).expect("reported");
    assert_eq!(race.check(&prediction(0, long.len() as u64), &past), None);
    assert_eq!(
        Race::new(&decision(0, None), &Arc::from(&tokens[..16]), BLOCK),
        None,
        "no full block before the last token"
    );
}

/// The index confirms an under-claim only when it holds every block the engine
/// served, from KV events (an approximate router indexes its own decisions).
#[test]
fn the_index_confirms_only_the_whole_served_prefix_from_kv_events() {
    let query = OverlapQuery {
        worker_id: WorkerId(1),
        dp_rank: DpRank(0),
        block_hashes: vec![LocalBlockHash(1); 3],
    };
    let answer = |overlap_blocks, approximate| OverlapAnswer {
        overlap_blocks,
        kv_position: None,
        approximate,
    };
    assert!(confirms(&query, &answer(3, false)));
    assert!(confirms(&query, &answer(4, false)));
    assert!(!confirms(&query, &answer(2, false)));
    assert!(!confirms(&query, &answer(3, true)));
}

/// A race the router confirms settles an over-claim as `evicted`, an under-claim as
/// `in_flight`; no answer or a denial leaves both.
#[test]
fn a_confirmed_race_settles_the_mismatch_and_nothing_else_does() {
    use Outcome::*;
    assert_eq!(settled(OverClaim, Ok(true)), Evicted);
    assert_eq!(settled(UnderClaim, Ok(true)), InFlight);
    for outcome in [OverClaim, UnderClaim] {
        assert_eq!(settled(outcome, Ok(false)), outcome);
        assert_eq!(settled(outcome, Err("no answer".into())), outcome);
    }
}

/// The per-answer cost of keeping a race, A/B alternated in one run: [`Race::new`]
/// (one reference to the prompt's token ids; a copy of them until `448ed8a`'s
/// successor) against hashing the reusable blocks on every
/// answer instead (what keeping 8-byte hashes would cost), on prompts of 2k, 8k and 32k
/// tokens at 16- and 512-token blocks. Prints ns per answer; asserts nothing about
/// time. Run: `cargo test --release -p kv-gateway --lib race_cost -- --ignored
/// --nocapture`.
#[test]
#[ignore = "a measurement, not a test"]
fn race_cost() {
    use std::hint::black_box;
    use std::time::Instant;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let per_answer = |reps: usize, mut f: Box<dyn FnMut() + '_>| {
        let start = Instant::now();
        for _ in 0..reps {
            f();
        }
        start.elapsed().as_nanos() as f64 / reps as f64
    };
    for block in [16u32, 512] {
        for len in [2_048usize, 8_192, 32_768] {
            let tokens: Arc<[u32]> = (0..len as u32)
                .map(|t| t.wrapping_mul(2_654_435_761))
                .collect();
            let reusable = (len - 1) / block as usize * block as usize;
            let reps = 100_000_000 / len;
            let (mut copied, mut hashed) = (Vec::new(), Vec::new());
            for _ in 0..5 {
                let decision = decision(0, Some(AFTER));
                copied.push(per_answer(
                    reps,
                    Box::new(|| {
                        black_box(Race::new(&decision, black_box(&tokens), block));
                    }),
                ));
                hashed.push(per_answer(
                    reps,
                    Box::new(|| {
                        let hashes: Box<[LocalBlockHash]> =
                            compute_block_hashes(&black_box(&tokens)[..reusable], block).into();
                        black_box(hashes);
                    }),
                ));
            }
            let (c, h) = (median(copied), median(hashed));
            println!(
                "block {block:>3}, {len:>6} tokens: tokens kept {c:>8.0} ns, blocks hashed {h:>8.0} ns per answer (hashing {:.1}x)",
                h / c
            );
        }
    }
}
