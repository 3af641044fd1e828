//! Tolerance of the engine decoder: unknown keys, trailing positional fields and
//! unknown event types are skipped, and both batch forms (array, map) decode.

// Test helpers unwrap: a broken encoding must fail the test loudly.
#![allow(clippy::unwrap_used)]
use kv_events::engines::{EngineEvent, EventForm, decode_batch};
use kv_events::{DpRank, ExternalBlockHash};
use serde::Serialize;

/// msgpack of an arbitrary serde value (maps with string keys, arrays, ints).
fn pack<T: Serialize>(value: &T) -> Vec<u8> {
    rmp_serde::to_vec(value).unwrap()
}

#[derive(Serialize)]
struct FutureStored {
    r#type: &'static str,
    future_field: Vec<u8>,
    block_hashes: Vec<i64>,
    parent_block_hash: Option<u64>,
    token_ids: Vec<u32>,
    block_size: u32,
    kv_cache_spec_kind: &'static str,
}

/// vLLM ≤ 0.23 `BlockStored` fields (nil lora_id, medium, lora_name, extra_keys,
/// group_idx, then kv_cache_spec_kind and kv_cache_spec_sliding_window) plus two
/// fields of a later version.
type PositionalStored = (
    &'static str,
    Vec<u64>,
    Option<u64>,
    Vec<u32>,
    u32,
    (),
    (),
    (),
    (),
    (),
    &'static str,
    u32,
    &'static str,
    u8,
);

#[derive(Serialize)]
struct FutureEvent {
    r#type: &'static str,
    anything: (u8, &'static str),
}

#[test]
fn unknown_keys_trailing_fields_and_unknown_types_are_skipped() {
    let stored = FutureStored {
        r#type: "BlockStored",
        future_field: vec![1, 2],
        block_hashes: vec![-5],
        parent_block_hash: None,
        token_ids: vec![1, 2],
        block_size: 2,
        kv_cache_spec_kind: "full_attention",
    };
    let unknown = FutureEvent {
        r#type: "BlockUpdated",
        anything: (1, "x"),
    };
    #[derive(Serialize)]
    #[serde(untagged)]
    enum Any {
        Stored(FutureStored),
        Unknown(FutureEvent),
        Positional(PositionalStored),
    }
    let positional = Any::Positional((
        "BlockStored",
        vec![9],
        Some(8),
        vec![3, 4],
        2,
        (),
        (),
        (),
        (),
        (),
        "sliding_window",
        128,
        "later",
        7,
    ));
    let batch = (
        1.5f64,
        vec![Any::Stored(stored), Any::Unknown(unknown), positional],
        2u32,
        "extra",
    );
    let bytes = rmp_serde::to_vec_named(&batch).unwrap();
    let decoded = decode_batch(&bytes).unwrap();
    assert_eq!(decoded.dp_rank, Some(DpRank(2)));
    let EngineEvent::BlockStored(s, EventForm::TaggedMap) = &decoded.events[0] else {
        panic!("{decoded:?}")
    };
    assert_eq!(s.block_hashes, vec![ExternalBlockHash(-5i64 as u64)]);
    assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
    assert_eq!(s.kv_cache_spec_sliding_window, None);
    assert_eq!(
        decoded.events[1],
        EngineEvent::Unknown {
            type_name: "BlockUpdated".into(),
            form: EventForm::TaggedMap
        }
    );
    let EngineEvent::BlockStored(p, EventForm::PositionalArray) = &decoded.events[2] else {
        panic!("{decoded:?}")
    };
    assert_eq!(p.parent_block_hash, Some(ExternalBlockHash(8)));
    assert_eq!(p.group_idx, None, "nil group");
    assert_eq!(p.kv_cache_spec_kind.as_deref(), Some("sliding_window"));
    assert_eq!(p.kv_cache_spec_sliding_window, Some(128));
    // The map form of a batch is accepted too.
    #[derive(Serialize)]
    struct MapBatch {
        ts: f64,
        events: Vec<()>,
        attn_dp_rank: u32,
    }
    let map = rmp_serde::to_vec_named(&MapBatch {
        ts: 2.0,
        events: vec![],
        attn_dp_rank: 1,
    })
    .unwrap();
    let decoded = decode_batch(&map).unwrap();
    assert_eq!((decoded.ts, decoded.dp_rank), (2.0, Some(DpRank(1))));
    // A struct encoded positionally is the array form of a batch.
    assert_eq!(
        decode_batch(&pack(&(3.0f64, Vec::<()>::new(), ())))
            .unwrap()
            .dp_rank,
        None
    );
}

/// vLLM 0.32's hybrid `BlockStored` map (as in the Gemma 3 capture), and group fields
/// of unexpected types: read as absent, never an error.
#[test]
fn kv_cache_group_fields_decode_and_odd_types_are_absent() {
    #[derive(Serialize)]
    struct Hybrid<K: Serialize, W: Serialize> {
        r#type: &'static str,
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<u64>,
        medium: &'static str,
        lora_name: Option<String>,
        extra_keys: Vec<Option<u8>>,
        group_idx: u32,
        kv_cache_spec_kind: K,
        kv_cache_spec_sliding_window: W,
    }
    fn hybrid<K: Serialize, W: Serialize>(kind: K, window: W) -> Hybrid<K, W> {
        Hybrid {
            r#type: "BlockStored",
            block_hashes: vec![1, 2],
            parent_block_hash: None,
            token_ids: vec![0; 8],
            block_size: 2,
            lora_id: None,
            medium: "GPU",
            lora_name: None,
            extra_keys: vec![None, None],
            group_idx: 2,
            kv_cache_spec_kind: kind,
            kv_cache_spec_sliding_window: window,
        }
    }
    let decode = |bytes: Vec<u8>| {
        let batch = decode_batch(&bytes).unwrap();
        let EngineEvent::BlockStored(s, EventForm::TaggedMap) = &batch.events[0] else {
            panic!("{batch:?}")
        };
        (
            s.group_idx,
            s.kv_cache_spec_kind.clone(),
            s.kv_cache_spec_sliding_window,
        )
    };
    let sliding = hybrid("sliding_window", 128i64);
    assert_eq!(
        decode(rmp_serde::to_vec_named(&(1.0f64, [sliding], 0u32)).unwrap()),
        (Some(2), Some("sliding_window".into()), Some(128))
    );
    let odd = hybrid(vec![1u8], -4i64);
    assert_eq!(
        decode(rmp_serde::to_vec_named(&(1.0f64, [odd], 0u32)).unwrap()),
        (Some(2), None, None)
    );
    let nil = hybrid((), ());
    assert_eq!(
        decode(rmp_serde::to_vec_named(&(1.0f64, [nil], 0u32)).unwrap()),
        (Some(2), None, None)
    );
}
