//! A split fleet in the simulator: the two halves of a disaggregated request, the KV
//! transfer between them, and the engine of a `decode` rank.
//!
//! A request the router disaggregates (its decision names a prefill rank) runs as:
//!
//! 1. **prefill half** on the prefill rank, under `{id}#prefill`, with one output
//!    token (as vLLM's proxy sends it, `max_tokens` 1): queued, batched and prefix
//!    cached like any request there. Its first token is the router's
//!    `remote_prefill_done`; it finishes in the same step, and its blocks stay cached
//!    on the prefill rank;
//! 2. **transfer** of every prompt block the decode rank does not hold at that
//!    instant (its leading cached run; the partial last block always moves), at the
//!    configured bandwidth ([`crate::serving::KvTransferModel`]). It runs beside both
//!    engines' steps, as NIXL's and Mooncake's reads do;
//! 3. **decode half** on the decode rank, under `{id}`: the whole prompt joins the
//!    rank's queue; its KV is there, so its admission step only recomputes the last
//!    token, emits the first token (the TTFT, and the router's `prefill_done`, which
//!    releases the prefill half's booking) and stores the prompt's blocks (the index
//!    hears them from the decode rank too, as vLLM's decode instance publishes them).
//!    Then it decodes; its end is the router's `freed`.
//!
//! **The engine of a decode rank.** [`EngineCore`](engine_model::EngineCore) has no way
//! to receive KV without computing it, so a decode rank's core runs with a prefill
//! cost of 0 and an unbounded token budget: a transferred prompt then "computes" in
//! its admission step at no cost, which is what receiving it is. A prompt the decode
//! rank prefills itself (conditional disaggregation keeps it local) must cost what it
//! costs: the lab adds `prefill_ms_per_token` × the tokens it computed to the step
//! that emits its first token ([`Sim::local_prefill_ms`]). With the unbounded budget
//! that is the step that computes them all. What this leaves out: a long local
//! prefill on a decode rank runs as one step instead of `max_num_batched_tokens`
//! chunks (the same total stall for its batch, in one piece), and prompt blocks the
//! decode rank evicts between the transfer's start and the decode half's admission
//! come back free.
//!
//! Cost: one prefix lookup on the decode rank per transfer, O(prompt blocks).

use super::{Event, Sim, request_id};
use engine_model::{EngineModelConfig, EngineRequest, StepOutput, TimingModel, chain_block_hashes};
use kv_events::disaggregation::prefill_booking_id;

/// What a rank runs of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    /// The request itself: the whole of it, or a disaggregated request's decode half
    /// once its KV arrived.
    Request,
    /// A disaggregated request's prefill half: one output token, under `{id}#prefill`.
    PrefillHalf,
}

/// A decode rank's engine model and timing, from the fleet's: no prefill cost and no
/// token budget (module docs), and the prefill cost per token the lab charges for
/// a prompt it prefills itself, in ms.
pub(super) fn decode_engine(
    engine: EngineModelConfig,
    timing: TimingModel,
) -> (EngineModelConfig, TimingModel, Option<f64>) {
    (
        EngineModelConfig {
            max_num_batched_tokens: u64::MAX,
            ..engine
        },
        TimingModel {
            prefill_ms_per_token: 0.0,
            ..timing
        },
        Some(timing.prefill_ms_per_token),
    )
}

impl Sim<'_> {
    /// Queues `part` of request `index` on `rank` at `now` and starts a step there if
    /// the rank is idle; an engine's refusal rejects the request and frees its
    /// bookings.
    pub(super) fn admit(&mut self, index: usize, rank: usize, part: Part, now: u64) {
        let request = &self.trace.requests[index];
        let id = request_id(index);
        let (engine_id, max_tokens) = match part {
            Part::Request => (id.clone(), request.max_tokens),
            Part::PrefillHalf => (prefill_booking_id(&id), 1),
        };
        let engine_request = EngineRequest {
            request_id: engine_id.clone(),
            block_hashes: request.block_hashes.clone(),
            prompt_tokens: request.prompt_tokens,
            max_tokens,
            token_ids: None,
        };
        if let Err(reason) = self.ranks[rank].core.add_request(engine_request) {
            tracing::debug!(request = index, %reason, "engine refused");
            self.records[index].rejected = true;
            self.router.free(&id, now);
            return;
        }
        self.active.insert(engine_id, index);
        if !self.ranks[rank].stepping {
            self.start_step(rank, now);
        }
    }

    /// Request `index`'s prefill half ended at `now`: its KV leaves for the decode
    /// rank, every block the decode rank does not hold now.
    pub(super) fn start_transfer(&mut self, index: usize, now: u64) {
        let Some(decode) = self.records[index].worker else {
            return;
        };
        let request = &self.trace.requests[index];
        let block_size = u64::from(self.trace.block_size);
        let full = (request.prompt_tokens / block_size) as usize;
        let prompt =
            chain_block_hashes(&request.block_hashes[..full.min(request.block_hashes.len())]);
        let held = self.ranks[decode].core.cache().prefix_hits(&prompt) as u64;
        let blocks = request.prompt_tokens.div_ceil(block_size) - held;
        self.records[index].transferred_blocks = blocks;
        let end = now + self.transfer.duration_ns(blocks, self.trace.block_size);
        self.push(end, Event::TransferEnd { index });
    }

    /// Request `index`'s KV reached its decode rank at `now`: its decode half joins
    /// the rank's queue.
    pub(super) fn end_transfer(&mut self, index: usize, now: u64) {
        if let Some(decode) = self.records[index].worker {
            self.admit(index, decode, Part::Request, now);
        }
    }

    /// The prefill cost the lab adds to a step of `rank` with `output`, in ms: on a
    /// decode rank, the tokens computed for prompts it prefills itself, charged in
    /// the step of their first token (module docs); 0 elsewhere.
    pub(super) fn local_prefill_ms(&self, rank: usize, output: &StepOutput) -> f64 {
        let Some(ms_per_token) = self.ranks[rank].local_prefill_ms_per_token else {
            return 0.0;
        };
        let tokens: u64 = output
            .first_tokens
            .iter()
            .filter(|f| {
                self.active
                    .get(&f.request_id)
                    .is_some_and(|&i| self.records[i].prefill_worker.is_none())
            })
            .map(|f| f.prompt_tokens - f.cached_tokens.min(f.prompt_tokens.saturating_sub(1)))
            .sum();
        ms_per_token * tokens as f64
    }
}
