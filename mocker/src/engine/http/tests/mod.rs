//! HTTP front-end tests over real sockets: engines with real nats-server and etcd,
//! listeners on ephemeral ports, requests with reqwest.

use super::DP_RANK_HEADER;
use crate::engine::{
    ConnectionArgs, EngineArgs, EngineHttpArgs, EnginesHandle, FleetArgs, RuntimeArgs,
    spawn_engines,
};
use engine_model::EngineModelConfig;
use futures::StreamExt;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use testbed::{EtcdServer, NatsServer};
use tokio_util::sync::CancellationToken;

struct Engines {
    // Field order: engines stop before the servers they talk to.
    handle: EnginesHandle,
    url: String,
    http: reqwest::Client,
    _nats: NatsServer,
    _etcd: EtcdServer,
}

impl Drop for Engines {
    fn drop(&mut self) {
        self.handle.shutdown();
    }
}

fn tokenizer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kv-tokenizer/tests/data")
}

/// The tokenizer fixture's expected renders and ids.
fn golden() -> Value {
    let text = std::fs::read_to_string(tokenizer_dir().join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// One worker with 2 dp ranks of 64 blocks of 16 tokens (max model len 1,024).
async fn start(time_scale: f64, model_dir: Option<PathBuf>) -> Engines {
    let http = EngineHttpArgs {
        model_dir,
        ..EngineHttpArgs::default()
    };
    start_with(time_scale, http).await
}

/// [`start`] with the given HTTP flags.
async fn start_with(time_scale: f64, http: EngineHttpArgs) -> Engines {
    let nats = NatsServer::start().await.expect("nats-server starts");
    let etcd = EtcdServer::start().await.expect("etcd starts");
    let args = engine_args((&nats, &etcd), 1, time_scale, http);
    let handle = spawn_engines(args, CancellationToken::new())
        .await
        .expect("engines start");
    let url = handle.http_urls()[0].clone();
    Engines {
        handle,
        url,
        http: kv_cluster::http::client().expect("http client"),
        _nats: nats,
        _etcd: etcd,
    }
}

/// The flags of [`start_with`]'s engines: worker `worker_id` of 2 dp ranks of 64
/// blocks of 16 tokens, aggregated.
fn engine_args(
    (nats, etcd): (&NatsServer, &EtcdServer),
    worker_id: u64,
    time_scale: f64,
    http: EngineHttpArgs,
) -> EngineArgs {
    EngineArgs {
        connection: ConnectionArgs::local(
            &nats.url(),
            &etcd.endpoint(),
            &kv_events::Namespace::new("httptest").expect("valid"),
        ),
        fleet: FleetArgs {
            workers: 1,
            first_worker_id: worker_id,
            dp_size: 2,
        },
        model: EngineModelConfig {
            block_size: 16,
            num_gpu_blocks: 64,
            max_num_seqs: 8,
            max_num_batched_tokens: 256,
        },
        runtime: RuntimeArgs {
            time_scale,
            lease_ttl_secs: 5,
            metrics_interval_ms: 50,
            shutdown: Default::default(),
        },
        http,
        cpu_tier: Default::default(),
        hybrid: Default::default(),
        kv_events: Default::default(),
        disaggregation: Default::default(),
    }
}

impl Engines {
    async fn post(&self, path: &str, body: Value, rank: Option<&str>) -> (u16, Value) {
        let mut req = self.http.post(format!("{}{path}", self.url)).json(&body);
        if let Some(rank) = rank {
            req = req.header(DP_RANK_HEADER, rank);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status().as_u16();
        (status, resp.json().await.expect("json body"))
    }

    /// The status of a POST to `path` of a body one byte over [`super::MAX_BODY_BYTES`].
    async fn post_too_large(&self, path: &str) -> u16 {
        let huge = vec![b'1'; super::MAX_BODY_BYTES + 1];
        let resp = self
            .http
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(huge)
            .send()
            .await
            .expect("request");
        resp.status().as_u16()
    }

    /// The body stream of a streamed `/v1/completions` request.
    async fn stream(
        &self,
        body: &Value,
    ) -> impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + use<> {
        let resp = self
            .http
            .post(format!("{}/v1/completions", self.url))
            .json(body)
            .send()
            .await
            .expect("request");
        resp.bytes_stream()
    }

    async fn metrics(&self) -> String {
        let resp = self.http.get(format!("{}/metrics", self.url)).send().await;
        resp.expect("metrics").text().await.expect("text")
    }
}

/// The value of the sample `name{…labels…}` whose labels include `label`.
fn sample(metrics: &str, name: &str, label: &str) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

fn prompt(n: u32) -> Vec<u32> {
    (1000..1000 + n).collect()
}

#[tokio::test]
async fn token_id_completion_non_streamed_reuses_the_cache() {
    let e = start(20.0, None).await;
    let body = json!({"model": "kv-mocker", "prompt": prompt(40), "max_tokens": 5});
    let (status, first) = e.post("/v1/completions", body.clone(), None).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["choices"][0]["text"], " tok0 tok1 tok2 tok3 tok4");
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert_eq!(first["usage"]["prompt_tokens"], 40);
    assert_eq!(first["usage"]["completion_tokens"], 5);
    assert_eq!(first["usage"]["total_tokens"], 45);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // The engine model cached the two full blocks of the prompt.
    let (_, second) = e.post("/v1/completions", body, None).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        32
    );
}

#[tokio::test]
async fn streamed_completion_arrives_chunk_by_chunk_with_usage_and_done() {
    let e = start(1.0, None).await;
    let body = json!({"prompt": prompt(20), "max_tokens": 12, "stream": true,
                      "stream_options": {"include_usage": true}});
    let resp = e
        .http
        .post(format!("{}/v1/completions", e.url))
        .json(&body)
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut reads = Vec::new();
    let mut text = String::new();
    let mut stream = resp.bytes_stream();
    while let Some(bytes) = stream.next().await {
        reads.push(Instant::now());
        text.push_str(std::str::from_utf8(&bytes.expect("bytes")).expect("utf-8"));
    }
    // Decode steps take ~10 ms each at time scale 1: the chunks came in separate
    // reads spread over time, not as one buffered answer.
    assert!(reads.len() >= 6, "{} reads", reads.len());
    assert!(reads[reads.len() - 1] - reads[0] >= Duration::from_millis(40));
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("sse data line"))
        .collect();
    assert_eq!(events.len(), 12 + 2, "{events:?}");
    assert_eq!(events[events.len() - 1], "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect();
    for (i, c) in chunks[..12].iter().enumerate() {
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["choices"][0]["text"], format!(" tok{i}"));
        let finish = if i == 11 {
            json!("length")
        } else {
            Value::Null
        };
        assert_eq!(c["choices"][0]["finish_reason"], finish);
    }
    let usage = &chunks[12];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 12);
    assert_eq!(usage["usage"]["prompt_tokens"], 20);
}

#[tokio::test]
async fn dp_rank_comes_from_the_header_or_the_body() {
    let e = start(20.0, None).await;
    let body = json!({"prompt": prompt(33), "max_tokens": 1});
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    let (status, r) = e.post("/v1/completions", body.clone(), Some("1")).await;
    assert_eq!(status, 200, "{r}");
    // Rank 0 has its own cache: no hit. Rank 1, by header or by body field: a hit.
    let (_, r) = e.post("/v1/completions", body.clone(), None).await;
    assert_eq!(cached(&r), 0);
    let (_, r) = e.post("/v1/completions", body.clone(), Some("1")).await;
    assert_eq!(cached(&r), 32);
    let with_field = json!({"prompt": prompt(33), "max_tokens": 1, "data_parallel_rank": 1});
    let (_, r) = e.post("/v1/completions", with_field, None).await;
    assert_eq!(cached(&r), 32);
    for bad in ["2", "-1", "one"] {
        let (status, r) = e.post("/v1/completions", body.clone(), Some(bad)).await;
        assert_eq!(status, 400, "{bad}: {r}");
        assert_eq!(r["error"]["code"], 400);
    }
}

#[tokio::test]
async fn malformed_and_unservable_requests_get_openai_errors() {
    let e = start(20.0, None).await;
    let resp = e
        .http
        .post(format!("{}/v1/completions", e.url))
        .header("content-type", "application/json")
        .body("{\"prompt\": [1, 2,")
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().await.expect("json");
    assert_eq!(err["error"]["type"], "BadRequestError");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("malformed request")
    );
    assert_eq!(err["error"]["param"], Value::Null);
    let cases = [
        (json!({"prompt": "hello"}), 400, "--model-dir"),
        (json!({"prompt": []}), 400, "prompt is empty"),
        (json!({"prompt": [1, -2]}), 400, "malformed request"),
        (json!({"prompt": [1], "max_tokens": 0}), 400, "max_tokens"),
        (
            json!({"prompt": prompt(1000), "max_tokens": 100}),
            400,
            "maximum context length is 1024",
        ),
        (
            json!({"prompt": [1], "model": "other"}),
            404,
            "does not exist",
        ),
    ];
    for (body, status, needle) in cases {
        let (got, r) = e.post("/v1/completions", body.clone(), None).await;
        assert_eq!(got, status, "{body}: {r}");
        let message = r["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{body}: {message}");
    }
    let (status, r) = e.post("/tokenize", json!({"prompt": "hi"}), None).await;
    assert_eq!(status, 400, "{r}");
    assert_eq!(e.post_too_large("/v1/completions").await, 413);
}

#[tokio::test]
async fn tokenize_models_metrics_and_text_prompts_with_a_model_dir() {
    let e = start(20.0, Some(tokenizer_dir())).await;
    let golden = golden();
    let (status, r) = e
        .post("/tokenize", json!({"prompt": golden["completion"]}), None)
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["tokens"], golden["completion_ids"]);
    assert_eq!(
        r["count"],
        golden["completion_ids"].as_array().unwrap().len()
    );
    assert_eq!(r["max_model_len"], 1024);
    let body = json!({"prompt": golden["completion"], "max_tokens": 3});
    let (status, r) = e.post("/v1/completions", body, None).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        r["usage"]["prompt_tokens"],
        golden["completion_ids"].as_array().unwrap().len()
    );
    assert!(!r["choices"][0]["text"].as_str().unwrap().contains("tok"));

    let models: Value = e
        .http
        .get(format!("{}/v1/models", e.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "kv-mocker");
    assert_eq!(models["data"][0]["max_model_len"], 1024);

    let m = e.metrics().await;
    for engine in ["engine=\"0\"", "engine=\"1\""] {
        assert_eq!(
            sample(&m, "vllm:num_requests_running", engine),
            Some(0.0),
            "{m}"
        );
        assert_eq!(
            sample(&m, "vllm:num_requests_waiting", engine),
            Some(0.0),
            "{m}"
        );
        assert_eq!(
            sample(&m, "vllm:kv_cache_usage_perc", engine),
            Some(0.0),
            "{m}"
        );
        let info = m
            .lines()
            .find(|l| l.starts_with("vllm:cache_config_info{") && l.contains(engine))
            .expect("cache_config_info");
        assert!(info.contains("block_size=\"16\""), "{info}");
        // vLLM's data-parallel page: both ranks' 64 blocks, under each engine label.
        assert!(info.contains("num_gpu_blocks=\"128\""), "{info}");
        assert!(info.ends_with(" 1"), "{info}");
    }
    assert!(m.contains("model_name=\"kv-mocker\""));
}

#[tokio::test]
async fn a_disconnect_mid_stream_aborts_the_request_and_frees_its_blocks() {
    let e = start(1.0, None).await;
    // ~900 decode steps of ~10 ms: ~9 s if it ran to the end.
    let body = json!({"prompt": prompt(64), "max_tokens": 900, "stream": true});
    let mut stream = e.stream(&body).await;
    let mut seen = String::new();
    while seen.matches("data: ").count() < 3 {
        let bytes = stream.next().await.expect("chunk").expect("bytes");
        seen.push_str(std::str::from_utf8(&bytes).expect("utf-8"));
    }
    let m = e.metrics().await;
    assert_eq!(
        sample(&m, "vllm:num_requests_running", "engine=\"0\""),
        Some(1.0)
    );
    // (64 + 900) / 16 = 61 of 64 blocks reserved.
    let usage = sample(&m, "vllm:kv_cache_usage_perc", "engine=\"0\"").unwrap();
    assert!(usage > 0.9, "{usage}");
    let disconnected = Instant::now();
    drop(stream);
    loop {
        let m = e.metrics().await;
        let running = sample(&m, "vllm:num_requests_running", "engine=\"0\"");
        let usage = sample(&m, "vllm:kv_cache_usage_perc", "engine=\"0\"");
        if running == Some(0.0) && usage == Some(0.0) {
            break;
        }
        assert!(
            disconnected.elapsed() < Duration::from_secs(3),
            "request still holds blocks after the client left: {m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The freed space is usable at once: a request needing most of the cache runs.
    let (status, r) = e
        .post(
            "/v1/completions",
            json!({"prompt": prompt(64), "max_tokens": 9}),
            None,
        )
        .await;
    assert_eq!(status, 200, "{r}");
    // The aborted request's 4 prompt blocks stay cached; the prompt is block-aligned,
    // so as in vLLM its last block is computed again: 3 blocks hit.
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 48);
}

/// A connection that never sends a request is closed after
/// `--http-header-read-timeout-ms`, and the engine goes on answering.
#[tokio::test]
async fn an_idle_connection_is_closed_after_the_header_read_timeout() {
    use tokio::io::AsyncReadExt;
    let http = EngineHttpArgs {
        http_header_read_timeout_ms: 200,
        ..EngineHttpArgs::default()
    };
    let engines = start_with(1.0, http).await;
    let addr = engines.url.trim_start_matches("http://").to_owned();
    let mut idle = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connects");
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(30), idle.read(&mut buf)).await;
    assert_eq!(read.expect("closed by the engine").unwrap_or(0), 0);
    let models = engines
        .http
        .get(format!("{}/v1/models", engines.url))
        .send();
    assert_eq!(models.await.expect("answered").status().as_u16(), 200);
}

/// `GET /health` answers 200 with an empty body, idle and with a request running (as
/// vLLM's does): SMG and vllm-router poll it on every worker.
#[tokio::test]
async fn health_answers_200_with_an_empty_body_idle_and_busy() {
    let e = start(1.0, None).await;
    let health = || async {
        let resp = e.http.get(format!("{}/health", e.url)).send().await;
        let resp = resp.expect("answered");
        let status = resp.status().as_u16();
        (status, resp.text().await.expect("body"))
    };
    assert_eq!(health().await, (200, String::new()));
    let long = json!({"prompt": prompt(16), "max_tokens": 30, "stream": true});
    let mut stream = e.stream(&long).await;
    stream.next().await.expect("chunk").expect("bytes");
    assert_eq!(health().await, (200, String::new()), "while a request runs");
}

/// vLLM's counters: prefix-cache queries and hits in tokens, and finished requests,
/// for JSON and streamed answers alike.
#[tokio::test]
async fn metrics_count_prefix_cache_queries_hits_and_finished_requests() {
    let e = start(20.0, None).await;
    let body = json!({"prompt": prompt(40), "max_tokens": 2});
    for _ in 0..2 {
        let (status, r) = e.post("/v1/completions", body.clone(), None).await;
        assert_eq!(status, 200, "{r}");
    }
    let streamed = json!({"prompt": prompt(40), "max_tokens": 2, "stream": true});
    let chunks: Vec<_> = e.stream(&streamed).await.collect().await;
    assert!(chunks.iter().all(Result::is_ok));
    let m = e.metrics().await;
    let rank0 = "engine=\"0\"";
    // 3 × 40 prompt tokens; the second and third reuse 2 full blocks of 16 each.
    assert_eq!(
        sample(&m, "vllm:prefix_cache_queries_total", rank0),
        Some(120.0)
    );
    assert_eq!(
        sample(&m, "vllm:prefix_cache_hits_total", rank0),
        Some(64.0)
    );
    assert_eq!(sample(&m, "vllm:request_success_total", rank0), Some(3.0));
    assert_eq!(
        sample(&m, "vllm:request_success_total", "engine=\"1\""),
        Some(0.0)
    );
}

mod bootstrap;
mod render;
mod reset;
mod transfer;
