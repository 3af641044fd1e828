//! `--tokenize-via render` end to end (nats-server, etcd, mock engines, daemon and
//! gateway all real, on loopback): the gateway sends the client's body to vLLM's
//! render endpoints and routes on the ids they answer; engine refusals are the
//! client's 400, a server without the endpoints a clear 502, a hung one a 504, and a
//! dead engine is skipped. The render server of `--render-url` is an HTTP server in
//! the test that answers ids no tokenizer would give.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

// The fixture is shared with gateway.rs, which uses all of it.
#[allow(dead_code)]
#[path = "gateway/fixture.rs"]
mod fixture;

use axum::Json;
use axum::routing::post;
use fixture::{BLOCK, MODEL, Stack};
use kv_events::WorkerId;
use serde_json::{Value, json};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(20);

/// The ids of the render server for any prompt but the ones below: 4 blocks that no
/// tokenizer gives for text.
fn canned() -> Vec<u32> {
    (3000..3000 + 4 * BLOCK).collect()
}

/// A render server with `POST /v1/completions/render` only: prompt `"hang"` is never
/// answered, `"huge"` gets 200,000 ids, any other prompt [`canned`]. Stopped on drop.
struct RenderServer {
    url: String,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for RenderServer {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl RenderServer {
    async fn start() -> Self {
        async fn render(Json(body): Json<Value>) -> Json<Value> {
            let ids: Vec<u32> = match body["prompt"].as_str() {
                Some("hang") => std::future::pending().await,
                Some("huge") => (0..200_000).collect(),
                _ => canned(),
            };
            Json(json!([{"request_id": "cmpl-1", "token_ids": ids, "sampling_params": {}}]))
        }
        let app = axum::Router::new().route("/v1/completions/render", post(render));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { url, server }
    }
}

/// POSTs `body` to the gateway's `path`: status, the routed worker and overlap
/// headers (0 when absent) and the JSON answer.
async fn send(stack: &Stack, path: &str, body: &Value) -> (u16, u64, u64, Value) {
    let response = tokio::time::timeout(WAIT, stack.post(path, body.to_string()))
        .await
        .expect("the gateway answers");
    let header = |name: &str| -> u64 {
        response
            .headers()
            .get(name)
            .map_or(0, |v| v.to_str().unwrap().parse().unwrap())
    };
    let (worker, overlap) = (
        header("x-kv-router-worker-id"),
        header("x-kv-router-overlap-blocks"),
    );
    let status = response.status().as_u16();
    (status, worker, overlap, response.json().await.unwrap())
}

/// The error message of an OpenAI error answer.
fn message(answer: &Value) -> &str {
    answer["error"]["message"].as_str().unwrap()
}

/// The JSON answer of a POST of `body` to `url`.
async fn post_json(stack: &Stack, url: &str, body: &Value) -> Value {
    let response = stack.http.post(url).json(body).send().await.unwrap();
    response.json().await.unwrap()
}

/// What the engine at `url` renders for `body` on `path`: its token ids.
async fn render(stack: &Stack, url: &str, path: &str, body: &Value) -> Vec<u32> {
    let rendered = post_json(stack, &format!("{url}{path}"), body).await;
    // The completions render is a list, one per prompt; the chat render one object.
    let one = rendered.get(0).unwrap_or(&rendered);
    serde_json::from_value(one["token_ids"].clone()).unwrap()
}

/// The count of `kv_gateway_stage_seconds` observations of `stage` on `/metrics`.
async fn stage_count(stack: &Stack, stage: &str) -> f64 {
    let url = format!("{}/metrics", stack.base);
    let text = stack.http.get(url).send().await.unwrap().text().await;
    let prefix = format!("kv_gateway_stage_seconds_count{{stage=\"{stage}\"}} ");
    text.unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// A completion and a chat whose bodies ask for what only the engine's own rendering
/// honours (`add_special_tokens` the other way round from the defaults) go to the
/// worker that holds the ids the render endpoint returned, with every block of them
/// as overlap, and the engine prefills exactly those ids.
#[tokio::test]
async fn completions_and_chats_are_routed_by_the_ids_the_render_endpoint_returned() {
    let mut stack = Stack::start(1, 10.0, |_| {}, &["--tokenize-via", "render"]).await;
    let engine = stack.engines.http_urls()[0].clone();
    let completion = json!({
        "model": MODEL, "max_tokens": 2, "add_special_tokens": false,
        "prompt": "the router sends each request where its prefix is cached ".repeat(8),
    });
    let chat = json!({
        "model": MODEL, "max_tokens": 2, "add_special_tokens": true,
        "messages": [{"role": "user", "content": "tell me about word ".repeat(30)}],
    });
    let ids = [
        render(&stack, &engine, "/v1/completions/render", &completion).await,
        render(&stack, &engine, "/v1/chat/completions/render", &chat).await,
    ];
    let prompt = json!({"prompt": completion["prompt"]});
    let tokenized = post_json(&stack, &format!("{engine}/tokenize"), &prompt).await;
    assert_eq!(
        tokenized["count"],
        ids[0].len() + 1,
        "local-style encoding adds a BOS the body asked to leave out"
    );
    // Worker 9 (the same engine behind another id) holds both renders.
    stack.add_engine_holding(WorkerId(9), engine, &ids).await;

    for ((path, body), ids) in [
        ("/v1/completions", &completion),
        ("/v1/chat/completions", &chat),
    ]
    .into_iter()
    .zip(&ids)
    {
        let (status, worker, overlap, done) = send(&stack, path, body).await;
        assert_eq!(status, 200, "{path}: {done}");
        assert_eq!(worker, 9, "{path}: routed to the worker holding the render");
        assert_eq!(overlap, ids.len() as u64 / u64::from(BLOCK), "{path}");
        assert_eq!(done["usage"]["prompt_tokens"], ids.len(), "{path}: {done}");
    }
    assert_eq!(stage_count(&stack, "tokenize").await, 2.0);
    stack.stop().await;
}

/// What the engine's render refuses (a prompt over its context, a template error) is
/// the client's 400 with the engine's reason; with one engine dead, renders go to the
/// live one.
#[tokio::test]
async fn engine_refusals_are_400_and_a_dead_engine_is_skipped() {
    let mut stack = Stack::start(1, 10.0, |_| {}, &["--tokenize-via", "render"]).await;
    let over = json!({"model": MODEL, "prompt": "hello there", "max_tokens": 20_000});
    let (status, _, _, answer) = send(&stack, "/v1/completions", &over).await;
    assert_eq!(status, 400, "{answer}");
    assert!(
        message(&answer).contains("refused to tokenize")
            && message(&answer).contains("maximum context length"),
        "{answer}"
    );
    let tool = json!({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]});
    let (status, _, _, answer) = send(&stack, "/v1/chat/completions", &tool).await;
    assert_eq!(status, 400, "{answer}");
    assert!(message(&answer).contains("unsupported role"), "{answer}");

    // Worker 0 comes first in id order, and its engine is gone: each render that
    // starts there is asked of the live engine instead.
    let gone = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = format!("http://{}", gone.local_addr().unwrap());
    drop(gone);
    stack.add_engine_holding(WorkerId(0), dead, &[]).await;
    for i in 0..4 {
        let body = json!({"model": MODEL, "prompt": format!("prompt number {i}"), "max_tokens": 2});
        let (status, worker, _, answer) = send(&stack, "/v1/completions", &body).await;
        assert_eq!(status, 200, "request {i}: {answer}");
        assert_eq!(worker, 1, "the live engine served it");
    }
    stack.stop().await;
}

/// With `--render-url` every render goes to that server: its ids are routed on, a
/// render endpoint it lacks is a 502 that says what to do, a reply longer than the
/// longest allowed prompt is refused unread, and one that never comes is a 504 after
/// `--first-token-timeout-ms`.
#[tokio::test]
async fn a_render_url_is_used_for_every_render_and_its_failures_are_clear() {
    let server = RenderServer::start().await;
    let flags = [
        "--tokenize-via",
        "render",
        "--render-url",
        &server.url,
        "--first-token-timeout-ms",
        "1000",
    ];
    let mut stack = Stack::start(1, 10.0, |_| {}, &flags).await;
    let engine = stack.engines.http_urls()[0].clone();
    stack
        .add_engine_holding(WorkerId(9), engine, &[canned()])
        .await;

    let body = json!({"model": MODEL, "prompt": "any text at all", "max_tokens": 2});
    let (status, worker, overlap, done) = send(&stack, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{done}");
    // The engine holds the 4 blocks of the server's ids, which are the whole prompt:
    // it computes the last token again, so 3 are reusable.
    assert_eq!((worker, overlap), (9, 3), "routed on the server's ids");
    assert_eq!(done["usage"]["prompt_tokens"], canned().len(), "{done}");

    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, _, answer) = send(&stack, "/v1/chat/completions", &chat).await;
    assert_eq!(status, 502, "{answer}");
    let text = message(&answer);
    assert!(
        text.contains("/v1/chat/completions/render answered 404")
            && text.contains("VLLM_ENABLE_SCALE_OUT_ENDPOINTS=1")
            && text.contains("--render-url"),
        "{text}"
    );

    let huge = json!({"model": MODEL, "prompt": "huge"});
    let (status, _, _, answer) = send(&stack, "/v1/completions", &huge).await;
    assert_eq!(status, 400, "{answer}");
    assert!(
        message(&answer).contains("more than the 8000 tokens"),
        "{answer}"
    );

    let started = std::time::Instant::now();
    let hang = json!({"model": MODEL, "prompt": "hang"});
    let (status, _, _, answer) = send(&stack, "/v1/completions", &hang).await;
    assert_eq!(status, 504, "{answer}");
    assert!(message(&answer).contains("within 1000 ms"), "{answer}");
    assert!(started.elapsed() >= Duration::from_millis(1000));
    stack.stop().await;
}
