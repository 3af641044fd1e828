//! The crate's one error type.

use std::path::PathBuf;

/// A boxed error from the `tokenizers` crate (which reports errors as trait objects).
pub type BoxedError = Box<dyn std::error::Error + Send + Sync>;

/// Why a tokenizer could not be loaded, or a prompt could not be rendered or encoded.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A model file could not be read (missing, unreadable).
    #[error("could not read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `tokenizer.json` is not a tokenizer the `tokenizers` crate understands.
    #[error("malformed tokenizer.json: {0}")]
    MalformedTokenizer(#[source] BoxedError),
    /// `tokenizer_config.json` is not valid JSON of the expected shape.
    #[error("malformed tokenizer_config.json: {0}")]
    MalformedConfig(#[source] serde_json::Error),
    /// A chat was to be rendered but the model has no chat template.
    #[error("the model has no chat template")]
    NoChatTemplate,
    /// The chat template does not compile.
    #[error("bad chat template: {0}")]
    BadTemplate(#[source] minijinja::Error),
    /// Rendering failed: the template called `raise_exception` (the message is the
    /// template's) or hit an error at run time (the messages do not fit it).
    #[error("chat template failed: {0}")]
    Render(String),
    /// The prompt text is over [`crate::TokenizerLimits::max_prompt_bytes`]; nothing was encoded.
    #[error("prompt of {bytes} bytes is over the limit of {max} bytes")]
    PromptTooLarge {
        /// The prompt's length, in bytes.
        bytes: usize,
        /// The limit, in bytes.
        max: usize,
    },
    /// The encoded prompt is over [`crate::TokenizerLimits::max_prompt_tokens`].
    #[error("prompt of {tokens} tokens is over the limit of {max} tokens")]
    TooManyTokens {
        /// The prompt's length, in tokens.
        tokens: usize,
        /// The limit, in tokens.
        max: usize,
    },
    /// The tokenizer failed to encode the text.
    #[error("encoding failed: {0}")]
    Encode(#[source] BoxedError),
    /// The tokenizer failed to decode token ids.
    #[error("decoding failed: {0}")]
    Decode(#[source] BoxedError),
}

impl TokenizerError {
    /// The error for a file that could not be read.
    pub(crate) fn read(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Read {
            path: path.into(),
            source,
        }
    }
}
