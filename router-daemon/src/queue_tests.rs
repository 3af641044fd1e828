//! Unit tests of the wait queue: order, bounds, release by load, withdrawal, close,
//! waiters freed by their frontend while they wait.

use super::*;
use crate::metrics::Registrar;
use kv_events::discovery::WorkerRegistration;
use kv_events::routing::LifecycleEvent;
use kv_events::{DpRank, LocalBlockHash, WorkerId, WorkerRank};
use scheduler::{SchedulerConfig, Threshold};
use tokio::sync::oneshot::error::TryRecvError;

const BLOCK: u32 = 16;

/// One worker with ranks `0..dp_size`, busy at 10 decode blocks.
fn busy_scheduler(dp_size: u32) -> Scheduler {
    let mut config = SchedulerConfig::default();
    config.busy.decode_blocks = Some(Threshold::Absolute(10));
    let mut s = Scheduler::new(config, Some(1)).unwrap();
    s.add_worker(WorkerRegistration {
        worker_id: WorkerId(1),
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
    s
}

/// [`busy_scheduler`] with one rank, made busy by a 10-block request `hog` at `t`.
fn hogged_scheduler(t: Instant) -> Scheduler {
    let mut s = busy_scheduler(1);
    s.schedule(&request("hog", 10), &OverlapScores::new(), t)
        .unwrap();
    s
}

fn request(id: &str, blocks: u32) -> ScheduleRequest {
    let hashes = (0..blocks)
        .map(|i| LocalBlockHash(u64::from(i) + 1000 * id.len() as u64))
        .collect();
    ScheduleRequest::new(id, hashes, u64::from(blocks * BLOCK), BLOCK)
}

fn queue(capacity: usize) -> WaitQueue {
    WaitQueue::new(
        QueueConfig {
            capacity,
            max_wait: Duration::from_secs(5),
        },
        QueueMetrics::new(&Registrar::unregistered()).unwrap(),
        QueueOutcomes::new(&Registrar::unregistered()).unwrap(),
    )
}

fn rid(s: &str) -> RequestId {
    RequestId::from(s)
}

#[test]
fn waiters_leave_in_priority_then_arrival_order_as_load_frees() {
    let t = Instant::now();
    let q = queue(8);
    let mut s = hogged_scheduler(t);
    let mut state = q.lock();
    let mut a = q
        .push(&mut state, request("a", 4), OverlapScores::new(), 0, t)
        .unwrap();
    let mut b = q
        .push(&mut state, request("bb", 4), OverlapScores::new(), 0, t)
        .unwrap();
    let mut urgent = q
        .push(&mut state, request("ccc", 4), OverlapScores::new(), 5, t)
        .unwrap();

    // Still busy: nothing moves.
    assert_eq!(
        q.release(&mut state, &mut s, t, |_, _| {}),
        Released::default()
    );
    assert_eq!(a.receiver.try_recv(), Err(TryRecvError::Empty));

    // The hog leaves: 10 free blocks. The urgent waiter goes first, then `a`
    // (4 + 4 = 8 < 10); after that the rank holds 8 blocks and `bb` fits too
    // (12 ≥ 10 only after it is booked).
    s.free(&rid("hog"), t).unwrap();
    let mut order = Vec::new();
    let released = q.release(&mut state, &mut s, t, |r, _| {
        order.push(r.request_id.clone())
    });
    assert_eq!(
        released,
        Released {
            routed: 3,
            failed: 0
        }
    );
    assert_eq!(order, vec![rid("ccc"), rid("a"), rid("bb")]);
    for ticket in [&mut urgent, &mut a, &mut b] {
        let sel = ticket.receiver.try_recv().unwrap().unwrap();
        assert_eq!(sel.rank, WorkerRank::new(WorkerId(1), DpRank(0)));
    }
    assert!(state.is_empty());
    assert_eq!(q.outcomes().get("routed"), 3);
}

#[test]
fn release_stops_when_ranks_are_busy_again_and_keeps_the_rest_in_order() {
    let t = Instant::now();
    let q = queue(8);
    let mut s = hogged_scheduler(t);
    let mut state = q.lock();
    let mut tickets: Vec<Ticket> = ["w1", "w22", "w333"]
        .into_iter()
        .map(|id| {
            q.push(&mut state, request(id, 6), OverlapScores::new(), 0, t)
                .unwrap()
        })
        .collect();
    s.free(&rid("hog"), t).unwrap();
    // 6 blocks booked (not busy), 12 after the second (busy): the third waits.
    assert_eq!(q.release(&mut state, &mut s, t, |_, _| {}).routed, 2);
    assert!(tickets[0].receiver.try_recv().unwrap().is_ok());
    assert!(tickets[1].receiver.try_recv().unwrap().is_ok());
    assert_eq!(tickets[2].receiver.try_recv(), Err(TryRecvError::Empty));
    assert_eq!(state.len(), 1);
}

#[test]
fn full_queue_and_duplicates_are_refused() {
    let t = Instant::now();
    let q = queue(1);
    let mut state = q.lock();
    q.push(&mut state, request("a", 1), OverlapScores::new(), 0, t)
        .unwrap();
    assert_eq!(
        q.push(&mut state, request("b", 1), OverlapScores::new(), 9, t)
            .unwrap_err(),
        QueueError::Full(1)
    );
    let q2 = queue(4);
    let mut state2 = q2.lock();
    q2.push(&mut state2, request("a", 1), OverlapScores::new(), 0, t)
        .unwrap();
    assert_eq!(
        q2.push(&mut state2, request("a", 2), OverlapScores::new(), 0, t)
            .unwrap_err(),
        QueueError::Duplicate(rid("a"))
    );
    assert_eq!(q.outcomes().get("refused"), 1);
    // Capacity 0: waiting is disabled.
    let none = queue(0);
    let mut state0 = none.lock();
    assert!(matches!(
        none.push(&mut state0, request("x", 1), OverlapScores::new(), 0, t),
        Err(QueueError::Full(0))
    ));
}

#[test]
fn waiters_that_cannot_be_served_as_asked_are_answered_with_the_reason() {
    let t = Instant::now();
    let q = queue(8);
    let mut s = busy_scheduler(2);
    let mut state = q.lock();
    let mut pinned_req = request("p", 1);
    pinned_req.dp_rank = Some(DpRank(1));
    let mut pinned = q
        .push(&mut state, pinned_req, OverlapScores::new(), 0, t)
        .unwrap();
    // The worker re-registers with one rank: dp_rank 1 is gone.
    s.add_worker(WorkerRegistration {
        worker_id: WorkerId(1),
        dp_size: 1,
        block_size: BLOCK,
        total_kv_blocks: 100,
        url: None,
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    })
    .unwrap();
    assert_eq!(q.release(&mut state, &mut s, t, |_, _| {}).failed, 1);
    assert_eq!(
        pinned.receiver.try_recv().unwrap(),
        Err(SchedulerError::RankUnavailable(DpRank(1)))
    );
    assert_eq!(q.outcomes().get("failed"), 1);
}

#[test]
fn withdrawn_and_closed_waiters() {
    let t = Instant::now();
    let q = queue(8);
    let mut state = q.lock();
    let gone = q
        .push(&mut state, request("gone", 1), OverlapScores::new(), 0, t)
        .unwrap();
    assert!(q.withdraw(&mut state, &gone));
    assert!(!q.withdraw(&mut state, &gone), "already withdrawn");
    // The id can wait again after withdrawal.
    let mut again = q
        .push(&mut state, request("gone", 1), OverlapScores::new(), 0, t)
        .unwrap();
    q.close(&mut state);
    assert_eq!(again.receiver.try_recv(), Err(TryRecvError::Closed));
    assert_eq!(
        q.push(&mut state, request("late", 1), OverlapScores::new(), 0, t)
            .unwrap_err(),
        QueueError::Closed
    );
    assert_eq!(q.outcomes().get("timed_out"), 1);
}

#[test]
fn a_waiter_pinned_to_a_busy_rank_does_not_block_later_ones() {
    let t = Instant::now();
    let q = queue(8);
    let mut s = busy_scheduler(2);
    // Fill dp_rank 1 (10 blocks: busy); dp_rank 0 stays free.
    let mut hog = request("hog", 10);
    hog.dp_rank = Some(DpRank(1));
    s.schedule(&hog, &OverlapScores::new(), t).unwrap();
    let mut state = q.lock();
    let mut pinned_req = request("p", 1);
    pinned_req.dp_rank = Some(DpRank(1));
    let mut pinned = q
        .push(&mut state, pinned_req, OverlapScores::new(), 0, t)
        .unwrap();
    let mut later = q
        .push(&mut state, request("later", 1), OverlapScores::new(), 0, t)
        .unwrap();
    assert_eq!(q.release(&mut state, &mut s, t, |_, _| {}).routed, 1);
    assert_eq!(pinned.receiver.try_recv(), Err(TryRecvError::Empty));
    let sel = later.receiver.try_recv().unwrap().unwrap();
    assert_eq!(sel.rank.dp_rank, DpRank(0));
    // When dp_rank 1 frees, the pinned waiter goes there.
    s.free(&rid("hog"), t).unwrap();
    assert_eq!(q.release(&mut state, &mut s, t, |_, _| {}).routed, 1);
    assert_eq!(
        pinned.receiver.try_recv().unwrap().unwrap().rank.dp_rank,
        DpRank(1)
    );
}

#[test]
fn may_have_waiters_follows_every_change_of_the_queue() {
    let t = Instant::now();
    let q = queue(8);
    let mut scheduler = hogged_scheduler(t);
    let mut state = q.lock();
    assert!(!q.may_have_waiters());
    let gone = q
        .push(&mut state, request("gone", 1), OverlapScores::new(), 0, t)
        .unwrap();
    assert!(q.may_have_waiters());
    assert!(q.withdraw(&mut state, &gone));
    assert!(!q.may_have_waiters());
    let _waiting = q
        .push(&mut state, request("w", 1), OverlapScores::new(), 0, t)
        .unwrap();
    assert!(q.may_have_waiters());
    scheduler.free(&rid("hog"), t).unwrap();
    let released = q.release(&mut state, &mut scheduler, t, |_, _| {});
    assert_eq!(released.routed, 1);
    assert!(!q.may_have_waiters());
    let _closed = q
        .push(&mut state, request("c", 1), OverlapScores::new(), 0, t)
        .unwrap();
    q.close(&mut state);
    assert!(!q.may_have_waiters());
}

/// A frontend that gives up on a waiting query frees its id: the waiter is refused
/// at the next release pass — before the rank frees, and from behind a waiter that
/// finds it busy — and nothing is booked for it.
#[test]
fn a_waiter_freed_while_it_waits_is_refused_at_the_next_release() {
    let t = Instant::now();
    let q = queue(8);
    let mut s = hogged_scheduler(t);
    let mut state = q.lock();
    let mut first = q
        .push(&mut state, request("first", 4), OverlapScores::new(), 0, t)
        .unwrap();
    let mut gave_up = q
        .push(
            &mut state,
            request("gave-up", 4),
            OverlapScores::new(),
            0,
            t,
        )
        .unwrap();
    assert_eq!(
        s.lifecycle(&rid("gave-up"), LifecycleEvent::Freed, t),
        Err(SchedulerError::UnknownRequest(rid("gave-up")))
    );

    // Still busy (a load report, say, releases): the first keeps waiting, the freed
    // one is answered.
    let released = q.release(&mut state, &mut s, t, |_, _| {});
    assert_eq!(
        released,
        Released {
            routed: 0,
            failed: 1
        }
    );
    assert_eq!(
        gave_up.receiver.try_recv().unwrap(),
        Err(SchedulerError::FreedBeforeRouted(rid("gave-up")))
    );
    assert_eq!(first.receiver.try_recv(), Err(TryRecvError::Empty));
    assert_eq!(state.len(), 1);

    // The hog leaves: the first is routed; only it and nothing else is booked.
    s.free(&rid("hog"), t).unwrap();
    assert_eq!(q.release(&mut state, &mut s, t, |_, _| {}).routed, 1);
    assert!(first.receiver.try_recv().unwrap().is_ok());
    assert_eq!(s.active_requests(), 1);
    assert!(!s.sequences().contains(&rid("gave-up")));
}
