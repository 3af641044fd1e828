//! Active sequences: the authoritative write model of the load this router (and its
//! peer replicas) booked on each (worker, dp_rank).
//!
//! Writes are four events ([`SequenceEvent`]): `AddRequest` books a request with a
//! [`PrefillLoadHint`] computed once by the caller, `MarkPrefillCompleted` ends its
//! prefill, `KeepAlive` refreshes it, `Free` releases it. The model applies hints; it
//! does no token math of its own. Reads go through [`ActiveSequences::load`], a
//! projection derived at the read time `now`: prefill tokens with the oldest
//! in-flight prefill decayed linearly, decode blocks with shared prefixes counted
//! once (when `assume_kv_reuse`), request and uncached-token counts.
//!
//! Time is always passed in (`now: Instant`), never read here, so tests are exact
//! and an offline simulator can drive the model on a virtual clock.
//!
//! Every request has a deadline `ttl` after its last event; [`ActiveSequences::expire`]
//! drops the overdue ones (a frontend that crashed never sends `freed`). Deadlines sit
//! in an ordered index, so the next deadline is O(log n) to find and refresh.
//!
//! Costs: memory is one record per active request (plus 8 bytes per prompt block
//! with KV reuse) and one aggregate per busy rank; each event is O(log n + blocks);
//! removing a worker scans the active requests once.

mod in_flight;
mod rank;

pub use crate::load::{PrefillLoadHint, RankLoad};
pub use rank::chain_block_ids;

use crate::config::SequencesConfig;
use crate::cost_bound::Changed;
use crate::error::SchedulerError;
use in_flight::BlockIdMap;
use kv_events::{LocalBlockHash, RequestId, RouterId, WorkerId, WorkerRank};
use rank::{RankSequences, SparePool};
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

/// Who booked a request: this router, or a peer replica (learned by sequence sync).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// Booked by this router's own routing decision.
    Local,
    /// Booked by another replica.
    Peer(RouterId),
}

/// Books a request on a rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddRequest {
    /// The request.
    pub request_id: RequestId,
    /// Where it runs.
    pub rank: WorkerRank,
    /// Its prompt's block hashes in prefix order (for KV reuse).
    pub block_hashes: Vec<LocalBlockHash>,
    /// Its KV blocks, in blocks (prompt blocks, partial last block counted); blocks
    /// beyond `block_hashes` are never shared.
    pub request_blocks: u32,
    /// Its prefill load.
    pub prefill: PrefillLoadHint,
    /// Who booked it.
    pub origin: Origin,
    /// The session it belongs to: [`crate::Scheduler::apply`] records its rank as the
    /// session's last rank (how a replica learns its peers' session decisions). The
    /// write model itself ignores it; a local booking records its session when it is
    /// routed ([`crate::Scheduler::schedule`]) and leaves this `None`.
    pub session_id: Option<kv_events::routing::SessionId>,
}

/// One write to the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SequenceEvent {
    /// A request was routed and booked.
    AddRequest(AddRequest),
    /// The request produced its first token.
    MarkPrefillCompleted(RequestId),
    /// The request is still alive (refresh its deadline only).
    KeepAlive(RequestId),
    /// The request ended; release everything.
    Free(RequestId),
}

/// One booked request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveRequest {
    /// Where it was routed.
    pub rank: WorkerRank,
    /// Who booked it.
    pub origin: Origin,
    /// KV blocks it holds, in blocks.
    pub request_blocks: u32,
    /// The prefill load it was booked with.
    pub prefill: PrefillLoadHint,
    /// Whether its prefill completed.
    pub prefill_done: bool,
    /// When it expires unless a lifecycle event arrives first.
    pub deadline: Instant,
    seq: u64,
    /// Chained block ids counted as shared (empty without KV reuse).
    block_ids: Vec<u64>,
    /// Blocks counted per request.
    private_blocks: u64,
}

/// All active requests, their per-rank aggregates and their deadlines.
#[derive(Debug, Clone)]
pub struct ActiveSequences {
    config: SequencesConfig,
    requests: HashMap<RequestId, ActiveRequest>,
    /// Only ranks with at least one active request have an entry.
    /// Looked up once per candidate rank per decision: foldhash, not SipHash.
    per_rank: HashMap<WorkerRank, RankSequences, foldhash::fast::RandomState>,
    /// Aggregates of ranks emptied, for the next ranks booked.
    spare: SparePool,
    /// (deadline, seq) → request, for expiry in deadline order.
    deadlines: BTreeMap<(Instant, u64), RequestId>,
    next_seq: u64,
    /// First chained block id of a booked request → the ranks holding it, with how
    /// many requests each: the ranks whose in-flight prefix a prompt can share.
    first_blocks: FirstBlocks,
    /// Ranks whose load changed since [`Self::take_changed`] last ran (the decision
    /// bound's updates, `crate::cost_bound`).
    changed: Changed,
}

impl ActiveSequences {
    /// No active requests.
    pub fn new(config: SequencesConfig) -> Self {
        Self {
            config,
            requests: HashMap::new(),
            per_rank: HashMap::default(),
            spare: SparePool::default(),
            deadlines: BTreeMap::new(),
            next_seq: 0,
            first_blocks: FirstBlocks::default(),
            changed: Changed::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SequencesConfig {
        &self.config
    }

    /// Applies one event at `now`. Returns the origin of the request it touched.
    ///
    /// # Errors
    /// [`SchedulerError::DuplicateRequest`] for an `AddRequest` whose id is active,
    /// [`SchedulerError::UnknownRequest`] for the others when the id is not active.
    /// Nothing changes on error.
    pub fn apply(&mut self, event: SequenceEvent, now: Instant) -> Result<Origin, SchedulerError> {
        match event {
            SequenceEvent::AddRequest(add) => {
                let origin = add.origin;
                self.add_request(add, now).map(|()| origin)
            }
            SequenceEvent::MarkPrefillCompleted(id) => self.mark_prefill_completed(&id, now),
            SequenceEvent::KeepAlive(id) => self.keep_alive(&id, now),
            SequenceEvent::Free(id) => self.free(&id, now).map(|r| r.origin),
        }
    }

    /// Books a request; its deadline is `now + ttl`.
    ///
    /// # Errors
    /// [`SchedulerError::DuplicateRequest`] if the id is already active.
    pub fn add_request(&mut self, add: AddRequest, now: Instant) -> Result<(), SchedulerError> {
        let block_ids = if self.config.assume_kv_reuse {
            let shared = add.block_hashes.len().min(add.request_blocks as usize);
            chain_block_ids(&add.block_hashes[..shared])
        } else {
            Vec::new()
        };
        self.add_chained(add, block_ids, now)
    }

    /// [`Self::add_request`] with the prompt's chained block ids already computed by
    /// the caller (the decision computed them to score the ranks): `block_ids` must be
    /// `chain_block_ids` of the first `min(hashes, request_blocks)` block hashes with
    /// KV reuse, else empty; `add.block_hashes` is not read (it may be empty), which
    /// spares the booking a copy of the prompt's hashes and a second chaining pass.
    ///
    /// # Errors
    /// [`SchedulerError::DuplicateRequest`] if the id is already active.
    pub(crate) fn add_chained(
        &mut self,
        add: AddRequest,
        block_ids: Vec<u64>,
        now: Instant,
    ) -> Result<(), SchedulerError> {
        if self.requests.contains_key(&add.request_id) {
            return Err(SchedulerError::DuplicateRequest(add.request_id));
        }
        debug_assert!(self.config.assume_kv_reuse || block_ids.is_empty());
        let shared = block_ids.len().min(add.request_blocks as usize);
        let private_blocks = u64::from(add.request_blocks) - shared as u64;
        let seq = self.next_seq;
        self.next_seq += 1;
        if let Some(&first) = block_ids.first() {
            *self
                .first_blocks
                .entry(first)
                .or_default()
                .entry(add.rank)
                .or_insert(0) += 1;
        }
        self.changed.push(add.rank);
        let spare = &mut self.spare;
        let rank = self.per_rank.entry(add.rank);
        rank.or_insert_with(|| spare.take())
            .add(seq, &block_ids, private_blocks, add.prefill, now);
        let deadline = now + self.config.request_ttl;
        self.deadlines
            .insert((deadline, seq), add.request_id.clone());
        self.requests.insert(
            add.request_id,
            ActiveRequest {
                rank: add.rank,
                origin: add.origin,
                request_blocks: add.request_blocks,
                prefill: add.prefill,
                prefill_done: false,
                deadline,
                seq,
                block_ids,
                private_blocks,
            },
        );
        Ok(())
    }

    /// The request's prefill finished: its prefill tokens leave its rank's load and the
    /// rank's next prefill starts decaying. Refreshes the deadline; repeating it is
    /// harmless.
    ///
    /// # Errors
    /// [`SchedulerError::UnknownRequest`] if `id` is not active.
    pub fn mark_prefill_completed(
        &mut self,
        id: &RequestId,
        now: Instant,
    ) -> Result<Origin, SchedulerError> {
        let origin = self.refresh(id, now)?;
        if let Some(r) = self.requests.get_mut(id)
            && !r.prefill_done
        {
            r.prefill_done = true;
            if let Some(rank) = self.per_rank.get_mut(&r.rank) {
                rank.finish_prefill(r.seq, now);
            }
            self.changed.push(r.rank);
        }
        Ok(origin)
    }

    /// Refreshes the request's deadline to `now + ttl`.
    ///
    /// # Errors
    /// [`SchedulerError::UnknownRequest`] if `id` is not active.
    pub fn keep_alive(&mut self, id: &RequestId, now: Instant) -> Result<Origin, SchedulerError> {
        self.refresh(id, now)
    }

    /// Releases everything the request booked.
    ///
    /// # Errors
    /// [`SchedulerError::UnknownRequest`] if `id` is not active.
    pub fn free(&mut self, id: &RequestId, now: Instant) -> Result<ActiveRequest, SchedulerError> {
        let request = self
            .requests
            .remove(id)
            .ok_or_else(|| SchedulerError::UnknownRequest(id.clone()))?;
        self.deadlines.remove(&(request.deadline, request.seq));
        self.release(&request, now);
        Ok(request)
    }

    /// Frees every request whose deadline is at or before `now`; returns them.
    pub fn expire(&mut self, now: Instant) -> Vec<(RequestId, ActiveRequest)> {
        let mut expired = Vec::new();
        while let Some(entry) = self.deadlines.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let id = entry.remove();
            if let Some(request) = self.requests.remove(&id) {
                self.release(&request, now);
                expired.push((id, request));
            }
        }
        expired
    }

    /// The earliest deadline of any active request.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.keys().next().map(|(deadline, _)| *deadline)
    }

    /// Drops every request booked on any rank of `worker_id` (the worker left, so its
    /// requests died with it); returns how many were dropped.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> usize {
        self.remove_where(|rank| rank.worker_id == worker_id)
    }

    /// Drops every request booked on one rank; returns how many were dropped.
    pub fn remove_rank(&mut self, rank: WorkerRank) -> usize {
        self.remove_where(|r| r == rank)
    }

    /// The load of `rank` at `now`; all zeros when nothing is booked there.
    pub fn load(&self, rank: WorkerRank, now: Instant) -> RankLoad {
        self.per_rank
            .get(&rank)
            .map(|r| r.load(now))
            .unwrap_or_default()
    }

    /// Every rank with at least one active request (the others' load is all zeros).
    pub fn booked_ranks(&self) -> impl Iterator<Item = WorkerRank> + '_ {
        self.per_rank.keys().copied()
    }

    /// Prefill tokens `rank` holds that do not decay before its next booking change:
    /// a lower bound of its `active_prefill_tokens` at any `now`, in tokens.
    pub(crate) fn floor_prefill_tokens(&self, rank: WorkerRank) -> u64 {
        self.per_rank
            .get(&rank)
            .map_or(0, RankSequences::floor_prefill_tokens)
    }

    /// Every in-flight prefill token booked on `rank`, none decayed, in tokens: an
    /// upper bound of its `active_prefill_tokens` at any `now`.
    pub(crate) fn total_prefill_tokens(&self, rank: WorkerRank) -> u64 {
        self.per_rank
            .get(&rank)
            .map_or(0, RankSequences::total_prefill_tokens)
    }

    /// Every rank with an active request whose chained block ids start with `first`:
    /// the only ranks where a prompt starting with that block has in-flight overlap.
    pub(crate) fn ranks_holding_first(&self, first: u64) -> impl Iterator<Item = WorkerRank> + '_ {
        self.first_blocks
            .get(&first)
            .into_iter()
            .flat_map(|ranks| ranks.keys().copied())
    }

    /// The ranks whose load changed since the last call, emptied.
    pub(crate) fn take_changed(&mut self) -> Changed {
        std::mem::take(&mut self.changed)
    }

    /// How many of a request's `request_blocks` blocks would be new decode load on
    /// `rank`, given its chained block ids ([`chain_block_ids`]): all of them without
    /// KV reuse, else those not already held there by an active request.
    pub fn new_blocks(&self, rank: WorkerRank, block_ids: &[u64], request_blocks: u32) -> u32 {
        self.new_blocks_on(self.per_rank.get(&rank), block_ids, request_blocks)
    }

    /// [`Self::load`] and [`Self::new_blocks`] of one rank with one look-up of its
    /// aggregate (a decision reads both for every candidate rank).
    pub(crate) fn load_and_new_blocks(
        &self,
        rank: WorkerRank,
        now: Instant,
        block_ids: &[u64],
        request_blocks: u32,
    ) -> (RankLoad, u32) {
        let booked = self.per_rank.get(&rank);
        (
            booked.map(|r| r.load(now)).unwrap_or_default(),
            self.new_blocks_on(booked, block_ids, request_blocks),
        )
    }

    /// [`Self::new_blocks`] on a rank's aggregate (`None`: nothing booked there).
    fn new_blocks_on(
        &self,
        booked: Option<&RankSequences>,
        block_ids: &[u64],
        request_blocks: u32,
    ) -> u32 {
        match booked {
            Some(r) if self.config.assume_kv_reuse => r.new_blocks(block_ids, request_blocks),
            _ => request_blocks,
        }
    }

    /// One active request.
    pub fn get(&self, id: &RequestId) -> Option<&ActiveRequest> {
        self.requests.get(id)
    }

    /// Every active request, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&RequestId, &ActiveRequest)> {
        self.requests.iter()
    }

    /// Whether `id` is active.
    pub fn contains(&self, id: &RequestId) -> bool {
        self.requests.contains_key(id)
    }

    /// Number of active requests over all ranks.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether no request is active.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    fn refresh(&mut self, id: &RequestId, now: Instant) -> Result<Origin, SchedulerError> {
        let r = self
            .requests
            .get_mut(id)
            .ok_or_else(|| SchedulerError::UnknownRequest(id.clone()))?;
        let deadline = now + self.config.request_ttl;
        if let Some(key) = self.deadlines.remove(&(r.deadline, r.seq)) {
            self.deadlines.insert((deadline, r.seq), key);
        }
        r.deadline = deadline;
        Ok(r.origin)
    }

    fn release(&mut self, request: &ActiveRequest, now: Instant) {
        self.changed.push(request.rank);
        if let Some(&first) = request.block_ids.first() {
            forget_first_block(&mut self.first_blocks, first, request.rank);
        }
        let Some(rank) = self.per_rank.get_mut(&request.rank) else {
            return;
        };
        if rank.holds_one() {
            // Its last request: the aggregate goes whole, with no per-block steps
            // (at light load most frees are a rank's only booking).
            if let Some(gone) = self.per_rank.remove(&request.rank) {
                self.spare.give(gone);
            }
            return;
        }
        rank.remove(
            request.seq,
            &request.block_ids,
            request.private_blocks,
            request.prefill.initial_effective_prefill_tokens,
            now,
        );
        if rank.is_empty()
            && let Some(gone) = self.per_rank.remove(&request.rank)
        {
            self.spare.give(gone);
        }
    }

    fn remove_where(&mut self, gone: impl Fn(WorkerRank) -> bool) -> usize {
        let before = self.requests.len();
        let deadlines = &mut self.deadlines;
        let (first_blocks, changed) = (&mut self.first_blocks, &mut self.changed);
        self.requests.retain(|_, r| {
            let keep = !gone(r.rank);
            if !keep {
                deadlines.remove(&(r.deadline, r.seq));
                changed.push(r.rank);
                if let Some(&first) = r.block_ids.first() {
                    forget_first_block(first_blocks, first, r.rank);
                }
            }
            keep
        });
        self.per_rank.retain(|rank, _| !gone(*rank));
        before - self.requests.len()
    }
}

/// First chained block id → rank → requests, updated on every booking and free, so
/// hashed with the rank maps' fast hasher rather than SipHash.
type FirstBlocks = BlockIdMap<HashMap<WorkerRank, u32, foldhash::fast::RandomState>>;

/// Drops one request of `rank` from the ranks holding `first`.
fn forget_first_block(first_blocks: &mut FirstBlocks, first: u64, rank: WorkerRank) {
    let Some(ranks) = first_blocks.get_mut(&first) else {
        return;
    };
    if let Some(refs) = ranks.get_mut(&rank) {
        *refs -= 1;
        if *refs == 0 {
            ranks.remove(&rank);
        }
    }
    if ranks.is_empty() {
        first_blocks.remove(&first);
    }
}

#[cfg(test)]
mod tests;
