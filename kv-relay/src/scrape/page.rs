//! Reading an engine's Prometheus text page: the samples, the load per rank, and what
//! the engine states about its KV cache (block size and capacity).
//!
//! The samples are read by the workspace's one Prometheus text reader,
//! [`kv_cluster::http::exposition`] (comments, malformed lines and non-finite values
//! skipped; label values with the format's quoting rules, because vLLM's
//! `cache_config_info` carries free-form configuration values). Only the metrics the
//! relay uses are interpreted; unknown ones are skipped, so a page from a newer
//! engine version still parses. Cost: linear in the page size, no allocation per
//! sample.
//!
//! The rank of a sample is its `engine` label (vLLM: one engine core per dp rank) or
//! its `dp_rank` label (SGLang); an unlabeled sample is rank 0.
//!
//! KV cache facts (engine code: vLLM `vllm/v1/metrics/loggers.py` publishes the
//! `CacheConfig` as an info gauge; SGLang's metrics collector publishes its pool
//! constants as gauges):
//!
//! | fact | vLLM | SGLang |
//! |---|---|---|
//! | block size, tokens | `vllm:cache_config_info{block_size}` | `sglang:page_size` |
//! | capacity per rank, blocks | `vllm:cache_config_info{num_gpu_blocks}`, divided by the engines it labels when they all carry one figure (below) | `sglang:num_pages`, else `sglang:max_total_num_tokens` / page size |
//!
//! vLLM with data parallelism (`--data-parallel-size N`, one API server for the N
//! engine cores) states the **sum** of its engines' `num_gpu_blocks` under every
//! `engine` label: the API server's `CacheConfig` adds up each engine core's
//! `num_gpu_blocks` as the cores report ready (`vllm/v1/engine/utils.py`,
//! `wait_for_engine_startup`: "Sum values from all engines in DP case"), and
//! `PrometheusStatLogger.log_metrics_info` (`vllm/v1/metrics/loggers.py`) writes that
//! one config once per engine index it serves. Read as is, each rank would count N
//! times its real capacity. So when two or more engine labels carry the same figure,
//! it is the total of those engines and each rank's capacity is the figure divided by
//! their number (ranks of one deployment are sized alike; the total is all the page
//! says). Labels carrying different figures are per-rank figures and taken as they
//! are; a single label is that engine's own figure.

use kv_cluster::http::exposition::{Sample, samples};
use kv_events::DpRank;
use std::collections::{BTreeMap, BTreeSet};

/// The dp rank of a sample (see the module docs).
fn rank(s: &Sample<'_>) -> DpRank {
    s.label("engine")
        .or_else(|| s.label("dp_rank"))
        .and_then(|r| r.parse::<u32>().ok())
        .map_or(DpRank(0), DpRank)
}

/// Load figures of one rank read from a metrics page.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ScrapedRankLoad {
    /// Requests running.
    pub running: f64,
    /// Requests waiting.
    pub waiting: f64,
    /// KV cache usage fraction, `[0, 1]`.
    pub usage: f64,
}

/// Parses a page into per-rank load. Several samples of one metric and rank (other
/// labels, e.g. `model_name`) are summed.
pub fn parse_metrics(page: &str) -> BTreeMap<DpRank, ScrapedRankLoad> {
    let mut out: BTreeMap<DpRank, ScrapedRankLoad> = BTreeMap::new();
    for s in samples(page) {
        let slot: fn(&mut ScrapedRankLoad) -> &mut f64 = match s.name {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => {
                |l: &mut ScrapedRankLoad| &mut l.running
            }
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => {
                |l: &mut ScrapedRankLoad| &mut l.waiting
            }
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                |l: &mut ScrapedRankLoad| &mut l.usage
            }
            _ => continue,
        };
        *slot(out.entry(rank(&s)).or_default()) += s.value;
    }
    out
}

/// What a metrics page states about the engine's KV cache.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheFacts {
    /// Every block size the page states, in tokens (one in a sane engine; more is
    /// reported as a conflict by the caller).
    pub block_sizes: BTreeSet<u32>,
    /// KV cache capacity per rank, in blocks.
    pub kv_blocks: BTreeMap<DpRank, u64>,
}

/// A positive integer sample value or label.
fn count(v: f64) -> Option<u64> {
    (v >= 1.0 && v <= u64::MAX as f64).then_some(v as u64)
}

/// Each rank's capacity from vLLM's `num_gpu_blocks` per engine label: one figure
/// under several labels is their engines' total (see the module docs).
fn vllm_per_rank(stated: BTreeMap<DpRank, u64>) -> BTreeMap<DpRank, u64> {
    let engines = stated.len() as u64;
    let mut figures = stated.values();
    let total = figures.next().copied();
    match total {
        Some(total) if engines > 1 && figures.all(|f| *f == total) => {
            let per_rank = (total / engines).max(1);
            stated.into_keys().map(|rank| (rank, per_rank)).collect()
        }
        _ => stated,
    }
}

/// Reads the KV cache facts of a page (see the module docs for the sources).
pub fn parse_cache_facts(page: &str) -> CacheFacts {
    let mut facts = CacheFacts::default();
    let mut vllm_blocks: BTreeMap<DpRank, u64> = BTreeMap::new();
    let mut sglang_tokens: BTreeMap<DpRank, u64> = BTreeMap::new();
    let mut sglang_pages: BTreeMap<DpRank, u64> = BTreeMap::new();
    let label_count = |s: &Sample<'_>, name: &str| {
        s.label(name)
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|v| *v > 0)
    };
    for s in samples(page) {
        match s.name {
            "vllm:cache_config_info" => {
                if let Some(bs) = label_count(&s, "block_size").and_then(|b| u32::try_from(b).ok())
                {
                    facts.block_sizes.insert(bs);
                }
                if let Some(blocks) = label_count(&s, "num_gpu_blocks") {
                    vllm_blocks.insert(rank(&s), blocks);
                }
            }
            "sglang:page_size" => {
                if let Some(bs) = count(s.value).and_then(|b| u32::try_from(b).ok()) {
                    facts.block_sizes.insert(bs);
                }
            }
            "sglang:num_pages" => {
                if let Some(pages) = count(s.value) {
                    sglang_pages.insert(rank(&s), pages);
                }
            }
            "sglang:max_total_num_tokens" => {
                if let Some(tokens) = count(s.value) {
                    sglang_tokens.insert(rank(&s), tokens);
                }
            }
            _ => {}
        }
    }
    facts.kv_blocks = vllm_per_rank(vllm_blocks);
    let page_size = (facts.block_sizes.len() == 1)
        .then(|| facts.block_sizes.first().copied())
        .flatten();
    for (rank, tokens) in sglang_tokens {
        if let Some(bs) = page_size {
            let pages = tokens / u64::from(bs);
            if pages > 0 {
                facts.kv_blocks.entry(rank).or_insert(pages);
            }
        }
    }
    // The pool's own page count wins over the token-derived one.
    facts.kv_blocks.extend(sglang_pages);
    facts
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
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="2048",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="2040",note="a,b}c \"q\""} 1.0
garbage line
"#;

    #[test]
    fn vllm_pages_parse_per_engine_rank() {
        let loads = parse_metrics(VLLM);
        assert_eq!(
            loads[&DpRank(0)],
            ScrapedRankLoad {
                running: 3.0,
                waiting: 2.0,
                usage: 0.25
            }
        );
        assert_eq!(loads[&DpRank(1)].running, 1.0);
    }

    #[test]
    fn vllm_cache_config_info_gives_block_size_and_capacity_per_rank() {
        let facts = parse_cache_facts(VLLM);
        assert_eq!(facts.block_sizes, BTreeSet::from([16]));
        assert_eq!(
            facts.kv_blocks,
            BTreeMap::from([(DpRank(0), 2048), (DpRank(1), 2040)])
        );
        // vLLM writes "None" before the KV cache is profiled: not a fact.
        let early = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1.0";
        let facts = parse_cache_facts(early);
        assert_eq!(facts.block_sizes, BTreeSet::from([16]));
        assert!(facts.kv_blocks.is_empty());
    }

    /// Issue 25: the page of a real vLLM CPU server started with
    /// `--data-parallel-size 2` (256 blocks per engine core) states the cores' total,
    /// 512, under both engine labels.
    #[test]
    fn vllm_dp_pages_state_the_total_under_every_engine_label() {
        let dp = "vllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\",engine=\"0\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"512\",num_gpu_blocks_override=\"None\"} 1.0\n\
                  vllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\",engine=\"1\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"512\",num_gpu_blocks_override=\"None\"} 1.0\n\
                  vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n";
        let facts = parse_cache_facts(dp);
        assert_eq!(facts.block_sizes, BTreeSet::from([32]));
        assert_eq!(
            facts.kv_blocks,
            BTreeMap::from([(DpRank(0), 256), (DpRank(1), 256)])
        );
        // One engine: its own figure.
        let one =
            "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"512\"} 1\n";
        assert_eq!(
            parse_cache_facts(one).kv_blocks,
            BTreeMap::from([(DpRank(0), 512)])
        );
    }

    #[test]
    fn sglang_page_size_and_pool_give_the_facts() {
        let page = "sglang:page_size{dp_rank=\"0\"} 32\nsglang:page_size{dp_rank=\"1\"} 32\n\
                    sglang:max_total_num_tokens{dp_rank=\"0\"} 471258\n\
                    sglang:max_total_num_tokens{dp_rank=\"1\"} 64000\nsglang:num_pages{dp_rank=\"1\"} 1999\n";
        let facts = parse_cache_facts(page);
        assert_eq!(facts.block_sizes, BTreeSet::from([32]));
        assert_eq!(
            facts.kv_blocks,
            BTreeMap::from([(DpRank(0), 471_258 / 32), (DpRank(1), 1999)])
        );
        let conflict =
            parse_cache_facts("sglang:page_size 16\nvllm:cache_config_info{block_size=\"32\"} 1\n");
        assert_eq!(conflict.block_sizes, BTreeSet::from([16, 32]));
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

    #[test]
    fn the_rank_is_the_engine_or_dp_rank_label() {
        let page = "m{a=\"x,}y\",engine=\"3\"} 2\nm{dp_rank=\"2\"} 1\nm 0\n";
        let ranks: Vec<DpRank> = samples(page).map(|s| rank(&s)).collect();
        assert_eq!(ranks, [DpRank(3), DpRank(2), DpRank(0)]);
    }
}
