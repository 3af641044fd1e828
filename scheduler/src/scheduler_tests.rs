//! Unit tests of the [`Scheduler`] facade: booking arithmetic, lifecycle errors,
//! worker churn, policy overrides and load metrics.

use super::*;
use kv_events::DpRank;

const BLOCK: u32 = 16;

fn rank(id: u64, dp: u32) -> WorkerRank {
    WorkerRank::new(WorkerId(id), DpRank(dp))
}

fn reg(id: u64, dp_size: u32) -> WorkerRegistration {
    WorkerRegistration {
        worker_id: WorkerId(id),
        dp_size,
        block_size: BLOCK,
        total_kv_blocks: 1000,
    }
}

fn kv_config(overlap_weight: f64) -> SchedulerConfig {
    SchedulerConfig {
        policy: PolicyConfig::Kv(KvPolicyConfig {
            overlap_weight,
            temperature: 0.0,
        }),
    }
}

fn scheduler(config: SchedulerConfig, workers: &[(u64, u32)]) -> Scheduler {
    let mut s = Scheduler::new(config, Some(11)).unwrap();
    for &(id, dp) in workers {
        s.add_worker(reg(id, dp)).unwrap();
    }
    s
}

/// A request of `num_tokens` tokens at block size 16 (partial last block counted).
fn request(id: &str, num_tokens: u64) -> ScheduleRequest {
    ScheduleRequest {
        request_id: RequestId::from(id),
        request_blocks: num_tokens.div_ceil(u64::from(BLOCK)) as u32,
        num_tokens,
        block_size: BLOCK,
        policy: None,
    }
}

fn with_policy(mut req: ScheduleRequest, policy: PolicyKind) -> ScheduleRequest {
    req.policy = Some(policy);
    req
}

#[test]
fn booking_follows_the_request_lifecycle() {
    let mut s = scheduler(SchedulerConfig::default(), &[(1, 1)]);
    let overlaps = HashMap::from([(rank(1, 0), 3)]);
    // 100 tokens = 7 blocks; 3 cached blocks = 48 tokens, so 52 left to prefill.
    let sel = s.schedule(&request("a", 100), &overlaps).unwrap();
    assert_eq!(sel.rank, rank(1, 0));
    assert_eq!(sel.overlap_blocks, 3);
    assert_eq!(sel.policy, PolicyKind::Kv);
    assert_eq!(sel.cost, Some(4.0));
    assert_eq!(
        s.rank_load(rank(1, 0)),
        RankLoad {
            active_prefill_tokens: 52,
            active_decode_blocks: 7,
            active_requests: 1
        }
    );

    s.mark_prefill_completed(&RequestId::from("a")).unwrap();
    assert_eq!(s.rank_load(rank(1, 0)).active_prefill_tokens, 0);
    assert_eq!(s.rank_load(rank(1, 0)).active_decode_blocks, 7);
    assert_eq!(s.active_requests(), 1);

    s.free(&RequestId::from("a")).unwrap();
    assert_eq!(s.rank_load(rank(1, 0)), RankLoad::default());
    assert_eq!(s.active_requests(), 0);
}

#[test]
fn fully_cached_prompt_books_no_prefill_and_overlap_is_clamped() {
    let mut s = scheduler(SchedulerConfig::default(), &[(1, 1)]);
    // 40 tokens = 3 blocks (last partial); the index claims 9, clamped to 3.
    let overlaps = HashMap::from([(rank(1, 0), 9)]);
    let sel = s.schedule(&request("a", 40), &overlaps).unwrap();
    assert_eq!(sel.overlap_blocks, 3);
    assert_eq!(sel.cost, Some(0.0));
    assert_eq!(s.rank_load(rank(1, 0)).active_prefill_tokens, 0);
    assert_eq!(s.rank_load(rank(1, 0)).active_decode_blocks, 3);
}

#[test]
fn booked_load_spreads_a_burst_of_identical_prompts() {
    let mut s = scheduler(SchedulerConfig::default(), &[(1, 1), (2, 1)]);
    // Both cache 4 of 5 blocks; each booking adds 5 decode blocks to its rank.
    let overlaps = HashMap::from([(rank(1, 0), 4), (rank(2, 0), 4)]);
    for i in 0..6 {
        s.schedule(&request(&format!("r{i}"), 80), &overlaps)
            .unwrap();
    }
    assert_eq!(s.rank_load(rank(1, 0)).active_requests, 3);
    assert_eq!(s.rank_load(rank(2, 0)).active_requests, 3);
}

#[test]
fn duplicate_request_is_rejected_and_books_nothing() {
    let mut s = scheduler(SchedulerConfig::default(), &[(1, 1)]);
    s.schedule(&request("a", 32), &NoOverlap).unwrap();
    assert_eq!(
        s.schedule(&request("a", 320), &NoOverlap),
        Err(SchedulerError::DuplicateRequest(RequestId::from("a")))
    );
    assert_eq!(s.active_requests(), 1);
    assert_eq!(s.rank_load(rank(1, 0)).active_decode_blocks, 2);
}

#[test]
fn unknown_request_ids_are_typed_errors() {
    let mut s = scheduler(SchedulerConfig::default(), &[(1, 1)]);
    let ghost = RequestId::from("ghost");
    assert_eq!(
        s.mark_prefill_completed(&ghost),
        Err(SchedulerError::UnknownRequest(ghost.clone()))
    );
    assert_eq!(
        s.free(&ghost),
        Err(SchedulerError::UnknownRequest(ghost.clone()))
    );
}

#[test]
fn no_workers_until_registered_and_after_all_leave() {
    let mut s = scheduler(SchedulerConfig::default(), &[]);
    assert_eq!(
        s.schedule(&request("a", 16), &NoOverlap),
        Err(SchedulerError::NoWorkers)
    );
    assert_eq!(s.active_requests(), 0);
    s.add_worker(reg(1, 1)).unwrap();
    s.schedule(&request("a", 16), &NoOverlap).unwrap();
    assert_eq!(s.remove_worker(WorkerId(1)), 1);
    assert_eq!(
        s.schedule(&request("b", 16), &NoOverlap),
        Err(SchedulerError::NoWorkers)
    );
}

#[test]
fn removed_worker_loses_its_requests_and_is_never_selected() {
    let mut s = scheduler(
        SchedulerConfig {
            policy: PolicyConfig::Random,
        },
        &[(1, 2), (2, 1)],
    );
    for i in 0..12 {
        s.schedule(&request(&format!("r{i}"), 16), &NoOverlap)
            .unwrap();
    }
    let on_worker_1 =
        s.rank_load(rank(1, 0)).active_requests + s.rank_load(rank(1, 1)).active_requests;
    assert!(on_worker_1 > 0);
    assert_eq!(s.remove_worker(WorkerId(1)), on_worker_1);
    assert_eq!(s.active_requests(), 12 - on_worker_1);
    assert_eq!(s.rank_load(rank(1, 0)), RankLoad::default());
    assert_eq!(s.ranks(), &[rank(2, 0)]);

    // Worker 1 caches everything, but it is gone.
    let overlaps = HashMap::from([(rank(1, 0), 1), (rank(1, 1), 1)]);
    for i in 0..20 {
        let req = with_policy(request(&format!("k{i}"), 16), PolicyKind::Kv);
        assert_eq!(s.schedule(&req, &overlaps).unwrap().rank, rank(2, 0));
    }
    // Requests that were dropped with the worker are unknown afterwards.
    let dropped = (0..12)
        .map(|i| RequestId(format!("r{i}")))
        .filter(|id| s.free(id).is_err())
        .count();
    assert_eq!(dropped, on_worker_1);
}

#[test]
fn shrinking_re_registration_drops_vanished_ranks() {
    let mut s = scheduler(
        SchedulerConfig {
            policy: PolicyConfig::RoundRobin,
        },
        &[(1, 2)],
    );
    s.schedule(&request("a", 16), &NoOverlap).unwrap();
    s.schedule(&request("b", 16), &NoOverlap).unwrap();
    assert_eq!(s.rank_load(rank(1, 1)).active_requests, 1);
    s.add_worker(reg(1, 1)).unwrap();
    assert_eq!(s.ranks(), &[rank(1, 0)]);
    assert_eq!(s.active_requests(), 1);
    assert!(s.free(&RequestId::from("b")).is_err());
    assert!(s.add_worker(reg(1, 0)).is_err());
    assert_eq!(s.workers().len(), 1);
}

#[test]
fn round_robin_cycles_across_dp_ranks() {
    let mut s = scheduler(
        SchedulerConfig {
            policy: PolicyConfig::RoundRobin,
        },
        &[(2, 2), (1, 1)],
    );
    let picks: Vec<WorkerRank> = (0..6)
        .map(|i| {
            s.schedule(&request(&format!("r{i}"), 16), &NoOverlap)
                .unwrap()
                .rank
        })
        .collect();
    let order = [rank(1, 0), rank(2, 0), rank(2, 1)];
    assert_eq!(picks, [order, order].concat());
}

#[test]
fn per_request_override_changes_the_policy() {
    // Daemon: KV with overlap weight 0 (pure load balance).
    let mut s = scheduler(kv_config(0.0), &[(1, 1), (2, 1)]);
    s.schedule(
        &with_policy(request("busy", 160), PolicyKind::RoundRobin),
        &NoOverlap,
    )
    .unwrap();
    // Rank 1/0 now has 10 decode blocks; rank 2/0 none.
    let overlaps = HashMap::from([(rank(1, 0), 4)]);
    let sel = s
        .schedule(&with_policy(request("a", 64), PolicyKind::Kv), &overlaps)
        .unwrap();
    // The daemon's weight 0 applies: the idle rank wins despite rank 1's cache.
    assert_eq!(
        (sel.rank, sel.policy, sel.cost),
        (rank(2, 0), PolicyKind::Kv, Some(0.0))
    );

    let sel = s
        .schedule(
            &with_policy(request("b", 64), PolicyKind::Random),
            &overlaps,
        )
        .unwrap();
    assert_eq!((sel.policy, sel.cost), (PolicyKind::Random, None));
    // The cache hit of the chosen rank is reported and booked whatever the policy.
    assert_eq!(sel.overlap_blocks, overlaps.overlap(sel.rank));

    // Daemon: round-robin. A KV override uses the default knobs (weight 1).
    let mut s = scheduler(
        SchedulerConfig {
            policy: PolicyConfig::RoundRobin,
        },
        &[(1, 1), (2, 1)],
    );
    assert_eq!(
        s.schedule(&request("r1", 16), &NoOverlap).unwrap().rank,
        rank(1, 0)
    );
    assert_eq!(
        s.schedule(&request("r2", 32), &NoOverlap).unwrap().rank,
        rank(2, 0)
    );
    // Decode load: rank 1/0 has 1 block, rank 2/0 has 2. For a 4-block prompt cached
    // on rank 2/0, weight 1 gives 4+1=5 vs 0+2=2 (rank 2/0 wins); weight 0 would
    // give 1 vs 2 (rank 1/0 would win).
    let overlaps = HashMap::from([(rank(2, 0), 4)]);
    let sel = s
        .schedule(&with_policy(request("k", 64), PolicyKind::Kv), &overlaps)
        .unwrap();
    assert_eq!(
        (sel.rank, sel.policy, sel.cost),
        (rank(2, 0), PolicyKind::Kv, Some(2.0))
    );
    // Without the override the daemon's round-robin continues where it left off.
    let sel = s.schedule(&request("plain", 64), &overlaps).unwrap();
    assert_eq!(
        (sel.rank, sel.policy, sel.cost),
        (rank(1, 0), PolicyKind::RoundRobin, None)
    );
}

#[test]
fn load_metrics_are_kept_per_registered_rank() {
    let mut s = scheduler(SchedulerConfig::default(), &[(1, 2)]);
    let sample = |dp: u32, running: u32| LoadMetrics {
        worker_id: WorkerId(1),
        dp_rank: DpRank(dp),
        num_requests_running: running,
        ..LoadMetrics::default()
    };
    assert!(s.update_load_metrics(sample(1, 3)));
    assert!(s.update_load_metrics(sample(1, 5)));
    assert_eq!(s.load_metrics(rank(1, 1)).unwrap().num_requests_running, 5);
    assert!(s.load_metrics(rank(1, 0)).is_none());
    // Unregistered rank or worker: ignored.
    assert!(!s.update_load_metrics(sample(2, 1)));
    assert!(!s.update_load_metrics(LoadMetrics {
        worker_id: WorkerId(9),
        ..LoadMetrics::default()
    }));
    s.remove_worker(WorkerId(1));
    assert!(s.load_metrics(rank(1, 1)).is_none());
}

#[test]
fn rank_loads_lists_every_registered_rank() {
    let mut s = scheduler(SchedulerConfig::default(), &[(1, 2)]);
    s.schedule(&request("a", 48), &NoOverlap).unwrap();
    let loads: Vec<(WorkerRank, RankLoad)> = s.rank_loads().collect();
    assert_eq!(loads.len(), 2);
    let total: u64 = loads.iter().map(|(_, l)| l.active_decode_blocks).sum();
    assert_eq!(total, 3);
}

#[test]
fn invalid_config_is_rejected_at_construction() {
    let err = Scheduler::new(kv_config(-1.0), None).unwrap_err();
    assert!(matches!(
        err,
        SchedulerError::InvalidConfig {
            field: "policy.kv.overlap_weight",
            ..
        }
    ));
}
