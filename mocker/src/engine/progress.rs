//! Where a rank sends a request's results: a NATS reply inbox (the mock protocol's two
//! messages) or, for the HTTP front end, a [`watch`] channel of [`Progress`] that a
//! streaming response reads token by token.
//!
//! A watch channel holds only the latest state, so a slow HTTP client never makes the
//! rank buffer tokens: the reader compares `output_tokens` with what it has sent and
//! writes the difference. Cost: one small struct per request.

use async_nats::Subject;
use tokio::sync::watch;

/// A request's state as the engine last reported it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// Set when prefill ended: prompt tokens served from the prefix cache, in tokens.
    pub cached_tokens: Option<u64>,
    /// Tokens generated so far, in tokens (0 until the first token).
    pub output_tokens: u64,
    /// True once the request finished (all `max_tokens` generated) and freed its KV.
    pub finished: bool,
    /// Set (lowercase reason) when the request was rejected or failed; final.
    pub error: Option<String>,
}

/// Where the results of one accepted request go.
#[derive(Debug)]
pub(super) enum Reply {
    /// The NATS protocol: `first_token`, then `finished` (or `error`) to this inbox.
    Nats(Subject),
    /// The HTTP front end: every change of the request's [`Progress`].
    Stream(watch::Sender<Progress>),
}
