//! Recovery time in process: rebuilding an index of 1M blocks from publisher dumps
//! (encode on the publisher, decode and apply on the router), and from an index
//! snapshot (the JetStream path's payload). The end-to-end numbers with NATS are
//! measured by `tests/tests/recovery_bench.rs`.

use crate::Scale;
use bench_workload::{WorkloadShape, build};
use indexer::{OrderedIndex, ShardSettings};
use kv_events::journal::{EventJournal, JournalConfig};
use kv_events::recovery::{ChunkAssembler, IndexSnapshot, RecoveryChunk, RecoveryRequest};
use kv_events::{DpRank, WorkerId, WorkerRank};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

pub fn run(scale: Scale) {
    let workers = 64;
    let w = build(WorkloadShape::apply(workers, scale.of(1_000_000)), 5);
    let mut journals: BTreeMap<WorkerId, EventJournal> = BTreeMap::new();
    for batch in &w.batches {
        let journal = journals
            .entry(batch.worker_id)
            .or_insert_with(|| EventJournal::new(batch.worker_id, 1, JournalConfig::default()));
        for event in &batch.events {
            journal.record(event.dp_rank, event.data.clone());
        }
    }
    println!(
        "\n## recovery in process ({} blocks, {workers} workers)\n",
        w.blocks
    );
    println!("| path | publisher side ms | router side ms | bytes | bytes/block |");
    println!("|---|---:|---:|---:|---:|");

    // Dumps: each publisher answers a dump request with msgpack chunks.
    let request = kv_events::encode(&RecoveryRequest {
        dp_rank: DpRank(0),
        epoch: 0,
        start_event_id: 0,
        dump: true,
    })
    .expect("encodes");
    let start = Instant::now();
    let wire: Vec<(WorkerId, Vec<Vec<u8>>)> = journals
        .iter()
        .map(|(id, j)| {
            let chunks = j
                .answer(&request)
                .iter()
                .map(|c| kv_events::encode(c).expect("encodes"))
                .collect();
            (*id, chunks)
        })
        .collect();
    let publisher_ms = start.elapsed().as_secs_f64() * 1e3;
    let bytes: usize = wire.iter().flat_map(|(_, c)| c.iter().map(Vec::len)).sum();
    let start = Instant::now();
    let mut index = OrderedIndex::new(ShardSettings::default(), Arc::default());
    for (id, chunks) in &wire {
        let rank = WorkerRank::new(*id, DpRank(0));
        let need = index.resync(rank).expect("a need");
        let mut asm = ChunkAssembler::new();
        let mut reply = None;
        for bytes in chunks {
            let chunk: RecoveryChunk = kv_events::decode(bytes).expect("decodes");
            reply = asm.push(chunk).expect("ordered");
        }
        index.apply_recovered(rank, need.token, reply.expect("complete"));
    }
    let router_ms = start.elapsed().as_secs_f64() * 1e3;
    assert_eq!(index.tree().num_entries() as u64, w.blocks);
    println!(
        "| dumps from {workers} publishers | {publisher_ms:.0} | {router_ms:.0} | {bytes} | {:.1} |",
        bytes as f64 / w.blocks as f64
    );

    // Snapshot: the router's own dump plus cursors, as one msgpack object.
    let start = Instant::now();
    let snapshot = kv_events::encode(&index.snapshot()).expect("encodes");
    let take_ms = start.elapsed().as_secs_f64() * 1e3;
    let start = Instant::now();
    let decoded: IndexSnapshot = kv_events::decode(&snapshot).expect("decodes");
    let mut restored = OrderedIndex::new(ShardSettings::default(), Arc::default());
    restored.restore(&decoded);
    let restore_ms = start.elapsed().as_secs_f64() * 1e3;
    assert_eq!(restored.tree().num_entries() as u64, w.blocks);
    println!(
        "| index snapshot | {take_ms:.0} (take + encode) | {restore_ms:.0} | {} | {:.1} |",
        snapshot.len(),
        snapshot.len() as f64 / w.blocks as f64
    );
}
