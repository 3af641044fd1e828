//! Router-side block hashing: tokens → one [`LocalBlockHash`] per full block.
//!
//! Each full block of `block_size` tokens is hashed on its own with xxh3-64 over the
//! tokens as little-endian `u32` bytes, seeded with [`BLOCK_HASH_SEED`]. The hash does
//! not chain over earlier blocks: prefix identity comes from the block's position in
//! the indexer's radix tree, so equal blocks at different depths never collide in a
//! way that matters. A trailing partial block is not hashed, because engines only
//! cache (and announce) full blocks.
//!
//! Engines that publish raw token ids get their events re-hashed the same way by the
//! relay, so routing queries and KV events always agree.

use crate::ids::LocalBlockHash;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of the xxh3-64 block hash. Fixed forever: changing it invalidates every hash
/// computed by frontends and relays in the field. (The value 1337 is also the seed used
/// by NVIDIA Dynamo's kv-router, so hashes agree with it for the same block contents.)
pub const BLOCK_HASH_SEED: u64 = 1337;

/// Hashes the tokens of one block.
///
/// `tokens` is normally exactly one block; any length is accepted and hashed as given.
pub fn hash_block(tokens: &[u32]) -> LocalBlockHash {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    LocalBlockHash(xxh3_64_with_seed(&bytes, BLOCK_HASH_SEED))
}

/// Hashes every full block of `tokens` (`block_size` tokens each, in tokens).
///
/// Returns `tokens.len() / block_size` hashes; the partial tail is ignored.
/// A `block_size` of 0 yields no hashes (it is rejected earlier, at registration).
pub fn compute_block_hashes(tokens: &[u32], block_size: u32) -> Vec<LocalBlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    tokens
        .chunks_exact(block_size as usize)
        .map(hash_block)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Pinned vectors. Computed independently with the reference `xxhash` Python
    /// package: `xxh3_64_intdigest(struct.pack('<4I', 1, 2, 3, 4), seed=1337)`.
    #[test]
    fn pinned_vectors() {
        assert_eq!(hash_block(&[]), LocalBlockHash(VECTOR_EMPTY));
        assert_eq!(hash_block(&[1, 2, 3, 4]), LocalBlockHash(VECTOR_1234));
        let block: Vec<u32> = (0..16).collect();
        assert_eq!(hash_block(&block), LocalBlockHash(VECTOR_0_TO_15));
    }

    const VECTOR_EMPTY: u64 = 15_128_690_059_815_094_969;
    const VECTOR_1234: u64 = 14_643_705_804_678_351_452;
    const VECTOR_0_TO_15: u64 = 15_310_707_395_893_867_146;

    #[test]
    fn partial_last_block_is_not_hashed() {
        let tokens: Vec<u32> = (0..37).collect();
        let hashes = compute_block_hashes(&tokens, 16);
        assert_eq!(hashes.len(), 2);
        assert_eq!(hashes[0], hash_block(&tokens[0..16]));
        assert_eq!(hashes[1], hash_block(&tokens[16..32]));
        assert!(compute_block_hashes(&tokens[..15], 16).is_empty());
        assert!(compute_block_hashes(&tokens, 0).is_empty());
    }

    #[test]
    fn token_order_and_byte_order_matter() {
        assert_ne!(hash_block(&[1, 2]), hash_block(&[2, 1]));
        // Little-endian: token 1 is bytes 01 00 00 00, not 00 00 00 01.
        assert_eq!(
            hash_block(&[1]),
            LocalBlockHash(xxh3_64_with_seed(&[1, 0, 0, 0], BLOCK_HASH_SEED))
        );
    }

    proptest! {
        #[test]
        fn shared_prefix_gives_shared_leading_hashes(
            prefix in proptest::collection::vec(any::<u32>(), 0..64),
            a in proptest::collection::vec(any::<u32>(), 0..40),
            b in proptest::collection::vec(any::<u32>(), 0..40),
            block_size in 1u32..9,
        ) {
            let ta: Vec<u32> = prefix.iter().chain(&a).copied().collect();
            let tb: Vec<u32> = prefix.iter().chain(&b).copied().collect();
            let ha = compute_block_hashes(&ta, block_size);
            let hb = compute_block_hashes(&tb, block_size);
            let shared = prefix.len() / block_size as usize;
            prop_assert_eq!(&ha[..shared], &hb[..shared]);
            prop_assert_eq!(ha.len(), ta.len() / block_size as usize);
        }
    }
}
