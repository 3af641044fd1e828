//! The indexer contract, run over every implementation: the `RadixTree` directly, the
//! synchronous `OrderedIndex`, and the running `Indexer` with 1 and 3 shards (driven through the `IndexerApi` trait). Each case builds a
//! fresh subject of each kind, drives it through the same adapter and asserts the
//! same answers (apart from node counts, which are per shard). The ordering, recovery, snapshot, approximate-mode and
//! memory-bound cases run over every implementation with event ordering (all but the
//! bare tree); they live in `contract_ordered.rs` and share this adapter.

mod common;
mod subject;

use common::{batch, chain, cleared, removed, stored, wr};
use subject::Subject;

/// Six workers (spread over every shard), two with two dp ranks, sharing prefixes.
async fn populate(s: &mut Subject) {
    s.apply(batch(0, vec![stored(0, None, &chain(100, 4))]))
        .await;
    s.apply(batch(
        1,
        vec![
            stored(0, None, &chain(200, 2)),
            stored(1, None, &chain(210, 3)),
        ],
    ))
    .await;
    s.apply(batch(
        2,
        vec![
            stored(0, None, &chain(300, 3)),
            stored(0, Some(301), &[(390, 9)]),
        ],
    ))
    .await;
    s.apply(batch(3, vec![stored(0, None, &[(400, 7), (401, 8)])]))
        .await;
    s.apply(batch(4, vec![stored(2, None, &chain(500, 1))]))
        .await;
    s.apply(batch(5, vec![stored(0, None, &chain(600, 5))]))
        .await;
}

#[tokio::test]
async fn prefix_scores_count_leading_blocks_per_rank() {
    for mut s in Subject::all() {
        let name = s.name;
        populate(&mut s).await;
        let expected = vec![
            (wr(0, 0), 4),
            (wr(1, 0), 2),
            (wr(1, 1), 3),
            (wr(2, 0), 3),
            (wr(4, 2), 1),
            (wr(5, 0), 4),
        ];
        assert_eq!(s.find(&[0, 1, 2, 3]).await, expected, "{name}");
        let expected = vec![
            (wr(0, 0), 2),
            (wr(1, 0), 2),
            (wr(1, 1), 2),
            (wr(2, 0), 3),
            (wr(5, 0), 2),
        ];
        let mut got = s.find(&[0, 1, 9]).await;
        got.retain(|(_, score)| *score >= 2);
        assert_eq!(got, expected, "{name}");
        assert_eq!(s.find(&[7, 8, 0]).await, vec![(wr(3, 0), 2)], "{name}");
        assert!(
            s.find(&[8]).await.is_empty(),
            "{name}: block 8 is only held after 7"
        );
        assert!(s.find(&[]).await.is_empty(), "{name}");
        assert_eq!(
            s.entries_and_ranks().await,
            (4 + 5 + 4 + 2 + 1 + 5, 7),
            "{name}"
        );
        let report = s.report().await;
        assert_eq!(report.blocks_per_rank.len(), 7, "{name}");
        assert_eq!(report.blocks_per_rank[2], (wr(1, 1), 3), "{name}");
        assert_eq!(
            report.blocks_per_worker()[..2],
            [(kv_events::WorkerId(0), 4), (kv_events::WorkerId(1), 5)],
            "{name}"
        );
        assert!(report.stats.bytes_per_entry() > 4.0, "{name}");
    }
}

#[tokio::test]
async fn unknown_parent_is_refused_and_changes_nothing() {
    for mut s in Subject::all() {
        let name = s.name;
        populate(&mut s).await;
        let before = (s.dump().await, s.entries_and_ranks().await);
        // Worker 3 names worker 0's block as parent; worker 6 is new.
        s.apply(batch(3, vec![stored(0, Some(100), &[(450, 1)])]))
            .await;
        s.apply(batch(6, vec![stored(0, Some(1), &chain(700, 2))]))
            .await;
        assert_eq!(
            (s.dump().await, s.entries_and_ranks().await),
            before,
            "{name}"
        );
        // The rest of a batch still applies after a refused event (on an ordered
        // index, the refusal asks for a dump and holds the later events until it
        // comes; nobody serves it here, giving it up applies them).
        s.apply(batch(
            3,
            vec![stored(0, Some(9), &[]), stored(0, Some(401), &[(402, 0)])],
        ))
        .await;
        s.abandon_all_recoveries().await;
        assert_eq!(s.find(&[7, 8, 0]).await, vec![(wr(3, 0), 3)], "{name}");
    }
}

#[tokio::test]
async fn removes_cut_prefixes_and_unknown_removes_are_ignored() {
    for mut s in Subject::all() {
        let name = s.name;
        populate(&mut s).await;
        s.apply(batch(0, vec![removed(0, &[103, 999])])).await; // leaf + unknown
        s.apply(batch(5, vec![removed(0, &[601])])).await; // interior
        s.apply(batch(9, vec![removed(0, &[1, 2])])).await; // unknown worker
        let got = s.find(&[0, 1, 2, 3]).await;
        assert_eq!(got[0], (wr(0, 0), 3), "{name}");
        assert_eq!(got.last(), Some(&(wr(5, 0), 1)), "{name}");
        assert_eq!(s.entries_and_ranks().await.0, 21 - 2, "{name}");
        // Storing the interior block again reconnects the tail.
        s.apply(batch(5, vec![stored(0, Some(600), &[(601, 1)])]))
            .await;
        assert_eq!(
            s.find(&[0, 1, 2, 3, 4]).await.last(),
            Some(&(wr(5, 0), 5)),
            "{name}"
        );
    }
}

/// Issue 28: a store of a block the rank holds is a second physical copy (vLLM
/// recomputing a prefix, or repeating an exactly block-aligned prompt); the block
/// leaves with its last copy, not its first.
#[tokio::test]
async fn a_duplicate_store_adds_copies_that_leave_one_remove_at_a_time() {
    for mut s in Subject::all() {
        let name = s.name;
        populate(&mut s).await;
        let entries = s.entries_and_ranks().await;
        s.apply(batch(0, vec![stored(0, None, &chain(100, 4))]))
            .await;
        s.apply(batch(2, vec![stored(0, Some(300), &[(301, 1)])]))
            .await;
        assert_eq!(
            s.entries_and_ranks().await,
            entries,
            "{name}: copies are not entries"
        );
        // Worker 0 holds blocks 100..104 twice: the first remove of 103 keeps it.
        s.apply(batch(0, vec![removed(0, &[103])])).await;
        assert_eq!(s.find(&[0, 1, 2, 3]).await[0], (wr(0, 0), 4), "{name}");
        s.apply(batch(0, vec![removed(0, &[103])])).await;
        assert_eq!(s.find(&[0, 1, 2, 3]).await[0], (wr(0, 0), 3), "{name}");
        // A third remove names a block no longer held: a no-op.
        s.apply(batch(0, vec![removed(0, &[103])])).await;
        assert_eq!(s.find(&[0, 1, 2, 3]).await[0], (wr(0, 0), 3), "{name}");
        // Worker 2's block 301 went through the same.
        s.apply(batch(2, vec![removed(0, &[301])])).await;
        assert_eq!(s.find(&[0, 1, 2]).await[3], (wr(2, 0), 3), "{name}");
        s.apply(batch(2, vec![removed(0, &[301])])).await;
        assert_eq!(s.find(&[0, 1, 2]).await[3], (wr(2, 0), 1), "{name}");
        // The copies of a dumped index are dumped too.
        let mut copy = s.empty_like();
        for batch in s.dump().await {
            copy.apply(batch).await;
        }
        for subject in [&mut s, &mut copy] {
            subject.apply(batch(0, vec![removed(0, &[102])])).await;
            assert_eq!(
                subject.find(&[0, 1, 2, 3]).await[0],
                (wr(0, 0), 3),
                "{name}: the copy of 102 stays"
            );
        }
    }
}

#[tokio::test]
async fn cleared_and_remove_worker_drop_ranks() {
    for mut s in Subject::all() {
        let name = s.name;
        populate(&mut s).await;
        s.apply(batch(1, vec![cleared(1)])).await;
        s.remove_worker(0).await;
        s.remove_worker(42).await; // unknown worker: no-op
        let got = s.find(&[0, 1, 2, 3]).await;
        let expected = vec![(wr(1, 0), 2), (wr(2, 0), 3), (wr(4, 2), 1), (wr(5, 0), 4)];
        assert_eq!(got, expected, "{name}");
        assert_eq!(s.entries_and_ranks().await, (21 - 3 - 4, 5), "{name}");
    }
}

#[tokio::test]
async fn events_of_one_worker_apply_in_order() {
    for mut s in Subject::all() {
        let name = s.name;
        for round in 0..20u64 {
            // Store, remove, store again: only the final state may remain.
            s.apply(batch(
                4,
                vec![stored(0, None, &chain(1000 + round * 10, 3))],
            ))
            .await;
            s.apply(batch(4, vec![removed(0, &[1000 + round * 10 + 2])]))
                .await;
        }
        s.apply(batch(4, vec![cleared(0), stored(0, None, &chain(5000, 2))]))
            .await;
        assert_eq!(s.find(&[0, 1, 2]).await, vec![(wr(4, 0), 2)], "{name}");
        assert_eq!(s.entries_and_ranks().await, (2, 1), "{name}");
    }
}

#[tokio::test]
async fn dump_replays_into_an_equal_index() {
    let queries: [&[u64]; 7] = [
        &[0, 1, 2, 3, 4],
        &[0, 1, 9],
        &[7, 8],
        &[0],
        &[1],
        &[0, 1, 2],
        &[0, 1, 2, 3],
    ];
    for mut s in Subject::all() {
        let name = s.name;
        populate(&mut s).await;
        s.apply(batch(5, vec![removed(0, &[602])])).await;
        let dump = s.dump().await;
        let workers: Vec<u64> = dump.iter().map(|b| b.worker_id.0).collect();
        assert_eq!(
            workers,
            vec![0, 1, 2, 3, 4, 5],
            "{name}: one batch per worker, sorted"
        );
        let mut copy = s.empty_like();
        for batch in dump.clone() {
            copy.apply(batch).await;
        }
        for query in queries {
            assert_eq!(
                copy.find(query).await,
                s.find(query).await,
                "{name}: {query:?}"
            );
        }
        // Blocks 603 and 604 hang below the removed 602: kept, so that storing 602
        // again reconnects them in the copy as in the original.
        assert_eq!(copy.entries_and_ranks().await, (21 - 1, 7), "{name}");
        assert_eq!(
            copy.dump().await,
            dump,
            "{name}: dumping the copy gives the same events"
        );
        for subject in [&mut s, &mut copy] {
            subject
                .apply(batch(5, vec![stored(0, Some(601), &[(602, 2)])]))
                .await;
            assert_eq!(
                subject.find(&[0, 1, 2, 3, 4]).await.last(),
                Some(&(wr(5, 0), 5)),
                "{name}"
            );
        }
    }
}
