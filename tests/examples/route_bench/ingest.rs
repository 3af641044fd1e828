//! A KV event flood for the daemon to ingest while routes are measured: each
//! worker in turn publishes a `Stored` batch of fresh blocks, then a `Removed`
//! batch of the same blocks, so the index keeps its size while the daemon applies
//! `blocks_per_s` blocks per second (the `Stored` and the `Removed` blocks both
//! count). It paces itself against the clock, catching up after a slow tick.

use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash,
    StoredBlock, Subjects, WorkerId, encode,
};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Blocks per `Stored` (and per `Removed`) batch.
const BLOCKS_PER_BATCH: u64 = 16;
/// How often the publisher checks its pace.
const TICK: Duration = Duration::from_millis(5);

/// What the flood published.
pub struct Flooded {
    /// Blocks in published events (stored and removed).
    pub blocks: u64,
    /// How long it ran.
    pub elapsed: Duration,
    /// Each worker's next event id, for the next flood.
    pub next_event: Vec<u64>,
}

/// Publishes the flood until `stop`. `next_event` holds each worker's next event
/// id; the advanced ids come back in [`Flooded`], so a later flood continues the
/// sequences.
///
/// # Errors
/// When a publish fails.
pub async fn flood(
    nats: async_nats::Client,
    subjects: Subjects,
    mut next_event: Vec<u64>,
    blocks_per_s: u64,
    stop: CancellationToken,
) -> anyhow::Result<Flooded> {
    let started = Instant::now();
    let workers = next_event.len() as u64;
    let mut published: u64 = 0;
    let mut n: u64 = 0;
    let mut tick = tokio::time::interval(TICK);
    while !stop.is_cancelled() {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let due = (started.elapsed().as_secs_f64() * blocks_per_s as f64) as u64;
        while published < due {
            let w = n % workers;
            n += 1;
            let hashes: Vec<ExternalBlockHash> = (0..BLOCKS_PER_BATCH)
                .map(|i| ExternalBlockHash((1 << 63) | (n << 8) | i))
                .collect();
            let blocks = hashes
                .iter()
                .map(|h| StoredBlock {
                    block_hash: *h,
                    tokens_hash: LocalBlockHash(h.0.rotate_left(17)),
                })
                .collect();
            let stored = KvCacheEventData::Stored {
                group: None,
                parent_hash: None,
                blocks,
                tier: kv_events::StorageTier::Gpu,
            };
            let removed = KvCacheEventData::Removed {
                group: None,
                block_hashes: hashes,
                tier: kv_events::StorageTier::Gpu,
            };
            for data in [stored, removed] {
                publish_event(&nats, &subjects, &mut next_event, WorkerId(w), data).await?;
            }
            published += 2 * BLOCKS_PER_BATCH;
        }
    }
    nats.flush().await?;
    Ok(Flooded {
        blocks: published,
        elapsed: started.elapsed(),
        next_event,
    })
}

/// Publishes one event of `worker` (rank 0) as a batch on its subject, with the
/// worker's next event id from `next_event`, which it advances.
///
/// # Errors
/// When encoding or the publish fails.
pub async fn publish_event(
    nats: &async_nats::Client,
    subjects: &Subjects,
    next_event: &mut [u64],
    worker: WorkerId,
    data: KvCacheEventData,
) -> anyhow::Result<()> {
    let id = &mut next_event[worker.0 as usize];
    let batch = KvEventBatch::new(
        worker,
        vec![KvCacheEvent {
            event_id: *id,
            dp_rank: DpRank(0),
            data,
        }],
    );
    *id += 1;
    nats.publish(subjects.kv_events(worker), encode(&batch)?.into())
        .await?;
    Ok(())
}
