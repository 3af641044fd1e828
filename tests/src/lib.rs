//! Shared helpers for the end-to-end tests in `tests/tests/`.
//!
//! Every test starts its own nats-server and etcd on free loopback ports (through
//! [`testbed`]), runs the router daemon in-process, and plays the roles of
//! engines and frontends over real NATS and etcd with real msgpack. Servers are
//! stopped when their guards drop.
//!
//! # Layout
//! - [`TestCluster`]: nats-server + etcd + a running daemon, and clients to both.
//! - [`FakeWorker`]: a hand-driven worker: etcd registration under a lease, KV events.
//! - [`nats_cluster`]: [`nats_cluster::NatsCluster`]: N nats-server nodes routed as one
//!   cluster, a node killed and restarted.
//! - [`security`]: [`security::SecureCluster`]: nats-server with the shipped
//!   permissions, etcd over mutual TLS with authentication and the shipped roles.
//! - [`child_daemon`]: the release binary as a child process, for the measurement
//!   tools in `tests/examples/`.
//! - [`etcd_proxy`]: a path to etcd the test can cut.

use anyhow::Context;

pub mod capture;
pub mod child_daemon;
pub mod cpu;
pub mod epp;
pub mod etcd_cluster;
pub mod etcd_proxy;
pub mod nats_cluster;
pub mod python;
pub mod router_client;
pub mod security;
use etcd_client::{Client as Etcd, PutOptions};
use indexer::IndexerApi as _;
use kv_events::discovery::WorkerRegistration;
use kv_events::routing::{
    LifecycleEvent, LifecycleMessage, Prompt, RouteBatchReply, RouteBatchRequest, RouteReply,
    RouteRequest,
};
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash,
    Namespace, StoredBlock, Subjects, WorkerId, WorkerRank, decode, encode,
};
use router_daemon::{Daemon, DaemonConfig, ServeArgs};
use testbed::{EtcdServer, NatsServer};

/// Real servers plus an in-process daemon.
pub struct TestCluster {
    /// The NATS server (dropped last).
    pub nats_server: NatsServer,
    /// The etcd server.
    pub etcd_server: EtcdServer,
    /// A client for playing engines and frontends.
    pub nats: async_nats::Client,
    /// A client for registering workers.
    pub etcd: Etcd,
    /// Subject names of the test namespace.
    pub subjects: Subjects,
    /// Tokens per block used by the daemon.
    pub block_size: u32,
    /// The metrics registry the daemon registered into.
    pub registry: prometheus::Registry,
}

impl TestCluster {
    /// Starts nats-server and etcd.
    ///
    /// # Errors
    /// When a server cannot be started or reached.
    pub async fn start(block_size: u32) -> anyhow::Result<Self> {
        let nats_server = NatsServer::start().await.context("starting nats-server")?;
        let etcd_server = EtcdServer::start().await.context("starting etcd")?;
        let nats = async_nats::connect(nats_server.url()).await?;
        let etcd = Etcd::connect([etcd_server.endpoint()], None).await?;
        let subjects = Subjects::new(Namespace::new("it")?);
        Ok(Self {
            nats_server,
            etcd_server,
            nats,
            etcd,
            subjects,
            block_size,
            registry: prometheus::Registry::new(),
        })
    }

    /// The program name, then the NATS, etcd and namespace flags that point `serve` or
    /// `relay` at this cluster.
    pub fn connection_flags(&self) -> Vec<String> {
        [
            "kv-router",
            "--nats-url",
            &self.nats_server.url(),
            "--etcd-endpoints",
            &self.etcd_server.endpoint(),
            "--namespace",
            self.subjects.namespace().as_str(),
        ]
        .map(String::from)
        .to_vec()
    }

    /// [`Self::connection_flags`] followed by `extra`, parsed as the flag group `A`
    /// ([`ServeArgs`] or `kv_relay::RelayArgs`).
    ///
    /// # Panics
    /// When the flags do not parse: a mistake in the test.
    pub fn flags<A: clap::Args + clap::FromArgMatches>(&self, extra: &[&str]) -> A {
        let mut args = self.connection_flags();
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        kv_cluster::args::parse_flags(args).expect("test flags parse")
    }

    /// Daemon flags for this cluster (default policy, seeded RNG, 2 shards).
    pub fn serve_args(&self) -> ServeArgs {
        let block_size = self.block_size.to_string();
        self.flags(&["--block-size", &block_size, "--shards", "2", "--seed", "7"])
    }

    /// Starts mock engines `1..=workers` (dp_size 1) of `model` in this cluster's
    /// namespace, at `time_scale`, serving OpenAI HTTP as `http` says.
    ///
    /// # Errors
    /// When the engines cannot start or register.
    pub async fn spawn_engines(
        &self,
        workers: u32,
        model: engine_model::EngineModelConfig,
        time_scale: f64,
        http: mocker::engine::EngineHttpArgs,
    ) -> anyhow::Result<mocker::engine::EnginesHandle> {
        let args = self.engine_args(workers, model, time_scale, http);
        let shutdown = tokio_util::sync::CancellationToken::new();
        Ok(mocker::engine::spawn_engines(args, shutdown).await?)
    }

    /// The arguments of [`Self::spawn_engines`]: engines `1..=workers` of this
    /// cluster, 5 s leases, load metrics every 50 ms; adjust them to start a fleet
    /// otherwise (other ids, another etcd path, longer leases).
    pub fn engine_args(
        &self,
        workers: u32,
        model: engine_model::EngineModelConfig,
        time_scale: f64,
        http: mocker::engine::EngineHttpArgs,
    ) -> mocker::engine::EngineArgs {
        let fleet = mocker::engine::FleetArgs {
            workers,
            first_worker_id: 1,
            dp_size: 1,
        };
        engine_args(self.flags(&[]), fleet, model, time_scale, http)
    }

    /// Starts a daemon with [`Self::serve_args`], modified by `adjust`.
    ///
    /// # Errors
    /// Configuration or start-up failures.
    pub async fn start_daemon(
        &self,
        adjust: impl FnOnce(&mut ServeArgs),
    ) -> anyhow::Result<Daemon> {
        let mut args = self.serve_args();
        adjust(&mut args);
        let config = DaemonConfig::from_args(&args)?;
        Daemon::start(config, &self.registry).await
    }

    /// Sends a route request and decodes the reply.
    ///
    /// # Errors
    /// NATS or decode failures.
    pub async fn route(&self, request: &RouteRequest) -> anyhow::Result<RouteReply> {
        let reply = self
            .nats
            .request(self.subjects.route(), encode(request)?.into())
            .await?;
        Ok(decode(&reply.payload)?)
    }

    /// Sends a batch route request and decodes the reply.
    ///
    /// # Errors
    /// NATS or decode failures.
    pub async fn route_batch(&self, batch: &RouteBatchRequest) -> anyhow::Result<RouteBatchReply> {
        let reply = self
            .nats
            .request(self.subjects.route_batch(), encode(batch)?.into())
            .await?;
        Ok(decode(&reply.payload)?)
    }

    /// Publishes a lifecycle message (`prefill_done`, `keep_alive`, `freed`) for
    /// `request_id`, as a frontend does, and flushes it to the server.
    ///
    /// # Errors
    /// NATS or encode failures.
    pub async fn lifecycle(&self, request_id: &str, event: LifecycleEvent) -> anyhow::Result<()> {
        let msg = LifecycleMessage {
            request_id: request_id.into(),
            event,
        };
        self.nats
            .publish(self.subjects.lifecycle(), encode(&msg)?.into())
            .await?;
        self.nats.flush().await?;
        Ok(())
    }

    /// Routes a token-id prompt under `request_id`.
    ///
    /// # Errors
    /// NATS or decode failures.
    pub async fn route_tokens(
        &self,
        request_id: &str,
        token_ids: Vec<u32>,
    ) -> anyhow::Result<RouteReply> {
        self.route(&RouteRequest::new(request_id, Prompt::Tokens { token_ids }))
            .await
    }
}

/// Starts the mock engines of `fleet`, connected as `connection` says, at
/// `time_scale` (lease TTL 5 s, metrics every 50 ms), serving OpenAI HTTP as `http`
/// says.
///
/// # Errors
/// When the engines cannot start or register.
pub async fn spawn_mock_engines(
    connection: mocker::engine::ConnectionArgs,
    fleet: mocker::engine::FleetArgs,
    model: engine_model::EngineModelConfig,
    time_scale: f64,
    http: mocker::engine::EngineHttpArgs,
) -> anyhow::Result<mocker::engine::EnginesHandle> {
    let args = engine_args(connection, fleet, model, time_scale, http);
    let shutdown = tokio_util::sync::CancellationToken::new();
    Ok(mocker::engine::spawn_engines(args, shutdown).await?)
}

/// Engine arguments for `fleet` on `connection`: 5 s leases, load metrics every 50 ms.
fn engine_args(
    connection: mocker::engine::ConnectionArgs,
    fleet: mocker::engine::FleetArgs,
    model: engine_model::EngineModelConfig,
    time_scale: f64,
    http: mocker::engine::EngineHttpArgs,
) -> mocker::engine::EngineArgs {
    mocker::engine::EngineArgs {
        connection,
        fleet,
        model,
        runtime: mocker::engine::RuntimeArgs {
            time_scale,
            lease_ttl_secs: 5,
            metrics_interval_ms: 50,
            shutdown: Default::default(),
        },
        http,
        cpu_tier: engine_model::CpuTierConfig::default(),
        hybrid: engine_model::HybridConfig::default(),
        kv_events: mocker::engine::KvEventsArgs::default(),
        disaggregation: mocker::engine::EngineDisaggregationArgs::default(),
    }
}

/// A worker driven by hand from a test: it registers under a lease and publishes the
/// KV events the test asks for, numbering them from 0.
pub struct FakeWorker {
    /// The worker id.
    pub id: WorkerId,
    /// The etcd lease its key is bound to.
    pub lease: i64,
    next_event_id: u64,
    last_hash: Option<ExternalBlockHash>,
}

impl FakeWorker {
    /// A publisher for worker `id`, whose registration the test writes itself (e.g.
    /// with [`register_worker`] and fields [`FakeWorker::register`] does not set).
    pub fn publisher(id: WorkerId, lease: i64) -> Self {
        Self {
            id,
            lease,
            next_event_id: 0,
            last_hash: None,
        }
    }

    /// Registers worker `id` (dp_size 1) in etcd under a fresh lease of `ttl_secs`.
    ///
    /// # Errors
    /// etcd failures.
    pub async fn register(
        cluster: &mut TestCluster,
        id: u64,
        ttl_secs: i64,
    ) -> anyhow::Result<Self> {
        let id = WorkerId(id);
        let reg = Self::registration(id, cluster.block_size);
        let lease = register_worker(&mut cluster.etcd, &cluster.subjects, &reg, ttl_secs).await?;
        Ok(Self {
            id,
            lease,
            next_event_id: 0,
            last_hash: None,
        })
    }

    /// The registration [`FakeWorker::register`] writes: one rank of 1,024 blocks of
    /// `block_size` tokens, no URL.
    pub fn registration(id: WorkerId, block_size: u32) -> WorkerRegistration {
        WorkerRegistration {
            worker_id: id,
            dp_size: 1,
            block_size,
            total_kv_blocks: 1024,
            url: None,
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        }
    }

    /// Publishes a `Stored` event for the full blocks of `tokens`, as one chain from
    /// the root, with engine hashes derived from the local hashes.
    ///
    /// # Errors
    /// NATS failures.
    pub async fn store_prompt(
        &mut self,
        cluster: &TestCluster,
        tokens: &[u32],
    ) -> anyhow::Result<()> {
        let local = kv_events::compute_block_hashes(tokens, cluster.block_size);
        let blocks: Vec<StoredBlock> = local
            .iter()
            .enumerate()
            .map(|(i, h)| StoredBlock {
                block_hash: ExternalBlockHash(h.0 ^ (self.id.0 << 32) ^ i as u64),
                tokens_hash: *h,
            })
            .collect();
        self.last_hash = blocks.last().map(|b| b.block_hash);
        self.publish(
            cluster,
            KvCacheEventData::Stored {
                group: None,
                parent_hash: None,
                blocks,
                tier: kv_events::StorageTier::Gpu,
            },
        )
        .await
    }

    /// Publishes one event with the next event id.
    ///
    /// # Errors
    /// NATS failures.
    pub async fn publish(
        &mut self,
        cluster: &TestCluster,
        data: KvCacheEventData,
    ) -> anyhow::Result<()> {
        let batch = KvEventBatch {
            worker_id: self.id,
            epoch: 0,
            events: vec![KvCacheEvent {
                event_id: self.next_event_id,
                dp_rank: DpRank(0),
                data,
            }],
        };
        self.next_event_id += 1;
        cluster
            .nats
            .publish(cluster.subjects.kv_events(self.id), encode(&batch)?.into())
            .await?;
        cluster.nats.flush().await?;
        Ok(())
    }

    /// The local block hashes a prompt of `tokens` has at `block_size`.
    pub fn hashes(tokens: &[u32], block_size: u32) -> Vec<LocalBlockHash> {
        kv_events::compute_block_hashes(tokens, block_size)
    }
}

/// `tokens` and one token more: a prompt that continues a cached one. An engine
/// reuses every cached full block of it, where it reuses one block less of an exactly
/// block-aligned cached prompt (it computes the last prompt token again), so tests
/// that expect the whole cached prefix as overlap send this.
pub fn continued(tokens: &[u32]) -> Vec<u32> {
    let mut out = tokens.to_vec();
    out.push(tokens.last().map_or(0, |t| t.wrapping_add(1)));
    out
}

/// The worker a route reply chose.
///
/// # Panics
/// When the reply is an error: the test expected a route.
pub fn routed_worker(reply: &RouteReply) -> WorkerId {
    match reply {
        RouteReply::Routed(d) => d.worker_id,
        RouteReply::Error(e) => panic!("route failed: {e:?}"),
    }
}

/// Writes `registration` at its worker key under a fresh etcd lease of `ttl_secs`, as
/// an engine (or the relay) does; returns the lease id, for revoking it.
///
/// # Errors
/// etcd failures.
pub async fn register_worker(
    etcd: &mut Etcd,
    subjects: &Subjects,
    registration: &WorkerRegistration,
    ttl_secs: i64,
) -> anyhow::Result<i64> {
    let lease = etcd.lease_grant(ttl_secs, None).await?.id();
    etcd.put(
        subjects.etcd_worker_key(registration.worker_id),
        serde_json::to_vec(registration)?,
        Some(PutOptions::new().with_lease(lease)),
    )
    .await?;
    Ok(lease)
}

/// Waits (up to 10 s) until `daemon`'s index holds at least `blocks` leading blocks of
/// `hashes` on `rank`.
///
/// # Errors
/// When it does not.
pub async fn wait_for_overlap(
    daemon: &Daemon,
    hashes: &[LocalBlockHash],
    rank: WorkerRank,
    blocks: u32,
) -> anyhow::Result<()> {
    eventually(
        &format!("{blocks} blocks to be indexed on {rank}"),
        std::time::Duration::from_secs(10),
        || async {
            let scores = daemon
                .state()
                .indexer
                .find_matches(hashes.to_vec())
                .await
                .ok()?;
            (scores.get(rank) >= blocks).then_some(())
        },
    )
    .await
}

/// Every request `daemon` holds booked, by id, with who booked it and whether its
/// prefill completed.
pub fn booked_requests(
    daemon: &Daemon,
) -> std::collections::BTreeMap<String, (router_daemon::Origin, bool)> {
    daemon
        .state()
        .scheduler()
        .sequences()
        .iter()
        .map(|(id, r)| (id.0.clone(), (r.origin, r.prefill_done)))
        .collect()
}

/// Waits until `check` returns `Some`, re-checking with a short backoff, for at most
/// `timeout`. The daemon consumes NATS and etcd asynchronously, so a test observes
/// *eventual* application; this returns as soon as the condition holds.
///
/// # Errors
/// When the condition does not hold within `timeout`.
pub async fn eventually<T, F, Fut>(
    what: &str,
    timeout: std::time::Duration,
    mut check: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut backoff = std::time::Duration::from_millis(5);
    loop {
        if let Some(value) = check().await {
            return Ok(value);
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(std::time::Duration::from_millis(100));
    }
}
