//! A cache of token ids for the pieces of text between added tokens, so that a
//! conversation that resends its history every turn, or prompts built from shared
//! documents, are not encoded again and again.
//!
//! A text is cut right after each added token it contains (`<|im_end|>`, a BOS
//! written into the text; see [`split`] for why that is exact and when it is
//! refused). Each piece is looked up by a keyed BLAKE3 hash of the sentinel before it
//! and its text; only the pieces not in the cache are encoded, and the ids are
//! concatenated. The post-processor's special tokens (a completion's BOS) are taken
//! once from the tokenizer and put around the result, as `encode` would.
//!
//! The ids are exactly those of encoding the whole text: the construction checks
//! that on probe texts and turns the cache off, with the reason, if they differ; the
//! tests compare both on generated texts. A text with no added token is one piece
//! and is encoded as before (one automaton scan more).
//!
//! Memory: at most the capacity given, counted as 4 bytes per cached token id plus
//! 64 per piece; least-recently/frequently used pieces are evicted (`quick_cache`).
//! Keys are 128 bits of a keyed hash (a random key per process), so one client
//! cannot craft text that another client's prompt would be tokenized from.

mod split;

use crate::chat::{ChatMessage, ChatOptions};
use crate::error::TokenizerError;
use crate::limits::TokenizerLimits;
use crate::model::ModelTokenizer;
use quick_cache::Weighter;
use split::{Piece, Splitter};
use std::sync::Arc;

/// Token ids of a prompt and how many came from the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// The prompt's token ids, as [`ModelTokenizer`] would give them.
    pub ids: Vec<u32>,
    /// How many of `ids` were taken from the cache rather than encoded.
    pub cached_tokens: usize,
}

/// A [`ModelTokenizer`] with a cache of the token ids of text pieces. Shareable
/// across threads.
#[derive(Debug)]
pub struct CachedTokenizer {
    tokenizer: Arc<ModelTokenizer>,
    pieces: Result<Pieces, String>,
}

#[derive(Debug)]
struct Pieces {
    splitter: Splitter,
    entries: quick_cache::sync::Cache<u128, Arc<[u32]>, IdsWeight>,
    /// The per-process key of the piece hashes.
    key: [u8; 32],
    /// What the post-processor puts before and after a single sequence's ids; `Err`
    /// (with why) if that is not a fixed prefix and suffix, and then texts encoded
    /// with special tokens bypass the cache.
    wrap: Result<(Vec<u32>, Vec<u32>), String>,
}

/// Weight of a cached piece, in bytes: its ids and about the entry's overhead.
#[derive(Debug, Clone)]
struct IdsWeight;

impl Weighter<u128, Arc<[u32]>> for IdsWeight {
    fn weight(&self, _key: &u128, ids: &Arc<[u32]>) -> u64 {
        64 + 4 * ids.len() as u64
    }
}

/// A piece could not be encoded behind its sentinel as expected: encode the whole
/// text instead.
struct Inexact;

impl CachedTokenizer {
    /// Wraps `tokenizer` with a cache of at most `capacity_bytes`; 0 turns the cache
    /// off. The cache is also off, with the reason in [`Self::off_reason`], if this
    /// tokenizer's text cannot be cut exactly.
    pub fn new(tokenizer: Arc<ModelTokenizer>, capacity_bytes: u64) -> Self {
        let pieces = if capacity_bytes == 0 {
            Err("its capacity is 0".to_owned())
        } else {
            Pieces::new(&tokenizer, capacity_bytes)
        };
        let mut cached = Self { tokenizer, pieces };
        if let Err(reason) = cached.self_check() {
            cached.pieces = Err(reason);
        }
        cached
    }

    /// Why the cache is off, if it is.
    pub fn off_reason(&self) -> Option<&str> {
        self.pieces.as_ref().err().map(String::as_str)
    }

    /// The wrapped tokenizer.
    pub fn tokenizer(&self) -> &Arc<ModelTokenizer> {
        &self.tokenizer
    }

    /// The prompt limits.
    pub fn limits(&self) -> TokenizerLimits {
        self.tokenizer.limits()
    }

    /// Bytes the cache holds now (as it weighs them).
    pub fn cached_bytes(&self) -> u64 {
        self.pieces.as_ref().map_or(0, |p| p.entries.weight())
    }

    /// [`ModelTokenizer::encode_completion`], through the cache.
    ///
    /// # Errors
    /// As [`ModelTokenizer::encode_completion`].
    pub fn completion(&self, prompt: &str) -> Result<Encoded, TokenizerError> {
        self.encode(prompt, true)
    }

    /// [`ModelTokenizer::encode_chat`], through the cache.
    ///
    /// # Errors
    /// As [`ModelTokenizer::encode_chat`].
    pub fn chat(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
    ) -> Result<Encoded, TokenizerError> {
        let text = self.tokenizer.render_chat(messages, options)?;
        self.encode(&text, false)
    }

    /// [`ModelTokenizer::encode`], through the cache.
    ///
    /// # Errors
    /// As [`ModelTokenizer::encode`].
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Encoded, TokenizerError> {
        let limits = self.tokenizer.limits();
        limits.check_bytes(text.len())?;
        let encoded = match self.through_cache(text, add_special_tokens)? {
            Some(encoded) => encoded,
            None => Encoded {
                ids: self.tokenizer.encode_raw(text, add_special_tokens)?,
                cached_tokens: 0,
            },
        };
        limits.check_tokens(encoded.ids.len())?;
        Ok(encoded)
    }

    /// The ids of `text` from its pieces, or `None` where the cache does not apply.
    fn through_cache(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Option<Encoded>, TokenizerError> {
        let Ok(pieces) = &self.pieces else {
            return Ok(None);
        };
        let (before, after) = match (&pieces.wrap, add_special_tokens) {
            (Ok((before, after)), true) => (before.as_slice(), after.as_slice()),
            (Err(_), true) => return Ok(None),
            (_, false) => (&[][..], &[][..]),
        };
        let cut = pieces.splitter.pieces(text);
        if cut.len() == 1 && !cut[0].closed {
            return Ok(None);
        }
        let mut ids = Vec::with_capacity(before.len() + after.len() + text.len() / 3);
        ids.extend_from_slice(before);
        let mut cached_tokens = 0;
        for piece in &cut {
            let key = piece.closed.then(|| pieces.key_of(piece));
            if let Some(hit) = key.and_then(|k| pieces.entries.get(&k)) {
                ids.extend_from_slice(&hit);
                cached_tokens += hit.len();
                continue;
            }
            let Ok(piece_ids) = pieces.encode_piece(&self.tokenizer, piece)? else {
                return Ok(None);
            };
            ids.extend_from_slice(&piece_ids);
            if let Some(k) = key {
                pieces.entries.insert(k, piece_ids.into());
            }
        }
        ids.extend_from_slice(after);
        Ok(Some(Encoded { ids, cached_tokens }))
    }

    /// Encodes probe texts made of the tokenizer's own added tokens with and without
    /// the cache, twice (the second time from the cache), and fails on any difference.
    fn self_check(&self) -> Result<(), String> {
        let Ok(pieces) = &self.pieces else {
            return Ok(());
        };
        let tokens = pieces.splitter.probe_tokens();
        for text in probe_texts(&tokens) {
            for special in [false, true] {
                let plain = self.tokenizer.encode_raw(&text, special);
                for _ in 0..2 {
                    let cached = self.through_cache(&text, special);
                    let same = match (&plain, &cached) {
                        (Ok(p), Ok(Some(c))) => *p == c.ids,
                        (_, Ok(None)) => true,
                        _ => false,
                    };
                    if !same {
                        return Err(format!(
                            "cut text tokenizes differently from whole text (probe {text:?})"
                        ));
                    }
                }
            }
        }
        pieces.entries.clear();
        Ok(())
    }
}

/// Texts that cut at every given token, with the whitespace, punctuation and word
/// starts around them that tokenizers treat specially.
fn probe_texts(tokens: &[&str]) -> Vec<String> {
    let mut texts = Vec::new();
    for (i, a) in tokens.iter().enumerate() {
        let b = tokens[(i + 1) % tokens.len()];
        texts.push(format!("{a}Hello, world!\n{b} x  y{a}\n\nz{b}tail "));
        texts.push(format!(" lead{a} {b}  {a}\t1234{b}é́ süß 日本{a}"));
        texts.push(format!("{a}{a}{b}\n{a}'s it{b}"));
    }
    texts
}

impl Pieces {
    fn new(tokenizer: &ModelTokenizer, capacity_bytes: u64) -> Result<Self, String> {
        let splitter = Splitter::new(tokenizer.inner())?;
        // About one entry per 2 KiB (a 512-token piece) to size the table.
        let items = usize::try_from(capacity_bytes / 2048)
            .unwrap_or(usize::MAX)
            .max(16);
        Ok(Self {
            splitter,
            entries: quick_cache::sync::Cache::with_weighter(items, capacity_bytes, IdsWeight),
            key: rand::random(),
            wrap: special_wrap(tokenizer),
        })
    }

    fn key_of(&self, piece: &Piece<'_>) -> u128 {
        let mut hasher = blake3::Hasher::new_keyed(&self.key);
        match piece.after {
            None => hasher.update(&[0]),
            Some(id) => hasher.update(&[1]).update(&id.to_le_bytes()),
        };
        hasher.update(piece.text.as_bytes());
        let hash = hasher.finalize();
        let mut first = [0u8; 16];
        first.copy_from_slice(&hash.as_bytes()[..16]);
        u128::from_le_bytes(first)
    }

    /// The ids of `piece` as they are in the whole text: a piece after a cut is
    /// encoded behind its sentinel, whose id is then dropped.
    fn encode_piece(
        &self,
        tokenizer: &ModelTokenizer,
        piece: &Piece<'_>,
    ) -> Result<Result<Vec<u32>, Inexact>, TokenizerError> {
        let Some(after) = piece.after else {
            return tokenizer.encode_raw(piece.text, false).map(Ok);
        };
        let Some(sentinel) = self.splitter.sentinel(after) else {
            return Ok(Err(Inexact));
        };
        let text = [sentinel.content.as_str(), piece.text].concat();
        let mut ids = tokenizer.encode_raw(&text, false)?;
        if ids.first() != Some(&sentinel.id) {
            return Ok(Err(Inexact));
        }
        ids.remove(0);
        Ok(Ok(ids))
    }
}

/// The ids the post-processor puts before and after a single sequence, found by
/// encoding probe texts with and without special tokens.
fn special_wrap(tokenizer: &ModelTokenizer) -> Result<(Vec<u32>, Vec<u32>), String> {
    let mut found: Option<(Vec<u32>, Vec<u32>)> = None;
    for probe in ["Hello world", "a b\nc 12"] {
        let with = tokenizer
            .encode_raw(probe, true)
            .map_err(|e| e.to_string())?;
        let without = tokenizer
            .encode_raw(probe, false)
            .map_err(|e| e.to_string())?;
        let fits = (0..=with.len().saturating_sub(without.len()))
            .filter(|&i| with.get(i..i + without.len()) == Some(without.as_slice()))
            .map(|i| (with[..i].to_vec(), with[i + without.len()..].to_vec()))
            .collect::<Vec<_>>();
        let [wrap] = fits.as_slice() else {
            return Err(
                "the post-processor's special tokens are not a fixed prefix and suffix".into(),
            );
        };
        if found.as_ref().is_some_and(|f| f != wrap) {
            return Err("the post-processor's special tokens depend on the text".into());
        }
        found = Some(wrap.clone());
    }
    found.ok_or_else(|| "no probe".into())
}
