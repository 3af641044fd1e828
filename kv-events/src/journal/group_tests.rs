//! The journal's held set with KV cache groups and copies: group-scoped removals,
//! sparse windowed chains below other groups' blocks, copy counts, and dumps that
//! rebuild all of it (checked against a plain model on random hybrid streams).

use super::tests::{chain, empty_dump, journal, removed, stored};
use super::*;
use crate::events::{KvCacheGroup, StorageTier};
use crate::ids::{ExternalBlockHash, GroupId};
use crate::recovery::{GroupBlocks, StoredChain};

fn in_group(data: KvCacheEventData, group: Option<KvCacheGroup>) -> KvCacheEventData {
    match data {
        KvCacheEventData::Stored {
            parent_hash,
            blocks,
            tier,
            ..
        } => KvCacheEventData::Stored {
            parent_hash,
            blocks,
            tier,
            group,
        },
        KvCacheEventData::Removed {
            block_hashes, tier, ..
        } => KvCacheEventData::Removed {
            block_hashes,
            tier,
            group: group.map(|g| g.id),
        },
        other => other,
    }
}

const FULL: Option<KvCacheGroup> = Some(KvCacheGroup {
    id: GroupId(3),
    window_blocks: None,
});

fn sliding(id: u32) -> Option<KvCacheGroup> {
    KvCacheGroup::windowed(id, 2)
}

/// Rank 0's dump: chains, unheld blocks, unheld blocks per group.
fn dump_parts(j: &EventJournal) -> (Vec<StoredChain>, Vec<ExternalBlockHash>, Vec<GroupBlocks>) {
    match j.dump(DpRank(0)).body {
        RecoveryBody::Dump {
            chains,
            unheld,
            unheld_in_groups,
        } => (chains, unheld, unheld_in_groups),
        other => panic!("expected a dump, got {other:?}"),
    }
}

/// The events a router applies for rank 0's dump: clear, the chains in order, then
/// the placeholders out of their groups.
fn dump_events(j: &EventJournal) -> Vec<KvCacheEventData> {
    let (chains, unheld, unheld_in_groups) = dump_parts(j);
    let mut events = vec![KvCacheEventData::Cleared];
    events.extend(chains.into_iter().map(StoredChain::into_event_data));
    if !unheld.is_empty() {
        events.push(removed(&unheld.iter().map(|h| h.0).collect::<Vec<_>>()));
    }
    for GroupBlocks {
        group,
        block_hashes,
    } in unheld_in_groups
    {
        events.push(KvCacheEventData::Removed {
            block_hashes,
            tier: StorageTier::Gpu,
            group: Some(group),
        });
    }
    events
}

/// Rebuilds `j`'s rank 0 from its dump in a fresh journal and checks that the copies
/// per group and the dump itself come back unchanged.
fn assert_dump_round_trips(j: &EventJournal) {
    let mut rebuilt = journal(64);
    for event in dump_events(j) {
        rebuilt.record(DpRank(0), event);
    }
    assert_eq!(copies(&rebuilt), copies(j), "copies per group");
    assert_eq!(rebuilt.dump(DpRank(0)).body, j.dump(DpRank(0)).body);
    assert_eq!(rebuilt.held_blocks(DpRank(0)), j.held_blocks(DpRank(0)));
}

/// Each dump chain as (group id, parent, block hashes).
type ChainShape = (Option<u32>, Option<u64>, Vec<u64>);

fn shape(chains: &[StoredChain]) -> Vec<ChainShape> {
    chains
        .iter()
        .map(|c| {
            (
                c.group.map(|g| g.id.0),
                c.parent_hash.map(|h| h.0),
                c.blocks.iter().map(|b| b.block_hash.0).collect(),
            )
        })
        .collect()
}

fn copies(j: &EventJournal) -> Vec<(Option<u32>, u64, u32)> {
    j.ranks
        .get(&DpRank(0))
        .map(|r| r.held.copies())
        .unwrap_or_default()
        .into_iter()
        .map(|((g, h), n)| (g.map(|g| g.0), h.0, n))
        .collect()
}

#[test]
fn groups_hold_their_own_blocks_and_sparse_windowed_chains_hang_below_other_groups() {
    let mut j = journal(64);
    // vLLM's step: the sliding groups store only the tail 4, 5 of the chain 1..=5
    // (parent 3, held by the full group); the full group stores it all.
    j.record(DpRank(0), in_group(stored(None, &[1, 2, 3, 4, 5]), FULL));
    j.record(DpRank(0), in_group(stored(Some(3), &[4, 5]), sliding(0)));
    j.record(DpRank(0), in_group(stored(Some(3), &[4, 5]), sliding(1)));
    // An empty store makes group 2 known.
    j.record(DpRank(0), in_group(stored(None, &[]), sliding(2)));
    assert_eq!(j.held_blocks(DpRank(0)), 5);
    // A removal applies to its own group only.
    j.record(DpRank(0), in_group(removed(&[5]), sliding(1)));
    assert_eq!(
        copies(&j),
        vec![
            (Some(0), 4, 1),
            (Some(0), 5, 1),
            (Some(1), 4, 1),
            (Some(3), 1, 1),
            (Some(3), 2, 1),
            (Some(3), 3, 1),
            (Some(3), 4, 1),
            (Some(3), 5, 1),
        ]
    );
    let (chains, unheld, unheld_in_groups) = dump_parts(&j);
    assert_eq!(
        shape(&chains),
        vec![
            (Some(3), None, vec![1, 2, 3, 4, 5]),
            (Some(0), Some(3), vec![4, 5]),
            (Some(1), Some(3), vec![4]),
            (Some(2), None, vec![]),
        ],
        "the full group carries the chain; the others hang below it; group 2 stays known"
    );
    assert_eq!(chains[1].group, sliding(0), "each chain names its window");
    assert!(unheld.is_empty() && unheld_in_groups.is_empty());
    assert_dump_round_trips(&j);
    // The full group evicts the whole chain: the sliding groups still hold 4 and 5,
    // so the dump places 1..=4 as placeholders of the full group, removed after.
    j.record(DpRank(0), in_group(removed(&[5, 4, 3, 2, 1]), FULL));
    assert_eq!(j.held_blocks(DpRank(0)), 2);
    let (chains, unheld, unheld_in_groups) = dump_parts(&j);
    assert_eq!(chains[0].blocks, chain(&[1, 2, 3, 4]));
    assert_eq!(chains[0].group, FULL);
    assert!(unheld.is_empty());
    assert_eq!(
        unheld_in_groups,
        vec![GroupBlocks {
            group: GroupId(3),
            block_hashes: [1, 2, 3, 4].map(ExternalBlockHash).to_vec()
        }]
    );
    assert_dump_round_trips(&j);
    // Last copies gone: nothing is left, not even placeholders; the groups stay known.
    j.record(DpRank(0), in_group(removed(&[4, 5]), sliding(0)));
    j.record(DpRank(0), in_group(removed(&[4]), sliding(1)));
    assert_eq!(j.held_blocks(DpRank(0)), 0);
    let (chains, ..) = dump_parts(&j);
    assert!(chains.iter().all(|c| c.blocks.is_empty()), "{chains:?}");
    assert_eq!(chains.len(), 4, "every known group, empty");
    // A clear forgets the groups too.
    j.record(DpRank(0), KvCacheEventData::Cleared);
    assert_eq!(j.dump(DpRank(0)).body, empty_dump());
}

#[test]
fn copies_are_counted_per_group_and_dumped_as_extra_chains() {
    let mut j = journal(64);
    // vLLM recomputing a prefix it holds (the capture's prompt B) stores 1..=3 again;
    // an aligned prompt's repeat stores its last block again.
    j.record(DpRank(0), stored(None, &[1, 2, 3]));
    j.record(DpRank(0), stored(None, &[1, 2, 3, 4]));
    j.record(DpRank(0), stored(Some(3), &[4]));
    j.record(DpRank(0), removed(&[2]));
    assert_eq!(
        copies(&j),
        vec![(None, 1, 2), (None, 2, 1), (None, 3, 2), (None, 4, 2)]
    );
    let (chains, ..) = dump_parts(&j);
    assert_eq!(
        shape(&chains),
        vec![
            (None, None, vec![1, 2, 3, 4]),
            (None, None, vec![1]),
            (None, Some(2), vec![3]),
            (None, Some(3), vec![4]),
        ]
    );
    assert_dump_round_trips(&j);
    // One removal per copy: the block leaves with its last one.
    j.record(DpRank(0), removed(&[4]));
    assert_eq!(j.held_blocks(DpRank(0)), 4);
    j.record(DpRank(0), removed(&[4, 4]));
    assert_eq!(
        j.held_blocks(DpRank(0)),
        3,
        "a removal of an absent copy is a no-op"
    );
    assert_dump_round_trips(&j);
}

#[test]
fn a_store_naming_another_window_for_a_known_group_changes_nothing() {
    let mut j = journal(64);
    j.record(DpRank(0), in_group(stored(None, &[1]), sliding(0)));
    j.record(
        DpRank(0),
        in_group(stored(Some(1), &[2]), KvCacheGroup::windowed(0, 7)),
    );
    assert_eq!(copies(&j), vec![(Some(0), 1, 1)]);
}

mod random {
    //! Random hybrid streams: the journal's copies match a plain model, and its dump
    //! rebuilds them exactly.
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// Blocks form a binary tree: block `h`'s parent is `h / 2`, block 1 is a root.
    fn parent(h: u64) -> Option<u64> {
        (h > 1).then_some(h / 2)
    }

    fn group(g: u8) -> Option<KvCacheGroup> {
        match g {
            0 => None,
            1 => Some(KvCacheGroup::full(1)),
            n => KvCacheGroup::windowed(u32::from(n), 2),
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Store the path from `start` down `len` blocks (left or right by `turns`).
        Store {
            g: u8,
            start: u64,
            len: u8,
            turns: u8,
        },
        Remove {
            g: u8,
            hash: u64,
        },
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u8..4, 1u64..16, 0u8..4, any::<u8>())
                .prop_map(|(g, start, len, turns)| Op::Store { g, start, len, turns }),
            4 => (0u8..4, 1u64..64).prop_map(|(g, hash)| Op::Remove { g, hash }),
            1 => Just(Op::Clear),
        ]
    }

    proptest! {
        #[test]
        fn dumps_rebuild_the_copies_of_every_group(ops in proptest::collection::vec(op(), 1..60)) {
            let mut j = journal(64);
            let mut model: BTreeMap<(Option<u32>, u64), u32> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Store { g, start, len, turns } => {
                        // A router refuses a chain whose parent no group holds: so
                        // does the relay, so such stores are not generated.
                        let parent_held = parent(start)
                            .is_none_or(|p| model.keys().any(|(_, h)| *h == p));
                        if !parent_held {
                            continue;
                        }
                        let mut hashes = vec![];
                        let mut h = start;
                        for i in 0..len {
                            hashes.push(h);
                            h = h * 2 + u64::from((turns >> i) & 1);
                        }
                        for h in &hashes {
                            *model.entry((group(g).map(|g| g.id.0), *h)).or_default() += 1;
                        }
                        j.record(DpRank(0), in_group(stored(parent(start), &hashes), group(g)));
                    }
                    Op::Remove { g, hash } => {
                        let key = (group(g).map(|g| g.id.0), hash);
                        if let Some(n) = model.get_mut(&key) {
                            *n -= 1;
                            if *n == 0 {
                                model.remove(&key);
                            }
                        }
                        j.record(DpRank(0), in_group(removed(&[hash]), group(g)));
                    }
                    Op::Clear => {
                        model.clear();
                        j.record(DpRank(0), KvCacheEventData::Cleared);
                    }
                }
            }
            let got: BTreeMap<_, _> = copies(&j).into_iter().map(|(g, h, n)| ((g, h), n)).collect();
            prop_assert_eq!(&got, &model);
            assert_dump_round_trips(&j);
        }
    }
}
