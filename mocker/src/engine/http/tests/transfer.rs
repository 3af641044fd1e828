//! vLLM's disaggregation protocol on the mock engines: a prefill engine answers with
//! `kv_transfer_params`, a decode engine loads the prompt with them (storing and
//! publishing the blocks it pulled, counting them as vLLM does), and bad parameters
//! are a 400. Real nats-server and etcd; the engines' KV events are read from NATS.

use super::{engine_args, prompt, sample};
use crate::engine::{EngineDisaggregationArgs, EngineHttpArgs, EnginesHandle, spawn_engines};
use futures::StreamExt;
use kv_cluster::args::{DisaggregationArgs, RoleFlag, TransferFlag};
use kv_events::{ExternalBlockHash, KvCacheEventData, KvEventBatch, Subjects, WorkerId};
use serde_json::{Value, json};
use std::time::Duration;
use testbed::{EtcdServer, NatsServer};
use tokio_util::sync::CancellationToken;

/// A prefill engine (worker 1) and a decode engine (worker 2) of one protocol, each
/// 2 dp ranks of 64 blocks of 16 tokens, on their own nats-server and etcd.
pub(super) struct Pair {
    pub prefill: EnginesHandle,
    pub decode: EnginesHandle,
    pub http: reqwest::Client,
    pub nats: async_nats::Client,
    _servers: (NatsServer, EtcdServer),
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.prefill.shutdown();
        self.decode.shutdown();
    }
}

/// The role flags of a worker.
pub(super) fn role(
    role: RoleFlag,
    protocol: TransferFlag,
    bootstrap_port: Option<u16>,
) -> EngineDisaggregationArgs {
    EngineDisaggregationArgs {
        placement: DisaggregationArgs {
            role,
            kv_transfer: Some(protocol),
            bootstrap_port,
        },
        ..EngineDisaggregationArgs::default()
    }
}

impl Pair {
    /// Starts the pair: `prefill` and `decode` are their role flags.
    pub async fn start(
        prefill: EngineDisaggregationArgs,
        decode: EngineDisaggregationArgs,
    ) -> Self {
        let nats = NatsServer::start().await.expect("nats-server starts");
        let etcd = EtcdServer::start().await.expect("etcd starts");
        let spawn = |worker, disaggregation| {
            let mut args = engine_args((&nats, &etcd), worker, 20.0, EngineHttpArgs::default());
            args.disaggregation = disaggregation;
            spawn_engines(args, CancellationToken::new())
        };
        let prefill = spawn(1, prefill).await.expect("prefill engine starts");
        let decode = spawn(2, decode).await.expect("decode engine starts");
        let client = async_nats::connect(nats.url()).await.expect("nats");
        Self {
            prefill,
            decode,
            http: kv_cluster::http::client().expect("http client"),
            nats: client,
            _servers: (nats, etcd),
        }
    }

    /// A POST of `body` to `path` on `engine`: the status and the JSON answer.
    pub async fn post(&self, engine: &EnginesHandle, path: &str, body: &Value) -> (u16, Value) {
        let url = format!("{}{path}", engine.http_urls()[0]);
        let resp = self
            .http
            .post(url)
            .json(body)
            .send()
            .await
            .expect("answered");
        let status = resp.status().as_u16();
        (status, resp.json().await.expect("json body"))
    }

    /// `engine`'s `/metrics` page.
    pub async fn metrics(&self, engine: &EnginesHandle) -> String {
        let url = format!("{}/metrics", engine.http_urls()[0]);
        let resp = self.http.get(url).send().await.expect("metrics");
        resp.text().await.expect("text")
    }

    /// The KV event batches worker `worker` publishes from now on.
    pub async fn kv_events(&self, worker: u64) -> async_nats::Subscriber {
        let subjects = Subjects::new(kv_events::Namespace::new("httptest").expect("valid"));
        let sub = self
            .nats
            .subscribe(subjects.kv_events(WorkerId(worker)))
            .await
            .expect("subscribed");
        kv_cluster::barrier::server_barrier(&self.nats)
            .await
            .expect("subscribed at the server");
        sub
    }
}

/// The blocks stored in the next batch of `sub` that stores any, within 30 s.
pub(super) async fn next_stored(sub: &mut async_nats::Subscriber) -> Vec<ExternalBlockHash> {
    let wait = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let msg = sub.next().await.expect("subscription open");
            let batch: KvEventBatch = kv_events::decode(&msg.payload).expect("a batch");
            let stored: Vec<_> = batch
                .events
                .iter()
                .flat_map(|e| match &e.data {
                    KvCacheEventData::Stored { blocks, .. } => {
                        blocks.iter().map(|b| b.block_hash).collect()
                    }
                    _ => Vec::new(),
                })
                .collect();
            if !stored.is_empty() {
                return stored;
            }
        }
    });
    wait.await.expect("blocks stored in time")
}

/// The chained block ids of `tokens` at 16 tokens per block.
pub(super) fn ids_of(tokens: &[u32]) -> Vec<u64> {
    super::super::transfer::block_ids(tokens, 16)
}

/// What a proxy sends a prefill worker: the request, one token, no stream.
fn prefill_body(tokens: &[u32]) -> Value {
    json!({"prompt": tokens, "max_tokens": 1, "stream": false, "kv_transfer_params": {
        "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
        "remote_block_ids": null, "remote_host": null, "remote_port": null}})
}

fn vllm_pair_roles() -> (EngineDisaggregationArgs, EngineDisaggregationArgs) {
    (
        role(RoleFlag::Prefill, TransferFlag::Vllm, None),
        role(RoleFlag::Decode, TransferFlag::Vllm, None),
    )
}

/// The prefill engine prefills (and publishes the prompt's blocks), answers one
/// token and the parameters a decode engine needs: its own address and engine id,
/// the prompt's block ids. A streamed prefill for a remote decode is refused.
#[tokio::test]
async fn a_prefill_answer_carries_well_formed_params() {
    let (prefill, decode) = vllm_pair_roles();
    let pair = Pair::start(prefill, decode).await;
    let mut stored = pair.kv_events(1).await;
    let tokens = prompt(40);
    let (status, answer) = pair
        .post(&pair.prefill, "/v1/completions", &prefill_body(&tokens))
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    let params = &answer["kv_transfer_params"];
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["tp_size"], 1);
    assert_eq!(params["remote_engine_id"], "kv-mocker-1_dp0");
    let url = &pair.prefill.http_urls()[0];
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(
        format!("http://127.0.0.1:{}", params["remote_port"]),
        *url,
        "its own address"
    );
    let ids: Vec<u64> = serde_json::from_value(params["remote_block_ids"].clone()).unwrap();
    assert_eq!(ids, ids_of(&tokens), "3 blocks: 2 full and a partial one");
    assert_eq!(
        next_stored(&mut stored).await.len(),
        2,
        "both full blocks published"
    );
    let m = pair.metrics(&pair.prefill).await;
    let rank0 = "engine=\"0\"";
    assert_eq!(
        sample(&m, "vllm:external_prefix_cache_queries_total", rank0),
        Some(40.0)
    );
    assert_eq!(
        sample(&m, "vllm:external_prefix_cache_hits_total", rank0),
        Some(0.0)
    );

    let mut streamed = prefill_body(&tokens);
    streamed["stream"] = json!(true);
    let (status, answer) = pair.post(&pair.prefill, "/v1/completions", &streamed).await;
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("stream")
    );
}

/// The decode engine given the prefill's parameters does not prefill: it stores and
/// publishes the pulled full blocks, counts the pulled tokens as external hits, and
/// decodes the client's request. A repeat pulls only what it lacks (the partial
/// block), as vLLM's decode instance did (640 tokens cached, 9 pulled).
#[tokio::test]
async fn a_decode_with_params_publishes_and_counts_the_transferred_blocks() {
    let (prefill, decode) = vllm_pair_roles();
    let pair = Pair::start(prefill, decode).await;
    let tokens = prompt(40);
    let (_, answer) = pair
        .post(&pair.prefill, "/v1/completions", &prefill_body(&tokens))
        .await;
    let params = answer["kv_transfer_params"].clone();
    let mut stored = pair.kv_events(2).await;
    let body = json!({"prompt": tokens, "max_tokens": 4, "kv_transfer_params": params});
    let (status, answer) = pair.post(&pair.decode, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 4);
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(
        answer.get("kv_transfer_params").is_none(),
        "the client's answer"
    );
    let full: Vec<_> = ids_of(&tokens)[..2]
        .iter()
        .map(|&h| ExternalBlockHash(h))
        .collect();
    assert_eq!(
        next_stored(&mut stored).await,
        full,
        "pulled blocks published"
    );
    let m = pair.metrics(&pair.decode).await;
    let rank0 = "engine=\"0\"";
    assert_eq!(
        sample(&m, "vllm:external_prefix_cache_hits_total", rank0),
        Some(40.0)
    );
    assert_eq!(sample(&m, "vllm:prefix_cache_hits_total", rank0), Some(0.0));

    let (status, again) = pair.post(&pair.decode, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    let m = pair.metrics(&pair.decode).await;
    assert_eq!(
        sample(&m, "vllm:external_prefix_cache_hits_total", rank0),
        Some(48.0)
    );
    assert_eq!(
        sample(&m, "vllm:external_prefix_cache_queries_total", rank0),
        Some(80.0)
    );
}

/// Malformed or misplaced parameters are a 400 naming the field, never a panic, and
/// the engine serves on; an aggregated engine ignores them as before.
#[tokio::test]
async fn bad_params_are_a_400_and_an_aggregated_engine_ignores_them() {
    let (prefill, decode) = vllm_pair_roles();
    let pair = Pair::start(prefill, decode).await;
    let tokens = prompt(40);
    let good = json!({"do_remote_prefill": true, "remote_engine_id": "e", "remote_host": "h",
        "remote_port": 5600, "remote_block_ids": ids_of(&tokens)});
    let with = |key: &str, value: Value| {
        let mut params = good.clone();
        params[key] = value;
        params
    };
    let other_prompt = ids_of(&prompt(41))[..3].to_vec();
    let cases = [
        (json!([1, 2]), "json object"),
        (with("do_remote_prefill", json!("yes")), "do_remote_prefill"),
        (with("remote_port", json!(70_000)), "remote_port"),
        (
            with("remote_block_ids", json!(vec![1; 4])),
            "remote_block_ids",
        ),
        (
            with("remote_block_ids", json!(vec![1; 100_000])),
            "remote_block_ids",
        ),
        (
            with("remote_block_ids", json!([1, -2, 3])),
            "remote_block_ids",
        ),
        (
            with("remote_block_ids", json!(other_prompt)),
            "another prompt",
        ),
        (
            with("remote_engine_id", json!("x".repeat(300))),
            "remote_engine_id",
        ),
        (with("remote_engine_id", Value::Null), "remote_engine_id"),
        (with("tp_size", json!(0)), "tp_size"),
        (with("do_remote_decode", json!(true)), "both"),
        (
            json!({"do_remote_decode": true}),
            "does not prefill for another",
        ),
    ];
    for (params, says) in cases {
        let body = json!({"prompt": tokens, "max_tokens": 2, "kv_transfer_params": params});
        let (status, answer) = pair.post(&pair.decode, "/v1/completions", &body).await;
        assert_eq!(status, 400, "{params}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{params}: {message}");
    }
    let sglang = json!({"prompt": tokens, "bootstrap_host": "h", "bootstrap_port": 1,
        "bootstrap_room": 7});
    let (status, answer) = pair.post(&pair.decode, "/v1/completions", &sglang).await;
    assert_eq!(status, 400, "the other protocol: {answer}");
    let remote = json!({"prompt": tokens, "kv_transfer_params": good});
    let (status, answer) = pair.post(&pair.prefill, "/v1/completions", &remote).await;
    assert_eq!(status, 400, "a prefill engine loads nothing: {answer}");
    // The decode engine still serves; without params it prefills itself.
    let local = json!({"prompt": tokens, "max_tokens": 2});
    let (status, answer) = pair.post(&pair.decode, "/v1/completions", &local).await;
    assert_eq!(status, 200, "{answer}");
    let m = pair.metrics(&pair.decode).await;
    assert_eq!(
        sample(&m, "vllm:external_prefix_cache_hits_total", "engine=\"0\""),
        Some(0.0)
    );

    let aggregated = super::start(20.0, None).await;
    for params in [json!("garbage"), with("remote_port", json!(-1)), good] {
        let body = json!({"prompt": tokens, "max_tokens": 2, "kv_transfer_params": params,
            "bootstrap_room": "x"});
        let (status, answer) = aggregated.post("/v1/completions", body, None).await;
        assert_eq!(status, 200, "{params}: {answer}");
    }
}
