//! The gateway's prompt bound comes from the engines' context length (issue 24): mock
//! engines register their `max_model_len`, and without `--max-prompt-tokens` the
//! gateway refuses what they would refuse before routing it, follows the bound as
//! workers come and go, and lets an explicit flag win. Real nats-server, etcd, router
//! daemon, mock engines and gateway.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

// The fixture is shared with gateway.rs, which uses all of it.
#[allow(dead_code)]
#[path = "gateway/fixture.rs"]
mod fixture;

use fixture::{BLOCK, MODEL, Stack, StackEngines};
use integration_tests::{TestCluster, eventually, register_worker};
use kv_events::WorkerId;
use kv_events::discovery::WorkerRegistration;
use router_daemon::counters::{MessageKind, Outcome};
use serde_json::{Value, json};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(15);

/// Engines serving a 1,024-token context, behind a gateway given `flags`.
async fn stack(flags: &[&str]) -> Stack {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let engines = StackEngines {
        workers: 2,
        time_scale: 10.0,
        max_model_len: Some(1024),
    };
    Stack::start_with(cluster, engines, |_| {}, flags).await
}

/// Route requests the router answered.
fn routed(stack: &Stack) -> u64 {
    let counters = &stack.daemon().state().counters;
    counters.messages(MessageKind::Route, Outcome::Ok)
}

/// A completion of `prompt_tokens` token ids, asking for `max_tokens` when given: the
/// status and the body.
async fn complete(stack: &Stack, prompt_tokens: u32, max_tokens: Option<u64>) -> (u16, Value) {
    let mut body = json!({"model": MODEL, "prompt": (0..prompt_tokens).collect::<Vec<u32>>()});
    if let Some(max_tokens) = max_tokens {
        body["max_tokens"] = json!(max_tokens);
    }
    let response = stack.post("/v1/completions", body.to_string()).await;
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// Asserts that a completion of `prompt_tokens` ids asking for `max_tokens` is a 400
/// whose message contains `says`.
async fn refused(stack: &Stack, prompt_tokens: u32, max_tokens: Option<u64>, says: &str) {
    let (status, body) = complete(stack, prompt_tokens, max_tokens).await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "{prompt_tokens} tokens: {body}");
}

/// Without `--max-prompt-tokens`, the engines' 1,024-token context is the bound, with
/// vLLM's checks and words: a 1,100-token prompt, a 1,024-token one, and one of 1,000
/// asking for 100 more are refused before anything is routed (so no engine sees them);
/// a 900-token prompt is served. On the old code the bound was 131,072 tokens: the
/// refused prompts were routed and forwarded, to be refused by the engine.
#[tokio::test]
async fn prompts_over_the_engines_context_length_are_refused_before_routing() {
    let stack = stack(&[]).await;
    assert_eq!(
        stack.gateway().workers().max_model_len().map(|l| l.get()),
        Some(1024),
        "the engines registered their context length"
    );

    let context = "This model's maximum context length is 1024 tokens. However, your request";
    refused(
        &stack,
        1100,
        None,
        &format!("{context} has 1100 input tokens"),
    )
    .await;
    // No room for one output token.
    refused(
        &stack,
        1024,
        Some(1),
        &format!("{context} has 1024 input tokens"),
    )
    .await;
    let output = "'max_tokens' or 'max_completion_tokens' is too large: 100";
    refused(&stack, 1000, Some(100), output).await;
    let chat = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_completion_tokens": 2000,
    });
    let response = stack.post("/v1/chat/completions", chat.to_string()).await;
    assert_eq!(
        response.status(),
        400,
        "a chat's max_completion_tokens counts"
    );
    assert_eq!(
        routed(&stack),
        0,
        "nothing was routed, so nothing forwarded"
    );

    let (status, body) = complete(&stack, 900, Some(4)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 900);
    assert_eq!(routed(&stack), 1);
    stack.stop().await;
}

/// The bound follows the registrations: a worker registering a 512-token context
/// lowers it for every request after, and its leaving raises it again. On the old
/// code neither registration changed the bound.
#[tokio::test]
async fn the_bound_follows_workers_as_they_come_and_go() {
    let mut stack = stack(&[]).await;
    let (status, body) = complete(&stack, 600, Some(4)).await;
    assert_eq!(status, 200, "{body}");

    let small = WorkerRegistration {
        worker_id: WorkerId(77),
        dp_size: 1,
        block_size: BLOCK,
        total_kv_blocks: 64,
        url: Some("http://127.0.0.1:9".into()),
        epoch: 0,
        max_model_len: Some(512),
        role: Default::default(),
        kv_transfer: None,
    };
    let cluster = &mut stack.cluster;
    let lease = register_worker(&mut cluster.etcd, &cluster.subjects, &small, 30)
        .await
        .unwrap();
    let bound = |stack: &Stack| stack.gateway().workers().max_model_len().map(|l| l.get());
    eventually("the gateway to see the 512-token worker", WAIT, || async {
        (bound(&stack) == Some(512)).then_some(())
    })
    .await
    .unwrap();
    let before = routed(&stack);
    refused(&stack, 600, Some(4), "maximum context length is 512 tokens").await;
    assert_eq!(routed(&stack), before, "refused before routing");

    stack.cluster.etcd.lease_revoke(lease).await.unwrap();
    eventually("the gateway to forget it", WAIT, || async {
        (bound(&stack) == Some(1024)).then_some(())
    })
    .await
    .unwrap();
    let (status, body) = complete(&stack, 600, Some(4)).await;
    assert_eq!(status, 200, "{body}");
    stack.stop().await;
}

/// An explicit `--max-prompt-tokens` wins over the engines' context length, either
/// way: 2,048 lets a 1,100-token prompt through to the engine (which refuses it in
/// its own words), and refuses a 2,100-token one before routing it. (This was the old
/// code's behaviour too: the rule guarded here is that the engines' bound does not
/// override an operator's.)
#[tokio::test]
async fn an_explicit_max_prompt_tokens_wins() {
    let stack = stack(&["--max-prompt-tokens", "2048"]).await;
    // The engine's refusal (the mock engine's words), not the gateway's.
    refused(&stack, 1100, None, "1024 tokens, but").await;
    assert_eq!(routed(&stack), 1, "routed and forwarded");
    refused(&stack, 2100, None, "more than the 2048 allowed").await;
    assert_eq!(routed(&stack), 1, "not routed");
    stack.stop().await;
}
