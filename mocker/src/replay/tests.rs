//! Replay tests against a real nats-server and etcd, with a scripted router and
//! engine standing in for `kv-router` and the mock engines.

use super::*;
use crate::protocol::{ClearReply, GenerateRequest, GenerateResponse, OP_CLEAR, OP_GENERATE};
use futures::StreamExt;
use kv_events::discovery::WorkerRegistration;
use kv_events::routing::{
    LifecycleEvent, LifecycleMessage, Prompt, RouteDecision, RouteError, RouteErrorCode,
    RouteReply, RouteRequest,
};
use kv_events::{DpRank, decode, encode};
use std::sync::atomic::{AtomicU32, Ordering};
use testbed::{EtcdServer, NatsServer};
use tokio::sync::mpsc;

#[test]
fn time_scale_converts_between_model_and_wall_time() {
    let scale = TimeScale::new(4.0).unwrap();
    assert_eq!(scale.to_wall(1000), Duration::from_millis(250));
    assert_eq!(scale.to_model_ms(Duration::from_millis(250)), 1000.0);
    assert!(TimeScale::new(0.0).is_err());
    assert!(TimeScale::new(f64::INFINITY).is_err());
    assert!("-1".parse::<TimeScale>().is_err());
    assert!("abc".parse::<TimeScale>().is_err());
    assert_eq!("2.5".parse::<TimeScale>().unwrap().get(), 2.5);
}

struct Cluster {
    _nats: NatsServer,
    _etcd: EtcdServer,
    target: ReplayTarget,
}

async fn cluster() -> Cluster {
    let nats = NatsServer::start().await.unwrap();
    let etcd = EtcdServer::start().await.unwrap();
    let connection = ConnectionArgs::local(
        &nats.url(),
        &etcd.endpoint(),
        &kv_events::Namespace::new("replay-test").unwrap(),
    );
    let target = ReplayTarget::connect(&connection).await.unwrap();
    Cluster {
        _nats: nats,
        _etcd: etcd,
        target,
    }
}

async fn register(target: &ReplayTarget, worker: u64) {
    let reg = WorkerRegistration {
        worker_id: WorkerId(worker),
        dp_size: 1,
        block_size: 512,
        total_kv_blocks: 100,
        url: None,
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    };
    target
        .etcd
        .clone()
        .put(
            target.subjects.etcd_worker_key(WorkerId(worker)),
            serde_json::to_vec(&reg).unwrap(),
            None,
        )
        .await
        .unwrap();
}

/// A router that sends request `i` to worker `1 + i % workers`, and rejects requests
/// whose id ends in `reject_suffix` as overloaded.
async fn fake_router(target: &ReplayTarget, workers: u64, reject_suffix: &'static str) {
    let mut sub = target
        .nats
        .subscribe(target.subjects.route())
        .await
        .unwrap();
    let nats = target.nats.clone();
    tokio::spawn(async move {
        let mut n = 0u64;
        while let Some(msg) = sub.next().await {
            let req: RouteRequest = decode(&msg.payload).unwrap();
            let reply = if req.request_id.0.ends_with(reject_suffix) {
                RouteReply::Error(RouteError {
                    code: RouteErrorCode::Overloaded,
                    message: "queue full".into(),
                })
            } else {
                let blocks = match &req.prompt {
                    Prompt::Blocks { block_hashes, .. } => block_hashes.len() as u32,
                    Prompt::Tokens { .. } => 0,
                };
                n += 1;
                RouteReply::Routed(RouteDecision {
                    request_id: req.request_id,
                    worker_id: WorkerId(1 + n % workers),
                    dp_rank: DpRank(0),
                    overlap_blocks: 0,
                    request_blocks: blocks,
                    in_flight_blocks: 0,
                    kv_position: None,
                    policy: req.policy.unwrap(),
                    disaggregation: None,
                    fallbacks: Vec::new(),
                })
            };
            nats.publish(msg.reply.unwrap(), encode(&reply).unwrap().into())
                .await
                .unwrap();
        }
    });
}

/// An engine that answers clear with `busy` `busy_clears` times, then `cleared`, and
/// generate with first_token (half the prompt cached) then finished; prompts of
/// exactly `fail_tokens` tokens get an error instead.
async fn fake_engine(target: &ReplayTarget, worker: u64, busy_clears: u32, fail_tokens: u64) {
    let nats = target.nats.clone();
    let mut clear = nats
        .subscribe(target.subjects.engine(WorkerId(worker), OP_CLEAR))
        .await
        .unwrap();
    let mut generate = nats
        .subscribe(target.subjects.engine(WorkerId(worker), OP_GENERATE))
        .await
        .unwrap();
    let busy = AtomicU32::new(busy_clears);
    let clear_nats = nats.clone();
    let generate_nats = nats.clone();
    tokio::spawn(async move {
        while let Some(msg) = clear.next().await {
            let reply = if busy.load(Ordering::SeqCst) > 0 {
                busy.fetch_sub(1, Ordering::SeqCst);
                ClearReply::Busy { active_requests: 1 }
            } else {
                ClearReply::Cleared
            };
            clear_nats
                .publish(msg.reply.unwrap(), encode(&reply).unwrap().into())
                .await
                .unwrap();
        }
    });
    tokio::spawn(async move {
        while let Some(msg) = generate.next().await {
            let req: GenerateRequest = decode(&msg.payload).unwrap();
            let inbox = msg.reply.unwrap();
            let replies = if req.num_tokens == fail_tokens {
                vec![GenerateResponse::Error {
                    message: "prompt too long".into(),
                }]
            } else {
                vec![
                    GenerateResponse::FirstToken {
                        cached_tokens: req.num_tokens / 2,
                        prompt_tokens: req.num_tokens,
                    },
                    GenerateResponse::Finished {
                        output_tokens: req.max_tokens,
                    },
                ]
            };
            for reply in replies {
                generate_nats
                    .publish(inbox.clone(), encode(&reply).unwrap().into())
                    .await
                    .unwrap();
            }
        }
    });
    nats.flush().await.unwrap();
}

/// Collects lifecycle messages.
async fn lifecycle_log(target: &ReplayTarget) -> mpsc::UnboundedReceiver<LifecycleMessage> {
    let mut sub = target
        .nats
        .subscribe(target.subjects.lifecycle())
        .await
        .unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            let _ = tx.send(decode(&msg.payload).unwrap());
        }
    });
    rx
}

fn request(timestamp_ms: u64, input_length: u64) -> TraceRequest {
    let blocks = input_length.div_ceil(512);
    TraceRequest {
        timestamp_ms,
        input_length,
        output_length: 3,
        hash_ids: (0..blocks).collect(),
    }
}

fn config() -> ReplayConfig {
    ReplayConfig {
        time_scale: TimeScale::new(100.0).unwrap(),
        request_timeout: Duration::from_secs(20),
        progress: false,
        frontend: Frontend::Nats,
    }
}

#[tokio::test]
async fn replays_each_policy_from_a_cold_cluster() {
    let c = cluster().await;
    register(&c.target, 1).await;
    register(&c.target, 2).await;
    // Worker 2 is busy for the first clear; the replay retries.
    fake_engine(&c.target, 1, 0, 777).await;
    fake_engine(&c.target, 2, 1, 777).await;
    fake_router(&c.target, 2, "-3").await;
    let mut lifecycle = lifecycle_log(&c.target).await;
    c.target.nats.flush().await.unwrap();

    // Request 2 fails in the engine (777 tokens), request 3 is rejected by the router.
    let trace = vec![
        request(0, 1024),
        request(0, 600),
        request(500, 777),
        request(1000, 100),
        request(1500, 2048),
    ];
    let report = run_replay_with(
        &c.target,
        &trace,
        &[PolicyKind::Kv, PolicyKind::RoundRobin],
        &config(),
    )
    .await
    .unwrap();

    assert_eq!(report.policies.len(), 2);
    for (policy, pass) in [PolicyKind::Kv, PolicyKind::RoundRobin]
        .into_iter()
        .zip(&report.policies)
    {
        assert_eq!(pass.policy, policy);
        assert_eq!(pass.requests, 5);
        assert_eq!(pass.completed, 3);
        assert_eq!(pass.failed, 1);
        assert_eq!(pass.route_errors[&RouteFailure::Overloaded], 1);
        // The fake engine reports half of every prompt cached.
        assert_eq!(pass.hit_rate, Some(0.5));
        let ttft = pass.ttft_ms.unwrap();
        assert!(ttft.mean > 0.0 && ttft.p50 <= ttft.p99);
        assert!(pass.e2e_ms.unwrap().mean >= ttft.mean);
        assert_eq!(pass.worker_request_counts.values().sum::<u64>(), 4);
    }

    // Every routed request was freed; completed ones first reported prefill_done.
    let mut events = Vec::new();
    for _ in 0..14 {
        let next = tokio::time::timeout(Duration::from_secs(10), lifecycle.recv());
        events.push(next.await.unwrap().unwrap());
    }
    let count = |event| events.iter().filter(|m| m.event == event).count();
    assert_eq!(count(LifecycleEvent::Freed), 8);
    assert_eq!(count(LifecycleEvent::PrefillDone), 6);
    assert!(events.iter().any(|m| m.request_id.0 == "kv-0"));
    assert!(events.iter().any(|m| m.request_id.0 == "round-robin-4"));
    assert!(!events.iter().any(|m| m.request_id.0.ends_with("-3")));
}

#[tokio::test]
async fn no_registered_workers_is_an_error() {
    let c = cluster().await;
    let err = replay_policy(&c.target, &[request(0, 10)], PolicyKind::Kv, &config())
        .await
        .unwrap_err();
    assert!(matches!(err, ReplayError::NoWorkers { .. }), "{err}");
}

#[tokio::test]
async fn unanswered_route_requests_count_as_unreachable() {
    let c = cluster().await;
    register(&c.target, 1).await;
    fake_engine(&c.target, 1, 0, 0).await;
    // No router: NATS answers "no responders" immediately.
    let report = replay_policy(
        &c.target,
        &[request(0, 10), request(10, 20)],
        PolicyKind::Kv,
        &config(),
    )
    .await
    .unwrap();
    assert_eq!(report.requests, 2);
    assert_eq!(report.completed, 0);
    assert_eq!(report.route_errors[&RouteFailure::Unreachable], 2);
    assert_eq!(report.ttft_ms, None);
}

#[tokio::test]
async fn report_is_written_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nested/report.json");
    let report = ReplayReport {
        policies: vec![PolicyReport::from_outcomes(
            PolicyKind::Kv,
            &[RequestOutcome::RouteFailed(RouteFailure::NoWorkers)],
            1.0,
        )],
    };
    report.write_json(&path).unwrap();
    let back: ReplayReport =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(back, report);
}
