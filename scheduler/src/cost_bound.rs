//! A best-bound-first search over the ranks that hold none of the prompt, for
//! `predicted-ttft` decisions on warmed-up fleets (issue 29, item 1).
//!
//! Why: the decision shortcut ([`crate::shortcut`]) prices only the *touched* ranks
//! and one idle stand-in, so once most ranks are booked, report load or have learned
//! their own timing, a decision is a full scan again. But a rank that holds none of
//! the prompt (overlap 0 on every tier, no in-flight prefill sharing its blocks) has
//! a cost that depends on its own state only, with no reuse credit (module docs of
//! [`crate::policy::predicted_ttft`], `O = L = 0`):
//!
//! ```text
//! cost = pf_r × (P(now) + N) + (max(1, ceil((P(now) + N) / B)) + w_r) × step_r
//! step_r = step_base_r + decode_r × R + kv_read_r × D × block_size
//! w_r = ½ if R > 0, else 0       (the wait for the step the rank is running)
//! ```
//!
//! with `pf_r`, `step_base_r`, `decode_r`, `kv_read_r` the rank's own (calibrated)
//! timing. `P(now)` decays as the oldest prefill completes, but never below the
//! prefill tokens booked behind the oldest one (`P_floor`, see
//! `RankSequences::floor_prefill_tokens`), which changes only when the rank's bookings
//! change. Hence a lower bound of the cost that is exact in its `now`-free part:
//!
//! ```text
//! cost ≥ pf_g × N + key_r,        key_r = pf_r × P_floor + (1 + w_r) × step_r
//! ```
//!
//! where `pf_g ≤ pf_r` is the lower edge of the rank's *group*: ranks are grouped by
//! their prefill multiplier in geometric buckets of [`GROUP_RATIO`], so the bound is
//! at most 1% loose in its `N` term. Within a group the bound is monotone in `key_r`,
//! so each group is a set ordered by `key_r`; a search pops ranks best-bound-first
//! across the groups, prices each exactly, and stops once the next bound exceeds the
//! best exact cost (with a relative slack of [`TIE_SLACK`] so rounding never stops it
//! before a rank of the exact-tie set).
//!
//! Cost: an update (booking, free, first token, calibration change of one rank) is
//! O(log N); a search is O(G log G + popped × log N) for `G` groups (a few dozen when
//! learned multipliers spread over ±30%), and `popped` is the ranks whose bound is
//! within the best exact cost: those with little queue behind their oldest prefill.

use crate::policy::TimingScale;
use crate::policy::predicted_ttft::{StepTimeModel, step_wait};
use kv_events::WorkerRank;
use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, btree_set};

/// The ratio between the prefill multipliers of two neighbouring groups' lower edges.
pub(crate) const GROUP_RATIO: f64 = 1.01;

/// Relative slack of the stop test: a rank whose bound is within this fraction of the
/// best exact cost is still priced (the bound and the exact cost round differently).
pub(crate) const TIE_SLACK: f64 = 1e-9;

/// What the bound of one rank is computed from; all of it changes only when the rank's
/// bookings or calibration change.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RankTerms {
    /// Prefill tokens booked behind the oldest in-flight prefill (`P_floor`), in tokens.
    pub floor_prefill_tokens: u64,
    /// Every in-flight prefill token booked there (at least `P_floor`): an upper
    /// bound of its `P(now)`, in tokens.
    pub total_prefill_tokens: u64,
    /// Active requests (`R`).
    pub active_requests: u64,
    /// KV tokens decode attention reads per step (`D × block_size`), in tokens.
    pub context_tokens: u64,
    /// The rank's timing multipliers.
    pub scale: TimingScale,
}

/// A finite `f64` with a total order (keys are sums of non-negative finite terms).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Key(f64);

impl Eq for Key {}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// The ranks that hold none of the prompt, grouped and ordered by their cost bound
/// (module docs).
#[derive(Debug, Default)]
pub(crate) struct BoundIndex {
    groups: BTreeMap<i32, BTreeSet<(Key, WorkerRank)>>,
    of_rank: HashMap<WorkerRank, Entry>,
    /// The ranks by `P_floor`, for the fleet's smallest backlog.
    by_floor: BTreeSet<(u64, WorkerRank)>,
    /// Σ `P_floor` and Σ total prefill tokens over the indexed ranks.
    floor_sum: u128,
    total_sum: u128,
}

/// Where one rank is in the index.
#[derive(Debug, Clone, Copy)]
struct Entry {
    group: i32,
    key: Key,
    floor: u64,
    total: u64,
}

/// The best ranks a search found: the lowest exact cost (ms) and every rank priced at
/// it, in the order they were popped.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Best {
    pub cost: f64,
    pub ranks: Vec<WorkerRank>,
    /// Ranks priced exactly (for the benchmarks and tests).
    pub priced: usize,
}

impl BoundIndex {
    /// Registered ranks in the index.
    pub(crate) fn len(&self) -> usize {
        self.of_rank.len()
    }

    /// Inserts or moves `rank` under `timing` scaled by its `terms`: O(log N).
    pub(crate) fn set(&mut self, rank: WorkerRank, timing: &StepTimeModel, terms: &RankTerms) {
        self.remove(rank);
        let t = timing.scaled(terms.scale);
        let per_step = t.step_ms(terms.active_requests, terms.context_tokens);
        let key = Key(t.prefill_ms_per_token * terms.floor_prefill_tokens as f64
            + (1.0 + step_wait(terms.active_requests > 0)) * per_step);
        let group = group_of(terms.scale.prefill);
        self.groups.entry(group).or_default().insert((key, rank));
        let (floor, total) = (terms.floor_prefill_tokens, terms.total_prefill_tokens);
        self.by_floor.insert((floor, rank));
        self.floor_sum += u128::from(floor);
        self.total_sum += u128::from(total);
        self.of_rank.insert(
            rank,
            Entry {
                group,
                key,
                floor,
                total,
            },
        );
    }

    /// Σ `P_floor` and Σ total prefill tokens over the indexed ranks, in tokens:
    /// bounds of their Σ `P(now)`.
    pub(crate) fn prefill_sums(&self) -> (u128, u128) {
        (self.floor_sum, self.total_sum)
    }

    /// `rank`'s `P_floor` and total prefill tokens, if indexed.
    pub(crate) fn prefill_of(&self, rank: WorkerRank) -> Option<(u64, u64)> {
        self.of_rank.get(&rank).map(|e| (e.floor, e.total))
    }

    /// The indexed ranks by ascending `P_floor`.
    pub(crate) fn by_floor(&self) -> impl Iterator<Item = (u64, WorkerRank)> + '_ {
        self.by_floor.iter().copied()
    }

    /// Drops `rank` (deregistered): O(log N).
    pub(crate) fn remove(&mut self, rank: WorkerRank) {
        let Some(Entry {
            group,
            key,
            floor,
            total,
        }) = self.of_rank.remove(&rank)
        else {
            return;
        };
        self.by_floor.remove(&(floor, rank));
        self.floor_sum -= u128::from(floor);
        self.total_sum -= u128::from(total);
        if let Some(set) = self.groups.get_mut(&group) {
            set.remove(&(key, rank));
            if set.is_empty() {
                self.groups.remove(&group);
            }
        }
    }

    /// The lowest exact cost of a prompt of `n_tokens` over the indexed ranks, and the
    /// ranks at it. `price(rank)` gives a rank's exact cost in ms, or `None` when it is
    /// not a candidate (skipped); it must be at least the rank's bound (module docs).
    /// `None` when no rank is a candidate.
    pub(crate) fn search(
        &self,
        timing: &StepTimeModel,
        n_tokens: u64,
        mut price: impl FnMut(WorkerRank) -> Option<f64>,
    ) -> Option<Best> {
        let mut cursors: Vec<(f64, btree_set::Iter<'_, (Key, WorkerRank)>)> = Vec::new();
        let mut heap = BinaryHeap::new();
        for (&group, set) in &self.groups {
            let base = group_floor(group) * timing.prefill_ms_per_token * n_tokens as f64;
            let mut it = set.iter();
            if let Some(&(key, rank)) = it.next() {
                heap.push(Reverse((Key(base + key.0), cursors.len(), rank)));
            }
            cursors.push((base, it));
        }
        let mut best: Option<Best> = None;
        let mut priced = 0;
        while let Some(Reverse((bound, at, rank))) = heap.pop() {
            if let Some(b) = &best
                && bound.0 > b.cost + TIE_SLACK * b.cost.abs().max(1.0)
            {
                break;
            }
            let (base, it) = &mut cursors[at];
            if let Some(&(key, next)) = it.next() {
                heap.push(Reverse((Key(*base + key.0), at, next)));
            }
            let Some(cost) = price(rank) else { continue };
            priced += 1;
            match &mut best {
                Some(b) if cost == b.cost => b.ranks.push(rank),
                Some(b) if cost > b.cost => {}
                _ => {
                    best = Some(Best {
                        cost,
                        ranks: vec![rank],
                        priced: 0,
                    })
                }
            }
        }
        best.map(|b| Best { priced, ..b })
    }
}

/// The group of a prefill multiplier: `floor(log_GROUP_RATIO(m))`, clamped so absurd
/// multipliers share the edge groups.
fn group_of(multiplier: f64) -> i32 {
    let m = if multiplier.is_finite() && multiplier > 0.0 {
        multiplier
    } else {
        f64::MIN_POSITIVE
    };
    // Clamped to ±10,000 groups (multipliers e^±99.5), so the cast cannot overflow.
    (m.ln() / GROUP_RATIO.ln())
        .floor()
        .clamp(-10_000.0, 10_000.0) as i32
}

/// A lower bound of every multiplier in `group`, slightly below the edge so rounding
/// in `powi` never puts it above a member's multiplier; 0 for the lowest group, which
/// also holds the non-positive multipliers.
fn group_floor(group: i32) -> f64 {
    if group <= -10_000 {
        return 0.0;
    }
    GROUP_RATIO.powi(group) * (1.0 - 1e-9)
}

/// Ranks whose bookings or calibration changed, or all of them once more than
/// [`Changed::MAX`] are pending (nobody took them: bounded memory).
#[derive(Debug, Clone, Default)]
pub(crate) struct Changed {
    /// The changed ranks, possibly repeated.
    pub ranks: Vec<WorkerRank>,
    /// More changed than `ranks` holds: every rank may have changed.
    pub all: bool,
}

impl Changed {
    const MAX: usize = 65_536;

    /// Notes that `rank` changed.
    pub(crate) fn push(&mut self, rank: WorkerRank) {
        if self.all {
            return;
        }
        if self.ranks.len() >= Self::MAX {
            self.ranks.clear();
            self.all = true;
        } else {
            self.ranks.push(rank);
        }
    }
}

#[cfg(test)]
#[path = "cost_bound_tests.rs"]
mod tests;
