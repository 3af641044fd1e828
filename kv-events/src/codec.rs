//! The msgpack codec used for every NATS payload.
//!
//! Structs are encoded as msgpack *maps* keyed by field name (`rmp_serde::to_vec_named`),
//! not as positional arrays. That costs a few bytes per message but lets clients in any
//! language build messages by name and lets us add optional fields without breaking
//! older peers: unknown keys are ignored on decode.

use serde::{Serialize, de::DeserializeOwned};

/// Errors from encoding or decoding a wire message.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The value could not be encoded (only possible for types serde cannot express).
    #[error("msgpack encode failed: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
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

/// Decodes a message of type `T` from msgpack bytes.
///
/// # Errors
/// [`CodecError::Decode`] for truncated, malformed or mistyped input. Never panics.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    Ok(rmp_serde::from_slice(bytes)?)
}
