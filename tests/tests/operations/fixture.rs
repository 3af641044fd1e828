//! What the operations tests share: real nats-server and etcd, etcd reached through a
//! TCP proxy the test can cut and restore, daemons started the way `kv-router serve`
//! starts them (HTTP endpoint first), and workers and frontends played over the wire
//! with messages built as JSON values and msgpack-encoded, as a non-Rust client would.

use anyhow::Context;
use etcd_client::Client as Etcd;
pub use integration_tests::etcd_proxy::{EtcdProxy, etcd_addr};
use kv_cluster::http::get_once;
use kv_events::{Namespace, Subjects, decode, encode};
use router_daemon::Starting;
use router_daemon::config::{DaemonConfig, ServeArgs};
use serde_json::{Value, json};
use std::time::Duration;
use testbed::{EtcdServer, NatsServer};

/// Tokens per block in these tests.
pub const BLOCK: u32 = 4;
/// Upper bound for anything eventual.
pub const WAIT: Duration = Duration::from_secs(30);

/// nats-server and etcd, plus clients playing workers and frontends.
pub struct Fixture {
    /// The NATS server.
    pub nats_server: NatsServer,
    /// The etcd server, `None` once the test stopped it.
    pub etcd_server: Option<EtcdServer>,
    /// The path from daemons to etcd.
    pub proxy: EtcdProxy,
    /// Client for workers and frontends.
    pub nats: async_nats::Client,
    /// Subjects of the test namespace.
    pub subjects: Subjects,
    /// The daemon's metrics.
    pub registry: prometheus::Registry,
}

impl Fixture {
    /// Starts both servers; the proxy to etcd is listening.
    ///
    /// # Errors
    /// When a server cannot start.
    pub async fn start() -> anyhow::Result<Self> {
        let mut fixture = Self::without_etcd_path().await?;
        fixture.proxy.restore().await?;
        Ok(fixture)
    }

    /// Starts both servers, with the proxy to etcd not listening yet.
    ///
    /// # Errors
    /// When a server cannot start.
    pub async fn without_etcd_path() -> anyhow::Result<Self> {
        let nats_server = NatsServer::start().await?;
        let etcd_server = EtcdServer::start().await?;
        let proxy = EtcdProxy::new(etcd_addr(&etcd_server.endpoint()))?;
        let nats = async_nats::connect(nats_server.url()).await?;
        Ok(Self {
            nats_server,
            etcd_server: Some(etcd_server),
            proxy,
            nats,
            subjects: Subjects::new(Namespace::new("ops")?),
            registry: prometheus::Registry::new(),
        })
    }

    /// Daemon config: this cluster, etcd through the proxy, 2 shards, seeded, 1 s etcd
    /// timeout.
    pub fn config(&self) -> DaemonConfig {
        let args = kv_cluster::args::parse_flags::<ServeArgs, _, _>([
            "kv-router",
            "--nats-url",
            &self.nats_server.url(),
            "--etcd-endpoints",
            &self.proxy.endpoint(),
            "--etcd-connect-timeout-ms",
            "1000",
            "--namespace",
            self.subjects.namespace().as_str(),
            "--block-size",
            &BLOCK.to_string(),
            "--shards",
            "2",
            "--seed",
            "7",
            "--http-listen",
            "127.0.0.1:0",
            "--http-debug-listen",
            "main",
        ])
        .expect("test flags parse");
        DaemonConfig::from_args(&args).expect("fixture flags are valid")
    }

    /// A daemon built and serving HTTP, not started; returns it and the HTTP address.
    ///
    /// # Errors
    /// When the daemon cannot be built or bound.
    pub async fn prepare(&self) -> anyhow::Result<(Starting, String)> {
        let mut starting = Starting::new(self.config(), &self.registry)?;
        let addr = starting.serve_http("127.0.0.1:0".parse()?).await?;
        Ok((starting, addr.to_string()))
    }

    /// An etcd client (directly, not through the proxy).
    ///
    /// # Errors
    /// When etcd was stopped or cannot be reached.
    pub async fn etcd(&self) -> anyhow::Result<Etcd> {
        let server = self.etcd_server.as_ref().context("etcd was stopped")?;
        Ok(Etcd::connect([server.endpoint()], None).await?)
    }

    /// Registers worker `id` (one rank) under a fresh lease of `ttl_secs`; returns the
    /// lease id.
    ///
    /// # Errors
    /// etcd failures.
    pub async fn register(&self, id: u64, ttl_secs: i64) -> anyhow::Result<i64> {
        let mut etcd = self.etcd().await?;
        let reg = kv_events::discovery::WorkerRegistration {
            worker_id: kv_events::WorkerId(id),
            dp_size: 1,
            block_size: BLOCK,
            total_kv_blocks: 1024,
            url: None,
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        };
        integration_tests::register_worker(&mut etcd, &self.subjects, &reg, ttl_secs).await
    }

    /// Publishes event `event_id` of worker `id`: its rank 0 stored the full blocks of
    /// `tokens` as one chain from the root.
    ///
    /// # Errors
    /// NATS or encoding failures.
    pub async fn store(&self, id: u64, event_id: u64, tokens: &[u32]) -> anyhow::Result<()> {
        let blocks: Vec<Value> = kv_events::compute_block_hashes(tokens, BLOCK)
            .iter()
            .enumerate()
            .map(|(i, h)| json!({"block_hash": h.0 ^ (id << 40) ^ i as u64, "tokens_hash": h.0}))
            .collect();
        let batch = json!({"worker_id": id, "events": [{"event_id": event_id, "dp_rank": 0,
            "data": {"type": "stored", "parent_hash": null, "blocks": blocks}}]});
        self.nats
            .publish(
                self.subjects.kv_events(kv_events::WorkerId(id)),
                encode(&batch)?.into(),
            )
            .await?;
        Ok(())
    }

    /// Sends a route request for `tokens`; returns the reply as JSON.
    ///
    /// # Errors
    /// NATS failures (including "no responders") and undecodable replies.
    pub async fn route(&self, request_id: &str, tokens: &[u32]) -> anyhow::Result<Value> {
        let request =
            json!({"request_id": request_id, "prompt": {"type": "tokens", "token_ids": tokens}});
        let reply = self
            .nats
            .request(self.subjects.route(), encode(&request)?.into())
            .await?;
        Ok(decode(&reply.payload)?)
    }
}

/// The tokens of a prompt of `blocks` full blocks, distinct per `seed`.
pub fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 10_000 + i).collect()
}

/// `GET` on the daemon's endpoint: the status and the body.
///
/// # Errors
/// When the endpoint does not answer.
pub async fn http(addr: &str, path: &str) -> anyhow::Result<(u16, String)> {
    let (status, body) = get_once(addr, path, Duration::from_secs(5)).await?;
    Ok((status.as_u16(), body))
}

/// The readiness report (status, JSON body).
///
/// # Errors
/// When the endpoint does not answer or the body is not JSON.
pub async fn readyz(addr: &str) -> anyhow::Result<(u16, Value)> {
    let (status, body) = http(addr, "/health/readyz").await?;
    Ok((status, serde_json::from_str(&body)?))
}

/// The current value of a metric from the daemon's `/metrics`.
///
/// # Errors
/// When the endpoint does not answer.
pub async fn metric(addr: &str, name: &str, labels: &str) -> anyhow::Result<Option<f64>> {
    let (_, text) = http(addr, "/metrics").await?;
    Ok(kv_cluster::http::metric_sample(&text, name, labels))
}
