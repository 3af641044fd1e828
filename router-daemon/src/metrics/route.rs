//! [`RouteMetrics`]: what routing queries got, how long they took, how much of their
//! prompt was cached on the chosen rank, where they went, and where disaggregated
//! requests' prompts were prefilled. Recorded once per answered query: a few atomic
//! adds and, for errors and disaggregation decisions, one label lookup.

use super::common::{RANK_LABELS, latency_buckets, overlap_buckets, rank_labels};
use super::registrar::Registrar;
use kv_events::WorkerRank;
use kv_events::disaggregation::DisaggregationReason;
use kv_events::routing::RouteReply;
use prometheus::{Histogram, HistogramVec, IntCounterVec};
use std::time::Duration;

/// Routing queries: outcome, latency, overlap, and where they went.
#[derive(Clone)]
pub struct RouteMetrics {
    requests: IntCounterVec,
    duration: HistogramVec,
    overlap_blocks: Histogram,
    decisions: IntCounterVec,
    disaggregation: IntCounterVec,
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
        })
    }

    /// Records one answered routing query that took `elapsed`.
    pub(crate) fn observe(&self, reply: &RouteReply, elapsed: Duration) {
        let outcome = outcome_label(reply);
        self.requests.with_label_values(&[&outcome]).inc();
        self.duration
            .with_label_values(&[&outcome])
            .observe(elapsed.as_secs_f64());
        if let RouteReply::Routed(d) = reply {
            self.overlap_blocks.observe(f64::from(d.overlap_blocks));
            let rank = WorkerRank::new(d.worker_id, d.dp_rank);
            self.decisions.with_label_values(&rank_labels(rank)).inc();
            if let Some(disaggregation) = &d.disaggregation {
                self.disaggregation
                    .with_label_values(&[disaggregation.reason.as_str()])
                    .inc();
            }
        }
    }

    /// Forgets the per-rank decision counters of a worker that left, so label sets do
    /// not accumulate with worker churn.
    pub(crate) fn forget_worker(&self, worker_id: kv_events::WorkerId, dp_size: u32) {
        let worker = worker_id.0.to_string();
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

/// `routed`, or the error code's wire name (`no_workers`, `overloaded`, ...).
fn outcome_label(reply: &RouteReply) -> String {
    match reply {
        RouteReply::Routed(_) => "routed".to_owned(),
        RouteReply::Error(e) => serde_json::to_value(e.code)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_else(|| "error".to_owned()),
    }
}
