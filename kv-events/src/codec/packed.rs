//! Lists of integers — a prompt's token ids, its block hashes — as one msgpack `bin`.
//!
//! Why: as a msgpack array each element is its own value, checked by the shape walk
//! and decoded by serde one at a time (a block hash takes 9 bytes and two passes).
//! A route request of a 1,000-block prompt carried 1,000 such values; as one `bin` it
//! is one header, one bounds check and one copy: decoding a route request takes 151
//! ns instead of 476 at 64 blocks, 0.31 µs instead of 5.1 at 1,024, and 0.61 µs
//! instead of 66 for 8,192 token ids (`cargo bench -p kv-events --bench codec`;
//! docs/benchmarks.md, "round 34"). The array stays valid
//! on the wire: every field that takes the packed form also decodes an array, so
//! clients in other languages need not change.
//!
//! The packed form: the integers' little-endian bytes back to back, 8 per block hash
//! (`u64`), 4 per token id (`u32`). A `bin` whose length is not a multiple of the
//! width does not decode. What it allocates is bounded by the payload: the shape
//! walk has checked that the `bin`'s bytes exist.

use crate::ids::LocalBlockHash;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serializer};
use std::fmt;
use std::marker::PhantomData;

/// An integer that packs into a fixed number of little-endian bytes.
pub(crate) trait Packed: Copy + for<'de> Deserialize<'de> {
    /// Bytes per integer.
    const WIDTH: usize;
    /// What the list is, for error messages.
    const WHAT: &'static str;
    /// Reads one from exactly [`Self::WIDTH`] bytes.
    fn read(bytes: &[u8]) -> Self;
    /// Appends its bytes.
    fn write(self, out: &mut Vec<u8>);
}

impl Packed for u32 {
    const WIDTH: usize = 4;
    const WHAT: &'static str = "token ids";
    #[inline]
    fn read(bytes: &[u8]) -> Self {
        let mut le = [0; 4];
        le.copy_from_slice(bytes);
        u32::from_le_bytes(le)
    }
    #[inline]
    fn write(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

impl Packed for LocalBlockHash {
    const WIDTH: usize = 8;
    const WHAT: &'static str = "block hashes";
    #[inline]
    fn read(bytes: &[u8]) -> Self {
        let mut le = [0; 8];
        le.copy_from_slice(bytes);
        LocalBlockHash(u64::from_le_bytes(le))
    }
    #[inline]
    fn write(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.0.to_le_bytes());
    }
}

/// Encodes `list` as one `bin` (for `#[serde(serialize_with)]`).
///
/// # Errors
/// The serializer's.
pub(crate) fn serialize<T: Packed, S: Serializer>(list: &[T], s: S) -> Result<S::Ok, S::Error> {
    let mut bytes = Vec::with_capacity(list.len() * T::WIDTH);
    for &x in list {
        x.write(&mut bytes);
    }
    s.serialize_bytes(&bytes)
}

/// Decodes a list from either form: a `bin` of packed integers or an array (for
/// `#[serde(deserialize_with)]`).
///
/// # Errors
/// A `bin` whose length is not a multiple of the width, or anything else that is
/// not a list of such integers.
pub(crate) fn deserialize<'de, T: Packed, D: Deserializer<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    d.deserialize_any(ListVisitor(PhantomData))
}

/// A list of `T` in either form, for decoders that read it as a value of its own.
pub(crate) struct List<T>(pub(crate) Vec<T>);

impl<'de, T: Packed> Deserialize<'de> for List<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        deserialize(d).map(List)
    }
}

struct ListVisitor<T>(PhantomData<T>);

/// Elements reserved up front for an array, whatever its header announces (serde's
/// own cap is similar): more grow as they are read.
const RESERVE_CAP: usize = 4096;

impl<'de, T: Packed> Visitor<'de> for ListVisitor<T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} as an array or a bin of {}-byte little-endian integers",
            T::WHAT,
            T::WIDTH
        )
    }

    fn visit_bytes<E: de::Error>(self, bytes: &[u8]) -> Result<Vec<T>, E> {
        if !bytes.len().is_multiple_of(T::WIDTH) {
            return Err(E::invalid_length(bytes.len(), &self));
        }
        Ok(bytes.chunks_exact(T::WIDTH).map(T::read).collect())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let mut list = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(RESERVE_CAP));
        while let Some(x) = seq.next_element()? {
            list.push(x);
        }
        Ok(list)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};
    use serde::Serialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Msg {
        #[serde(serialize_with = "serialize", deserialize_with = "deserialize")]
        hashes: Vec<LocalBlockHash>,
        #[serde(serialize_with = "serialize", deserialize_with = "deserialize")]
        tokens: Vec<u32>,
    }

    /// The same fields as plain arrays, as a client in another language sends them.
    #[derive(Serialize)]
    struct Plain {
        hashes: Vec<u64>,
        tokens: Vec<u32>,
    }

    #[test]
    fn both_forms_decode_to_the_same_lists() {
        let msg = Msg {
            hashes: vec![
                LocalBlockHash(0),
                LocalBlockHash(u64::MAX),
                LocalBlockHash(7),
            ],
            tokens: vec![1, u32::MAX, 0],
        };
        let packed = encode(&msg).unwrap();
        // One bin each: 0xc4 (bin 8), then the length in bytes.
        let at = packed.windows(2).position(|w| w == [0xc4, 24]);
        assert!(at.is_some(), "hashes packed as 24 bytes: {packed:02x?}");
        assert_eq!(decode::<Msg>(&packed).unwrap(), msg);
        let plain = encode(&Plain {
            hashes: vec![0, u64::MAX, 7],
            tokens: vec![1, u32::MAX, 0],
        })
        .unwrap();
        assert_eq!(decode::<Msg>(&plain).unwrap(), msg);
        let empty = Msg {
            hashes: vec![],
            tokens: vec![],
        };
        assert_eq!(decode::<Msg>(&encode(&empty).unwrap()).unwrap(), empty);
    }

    #[test]
    fn a_bin_of_a_partial_integer_or_a_wrong_type_is_refused() {
        #[derive(Serialize)]
        struct Raw<'a> {
            #[serde(serialize_with = "bytes")]
            hashes: &'a [u8],
            tokens: Vec<u32>,
        }
        fn bytes<S: serde::Serializer>(b: &&[u8], s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(b)
        }
        let odd = encode(&Raw {
            hashes: &[0; 12],
            tokens: vec![],
        })
        .unwrap();
        let err = decode::<Msg>(&odd).unwrap_err().to_string();
        assert!(err.contains("block hashes"), "{err}");
        let whole = encode(&Raw {
            hashes: &[0; 16],
            tokens: vec![],
        })
        .unwrap();
        assert_eq!(decode::<Msg>(&whole).unwrap().hashes.len(), 2);
        #[derive(Serialize)]
        struct Strings {
            hashes: Vec<&'static str>,
            tokens: Vec<u32>,
        }
        let strings = encode(&Strings {
            hashes: vec!["a"],
            tokens: vec![],
        })
        .unwrap();
        assert!(decode::<Msg>(&strings).is_err());
    }
}
