//! Calibration through the [`Scheduler`] facade: bookings record features, lifecycle
//! steps (local and from peers) feed the estimator, and a rank observed to be slower
//! loses traffic once calibrated.

use super::tests::{rank, request, scheduler, with_policy};
use super::*;
use kv_events::RequestId;
use std::collections::HashMap;
use std::time::Duration;

fn calibrated(enabled: bool) -> SchedulerConfig {
    SchedulerConfig {
        calibration: CalibrationConfig {
            enabled,
            warmup_samples: 10,
            ..CalibrationConfig::default()
        },
        ..with_policy(PolicyConfig::default())
    }
}

/// Routes `n` requests of 2,000 uncached tokens one after another over workers 1
/// and 2 (idle between requests, so only the step-time model tells them apart);
/// worker 2's engine takes `slowdown` × the configured model. Returns how many
/// requests each worker got in the second half, and the scheduler.
fn run(enabled: bool, slowdown: f64, n: u32) -> ([u32; 2], Scheduler) {
    let mut s = scheduler(calibrated(enabled), &[(1, 1), (2, 1)]);
    let seed = StepTimeModelParts::seed();
    let mut now = Instant::now();
    let mut late = [0; 2];
    for i in 0..n {
        let id = format!("r{i}");
        let req = request(&id, 2_000);
        let sel = s.schedule(&req, &HashMap::new(), now).unwrap();
        let worker = usize::try_from(sel.rank.worker_id.0 - 1).unwrap();
        if i >= n / 2 {
            late[worker] += 1;
        }
        let factor = if worker == 1 { slowdown } else { 1.0 };
        now += Duration::from_secs_f64(factor * seed / 1e3);
        s.mark_prefill_completed(&RequestId::from(id.as_str()), now)
            .unwrap();
        s.free(&RequestId::from(id.as_str()), now).unwrap();
    }
    (late, s)
}

/// The configured model's TTFT of 2,000 tokens on an idle rank, in ms.
struct StepTimeModelParts;

impl StepTimeModelParts {
    fn seed() -> f64 {
        let t = policy::predicted_ttft::StepTimeModel::default();
        t.prefill_ms_per_token * 2_000.0 + t.step_base_ms
    }
}

#[test]
fn a_rank_observed_twice_as_slow_gets_fewer_requests_once_calibrated() {
    let (off, s_off) = run(false, 2.0, 200);
    assert!(off[1] > 30, "without calibration idle ranks tie: {off:?}");
    assert_eq!(s_off.calibration(rank(2, 0)), None);

    let (on, s) = run(true, 2.0, 200);
    assert!(on[1] < off[1] / 4, "calibrated {on:?} vs not {off:?}");
    let slow = s.calibration(rank(2, 0)).unwrap();
    let fast = s.calibration(rank(1, 0)).unwrap();
    assert!(slow.in_use && fast.in_use, "{slow:?} {fast:?}");
    // Idle ranks and one prompt size: only the TTFT along these features is
    // identified. Worker 2 stops getting requests soon after its warm-up, so its
    // estimate stays a little short of 2× (the seed still weighs as one sample).
    let features = policy::predicted_ttft::TtftFeatures {
        prefill_tokens: 2_000,
        uncached_tokens: 2_000,
        steps: 1,
        active_requests: 0,
        context_tokens: 0,
        mid_step: false,
    };
    let predicted =
        |m: &policy::predicted_ttft::StepTimeModel| features.parts(m).iter().sum::<f64>();
    let seed = StepTimeModelParts::seed();
    assert!(
        (predicted(&slow.model) / seed - 2.0).abs() < 0.15,
        "{slow:?}"
    );
    assert!(
        (predicted(&fast.model) / seed - 1.0).abs() < 0.05,
        "{fast:?}"
    );
    assert_eq!(s.calibration.pending(), 0, "every booking was settled");
}

#[test]
fn peer_bookings_and_lifecycle_feed_calibration_and_departures_drop_it() {
    let mut s = scheduler(calibrated(true), &[(1, 1)]);
    let t = Instant::now();
    let r = rank(1, 0);
    let add = |id: &str| {
        SequenceEvent::AddRequest(AddRequest {
            request_id: RequestId::from(id),
            rank: r,
            block_hashes: Vec::new(),
            request_blocks: 10,
            prefill: PrefillLoadHint {
                initial_effective_prefill_tokens: 160,
                expected_prefill_duration: None,
            },
            origin: Origin::Peer(kv_events::RouterId(9)),
            session_id: None,
        })
    };
    s.apply(add("p1"), t).unwrap();
    s.apply(
        SequenceEvent::MarkPrefillCompleted(RequestId::from("p1")),
        t + Duration::from_millis(30),
    )
    .unwrap();
    assert_eq!(s.calibration(r).unwrap().samples, 1);
    // Freed or expired before the first token: nothing is learned, nothing kept.
    s.apply(add("p2"), t).unwrap();
    s.apply(SequenceEvent::Free(RequestId::from("p2")), t)
        .unwrap();
    s.apply(add("p3"), t).unwrap();
    s.expire(t + Duration::from_secs(3_600));
    assert_eq!(s.calibration.pending(), 0);
    // A booking on an unregistered rank is refused as before.
    let mut other = add("p4");
    if let SequenceEvent::AddRequest(a) = &mut other {
        a.rank = rank(7, 0);
    }
    assert!(matches!(
        s.apply(other, t),
        Err(SchedulerError::UnregisteredRank(_))
    ));
    s.apply(add("p5"), t).unwrap();
    s.remove_worker(WorkerId(1));
    assert_eq!(s.calibration.pending(), 0);
    assert_eq!(s.calibration(r).unwrap().samples, 0, "estimator dropped");
}
