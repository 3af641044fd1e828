use super::*;
use crate::test_support::{EventReplica, sorted};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub(super) fn chain(ids: &[u64]) -> Vec<StoredBlock> {
    let locals: Vec<_> = ids.iter().map(|&i| LocalBlockHash(i)).collect();
    chain_block_hashes(&locals)
}

pub(super) fn hashes(blocks: &[StoredBlock]) -> Vec<ExternalBlockHash> {
    blocks.iter().map(|b| b.block_hash).collect()
}

/// Allocates and commits every prompt block, like a finished prefill.
pub(super) fn prefill(cache: &mut KvCache, prompt: &[StoredBlock], total: u64) -> Allocation {
    let mut alloc = cache.try_allocate(prompt, total).expect("fits");
    for b in &prompt[alloc.held().len()..] {
        cache.commit(&mut alloc, *b, None);
    }
    alloc
}

#[test]
fn engine_hash_chains_over_the_parent() {
    let a = chain(&[1, 2, 3]);
    let b = chain(&[9, 2, 3]);
    assert_eq!(a[0].block_hash, engine_block_hash(None, LocalBlockHash(1)));
    assert_eq!(
        a[1].block_hash,
        engine_block_hash(Some(a[0].block_hash), LocalBlockHash(2))
    );
    // Same tokens at position 1, different prefix: different engine hash.
    assert_ne!(a[1].block_hash, b[1].block_hash);
    assert_eq!(a[1].tokens_hash, b[1].tokens_hash);
    // Deterministic and pinned to xxh3 over the LE bytes of (parent, local).
    let expected = xxh3_reference(&[a[0].block_hash.0, 2]);
    assert_eq!(a[1].block_hash.0, expected);
    assert_eq!(a[0].block_hash.0, xxh3_reference(&[1]));
}

fn xxh3_reference(words: &[u64]) -> u64 {
    // hash_block over u32 words == xxh3 over the same bytes; rebuild the words from the
    // u64s' little-endian bytes to check the documented byte layout independently.
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let as_u32: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    kv_events::hash_block(&as_u32).0
}

#[test]
fn committed_blocks_are_stored_as_one_chain() {
    let mut cache = KvCache::new(16, 10);
    let prompt = chain(&[1, 2, 3]);
    let alloc = prefill(&mut cache, &prompt, 4);
    assert_eq!(alloc.hit_blocks(), 0);
    assert_eq!(alloc.held(), hashes(&prompt).as_slice());
    assert_eq!(alloc.reserved(), 1);
    assert_eq!(cache.used_blocks(), 4);
    assert_eq!(
        cache.take_events(),
        vec![KvCacheEventData::Stored {
            group: None,
            parent_hash: None,
            blocks: prompt.clone(),
            tier: kv_events::StorageTier::Gpu
        }]
    );
    cache.release(alloc);
    assert_eq!(cache.used_blocks(), 3);
    assert_eq!(cache.evictable_blocks(), 3);
    assert!(cache.take_events().is_empty(), "release announces nothing");
}

#[test]
fn shared_prefix_is_a_hit_and_only_new_blocks_are_stored() {
    let mut cache = KvCache::new(16, 20);
    let first = chain(&[1, 2, 3]);
    let a = prefill(&mut cache, &first, 3);
    cache.take_events();

    let second = chain(&[1, 2, 7, 8]);
    let b = prefill(&mut cache, &second, 5);
    assert_eq!(b.hit_blocks(), 2);
    assert_eq!(
        cache.take_events(),
        vec![KvCacheEventData::Stored {
            group: None,
            parent_hash: Some(first[1].block_hash),
            blocks: second[2..].to_vec(),
            tier: kv_events::StorageTier::Gpu
        }]
    );
    // Shared blocks are counted once: 3 + 2 new cached + 1 reserved.
    assert_eq!(cache.used_blocks(), 6);
    cache.release(a);
    cache.release(b);
    assert_eq!(cache.used_blocks(), 5);
}

#[test]
fn eviction_is_lru_and_never_touches_referenced_blocks() {
    let mut cache = KvCache::new(16, 6);
    let old = chain(&[1, 2]);
    let newer = chain(&[3, 4]);
    let pinned = chain(&[5, 6]);
    let a = prefill(&mut cache, &old, 2);
    cache.release(a);
    let b = prefill(&mut cache, &newer, 2);
    cache.release(b);
    let pinned_alloc = prefill(&mut cache, &pinned, 2);
    cache.take_events();
    assert_eq!(cache.free_blocks(), 0);
    // Released tail-first: a chain is evicted from its end towards its root.
    assert_eq!(
        cache.lru_order().collect::<Vec<_>>(),
        vec![
            old[1].block_hash,
            old[0].block_hash,
            newer[1].block_hash,
            newer[0].block_hash
        ]
    );

    // Needs 3 blocks: evicts the whole older chain and the newer chain's tail.
    let fresh = cache
        .try_allocate(&chain(&[7]), 3)
        .expect("fits after eviction");
    assert_eq!(
        cache.take_events(),
        vec![KvCacheEventData::Removed {
            group: None,
            block_hashes: vec![old[1].block_hash, old[0].block_hash, newer[1].block_hash],
            tier: kv_events::StorageTier::Gpu
        }]
    );
    assert!(cache.contains(newer[0].block_hash));
    assert!(hashes(&pinned).iter().all(|h| cache.contains(*h)));

    // Only one unreferenced block is left: a 2-block request cannot fit, and the refusal
    // changes nothing.
    assert_eq!(cache.try_allocate(&chain(&[8]), 2), None);
    assert!(cache.take_events().is_empty());
    assert!(cache.contains(newer[0].block_hash));
    cache.release(fresh);
    cache.release(pinned_alloc);
}

#[test]
fn a_hit_on_an_unreferenced_block_protects_it_from_its_own_eviction() {
    let mut cache = KvCache::new(16, 3);
    let prompt = chain(&[1, 2]);
    let a = prefill(&mut cache, &prompt, 2);
    cache.release(a);
    cache.take_events();
    // 2 hits + 1 more block: exactly fits without evicting the hits.
    let b = cache.try_allocate(&prompt, 3).expect("fits");
    assert_eq!(b.hit_blocks(), 2);
    assert!(cache.take_events().is_empty());
    // 2 hits + 2 more would need to evict a block this request references: refused.
    cache.release(b);
    assert_eq!(cache.try_allocate(&prompt, 4), None);
}

#[test]
fn committing_a_block_cached_meanwhile_reuses_it_silently() {
    let mut cache = KvCache::new(16, 10);
    let prompt = chain(&[1, 2]);
    let mut a = cache.try_allocate(&prompt, 2).expect("fits");
    let mut b = cache.try_allocate(&prompt, 2).expect("fits");
    assert_eq!(cache.used_blocks(), 4);
    for blk in &prompt {
        cache.commit(&mut a, *blk, None);
    }
    for blk in &prompt {
        cache.commit(&mut b, *blk, None);
    }
    // One Stored event; b's reservation was returned.
    assert_eq!(cache.take_events().len(), 1);
    assert_eq!(cache.used_blocks(), 2);
    cache.release(a);
    assert_eq!(cache.evictable_blocks(), 0, "b still references both");
    cache.release(b);
    assert_eq!(cache.evictable_blocks(), 2);
}

#[test]
fn clear_requires_an_idle_cache() {
    let mut cache = KvCache::new(16, 10);
    let prompt = chain(&[1, 2]);
    let a = prefill(&mut cache, &prompt, 3);
    assert_eq!(
        cache.clear(),
        Err(CacheInUse {
            referenced: 2,
            reserved: 1
        })
    );
    cache.release(a);
    cache.take_events();
    assert_eq!(cache.clear(), Ok(()));
    assert_eq!(cache.take_events(), vec![KvCacheEventData::Cleared]);
    assert_eq!(cache.used_blocks(), 0);
    assert_eq!(
        cache.try_allocate(&prompt, 2).map(|a| a.hit_blocks()),
        Some(0)
    );
}

#[test]
fn replayed_events_always_equal_the_cached_blocks() {
    let events = random_workload(&mut KvCache::new(4, 40), 7);
    let evictions = events
        .iter()
        .filter(|e| matches!(e, KvCacheEventData::Removed { .. }))
        .count();
    assert!(
        evictions > 10,
        "workload must exercise eviction ({evictions})"
    );
}

/// Runs 2,000 random admissions, commits, releases and clears on `cache` (seeded by
/// `seed`), checking after each that replaying the events gives exactly the blocks of
/// each tier and that no tier is over capacity; returns every event, in order.
pub(super) fn random_workload(cache: &mut KvCache, seed: u64) -> Vec<KvCacheEventData> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut replica = EventReplica::default();
    let mut all = Vec::new();
    let mut live: Vec<(Vec<StoredBlock>, Allocation)> = Vec::new();
    for _ in 0..2_000 {
        match rng.random_range(0..10) {
            0..=4 => {
                // Prompts from a small tree of prefixes so hits and sharing are common.
                let len = rng.random_range(1..8);
                let ids: Vec<u64> = (0..len).map(|_| rng.random_range(0..3)).collect();
                let prompt = chain(&ids);
                let total = len as u64 + rng.random_range(0..4);
                if let Some(alloc) = cache.try_allocate(&prompt, total) {
                    live.push((prompt, alloc));
                }
            }
            5..=7 if !live.is_empty() => {
                // Commit a few more prompt blocks of a random live request.
                let i = rng.random_range(0..live.len());
                let (prompt, alloc) = &mut live[i];
                let n = rng.random_range(1..3);
                for _ in 0..n {
                    let next = alloc.held().len();
                    if next < prompt.len() {
                        cache.commit(alloc, prompt[next], None);
                    }
                }
            }
            8 if !live.is_empty() => {
                let i = rng.random_range(0..live.len());
                let (_, alloc) = live.swap_remove(i);
                cache.release(alloc);
            }
            9 if live.is_empty() => {
                cache.clear().expect("idle");
            }
            _ => {}
        }
        let events = cache.take_events();
        replica.apply(&events);
        all.extend(events);
        assert_eq!(replica.sorted(), sorted(cache.cached_hashes()));
        assert_eq!(
            replica.sorted_cpu(),
            sorted(cache.cpu_lru_order().into_iter())
        );
        assert!(cache.cpu_blocks() <= cache.cpu_capacity());
        let reserved: u64 = live.iter().map(|(_, a)| a.reserved()).sum();
        assert_eq!(cache.used_blocks(), cache.cached_blocks() + reserved);
        assert!(cache.used_blocks() <= cache.capacity());
    }
    all
}
