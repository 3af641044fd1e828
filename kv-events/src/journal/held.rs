//! The blocks one rank holds on the GPU, per KV cache group with copy counts, and the
//! recovery dump that rebuilds them (see [`super::EventJournal`]).
//!
//! The rank's blocks form one tree shared by its groups (vLLM's block hash is the
//! token chain's, the same in every group): each node keeps its parent, its tokens
//! hash and how many groups hold it; each group keeps how many copies of each block
//! it holds. A node lives while a group holds it or a node below it lives, so a
//! sliding-window group's sparse chain can always be placed below the blocks before
//! it, even after the full-attention group evicted those.
//!
//! A dump names (see `docs/protocol.md`, recovery):
//! 1. the *carrier* group's chains: every block it holds and every block some held
//!    block continues (an ancestor), the latter listed as unheld placeholders of the
//!    carrier (`unheld` for the group-less case, else `unheld_in_groups`), so every
//!    other chain's parent is placed first. The carrier is the group-less holder if it
//!    holds anything, else the full-attention group with the smallest id, else the
//!    smallest group id;
//! 2. every other group's chains of the blocks it holds, each starting below a block
//!    the carrier's chains placed (a sparse windowed chain's parent is another group's
//!    block); a known group holding nothing gets one empty chain (it stays known);
//! 3. one single-block chain per extra copy of a block in a group.
//!
//! Held blocks whose chain does not reach the root (their first `Stored` named a
//! parent this journal never saw) are left out: a router would refuse them too.
//!
//! Cost: ≈ 40 bytes per node plus ≈ 16 bytes per (group, held block); O(blocks) per
//! event, O(nodes · groups) per dump.

use crate::events::{KvCacheEventData, KvCacheGroup, StorageTier, StoredBlock};
use crate::ids::{ExternalBlockHash, GroupId, LocalBlockHash};
use crate::recovery::{GroupBlocks, StoredChain};
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet};

/// A block some group holds, or an ancestor of one (kept only to place it).
#[derive(Debug, Clone, Copy)]
struct Node {
    parent: Option<ExternalBlockHash>,
    tokens_hash: LocalBlockHash,
    /// Nodes whose parent this node is.
    children: u32,
    /// Groups holding at least one copy.
    holders: u32,
}

/// One group's holdings: copies per block, and the group as its first store named it.
#[derive(Debug)]
struct Group {
    group: Option<KvCacheGroup>,
    copies: HashMap<ExternalBlockHash, u32>,
}

/// A rank's GPU blocks by group. `None` is the group-less holder.
#[derive(Debug, Default)]
pub(super) struct HeldSet {
    nodes: HashMap<ExternalBlockHash, Node>,
    groups: BTreeMap<Option<GroupId>, Group>,
    /// Nodes with `holders > 0`.
    held: usize,
}

/// What a dump carries: chains in placement order, then the placeholders to remove.
pub(super) struct Dump {
    pub chains: Vec<StoredChain>,
    pub unheld: Vec<ExternalBlockHash>,
    pub unheld_in_groups: Vec<GroupBlocks>,
}

impl HeldSet {
    /// Blocks held by at least one group.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Copies per (group, block), for tests.
    #[cfg(test)]
    pub fn copies(&self) -> BTreeMap<(Option<GroupId>, ExternalBlockHash), u32> {
        self.groups
            .iter()
            .flat_map(|(key, g)| g.copies.iter().map(move |(h, n)| ((*key, *h), *n)))
            .collect()
    }

    /// Applies one recorded event. Lower tiers are not kept (see the journal docs).
    pub fn apply(&mut self, data: &KvCacheEventData) {
        match data {
            KvCacheEventData::Stored { tier, .. } | KvCacheEventData::Removed { tier, .. }
                if !tier.is_gpu() => {}
            KvCacheEventData::Stored {
                parent_hash,
                blocks,
                group,
                ..
            } => {
                let key = group.map(|g| g.id);
                match self.groups.get(&key) {
                    // A store naming another window than the group's first: a
                    // router refuses it, so it changes nothing here either.
                    Some(known) if known.group != *group => return,
                    Some(_) => {}
                    None => {
                        self.groups.insert(
                            key,
                            Group {
                                group: *group,
                                copies: HashMap::new(),
                            },
                        );
                    }
                }
                let mut parent = *parent_hash;
                for block in blocks {
                    self.store(key, block, parent);
                    parent = Some(block.block_hash);
                }
            }
            KvCacheEventData::Removed {
                block_hashes,
                group,
                ..
            } => {
                for hash in block_hashes {
                    self.remove(*group, *hash);
                }
            }
            KvCacheEventData::Cleared => *self = Self::default(),
        }
    }

    fn store(
        &mut self,
        key: Option<GroupId>,
        block: &StoredBlock,
        parent: Option<ExternalBlockHash>,
    ) {
        let hash = block.block_hash;
        if let Entry::Vacant(slot) = self.nodes.entry(hash) {
            slot.insert(Node {
                parent,
                tokens_hash: block.tokens_hash,
                children: 0,
                holders: 0,
            });
            if let Some(p) = parent
                .filter(|p| *p != hash)
                .and_then(|p| self.nodes.get_mut(&p))
            {
                p.children += 1;
            }
        }
        let Some(group) = self.groups.get_mut(&key) else {
            return;
        };
        let copies = group.copies.entry(hash).or_insert(0);
        *copies += 1;
        if *copies == 1
            && let Some(node) = self.nodes.get_mut(&hash)
        {
            node.holders += 1;
            if node.holders == 1 {
                self.held += 1;
            }
        }
    }

    /// Drops one copy of `hash` from group `key`; forgets the node (and ancestors
    /// kept only for it) once no group holds it and nothing below it lives.
    fn remove(&mut self, key: Option<GroupId>, hash: ExternalBlockHash) {
        let Some(group) = self.groups.get_mut(&key) else {
            return;
        };
        let Some(copies) = group.copies.get_mut(&hash) else {
            return;
        };
        *copies -= 1;
        if *copies > 0 {
            return;
        }
        group.copies.remove(&hash);
        let Some(node) = self.nodes.get_mut(&hash) else {
            return;
        };
        node.holders -= 1;
        if node.holders > 0 {
            return;
        }
        self.held -= 1;
        let mut cur = hash;
        loop {
            let Some(node) = self.nodes.get(&cur).copied() else {
                return;
            };
            if node.holders > 0 || node.children > 0 {
                return;
            }
            self.nodes.remove(&cur);
            let Some(parent) = node.parent else {
                return;
            };
            match self.nodes.get_mut(&parent) {
                Some(p) => p.children -= 1,
                None => return,
            }
            cur = parent;
        }
    }

    /// The group whose chains place every ancestor (module docs).
    fn carrier(&self) -> Option<GroupId> {
        let plain = self.groups.get(&None).is_some_and(|g| !g.copies.is_empty());
        if plain {
            return None;
        }
        let full = self
            .groups
            .iter()
            .find(|(key, g)| key.is_some() && g.group.is_none_or(|g| g.is_full()));
        full.or_else(|| self.groups.iter().next())
            .and_then(|(key, _)| *key)
    }

    /// The dump of this rank (module docs).
    pub fn dump(&self) -> Dump {
        let mut children: HashMap<Option<ExternalBlockHash>, Vec<ExternalBlockHash>> =
            HashMap::new();
        for (hash, node) in &self.nodes {
            children.entry(node.parent).or_default().push(*hash);
        }
        for list in children.values_mut() {
            list.sort_unstable();
        }
        let carrier = self.carrier();
        let no_copies = HashMap::new();
        let carried = self.groups.get(&carrier).map_or(&no_copies, |g| &g.copies);
        let lives_below = |h: &ExternalBlockHash| self.nodes.get(h).is_some_and(|n| n.children > 0);
        let in_carrier = |h: &ExternalBlockHash| carried.contains_key(h) || lives_below(h);
        let roots = children.get(&None).map(Vec::as_slice).unwrap_or_default();
        let roots = roots.iter().filter(|h| in_carrier(h)).map(|h| (None, *h));
        let carrier_group = self.groups.get(&carrier).and_then(|g| g.group);
        let mut chains = Vec::new();
        let mut placed = HashSet::new();
        self.walk(roots.collect(), &children, &in_carrier, |parent, blocks| {
            placed.extend(blocks.iter().map(|b| b.block_hash));
            chains.push(chain(parent, blocks, carrier_group));
        });
        let mut unheld: Vec<_> = placed
            .iter()
            .filter(|h| !carried.contains_key(h))
            .copied()
            .collect();
        unheld.sort_unstable();
        let mut extra = Vec::new();
        for (key, group) in &self.groups {
            let copies = &group.copies;
            let mut emitted = HashSet::new();
            let emitted = if *key == carrier {
                if placed.is_empty() && key.is_some() {
                    chains.push(chain(None, Vec::new(), group.group));
                }
                &placed
            } else {
                let mut starts: Vec<_> = copies
                    .keys()
                    .filter_map(|h| {
                        let parent = self.nodes.get(h)?.parent;
                        let placeable =
                            parent.is_none_or(|p| !copies.contains_key(&p) && placed.contains(&p));
                        placeable.then_some((parent, *h))
                    })
                    .collect();
                starts.sort_unstable();
                let held = |h: &ExternalBlockHash| copies.contains_key(h);
                self.walk(starts, &children, &held, |parent, blocks| {
                    emitted.extend(blocks.iter().map(|b| b.block_hash));
                    chains.push(chain(parent, blocks, group.group));
                });
                if emitted.is_empty() && key.is_some() {
                    chains.push(chain(None, Vec::new(), group.group));
                }
                &emitted
            };
            let mut more: Vec<_> = copies
                .iter()
                .filter(|(h, n)| **n > 1 && emitted.contains(*h))
                .collect();
            more.sort_unstable();
            for (hash, n) in more {
                let Some(node) = self.nodes.get(hash) else {
                    continue;
                };
                let block = StoredBlock {
                    block_hash: *hash,
                    tokens_hash: node.tokens_hash,
                };
                for _ in 1..*n {
                    extra.push(chain(node.parent, vec![block], group.group));
                }
            }
        }
        chains.extend(extra);
        let unheld_in_groups = match carrier {
            Some(id) if !unheld.is_empty() => vec![GroupBlocks {
                group: id,
                block_hashes: std::mem::take(&mut unheld),
            }],
            _ => Vec::new(),
        };
        Dump {
            chains,
            unheld,
            unheld_in_groups,
        }
    }

    /// Walks down from `starts` (each with its parent) through the nodes `include`
    /// admits, in hash order, handing each maximal chain to `emit`.
    fn walk(
        &self,
        starts: Vec<(Option<ExternalBlockHash>, ExternalBlockHash)>,
        children: &HashMap<Option<ExternalBlockHash>, Vec<ExternalBlockHash>>,
        include: &dyn Fn(&ExternalBlockHash) -> bool,
        mut emit: impl FnMut(Option<ExternalBlockHash>, Vec<StoredBlock>),
    ) {
        let mut stack: Vec<_> = starts.into_iter().rev().collect();
        while let Some((parent, start)) = stack.pop() {
            let mut blocks = Vec::new();
            let mut node = start;
            while let Some(n) = self.nodes.get(&node) {
                blocks.push(StoredBlock {
                    block_hash: node,
                    tokens_hash: n.tokens_hash,
                });
                let below: Vec<_> = children
                    .get(&Some(node))
                    .map(|c| c.iter().filter(|h| include(h)).copied().collect())
                    .unwrap_or_default();
                match below.as_slice() {
                    [first, rest @ ..] => {
                        stack.extend(rest.iter().rev().map(|h| (Some(node), *h)));
                        node = *first;
                    }
                    [] => break,
                }
            }
            if !blocks.is_empty() {
                emit(parent, blocks);
            }
        }
    }
}

fn chain(
    parent_hash: Option<ExternalBlockHash>,
    blocks: Vec<StoredBlock>,
    group: Option<KvCacheGroup>,
) -> StoredChain {
    StoredChain {
        parent_hash,
        blocks,
        tier: StorageTier::Gpu,
        group,
    }
}
