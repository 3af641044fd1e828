//! Golden tests: real vLLM (0.11, 0.23, 0.33) and SGLang (0.5.23) wire captures decode
//! to the events their fixture files document, and vLLM's own block hashes line up
//! with the hashes in the frames. Fixtures: `tests/fixtures/engines/` (see its README).

// Test helpers unwrap: a broken fixture must fail the test loudly.
#![allow(clippy::unwrap_used)]

use kv_events::engines::{
    BlockRemoved, BlockStored, EngineBatch, EngineEvent, EventForm, ExtraKey, decode_batch,
    external_from_bytes, local_block_hashes,
};
use kv_events::{DpRank, ExternalBlockHash, compute_block_hashes};
use serde_json::Value;

fn fixture(name: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/engines/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// A hash as the fixture's generic decode shows it: a JSON integer (u64 or negative
/// i64) or `{"$bytes_hex": …}`.
fn json_hash(v: &Value) -> ExternalBlockHash {
    if let Some(u) = v.as_u64() {
        ExternalBlockHash(u)
    } else if let Some(i) = v.as_i64() {
        ExternalBlockHash(i as u64)
    } else {
        external_from_bytes(&unhex(v["$bytes_hex"].as_str().unwrap())).unwrap()
    }
}

fn json_opt_str(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_owned)
}

/// Checks one decoded event against the fixture's generic decode of it. Positional
/// events are read with the version's `struct_fields`.
fn check_event(decoded: &EngineEvent, doc: &Value, fields: &Value) {
    let (form, named) = if let Some(arr) = doc.as_array() {
        let ty = arr[0].as_str().unwrap();
        let mut named = serde_json::Map::new();
        named.insert("type".into(), Value::from(ty));
        for (name, value) in fields[ty].as_array().unwrap().iter().zip(&arr[1..]) {
            named.insert(name.as_str().unwrap().to_owned(), value.clone());
        }
        (EventForm::PositionalArray, Value::Object(named))
    } else {
        (EventForm::TaggedMap, doc.clone())
    };
    let ty = named["type"].as_str().unwrap();
    let get = |name: &str| named.get(name);
    assert_eq!(decoded.form(), form, "{doc}");
    let hashes = |v: Option<&Value>| -> Vec<ExternalBlockHash> {
        v.unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(json_hash)
            .collect()
    };
    match (ty, decoded) {
        ("BlockStored", EngineEvent::BlockStored(s, _)) => {
            assert_eq!(s.block_hashes, hashes(get("block_hashes")));
            let parent = get("parent_block_hash").filter(|v| !v.is_null());
            assert_eq!(s.parent_block_hash, parent.map(json_hash));
            let tokens: Vec<u32> = get("token_ids")
                .unwrap()
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(s.token_ids, tokens);
            assert_eq!(
                u64::from(s.block_size),
                get("block_size").unwrap().as_u64().unwrap()
            );
            assert_eq!(s.lora_id, get("lora_id").and_then(Value::as_u64));
            assert_eq!(s.medium, json_opt_str(get("medium")));
            assert_eq!(s.lora_name, json_opt_str(get("lora_name")));
            assert_eq!(s.cache_salt, json_opt_str(get("cache_salt")));
            assert_eq!(
                s.group_idx.map(u64::from),
                get("group_idx").and_then(Value::as_u64)
            );
            assert_eq!(
                s.kv_cache_spec_kind,
                json_opt_str(get("kv_cache_spec_kind"))
            );
            assert_eq!(
                s.kv_cache_spec_sliding_window,
                get("kv_cache_spec_sliding_window").and_then(Value::as_u64)
            );
        }
        ("BlockRemoved", EngineEvent::BlockRemoved(r, _)) => {
            assert_eq!(r.block_hashes, hashes(get("block_hashes")));
            assert_eq!(r.medium, json_opt_str(get("medium")));
            assert_eq!(
                r.group_idx.map(u64::from),
                get("group_idx").and_then(Value::as_u64)
            );
        }
        ("AllBlocksCleared", EngineEvent::AllBlocksCleared(_)) => {}
        (ty, other) => panic!("fixture says {ty}, decoded {other:?}"),
    }
}

fn check_batch(decoded: &EngineBatch, doc: &Value, fields: &Value) {
    let doc = doc.as_array().unwrap();
    assert_eq!(decoded.ts, doc[0].as_f64().unwrap());
    assert_eq!(
        decoded.dp_rank,
        doc[2].as_u64().map(|r| DpRank(r as u32)),
        "dp_rank"
    );
    let events = doc[1].as_array().unwrap();
    assert_eq!(decoded.events.len(), events.len());
    for (e, d) in decoded.events.iter().zip(events) {
        check_event(e, d, fields);
    }
}

/// The field lists of vLLM 0.33's tagged structs (maps carry their own names).
fn no_fields() -> Value {
    Value::Null
}

/// Every payload of a `*_payloads.json` file decodes to its documented events.
fn check_payload_file(name: &str) -> Vec<EngineBatch> {
    let doc = fixture(name);
    let fields = &doc["struct_fields"];
    doc["payloads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let batch = decode_batch(&unhex(p["payload_hex"].as_str().unwrap()))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            check_batch(&batch, &p["payload_generic_decode"], fields);
            batch
        })
        .collect()
}

const A0: u64 = 7_322_446_309_363_477_352;
const A1: u64 = 17_027_874_615_116_373_601;
const A2: u64 = 2_147_986_591_436_168_966;
const B2: u64 = 8_646_635_060_491_323_254;

fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[test]
fn vllm_0_11_positional_arrays_decode() {
    let batches = check_payload_file("vllm_0.11.0_payloads.json");
    assert_eq!(batches.len(), 5);
    let EngineEvent::BlockStored(s, EventForm::PositionalArray) = &batches[0].events[0] else {
        panic!("{:?}", batches[0]);
    };
    assert_eq!(
        &**s,
        &BlockStored {
            block_hashes: vec![
                ExternalBlockHash(A0),
                ExternalBlockHash(A1),
                ExternalBlockHash(A2)
            ],
            parent_block_hash: None,
            token_ids: tokens(1000..1048),
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            ..BlockStored::default()
        }
    );
    assert_eq!(
        batches[2].events[0],
        EngineEvent::BlockRemoved(
            BlockRemoved {
                block_hashes: vec![ExternalBlockHash(A2)],
                medium: Some("GPU".into()),
                group_idx: None
            },
            EventForm::PositionalArray
        )
    );
    assert_eq!(batches[3].dp_rank, Some(DpRank(0)));
    assert_eq!(batches[4].dp_rank, None, "nil dp rank");
}

#[test]
fn vllm_0_23_positional_arrays_with_more_fields_decode() {
    let batches = check_payload_file("vllm_0.23.0_payloads.json");
    let EngineEvent::BlockStored(s, EventForm::PositionalArray) = &batches[1].events[0] else {
        panic!("{:?}", batches[1]);
    };
    assert_eq!(s.block_hashes, vec![ExternalBlockHash(B2)]);
    assert_eq!(s.parent_block_hash, Some(ExternalBlockHash(A1)));
    assert_eq!(s.token_ids, tokens(5000..5016));
    assert_eq!(s.group_idx, Some(0));
    assert_eq!(s.lora_name, None);
    assert!(matches!(
        batches[2].events[0],
        EngineEvent::BlockRemoved(ref r, _) if r.group_idx == Some(0)
    ));
}

#[test]
fn sglang_tagged_maps_with_signed_hashes_decode() {
    let batches = check_payload_file("sglang_0.5.23_payloads.json");
    assert_eq!(batches.len(), 3);
    assert_eq!(batches[0].events.len(), 2);
    let EngineEvent::BlockStored(second, EventForm::TaggedMap) = &batches[0].events[1] else {
        panic!("{:?}", batches[0]);
    };
    // Sent as msgpack int 64 -278502217879090434: its two's complement bits.
    assert_eq!(
        second.block_hashes,
        vec![ExternalBlockHash((-278_502_217_879_090_434_i64) as u64)]
    );
    assert_eq!(
        second.parent_block_hash,
        Some(ExternalBlockHash(5_740_554_423_035_903_369))
    );
    assert_eq!(batches[1].dp_rank, None);
    assert_eq!(batches[2].dp_rank, Some(DpRank(1)));
    assert!(matches!(
        batches[2].events[0],
        EngineEvent::AllBlocksCleared(EventForm::TaggedMap)
    ));
}

/// The five live frames of vLLM 0.33 (`[topic, seq, payload]`) and the replay
/// exchange, for both topic files.
#[test]
fn vllm_0_33_frames_and_replay_replies_decode() {
    for (file, topic) in [
        ("vllm_zmq_frames_topic_kv-events.json", "kv-events"),
        ("vllm_zmq_frames_topic_empty.json", ""),
    ] {
        let doc = fixture(file);
        let frames = doc["frames"].as_array().unwrap();
        assert_eq!(frames.len(), 5);
        let mut by_seq = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            assert_eq!(f["topic_utf8"], topic);
            assert_eq!(
                unhex(f["seq_hex"].as_str().unwrap()),
                (i as u64).to_be_bytes()
            );
            let payload = unhex(f["payload_hex"].as_str().unwrap());
            let batch = decode_batch(&payload).unwrap();
            check_batch(&batch, &f["payload_generic_decode"], &no_fields());
            by_seq.push(payload);
        }
        // Replay of seq ≥ 2: ["", topic, seq, payload] × 3, then ["", "", ff×8, ""].
        let replies = doc["replay_reply_frames"].as_array().unwrap();
        assert_eq!(replies.len(), 4);
        for (k, r) in replies.iter().enumerate() {
            let parts: Vec<Vec<u8>> = r["frames_hex"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| unhex(h.as_str().unwrap()))
                .collect();
            assert_eq!(parts.len(), 4);
            assert!(parts[0].is_empty());
            if k == 3 {
                assert_eq!(parts[2], [0xff; 8], "end marker");
                continue;
            }
            assert_eq!(parts[1], topic.as_bytes());
            assert_eq!(parts[2], (k as u64 + 2).to_be_bytes());
            assert_eq!(
                parts[3],
                by_seq[k + 2],
                "replayed payload equals the live one"
            );
        }
    }
}

#[test]
fn vllm_0_33_lora_batch_has_bytes_hashes_and_its_own_rank() {
    let doc = fixture("vllm_zmq_frames_topic_kv-events.json");
    let payload = unhex(doc["frames"][3]["payload_hex"].as_str().unwrap());
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.dp_rank, Some(DpRank(3)));
    let EngineEvent::BlockStored(s, EventForm::TaggedMap) = &batch.events[0] else {
        panic!("{batch:?}");
    };
    // A 32-byte bin hash maps to the integer vLLM publishes for the same block.
    assert_eq!(s.block_hashes, vec![ExternalBlockHash(A0)]);
    assert_eq!(s.lora_id, Some(7));
    assert_eq!(s.lora_name.as_deref(), Some("my-lora"));
    assert_eq!(s.medium.as_deref(), Some("CPU"));
    assert_eq!(s.group_idx, Some(1));
    assert_eq!(
        s.extra_keys,
        vec![Some(ExtraKey::Array(vec![ExtraKey::Str("my-lora".into())]))]
    );
    // Scoped by the adapter: the same tokens hash differently from the base model.
    let local = local_block_hashes(s, 16).unwrap();
    assert_ne!(local, compute_block_hashes(&tokens(1000..1016), 16));
}

/// vLLM's own block hashes (sha256 and sha256_cbor) for prompts A and B: the bytes →
/// u64 mapping gives `external_u64`, and the sha256 ones are exactly the hashes in
/// the frames, so removals and parents line up.
#[test]
fn vllm_block_hash_fixture_lines_up_with_the_frames() {
    let hashes = fixture("vllm_block_hash_fixtures.json");
    assert_eq!(hashes["block_size"], 16);
    for algo in ["sha256", "sha256_cbor"] {
        for prompt in ["A", "B"] {
            for block in hashes["algos"][algo]["prompts"][prompt]["full_blocks"]
                .as_array()
                .unwrap()
            {
                let bytes = unhex(block["hash_hex"].as_str().unwrap());
                assert_eq!(bytes.len(), 32);
                assert_eq!(
                    external_from_bytes(&bytes).unwrap(),
                    ExternalBlockHash(block["external_u64"].as_u64().unwrap()),
                    "{algo} {prompt}"
                );
            }
        }
    }
    let sha = &hashes["algos"]["sha256"]["prompts"];
    let ext = |p: &str, i: usize| {
        ExternalBlockHash(sha[p]["full_blocks"][i]["external_u64"].as_u64().unwrap())
    };
    let block_tokens = |p: &str, i: usize| -> Vec<u32> {
        sha[p]["full_blocks"][i]["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    let frames = fixture("vllm_zmq_frames_topic_kv-events.json");
    let batch = |i: usize| {
        decode_batch(&unhex(frames["frames"][i]["payload_hex"].as_str().unwrap())).unwrap()
    };
    let stored = |b: &EngineBatch| match &b.events[0] {
        EngineEvent::BlockStored(s, _) => s.clone(),
        other => panic!("{other:?}"),
    };
    let a = stored(&batch(0));
    assert_eq!(a.block_hashes, vec![ext("A", 0), ext("A", 1), ext("A", 2)]);
    let a_tokens: Vec<u32> = (0..3).flat_map(|i| block_tokens("A", i)).collect();
    assert_eq!(a.token_ids, a_tokens);
    // B shares A's first two blocks; its third is stored below A's second.
    assert_eq!(ext("B", 0), ext("A", 0));
    assert_eq!(ext("B", 1), ext("A", 1));
    let b = stored(&batch(1));
    assert_eq!(b.block_hashes, vec![ext("B", 2)]);
    assert_eq!(b.parent_block_hash, Some(ext("B", 1)));
    assert_eq!(b.token_ids, block_tokens("B", 2));
    let EngineEvent::BlockRemoved(r, _) = &batch(2).events[0] else {
        panic!()
    };
    assert_eq!(r.block_hashes, vec![ext("A", 2)]);
    // The bytes-hash batch names A's first block by its full 32-byte hash.
    assert_eq!(stored(&batch(3)).block_hashes, vec![ext("A", 0)]);
    // Our local hashes of the frames' tokens equal plain token hashing of the prompt.
    assert_eq!(
        local_block_hashes(&a, 16).unwrap(),
        compute_block_hashes(&a_tokens, 16)
    );
}
