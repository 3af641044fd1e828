//! [`QueueMetrics`] (the wait queue, recorded by it) and [`WorkerLoadMetrics`] (the
//! load booked on and reported by every rank, sampled at scrape time under one
//! scheduler lock).

use super::common::{RANK_LABELS, latency_buckets, rank_labels, to_i64};
use super::registrar::Registrar;
use prometheus::{GaugeVec, Histogram, IntGauge, IntGaugeVec};
use scheduler::{Liveness, Scheduler};
use std::time::Duration;

/// The wait queue of routing queries when every worker is busy.
#[derive(Clone)]
pub struct QueueMetrics {
    depth: IntGauge,
    wait: Histogram,
}

impl QueueMetrics {
    /// Creates the metrics through `r`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub(crate) fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            depth: r.gauge(
                "kv_router_queue_depth",
                "Routing queries waiting because every worker rank is busy",
            )?,
            wait: r.histogram(
                "kv_router_queue_wait_seconds",
                "Time a routing query waited in the queue before it was scheduled or \
                 refused, in seconds",
                latency_buckets(),
            )?,
        })
    }

    /// Sets the number of queued queries.
    pub(crate) fn set_depth(&self, depth: usize) {
        self.depth.set(to_i64(depth));
    }

    /// Records how long one query waited.
    pub(crate) fn observe_wait(&self, wait: Duration) {
        self.wait.observe(wait.as_secs_f64());
    }
}

/// Per-rank load: what the scheduler booked and what the engine last reported.
#[derive(Clone)]
pub struct WorkerLoadMetrics {
    prefill_tokens: IntGaugeVec,
    decode_blocks: IntGaugeVec,
    requests: IntGaugeVec,
    engine_kv_used: IntGaugeVec,
    engine_kv_total: IntGaugeVec,
    engine_running: IntGaugeVec,
    engine_waiting: IntGaugeVec,
    liveness: IntGaugeVec,
    calibration_factor: GaugeVec,
    calibration_samples: IntGaugeVec,
}

impl WorkerLoadMetrics {
    /// Creates the metrics through `r`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub(crate) fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            prefill_tokens: r.gauge_vec(
                "kv_router_worker_active_prefill_tokens",
                "Prompt tokens routed to the rank whose prefill is not done, in tokens",
                RANK_LABELS,
            )?,
            decode_blocks: r.gauge_vec(
                "kv_router_worker_active_decode_blocks",
                "KV blocks held by requests routed to the rank and not yet freed",
                RANK_LABELS,
            )?,
            requests: r.gauge_vec(
                "kv_router_worker_active_requests",
                "Requests routed to the rank by this replica and not yet freed",
                RANK_LABELS,
            )?,
            engine_kv_used: r.gauge_vec(
                "kv_router_engine_kv_used_blocks",
                "KV blocks in use, as last reported by the engine rank",
                RANK_LABELS,
            )?,
            engine_kv_total: r.gauge_vec(
                "kv_router_engine_kv_total_blocks",
                "KV cache capacity in blocks, as last reported by the engine rank",
                RANK_LABELS,
            )?,
            engine_running: r.gauge_vec(
                "kv_router_engine_requests_running",
                "Requests in the running batch, as last reported by the engine rank",
                RANK_LABELS,
            )?,
            engine_waiting: r.gauge_vec(
                "kv_router_engine_requests_waiting",
                "Requests waiting for a batch slot or KV space, as last reported by the \
                 engine rank",
                RANK_LABELS,
            )?,
            liveness: r.gauge_vec(
                "kv_router_worker_liveness_ranks",
                "Registered ranks by what the silence of their load metrics says \
                 (never_reported, live, quiet: deprioritized, silent: excluded)",
                &["state"],
            )?,
            calibration_factor: r.float_gauge_vec(
                "kv_router_worker_calibration_factor",
                "Learned multiplier of a configured predicted-ttft step-time constant \
                 (prefill: prefill_ms_per_token, step_base: step_base_ms, decode: both \
                 decode terms) on the rank; only with --calibration",
                &["worker_id", "dp_rank", "constant"],
            )?,
            calibration_samples: r.gauge_vec(
                "kv_router_worker_calibration_samples",
                "TTFT observations calibration took on the rank; its own constants are \
                 used from --calibration-warmup-samples on",
                RANK_LABELS,
            )?,
        })
    }

    pub(crate) fn all(&self) -> [&IntGaugeVec; 8] {
        [
            &self.calibration_samples,
            &self.prefill_tokens,
            &self.decode_blocks,
            &self.requests,
            &self.engine_kv_used,
            &self.engine_kv_total,
            &self.engine_running,
            &self.engine_waiting,
        ]
    }

    /// Replaces every sample with the load `scheduler` holds now.
    pub(crate) fn sample(&self, scheduler: &Scheduler) {
        for g in self.all() {
            g.reset();
        }
        self.calibration_factor.reset();
        let now = std::time::Instant::now();
        let mut liveness = [0i64; Liveness::ALL.len()];
        for &rank in scheduler.ranks() {
            let state = scheduler.liveness(rank, now).0;
            if let Some(i) = Liveness::ALL.iter().position(|&l| l == state) {
                liveness[i] += 1;
            }
            let labels = rank_labels(rank);
            let load = scheduler.rank_load(rank);
            self.prefill_tokens
                .with_label_values(&labels)
                .set(to_i64(load.active_prefill_tokens));
            self.decode_blocks
                .with_label_values(&labels)
                .set(to_i64(load.active_decode_blocks));
            self.requests
                .with_label_values(&labels)
                .set(to_i64(load.active_requests));
            if let Some(c) = scheduler.calibration(rank) {
                self.calibration_samples
                    .with_label_values(&labels)
                    .set(to_i64(c.samples));
                let [worker, dp] = &labels;
                for (constant, factor) in [
                    ("prefill", c.scale.prefill),
                    ("step_base", c.scale.step_base),
                    ("decode", c.scale.decode),
                ] {
                    self.calibration_factor
                        .with_label_values(&[worker.as_str(), dp.as_str(), constant])
                        .set(factor);
                }
            }
            if let Some(m) = scheduler.load_metrics(rank) {
                self.engine_kv_used
                    .with_label_values(&labels)
                    .set(to_i64(m.kv_used_blocks));
                self.engine_kv_total
                    .with_label_values(&labels)
                    .set(to_i64(m.kv_total_blocks));
                self.engine_running
                    .with_label_values(&labels)
                    .set(i64::from(m.num_requests_running));
                self.engine_waiting
                    .with_label_values(&labels)
                    .set(i64::from(m.num_requests_waiting));
            }
        }
        for (state, count) in Liveness::ALL.iter().zip(liveness) {
            self.liveness.with_label_values(&[state.label()]).set(count);
        }
    }
}
