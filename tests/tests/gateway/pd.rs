//! Both sides of the gateway's disaggregation protocol, small enough to check every
//! message: engines on loopback HTTP that answer as a prefill or decode worker of
//! vLLM's protocol (`kv_transfer_params`) or SGLang's (`bootstrap_*`), recording what
//! they receive, and a router on real NATS that pairs a prefill worker with a decode
//! worker and records every lifecycle message.

use super::fixture::{BLOCK, registration};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use integration_tests::{TestCluster, register_worker};
use kv_events::disaggregation::{
    Disaggregation, DisaggregationReason, KvTransfer, PrefillPlacement, TransferProtocol,
    WorkerRole,
};
use kv_events::discovery::WorkerRegistration;
use kv_events::routing::{
    LifecycleBatch, LifecycleEvent, LifecycleMessage, PolicyKind, Prompt, RouteDecision,
    RouteError, RouteErrorCode, RouteReply, RouteRequest,
};
use kv_events::{DpRank, RequestId, WorkerId, encode};
use serde_json::{Value, json};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How an engine answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// As its role and protocol say.
    Serve,
    /// 500 to every request.
    Fail,
    /// A vLLM prefill answer without `kv_transfer_params`.
    NoParams,
    /// Reads the request and never answers.
    Hang,
}

/// One request an engine received.
#[derive(Debug, Clone)]
pub struct Received {
    /// Its `X-Request-Id` header.
    pub request_id: String,
    /// Its body.
    pub body: Value,
}

/// The rooms SGLang prefill workers have prefilled, shared by a test's engines (what
/// SGLang's bootstrap server and transfer do between real engines).
pub type Rooms = watch::Sender<HashSet<u64>>;

/// A fresh set of rooms.
pub fn rooms() -> Rooms {
    watch::Sender::new(HashSet::new())
}

struct Engine {
    role: WorkerRole,
    protocol: TransferProtocol,
    behaviour: Behaviour,
    /// Pause before each decoded token.
    token_pause: Duration,
    received: Mutex<Vec<Received>>,
    /// The `kv_transfer_params` a vLLM prefill worker answered, by request id.
    answered: Mutex<Vec<(String, Value)>>,
    rooms: Rooms,
}

/// A prefill or decode engine on a loopback port, registered as a worker; it closes
/// every connection after its answer, so once stopped it refuses every request.
pub struct PdEngine {
    /// Its worker id.
    pub worker: WorkerId,
    /// The SGLang bootstrap port it registered (prefill workers).
    pub bootstrap_port: Option<u16>,
    engine: Arc<Engine>,
    server: JoinHandle<()>,
}

impl Drop for PdEngine {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl PdEngine {
    /// Starts worker `worker` as `role` of `protocol`, answering as `behaviour`, with
    /// `token_pause` before each token it decodes, and registers it in `cluster`.
    pub async fn start(
        cluster: &mut TestCluster,
        worker: u64,
        (role, protocol): (WorkerRole, TransferProtocol),
        behaviour: Behaviour,
        token_pause: Duration,
        rooms: &Rooms,
    ) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let url = format!("http://127.0.0.1:{port}");
        let engine = Arc::new(Engine {
            role,
            protocol,
            behaviour,
            token_pause,
            received: Mutex::new(Vec::new()),
            answered: Mutex::new(Vec::new()),
            rooms: rooms.clone(),
        });
        let app = axum::Router::new()
            .route("/v1/completions", axum::routing::post(completions))
            .with_state(engine.clone());
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        // SGLang's bootstrap server would listen here; the test's engines share rooms.
        let bootstrap_port = (protocol == TransferProtocol::Sglang && role == WorkerRole::Prefill)
            .then_some(port.wrapping_add(1000));
        let registration = WorkerRegistration {
            role,
            kv_transfer: Some(KvTransfer {
                protocol,
                bootstrap_port,
            }),
            ..registration(WorkerId(worker), url)
        };
        register_worker(&mut cluster.etcd, &cluster.subjects, &registration, 30)
            .await
            .unwrap();
        Self {
            worker: WorkerId(worker),
            bootstrap_port,
            engine,
            server,
        }
    }

    /// The requests it received, in order.
    pub fn received(&self) -> Vec<Received> {
        self.engine.received.lock().unwrap().clone()
    }

    /// The `kv_transfer_params` it answered (a vLLM prefill worker), by request id.
    pub fn answered(&self) -> Vec<(String, Value)> {
        self.engine.answered.lock().unwrap().clone()
    }

    /// Stops serving: new connections are refused.
    pub fn kill(&self) {
        self.server.abort();
    }
}

async fn completions(
    State(engine): State<Arc<Engine>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    engine.received.lock().unwrap().push(Received {
        request_id: request_id.clone(),
        body: body.clone(),
    });
    let mut response = match engine.behaviour {
        Behaviour::Fail => (StatusCode::INTERNAL_SERVER_ERROR, "engine failure").into_response(),
        Behaviour::Hang => std::future::pending().await,
        Behaviour::Serve | Behaviour::NoParams => answer(&engine, &request_id, &body).await,
    };
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}

async fn answer(engine: &Engine, request_id: &str, body: &Value) -> Response {
    let prompt_tokens = body["prompt"].as_array().map_or(0, Vec::len);
    match (engine.protocol, engine.role) {
        (TransferProtocol::Vllm, WorkerRole::Prefill) => {
            let mut answer = json!({"id": format!("cmpl-{request_id}"), "object": "text_completion",
                "created": 0, "model": "tiny",
                "choices": [{"index": 0, "text": " p", "finish_reason": "length"}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1}});
            if engine.behaviour == Behaviour::Serve {
                let blocks: Vec<usize> = (0..prompt_tokens / BLOCK as usize).collect();
                let params = json!({"do_remote_prefill": true, "do_remote_decode": false,
                    "remote_block_ids": blocks, "remote_engine_id": format!("engine-{request_id}"),
                    "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1});
                let answered = (request_id.to_owned(), params.clone());
                engine.answered.lock().unwrap().push(answered);
                answer["kv_transfer_params"] = params;
            }
            Json(answer).into_response()
        }
        (TransferProtocol::Sglang, WorkerRole::Prefill) => {
            let room = body["bootstrap_room"].as_u64().unwrap();
            engine.rooms.send_modify(|rooms| {
                rooms.insert(room);
            });
            Json(json!({"id": "p", "choices": [{"index": 0, "text": " p"}]})).into_response()
        }
        (TransferProtocol::Sglang, _) => {
            let room = body["bootstrap_room"].as_u64();
            let mut rooms = engine.rooms.subscribe();
            let prefilled = rooms.wait_for(|rooms| room.is_some_and(|r| rooms.contains(&r)));
            match tokio::time::timeout(Duration::from_secs(5), prefilled).await {
                Ok(Ok(_)) => stream(engine, request_id, body, prompt_tokens),
                _ => (StatusCode::INTERNAL_SERVER_ERROR, "no prefill for the room").into_response(),
            }
        }
        (TransferProtocol::Vllm, _) => stream(engine, request_id, body, prompt_tokens),
    }
}

/// `max_tokens` completion chunks (one token each), a usage chunk when asked, `[DONE]`.
fn stream(engine: &Engine, request_id: &str, body: &Value, prompt_tokens: usize) -> Response {
    let tokens = body["max_tokens"].as_u64().unwrap_or(4);
    let id = format!("cmpl-{request_id}");
    let mut events: Vec<String> = (1..=tokens)
        .map(|i| {
            let finish = if i == tokens {
                json!("length")
            } else {
                Value::Null
            };
            json!({"id": id, "object": "text_completion", "created": 0, "model": "tiny",
                "choices": [{"index": 0, "text": format!(" t{i}"), "finish_reason": finish}]})
            .to_string()
        })
        .collect();
    if body["stream_options"]["include_usage"] == json!(true) {
        events.push(
            json!({"id": id, "object": "text_completion", "created": 0, "model": "tiny",
                "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                "completion_tokens": tokens, "total_tokens": prompt_tokens as u64 + tokens}})
            .to_string(),
        );
    }
    events.push("[DONE]".into());
    let pause = engine.token_pause;
    let chunks = futures::stream::iter(events).then(move |event| async move {
        tokio::time::sleep(pause).await;
        Ok::<_, std::convert::Infallible>(format!("data: {event}\n\n"))
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::from_stream(chunks),
    )
        .into_response()
}

/// A router on the cluster's NATS that pairs the first prefill worker the request
/// does not exclude with the first such decode worker (a request that does not allow
/// disaggregation gets the decode worker alone), and records every route request and
/// lifecycle message.
pub struct PairRouter {
    routed: Arc<Mutex<Vec<RouteRequest>>>,
    lifecycle: Arc<Mutex<Vec<LifecycleMessage>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for PairRouter {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl PairRouter {
    /// Answers route requests on `cluster` with pairs of `prefill` and `decode`
    /// workers.
    pub async fn start(
        cluster: &TestCluster,
        prefill: Vec<WorkerId>,
        decode: Vec<WorkerId>,
    ) -> Self {
        let nats = &cluster.nats;
        let mut routes = nats.subscribe(cluster.subjects.route()).await.unwrap();
        let mut messages = nats.subscribe(cluster.subjects.lifecycle()).await.unwrap();
        kv_cluster::barrier::server_barrier(nats).await.unwrap();
        let routed: Arc<Mutex<Vec<RouteRequest>>> = Arc::default();
        let lifecycle: Arc<Mutex<Vec<LifecycleMessage>>> = Arc::default();
        let (seen, client) = (Arc::clone(&routed), nats.clone());
        let answering = tokio::spawn(async move {
            while let Some(message) = routes.next().await {
                let request: RouteRequest = kv_events::decode(&message.payload).unwrap();
                let reply = decide(&request, &prefill, &decode);
                if matches!(reply, RouteReply::Routed(_)) {
                    seen.lock().unwrap().push(request);
                }
                if let Some(to) = message.reply {
                    client
                        .publish(to, encode(&reply).unwrap().into())
                        .await
                        .unwrap();
                }
            }
        });
        let heard = Arc::clone(&lifecycle);
        let listening = tokio::spawn(async move {
            while let Some(message) = messages.next().await {
                // The gateway sends what it has queued as one batch (or one message).
                let batch: LifecycleBatch = kv_events::decode(&message.payload).unwrap();
                heard.lock().unwrap().extend(batch.messages);
            }
        });
        Self {
            routed,
            lifecycle,
            tasks: vec![answering, listening],
        }
    }

    /// The route requests it booked, in order.
    pub fn routed(&self) -> Vec<RouteRequest> {
        self.routed.lock().unwrap().clone()
    }

    /// The workers each booked route request excluded, in order.
    pub fn excluded(&self) -> Vec<Vec<u64>> {
        let routed = self.routed.lock().unwrap();
        let ids = |r: &RouteRequest| r.exclude_workers.iter().map(|w| w.0).collect();
        routed.iter().map(ids).collect()
    }

    /// The lifecycle events of `request_id`, in order, keep-alives left out.
    pub fn events(&self, request_id: &RequestId) -> Vec<LifecycleEvent> {
        let messages = self.lifecycle.lock().unwrap();
        messages
            .iter()
            .filter(|m| &m.request_id == request_id && m.event != LifecycleEvent::KeepAlive)
            .map(|m| m.event)
            .collect()
    }

    /// Booked requests not freed yet.
    pub fn booked(&self) -> usize {
        let freed: HashSet<RequestId> = self
            .lifecycle
            .lock()
            .unwrap()
            .iter()
            .filter(|m| m.event == LifecycleEvent::Freed)
            .map(|m| m.request_id.clone())
            .collect();
        let routed = self.routed.lock().unwrap();
        routed
            .iter()
            .filter(|r| !freed.contains(&r.request_id))
            .count()
    }
}

fn decide(request: &RouteRequest, prefill: &[WorkerId], decode: &[WorkerId]) -> RouteReply {
    let error = |code, message: &str| {
        RouteReply::Error(RouteError {
            code,
            message: message.into(),
        })
    };
    let (request_blocks, empty) = match &request.prompt {
        Prompt::Tokens { token_ids } => (token_ids.len() as u32 / BLOCK, token_ids.is_empty()),
        Prompt::Blocks {
            block_hashes,
            num_tokens,
        } => (block_hashes.len() as u32, *num_tokens == 0),
    };
    if empty {
        return error(RouteErrorCode::BadRequest, "empty prompt");
    }
    let free = |workers: &[WorkerId]| {
        workers
            .iter()
            .copied()
            .find(|w| !request.exclude_workers.contains(w))
    };
    let Some(worker_id) = free(decode) else {
        return error(RouteErrorCode::NoWorkers, "every decode worker is excluded");
    };
    let disaggregation = request.allow_disaggregation.then(|| match free(prefill) {
        Some(worker_id) => Disaggregation {
            reason: DisaggregationReason::LongUncached,
            prefill: Some(PrefillPlacement {
                worker_id,
                dp_rank: DpRank(0),
                overlap_blocks: 0,
            }),
        },
        None => Disaggregation {
            reason: DisaggregationReason::NoPrefillWorker,
            prefill: None,
        },
    });
    RouteReply::Routed(RouteDecision {
        request_id: request.request_id.clone(),
        worker_id,
        dp_rank: DpRank(0),
        overlap_blocks: 0,
        request_blocks,
        in_flight_blocks: 0,
        kv_position: None,
        policy: PolicyKind::Kv,
        disaggregation,
        fallbacks: Vec::new(),
    })
}
