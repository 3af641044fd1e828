//! A test publisher with a real `EventJournal`, and helpers to compare what a
//! router holds with what a publisher holds.

#![allow(dead_code)] // each test binary uses a different subset

use futures::StreamExt;
use indexer::IndexerApi as _;
use integration_tests::TestCluster;
use kv_events::discovery::WorkerRegistration;
use kv_events::journal::{EventJournal, JournalConfig, unix_epoch_micros};
use kv_events::recovery::{RecoveryBody, RecoveryReply, RecoveryRequest};
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash,
    StoredBlock, Subjects, WorkerId, hash_block,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How the worker answers recovery requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Responder {
    /// From its journal.
    Journal,
    /// With bytes that are not a reply.
    Garbage,
    /// Not at all (nobody subscribed to its recovery subject).
    Silent,
    /// With an empty range at the requested position, whatever was asked: a reply
    /// that never closes a gap.
    Stuck,
}

/// What the worker answered.
#[derive(Debug, Default)]
struct Served {
    requests: AtomicU64,
    ranges: AtomicU64,
    dumps: AtomicU64,
    bytes: AtomicU64,
}

/// A registered worker publishing through its own journal.
pub struct JournalWorker {
    id: WorkerId,
    journal: Arc<Mutex<EventJournal>>,
    nats: async_nats::Client,
    subjects: Subjects,
    served: Arc<Served>,
    responder: Option<JoinHandle<()>>,
}

impl Drop for JournalWorker {
    fn drop(&mut self) {
        if let Some(task) = &self.responder {
            task.abort();
        }
    }
}

impl JournalWorker {
    async fn start_with(
        cluster: &mut TestCluster,
        id: u64,
        dp_size: u32,
        config: JournalConfig,
        responder: Responder,
    ) -> anyhow::Result<Self> {
        let epoch = unix_epoch_micros();
        register(cluster, WorkerId(id), dp_size, epoch).await?;
        let journal = Arc::new(Mutex::new(EventJournal::new(WorkerId(id), epoch, config)));
        let nats = async_nats::connect(cluster.nats_server.url()).await?;
        let served = Arc::new(Served::default());
        let mut responder_task = None;
        if responder != Responder::Silent {
            let mut requests = nats
                .subscribe(cluster.subjects.kv_recovery(WorkerId(id)))
                .await?;
            kv_cluster::barrier::server_barrier(&nats).await?;
            let (nats, journal, served) = (nats.clone(), journal.clone(), served.clone());
            responder_task = Some(tokio::spawn(async move {
                while let Some(msg) = requests.next().await {
                    served.requests.fetch_add(1, Ordering::Relaxed);
                    let Some(reply) = msg.reply else { continue };
                    let payloads: Vec<Vec<u8>> = match responder {
                        Responder::Garbage => vec![vec![0xc1, 0x00, 0xff]],
                        Responder::Stuck => {
                            let Ok(request) = kv_events::decode::<RecoveryRequest>(&msg.payload)
                            else {
                                continue;
                            };
                            let reply = RecoveryReply {
                                worker_id: WorkerId(id),
                                dp_rank: request.dp_rank,
                                epoch: request.epoch,
                                next_event_id: request.start_event_id,
                                body: RecoveryBody::Events { events: Vec::new() },
                            };
                            served.ranges.fetch_add(1, Ordering::Relaxed);
                            reply
                                .into_chunks(8)
                                .iter()
                                .map(|c| kv_events::encode(c).expect("chunks encode"))
                                .collect()
                        }
                        _ => {
                            let chunks = journal.lock().expect("journal lock").answer(&msg.payload);
                            if let Some(first) = chunks.first() {
                                let counter = match first.body {
                                    RecoveryBody::Dump { .. } => &served.dumps,
                                    _ => &served.ranges,
                                };
                                counter.fetch_add(1, Ordering::Relaxed);
                            }
                            chunks
                                .iter()
                                .map(|c| kv_events::encode(c).expect("chunks encode"))
                                .collect()
                        }
                    };
                    for payload in payloads {
                        served
                            .bytes
                            .fetch_add(payload.len() as u64, Ordering::Relaxed);
                        if nats.publish(reply.clone(), payload.into()).await.is_err() {
                            return;
                        }
                    }
                }
            }));
        }
        Ok(Self {
            id: WorkerId(id),
            journal,
            nats,
            subjects: cluster.subjects.clone(),
            served,
            responder: responder_task,
        })
    }

    /// A worker with `dp_size` ranks whose journal keeps `ring` events per rank and
    /// answers recovery requests in chunks of at most 8 blocks (so replies span
    /// several messages).
    pub async fn start(
        cluster: &mut TestCluster,
        id: u64,
        dp_size: u32,
        ring: usize,
    ) -> anyhow::Result<Self> {
        let config = JournalConfig {
            ring_capacity: ring,
            max_chunk_blocks: 8,
        };
        Self::start_with(cluster, id, dp_size, config, Responder::Journal).await
    }

    /// A worker with one rank and a default journal (4096-event ring, 4096-block
    /// chunks), for bulk loads.
    pub async fn start_bulk(cluster: &mut TestCluster, id: u64) -> anyhow::Result<Self> {
        Self::start_with(cluster, id, 1, JournalConfig::default(), Responder::Journal).await
    }

    /// A worker that answers recovery requests with garbage.
    pub async fn start_garbage(cluster: &mut TestCluster, id: u64) -> anyhow::Result<Self> {
        Self::start_with(cluster, id, 1, JournalConfig::default(), Responder::Garbage).await
    }

    /// A worker that answers every recovery request with an empty range at the
    /// requested position, so a gap is never closed.
    pub async fn start_stuck(cluster: &mut TestCluster, id: u64) -> anyhow::Result<Self> {
        Self::start_with(cluster, id, 1, JournalConfig::default(), Responder::Stuck).await
    }

    /// A worker that does not serve recovery at all.
    pub async fn start_silent(cluster: &mut TestCluster, id: u64) -> anyhow::Result<Self> {
        Self::start_with(cluster, id, 1, JournalConfig::default(), Responder::Silent).await
    }

    pub fn id(&self) -> WorkerId {
        self.id
    }

    /// Recovery requests received.
    pub fn recovery_requests(&self) -> u64 {
        self.served.requests.load(Ordering::Relaxed)
    }

    /// Recovery requests answered with a range of events.
    pub fn ranges_served(&self) -> u64 {
        self.served.ranges.load(Ordering::Relaxed)
    }

    /// Recovery requests answered with a dump.
    pub fn dumps_served(&self) -> u64 {
        self.served.dumps.load(Ordering::Relaxed)
    }

    /// Reply bytes published in answer to recovery requests.
    pub fn bytes_served(&self) -> u64 {
        self.served.bytes.load(Ordering::Relaxed)
    }

    /// Records `data` and publishes it without flushing (for bulk loads).
    pub async fn record_and_send(&self, dp: DpRank, data: KvCacheEventData) -> anyhow::Result<()> {
        let batch = self.record(dp, data);
        self.nats
            .publish(
                self.subjects.kv_events(batch.worker_id),
                kv_events::encode(&batch)?.into(),
            )
            .await?;
        Ok(())
    }

    /// Waits until everything sent on this worker's connection reached the server.
    pub async fn flush(&self) -> anyhow::Result<()> {
        self.nats.flush().await?;
        Ok(())
    }

    /// Records an event without publishing it (lost in transit).
    pub fn record(&self, dp: DpRank, data: KvCacheEventData) -> KvEventBatch {
        self.journal
            .lock()
            .expect("journal lock")
            .record_batch(dp, [data])
    }

    /// Records and publishes an event.
    pub async fn record_and_publish(
        &self,
        dp: DpRank,
        data: KvCacheEventData,
    ) -> anyhow::Result<()> {
        let batch = self.record(dp, data);
        publish(&self.nats, &self.subjects, &batch).await
    }

    /// The journal's dump of `dp`.
    pub fn dump(&self, dp: DpRank) -> RecoveryReply {
        self.journal.lock().expect("journal lock").dump(dp)
    }

    /// Publishes chain `i` (and every 3rd time, removes an older one) every
    /// `period` until stopped: a steady event flow.
    pub fn flow(&self, dp: DpRank, period: Duration) -> EventFlow {
        let (stop, mut stopped) = oneshot::channel::<()>();
        let (journal, nats, subjects, id) = (
            self.journal.clone(),
            self.nats.clone(),
            self.subjects.clone(),
            self.id,
        );
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            let mut published = 0u64;
            for i in 1000u64.. {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tick.tick() => {}
                }
                let data = if i % 3 == 0 {
                    KvCacheEventData::Removed {
                        group: None,
                        block_hashes: vec![engine_hash(id, i - 2, 1)],
                        tier: kv_events::StorageTier::Gpu,
                    }
                } else {
                    chain_from_root(id, i, 2)
                };
                let batch = journal
                    .lock()
                    .expect("journal lock")
                    .record_batch(dp, [data]);
                if publish(&nats, &subjects, &batch).await.is_err() {
                    break;
                }
                published += 1;
            }
            published
        });
        EventFlow { stop, task }
    }
}

/// Registers `id` with `dp_size` ranks and its event `epoch` in etcd under a fresh
/// 30 s lease.
async fn register(
    cluster: &mut TestCluster,
    id: WorkerId,
    dp_size: u32,
    epoch: u64,
) -> anyhow::Result<()> {
    let reg = WorkerRegistration {
        worker_id: id,
        dp_size,
        block_size: cluster.block_size,
        total_kv_blocks: 1024,
        url: None,
        epoch,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    };
    integration_tests::register_worker(&mut cluster.etcd, &cluster.subjects, &reg, 30).await?;
    Ok(())
}

async fn publish(
    nats: &async_nats::Client,
    subjects: &Subjects,
    batch: &KvEventBatch,
) -> anyhow::Result<()> {
    nats.publish(
        subjects.kv_events(batch.worker_id),
        kv_events::encode(batch)?.into(),
    )
    .await?;
    nats.flush().await?;
    Ok(())
}

/// A running event flow.
pub struct EventFlow {
    stop: oneshot::Sender<()>,
    task: JoinHandle<u64>,
}

impl EventFlow {
    /// Stops the flow; returns the batches it published.
    pub async fn stop(self) -> u64 {
        let _ = self.stop.send(());
        self.task.await.unwrap_or(0)
    }
}

/// The tokens of chain `i` of worker `w`: `len` full blocks of `block_size` tokens.
pub fn chain_tokens(w: WorkerId, i: u64, len: u64, block_size: u32) -> Vec<u32> {
    (0..len * u64::from(block_size))
        .map(|t| (w.0 * 1_000_000 + i * 1000 + t) as u32)
        .collect()
}

/// The engine hash of block `b` of chain `i` of worker `w`.
pub fn engine_hash(w: WorkerId, i: u64, b: u64) -> ExternalBlockHash {
    ExternalBlockHash(w.0 << 40 | i << 8 | b)
}

/// A `Stored` event of chain `i` of worker `w` from the root: `len` blocks whose
/// local hashes are those of [`chain_tokens`] at 4 tokens per block.
pub fn chain_from_root(w: WorkerId, i: u64, len: u64) -> KvCacheEventData {
    let tokens = chain_tokens(w, i, len, 4);
    let blocks = tokens
        .chunks_exact(4)
        .enumerate()
        .map(|(b, t)| StoredBlock {
            block_hash: engine_hash(w, i, b as u64),
            tokens_hash: hash_block(t),
        })
        .collect();
    KvCacheEventData::Stored {
        group: None,
        parent_hash: None,
        blocks,
        tier: kv_events::StorageTier::Gpu,
    }
}

/// Held blocks of one rank: engine hash → the local hashes of the prefix it ends.
pub type Paths = BTreeMap<ExternalBlockHash, Vec<LocalBlockHash>>;

/// Replays `Stored` / `Removed` event data into [`Paths`].
fn paths_of<'a>(events: impl IntoIterator<Item = &'a KvCacheEventData>) -> Paths {
    let mut known: HashMap<ExternalBlockHash, Vec<LocalBlockHash>> = HashMap::new();
    let mut held = Paths::new();
    for data in events {
        match data {
            KvCacheEventData::Stored {
                parent_hash,
                blocks,
                ..
            } => {
                let mut path = parent_hash
                    .and_then(|p| known.get(&p).cloned())
                    .unwrap_or_default();
                for b in blocks {
                    path.push(b.tokens_hash);
                    known.insert(b.block_hash, path.clone());
                    held.insert(b.block_hash, path.clone());
                }
            }
            KvCacheEventData::Removed { block_hashes, .. } => {
                for h in block_hashes {
                    held.remove(h);
                }
            }
            KvCacheEventData::Cleared => held.clear(),
        }
    }
    held
}

/// What a publisher holds, from its dump.
pub fn held_paths(dump: &RecoveryReply) -> Paths {
    let RecoveryBody::Dump {
        unheld_in_groups: _,
        chains,
        unheld,
    } = &dump.body
    else {
        panic!("not a dump: {dump:?}")
    };
    let mut events: Vec<KvCacheEventData> = chains
        .iter()
        .cloned()
        .map(|c| c.into_event_data())
        .collect();
    events.push(KvCacheEventData::Removed {
        group: None,
        block_hashes: unheld.clone(),
        tier: kv_events::StorageTier::Gpu,
    });
    paths_of(&events)
}

/// What the router holds for rank 0 of `worker`, from its index dump.
pub async fn router_paths(daemon: &router_daemon::Daemon, worker: WorkerId) -> Paths {
    router_paths_of(daemon, worker, DpRank(0)).await
}

/// What the router holds for one rank of `worker`, from its index dump.
pub async fn router_paths_of(
    daemon: &router_daemon::Daemon,
    worker: WorkerId,
    dp: DpRank,
) -> Paths {
    let dump = daemon.state().indexer.dump().await.unwrap_or_default();
    let events: Vec<KvCacheEvent> = dump
        .into_iter()
        .filter(|b| b.worker_id == worker)
        .flat_map(|b| b.events)
        .filter(|e| e.dp_rank == dp)
        .collect();
    paths_of(events.iter().map(|e| &e.data))
}
