//! Input bounds: every prompt is measured before it is tokenized, and its token count
//! is checked before it is handed on, so a huge prompt is an error rather than an
//! allocation proportional to whatever a client sent.
//!
//! Why bytes as well as tokens: a prompt's token count is only known after encoding
//! it, and encoding is what costs. Hugging Face `tokenizers` holds, while it encodes,
//! 150–170 bytes of memory per prompt byte (the normalized text with one
//! alignment per byte, the pre-tokenized splits, a token string per token; measured
//! in docs/studies/gateway.md, "CPU and memory per stage, text prompts"), so the byte bound is
//! what bounds a tokenizer thread's memory. [`TokenizerLimits::for_tokens`] derives it from the
//! token bound with [`MAX_BYTES_PER_TOKEN`].

use crate::error::TokenizerError;

/// Default [`TokenizerLimits::max_prompt_tokens`]: 131,072 tokens (a 128k-context model).
pub const DEFAULT_MAX_PROMPT_TOKENS: usize = 131_072;
/// Bytes per token assumed when the byte bound is derived from the token bound: 8.
/// English text averages about 4 bytes per token with today's 100k–150k-token
/// vocabularies, code about 3, CJK text about 1.5–3; only long runs of one character
/// (whitespace, `=====`) reach more, so a prompt within the token bound is within
/// this byte bound unless it is mostly such runs.
pub const MAX_BYTES_PER_TOKEN: usize = 8;
/// Default [`TokenizerLimits::max_prompt_bytes`]: [`DEFAULT_MAX_PROMPT_TOKENS`] ×
/// [`MAX_BYTES_PER_TOKEN`], 1 MiB.
pub const DEFAULT_MAX_PROMPT_BYTES: usize = DEFAULT_MAX_PROMPT_TOKENS * MAX_BYTES_PER_TOKEN;

/// Bounds on one prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenizerLimits {
    /// Longest prompt text accepted for encoding (a completion prompt, or a rendered
    /// chat), in bytes. Checked before the tokenizer runs; the tokenizer's own memory is
    /// proportional to this.
    pub max_prompt_bytes: usize,
    /// Most tokens an encoded prompt may have, in tokens (special tokens included).
    pub max_prompt_tokens: usize,
}

impl TokenizerLimits {
    /// At most `max_prompt_tokens` tokens and [`MAX_BYTES_PER_TOKEN`] bytes for each
    /// (saturating).
    pub fn for_tokens(max_prompt_tokens: usize) -> Self {
        Self {
            max_prompt_bytes: max_prompt_tokens.saturating_mul(MAX_BYTES_PER_TOKEN),
            max_prompt_tokens,
        }
    }

    /// Checks a prompt of `bytes` bytes against [`Self::max_prompt_bytes`], before
    /// anything is rendered or encoded.
    ///
    /// # Errors
    /// [`TokenizerError::PromptTooLarge`] above the bound.
    pub fn check_bytes(&self, bytes: usize) -> Result<(), TokenizerError> {
        if bytes > self.max_prompt_bytes {
            return Err(TokenizerError::PromptTooLarge {
                bytes,
                max: self.max_prompt_bytes,
            });
        }
        Ok(())
    }

    /// Checks an encoded prompt of `tokens` tokens against [`Self::max_prompt_tokens`].
    ///
    /// # Errors
    /// [`TokenizerError::TooManyTokens`] above the bound.
    pub fn check_tokens(&self, tokens: usize) -> Result<(), TokenizerError> {
        if tokens > self.max_prompt_tokens {
            return Err(TokenizerError::TooManyTokens {
                tokens,
                max: self.max_prompt_tokens,
            });
        }
        Ok(())
    }
}

impl Default for TokenizerLimits {
    fn default() -> Self {
        Self::for_tokens(DEFAULT_MAX_PROMPT_TOKENS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_bound_follows_the_token_bound() {
        assert_eq!(TokenizerLimits::default().max_prompt_bytes, 1 << 20);
        assert_eq!(TokenizerLimits::for_tokens(1000).max_prompt_bytes, 8000);
        assert_eq!(
            TokenizerLimits::for_tokens(usize::MAX).max_prompt_bytes,
            usize::MAX
        );
        let limits = TokenizerLimits::for_tokens(10);
        assert!(limits.check_bytes(80).is_ok());
        assert!(matches!(
            limits.check_bytes(81),
            Err(TokenizerError::PromptTooLarge { bytes: 81, max: 80 })
        ));
    }
}
