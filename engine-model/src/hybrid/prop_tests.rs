//! Property test of the hybrid cache: random workloads (shared prefixes, aligned
//! prompts, chunked prefills, aborts, clears) on random group shapes. After every
//! step, the KV events replayed into a multiset per group (what a group-aware router
//! keeps) equal the copies the cache holds, the vLLM-form stores name the same blocks
//! as the router-form ones, and the engine's hit on random prompts equals the rule
//! computed from the replayed state alone.

use crate::hybrid::{HybridConfig, WindowRetention, window_blocks};
use crate::kv_cache::chain_block_hashes;
use crate::{EngineCore, EngineModelConfig, EngineRequest, RejectReason, StepOutput, TimingModel};
use kv_events::{
    ExternalBlockHash, GroupId, KvCacheEventData, LocalBlockHash, RequestId, StoredBlock,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// Copies per hash, per group, as the events describe them.
#[derive(Debug, Default)]
struct GroupReplica {
    groups: HashMap<GroupId, HashMap<ExternalBlockHash, usize>>,
    /// Stores of a hash the group already held (copies).
    copies_stored: usize,
    /// Windowed removals of a hash the full group kept.
    group_scoped_removals: usize,
}

impl GroupReplica {
    fn held(&self, group: GroupId, hash: ExternalBlockHash) -> bool {
        self.groups
            .get(&group)
            .is_some_and(|g| g.contains_key(&hash))
    }

    fn apply(&mut self, events: &[KvCacheEventData], full: GroupId) {
        for event in events {
            match event {
                KvCacheEventData::Stored {
                    parent_hash,
                    blocks,
                    group,
                    ..
                } => {
                    let group = group.expect("a hybrid rank names every group").id;
                    if let Some(parent) = parent_hash {
                        assert!(
                            self.groups.values().any(|g| g.contains_key(parent)),
                            "parent {parent} held by no group"
                        );
                    }
                    for b in blocks {
                        let count = self
                            .groups
                            .entry(group)
                            .or_default()
                            .entry(b.block_hash)
                            .or_default();
                        self.copies_stored += usize::from(*count > 0);
                        *count += 1;
                    }
                }
                KvCacheEventData::Removed {
                    block_hashes,
                    group,
                    ..
                } => {
                    let group = group.expect("a hybrid rank names every group");
                    for h in block_hashes {
                        let held = self.groups.entry(group).or_default();
                        let count = held.get_mut(h).expect("removed a block the group holds");
                        *count -= 1;
                        if *count == 0 {
                            held.remove(h);
                        }
                        if group != full && self.held(full, *h) {
                            self.group_scoped_removals += 1;
                        }
                    }
                }
                KvCacheEventData::Cleared => self.groups.clear(),
            }
        }
    }

    /// The rule of the module docs, by brute force over every `L`.
    fn hit(&self, prompt: &[StoredBlock], tokens: u64, bs: u32, windowed: u32, w: usize) -> usize {
        let cap = ((tokens - 1) / u64::from(bs)) as usize;
        let full = GroupId(windowed);
        (0..=cap.min(prompt.len()))
            .rev()
            .find(|&l| {
                (0..l).all(|i| self.held(full, prompt[i].block_hash))
                    && (0..windowed).all(|g| {
                        (l.saturating_sub(w)..l)
                            .all(|i| self.held(GroupId(g), prompt[i].block_hash))
                    })
            })
            .unwrap_or(0)
    }
}

/// A random prompt: a prefix of one of a few stems, then fresh blocks.
fn prompt(rng: &mut StdRng, bs: u32, fresh: &mut u64) -> (Vec<LocalBlockHash>, u64) {
    let stem = rng.random_range(0..5u64);
    let blocks = rng.random_range(1..14u64);
    let keep = rng.random_range(0..=blocks);
    let mut hashes: Vec<LocalBlockHash> =
        (0..keep).map(|i| LocalBlockHash(stem * 1000 + i)).collect();
    for _ in keep..blocks {
        *fresh += 1;
        hashes.push(LocalBlockHash(*fresh));
    }
    let aligned = rng.random_bool(0.3);
    let tokens = if aligned {
        blocks * u64::from(bs)
    } else {
        (blocks - 1) * u64::from(bs) + rng.random_range(1..u64::from(bs))
    };
    (hashes, tokens)
}

fn chain(hashes: &[LocalBlockHash], tokens: u64, bs: u32) -> Vec<StoredBlock> {
    let full = (tokens / u64::from(bs)) as usize;
    chain_block_hashes(&hashes[..full.min(hashes.len())])
}

/// Checks one step's output against the replica and the cache.
fn check_step(core: &EngineCore, out: &StepOutput, replica: &mut GroupReplica, windowed: u32) {
    let full = GroupId(windowed);
    // The vLLM-form stores name, per group, exactly the router-form stored blocks.
    for g in 0..=windowed {
        let router: Vec<ExternalBlockHash> = out
            .kv_events
            .iter()
            .filter_map(|e| match e {
                KvCacheEventData::Stored { blocks, group, .. }
                    if group.map(|x| x.id) == Some(GroupId(g)) =>
                {
                    Some(blocks.iter().map(|b| b.block_hash))
                }
                _ => None,
            })
            .flatten()
            .collect();
        let vllm: Vec<ExternalBlockHash> = out
            .group_stores
            .iter()
            .filter(|s| s.group.id == GroupId(g))
            .flat_map(|s| s.stored.iter().map(|b| b.block_hash))
            .collect();
        assert_eq!(router, vllm, "group {g}");
    }
    replica.apply(&out.kv_events, full);
    let cache = core.cache().hybrid().expect("hybrid");
    let occupancy = cache.occupancy();
    assert!(occupancy.used() <= occupancy.capacity);
    for g in 0..=windowed as usize {
        let mut held: Vec<(ExternalBlockHash, usize)> = cache.group_blocks(g).collect();
        held.sort();
        let mut replayed: Vec<(ExternalBlockHash, usize)> = replica
            .groups
            .get(&GroupId(g as u32))
            .map(|m| m.iter().map(|(h, c)| (*h, *c)).collect())
            .unwrap_or_default();
        replayed.sort();
        assert_eq!(held, replayed, "group {g}");
    }
}

#[test]
fn events_replay_to_the_caches_copies_and_the_hit_is_the_rule() {
    let mut totals = (0, 0);
    for seed in 0..24u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let bs = 4;
        let windowed = rng.random_range(1..=3u32);
        let window = rng.random_range(2..14u32);
        let retention = if rng.random_bool(0.7) {
            WindowRetention::Tail
        } else {
            WindowRetention::All
        };
        let config = EngineModelConfig {
            block_size: bs,
            num_gpu_blocks: rng.random_range(100..220),
            max_num_seqs: 4,
            max_num_batched_tokens: rng.random_range(8..40),
        };
        let hybrid = HybridConfig {
            sliding_window_groups: windowed,
            sliding_window: window,
            sliding_window_retention: retention,
        };
        let mut core = EngineCore::new(config, TimingModel::default())
            .and_then(|c| c.with_hybrid(hybrid))
            .expect("valid");
        let w = window_blocks(window, bs) as usize;
        let mut replica = GroupReplica::default();
        let (mut fresh, mut next_id) = (1_000_000u64, 0u64);
        for _ in 0..400 {
            match rng.random_range(0..10) {
                0..=4 => {
                    let (block_hashes, prompt_tokens) = prompt(&mut rng, bs, &mut fresh);
                    next_id += 1;
                    let added = core.add_request(EngineRequest {
                        request_id: RequestId(next_id.to_string()),
                        block_hashes,
                        prompt_tokens,
                        max_tokens: rng.random_range(1..8),
                        token_ids: None,
                    });
                    assert!(matches!(
                        added,
                        Ok(()) | Err(RejectReason::ExceedsCapacity { .. })
                    ));
                }
                5 => {
                    let victim = RequestId(rng.random_range(0..=next_id).to_string());
                    core.abort(&victim);
                }
                6 if !core.has_work() => {
                    let events = core.clear().expect("idle");
                    replica.apply(&events, GroupId(windowed));
                }
                _ => {}
            }
            let out = core.step();
            check_step(&core, &out, &mut replica, windowed);
            for _ in 0..3 {
                let (hashes, tokens) = prompt(&mut rng, bs, &mut fresh);
                let probe = chain(&hashes, tokens, bs);
                let engine = core.cache().hit_blocks(&probe, tokens);
                assert_eq!(
                    engine,
                    replica.hit(&probe, tokens, bs, windowed, w),
                    "seed {seed}"
                );
            }
        }
        totals.0 += replica.copies_stored;
        totals.1 += replica.group_scoped_removals;
    }
    // The workloads did store copies and evict windowed blocks the full group kept.
    assert!(totals.0 > 0 && totals.1 > 0, "{totals:?}");
}
