//! Engine block hash normalization: every wire form → one [`ExternalBlockHash`].
//!
//! | engine form | msgpack | mapping |
//! |---|---|---|
//! | vLLM int hash (default) | `uint 64` (`0xcf`, often ≥ 2^63) or smaller uint | the value |
//! | SGLang hash | `int 64` (`0xd3`, often negative) or positive uint | two's complement bits (`i as u64`) |
//! | vLLM bytes hash (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) | `bin` (32 bytes) | low 64 bits, big-endian: the last 8 bytes |
//!
//! The bytes mapping is the one vLLM itself uses to turn its 32-byte block hash into
//! the integer it publishes by default (`int.from_bytes(h, "big") & (2**64 - 1)`), so
//! one engine publishing the same block in either form yields the same
//! `ExternalBlockHash` (checked against `vllm_block_hash_fixtures.json`). A `bin` shorter
//! than 8 bytes is read as a big-endian integer. The mapping is injective per form; an
//! engine uses one form at a time, and external hashes are scoped to their
//! (worker, dp_rank), so cross-form collisions cannot mix two engines' blocks.

use crate::ids::ExternalBlockHash;

/// Why a block hash could not be normalized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HashError {
    /// A `bin` block hash had no bytes.
    #[error("empty bytes block hash")]
    EmptyBytes,
}

/// A vLLM integer block hash (`uint 64`).
pub fn external_from_u64(value: u64) -> ExternalBlockHash {
    ExternalBlockHash(value)
}

/// An SGLang signed block hash (`int 64`): its two's complement bits.
pub fn external_from_i64(value: i64) -> ExternalBlockHash {
    ExternalBlockHash(value as u64)
}

/// A bytes block hash (vLLM's 32-byte hash): its low 64 bits, big-endian.
///
/// # Errors
/// [`HashError::EmptyBytes`] for an empty slice.
pub fn external_from_bytes(bytes: &[u8]) -> Result<ExternalBlockHash, HashError> {
    if bytes.is_empty() {
        return Err(HashError::EmptyBytes);
    }
    let low = &bytes[bytes.len().saturating_sub(8)..];
    let mut value = 0u64;
    for b in low {
        value = (value << 8) | u64::from(*b);
    }
    Ok(ExternalBlockHash(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_map_to_their_low_64_bits_big_endian() {
        // vLLM 0.33 sha256 block 0 of prompt A: the 32-byte hash and the integer vLLM
        // publishes for it (vllm_block_hash_fixtures.json).
        let hash = [
            0x9d, 0x9c, 0x41, 0x37, 0x31, 0x09, 0x5d, 0x0e, 0xe8, 0x11, 0xa1, 0x48, 0x14, 0x41,
            0x49, 0x07, 0xca, 0xfc, 0xcd, 0x75, 0x1c, 0xe2, 0x05, 0x2f, 0x65, 0x9e, 0x8e, 0x1f,
            0x54, 0x7a, 0xeb, 0x68,
        ];
        assert_eq!(
            external_from_bytes(&hash),
            Ok(ExternalBlockHash(7_322_446_309_363_477_352))
        );
        assert_eq!(external_from_bytes(&[1, 2]), Ok(ExternalBlockHash(0x0102)));
        assert_eq!(external_from_bytes(&[]), Err(HashError::EmptyBytes));
    }

    #[test]
    fn signed_hashes_keep_their_bits() {
        assert_eq!(external_from_i64(-1), ExternalBlockHash(u64::MAX));
        assert_eq!(
            external_from_i64(-278_502_217_879_090_434),
            ExternalBlockHash(0xfc22_8fb5_5a28_8afe)
        );
        assert_eq!(external_from_u64(5), ExternalBlockHash(5));
    }
}
