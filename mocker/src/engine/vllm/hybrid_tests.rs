//! A hybrid-attention mock against a real vLLM 0.32 with its hybrid KV cache manager
//! (a tiny Gemma 3: 3 sliding-window groups of window 128 and one full group, block
//! 32; `testdata/vllm_0.32_hybrid_batches.json`): the encoding byte for byte, and the
//! mock's own batches for the capture's requests in the same shape (groups, sparse
//! and empty stores, parents, token ranges, one removal per event).

use super::tests::{hashes, tokens, unhex};
use super::*;
use engine_model::{
    EngineCore, EngineModelConfig, EngineRequest, HybridConfig, StepOutput, TimingModel,
};
use kv_events::engines::decode_batch;
use kv_events::{DpRank, ExternalBlockHash, StorageTier, compute_block_hashes};
use serde_json::Value;
use std::collections::BTreeSet;

fn capture() -> Vec<(u64, Vec<u8>)> {
    let path = format!(
        "{}/src/engine/vllm/testdata/vllm_0.32_hybrid_batches.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("fixture"))
        .expect("fixture is json");
    doc["batches"]
        .as_array()
        .expect("batches")
        .iter()
        .map(|b| {
            let bytes = unhex(b["payload_hex"].as_str().expect("hex"));
            (b["seq"].as_u64().expect("seq"), bytes)
        })
        .collect()
}

fn decode(payload: &[u8]) -> Value {
    kv_events::decode(payload).expect("msgpack")
}

/// A captured event as a [`VllmEvent`].
fn event(e: &Value) -> VllmEvent {
    let idx = u32::try_from(e["group_idx"].as_u64().expect("group")).expect("u32");
    match e["type"].as_str().expect("type") {
        "BlockStored" => VllmEvent::BlockStored {
            block_hashes: hashes(&e["block_hashes"]),
            parent_block_hash: e["parent_block_hash"].as_u64().map(ExternalBlockHash),
            token_ids: tokens(&e["token_ids"]),
            block_size: u32::try_from(e["block_size"].as_u64().expect("size")).expect("u32"),
            tier: StorageTier::Gpu,
            group: Some(VllmGroup {
                idx,
                sliding_window: e["kv_cache_spec_sliding_window"]
                    .as_u64()
                    .map(|w| u32::try_from(w).expect("u32")),
            }),
        },
        "BlockRemoved" => VllmEvent::BlockRemoved {
            block_hashes: hashes(&e["block_hashes"]),
            tier: StorageTier::Gpu,
            group: Some(idx),
        },
        other => panic!("unexpected {other}"),
    }
}

#[test]
fn hybrid_payloads_equal_vllm_0_32_byte_for_byte() {
    for (seq, theirs) in capture() {
        let batch = decode(&theirs);
        let events: Vec<VllmEvent> = batch[1]
            .as_array()
            .expect("events")
            .iter()
            .map(event)
            .collect();
        let ts = batch[0].as_f64().expect("ts");
        let ours = encode_batch(ts, &events, DpRank(0));
        assert_eq!(ours, theirs, "batch seq {seq}");
    }
}

/// Per event: (type, group_idx, kind, window, hashes, parent is set, token count,
/// has extra_keys).
type Shape = (
    String,
    u64,
    Option<String>,
    Option<u64>,
    usize,
    bool,
    usize,
    bool,
);

fn shapes(payload: &[u8]) -> Vec<Shape> {
    decode(payload)[1]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            (
                e["type"].as_str().expect("type").to_owned(),
                e["group_idx"].as_u64().expect("group"),
                e["kv_cache_spec_kind"].as_str().map(str::to_owned),
                e["kv_cache_spec_sliding_window"].as_u64(),
                e["block_hashes"].as_array().map_or(0, Vec::len),
                !e["parent_block_hash"].is_null(),
                e["token_ids"].as_array().map_or(0, Vec::len),
                e.get("extra_keys").is_some(),
            )
        })
        .collect()
}

/// The payload each step of `core` publishes, one per step with events.
fn run(core: &mut EngineCore, id: &str, tokens: &[u32]) -> Vec<Vec<u8>> {
    core.add_request(EngineRequest {
        request_id: id.into(),
        block_hashes: compute_block_hashes(tokens, 32),
        prompt_tokens: tokens.len() as u64,
        max_tokens: 1,
        token_ids: Some(tokens.to_vec()),
    })
    .expect("accepted");
    let mut payloads = Vec::new();
    while core.has_work() {
        let out: StepOutput = core.step();
        if out.kv_events.is_empty() {
            continue;
        }
        let events = to_vllm_hybrid(
            &out.kv_events,
            &out.group_stores,
            &out.block_tokens,
            32,
            128,
        )
        .expect("tokens known");
        payloads.push(encode_batch(1.0, &events, DpRank(0)));
    }
    payloads
}

#[test]
fn a_hybrid_mock_publishes_the_captures_requests_in_vllms_shape() {
    let config = EngineModelConfig {
        block_size: 32,
        num_gpu_blocks: 136,
        max_num_seqs: 8,
        max_num_batched_tokens: 8192,
    };
    let mut core = EngineCore::new(config, TimingModel::default())
        .and_then(|c| c.with_hybrid(HybridConfig::sliding(3, 128)))
        .expect("valid");
    let fresh = |from: u32, n: u32| (from..from + n).collect::<Vec<u32>>();
    let a = fresh(100, 357);
    let b: Vec<u32> = a[..256].iter().copied().chain(fresh(3000, 121)).collect();
    let c = fresh(5000, 320);
    let d: Vec<u32> = a[..300].iter().copied().chain(fresh(9000, 70)).collect();
    let e0 = fresh(20_000, 900);
    let ours = [
        run(&mut core, "A", &a),
        run(&mut core, "B", &b),
        run(&mut core, "C", &c),
        run(&mut core, "C repeat", &c),
        run(&mut core, "D", &d),
        run(&mut core, "E0", &e0),
    ];
    let theirs: Vec<Vec<Shape>> = capture().iter().map(|(_, p)| shapes(p)).collect();
    // A (seq 0), C repeat (seq 3: empty sliding stores) and D (seq 5) have exactly
    // the capture's shape.
    assert_eq!(shapes(&ours[0][0]), theirs[0], "A");
    assert_eq!(shapes(&ours[3][0]), theirs[1], "C repeat");
    assert_eq!(shapes(&ours[4][0]), theirs[2], "D");
    // E0 evicts (the mock's pool differs in detail): one hash per removal, every
    // removal before the stores, then the capture's four stores.
    let e = shapes(&ours[5][0]);
    let stores = e.iter().position(|s| s.0 == "BlockStored").expect("stores");
    assert!(stores > 0, "E0 evicted");
    assert!(
        e[..stores]
            .iter()
            .all(|s| s.0 == "BlockRemoved" && s.4 == 1)
    );
    let their_e = &theirs[3];
    let their_stores = their_e
        .iter()
        .position(|s| s.0 == "BlockStored")
        .expect("stores");
    assert_eq!(e[stores..], their_e[their_stores..]);
    // Every key set the capture has, the mock has, and nothing else.
    let keys = |p: &[u8]| -> BTreeSet<Vec<String>> {
        decode(p)[1]
            .as_array()
            .expect("events")
            .iter()
            .map(|e| e.as_object().expect("map").keys().cloned().collect())
            .collect()
    };
    let mut mine = BTreeSet::new();
    for payload in ours.iter().flatten() {
        mine.extend(keys(payload));
        // The relay's decoder reads every batch.
        decode_batch(payload).expect("the relay decodes it");
    }
    let captured: BTreeSet<_> = capture().iter().flat_map(|(_, p)| keys(p)).collect();
    assert_eq!(mine, captured);
}
