//! The gateway's Prometheus metrics, created through the cluster's one
//! [`Registrar`] in an injected registry (tests run several gateways in one process).
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `kv_gateway_requests_total` | `endpoint`, `status` | answered requests, by HTTP status |
//! | `kv_gateway_ttft_seconds` | `endpoint` | arrival → first token, as the gateway sees it |
//! | `kv_gateway_itl_seconds` | `endpoint` | time between two streamed chunks (inter-token latency) |
//! | `kv_gateway_e2e_seconds` | `endpoint` | arrival → last token |
//! | `kv_gateway_stage_seconds` | `stage`: `tokenize_queue`, `tokenize`, `route`, `engine` | time in each stage before the first token (`tokenize_queue`: waiting for a tokenizer thread; `tokenize`: the encode itself; `engine`: forward → first token) |
//! | `kv_gateway_tokenize_jobs` | | prompts admitted to the tokenizer pool, encoding or waiting for a thread |
//! | `kv_gateway_tokenize_rejected_total` | `reason`: `queue_full`, `deadline` | prompts refused by the tokenizer pool (503 + `Retry-After`, 504) |
//! | `kv_gateway_tokenized_tokens_total` | `source`: `cache`, `encoded` | prompt tokens the gateway's tokenizer took from its piece cache or encoded (`--tokenize-via local`; the hit rate is `cache` over both) |
//! | `kv_gateway_tokenizer_cache_bytes` | | bytes the tokenizer's piece cache holds (`--tokenizer-cache-mib`) |
//! | `kv_gateway_prompt_tokens_total` | | prompt tokens routed |
//! | `kv_gateway_completion_tokens_total` | | tokens generated (engines' usage) |
//! | `kv_gateway_retries_total` | `reason`: `connect`, `engine_error`, `first_token_timeout`, `no_url`, `no_transfer` | failovers to another worker |
//! | `kv_gateway_disaggregation_total` | `reason`: `long_uncached`, `short_uncached`, `decode_holds_prefix`, `no_prefill_worker`, `aggregated` | routed attempts by the router's disaggregation decision (`aggregated`: the reply had none) |
//! | `kv_gateway_remote_prefill_seconds` | `protocol`: `vllm`, `sglang` | a disaggregated request's prefill half: its request sent → its answer whole |
//! | `kv_gateway_half_retries_total` | `half`: `prefill`, `decode`; `reason` as above | failovers of a disaggregated request, by the half that failed (also counted in `kv_gateway_retries_total`) |
//! | `kv_gateway_route_affinity_total` | `event`: `pinned`, `gone`, `overloaded`, `timed_out`, `failed` | replica affinity's pins taken, and pins let go before their window passed, by why (`crate::router`, "replica affinity") |
//! | `kv_gateway_route_stalls_total` | `event`: `silent`, `asked_again`, `again_answered` | router replicas that missed a ping while a query waited out the patience (`silent`), queries then asked again of a live replica, and of those the ones whose second ask was answered first (`crate::router`, "stalls") |
//! | `kv_gateway_overlap_ratio` | | overlap blocks / prompt blocks of each routed request |
//! | `kv_gateway_requests_in_flight` | | requests between routing and their end |
//! | `kv_gateway_cache_parity_total` | `worker`, `outcome`: `agree`, `over_claim`, `under_claim`, `in_flight`, `evicted`, `unreported` | engine answers by how the router's predicted overlap compares with the engine's reported cached tokens ([`crate::parity`]) |
//! | `kv_gateway_cache_parity_diff_tokens` | `worker` | predicted minus reported cached prompt tokens of each judged answer (negative: the engine had more) |
//! | `kv_gateway_cache_parity_mismatch` | `worker`, `cause` | 1 while a worker's persistent mismatch is flagged, with its likely cause; absent otherwise |

use crate::router::RouterMetrics;
use kv_cluster::metrics::Registrar;
use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};
use std::time::Duration;

/// Latency buckets in seconds, 1 ms to 60 s: TTFT spans prefix hits of a few ms to
/// cold 100k-token prefills of tens of seconds.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Inter-token buckets in seconds, 0.5 ms to 2 s.
const ITL_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0,
];

/// Buckets of the signed parity difference, in tokens: 0 alone (agreement), then
/// powers of 4 from 16 tokens (a block) to 64k tokens, on both sides.
const PARITY_DIFF_BUCKETS: &[f64] = &[
    -65536.0, -16384.0, -4096.0, -1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 16.0, 64.0, 256.0,
    1024.0, 4096.0, 16384.0, 65536.0,
];

/// Every metric of the gateway.
#[derive(Clone)]
pub struct GatewayMetrics {
    requests: IntCounterVec,
    ttft: HistogramVec,
    itl: HistogramVec,
    e2e: HistogramVec,
    stages: HistogramVec,
    prompt_tokens: IntCounter,
    completion_tokens: IntCounter,
    retries: IntCounterVec,
    disaggregation: IntCounterVec,
    remote_prefill: HistogramVec,
    half_retries: IntCounterVec,
    overlap: Histogram,
    route_group_sizes: Histogram,
    route_affinity: IntCounterVec,
    route_stalls: IntCounterVec,
    in_flight: IntGauge,
    tokenize_jobs: IntGauge,
    tokenize_rejected: IntCounterVec,
    tokenized: IntCounterVec,
    tokenizer_cache_bytes: IntGauge,
    parity: IntCounterVec,
    parity_diff: HistogramVec,
    parity_mismatch: IntGaugeVec,
}

impl GatewayMetrics {
    /// Creates every metric through `r`.
    ///
    /// # Errors
    /// When a metric of the same name is already registered.
    pub fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        let latency = LATENCY_BUCKETS.to_vec();
        Ok(Self {
            requests: r.counter_vec(
                "kv_gateway_requests_total",
                "Requests answered, by endpoint and HTTP status",
                &["endpoint", "status"],
            )?,
            ttft: r.histogram_vec(
                "kv_gateway_ttft_seconds",
                "Time from a request's arrival to its first token, in seconds",
                &["endpoint"],
                latency.clone(),
            )?,
            itl: r.histogram_vec(
                "kv_gateway_itl_seconds",
                "Time between two streamed chunks of one request, in seconds",
                &["endpoint"],
                ITL_BUCKETS.to_vec(),
            )?,
            e2e: r.histogram_vec(
                "kv_gateway_e2e_seconds",
                "Time from a request's arrival to its last token, in seconds",
                &["endpoint"],
                latency.clone(),
            )?,
            stages: r.histogram_vec(
                "kv_gateway_stage_seconds",
                "Time spent before the first token in tokenize_queue, tokenize, route and engine, in seconds",
                &["stage"],
                latency,
            )?,
            prompt_tokens: r.counter(
                "kv_gateway_prompt_tokens_total",
                "Prompt tokens of routed requests",
            )?,
            completion_tokens: r.counter(
                "kv_gateway_completion_tokens_total",
                "Tokens generated, as the engines' usage reports them",
            )?,
            retries: r.counter_vec(
                "kv_gateway_retries_total",
                "Requests routed again to another worker, by reason",
                &["reason"],
            )?,
            disaggregation: r.counter_vec(
                "kv_gateway_disaggregation_total",
                "Routed attempts by the router's disaggregation decision (long_uncached, short_uncached, decode_holds_prefix, no_prefill_worker), or aggregated when the reply had none",
                &["reason"],
            )?,
            remote_prefill: r.histogram_vec(
                "kv_gateway_remote_prefill_seconds",
                "Time from sending a disaggregated request's prefill half to its whole answer, in seconds, by transfer protocol",
                &["protocol"],
                LATENCY_BUCKETS.to_vec(),
            )?,
            half_retries: r.counter_vec(
                "kv_gateway_half_retries_total",
                "Disaggregated requests routed again, by the half that failed (prefill, decode) and reason",
                &["half", "reason"],
            )?,
            overlap: r.histogram(
                "kv_gateway_overlap_ratio",
                "Overlap blocks over prompt blocks of each routed request",
                vec![0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0],
            )?,
            route_group_sizes: r.histogram(
                "kv_gateway_route_group_queries",
                "Route queries per NATS message to the router (1: a single query; more: a route batch of queries that arrived while the previous one was out)",
                vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0],
            )?,
            route_affinity: r.counter_vec(
                "kv_gateway_route_affinity_total",
                "Replica affinity: pins to a router replica taken (pinned), and pins let go before their window passed, by why (gone, overloaded, timed_out, failed)",
                &["event"],
            )?,
            route_stalls: r.counter_vec(
                "kv_gateway_route_stalls_total",
                "Router replicas that missed a ping while a route query waited out the patience (silent), queries then asked again of a live replica (asked_again), and those whose second ask was answered first (again_answered)",
                &["event"],
            )?,
            in_flight: r.gauge(
                "kv_gateway_requests_in_flight",
                "Requests between routing and their last token",
            )?,
            tokenize_jobs: r.gauge(
                "kv_gateway_tokenize_jobs",
                "Prompts admitted to the tokenizer pool, encoding or waiting for a thread",
            )?,
            tokenize_rejected: r.counter_vec(
                "kv_gateway_tokenize_rejected_total",
                "Prompts the tokenizer pool refused, by reason (queue_full, deadline)",
                &["reason"],
            )?,
            tokenized: r.counter_vec(
                "kv_gateway_tokenized_tokens_total",
                "Prompt tokens the gateway's tokenizer took from its piece cache or encoded, by source (cache, encoded)",
                &["source"],
            )?,
            tokenizer_cache_bytes: r.gauge(
                "kv_gateway_tokenizer_cache_bytes",
                "Bytes held by the tokenizer's cache of text pieces' token ids",
            )?,
            parity: r.counter_vec(
                "kv_gateway_cache_parity_total",
                "Engine answers by how the router's predicted overlap compares with the engine's reported cached prompt tokens (agree, over_claim, under_claim, unreported), per worker",
                &["worker", "outcome"],
            )?,
            parity_diff: r.histogram_vec(
                "kv_gateway_cache_parity_diff_tokens",
                "Predicted minus reported cached prompt tokens of each judged engine answer, per worker",
                &["worker"],
                PARITY_DIFF_BUCKETS.to_vec(),
            )?,
            parity_mismatch: r.gauge_vec(
                "kv_gateway_cache_parity_mismatch",
                "1 while a worker's persistent cache parity mismatch is flagged, labelled with its likely cause",
                &["worker", "cause"],
            )?,
        })
    }

    /// Counts an answered request.
    pub fn answered(&self, endpoint: &str, status: u16) {
        self.requests
            .with_label_values(&[endpoint, &status.to_string()])
            .inc();
    }

    /// Requests answered with `status` on `endpoint` so far.
    pub fn answered_count(&self, endpoint: &str, status: u16) -> u64 {
        self.requests
            .with_label_values(&[endpoint, &status.to_string()])
            .get()
    }

    /// Records a request's time to first token.
    pub fn ttft(&self, endpoint: &str, elapsed: Duration) {
        self.ttft
            .with_label_values(&[endpoint])
            .observe(elapsed.as_secs_f64());
    }

    /// Records the time between two chunks.
    pub fn itl(&self, endpoint: &str, elapsed: Duration) {
        self.itl
            .with_label_values(&[endpoint])
            .observe(elapsed.as_secs_f64());
    }

    /// Records a request's end-to-end latency.
    pub fn e2e(&self, endpoint: &str, elapsed: Duration) {
        self.e2e
            .with_label_values(&[endpoint])
            .observe(elapsed.as_secs_f64());
    }

    /// Records the time spent in one stage.
    pub fn stage(&self, stage: &str, elapsed: Duration) {
        self.stages
            .with_label_values(&[stage])
            .observe(elapsed.as_secs_f64());
    }

    /// Counts prompt tokens routed.
    pub fn prompt_tokens(&self, tokens: usize) {
        self.prompt_tokens.inc_by(tokens as u64);
    }

    /// Counts generated tokens.
    pub fn completion_tokens(&self, tokens: u64) {
        self.completion_tokens.inc_by(tokens);
    }

    /// Generated tokens counted so far.
    pub fn completion_tokens_total(&self) -> u64 {
        self.completion_tokens.get()
    }

    /// Counts a failover.
    pub fn retry(&self, reason: &str) {
        self.retries.with_label_values(&[reason]).inc();
    }

    /// Failovers counted with `reason` so far.
    pub fn retries(&self, reason: &str) -> u64 {
        self.retries.with_label_values(&[reason]).get()
    }

    /// Counts a routed attempt by the router's disaggregation decision: its reason's
    /// wire name, or `aggregated`.
    pub fn routed(&self, decision: &str) {
        self.disaggregation.with_label_values(&[decision]).inc();
    }

    /// Routed attempts counted with `decision` so far.
    pub fn routed_count(&self, decision: &str) -> u64 {
        self.disaggregation.with_label_values(&[decision]).get()
    }

    /// Records how long a prefill half took over `protocol` (`vllm`, `sglang`).
    pub fn remote_prefill(&self, protocol: &str, elapsed: Duration) {
        self.remote_prefill
            .with_label_values(&[protocol])
            .observe(elapsed.as_secs_f64());
    }

    /// Prefill halves recorded over `protocol` so far.
    pub fn remote_prefills(&self, protocol: &str) -> u64 {
        self.remote_prefill
            .with_label_values(&[protocol])
            .get_sample_count()
    }

    /// Counts a failover of a disaggregated request whose `half` (`prefill`,
    /// `decode`) failed for `reason`.
    pub fn half_retry(&self, half: &str, reason: &str) {
        self.half_retries.with_label_values(&[half, reason]).inc();
    }

    /// Failovers counted for `half` and `reason` so far.
    pub fn half_retries(&self, half: &str, reason: &str) -> u64 {
        self.half_retries.with_label_values(&[half, reason]).get()
    }

    /// Records the router's reported overlap of a routed request.
    pub fn overlap(&self, overlap_blocks: u32, request_blocks: u32) {
        if request_blocks > 0 {
            self.overlap
                .observe(f64::from(overlap_blocks) / f64::from(request_blocks));
        }
    }

    /// The in-flight gauge.
    pub fn in_flight(&self) -> &IntGauge {
        &self.in_flight
    }

    /// The gauge of prompts admitted to the tokenizer pool.
    pub fn tokenize_jobs(&self) -> &IntGauge {
        &self.tokenize_jobs
    }

    /// Counts a prompt the tokenizer pool refused for `reason`.
    pub fn tokenize_rejected(&self, reason: &str) {
        self.tokenize_rejected.with_label_values(&[reason]).inc();
    }

    /// Prompts refused for `reason` so far.
    pub fn tokenize_rejections(&self, reason: &str) -> u64 {
        self.tokenize_rejected.with_label_values(&[reason]).get()
    }

    /// Counts a prompt's tokens by where they came from, and the cache's size after.
    pub fn tokenized(&self, cached: usize, encoded: usize, cache_bytes: u64) {
        let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        self.tokenized
            .with_label_values(&["cache"])
            .inc_by(count(cached));
        self.tokenized
            .with_label_values(&["encoded"])
            .inc_by(count(encoded));
        self.tokenizer_cache_bytes
            .set(i64::try_from(cache_bytes).unwrap_or(i64::MAX));
    }

    /// Prompt tokens taken from `source` (`cache` or `encoded`) so far.
    pub fn tokenized_tokens(&self, source: &str) -> u64 {
        self.tokenized.with_label_values(&[source]).get()
    }

    /// What the router client records: route queries per NATS message, replica
    /// affinity's events and stalled replicas'.
    pub fn router(&self) -> RouterMetrics {
        RouterMetrics {
            group_sizes: self.route_group_sizes.clone(),
            affinity: self.route_affinity.clone(),
            stalls: self.route_stalls.clone(),
        }
    }

    /// The parity outcome counter of `worker` (its id as a label) for `outcome`.
    pub fn parity_outcome(&self, worker: &str, outcome: &str) -> IntCounter {
        self.parity.with_label_values(&[worker, outcome])
    }

    /// The parity difference histogram of `worker`.
    pub fn parity_diff(&self, worker: &str) -> Histogram {
        self.parity_diff.with_label_values(&[worker])
    }

    /// Flags (`true`) or clears a persistent parity mismatch of `worker` with `cause`.
    pub fn parity_mismatch(&self, worker: &str, cause: &str, flagged: bool) {
        if flagged {
            self.parity_mismatch
                .with_label_values(&[worker, cause])
                .set(1);
        } else {
            // Absent when it was never flagged: nothing to remove.
            let _ = self.parity_mismatch.remove_label_values(&[worker, cause]);
        }
    }

    /// Drops every parity series of `worker` (`outcomes`: its outcome labels), when it
    /// leaves the directory.
    pub fn forget_parity(&self, worker: &str, outcomes: &[&str], causes: &[&str]) {
        // Series never created are absent: nothing to remove.
        for outcome in outcomes {
            let _ = self.parity.remove_label_values(&[worker, outcome]);
        }
        for cause in causes {
            let _ = self.parity_mismatch.remove_label_values(&[worker, cause]);
        }
        let _ = self.parity_diff.remove_label_values(&[worker]);
    }
}
