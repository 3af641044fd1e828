//! Unit tests of the ordering and recovery rules, with a real publisher journal.

use super::*;
use kv_events::journal::{EventJournal, JournalConfig};
use kv_events::recovery::RecoveryBody;
use kv_events::{DpRank, ExternalBlockHash, StoredBlock};
use std::time::{Duration, Instant};

const W: WorkerId = WorkerId(7);

fn rank(dp: u32) -> WorkerRank {
    WorkerRank::new(W, DpRank(dp))
}

fn index(buffer: usize) -> OrderedIndex {
    let settings = ShardSettings {
        recovery_buffer_events: buffer,
        ..ShardSettings::default()
    };
    OrderedIndex::new(settings, Arc::new(IndexerCounters::new()))
}

fn journal(epoch: u64, ring: usize) -> EventJournal {
    let config = JournalConfig {
        ring_capacity: ring,
        max_chunk_blocks: 3,
    };
    EventJournal::new(W, epoch, config)
}

/// A `Stored` of one block `h` (local hash `h`) below `parent`.
fn store(parent: Option<u64>, h: u64) -> KvCacheEventData {
    KvCacheEventData::Stored {
        group: None,
        parent_hash: parent.map(ExternalBlockHash),
        blocks: vec![StoredBlock {
            block_hash: ExternalBlockHash(h),
            tokens_hash: LocalBlockHash(h),
        }],
        tier: kv_events::StorageTier::Gpu,
    }
}

fn remove(h: u64) -> KvCacheEventData {
    KvCacheEventData::Removed {
        group: None,
        block_hashes: vec![ExternalBlockHash(h)],
        tier: kv_events::StorageTier::Gpu,
    }
}

/// Leading blocks of the chain `hashes` that rank `dp` holds.
fn score(index: &OrderedIndex, dp: u32, hashes: &[u64]) -> u32 {
    let q: Vec<LocalBlockHash> = hashes.iter().map(|h| LocalBlockHash(*h)).collect();
    index.find_matches(&q).get(rank(dp))
}

/// Answers `need` from `journal` (reassembling chunks, as the daemon does).
fn serve(
    index: &mut OrderedIndex,
    journal: &EventJournal,
    need: &RecoveryNeed,
) -> Vec<RecoveryNeed> {
    let payload = kv_events::encode(&need.request).expect("encodes");
    let mut asm = kv_events::recovery::ChunkAssembler::new();
    let mut reply = None;
    for chunk in journal.answer(&payload) {
        reply = asm.push(chunk).expect("chunks in order");
    }
    index.apply_recovered(need.rank, need.token, reply.expect("last chunk"))
}

/// The rank's state as the journal sees it, re-applied to a fresh index.
fn same_as_journal(index: &OrderedIndex, journal: &EventJournal, dp: u32) {
    let mut fresh = OrderedIndex::new(ShardSettings::default(), Arc::new(IndexerCounters::new()));
    let need = fresh.resync(rank(dp)).expect("a dump need");
    assert!(serve(&mut fresh, journal, &need).is_empty());
    let ours: Vec<KvEventBatch> = index
        .dump()
        .into_iter()
        .filter(|b| b.worker_id == W)
        .collect();
    let theirs = fresh.dump();
    let of_rank = |batches: &[KvEventBatch]| -> Vec<KvCacheEvent> {
        batches
            .iter()
            .flat_map(|b| b.events.iter().filter(|e| e.dp_rank == DpRank(dp)).cloned())
            .collect()
    };
    assert_eq!(of_rank(&ours), of_rank(&theirs));
    assert_eq!(
        index.cursor(rank(dp)).map(|c| c.next_event_id),
        Some(journal.next_event_id(DpRank(dp)))
    );
}

#[test]
fn in_order_events_apply_and_duplicates_are_dropped() {
    let mut idx = index(16);
    let mut j = journal(5, 16);
    let a = j.record_batch(DpRank(0), [store(None, 1), store(Some(1), 2)]);
    assert!(idx.apply_batch(&a).is_empty());
    assert!(
        idx.apply_batch(&a).is_empty(),
        "a duplicate batch is dropped"
    );
    assert_eq!(score(&idx, 0, &[1, 2]), 2);
    let c = idx.counters().snapshot();
    assert_eq!((c.duplicate_events, c.blocks_stored, c.gaps), (2, 2, 0));
    assert_eq!(
        idx.cursor(rank(0)).map(|c| (c.epoch, c.next_event_id)),
        Some((5, 2))
    );
}

#[test]
fn a_gap_is_buffered_and_filled_from_the_publishers_ring() {
    let mut idx = index(16);
    let mut j = journal(5, 16);
    let b0 = j.record_batch(DpRank(0), [store(None, 1)]);
    let lost = j.record_batch(DpRank(0), [store(Some(1), 2), remove(1)]);
    let b3 = j.record_batch(DpRank(0), [store(Some(2), 3)]);
    assert!(idx.apply_batch(&b0).is_empty());
    let needs = idx.apply_batch(&b3);
    assert_eq!(needs.len(), 1);
    let need = &needs[0];
    assert_eq!(
        need.reason,
        RecoveryReason::Gap {
            expected: 1,
            received: 3
        }
    );
    assert_eq!((need.request.start_event_id, need.request.dump), (1, false));
    assert_eq!(score(&idx, 0, &[1]), 1, "event 3 is buffered, not applied");
    // Live events keep arriving while the request is out: buffered too.
    let b4 = j.record_batch(DpRank(0), [store(Some(3), 4)]);
    assert!(idx.apply_batch(&b4).is_empty());
    assert!(serve(&mut idx, &j, need).is_empty());
    same_as_journal(&idx, &j, 0);
    assert_eq!(score(&idx, 0, &[1, 2, 3, 4]), 0, "block 1 was removed");
    drop(lost);
    // The range runs to the publisher's end, so the buffered events 3 and 4 come
    // back in it and the buffered copies are dropped as duplicates.
    let c = idx.counters().snapshot();
    assert_eq!((c.gaps, c.recovered_ranges, c.recovered_events), (1, 1, 4));
    assert_eq!(c.duplicate_events, 2);
}

#[test]
fn a_range_that_left_the_ring_is_recovered_from_a_dump() {
    let mut idx = index(64);
    let mut j = journal(5, 2);
    idx.apply_batch(&j.record_batch(DpRank(0), [store(None, 1)]));
    for h in 2..8 {
        j.record(DpRank(0), store(Some(h - 1), h)); // all lost in transit
    }
    let needs = idx.apply_batch(&j.record_batch(DpRank(0), [store(Some(7), 8)]));
    assert_eq!(needs.len(), 1);
    assert!(serve(&mut idx, &j, &needs[0]).is_empty());
    same_as_journal(&idx, &j, 0);
    assert_eq!(score(&idx, 0, &[1, 2, 3, 4, 5, 6, 7, 8]), 8);
    assert_eq!(idx.counters().snapshot().recovered_dumps, 1);
}

#[test]
fn an_overflowing_buffer_turns_into_a_dump_request() {
    let mut idx = index(3);
    let mut j = journal(5, 64);
    idx.apply_batch(&j.record_batch(DpRank(0), [store(None, 1)]));
    j.record(DpRank(0), store(Some(1), 2)); // lost
    let mut needs = Vec::new();
    for h in 3..8 {
        needs.extend(idx.apply_batch(&j.record_batch(DpRank(0), [store(Some(h - 1), h)])));
    }
    let reasons: Vec<RecoveryReason> = needs.iter().map(|n| n.reason).collect();
    // Ids 2–4 fit the buffer of 3 past the cursor (1); id 5 does not.
    assert_eq!(
        reasons,
        vec![
            RecoveryReason::Gap {
                expected: 1,
                received: 2
            },
            RecoveryReason::FarAhead {
                expected: 1,
                received: 5
            }
        ]
    );
    assert!(needs[1].request.dump);
    // The first request is superseded: its reply is ignored.
    assert!(serve(&mut idx, &j, &needs[0]).is_empty());
    assert_eq!(idx.counters().snapshot().recovery_replies_ignored, 1);
    assert!(serve(&mut idx, &j, &needs[1]).is_empty());
    same_as_journal(&idx, &j, 0);
}

/// Issue 14, finding 2: an id far ahead (here `u64::MAX`) was buffered, the range up
/// to it requested, and after every reply the hole remained, so the daemon asked again
/// at once, forever. Now such an event is dropped, one dump is requested, and once it
/// is applied nothing is left to ask for.
#[test]
fn an_event_id_far_ahead_is_dropped_and_one_dump_settles_the_rank() {
    let mut idx = index(8);
    let mut j = journal(5, 64);
    idx.apply_batch(&j.record_batch(DpRank(0), [store(None, 1)]));
    let forged = KvEventBatch {
        worker_id: W,
        epoch: 5,
        events: vec![KvCacheEvent {
            event_id: u64::MAX,
            dp_rank: DpRank(0),
            data: store(Some(1), 99),
        }],
    };
    let needs = idx.apply_batch(&forged);
    assert_eq!(needs.len(), 1);
    assert_eq!(
        needs[0].reason,
        RecoveryReason::FarAhead {
            expected: 1,
            received: u64::MAX
        }
    );
    assert!(needs[0].request.dump);
    // Again while the dump is pending: counted, no second request.
    assert!(idx.apply_batch(&forged).is_empty());
    assert_eq!(idx.counters().snapshot().far_ahead_events, 2);
    // The real stream goes on; the dump settles the rank with nothing left to ask.
    idx.apply_batch(&j.record_batch(DpRank(0), [store(Some(1), 2)]));
    assert!(serve(&mut idx, &j, &needs[0]).is_empty());
    same_as_journal(&idx, &j, 0);
    assert_eq!(score(&idx, 0, &[1, 2]), 2);
    assert_eq!(
        score(&idx, 0, &[1, 99]),
        1,
        "the forged block was never indexed"
    );
    // An id just inside the buffer's reach is still a gap recovered as a range.
    let within = j.next_event_id(DpRank(0)) + 8;
    let gap = KvEventBatch {
        worker_id: W,
        epoch: 5,
        events: vec![KvCacheEvent {
            event_id: within,
            dp_rank: DpRank(0),
            data: KvCacheEventData::Cleared,
        }],
    };
    let needs = idx.apply_batch(&gap);
    assert!(
        matches!(needs[0].reason, RecoveryReason::Gap { .. }),
        "{:?}",
        needs[0].reason
    );
}

#[test]
fn a_restarted_publisher_resets_its_rank_and_old_epochs_are_dropped() {
    let mut idx = index(16);
    let mut old = journal(5, 16);
    let stale = old.record_batch(DpRank(0), [store(None, 1)]);
    idx.apply_batch(&stale);
    idx.apply_batch(&old.record_batch(DpRank(0), [store(Some(1), 2)]));
    let mut new = journal(6, 16);
    assert!(
        idx.apply_batch(&new.record_batch(DpRank(0), [store(None, 9)]))
            .is_empty()
    );
    assert_eq!(score(&idx, 0, &[1]), 0, "the old epoch's blocks are gone");
    assert_eq!(score(&idx, 0, &[9]), 1);
    idx.apply_batch(&stale);
    assert_eq!(
        score(&idx, 0, &[1]),
        0,
        "a late batch of the old epoch is dropped"
    );
    let c = idx.counters().snapshot();
    assert_eq!((c.publisher_restarts, c.stale_epoch_events), (1, 1));
    // A publisher without epochs that starts over with a Cleared also resets.
    let mut legacy = journal(0, 16);
    let mut idx = index(16);
    idx.apply_batch(&legacy.record_batch(DpRank(0), [store(None, 1), store(Some(1), 2)]));
    let mut legacy2 = journal(0, 16);
    idx.apply_batch(&legacy2.record_batch(DpRank(0), [KvCacheEventData::Cleared, store(None, 3)]));
    assert_eq!((score(&idx, 0, &[1]), score(&idx, 0, &[3])), (0, 1));
    drop(legacy);
}

#[test]
fn an_unknown_parent_asks_for_a_dump_and_holds_later_events() {
    let mut idx = index(16);
    let mut j = journal(5, 16);
    idx.apply_batch(&j.record_batch(DpRank(0), [store(None, 1)]));
    // The publisher names a parent the index never saw, with no gap in the ids
    // (e.g. a publisher that lost its own event): the index asks for a dump.
    let rogue = j.record_batch(DpRank(0), [store(Some(50), 51)]);
    let needs = idx.apply_batch(&rogue);
    assert_eq!(needs.len(), 1);
    assert_eq!(needs[0].reason, RecoveryReason::UnknownParent);
    assert!(needs[0].request.dump);
    let later = j.record_batch(DpRank(0), [store(Some(1), 2)]);
    idx.apply_batch(&later);
    assert_eq!(score(&idx, 0, &[1, 2]), 1, "held until the dump arrives");
    assert!(serve(&mut idx, &j, &needs[0]).is_empty());
    same_as_journal(&idx, &j, 0);
    assert_eq!(score(&idx, 0, &[1, 2]), 2);
}

#[test]
fn abandoning_applies_the_buffer_past_its_holes() {
    let mut idx = index(16);
    let mut j = journal(5, 16);
    idx.apply_batch(&j.record_batch(DpRank(0), [store(None, 1)]));
    j.record(DpRank(0), store(None, 2)); // lost
    let needs = idx.apply_batch(&j.record_batch(DpRank(0), [store(None, 3)]));
    idx.apply_batch(&j.record_batch(DpRank(0), [store(None, 4)]));
    assert!(
        idx.abandon_recovery(needs[0].rank, needs[0].token)
            .is_empty()
    );
    assert_eq!((score(&idx, 0, &[3]), score(&idx, 0, &[4])), (1, 1));
    assert_eq!(score(&idx, 0, &[2]), 0, "the lost event stays lost");
    let c = idx.counters().snapshot();
    assert_eq!((c.recoveries_abandoned, c.events_lost), (1, 1));
    // A late reply to the abandoned recovery is ignored.
    assert!(serve(&mut idx, &j, &needs[0]).is_empty());
    assert_eq!(score(&idx, 0, &[2]), 0);
}

#[test]
fn resync_applies_live_events_after_the_dump_position_once() {
    let mut idx = index(16);
    let mut j = journal(5, 16);
    for h in 1..4 {
        j.record(DpRank(0), store(Some(h - 1).filter(|p| *p > 0), h)); // before start-up
    }
    let need = idx.resync(rank(0)).expect("a dump need");
    assert!(
        idx.resync(rank(0)).is_none(),
        "one pending recovery per rank"
    );
    // Published after the dump is taken (on the wire meanwhile): buffered.
    let reply = {
        let payload = kv_events::encode(&need.request).expect("encodes");
        let chunks = j.answer(&payload);
        let mut asm = kv_events::recovery::ChunkAssembler::new();
        let mut out = None;
        for c in chunks {
            out = asm.push(c).expect("ordered");
        }
        out.expect("complete")
    };
    let live = j.record_batch(DpRank(0), [remove(3), store(Some(2), 30)]);
    idx.apply_batch(&live);
    assert!(matches!(reply.body, RecoveryBody::Dump { .. }));
    assert!(idx.apply_recovered(need.rank, need.token, reply).is_empty());
    same_as_journal(&idx, &j, 0);
    assert_eq!(
        (score(&idx, 0, &[1, 2, 3]), score(&idx, 0, &[1, 2, 30])),
        (2, 3)
    );
    // Events the dump already covered, delivered late, are duplicates.
    let c = idx.counters().snapshot();
    assert_eq!(c.recovered_dumps, 1);
}

#[test]
fn routed_prompts_are_indexed_until_their_ttl() {
    let mut idx = index(16);
    let t0 = Instant::now();
    let q: Vec<LocalBlockHash> = (1..=3).map(LocalBlockHash).collect();
    idx.insert_routed(rank(1), &q, t0 + Duration::from_secs(10));
    idx.insert_routed(rank(1), &q[..1], t0 + Duration::from_secs(20));
    assert_eq!(idx.find_matches(&q).get(rank(1)), 3);
    assert_eq!(idx.next_expiry(), Some(t0 + Duration::from_secs(10)));
    assert_eq!(idx.expire(t0 + Duration::from_secs(9)), 0);
    assert_eq!(idx.expire(t0 + Duration::from_secs(10)), 2);
    assert_eq!(
        idx.find_matches(&q).get(rank(1)),
        1,
        "the refreshed prefix stays"
    );
    assert_eq!(idx.expire(t0 + Duration::from_secs(20)), 1);
    assert!(idx.find_matches(&q).is_empty());
    let c = idx.counters().snapshot();
    assert_eq!((c.approximate_blocks, c.expired_blocks), (3, 3));
}

#[test]
fn a_snapshot_restores_the_tree_and_the_cursors() {
    let mut idx = index(16);
    let mut j = journal(5, 16);
    idx.apply_batch(&j.record_batch(DpRank(0), [store(None, 1), store(Some(1), 2), remove(1)]));
    idx.apply_batch(&j.record_batch(DpRank(2), [store(None, 8)]));
    let snapshot = idx.snapshot();
    let mut copy = index(16);
    copy.restore(&snapshot);
    assert_eq!(copy.snapshot(), snapshot);
    // The copy continues where the original stood: the next event applies, an old
    // one is a duplicate.
    let next = j.record_batch(DpRank(0), [store(None, 1)]);
    assert!(copy.apply_batch(&next).is_empty());
    same_as_journal(&copy, &j, 0);
    same_as_journal(&copy, &j, 2);
    assert_eq!(copy.ranks_of(W), vec![DpRank(0), DpRank(2)]);
}

/// Issue 28: a store naming a known group with another window is refused and
/// counted, asks for no recovery, and later events apply; copies are counted.
#[test]
fn a_changed_window_is_refused_and_counted_and_copies_are_counted() {
    let mut idx = index(16);
    let grouped = |data: KvCacheEventData, window: Option<u32>| match data {
        KvCacheEventData::Stored {
            parent_hash,
            blocks,
            tier,
            ..
        } => KvCacheEventData::Stored {
            parent_hash,
            blocks,
            tier,
            group: kv_events::KvCacheGroup::windowed(0, window.unwrap_or(0))
                .or(Some(kv_events::KvCacheGroup::full(0))),
        },
        other => other,
    };
    let events: Vec<KvCacheEvent> = [
        grouped(store(None, 1), Some(2)),
        grouped(store(Some(1), 2), Some(3)), // group 0 has window 2
        grouped(store(Some(1), 2), Some(2)),
        grouped(store(Some(1), 2), Some(2)), // a second copy of block 2
    ]
    .into_iter()
    .enumerate()
    .map(|(i, data)| KvCacheEvent {
        event_id: i as u64,
        dp_rank: DpRank(0),
        data,
    })
    .collect();
    let needs = idx.apply_batch(&KvEventBatch::new(W, events));
    assert!(needs.is_empty(), "a changed window is not lost state");
    let c = idx.counters().snapshot();
    assert_eq!(
        (
            c.rejected_events,
            c.window_mismatch_rejections,
            c.stored_events
        ),
        (1, 1, 3)
    );
    assert_eq!((c.blocks_stored, c.duplicate_stores), (2, 1));
    assert_eq!(score(&idx, 0, &[1, 2]), 2);
    let evict = KvCacheEvent {
        event_id: 4,
        dp_rank: DpRank(0),
        data: KvCacheEventData::Removed {
            group: Some(kv_events::GroupId(0)),
            block_hashes: vec![ExternalBlockHash(2)],
            tier: kv_events::StorageTier::Gpu,
        },
    };
    idx.apply_batch(&KvEventBatch::new(W, vec![evict]));
    let c = idx.counters().snapshot();
    assert_eq!((c.copies_removed, c.blocks_removed), (1, 0));
    assert_eq!(score(&idx, 0, &[1, 2]), 2);
}
