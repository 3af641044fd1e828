//! Issue 25, finding 7: one door for KV events. The `--jetstream` intake used to apply
//! every batch from the stream itself, so a worker no etcd key names, or a batch of a
//! newer epoch than its worker registered, went straight into the index — the rules
//! every other intake enforces (`router-daemon/src/publishers.rs`) did not hold. Now
//! both intakes pass each batch through the same decode → hold → apply path; these
//! tests run the same scenario through each and expect the same outcome. Real
//! nats-server with JetStream and etcd; the daemon in-process.

use indexer::IndexerApi as _;
use integration_tests::{TestCluster, eventually, register_worker};
use kv_events::discovery::WorkerRegistration;
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash,
    StoredBlock, WorkerId, WorkerRank, encode,
};
use router_daemon::JetStreamPath;
use router_daemon::counters::{MessageKind, Outcome};
use router_daemon::{Daemon, DaemonConfig, ServeArgs};
use std::time::Duration;

const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);

/// Which intake the daemon uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Intake {
    Core,
    JetStream,
}

/// The daemon's flags for `intake`, holding batches for `hold_ms`.
fn args(cluster: &TestCluster, intake: Intake, hold_ms: u64) -> ServeArgs {
    let mut args = cluster.serve_args();
    args.index.jetstream = intake == Intake::JetStream;
    args.index.event_hold_ms = hold_ms;
    args
}

async fn start(args: &ServeArgs) -> anyhow::Result<Daemon> {
    Daemon::start(DaemonConfig::from_args(args)?, &prometheus::Registry::new()).await
}

/// Registers worker `id` at `epoch` (dp_size 1) under a fresh 30 s lease.
async fn register(cluster: &mut TestCluster, id: u64, epoch: u64) -> anyhow::Result<()> {
    let registration = WorkerRegistration {
        worker_id: WorkerId(id),
        dp_size: 1,
        block_size: BLOCK,
        total_kv_blocks: 1024,
        url: None,
        epoch,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    };
    register_worker(&mut cluster.etcd, &cluster.subjects, &registration, 30).await?;
    Ok(())
}

/// Publishes one `Stored` event of the single block `hash` on worker `id`'s subject,
/// with core NATS, as every publisher does (the stream captures it).
async fn store(
    cluster: &TestCluster,
    id: u64,
    epoch: u64,
    event_id: u64,
    hash: u64,
) -> anyhow::Result<()> {
    let batch = KvEventBatch {
        worker_id: WorkerId(id),
        epoch,
        events: vec![KvCacheEvent {
            event_id,
            dp_rank: DpRank(0),
            data: KvCacheEventData::Stored {
                group: None,
                parent_hash: None,
                blocks: vec![StoredBlock {
                    block_hash: ExternalBlockHash(hash),
                    tokens_hash: LocalBlockHash(hash),
                }],
                tier: kv_events::StorageTier::Gpu,
            },
        }],
    };
    let subject = cluster.subjects.kv_events(batch.worker_id);
    cluster
        .nats
        .publish(subject, encode(&batch)?.into())
        .await?;
    cluster.nats.flush().await?;
    Ok(())
}

/// Whether `daemon`'s index holds block `hash` on worker `id`'s rank 0.
async fn indexed(daemon: &Daemon, id: u64, hash: u64) -> bool {
    let rank = WorkerRank::new(WorkerId(id), DpRank(0));
    match daemon
        .state()
        .indexer
        .find_matches(vec![LocalBlockHash(hash)])
        .await
    {
        Ok(scores) => scores.get(rank) >= 1,
        Err(_) => false,
    }
}

async fn wait_indexed(daemon: &Daemon, id: u64, hash: u64) -> anyhow::Result<()> {
    eventually(&format!("block {hash} of worker {id}"), WAIT, || async {
        indexed(daemon, id, hash).await.then_some(())
    })
    .await
}

/// Worker 1 registered at epoch 1; worker 9 never registered. A batch of worker 9 and
/// one of worker 1 at epoch 2 are held — not indexed while a later batch is — then
/// worker 9's is dropped after the grace and worker 1's is applied once its
/// registration moves to epoch 2. Normal batches apply throughout.
async fn holds_as_the_core_intake_does(intake: Intake) -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    register(&mut cluster, 1, 1).await?;
    let daemon = start(&args(&cluster, intake, 3_000)).await?;
    store(&cluster, 1, 1, 0, 11).await?;
    wait_indexed(&daemon, 1, 11).await?;

    store(&cluster, 9, 0, 0, 99).await?;
    store(&cluster, 1, 2, 0, 22).await?;
    // Taken after the two above (one subject order per intake): once it is indexed,
    // they have been taken too.
    store(&cluster, 1, 1, 1, 12).await?;
    wait_indexed(&daemon, 1, 12).await?;
    assert!(
        !indexed(&daemon, 9, 99).await,
        "{intake:?}: a worker no registration names was indexed"
    );
    assert!(
        !indexed(&daemon, 1, 22).await,
        "{intake:?}: an epoch newer than registered was applied"
    );

    register(&mut cluster, 1, 2).await?;
    wait_indexed(&daemon, 1, 22).await?;
    let counters = &daemon.state().counters;
    eventually("worker 9's batch to be dropped", WAIT, || async {
        (counters.messages(MessageKind::Events, Outcome::Unregistered) == 1).then_some(())
    })
    .await?;
    assert!(!indexed(&daemon, 9, 99).await, "{intake:?}");
    assert_eq!(
        counters.messages(MessageKind::Events, Outcome::FutureEpoch),
        0,
        "{intake:?}: the epoch-2 batch was applied, not dropped"
    );
    daemon.shutdown().await
}

#[tokio::test]
async fn the_core_intake_holds_unregistered_workers_and_newer_epochs() -> anyhow::Result<()> {
    holds_as_the_core_intake_does(Intake::Core).await
}

#[tokio::test]
async fn the_jetstream_intake_holds_unregistered_workers_and_newer_epochs_as_the_core_one_does()
-> anyhow::Result<()> {
    holds_as_the_core_intake_does(Intake::JetStream).await
}

/// A batch still held when the daemon stops is not claimed by its snapshot: the
/// snapshot covers the stream only up to just before it, and the next daemon replays
/// it, now that its worker is registered, instead of losing it.
#[tokio::test]
async fn a_batch_held_at_shutdown_is_replayed_by_the_next_daemon() -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(BLOCK).await?;
    register(&mut cluster, 1, 0).await?;
    let args = args(&cluster, Intake::JetStream, 30_000);
    let first = start(&args).await?;
    store(&cluster, 1, 0, 0, 11).await?; // stream sequence 1
    store(&cluster, 2, 0, 0, 21).await?; // 2: worker 2 is not registered yet
    store(&cluster, 1, 0, 1, 12).await?; // 3
    wait_indexed(&first, 1, 12).await?;
    assert!(!indexed(&first, 2, 21).await, "worker 2 is not registered");
    first.shutdown().await?;

    let config = DaemonConfig::from_args(&args)?;
    let js = config
        .durability
        .jetstream
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("--jetstream is on"))?;
    let path = JetStreamPath::open(&cluster.nats, &cluster.subjects, js).await?;
    let (stored, _) = path
        .load_snapshot()
        .await?
        .ok_or_else(|| anyhow::anyhow!("the daemon stored a snapshot at shutdown"))?;
    assert_eq!(
        stored.stream_sequence, 1,
        "the snapshot claims only what precedes the held batch"
    );

    register(&mut cluster, 2, 0).await?;
    let second = start(&args).await?;
    // Ready means caught up with the stream: the held batch was replayed and applied.
    assert!(indexed(&second, 2, 21).await, "the held batch was lost");
    assert!(indexed(&second, 1, 11).await && indexed(&second, 1, 12).await);
    second.shutdown().await
}
