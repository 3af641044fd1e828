//! The engine core of one dp rank: a deterministic, clock-free state machine for
//! vLLM-style continuous batching over a paged KV cache.
//!
//! The caller owns time. It adds requests with [`EngineCore::add_request`] and calls
//! [`EngineCore::step`] while [`EngineCore::has_work`]; each step reports how long it
//! took in model ms, the KV events it caused, which requests produced their first token
//! and which finished. The live service waits `duration_ms / time_scale` per step (`rank.rs`); an
//! offline simulator can instead advance a virtual clock by `duration_ms`. Same inputs,
//! same outputs: nothing here reads a clock or a random source.
//!
//! Scheduling per step (budget = `max_num_batched_tokens` tokens):
//! 1. every running request that finished prefill decodes 1 token (decodes first keeps
//!    inter-token latency steady; the budget always covers them because it is at least
//!    `max_num_seqs`);
//! 2. running requests with prefill left get the next chunk, in admission order;
//! 3. waiting requests are admitted FCFS while the batch has fewer than `max_num_seqs`
//!    requests, budget is left, and the KV cache can hold the request's whole footprint
//!    (`ceil((prompt + max_tokens) / block_size)` blocks, reserved up front so a running
//!    request never needs preemption); a head that does not fit blocks the queue.
//!
//! A request emits its first token in the step that computes its last prompt token and
//! then one token per step; it finishes when it has `max_tokens` tokens. Costs: O(batch
//! + prompt blocks committed) per step.
//!
//! With a CPU tier ([`EngineCore::with_cpu_tier`]), prompt blocks an admission copies
//! back from it skip prefill like a GPU hit; instead the admitting step takes
//! `cpu_tier_load_ms_per_token` per loaded token longer. The copy is synchronous in
//! this model (the whole batch waits for it), an upper bound on its cost: vLLM's
//! offloading connector loads asynchronously while other requests keep running.
//!
//! With sliding-window groups ([`EngineCore::with_hybrid`]) the cache is a
//! [`HybridCache`]: the prefix hit is the hybrid rule (its module docs), every step
//! starts by bringing the running requests' windowed working sets up to date, and
//! each step also reports the vLLM-form stores ([`StepOutput::group_stores`]).

use crate::cache::PagedCache;
use crate::config::{CpuTierConfig, EngineModelConfig, ModelConfigError};
use crate::hybrid::{GroupStore, HybridCache, HybridConfig};
use crate::kv_cache::{KvCache, chain_block_hashes};
use crate::request::{EngineRequest, RejectReason, Running, Waiting};
use crate::timing::{StepWork, TimingModel};
use kv_events::{
    ExternalBlockHash, KvCacheEventData, LoadMetrics, LocalBlockHash, RequestId, WorkerRank,
};
use std::collections::{HashMap, HashSet, VecDeque};

/// A request produced its first token (its prefill completed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirstToken {
    /// The request.
    pub request_id: RequestId,
    /// Prompt tokens served from the prefix cache (GPU hit blocks plus blocks loaded
    /// back from the CPU tier, × block size), in tokens.
    pub cached_tokens: u64,
    /// The part of `cached_tokens` loaded back from the CPU tier, in tokens.
    pub loaded_tokens: u64,
    /// Prompt length, in tokens.
    pub prompt_tokens: u64,
}

/// A request finished and released its KV space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    /// The request.
    pub request_id: RequestId,
    /// Tokens generated (equals the request's `max_tokens`).
    pub output_tokens: u64,
}

/// Everything one [`EngineCore::step`] did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepOutput {
    /// Step duration from the timing model, in model ms (0 when there was no work).
    pub duration_ms: f64,
    /// The work the duration was computed from.
    pub work: StepWork,
    /// Prompt tokens copied back from the CPU tier in this step (their load time is in
    /// `duration_ms`), in tokens.
    pub loaded_tokens: u64,
    /// KV events caused by the step (evictions at admission, blocks stored by prefill),
    /// in order.
    pub kv_events: Vec<KvCacheEventData>,
    /// The tokens of every block this step newly cached on a tier (the blocks of the
    /// `Stored` events), for requests that came with token ids; a vLLM-style publisher
    /// puts them in `BlockStored.token_ids`.
    pub block_tokens: HashMap<ExternalBlockHash, Vec<u32>>,
    /// Requests whose first token was produced in this step.
    pub first_tokens: Vec<FirstToken>,
    /// Requests that finished in this step (a request with `max_tokens == 1` appears in
    /// both lists).
    pub finished: Vec<Finished>,
    /// On a hybrid rank, every group's part of each request's blocks completed in
    /// this step, as vLLM publishes them (one `BlockStored` per group per request and
    /// step, windowed groups first); empty on a dense rank. The router-protocol form
    /// of the same stores is in `kv_events`.
    pub group_stores: Vec<GroupStore>,
}

/// Why [`EngineCore::clear`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClearError {
    /// Requests are still waiting or running.
    #[error("{active_requests} requests are still active")]
    Busy {
        /// Waiting plus running requests.
        active_requests: u64,
    },
}

/// One dp rank's engine: waiting queue, running batch, KV cache and timing model.
///
/// A clone is an independent copy of the whole state, O(cached blocks + requests);
/// the lab steps clones to measure a decision's counterfactual TTFT on every rank.
#[derive(Debug, Clone)]
pub struct EngineCore {
    config: EngineModelConfig,
    timing: TimingModel,
    cache: PagedCache,
    cpu_tier: CpuTierConfig,
    hybrid: HybridConfig,
    /// Tokens loaded back from the CPU tier by this step's admissions.
    loaded_tokens: u64,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
    active_ids: HashSet<RequestId>,
}

impl EngineCore {
    /// An idle core with an empty cache.
    ///
    /// # Errors
    /// [`ModelConfigError`] if `config` fails [`EngineModelConfig::validate`].
    pub fn new(config: EngineModelConfig, timing: TimingModel) -> Result<Self, ModelConfigError> {
        config.validate()?;
        Ok(Self {
            config,
            timing,
            cache: PagedCache::Dense(KvCache::new(config.block_size, config.num_gpu_blocks)),
            cpu_tier: CpuTierConfig::default(),
            hybrid: HybridConfig::default(),
            loaded_tokens: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            active_ids: HashSet::new(),
        })
    }

    /// Gives this (idle, empty) core a CPU tier; `cpu_tier_blocks = 0` keeps it
    /// without one.
    ///
    /// # Errors
    /// [`ModelConfigError`] if `tier` fails [`CpuTierConfig::validate`], or
    /// [`ModelConfigError::HybridWithCpuTier`] for a CPU tier on a hybrid core.
    pub fn with_cpu_tier(mut self, tier: CpuTierConfig) -> Result<Self, ModelConfigError> {
        tier.validate()?;
        if tier.cpu_tier_blocks == 0 {
            self.cpu_tier = tier;
            return Ok(self);
        }
        if self.hybrid.is_hybrid() {
            return Err(ModelConfigError::HybridWithCpuTier);
        }
        self.cache = PagedCache::Dense(
            KvCache::new(self.config.block_size, self.config.num_gpu_blocks)
                .with_cpu_tier(tier.cpu_tier_blocks),
        );
        self.cpu_tier = tier;
        Ok(self)
    }

    /// Gives this (idle, empty) core sliding-window KV cache groups beside its
    /// full-attention group (see [`crate::hybrid`]); a config without groups keeps it
    /// dense.
    ///
    /// # Errors
    /// [`ModelConfigError`] if `hybrid` fails [`HybridConfig::validate`], or
    /// [`ModelConfigError::HybridWithCpuTier`] when the core has a CPU tier.
    pub fn with_hybrid(mut self, hybrid: HybridConfig) -> Result<Self, ModelConfigError> {
        hybrid.validate()?;
        if !hybrid.is_hybrid() {
            return Ok(self);
        }
        if self.cpu_tier.cpu_tier_blocks > 0 {
            return Err(ModelConfigError::HybridWithCpuTier);
        }
        let c = &self.config;
        self.cache = PagedCache::Hybrid(HybridCache::new(
            c.block_size,
            c.num_gpu_blocks,
            hybrid.layout(c.block_size),
            c.max_num_batched_tokens,
        ));
        self.hybrid = hybrid;
        Ok(self)
    }

    /// The model configuration.
    pub fn config(&self) -> &EngineModelConfig {
        &self.config
    }

    /// The hybrid-attention shape (no sliding-window group on a dense core).
    pub fn hybrid(&self) -> &HybridConfig {
        &self.hybrid
    }

    /// The KV cache (read-only), for inspection.
    pub fn cache(&self) -> &PagedCache {
        &self.cache
    }

    /// Queues a request (FCFS).
    ///
    /// # Errors
    /// [`RejectReason`] if the request is malformed, can never fit in the cache, or its
    /// id is already active; the core is unchanged.
    pub fn add_request(&mut self, req: EngineRequest) -> Result<(), RejectReason> {
        self.enqueue(req, false)
    }

    /// Queues a request whose prompt KV was pulled from a prefill worker over a KV
    /// transfer (a disaggregated decode, vLLM's `do_remote_prefill`): at admission
    /// the prompt blocks the cache lacks are taken as loaded, so only the last
    /// prompt token is computed (as vLLM's decode instance recomputes it), and the
    /// step that computes it stores those blocks (`Stored` events), as vLLM's decode
    /// instance publishes `BlockStored` for them. The transfer's duration is the
    /// caller's to charge before it adds the request
    /// ([`Self::transfer_blocks`], [`crate::KvTransferConfig::duration_ms`]): in
    /// vLLM the read runs asynchronously while the batch keeps stepping. The first
    /// token's `cached_tokens` counts this rank's own cache hits only; the rest of
    /// the prompt (`prompt_tokens - cached_tokens`) came over the transfer.
    ///
    /// # Errors
    /// As [`Self::add_request`].
    pub fn add_transferred_request(&mut self, req: EngineRequest) -> Result<(), RejectReason> {
        self.enqueue(req, true)
    }

    /// Whole prompt blocks a KV transfer of a prompt of `prompt_tokens` tokens with
    /// local block hashes `block_hashes` pulls to this rank, in blocks: every prompt
    /// block (the last one may be partial) after the leading full blocks this rank's
    /// GPU cache holds now. A snapshot: the cache may change before the request is
    /// admitted.
    pub fn transfer_blocks(&self, block_hashes: &[LocalBlockHash], prompt_tokens: u64) -> u64 {
        let bs = u64::from(self.config.block_size);
        let full = (prompt_tokens / bs).min(block_hashes.len() as u64) as usize;
        let prompt = chain_block_hashes(&block_hashes[..full]);
        prompt_tokens.div_ceil(bs) - self.cache.hit_blocks(&prompt, prompt_tokens) as u64
    }

    fn enqueue(&mut self, req: EngineRequest, transferred: bool) -> Result<(), RejectReason> {
        if self.active_ids.contains(&req.request_id) {
            return Err(RejectReason::DuplicateRequestId(req.request_id));
        }
        let capacity = self.config.num_gpu_blocks;
        let mut waiting = Waiting::validate(req, self.config.block_size, capacity)?;
        let needed = self.cache.footprint(waiting.total_blocks);
        if needed > capacity {
            return Err(RejectReason::ExceedsCapacity { needed, capacity });
        }
        waiting.transferred = transferred;
        self.active_ids.insert(waiting.request_id.clone());
        self.waiting.push_back(waiting);
        Ok(())
    }

    /// True when a request is waiting or running, i.e. [`Self::step`] would make progress.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Requests waiting or running.
    pub fn active_requests(&self) -> u64 {
        (self.waiting.len() + self.running.len()) as u64
    }

    /// Requests in the running batch.
    pub fn running_requests(&self) -> usize {
        self.running.len()
    }

    /// Requests in the waiting queue.
    pub fn waiting_requests(&self) -> usize {
        self.waiting.len()
    }

    /// Removes a request wherever it is (vLLM's abort on a client disconnect): a
    /// waiting request is dropped; a running one leaves the batch and its KV space is
    /// released as at a normal finish (reserved blocks freed, its cached prompt blocks
    /// lose a reference and stay cached for reuse). Returns false if the id is not
    /// active. Emits no event by itself (releasing never uncaches a block).
    pub fn abort(&mut self, request_id: &RequestId) -> bool {
        if !self.active_ids.remove(request_id) {
            return false;
        }
        if let Some(i) = self
            .running
            .iter()
            .position(|r| &r.request_id == request_id)
        {
            let r = self.running.remove(i);
            self.cache.release(r.alloc);
        } else {
            self.waiting.retain(|w| &w.request_id != request_id);
        }
        true
    }

    /// Tokens generated so far by each running request that has its first token, in
    /// tokens; for streaming outputs between [`StepOutput::first_tokens`] and
    /// [`StepOutput::finished`]. O(batch).
    pub fn output_progress(&self) -> impl Iterator<Item = (&RequestId, u64)> {
        self.running
            .iter()
            .filter(|r| r.output_tokens > 0)
            .map(|r| (&r.request_id, r.output_tokens))
    }

    /// Runs one engine step (see the module docs for the schedule).
    ///
    /// An idle core returns an empty output with `duration_ms == 0`. A core with work
    /// always makes progress: with no running request every cached block is
    /// unreferenced, so the queue head (which fits the cache by validation) is admitted.
    pub fn step(&mut self) -> StepOutput {
        self.loaded_tokens = 0;
        let work = self.schedule();
        let load_ms = self.cpu_tier.cpu_tier_load_ms_per_token * self.loaded_tokens as f64;
        let mut out = StepOutput {
            duration_ms: self.timing.step_duration_ms(&work) + load_ms,
            work,
            loaded_tokens: self.loaded_tokens,
            ..StepOutput::default()
        };
        self.execute(&mut out);
        out.kv_events = self.cache.take_events();
        out.group_stores = self.cache.take_group_stores();
        for (hash, tokens) in self.cache.take_event_tokens() {
            out.block_tokens.insert(hash, tokens.to_vec());
        }
        out
    }

    /// Drops every cached block of an idle core and returns the `Cleared` event.
    ///
    /// # Errors
    /// [`ClearError::Busy`] (changing nothing) while requests are active.
    pub fn clear(&mut self) -> Result<Vec<KvCacheEventData>, ClearError> {
        let busy = ClearError::Busy {
            active_requests: self.active_requests(),
        };
        if self.has_work() {
            return Err(busy);
        }
        // With no active request nothing is referenced or reserved, so this succeeds.
        self.cache.clear().map_err(|_| busy)?;
        Ok(self.cache.take_events())
    }

    /// A truthful load snapshot of this rank, labelled `rank`.
    ///
    /// `active_prefill_tokens` counts prompt tokens still to compute for running
    /// requests plus, for waiting requests, prompt tokens beyond their current prefix
    /// hit; `active_decode_blocks` counts blocks held by running requests.
    pub fn load_metrics(&self, rank: WorkerRank) -> LoadMetrics {
        let bs = self.config.block_size;
        let running_prefill: u64 = self.running.iter().map(Running::remaining_prefill).sum();
        let waiting_prefill: u64 = self
            .waiting
            .iter()
            .map(|w| {
                let hit = self.cache.hit_blocks(&w.prompt, w.prompt_tokens);
                w.prompt_tokens - w.skipped_tokens(hit, bs)
            })
            .sum();
        LoadMetrics {
            worker_id: rank.worker_id,
            dp_rank: rank.dp_rank,
            active_decode_blocks: self.running.iter().map(|r| r.alloc.total_blocks()).sum(),
            active_prefill_tokens: running_prefill + waiting_prefill,
            kv_used_blocks: self.cache.used_blocks(),
            kv_total_blocks: self.cache.capacity(),
            num_requests_running: u32::try_from(self.running.len()).unwrap_or(u32::MAX),
            num_requests_waiting: u32::try_from(self.waiting.len()).unwrap_or(u32::MAX),
        }
    }

    /// Decides this step's tokens per request and admits waiting requests.
    fn schedule(&mut self) -> StepWork {
        let mut budget = self.config.max_num_batched_tokens;
        let mut work = StepWork::default();
        let bs = u64::from(self.config.block_size);
        for r in &mut self.running {
            let computed_blocks = (r.computed_tokens / bs) as usize;
            let prefill_done = r.prefill_done();
            self.cache
                .settle(&mut r.alloc, computed_blocks, prefill_done);
            r.scheduled = 0;
            if r.prefill_done() && budget > 0 {
                r.scheduled = 1;
                budget -= 1;
                work.decode_seqs += 1;
                work.decode_context_tokens += r.context_tokens();
            }
        }
        for r in self.running.iter_mut().filter(|r| !r.prefill_done()) {
            r.scheduled = r.remaining_prefill().min(budget);
            budget -= r.scheduled;
            work.prefill_tokens += r.scheduled;
        }
        while budget > 0 && self.running.len() < self.config.max_num_seqs as usize {
            let Some(head) = self.waiting.front() else {
                break;
            };
            let Some(alloc) =
                self.cache
                    .try_allocate(&head.prompt, head.prompt_tokens, head.total_blocks)
            else {
                break;
            };
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            let reused = alloc.hit_blocks() + alloc.loaded_blocks();
            let skipped = w.skipped_tokens(reused, self.config.block_size);
            let loaded_tokens = alloc.loaded_blocks() as u64 * bs;
            self.loaded_tokens += loaded_tokens;
            let mut r = Running {
                request_id: w.request_id,
                prompt_tokens: w.prompt_tokens,
                max_tokens: w.max_tokens,
                cached_tokens: reused as u64 * bs,
                loaded_tokens,
                prompt: w.prompt,
                token_ids: w.token_ids,
                alloc,
                computed_tokens: skipped,
                output_tokens: 0,
                scheduled: 0,
            };
            r.scheduled = r.remaining_prefill().min(budget);
            budget -= r.scheduled;
            work.prefill_tokens += r.scheduled;
            self.running.push(r);
        }
        work
    }

    /// Applies the scheduled tokens: commits newly computed prompt blocks, emits first
    /// tokens and finishes requests.
    fn execute(&mut self, out: &mut StepOutput) {
        let bs = self.config.block_size;
        for r in &mut self.running {
            if r.scheduled == 0 {
                continue;
            }
            if r.prefill_done() {
                r.output_tokens += 1;
                continue;
            }
            r.computed_tokens += r.scheduled;
            let ready = r.blocks_ready_to_commit(bs);
            self.cache.commit(
                &mut r.alloc,
                &r.prompt,
                ready,
                r.token_ids.as_deref(),
                &mut out.block_tokens,
            );
            if r.prefill_done() {
                r.output_tokens = 1;
                out.first_tokens.push(FirstToken {
                    request_id: r.request_id.clone(),
                    cached_tokens: r.cached_tokens,
                    loaded_tokens: r.loaded_tokens,
                    prompt_tokens: r.prompt_tokens,
                });
            }
        }
        let (done, still): (Vec<Running>, Vec<Running>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|r| r.output_tokens >= r.max_tokens);
        self.running = still;
        for r in done {
            self.active_ids.remove(&r.request_id);
            self.cache.release(r.alloc);
            out.finished.push(Finished {
                request_id: r.request_id,
                output_tokens: r.output_tokens,
            });
        }
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod transfer_tests;
