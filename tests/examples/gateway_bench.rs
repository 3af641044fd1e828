//! The gateway's added latency against calling the mock engine directly, for
//! `docs/benchmarks.md`.
//!
//! ```sh
//! cargo run --release -p integration-tests --example gateway_bench -- [OPTIONS]
//! ```
//!
//! It starts nats-server and etcd on free loopback ports and, in this process, the
//! router daemon, `--workers` mock engines speaking OpenAI HTTP at `--time-scale`, and
//! the gateway. For each rate of `--rates`, requests arrive open-loop (at fixed times,
//! whether or not earlier ones finished) for `--seconds`, alternating **direct** (a
//! `POST /v1/completions` to an engine, round-robin) and **gateway** (the same request
//! to the gateway, which routes it over NATS and relays the engine's stream): each mode
//! gets the rate, so the offered load is twice it. Every request is a streamed
//! completion of `--prompt-tokens` fresh random token ids (no prefix-cache hits, no
//! tokenization) and `--max-tokens` output tokens. Client-side, per request: TTFT
//! (request sent → first SSE `data:` event) and total time (→ end of stream).
//!
//! Then, per rate, a direct-only and a gateway-only phase of the same length measure
//! CPU time (utime + stime from `/proc/PID/stat`) of this process plus its child
//! processes (nats-server, etcd); the difference divided by the chunks the gateway
//! relayed is the gateway's CPU per streamed chunk (its routing round trip — gateway,
//! NATS and daemon — is included, spread over the chunks).
//!
//! Last, tokenization cost: the repo's test tokenizer encodes a long text repeatedly;
//! and the cache-parity monitor's work per answer, judged a million times.

use bench_workload::{latencies, quantile_ms};
use clap::Parser;
use engine_model::EngineModelConfig;
use futures::StreamExt;
use integration_tests::TestCluster;
use integration_tests::cpu::cpu_seconds;
use kv_gateway::{Gateway, GatewayArgs};
use kv_tokenizer::{ModelTokenizer, TokenizerLimits};
use mocker::engine::EngineHttpArgs;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const BLOCK: u32 = 16;
const MODEL: &str = "tiny";

/// Gateway added latency against direct engine calls, streamed completions.
#[derive(Parser, Debug, Clone)]
struct Args {
    /// Arrival rates per mode, requests/s.
    #[arg(long, value_delimiter = ',', default_values_t = [100u32, 1000])]
    rates: Vec<u32>,
    /// Duration of each measured phase, in seconds.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Prompt length, in tokens (token ids, so not tokenized).
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    /// Output tokens per request (one SSE chunk each).
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
    /// Mock engines.
    #[arg(long, default_value_t = 2)]
    workers: u32,
    /// Mock engine speed-up over model time.
    #[arg(long, default_value_t = 1000.0)]
    time_scale: f64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Direct,
    Gateway,
}

/// One finished request.
struct Sample {
    mode: Mode,
    ttft: Duration,
    total: Duration,
    chunks: u64,
}

/// What a run needs to send requests.
struct Target {
    http: reqwest::Client,
    gateway: String,
    engines: Vec<String>,
    vocab: u32,
    prompt_tokens: usize,
    max_tokens: u32,
}

impl Target {
    /// Sends request `i` in `mode` and reads its stream to the end.
    async fn one(&self, mode: Mode, i: u64) -> anyhow::Result<Sample> {
        let url = match mode {
            Mode::Gateway => format!("{}/v1/completions", self.gateway),
            Mode::Direct => {
                let e = &self.engines[(i / 2) as usize % self.engines.len()];
                format!("{e}/v1/completions")
            }
        };
        let mut x = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let prompt: Vec<u32> = (0..self.prompt_tokens)
            .map(|_| (xorshift(&mut x) % u64::from(self.vocab)) as u32)
            .collect();
        let body = serde_json::json!({
            "model": MODEL, "prompt": prompt, "max_tokens": self.max_tokens,
            "stream": true,
        })
        .to_string();
        let start = Instant::now();
        let response = self
            .http
            .post(url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await?;
        anyhow::ensure!(response.status() == 200, "{mode:?}: {}", response.status());
        let mut stream = response.bytes_stream();
        let mut seen = Vec::new();
        let mut ttft = None;
        while let Some(chunk) = stream.next().await {
            seen.extend_from_slice(&chunk?);
            if ttft.is_none() && seen.windows(5).any(|w| w == b"data:") {
                ttft = Some(start.elapsed());
            }
        }
        let total = start.elapsed();
        let text = String::from_utf8_lossy(&seen);
        let chunks = text.matches("data: {").count() as u64;
        anyhow::ensure!(text.contains("data: [DONE]"), "{mode:?}: stream cut short");
        Ok(Sample {
            mode,
            ttft: ttft.unwrap_or(total),
            total,
            chunks,
        })
    }

    /// Sends `count` requests open-loop, one every `period`, mode chosen by `pick`.
    async fn open_loop(
        self: &Arc<Self>,
        count: u64,
        period: Duration,
        pick: impl Fn(u64) -> Mode,
        seed: u64,
    ) -> Vec<Sample> {
        let t0 = tokio::time::Instant::now();
        let mut tasks = Vec::with_capacity(count as usize);
        for i in 0..count {
            tokio::time::sleep_until(t0 + period.mul_f64(i as f64)).await;
            let target = Arc::clone(self);
            let mode = pick(i);
            tasks.push(tokio::spawn(
                async move { target.one(mode, seed + i).await },
            ));
        }
        let mut samples = Vec::with_capacity(tasks.len());
        let mut failed = 0;
        for task in tasks {
            match task.await {
                Ok(Ok(s)) => samples.push(s),
                Ok(Err(e)) => {
                    failed += 1;
                    if failed <= 3 {
                        eprintln!("request failed: {e:#}");
                    }
                }
                Err(e) => eprintln!("task failed: {e}"),
            }
        }
        if failed > 0 {
            eprintln!("{failed} of {count} requests failed");
        }
        samples
    }
}

/// The next value of a xorshift64 generator.
fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Prints one rate's comparison.
fn report(rate: u32, samples: &[Sample]) {
    let pick = |mode: Mode, f: fn(&Sample) -> Duration| -> Vec<Duration> {
        samples.iter().filter(|s| s.mode == mode).map(f).collect()
    };
    let q = |mode, f: fn(&Sample) -> Duration| {
        let v = pick(mode, f);
        let histogram = latencies(v.iter().copied());
        (
            v.len(),
            quantile_ms(&histogram, 0.50),
            quantile_ms(&histogram, 0.99),
        )
    };
    let (nd, d50, d99) = q(Mode::Direct, |s| s.ttft);
    let (ng, g50, g99) = q(Mode::Gateway, |s| s.ttft);
    let (_, dt50, dt99) = q(Mode::Direct, |s| s.total);
    let (_, gt50, gt99) = q(Mode::Gateway, |s| s.total);
    println!("{rate} req/s per mode ({nd} direct, {ng} gateway requests), ms:");
    println!("  direct   TTFT p50 {d50:7.3}  p99 {d99:7.3}   total p50 {dt50:7.3}  p99 {dt99:7.3}");
    println!("  gateway  TTFT p50 {g50:7.3}  p99 {g99:7.3}   total p50 {gt50:7.3}  p99 {gt99:7.3}");
    println!(
        "  added    TTFT p50 {:7.3}  p99 {:7.3}   total p50 {:7.3}  p99 {:7.3}",
        g50 - d50,
        g99 - d99,
        gt50 - dt50,
        gt99 - dt99
    );
}

/// Sum (s) and count of each `kv_gateway_stage_seconds` stage in `registry`.
fn stage_totals(registry: &prometheus::Registry) -> Vec<(String, f64, u64)> {
    let mut out = Vec::new();
    for family in registry.gather() {
        if family.name() != "kv_gateway_stage_seconds" {
            continue;
        }
        for m in family.get_metric() {
            let stage = m.get_label().iter().find(|l| l.name() == "stage");
            let h = m.get_histogram();
            out.push((
                stage.map_or_else(String::new, |l| l.value().to_owned()),
                h.get_sample_sum(),
                h.get_sample_count(),
            ));
        }
    }
    out
}

/// Prints the mean of each gateway stage between two [`stage_totals`] readings.
fn report_stages(before: &[(String, f64, u64)], after: &[(String, f64, u64)]) {
    let mut line = String::from("  gateway stages (mean ms, from its /metrics):");
    for (stage, sum, count) in after {
        let (s0, c0) = before
            .iter()
            .find(|(s, ..)| s == stage)
            .map_or((0.0, 0), |(_, s, c)| (*s, *c));
        if count > &c0 {
            let mean = (sum - s0) * 1e3 / (count - c0) as f64;
            line.push_str(&format!(" {stage} {mean:.3}"));
        }
    }
    println!("{line}");
}

/// µs per 1,000 tokens of encoding a long text with the repo's test tokenizer.
fn tokenization_cost(dir: &std::path::Path) -> anyhow::Result<(usize, f64)> {
    let tok = ModelTokenizer::from_dir(dir, TokenizerLimits::default())?;
    let words: Vec<&str> = "the router sends each request to a worker whose cache already \
        holds its prefix, balancing load across engines. Latency matters; throughput too. \
        kv-cache blocks of 16 tokens are hashed and indexed"
        .split_whitespace()
        .collect();
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let text: String = (0..3000)
        .map(|_| words[(xorshift(&mut x) % words.len() as u64) as usize])
        .collect::<Vec<_>>()
        .join(" ");
    let tokens = tok.encode_completion(&text)?.len();
    for _ in 0..20 {
        tok.encode_completion(&text)?;
    }
    let rounds = 200;
    let start = Instant::now();
    for _ in 0..rounds {
        std::hint::black_box(tok.encode_completion(std::hint::black_box(&text))?);
    }
    let per_round = start.elapsed().as_secs_f64() / f64::from(rounds);
    Ok((tokens, per_round * 1e6 / tokens as f64 * 1000.0))
}

/// The parity monitor's work per engine answer, ns: the prediction looked up and the
/// answer judged (counter, histogram, window), cycling through informative answers
/// that agree and disagree on 8 workers, one thread.
fn parity_cost() -> anyhow::Result<f64> {
    use kv_events::WorkerId;
    use kv_gateway::parity::{ParityMonitor, Reported};
    let registry = prometheus::Registry::new();
    let registrar = kv_cluster::metrics::Registrar::new(&registry);
    let metrics = kv_gateway::metrics::GatewayMetrics::new(&registrar)?;
    let workers = kv_gateway::workers::WorkerUrls::default();
    for id in 0..8 {
        workers.insert(&kv_events::discovery::WorkerRegistration {
            worker_id: WorkerId(id),
            dp_size: 1,
            block_size: BLOCK,
            total_kv_blocks: 1024,
            url: None,
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        });
    }
    let monitor = ParityMonitor::new(metrics, workers);
    let rounds: u32 = 1_000_000;
    let start = Instant::now();
    for i in 0..rounds {
        let pending = monitor.pending(WorkerId(u64::from(i % 8)), 10, 0, 256);
        let cached = if i % 3 == 0 { 128 } else { 160 };
        let reported = Reported {
            cached_tokens: Some(cached),
            prompt_tokens: Some(256),
        };
        if let Some(pending) = std::hint::black_box(pending) {
            pending.judge(reported);
        }
    }
    Ok(start.elapsed().as_secs_f64() * 1e9 / f64::from(rounds))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kv-tokenizer/tests/data");
    let cluster = TestCluster::start(BLOCK).await?;
    let model = EngineModelConfig {
        block_size: BLOCK,
        num_gpu_blocks: 4096,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
    };
    let http = EngineHttpArgs {
        model_dir: Some(dir.clone()),
        served_model_name: MODEL.into(),
        ..EngineHttpArgs::default()
    };
    let engines = cluster
        .spawn_engines(args.workers, model, args.time_scale, http)
        .await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    let dir_flag = dir.display().to_string();
    let gateway_args: GatewayArgs = cluster.flags(&[
        "--listen",
        "127.0.0.1:0",
        "--served-model-name",
        MODEL,
        "--model-dir",
        &dir_flag,
    ]);
    let registry = Arc::new(prometheus::Registry::new());
    let gateway = Gateway::start(
        gateway_args.to_config()?,
        Arc::clone(&registry),
        CancellationToken::new(),
    )
    .await?;
    let vocab =
        u32::try_from(ModelTokenizer::from_dir(&dir, TokenizerLimits::default())?.vocab_size())?;
    let target = Arc::new(Target {
        http: kv_cluster::http::client().expect("http client"),
        gateway: format!("http://{}", gateway.local_addr()),
        engines: engines.http_urls().to_vec(),
        vocab,
        prompt_tokens: args.prompt_tokens,
        max_tokens: args.max_tokens,
    });
    integration_tests::eventually("gateway ready", Duration::from_secs(15), || async {
        let r = (target.http.get(format!("{}/health/readyz", target.gateway)))
            .send()
            .await
            .ok()?;
        (r.status() == 200).then_some(())
    })
    .await?;
    println!(
        "{} mock engines at time_scale {}, prompts of {} token ids, max_tokens {}, \
         {} s per phase; client, gateway, daemon and engines share this process",
        args.workers, args.time_scale, args.prompt_tokens, args.max_tokens, args.seconds
    );
    let alternate = |i: u64| {
        if i.is_multiple_of(2) {
            Mode::Direct
        } else {
            Mode::Gateway
        }
    };
    // Warm-up: connections, allocators, the daemon's index.
    target
        .open_loop(400, Duration::from_millis(2), alternate, 1 << 40)
        .await;

    let mut seed = 0;
    let mut cpu_rows = Vec::new();
    for &rate in &args.rates {
        let count = u64::from(rate) * args.seconds;
        let half = Duration::from_secs_f64(0.5 / f64::from(rate));
        let before = stage_totals(&registry);
        let samples = target.open_loop(2 * count, half, alternate, seed).await;
        seed += 2 * count;
        report(rate, &samples);
        report_stages(&before, &stage_totals(&registry));

        let period = Duration::from_secs_f64(1.0 / f64::from(rate));
        let mut phase = |mode: Mode| {
            let target = Arc::clone(&target);
            let s = seed;
            seed += count;
            async move {
                let cpu0 = cpu_seconds();
                let samples = target.open_loop(count, period, move |_| mode, s).await;
                let cpu = cpu_seconds() - cpu0;
                let chunks: u64 = samples.iter().map(|s| s.chunks).sum();
                (cpu, samples.len() as u64, chunks)
            }
        };
        let (direct_cpu, direct_n, _) = phase(Mode::Direct).await;
        let (gateway_cpu, gateway_n, gateway_chunks) = phase(Mode::Gateway).await;
        cpu_rows.push((
            rate,
            direct_cpu,
            direct_n,
            gateway_cpu,
            gateway_n,
            gateway_chunks,
        ));
    }

    println!(
        "\nGateway CPU per streamed chunk: CPU time (utime+stime, /proc/PID/stat, 10 ms \
         ticks) of this process and its children (nats-server, etcd) in a gateway-only \
         phase minus a direct-only phase of equal length and rate, divided by the chunks \
         the gateway relayed; it includes the routing round trip (gateway, NATS, daemon)."
    );
    for (rate, dc, dn, gc, gn, chunks) in cpu_rows {
        let extra = gc - dc;
        println!(
            "  {rate} req/s: direct {dc:.2} s CPU / {dn} req, gateway {gc:.2} s CPU / {gn} req, \
             {chunks} chunks → {:.1} µs per chunk, {:.1} µs per request",
            extra * 1e6 / chunks.max(1) as f64,
            extra * 1e6 / gn.max(1) as f64
        );
    }

    let (tokens, us) = tokenization_cost(&dir)?;
    println!(
        "\nTokenization (kv-tokenizer/tests/data, a tiny byte-level BPE; a {tokens}-token \
         text encoded 200 times, one thread): {us:.1} µs per 1,000 prompt tokens"
    );

    println!(
        "Cache parity monitor (kv_gateway::parity; lookup and judgement, one thread): {:.0} ns per answer",
        parity_cost()?
    );

    gateway.shutdown().await?;
    daemon.shutdown().await?;
    engines.shutdown();
    Ok(())
}
