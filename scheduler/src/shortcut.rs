//! The decision shortcut: a `predicted-ttft` decision that looks at the ranks that
//! can differ and one stand-in for the rest, instead of every registered rank.
//!
//! A rank with no booked request, no warmed-up calibration of its own, no overlap,
//! and either no load report or a live one of no load (when busy thresholds are
//! set) with the prompt (GPU or any tier) is *idle*, and every idle rank is priced
//! alike: its load projection is all zeros at any `now` (nothing is booked, so
//! nothing decays), its overlap, lower-tier and in-flight blocks are 0, its liveness
//! tier is the preferred one (never reported, or live), it cannot be busy (every
//! busy threshold needs a load of at least 1), and calibration prices it with the
//! fleet prior. So a decision considers the *touched* ranks — the union of the rank
//! sets of the bookings, the reports no longer live (a prefix of the reports ordered
//! by time) or reporting load, the warmed-up calibrated ranks and the overlap scores,
//! O(touched) — plus one idle rank drawn uniformly (rejection sampling over the
//! registered ranks while at least half are idle, fewer than 2 draws on average;
//! else the drawn one found in the touched ranks' bit set), which stands for all `k`
//! idle ranks:
//! - the fleet-wide figures of `predicted-ttft` are the same with one zero-backlog
//!   candidate as with `k` (the smallest backlog; the decision counts the `k − 1`
//!   left out in the delay cap's mean backlog and hands the policy its gate,
//!   [`crate::policy::SelectContext::delay_cap_gate`]);
//! - when the stand-in ties with the lowest cost, the choice is drawn again over
//!   the tie set with the stand-in weighted `k`, so the choice stays uniform among
//!   every rank of the exact-tie set, as the full scan's.
//!
//! Most touched ranks hold none of the prompt (booked with other prompts): those are
//! *priced apart* (`Scheduler::price_apart`), two look-ups each instead of about
//! seven, and only the cheapest of them stay candidates, with the one holding the
//! fleet's smallest backlog when there is no stand-in; the others count in the
//! delay cap's mean backlog alone. That is exact too (the reasons are on
//! `price_apart`).
//!
//! The chosen cost is exactly the full scan's, and the chosen rank one of its
//! lowest-cost ranks (`shortcut_tests.rs` and `shortcut_apart_tests.rs` check this
//! against the full scan on random fleets). A decision then costs O(touched ranks +
//! prompt blocks) instead of O(registered ranks) (plus registered ranks / 64 words
//! to clear and read back the bit set that orders the touched ranks,
//! `WorkerRegistry::keep_registered_in_order`: at 64 ranks one word, where a sort of
//! ~30 touched ranks was ~5% of a route's CPU). The full scan remains for every
//! other case: other policies, a pinned dp_rank, excluded workers, an eligible set
//! (`eligible_workers`: the stand-in cannot stand for idle ranks some of which are
//! outside the set, and filtering the touched ranks alone would not be cheaper than
//! the scan's one binary search per rank), a request asking for fallbacks (every
//! alternate must be priced, not one stand-in for the idle ranks), a session id, a
//! fleet with workers that do not serve whole requests (disaggregation), and
//! overlaps that cannot list their ranks.
//!
//! The bounded search (`shortcut_bound.rs`: the ranks that may hold the prompt and
//! those still warming up priced exactly, the others best cost bound first; under
//! busy thresholds — every engine reporting load — the busy ranks are kept out of its
//! index, `shortcut_busy.rs`) decides instead where it indexes most ranks: once more
//! than half of the ranks have their own calibration (then the touched set is not
//! listed at all: that listing, a registry lookup and a sort per rank, was 70% of a
//! decision's CPU at 4,096 ranks), and with calibration off once more than half are
//! touched. Where every rank outside its priced ones is busy, it gives way to the
//! full scan. With calibration on and most ranks still on the fleet prior (no
//! engine's first tokens reported yet, or too few), it would price every such rank
//! exactly, so more than half touched stays here: before, those decisions fell to
//! the full scan, 1.8× the CPU at 40 in flight over 64 ranks (`docs/benchmarks.md`,
//! "round 33").

use crate::Scheduler;
use crate::candidates::{Ask, Seen};
use crate::error::SchedulerError;
use crate::liveness::Tier;
use crate::overlap::Overlaps;
use crate::policy::predicted_ttft::{self, PredictedTtftConfig};
use crate::policy::{Candidate, Choice, PolicyConfig, SelectContext, Selector};
use crate::workers::Side;
use kv_events::WorkerRank;

/// The idle rank a shortcut decision drew, and how many idle ranks (itself
/// included) it stands for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StandIn {
    /// `None` when every registered rank is touched.
    rank: Option<WorkerRank>,
    idle: usize,
    /// The delay cap's gate, decided over the candidates and the ranks left out of
    /// them: the stand-in's idle twins and the ranks priced apart and dropped.
    delay_cap_gate: bool,
}

/// Scratch of the ranks a stand-in decision prices apart (`Scheduler::price_apart`).
#[derive(Debug, Default)]
pub(crate) struct PricedApart {
    /// The ranks that must go through `consider`: matched, or not like an
    /// unreported rank (sorted once gathered).
    must: Vec<WorkerRank>,
    /// The ranks holding the prompt's first block in flight (most often none).
    holders: Vec<WorkerRank>,
    /// Per touched rank, in order: its candidate and cost when priced apart.
    priced: Vec<Option<(Candidate, f64)>>,
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
        self.idle.saturating_sub(1)
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
            Some(Shortcut::StandIn(s)) => (Some(s), Some(s.delay_cap_gate)),
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
        let mut apart = std::mem::take(&mut self.apart);
        apart.must.clear();
        apart.must.extend_from_slice(&touched);
        touched.extend(self.sequences.booked_ranks());
        let busy_checked = self.config.busy.enabled();
        self.reports
            .visit_unlike_unreported(&self.config.liveness, busy_checked, now, |r| {
                touched.push(r);
                apart.must.push(r);
            });
        self.calibration.visit_own_scales(|r| touched.push(r));
        (self.workers).keep_registered_in_order(&mut touched, &mut self.touched_bits);
        // More than half touched: the bounded search, where it indexes every rank
        // (calibration off). With calibration on, ranks still warming up are priced
        // exactly there anyway, so the touched ranks are priced here instead (most of
        // them apart): a fleet without its own timings, whose booked ranks pass half,
        // no longer falls to the full scan.
        if touched.len() * 2 > n && !self.calibration.enabled() {
            self.apart = apart;
            touched.clear();
            overlaps.visit_matched(&mut |r| touched.push(r));
            return self.take_bounded(ask, config, touched);
        }
        let rank = self.draw_idle(&touched);
        let mut stand_in = StandIn {
            rank,
            idle: n - touched.len(),
            delay_cap_gate: false,
        };
        if let Some(rank) = rank
            && let Err(at) = touched.binary_search(&rank)
        {
            touched.insert(at, rank);
        }
        apart.must.sort_unstable();
        apart.must.dedup();
        let kept = self.price_apart(ask, config, &touched, rank, &mut apart);
        self.candidates.clear();
        self.tiers.clear();
        let mut seen = Seen::default();
        // Left out of the candidates but counted in the delay cap's mean backlog: the
        // stand-in's idle twins (no backlog), then the ranks priced apart and dropped.
        let mut left_out = (stand_in.twins(), 0u64);
        for (&r, priced) in touched.iter().zip(&apart.priced) {
            match priced {
                None => self.consider(r, req, overlaps, block_ids, now, Side::Whole, &mut seen),
                Some((c, cost)) if *cost <= kept.cost || Some(r) == kept.rank => {
                    seen.admit();
                    self.tiers.push(Tier::Preferred);
                    self.candidates.push(*c);
                }
                Some((c, _)) => {
                    seen.admit();
                    left_out.0 += 1;
                    left_out.1 = left_out.1.saturating_add(c.load.active_prefill_tokens);
                }
            }
        }
        self.touched = touched;
        self.apart = apart;
        self.finish_candidates(req, seen)?;
        stand_in.delay_cap_gate = config.delay_cap.applies_with_left_out(
            self.candidates.iter().map(|c| c.load.active_prefill_tokens),
            left_out,
            config.timing.max_num_batched_tokens,
        );
        Ok(Some(Shortcut::StandIn(stand_in)))
    }

    /// Prices apart, into `apart.priced` (parallel to `touched`), every touched rank
    /// that [`Scheduler::consider`] would admit as a candidate holding none of the
    /// prompt, and returns which of them stay candidates.
    ///
    /// Why: such a rank's cost has no reuse credit, so it depends on its own load
    /// and multipliers only, not on the other candidates, and its own predicted TTFT
    /// under the delay cap is that same cost. So of these ranks only those at their
    /// lowest cost can be chosen or set the cap's lowest prediction: a higher one is
    /// capped whenever they are, and costs more than they do when they are not. The
    /// others are left out of the candidates and count only in the cap's mean
    /// backlog. One more stays for the fleet's smallest backlog, which the matching
    /// ranks' credit reads: the idle stand-in (0) when there is one, else the rank
    /// priced apart with the smallest. A rank qualifies when it is not matched by the
    /// index, not set apart by its load report (live or never reported, so of the
    /// preferred tier), holds none of the prompt's blocks in flight, and busy
    /// thresholds are off. Cost: one look-up of its booked load and one of its
    /// calibration, where `consider` and the policy make about seven; whether it
    /// holds the prompt in flight is read once per decision, from the few ranks
    /// holding the prompt's first block (as the bounded search reads it).
    fn price_apart<O: Overlaps + ?Sized>(
        &self,
        ask: &Ask<'_, O>,
        config: &PredictedTtftConfig,
        touched: &[WorkerRank],
        stand_in: Option<WorkerRank>,
        apart: &mut PricedApart,
    ) -> Kept {
        let req = ask.req;
        let shape = req.shape();
        let prior = self.calibration.prior_scale();
        let scaled = self.calibration.enabled();
        let plain = !self.config.busy.enabled();
        let mut best = f64::INFINITY;
        let mut least = (u64::MAX, stand_in);
        // A rank holds part of the prompt in flight (and is credited for it) exactly
        // when it holds its first chained block: listed once (sorted: a shared system
        // prompt may be in flight on many ranks), not probed per rank.
        apart.holders.clear();
        if let Some(&first) = ask.block_ids.first() {
            (apart.holders).extend(self.sequences.ranks_holding_first(first));
            apart.holders.sort_unstable();
        }
        apart.priced.clear();
        apart.priced.extend(touched.iter().map(|&r| {
            if !plain
                || apart.must.binary_search(&r).is_ok()
                || apart.holders.binary_search(&r).is_ok()
            {
                return None;
            }
            let c = Candidate {
                rank: r,
                overlap_blocks: 0,
                any_tier_blocks: 0,
                load: self.sequences.load(r, ask.now),
                new_blocks: req.request_blocks,
            };
            let load = c.load;
            // As `Calibration::timing_scales` gives the policy (none when off).
            let scale = scaled.then(|| self.calibration.own_scale(r).unwrap_or(prior));
            let cost = predicted_ttft::scaled_cost(config, scale, &shape, &c, 0);
            best = best.min(cost);
            if stand_in.is_none() && load.active_prefill_tokens < least.0 {
                least = (load.active_prefill_tokens, Some(r));
            }
            Some((c, cost))
        }));
        Kept {
            cost: best,
            rank: least.1,
        }
    }

    /// A registered rank drawn uniformly among those not in `touched` (registered,
    /// in registry order, marked in `touched_bits`); `None` when every rank is
    /// touched. While at least half are idle, by rejection (fewer than 2 draws on
    /// average); otherwise the drawn idle rank is found in the bit set, O(ranks /
    /// 64).
    fn draw_idle(&mut self, touched: &[WorkerRank]) -> Option<WorkerRank> {
        let ranks = self.workers.ranks();
        let n = ranks.len();
        let idle = n - touched.len();
        if idle == 0 {
            return None;
        }
        if idle * 2 >= n {
            return loop {
                let r = ranks[self.selector.draw(n)];
                if touched.binary_search(&r).is_err() {
                    break Some(r);
                }
            };
        }
        let mut k = self.selector.draw(idle);
        for (w, &word) in self.touched_bits.iter().enumerate() {
            let valid = (n - w * 64).min(64);
            let mask = if valid == 64 {
                u64::MAX
            } else {
                (1 << valid) - 1
            };
            let mut free = !word & mask;
            let count = free.count_ones() as usize;
            if k >= count {
                k -= count;
                continue;
            }
            for _ in 0..k {
                free &= free - 1;
            }
            return Some(ranks[w * 64 + free.trailing_zeros() as usize]);
        }
        None // unreachable: `idle` zero bits are set among the first `n`
    }
}

/// The ranks priced apart that stay candidates besides the cheapest: every one at
/// `cost` (ms), and `rank`, kept for the fleet's smallest backlog.
#[derive(Debug, Clone, Copy)]
struct Kept {
    cost: f64,
    rank: Option<WorkerRank>,
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
        config: &PredictedTtftConfig,
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
    let Some(rank) = stand_in.rank else {
        return chosen; // every rank touched: no idle rank
    };
    let Ok(own) = candidates.binary_search_by_key(&rank, |c| c.rank) else {
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
