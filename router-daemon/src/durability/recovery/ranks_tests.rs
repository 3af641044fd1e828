use super::*;
use crate::metrics::Registrar;
use indexer::{RecoveryReason, RecoveryToken};
use kv_events::recovery::RecoveryRequest;
use kv_events::{DpRank, WorkerId};

const MIN: Duration = Duration::from_millis(100);
const MAX: Duration = Duration::from_millis(400);
const COOLDOWN: Duration = Duration::from_secs(60);

fn book(budget: u32) -> RankBook {
    let pacing = Pacing {
        backoff: ExponentialBuilder::default()
            .with_min_delay(MIN)
            .with_max_delay(MAX)
            .with_jitter()
            .without_max_times(),
        budget,
        cooldown: COOLDOWN,
    };
    let metrics = RecoveryMetrics::new(&Registrar::unregistered()).expect("metrics");
    RankBook::new(pacing, metrics)
}

fn rank(w: u64) -> WorkerRank {
    WorkerRank::new(WorkerId(w), DpRank(0))
}

fn need(w: u64, token: u64, epoch: u64, reason: RecoveryReason) -> RecoveryNeed {
    RecoveryNeed {
        rank: rank(w),
        token: RecoveryToken(token),
        request: RecoveryRequest {
            dp_rank: DpRank(0),
            epoch,
            start_event_id: 1,
            dump: false,
        },
        reason,
    }
}

const GAP: RecoveryReason = RecoveryReason::Gap {
    expected: 1,
    received: 5,
};
const APPLIED: RunOutcome = RunOutcome::Applied { usable: true };

fn tokens(starts: &[Start]) -> Vec<u64> {
    starts.iter().map(|s| s.need.token.0).collect()
}

#[test]
fn one_recovery_in_flight_per_rank_and_a_newer_need_supersedes() {
    let mut b = book(8);
    let t = Instant::now();
    assert_eq!(b.on_need(need(1, 1, 7, GAP), t), None);
    assert_eq!(b.on_need(need(2, 2, 7, GAP), t), None);
    let starts = b.start_ready(t, 16);
    assert_eq!(tokens(&starts), vec![1, 2]);
    // While rank 1 runs, a newer need waits and cancels the run's attempts.
    assert_eq!(
        b.on_need(need(1, 3, 7, RecoveryReason::BufferOverflow), t),
        None
    );
    assert!(starts[0].superseded.is_cancelled());
    assert!(!starts[1].superseded.is_cancelled());
    assert!(b.start_ready(t, 16).is_empty(), "one run per rank");
    // A still newer one replaces the waiting one.
    let released = b.on_need(need(1, 4, 7, RecoveryReason::BufferOverflow), t);
    assert!(matches!(released, Some(Release::Superseded(n)) if n.token.0 == 3));
    // Slots bound the runs over all ranks.
    assert_eq!(b.on_need(need(3, 5, 7, GAP), t), None);
    assert_eq!(b.on_need(need(4, 6, 7, GAP), t), None);
    assert_eq!(b.start_ready(t, 1).len(), 1);
}

#[test]
fn recoveries_that_leave_the_hole_back_off_exponentially_then_degrade_the_rank() {
    let budget = 4;
    let mut b = book(budget);
    let mut now = Instant::now();
    let mut token = 0;
    let mut next = |reason| {
        token += 1;
        need(1, token, 7, reason)
    };
    b.on_need(next(GAP), now);
    let mut expected = MIN;
    for failure in 1..budget {
        assert_eq!(b.start_ready(now, 16).len(), 1, "failure {failure}");
        // The reply was applied and the indexer asked again at once.
        assert_eq!(b.on_need(next(RecoveryReason::Retry), now), None);
        assert_eq!(b.on_done(rank(1), &APPLIED, now), None);
        let status = b.statuses()[&rank(1)];
        assert_eq!(
            (status.phase, status.failures),
            (RecoveryPhase::BackingOff, failure)
        );
        let due = status.until.expect("a backoff deadline");
        // backon: the delay doubles (capped), plus jitter of up to 100 %.
        assert!(
            due >= now + expected && due < now + expected * 2,
            "{failure}"
        );
        assert_eq!(b.next_wakeup(), Some(due));
        assert!(b.start_ready(due - Duration::from_millis(1), 16).is_empty());
        now = due;
        expected = (expected * 2).min(MAX);
    }
    assert_eq!(b.start_ready(now, 16).len(), 1);
    b.on_need(next(RecoveryReason::Retry), now);
    let released = b.on_done(rank(1), &APPLIED, now);
    assert!(matches!(released, Some(Release::GiveUp(n)) if n.reason == RecoveryReason::Retry));
    assert_eq!(b.degraded(), 1);
    assert_eq!(b.metrics.degraded_ranks(), 1);
    // Degraded: needs are given up at once, never started.
    for _ in 0..3 {
        let released = b.on_need(next(GAP), now);
        assert!(matches!(released, Some(Release::GiveUp(_))));
    }
    assert!(b.start_ready(now + COOLDOWN, 16).is_empty());
    assert_eq!(b.metrics.skipped("degraded"), 4);
    let status = b.statuses()[&rank(1)];
    assert_eq!(
        status,
        RankStatus {
            phase: RecoveryPhase::Degraded(DegradeReason::HoleNotClosed),
            failures: budget,
            until: Some(now + COOLDOWN),
            skipped: 3,
        }
    );
}

#[test]
fn a_closed_hole_forgets_the_failures() {
    let mut b = book(8);
    let t = Instant::now();
    b.on_need(need(1, 1, 7, GAP), t);
    b.start_ready(t, 16);
    b.on_need(need(1, 2, 7, RecoveryReason::Retry), t);
    b.on_done(rank(1), &APPLIED, t);
    let due = b.next_wakeup().expect("backing off");
    assert_eq!(b.start_ready(due, 16).len(), 1);
    assert!(b.failing(rank(1)));
    // Nothing new from the indexer after this reply: the hole is closed.
    assert_eq!(b.on_done(rank(1), &APPLIED, due), None);
    assert!(b.statuses().is_empty(), "a rank in order is not tracked");
    assert!(!b.failing(rank(1)));
    // The next gap is served at once.
    b.on_need(need(1, 3, 7, GAP), due);
    assert_eq!(b.start_ready(due, 16).len(), 1);
}

#[test]
fn an_unreachable_publisher_degrades_and_a_restarted_one_resumes_at_once() {
    let mut b = book(2);
    let mut now = Instant::now();
    for token in 1..=2 {
        b.on_need(need(1, token, 7, GAP), now);
        now = b.next_wakeup().expect("due");
        assert_eq!(b.start_ready(now, 16).len(), 1);
        b.on_done(rank(1), &RunOutcome::GaveUp("no responders".into()), now);
    }
    assert_eq!(
        b.statuses()[&rank(1)].phase,
        RecoveryPhase::Degraded(DegradeReason::Unreachable)
    );
    assert!(matches!(
        b.on_need(need(1, 3, 7, GAP), now),
        Some(Release::GiveUp(_))
    ));
    // A need of a newer epoch: the publisher restarted; asked again, fresh budget.
    assert_eq!(
        b.on_need(
            need(
                1,
                4,
                8,
                RecoveryReason::Gap {
                    expected: 0,
                    received: 3
                }
            ),
            now
        ),
        None
    );
    assert_eq!(b.degraded(), 0);
    assert_eq!(tokens(&b.start_ready(now, 16)), vec![4]);
    assert!(!b.failing(rank(1)));
}

#[test]
fn a_degraded_rank_is_forgotten_after_the_cool_down_and_then_asked_again() {
    let mut b = book(1);
    let t = Instant::now();
    b.on_need(need(1, 1, 7, GAP), t);
    b.start_ready(t, 16);
    b.on_need(need(1, 2, 7, RecoveryReason::Retry), t);
    assert!(matches!(
        b.on_done(rank(1), &APPLIED, t),
        Some(Release::GiveUp(_))
    ));
    assert_eq!(b.next_wakeup(), Some(t + COOLDOWN));
    b.expire(t + COOLDOWN - Duration::from_millis(1));
    assert_eq!(b.degraded(), 1);
    b.expire(t + COOLDOWN);
    assert_eq!(b.degraded(), 0);
    assert_eq!(b.metrics.degraded_ranks(), 0);
    assert!(b.statuses().is_empty());
    assert_eq!(b.on_need(need(1, 3, 7, GAP), t + COOLDOWN), None);
    assert_eq!(b.start_ready(t + COOLDOWN, 16).len(), 1);
}

#[test]
fn a_failing_streak_without_further_needs_is_forgotten_after_the_cool_down() {
    let mut b = book(8);
    let t = Instant::now();
    b.on_need(need(1, 1, 7, GAP), t);
    b.start_ready(t, 16);
    b.on_done(rank(1), &RunOutcome::GaveUp("timed out".into()), t);
    assert_eq!(b.next_wakeup(), Some(t + COOLDOWN));
    b.expire(t + COOLDOWN);
    assert!(b.statuses().is_empty());
    assert_eq!(b.next_wakeup(), None);
}
