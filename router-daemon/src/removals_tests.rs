//! The removals memory: what it excuses, what it never does, and its bounds.

use super::*;
use kv_events::routing::MAX_REMOVAL_HASHES;
use kv_events::{DpRank, KvCacheEvent, StoredBlock, encode};
use std::collections::HashMap;

const W: WorkerId = WorkerId(7);

fn at(event_id: u64) -> EventPosition {
    EventPosition { epoch: 1, event_id }
}

fn batch(event_id: u64, data: KvCacheEventData) -> KvEventBatch {
    KvEventBatch {
        worker_id: W,
        epoch: 1,
        events: vec![KvCacheEvent {
            event_id,
            dp_rank: DpRank(0),
            data,
        }],
    }
}

/// Engine hash `e` names the block of local hash `100 + e`.
fn stored(event_id: u64, externals: &[u64]) -> KvEventBatch {
    let blocks = externals
        .iter()
        .map(|&e| StoredBlock {
            block_hash: ExternalBlockHash(e),
            tokens_hash: LocalBlockHash(100 + e),
        })
        .collect();
    batch(
        event_id,
        KvCacheEventData::Stored {
            parent_hash: None,
            blocks,
            tier: Default::default(),
            group: None,
        },
    )
}

fn removed(event_id: u64, externals: &[u64]) -> KvEventBatch {
    batch(
        event_id,
        KvCacheEventData::Removed {
            block_hashes: externals.iter().copied().map(ExternalBlockHash).collect(),
            tier: Default::default(),
            group: None,
        },
    )
}

fn query(after: EventPosition, externals: &[u64]) -> RemovalsQuery {
    RemovalsQuery {
        worker_id: W,
        dp_rank: DpRank(0),
        after,
        block_hashes: externals.iter().map(|&e| LocalBlockHash(100 + e)).collect(),
    }
}

fn rank0() -> WorkerRank {
    WorkerRank::new(W, DpRank(0))
}

/// The race: stored, routed (position 0), removed, stored again by the request that
/// found it missing: the removed block is named, by its index in the query.
#[test]
fn a_block_removed_after_the_decision_and_stored_again_is_named() {
    let r = Removals::new(16);
    r.record(&stored(0, &[1, 2, 3]));
    let decided = r.position(rank0()).unwrap();
    assert_eq!(decided, at(0));
    r.record(&removed(1, &[3, 2]));
    r.record(&stored(2, &[2, 3]));
    let answer = r.answer(&query(decided, &[1, 2, 3]));
    assert_eq!(answer.removed, vec![1, 2]);
    assert!(answer.complete && !answer.cleared);
    // Asked from after the removal, nothing was removed since.
    assert!(r.answer(&query(at(1), &[1, 2, 3])).removed.is_empty());
}

/// Not excused: a removal before the decision, a removal never stored again (its
/// local hash is unknown), and a block missing without any `Removed` (an engine that
/// loses its removals), even when the request stores it again.
#[test]
fn removals_before_the_decision_unstored_or_never_published_name_nothing() {
    let r = Removals::new(16);
    r.record(&stored(0, &[1, 2]));
    r.record(&removed(1, &[2]));
    r.record(&stored(2, &[2]));
    let decided = r.position(rank0()).unwrap();
    assert!(r.answer(&query(decided, &[1, 2])).removed.is_empty());

    r.record(&removed(3, &[1]));
    assert!(r.answer(&query(decided, &[1, 2])).removed.is_empty());

    let silent = Removals::new(16);
    silent.record(&stored(0, &[1, 2]));
    let decided = silent.position(rank0()).unwrap();
    silent.record(&stored(1, &[1, 2]));
    let answer = silent.answer(&query(decided, &[1, 2]));
    assert!(answer.removed.is_empty() && answer.complete);
}

/// At most `per_rank` removals are kept, with their maps; once one after the asked
/// position is forgotten the answer says it is incomplete.
#[test]
fn the_memory_is_bounded_per_rank_and_says_when_it_is_incomplete() {
    let r = Removals::new(2);
    r.record(&stored(0, &[1, 2, 3, 4]));
    r.record(&removed(1, &[1]));
    r.record(&stored(2, &[1]));
    r.record(&removed(3, &[2, 3, 4]));
    r.record(&stored(4, &[2, 3, 4]));
    {
        let ranks = r.lock();
        let rank = &ranks[&rank0()];
        assert_eq!(rank.ring.len(), 2);
        assert!(rank.by_external.len() <= 2 && rank.restored.len() <= 2);
        assert_eq!(rank.forgotten, Some(at(3)));
    }
    let answer = r.answer(&query(at(0), &[1, 2, 3, 4]));
    assert_eq!(answer.removed, vec![2, 3]);
    assert!(!answer.complete);
    assert!(r.answer(&query(at(3), &[1])).complete);
    // A rank the router never saw: nothing known, so incomplete.
    let unknown = RemovalsQuery {
        dp_rank: DpRank(1),
        ..query(at(0), &[1])
    };
    assert!(!r.answer(&unknown).complete);
    // Nor does a replica know removals from before its first event of the rank.
    let late = Removals::new(4);
    late.record(&stored(5, &[1]));
    assert!(!late.answer(&query(at(4), &[1])).complete);
}

/// Positions: the last event recorded of the rank (epoch before event id), none when
/// removals are off; a clear after the decision is reported; a worker that left is
/// forgotten.
#[test]
fn positions_clears_and_forgotten_workers() {
    let r = Removals::new(4);
    assert_eq!(r.position(rank0()), Some(EventPosition::default()));
    r.record(&stored(9, &[1]));
    r.record(&stored(4, &[2]));
    assert_eq!(r.position(rank0()), Some(at(9)));
    let mut next_epoch = stored(0, &[3]);
    next_epoch.epoch = 2;
    r.record(&next_epoch);
    let decided = r.position(rank0()).unwrap();
    assert_eq!(
        decided,
        EventPosition {
            epoch: 2,
            event_id: 0
        }
    );
    let mut cleared = batch(1, KvCacheEventData::Cleared);
    cleared.epoch = 2;
    r.record(&cleared);
    assert!(r.answer(&query(decided, &[3])).cleared);
    assert!(
        !r.answer(&query(
            EventPosition {
                epoch: 2,
                event_id: 1
            },
            &[3]
        ))
        .cleared
    );
    r.forget_worker(W);
    assert!(r.lock().is_empty());

    let off = Removals::new(0);
    off.record(&removed(1, &[1]));
    assert_eq!(off.position(rank0()), None);
    assert!(off.lock().is_empty());
}

/// One event of the differential test, on engine hashes `0..12`.
#[derive(Debug, Clone)]
enum Op {
    Stored(Vec<u64>),
    Removed(Vec<u64>),
    Cleared,
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    let hashes = |max| proptest::collection::vec(0u64..12, 0..max);
    prop_oneof![
        4 => hashes(8).prop_map(Op::Stored),
        4 => hashes(20).prop_map(Op::Removed),
        1 => Just(Op::Cleared),
    ]
}

proptest::proptest! {
    /// Differential: the memory (with its bulk path for removals larger than the
    /// ring) answers every query, from every position, as the reference model that
    /// passes each removal through the ring one at a time, and holds the same
    /// removals, maps and forgotten position.
    #[test]
    fn answers_as_the_reference_model(
        per_rank in 1usize..6,
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        let r = Removals::new(per_rank);
        let mut model = model::Model::new(per_rank, at(1));
        for (event_id, op) in (1u64..).zip(&ops) {
            let batch = match op {
                Op::Stored(e) => stored(event_id, e),
                Op::Removed(e) => removed(event_id, e),
                Op::Cleared => batch(event_id, KvCacheEventData::Cleared),
            };
            r.record(&batch);
            match op {
                Op::Stored(e) => e.iter().for_each(|&e| {
                    model.store(ExternalBlockHash(e), LocalBlockHash(100 + e))
                }),
                Op::Removed(e) => {
                    e.iter().for_each(|&e| model.remove(at(event_id), ExternalBlockHash(e)))
                }
                Op::Cleared => model.cleared = Some(at(event_id)),
            }
            let ranks = r.lock();
            let rank = &ranks[&rank0()];
            let ring = |r: &Removal| (r.at, r.external, r.local);
            proptest::prop_assert_eq!(
                rank.ring.iter().map(ring).collect::<Vec<_>>(),
                model.ring.iter().map(|(_, r)| ring(r)).collect::<Vec<_>>()
            );
            proptest::prop_assert_eq!(rank.forgotten, model.forgotten);
            let restored: HashMap<_, _> = rank.restored.iter().map(|(k, v)| (*k, *v)).collect();
            proptest::prop_assert_eq!(&restored, &model.restored);
            let by_external: HashMap<_, _> = rank.by_external.iter().map(|(k, n)| (*k, *n)).collect();
            proptest::prop_assert_eq!(&by_external, &model.by_external);
            drop(ranks);
            for after in 0..=event_id {
                let q = query(at(after), &(0..12).collect::<Vec<_>>());
                proptest::prop_assert_eq!(r.answer(&q), model.answer(&q), "after {}", after);
            }
        }
    }
}

fn handle(state: &crate::state::RouterState, subject: &str, payload: &[u8]) -> RemovalsReply {
    (state.removals).handle(&state.counters, &state.limits, subject, payload)
}

/// The service refuses a query over the hash cap (or undecodable) with a
/// `bad_request` reply, and answers a valid one.
#[tokio::test]
async fn over_long_or_malformed_queries_are_refused() {
    let starting = crate::test_state::starting();
    let state = starting.state();
    let long = query(at(0), &vec![1; MAX_REMOVAL_HASHES + 1]);
    let reply = handle(state, "s", &encode(&long).unwrap());
    assert!(
        matches!(&reply, RemovalsReply::Error(e) if e.code == RouteErrorCode::BadRequest),
        "{reply:?}"
    );
    let reply = handle(state, "s", b"\xc1");
    assert!(matches!(reply, RemovalsReply::Error(_)));
    let ok = query(at(0), &vec![1; MAX_REMOVAL_HASHES]);
    let reply = handle(state, "s", &encode(&ok).unwrap());
    assert!(matches!(reply, RemovalsReply::Answered(_)), "{reply:?}");
}

/// The cost of remembering removals on the event intake, A/B alternated in one run:
/// `Indexer::apply` of the latency benches' floods (alternating `Stored` and
/// `Removed` batches on 64 workers, the worst case: every other batch removes; 16-
/// and 4,096-block batches, 3.2M blocks each) with and without [`Removals::record`]
/// before it. Prints ns per block; asserts nothing about time. Run: `cargo test
/// --release -p router-daemon --lib apply_cost -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a test"]
fn apply_cost() {
    use indexer::{Indexer, IndexerApi as _, IndexerConfig};
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    const BLOCKS: usize = 3_200_000;
    for batch_blocks in [16, 4096] {
        let batches = bench_workload::flood_batches_of(BLOCKS / batch_blocks, batch_blocks);
        let run = |keep: bool| -> f64 {
            rt.block_on(async {
                let indexer = Indexer::spawn(
                    IndexerConfig {
                        num_shards: 1,
                        ..IndexerConfig::default()
                    },
                    tokio_util::sync::CancellationToken::new(),
                )
                .expect("config");
                let removals = Removals::new(if keep { DEFAULT_PER_RANK } else { 0 });
                let start = std::time::Instant::now();
                for batch in &batches {
                    removals.record(batch);
                    indexer.apply(batch.clone()).await.expect("running");
                }
                start.elapsed().as_secs_f64() * 1e9 / BLOCKS as f64
            })
        };
        let (mut base, mut with) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            base.push(run(false));
            with.push(run(true));
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (a, b) = (median(&mut base), median(&mut with));
        println!(
            "{batch_blocks}-block batches, ns per block: without {a:.1} (sorted {base:.1?}), \
             with removals {b:.1} (sorted {with:.1?}), ratio {:.3}",
            b / a
        );
    }
}
