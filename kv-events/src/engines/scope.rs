//! Local block hashes for engine events, scoped by LoRA adapter and cache salt.
//!
//! The router matches prompts by [`LocalBlockHash`]: xxh3-64 of a block's tokens (see
//! [`crate::hashing`]). Two requests with the same tokens but different LoRA adapters
//! or cache salts must never share cached blocks, so for those blocks the hash *seed*
//! is derived from the scope instead of being [`BLOCK_HASH_SEED`]:
//!
//! ```text
//! scope bytes = [0x01, len u64 LE, lora_name utf-8]     if lora_name is set
//!             | [0x02, lora_id u64 LE]                  else if lora_id is set
//!             ‖ [0x03, len u64 LE, cache_salt utf-8]    if cache_salt is set
//!             ‖ [0x04, extra digest u64 LE]             if the block has extra keys
//! seed        = 1337                                    if scope bytes are empty
//!             = xxh3_64(scope bytes, seed 1337)         otherwise
//! block hash  = xxh3_64(tokens as u32 LE, seed)
//! ```
//!
//! So a base-model, unsalted block hashes exactly like
//! [`crate::hashing::hash_block`], and plain token queries keep matching. A frontend
//! routing a LoRA or salted request computes the same seed with [`HashScope`] and
//! sends a `blocks` prompt. vLLM's per-block `extra_keys` (its own hash inputs beyond
//! the tokens: the LoRA name, multimodal ids, the cache salt on the first block) are
//! digested per block after dropping a leading entry equal to `lora_name`; a block
//! with such keys (an image, a salt) never matches a token-only query, which errs on
//! the side of a cache miss rather than a false hit. The digest is xxh3-64, seed 1337,
//! of a canonical encoding ([`ExtraKey`] tag byte, then the value; see
//! `docs/protocol.md`).
//!
//! Cost: one extra xxh3 over a few bytes per scoped block; nothing for base blocks.

use super::wire::{BlockStored, ExtraKey};
use crate::hashing::BLOCK_HASH_SEED;
use crate::ids::LocalBlockHash;
use xxhash_rust::xxh3::{Xxh3, xxh3_64_with_seed};

/// Which LoRA adapter a block was computed under.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum AdapterScope {
    /// By name (vLLM `lora_name`, SGLang `lora_name`): stable across engines.
    Name(String),
    /// By the engine's integer id, when no name was sent (vLLM ≤ 0.22). Only stable
    /// within one engine.
    Id(u64),
}

/// The scope of a request's blocks: adapter and cache salt. The default is the base
/// model without salt, whose hashes equal [`crate::hashing::hash_block`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct HashScope {
    /// The LoRA adapter, if any.
    pub adapter: Option<AdapterScope>,
    /// The cache salt, if any.
    pub cache_salt: Option<String>,
}

/// Why an event's local hashes could not be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocalHashError {
    /// The event's block size differs from the cluster's.
    #[error("event block_size {event} differs from the {expected} tokens in use")]
    BlockSize {
        /// `block_size` in the event, in tokens.
        event: u32,
        /// The configured block size, in tokens.
        expected: u32,
    },
    /// `token_ids` does not hold exactly one full block of tokens per block hash.
    #[error("{tokens} token ids for {blocks} blocks of {block_size} tokens")]
    TokenCount {
        /// Number of token ids in the event.
        tokens: usize,
        /// Number of block hashes in the event.
        blocks: usize,
        /// Tokens per block.
        block_size: u32,
    },
}

impl HashScope {
    /// The scope an engine event was stored under: `lora_name` if sent, else
    /// `lora_id`; SGLang's `cache_salt`.
    pub fn of_event(event: &BlockStored) -> Self {
        let adapter = match (&event.lora_name, event.lora_id) {
            (Some(name), _) if !name.is_empty() => Some(AdapterScope::Name(name.clone())),
            (_, Some(id)) => Some(AdapterScope::Id(id)),
            _ => None,
        };
        Self {
            adapter,
            cache_salt: event.cache_salt.clone().filter(|s| !s.is_empty()),
        }
    }

    /// The xxh3 seed of a block in this scope with the given extra-keys digest.
    pub fn seed(&self, extra_digest: Option<u64>) -> u64 {
        let mut bytes = Vec::new();
        match &self.adapter {
            Some(AdapterScope::Name(name)) => push_str(&mut bytes, 0x01, name),
            Some(AdapterScope::Id(id)) => {
                bytes.push(0x02);
                bytes.extend_from_slice(&id.to_le_bytes());
            }
            None => {}
        }
        if let Some(salt) = &self.cache_salt {
            push_str(&mut bytes, 0x03, salt);
        }
        if let Some(digest) = extra_digest {
            bytes.push(0x04);
            bytes.extend_from_slice(&digest.to_le_bytes());
        }
        if bytes.is_empty() {
            BLOCK_HASH_SEED
        } else {
            xxh3_64_with_seed(&bytes, BLOCK_HASH_SEED)
        }
    }

    /// Hashes every full block of a prompt in this scope (a frontend's view: no
    /// per-block extra keys). `block_size` in tokens; the partial tail is not hashed.
    pub fn block_hashes(&self, tokens: &[u32], block_size: u32) -> Vec<LocalBlockHash> {
        if block_size == 0 {
            return Vec::new();
        }
        let seed = self.seed(None);
        tokens
            .chunks_exact(block_size as usize)
            .map(|block| hash_tokens(block, seed))
            .collect()
    }
}

fn push_str(bytes: &mut Vec<u8>, tag: u8, s: &str) {
    bytes.push(tag);
    bytes.extend_from_slice(&(s.len() as u64).to_le_bytes());
    bytes.extend_from_slice(s.as_bytes());
}

fn hash_tokens(tokens: &[u32], seed: u64) -> LocalBlockHash {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    LocalBlockHash(xxh3_64_with_seed(&bytes, seed))
}

/// The extra keys of one block that scope it, without a leading `lora_name` (already
/// in the adapter scope); `None` when nothing is left.
fn scoping_keys<'a>(key: Option<&'a ExtraKey>, lora_name: Option<&str>) -> Option<&'a [ExtraKey]> {
    let items: &[ExtraKey] = match key? {
        ExtraKey::Nil => return None,
        ExtraKey::Array(items) => items,
        other => std::slice::from_ref(other),
    };
    let items = match (items.first(), lora_name) {
        (Some(ExtraKey::Str(first)), Some(name)) if first == name => &items[1..],
        _ => items,
    };
    (!items.is_empty()).then_some(items)
}

/// Digest of a block's scoping extra keys: xxh3-64 (seed 1337) of their canonical
/// encoding.
pub fn extra_keys_digest(keys: &[ExtraKey]) -> u64 {
    let mut hasher = Xxh3::with_seed(BLOCK_HASH_SEED);
    write_len(&mut hasher, 0x06, keys.len());
    for key in keys {
        write_key(&mut hasher, key);
    }
    hasher.digest()
}

fn write_len(h: &mut Xxh3, tag: u8, len: usize) {
    h.update(&[tag]);
    h.update(&(len as u64).to_le_bytes());
}

/// Canonical encoding: a tag byte, then the value (lengths as u64 LE).
fn write_key(h: &mut Xxh3, key: &ExtraKey) {
    match key {
        ExtraKey::Nil => h.update(&[0x00]),
        ExtraKey::Bool(b) => h.update(&[0x01, u8::from(*b)]),
        ExtraKey::Int(i) => {
            h.update(&[0x02]);
            h.update(&i.to_le_bytes());
        }
        ExtraKey::Float(f) => {
            h.update(&[0x03]);
            h.update(&f.to_bits().to_le_bytes());
        }
        ExtraKey::Str(s) => {
            write_len(h, 0x04, s.len());
            h.update(s.as_bytes());
        }
        ExtraKey::Bytes(b) => {
            write_len(h, 0x05, b.len());
            h.update(b);
        }
        ExtraKey::Array(items) => {
            write_len(h, 0x06, items.len());
            for item in items {
                write_key(h, item);
            }
        }
        ExtraKey::Map(entries) => {
            write_len(h, 0x07, entries.len());
            for (k, v) in entries {
                write_key(h, k);
                write_key(h, v);
            }
        }
    }
}

/// The [`LocalBlockHash`] of every block of a `BlockStored`, in order.
///
/// `block_size` is the cluster's, in tokens; the event must use the same size and
/// carry exactly `block_size` tokens per block hash.
///
/// # Errors
/// [`LocalHashError`] when the block size or the token count does not fit.
pub fn local_block_hashes(
    event: &BlockStored,
    block_size: u32,
) -> Result<Vec<LocalBlockHash>, LocalHashError> {
    if event.block_size != block_size {
        return Err(LocalHashError::BlockSize {
            event: event.block_size,
            expected: block_size,
        });
    }
    let blocks = event.block_hashes.len();
    if block_size == 0 || event.token_ids.len() != blocks.saturating_mul(block_size as usize) {
        return Err(LocalHashError::TokenCount {
            tokens: event.token_ids.len(),
            blocks,
            block_size,
        });
    }
    let scope = HashScope::of_event(event);
    let lora_name = event.lora_name.as_deref();
    Ok(event
        .token_ids
        .chunks_exact(block_size as usize)
        .enumerate()
        .map(|(i, tokens)| {
            let extra = scoping_keys(event.extra_keys.get(i).and_then(Option::as_ref), lora_name)
                .map(extra_keys_digest);
            hash_tokens(tokens, scope.seed(extra))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::hash_block;

    fn stored(tokens: Vec<u32>, blocks: usize) -> BlockStored {
        BlockStored {
            block_hashes: (0..blocks as u64).map(crate::ExternalBlockHash).collect(),
            token_ids: tokens,
            block_size: 4,
            ..BlockStored::default()
        }
    }

    #[test]
    fn base_scope_matches_plain_hashing() {
        let e = stored((0..8).collect(), 2);
        let hashes = local_block_hashes(&e, 4).unwrap();
        assert_eq!(
            hashes,
            vec![hash_block(&[0, 1, 2, 3]), hash_block(&[4, 5, 6, 7])]
        );
        assert_eq!(HashScope::default().seed(None), BLOCK_HASH_SEED);
        assert_eq!(
            HashScope::default().block_hashes(&(0..9).collect::<Vec<_>>(), 4),
            hashes
        );
    }

    #[test]
    fn adapters_and_salts_never_match_each_other() {
        let base = stored((0..4).collect(), 1);
        let lora_a = BlockStored {
            lora_name: Some("a".into()),
            lora_id: Some(1),
            ..base.clone()
        };
        let lora_b = BlockStored {
            lora_name: Some("b".into()),
            lora_id: Some(1),
            ..base.clone()
        };
        let id_only = BlockStored {
            lora_id: Some(1),
            ..base.clone()
        };
        let salted = BlockStored {
            cache_salt: Some("s".into()),
            ..base.clone()
        };
        let salted_a = BlockStored {
            cache_salt: Some("s".into()),
            ..lora_a.clone()
        };
        let all: Vec<LocalBlockHash> = [&base, &lora_a, &lora_b, &id_only, &salted, &salted_a]
            .iter()
            .map(|e| local_block_hashes(e, 4).unwrap()[0])
            .collect();
        for i in 0..all.len() {
            for j in i + 1..all.len() {
                assert_ne!(all[i], all[j], "scopes {i} and {j} collide");
            }
        }
        // A frontend computes the same hash for the same scope.
        let scope = HashScope {
            adapter: Some(AdapterScope::Name("a".into())),
            cache_salt: None,
        };
        assert_eq!(scope.block_hashes(&[0, 1, 2, 3], 4)[0], all[1]);
    }

    #[test]
    fn extra_keys_equal_to_the_lora_name_do_not_rescope() {
        let lora = BlockStored {
            lora_name: Some("my-lora".into()),
            ..stored((0..4).collect(), 1)
        };
        let with_keys = BlockStored {
            extra_keys: vec![Some(ExtraKey::Array(vec![ExtraKey::Str("my-lora".into())]))],
            ..lora.clone()
        };
        let with_image = BlockStored {
            extra_keys: vec![Some(ExtraKey::Array(vec![
                ExtraKey::Str("my-lora".into()),
                ExtraKey::Str("image-hash".into()),
            ]))],
            ..lora.clone()
        };
        let h = |e: &BlockStored| local_block_hashes(e, 4).unwrap()[0];
        assert_eq!(h(&lora), h(&with_keys));
        assert_ne!(h(&lora), h(&with_image));
    }

    /// Pinned vectors, computed independently with the reference `xxhash` Python
    /// package (3.5.0) from the byte layout in the module docs, so frontends in other
    /// languages can check their implementation (also in docs/protocol.md).
    #[test]
    fn pinned_scope_vectors() {
        let lora = HashScope {
            adapter: Some(AdapterScope::Name("my-lora".into())),
            cache_salt: None,
        };
        assert_eq!(lora.seed(None), 13_784_207_641_599_296_609);
        assert_eq!(
            lora.block_hashes(&[1, 2, 3, 4], 4),
            vec![LocalBlockHash(4_222_072_746_931_576_972)]
        );
        let salted = HashScope {
            adapter: None,
            cache_salt: Some("tenant-a".into()),
        };
        assert_eq!(salted.seed(None), 16_583_577_849_636_364_897);
        assert_eq!(
            salted.block_hashes(&[1, 2, 3, 4], 4),
            vec![LocalBlockHash(13_769_488_339_905_308_849)]
        );
        assert_eq!(
            extra_keys_digest(&[ExtraKey::Str("image-1".into())]),
            7_884_777_596_999_882_897
        );
    }

    #[test]
    fn wrong_sizes_are_errors() {
        let e = stored((0..7).collect(), 2);
        assert_eq!(
            local_block_hashes(&e, 4),
            Err(LocalHashError::TokenCount {
                tokens: 7,
                blocks: 2,
                block_size: 4
            })
        );
        assert_eq!(
            local_block_hashes(&stored((0..8).collect(), 2), 8),
            Err(LocalHashError::BlockSize {
                event: 4,
                expected: 8
            })
        );
    }
}
