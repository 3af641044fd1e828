//! Unit tests of liveness from silence through the [`Scheduler`] facade: a rank whose
//! load metrics stop is deprioritized, then excluded, until it reports again.

use super::tests::{rank, request, scheduler, with_policy};
use super::*;
use kv_events::LoadMetrics;
use kv_events::routing::PolicyKind;
use std::time::Duration;

const INTERVAL: Duration = Duration::from_millis(100);

fn config() -> SchedulerConfig {
    SchedulerConfig {
        liveness: LivenessConfig {
            enabled: true,
            metrics_interval: INTERVAL,
            quiet_intervals: 3,
            silent_intervals: 10,
        },
        ..with_policy(PolicyConfig::default_for(PolicyKind::RoundRobin))
    }
}

fn report(s: &mut Scheduler, worker: u64, now: Instant) {
    let sample = LoadMetrics {
        worker_id: WorkerId(worker),
        ..LoadMetrics::default()
    };
    assert!(s.update_load_metrics(sample, now));
}

/// Schedules `n` requests at `now` and returns the workers chosen.
fn route(s: &mut Scheduler, tag: &str, n: usize, now: Instant) -> Vec<u64> {
    (0..n)
        .map(|i| {
            let sel = s
                .schedule(&request(&format!("{tag}-{i}"), 32), &NoOverlap, now)
                .expect("routed");
            sel.rank.worker_id.0
        })
        .collect()
}

fn excluding(id: &str, workers: &[u64]) -> ScheduleRequest {
    let mut req = request(id, 32);
    req.exclude(workers.iter().map(|&w| WorkerId(w)).collect());
    req
}

#[test]
fn a_rank_that_stops_reporting_is_deprioritized_then_excluded_until_it_reports() {
    let mut s = scheduler(config(), &[(1, 1), (2, 1), (3, 1)]);
    let t = Instant::now();
    for w in 1..=3 {
        report(&mut s, w, t);
    }
    let mut chosen = route(&mut s, "live", 6, t);
    chosen.sort_unstable();
    assert_eq!(chosen, vec![1, 1, 2, 2, 3, 3], "all live: round robin");

    // Workers 1 and 2 keep reporting; worker 3 falls silent.
    let quiet = t + INTERVAL * 3;
    report(&mut s, 1, quiet);
    report(&mut s, 2, quiet);
    assert_eq!(s.liveness(rank(3, 0), quiet), (Liveness::Quiet, Some(t)));
    assert!(!route(&mut s, "quiet", 6, quiet).contains(&3));
    // Deprioritized, not excluded: it serves when no live rank may.
    let sel = s
        .schedule(&excluding("only-3", &[1, 2]), &NoOverlap, quiet)
        .expect("a quiet rank is a fallback");
    assert_eq!(sel.rank, rank(3, 0));

    let silent = t + INTERVAL * 10;
    report(&mut s, 1, silent);
    report(&mut s, 2, silent);
    assert_eq!(s.liveness(rank(3, 0), silent).0, Liveness::Silent);
    assert!(!route(&mut s, "silent", 6, silent).contains(&3));
    assert_eq!(
        s.schedule(&excluding("none", &[1, 2]), &NoOverlap, silent),
        Err(SchedulerError::AllBusy),
        "a silent rank is excluded"
    );

    // It reports again: back in the rotation at once.
    report(&mut s, 3, silent);
    assert_eq!(s.liveness(rank(3, 0), silent).0, Liveness::Live);
    assert!(route(&mut s, "back", 3, silent).contains(&3));
}

#[test]
fn a_rank_that_never_reported_is_never_excluded() {
    let mut s = scheduler(config(), &[(1, 1), (2, 1)]);
    let t = Instant::now();
    report(&mut s, 1, t);
    let much_later = t + INTERVAL * 1000;
    report(&mut s, 1, much_later);
    assert_eq!(
        s.liveness(rank(2, 0), much_later),
        (Liveness::NeverReported, None)
    );
    let chosen = route(&mut s, "r", 4, much_later);
    assert_eq!(chosen.iter().filter(|&&w| w == 2).count(), 2);
}

#[test]
fn when_every_rank_is_silent_silence_is_not_held_against_them() {
    let mut s = scheduler(config(), &[(1, 1), (2, 1)]);
    let t = Instant::now();
    report(&mut s, 1, t);
    report(&mut s, 2, t);
    let later = t + INTERVAL * 50;
    let mut chosen = route(&mut s, "r", 2, later);
    chosen.sort_unstable();
    assert_eq!(
        chosen,
        vec![1, 2],
        "the router's own feed is the likelier fault"
    );
}

#[test]
fn disabled_liveness_routes_by_lease_alone() {
    let mut config = config();
    config.liveness.enabled = false;
    let mut s = scheduler(config, &[(1, 1), (2, 1)]);
    let t = Instant::now();
    report(&mut s, 1, t);
    report(&mut s, 2, t);
    let later = t + INTERVAL * 50;
    report(&mut s, 1, later);
    assert_eq!(s.liveness(rank(2, 0), later).0, Liveness::Live);
    assert!(route(&mut s, "r", 2, later).contains(&2));
}

#[test]
fn removing_a_worker_forgets_its_reports() {
    let mut s = scheduler(config(), &[(1, 1)]);
    let t = Instant::now();
    report(&mut s, 1, t);
    s.remove_worker(WorkerId(1));
    s.add_worker(WorkerRegistration {
        worker_id: WorkerId(1),
        dp_size: 1,
        block_size: 16,
        total_kv_blocks: 100,
        url: None,
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    })
    .unwrap();
    assert_eq!(
        s.liveness(rank(1, 0), t + INTERVAL * 50),
        (Liveness::NeverReported, None)
    );
}
