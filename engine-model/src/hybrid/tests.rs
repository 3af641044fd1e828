//! The hybrid cache against the real vLLM 0.32 capture of issue 28 (a tiny Gemma 3:
//! 3 sliding-window groups of 128 tokens and one full group, block 32, 136 blocks):
//! the same request sequence must give the same `cached_tokens` and store the same
//! block positions in each group, with the same copies.

use crate::hybrid::{HybridConfig, WindowRetention};
use crate::kv_cache::chain_block_hashes;
use crate::{EngineCore, EngineModelConfig, EngineRequest, StepOutput, TimingModel};
use kv_events::{
    ExternalBlockHash, GroupId, KvCacheEventData, KvCacheGroup, LocalBlockHash, StoredBlock,
};

const BS: u32 = 32;

/// A hybrid core shaped like the capture's vLLM.
pub(super) fn capture_core(retention: WindowRetention) -> EngineCore {
    let config = EngineModelConfig {
        block_size: BS,
        num_gpu_blocks: 136,
        max_num_seqs: 8,
        max_num_batched_tokens: 8192,
    };
    EngineCore::new(config, TimingModel::default())
        .and_then(|c| {
            c.with_hybrid(HybridConfig {
                sliding_window_retention: retention,
                ..HybridConfig::sliding(3, 128)
            })
        })
        .expect("valid config")
}

/// A prompt: one local hash per block (the last may be partial) and its length.
#[derive(Debug, Clone)]
pub(super) struct Prompt {
    pub hashes: Vec<u64>,
    pub tokens: u64,
}

impl Prompt {
    /// `tokens` tokens whose blocks are `first, first + 1, …`.
    pub fn fresh(first: u64, tokens: u64) -> Self {
        let blocks = tokens.div_ceil(u64::from(BS));
        Self {
            hashes: (first..first + blocks).collect(),
            tokens,
        }
    }

    /// This prompt's first `keep` full blocks, then fresh blocks from `first` up to
    /// `tokens` tokens.
    pub fn branch(&self, keep: usize, first: u64, tokens: u64) -> Self {
        let blocks = tokens.div_ceil(u64::from(BS)) as usize;
        let mut hashes = self.hashes[..keep].to_vec();
        hashes.extend(first..first + (blocks - keep) as u64);
        Self { hashes, tokens }
    }

    /// The chained engine hashes of its full blocks.
    pub fn chain(&self) -> Vec<StoredBlock> {
        let full = (self.tokens / u64::from(BS)) as usize;
        let locals: Vec<LocalBlockHash> = self.hashes[..full.min(self.hashes.len())]
            .iter()
            .map(|&h| LocalBlockHash(h))
            .collect();
        chain_block_hashes(&locals)
    }
}

/// Runs `prompt` alone (one output token) to completion: its cached tokens and the
/// steps' outputs.
pub(super) fn serve(core: &mut EngineCore, id: &str, prompt: &Prompt) -> (u64, Vec<StepOutput>) {
    core.add_request(EngineRequest {
        request_id: id.into(),
        block_hashes: prompt.hashes.iter().map(|&h| LocalBlockHash(h)).collect(),
        prompt_tokens: prompt.tokens,
        max_tokens: 1,
        token_ids: None,
    })
    .expect("accepted");
    let mut outs = Vec::new();
    while core.has_work() {
        outs.push(core.step());
    }
    let cached = outs
        .iter()
        .flat_map(|o| &o.first_tokens)
        .map(|f| f.cached_tokens)
        .next()
        .expect("first token");
    (cached, outs)
}

/// Per group id: the (parent, blocks) of every `Stored` in `outs`, in order.
fn stores(
    outs: &[StepOutput],
    group: u32,
) -> Vec<(Option<ExternalBlockHash>, Vec<ExternalBlockHash>)> {
    outs.iter()
        .flat_map(|o| &o.kv_events)
        .filter_map(|e| match e {
            KvCacheEventData::Stored {
                parent_hash,
                blocks,
                group: Some(g),
                ..
            } if g.id == GroupId(group) => {
                Some((*parent_hash, blocks.iter().map(|b| b.block_hash).collect()))
            }
            _ => None,
        })
        .collect()
}

fn hashes(chain: &[StoredBlock], positions: std::ops::Range<usize>) -> Vec<ExternalBlockHash> {
    chain[positions].iter().map(|b| b.block_hash).collect()
}

#[test]
fn the_captures_requests_get_vllms_cached_tokens_stores_and_copies() {
    let mut core = capture_core(WindowRetention::Tail);
    let a = Prompt::fresh(1000, 357);
    let b = a.branch(8, 2000, 377);
    let c = Prompt::fresh(3000, 320);
    let d = a.branch(9, 4000, 370);
    let (ac, bc, cc, dc) = (a.chain(), b.chain(), c.chain(), d.chain());
    let windowed = |g: u32| KvCacheGroup::windowed(g, 4).unwrap();

    // A: 11 full blocks; every window keeps only 7..10 (the window before block 11).
    let (cached, outs) = serve(&mut core, "A", &a);
    assert_eq!(cached, 0);
    assert_eq!(stores(&outs, 3), vec![(None, hashes(&ac, 0..11))]);
    for g in 0..3 {
        assert_eq!(
            stores(&outs, g),
            vec![(Some(ac[6].block_hash), hashes(&ac, 7..11))]
        );
    }
    // The full group's store comes first, so a windowed run's parent is held.
    let first = &outs[0].kv_events[0];
    assert!(matches!(first, KvCacheEventData::Stored { group: Some(g), .. } if g.is_full()));
    let vllm = &outs[0].group_stores;
    assert_eq!(vllm.len(), 4);
    assert_eq!(vllm[0].group, windowed(0));
    assert_eq!((vllm[0].parent_hash, vllm[0].range.len()), (None, 11));
    assert_eq!(vllm[0].stored, ac[7..11].to_vec());
    assert_eq!(vllm[3].group, KvCacheGroup::full(3));
    assert_eq!(vllm[3].stored, ac);

    // B shares 8 blocks, but no window holds 4..7: a miss; it recomputes and stores
    // the prefix again in the full group (copies), and the junction's window 4..7
    // plus its own tail 7..10 in the windows (7 a second copy: B's 7 is A's 7).
    let (cached, outs) = serve(&mut core, "B", &b);
    assert_eq!(cached, 0);
    assert_eq!(stores(&outs, 3), vec![(None, hashes(&bc, 0..11))]);
    assert_eq!(
        stores(&outs, 0),
        vec![(Some(bc[3].block_hash), hashes(&bc, 4..11))]
    );
    let hybrid = core.cache().hybrid().expect("hybrid");
    assert_eq!(hybrid.copies(3, ac[0].block_hash), 2);
    assert_eq!(hybrid.copies(3, ac[8].block_hash), 1);
    assert_eq!(hybrid.copies(1, ac[7].block_hash), 2);

    // Repeats hit everything but the partial last block and store nothing.
    for (id, p) in [("A repeat", &a), ("B repeat", &b)] {
        let (cached, outs) = serve(&mut core, id, p);
        assert_eq!(cached, 352, "{id}");
        assert!(
            outs.iter()
                .all(|o| o.kv_events.is_empty() && o.group_stores.is_empty())
        );
    }

    // C is block-aligned: its windows keep 5..8 (block 9 can never be hit), and each
    // repeat recomputes block 9 and stores it again in the full group only, with
    // empty stores in the windows.
    let (cached, outs) = serve(&mut core, "C", &c);
    assert_eq!(cached, 0);
    assert_eq!(
        stores(&outs, 2),
        vec![(Some(cc[4].block_hash), hashes(&cc, 5..9))]
    );
    for n in 1..=2 {
        let (cached, outs) = serve(&mut core, "C repeat", &c);
        assert_eq!(cached, 288);
        assert_eq!(
            stores(&outs, 3),
            vec![(Some(cc[8].block_hash), hashes(&cc, 9..10))]
        );
        assert_eq!(stores(&outs, 0), vec![(None, vec![])]);
        let hybrid = core.cache().hybrid().expect("hybrid");
        assert_eq!(hybrid.copies(3, cc[9].block_hash), 1 + n);
        let window = &outs[0].group_stores[0];
        assert_eq!(
            (window.parent_hash, window.range.len()),
            (Some(cc[8].block_hash), 1)
        );
        assert!(window.stored.is_empty());
    }

    // D shares 9 blocks with A: the window 5..8 before them is held (5, 6 from B's
    // junction, 7, 8 from A), so it hits 288 and stores 9, 10 in every group.
    let (cached, outs) = serve(&mut core, "D", &d);
    assert_eq!(cached, 288);
    for g in 0..4 {
        assert_eq!(
            stores(&outs, g),
            vec![(Some(ac[8].block_hash), hashes(&dc, 9..11))]
        );
    }

    // Twelve long prompts evict everything, each group on its own.
    let mut windowed_removals = 0;
    for i in 0..12u64 {
        let e = Prompt::fresh(10_000 + 100 * i, 900 + 7 * i);
        let (cached, outs) = serve(&mut core, &format!("E{i}"), &e);
        assert_eq!(cached, 0);
        windowed_removals += outs
            .iter()
            .flat_map(|o| &o.kv_events)
            .filter(|e| matches!(e, KvCacheEventData::Removed { group: Some(g), .. } if g.0 < 3))
            .count();
    }
    assert!(windowed_removals > 0);
    assert_eq!(
        core.cache()
            .hybrid()
            .expect("hybrid")
            .copies(3, ac[0].block_hash),
        0
    );
    let (a_again, _) = serve(&mut core, "A after eviction", &a);
    let (b_again, _) = serve(&mut core, "B after eviction", &b);
    let (a_repeat, _) = serve(&mut core, "A repeat after eviction", &a);
    assert_eq!((a_again, b_again, a_repeat), (0, 0, 352));
}

#[test]
fn dense_retention_keeps_every_block_so_a_shared_prefix_hits() {
    let mut core = capture_core(WindowRetention::All);
    let a = Prompt::fresh(1000, 357);
    let b = a.branch(8, 2000, 377);
    let (_, outs) = serve(&mut core, "A", &a);
    for g in 0..3 {
        assert_eq!(stores(&outs, g), vec![(None, hashes(&a.chain(), 0..11))]);
    }
    assert_eq!(serve(&mut core, "B", &b).0, 256);
    let c = Prompt::fresh(3000, 320);
    serve(&mut core, "C", &c);
    serve(&mut core, "C repeat", &c);
    // The aligned repeat duplicates its last block in every group.
    let hybrid = core.cache().hybrid().expect("hybrid");
    for g in 0..4 {
        assert_eq!(hybrid.copies(g, c.chain()[9].block_hash), 2, "group {g}");
    }
}

#[test]
fn a_hybrid_core_refuses_a_cpu_tier_and_requests_it_cannot_ever_hold() {
    let core = capture_core(WindowRetention::Tail);
    let tier = crate::CpuTierConfig {
        cpu_tier_blocks: 4,
        ..crate::CpuTierConfig::default()
    };
    assert_eq!(
        core.with_cpu_tier(tier).err(),
        Some(crate::ModelConfigError::HybridWithCpuTier)
    );
    // The largest request: 34 blocks, a quarter of the pool (4 groups).
    let hybrid = HybridConfig::sliding(3, 128);
    let model = *capture_core(WindowRetention::Tail).config();
    assert_eq!(hybrid.max_request_blocks(&model), 34);
    let mut fits = capture_core(WindowRetention::Tail);
    let request = |blocks: u64| EngineRequest {
        request_id: blocks.to_string().into(),
        block_hashes: Vec::new(),
        prompt_tokens: blocks * u64::from(BS) - 1,
        max_tokens: 1,
        token_ids: None,
    };
    assert_eq!(fits.add_request(request(34)), Ok(()));
    assert!(fits.add_request(request(35)).is_err());
    // With steps of 64 tokens, long prompts need one step's working set per window.
    let short_steps = EngineModelConfig {
        max_num_batched_tokens: 64,
        max_num_seqs: 8,
        ..model
    };
    // chunk 3 + window 4 = 7 blocks per window: 136 − 3 × 7.
    assert_eq!(hybrid.max_request_blocks(&short_steps), 115);
    let mut fits = EngineCore::new(short_steps, TimingModel::default())
        .and_then(|c| c.with_hybrid(hybrid))
        .expect("valid");
    assert_eq!(fits.add_request(request(115)), Ok(()));
    assert!(fits.add_request(request(116)).is_err());
    let mut core = capture_core(WindowRetention::Tail);
    // 40 blocks fit the full group (136), not 4 × 40 during the prefill.
    let refused = core.add_request(EngineRequest {
        request_id: "long".into(),
        block_hashes: Vec::new(),
        prompt_tokens: 40 * u64::from(BS) - 1,
        max_tokens: 1,
        token_ids: None,
    });
    assert_eq!(
        refused,
        Err(crate::RejectReason::ExceedsCapacity {
            needed: 160,
            capacity: 136
        })
    );
}
