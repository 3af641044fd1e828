//! The engines' msgpack shapes, decoded with hand-written serde visitors.
//!
//! Hand-written because one field can have several wire types (a hash is `uint`,
//! `int` or `bin`), events are either positional arrays or maps tagged by `"type"`,
//! and tolerance matters more than strictness: unknown keys, trailing positional
//! fields and unknown event types are skipped, not errors.

mod values;

pub use values::ExtraKey;
use values::{LenientId, WireHash, WireHashes, lenient_str, lenient_uint, opt_hash};

use crate::ids::{DpRank, ExternalBlockHash};
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// Deepest msgpack nesting accepted; engine payloads use at most 6 levels (batch →
/// events → event → extra_keys → block → key), so anything deeper is hostile.
pub const MAX_DEPTH: usize = 32;

/// One published engine batch: `[ts, events, dp_rank]`.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineBatch {
    /// Engine wall-clock time of the batch, in seconds since the Unix epoch.
    pub ts: f64,
    /// Events in engine order.
    pub events: Vec<EngineEvent>,
    /// The data-parallel rank that published (`data_parallel_rank` in vLLM,
    /// `attn_dp_rank` in SGLang); `None` when the engine sent nil.
    pub dp_rank: Option<DpRank>,
}

/// Which of the two event encodings an event used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventForm {
    /// vLLM ≤ 0.23: `["BlockStored", field, field, …]`.
    PositionalArray,
    /// vLLM ≥ 0.24 and SGLang: `{"type": "BlockStored", "field": …}`.
    TaggedMap,
}

impl EventForm {
    /// Lowercase name for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            EventForm::PositionalArray => "positional",
            EventForm::TaggedMap => "tagged",
        }
    }
}

/// One engine event and the form it arrived in.
///
/// `BlockStored` is boxed so that every event is 64 bytes: inline it made each event
/// ~200 bytes, and a batch of 3-byte events of an unknown type held 100 bytes per
/// payload byte.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Blocks were cached.
    BlockStored(Box<BlockStored>, EventForm),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved, EventForm),
    /// The whole cache of the rank was dropped.
    AllBlocksCleared(EventForm),
    /// An event type this decoder does not know; its fields were skipped.
    Unknown {
        /// The engine's type name.
        type_name: String,
        /// The form it arrived in.
        form: EventForm,
    },
}

impl EngineEvent {
    /// The form the event arrived in.
    pub fn form(&self) -> EventForm {
        match self {
            EngineEvent::BlockStored(_, f)
            | EngineEvent::BlockRemoved(_, f)
            | EngineEvent::AllBlocksCleared(f)
            | EngineEvent::Unknown { form: f, .. } => *f,
        }
    }
}

/// `BlockStored`: a chain of full blocks was cached.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// Engine hashes of the new blocks, in prefix order.
    pub block_hashes: Vec<ExternalBlockHash>,
    /// Engine hash of the block before `block_hashes[0]`; `None` at a sequence start.
    pub parent_block_hash: Option<ExternalBlockHash>,
    /// The tokens of every new block, concatenated (`block_size` per block).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The engine's integer LoRA adapter id, if any.
    pub lora_id: Option<u64>,
    /// Storage tier (`"GPU"`, `"CPU"`, …); `None` when not sent.
    pub medium: Option<String>,
    /// The LoRA adapter's name (vLLM ≥ 0.23, SGLang).
    pub lora_name: Option<String>,
    /// SGLang's per-request cache salt.
    pub cache_salt: Option<String>,
    /// vLLM's per-block extra hash keys (LoRA name, multimodal ids, cache salt), one
    /// entry per block; empty when not sent.
    pub extra_keys: Vec<Option<ExtraKey>>,
    /// vLLM's KV cache group of a hybrid model; `None` when not sent.
    pub group_idx: Option<u32>,
    /// vLLM's kind of that group (`"full_attention"`, `"sliding_window"`, `"mamba"`,
    /// …; vLLM ≥ 0.23); `None` when not sent or not a string.
    pub kv_cache_spec_kind: Option<String>,
    /// vLLM's sliding window of that group, in tokens (sliding-window kinds only);
    /// `None` when not sent or not a non-negative integer.
    pub kv_cache_spec_sliding_window: Option<u64>,
}

/// `BlockRemoved`: blocks were evicted.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// Engine hashes of the evicted blocks.
    pub block_hashes: Vec<ExternalBlockHash>,
    /// Storage tier they were evicted from; `None` when not sent.
    pub medium: Option<String>,
    /// vLLM's KV cache group; `None` when not sent.
    pub group_idx: Option<u32>,
}

/// `extra_keys`: nil or one entry (nil or any value) per block.
fn extra_keys(v: Option<Vec<Option<ExtraKey>>>) -> Vec<Option<ExtraKey>> {
    v.unwrap_or_default()
}

fn missing<E: de::Error>(what: &'static str) -> E {
    E::custom(format_args!("engine event without {what}"))
}

/// Reads the fields of a positional `BlockStored` after its tag, in vLLM's order.
fn positional_stored<'de, A: SeqAccess<'de>>(seq: &mut A) -> Result<BlockStored, A::Error> {
    let block_hashes = seq
        .next_element::<WireHashes>()?
        .ok_or_else(|| missing("block_hashes"))?
        .0;
    let parent = seq
        .next_element::<Option<WireHash>>()?
        .ok_or_else(|| missing("parent_block_hash"))?;
    let token_ids = seq
        .next_element::<Vec<u32>>()?
        .ok_or_else(|| missing("token_ids"))?;
    let block_size = seq
        .next_element::<u32>()?
        .ok_or_else(|| missing("block_size"))?;
    let lora_id = seq.next_element::<Option<LenientId>>()?.flatten();
    let medium = seq.next_element::<Option<String>>()?.flatten();
    let lora_name = seq.next_element::<Option<String>>()?.flatten();
    let extra = seq
        .next_element::<Option<Vec<Option<ExtraKey>>>>()?
        .flatten();
    let group_idx = seq.next_element::<Option<u32>>()?.flatten();
    let kind = seq.next_element::<Option<ExtraKey>>()?.flatten();
    let window = seq.next_element::<Option<ExtraKey>>()?.flatten();
    Ok(BlockStored {
        block_hashes,
        parent_block_hash: opt_hash(parent),
        token_ids,
        block_size,
        lora_id: lora_id.map(|l| l.0),
        medium,
        lora_name,
        cache_salt: None,
        extra_keys: extra_keys(extra),
        group_idx,
        kv_cache_spec_kind: lenient_str(kind),
        kv_cache_spec_sliding_window: lenient_uint(window),
    })
}

/// Reads the fields of a positional `BlockRemoved` after its tag.
fn positional_removed<'de, A: SeqAccess<'de>>(seq: &mut A) -> Result<BlockRemoved, A::Error> {
    let block_hashes = seq
        .next_element::<WireHashes>()?
        .ok_or_else(|| missing("block_hashes"))?
        .0;
    let medium = seq.next_element::<Option<String>>()?.flatten();
    let group_idx = seq.next_element::<Option<u32>>()?.flatten();
    Ok(BlockRemoved {
        block_hashes,
        medium,
        group_idx,
    })
}

/// A map key: a known field name or anything else (skipped).
enum Key {
    Type,
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    CacheSalt,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    SlidingWindow,
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(match v {
                    "type" => Key::Type,
                    "block_hashes" => Key::BlockHashes,
                    "parent_block_hash" => Key::ParentBlockHash,
                    "token_ids" => Key::TokenIds,
                    "block_size" => Key::BlockSize,
                    "lora_id" => Key::LoraId,
                    "medium" => Key::Medium,
                    "lora_name" => Key::LoraName,
                    "cache_salt" => Key::CacheSalt,
                    "extra_keys" => Key::ExtraKeys,
                    "group_idx" => Key::GroupIdx,
                    "kv_cache_spec_kind" => Key::SpecKind,
                    "kv_cache_spec_sliding_window" => Key::SlidingWindow,
                    _ => Key::Other,
                })
            }
            fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Key, E> {
                Ok(Key::Other)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Key, E> {
                Ok(Key::Other)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Key, E> {
                Ok(Key::Other)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Key, E> {
                Ok(Key::Other)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Key, E> {
                Ok(Key::Other)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Key, E> {
                Ok(Key::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// Reads a tagged-map event; the `"type"` key may appear anywhere in the map.
fn tagged_event<'de, A: MapAccess<'de>>(mut map: A) -> Result<EngineEvent, A::Error> {
    let mut type_name: Option<String> = None;
    let mut stored = BlockStored::default();
    let mut have = (false, false, false); // block_hashes, token_ids, block_size
    let mut removed_medium = None;
    while let Some(key) = map.next_key::<Key>()? {
        match key {
            Key::Type => type_name = Some(map.next_value()?),
            Key::BlockHashes => {
                stored.block_hashes = map.next_value::<WireHashes>()?.0;
                have.0 = true;
            }
            Key::ParentBlockHash => {
                stored.parent_block_hash = opt_hash(map.next_value::<Option<WireHash>>()?);
            }
            Key::TokenIds => {
                stored.token_ids = map.next_value()?;
                have.1 = true;
            }
            Key::BlockSize => {
                stored.block_size = map.next_value()?;
                have.2 = true;
            }
            Key::LoraId => stored.lora_id = map.next_value::<Option<LenientId>>()?.map(|l| l.0),
            Key::Medium => {
                stored.medium = map.next_value()?;
                removed_medium.clone_from(&stored.medium);
            }
            Key::LoraName => stored.lora_name = map.next_value()?,
            Key::CacheSalt => stored.cache_salt = map.next_value()?,
            Key::ExtraKeys => stored.extra_keys = extra_keys(map.next_value()?),
            Key::GroupIdx => stored.group_idx = map.next_value()?,
            Key::SpecKind => stored.kv_cache_spec_kind = lenient_str(map.next_value()?),
            Key::SlidingWindow => {
                stored.kv_cache_spec_sliding_window = lenient_uint(map.next_value()?);
            }
            Key::Other => {
                map.next_value::<IgnoredAny>()?;
            }
        }
    }
    let form = EventForm::TaggedMap;
    let type_name = type_name.ok_or_else(|| missing("\"type\""))?;
    Ok(match type_name.as_str() {
        "BlockStored" => {
            if !have.0 {
                return Err(missing("block_hashes"));
            }
            if !have.1 {
                return Err(missing("token_ids"));
            }
            if !have.2 {
                return Err(missing("block_size"));
            }
            EngineEvent::BlockStored(Box::new(stored), form)
        }
        "BlockRemoved" => {
            if !have.0 {
                return Err(missing("block_hashes"));
            }
            EngineEvent::BlockRemoved(
                BlockRemoved {
                    block_hashes: stored.block_hashes,
                    medium: removed_medium,
                    group_idx: stored.group_idx,
                },
                form,
            )
        }
        "AllBlocksCleared" => EngineEvent::AllBlocksCleared(form),
        _ => EngineEvent::Unknown { type_name, form },
    })
}

impl<'de> Deserialize<'de> for EngineEvent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = EngineEvent;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an engine kv event (array or map)")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EngineEvent, A::Error> {
                let form = EventForm::PositionalArray;
                let type_name: String = seq.next_element()?.ok_or_else(|| missing("a type"))?;
                let event = match type_name.as_str() {
                    "BlockStored" => {
                        EngineEvent::BlockStored(Box::new(positional_stored(&mut seq)?), form)
                    }
                    "BlockRemoved" => {
                        EngineEvent::BlockRemoved(positional_removed(&mut seq)?, form)
                    }
                    "AllBlocksCleared" => EngineEvent::AllBlocksCleared(form),
                    _ => EngineEvent::Unknown { type_name, form },
                };
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(event)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<EngineEvent, A::Error> {
                tagged_event(map)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for EngineBatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = EngineBatch;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an engine kv event batch [ts, events, dp_rank]")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EngineBatch, A::Error> {
                let ts = seq.next_element::<f64>()?.ok_or_else(|| missing("ts"))?;
                let events = seq
                    .next_element::<Vec<EngineEvent>>()?
                    .ok_or_else(|| missing("events"))?;
                let dp_rank = seq.next_element::<Option<u32>>()?.flatten().map(DpRank);
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(EngineBatch {
                    ts,
                    events,
                    dp_rank,
                })
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EngineBatch, A::Error> {
                let (mut ts, mut events, mut dp_rank) = (None, None, None);
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "ts" => ts = Some(map.next_value::<f64>()?),
                        "events" => events = Some(map.next_value::<Vec<EngineEvent>>()?),
                        "data_parallel_rank" | "attn_dp_rank" | "dp_rank" => {
                            dp_rank = map.next_value::<Option<u32>>()?.map(DpRank);
                        }
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(EngineBatch {
                    ts: ts.ok_or_else(|| missing("ts"))?,
                    events: events.ok_or_else(|| missing("events"))?,
                    dp_rank,
                })
            }
        }
        d.deserialize_any(V)
    }
}
