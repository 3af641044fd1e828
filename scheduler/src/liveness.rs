//! Liveness from silence: engines publish load metrics every interval, so a rank
//! whose metrics stop is probably dead — even while its etcd lease lives on (etcd
//! unreachable, a lease with a long TTL, a hung process whose lease keeper still
//! runs). `LoadReports` keeps each rank's last sample and when it arrived;
//! [`LivenessConfig::classify`] reads the silence at `now`:
//!
//! | silence since the last sample | [`Liveness`] | routing |
//! |---|---|---|
//! | no sample since the rank registered | `NeverReported` | as a live rank: its lease is its only signal (an integration without metrics is never excluded) |
//! | < `quiet_intervals` × interval | `Live` | normal |
//! | ≥ `quiet_intervals` × interval | `Quiet` | deprioritized: a candidate only when no live rank is |
//! | ≥ `silent_intervals` × interval | `Silent` | excluded, until it publishes again |
//!
//! One safeguard: when *no* rank is `Live`, the silence is more likely the router's
//! (its metrics subscription, its NATS connection) than every engine's, so `Silent`
//! ranks are treated as `Quiet` rather than leaving nothing to route to.
//!
//! The rule is clock-free like the rest of the scheduler: every call takes `now`.
//! Cost: one hash lookup per rank per decision, and the latest sample time kept
//! aside so the safeguard is O(1).

use crate::cost_bound::Changed;
use crate::duration_ms;
use crate::error::SchedulerError;
use crate::policy::Candidate;
use kv_events::{LoadMetrics, WorkerId, WorkerRank};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

/// How silence in a rank's load metrics is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LivenessConfig {
    /// Whether silence counts at all; false leaves the etcd lease as the only
    /// liveness signal. Default true.
    pub enabled: bool,
    /// How often engines publish load metrics. Default 1 s, the relay's
    /// `--metrics-interval-ms` (the mock engines publish every 100 ms).
    #[serde(rename = "metrics_interval_ms", with = "duration_ms")]
    pub metrics_interval: Duration,
    /// Intervals without a sample after which a rank is deprioritized (at least 1).
    /// Default 3.
    pub quiet_intervals: u32,
    /// Intervals without a sample after which a rank is excluded (at least
    /// `quiet_intervals`). Default 10: a dead engine stops getting requests 3 s after
    /// its last report when others are available, and 10 s after in any case.
    pub silent_intervals: u32,
}

impl Default for LivenessConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            metrics_interval: Duration::from_secs(1),
            quiet_intervals: 3,
            silent_intervals: 10,
        }
    }
}

/// What a rank's load-metric silence says at some moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Liveness {
    /// No sample since the rank registered: judged by its lease alone.
    NeverReported,
    /// Reported recently.
    Live,
    /// Silent for `quiet_intervals`: deprioritized.
    Quiet,
    /// Silent for `silent_intervals`: excluded from routing.
    Silent,
}

impl Liveness {
    /// Every state, for metrics.
    pub const ALL: [Liveness; 4] = [
        Liveness::NeverReported,
        Liveness::Live,
        Liveness::Quiet,
        Liveness::Silent,
    ];

    /// The lowercase name (metric label and JSON value).
    pub fn label(self) -> &'static str {
        match self {
            Liveness::NeverReported => "never_reported",
            Liveness::Live => "live",
            Liveness::Quiet => "quiet",
            Liveness::Silent => "silent",
        }
    }
}

/// How a rank competes in a decision, from its [`Liveness`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Tier {
    /// Live or never reported.
    Preferred,
    /// Quiet (or silent while no rank is live): only when no preferred rank is a
    /// candidate.
    Fallback,
}

impl LivenessConfig {
    /// The liveness of a rank whose last sample arrived at `last_heard` (`None`:
    /// never), at `now`. Always `Live` or `NeverReported` when disabled.
    pub fn classify(&self, last_heard: Option<Instant>, now: Instant) -> Liveness {
        let Some(heard) = last_heard else {
            return Liveness::NeverReported;
        };
        if !self.enabled {
            return Liveness::Live;
        }
        let silence = now.saturating_duration_since(heard);
        if silence >= self.metrics_interval * self.silent_intervals {
            Liveness::Silent
        } else if silence >= self.metrics_interval * self.quiet_intervals {
            Liveness::Quiet
        } else {
            Liveness::Live
        }
    }

    /// Checks the interval and the counts.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] naming the first bad field.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        let invalid = |field, reason: &str| {
            Err(SchedulerError::InvalidConfig {
                field,
                reason: reason.into(),
            })
        };
        if self.metrics_interval < Duration::from_millis(1) {
            return invalid("liveness.metrics_interval_ms", "must be at least 1 ms");
        }
        if self.quiet_intervals == 0 {
            return invalid("liveness.quiet_intervals", "must be at least 1");
        }
        if self.silent_intervals < self.quiet_intervals {
            return invalid(
                "liveness.silent_intervals",
                "must be at least liveness.quiet_intervals",
            );
        }
        Ok(())
    }
}

/// One engine-reported sample and when it arrived.
#[derive(Debug, Clone, Copy)]
struct Report {
    metrics: LoadMetrics,
    at: Instant,
}

/// The latest engine-reported sample of each registered rank, and when it came.
#[derive(Debug, Default)]
pub(crate) struct LoadReports {
    reports: HashMap<WorkerRank, Report>,
    /// The newest `at` over all reports (for the no-rank-is-live safeguard).
    latest: Option<Instant>,
    /// Every report's `(at, rank)`, oldest first: the ranks that are no longer live
    /// are a prefix (the decision shortcut lists them without a scan).
    by_time: BTreeSet<(Instant, WorkerRank)>,
    /// Ranks whose latest sample reports decode blocks or prefill tokens (the only
    /// ones a report alone can make busy).
    loaded: HashSet<WorkerRank>,
    /// Ranks whose reported decode blocks or prefill tokens changed since
    /// [`Self::take_changed`] last ran (their busy state may have: the bound index,
    /// `crate::shortcut_busy`).
    changed: Changed,
}

impl LoadReports {
    /// Stores `metrics` for `rank`, heard at `now`.
    pub(crate) fn insert(&mut self, rank: WorkerRank, metrics: LoadMetrics, now: Instant) {
        if metrics.active_decode_blocks > 0 || metrics.active_prefill_tokens > 0 {
            self.loaded.insert(rank);
        } else {
            self.loaded.remove(&rank);
        }
        let busy_terms = |m: &LoadMetrics| (m.active_decode_blocks, m.active_prefill_tokens);
        let old = self.reports.insert(rank, Report { metrics, at: now });
        if old.is_none_or(|old| busy_terms(&old.metrics) != busy_terms(&metrics)) {
            self.changed.push(rank);
        }
        if let Some(old) = old {
            self.by_time.remove(&(old.at, rank));
        }
        self.by_time.insert((now, rank));
        self.latest = self.latest.max(Some(now));
    }

    /// The latest sample of `rank`.
    pub(crate) fn get(&self, rank: WorkerRank) -> Option<&LoadMetrics> {
        self.reports.get(&rank).map(|r| &r.metrics)
    }

    /// Calls `f` with every rank whose sample may set it apart from a rank that never
    /// reported, at `now`: those no longer live, and (when `busy_checked`) those
    /// reporting load. O(those ranks), not O(reports).
    pub(crate) fn visit_unlike_unreported(
        &self,
        config: &LivenessConfig,
        busy_checked: bool,
        now: Instant,
        mut f: impl FnMut(WorkerRank),
    ) {
        for &(at, rank) in &self.by_time {
            if config.classify(Some(at), now) == Liveness::Live {
                break; // every later sample is newer, so live too
            }
            f(rank);
        }
        if busy_checked {
            self.loaded.iter().for_each(|&r| f(r));
        }
    }

    /// The ranks whose reported load changed since the last call (`Changed::all`
    /// when too many did to list).
    pub(crate) fn take_changed(&mut self) -> Changed {
        std::mem::take(&mut self.changed)
    }

    /// When `rank` last reported.
    pub(crate) fn heard(&self, rank: WorkerRank) -> Option<Instant> {
        self.reports.get(&rank).map(|r| r.at)
    }

    /// Drops what `keep` refuses, then recomputes the newest sample time.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(WorkerRank) -> bool) {
        self.reports.retain(|rank, _| keep(*rank));
        self.by_time
            .retain(|(_, rank)| self.reports.contains_key(rank));
        self.loaded.retain(|rank| self.reports.contains_key(rank));
        self.latest = self.reports.values().map(|r| r.at).max();
    }

    /// Drops every rank of `worker_id`.
    pub(crate) fn remove_worker(&mut self, worker_id: WorkerId) {
        self.retain(|rank| rank.worker_id != worker_id);
    }

    /// How `rank` competes at `now`, or `None` when it is excluded.
    pub(crate) fn tier(
        &self,
        config: &LivenessConfig,
        rank: WorkerRank,
        now: Instant,
    ) -> Option<Tier> {
        match config.classify(self.heard(rank), now) {
            Liveness::NeverReported | Liveness::Live => Some(Tier::Preferred),
            Liveness::Quiet => Some(Tier::Fallback),
            Liveness::Silent if self.none_live(config, now) => Some(Tier::Fallback),
            Liveness::Silent => None,
        }
    }

    /// Keeps the candidates of the best tier in `tiers` (parallel to `candidates`):
    /// deprioritized ranks only compete when no preferred rank does.
    pub(crate) fn keep_best(candidates: &mut Vec<Candidate>, tiers: &[Tier]) {
        if let Some(&best) = tiers.iter().min() {
            let mut tiers = tiers.iter();
            candidates.retain(|_| tiers.next().is_some_and(|&t| t == best));
        }
    }

    /// Whether no rank has reported within the quiet window (the safeguard).
    fn none_live(&self, config: &LivenessConfig, now: Instant) -> bool {
        config.classify(self.latest, now) != Liveness::Live
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::DpRank;

    const INTERVAL: Duration = Duration::from_millis(100);

    fn config() -> LivenessConfig {
        LivenessConfig {
            enabled: true,
            metrics_interval: INTERVAL,
            quiet_intervals: 3,
            silent_intervals: 10,
        }
    }

    fn rank(w: u64) -> WorkerRank {
        WorkerRank::new(WorkerId(w), DpRank(0))
    }

    fn sample(w: u64) -> LoadMetrics {
        LoadMetrics {
            worker_id: WorkerId(w),
            dp_rank: DpRank(0),
            ..LoadMetrics::default()
        }
    }

    #[test]
    fn silence_is_read_in_intervals() {
        let c = config();
        let t = Instant::now();
        assert_eq!(c.classify(None, t), Liveness::NeverReported);
        assert_eq!(
            c.classify(None, t + INTERVAL * 1000),
            Liveness::NeverReported
        );
        assert_eq!(c.classify(Some(t), t), Liveness::Live);
        assert_eq!(
            c.classify(Some(t), t + INTERVAL * 3 - Duration::from_millis(1)),
            Liveness::Live
        );
        assert_eq!(c.classify(Some(t), t + INTERVAL * 3), Liveness::Quiet);
        assert_eq!(c.classify(Some(t), t + INTERVAL * 10), Liveness::Silent);
        // A sample stamped after `now` (clock skew between callers) is live.
        assert_eq!(c.classify(Some(t + INTERVAL), t), Liveness::Live);
        let off = LivenessConfig {
            enabled: false,
            ..c
        };
        assert_eq!(off.classify(Some(t), t + INTERVAL * 1000), Liveness::Live);
    }

    #[test]
    fn a_silent_rank_is_excluded_only_while_another_rank_is_live() {
        let c = config();
        let t = Instant::now();
        let mut reports = LoadReports::default();
        reports.insert(rank(1), sample(1), t);
        reports.insert(rank(2), sample(2), t);
        let later = t + INTERVAL * 10;
        // Both silent: the router's feed is the likelier fault; neither excluded.
        assert_eq!(reports.tier(&c, rank(1), later), Some(Tier::Fallback));
        // Rank 2 speaks again: rank 1 is excluded, rank 2 preferred.
        reports.insert(rank(2), sample(2), later);
        assert_eq!(reports.tier(&c, rank(1), later), None);
        assert_eq!(reports.tier(&c, rank(2), later), Some(Tier::Preferred));
        // A rank that never reported competes as a live one.
        assert_eq!(reports.tier(&c, rank(3), later), Some(Tier::Preferred));
        // Removing the live worker brings the safeguard back.
        reports.remove_worker(WorkerId(2));
        assert_eq!(reports.tier(&c, rank(1), later), Some(Tier::Fallback));
    }

    #[test]
    fn validation_names_the_bad_field() {
        let field = |c: LivenessConfig| match c.validate() {
            Err(SchedulerError::InvalidConfig { field, .. }) => field,
            other => panic!("expected invalid config, got {other:?}"),
        };
        assert!(config().validate().is_ok());
        assert_eq!(
            field(LivenessConfig {
                metrics_interval: Duration::ZERO,
                ..config()
            }),
            "liveness.metrics_interval_ms"
        );
        assert_eq!(
            field(LivenessConfig {
                quiet_intervals: 0,
                ..config()
            }),
            "liveness.quiet_intervals"
        );
        assert_eq!(
            field(LivenessConfig {
                silent_intervals: 2,
                ..config()
            }),
            "liveness.silent_intervals"
        );
    }
}
