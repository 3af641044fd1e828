//! Long events applied whole and in parts (issue 29, item 4): a flood's 4,096-block
//! `Stored` and `Removed` events (fresh chains of 64 workers that no query matches,
//! `bench_workload::flood_batches_of`) on a bare tree of 64 workers × 1M entries,
//! 400 of each applied whole, then 400 of each stopped at every 8-block boundary and
//! resumed
//! ([`RadixTree::apply_event_from`]), as a writer would be under queries asked back
//! to back. Prints µs per event (p50, p99, max): what a query that meets the whole
//! event may wait, and what the hand-overs cost the writer.

use crate::{Scale, percentiles};
use bench_workload::{WorkloadShape, build, flood_batches_of};
use indexer::RadixTree;
use indexer::tree::{Interrupt, Progress};
use std::time::{Duration, Instant};

/// Blocks per flood event.
const EVENT_BLOCKS: usize = 4096;

/// Blocks between two stops when applied in parts (the front's `STEP_BLOCKS`).
const PART_BLOCKS: usize = indexer::inline::STEP_BLOCKS;

pub fn run(scale: Scale) {
    let w = build(WorkloadShape::apply(64, scale.of(1_000_000)), 1);
    let mut tree = RadixTree::new();
    for batch in &w.batches {
        for event in &batch.events {
            let _ = tree.apply_event(batch.worker_id, event);
        }
    }
    // Stored and Removed alternate. The first half is applied whole, the second in
    // parts (two passes rather than interleaved: the parts leave the arena's free
    // lists in another order, which moved the whole events' figures by up to 25 %).
    let flood = flood_batches_of(scale.of(800) as usize * 2, EVENT_BLOCKS);
    let mut took: [Vec<Duration>; 4] = Default::default();
    let half = flood.len() / 2;
    for (i, batch) in flood.iter().enumerate() {
        let in_parts = i >= half;
        let began = Instant::now();
        for event in &batch.events {
            if in_parts {
                let stop = || true;
                let every = Interrupt {
                    every: PART_BLOCKS,
                    stop: &stop,
                };
                let mut progress = Progress::default();
                while !progress.is_done() {
                    let _ = tree.apply_event_from(batch.worker_id, event, &mut progress, every);
                }
            } else {
                let _ = tree.apply_event(batch.worker_id, event);
            }
        }
        took[usize::from(in_parts) * 2 + i % 2].push(began.elapsed());
    }
    println!(
        "\n## {EVENT_BLOCKS}-block flood events, whole and stopped every {PART_BLOCKS} blocks \
         (64 workers x {} entries, bare tree; µs per event)\n",
        w.blocks
    );
    println!("| event | p50 | p99 | max |\n|---|---|---|---|");
    let names = [
        "Stored, whole",
        "Removed, whole",
        "Stored, in parts",
        "Removed, in parts",
    ];
    for (name, samples) in names.iter().zip(took) {
        let (p50, p99, max) = percentiles(samples);
        println!("| {name} | {p50:.1} | {p99:.1} | {max:.1} |");
    }
}
