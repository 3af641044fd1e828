//! [`RankBook`]: when each worker rank may be asked for recovery again, and when it
//! is not asked at all. Synchronous and clock-free (every call takes `now`), so its
//! rules are tested without NATS or a runtime.
//!
//! Rules, per (worker, dp_rank):
//! - **One recovery in flight.** A need that arrives while one runs waits; a newer
//!   need replaces a waiting one (the older is superseded in the indexer too) and
//!   cancels the running one's remaining attempts.
//! - **Closed or not.** A recovery *closed the hole* when its reply was applied and,
//!   once the indexer had emitted every need that reply caused, no newer need of the
//!   rank waits. Otherwise (a hole left, a refused parent, a reply that could not be
//!   used, the publisher unreachable, superseded) it counts as a failure.
//! - **Backoff.** After a failure the rank's next recovery waits an exponential,
//!   jittered delay (`backon`: from the minimum, doubling to the maximum, plus up to
//!   100 % jitter). A closed hole forgets the failures.
//! - **Budget.** After `budget` failures in a row the rank is *degraded*: its waiting
//!   and future needs are given up at once, without a request (the indexer then
//!   applies its buffered events past the hole, counting them lost), until the
//!   cool-down ends — then it starts afresh with a full budget — or until a need
//!   carries a newer publisher epoch (the publisher restarted).
//! - **Memory.** A rank is tracked only while it has trouble: it is dropped when a
//!   recovery closes its hole, or a cool-down after its last failure when no need
//!   came meanwhile.
//! - **Logs.** The first failure of a streak is a warning, the next ones are debug
//!   lines, degrading is one warning with the count, leaving it one info line with
//!   the needs skipped meanwhile.

use crate::metrics::RecoveryMetrics;
use crate::recovery_status::{DegradeReason, RankStatus, RecoveryPhase};
use backon::{BackoffBuilder as _, ExponentialBackoff, ExponentialBuilder};
use indexer::RecoveryNeed;
use kv_events::WorkerRank;
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// How recoveries of a rank are spaced and bounded (see [`super::RecoveryConfig`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pacing {
    /// Delays after failed recoveries.
    pub backoff: ExponentialBuilder,
    /// Failures in a row before the rank is degraded (at least 1).
    pub budget: u32,
    /// How long a degraded rank is left alone, and a failing streak remembered.
    pub cooldown: Duration,
}

/// How a recovery run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RunOutcome {
    /// A reply was handed to the indexer; `usable` is false for a publisher's error
    /// body (the indexer then gives the recovery up).
    Applied {
        /// Whether the reply carried events or a dump.
        usable: bool,
    },
    /// Every attempt failed, or the publisher has no responder or refused; the
    /// indexer was told to give the recovery up. The error, lowercase.
    GaveUp(String),
    /// A newer need of the rank arrived before a reply did.
    Superseded,
    /// The daemon is stopping.
    Stopped,
}

/// What the caller must do with a need the book lets go.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// Nothing but count it resolved: a newer need of the rank replaced it.
    Superseded(RecoveryNeed),
    /// Give it up in the indexer without a request: the rank is degraded.
    GiveUp(RecoveryNeed),
}

/// A recovery the caller must run now.
#[derive(Debug)]
pub(crate) struct Start {
    /// The need to serve.
    pub need: RecoveryNeed,
    /// Fires when a newer need of the rank supersedes this one.
    pub superseded: CancellationToken,
}

#[derive(Debug)]
struct Degraded {
    until: Instant,
    reason: DegradeReason,
    epoch: u64,
    skipped: u64,
}

#[derive(Debug)]
struct Entry {
    waiting: Option<RecoveryNeed>,
    running: Option<CancellationToken>,
    failures: u32,
    backoff: Option<ExponentialBackoff>,
    not_before: Instant,
    /// When an idle entry is dropped.
    forget_at: Option<Instant>,
    degraded: Option<Degraded>,
    /// The newest publisher epoch a need of the rank carried.
    epoch: u64,
}

impl Entry {
    fn new(now: Instant) -> Self {
        Self {
            waiting: None,
            running: None,
            failures: 0,
            backoff: None,
            not_before: now,
            forget_at: None,
            degraded: None,
            epoch: 0,
        }
    }

    fn status(&self) -> RankStatus {
        let (phase, until) = match &self.degraded {
            Some(d) => (RecoveryPhase::Degraded(d.reason), Some(d.until)),
            None if self.running.is_some() || self.failures == 0 => {
                (RecoveryPhase::Recovering, None)
            }
            None => (RecoveryPhase::BackingOff, Some(self.not_before)),
        };
        RankStatus {
            phase,
            failures: self.failures,
            until,
            skipped: self.degraded.as_ref().map_or(0, |d| d.skipped),
        }
    }
}

/// Per-rank recovery pacing; see the module docs.
pub(crate) struct RankBook {
    pacing: Pacing,
    metrics: RecoveryMetrics,
    ranks: HashMap<WorkerRank, Entry>,
}

impl RankBook {
    /// An empty book recording degradations and skipped needs in `metrics`.
    pub(crate) fn new(pacing: Pacing, metrics: RecoveryMetrics) -> Self {
        Self {
            pacing: Pacing {
                budget: pacing.budget.max(1),
                ..pacing
            },
            metrics,
            ranks: HashMap::new(),
        }
    }

    /// Takes a need of the indexer. Returns the need it lets go, if any: the one it
    /// replaced, or this one when its rank is degraded.
    pub(crate) fn on_need(&mut self, need: RecoveryNeed, now: Instant) -> Option<Release> {
        let rank = need.rank;
        let entry = self.ranks.entry(rank).or_insert_with(|| Entry::new(now));
        entry.epoch = entry.epoch.max(need.request.epoch);
        if let Some(degraded) = &mut entry.degraded {
            if need.request.epoch <= degraded.epoch {
                degraded.skipped += 1;
                self.metrics.skip("degraded");
                debug!(worker_id = %rank.worker_id, dp_rank = %rank.dp_rank, reason = need.reason.label(), "kv event recovery skipped: rank degraded");
                return Some(Release::GiveUp(need));
            }
            info!(
                worker_id = %rank.worker_id, dp_rank = %rank.dp_rank,
                epoch = need.request.epoch, needs_skipped = degraded.skipped,
                "kv event recovery resumes: the publisher restarted"
            );
            *entry = Entry {
                epoch: entry.epoch,
                ..Entry::new(now)
            };
            self.metrics.set_degraded_ranks(self.degraded());
        }
        let entry = self.ranks.entry(rank).or_insert_with(|| Entry::new(now));
        entry.forget_at = None;
        if let Some(running) = &entry.running {
            running.cancel();
        }
        let replaced = entry.waiting.replace(need);
        replaced.map(|old| {
            self.metrics.skip("superseded");
            Release::Superseded(old)
        })
    }

    /// Marks as running and returns up to `slots` waiting needs whose rank is due at
    /// `now` and has nothing running, the longest due first.
    pub(crate) fn start_ready(&mut self, now: Instant, slots: usize) -> Vec<Start> {
        let mut due: Vec<(Instant, WorkerRank)> = self
            .ranks
            .iter()
            .filter(|(_, e)| e.waiting.is_some() && e.running.is_none() && e.not_before <= now)
            .map(|(rank, e)| (e.not_before, *rank))
            .collect();
        due.sort_unstable();
        due.truncate(slots);
        let mut starts = Vec::with_capacity(due.len());
        for (_, rank) in due {
            let Some(entry) = self.ranks.get_mut(&rank) else {
                continue;
            };
            let Some(need) = entry.waiting.take() else {
                continue;
            };
            let superseded = CancellationToken::new();
            entry.running = Some(superseded.clone());
            starts.push(Start { need, superseded });
        }
        starts
    }

    /// Whether `rank` is in a failing streak (its run's own log lines stay quiet).
    pub(crate) fn failing(&self, rank: WorkerRank) -> bool {
        self.ranks.get(&rank).is_some_and(|e| e.failures > 0)
    }

    /// Records how the run of `rank` ended, after every need it caused was taken
    /// with [`RankBook::on_need`]. Returns the waiting need to give up if the rank
    /// was degraded just now.
    pub(crate) fn on_done(
        &mut self,
        rank: WorkerRank,
        outcome: &RunOutcome,
        now: Instant,
    ) -> Option<Release> {
        let Pacing {
            backoff,
            budget,
            cooldown,
        } = self.pacing;
        let entry = self.ranks.get_mut(&rank)?;
        entry.running = None;
        let (worker_id, dp_rank) = (rank.worker_id, rank.dp_rank);
        let closed =
            matches!(outcome, RunOutcome::Applied { usable: true }) && entry.waiting.is_none();
        if matches!(outcome, RunOutcome::Stopped) {
            return None;
        }
        if closed {
            if entry.failures > 0 {
                info!(%worker_id, %dp_rank, failures = entry.failures, "kv event recovery closed the hole after failed recoveries");
            }
            self.ranks.remove(&rank);
            return None;
        }
        entry.failures += 1;
        let failures = entry.failures;
        let error = match outcome {
            RunOutcome::GaveUp(error) => error.as_str(),
            RunOutcome::Applied { usable: false } => "the publisher answered with an error",
            RunOutcome::Superseded => "superseded by a newer need before a reply came",
            _ => "the reply left a hole",
        };
        if failures >= budget {
            let reason = match outcome {
                RunOutcome::GaveUp(_) | RunOutcome::Applied { usable: false } => {
                    DegradeReason::Unreachable
                }
                _ => DegradeReason::HoleNotClosed,
            };
            let until = now + cooldown;
            entry.degraded = Some(Degraded {
                until,
                reason,
                epoch: entry.epoch,
                skipped: 0,
            });
            entry.backoff = None;
            entry.forget_at = Some(until);
            let waiting = entry.waiting.take();
            warn!(
                %worker_id, %dp_rank, failures, reason = reason.label(), error,
                cooldown_secs = cooldown.as_secs(),
                "kv event recovery degraded: no further requests to this rank until the cool-down ends or its publisher restarts; its events are applied past the hole"
            );
            self.metrics.degrade(reason.label());
            self.metrics.set_degraded_ranks(self.degraded());
            return waiting.map(|need| {
                self.metrics.skip("degraded");
                Release::GiveUp(need)
            });
        }
        let delay = entry
            .backoff
            .get_or_insert_with(|| backoff.build())
            .next()
            .unwrap_or(cooldown);
        entry.not_before = now + delay;
        if entry.waiting.is_none() {
            entry.forget_at = Some(now + cooldown);
        }
        let delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        if failures == 1 {
            warn!(%worker_id, %dp_rank, error, delay_ms, budget, "kv event recovery did not close the hole; backing off (further failures of this rank are logged at debug)");
        } else {
            debug!(%worker_id, %dp_rank, error, delay_ms, failures, "kv event recovery did not close the hole; backing off");
        }
        None
    }

    /// When the next waiting need becomes due or an idle entry is forgotten.
    pub(crate) fn next_wakeup(&self) -> Option<Instant> {
        self.ranks
            .values()
            .filter_map(|e| match (&e.waiting, &e.running) {
                (Some(_), None) => Some(e.not_before),
                (None, None) => e.forget_at,
                (_, Some(_)) => None,
            })
            .min()
    }

    /// Drops the idle entries whose time is up at `now` (a degraded rank's
    /// cool-down ended, or a failing streak was not followed by a need).
    pub(crate) fn expire(&mut self, now: Instant) {
        let before = self.degraded();
        self.ranks.retain(|rank, e| {
            let idle = e.waiting.is_none() && e.running.is_none();
            let keep = !idle || e.forget_at.is_none_or(|t| t > now);
            if !keep && let Some(d) = &e.degraded {
                info!(worker_id = %rank.worker_id, dp_rank = %rank.dp_rank, needs_skipped = d.skipped, "kv event recovery cool-down over: the rank is asked again, with a fresh budget");
            }
            keep
        });
        if self.degraded() != before {
            self.metrics.set_degraded_ranks(self.degraded());
        }
    }

    /// Ranks degraded now.
    pub(crate) fn degraded(&self) -> usize {
        self.ranks.values().filter(|e| e.degraded.is_some()).count()
    }

    /// The status of every tracked rank.
    pub(crate) fn statuses(&self) -> HashMap<WorkerRank, RankStatus> {
        self.ranks.iter().map(|(r, e)| (*r, e.status())).collect()
    }
}

#[cfg(test)]
#[path = "ranks_tests.rs"]
mod tests;
