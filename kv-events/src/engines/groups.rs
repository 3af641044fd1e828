//! vLLM's KV cache group fields → our [`KvCacheGroup`].
//!
//! vLLM's hybrid KV cache manager keeps one group per kind of layer and names it on
//! every `BlockStored`: `group_idx`, `kv_cache_spec_kind` and, for sliding-window
//! kinds, `kv_cache_spec_sliding_window` (tokens). What a prefix hit at `L` blocks
//! needs of a group (vLLM `HybridKVCacheCoordinator.find_longest_cache_hit`):
//!
//! | kind | needs | our group |
//! |---|---|---|
//! | `full_attention`, `mla_attention`, `sink_full_attention` (or no kind sent) | blocks `0 .. L` | full |
//! | `sliding_window`, `sliding_window_mla` | the `cdiv(sliding_window − 1, block_size)` blocks before `L` (`SlidingWindowManager`) | windowed |
//! | `mamba` | the state at `L`: the block before it (`MambaManager`) | window 1 |
//! | `chunked_local_attention`, `encoder_only_attention`, `cross_attention`, `unknown`, anything else | not modelled | [`UnsupportedGroup`] |
//!
//! An engine that sends `group_idx` without a kind (vLLM before the kind was added)
//! is taken at its word as full attention for every group: the index then asks every
//! group for the whole prefix, which never claims more than the engine holds in each
//! group. Not modelled: EAGLE speculative decoding, which makes vLLM drop the last
//! matched block of a sliding-window hit (one block less than this rule).
//!
//! Cost: a few string comparisons per `BlockStored`.

use crate::events::KvCacheGroup;

/// A group whose kind the router cannot index exactly; its events are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnsupportedGroup {
    /// A kind whose hit rule is not modelled (chunked local attention, encoder-only
    /// or cross attention, vLLM's `unknown`, a kind newer than this build). Holds the
    /// kind, cut to 64 characters.
    #[error("KV cache group kind {0:?} is not indexed")]
    Kind(String),
    /// A sliding-window kind without a window that covers at least one block
    /// (`kv_cache_spec_sliding_window` absent, 0 or 1 token, or over 2^32 blocks).
    #[error("sliding-window KV cache group {kind:?} without a usable window ({window:?} tokens)")]
    NoWindow {
        /// The kind.
        kind: String,
        /// The window sent, in tokens.
        window: Option<u64>,
    },
    /// A kind other than full attention on an event without `group_idx`.
    #[error("KV cache group kind {0:?} without a group_idx")]
    NoGroupIdx(String),
}

impl UnsupportedGroup {
    /// The engine's kind name, for logging each kind once.
    pub fn kind(&self) -> &str {
        match self {
            UnsupportedGroup::Kind(kind)
            | UnsupportedGroup::NoWindow { kind, .. }
            | UnsupportedGroup::NoGroupIdx(kind) => kind,
        }
    }
}

/// Kinds whose hit needs every block of the prefix.
const FULL_KINDS: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];
/// Kinds whose hit needs the window before the hit point.
const SLIDING_KINDS: [&str; 2] = ["sliding_window", "sliding_window_mla"];

/// The [`KvCacheGroup`] a vLLM `BlockStored` names, by the table in the module docs;
/// `Ok(None)` for an event without a group (a model with one group, or an engine
/// that predates groups). `sliding_window` in tokens, `block_size` in tokens (the
/// size in use).
///
/// # Errors
/// [`UnsupportedGroup`] for a kind that is not indexed exactly, a sliding-window kind
/// without a usable window, and a non-full kind without `group_idx`.
pub fn kv_cache_group(
    group_idx: Option<u32>,
    kind: Option<&str>,
    sliding_window: Option<u64>,
    block_size: u32,
) -> Result<Option<KvCacheGroup>, UnsupportedGroup> {
    let cut = |k: &str| k.chars().take(64).collect::<String>();
    let full = kind.is_none_or(|k| FULL_KINDS.contains(&k));
    let Some(id) = group_idx else {
        return match kind {
            Some(k) if !full => Err(UnsupportedGroup::NoGroupIdx(cut(k))),
            _ => Ok(None),
        };
    };
    let Some(kind) = kind.filter(|_| !full) else {
        return Ok(Some(KvCacheGroup::full(id)));
    };
    if kind == "mamba" {
        return Ok(KvCacheGroup::windowed(id, 1));
    }
    if !SLIDING_KINDS.contains(&kind) {
        return Err(UnsupportedGroup::Kind(cut(kind)));
    }
    sliding_window
        .and_then(|w| window_blocks(w, block_size))
        .and_then(|blocks| KvCacheGroup::windowed(id, blocks))
        .map(Some)
        .ok_or_else(|| UnsupportedGroup::NoWindow {
            kind: cut(kind),
            window: sliding_window,
        })
}

/// vLLM's blocks a sliding-window hit needs: `cdiv(window − 1, block_size)`; `None`
/// when that is 0 or does not fit a u32.
fn window_blocks(window_tokens: u64, block_size: u32) -> Option<u32> {
    let block_size = u64::from(block_size);
    if block_size == 0 {
        return None;
    }
    let blocks = window_tokens.checked_sub(1)?.div_ceil(block_size);
    u32::try_from(blocks).ok().filter(|b| *b > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_map_to_full_windowed_or_unsupported_groups() {
        let group = |idx, kind, window| kv_cache_group(idx, kind, window, 32);
        assert_eq!(group(None, None, None), Ok(None));
        assert_eq!(group(None, Some("full_attention"), None), Ok(None));
        for kind in [None, Some("full_attention"), Some("mla_attention")] {
            assert_eq!(group(Some(3), kind, None), Ok(Some(KvCacheGroup::full(3))));
        }
        // The capture's Gemma 3: window 128 tokens, block 32 → cdiv(127, 32) = 4.
        let gemma = group(Some(0), Some("sliding_window"), Some(128));
        assert_eq!(gemma, Ok(KvCacheGroup::windowed(0, 4)));
        // gpt-oss: window 128 at block 16 → 8; a window of 129 tokens → 4 at 32.
        assert_eq!(
            kv_cache_group(Some(1), Some("sliding_window_mla"), Some(128), 16),
            Ok(KvCacheGroup::windowed(1, 8))
        );
        assert_eq!(
            group(Some(1), Some("sliding_window"), Some(129)),
            Ok(KvCacheGroup::windowed(1, 4))
        );
        assert_eq!(
            group(Some(2), Some("mamba"), None),
            Ok(KvCacheGroup::windowed(2, 1))
        );
        for kind in [
            "chunked_local_attention",
            "cross_attention",
            "unknown",
            "new",
        ] {
            let err = group(Some(1), Some(kind), Some(128)).unwrap_err();
            assert_eq!(err, UnsupportedGroup::Kind(kind.into()));
            assert_eq!(err.kind(), kind);
        }
        for window in [None, Some(0), Some(1), Some(u64::MAX)] {
            assert!(matches!(
                group(Some(0), Some("sliding_window"), window),
                Err(UnsupportedGroup::NoWindow { .. })
            ));
        }
        assert!(matches!(
            kv_cache_group(Some(0), Some("sliding_window"), Some(128), 0),
            Err(UnsupportedGroup::NoWindow { .. })
        ));
        assert_eq!(
            group(None, Some("mamba"), None),
            Err(UnsupportedGroup::NoGroupIdx("mamba".into()))
        );
        let long = "k".repeat(500);
        assert_eq!(
            group(Some(0), Some(&long), None).unwrap_err().kind().len(),
            64
        );
    }
}
