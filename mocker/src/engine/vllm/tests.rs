//! Golden tests: the mock's vLLM payloads and frames against vLLM 0.33's own, as
//! captured in `kv-events/tests/fixtures/engines/` (see that folder's README).

use super::*;
use engine_model::EngineCore;
use engine_model::EngineRequest;
use engine_model::TimingModel;
use engine_model::{CpuTierConfig, EngineModelConfig};
use kv_events::engines::{EngineEvent, EventForm, decode_batch, local_block_hashes};
use kv_events::{DpRank, ExternalBlockHash, StorageTier, compute_block_hashes};
use serde_json::Value;
use std::collections::BTreeSet;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

fn fixture(name: &str) -> Value {
    let path = format!(
        "{}/../kv-events/tests/fixtures/engines/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture exists"))
        .expect("fixture is json")
}

pub(super) fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

pub(super) fn hashes(v: &Value) -> Vec<ExternalBlockHash> {
    v.as_array()
        .expect("hash list")
        .iter()
        .map(|h| ExternalBlockHash(h.as_u64().expect("int hash")))
        .collect()
}

/// A captured event's `token_ids`.
pub(super) fn tokens(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("tokens")
        .iter()
        .map(|t| u32::try_from(t.as_u64().expect("token")).expect("u32"))
        .collect()
}

/// The tier a captured event's `medium` names.
fn tier_of(event: &Value) -> StorageTier {
    kv_events::engines::tier_of_medium(event["medium"].as_str()).expect("known medium")
}

/// The capture's events as [`VllmEvent`]s (batch 3, with bytes hashes and LoRA
/// fields the mock never produces, is `None`).
fn captured_events(decoded: &Value) -> Option<Vec<VllmEvent>> {
    decoded[1]
        .as_array()
        .expect("event list")
        .iter()
        .map(|e| match e["type"].as_str().expect("type") {
            "BlockStored" => {
                if !e["lora_id"].is_null() {
                    return None;
                }
                Some(VllmEvent::BlockStored {
                    block_hashes: hashes(&e["block_hashes"]),
                    parent_block_hash: e["parent_block_hash"].as_u64().map(ExternalBlockHash),
                    token_ids: tokens(&e["token_ids"]),
                    block_size: u32::try_from(e["block_size"].as_u64().expect("size"))
                        .expect("u32"),
                    tier: tier_of(e),
                    group: None,
                })
            }
            "BlockRemoved" => Some(VllmEvent::BlockRemoved {
                block_hashes: hashes(&e["block_hashes"]),
                tier: tier_of(e),
                group: None,
            }),
            "AllBlocksCleared" => Some(VllmEvent::AllBlocksCleared),
            other => panic!("unexpected event type {other}"),
        })
        .collect()
}

#[test]
fn payloads_equal_vllm_0_33_byte_for_byte() {
    let doc = fixture("vllm_zmq_frames_topic_kv-events.json");
    let mut compared = 0;
    for frame in doc["frames"].as_array().expect("frames") {
        let decoded = &frame["payload_generic_decode"];
        let Some(events) = captured_events(decoded) else {
            continue;
        };
        let ts = decoded[0].as_f64().expect("ts");
        let rank = DpRank(u32::try_from(decoded[2].as_u64().expect("rank")).expect("u32"));
        let ours = encode_batch(ts, &events, rank);
        let theirs = unhex(frame["payload_hex"].as_str().expect("hex"));
        assert_eq!(ours, theirs, "batch seq {}", frame["seq_u64_be"]);
        compared += 1;
    }
    // Stored (root and child), Removed and AllBlocksCleared.
    assert_eq!(compared, 4);
}

/// Map keys of every event in a payload, through a generic msgpack decode.
fn event_keys(payload: &[u8]) -> Vec<(String, BTreeSet<String>)> {
    let batch: Value = kv_events::decode(payload).expect("msgpack");
    batch[1]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            let map = e.as_object().expect("tagged map");
            let ty = map["type"].as_str().expect("type").to_owned();
            (ty, map.keys().cloned().collect())
        })
        .collect()
}

/// A mock engine core serving `prompt` with token ids, then evicting it (with a CPU
/// tier of `cpu_tier_blocks`, offloading it, and serving it again from there) and
/// clearing: the payloads it publishes in vLLM mode, one per step that had KV events.
fn mock_payloads(prompt: &[u32], block_size: u32, cpu_tier_blocks: u64) -> Vec<Vec<u8>> {
    let config = EngineModelConfig {
        block_size,
        num_gpu_blocks: 8,
        ..EngineModelConfig::default()
    };
    let mut core = EngineCore::new(config, TimingModel::default())
        .and_then(|c| {
            c.with_cpu_tier(CpuTierConfig {
                cpu_tier_blocks,
                ..CpuTierConfig::default()
            })
        })
        .expect("valid config");
    let request = |id: &str, tokens: &[u32]| EngineRequest {
        request_id: id.into(),
        block_hashes: compute_block_hashes(tokens, block_size),
        prompt_tokens: tokens.len() as u64,
        max_tokens: 2,
        token_ids: Some(tokens.to_vec()),
    };
    core.add_request(request("a", prompt)).expect("fits");
    // A different 7-block prompt then needs the space of `a`'s cached blocks.
    let other: Vec<u32> = (7000..7000 + 7 * block_size).collect();
    core.add_request(request("b", &other)).expect("fits");
    let mut payloads = Vec::new();
    let mut publish =
        |events: &[kv_events::KvCacheEventData],
         tokens: &std::collections::HashMap<ExternalBlockHash, Vec<u32>>| {
            if !events.is_empty() {
                let events = to_vllm(events, tokens, block_size).expect("tokens known");
                payloads.push(encode_batch(1.0, &events, DpRank(0)));
            }
        };
    while core.has_work() {
        let out = core.step();
        publish(&out.kv_events, &out.block_tokens);
    }
    if cpu_tier_blocks > 0 {
        core.add_request(request("a again", prompt)).expect("fits");
        while core.has_work() {
            let out = core.step();
            publish(&out.kv_events, &out.block_tokens);
        }
    }
    publish(&core.clear().expect("idle"), &Default::default());
    payloads
}

#[test]
fn mock_payloads_decode_like_vllms_with_the_same_fields_and_the_routers_hashes() {
    let bs = 16;
    let prompt: Vec<u32> = (1000..1048).collect();
    let payloads = mock_payloads(&prompt, bs, 0);
    let doc = fixture("vllm_zmq_frames_topic_kv-events.json");
    let mut captured_keys = BTreeSet::new();
    for frame in doc["frames"].as_array().expect("frames") {
        let payload = unhex(frame["payload_hex"].as_str().expect("hex"));
        // Batch 3's LoRA fields are not produced by the mock.
        if frame["seq_u64_be"] != 3 {
            captured_keys.extend(event_keys(&payload));
        }
    }
    let mut mock_keys = BTreeSet::new();
    let (mut stored, mut removed, mut cleared) = (Vec::new(), Vec::new(), 0);
    for payload in &payloads {
        mock_keys.extend(event_keys(payload));
        let batch = decode_batch(payload).expect("the relay's decoder reads it");
        assert_eq!(batch.dp_rank, Some(DpRank(0)));
        for event in batch.events {
            assert_eq!(event.form(), EventForm::TaggedMap);
            match event {
                EngineEvent::BlockStored(s, _) => stored.push(s),
                EngineEvent::BlockRemoved(r, _) => removed.extend(r.block_hashes),
                EngineEvent::AllBlocksCleared(_) => cleared += 1,
                EngineEvent::Unknown { type_name, .. } => panic!("unknown {type_name}"),
            }
        }
    }
    assert_eq!(
        mock_keys, captured_keys,
        "same event types with the same keys"
    );
    // Prompt a's three full blocks: stored as one chain from the root, with their
    // tokens, hashing (as the relay hashes them) to the router's block hashes.
    let first = &stored[0];
    assert_eq!(first.parent_block_hash, None);
    assert_eq!(first.block_hashes.len(), 3);
    assert_eq!(first.token_ids, prompt);
    assert_eq!(first.block_size, bs);
    assert_eq!(first.medium.as_deref(), Some("GPU"));
    assert_eq!(
        local_block_hashes(first, bs).expect("whole blocks"),
        compute_block_hashes(&prompt, bs)
    );
    // Prompt b evicted a's blocks (from the chain's end), then the cache was cleared.
    let mut evicted = removed.clone();
    evicted.sort_unstable();
    let mut a_blocks = first.block_hashes.clone();
    a_blocks.sort_unstable();
    assert_eq!(evicted, a_blocks);
    assert_eq!(cleared, 1);
}

#[test]
fn cpu_tier_events_name_their_medium_and_carry_tokens_like_gpu_ones() {
    let bs = 16;
    let prompt: Vec<u32> = (1000..1048).collect();
    let router_hashes = compute_block_hashes(&prompt, bs);
    let mut events = Vec::new();
    for payload in mock_payloads(&prompt, bs, 64) {
        events.extend(decode_batch(&payload).expect("decodes").events);
    }
    let stored: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            EngineEvent::BlockStored(s, _) => Some(s),
            _ => None,
        })
        .collect();
    let mediums: Vec<_> = stored.iter().map(|s| s.medium.as_deref()).collect();
    // b's admission evicts a before b's blocks are computed; a's second admission
    // evicts b's last blocks before loading a back.
    assert_eq!(
        mediums,
        [
            Some("GPU"),
            Some("CPU"),
            Some("GPU"),
            Some("CPU"),
            Some("GPU")
        ],
        "a on the GPU, a offloaded, b computed, b offloaded, a loaded back"
    );
    for s in [stored[1], stored[4]] {
        assert_eq!(s.parent_block_hash, None);
        assert_eq!(s.token_ids, prompt, "the relay hashes the tokens");
        assert_eq!(
            local_block_hashes(s, bs).expect("whole blocks"),
            router_hashes
        );
    }
    let removed: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            EngineEvent::BlockRemoved(r, _) => r.medium.as_deref(),
            _ => None,
        })
        .collect();
    assert_eq!(removed, ["GPU", "GPU"]);
}

fn message(frames: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(frames).expect("frames")
}

#[tokio::test]
async fn sockets_frame_live_batches_and_replays_like_vllm() {
    let shutdown = CancellationToken::new();
    let args = KvEventsArgs {
        zmq_topic: "kv-events".into(),
        zmq_buffer_steps: 2,
        ..KvEventsArgs::vllm_on_free_ports()
    };
    let config = args.rank_config(0, 1, 0).expect("ports");
    let (publisher, endpoints, task) = VllmPublisher::start(DpRank(0), config, shutdown.clone())
        .await
        .expect("binds");
    let mut sub = SubSocket::new();
    sub.connect(&endpoints.publish).await.expect("connects");
    sub.subscribe("").await.expect("subscribes");
    // PUB drops batches until the subscription has arrived (ZMQ's slow joiner):
    // publish until one is received, each a batch of its own seq.
    let payload = |seq: u64| encode_batch(seq as f64, &[VllmEvent::AllBlocksCleared], DpRank(0));
    let mut seq = 0;
    let live = loop {
        publisher.send(payload(seq));
        seq += 1;
        if let Ok(msg) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            break msg.expect("receives").into_vec();
        }
        assert!(seq < 200, "no live batch reached the subscriber");
    };
    assert_eq!(live.len(), 3, "[topic, seq, payload]");
    assert_eq!(&live[0][..], b"kv-events");
    let live_seq = u64::from_be_bytes(live[1][..].try_into().expect("8-byte seq"));
    assert_eq!(live[2][..], payload(live_seq)[..]);
    // Two more, so that the bounded buffer (2 batches) holds only the last two.
    for _ in 0..2 {
        publisher.send(payload(seq));
        seq += 1;
    }
    let last = seq - 1;
    let mut dealer = DealerSocket::new();
    dealer.connect(&endpoints.replay).await.expect("connects");
    let request = vec![Bytes::new(), Bytes::copy_from_slice(&0u64.to_be_bytes())];
    dealer.send(message(request)).await.expect("sends");
    let mut replies = Vec::new();
    loop {
        let reply = dealer.recv().await.expect("replies").into_vec();
        let end = reply.get(2).is_some_and(|s| s[..] == [0xff; 8]);
        replies.push(reply);
        if end {
            break;
        }
    }
    // vLLM 0.33's replay framing, as captured: ["", topic, seq, payload] per batch
    // from the requested seq on (here: what the buffer still holds), then the end.
    let expected: Vec<Vec<Bytes>> = [last - 1, last]
        .into_iter()
        .map(|s| {
            vec![
                Bytes::new(),
                Bytes::from_static(b"kv-events"),
                Bytes::copy_from_slice(&s.to_be_bytes()),
                Bytes::from(payload(s)),
            ]
        })
        .chain(std::iter::once(vec![
            Bytes::new(),
            Bytes::new(),
            Bytes::from_static(&[0xff; 8]),
            Bytes::new(),
        ]))
        .collect();
    assert_eq!(replies, expected);
    let captured_end: Vec<Vec<u8>> =
        fixture("vllm_zmq_frames_topic_kv-events.json")["replay_reply_frames"]
            .as_array()
            .expect("replies")
            .last()
            .expect("end marker")["frames_hex"]
            .as_array()
            .expect("frames")
            .iter()
            .map(|f| unhex(f.as_str().expect("hex")))
            .collect();
    let our_end: Vec<Vec<u8>> = replies
        .last()
        .expect("end")
        .iter()
        .map(|f| f.to_vec())
        .collect();
    assert_eq!(our_end, captured_end);
    shutdown.cancel();
    task.await.expect("publisher stops");
}
