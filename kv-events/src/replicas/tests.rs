use super::*;
use crate::codec::{decode, encode};
use crate::routing::MAX_SESSION_ID_BYTES;

#[test]
fn sync_messages_round_trip() {
    let booked = SequenceSync {
        router_id: RouterId(u64::MAX),
        request_id: "r1".into(),
        update: SequenceUpdate::Booked(BookedSequence {
            worker_id: WorkerId(4),
            dp_rank: DpRank(1),
            block_hashes: vec![LocalBlockHash(9), LocalBlockHash(u64::MAX)],
            request_blocks: 3,
            prefill_tokens: 130,
            expected_prefill_ms: Some(25),
            session_id: None,
        }),
    };
    assert_eq!(
        decode::<SequenceSync>(&encode(&booked).unwrap()).unwrap(),
        booked
    );
    for update in [
        SequenceUpdate::PrefillDone,
        SequenceUpdate::KeepAlive,
        SequenceUpdate::Freed,
    ] {
        let msg = SequenceSync {
            router_id: RouterId(1),
            request_id: "r1".into(),
            update,
        };
        assert_eq!(decode::<SequenceSync>(&encode(&msg).unwrap()).unwrap(), msg);
    }
}

#[test]
fn update_is_tagged_and_expected_duration_is_optional() {
    #[derive(Serialize)]
    struct Booked {
        r#type: &'static str,
        worker_id: u64,
        dp_rank: u32,
        block_hashes: Vec<u64>,
        request_blocks: u32,
        prefill_tokens: u64,
    }
    let bytes = encode(&Booked {
        r#type: "booked",
        worker_id: 2,
        dp_rank: 0,
        block_hashes: vec![],
        request_blocks: 1,
        prefill_tokens: 10,
    })
    .unwrap();
    match decode::<SequenceUpdate>(&bytes).unwrap() {
        SequenceUpdate::Booked(b) => assert_eq!(b.expected_prefill_ms, None),
        other => panic!("decoded as {other:?}"),
    }
    assert_eq!(RouterId(255).to_string(), "00000000000000ff");
}

fn entry(id: &str, blocks: usize) -> SnapshotEntry {
    SnapshotEntry {
        request_id: id.into(),
        booked: BookedSequence {
            worker_id: WorkerId(u64::MAX),
            dp_rank: DpRank(u32::MAX),
            block_hashes: (0..blocks)
                .map(|i| LocalBlockHash(u64::MAX - i as u64))
                .collect(),
            request_blocks: u32::MAX,
            prefill_tokens: u64::MAX,
            expected_prefill_ms: Some(u64::MAX),
            session_id: Some(longest_session()),
        },
        prefill_done: true,
    }
}

#[test]
fn snapshot_messages_round_trip() {
    let request = SnapshotRequest {
        router_id: RouterId(3),
        accepts_packed: true,
    };
    assert_eq!(
        decode::<SnapshotRequest>(&encode(&request).unwrap()).unwrap(),
        request
    );
    let reply = SnapshotReply {
        router_id: RouterId(u64::MAX),
        chunk: 2,
        last: false,
        requests: vec![entry("a", 3), entry("b", 0)],
        accepts_packed: true,
    };
    assert_eq!(
        decode::<SnapshotReply>(&encode(&reply).unwrap()).unwrap(),
        reply
    );
}

#[test]
fn encoded_length_bound_holds_for_the_largest_values() {
    for (id, blocks) in [("", 0), ("r", 1), (&*"x".repeat(300), 5000)] {
        let e = entry(id, blocks);
        let actual = encode(&e).unwrap().len();
        assert!(
            actual <= e.encoded_len_bound(),
            "{actual} > {} for {blocks} blocks",
            e.encoded_len_bound()
        );
        let reply = SnapshotReply {
            router_id: RouterId(u64::MAX),
            chunk: u32::MAX,
            last: false,
            requests: vec![e.clone()],
            accepts_packed: true,
        };
        assert!(encode(&reply).unwrap().len() <= REPLY_ENVELOPE_BOUND + e.encoded_len_bound());
    }
}

#[test]
fn chunks_stay_under_the_budget_and_keep_order() {
    let per_entry = entry("r00", 100).encoded_len_bound();
    // Exactly three entries fit in a chunk; a fourth would not.
    let budget = REPLY_ENVELOPE_BOUND + 3 * per_entry;
    let entries: Vec<SnapshotEntry> = (0..7).map(|i| entry(&format!("r{i:02}"), 100)).collect();
    let chunks = SnapshotReply::chunked(RouterId(9), entries.clone(), budget);
    let sizes: Vec<usize> = chunks.iter().map(|c| c.requests.len()).collect();
    assert_eq!(sizes, [3, 3, 1]);
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c.chunk as usize, i);
        assert_eq!(c.last, i == chunks.len() - 1);
        assert_eq!(c.router_id, RouterId(9));
        assert!(encode(c).unwrap().len() <= budget);
    }
    let rejoined: Vec<SnapshotEntry> = chunks.into_iter().flat_map(|c| c.requests).collect();
    assert_eq!(rejoined, entries);

    // One byte less and only two fit.
    let chunks = SnapshotReply::chunked(RouterId(9), entries.clone(), budget - 1);
    assert_eq!(
        chunks.iter().map(|c| c.requests.len()).collect::<Vec<_>>(),
        [2, 2, 2, 1]
    );

    // Nothing booked: one empty, final chunk.
    let empty = SnapshotReply::chunked(RouterId(9), Vec::new(), budget);
    assert_eq!(empty.len(), 1);
    assert!(empty[0].last && empty[0].requests.is_empty() && empty[0].chunk == 0);

    // A request larger than the budget travels alone.
    let big = vec![entry("small", 1), entry("big", 1000), entry("small2", 1)];
    let chunks = SnapshotReply::chunked(RouterId(9), big, 2048);
    assert_eq!(
        chunks.iter().map(|c| c.requests.len()).collect::<Vec<_>>(),
        [1, 1, 1]
    );
    assert_eq!(chunks[1].requests[0].request_id, "big".into());
}

#[test]
fn default_budget_fits_thousands_of_blocks_under_the_nats_limit() {
    let entries: Vec<SnapshotEntry> = (0..50).map(|i| entry(&format!("{i}"), 4000)).collect();
    let chunks = SnapshotReply::chunked(RouterId(1), entries, SNAPSHOT_CHUNK_BYTES);
    assert!(chunks.len() > 1);
    for c in &chunks {
        let len = encode(c).unwrap().len();
        assert!(len <= SNAPSHOT_CHUNK_BYTES, "{len}");
    }
}

#[test]
fn reply_without_the_optional_fields_decodes_with_defaults() {
    #[derive(Serialize)]
    struct Booked {
        worker_id: u64,
        dp_rank: u32,
        block_hashes: Vec<u64>,
        request_blocks: u32,
        prefill_tokens: u64,
    }
    #[derive(Serialize)]
    struct Entry {
        request_id: &'static str,
        booked: Booked,
    }
    #[derive(Serialize)]
    struct Reply {
        router_id: u64,
        requests: Vec<Entry>,
    }
    let bytes = encode(&Reply {
        router_id: 5,
        requests: vec![Entry {
            request_id: "r1",
            booked: Booked {
                worker_id: 2,
                dp_rank: 0,
                block_hashes: vec![7],
                request_blocks: 1,
                prefill_tokens: 4,
            },
        }],
    })
    .unwrap();
    let reply: SnapshotReply = decode(&bytes).unwrap();
    assert_eq!((reply.chunk, reply.last), (0, true));
    assert!(!reply.requests[0].prefill_done);
    assert_eq!(reply.requests[0].booked.expected_prefill_ms, None);
    // Only the router id is required.
    #[derive(Serialize)]
    struct Bare {
        router_id: u64,
    }
    let bare: SnapshotReply = decode(&encode(&Bare { router_id: 5 }).unwrap()).unwrap();
    assert!(bare.last && bare.requests.is_empty());
    assert!(decode::<SnapshotReply>(&[0xc1]).is_err());
}

fn step(id: &str, update: SequenceUpdate) -> SequenceStep {
    SequenceStep {
        request_id: id.into(),
        update,
    }
}

fn booked_update(blocks: u64) -> SequenceUpdate {
    SequenceUpdate::Booked(BookedSequence {
        worker_id: WorkerId(4),
        dp_rank: DpRank(1),
        block_hashes: (0..blocks).map(|i| LocalBlockHash(u64::MAX - i)).collect(),
        request_blocks: 3,
        prefill_tokens: 130,
        expected_prefill_ms: Some(25),
        session_id: Some(longest_session()),
    })
}

/// A session id of the longest length the wire allows.
fn longest_session() -> SessionId {
    SessionId::new(&"s".repeat(MAX_SESSION_ID_BYTES)).expect("at the limit")
}

#[test]
fn a_booking_carries_its_session_and_an_over_long_one_does_not_decode() {
    let SequenceUpdate::Booked(mut booked) = booked_update(2) else {
        unreachable!("booked_update books")
    };
    let with = encode(&booked).unwrap();
    assert_eq!(decode::<BookedSequence>(&with).unwrap(), booked);
    // Without a session the field is left out (the form older replicas send and read).
    booked.session_id = None;
    let without = encode(&booked).unwrap();
    assert!(without.len() + MAX_SESSION_ID_BYTES < with.len());
    assert_eq!(decode::<BookedSequence>(&without).unwrap(), booked);
    // Over the limit: refused by the decoder, before it is kept anywhere.
    #[derive(serde::Serialize)]
    struct Wire<'a> {
        worker_id: u64,
        dp_rank: u32,
        block_hashes: Vec<u64>,
        request_blocks: u32,
        prefill_tokens: u64,
        session_id: &'a str,
    }
    let long = "s".repeat(MAX_SESSION_ID_BYTES + 1);
    let wire = Wire {
        worker_id: 1,
        dp_rank: 0,
        block_hashes: vec![],
        request_blocks: 1,
        prefill_tokens: 1,
        session_id: &long,
    };
    let err = decode::<BookedSequence>(&encode(&wire).unwrap()).expect_err("too long");
    assert!(err.to_string().contains("session_id"), "{err}");
}

#[test]
fn a_batch_round_trips_in_order_and_the_single_step_form_decodes_as_one() {
    let batch = SequenceSyncBatch {
        router_id: RouterId(9),
        steps: vec![
            step("a", booked_update(2)),
            step("b", SequenceUpdate::KeepAlive),
            step("a", SequenceUpdate::PrefillDone),
            step("a", SequenceUpdate::Freed),
        ],
        queued_at_us: None,
        accepts_packed: false,
    };
    assert_eq!(
        decode::<SequenceSyncBatch>(&encode(&batch).unwrap()).unwrap(),
        batch
    );
    // With the time its first step was queued: it round trips, and a decoder that
    // does not know the field (an older replica) still reads the batch.
    let stamped = SequenceSyncBatch {
        queued_at_us: Some(1_764_000_000_123_456),
        ..batch.clone()
    };
    let bytes = encode(&stamped).unwrap();
    assert_eq!(decode::<SequenceSyncBatch>(&bytes).unwrap(), stamped);
    #[derive(Deserialize)]
    struct Older {
        router_id: RouterId,
        steps: Vec<SequenceStep>,
    }
    let older: Older = decode(&bytes).unwrap();
    assert_eq!(
        (older.router_id, older.steps),
        (batch.router_id, batch.steps.clone())
    );
    // What a replica before the batch form publishes.
    let single = SequenceSync {
        router_id: RouterId(3),
        request_id: "r1".into(),
        update: booked_update(1),
    };
    assert_eq!(
        decode::<SequenceSyncBatch>(&encode(&single).unwrap()).unwrap(),
        SequenceSyncBatch::from(single)
    );
}

#[test]
fn a_sync_message_with_both_forms_or_neither_is_refused() {
    #[derive(Serialize)]
    struct Both {
        router_id: u64,
        request_id: &'static str,
        update: SequenceUpdate,
        steps: Vec<SequenceStep>,
    }
    let both = encode(&Both {
        router_id: 1,
        request_id: "r",
        update: SequenceUpdate::Freed,
        steps: vec![step("s", SequenceUpdate::Freed)],
    })
    .unwrap();
    assert!(decode::<SequenceSyncBatch>(&both).is_err());
    #[derive(Serialize)]
    struct Half {
        router_id: u64,
        request_id: &'static str,
    }
    let half = encode(&Half {
        router_id: 1,
        request_id: "r",
    })
    .unwrap();
    assert!(decode::<SequenceSyncBatch>(&half).is_err());
    #[derive(Serialize)]
    struct Bare {
        router_id: u64,
    }
    assert!(decode::<SequenceSyncBatch>(&encode(&Bare { router_id: 1 }).unwrap()).is_err());
}

#[test]
fn step_length_bound_holds_for_the_largest_values() {
    for (id, blocks) in [("", 0), ("r", 1), (&*"x".repeat(300), 5000)] {
        for update in [booked_update(blocks), SequenceUpdate::Freed] {
            let s = step(id, update);
            let actual = encode(&s).unwrap().len();
            assert!(
                actual <= s.encoded_len_bound(),
                "{actual} > {}",
                s.encoded_len_bound()
            );
        }
    }
}

#[test]
fn a_router_id_reads_back_only_from_its_sixteen_hex_digits() {
    let id = RouterId(0x00ab_cdef_0123_4567);
    assert_eq!(RouterId::parse_hex(&id.to_string()), Some(id));
    assert_eq!(
        RouterId::parse_hex("FFFFFFFFFFFFFFFF"),
        Some(RouterId(u64::MAX))
    );
    for bad in [
        "",
        "ab",
        "00ab cdef01234567",
        "+0abcdef01234567",
        "0000000000000000a",
    ] {
        assert_eq!(RouterId::parse_hex(bad), None, "{bad:?}");
    }
}
