//! `GET /debug/workers`: the worker directory as the daemon sees it, joined with the
//! scheduler's booked load and the indexer's blocks per rank. It names every worker,
//! its etcd lease and its load, so it is served on its own listener (loopback by
//! default) or not at all; see [`super::DebugListen`]. Cost: one scheduler lock, one
//! copy of the worker directory and one round trip to every indexer shard.

use super::HttpState;
use crate::health::Check;
use crate::recovery_status::RankRecoveryView;
use crate::state::RouterState;
use axum::Router;
use axum::extract::State;
use axum::response::Json;
use axum::routing::get;
use indexer::IndexerApi as _;
use kv_events::LoadMetrics;
use scheduler::Liveness;
use serde::Serialize;

/// The `/debug/*` routes.
pub(crate) fn debug_app(state: HttpState) -> Router {
    Router::new()
        .route("/debug/workers", get(workers))
        .with_state(state)
}

/// The body of `GET /debug/workers`.
#[derive(Debug, Clone, Serialize)]
pub struct WorkersView {
    /// etcd reachability; when not ok, `workers` are the last known ones.
    pub etcd: Check,
    /// The router's tokens per KV block (`None`: not adopted yet, no worker).
    pub block_size: Option<u32>,
    /// Where it comes from: `pinned` (`--block-size`) or `adopted` (the registrations).
    pub block_size_source: crate::block_size::BlockSizeSource,
    /// Registered workers by id.
    pub workers: Vec<WorkerView>,
}

/// One registered worker.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerView {
    /// Worker id.
    pub worker_id: u64,
    /// etcd lease id of its registration key (0: no lease).
    pub lease_id: i64,
    /// etcd revision that last modified its key.
    pub mod_revision: i64,
    /// Data-parallel ranks.
    pub dp_size: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV capacity of each rank, in blocks.
    pub total_kv_blocks: u64,
    /// Its role in a disaggregated fleet (`both`, `prefill`, `decode`).
    pub role: kv_events::disaggregation::WorkerRole,
    /// One entry per dp_rank.
    pub ranks: Vec<RankView>,
}

/// Load of one (worker, dp_rank).
#[derive(Debug, Clone, Serialize)]
pub struct RankView {
    /// The rank.
    pub dp_rank: u32,
    /// Prompt tokens booked here whose prefill is not done, in tokens.
    pub active_prefill_tokens: u64,
    /// KV blocks booked here until freed, in blocks.
    pub active_decode_blocks: u64,
    /// Requests booked here and not freed.
    pub active_requests: usize,
    /// Blocks the index holds for this rank (`None` when the indexer did not answer).
    pub indexed_blocks: Option<usize>,
    /// The engine's last load report, if any.
    pub engine: Option<LoadMetrics>,
    /// What the silence of its load reports says: `never_reported` (judged by its
    /// lease alone), `live`, `quiet` (deprioritized) or `silent` (excluded).
    pub liveness: Liveness,
    /// Time since its last load report, in ms (`None`: never reported).
    pub metrics_age_ms: Option<u64>,
    /// Gap recovery trouble (`{"state": "recovering" | "backing_off" | "degraded",
    /// ...}`); `null` while the rank's events are in order.
    pub recovery: Option<RankRecoveryView>,
    /// What online calibration learned (`null` unless `--calibration`): `samples`,
    /// `in_use` (warm-up done), the learned multipliers `scale` and the learned
    /// `model` in ms.
    pub calibration: Option<scheduler::RankCalibration>,
}

/// Builds the workers view from the directory, the scheduler and the indexer's
/// blocks per rank (one round trip to every shard).
pub async fn workers_view(router: &RouterState) -> WorkersView {
    let indexed: Option<std::collections::HashMap<kv_events::WorkerRank, usize>> = router
        .indexer
        .report()
        .await
        .ok()
        .map(|r| r.blocks_per_rank.into_iter().collect());
    let entries = router.directory.snapshot();
    let scheduler = router.scheduler();
    let now = tokio::time::Instant::now();
    let clock = std::time::Instant::now();
    let workers = entries
        .into_iter()
        .map(|e| {
            let reg = e.registration;
            let ranks = (0..reg.dp_size)
                .map(|r| {
                    let rank = kv_events::WorkerRank::new(reg.worker_id, kv_events::DpRank(r));
                    let load = scheduler.rank_load(rank);
                    let (liveness, heard) = scheduler.liveness(rank, clock);
                    RankView {
                        dp_rank: r,
                        active_prefill_tokens: load.active_prefill_tokens,
                        active_decode_blocks: load.active_decode_blocks,
                        active_requests: load.active_requests,
                        indexed_blocks: indexed
                            .as_ref()
                            .map(|m| m.get(&rank).copied().unwrap_or(0)),
                        engine: scheduler.load_metrics(rank).copied(),
                        liveness,
                        metrics_age_ms: heard.map(|h| {
                            u64::try_from(clock.saturating_duration_since(h).as_millis())
                                .unwrap_or(u64::MAX)
                        }),
                        recovery: router.recovery.view(rank, now),
                        calibration: scheduler.calibration(rank),
                    }
                })
                .collect();
            WorkerView {
                worker_id: reg.worker_id.0,
                lease_id: e.lease_id,
                mod_revision: e.mod_revision,
                dp_size: reg.dp_size,
                block_size: reg.block_size,
                total_kv_blocks: reg.total_kv_blocks,
                role: reg.role,
                ranks,
            }
        })
        .collect();
    drop(scheduler);
    WorkersView {
        etcd: router.health.report().checks.etcd,
        block_size: router.block_size.get().map(std::num::NonZeroU32::get),
        block_size_source: router.block_size.source(),
        workers,
    }
}

async fn workers(State(s): State<HttpState>) -> Json<WorkersView> {
    Json(workers_view(&s.router).await)
}
