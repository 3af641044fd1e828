//! End to end through real NATS and etcd: the router's `{ns}.router.overlap` service,
//! and the gateway's parity monitor asking it on an under-claim (`in_flight` when the
//! index holds the served prefix by the time the answer is judged: its KV events
//! arrived after the decision; `under_claim` when it holds less, or nothing because
//! the engine never publishes, which flags the worker).

use integration_tests::{FakeWorker, continued, eventually, wait_for_overlap};
use kv_events::routing::overlap::{MAX_OVERLAP_HASHES, OverlapQuery, OverlapReply};
use kv_events::routing::{RouteDecision, RouteErrorCode};
use kv_events::{DpRank, WorkerId, decode, encode};
use kv_gateway::parity::{Cause, FLAG_AT, ParityMonitor, Reported};
use parity_asking::{monitor, one_worker, one_worker_with, outcome, routed};
use std::time::Duration;

mod parity_asking;

const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);

fn prompt(blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| 7_000 + i).collect()
}

/// Judges an answer to `decision` on `tokens` whose engine served all 4 blocks.
fn judge_full_hit(parity: &ParityMonitor, decision: &RouteDecision, tokens: &[u32]) {
    let served = Reported {
        cached_tokens: Some(u64::from(4 * BLOCK)),
        prompt_tokens: Some(tokens.len() as u64),
    };
    let pending = parity.pending(WorkerId(1), decision.overlap_blocks, 0, tokens.len());
    (pending.expect("worker 1 is registered"))
        .with_race(decision, &tokens.into())
        .judge(served);
}

/// Routed before worker 1's stores reached the index (0 blocks predicted), the engine
/// serves 4: while the index holds 2 of them the answer stays an under-claim; once it
/// holds all 4 (the late store), the same answer is counted `in_flight`.
#[tokio::test]
async fn a_store_indexed_after_the_decision_is_counted_in_flight() -> anyhow::Result<()> {
    let (cluster, mut worker, daemon, rank) = one_worker(BLOCK).await?;
    let tokens = continued(&prompt(4));
    let hashes = FakeWorker::hashes(&tokens, BLOCK);
    let (parity, registry) = monitor(&cluster, &cluster.subjects, BLOCK)?;
    let decision = routed(cluster.route_tokens("r1", tokens.clone()).await?);
    assert_eq!(decision.overlap_blocks, 0);

    worker.store_prompt(&cluster, &prompt(2)).await?;
    wait_for_overlap(&daemon, &hashes, rank, 2).await?;
    judge_full_hit(&parity, &decision, &tokens);
    eventually("an under-claim", WAIT, || async {
        (outcome(&registry, "under_claim") == 1.0).then_some(())
    })
    .await?;

    worker.store_prompt(&cluster, &prompt(4)).await?;
    wait_for_overlap(&daemon, &hashes, rank, 4).await?;
    judge_full_hit(&parity, &decision, &tokens);
    eventually("an answer in flight", WAIT, || async {
        (outcome(&registry, "in_flight") == 1.0).then_some(())
    })
    .await?;
    assert_eq!(outcome(&registry, "under_claim"), 1.0);
    assert_eq!(parity.flagged(WorkerId(1)), None);
    Ok(())
}

/// An engine that serves hits but never publishes its stores: every under-claim stays
/// one, and the worker is flagged at the [`FLAG_AT`]th.
#[tokio::test]
async fn an_engine_that_never_publishes_stays_under_claimed_and_is_flagged() -> anyhow::Result<()> {
    let (cluster, _worker, _daemon, _) = one_worker(BLOCK).await?;
    let tokens = continued(&prompt(4));
    let (parity, registry) = monitor(&cluster, &cluster.subjects, BLOCK)?;
    for i in 0..FLAG_AT {
        let decision = routed(
            cluster
                .route_tokens(&format!("r{i}"), tokens.clone())
                .await?,
        );
        assert_eq!(decision.overlap_blocks, 0);
        judge_full_hit(&parity, &decision, &tokens);
    }
    eventually("every under-claim counted", WAIT, || async {
        (outcome(&registry, "under_claim") == FLAG_AT as f64).then_some(())
    })
    .await?;
    assert_eq!(outcome(&registry, "in_flight"), 0.0);
    assert_eq!(parity.flagged(WorkerId(1)), Some(Cause::NoMatchingEvents));
    Ok(())
}

/// Asks the cluster's router how much of `block_hashes` worker 1's rank 0 holds.
async fn ask(
    cluster: &integration_tests::TestCluster,
    block_hashes: Vec<kv_events::LocalBlockHash>,
) -> anyhow::Result<OverlapReply> {
    let query = OverlapQuery {
        worker_id: WorkerId(1),
        dp_rank: DpRank(0),
        block_hashes,
    };
    let subject = cluster.subjects.router_overlap();
    let reply = cluster
        .nats
        .request(subject, encode(&query)?.into())
        .await?;
    Ok(decode::<OverlapReply>(&reply.payload)?)
}

/// An approximate-mode router indexes the prompts it routed, the judged request's
/// included: it holds the prefix the engine served, says it is approximate, and the
/// under-claim stays one.
#[tokio::test]
async fn an_approximate_router_confirms_nothing() -> anyhow::Result<()> {
    let (cluster, _worker, _daemon, _) = one_worker_with(BLOCK, |args| {
        args.index.index_mode = router_daemon::config::index::IndexModeArg::Approximate;
    })
    .await?;
    let tokens = continued(&prompt(4));
    let hashes = FakeWorker::hashes(&tokens, BLOCK);
    let (parity, registry) = monitor(&cluster, &cluster.subjects, BLOCK)?;
    let decision = routed(cluster.route_tokens("r1", tokens.clone()).await?);
    assert_eq!(decision.overlap_blocks, 0);
    eventually("the routed prompt indexed", WAIT, || async {
        match ask(&cluster, hashes.clone()).await.ok()? {
            OverlapReply::Answered(a) => (a.overlap_blocks == 4 && a.approximate).then_some(()),
            OverlapReply::Error(_) => None,
        }
    })
    .await?;
    judge_full_hit(&parity, &decision, &tokens);
    eventually("an under-claim", WAIT, || async {
        (outcome(&registry, "under_claim") == 1.0).then_some(())
    })
    .await?;
    assert_eq!(outcome(&registry, "in_flight"), 0.0);
    Ok(())
}

/// The service answers the prefix a rank holds, and refuses a query over
/// [`MAX_OVERLAP_HASHES`] (`bad_request`).
#[tokio::test]
async fn the_service_answers_a_prefix_and_refuses_an_over_long_query() -> anyhow::Result<()> {
    let (cluster, mut worker, daemon, rank) = one_worker(BLOCK).await?;
    let hashes = FakeWorker::hashes(&prompt(4), BLOCK);
    worker.store_prompt(&cluster, &prompt(3)).await?;
    wait_for_overlap(&daemon, &hashes, rank, 3).await?;
    let OverlapReply::Answered(answer) = ask(&cluster, hashes.clone()).await? else {
        panic!("a valid query was refused");
    };
    assert_eq!(answer.overlap_blocks, 3);
    assert!(!answer.approximate);
    assert!(answer.kv_position.is_some());
    let long = vec![hashes[0]; MAX_OVERLAP_HASHES + 1];
    let OverlapReply::Error(refused) = ask(&cluster, long).await? else {
        panic!("an over-long query was answered");
    };
    assert_eq!(refused.code, RouteErrorCode::BadRequest);
    Ok(())
}
