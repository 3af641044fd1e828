//! Input generation: structure-aware mutation of valid encodings, plus random trees and
//! random bytes. Every choice is drawn from an [`arbitrary::Unstructured`], so the same
//! generator can be driven by a seeded RNG (here) or by a coverage-guided fuzzer's
//! bytes (a `cargo fuzz` target would pass its input straight in).
//!
//! Mutations, in the order they are applied to one input:
//! 1. structural (0–3 per input) on the value tree of a seed: a field set to an
//!    extreme (`u64::MAX`, `2^63`, `i64::MIN`, NaN, ±∞, huge or invalid UTF-8
//!    strings), the wrong type, a tag or key from the target's own vocabulary, an
//!    element removed, duplicated or repeated up to 10,000 times, an unknown or
//!    duplicate key, a struct written as a positional array, wrapping and nesting,
//!    subtrees spliced from another seed;
//! 2. a lying length header (¼ of inputs): an array, map, `str` or `bin` that
//!    announces `u32::MAX`, `2^31`, one more or one less than it holds;
//! 3. byte-level (¼ of inputs): flips, inserts, deletions, truncation, a run of
//!    nesting markers up to 100,000 deep, garbage appended.

use crate::value::MsgpackNode;
use arbitrary::{Result, Unstructured};

/// Longest input, in bytes; longer generated inputs are cut (a truncation is one more
/// mutation). Four times NATS's default `max_payload`, and half the gateway's default
/// body limit.
pub const MAX_INPUT_BYTES: usize = 4 << 20;

/// How a target's inputs are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One msgpack value.
    Msgpack,
    /// One JSON document.
    Json,
    /// Several frames (ZMQ multipart parts, or NATS messages in order), each mutated
    /// as msgpack where it is msgpack; see [`crate::frames`].
    Frames,
}

/// The seeds of one target and what the mutators derive from them.
#[derive(Debug, Clone)]
pub struct Corpus {
    format: Format,
    seeds: Vec<Vec<u8>>,
    /// Each seed's value tree (msgpack and JSON formats; empty for frames).
    trees: Vec<MsgpackNode>,
    /// Each seed's frames (frames format; empty otherwise).
    frame_sets: Vec<Vec<Vec<u8>>>,
    /// Trees of every msgpack frame of every frame seed, for splicing.
    frame_trees: Vec<MsgpackNode>,
    /// Every string found in the seeds, plus a few hostile ones.
    vocab: Vec<Vec<u8>>,
}

impl Corpus {
    /// A corpus over `seeds`, which must be valid inputs of `format`.
    ///
    /// # Panics
    /// When a seed does not parse: the seed lists are code, so this is a bug.
    pub fn new(format: Format, seeds: Vec<Vec<u8>>) -> Self {
        let mut vocab: Vec<Vec<u8>> = vec![b"type".to_vec(), Vec::new(), vec![0], vec![0xff, 0xfe]];
        let (mut trees, mut frame_sets, mut frame_trees) = (Vec::new(), Vec::new(), Vec::new());
        for seed in &seeds {
            match format {
                Format::Msgpack => {
                    let node =
                        MsgpackNode::parse(seed).unwrap_or_else(|| panic!("seed is not msgpack"));
                    node.strings(&mut vocab);
                    trees.push(node);
                }
                Format::Json => {
                    let value: serde_json::Value = serde_json::from_slice(seed)
                        .unwrap_or_else(|e| panic!("seed is not json: {e}"));
                    let node = MsgpackNode::from_json(&value);
                    node.strings(&mut vocab);
                    trees.push(node);
                }
                Format::Frames => {
                    let frames = crate::frames::split(seed);
                    for frame in &frames {
                        if let Some(node) = MsgpackNode::parse(frame) {
                            node.strings(&mut vocab);
                            frame_trees.push(node);
                        }
                    }
                    frame_sets.push(frames);
                }
            }
        }
        vocab.sort();
        vocab.dedup();
        Self {
            format,
            seeds,
            trees,
            frame_sets,
            frame_trees,
            vocab,
        }
    }

    /// The seeds, unmutated.
    pub fn seeds(&self) -> &[Vec<u8>] {
        &self.seeds
    }

    /// One input drawn from `u`, at most [`MAX_INPUT_BYTES`] long.
    ///
    /// # Errors
    /// Only if `u` refuses a draw (it never does; an exhausted `u` yields zeros).
    pub fn generate(&self, u: &mut Unstructured<'_>) -> Result<Vec<u8>> {
        let mut bytes = match self.format {
            Format::Msgpack => self.msgpack(u, &self.trees),
            Format::Json => self.json(u),
            Format::Frames => self.frames(u),
        }?;
        bytes.truncate(MAX_INPUT_BYTES);
        Ok(bytes)
    }

    fn msgpack(&self, u: &mut Unstructured<'_>, trees: &[MsgpackNode]) -> Result<Vec<u8>> {
        match u.int_in_range(0u8..=99)? {
            0..=7 => random_bytes(u, 1024),
            8..=15 => Ok(self.random_tree(u, 3)?.to_msgpack().0),
            _ => {
                let mut node = u.choose(trees)?.clone();
                for _ in 0..u.int_in_range(0..=3)? {
                    self.mutate(u, &mut node, trees)?;
                }
                let (mut bytes, headers) = node.to_msgpack();
                if u.ratio(1, 4)? && !headers.is_empty() {
                    let header = *u.choose(&headers)?;
                    let holds = bytes.len() - header.at;
                    let claim = *u.choose(&[
                        u32::MAX,
                        1 << 31,
                        u32::try_from(holds).unwrap_or(u32::MAX).saturating_add(1),
                        0xffff,
                        1,
                        0,
                    ])?;
                    let replacement = header.kind.header32(claim);
                    bytes.splice(header.at..header.at + header.len, replacement);
                }
                if u.ratio(1, 4)? {
                    bytes_mutate(u, &mut bytes, &[0x91, 0x81])?;
                }
                Ok(bytes)
            }
        }
    }

    fn json(&self, u: &mut Unstructured<'_>) -> Result<Vec<u8>> {
        if u.ratio(1, 12)? {
            return random_bytes(u, 256);
        }
        let mut node = u.choose(&self.trees)?.clone();
        for _ in 0..u.int_in_range(0..=3)? {
            self.mutate(u, &mut node, &self.trees)?;
        }
        // Writing a `serde_json::Value` cannot fail.
        let mut bytes = serde_json::to_vec(&node.to_json()).unwrap_or_default();
        if u.ratio(1, 3)? {
            const TOKENS: &[&[u8]] = &[
                b"1e400",
                b"-0",
                b"18446744073709551616",
                b"-9223372036854775809",
                b"\"\\ud800\"",
                b"\"\\u0000\"",
                b"null",
                b"[",
                b"{",
                b"}",
                b",",
                b"\"model\":",
            ];
            let token = u.choose(TOKENS)?;
            let at = u.int_in_range(0..=bytes.len())?;
            bytes.splice(at..at, token.iter().copied());
        }
        if u.ratio(1, 4)? {
            bytes_mutate(u, &mut bytes, b"[{")?;
        }
        Ok(bytes)
    }

    fn frames(&self, u: &mut Unstructured<'_>) -> Result<Vec<u8>> {
        if u.ratio(1, 16)? {
            return random_bytes(u, 512);
        }
        let mut frames = u.choose(&self.frame_sets)?.clone();
        for frame in &mut frames {
            if !u.ratio(1, 3)? {
                continue;
            }
            *frame = match MsgpackNode::parse(frame) {
                Some(tree) if !frame.is_empty() => self.msgpack_from(u, &tree)?,
                _ => {
                    let mut bytes = frame.clone();
                    bytes_mutate(u, &mut bytes, &[0xff])?;
                    bytes
                }
            };
        }
        match u.int_in_range(0u8..=9)? {
            0 if !frames.is_empty() => {
                let i = u.choose_index(frames.len())?;
                frames.remove(i);
            }
            1 if !frames.is_empty() => {
                let i = u.choose_index(frames.len())?;
                frames.insert(i, frames[i].clone());
            }
            2 => {
                let any: u64 = u.arbitrary()?;
                let seq = *u.choose(&[u64::MAX, 0, 1, u64::MAX - 1, any])?;
                let i = u.int_in_range(0..=frames.len())?;
                frames.insert(i, seq.to_be_bytes().to_vec());
            }
            3 if frames.len() > 1 => {
                let (a, b) = (u.choose_index(frames.len())?, u.choose_index(frames.len())?);
                frames.swap(a, b);
            }
            4 => {
                // Replay the same frames again (a duplicate delivery).
                let again = frames.clone();
                frames.extend(again);
            }
            _ => {}
        }
        let mut bytes = crate::frames::join(&frames);
        if u.ratio(1, 10)? {
            bytes_mutate(u, &mut bytes, &[0x91])?;
        }
        Ok(bytes)
    }

    /// A mutated encoding of `tree`, splicing from the frame trees.
    fn msgpack_from(&self, u: &mut Unstructured<'_>, tree: &MsgpackNode) -> Result<Vec<u8>> {
        let mut node = tree.clone();
        for _ in 0..u.int_in_range(1..=3)? {
            self.mutate(u, &mut node, &self.frame_trees)?;
        }
        let mut bytes = node.to_msgpack().0;
        if u.ratio(1, 4)? {
            bytes_mutate(u, &mut bytes, &[0x91, 0x81])?;
        }
        Ok(bytes)
    }

    fn word(&self, u: &mut Unstructured<'_>) -> Result<Vec<u8>> {
        Ok(u.choose(&self.vocab)?.clone())
    }

    fn scalar(&self, u: &mut Unstructured<'_>) -> Result<MsgpackNode> {
        Ok(match u.int_in_range(0u8..=9)? {
            0 => MsgpackNode::UInt(*u.choose(&EXTREME_UINTS)?),
            1 => MsgpackNode::UInt(u.arbitrary()?),
            2 => MsgpackNode::NInt(*u.choose(&[-1, -32, -33, i64::from(i32::MIN), i64::MIN])?),
            3 => MsgpackNode::F64(*u.choose(&[
                f64::NAN,
                f64::INFINITY,
                f64::NEG_INFINITY,
                -0.0,
                f64::MAX,
                1e19,
                0.5,
                -1.0,
            ])?),
            4 => MsgpackNode::F32(*u.choose(&[f32::NAN, f32::INFINITY, 1e10, -0.5])?),
            5 => MsgpackNode::Nil,
            6 => MsgpackNode::Bool(u.arbitrary()?),
            7 => MsgpackNode::Str(self.word(u)?),
            8 => {
                let len = *u.choose(&[1usize, 31, 32, 255, 256, 4096, 65_535, 65_536])?;
                MsgpackNode::Str(vec![b'a'; len])
            }
            _ => MsgpackNode::Bin(random_bytes(u, 40)?),
        })
    }

    fn random_tree(&self, u: &mut Unstructured<'_>, depth: u32) -> Result<MsgpackNode> {
        if depth == 0 || u.ratio(1, 2)? {
            return self.scalar(u);
        }
        let n = u.int_in_range(0..=4)?;
        Ok(if u.arbitrary()? {
            MsgpackNode::Array(
                (0..n)
                    .map(|_| self.random_tree(u, depth - 1))
                    .collect::<Result<_>>()?,
            )
        } else {
            MsgpackNode::Map(
                (0..n)
                    .map(|_| {
                        Ok((
                            MsgpackNode::Str(self.word(u)?),
                            self.random_tree(u, depth - 1)?,
                        ))
                    })
                    .collect::<Result<_>>()?,
            )
        })
    }

    /// One structural mutation of a random node of `root`.
    fn mutate(
        &self,
        u: &mut Unstructured<'_>,
        root: &mut MsgpackNode,
        splice: &[MsgpackNode],
    ) -> Result<()> {
        let k = u.choose_index(root.count())?;
        let Some(node) = root.nth_mut(k) else {
            return Ok(());
        };
        match u.int_in_range(0u8..=11)? {
            0..=2 => *node = self.scalar(u)?,
            3 => *node = MsgpackNode::Str(self.word(u)?),
            4 => *node = self.random_tree(u, 2)?,
            5 => {
                let donor = u.choose(splice)?;
                let j = u.choose_index(donor.count())?;
                let mut donor = donor.clone();
                if let Some(part) = donor.nth_mut(j) {
                    *node = part.clone();
                }
            }
            6 => {
                let levels = *u.choose(&[1u32, 2, 8, 40])?;
                for _ in 0..levels {
                    let inner = std::mem::replace(node, MsgpackNode::Nil);
                    *node = if u.arbitrary()? {
                        MsgpackNode::Array(vec![inner])
                    } else {
                        MsgpackNode::Map(vec![(MsgpackNode::Str(self.word(u)?), inner)])
                    };
                }
            }
            _ => match node {
                MsgpackNode::Array(items) if !items.is_empty() => {
                    let i = u.choose_index(items.len())?;
                    match u.int_in_range(0u8..=4)? {
                        0 => {
                            items.remove(i);
                        }
                        1 => items.insert(i, items[i].clone()),
                        2 => {
                            let times = *u.choose(&[2usize, 16, 100, 1000, 10_000])?;
                            let item = items[i].clone();
                            // Keep the input under the runner's cap rather than build
                            // hundreds of MB only to cut them.
                            let size = item.to_msgpack().0.len().max(1);
                            let times = times.min(MAX_INPUT_BYTES / size);
                            items.extend(std::iter::repeat_n(item, times));
                        }
                        3 => {
                            let j = u.choose_index(items.len())?;
                            items.swap(i, j);
                        }
                        _ => items.push(self.scalar(u)?),
                    }
                }
                MsgpackNode::Map(pairs) if !pairs.is_empty() => {
                    let i = u.choose_index(pairs.len())?;
                    match u.int_in_range(0u8..=5)? {
                        0 => {
                            pairs.remove(i);
                        }
                        1 => pairs.push(pairs[i].clone()),
                        2 => pairs.push((MsgpackNode::Str(self.word(u)?), self.scalar(u)?)),
                        3 => pairs[i].0 = self.scalar(u)?,
                        4 => {
                            // The struct as a positional array of its values.
                            let values = pairs.iter().map(|(_, v)| v.clone()).collect();
                            *node = MsgpackNode::Array(values);
                        }
                        _ => {
                            let j = u.choose_index(pairs.len())?;
                            let value = pairs[j].1.clone();
                            pairs[i].1 = value;
                        }
                    }
                }
                _ => *node = self.scalar(u)?,
            },
        }
        Ok(())
    }
}

const EXTREME_UINTS: [u64; 14] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x100,
    0xffff,
    0x1_0000,
    0xffff_ffff,
    0x1_0000_0000,
    i64::MAX as u64,
    1 << 63,
    u64::MAX - 1,
    u64::MAX,
];

fn random_bytes(u: &mut Unstructured<'_>, max: usize) -> Result<Vec<u8>> {
    let len = u.int_in_range(0..=max)?;
    Ok((0..len).map(|_| u.arbitrary::<u8>().unwrap_or(0)).collect())
}

/// 1–3 byte-level mutations; `nest` are the bytes that open one nesting level.
fn bytes_mutate(u: &mut Unstructured<'_>, bytes: &mut Vec<u8>, nest: &[u8]) -> Result<()> {
    for _ in 0..u.int_in_range(1..=3)? {
        let at = u.int_in_range(0..=bytes.len())?;
        match u.int_in_range(0u8..=6)? {
            0 if at < bytes.len() => bytes[at] = u.arbitrary()?,
            1 => {
                let junk = random_bytes(u, 8)?;
                bytes.splice(at..at, junk);
            }
            2 => {
                let end = u.int_in_range(at..=bytes.len())?;
                bytes.drain(at..end);
            }
            3 => bytes.truncate(at),
            4 => {
                let end = u.int_in_range(at..=bytes.len().min(at + 64))?;
                let copy = bytes[at..end].to_vec();
                bytes.splice(at..at, copy);
            }
            5 => {
                let depth = *u.choose(&[10usize, 40, 1000, 100_000])?;
                let opener = *u.choose(nest)?;
                bytes.splice(at..at, std::iter::repeat_n(opener, depth));
            }
            _ => bytes.extend(random_bytes(u, 16)?),
        }
    }
    Ok(())
}
