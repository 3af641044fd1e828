//! Worker id claims (issue 16, "operators must not hand-allocate numbers") against a
//! real etcd: `kv_cluster::claim` on its own, and `kv-router relay` started without
//! `--worker-id`. Two relays must never publish under one id.

// The relay tests' fake engine unwraps, as do these tests: a broken fixture, socket or
// refusal must fail the test loudly.
#![allow(clippy::unwrap_used)]

#[path = "relay/engine.rs"]
#[allow(dead_code)]
mod engine;

use engine::{FakeEngine, ReplayFraming};
use etcd_client::{Client as Etcd, PutOptions};
use integration_tests::{TestCluster, eventually};
use kv_cluster::claim::{ClaimHolder, ClaimRequest, WorkerIdClaim, WorkerName, derived_worker_id};
use kv_events::WorkerId;
use kv_events::discovery::WorkerRegistration;
use kv_relay::{Relay, RelayArgs, RelayConfig};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(15);

fn request(name: &str, worker_id: Option<u64>) -> ClaimRequest {
    ClaimRequest {
        name: WorkerName::new(name).unwrap(),
        worker_id: worker_id.map(WorkerId),
        ttl_secs: 3,
    }
}

/// The claim key's holder name and lease, or `None` when the key is absent.
async fn holder(cluster: &TestCluster, id: WorkerId) -> Option<(String, i64)> {
    let mut etcd = cluster.etcd.clone();
    let resp = etcd
        .get(cluster.subjects.etcd_worker_id_key(id), None)
        .await
        .unwrap();
    resp.kvs().first().map(|kv| {
        let holder: ClaimHolder = serde_json::from_slice(kv.value()).unwrap();
        (holder.name, kv.lease())
    })
}

/// Writes a claim as another process would, without a lease.
async fn put_claim(cluster: &TestCluster, id: WorkerId, name: &str) {
    let value = serde_json::json!({"name": name, "host": "node-9", "pid": 4242}).to_string();
    let mut etcd = cluster.etcd.clone();
    etcd.put(cluster.subjects.etcd_worker_id_key(id), value, None)
        .await
        .unwrap();
}

async fn acquire(cluster: &TestCluster, request: &ClaimRequest) -> Result<WorkerIdClaim, String> {
    WorkerIdClaim::acquire(cluster.etcd.clone(), &cluster.subjects, request)
        .await
        .map_err(|e| e.to_string())
}

async fn lease_count(etcd: &mut Etcd) -> usize {
    etcd.leases().await.unwrap().leases().len()
}

/// A name's id is derived from the name alone, and comes back after a release.
#[tokio::test]
async fn a_name_gets_the_same_derived_id_again() {
    let cluster = TestCluster::start(16).await.unwrap();
    let req = request("engine-0", None);
    let claim = acquire(&cluster, &req).await.unwrap();
    let id = claim.worker_id();
    assert_eq!(id, derived_worker_id(&req.name, 0));
    assert!(id.0 < 1 << 53, "{id}");
    let (name, lease) = holder(&cluster, id).await.expect("claimed");
    assert_eq!(name, "engine-0");
    assert_ne!(lease, 0, "the claim is bound to a lease");
    let stop = CancellationToken::new();
    let keeper = tokio::spawn(claim.keep_until(stop.clone()));
    stop.cancel();
    keeper.await.unwrap();
    assert_eq!(holder(&cluster, id).await, None, "released at once");
    let again = acquire(&cluster, &req).await.unwrap();
    assert_eq!(again.worker_id(), id);
}

/// The same name held by a live claim (a previous incarnation whose lease has not
/// expired): the second claimant waits, and gets the same id only after the first
/// releases it.
#[tokio::test]
async fn the_same_name_waits_for_its_previous_incarnation() {
    let cluster = TestCluster::start(16).await.unwrap();
    let mut etcd = cluster.etcd.clone();
    let req = request("engine-1", None);
    let first = acquire(&cluster, &req).await.unwrap();
    let id = first.worker_id();
    let (_, first_lease) = holder(&cluster, id).await.unwrap();
    let stop_first = CancellationToken::new();
    let first_keeper = tokio::spawn(first.keep_until(stop_first.clone()));

    let leases_before = lease_count(&mut etcd).await;
    let second = {
        let (etcd, subjects, req) = (cluster.etcd.clone(), cluster.subjects.clone(), req.clone());
        tokio::spawn(async move { WorkerIdClaim::acquire(etcd, &subjects, &req).await })
    };
    // The second claimant has its lease (granted before its transaction) ...
    eventually("the second claimant's lease", WAIT, || {
        let mut etcd = etcd.clone();
        async move { (lease_count(&mut etcd).await > leases_before).then_some(()) }
    })
    .await
    .unwrap();
    // ... and, over more than a renewal period of the first, neither took the key nor
    // gave up.
    tokio::time::timeout(Duration::from_millis(1500), async {
        while !second.is_finished() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect_err("the second claimant must wait while the first holds the id");
    assert_eq!(holder(&cluster, id).await.unwrap().1, first_lease);

    stop_first.cancel();
    first_keeper.await.unwrap();
    let second = tokio::time::timeout(WAIT, second)
        .await
        .expect("the second claimant gets the id once it is released")
        .unwrap()
        .unwrap();
    assert_eq!(second.worker_id(), id, "the id is stable across restarts");
    let (name, lease) = holder(&cluster, id).await.unwrap();
    assert_eq!(name, "engine-1");
    assert_ne!(lease, first_lease);
}

/// Another name already holding a name's derived id (a hash collision, forced here):
/// the claimant probes the next candidate and leaves the other's key alone.
#[tokio::test]
async fn a_collision_with_another_name_probes_the_next_id() {
    let cluster = TestCluster::start(16).await.unwrap();
    let req = request("engine-2", None);
    let taken = derived_worker_id(&req.name, 0);
    put_claim(&cluster, taken, "someone-else").await;
    let claim = acquire(&cluster, &req).await.unwrap();
    assert_eq!(claim.worker_id(), derived_worker_id(&req.name, 1));
    assert_eq!(holder(&cluster, taken).await.unwrap().0, "someone-else");
    assert_eq!(
        holder(&cluster, claim.worker_id()).await.unwrap().0,
        "engine-2"
    );
}

/// An explicit `--worker-id` held by another name stops the relay at start, naming
/// the id and the holder; the refused claimant leaves no lease behind.
#[tokio::test]
async fn an_explicit_id_held_by_another_name_is_a_start_up_error() {
    let cluster = TestCluster::start(16).await.unwrap();
    let mut etcd = cluster.etcd.clone();
    put_claim(&cluster, WorkerId(42), "engine-x").await;
    let leases_before = lease_count(&mut etcd).await;
    let err = acquire(&cluster, &request("engine-y", Some(42)))
        .await
        .err()
        .expect("refused");
    assert!(
        err.contains("worker id 42") && err.contains("\"engine-x\"") && err.contains("node-9"),
        "{err}"
    );
    assert_eq!(lease_count(&mut etcd).await, leases_before);

    let engine = FakeEngine::start("kv-events", ReplayFraming::WithTopic).await;
    let config = relay_config(
        &cluster,
        &engine,
        &["--worker-id", "42", "--worker-name", "engine-y"],
    );
    let Err(err) = Relay::start(config, &prometheus::Registry::new()).await else {
        panic!("the relay started with a held worker id")
    };
    let err = err.to_string();
    assert!(
        err.contains("claiming the worker id") && err.contains("42") && err.contains("engine-x"),
        "{err}"
    );
}

/// The relay flags of `engine` without its fixed worker id, plus `extra`.
fn relay_config(cluster: &TestCluster, engine: &FakeEngine, extra: &[&str]) -> RelayConfig {
    let mut flags = engine.relay_flags();
    let at = flags.iter().position(|f| f == "--worker-id").unwrap();
    flags.drain(at..at + 4); // --worker-id 7 --worker-name relay-7
    flags.extend(["--lease-ttl-secs", "3"].map(str::to_owned));
    flags.extend(extra.iter().map(|f| (*f).to_owned()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    RelayConfig::from_args(&cluster.flags::<RelayArgs>(&flags)).unwrap()
}

async fn registration(cluster: &TestCluster, id: WorkerId) -> Option<WorkerRegistration> {
    let mut etcd = cluster.etcd.clone();
    let resp = etcd
        .get(cluster.subjects.etcd_worker_key(id), None)
        .await
        .unwrap();
    resp.kvs()
        .first()
        .map(|kv| serde_json::from_slice(kv.value()).unwrap())
}

/// Two relays without `--worker-id`, named differently, register distinct ids: each
/// its name's derived id.
#[tokio::test]
async fn relays_without_worker_ids_register_distinct_derived_ids() {
    let cluster = TestCluster::start(16).await.unwrap();
    let mut engines = Vec::new();
    let mut relays = Vec::new();
    for name in ["engine-a", "engine-b"] {
        let mut engine = FakeEngine::start("kv-events", ReplayFraming::WithTopic).await;
        let config = relay_config(&cluster, &engine, &["--worker-name", name]);
        let relay = Relay::start(config, &prometheus::Registry::new())
            .await
            .unwrap();
        engine.wait_subscribed().await;
        let expected = derived_worker_id(&WorkerName::new(name).unwrap(), 0);
        assert_eq!(relay.worker_id(), expected);
        engines.push(engine);
        relays.push(relay);
    }
    let (a, b) = (relays[0].worker_id(), relays[1].worker_id());
    assert_ne!(a, b);
    for id in [a, b] {
        let registered = eventually("both registrations", WAIT, || registration(&cluster, id))
            .await
            .unwrap();
        assert_eq!(registered.worker_id, id);
    }
    for relay in relays {
        relay.shutdown().await.unwrap();
    }
    for id in [a, b] {
        assert_eq!(registration(&cluster, id).await, None);
        assert_eq!(
            holder(&cluster, id).await,
            None,
            "claims released at shutdown"
        );
    }
}

/// The claim lease is lost (revoked from outside) and another name holds the key by
/// the time the relay renews: the loss fires, the relay stops in order, and `run`
/// returns the error. (The other holder's put comes first and detaches the key from
/// the relay's lease, so the relay cannot re-take the key between the two steps.)
#[tokio::test]
async fn a_lost_claim_stops_the_relay() {
    let cluster = TestCluster::start(16).await.unwrap();
    let mut engine = FakeEngine::start("kv-events", ReplayFraming::WithTopic).await;
    let config = relay_config(&cluster, &engine, &["--worker-name", "engine-c"]);
    let id = derived_worker_id(&WorkerName::new("engine-c").unwrap(), 0);
    let relay = tokio::spawn(async move {
        kv_relay::run(config, &prometheus::Registry::new(), std::future::pending()).await
    });
    engine.wait_subscribed().await;
    eventually("the relay's registration", WAIT, || {
        registration(&cluster, id)
    })
    .await
    .unwrap();
    let (_, relay_lease) = holder(&cluster, id).await.unwrap();

    let mut etcd = cluster.etcd.clone();
    let usurper = etcd.lease_grant(30, None).await.unwrap().id();
    let value = serde_json::json!({"name": "usurper"}).to_string();
    etcd.put(
        cluster.subjects.etcd_worker_id_key(id),
        value,
        Some(PutOptions::new().with_lease(usurper)),
    )
    .await
    .unwrap();
    etcd.lease_revoke(relay_lease).await.unwrap();

    let stopped = tokio::time::timeout(WAIT, relay)
        .await
        .expect("the relay stops after losing its worker id")
        .unwrap();
    let err = stopped.expect_err("run reports the loss").to_string();
    assert!(err.contains(&format!("worker id {id}")), "{err}");
    assert_eq!(holder(&cluster, id).await.unwrap().0, "usurper");
    assert_eq!(
        registration(&cluster, id).await,
        None,
        "the registration is revoked"
    );
}
