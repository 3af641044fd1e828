//! End to end through the endpoint picker (`kv-router epp`): a client built from
//! Envoy's own API definitions plays the proxy's part of the ext_proc exchange
//! against the picker, in front of the real router daemon, over real nats-server and
//! etcd. Workers are registered with pod addresses that nothing listens on: the
//! picker never forwards, the proxy would.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

#[path = "epp/envoy.rs"]
mod envoy;
#[path = "gateway/fixture.rs"]
#[allow(dead_code)]
mod fixture;

use envoy::{Envoy, Picked};
use fixture::{BLOCK, MODEL, model_dir, registration};
use integration_tests::{FakeWorker, TestCluster, eventually, register_worker};
use kv_epp::Epp;
use kv_events::{DpRank, WorkerId, WorkerRank, compute_block_hashes};
use router_daemon::{Daemon, ServeArgs};
use serde_json::json;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(15);

/// The pod address of worker `n`.
fn pod(n: u64) -> String {
    format!("127.0.0.{n}:8000")
}

struct EppStack {
    cluster: TestCluster,
    daemon: Daemon,
    epp: Epp,
    workers: Vec<FakeWorker>,
}

impl EppStack {
    /// A daemon adjusted by `adjust`, `workers` registered workers (ids 1..,
    /// pods [`pod`]) and a picker with `flags`, all known to each other.
    async fn start(workers: u64, adjust: impl FnOnce(&mut ServeArgs), flags: &[&str]) -> Self {
        let mut cluster = TestCluster::start(BLOCK).await.expect("servers start");
        let daemon = cluster.start_daemon(adjust).await.expect("daemon starts");
        let mut fakes = Vec::new();
        for n in 1..=workers {
            let registration = registration(WorkerId(n), format!("http://{}", pod(n)));
            let lease = register_worker(&mut cluster.etcd, &cluster.subjects, &registration, 30)
                .await
                .unwrap();
            fakes.push(FakeWorker::publisher(WorkerId(n), lease));
        }
        let dir = model_dir().display().to_string();
        let mut all = vec!["--max-prompt-tokens", "8000"];
        all.extend_from_slice(flags);
        let epp = cluster
            .start_epp(MODEL, &dir, &all)
            .await
            .expect("the picker starts");
        let stack = Self {
            cluster,
            daemon,
            epp,
            workers: fakes,
        };
        eventually(
            "the router and the picker to know the workers",
            WAIT,
            || async {
                let router = stack.daemon.state().scheduler().workers().len();
                let picker = stack.epp.workers().len();
                (router == workers as usize && picker == workers as usize).then_some(())
            },
        )
        .await
        .unwrap();
        stack
    }

    fn booked(&self) -> usize {
        self.daemon.state().scheduler().active_requests()
    }

    async fn metrics(&self) -> String {
        let url = format!("http://{}/metrics", self.epp.metrics_addr());
        let client = kv_cluster::http::client().unwrap();
        client.get(url).send().await.unwrap().text().await.unwrap()
    }

    /// Worker `n` holds the KV blocks of `tokens`.
    async fn hold(&mut self, n: u64, tokens: &[u32]) {
        let worker = &mut self.workers[n as usize - 1];
        worker.store_prompt(&self.cluster, tokens).await.unwrap();
        integration_tests::wait_for_overlap(
            &self.daemon,
            &compute_block_hashes(tokens, BLOCK),
            WorkerRank::new(WorkerId(n), DpRank(0)),
            tokens.len() as u32 / BLOCK,
        )
        .await
        .unwrap();
    }

    async fn open(&self, body: &serde_json::Value, subset: Option<&[String]>) -> (Envoy, Picked) {
        let mut envoy = Envoy::open(self.epp.grpc_addr(), "/v1/completions", subset).await;
        envoy.body(body.to_string().as_bytes(), 3).await;
        let picked = envoy.picked().await;
        (envoy, picked)
    }

    async fn no_booking_left(&self) {
        eventually("every booking to be freed", WAIT, || async {
            (self.booked() == 0).then_some(())
        })
        .await
        .unwrap();
    }

    async fn stop(self) {
        self.epp.shutdown().await;
        self.daemon.shutdown().await.unwrap();
    }
}

fn completion(tokens: &[u32]) -> serde_json::Value {
    json!({"model": MODEL, "prompt": tokens, "max_tokens": 8, "stream": true})
}

fn long_prefix() -> Vec<u32> {
    (1000..1000 + 8 * BLOCK).collect()
}

/// The endpoints named, primary first: the header and the metadata carry the same
/// comma-separated list.
fn endpoints(picked: &Picked) -> Vec<&str> {
    match picked {
        Picked::Endpoint {
            header, metadata, ..
        } => {
            assert_eq!(header, metadata, "header and metadata name the same list");
            header.split(',').collect()
        }
        Picked::Refused { status, body } => panic!("refused {status}: {body}"),
    }
}

/// The primary endpoint.
fn endpoint(picked: &Picked) -> &str {
    endpoints(picked)[0]
}

/// Three workers; worker 2 holds a long prefix; a request continuing it.
async fn three_workers_the_second_holding_the_prefix() -> (EppStack, serde_json::Value) {
    let mut stack = EppStack::start(3, |_| {}, &[]).await;
    let prefix = long_prefix();
    stack.hold(2, &prefix).await;
    (stack, completion(&integration_tests::continued(&prefix)))
}

#[tokio::test]
async fn the_pod_holding_the_prefix_is_picked_and_freed_at_the_end() {
    let (stack, body) = three_workers_the_second_holding_the_prefix().await;
    let (mut envoy, picked) = stack.open(&body, None).await;
    assert_eq!(endpoint(&picked), pod(2));
    let Picked::Endpoint {
        body: echoed,
        dp_rank,
        ..
    } = &picked
    else {
        unreachable!()
    };
    assert_eq!(
        echoed,
        &body.to_string().into_bytes(),
        "the body passes on whole"
    );
    assert_eq!(dp_rank, &None, "rank 0 needs no header");
    assert_eq!(stack.booked(), 1, "the pick holds a booking");
    envoy.response_headers(&pod(2)).await;
    envoy.response_chunk(b"data: {}\n\n", false).await;
    envoy.response_chunk(b"data: [DONE]\n\n", true).await;
    stack.no_booking_left().await;
    assert_eq!(
        stack.epp.metrics().picks("picked"),
        1,
        "{}",
        stack.metrics().await
    );
    stack.stop().await;
}

#[tokio::test]
async fn the_subset_hint_is_honoured_and_an_empty_one_is_503() {
    let (stack, body) = three_workers_the_second_holding_the_prefix().await;
    let subset = [pod(1), pod(3)];
    for _ in 0..4 {
        let (envoy, picked) = stack.open(&body, Some(&subset)).await;
        let chosen = endpoint(&picked).to_owned();
        assert!(subset.contains(&chosen), "{chosen} is in the subset");
        drop(envoy);
    }
    let (_envoy, picked) = stack.open(&body, Some(&["10.9.9.9:8000".to_owned()])).await;
    match picked {
        Picked::Refused { status, .. } => assert_eq!(status, 503),
        other => panic!("no eligible endpoint is 503: {other:?}"),
    }
    stack.no_booking_left().await;
    stack.stop().await;
}

#[tokio::test]
async fn an_aborted_stream_frees_its_booking() {
    let stack = EppStack::start(2, |_| {}, &[]).await;
    let (mut envoy, picked) = stack.open(&completion(&long_prefix()), None).await;
    let chosen = endpoint(&picked).to_owned();
    envoy.response_headers(&chosen).await;
    envoy.response_chunk(b"data: {}\n\n", false).await;
    assert_eq!(stack.booked(), 1);
    // The client goes away mid-answer: the proxy cancels the stream.
    drop(envoy);
    stack.no_booking_left().await;
    stack.stop().await;
}

#[tokio::test]
async fn a_shedding_router_is_429() {
    // One block of decode load makes a rank busy, and nothing may wait in the queue.
    let stack = EppStack::start(
        1,
        |args| {
            args.scheduling.scheduler.busy_decode_blocks = Some("1".parse().unwrap());
            args.scheduling.queue_capacity = 0;
        },
        &[],
    )
    .await;
    let (mut held, picked) = stack.open(&completion(&long_prefix()), None).await;
    assert_eq!(endpoint(&picked), pod(1));
    held.response_headers(&pod(1)).await;
    held.response_chunk(b"data: {}\n\n", false).await;
    let (_shed, picked) = stack.open(&completion(&[1, 2, 3]), None).await;
    match picked {
        Picked::Refused { status, body } => {
            assert_eq!(status, 429, "{body}");
            assert!(body.contains("rate_limit_error"), "{body}");
        }
        other => panic!("a shedding router is 429: {other:?}"),
    }
    drop(held);
    stack.no_booking_left().await;
    stack.stop().await;
}

#[tokio::test]
async fn bad_and_oversized_bodies_are_refused_before_routing() {
    let stack = EppStack::start(1, |_| {}, &["--max-body-bytes", "512"]).await;
    let big = completion(&(0..400).collect::<Vec<u32>>());
    let (_big, picked) = stack.open(&big, None).await;
    assert!(
        matches!(picked, Picked::Refused { status: 413, .. }),
        "{picked:?}"
    );
    let other_model = json!({"model": "other", "prompt": [1, 2, 3]});
    let (_other, picked) = stack.open(&other_model, None).await;
    assert!(
        matches!(picked, Picked::Refused { status: 404, .. }),
        "{picked:?}"
    );
    assert_eq!(stack.booked(), 0);
    stack.stop().await;
}

/// The same exchange from Python, with Envoy's message types from PyPI `xds-protos`
/// over `grpcio`: a full exchange inside the subset hint and an abandoned stream; no
/// booking is left after either.
#[tokio::test]
async fn envoys_own_python_types_drive_the_picker() {
    let python = integration_tests::python::venv(
        env!("CARGO_TARGET_TMPDIR"),
        "kv-router-xds",
        &["xds-protos==1.85.0", "grpcio==1.85.3"],
        "grpc, envoy.service.ext_proc.v3.external_processor_pb2",
    )
    .await;
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/epp_client.py");
    let (stack, body) = three_workers_the_second_holding_the_prefix().await;
    let addr = stack.epp.grpc_addr().to_string();
    let subset = format!("{},{}", pod(1), pod(3));
    let seen =
        integration_tests::python::run_json(&python, &script, &[&addr, &body.to_string(), &subset])
            .await;
    for stream in ["full", "aborted"] {
        let picked = &seen[stream];
        let list = picked["header"]
            .as_str()
            .unwrap_or_else(|| panic!("{seen}"));
        assert_eq!(picked["metadata"], list, "{seen}");
        // Both pods of the subset: the pick, then the other as its fallback.
        let mut named: Vec<&str> = list.split(',').collect();
        named.sort_unstable();
        assert_eq!(named, [pod(1), pod(3)], "{seen}");
        assert_eq!(picked["clear_route_cache"], true, "{seen}");
        assert_eq!(picked["body_echoed"], true, "{seen}");
        assert_eq!(picked["passed_through"], true, "{seen}");
    }
    stack.no_booking_left().await;
    assert_eq!(stack.epp.metrics().picks("picked"), 2);
    stack.stop().await;
}

/// gRPC health as kubelet and the proxy ask it: liveness always; readiness and the
/// ext_proc service name only with workers known and a router answering; an unknown
/// service name is refused. With no worker, a request is 503.
#[tokio::test]
async fn grpc_health_and_503_without_workers() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    async fn status(stack: &EppStack, service: &str) -> Result<ServingStatus, tonic::Code> {
        let url = format!("http://{}", stack.epp.grpc_addr());
        let channel = tonic::transport::Channel::from_shared(url).unwrap();
        let mut client = HealthClient::new(channel.connect().await.unwrap());
        let request = HealthCheckRequest {
            service: service.into(),
        };
        match client.check(request).await {
            Ok(answer) => Ok(answer.into_inner().status()),
            Err(status) => Err(status.code()),
        }
    }
    const EXT_PROC: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
    let empty = EppStack::start(0, |_| {}, &[]).await;
    assert_eq!(status(&empty, "liveness").await, Ok(ServingStatus::Serving));
    for service in ["readiness", EXT_PROC] {
        let answer = status(&empty, service).await;
        assert_eq!(answer, Ok(ServingStatus::NotServing), "{service}");
    }
    // Nothing registered: no endpoint is ready.
    let (_envoy, picked) = empty.open(&completion(&[1, 2, 3]), None).await;
    assert!(
        matches!(picked, Picked::Refused { status: 503, .. }),
        "{picked:?}"
    );
    empty.stop().await;
    let stack = EppStack::start(1, |_| {}, &[]).await;
    for service in ["liveness", "readiness", EXT_PROC, ""] {
        let answer = status(&stack, service).await;
        assert_eq!(answer, Ok(ServingStatus::Serving), "{service:?}");
    }
    assert_eq!(status(&stack, "other").await, Err(tonic::Code::NotFound));
    stack.stop().await;
}

/// The router's booked requests on worker `n` (rank 0).
fn booked_on(stack: &EppStack, n: u64) -> usize {
    let rank = WorkerRank::new(WorkerId(n), DpRank(0));
    stack
        .daemon
        .state()
        .scheduler()
        .rank_load(rank)
        .active_requests
}

#[tokio::test]
async fn fallbacks_name_the_next_cheapest_pods_after_the_pick() {
    let (mut stack, body) = three_workers_the_second_holding_the_prefix().await;
    // Worker 3 holds half of the prefix: the cheapest alternate; worker 1 nothing.
    let prefix = long_prefix();
    stack.hold(3, &prefix[..prefix.len() / 2]).await;
    let (envoy, picked) = stack.open(&body, None).await;
    assert_eq!(endpoints(&picked), [pod(2), pod(3), pod(1)]);
    assert_eq!(stack.booked(), 1, "only the primary is booked");
    assert_eq!(booked_on(&stack, 2), 1);
    drop(envoy);
    stack.no_booking_left().await;
    stack.stop().await;
    // `--fallbacks 0` names one endpoint.
    let single = EppStack::start(2, |_| {}, &["--fallbacks", "0"]).await;
    let (_envoy, picked) = single.open(&completion(&long_prefix()), None).await;
    assert_eq!(endpoints(&picked).len(), 1, "{picked:?}");
    single.stop().await;
}

/// A subset leaving out more workers than a route query may exclude (64) is the
/// query's eligible set: the pick and its fallbacks stay inside it, even when a pod
/// outside holds the prompt.
#[tokio::test]
async fn a_subset_leaving_out_many_pods_is_honoured() {
    let mut stack = EppStack::start(100, |_| {}, &[]).await;
    let prefix = long_prefix();
    stack.hold(90, &prefix).await;
    let body = completion(&integration_tests::continued(&prefix));
    let (outside, picked) = stack.open(&body, None).await;
    assert_eq!(
        endpoint(&picked),
        pod(90),
        "without a subset the holder wins"
    );
    let subset: Vec<String> = (1..=30).map(pod).collect();
    let (envoy, picked) = stack.open(&body, Some(&subset)).await;
    let named = endpoints(&picked);
    assert_eq!(named.len(), 3, "{named:?}");
    for endpoint in &named {
        assert!(
            subset.iter().any(|p| p == endpoint),
            "{endpoint} is in the subset"
        );
    }
    drop(envoy);
    drop(outside);
    stack.no_booking_left().await;
    stack.stop().await;
}

/// The proxy retried down the list and reports (in the `envoy.lb` metadata, as the
/// protocol describes) that another pod served: the booking moves there while the
/// response streams, and is freed there at the end.
#[tokio::test]
async fn the_booking_moves_to_the_pod_the_proxy_served() {
    let (stack, body) = three_workers_the_second_holding_the_prefix().await;
    let (mut envoy, picked) = stack.open(&body, None).await;
    assert_eq!(endpoint(&picked), pod(2));
    // Worker 3's pod answered (whether the proxy took it from the list or not).
    let moved_to = 3;
    envoy.response_headers_served(&pod(moved_to), true).await;
    envoy.response_chunk(b"data: {}\n\n", false).await;
    eventually("the booking to move to the served worker", WAIT, || async {
        (booked_on(&stack, moved_to) == 1 && booked_on(&stack, 2) == 0).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(stack.booked(), 1, "moved, not copied");
    assert_eq!(stack.epp.metrics().rebooks("moved"), 1);
    let text = stack.metrics().await;
    assert!(
        text.contains("kv_epp_served_total{served=\"mismatch\"} 1"),
        "{text}"
    );
    envoy.response_chunk(b"data: [DONE]\n\n", true).await;
    stack.no_booking_left().await;
    stack.stop().await;
}
