//! End to end with Python peers, against real nats-server, etcd and the daemon:
//! - the documented frontend client `docs/examples/route_client.py` (nats-py +
//!   msgpack) asks the router for a worker and releases its booking;
//! - a vLLM-like publisher on real libzmq (`tests/python/vllm_like_publisher.py`,
//!   pyzmq) feeds `kv-router relay`, proving the pure-Rust ZMQ sockets interoperate
//!   with libzmq's PUB and ROUTER.
//!
//! The Python packages are pip-installed (pinned) into a venv under the target
//! directory once per run (deploy/ensure-deps.sh installs python3 with venv).

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

use integration_tests::{FakeWorker, TestCluster, eventually, wait_for_overlap};
use kv_events::routing::{RouteBatchReply, RouteReply};
use kv_events::{DpRank, WorkerId, WorkerRank, compute_block_hashes};
use kv_relay::{Relay, RelayArgs, RelayConfig};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::OnceCell;

const WAIT: Duration = Duration::from_secs(15);
const PACKAGES: [&str; 3] = ["nats-py==2.16.0", "msgpack==1.2.4", "pyzmq==27.3.0"];

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

/// The venv's python, created on first use.
async fn python() -> PathBuf {
    static VENV: OnceCell<PathBuf> = OnceCell::const_new();
    VENV.get_or_init(|| {
        integration_tests::python::venv(
            env!("CARGO_TARGET_TMPDIR"),
            "kv-router-python",
            &PACKAGES,
            "nats, msgpack, zmq",
        )
    })
    .await
    .clone()
}

/// Runs `docs/examples/route_client.py` against the cluster with `args`; returns the
/// JSON reply it printed, after checking it exited 0.
async fn route_client(
    python: &std::path::Path,
    cluster: &TestCluster,
    args: &[&str],
) -> serde_json::Value {
    let nats_url = cluster.nats_server.url();
    let mut all = vec!["--nats-url", &nats_url];
    all.extend(["--namespace", cluster.subjects.namespace().as_str()]);
    all.extend_from_slice(args);
    let script = repo("docs/examples/route_client.py");
    integration_tests::python::run_json(python, &script, &all).await
}

#[tokio::test]
async fn python_route_client_asks_the_router_for_a_worker() {
    let python = python().await;
    let mut cluster = TestCluster::start(16).await.unwrap();
    let _w1 = FakeWorker::register(&mut cluster, 1, 30).await.unwrap();
    let mut w2 = FakeWorker::register(&mut cluster, 2, 30).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let prompt: Vec<u32> = (1000..1048).collect();
    w2.store_prompt(&cluster, &prompt).await.unwrap();
    let hashes = compute_block_hashes(&prompt, 16);
    wait_for_overlap(&daemon, &hashes, WorkerRank::new(WorkerId(2), DpRank(0)), 3)
        .await
        .unwrap();

    let reply = route_client(
        &python,
        &cluster,
        &["--tokens", "1000-1049", "--request-id", "py-1", "--release"],
    )
    .await;
    assert_eq!(reply["status"], "routed", "{reply}");
    assert_eq!(reply["request_id"], "py-1");
    assert_eq!(reply["worker_id"], 2);
    assert_eq!(reply["overlap_blocks"], 3);
    assert_eq!(reply["request_blocks"], 4);
    // The decoded reply is the daemon's RouteReply, field for field.
    let typed: RouteReply = serde_json::from_value(reply).unwrap();
    assert!(matches!(typed, RouteReply::Routed(_)));
    // --release published prefill_done and freed: nothing stays booked.
    eventually("the booking to be released", WAIT, || async {
        (daemon.state().scheduler().active_requests() == 0).then_some(())
    })
    .await
    .unwrap();

    // --packed: the same prompt as one bin of little-endian u32s, the same answer.
    let packed = route_client(
        &python,
        &cluster,
        &[
            "--tokens",
            "1000-1049",
            "--request-id",
            "py-p",
            "--packed",
            "--release",
        ],
    )
    .await;
    assert_eq!(packed["status"], "routed", "{packed}");
    assert_eq!(
        (
            &packed["worker_id"],
            &packed["overlap_blocks"],
            &packed["request_blocks"]
        ),
        (&2.into(), &3.into(), &4.into()),
        "{packed}"
    );
    eventually(
        "the packed request's booking to be released",
        WAIT,
        || async { (daemon.state().scheduler().active_requests() == 0).then_some(()) },
    )
    .await
    .unwrap();

    // --samples 3: one RouteBatchRequest, three replies in input order.
    let reply = route_client(
        &python,
        &cluster,
        &[
            "--tokens",
            "1000-1049",
            "--request-id",
            "py-n",
            "--samples",
            "3",
        ],
    )
    .await;
    assert_eq!(reply["status"], "answered", "{reply}");
    let typed: RouteBatchReply = serde_json::from_value(reply.clone()).unwrap();
    let RouteBatchReply::Answered { replies } = typed else {
        panic!("batch refused: {reply}");
    };
    let ids: Vec<String> = replies
        .iter()
        .map(|r| match r {
            RouteReply::Routed(d) => d.request_id.to_string(),
            RouteReply::Error(e) => panic!("entry failed: {e:?}"),
        })
        .collect();
    assert_eq!(ids, ["py-n-0", "py-n-1", "py-n-2"]);
    // Without --release the three stay booked.
    assert_eq!(daemon.state().scheduler().active_requests(), 3);
    daemon.shutdown().await.unwrap();
}

#[tokio::test]
async fn relay_reads_a_libzmq_publisher_and_replay_socket() {
    let python = python().await;
    let cluster = TestCluster::start(16).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let mut engine = Command::new(&python)
        .arg(repo("tests/python/vllm_like_publisher.py"))
        .arg(repo(
            "kv-events/tests/fixtures/engines/vllm_zmq_frames_topic_kv-events.json",
        ))
        .arg("kv-events")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(engine.stdout.take().unwrap()).lines();
    let endpoints: serde_json::Value =
        serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
    let args: RelayArgs = cluster.flags(&[
        "--engine-endpoint",
        endpoints["pub"].as_str().unwrap(),
        "--replay-endpoint",
        endpoints["replay"].as_str().unwrap(),
        "--topic",
        "kv-events",
        "--worker-id",
        "7",
        "--worker-name",
        "relay-7",
        "--dp-size",
        "4",
        "--shared-endpoint",
    ]);
    let registry = prometheus::Registry::new();
    let relay = Relay::start(RelayConfig::from_args(&args).unwrap(), &registry)
        .await
        .unwrap();
    assert_eq!(
        lines.next_line().await.unwrap().as_deref(),
        Some("published")
    );

    let b: Vec<u32> = (1000..1032).chain(5000..5020).collect();
    let hashes = compute_block_hashes(&b, 16);
    wait_for_overlap(&daemon, &hashes, WorkerRank::new(WorkerId(7), DpRank(0)), 3)
        .await
        .unwrap();
    // The relay reads libzmq's ROUTER as soon as its socket connects, before any live
    // batch: the buffer holds batches 0-3 (2 was never sent live), so all four come
    // from the replay socket and the live 0, 1 and 3 are duplicates. The counters are
    // bumped after the events are published, so wait for them too.
    let c = relay.counters();
    eventually("the relay to count the replayed batches", WAIT, || async {
        (c.frames("ok") >= 4 && c.frames("duplicate") >= 3).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(
        c.connect_replays("complete"),
        1,
        "batch 2 came from libzmq's ROUTER"
    );
    assert_eq!((c.frames("ok"), c.frames("duplicate")), (4, 3));
    assert_eq!(
        c.gaps("filled") + c.gaps("cleared"),
        0,
        "no gap left to fill"
    );

    drop(engine.stdin.take());
    engine.wait().await.unwrap();
    relay.shutdown().await.unwrap();
    daemon.shutdown().await.unwrap();
}
