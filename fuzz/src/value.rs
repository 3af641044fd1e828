//! A msgpack value tree the mutators edit, with a reader for seeds and a writer that
//! records where every length header sits (so a mutation can make it lie).
//!
//! Unlike a decoder, this model keeps what a hostile peer controls: duplicate map
//! keys, non-string keys, strings that are not UTF-8, ext values, and the width of
//! each integer is re-chosen by the writer.

use serde_json::Value;

/// One msgpack value.
#[derive(Debug, Clone, PartialEq)]
pub enum MsgpackNode {
    /// `nil`.
    Nil,
    /// `true` / `false`.
    Bool(bool),
    /// A non-negative integer.
    UInt(u64),
    /// A negative integer.
    NInt(i64),
    /// A 32-bit float.
    F32(f32),
    /// A 64-bit float.
    F64(f64),
    /// A `str`; the bytes need not be UTF-8.
    Str(Vec<u8>),
    /// A `bin`.
    Bin(Vec<u8>),
    /// An ext value: type tag and data.
    Ext(i8, Vec<u8>),
    /// An array.
    Array(Vec<MsgpackNode>),
    /// A map, in wire order; keys may repeat.
    Map(Vec<(MsgpackNode, MsgpackNode)>),
}

/// Deepest nesting [`MsgpackNode::parse`] reads; seeds are shallow.
const PARSE_DEPTH: usize = 64;

/// Where the writer put a length header: `at` is its first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Offset of the marker byte.
    pub at: usize,
    /// Bytes of marker plus length field.
    pub len: usize,
    /// What it announces.
    pub kind: HeaderKind,
}

/// The kinds of length-prefixed msgpack values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderKind {
    /// An array (the length counts elements).
    Array,
    /// A map (the length counts pairs).
    Map,
    /// A `str` (the length counts bytes).
    Str,
    /// A `bin` (the length counts bytes).
    Bin,
}

impl HeaderKind {
    /// A header of this kind announcing `claim`, in the 32-bit form.
    pub fn header32(self, claim: u32) -> Vec<u8> {
        let marker = match self {
            HeaderKind::Array => 0xdd,
            HeaderKind::Map => 0xdf,
            HeaderKind::Str => 0xdb,
            HeaderKind::Bin => 0xc6,
        };
        let mut out = vec![marker];
        out.extend_from_slice(&claim.to_be_bytes());
        out
    }
}

impl MsgpackNode {
    /// Reads the first msgpack value of `bytes`; `None` if it is not complete and
    /// well formed (or nests deeper than 64 levels).
    pub fn parse(bytes: &[u8]) -> Option<MsgpackNode> {
        let mut at = 0;
        parse(bytes, &mut at, 0)
    }

    /// Number of nodes in the tree, this one included.
    pub fn count(&self) -> usize {
        1 + match self {
            MsgpackNode::Array(items) => items.iter().map(MsgpackNode::count).sum(),
            MsgpackNode::Map(pairs) => pairs.iter().map(|(k, v)| k.count() + v.count()).sum(),
            _ => 0,
        }
    }

    /// The `k`-th node in pre-order (0 is `self`).
    pub fn nth_mut(&mut self, k: usize) -> Option<&mut MsgpackNode> {
        let mut k = k;
        nth(self, &mut k)
    }

    /// Every string (map keys and values) in the tree, for mutation vocabularies.
    pub fn strings(&self, out: &mut Vec<Vec<u8>>) {
        match self {
            MsgpackNode::Str(s) => out.push(s.clone()),
            MsgpackNode::Array(items) => items.iter().for_each(|n| n.strings(out)),
            MsgpackNode::Map(pairs) => pairs.iter().for_each(|(k, v)| {
                k.strings(out);
                v.strings(out);
            }),
            _ => {}
        }
    }

    /// The msgpack encoding, and where its length headers are.
    pub fn to_msgpack(&self) -> (Vec<u8>, Vec<Header>) {
        let mut out = Vec::new();
        let mut headers = Vec::new();
        write(self, &mut out, &mut headers);
        (out, headers)
    }

    /// The nearest JSON value: `bin` and ext become arrays of bytes, keys that are not
    /// strings are written as their JSON text, non-finite floats become `null`.
    pub fn to_json(&self) -> Value {
        match self {
            MsgpackNode::Nil => Value::Null,
            MsgpackNode::Bool(b) => Value::Bool(*b),
            MsgpackNode::UInt(n) => Value::from(*n),
            MsgpackNode::NInt(n) => Value::from(*n),
            MsgpackNode::F32(f) => {
                serde_json::Number::from_f64(f64::from(*f)).map_or(Value::Null, Value::Number)
            }
            MsgpackNode::F64(f) => {
                serde_json::Number::from_f64(*f).map_or(Value::Null, Value::Number)
            }
            MsgpackNode::Str(s) => Value::String(String::from_utf8_lossy(s).into_owned()),
            MsgpackNode::Bin(b) | MsgpackNode::Ext(_, b) => {
                Value::Array(b.iter().map(|&x| Value::from(x)).collect())
            }
            MsgpackNode::Array(items) => {
                Value::Array(items.iter().map(MsgpackNode::to_json).collect())
            }
            MsgpackNode::Map(pairs) => Value::Object(
                pairs
                    .iter()
                    .map(|(k, v)| {
                        let key = match k {
                            MsgpackNode::Str(s) => String::from_utf8_lossy(s).into_owned(),
                            other => other.to_json().to_string(),
                        };
                        (key, v.to_json())
                    })
                    .collect(),
            ),
        }
    }

    /// The tree of a JSON value (numbers keep their integer kind where they have one).
    pub fn from_json(value: &Value) -> MsgpackNode {
        match value {
            Value::Null => MsgpackNode::Nil,
            Value::Bool(b) => MsgpackNode::Bool(*b),
            Value::Number(n) => match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => MsgpackNode::UInt(u),
                (None, Some(i)) => MsgpackNode::NInt(i),
                _ => MsgpackNode::F64(n.as_f64().unwrap_or(0.0)),
            },
            Value::String(s) => MsgpackNode::Str(s.clone().into_bytes()),
            Value::Array(items) => {
                MsgpackNode::Array(items.iter().map(MsgpackNode::from_json).collect())
            }
            Value::Object(map) => MsgpackNode::Map(
                map.iter()
                    .map(|(k, v)| {
                        (
                            MsgpackNode::Str(k.clone().into_bytes()),
                            MsgpackNode::from_json(v),
                        )
                    })
                    .collect(),
            ),
        }
    }
}

fn nth<'a>(node: &'a mut MsgpackNode, k: &mut usize) -> Option<&'a mut MsgpackNode> {
    if *k == 0 {
        return Some(node);
    }
    *k -= 1;
    match node {
        MsgpackNode::Array(items) => {
            for item in items {
                let size = item.count();
                if *k < size {
                    return nth(item, k);
                }
                *k -= size;
            }
            None
        }
        MsgpackNode::Map(pairs) => {
            for (key, value) in pairs {
                for child in [key, value] {
                    let size = child.count();
                    if *k < size {
                        return nth(child, k);
                    }
                    *k -= size;
                }
            }
            None
        }
        _ => None,
    }
}

fn take<'a>(bytes: &'a [u8], at: &mut usize, n: usize) -> Option<&'a [u8]> {
    let end = at.checked_add(n)?;
    let out = bytes.get(*at..end)?;
    *at = end;
    Some(out)
}

fn be(bytes: &[u8], at: &mut usize, n: usize) -> Option<u64> {
    Some(
        take(bytes, at, n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)),
    )
}

fn parse(bytes: &[u8], at: &mut usize, depth: usize) -> Option<MsgpackNode> {
    if depth > PARSE_DEPTH {
        return None;
    }
    let marker = *bytes.get(*at)?;
    *at += 1;
    let seq = |bytes: &[u8], at: &mut usize, n: u64| -> Option<MsgpackNode> {
        // Each element takes at least one byte: a lying length fails here.
        if n > (bytes.len() - *at) as u64 {
            return None;
        }
        (0..n)
            .map(|_| parse(bytes, at, depth + 1))
            .collect::<Option<Vec<_>>>()
            .map(MsgpackNode::Array)
    };
    let map = |bytes: &[u8], at: &mut usize, n: u64| -> Option<MsgpackNode> {
        if n > (bytes.len() - *at) as u64 {
            return None;
        }
        (0..n)
            .map(|_| Some((parse(bytes, at, depth + 1)?, parse(bytes, at, depth + 1)?)))
            .collect::<Option<Vec<_>>>()
            .map(MsgpackNode::Map)
    };
    let raw = |bytes: &[u8], at: &mut usize, n: u64| -> Option<Vec<u8>> {
        take(bytes, at, usize::try_from(n).ok()?).map(<[u8]>::to_vec)
    };
    Some(match marker {
        0x00..=0x7f => MsgpackNode::UInt(u64::from(marker)),
        0x80..=0x8f => map(bytes, at, u64::from(marker & 0x0f))?,
        0x90..=0x9f => seq(bytes, at, u64::from(marker & 0x0f))?,
        0xa0..=0xbf => MsgpackNode::Str(raw(bytes, at, u64::from(marker & 0x1f))?),
        0xc0 => MsgpackNode::Nil,
        0xc2 => MsgpackNode::Bool(false),
        0xc3 => MsgpackNode::Bool(true),
        0xc4..=0xc6 => {
            let n = be(bytes, at, 1 << (marker - 0xc4))?;
            MsgpackNode::Bin(raw(bytes, at, n)?)
        }
        0xc7..=0xc9 => {
            let n = be(bytes, at, 1 << (marker - 0xc7))?;
            let tag = take(bytes, at, 1)?[0] as i8;
            MsgpackNode::Ext(tag, raw(bytes, at, n)?)
        }
        0xca => MsgpackNode::F32(f32::from_bits(u32::try_from(be(bytes, at, 4)?).ok()?)),
        0xcb => MsgpackNode::F64(f64::from_bits(be(bytes, at, 8)?)),
        0xcc..=0xcf => MsgpackNode::UInt(be(bytes, at, 1 << (marker - 0xcc))?),
        0xd0..=0xd3 => {
            let width = 1usize << (marker - 0xd0);
            let raw = be(bytes, at, width)?;
            let shift = 64 - 8 * width as u32;
            let value = ((raw << shift) as i64) >> shift;
            if value >= 0 {
                MsgpackNode::UInt(value as u64)
            } else {
                MsgpackNode::NInt(value)
            }
        }
        0xd4..=0xd8 => {
            let tag = take(bytes, at, 1)?[0] as i8;
            MsgpackNode::Ext(tag, raw(bytes, at, 1 << (marker - 0xd4))?)
        }
        0xd9..=0xdb => {
            let n = be(bytes, at, 1 << (marker - 0xd9))?;
            MsgpackNode::Str(raw(bytes, at, n)?)
        }
        0xdc | 0xdd => {
            let n = be(bytes, at, if marker == 0xdc { 2 } else { 4 })?;
            seq(bytes, at, n)?
        }
        0xde | 0xdf => {
            let n = be(bytes, at, if marker == 0xde { 2 } else { 4 })?;
            map(bytes, at, n)?
        }
        0xe0..=0xff => MsgpackNode::NInt(i64::from(marker as i8)),
        0xc1 => return None,
    })
}

fn len_header(out: &mut Vec<u8>, headers: &mut Vec<Header>, kind: HeaderKind, n: usize) {
    let at = out.len();
    // Lengths over u32::MAX cannot be written; the mutators never build them.
    let n32 = u32::try_from(n).unwrap_or(u32::MAX);
    match kind {
        HeaderKind::Array if n < 16 => out.push(0x90 | n as u8),
        HeaderKind::Map if n < 16 => out.push(0x80 | n as u8),
        HeaderKind::Str if n < 32 => out.push(0xa0 | n as u8),
        HeaderKind::Str if n < 256 => out.extend_from_slice(&[0xd9, n as u8]),
        HeaderKind::Bin if n < 256 => out.extend_from_slice(&[0xc4, n as u8]),
        _ if n < 65536 => {
            let marker = match kind {
                HeaderKind::Array => 0xdc,
                HeaderKind::Map => 0xde,
                HeaderKind::Str => 0xda,
                HeaderKind::Bin => 0xc5,
            };
            out.push(marker);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => out.extend_from_slice(&kind.header32(n32)),
    }
    headers.push(Header {
        at,
        len: out.len() - at,
        kind,
    });
}

fn write(node: &MsgpackNode, out: &mut Vec<u8>, headers: &mut Vec<Header>) {
    match node {
        MsgpackNode::Nil => out.push(0xc0),
        MsgpackNode::Bool(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        MsgpackNode::UInt(n) => match *n {
            0..=0x7f => out.push(*n as u8),
            0x80..=0xff => out.extend_from_slice(&[0xcc, *n as u8]),
            0x100..=0xffff => {
                out.push(0xcd);
                out.extend_from_slice(&(*n as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                out.push(0xce);
                out.extend_from_slice(&(*n as u32).to_be_bytes());
            }
            _ => {
                out.push(0xcf);
                out.extend_from_slice(&n.to_be_bytes());
            }
        },
        MsgpackNode::NInt(n) => {
            if *n >= -32 {
                out.push(*n as u8);
            } else {
                out.push(0xd3);
                out.extend_from_slice(&n.to_be_bytes());
            }
        }
        MsgpackNode::F32(f) => {
            out.push(0xca);
            out.extend_from_slice(&f.to_bits().to_be_bytes());
        }
        MsgpackNode::F64(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_bits().to_be_bytes());
        }
        MsgpackNode::Str(s) => {
            len_header(out, headers, HeaderKind::Str, s.len());
            out.extend_from_slice(s);
        }
        MsgpackNode::Bin(b) => {
            len_header(out, headers, HeaderKind::Bin, b.len());
            out.extend_from_slice(b);
        }
        MsgpackNode::Ext(tag, data) => {
            let n = u32::try_from(data.len()).unwrap_or(u32::MAX);
            out.push(0xc9);
            out.extend_from_slice(&n.to_be_bytes());
            out.push(*tag as u8);
            out.extend_from_slice(data);
        }
        MsgpackNode::Array(items) => {
            len_header(out, headers, HeaderKind::Array, items.len());
            items.iter().for_each(|n| write(n, out, headers));
        }
        MsgpackNode::Map(pairs) => {
            len_header(out, headers, HeaderKind::Map, pairs.len());
            for (k, v) in pairs {
                write(k, out, headers);
                write(v, out, headers);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_encodings_read_back_and_write_the_same_bytes() {
        let batch = kv_events::KvEventBatch::new(
            kv_events::WorkerId(u64::MAX),
            vec![kv_events::KvCacheEvent {
                event_id: 300,
                dp_rank: kv_events::DpRank(70_000),
                data: kv_events::KvCacheEventData::Removed {
                    group: None,
                    block_hashes: vec![kv_events::ExternalBlockHash(1 << 40)],
                    tier: kv_events::StorageTier::Gpu,
                },
            }],
        );
        let bytes = kv_events::encode(&batch).expect("a batch encodes");
        let node = MsgpackNode::parse(&bytes).expect("a real encoding parses");
        let (again, headers) = node.to_msgpack();
        assert_eq!(again, bytes);
        assert!(headers.iter().any(|h| h.kind == HeaderKind::Map));
        assert!(MsgpackNode::parse(&bytes[..bytes.len() - 1]).is_none());
    }

    #[test]
    fn negative_and_float_values_round_trip() {
        let node = MsgpackNode::Array(vec![
            MsgpackNode::NInt(-5),
            MsgpackNode::NInt(i64::MIN),
            MsgpackNode::F64(1.5),
            MsgpackNode::F32(-2.0),
            MsgpackNode::Ext(-1, vec![1, 2]),
            MsgpackNode::Bin(vec![0; 300]),
        ]);
        assert_eq!(MsgpackNode::parse(&node.to_msgpack().0), Some(node));
    }
}
