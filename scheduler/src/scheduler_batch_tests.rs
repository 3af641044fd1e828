//! Unit tests of [`Scheduler::schedule_batch`] and of bookings learned from peer
//! router replicas ([`Scheduler::apply`]), and queries freed before they were routed.

use super::*;
use kv_events::DpRank;
use kv_events::RequestId;
use kv_events::routing::LifecycleEvent;
use kv_events::{LocalBlockHash, RouterId};
use std::collections::HashMap;

const BLOCK: u32 = 16;

fn rank(id: u64, dp: u32) -> WorkerRank {
    WorkerRank::new(WorkerId(id), DpRank(dp))
}

fn scheduler(config: SchedulerConfig, workers: &[(u64, u32)]) -> Scheduler {
    let mut s = Scheduler::new(config, Some(11)).unwrap();
    for &(id, dp_size) in workers {
        s.add_worker(WorkerRegistration {
            worker_id: WorkerId(id),
            dp_size,
            block_size: BLOCK,
            total_kv_blocks: 100,
            url: None,
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        })
        .unwrap();
    }
    s
}

fn prefixed(id: &str, num_tokens: u64, seed: u64) -> ScheduleRequest {
    let hashes = (0..num_tokens / u64::from(BLOCK))
        .map(|i| LocalBlockHash(seed * 1000 + i))
        .collect();
    ScheduleRequest::new(id, hashes, num_tokens, BLOCK)
}

fn request(id: &str, num_tokens: u64) -> ScheduleRequest {
    prefixed(id, num_tokens, 0)
}

fn pinned(mut req: ScheduleRequest, dp: u32) -> ScheduleRequest {
    req.dp_rank = Some(DpRank(dp));
    req
}

fn rid(s: &str) -> RequestId {
    RequestId::from(s)
}

fn with_policy(policy: PolicyConfig) -> SchedulerConfig {
    SchedulerConfig {
        policy,
        ..SchedulerConfig::default()
    }
}

#[test]
fn batch_groups_by_prefix_and_respects_the_fair_share_cap() {
    let t = Instant::now();
    let policy = PolicyConfig::default_for(PolicyKind::KvNormalized);
    let mut s = scheduler(with_policy(policy), &[(1, 1), (2, 1), (3, 1)]);
    // Six requests of one conversation (prefix seed 5), all cached on rank 1/0.
    let overlaps = HashMap::from([(rank(1, 0), 4)]);
    let batch: Vec<(ScheduleRequest, &HashMap<WorkerRank, u32>)> = (0..6)
        .map(|i| (prefixed(&format!("c{i}"), 80, 5), &overlaps))
        .collect();
    let results = s.schedule_batch(&batch, BatchOrder::GroupByPrefix, t);
    let on_1 = results
        .iter()
        .filter(|r| r.as_ref().unwrap().rank == rank(1, 0))
        .count();
    // fair share = ceil(6 / 3) = 2, cap = 4: rank 1 takes the cached requests up to 4.
    assert_eq!(on_1, 4);
    assert_eq!(s.active_requests(), 6);
}

#[test]
fn batch_stops_scanning_once_all_ranks_are_busy() {
    let t = Instant::now();
    let mut config = SchedulerConfig::default();
    config.busy.decode_blocks = Some(Threshold::Absolute(10));
    let mut s = scheduler(config, &[(1, 1)]);
    let batch: Vec<(ScheduleRequest, NoOverlap)> = vec![
        (request("a", 160), NoOverlap),
        (request("b", 16), NoOverlap),
        (pinned(request("c", 16), 3), NoOverlap),
        (request("a", 16), NoOverlap),
    ];
    let results = s.schedule_batch(&batch, BatchOrder::AsGiven, t);
    assert!(results[0].is_ok());
    assert_eq!(results[1], Err(SchedulerError::AllBusy));
    assert_eq!(results[2], Err(SchedulerError::RankUnavailable(DpRank(3))));
    assert_eq!(results[3], Err(SchedulerError::DuplicateRequest(rid("a"))));
}

#[test]
fn peer_bookings_are_applied_only_on_registered_ranks() {
    let t = Instant::now();
    let mut s = scheduler(
        SchedulerConfig {
            // The hand-computed cost below is the kv policy's.
            policy: PolicyConfig::default_for(PolicyKind::Kv),
            ..SchedulerConfig::default()
        },
        &[(1, 1)],
    );
    let peer = Origin::Peer(RouterId(9));
    let add = |r: WorkerRank| AddRequest {
        request_id: rid("peer-1"),
        rank: r,
        block_hashes: vec![LocalBlockHash(1)],
        request_blocks: 2,
        prefill: PrefillLoadHint {
            initial_effective_prefill_tokens: 20,
            expected_prefill_duration: None,
        },
        origin: peer,
        session_id: None,
    };
    assert_eq!(
        s.apply(SequenceEvent::AddRequest(add(rank(4, 0))), t),
        Err(SchedulerError::UnregisteredRank(rank(4, 0)))
    );
    assert_eq!(
        s.apply(SequenceEvent::AddRequest(add(rank(1, 0))), t),
        Ok(peer)
    );
    assert_eq!(s.rank_load_at(rank(1, 0), t).active_prefill_tokens, 20);
    // Our own decision sees the peer's load.
    let sel = s.schedule(&request("mine", 32), &NoOverlap, t).unwrap();
    assert_eq!(sel.cost, Some(20.0 / 16.0 + 2.0 + 2.0 + 2.0));
    assert_eq!(s.free(&rid("peer-1"), t), Ok(peer));
    assert_eq!(s.free(&rid("mine"), t), Ok(Origin::Local));
}

fn excluding(mut req: ScheduleRequest, workers: &[u64]) -> ScheduleRequest {
    req.exclude(workers.iter().map(|&w| WorkerId(w)).collect());
    req
}

#[test]
fn excluded_workers_are_never_chosen_even_with_the_best_overlap() {
    let t = Instant::now();
    let mut s = scheduler(SchedulerConfig::default(), &[(1, 2), (2, 1), (3, 1)]);
    // Worker 1 caches the whole prompt on both ranks; a failover excludes it.
    let overlaps = HashMap::from([(rank(1, 0), 5), (rank(1, 1), 5)]);
    let sel = s.schedule(&request("plain", 80), &overlaps, t).unwrap();
    assert_eq!(
        sel.rank.worker_id,
        WorkerId(1),
        "the cache wins without exclusions"
    );
    let retry = excluding(request("retry", 80), &[1, 1]);
    assert_eq!(retry.exclude_workers, vec![WorkerId(1)], "deduplicated");
    let sel = s.schedule(&retry, &overlaps, t).unwrap();
    assert_ne!(sel.rank.worker_id, WorkerId(1));
    // Excluding every worker books nothing and says why.
    let none_left = excluding(request("none", 80), &[3, 2, 1]);
    assert_eq!(
        s.schedule(&none_left, &overlaps, t),
        Err(SchedulerError::AllExcluded)
    );
    assert!(!s.sequences().contains(&rid("none")));
    // A pinned rank that exists only on excluded workers is excluded, not unavailable.
    let pinned_1 = excluding(pinned(request("p", 80), 1), &[1]);
    assert_eq!(
        s.schedule(&pinned_1, &overlaps, t),
        Err(SchedulerError::AllExcluded)
    );
}

#[test]
fn a_batch_entry_with_exclusions_neither_sets_nor_trusts_the_all_busy_shortcut() {
    let t = Instant::now();
    let mut config = SchedulerConfig::default();
    config.busy.decode_blocks = Some(Threshold::Absolute(10));
    let mut s = scheduler(config, &[(1, 1), (2, 1)]);
    let batch: Vec<(ScheduleRequest, NoOverlap)> = vec![
        // Fills worker 2; the entry excluding worker 1 then finds all it may use busy.
        (excluding(request("fill-2", 160), &[1]), NoOverlap),
        (excluding(request("only-2", 16), &[1]), NoOverlap),
        // Worker 1 is still free: this entry must be placed there, not short-cut.
        (request("any", 16), NoOverlap),
    ];
    let results = s.schedule_batch(&batch, BatchOrder::AsGiven, t);
    assert_eq!(results[0].as_ref().unwrap().rank, rank(2, 0));
    assert_eq!(results[1], Err(SchedulerError::AllBusy));
    assert_eq!(results[2].as_ref().unwrap().rank, rank(1, 0));
}

/// A frontend's `freed` for an id not booked here makes a later query for it stale:
/// refused alone or in a batch, nothing booked, for [`freed_early::REMEMBER_FOR`]. A
/// `freed` of a booked request, or a peer replica's sync `freed`, remembers nothing.
#[test]
fn a_query_freed_before_it_was_routed_books_nothing() {
    let t = Instant::now();
    let mut s = scheduler(SchedulerConfig::default(), &[(1, 1)]);
    assert_eq!(
        s.lifecycle(&rid("gave-up"), LifecycleEvent::Freed, t),
        Err(SchedulerError::UnknownRequest(rid("gave-up")))
    );
    let stale = Err(SchedulerError::FreedBeforeRouted(rid("gave-up")));
    assert_eq!(s.schedule(&request("gave-up", 32), &NoOverlap, t), stale);
    let batch = [
        (request("gave-up", 32), NoOverlap),
        (request("b", 32), NoOverlap),
    ];
    let results = s.schedule_batch(&batch, BatchOrder::AsGiven, t);
    assert_eq!(results[0], stale);
    assert!(results[1].is_ok(), "{:?}", results[1]);
    assert_eq!(s.active_requests(), 1, "only b is booked");

    // A booked request freed by its frontend, and a peer's sync free of an unknown
    // id, leave nothing behind: the ids route again (a frontend may not reuse ids,
    // but nothing is remembered for these).
    s.lifecycle(&rid("b"), LifecycleEvent::Freed, t).unwrap();
    assert_eq!(
        s.apply(SequenceEvent::Free(rid("peer")), t),
        Err(SchedulerError::UnknownRequest(rid("peer")))
    );
    for id in ["b", "peer"] {
        assert!(s.schedule(&request(id, 32), &NoOverlap, t).is_ok(), "{id}");
    }

    // Forgotten after a while.
    let later = t + freed_early::REMEMBER_FOR;
    assert!(
        s.schedule(&request("gave-up", 32), &NoOverlap, later)
            .is_ok()
    );
}

/// Once every rank is known busy, later batch entries are not scanned; one freed
/// before it was routed is still refused as such (a waiter behind one that finds
/// every rank busy leaves the queue at that release pass).
#[test]
fn a_freed_query_is_refused_in_a_batch_after_every_rank_is_found_busy() {
    let t = Instant::now();
    let mut config = SchedulerConfig::default();
    config.busy.decode_blocks = Some(Threshold::Absolute(10));
    let mut s = scheduler(config, &[(1, 1)]);
    s.schedule(&request("hog", 160), &NoOverlap, t).unwrap();
    let _ = s.lifecycle(&rid("gave-up"), LifecycleEvent::Freed, t);
    let batch = [
        (request("waits", 16), NoOverlap),
        (request("gave-up", 16), NoOverlap),
    ];
    let results = s.schedule_batch(&batch, BatchOrder::AsGiven, t);
    assert_eq!(results[0], Err(SchedulerError::AllBusy));
    assert_eq!(
        results[1],
        Err(SchedulerError::FreedBeforeRouted(rid("gave-up")))
    );
    assert_eq!(s.active_requests(), 1, "only the hog");
}

/// Only a frontend's `freed` that finds the request's own id unknown is remembered:
/// not a request's absent prefill half, not a booked request, not a peer's sync.
#[test]
fn only_an_unknown_request_freed_by_its_frontend_is_remembered() {
    let t = Instant::now();
    let mut s = scheduler(SchedulerConfig::default(), &[(1, 1)]);
    s.schedule(&request("booked", 32), &NoOverlap, t).unwrap();
    // An aggregated request has no `#prefill` half: that step finds nothing.
    s.lifecycle(&rid("booked"), LifecycleEvent::Freed, t)
        .unwrap();
    assert_eq!(s.freed_early.len(), 0);
    let _ = s.apply(SequenceEvent::Free(rid("peer")), t);
    assert_eq!(s.freed_early.len(), 0);
    let _ = s.lifecycle(&rid("unknown"), LifecycleEvent::Freed, t);
    let _ = s.lifecycle(&rid("kept"), LifecycleEvent::KeepAlive, t);
    assert_eq!(s.freed_early.len(), 1, "only `unknown`");
    assert!(s.freed_early.contains(&rid("unknown"), t));
}
