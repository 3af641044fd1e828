//! Registry of workers and their data-parallel ranks: the candidate set of every
//! scheduling decision.
//!
//! Workers arrive from etcd discovery as [`WorkerRegistration`]s; each contributes the
//! ranks `0..dp_size`. Ranks are kept in one sorted `Vec` (ordered by worker id, then
//! dp_rank) so round-robin order and candidate order are deterministic and scheduling
//! can borrow a slice without allocating. Registration changes are rare, so rebuilding
//! that `Vec` on add/remove (O(total ranks)) is the cheap side of the trade. The same
//! holds for the lookup by worker id: every decision asks it for each rank it prices
//! and each rank whose state changed (a B-tree walk: 4–5 nodes of up to 11 key
//! comparisons each at 4,096 workers, most of them cache misses), so the registrations
//! sit in a `Vec` sorted by id behind a hash map of positions, O(1), rebuilt on
//! add/remove (O(workers)).

use crate::error::SchedulerError;
use kv_events::disaggregation::{TransferProtocol, WorkerRole};
use kv_events::discovery::WorkerRegistration;
use kv_events::{DpRank, WorkerId, WorkerRank};
use std::collections::HashMap;

/// Which workers' ranks a decision considers, by their role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// Workers that serve a whole request themselves
    /// ([`WorkerRegistration::serves_whole_requests`]: `both`, and vLLM `decode`
    /// workers). Ranks of other workers do not exist for it (a pinned dp_rank only
    /// they have is unavailable).
    Whole,
    /// Workers that decode (`both`, `decode`): the decode half of a disaggregated
    /// request.
    Decode,
    /// `prefill` workers whose transfer protocol is this one: the prefill half of a
    /// disaggregated request, paired with a decode worker of that protocol.
    Prefill(TransferProtocol),
}

impl Side {
    pub(crate) fn admits(self, reg: &WorkerRegistration) -> bool {
        match self {
            Side::Whole => reg.serves_whole_requests(),
            Side::Decode => reg.role.decodes(),
            Side::Prefill(protocol) => {
                reg.role == WorkerRole::Prefill
                    && reg.kv_transfer.is_some_and(|t| t.protocol == protocol)
            }
        }
    }
}

/// Registered workers, keyed and iterated by [`WorkerId`].
#[derive(Debug, Clone, Default)]
pub struct WorkerRegistry {
    /// The registrations, sorted by worker id.
    workers: Vec<WorkerRegistration>,
    /// Each worker's position in `workers` (foldhash: looked up per priced rank).
    slots: HashMap<WorkerId, usize, foldhash::fast::RandomState>,
    /// Every rank of every worker, sorted by (worker id, dp_rank).
    ranks: Vec<WorkerRank>,
    /// For each registration (same order as `workers`), the position of its rank 0
    /// in `ranks`.
    first_rank: Vec<usize>,
    /// Registered workers whose role is `prefill`.
    prefill_workers: usize,
    /// Registered workers that cannot serve a whole request (`prefill`, and `decode`
    /// without a transfer protocol that allows it).
    partial_workers: usize,
}

impl WorkerRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a worker, replacing any earlier registration with the same id
    /// (a restarted worker may come back with a different `dp_size`).
    ///
    /// Returns the ranks the worker had before and no longer has (non-empty only when
    /// a re-registration shrinks `dp_size`); the caller must drop state kept for them.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidRegistration`] when `dp_size` or `block_size` is 0;
    /// the registry is left unchanged.
    pub fn add(&mut self, reg: WorkerRegistration) -> Result<Vec<WorkerRank>, SchedulerError> {
        reg.validate()?;
        let (id, dp_size) = (reg.worker_id, reg.dp_size);
        let old = match self.workers.binary_search_by_key(&id, |r| r.worker_id) {
            Ok(at) => Some(std::mem::replace(&mut self.workers[at], reg)),
            Err(at) => {
                self.workers.insert(at, reg);
                None
            }
        };
        let vanished = match old {
            Some(old) if old.dp_size > dp_size => (dp_size..old.dp_size)
                .map(|r| WorkerRank::new(id, DpRank(r)))
                .collect(),
            _ => Vec::new(),
        };
        self.rebuild_ranks();
        Ok(vanished)
    }

    /// Unregisters a worker; returns its registration if it was known.
    pub fn remove(&mut self, id: WorkerId) -> Option<WorkerRegistration> {
        let at = *self.slots.get(&id)?;
        let removed = self.workers.remove(at);
        self.rebuild_ranks();
        Some(removed)
    }

    /// The registration of one worker.
    pub fn get(&self, id: WorkerId) -> Option<&WorkerRegistration> {
        self.slots.get(&id).map(|&at| &self.workers[at])
    }

    /// All registrations, in worker id order.
    pub fn list(&self) -> impl ExactSizeIterator<Item = &WorkerRegistration> {
        self.workers.iter()
    }

    /// All registered ranks, sorted by (worker id, dp_rank).
    pub fn ranks(&self) -> &[WorkerRank] {
        &self.ranks
    }

    /// The position of a registered (worker, dp_rank) in [`WorkerRegistry::ranks`];
    /// `None` when it is not registered. One hash lookup, like
    /// [`WorkerRegistry::contains_rank`].
    pub fn rank_index(&self, rank: WorkerRank) -> Option<usize> {
        let &at = self.slots.get(&rank.worker_id)?;
        (rank.dp_rank.0 < self.workers[at].dp_size)
            .then(|| self.first_rank[at] + rank.dp_rank.0 as usize)
    }

    /// Whether this (worker, dp_rank) is currently registered.
    pub fn contains_rank(&self, rank: WorkerRank) -> bool {
        self.rank_index(rank).is_some()
    }

    /// Keeps the registered ranks of `ranks`, in [`WorkerRegistry::ranks`] order and
    /// without repeats. They are marked in `bits` (scratch: one bit per registered
    /// rank, by its position) and read back in order, which costs O(ranks listed +
    /// registered ranks / 64) where a sort and a dedup of the list cost more (about
    /// 5% of a route's CPU at ~30 listed ranks; `docs/benchmarks.md`, "Issue 29 item
    /// 1, round 31").
    pub fn keep_registered_in_order(&self, ranks: &mut Vec<WorkerRank>, bits: &mut Vec<u64>) {
        bits.clear();
        bits.resize(self.ranks.len().div_ceil(64), 0);
        for &r in ranks.iter() {
            if let Some(i) = self.rank_index(r) {
                bits[i / 64] |= 1 << (i % 64);
            }
        }
        ranks.clear();
        for (w, &word) in bits.iter().enumerate() {
            let mut word = word;
            while word != 0 {
                ranks.push(self.ranks[w * 64 + word.trailing_zeros() as usize]);
                word &= word - 1;
            }
        }
    }

    /// Number of registered workers.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether no worker is registered.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Whether a worker of role `prefill` is registered (a disaggregated fleet).
    pub fn has_prefill_workers(&self) -> bool {
        self.prefill_workers > 0
    }

    /// Whether every registered worker serves whole requests ([`Side::Whole`] admits
    /// every rank).
    pub(crate) fn all_serve_whole(&self) -> bool {
        self.partial_workers == 0
    }

    fn rebuild_ranks(&mut self) {
        self.slots.clear();
        (self.slots).extend(
            self.workers
                .iter()
                .enumerate()
                .map(|(at, r)| (r.worker_id, at)),
        );
        self.partial_workers = self
            .workers
            .iter()
            .filter(|reg| !reg.serves_whole_requests())
            .count();
        self.prefill_workers = self
            .workers
            .iter()
            .filter(|reg| reg.role == WorkerRole::Prefill)
            .count();
        self.ranks.clear();
        self.first_rank.clear();
        for reg in &self.workers {
            self.first_rank.push(self.ranks.len());
            self.ranks
                .extend((0..reg.dp_size).map(|r| WorkerRank::new(reg.worker_id, DpRank(r))));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(id: u64, dp_size: u32) -> WorkerRegistration {
        WorkerRegistration {
            worker_id: WorkerId(id),
            dp_size,
            block_size: 16,
            total_kv_blocks: 1000,
            url: None,
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        }
    }

    fn rank(id: u64, dp: u32) -> WorkerRank {
        WorkerRank::new(WorkerId(id), DpRank(dp))
    }

    #[test]
    fn ranks_are_sorted_by_worker_then_dp_rank() {
        let mut registry = WorkerRegistry::new();
        registry.add(reg(9, 1)).unwrap();
        registry.add(reg(2, 3)).unwrap();
        registry.add(reg(5, 2)).unwrap();
        assert_eq!(
            registry.ranks(),
            &[
                rank(2, 0),
                rank(2, 1),
                rank(2, 2),
                rank(5, 0),
                rank(5, 1),
                rank(9, 0)
            ]
        );
        let ids: Vec<_> = registry.list().map(|r| r.worker_id.0).collect();
        assert_eq!(ids, vec![2, 5, 9]);
        assert_eq!(registry.len(), 3);
    }

    #[test]
    fn rank_index_is_the_position_in_ranks_and_none_for_unregistered_ranks() {
        let mut registry = WorkerRegistry::new();
        registry.add(reg(9, 1)).unwrap();
        registry.add(reg(2, 3)).unwrap();
        registry.add(reg(5, 2)).unwrap();
        registry.add(reg(2, 2)).unwrap(); // shrinks worker 2: later positions move
        for (i, &r) in registry.ranks().iter().enumerate() {
            assert_eq!(registry.rank_index(r), Some(i), "{r:?}");
        }
        assert_eq!(
            registry.rank_index(rank(2, 2)),
            None,
            "gone with the shrink"
        );
        assert_eq!(registry.rank_index(rank(5, 2)), None, "past dp_size");
        assert_eq!(registry.rank_index(rank(3, 0)), None, "unregistered worker");
        registry.remove(WorkerId(5));
        assert_eq!(registry.rank_index(rank(9, 0)), Some(2));
    }

    #[test]
    fn keep_registered_in_order_sorts_dedups_and_drops_unregistered_ranks() {
        let mut registry = WorkerRegistry::new();
        registry.add(reg(9, 1)).unwrap();
        registry.add(reg(2, 70)).unwrap(); // past one 64-bit word
        let mut listed = vec![
            rank(9, 0),
            rank(2, 69),
            rank(3, 0), // unregistered worker
            rank(2, 0),
            rank(9, 0),
            rank(9, 1), // past dp_size
            rank(2, 69),
            rank(2, 63),
            rank(2, 64),
        ];
        let mut bits = vec![u64::MAX; 5]; // stale scratch must not leak in
        registry.keep_registered_in_order(&mut listed, &mut bits);
        let expected = [
            rank(2, 0),
            rank(2, 63),
            rank(2, 64),
            rank(2, 69),
            rank(9, 0),
        ];
        assert_eq!(listed, expected);
    }

    #[test]
    fn re_registration_replaces_and_reports_vanished_ranks() {
        let mut registry = WorkerRegistry::new();
        assert!(registry.add(reg(1, 4)).unwrap().is_empty());
        let vanished = registry.add(reg(1, 2)).unwrap();
        assert_eq!(vanished, vec![rank(1, 2), rank(1, 3)]);
        assert_eq!(registry.ranks(), &[rank(1, 0), rank(1, 1)]);
        assert_eq!(registry.get(WorkerId(1)).unwrap().dp_size, 2);
        // Growing reports nothing vanished.
        assert!(registry.add(reg(1, 3)).unwrap().is_empty());
        assert_eq!(registry.ranks().len(), 3);
        assert_eq!(registry.len(), 1);
    }

    #[test]
    fn remove_drops_the_worker_and_its_ranks() {
        let mut registry = WorkerRegistry::new();
        registry.add(reg(1, 2)).unwrap();
        registry.add(reg(2, 1)).unwrap();
        assert_eq!(registry.remove(WorkerId(1)).unwrap().dp_size, 2);
        assert_eq!(registry.ranks(), &[rank(2, 0)]);
        assert!(!registry.contains_rank(rank(1, 0)));
        assert!(registry.remove(WorkerId(1)).is_none());
        registry.remove(WorkerId(2));
        assert!(registry.is_empty());
        assert!(registry.ranks().is_empty());
    }

    #[test]
    fn prefill_workers_are_counted_through_churn() {
        let mut registry = WorkerRegistry::new();
        registry.add(reg(1, 1)).unwrap();
        assert!(!registry.has_prefill_workers());
        let prefill = WorkerRegistration {
            role: WorkerRole::Prefill,
            kv_transfer: Some(kv_events::disaggregation::KvTransfer {
                protocol: kv_events::disaggregation::TransferProtocol::Vllm,
                bootstrap_port: None,
            }),
            ..reg(2, 1)
        };
        registry.add(prefill.clone()).unwrap();
        assert!(registry.has_prefill_workers());
        registry.add(reg(2, 1)).unwrap();
        assert!(!registry.has_prefill_workers(), "re-registered as both");
        registry.add(prefill).unwrap();
        registry.remove(WorkerId(2));
        assert!(!registry.has_prefill_workers());
    }

    #[test]
    fn contains_rank_respects_dp_size() {
        let mut registry = WorkerRegistry::new();
        registry.add(reg(3, 2)).unwrap();
        assert!(registry.contains_rank(rank(3, 0)));
        assert!(registry.contains_rank(rank(3, 1)));
        assert!(!registry.contains_rank(rank(3, 2)));
        assert!(!registry.contains_rank(rank(4, 0)));
    }

    #[test]
    fn lookups_follow_removals_and_replacements() {
        let mut registry = WorkerRegistry::new();
        for (id, dp_size) in [(9, 1), (2, 3), (5, 2)] {
            registry.add(reg(id, dp_size)).unwrap();
        }
        // Removing the first worker shifts the others' positions.
        assert_eq!(registry.remove(WorkerId(2)).map(|r| r.dp_size), Some(3));
        assert!(registry.remove(WorkerId(2)).is_none());
        assert!(registry.get(WorkerId(2)).is_none());
        assert!(!registry.contains_rank(rank(2, 0)));
        assert_eq!(registry.get(WorkerId(5)).map(|r| r.dp_size), Some(2));
        assert_eq!(registry.get(WorkerId(9)).map(|r| r.dp_size), Some(1));
        // A re-registration replaces in place; a new worker lands in id order.
        assert_eq!(registry.add(reg(5, 1)).unwrap(), vec![rank(5, 1)]);
        registry.add(reg(1, 1)).unwrap();
        assert!(registry.contains_rank(rank(5, 0)) && !registry.contains_rank(rank(5, 1)));
        for id in [1, 5, 9] {
            assert_eq!(
                registry.get(WorkerId(id)).map(|r| r.worker_id),
                Some(WorkerId(id))
            );
        }
        let ids: Vec<_> = registry.list().map(|r| r.worker_id.0).collect();
        assert_eq!(ids, vec![1, 5, 9]);
        assert_eq!(registry.ranks(), &[rank(1, 0), rank(5, 0), rank(9, 0)]);
    }

    #[test]
    fn invalid_registration_is_rejected_without_change() {
        let mut registry = WorkerRegistry::new();
        registry.add(reg(1, 1)).unwrap();
        let err = registry.add(reg(1, 0)).unwrap_err();
        assert!(matches!(err, SchedulerError::InvalidRegistration(_)));
        assert_eq!(registry.ranks(), &[rank(1, 0)]);
        let zero_block = WorkerRegistration {
            block_size: 0,
            ..reg(2, 1)
        };
        assert!(registry.add(zero_block).is_err());
        assert_eq!(registry.len(), 1);
    }
}
