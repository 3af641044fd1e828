//! Sync batches with real NATS: a replica publishes the steps queued at one wake-up
//! as one `SequenceSyncBatch`, in the order it applied them, and applies a peer's
//! batch step by step — as well as the single-step `SequenceSync` of a replica from
//! before batches (a rolling upgrade).

use super::{REQUESTS, WAIT, request_prompt, setup};
use futures::StreamExt as _;
use integration_tests::{TestCluster, eventually};
use kv_events::replicas::{
    BookedSequence, SequenceStep, SequenceSync, SequenceSyncBatch, SequenceUpdate,
};
use kv_events::routing::{LifecycleEvent, LifecycleMessage, RouteReply};
use kv_events::{DpRank, RequestId, RouterId, WorkerId, decode, encode};
use router_daemon::counters::{MessageKind, Outcome};
use std::collections::HashMap;

fn peer_booking(id: &str) -> SequenceStep {
    SequenceStep {
        request_id: id.into(),
        update: SequenceUpdate::Booked(BookedSequence {
            worker_id: WorkerId(2),
            dp_rank: DpRank(0),
            block_hashes: vec![],
            request_blocks: 2,
            prefill_tokens: 8,
            expected_prefill_ms: None,
            session_id: None,
        }),
    }
}

/// Routes `REQUESTS` requests named `{prefix}{i}` concurrently, then frees them all.
async fn route_and_free(cluster: &TestCluster, prefix: &str) -> anyhow::Result<()> {
    let routes = (0..REQUESTS).map(|i| async move {
        let id = format!("{prefix}{i}");
        cluster.route_tokens(&id, request_prompt(i)).await
    });
    for reply in futures::future::join_all(routes).await {
        anyhow::ensure!(
            matches!(reply?, RouteReply::Routed(_)),
            "a request was not routed"
        );
    }
    for i in 0..REQUESTS {
        let freed = LifecycleMessage {
            request_id: format!("{prefix}{i}").into(),
            event: LifecycleEvent::Freed,
        };
        (cluster.nats)
            .publish(cluster.subjects.lifecycle(), encode(&freed)?.into())
            .await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_replica_publishes_its_steps_in_batches_and_applies_both_forms() -> anyhow::Result<()> {
    let (cluster, daemons) = setup(1, true).await?;
    let daemon = &daemons[0];
    let metrics = daemon.state().admission.replicas.metrics();
    let subject = cluster.subjects.sequences();
    let mut sync = cluster.nats.subscribe(subject.clone()).await?;
    kv_cluster::barrier::server_barrier(&cluster.nats).await?;
    // The replica's next message, past this test's own (echoed) as peer 7.
    let mut next = async || -> anyhow::Result<SequenceSyncBatch> {
        loop {
            let msg = tokio::time::timeout(WAIT, sync.next())
                .await?
                .ok_or_else(|| anyhow::anyhow!("sync subscription ended"))?;
            // The batch form: not the single step of older replicas.
            assert!(decode::<SequenceSync>(&msg.payload).is_err());
            let batch: SequenceSyncBatch = decode(&msg.payload)?;
            if batch.router_id != RouterId(7) {
                assert_eq!(batch.router_id, RouterId(100));
                return Ok(batch);
            }
        }
    };

    // Alone, the replica said hello at start-up and queues none of its steps.
    route_and_free(&cluster, "alone").await?;
    eventually("the lone replica's frees", WAIT, || async {
        (daemon.state().scheduler().active_requests() == 0).then_some(())
    })
    .await?;
    assert_eq!(metrics.get("out", "announced"), 1, "the hello");
    assert_eq!(metrics.get("out", "queued"), 0);

    // A peer says hello: the replica answers with an empty batch of its own, ahead
    // of any step (none was queued while it was alone).
    let hello = SequenceSyncBatch {
        router_id: RouterId(7),
        steps: vec![],
        queued_at_us: None,
    };
    (cluster.nats)
        .publish(subject.clone(), encode(&hello)?.into())
        .await?;
    assert_eq!(
        next().await?.steps,
        vec![],
        "the answer to the peer's hello"
    );
    assert_eq!(metrics.get("out", "announced"), 2);

    // Route concurrently, then free everything: 2 steps per request, now published.
    // Every message is the batch form, from this replica; each request's booking
    // comes before its free.
    route_and_free(&cluster, "r").await?;
    let mut seen: HashMap<RequestId, Vec<&'static str>> = HashMap::new();
    let (mut messages, mut steps) = (0, 0);
    while steps < 2 * REQUESTS {
        let batch = next().await?;
        messages += 1;
        steps += batch.steps.len();
        for step in batch.steps {
            let kind = match step.update {
                SequenceUpdate::Booked(_) => "booked",
                SequenceUpdate::Freed => "freed",
                other => anyhow::bail!("unexpected step {other:?}"),
            };
            seen.entry(step.request_id).or_default().push(kind);
        }
    }
    eprintln!("{steps} steps in {messages} sync messages");
    assert_eq!(seen.len(), REQUESTS);
    assert!(
        seen.values().all(|kinds| kinds == &["booked", "freed"]),
        "each request booked, then freed: {seen:?}"
    );
    assert_eq!(metrics.get("out", "published"), 2 * REQUESTS as u64);
    assert_eq!(
        metrics.get("out", "announced"),
        2,
        "one answer, to the first peer"
    );

    // A peer's batch: two bookings and the free of the first, applied in order.
    let batch = SequenceSyncBatch {
        router_id: RouterId(7),
        steps: vec![
            peer_booking("p1"),
            peer_booking("p2"),
            SequenceStep {
                request_id: "p1".into(),
                update: SequenceUpdate::Freed,
            },
        ],
        queued_at_us: None,
    };
    cluster
        .nats
        .publish(subject.clone(), encode(&batch)?.into())
        .await?;
    eventually("the peer's batch to be applied", WAIT, || async {
        let scheduler = daemon.state().scheduler();
        let ids: Vec<String> = scheduler
            .sequences()
            .iter()
            .map(|(id, _)| id.0.clone())
            .collect();
        (ids == ["p2"]).then_some(())
    })
    .await?;
    // An older peer's single step frees the second.
    let single = SequenceSync {
        router_id: RouterId(7),
        request_id: "p2".into(),
        update: SequenceUpdate::Freed,
    };
    cluster
        .nats
        .publish(subject.clone(), encode(&single)?.into())
        .await?;
    eventually("the single-step free to be applied", WAIT, || async {
        (daemon.state().scheduler().active_requests() == 0).then_some(())
    })
    .await?;
    assert_eq!(metrics.get("in", "applied"), 4);

    // A map with both forms' fields is malformed, counted once, and skipped.
    // (Msgpack maps concatenate: a batch's map with the single form's two extra keys.)
    let mut both = encode(&SequenceSyncBatch {
        router_id: RouterId(7),
        steps: vec![peer_booking("p4")],
        queued_at_us: None,
    })?;
    anyhow::ensure!(both[0] == 0x82, "a fixmap of two keys");
    both[0] = 0x84;
    both.extend(encode(&"request_id")?);
    both.extend(encode(&"p3")?);
    both.extend(encode(&"update")?);
    both.extend(encode(&SequenceUpdate::Freed)?);
    cluster.nats.publish(subject, both.into()).await?;
    let counters = &daemon.state().counters;
    eventually("the malformed message to be counted", WAIT, || async {
        (counters.messages(MessageKind::Sequences, Outcome::Malformed) == 1).then_some(())
    })
    .await?;
    assert_eq!(daemon.state().scheduler().active_requests(), 0);
    for daemon in daemons {
        daemon.shutdown().await?;
    }
    Ok(())
}
