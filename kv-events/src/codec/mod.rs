//! The msgpack codec used for every NATS payload.
//!
//! Structs are encoded as msgpack *maps* keyed by field name (`rmp_serde::to_vec_named`),
//! not as positional arrays. That costs a few bytes per message but lets clients in any
//! language build messages by name and lets us add optional fields without breaking
//! older peers: unknown keys are ignored on decode.
//!
//! Decoding first walks the bytes once (`shape`) and refuses a value that is
//! truncated, announces more elements or bytes than follow, or nests deeper than
//! [`MAX_DEPTH`]. Only then does serde see it. Why: serde pre-allocates up to 1 MiB
//! per announced sequence, and buffers internally tagged enums (`KvCacheEventData`,
//! `Prompt`, `RecoveryBody`, ...) as generic values, so without the walk a few
//! kilobytes of nested arrays each announcing 4 G elements made the decoder hold
//! 1 MiB per level, and 1,024 levels (rmp-serde's own limit) overflowed a 2 MiB
//! tokio worker stack in debug builds. After the walk every announced element
//! exists, so what decoding holds grows with the input's length. Cost: one pass
//! over the bytes without allocating, about 10% of the decode itself (17 µs of
//! 157 µs for an 8,192-token route request sent as an array, release build).
//!
//! A prompt's token ids and block hashes may travel packed in one `bin` instead of
//! an array (`packed`), which the walk and serde each take in one step: an
//! 8,192-token route request then decodes in under 1 µs.

pub(crate) mod packed;
mod shape;

pub use shape::{MAX_DEPTH, ShapeError, check as check_shape};

use serde::{Serialize, de::DeserializeOwned};

/// Errors from encoding or decoding a wire message.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The value could not be encoded (only possible for types serde cannot express).
    #[error("msgpack encode failed: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
    /// The bytes are not one complete msgpack value within the nesting limit; nothing
    /// was decoded.
    #[error("msgpack refused before decoding: {0}")]
    Shape(#[from] ShapeError),
    /// The bytes are not a valid msgpack encoding of the expected message.
    #[error("msgpack decode failed: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
}

/// Encodes `value` as a named msgpack map.
///
/// # Errors
/// [`CodecError::Encode`] if serde cannot express the value.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError> {
    Ok(rmp_serde::to_vec_named(value)?)
}

/// Decodes a message of type `T` from msgpack bytes (bytes after the first value
/// are ignored).
///
/// # Errors
/// [`CodecError::Shape`] for truncated input, lengths that announce more than
/// follows, or nesting deeper than [`MAX_DEPTH`]; [`CodecError::Decode`] for
/// malformed or mistyped input. Never panics; holds memory in proportion to
/// `bytes.len()`.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    check_shape(bytes)?;
    Ok(rmp_serde::from_slice(bytes)?)
}
