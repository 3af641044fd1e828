//! Workers survive the loss of one etcd member: on a 3-member etcd cluster (every
//! process given all three endpoints), a mock engine keeps its registration lease
//! alive through another member when the member its keep-alive ran through dies, and
//! when the leader dies: the lease id stays the same, the registration key is never
//! deleted, and the router keeps routing to the engine with an exact overlap. And a
//! worker whose registration was dropped and comes back gets a dump request from the
//! router, so its index is rebuilt without waiting for its next KV event.

#![allow(clippy::unwrap_used)]

mod journal_worker;
mod mock_engine;

use engine_model::EngineModelConfig;
use etcd_client::{Client as Etcd, EventType, WatchOptions};
use futures::StreamExt;
use indexer::IndexerApi as _;
use integration_tests::etcd_cluster::EtcdCluster;
use integration_tests::eventually;
use journal_worker::{held_paths, router_paths_of};
use kv_cluster::args::{EtcdArgs, NatsArgs};
use kv_events::routing::{Prompt, RouteReply, RouteRequest};
use kv_events::{DpRank, Namespace, Subjects, WorkerId};
use mock_engine::{engine_dump, generate};
use mocker::engine::{ConnectionArgs, EnginesHandle, FleetArgs};
use router_daemon::{Daemon, DaemonConfig, ServeArgs};
use std::time::Duration;
use testbed::NatsServer;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

const BLOCK: u32 = 4;
/// The engines' lease TTL (`integration_tests::spawn_mock_engines`): renewed every
/// 1.7 s.
const TTL_SECS: u64 = 5;
/// How long a test waits after losing a member: past two TTLs, so a lease that was
/// not renewed through another member has expired by then.
const AFTER_LOSS: Duration = Duration::from_secs(2 * TTL_SECS + 2);
const WORKER: WorkerId = WorkerId(1);

/// NATS, a 3-member etcd cluster, a router daemon and one mock engine, all given
/// every etcd endpoint.
struct Fixture {
    etcd: EtcdCluster,
    nats_server: NatsServer,
    nats: async_nats::Client,
    subjects: Subjects,
    daemon: Daemon,
    engines: EnginesHandle,
    /// The prompt the engine cached before the test's fault.
    prompt: Vec<u32>,
}

impl Fixture {
    async fn start() -> anyhow::Result<Self> {
        let etcd = EtcdCluster::start(3).await?;
        let nats_server = NatsServer::start().await?;
        let nats = async_nats::connect(nats_server.url()).await?;
        let subjects = Subjects::new(Namespace::new("it")?);
        let args: ServeArgs = kv_cluster::args::parse_flags([
            "kv-router",
            "--nats-url",
            &nats_server.url(),
            "--etcd-endpoints",
            &etcd.endpoints_flag(),
            "--namespace",
            subjects.namespace().as_str(),
            "--block-size",
            &BLOCK.to_string(),
            "--shards",
            "2",
        ])?;
        let daemon = Daemon::start(
            DaemonConfig::from_args(&args)?,
            &prometheus::Registry::new(),
        )
        .await?;
        let engines = integration_tests::spawn_mock_engines(
            ConnectionArgs {
                nats: NatsArgs {
                    nats_url: vec![nats_server.url()],
                    ..NatsArgs::default()
                },
                etcd: EtcdArgs {
                    etcd_endpoints: etcd.endpoints(),
                    ..EtcdArgs::default()
                },
                namespace: kv_cluster::args::NamespaceArgs {
                    namespace: subjects.namespace().as_str().to_owned(),
                },
            },
            FleetArgs {
                workers: 1,
                first_worker_id: WORKER.0,
                dp_size: 1,
            },
            EngineModelConfig {
                block_size: BLOCK,
                num_gpu_blocks: 256,
                ..EngineModelConfig::default()
            },
            100.0,
            Default::default(),
        )
        .await?;
        let prompt: Vec<u32> = (0..6 * BLOCK).collect();
        generate(&nats, &subjects, BLOCK, WORKER, "warm", &prompt).await?;
        let fixture = Self {
            etcd,
            nats_server,
            nats,
            subjects,
            daemon,
            engines,
            prompt,
        };
        fixture.wait_for_exact_index().await?;
        Ok(fixture)
    }

    /// Waits (up to 15 s) until the router holds exactly what the engine holds, and
    /// something.
    async fn wait_for_exact_index(&self) -> anyhow::Result<()> {
        let held = held_paths(&engine_dump(&self.nats, &self.subjects, WORKER).await?);
        anyhow::ensure!(!held.is_empty(), "the engine cached the prompt");
        eventually(
            "the router's index to equal the engine's blocks",
            Duration::from_secs(15),
            || async {
                (router_paths_of(&self.daemon, WORKER, DpRank(0)).await == held).then_some(())
            },
        )
        .await
    }

    /// The worker key's (lease id, create revision) as member `via` has it.
    async fn registration(&self, via: usize) -> anyhow::Result<(i64, i64)> {
        let mut client = self.etcd.member_client(via).await?;
        let got = client
            .get(self.subjects.etcd_worker_key(WORKER), None)
            .await?;
        let kv = got
            .kvs()
            .first()
            .ok_or_else(|| anyhow::anyhow!("worker key missing"))?;
        Ok((kv.lease(), kv.create_revision()))
    }

    /// The prompt plus a partial block, routed: must reach the engine with every block
    /// of the prompt matched.
    async fn assert_routed_with_exact_overlap(&self, id: &str) -> anyhow::Result<()> {
        let mut tokens = self.prompt.clone();
        tokens.push(7);
        let request = RouteRequest::new(id, Prompt::Tokens { token_ids: tokens });
        let reply = self
            .nats
            .request(self.subjects.route(), kv_events::encode(&request)?.into())
            .await?;
        match kv_events::decode::<RouteReply>(&reply.payload)? {
            RouteReply::Routed(d) => assert_eq!(
                (d.worker_id, d.overlap_blocks),
                (WORKER, 6),
                "routed to the engine with the cached prompt matched"
            ),
            other => panic!("not routed: {other:?}"),
        }
        Ok(())
    }

    async fn stop(self) -> anyhow::Result<()> {
        self.daemon.shutdown().await?;
        self.engines.shutdown();
        self.engines.wait().await?;
        drop(self.nats_server);
        Ok(())
    }
}

/// The registration events an etcd watch saw, and how the watch ended.
struct KeyWatch {
    /// Every event on the worker keys: (deleted, key).
    events: mpsc::UnboundedReceiver<(bool, String)>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl KeyWatch {
    /// Watches the worker keys through `client` from `revision` on.
    fn start(mut client: Etcd, subjects: &Subjects, revision: i64) -> Self {
        let prefix = subjects.etcd_worker_prefix();
        let (tx, events) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let options = WatchOptions::new()
                .with_prefix()
                .with_start_revision(revision);
            let mut stream = client.watch(prefix, Some(options)).await?;
            while let Some(resp) = stream.next().await {
                for event in resp?.events() {
                    let key = event.kv().and_then(|kv| kv.key_str().ok()).unwrap_or("?");
                    let _ = tx.send((event.event_type() == EventType::Delete, key.to_owned()));
                }
            }
            anyhow::bail!("the watch ended")
        });
        Self { events, task }
    }

    /// The keys deleted so far; fails if the watch failed.
    async fn deleted(&mut self) -> anyhow::Result<Vec<String>> {
        if self.task.is_finished() {
            (&mut self.task).await??;
        }
        let mut deleted = Vec::new();
        while let Ok((delete, key)) = self.events.try_recv() {
            if delete {
                deleted.push(key);
            }
        }
        Ok(deleted)
    }
}

/// Which member dies, relative to the one the engine's lease keep-alive stream runs
/// through (arranged with etcd's leader transfer before the kill).
#[derive(Debug, Clone, Copy)]
enum Loss {
    /// The member the engine talks to, a follower.
    EngineFollower,
    /// The member the engine talks to, the leader.
    EngineLeader,
}

impl Loss {
    /// Arranges the leadership and returns the member to kill.
    async fn arrange(self, etcd: &EtcdCluster) -> anyhow::Result<usize> {
        let holders = etcd.members_with_keep_alives().await?;
        anyhow::ensure!(
            holders.len() == 1,
            "one member holds the engine's keep-alive stream: {holders:?}"
        );
        let engine = holders[0].0;
        let other = (engine + 1) % etcd.len();
        match self {
            Loss::EngineFollower => {
                if etcd.leader().await? == engine {
                    etcd.move_leader(other).await?;
                }
                Ok(engine)
            }
            Loss::EngineLeader => {
                etcd.move_leader(engine).await?;
                Ok(engine)
            }
        }
    }
}

/// Kills the member `loss` names and checks that the engine's registration lives on
/// unchanged through the other members, and the router with it.
async fn survives(loss: Loss) -> anyhow::Result<()> {
    let mut f = Fixture::start().await?;
    let victim = loss.arrange(&f.etcd).await?;
    let observer = (0..f.etcd.len()).find(|&i| i != victim).unwrap();
    let (lease, created) = f.registration(observer).await?;
    let mut observer_client = f.etcd.member_client(observer).await?;
    let revision = observer_client.status().await?.header().unwrap().revision();
    let mut watch = KeyWatch::start(observer_client, &f.subjects, revision);

    f.etcd.kill(victim);
    tokio::time::sleep(AFTER_LOSS).await;

    assert_eq!(
        watch.deleted().await?,
        Vec::<String>::new(),
        "{loss:?}: no registration was deleted"
    );
    assert_eq!(
        f.registration(observer).await?,
        (lease, created),
        "{loss:?}: the registration keeps its lease and was never re-created"
    );
    let known: Vec<(WorkerId, i64)> = f
        .daemon
        .state()
        .directory
        .snapshot()
        .iter()
        .map(|e| (e.registration.worker_id, e.lease_id))
        .collect();
    assert_eq!(
        known,
        vec![(WORKER, lease)],
        "{loss:?}: the router knows the engine under its lease"
    );
    f.assert_routed_with_exact_overlap("after-loss").await?;
    f.wait_for_exact_index().await?;

    // The member comes back and catches up.
    f.etcd.restart(victim).await?;
    assert_eq!(f.registration(victim).await?, (lease, created), "{loss:?}");
    f.stop().await
}

#[tokio::test]
async fn losing_the_member_a_worker_talks_to_keeps_its_lease_and_registration() -> anyhow::Result<()>
{
    survives(Loss::EngineFollower).await
}

#[tokio::test]
async fn losing_the_leader_a_worker_talks_to_keeps_its_lease_and_registration() -> anyhow::Result<()>
{
    survives(Loss::EngineLeader).await
}

#[tokio::test]
async fn a_worker_dropped_and_back_is_asked_for_a_dump_and_indexed_without_a_new_event()
-> anyhow::Result<()> {
    let f = Fixture::start().await?;
    let mut events = f.nats.subscribe(f.subjects.kv_events(WORKER)).await?;
    kv_cluster::barrier::server_barrier(&f.nats).await?;
    let requests = || {
        f.daemon
            .state()
            .indexer
            .counters()
            .snapshot()
            .recovery_requests
    };
    let asked_before = requests();
    let (lease, created) = f.registration(0).await?;

    // The lease ends as an expiry would end it: the key is deleted and the router
    // drops the worker with its blocks; the engine's next renewal finds the lease
    // gone and registers again under a new one, with the same epoch.
    f.etcd.member_client(0).await?.lease_revoke(lease).await?;
    let (new_lease, recreated) = eventually(
        "the engine to register again",
        Duration::from_secs(10),
        || async { f.registration(0).await.ok().filter(|(l, _)| *l != lease) },
    )
    .await?;
    assert!(
        recreated > created,
        "the key was deleted, then written again"
    );
    eventually(
        "the router to know the engine under its new lease",
        Duration::from_secs(10),
        || async {
            let known = f.daemon.state().directory.snapshot();
            known.iter().any(|e| e.lease_id == new_lease).then_some(())
        },
    )
    .await?;

    // Rebuilt from one dump, with no KV event published meanwhile.
    f.wait_for_exact_index().await?;
    f.assert_routed_with_exact_overlap("after-rejoin").await?;
    assert_eq!(
        requests() - asked_before,
        1,
        "one dump request for the one rank"
    );
    let published = tokio::time::timeout(Duration::from_millis(300), events.next()).await;
    assert!(
        published.is_err(),
        "the engine published no KV event: {published:?}"
    );
    f.stop().await
}
