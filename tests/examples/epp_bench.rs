//! The endpoint picker's added latency per request and its CPU, for
//! `docs/benchmarks.md`.
//!
//! ```sh
//! cargo build --release -p kv-router
//! cargo run --release -p integration-tests --example epp_bench -- [OPTIONS]
//! ```
//!
//! It starts nats-server and etcd on free loopback ports; in this process the router
//! daemon and `--workers` registered workers (pod addresses nobody listens on: the
//! picker never forwards); and the picker as its own process, the release
//! `kv-router epp` (`KV_ROUTER_BIN`, default `target/release/kv-router`). `--concurrency` clients, each with one
//! stream at a time over one shared HTTP/2 connection (as Envoy multiplexes its ext_proc
//! streams), play the proxy's part for `--seconds`: request headers, the body of a
//! completion of `--prompt-tokens` fresh random token ids (no tokenization, no cache
//! hits) in 2 chunks, then — once the pick arrives — response headers and one response
//! body chunk ending the stream (which frees the booking).
//!
//! **Added latency** is what a proxy waits before it can forward: from sending the
//! request headers to receiving the pick and the body handed back. **Picker CPU per
//! request** is the picker process's CPU time (utime + stime, `/proc/PID/stat`) over
//! the phase, divided by the requests; **the rest** is the same for this process and
//! its other children (daemon, the driving clients, nats-server, etcd).

use bench_workload::{latencies, quantile_ms};
use clap::Parser;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest};
use integration_tests::cpu::cpu_seconds;
use integration_tests::{FakeWorker, TestCluster, register_worker};
use kv_events::WorkerId;
use kv_events::discovery::WorkerRegistration;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tonic::transport::Channel;

const BLOCK: u32 = 16;
const MODEL: &str = "tiny";

/// Picker added latency and CPU per request.
#[derive(Parser, Debug, Clone)]
struct Args {
    /// Streams in flight at once.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 8])]
    concurrency: Vec<usize>,
    /// Duration of each measured phase, in seconds.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Prompt length, in tokens (token ids, so not tokenized).
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    /// Registered workers.
    #[arg(long, default_value_t = 8)]
    workers: u64,
}

fn header(key: &str, value: &str) -> HeaderValue {
    HeaderValue {
        key: key.into(),
        raw_value: value.as_bytes().to_vec(),
        ..HeaderValue::default()
    }
}

fn message(request: Message) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..ProcessingRequest::default()
    }
}

fn headers(list: Vec<HeaderValue>, end_of_stream: bool) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap { headers: list }),
        end_of_stream,
        ..HttpHeaders::default()
    }
}

fn chunk(body: &[u8], end_of_stream: bool) -> HttpBody {
    HttpBody {
        body: body.to_vec(),
        end_of_stream,
        ..HttpBody::default()
    }
}

/// One request through the picker: its added latency.
async fn one(
    mut client: ExternalProcessorClient<Channel>,
    body: Vec<u8>,
) -> anyhow::Result<Duration> {
    let (tx, mut rx) = mpsc::channel(8);
    let started = Instant::now();
    let request = vec![
        header(":method", "POST"),
        header(":path", "/v1/completions"),
        header("content-type", "application/json"),
    ];
    tx.send(message(Message::RequestHeaders(headers(request, false))))
        .await?;
    let half = body.len() / 2;
    tx.send(message(Message::RequestBody(chunk(&body[..half], false))))
        .await?;
    tx.send(message(Message::RequestBody(chunk(&body[half..], true))))
        .await?;
    let outbound = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let mut inbound = client.process(outbound).await?.into_inner();
    let mut answers = 0;
    while answers < 2 {
        let answer = inbound.message().await?.and_then(|m| m.response);
        match answer {
            Some(Answer::RequestHeaders(_) | Answer::RequestBody(_)) => answers += 1,
            other => anyhow::bail!("not picked: {other:?}"),
        }
    }
    let added = started.elapsed();
    // The response path, in the background of the measurement: frees the booking.
    tokio::spawn(async move {
        let response = vec![header(":status", "200")];
        let _ = tx
            .send(message(Message::ResponseHeaders(headers(response, false))))
            .await;
        let _ = tx
            .send(message(Message::ResponseBody(chunk(
                b"data: [DONE]\n\n",
                true,
            ))))
            .await;
        while let Ok(Some(_)) = inbound.message().await {}
    });
    Ok(added)
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// A fresh completion body of `tokens` random token ids.
fn body(seed: &mut u64, tokens: usize) -> Vec<u8> {
    let prompt: Vec<u32> = (0..tokens)
        .map(|_| (xorshift(seed) % 1000) as u32)
        .collect();
    serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": true})
        .to_string()
        .into_bytes()
}

/// `concurrency` clients sending requests back to back for `seconds`.
async fn phase(
    client: &ExternalProcessorClient<Channel>,
    concurrency: usize,
    seconds: u64,
    prompt_tokens: usize,
) -> Vec<Duration> {
    let until = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for c in 0..concurrency {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut seed = 0x9e37_79b9_7f4a_7c15 ^ (c as u64 + 1);
            let mut samples = Vec::new();
            while Instant::now() < until {
                match one(client.clone(), body(&mut seed, prompt_tokens)).await {
                    Ok(added) => samples.push(added),
                    Err(e) => eprintln!("request failed: {e}"),
                }
            }
            samples
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap_or_default());
    }
    all
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../kv-tokenizer/tests/data")
        .display()
        .to_string();
    let mut cluster = TestCluster::start(BLOCK).await?;
    let daemon = cluster.start_daemon(|_| {}).await?;
    let mut workers = Vec::new();
    for n in 1..=args.workers {
        let registration = WorkerRegistration {
            worker_id: WorkerId(n),
            dp_size: 1,
            block_size: BLOCK,
            total_kv_blocks: 4096,
            url: Some(format!("http://127.0.1.{n}:8000")),
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        };
        let lease =
            register_worker(&mut cluster.etcd, &cluster.subjects, &registration, 30).await?;
        workers.push(FakeWorker::publisher(WorkerId(n), lease));
    }
    let epp = cluster.spawn_epp(MODEL, &dir, &[]).await?;
    let client = ExternalProcessorClient::connect(format!("http://{}", epp.grpc_addr())).await?;
    // Picked once the picker knows a worker (503 until then).
    let mut seed = 1;
    integration_tests::eventually("the picker to pick", Duration::from_secs(15), || {
        let request = one(client.clone(), body(&mut seed, 8));
        async move { request.await.ok() }
    })
    .await?;
    println!(
        "{} workers, prompts of {} token ids, 2 body chunks, {} s per phase; \
         the picker is its own process, clients and daemon share this one",
        args.workers, args.prompt_tokens, args.seconds
    );
    // Warm-up: connections, allocators, the daemon's index.
    phase(&client, 4, 2, args.prompt_tokens).await;
    println!(
        "| streams in flight | requests/s | added p50 / p99 (ms) | picker CPU per request (µs) | the rest (µs) |"
    );
    println!("|---:|---:|---|---:|---:|");
    for &concurrency in &args.concurrency {
        let (all0, picker0) = (cpu_seconds(), epp.cpu_seconds()?);
        let started = Instant::now();
        let samples = phase(&client, concurrency, args.seconds, args.prompt_tokens).await;
        let wall = started.elapsed().as_secs_f64();
        let picker = epp.cpu_seconds()? - picker0;
        let rest = cpu_seconds() - all0 - picker;
        let n = samples.len().max(1) as f64;
        let h = latencies(samples.iter().copied());
        println!(
            "| {concurrency} | {:.0} | {:.3} / {:.3} | {:.0} | {:.0} |",
            n / wall,
            quantile_ms(&h, 0.5),
            quantile_ms(&h, 0.99),
            picker * 1e6 / n,
            rest * 1e6 / n
        );
    }
    drop(workers);
    drop(epp);
    daemon.shutdown().await?;
    Ok(())
}
