//! `tokenizer_config.json`: the special tokens a chat template sees and the chat
//! template itself, as Hugging Face transformers reads them.
//!
//! Only the fields that change a rendered prompt are read; everything else in the file
//! is ignored, so configs from any transformers version load. A special token may be
//! written as a plain string or as an `AddedToken` object (`{"content": "<s>", ...}`),
//! and `chat_template` as a string or as a list of `{"name", "template"}` of which the
//! one named `default` is used (transformers' rule when no template is named).

use crate::error::TokenizerError;
use serde::Deserialize;

/// The special tokens of a model, as strings (the templates' `bos_token`, `eos_token`,
/// … variables). `None` when the config does not set one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning of sequence, e.g. `<s>` or `<|begin_of_text|>`.
    pub bos_token: Option<String>,
    /// End of sequence, e.g. `</s>` or `<|eot_id|>`.
    pub eos_token: Option<String>,
    /// Unknown token.
    pub unk_token: Option<String>,
    /// Padding token.
    pub pad_token: Option<String>,
    /// Separator token (BERT-style models).
    pub sep_token: Option<String>,
    /// Classifier token (BERT-style models).
    pub cls_token: Option<String>,
    /// Mask token (BERT-style models).
    pub mask_token: Option<String>,
    /// `additional_special_tokens`, in the config's order.
    pub additional_special_tokens: Vec<String>,
}

impl SpecialTokens {
    /// The `(variable name, token)` pairs a chat template is given, in the order
    /// transformers' `special_tokens_map` lists them; unset tokens are left out.
    pub fn template_variables(&self) -> impl Iterator<Item = (&'static str, &str)> {
        [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
            ("unk_token", &self.unk_token),
            ("sep_token", &self.sep_token),
            ("pad_token", &self.pad_token),
            ("cls_token", &self.cls_token),
            ("mask_token", &self.mask_token),
        ]
        .into_iter()
        .filter_map(|(name, token)| token.as_deref().map(|t| (name, t)))
    }
}

/// What a model directory's `tokenizer_config.json` contributes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerConfigJson {
    /// The special tokens.
    pub special_tokens: SpecialTokens,
    /// The Jinja chat template source, if the model has one.
    pub chat_template: Option<String>,
    /// `model_max_length`, in tokens, when it is a real bound (transformers writes a
    /// huge float, about 1e30, for "no limit"; that reads as `None`).
    pub model_max_length: Option<u64>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TokenField {
    Plain(String),
    Added { content: String },
}

impl TokenField {
    fn into_string(self) -> String {
        match self {
            Self::Plain(s) | Self::Added { content: s } => s,
        }
    }
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateField {
    Single(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    bos_token: Option<TokenField>,
    #[serde(default)]
    eos_token: Option<TokenField>,
    #[serde(default)]
    unk_token: Option<TokenField>,
    #[serde(default)]
    pad_token: Option<TokenField>,
    #[serde(default)]
    sep_token: Option<TokenField>,
    #[serde(default)]
    cls_token: Option<TokenField>,
    #[serde(default)]
    mask_token: Option<TokenField>,
    #[serde(default)]
    additional_special_tokens: Vec<TokenField>,
    #[serde(default)]
    chat_template: Option<TemplateField>,
    #[serde(default)]
    model_max_length: Option<f64>,
}

impl TokenizerConfigJson {
    /// Parses the text of a `tokenizer_config.json`.
    ///
    /// # Errors
    /// [`TokenizerError::MalformedConfig`] when the text is not a JSON object whose
    /// special-token and template fields have the shapes described in the module docs.
    pub fn parse(json: &str) -> Result<Self, TokenizerError> {
        let raw: RawConfig = serde_json::from_str(json).map_err(TokenizerError::MalformedConfig)?;
        let token = |t: Option<TokenField>| t.map(TokenField::into_string);
        let chat_template = match raw.chat_template {
            None => None,
            Some(TemplateField::Single(t)) => Some(t),
            Some(TemplateField::Named(list)) => list
                .into_iter()
                .find(|t| t.name == "default")
                .map(|t| t.template),
        };
        // A float above 2^53 is transformers' "unbounded" marker, not a real length.
        let model_max_length = raw
            .model_max_length
            .filter(|n| (1.0..=9_007_199_254_740_992.0).contains(n))
            .map(|n| n as u64);
        Ok(Self {
            special_tokens: SpecialTokens {
                bos_token: token(raw.bos_token),
                eos_token: token(raw.eos_token),
                unk_token: token(raw.unk_token),
                pad_token: token(raw.pad_token),
                sep_token: token(raw.sep_token),
                cls_token: token(raw.cls_token),
                mask_token: token(raw.mask_token),
                additional_special_tokens: raw
                    .additional_special_tokens
                    .into_iter()
                    .map(TokenField::into_string)
                    .collect(),
            },
            chat_template,
            model_max_length,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_plain_and_added_tokens_and_named_templates() {
        let c = TokenizerConfigJson::parse(
            r#"{"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
                "eos_token": "</s>", "unk_token": null, "model_max_length": 1e30,
                "additional_special_tokens": ["<a>", {"content": "<b>"}],
                "chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}],
                "something_else": [1, 2, 3]}"#,
        )
        .unwrap();
        assert_eq!(c.special_tokens.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.special_tokens.eos_token.as_deref(), Some("</s>"));
        assert_eq!(c.special_tokens.unk_token, None);
        assert_eq!(c.special_tokens.additional_special_tokens, ["<a>", "<b>"]);
        assert_eq!(c.chat_template.as_deref(), Some("D"));
        assert_eq!(c.model_max_length, None);
        let vars: Vec<_> = c.special_tokens.template_variables().collect();
        assert_eq!(vars, [("bos_token", "<s>"), ("eos_token", "</s>")]);
    }

    #[test]
    fn real_max_length_is_kept_and_bad_shapes_are_errors() {
        let c = TokenizerConfigJson::parse(r#"{"model_max_length": 4096}"#).unwrap();
        assert_eq!(c.model_max_length, Some(4096));
        for bad in ["", "5", r#"{"bos_token": 5}"#, r#"{"chat_template": 1}"#] {
            assert!(
                matches!(
                    TokenizerConfigJson::parse(bad),
                    Err(TokenizerError::MalformedConfig(_))
                ),
                "{bad}"
            );
        }
    }
}
