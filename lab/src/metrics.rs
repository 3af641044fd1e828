//! What one simulated run measured: a record per request, and their aggregate.
//!
//! All times are simulated model time. TTFT is first token minus arrival; end-to-end
//! latency is finish minus arrival; ITL (inter-token latency) of a request is
//! `(finish − first token) / (output_tokens − 1)`, defined for requests with at least
//! two output tokens. Statistics come from `engine_model::LatencyHistogram`, as the
//! online replay's do: nearest-rank percentiles within 0.1%, exact means. Aggregation
//! is one pass: `O(n)` for `n` requests.

use crate::config::ns_to_ms;
use engine_model::{LatencyHistogram, LatencyStats};
use kv_events::disaggregation::DisaggregationReason;
use serde::{Deserialize, Serialize};

/// Points of the TTFT CDF kept in the report: quantiles `0, 1/(N−1), …, 1`.
pub const CDF_POINTS: usize = 101;

/// What happened to one request, in simulated ns since the start of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestRecord {
    /// Arrival time.
    pub arrival_ns: u64,
    /// Prompt length, in tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the prefix cache, in tokens (set at first token).
    pub cached_tokens: u64,
    /// The router's predicted overlap on the rank that prefills it (its index's
    /// blocks × block size, at most the prompt), in tokens (set when routed).
    pub predicted_tokens: u64,
    /// The part of `cached_tokens` loaded back from the engine's CPU tier, in tokens.
    pub loaded_tokens: u64,
    /// When the first token was produced; `None` until then.
    pub first_token_ns: Option<u64>,
    /// When the request finished; `None` until then.
    pub finish_ns: Option<u64>,
    /// Tokens generated.
    pub output_tokens: u64,
    /// Index of the worker it was routed to (its decode worker when disaggregated);
    /// `None` if not routed.
    pub worker: Option<usize>,
    /// Index of the worker that prefilled it, when disaggregated.
    pub prefill_worker: Option<usize>,
    /// Prompt blocks moved from the prefill worker to the decode worker (those the
    /// decode worker did not hold), in blocks; 0 unless disaggregated.
    pub transferred_blocks: u64,
    /// Why a split fleet's router placed it as it did; `None` in an aggregated fleet.
    pub reason: Option<DisaggregationReason>,
    /// The router or the engine refused it.
    pub rejected: bool,
}

/// Aggregate of one run. JSON keys are the field names; latencies are
/// `{mean, p50, p90, p99}` objects in model ms, `null` when nothing completed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunMetrics {
    /// Requests in the trace.
    pub requests: u64,
    /// Requests that finished.
    pub completed: u64,
    /// Requests the router or an engine refused.
    pub rejected: u64,
    /// Prefix-cache hit rate: Σ cached tokens / Σ prompt tokens over completed requests
    /// (GPU hits and CPU-tier loads).
    pub hit_rate: Option<f64>,
    /// The CPU-tier part of `hit_rate`: Σ tokens loaded back from the CPU tier / Σ
    /// prompt tokens (0 without a CPU tier; absent in older reports).
    #[serde(default)]
    pub cpu_tier_hit_rate: Option<f64>,
    /// Time to first token, in model ms.
    pub ttft_ms: Option<LatencyStats>,
    /// Inter-token latency per request (requests with ≥ 2 output tokens), in model ms.
    pub itl_ms: Option<LatencyStats>,
    /// End-to-end latency, in model ms.
    pub e2e_ms: Option<LatencyStats>,
    /// Output tokens per second of simulated time, from the first arrival to the last
    /// finish.
    pub throughput_tokens_per_s: f64,
    /// Completed requests per second over the same span.
    pub throughput_requests_per_s: f64,
    /// Requests routed to each worker, in worker order (a prefill worker counts the
    /// requests it prefilled, a decode worker those it decoded).
    pub requests_per_worker: Vec<u64>,
    /// Completed requests prefilled on a prefill worker and decoded on another (0 in
    /// an aggregated fleet; absent in older reports).
    #[serde(default)]
    pub disaggregated: u64,
    /// Prompt blocks moved from prefill to decode workers over completed requests, in
    /// blocks (absent in older reports).
    #[serde(default)]
    pub transferred_blocks: u64,
    /// Completed requests by the split fleet router's reason (all 0 in an aggregated
    /// fleet; absent in older reports).
    #[serde(default)]
    pub decisions: Decisions,
    /// TTFT quantiles `0, 0.01, …, 1` (`CDF_POINTS`, 101 values), in model ms; empty when
    /// nothing completed. The chart's CDF is drawn from these.
    pub ttft_cdf_ms: Vec<f64>,
    /// KV events the index refused (a `Stored` with an unknown parent); 0 unless the
    /// simulator delivers events out of order, so a non-zero value is a bug.
    pub refused_events: u64,
    /// The router's prediction against the engines' own hits, over completed requests
    /// (absent in older reports).
    #[serde(default)]
    pub prediction: Prediction,
}

/// How far the router's predicted overlaps were from the hits the engines reported,
/// over completed requests, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Prediction {
    /// Σ prompt tokens.
    pub prompt_tokens: u64,
    /// Σ predicted overlap (index blocks × block size on the chosen rank).
    pub predicted_tokens: u64,
    /// Σ of predicted minus cached, where the router predicted more than the engine
    /// reused (it priced reuse that did not happen).
    pub overclaimed_tokens: u64,
    /// Requests whose predicted overlap exceeded the engine's hit.
    pub overclaimed_requests: u64,
    /// Σ of cached minus predicted, where the engine reused more than predicted.
    pub underclaimed_tokens: u64,
}

impl Prediction {
    /// Σ predicted / Σ prompt tokens: the hit rate the router expected.
    pub fn predicted_rate(&self) -> Option<f64> {
        ratio(self.predicted_tokens, self.prompt_tokens)
    }

    fn count(&mut self, prompt: u64, predicted: u64, cached: u64) {
        self.prompt_tokens += prompt;
        self.predicted_tokens += predicted;
        if predicted > cached {
            self.overclaimed_tokens += predicted - cached;
            self.overclaimed_requests += 1;
        } else {
            self.underclaimed_tokens += cached - predicted;
        }
    }
}

/// Requests by the router's disaggregation reason (`kv_events::disaggregation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Decisions {
    /// Prefilled on a prefill worker: too much to prefill on the decode worker.
    pub long_uncached: u64,
    /// Prefilled on the decode worker: little of the prompt uncached there.
    pub short_uncached: u64,
    /// Prefilled on the decode worker: it held most of the prompt's blocks.
    pub decode_holds_prefix: u64,
    /// Prefilled on the decode worker: no prefill worker was eligible.
    pub no_prefill_worker: u64,
}

impl Decisions {
    fn count(&mut self, reason: DisaggregationReason) {
        *match reason {
            DisaggregationReason::LongUncached => &mut self.long_uncached,
            DisaggregationReason::ShortUncached => &mut self.short_uncached,
            DisaggregationReason::DecodeHoldsPrefix => &mut self.decode_holds_prefix,
            DisaggregationReason::NoPrefillWorker => &mut self.no_prefill_worker,
        } += 1;
    }
}

impl RunMetrics {
    /// Aggregates the records of a run over `workers` workers.
    pub fn from_records(records: &[RequestRecord], workers: usize, refused_events: u64) -> Self {
        let mut ttft = LatencyHistogram::default();
        let mut itl = LatencyHistogram::default();
        let mut e2e = LatencyHistogram::default();
        let (mut cached, mut prompt, mut output) = (0u64, 0u64, 0u64);
        let mut loaded = 0u64;
        let mut completed = 0u64;
        let mut rejected = 0u64;
        let (mut disaggregated, mut transferred_blocks) = (0u64, 0u64);
        let mut decisions = Decisions::default();
        let mut prediction = Prediction::default();
        let mut per_worker = vec![0u64; workers];
        let mut span_end = 0u64;
        let span_start = records.iter().map(|r| r.arrival_ns).min().unwrap_or(0);
        for r in records {
            if r.rejected {
                rejected += 1;
            }
            for w in [r.worker, r.prefill_worker].into_iter().flatten() {
                if let Some(count) = per_worker.get_mut(w) {
                    *count += 1;
                }
            }
            let (Some(first), Some(finish)) = (r.first_token_ns, r.finish_ns) else {
                continue;
            };
            completed += 1;
            if let Some(reason) = r.reason {
                decisions.count(reason);
            }
            if r.prefill_worker.is_some() {
                disaggregated += 1;
                transferred_blocks += r.transferred_blocks;
            }
            span_end = span_end.max(finish);
            prediction.count(r.prompt_tokens, r.predicted_tokens, r.cached_tokens);
            cached += r.cached_tokens;
            loaded += r.loaded_tokens;
            prompt += r.prompt_tokens;
            output += r.output_tokens;
            ttft.record(ns_to_ms(first.saturating_sub(r.arrival_ns)));
            e2e.record(ns_to_ms(finish.saturating_sub(r.arrival_ns)));
            if r.output_tokens >= 2 {
                itl.record(ns_to_ms(finish.saturating_sub(first)) / (r.output_tokens - 1) as f64);
            }
        }
        let span_s = ns_to_ms(span_end.saturating_sub(span_start)) / 1_000.0;
        let per_s = |x: u64| if span_s > 0.0 { x as f64 / span_s } else { 0.0 };
        let ttft_cdf_ms = (0..CDF_POINTS)
            .filter_map(|i| ttft.quantile(i as f64 / (CDF_POINTS - 1) as f64))
            .collect();
        Self {
            requests: records.len() as u64,
            completed,
            rejected,
            hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
            cpu_tier_hit_rate: (prompt > 0).then(|| loaded as f64 / prompt as f64),
            ttft_ms: ttft.stats(),
            itl_ms: itl.stats(),
            e2e_ms: e2e.stats(),
            throughput_tokens_per_s: per_s(output),
            throughput_requests_per_s: per_s(completed),
            requests_per_worker: per_worker,
            disaggregated,
            transferred_blocks,
            decisions,
            ttft_cdf_ms,
            refused_events,
            prediction,
        }
    }
}

/// `part / whole`, `None` when `whole` is 0.
pub(crate) fn ratio(part: u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| part as f64 / whole as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(arrival_ms: u64, ttft_ms: u64, e2e_ms: u64, out: u64, worker: usize) -> RequestRecord {
        RequestRecord {
            arrival_ns: arrival_ms * 1_000_000,
            prompt_tokens: 1_000,
            cached_tokens: 250,
            loaded_tokens: 100,
            first_token_ns: Some((arrival_ms + ttft_ms) * 1_000_000),
            finish_ns: Some((arrival_ms + e2e_ms) * 1_000_000),
            output_tokens: out,
            worker: Some(worker),
            ..RequestRecord::default()
        }
    }

    #[test]
    fn aggregates_latencies_hit_rate_and_throughput() {
        let records = [
            done(0, 100, 1_100, 11, 0),
            RequestRecord {
                prefill_worker: Some(0),
                transferred_blocks: 7,
                reason: Some(DisaggregationReason::LongUncached),
                ..done(1_000, 300, 2_000, 1, 1)
            },
            RequestRecord {
                arrival_ns: 5,
                prompt_tokens: 10,
                rejected: true,
                ..RequestRecord::default()
            },
        ];
        let m = RunMetrics::from_records(&records, 2, 0);
        assert_eq!((m.requests, m.completed, m.rejected), (3, 2, 1));
        assert_eq!(m.hit_rate, Some(0.25));
        assert_eq!(m.cpu_tier_hit_rate, Some(0.1));
        // Percentiles are nearest-rank within the histogram's 0.1%; means are exact.
        let close = |got: f64, want: f64| (got - want).abs() <= want * 1e-3;
        let ttft = m.ttft_ms.unwrap();
        assert_eq!(ttft.mean, 200.0);
        assert!(close(ttft.p50, 100.0), "{ttft:?}");
        // Only the 11-token request has an ITL: 1000 ms over 10 gaps.
        assert_eq!(m.itl_ms.unwrap().mean, 100.0);
        assert!(close(m.e2e_ms.unwrap().p99, 2_000.0), "{:?}", m.e2e_ms);
        // 12 tokens and 2 requests from t = 0 to the last finish at 3 s.
        assert!((m.throughput_tokens_per_s - 4.0).abs() < 1e-9);
        assert!((m.throughput_requests_per_s - 2.0 / 3.0).abs() < 1e-9);
        // Worker 0 prefilled the second request, which worker 1 decoded.
        assert_eq!(m.requests_per_worker, vec![2, 1]);
        assert_eq!((m.disaggregated, m.transferred_blocks), (1, 7));
        assert_eq!(m.decisions.long_uncached, 1);
        assert_eq!(m.ttft_cdf_ms.len(), CDF_POINTS);
        assert!(close(m.ttft_cdf_ms[0], 100.0));
        assert!(close(m.ttft_cdf_ms[50], 100.0));
        assert!(close(m.ttft_cdf_ms[51], 300.0));
        assert!(close(m.ttft_cdf_ms[CDF_POINTS - 1], 300.0));
    }

    #[test]
    fn nothing_completed_gives_nulls() {
        let m = RunMetrics::from_records(&[], 3, 0);
        assert_eq!((m.hit_rate, m.ttft_ms, m.itl_ms), (None, None, None));
        assert!(m.ttft_cdf_ms.is_empty());
        assert_eq!(m.throughput_tokens_per_s, 0.0);
        let json = serde_json::to_value(&m).unwrap();
        assert!(json["ttft_ms"].is_null());
        assert_eq!(json["requests_per_worker"], serde_json::json!([0, 0, 0]));
    }
}
