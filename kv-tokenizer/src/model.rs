//! [`ModelTokenizer`]: a model directory's tokenizer, special tokens and chat
//! template, with prompt limits (see the crate docs for what it reproduces of vLLM
//! and SGLang).

use crate::chat::{ChatMessage, ChatOptions, ChatTemplate};
use crate::config::{SpecialTokens, TokenizerConfigJson};
use crate::error::TokenizerError;
use crate::limits::TokenizerLimits;
use std::path::Path;
use std::str::FromStr;

/// The tokenizer file of a model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The tokenizer config file of a model directory (optional).
pub const CONFIG_FILE: &str = "tokenizer_config.json";
/// A stand-alone chat template file (optional; overrides the config's template).
pub const TEMPLATE_FILE: &str = "chat_template.jinja";

/// A model's tokenizer, special tokens and chat template, with prompt limits.
#[derive(Debug)]
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    config: TokenizerConfigJson,
    template: Option<ChatTemplate>,
    limits: TokenizerLimits,
}

impl ModelTokenizer {
    /// Loads `dir/tokenizer.json`, and `dir/tokenizer_config.json` and
    /// `dir/chat_template.jinja` when present.
    ///
    /// # Errors
    /// [`TokenizerError::Read`] if `tokenizer.json` is missing or a file is unreadable;
    /// [`TokenizerError::MalformedTokenizer`], [`TokenizerError::MalformedConfig`] or
    /// [`TokenizerError::BadTemplate`] if a file's content is unusable.
    pub fn from_dir(
        dir: impl AsRef<Path>,
        limits: TokenizerLimits,
    ) -> Result<Self, TokenizerError> {
        let dir = dir.as_ref();
        let tokenizer = read(&dir.join(TOKENIZER_FILE))?;
        let config = read_optional(&dir.join(CONFIG_FILE))?;
        let template = read_optional(&dir.join(TEMPLATE_FILE))?;
        Self::from_parts(&tokenizer, config.as_deref(), template.as_deref(), limits)
    }

    /// Builds a tokenizer from file contents: `tokenizer_json` (required),
    /// `config_json` (`tokenizer_config.json`) and `template` (a Jinja chat template
    /// that replaces the config's).
    ///
    /// # Errors
    /// As [`Self::from_dir`], without the read errors.
    pub fn from_parts(
        tokenizer_json: &str,
        config_json: Option<&str>,
        template: Option<&str>,
        limits: TokenizerLimits,
    ) -> Result<Self, TokenizerError> {
        let mut tokenizer = tokenizers::Tokenizer::from_str(tokenizer_json)
            .map_err(TokenizerError::MalformedTokenizer)?;
        tokenizer
            .with_truncation(None)
            .map_err(TokenizerError::MalformedTokenizer)?;
        tokenizer.with_padding(None);
        let mut config = match config_json {
            Some(json) => TokenizerConfigJson::parse(json)?,
            None => TokenizerConfigJson::default(),
        };
        if let Some(t) = template {
            config.chat_template = Some(t.to_owned());
        }
        let template = match &config.chat_template {
            Some(source) => Some(ChatTemplate::new(source, &config.special_tokens)?),
            None => None,
        };
        Ok(Self {
            tokenizer,
            config,
            template,
            limits,
        })
    }

    /// The prompt limits.
    pub fn limits(&self) -> TokenizerLimits {
        self.limits
    }

    /// The special tokens from `tokenizer_config.json`.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.config.special_tokens
    }

    /// `model_max_length` from `tokenizer_config.json`, in tokens, if it is a real bound.
    pub fn model_max_length(&self) -> Option<u64> {
        self.config.model_max_length
    }

    /// Whether the model has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Vocabulary size including added tokens, in tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The id of a token string (e.g. a special token), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Encodes a completion prompt as vLLM's `/v1/completions` does: with special
    /// tokens (the post-processor's BOS/EOS), in token ids.
    ///
    /// # Errors
    /// [`TokenizerError::PromptTooLarge`] / [`TokenizerError::TooManyTokens`] past the
    /// limits; [`TokenizerError::Encode`] if the tokenizer fails.
    pub fn encode_completion(&self, prompt: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode(prompt, true)
    }

    /// Renders `messages` with the chat template (see [`ChatTemplate::render`]).
    ///
    /// # Errors
    /// [`TokenizerError::NoChatTemplate`], or the render's errors.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
    ) -> Result<String, TokenizerError> {
        let template = self
            .template
            .as_ref()
            .ok_or(TokenizerError::NoChatTemplate)?;
        template.render(messages, options)
    }

    /// Renders and encodes a chat as vLLM's `/v1/chat/completions` does: the rendered
    /// text is encoded without special tokens (the template wrote them), in token ids.
    ///
    /// # Errors
    /// As [`Self::render_chat`] and [`Self::encode`].
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
    ) -> Result<Vec<u32>, TokenizerError> {
        let text = self.render_chat(messages, options)?;
        self.encode(&text, false)
    }

    /// Encodes `text`, adding the post-processor's special tokens if
    /// `add_special_tokens`; the length is checked against [`TokenizerLimits::max_prompt_bytes`]
    /// before encoding and the result against [`TokenizerLimits::max_prompt_tokens`].
    ///
    /// # Errors
    /// [`TokenizerError::PromptTooLarge`], [`TokenizerError::TooManyTokens`],
    /// [`TokenizerError::Encode`].
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        self.limits.check_bytes(text.len())?;
        let ids = self.encode_raw(text, add_special_tokens)?;
        self.limits.check_tokens(ids.len())?;
        Ok(ids)
    }

    /// Encodes `text` without checking the limits.
    pub(crate) fn encode_raw(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(TokenizerError::Encode)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The Hugging Face tokenizer.
    pub(crate) fn inner(&self) -> &tokenizers::Tokenizer {
        &self.tokenizer
    }

    /// Decodes token ids to text (ids outside the vocabulary are skipped), leaving out
    /// special tokens if `skip_special_tokens` (vLLM's default for outputs).
    ///
    /// # Errors
    /// [`TokenizerError::Decode`] if the decoder fails (e.g. invalid byte sequences in
    /// a byte-level vocabulary are replaced, not errors).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(TokenizerError::Decode)
    }
}

fn read(path: &Path) -> Result<String, TokenizerError> {
    std::fs::read_to_string(path).map_err(|e| TokenizerError::read(path, e))
}

fn read_optional(path: &Path) -> Result<Option<String>, TokenizerError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(TokenizerError::read(path, e)),
    }
}
