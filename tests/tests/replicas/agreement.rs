//! Four replicas agree: the queries NATS spreads between them, routed all at once,
//! end up booked the same on every replica — every request on the same rank, the same
//! booked load per rank — within a deadline, and every replica measures the
//! replication lag of its peers' bookings. Without sync each replica would hold only
//! what it booked itself, and the views would never converge.

use super::{REQUESTS, WAIT, own_bookings, request_prompt, setup};
use integration_tests::eventually;
use kv_events::WorkerRank;
use kv_events::routing::RouteReply;
use router_daemon::Daemon;
use std::collections::BTreeMap;

const REPLICAS: u64 = 4;

/// What one replica has booked: each request's rank, and each rank's booked decode
/// blocks and requests.
#[derive(Debug, PartialEq, Eq)]
struct View {
    requests: BTreeMap<String, WorkerRank>,
    load: Vec<(WorkerRank, u64, usize)>,
}

fn view(daemon: &Daemon) -> View {
    let scheduler = daemon.state().scheduler();
    View {
        requests: scheduler
            .sequences()
            .iter()
            .map(|(id, r)| (id.0.clone(), r.rank))
            .collect(),
        load: scheduler
            .rank_loads()
            .map(|(rank, l)| (rank, l.active_decode_blocks, l.active_requests))
            .collect(),
    }
}

#[tokio::test]
async fn four_replicas_converge_on_one_book_and_measure_their_lag() -> anyhow::Result<()> {
    let (cluster, daemons) = setup(REPLICAS, true).await?;
    // All at once, so decisions race the sync messages as they do under load.
    let ids: Vec<String> = (0..REQUESTS).map(|i| format!("r{i}")).collect();
    let replies = futures::future::try_join_all(
        ids.iter()
            .enumerate()
            .map(|(i, id)| cluster.route_tokens(id, request_prompt(i))),
    )
    .await?;
    let mut decided = BTreeMap::new();
    for (i, reply) in replies.iter().enumerate() {
        match reply {
            RouteReply::Routed(d) => decided.insert(format!("r{i}"), d.worker_id),
            RouteReply::Error(e) => anyhow::bail!("request {i} failed: {e:?}"),
        };
    }
    let own: Vec<usize> = daemons.iter().map(own_bookings).collect();
    assert_eq!(own.iter().sum::<usize>(), REQUESTS, "{own:?}");
    assert!(
        own.iter().filter(|&&n| n > 0).count() >= 2,
        "the queue group spread the queries over the replicas: {own:?}"
    );

    // Every replica converges on the same book, the one the answers describe.
    let first = eventually("every replica to hold every booking", WAIT, || async {
        let mut views: Vec<View> = daemons.iter().map(view).collect();
        let complete = views[0].requests.len() == REQUESTS;
        (complete && views.iter().all(|v| *v == views[0])).then(|| views.swap_remove(0))
    })
    .await
    .map_err(|e| {
        let sizes: Vec<usize> = daemons.iter().map(|d| view(d).requests.len()).collect();
        e.context(format!("bookings held per replica: {sizes:?}"))
    })?;
    let booked: BTreeMap<String, _> = first
        .requests
        .iter()
        .map(|(id, rank)| (id.clone(), rank.worker_id))
        .collect();
    assert_eq!(booked, decided, "the book holds what each reply decided");

    // Each replica received a peer's booking, and measured its lag (one clock here).
    for (i, daemon) in daemons.iter().enumerate() {
        let lag = &daemon.state().admission.replicas.metrics().lag;
        assert!(
            lag.get_sample_count() > 0,
            "replica {i} measured no replication lag"
        );
        assert!(
            lag.get_sample_sum() / (lag.get_sample_count() as f64) < WAIT.as_secs_f64(),
            "replica {i}: a lag longer than the convergence deadline is a wrong clock"
        );
    }
    for daemon in daemons {
        daemon.shutdown().await?;
    }
    Ok(())
}
