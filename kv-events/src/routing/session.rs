//! [`SessionId`]: the frontend's name for a conversation (or agent run), so the router
//! can keep a session's turns on the rank that already holds its context.
//!
//! Why a newtype with its own decoder: the router keeps one table entry per session
//! (`scheduler::sessions`), so the id's length sizes state. The decoder checks the
//! length of the borrowed string *before* copying it, and refuses an empty id or one
//! longer than [`MAX_SESSION_ID_BYTES`]; the refusal is a decode error naming the
//! field (`session_id ... over the limit of 256`), counted and answered like any
//! other malformed route request.

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;

/// Longest session id, in bytes: UUIDs (36 bytes), hashes and prefixed user/thread
/// names fit with room to spare, and a full session table stays small
/// (`docs/protocol.md`).
pub const MAX_SESSION_ID_BYTES: usize = 256;

/// A session id: 1 to [`MAX_SESSION_ID_BYTES`] bytes of UTF-8, opaque to the router
/// (compared byte for byte). On the wire a plain msgpack string.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct SessionId(String);

/// Why a string is not a [`SessionId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionIdError {
    /// The id is empty.
    #[error("session_id is empty")]
    Empty,
    /// The id is longer than [`MAX_SESSION_ID_BYTES`].
    #[error("session_id is {0} bytes, over the limit of {MAX_SESSION_ID_BYTES}")]
    TooLong(usize),
}

impl SessionId {
    /// Checks `id` and copies it.
    ///
    /// # Errors
    /// [`SessionIdError`] for an empty id or one over [`MAX_SESSION_ID_BYTES`] bytes;
    /// nothing is allocated then.
    pub fn new(id: &str) -> Result<Self, SessionIdError> {
        match id.len() {
            0 => Err(SessionIdError::Empty),
            n if n > MAX_SESSION_ID_BYTES => Err(SessionIdError::TooLong(n)),
            _ => Ok(Self(id.to_owned())),
        }
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for SessionId {
    type Err = SessionIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl<'de> Deserialize<'de> for SessionId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Checked;
        impl Visitor<'_> for Checked {
            type Value = SessionId;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a string of 1 to {MAX_SESSION_ID_BYTES} bytes")
            }

            // Borrowed or transient, the string is checked before it is copied.
            fn visit_str<E: de::Error>(self, v: &str) -> Result<SessionId, E> {
                SessionId::new(v).map_err(E::custom)
            }
        }
        deserializer.deserialize_str(Checked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};

    #[test]
    fn a_session_id_is_a_plain_string_on_the_wire_and_bounded() {
        let id = SessionId::new("conv-7").expect("short");
        let bytes = encode(&id).expect("encode");
        assert_eq!(bytes, rmp_serde::to_vec("conv-7").expect("encode str"));
        assert_eq!(decode::<SessionId>(&bytes).expect("decode"), id);
        let longest = "x".repeat(MAX_SESSION_ID_BYTES);
        assert!(SessionId::new(&longest).is_ok());
        let long = rmp_serde::to_vec(&format!("{longest}x")).expect("encode str");
        let err = decode::<SessionId>(&long).expect_err("over the limit");
        assert!(
            err.to_string()
                .contains("session_id is 257 bytes, over the limit of 256"),
            "{err}"
        );
        let empty = rmp_serde::to_vec("").expect("encode str");
        assert!(
            decode::<SessionId>(&empty)
                .expect_err("empty")
                .to_string()
                .contains("session_id is empty")
        );
        assert_eq!(SessionId::new(""), Err(SessionIdError::Empty));
    }
}
