//! Differential property test: the radix tree against a naive reference model
//! (`tree/differential_model.rs`).
//!
//! Random stores (at the root, below a held block, below an unknown block), removes
//! (held and unknown), clears and worker removals run against both, each store and
//! remove on a random storage tier (a lower-tier chain may hang below a parent the
//! rank holds on another tier). Hybrid streams add KV cache groups: full attention
//! and windows of 1–4 blocks, drawn per case, now and then a store naming another
//! window (refused by both); *mirror* stores that copy part of a path the rank holds
//! into a group, below another group's block (a windowed group's sparse store); and
//! stores of held blocks (copies) removed one copy at a time, per group. After every
//! step the tree's invariants are checked and its answers (GPU overlap with the
//! hybrid hit of grouped ranks, any-tier overlap, entries, nodes, holders, copies,
//! blocks per rank) compared for every held prefix and one-block extensions of them.
//! At the end, the tree's dump is replayed into a fresh tree, which must answer the
//! same and hold every entry and copy (including those below a removed block).

use super::differential_model::{Key, Reference, Refusal};
use super::tests::check_invariants;
use super::tests::events::{engine_hash, on_tier};
use super::*;
use crate::error::ApplyError;
use kv_events::{DpRank, KvCacheGroup, StorageTier};
use kv_events::{KvCacheEvent, KvCacheEventData};
use proptest::prelude::*;
use proptest::sample::Index;
use std::num::NonZeroU32;

#[derive(Debug, Clone)]
enum Parent {
    Root,
    Held(Index),
    Unknown,
}

/// The group an event names: none, one of the case's three groups (with its
/// window), or one of them with some window (a mismatch unless it happens to agree).
#[derive(Debug, Clone, Copy)]
enum Group {
    None,
    Id(u32),
    Odd(u32, u32),
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        worker: u64,
        dp: u32,
        tier: StorageTier,
        group: Group,
        parent: Parent,
        chain: Vec<(u64, u8)>,
    },
    /// Stores blocks `from..` of the path of a block the rank holds into `group`,
    /// below the block before them (held by some holder of the rank).
    Mirror {
        worker: u64,
        dp: u32,
        tier: StorageTier,
        group: Group,
        pick: Index,
        from: Index,
    },
    Remove {
        worker: u64,
        dp: u32,
        tier: StorageTier,
        group: Group,
        picks: Vec<Index>,
        unknown: bool,
    },
    Clear {
        worker: u64,
        dp: u32,
    },
    RemoveWorker {
        worker: u64,
    },
}

/// One random case: the windows of groups 0..3 and the operations.
#[derive(Debug, Clone)]
struct Case {
    windows: [Option<u32>; 3],
    ops: Vec<Op>,
}

fn tier() -> impl Strategy<Value = StorageTier> {
    prop_oneof![
        4 => Just(StorageTier::Gpu),
        2 => Just(StorageTier::Cpu),
        1 => Just(StorageTier::Disk),
    ]
}

/// Operations; with `hybrid`, on KV cache groups and mostly on the GPU.
fn op(hybrid: bool) -> impl Strategy<Value = Op> {
    let parent = prop_oneof![
        2 => Just(Parent::Root),
        5 => any::<Index>().prop_map(Parent::Held),
        1 => Just(Parent::Unknown),
    ];
    let chain = prop::collection::vec((0u64..4, prop_oneof![6 => Just(0u8), 1 => Just(1u8)]), 0..5);
    let group = move || -> BoxedStrategy<Group> {
        if hybrid {
            prop_oneof![
                2 => Just(Group::None),
                12 => (0u32..3).prop_map(Group::Id),
                1 => (0u32..3, 1u32..5).prop_map(|(id, w)| Group::Odd(id, w)),
            ]
            .boxed()
        } else {
            Just(Group::None).boxed()
        }
    };
    let tier = move || -> BoxedStrategy<StorageTier> {
        if hybrid {
            prop_oneof![8 => Just(StorageTier::Gpu), 1 => Just(StorageTier::Cpu)].boxed()
        } else {
            tier().boxed()
        }
    };
    let mirror = if hybrid { 6 } else { 1 };
    prop_oneof![
        8 => (0u64..3, 0u32..2, tier(), group(), parent, chain)
            .prop_map(|(worker, dp, tier, group, parent, chain)| Op::Store { worker, dp, tier, group, parent, chain }),
        mirror => (0u64..3, 0u32..2, tier(), group(), any::<Index>(), any::<Index>())
            .prop_map(|(worker, dp, tier, group, pick, from)| Op::Mirror { worker, dp, tier, group, pick, from }),
        4 => (0u64..3, 0u32..2, tier(), group(), prop::collection::vec(any::<Index>(), 1..4), any::<bool>())
            .prop_map(|(worker, dp, tier, group, picks, unknown)| Op::Remove { worker, dp, tier, group, picks, unknown }),
        1 => (0u64..3, 0u32..2).prop_map(|(worker, dp)| Op::Clear { worker, dp }),
        1 => (0u64..3).prop_map(|worker| Op::RemoveWorker { worker }),
    ]
}

fn case(hybrid: bool, ops: usize) -> impl Strategy<Value = Case> {
    let window = prop_oneof![Just(None), (1u32..5).prop_map(Some)];
    (
        prop::array::uniform3(window),
        prop::collection::vec(op(hybrid), 1..ops),
    )
        .prop_map(|(windows, ops)| Case { windows, ops })
}

impl Case {
    /// The group id and window an event names.
    fn group(&self, group: Group) -> (Option<u32>, Option<u32>) {
        match group {
            Group::None => (None, None),
            Group::Id(id) => (Some(id), self.windows[id as usize]),
            Group::Odd(id, w) => (Some(id), Some(w)),
        }
    }
}

/// `event` (a `Stored` or `Removed`) in `group` (with `window`, for a store).
fn in_group(mut event: KvCacheEvent, id: Option<u32>, window: Option<u32>) -> KvCacheEvent {
    match &mut event.data {
        KvCacheEventData::Stored { group, .. } => {
            *group = id.map(|id| KvCacheGroup {
                id: kv_events::GroupId(id),
                window_blocks: window.and_then(NonZeroU32::new),
            });
        }
        KvCacheEventData::Removed { group, .. } => *group = id.map(kv_events::GroupId),
        KvCacheEventData::Cleared => {}
    }
    event
}

/// The store a mirror op makes, if the rank holds anything to mirror: (parent,
/// chain of (engine hash, local hash)).
type Mirrored = (Option<u64>, Vec<(u64, u64)>);

fn mirror(model: &Reference, rank: WorkerRank, pick: &Index, from: &Index) -> Option<Mirrored> {
    let held = model.held_anywhere(rank);
    if held.is_empty() {
        return None;
    }
    let path = model.path_anywhere(rank, *pick.get(&held))?.clone();
    let start = from.index(path.len());
    let parent = match start {
        0 => None,
        k => Some(model.hash_at(rank, &path[..k])?),
    };
    let mut prev = parent;
    let chain = (start..path.len())
        .map(|k| {
            let ext = model
                .hash_at(rank, &path[..=k])
                .unwrap_or_else(|| engine_hash(prev, path[k], 0));
            prev = Some(ext);
            (ext, path[k])
        })
        .collect();
    Some((parent, chain))
}

/// A store to make: (worker, dp, tier, group, parent, chain of (engine, local)).
type StoreArgs = (u64, u32, StorageTier, Group, Option<u64>, Vec<(u64, u64)>);

/// The store `op` makes, if it is one.
fn store_of(model: &Reference, op: &Op) -> Option<StoreArgs> {
    match op {
        Op::Store {
            worker,
            dp,
            tier,
            group,
            parent,
            chain,
        } => {
            let rank = WorkerRank::new(WorkerId(*worker), DpRank(*dp));
            let held = model.held_anywhere(rank);
            let parent_hash = match parent {
                Parent::Root => None,
                Parent::Held(i) if !held.is_empty() => Some(*i.get(&held)),
                Parent::Held(_) => None,
                Parent::Unknown => Some(u64::MAX),
            };
            let mut prev = parent_hash;
            let blocks: Vec<(u64, u64)> = chain
                .iter()
                .map(|(local, salt)| {
                    let ext = engine_hash(prev, *local, *salt);
                    prev = Some(ext);
                    (ext, *local)
                })
                .collect();
            Some((*worker, *dp, *tier, *group, parent_hash, blocks))
        }
        Op::Mirror {
            worker,
            dp,
            tier,
            group,
            pick,
            from,
        } => {
            let rank = WorkerRank::new(WorkerId(*worker), DpRank(*dp));
            let (parent, blocks) = mirror(model, rank, pick, from)?;
            Some((*worker, *dp, *tier, *group, parent, blocks))
        }
        _ => None,
    }
}

/// Applies `event` to `tree` in parts of `part` blocks, as the concurrent front
/// does when queries wait at every check; the outcomes summed.
fn apply_in_parts(
    tree: &mut RadixTree,
    worker: u64,
    event: &KvCacheEvent,
    part: usize,
) -> Result<ApplyOutcome, ApplyError> {
    let interrupt = Interrupt {
        every: part,
        stop: &|| true,
    };
    let len = event.data.block_count();
    let mut progress = Progress::default();
    let mut total = ApplyOutcome::default();
    let mut parts = 0;
    while !progress.is_done() {
        total += tree.apply_event_from(WorkerId(worker), event, &mut progress, interrupt)?;
        parts += 1;
        // A removal's lookups, then at most one part per block dropped.
        assert!(
            parts <= 2 * len + 1,
            "{parts} parts of {part} blocks for {len}"
        );
    }
    if let KvCacheEventData::Stored { .. } = event.data {
        assert_eq!(parts, len.div_ceil(part).max(1), "parts of {part} blocks");
    }
    Ok(total)
}

/// Applies `op` to `tree` and `model` (asserting they agree on acceptance) and, when
/// given, to `bounded` too (whose answers may differ: it forgets) and to `parted`,
/// each event in parts of the given size (which must answer as `tree`).
fn run(
    tree: &mut RadixTree,
    model: &mut Reference,
    case: &Case,
    op: &Op,
    mut bounded: Option<&mut RadixTree>,
    mut parted: Option<(&mut RadixTree, usize)>,
) {
    let mut mirror_to =
        |worker: u64, event: &KvCacheEvent, whole: &Result<ApplyOutcome, ApplyError>| {
            if let Some(b) = bounded.as_deref_mut() {
                let _ = b.apply_event(WorkerId(worker), event);
            }
            if let Some((p, part)) = parted.as_mut() {
                let got = apply_in_parts(p, worker, event, *part);
                assert_eq!(&got, whole, "in parts of {part}: {event:?}");
            }
        };
    if let Some((worker, dp, tier, group, parent, blocks)) = store_of(model, op) {
        let rank = WorkerRank::new(WorkerId(worker), DpRank(dp));
        let (id, window) = case.group(group);
        let key: Key = (rank, tier, id);
        let expected = model.store(key, window, parent, &blocks);
        let event = on_tier(super::tests::stored(dp, parent, &blocks), tier);
        let event = in_group(event, id, window);
        let got = tree.apply_event(WorkerId(worker), &event);
        mirror_to(worker, &event, &got);
        match (&expected, &got) {
            (Ok(()), Ok(_))
            | (Err(Refusal::UnknownParent), Err(ApplyError::UnknownParent { .. }))
            | (Err(Refusal::WindowMismatch), Err(ApplyError::WindowMismatch { .. })) => {}
            _ => panic!("model {expected:?}, tree {got:?} for {event:?}"),
        }
        return;
    }
    match op {
        Op::Store { .. } | Op::Mirror { .. } => {} // a mirror of nothing
        Op::Remove {
            worker,
            dp,
            tier,
            group,
            picks,
            unknown,
        } => {
            let rank = WorkerRank::new(WorkerId(*worker), DpRank(*dp));
            let (id, _) = case.group(*group);
            let key: Key = (rank, *tier, id);
            let held = model.held_on(&key);
            let mut hashes: Vec<u64> = if held.is_empty() {
                Vec::new()
            } else {
                picks.iter().map(|i| *i.get(&held)).collect()
            };
            if *unknown {
                hashes.push(u64::MAX - 1);
            }
            model.remove(&key, &hashes);
            let event = on_tier(super::tests::removed(*dp, &hashes), *tier);
            let event = in_group(event, id, None);
            let got = tree.apply_event(WorkerId(*worker), &event);
            assert!(got.is_ok());
            mirror_to(*worker, &event, &got);
        }
        Op::Clear { worker, dp } => {
            let rank = WorkerRank::new(WorkerId(*worker), DpRank(*dp));
            model.clear(rank);
            let got = Ok(tree.clear_rank(rank));
            mirror_to(*worker, &super::tests::cleared(*dp), &got);
        }
        Op::RemoveWorker { worker } => {
            model.remove_worker(WorkerId(*worker));
            tree.remove_worker(WorkerId(*worker));
            if let Some(b) = bounded {
                b.remove_worker(WorkerId(*worker));
            }
            if let Some((p, _)) = parted {
                p.remove_worker(WorkerId(*worker));
            }
        }
    }
}

fn assert_same_answers(tree: &RadixTree, model: &Reference) {
    for query in model.queries() {
        let got = tree.find_matches(&super::tests::q(&query));
        assert_eq!(got.sorted(), model.find_matches(&query), "query {query:?}");
        let mut any: Vec<(WorkerRank, u32)> = got.any_tier.into_iter().collect();
        any.sort_unstable();
        assert_eq!(
            any,
            model.find_any_tier(&query),
            "any tier, query {query:?}"
        );
    }
    assert_eq!(tree.num_entries(), model.num_entries(), "entries");
    assert_eq!(tree.num_nodes(), model.num_nodes(), "nodes");
    assert_eq!(super::tests::num_copies(tree), model.num_copies(), "copies");
}

/// Runs a case against the model, and a second tree applying each event in parts
/// of `part` blocks; then replays the tree's dump into a fresh tree.
fn check_case(case: &Case, part: usize) {
    let mut tree = RadixTree::new();
    let mut parted = RadixTree::new();
    let mut model = Reference::default();
    for op in &case.ops {
        run(
            &mut tree,
            &mut model,
            case,
            op,
            None,
            Some((&mut parted, part)),
        );
        check_invariants(&tree);
        check_invariants(&parted);
        assert_same_answers(&tree, &model);
        assert_same_answers(&parted, &model);
        assert_eq!(tree.num_ranks(), model.holders.len(), "holders");
        assert_eq!(tree.blocks_per_rank(), model.blocks_per_rank());
    }
    let mut rebuilt = RadixTree::new();
    for batch in tree.dump() {
        for event in &batch.events {
            let applied = rebuilt.apply_event(batch.worker_id, event);
            assert!(applied.is_ok(), "{event:?}: {applied:?}");
        }
    }
    check_invariants(&rebuilt);
    assert_same_answers(&rebuilt, &model);
    // Holders that hold nothing are dumped only where they change answers (groups).
    let held = |t: &RadixTree| {
        let mut b = t.blocks_per_rank();
        b.retain(|(_, n)| *n > 0);
        b
    };
    assert_eq!(held(&rebuilt), held(&tree));
    assert_eq!(rebuilt.dump(), tree.dump());
    assert_eq!(parted.dump(), tree.dump());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn tree_matches_the_reference_model(case in case(false, 60), part in 1usize..4) {
        check_case(&case, part);
    }

    /// Issue 28: KV cache groups (windows, sparse stores below another group's
    /// blocks), copies and per-group removals.
    #[test]
    fn hybrid_streams_match_the_reference_model(case in case(true, 60), part in 1usize..4) {
        check_case(&case, part);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A bounded tree stays under its bound, keeps its invariants, and never claims
    /// more than the unbounded tree: pruning only forgets (holders in groups and
    /// copies included).
    #[test]
    fn a_bounded_tree_only_forgets(
        case in prop_oneof![case(false, 60), case(true, 60)],
        max_entries in 1usize..12,
        target_percent in 1u8..100,
    ) {
        let mut tree = RadixTree::new();
        let mut bounded = RadixTree::with_pruning(crate::config::Pruning::LeastRecentlyMatched {
            max_entries,
            target_percent,
        });
        let mut model = Reference::default();
        for op in &case.ops {
            run(&mut tree, &mut model, &case, op, Some(&mut bounded), None);
            check_invariants(&bounded);
            prop_assert!(bounded.num_entries() <= max_entries);
            for query in model.queries() {
                let full = tree.find_matches(&super::tests::q(&query));
                for (rank, score) in bounded.find_matches(&super::tests::q(&query)).sorted() {
                    prop_assert!(score <= full.get(rank), "query {:?} rank {}", query, rank);
                }
            }
        }
    }
}
