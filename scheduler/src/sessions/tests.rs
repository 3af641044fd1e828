//! Unit tests of the session table: capacity, TTL (explicit `Instant`s), worker
//! removal and the margin rule.

use super::*;
use crate::load::RankLoad;
use kv_events::{DpRank, RequestId};

fn rank(worker: u64, dp: u32) -> WorkerRank {
    WorkerRank::new(WorkerId(worker), DpRank(dp))
}

fn id(name: &str) -> SessionId {
    SessionId::new(name).expect("valid session id")
}

fn table(capacity: usize, ttl_ms: u64) -> SessionTable {
    SessionTable::new(SessionConfig {
        capacity,
        ttl: Duration::from_millis(ttl_ms),
        ..SessionConfig::default()
    })
}

/// A `kv` scheduler (session affinity on by default) over workers 1–4, one rank
/// each, tie-breaks seeded with `seed`.
fn kv_scheduler(seed: u64) -> crate::Scheduler {
    use crate::{PolicyConfig, Scheduler, SchedulerConfig};
    use kv_events::discovery::WorkerRegistration;
    let mut s = Scheduler::new(
        SchedulerConfig {
            policy: PolicyConfig::default_for(PolicyKind::Kv),
            ..SchedulerConfig::default()
        },
        Some(seed),
    )
    .expect("valid config");
    for worker in 1..=4 {
        s.add_worker(WorkerRegistration {
            worker_id: WorkerId(worker),
            dp_size: 1,
            block_size: 16,
            total_kv_blocks: 1_000,
            url: None,
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        })
        .expect("valid registration");
    }
    s
}

fn candidates(ranks: &[WorkerRank]) -> Vec<Candidate> {
    ranks
        .iter()
        .map(|&rank| Candidate {
            rank,
            overlap_blocks: 0,
            any_tier_blocks: 0,
            load: RankLoad::default(),
            new_blocks: 0,
        })
        .collect()
}

#[test]
fn the_least_recently_used_session_is_forgotten_beyond_the_capacity() {
    let t0 = Instant::now();
    let mut t = table(2, 60_000);
    t.record(&id("a"), rank(1, 0), t0);
    t.record(&id("b"), rank(2, 0), t0);
    // Using `a` again makes `b` the least recently used.
    t.record(&id("a"), rank(3, 0), t0);
    t.record(&id("c"), rank(4, 0), t0);
    assert_eq!(t.len(), 2);
    assert_eq!(t.last_rank(&id("b"), t0), None);
    assert_eq!(t.last_rank(&id("a"), t0), Some(rank(3, 0)));
    assert_eq!(t.last_rank(&id("c"), t0), Some(rank(4, 0)));
    assert_eq!(t.order.len(), t.entries.len(), "order and entries agree");
}

#[test]
fn a_session_unused_for_the_ttl_is_forgotten() {
    let t0 = Instant::now();
    let mut t = table(10, 1_000);
    t.record(&id("a"), rank(1, 0), t0);
    t.record(&id("b"), rank(2, 0), t0 + Duration::from_millis(600));
    let just_before = t0 + Duration::from_millis(999);
    assert_eq!(t.last_rank(&id("a"), just_before), Some(rank(1, 0)));
    let at_ttl = t0 + Duration::from_millis(1_000);
    assert_eq!(t.last_rank(&id("a"), at_ttl), None, "expired at the TTL");
    assert_eq!(t.len(), 1, "the expired entry was dropped");
    // A record sweeps the expired front of the order.
    t.record(&id("c"), rank(3, 0), t0 + Duration::from_millis(1_700));
    assert_eq!(t.len(), 1);
    assert_eq!(t.expire(t0 + Duration::from_millis(2_700)), 1);
    assert!(t.is_empty() && t.order.is_empty());
}

#[test]
fn a_departed_worker_drops_its_sessions() {
    let t0 = Instant::now();
    let mut t = table(10, 60_000);
    t.record(&id("a"), rank(1, 0), t0);
    t.record(&id("b"), rank(1, 1), t0);
    t.record(&id("c"), rank(2, 0), t0);
    assert_eq!(t.remove_worker(WorkerId(1)), 2);
    assert_eq!(t.last_rank(&id("a"), t0), None);
    assert_eq!(t.last_rank(&id("c"), t0), Some(rank(2, 0)));
    assert_eq!(t.remove_ranks(|r| r == rank(2, 0)), 1);
    assert!(t.is_empty() && t.order.is_empty());
}

#[test]
fn the_last_rank_is_kept_within_the_margin_and_left_beyond_it() {
    let t0 = Instant::now();
    let ranks = [rank(1, 0), rank(2, 0)];
    let cands = candidates(&ranks);
    let mut t = table(10, 60_000);
    let s = id("conv");
    t.record(&s, rank(2, 0), t0);
    // predicted-ttft: the pick (index 0) is 40 ms cheaper, within the 50 ms margin.
    let costs = [100.0, 140.0];
    let steer = |t: &mut SessionTable, costs: [f64; 2], kind| {
        t.steer(Some(&s), kind, 0, &cands, |i| Some(costs[i]), t0)
    };
    assert_eq!(
        steer(&mut t, costs, PolicyKind::PredictedTtft),
        (1, Some(SessionOutcome::Hit))
    );
    // 60 ms cheaper: beyond the margin, the policy's pick stands.
    assert_eq!(
        steer(&mut t, [100.0, 160.0], PolicyKind::PredictedTtft),
        (0, Some(SessionOutcome::Override))
    );
    // kv: relative margin 0.25 of the kept rank's cost.
    assert_eq!(
        steer(&mut t, [80.0, 100.0], PolicyKind::Kv),
        (1, Some(SessionOutcome::Hit))
    );
    assert_eq!(
        steer(&mut t, [70.0, 100.0], PolicyKind::KvNormalized),
        (0, Some(SessionOutcome::Override))
    );
    // Policies without costs decide alone.
    assert_eq!(
        steer(&mut t, costs, PolicyKind::RoundRobin),
        (0, Some(SessionOutcome::Miss))
    );
    // The policy picked the last rank itself.
    assert_eq!(
        t.steer(Some(&s), PolicyKind::Kv, 1, &cands, |_| None, t0),
        (1, Some(SessionOutcome::Hit))
    );
    // A last rank that is not a candidate, an unknown session, no session.
    let only_first = candidates(&ranks[..1]);
    assert_eq!(
        t.steer(Some(&s), PolicyKind::Kv, 0, &only_first, |_| Some(1.0), t0),
        (0, Some(SessionOutcome::Miss))
    );
    assert_eq!(
        t.steer(
            Some(&id("new")),
            PolicyKind::Kv,
            0,
            &cands,
            |_| Some(1.0),
            t0
        ),
        (0, Some(SessionOutcome::Miss))
    );
    assert_eq!(
        t.steer(None, PolicyKind::Kv, 0, &cands, |_| Some(1.0), t0),
        (0, None)
    );
}

#[test]
fn affinity_off_ignores_the_session_and_keeps_nothing() {
    let t0 = Instant::now();
    let mut t = SessionTable::new(SessionConfig {
        enabled: false,
        ..SessionConfig::default()
    });
    let s = id("conv");
    t.record(&s, rank(1, 0), t0);
    assert!(t.is_empty());
    let cands = candidates(&[rank(1, 0), rank(2, 0)]);
    assert_eq!(
        t.steer(Some(&s), PolicyKind::Kv, 1, &cands, |_| Some(1.0), t0),
        (1, None)
    );
}

#[test]
fn validation_names_the_bad_field() {
    let bad = |config: SessionConfig| match config.validate() {
        Err(SchedulerError::InvalidConfig { field, .. }) => field,
        other => panic!("expected invalid config, got {other:?}"),
    };
    let d = SessionConfig::default();
    assert!(d.validate().is_ok());
    assert_eq!(bad(SessionConfig { capacity: 0, ..d }), "sessions.capacity");
    assert_eq!(
        bad(SessionConfig {
            ttl: Duration::ZERO,
            ..d
        }),
        "sessions.ttl_ms"
    );
    assert_eq!(
        bad(SessionConfig {
            margin_ms: f64::NAN,
            ..d
        }),
        "sessions.margin_ms"
    );
    assert_eq!(
        bad(SessionConfig {
            relative_margin: 1.5,
            ..d
        }),
        "sessions.relative_margin"
    );
}

/// Through the facade: a session's turns stay on one rank while costs are level,
/// leave it when another is cheaper beyond the margin, and a departed worker's
/// sessions are forgotten.
#[test]
fn the_scheduler_keeps_a_session_on_its_rank_until_the_margin_or_the_worker_goes() {
    use crate::ScheduleRequest;
    let t0 = Instant::now();
    let mut s = kv_scheduler(3);
    let turn = |n: usize| {
        let mut req = ScheduleRequest::new(format!("t{n}"), Vec::new(), 160, 16);
        req.session_id = Some(id("conv"));
        req
    };
    let first = s.schedule(&turn(0), &crate::NoOverlap, t0).expect("routed");
    assert_eq!(first.session, Some(SessionOutcome::Miss), "a new session");
    s.free(&RequestId::from("t0"), t0).expect("active");
    // Costs are level on every rank: without affinity the kv policy breaks the tie
    // at random; with it every turn stays.
    for n in 1..20 {
        let next = s.schedule(&turn(n), &crate::NoOverlap, t0).expect("routed");
        assert_eq!(next.rank, first.rank, "turn {n}");
        assert_eq!(next.session, Some(SessionOutcome::Hit));
        s.free(&RequestId::from(format!("t{n}").as_str()), t0)
            .expect("active");
    }
    assert_eq!(s.sessions_held(), 1);
    // Load the session's rank well beyond 10% of the request's cost: it moves.
    let mut heavy = ScheduleRequest::new("heavy", Vec::new(), 1_600, 16);
    heavy.dp_rank = Some(first.rank.dp_rank);
    heavy.exclude(
        (1..=4)
            .map(WorkerId)
            .filter(|w| *w != first.rank.worker_id)
            .collect(),
    );
    s.schedule(&heavy, &crate::NoOverlap, t0).expect("routed");
    let moved = s
        .schedule(&turn(20), &crate::NoOverlap, t0)
        .expect("routed");
    assert_eq!(moved.session, Some(SessionOutcome::Override));
    assert_ne!(moved.rank, first.rank);
    // The rank that served it is the session's rank now; when its worker leaves,
    // the session is forgotten.
    s.remove_worker(moved.rank.worker_id);
    assert_eq!(s.sessions_held(), 0);
}

/// A peer replica's booking of a session's turn (through [`crate::Scheduler::apply`])
/// makes its rank the session's last rank here too, so the next turn stays there
/// whichever replica routes it; a booking on a rank this replica does not know is
/// not recorded.
#[test]
fn a_peer_booking_records_its_session_for_the_next_turn() {
    use crate::ScheduleRequest;
    use crate::sequences::{AddRequest, Origin, SequenceEvent};
    use kv_events::RouterId;
    let t0 = Instant::now();
    let mut s = kv_scheduler(5);
    let peer_booking = |request: &str, worker: u64| {
        SequenceEvent::AddRequest(AddRequest {
            request_id: request.into(),
            rank: rank(worker, 0),
            block_hashes: Vec::new(),
            request_blocks: 10,
            prefill: crate::PrefillLoadHint::default(),
            origin: Origin::Peer(RouterId(9)),
            session_id: Some(id("conv")),
        })
    };
    s.apply(peer_booking("ghost", 99), t0)
        .expect_err("an unknown rank is refused");
    assert_eq!(s.sessions_held(), 0, "nor is its session recorded");
    s.apply(peer_booking("p0", 3), t0).expect("a known rank");
    assert_eq!(s.sessions_held(), 1);
    s.free(&RequestId::from("p0"), t0).expect("active");
    // Level costs; repeated so a random tie-break cannot pass by chance.
    for n in 0..8 {
        let mut req = ScheduleRequest::new(format!("t{n}"), Vec::new(), 160, 16);
        req.session_id = Some(id("conv"));
        let next = s.schedule(&req, &crate::NoOverlap, t0).expect("routed");
        assert_eq!(next.rank, rank(3, 0), "turn {n}");
        assert_eq!(next.session, Some(SessionOutcome::Hit));
        s.free(&RequestId::from(format!("t{n}").as_str()), t0)
            .expect("active");
    }
}
