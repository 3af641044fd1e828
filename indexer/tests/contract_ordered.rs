//! The ordering, recovery, snapshot, approximate-mode and memory-bound contract, run
//! over every implementation with event ordering: `OrderedIndex`, and the running
//! `Indexer` with 1 and 3 shards. Publishers are real `EventJournal`s; recovery
//! needs are answered from them, as the daemon does over NATS.

mod common;
mod subject;

use common::{a, query, wr};
use indexer::Pruning;
use kv_events::journal::{EventJournal, JournalConfig};
use kv_events::recovery::ChunkAssembler;
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEventData, KvEventBatch, LocalBlockHash, StoredBlock,
    WorkerId,
};
use std::collections::BTreeMap;
use std::time::Duration;
use subject::Subject;

/// Publishers by worker id.
type Journals = BTreeMap<WorkerId, EventJournal>;

fn journal(worker: u64, epoch: u64, ring: usize) -> EventJournal {
    let config = JournalConfig {
        ring_capacity: ring,
        max_chunk_blocks: 2,
    };
    EventJournal::new(WorkerId(worker), epoch, config)
}

/// A chain of blocks `hashes` (engine hash = local hash) below `parent`.
fn store(parent: Option<u64>, hashes: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Stored {
        group: None,
        parent_hash: parent.map(ExternalBlockHash),
        blocks: hashes
            .iter()
            .map(|h| StoredBlock {
                block_hash: ExternalBlockHash(*h),
                tokens_hash: LocalBlockHash(*h),
            })
            .collect(),
        tier: kv_events::StorageTier::Gpu,
    }
}

fn remove(hashes: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Removed {
        group: None,
        block_hashes: hashes.iter().map(|h| ExternalBlockHash(*h)).collect(),
        tier: kv_events::StorageTier::Gpu,
    }
}

/// Answers every recovery need from the journals until none is left.
async fn serve_all(s: &mut Subject, journals: &Journals) -> usize {
    let mut served = 0;
    loop {
        let needs = s.take_needs().await;
        if needs.is_empty() {
            return served;
        }
        for need in needs {
            let journal = &journals[&need.rank.worker_id];
            let payload = kv_events::encode(&need.request).expect("encodes");
            let mut asm = ChunkAssembler::new();
            let mut reply = None;
            for chunk in journal.answer(&payload) {
                reply = asm.push(chunk).expect("in order");
            }
            s.recovered(&need, reply.expect("complete")).await;
            served += 1;
        }
    }
}

/// Asserts the subject holds exactly what the journals say, rank by rank: the same
/// dump as a fresh index rebuilt from the journals' own dumps.
async fn assert_matches_journals(s: &mut Subject, journals: &Journals) {
    let mut truth = s.empty_like();
    for journal in journals.values() {
        for dp in journal.ranks() {
            truth.resync(wr(journal.worker_id().0, dp.0)).await;
        }
    }
    serve_all(&mut truth, journals).await;
    assert_eq!(s.dump().await, truth.dump().await, "{}", s.name);
}

#[tokio::test]
async fn lost_duplicated_and_reordered_events_are_recovered_exactly() {
    for mut s in Subject::ordered(Pruning::Unbounded) {
        let mut journals = Journals::new();
        journals.insert(WorkerId(1), journal(1, 10, 4));
        journals.insert(WorkerId(2), journal(2, 10, 64));
        let mut wire: Vec<KvEventBatch> = Vec::new();
        for i in 0..12u64 {
            let j1 = journals.get_mut(&WorkerId(1)).expect("worker 1");
            let parent = (i > 0).then_some(100 + i - 1);
            wire.push(j1.record_batch(DpRank(0), [store(parent, &[100 + i])]));
            let j2 = journals.get_mut(&WorkerId(2)).expect("worker 2");
            wire.push(j2.record_batch(DpRank(1), [store(None, &[200 + i]), remove(&[200 + i])]));
        }
        // In transit: worker 1 loses batches 2..8 (more than its ring of 4 events
        // holds: it will answer with a dump), worker 2 loses one batch, one batch is
        // duplicated and two are swapped.
        let mut delivered: Vec<KvEventBatch> = Vec::new();
        for (i, batch) in wire.into_iter().enumerate() {
            let lost = (batch.worker_id == WorkerId(1) && (4..16).contains(&i)) || i == 9;
            if !lost {
                delivered.push(batch);
            }
        }
        delivered.insert(3, delivered[2].clone());
        delivered.swap(6, 7);
        for batch in delivered {
            s.apply_raw(batch).await;
        }
        assert!(serve_all(&mut s, &journals).await >= 2, "{}", s.name);
        assert_matches_journals(&mut s, &journals).await;
        let hashes: Vec<u64> = (100..112).collect();
        assert_eq!(s.find(&hashes).await, vec![(wr(1, 0), 12)], "{}", s.name);
        let c = s.report().await;
        assert_eq!(
            (c.recovering_ranks, c.buffered_events),
            (0, 0),
            "{}",
            s.name
        );
    }
}

#[tokio::test]
async fn a_restarted_publisher_replaces_its_old_state() {
    for mut s in Subject::ordered(Pruning::Unbounded) {
        let mut old = journal(3, 10, 16);
        s.apply_raw(old.record_batch(DpRank(0), [store(None, &[1, 2, 3])]))
            .await;
        // Restarted with a newer epoch; its first batch is lost in transit.
        let mut new = journal(3, 11, 16);
        new.record_batch(DpRank(0), [store(None, &[7])]);
        let late = old.record_batch(DpRank(0), [store(Some(3), &[4])]);
        s.apply_raw(new.record_batch(DpRank(0), [store(Some(7), &[8])]))
            .await;
        s.apply_raw(late).await; // the old epoch is over: dropped
        let journals = Journals::from([(WorkerId(3), new)]);
        serve_all(&mut s, &journals).await;
        assert_matches_journals(&mut s, &journals).await;
        assert_eq!(s.find(&[7, 8]).await, vec![(wr(3, 0), 2)], "{}", s.name);
        assert!(s.find(&[1]).await.is_empty(), "{}", s.name);
    }
}

#[tokio::test]
async fn a_resync_catches_up_with_events_published_meanwhile() {
    for mut s in Subject::ordered(Pruning::Unbounded) {
        let mut j = journal(4, 10, 2);
        for h in 1..6 {
            j.record(DpRank(0), store((h > 1).then(|| h - 1), &[h]));
        }
        // Start-up: ask for the state, then events published after the request
        // arrive before the reply is handed back.
        s.resync(wr(4, 0)).await;
        let needs = s.take_needs().await;
        assert_eq!(needs.len(), 1, "{}", s.name);
        let payload = kv_events::encode(&needs[0].request).expect("encodes");
        let chunks = j.answer(&payload);
        let after: Vec<KvEventBatch> = (6..9)
            .map(|h| j.record_batch(DpRank(0), [store(Some(h - 1), &[h])]))
            .collect();
        let mut asm = ChunkAssembler::new();
        let mut reply = None;
        for chunk in chunks {
            reply = asm.push(chunk).expect("in order");
        }
        // The first event after the dump arrives before the reply, the rest after it.
        let mut after = after.into_iter();
        s.apply_raw(after.next().expect("three")).await;
        s.recovered(&needs[0], reply.expect("complete")).await;
        for batch in after {
            s.apply_raw(batch).await;
        }
        let journals = Journals::from([(WorkerId(4), j)]);
        assert_eq!(serve_all(&mut s, &journals).await, 0, "{}", s.name);
        assert_matches_journals(&mut s, &journals).await;
        let hashes: Vec<u64> = (1..9).collect();
        assert_eq!(s.find(&hashes).await, vec![(wr(4, 0), 8)], "{}", s.name);
    }
}

#[tokio::test]
async fn a_snapshot_restores_into_an_empty_index_that_continues_in_order() {
    for mut s in Subject::ordered(Pruning::Unbounded) {
        let mut journals = Journals::new();
        for w in [0u64, 1, 2] {
            let mut j = journal(w, 10, 16);
            s.apply_raw(j.record_batch(DpRank(0), [store(None, &[w * 10, w * 10 + 1])]))
                .await;
            s.apply_raw(j.record_batch(
                DpRank(1),
                [store(None, &[w * 10 + 5]), remove(&[w * 10 + 5])],
            ))
            .await;
            journals.insert(WorkerId(w), j);
        }
        let snapshot = s.snapshot().await;
        assert_eq!(snapshot.cursors.len(), 6, "{}", s.name);
        let mut copy = s.empty_like();
        copy.restore(snapshot.clone()).await;
        assert_eq!(copy.snapshot().await, snapshot, "{}", s.name);
        for (w, j) in &mut journals {
            let batch = j.record_batch(DpRank(0), [store(Some(w.0 * 10 + 1), &[w.0 * 10 + 2])]);
            copy.apply_raw(batch).await;
        }
        assert_eq!(
            serve_all(&mut copy, &journals).await,
            0,
            "no gap after a restore"
        );
        assert_matches_journals(&mut copy, &journals).await;
    }
}

#[tokio::test(start_paused = true)]
async fn routed_prompts_are_indexed_until_their_ttl_ends() {
    for mut s in Subject::ordered(Pruning::Unbounded) {
        let ttl = Duration::from_secs(30);
        s.insert_routed(wr(9, 1), &[1, 2, 3], ttl).await;
        tokio::time::advance(Duration::from_secs(10)).await;
        s.insert_routed(wr(9, 1), &[1, 2], ttl).await; // refreshes the prefix
        s.insert_routed(wr(8, 0), &[1, 2, 3, 4], ttl).await;
        assert_eq!(
            s.find(&[1, 2, 3, 4]).await,
            vec![(wr(8, 0), 4), (wr(9, 1), 3)],
            "{}",
            s.name
        );
        tokio::time::advance(Duration::from_secs(21)).await;
        s.expire_due(6).await;
        assert_eq!(
            s.find(&[1, 2, 3, 4]).await,
            vec![(wr(8, 0), 4), (wr(9, 1), 2)],
            "{}: block 3 of 9/1 expired",
            s.name
        );
        tokio::time::advance(Duration::from_secs(10)).await;
        s.expire_due(0).await;
        assert!(s.find(&[1]).await.is_empty(), "{}", s.name);
        assert_eq!(s.entries_and_ranks().await.0, 0, "{}", s.name);
    }
}

#[tokio::test]
async fn a_memory_bound_keeps_entries_under_it_and_forgets_the_coldest() {
    let bound = Pruning::LeastRecentlyMatched {
        max_entries: 300,
        target_percent: 80,
    };
    for mut s in Subject::ordered(bound) {
        let name = s.name;
        let mut journals = Journals::new();
        for w in 0..6u64 {
            journals.insert(WorkerId(w), journal(w, 1, 4096));
        }
        let hot: Vec<u64> = (0..20).map(|i| 1_000_000 + i).collect();
        for round in 0..10u64 {
            for w in 0..6u64 {
                let j = journals.get_mut(&WorkerId(w)).expect("worker");
                let base = (w * 100 + round) * 1000;
                let cold: Vec<u64> = (base..base + 10).collect();
                s.apply_raw(j.record_batch(DpRank(0), [store(None, &cold)]))
                    .await;
                if w == 0 && round == 0 {
                    let hot_chain = j.record_batch(DpRank(0), [store(None, &hot)]);
                    s.apply_raw(hot_chain).await;
                }
            }
            // The hot chain is matched every round, so it is never the coldest.
            assert_eq!(s.find(&hot).await, vec![(wr(0, 0), 20)], "{name}");
            let report = s.report().await;
            assert!(
                report.stats.entries <= 300,
                "{name}: {}",
                report.stats.entries
            );
        }
        // 620 entries were stored; the bound forgot the oldest cold chains.
        let oldest: Vec<u64> = (0..10).collect();
        assert!(s.find(&oldest).await.is_empty(), "{name}");
        assert_eq!(
            serve_all(&mut s, &journals).await,
            0,
            "{name}: pruning is not loss"
        );
    }
}

/// Issue 28: a snapshot of a hybrid rank restores its groups, windows and copies.
#[tokio::test]
async fn a_snapshot_restores_groups_windows_and_copies() {
    for mut s in Subject::ordered(Pruning::Unbounded) {
        let name = s.name;
        s.apply(common::batch(1, common::prompt_a())).await;
        let again = common::in_group(common::stored(0, Some(a(6)), &[(a(7), 7)]), 0, Some(4));
        s.apply(common::batch(1, vec![again])).await; // a second copy in group 0
        let snapshot = s.snapshot().await;
        let mut copy = s.empty_like();
        copy.restore(snapshot.clone()).await;
        assert_eq!(copy.snapshot().await, snapshot, "{name}");
        assert_eq!(copy.entries_and_ranks().await, (11 + 3 * 4, 4), "{name}");
        for subject in [&mut s, &mut copy] {
            assert_eq!(
                subject.find(&query(11, 11)).await,
                vec![(wr(1, 0), 11)],
                "{name}"
            );
            assert!(subject.find(&query(10, 10)).await.is_empty(), "{name}");
            let evict = common::in_group(common::removed(0, &[a(7)]), 0, None);
            subject.apply(common::batch(1, vec![evict])).await;
            assert_eq!(
                subject.find(&query(11, 11)).await,
                vec![(wr(1, 0), 11)],
                "{name}: one copy of block 7 left in group 0"
            );
        }
    }
}

/// Issue 28: a publisher's dump of a hybrid rank: chains per group, and the blocks
/// stored only to place others removed from their own group (`unheld_in_groups`).
#[tokio::test]
async fn a_recovery_dump_removes_placeholders_from_their_own_group() {
    use kv_events::recovery::{GroupBlocks, RecoveryBody, RecoveryReply, StoredChain};
    use kv_events::{GroupId, KvCacheGroup, StorageTier};
    for mut s in Subject::ordered(Pruning::Unbounded) {
        let name = s.name;
        s.resync(wr(7, 0)).await;
        let needs = s.take_needs().await;
        let blocks: Vec<StoredBlock> = (0..11)
            .map(|k| StoredBlock {
                block_hash: ExternalBlockHash(a(k)),
                tokens_hash: LocalBlockHash(k),
            })
            .collect();
        let chain = |group| StoredChain {
            parent_hash: None,
            blocks: blocks.clone(),
            tier: StorageTier::Gpu,
            group: Some(group),
        };
        let window = KvCacheGroup::windowed(0, 2).expect("window ≥ 1");
        let reply = RecoveryReply {
            worker_id: WorkerId(7),
            dp_rank: DpRank(0),
            epoch: 0,
            next_event_id: 5,
            body: RecoveryBody::Dump {
                chains: vec![chain(KvCacheGroup::full(3)), chain(window)],
                unheld: Vec::new(),
                unheld_in_groups: vec![GroupBlocks {
                    group: GroupId(0),
                    block_hashes: (0..9).map(|k| ExternalBlockHash(a(k))).collect(),
                }],
            },
        };
        s.recovered(&needs[0], reply).await;
        // Group 0 (window 2) holds blocks 9 and 10 only.
        assert_eq!(s.find(&query(11, 11)).await, vec![(wr(7, 0), 11)], "{name}");
        assert!(
            s.find(&query(10, 10)).await.is_empty(),
            "{name}: needs 8..10"
        );
        assert_eq!(s.entries_and_ranks().await, (11 + 2, 2), "{name}");
    }
}
