//! Property tests: the engine decoder never panics, whatever the bytes — random,
//! truncated, mutated real payloads, random msgpack built from engine-like pieces,
//! hostile nesting and length prefixes.

// Test helpers unwrap: a broken fixture must fail the test loudly.
#![allow(clippy::unwrap_used)]

use kv_events::engines::{EngineEvent, decode_batch, local_block_hashes};
use proptest::prelude::*;
use serde_json::{Value, json};

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Every real payload in the fixtures.
fn real_payloads() -> Vec<Vec<u8>> {
    let dir = format!("{}/tests/fixtures/engines", env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for name in [
        "vllm_0.11.0_payloads.json",
        "vllm_0.23.0_payloads.json",
        "sglang_0.5.23_payloads.json",
        "vllm_zmq_frames_topic_kv-events.json",
    ] {
        let doc: Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{dir}/{name}")).unwrap())
                .unwrap();
        let list = doc.get("payloads").or_else(|| doc.get("frames")).unwrap();
        for p in list.as_array().unwrap() {
            out.push(unhex(p["payload_hex"].as_str().unwrap()));
        }
    }
    out
}

/// Decodes and, for stored events, hashes: the full path the relay takes.
fn exercise(bytes: &[u8]) -> bool {
    match decode_batch(bytes) {
        Ok(batch) => {
            for e in &batch.events {
                if let EngineEvent::BlockStored(s, _) = e {
                    let _ = local_block_hashes(s, 16);
                }
            }
            true
        }
        Err(_) => false,
    }
}

#[test]
fn every_strict_prefix_of_a_real_payload_is_an_error() {
    for payload in real_payloads() {
        assert!(exercise(&payload));
        for cut in 0..payload.len() {
            assert!(
                !exercise(&payload[..cut]),
                "a {cut}-byte prefix of a {}-byte payload decoded",
                payload.len()
            );
        }
    }
}

#[test]
fn hostile_nesting_and_lengths_are_errors() {
    // 100k nested one-element arrays: refused by the depth cap, no stack overflow.
    let mut deep = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0];
    deep.extend(std::iter::repeat_n(0x91, 100_000));
    deep.push(0xc0);
    assert!(!exercise(&deep));
    // An array32 / bin32 header claiming 4 G elements with nothing behind it.
    assert!(!exercise(&[0xdd, 0xff, 0xff, 0xff, 0xff]));
    assert!(!exercise(&[
        0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x92, 0xab, b'B', b'l', b'o', b'c', b'k', b'S',
        b't', b'o', b'r', b'e', b'd', 0x91, 0xc6, 0xff, 0xff, 0xff, 0xff
    ]));
}

/// Random JSON-like values whose strings and keys come from the engines' vocabulary,
/// so many of them reach deep into the event decoders.
fn engine_like() -> impl Strategy<Value = Value> {
    let word = prop_oneof![
        Just("BlockStored"),
        Just("BlockRemoved"),
        Just("AllBlocksCleared"),
        Just("type"),
        Just("block_hashes"),
        Just("parent_block_hash"),
        Just("token_ids"),
        Just("block_size"),
        Just("lora_name"),
        Just("extra_keys"),
        Just("medium"),
        Just("GPU"),
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        word.clone().prop_map(Value::from),
    ];
    leaf.prop_recursive(5, 64, 8, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            proptest::collection::vec((word.clone(), inner), 0..8).prop_map(|kv| {
                Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
            }),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        exercise(&bytes);
    }

    #[test]
    fn mutated_real_payloads_never_panic(
        pick in any::<prop::sample::Index>(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let payloads = real_payloads();
        let mut bytes = pick.get(&payloads).clone();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        exercise(&bytes);
    }

    #[test]
    fn random_engine_like_msgpack_never_panics(
        ts in any::<f64>(),
        events in proptest::collection::vec(engine_like(), 0..6),
        rank in engine_like(),
    ) {
        let batch = json!([ts, events, rank]);
        let bytes = rmp_serde::to_vec(&batch).unwrap();
        exercise(&bytes);
        exercise(&bytes[..bytes.len() / 2]);
    }
}
