//! Decoding a [`Prompt`] in one pass.
//!
//! Why: serde's derived decoder for an internally tagged enum cannot know the variant
//! before it has read the `type` key, which may come last, so it first buffers the
//! whole map as generic `Content` values (one allocated value per token id or block
//! hash) and then decodes the variant again from that buffer. Every `RouteRequest`
//! paid for it: serde's `ContentVisitor` was 3% of the daemon's CPU per route
//! (docs/studies/routing-service.md, "Against a bare NATS round trip"). This decoder reads the
//! keys in whatever order they come and decodes each value straight into its field,
//! then checks that the fields match the tag.
//!
//! The wire format and its rules are unchanged: keys in any order, unknown keys (and
//! the other variant's fields) skipped, a missing or duplicate field and an unknown
//! `type` refused. (The derived decoder also took an array `[tag, fields…]`, which
//! no encoder of the protocol produces; a prompt is a map.) What a value allocates is bounded as before: the codec has checked
//! that every length the payload announces is backed by bytes (`crate::codec`), and
//! serde caps the up-front reservation of each vector.

use super::Prompt;
use crate::codec::packed::List;
use crate::ids::LocalBlockHash;
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use std::fmt;

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(PromptVisitor)
    }
}

/// The `type` tag.
#[derive(Deserialize)]
#[serde(variant_identifier, rename_all = "snake_case")]
enum Kind {
    Tokens,
    Blocks,
}

/// The keys of either variant.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum Field {
    Type,
    TokenIds,
    BlockHashes,
    NumTokens,
    #[serde(other)]
    Other,
}

struct PromptVisitor;

/// Refuses a key seen twice before its value is decoded.
fn vacant<T, E: de::Error>(slot: &Option<T>, name: &'static str) -> Result<(), E> {
    match slot {
        Some(_) => Err(E::duplicate_field(name)),
        None => Ok(()),
    }
}

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a prompt map tagged by `type`")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Prompt, A::Error> {
        let mut kind: Option<Kind> = None;
        let mut token_ids: Option<Vec<u32>> = None;
        let mut block_hashes: Option<Vec<LocalBlockHash>> = None;
        let mut num_tokens: Option<u64> = None;
        while let Some(key) = map.next_key::<Field>()? {
            match key {
                Field::Type => {
                    vacant(&kind, "type")?;
                    kind = Some(map.next_value()?);
                }
                Field::TokenIds => {
                    vacant(&token_ids, "token_ids")?;
                    token_ids = Some(map.next_value::<List<u32>>()?.0);
                }
                Field::BlockHashes => {
                    vacant(&block_hashes, "block_hashes")?;
                    block_hashes = Some(map.next_value::<List<LocalBlockHash>>()?.0);
                }
                Field::NumTokens => {
                    vacant(&num_tokens, "num_tokens")?;
                    num_tokens = Some(map.next_value()?);
                }
                Field::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let missing = de::Error::missing_field;
        match kind.ok_or_else(|| missing("type"))? {
            Kind::Tokens => Ok(Prompt::Tokens {
                token_ids: token_ids.ok_or_else(|| missing("token_ids"))?,
            }),
            Kind::Blocks => Ok(Prompt::Blocks {
                block_hashes: block_hashes.ok_or_else(|| missing("block_hashes"))?,
                num_tokens: num_tokens.ok_or_else(|| missing("num_tokens"))?,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};
    use serde::Serialize;

    /// The derived decoder this one replaces, to compare against.
    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(tag = "type", rename_all = "snake_case")]
    enum Derived {
        Tokens {
            #[serde(deserialize_with = "crate::codec::packed::deserialize")]
            token_ids: Vec<u32>,
        },
        Blocks {
            #[serde(deserialize_with = "crate::codec::packed::deserialize")]
            block_hashes: Vec<LocalBlockHash>,
            num_tokens: u64,
        },
    }

    impl From<Derived> for Prompt {
        fn from(d: Derived) -> Self {
            match d {
                Derived::Tokens { token_ids } => Prompt::Tokens { token_ids },
                Derived::Blocks {
                    block_hashes,
                    num_tokens,
                } => Prompt::Blocks {
                    block_hashes,
                    num_tokens,
                },
            }
        }
    }

    /// Both decoders agree on `bytes`: the same prompt, or both refuse.
    fn agree(bytes: &[u8]) -> Option<Prompt> {
        let ours = decode::<Prompt>(bytes).ok();
        let derived = decode::<Derived>(bytes).ok().map(Prompt::from);
        assert_eq!(ours, derived, "decoders disagree on {bytes:02x?}");
        ours
    }

    #[test]
    fn both_variants_round_trip_with_keys_in_any_order_and_unknown_keys_skipped() {
        for prompt in [
            Prompt::Tokens {
                token_ids: vec![1, 2, u32::MAX],
            },
            Prompt::Tokens { token_ids: vec![] },
            Prompt::Blocks {
                block_hashes: vec![LocalBlockHash(7), LocalBlockHash(u64::MAX)],
                num_tokens: 300,
            },
        ] {
            assert_eq!(agree(&encode(&prompt).unwrap()), Some(prompt));
        }
        // The tag last, an unknown key, and the other variant's field.
        #[derive(Serialize)]
        struct Reordered {
            num_tokens: u64,
            extra: Vec<String>,
            token_ids: Vec<u32>,
            block_hashes: Vec<u64>,
            r#type: &'static str,
        }
        let bytes = encode(&Reordered {
            num_tokens: 20,
            extra: vec!["x".into()],
            token_ids: vec![1],
            block_hashes: vec![5],
            r#type: "blocks",
        })
        .unwrap();
        assert_eq!(
            agree(&bytes),
            Some(Prompt::Blocks {
                block_hashes: vec![LocalBlockHash(5)],
                num_tokens: 20
            })
        );
    }

    #[test]
    fn a_missing_duplicate_or_unknown_tag_and_a_missing_field_are_refused() {
        #[derive(Serialize)]
        struct Untagged {
            token_ids: Vec<u32>,
        }
        #[derive(Serialize)]
        struct Tagged {
            r#type: &'static str,
            token_ids: Vec<u32>,
        }
        let cases = [
            encode(&Untagged { token_ids: vec![1] }).unwrap(),
            encode(&Tagged {
                r#type: "images",
                token_ids: vec![1],
            })
            .unwrap(),
            // Blocks without `num_tokens`.
            encode(&Tagged {
                r#type: "blocks",
                token_ids: vec![1],
            })
            .unwrap(),
            // Not a map.
            encode(&vec![1u32]).unwrap(),
        ];
        for bytes in &cases {
            assert_eq!(agree(bytes), None, "{bytes:02x?}");
        }
        // A duplicate key: a map of three keys, `token_ids` twice.
        let mut dup = encode(&Tagged {
            r#type: "tokens",
            token_ids: vec![1],
        })
        .unwrap();
        assert_eq!(dup[0], 0x82, "a fixmap of two keys");
        dup[0] = 0x83;
        dup.extend(encode(&"token_ids").unwrap());
        dup.extend(encode(&vec![2u32]).unwrap());
        assert!(decode::<Prompt>(&dup).is_err());
    }
}
