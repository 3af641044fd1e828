//! The gateway's router client as the tests and examples build it, and the route
//! decision a scripted router answers with.

use kv_events::routing::{PolicyKind, RouteDecision};
use kv_events::{DpRank, RequestId, Subjects, WorkerId};
use kv_gateway::router::{Grouping, RouterClient, RouterSettings};
use std::time::Duration;

/// A router client on `nats` asking with `timeout`, grouping route queries as
/// `grouping` says and sending at most `lifecycle_batch` lifecycle messages per NATS
/// message; no keep-alive within a test (one an hour), no replica affinity, and no
/// reconnect events. Also returns the histogram of route queries per NATS message.
///
/// # Panics
/// Never: the histogram's options are fixed and valid.
pub fn router_client(
    nats: &async_nats::Client,
    subjects: &Subjects,
    timeout: Duration,
    grouping: Grouping,
    lifecycle_batch: usize,
) -> (RouterClient, prometheus::Histogram) {
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

/// A router client on `nats` with `settings` (no reconnect events), and its
/// histogram of route queries per NATS message.
///
/// # Panics
/// Never: the histogram's options are fixed and valid.
pub fn router_client_with(
    nats: &async_nats::Client,
    subjects: &Subjects,
    settings: RouterSettings,
) -> (RouterClient, prometheus::Histogram) {
    let opts = prometheus::HistogramOpts::new("route_group_queries", "queries per message")
        .buckets(vec![1.0, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0]);
    #[allow(clippy::unwrap_used)] // fixed, valid options
    let sizes = prometheus::Histogram::with_opts(opts).unwrap();
    let (_, connection) = tokio::sync::mpsc::unbounded_channel();
    let client = RouterClient::new(
        nats.clone(),
        subjects.clone(),
        settings,
        sizes.clone(),
        connection,
    );
    (client, sizes)
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
