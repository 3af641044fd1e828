//! A real vLLM 0.32 capture of a hybrid-attention model (3 sliding-window groups of
//! window 128 and 1 full-attention group, block 32), replayed through the relay's
//! translator and an `EventJournal`: nothing is refused, every group passes through
//! with its window, sparse sliding stores land below the full group's chain, copies
//! are counted, every removal names a copy its own group holds, and the journal's
//! dump rebuilds the same copies. Fixture: `kv-events/tests/fixtures/engines/`
//! (`vllm_0.32_hybrid_*`, see its README).

// Test helpers unwrap: a broken fixture must fail the test loudly.
#![allow(clippy::unwrap_used)]

use integration_tests::capture::messages;
use kv_events::journal::{EventJournal, JournalConfig};
use kv_events::recovery::RecoveryBody;
use kv_events::{DpRank, ExternalBlockHash, KvCacheEventData, KvCacheGroup, WorkerId};
use kv_relay::EngineFormat;
use kv_relay::translate::Translator;
use std::collections::BTreeMap;

/// Copies per (group id, block) after applying `data`; panics on a removal of a
/// copy the group does not hold.
fn apply(copies: &mut BTreeMap<(u32, ExternalBlockHash), u32>, data: &KvCacheEventData) {
    match data {
        KvCacheEventData::Stored { blocks, group, .. } => {
            for b in blocks {
                *copies
                    .entry((group.unwrap().id.0, b.block_hash))
                    .or_default() += 1;
            }
        }
        KvCacheEventData::Removed {
            block_hashes,
            group,
            ..
        } => {
            for h in block_hashes {
                let key = (group.unwrap().0, *h);
                let n = copies.get_mut(&key).expect("a removal names a held copy");
                *n -= 1;
                if *n == 0 {
                    copies.remove(&key);
                }
            }
        }
        KvCacheEventData::Cleared => copies.clear(),
    }
}

/// Copies per (group, block) that a router rebuilds from the journal's dump.
fn dumped(journal: &EventJournal) -> BTreeMap<(u32, ExternalBlockHash), u32> {
    let RecoveryBody::Dump {
        chains,
        unheld,
        unheld_in_groups,
    } = journal.dump(DpRank(0)).body
    else {
        panic!("a dump")
    };
    assert!(unheld.is_empty(), "every chain has a group");
    let mut copies = BTreeMap::new();
    for chain in chains {
        apply(&mut copies, &chain.into_event_data());
    }
    for g in unheld_in_groups {
        let removed = KvCacheEventData::Removed {
            block_hashes: g.block_hashes,
            tier: kv_events::StorageTier::Gpu,
            group: Some(g.group),
        };
        apply(&mut copies, &removed);
    }
    copies
}

#[test]
fn the_real_hybrid_capture_translates_without_refusals() {
    let mut translator = Translator::new(EngineFormat::Auto);
    let mut journal = EventJournal::new(WorkerId(1), 1, JournalConfig::default());
    let mut copies = BTreeMap::new();
    let mut outcomes: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    let mut groups = BTreeMap::new();
    let mut per_seq = BTreeMap::new();
    for (seq, batch) in messages("vllm_0.32_hybrid_frames.bin") {
        let (rank, results) = translator.translate_batch(&batch, DpRank(0));
        assert_eq!(rank, DpRank(0));
        let mut published = Vec::new();
        for outcome in results {
            let label = outcome
                .result
                .as_ref()
                .map_or_else(|s| s.label(), |_| "published");
            *outcomes.entry((outcome.kind, label)).or_default() += 1;
            published.extend(outcome.result.unwrap_or_default());
        }
        for data in &published {
            apply(&mut copies, data);
            if let KvCacheEventData::Stored { group: Some(g), .. } = data {
                groups.insert(g.id.0, *g);
            }
        }
        journal.record_batch(rank, published.clone());
        assert_eq!(
            dumped(&journal),
            copies,
            "seq {seq}: the dump rebuilds the copies"
        );
        per_seq.insert(seq, (published, copies.clone()));
    }
    // Nothing refused: only C's repeated empty sliding stores change nothing (the
    // sliding groups are already known).
    let refused: Vec<_> = outcomes
        .iter()
        .filter(|((_, label), _)| *label != "published")
        .collect();
    assert_eq!(refused, vec![(&("stored", "no_change"), &6)]);
    let removals = messages("vllm_0.32_hybrid_frames.bin")
        .iter()
        .flat_map(|(_, b)| &b.events)
        .filter(|e| matches!(e, kv_events::engines::EngineEvent::BlockRemoved(..)))
        .count();
    assert_eq!(removals, 68 + 40 * 4 + 45, "the evictions of E0–E5");
    assert_eq!(
        outcomes[&("removed", "published")],
        removals,
        "every removal"
    );
    // Every group with its window: 0–2 sliding (cdiv(127, 32) = 4 blocks), 3 full.
    assert_eq!(
        groups.into_values().collect::<Vec<_>>(),
        vec![
            KvCacheGroup::windowed(0, 4).unwrap(),
            KvCacheGroup::windowed(1, 4).unwrap(),
            KvCacheGroup::windowed(2, 4).unwrap(),
            KvCacheGroup::full(3),
        ]
    );
    // Prompt A (seq 0): each sliding group stores A's positions 7–10 below the full
    // group's position 6, with the full group's local hashes.
    let (a, _) = &per_seq[&0];
    let KvCacheEventData::Stored {
        blocks: full_a,
        group: Some(full),
        parent_hash: None,
        ..
    } = &a[0]
    else {
        panic!("{:?}", a[0])
    };
    assert!(full.is_full() && full_a.len() == 11);
    for sliding in &a[1..] {
        assert_eq!(
            sliding,
            &KvCacheEventData::Stored {
                parent_hash: Some(full_a[6].block_hash),
                blocks: full_a[7..].to_vec(),
                tier: kv_events::StorageTier::Gpu,
                group: match sliding {
                    KvCacheEventData::Stored { group, .. } => *group,
                    _ => None,
                },
            }
        );
    }
    // Copies: B (seq 1) re-stores A's first 8 blocks in the full group, and A's
    // position 7 in each sliding group; C's last block is held 3 times after its two
    // repeats (seq 4), and no copy of either is left after the first eviction (seq 6).
    let held = |seq: u64, group: u32, hash: ExternalBlockHash| {
        per_seq[&seq].1.get(&(group, hash)).copied().unwrap_or(0)
    };
    for block in &full_a[..8] {
        assert_eq!(held(1, 3, block.block_hash), 2);
    }
    for g in 0..3 {
        assert_eq!(held(1, g, full_a[7].block_hash), 2);
    }
    let c_last = ExternalBlockHash(10_031_061_800_825_616_930);
    assert_eq!(
        (held(2, 3, c_last), held(4, 3, c_last), held(6, 3, c_last)),
        (1, 3, 0)
    );
    assert_eq!(
        held(7, 3, full_a[0].block_hash),
        0,
        "both copies evicted by seq 7"
    );
}
