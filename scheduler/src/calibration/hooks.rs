//! Where calibration meets a decision: the multipliers a decision prices with, the
//! features recorded when a request is booked, locally or by a peer replica, and
//! which ranks the bounded search may index (`crate::shortcut_bound`).
//!
//! Why here and not in [`crate::Scheduler`]: only `predicted-ttft` prices with the
//! learned multipliers, and the features are that policy's. Keeping both behind
//! [`Calibration`] lets the scheduler's decision path stay policy-agnostic: it asks
//! for scales and reports bookings, and a policy without a timing model gets none.

use super::Calibration;
use crate::load::RankLoad;
use crate::policy::predicted_ttft::{PredictedTtftConfig, TtftFeatures};
use crate::policy::{Candidate, PolicyConfig, TimingScale};
use crate::request::RequestShape;
use kv_events::{RequestId, WorkerRank};
use std::time::Instant;

impl Calibration {
    /// Fills `out` with one [`TimingScale`] per candidate, in order, when calibration
    /// is on and `policy` prices with a timing model (`predicted-ttft`); leaves it
    /// empty otherwise (a policy reads an empty slice as no scaling).
    pub(crate) fn timing_scales(
        &self,
        policy: &PolicyConfig,
        candidates: &[Candidate],
        out: &mut Vec<TimingScale>,
    ) {
        out.clear();
        if self.enabled() && matches!(policy, PolicyConfig::PredictedTtft(_)) {
            out.extend(candidates.iter().map(|c| self.scale(c.rank)));
        }
    }

    /// Records a local booking of `id` on `chosen` at `now`: the features `policy`
    /// priced (the seed model's under a policy without one). Nothing when off.
    pub(crate) fn book_local(
        &mut self,
        policy: &PolicyConfig,
        request: &RequestShape,
        chosen: &Candidate,
        id: &RequestId,
        now: Instant,
    ) {
        if !self.enabled() {
            return;
        }
        let seeded;
        let config = match policy {
            PolicyConfig::PredictedTtft(c) => c,
            _ => {
                seeded = PredictedTtftConfig {
                    timing: *self.seed(),
                    ..PredictedTtftConfig::default()
                };
                &seeded
            }
        };
        let features = TtftFeatures::of(config, request, chosen);
        self.book(id, chosen.rank, features, now);
    }

    /// The features of a peer replica's booking of `uncached_tokens` prefill tokens
    /// on a rank that held `before` (the peer's own overlap is not known here), for
    /// [`Calibration::book`] once the booking is applied; `None` when off.
    pub(crate) fn peer_features(
        &self,
        uncached_tokens: u64,
        before: impl FnOnce() -> RankLoad,
        block_size: u32,
    ) -> Option<TtftFeatures> {
        self.enabled().then(|| {
            TtftFeatures::new(
                uncached_tokens,
                &before(),
                block_size,
                self.seed().max_num_batched_tokens,
            )
        })
    }

    /// Whether calibration is on and more than half of the `registered` ranks are
    /// priced with their own estimate, which [`Self::visit_own_scales`] would list:
    /// O(1).
    pub(crate) fn most_ranks_apart(&self, registered: usize) -> bool {
        let own = if self.config.warmup_samples == 0 {
            self.ranks.len()
        } else {
            self.warmed.len()
        };
        self.config.enabled && own * 2 > registered
    }

    /// `rank`'s own multipliers once it is warmed up; `None` while it is priced with
    /// the fleet prior, and when calibration is off. With [`Self::prior_scale`] it
    /// gives [`Self::scale`] to the bit, for a decision that reads the prior once.
    pub(crate) fn own_scale(&self, rank: WorkerRank) -> Option<TimingScale> {
        let r = self.warmed_up(rank).filter(|_| self.config.enabled)?;
        Some(super::to_scale(r.rls.theta()))
    }

    /// `rank`'s estimator once it has its own estimate (warmed up, calibration on or
    /// off). While no rank is warmed up (a fleet starting, or one whose frontends
    /// report no first token) it answers without a look-up, which costs a cache miss
    /// per priced rank at 4,096 ranks.
    fn warmed_up(&self, rank: WorkerRank) -> Option<&super::RankState> {
        let warmup = u64::from(self.config.warmup_samples);
        // With no warm-up every rank with an estimator has its own estimate, and
        // none is listed in `warmed`.
        if warmup > 0 && self.warmed.is_empty() {
            return None;
        }
        self.ranks.get(&rank).filter(|r| r.rls.samples() >= warmup)
    }

    /// The multipliers of every rank not warmed up yet: the geometric mean of the
    /// warmed-up ranks' ([`TimingScale::ONE`] while there is none, and when
    /// calibration is off). O(1), with three `exp`.
    pub(crate) fn prior_scale(&self) -> TimingScale {
        if self.config.enabled {
            self.fleet.scale()
        } else {
            TimingScale::ONE
        }
    }

    /// Whether `rank` is priced apart from the fleet prior (its own estimate, or
    /// calibration off): its multipliers change only with its own samples.
    pub(crate) fn prices_apart(&self, rank: WorkerRank) -> bool {
        !self.config.enabled || self.warmed_up(rank).is_some()
    }
}
