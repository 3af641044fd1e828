//! The translator: tiers, block sizes, refusals, and KV cache groups (sparse
//! sliding-window stores, copies, group-scoped removals, unsupported kinds).

use super::*;
use kv_events::{LocalBlockHash, StorageTier, compute_block_hashes};

const BS: u32 = 2;
const R: DpRank = DpRank(0);

/// Tokens of block `h`: two per block, derived from the hash.
fn tokens_of(hashes: &[u64]) -> Vec<u32> {
    hashes
        .iter()
        .flat_map(|h| [*h as u32, *h as u32 + 1])
        .collect()
}

fn event(stored: BlockStored) -> EngineEvent {
    EngineEvent::BlockStored(Box::new(stored), EventForm::TaggedMap)
}

fn stored(hashes: &[u64], parent: Option<u64>, medium: &str, group: u32) -> EngineEvent {
    event(BlockStored {
        block_hashes: hashes.iter().copied().map(ExternalBlockHash).collect(),
        parent_block_hash: parent.map(ExternalBlockHash),
        token_ids: tokens_of(hashes),
        block_size: BS,
        medium: Some(medium.into()),
        group_idx: Some(group),
        ..BlockStored::default()
    })
}

fn removed(hashes: &[u64], medium: &str, group: Option<u32>) -> EngineEvent {
    EngineEvent::BlockRemoved(
        BlockRemoved {
            block_hashes: hashes.iter().copied().map(ExternalBlockHash).collect(),
            medium: Some(medium.into()),
            group_idx: group,
        },
        EventForm::TaggedMap,
    )
}

fn translator(format: EngineFormat) -> Translator {
    let mut t = Translator::new(format);
    t.learn_block_size(BS);
    t
}

/// The one event an engine event published.
fn one(result: Result<Vec<KvCacheEventData>, Skip>) -> KvCacheEventData {
    let mut events = result.expect("published");
    assert_eq!(events.len(), 1, "{events:?}");
    events.remove(0)
}

fn gpu_removed(hashes: &[u64], group: Option<u32>) -> KvCacheEventData {
    KvCacheEventData::Removed {
        block_hashes: hashes.iter().copied().map(ExternalBlockHash).collect(),
        tier: StorageTier::Gpu,
        group: group.map(GroupId),
    }
}

#[test]
fn the_first_stored_event_fixes_the_block_size_and_others_are_refused() {
    let mut t = Translator::new(EngineFormat::Auto);
    assert_eq!(t.block_size(), None);
    let mut zero = stored(&[10], None, "GPU", 0);
    if let EngineEvent::BlockStored(b, _) = &mut zero {
        b.block_size = 0;
    }
    assert!(matches!(t.apply(R, &zero), Err(Skip::Hashing(_))));
    assert_eq!(
        t.block_size(),
        None,
        "a size that does not hash fixes nothing"
    );
    t.apply(R, &stored(&[10], None, "GPU", 0)).expect("stored");
    assert_eq!(t.block_size(), Some(BS));
    t.learn_block_size(64);
    assert_eq!(t.block_size(), Some(BS), "the size in use stays");
    let mut other = stored(&[11], Some(10), "GPU", 0);
    if let EngineEvent::BlockStored(b, _) = &mut other {
        b.block_size = 4;
        b.token_ids.extend([1, 2]);
    }
    let err = t.apply(R, &other).unwrap_err().to_string();
    assert!(err.contains('4') && err.contains(&BS.to_string()), "{err}");
}

#[test]
fn stores_become_chains_with_local_hashes_and_a_store_again_is_a_copy() {
    let mut t = translator(EngineFormat::Auto);
    let out = one(t.apply(R, &stored(&[10, 11], None, "GPU", 0)));
    let KvCacheEventData::Stored {
        parent_hash,
        blocks,
        group,
        ..
    } = out
    else {
        panic!("{out:?}")
    };
    assert_eq!(parent_hash, None);
    assert_eq!(
        group,
        Some(KvCacheGroup::full(0)),
        "group_idx 0, no kind: full"
    );
    assert_eq!(blocks[1].block_hash, ExternalBlockHash(11));
    assert_eq!(
        blocks[1].tokens_hash,
        compute_block_hashes(&[11, 12], BS)[0]
    );
    let child = one(t.apply(R, &stored(&[12], Some(11), "GPU", 0)));
    assert!(matches!(
        child,
        KvCacheEventData::Stored {
            parent_hash: Some(ExternalBlockHash(11)),
            ..
        }
    ));
    assert_eq!(t.held(R), 3);
    // The same blocks again: a second physical copy, published; the block leaves
    // with its last copy.
    assert!(matches!(
        one(t.apply(R, &stored(&[10, 11], None, "GPU", 0))),
        KvCacheEventData::Stored { ref blocks, .. } if blocks.len() == 2
    ));
    for _ in 0..2 {
        assert_eq!(
            one(t.apply(R, &removed(&[11], "GPU", Some(0)))),
            gpu_removed(&[11], Some(0))
        );
    }
    assert_eq!(
        t.apply(R, &removed(&[11], "GPU", Some(0))),
        Err(Skip::NoChange),
        "no copy left"
    );
    assert_eq!(t.held(R), 2);
}

#[test]
fn a_removal_applies_to_its_own_group_only() {
    let mut t = translator(EngineFormat::Auto);
    t.apply(R, &stored(&[10], None, "GPU", 0)).unwrap();
    let again = one(t.apply(R, &stored(&[10], None, "GPU", 1)));
    assert!(
        matches!(again, KvCacheEventData::Stored { group: Some(g), .. } if g.id == GroupId(1)),
        "each group's store passes through with its group"
    );
    assert_eq!(
        one(t.apply(R, &removed(&[10], "GPU", Some(1)))),
        gpu_removed(&[10], Some(1))
    );
    // Group 1 holds no copy any more, and a removal without a group names the
    // group-less holder, which holds nothing: no fallback to group 0's copy.
    for group in [Some(1), Some(2), None] {
        assert_eq!(
            t.apply(R, &removed(&[10], "GPU", group)),
            Err(Skip::NoChange),
            "{group:?}"
        );
    }
    assert_eq!(t.held(R), 1, "group 0 still holds it");
    assert_eq!(
        one(t.apply(R, &removed(&[10], "GPU", Some(0)))),
        gpu_removed(&[10], Some(0))
    );
    assert_eq!(t.held(R), 0);
}

#[test]
fn an_offloaded_copy_is_its_own_tier() {
    let mut t = translator(EngineFormat::Auto);
    t.apply(R, &stored(&[10], None, "GPU", 0)).unwrap();
    // vLLM's offloading connector: the CPU copy (medium "CPU"), later the GPU
    // copy's eviction; the block stays held on the CPU.
    let cpu = one(t.apply(R, &stored(&[10, 11], None, "CPU", 0)));
    assert!(matches!(
        cpu,
        KvCacheEventData::Stored {
            tier: StorageTier::Cpu,
            ref blocks,
            ..
        } if blocks.len() == 2
    ));
    assert_eq!(
        one(t.apply(R, &removed(&[10], "GPU", Some(0)))),
        gpu_removed(&[10], Some(0))
    );
    assert_eq!(t.held(R), 2);
    // A GPU child of a block held only on the CPU is not an orphan.
    assert!(t.apply(R, &stored(&[12], Some(11), "GPU", 0)).is_ok());
    assert_eq!(
        t.apply(R, &removed(&[10, 11, 99], "Disk", Some(0))),
        Err(Skip::NoChange),
        "nothing is held on disk"
    );
    assert_eq!(
        one(t.apply(R, &removed(&[10, 11, 99], "cpu", Some(0)))),
        KvCacheEventData::Removed {
            block_hashes: vec![ExternalBlockHash(10), ExternalBlockHash(11)],
            tier: StorageTier::Cpu,
            group: Some(GroupId(0)),
        }
    );
    assert_eq!(t.held(R), 1);
}

#[test]
fn an_unknown_medium_is_skipped_with_its_reason() {
    let mut t = translator(EngineFormat::Auto);
    let skip = t.apply(R, &stored(&[10], None, "tape", 0)).unwrap_err();
    assert_eq!(skip, Skip::UnknownMedium(UnknownMedium("tape".into())));
    assert_eq!(skip.label(), "unknown_medium");
    assert_eq!(t.held(R), 0);
    t.apply(R, &stored(&[10], None, "GPU", 0)).unwrap();
    assert_eq!(
        t.apply(R, &removed(&[10], "tape", None))
            .unwrap_err()
            .label(),
        "unknown_medium"
    );
    assert_eq!(t.held(R), 1);
}

#[test]
fn orphans_bad_blocks_unknown_types_and_refused_forms_are_skipped() {
    let mut t = translator(EngineFormat::Tagged);
    assert_eq!(
        t.apply(R, &stored(&[5], Some(4), "GPU", 0)),
        Err(Skip::Orphan(ExternalBlockHash(4)))
    );
    let EngineEvent::BlockStored(mut bad, form) = stored(&[5], None, "GPU", 0) else {
        unreachable!()
    };
    bad.token_ids.pop();
    assert!(matches!(
        t.apply(R, &EngineEvent::BlockStored(bad, form)),
        Err(Skip::Hashing(_))
    ));
    let unknown = EngineEvent::Unknown {
        type_name: "BlockUpdated".into(),
        form: EventForm::TaggedMap,
    };
    assert_eq!(
        t.apply(R, &unknown),
        Err(Skip::UnknownType("BlockUpdated".into()))
    );
    let positional = EngineEvent::AllBlocksCleared(EventForm::PositionalArray);
    assert_eq!(
        t.apply(R, &positional),
        Err(Skip::Format(EventForm::PositionalArray))
    );
}

#[test]
fn ranks_are_independent_and_clear_drops_one_rank() {
    let mut t = translator(EngineFormat::Auto);
    t.apply(R, &stored(&[1, 2], None, "GPU", 0)).unwrap();
    t.apply(DpRank(1), &stored(&[1], None, "GPU", 0)).unwrap();
    assert_eq!(
        t.apply(R, &EngineEvent::AllBlocksCleared(EventForm::TaggedMap)),
        Ok(vec![KvCacheEventData::Cleared])
    );
    assert_eq!((t.held(R), t.held(DpRank(1))), (0, 1));
}

#[path = "hybrid_tests.rs"]
mod hybrid;

/// The local hash the translator gives block `h` of [`stored`].
fn local(h: u64) -> LocalBlockHash {
    compute_block_hashes(&tokens_of(&[h]), BS)[0]
}
