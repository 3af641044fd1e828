//! Applying a batch in steps of a bounded number of blocks, so that the concurrent
//! front can let waiting queries read the shard between two steps.
//!
//! Why: a 4,096-block `Stored` (an engine storing a long prefill at once) or
//! `Removed` (an eviction sweep) takes about 0.5 ms to apply at 1M entries. Applied
//! whole under the shard's write lock, every query that needs the shard meanwhile
//! waits for all of it (the p99.9 loss against Dynamo's readers in
//! `docs/benchmarks.md`, "Floods of large batches"). In steps, a query waits for one
//! step at most.
//!
//! How: an event is *decided* once, when its first part is applied (ordering rules,
//! cursor, buffering: [`OrderedIndex`]'s module docs); its blocks are then applied
//! until the caller's [`Interrupt`] says a query waits, the rest later from where it
//! stopped ([`crate::RadixTree::apply_event_from`]: a store's rest hangs below its
//! last applied block), and it is counted once, when its last block is applied. A
//! query between two steps may see a prefix of a `Stored` chain or part of a
//! `Removed`, states the engine's cache also passes through.
//!
//! The rule for callers: between two steps of one batch, no other write may touch
//! the index. A worker removal, resync or recovery reply applied between two parts of
//! an event would be undone by the rest of the event, and a snapshot taken between
//! them would pair the advanced cursor with part of the event. The front holds a
//! per-shard writer mutex from a batch's first step to its last
//! (`crate::inline`).
//!
//! Cost: while nothing waits, one comparison per block and a call to `stop` every
//! `every` blocks and between events; a step ends only when a query waits.

use super::OrderedIndex;
use crate::recovery::RecoveryNeed;
use crate::tree::{ApplyOutcome, Interrupt, Progress};
use kv_events::KvEventBatch;

/// Where a batch applied in steps stands: its next event, the next block of an event
/// applied in parts, and the recoveries to perform so far. Start each batch with
/// [`BatchSteps::default`].
#[derive(Debug, Default)]
pub struct BatchSteps {
    begun: bool,
    event: usize,
    part: Option<Part>,
    needs: Vec<RecoveryNeed>,
}

/// An event decided and partly applied.
#[derive(Debug)]
struct Part {
    progress: Progress,
    outcome: ApplyOutcome,
}

impl BatchSteps {
    /// The recoveries the batch called for (complete once the last step returned
    /// true).
    pub fn into_needs(self) -> Vec<RecoveryNeed> {
        self.needs
    }
}

impl OrderedIndex {
    /// Applies the next step of `batch`: its events in order until the batch is done
    /// or `interrupt` stops it (between two events, or inside a long one at a block
    /// boundary). A step applies at least one block or one event, so steps always end.
    /// Returns true once the batch is fully applied. `steps` carries the position
    /// between calls and must start at its default for each batch; the batch must
    /// not change between steps, and no other write may reach this index between two
    /// steps (module docs).
    pub fn apply_batch_step(
        &mut self,
        batch: &KvEventBatch,
        steps: &mut BatchSteps,
        interrupt: Interrupt<'_>,
    ) -> bool {
        if !steps.begun {
            steps.begun = true;
            self.counters.record_batch();
        }
        let mut progressed = false;
        while let Some(event) = batch.events.get(steps.event) {
            if progressed && (interrupt.stop)() {
                return false;
            }
            progressed = true;
            let mut part = match steps.part.take() {
                Some(part) => part,
                None if self.decide(batch.worker_id, batch.epoch, event, &mut steps.needs) => {
                    Part {
                        progress: Progress::default(),
                        outcome: ApplyOutcome::default(),
                    }
                }
                None => {
                    steps.event += 1;
                    continue;
                }
            };
            let applied =
                (self.tree).apply_event_from(batch.worker_id, event, &mut part.progress, interrupt);
            match applied {
                Ok(outcome) if !part.progress.is_done() => {
                    part.outcome += outcome;
                    steps.part = Some(part);
                    return false;
                }
                Ok(outcome) => {
                    part.outcome += outcome;
                    let result = Ok(part.outcome);
                    self.settle(batch.worker_id, event, result, &mut steps.needs);
                    steps.event += 1;
                }
                Err(error) => {
                    // The parts before were applied: their blocks are counted, and the
                    // event as refused (only a part whose parent was pruned or removed
                    // in between can be refused after the first).
                    self.counters.record_outcome(&part.outcome);
                    self.settle(batch.worker_id, event, Err(error), &mut steps.needs);
                    steps.event += 1;
                }
            }
        }
        true
    }
}

#[cfg(test)]
mod tests;
