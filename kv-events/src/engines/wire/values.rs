//! The scalar and free-form values inside engine events: block hashes in any of
//! their wire types (`uint`, `int` or `bin`), ids that may arrive signed, and vLLM's
//! free-form `extra_keys` values. Split from the event decoders ([`super`]), which
//! read these as fields.

use super::super::hash::{external_from_bytes, external_from_i64, external_from_u64};
use crate::ids::ExternalBlockHash;
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// A generic msgpack value, used only for vLLM's free-form `extra_keys`.
#[derive(Debug, Clone, PartialEq)]
pub enum ExtraKey {
    /// nil.
    Nil,
    /// A boolean.
    Bool(bool),
    /// Any integer.
    Int(i128),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// A `bin`.
    Bytes(Vec<u8>),
    /// An array.
    Array(Vec<ExtraKey>),
    /// A map, as key/value pairs in wire order.
    Map(Vec<(ExtraKey, ExtraKey)>),
}

/// A block hash in any of its wire forms.
pub(super) struct WireHash(pub(super) ExternalBlockHash);

impl<'de> Deserialize<'de> for WireHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = WireHash;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a block hash (uint 64, int 64 or bin)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<WireHash, E> {
                Ok(WireHash(external_from_u64(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<WireHash, E> {
                Ok(WireHash(external_from_i64(v)))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<WireHash, E> {
                external_from_bytes(v).map(WireHash).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A list of block hashes.
pub(super) struct WireHashes(pub(super) Vec<ExternalBlockHash>);

impl<'de> Deserialize<'de> for WireHashes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let hashes = Vec::<WireHash>::deserialize(d)?;
        Ok(WireHashes(hashes.into_iter().map(|h| h.0).collect()))
    }
}

/// An optional block hash (nil → `None`).
pub(super) fn opt_hash(h: Option<WireHash>) -> Option<ExternalBlockHash> {
    h.map(|h| h.0)
}

/// A string field read tolerantly: any other value (a later version's type) is
/// `None`.
pub(super) fn lenient_str(v: Option<ExtraKey>) -> Option<String> {
    match v? {
        ExtraKey::Str(s) => Some(s),
        _ => None,
    }
}

/// A non-negative integer field read tolerantly: a negative, oversized or non-integer
/// value is `None`.
pub(super) fn lenient_uint(v: Option<ExtraKey>) -> Option<u64> {
    match v? {
        ExtraKey::Int(i) => u64::try_from(i).ok(),
        _ => None,
    }
}

/// An integer id that may arrive signed or unsigned; signed values keep their bits.
pub(super) struct LenientId(pub(super) u64);

impl<'de> Deserialize<'de> for LenientId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = LenientId;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer id")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<LenientId, E> {
                Ok(LenientId(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<LenientId, E> {
                Ok(LenientId(v as u64))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for ExtraKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ExtraKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any msgpack value")
            }
            fn visit_unit<E: de::Error>(self) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Nil)
            }
            fn visit_none<E: de::Error>(self) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Nil)
            }
            fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<ExtraKey, D2::Error> {
                ExtraKey::deserialize(d)
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Bool(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Int(i128::from(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Int(i128::from(v)))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Float(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Str(v.to_owned()))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<ExtraKey, E> {
                Ok(ExtraKey::Bytes(v.to_vec()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ExtraKey, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(ExtraKey::Array(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ExtraKey, A::Error> {
                let mut items = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    items.push(entry);
                }
                Ok(ExtraKey::Map(items))
            }
        }
        d.deserialize_any(V)
    }
}
