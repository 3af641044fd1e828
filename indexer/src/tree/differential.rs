//! Differential property test: the radix tree against a naive reference model.
//!
//! The model keeps, per worker rank, each engine block hash with the full block-hash
//! path (prefix) it was stored at. A rank holds prefix `P` when one of its blocks sits
//! at `P`; its score for a query is the largest `k` such that it holds every prefix
//! `query[..1]`, …, `query[..k]`. Random stores (at the root, below a held block,
//! below an unknown block), removes (held and unknown), clears and worker removals
//! run against both; after every step the tree's invariants are checked and its
//! answers compared for every held prefix and one-block extensions of them. At the
//! end, the tree's dump is replayed into a fresh tree, which must answer the same and
//! hold every entry (including those below a removed block).

use super::tests::check_invariants;
use super::tests::events::{Model, Path, engine_hash};
use super::*;
use kv_events::DpRank;
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
        parent: Parent,
        chain: Vec<(u64, u8)>,
    },
    Remove {
        worker: u64,
        dp: u32,
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
    prop_oneof![
        8 => (0u64..3, 0u32..2, parent, chain)
            .prop_map(|(worker, dp, parent, chain)| Op::Store { worker, dp, parent, chain }),
        4 => (0u64..3, 0u32..2, prop::collection::vec(any::<Index>(), 1..4), any::<bool>())
            .prop_map(|(worker, dp, picks, unknown)| Op::Remove { worker, dp, picks, unknown }),
        1 => (0u64..3, 0u32..2).prop_map(|(worker, dp)| Op::Clear { worker, dp }),
        1 => (0u64..3).prop_map(|worker| Op::RemoveWorker { worker }),
    ]
}

impl Model {
    /// Applies a store; `Err` when the parent is unknown (then nothing changes).
    fn store(&mut self, rank: WorkerRank, parent: Option<u64>, chain: &[(u64, u64)]) -> bool {
        let start: Path = match parent {
            None => Vec::new(),
            Some(p) => match self.ranks.get(&rank).and_then(|m| m.get(&p)) {
                Some(path) => path.clone(),
                None => return false,
            },
        };
        if chain.is_empty() && parent.is_none() {
            return true;
        }
        let blocks = self.ranks.entry(rank).or_default();
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
        let held: BTreeSet<&[u64]> = blocks.values().map(Vec::as_slice).collect();
        (1..=query.len())
            .take_while(|k| held.contains(&query[..*k]))
            .count() as u32
    }

    fn find_matches(&self, query: &[u64]) -> Vec<(WorkerRank, u32)> {
        self.ranks
            .iter()
            .map(|(rank, blocks)| (*rank, self.score(blocks, query)))
            .filter(|(_, s)| *s > 0)
            .collect()
    }

    /// Every held path and its one-block extensions: the interesting queries.
    fn queries(&self) -> BTreeSet<Path> {
        let mut out = BTreeSet::new();
        for path in self.ranks.values().flat_map(|m| m.values()) {
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
        for path in self.ranks.values().flat_map(|m| m.values()) {
            for k in 1..=path.len() {
                prefixes.insert(&path[..k]);
            }
        }
        prefixes.len()
    }
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
            parent,
            chain,
        } => {
            let rank = WorkerRank::new(WorkerId(*worker), DpRank(*dp));
            let held = model.held(rank);
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
            let accepted = model.store(rank, parent_hash, &blocks);
            let event = super::tests::stored(*dp, parent_hash, &blocks);
            mirror(*worker, &event);
            assert_eq!(
                tree.apply_event(WorkerId(*worker), &event).is_ok(),
                accepted
            );
        }
        Op::Remove {
            worker,
            dp,
            picks,
            unknown,
        } => {
            let rank = WorkerRank::new(WorkerId(*worker), DpRank(*dp));
            let held = model.held(rank);
            let mut hashes: Vec<u64> = if held.is_empty() {
                Vec::new()
            } else {
                picks.iter().map(|i| *i.get(&held)).collect()
            };
            if *unknown {
                hashes.push(u64::MAX - 1);
            }
            if let Some(blocks) = model.ranks.get_mut(&rank) {
                for h in &hashes {
                    blocks.remove(h);
                }
            }
            let event = super::tests::removed(*dp, &hashes);
            mirror(*worker, &event);
            let outcome = tree.apply_event(WorkerId(*worker), &event);
            assert!(outcome.is_ok());
        }
        Op::Clear { worker, dp } => {
            let rank = WorkerRank::new(WorkerId(*worker), DpRank(*dp));
            model.ranks.remove(&rank);
            tree.clear_rank(rank);
            mirror(*worker, &super::tests::cleared(*dp));
        }
        Op::RemoveWorker { worker } => {
            model
                .ranks
                .retain(|rank, _| rank.worker_id != WorkerId(*worker));
            tree.remove_worker(WorkerId(*worker));
            if let Some(b) = bounded {
                b.remove_worker(WorkerId(*worker));
            }
        }
    }
}

fn assert_same_answers(tree: &RadixTree, model: &Model) {
    for query in model.queries() {
        let got = tree.find_matches(&super::tests::q(&query)).sorted();
        assert_eq!(got, model.find_matches(&query), "query {query:?}");
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
            let entries: usize = model.ranks.values().map(BTreeMap::len).sum();
            prop_assert_eq!(tree.num_entries(), entries);
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
        let entries: usize = model.ranks.values().map(BTreeMap::len).sum();
        prop_assert_eq!(rebuilt.num_entries(), entries);
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
