//! The journal: numbering, the ring, recovery answers and dumps.

use super::*;
use crate::codec::encode;
use crate::events::{StorageTier, StoredBlock};
use crate::ids::{ExternalBlockHash, LocalBlockHash};
use crate::recovery::StoredChain;

pub(super) fn chain(hashes: &[u64]) -> Vec<StoredBlock> {
    hashes
        .iter()
        .map(|h| StoredBlock {
            block_hash: ExternalBlockHash(*h),
            tokens_hash: LocalBlockHash(h * 10),
        })
        .collect()
}

pub(super) fn stored(parent: Option<u64>, hashes: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Stored {
        group: None,
        parent_hash: parent.map(ExternalBlockHash),
        blocks: chain(hashes),
        tier: StorageTier::Gpu,
    }
}

pub(super) fn removed(hashes: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Removed {
        group: None,
        block_hashes: hashes.iter().map(|h| ExternalBlockHash(*h)).collect(),
        tier: StorageTier::Gpu,
    }
}

pub(super) fn journal(ring: usize) -> EventJournal {
    let config = JournalConfig {
        ring_capacity: ring,
        max_chunk_blocks: 2,
    };
    EventJournal::new(WorkerId(5), 42, config)
}

/// The dump of a rank that holds nothing and knows no group.
pub(super) fn empty_dump() -> RecoveryBody {
    RecoveryBody::Dump {
        chains: vec![],
        unheld: vec![],
        unheld_in_groups: vec![],
    }
}

fn request(dp: u32, epoch: u64, start: u64) -> RecoveryRequest {
    RecoveryRequest {
        dp_rank: DpRank(dp),
        epoch,
        start_event_id: start,
        dump: false,
    }
}

#[test]
fn numbers_events_per_rank_and_stamps_the_epoch() {
    let mut j = journal(8);
    let a = j.record_batch(DpRank(0), [stored(None, &[1, 2]), removed(&[2])]);
    let b = j.record_batch(DpRank(1), [stored(None, &[7])]);
    let c = j.record_batch(DpRank(0), [KvCacheEventData::Cleared]);
    let ids = |batch: &KvEventBatch| batch.events.iter().map(|e| e.event_id).collect::<Vec<_>>();
    assert_eq!((ids(&a), ids(&b), ids(&c)), (vec![0, 1], vec![0], vec![2]));
    assert_eq!((a.worker_id, a.epoch), (WorkerId(5), 42));
    assert_eq!(c.events[0].dp_rank, DpRank(0));
    assert_eq!(j.next_event_id(DpRank(0)), 3);
    assert_eq!((j.held_blocks(DpRank(0)), j.held_blocks(DpRank(1))), (0, 1));
}

#[test]
fn buffered_ranges_are_replayed_as_events() {
    let mut j = journal(8);
    for i in 0..5 {
        j.record(DpRank(0), stored(None, &[i]));
    }
    let reply = j.replay(&request(0, 42, 2));
    assert_eq!(reply.next_event_id, 5);
    let RecoveryBody::Events { events } = reply.body else {
        panic!("expected events")
    };
    assert_eq!(
        events.iter().map(|e| e.event_id).collect::<Vec<_>>(),
        vec![2, 3, 4]
    );
    // Nothing missing: an empty events reply.
    let reply = j.replay(&request(0, 42, 5));
    assert_eq!(reply.body, RecoveryBody::Events { events: vec![] });
}

#[test]
fn ranges_that_left_the_ring_other_epochs_and_forced_requests_get_a_dump() {
    let mut j = journal(3);
    j.record(DpRank(0), stored(None, &[1, 2, 3]));
    j.record(DpRank(0), stored(Some(2), &[4]));
    j.record(DpRank(0), stored(None, &[9]));
    j.record(DpRank(0), removed(&[9]));
    let is_dump = |r: &RecoveryReply| matches!(r.body, RecoveryBody::Dump { .. });
    assert!(
        is_dump(&j.replay(&request(0, 42, 0))),
        "event 0 left the ring"
    );
    assert!(!is_dump(&j.replay(&request(0, 42, 1))));
    assert!(is_dump(&j.replay(&request(0, 41, 1))), "old epoch");
    assert!(is_dump(&j.replay(&request(0, 42, 9))), "beyond the end");
    let forced = RecoveryRequest {
        dump: true,
        ..request(0, 42, 3)
    };
    let reply = j.replay(&forced);
    assert_eq!(reply.next_event_id, 4);
    let RecoveryBody::Dump {
        unheld_in_groups: _,
        chains,
        unheld,
    } = reply.body
    else {
        panic!("expected a dump")
    };
    assert!(unheld.is_empty());
    assert_eq!(
        chains,
        vec![
            StoredChain {
                group: None,
                parent_hash: None,
                blocks: chain(&[1, 2, 3]),
                tier: StorageTier::Gpu
            },
            StoredChain {
                group: None,
                parent_hash: Some(ExternalBlockHash(2)),
                blocks: chain(&[4]),
                tier: StorageTier::Gpu
            },
        ]
    );
    // A rank that never published: nothing is missing, and its dump is empty.
    let reply = j.replay(&request(3, 42, 0));
    assert_eq!(reply.next_event_id, 0);
    assert_eq!(reply.body, RecoveryBody::Events { events: vec![] });
    assert_eq!(j.dump(DpRank(3)).body, empty_dump());
}

#[test]
fn dumps_keep_blocks_below_a_removed_block_as_unheld_placeholders() {
    let mut j = journal(8);
    j.record(DpRank(0), stored(None, &[1, 2, 3]));
    j.record(DpRank(0), stored(Some(2), &[4]));
    j.record(DpRank(0), removed(&[2]));
    let dump = |j: &EventJournal| match j.dump(DpRank(0)).body {
        RecoveryBody::Dump {
            unheld_in_groups: _,
            chains,
            unheld,
        } => (
            chains
                .iter()
                .flat_map(|c| c.blocks.iter().map(|b| b.block_hash.0))
                .collect::<Vec<_>>(),
            unheld.iter().map(|h| h.0).collect::<Vec<_>>(),
        ),
        other => panic!("expected a dump, got {other:?}"),
    };
    assert_eq!(dump(&j), (vec![1, 2, 3, 4], vec![2]));
    assert_eq!(j.held_blocks(DpRank(0)), 3);
    // Once nothing below it is held, the placeholder goes too.
    j.record(DpRank(0), removed(&[3, 4]));
    assert_eq!(dump(&j), (vec![1], vec![]));
    j.record(DpRank(0), stored(Some(1), &[2, 3]));
    j.record(DpRank(0), removed(&[2]));
    j.record(DpRank(0), stored(Some(1), &[2]));
    assert_eq!(
        dump(&j),
        (vec![1, 2, 3], vec![]),
        "stored again: held again"
    );
    j.record(DpRank(0), KvCacheEventData::Cleared);
    assert_eq!(dump(&j), (vec![], vec![]));
    assert_eq!(j.held_blocks(DpRank(0)), 0);
}

#[test]
fn answers_raw_payloads_in_chunks_and_malformed_ones_with_an_error() {
    let mut j = journal(8);
    j.record(DpRank(0), stored(None, &[1, 2, 3, 4, 5]));
    let payload = encode(&RecoveryRequest {
        dump: true,
        ..request(0, 42, 0)
    })
    .unwrap();
    let chunks = j.answer(&payload);
    assert_eq!(chunks.len(), 3, "5 blocks at 2 per chunk");
    assert!(chunks[2].last && !chunks[0].last);
    let bad = j.answer(&[0xc1]);
    assert_eq!(bad.len(), 1);
    assert!(matches!(bad[0].body, RecoveryBody::Error { .. }));
}
