//! The reference model of the radix tree's differential test (`tree/differential.rs`):
//! per holder (worker rank, storage tier, KV cache group), each engine block hash with
//! the full block-hash path (prefix) it was stored at and its extra copies, and every
//! answer computed naively from that.
//!
//! A holder holds prefix `P` when one of its blocks sits at `P`. A rank that is not
//! grouped (one group, full attention) scores the largest `k` such that its GPU holder
//! holds every prefix `query[..1]`, …, `query[..k]`; a grouped rank (more than one
//! group, or a windowed one) scores the largest `L` such that every full-attention GPU
//! group holds `query[..1] ..= query[..L]` and every windowed one (window `w`) holds
//! `query[..max(0, L − w) + 1] ..= query[..L]`, tried from the query's length down.

use kv_events::{StorageTier, WorkerId, WorkerRank};
use std::collections::{BTreeMap, BTreeSet};

/// A block's path: the local hashes from the root to it, inclusive.
pub(super) type Path = Vec<u64>;

/// A holder: (rank, tier, group id).
pub(super) type Key = (WorkerRank, StorageTier, Option<u32>);

/// One holder's blocks: engine hash → (path, extra copies).
#[derive(Debug, Default)]
pub(super) struct Holder {
    window: Option<u32>,
    pub(super) blocks: BTreeMap<u64, (Path, u32)>,
}

/// Why the model refuses a store.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    UnknownParent,
    WindowMismatch,
}

/// Every holder; a holder exists from its first accepted store (with blocks, or with
/// a group) until its rank is cleared or its worker removed.
#[derive(Debug, Default)]
pub(super) struct Reference {
    pub(super) holders: BTreeMap<Key, Holder>,
}

impl Reference {
    fn of_rank(&self, rank: WorkerRank) -> impl Iterator<Item = (&Key, &Holder)> {
        self.holders.iter().filter(move |(key, _)| key.0 == rank)
    }

    /// Engine hashes `key` holds, in order.
    pub(super) fn held_on(&self, key: &Key) -> Vec<u64> {
        self.holders
            .get(key)
            .map(|h| h.blocks.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Engine hashes `rank` holds in any holder, in order, each once.
    pub(super) fn held_anywhere(&self, rank: WorkerRank) -> Vec<u64> {
        let all: BTreeSet<u64> = self
            .of_rank(rank)
            .flat_map(|(_, h)| h.blocks.keys().copied())
            .collect();
        all.into_iter().collect()
    }

    /// The path of `hash` in any holder of `rank`.
    pub(super) fn path_anywhere(&self, rank: WorkerRank, hash: u64) -> Option<&Path> {
        self.of_rank(rank)
            .find_map(|(_, h)| h.blocks.get(&hash).map(|(path, _)| path))
    }

    /// An engine hash some holder of `rank` holds at `path`.
    pub(super) fn hash_at(&self, rank: WorkerRank, path: &[u64]) -> Option<u64> {
        self.of_rank(rank).find_map(|(_, h)| {
            (h.blocks.iter())
                .find(|(_, (p, _))| p.as_slice() == path)
                .map(|(hash, _)| *hash)
        })
    }

    /// Applies a store into `key` (whose group has `window`). The parent is looked up
    /// in the holder, then in the rank's other holders (a hash names one path).
    pub(super) fn store(
        &mut self,
        key: Key,
        window: Option<u32>,
        parent: Option<u64>,
        chain: &[(u64, u64)],
    ) -> Result<(), Refusal> {
        let (rank, _, group) = key;
        let known = self.of_rank(rank).find(|(k, _)| k.2 == group);
        if group.is_some() && known.is_some_and(|(_, h)| h.window != window) {
            return Err(Refusal::WindowMismatch);
        }
        let start: Path = match parent {
            None => Vec::new(),
            Some(p) => {
                let own = self.holders.get(&key).and_then(|h| h.blocks.get(&p));
                match own.map(|(path, _)| path).or(self.path_anywhere(rank, p)) {
                    Some(path) => path.clone(),
                    None => {
                        // Refused, but the group (and its window) is known from now on.
                        if group.is_some() {
                            self.holders.entry(key).or_insert_with(|| Holder {
                                window,
                                blocks: BTreeMap::new(),
                            });
                        }
                        return Err(Refusal::UnknownParent);
                    }
                }
            }
        };
        if chain.is_empty() && group.is_none() {
            return Ok(()); // nothing to hold, and no group to make known
        }
        let holder = self.holders.entry(key).or_insert_with(|| Holder {
            window,
            blocks: BTreeMap::new(),
        });
        let mut path = start;
        for (ext, local) in chain {
            match holder.blocks.get_mut(ext) {
                Some((held, copies)) => {
                    *copies += 1;
                    path = held.clone();
                }
                None => {
                    path.push(*local);
                    holder.blocks.insert(*ext, (path.clone(), 0));
                }
            }
        }
        Ok(())
    }

    /// Applies a remove from `key`: one copy per hash named.
    pub(super) fn remove(&mut self, key: &Key, hashes: &[u64]) {
        let Some(holder) = self.holders.get_mut(key) else {
            return;
        };
        for hash in hashes {
            match holder.blocks.get_mut(hash) {
                Some((_, copies)) if *copies > 0 => *copies -= 1,
                Some(_) => {
                    holder.blocks.remove(hash);
                }
                None => {}
            }
        }
    }

    pub(super) fn clear(&mut self, rank: WorkerRank) {
        self.holders.retain(|key, _| key.0 != rank);
    }

    pub(super) fn remove_worker(&mut self, worker: WorkerId) {
        self.holders.retain(|key, _| key.0.worker_id != worker);
    }

    /// True when `rank` has more than one group or a windowed one.
    fn grouped(&self, rank: WorkerRank) -> bool {
        let groups: BTreeSet<(Option<u32>, Option<u32>)> = self
            .of_rank(rank)
            .map(|(key, h)| (key.2, h.window))
            .collect();
        groups.len() > 1 || groups.iter().any(|(_, window)| window.is_some())
    }

    fn ranks(&self) -> BTreeSet<WorkerRank> {
        self.holders.keys().map(|key| key.0).collect()
    }

    fn gpu(&self, rank: WorkerRank) -> impl Iterator<Item = &Holder> {
        self.of_rank(rank)
            .filter(|(key, _)| key.1.is_gpu())
            .map(|(_, h)| h)
    }

    /// Per rank with a GPU holder, its score (ranks scoring 0 left out).
    pub(super) fn find_matches(&self, query: &[u64]) -> Vec<(WorkerRank, u32)> {
        let mut out = Vec::new();
        for rank in self.ranks() {
            let score = if self.gpu(rank).next().is_none() {
                0
            } else if self.grouped(rank) {
                (1..=query.len())
                    .rev()
                    .find(|&l| self.gpu(rank).all(|h| accepts(h, query, l)))
                    .unwrap_or(0) as u32
            } else {
                self.gpu(rank)
                    .map(|h| held_score(h.blocks.values().map(|(p, _)| p), query))
                    .max()
                    .unwrap_or(0)
            };
            if score > 0 {
                out.push((rank, score));
            }
        }
        out
    }

    /// Per rank that is not grouped, the leading blocks held each on some tier,
    /// where that exceeds the GPU score.
    pub(super) fn find_any_tier(&self, query: &[u64]) -> Vec<(WorkerRank, u32)> {
        let gpu: BTreeMap<WorkerRank, u32> = self.find_matches(query).into_iter().collect();
        self.ranks()
            .into_iter()
            .filter(|rank| !self.grouped(*rank))
            .filter_map(|rank| {
                let paths = self
                    .of_rank(rank)
                    .flat_map(|(_, h)| h.blocks.values().map(|(p, _)| p));
                let any = held_score(paths, query);
                (any > gpu.get(&rank).copied().unwrap_or(0)).then_some((rank, any))
            })
            .collect()
    }

    /// Per rank with a GPU holder: its largest full-attention GPU group's blocks (its
    /// largest GPU group's when none is full attention).
    pub(super) fn blocks_per_rank(&self) -> Vec<(WorkerRank, usize)> {
        let mut out = Vec::new();
        for rank in self.ranks() {
            let full = (self.gpu(rank))
                .filter(|h| h.window.is_none())
                .map(|h| h.blocks.len())
                .max();
            if let Some(n) = full.or_else(|| self.gpu(rank).map(|h| h.blocks.len()).max()) {
                out.push((rank, n));
            }
        }
        out
    }

    pub(super) fn num_entries(&self) -> usize {
        self.holders.values().map(|h| h.blocks.len()).sum()
    }

    /// Extra copies over every holder.
    pub(super) fn num_copies(&self) -> u64 {
        let copies = self.holders.values().flat_map(|h| h.blocks.values());
        copies.map(|(_, c)| u64::from(*c)).sum()
    }

    fn paths(&self) -> impl Iterator<Item = &Path> {
        self.holders
            .values()
            .flat_map(|h| h.blocks.values().map(|(p, _)| p))
    }

    /// Every held path and its one-block extensions: the interesting queries.
    pub(super) fn queries(&self) -> BTreeSet<Path> {
        let mut out = BTreeSet::new();
        for path in self.paths() {
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
    pub(super) fn num_nodes(&self) -> usize {
        let mut prefixes = BTreeSet::new();
        for path in self.paths() {
            for k in 1..=path.len() {
                prefixes.insert(&path[..k]);
            }
        }
        prefixes.len()
    }
}

/// True when `holder` allows a hit of `l` blocks on `query`: it holds every prefix
/// `query[..k]` for `k` in `max(0, l − window) + 1 ..= l` (from 1 for full attention).
fn accepts(holder: &Holder, query: &[u64], l: usize) -> bool {
    let held: BTreeSet<&[u64]> = holder.blocks.values().map(|(p, _)| p.as_slice()).collect();
    let first = holder.window.map_or(0, |w| l.saturating_sub(w as usize));
    (first + 1..=l).all(|k| held.contains(&query[..k]))
}

/// The leading query blocks whose prefixes are all among `paths`.
pub(super) fn held_score<'a>(paths: impl Iterator<Item = &'a Path>, query: &[u64]) -> u32 {
    let held: BTreeSet<&[u64]> = paths.map(Vec::as_slice).collect();
    (1..=query.len())
        .take_while(|k| held.contains(&query[..*k]))
        .count() as u32
}
