//! Applying recovery replies to an [`OrderedIndex`], draining its buffers, and giving
//! up on a recovery.
//!
//! A reply is used only if its token is the rank's pending one. Then:
//! - a **dump** replaces the rank's state when it is at least as new as the index
//!   (a newer epoch, or `next_event_id` not behind the cursor), and the cursor jumps
//!   to the dump's `next_event_id`; an older dump is ignored. Its chains are stored
//!   in order (each in its KV cache group, a block held as `n` copies in `n` chains),
//!   then its placeholders are removed: `unheld` from the group-less group,
//!   `unheld_in_groups` each from its own group;
//! - an **events** range of the cursor's epoch is applied from the cursor on, in
//!   order, stopping at a hole;
//! - anything else (an `error` body, a reply for another rank, events of another
//!   epoch) cannot be used and is handled like an abandoned recovery.
//!
//! Then the buffer is drained from the cursor on: older entries are duplicates, the
//! contiguous run is applied, and a remaining hole starts a new recovery.

use super::{Cursor, OrderedIndex};
use crate::counters::{Counter, IndexerCounters};
use crate::recovery::{RecoveryNeed, RecoveryReason, RecoveryToken};
use kv_events::recovery::{RecoveryBody, RecoveryReply};
use kv_events::{KvCacheEvent, WorkerRank};
use tracing::{info, warn};

impl OrderedIndex {
    /// Applies the reply to the recovery `token` of `rank`; returns further
    /// recoveries to perform (a hole left after it, or a refused parent).
    pub fn apply_recovered(
        &mut self,
        rank: WorkerRank,
        token: RecoveryToken,
        reply: RecoveryReply,
    ) -> Vec<RecoveryNeed> {
        let current = self.cursors.get(&rank).and_then(|c| c.pending);
        if current != Some(token) {
            self.counters.add(Counter::RecoveryRepliesIgnored, 1);
            return Vec::new();
        }
        let for_rank = reply.worker_id == rank.worker_id && reply.dp_rank == rank.dp_rank;
        let usable = for_rank
            && match &reply.body {
                RecoveryBody::Dump { .. } => true,
                RecoveryBody::Events { .. } => {
                    self.cursors.get(&rank).map(|c| c.epoch) == Some(reply.epoch)
                }
                RecoveryBody::Error { .. } => false,
            };
        if !usable {
            if let RecoveryBody::Error { message } = &reply.body {
                warn!(worker_id = %rank.worker_id, dp_rank = %rank.dp_rank, %message, "publisher could not serve recovery");
            } else {
                warn!(worker_id = %rank.worker_id, dp_rank = %rank.dp_rank, "unusable recovery reply");
            }
            return self.abandon_recovery(rank, token);
        }
        if let Some(cursor) = self.cursors.get_mut(&rank) {
            cursor.pending = None;
        }
        let refused = match reply.body {
            RecoveryBody::Dump {
                unheld_in_groups,
                chains,
                unheld,
            } => {
                let unheld = Unheld {
                    plain: unheld,
                    in_groups: unheld_in_groups,
                };
                self.apply_dump(rank, reply.epoch, reply.next_event_id, chains, unheld)
            }
            RecoveryBody::Events { events } => self.apply_range(rank, &events),
            RecoveryBody::Error { .. } => false,
        };
        let mut needs = Vec::new();
        if refused {
            needs.push(self.start_recovery(rank, RecoveryReason::UnknownParent, true));
        } else {
            self.drain(rank, false, &mut needs);
        }
        needs
    }

    /// Replaces the rank's state with a dump if it is not older than the index.
    /// Returns true when a chain was refused for an unknown parent.
    fn apply_dump(
        &mut self,
        rank: WorkerRank,
        epoch: u64,
        next_event_id: u64,
        chains: Vec<kv_events::recovery::StoredChain>,
        unheld: Unheld,
    ) -> bool {
        let Some(cursor) = self.cursors.get_mut(&rank) else {
            return false;
        };
        let newer_epoch = epoch > cursor.epoch;
        if !newer_epoch && (epoch < cursor.epoch || next_event_id < cursor.next) {
            self.counters.add(Counter::RecoveryRepliesIgnored, 1);
            return false;
        }
        if newer_epoch {
            // Buffered events belong to the older epoch.
            cursor.buffer.clear();
        }
        cursor.epoch = epoch;
        cursor.next = next_event_id;
        self.tree.clear_rank(rank);
        let mut blocks = 0;
        let mut refused = false;
        for chain in chains {
            blocks += chain.blocks.len() as u64;
            let event = KvCacheEvent {
                event_id: next_event_id,
                dp_rank: rank.dp_rank,
                data: chain.into_event_data(),
            };
            refused |= self.apply_one(rank.worker_id, &event).is_err();
        }
        // Placeholders: of the group-less (or only) group, then of each group.
        let groups = unheld
            .in_groups
            .into_iter()
            .map(|g| (Some(g.group), g.block_hashes));
        for (group, block_hashes) in std::iter::once((None, unheld.plain)).chain(groups) {
            if block_hashes.is_empty() {
                continue;
            }
            let event = KvCacheEvent {
                event_id: next_event_id,
                dp_rank: rank.dp_rank,
                data: kv_events::KvCacheEventData::Removed {
                    group,
                    block_hashes,
                    tier: kv_events::StorageTier::Gpu,
                },
            };
            let _ = self.apply_one(rank.worker_id, &event); // a remove is never refused
        }
        self.counters.add(Counter::RecoveredDumps, 1);
        self.counters.add(Counter::RecoveredBlocks, blocks);
        info!(worker_id = %rank.worker_id, dp_rank = %rank.dp_rank, epoch, next_event_id, blocks, "kv events recovered from a dump");
        refused
    }

    /// Applies a range of events from the cursor on. Returns true when one was
    /// refused for an unknown parent.
    fn apply_range(&mut self, rank: WorkerRank, events: &[KvCacheEvent]) -> bool {
        let mut applied = 0;
        let mut refused = false;
        for event in events {
            let Some(cursor) = self.cursors.get_mut(&rank) else {
                break;
            };
            if event.event_id < cursor.next || event.dp_rank != rank.dp_rank {
                continue;
            }
            if event.event_id > cursor.next {
                break; // a hole in the reply: the drain asks again
            }
            cursor.next = cursor.next.saturating_add(1);
            applied += 1;
            refused |= self.apply_one(rank.worker_id, event).is_err();
        }
        self.counters.add(Counter::RecoveredRanges, 1);
        self.counters.add(Counter::RecoveredEvents, applied);
        info!(worker_id = %rank.worker_id, dp_rank = %rank.dp_rank, events = applied, "kv events recovered from a range");
        refused
    }

    /// Applies the buffer of `rank` from its cursor on. With `skip_holes`, holes are
    /// jumped over (counted as lost); without, a hole starts a recovery.
    fn drain(&mut self, rank: WorkerRank, skip_holes: bool, needs: &mut Vec<RecoveryNeed>) {
        let counters = self.counters.clone();
        loop {
            let Some(cursor) = self.cursors.get_mut(&rank) else {
                return;
            };
            let Some(event) = pop_next(cursor, &counters) else {
                break;
            };
            if event.event_id > cursor.next {
                if !skip_holes {
                    cursor.buffer.insert(event.event_id, event);
                    needs.push(self.start_recovery(rank, RecoveryReason::Retry, false));
                    return;
                }
                let lost = event.event_id - cursor.next;
                self.counters.add(Counter::EventsLost, lost);
                warn!(worker_id = %rank.worker_id, dp_rank = %rank.dp_rank, from = cursor.next, lost, "kv events lost: skipping a gap");
                cursor.next = event.event_id;
            }
            cursor.next = cursor.next.saturating_add(1);
            if self.apply_one(rank.worker_id, &event).is_err() && !skip_holes {
                needs.push(self.start_recovery(rank, RecoveryReason::UnknownParent, true));
                return;
            }
        }
    }

    /// Gives up the recovery `token` of `rank` (the publisher cannot be reached):
    /// buffered events are applied past their holes, which are counted as lost.
    /// Ignored when `token` is not the rank's pending recovery.
    pub fn abandon_recovery(
        &mut self,
        rank: WorkerRank,
        token: RecoveryToken,
    ) -> Vec<RecoveryNeed> {
        let Some(cursor) = self.cursors.get_mut(&rank) else {
            return Vec::new();
        };
        if cursor.pending != Some(token) {
            return Vec::new();
        }
        cursor.pending = None;
        self.counters.add(Counter::RecoveriesAbandoned, 1);
        warn!(worker_id = %rank.worker_id, dp_rank = %rank.dp_rank, buffered = cursor.buffer.len(), "kv event recovery abandoned");
        let mut needs = Vec::new();
        self.drain(rank, true, &mut needs);
        needs
    }
}

/// The placeholders of a dump: blocks stored by its chains only to place the blocks
/// below them, removed once every chain is stored.
struct Unheld {
    /// Of the rank's group-less (or only) group.
    plain: Vec<kv_events::ExternalBlockHash>,
    /// Of each KV cache group of a hybrid model.
    in_groups: Vec<kv_events::recovery::GroupBlocks>,
}

/// Removes and returns the first buffered event at or after the cursor, dropping
/// (and counting) older ones as duplicates.
fn pop_next(cursor: &mut Cursor, counters: &IndexerCounters) -> Option<KvCacheEvent> {
    while let Some((_, event)) = cursor.buffer.pop_first() {
        if event.event_id >= cursor.next {
            return Some(event);
        }
        counters.add(Counter::DuplicateEvents, 1);
    }
    None
}
