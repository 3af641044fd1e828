//! The gateway's router client as the tests and examples build it, and the route
//! decision a scripted router answers with.

use kv_events::routing::{PolicyKind, RouteDecision};
use kv_events::{DpRank, RequestId, Subjects, WorkerId};
use kv_gateway::router::{Grouping, RouterClient, RouterMetrics, RouterSettings};
use std::time::Duration;

/// A router client on `nats` asking with `timeout`, grouping route queries as
/// `grouping` says and sending at most `lifecycle_batch` lifecycle messages per NATS
/// message; no keep-alive within a test (one an hour), no replica affinity, and no
/// reconnect events. Also returns what it records (route queries per NATS message,
/// replica affinity's events).
///
/// # Panics
/// Never: the metrics' options are fixed and valid.
pub fn router_client(
    nats: &async_nats::Client,
    subjects: &Subjects,
    timeout: Duration,
    grouping: Grouping,
    lifecycle_batch: usize,
) -> (RouterClient, RouterMetrics) {
    let settings = RouterSettings {
        timeout,
        keep_alive: Duration::from_secs(3600),
        lifecycle_batch,
        grouping,
        max_message_bytes: kv_events::limits::Limits::default().max_message_bytes,
        affinity: None,
    };
    router_client_with(nats, subjects, settings)
}

/// A router client on `nats` with `settings` (no reconnect events), and what it
/// records.
///
/// # Panics
/// Never: the metrics' options are fixed and valid.
pub fn router_client_with(
    nats: &async_nats::Client,
    subjects: &Subjects,
    settings: RouterSettings,
) -> (RouterClient, RouterMetrics) {
    let opts = prometheus::HistogramOpts::new("route_group_queries", "queries per message")
        .buckets(vec![1.0, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0]);
    #[allow(clippy::unwrap_used)] // fixed, valid options
    let metrics = RouterMetrics {
        group_sizes: prometheus::Histogram::with_opts(opts).unwrap(),
        affinity: prometheus::IntCounterVec::new(
            prometheus::Opts::new("route_affinity", "pins taken and let go"),
            &["event"],
        )
        .unwrap(),
    };
    let (_, connection) = tokio::sync::mpsc::unbounded_channel();
    let client = RouterClient::new(
        nats.clone(),
        subjects.clone(),
        settings,
        metrics.clone(),
        connection,
    );
    (client, metrics)
}

/// A decision routing `request_id` to rank 0 of `worker` with no overlap (kv policy).
pub fn decision(request_id: RequestId, worker: WorkerId) -> RouteDecision {
    RouteDecision {
        request_id,
        worker_id: worker,
        dp_rank: DpRank(0),
        overlap_blocks: 0,
        request_blocks: 1,
        in_flight_blocks: 0,
        kv_position: None,
        policy: PolicyKind::Kv,
        disaggregation: None,
        fallbacks: vec![],
    }
}
