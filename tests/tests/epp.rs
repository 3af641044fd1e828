//! End to end through the endpoint picker (`kv-router epp`): a client built from
//! Envoy's own API definitions plays the proxy's part of the ext_proc exchange
//! against the picker, in front of the real router daemon, over real nats-server and
//! etcd. Workers are registered with pod addresses that nothing listens on: the
//! picker never forwards, the proxy would.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

#[path = "epp/buffered.rs"]
mod buffered;
#[path = "epp/envoy.rs"]
mod envoy;
#[path = "epp/fallbacks.rs"]
mod fallbacks;
#[path = "gateway/fixture.rs"]
#[allow(dead_code)]
mod fixture;

use envoy::{Envoy, Mode, Picked};
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
        self.open_in(Mode::FullDuplex, body, 3, subset).await
    }

    /// A stream in body mode `mode` sending `body` in `chunks` chunks, and the pick.
    async fn open_in(
        &self,
        mode: Mode,
        body: &serde_json::Value,
        chunks: usize,
        subset: Option<&[String]>,
    ) -> (Envoy, Picked) {
        let addr = self.epp.grpc_addr();
        let mut envoy = Envoy::open(addr, mode, "/v1/completions", subset).await;
        envoy.body(body.to_string().as_bytes(), chunks).await;
        let picked = envoy.picked().await;
        (envoy, picked)
    }

    /// [`Self::open_in`] for a request continuing the prefix worker 2 holds: the pick
    /// names its pod, the body reaches upstream unchanged, and the pick holds one
    /// booking.
    async fn open_on_the_prefix_pod(
        &self,
        mode: Mode,
        body: &serde_json::Value,
        chunks: usize,
    ) -> Envoy {
        let (envoy, picked) = self.open_in(mode, body, chunks, None).await;
        assert_eq!(endpoint(&picked), pod(2));
        let Picked::Endpoint { body: upstream, .. } = &picked else {
            unreachable!()
        };
        assert_eq!(
            upstream,
            &body.to_string().into_bytes(),
            "the body passes unchanged"
        );
        assert_eq!(self.booked(), 1, "the pick holds a booking");
        envoy
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
    three_workers_holding_the_prefix_with(&[]).await
}

/// [`three_workers_the_second_holding_the_prefix`], the picker started with `flags`.
async fn three_workers_holding_the_prefix_with(flags: &[&str]) -> (EppStack, serde_json::Value) {
    let mut stack = EppStack::start(3, |_| {}, flags).await;
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

/// `STREAMED` with the body sent without waiting for the headers' answer: the pick
/// sees the whole prompt (both requests continuing the held prefix land on its pod),
/// each of the five chunks gets its own answer and reaches upstream unchanged, the
/// response chunks pass with empty answers, and every booking is freed.
#[tokio::test]
async fn streamed_mode_picks_on_the_prefix_and_answers_chunk_by_chunk() {
    let (stack, body) = three_workers_the_second_holding_the_prefix().await;
    for _ in 0..2 {
        let mut envoy = stack.open_on_the_prefix_pod(Mode::Streamed, &body, 5).await;
        envoy.response_headers(&pod(2)).await;
        envoy.response_chunk(b"data: {}\n\n", false).await;
        envoy.response_chunk(b"data: [DONE]\n\n", true).await;
        stack.no_booking_left().await;
    }
    stack.stop().await;
}

/// `STREAMED`: a small body is picked, an oversized one is 413, one stalled mid-body
/// is 408 after the configured 300 ms, and a stream aborted mid-response frees its
/// booking. `STREAMED` without sending the body early cannot be picked on: 500 at once.
#[tokio::test]
async fn streamed_mode_bounds_the_body_and_frees_aborted_streams() {
    let flags = ["--max-body-bytes", "1024", "--body-timeout-ms", "300"];
    let stack = EppStack::start(1, |_| {}, &flags).await;
    let addr = stack.epp.grpc_addr();
    let (mut envoy, picked) = stack
        .open_in(Mode::Streamed, &completion(&[1, 2, 3]), 2, None)
        .await;
    assert_eq!(endpoint(&picked), pod(1));
    envoy.response_headers(&pod(1)).await;
    envoy.response_chunk(b"data: {}\n\n", false).await;
    assert_eq!(stack.booked(), 1);
    // The client goes away mid-answer: the proxy cancels the stream.
    drop(envoy);
    stack.no_booking_left().await;

    let big = completion(&(0..400).collect::<Vec<u32>>());
    let (_big, picked) = stack.open_in(Mode::Streamed, &big, 4, None).await;
    assert!(
        matches!(picked, Picked::Refused { status: 413, .. }),
        "{picked:?}"
    );

    let mut stalled = Envoy::open(addr, Mode::Streamed, "/v1/completions", None).await;
    assert!(stalled.chunk(br#"{"model": "#, false).await);
    let picked = stalled.picked().await;
    assert!(
        matches!(picked, Picked::Refused { status: 408, .. }),
        "{picked:?}"
    );

    let mut waiting = Envoy::open(addr, Mode::StreamedWaiting, "/v1/completions", None).await;
    match waiting.picked().await {
        Picked::Refused { status, body } => {
            assert_eq!(status, 500, "{body}");
            assert!(body.contains("send_body_without_waiting"), "{body}");
        }
        other => panic!("a body the pick cannot see is refused: {other:?}"),
    }
    assert_eq!(stack.booked(), 0);
    stack.stop().await;
}

/// The same exchange from Python, with Envoy's message types from PyPI `xds-protos`
/// over `grpcio`: a full exchange inside the subset hint and an abandoned stream; no
/// booking is left after either.
#[tokio::test]
async fn envoys_own_python_types_drive_the_picker() {
    let (stack, body) = three_workers_the_second_holding_the_prefix().await;
    let seen = python_drives(&stack, &body, "full_duplex").await;
    assert!(seen.get("oversized").is_none(), "{seen}");
    stack.stop().await;
}

/// The Python client in `STREAMED` mode: both streams as above with each chunk
/// answered on its own, a body four times over `--max-body-bytes` is 413 and one
/// stalled after its first chunk is 408 after the configured 300 ms.
#[tokio::test]
async fn envoys_own_python_types_drive_the_picker_in_streamed_mode() {
    // The request body is about 850 bytes: four times over is past 1500.
    let flags = ["--max-body-bytes", "1500", "--body-timeout-ms", "300"];
    let (stack, body) = three_workers_holding_the_prefix_with(&flags).await;
    let seen = python_drives(&stack, &body, "streamed").await;
    assert_eq!(seen["oversized"]["status"], 413, "{seen}");
    assert_eq!(seen["stalled"]["status"], 408, "{seen}");
    stack.stop().await;
}

/// Runs `python/epp_client.py` in body mode `mode` against `stack` with `body` and
/// the subset {pod 1, pod 3}; checks both picked streams and that no booking is left.
async fn python_drives(
    stack: &EppStack,
    body: &serde_json::Value,
    mode: &str,
) -> serde_json::Value {
    let python = integration_tests::python::venv(
        env!("CARGO_TARGET_TMPDIR"),
        "kv-router-xds",
        &["xds-protos==1.85.0", "grpcio==1.85.3"],
        "grpc, envoy.service.ext_proc.v3.external_processor_pb2",
    )
    .await;
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/epp_client.py");
    let addr = stack.epp.grpc_addr().to_string();
    let subset = format!("{},{}", pod(1), pod(3));
    let args = [addr.as_str(), &body.to_string(), &subset, mode];
    let seen = integration_tests::python::run_json(&python, &script, &args).await;
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
    seen
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
