//! Tokenization that matches the inference engine's, for kv-router's frontends.
//!
//! A KV-aware router only finds prefix overlap if it hashes exactly the token ids the
//! engine will cache. This crate loads a model directory's Hugging Face files —
//! `tokenizer.json` (the `tokenizers` crate, the same Rust code the Python package
//! runs) and `tokenizer_config.json` (special tokens, chat template; a
//! `chat_template.jinja` beside it wins, as in transformers) — and reproduces what vLLM
//! and SGLang do with a request:
//!
//! - **completions** ([`ModelTokenizer::encode_completion`]): the prompt text is
//!   encoded *with* special tokens. vLLM's `CompletionRequest.add_special_tokens`
//!   defaults to `true`, so the tokenizer's post-processor adds what the model expects
//!   (a BOS for Llama-style models, nothing for Qwen-style ones).
//! - **chat** ([`ModelTokenizer::encode_chat`]): the messages are rendered with the
//!   chat template (see `chat`), then encoded *without* special tokens. The template
//!   already writes the BOS; vLLM's `ChatCompletionRequest.add_special_tokens` defaults
//!   to `false` for that reason, and SGLang (via transformers'
//!   `apply_chat_template(tokenize=True)`) does the same. Adding them again would
//!   double the BOS and shift every block.
//!
//! Truncation and padding stored in `tokenizer.json` are switched off, as transformers
//! does when a request asks for neither. Nothing is downloaded: files come from the
//! directory given. Every prompt is bounded ([`TokenizerLimits`]) before it is encoded.
//!
//! Cost: loading parses `tokenizer.json` (tens of MB and ~100 ms for a large
//! vocabulary); encoding is linear in the prompt; a [`ModelTokenizer`] is immutable and
//! can be shared across threads behind an `Arc`.

mod cached;
mod chat;
mod config;
mod error;
mod limits;
mod model;
mod pyjson;

pub use cached::{CachedTokenizer, Encoded};
pub use chat::{ChatMessage, ChatOptions, ChatTemplate};
pub use config::{SpecialTokens, TokenizerConfigJson};
pub use error::{BoxedError, TokenizerError};
pub use limits::{
    DEFAULT_MAX_PROMPT_BYTES, DEFAULT_MAX_PROMPT_TOKENS, MAX_BYTES_PER_TOKEN, TokenizerLimits,
};
/// Template values (message extras, tools, template kwargs) are MiniJinja values.
pub use minijinja::Value as TemplateValue;
pub use model::{CONFIG_FILE, ModelTokenizer, TEMPLATE_FILE, TOKENIZER_FILE};

/// Any serializable value (e.g. a request's JSON `tools`) as a template value.
pub fn template_value<T: serde::Serialize>(value: &T) -> TemplateValue {
    TemplateValue::from(minijinja::value::Serde(value))
}
