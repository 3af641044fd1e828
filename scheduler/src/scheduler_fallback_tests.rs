//! Unit tests of a request's eligible set and of the fallbacks of a decision.

use super::tests::{rank, request, scheduler, with_policy};
use super::*;
use kv_events::RequestId;
use std::collections::HashMap;

fn eligible(mut req: ScheduleRequest, workers: &[u64]) -> ScheduleRequest {
    req.restrict_to(workers.iter().map(|&w| WorkerId(w)).collect());
    req
}

fn asking(mut req: ScheduleRequest, fallbacks: u8) -> ScheduleRequest {
    req.fallbacks = fallbacks;
    req
}

fn workers(sel: &Selection) -> Vec<u64> {
    sel.fallbacks.iter().map(|f| f.rank.worker_id.0).collect()
}

#[test]
fn only_eligible_workers_are_chosen_under_every_policy() {
    let t = Instant::now();
    for policy in PolicyKind::ALL {
        let mut s = scheduler(
            with_policy(PolicyConfig::default_for(policy)),
            &[(1, 1), (2, 2), (3, 1), (4, 1)],
        );
        // Worker 1 holds the prompt; only 2 and 4 are eligible (duplicates and order
        // do not matter).
        let overlaps = HashMap::from([(rank(1, 0), 5)]);
        for i in 0..12 {
            let req = eligible(request(&format!("{policy}-{i}"), 80), &[4, 2, 4]);
            let sel = s.schedule(&req, &overlaps, t).unwrap();
            assert!(
                [2, 4].contains(&sel.rank.worker_id.0),
                "{policy}: {}",
                sel.rank
            );
        }
        // None registered inside, or every one inside excluded: nothing is booked.
        let outside = eligible(request(&format!("{policy}-out"), 80), &[9]);
        assert_eq!(
            s.schedule(&outside, &overlaps, t),
            Err(SchedulerError::AllExcluded)
        );
        let mut excluded = eligible(request(&format!("{policy}-ex"), 80), &[2]);
        excluded.exclude(vec![WorkerId(2)]);
        assert_eq!(
            s.schedule(&excluded, &overlaps, t),
            Err(SchedulerError::AllExcluded)
        );
        assert_eq!(s.active_requests(), 12, "{policy}");
    }
}

#[test]
fn fallbacks_follow_the_choice_cost_one_per_other_worker() {
    let t = Instant::now();
    for policy in [
        PolicyKind::Kv,
        PolicyKind::KvNormalized,
        PolicyKind::PredictedTtft,
    ] {
        let mut s = scheduler(
            with_policy(PolicyConfig::default_for(policy)),
            &[(1, 1), (2, 2), (3, 1), (4, 1)],
        );
        // Worker 3 holds most of the prompt, worker 2 (both ranks) some, worker 1 a
        // little, worker 4 nothing.
        let overlaps = HashMap::from([
            (rank(3, 0), 8),
            (rank(2, 0), 5),
            (rank(2, 1), 4),
            (rank(1, 0), 2),
        ]);
        let sel = s
            .schedule(
                &asking(request(&format!("{policy}-a"), 160), 4),
                &overlaps,
                t,
            )
            .unwrap();
        assert_eq!(sel.rank, rank(3, 0), "{policy}");
        assert_eq!(
            workers(&sel),
            [2, 1, 4],
            "{policy}: every other worker once"
        );
        let first = sel.fallbacks.iter().next().unwrap();
        assert_eq!((first.rank, first.overlap_blocks), (rank(2, 0), 5));
        // Two asked, two given; none asked, none given.
        let two = s
            .schedule(
                &asking(request(&format!("{policy}-b"), 160), 2),
                &overlaps,
                t,
            )
            .unwrap();
        assert_eq!(two.fallbacks.len(), 2, "{policy}");
        let none = s
            .schedule(&request(&format!("{policy}-c"), 160), &overlaps, t)
            .unwrap();
        assert!(none.fallbacks.is_empty(), "{policy}");
        // Within an eligible set, the alternates stay inside it too.
        let inside = eligible(asking(request(&format!("{policy}-d"), 160), 4), &[1, 4]);
        let sel = s.schedule(&inside, &overlaps, t).unwrap();
        assert_eq!(sel.rank, rank(1, 0), "{policy}");
        assert_eq!(workers(&sel), [4], "{policy}");
    }
}

#[test]
fn fallbacks_without_a_cost_go_by_booked_load() {
    let t = Instant::now();
    let mut s = scheduler(
        with_policy(PolicyConfig::RoundRobin),
        &[(1, 1), (2, 1), (3, 1)],
    );
    let none = HashMap::<WorkerRank, u32>::new();
    // Round robin books 1, then 2; the third request (on 3) lists 1 and 2 by load:
    // worker 1 carries the smaller booking.
    s.schedule(&request("small", 16), &none, t).unwrap();
    s.schedule(&request("large", 320), &none, t).unwrap();
    let sel = s.schedule(&asking(request("x", 32), 3), &none, t).unwrap();
    assert_eq!(sel.rank, rank(3, 0));
    assert_eq!(workers(&sel), [1, 2]);
}

/// A fleet of idle ranks is where `predicted-ttft` takes the stand-in shortcut: an
/// eligible set or fallbacks must see every rank instead.
#[test]
fn the_shortcut_gives_way_to_an_eligible_set_and_to_fallbacks() {
    let t = Instant::now();
    let fleet: Vec<(u64, u32)> = (1..=40).map(|w| (w, 1)).collect();
    let mut s = scheduler(
        with_policy(PolicyConfig::default_for(PolicyKind::PredictedTtft)),
        &fleet,
    );
    let overlaps = HashMap::from([(rank(1, 0), 3)]);
    for i in 0..20 {
        let id = format!("e{i}");
        let sel = s
            .schedule(&eligible(request(&id, 80), &[7, 30]), &overlaps, t)
            .unwrap();
        assert!([7, 30].contains(&sel.rank.worker_id.0), "{}", sel.rank);
        s.free(&RequestId::from(id.as_str()), t).unwrap();
    }
    let sel = s
        .schedule(&asking(request("f", 80), 4), &overlaps, t)
        .unwrap();
    assert_eq!(sel.rank, rank(1, 0));
    let listed = workers(&sel);
    assert_eq!(
        listed.len(),
        4,
        "every idle worker is an alternate: {listed:?}"
    );
    assert!(!listed.contains(&1), "{listed:?}");
}

/// A batch entry with an eligible set that finds its workers busy says nothing about
/// the others; each entry gets its own fallbacks, seeing the bookings before it.
#[test]
fn batch_entries_keep_their_eligible_sets_and_fallbacks() {
    let t = Instant::now();
    let mut config = with_policy(PolicyConfig::default_for(PolicyKind::Kv));
    config.busy.decode_blocks = Some(Threshold::Absolute(10));
    let mut s = scheduler(config, &[(1, 1), (2, 1), (3, 1)]);
    let batch: Vec<(ScheduleRequest, NoOverlap)> = vec![
        // Fills worker 2; the next entry, limited to worker 2, finds it busy.
        (eligible(request("fill-2", 160), &[2]), NoOverlap),
        (eligible(request("only-2", 16), &[2]), NoOverlap),
        // Workers 1 and 3 are free: placed there, with the other as its fallback
        // (worker 2 is busy, so no candidate).
        (asking(request("any", 16), 2), NoOverlap),
    ];
    let results = s.schedule_batch(&batch, BatchOrder::AsGiven, t);
    assert_eq!(results[0].as_ref().unwrap().rank, rank(2, 0));
    assert_eq!(results[1], Err(SchedulerError::AllBusy));
    let any = results[2].as_ref().unwrap();
    assert_ne!(any.rank.worker_id, WorkerId(2));
    let listed = workers(any);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_ne!(listed[0], 2, "a busy worker is no alternate");
}
