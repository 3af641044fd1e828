//! Issue 25, finding 4: an engine restarted after a while away is routable again
//! within about `--reconnect-max-backoff-ms` of coming back. The relay's ZMQ
//! reconnects used to double their wait up to 30 s (the `zeromq` crate's fixed
//! schedule), so an engine back after half a minute stayed unroutable for up to 30 s.
//! Real nats-server, etcd, router daemon, relay and a vLLM-mode mock engine.

// Test helpers unwrap: a broken socket or server must fail the test loudly.
#![allow(clippy::unwrap_used)]

use engine_model::EngineModelConfig;
use indexer::IndexerApi as _;
use integration_tests::{TestCluster, eventually};
use kv_events::{DpRank, WorkerId, WorkerRank, compute_block_hashes};
use kv_relay::{Relay, RelayArgs, RelayConfig};
use mocker::engine::{EngineHttpArgs, EnginesHandle, FleetArgs, KvEventsArgs};
use router_daemon::Daemon;
use serde_json::json;
use std::time::Duration;
use tokio::time::Instant;

const BLOCK: u32 = 16;
const WAIT: Duration = Duration::from_secs(15);
const WORKER: WorkerId = WorkerId(1);
/// The relay's `--reconnect-max-backoff-ms` here.
const CAP_MS: &str = "250";
/// How long the engine's port refuses the relay's handshakes while it is away.
const AWAY: Duration = Duration::from_secs(4);

/// Ports of the engine, kept across its restart.
struct Ports {
    publish: u16,
    replay: u16,
    http: u16,
}

fn port_of(url: &str) -> u16 {
    url.rsplit(':').next().unwrap().parse().unwrap()
}

/// A vLLM-mode mock engine as worker 1 (one rank of 64 blocks), on `ports` or, for
/// `None`, on free ones.
async fn engine(cluster: &TestCluster, ports: Option<&Ports>) -> EnginesHandle {
    let http = EngineHttpArgs {
        http_port: ports.map_or(0, |p| p.http),
        ..EngineHttpArgs::default()
    };
    let model = EngineModelConfig {
        block_size: BLOCK,
        num_gpu_blocks: 64,
        ..EngineModelConfig::default()
    };
    let mut args = cluster.engine_args(1, model, 100.0, http);
    args.fleet = FleetArgs {
        workers: 1,
        first_worker_id: WORKER.0,
        dp_size: 1,
    };
    args.kv_events = KvEventsArgs::vllm_on_free_ports();
    if let Some(p) = ports {
        args.kv_events.zmq_port = p.publish;
        args.kv_events.zmq_replay_port = p.replay;
    }
    mocker::engine::spawn_engines(args, Default::default())
        .await
        .unwrap()
}

async fn complete(url: &str, prompt: &[u32]) {
    let response = kv_cluster::http::client()
        .expect("http client")
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success(), "{}", response.status());
}

async fn overlap(daemon: &Daemon, prompt: &[u32]) -> u32 {
    let hashes = compute_block_hashes(prompt, BLOCK);
    let scores = daemon.state().indexer.find_matches(hashes).await.unwrap();
    scores.get(WorkerRank::new(WORKER, DpRank(0)))
}

fn registered(daemon: &Daemon) -> bool {
    daemon
        .state()
        .scheduler()
        .workers()
        .any(|w| w.worker_id == WORKER)
}

/// Accepts every connection to `port` and closes it at once (a port that is up but
/// refuses the ZMQ handshake) for `AWAY`; returns when each connection came.
async fn refuse_handshakes(port: u16) -> Vec<Instant> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let end = Instant::now() + AWAY;
    let mut tries = Vec::new();
    while let Ok(accepted) = tokio::time::timeout_at(end, listener.accept()).await {
        tries.push(Instant::now());
        drop(accepted.unwrap());
    }
    tries
}

/// The engine goes away, its port refuses the relay for 4 s, and it comes back on
/// the same ports. The relay tries at most the cap (250 ms) apart all along — the old
/// schedule's waits had grown past 1.6 s by then — and the restarted engine's newly
/// cached prompt is routable within a bound the old schedule (next try 3.2 to 6 s
/// later) could not meet.
#[tokio::test]
async fn a_restarted_engine_is_read_again_within_the_reconnect_cap() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let first = engine(&cluster, None).await;
    let url = first.http_urls()[0].clone();
    let sockets = first.zmq_endpoints()[0][0].clone();
    let ports = Ports {
        publish: port_of(&sockets.publish),
        replay: port_of(&sockets.replay),
        http: port_of(&url),
    };
    let args = [
        "--engine-endpoint",
        sockets.publish.as_str(),
        "--replay-endpoint",
        sockets.replay.as_str(),
        "--worker-id",
        "1",
        "--worker-name",
        "reconnect-1",
        "--engine-url",
        url.as_str(),
        "--metrics-interval-ms",
        "100",
        "--reconnect-max-backoff-ms",
        CAP_MS,
    ];
    let config = RelayConfig::from_args(&cluster.flags::<RelayArgs>(&args)).unwrap();
    let relay = Relay::start(config, &prometheus::Registry::new())
        .await
        .unwrap();
    let a: Vec<u32> = (1000..1050).collect();
    complete(&url, &a).await;
    eventually("prompt A routable", WAIT, || async {
        (overlap(&daemon, &a).await == 3).then_some(())
    })
    .await
    .unwrap();

    // The engine goes away: the relay revokes the registration at once.
    first.shutdown();
    first.wait().await.unwrap();
    eventually("the worker unregistered", WAIT, || async {
        (!registered(&daemon)).then_some(())
    })
    .await
    .unwrap();
    let tries = refuse_handshakes(ports.publish).await;
    let gaps: Vec<Duration> = tries.windows(2).map(|w| w[1] - w[0]).collect();
    let widest = gaps.iter().max().copied().unwrap_or(AWAY);
    assert!(
        tries.len() >= 8 && widest < Duration::from_secs(1),
        "the relay tried {} times in {AWAY:?}, at most {widest:?} apart (cap {CAP_MS} ms)",
        tries.len()
    );

    // The engine is back (healthy: its HTTP server answers) and caches prompt B.
    let second = engine(&cluster, Some(&ports)).await;
    let healthy = Instant::now();
    let b: Vec<u32> = (5000..5050).collect();
    complete(&url, &b).await;
    let bound = Duration::from_secs(5);
    eventually(
        "prompt B routable on the restarted engine",
        bound,
        || async { (registered(&daemon) && overlap(&daemon, &b).await == 3).then_some(()) },
    )
    .await
    .unwrap();
    eprintln!(
        "engine healthy -> prompt B routable: {:?} (tries {AWAY:?} apart at most {widest:?})",
        healthy.elapsed()
    );
    assert_eq!(
        overlap(&daemon, &a).await,
        0,
        "the restarted engine's picture starts empty"
    );
    assert_eq!(relay.counters().resets("reconnect"), 1);

    relay.shutdown().await.unwrap();
    second.shutdown();
    second.wait().await.unwrap();
    daemon.shutdown().await.unwrap();
}
