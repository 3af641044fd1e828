//! Over-claims checked against the router's removals: did an eviction race the route?
//!
//! **Why.** An engine that evicts predicted prefix blocks after the route decision
//! and before the request's prefill reports fewer cached tokens than the router
//! predicted, although the router's picture was right when it decided (the request
//! then recomputes and re-stores the blocks, so asking the index at answer time
//! cannot tell). The route reply names the chosen rank's KV event position at the
//! decision (`kv_position`), and the router remembers recent removals per rank: on
//! an over-claim the monitor asks `{ns}.router.removals` whether the first block the
//! engine did not serve was removed from that rank after that position
//! (`docs/protocol.md`, "Removals"). If so the answer is counted `evicted`, which
//! never flags a worker; on any other answer, none in time, or an error, it stays an
//! `over_claim`. An engine that never publishes its removals is never excused.
//!
//! **Cost.** Per answer with a position and a predicted prefix: a copy of the
//! predicted prefix's token ids (kept until the answer is judged). Per over-claim
//! (a few per thousand answers in a healthy fleet): hashing the blocks past the
//! engine's count (at most [`MAX_REMOVAL_HASHES`]) and one NATS round trip of at most
//! [`ASK_DEADLINE`], off the answer's path (a spawned task).

use kv_events::routing::{
    EventPosition, MAX_REMOVAL_HASHES, RemovalsQuery, RemovalsReply, RouteDecision,
};
use kv_events::{DpRank, Subjects, WorkerId, compute_block_hashes, decode, encode};
use std::time::Duration;

/// How long an over-claim waits for the router's answer before it is counted as
/// one: a request-reply inside one NATS cluster takes well under a millisecond, and
/// the answer's judgement waits for nothing else.
pub const ASK_DEADLINE: Duration = Duration::from_millis(250);

/// Asks the router's removals service (`{ns}.router.removals`).
#[derive(Clone)]
pub struct RemovalsAsker {
    nats: async_nats::Client,
    subject: String,
    deadline: Duration,
}

impl RemovalsAsker {
    /// An asker on `nats` for the namespace of `subjects`, waiting [`ASK_DEADLINE`].
    pub fn new(nats: async_nats::Client, subjects: &Subjects) -> Self {
        Self {
            nats,
            subject: subjects.router_removals(),
            deadline: ASK_DEADLINE,
        }
    }

    /// Whether the router says an eviction raced the route: the query's first block
    /// was removed after its position (or the rank was cleared).
    ///
    /// # Errors
    /// A description when no router answered in time, the reply does not decode, or
    /// the router refused the query.
    pub(crate) async fn evicted(&self, query: &RemovalsQuery) -> Result<bool, String> {
        let payload = encode(query).map_err(|e| format!("encoding the query: {e}"))?;
        let request = async_nats::client::Request::new()
            .payload(payload.into())
            .timeout(Some(self.deadline));
        let reply = (self.nats.send_request(self.subject.clone(), request).await)
            .map_err(|e| format!("no answer on {}: {e}", self.subject))?;
        match decode::<RemovalsReply>(&reply.payload) {
            Ok(RemovalsReply::Answered(a)) => Ok(a.cleared || a.removed.first() == Some(&0)),
            Ok(RemovalsReply::Error(e)) => Err(format!("refused: {}", e.message)),
            Err(e) => Err(format!("malformed reply: {e}")),
        }
    }
}

/// What an answer needs to be checked against the router's removals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Race {
    dp_rank: DpRank,
    after: EventPosition,
    /// The token ids of the predicted prefix (`overlap_blocks` full blocks).
    prefix: Box<[u32]>,
}

impl Race {
    /// The check for `decision` on a prompt of `tokens` at `block_size` tokens a
    /// block; `None` when the router named no position or predicted nothing.
    pub(crate) fn new(decision: &RouteDecision, tokens: &[u32], block_size: u32) -> Option<Self> {
        let after = *decision.kv_position.as_deref()?;
        let predicted = usize::try_from(decision.overlap_blocks)
            .ok()?
            .checked_mul(block_size as usize)?;
        (predicted > 0 && predicted <= tokens.len()).then(|| Self {
            dp_rank: decision.dp_rank,
            after,
            prefix: tokens[..predicted].into(),
        })
    }

    /// The query for an answer whose engine served `served` of the predicted blocks:
    /// the blocks from the first one it did not serve, at most
    /// [`MAX_REMOVAL_HASHES`].
    pub(crate) fn query(&self, worker: WorkerId, served: u64, block_size: u32) -> RemovalsQuery {
        let block = block_size.max(1) as usize;
        let from = usize::try_from(served)
            .unwrap_or(usize::MAX)
            .saturating_mul(block)
            .min(self.prefix.len());
        let to = self
            .prefix
            .len()
            .min(from.saturating_add(MAX_REMOVAL_HASHES * block));
        RemovalsQuery {
            worker_id: worker,
            dp_rank: self.dp_rank,
            after: self.after,
            block_hashes: compute_block_hashes(&self.prefix[from..to], block_size),
        }
    }
}
