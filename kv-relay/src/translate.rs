//! Engine events → our [`KvCacheEventData`], per data-parallel rank. Pure and
//! synchronous: [`Translator::translate_batch`] maps one decoded engine batch to the
//! events to publish, so a recorded engine stream can be replayed without sockets.
//!
//! Per rank the translator keeps every block a (storage tier, KV cache group) holds,
//! with its copy count and its place in the rank's chain (parent hash, local hash).
//! The numbering, the ring and the recovery dumps live in the publisher's
//! [`kv_events::journal::EventJournal`].
//!
//! - **Tiers**: the engine's `medium` becomes a [`StorageTier`] ([`tier_of_medium`]);
//!   a CPU-offloaded copy is a `Stored` on the CPU tier, the GPU copy's eviction a
//!   `Removed` from the GPU tier. An unknown medium is refused (`unknown_medium`).
//! - **KV cache groups** (hybrid-attention models): every engine group passes through
//!   as our `group` ([`kv_events::engines::groups`]: the window in blocks from vLLM's
//!   `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`), learned per rank from
//!   the group's first store; a store naming another window later is refused
//!   (`group_conflict`), and a kind that cannot be indexed exactly is refused
//!   (`unsupported_group`), its stores and its removals. A `Removed` applies to its
//!   own (tier, group) only, never to another group's copy of the block.
//! - **Sparse sliding-window stores**: vLLM keeps only the blocks of a sliding-window
//!   group a later hit can use, and publishes those hashes with the `token_ids` (and
//!   parent) of the whole new chain, so `token_ids` do not describe the hashes. Such a
//!   store is placed through the rank's chain, learned from every dense store (any
//!   group): each maximal run of consecutive blocks becomes one `Stored` whose parent
//!   is the block before the run (held by another group). Within one batch the stores
//!   of full-attention groups are applied before those of windowed groups (vLLM
//!   publishes the sliding groups first), so the chain a step stores is known when its
//!   sparse stores are placed; removals and clears keep their place. A windowed store
//!   with no hashes publishes an empty `Stored` the first time its group is seen on the
//!   rank, so the router knows the group (a rank whose sliding window holds nothing
//!   gets no hit past it).
//! - **Copies**: a `Stored` naming a block the (tier, group) already holds is a new
//!   physical copy (vLLM recomputing a prefix it holds, or repeating an exactly
//!   block-aligned prompt): published, and counted, so a removal of a block the
//!   (tier, group) does not hold any more changes nothing (`no_change`).
//! - A dense `BlockStored` whose parent the rank does not hold on any tier cannot be
//!   placed in the prefix tree (`orphan`); a sparse one naming a block the rank does
//!   not hold (`unplaced`). The engine's next stores from the root rebuild the picture.
//! - `AllBlocksCleared` drops everything of the rank, on every tier and in every group.
//!
//! Cost: one hash map entry per held block (≈ 80 bytes, plus 8 per extra holder),
//! O(blocks) per event.

mod holdings;

use crate::config::EngineFormat;
use holdings::{Holder, RankBlocks};
use kv_events::engines::{
    BlockRemoved, BlockStored, EngineBatch, EngineEvent, EventForm, LocalHashError, UnknownMedium,
    UnsupportedGroup, kv_cache_group, local_block_hashes, tier_of_medium,
};
use kv_events::{
    DpRank, ExternalBlockHash, GroupId, KvCacheEventData, KvCacheGroup, StorageTier, StoredBlock,
};
use std::collections::HashMap;

/// Why an engine event produced nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    /// Local hashes could not be computed (block size or token count).
    #[error("cannot hash the stored blocks: {0}")]
    Hashing(#[from] LocalHashError),
    /// The parent block is not held by the rank.
    #[error("parent block {0} is not held by the rank")]
    Orphan(ExternalBlockHash),
    /// A sparse sliding-window store names a block no group of the rank holds, so its
    /// position is unknown.
    #[error("block {0} of a sparse store is not held by the rank: its position is unknown")]
    Unplaced(ExternalBlockHash),
    /// The KV cache group's kind is not indexed exactly.
    #[error(transparent)]
    UnsupportedGroup(#[from] UnsupportedGroup),
    /// The rank named more KV cache groups than any model has.
    #[error("more than {0} KV cache groups on one rank")]
    TooManyGroups(usize),
    /// A store names another window for a group than its first store did.
    #[error("KV cache group {} first stored as {first:?}, now as {now:?}", first.id)]
    GroupConflict {
        /// The group as first stored.
        first: KvCacheGroup,
        /// The group as this event names it.
        now: KvCacheGroup,
    },
    /// An event type the relay does not know.
    #[error("unknown engine event type {0:?}")]
    UnknownType(String),
    /// The event names a storage medium the relay does not know.
    #[error(transparent)]
    UnknownMedium(#[from] UnknownMedium),
    /// The event's encoding is excluded by `--engine-format`.
    #[error("{} event refused by --engine-format", .0.as_str())]
    Format(EventForm),
    /// Nothing changed (removals of copies the (tier, group) does not hold, or an
    /// empty store of a group already known).
    #[error("no change")]
    NoChange,
}

impl Skip {
    /// Short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Skip::Hashing(_) => "bad_blocks",
            Skip::Orphan(_) => "orphan",
            Skip::Unplaced(_) => "unplaced",
            Skip::UnsupportedGroup(_) => "unsupported_group",
            Skip::GroupConflict { .. } | Skip::TooManyGroups(_) => "group_conflict",
            Skip::UnknownType(_) => "unknown_type",
            Skip::UnknownMedium(_) => "unknown_medium",
            Skip::Format(_) => "format",
            Skip::NoChange => "no_change",
        }
    }
}

/// The short kind name of an engine event, for metric labels.
pub fn event_kind(event: &EngineEvent) -> &'static str {
    match event {
        EngineEvent::BlockStored(..) => "stored",
        EngineEvent::BlockRemoved(..) => "removed",
        EngineEvent::AllBlocksCleared(..) => "cleared",
        EngineEvent::Unknown { .. } => "unknown",
    }
}

/// What became of one engine event of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The event's position in its batch.
    pub index: usize,
    /// [`event_kind`] of the event.
    pub kind: &'static str,
    /// The events it published (in order), or why none.
    pub result: Result<Vec<KvCacheEventData>, Skip>,
}

/// Translates one worker's engine events, rank by rank.
#[derive(Debug)]
pub struct Translator {
    /// Tokens per block; until known, the first stored event's `block_size` fixes it
    /// (see [`crate::facts`]).
    block_size: Option<u32>,
    format: EngineFormat,
    ranks: HashMap<DpRank, RankBlocks>,
}

impl Translator {
    /// A translator accepting `format`, with the block size not known yet.
    pub fn new(format: EngineFormat) -> Self {
        Self {
            block_size: None,
            format,
            ranks: HashMap::new(),
        }
    }

    /// Tokens per block in use, once known.
    pub fn block_size(&self) -> Option<u32> {
        self.block_size
    }

    /// Fixes the block size learned elsewhere (the engine's metrics page) when none
    /// is in use yet; a size already in use is kept.
    pub fn learn_block_size(&mut self, size: u32) {
        self.block_size.get_or_insert(size);
    }

    /// Translates one engine batch of `rank` (the batch's own rank is not looked at):
    /// one [`Outcome`] per event, in the order applied (see the module docs: within a
    /// run of stores, full-attention groups first). The events to publish are the
    /// outcomes' events in that order.
    pub fn apply_batch(&mut self, rank: DpRank, events: &[EngineEvent]) -> Vec<Outcome> {
        let mut order: Vec<usize> = (0..events.len()).collect();
        // Stable: windowed stores go after the other stores of their run.
        let mut start = 0;
        while start < events.len() {
            let run = events[start..]
                .iter()
                .take_while(|e| matches!(e, EngineEvent::BlockStored(..)))
                .count();
            order[start..start + run].sort_by_key(|&i| self.is_windowed_store(&events[i]));
            start += run.max(1);
        }
        order
            .into_iter()
            .map(|index| Outcome {
                index,
                kind: event_kind(&events[index]),
                result: self.apply(rank, &events[index]),
            })
            .collect()
    }

    /// Translates a decoded engine batch as the relay does, for a batch that names no
    /// rank taken as `default_rank`: the rank and the [`Outcome`]s.
    pub fn translate_batch(
        &mut self,
        batch: &EngineBatch,
        default_rank: DpRank,
    ) -> (DpRank, Vec<Outcome>) {
        let rank = batch.dp_rank.unwrap_or(default_rank);
        (rank, self.apply_batch(rank, &batch.events))
    }

    /// Translates one engine event of `rank` on its own (no reordering).
    ///
    /// # Errors
    /// [`Skip`] when the event produces no event of ours (counted by the caller).
    pub fn apply(
        &mut self,
        rank: DpRank,
        event: &EngineEvent,
    ) -> Result<Vec<KvCacheEventData>, Skip> {
        let form = event.form();
        let accepted = match self.format {
            EngineFormat::Auto => true,
            EngineFormat::VllmArray => form == EventForm::PositionalArray,
            EngineFormat::Tagged => form == EventForm::TaggedMap,
        };
        if !accepted {
            return Err(Skip::Format(form));
        }
        match event {
            EngineEvent::BlockStored(stored, _) => self.stored(rank, stored),
            EngineEvent::BlockRemoved(removed, _) => self.removed(rank, removed).map(|d| vec![d]),
            EngineEvent::AllBlocksCleared(_) => Ok(vec![self.clear(rank)]),
            EngineEvent::Unknown { type_name, .. } => Err(Skip::UnknownType(type_name.clone())),
        }
    }

    /// Forgets every block and group of `rank` and returns the `cleared` event to
    /// publish.
    pub fn clear(&mut self, rank: DpRank) -> KvCacheEventData {
        self.ranks.remove(&rank);
        KvCacheEventData::Cleared
    }

    /// Number of blocks `rank` holds (on any tier, in any group).
    pub fn held(&self, rank: DpRank) -> usize {
        self.ranks.get(&rank).map_or(0, RankBlocks::held)
    }

    /// The group a store names, by vLLM's kind rules, at the block size in use.
    fn group_of(&self, event: &BlockStored) -> Result<Option<KvCacheGroup>, UnsupportedGroup> {
        kv_cache_group(
            event.group_idx,
            event.kv_cache_spec_kind.as_deref(),
            event.kv_cache_spec_sliding_window,
            self.block_size.unwrap_or(event.block_size),
        )
    }

    fn is_windowed_store(&self, event: &EngineEvent) -> bool {
        match event {
            EngineEvent::BlockStored(stored, _) => {
                matches!(self.group_of(stored), Ok(Some(g)) if !g.is_full())
            }
            _ => false,
        }
    }

    fn stored(&mut self, rank: DpRank, event: &BlockStored) -> Result<Vec<KvCacheEventData>, Skip> {
        let tier = tier_of_medium(event.medium.as_deref())?;
        let group = match self.group_of(event) {
            Ok(group) => group,
            Err(why) => {
                if let Some(idx) = event.group_idx {
                    self.ranks.entry(rank).or_default().refuse_group(idx, &why);
                }
                return Err(why.into());
            }
        };
        // Until the size is known, the event's own size is tried, and kept only if the
        // event hashes at it (a 0 or inconsistent size fixes nothing).
        let block_size = self.block_size.unwrap_or(event.block_size);
        let sparse = group.is_some_and(|g| !g.is_full())
            && event.token_ids.len()
                != event.block_hashes.len().saturating_mul(block_size as usize);
        if sparse {
            return self.stored_sparse(rank, event, block_size, tier, group);
        }
        let locals = local_block_hashes(event, block_size)?;
        let blocks = self.ranks.entry(rank).or_default();
        let parent = event.parent_block_hash.filter(|_| !locals.is_empty());
        if let Some(parent) = parent.filter(|p| !blocks.holds(*p)) {
            return Err(Skip::Orphan(parent));
        }
        let new_group = blocks.learn_group(group)?;
        self.block_size.get_or_insert(block_size);
        let stored: Vec<StoredBlock> = event
            .block_hashes
            .iter()
            .zip(locals)
            .map(|(&block_hash, tokens_hash)| StoredBlock {
                block_hash,
                tokens_hash,
            })
            .collect();
        if stored.is_empty() && !new_group {
            return Err(Skip::NoChange);
        }
        let holder = Holder {
            tier,
            group: group.map(|g| g.id),
        };
        blocks.store(holder, parent, &stored);
        Ok(vec![KvCacheEventData::Stored {
            parent_hash: parent,
            blocks: stored,
            tier,
            group,
        }])
    }

    /// A windowed group's store whose `token_ids` do not describe its hashes: placed
    /// through the rank's chain (module docs).
    fn stored_sparse(
        &mut self,
        rank: DpRank,
        event: &BlockStored,
        block_size: u32,
        tier: StorageTier,
        group: Option<KvCacheGroup>,
    ) -> Result<Vec<KvCacheEventData>, Skip> {
        if event.block_size != block_size {
            return Err(LocalHashError::BlockSize {
                event: event.block_size,
                expected: block_size,
            }
            .into());
        }
        let blocks = self.ranks.entry(rank).or_default();
        let runs = blocks.place(&event.block_hashes)?;
        let new_group = blocks.learn_group(group)?;
        if runs.is_empty() {
            return if new_group {
                Ok(vec![KvCacheEventData::Stored {
                    parent_hash: None,
                    blocks: Vec::new(),
                    tier,
                    group,
                }])
            } else {
                Err(Skip::NoChange)
            };
        }
        let holder = Holder {
            tier,
            group: group.map(|g| g.id),
        };
        Ok(runs
            .into_iter()
            .map(|run| {
                blocks.store(holder, run.parent, &run.blocks);
                KvCacheEventData::Stored {
                    parent_hash: run.parent,
                    blocks: run.blocks,
                    tier,
                    group,
                }
            })
            .collect())
    }

    fn removed(&mut self, rank: DpRank, event: &BlockRemoved) -> Result<KvCacheEventData, Skip> {
        let tier = tier_of_medium(event.medium.as_deref())?;
        let Some(blocks) = self.ranks.get_mut(&rank) else {
            return Err(Skip::NoChange);
        };
        if let Some(why) = event.group_idx.and_then(|idx| blocks.refused(idx)) {
            return Err(why.clone().into());
        }
        let group = event.group_idx.map(GroupId);
        let holder = Holder { tier, group };
        let gone: Vec<ExternalBlockHash> = event
            .block_hashes
            .iter()
            .copied()
            .filter(|hash| blocks.remove(holder, *hash))
            .collect();
        if gone.is_empty() {
            return Err(Skip::NoChange);
        }
        Ok(KvCacheEventData::Removed {
            block_hashes: gone,
            tier,
            group,
        })
    }
}

#[cfg(test)]
mod tests;
