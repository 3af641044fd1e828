//! The KV cache group contract (issue 28), run over every implementation (see
//! `contract.rs`): a hybrid-attention model's rank holds each group's blocks apart,
//! and scores the engine's own hybrid hit — the largest `L` such that every
//! full-attention group holds blocks `0..L` and every windowed group (window `w`)
//! holds `max(0, L − w)..L`. Groups are removed from one at a time, cleared together,
//! dumped with their windows, and a block stored again is a copy.

mod common;
mod subject;

use common::{FULL, WINDOW, WINDOWED, a, prompt_a, query};
use common::{batch, chain, cleared, in_group, on_tier, removed, stored, wr};
use kv_events::StorageTier::Cpu;
use kv_events::{KvCacheEvent, KvCacheEventData};
use subject::Subject;

#[tokio::test]
async fn a_hybrid_rank_scores_the_engines_hit_not_the_full_groups_prefix() {
    for mut s in Subject::all() {
        let name = s.name;
        s.apply(batch(1, prompt_a())).await;
        // Worker 2 serves a dense model and holds A's first 9 blocks.
        s.apply(batch(2, vec![stored(0, None, &chain(2000, 9))]))
            .await;
        assert_eq!(
            s.find(&query(11, 11)).await,
            vec![(wr(1, 0), 11), (wr(2, 0), 9)],
            "{name}: A repeated"
        );
        // B shares 8 blocks: the window before 8 (blocks 4..8) is not held.
        assert_eq!(
            s.find(&query(8, 11)).await,
            vec![(wr(2, 0), 8)],
            "{name}: B"
        );
        // 9 shared blocks need 5..9; only 7 and 8 are held.
        assert_eq!(
            s.find(&query(9, 11)).await,
            vec![(wr(2, 0), 9)],
            "{name}: 9 shared"
        );
        // A's first 10 blocks need 6..10: block 6 is not held in the windowed groups
        // (vLLM finds no 4 contiguous cached blocks ending at or before block 9).
        assert!(
            !s.find(&query(10, 10)).await.contains(&(wr(1, 0), 10)),
            "{name}: 10-block prefix"
        );
        // Once the windowed groups hold block 6 too, that prefix is a hit.
        let six: Vec<KvCacheEvent> = WINDOWED
            .iter()
            .map(|g| in_group(stored(0, Some(a(5)), &[(a(6), 6)]), *g, Some(WINDOW)))
            .collect();
        s.apply(batch(1, six)).await;
        assert_eq!(
            s.find(&query(10, 10)).await,
            vec![(wr(1, 0), 10), (wr(2, 0), 9)],
            "{name}: 10-block prefix, window held"
        );
        assert_eq!(
            s.find(&query(9, 11)).await,
            vec![(wr(2, 0), 9)],
            "{name}: 9 shared still needs block 5"
        );
        // Four holders of worker 1 (one per group), one of worker 2; every group's
        // blocks are entries of their own.
        assert_eq!(s.entries_and_ranks().await, (11 + 3 * 5 + 9, 5), "{name}");
        let report = s.report().await;
        assert_eq!(
            report.blocks_per_rank,
            vec![(wr(1, 0), 11), (wr(2, 0), 9)],
            "{name}: a hybrid rank counts its full-attention group"
        );
    }
}

#[tokio::test]
async fn a_removal_applies_to_its_own_group_only() {
    for mut s in Subject::all() {
        let name = s.name;
        s.apply(batch(1, prompt_a())).await;
        // Group 1 evicts block 8: its window before 11 is broken, the other groups'
        // copies of the block stay.
        s.apply(batch(1, vec![in_group(removed(0, &[a(8)]), 1, None)]))
            .await;
        assert!(s.find(&query(11, 11)).await.is_empty(), "{name}");
        assert_eq!(s.entries_and_ranks().await.0, 11 + 3 * 4 - 1, "{name}");
        // Storing it back below group 1's block 7 restores the hit.
        let back = in_group(stored(0, Some(a(7)), &[(a(8), 8)]), 1, Some(WINDOW));
        s.apply(batch(1, vec![back])).await;
        assert_eq!(s.find(&query(11, 11)).await, vec![(wr(1, 0), 11)], "{name}");
        // A removal without a group names the group-less holder, which this rank
        // does not have: nothing changes.
        s.apply(batch(1, vec![removed(0, &[a(8)])])).await;
        assert_eq!(s.find(&query(11, 11)).await, vec![(wr(1, 0), 11)], "{name}");
        // The full group evicting block 10 caps the hit at 10, whose window (6..10)
        // the windowed groups do not hold.
        s.apply(batch(1, vec![in_group(removed(0, &[a(10)]), FULL, None)]))
            .await;
        assert!(s.find(&query(11, 11)).await.is_empty(), "{name}");
        // Cleared drops every group; so does removing the worker.
        s.apply(batch(1, vec![cleared(0)])).await;
        assert_eq!(s.entries_and_ranks().await, (0, 0), "{name}");
        s.apply(batch(1, prompt_a())).await;
        s.remove_worker(1).await;
        assert_eq!(s.entries_and_ranks().await, (0, 0), "{name}");
    }
}

#[tokio::test]
async fn copies_leave_one_removal_at_a_time_per_group() {
    for mut s in Subject::all() {
        let name = s.name;
        s.apply(batch(1, prompt_a())).await;
        // B's junction store repeats block 7 in group 0 (vLLM keeps a second copy).
        let again = in_group(stored(0, Some(a(6)), &[(a(7), 7)]), 0, Some(WINDOW));
        s.apply(batch(1, vec![again])).await;
        s.apply(batch(1, vec![in_group(removed(0, &[a(7)]), 0, None)]))
            .await;
        assert_eq!(
            s.find(&query(11, 11)).await,
            vec![(wr(1, 0), 11)],
            "{name}: a copy of block 7 is left"
        );
        s.apply(batch(1, vec![in_group(removed(0, &[a(7)]), 0, None)]))
            .await;
        assert!(s.find(&query(11, 11)).await.is_empty(), "{name}: both gone");
        // Group 1 was not touched.
        assert_eq!(s.entries_and_ranks().await.0, 11 + 3 * 4 - 1, "{name}");
    }
}

#[tokio::test]
async fn a_groups_window_is_fixed_by_its_first_store() {
    for mut s in Subject::all() {
        let name = s.name;
        s.apply(batch(1, prompt_a())).await;
        let before = (s.dump().await, s.entries_and_ranks().await);
        // Group 0 named with another window (2 blocks, which would accept more).
        let odd = in_group(stored(0, Some(a(10)), &[(a(11), 11)]), 0, Some(2));
        s.apply(batch(1, vec![odd])).await;
        s.abandon_all_recoveries().await;
        assert_eq!(
            (s.dump().await, s.entries_and_ranks().await),
            before,
            "{name}: refused, nothing changed"
        );
        // A full-attention store naming a windowed group is refused the same way.
        let odd = in_group(stored(0, None, &[(a(0), 0)]), 1, None);
        s.apply(batch(1, vec![odd])).await;
        s.abandon_all_recoveries().await;
        assert_eq!(s.entries_and_ranks().await, before.1, "{name}");
    }
}

#[tokio::test]
async fn an_empty_store_makes_a_group_known() {
    for mut s in Subject::all() {
        let name = s.name;
        s.apply(batch(
            3,
            vec![in_group(stored(0, None, &chain(3000, 4)), FULL, None)],
        ))
        .await;
        assert_eq!(s.find(&[0, 1, 2, 3]).await, vec![(wr(3, 0), 4)], "{name}");
        // vLLM's empty sliding-window store (a repeat of an aligned prompt), below the
        // full group's block: the group holds nothing, so no prefix is a hit.
        let empty = in_group(stored(0, Some(3003), &[]), 0, Some(WINDOW));
        s.apply(batch(3, vec![empty])).await;
        assert!(s.find(&[0, 1, 2, 3]).await.is_empty(), "{name}");
        assert_eq!(s.entries_and_ranks().await, (4, 2), "{name}");
        // Once it holds the window before block 4, prefix 4 is a hit again.
        let window = in_group(
            stored(0, Some(3000), &[(3001, 1), (3002, 2), (3003, 3)]),
            0,
            Some(WINDOW),
        );
        s.apply(batch(3, vec![window])).await;
        assert!(
            s.find(&[0, 1, 2, 3]).await.is_empty(),
            "{name}: 0..4 needed"
        );
        let first = in_group(stored(0, None, &[(3000, 0)]), 0, Some(WINDOW));
        s.apply(batch(3, vec![first])).await;
        assert_eq!(s.find(&[0, 1, 2, 3]).await, vec![(wr(3, 0), 4)], "{name}");
    }
}

#[tokio::test]
async fn a_grouped_rank_gets_no_any_tier_score() {
    for mut s in Subject::all() {
        let name = s.name;
        s.apply(batch(1, prompt_a())).await;
        // Its full group also offloaded block 11 to CPU.
        let cpu = on_tier(stored(0, Some(a(10)), &[(a(11), 11)]), Cpu);
        s.apply(batch(1, vec![in_group(cpu, FULL, None)])).await;
        assert_eq!(s.find(&query(12, 12)).await, vec![(wr(1, 0), 11)], "{name}");
        assert!(s.find_any_tier(&query(12, 12)).await.is_empty(), "{name}");
    }
}

#[tokio::test]
async fn a_dump_carries_groups_windows_and_copies() {
    let queries = [query(11, 11), query(10, 10), query(9, 11), query(8, 11)];
    for mut s in Subject::all() {
        let name = s.name;
        s.apply(batch(1, prompt_a())).await;
        let junction: Vec<KvCacheEvent> = WINDOWED
            .iter()
            .map(|g| {
                let blocks: Vec<(u64, u64)> = (4..8).map(|k| (a(k), k)).collect();
                in_group(stored(0, Some(a(3)), &blocks), *g, Some(WINDOW))
            })
            .collect();
        s.apply(batch(1, junction)).await; // block 7 is now held twice per group
        s.apply(batch(
            1,
            vec![in_group(stored(0, None, &chain(1000, 8)), FULL, None)],
        ))
        .await; // blocks 0..8 held twice in the full group
        s.apply(batch(2, vec![in_group(stored(0, None, &[]), 5, Some(1))]))
            .await; // worker 2 knows a group that holds nothing
        let dump = s.dump().await;
        // Windowed chains hang below the full group's blocks: no placeholders.
        let removals = dump
            .iter()
            .flat_map(|b| &b.events)
            .filter(|e| matches!(e.data, KvCacheEventData::Removed { .. }))
            .count();
        assert_eq!(removals, 0, "{name}: {dump:?}");
        let mut copy = s.empty_like();
        for batch in dump.clone() {
            copy.apply(batch).await;
        }
        for q in &queries {
            assert_eq!(copy.find(q).await, s.find(q).await, "{name}: {q:?}");
        }
        assert_eq!(
            s.find(&query(9, 11)).await,
            vec![(wr(1, 0), 9)],
            "{name}: the junction store holds 4..8 in the windowed groups"
        );
        assert_eq!(copy.entries_and_ranks().await, (11 + 3 * 7, 5), "{name}");
        assert_eq!(copy.dump().await, dump, "{name}: same events again");
        // The copies came along: one removal of block 7 from group 0 and of block 2
        // from the full group leaves the hits as they were.
        for subject in [&mut s, &mut copy] {
            subject
                .apply(batch(
                    1,
                    vec![
                        in_group(removed(0, &[a(7)]), 0, None),
                        in_group(removed(0, &[a(2)]), FULL, None),
                    ],
                ))
                .await;
            assert_eq!(
                subject.find(&query(11, 11)).await,
                vec![(wr(1, 0), 11)],
                "{name}"
            );
            assert_eq!(
                subject.find(&query(8, 11)).await,
                vec![(wr(1, 0), 8)],
                "{name}: the window before 8 is held since the junction store"
            );
        }
    }
}
