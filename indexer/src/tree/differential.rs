//! Differential property test: the radix tree against a naive reference model.
//!
//! The model keeps, per worker rank, each engine block hash with the full block-hash
//! path (prefix) it was stored at. A rank holds prefix `P` when one of its blocks sits
//! at `P`; its score for a query is the largest `k` such that it holds every prefix
//! `query[..1]`, …, `query[..k]`. Random stores (at the root, below a held block,
//! below an unknown block), removes (held and unknown), clears and worker removals
//! run against both, each store and remove on a random storage tier (a lower-tier
//! chain may hang below a parent the rank holds on another tier); after every step the tree's invariants are checked and its
//! answers (GPU overlap and any-tier overlap) compared for every held prefix and
//! one-block extensions of them. At the
//! end, the tree's dump is replayed into a fresh tree, which must answer the same and
//! hold every entry (including those below a removed block).

use super::tests::check_invariants;
use super::tests::events::{Model, Path, engine_hash, on_tier};
use super::*;
use kv_events::{DpRank, StorageTier};
use proptest::prelude::*;
use proptest::sample::Index;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, Clone)]
enum Parent {
    Root,
    Held(Index),
    Unknown,
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        worker: u64,
        dp: u32,
        tier: StorageTier,
        parent: Parent,
        chain: Vec<(u64, u8)>,
    },
    Remove {
        worker: u64,
        dp: u32,
        tier: StorageTier,
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

fn op() -> impl Strategy<Value = Op> {
    let parent = prop_oneof![
        2 => Just(Parent::Root),
        5 => any::<Index>().prop_map(Parent::Held),
        1 => Just(Parent::Unknown),
    ];
    let chain = prop::collection::vec((0u64..4, prop_oneof![6 => Just(0u8), 1 => Just(1u8)]), 0..5);
    let tier = || {
        prop_oneof![
            4 => Just(StorageTier::Gpu),
            2 => Just(StorageTier::Cpu),
            1 => Just(StorageTier::Disk),
        ]
    };
    prop_oneof![
        8 => (0u64..3, 0u32..2, tier(), parent, chain)
            .prop_map(|(worker, dp, tier, parent, chain)| Op::Store { worker, dp, tier, parent, chain }),
        4 => (0u64..3, 0u32..2, tier(), prop::collection::vec(any::<Index>(), 1..4), any::<bool>())
            .prop_map(|(worker, dp, tier, picks, unknown)| Op::Remove { worker, dp, tier, picks, unknown }),
        1 => (0u64..3, 0u32..2).prop_map(|(worker, dp)| Op::Clear { worker, dp }),
        1 => (0u64..3).prop_map(|worker| Op::RemoveWorker { worker }),
    ]
}

impl Model {
    /// The blocks `rank` holds on `tier`.
    fn holder(&self, rank: WorkerRank, tier: StorageTier) -> Option<&BTreeMap<u64, Path>> {
        if tier.is_gpu() {
            self.ranks.get(&rank)
        } else {
            self.lower.get(&(rank, tier))
        }
    }

    fn holder_mut(&mut self, rank: WorkerRank, tier: StorageTier) -> &mut BTreeMap<u64, Path> {
        if tier.is_gpu() {
            self.ranks.entry(rank).or_default()
        } else {
            self.lower.entry((rank, tier)).or_default()
        }
    }

    /// Engine hashes `rank` holds on `tier`, in order.
    fn held_on(&self, rank: WorkerRank, tier: StorageTier) -> Vec<u64> {
        self.holder(rank, tier)
            .map(|m| m.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Engine hashes `rank` holds on any tier, in order, each once.
    fn held_anywhere(&self, rank: WorkerRank) -> Vec<u64> {
        let all: BTreeSet<u64> = StorageTier::ALL
            .into_iter()
            .flat_map(|tier| self.held_on(rank, tier))
            .collect();
        all.into_iter().collect()
    }

    /// Applies a store; `Err` when the parent is unknown (then nothing changes). A
    /// parent not held on `tier` is looked up on the rank's other tiers, GPU first.
    fn store(
        &mut self,
        rank: WorkerRank,
        tier: StorageTier,
        parent: Option<u64>,
        chain: &[(u64, u64)],
    ) -> bool {
        let start: Path = match parent {
            None => Vec::new(),
            Some(p) => match self.holder(rank, tier).and_then(|m| m.get(&p)) {
                Some(path) => path.clone(),
                None => {
                    let other = StorageTier::ALL
                        .into_iter()
                        .filter(|other| *other != tier)
                        .find_map(|other| self.holder(rank, other)?.get(&p).cloned());
                    match other {
                        Some(_) if chain.is_empty() => return true,
                        Some(path) => path,
                        None => return false,
                    }
                }
            },
        };
        if chain.is_empty() && parent.is_none() {
            return true;
        }
        let blocks = self.holder_mut(rank, tier);
        let mut path = start;
        for (ext, local) in chain {
            match blocks.get(ext) {
                Some(held) => path = held.clone(),
                None => {
                    path.push(*local);
                    blocks.insert(*ext, path.clone());
                }
            }
        }
        true
    }

    fn score(&self, blocks: &BTreeMap<u64, Path>, query: &[u64]) -> u32 {
        held_score(blocks.values(), query)
    }

    fn find_matches(&self, query: &[u64]) -> Vec<(WorkerRank, u32)> {
        self.ranks
            .iter()
            .map(|(rank, blocks)| (*rank, self.score(blocks, query)))
            .filter(|(_, s)| *s > 0)
            .collect()
    }

    /// Per rank, the leading blocks held each on some tier, where that exceeds the
    /// GPU score.
    fn find_any_tier(&self, query: &[u64]) -> Vec<(WorkerRank, u32)> {
        let ranks: BTreeSet<WorkerRank> = self.lower.keys().map(|(rank, _)| *rank).collect();
        ranks
            .into_iter()
            .filter_map(|rank| {
                let mut all = BTreeMap::new();
                for (i, tier) in StorageTier::ALL.into_iter().enumerate() {
                    for (ext, path) in self.holder(rank, tier).into_iter().flatten() {
                        all.insert((i, *ext), path.clone());
                    }
                }
                let gpu = self.ranks.get(&rank).map_or(0, |m| self.score(m, query));
                let any = held_score(all.values(), query);
                (any > gpu).then_some((rank, any))
            })
            .collect()
    }

    /// Every holder's blocks, GPU and lower tiers.
    fn all_holders(&self) -> impl Iterator<Item = &BTreeMap<u64, Path>> {
        self.ranks.values().chain(self.lower.values())
    }

    fn num_entries(&self) -> usize {
        self.all_holders().map(BTreeMap::len).sum()
    }

    /// Every held path and its one-block extensions: the interesting queries.
    fn queries(&self) -> BTreeSet<Path> {
        let mut out = BTreeSet::new();
        for path in self.all_holders().flat_map(|m| m.values()) {
            out.insert(path.clone());
            for extra in 0..4 {
                let mut longer = path.clone();
                longer.push(extra);
                out.insert(longer);
            }
        }
        out
    }

    /// Distinct prefixes of held paths: exactly the tree's live nodes.
    fn num_nodes(&self) -> usize {
        let mut prefixes = BTreeSet::new();
        for path in self.all_holders().flat_map(|m| m.values()) {
            for k in 1..=path.len() {
                prefixes.insert(&path[..k]);
            }
        }
        prefixes.len()
    }
}

/// The leading query blocks whose prefixes are all among `paths`.
fn held_score<'a>(paths: impl Iterator<Item = &'a Path>, query: &[u64]) -> u32 {
    let held: BTreeSet<&[u64]> = paths.map(Vec::as_slice).collect();
    (1..=query.len())
        .take_while(|k| held.contains(&query[..*k]))
        .count() as u32
}

/// Applies `op` to `tree` and `model` (asserting they agree on acceptance) and, when
/// given, to `bounded` too (whose answers may differ: it forgets).
fn run(tree: &mut RadixTree, model: &mut Model, op: &Op, mut bounded: Option<&mut RadixTree>) {
    let mut mirror = |worker: u64, event: &KvCacheEvent| {
        if let Some(b) = bounded.as_deref_mut() {
            let _ = b.apply_event(WorkerId(worker), event);
        }
    };
    match op {
        Op::Store {
            worker,
            dp,
            tier,
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
            let accepted = model.store(rank, *tier, parent_hash, &blocks);
            let event = on_tier(super::tests::stored(*dp, parent_hash, &blocks), *tier);
            mirror(*worker, &event);
            assert_eq!(
                tree.apply_event(WorkerId(*worker), &event).is_ok(),
                accepted
            );
        }
        Op::Remove {
            worker,
            dp,
            tier,
            picks,
            unknown,
        } => {
            let rank = WorkerRank::new(WorkerId(*worker), DpRank(*dp));
            let held = model.held_on(rank, *tier);
            let mut hashes: Vec<u64> = if held.is_empty() {
                Vec::new()
            } else {
                picks.iter().map(|i| *i.get(&held)).collect()
            };
            if *unknown {
                hashes.push(u64::MAX - 1);
            }
            let blocks = model.holder_mut(rank, *tier);
            for h in &hashes {
                blocks.remove(h);
            }
            let event = on_tier(super::tests::removed(*dp, &hashes), *tier);
            mirror(*worker, &event);
            let outcome = tree.apply_event(WorkerId(*worker), &event);
            assert!(outcome.is_ok());
        }
        Op::Clear { worker, dp } => {
            let rank = WorkerRank::new(WorkerId(*worker), DpRank(*dp));
            model.ranks.remove(&rank);
            model.lower.retain(|(held, _), _| *held != rank);
            tree.clear_rank(rank);
            mirror(*worker, &super::tests::cleared(*dp));
        }
        Op::RemoveWorker { worker } => {
            model
                .ranks
                .retain(|rank, _| rank.worker_id != WorkerId(*worker));
            model
                .lower
                .retain(|(rank, _), _| rank.worker_id != WorkerId(*worker));
            tree.remove_worker(WorkerId(*worker));
            if let Some(b) = bounded {
                b.remove_worker(WorkerId(*worker));
            }
        }
    }
}

fn assert_same_answers(tree: &RadixTree, model: &Model) {
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
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn tree_matches_the_reference_model(ops in prop::collection::vec(op(), 1..60)) {
        let mut tree = RadixTree::new();
        let mut model = Model::default();
        for op in &ops {
            run(&mut tree, &mut model, op, None);
            check_invariants(&tree);
            assert_same_answers(&tree, &model);
            prop_assert_eq!(tree.num_entries(), model.num_entries());
            prop_assert_eq!(tree.num_nodes(), model.num_nodes());
        }
        let mut rebuilt = RadixTree::new();
        for batch in tree.dump() {
            for event in &batch.events {
                prop_assert!(rebuilt.apply_event(batch.worker_id, event).is_ok());
            }
        }
        check_invariants(&rebuilt);
        assert_same_answers(&rebuilt, &model);
        prop_assert_eq!(rebuilt.num_entries(), model.num_entries());
        prop_assert_eq!(rebuilt.num_nodes(), model.num_nodes());
        prop_assert_eq!(rebuilt.dump(), tree.dump());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A bounded tree stays under its bound, keeps its invariants, and never claims
    /// more than the unbounded tree: pruning only forgets.
    #[test]
    fn a_bounded_tree_only_forgets(
        ops in prop::collection::vec(op(), 1..60),
        max_entries in 1usize..12,
        target_percent in 1u8..100,
    ) {
        let mut tree = RadixTree::new();
        let mut bounded = RadixTree::with_pruning(crate::config::Pruning::LeastRecentlyMatched {
            max_entries,
            target_percent,
        });
        let mut model = Model::default();
        for op in &ops {
            run(&mut tree, &mut model, op, Some(&mut bounded));
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
