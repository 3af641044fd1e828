//! The CPU tier: offload at GPU eviction, the tier's own LRU eviction, loading back at
//! admission, and the events of each.

use super::tests::{chain, hashes, prefill, random_workload};
use super::*;

fn stored(
    tier: StorageTier,
    parent: Option<&StoredBlock>,
    blocks: &[StoredBlock],
) -> KvCacheEventData {
    KvCacheEventData::Stored {
        group: None,
        parent_hash: parent.map(|p| p.block_hash),
        blocks: blocks.to_vec(),
        tier,
    }
}

fn removed(tier: StorageTier, blocks: &[&StoredBlock]) -> KvCacheEventData {
    KvCacheEventData::Removed {
        group: None,
        block_hashes: blocks.iter().map(|b| b.block_hash).collect(),
        tier,
    }
}

/// A cache of 4 GPU blocks and `cpu` CPU blocks in which prompt `a` (3 blocks) was
/// computed and released, then evicted by prompt `b` (4 blocks, still running).
fn a_evicted_by_b(cpu: u64) -> (KvCache, Vec<StoredBlock>, Vec<StoredBlock>, Allocation) {
    let mut cache = KvCache::new(16, 4).with_cpu_tier(cpu);
    let a = chain(&[1, 2, 3]);
    let alloc = prefill(&mut cache, &a, 3);
    cache.release(alloc);
    cache.take_events();
    let b = chain(&[7, 8, 9, 10]);
    let b_alloc = cache.try_allocate(&b, 4).expect("a's blocks are evictable");
    (cache, a, b, b_alloc)
}

#[test]
fn a_gpu_eviction_offloads_the_chain_to_the_cpu_before_removing_it() {
    let (mut cache, a, _, _) = a_evicted_by_b(8);
    // Evicted from the chain's end, offloaded as one chain from the root, stored on
    // the CPU while the GPU still holds the parents.
    assert_eq!(
        cache.take_events(),
        vec![
            stored(StorageTier::Cpu, None, &a),
            removed(StorageTier::Gpu, &[&a[2], &a[1], &a[0]]),
        ]
    );
    assert_eq!(cache.cpu_blocks(), 3);
    assert!(a.iter().all(|b| cache.cpu_contains(b.block_hash)));
    assert!(a.iter().all(|b| !cache.contains(b.block_hash)));
}

#[test]
fn a_full_cpu_tier_evicts_its_least_recently_used_block() {
    let (mut cache, a, _, _) = a_evicted_by_b(2);
    // a2 then a1 enter the tier; a0 needs room and evicts a2, the oldest.
    assert_eq!(
        cache.take_events(),
        vec![
            stored(StorageTier::Cpu, Some(&a[0]), &a[1..]),
            removed(StorageTier::Cpu, &[&a[2]]),
            stored(StorageTier::Cpu, None, &a[..1]),
            removed(StorageTier::Gpu, &[&a[2], &a[1], &a[0]]),
        ]
    );
    assert_eq!(
        cache.cpu_lru_order(),
        vec![a[1].block_hash, a[0].block_hash]
    );
}

#[test]
fn a_prompt_continuing_in_the_cpu_tier_loads_it_back_and_keeps_the_copy() {
    let (mut cache, a, b, b_alloc) = a_evicted_by_b(8);
    let mut b_alloc = b_alloc;
    for blk in &b {
        cache.commit(&mut b_alloc, *blk, None);
    }
    cache.release(b_alloc);
    cache.take_events();
    // a plus one new block: a's 3 blocks come back from the CPU, the 4th is computed.
    let a_longer = chain(&[1, 2, 3, 4]);
    let alloc = cache.try_allocate(&a_longer, 4).expect("b is evictable");
    assert_eq!((alloc.hit_blocks(), alloc.loaded_blocks()), (0, 3));
    assert_eq!(alloc.held(), hashes(&a).as_slice());
    assert_eq!(alloc.reserved(), 1);
    assert_eq!(
        cache.take_events(),
        vec![
            stored(StorageTier::Cpu, None, &b),
            removed(StorageTier::Gpu, &[&b[3], &b[2], &b[1], &b[0]]),
            stored(StorageTier::Gpu, None, &a),
        ]
    );
    // The CPU keeps a (recently used: the root last) and now also holds b.
    assert_eq!(cache.cpu_blocks(), 7);
    let lru = cache.cpu_lru_order();
    assert_eq!(
        &lru[4..],
        &[a[2].block_hash, a[1].block_hash, a[0].block_hash]
    );
    // Evicting a from the GPU again only refreshes the CPU copies: no CPU event.
    cache.release(alloc);
    let c = chain(&[20, 21, 22, 23]);
    cache.try_allocate(&c, 4).expect("a is evictable");
    let events = cache.take_events();
    assert!(
        events.iter().all(|e| !matches!(
            e,
            KvCacheEventData::Stored {
                tier: StorageTier::Cpu,
                ..
            }
        )),
        "{events:?}"
    );
}

#[test]
fn offloaded_and_loaded_blocks_carry_their_tokens() {
    let mut cache = KvCache::new(2, 2).with_cpu_tier(4);
    let a = chain(&[1]);
    let mut alloc = cache.try_allocate(&a, 1).expect("fits");
    cache.commit(&mut alloc, a[0], Some(&[5, 6]));
    cache.release(alloc);
    let b = chain(&[2, 3]);
    let b_alloc = cache.try_allocate(&b, 2).expect("a is evictable");
    let tokens = cache.take_event_tokens();
    assert_eq!(
        tokens.get(&a[0].block_hash).map(|t| &t[..]),
        Some(&[5, 6][..])
    );
    cache.release(b_alloc);
    let again = cache.try_allocate(&a, 1).expect("fits");
    assert_eq!(again.loaded_blocks(), 1);
    assert_eq!(
        cache
            .take_event_tokens()
            .get(&a[0].block_hash)
            .map(|t| &t[..]),
        Some(&[5, 6][..])
    );
}

#[test]
fn clear_drops_the_cpu_tier_too() {
    let (mut cache, _, _, b_alloc) = a_evicted_by_b(8);
    cache.release(b_alloc);
    cache.clear().expect("idle");
    assert_eq!(cache.cpu_blocks(), 0);
}

#[test]
fn replayed_tier_events_always_equal_each_tiers_blocks() {
    let mut cache = KvCache::new(4, 20).with_cpu_tier(12);
    let events = random_workload(&mut cache, 11);
    let count = |want: StorageTier, removal: bool| {
        events
            .iter()
            .filter(|e| match e {
                KvCacheEventData::Stored { tier, .. } => !removal && *tier == want,
                KvCacheEventData::Removed { tier, .. } => removal && *tier == want,
                KvCacheEventData::Cleared => false,
            })
            .count()
    };
    assert!(count(StorageTier::Cpu, false) > 10, "workload must offload");
    assert!(
        count(StorageTier::Cpu, true) > 10,
        "workload must fill the cpu tier"
    );
}

#[test]
fn a_zero_block_cpu_tier_is_no_tier() {
    let plain = random_workload(&mut KvCache::new(4, 20), 11);
    let zero = random_workload(&mut KvCache::new(4, 20).with_cpu_tier(0), 11);
    assert_eq!(plain, zero);
    assert!(plain.iter().all(|e| match e {
        KvCacheEventData::Stored { tier, .. } | KvCacheEventData::Removed { tier, .. } =>
            *tier == StorageTier::Gpu,
        KvCacheEventData::Cleared => true,
    }));
}
