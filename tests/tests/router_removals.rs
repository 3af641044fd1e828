//! End to end through real NATS and etcd: the route reply's `kv_position`, the
//! router's `{ns}.router.removals` service, and the gateway's parity monitor asking
//! it on an over-claim (`evicted` for an eviction that raced the route, `over_claim`
//! for a block missing without a `Removed` event, or when no router answers).

use integration_tests::{FakeWorker, TestCluster, continued, eventually, wait_for_overlap};
use kv_events::routing::{
    EventPosition, MAX_REMOVAL_HASHES, RemovalsAnswer, RemovalsQuery, RemovalsReply, RouteDecision,
    RouteErrorCode,
};
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEventData, LocalBlockHash, Namespace, StorageTier, Subjects,
    WorkerId, WorkerRank, decode, encode,
};
use kv_gateway::parity::Reported;
use parity_asking::{monitor, one_worker, outcome, routed};
use std::time::Duration;

mod parity_asking;

const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);

fn prompt(blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| 5_000 + i).collect()
}

/// Publishes the removal of blocks `blocks` of a prompt of `hashes` that `worker`
/// stored with [`FakeWorker::store_prompt`] (which names block `i` by
/// `hash ^ (worker << 32) ^ i`).
async fn evict(
    worker: &mut FakeWorker,
    cluster: &TestCluster,
    hashes: &[LocalBlockHash],
    blocks: std::ops::Range<usize>,
) -> anyhow::Result<()> {
    let id = worker.id.0;
    let gone = blocks.map(|i| ExternalBlockHash(hashes[i].0 ^ (id << 32) ^ i as u64));
    let removed = KvCacheEventData::Removed {
        block_hashes: gone.collect(),
        tier: StorageTier::Gpu,
        group: None,
    };
    worker.publish(cluster, removed).await
}

async fn ask(cluster: &TestCluster, query: &RemovalsQuery) -> anyhow::Result<RemovalsReply> {
    let reply = (cluster.nats)
        .request(cluster.subjects.router_removals(), encode(query)?.into())
        .await?;
    Ok(decode(&reply.payload)?)
}

/// Waits until the router's answer to `query` is `want`.
async fn answered(
    cluster: &TestCluster,
    query: &RemovalsQuery,
    want: RemovalsAnswer,
) -> anyhow::Result<()> {
    eventually(&format!("the answer {want:?}"), WAIT, || async {
        let reply = ask(cluster, query).await.ok()?;
        (reply == RemovalsReply::Answered(want.clone())).then_some(())
    })
    .await
}

/// Worker 1 stores a 4-block prompt; a route names position (0, 0). Blocks 2 and 3
/// are then removed and stored again (the request that found them missing): the
/// router names them. After a store without any `Removed` (an engine that loses its
/// removals) it names nothing. An over-long query is refused.
#[tokio::test]
async fn evictions_after_the_route_are_named_and_silent_ones_are_not() -> anyhow::Result<()> {
    let (cluster, mut worker, daemon, rank) = one_worker(BLOCK).await?;
    let tokens = prompt(4);
    let hashes = FakeWorker::hashes(&tokens, BLOCK);
    worker.store_prompt(&cluster, &tokens).await?;
    wait_for_overlap(&daemon, &hashes, rank, 4).await?;

    let decision = routed(cluster.route_tokens("r1", continued(&tokens)).await?);
    assert_eq!(decision.overlap_blocks, 4);
    let decided = *decision
        .kv_position
        .expect("the route names the rank's position");
    assert_eq!(decided, EventPosition::default());
    let query = RemovalsQuery {
        worker_id: worker.id,
        dp_rank: DpRank(0),
        after: decided,
        block_hashes: hashes[2..].to_vec(),
    };
    let nothing = RemovalsAnswer {
        removed: vec![],
        complete: true,
        cleared: false,
    };
    answered(&cluster, &query, nothing.clone()).await?;

    evict(&mut worker, &cluster, &hashes, 2..4).await?;
    worker.store_prompt(&cluster, &tokens).await?;
    let named = RemovalsAnswer {
        removed: vec![0, 1],
        ..nothing.clone()
    };
    answered(&cluster, &query, named).await?;

    // Missing without a `Removed`: the engine recomputed and stored the blocks again.
    let decision = routed(cluster.route_tokens("r2", continued(&tokens)).await?);
    let decided = *decision.kv_position.expect("a position");
    assert_eq!(decided.event_id, 2);
    worker.store_prompt(&cluster, &tokens).await?;
    let after_silent = RemovalsQuery {
        after: decided,
        ..query.clone()
    };
    wait_for_position(&daemon, &cluster, rank, 3).await?;
    answered(&cluster, &after_silent, nothing).await?;

    let long = RemovalsQuery {
        block_hashes: vec![hashes[0]; MAX_REMOVAL_HASHES + 1],
        ..query
    };
    let RemovalsReply::Error(refused) = ask(&cluster, &long).await? else {
        panic!("an over-long query was answered");
    };
    assert_eq!(refused.code, RouteErrorCode::BadRequest);
    Ok(())
}

/// Waits until a route on `rank` names event `event_id` (the daemon applied it).
async fn wait_for_position(
    daemon: &router_daemon::Daemon,
    cluster: &TestCluster,
    rank: WorkerRank,
    event_id: u64,
) -> anyhow::Result<()> {
    let _ = daemon;
    let mut n = 0;
    eventually(&format!("event {event_id} of {rank} applied"), WAIT, || {
        n += 1;
        let id = format!("probe-{n}");
        async move {
            let reply = cluster.route_tokens(&id, prompt(1)).await.ok()?;
            let seen = routed(reply).kv_position?.event_id;
            cluster
                .lifecycle(&id, kv_events::routing::LifecycleEvent::Freed)
                .await
                .ok()?;
            (seen >= event_id).then_some(())
        }
    })
    .await
}

/// The gateway's monitor: an over-claim whose first unserved block was removed after
/// the route and stored again is `evicted` (and flags nothing); one missing without
/// a `Removed` stays `over_claim`, as does one no router answers for.
#[tokio::test]
async fn the_gateway_counts_a_raced_eviction_apart_from_over_claims() -> anyhow::Result<()> {
    let (cluster, mut worker, daemon, rank) = one_worker(BLOCK).await?;
    let tokens: std::sync::Arc<[u32]> = continued(&prompt(4)).into();
    let hashes = FakeWorker::hashes(&tokens, BLOCK);
    worker.store_prompt(&cluster, &prompt(4)).await?;
    wait_for_overlap(&daemon, &hashes, rank, 4).await?;
    let (parity, registry) = monitor(&cluster, &cluster.subjects, BLOCK)?;
    // The engine served 2 of the 4 predicted blocks.
    let served = Reported {
        cached_tokens: Some(u64::from(2 * BLOCK)),
        prompt_tokens: Some(tokens.len() as u64),
    };
    let judge = |decision: &RouteDecision| {
        let pending = parity.pending(WorkerId(1), decision.overlap_blocks, 0, tokens.len());
        pending
            .expect("worker 1 is registered")
            .with_race(decision, &tokens)
            .judge(served);
    };

    let decision = routed(cluster.route_tokens("r1", tokens.to_vec()).await?);
    assert_eq!(decision.overlap_blocks, 4);
    evict(&mut worker, &cluster, &hashes, 2..4).await?;
    worker.store_prompt(&cluster, &prompt(4)).await?;
    wait_for_position(&daemon, &cluster, rank, 2).await?;
    judge(&decision);
    eventually("an evicted answer", WAIT, || async {
        (outcome(&registry, "evicted") == 1.0).then_some(())
    })
    .await?;
    assert_eq!(outcome(&registry, "over_claim"), 0.0);

    let decision = routed(cluster.route_tokens("r2", tokens.to_vec()).await?);
    worker.store_prompt(&cluster, &prompt(4)).await?;
    wait_for_position(&daemon, &cluster, rank, 3).await?;
    judge(&decision);
    eventually("an over-claim", WAIT, || async {
        (outcome(&registry, "over_claim") == 1.0).then_some(())
    })
    .await?;

    // No router answers on another namespace's subject: counted as an over-claim.
    let elsewhere = Subjects::new(Namespace::new("nobody-here")?);
    let (parity, registry) = monitor(&cluster, &elsewhere, BLOCK)?;
    let pending = parity
        .pending(WorkerId(1), 4, 0, tokens.len())
        .expect("registered");
    pending.with_race(&decision, &tokens).judge(served);
    eventually("an unanswered over-claim", WAIT, || async {
        (outcome(&registry, "over_claim") == 1.0).then_some(())
    })
    .await?;
    assert_eq!(outcome(&registry, "evicted"), 0.0);
    assert_eq!(parity.flagged(WorkerId(1)), None);
    Ok(())
}
