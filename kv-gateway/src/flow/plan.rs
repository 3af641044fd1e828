//! A request body read, checked and tokenized: what the gateway forwards
//! ([`Plan`]) and, through [`Flow::tokenize_body`], what the endpoint picker
//! (`kv-epp`) routes — one code path, so both frontends tokenize alike.

use super::{EngineRequest, Flow, Plan};
use crate::config::{ChatForward, PromptForward};
use crate::error::ApiError;
use crate::openai::{
    EngineTarget, PromptInput, chat_as_completion, max_output_tokens, parse_chat, parse_completion,
};
use kv_events::DpRank;
use kv_events::routing::{Prompt, SessionId};

/// Which OpenAI body [`Flow::tokenize_body`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// `/v1/completions`.
    Completion,
    /// `/v1/chat/completions`.
    Chat,
}

/// A request body read and tokenized, ready for a route query.
#[derive(Debug, Clone)]
pub struct Tokenized {
    /// The route query's prompt (block hashes or token ids, see `Flow::route_prompt`).
    pub prompt: Prompt,
    /// Prompt length, in tokens.
    pub prompt_tokens: usize,
    /// The session, from the caller's header or the body's `prompt_cache_key`.
    pub session: Option<SessionId>,
}

impl Flow {
    fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model == self.model.served_model_name {
            Ok(())
        } else {
            Err(ApiError::unknown_model(model))
        }
    }

    /// Parses and tokenizes a completion body, checking its model and prompt bound.
    pub(super) async fn plan_completion(
        &self,
        body: &[u8],
        session: Option<SessionId>,
    ) -> Result<Plan, ApiError> {
        let request = parse_completion(body)?;
        self.check_model(&request.model)?;
        // One bound for the whole request, though workers may come and go meanwhile.
        let bound = self.prompt.current();
        let tokens = match &request.prompt {
            PromptInput::Tokens(ids) => ids.clone(),
            PromptInput::Text(text) => {
                let body = &request.body;
                self.tokenizer.completion(text, body, bound.limits).await?
            }
        };
        bound.check(tokens.len(), max_output_tokens(&request.body, false))?;
        let forward_tokens = self.model.forward == PromptForward::Tokens
            || matches!(request.prompt, PromptInput::Tokens(_));
        let plan = Plan {
            endpoint: "completions",
            stream: request.stream,
            include_usage: request.include_usage,
            session: session.or_else(|| request.prompt_cache_key.clone()),
            tokens: tokens.into(),
            request: EngineRequest::Completion {
                request,
                forward_tokens,
            },
        };
        Ok(plan)
    }

    /// Parses and tokenizes a chat body, checking its model and prompt bound.
    pub(super) async fn plan_chat(
        &self,
        body: &[u8],
        session: Option<SessionId>,
    ) -> Result<Plan, ApiError> {
        let chat = parse_chat(body)?;
        self.check_model(&chat.model)?;
        if self.model.chat_forward == ChatForward::Tokens {
            // Refuse what tokens mode cannot do before anything is routed.
            chat_as_completion(
                &chat,
                &[],
                EngineTarget::whole(self.model.engine_api, DpRank(0)),
            )?;
        }
        let bound = self.prompt.current();
        let tokens = self
            .tokenizer
            .chat(
                chat.messages.clone(),
                chat.options.clone(),
                &chat.body,
                bound.limits,
            )
            .await?;
        bound.check(tokens.len(), max_output_tokens(&chat.body, true))?;
        let plan = Plan {
            endpoint: "chat_completions",
            stream: chat.stream,
            include_usage: chat.include_usage,
            session: session.or_else(|| chat.prompt_cache_key.clone()),
            tokens: tokens.into(),
            request: match self.model.chat_forward {
                ChatForward::Tokens => EngineRequest::ChatAsCompletion(chat),
                ChatForward::Passthrough => EngineRequest::Chat(chat),
            },
        };
        Ok(plan)
    }

    /// Parses and tokenizes a request body exactly as the gateway's own endpoints do
    /// (model check, prompt bound, session from `session` or the body's
    /// `prompt_cache_key`), for a frontend that routes but does not forward (the
    /// endpoint picker, `kv-epp`). Returns the route query's prompt.
    ///
    /// # Errors
    /// The [`ApiError`] the gateway would answer: 400 for a malformed body or a prompt
    /// over the bound, 404 for another model, 503/504 when tokenization cannot run.
    pub async fn tokenize_body(
        &self,
        endpoint: BodyKind,
        body: &[u8],
        session: Option<SessionId>,
    ) -> Result<Tokenized, ApiError> {
        let plan = match endpoint {
            BodyKind::Completion => self.plan_completion(body, session).await?,
            BodyKind::Chat => self.plan_chat(body, session).await?,
        };
        Ok(Tokenized {
            prompt_tokens: plan.tokens.len(),
            prompt: self.route_prompt(&plan.tokens),
            session: plan.session,
        })
    }
}
