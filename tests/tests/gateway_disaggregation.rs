//! The gateway in front of a disaggregated fleet, end to end: real nats-server and
//! etcd, the router daemon (pair selection, conditional disaggregation, both
//! bookings), mock engines in the prefill and decode roles speaking vLLM's or SGLang's
//! protocol (the decode worker loads the prompt over the transfer and counts it as
//! `vllm:external_prefix_cache_hits_total`), and the official `openai` client. Each
//! message of the protocols is checked in `gateway_disaggregation_protocol.rs`.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

// The fixture is shared with gateway.rs, which uses all of it.
#[allow(dead_code)]
#[path = "gateway/fixture.rs"]
mod fixture;
#[path = "gateway/routed.rs"]
mod routed;

use engine_model::EngineModelConfig;
use fixture::{BLOCK, MODEL};
use futures::StreamExt;
use integration_tests::{FakeWorker, TestCluster, eventually, register_worker, wait_for_overlap};
use kv_cluster::args::{DisaggregationArgs, RoleFlag, TransferFlag};
use kv_events::disaggregation::{KvTransfer, TransferProtocol, WorkerRole};
use kv_events::discovery::WorkerRegistration;
use kv_events::{DpRank, WorkerId, WorkerRank, compute_block_hashes};
use kv_gateway::Gateway;
use kv_gateway::flow::PREFILL_WORKER_HEADER;
use mocker::engine::{EngineDisaggregationArgs, EngineHttpArgs, EnginesHandle};
use routed::Routed;
use router_daemon::Daemon;
use serde_json::{Value, json};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);
/// Prefill workers are 1.., decode workers 11...
const FIRST_DECODE: u64 = 11;

/// nats-server, etcd, the router, prefill and decode mock engines and the gateway.
struct Fleet {
    gateway: Option<Gateway>,
    engines: [EnginesHandle; 2],
    daemon: Option<Daemon>,
    cluster: TestCluster,
    base: String,
    http: reqwest::Client,
}

impl Fleet {
    /// `prefill` prefill workers and `decode` decode workers of `protocol`; the
    /// router prefills on the decode worker only prompts of at most 64 uncached
    /// tokens (or mostly cached there).
    async fn start(protocol: TransferFlag, prefill: u32, decode: u32, flags: &[&str]) -> Self {
        let cluster = TestCluster::start(BLOCK).await.unwrap();
        let bootstrap_port =
            (protocol == TransferFlag::Sglang).then(|| testbed::free_port().unwrap());
        let roles = [
            (1, prefill, RoleFlag::Prefill, bootstrap_port),
            (FIRST_DECODE, decode, RoleFlag::Decode, None),
        ];
        let mut engines = Vec::new();
        for (first, workers, role, bootstrap_port) in roles {
            let placement = DisaggregationArgs {
                role,
                kv_transfer: Some(protocol),
                bootstrap_port,
            };
            let model = EngineModelConfig {
                block_size: BLOCK,
                num_gpu_blocks: 1024,
                ..EngineModelConfig::default()
            };
            let http = EngineHttpArgs {
                model_dir: Some(fixture::model_dir()),
                served_model_name: MODEL.into(),
                ..EngineHttpArgs::default()
            };
            let mut args = cluster.engine_args(workers, model, 10.0, http);
            args.fleet.first_worker_id = first;
            args.disaggregation = EngineDisaggregationArgs {
                placement,
                ..EngineDisaggregationArgs::default()
            };
            let handle = mocker::engine::spawn_engines(args, Default::default());
            engines.push(handle.await.unwrap());
        }
        let daemon = cluster
            .start_daemon(|args| {
                let thresholds = &mut args.scheduling.scheduler.disaggregation;
                thresholds.disagg_max_local_prefill_tokens = 64;
            })
            .await
            .unwrap();
        let mut gateway_flags = vec!["--max-prompt-tokens", "8000"];
        gateway_flags.extend_from_slice(flags);
        let gateway = fixture::start_gateway(&cluster, &gateway_flags).await;
        let base = format!("http://{}", gateway.local_addr());
        let http = kv_cluster::http::client().unwrap();
        fixture::wait_ready(&http, &base).await;
        let total = (prefill + decode) as usize;
        eventually("the gateway to know every worker", WAIT, || async {
            (gateway.workers().len() == total).then_some(())
        })
        .await
        .unwrap();
        let [prefill, decode] = <[EnginesHandle; 2]>::try_from(engines).ok().unwrap();
        Self {
            gateway: Some(gateway),
            engines: [prefill, decode],
            daemon: Some(daemon),
            cluster,
            base,
            http,
        }
    }

    fn metrics(&self) -> &kv_gateway::metrics::GatewayMetrics {
        self.gateway.as_ref().unwrap().metrics()
    }

    fn daemon(&self) -> &Daemon {
        self.daemon.as_ref().unwrap()
    }

    /// A completion of `tokens` for `max_tokens` tokens.
    async fn complete(&self, tokens: &[u32], stream: bool, max_tokens: u32) -> Routed {
        routed::complete(&self.http, &self.base, tokens, stream, max_tokens).await
    }

    /// Prompt tokens the decode workers loaded over the transfer.
    async fn transferred_tokens(&self) -> f64 {
        let mut tokens = 0.0;
        for url in self.engines[1].http_urls() {
            let page = self
                .http
                .get(format!("{url}/metrics"))
                .send()
                .await
                .unwrap();
            let page = page.text().await.unwrap();
            tokens += kv_cluster::http::exposition::samples(&page)
                .filter(|s| s.name == "vllm:external_prefix_cache_hits_total")
                .map(|s| s.value)
                .sum::<f64>();
        }
        tokens
    }

    /// Waits until the router's index holds `tokens`' full blocks on `worker`.
    async fn indexed(&self, worker: &str, tokens: &[u32]) {
        let rank = WorkerRank::new(WorkerId(worker.parse().unwrap()), DpRank(0));
        let hashes = compute_block_hashes(tokens, BLOCK);
        let blocks = hashes.len() as u32;
        wait_for_overlap(self.daemon(), &hashes, rank, blocks)
            .await
            .unwrap();
    }

    /// Registers worker `worker` in `role` of vLLM's protocol at an address where no
    /// engine answers (a killed engine whose lease has not expired), holding
    /// `tokens`, and waits until the router and the gateway know it.
    async fn add_killed_engine(&mut self, worker: u64, role: WorkerRole, tokens: &[u32]) {
        let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", dead.local_addr().unwrap());
        drop(dead);
        let registration = WorkerRegistration {
            role,
            kv_transfer: Some(KvTransfer {
                protocol: TransferProtocol::Vllm,
                bootstrap_port: None,
            }),
            ..fixture::registration(WorkerId(worker), url)
        };
        let cluster = &mut self.cluster;
        let lease = register_worker(&mut cluster.etcd, &cluster.subjects, &registration, 30)
            .await
            .unwrap();
        FakeWorker::publisher(WorkerId(worker), lease)
            .store_prompt(&self.cluster, tokens)
            .await
            .unwrap();
        self.indexed(&worker.to_string(), tokens).await;
        let gateway = self.gateway.as_ref().unwrap();
        eventually("the gateway to know the worker", WAIT, || async {
            gateway.workers().endpoint(WorkerId(worker)).map(drop)
        })
        .await
        .unwrap();
    }

    async fn all_freed(&self) {
        let scheduler = || self.daemon().state().scheduler().active_requests();
        eventually("both halves of every request to be freed", WAIT, || async {
            (scheduler() == 0).then_some(())
        })
        .await
        .unwrap();
    }

    async fn stop(mut self) {
        self.gateway.take().unwrap().shutdown().await.unwrap();
        self.daemon.take().unwrap().shutdown().await.unwrap();
        for engines in &self.engines {
            engines.shutdown();
        }
    }
}

/// `blocks` full blocks of tokens from `first`.
fn tokens(first: u32, blocks: u32) -> Vec<u32> {
    (first..first + blocks * BLOCK).collect()
}

#[tokio::test]
async fn the_openai_client_is_served_by_a_prefill_and_a_decode_worker_and_prefixes_find_their_prefill_worker()
 {
    let fleet = Fleet::start(TransferFlag::Vllm, 2, 2, &[]).await;
    let (python, script) = fixture::openai_python("gateway_client.py").await;
    let seen = integration_tests::python::run_json(&python, &script, &[&fleet.base, MODEL]).await;
    fixture::assert_openai_client_saw(&seen);
    // The long prompt was prefilled on a prefill worker and loaded by the decode
    // worker with the prefill worker's kv_transfer_params; the short chats were
    // prefilled where they decoded.
    assert!(fleet.metrics().routed_count("long_uncached") >= 1);
    assert!(fleet.metrics().routed_count("short_uncached") >= 2);
    let prompt_tokens = seen["completion"]["prompt_tokens"].as_f64().unwrap();
    assert!(fleet.transferred_tokens().await >= prompt_tokens, "{seen}");

    // A prompt's prefill goes to the prefill worker that holds its prefix.
    let shared = tokens(10_000, 30);
    let first = fleet.complete(&shared, true, 2).await;
    assert_eq!(first.status, 200, "{}", first.text);
    assert_eq!(first.decision.as_deref(), Some("long_uncached"));
    let prefill = first.prefill.unwrap();
    fleet.indexed(&prefill, &shared).await;
    let longer = [shared.clone(), tokens(20_000, 30)].concat();
    let second = fleet.complete(&longer, false, 2).await;
    assert_eq!(second.status, 200, "{}", second.text);
    assert_eq!(second.decision.as_deref(), Some("long_uncached"));
    assert_eq!(
        second.prefill.as_ref(),
        Some(&prefill),
        "the prefill worker holding the prefix"
    );

    // Conditional disaggregation: a prompt the decode worker mostly holds (five
    // sixths; the rest over the 64-token local bound), and a short one, are
    // prefilled where they decode.
    let decode = first.worker.unwrap();
    fleet.indexed(&decode, &shared).await;
    let mostly_held = [shared, tokens(25_000, 6)].concat();
    let again = fleet.complete(&mostly_held, false, 2).await;
    assert_eq!(again.status, 200, "{}", again.text);
    assert_eq!(again.decision.as_deref(), Some("decode_holds_prefix"));
    assert_eq!(again.prefill, None);
    let short = fleet.complete(&tokens(30_000, 2), false, 2).await;
    assert_eq!(short.decision.as_deref(), Some("short_uncached"));
    assert_eq!(short.prefill, None);
    fleet.all_freed().await;
    assert!(fleet.metrics().remote_prefills("vllm") >= 3);
    // Cache parity is judged where each prompt was prefilled, and agrees: the
    // prefill worker's cold and prefix answers, the decode worker's own prefill.
    let parity = |worker: &str, outcome| fleet.metrics().parity_outcome(worker, outcome).get();
    assert!(parity(&prefill, "agree") >= 2);
    assert!(parity(&decode, "agree") >= 1);
    for (worker, outcome) in [(&prefill, "over_claim"), (&decode, "under_claim")] {
        assert_eq!(parity(worker, outcome), 0, "{worker} {outcome}");
    }
    fleet.stop().await;
}

#[tokio::test]
async fn sglang_pairs_stream_and_assemble_the_decode_workers_answer() {
    let fleet = Fleet::start(TransferFlag::Sglang, 1, 1, &[]).await;
    let (streamed_prompt, whole_prompt) = (tokens(1_000, 20), tokens(5_000, 24));
    let streamed = fleet.complete(&streamed_prompt, true, 3).await;
    assert_eq!(streamed.status, 200, "{}", streamed.text);
    assert!(
        streamed.text.ends_with("data: [DONE]\n\n"),
        "{}",
        streamed.text
    );
    assert!(!streamed.text.contains("error"), "{}", streamed.text);
    let whole = fleet.complete(&whole_prompt, false, 3).await;
    assert_eq!(whole.status, 200, "{}", whole.text);
    for answer in [&streamed, &whole] {
        assert_eq!(answer.decision.as_deref(), Some("long_uncached"));
        assert_eq!(answer.prefill.as_deref(), Some("1"));
        assert_eq!(answer.worker.as_deref(), Some("11"));
    }
    let whole: Value = serde_json::from_str(&whole.text).unwrap();
    assert_eq!(whole["usage"]["completion_tokens"], 3, "{whole}");
    let transferred = (streamed_prompt.len() + whole_prompt.len()) as f64;
    assert_eq!(fleet.transferred_tokens().await, transferred);
    // The prefill worker's answers are judged (cold: nothing predicted, nothing
    // cached); the decode worker's, which loaded the prompt, are not.
    let parity = |worker, outcome| fleet.metrics().parity_outcome(worker, outcome).get();
    assert_eq!(parity("1", "agree"), 2);
    assert_eq!(parity("11", "agree") + parity("11", "unreported"), 0);
    fleet.all_freed().await;
    fleet.stop().await;
}

#[tokio::test]
async fn killed_prefill_and_decode_engines_are_failed_over() {
    let flags = ["--max-retries", "3"];
    let mut fleet = Fleet::start(TransferFlag::Vllm, 1, 1, &flags).await;
    // Prefill worker 9 holds the prompt, so the router picks it first.
    let held = tokens(40_000, 20);
    fleet.add_killed_engine(9, WorkerRole::Prefill, &held).await;
    let answer = fleet.complete(&held, true, 2).await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    assert!(!answer.text.contains("error"), "{}", answer.text);
    assert_eq!(answer.prefill.as_deref(), Some("1"));
    assert_eq!(fleet.metrics().half_retries("prefill", "connect"), 1);

    // Decode worker 19 holds half of the next prompt: the least full with it.
    let prompt = tokens(50_000, 40);
    fleet
        .add_killed_engine(19, WorkerRole::Decode, &prompt[..20 * BLOCK as usize])
        .await;
    let answer = fleet.complete(&prompt, false, 2).await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    assert_eq!(answer.worker, Some(FIRST_DECODE.to_string()));
    assert_eq!(fleet.metrics().half_retries("decode", "connect"), 1);
    fleet.all_freed().await;
    fleet.stop().await;
}

#[tokio::test]
async fn both_halves_are_freed_when_streaming_clients_go_away() {
    let fleet = Fleet::start(TransferFlag::Vllm, 1, 1, &[]).await;
    let mut streams = Vec::new();
    for i in 0..3 {
        let body = json!({"model": MODEL, "prompt": tokens(60_000 + i * 1_000, 20),
            "max_tokens": 2_000, "stream": true});
        let url = format!("{}/v1/completions", fleet.base);
        let response = fleet.http.post(url).json(&body).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()[PREFILL_WORKER_HEADER], "1");
        let mut chunks = response.bytes_stream();
        chunks.next().await.unwrap().unwrap();
        streams.push(chunks);
    }
    assert!(fleet.daemon().state().scheduler().active_requests() >= 3);
    drop(streams);
    fleet.all_freed().await;
    fleet.stop().await;
}
