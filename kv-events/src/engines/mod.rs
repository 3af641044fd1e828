//! Decoders for the KV events real engines publish, so that an unmodified vLLM or
//! SGLang can feed the router through a relay (`kv-router relay`).
//!
//! Engines publish their own msgpack, not [`crate::KvEventBatch`]. Every payload is a
//! batch `[ts, events, dp_rank]` (a positional array), and each event comes in one of
//! two forms, detected per event:
//!
//! - **positional array** (vLLM ≤ 0.23):
//!   `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//!   medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
//!   kv_cache_spec_sliding_window, …]`, as many fields as that version has;
//! - **tagged map** (vLLM ≥ 0.24, SGLang): `{"type": "BlockStored", …}` with optional
//!   fields omitted.
//!
//! Both forms have `BlockStored`, `BlockRemoved` and `AllBlocksCleared`. Unknown keys,
//! trailing positional fields and unknown event types are ignored (an unknown type
//! decodes to [`EngineEvent::Unknown`] so the caller can count it). Block hashes arrive
//! as msgpack `uint 64` (vLLM), `int 64` (SGLang, often negative) or a 32-byte `bin`
//! (vLLM with int hashes off); [`hash`] maps each to one [`crate::ExternalBlockHash`].
//!
//! [`groups`] turns vLLM's `group_idx`, `kv_cache_spec_kind` and
//! `kv_cache_spec_sliding_window` into our [`crate::KvCacheGroup`] (the group's
//! window in blocks), or says why the kind cannot be indexed exactly.
//!
//! From an event's `token_ids` and `block_size`, [`scope`] computes our
//! [`crate::LocalBlockHash`] per block, mixing the LoRA adapter, SGLang's `cache_salt`
//! and vLLM's per-block `extra_keys` into the hash seed so that different adapters or
//! salts never match each other (see `docs/protocol.md`, "Engine block hashes").
//!
//! Cost: decoding allocates the event vectors once; no intermediate generic value
//! tree is built except for `extra_keys`. The payload is first checked by the codec's
//! walk ([`crate::codec::ShapeError`]): complete, nesting at most [`MAX_DEPTH`]
//! levels, and no length announcing more than follows, so hostile input can neither
//! exhaust the stack nor make serde pre-allocate for elements that are not there
//! (it reserves up to 1 MiB per announced sequence). Decoding never panics
//! (property-tested on random and truncated input, and fuzzed by `kv-fuzz`).
//!
//! This module is tokio-free like the rest of the crate: the relay in `router-daemon`
//! does the networking.

pub mod groups;
pub mod hash;
pub mod scope;
mod wire;

pub use groups::{UnsupportedGroup, kv_cache_group};
pub use hash::{HashError, external_from_bytes, external_from_i64, external_from_u64};
pub use scope::{AdapterScope, HashScope, LocalHashError, extra_keys_digest, local_block_hashes};
pub use wire::{
    BlockRemoved, BlockStored, EngineBatch, EngineEvent, EventForm, ExtraKey, MAX_DEPTH,
};

/// The [`crate::StorageTier`] an engine's `medium` names.
///
/// vLLM's offloading connector sends the medium of its load/store spec: `"GPU"`,
/// `"CPU"` or `"Disk"` (`vllm/v1/kv_offload/mediums.py`); SGLang sends `"GPU"` or
/// nothing. Matched without regard to case; an absent medium (nil or omitted, every
/// publisher that predates tiers) is the GPU.
///
/// # Errors
/// [`UnknownMedium`] for any other name; the caller counts and skips the event.
pub fn tier_of_medium(medium: Option<&str>) -> Result<crate::StorageTier, UnknownMedium> {
    let Some(name) = medium else {
        return Ok(crate::StorageTier::Gpu);
    };
    crate::StorageTier::ALL
        .into_iter()
        .find(|tier| tier.as_str().eq_ignore_ascii_case(name))
        .ok_or_else(|| UnknownMedium(name.chars().take(32).collect()))
}

/// An engine event named a storage medium this build does not know (the name, cut to
/// 32 characters).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown storage medium {0:?}")]
pub struct UnknownMedium(pub String);

/// Why an engine payload could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum EngineDecodeError {
    /// The bytes are not one complete msgpack value within [`MAX_DEPTH`] levels, or a
    /// length announces more than follows; nothing was decoded.
    #[error("engine kv event payload refused before decoding: {0}")]
    Shape(#[from] crate::codec::ShapeError),
    /// The bytes are not msgpack of the expected shape (wrong types, missing fields).
    #[error("engine kv event payload is malformed: {0}")]
    Malformed(#[from] rmp_serde::decode::Error),
}

/// Decodes one engine payload (the third ZMQ frame) into an [`EngineBatch`].
///
/// # Errors
/// [`EngineDecodeError`] for anything that does not start with one complete batch
/// (bytes after it are ignored, as msgpack readers do). Never panics.
pub fn decode_batch(payload: &[u8]) -> Result<EngineBatch, EngineDecodeError> {
    crate::codec::check_shape(payload)?;
    let mut de = rmp_serde::Deserializer::from_read_ref(payload);
    de.set_max_depth(MAX_DEPTH);
    Ok(<EngineBatch as serde::Deserialize>::deserialize(&mut de)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StorageTier;

    #[test]
    fn engine_media_map_to_tiers_and_unknown_ones_are_errors() {
        assert_eq!(tier_of_medium(None), Ok(StorageTier::Gpu));
        assert_eq!(tier_of_medium(Some("GPU")), Ok(StorageTier::Gpu));
        assert_eq!(tier_of_medium(Some("CPU")), Ok(StorageTier::Cpu));
        assert_eq!(tier_of_medium(Some("Disk")), Ok(StorageTier::Disk));
        assert_eq!(
            tier_of_medium(Some("tape")),
            Err(UnknownMedium("tape".into()))
        );
        let long = "x".repeat(100);
        assert_eq!(tier_of_medium(Some(&long)).unwrap_err().0.len(), 32);
    }
}
