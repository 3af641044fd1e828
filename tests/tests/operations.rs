//! Operations, end to end with real nats-server and etcd: readiness during start-up,
//! NATS restarts, etcd outages at start-up and later, and the shutdown order. Each test
//! runs the daemon in-process the way `kv-router serve` does (HTTP endpoint first) and
//! observes it through `/health/readyz`, `/metrics` and `/debug/workers`.

#[path = "operations/fixture.rs"]
mod fixture;
#[path = "journal_worker/mod.rs"]
mod journal_worker;

use fixture::{Fixture, WAIT, http, metric, prompt, readyz};
use indexer::IndexerApi as _;
use integration_tests::{TestCluster, eventually};
use journal_worker::{JournalWorker, chain_from_root, held_paths, router_paths};
use kv_events::DpRank;
use router_daemon::Phase;
use router_daemon::counters::{MessageKind, Outcome};
use serde_json::Value;
use std::time::Duration;

fn routed_worker(reply: &Value) -> Option<u64> {
    (reply["status"] == "routed").then(|| reply["worker_id"].as_u64())?
}

#[tokio::test]
async fn etcd_down_at_start_up_is_retried_and_ready_comes_only_after_discovery()
-> anyhow::Result<()> {
    let mut fx = Fixture::without_etcd_path().await?;
    let (starting, addr) = fx.prepare().await?;
    let mut ready_changes = starting.state().health.subscribe();
    let start = tokio::spawn(starting.start());

    // Live at once; not ready while etcd refuses connections; retried with backoff.
    assert_eq!(http(&addr, "/health/livez").await?.0, 200);
    eventually("two failed etcd attempts", WAIT, || async {
        let failures = metric(&addr, "kv_router_etcd_errors_total", r#"stage="load""#)
            .await
            .ok()??;
        (failures >= 2.0).then_some(())
    })
    .await?;
    let (status, report) = readyz(&addr).await?;
    assert_eq!(status, 503, "{report}");
    assert_eq!(report["phase"], "starting");
    assert_eq!(report["checks"]["nats"]["ok"], true, "{report}");
    assert_eq!(report["checks"]["etcd"]["ok"], false);
    assert!(
        report["checks"]["etcd"]["detail"]
            .as_str()
            .is_some_and(|d| d.contains("load failed")),
        "{report}"
    );
    assert_eq!(report["checks"]["discovery"]["ok"], false);
    assert_eq!(report["checks"]["recovery"]["ok"], false);
    assert_eq!(metric(&addr, "kv_router_ready", "").await?, Some(0.0));
    assert!(!start.is_finished(), "start-up must wait for etcd");
    assert!(!*ready_changes.borrow_and_update());

    // A worker registers while the daemon waits; then etcd becomes reachable.
    let lease = fx.register(1, 30).await?;
    fx.proxy.restore().await?;
    let daemon = tokio::time::timeout(WAIT, start).await???;
    assert!(*ready_changes.borrow_and_update(), "ready once started");

    let (status, report) = readyz(&addr).await?;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["phase"], "running");
    for check in ["nats", "etcd", "discovery", "recovery"] {
        assert_eq!(report["checks"][check]["ok"], true, "{check}: {report}");
    }
    let workers: Value = serde_json::from_str(&http(&addr, "/debug/workers").await?.1)?;
    assert_eq!(workers["workers"][0]["worker_id"], 1, "{workers}");
    assert_eq!(workers["workers"][0]["lease_id"], lease);
    assert_eq!(
        metric(&addr, "kv_router_etcd_connected", "").await?,
        Some(1.0)
    );
    assert_eq!(metric(&addr, "kv_router_workers", "").await?, Some(1.0));
    daemon.shutdown().await
}

#[tokio::test]
async fn nats_restart_resumes_routing_and_applies_later_events() -> anyhow::Result<()> {
    // KV events reach the daemon on its main connection and route queries on the route
    // path's: a query sent right after an event may be decided before it is applied.
    let tries = std::sync::atomic::AtomicU32::new(0);
    let fresh_id = |name: &str| {
        let n = tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{name}-{n}")
    };
    let mut fx = Fixture::start().await?;
    let (starting, addr) = fx.prepare().await?;
    let daemon = starting.start().await?;
    fx.register(1, 30).await?;
    fx.register(2, 30).await?;
    eventually("both workers registered", WAIT, || async {
        (daemon.state().scheduler().workers().count() == 2).then_some(())
    })
    .await?;
    let before = prompt(1, 4);
    fx.store(2, 0, &before).await?;
    eventually("worker 2's prefix routed to it", WAIT, || async {
        // A fresh id per try: a try routed before the event was applied stays booked.
        let reply = fx.route(&fresh_id("before"), &before).await.ok()?;
        (routed_worker(&reply) == Some(2)).then_some(())
    })
    .await?;

    fx.nats_server.restart().await?;
    eventually(
        "the daemon to see the disconnect and reconnect",
        WAIT,
        || async {
            let down = metric(
                &addr,
                "kv_router_nats_events_total",
                r#"event="disconnected""#,
            )
            .await
            .ok()??;
            let (status, _) = readyz(&addr).await.ok()?;
            (down >= 1.0 && status == 200).then_some(())
        },
    )
    .await?;
    assert_eq!(
        metric(&addr, "kv_router_nats_connected", "").await?,
        Some(1.0)
    );

    // Routing resumes: the route subscription was re-sent on reconnect.
    eventually("routing to resume", WAIT, || async {
        let reply = fx.route(&fresh_id("resume"), &before).await.ok()?;
        (routed_worker(&reply) == Some(2)).then_some(())
    })
    .await?;
    // Events published after the restart are applied: worker 1 now holds a prompt
    // worker 2 never saw, and routing follows it.
    let after = prompt(2, 5);
    fx.store(1, 0, &after).await?;
    eventually("the post-restart event to be applied", WAIT, || async {
        let reply = fx
            .route(&fresh_id("after"), &integration_tests::continued(&after))
            .await
            .ok()?;
        (routed_worker(&reply) == Some(1) && reply["overlap_blocks"] == 5).then_some(())
    })
    .await?;
    daemon.shutdown().await
}

#[tokio::test]
async fn etcd_lost_later_keeps_the_last_known_workers_and_reports_it() -> anyhow::Result<()> {
    let mut fx = Fixture::start().await?;
    let (starting, addr) = fx.prepare().await?;
    let daemon = starting.start().await?;
    fx.register(1, 30).await?;
    eventually("worker registered", WAIT, || async {
        (daemon.state().scheduler().workers().count() == 1).then_some(())
    })
    .await?;

    // Cut the path to etcd: the watch fails, the daemon reports it and keeps routing.
    fx.proxy.cut().await;
    eventually("etcd loss reported", WAIT, || async {
        let lost = metric(&addr, "kv_router_etcd_connected", "").await.ok()?? == 0.0;
        lost.then_some(())
    })
    .await?;
    let (status, report) = readyz(&addr).await?;
    assert_eq!(
        status, 200,
        "etcd loss after start-up keeps the daemon ready: {report}"
    );
    assert_eq!(report["checks"]["etcd"]["ok"], false);
    assert!(
        report["checks"]["etcd"]["detail"]
            .as_str()
            .is_some_and(|d| d.contains("serving the last known workers")),
        "{report}"
    );
    let workers: Value = serde_json::from_str(&http(&addr, "/debug/workers").await?.1)?;
    assert_eq!(workers["etcd"]["ok"], false);
    assert_eq!(workers["workers"].as_array().map(Vec::len), Some(1));
    let reply = fx.route("during-outage", &prompt(3, 2)).await?;
    assert_eq!(routed_worker(&reply), Some(1), "{reply}");

    // While etcd is away the worker leaves and another joins; on reconnect the daemon
    // resyncs and reconciles.
    let mut etcd = fx.etcd().await?;
    etcd.delete(fx.subjects.etcd_worker_key(kv_events::WorkerId(1)), None)
        .await?;
    fx.register(2, 30).await?;
    fx.proxy.restore().await?;
    eventually("etcd reconnect and resync", WAIT, || async {
        let ids: Vec<_> = daemon
            .state()
            .scheduler()
            .workers()
            .map(|w| w.worker_id.0)
            .collect();
        let up = daemon.state().health.etcd_connected();
        (up && ids == [2]).then_some(())
    })
    .await?;
    assert_eq!(
        metric(&addr, "kv_router_etcd_connected", "").await?,
        Some(1.0)
    );
    assert!(
        metric(&addr, "kv_router_etcd_errors_total", r#"stage="watch""#)
            .await?
            .unwrap_or(0.0)
            >= 1.0
    );
    drop(fx.etcd_server.take());
    daemon.shutdown().await
}

#[tokio::test]
async fn shutdown_answers_or_rejects_in_flight_queries_and_drains_accepted_events()
-> anyhow::Result<()> {
    let fx = Fixture::start().await?;
    let (starting, addr) = fx.prepare().await?;
    let daemon = starting.start().await?;
    let state = daemon.state().clone();
    fx.register(1, 30).await?;
    eventually("worker registered", WAIT, || async {
        (state.scheduler().workers().count() == 1).then_some(())
    })
    .await?;

    // A stream of events and a burst of queries, with shutdown in the middle.
    let publisher = {
        let nats = fx.nats.clone();
        let subjects = fx.subjects.clone();
        tokio::spawn(async move {
            for i in 0..3000u32 {
                let tokens = prompt(100 + i, 1);
                let hash = kv_events::compute_block_hashes(&tokens, fixture::BLOCK)[0].0;
                let batch = serde_json::json!({"worker_id": 1, "events": [{"event_id": i,
                    "dp_rank": 0, "data": {"type": "stored", "parent_hash": null,
                    "blocks": [{"block_hash": hash, "tokens_hash": hash}]}}]});
                let payload = kv_events::encode(&batch).expect("json encodes");
                if nats
                    .publish(subjects.kv_events(kv_events::WorkerId(1)), payload.into())
                    .await
                    .is_err()
                {
                    break;
                }
            }
            let _ = nats.flush().await;
        })
    };
    eventually("intake under way", WAIT, || async {
        (state.counters.messages(MessageKind::Events, Outcome::Ok) > 0).then_some(())
    })
    .await?;
    let queries: Vec<_> = (0..256)
        .map(|i| {
            let nats = fx.nats.clone();
            let subjects = fx.subjects.clone();
            tokio::spawn(async move {
                let request = serde_json::json!({"request_id": format!("q{i}"),
                    "prompt": {"type": "tokens", "token_ids": prompt(7, 3)}});
                let payload = kv_events::encode(&request).expect("json encodes");
                tokio::time::timeout(
                    Duration::from_secs(10),
                    nats.request(subjects.route(), payload.into()),
                )
                .await
            })
        })
        .collect();
    let mut readiness = state.health.subscribe();
    daemon.shutdown().await?;
    assert!(
        readiness.has_changed()? && !*readiness.borrow_and_update(),
        "not ready once shutdown began"
    );
    assert_eq!(state.health.phase(), Phase::Stopped);

    // Every query was answered or rejected with "no responders"; none hung.
    let (mut answered, mut rejected) = (0u64, 0u64);
    for q in queries {
        match q.await? {
            Ok(Ok(reply)) => {
                let reply: Value = kv_events::decode(&reply.payload)?;
                assert_eq!(routed_worker(&reply), Some(1), "{reply}");
                answered += 1;
            }
            Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => rejected += 1,
            Ok(Err(e)) => panic!("query failed other than by no responders: {e}"),
            Err(_) => panic!("a query hung through shutdown"),
        }
    }
    assert_eq!(answered + rejected, 256);
    assert_eq!(
        answered,
        state.counters.messages(MessageKind::Route, Outcome::Ok),
        "every query the daemon took was answered"
    );

    // Every batch intake accepted reached the shards before they stopped.
    publisher.abort();
    let accepted = state.counters.messages(MessageKind::Events, Outcome::Ok);
    let applied = state.indexer.counters().snapshot().batches;
    assert!(accepted > 0);
    assert_eq!(
        applied, accepted,
        "accepted batches were drained, not dropped"
    );

    // The endpoint is gone last.
    assert!(http(&addr, "/health/livez").await.is_err());
    Ok(())
}

#[tokio::test]
async fn events_lost_while_nats_was_down_are_recovered_after_reconnect() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(fixture::BLOCK).await?;
    let worker = JournalWorker::start(&mut cluster, 1, 1, 4096).await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    for i in 0..5 {
        worker
            .record_and_publish(DpRank(0), chain_from_root(worker.id(), i, 3))
            .await?;
    }
    eventually("the first events indexed", WAIT, || async {
        (router_paths(&daemon, worker.id()).await == held_paths(&worker.dump(DpRank(0))))
            .then_some(())
    })
    .await?;
    let ranges_before = worker.ranges_served();

    cluster.nats_server.restart().await?;
    // What the engine cached while the router was cut off never reached it.
    for i in 5..10 {
        worker.record(DpRank(0), chain_from_root(worker.id(), i, 3));
    }
    eventually("routing to resume after the reconnect", WAIT, || async {
        let tokens = journal_worker::chain_tokens(worker.id(), 0, 3, fixture::BLOCK);
        matches!(
            cluster.route_tokens("probe", tokens).await,
            Ok(kv_events::routing::RouteReply::Routed(_))
        )
        .then_some(())
    })
    .await?;
    // The next event reveals the gap; the daemon recovers the missed range.
    worker
        .record_and_publish(DpRank(0), chain_from_root(worker.id(), 10, 3))
        .await?;
    eventually("the gap to be recovered", WAIT, || async {
        (router_paths(&daemon, worker.id()).await == held_paths(&worker.dump(DpRank(0))))
            .then_some(())
    })
    .await?;
    assert_eq!(
        worker.ranges_served(),
        ranges_before + 1,
        "the missed range was asked for"
    );
    let counters = daemon.state().indexer.counters().snapshot();
    assert_eq!((counters.gaps, counters.events_lost), (1, 0));
    assert!(
        daemon
            .state()
            .counters
            .metrics
            .connections
            .nats_events("disconnected")
            >= 1
    );
    daemon.shutdown().await
}
