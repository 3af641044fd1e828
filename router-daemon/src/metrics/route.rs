//! [`RouteMetrics`]: what routing queries got, how long they took, how much of their
//! prompt was cached on the chosen rank, where they went, and where disaggregated
//! requests' prompts were prefilled. Recorded once per answered query: a few atomic
//! adds on handles resolved at a routed query's first use (the outcome's, and the
//! chosen rank's, kept per rank), and, for errors and disaggregation decisions, one
//! label lookup. A label lookup hashes its label strings under the vector's lock,
//! and a rank's labels are two formatted strings: resolved per query they were
//! about 2% of a route's CPU.

use super::common::{RANK_LABELS, latency_buckets, overlap_buckets, rank_labels};
use super::registrar::Registrar;
use kv_events::WorkerRank;
use kv_events::disaggregation::DisaggregationReason;
use kv_events::routing::RouteReply;
use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Routing queries: outcome, latency, overlap, and where they went.
#[derive(Clone)]
pub struct RouteMetrics {
    requests: IntCounterVec,
    duration: HistogramVec,
    overlap_blocks: Histogram,
    decisions: IntCounterVec,
    disaggregation: IntCounterVec,
    /// The `routed` outcome's request counter and latency histogram, resolved once.
    routed: Arc<OnceLock<(IntCounter, Histogram)>>,
    /// Each chosen rank's decision counter, resolved at its first decision.
    per_rank: Arc<Mutex<HashMap<WorkerRank, IntCounter>>>,
}

impl RouteMetrics {
    /// Creates the metrics through `r`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub(crate) fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            requests: r.counter_vec(
                "kv_router_route_requests_total",
                "Routing queries answered, by outcome (routed or the error code)",
                &["outcome"],
            )?,
            duration: r.histogram_vec(
                "kv_router_route_duration_seconds",
                "Time from receiving a routing query to having its reply, in seconds, by outcome",
                &["outcome"],
                latency_buckets(),
            )?,
            overlap_blocks: r.histogram(
                "kv_router_route_overlap_blocks",
                "Prompt blocks already cached on the chosen worker rank, per routed query",
                overlap_buckets(),
            )?,
            decisions: r.counter_vec(
                "kv_router_route_decisions_total",
                "Routed queries by chosen worker rank",
                RANK_LABELS,
            )?,
            disaggregation: disaggregation_decisions(r)?,
            routed: Arc::default(),
            per_rank: Arc::default(),
        })
    }

    /// Records one answered routing query that took `elapsed`.
    pub(crate) fn observe(&self, reply: &RouteReply, elapsed: Duration) {
        let RouteReply::Routed(d) = reply else {
            let outcome = outcome_label(reply);
            self.requests.with_label_values(&[&outcome]).inc();
            self.duration
                .with_label_values(&[&outcome])
                .observe(elapsed.as_secs_f64());
            return;
        };
        let (requests, duration) = self.routed.get_or_init(|| {
            let label = [ROUTED];
            let requests = self.requests.with_label_values(&label);
            (requests, self.duration.with_label_values(&label))
        });
        requests.inc();
        duration.observe(elapsed.as_secs_f64());
        self.overlap_blocks.observe(f64::from(d.overlap_blocks));
        let rank = WorkerRank::new(d.worker_id, d.dp_rank);
        {
            // A poisoned map only lost a resolved handle: the counters are atomics.
            let mut per_rank = self.per_rank.lock().unwrap_or_else(|e| e.into_inner());
            per_rank
                .entry(rank)
                .or_insert_with(|| self.decisions.with_label_values(&rank_labels(rank)))
                .inc();
        }
        {
            if let Some(disaggregation) = &d.disaggregation {
                self.disaggregation
                    .with_label_values(&[disaggregation.reason.as_str()])
                    .inc();
            }
        }
    }

    /// Records one readiness probe (a route query with an empty prompt) that took
    /// `elapsed`, under the outcome `probe` whatever its reply.
    pub(crate) fn observe_probe(&self, elapsed: Duration) {
        let label = [PROBE];
        self.requests.with_label_values(&label).inc();
        self.duration
            .with_label_values(&label)
            .observe(elapsed.as_secs_f64());
    }

    /// Forgets the per-rank decision counters of a worker that left, so label sets do
    /// not accumulate with worker churn. Holds the resolved handles' lock throughout,
    /// so a decision recorded meanwhile resolves its handle before or after, never a
    /// handle to a counter already dropped from the vector.
    pub(crate) fn forget_worker(&self, worker_id: kv_events::WorkerId, dp_size: u32) {
        let worker = worker_id.0.to_string();
        let mut per_rank = self.per_rank.lock().unwrap_or_else(|e| e.into_inner());
        per_rank.retain(|rank, _| rank.worker_id != worker_id);
        for rank in 0..dp_size {
            let _ = self
                .decisions
                .remove_label_values(&[&worker, &rank.to_string()]);
        }
    }
}

/// `kv_router_disaggregation_decisions_total{reason}`, every reason present from
/// the start (at 0), so a rate over it never misses the first decision.
fn disaggregation_decisions(r: &Registrar<'_>) -> Result<IntCounterVec, prometheus::Error> {
    let counter = r.counter_vec(
        "kv_router_disaggregation_decisions_total",
        "Routed queries that allowed disaggregation while a prefill worker was \
         registered, by the router's decision: long_uncached (prefilled on a prefill \
         worker), short_uncached, decode_holds_prefix or no_prefill_worker (prefilled \
         on the decode worker)",
        &["reason"],
    )?;
    for reason in DisaggregationReason::ALL {
        counter.with_label_values(&[reason.as_str()]);
    }
    Ok(counter)
}

/// The `outcome` label of a routed query.
const ROUTED: &str = "routed";

/// The `outcome` label of a readiness probe.
const PROBE: &str = "probe";

/// `routed`, or the error code's wire name (`no_workers`, `overloaded`, ...).
fn outcome_label(reply: &RouteReply) -> String {
    match reply {
        RouteReply::Routed(_) => ROUTED.to_owned(),
        RouteReply::Error(e) => serde_json::to_value(e.code)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_else(|| "error".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::routing::{RouteDecision, RouteError, RouteErrorCode};
    use kv_events::{DpRank, WorkerId};
    use prometheus::Registry;

    fn routed(worker: u64, dp: u32) -> RouteReply {
        RouteReply::Routed(RouteDecision {
            request_id: "r".into(),
            worker_id: WorkerId(worker),
            dp_rank: DpRank(dp),
            overlap_blocks: 1,
            request_blocks: 2,
            in_flight_blocks: 0,
            kv_position: None,
            policy: kv_events::routing::PolicyKind::PredictedTtft,
            disaggregation: None,
            fallbacks: Vec::new(),
        })
    }

    /// `(labels, value)` of every sample of `name`, labels as `k=v` joined by `,`.
    fn samples(registry: &Registry, name: &str) -> Vec<(String, f64)> {
        let families = registry.gather();
        let Some(family) = families.iter().find(|f| f.name() == name) else {
            return Vec::new();
        };
        let mut out: Vec<(String, f64)> = (family.get_metric().iter())
            .map(|m| {
                let labels: Vec<String> = (m.get_label().iter())
                    .map(|l| format!("{}={}", l.name(), l.value()))
                    .collect();
                (labels.join(","), m.get_counter().value())
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Handles resolved once still count under their labels; a worker that leaves
    /// drops its ranks' series and handles, so after it comes back its decisions
    /// count in a fresh series, not in a dropped one.
    #[test]
    fn resolved_handles_count_and_are_forgotten_with_their_worker() {
        let registry = Registry::new();
        let m = RouteMetrics::new(&Registrar::new(&registry)).unwrap();
        let ms = Duration::from_millis(1);
        for reply in [routed(7, 1), routed(7, 1), routed(3, 0), routed(7, 0)] {
            m.observe(&reply, ms);
        }
        let error = RouteReply::Error(RouteError {
            code: RouteErrorCode::Overloaded,
            message: String::new(),
        });
        m.observe(&error, ms);
        let decisions = "kv_router_route_decisions_total";
        assert_eq!(
            samples(&registry, decisions),
            [
                ("dp_rank=0,worker_id=3".to_owned(), 1.0),
                ("dp_rank=0,worker_id=7".to_owned(), 1.0),
                ("dp_rank=1,worker_id=7".to_owned(), 2.0),
            ]
        );
        assert_eq!(
            samples(&registry, "kv_router_route_requests_total"),
            [
                ("outcome=overloaded".to_owned(), 1.0),
                ("outcome=routed".to_owned(), 4.0),
            ]
        );
        m.forget_worker(WorkerId(7), 2);
        assert_eq!(
            samples(&registry, decisions),
            [("dp_rank=0,worker_id=3".to_owned(), 1.0)]
        );
        m.observe(&routed(7, 1), ms);
        assert_eq!(
            samples(&registry, decisions),
            [
                ("dp_rank=0,worker_id=3".to_owned(), 1.0),
                ("dp_rank=1,worker_id=7".to_owned(), 1.0),
            ]
        );
    }
}
