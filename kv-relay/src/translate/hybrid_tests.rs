//! Hybrid-attention models, shaped like the real vLLM 0.32 capture of a Gemma 3
//! (3 sliding-window groups of window 128, 1 full-attention group, block 32; see
//! `kv-events/tests/fixtures/engines/README.md`).

use super::*;

/// Block size and window of the capture.
const CAPTURE_BS: u32 = 32;
const WINDOW: u64 = 128;
/// `cdiv(128 − 1, 32)`.
const WINDOW_BLOCKS: u32 = 4;
const FULL: u32 = 3;

/// The capture's chain of prompt A: 11 full blocks, hashes 100..=110.
fn chain_a() -> Vec<u64> {
    (100..=110).collect()
}

fn tokens_32(hashes: &[u64]) -> Vec<u32> {
    hashes
        .iter()
        .flat_map(|h| (0..CAPTURE_BS).map(move |i| *h as u32 * 100 + i))
        .collect()
}

/// A `BlockStored` of group `group` as vLLM 0.32 publishes it: `hashes` named,
/// `token_ids` of the blocks `tokens` (the whole new chain), a parent.
fn vllm_stored(group: u32, hashes: &[u64], parent: Option<u64>, tokens: &[u64]) -> EngineEvent {
    let sliding = group != FULL;
    event(BlockStored {
        block_hashes: hashes.iter().copied().map(ExternalBlockHash).collect(),
        parent_block_hash: parent.map(ExternalBlockHash),
        token_ids: tokens_32(tokens),
        block_size: CAPTURE_BS,
        medium: Some("GPU".into()),
        group_idx: Some(group),
        kv_cache_spec_kind: Some(
            if sliding {
                "sliding_window"
            } else {
                "full_attention"
            }
            .into(),
        ),
        kv_cache_spec_sliding_window: sliding.then_some(WINDOW),
        ..BlockStored::default()
    })
}

/// One vLLM step storing a new chain `tokens` (from `parent`): the sliding groups'
/// (sparse) stores of `sliding` first, then the full group's dense store.
fn vllm_step(sliding: &[u64], parent: Option<u64>, tokens: &[u64]) -> Vec<EngineEvent> {
    let mut events: Vec<_> = (0..FULL)
        .map(|g| vllm_stored(g, sliding, parent, tokens))
        .collect();
    events.push(vllm_stored(FULL, tokens, parent, tokens));
    events
}

fn capture_translator() -> Translator {
    let mut t = Translator::new(EngineFormat::Auto);
    t.learn_block_size(CAPTURE_BS);
    t
}

/// (group id, window, parent, block hashes) of every published `Stored`.
type StoredShape = (Option<u32>, Option<u32>, Option<u64>, Vec<u64>);

fn shapes(outcomes: &[Outcome]) -> Vec<StoredShape> {
    outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().ok())
        .flatten()
        .filter_map(|data| match data {
            KvCacheEventData::Stored {
                parent_hash,
                blocks,
                group,
                ..
            } => Some((
                group.map(|g| g.id.0),
                group.and_then(|g| g.window_blocks).map(|w| w.get()),
                parent_hash.map(|h| h.0),
                blocks.iter().map(|b| b.block_hash.0).collect(),
            )),
            _ => None,
        })
        .collect()
}

fn refusals(outcomes: &[Outcome]) -> Vec<&'static str> {
    outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().err())
        .map(Skip::label)
        .collect()
}

#[test]
fn sparse_sliding_stores_are_placed_through_the_full_groups_chain() {
    let mut t = capture_translator();
    let a = chain_a();
    // Prompt A: the sliding groups keep positions 7–10 (4 hashes, parent null,
    // 352 token ids), published before the full group's 11 blocks.
    let out = t.apply_batch(R, &vllm_step(&a[7..], None, &a));
    assert_eq!(
        out.iter().map(|o| o.index).collect::<Vec<_>>(),
        vec![3, 0, 1, 2],
        "the full group's store is applied first"
    );
    assert_eq!(refusals(&out), Vec::<&str>::new());
    let w = Some(WINDOW_BLOCKS);
    assert_eq!(
        shapes(&out),
        vec![
            (Some(FULL), None, None, a.clone()),
            (Some(0), w, Some(106), a[7..].to_vec()),
            (Some(1), w, Some(106), a[7..].to_vec()),
            (Some(2), w, Some(106), a[7..].to_vec()),
        ]
    );
    // The sparse blocks carry the full group's local hashes of the same blocks.
    let blocks_of = |o: &Outcome| match &o.result.as_ref().unwrap()[0] {
        KvCacheEventData::Stored { blocks, .. } => blocks.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(blocks_of(&out[1])[..], blocks_of(&out[0])[7..]);
    // Prompt B (shares 8 blocks with A): the engine recomputes, re-stores the
    // shared prefix in the full group (copies) and keeps 4–10 of B's chain in the
    // sliding groups: one run from position 4, below A's position 3.
    let b: Vec<u64> = a[..8].iter().copied().chain(208..=210).collect();
    let out = t.apply_batch(R, &vllm_step(&b[4..], None, &b));
    assert_eq!(refusals(&out), Vec::<&str>::new());
    assert_eq!(shapes(&out)[0], (Some(FULL), None, None, b.clone()));
    assert_eq!(shapes(&out)[1], (Some(0), w, Some(103), b[4..].to_vec()));
    // Positions that are not consecutive become one `Stored` per run.
    let out = t.apply_batch(R, &[vllm_stored(0, &[101, 102, 105, 106], None, &a)]);
    assert_eq!(
        shapes(&out),
        vec![
            (Some(0), w, Some(100), vec![101, 102]),
            (Some(0), w, Some(104), vec![105, 106]),
        ]
    );
}

#[test]
fn empty_sliding_stores_make_the_group_known_once() {
    let mut t = capture_translator();
    // Prompt C (10 blocks, aligned): sliding groups keep 5–8; each repeat stores
    // the last block again in the full group and nothing in the sliding groups.
    let c: Vec<u64> = (300..310).collect();
    assert_eq!(
        refusals(&t.apply_batch(R, &vllm_step(&c[5..9], None, &c))),
        Vec::<&str>::new()
    );
    let mut fresh = capture_translator();
    fresh.apply_batch(R, &[vllm_stored(FULL, &c, None, &c)]);
    let repeat = vllm_step(&[], Some(308), &c[9..]);
    for (t, first) in [(&mut fresh, true), (&mut t, false)] {
        let out = t.apply_batch(R, &repeat);
        // The full group's copy of position 9 is published every time.
        assert_eq!(shapes(&out)[0], (Some(FULL), None, Some(308), vec![309]));
        if first {
            // Sliding groups never seen on this rank: announced, with no blocks.
            assert_eq!(
                shapes(&out)[1..],
                [0, 1, 2].map(|g| (Some(g), Some(WINDOW_BLOCKS), None, vec![]))
            );
        } else {
            assert_eq!(refusals(&out), vec!["no_change"; 3]);
        }
    }
}

#[test]
fn within_a_batch_removals_keep_their_place() {
    let mut t = capture_translator();
    let a = chain_a();
    t.apply_batch(R, &vllm_step(&a[7..], None, &a));
    let mut batch = vec![removed(&[110], "GPU", Some(0))];
    batch.extend(vllm_step(&a[7..], None, &a));
    batch.push(removed(&[110], "GPU", Some(0)));
    let out = t.apply_batch(R, &batch);
    let order: Vec<usize> = out.iter().map(|o| o.index).collect();
    assert_eq!(order, vec![0, 4, 1, 2, 3, 5]);
    assert_eq!(refusals(&out), Vec::<&str>::new());
}

#[test]
fn sparse_blocks_the_rank_does_not_hold_are_refused_as_unplaced() {
    let mut t = capture_translator();
    let a = chain_a();
    let out = t.apply_batch(R, &[vllm_stored(0, &a[7..], None, &a)]);
    assert_eq!(refusals(&out), vec!["unplaced"]);
    assert_eq!(t.held(R), 0);
}

#[test]
fn kinds_not_indexed_are_refused_with_their_removals_and_windows_are_fixed() {
    let mut t = translator(EngineFormat::Auto);
    let with_kind = |group, kind: &str, window: Option<u64>| {
        let mut e = stored(&[10], None, "GPU", group);
        if let EngineEvent::BlockStored(s, _) = &mut e {
            s.kv_cache_spec_kind = Some(kind.into());
            s.kv_cache_spec_sliding_window = window;
        }
        e
    };
    let chunked = t
        .apply(R, &with_kind(1, "chunked_local_attention", None))
        .unwrap_err();
    assert_eq!(chunked.label(), "unsupported_group");
    assert_eq!(
        t.apply(R, &removed(&[10], "GPU", Some(1)))
            .unwrap_err()
            .label(),
        "unsupported_group",
        "a removal of that group too"
    );
    // Mamba: the state at the hit point, a window of one block.
    let mamba = one(t.apply(R, &with_kind(2, "mamba", None)));
    assert!(matches!(
        mamba,
        KvCacheEventData::Stored { group: Some(g), .. } if g == KvCacheGroup::windowed(2, 1).unwrap()
    ));
    // Group 2's window is fixed by its first store.
    assert_eq!(
        t.apply(R, &with_kind(2, "sliding_window", Some(9)))
            .unwrap_err()
            .label(),
        "group_conflict"
    );
    // At most MAX_GROUPS groups per rank.
    for g in 3..holdings::MAX_GROUPS as u32 + 2 {
        let _ = t.apply(R, &stored(&[10], None, "GPU", g));
    }
    assert_eq!(
        t.apply(R, &stored(&[10], None, "GPU", 1000)),
        Err(Skip::TooManyGroups(holdings::MAX_GROUPS))
    );
}

#[test]
fn dense_windowed_stores_keep_their_own_parent_and_local_hashes() {
    let mut t = translator(EngineFormat::Auto);
    let mut dense = stored(&[10, 11], None, "GPU", 0);
    if let EngineEvent::BlockStored(s, _) = &mut dense {
        s.kv_cache_spec_kind = Some("sliding_window".into());
        s.kv_cache_spec_sliding_window = Some(5);
    }
    let out = one(t.apply(R, &dense));
    let KvCacheEventData::Stored { blocks, group, .. } = out else {
        panic!("{out:?}")
    };
    assert_eq!(group, KvCacheGroup::windowed(0, 2), "cdiv(5 − 1, 2)");
    assert_eq!(blocks[1].tokens_hash, local(11));
}
