//! The gateway's router client as the tests and examples build it, and the route
//! decision a scripted router answers with.

use kv_events::routing::{PolicyKind, RouteDecision};
use kv_events::{DpRank, RequestId, Subjects, WorkerId};
use kv_gateway::router::{Grouping, ReplicaAffinity, RouterClient, RouterMetrics, RouterSettings};
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
    let settings = settings(timeout, grouping, lifecycle_batch, None);
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
    let (_, connection) = tokio::sync::mpsc::unbounded_channel();
    router_client_on(nats, subjects, settings, connection)
}

/// A router client on `nats` with `settings`, told of the connection's ups and downs
/// by `connection` (as the gateway is), and what it records.
///
/// # Panics
/// Never: the metrics' options are fixed and valid.
pub fn router_client_on(
    nats: &async_nats::Client,
    subjects: &Subjects,
    settings: RouterSettings,
    connection: tokio::sync::mpsc::UnboundedReceiver<async_nats::Event>,
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
        stalls: prometheus::IntCounterVec::new(
            prometheus::Opts::new("route_stalls", "stalled replicas and queries asked again"),
            &["event"],
        )
        .unwrap(),
    };
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

/// Routes query `n` (request id `q-{n}`, a prompt of 8 tokens `n`) on `client` in a
/// task, dropping the booking (its `freed` goes out) once routed.
pub fn ask(
    client: &RouterClient,
    n: u32,
) -> tokio::task::JoinHandle<Result<kv_events::routing::RouteReply, kv_gateway::error::ApiError>> {
    let client = client.clone();
    let id = format!("q-{n}").as_str().into();
    let prompt = kv_events::routing::Prompt::Tokens {
        token_ids: vec![n; 8],
    };
    tokio::spawn(async move {
        let (decision, booking) = client.route(id, prompt, &[], None, false).await?;
        std::mem::drop(booking);
        Ok(kv_events::routing::RouteReply::Routed(decision))
    })
}

/// Router client settings for a test: `timeout`, `grouping`, at most
/// `lifecycle_batch` lifecycle messages per NATS message, `affinity`; no keep-alive
/// within a test (one an hour), the default message bound.
pub fn settings(
    timeout: Duration,
    grouping: Grouping,
    lifecycle_batch: usize,
    affinity: Option<ReplicaAffinity>,
) -> RouterSettings {
    RouterSettings {
        timeout,
        keep_alive: Duration::from_secs(3600),
        lifecycle_batch,
        grouping,
        max_message_bytes: kv_events::limits::Limits::default().max_message_bytes,
        affinity,
    }
}

/// No grouping: each query leaves alone.
pub const ALONE: Grouping = Grouping {
    max: 1,
    hold: Duration::ZERO,
};

/// Settings that send each query alone (no grouping) and lifecycle messages one per
/// NATS message, with `timeout` and `affinity`.
pub fn one_by_one(timeout: Duration, affinity: Option<ReplicaAffinity>) -> RouterSettings {
    settings(timeout, ALONE, 1, affinity)
}
