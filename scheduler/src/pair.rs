//! Pair selection: a request that allows disaggregation in a fleet with `prefill`
//! workers gets a decode rank, a decision ([`crate::disaggregation`]) and, when it
//! runs disaggregated, a prefill rank; both halves are booked or neither is. A
//! second `impl` block of [`Scheduler`], entered from `schedule_one` in `lib.rs`.
//!
//! The bookings: the decode half under the request's id on the decode rank (its
//! prompt blocks as decode load; its prefill tokens are 0 when the prompt is
//! prefilled remotely, since it arrives by transfer, else the usual uncached
//! tokens), and the prefill half under `{id}#prefill` on the prefill rank (the
//! prompt's tokens not cached there as prefill load, its blocks as held blocks,
//! which the prefill worker keeps until the transfer is over). Online calibration
//! learns from the prefill half (booking → `remote_prefill_done` is the prefill
//! rank's TTFT for a one-token answer) and not from a remote decode half, whose
//! booking → `prefill_done` interval is another engine's prefill plus the transfer.
//!
//! Cost: two candidate scans and two selections at most; the decode cost is O(1)
//! per candidate.

use crate::Scheduler;
use crate::candidates::Ask;
use crate::disaggregation::decode_cost;
use crate::error::SchedulerError;
use crate::overlap::Overlaps;
use crate::policy::{Candidate, SelectContext};
use crate::request::{Fallbacks, PairDecision, PrefillChoice, ScheduleRequest, Selection};
use crate::sequences::{AddRequest, Origin};
use crate::sessions::CostScale;
use crate::workers::Side;
use kv_events::disaggregation::{DisaggregationReason, TransferProtocol, prefill_booking_id};
use std::time::Instant;

impl Scheduler {
    /// Chooses and books the decode rank of `req` and, when the decision is to
    /// disaggregate, its prefill rank (module docs).
    ///
    /// # Errors
    /// As [`Scheduler::schedule`]: the decode side's candidate errors; a prefill
    /// side without candidates is the decision `no_prefill_worker`, not an error,
    /// unless the decode worker cannot prefill (an SGLang `decode` server): then
    /// [`SchedulerError::AllBusy`], and nothing is booked.
    pub(crate) fn schedule_pair<O: Overlaps + ?Sized>(
        &mut self,
        ask: &Ask<'_, O>,
    ) -> Result<Selection, SchedulerError> {
        let (req, policy, now) = (ask.req, ask.policy, ask.now);
        let half_id = prefill_booking_id(&req.request_id);
        if self.sequences.contains(&half_id) {
            return Err(SchedulerError::DuplicateRequest(half_id));
        }
        self.gather_candidates(req, ask.overlaps, ask.block_ids, now, Side::Decode)?;
        let (decode, cost, session) = self.pick_decode(req, now);
        // An SGLang decode server cannot prefill the prompt itself: its request is
        // disaggregated whatever the thresholds say, and fails without a prefill worker.
        let (protocol, whole) =
            self.workers
                .get(decode.rank.worker_id)
                .map_or((None, true), |reg| {
                    (
                        reg.kv_transfer.map(|t| t.protocol),
                        reg.serves_whole_requests(),
                    )
                });
        let local = if whole {
            self.config
                .disaggregation
                .local_reason(req, decode.overlap_blocks)
        } else {
            None
        };
        let (reason, prefill) = match local {
            Some(reason) => (reason, None),
            None => match protocol.and_then(|p| self.pick_prefill(ask, p)) {
                Some(pick) => (DisaggregationReason::LongUncached, Some(pick)),
                None if whole => (DisaggregationReason::NoPrefillWorker, None),
                None => return Err(SchedulerError::AllBusy),
            },
        };
        let decode_hint = match prefill {
            Some(_) => self.prefill_hint(0),
            None => self.prefill_hint(req.uncached_tokens(decode.overlap_blocks)),
        };
        let booking = |request_id, rank, prefill| AddRequest {
            request_id,
            rank,
            block_hashes: req.block_hashes.clone(),
            request_blocks: req.request_blocks,
            prefill,
            origin: Origin::Local,
            session_id: None,
        };
        self.sequences.add_request(
            booking(req.request_id.clone(), decode.rank, decode_hint),
            now,
        )?;
        let prefill = match prefill {
            None => None,
            Some((chosen, cost)) => {
                let hint = self.prefill_hint(req.uncached_tokens(chosen.overlap_blocks));
                let added = self
                    .sequences
                    .add_request(booking(half_id.clone(), chosen.rank, hint), now);
                if let Err(e) = added {
                    // Both halves or neither.
                    let _ = self.sequences.free(&req.request_id, now);
                    return Err(e);
                }
                self.calibration
                    .book_local(policy, &req.shape(), &chosen, &half_id, now);
                Some(PrefillChoice {
                    rank: chosen.rank,
                    overlap_blocks: chosen.overlap_blocks,
                    prefill: hint,
                    cost,
                })
            }
        };
        if prefill.is_none() {
            self.calibration
                .book_local(policy, &req.shape(), &decode, &req.request_id, now);
        }
        if let Some(id) = &req.session_id {
            self.sessions.record(id, decode.rank, now);
        }
        tracing::debug!(
            request_id = %req.request_id,
            decode = %decode.rank,
            prefill = ?prefill.map(|p| p.rank.to_string()),
            reason = reason.as_str(),
            decode_overlap_blocks = decode.overlap_blocks,
            request_blocks = req.request_blocks,
            decode_cost = cost,
            session = ?session,
            "request scheduled as a pair",
        );
        Ok(Selection {
            rank: decode.rank,
            overlap_blocks: decode.overlap_blocks,
            in_flight_blocks: 0,
            policy: policy.kind(),
            cost: Some(cost),
            prefill: decode_hint,
            session,
            disaggregation: Some(PairDecision { reason, prefill }),
            fallbacks: Fallbacks::default(),
        })
    }

    /// The decode rank among `self.candidates`: the lowest [`decode_cost`], ties to
    /// fewer active requests, then uniformly at random; then session affinity with
    /// the relative margin. Returns the candidate, its cost and what affinity did.
    fn pick_decode(
        &mut self,
        req: &ScheduleRequest,
        now: Instant,
    ) -> (Candidate, f64, Option<crate::SessionOutcome>) {
        self.decode_keys.clear();
        for c in &self.candidates {
            let total = self
                .workers
                .get(c.rank.worker_id)
                .map_or(1, |reg| reg.total_kv_blocks);
            self.decode_keys.push((
                decode_cost(c, req.request_blocks, total),
                c.load.active_requests as f64,
            ));
        }
        let pick = self.selector.pick_min(&self.decode_keys);
        let keys = &self.decode_keys;
        let (index, session) = self.sessions.steer(
            req.session_id.as_ref(),
            CostScale::Relative,
            pick,
            &self.candidates,
            |i| keys.get(i).map(|k| k.0),
            now,
        );
        (self.candidates[index], self.decode_keys[index].0, session)
    }

    /// The prefill rank for `req` among the `prefill` workers of `protocol`, chosen
    /// by `policy`, with its cost; `None` when none is eligible.
    fn pick_prefill<O: Overlaps + ?Sized>(
        &mut self,
        ask: &Ask<'_, O>,
        protocol: TransferProtocol,
    ) -> Option<(Candidate, Option<f64>)> {
        let side = Side::Prefill(protocol);
        self.gather_candidates(ask.req, ask.overlaps, ask.block_ids, ask.now, side)
            .ok()?;
        self.calibration
            .timing_scales(ask.policy, &self.candidates, &mut self.scales);
        let ctx = SelectContext {
            request: ask.req.shape(),
            candidates: &self.candidates,
            batch_remaining: ask.batch_remaining,
            timing_scales: &self.scales,
            delay_cap_gate: None,
        };
        let choice = self.selector.select(ask.policy, &ctx).ok()?;
        Some((self.candidates[choice.index], choice.cost))
    }
}
