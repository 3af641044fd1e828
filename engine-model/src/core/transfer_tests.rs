//! A disaggregated decode: prompts whose KV arrives over a KV transfer
//! ([`EngineCore::add_transferred_request`], [`EngineCore::transfer_blocks`]).

use super::tests;
use super::*;
use crate::test_support::EventReplica;
use kv_events::StorageTier;

/// A core of 100 blocks of `block_size` tokens.
fn core(block_size: u32) -> EngineCore {
    tests::core(tests::config(block_size, 100, 8, 64))
}

/// [`tests::req`] with token ids, as HTTP requests come.
fn req(id: &str, hashes: &[u64], prompt: u64, max_tokens: u64) -> EngineRequest {
    let ids = (0..u32::try_from(prompt).expect("small")).collect();
    EngineRequest {
        token_ids: Some(ids),
        ..tests::req(id, hashes, prompt, max_tokens)
    }
}

fn stored(events: &[KvCacheEventData]) -> Vec<ExternalBlockHash> {
    events
        .iter()
        .flat_map(|e| match e {
            KvCacheEventData::Stored { blocks, tier, .. } => {
                assert_eq!(*tier, StorageTier::Gpu);
                blocks.iter().map(|b| b.block_hash).collect()
            }
            _ => Vec::new(),
        })
        .collect()
}

/// A transferred prompt computes only its last token, stores every full block it
/// did not cache in that step (with their tokens), then decodes; its first token
/// counts only the rank's own hits as cached.
#[test]
fn a_transferred_prompt_computes_one_token_and_stores_its_blocks() {
    let mut c = core(4);
    let hashes = [1, 2, 3];
    // 11 tokens at block size 4: 2 full blocks and a partial one, all pulled.
    assert_eq!(c.transfer_blocks(&hashes.map(LocalBlockHash), 11), 3);
    c.add_transferred_request(req("d", &hashes, 11, 3))
        .expect("accepted");
    assert_eq!(
        c.load_metrics(WorkerRank::new(
            kv_events::WorkerId(1),
            kv_events::DpRank(0)
        ))
        .active_prefill_tokens,
        1,
        "only the last token is left to compute"
    );
    let first = c.step();
    assert_eq!(first.work.prefill_tokens, 1);
    assert_eq!(first.first_tokens.len(), 1);
    assert_eq!(first.first_tokens[0].cached_tokens, 0, "nothing was local");
    let chain = chain_block_hashes(&[LocalBlockHash(1), LocalBlockHash(2)]);
    let full: Vec<_> = chain.iter().map(|b| b.block_hash).collect();
    assert_eq!(stored(&first.kv_events), full);
    assert_eq!(
        first.block_tokens.len(),
        2,
        "with their tokens, for vLLM events"
    );
    let mut replica = EventReplica::default();
    replica.apply(&first.kv_events);
    let rest: Vec<_> = std::iter::from_fn(|| c.has_work().then(|| c.step())).collect();
    assert_eq!(rest.len(), 2, "then one decode step per token");
    assert!(rest.iter().all(|o| o.work.prefill_tokens == 0));
    // Now cached here: a repeat pulls only the partial block.
    assert_eq!(c.transfer_blocks(&hashes.map(LocalBlockHash), 11), 1);
}

/// A prefix the decode rank already holds is its own hit: only the rest is pulled
/// and stored, and `cached_tokens` says how much was local.
#[test]
fn a_cached_prefix_is_not_pulled_again() {
    let mut c = core(4);
    c.add_request(req("local", &[1, 2], 8, 1))
        .expect("accepted");
    let warm = c.step();
    assert_eq!(stored(&warm.kv_events).len(), 2);
    let hashes = [1, 2, 3, 4].map(LocalBlockHash);
    assert_eq!(c.transfer_blocks(&hashes, 16), 2, "blocks 3 and 4");
    c.add_transferred_request(req("d", &[1, 2, 3, 4], 16, 1))
        .expect("accepted");
    let out = c.step();
    assert_eq!(out.work.prefill_tokens, 1);
    assert_eq!(out.first_tokens[0].cached_tokens, 8);
    let chain = chain_block_hashes(&hashes);
    assert_eq!(
        stored(&out.kv_events),
        vec![chain[2].block_hash, chain[3].block_hash]
    );
    assert_eq!(out.finished.len(), 1);
}

/// The same validation as any request: a transferred request is refused when it
/// could never run.
#[test]
fn a_transferred_request_is_validated_like_any_other() {
    let mut c = core(4);
    assert_eq!(
        c.add_transferred_request(req("e", &[], 0, 1)),
        Err(RejectReason::EmptyPrompt)
    );
    c.add_transferred_request(req("d", &[1], 4, 1))
        .expect("accepted");
    assert!(matches!(
        c.add_transferred_request(req("d", &[1], 4, 1)),
        Err(RejectReason::DuplicateRequestId(_))
    ));
}
