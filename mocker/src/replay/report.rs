//! Per-policy replay results: aggregation, latency statistics, JSON and a terminal
//! table.
//!
//! Latencies are in **model ms** (wall ms × time scale), so runs at different time
//! scales are comparable. Statistics are `engine_model::LatencyStats`, shared with the
//! lab: an HDR histogram's nearest-rank percentiles, within 0.1%, and exact means.
//! Aggregation is one pass: `O(n)` for `n` completed requests.

use engine_model::LatencyStats;
use kv_events::WorkerId;
use kv_events::routing::{PolicyKind, RouteErrorCode};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Why a route request got no decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouteFailure {
    /// The router rejected the request as invalid.
    BadRequest,
    /// The router knows no workers.
    NoWorkers,
    /// Every worker was saturated and the router's wait queue was full.
    Overloaded,
    /// The router failed internally.
    Internal,
    /// No reply: no router listening, a timeout, or an undecodable reply.
    Unreachable,
}

impl From<RouteErrorCode> for RouteFailure {
    fn from(code: RouteErrorCode) -> Self {
        match code {
            // Replay never pins a dp_rank, so an unavailable rank is a bad request.
            RouteErrorCode::BadRequest | RouteErrorCode::RankUnavailable => {
                RouteFailure::BadRequest
            }
            RouteErrorCode::NoWorkers => RouteFailure::NoWorkers,
            RouteErrorCode::Overloaded => RouteFailure::Overloaded,
            RouteErrorCode::Internal => RouteFailure::Internal,
        }
    }
}

impl RouteFailure {
    /// The snake_case name used in JSON and the table.
    pub fn as_str(self) -> &'static str {
        match self {
            RouteFailure::BadRequest => "bad_request",
            RouteFailure::NoWorkers => "no_workers",
            RouteFailure::Overloaded => "overloaded",
            RouteFailure::Internal => "internal",
            RouteFailure::Unreachable => "unreachable",
        }
    }
}

/// What happened to one replayed request.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestOutcome {
    /// Routed, generated and finished.
    Completed {
        /// The worker that served it.
        worker_id: WorkerId,
        /// Time to first token from the route request's send, in model ms.
        ttft_ms: f64,
        /// Time to the `finished` message from the route request's send, in model ms.
        e2e_ms: f64,
        /// Prompt tokens served from the engine's prefix cache, in tokens.
        cached_tokens: u64,
        /// Prompt tokens, in tokens.
        prompt_tokens: u64,
    },
    /// Routed but the engine failed it, or it timed out.
    Failed {
        /// The worker it was routed to.
        worker_id: WorkerId,
    },
    /// Not routed.
    RouteFailed(RouteFailure),
}

/// Results of replaying the trace under one policy.
///
/// JSON keys: `policy`, `requests`, `completed`, `failed`, `route_errors` (map from
/// failure to count), `hit_rate`, `ttft_ms` and `e2e_ms` (each `{mean, p50, p90, p99}`
/// in model ms), `worker_request_counts` (map from worker id to routed requests),
/// `wall_s`. `hit_rate`, `ttft_ms` and `e2e_ms` are `null` when nothing completed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyReport {
    /// The routing policy.
    pub policy: PolicyKind,
    /// Requests sent (completed + failed + route errors).
    pub requests: u64,
    /// Requests that finished.
    pub completed: u64,
    /// Requests routed but failed by the engine or timed out.
    pub failed: u64,
    /// Requests not routed, by reason.
    pub route_errors: BTreeMap<RouteFailure, u64>,
    /// Prefix-cache hit rate: Σ cached tokens / Σ prompt tokens over completed requests.
    pub hit_rate: Option<f64>,
    /// Time to first token, in model ms, over completed requests.
    pub ttft_ms: Option<LatencyStats>,
    /// End-to-end latency, in model ms, over completed requests.
    pub e2e_ms: Option<LatencyStats>,
    /// Routed requests (completed or failed) per worker.
    pub worker_request_counts: BTreeMap<WorkerId, u64>,
    /// Wall-clock duration of the pass, in seconds.
    pub wall_s: f64,
}

impl PolicyReport {
    /// Aggregates the outcomes of one pass that took `wall_s` seconds.
    pub fn from_outcomes(policy: PolicyKind, outcomes: &[RequestOutcome], wall_s: f64) -> Self {
        let mut report = Self {
            policy,
            requests: outcomes.len() as u64,
            completed: 0,
            failed: 0,
            route_errors: BTreeMap::new(),
            hit_rate: None,
            ttft_ms: None,
            e2e_ms: None,
            worker_request_counts: BTreeMap::new(),
            wall_s,
        };
        let (mut ttft, mut e2e) = (Vec::new(), Vec::new());
        let (mut cached, mut prompt) = (0u64, 0u64);
        for outcome in outcomes {
            match outcome {
                RequestOutcome::Completed {
                    worker_id,
                    ttft_ms,
                    e2e_ms,
                    cached_tokens,
                    prompt_tokens,
                } => {
                    report.completed += 1;
                    *report.worker_request_counts.entry(*worker_id).or_default() += 1;
                    ttft.push(*ttft_ms);
                    e2e.push(*e2e_ms);
                    cached += cached_tokens;
                    prompt += prompt_tokens;
                }
                RequestOutcome::Failed { worker_id } => {
                    report.failed += 1;
                    *report.worker_request_counts.entry(*worker_id).or_default() += 1;
                }
                RequestOutcome::RouteFailed(failure) => {
                    *report.route_errors.entry(*failure).or_default() += 1;
                }
            }
        }
        report.hit_rate = (prompt > 0).then(|| cached as f64 / prompt as f64);
        report.ttft_ms = LatencyStats::from_samples(ttft);
        report.e2e_ms = LatencyStats::from_samples(e2e);
        report
    }

    /// Total requests that got no route decision.
    pub fn route_error_count(&self) -> u64 {
        self.route_errors.values().sum()
    }
}

/// Results of a replay, one entry per policy in the order run. Serializes as a JSON
/// array of [`PolicyReport`] objects.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ReplayReport {
    /// Per-policy results.
    pub policies: Vec<PolicyReport>,
}

impl ReplayReport {
    /// The report for `policy`, if it was run.
    pub fn policy(&self, policy: PolicyKind) -> Option<&PolicyReport> {
        self.policies.iter().find(|p| p.policy == policy)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn completed(worker: u64, ttft_ms: f64, cached: u64, prompt: u64) -> RequestOutcome {
        RequestOutcome::Completed {
            worker_id: WorkerId(worker),
            ttft_ms,
            e2e_ms: ttft_ms * 10.0,
            cached_tokens: cached,
            prompt_tokens: prompt,
        }
    }

    #[test]
    fn aggregates_outcomes() {
        let outcomes = vec![
            completed(1, 100.0, 512, 1024),
            completed(2, 300.0, 0, 1024),
            RequestOutcome::Failed {
                worker_id: WorkerId(2),
            },
            RequestOutcome::RouteFailed(RouteFailure::Overloaded),
            RequestOutcome::RouteFailed(RouteErrorCode::Overloaded.into()),
            RequestOutcome::RouteFailed(RouteFailure::Unreachable),
        ];
        let r = PolicyReport::from_outcomes(PolicyKind::Kv, &outcomes, 12.5);
        assert_eq!(r.requests, 6);
        assert_eq!(r.completed, 2);
        assert_eq!(r.failed, 1);
        assert_eq!(r.route_error_count(), 3);
        assert_eq!(r.route_errors[&RouteFailure::Overloaded], 2);
        assert_eq!(r.hit_rate, Some(0.25));
        assert_eq!(r.ttft_ms.unwrap().mean, 200.0);
        // Nearest-rank percentiles of {1000, 3000} ms, within the histogram's 0.1%.
        let e2e = r.e2e_ms.unwrap();
        assert!((e2e.p50 - 1000.0).abs() <= 1.0, "{e2e:?}");
        assert!((e2e.p99 - 3000.0).abs() <= 3.0, "{e2e:?}");
        assert_eq!(r.worker_request_counts[&WorkerId(1)], 1);
        assert_eq!(r.worker_request_counts[&WorkerId(2)], 2);
    }

    #[test]
    fn nothing_completed_gives_null_statistics() {
        let outcomes = vec![RequestOutcome::RouteFailed(RouteFailure::NoWorkers)];
        let r = PolicyReport::from_outcomes(PolicyKind::RoundRobin, &outcomes, 1.0);
        assert_eq!((r.hit_rate, r.ttft_ms, r.e2e_ms), (None, None, None));
        let json = serde_json::to_value(&r).unwrap();
        assert!(json["hit_rate"].is_null());
        assert_eq!(json["route_errors"]["no_workers"], 1);
        assert!(r.policy == PolicyKind::RoundRobin);
    }

    pub(crate) fn sample_report() -> ReplayReport {
        ReplayReport {
            policies: vec![
                PolicyReport::from_outcomes(
                    PolicyKind::Kv,
                    &[
                        completed(1, 100.0, 600, 1000),
                        completed(2, 200.0, 400, 1000),
                    ],
                    10.0,
                ),
                PolicyReport::from_outcomes(
                    PolicyKind::RoundRobin,
                    &[
                        completed(1, 300.0, 100, 1000),
                        completed(2, 300.0, 100, 1000),
                        RequestOutcome::RouteFailed(RouteFailure::Overloaded),
                    ],
                    11.0,
                ),
            ],
        }
    }

    #[test]
    fn report_serializes_as_an_array_of_policy_objects() {
        let json = serde_json::to_value(sample_report()).unwrap();
        let array = json.as_array().unwrap();
        assert_eq!(array.len(), 2);
        let kv = &array[0];
        assert_eq!(kv["policy"], "kv");
        assert_eq!(kv["requests"], 2);
        assert_eq!(kv["completed"], 2);
        assert_eq!(kv["hit_rate"], 0.5);
        for key in ["mean", "p50", "p90", "p99"] {
            assert!(kv["ttft_ms"][key].is_number(), "ttft_ms.{key}");
        }
        for key in ["mean", "p50", "p99"] {
            assert!(kv["e2e_ms"][key].is_number(), "e2e_ms.{key}");
        }
        assert_eq!(kv["worker_request_counts"]["1"], 1);
        assert_eq!(array[1]["policy"], "round-robin");
        let back: ReplayReport = serde_json::from_value(json).unwrap();
        assert_eq!(back, sample_report());
    }
}
