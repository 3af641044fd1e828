//! [`SessionMetrics`]: session affinity — how many sessions the scheduler holds
//! (sampled at scrape time) and what affinity did per routed query that carried a
//! session id (recorded inline, one atomic add).

use super::common::to_i64;
use super::registrar::Registrar;
use prometheus::{IntCounterVec, IntGauge};
use scheduler::{Scheduler, SessionOutcome};

/// Session affinity: sessions held and per-decision outcomes.
#[derive(Clone)]
pub struct SessionMetrics {
    held: IntGauge,
    decisions: IntCounterVec,
}

impl SessionMetrics {
    /// Creates the metrics through `r`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub(crate) fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            held: r.gauge(
                "kv_router_sessions",
                "Sessions whose last worker rank this replica remembers (session affinity)",
            )?,
            decisions: r.counter_vec(
                "kv_router_session_decisions_total",
                "Routed queries with a session id, by what affinity did: hit (served by the \
                 session's last rank), override (another rank cheaper beyond the margin), miss \
                 (no usable last rank)",
                &["outcome"],
            )?,
        })
    }

    /// Counts one routed query's session outcome; nothing for `None` (no session id).
    pub(crate) fn observe(&self, outcome: Option<SessionOutcome>) {
        if let Some(outcome) = outcome {
            self.decisions.with_label_values(&[outcome.as_str()]).inc();
        }
    }

    /// Samples the sessions held.
    pub(crate) fn sample(&self, scheduler: &Scheduler) {
        self.held.set(to_i64(scheduler.sessions_held()));
    }

    /// Routed queries counted for `outcome`.
    pub fn decisions(&self, outcome: SessionOutcome) -> u64 {
        self.decisions.with_label_values(&[outcome.as_str()]).get()
    }
}
