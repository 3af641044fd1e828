//! The whole request path on loopback: nats-server, etcd, the router daemon, mock
//! engines speaking OpenAI HTTP, and the gateway — each real, each on free ports.

use engine_model::EngineModelConfig;
use integration_tests::{FakeWorker, TestCluster, register_worker};
use kv_events::discovery::WorkerRegistration;
use kv_events::{DpRank, WorkerId, WorkerRank, compute_block_hashes};
use kv_gateway::{Gateway, GatewayArgs};
use mocker::engine::{EngineHttpArgs, EnginesHandle};
use router_daemon::{Daemon, ServeArgs};
use std::path::PathBuf;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Tokens per KV block, everywhere.
pub const BLOCK: u32 = 16;
/// The model name the engines and the gateway serve.
pub const MODEL: &str = "tiny";

/// A tiny byte-level BPE tokenizer with a chat template, made for the tokenizer tests.
pub fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kv-tokenizer/tests/data")
}

/// A Python with the official `openai` client, and the path of `script` under
/// `tests/python/`.
pub async fn openai_python(script: &str) -> (PathBuf, PathBuf) {
    let python = integration_tests::python::venv(
        env!("CARGO_TARGET_TMPDIR"),
        "kv-router-openai",
        &["openai==3.54.0"],
        "openai",
    )
    .await;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(script);
    (python, script)
}

/// The registration of worker `worker` (dp_size 1, 1024 blocks of [`BLOCK`] tokens,
/// role `both`) with its engine at `url`.
pub fn registration(worker: WorkerId, url: String) -> WorkerRegistration {
    WorkerRegistration {
        worker_id: worker,
        dp_size: 1,
        block_size: BLOCK,
        total_kv_blocks: 1024,
        url: Some(url),
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    }
}

/// A gateway on a free loopback port in front of `cluster`, serving [`MODEL`] with the
/// test tokenizer, with `gateway_flags`.
pub async fn start_gateway(cluster: &TestCluster, gateway_flags: &[&str]) -> Gateway {
    let mut flags = vec!["--listen", "127.0.0.1:0", "--served-model-name", MODEL];
    let dir = model_dir().display().to_string();
    flags.extend(["--model-dir", &dir]);
    flags.extend_from_slice(gateway_flags);
    let args: GatewayArgs = cluster.flags(&flags);
    Gateway::start(
        args.to_config().expect("gateway flags are valid"),
        Arc::new(prometheus::Registry::new()),
        CancellationToken::new(),
    )
    .await
    .expect("gateway starts")
}

/// Waits until the gateway at `base` says ready on `/health/readyz` (workers known,
/// a router answering).
pub async fn wait_ready(http: &reqwest::Client, base: &str) {
    integration_tests::eventually(
        "the gateway to be ready",
        std::time::Duration::from_secs(15),
        || async {
            let r = http
                .get(format!("{base}/health/readyz"))
                .send()
                .await
                .ok()?;
            (r.status() == 200).then_some(())
        },
    )
    .await
    .expect("gateway ready");
}

/// Checks what `python/gateway_client.py` saw: the token counts it asked for, the
/// same prompt counted streamed and not, chat shapes, 404 and 400.
pub fn assert_openai_client_saw(seen: &serde_json::Value) {
    assert_eq!(seen["completion"]["completion_tokens"], 5, "{seen}");
    assert_eq!(seen["completion"]["finish_reason"], "length", "{seen}");
    let streamed = &seen["completion_stream"];
    assert_eq!(streamed["completion_tokens"], 6, "{streamed}");
    let prompt_tokens = &seen["completion"]["prompt_tokens"];
    assert_eq!(&streamed["prompt_tokens"], prompt_tokens, "{seen}");
    assert_eq!(seen["chat"]["completion_tokens"], 4, "{seen}");
    assert_eq!(seen["chat_stream"]["first_role"], "assistant", "{seen}");
    assert_eq!(
        seen["chat_stream"]["last_finish_reason"], "length",
        "{seen}"
    );
    assert_eq!(seen["unknown_model"], 404, "{seen}");
    assert_eq!(seen["oversized"]["status"], 400, "{seen}");
}

/// The mock engines of a [`Stack`].
pub struct StackEngines {
    /// How many, one worker each.
    pub workers: u32,
    /// Their speed over real time.
    pub time_scale: f64,
    /// Their `--max-model-len` (default: one rank's KV cache, 16,384 tokens).
    pub max_model_len: Option<u64>,
}

/// Everything, started in dependency order; dropped in reverse.
pub struct Stack {
    pub gateway: Option<Gateway>,
    pub engines: EnginesHandle,
    pub daemon: Option<Daemon>,
    pub cluster: TestCluster,
    pub base: String,
    pub http: reqwest::Client,
}

impl Stack {
    /// `workers` mock engines at `time_scale`, a daemon adjusted by `adjust`, and a
    /// gateway with `gateway_flags`.
    pub async fn start(
        workers: u32,
        time_scale: f64,
        adjust: impl FnOnce(&mut ServeArgs),
        gateway_flags: &[&str],
    ) -> Self {
        let cluster = TestCluster::start(BLOCK).await.expect("servers start");
        Self::start_on(cluster, workers, time_scale, adjust, gateway_flags).await
    }

    /// [`Self::start`] on servers the test started itself.
    pub async fn start_on(
        cluster: TestCluster,
        workers: u32,
        time_scale: f64,
        adjust: impl FnOnce(&mut ServeArgs),
        gateway_flags: &[&str],
    ) -> Self {
        let engines = StackEngines {
            workers,
            time_scale,
            max_model_len: None,
        };
        let mut flags = vec!["--max-prompt-tokens", "8000"];
        flags.extend_from_slice(gateway_flags);
        Self::start_with(cluster, engines, adjust, &flags).await
    }

    /// `engines`, a daemon adjusted by `adjust`, and a gateway with `gateway_flags`
    /// only (no `--max-prompt-tokens` unless given), on `cluster`.
    pub async fn start_with(
        cluster: TestCluster,
        engines: StackEngines,
        adjust: impl FnOnce(&mut ServeArgs),
        gateway_flags: &[&str],
    ) -> Self {
        let StackEngines {
            workers,
            time_scale,
            max_model_len,
        } = engines;
        let model = EngineModelConfig {
            block_size: BLOCK,
            num_gpu_blocks: 1024,
            max_num_seqs: 16,
            max_num_batched_tokens: 2048,
        };
        let http = EngineHttpArgs {
            model_dir: Some(model_dir()),
            served_model_name: MODEL.into(),
            max_model_len,
            ..EngineHttpArgs::default()
        };
        let engines = cluster
            .spawn_engines(workers, model, time_scale, http)
            .await
            .expect("engines start");
        Self::assemble(cluster, engines, adjust, gateway_flags).await
    }

    /// A daemon adjusted by `adjust` and a gateway with `gateway_flags` in front of
    /// `engines`, started by the test, on `cluster`.
    pub async fn assemble(
        cluster: TestCluster,
        engines: EnginesHandle,
        adjust: impl FnOnce(&mut ServeArgs),
        gateway_flags: &[&str],
    ) -> Self {
        let daemon = cluster.start_daemon(adjust).await.expect("daemon starts");
        let gateway = start_gateway(&cluster, gateway_flags).await;
        let base = format!("http://{}", gateway.local_addr());
        let stack = Self {
            gateway: Some(gateway),
            engines,
            daemon: Some(daemon),
            cluster,
            base,
            http: kv_cluster::http::client().expect("http client"),
        };
        wait_ready(&stack.http, &stack.base).await;
        stack
    }

    /// The daemon.
    pub fn daemon(&self) -> &Daemon {
        self.daemon.as_ref().expect("running")
    }

    /// The gateway.
    pub fn gateway(&self) -> &Gateway {
        self.gateway.as_ref().expect("running")
    }

    /// Requests the router still has booked.
    pub fn booked(&self) -> usize {
        self.daemon().state().scheduler().active_requests()
    }

    /// POSTs `body` (raw bytes) to the gateway's `path`.
    pub async fn post(&self, path: &str, body: impl Into<reqwest::Body>) -> reqwest::Response {
        self.http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("gateway answers")
    }

    /// The gateway's `/metrics` page.
    pub async fn metrics(&self) -> String {
        let url = format!("{}/metrics", self.base);
        let response = self.http.get(url).send().await.expect("gateway answers");
        response.text().await.expect("a metrics page")
    }

    /// Registers worker `worker` with the engine at `url` and has it hold each of
    /// `prompts`, so the router routes them there first; returns once the daemon and
    /// the gateway both know it.
    pub async fn add_engine_holding(
        &mut self,
        worker: WorkerId,
        url: String,
        prompts: &[Vec<u32>],
    ) {
        let registration = registration(worker, url);
        let cluster = &mut self.cluster;
        let lease = register_worker(&mut cluster.etcd, &cluster.subjects, &registration, 30)
            .await
            .expect("registered");
        let mut fake = FakeWorker::publisher(worker, lease);
        for tokens in prompts {
            fake.store_prompt(&self.cluster, tokens)
                .await
                .expect("published");
            integration_tests::wait_for_overlap(
                self.daemon(),
                &compute_block_hashes(tokens, BLOCK),
                WorkerRank::new(worker, DpRank(0)),
                tokens.len() as u32 / BLOCK,
            )
            .await
            .expect("the daemon sees the prompt on the worker");
        }
        integration_tests::eventually(
            "the gateway to know the worker",
            std::time::Duration::from_secs(15),
            || async { self.gateway().workers().url(worker).map(|_| ()) },
        )
        .await
        .expect("the gateway knows the worker");
    }

    /// Stops gateway, daemon and engines in that order.
    pub async fn stop(mut self) {
        if let Some(gateway) = self.gateway.take() {
            gateway.shutdown().await.expect("gateway stops");
        }
        if let Some(daemon) = self.daemon.take() {
            daemon.shutdown().await.expect("daemon stops");
        }
        self.engines.shutdown();
    }
}
