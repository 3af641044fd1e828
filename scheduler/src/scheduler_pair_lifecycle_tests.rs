//! Both bookings of a disaggregated request through the [`Scheduler`] facade: every
//! lifecycle path, keep-alive and expiry, and nothing booked on error.

use super::pair_tests::{LONG, decode, fleet, id, pair_request, prefill, reg};
use super::*;
use kv_events::disaggregation::{
    DisaggregationReason, TransferProtocol, WorkerRole, prefill_booking_id,
};
use kv_events::replicas::SequenceUpdate;
use kv_events::routing::LifecycleEvent;
use std::collections::HashMap;
use std::time::Duration;

/// Books `long` (disaggregated) on the vLLM fleet; returns the scheduler, the
/// decode and prefill ranks.
fn booked_pair(t: Instant) -> (Scheduler, WorkerRank, WorkerRank) {
    let mut s = fleet(
        SchedulerConfig {
            sequences: SequencesConfig {
                request_ttl: Duration::from_secs(1),
                ..SequencesConfig::default()
            },
            ..SchedulerConfig::default()
        },
        vec![decode(1), decode(2), prefill(11), prefill(12)],
    );
    let sel = s
        .schedule(&pair_request("long", LONG, 1), &HashMap::new(), t)
        .unwrap();
    let prefill = sel.disaggregation.unwrap().prefill.unwrap().rank;
    let d = s.rank_load_at(sel.rank, t);
    assert_eq!((d.active_prefill_tokens, d.active_decode_blocks), (0, 100));
    let p = s.rank_load_at(prefill, t);
    assert_eq!(
        (p.active_prefill_tokens, p.active_decode_blocks),
        (LONG, 100)
    );
    (s, sel.rank, prefill)
}

fn loads(s: &Scheduler, ranks: [WorkerRank; 2], t: Instant) -> [(u64, u64); 2] {
    ranks.map(|r| {
        let l = s.rank_load_at(r, t);
        (l.active_prefill_tokens, l.active_decode_blocks)
    })
}

fn steps(applied: &[LifecycleStep]) -> Vec<(String, SequenceUpdate)> {
    applied
        .iter()
        .map(|s| {
            assert_eq!(s.origin, Origin::Local);
            (s.request_id.0.clone(), s.update.clone())
        })
        .collect()
}

#[test]
fn both_halves_are_released_through_the_lifecycle() {
    let t = Instant::now();
    let (mut s, d, p) = booked_pair(t);
    let long = id("long");
    let applied = s
        .lifecycle(&long, LifecycleEvent::RemotePrefillDone, t)
        .unwrap();
    assert_eq!(
        steps(&applied),
        [("long#prefill".into(), SequenceUpdate::PrefillDone)]
    );
    assert_eq!(loads(&s, [d, p], t), [(0, 100), (0, 100)], "blocks held");
    let applied = s.lifecycle(&long, LifecycleEvent::KeepAlive, t).unwrap();
    assert_eq!(applied.len(), 2);
    let applied = s.lifecycle(&long, LifecycleEvent::PrefillDone, t).unwrap();
    assert_eq!(
        steps(&applied),
        [
            ("long".into(), SequenceUpdate::PrefillDone),
            ("long#prefill".into(), SequenceUpdate::Freed)
        ]
    );
    assert_eq!(loads(&s, [d, p], t), [(0, 100), (0, 0)]);
    assert_eq!(
        s.lifecycle(&long, LifecycleEvent::RemotePrefillDone, t),
        Err(SchedulerError::UnknownRequest(prefill_booking_id(&long))),
        "late: the half is gone"
    );
    let applied = s.lifecycle(&long, LifecycleEvent::Freed, t).unwrap();
    assert_eq!(steps(&applied), [("long".into(), SequenceUpdate::Freed)]);
    assert_eq!(loads(&s, [d, p], t), [(0, 0), (0, 0)]);
    assert_eq!(s.active_requests(), 0);
    assert_eq!(
        s.lifecycle(&long, LifecycleEvent::Freed, t),
        Err(SchedulerError::UnknownRequest(long))
    );
}

#[test]
fn freed_releases_both_halves_at_once_and_half_ids_are_not_frontends() {
    let t = Instant::now();
    let (mut s, d, p) = booked_pair(t);
    let half = prefill_booking_id(&id("long"));
    assert_eq!(
        s.lifecycle(&half, LifecycleEvent::Freed, t),
        Err(SchedulerError::ReservedRequestId(half))
    );
    let applied = s.lifecycle(&id("long"), LifecycleEvent::Freed, t).unwrap();
    assert_eq!(applied.len(), 2);
    assert_eq!(loads(&s, [d, p], t), [(0, 0), (0, 0)]);
    assert_eq!(s.active_requests(), 0);
}

#[test]
fn keep_alive_refreshes_both_halves_and_expiry_frees_both() {
    let t = Instant::now();
    let ms = |n| t + Duration::from_millis(n);
    let (mut s, d, p) = booked_pair(t);
    s.lifecycle(&id("long"), LifecycleEvent::KeepAlive, ms(900))
        .unwrap();
    assert!(s.expire(ms(1500)).is_empty(), "both refreshed at 900 ms");
    let mut expired: Vec<String> = s.expire(ms(1900)).into_iter().map(|(r, _)| r.0).collect();
    expired.sort();
    assert_eq!(expired, ["long", "long#prefill"]);
    assert_eq!(loads(&s, [d, p], ms(1900)), [(0, 0), (0, 0)]);
}

#[test]
fn nothing_is_booked_on_error() {
    let t = Instant::now();
    let (mut s, _, _) = booked_pair(t);
    // Free the decode half alone (a peer's step): its prefill half stays.
    s.free(&id("long"), t).unwrap();
    assert_eq!(
        s.schedule(&pair_request("long", LONG, 1), &HashMap::new(), t),
        Err(SchedulerError::DuplicateRequest(prefill_booking_id(&id(
            "long"
        ))))
    );
    assert_eq!(s.active_requests(), 1, "the half only");
    let reserved = pair_request("x#prefill", LONG, 2);
    assert_eq!(
        s.schedule(&reserved, &HashMap::new(), t),
        Err(SchedulerError::ReservedRequestId(id("x#prefill")))
    );
    // Every decode rank busy: neither half is booked, though prefill ranks are free.
    let config = SchedulerConfig {
        busy: BusyThresholds {
            decode_blocks: Some(Threshold::Absolute(50)),
            prefill_tokens: None,
        },
        ..SchedulerConfig::default()
    };
    let mut s = fleet(config, vec![decode(1), prefill(11)]);
    s.schedule(&pair_request("a", LONG, 1), &HashMap::new(), t)
        .unwrap();
    assert_eq!(
        s.schedule(&pair_request("b", LONG, 2), &HashMap::new(), t),
        Err(SchedulerError::AllBusy)
    );
    assert_eq!(s.active_requests(), 2, "a and its half");
}

/// An SGLang decode server refuses a request without a bootstrap (it cannot prefill):
/// it gets no whole request, a short prompt on it is still disaggregated, and without
/// an eligible prefill worker the request fails with nothing booked.
#[test]
fn an_sglang_decode_worker_never_prefills_itself() {
    let t = Instant::now();
    let sglang = |id, role| reg(id, role, Some(TransferProtocol::Sglang));
    let mut s = fleet(
        SchedulerConfig::default(),
        vec![
            sglang(2, WorkerRole::Decode),
            sglang(21, WorkerRole::Prefill),
        ],
    );
    let mut whole = pair_request("whole", LONG, 1);
    whole.allow_disaggregation = false;
    assert_eq!(
        s.schedule(&whole, &HashMap::new(), t),
        Err(SchedulerError::NoWorkers)
    );
    // 32 tokens: short enough to stay local on a vLLM decode worker.
    let sel = s
        .schedule(&pair_request("short", 32, 2), &HashMap::new(), t)
        .unwrap();
    let decision = sel.disaggregation.unwrap();
    assert_eq!(decision.reason, DisaggregationReason::LongUncached);
    assert_eq!(decision.prefill.unwrap().rank.worker_id, WorkerId(21));
    let mut no_prefill = pair_request("no-prefill", LONG, 3);
    no_prefill.exclude(vec![WorkerId(21)]);
    assert_eq!(
        s.schedule(&no_prefill, &HashMap::new(), t),
        Err(SchedulerError::AllBusy)
    );
    assert_eq!(
        s.active_requests(),
        2,
        "only the short request's two halves"
    );
}
