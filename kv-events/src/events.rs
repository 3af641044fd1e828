//! KV cache events: what an engine tells the router about the blocks it holds.
//!
//! An engine publishes [`KvEventBatch`]es on `{ns}.kv.events.{worker_id}`. Each event
//! carries a per-(worker, dp_rank) sequence number, `event_id`, counted from 0 by the
//! publisher, and each batch the publisher's `epoch`, so the indexer can detect gaps,
//! duplicates and restarted publishers (and recover, see [`crate::recovery`]).
//!
//! Semantics (the indexer's contract):
//! - `Stored` appends `blocks` as a chain below `parent_hash` (or at the root when the
//!   parent is `None`). Each block's `block_hash` is the engine's hash, used later to
//!   find it again; its `tokens_hash` is the router-side [`LocalBlockHash`] that
//!   routing queries are matched against.
//! - `Removed` drops the named blocks for that worker rank.
//! - `Cleared` drops every block of that worker rank (engine reset or cache flush).
//!
//! `Stored` and `Removed` name the [`StorageTier`] the blocks went to or left: the
//! GPU (the default, and the only tier of a publisher that predates tiers) or a
//! lower tier an engine offloads to (CPU memory, local disk). The tier is optional on
//! the wire and omitted for the GPU, so GPU events are byte-identical to those of
//! publishers that predate tiers.
//!
//! Hybrid-attention models (sliding-window or Mamba layers next to full attention)
//! keep one KV cache *group* per kind of layer, and the engine caches and evicts each
//! group's copy of a block on its own. `Stored` names the [`KvCacheGroup`] (its id and
//! its window) and `Removed` the group id; both are optional and omitted for models
//! with one group, so their events are byte-identical to those of publishers that
//! predate groups. The indexer keeps each (rank, tier, group) apart and computes the
//! engine's own hybrid hit from them (see `docs/protocol.md`, "KV cache groups").
//!
//! Copies: an engine may hold two physical blocks under one block hash (vLLM does
//! when a prompt is recomputed over a prefix it holds, and for an exactly
//! block-aligned prompt repeated). A `Stored` that names a block the (rank, tier,
//! group) already holds adds a copy, each `Removed` drops one, and the block leaves
//! the index with its last copy.

use crate::ids::{DpRank, ExternalBlockHash, GroupId, LocalBlockHash, WorkerId};
use serde::{Deserialize, Serialize};
use std::num::NonZeroU32;

/// Where a worker rank holds a block: the storage tier a `Stored` event wrote to or
/// a `Removed` event evicted from.
///
/// On the wire a lowercase string (`"gpu"`, `"cpu"`, `"disk"`), omitted for
/// [`StorageTier::Gpu`]. A block on a lower tier is not usable as is: the engine
/// loads it back to the GPU first (for vLLM's offloading connector, over PCIe), which
/// is cheaper than recomputing its prefill but not free.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum StorageTier {
    /// GPU memory: the engine's KV cache proper. The default.
    #[default]
    Gpu,
    /// Host (CPU) memory, e.g. vLLM's `OffloadingConnector` with a CPU backend.
    Cpu,
    /// Local disk or other storage below host memory.
    Disk,
}

impl StorageTier {
    /// Every tier, fastest first.
    pub const ALL: [StorageTier; 3] = [StorageTier::Gpu, StorageTier::Cpu, StorageTier::Disk];

    /// True for [`StorageTier::Gpu`] (used to omit the default on the wire).
    pub fn is_gpu(&self) -> bool {
        matches!(self, StorageTier::Gpu)
    }

    /// The lowercase wire name, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            StorageTier::Gpu => "gpu",
            StorageTier::Cpu => "cpu",
            StorageTier::Disk => "disk",
        }
    }
}

impl std::fmt::Display for StorageTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The KV cache group a `Stored` event writes to: its id and what a prefix hit needs
/// of it.
///
/// On the wire a map `{"id": 3}` (full attention) or `{"id": 0, "window_blocks": 4}`.
/// A publisher sends the same `window_blocks` for a group on every store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvCacheGroup {
    /// The engine's group index (vLLM's `group_idx`).
    pub id: GroupId,
    /// The blocks right before a hit point that this group must hold for the engine
    /// to reuse a prefix ending there: a hit at `L` blocks needs the group to hold
    /// blocks `max(0, L − window_blocks) .. L`. Absent for full attention, which needs
    /// every block `0 .. L`. vLLM: `cdiv(sliding_window − 1, block_size)` for a
    /// sliding-window group (`SlidingWindowManager`), 1 for a Mamba group (the state
    /// at the hit point, `MambaManager`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_blocks: Option<NonZeroU32>,
}

impl KvCacheGroup {
    /// A full-attention group.
    pub fn full(id: u32) -> Self {
        Self {
            id: GroupId(id),
            window_blocks: None,
        }
    }

    /// A group whose hit needs the `window_blocks` blocks before the hit point;
    /// `None` when `window_blocks` is 0.
    pub fn windowed(id: u32, window_blocks: u32) -> Option<Self> {
        Some(Self {
            id: GroupId(id),
            window_blocks: Some(NonZeroU32::new(window_blocks)?),
        })
    }

    /// True for a full-attention group.
    pub fn is_full(&self) -> bool {
        self.window_blocks.is_none()
    }
}

/// One block in a `Stored` event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StoredBlock {
    /// The engine's hash of this block (opaque, used for parent lookup and removal).
    pub block_hash: ExternalBlockHash,
    /// The router-side hash of this block's tokens.
    pub tokens_hash: LocalBlockHash,
}

/// The payload of one KV cache event.
///
/// On the wire this is a map with a `"type"` key: `{"type": "stored", "parent_hash": …,
/// "blocks": […], "tier": …, "group": {…}}`, `{"type": "removed", "block_hashes": […],
/// "tier": …, "group": …}` or `{"type": "cleared"}`; `tier` is omitted for the GPU and
/// `group` for models with one KV cache group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvCacheEventData {
    /// Blocks were written to the cache, as a chain continuing `parent_hash`.
    Stored {
        /// The engine hash of the block preceding `blocks[0]`; `None` for a chain that
        /// starts at the beginning of a sequence.
        parent_hash: Option<ExternalBlockHash>,
        /// The new blocks, in prefix order.
        blocks: Vec<StoredBlock>,
        /// The tier the blocks were written to; GPU when absent on the wire.
        #[serde(default, skip_serializing_if = "StorageTier::is_gpu")]
        tier: StorageTier,
        /// The KV cache group the blocks belong to; absent for a model with one group.
        /// A windowed group's store may be sparse (vLLM keeps only the blocks a hit
        /// can use): `parent_hash` is then looked up in the rank's other groups on the
        /// same tier when the group itself does not hold it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        group: Option<KvCacheGroup>,
    },
    /// Blocks were evicted from the cache.
    Removed {
        /// The engine hashes of the evicted blocks.
        block_hashes: Vec<ExternalBlockHash>,
        /// The tier they were evicted from (the rank may still hold them on another
        /// tier); GPU when absent on the wire.
        #[serde(default, skip_serializing_if = "StorageTier::is_gpu")]
        tier: StorageTier,
        /// The KV cache group they were evicted from; absent for a model with one
        /// group. Never applies to another group's copy of the block.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        group: Option<GroupId>,
    },
    /// Every block of this worker rank was dropped, on every tier and in every group.
    Cleared,
}

/// One KV cache event of one data-parallel rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheEvent {
    /// Sequence number, counted from 0 per (worker, dp_rank) by the publisher.
    pub event_id: u64,
    /// The data-parallel rank whose cache changed.
    #[serde(default)]
    pub dp_rank: DpRank,
    /// What changed.
    pub data: KvCacheEventData,
}

/// The unit published on the events subject: every event in it belongs to `worker_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventBatch {
    /// The worker that publishes these events.
    pub worker_id: WorkerId,
    /// The publisher's epoch: a value that strictly increases each time the publisher
    /// restarts and numbers its events from 0 again (the mock engine and the relay use
    /// their start time in microseconds since the Unix epoch). 0 means "unknown"
    /// (publishers that predate epochs; the field is optional on the wire). The indexer
    /// resets a worker rank whose epoch increases and drops events of an older epoch.
    #[serde(default)]
    pub epoch: u64,
    /// Events in publication order.
    pub events: Vec<KvCacheEvent>,
}

impl KvEventBatch {
    /// A batch of epoch 0 (a publisher that does not track restarts).
    pub fn new(worker_id: WorkerId, events: Vec<KvCacheEvent>) -> Self {
        Self {
            worker_id,
            epoch: 0,
            events,
        }
    }
}

impl KvCacheEventData {
    /// Number of blocks the event names (0 for `Cleared`); used for metrics.
    pub fn block_count(&self) -> usize {
        match self {
            KvCacheEventData::Stored { blocks, .. } => blocks.len(),
            KvCacheEventData::Removed { block_hashes, .. } => block_hashes.len(),
            KvCacheEventData::Cleared => 0,
        }
    }

    /// A short lowercase name of the variant, for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            KvCacheEventData::Stored { .. } => "stored",
            KvCacheEventData::Removed { .. } => "removed",
            KvCacheEventData::Cleared => "cleared",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};

    fn sample_batch() -> KvEventBatch {
        KvEventBatch {
            worker_id: WorkerId(42),
            epoch: 7,
            events: vec![
                KvCacheEvent {
                    event_id: 0,
                    dp_rank: DpRank(1),
                    data: KvCacheEventData::Stored {
                        group: None,
                        parent_hash: None,
                        blocks: vec![
                            StoredBlock {
                                block_hash: ExternalBlockHash(u64::MAX),
                                tokens_hash: LocalBlockHash(11),
                            },
                            StoredBlock {
                                block_hash: ExternalBlockHash(2),
                                tokens_hash: LocalBlockHash(12),
                            },
                        ],
                        tier: StorageTier::Gpu,
                    },
                },
                KvCacheEvent {
                    event_id: 1,
                    dp_rank: DpRank(1),
                    data: KvCacheEventData::Removed {
                        group: None,
                        block_hashes: vec![ExternalBlockHash(2)],
                        tier: StorageTier::Cpu,
                    },
                },
                KvCacheEvent {
                    event_id: 2,
                    dp_rank: DpRank(1),
                    data: KvCacheEventData::Cleared,
                },
            ],
        }
    }

    #[test]
    fn batch_round_trips() {
        let batch = sample_batch();
        let back: KvEventBatch = decode(&encode(&batch).unwrap()).unwrap();
        assert_eq!(back, batch);
    }

    #[test]
    fn event_data_is_tagged_by_type() {
        #[derive(Deserialize)]
        struct Tagged {
            r#type: String,
        }
        let bytes = encode(&KvCacheEventData::Cleared).unwrap();
        let tagged: Tagged = decode(&bytes).unwrap();
        assert_eq!(tagged.r#type, "cleared");
    }

    #[test]
    fn missing_dp_rank_defaults_to_zero_and_unknown_keys_are_ignored() {
        #[derive(Serialize)]
        struct Foreign {
            event_id: u64,
            data: KvCacheEventData,
            future_field: &'static str,
        }
        let bytes = encode(&Foreign {
            event_id: 5,
            data: KvCacheEventData::Cleared,
            future_field: "ignored",
        })
        .unwrap();
        let event: KvCacheEvent = decode(&bytes).unwrap();
        assert_eq!(event.dp_rank, DpRank(0));
        assert_eq!(event.event_id, 5);
    }

    #[test]
    fn a_batch_without_epoch_decodes_as_epoch_zero() {
        #[derive(Serialize)]
        struct OldBatch {
            worker_id: WorkerId,
            events: Vec<KvCacheEvent>,
        }
        let bytes = encode(&OldBatch {
            worker_id: WorkerId(3),
            events: vec![],
        })
        .unwrap();
        let batch: KvEventBatch = decode(&bytes).unwrap();
        assert_eq!(batch, KvEventBatch::new(WorkerId(3), vec![]));
    }

    #[test]
    fn the_tier_is_omitted_for_the_gpu_and_defaults_to_it() {
        // A publisher that predates tiers: no `tier` key.
        #[derive(Serialize)]
        #[serde(tag = "type", rename_all = "snake_case")]
        enum OldData {
            Stored {
                parent_hash: Option<ExternalBlockHash>,
                blocks: Vec<StoredBlock>,
            },
            Removed {
                block_hashes: Vec<ExternalBlockHash>,
            },
        }
        let block = StoredBlock {
            block_hash: ExternalBlockHash(9),
            tokens_hash: LocalBlockHash(10),
        };
        let old_stored = encode(&OldData::Stored {
            parent_hash: None,
            blocks: vec![block],
        })
        .unwrap();
        let old_removed = encode(&OldData::Removed {
            block_hashes: vec![ExternalBlockHash(9)],
        })
        .unwrap();
        let gpu_stored = KvCacheEventData::Stored {
            group: None,
            parent_hash: None,
            blocks: vec![block],
            tier: StorageTier::Gpu,
        };
        let gpu_removed = KvCacheEventData::Removed {
            group: None,
            block_hashes: vec![ExternalBlockHash(9)],
            tier: StorageTier::Gpu,
        };
        // Old bytes decode as GPU events, and GPU events encode to the old bytes.
        assert_eq!(decode::<KvCacheEventData>(&old_stored).unwrap(), gpu_stored);
        assert_eq!(
            decode::<KvCacheEventData>(&old_removed).unwrap(),
            gpu_removed
        );
        assert_eq!(encode(&gpu_stored).unwrap(), old_stored);
        assert_eq!(encode(&gpu_removed).unwrap(), old_removed);
    }

    #[test]
    fn lower_tiers_round_trip_by_lowercase_name() {
        for tier in [StorageTier::Cpu, StorageTier::Disk] {
            let data = KvCacheEventData::Removed {
                group: None,
                block_hashes: vec![ExternalBlockHash(1)],
                tier,
            };
            let bytes = encode(&data).unwrap();
            assert_eq!(decode::<KvCacheEventData>(&bytes).unwrap(), data);
            #[derive(Deserialize)]
            struct Named {
                tier: String,
            }
            assert_eq!(decode::<Named>(&bytes).unwrap().tier, tier.as_str());
        }
        // A tier this build does not know is a decode error, not a GPU event.
        #[derive(Serialize)]
        struct Future {
            r#type: &'static str,
            block_hashes: Vec<u64>,
            tier: &'static str,
        }
        let future = encode(&Future {
            r#type: "removed",
            block_hashes: vec![1],
            tier: "tape",
        })
        .unwrap();
        assert!(decode::<KvCacheEventData>(&future).is_err());
    }

    #[test]
    fn groups_round_trip_and_are_omitted_for_one_group_models() {
        let stored = KvCacheEventData::Stored {
            parent_hash: Some(ExternalBlockHash(1)),
            blocks: vec![StoredBlock {
                block_hash: ExternalBlockHash(2),
                tokens_hash: LocalBlockHash(3),
            }],
            tier: StorageTier::Gpu,
            group: KvCacheGroup::windowed(0, 4),
        };
        let removed = KvCacheEventData::Removed {
            block_hashes: vec![ExternalBlockHash(2)],
            tier: StorageTier::Gpu,
            group: Some(GroupId(3)),
        };
        for data in [&stored, &removed] {
            assert_eq!(
                &decode::<KvCacheEventData>(&encode(data).unwrap()).unwrap(),
                data
            );
        }
        #[derive(Deserialize)]
        struct Named {
            group: std::collections::BTreeMap<String, u32>,
        }
        let named: Named = decode(&encode(&stored).unwrap()).unwrap();
        assert_eq!(
            format!("{:?}", named.group),
            r#"{"id": 0, "window_blocks": 4}"#,
            "the wire shape documented in docs/protocol.md"
        );
        let full = KvCacheEventData::Stored {
            parent_hash: None,
            blocks: vec![],
            tier: StorageTier::Gpu,
            group: Some(KvCacheGroup::full(3)),
        };
        let named: Named = decode(&encode(&full).unwrap()).unwrap();
        assert_eq!(format!("{:?}", named.group), r#"{"id": 3}"#);
        // No group: not on the wire at all.
        let plain = KvCacheEventData::Removed {
            block_hashes: vec![],
            tier: StorageTier::Gpu,
            group: None,
        };
        assert!(decode::<Named>(&encode(&plain).unwrap()).is_err());
    }

    #[test]
    fn a_zero_window_is_a_decode_error() {
        assert_eq!(KvCacheGroup::windowed(0, 0), None);
        #[derive(Serialize)]
        struct Forged {
            id: u32,
            window_blocks: u32,
        }
        let bytes = encode(&Forged {
            id: 1,
            window_blocks: 0,
        })
        .unwrap();
        assert!(decode::<KvCacheGroup>(&bytes).is_err());
    }

    #[test]
    fn truncated_input_is_an_error_not_a_panic() {
        let bytes = encode(&sample_batch()).unwrap();
        for cut in 0..bytes.len() {
            assert!(
                decode::<KvEventBatch>(&bytes[..cut]).is_err(),
                "prefix of {cut} bytes decoded"
            );
        }
    }
}
