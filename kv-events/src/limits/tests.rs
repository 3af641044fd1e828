//! Unit tests of the limits: each message kind refused by the field it breaks.

use super::*;
use crate::events::{KvCacheEvent, StorageTier, StoredBlock};
use crate::replicas::RouterId;
use crate::{DpRank, ExternalBlockHash, LocalBlockHash, WorkerId, encode};

fn registration(dp_size: u32, total_kv_blocks: u64) -> WorkerRegistration {
    WorkerRegistration {
        worker_id: WorkerId(1),
        dp_size,
        block_size: 16,
        total_kv_blocks,
        url: None,
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    }
}

fn stored(blocks: u64) -> KvCacheEventData {
    KvCacheEventData::Stored {
        group: None,
        parent_hash: None,
        blocks: (0..blocks)
            .map(|i| StoredBlock {
                block_hash: ExternalBlockHash(i),
                tokens_hash: LocalBlockHash(i),
            })
            .collect(),
        tier: StorageTier::Gpu,
    }
}

fn batch(events: Vec<KvCacheEventData>) -> KvEventBatch {
    KvEventBatch {
        worker_id: WorkerId(1),
        epoch: 0,
        events: (0u64..)
            .zip(events)
            .map(|(event_id, data)| KvCacheEvent {
                event_id,
                dp_rank: DpRank(0),
                data,
            })
            .collect(),
    }
}

fn booked(prefill_tokens: u64) -> SequenceSync {
    SequenceSync {
        router_id: RouterId(7),
        request_id: RequestId("r".into()),
        update: SequenceUpdate::Booked(BookedSequence {
            worker_id: WorkerId(1),
            dp_rank: DpRank(0),
            block_hashes: vec![LocalBlockHash(1)],
            request_blocks: 1,
            prefill_tokens,
            expected_prefill_ms: Some(20),
            session_id: None,
        }),
    }
}

fn refused_field<T: WithinLimits>(message: &T, limits: &Limits) -> &'static str {
    message.within(limits).expect_err("over a limit").field
}

#[test]
fn a_registration_over_the_rank_or_capacity_limit_is_refused_by_name() {
    let limits = Limits::default();
    assert_eq!(registration(8, 1 << 20).within(&limits), Ok(()));
    assert_eq!(
        registration(u32::MAX, 100).within(&limits),
        Err(LimitError {
            field: "dp_size",
            value: u64::from(u32::MAX),
            limit: 1024
        })
    );
    assert_eq!(
        refused_field(&registration(1, u64::MAX), &limits),
        "total_kv_blocks"
    );
}

#[test]
fn event_batches_are_bounded_in_events_blocks_and_ranks() {
    let limits = Limits {
        max_batch_events: 3,
        max_batch_blocks: 10,
        max_dp_size: 2,
        ..Limits::default()
    };
    assert_eq!(batch(vec![stored(4), stored(6)]).within(&limits), Ok(()));
    // 11 blocks over two events: the sum counts, not each event.
    assert_eq!(
        refused_field(&batch(vec![stored(5), stored(6)]), &limits),
        "blocks"
    );
    let removed = KvCacheEventData::Removed {
        group: None,
        block_hashes: (0..11).map(ExternalBlockHash).collect(),
        tier: StorageTier::Gpu,
    };
    assert_eq!(refused_field(&batch(vec![removed]), &limits), "blocks");
    let four = vec![KvCacheEventData::Cleared; 4];
    assert_eq!(refused_field(&batch(four), &limits), "events");
    let mut far_rank = batch(vec![stored(1)]);
    far_rank.events[0].dp_rank = DpRank(2);
    assert_eq!(refused_field(&far_rank, &limits), "dp_rank");
}

#[test]
fn route_requests_and_bookings_are_bounded_in_tokens() {
    let limits = Limits {
        max_route_tokens: 100,
        ..Limits::default()
    };
    let tokens = |n: u32| {
        RouteRequest::new(
            "r",
            Prompt::Tokens {
                token_ids: (0..n).collect(),
            },
        )
    };
    assert_eq!(tokens(100).within(&limits), Ok(()));
    assert_eq!(refused_field(&tokens(101), &limits), "token_ids");
    let blocks = RouteRequest::new(
        "r",
        Prompt::Blocks {
            block_hashes: vec![LocalBlockHash(1)],
            num_tokens: u64::MAX,
        },
    );
    assert_eq!(refused_field(&blocks, &limits), "num_tokens");
    let batch = RouteBatchRequest {
        requests: vec![tokens(1), tokens(101)],
        order: crate::routing::BatchOrder::AsGiven,
    };
    assert_eq!(refused_field(&batch, &limits), "token_ids");
    assert_eq!(booked(100).within(&limits), Ok(()));
    assert_eq!(refused_field(&booked(u64::MAX), &limits), "prefill_tokens");
    // A batch is refused by its first step over a limit.
    let sync = SequenceSyncBatch {
        router_id: RouterId(7),
        steps: [booked(100), booked(u64::MAX)]
            .into_iter()
            .flat_map(|b| SequenceSyncBatch::from(b).steps)
            .collect(),
        queued_at_us: None,
        accepts_packed: true,
    };
    assert_eq!(refused_field(&sync, &limits), "prefill_tokens");
    let long_id = RouteRequest::new(
        "x".repeat(MAX_REQUEST_ID_BYTES + 1),
        Prompt::Tokens { token_ids: vec![1] },
    );
    assert_eq!(refused_field(&long_id, &Limits::default()), "request_id");
}

#[test]
fn lifecycle_batches_are_bounded_in_messages_and_id_length() {
    use crate::routing::{LifecycleBatch, LifecycleEvent, LifecycleMessage};
    let freed = |id: String| LifecycleMessage {
        request_id: RequestId(id),
        event: LifecycleEvent::Freed,
    };
    let batch = |n: usize| LifecycleBatch {
        messages: (0..n).map(|i| freed(format!("r{i}"))).collect(),
    };
    let limits = Limits::default();
    assert_eq!(batch(MAX_LIFECYCLE_BATCH).within(&limits), Ok(()));
    assert_eq!(
        refused_field(&batch(MAX_LIFECYCLE_BATCH + 1), &limits),
        "messages"
    );
    let long_id = LifecycleBatch {
        messages: vec![
            freed("a".into()),
            freed("x".repeat(MAX_REQUEST_ID_BYTES + 1)),
        ],
    };
    assert_eq!(refused_field(&long_id, &limits), "request_id");
}

#[test]
fn load_metrics_over_the_capacity_are_refused() {
    let metrics = |kv_used_blocks| LoadMetrics {
        worker_id: WorkerId(1),
        dp_rank: DpRank(0),
        active_decode_blocks: 1,
        active_prefill_tokens: 1,
        kv_used_blocks,
        kv_total_blocks: 100,
        num_requests_running: 1,
        num_requests_waiting: 0,
    };
    let limits = Limits::default();
    assert_eq!(metrics(10).within(&limits), Ok(()));
    assert_eq!(refused_field(&metrics(u64::MAX), &limits), "kv_used_blocks");
}

#[test]
fn a_payload_over_the_byte_limit_is_refused_before_decoding() {
    let limits = Limits {
        max_message_bytes: 256,
        ..Limits::default()
    };
    let big = encode(&batch(vec![stored(100)])).expect("encodes");
    let refusal = decode_within::<KvEventBatch>(&big, &limits).expect_err("too large");
    assert!(
        matches!(refusal, Refusal::TooLarge { bytes, limit: 256 } if bytes == big.len()),
        "{refusal}"
    );
    assert_eq!(refusal.reason(), "too_large");
    // Garbage within the byte limit is malformed, a valid one over a count limit
    // is over_limit, and a valid one within every limit decodes.
    let garbage = decode_within::<KvEventBatch>(&[0xc1], &limits).expect_err("bad");
    assert_eq!(garbage.reason(), "malformed");
    let small = encode(&batch(vec![stored(1)])).expect("encodes");
    let one_block = Limits {
        max_batch_blocks: 0,
        ..limits
    };
    let over = decode_within::<KvEventBatch>(&small, &one_block).expect_err("over");
    assert_eq!(over.reason(), "over_limit");
    assert_eq!(over.to_string(), "blocks is 1, over the limit of 0");
    let ok: KvEventBatch = decode_within(&small, &limits).expect("within limits");
    assert_eq!(ok, batch(vec![stored(1)]));
}
