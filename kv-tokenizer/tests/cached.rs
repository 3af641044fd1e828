//! The piece cache gives exactly the ids of encoding the whole text: a differential
//! test against the plain tokenizer on generated texts, for a Llama-3-style byte-level
//! BPE (the fixture in `tests/data`) and for a Metaspace tokenizer whose pieces
//! depend on whether they start the text (`prepend_scheme: first`).
#![allow(clippy::unwrap_used)]

use kv_tokenizer::{CachedTokenizer, ChatMessage, ChatOptions, ModelTokenizer, TokenizerLimits};
use proptest::prelude::*;
use std::path::PathBuf;
use std::sync::Arc;

const MIB: u64 = 1 << 20;

fn fixture() -> Arc<ModelTokenizer> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    Arc::new(ModelTokenizer::from_dir(dir, TokenizerLimits::default()).unwrap())
}

/// A word-level tokenizer that tells `▁Hello` (a word after a space, or at the start
/// of the text) from `Hello`, with `<s>` and `</s>` as special tokens.
fn metaspace_first() -> Arc<ModelTokenizer> {
    let json = r#"{
      "version": "1.0",
      "added_tokens": [
        {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
      ],
      "normalizer": null,
      "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true},
      "post_processor": {"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
      "decoder": null,
      "model": {"type": "WordLevel", "unk_token": "[UNK]",
        "vocab": {"[UNK]": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "Hello": 4, "▁world": 5, "world": 6, "▁": 7}}
    }"#;
    Arc::new(ModelTokenizer::from_parts(json, None, None, TokenizerLimits::default()).unwrap())
}

fn text(fragments: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(fragments), 0..40).prop_map(|f| f.concat())
}

const LLAMA_FRAGMENTS: &[&str] = &[
    "<|bos|>",
    "<|eos|>",
    "<|start|>",
    "<|end|>",
    " ",
    "  ",
    "\n",
    "\n\n",
    "Hello",
    " world",
    ",",
    "'s",
    "123",
    "4",
    "é",
    "日本",
    "\t",
    "x",
    "!",
    "<|",
    "|>",
];
const METASPACE_FRAGMENTS: &[&str] = &["<s>", "</s>", " ", "Hello", "world", " Hello", "\n"];

/// Encodes `text` through `cached` twice (the second time from the cache) and
/// compares both with the plain tokenizer, with and without special tokens.
fn assert_same(cached: &CachedTokenizer, text: &str) {
    for special in [false, true] {
        let plain = cached.tokenizer().encode(text, special).unwrap();
        for turn in 0..2 {
            let got = cached.encode(text, special).unwrap();
            assert_eq!(got.ids, plain, "{text:?} special={special} turn={turn}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn byte_level_bpe_ids_are_those_of_the_whole_text(t in text(LLAMA_FRAGMENTS)) {
        let cached = CachedTokenizer::new(fixture(), MIB);
        prop_assert_eq!(cached.off_reason(), None);
        assert_same(&cached, &t);
    }

    #[test]
    fn metaspace_first_ids_are_those_of_the_whole_text(t in text(METASPACE_FRAGMENTS)) {
        let cached = CachedTokenizer::new(metaspace_first(), MIB);
        prop_assert_eq!(cached.off_reason(), None);
        assert_same(&cached, &t);
    }
}

#[test]
fn a_piece_after_a_special_token_is_not_taken_for_the_start_of_the_text() {
    // "Hello" starts the text (▁Hello) but not the piece after <s> (Hello): encoded
    // on its own, that piece would come out as ▁Hello.
    let cached = CachedTokenizer::new(metaspace_first(), MIB);
    let got = cached.encode("Hello<s>Hello", false).unwrap();
    assert_eq!(got.ids, [3, 1, 4]);
    assert_eq!(
        cached.encode("Hello<s>Hello", false).unwrap().cached_tokens,
        2
    );
}

#[test]
fn the_next_turn_of_a_chat_encodes_only_what_is_new() {
    let cached = CachedTokenizer::new(fixture(), MIB);
    let options = ChatOptions::default();
    let mut chat = vec![
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new("user", "Tell me about block hashes."),
    ];
    let first = cached.chat(&chat, &options).unwrap();
    // Only a piece repeated inside the first chat ("\n<|start|>") can come from the cache.
    assert!(first.cached_tokens <= 4, "{}", first.cached_tokens);
    chat.push(ChatMessage::new("assistant", "They identify KV blocks."));
    chat.push(ChatMessage::new("user", "And prefix matches?"));
    let second = cached.chat(&chat, &options).unwrap();
    assert_eq!(
        second.ids,
        cached.tokenizer().encode_chat(&chat, &options).unwrap()
    );
    // Everything up to the generation prompt of the first turn was cached.
    let shared = first
        .ids
        .iter()
        .zip(&second.ids)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(second.cached_tokens > first.cached_tokens && second.cached_tokens <= shared);
    assert!(
        second.cached_tokens >= shared - 8,
        "{} of {shared}",
        second.cached_tokens
    );
}

#[test]
fn the_cache_stays_within_its_capacity() {
    let capacity = 64 * 1024;
    let cached = CachedTokenizer::new(fixture(), capacity);
    for i in 0..2000 {
        let text = format!("piece number {i} with some words<|end|>tail");
        cached.encode(&text, true).unwrap();
    }
    assert!(cached.cached_bytes() > 0);
    assert!(
        cached.cached_bytes() <= capacity,
        "{}",
        cached.cached_bytes()
    );
}

#[test]
fn limits_apply_as_without_the_cache() {
    let tokenizer = ModelTokenizer::from_dir(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data"),
        TokenizerLimits {
            max_prompt_bytes: 64,
            max_prompt_tokens: 5,
        },
    )
    .unwrap();
    let cached = CachedTokenizer::new(Arc::new(tokenizer), MIB);
    let long = "word ".repeat(20);
    assert_eq!(
        cached.encode(&long, true).unwrap_err().to_string(),
        cached
            .tokenizer()
            .encode(&long, true)
            .unwrap_err()
            .to_string()
    );
    let many = "a<|end|>b<|end|>c<|end|>";
    assert_eq!(
        cached.encode(many, true).unwrap_err().to_string(),
        cached
            .tokenizer()
            .encode(many, true)
            .unwrap_err()
            .to_string()
    );
}

#[test]
fn a_zero_capacity_turns_the_cache_off() {
    let cached = CachedTokenizer::new(fixture(), 0);
    assert!(cached.off_reason().is_some());
    let got = cached.encode("a<|end|>b", true).unwrap();
    assert_eq!(got.cached_tokens, 0);
    assert_eq!(
        got.ids,
        cached.tokenizer().encode("a<|end|>b", true).unwrap()
    );
}
