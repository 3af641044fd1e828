//! Applying events to the [`RadixTree`]: stores, removes and rank releases, in terms
//! of runs (see `tree/runs.rs` for how runs extend, split and merge).

use super::arena::{self, Arena, BlockId, NodeIdx};
use super::ranks::BlockRef;
use super::rankset::RankIdx;
use super::{ApplyOutcome, RadixTree, is_live};
use crate::error::ApplyError;
use kv_events::{ExternalBlockHash, StorageTier, StoredBlock, WorkerRank};
use std::collections::hash_map::Entry;

impl RadixTree {
    pub(super) fn store(
        &mut self,
        rank: WorkerRank,
        tier: StorageTier,
        parent_hash: Option<ExternalBlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<ApplyOutcome, ApplyError> {
        if blocks.is_empty() && parent_hash.is_none() {
            return Ok(ApplyOutcome::default()); // do not intern a rank that holds nothing
        }
        let tick = self.tick();
        let (idx, mut cur) = match parent_hash {
            None => (self.ranks.intern(rank, tier), BlockId::ROOT),
            Some(parent) => {
                let unknown = ApplyError::UnknownParent {
                    rank,
                    parent_hash: parent,
                };
                let own = self.ranks.lookup(rank, tier);
                let here = own
                    .and_then(|idx| self.ranks.get(idx))
                    .and_then(|state| state.blocks.get(&parent).copied());
                match here {
                    None => {
                        // Not held on this tier: an engine offloading a chain below
                        // parents on another tier (vLLM stores a GPU chain's blocks to
                        // CPU one event at a time). The chain hangs below the block the
                        // rank holds on another tier, fastest first.
                        let other = self
                            .ranks
                            .tiers_of(rank)
                            .filter(|other| Some(*other) != own)
                            .find_map(|other| {
                                let state = self.ranks.get(other)?;
                                let held = *state.blocks.get(&parent)?;
                                is_live(&self.arena, state, held).then_some(held)
                            })
                            .ok_or(unknown)?;
                        if blocks.is_empty() {
                            return Ok(ApplyOutcome::default()); // nothing to hold on `tier`
                        }
                        let run = self.arena.run_of(other.id);
                        self.arena.node(run).last_used.stored(tick);
                        (self.ranks.intern(rank, tier), other.id)
                    }
                    Some(held) => {
                        let idx = own.ok_or(unknown)?; // `here` is Some only when `own` is
                        let state = self.ranks.get_mut(idx).ok_or(unknown)?;
                        if !is_live(&self.arena, state, held) {
                            // Children of a forgotten block are forgotten too.
                            state.blocks.insert(parent, BlockRef::FORGOTTEN);
                            for block in blocks {
                                if let Some(old) =
                                    state.blocks.insert(block.block_hash, BlockRef::FORGOTTEN)
                                {
                                    if is_live(&self.arena, state, old) {
                                        // A live block under a forgotten parent: keep it.
                                        state.blocks.insert(block.block_hash, old);
                                    }
                                    continue;
                                }
                                state.forgotten += 1;
                            }
                            return Err(ApplyError::ForgottenParent {
                                rank,
                                parent_hash: parent,
                            });
                        }
                        let run = self.arena.run_of(held.id);
                        self.arena.node(run).last_used.stored(tick);
                        (idx, held.id)
                    }
                }
            }
        };
        let mut outcome = ApplyOutcome::default();
        let Some(state) = self.ranks.get_mut(idx) else {
            return Ok(outcome); // unreachable: `idx` was just interned or looked up
        };
        // Existing blocks the rank now holds too, not yet added to their run's
        // holders: one contiguous piece of one run, so that a store over part of a
        // run splits it at most twice, not once per block.
        let mut pending: Option<Pending> = None;
        state.warm(blocks.iter().map(|block| &block.block_hash));
        for (k, block) in blocks.iter().enumerate() {
            // One hash-map probe per block: the entry stays open while the arena
            // changes (the arena and the rank's other fields are separate borrows).
            let entry = state.blocks.entry(block.block_hash);
            if let Entry::Occupied(held) = &entry {
                let held = *held.get();
                if state.forgotten == 0 || self.arena.generation(held.id) == held.generation {
                    outcome.already_present += 1;
                    cur = held.id;
                    let run = self.arena.run_of(cur);
                    self.arena.node(run).last_used.stored(tick);
                    continue;
                }
                // A forgotten block stored again: its entry is revived below.
                state.forgotten -= 1;
                outcome.forgotten += 1;
            }
            let id = match self.arena.next(cur, block.tokens_hash) {
                Some(id) => {
                    if hold(&mut self.arena, &mut pending, id, idx, tick) {
                        *state.aliases.entry(id).or_insert(0) += 1;
                    }
                    id
                }
                None => {
                    flush(&mut self.arena, &mut pending, idx);
                    let more = blocks.len() - k - 1;
                    self.arena
                        .new_child(cur, block.tokens_hash, idx, tick, more)
                }
            };
            let held = BlockRef {
                id,
                generation: self.arena.generation(id),
            };
            match entry {
                Entry::Occupied(mut old) => {
                    old.insert(held);
                }
                Entry::Vacant(slot) => {
                    slot.insert(held);
                }
            }
            self.entries += 1;
            outcome.stored += 1;
            cur = id;
        }
        flush(&mut self.arena, &mut pending, idx);
        Ok(outcome)
    }

    pub(super) fn remove(
        &mut self,
        rank: WorkerRank,
        tier: StorageTier,
        block_hashes: &[ExternalBlockHash],
    ) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        let state = self
            .ranks
            .lookup(rank, tier)
            .and_then(|idx| Some((idx, self.ranks.get_mut(idx)?)));
        let Some((idx, state)) = state else {
            outcome.unknown_removed = block_hashes.len() as u64;
            return outcome;
        };
        let mut dropped = Vec::new();
        state.warm(block_hashes.iter());
        for hash in block_hashes {
            let Some(held) = state.blocks.remove(hash) else {
                outcome.unknown_removed += 1;
                continue;
            };
            if !is_live(&self.arena, state, held) {
                state.forgotten -= 1;
                outcome.forgotten += 1;
                continue;
            }
            outcome.removed += 1;
            self.entries -= 1;
            match state.aliases.get_mut(&held.id) {
                Some(extra) if *extra > 1 => *extra -= 1,
                Some(_) => {
                    state.aliases.remove(&held.id);
                }
                None => dropped.push(held.id),
            }
        }
        self.drop_blocks(idx, &mut dropped);
        outcome
    }

    /// Drops `rank` from the blocks `ids` (which it holds, each once), one contiguous
    /// piece of a run at a time: removing a whole chain is one change of its run, not
    /// one split per block. The end state does not depend on the order.
    fn drop_blocks(&mut self, rank: RankIdx, ids: &mut [BlockId]) {
        let arena = &mut self.arena;
        ids.sort_unstable_by_key(|id| {
            let slot = arena.slot(*id);
            (slot.node, slot.offset)
        });
        // Pieces as (first block, length). Dropping one piece splits runs only at its
        // own ends and frees or merges whole runs, so every other piece stays
        // contiguous in one run: it is found again from its first block.
        let mut pieces: Vec<(BlockId, usize)> = Vec::new();
        let mut last: Option<arena::Slot> = None;
        for id in ids.iter() {
            let slot = arena.slot(*id);
            match (last, pieces.last_mut()) {
                (Some(prev), Some(piece))
                    if prev.node == slot.node && prev.offset + 1 == slot.offset =>
                {
                    piece.1 += 1;
                }
                _ => pieces.push((*id, 1)),
            }
            last = Some(slot);
        }
        for (first, len) in pieces {
            let slot = arena.slot(first);
            let start = slot.offset as usize;
            arena.drop_holder(slot.node, start, start + len, rank);
        }
    }

    pub(super) fn release_rank(&mut self, idx: RankIdx) -> ApplyOutcome {
        let Some(state) = self.ranks.release(idx) else {
            return ApplyOutcome::default();
        };
        // The rank holds every block of each run it is a holder of, so it leaves
        // whole runs: first drop it from every run (no structural change), then free
        // or merge them, naming each by one of its blocks (runs move, blocks do not).
        let mut live: Vec<BlockRef> = state
            .blocks
            .values()
            .filter(|held| is_live(&self.arena, &state, **held))
            .copied()
            .collect();
        let removed = live.len() as u64;
        self.entries -= live.len();
        live.sort_unstable_by_key(|held| self.arena.run_of(held.id));
        live.dedup_by_key(|held| self.arena.run_of(held.id));
        for held in &live {
            let run = self.arena.run_of(held.id);
            self.arena.update(run, |r| r.holders.remove(idx));
        }
        for held in &live {
            if self.arena.generation(held.id) == held.generation {
                self.arena.tidy(self.arena.run_of(held.id));
            }
        }
        ApplyOutcome {
            removed,
            forgotten: state.forgotten,
            ..ApplyOutcome::default()
        }
    }
}

/// Blocks of one run that a store found the rank now holds: `start..end` of `node`.
struct Pending {
    node: NodeIdx,
    start: usize,
    end: usize,
}

/// The storing rank `rank` also holds the existing block `id` now: extends the
/// pending piece when `id` continues it, else adds the pending piece to its run's
/// holders and starts a new one. True when `rank` already held the block (under
/// another engine hash: an alias).
fn hold(
    arena: &mut Arena,
    pending: &mut Option<Pending>,
    id: BlockId,
    rank: RankIdx,
    tick: u32,
) -> bool {
    let slot = arena.slot(id);
    let offset = slot.offset as usize;
    arena.node(slot.node).last_used.stored(tick);
    if let Some(p) = pending.as_mut()
        && p.node == slot.node
    {
        if (p.start..p.end).contains(&offset) {
            return true;
        }
        if offset == p.end {
            p.end += 1;
            return false;
        }
    }
    flush(arena, pending, rank);
    let slot = arena.slot(id); // the flush may have moved the block
    if arena.node(slot.node).holders.contains(rank) {
        return true;
    }
    let offset = slot.offset as usize;
    *pending = Some(Pending {
        node: slot.node,
        start: offset,
        end: offset + 1,
    });
    false
}

/// Adds the pending piece, if any, to its run's holders.
fn flush(arena: &mut Arena, pending: &mut Option<Pending>, rank: RankIdx) {
    if let Some(p) = pending.take() {
        arena.add_holder(p.node, p.start, p.end, rank);
    }
}
