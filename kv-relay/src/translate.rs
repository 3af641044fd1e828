//! Engine events → our [`KvCacheEventData`], per data-parallel rank. Pure and
//! synchronous.
//!
//! Per rank the translator keeps the blocks the engine holds and which (storage tier,
//! KV cache group) pairs hold each (the engine hash → local hash map and the parents
//! live in the publisher's [`kv_events::journal::EventJournal`], which also answers
//! the router's recovery requests). The engine's `medium` becomes a [`StorageTier`]
//! ([`tier_of_medium`]); the holder sets fold hybrid-model groups into one "cached"
//! fact per (block, tier):
//! - a block is stored on a tier when the first group stores it there, and removed
//!   from the tier when the last group there removes it, so a sliding-window group
//!   dropping old blocks does not hide blocks the full-attention group still holds;
//!   a CPU-offloaded copy is published as a `Stored` on the CPU tier and the GPU
//!   copy's eviction as a `Removed` from the GPU tier, so the router sees both;
//! - a `BlockStored` whose parent the rank does not hold on any tier cannot be placed
//!   in the prefix tree; it is dropped and counted (the engine's next blocks from the
//!   root rebuild the picture);
//! - an event naming a medium this build does not know is dropped and counted
//!   (`unknown_medium`);
//! - `AllBlocksCleared` drops everything of the rank, on every tier.
//!
//! Cost: one hash map entry per held block (≈ 60 bytes), O(blocks) per event.

use crate::config::EngineFormat;
use kv_events::engines::{
    BlockRemoved, BlockStored, EngineEvent, EventForm, LocalHashError, UnknownMedium,
    local_block_hashes, tier_of_medium,
};
use kv_events::{DpRank, ExternalBlockHash, KvCacheEventData, StorageTier, StoredBlock};
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
    /// An event type the relay does not know.
    #[error("unknown engine event type {0:?}")]
    UnknownType(String),
    /// The event names a storage medium the relay does not know.
    #[error(transparent)]
    UnknownMedium(#[from] UnknownMedium),
    /// The event's encoding is excluded by `--engine-format`.
    #[error("{} event refused by --engine-format", .0.as_str())]
    Format(EventForm),
    /// Nothing changed (blocks already held, or removals of blocks still held
    /// elsewhere or never seen).
    #[error("no change")]
    NoChange,
}

impl Skip {
    /// Short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Skip::Hashing(_) => "bad_blocks",
            Skip::Orphan(_) => "orphan",
            Skip::UnknownType(_) => "unknown_type",
            Skip::UnknownMedium(_) => "unknown_medium",
            Skip::Format(_) => "format",
            Skip::NoChange => "no_change",
        }
    }
}

/// A (storage tier, KV cache group) pair that holds a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    tier: StorageTier,
    group: Option<u32>,
}

/// The blocks one rank holds, each with the (tier, group) pairs holding it.
#[derive(Debug, Default)]
struct RankBlocks {
    blocks: HashMap<ExternalBlockHash, Vec<Holder>>,
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

    /// Translates one engine event of `rank`.
    ///
    /// # Errors
    /// [`Skip`] when the event produces no event of ours (counted by the caller).
    pub fn apply(&mut self, rank: DpRank, event: &EngineEvent) -> Result<KvCacheEventData, Skip> {
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
            EngineEvent::BlockRemoved(removed, _) => self.removed(rank, removed),
            EngineEvent::AllBlocksCleared(_) => Ok(self.clear(rank)),
            EngineEvent::Unknown { type_name, .. } => Err(Skip::UnknownType(type_name.clone())),
        }
    }

    /// Forgets every block of `rank` and returns the `cleared` event to publish.
    pub fn clear(&mut self, rank: DpRank) -> KvCacheEventData {
        self.ranks.remove(&rank);
        KvCacheEventData::Cleared
    }

    /// Number of blocks `rank` holds.
    pub fn held(&self, rank: DpRank) -> usize {
        self.ranks.get(&rank).map_or(0, |r| r.blocks.len())
    }

    fn stored(&mut self, rank: DpRank, event: &BlockStored) -> Result<KvCacheEventData, Skip> {
        let tier = tier_of_medium(event.medium.as_deref())?;
        // Until the size is known, the event's own size is tried, and kept only if the
        // event hashes at it (a 0 or inconsistent size fixes nothing).
        let block_size = self.block_size.unwrap_or(event.block_size);
        let locals = local_block_hashes(event, block_size)?;
        self.block_size.get_or_insert(block_size);
        let blocks = &mut self.ranks.entry(rank).or_default().blocks;
        if let Some(parent) = event.parent_block_hash
            && !blocks.contains_key(&parent)
        {
            return Err(Skip::Orphan(parent));
        }
        let holder = Holder {
            tier,
            group: event.group_idx,
        };
        let mut any_new = false;
        for &hash in &event.block_hashes {
            let holders = blocks.entry(hash).or_default();
            any_new |= !holders.iter().any(|h| h.tier == tier);
            if !holders.contains(&holder) {
                holders.push(holder);
            }
        }
        if !any_new {
            return Err(Skip::NoChange);
        }
        Ok(KvCacheEventData::Stored {
            group: None,
            parent_hash: event.parent_block_hash,
            blocks: event
                .block_hashes
                .iter()
                .zip(locals)
                .map(|(&block_hash, tokens_hash)| StoredBlock {
                    block_hash,
                    tokens_hash,
                })
                .collect(),
            tier,
        })
    }

    fn removed(&mut self, rank: DpRank, event: &BlockRemoved) -> Result<KvCacheEventData, Skip> {
        let tier = tier_of_medium(event.medium.as_deref())?;
        let Some(rank_blocks) = self.ranks.get_mut(&rank) else {
            return Err(Skip::NoChange);
        };
        let mut gone = Vec::new();
        for hash in &event.block_hashes {
            let Some(holders) = rank_blocks.blocks.get_mut(hash) else {
                continue;
            };
            // The exact (tier, group) if it holds the block; else any holder on that
            // tier (an engine that omits the group on removal).
            let exact = holders
                .iter()
                .position(|h| h.tier == tier && h.group == event.group_idx);
            let same_tier = || holders.iter().position(|h| h.tier == tier);
            let Some(i) = exact.or_else(same_tier) else {
                continue;
            };
            holders.swap_remove(i);
            if !holders.iter().any(|h| h.tier == tier) {
                gone.push(*hash);
            }
            if holders.is_empty() {
                rank_blocks.blocks.remove(hash);
            }
        }
        if gone.is_empty() {
            return Err(Skip::NoChange);
        }
        Ok(KvCacheEventData::Removed {
            group: None,
            block_hashes: gone,
            tier,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::compute_block_hashes;

    const BS: u32 = 2;

    fn stored(hashes: &[u64], parent: Option<u64>, medium: &str, group: u32) -> EngineEvent {
        let tokens: Vec<u32> = hashes
            .iter()
            .flat_map(|h| [*h as u32, *h as u32 + 1])
            .collect();
        EngineEvent::BlockStored(
            Box::new(BlockStored {
                block_hashes: hashes.iter().copied().map(ExternalBlockHash).collect(),
                parent_block_hash: parent.map(ExternalBlockHash),
                token_ids: tokens,
                block_size: BS,
                medium: Some(medium.into()),
                group_idx: Some(group),
                ..BlockStored::default()
            }),
            EventForm::TaggedMap,
        )
    }

    fn removed(hashes: &[u64], medium: &str, group: Option<u32>) -> EngineEvent {
        EngineEvent::BlockRemoved(
            BlockRemoved {
                block_hashes: hashes.iter().copied().map(ExternalBlockHash).collect(),
                medium: Some(medium.into()),
                group_idx: group,
            },
            EventForm::TaggedMap,
        )
    }

    const R: DpRank = DpRank(0);

    fn translator(format: EngineFormat) -> Translator {
        let mut t = Translator::new(format);
        t.learn_block_size(BS);
        t
    }

    #[test]
    fn the_first_stored_event_fixes_the_block_size_and_others_are_refused() {
        let mut t = Translator::new(EngineFormat::Auto);
        assert_eq!(t.block_size(), None);
        let mut zero = stored(&[10], None, "GPU", 0);
        if let EngineEvent::BlockStored(b, _) = &mut zero {
            b.block_size = 0;
        }
        assert!(matches!(t.apply(R, &zero), Err(Skip::Hashing(_))));
        assert_eq!(
            t.block_size(),
            None,
            "a size that does not hash fixes nothing"
        );
        t.apply(R, &stored(&[10], None, "GPU", 0)).expect("stored");
        assert_eq!(t.block_size(), Some(BS));
        t.learn_block_size(64);
        assert_eq!(t.block_size(), Some(BS), "the size in use stays");
        let mut other = stored(&[11], Some(10), "GPU", 0);
        if let EngineEvent::BlockStored(b, _) = &mut other {
            b.block_size = 4;
            b.token_ids.extend([1, 2]);
        }
        let err = t.apply(R, &other).unwrap_err().to_string();
        assert!(err.contains('4') && err.contains(&BS.to_string()), "{err}");
    }

    #[test]
    fn stores_become_chains_with_local_hashes() {
        let mut t = translator(EngineFormat::Auto);
        let out = t.apply(R, &stored(&[10, 11], None, "GPU", 0)).unwrap();
        let KvCacheEventData::Stored {
            parent_hash,
            blocks,
            ..
        } = out
        else {
            panic!("{out:?}")
        };
        assert_eq!(parent_hash, None);
        assert_eq!(blocks[1].block_hash, ExternalBlockHash(11));
        assert_eq!(
            blocks[1].tokens_hash,
            compute_block_hashes(&[11, 12], BS)[0]
        );
        let child = t.apply(R, &stored(&[12], Some(11), "GPU", 0)).unwrap();
        assert!(matches!(
            child,
            KvCacheEventData::Stored {
                parent_hash: Some(ExternalBlockHash(11)),
                ..
            }
        ));
        assert_eq!(t.held(R), 3);
        // Same blocks again: nothing to publish.
        assert_eq!(
            t.apply(R, &stored(&[10, 11], None, "GPU", 0)),
            Err(Skip::NoChange)
        );
    }

    #[test]
    fn a_block_leaves_a_tier_when_its_last_group_there_removes_it() {
        let mut t = translator(EngineFormat::Auto);
        t.apply(R, &stored(&[10], None, "GPU", 0)).unwrap();
        assert_eq!(
            t.apply(R, &stored(&[10], None, "GPU", 1)),
            Err(Skip::NoChange),
            "a second group on the same tier changes nothing"
        );
        assert_eq!(
            t.apply(R, &removed(&[10], "GPU", Some(1))),
            Err(Skip::NoChange),
            "group 0 still holds it on the GPU"
        );
        assert_eq!(
            t.apply(R, &removed(&[10], "GPU", Some(0))),
            Ok(KvCacheEventData::Removed {
                group: None,
                block_hashes: vec![ExternalBlockHash(10)],
                tier: StorageTier::Gpu,
            })
        );
        assert_eq!(t.held(R), 0);
    }

    #[test]
    fn an_offloaded_copy_is_its_own_tier() {
        let mut t = translator(EngineFormat::Auto);
        t.apply(R, &stored(&[10], None, "GPU", 0)).unwrap();
        // vLLM's offloading connector: the CPU copy (medium "CPU"), later the GPU
        // copy's eviction; the block stays held on the CPU.
        let cpu = t.apply(R, &stored(&[10, 11], None, "CPU", 0)).unwrap();
        assert!(matches!(
            cpu,
            KvCacheEventData::Stored {
                tier: StorageTier::Cpu,
                ref blocks,
                ..
            } if blocks.len() == 2
        ));
        assert_eq!(
            t.apply(R, &removed(&[10], "GPU", Some(0))),
            Ok(KvCacheEventData::Removed {
                group: None,
                block_hashes: vec![ExternalBlockHash(10)],
                tier: StorageTier::Gpu,
            })
        );
        assert_eq!(t.held(R), 2);
        // A GPU child of a block held only on the CPU is not an orphan.
        assert!(t.apply(R, &stored(&[12], Some(11), "GPU", 0)).is_ok());
        assert_eq!(
            t.apply(R, &removed(&[10, 11, 99], "Disk", None)),
            Err(Skip::NoChange),
            "nothing is held on disk"
        );
        assert_eq!(
            t.apply(R, &removed(&[10, 11, 99], "cpu", None)),
            Ok(KvCacheEventData::Removed {
                group: None,
                block_hashes: vec![ExternalBlockHash(10), ExternalBlockHash(11)],
                tier: StorageTier::Cpu,
            })
        );
        assert_eq!(t.held(R), 1);
    }

    #[test]
    fn an_unknown_medium_is_skipped_with_its_reason() {
        let mut t = translator(EngineFormat::Auto);
        let skip = t.apply(R, &stored(&[10], None, "tape", 0)).unwrap_err();
        assert_eq!(skip, Skip::UnknownMedium(UnknownMedium("tape".into())));
        assert_eq!(skip.label(), "unknown_medium");
        assert_eq!(t.held(R), 0);
        t.apply(R, &stored(&[10], None, "GPU", 0)).unwrap();
        assert_eq!(
            t.apply(R, &removed(&[10], "tape", None))
                .unwrap_err()
                .label(),
            "unknown_medium"
        );
        assert_eq!(t.held(R), 1);
    }

    #[test]
    fn orphans_bad_blocks_unknown_types_and_refused_forms_are_skipped() {
        let mut t = translator(EngineFormat::Tagged);
        assert_eq!(
            t.apply(R, &stored(&[5], Some(4), "GPU", 0)),
            Err(Skip::Orphan(ExternalBlockHash(4)))
        );
        let EngineEvent::BlockStored(mut bad, form) = stored(&[5], None, "GPU", 0) else {
            unreachable!()
        };
        bad.token_ids.pop();
        assert!(matches!(
            t.apply(R, &EngineEvent::BlockStored(bad, form)),
            Err(Skip::Hashing(_))
        ));
        let unknown = EngineEvent::Unknown {
            type_name: "BlockUpdated".into(),
            form: EventForm::TaggedMap,
        };
        assert_eq!(
            t.apply(R, &unknown),
            Err(Skip::UnknownType("BlockUpdated".into()))
        );
        let positional = EngineEvent::AllBlocksCleared(EventForm::PositionalArray);
        assert_eq!(
            t.apply(R, &positional),
            Err(Skip::Format(EventForm::PositionalArray))
        );
    }

    #[test]
    fn ranks_are_independent_and_clear_drops_one_rank() {
        let mut t = translator(EngineFormat::Auto);
        t.apply(R, &stored(&[1, 2], None, "GPU", 0)).unwrap();
        t.apply(DpRank(1), &stored(&[1], None, "GPU", 0)).unwrap();
        assert_eq!(
            t.apply(R, &EngineEvent::AllBlocksCleared(EventForm::TaggedMap)),
            Ok(KvCacheEventData::Cleared)
        );
        assert_eq!((t.held(R), t.held(DpRank(1))), (0, 1));
    }
}
