//! Unit tests of path compression: how runs extend, split and merge back, with the
//! invariant check (`tests::check_invariants`) after every step.

use super::tests::{check_invariants, ok, removed, scores, stored, wr};
use super::*;

/// `(engine hash, local hash)` pairs for local hashes `locals`, engine hashes salted
/// by `salt` (as an engine salting per worker would publish them).
fn chain(salt: u64, locals: std::ops::Range<u64>) -> Vec<(u64, u64)> {
    locals.map(|l| (salt * 1_000_000 + l, l)).collect()
}

#[test]
fn a_chain_appended_by_one_rank_is_one_run() {
    let mut tree = RadixTree::new();
    ok(&mut tree, 1, stored(0, None, &chain(1, 0..16)));
    for piece in 1..6 {
        let parent = 1_000_000 + piece * 16 - 1;
        let blocks = chain(1, piece * 16..(piece + 1) * 16);
        ok(&mut tree, 1, stored(0, Some(parent), &blocks));
    }
    assert_eq!((tree.num_runs(), tree.num_nodes()), (1, 96));
    let all: Vec<u64> = (0..96).collect();
    assert_eq!(scores(&tree, &all), vec![(wr(1, 0), 96)]);
    // A query leaving the run in its middle, or ending there, stops there.
    let mut off = all.clone();
    off[40] = 999;
    assert_eq!(scores(&tree, &off), vec![(wr(1, 0), 40)]);
    assert_eq!(scores(&tree, &all[..7]), vec![(wr(1, 0), 7)]);
    // Removing the tail shortens the run in place.
    ok(&mut tree, 1, removed(0, &[1_000_095, 1_000_094]));
    assert_eq!((tree.num_runs(), tree.num_nodes()), (1, 94));
    assert_eq!(scores(&tree, &all), vec![(wr(1, 0), 94)]);
}

#[test]
fn a_branch_off_the_middle_of_a_run_splits_it() {
    let mut tree = RadixTree::new();
    ok(&mut tree, 1, stored(0, None, &chain(1, 0..8)));
    ok(
        &mut tree,
        1,
        stored(0, Some(1_000_003), &[(77, 50), (78, 51)]),
    );
    assert_eq!((tree.num_runs(), tree.num_nodes()), (3, 10));
    assert_eq!(scores(&tree, &[0, 1, 2, 3, 50, 51]), vec![(wr(1, 0), 6)]);
    assert_eq!(
        scores(&tree, &[0, 1, 2, 3, 4, 5, 6, 7]),
        vec![(wr(1, 0), 8)]
    );
    // Another rank extends the branch: the branch's run is not the storing rank's
    // alone, so it gets a run of its own below.
    ok(&mut tree, 2, stored(0, None, &chain(2, 0..4)));
    ok(
        &mut tree,
        2,
        stored(0, Some(2_000_003), &[(88, 50), (89, 51), (90, 52)]),
    );
    assert_eq!(
        scores(&tree, &[0, 1, 2, 3, 50, 51, 52]),
        vec![(wr(1, 0), 6), (wr(2, 0), 7)]
    );
    // Removing the branch merges the head and the rest of the chain back into one
    // run for rank 1 (rank 2 holds the head too, so it stays a run of its own).
    ok(&mut tree, 1, removed(0, &[78, 77]));
    ok(&mut tree, 2, removed(0, &[90, 89, 88]));
    ok(
        &mut tree,
        2,
        removed(0, &[2_000_003, 2_000_002, 2_000_001, 2_000_000]),
    );
    assert_eq!((tree.num_runs(), tree.num_nodes()), (1, 8));
}

#[test]
fn a_second_holder_over_part_of_a_run_splits_it_and_merges_back_when_it_holds_all() {
    let mut tree = RadixTree::new();
    ok(&mut tree, 1, stored(0, None, &chain(1, 0..8)));
    // Worker 2 (salted engine hashes) stores the same content in two pieces.
    ok(&mut tree, 2, stored(0, None, &chain(2, 0..5)));
    assert_eq!(tree.num_runs(), 2);
    let all: Vec<u64> = (0..8).collect();
    assert_eq!(scores(&tree, &all), vec![(wr(1, 0), 8), (wr(2, 0), 5)]);
    ok(&mut tree, 2, stored(0, Some(2_000_004), &chain(2, 5..8)));
    assert_eq!(
        (tree.num_runs(), tree.num_nodes(), tree.num_entries()),
        (1, 8, 16)
    );
    assert_eq!(scores(&tree, &all), vec![(wr(1, 0), 8), (wr(2, 0), 8)]);
    // A piece in the middle held by a third rank: split in three, then merged back
    // when the third rank leaves.
    ok(&mut tree, 3, stored(0, None, &chain(3, 0..3)));
    ok(&mut tree, 3, stored(0, None, &chain(3, 0..6)));
    assert_eq!(tree.num_runs(), 2);
    assert_eq!(
        scores(&tree, &all),
        vec![(wr(1, 0), 8), (wr(2, 0), 8), (wr(3, 0), 6)]
    );
    assert_eq!(tree.clear_rank(wr(3, 0)).removed, 6);
    check_invariants(&tree);
    assert_eq!(tree.num_runs(), 1);
}

#[test]
fn removing_a_block_in_the_middle_of_a_run_splits_it_in_three() {
    let mut tree = RadixTree::new();
    ok(&mut tree, 1, stored(0, None, &chain(1, 0..8)));
    ok(&mut tree, 2, stored(0, None, &chain(2, 0..8)));
    ok(&mut tree, 1, removed(0, &[1_000_004]));
    assert_eq!((tree.num_runs(), tree.num_nodes()), (3, 8));
    let all: Vec<u64> = (0..8).collect();
    assert_eq!(scores(&tree, &all), vec![(wr(1, 0), 4), (wr(2, 0), 8)]);
    // The only holder of a block in the middle removes it: the block stays, held by
    // nobody, because blocks below it are still held.
    ok(&mut tree, 2, removed(0, &[2_000_004]));
    assert_eq!((tree.num_runs(), tree.num_nodes()), (3, 8));
    assert_eq!(scores(&tree, &all), vec![(wr(1, 0), 4), (wr(2, 0), 4)]);
    // Stored again under its engine hash: the run is whole again.
    ok(&mut tree, 1, stored(0, Some(1_000_003), &[(1_000_004, 4)]));
    ok(&mut tree, 2, stored(0, Some(2_000_003), &[(2_000_004, 4)]));
    assert_eq!((tree.num_runs(), tree.num_nodes()), (1, 8));
    assert_eq!(scores(&tree, &all), vec![(wr(1, 0), 8), (wr(2, 0), 8)]);
    // Removed from the head by one holder, one block at a time.
    for l in 0..8 {
        ok(&mut tree, 1, removed(0, &[1_000_000 + l]));
    }
    assert_eq!(tree.num_runs(), 1);
    assert_eq!(scores(&tree, &all), vec![(wr(2, 0), 8)]);
}

/// A store that jumps back to a block it already holds and continues into blocks it
/// has just been found to hold (not yet added to their run) counts them as aliases.
#[test]
fn a_store_revisiting_its_own_pending_blocks_aliases_them() {
    let mut tree = RadixTree::new();
    let first: Vec<(u64, u64)> = (1..5).map(|l| (10 + l, l)).collect();
    ok(&mut tree, 1, stored(0, None, &first));
    let out = ok(
        &mut tree,
        2,
        stored(0, None, &[(21, 1), (22, 2), (21, 1), (24, 2), (25, 3)]),
    );
    assert_eq!((out.stored, out.copies_added), (4, 1));
    assert_eq!(
        scores(&tree, &[1, 2, 3, 4]),
        vec![(wr(1, 0), 4), (wr(2, 0), 3)]
    );
    ok(&mut tree, 2, removed(0, &[22]));
    assert_eq!(
        scores(&tree, &[1, 2, 3]),
        vec![(wr(1, 0), 3), (wr(2, 0), 3)]
    );
    ok(&mut tree, 2, removed(0, &[24]));
    assert_eq!(
        scores(&tree, &[1, 2, 3]),
        vec![(wr(1, 0), 3), (wr(2, 0), 1)]
    );
}

#[test]
fn salted_engine_hashes_share_runs_and_stay_apart_in_rank_maps() {
    let mut tree = RadixTree::new();
    for w in 1..=4 {
        ok(&mut tree, w, stored(0, None, &chain(w, 0..32)));
        ok(
            &mut tree,
            w,
            stored(
                0,
                Some(w * 1_000_000 + 31),
                &chain(w, 100 + w * 10..100 + w * 10 + 5),
            ),
        );
    }
    // One shared run of 32 and four private runs of 5.
    assert_eq!(
        (tree.num_runs(), tree.num_nodes(), tree.num_entries()),
        (5, 52, 148)
    );
    let mut query: Vec<u64> = (0..32).collect();
    query.extend(120..125);
    // Worker 2 holds its private tail too; worker 3 scores `third`.
    let expected = |third| {
        let s = [32, 37, third, 32];
        (1..=4)
            .map(|w| (wr(w, 0), s[w as usize - 1]))
            .collect::<Vec<_>>()
    };
    assert_eq!(scores(&tree, &query), expected(32));
    // Worker 3 removes block 10 by its own engine hash: only worker 3 is cut.
    ok(&mut tree, 3, removed(0, &[3_000_010]));
    assert_eq!(scores(&tree, &query), expected(10));
    // Worker 1's engine hash means nothing to worker 2.
    let out = ok(&mut tree, 2, removed(0, &[1_000_005]));
    assert_eq!(out.unknown_removed, 1);
    let mut rebuilt = RadixTree::new();
    for batch in tree.dump() {
        for event in &batch.events {
            rebuilt
                .apply_event(batch.worker_id, event)
                .expect("dump applies");
        }
    }
    check_invariants(&rebuilt);
    assert_eq!(scores(&rebuilt, &query), scores(&tree, &query));
    assert_eq!(rebuilt.num_entries(), tree.num_entries());
    assert_eq!(rebuilt.dump(), tree.dump());
}

/// A `Removed` naming a whole piece of a run (in any order) changes the run once:
/// the flood of store-then-remove chains leaves no runs behind, and a piece removed
/// from the middle of a shared run splits it in three, not once per block.
#[test]
fn a_removed_event_drops_each_piece_of_a_run_at_once() {
    let mut tree = RadixTree::new();
    ok(&mut tree, 1, stored(0, None, &chain(1, 0..16)));
    let head_first: Vec<u64> = (0..16).map(|l| 1_000_000 + l).collect();
    ok(&mut tree, 1, removed(0, &head_first));
    assert_eq!(
        (tree.num_runs(), tree.num_nodes(), tree.num_entries()),
        (0, 0, 0)
    );
    ok(&mut tree, 1, stored(0, None, &chain(1, 0..16)));
    ok(&mut tree, 2, stored(0, None, &chain(2, 0..16)));
    let middle = [1_000_009, 1_000_005, 1_000_007, 1_000_006, 1_000_008];
    ok(&mut tree, 1, removed(0, &middle));
    assert_eq!((tree.num_runs(), tree.num_nodes()), (3, 16));
    let all: Vec<u64> = (0..16).collect();
    assert_eq!(scores(&tree, &all), vec![(wr(1, 0), 5), (wr(2, 0), 16)]);
    // Two pieces of one run in one event, with a block of another rank's run.
    let two = [1_000_001, 1_000_002, 1_000_012, 1_000_013, 2_000_015];
    ok(&mut tree, 1, removed(0, &[two[0], two[1], two[2], two[3]]));
    ok(&mut tree, 2, removed(0, &[two[4]]));
    assert_eq!(scores(&tree, &all), vec![(wr(1, 0), 1), (wr(2, 0), 15)]);
}
