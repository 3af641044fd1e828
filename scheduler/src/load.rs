//! The two values that cross the write model's boundary: [`PrefillLoadHint`], the
//! prefill load a booking brings in, and [`RankLoad`], the load projection a read
//! takes out.
//!
//! They live in their own top-level leaf file, below the model (`sequences/`), the
//! configuration, the busy check, the policies and the request types, which all use
//! them: each depends on this file alone, and nothing here depends back on them.

use std::time::Duration;

/// The prefill load a booking adds, computed once by the caller at routing time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefillLoadHint {
    /// Prompt tokens the rank must prefill (not cached there), in tokens.
    pub initial_effective_prefill_tokens: u64,
    /// How long that prefill should take; with a value, the load decays linearly to
    /// 0 over it once the request is the rank's oldest in-flight prefill. `None`: the
    /// load stays until `MarkPrefillCompleted`.
    pub expected_prefill_duration: Option<Duration>,
}

/// The derived load of one (worker, dp_rank) at a moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankLoad {
    /// In-flight prefill tokens, the oldest decayed, in tokens (cached prefix tokens
    /// are excluded at booking).
    pub active_prefill_tokens: u64,
    /// KV blocks held by booked requests until they are freed, in blocks; with KV
    /// reuse, a prefix shared by several requests counts once.
    pub active_decode_blocks: u64,
    /// Requests booked here and not yet freed.
    pub active_requests: usize,
    /// Σ uncached prompt tokens of every active request here, prefilling or decoding,
    /// in tokens (TensorRT-LLM's per-rank "active tokens"); does not decay.
    pub active_uncached_tokens: u64,
    /// Σ KV blocks of every active request, a prefix shared by several requests
    /// counted once per request, in blocks: the context that decode attention reads
    /// for each running sequence in every step.
    pub active_context_blocks: u64,
}
