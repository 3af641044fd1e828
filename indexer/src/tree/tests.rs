//! Unit tests of the radix tree, with an invariant check run after every step.

use super::arena::BlockId;
use super::*;
use crate::error::ApplyError;
use kv_events::{DpRank, ExternalBlockHash, KvCacheEvent};

/// The event builders of the integration tests (`indexer/tests/common`), shared so the
/// unit tests and the integration tests build events one way.
#[path = "../../tests/common/mod.rs"]
pub(crate) mod events;
pub(super) use events::{cleared, q, removed, stored, wr};
use std::collections::{HashMap, HashSet};

/// Applies an event that must succeed, then checks every invariant.
pub(super) fn ok(tree: &mut RadixTree, worker: u64, event: KvCacheEvent) -> ApplyOutcome {
    let outcome = tree
        .apply_event(WorkerId(worker), &event)
        .expect("event applies");
    check_invariants(tree);
    outcome
}

/// Asserts that nodes, holder sets and per-rank maps agree with each other.
pub(super) fn check_invariants(tree: &RadixTree) {
    let live = tree.arena.check();
    assert_eq!(live.len(), tree.num_nodes());
    let held_by_nodes: HashSet<(BlockId, RankIdx)> = live
        .iter()
        .flat_map(|(node, holders)| holders.iter().map(move |r| (*node, *r)))
        .collect();
    let mut held_by_maps: HashMap<(BlockId, RankIdx), u32> = HashMap::new();
    let mut live_entries = 0;
    for (idx, state) in tree.ranks.iter() {
        assert_eq!(tree.ranks.lookup(state.holder()), Some(idx));
        assert!(tree.ranks.holders_of(state.rank).contains(&idx));
        let gpu = state.tier.is_gpu();
        assert_eq!(
            tree.ranks.rank_of(idx),
            (gpu && !state.grouped).then_some(state.rank),
            "dense rank names: GPU holders of ranks without groups only"
        );
        assert_eq!(
            tree.ranks.grouped_name(idx).map(|g| (g.rank, g.window)),
            (gpu && state.grouped).then_some((state.rank, state.window)),
            "grouped names: GPU holders of grouped ranks only"
        );
        let groups: HashSet<_> = (tree.ranks.holders_of(state.rank).iter())
            .filter_map(|i| tree.ranks.get(*i))
            .map(|s| (s.group, s.window))
            .collect();
        let grouped = groups.len() > 1 || groups.iter().any(|(_, w)| w.is_some());
        assert_eq!(state.grouped, grouped, "grouped status of {}", state.rank);
        assert!(
            state.group.is_some() || state.window.is_none(),
            "a window needs a group"
        );
        for (hash, extra) in &state.copies {
            assert!(*extra > 0, "an empty copy count");
            assert!(state.blocks.contains_key(hash), "copies of an unknown hash");
        }
        let mut stale = 0;
        for held in state.blocks.values() {
            if tree.arena.generation(held.id) != held.generation {
                stale += 1;
                continue;
            }
            live_entries += 1;
            *held_by_maps.entry((held.id, idx)).or_insert(0) += 1;
        }
        assert_eq!(
            stale, state.forgotten,
            "forgotten entries of {}",
            state.rank
        );
        for (node, extra) in &state.aliases {
            assert_eq!(
                held_by_maps.get(&(*node, idx)),
                Some(&(extra + 1)),
                "alias count"
            );
        }
    }
    for (key, count) in &held_by_maps {
        if *count > 1 {
            let aliases = &tree.ranks.get(key.1).expect("live rank").aliases;
            assert_eq!(aliases.get(&key.0), Some(&(count - 1)), "alias missing");
        }
    }
    assert_eq!(tree.num_entries(), live_entries, "entry count");
    let from_maps: HashSet<_> = held_by_maps.keys().copied().collect();
    assert_eq!(
        held_by_nodes, from_maps,
        "holder sets disagree with rank maps"
    );
}

/// Extra copies over every holder (live blocks only).
pub(super) fn num_copies(tree: &RadixTree) -> u64 {
    let live = |s: &RankState, hash| {
        s.blocks
            .get(hash)
            .is_some_and(|r| is_live(&tree.arena, s, *r))
    };
    (tree.ranks.iter())
        .flat_map(|(_, s)| s.copies.iter().filter(move |(h, _)| live(s, *h)))
        .map(|(_, n)| u64::from(*n))
        .sum()
}

pub(super) fn scores(tree: &RadixTree, hashes: &[u64]) -> Vec<(WorkerRank, u32)> {
    tree.find_matches(&q(hashes)).sorted()
}

#[test]
fn store_at_root_then_below_a_parent() {
    let mut tree = RadixTree::new();
    let outcome = ok(
        &mut tree,
        1,
        stored(0, None, &[(101, 1), (102, 2), (103, 3)]),
    );
    assert_eq!(
        outcome,
        ApplyOutcome {
            stored: 3,
            ..ApplyOutcome::default()
        }
    );
    ok(&mut tree, 1, stored(0, Some(103), &[(104, 4)]));
    assert_eq!(scores(&tree, &[1, 2, 3, 4]), vec![(wr(1, 0), 4)]);
    assert_eq!(scores(&tree, &[1, 2, 3, 4, 5]), vec![(wr(1, 0), 4)]);
    assert_eq!(scores(&tree, &[1, 2]), vec![(wr(1, 0), 2)]);
    assert_eq!(
        (tree.num_nodes(), tree.num_entries(), tree.num_ranks()),
        (4, 4, 1)
    );
    // A store below block 102 branches off the middle of the chain.
    ok(&mut tree, 1, stored(0, Some(102), &[(205, 5)]));
    assert_eq!(scores(&tree, &[1, 2, 5]), vec![(wr(1, 0), 3)]);
    assert_eq!(tree.num_nodes(), 5);
}

#[test]
fn prefix_scores_across_workers_and_dp_ranks() {
    let mut tree = RadixTree::new();
    ok(
        &mut tree,
        1,
        stored(0, None, &[(11, 1), (12, 2), (13, 3), (14, 4)]),
    );
    ok(&mut tree, 1, stored(1, None, &[(21, 1), (22, 2)]));
    ok(&mut tree, 2, stored(0, None, &[(31, 1), (32, 2), (33, 3)]));
    ok(&mut tree, 2, stored(0, Some(32), &[(35, 5)]));
    ok(&mut tree, 3, stored(0, None, &[(41, 9)]));
    // Shared nodes: blocks 1 and 2 have three holders each.
    assert_eq!(tree.num_nodes(), 6);
    assert_eq!(
        scores(&tree, &[1, 2, 3, 4, 6]),
        vec![(wr(1, 0), 4), (wr(1, 1), 2), (wr(2, 0), 3)]
    );
    assert_eq!(
        scores(&tree, &[1, 2, 5]),
        vec![(wr(1, 0), 2), (wr(1, 1), 2), (wr(2, 0), 3)]
    );
    assert_eq!(scores(&tree, &[9, 1]), vec![(wr(3, 0), 1)]);
    assert!(scores(&tree, &[7, 1, 2]).is_empty());
    assert!(scores(&tree, &[]).is_empty());
    // Block 2 at the root is a different node from block 2 after block 1.
    assert!(scores(&tree, &[2]).is_empty());
}

#[test]
fn removing_a_leaf_prunes_its_node() {
    let mut tree = RadixTree::new();
    ok(&mut tree, 1, stored(0, None, &[(11, 1), (12, 2), (13, 3)]));
    ok(&mut tree, 2, stored(0, None, &[(21, 1), (22, 2)]));
    let outcome = ok(&mut tree, 1, removed(0, &[13]));
    assert_eq!(
        outcome,
        ApplyOutcome {
            removed: 1,
            ..ApplyOutcome::default()
        }
    );
    assert_eq!(
        scores(&tree, &[1, 2, 3]),
        vec![(wr(1, 0), 2), (wr(2, 0), 2)]
    );
    assert_eq!((tree.num_nodes(), tree.num_entries()), (2, 4));
    // Block 2 is still held by worker 2, so removing worker 1's copy keeps the node.
    ok(&mut tree, 1, removed(0, &[12]));
    assert_eq!(tree.num_nodes(), 2);
    assert_eq!(scores(&tree, &[1, 2]), vec![(wr(1, 0), 1), (wr(2, 0), 2)]);
}

#[test]
fn removing_an_interior_block_cuts_the_rank_prefix_there() {
    let mut tree = RadixTree::new();
    ok(
        &mut tree,
        1,
        stored(0, None, &[(11, 1), (12, 2), (13, 3), (14, 4)]),
    );
    ok(
        &mut tree,
        2,
        stored(0, None, &[(21, 1), (22, 2), (23, 3), (24, 4)]),
    );
    ok(&mut tree, 1, removed(0, &[12]));
    assert_eq!(
        scores(&tree, &[1, 2, 3, 4]),
        vec![(wr(1, 0), 1), (wr(2, 0), 4)]
    );
    // Worker 1 still holds blocks 3 and 4 (unreachable for it); nodes stay.
    assert_eq!((tree.num_nodes(), tree.num_entries()), (4, 7));
    ok(&mut tree, 2, removed(0, &[21, 22, 23, 24]));
    assert_eq!(scores(&tree, &[1, 2, 3, 4]), vec![(wr(1, 0), 1)]);
    assert_eq!(
        tree.num_nodes(),
        4,
        "node 2 has no holder but keeps held children"
    );
    // Re-storing the interior block under its old parent makes the tail reachable.
    ok(&mut tree, 1, stored(0, Some(11), &[(12, 2)]));
    assert_eq!(scores(&tree, &[1, 2, 3, 4]), vec![(wr(1, 0), 4)]);
    ok(&mut tree, 1, removed(0, &[14, 13, 12, 11]));
    assert_eq!((tree.num_nodes(), tree.num_entries()), (0, 0));
}

#[test]
fn cleared_drops_one_rank_only() {
    let mut tree = RadixTree::new();
    ok(&mut tree, 1, stored(0, None, &[(11, 1), (12, 2)]));
    ok(&mut tree, 1, stored(1, None, &[(11, 1), (12, 2), (13, 3)]));
    let outcome = ok(&mut tree, 1, cleared(0));
    assert_eq!(outcome.removed, 2);
    assert_eq!(scores(&tree, &[1, 2, 3]), vec![(wr(1, 1), 3)]);
    assert_eq!(
        (tree.num_ranks(), tree.num_entries(), tree.num_nodes()),
        (1, 3, 3)
    );
    assert_eq!(
        ok(&mut tree, 1, cleared(0)),
        ApplyOutcome::default(),
        "clearing twice"
    );
    assert_eq!(tree.clear_rank(wr(1, 1)).removed, 3);
    check_invariants(&tree);
    assert_eq!((tree.num_ranks(), tree.num_nodes()), (0, 0));
}

#[test]
fn unknown_parent_is_rejected_without_change() {
    let mut tree = RadixTree::new();
    ok(&mut tree, 1, stored(0, None, &[(11, 1), (12, 2)]));
    let before = (tree.dump(), tree.stats());
    for (worker, dp) in [(1, 0), (1, 1), (2, 0)] {
        let err = tree
            .apply_event(WorkerId(worker), &stored(dp, Some(99), &[(13, 3), (14, 4)]))
            .unwrap_err();
        let expected = ApplyError::UnknownParent {
            rank: wr(worker, dp),
            parent_hash: ExternalBlockHash(99),
        };
        assert_eq!(err, expected);
        assert_eq!(err.reason(), "unknown_parent");
    }
    // The parent must be held by the same rank: worker 2 cannot continue worker 1.
    assert!(
        tree.apply_event(WorkerId(2), &stored(0, Some(12), &[(13, 3)]))
            .is_err()
    );
    check_invariants(&tree);
    assert_eq!((tree.dump(), tree.stats()), before);
}

/// Issue 28: an engine may hold two physical blocks under one hash; the first
/// removal used to drop the block while its second copy stayed.
#[test]
fn a_store_of_a_held_block_adds_a_copy_that_one_remove_drops() {
    let mut tree = RadixTree::new();
    ok(&mut tree, 1, stored(0, None, &[(11, 1), (12, 2)]));
    let outcome = ok(&mut tree, 1, stored(0, None, &[(11, 1), (12, 2)]));
    assert_eq!(
        outcome,
        ApplyOutcome {
            copies_added: 2,
            ..ApplyOutcome::default()
        }
    );
    assert_eq!((tree.num_nodes(), tree.num_entries()), (2, 2));
    // A longer chain over held blocks adds copies and the new tail below them.
    let outcome = ok(&mut tree, 1, stored(0, None, &[(11, 1), (12, 2), (13, 3)]));
    assert_eq!(
        outcome,
        ApplyOutcome {
            stored: 1,
            copies_added: 2,
            ..Default::default()
        }
    );
    assert_eq!(scores(&tree, &[1, 2, 3]), vec![(wr(1, 0), 3)]);
    assert_eq!(tree.num_entries(), 3);
    // Block 12 is held three times: two removes drop copies, the third the block.
    for _ in 0..2 {
        let outcome = ok(&mut tree, 1, removed(0, &[12]));
        assert_eq!((outcome.removed, outcome.copies_removed), (0, 1));
        assert_eq!(scores(&tree, &[1, 2, 3]), vec![(wr(1, 0), 3)]);
    }
    let outcome = ok(&mut tree, 1, removed(0, &[12]));
    assert_eq!((outcome.removed, outcome.copies_removed), (1, 0));
    assert_eq!(scores(&tree, &[1, 2, 3]), vec![(wr(1, 0), 1)]);
    // Clearing drops the last copies of block 11 with it.
    let outcome = ok(&mut tree, 1, cleared(0));
    assert_eq!((outcome.removed, outcome.copies_removed), (2, 2));
}

#[test]
fn same_content_under_two_engine_hashes_stays_held_until_both_go() {
    let mut tree = RadixTree::new();
    ok(&mut tree, 1, stored(0, None, &[(11, 1), (12, 2)]));
    ok(&mut tree, 1, stored(0, Some(11), &[(92, 2)]));
    assert_eq!((tree.num_nodes(), tree.num_entries()), (2, 3));
    ok(&mut tree, 1, removed(0, &[12]));
    assert_eq!(scores(&tree, &[1, 2]), vec![(wr(1, 0), 2)]);
    ok(&mut tree, 1, removed(0, &[92]));
    assert_eq!(scores(&tree, &[1, 2]), vec![(wr(1, 0), 1)]);
    assert_eq!(tree.num_nodes(), 1);
}

#[test]
fn removing_unknown_blocks_is_a_counted_no_op() {
    let mut tree = RadixTree::new();
    ok(&mut tree, 1, stored(0, None, &[(11, 1)]));
    let outcome = ok(&mut tree, 1, removed(0, &[55, 11, 11]));
    assert_eq!(
        outcome,
        ApplyOutcome {
            removed: 1,
            unknown_removed: 2,
            ..Default::default()
        }
    );
    let outcome = ok(&mut tree, 7, removed(3, &[1, 2]));
    assert_eq!(
        outcome,
        ApplyOutcome {
            unknown_removed: 2,
            ..Default::default()
        }
    );
    assert_eq!(
        tree.num_ranks(),
        1,
        "an unknown rank is not interned by a remove"
    );
}

#[test]
fn remove_worker_drops_all_its_ranks() {
    let mut tree = RadixTree::new();
    ok(&mut tree, 1, stored(0, None, &[(11, 1), (12, 2)]));
    ok(&mut tree, 1, stored(3, None, &[(11, 1), (15, 5)]));
    ok(&mut tree, 2, stored(0, None, &[(21, 1), (22, 2)]));
    let outcome = tree.remove_worker(WorkerId(1));
    check_invariants(&tree);
    assert_eq!(outcome.removed, 4);
    assert_eq!(scores(&tree, &[1, 2]), vec![(wr(2, 0), 2)]);
    assert_eq!(scores(&tree, &[1, 5]), vec![(wr(2, 0), 1)]);
    assert_eq!(tree.blocks_per_rank(), vec![(wr(2, 0), 2)]);
    assert_eq!(tree.num_nodes(), 2);
    assert_eq!(tree.remove_worker(WorkerId(1)), ApplyOutcome::default());
}

#[test]
fn freed_slots_are_reused() {
    let mut tree = RadixTree::new();
    let chain: Vec<(u64, u64)> = (0..10).map(|i| (100 + i, i)).collect();
    ok(&mut tree, 1, stored(0, None, &chain));
    assert_eq!(tree.num_nodes(), 10);
    let slots = tree.arena.slots();
    let all: Vec<u64> = chain.iter().map(|(e, _)| *e).collect();
    ok(&mut tree, 1, removed(0, &all));
    assert_eq!(tree.num_nodes(), 0);
    let other: Vec<(u64, u64)> = (0..10).map(|i| (200 + i, 50 + i)).collect();
    ok(&mut tree, 2, stored(0, None, &other));
    assert_eq!(tree.num_nodes(), 10);
    assert_eq!(
        tree.arena.slots(),
        slots,
        "the second chain reused the freed slots"
    );
}

#[test]
fn wide_nodes_switch_child_maps_and_back() {
    let mut tree = RadixTree::new();
    for i in 0..40u64 {
        ok(&mut tree, 1, stored(0, None, &[(1000 + i, i)]));
    }
    for i in 0..40u64 {
        assert_eq!(scores(&tree, &[i]), vec![(wr(1, 0), 1)]);
    }
    for i in 0..38u64 {
        ok(&mut tree, 1, removed(0, &[1000 + i]));
    }
    assert_eq!(scores(&tree, &[39]), vec![(wr(1, 0), 1)]);
    assert!(scores(&tree, &[3]).is_empty());
    assert_eq!(tree.num_nodes(), 2);
}

#[test]
fn memory_grows_with_entries_and_stats_agree() {
    let mut tree = RadixTree::new();
    let empty = tree.memory_bytes();
    for worker in 0..8u64 {
        let chain: Vec<(u64, u64)> = (0..64).map(|i| (worker * 1000 + i, i)).collect();
        ok(&mut tree, worker, stored(0, None, &chain));
    }
    let stats = tree.stats();
    assert_eq!((stats.nodes, stats.entries, stats.ranks), (64, 512, 8));
    assert!(
        stats.memory_bytes > empty + 512 * 4,
        "holder slots alone are 4 bytes each"
    );
    assert_eq!(stats.memory_bytes, tree.memory_bytes());
}

#[test]
fn dump_rebuilds_the_same_matches() {
    let mut tree = RadixTree::new();
    ok(
        &mut tree,
        1,
        stored(0, None, &[(11, 1), (12, 2), (13, 3), (14, 4)]),
    );
    ok(&mut tree, 1, stored(0, Some(12), &[(15, 5), (16, 6)]));
    ok(&mut tree, 1, stored(0, Some(11), &[(92, 2)])); // alias of block 12
    ok(&mut tree, 1, stored(2, None, &[(21, 1), (22, 7)]));
    ok(&mut tree, 3, stored(0, None, &[(31, 8), (32, 9), (33, 10)]));
    ok(&mut tree, 3, removed(0, &[32])); // block 33 is now unreachable for 3/0
    let dump = tree.dump();
    assert_eq!(
        dump.iter().map(|b| b.worker_id.0).collect::<Vec<_>>(),
        vec![1, 3]
    );
    for batch in &dump {
        let mut next: HashMap<DpRank, u64> = HashMap::new();
        for event in &batch.events {
            let id = next.entry(event.dp_rank).or_insert(0);
            assert_eq!(event.event_id, *id, "event ids count from 0 per rank");
            *id += 1;
        }
    }
    let mut rebuilt = RadixTree::new();
    for batch in &dump {
        for event in &batch.events {
            rebuilt
                .apply_event(batch.worker_id, event)
                .expect("dump applies cleanly");
        }
    }
    check_invariants(&rebuilt);
    let queries: [&[u64]; 7] = [
        &[1, 2, 3, 4],
        &[1, 2, 5, 6],
        &[1, 7],
        &[8, 9, 10],
        &[8],
        &[2],
        &[1, 2, 3, 4, 9],
    ];
    for query in queries {
        assert_eq!(
            scores(&rebuilt, query),
            scores(&tree, query),
            "query {query:?}"
        );
    }
    assert_eq!(
        rebuilt.num_entries(),
        tree.num_entries(),
        "the orphan below the removed block is kept too"
    );
    // Storing the removed block again reconnects the orphan in both trees.
    for t in [&mut tree, &mut rebuilt] {
        ok(t, 3, stored(0, Some(31), &[(32, 9)]));
        assert_eq!(scores(t, &[8, 9, 10]), vec![(wr(3, 0), 3)]);
    }
    assert_eq!(
        rebuilt.dump(),
        tree.dump(),
        "a dump of the rebuilt tree is identical"
    );
}
