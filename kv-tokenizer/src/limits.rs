//! Input bounds: every prompt is measured before it is tokenized, and its token count
//! is checked before it is handed on, so a huge prompt is an error rather than an
//! allocation proportional to whatever a client sent.

/// Default [`Limits::max_prompt_bytes`]: 4 MiB, about a million tokens of English.
pub const DEFAULT_MAX_PROMPT_BYTES: usize = 4 << 20;
/// Default [`Limits::max_prompt_tokens`]: 131,072 tokens (a 128k-context model).
pub const DEFAULT_MAX_PROMPT_TOKENS: usize = 131_072;

/// Bounds on one prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest prompt text accepted for encoding (a completion prompt, or a rendered
    /// chat), in bytes. Checked before the tokenizer runs; the tokenizer's own memory is
    /// proportional to this.
    pub max_prompt_bytes: usize,
    /// Most tokens an encoded prompt may have, in tokens (special tokens included).
    pub max_prompt_tokens: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_prompt_bytes: DEFAULT_MAX_PROMPT_BYTES,
            max_prompt_tokens: DEFAULT_MAX_PROMPT_TOKENS,
        }
    }
}
