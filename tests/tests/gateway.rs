//! End to end through the gateway: the official `openai` Python client and raw HTTP
//! against `kv-router gateway`, in front of the real router daemon and mock engines
//! that speak OpenAI HTTP, over real nats-server and etcd.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

#[path = "gateway/fixture.rs"]
mod fixture;

use fixture::{BLOCK, MODEL, Stack};
use futures::StreamExt;
use indexer::IndexerApi as _;
use integration_tests::eventually;
use kv_events::routing::{Prompt, RouteRequest};
use kv_events::{WorkerId, compute_block_hashes};
use serde_json::{Value, json};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(15);

fn metric(text: &str, line_prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// What `python/gateway_client.py` (the official `openai` client) saw of `stack`.
async fn openai_client(stack: &Stack) -> Value {
    let (python, script) = fixture::openai_python("gateway_client.py").await;
    integration_tests::python::run_json(&python, &script, &[&stack.base, MODEL]).await
}

#[tokio::test]
async fn the_openai_client_gets_completions_and_chats_streamed_and_whole() {
    let stack = Stack::start(2, 10.0, |_| {}, &[]).await;
    let seen = openai_client(&stack).await;

    assert_eq!(seen["models"], json!([MODEL]));
    fixture::assert_openai_client_saw(&seen);
    let done = &seen["completion"];
    assert!(!done["text"].as_str().unwrap().is_empty(), "{done}");
    let prompt_tokens = done["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 10 * u64::from(BLOCK), "{done}");
    let streamed = &seen["completion_stream"];
    assert!(
        streamed["chunks"].as_u64().unwrap() >= 6,
        "one chunk per token: {streamed}"
    );
    let chat = &seen["chat"];
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["role"], "assistant");
    let chat_stream = &seen["chat_stream"];
    assert!(
        chat_stream["chunks"].as_u64().unwrap() >= 4,
        "{chat_stream}"
    );

    // Every request ended: nothing is booked in the router, nothing in flight here.
    eventually("bookings to be freed", WAIT, || async {
        (stack.booked() == 0).then_some(())
    })
    .await
    .unwrap();
    let text = stack.metrics().await;
    assert_eq!(metric(&text, "kv_gateway_requests_in_flight"), 0.0);
    assert_eq!(
        metric(
            &text,
            r#"kv_gateway_requests_total{endpoint="completions",status="200"}"#
        ),
        2.0
    );
    assert_eq!(
        metric(
            &text,
            r#"kv_gateway_requests_total{endpoint="chat_completions",status="200"}"#
        ),
        2.0
    );
    assert_eq!(
        metric(
            &text,
            r#"kv_gateway_requests_total{endpoint="completions",status="404"}"#
        ),
        1.0
    );
    assert_eq!(metric(&text, "kv_gateway_completion_tokens_total"), 19.0);
    stack.stop().await;
}

#[tokio::test]
async fn a_repeated_prompt_lands_on_the_worker_that_cached_it_with_full_overlap() {
    let stack = Stack::start(4, 10.0, |_| {}, &[]).await;
    // The gateway hashes the prompt's full blocks itself: its route requests carry
    // block hashes, not token ids (seen by a plain subscriber of the route subjects:
    // the queue group's and, once the gateway pins to the replica, the replica's own;
    // the gateway's readiness probes left out).
    let (nats, subjects) = (&stack.cluster.nats, &stack.cluster.subjects);
    let mut routes = futures::stream::select_all([
        nats.subscribe(subjects.route()).await.unwrap(),
        nats.subscribe(subjects.route_at_any()).await.unwrap(),
    ])
    .filter_map(|message| async move {
        let request: RouteRequest = kv_events::decode(&message.payload).unwrap();
        (request.request_id.0 != "gateway-readiness-probe").then_some(request)
    })
    .boxed();
    kv_cluster::barrier::server_barrier(&stack.cluster.nats)
        .await
        .unwrap();
    // 20 full blocks and a partial one.
    let tokens: Vec<u32> = (100..100 + 20 * BLOCK + 3).collect();
    let body = json!({"model": MODEL, "prompt": tokens, "max_tokens": 2}).to_string();
    let first: Value = stack
        .post("/v1/completions", body.clone())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(first["usage"]["prompt_tokens"], 20 * BLOCK + 3);
    let hashes = compute_block_hashes(&tokens, BLOCK);
    let routed = routes.next().await.unwrap();
    assert_eq!(
        routed.prompt,
        Prompt::Blocks {
            block_hashes: hashes.clone(),
            num_tokens: u64::from(20 * BLOCK + 3),
        }
    );
    // The engine's KV events reach the index: some worker holds all 20 blocks.
    let daemon = stack.daemon();
    eventually("the prompt to be indexed", WAIT, || async {
        let scores = daemon
            .state()
            .indexer
            .find_matches(hashes.clone())
            .await
            .ok()?;
        scores
            .scores
            .values()
            .any(|&blocks| blocks == 20)
            .then_some(())
    })
    .await
    .unwrap();
    let second: Value = stack
        .post("/v1/completions", body)
        .await
        .json()
        .await
        .unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= u64::from(19 * BLOCK),
        "the engine served it from cache: {second}"
    );
    let text = stack.metrics().await;
    let routed = metric(&text, "kv_gateway_overlap_ratio_count");
    let below_full = metric(&text, r#"kv_gateway_overlap_ratio_bucket{le="0.9"}"#);
    assert_eq!(routed, 2.0);
    assert_eq!(
        routed - below_full,
        1.0,
        "the second overlapped every full block (20 of 21):\n{text}"
    );
    stack.stop().await;
}

#[tokio::test]
async fn malformed_and_oversized_requests_get_openai_errors() {
    let stack = Stack::start(1, 10.0, |_| {}, &["--max-body-bytes", "4096"]).await;
    for (body, status) in [
        ("{\"model\": \"tiny\", \"prompt\": ".to_owned(), 400),
        ("[1, 2]".to_owned(), 400),
        (json!({"model": MODEL}).to_string(), 400),
        (
            json!({"model": MODEL, "prompt": "x".repeat(5000)}).to_string(),
            413,
        ),
        (
            json!({"model": MODEL, "prompt": (0..9000).collect::<Vec<u32>>()}).to_string(),
            413,
        ),
    ] {
        let response = stack.post("/v1/completions", body.clone()).await;
        assert_eq!(response.status(), status, "{}", &body[..body.len().min(80)]);
        let error: Value = response.json().await.unwrap();
        assert!(error["error"]["message"].is_string(), "{error}");
        assert_eq!(error["error"]["code"], status);
    }
    // More tokens than --max-prompt-tokens (8000 here), in a body under the size limit.
    let stack2 = Stack::start(1, 10.0, |_| {}, &[]).await;
    let response = stack2
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": (0..8001).collect::<Vec<u32>>()}).to_string(),
        )
        .await;
    assert_eq!(response.status(), 400);
    assert_eq!(stack.booked() + stack2.booked(), 0, "nothing was routed");
    stack.stop().await;
    stack2.stop().await;
}

#[tokio::test]
async fn clients_that_disconnect_mid_stream_leave_no_booking() {
    // Time scale 1: 400 tokens take seconds, so the clients leave mid-stream.
    let stack = Stack::start(2, 1.0, |_| {}, &[]).await;
    let mut streams = Vec::new();
    for i in 0..6u32 {
        let body = json!({
            "model": MODEL,
            "prompt": (i * 1000..i * 1000 + 64).collect::<Vec<u32>>(),
            "max_tokens": 400,
            "stream": true,
        });
        let response = stack.post("/v1/completions", body.to_string()).await;
        assert_eq!(response.status(), 200);
        let mut chunks = response.bytes_stream();
        let first = chunks.next().await.unwrap().unwrap();
        assert!(first.starts_with(b"data: {"), "{first:?}");
        streams.push(chunks);
    }
    assert_eq!(stack.booked(), 6, "all six are booked while they stream");
    drop(streams); // every client goes away mid-answer
    eventually("the router's load to return to zero", WAIT, || async {
        (stack.booked() == 0).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(stack.gateway().metrics().in_flight().get(), 0);
    stack.stop().await;
}

#[tokio::test]
async fn an_engine_that_refuses_connections_is_failed_over_before_the_first_token() {
    let mut stack = Stack::start(2, 10.0, |_| {}, &[]).await;
    // Worker 9 holds the prompt, so the router picks it first, but its engine is gone:
    // its port refuses connections.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let tokens: Vec<u32> = (5000..5000 + 8 * BLOCK).collect();
    stack
        .add_engine_holding(WorkerId(9), dead_url, std::slice::from_ref(&tokens))
        .await;

    let body = json!({"model": MODEL, "prompt": tokens, "max_tokens": 3, "stream": true});
    let response = stack.post("/v1/completions", body.to_string()).await;
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(stack.gateway().metrics().retries("connect"), 1);
    eventually("bookings to be freed", WAIT, || async {
        (stack.booked() == 0).then_some(())
    })
    .await
    .unwrap();
    stack.stop().await;
}

#[tokio::test]
async fn an_overloaded_router_is_429_with_retry_after() {
    // One block of decode load makes a rank busy, and nothing may wait in the queue.
    let stack = Stack::start(
        1,
        1.0,
        |args| {
            args.scheduling.scheduler.busy_decode_blocks = Some("1".parse().unwrap());
            args.scheduling.queue_capacity = 0;
        },
        &[],
    )
    .await;
    let long = json!({"model": MODEL, "prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 300, "stream": true});
    let busy = stack.post("/v1/completions", long.to_string()).await;
    assert_eq!(busy.status(), 200);
    let mut held = busy.bytes_stream();
    held.next().await.unwrap().unwrap();
    let response = stack
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}).to_string(),
        )
        .await;
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "1");
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["type"], "rate_limit_error");
    drop(held);
    stack.stop().await;
}

/// Also: the gateway's header-read timeout (300 ms here) closes a connection that
/// sends nothing, and does not cut a stream that lasts far longer.
#[tokio::test]
async fn a_long_stream_keeps_its_booking_alive() {
    use router_daemon::counters::{MessageKind, Outcome};
    use tokio::io::AsyncReadExt;
    let flags = ["--keep-alive-s", "1", "--header-read-timeout-ms", "300"];
    let stack = Stack::start(1, 1.0, |_| {}, &flags).await;
    let mut idle = tokio::net::TcpStream::connect(stack.gateway().local_addr())
        .await
        .unwrap();
    let body = json!({
        "model": MODEL,
        "prompt": (0..64).collect::<Vec<u32>>(),
        "max_tokens": 1000,
        "stream": true,
    });
    let response = stack.post("/v1/completions", body.to_string()).await;
    assert_eq!(response.status(), 200);
    let mut chunks = response.bytes_stream();
    chunks.next().await.unwrap().unwrap();
    let counters = &stack.daemon().state().counters;
    // One prefill_done, then keep_alive every second while the stream runs.
    eventually("a keep_alive to reach the router", WAIT, || async {
        (counters.messages(MessageKind::Lifecycle, Outcome::Ok) >= 2).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(stack.booked(), 1, "still streaming, still booked");
    let more = chunks.next().await.unwrap().unwrap();
    assert!(
        !more.is_empty(),
        "the stream goes on past the header-read timeout"
    );
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(WAIT, idle.read(&mut buf)).await;
    assert_eq!(
        read.unwrap().unwrap_or(0),
        0,
        "the idle connection was closed"
    );
    drop(chunks);
    eventually("the booking to be freed", WAIT, || async {
        (stack.booked() == 0).then_some(())
    })
    .await
    .unwrap();
    stack.stop().await;
}

#[tokio::test]
async fn engine_side_tokenization_routes_on_the_engines_own_token_ids() {
    let stack = Stack::start(1, 10.0, |_| {}, &["--tokenize-via", "engine"]).await;
    let prompt = "word1 word2 word3 ".repeat(40);
    let engine = stack.gateway().workers().any_url().unwrap();
    let tokenized: Value = stack
        .http
        .post(format!("{engine}/tokenize"))
        .json(&json!({ "prompt": prompt }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let count = tokenized["count"].as_u64().unwrap();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    let response = stack.post("/v1/completions", body.to_string()).await;
    assert_eq!(response.status(), 200);
    let done: Value = response.json().await.unwrap();
    assert_eq!(done["usage"]["prompt_tokens"], count, "{done}");
    let text = stack.metrics().await;
    assert_eq!(
        metric(&text, r#"kv_gateway_stage_seconds_count{stage="tokenize"}"#),
        1.0
    );
    stack.stop().await;
}

/// `--chat-forward passthrough`: chats go to the engine's own `/v1/chat/completions`
/// as the client sent them. The official client gets chat shapes, streamed and whole,
/// and a repeated chat lands on the worker that cached it: the router's overlap (the
/// gateway's rendering and tokenization) matches the prefix the engine itself found
/// cached (its own rendering), block for block.
#[tokio::test]
async fn passthrough_chats_reach_the_engines_chat_endpoint_with_token_parity() {
    let stack = Stack::start(2, 10.0, |_| {}, &["--chat-forward", "passthrough"]).await;
    let seen = openai_client(&stack).await;
    let chat = &seen["chat"];
    assert_eq!(chat["object"], "chat.completion", "{chat}");
    assert_eq!(chat["role"], "assistant");
    assert_eq!(chat["completion_tokens"], 4);
    let chat_stream = &seen["chat_stream"];
    assert_eq!(chat_stream["first_role"], "assistant", "{chat_stream}");
    assert_eq!(chat_stream["last_finish_reason"], "length");

    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me about word ".repeat(60)}],
        "max_tokens": 2,
    })
    .to_string();
    let header = |r: &reqwest::Response, name: &str| -> u64 {
        r.headers()[name].to_str().unwrap().parse().unwrap()
    };
    let first = stack.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(first.status(), 200);
    let worker = header(&first, "x-kv-router-worker-id");
    let _: Value = first.json().await.unwrap();
    eventually("the first chat to be freed", WAIT, || async {
        (stack.booked() == 0).then_some(())
    })
    .await
    .unwrap();
    let second = stack.post("/v1/chat/completions", body).await;
    assert_eq!(second.status(), 200);
    assert_eq!(header(&second, "x-kv-router-worker-id"), worker);
    let overlap = header(&second, "x-kv-router-overlap-blocks");
    let done: Value = second.json().await.unwrap();
    let prompt_tokens = done["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = done["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(overlap, prompt_tokens / u64::from(BLOCK), "{done}");
    assert_eq!(cached, overlap * u64::from(BLOCK), "{done}");
    stack.stop().await;
}
