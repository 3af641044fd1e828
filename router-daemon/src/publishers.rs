//! Who may publish KV events, up to which epoch, and the short, bounded wait of the
//! batches that arrive before their publisher's registration.
//!
//! Why: the index must only ever hold what registered workers published, at the epoch
//! they registered. Before this rule, events from 1,000 worker ids that no etcd key
//! named were indexed forever (64,000 entries, 1,000 new metric series), and one batch
//! on worker 1's subject carrying a newer epoch wiped worker 1's index and had its
//! real events dropped as stale until it re-registered. Now:
//!
//! - a batch from a registered worker whose `epoch` is at most the registered one goes
//!   to the indexer (which drops older epochs as stale, as before);
//! - a batch from an unregistered worker, or of a newer epoch than registered, is
//!   **held**: its registration may be in flight (a publisher registers, then
//!   publishes, and etcd's watch and NATS race). When discovery registers the worker
//!   (or its newer epoch), the held batches are applied in arrival order before any
//!   later batch. After the grace window they are dropped and counted
//!   (`kv_router_messages_total{kind="events", outcome="unregistered"|"future_epoch"}`);
//!   when the hold is full the oldest is dropped first.
//!
//! So an epoch moves forward only through the worker's own registration, which only
//! the worker's etcd credentials can write (`docs/security.md`).
//!
//! [`Publishers`] is written by discovery and read by every event intake task through
//! a `watch` channel (a copy of the map per registration change: O(workers), rare).
//! [`Hold`] is owned by one intake task: plain data, tested without a runtime. It
//! holds a bare [`KvEventBatch`], or one with where it came from ([`HeldBatch`]): the
//! JetStream intake keeps each held batch's stream sequence, so its snapshots never
//! claim a batch still waiting.
//! Memory: at most `capacity` batches, each bounded by `--max-message-bytes`.

use kv_events::{KvEventBatch, WorkerId};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Registered workers and the epoch each registered (0: no epochs).
pub(crate) type RegisteredEpochs = Arc<HashMap<WorkerId, u64>>;

/// The registered publishers, shared by discovery (writer) and intake (readers).
#[derive(Debug, Clone)]
pub struct Publishers {
    tx: Arc<watch::Sender<RegisteredEpochs>>,
}

impl Default for Publishers {
    fn default() -> Self {
        Self {
            tx: Arc::new(watch::Sender::new(RegisteredEpochs::default())),
        }
    }
}

impl Publishers {
    /// Records (or updates) `worker`'s registered `epoch`.
    pub(crate) fn register(&self, worker: WorkerId, epoch: u64) {
        self.tx.send_if_modified(|map| {
            if map.get(&worker) == Some(&epoch) {
                return false;
            }
            Arc::make_mut(map).insert(worker, epoch);
            true
        });
    }
    pub(crate) fn remove(&self, worker: WorkerId) {
        self.tx
            .send_if_modified(|map| Arc::make_mut(map).remove(&worker).is_some());
    }

    /// A receiver of every change, for an intake task.
    pub(crate) fn subscribe(&self) -> watch::Receiver<RegisteredEpochs> {
        self.tx.subscribe()
    }
}

/// How long and how many batches an intake task holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldConfig {
    /// How long a batch waits for its registration (default 5 s: etcd's watch
    /// delivers a put in milliseconds; the margin covers a slow etcd).
    pub grace: Duration,
    /// Most batches held at once, over all workers (default 1,024).
    pub capacity: usize,
}

impl Default for HoldConfig {
    fn default() -> Self {
        Self {
            grace: Duration::from_secs(5),
            capacity: 1024,
        }
    }
}

/// Why a batch is held (and, when it is dropped, the counted outcome).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HoldReason {
    /// No registration names the worker.
    Unregistered,
    /// The batch's epoch is newer than the worker's registered one.
    FutureEpoch,
}

/// A held batch given up on: its worker and epoch, and why it was held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dropped {
    /// The publishing worker.
    pub worker_id: WorkerId,
    /// The batch's epoch.
    pub epoch: u64,
    /// Why it was held.
    pub reason: HoldReason,
}

/// What a [`Hold`] holds: a batch, possibly with where it came from.
pub(crate) trait HeldBatch {
    /// The batch itself.
    fn batch(&self) -> &KvEventBatch;
}

impl HeldBatch for KvEventBatch {
    fn batch(&self) -> &KvEventBatch {
        self
    }
}

/// A batch and its position in its source (e.g. a JetStream stream sequence).
impl<P> HeldBatch for (KvEventBatch, P) {
    fn batch(&self) -> &KvEventBatch {
        &self.0
    }
}

#[derive(Debug)]
struct Held<B> {
    until: Instant,
    batch: B,
}

/// The batches one intake task holds, each a `B` ([`HeldBatch`]); see the module docs.
#[derive(Debug)]
pub(crate) struct Hold<B = KvEventBatch> {
    config: HoldConfig,
    held: VecDeque<Held<B>>,
}

/// Whether `batch` may be applied under `registered`, or why not.
fn verdict(batch: &KvEventBatch, registered: &HashMap<WorkerId, u64>) -> Option<HoldReason> {
    match registered.get(&batch.worker_id) {
        None => Some(HoldReason::Unregistered),
        Some(&epoch) if batch.epoch > epoch => Some(HoldReason::FutureEpoch),
        Some(_) => None,
    }
}

impl<B: HeldBatch> Hold<B> {
    /// An empty hold.
    pub(crate) fn new(config: HoldConfig) -> Self {
        Self {
            config,
            held: VecDeque::new(),
        }
    }

    /// Batches held now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether nothing is held.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Takes a batch that arrived at `now`: `Ok(batch)` to apply it, or `Err` with
    /// the batch dropped to make room if it had to be held and the hold was full
    /// (`Err(None)`: held, nothing dropped).
    ///
    /// # Errors
    /// As described: the batch is not to be applied now.
    pub(crate) fn admit(
        &mut self,
        batch: B,
        registered: &HashMap<WorkerId, u64>,
        now: Instant,
    ) -> Result<B, Option<Dropped>> {
        if verdict(batch.batch(), registered).is_none() {
            return Ok(batch);
        }
        let evicted = if self.held.len() >= self.config.capacity {
            self.held
                .pop_front()
                .map(|h| dropped(h.batch.batch(), registered))
        } else {
            None
        };
        self.held.push_back(Held {
            until: now + self.config.grace,
            batch,
        });
        Err(evicted)
    }

    /// The held batches that `registered` now allows, in arrival order.
    pub(crate) fn release(&mut self, registered: &HashMap<WorkerId, u64>) -> Vec<B> {
        let (ready, waiting): (VecDeque<Held<B>>, VecDeque<Held<B>>) =
            std::mem::take(&mut self.held)
                .into_iter()
                .partition(|h| verdict(h.batch.batch(), registered).is_none());
        // Both keep arrival order, so `held` stays sorted by deadline.
        self.held = waiting;
        ready.into_iter().map(|h| h.batch).collect()
    }

    /// Drops the batches whose grace ended at or before `now`.
    pub(crate) fn expire(
        &mut self,
        now: Instant,
        registered: &HashMap<WorkerId, u64>,
    ) -> Vec<Dropped> {
        let mut out = Vec::new();
        while self.held.front().is_some_and(|h| h.until <= now) {
            if let Some(h) = self.held.pop_front() {
                out.push(dropped(h.batch.batch(), registered));
            }
        }
        out
    }

    /// When the oldest held batch's grace ends.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.held.front().map(|h| h.until)
    }

    /// The batch held longest (the first to arrive of those still held).
    pub(crate) fn oldest(&self) -> Option<&B> {
        self.held.front().map(|h| &h.batch)
    }
}

fn dropped(batch: &KvEventBatch, registered: &HashMap<WorkerId, u64>) -> Dropped {
    Dropped {
        worker_id: batch.worker_id,
        epoch: batch.epoch,
        reason: verdict(batch, registered).unwrap_or(HoldReason::Unregistered),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(worker: u64, epoch: u64) -> KvEventBatch {
        KvEventBatch {
            worker_id: WorkerId(worker),
            epoch,
            events: Vec::new(),
        }
    }

    fn registered(entries: &[(u64, u64)]) -> HashMap<WorkerId, u64> {
        entries.iter().map(|&(w, e)| (WorkerId(w), e)).collect()
    }

    const CONFIG: HoldConfig = HoldConfig {
        grace: Duration::from_secs(5),
        capacity: 3,
    };

    #[test]
    fn registered_epochs_pass_and_the_rest_wait_for_their_registration() {
        let mut hold = Hold::new(CONFIG);
        let now = Instant::now();
        let reg = registered(&[(1, 10)]);
        // Worker 1 at its registered epoch or an older one (the indexer drops those).
        assert_eq!(hold.admit(batch(1, 10), &reg, now), Ok(batch(1, 10)));
        assert_eq!(hold.admit(batch(1, 3), &reg, now), Ok(batch(1, 3)));
        // A forged newer epoch, and an unknown worker: held.
        assert_eq!(hold.admit(batch(1, u64::MAX), &reg, now), Err(None));
        assert_eq!(hold.admit(batch(2, 0), &reg, now), Err(None));
        assert_eq!(hold.len(), 2);
        // Worker 2 registers: its batch is released; worker 1's forged epoch stays.
        let released = hold.release(&registered(&[(1, 10), (2, 0)]));
        assert_eq!(released, vec![batch(2, 0)]);
        assert_eq!(hold.len(), 1);
        // Its grace ends: dropped, counted as a future epoch.
        assert!(hold.expire(now + Duration::from_secs(4), &reg).is_empty());
        assert_eq!(
            hold.expire(now + CONFIG.grace, &reg),
            vec![Dropped {
                worker_id: WorkerId(1),
                epoch: u64::MAX,
                reason: HoldReason::FutureEpoch
            }]
        );
        assert!(hold.is_empty() && hold.next_deadline().is_none());
    }

    #[test]
    fn a_registered_new_epoch_releases_in_arrival_order_and_a_full_hold_drops_the_oldest() {
        let mut hold = Hold::new(CONFIG);
        let t0 = Instant::now();
        let none = registered(&[]);
        for (i, w) in [7, 8, 7].into_iter().enumerate() {
            let at = t0 + Duration::from_millis(i as u64);
            assert_eq!(hold.admit(batch(w, 2), &none, at), Err(None));
        }
        // Full: the fourth evicts the oldest (worker 7's first).
        let evicted = hold.admit(batch(9, 0), &none, t0 + Duration::from_millis(3));
        assert_eq!(
            evicted,
            Err(Some(Dropped {
                worker_id: WorkerId(7),
                epoch: 2,
                reason: HoldReason::Unregistered
            }))
        );
        assert_eq!(
            hold.next_deadline(),
            Some(t0 + Duration::from_millis(1) + CONFIG.grace)
        );
        // Worker 7 registered at epoch 1: its epoch-2 batch waits; at epoch 2 it goes.
        assert!(hold.release(&registered(&[(7, 1)])).is_empty());
        let released = hold.release(&registered(&[(7, 2), (8, 5)]));
        assert_eq!(released, vec![batch(8, 2), batch(7, 2)]);
        assert_eq!(hold.len(), 1);
    }

    #[test]
    fn a_hold_keeps_where_each_batch_came_from_and_knows_the_oldest() {
        let mut hold: Hold<(KvEventBatch, u64)> = Hold::new(CONFIG);
        let now = Instant::now();
        let reg = registered(&[(1, 0)]);
        assert_eq!(
            hold.admit((batch(1, 0), 5), &reg, now),
            Ok((batch(1, 0), 5))
        );
        assert_eq!(hold.admit((batch(2, 0), 6), &reg, now), Err(None));
        assert_eq!(hold.admit((batch(3, 0), 7), &reg, now), Err(None));
        assert_eq!(hold.oldest().map(|(_, at)| *at), Some(6));
        let released = hold.release(&registered(&[(1, 0), (2, 0)]));
        assert_eq!(released, vec![(batch(2, 0), 6)]);
        assert_eq!(hold.oldest().map(|(_, at)| *at), Some(7));
        assert_eq!(hold.expire(now + CONFIG.grace, &reg).len(), 1);
        assert_eq!(hold.oldest(), None);
    }

    #[test]
    fn publishers_notify_only_on_a_change() {
        let publishers = Publishers::default();
        let mut rx = publishers.subscribe();
        publishers.register(WorkerId(1), 5);
        assert!(rx.has_changed().expect("sender alive"));
        assert_eq!(rx.borrow_and_update().get(&WorkerId(1)), Some(&5));
        publishers.register(WorkerId(1), 5);
        assert!(
            !rx.has_changed().expect("sender alive"),
            "same epoch: no change"
        );
        publishers.remove(WorkerId(1));
        assert!(rx.borrow_and_update().is_empty());
        publishers.remove(WorkerId(1));
        assert!(!rx.has_changed().expect("sender alive"));
    }
}
