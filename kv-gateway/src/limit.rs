//! The bound on one prompt: how many tokens, how many bytes of text, and — when the
//! bound is the engines' own context length — how much room is left for the answer.
//!
//! Why from the engines: a fixed limit unrelated to the served model refuses prompts
//! the engine would take (a 1M-token model behind a 128k default) and lets through
//! prompts it will refuse anyway, after a wasted route and forward (a 4k model). vLLM
//! publishes its context length (`max_model_len` on `GET /v1/models`); the relay and
//! the mock engines register it (`WorkerRegistration::max_model_len`), and without an
//! explicit `--max-prompt-tokens` the gateway bounds prompts by the smallest one
//! registered ([`crate::workers::WorkerUrls::max_model_len`]), so any worker the
//! router picks can serve the prompt. Where none is published the bound is
//! [`kv_tokenizer::DEFAULT_MAX_PROMPT_TOKENS`]; either way it is at most the
//! cluster's `--max-route-tokens`, the longest prompt the router accepts.
//!
//! With the engines' context length `L`, the gateway checks what vLLM checks
//! (`OpenAIServing._validate_input`), with vLLM's wording, so a client sees the same
//! 400 it would get from the engine, only without the route and the forward: a prompt
//! of `L` tokens or more is refused (it leaves no room for one output token), and so
//! is one whose tokens plus the client's `max_tokens` (a chat's
//! `max_completion_tokens`) are over `L`. An explicit `--max-prompt-tokens` is a bound
//! on the prompt only.
//!
//! The byte bound (`--max-prompt-bytes`, checked before a prompt is tokenized) follows
//! the token bound at [`kv_tokenizer::MAX_BYTES_PER_TOKEN`] bytes a token unless given.
//! The bound can change as workers come and go, so it is read once per request
//! ([`PromptLimits::current`]: one atomic load). Cost: nothing else.

use crate::error::ApiError;
use crate::workers::WorkerUrls;
use kv_tokenizer::{DEFAULT_MAX_PROMPT_TOKENS, MAX_BYTES_PER_TOKEN, TokenizerLimits};
use std::num::NonZeroUsize;

/// Where the token bound of a prompt comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptTokens {
    /// `--max-prompt-tokens`: this many tokens, whatever the engines publish.
    Explicit(NonZeroUsize),
    /// The smallest `max_model_len` the registered workers publish, else
    /// [`DEFAULT_MAX_PROMPT_TOKENS`]; at most `ceiling` tokens either way.
    FromEngines {
        /// The longest prompt the router accepts (`--max-route-tokens`), in tokens.
        ceiling: usize,
    },
}

/// The prompt bound's settings: the token bound's source, and `--max-prompt-bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLimitConfig {
    /// Where the token bound comes from.
    pub tokens: PromptTokens,
    /// `--max-prompt-bytes`, in bytes; `None`: the token bound ×
    /// [`MAX_BYTES_PER_TOKEN`].
    pub bytes: Option<NonZeroUsize>,
}

impl PromptLimitConfig {
    /// Token and byte bounds for a token bound of `tokens`.
    fn limits(&self, tokens: usize) -> TokenizerLimits {
        TokenizerLimits {
            max_prompt_tokens: tokens,
            max_prompt_bytes: self.bytes.map_or_else(
                || tokens.saturating_mul(MAX_BYTES_PER_TOKEN),
                NonZeroUsize::get,
            ),
        }
    }

    /// The largest bound there can be: what the tokenizer is built with (each request
    /// is then checked against its own, [`PromptLimits::current`]).
    pub fn ceiling(&self) -> TokenizerLimits {
        match self.tokens {
            PromptTokens::Explicit(tokens) => self.limits(tokens.get()),
            PromptTokens::FromEngines { ceiling } => self.limits(ceiling),
        }
    }
}

/// The bound of one prompt, as it stands when the prompt arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptBound {
    /// Most tokens and bytes of text.
    pub limits: TokenizerLimits,
    /// The engines' context length, in tokens, when the bound is theirs.
    pub context: Option<u64>,
}

impl PromptBound {
    /// Checks a prompt of `prompt_tokens` tokens asking for up to `max_tokens` output
    /// tokens (when the client said): against the engines' context length as vLLM
    /// does, then against the token bound.
    ///
    /// # Errors
    /// 400, in vLLM's words for the context length.
    pub fn check(&self, prompt_tokens: usize, max_tokens: Option<u64>) -> Result<(), ApiError> {
        if let Some(len) = self.context {
            let input = u64::try_from(prompt_tokens).unwrap_or(u64::MAX);
            if input >= len {
                return Err(ApiError::bad_request(format!(
                    "This model's maximum context length is {len} tokens. However, your \
                     request has {input} input tokens. Please reduce the length of the \
                     input messages."
                )));
            }
            if let Some(output) = max_tokens
                && input.saturating_add(output) > len
            {
                return Err(ApiError::bad_request(format!(
                    "'max_tokens' or 'max_completion_tokens' is too large: {output}. This \
                     model's maximum context length is {len} tokens and your request has \
                     {input} input tokens ({output} > {len} - {input})."
                )));
            }
        }
        let limit = self.limits.max_prompt_tokens;
        if prompt_tokens > limit {
            return Err(too_many(prompt_tokens, limit));
        }
        Ok(())
    }
}

/// The prompt bound, read per request from the settings and the registered workers.
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct PromptLimits {
    config: PromptLimitConfig,
    workers: WorkerUrls,
}

impl PromptLimits {
    /// The bound of `config`, following the context lengths `workers` publish.
    pub fn new(config: PromptLimitConfig, workers: WorkerUrls) -> Self {
        Self { config, workers }
    }

    /// The bound of a prompt arriving now.
    pub fn current(&self) -> PromptBound {
        match self.config.tokens {
            PromptTokens::Explicit(tokens) => PromptBound {
                limits: self.config.limits(tokens.get()),
                context: None,
            },
            PromptTokens::FromEngines { ceiling } => match self.workers.max_model_len() {
                Some(len) => {
                    let len = len.get();
                    let tokens = usize::try_from(len).unwrap_or(usize::MAX).min(ceiling);
                    PromptBound {
                        limits: self.config.limits(tokens),
                        context: Some(len),
                    }
                }
                None => PromptBound {
                    limits: self.config.limits(DEFAULT_MAX_PROMPT_TOKENS.min(ceiling)),
                    context: None,
                },
            },
        }
    }
}

/// 400 for a prompt of `tokens` tokens over the `limit`.
pub(crate) fn too_many(tokens: usize, limit: usize) -> ApiError {
    ApiError::bad_request(format!(
        "the prompt has {tokens} tokens, more than the {limit} allowed"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::WorkerId;
    use kv_events::discovery::WorkerRegistration;

    fn worker(id: u64, max_model_len: Option<u64>) -> WorkerRegistration {
        WorkerRegistration {
            worker_id: WorkerId(id),
            dp_size: 1,
            block_size: 16,
            total_kv_blocks: 100,
            url: Some("http://e:1".into()),
            epoch: 0,
            max_model_len,
            role: Default::default(),
            kv_transfer: None,
        }
    }

    fn engines(bytes: Option<usize>) -> (PromptLimits, WorkerUrls) {
        let workers = WorkerUrls::default();
        let config = PromptLimitConfig {
            tokens: PromptTokens::FromEngines { ceiling: 1 << 20 },
            bytes: bytes.and_then(NonZeroUsize::new),
        };
        (PromptLimits::new(config, workers.clone()), workers)
    }

    #[test]
    fn the_bound_follows_the_smallest_registered_context_length() {
        let (limits, workers) = engines(None);
        let default = limits.current();
        assert_eq!(default.context, None);
        assert_eq!(
            default.limits,
            TokenizerLimits::for_tokens(DEFAULT_MAX_PROMPT_TOKENS)
        );
        workers.insert(&worker(1, Some(4096)));
        workers.insert(&worker(2, Some(2048)));
        workers.insert(&worker(3, None));
        let now = limits.current();
        assert_eq!(now.context, Some(2048));
        assert_eq!(
            now.limits,
            TokenizerLimits::for_tokens(2048),
            "the bytes follow"
        );
        workers.remove(WorkerId(2));
        assert_eq!(limits.current().context, Some(4096));
        // Above the router's own bound, the router's bound holds.
        workers.insert(&worker(4, Some(10_000_000)));
        workers.remove(WorkerId(1));
        let long = limits.current();
        assert_eq!(long.limits.max_prompt_tokens, 1 << 20);
        assert_eq!(long.context, Some(10_000_000));
        assert_eq!(
            limits.config.ceiling(),
            TokenizerLimits::for_tokens(1 << 20)
        );
    }

    #[test]
    fn explicit_flags_win() {
        let workers = WorkerUrls::default();
        workers.insert(&worker(1, Some(1024)));
        let explicit = PromptLimits::new(
            PromptLimitConfig {
                tokens: PromptTokens::Explicit(NonZeroUsize::new(2048).unwrap()),
                bytes: None,
            },
            workers,
        );
        let bound = explicit.current();
        assert_eq!(
            (bound.limits, bound.context),
            (TokenizerLimits::for_tokens(2048), None)
        );
        assert!(
            bound.check(2048, Some(1_000_000)).is_ok(),
            "a prompt bound only"
        );
        assert!(bound.check(2049, None).is_err());
        let (limits, workers) = engines(Some(5000));
        workers.insert(&worker(1, Some(1024)));
        assert_eq!(limits.current().limits.max_prompt_bytes, 5000);
    }

    #[test]
    fn the_engines_context_length_is_checked_as_vllm_does() {
        let bound = PromptBound {
            limits: TokenizerLimits::for_tokens(1024),
            context: Some(1024),
        };
        assert!(bound.check(1023, None).is_ok());
        let full = bound.check(1024, None).unwrap_err();
        assert_eq!(full.status.as_u16(), 400);
        assert!(
            full.message.contains(
                "maximum context length is 1024 tokens. However, your request has 1024 input tokens"
            ),
            "{}",
            full.message
        );
        assert!(bound.check(1000, Some(24)).is_ok());
        let over = bound.check(1000, Some(25)).unwrap_err();
        assert!(
            over.message
                .contains("'max_tokens' or 'max_completion_tokens' is too large: 25"),
            "{}",
            over.message
        );
        assert!(
            over.message.contains("(25 > 1024 - 1000)"),
            "{}",
            over.message
        );
    }
}
