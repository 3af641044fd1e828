//! Sync batches with real NATS: a replica publishes the steps queued at one wake-up
//! as one `SequenceSyncBatch`, in the order it applied them, and applies a peer's
//! batch step by step — as well as the single-step `SequenceSync` of a replica from
//! before batches (a rolling upgrade). Its bookings' block hashes are packed only
//! while every peer it has heard accepts them.

use super::{REQUESTS, WAIT, request_prompt, setup};
use futures::StreamExt as _;
use integration_tests::{TestCluster, eventually};
use kv_events::replicas::{
    BookedSequence, HashForm, SequenceStep, SequenceSync, SequenceSyncBatch, SequenceUpdate,
};
use kv_events::routing::{LifecycleEvent, LifecycleMessage, RouteReply};
use kv_events::{DpRank, LocalBlockHash, RequestId, RouterId, WorkerId, decode, encode};
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

/// The form in which `payload` carries `hashes` (one booking's block hashes, at
/// least one): as a msgpack array or as one `bin` of little-endian hashes.
fn form_of(payload: &[u8], hashes: &[LocalBlockHash]) -> Option<HashForm> {
    let contains = |fragment: &[u8]| payload.windows(fragment.len()).any(|w| w == fragment);
    let le: Vec<u8> = hashes.iter().flat_map(|h| h.0.to_le_bytes()).collect();
    let mut packed = match u8::try_from(le.len()) {
        Ok(len) => vec![0xc4, len],
        Err(_) => [
            vec![0xc5],
            u16::try_from(le.len()).ok()?.to_be_bytes().to_vec(),
        ]
        .concat(),
    };
    packed.extend(&le);
    if contains(&packed) {
        Some(HashForm::Packed)
    } else if contains(&encode(&hashes).ok()?) {
        Some(HashForm::Array)
    } else {
        None
    }
}

/// The sync subject, as the test's peers hear it.
struct Listener(async_nats::Subscriber);

impl Listener {
    /// The replica's next message, past this test's own (echoed) as peers 7 and 8,
    /// with the form of each of its bookings' block hashes.
    async fn next(&mut self) -> anyhow::Result<(SequenceSyncBatch, Vec<HashForm>)> {
        loop {
            let msg = tokio::time::timeout(WAIT, self.0.next())
                .await?
                .ok_or_else(|| anyhow::anyhow!("sync subscription ended"))?;
            // The test's own malformed message is skipped.
            let Ok(batch) = decode::<SequenceSyncBatch>(&msg.payload) else {
                continue;
            };
            if batch.router_id == RouterId(100) {
                // The batch form: not the single step of older replicas.
                assert!(decode::<SequenceSync>(&msg.payload).is_err());
                assert!(batch.accepts_packed);
                let forms = batch
                    .steps
                    .iter()
                    .filter_map(|step| match &step.update {
                        SequenceUpdate::Booked(b) => form_of(&msg.payload, &b.block_hashes),
                        _ => None,
                    })
                    .collect();
                return Ok((batch, forms));
            }
        }
    }
}

/// Routes `REQUESTS` requests named `{prefix}{i}` and frees them, and reads the
/// replica's steps for them: each request booked, then freed. Returns the form of
/// each booking's block hashes.
async fn published(
    cluster: &TestCluster,
    sync: &mut Listener,
    prefix: &str,
) -> anyhow::Result<Vec<HashForm>> {
    route_and_free(cluster, prefix).await?;
    let mut seen: HashMap<RequestId, Vec<&'static str>> = HashMap::new();
    let (mut messages, mut steps, mut forms) = (0, 0, Vec::new());
    while steps < 2 * REQUESTS {
        let (batch, batch_forms) = sync.next().await?;
        messages += 1;
        steps += batch.steps.len();
        forms.extend(batch_forms);
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
    anyhow::ensure!(seen.len() == REQUESTS, "{seen:?}");
    anyhow::ensure!(
        seen.values().all(|kinds| kinds == &["booked", "freed"]),
        "each request booked, then freed: {seen:?}"
    );
    anyhow::ensure!(
        forms.len() == REQUESTS,
        "every booking's hashes found: {forms:?}"
    );
    Ok(forms)
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
    let sync = cluster.nats.subscribe(subject.clone()).await?;
    kv_cluster::barrier::server_barrier(&cluster.nats).await?;
    let mut sync = Listener(sync);
    // Alone, the replica said hello at start-up and queues none of its steps.
    route_and_free(&cluster, "alone").await?;
    eventually("the lone replica's frees", WAIT, || async {
        (daemon.state().scheduler().active_requests() == 0).then_some(())
    })
    .await?;
    assert_eq!(metrics.get("out", "announced"), 1, "the hello");
    assert_eq!(metrics.get("out", "queued"), 0);

    // A peer of a version before packed bookings says hello (no `accepts_packed`):
    // the replica answers with an empty batch of its own, ahead of any step (none
    // was queued while it was alone).
    let hello = |id, accepts_packed| SequenceSyncBatch {
        router_id: RouterId(id),
        steps: vec![],
        queued_at_us: None,
        accepts_packed,
    };
    (cluster.nats)
        .publish(subject.clone(), encode(&hello(7, false))?.into())
        .await?;
    assert_eq!(
        sync.next().await?.0.steps,
        vec![],
        "the answer to the peer's hello"
    );
    assert_eq!(metrics.get("out", "announced"), 2);
    assert_eq!(metrics.peers_array_only.get(), 1);

    // Route concurrently, then free everything: 2 steps per request, now published.
    // Every message is the batch form, from this replica; each request's booking
    // comes before its free, its block hashes as arrays for the older peer.
    let forms = published(&cluster, &mut sync, "r").await?;
    assert!(forms.iter().all(|f| *f == HashForm::Array), "{forms:?}");
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
        accepts_packed: false,
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
        accepts_packed: false,
    })?;
    anyhow::ensure!(both[0] == 0x82, "a fixmap of two keys");
    both[0] = 0x84;
    both.extend(encode(&"request_id")?);
    both.extend(encode(&"p3")?);
    both.extend(encode(&"update")?);
    both.extend(encode(&SequenceUpdate::Freed)?);
    cluster.nats.publish(subject.clone(), both.into()).await?;
    let counters = &daemon.state().counters;
    eventually("the malformed message to be counted", WAIT, || async {
        (counters.messages(MessageKind::Sequences, Outcome::Malformed) == 1).then_some(())
    })
    .await?;
    assert_eq!(daemon.state().scheduler().active_requests(), 0);

    // A new peer that accepts packed bookings: the older one is still heard, so
    // arrays stay. Then the older one comes back upgraded under its configured id:
    // every peer accepts them, and the bookings go packed.
    (cluster.nats)
        .publish(subject.clone(), encode(&hello(8, true))?.into())
        .await?;
    assert_eq!(sync.next().await?.0.steps, vec![], "the answer to peer 8");
    assert_eq!(metrics.peers.get(), 2);
    let forms = published(&cluster, &mut sync, "s").await?;
    assert!(forms.iter().all(|f| *f == HashForm::Array), "{forms:?}");
    (cluster.nats)
        .publish(subject.clone(), encode(&hello(7, true))?.into())
        .await?;
    eventually(
        "peer 7 heard as accepting packed bookings",
        WAIT,
        || async { (metrics.peers_array_only.get() == 0).then_some(()) },
    )
    .await?;
    let forms = published(&cluster, &mut sync, "t").await?;
    assert!(forms.iter().all(|f| *f == HashForm::Packed), "{forms:?}");
    assert_eq!(daemon.state().scheduler().active_requests(), 0);
    for daemon in daemons {
        daemon.shutdown().await?;
    }
    Ok(())
}
