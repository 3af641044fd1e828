//! Serializes a [`Duration`] as whole milliseconds (a `u64`), for config files: the
//! `with` module of every `*_ms` field of the scheduler's config (a leaf, so each
//! config part can use it).

use serde::{Deserialize, Deserializer, Serializer};
use std::time::Duration;

/// Writes `d` as milliseconds, saturating at `u64::MAX`.
///
/// # Errors
/// Whatever the serializer reports.
pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Reads milliseconds into a [`Duration`].
///
/// # Errors
/// Whatever the deserializer reports for a non-integer.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    u64::deserialize(d).map(Duration::from_millis)
}
