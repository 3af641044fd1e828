use super::*;
use crate::config::CpuTierConfig;
use crate::kv_cache::chain_block_hashes;
use crate::test_support::{EventReplica, sorted};
use kv_events::{DpRank, LocalBlockHash, WorkerId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub(super) fn config(block_size: u32, blocks: u64, seqs: u32, budget: u64) -> EngineModelConfig {
    EngineModelConfig {
        block_size,
        num_gpu_blocks: blocks,
        max_num_seqs: seqs,
        max_num_batched_tokens: budget,
    }
}

pub(super) fn core(cfg: EngineModelConfig) -> EngineCore {
    EngineCore::new(cfg, TimingModel::default()).expect("valid config")
}

pub(super) fn req(id: &str, hashes: &[u64], prompt: u64, max_tokens: u64) -> EngineRequest {
    EngineRequest {
        request_id: id.into(),
        block_hashes: hashes.iter().map(|&h| LocalBlockHash(h)).collect(),
        prompt_tokens: prompt,
        max_tokens,
        token_ids: None,
    }
}

/// Steps until idle, returning every step's output.
fn run_to_idle(core: &mut EngineCore) -> Vec<StepOutput> {
    let mut outs = Vec::new();
    while core.has_work() {
        outs.push(core.step());
        assert!(outs.len() < 100_000, "no progress");
    }
    outs
}

fn first_token_of<'a>(outs: &'a [StepOutput], id: &str) -> (usize, &'a FirstToken) {
    outs.iter()
        .enumerate()
        .find_map(|(i, o)| {
            o.first_tokens
                .iter()
                .find(|f| f.request_id.0 == id)
                .map(|f| (i, f))
        })
        .expect("first token emitted")
}

fn finish_step(outs: &[StepOutput], id: &str) -> usize {
    outs.iter()
        .position(|o| o.finished.iter().any(|f| f.request_id.0 == id))
        .expect("finished")
}

#[test]
fn a_request_prefills_then_decodes_one_token_per_step() {
    let mut c = core(config(4, 100, 8, 64));
    c.add_request(req("a", &[1, 2, 3], 10, 3))
        .expect("accepted");
    let outs = run_to_idle(&mut c);
    assert_eq!(
        outs.len(),
        3,
        "1 prefill step (with first token) + 2 decode steps"
    );
    assert_eq!(outs[0].work.prefill_tokens, 10);
    assert_eq!(outs[0].work.decode_seqs, 0);
    assert_eq!(
        outs[0].first_tokens,
        vec![FirstToken {
            request_id: "a".into(),
            cached_tokens: 0,
            loaded_tokens: 0,
            prompt_tokens: 10
        }]
    );
    assert_eq!(outs[1].work.decode_seqs, 1);
    assert_eq!(outs[1].work.decode_context_tokens, 11);
    assert_eq!(
        outs[2].finished,
        vec![Finished {
            request_id: "a".into(),
            output_tokens: 3
        }]
    );
    let timing = TimingModel::default();
    for o in &outs {
        assert_eq!(o.duration_ms, timing.step_duration_ms(&o.work));
    }
    // Only the 2 full prompt blocks (of 10 tokens at block size 4) are announced.
    match &outs[0].kv_events[..] {
        [
            KvCacheEventData::Stored {
                parent_hash: None,
                blocks,
                ..
            },
        ] => assert_eq!(blocks.len(), 2),
        other => panic!("unexpected events {other:?}"),
    }
}

#[test]
fn max_tokens_one_finishes_in_the_prefill_step() {
    let mut c = core(config(4, 100, 8, 64));
    c.add_request(req("a", &[1], 4, 1)).expect("accepted");
    let out = c.step();
    assert_eq!(out.first_tokens.len(), 1);
    assert_eq!(out.finished.len(), 1);
    assert!(!c.has_work());
}

#[test]
fn second_request_with_shared_prefix_hits_the_cache() {
    let mut c = core(config(4, 100, 8, 64));
    c.add_request(req("a", &[1, 2, 3], 12, 2))
        .expect("accepted");
    let first = run_to_idle(&mut c);
    let stored_a = first[0].kv_events.clone();
    c.add_request(req("b", &[1, 2, 9, 10], 14, 2))
        .expect("accepted");
    let second = run_to_idle(&mut c);
    let (_, ft) = first_token_of(&second, "b");
    assert_eq!(ft.cached_tokens, 8, "two shared blocks of 4 tokens");
    assert_eq!(second[0].work.prefill_tokens, 14 - 8);
    // Stored only for the one new full block (block 3 of 14 tokens; the 4th is partial).
    let a_chain = chain_block_hashes(&[LocalBlockHash(1), LocalBlockHash(2)]);
    let b_chain = chain_block_hashes(&[1, 2, 9].map(LocalBlockHash));
    assert_eq!(
        second[0].kv_events,
        vec![KvCacheEventData::Stored {
            group: None,
            parent_hash: Some(a_chain[1].block_hash),
            blocks: vec![b_chain[2]],
            tier: kv_events::StorageTier::Gpu
        }]
    );
    assert_eq!(stored_a.len(), 1);
}

#[test]
fn a_block_aligned_fully_cached_prompt_recomputes_its_last_block() {
    // vLLM caps the hit at (len − 1) / block_size blocks: an aligned prompt of two
    // cached blocks hits one, computes the second again and reports 4 cached tokens.
    let mut c = core(config(4, 100, 8, 64));
    c.add_request(req("a", &[1, 2], 8, 1)).expect("accepted");
    run_to_idle(&mut c);
    c.add_request(req("b", &[1, 2], 8, 1)).expect("accepted");
    let waiting = c.load_metrics(WorkerRank::new(WorkerId(1), DpRank(0)));
    assert_eq!(
        waiting.active_prefill_tokens, 4,
        "the last block is to compute"
    );
    let out = c.step();
    assert_eq!(out.work.prefill_tokens, 4);
    assert_eq!(out.first_tokens[0].cached_tokens, 4);
    assert!(
        out.kv_events.is_empty(),
        "the recomputed block is already cached"
    );
    run_to_idle(&mut c);
    assert_eq!(c.cache().dense().expect("dense").cached_blocks(), 2);
}

#[test]
fn an_unaligned_fully_cached_prompt_hits_every_full_block() {
    // 9 tokens: both full blocks fit under the cap (8 / 4 = 2); the partial block's
    // one token is computed.
    let mut c = core(config(4, 100, 8, 64));
    c.add_request(req("a", &[1, 2], 9, 1)).expect("accepted");
    run_to_idle(&mut c);
    c.add_request(req("b", &[1, 2], 9, 1)).expect("accepted");
    let out = c.step();
    assert_eq!(out.work.prefill_tokens, 1);
    assert_eq!(out.first_tokens[0].cached_tokens, 8);
}

#[test]
fn chunked_prefill_takes_ceil_prompt_over_budget_steps() {
    let mut c = core(config(16, 1_000, 8, 100));
    c.add_request(req("long", &[], 950, 1)).expect("accepted");
    let outs = run_to_idle(&mut c);
    assert_eq!(outs.len(), 10, "ceil(950 / 100) steps");
    assert!(outs[..9].iter().all(|o| o.work.prefill_tokens == 100));
    assert_eq!(outs[9].work.prefill_tokens, 50);
    assert_eq!(first_token_of(&outs, "long").0, 9);
}

#[test]
fn decodes_share_the_step_budget_with_prefill_chunks() {
    let mut c = core(config(16, 1_000, 8, 100));
    c.add_request(req("short", &[], 10, 50)).expect("accepted");
    c.step(); // prefill of `short`, which now decodes
    c.add_request(req("long", &[], 495, 1)).expect("accepted");
    let outs = run_to_idle(&mut c);
    // Each step: 1 decode token + 99 prefill tokens until the prompt is done.
    assert!(outs[..5].iter().all(|o| o.work.decode_seqs == 1));
    assert!(outs[..5].iter().all(|o| o.work.prefill_tokens == 99));
    assert_eq!(
        first_token_of(&outs, "long").0,
        4,
        "ceil(495 / 99) = 5 steps"
    );
    assert!(
        outs.iter()
            .all(|o| o.work.prefill_tokens + o.work.decode_seqs <= 100)
    );
}

#[test]
fn max_num_seqs_caps_the_running_batch() {
    let mut c = core(config(4, 1_000, 2, 64));
    for i in 0..5 {
        c.add_request(req(&format!("r{i}"), &[], 4, 3))
            .expect("accepted");
    }
    let outs = run_to_idle(&mut c);
    assert_eq!(outs[0].first_tokens.len(), 2);
    assert!(
        outs.iter()
            .all(|o| o.work.decode_seqs + o.first_tokens.len() as u64 <= 2)
    );
    // FCFS: r2 starts only after r0 and r1 finish.
    assert!(first_token_of(&outs, "r2").0 > finish_step(&outs, "r0"));
    let m = {
        let mut c = core(config(4, 1_000, 2, 64));
        for i in 0..5 {
            c.add_request(req(&format!("r{i}"), &[], 4, 3))
                .expect("accepted");
        }
        c.step();
        c.load_metrics(WorkerRank::new(WorkerId(1), DpRank(0)))
    };
    assert_eq!(m.num_requests_running, 2);
    assert_eq!(m.num_requests_waiting, 3);
    assert_eq!(m.active_prefill_tokens, 3 * 4);
    assert_eq!(
        m.active_decode_blocks,
        2 * 2,
        "ceil((4 + 3) / 4) blocks each"
    );
    assert_eq!(m.kv_used_blocks, 4);
    assert_eq!(m.kv_total_blocks, 1_000);
}

#[test]
fn a_request_waits_for_kv_space_then_runs() {
    // 10 blocks; each request needs ceil((16 + 8) / 4) = 6.
    let mut c = core(config(4, 10, 8, 64));
    c.add_request(req("a", &[1, 2, 3, 4], 16, 8))
        .expect("accepted");
    c.add_request(req("b", &[5, 6, 7, 8], 16, 8))
        .expect("accepted");
    let outs = run_to_idle(&mut c);
    assert_eq!(outs[0].first_tokens.len(), 1, "b does not fit next to a");
    assert!(first_token_of(&outs, "b").0 > finish_step(&outs, "a"));
}

#[test]
fn invalid_and_oversized_requests_are_rejected() {
    let mut c = core(config(4, 10, 8, 64));
    assert_eq!(
        c.add_request(req("big", &[], 40, 1)),
        Err(RejectReason::ExceedsCapacity {
            needed: 11,
            capacity: 10
        })
    );
    assert_eq!(
        c.add_request(req("e", &[], 0, 1)),
        Err(RejectReason::EmptyPrompt)
    );
    assert_eq!(
        c.add_request(req("z", &[], 4, 0)),
        Err(RejectReason::ZeroMaxTokens)
    );
    assert!(matches!(
        c.add_request(req("h", &[1, 2, 3], 8, 1)),
        Err(RejectReason::TooManyBlockHashes { hashes: 3, max: 2 })
    ));
    assert!(!c.has_work(), "rejections leave the core idle");
    c.add_request(req("ok", &[], 4, 1)).expect("accepted");
    assert_eq!(
        c.add_request(req("ok", &[], 4, 1)),
        Err(RejectReason::DuplicateRequestId("ok".into()))
    );
}

#[test]
fn clear_is_refused_while_busy_and_empties_an_idle_cache() {
    let mut c = core(config(4, 100, 8, 64));
    c.add_request(req("a", &[1, 2], 8, 2)).expect("accepted");
    assert_eq!(c.clear(), Err(ClearError::Busy { active_requests: 1 }));
    run_to_idle(&mut c);
    assert_eq!(c.cache().cached_blocks(), 2);
    assert_eq!(c.clear(), Ok(vec![KvCacheEventData::Cleared]));
    assert_eq!(c.cache().used_blocks(), 0);
    c.add_request(req("b", &[1, 2], 8, 1)).expect("accepted");
    assert_eq!(
        c.step().first_tokens[0].cached_tokens,
        0,
        "cold after clear"
    );
}

#[test]
fn event_stream_replayed_into_a_set_matches_the_cache() {
    let mut rng = StdRng::seed_from_u64(42);
    let mut c = core(config(4, 60, 6, 32));
    let mut replica = EventReplica::default();
    let mut next_id = 0u64;
    let (mut removed, mut hits) = (0, 0);
    for round in 0..3_000 {
        if rng.random_bool(0.4) {
            let blocks = rng.random_range(1..8u64);
            let prompt = blocks * 4 - rng.random_range(0..4);
            // A few shared roots so prefixes overlap and eviction churns.
            let hashes: Vec<u64> = (0..prompt.div_ceil(4))
                .map(|i| {
                    if i < 2 {
                        rng.random_range(0..3)
                    } else {
                        rng.random_range(0..1_000)
                    }
                })
                .collect();
            let _ = c.add_request(req(
                &format!("r{next_id}"),
                &hashes,
                prompt,
                rng.random_range(1..6),
            ));
            next_id += 1;
        }
        if round % 500 == 499 {
            while c.has_work() {
                replica.apply(&c.step().kv_events);
            }
            replica.apply(&c.clear().expect("idle"));
        }
        let out = c.step();
        removed += out
            .kv_events
            .iter()
            .filter(|e| matches!(e, KvCacheEventData::Removed { .. }))
            .count();
        hits += out
            .first_tokens
            .iter()
            .filter(|f| f.cached_tokens > 0)
            .count();
        replica.apply(&out.kv_events);
        assert_eq!(replica.sorted(), sorted(c.cache().cached_hashes()));
        assert!(c.cache().used_blocks() <= c.cache().capacity());
    }
    assert!(next_id > 1_000);
    assert!(
        removed > 10 && hits > 10,
        "workload must exercise eviction ({removed}) and reuse ({hits})"
    );
}

#[test]
fn the_core_is_deterministic() {
    let run = || {
        let mut c = core(config(4, 30, 4, 16));
        for i in 0..20u64 {
            let _ = c.add_request(req(&format!("r{i}"), &[i % 3, i % 5], 9, 1 + i % 4));
        }
        run_to_idle(&mut c)
    };
    assert_eq!(run(), run());
}

#[test]
fn abort_frees_a_running_requests_space_and_drops_a_waiting_one() {
    // 4 blocks of 4 tokens: "a" (8 prompt + 8 out = 4 blocks) fills the cache, so "b"
    // waits behind it.
    let mut c = core(config(4, 4, 4, 64));
    c.add_request(req("a", &[1, 2], 8, 8)).unwrap();
    c.add_request(req("b", &[3], 4, 4)).unwrap();
    let out = c.step();
    assert_eq!(out.first_tokens.len(), 1);
    assert_eq!(c.running_requests(), 1);
    assert_eq!(c.waiting_requests(), 1);
    assert_eq!(c.output_progress().collect::<Vec<_>>(), [(&"a".into(), 1)]);
    assert_eq!(c.cache().used_blocks(), 4);
    assert!(c.abort(&"b".into()));
    assert!(c.abort(&"a".into()));
    assert!(!c.abort(&"a".into()), "already gone");
    assert!(!c.has_work());
    // The prompt blocks stay cached for reuse but nothing references them.
    assert_eq!(c.cache().used_blocks() - c.cache().evictable_blocks(), 0);
    assert_eq!(c.cache().cached_blocks(), 2);
    // The id is free again.
    c.add_request(req("a", &[1, 2], 8, 1)).unwrap();
    let out = c.step();
    // Block 1 is a hit; block 2, the aligned prompt's last, is computed again.
    assert_eq!(out.first_tokens[0].cached_tokens, 4);
}

fn tiered(cfg: EngineModelConfig, cpu_tier_blocks: u64, load_ms: f64) -> EngineCore {
    core(cfg)
        .with_cpu_tier(CpuTierConfig {
            cpu_tier_blocks,
            cpu_tier_load_ms_per_token: load_ms,
        })
        .expect("valid tier")
}

#[test]
fn a_prefix_in_the_cpu_tier_is_loaded_back_for_its_load_time_not_prefilled() {
    // 4 GPU blocks: b's 4-block footprint evicts a's 3 cached blocks to the CPU.
    let mut c = tiered(config(4, 4, 8, 64), 16, 0.5);
    c.add_request(req("a", &[1, 2, 3], 13, 1))
        .expect("accepted");
    c.add_request(req("b", &[7, 8, 9], 13, 1))
        .expect("accepted");
    run_to_idle(&mut c);
    assert_eq!(c.cache().cpu_blocks(), 3);
    c.add_request(req("a2", &[1, 2, 3], 13, 1))
        .expect("accepted");
    let outs = run_to_idle(&mut c);
    let (step, ft) = first_token_of(&outs, "a2");
    assert_eq!((ft.cached_tokens, ft.loaded_tokens), (12, 12));
    let out = &outs[step];
    assert_eq!(
        out.work.prefill_tokens, 1,
        "only the partial block is computed"
    );
    assert_eq!(out.loaded_tokens, 12);
    let compute = TimingModel::default().step_duration_ms(&out.work);
    assert!((out.duration_ms - (compute + 0.5 * 12.0)).abs() < 1e-9);
    assert!(out.kv_events.iter().any(|e| matches!(
        e,
        KvCacheEventData::Stored { group: _, tier: kv_events::StorageTier::Gpu, blocks, parent_hash: None }
            if blocks.len() == 3
    )));
}

#[test]
fn a_zero_block_cpu_tier_changes_nothing() {
    let run = |mut c: EngineCore| {
        let mut rng = StdRng::seed_from_u64(3);
        let mut outs = Vec::new();
        for i in 0..200 {
            let hashes: Vec<u64> = (0..rng.random_range(1..6))
                .map(|_| rng.random_range(0..4))
                .collect();
            let prompt = hashes.len() as u64 * 4 + 1;
            c.add_request(req(&i.to_string(), &hashes, prompt, 2))
                .expect("accepted");
            outs.push(c.step());
        }
        outs.extend(run_to_idle(&mut c));
        outs
    };
    let plain = run(core(config(4, 12, 4, 64)));
    assert!(
        plain.iter().any(|o| o
            .kv_events
            .iter()
            .any(|e| matches!(e, KvCacheEventData::Removed { .. }))),
        "the workload must evict"
    );
    assert_eq!(plain, run(tiered(config(4, 12, 4, 64), 0, 1.0)));
}
