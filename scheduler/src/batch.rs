//! [`Scheduler::schedule_batch`]: several requests routed together, each seeing the
//! bookings of the ones placed before it. A second `impl` block of [`Scheduler`]; a
//! batch costs what its requests cost one by one, minus the scans it skips once every
//! rank is known busy.

use crate::error::SchedulerError;
use crate::overlap::Overlaps;
use crate::request::{ScheduleRequest, Selection};
use crate::{BatchOrder, Scheduler};
use kv_events::DpRank;
use std::borrow::Borrow;
use std::cmp::Reverse;
use std::collections::HashSet;
use std::time::Instant;

impl Scheduler {
    /// Schedules several requests routed together, each seeing the bookings of the
    /// ones placed before it (`kv-normalized` also sizes its fair share with the
    /// requests still to place). Returns one result per request, in input order.
    /// Once an unpinned request finds every rank busy, later unpinned ones fail with
    /// [`SchedulerError::AllBusy`] without another scan (bookings only add load);
    /// likewise per pinned dp_rank. A duplicate id or one freed before it was routed
    /// still gets its own error ([`Scheduler::schedule`]).
    pub fn schedule_batch<R: Borrow<ScheduleRequest>, O: Overlaps>(
        &mut self,
        batch: &[(R, O)],
        order: BatchOrder,
        now: Instant,
    ) -> Vec<Result<Selection, SchedulerError>> {
        let mut sequence: Vec<usize> = (0..batch.len()).collect();
        if order == BatchOrder::GroupByPrefix {
            sequence.sort_by_key(|&i| {
                let r = batch[i].0.borrow();
                (
                    r.dp_rank.is_none(),
                    r.block_hashes.first().copied(),
                    Reverse(r.num_tokens),
                )
            });
        }
        let mut results: Vec<Result<Selection, SchedulerError>> =
            batch.iter().map(|_| Err(SchedulerError::AllBusy)).collect();
        let mut all_busy = false;
        let mut busy_pins: HashSet<DpRank> = HashSet::new();
        for (k, &i) in sequence.iter().enumerate() {
            let (req, overlaps) = (batch[i].0.borrow(), &batch[i].1);
            // A request with exclusions or an eligible set has fewer candidates than
            // the others, so what it finds says nothing about them, nor theirs about
            // it.
            let excludes = !req.exclude_workers.is_empty() || !req.eligible_workers.is_empty();
            let known_busy = match req.dp_rank {
                _ if excludes => false,
                None => all_busy,
                Some(dp) => busy_pins.contains(&dp),
            };
            // Skipped only if it would find every rank busy: a duplicate or a query
            // its frontend already freed gets its own error (a waiter freed while it
            // waits leaves the queue at the next release pass, wherever it waits).
            if known_busy
                && !self.sequences.contains(&req.request_id)
                && !self.freed_early.contains(&req.request_id, now)
            {
                continue; // stays AllBusy
            }
            let result = self.schedule_one(req, overlaps, now, batch.len() - k);
            if matches!(result, Err(SchedulerError::AllBusy)) && !excludes {
                match req.dp_rank {
                    None => all_busy = true,
                    Some(dp) => {
                        busy_pins.insert(dp);
                    }
                }
            }
            results[i] = result;
        }
        results
    }
}
