//! The router's overlap against a real vLLM's own prefix hits, offline: a real vLLM
//! 0.32 capture of a hybrid-attention model (3 sliding-window groups of window 128 and
//! 1 full-attention group, block 32; `kv-events/tests/fixtures/engines/`,
//! `vllm_0.32_hybrid_*`, see its README) replayed through the relay's translator into
//! the index. Before each request's events are applied, the index is asked for the
//! request's prompt exactly as the router asks it (the scheduler's cap included), and
//! overlap × block size must equal the `cached_tokens` the engine reported for that
//! request: after sparse sliding-window stores, for prompts that share only a prefix
//! (the engine reuses nothing: its sliding window before the split point is gone), for
//! exactly block-aligned repeats (duplicate copies of the last block) and after
//! eviction (copies removed one at a time).

// A broken fixture must fail the test loudly.
#![allow(clippy::unwrap_used)]

use indexer::RadixTree;
use integration_tests::capture::{fixture, messages};
use kv_events::{DpRank, KvCacheEvent, WorkerId, WorkerRank, compute_block_hashes};
use kv_relay::EngineFormat;
use kv_relay::translate::{Skip, Translator};
use scheduler::ScheduleRequest;
use serde_json::Value;
use std::collections::BTreeMap;

const BLOCK: u32 = 32;
const WORKER: WorkerId = WorkerId(1);

#[test]
fn the_router_predicts_every_cached_token_count_of_a_real_hybrid_vllm() {
    let fixture: Value =
        serde_json::from_slice(&fixture("vllm_0.32_hybrid_requests.json")).unwrap();
    let prompts: BTreeMap<String, Vec<u32>> =
        serde_json::from_value(fixture["prompts"].clone()).unwrap();
    let mut messages: BTreeMap<u64, _> = messages("vllm_0.32_hybrid_frames.bin")
        .into_iter()
        .collect();
    let mut translator = Translator::new(EngineFormat::Auto);
    translator.learn_block_size(BLOCK);
    let mut tree = RadixTree::new();
    let rank = WorkerRank::new(WORKER, DpRank(0));
    let mut next_event_id = 0;
    let mut table = Vec::new();
    let mut compared = 0;
    for request in fixture["requests"].as_array().unwrap() {
        let label = request["label"].as_str().unwrap();
        let prompt_tokens = request["prompt_tokens"].as_u64().unwrap();
        let cached_tokens = request["cached_tokens"].as_u64().unwrap();
        if let Some(name) = request["prompt"].as_str() {
            let tokens = &prompts[name];
            assert_eq!(tokens.len() as u64, prompt_tokens);
            let hashes = compute_block_hashes(tokens, BLOCK);
            let cap =
                ScheduleRequest::new("q", hashes.clone(), prompt_tokens, BLOCK).reusable_blocks();
            let overlap = tree.find_matches(&hashes).get(rank).min(cap);
            let predicted = u64::from(overlap) * u64::from(BLOCK);
            table.push(format!(
                "{label:<28} prompt {prompt_tokens:>4}  router {predicted:>4}  engine {cached_tokens:>4}"
            ));
            compared += 1;
            assert_eq!(
                predicted,
                cached_tokens,
                "{label}: the router predicts {predicted} cached tokens, the engine had {cached_tokens}\n{}",
                table.join("\n")
            );
        }
        for seq in request["published_seqs"].as_array().unwrap() {
            let seq = seq.as_u64().unwrap();
            let Some(batch) = messages.remove(&seq) else {
                continue; // left out of the excerpt (see the fixture's README)
            };
            let (dp_rank, outcomes) = translator.translate_batch(&batch, DpRank(0));
            for outcome in outcomes {
                let published = match outcome.result {
                    Ok(published) => published,
                    Err(Skip::NoChange) => Vec::new(),
                    Err(skip) => panic!("seq {seq}: refused: {skip}"),
                };
                for data in published {
                    let event = KvCacheEvent {
                        event_id: next_event_id,
                        dp_rank,
                        data,
                    };
                    next_event_id += 1;
                    tree.apply_event(WORKER, &event)
                        .unwrap_or_else(|e| panic!("seq {seq}: {e}"));
                }
            }
        }
    }
    assert_eq!(
        compared, 11,
        "every request with a known prompt is compared"
    );
}
