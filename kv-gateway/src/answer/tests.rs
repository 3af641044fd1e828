//! Unit tests of [`Answer`]: relaying, rewriting and assembling engine events.

use super::*;
use kv_cluster::metrics;
use std::time::Duration;

fn event(data: &str) -> Event {
    Event {
        data: data.to_owned(),
        ..Event::default()
    }
}

fn answer(shape: Shape, include_usage: bool, rest: &[&str], first: &str) -> Answer {
    let events: Vec<Result<Event, String>> = rest.iter().map(|d| Ok(event(d))).collect();
    let metrics = metrics::unregistered(GatewayMetrics::new);
    metrics.in_flight().inc();
    let now = Instant::now();
    Answer {
        first: Some(event(first)),
        events: Box::pin(futures::stream::iter(events)),
        booking: None,
        shape,
        stream: false,
        include_usage,
        deadline: now + Duration::from_secs(5),
        idle: Duration::from_secs(5),
        metrics,
        endpoint: "completions",
        arrived: now,
        last: now,
        roles_sent: HashSet::new(),
        finished: false,
        parity: None,
    }
}

const C1: &str = r#"{"id":"cmpl-7","object":"text_completion","created":5,"model":"m","choices":[{"index":0,"text":" a","finish_reason":null}]}"#;
const C2: &str = r#"{"id":"cmpl-7","object":"text_completion","created":5,"model":"m","choices":[{"index":0,"text":" b","finish_reason":"length"}]}"#;
const USAGE: &str = r#"{"id":"cmpl-7","object":"text_completion","created":5,"model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;

async fn body_text(body: Body) -> String {
    let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn a_stream_is_relayed_and_the_usage_chunk_only_when_asked() {
    let sse =
        body_text(answer(Shape::Completion, false, &[C2, USAGE, "[DONE]"], C1).into_sse()).await;
    let lines: Vec<&str> = sse.split("\n\n").filter(|l| !l.is_empty()).collect();
    // Passed on byte for byte, as the engine wrote them.
    assert_eq!(
        lines,
        [
            format!("data: {C1}"),
            format!("data: {C2}"),
            "data: [DONE]".into()
        ]
    );
    let with_usage =
        body_text(answer(Shape::Completion, true, &[C2, USAGE, "[DONE]"], C1).into_sse()).await;
    assert!(
        with_usage.contains(r#""completion_tokens":2"#),
        "{with_usage}"
    );
}

#[tokio::test]
async fn completion_chunks_become_chat_chunks_with_the_role_once() {
    let sse =
        body_text(answer(Shape::ChatFromCompletion, true, &[C2, USAGE, "[DONE]"], C1).into_sse())
            .await;
    let chunks: Vec<Value> = sse
        .split("\n\n")
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["id"], "chatcmpl-7");
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": " a"})
    );
    assert_eq!(chunks[1]["choices"][0]["delta"], json!({"content": " b"}));
    assert_eq!(chunks[1]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[2]["usage"]["total_tokens"], 5);
}

#[tokio::test]
async fn a_non_streaming_answer_is_assembled() {
    let whole = answer(Shape::Completion, false, &[C2, USAGE, "[DONE]"], C1)
        .collect()
        .await
        .unwrap();
    assert_eq!(whole["object"], "text_completion");
    assert_eq!(whole["choices"][0]["text"], " a b");
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    assert_eq!(whole["usage"]["completion_tokens"], 2);
    let chat = answer(Shape::ChatFromCompletion, false, &[C2, USAGE, "[DONE]"], C1)
        .collect()
        .await
        .unwrap();
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(
        chat["choices"][0]["message"],
        json!({"role": "assistant", "content": " a b"})
    );
}

#[tokio::test]
async fn pass_through_chat_deltas_with_tool_calls_are_assembled() {
    let d1 = r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get_","arguments":"{\"a\""}}]},"finish_reason":null}]}"#;
    let d2 = r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"weather","arguments":":1}"}}]},"finish_reason":"tool_calls"}]}"#;
    let chat = answer(Shape::Chat, false, &[d2, "[DONE]"], d1)
        .collect()
        .await
        .unwrap();
    let call = &chat["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["id"], "call_1");
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(call["function"]["arguments"], "{\"a\":1}");
    assert_eq!(chat["choices"][0]["finish_reason"], "tool_calls");
}

#[tokio::test]
async fn an_engine_failure_mid_stream_ends_with_an_error_event() {
    let sse = body_text(
        answer(
            Shape::Completion,
            false,
            &[r#"{"error":{"message":"engine died"}}"#],
            C1,
        )
        .into_sse(),
    )
    .await;
    assert!(sse.contains(r#""text":" a""#), "{sse}");
    assert!(sse.contains(r#""message":"engine died""#), "{sse}");
    assert!(sse.ends_with("data: [DONE]\n\n"), "{sse}");
    // A stream that just stops is a failure too, not a silent end.
    let cut = body_text(answer(Shape::Completion, false, &[], C1).into_sse()).await;
    assert!(cut.contains("closed the stream early"), "{cut}");
    let err = answer(Shape::Completion, false, &[], C1)
        .collect()
        .await
        .unwrap_err();
    assert!(err.contains("closed the stream early"), "{err}");
}

#[tokio::test]
async fn the_in_flight_gauge_returns_to_zero_on_every_end() {
    let a = answer(Shape::Completion, false, &[C2, "[DONE]"], C1);
    let metrics = a.metrics.clone();
    assert_eq!(metrics.in_flight().get(), 1);
    drop(a); // the client went away before reading anything
    assert_eq!(metrics.in_flight().get(), 0);
}

#[tokio::test(start_paused = true)]
async fn an_engine_silent_past_the_idle_timeout_ends_the_answer() {
    let mut silent = answer(Shape::Completion, false, &[], C1);
    silent.events = Box::pin(futures::stream::pending());
    silent.idle = Duration::from_millis(300);
    let error = silent.collect().await.unwrap_err();
    assert!(error.contains("sent nothing for 300 ms"), "{error}");
}

#[tokio::test]
async fn a_passed_through_stream_still_sees_errors_and_usage() {
    let metrics = metrics::unregistered(GatewayMetrics::new);
    let mut relayed = answer(Shape::Completion, true, &[USAGE, "[DONE]"], C1);
    relayed.metrics = metrics.clone();
    let sse = body_text(relayed.into_sse()).await;
    assert!(sse.contains(USAGE), "{sse}");
    assert_eq!(metrics.completion_tokens_total(), 2);

    let failing = r#"{"error":{"message":"KV cache exhausted","code":500}}"#;
    let sse = body_text(answer(Shape::Chat, false, &[failing, C2], C1).into_sse()).await;
    assert!(
        sse.contains("KV cache exhausted") && sse.contains("engine_error"),
        "{sse}"
    );
    assert!(
        !sse.contains(r#""text":" b""#),
        "nothing after the error: {sse}"
    );
    let garbage = body_text(answer(Shape::Chat, false, &["<html>"], C1).into_sse()).await;
    assert!(garbage.contains("not JSON"), "{garbage}");
}

#[tokio::test]
async fn the_engines_cached_tokens_are_judged_once_whether_streamed_or_assembled() {
    use crate::parity::tests::{monitor, outcome};
    use kv_events::WorkerId;
    // 1-token blocks: of a 3-token prompt at most 2 can be cached.
    let (monitor, registry, _) = monitor(1);
    let count = |o: &str| outcome(&registry, o);
    let judged = |shape, include_usage, rest: &[&str], overlap| {
        let mut a = answer(shape, include_usage, rest, C1);
        a.parity = monitor.pending(WorkerId(1), overlap, 0, 3);
        a
    };
    // Streamed to a client that did not ask for usage: the chunk is peeked at, then
    // dropped.
    let rest = &[C2, CACHED, "[DONE]"];
    let sse = body_text(judged(Shape::Completion, false, rest, 2).into_sse()).await;
    assert!(!sse.contains("cached_tokens"), "{sse}");
    assert_eq!(count("agree"), 1.0);
    // Parsed (a chat from completion chunks), and assembled.
    body_text(judged(Shape::ChatFromCompletion, true, rest, 2).into_sse()).await;
    assert_eq!(count("agree"), 2.0);
    judged(Shape::Completion, false, rest, 1)
        .collect()
        .await
        .unwrap();
    assert_eq!(count("under_claim"), 1.0);
    // Usage without a cached count, or none at all: unreported.
    let no_cached = &[C2, USAGE, "[DONE]"];
    judged(Shape::Completion, false, no_cached, 1)
        .collect()
        .await
        .unwrap();
    body_text(judged(Shape::Completion, false, &[C2, "[DONE]"], 1).into_sse()).await;
    assert_eq!(count("unreported"), 2.0);
    assert_eq!(
        count("agree") + count("over_claim"),
        2.0,
        "each judged once"
    );
}

const CACHED: &str = r#"{"id":"cmpl-7","object":"text_completion","created":5,"model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":{"cached_tokens":2}}}"#;
