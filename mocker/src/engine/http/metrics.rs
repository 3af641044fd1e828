//! `GET /metrics` with vLLM's metric names, so scrapers written for vLLM (a relay's
//! load scrape, a dashboard) read the mock unchanged.
//!
//! Gauges per dp rank (label `engine`, vLLM's label for it, plus `model_name`):
//! `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//! `vllm:kv_cache_usage_perc` (a fraction 0..=1 despite the name, as in vLLM), and the
//! info gauge `vllm:cache_config_info` (value 1) whose labels carry `block_size` and
//! `num_gpu_blocks`. As vLLM's API server does with data parallelism, every `engine`
//! label carries the total of all ranks' blocks (vLLM sums its engine cores'
//! `num_gpu_blocks` into the one `CacheConfig` it labels per engine;
//! `vllm/v1/engine/utils.py`), so a relay reading the mock reads vLLM's shape. Values
//! are read from the ranks at scrape time, so a scrape costs one short lock per rank
//! and nothing between scrapes.
//!
//! Counters per dp rank, as vLLM's: `vllm:prefix_cache_queries_total` and
//! `vllm:prefix_cache_hits_total` (prompt tokens of the HTTP requests that were
//! prefilled, and the part of them served from the prefix cache, in tokens) and
//! `vllm:request_success_total` (HTTP requests that generated all their tokens, label
//! `finished_reason="length"`), so a benchmark reads the cached ratio and the requests
//! each engine served from two scrapes. Each request adds to them once, when its answer
//! is dropped ([`RankCounters::record`]): a few atomic adds.
//!
//! Counters of a KV connector, as vLLM's (an engine in the `prefill` or `decode` role
//! has one; in role `both` they stay 0, as in a vLLM without a connector):
//! `vllm:external_prefix_cache_queries_total` (prompt tokens of the requests it
//! prefilled or loaded) and `vllm:external_prefix_cache_hits_total` (prompt tokens a
//! decode worker loaded over a KV transfer instead of computing: the prompt minus
//! its own cache hits), so a test or a real-vLLM comparison reads one name.

use super::super::progress::Progress;
use super::super::rank::Rank;
use prometheus::{Encoder, GaugeVec, IntCounter, IntCounterVec, Opts, Registry, TextEncoder};
use std::sync::Arc;

/// The registry and gauges of one worker.
#[derive(Debug)]
pub(super) struct EngineMetrics {
    registry: Registry,
    running: GaugeVec,
    waiting: GaugeVec,
    usage: GaugeVec,
    counters: Vec<RankCounters>,
    model_name: String,
}

/// One dp rank's request counters (see the module docs); clones share the counts.
#[derive(Debug, Clone)]
pub(super) struct RankCounters {
    queries: IntCounter,
    hits: IntCounter,
    external_queries: IntCounter,
    external_hits: IntCounter,
    success: IntCounter,
}

/// What a request meant to the engine's KV connector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::engine) enum KvConnector {
    /// The engine has none (role `both`).
    Absent,
    /// Asked, nothing loaded: the prompt was computed here.
    Queried,
    /// The prompt's KV beyond the engine's own hits came over a transfer.
    Loaded,
}

impl RankCounters {
    /// Counts one request of `prompt_tokens` tokens whose last progress was `p`: its
    /// prompt and cached tokens once it was prefilled (and what its KV connector
    /// queried and loaded), a success once it finished.
    pub fn record(&self, p: &Progress, prompt_tokens: u64, kv: KvConnector) {
        if let Some(cached) = p.cached_tokens {
            let cached = cached.min(prompt_tokens);
            self.queries.inc_by(prompt_tokens);
            self.hits.inc_by(cached);
            if kv != KvConnector::Absent {
                self.external_queries.inc_by(prompt_tokens);
            }
            if kv == KvConnector::Loaded {
                self.external_hits.inc_by(prompt_tokens - cached);
            }
        }
        if p.finished && p.error.is_none() {
            self.success.inc();
        }
    }
}

impl EngineMetrics {
    /// Registers the gauges for a worker serving `model_name` with `dp_size` ranks of
    /// `num_gpu_blocks` blocks of `block_size` tokens.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric cannot be registered (names are fixed, so
    /// only on a programming error).
    pub fn new(
        model_name: &str,
        block_size: u32,
        num_gpu_blocks: u64,
        dp_size: usize,
    ) -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let gauge = |name: &str, help: &str| -> Result<GaugeVec, prometheus::Error> {
            let g = GaugeVec::new(Opts::new(name, help), &["model_name", "engine"])?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let running = gauge(
            "vllm:num_requests_running",
            "Requests in the running batch.",
        )?;
        let waiting = gauge(
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled.",
        )?;
        let usage = gauge(
            "vllm:kv_cache_usage_perc",
            "KV cache usage; 1 means 100 percent.",
        )?;
        let info = GaugeVec::new(
            Opts::new(
                "vllm:cache_config_info",
                "Information of the KV cache configuration.",
            ),
            &[
                "block_size",
                "num_gpu_blocks",
                "enable_prefix_caching",
                "engine",
            ],
        )?;
        registry.register(Box::new(info.clone()))?;
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(c.clone()))?;
            Ok::<_, prometheus::Error>(c)
        };
        let per_rank = ["model_name", "engine"];
        let queries = counter(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            &per_rank,
        )?;
        let hits = counter(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            &per_rank,
        )?;
        let external_queries = counter(
            "vllm:external_prefix_cache_queries_total",
            "External prefix cache queries from KV connector cross-instance cache \
             sharing, in terms of number of queried tokens.",
            &per_rank,
        )?;
        let external_hits = counter(
            "vllm:external_prefix_cache_hits_total",
            "External prefix cache hits from KV connector cross-instance cache sharing, \
             in terms of number of cached tokens.",
            &per_rank,
        )?;
        let success = counter(
            "vllm:request_success_total",
            "Count of successfully processed requests.",
            &["model_name", "engine", "finished_reason"],
        )?;
        let counters = (0..dp_size)
            .map(|rank| {
                let engine = rank.to_string();
                let labels = [model_name, engine.as_str()];
                RankCounters {
                    queries: queries.with_label_values(&labels),
                    hits: hits.with_label_values(&labels),
                    external_queries: external_queries.with_label_values(&labels),
                    external_hits: external_hits.with_label_values(&labels),
                    success: success.with_label_values(&[model_name, engine.as_str(), "length"]),
                }
            })
            .collect();
        // vLLM's total over the ranks, under every rank's label (see the module docs).
        let total = num_gpu_blocks.saturating_mul(dp_size as u64);
        let (bs, blocks) = (block_size.to_string(), total.to_string());
        for engine in 0..dp_size {
            let engine = engine.to_string();
            info.with_label_values(&[bs.as_str(), blocks.as_str(), "True", engine.as_str()])
                .set(1.0);
        }
        Ok(Self {
            registry,
            running,
            waiting,
            usage,
            counters,
            model_name: model_name.to_owned(),
        })
    }

    /// The counters of dp rank `rank`, which must be below the `dp_size` given to
    /// [`Self::new`] (as `EngineHttpState::ranks` is indexed: the rank is validated before).
    pub fn rank_counters(&self, rank: usize) -> RankCounters {
        self.counters[rank].clone()
    }

    /// Reads every rank and renders the Prometheus text format.
    pub fn render(&self, ranks: &[Arc<Rank>]) -> String {
        for (i, rank) in ranks.iter().enumerate() {
            let u = rank.usage();
            let engine = i.to_string();
            let labels = [self.model_name.as_str(), engine.as_str()];
            self.running
                .with_label_values(&labels)
                .set(u.running as f64);
            self.waiting
                .with_label_values(&labels)
                .set(u.waiting as f64);
            self.usage.with_label_values(&labels).set(u.kv_cache_usage);
        }
        let mut out = Vec::new();
        // Encoding gauges into a Vec cannot fail (no I/O, valid names).
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}
