//! A worker's window of judged answers: when it flags a persistent mismatch, when it
//! clears it, and the likely cause ([`Cause`]) the disagreeing answers point to.

use super::{CLEAR_AT, FLAG_AT, Judged, Outcome, WINDOW};
use std::collections::VecDeque;

/// The likely cause of a worker's persistent mismatch, from the evidence of its
/// disagreeing answers, tried in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The engine counted the prompt's tokens differently from the gateway: its
    /// tokenizer or chat template differs.
    TokenizerMismatch,
    /// The engine reported cached tokens that are not a multiple of the worker's
    /// registered block size: it caches in blocks of another size.
    BlockSizeMismatch,
    /// The router predicted nothing cached while the engine reported hits: the
    /// worker's KV events do not reach the index, or never match the router's hashes
    /// (block size, hash seed or salt).
    NoMatchingEvents,
    /// Mostly over-claims with a prefix predicted.
    OverClaim,
    /// Mostly under-claims with a prefix predicted.
    UnderClaim,
}

impl Cause {
    pub(super) const ALL: [Cause; 5] = [
        Cause::TokenizerMismatch,
        Cause::BlockSizeMismatch,
        Cause::NoMatchingEvents,
        Cause::OverClaim,
        Cause::UnderClaim,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::TokenizerMismatch => "tokenizer_mismatch",
            Cause::BlockSizeMismatch => "block_size_mismatch",
            Cause::NoMatchingEvents => "no_matching_events",
            Cause::OverClaim => "over_claim",
            Cause::UnderClaim => "under_claim",
        }
    }
}

/// What the last informative answers of one worker say.
#[derive(Debug, Default)]
pub(super) struct Window {
    recent: VecDeque<Judged>,
    pub(super) flagged: Option<Cause>,
}

/// A change of a worker's flag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Change {
    Flagged(Cause, String),
    Cleared(Cause),
}

impl Window {
    /// Adds an answer; says whether the worker's flag changed.
    pub(super) fn push(&mut self, judged: Judged, block_size: u32) -> Option<Change> {
        if judged.predicted == 0 && judged.raw_cached == 0 {
            return None;
        }
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(judged);
        let wrong = self.wrong().count();
        match self.flagged {
            None if wrong >= FLAG_AT => {
                let (cause, why) = self.likely_cause(block_size);
                self.flagged = Some(cause);
                Some(Change::Flagged(cause, why))
            }
            Some(cause) if wrong <= CLEAR_AT => {
                self.flagged = None;
                Some(Change::Cleared(cause))
            }
            _ => None,
        }
    }

    fn wrong(&self) -> impl Iterator<Item = &Judged> + Clone {
        (self.recent.iter()).filter(|j| {
            !matches!(
                j.outcome,
                Outcome::Agree | Outcome::InFlight | Outcome::Evicted
            )
        })
    }

    /// The likely cause of the disagreements in the window, and why, for the log.
    fn likely_cause(&self, block_size: u32) -> (Cause, String) {
        let block = u64::from(block_size.max(1));
        let wrong = self.wrong();
        let Some(last) = wrong.clone().last() else {
            return (Cause::UnderClaim, "no disagreement".into());
        };
        let seen = format!(
            "last: predicted {} cached tokens, the engine reported {} of a {}-token prompt",
            last.predicted, last.raw_cached, last.prompt_tokens
        );
        if let Some(j) = wrong.clone().find(|j| j.engine_prompt_tokens.is_some()) {
            let engine = j.engine_prompt_tokens.unwrap_or_default();
            return (
                Cause::TokenizerMismatch,
                format!(
                    "the engine counted {engine} prompt tokens where the gateway counted {}: its tokenizer or chat template differs from the gateway's (give the gateway the engines' model files, or forward token ids: --forward tokens, --chat-forward tokens, --tokenize-via render)",
                    j.prompt_tokens
                ),
            );
        }
        if let Some(j) = wrong.clone().find(|j| j.raw_cached % block != 0) {
            return (
                Cause::BlockSizeMismatch,
                format!(
                    "the engine reported {} cached tokens, not a multiple of the worker's registered block size of {block} tokens: the engine caches in blocks of another size than the registered one; {seen}",
                    j.raw_cached
                ),
            );
        }
        if wrong.clone().all(|j| j.predicted == 0) {
            let step = wrong.clone().fold(0, |g, j| gcd(g, j.raw_cached));
            let hint = if step != block && step > 0 {
                format!(" (every hit the engine reported is a multiple of {step} tokens)")
            } else {
                String::new()
            };
            return (
                Cause::NoMatchingEvents,
                format!(
                    "the router predicts no cached prefix while the engine reports hits: the worker publishes no KV events, or the router drops them or never matches their hashes (block size, hash seed or salt differ from the router's){hint}; {seen}"
                ),
            );
        }
        let over = wrong
            .clone()
            .filter(|j| j.outcome == Outcome::OverClaim)
            .count();
        if 2 * over >= wrong.count() {
            (
                Cause::OverClaim,
                format!(
                    "the router claims prefix blocks the engine does not have: a hybrid or sliding-window model indexed without its KV cache groups, a tokenizer that splits prompts differently from the engine's, or lost removal events; {seen}"
                ),
            )
        } else {
            (
                Cause::UnderClaim,
                format!(
                    "the engine has prefix blocks the router does not know: KV events late or lost (kv_router_indexer_event_order_total), or hits the engine counts from a CPU or offload tier; {seen}"
                ),
            )
        }
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}
