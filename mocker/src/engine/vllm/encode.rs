//! vLLM 0.33's KV event payload, byte for byte: the msgpack `KVEventBatch` that
//! `vllm.distributed.kv_events.ZmqEventPublisher` sends as the third ZMQ frame.
//!
//! ```text
//! batch            = [ts: float64, [event, …], data_parallel_rank: int]
//! BlockStored      = map16 {"type", "block_hashes", "parent_block_hash", "token_ids",
//!                           "block_size", "lora_id", "medium", "lora_name", "group_idx"}
//! BlockRemoved     = fixmap {"type", "block_hashes", "medium", "group_idx"}
//! AllBlocksCleared = fixmap {"type"}
//! ```
//!
//! Keys come in vLLM's field order; `extra_keys` is omitted (nil: no LoRA, salt or
//! multimodal input), `lora_id` and `lora_name` are nil, `medium` is the block's tier
//! as vLLM names it (`"GPU"`; `"CPU"` for the CPU tier, as vLLM's offloading connector
//! publishes it, [`medium`]) and `group_idx` 0 (one KV cache group). Unlike vLLM
//! releases whose connector sends CPU `BlockStored` events without tokens, the mock
//! sends each offloaded block's tokens and parent, so a relay can hash them. Integers take msgpack's smallest form, as
//! msgspec writes them (block hashes ≥ 2^32 as `uint 64`). msgspec reserves a `map16`
//! header for `BlockStored` (a struct with more than 15 fields, most omitted), which
//! is reproduced so that a payload equals the captured one byte for byte (checked in
//! the golden tests against `kv-events/tests/fixtures/engines/`).
//!
//! A hybrid-attention rank (sliding-window groups, `engine_model::hybrid`) publishes
//! as vLLM 0.32 does with its hybrid KV cache manager (checked byte for byte against
//! a real capture of a Gemma 3 in `vllm/testdata/`): one `BlockStored` per KV cache
//! group per request and step, the sliding-window groups first and the full group
//! last, each a fixmap ending in `group_idx`, `kv_cache_spec_kind`
//! (`"sliding_window"` or `"full_attention"`) and, on sliding-window groups,
//! `kv_cache_spec_sliding_window` (tokens), with `extra_keys` (one nil per hash)
//! before them on a store with hashes. A sliding-window group's store is sparse: it
//! names only the blocks the group keeps (possibly none), while `parent_block_hash`
//! and `token_ids` describe the request's whole range of new blocks, as the full
//! group's do ([`to_vllm_hybrid`]). Each eviction is a `BlockRemoved` of one hash
//! with its `group_idx`, and a batch's removals come before its stores.
//!
//! Cost: one buffer per batch, sized by its token ids (≤ 3 bytes per token).

use engine_model::GroupStore;
use kv_events::{DpRank, ExternalBlockHash, KvCacheEventData, StorageTier};
use rmp::encode::{self as mp, ByteBuf, RmpWrite, ValueWriteError};
use std::collections::HashMap;
use std::convert::Infallible;

/// vLLM's name of a storage tier (its `medium` field): `"GPU"`, `"CPU"`, `"DISK"`.
pub fn medium(tier: StorageTier) -> &'static str {
    match tier {
        StorageTier::Gpu => "GPU",
        StorageTier::Cpu => "CPU",
        StorageTier::Disk => "DISK",
    }
}

/// A KV cache group of a hybrid-attention model, as vLLM 0.32 names it on a
/// `BlockStored`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VllmGroup {
    /// `group_idx`.
    pub idx: u32,
    /// `kv_cache_spec_sliding_window` in tokens, for a `"sliding_window"` group;
    /// `None` for `"full_attention"`.
    pub sliding_window: Option<u32>,
}

/// One event as vLLM publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VllmEvent {
    /// A chain of full blocks was cached (a hybrid model's sliding-window group:
    /// the blocks of the range it keeps).
    BlockStored {
        /// Engine hashes of the new blocks, in prefix order.
        block_hashes: Vec<ExternalBlockHash>,
        /// Engine hash of the block before the first; `None` at a sequence start.
        parent_block_hash: Option<ExternalBlockHash>,
        /// The tokens of every new block, concatenated (`block_size` per block).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The tier the blocks were stored on.
        tier: StorageTier,
        /// The KV cache group of a hybrid model; `None` for a model with one group
        /// (vLLM 0.33's form, `group_idx` 0).
        group: Option<VllmGroup>,
    },
    /// Blocks were evicted.
    BlockRemoved {
        /// Engine hashes of the evicted blocks.
        block_hashes: Vec<ExternalBlockHash>,
        /// The tier they were evicted from.
        tier: StorageTier,
        /// The `group_idx` of a hybrid model's group; `None` (0) with one group.
        group: Option<u32>,
    },
    /// The whole cache of the rank was dropped.
    AllBlocksCleared,
}

/// A `Stored` block whose tokens the step did not report (a request without token
/// ids): vLLM always knows its tokens, so such an event cannot be published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no token ids for stored block {0}")]
pub struct MissingTokens(pub ExternalBlockHash);

/// Turns the core's KV events into vLLM's. `block_tokens` holds the tokens of every
/// block stored in the step (see [`engine_model::StepOutput::block_tokens`]);
/// `block_size` is in tokens.
///
/// # Errors
/// [`MissingTokens`] for a stored block without tokens (nothing is converted then).
pub fn to_vllm(
    events: &[KvCacheEventData],
    block_tokens: &HashMap<ExternalBlockHash, Vec<u32>>,
    block_size: u32,
) -> Result<Vec<VllmEvent>, MissingTokens> {
    events
        .iter()
        .map(|event| {
            Ok(match event {
                KvCacheEventData::Stored {
                    parent_hash,
                    blocks,
                    tier,
                    group: _,
                } => {
                    let mut token_ids = Vec::with_capacity(blocks.len() * block_size as usize);
                    for b in blocks {
                        let tokens = block_tokens
                            .get(&b.block_hash)
                            .ok_or(MissingTokens(b.block_hash))?;
                        token_ids.extend_from_slice(tokens);
                    }
                    VllmEvent::BlockStored {
                        block_hashes: blocks.iter().map(|b| b.block_hash).collect(),
                        parent_block_hash: *parent_hash,
                        token_ids,
                        block_size,
                        tier: *tier,
                        group: None,
                    }
                }
                KvCacheEventData::Removed {
                    block_hashes,
                    tier,
                    group: _,
                } => VllmEvent::BlockRemoved {
                    block_hashes: block_hashes.clone(),
                    tier: *tier,
                    group: None,
                },
                KvCacheEventData::Cleared => VllmEvent::AllBlocksCleared,
            })
        })
        .collect()
}

/// Turns a hybrid rank's step into vLLM 0.32's events: from `events` (the router
/// form) every `Cleared` and each evicted hash as its own `BlockRemoved`, in order;
/// then one `BlockStored` per [`GroupStore`], its `token_ids` the tokens of the
/// store's whole range (from `block_tokens`, which holds every block the full group
/// stored). `sliding_window` is the sliding-window groups' window, in tokens.
///
/// # Errors
/// [`MissingTokens`] for a range block without tokens (nothing is converted then).
pub fn to_vllm_hybrid(
    events: &[KvCacheEventData],
    stores: &[GroupStore],
    block_tokens: &HashMap<ExternalBlockHash, Vec<u32>>,
    block_size: u32,
    sliding_window: u32,
) -> Result<Vec<VllmEvent>, MissingTokens> {
    let mut out = Vec::new();
    for event in events {
        match event {
            KvCacheEventData::Cleared => out.push(VllmEvent::AllBlocksCleared),
            KvCacheEventData::Removed {
                block_hashes,
                tier,
                group,
            } => out.extend(block_hashes.iter().map(|h| VllmEvent::BlockRemoved {
                block_hashes: vec![*h],
                tier: *tier,
                group: Some(group.map_or(0, |g| g.0)),
            })),
            // The stores are the group stores'.
            KvCacheEventData::Stored { .. } => {}
        }
    }
    for store in stores {
        let mut token_ids = Vec::with_capacity(store.range.len() * block_size as usize);
        for b in &store.range {
            let tokens = block_tokens
                .get(&b.block_hash)
                .ok_or(MissingTokens(b.block_hash))?;
            token_ids.extend_from_slice(tokens);
        }
        out.push(VllmEvent::BlockStored {
            block_hashes: store.stored.iter().map(|b| b.block_hash).collect(),
            parent_block_hash: store.parent_hash,
            token_ids,
            block_size,
            tier: StorageTier::Gpu,
            group: Some(VllmGroup {
                idx: store.group.id.0,
                sliding_window: (!store.group.is_full()).then_some(sliding_window),
            }),
        });
    }
    Ok(out)
}

/// Encodes one batch: `ts` in seconds since the Unix epoch, the events in order, the
/// publishing rank.
pub fn encode_batch(ts: f64, events: &[VllmEvent], dp_rank: DpRank) -> Vec<u8> {
    let mut w = Writer(ByteBuf::new());
    w.array(3);
    ok(mp::write_f64(&mut w.0, ts));
    w.array(events.len());
    for event in events {
        match event {
            VllmEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                tier,
                group,
            } => {
                match group {
                    // map16 with 9 entries, as msgspec reserves it (see the module docs).
                    None => {
                        let Ok(()) = w.0.write_bytes(&[0xde, 0x00, 9]);
                    }
                    // vLLM 0.32's fixmap: 8 fields, extra_keys, the group's 2 or 3.
                    Some(g) => w.map(
                        10 + u32::from(!block_hashes.is_empty())
                            + u32::from(g.sliding_window.is_some()),
                    ),
                }
                w.entry_str("type", "BlockStored");
                w.str("block_hashes");
                w.hashes(block_hashes);
                w.str("parent_block_hash");
                match parent_block_hash {
                    Some(p) => w.uint(p.0),
                    None => w.nil(),
                }
                w.str("token_ids");
                w.array(token_ids.len());
                for t in token_ids {
                    w.uint(u64::from(*t));
                }
                w.str("block_size");
                w.uint(u64::from(*block_size));
                w.str("lora_id");
                w.nil();
                w.entry_str("medium", medium(*tier));
                w.str("lora_name");
                w.nil();
                match group {
                    None => {
                        w.str("group_idx");
                        w.uint(0);
                    }
                    Some(g) => w.group_fields(g, block_hashes.len()),
                }
            }
            VllmEvent::BlockRemoved {
                block_hashes,
                tier,
                group,
            } => {
                w.map(4);
                w.entry_str("type", "BlockRemoved");
                w.str("block_hashes");
                w.hashes(block_hashes);
                w.entry_str("medium", medium(*tier));
                w.str("group_idx");
                w.uint(u64::from(group.unwrap_or(0)));
            }
            VllmEvent::AllBlocksCleared => {
                w.map(1);
                w.entry_str("type", "AllBlocksCleared");
            }
        }
    }
    w.uint(u64::from(dp_rank.0));
    w.0.into_vec()
}

/// Writing to a [`ByteBuf`] cannot fail: its error type is uninhabited.
fn ok<T>(result: Result<T, ValueWriteError<Infallible>>) -> T {
    let Ok(value) = result;
    value
}

/// Thin msgpack writer over a growable buffer.
struct Writer(ByteBuf);

impl Writer {
    fn array(&mut self, len: usize) {
        // Batches and events are far below u32::MAX entries (bounded by the cache).
        ok(mp::write_array_len(
            &mut self.0,
            u32::try_from(len).unwrap_or(u32::MAX),
        ));
    }

    fn map(&mut self, len: u32) {
        ok(mp::write_map_len(&mut self.0, len));
    }

    fn str(&mut self, s: &str) {
        ok(mp::write_str(&mut self.0, s));
    }

    fn entry_str(&mut self, key: &str, value: &str) {
        self.str(key);
        self.str(value);
    }

    fn uint(&mut self, v: u64) {
        ok(mp::write_uint(&mut self.0, v));
    }

    fn nil(&mut self) {
        let Ok(()) = mp::write_nil(&mut self.0);
    }

    /// A hybrid `BlockStored`'s tail: `extra_keys` (one nil per hash, absent without
    /// hashes), `group_idx`, `kv_cache_spec_kind` and the sliding window.
    fn group_fields(&mut self, group: &VllmGroup, hashes: usize) {
        if hashes > 0 {
            self.str("extra_keys");
            self.array(hashes);
            for _ in 0..hashes {
                self.nil();
            }
        }
        self.str("group_idx");
        self.uint(u64::from(group.idx));
        match group.sliding_window {
            Some(window) => {
                self.entry_str("kv_cache_spec_kind", "sliding_window");
                self.str("kv_cache_spec_sliding_window");
                self.uint(u64::from(window));
            }
            None => self.entry_str("kv_cache_spec_kind", "full_attention"),
        }
    }

    fn hashes(&mut self, hashes: &[ExternalBlockHash]) {
        self.array(hashes.len());
        for h in hashes {
            self.uint(h.0);
        }
    }
}
