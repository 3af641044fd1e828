//! Optional load scrape: reads the engine's Prometheus `/metrics` and publishes our
//! [`LoadMetrics`] per dp rank on `{ns}.kv.metrics.{worker_id}`; the same page gives
//! the engine's KV cache facts (block size and capacity, [`crate::facts`]).
//!
//! | our field | vLLM metric | SGLang metric |
//! |---|---|---|
//! | `num_requests_running` | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | `num_requests_waiting` | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` |
//! | `kv_used_blocks` = usage × the rank's capacity | `vllm:kv_cache_usage_perc` (≥ 0.10) or `vllm:gpu_cache_usage_perc` | `sglang:token_usage` |
//! | `kv_total_blocks` | `vllm:cache_config_info{num_gpu_blocks}`, per rank ([`page`]: a data-parallel vLLM states the total) | `sglang:num_pages` (or max tokens / page size) |
//! | `active_decode_blocks` | = `kv_used_blocks` (blocks referenced by running requests) | same |
//! | `active_prefill_tokens` | 0: not exported by the engines | 0 |
//!
//! Each period also reads the engine's `/v1/models` ([`crate::models`]) until it
//! answers once, before the first scrape counts as done, so the worker's first
//! registration carries its context length when the engine is up.
//!
//! The page is read over `http://` or `https://` ([`target`]: the URLs and the
//! client, with `--metrics-tls-ca`). Parsing is in [`page`]. Cost: one HTTP GET per
//! period on a kept-alive connection, at most [`MAX_PAGE_BYTES`]; parsing is linear
//! in the page size.

pub mod page;
pub mod target;

use crate::counters::RelayCounters;
use crate::facts::EngineFacts;
use crate::models::ModelsEndpoint;
use kv_events::{DpRank, LoadMetrics, WorkerId, encode};
pub use page::{CacheFacts, ScrapedRankLoad, parse_cache_facts, parse_metrics};
use std::time::Duration;
use target::ScrapeConfig;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// Largest metrics page read, in bytes: 16 MiB, far above any engine's page.
pub const MAX_PAGE_BYTES: usize = kv_cluster::http::MAX_RESPONSE_BYTES;

/// Our load metrics for one rank from its scraped figures.
pub fn to_load_metrics(
    worker_id: WorkerId,
    rank: DpRank,
    load: &ScrapedRankLoad,
    total_kv_blocks: u64,
) -> LoadMetrics {
    let used = (load.usage.clamp(0.0, 1.0) * total_kv_blocks as f64).round() as u64;
    let count = |v: f64| v.max(0.0).min(f64::from(u32::MAX)) as u32;
    LoadMetrics {
        worker_id,
        dp_rank: rank,
        active_decode_blocks: used,
        active_prefill_tokens: 0,
        kv_used_blocks: used,
        kv_total_blocks: total_kv_blocks,
        num_requests_running: count(load.running),
        num_requests_waiting: count(load.waiting),
    }
}

/// The scrape task's inputs.
pub struct Scraper {
    /// Where and how often.
    pub config: ScrapeConfig,
    /// Where to publish.
    pub nats: async_nats::Client,
    /// The worker's load metrics subject.
    pub subject: String,
    /// The worker.
    pub worker_id: WorkerId,
    /// Ranks `0..dp_size` are published; others ignored.
    pub dp_size: u32,
    /// The engine's KV cache facts: the page's are offered here.
    pub facts: watch::Sender<EngineFacts>,
    /// Metrics.
    pub counters: RelayCounters,
}

impl Scraper {
    /// Scrapes every period and publishes until `shutdown`. A client that cannot be
    /// built (no usable TLS set-up) is logged and ends the scrape; the worker then
    /// registers without the page's facts, as with an engine that never answers.
    pub async fn run(self, shutdown: CancellationToken) {
        let client = match self.config.client() {
            Ok(client) => client,
            Err(reason) => {
                error!(url = %self.config.url, %reason, "cannot build the scrape's http client");
                self.facts
                    .send_if_modified(|f| !std::mem::replace(&mut f.scraped, true));
                return;
            }
        };
        let mut tick = tokio::time::interval(self.config.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        // The last conflicting page block size logged, so a conflict is logged once.
        let mut reported = None;
        // `/v1/models` still to be read, and whether its last read failed.
        let mut models = self.config.models.clone();
        let mut models_failing = false;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Some(endpoint) = &models
                && self
                    .read_models(&client, endpoint, &mut models_failing)
                    .await
            {
                models = None;
            }
            let result = self.scrape_once(&client, &mut reported).await;
            // Read or tried once: the worker may register (see `crate::facts`).
            self.facts
                .send_if_modified(|f| !std::mem::replace(&mut f.scraped, true));
            match result {
                Ok(()) => {
                    failing = false;
                    self.counters.scrape("ok");
                }
                Err(reason) => {
                    self.counters.scrape("failed");
                    if !failing {
                        warn!(url = %self.config.url, %reason, "engine metrics scrape failed");
                    }
                    failing = true;
                }
            }
        }
    }

    /// The deadline of one read of the engine: the period, at most 5 s.
    fn timeout(&self) -> Duration {
        self.config.interval.min(Duration::from_secs(5))
    }

    /// Reads the engine's context length into the facts; `true` once the engine
    /// answered (with one or without), `false` to try again next period (the first
    /// failure of a run is logged).
    async fn read_models(
        &self,
        client: &reqwest::Client,
        endpoint: &ModelsEndpoint,
        failing: &mut bool,
    ) -> bool {
        match endpoint.read(client, self.timeout()).await {
            Ok(len) => {
                self.counters.scrape("models_ok");
                match len {
                    Some(len) => {
                        self.facts
                            .send_if_modified(|f| f.max_model_len.replace(len) != Some(len));
                    }
                    None => {
                        info!(url = %endpoint.url,
                            "the engine's /v1/models names no max_model_len; none is registered");
                    }
                }
                true
            }
            Err(reason) => {
                self.counters.scrape("models_failed");
                if !std::mem::replace(failing, true) {
                    warn!(url = %endpoint.url, %reason,
                        "reading the engine's max_model_len failed; retrying every scrape period");
                }
                false
            }
        }
    }

    async fn scrape_once(
        &self,
        client: &reqwest::Client,
        reported: &mut Option<u32>,
    ) -> Result<(), String> {
        let (status, page) = kv_cluster::http::get_text(
            client,
            self.config.url.clone(),
            self.timeout(),
            MAX_PAGE_BYTES,
        )
        .await
        .map_err(|e| e.to_string())?;
        if status != reqwest::StatusCode::OK {
            return Err(format!("http status {status}"));
        }
        let cache = parse_cache_facts(&page);
        self.offer(&cache, reported);
        let known = self.facts.borrow().kv_blocks.unwrap_or(0);
        for (rank, load) in parse_metrics(&page) {
            if rank.0 >= self.dp_size {
                debug!(%rank, "metrics for a rank outside the dp size ignored");
                continue;
            }
            let capacity = cache.kv_blocks.get(&rank).copied().unwrap_or(known);
            let metrics = to_load_metrics(self.worker_id, rank, &load, capacity);
            let bytes = encode(&metrics).map_err(|e| e.to_string())?;
            self.nats
                .publish(self.subject.clone(), bytes.into())
                .await
                .map_err(|e| format!("publishing load metrics: {e}"))?;
        }
        Ok(())
    }

    /// Offers the page's block size and capacity to the shared facts; a block size
    /// other than the one already fixed is logged (once per value) and counted.
    fn offer(&self, cache: &CacheFacts, reported: &mut Option<u32>) {
        for &size in &cache.block_sizes {
            let mut conflict = None;
            self.facts.send_if_modified(|f| {
                let before = f.block_size;
                conflict = f.offer_block_size(size);
                before != f.block_size
            });
            if let Some(fixed) = conflict {
                self.counters.scrape("block_size_conflict");
                if reported.replace(size) != Some(size) {
                    error!(url = %self.config.url, page_block_size = size, block_size = fixed,
                        "the engine's metrics page states block_size {size} but the relay already \
                         uses {fixed} tokens (from the engine's events or an earlier page); \
                         events of another size are refused");
                }
            }
        }
        let smallest = (0..self.dp_size)
            .filter_map(|r| cache.kv_blocks.get(&DpRank(r)).copied())
            .min();
        if let Some(blocks) = smallest {
            self.facts
                .send_if_modified(|f| f.kv_blocks.replace(blocks) != Some(blocks));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_scaled_by_the_ranks_capacity() {
        let load = ScrapedRankLoad {
            running: 3.0,
            waiting: 2.0,
            usage: 0.25,
        };
        let m = to_load_metrics(WorkerId(7), DpRank(0), &load, 1000);
        assert_eq!(
            (
                m.kv_used_blocks,
                m.kv_total_blocks,
                m.active_decode_blocks,
                m.num_requests_running,
                m.num_requests_waiting
            ),
            (250, 1000, 250, 3, 2)
        );
    }
}
