//! Pair selection through the [`Scheduler`] facade: roles, the decision and its
//! reasons, the decode and prefill picks, protocols, batches, calibration and
//! sessions (both bookings' lifecycle: `scheduler_pair_lifecycle_tests.rs`).

use super::*;
use kv_events::LocalBlockHash;
use kv_events::RequestId;
use kv_events::disaggregation::{
    DisaggregationReason, KvTransfer, TransferProtocol, WorkerRole, prefill_booking_id,
};
use kv_events::routing::{LifecycleEvent, SessionId};
use kv_events::{DpRank, WorkerRank};
use std::collections::HashMap;
use std::time::Duration;

const BLOCK: u32 = 16;
/// 100 blocks: uncached 1,600 tokens > the default local limit of 1,024.
pub(super) const LONG: u64 = 1600;

pub(super) fn rank(id: u64) -> WorkerRank {
    WorkerRank::new(WorkerId(id), DpRank(0))
}

pub(super) fn reg(
    id: u64,
    role: WorkerRole,
    protocol: Option<TransferProtocol>,
) -> WorkerRegistration {
    WorkerRegistration {
        worker_id: WorkerId(id),
        dp_size: 1,
        block_size: BLOCK,
        total_kv_blocks: 10_000,
        url: None,
        epoch: 0,
        max_model_len: None,
        role,
        kv_transfer: protocol.map(|protocol| KvTransfer {
            protocol,
            bootstrap_port: (protocol == TransferProtocol::Sglang).then_some(8998),
        }),
    }
}

pub(super) fn decode(id: u64) -> WorkerRegistration {
    reg(id, WorkerRole::Decode, Some(TransferProtocol::Vllm))
}

pub(super) fn prefill(id: u64) -> WorkerRegistration {
    reg(id, WorkerRole::Prefill, Some(TransferProtocol::Vllm))
}

pub(super) fn fleet(config: SchedulerConfig, workers: Vec<WorkerRegistration>) -> Scheduler {
    let mut s = Scheduler::new(config, Some(3)).unwrap();
    for w in workers {
        s.add_worker(w).unwrap();
    }
    s
}

/// Decode workers 1 and 2, prefill workers 11 and 12, all vLLM.
pub(super) fn vllm_fleet() -> Scheduler {
    fleet(
        SchedulerConfig::default(),
        vec![decode(1), decode(2), prefill(11), prefill(12)],
    )
}

/// A request of `num_tokens` whose blocks hash to `seed * 1000 + i`, allowing
/// disaggregation.
pub(super) fn pair_request(id: &str, num_tokens: u64, seed: u64) -> ScheduleRequest {
    let hashes = (0..num_tokens / u64::from(BLOCK))
        .map(|i| LocalBlockHash(seed * 1000 + i))
        .collect();
    let mut r = ScheduleRequest::new(id, hashes, num_tokens, BLOCK);
    r.allow_disaggregation = true;
    r
}

fn decision(sel: &Selection) -> (DisaggregationReason, Option<WorkerId>) {
    let d = sel.disaggregation.expect("a pair decision");
    (d.reason, d.prefill.map(|p| p.rank.worker_id))
}

pub(super) fn id(s: &str) -> RequestId {
    RequestId::from(s)
}

#[test]
fn whole_requests_never_go_to_prefill_workers() {
    let mut s = vllm_fleet();
    let t = Instant::now();
    for i in 0..20 {
        let mut r = pair_request(&format!("r{i}"), LONG, i);
        r.allow_disaggregation = false;
        let sel = s.schedule(&r, &HashMap::new(), t).unwrap();
        assert!([1, 2].contains(&sel.rank.worker_id.0), "{sel:?}");
        assert_eq!(sel.disaggregation, None);
    }
    // A pin only prefill workers have is unavailable; prefill workers alone are none.
    let mut s = fleet(
        SchedulerConfig::default(),
        vec![
            decode(1),
            WorkerRegistration {
                dp_size: 2,
                ..prefill(11)
            },
        ],
    );
    let mut pinned = pair_request("pinned", LONG, 1);
    pinned.dp_rank = Some(DpRank(1));
    assert_eq!(
        s.schedule(&pinned, &HashMap::new(), t),
        Err(SchedulerError::RankUnavailable(DpRank(1)))
    );
    let mut s = fleet(SchedulerConfig::default(), vec![prefill(11)]);
    assert_eq!(
        s.schedule(&pair_request("r", LONG, 1), &HashMap::new(), t),
        Err(SchedulerError::NoWorkers)
    );
    assert_eq!(s.active_requests(), 0);
}

#[test]
fn no_decision_without_a_registered_prefill_worker() {
    let mut s = fleet(SchedulerConfig::default(), vec![decode(1), decode(2)]);
    let sel = s
        .schedule(&pair_request("r", LONG, 1), &HashMap::new(), Instant::now())
        .unwrap();
    assert_eq!(sel.disaggregation, None);
    assert_eq!(sel.prefill.initial_effective_prefill_tokens, LONG);
}

#[test]
fn the_three_local_reasons_and_the_remote_one() {
    let t = Instant::now();
    let mut s = vllm_fleet();
    let long = s
        .schedule(&pair_request("long", LONG, 1), &HashMap::new(), t)
        .unwrap();
    let (reason, remote) = decision(&long);
    assert_eq!(reason, DisaggregationReason::LongUncached);
    assert!(matches!(remote, Some(WorkerId(11 | 12))));
    assert_eq!(
        long.prefill.initial_effective_prefill_tokens, 0,
        "by transfer"
    );

    let short = s
        .schedule(&pair_request("short", 1024, 2), &HashMap::new(), t)
        .unwrap();
    assert_eq!(
        decision(&short),
        (DisaggregationReason::ShortUncached, None)
    );
    assert_eq!(short.prefill.initial_effective_prefill_tokens, 1024);

    // 1,000 blocks, 800 held by both decode ranks: 3,200 uncached, 80% held.
    let held = HashMap::from([(rank(1), 800), (rank(2), 800)]);
    let sel = s
        .schedule(&pair_request("held", 16_000, 3), &held, t)
        .unwrap();
    assert_eq!(
        decision(&sel),
        (DisaggregationReason::DecodeHoldsPrefix, None)
    );
    assert_eq!(sel.prefill.initial_effective_prefill_tokens, 3200);

    let mut excluded = pair_request("excluded", LONG, 4);
    excluded.exclude(vec![WorkerId(11), WorkerId(12)]);
    let sel = s.schedule(&excluded, &HashMap::new(), t).unwrap();
    assert_eq!(
        decision(&sel),
        (DisaggregationReason::NoPrefillWorker, None)
    );
    assert_eq!(sel.prefill.initial_effective_prefill_tokens, LONG);
    assert!(!s.sequences().contains(&prefill_booking_id(&id("excluded"))));
}

#[test]
fn a_busy_or_pinned_away_prefill_side_is_no_prefill_worker() {
    let t = Instant::now();
    let config = SchedulerConfig {
        busy: BusyThresholds {
            decode_blocks: None,
            prefill_tokens: Some(Threshold::Absolute(1000)),
        },
        ..SchedulerConfig::default()
    };
    let mut s = fleet(config, vec![decode(1), prefill(11)]);
    let first = s
        .schedule(&pair_request("a", LONG, 1), &HashMap::new(), t)
        .unwrap();
    assert_eq!(decision(&first).1, Some(WorkerId(11)));
    // Worker 11 now holds 1,600 prefill tokens: busy.
    let second = s
        .schedule(&pair_request("b", LONG, 2), &HashMap::new(), t)
        .unwrap();
    assert_eq!(
        decision(&second),
        (DisaggregationReason::NoPrefillWorker, None)
    );
}

#[test]
fn the_prefill_pick_prefers_the_worker_holding_the_prefix() {
    let mut s = vllm_fleet();
    let overlaps = HashMap::from([(rank(12), 90)]);
    for i in 0..4 {
        let name = format!("r{i}");
        let sel = s
            .schedule(&pair_request(&name, LONG, 7), &overlaps, Instant::now())
            .unwrap();
        let p = sel.disaggregation.unwrap().prefill.expect("remote");
        assert_eq!(p.rank, rank(12));
        assert_eq!(p.overlap_blocks, 90);
        assert_eq!(p.prefill.initial_effective_prefill_tokens, LONG - 90 * 16);
        s.lifecycle(&id(&name), LifecycleEvent::Freed, Instant::now())
            .unwrap();
    }
}

#[test]
fn the_decode_pick_prefers_free_capacity_and_the_held_prefix() {
    let t = Instant::now();
    let small = WorkerRegistration {
        total_kv_blocks: 1000,
        ..decode(1)
    };
    let big = WorkerRegistration {
        total_kv_blocks: 4000,
        ..decode(2)
    };
    let mut s = fleet(SchedulerConfig::default(), vec![small, big, prefill(11)]);
    // Empty ranks: 100 / 4000 beats 100 / 1000, and the bigger rank keeps winning
    // until it is as full as the smaller.
    for i in 0..3 {
        let sel = s
            .schedule(&pair_request(&format!("r{i}"), LONG, i), &HashMap::new(), t)
            .unwrap();
        assert_eq!(sel.rank, rank(2));
        assert_eq!(sel.cost, Some(f64::from(100 * (i as u32 + 1)) / 4000.0));
    }
    // Same capacity: the rank holding 40 of the prompt's blocks adds only 60.
    let mut s = vllm_fleet();
    let sel = s
        .schedule(
            &pair_request("held", LONG, 9),
            &HashMap::from([(rank(1), 40)]),
            t,
        )
        .unwrap();
    assert_eq!(sel.rank, rank(1));
    assert_eq!(sel.overlap_blocks, 40);
    assert_eq!(sel.cost, Some(60.0 / 10_000.0));
}

#[test]
fn prefill_workers_pair_only_with_decode_workers_of_their_protocol() {
    let t = Instant::now();
    let both = reg(3, WorkerRole::Both, None);
    let mut s = fleet(
        SchedulerConfig::default(),
        vec![
            decode(1),
            reg(2, WorkerRole::Decode, Some(TransferProtocol::Sglang)),
            both,
            prefill(11),
            reg(21, WorkerRole::Prefill, Some(TransferProtocol::Sglang)),
        ],
    );
    for (excluded, decode_worker, prefill_worker) in [
        (vec![2, 3], 1, Some(11)),
        (vec![1, 3], 2, Some(21)),
        (vec![1, 2], 3, None),
    ] {
        let mut r = pair_request(&format!("to-{decode_worker}"), LONG, decode_worker);
        r.exclude(excluded.into_iter().map(WorkerId).collect());
        let sel = s.schedule(&r, &HashMap::new(), t).unwrap();
        assert_eq!(sel.rank.worker_id, WorkerId(decode_worker));
        assert_eq!(decision(&sel).1, prefill_worker.map(WorkerId));
    }
}

#[test]
fn a_batch_places_pairs_each_seeing_the_last() {
    let mut s = vllm_fleet();
    let batch: Vec<_> = ["a", "b", "c"]
        .iter()
        .enumerate()
        .map(|(i, name)| (pair_request(name, LONG, i as u64), HashMap::new()))
        .chain(std::iter::once((
            pair_request("short", 64, 9),
            HashMap::new(),
        )))
        .collect();
    let results = s.schedule_batch(&batch, BatchOrder::AsGiven, Instant::now());
    let sels: Vec<Selection> = results.into_iter().map(Result::unwrap).collect();
    assert_ne!(sels[0].rank, sels[1].rank, "b sees a's decode blocks");
    for (sel, (req, _)) in sels.iter().zip(&batch).take(3) {
        assert_eq!(decision(sel).0, DisaggregationReason::LongUncached);
        assert!(s.sequences().contains(&prefill_booking_id(&req.request_id)));
    }
    assert_eq!(decision(&sels[3]).0, DisaggregationReason::ShortUncached);
    assert_eq!(s.active_requests(), 7);
}

#[test]
fn calibration_learns_from_the_prefill_half_not_the_remote_decode_half() {
    let t = Instant::now();
    let mut s = vllm_fleet();
    let sel = s
        .schedule(&pair_request("r", LONG, 1), &HashMap::new(), t)
        .unwrap();
    let p = sel.disaggregation.unwrap().prefill.unwrap().rank;
    let later = t + Duration::from_millis(120);
    s.lifecycle(&id("r"), LifecycleEvent::RemotePrefillDone, later)
        .unwrap();
    s.lifecycle(
        &id("r"),
        LifecycleEvent::PrefillDone,
        later + Duration::from_millis(50),
    )
    .unwrap();
    let samples = |s: &Scheduler, r| s.calibration(r).map_or(0, |c| c.samples);
    assert_eq!(samples(&s, p), 1, "the prefill rank's TTFT");
    assert_eq!(samples(&s, sel.rank), 0, "not the transfer's");

    // A peer's remote decode half (0 tokens on a decode worker) is not learned either.
    let peer = SequenceEvent::AddRequest(AddRequest {
        request_id: id("peer"),
        rank: rank(2),
        block_hashes: Vec::new(),
        request_blocks: 100,
        prefill: PrefillLoadHint::default(),
        origin: Origin::Peer(kv_events::RouterId(9)),
        session_id: None,
    });
    s.apply(peer, t).unwrap();
    s.apply(SequenceEvent::MarkPrefillCompleted(id("peer")), later)
        .unwrap();
    assert_eq!(samples(&s, rank(2)), 0);
}

#[test]
fn a_sessions_last_rank_is_the_decode_rank() {
    let t = Instant::now();
    let mut s = vllm_fleet();
    let session = SessionId::new("conv").unwrap();
    let mut first = pair_request("t1", LONG, 1);
    first.session_id = Some(session.clone());
    let sel = s.schedule(&first, &HashMap::new(), t).unwrap();
    assert_eq!(sel.session, Some(SessionOutcome::Miss));
    // 90 blocks on the other decode rank: emptier, but within the relative margin
    // (94 vs 104 blocks with the next turn's 4).
    let other = if sel.rank == rank(1) { 2 } else { 1 };
    let mut background = pair_request("bg", 90 * 16, 3);
    background.exclude(vec![sel.rank.worker_id]);
    background.allow_disaggregation = false;
    assert_eq!(
        s.schedule(&background, &HashMap::new(), t).unwrap().rank,
        rank(other)
    );
    let mut second = pair_request("t2", 64, 2);
    second.session_id = Some(session);
    let next = s.schedule(&second, &HashMap::new(), t).unwrap();
    assert_eq!(next.rank, sel.rank);
    assert_eq!(next.session, Some(SessionOutcome::Hit));
}
