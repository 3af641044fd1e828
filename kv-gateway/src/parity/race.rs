//! Mismatches checked against the router: did a KV event race the route?
//!
//! **Why.** The router's picture can be right and still disagree with the engine,
//! because the index is read at the decision and the engine's cache moves on:
//!
//! - *An eviction after the decision* (an over-claim). The engine evicts predicted
//!   prefix blocks before the request's prefill, recomputes and re-stores them, and
//!   reports fewer cached tokens than predicted. Asking the index at answer time cannot
//!   tell (the request re-stored the blocks). The route reply names the chosen rank's
//!   KV event position at the decision (`kv_position`), and the router remembers recent
//!   removals per rank: the monitor asks `{ns}.router.removals` whether the first block
//!   the engine did not serve was removed from that rank after that position
//!   (`docs/protocol.md`, "Removals"). If so the answer is counted `evicted`.
//! - *A store not yet indexed at the decision* (an under-claim past the reply's
//!   `in_flight_blocks`). The engine served a prefix whose `Stored` events were still
//!   on their way (stored by a request already freed, so no booking names them). The
//!   monitor asks `{ns}.router.overlap` how many leading blocks of the prefix the
//!   engine served the rank holds *now*; if all of them, the picture was late, not
//!   wrong, and the answer is counted `in_flight`. Prefix match is deterministic, so an
//!   index that now holds the prefix learned it after the decision; the request being
//!   judged cannot have taught it (an engine does not store the blocks it served from
//!   cache). A worker whose events never arrive or never match the router's hashes
//!   (hash seed or salt, block size, tokenizer) never has its index hold the prefix
//!   under the gateway's hashes, so its under-claims stay. An approximate-mode router
//!   indexes its own decisions (this request's included) and confirms nothing.
//!
//! Both excuses never flag a worker; on any other answer, none in time, or an error,
//! the mismatch stays. An engine that never publishes its removals is never excused.
//!
//! **Cost.** Per answer: one reference to the prompt's token ids, which the request
//! already holds (so they live until the answer is judged, no copy); the check may
//! hash its full blocks before the last token, at most [`MAX_OVERLAP_HASHES`]. A copy
//! of those ids cost ~1 µs for 32k tokens, and hashing them on every answer instead
//! 10–35 times as much (`race_cost`: 37 µs for 32k tokens at 16-token blocks), so
//! blocks are hashed only on a mismatch (a few per thousand answers in a
//! healthy fleet), which also costs one NATS round trip of at most [`ASK_DEADLINE`],
//! off the answer's path (a spawned task). An under-claim whose served prefix is
//! longer than the blocks kept is not asked about and stays.

use super::{Judged, Outcome, Prediction};
use kv_events::routing::overlap::{MAX_OVERLAP_HASHES, OverlapAnswer, OverlapQuery, OverlapReply};
use kv_events::routing::{
    EventPosition, MAX_REMOVAL_HASHES, RemovalsQuery, RemovalsReply, RouteDecision,
};
use kv_events::{DpRank, LocalBlockHash, Subjects, compute_block_hashes, decode, encode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::time::Duration;

/// How long a mismatch waits for the router's answer before it is counted as one: a
/// request-reply inside one NATS cluster takes well under a millisecond, and the
/// answer's judgement waits for nothing else.
pub const ASK_DEADLINE: Duration = Duration::from_millis(250);

/// Asks the router's removals (`{ns}.router.removals`) and overlap
/// (`{ns}.router.overlap`) services.
#[derive(Clone)]
pub struct RouterAsker {
    nats: async_nats::Client,
    removals: String,
    overlap: String,
    deadline: Duration,
}

impl RouterAsker {
    /// An asker on `nats` for the namespace of `subjects`, waiting [`ASK_DEADLINE`].
    pub fn new(nats: async_nats::Client, subjects: &Subjects) -> Self {
        Self {
            nats,
            removals: subjects.router_removals(),
            overlap: subjects.router_overlap(),
            deadline: ASK_DEADLINE,
        }
    }

    /// Whether the router says `check`'s mismatch was a race: for an over-claim, the
    /// first block the engine did not serve was removed after the decision (or the
    /// rank was cleared); for an under-claim, the index now holds every block the
    /// engine served, from KV events.
    ///
    /// # Errors
    /// A description when no router answered in time, the reply does not decode, or
    /// the router refused the query.
    pub(crate) async fn raced(&self, check: &Check) -> Result<bool, String> {
        match check {
            Check::Removals(query) => {
                match self.ask::<_, RemovalsReply>(&self.removals, query).await? {
                    RemovalsReply::Answered(a) => Ok(a.cleared || a.removed.first() == Some(&0)),
                    RemovalsReply::Error(e) => Err(format!("refused: {}", e.message)),
                }
            }
            Check::Overlap(query) => match self.ask(&self.overlap, query).await? {
                OverlapReply::Answered(a) => Ok(confirms(query, &a)),
                OverlapReply::Error(e) => Err(format!("refused: {}", e.message)),
            },
        }
    }

    async fn ask<Q: Serialize, R: DeserializeOwned>(
        &self,
        subject: &str,
        query: &Q,
    ) -> Result<R, String> {
        let payload = encode(query).map_err(|e| format!("encoding the query: {e}"))?;
        let request = async_nats::client::Request::new()
            .payload(payload.into())
            .timeout(Some(self.deadline));
        let reply = (self.nats.send_request(subject.to_owned(), request).await)
            .map_err(|e| format!("no answer on {subject}: {e}"))?;
        decode(&reply.payload).map_err(|e| format!("malformed reply: {e}"))
    }
}

/// Whether `answer` shows the index now holds every block of `query` (the prefix the
/// engine served), from KV events.
pub(crate) fn confirms(query: &OverlapQuery, answer: &OverlapAnswer) -> bool {
    !answer.approximate && answer.overlap_blocks as usize >= query.block_hashes.len()
}

/// The outcome of a mismatch once the router said whether it was a race (`Ok(true)`):
/// an over-claim becomes `evicted`, an under-claim `in_flight`; anything else stays.
pub(crate) fn settled(outcome: Outcome, raced: Result<bool, String>) -> Outcome {
    match (outcome, raced) {
        (Outcome::OverClaim, Ok(true)) => Outcome::Evicted,
        (Outcome::UnderClaim, Ok(true)) => Outcome::InFlight,
        (outcome, _) => outcome,
    }
}

/// The question one mismatch asks the router.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Check {
    /// An over-claim: were the blocks past the engine's count removed after the route?
    Removals(RemovalsQuery),
    /// An under-claim: does the rank hold the prefix the engine served now?
    Overlap(OverlapQuery),
}

/// What an answer needs to be checked against the router.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Race {
    dp_rank: DpRank,
    /// The rank's position at the decision; `None`: the router keeps no removals.
    after: Option<EventPosition>,
    /// The prompt's token ids, shared with the request.
    tokens: Arc<[u32]>,
    /// How many of them the check may hash: the prompt's full blocks before its last
    /// token (the most an engine serves from cache), at most [`MAX_OVERLAP_HASHES`]
    /// blocks. Hashed only on a mismatch: hashing every answer cost 13–36 times a
    /// copy of them, and sharing them costs less than either.
    reusable: usize,
}

impl Race {
    /// The check for `decision` on a prompt of `tokens` at `block_size` tokens a
    /// block; `None` when the prompt has no full block before its last token.
    pub(crate) fn new(
        decision: &RouteDecision,
        tokens: &Arc<[u32]>,
        block_size: u32,
    ) -> Option<Self> {
        let block = block_size.max(1) as usize;
        let blocks = (tokens.len().saturating_sub(1) / block).min(MAX_OVERLAP_HASHES);
        (blocks > 0).then(|| Self {
            dp_rank: decision.dp_rank,
            after: decision.kv_position.as_deref().copied(),
            tokens: Arc::clone(tokens),
            reusable: blocks * block,
        })
    }

    /// What to ask the router about `judged`, an answer to `prediction`: `None` when it
    /// is no mismatch, or nothing can be asked of it.
    pub(crate) fn check(&self, prediction: &Prediction, judged: &Judged) -> Option<Check> {
        let block = u64::from(prediction.block_size.max(1));
        let blocks = |tokens: u64| usize::try_from(tokens.div_ceil(block)).ok();
        let kept = self.reusable / block as usize;
        match judged.outcome {
            Outcome::OverClaim => {
                let from = usize::try_from(judged.cached / block).ok()?;
                // Only the first block the engine did not serve decides.
                let to = (blocks(judged.predicted)?)
                    .min(kept)
                    .min(from.saturating_add(MAX_REMOVAL_HASHES));
                Some(Check::Removals(RemovalsQuery {
                    worker_id: prediction.worker,
                    dp_rank: self.dp_rank,
                    after: self.after?,
                    block_hashes: self.hashes(from, to, prediction.block_size)?,
                }))
            }
            // An engine count that is no whole number of blocks needs its last one too.
            Outcome::UnderClaim => Some(Check::Overlap(OverlapQuery {
                worker_id: prediction.worker,
                dp_rank: self.dp_rank,
                block_hashes: self.hashes(0, blocks(judged.cached)?, prediction.block_size)?,
            })),
            _ => None,
        }
    }

    /// The hashes of blocks `from..to`; `None` when that is empty or past the blocks
    /// kept.
    fn hashes(&self, from: usize, to: usize, block_size: u32) -> Option<Vec<LocalBlockHash>> {
        let block = block_size.max(1) as usize;
        let tokens =
            self.tokens[..self.reusable].get(from.checked_mul(block)?..to.checked_mul(block)?)?;
        (!tokens.is_empty()).then(|| compute_block_hashes(tokens, block_size))
    }
}

#[cfg(test)]
#[path = "race_tests.rs"]
mod tests;
