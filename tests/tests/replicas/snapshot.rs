//! The start-up snapshot end to end: a replica that starts late learns the bookings
//! its peers already hold, and a request freed while it starts is not resurrected.

use super::*;
use futures::StreamExt;
use integration_tests::booked_requests;
use kv_events::replicas::{SnapshotEntry, SnapshotReply, SnapshotRequest};
use kv_events::{LocalBlockHash, decode};
use router_daemon::Starting;
use std::time::Instant;

/// Per-rank booked load, every field `rank_loads()` reports: prefill tokens, decode
/// blocks, requests, uncached tokens, context blocks.
fn rank_loads(daemon: &Daemon) -> Vec<(WorkerRank, [u64; 5])> {
    daemon
        .state()
        .scheduler()
        .rank_loads()
        .map(|(rank, l)| {
            let fields = [
                l.active_prefill_tokens,
                l.active_decode_blocks,
                l.active_requests as u64,
                l.active_uncached_tokens,
                l.active_context_blocks,
            ];
            (rank, fields)
        })
        .collect()
}

#[tokio::test]
async fn a_late_replica_learns_the_bookings_its_peers_hold() -> anyhow::Result<()> {
    // A long window: the first replica must not wait for it, nobody answers.
    let started = Instant::now();
    let (cluster, mut first) = setup_with(1, |args| {
        args.scheduling.replica_snapshot_timeout_ms = 30_000
    })
    .await?;
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "\"no responders\" ends the first replica's snapshot at once"
    );
    let a = first.remove(0);
    const BOOKED: usize = 12;
    for i in 0..BOOKED {
        let reply = cluster
            .route_tokens(&format!("r{i}"), request_prompt(i))
            .await?;
        anyhow::ensure!(
            matches!(reply, RouteReply::Routed(_)),
            "request {i}: {reply:?}"
        );
    }
    for i in (0..BOOKED).step_by(2) {
        cluster
            .lifecycle(&format!("r{i}"), LifecycleEvent::PrefillDone)
            .await?;
    }
    eventually("A to apply the prefill_done messages", WAIT, || async {
        let done = booked_requests(&a)
            .values()
            .filter(|(_, done)| *done)
            .count();
        (done == BOOKED / 2).then_some(())
    })
    .await?;
    assert!(
        booked_requests(&a)
            .values()
            .all(|(origin, _)| *origin == Origin::Local)
    );

    // B starts while A serves, and learns A's bookings before it is ready.
    let b = start_replica(&cluster, 101, |args| {
        args.scheduling.replica_snapshot_timeout_ms = 2000;
    })
    .await?;
    let a_loads = rank_loads(&a);
    assert!(a_loads.iter().any(|(_, l)| l[2] > 0));
    assert_eq!(rank_loads(&b), a_loads, "B sees A's per-rank load");
    let a_requests = booked_requests(&a);
    let b_requests = booked_requests(&b);
    assert_eq!(b_requests.len(), BOOKED);
    for (id, (origin, done)) in &b_requests {
        assert_eq!(*origin, Origin::Peer(RouterId(100)), "{id}");
        assert_eq!(Some(done), a_requests.get(id).map(|(_, d)| d), "{id}");
    }
    let answered = a.state().admission.replicas.metrics();
    assert_eq!(answered.get("snapshot_out", "answered"), 1);
    assert!(answered.get("snapshot_out", "published") >= 1);
    let learned = b.state().admission.replicas.metrics();
    assert_eq!(learned.get("snapshot_in", "applied"), BOOKED as u64);
    assert_eq!(learned.get("snapshot_in", "malformed"), 0);

    // C starts with the snapshot off: it knows none of the earlier bookings.
    let c = start_replica(&cluster, 102, |args| {
        args.scheduling.replica_snapshot_timeout_ms = 0;
    })
    .await?;
    assert_eq!(c.state().scheduler().active_requests(), 0);
    assert_eq!(
        answered.get("snapshot_out", "answered"),
        1,
        "C asked nobody"
    );

    // Live sync goes on: a free reaches both peers.
    cluster.lifecycle("r0", LifecycleEvent::Freed).await?;
    for daemon in [&a, &b] {
        eventually("r0 to be freed", WAIT, || async {
            (daemon.state().scheduler().active_requests() == BOOKED - 1).then_some(())
        })
        .await?;
    }

    // C asked no snapshot, but its hello reached A and B, who answered it though
    // they had heard a peer before: every replica hears the two others, before any
    // of them routes a request.
    for daemon in [&a, &b, &c] {
        let sync = daemon.state().admission.replicas.metrics();
        eventually("every replica to hear the two others", WAIT, || async {
            (sync.peers.get() == 2).then_some(())
        })
        .await?;
    }
    // So what C books reaches both, and C learns what they book.
    let mut i = BOOKED;
    while !booked_requests(&c)
        .values()
        .any(|(origin, _)| *origin == Origin::Local)
    {
        anyhow::ensure!(i < BOOKED + 64, "the queue group never reached C");
        let reply = cluster
            .route_tokens(&format!("r{i}"), request_prompt(i))
            .await?;
        anyhow::ensure!(matches!(reply, RouteReply::Routed(_)), "{reply:?}");
        i += 1;
    }
    let late = i - BOOKED;
    for (daemon, known) in [(&a, BOOKED - 1 + late), (&b, BOOKED - 1 + late), (&c, late)] {
        eventually("the late requests to reach every replica", WAIT, || async {
            (daemon.state().scheduler().active_requests() == known).then_some(())
        })
        .await?;
    }
    for daemon in [a, b, c] {
        daemon.shutdown().await?;
    }
    Ok(())
}

/// A fake peer answers the snapshot request of a starting replica only after the
/// replica has seen steps taken after the fake peer's "snapshot": the freed requests
/// are not resurrected, the prefill_done is kept.
#[tokio::test]
async fn a_request_freed_while_a_replica_starts_is_not_resurrected() -> anyhow::Result<()> {
    let (cluster, _none) = setup(0, true).await?;
    let mut requests_seen = cluster
        .nats
        .subscribe(cluster.subjects.sequences_snapshot())
        .await?;
    kv_cluster::barrier::server_barrier(&cluster.nats).await?;

    let args = replica_args(&cluster, 101, |args| {
        args.scheduling.replica_snapshot_timeout_ms = 3000;
    });
    let starting = Starting::new(
        DaemonConfig::from_args(&args)?,
        &prometheus::Registry::new(),
    )?;
    let state = starting.state().clone();
    let start = tokio::spawn(starting.start());

    let request = tokio::time::timeout(WAIT, requests_seen.next())
        .await?
        .ok_or_else(|| anyhow::anyhow!("subscription closed"))?;
    let asked: SnapshotRequest = decode(&request.payload)?;
    assert_eq!(asked.router_id, RouterId(101));
    let inbox = request
        .reply
        .ok_or_else(|| anyhow::anyhow!("snapshot request without a reply inbox"))?;
    drop(requests_seen);

    // After the peer took its snapshot: two of its requests end (one freed through
    // the peer's sync, one by the frontend) and one finishes its prefill.
    let peer = RouterId(7);
    let sync = |id: &str, update: SequenceUpdate| SequenceSync {
        router_id: peer,
        request_id: id.into(),
        update,
    };
    for msg in [
        sync("gone-peer", SequenceUpdate::Freed),
        sync("early", SequenceUpdate::PrefillDone),
    ] {
        cluster
            .nats
            .publish(cluster.subjects.sequences(), encode(&msg)?.into())
            .await?;
    }
    cluster
        .lifecycle("gone-frontend", LifecycleEvent::Freed)
        .await?;
    let sync_metrics = &state.admission.replicas;
    eventually("the starting replica to see the steps", WAIT, || async {
        (sync_metrics.metrics().get("in", "duplicate") == 2
            && state
                .counters
                .messages(MessageKind::Lifecycle, Outcome::Rejected)
                == 1)
            .then_some(())
    })
    .await?;

    // Then the answer, taken before those steps, arrives: two chunks and garbage.
    let entry = |id: &str, worker: u64| SnapshotEntry {
        request_id: id.into(),
        booked: BookedSequence {
            worker_id: WorkerId(worker),
            dp_rank: DpRank(0),
            block_hashes: vec![LocalBlockHash(11), LocalBlockHash(12)],
            request_blocks: 3,
            prefill_tokens: 12,
            expected_prefill_ms: None,
            session_id: None,
        },
        prefill_done: false,
    };
    let chunks = [
        SnapshotReply {
            router_id: peer,
            chunk: 0,
            last: false,
            requests: vec![entry("gone-peer", 1), entry("kept", 2)],
            accepts_packed: false,
        },
        SnapshotReply {
            router_id: peer,
            chunk: 1,
            last: true,
            requests: vec![entry("gone-frontend", 3), entry("early", 4)],
            accepts_packed: false,
        },
    ];
    cluster
        .nats
        .publish(inbox.clone(), encode(&chunks[0])?.into())
        .await?;
    cluster
        .nats
        .publish(inbox.clone(), vec![0xc1, 0x00].into())
        .await?;
    cluster
        .nats
        .publish(inbox, encode(&chunks[1])?.into())
        .await?;
    cluster.nats.flush().await?;

    let daemon = start.await??;
    let booked: BTreeMap<String, (Origin, bool)> = state
        .scheduler()
        .sequences()
        .iter()
        .map(|(id, r)| (id.0.clone(), (r.origin, r.prefill_done)))
        .collect();
    assert_eq!(
        booked,
        BTreeMap::from([
            ("early".to_owned(), (Origin::Peer(peer), true)),
            ("kept".to_owned(), (Origin::Peer(peer), false)),
        ])
    );
    let m = state.admission.replicas.metrics();
    assert_eq!(m.get("snapshot_in", "applied"), 2);
    assert_eq!(m.get("snapshot_in", "freed"), 2);
    assert_eq!(m.get("snapshot_in", "malformed"), 1);
    // The peer answered without `accepts_packed` (a version before packed bookings):
    // this replica will write its bookings' hashes as arrays.
    assert_eq!((m.peers.get(), m.peers_array_only.get()), (1, 1));
    assert_eq!(
        state
            .counters
            .messages(MessageKind::SequenceSnapshot, Outcome::Malformed),
        1
    );

    // Now ready, the replica answers snapshot requests itself: nothing of its own.
    let ask = SnapshotRequest {
        router_id: RouterId(8),
        accepts_packed: true,
    };
    let answer = cluster
        .nats
        .request(cluster.subjects.sequences_snapshot(), encode(&ask)?.into())
        .await?;
    let answer: SnapshotReply = decode(&answer.payload)?;
    assert_eq!(
        (
            answer.router_id,
            answer.chunk,
            answer.last,
            answer.requests.len()
        ),
        (RouterId(101), 0, true, 0)
    );
    // Garbage on the request subject is counted and skipped.
    cluster
        .nats
        .publish(cluster.subjects.sequences_snapshot(), vec![0xc1].into())
        .await?;
    eventually(
        "a malformed snapshot request to be counted",
        WAIT,
        || async {
            (state
                .counters
                .messages(MessageKind::SequenceSnapshot, Outcome::Malformed)
                == 2)
                .then_some(())
        },
    )
    .await?;
    daemon.shutdown().await?;
    Ok(())
}
