//! NATS permissions: forbidden publishes and subscriptions refused, every role's
//! allowed path working (finding 9 of issue 14).

use super::engine;
use super::fixture::*;
use bytes::Bytes;
use futures::StreamExt;
use indexer::IndexerApi as _;
use integration_tests::security::{FRONTEND, OPERATOR, RELAY_7, ROUTER, SecureCluster, violation};
use integration_tests::{FakeWorker, TestCluster, eventually, register_worker, wait_for_overlap};
use kv_events::discovery::WorkerRegistration;
use kv_events::routing::{LifecycleEvent, LifecycleMessage, Prompt, RouteReply, RouteRequest};
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, StoredBlock, WorkerId,
    WorkerRank, compute_block_hashes, encode,
};
use router_daemon::{Daemon, DaemonConfig, ServeArgs};

/// Finding 9: on the open bus any client can join the router's queue group and answer
/// queries with a worker of its choosing; under the shipped permissions only routers
/// may join it, so every query is answered by the real router.
#[tokio::test]
async fn a_fake_router_steals_routes_on_an_open_bus_but_not_under_the_shipped_config() {
    // The open bus: the attack works (this is what the shipped configuration fixes).
    let mut open = TestCluster::start(BLOCK).await.expect("servers start");
    let _worker = FakeWorker::register(&mut open, 1, 30)
        .await
        .expect("registers");
    let _daemon = open.start_daemon(|_| {}).await.expect("daemon starts");
    let attacker = async_nats::connect(open.nats_server.url())
        .await
        .expect("connects");
    let (route_subject, group) = (open.subjects.route(), open.subjects.route_queue_group());
    fake_router(attacker.clone(), route_subject.clone(), group).await;
    kv_cluster::barrier::server_barrier(&attacker)
        .await
        .expect("the fake router is subscribed");
    let stolen = stolen_routes(&open.nats, &route_subject).await;
    println!("open bus: {stolen} of {ROUTES} routes answered by the fake router");
    assert!(
        stolen > 0,
        "the open-bus control did not reproduce the attack"
    );

    // The shipped configuration: frontends and workers may not join the group.
    let cluster = SecureCluster::start().await.expect("secured servers start");
    let _engines = secure_engines(&cluster).await;
    let _daemon = secure_daemon(&cluster).await;
    let s = &cluster.subjects;
    for user in [FRONTEND, RELAY_7] {
        let (attacker, mut errors) = cluster.nats_as(user).await.expect("connects");
        fake_router(attacker.clone(), s.route(), s.route_queue_group()).await;
        violation(&mut errors, &s.route())
            .await
            .expect("queue join refused");
        // Nor may it read the queries with a plain subscription.
        let _sub = attacker
            .subscribe(s.route())
            .await
            .expect("subscribe is sent");
        violation(&mut errors, &s.route())
            .await
            .expect("plain subscription refused");
        let _sub = attacker
            .queue_subscribe(s.route_batch(), s.route_queue_group())
            .await
            .expect("subscribe is sent");
        violation(&mut errors, &s.route_batch())
            .await
            .expect("batch queue join refused");
    }
    let (frontend, _errors) = cluster.nats_as(FRONTEND).await.expect("connects");
    eventually("the router to know both engines", WAIT, || async {
        let request = RouteRequest::new("warm-up", Prompt::Tokens { token_ids: vec![1] });
        matches!(
            route(&frontend, s.route(), &request).await,
            RouteReply::Routed(_)
        )
        .then_some(())
    })
    .await
    .expect("routes are served");
    let stolen = stolen_routes(&frontend, &s.route()).await;
    println!("shipped config: {stolen} of {ROUTES} routes answered by a fake router");
    assert_eq!(stolen, 0);
}

/// A worker's credentials publish only its own worker's events and metrics; the
/// relay serves its worker end to end with them (etcd registration over TLS with its
/// own key, KV events, recovery answers).
#[tokio::test]
async fn a_relay_publishes_only_its_own_workers_subjects() {
    let cluster = SecureCluster::start().await.expect("secured servers start");
    let s = &cluster.subjects;
    let (relay, mut errors) = cluster.nats_as(RELAY_7).await.expect("connects");
    let (operator, _) = cluster.nats_as(OPERATOR).await.expect("connects");
    let mut events = operator
        .subscribe(s.kv_events_all())
        .await
        .expect("subscribes");
    let mut metrics = operator
        .subscribe(s.load_metrics_all())
        .await
        .expect("subscribes");
    kv_cluster::barrier::server_barrier(&operator)
        .await
        .expect("round trip");
    let others = [s.kv_events(WorkerId(8)), s.load_metrics(WorkerId(8))];
    refused_publishes(&relay, &mut errors, others).await;
    relay
        .publish(s.kv_events(WorkerId(7)), Bytes::from_static(b"own"))
        .await
        .unwrap();
    relay
        .publish(s.load_metrics(WorkerId(7)), Bytes::from_static(b"own"))
        .await
        .unwrap();
    // One connection's messages arrive in order: had worker 8's gone through, they
    // would come first.
    for sub in [&mut events, &mut metrics] {
        let first = tokio::time::timeout(WAIT, sub.next())
            .await
            .unwrap()
            .unwrap();
        assert!(first.subject.ends_with(".7"), "{}", first.subject);
        assert_eq!(&first.payload[..], b"own");
    }
    // Nor may a worker book, free or read bookings, or read other clients' replies.
    let bookings = [s.sequences(), s.sequences_snapshot(), s.lifecycle()];
    refused_publishes(&relay, &mut errors, bookings).await;
    let _sub = relay
        .subscribe("_INBOX.>")
        .await
        .expect("subscribe is sent");
    violation(&mut errors, "_INBOX.>")
        .await
        .expect("inbox snooping refused");

    // The real relay with the same credentials.
    let daemon = secure_daemon(&cluster).await;
    let mut engine = engine::FakeEngine::start("kv-events", engine::ReplayFraming::WithTopic).await;
    let mut flags = engine.relay_flags();
    flags.extend(["--dp-size", "4", "--shared-endpoint"].map(str::to_owned));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let args: kv_relay::RelayArgs = cluster.flags(RELAY_7, &flags);
    let config = kv_relay::RelayConfig::from_args(&args).expect("relay flags are valid");
    let _relay = kv_relay::Relay::start(config, &prometheus::Registry::new())
        .await
        .expect("the relay starts with worker 7's credentials");
    engine.wait_subscribed().await;
    // Frames 0-3 of the capture (the later ones clear the cache).
    for (seq, frame) in engine::payloads("vllm_zmq_frames_topic_kv-events.json")
        .iter()
        .take(4)
        .enumerate()
    {
        engine.publish(seq as u64, frame).await;
    }
    // Prompt B of the capture (see relay.rs): three blocks on rank 0 of worker 7.
    let prompt_b: Vec<u32> = (1000..1032).chain(5000..5020).collect();
    let hashes = compute_block_hashes(&prompt_b, BLOCK);
    wait_for_overlap(&daemon, &hashes, WorkerRank::new(WorkerId(7), DpRank(0)), 3)
        .await
        .expect("the relay's events reach the router");
    eventually("worker 7's registration", WAIT, || async {
        let scheduler = daemon.state().scheduler();
        scheduler
            .workers()
            .any(|w| w.worker_id == WorkerId(7))
            .then_some(())
    })
    .await
    .expect("the relay registers over etcd tls with its own user");
    let (frontend, _) = cluster.nats_as(FRONTEND).await.expect("connects");
    let reply = route(
        &frontend,
        s.route(),
        &RouteRequest::new(
            "b-1",
            Prompt::Tokens {
                token_ids: prompt_b,
            },
        ),
    )
    .await;
    let RouteReply::Routed(decision) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(
        (decision.worker_id, decision.overlap_blocks),
        (WorkerId(7), 3)
    );
}

/// A frontend asks for routes and publishes lifecycle messages, nothing else: no KV
/// events, no bookings, no snapshot requests, no other client's replies.
#[tokio::test]
async fn a_frontend_routes_but_cannot_publish_events_or_read_bookings() {
    let cluster = SecureCluster::start().await.expect("secured servers start");
    let s = &cluster.subjects;
    let _engines = secure_engines(&cluster).await;
    let daemon = secure_daemon(&cluster).await;
    let (frontend, mut errors) = cluster.nats_as(FRONTEND).await.expect("connects");
    let forbidden = [
        s.kv_events(WorkerId(1)),
        s.load_metrics(WorkerId(1)),
        s.sequences(),
        s.sequences_snapshot(),
        s.kv_recovery(WorkerId(1)),
    ];
    refused_publishes(&frontend, &mut errors, forbidden).await;
    for subject in [s.sequences(), s.sequences_snapshot(), "_INBOX.>".to_owned()] {
        let _sub = frontend
            .subscribe(subject.clone())
            .await
            .expect("subscribe is sent");
        violation(&mut errors, &subject)
            .await
            .expect("subscription refused");
    }

    // Allowed: route (reply on its own inbox), then free the booking.
    let booked = || daemon.state().scheduler().active_requests();
    let request = RouteRequest::new(
        "f-1",
        Prompt::Tokens {
            token_ids: (0..40).collect(),
        },
    );
    let reply = eventually("a route", WAIT, || async {
        match route(&frontend, s.route(), &request).await {
            RouteReply::Routed(d) => Some(d),
            RouteReply::Error(_) => None,
        }
    })
    .await
    .expect("routes are served");
    assert!([WorkerId(1), WorkerId(2)].contains(&reply.worker_id));
    assert_eq!(booked(), 1);
    let freed = LifecycleMessage {
        request_id: "f-1".into(),
        event: LifecycleEvent::Freed,
    };
    frontend
        .publish(s.lifecycle(), encode(&freed).unwrap().into())
        .await
        .unwrap();
    eventually("the booking to be freed", WAIT, || async {
        (booked() == 0).then_some(())
    })
    .await
    .expect("lifecycle messages are delivered");
}

/// The gateway, as a frontend user, serves an OpenAI completion through the router
/// and a mock engine, each with only its role's rights.
#[tokio::test]
async fn the_gateway_serves_completions_on_the_secured_cluster() {
    let cluster = SecureCluster::start().await.expect("secured servers start");
    let _engines = secure_engines(&cluster).await;
    let _daemon = secure_daemon(&cluster).await;
    let dir = model_dir().display().to_string();
    let args: kv_gateway::GatewayArgs = cluster.flags(
        FRONTEND,
        &[
            "--listen",
            "127.0.0.1:0",
            "--served-model-name",
            "tiny",
            "--model-dir",
            &dir,
        ],
    );
    let gateway = kv_gateway::Gateway::start(
        args.to_config().expect("gateway flags are valid"),
        std::sync::Arc::new(prometheus::Registry::new()),
        tokio_util::sync::CancellationToken::new(),
    )
    .await
    .expect("the gateway starts with frontend credentials");
    let base = format!("http://{}", gateway.local_addr());
    let http = kv_cluster::http::client().expect("http client");
    let body = eventually("a completion", WAIT, || async {
        let response = http
            .post(format!("{base}/v1/completions"))
            .json(&serde_json::json!({"model": "tiny", "prompt": "hello there", "max_tokens": 4}))
            .send()
            .await
            .ok()?;
        if response.status() != 200 {
            return None;
        }
        response.json::<serde_json::Value>().await.ok()
    })
    .await
    .expect("the gateway answers");
    assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");
    // The next requests go to the replica the gateway pinned (its own subject, found
    // by the roll call), and the gateway asks the router about cache parity: each
    // answered at once, with only the two roles' rights.
    for n in 0..3 {
        let response = http
            .post(format!("{base}/v1/completions"))
            .json(&serde_json::json!({"model": "tiny", "prompt": "hello there", "max_tokens": 4}))
            .send()
            .await
            .expect("the gateway answers");
        assert_eq!(response.status(), 200, "request {n}");
    }
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    let pinned_away = |event: &str| {
        metrics.lines().any(|l| {
            l.starts_with(&format!(
                "kv_gateway_route_affinity_total{{event=\"{event}\"}}"
            )) && !l.ends_with(" 0")
        })
    };
    for event in ["timed_out", "failed", "gone"] {
        assert!(!pinned_away(event), "a pin let go ({event}):\n{metrics}");
    }
}

/// The router's JetStream path (`--jetstream`: the KV event stream, its consumer and
/// the index snapshot bucket) works with the router's permissions alone, and a second
/// router restores the snapshot the first stored.
#[tokio::test]
async fn a_router_with_jetstream_works_under_the_shipped_permissions() {
    use futures::TryStreamExt as _;
    let cluster = SecureCluster::start().await.expect("secured servers start");
    let _engines = secure_engines(&cluster).await;
    let s = &cluster.subjects;
    let block = BLOCK.to_string();
    let flags = [
        "--block-size",
        &block,
        "--jetstream",
        "--jetstream-snapshot-every",
        "1",
    ];
    let start = || async {
        let args: ServeArgs = cluster.flags(ROUTER, &flags);
        let config = DaemonConfig::from_args(&args).expect("daemon flags are valid");
        Daemon::start(config, &prometheus::Registry::new())
            .await
            .expect("the daemon starts with --jetstream and router credentials")
    };
    let (frontend, _) = cluster.nats_as(FRONTEND).await.expect("connects");
    let routed = |id: &'static str| {
        let frontend = frontend.clone();
        async move {
            eventually("a route", WAIT, || async {
                let request = RouteRequest::new(
                    id,
                    Prompt::Tokens {
                        token_ids: (0..40).collect(),
                    },
                );
                matches!(
                    route(&frontend, s.route(), &request).await,
                    RouteReply::Routed(_)
                )
                .then_some(())
            })
            .await
            .expect("routes are served");
        }
    };
    let first = start().await;
    routed("js-1").await;
    // Worker 7 stores a block: consumed from the stream, then snapshotted.
    let hashes = compute_block_hashes(&(0..BLOCK).collect::<Vec<u32>>(), BLOCK);
    let batch = KvEventBatch {
        worker_id: WorkerId(7),
        epoch: 0,
        events: vec![KvCacheEvent {
            event_id: 0,
            dp_rank: DpRank(0),
            data: KvCacheEventData::Stored {
                group: None,
                parent_hash: None,
                blocks: vec![StoredBlock {
                    block_hash: ExternalBlockHash(77),
                    tokens_hash: hashes[0],
                }],
                tier: kv_events::StorageTier::Gpu,
            },
        }],
    };
    // Worker 7 registers first, with its own etcd credentials, as its relay does:
    // the router indexes only registered workers, from the stream as from core NATS.
    let mut relay_etcd = cluster
        .etcd_as(Some("client"), Some(RELAY_7))
        .await
        .expect("worker 7 connects to etcd");
    let registration = WorkerRegistration {
        worker_id: WorkerId(7),
        dp_size: 1,
        block_size: BLOCK,
        total_kv_blocks: 1024,
        url: None,
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    };
    register_worker(&mut relay_etcd, s, &registration, 120)
        .await
        .expect("worker 7 registers");
    let (relay, _) = cluster.nats_as(RELAY_7).await.expect("connects");
    relay
        .publish(s.kv_events(WorkerId(7)), encode(&batch).unwrap().into())
        .await
        .unwrap();
    relay.flush().await.unwrap();
    let rank = WorkerRank::new(WorkerId(7), DpRank(0));
    wait_for_overlap(&first, &hashes, rank, 1)
        .await
        .expect("consumed from the stream");
    let (operator, _) = cluster.nats_as(OPERATOR).await.expect("connects");
    let bucket = format!("{}-kv-index", s.namespace());
    eventually("an index snapshot in the bucket", WAIT, || async {
        let store = async_nats::jetstream::new(operator.clone())
            .get_object_store(&bucket)
            .await
            .ok()?;
        let objects: Vec<_> = store.list().await.ok()?.try_collect().await.ok()?;
        (!objects.is_empty()).then_some(())
    })
    .await
    .expect("the router stores its snapshot");
    first.shutdown().await.expect("stops");
    let second = start().await;
    // Ready means restored and caught up with the stream.
    let scores = second.state().indexer.find_matches(hashes).await.unwrap();
    assert_eq!(scores.get(rank), 1);
    routed("js-2").await;
}
