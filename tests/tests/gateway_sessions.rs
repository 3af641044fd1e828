//! Session affinity end to end: the gateway's `x-session-id` header reaches the real
//! router daemon as the route request's `session_id`, and a session's turns stay on
//! one worker while costs are level (nats-server, etcd, mock engines, daemon and
//! gateway all real, on loopback).

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

// The fixture is shared with gateway.rs, which uses all of it.
#[allow(dead_code)]
#[path = "gateway/fixture.rs"]
mod fixture;

use fixture::{MODEL, Stack};
use integration_tests::eventually;
use scheduler::SessionOutcome;
use serde_json::json;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(15);

/// Waits until nothing is booked, so the next turn sees level costs.
async fn freed(stack: &Stack) {
    eventually("the turn to be freed", WAIT, || async {
        (stack.booked() == 0).then_some(())
    })
    .await
    .unwrap();
}

/// POSTs a completion of `prompt` with an optional session header; returns the status.
async fn turn(stack: &Stack, prompt: Vec<u32>, session: Option<&str>) -> u16 {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}).to_string();
    let mut request = stack
        .http
        .post(format!("{}/v1/completions", stack.base))
        .header("content-type", "application/json")
        .body(body);
    if let Some(session) = session {
        request = request.header("x-session-id", session);
    }
    let status = request.send().await.unwrap().status().as_u16();
    freed(stack).await;
    status
}

#[tokio::test]
async fn turns_with_the_same_session_header_stay_on_one_worker_when_costs_are_level() {
    let stack = Stack::start(4, 10.0, |_| {}, &[]).await;
    let sessions = &stack.daemon().state().counters.metrics.sessions;
    // Unrelated prompts (no shared prefix, nothing cached for them anywhere) on idle
    // workers: every worker costs the same, and without affinity the tie is broken
    // at random among 4.
    const TURNS: u32 = 8;
    for n in 0..TURNS {
        let prompt: Vec<u32> = (0..40).map(|i| 1_000 * (n + 1) + i).collect();
        assert_eq!(turn(&stack, prompt, Some("conversation-7")).await, 200);
    }
    assert_eq!(
        sessions.decisions(SessionOutcome::Miss),
        1,
        "the first turn"
    );
    assert_eq!(
        sessions.decisions(SessionOutcome::Hit),
        u64::from(TURNS - 1),
        "every later turn went to the session's last worker"
    );
    assert_eq!(sessions.decisions(SessionOutcome::Override), 0);
    // Without the header nothing is counted; a malformed one is a 400, not routed.
    assert_eq!(turn(&stack, vec![7; 40], None).await, 200);
    assert_eq!(sessions.decisions(SessionOutcome::Miss), 1);
    let long = "s".repeat(kv_events::routing::MAX_SESSION_ID_BYTES + 1);
    assert_eq!(turn(&stack, vec![8; 40], Some(&long)).await, 400);
    assert_eq!(
        sessions.decisions(SessionOutcome::Hit) + sessions.decisions(SessionOutcome::Miss),
        u64::from(TURNS)
    );
    stack.stop().await;
}

/// One chat turn sent by the official `openai` client with `prompt_cache_key` set to
/// `key` (and the `x-session-id` header when `header` is given), then waits until it
/// is freed.
async fn openai_turn(stack: &Stack, key: &str, text: &str, header: Option<&str>) {
    let (python, script) = fixture::openai_python("session_turn.py").await;
    let mut args = vec![stack.base.as_str(), MODEL, key, text];
    args.extend(header);
    let seen = integration_tests::python::run_json(&python, &script, &args).await;
    assert!(seen["content"].is_string(), "an answer: {seen}");
    freed(stack).await;
}

#[tokio::test]
async fn the_openai_prompt_cache_key_names_the_session_and_the_header_wins() {
    let stack = Stack::start(4, 10.0, |_| {}, &[]).await;
    let sessions = &stack.daemon().state().counters.metrics.sessions;
    const TURNS: u64 = 5;
    for n in 0..TURNS {
        let text = format!("turn {n}: {}", "lorem ipsum ".repeat(5 + n as usize));
        openai_turn(&stack, "conversation-11", &text, None).await;
    }
    assert_eq!(
        sessions.decisions(SessionOutcome::Miss),
        1,
        "the first turn"
    );
    assert_eq!(
        sessions.decisions(SessionOutcome::Hit),
        TURNS - 1,
        "later turns went to the session's last worker"
    );
    // With both, the header names the session: "k-2" is never seen, so the turn that
    // sends only that key afterwards starts a session of its own.
    openai_turn(&stack, "k-2", "with both", Some("h-2")).await;
    openai_turn(&stack, "k-2", "key only", None).await;
    assert_eq!(
        sessions.decisions(SessionOutcome::Miss),
        3,
        "h-2 and then k-2 were new sessions"
    );
    stack.stop().await;
}
