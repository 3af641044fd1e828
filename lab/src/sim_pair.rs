//! A split fleet in the simulator: the two halves of a disaggregated request and the
//! KV transfer between them.
//!
//! A request the router disaggregates (its decision names a prefill rank) runs as:
//!
//! 1. **prefill half** on the prefill rank, under `{id}#prefill`, with one output
//!    token (as vLLM's proxy sends it, `max_tokens` 1): queued, batched and prefix
//!    cached like any request there. Its first token is the router's
//!    `remote_prefill_done`; it finishes in the same step, and its blocks stay cached
//!    on the prefill rank;
//! 2. **transfer** of every prompt block the decode rank does not hold at that
//!    instant (`EngineCore::transfer_blocks`: its leading cached run is kept, the
//!    partial last block moves whole) at `--transfer-ms-per-token`
//!    ([`engine_model::KvTransferConfig`]). It runs beside both engines' steps, as
//!    NIXL's and Mooncake's reads do: the decode rank keeps decoding its batch;
//! 3. **decode half** on the decode rank, under `{id}`, queued as a transferred
//!    request (`EngineCore::add_transferred_request`): its admission step recomputes
//!    only the last prompt token, emits the first token (the TTFT, and the router's
//!    `prefill_done`, which releases the prefill half's booking) and stores the
//!    prompt's blocks (the index hears them from the decode rank too, as vLLM's decode
//!    instance publishes them). Then it decodes; its end is the router's `freed`.
//!
//! A prompt the router keeps on its decode rank runs there as on an aggregated rank.
//! The engine model's own account of a transfer, and what it leaves out, is in
//! `docs/engine-model.md` ("KV transfer").
//!
//! Cost: one prefix lookup on the decode rank per transfer, O(prompt blocks).

use super::{Event, Sim, request_id};
use crate::config::ms_to_ns;
use engine_model::EngineRequest;
use kv_events::disaggregation::prefill_booking_id;

/// What a rank runs of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    /// The whole request (aggregated, or prefilled by its decode rank).
    Request,
    /// A disaggregated request's prefill half: one output token, under `{id}#prefill`.
    PrefillHalf,
    /// A disaggregated request's decode half, once its KV arrived.
    DecodeHalf,
}

impl Sim<'_> {
    /// Queues `part` of request `index` on `rank` at `now` and starts a step there if
    /// the rank is idle; an engine's refusal rejects the request and frees its
    /// bookings.
    pub(super) fn admit(&mut self, index: usize, rank: usize, part: Part, now: u64) {
        let request = &self.trace.requests[index];
        let id = request_id(index);
        let (engine_id, max_tokens) = match part {
            Part::Request | Part::DecodeHalf => (id.clone(), request.max_tokens),
            Part::PrefillHalf => (prefill_booking_id(&id), 1),
        };
        let engine_request = EngineRequest {
            request_id: engine_id.clone(),
            block_hashes: request.block_hashes.clone(),
            prompt_tokens: request.prompt_tokens,
            max_tokens,
            token_ids: None,
        };
        let core = &mut self.ranks[rank].core;
        let added = match part {
            Part::DecodeHalf => core.add_transferred_request(engine_request),
            Part::Request | Part::PrefillHalf => core.add_request(engine_request),
        };
        if let Err(reason) = added {
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
        let blocks = self.ranks[decode]
            .core
            .transfer_blocks(&request.block_hashes, request.prompt_tokens);
        self.records[index].transferred_blocks = blocks;
        let ms = self.transfer.duration_ms(blocks, self.trace.block_size);
        self.push(now + ms_to_ns(ms), Event::TransferEnd { index });
    }

    /// Request `index`'s KV reached its decode rank at `now`: its decode half joins
    /// the rank's queue.
    pub(super) fn end_transfer(&mut self, index: usize, now: u64) {
        if let Some(decode) = self.records[index].worker {
            self.admit(index, decode, Part::DecodeHalf, now);
        }
    }
}
