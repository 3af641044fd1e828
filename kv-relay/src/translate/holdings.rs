//! What one rank holds, as the translator tracks it: per engine block hash, its place
//! in the rank's chain (parent hash, local hash) and the (tier, group) holders with
//! their copy counts. The chain is what places a sliding-window group's sparse store.

use super::Skip;
use kv_events::engines::UnsupportedGroup;
use kv_events::{
    ExternalBlockHash, GroupId, KvCacheGroup, LocalBlockHash, StorageTier, StoredBlock,
};
use std::collections::HashMap;

/// Most KV cache groups (known or refused) one rank may name; real models have a few
/// (vLLM: one per attention kind, and a few more for Mamba or MLA variants).
pub(super) const MAX_GROUPS: usize = 64;

/// A (storage tier, KV cache group) pair that holds blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Holder {
    pub tier: StorageTier,
    pub group: Option<GroupId>,
}

/// A block some holder of the rank holds.
#[derive(Debug)]
struct Block {
    parent: Option<ExternalBlockHash>,
    tokens_hash: LocalBlockHash,
    /// Holders and how many physical copies each holds (≥ 1).
    holders: Vec<(Holder, u32)>,
}

/// A maximal run of consecutive blocks of a sparse store, and the block before it.
pub(super) struct Run {
    pub parent: Option<ExternalBlockHash>,
    pub blocks: Vec<StoredBlock>,
}

/// The blocks of one rank and the groups it announced.
#[derive(Debug, Default)]
pub(super) struct RankBlocks {
    blocks: HashMap<ExternalBlockHash, Block>,
    /// The engine's group index → our group, fixed by the group's first store, or
    /// why its kind is refused.
    groups: HashMap<u32, Result<KvCacheGroup, UnsupportedGroup>>,
}

impl RankBlocks {
    /// Blocks held by at least one holder.
    pub fn held(&self) -> usize {
        self.blocks.len()
    }

    /// Checks `group` against the group's first store; `Ok(true)` when the group is
    /// new to the rank (and now known).
    ///
    /// # Errors
    /// [`Skip::GroupConflict`] when the group was first stored with another window.
    /// [`Skip::TooManyGroups`] past [`MAX_GROUPS`].
    pub fn learn_group(&mut self, group: Option<KvCacheGroup>) -> Result<bool, Skip> {
        let Some(group) = group else {
            return Ok(false);
        };
        match self.groups.get(&group.id.0) {
            Some(Ok(known)) if *known == group => Ok(false),
            Some(Ok(known)) => Err(Skip::GroupConflict {
                first: *known,
                now: group,
            }),
            // A group refused before and stored now with a kind we index (the engine
            // changed its mind, or another model): a conflict as well.
            Some(Err(refused)) => Err(Skip::UnsupportedGroup(refused.clone())),
            None => {
                self.room_for_a_group()?;
                self.groups.insert(group.id.0, Ok(group));
                Ok(true)
            }
        }
    }

    /// Remembers that the rank's group `idx` is of a kind not indexed, so its
    /// removals are refused for the same reason.
    pub fn refuse_group(&mut self, idx: u32, why: &UnsupportedGroup) {
        if !self.groups.contains_key(&idx) && self.room_for_a_group().is_ok() {
            self.groups.insert(idx, Err(why.clone()));
        }
    }

    /// Why the rank's group `idx` is refused, if it is.
    pub fn refused(&self, idx: u32) -> Option<&UnsupportedGroup> {
        self.groups.get(&idx)?.as_ref().err()
    }

    fn room_for_a_group(&self) -> Result<(), Skip> {
        if self.groups.len() >= MAX_GROUPS {
            return Err(Skip::TooManyGroups(MAX_GROUPS));
        }
        Ok(())
    }

    /// True when some holder of the rank holds `hash` (on any tier, in any group).
    pub fn holds(&self, hash: ExternalBlockHash) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// Adds one copy of each block, chained from `parent`, to `holder`.
    pub fn store(
        &mut self,
        holder: Holder,
        parent: Option<ExternalBlockHash>,
        blocks: &[StoredBlock],
    ) {
        let mut parent = parent;
        for b in blocks {
            let block = self.blocks.entry(b.block_hash).or_insert_with(|| Block {
                parent,
                tokens_hash: b.tokens_hash,
                holders: Vec::new(),
            });
            match block.holders.iter_mut().find(|(h, _)| *h == holder) {
                Some((_, copies)) => *copies += 1,
                None => block.holders.push((holder, 1)),
            }
            parent = Some(b.block_hash);
        }
    }

    /// Places the hashes of a sparse store through the chain learned from dense
    /// stores: maximal runs of consecutive blocks, each with the block before it.
    ///
    /// # Errors
    /// [`Skip::Unplaced`] for a hash no holder of the rank holds (its position is
    /// unknown); [`Skip::Orphan`] when the block before a run is not held (the index
    /// could not place the run).
    pub fn place(&self, hashes: &[ExternalBlockHash]) -> Result<Vec<Run>, Skip> {
        let mut runs: Vec<Run> = Vec::new();
        for &hash in hashes {
            let block = self.blocks.get(&hash).ok_or(Skip::Unplaced(hash))?;
            let stored = StoredBlock {
                block_hash: hash,
                tokens_hash: block.tokens_hash,
            };
            match runs.last_mut() {
                Some(run)
                    if block.parent.is_some()
                        && run.blocks.last().map(|b| b.block_hash) == block.parent =>
                {
                    run.blocks.push(stored);
                }
                _ => {
                    if let Some(parent) = block.parent.filter(|p| !self.holds(*p)) {
                        return Err(Skip::Orphan(parent));
                    }
                    runs.push(Run {
                        parent: block.parent,
                        blocks: vec![stored],
                    });
                }
            }
        }
        Ok(runs)
    }

    /// Drops one copy of `hash` from `holder`; false when the holder holds none.
    pub fn remove(&mut self, holder: Holder, hash: ExternalBlockHash) -> bool {
        let Some(block) = self.blocks.get_mut(&hash) else {
            return false;
        };
        let Some(i) = block.holders.iter().position(|(h, _)| *h == holder) else {
            return false;
        };
        block.holders[i].1 -= 1;
        if block.holders[i].1 == 0 {
            block.holders.swap_remove(i);
        }
        if block.holders.is_empty() {
            self.blocks.remove(&hash);
        }
        true
    }
}
