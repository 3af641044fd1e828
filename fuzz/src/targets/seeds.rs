//! Seed inputs: valid messages built from the wire types, and the real vLLM / SGLang
//! captures of `kv-events/tests/fixtures/engines` (compiled in; see that folder's
//! README for their origin and licence).

use kv_events::disaggregation::{Disaggregation, DisaggregationReason, PrefillPlacement};
use kv_events::discovery::WorkerRegistration;
use kv_events::events::KvCacheEvent;
use kv_events::ids::{DpRank, ExternalBlockHash, LocalBlockHash, RequestId, WorkerId};
use kv_events::replicas::{
    BookedSequence, HashForm, RouterId, SequenceSync, SequenceSyncBatch, SequenceUpdate,
    SnapshotEntry, SnapshotReply, SnapshotRequest,
};
use kv_events::routing::{
    BatchOrder, CostOverrides, LifecycleEvent, LifecycleMessage, PolicyKind, Prompt,
    RouteBatchReply, RouteBatchRequest, RouteDecision, RouteError, RouteErrorCode, RouteReply,
    RouteRequest,
};
use kv_events::{KvCacheEventData, KvEventBatch, LoadMetrics, StoredBlock, encode};
use serde::Serialize;
use serde_json::{Value, json};

/// The worker every seed speaks for (its subject and key name it too).
pub const WORKER: WorkerId = WorkerId(7);
/// Tokens per block of the seeds and of every target's state.
pub const BLOCK_SIZE: u32 = 16;
/// The request the lifecycle and booking targets find booked.
pub const BOOKED: &str = "r-booked";
/// The id of the replica under test (peers' seeds use others).
pub const OWN_ROUTER: RouterId = RouterId(1);

fn enc<T: Serialize>(values: &[T]) -> Vec<Vec<u8>> {
    values
        .iter()
        // The seed types are plain data: encoding cannot fail.
        .map(|v| encode(v).unwrap_or_default())
        .collect()
}

fn block(h: u64) -> StoredBlock {
    StoredBlock {
        block_hash: ExternalBlockHash(h),
        tokens_hash: LocalBlockHash(h.wrapping_mul(31)),
    }
}

fn event(event_id: u64, dp_rank: u32, data: KvCacheEventData) -> KvCacheEvent {
    KvCacheEvent {
        event_id,
        dp_rank: DpRank(dp_rank),
        data,
    }
}

/// A chain below `parent`, then a removal and a clear, numbered from `first`.
pub fn event_batch(first: u64, dp_rank: u32) -> KvEventBatch {
    KvEventBatch {
        worker_id: WORKER,
        epoch: 1,
        events: vec![
            event(
                first,
                dp_rank,
                KvCacheEventData::Stored {
                    group: None,
                    parent_hash: None,
                    blocks: vec![block(1), block(2), block(3)],
                    tier: kv_events::StorageTier::Gpu,
                },
            ),
            event(
                first + 1,
                dp_rank,
                KvCacheEventData::Stored {
                    group: None,
                    parent_hash: Some(ExternalBlockHash(2)),
                    blocks: vec![block(u64::MAX)],
                    tier: kv_events::StorageTier::Gpu,
                },
            ),
            event(
                first + 2,
                dp_rank,
                KvCacheEventData::Removed {
                    group: None,
                    block_hashes: vec![ExternalBlockHash(3)],
                    tier: kv_events::StorageTier::Gpu,
                },
            ),
        ],
    }
}

pub fn events() -> Vec<Vec<u8>> {
    let mut cleared = event_batch(3, 0);
    cleared.events = vec![event(3, 0, KvCacheEventData::Cleared)];
    enc(&[
        event_batch(0, 0),
        event_batch(0, 3),
        cleared,
        KvEventBatch::new(WORKER, Vec::new()),
    ])
}

pub fn metrics() -> Vec<Vec<u8>> {
    enc(&[
        LoadMetrics {
            worker_id: WORKER,
            dp_rank: DpRank(1),
            active_decode_blocks: 10,
            active_prefill_tokens: 512,
            kv_used_blocks: 25,
            kv_total_blocks: 100,
            num_requests_running: 4,
            num_requests_waiting: 1,
        },
        LoadMetrics {
            worker_id: WORKER,
            ..LoadMetrics::default()
        },
    ])
}

pub fn route_request(id: &str, tokens: u32) -> RouteRequest {
    RouteRequest::new(
        id,
        Prompt::Tokens {
            token_ids: (0..tokens).collect(),
        },
    )
}

fn route_requests() -> Vec<RouteRequest> {
    let mut pinned = route_request("r-pinned", 40);
    pinned.policy = Some(PolicyKind::Kv);
    pinned.dp_rank = Some(DpRank(1));
    pinned.priority = -3;
    pinned.overrides = CostOverrides {
        prefill_load_scale: Some(2.0),
        overlap_credit: Some(1.0),
        load_balance_weight: None,
        temperature: Some(0.5),
    };
    pinned.exclude_workers = vec![WorkerId(8)];
    let mut normalized = RouteRequest::new(
        "r-blocks",
        Prompt::Blocks {
            block_hashes: vec![LocalBlockHash(1), LocalBlockHash(u64::MAX)],
            num_tokens: 20,
        },
    );
    normalized.policy = Some(PolicyKind::KvNormalized);
    normalized.overrides.load_balance_weight = Some(0.1);
    let mut disaggregated = route_request("r-pair", 48);
    disaggregated.allow_disaggregation = true;
    vec![
        route_request("r-tokens", 40),
        pinned,
        normalized,
        disaggregated,
    ]
}

pub fn route() -> Vec<Vec<u8>> {
    enc(&route_requests())
}

pub fn route_batch() -> Vec<Vec<u8>> {
    enc(&[
        RouteBatchRequest {
            requests: route_requests(),
            order: BatchOrder::GroupByPrefix,
        },
        RouteBatchRequest {
            requests: vec![route_request("r-one", 17)],
            order: BatchOrder::AsGiven,
        },
    ])
}

pub fn lifecycle() -> Vec<Vec<u8>> {
    [
        LifecycleEvent::RemotePrefillDone,
        LifecycleEvent::PrefillDone,
        LifecycleEvent::KeepAlive,
        LifecycleEvent::Freed,
    ]
    .into_iter()
    .flat_map(|event| {
        enc(&[LifecycleMessage {
            request_id: RequestId::from(BOOKED),
            event,
        }])
    })
    .collect()
}

fn booked(dp_rank: u32) -> BookedSequence {
    BookedSequence {
        worker_id: WORKER,
        dp_rank: DpRank(dp_rank),
        block_hashes: vec![LocalBlockHash(5), LocalBlockHash(6)],
        request_blocks: 3,
        prefill_tokens: 40,
        expected_prefill_ms: Some(12),
        session_id: None,
    }
}

pub fn bookings() -> Vec<Vec<u8>> {
    let sync = |request: &str, update| SequenceSync {
        router_id: RouterId(2),
        request_id: RequestId::from(request),
        update,
    };
    let singles = [
        sync("r-peer", SequenceUpdate::Booked(booked(1))),
        sync(BOOKED, SequenceUpdate::PrefillDone),
        sync(BOOKED, SequenceUpdate::KeepAlive),
        sync(BOOKED, SequenceUpdate::Freed),
    ];
    // The batch form: a booking and its steps in one message.
    let batch = SequenceSyncBatch {
        router_id: RouterId(2),
        steps: singles
            .iter()
            .cloned()
            .flat_map(|s| SequenceSyncBatch::from(s).steps)
            .collect(),
        queued_at_us: Some(1_700_000_000_000_000),
        accepts_packed: true,
    };
    let mut seeds = enc(&singles);
    seeds.extend(enc(std::slice::from_ref(&batch)));
    // Its bookings' block hashes packed, as for peers that accept them.
    seeds.push(encode(&batch.with_hashes(HashForm::Packed)).expect("a seed encodes"));
    seeds
}

pub fn snapshot_request() -> Vec<Vec<u8>> {
    enc(&[
        SnapshotRequest {
            router_id: RouterId(u64::MAX),
            accepts_packed: false,
        },
        SnapshotRequest {
            router_id: RouterId(1),
            accepts_packed: true,
        },
    ])
}

pub fn snapshot_reply() -> Vec<Vec<u8>> {
    let entry = |id: &str, prefill_done| SnapshotEntry {
        request_id: RequestId::from(id),
        booked: booked(0),
        prefill_done,
    };
    let mut replies =
        SnapshotReply::chunked(RouterId(3), vec![entry("a", false), entry("b", true)], 300);
    replies.push(SnapshotReply {
        router_id: RouterId(4),
        chunk: 0,
        last: true,
        requests: Vec::new(),
        accepts_packed: false,
    });
    enc(&replies)
}

pub fn registration_json() -> Vec<Vec<u8>> {
    let reg = |url: Option<&str>, dp_size| WorkerRegistration {
        worker_id: WORKER,
        dp_size,
        block_size: BLOCK_SIZE,
        total_kv_blocks: 1000,
        url: url.map(str::to_owned),
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    };
    [reg(Some("http://127.0.0.1:8000"), 2), reg(None, 1)]
        .iter()
        // A registration is plain data: it always serializes.
        .map(|r| serde_json::to_vec(r).unwrap_or_default())
        .collect()
}

pub fn route_replies() -> Vec<Vec<u8>> {
    let routed = RouteReply::Routed(RouteDecision {
        request_id: RequestId::from("r"),
        worker_id: WORKER,
        dp_rank: DpRank(1),
        overlap_blocks: 2,
        request_blocks: 3,
        in_flight_blocks: 1,
        kv_position: None,
        policy: PolicyKind::PredictedTtft,
        disaggregation: None,
        fallbacks: Vec::new(),
    });
    // A decode worker paired with a prefill worker, and one that prefills itself.
    let pair = |reason, prefill| {
        RouteReply::Routed(RouteDecision {
            request_id: RequestId::from("r-pair"),
            worker_id: WORKER,
            dp_rank: DpRank(0),
            overlap_blocks: 1,
            request_blocks: 3,
            in_flight_blocks: 0,
            kv_position: None,
            policy: PolicyKind::PredictedTtft,
            disaggregation: Some(Disaggregation { reason, prefill }),
            fallbacks: Vec::new(),
        })
    };
    let remote = PrefillPlacement {
        worker_id: WorkerId(8),
        dp_rank: DpRank(1),
        overlap_blocks: 2,
    };
    let disaggregated = pair(DisaggregationReason::LongUncached, Some(remote));
    let local = pair(DisaggregationReason::ShortUncached, None);
    let error = RouteReply::Error(RouteError {
        code: RouteErrorCode::Overloaded,
        message: "every eligible worker is busy".into(),
    });
    let mut out = enc(&[routed.clone(), disaggregated, local, error.clone()]);
    out.extend(enc(&[RouteBatchReply::Answered {
        replies: vec![routed, error],
    }]));
    out
}

pub fn completion_bodies() -> Vec<Vec<u8>> {
    json_bodies(&[
        json!({"model": "m", "prompt": "hello there", "max_tokens": 8, "stream": false}),
        json!({"model": "m", "prompt": [1, 2, 3], "stream": true,
               "stream_options": {"include_usage": true}}),
        json!({"model": "m", "prompt": [[4, 5, 6]], "temperature": 0.2}),
    ])
}

pub fn chat_bodies() -> Vec<Vec<u8>> {
    json_bodies(&[
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        json!({"model": "m", "stream": true, "add_generation_prompt": false,
               "messages": [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
               "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
               "chat_template_kwargs": {"enable_thinking": false}}),
    ])
}

fn json_bodies(values: &[Value]) -> Vec<Vec<u8>> {
    // Writing a `serde_json::Value` cannot fail.
    values
        .iter()
        .map(|v| serde_json::to_vec(v).unwrap_or_default())
        .collect()
}

const CAPTURES: [&str; 5] = [
    include_str!("../../../kv-events/tests/fixtures/engines/vllm_zmq_frames_topic_kv-events.json"),
    include_str!("../../../kv-events/tests/fixtures/engines/vllm_zmq_frames_topic_empty.json"),
    include_str!("../../../kv-events/tests/fixtures/engines/vllm_0.11.0_payloads.json"),
    include_str!("../../../kv-events/tests/fixtures/engines/vllm_0.23.0_payloads.json"),
    include_str!("../../../kv-events/tests/fixtures/engines/sglang_0.5.23_payloads.json"),
];

fn unhex(s: &str) -> Vec<u8> {
    crate::unhex(s).unwrap_or_else(|| panic!("fixture hex is malformed: {s}"))
}

fn capture_docs() -> Vec<Value> {
    CAPTURES
        .iter()
        .map(|text| serde_json::from_str(text).unwrap_or_else(|e| panic!("fixture: {e}")))
        .collect()
}

/// Every engine payload of the captures (the third frame of a live message).
pub fn engine_payloads() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for doc in capture_docs() {
        let list = doc.get("payloads").or_else(|| doc.get("frames"));
        for p in list.and_then(Value::as_array).into_iter().flatten() {
            if let Some(hex) = p.get("payload_hex").and_then(Value::as_str) {
                out.push(unhex(hex));
            }
        }
    }
    out
}

/// Live and replay multipart messages of the captures, as harness frame sets.
pub fn relay_frames() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for doc in capture_docs() {
        let topic = doc.get("topic").and_then(Value::as_str);
        for f in doc
            .get("frames")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let (Some(topic), Some(seq), Some(payload)) = (
                topic,
                f.get("seq_hex").and_then(Value::as_str),
                f.get("payload_hex").and_then(Value::as_str),
            ) else {
                continue;
            };
            out.push(crate::frames::join(&[
                topic.as_bytes().to_vec(),
                unhex(seq),
                unhex(payload),
            ]));
        }
        let replies = doc.get("replay_reply_frames").and_then(Value::as_array);
        for r in replies.into_iter().flatten() {
            let parts: Vec<Vec<u8>> = r
                .get("frames_hex")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(unhex)
                .collect();
            out.push(crate::frames::join(&parts));
        }
    }
    out
}
