//! Active sequences: the scheduler's write model of the load it has booked.
//!
//! Every routed request is *booked* on its rank: its uncached prompt tokens count as
//! pending prefill until the frontend reports `prefill_done`, and its prompt blocks
//! count as decode load until it is `freed`. The per-rank aggregates are maintained
//! incrementally, so reading a rank's load is O(1) and every lifecycle step is O(1)
//! (one hash-map lookup per map); only removing a worker scans all active requests.
//! Memory is one small record per active request plus one aggregate per busy rank.

use crate::error::SchedulerError;
use kv_events::{RequestId, WorkerId, WorkerRank};
use std::collections::HashMap;

/// The load the scheduler has booked on one (worker, dp_rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankLoad {
    /// Prompt tokens routed here whose prefill has not completed, in tokens
    /// (cached prefix tokens are excluded at booking).
    pub active_prefill_tokens: u64,
    /// KV blocks held by requests routed here until they are freed, in blocks.
    pub active_decode_blocks: u64,
    /// Requests routed here and not yet freed.
    pub active_requests: usize,
}

/// One booked request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveRequest {
    /// Where it was routed.
    pub rank: WorkerRank,
    /// Prompt tokens still to prefill, in tokens; 0 once prefill completed.
    pub prefill_tokens: u64,
    /// KV blocks it holds, in blocks (prompt blocks, partial last block counted).
    pub blocks: u32,
    /// Whether the frontend reported the first output token.
    pub prefill_done: bool,
}

/// All active requests and their per-rank aggregates.
#[derive(Debug, Clone, Default)]
pub struct ActiveSequences {
    requests: HashMap<RequestId, ActiveRequest>,
    /// Only ranks with at least one active request have an entry.
    per_rank: HashMap<WorkerRank, RankLoad>,
}

impl ActiveSequences {
    /// No active requests.
    pub fn new() -> Self {
        Self::default()
    }

    /// Books a request on `rank` with `prefill_tokens` tokens to prefill and `blocks`
    /// KV blocks held.
    ///
    /// # Errors
    /// [`SchedulerError::DuplicateRequest`] if `id` is already active; nothing changes.
    pub fn add_request(
        &mut self,
        id: RequestId,
        rank: WorkerRank,
        prefill_tokens: u64,
        blocks: u32,
    ) -> Result<(), SchedulerError> {
        if self.requests.contains_key(&id) {
            return Err(SchedulerError::DuplicateRequest(id));
        }
        // Saturating: token counts come from the network, and an absurd request must
        // not panic the daemon (it can only distort this rank's aggregate).
        let load = self.per_rank.entry(rank).or_default();
        load.active_prefill_tokens = load.active_prefill_tokens.saturating_add(prefill_tokens);
        load.active_decode_blocks = load.active_decode_blocks.saturating_add(u64::from(blocks));
        load.active_requests += 1;
        self.requests.insert(
            id,
            ActiveRequest {
                rank,
                prefill_tokens,
                blocks,
                prefill_done: false,
            },
        );
        Ok(())
    }

    /// Records that the request's prefill finished: its prefill tokens leave its
    /// rank's `active_prefill_tokens`. Repeating it is harmless.
    ///
    /// # Errors
    /// [`SchedulerError::UnknownRequest`] if `id` is not active.
    pub fn mark_prefill_completed(&mut self, id: &RequestId) -> Result<(), SchedulerError> {
        let request = self
            .requests
            .get_mut(id)
            .ok_or_else(|| SchedulerError::UnknownRequest(id.clone()))?;
        if let Some(load) = self.per_rank.get_mut(&request.rank) {
            load.active_prefill_tokens = load
                .active_prefill_tokens
                .saturating_sub(request.prefill_tokens);
        }
        request.prefill_tokens = 0;
        request.prefill_done = true;
        Ok(())
    }

    /// Releases everything the request holds and forgets it; returns its record.
    ///
    /// # Errors
    /// [`SchedulerError::UnknownRequest`] if `id` is not active.
    pub fn free(&mut self, id: &RequestId) -> Result<ActiveRequest, SchedulerError> {
        let request = self
            .requests
            .remove(id)
            .ok_or_else(|| SchedulerError::UnknownRequest(id.clone()))?;
        self.release(&request);
        Ok(request)
    }

    /// Drops every request booked on any rank of `worker_id` (the worker left, so its
    /// requests died with it); returns how many were dropped.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> usize {
        let before = self.requests.len();
        self.requests.retain(|_, r| r.rank.worker_id != worker_id);
        self.per_rank.retain(|rank, _| rank.worker_id != worker_id);
        before - self.requests.len()
    }

    /// Drops every request booked on one rank; returns how many were dropped.
    pub fn remove_rank(&mut self, rank: WorkerRank) -> usize {
        let before = self.requests.len();
        self.requests.retain(|_, r| r.rank != rank);
        self.per_rank.remove(&rank);
        before - self.requests.len()
    }

    /// The load booked on `rank`; all zeros when nothing is booked there.
    pub fn load(&self, rank: WorkerRank) -> RankLoad {
        self.per_rank.get(&rank).copied().unwrap_or_default()
    }

    /// One active request.
    pub fn get(&self, id: &RequestId) -> Option<&ActiveRequest> {
        self.requests.get(id)
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

    fn release(&mut self, request: &ActiveRequest) {
        let Some(load) = self.per_rank.get_mut(&request.rank) else {
            return;
        };
        load.active_prefill_tokens = load
            .active_prefill_tokens
            .saturating_sub(request.prefill_tokens);
        load.active_decode_blocks = load
            .active_decode_blocks
            .saturating_sub(u64::from(request.blocks));
        load.active_requests = load.active_requests.saturating_sub(1);
        if load.active_requests == 0 {
            self.per_rank.remove(&request.rank);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::DpRank;
    use proptest::prelude::*;

    fn rank(id: u64, dp: u32) -> WorkerRank {
        WorkerRank::new(WorkerId(id), DpRank(dp))
    }

    fn id(s: &str) -> RequestId {
        RequestId::from(s)
    }

    #[test]
    fn booking_lifecycle_updates_aggregates() {
        let mut seqs = ActiveSequences::new();
        seqs.add_request(id("a"), rank(1, 0), 100, 8).unwrap();
        seqs.add_request(id("b"), rank(1, 0), 40, 3).unwrap();
        seqs.add_request(id("c"), rank(2, 0), 7, 1).unwrap();
        assert_eq!(
            seqs.load(rank(1, 0)),
            RankLoad {
                active_prefill_tokens: 140,
                active_decode_blocks: 11,
                active_requests: 2
            }
        );

        seqs.mark_prefill_completed(&id("a")).unwrap();
        seqs.mark_prefill_completed(&id("a")).unwrap();
        assert_eq!(seqs.load(rank(1, 0)).active_prefill_tokens, 40);
        assert_eq!(seqs.load(rank(1, 0)).active_decode_blocks, 11);
        assert!(seqs.get(&id("a")).unwrap().prefill_done);
        assert_eq!(seqs.get(&id("a")).unwrap().prefill_tokens, 0);

        let freed = seqs.free(&id("a")).unwrap();
        assert_eq!(freed.blocks, 8);
        assert_eq!(
            seqs.load(rank(1, 0)),
            RankLoad {
                active_prefill_tokens: 40,
                active_decode_blocks: 3,
                active_requests: 1
            }
        );
        // Freeing before prefill completed releases its prefill tokens too.
        seqs.free(&id("b")).unwrap();
        assert_eq!(seqs.load(rank(1, 0)), RankLoad::default());
        assert_eq!(seqs.len(), 1);
        assert!(!seqs.per_rank.contains_key(&rank(1, 0)));
    }

    #[test]
    fn duplicate_and_unknown_ids_are_typed_errors() {
        let mut seqs = ActiveSequences::new();
        seqs.add_request(id("a"), rank(1, 0), 10, 1).unwrap();
        assert_eq!(
            seqs.add_request(id("a"), rank(2, 0), 99, 9),
            Err(SchedulerError::DuplicateRequest(id("a")))
        );
        assert_eq!(seqs.load(rank(2, 0)), RankLoad::default());
        assert_eq!(seqs.load(rank(1, 0)).active_prefill_tokens, 10);
        assert_eq!(
            seqs.mark_prefill_completed(&id("zz")),
            Err(SchedulerError::UnknownRequest(id("zz")))
        );
        assert_eq!(
            seqs.free(&id("zz")),
            Err(SchedulerError::UnknownRequest(id("zz")))
        );
        seqs.free(&id("a")).unwrap();
        assert_eq!(
            seqs.free(&id("a")),
            Err(SchedulerError::UnknownRequest(id("a")))
        );
    }

    #[test]
    fn remove_worker_and_rank_drop_only_their_requests() {
        let mut seqs = ActiveSequences::new();
        seqs.add_request(id("a"), rank(1, 0), 10, 1).unwrap();
        seqs.add_request(id("b"), rank(1, 1), 10, 1).unwrap();
        seqs.add_request(id("c"), rank(2, 0), 10, 1).unwrap();
        seqs.add_request(id("d"), rank(2, 1), 10, 1).unwrap();
        assert_eq!(seqs.remove_worker(WorkerId(1)), 2);
        assert!(!seqs.contains(&id("a")) && !seqs.contains(&id("b")));
        assert_eq!(seqs.load(rank(1, 1)), RankLoad::default());
        assert_eq!(seqs.remove_rank(rank(2, 1)), 1);
        assert_eq!(seqs.len(), 1);
        assert_eq!(seqs.load(rank(2, 0)).active_requests, 1);
        assert!(matches!(
            seqs.free(&id("d")),
            Err(SchedulerError::UnknownRequest(_))
        ));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add {
            req: u8,
            rank: u8,
            tokens: u16,
            blocks: u8,
        },
        Prefill {
            req: u8,
        },
        Free {
            req: u8,
        },
        RemoveWorker {
            worker: u8,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..12, 0u8..4, any::<u16>(), any::<u8>()).prop_map(|(req, rank, tokens, blocks)| {
                Op::Add {
                    req,
                    rank,
                    tokens,
                    blocks,
                }
            }),
            (0u8..12).prop_map(|req| Op::Prefill { req }),
            (0u8..12).prop_map(|req| Op::Free { req }),
            (0u8..2).prop_map(|worker| Op::RemoveWorker { worker }),
        ]
    }

    proptest! {
        /// The incremental aggregates always equal a recomputation from the records.
        #[test]
        fn aggregates_match_records(ops in proptest::collection::vec(op(), 0..200)) {
            let mut seqs = ActiveSequences::new();
            for op in ops {
                match op {
                    Op::Add { req, rank: r, tokens, blocks } => {
                        let _ = seqs.add_request(
                            RequestId(req.to_string()),
                            rank(u64::from(r / 2), u32::from(r % 2)),
                            u64::from(tokens),
                            u32::from(blocks),
                        );
                    }
                    Op::Prefill { req } => {
                        let _ = seqs.mark_prefill_completed(&RequestId(req.to_string()));
                    }
                    Op::Free { req } => {
                        let _ = seqs.free(&RequestId(req.to_string()));
                    }
                    Op::RemoveWorker { worker } => {
                        seqs.remove_worker(WorkerId(u64::from(worker)));
                    }
                }
                let mut expected: HashMap<WorkerRank, RankLoad> = HashMap::new();
                for r in seqs.requests.values() {
                    let load = expected.entry(r.rank).or_default();
                    load.active_prefill_tokens += r.prefill_tokens;
                    load.active_decode_blocks += u64::from(r.blocks);
                    load.active_requests += 1;
                }
                prop_assert_eq!(&expected, &seqs.per_rank);
            }
        }
    }
}
