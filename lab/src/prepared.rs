//! A trace prepared for simulation ([`PreparedTrace`]): every prompt mapped onto
//! engine blocks and given its derived session once, then shared (read-only) by every
//! run of a study. Costs one pass over the trace and one hash per engine block.

use engine_model::trace::{BlockMapping, TraceRequest};
use kv_events::LocalBlockHash;

/// A trace prepared for simulation: every prompt mapped onto engine blocks once, shared
/// by all runs.
#[derive(Debug, Clone)]
pub struct PreparedTrace {
    pub(crate) requests: Vec<PreparedRequest>,
    pub(crate) block_size: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct PreparedRequest {
    pub(crate) timestamp_ms: u64,
    pub(crate) prompt_tokens: u64,
    pub(crate) max_tokens: u64,
    pub(crate) block_hashes: Vec<LocalBlockHash>,
    /// The session derived from the trace's prefix chains ([`crate::sessions`]).
    pub(crate) session: u32,
}

impl PreparedTrace {
    /// Maps every request of `trace` onto engine blocks with `mapping` and derives its
    /// session (the `sessions` module). A request with
    /// `output_length` 0 asks for 1 token (the first token is always produced), as the
    /// online replay does.
    pub fn new(trace: &[TraceRequest], mapping: BlockMapping) -> Self {
        let requests = trace
            .iter()
            .zip(crate::sessions::derive(trace))
            .map(|(r, session)| PreparedRequest {
                timestamp_ms: r.timestamp_ms,
                prompt_tokens: r.input_length,
                max_tokens: r.output_length.max(1),
                block_hashes: mapping.block_hashes(r),
                session,
            })
            .collect();
        Self {
            requests,
            block_size: mapping.engine_block_size(),
        }
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// True when the trace has no request.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Tokens per engine block the prompts were mapped to.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Span of the arrivals, from the first to the last, in trace ms.
    pub fn span_ms(&self) -> u64 {
        match (self.requests.first(), self.requests.last()) {
            (Some(a), Some(b)) => b.timestamp_ms - a.timestamp_ms,
            _ => 0,
        }
    }

    /// `(prompt tokens, engine block hashes)` of every request, in arrival order.
    pub fn prompts(&self) -> impl Iterator<Item = (u64, &[LocalBlockHash])> {
        self.requests
            .iter()
            .map(|r| (r.prompt_tokens, r.block_hashes.as_slice()))
    }
}
