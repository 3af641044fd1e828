//! Helpers of the relay tests (`relay.rs`, `relay_facts.rs`, `relay_https.rs`): the relay's
//! configuration for the fake engine, and waits on what the router sees. Each test
//! crate uses a subset.

use super::engine::FakeEngine;
use indexer::IndexerApi as _;
use integration_tests::{TestCluster, eventually};
use kv_events::discovery::WorkerRegistration;
use kv_events::{DpRank, LocalBlockHash, WorkerId, WorkerRank};
use kv_relay::{Relay, RelayArgs, RelayConfig};
use router_daemon::Daemon;
use std::time::Duration;

pub const BLOCK: u32 = 16;
pub const WAIT: Duration = Duration::from_secs(15);
pub const WORKER: WorkerId = WorkerId(7);

pub fn relay_config(cluster: &TestCluster, engine: &FakeEngine, extra: &[&str]) -> RelayConfig {
    config_from(cluster, engine.relay_flags(), extra)
}

pub fn config_from(cluster: &TestCluster, mut args: Vec<String>, extra: &[&str]) -> RelayConfig {
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    RelayConfig::from_args(&cluster.flags::<RelayArgs>(&args)).unwrap()
}

/// A relay for `engine` with the flags `engine_flags` then `extra`, once the engine
/// is subscribed and the router has worker 7's registration, which is returned.
pub async fn registered_with(
    cluster: &TestCluster,
    daemon: &Daemon,
    engine: &mut FakeEngine,
    engine_flags: Vec<String>,
    extra: &[&str],
) -> (Relay, WorkerRegistration) {
    let relay = Relay::start(
        config_from(cluster, engine_flags, extra),
        &prometheus::Registry::new(),
    )
    .await
    .unwrap();
    engine.wait_subscribed().await;
    wait_registered(daemon, WORKER, true).await;
    (relay, registration(daemon).unwrap())
}

pub async fn overlap(daemon: &Daemon, hashes: Vec<LocalBlockHash>, rank: u32) -> u32 {
    let scores = daemon.state().indexer.find_matches(hashes).await.unwrap();
    scores.get(WorkerRank::new(WORKER, DpRank(rank)))
}

/// The router's overlap for `hashes` on `rank` of worker 7 counting blocks held on
/// any storage tier (GPU, CPU, disk), read from the daemon's index: the route reply
/// carries the GPU overlap only.
pub async fn overlap_any_tier(daemon: &Daemon, hashes: Vec<LocalBlockHash>, rank: u32) -> u32 {
    let scores = daemon.state().indexer.find_matches(hashes).await.unwrap();
    scores.get_any_tier(WorkerRank::new(WORKER, DpRank(rank)))
}

/// Waits until the router's overlap for `hashes` on `rank` of worker 7 is `blocks`.
pub async fn wait_overlap(
    daemon: &Daemon,
    what: &str,
    hashes: &[LocalBlockHash],
    rank: u32,
    blocks: u32,
) {
    eventually(what, WAIT, || async {
        (overlap(daemon, hashes.to_vec(), rank).await == blocks).then_some(())
    })
    .await
    .unwrap();
}

/// The router's registration of worker 7.
pub fn registration(daemon: &Daemon) -> Option<WorkerRegistration> {
    let scheduler = daemon.state().scheduler();
    let mut workers = scheduler.workers();
    workers.find(|w| w.worker_id == WORKER).cloned()
}

pub async fn wait_registered(daemon: &Daemon, worker: WorkerId, registered: bool) {
    eventually("worker 7's registration", WAIT, || async {
        let known = daemon
            .state()
            .scheduler()
            .workers()
            .any(|w| w.worker_id == worker);
        (known == registered).then_some(())
    })
    .await
    .unwrap();
}

/// Waits until the relay has read the engine's replay buffer at connect, with
/// `result` (so live batches published from here on are not also in that read).
pub async fn wait_connect_replay(relay: &Relay, result: &str) {
    eventually("the replay buffer read at connect", WAIT, || async {
        (relay.counters().connect_replays(result) == 1).then_some(())
    })
    .await
    .unwrap();
}

pub fn prompt_a() -> Vec<u32> {
    (1000..1048).collect()
}

pub fn prompt_b() -> Vec<u32> {
    (1000..1032).chain(5000..5020).collect()
}
