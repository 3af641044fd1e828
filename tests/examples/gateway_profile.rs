//! Where the gateway's CPU and memory go for one text prompt, by stage and prompt
//! size, for `docs/benchmarks.md`.
//!
//! ```sh
//! cargo run --release -p integration-tests --example gateway_profile -- [OPTIONS]
//! ```
//!
//! The repo's test tokenizer has 400 tokens and understates a real model's cost, so
//! unless `--model-dir` names a model directory this first trains a realistic one:
//! `tests/python/bench_tokenizer.py` (Hugging Face `tokenizers`, pip-installed into a
//! venv under the system temp directory) builds a 32,000-token byte-level BPE shaped
//! like Llama 3's and Qwen 2's from Python's own documentation and standard library.
//! Prompts are English-like: the repo's `README.md` and `docs/*.md`, repeated to
//! length.
//!
//! 1. **Memory per prompt byte**: the resident-set peak (`VmHWM`, reset through
//!    `/proc/self/clear_refs`) of one encode on this thread, per byte of prompt; and
//!    what stays resident after the encode's memory is freed.
//! 2. **CPU per stage** at each `--tokens` size, on one thread with the machine
//!    otherwise idle (the stages are CPU-bound, so wall time is CPU time): the body
//!    parse (`parse_completion`), tokenization (`encode_completion`), block hashing
//!    (`compute_block_hashes`, block 16: what the router does with the ids, and what a
//!    gateway sending `Prompt::Blocks` would do), encoding the msgpack
//!    `RouteRequest` with `Prompt::Tokens`, and building and serializing the engine's
//!    JSON body with the token ids.
//! 3. **NATS**: the route round trip (gateway's NATS client → nats-server → the router
//!    daemon, in this process, with one registered worker → reply), wall time.
//!
//! 4. **The gateway process's memory**: the release `kv-router gateway`
//!    (`KV_ROUTER_BIN`, default `target/release/kv-router`) as a child process, sent
//!    `--concurrent` prompts of `--prompt-bytes` (its `--max-prompt-bytes`) at once:
//!    its resident set before, at the peak (`VmHWM`) and 2 s after the answers. (The
//!    SSE relay's cost per chunk is `gateway_bench`'s.)

use clap::Parser;
use engine_model::EngineModelConfig;
use futures::StreamExt;
use integration_tests::TestCluster;
use integration_tests::child_daemon::{DEFAULT_BIN, status_bytes};
use integration_tests::router_client::{ALONE, router_client};
use kv_events::routing::{Prompt, RouteRequest};
use kv_events::{DpRank, compute_block_hashes, encode};
use kv_gateway::config::EngineApi;
use kv_gateway::openai::{EngineTarget, completion_for_engine, parse_completion};
use kv_tokenizer::{ModelTokenizer, TokenizerLimits};
use mocker::engine::EngineHttpArgs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use testbed::{Echo, ManagedProcess, free_port};
use tokio_util::sync::CancellationToken;

const BLOCK: u32 = 16;
const MODEL: &str = "bench";

/// Per-stage CPU and memory of the gateway's request path.
#[derive(Parser, Debug)]
struct Args {
    /// A model directory (`tokenizer.json`); default: a trained bench tokenizer.
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// Prompt sizes for the stage profile, in tokens.
    #[arg(long, value_delimiter = ',', default_values_t = [1_000usize, 16_000, 128_000])]
    tokens: Vec<usize>,
    /// Prompt sizes for the memory measurement, in bytes.
    #[arg(long, value_delimiter = ',', default_values_t = [256usize << 10, 1 << 20, 4 << 20])]
    memory_bytes: Vec<usize>,
    /// Minimum time each stage is repeated for, in ms.
    #[arg(long, default_value_t = 1_000)]
    min_ms: u64,
    /// Prompts sent at once to the gateway process (step 4).
    #[arg(long, default_value_t = 8)]
    concurrent: usize,
    /// Bytes of each of those prompts: the gateway's `--max-prompt-bytes`.
    #[arg(long, default_value_t = 1 << 20)]
    prompt_bytes: usize,
    /// More flags for the gateway process (e.g. `--tokenizer-threads=1`).
    #[arg(long, allow_hyphen_values = true)]
    gateway_flag: Vec<String>,
}

/// The bench tokenizer's directory, trained once per machine (see the module docs).
async fn bench_model_dir() -> anyhow::Result<PathBuf> {
    let tmp = std::env::temp_dir();
    let out = tmp.join("kv-router-bench-tokenizer");
    if out.join("tokenizer.json").exists() {
        return Ok(out);
    }
    let tmp_str = tmp.display().to_string();
    let python = integration_tests::python::venv(
        &tmp_str,
        "kv-router-bench-venv",
        &["tokenizers==0.23.3"],
        "tokenizers",
    )
    .await;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/bench_tokenizer.py");
    integration_tests::python::run_json(&python, &script, &[&out.display().to_string()]).await;
    Ok(out)
}

/// English-like text of at least `bytes` bytes: the repo's documentation, repeated.
struct Corpus(String);

impl Corpus {
    fn load() -> anyhow::Result<Self> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files = vec![root.join("README.md")];
        let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))?
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "md"))
            .collect();
        docs.sort();
        files.extend(docs);
        let mut text = String::new();
        for f in files {
            text.push_str(&std::fs::read_to_string(f)?);
            text.push_str("\n\n");
        }
        Ok(Self(text))
    }

    fn text(&self, bytes: usize) -> String {
        let mut out = String::with_capacity(bytes + self.0.len());
        while out.len() < bytes {
            out.push_str(&self.0);
        }
        let mut cut = bytes;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out
    }
}

/// Resets the resident-set peak `VmHWM` to the current resident set.
fn reset_peak() -> anyhow::Result<()> {
    std::fs::write("/proc/self/clear_refs", "5")?;
    Ok(())
}

/// Mean time of one call of `f`, repeated for at least `min` (and 3 times).
fn mean_time<T>(min: Duration, mut f: impl FnMut() -> T) -> Duration {
    std::hint::black_box(f());
    let start = Instant::now();
    let mut n = 0u32;
    while n < 3 || start.elapsed() < min {
        std::hint::black_box(f());
        n += 1;
    }
    start.elapsed() / n
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

/// One encode's resident-set peak per prompt byte, each size on a fresh thread (so
/// in a fresh malloc arena, as a tokenizer thread's first long prompt is).
fn memory(tok: &ModelTokenizer, corpus: &Corpus, sizes: &[usize]) -> anyhow::Result<()> {
    println!(
        "\n| prompt bytes | tokens | encode peak above baseline | per prompt byte | resident after |"
    );
    println!("|---|---|---|---|---|");
    for &bytes in sizes {
        let text = corpus.text(bytes);
        let base = status_bytes("self", "VmRSS:")?;
        reset_peak()?;
        let tokens = std::thread::scope(|s| s.spawn(|| tok.encode_completion(&text)).join())
            .map_err(|_| anyhow::anyhow!("the encode panicked"))??
            .len();
        let peak = status_bytes("self", "VmHWM:")?.saturating_sub(base);
        let after = status_bytes("self", "VmRSS:")?.saturating_sub(base);
        println!(
            "| {bytes} | {tokens} | {:.1} MiB | {:.0} B | {:.1} MiB |",
            peak as f64 / f64::from(1 << 20),
            peak as f64 / bytes as f64,
            after as f64 / f64::from(1 << 20)
        );
    }
    Ok(())
}

/// The stage table: one row per prompt size.
fn stages(
    tok: &ModelTokenizer,
    corpus: &Corpus,
    sizes: &[usize],
    min: Duration,
) -> anyhow::Result<Vec<(usize, Vec<u32>)>> {
    let sample = corpus.text(1 << 20);
    let bytes_per_token = sample.len() as f64 / tok.encode_completion(&sample)?.len() as f64;
    println!("\nCPU per request by stage, ms (one thread; {bytes_per_token:.2} bytes per token):");
    println!(
        "| prompt tokens | bytes | body parse | tokenize | µs per 1k tokens | hash blocks | route msgpack (bytes) | engine JSON body (bytes) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut prompts = Vec::new();
    for &want in sizes {
        let text = corpus.text((want as f64 * bytes_per_token) as usize);
        let body = serde_json::json!({
            "model": MODEL, "prompt": text, "max_tokens": 16, "stream": true,
        })
        .to_string();
        let parse = mean_time(min, || parse_completion(body.as_bytes()));
        let request = parse_completion(body.as_bytes()).map_err(|e| anyhow::anyhow!("{e}"))?;
        let ids = tok.encode_completion(&text)?;
        let tokenize = mean_time(min, || tok.encode_completion(&text));
        let hash = mean_time(min, || compute_block_hashes(&ids, BLOCK));
        let route = |ids: &[u32]| {
            encode(&RouteRequest::new(
                "gw-0-1",
                Prompt::Tokens {
                    token_ids: ids.to_vec(),
                },
            ))
        };
        let route_bytes = route(&ids)?.len();
        let route_t = mean_time(min, || route(&ids));
        let target = EngineTarget::whole(EngineApi::Vllm, DpRank(0));
        let engine = || {
            let body = completion_for_engine(&request, Some(&ids), target);
            serde_json::to_vec(&body)
        };
        let engine_bytes = engine()?.len();
        let engine_t = mean_time(min, engine);
        println!(
            "| {} | {} | {} | {} | {:.0} | {} | {} ({route_bytes}) | {} ({engine_bytes}) |",
            ids.len(),
            text.len(),
            ms(parse),
            ms(tokenize),
            tokenize.as_secs_f64() * 1e6 / ids.len() as f64 * 1e3,
            ms(hash),
            ms(route_t),
            ms(engine_t),
        );
        prompts.push((ids.len(), ids));
    }
    Ok(prompts)
}

/// Route round trips through a real daemon for each prompt, wall time; then the
/// gateway process under `args.concurrent` maximum-size prompts.
async fn cluster_steps(
    prompts: Vec<(usize, Vec<u32>)>,
    args: &Args,
    dir: &Path,
    corpus: &Corpus,
) -> anyhow::Result<()> {
    let min = Duration::from_millis(args.min_ms);
    let cluster = TestCluster::start(BLOCK).await?;
    let model = EngineModelConfig {
        block_size: BLOCK,
        num_gpu_blocks: 1 << 16,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
    };
    let http = EngineHttpArgs {
        model_dir: Some(dir.to_owned()),
        served_model_name: MODEL.into(),
        ..EngineHttpArgs::default()
    };
    let engines = cluster.spawn_engines(2, model, 1000.0, http).await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    // One query at a time: each round trip is timed alone.
    let limit = kv_events::limits::MAX_LIFECYCLE_BATCH;
    let timeout = Duration::from_secs(10);
    let (client, _) = router_client(&cluster.nats, &cluster.subjects, timeout, ALONE, limit);
    let ready = || async {
        let token_ids = vec![1; 64];
        let prompt = Prompt::Tokens { token_ids };
        let id = client.request_id();
        let routed = client.route(id, prompt, &[], None, false).await;
        routed.is_ok().then_some(())
    };
    integration_tests::eventually("a worker to be routable", Duration::from_secs(15), ready)
        .await?;
    println!(
        "\nRoute round trip (gateway's NATS client → nats-server → daemon → reply), wall ms, \
         with the prompt as token ids and as block hashes (the gateway's way since 37e8df7), \
         each with its msgpack size in bytes:"
    );
    println!("| prompt tokens | token ids | block hashes |");
    println!("|---|---|---|");
    for (tokens, ids) in prompts {
        let as_ids = Prompt::Tokens {
            token_ids: ids.clone(),
        };
        let as_blocks = Prompt::Blocks {
            block_hashes: compute_block_hashes(&ids, BLOCK),
            num_tokens: ids.len() as u64,
        };
        let mut cells = Vec::new();
        for prompt in [as_ids, as_blocks] {
            let bytes = encode(&RouteRequest::new("sized", prompt.clone()))?.len();
            let start = Instant::now();
            let mut n = 0u32;
            while n < 3 || start.elapsed() < min {
                let routed = client
                    .route(client.request_id(), prompt.clone(), &[], None, false)
                    .await;
                drop(routed.map_err(|e| anyhow::anyhow!("{e}"))?);
                n += 1;
            }
            cells.push(format!("{} ({bytes})", ms(start.elapsed() / n)));
        }
        println!("| {tokens} | {} | {} |", cells[0], cells[1]);
    }
    gateway_process(&cluster, args, dir, corpus).await?;
    daemon.shutdown().await?;
    engines.shutdown();
    Ok(())
}

/// TTFT of a streamed 256-token-id completion through the gateway at `url`.
async fn probe(http: &reqwest::Client, url: &str, i: u32) -> anyhow::Result<Duration> {
    let prompt: Vec<u32> = (0..256).map(|t| (t * 31 + i * 7919) % 30_000).collect();
    let body = serde_json::json!({
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": true,
    });
    let start = Instant::now();
    let response = http.post(url).body(body.to_string()).send().await?;
    anyhow::ensure!(response.status() == 200, "probe: {}", response.status());
    let mut stream = response.bytes_stream();
    let mut ttft = None;
    while let Some(chunk) = stream.next().await {
        if ttft.is_none() && chunk?.windows(5).any(|w| w == b"data:") {
            ttft = Some(start.elapsed());
        }
    }
    ttft.ok_or_else(|| anyhow::anyhow!("probe: no event"))
}

/// TTFTs of sequential probes, one every 20 ms, for `length` or until `stop`:
/// "p50 / p99 / max ms (n, failed)".
async fn probes(
    http: &reqwest::Client,
    url: &str,
    length: Duration,
    stop: CancellationToken,
) -> String {
    let mut ttfts = Vec::new();
    let mut failed = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    let end = tokio::time::Instant::now() + length;
    for i in 1.. {
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep_until(end) => break,
            _ = tick.tick() => {}
        }
        // Sequential: a slow probe delays the next, as a client's own would.
        match probe(http, url, i).await {
            Ok(t) => ttfts.push(t),
            Err(_) => failed += 1,
        }
    }
    ttfts.sort_unstable();
    let q = |q: f64| {
        let i = ((ttfts.len() as f64 * q).ceil() as usize).clamp(1, ttfts.len().max(1)) - 1;
        ttfts.get(i).map_or_else(|| "-".into(), |d| ms(*d))
    };
    format!(
        "{} / {} / {} ms ({} probes, {failed} failed)",
        q(0.5),
        q(0.99),
        q(1.0),
        ttfts.len()
    )
}

/// Step 4: the release gateway as a child process under maximum-size prompts, with
/// a token-id request every 20 ms meanwhile.
async fn gateway_process(
    cluster: &TestCluster,
    args: &Args,
    dir: &Path,
    corpus: &Corpus,
) -> anyhow::Result<()> {
    let bin = std::env::var("KV_ROUTER_BIN").unwrap_or_else(|_| DEFAULT_BIN.into());
    let listen = format!("127.0.0.1:{}", free_port()?);
    let mut command = std::process::Command::new(&bin);
    command
        .arg("gateway")
        .args(&cluster.connection_flags()[1..])
        .args(["--listen", &listen, "--served-model-name", MODEL])
        .arg("--model-dir")
        .arg(dir)
        .args(["--max-prompt-bytes", &args.prompt_bytes.to_string()])
        .args(&args.gateway_flag);
    let mut gateway = ManagedProcess::spawn("kv-router gateway", command, Echo::Quiet)?;
    gateway
        .wait_for_line("kv-router gateway ready", Duration::from_secs(60))
        .await?;
    let pid = gateway
        .id()
        .ok_or_else(|| anyhow::anyhow!("no pid"))?
        .to_string();
    let http = kv_cluster::http::client().expect("http client");
    let url = format!("http://{listen}/v1/completions");
    let ready = || async { probe(&http, &url, 0).await.ok() };
    integration_tests::eventually("the gateway to serve", Duration::from_secs(15), ready).await?;
    let send = |text: String| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let body = serde_json::json!({"model": MODEL, "prompt": text}).to_string();
            let response = http.post(url).body(body).send().await?;
            anyhow::Ok(response.status().as_u16())
        }
    };
    send("warm up".into()).await?;
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let base = status_bytes(&pid, "VmRSS:")?;
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")?;
    // Different texts: a rotation of the corpus each.
    let texts = (0..args.concurrent).map(|i| {
        let text = corpus.text(args.prompt_bytes + 4096 * i);
        let mut cut = 4096 * i;
        while !text.is_char_boundary(cut) {
            cut += 1;
        }
        text[cut..].to_owned()
    });
    let quiet = probes(
        &http,
        &url,
        Duration::from_secs(2),
        CancellationToken::new(),
    )
    .await;
    let stop = CancellationToken::new();
    let during = tokio::spawn({
        let (http, url, stop) = (http.clone(), url.clone(), stop.clone());
        async move { probes(&http, &url, Duration::from_secs(600), stop).await }
    });
    let started = Instant::now();
    let burst = futures::future::join_all(texts.map(send));
    let statuses = tokio::time::timeout(Duration::from_secs(600), burst).await?;
    let took = started.elapsed();
    stop.cancel();
    let during = during.await?;
    let peak = status_bytes(&pid, "VmHWM:")?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = status_bytes(&pid, "VmRSS:")?;
    let statuses: Vec<String> = statuses
        .into_iter()
        .map(|s| s.map_or_else(|e| e.to_string(), |s| s.to_string()))
        .collect();
    println!(
        "\nGateway process ({bin} {}): {} prompts of {} bytes at once, answered {:?} in {:.1} s",
        args.gateway_flag.join(" "),
        args.concurrent,
        args.prompt_bytes,
        statuses,
        took.as_secs_f64()
    );
    println!(
        "| resident before | peak | 2 s after | probe TTFT p50 / p99 / max, quiet | during the burst |"
    );
    println!(
        "|---|---|---|---|---|\n| {:.0} MiB | {:.0} MiB | {:.0} MiB | {quiet} | {during} |",
        mib(base),
        mib(peak),
        mib(after)
    );
    gateway.stop(Duration::from_secs(10)).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = match args.model_dir.clone() {
        Some(dir) => dir,
        None => bench_model_dir().await?,
    };
    let limits = TokenizerLimits {
        max_prompt_bytes: usize::MAX,
        max_prompt_tokens: usize::MAX,
    };
    let tok = ModelTokenizer::from_dir(&dir, limits)?;
    let corpus = Corpus::load()?;
    println!(
        "tokenizer {} ({} tokens); prompts: the repo's docs, repeated",
        dir.display(),
        tok.vocab_size()
    );
    let min = Duration::from_millis(args.min_ms);
    // Memory first, on this thread, before anything else allocates.
    let (tok, prompts) = tokio::task::block_in_place(|| {
        memory(&tok, &corpus, &args.memory_bytes)?;
        let prompts = stages(&tok, &corpus, &args.tokens, min)?;
        anyhow::Ok((tok, prompts))
    })?;
    drop(tok);
    cluster_steps(prompts, &args, &dir, &corpus).await
}
