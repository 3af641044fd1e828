//! Differential test: a batch applied in steps, interrupted between events and
//! inside them at random block boundaries, leaves the index exactly as the batch
//! applied whole: the same answers, dump, cursors, counters and recovery needs.

use super::super::*;
use crate::tree::tests::events::{batch, cleared, q, removed, stored};
use kv_events::DpRank;
use proptest::prelude::*;
use std::cell::Cell;

/// One event of a generated stream.
#[derive(Debug, Clone)]
enum Ev {
    /// A chain of `len` new blocks below the `parent`-th block stored so far (or the
    /// root, or an unknown block), with `repeat` of its blocks being copies of blocks
    /// the rank already holds.
    Store {
        dp: u32,
        parent: Option<prop::sample::Index>,
        unknown_parent: bool,
        len: usize,
        repeat: Option<prop::sample::Index>,
    },
    /// Removes the picked blocks stored so far (some perhaps already removed).
    Remove {
        dp: u32,
        picks: Vec<prop::sample::Index>,
    },
    Clear {
        dp: u32,
    },
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        6 => (0u32..2, proptest::option::of(any::<prop::sample::Index>()), prop::bool::weighted(0.05), 0usize..14, proptest::option::of(any::<prop::sample::Index>()))
            .prop_map(|(dp, parent, unknown_parent, len, repeat)| Ev::Store { dp, parent, unknown_parent, len, repeat }),
        3 => (0u32..2, prop::collection::vec(any::<prop::sample::Index>(), 0..10))
            .prop_map(|(dp, picks)| Ev::Remove { dp, picks }),
        1 => (0u32..2).prop_map(|dp| Ev::Clear { dp }),
    ]
}

/// Turns generated events into batches of 1–4 events, numbered per rank, now and
/// then skipping an id (a gap, buffered until recovery) or repeating one.
fn batches(evs: &[Ev], skips: &[bool]) -> Vec<KvEventBatch> {
    let mut next_id = [0u64; 2];
    let mut held: Vec<u64> = Vec::new();
    let mut fresh = 1_000u64;
    let mut events = Vec::new();
    for (i, e) in evs.iter().enumerate() {
        let mut event = match e {
            Ev::Store {
                dp,
                parent,
                unknown_parent,
                len,
                repeat,
            } => {
                let parent = if *unknown_parent {
                    Some(7)
                } else {
                    (parent.as_ref())
                        .filter(|_| !held.is_empty())
                        .map(|p| *p.get(&held))
                };
                let mut chain: Vec<u64> = (0..*len)
                    .map(|_| {
                        fresh += 1;
                        fresh
                    })
                    .collect();
                if let (Some(r), false) = (repeat, held.is_empty() || chain.is_empty()) {
                    let at = r.index(chain.len());
                    chain[at] = *r.get(&held);
                }
                held.extend(&chain);
                let pairs: Vec<(u64, u64)> = chain.iter().map(|h| (*h, *h % 97)).collect();
                stored(*dp, parent, &pairs)
            }
            Ev::Remove { dp, picks } => {
                let hashes: Vec<u64> = (picks.iter())
                    .filter(|_| !held.is_empty())
                    .map(|p| *p.get(&held))
                    .collect();
                removed(*dp, &hashes)
            }
            Ev::Clear { dp } => cleared(*dp),
        };
        let id = &mut next_id[event.dp_rank.0 as usize];
        if skips.get(i).copied().unwrap_or(false) {
            *id += 1;
        }
        event.event_id = *id;
        events.push(event);
        *id += 1;
    }
    (events.chunks(4))
        .map(|events| KvEventBatch {
            epoch: 1,
            ..batch(3, events.to_vec())
        })
        .collect()
}

fn index() -> OrderedIndex {
    OrderedIndex::new(ShardSettings::default(), Arc::new(IndexerCounters::new()))
}

/// Every prefix of every chain the dump holds, per rank: the answers to compare.
fn answers(index: &OrderedIndex) -> Vec<Vec<(WorkerRank, u32)>> {
    let mut queries: Vec<Vec<LocalBlockHash>> = Vec::new();
    for batch in index.dump() {
        for event in &batch.events {
            if let KvCacheEventData::Stored { blocks, .. } = &event.data {
                queries.push(blocks.iter().map(|b| b.tokens_hash).collect());
            }
        }
    }
    queries
        .iter()
        .map(|q| index.find_matches(q).sorted())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_batch_in_steps_leaves_the_index_as_the_whole_batch(
        evs in prop::collection::vec(ev(), 1..40),
        skips in prop::collection::vec(prop::bool::weighted(0.05), 40),
        every in 1usize..6,
        stops in prop::collection::vec(any::<bool>(), 1..8),
    ) {
        let mut whole = index();
        let mut stepped = index();
        // Stops at the asked boundaries in the pattern `stops`, cycled.
        let asked = Cell::new(0usize);
        let stop = || {
            asked.set(asked.get() + 1);
            stops[asked.get() % stops.len()]
        };
        let interrupt = Interrupt { every, stop: &stop };
        for batch in batches(&evs, &skips) {
            let needs_whole = whole.apply_batch(&batch);
            let mut steps = BatchSteps::default();
            let mut calls = 0;
            while !stepped.apply_batch_step(&batch, &mut steps, interrupt) {
                calls += 1;
                prop_assert!(calls <= 1_000, "steps never end");
            }
            prop_assert_eq!(needs_whole, steps.into_needs());
            prop_assert_eq!(whole.dump(), stepped.dump());
            prop_assert_eq!(whole.snapshot(), stepped.snapshot());
            prop_assert_eq!(whole.counters().snapshot(), stepped.counters().snapshot());
            prop_assert_eq!(answers(&whole), answers(&stepped));
        }
    }
}

/// Applies `batch` (of worker 3) in steps asked to stop every 3 blocks, and returns
/// how many of blocks 1..=10 a query for them found rank (3, 0) holding between two
/// steps, and after the last. `counted` reads the event's counter, which must stay 0
/// until the last step.
fn seen_between_steps(
    index: &mut OrderedIndex,
    batch: &KvEventBatch,
    counted: impl Fn(&OrderedIndex) -> u64,
) -> (Vec<u32>, u32) {
    let query = q(&(1..=10).collect::<Vec<u64>>());
    let rank = WorkerRank::new(WorkerId(3), DpRank(0));
    let mut steps = BatchSteps::default();
    let mut seen = Vec::new();
    let interrupt = Interrupt {
        every: 3,
        stop: &|| true,
    };
    while !index.apply_batch_step(batch, &mut steps, interrupt) {
        seen.push(index.find_matches(&query).get(rank));
        assert_eq!(counted(index), 0, "counted before its last step");
    }
    (seen, index.find_matches(&query).get(rank))
}

/// A 10-block store asked to stop every 3 blocks: the steps stop before blocks 3, 6
/// and 9, a query between two of them sees the prefix stored so far, and the event
/// is counted once, at its last part.
#[test]
fn a_query_between_two_steps_sees_a_prefix_of_the_chain() {
    let mut index = index();
    let pairs: Vec<(u64, u64)> = (1..=10).map(|h| (h, h)).collect();
    let batch = batch(3, vec![stored(0, None, &pairs)]);
    let seen = seen_between_steps(&mut index, &batch, |i| {
        i.counters().snapshot().stored_events
    });
    assert_eq!(seen, (vec![3, 6, 9], 10));
    let counters = index.counters().snapshot();
    assert_eq!((counters.stored_events, counters.blocks_stored), (1, 10));
    assert_eq!(counters.batches, 1);
}

/// A 10-block chain removed, asked to stop every 3 blocks: while its blocks are
/// looked up a query still sees the whole chain (no run is split because a step
/// ended), then the chain shrinks from its leaf end, 3 blocks a step; the event is
/// counted once, at its last part.
#[test]
fn a_removal_in_steps_drops_its_chain_from_the_leaf_end() {
    let mut index = index();
    let pairs: Vec<(u64, u64)> = (1..=10).map(|h| (h, h)).collect();
    assert!(
        index
            .apply_batch(&batch(3, vec![stored(0, None, &pairs)]))
            .is_empty()
    );
    let mut event = removed(0, &(1..=10).collect::<Vec<u64>>());
    event.event_id = 1;
    let seen = seen_between_steps(&mut index, &batch(3, vec![event]), |i| {
        i.counters().snapshot().removed_events
    });
    assert_eq!(seen, (vec![10, 10, 10, 7, 4, 1], 0));
    let counters = index.counters().snapshot();
    assert_eq!((counters.removed_events, counters.blocks_removed), (1, 10));
}
