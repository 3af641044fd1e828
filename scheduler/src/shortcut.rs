//! The decision shortcut: a `predicted-ttft` decision that looks at the ranks that
//! can differ and one stand-in for the rest, instead of every registered rank.
//!
//! A rank with no booked request, no warmed-up calibration of its own, no overlap,
//! and either no load report or a live one of no load (when busy thresholds are
//! set) with the prompt (GPU or any tier) is *idle*, and every idle rank
//! is priced alike: its load projection is all zeros at any `now` (nothing is
//! booked, so nothing decays), its overlap, lower-tier and in-flight blocks are 0,
//! its liveness tier is the preferred one (never reported, or live), it cannot be
//! busy (every busy threshold needs a load of at least 1), and calibration prices it with the fleet prior. So a
//! decision considers the *touched* ranks — the union of the rank sets of the
//! bookings, the reports no longer live (a prefix of the reports ordered by time) or
//! reporting load, the warmed-up calibrated ranks and the overlap scores,
//! O(touched) — plus
//! one idle rank drawn uniformly (rejection sampling over the registered ranks,
//! fewer than 2 draws on average, since the shortcut is taken only while at least
//! half of the ranks are idle), which stands for all `k` idle ranks:
//! - the fleet-wide figures of `predicted-ttft` are the same with one zero-backlog
//!   candidate as with `k` (the smallest backlog; the delay cap's mean backlog is
//!   given the `k − 1` left out, [`crate::policy::SelectContext::idle_twins`]);
//! - when the stand-in ties with the lowest cost, the choice is drawn again over
//!   the tie set with the stand-in weighted `k`, so the choice stays uniform among
//!   every rank of the exact-tie set, as the full scan's.
//!
//! The chosen cost is exactly the full scan's, and the chosen rank one of its
//! lowest-cost ranks (`shortcut_tests.rs` checks this against the full scan on
//! random fleets). A decision then costs O(touched ranks + prompt blocks) instead of
//! O(registered ranks) (plus registered ranks / 64 words to clear and read back the
//! bit set that orders the touched ranks, `WorkerRegistry::keep_registered_in_order`:
//! at 64 ranks one word, where a sort of ~30 touched ranks was ~5% of a route's CPU). The full scan remains for every other case: other policies,
//! a pinned dp_rank, excluded workers, an eligible set (`eligible_workers`: the
//! stand-in cannot stand for idle ranks some of which are outside the set, and
//! filtering the touched ranks alone would not be cheaper than the scan's one binary
//! search per rank), a request asking for fallbacks (every alternate must be priced,
//! not one stand-in for the idle ranks), a session id, a fleet with workers that do
//! not serve whole requests (disaggregation), overlaps that cannot list their ranks,
//! and more than half of the ranks touched. In that last case the bounded search
//! decides instead (`shortcut_bound.rs`: the ranks that may hold the prompt and
//! those still warming up priced exactly, the others best cost bound first; under
//! busy thresholds — every engine reporting load — the busy ranks are kept out of
//! its index, `shortcut_busy.rs`), unless every rank outside the priced ones is busy:
//! then it is the full scan. Once more than half of the ranks have their own calibration, more
//! than half are touched, so the touched set is not listed (that listing, a registry
//! lookup and a sort per rank, was 70% of a decision's CPU at 4,096 ranks): the
//! decision goes to the bounded search directly.

use crate::Scheduler;
use crate::candidates::{Ask, Seen};
use crate::error::SchedulerError;
use crate::overlap::Overlaps;
use crate::policy::{Candidate, Choice, PolicyConfig, SelectContext, Selector};
use crate::workers::Side;
use kv_events::WorkerRank;

/// The idle rank a shortcut decision drew, and how many idle ranks (itself
/// included) it stands for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StandIn {
    rank: WorkerRank,
    idle: usize,
}

/// How a shortcut decision gathered its candidates.
#[derive(Debug, Clone, Copy)]
enum Shortcut {
    /// The touched ranks and one idle stand-in.
    StandIn(StandIn),
    /// The ranks that may hold the prompt and the best of the others
    /// (`shortcut_bound.rs`), with the delay cap's gate decided over every rank.
    Bounded { delay_cap_gate: bool },
}

impl StandIn {
    /// The idle ranks left out of the candidates.
    pub(crate) fn twins(self) -> usize {
        self.idle - 1
    }
}

impl Scheduler {
    /// Gathers the candidates of a whole request (through the shortcut where it
    /// applies, else the full scan) and chooses one under `policy`.
    ///
    /// # Errors
    /// As [`Scheduler::gather_candidates`].
    pub(crate) fn choose_whole<O: Overlaps + ?Sized>(
        &mut self,
        ask: &Ask<'_, O>,
    ) -> Result<Choice, SchedulerError> {
        let (req, policy) = (ask.req, ask.policy);
        let (overlaps, block_ids, now) = (ask.overlaps, ask.block_ids, ask.now);
        let shortcut = self.gather_shortcut(ask)?;
        if shortcut.is_none() {
            self.gather_candidates(req, overlaps, block_ids, now, Side::Whole)?;
        }
        let (stand_in, delay_cap_gate) = match shortcut {
            Some(Shortcut::StandIn(s)) => (Some(s), None),
            Some(Shortcut::Bounded { delay_cap_gate }) => (None, Some(delay_cap_gate)),
            None => (None, None),
        };
        self.calibration
            .timing_scales(policy, &self.candidates, &mut self.scales);
        let ctx = SelectContext {
            request: req.shape(),
            candidates: &self.candidates,
            batch_remaining: ask.batch_remaining,
            timing_scales: &self.scales,
            idle_twins: stand_in.map_or(0, StandIn::twins),
            delay_cap_gate,
        };
        let mut choice = self.selector.select(policy, &ctx)?;
        if let Some(stand_in) = stand_in {
            let index = spread_over_twins(
                &mut self.selector,
                policy,
                &self.candidates,
                stand_in,
                choice.index,
            );
            choice.cost = self.selector.cost_of(policy, index).or(choice.cost);
            choice.index = index;
        }
        Ok(choice)
    }

    /// Fills `self.candidates` as [`Scheduler::gather_candidates`] would with the
    /// same costs, from the touched ranks and one idle stand-in (module docs), and
    /// returns the stand-in; `Ok(None)`, with nothing gathered, where the shortcut
    /// does not apply.
    ///
    /// # Errors
    /// As [`Scheduler::gather_candidates`].
    fn gather_shortcut<O: Overlaps + ?Sized>(
        &mut self,
        ask: &Ask<'_, O>,
    ) -> Result<Option<Shortcut>, SchedulerError> {
        let (req, overlaps, block_ids, now) = (ask.req, ask.overlaps, ask.block_ids, ask.now);
        let n = self.workers.ranks().len();
        let PolicyConfig::PredictedTtft(config) = ask.policy else {
            return Ok(None);
        };
        if !self.shortcut
            || req.dp_rank.is_some()
            || !req.exclude_workers.is_empty()
            || req.needs_full_scan()
            || req.session_id.is_some()
            || !self.workers.all_serve_whole()
            || n == 0
        {
            return Ok(None);
        }
        let mut touched = std::mem::take(&mut self.touched);
        touched.clear();
        if !overlaps.visit_matched(&mut |r| touched.push(r)) {
            touched.clear();
            self.touched = touched;
            return Ok(None);
        }
        // Most ranks warmed up on their own: more than half are touched, so skip
        // listing them (O(ranks log ranks)) and go to the bounded search.
        if self.calibration.most_ranks_apart(n) {
            return self.take_bounded(ask, config, touched);
        }
        // The registered ones among the matched, booked, unlike-unreported and
        // self-calibrated ranks, sorted and without repeats.
        touched.extend(self.sequences.booked_ranks());
        let busy_checked = self.config.busy.enabled();
        self.reports
            .visit_unlike_unreported(&self.config.liveness, busy_checked, now, |r| {
                touched.push(r)
            });
        self.calibration.visit_own_scales(|r| touched.push(r));
        (self.workers).keep_registered_in_order(&mut touched, &mut self.touched_bits);
        if touched.len() * 2 > n {
            touched.clear();
            overlaps.visit_matched(&mut |r| touched.push(r));
            return self.take_bounded(ask, config, touched);
        }
        let ranks = self.workers.ranks();
        let (rank, at) = loop {
            let r = ranks[self.selector.draw(n)];
            if let Err(at) = touched.binary_search(&r) {
                break (r, at);
            }
        };
        let stand_in = StandIn {
            rank,
            idle: n - touched.len(),
        };
        touched.insert(at, rank);
        self.candidates.clear();
        self.tiers.clear();
        let mut seen = Seen::default();
        for &r in &touched {
            self.consider(r, req, overlaps, block_ids, now, Side::Whole, &mut seen);
        }
        self.touched = touched;
        self.finish_candidates(req, seen)?;
        Ok(Some(Shortcut::StandIn(stand_in)))
    }
}

impl Scheduler {
    /// Gathers the candidates through the bounded search (`shortcut_bound.rs`);
    /// `touched` holds the ranks the index matched, and is kept as the scratch
    /// buffer.
    ///
    /// # Errors
    /// As [`Scheduler::gather_candidates`].
    fn take_bounded<O: Overlaps + ?Sized>(
        &mut self,
        ask: &Ask<'_, O>,
        config: &crate::policy::predicted_ttft::PredictedTtftConfig,
        mut touched: Vec<WorkerRank>,
    ) -> Result<Option<Shortcut>, SchedulerError> {
        let gathered = self.gather_bounded(ask, config, &mut touched);
        if !matches!(gathered, Ok(Some(_))) {
            touched.clear(); // left filled when taken (tests look)
        }
        self.touched = touched;
        Ok(gathered?.map(|delay_cap_gate| Shortcut::Bounded { delay_cap_gate }))
    }
}

/// The index among `candidates` (sorted by rank) of the choice once the stand-in's
/// twins are counted: `chosen` unless the stand-in ties with it, else a uniform draw
/// over the tie set with the stand-in weighted by the idle ranks it stands for.
fn spread_over_twins(
    selector: &mut Selector,
    policy: &PolicyConfig,
    candidates: &[Candidate],
    stand_in: StandIn,
    chosen: usize,
) -> usize {
    let Ok(own) = candidates.binary_search_by_key(&stand_in.rank, |c| c.rank) else {
        return chosen; // left out by liveness, with every idle rank
    };
    let best = selector.cost_of(policy, chosen);
    if selector.cost_of(policy, own) != best {
        return chosen;
    }
    let is_tied = |selector: &Selector, i: usize| i != own && selector.cost_of(policy, i) == best;
    let others = (0..candidates.len())
        .filter(|&i| is_tied(selector, i))
        .count();
    let draw = selector.draw(others + stand_in.idle);
    if draw < stand_in.idle {
        return own;
    }
    (0..candidates.len())
        .filter(|&i| is_tied(selector, i))
        .nth(draw - stand_in.idle)
        .unwrap_or(own)
}
