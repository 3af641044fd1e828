//! Unit tests of the [`Scheduler`] facade: booking arithmetic, lifecycle and expiry,
//! worker churn, dp_rank pinning, busy exclusion, overrides, KV reuse and decay.

use super::*;
use kv_events::LocalBlockHash;
use kv_events::RequestId;
use kv_events::routing::CostOverrides;
use kv_events::{DpRank, LoadMetrics};
use std::collections::HashMap;
use std::time::Duration;

const BLOCK: u32 = 16;

pub(super) fn rank(id: u64, dp: u32) -> WorkerRank {
    WorkerRank::new(WorkerId(id), DpRank(dp))
}

fn reg(id: u64, dp_size: u32) -> WorkerRegistration {
    WorkerRegistration {
        worker_id: WorkerId(id),
        dp_size,
        block_size: BLOCK,
        total_kv_blocks: 100,
        url: None,
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    }
}

pub(super) fn with_policy(policy: PolicyConfig) -> SchedulerConfig {
    SchedulerConfig {
        policy,
        ..SchedulerConfig::default()
    }
}

fn kv_config(prefill_load_scale: f64) -> SchedulerConfig {
    with_policy(PolicyConfig::Kv(KvPolicyConfig {
        prefill_load_scale,
        ..KvPolicyConfig::default()
    }))
}

pub(super) fn scheduler(config: SchedulerConfig, workers: &[(u64, u32)]) -> Scheduler {
    let mut s = Scheduler::new(config, Some(11)).unwrap();
    for &(id, dp) in workers {
        s.add_worker(reg(id, dp)).unwrap();
    }
    s
}

/// A request of `num_tokens` tokens at block size 16 whose full blocks hash to
/// `seed * 1000 + i`.
pub(super) fn request(id: &str, num_tokens: u64) -> ScheduleRequest {
    prefixed(id, num_tokens, 0)
}

fn prefixed(id: &str, num_tokens: u64, seed: u64) -> ScheduleRequest {
    let hashes = (0..num_tokens / u64::from(BLOCK))
        .map(|i| LocalBlockHash(seed * 1000 + i))
        .collect();
    ScheduleRequest::new(id, hashes, num_tokens, BLOCK)
}

fn kind(mut req: ScheduleRequest, policy: PolicyKind) -> ScheduleRequest {
    req.policy = Some(policy);
    req
}

fn pinned(mut req: ScheduleRequest, dp: u32) -> ScheduleRequest {
    req.dp_rank = Some(DpRank(dp));
    req
}

fn rid(s: &str) -> RequestId {
    RequestId::from(s)
}

#[test]
fn booking_follows_the_request_lifecycle() {
    let t = Instant::now();
    let mut s = scheduler(kv_config(1.0), &[(1, 1)]);
    let overlaps = HashMap::from([(rank(1, 0), 3)]);
    // 100 tokens = 7 blocks; 3 cached blocks = 48 tokens, so 52 left to prefill.
    let sel = s.schedule(&request("a", 100), &overlaps, t).unwrap();
    assert_eq!(sel.rank, rank(1, 0));
    assert_eq!(sel.overlap_blocks, 3);
    assert_eq!(sel.policy, PolicyKind::Kv);
    // Idle rank: 4 uncached blocks + 7 new decode blocks.
    assert_eq!(sel.cost, Some(11.0));
    assert_eq!(
        sel.prefill,
        PrefillLoadHint {
            initial_effective_prefill_tokens: 52,
            expected_prefill_duration: None
        }
    );
    assert_eq!(
        s.rank_load_at(rank(1, 0), t),
        RankLoad {
            active_prefill_tokens: 52,
            active_decode_blocks: 7,
            active_requests: 1,
            active_uncached_tokens: 52,
            active_context_blocks: 7,
        }
    );
    assert_eq!(s.mark_prefill_completed(&rid("a"), t), Ok(Origin::Local));
    assert_eq!(s.rank_load_at(rank(1, 0), t).active_prefill_tokens, 0);
    assert_eq!(s.rank_load_at(rank(1, 0), t).active_decode_blocks, 7);
    s.free(&rid("a"), t).unwrap();
    assert_eq!(s.rank_load_at(rank(1, 0), t), RankLoad::default());
    assert_eq!(s.active_requests(), 0);
}

#[test]
fn unfreed_requests_expire_and_lifecycle_messages_keep_them_alive() {
    let t0 = Instant::now();
    let mut config = SchedulerConfig::default();
    config.sequences.request_ttl = Duration::from_secs(10);
    let mut s = scheduler(config, &[(1, 1)]);
    s.schedule(&request("crashed", 32), &NoOverlap, t0).unwrap();
    s.schedule(&request("healthy", 32), &NoOverlap, t0).unwrap();
    assert_eq!(s.next_expiry(), Some(t0 + Duration::from_secs(10)));
    // The healthy one reports prefill done at 5 s and keeps alive every 8 s.
    s.mark_prefill_completed(&rid("healthy"), t0 + Duration::from_secs(5))
        .unwrap();
    let expired = s.expire(t0 + Duration::from_secs(10));
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].0, rid("crashed"));
    for k in 1..10 {
        s.keep_alive(&rid("healthy"), t0 + Duration::from_secs(5 + 8 * k))
            .unwrap();
        assert!(s.expire(t0 + Duration::from_secs(5 + 8 * k + 7)).is_empty());
    }
    assert_eq!(s.active_requests(), 1);
    assert_eq!(
        s.free(&rid("crashed"), t0),
        Err(SchedulerError::UnknownRequest(rid("crashed")))
    );
}

#[test]
fn booked_load_spreads_a_burst_of_identical_prompts() {
    let t = Instant::now();
    let mut s = scheduler(SchedulerConfig::default(), &[(1, 1), (2, 1)]);
    // Both cache 4 of 5 blocks; each booking adds load to its rank.
    let overlaps = HashMap::from([(rank(1, 0), 4), (rank(2, 0), 4)]);
    for i in 0..6 {
        s.schedule(&prefixed(&format!("r{i}"), 80, i), &overlaps, t)
            .unwrap();
    }
    assert_eq!(s.rank_load_at(rank(1, 0), t).active_requests, 3);
    assert_eq!(s.rank_load_at(rank(2, 0), t).active_requests, 3);
}

#[test]
fn kv_reuse_keeps_same_prefix_requests_together_until_it_is_turned_off() {
    let t = Instant::now();
    // Rank 1/0 runs turn 1 of a conversation (8 blocks), rank 2/0 an unrelated 3-block
    // request; both finished prefill. Turn 2 extends turn 1 to 10 blocks; no rank
    // caches it yet (overlap 0). Costs: prefill 10 everywhere; decode
    //   reuse:    rank 1 = 8 held + 2 new = 10, rank 2 = 3 + 10 = 13 → rank 1 (20)
    //   no reuse: rank 1 = 8 + 10 = 18,        rank 2 = 13        → rank 2 (23)
    for (reuse, expected, cost, held) in
        [(true, rank(1, 0), 20.0, 10), (false, rank(2, 0), 23.0, 13)]
    {
        let mut config = kv_config(1.0);
        config.sequences.assume_kv_reuse = reuse;
        let mut s = scheduler(config, &[(1, 1), (2, 1)]);
        let rr = |r| kind(r, PolicyKind::RoundRobin);
        s.schedule(&rr(prefixed("turn-1", 128, 7)), &NoOverlap, t)
            .unwrap();
        s.schedule(&rr(prefixed("other", 48, 9)), &NoOverlap, t)
            .unwrap();
        s.mark_prefill_completed(&rid("turn-1"), t).unwrap();
        s.mark_prefill_completed(&rid("other"), t).unwrap();
        let sel = s
            .schedule(&prefixed("turn-2", 160, 7), &NoOverlap, t)
            .unwrap();
        assert_eq!(
            (sel.rank, sel.cost),
            (expected, Some(cost)),
            "assume_kv_reuse = {reuse}"
        );
        assert_eq!(s.rank_load_at(sel.rank, t).active_decode_blocks, held);
    }
}

#[test]
fn decaying_prefill_makes_a_rank_attractive_again() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let mut config = kv_config(1.0);
    config.prefill_duration = PrefillDurationModel::Throughput {
        tokens_per_second: 1600.0,
    };
    let mut s = scheduler(config, &[(1, 1), (2, 1)]);
    // 1600-token prompts (100 blocks, 1 s of prefill each): one on rank 1/0 at 0 ms,
    // one on rank 2/0 at 500 ms.
    let rr = |r| kind(r, PolicyKind::RoundRobin);
    let sel = s
        .schedule(&rr(prefixed("big-1", 1600, 1)), &NoOverlap, t0)
        .unwrap();
    assert_eq!(sel.rank, rank(1, 0));
    assert_eq!(
        sel.prefill.expected_prefill_duration,
        Some(Duration::from_secs(1))
    );
    s.schedule(&rr(prefixed("big-2", 1600, 2)), &NoOverlap, at(500))
        .unwrap();
    assert_eq!(
        s.rank_load_at(rank(1, 0), at(250)).active_prefill_tokens,
        1200
    );
    assert_eq!(
        s.rank_load_at(rank(1, 0), at(500)).active_prefill_tokens,
        800
    );
    assert_eq!(
        s.rank_load_at(rank(2, 0), at(500)).active_prefill_tokens,
        1600
    );
    // Equal decode load (100 blocks each), but rank 1's prefill is half done:
    // rank 1 = 800/16 + 1 + 100 + 1 = 152, rank 2 = 100 + 1 + 100 + 1 = 202.
    let sel = s
        .schedule(&prefixed("probe", 16, 3), &NoOverlap, at(500))
        .unwrap();
    assert_eq!((sel.rank, sel.cost), (rank(1, 0), Some(152.0)));
    // The probe queues behind big-1 and only starts decaying when big-1 completes.
    assert_eq!(
        s.rank_load_at(rank(1, 0), at(1000)).active_prefill_tokens,
        16
    );
    s.mark_prefill_completed(&rid("big-1"), at(1000)).unwrap();
    assert_eq!(
        s.rank_load_at(rank(1, 0), at(1005)).active_prefill_tokens,
        8
    );
}

#[test]
fn pinned_dp_rank_is_honoured_or_refused_never_substituted() {
    let t = Instant::now();
    let mut s = scheduler(SchedulerConfig::default(), &[(1, 2), (2, 1)]);
    // Rank 2/0 caches everything, but the request pins dp_rank 1: only 1/1 qualifies.
    let overlaps = HashMap::from([(rank(2, 0), 5)]);
    let sel = s
        .schedule(&pinned(request("p", 80), 1), &overlaps, t)
        .unwrap();
    assert_eq!(sel.rank, rank(1, 1));
    // No worker has dp_rank 2.
    assert_eq!(
        s.schedule(&pinned(request("q", 80), 2), &overlaps, t),
        Err(SchedulerError::RankUnavailable(DpRank(2)))
    );
    assert!(!s.sequences().contains(&rid("q")));
    // dp_rank 0 exists on two workers: the pinned request may use either.
    let sel = s
        .schedule(&pinned(request("r", 80), 0), &overlaps, t)
        .unwrap();
    assert_eq!(sel.rank, rank(2, 0));
    // Once worker 1 leaves, dp_rank 1 is gone.
    s.remove_worker(WorkerId(1));
    assert_eq!(
        s.schedule(&pinned(request("s", 80), 1), &overlaps, t),
        Err(SchedulerError::RankUnavailable(DpRank(1)))
    );
}

#[test]
fn busy_ranks_are_skipped_and_all_busy_books_nothing() {
    let t = Instant::now();
    // Cache-aware-threshold sends a well-cached prompt to its best match while loads
    // are balanced, so only busy exclusion can divert it.
    let mut config = with_policy(PolicyConfig::default_for(PolicyKind::CacheAwareThreshold));
    // total_kv_blocks is 100: busy at 50 decode blocks.
    config.busy.decode_blocks = Some(Threshold::Fraction(0.5));
    let mut s = scheduler(config, &[(1, 1), (2, 1)]);
    let rr = |r| kind(r, PolicyKind::RoundRobin);
    s.schedule(&rr(prefixed("load-1", 48 * 16, 1)), &NoOverlap, t)
        .unwrap();
    let overlaps = HashMap::from([(rank(1, 0), 4)]);
    let sel = s.schedule(&prefixed("a", 64, 2), &overlaps, t).unwrap();
    assert_eq!(sel.rank, rank(1, 0), "48 < 50 blocks: not busy yet");
    // Now 52 blocks: busy, so the cached rank is skipped even for a full hit.
    assert!(s.is_busy_at(rank(1, 0), t));
    let sel = s.schedule(&prefixed("b", 64, 3), &overlaps, t).unwrap();
    assert_eq!(sel.rank, rank(2, 0));
    // Fill rank 2/0 too (4 + 46 = 50 blocks): every rank is busy.
    s.schedule(&pinned(prefixed("load-2", 46 * 16, 4), 0), &NoOverlap, t)
        .unwrap();
    assert!(s.is_busy_at(rank(2, 0), t));
    let before = s.active_requests();
    assert_eq!(
        s.schedule(&prefixed("c", 64, 5), &overlaps, t),
        Err(SchedulerError::AllBusy)
    );
    assert_eq!(s.active_requests(), before);
    // Freeing load makes the cached rank eligible again.
    s.free(&rid("load-1"), t).unwrap();
    assert_eq!(
        s.schedule(&prefixed("c", 64, 5), &overlaps, t)
            .unwrap()
            .rank,
        rank(1, 0)
    );
}

#[test]
fn engine_reported_load_can_make_a_rank_busy() {
    let t = Instant::now();
    let mut config = SchedulerConfig::default();
    config.busy.prefill_tokens = Some(Threshold::Absolute(1000));
    let mut s = scheduler(config, &[(1, 1), (2, 1)]);
    s.update_load_metrics(
        LoadMetrics {
            worker_id: WorkerId(1),
            active_prefill_tokens: 5000,
            ..LoadMetrics::default()
        },
        t,
    );
    let overlaps = HashMap::from([(rank(1, 0), 4)]);
    for i in 0..5 {
        let sel = s
            .schedule(&request(&format!("r{i}"), 64), &overlaps, t)
            .unwrap();
        assert_eq!(sel.rank, rank(2, 0));
    }
}

#[test]
fn per_request_policy_and_overrides() {
    let t = Instant::now();
    // Daemon: kv with prefill weight 0 (pure decode balance).
    let mut s = scheduler(kv_config(0.0), &[(1, 1), (2, 1)]);
    s.schedule(
        &kind(prefixed("busy", 160, 1), PolicyKind::RoundRobin),
        &NoOverlap,
        t,
    )
    .unwrap();
    s.mark_prefill_completed(&rid("busy"), t).unwrap();
    // Rank 1/0 holds 10 decode blocks, rank 2/0 none; rank 1 caches the 4-block prompt.
    // Weight 0: rank 1 = 10 + 4 = 14, rank 2 = 0 + 4 = 4.
    let overlaps = HashMap::from([(rank(1, 0), 4)]);
    let sel = s.schedule(&prefixed("a", 64, 2), &overlaps, t).unwrap();
    assert_eq!((sel.rank, sel.cost), (rank(2, 0), Some(4.0)));
    s.mark_prefill_completed(&rid("a"), t).unwrap();
    // Weight overridden to 10. The 64-token prompt is exactly 4 blocks, so an engine
    // reuses at most 3 of them (it computes the last token): rank 1 = 10×1 + 10 + 4 =
    // 24, rank 2 = 10×4 + 4 + 4 = 48.
    let mut heavy = prefixed("b", 64, 3);
    heavy.overrides = CostOverrides {
        prefill_load_scale: Some(10.0),
        ..CostOverrides::default()
    };
    let sel = s.schedule(&heavy, &overlaps, t).unwrap();
    assert_eq!((sel.rank, sel.cost), (rank(1, 0), Some(24.0)));
    assert_eq!(
        sel.overlap_blocks, 3,
        "the last token's block is computed again"
    );
    // An override the policy lacks is refused and books nothing.
    let mut bad = prefixed("c", 64, 4);
    bad.overrides.load_balance_weight = Some(1.0);
    assert!(matches!(
        s.schedule(&bad, &overlaps, t),
        Err(SchedulerError::InvalidOverride {
            field: "load_balance_weight",
            ..
        })
    ));
    assert!(!s.sequences().contains(&rid("c")));
    // Another kind per request runs with that kind's defaults.
    let sel = s
        .schedule(
            &kind(prefixed("d", 64, 5), PolicyKind::Random),
            &overlaps,
            t,
        )
        .unwrap();
    assert_eq!((sel.policy, sel.cost), (PolicyKind::Random, None));
    assert_eq!(sel.overlap_blocks, overlaps.overlap(sel.rank).min(3));
    let sel = s
        .schedule(
            &kind(prefixed("e", 64, 6), PolicyKind::KvNormalized),
            &overlaps,
            t,
        )
        .unwrap();
    assert_eq!(sel.policy, PolicyKind::KvNormalized);
}

#[test]
fn round_robin_cycles_across_dp_ranks() {
    let t = Instant::now();
    let mut s = scheduler(with_policy(PolicyConfig::RoundRobin), &[(2, 2), (1, 1)]);
    let picks: Vec<WorkerRank> = (0..6)
        .map(|i| {
            s.schedule(&request(&format!("r{i}"), 16), &NoOverlap, t)
                .unwrap()
                .rank
        })
        .collect();
    let order = [rank(1, 0), rank(2, 0), rank(2, 1)];
    assert_eq!(picks, [order, order].concat());
}

#[test]
fn worker_churn_drops_requests_and_shrinks_ranks() {
    let t = Instant::now();
    let mut s = scheduler(with_policy(PolicyConfig::Random), &[(1, 2), (2, 1)]);
    for i in 0..12 {
        s.schedule(&request(&format!("r{i}"), 16), &NoOverlap, t)
            .unwrap();
    }
    let on_1 = s.rank_load_at(rank(1, 0), t).active_requests
        + s.rank_load_at(rank(1, 1), t).active_requests;
    assert!(on_1 > 0);
    assert_eq!(s.remove_worker(WorkerId(1)), on_1);
    assert_eq!(s.active_requests(), 12 - on_1);
    assert_eq!(s.ranks(), &[rank(2, 0)]);
    assert_eq!(s.remove_worker(WorkerId(2)), 12 - on_1);
    assert_eq!(s.next_expiry(), None, "dropped requests leave no deadline");
    assert_eq!(
        s.schedule(&request("x", 16), &NoOverlap, t),
        Err(SchedulerError::NoWorkers)
    );
    // Shrinking re-registration drops the vanished rank's requests.
    let mut s = scheduler(with_policy(PolicyConfig::RoundRobin), &[(1, 2)]);
    s.schedule(&request("a", 16), &NoOverlap, t).unwrap();
    s.schedule(&request("b", 16), &NoOverlap, t).unwrap();
    s.add_worker(reg(1, 1)).unwrap();
    assert_eq!(s.ranks(), &[rank(1, 0)]);
    assert_eq!(s.active_requests(), 1);
    assert!(s.add_worker(reg(1, 0)).is_err());
}

#[test]
fn duplicate_ids_and_load_metrics() {
    let t = Instant::now();
    let mut s = scheduler(SchedulerConfig::default(), &[(1, 2)]);
    s.schedule(&request("a", 32), &NoOverlap, t).unwrap();
    assert_eq!(
        s.schedule(&request("a", 320), &NoOverlap, t),
        Err(SchedulerError::DuplicateRequest(rid("a")))
    );
    let sample = |dp: u32, running: u32| LoadMetrics {
        worker_id: WorkerId(1),
        dp_rank: DpRank(dp),
        num_requests_running: running,
        ..LoadMetrics::default()
    };
    assert!(s.update_load_metrics(sample(1, 5), Instant::now()));
    assert_eq!(s.load_metrics(rank(1, 1)).unwrap().num_requests_running, 5);
    assert!(
        !s.update_load_metrics(sample(2, 1), Instant::now()),
        "unregistered rank ignored"
    );
    assert_eq!(s.rank_loads().count(), 2);
    let err = Scheduler::new(kv_config(-1.0), None).unwrap_err();
    assert!(matches!(
        err,
        SchedulerError::InvalidConfig {
            field: "policy.kv.prefill_load_scale",
            ..
        }
    ));
}

#[test]
fn lower_tier_overlap_flows_from_the_index_scores() {
    let t = Instant::now();
    // Rank 2 holds 5 of the 7 prompt blocks on CPU only, rank 1 nothing.
    let mut scores = indexer::OverlapScores::new();
    scores.any_tier.insert(rank(2, 0), 5);
    for config in [kv_config(1.0), SchedulerConfig::default()] {
        let mut s = scheduler(config, &[(1, 1), (2, 1)]);
        let sel = s.schedule(&request("a", 100), &scores, t).unwrap();
        assert_eq!(sel.rank, rank(2, 0), "{:?}", sel.policy);
        assert_eq!(sel.overlap_blocks, 0, "no GPU overlap");
    }
    // kv: 7 − 0.5 × 5 prefill blocks + 7 new decode blocks; an any-tier prefix
    // longer than the prompt counts as the prompt's 6 full blocks (the partial 7th
    // cannot be cached).
    let mut s = scheduler(kv_config(1.0), &[(2, 1)]);
    let sel = s.schedule(&request("b", 100), &scores, t).unwrap();
    assert_eq!(sel.cost, Some(4.5 + 7.0));
    scores.any_tier.insert(rank(2, 0), 50);
    let mut s = scheduler(kv_config(1.0), &[(2, 1)]);
    let sel = s.schedule(&request("c", 100), &scores, t).unwrap();
    assert_eq!(sel.cost, Some(4.0 + 7.0));
}
