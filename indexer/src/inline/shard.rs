//! One shard of the [`crate::Indexer`]: its [`OrderedIndex`] behind a read-write
//! lock, the mutex every writer holds for a whole operation, and the hand-over that
//! lets queries blocked on the read lock in between two steps of a batch (the
//! module docs of `crate::inline` say why and what it costs).

use crate::ordered::{BatchSteps, OrderedIndex};
use crate::recovery::RecoveryNeed;
use crate::tree::Interrupt;
use kv_events::KvEventBatch;
use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};
use std::time::{Duration, Instant};

/// Blocks between two checks, while a batch is applied, for queries waiting on the
/// shard: a query waits for the rest of the writer's minimum hold (`MIN_HOLD`), then at most
/// this many blocks (under 1 µs of apply at 1M entries), plus the hand-over.
pub const STEP_BLOCKS: usize = 8;

/// How long a query that finds its shard held spins before it sleeps on the lock, and
/// a batch's writer that finds it read: a step or a query ends sooner than a thread
/// is put to sleep and woken up again, and a sleeping waiter costs the holder a
/// wake-up call when it unlocks.
const SPIN: Duration = Duration::from_micros(50);

/// How long a batch's writer holds the lock at least before it stops for waiting
/// queries: queries asking back to back would otherwise let it apply only
/// [`STEP_BLOCKS`] blocks per hand-over, which costs more than the blocks.
const MIN_HOLD: Duration = Duration::from_micros(5);

/// How long a writer waits, at the end of a step, for the queries it woke to take
/// their read locks before it takes the write lock again regardless.
const HAND_OVER_DEADLINE: Duration = Duration::from_micros(200);

/// One shard: its index, the mutex every writer holds for a whole operation, and
/// the number of queries blocked on its read lock.
#[derive(Debug)]
pub(super) struct Shard {
    index: RwLock<OrderedIndex>,
    writer: Mutex<()>,
    waiting: AtomicUsize,
}

/// A shard's writer mutex and write lock, held together for one whole operation.
pub(super) struct ShardWrite<'a> {
    _writer: MutexGuard<'a, ()>,
    index: RwLockWriteGuard<'a, OrderedIndex>,
}

impl Deref for ShardWrite<'_> {
    type Target = OrderedIndex;

    fn deref(&self) -> &OrderedIndex {
        &self.index
    }
}

impl DerefMut for ShardWrite<'_> {
    fn deref_mut(&mut self) -> &mut OrderedIndex {
        &mut self.index
    }
}

// A panic while holding a lock cannot leave a shard in a state worse than stopping
// routing would; a poisoned lock is recovered.
impl Shard {
    pub(super) fn new(index: OrderedIndex) -> Self {
        Self {
            index: RwLock::new(index),
            writer: Mutex::new(()),
            waiting: AtomicUsize::new(0),
        }
    }

    pub(super) fn read(&self) -> RwLockReadGuard<'_, OrderedIndex> {
        self.index.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The read lock if no writer holds it now.
    pub(super) fn try_read(&self) -> Option<RwLockReadGuard<'_, OrderedIndex>> {
        match self.index.try_read() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// The read lock of a query that found the shard held: counted in `waiting`
    /// while it waits, so that the writer hands the shard over at its next step. It
    /// spins for up to [`SPIN`], then sleeps on the lock.
    pub(super) fn read_waiting(&self) -> RwLockReadGuard<'_, OrderedIndex> {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let spin_until = Instant::now() + SPIN;
        let guard = loop {
            if let Some(guard) = self.try_read() {
                break guard;
            }
            if Instant::now() >= spin_until {
                break self.read();
            }
            std::hint::spin_loop();
        };
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        guard
    }

    fn lock_writer(&self) -> MutexGuard<'_, ()> {
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn write_lock(&self) -> RwLockWriteGuard<'_, OrderedIndex> {
        self.index.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The write lock for a batch's next step: spins for up to [`SPIN`] while queries
    /// read, then sleeps on the lock.
    fn write_lock_spinning(&self) -> RwLockWriteGuard<'_, OrderedIndex> {
        let spin_until = Instant::now() + SPIN;
        loop {
            match self.index.try_write() {
                Ok(guard) => return guard,
                Err(TryLockError::Poisoned(p)) => return p.into_inner(),
                Err(TryLockError::WouldBlock) if Instant::now() >= spin_until => {
                    return self.write_lock();
                }
                Err(TryLockError::WouldBlock) => std::hint::spin_loop(),
            }
        }
    }

    /// The writer mutex and the write lock, for a write applied whole.
    pub(super) fn write(&self) -> ShardWrite<'_> {
        let writer = self.lock_writer();
        ShardWrite {
            _writer: writer,
            index: self.write_lock(),
        }
    }

    /// The writer mutex and the read lock: a consistent view for a dump or snapshot
    /// (never between two steps of a batch).
    pub(super) fn read_whole(&self) -> (MutexGuard<'_, ()>, RwLockReadGuard<'_, OrderedIndex>) {
        let writer = self.lock_writer();
        (writer, self.read())
    }

    /// Applies `batch` step by step (module docs); returns the recoveries to perform.
    pub(super) fn apply_in_steps(&self, batch: &KvEventBatch) -> Vec<RecoveryNeed> {
        let _writer = self.lock_writer();
        let mut steps = BatchSteps::default();
        let locked_at = Cell::new(Instant::now());
        let interrupt = Interrupt {
            every: STEP_BLOCKS,
            stop: &|| {
                self.waiting.load(Ordering::Acquire) > 0 && locked_at.get().elapsed() >= MIN_HOLD
            },
        };
        loop {
            // A step ends when a query waits; the write lock is released with it.
            let mut index = self.write_lock_spinning();
            locked_at.set(Instant::now());
            let done = index.apply_batch_step(batch, &mut steps, interrupt);
            drop(index);
            if done {
                return steps.into_needs();
            }
            self.let_waiting_queries_in(HAND_OVER_DEADLINE);
        }
    }

    /// Called with the write lock just released: while queries were blocked on it,
    /// gives the ones it woke up until `deadline` has passed to take their read locks.
    fn let_waiting_queries_in(&self, deadline: Duration) {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return;
        }
        let deadline = Instant::now() + deadline;
        while self.waiting.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            // The woken queries may need this core to run.
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ShardSettings;
    use crate::counters::IndexerCounters;
    use crate::tree::tests::events::{batch, stored};
    use std::sync::Arc;

    /// A batch of one one-block `Stored` (engine and local hash `hash`).
    fn store(event_id: u64, parent: Option<u64>, hash: u64) -> KvEventBatch {
        let mut event = stored(0, parent, &[(hash, hash)]);
        event.event_id = event_id;
        batch(1, vec![event])
    }

    /// A query blocked on the read lock while a write is applied reads the shard
    /// before the writer's next write: the hand-over. (Without it the writer, still
    /// running, takes the lock back before the woken query runs.)
    #[test]
    fn a_blocked_query_reads_before_the_next_write() {
        let index = OrderedIndex::new(ShardSettings::default(), Arc::new(IndexerCounters::new()));
        let shard = Arc::new(Shard::new(index));
        let mut write = shard.write_lock();
        assert!(write.apply_batch(&store(0, None, 1)).is_empty());
        let reader = {
            let shard = shard.clone();
            std::thread::spawn(move || shard.read_waiting().stats().entries)
        };
        let began = Instant::now();
        while shard.waiting.load(Ordering::Acquire) == 0 {
            assert!(
                began.elapsed() < Duration::from_secs(10),
                "the query never blocked"
            );
            std::thread::yield_now();
        }
        drop(write);
        shard.let_waiting_queries_in(Duration::from_secs(10));
        assert!(
            shard
                .write_lock()
                .apply_batch(&store(1, Some(1), 2))
                .is_empty()
        );
        assert_eq!(
            reader.join().expect("reader"),
            1,
            "the query read after the next write"
        );
        assert_eq!(shard.read().stats().entries, 2);
    }
}
