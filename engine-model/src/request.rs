//! Requests as the engine core sees them: the admitted input, its validation, and the
//! per-request progress the scheduler tracks (prefill position, tokens generated, the
//! KV space held).
//!
//! Validation happens once, when a request is added, so a request that could never run
//! (empty prompt, zero output, more KV than the whole cache) is rejected up front
//! instead of waiting forever. The cost is one chained hash per full prompt block.

use crate::cache::CacheAllocation;
use crate::kv_cache::chain_block_hashes;
use kv_events::{LocalBlockHash, RequestId, StoredBlock};

/// One inference request for one dp rank's engine core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineRequest {
    /// Frontend-chosen id, unique among the core's active requests.
    pub request_id: RequestId,
    /// One local block hash per prompt block, in prefix order (the last may be partial).
    /// Only full blocks (`prompt_tokens / block_size` of them) are cacheable.
    pub block_hashes: Vec<LocalBlockHash>,
    /// Prompt length, in tokens (at least 1).
    pub prompt_tokens: u64,
    /// Tokens to generate, in tokens (at least 1).
    pub max_tokens: u64,
    /// The prompt's token ids when the sender has them (HTTP requests), else `None`
    /// (NATS generate requests carry only block hashes). Needed to publish vLLM
    /// `BlockStored` events, which carry each block's tokens.
    pub token_ids: Option<Vec<u32>>,
}

/// Why the core refused a request; it is answered with an error and never runs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    /// `prompt_tokens` was 0.
    #[error("prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` was 0.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// More block hashes than prompt blocks: the sender uses another block size.
    #[error("{hashes} block hashes for a prompt of {max} blocks (block size mismatch?)")]
    TooManyBlockHashes {
        /// Hashes received.
        hashes: usize,
        /// `ceil(prompt_tokens / block_size)`, in blocks.
        max: u64,
    },
    /// The request alone needs more KV blocks than the rank has.
    #[error("request needs {needed} kv blocks but the cache holds {capacity}")]
    ExceedsCapacity {
        /// `ceil((prompt_tokens + max_tokens) / block_size)`, in blocks.
        needed: u64,
        /// The rank's capacity, in blocks.
        capacity: u64,
    },
    /// `token_ids` does not hold exactly `prompt_tokens` tokens.
    #[error("{token_ids} token ids for a prompt of {prompt_tokens} tokens")]
    TokenIdsLength {
        /// Token ids received.
        token_ids: usize,
        /// The prompt length, in tokens.
        prompt_tokens: u64,
    },
    /// A request with the same id is already waiting or running.
    #[error("request {0} is already active")]
    DuplicateRequestId(RequestId),
}

/// A validated request in the waiting queue.
#[derive(Debug, Clone)]
pub(super) struct Waiting {
    pub request_id: RequestId,
    pub prompt_tokens: u64,
    pub max_tokens: u64,
    /// Chained engine hashes of the full prompt blocks.
    pub prompt: Vec<StoredBlock>,
    /// KV space reserved at admission, in blocks.
    pub total_blocks: u64,
    /// The prompt's token ids, if the sender gave them.
    pub token_ids: Option<Vec<u32>>,
    /// The prompt's KV arrives over a KV transfer (a disaggregated decode): only
    /// its last token is computed, the blocks not cached are stored at admission.
    pub transferred: bool,
}

impl Waiting {
    /// Validates `req` against a rank with `block_size` tokens per block and `capacity`
    /// blocks (duplicate ids are checked by the caller).
    pub fn validate(
        req: EngineRequest,
        block_size: u32,
        capacity: u64,
    ) -> Result<Self, RejectReason> {
        if req.prompt_tokens == 0 {
            return Err(RejectReason::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(RejectReason::ZeroMaxTokens);
        }
        let bs = u64::from(block_size);
        let max = req.prompt_tokens.div_ceil(bs);
        if req.block_hashes.len() as u64 > max {
            return Err(RejectReason::TooManyBlockHashes {
                hashes: req.block_hashes.len(),
                max,
            });
        }
        let needed = req
            .prompt_tokens
            .saturating_add(req.max_tokens)
            .div_ceil(bs);
        if needed > capacity {
            return Err(RejectReason::ExceedsCapacity { needed, capacity });
        }
        if let Some(ids) = &req.token_ids
            && ids.len() as u64 != req.prompt_tokens
        {
            return Err(RejectReason::TokenIdsLength {
                token_ids: ids.len(),
                prompt_tokens: req.prompt_tokens,
            });
        }
        let full = (req.prompt_tokens / bs).min(req.block_hashes.len() as u64) as usize;
        Ok(Self {
            request_id: req.request_id,
            prompt_tokens: req.prompt_tokens,
            max_tokens: req.max_tokens,
            prompt: chain_block_hashes(&req.block_hashes[..full]),
            total_blocks: needed,
            token_ids: req.token_ids,
            transferred: false,
        })
    }

    /// Prompt tokens a prefix hit of `hit_blocks` saves, in tokens. At least the last
    /// prompt token is always computed (its logits give the first output token), as in
    /// vLLM, so the saving is capped at `prompt_tokens - 1`; a transferred prompt
    /// saves that much whatever the hit.
    pub fn skipped_tokens(&self, hit_blocks: usize, block_size: u32) -> u64 {
        if self.transferred {
            // The whole prompt's KV arrives; its last token is computed again, as
            // vLLM's decode instance does after a NIXL read.
            return self.prompt_tokens - 1;
        }
        (hit_blocks as u64 * u64::from(block_size)).min(self.prompt_tokens - 1)
    }
}

/// A request in the running batch.
#[derive(Debug, Clone)]
pub(super) struct Running {
    pub request_id: RequestId,
    pub prompt_tokens: u64,
    pub max_tokens: u64,
    pub prompt: Vec<StoredBlock>,
    /// The prompt's token ids, if the sender gave them.
    pub token_ids: Option<Vec<u32>>,
    pub alloc: CacheAllocation,
    /// Prompt tokens served from the prefix cache (GPU hit and CPU-tier loaded blocks ×
    /// block size), in tokens.
    pub cached_tokens: u64,
    /// The part of `cached_tokens` loaded back from the CPU tier, in tokens.
    pub loaded_tokens: u64,
    /// Prompt tokens whose KV exists (skipped by the hit or computed), in tokens.
    pub computed_tokens: u64,
    /// Tokens generated so far.
    pub output_tokens: u64,
    /// Tokens scheduled in the current step (prefill chunk or 1 decode token).
    pub scheduled: u64,
}

impl Running {
    /// True once every prompt token is computed; the request then decodes.
    pub fn prefill_done(&self) -> bool {
        self.computed_tokens >= self.prompt_tokens
    }

    /// Prompt tokens still to compute, in tokens.
    pub fn remaining_prefill(&self) -> u64 {
        self.prompt_tokens - self.computed_tokens.min(self.prompt_tokens)
    }

    /// Tokens of KV a decode step of this request reads, in tokens.
    pub fn context_tokens(&self) -> u64 {
        self.prompt_tokens + self.output_tokens
    }

    /// Full prompt blocks whose KV is computed but not yet cached, in prefix order.
    pub fn blocks_ready_to_commit(&self, block_size: u32) -> std::ops::Range<usize> {
        let computed_blocks = (self.computed_tokens / u64::from(block_size)) as usize;
        let done = self.alloc.committed_blocks();
        done..computed_blocks.min(self.prompt.len()).max(done)
    }
}
