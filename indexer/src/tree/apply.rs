//! Applying events to the [`RadixTree`]: stores and holder releases, in terms of runs
//! (see `tree/runs.rs` for how runs extend, split and merge; removals are in
//! `tree/remove.rs`).
//!
//! Copies: a store of a block the holder already holds counts one more copy in the
//! holder's `copies` map (a second physical block under one engine hash) and a remove
//! drops one; only the last copy's remove changes the tree. The map is empty for
//! engines that never duplicate a block, and the remove path then costs one length
//! check more.

use super::arena::{Arena, BlockId, NodeIdx};
use super::blockmap::BlockRef;
use super::blockmap::Found;
use super::part::Part;
use super::ranks::Holder;
use super::rankset::RankIdx;
use super::{ApplyOutcome, RadixTree, is_live};
use crate::error::ApplyError;
use kv_events::{ExternalBlockHash, StorageTier, StoredBlock, WorkerRank};
use std::num::NonZeroU32;

/// Where a `Stored` event's parent was found.
pub(super) enum ParentAt {
    /// In the storing holder itself (live).
    Own(RankIdx, BlockRef),
    /// Live in another holder of the rank: another group on the same tier, or
    /// another tier.
    Other(BlockId),
    /// The storing holder keeps a tombstone for it (this index pruned it).
    ForgottenOwn(RankIdx),
    /// Only tombstones in the rank's other holders.
    ForgottenOther,
    /// No holder of the rank knows it.
    Unknown,
}

impl RadixTree {
    /// Finds `parent` for a store into `holder`: in the holder, else in the rank's
    /// other groups on the same tier, else on its other tiers (GPU first).
    pub(super) fn find_parent(&self, holder: Holder, parent: ExternalBlockHash) -> ParentAt {
        let own = self.ranks.lookup(holder);
        if let Some(idx) = own
            && let Some(state) = self.ranks.get(idx)
            && let Some(held) = state.blocks.get(&parent)
        {
            return if is_live(&self.arena, state, *held) {
                ParentAt::Own(idx, *held)
            } else {
                ParentAt::ForgottenOwn(idx)
            };
        }
        let others = self.ranks.holders_of(holder.rank);
        let same_tier = |i: &RankIdx| self.ranks.get(*i).is_some_and(|s| s.tier == holder.tier);
        let ordered = (others.iter().filter(|i| same_tier(i)))
            .chain(others.iter().filter(|i| !same_tier(i)))
            .filter(|i| Some(**i) != own);
        let mut forgotten = false;
        for idx in ordered {
            let Some(state) = self.ranks.get(*idx) else {
                continue;
            };
            if let Some(held) = state.blocks.get(&parent) {
                if is_live(&self.arena, state, *held) {
                    return ParentAt::Other(held.id);
                }
                forgotten = true;
            }
        }
        if forgotten {
            ParentAt::ForgottenOther
        } else {
            ParentAt::Unknown
        }
    }

    /// Refuses a store into `holder` whose group the rank already knows with a
    /// window other than `window`.
    pub(super) fn check_window(
        &self,
        holder: Holder,
        window: Option<NonZeroU32>,
    ) -> Result<(), ApplyError> {
        let Some(group) = holder.group else {
            return Ok(());
        };
        match self.ranks.window_of(holder.rank, holder.group) {
            Some(known) if known != window => Err(ApplyError::WindowMismatch {
                rank: holder.rank,
                group,
                window_blocks: window,
                known,
            }),
            _ => Ok(()),
        }
    }

    /// Stores `blocks` as a chain from the root into `rank`'s GPU holder (no group)
    /// without adding copies of blocks it holds: the approximate mode's routing
    /// decisions, which refresh a prefix by storing it again. Prunes like
    /// [`RadixTree::apply_event`].
    pub(crate) fn store_refreshing(
        &mut self,
        rank: WorkerRank,
        blocks: &[StoredBlock],
    ) -> ApplyOutcome {
        let holder = Holder {
            rank,
            tier: StorageTier::Gpu,
            group: None,
        };
        let room = self.make_room(holder, None, blocks.len());
        // A chain from the root cannot be refused.
        let (mut outcome, _) = self
            .store(holder, None, None, blocks, false, Part::WHOLE)
            .unwrap_or_default();
        outcome.pruned = room + self.enforce_bound();
        outcome
    }

    /// Stores `blocks` below `parent_hash` into `holder` (whose group has `window`),
    /// as `part` says (when to stop, how far ahead to warm).
    /// With `copies`, a block the holder already holds adds a copy; without (the
    /// approximate mode's refreshes), it is left as it is. Returns the outcome and how
    /// many blocks were stored: all of them, unless `interrupt` stopped it before
    /// block `k`, when the first `k` are held and the rest can be stored later below
    /// block `k - 1`.
    pub(super) fn store(
        &mut self,
        holder: Holder,
        window: Option<NonZeroU32>,
        parent_hash: Option<ExternalBlockHash>,
        blocks: &[StoredBlock],
        copies: bool,
        Part { interrupt, warm }: Part<'_>,
    ) -> Result<(ApplyOutcome, usize), ApplyError> {
        let rank = holder.rank;
        // An empty store interns a group (the group is known, holding nothing), never
        // a holder without one.
        let intern_empty = holder.group.is_some();
        if blocks.is_empty() && parent_hash.is_none() {
            if intern_empty {
                self.ranks.intern(holder, window);
            }
            return Ok((ApplyOutcome::default(), 0));
        }
        let tick = self.tick();
        let (idx, mut cur) = match parent_hash {
            None => (self.ranks.intern(holder, window), BlockId::ROOT),
            Some(parent) => match self.find_parent(holder, parent) {
                ParentAt::Own(idx, held) => {
                    let run = self.arena.run_of(held.id);
                    self.arena.node(run).last_used.stored(tick);
                    (idx, held.id)
                }
                ParentAt::Other(id) => {
                    // A sparse windowed store below another group's block, or an
                    // engine offloading a chain below parents on another tier (vLLM
                    // stores a GPU chain's blocks to CPU one event at a time).
                    if blocks.is_empty() {
                        if intern_empty {
                            self.ranks.intern(holder, window);
                        }
                        return Ok((ApplyOutcome::default(), 0)); // nothing to hold
                    }
                    let run = self.arena.run_of(id);
                    self.arena.node(run).last_used.stored(tick);
                    (self.ranks.intern(holder, window), id)
                }
                ParentAt::ForgottenOwn(idx) => {
                    self.forget_chain(idx, blocks);
                    return Err(ApplyError::ForgottenParent {
                        rank,
                        parent_hash: parent,
                    });
                }
                ParentAt::ForgottenOther => {
                    if !blocks.is_empty() || intern_empty {
                        let idx = self.ranks.intern(holder, window);
                        self.forget_chain(idx, blocks);
                    }
                    return Err(ApplyError::ForgottenParent {
                        rank,
                        parent_hash: parent,
                    });
                }
                ParentAt::Unknown => {
                    // The store is refused, but it tells that the rank has this group
                    // and its window: the group is known (holding nothing), so the
                    // rank's hybrid hit does not count without it. Every tree does
                    // this, bounded or not: a bounded tree cannot tell a parent it
                    // pruned without trace from one it never saw, and a tree that
                    // learnt the window here refuses a later store naming another
                    // window exactly as one that never pruned.
                    if intern_empty {
                        self.ranks.intern(holder, window);
                    }
                    return Err(ApplyError::UnknownParent {
                        rank,
                        parent_hash: parent,
                    });
                }
            },
        };
        let mut outcome = ApplyOutcome::default();
        let Some(state) = self.ranks.get_mut(idx) else {
            // Unreachable: `idx` was just interned or looked up.
            return Ok((outcome, blocks.len()));
        };
        // Existing blocks the rank now holds too, not yet added to their run's
        // holders: one contiguous piece of one run, so that a store over part of a
        // run splits it at most twice, not once per block.
        let mut pending: Option<Pending> = None;
        // The run `cur` ends while this store appends to it: a run the holder alone
        // holds, with no children, whose last block is `cur` (what a new child or an
        // extension leaves). Each further new block is appended to it directly,
        // without looking for a child or re-checking the run: the common case of a
        // chain continued by one rank.
        let mut tail: Option<NodeIdx> = None;
        let mut check_at = interrupt.every;
        let mut warm_at = 0;
        for (k, block) in blocks.iter().enumerate() {
            if interrupt.stops_at(k, &mut check_at) {
                flush(&mut self.arena, &mut pending, idx);
                return Ok((outcome, k));
            }
            if let Some(ahead) = warm.due(k, blocks.len(), &mut warm_at) {
                state.warm(blocks[ahead].iter().map(|block| &block.block_hash));
            }
            // One probe per block serves the lookup and the insert: the slot found
            // stays valid while only the arena and the rank's other maps change.
            let at = state.blocks.find_or_free(block.block_hash);
            if let Found::Held(_, held) = at {
                if state.forgotten == 0 || self.arena.generation(held.id) == held.generation {
                    if copies {
                        *state.copies.entry(block.block_hash).or_insert(0) += 1;
                        outcome.copies_added += 1;
                    }
                    cur = held.id;
                    tail = None;
                    let run = self.arena.run_of(cur);
                    self.arena.node(run).last_used.stored(tick);
                    continue;
                }
                // A forgotten block stored again: its entry is revived below, without
                // the copies it had when it was pruned.
                state.forgotten -= 1;
                outcome.forgotten += 1;
                if !state.copies.is_empty() {
                    state.copies.remove(&block.block_hash);
                }
            }
            let more = blocks.len() - k - 1;
            let id = match tail {
                // `pending` is empty here: nothing was held since the tail was made.
                Some(run) => self.arena.append(run, block.tokens_hash, tick, more),
                None => match self.arena.next(cur, block.tokens_hash) {
                    Some(id) => {
                        if hold(&mut self.arena, &mut pending, id, idx, tick) {
                            *state.aliases.entry(id).or_insert(0) += 1;
                        }
                        id
                    }
                    None => {
                        flush(&mut self.arena, &mut pending, idx);
                        let id = self
                            .arena
                            .new_child(cur, block.tokens_hash, idx, tick, more);
                        tail = Some(self.arena.run_of(id));
                        id
                    }
                },
            };
            let held = BlockRef {
                id,
                generation: self.arena.generation(id),
            };
            state.blocks.fill(at, block.block_hash, held);
            self.entries += 1;
            outcome.stored += 1;
            cur = id;
        }
        flush(&mut self.arena, &mut pending, idx);
        Ok((outcome, blocks.len()))
    }

    /// Remembers the blocks of a store refused below a forgotten parent as forgotten
    /// in holder `idx`, so that their own children are refused the same way. Blocks
    /// the holder holds live stay as they are.
    fn forget_chain(&mut self, idx: RankIdx, blocks: &[StoredBlock]) {
        let Some(state) = self.ranks.get_mut(idx) else {
            return;
        };
        for block in blocks {
            match state.blocks.insert(block.block_hash, BlockRef::FORGOTTEN) {
                Some(old) if is_live(&self.arena, state, old) => {
                    // A live block under a forgotten parent: keep it.
                    state.blocks.insert(block.block_hash, old);
                }
                Some(_) => {} // already forgotten
                None => state.forgotten += 1,
            }
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
        let copies_removed = state
            .copies
            .iter()
            .filter(|(hash, _)| {
                let held = state.blocks.get(hash);
                held.is_some_and(|held| is_live(&self.arena, &state, *held))
            })
            .map(|(_, extra)| u64::from(*extra))
            .sum();
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
            copies_removed,
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
