//! A gateway's burst through two replicas: its queries leave the gateway together
//! as one batch (route grouping), so one replica places all of them, each seeing the
//! bookings of those before it: the requests land per worker as one replica placing
//! them one by one, both replicas end with the same book, and the gateway's frees
//! empty both.

use super::{REQUESTS, WAIT, WORKERS, one_replica_one_by_one, own_bookings, request_prompt, setup};
use integration_tests::eventually;
use integration_tests::router_client::router_client;
use kv_events::routing::Prompt;
use kv_gateway::router::Grouping;
use std::collections::BTreeMap;

/// Worker 1's count (it caches the prefix) and the others' counts, sorted: ties
/// between idle workers are broken at random, so which of them got what may differ.
fn shape(per_worker: &BTreeMap<u64, usize>) -> (usize, Vec<usize>) {
    let mut others: Vec<usize> = (2..=WORKERS).map(|w| per_worker[&w]).collect();
    others.sort_unstable();
    (per_worker[&1], others)
}

#[tokio::test]
async fn a_gateway_burst_is_placed_by_one_replica_as_one_replica_would() -> anyhow::Result<()> {
    let alone = one_replica_one_by_one().await?;
    let (cluster, pair) = setup(2, true).await?;
    let grouping = Grouping {
        max: 32,
        hold: WAIT,
    };
    let (client, metrics) = router_client(&cluster.nats, &cluster.subjects, WAIT, grouping, 16);
    // All at once, as requests reaching the gateway in the same instant. On this
    // test's single-threaded runtime every query is queued before the grouping task
    // runs, so they leave as one batch.
    let asks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let client = client.clone();
            let prompt = Prompt::Tokens {
                token_ids: request_prompt(i),
            };
            tokio::spawn(async move {
                let id = format!("r{i}").as_str().into();
                client.route(id, prompt, &[], None, false).await
            })
        })
        .collect();
    let mut per_worker: BTreeMap<u64, usize> = (1..=WORKERS).map(|w| (w, 0)).collect();
    let mut bookings = Vec::new();
    for (i, ask) in asks.into_iter().enumerate() {
        let (decision, booking) = ask.await?.map_err(|e| anyhow::anyhow!("r{i}: {e:?}"))?;
        assert_eq!(decision.request_id.0, format!("r{i}"));
        *per_worker.entry(decision.worker_id.0).or_default() += 1;
        bookings.push(booking);
    }
    assert_eq!(
        metrics.group_sizes.get_sample_count(),
        1,
        "the burst left as one message"
    );
    assert_eq!(metrics.group_sizes.get_sample_sum(), REQUESTS as f64);
    assert_eq!(
        shape(&per_worker),
        shape(&alone),
        "placed as one replica places them one by one: {per_worker:?} vs {alone:?}"
    );
    let mut own: Vec<usize> = pair.iter().map(own_bookings).collect();
    own.sort_unstable();
    assert_eq!(own, [0, REQUESTS], "one replica booked the whole burst");
    for daemon in &pair {
        eventually(
            "the burst's bookings to reach both replicas",
            WAIT,
            || async { (daemon.state().scheduler().active_requests() == REQUESTS).then_some(()) },
        )
        .await?;
    }

    drop(bookings);
    for daemon in &pair {
        eventually(
            "the gateway's frees to empty both replicas",
            WAIT,
            || async { (daemon.state().scheduler().active_requests() == 0).then_some(()) },
        )
        .await?;
    }
    for daemon in pair {
        daemon.shutdown().await?;
    }
    Ok(())
}
