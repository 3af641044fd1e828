//! Optional load scrape: reads the engine's Prometheus `/metrics` and publishes our
//! [`LoadMetrics`] per dp rank on `{ns}.kv.metrics.{worker_id}`.
//!
//! | our field | vLLM metric | SGLang metric |
//! |---|---|---|
//! | `num_requests_running` | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | `num_requests_waiting` | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` |
//! | `kv_used_blocks` = usage × `--total-kv-blocks` | `vllm:kv_cache_usage_perc` (≥ 0.10) or `vllm:gpu_cache_usage_perc` | `sglang:token_usage` |
//! | `active_decode_blocks` | = `kv_used_blocks` (blocks referenced by running requests) | same |
//! | `active_prefill_tokens` | 0: not exported by the engines | 0 |
//!
//! The rank is the sample's `engine` label (vLLM, one engine core per dp rank) or
//! `dp_rank` label (SGLang); unlabeled samples are rank 0. Several samples of one
//! metric and rank (other labels, e.g. `model_name`) are summed. Cost: one HTTP GET
//! per period; parsing is linear in the page size.

use crate::config::ScrapeConfig;
use crate::counters::RelayCounters;
use kv_events::{DpRank, LoadMetrics, WorkerId, encode};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// Load figures of one rank read from a metrics page.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankLoad {
    /// Requests running.
    pub running: f64,
    /// Requests waiting.
    pub waiting: f64,
    /// KV cache usage fraction, `[0, 1]`.
    pub usage: f64,
}

enum Field {
    Running,
    Waiting,
    Usage,
}

fn field(name: &str) -> Option<Field> {
    match name {
        "vllm:num_requests_running" | "sglang:num_running_reqs" => Some(Field::Running),
        "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => Some(Field::Waiting),
        "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
            Some(Field::Usage)
        }
        _ => None,
    }
}

/// The value of label `name` in a `{a="x",b="y"}` label set, if present.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    labels.split(',').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == name).then(|| v.trim().trim_matches('"'))
    })
}

/// Parses a Prometheus text page into per-rank load. Unknown metrics, comments and
/// malformed lines are ignored.
pub fn parse_metrics(page: &str) -> BTreeMap<DpRank, RankLoad> {
    let mut out: BTreeMap<DpRank, RankLoad> = BTreeMap::new();
    for line in page.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(open) => {
                let Some(close) = line[open..].find('}').map(|c| open + c) else {
                    continue;
                };
                (&line[..open], &line[open + 1..close], &line[close + 1..])
            }
            None => match line.split_once(char::is_whitespace) {
                Some((name, rest)) => (name, "", rest),
                None => continue,
            },
        };
        let Some(field) = field(name) else {
            continue;
        };
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())
        else {
            continue;
        };
        let rank = label(labels, "engine")
            .or_else(|| label(labels, "dp_rank"))
            .and_then(|r| r.parse::<u32>().ok())
            .map_or(DpRank(0), DpRank);
        let load = out.entry(rank).or_default();
        match field {
            Field::Running => load.running += value,
            Field::Waiting => load.waiting += value,
            Field::Usage => load.usage += value,
        }
    }
    out
}

/// Our load metrics for one rank from its scraped figures.
pub fn to_load_metrics(
    worker_id: WorkerId,
    rank: DpRank,
    load: &RankLoad,
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
    /// Capacity per rank, in blocks.
    pub total_kv_blocks: u64,
    /// Metrics.
    pub counters: RelayCounters,
}

impl Scraper {
    /// Scrapes every period and publishes until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.config.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            match self.scrape_once().await {
                Ok(()) => {
                    failing = false;
                    self.counters.scrape("ok");
                }
                Err(reason) => {
                    self.counters.scrape("failed");
                    if !failing {
                        warn!(addr = %self.config.addr, path = %self.config.path, %reason, "engine metrics scrape failed");
                    }
                    failing = true;
                }
            }
        }
    }

    async fn scrape_once(&self) -> Result<(), String> {
        let timeout = self.config.interval.min(Duration::from_secs(5));
        let resp = kv_cluster::http::get(&self.config.addr, &self.config.path, timeout)
            .await
            .map_err(|e| e.to_string())?;
        if resp.status != 200 {
            return Err(format!("http status {}", resp.status));
        }
        for (rank, load) in parse_metrics(&resp.body) {
            if rank.0 >= self.dp_size {
                debug!(%rank, "metrics for a rank outside --dp-size ignored");
                continue;
            }
            let metrics = to_load_metrics(self.worker_id, rank, &load, self.total_kv_blocks);
            let bytes = encode(&metrics).map_err(|e| e.to_string())?;
            self.nats
                .publish(self.subject.clone(), bytes.into())
                .await
                .map_err(|e| format!("publishing load metrics: {e}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
garbage line
"#;

    #[test]
    fn vllm_pages_parse_per_engine_rank() {
        let loads = parse_metrics(VLLM);
        assert_eq!(
            loads[&DpRank(0)],
            RankLoad {
                running: 3.0,
                waiting: 2.0,
                usage: 0.25
            }
        );
        assert_eq!(loads[&DpRank(1)].running, 1.0);
        let m = to_load_metrics(WorkerId(7), DpRank(0), &loads[&DpRank(0)], 1000);
        assert_eq!(
            (
                m.kv_used_blocks,
                m.active_decode_blocks,
                m.num_requests_running,
                m.num_requests_waiting
            ),
            (250, 250, 3, 2)
        );
    }

    #[test]
    fn sglang_pages_and_unlabeled_samples_parse() {
        let page = "sglang:num_running_reqs{dp_rank=\"1\"} 4\nsglang:num_queue_reqs 7\nsglang:token_usage{dp_rank=\"1\"} 0.5 1700000000\n";
        let loads = parse_metrics(page);
        assert_eq!(loads[&DpRank(0)].waiting, 7.0);
        assert_eq!(loads[&DpRank(1)].running, 4.0);
        assert_eq!(loads[&DpRank(1)].usage, 0.5);
        assert!(parse_metrics("vllm:num_requests_running{engine=\"0\"} NaN").is_empty());
    }
}
