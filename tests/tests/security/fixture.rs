//! The pieces the trust-model tests share: role processes on the secured cluster,
//! a fake router, refused publishes.

use bytes::Bytes;
use engine_model::EngineModelConfig;
use futures::StreamExt;
use integration_tests::security::{ENGINES, ROUTER, SecureCluster, violation};
use kv_events::routing::{PolicyKind, Prompt, RouteDecision, RouteReply, RouteRequest};
use kv_events::{DpRank, WorkerId, decode, encode};
use mocker::engine::{ConnectionArgs, EngineHttpArgs, FleetArgs};
use router_daemon::{Daemon, DaemonConfig, ServeArgs};
use std::time::Duration;

pub(crate) const BLOCK: u32 = 16;
pub(crate) const WAIT: Duration = Duration::from_secs(15);
/// Route queries sent per attack.
pub(crate) const ROUTES: usize = 200;
/// The worker id a fake router answers with.
pub(crate) const FAKE: WorkerId = WorkerId(666);

pub(crate) fn model() -> EngineModelConfig {
    EngineModelConfig {
        block_size: BLOCK,
        num_gpu_blocks: 1024,
        max_num_seqs: 16,
        max_num_batched_tokens: 2048,
    }
}

pub(crate) fn model_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kv-tokenizer/tests/data")
}

/// The daemon as user `router-1` of the secured cluster.
pub(crate) async fn secure_daemon(cluster: &SecureCluster) -> Daemon {
    let block = BLOCK.to_string();
    let args: ServeArgs = cluster.flags(ROUTER, &["--block-size", &block, "--seed", "7"]);
    let config = DaemonConfig::from_args(&args).expect("daemon flags are valid");
    Daemon::start(config, &prometheus::Registry::new())
        .await
        .expect("the daemon starts with router credentials")
}

/// Mock engines 1 and 2 as user `engines`, serving OpenAI HTTP.
pub(crate) async fn secure_engines(cluster: &SecureCluster) -> mocker::engine::EnginesHandle {
    let connection: ConnectionArgs = cluster.flags(ENGINES, &[]);
    let fleet = FleetArgs {
        workers: 2,
        first_worker_id: 1,
        dp_size: 1,
    };
    let http = EngineHttpArgs {
        model_dir: Some(model_dir()),
        served_model_name: "tiny".into(),
        ..EngineHttpArgs::default()
    };
    integration_tests::spawn_mock_engines(connection, fleet, model(), 50.0, http)
        .await
        .expect("engines start with worker credentials")
}

/// Sends `request` on the route subject from `nats` and decodes the reply.
pub(crate) async fn route(
    nats: &async_nats::Client,
    subject: String,
    request: &RouteRequest,
) -> RouteReply {
    let reply = tokio::time::timeout(
        WAIT,
        nats.request(subject, encode(request).expect("encodes").into()),
    )
    .await
    .expect("a reply in time")
    .expect("a reply");
    decode(&reply.payload).expect("a route reply")
}

/// Joins the route queue group from `nats` and answers every query with [`FAKE`].
pub(crate) async fn fake_router(nats: async_nats::Client, subject: String, group: String) {
    let mut queries = nats
        .queue_subscribe(subject, group)
        .await
        .expect("subscribe is sent");
    tokio::spawn(async move {
        while let Some(query) = queries.next().await {
            let Ok(request) = decode::<RouteRequest>(&query.payload) else {
                continue;
            };
            let reply = RouteReply::Routed(RouteDecision {
                request_id: request.request_id,
                worker_id: FAKE,
                dp_rank: DpRank(0),
                overlap_blocks: 0,
                request_blocks: 1,
                in_flight_blocks: 0,
                kv_position: None,
                policy: PolicyKind::Random,
                disaggregation: None,
                fallbacks: Vec::new(),
            });
            if let Some(to) = query.reply {
                let _ = nats
                    .publish(to, encode(&reply).expect("encodes").into())
                    .await;
            }
        }
    });
}

/// Publishes to each of `subjects` from `client` and waits for the server to refuse
/// each one.
pub(crate) async fn refused_publishes(
    client: &async_nats::Client,
    errors: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    subjects: impl IntoIterator<Item = String>,
) {
    for subject in subjects {
        client
            .publish(subject.clone(), Bytes::from_static(b"poison"))
            .await
            .unwrap();
        violation(errors, &subject).await.expect("publish refused");
    }
}

/// How many of [`ROUTES`] queries went to [`FAKE`]; panics on any error reply.
pub(crate) async fn stolen_routes(nats: &async_nats::Client, subject: &str) -> usize {
    let mut stolen = 0;
    for i in 0..ROUTES {
        let request = RouteRequest::new(
            format!("q-{i}"),
            Prompt::Tokens {
                token_ids: (0..64).collect(),
            },
        );
        match route(nats, subject.to_owned(), &request).await {
            RouteReply::Routed(d) if d.worker_id == FAKE => stolen += 1,
            RouteReply::Routed(_) => {}
            RouteReply::Error(e) => panic!("route {i} failed: {e:?}"),
        }
    }
    stolen
}
