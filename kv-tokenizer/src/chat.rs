//! Chat templates: OpenAI-style messages rendered to one prompt string with the
//! model's Jinja template, the way Hugging Face transformers' `apply_chat_template`
//! renders it for vLLM and SGLang.
//!
//! Why this matters: a router that hashes a prompt rendered differently from the
//! engine's (one newline, one missing BOS) finds no prefix overlap at all. So the
//! environment copies transformers' choices: `trim_blocks` and `lstrip_blocks` on,
//! loop controls (`break`/`continue`), `raise_exception(msg)` failing the render with
//! the template's message, Python's `json.dumps` as `tojson`, Python string and dict
//! methods (`.strip()`, `.startswith()`, `.items()`, … via minijinja-contrib's
//! pycompat), and the variables `messages`, `tools`, `documents`,
//! `add_generation_prompt` plus every special token (`bos_token`, `eos_token`, …) of
//! `tokenizer_config.json`. Not provided: `strftime_now` (templates that use it test
//! `is defined` and fall back to a fixed date) and multimodal content parts.
//!
//! Cost: compiling the template once at load; a render is linear in the template's
//! work over the messages.

use crate::config::SpecialTokens;
use crate::error::TokenizerError;
use crate::pyjson;
use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;

const TEMPLATE_NAME: &str = "chat_template";

/// One chat message as an OpenAI request carries it.
///
/// `content` may be a string, `null`, or a list of content parts; text parts
/// (`{"type": "text", "text": …}`) are joined with `"\n"`, as vLLM does for templates
/// that expect string content, and any other part type is a decode error. Every other
/// field (`name`, `tool_calls`, `tool_call_id`, `reasoning_content`, …) is kept in
/// `extra` and reaches the template unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, … (the template decides what it accepts).
    pub role: String,
    /// The text, or `None` (e.g. an assistant turn that only calls tools).
    #[serde(default, deserialize_with = "content_text")]
    pub content: Option<String>,
    /// Other fields of the message, passed to the template as they came.
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

impl ChatMessage {
    /// A message with only a role and text content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Some(content.into()),
            extra: BTreeMap::new(),
        }
    }
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ContentPart {
    Text { text: String },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

fn content_text<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match Option::<Content>::deserialize(d)? {
        None => None,
        Some(Content::Text(text)) => Some(text),
        Some(Content::Parts(parts)) => Some(
            parts
                .into_iter()
                .map(|ContentPart::Text { text }| text)
                .collect::<Vec<_>>()
                .join("\n"),
        ),
    })
}

/// How to render one chat, beyond its messages.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOptions {
    /// End the prompt with the header of an assistant turn, so the model answers
    /// (OpenAI chat requests: vLLM's default is `true`).
    pub add_generation_prompt: bool,
    /// The request's `tools` (JSON schemas), or `None` (the template sees `none`).
    pub tools: Option<Vec<Value>>,
    /// Retrieval documents, or `None` (the template sees `none`).
    pub documents: Option<Vec<Value>>,
    /// Extra template variables (vLLM's `chat_template_kwargs`, e.g.
    /// `enable_thinking`); they override special tokens of the same name but not the
    /// four variables above.
    pub template_kwargs: BTreeMap<String, Value>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
            tools: None,
            documents: None,
            template_kwargs: BTreeMap::new(),
        }
    }
}

/// A compiled chat template with the model's special tokens.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    special: Vec<(&'static str, Value)>,
}

impl ChatTemplate {
    /// Compiles `source` (the Jinja text of `chat_template`).
    ///
    /// # Errors
    /// [`TokenizerError::BadTemplate`] when the template does not parse.
    pub fn new(source: &str, special: &SpecialTokens) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        let mut syntax = SyntaxConfig::builder();
        syntax.trim_blocks(true).lstrip_blocks(true);
        env.set_syntax(syntax.build().map_err(TokenizerError::BadTemplate)?);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", pyjson::tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(TokenizerError::BadTemplate)?;
        let mut special_vars: Vec<(&'static str, Value)> = special
            .template_variables()
            .map(|(name, token)| (name, Value::from(token)))
            .collect();
        if !special.additional_special_tokens.is_empty() {
            let list = special.additional_special_tokens.clone();
            special_vars.push(("additional_special_tokens", Value::from(list)));
        }
        Ok(Self {
            env,
            special: special_vars,
        })
    }

    /// Renders `messages` to the prompt text the engine would build.
    ///
    /// # Errors
    /// [`TokenizerError::Render`] with the template's own message when it calls
    /// `raise_exception` (e.g. roles that do not alternate), or minijinja's message
    /// for any other failure at run time.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
    ) -> Result<String, TokenizerError> {
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        for (name, value) in &self.special {
            ctx.insert(name, value.clone());
        }
        for (name, value) in &options.template_kwargs {
            ctx.insert(name, value.clone());
        }
        ctx.insert("messages", Value::from(Serde(messages)));
        ctx.insert("tools", opt_list(&options.tools));
        ctx.insert("documents", opt_list(&options.documents));
        ctx.insert(
            "add_generation_prompt",
            Value::from(options.add_generation_prompt),
        );
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TokenizerError::Render(e.to_string()))?;
        template.render(ctx).map_err(|e| {
            TokenizerError::Render(match (e.kind(), e.detail()) {
                (ErrorKind::InvalidOperation, Some(detail)) => detail.to_owned(),
                _ => e.to_string(),
            })
        })
    }
}

fn opt_list(list: &Option<Vec<Value>>) -> Value {
    match list {
        Some(items) => Value::from(items.clone()),
        None => Value::from(()),
    }
}

/// `raise_exception(message)`: fails the render with `message`, as transformers does.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}
