//! The gateway's tokenization bounds end to end (nats-server, etcd, mock engines,
//! daemon and gateway all real, on loopback): a bounded tokenizer pool that refuses
//! at once when full while requests that need no tokenization go on, and a prompt
//! byte bound checked before anything is encoded.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

// The fixture is shared with gateway.rs, which uses all of it.
#[allow(dead_code)]
#[path = "gateway/fixture.rs"]
mod fixture;

use fixture::{MODEL, Stack};
use futures::StreamExt;
use integration_tests::eventually;
use serde_json::{Value, json};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(15);

/// English-like text of exactly `bytes` bytes (ASCII).
fn text(bytes: usize) -> String {
    let words = "the router sends each request to a worker whose cache already holds \
                 its prefix while the gateway keeps streams flowing ";
    words.chars().cycle().take(bytes).collect()
}

/// The count of `kv_gateway_stage_seconds` observations of `stage` on `/metrics`.
async fn stage_count(stack: &Stack, stage: &str) -> f64 {
    let text = stack
        .http
        .get(format!("{}/metrics", stack.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let prefix = format!("kv_gateway_stage_seconds_count{{stage=\"{stage}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

#[tokio::test]
async fn a_full_tokenizer_pool_refuses_text_at_once_while_token_ids_are_served() {
    let stack = Stack::start(
        1,
        10.0,
        |_| {},
        &[
            "--tokenizer-threads",
            "1",
            "--tokenizer-queue",
            "0",
            "--max-prompt-bytes",
            "8000000",
        ],
    )
    .await;
    let metrics = stack.gateway().metrics().clone();
    // A prompt whose encode takes seconds here (over the 8000-token limit, so it
    // would end in a 400): it holds the one tokenizer thread meanwhile.
    let long = json!({"model": MODEL, "prompt": text(1_500_000)}).to_string();
    let (http, url) = (stack.http.clone(), format!("{}/v1/completions", stack.base));
    let first = tokio::spawn(async move {
        let response = http.post(url).body(long).send().await.unwrap();
        response.status().as_u16()
    });
    eventually("the long prompt to hold the tokenizer", WAIT, || async {
        (metrics.tokenize_jobs().get() == 1).then_some(())
    })
    .await
    .unwrap();

    // Another text prompt, and a chat: refused at once with 503 and Retry-After.
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "hello there", "max_tokens": 2}),
        ),
        ("/v1/chat/completions", chat),
    ] {
        let response = stack.post(path, body.to_string()).await;
        assert_eq!(response.status(), 503, "{path}");
        assert_eq!(response.headers()["retry-after"], "1", "{path}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["type"], "service_unavailable", "{error}");
        assert_eq!(error["error"]["code"], 503, "{error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("tokenizer is busy"), "{message}");
    }
    assert_eq!(metrics.tokenize_rejections("queue_full"), 2);

    // A prompt of token ids needs no tokenizer: streamed to its end meanwhile.
    let body = json!({
        "model": MODEL, "prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 4,
        "stream": true,
    });
    let response = stack.post("/v1/completions", body.to_string()).await;
    assert_eq!(response.status(), 200);
    let mut stream = response.bytes_stream();
    let mut seen = Vec::new();
    while let Some(chunk) = stream.next().await {
        seen.extend_from_slice(&chunk.unwrap());
    }
    assert!(
        String::from_utf8_lossy(&seen).contains("data: [DONE]"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
    // All of that happened while the long prompt was still being tokenized.
    assert!(!first.is_finished(), "the long prompt was still pending");
    assert_eq!(metrics.tokenize_jobs().get(), 1);
    first.abort();
    stack.stop().await;
}

#[tokio::test]
async fn a_prompt_over_the_byte_bound_is_refused_before_it_is_tokenized() {
    let stack = Stack::start(1, 10.0, |_| {}, &["--max-prompt-bytes", "4096"]).await;
    let encoded = stage_count(&stack, "tokenize").await;
    let queued = stage_count(&stack, "tokenize_queue").await;

    let over = json!({"model": MODEL, "prompt": text(4097), "max_tokens": 2});
    let response = stack.post("/v1/completions", over.to_string()).await;
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("4097 bytes") && message.contains("4096 bytes"),
        "{message}"
    );
    assert_eq!(
        stage_count(&stack, "tokenize").await,
        encoded,
        "not encoded"
    );
    assert_eq!(
        stage_count(&stack, "tokenize_queue").await,
        queued,
        "not queued"
    );

    // A chat whose rendered text is over the bound: rendered, never encoded.
    let chat = json!({
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": text(4090)}],
    });
    let response = stack.post("/v1/chat/completions", chat.to_string()).await;
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("over the limit of 4096 bytes"),
        "{message}"
    );
    assert_eq!(
        stage_count(&stack, "tokenize").await,
        encoded,
        "not encoded"
    );

    // At the bound: tokenized and served.
    let at = json!({"model": MODEL, "prompt": text(4096), "max_tokens": 2});
    let response = stack.post("/v1/completions", at.to_string()).await;
    assert_eq!(response.status(), 200, "{:?}", response.text().await);
    assert_eq!(stage_count(&stack, "tokenize").await, encoded + 1.0);
    stack.stop().await;
}

/// `usage.prompt_tokens` of a non-streamed request.
async fn prompt_tokens(stack: &Stack, path: &str, body: &Value) -> u64 {
    let response = stack.post(path, body.to_string()).await;
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    answer["usage"]["prompt_tokens"].as_u64().unwrap()
}

#[tokio::test]
async fn a_conversation_and_shared_documents_are_encoded_once() {
    let stack = Stack::start(1, 10.0, |_| {}, &[]).await;
    let metrics = stack.gateway().metrics().clone();
    let tokenizer = kv_tokenizer::ModelTokenizer::from_dir(
        fixture::model_dir(),
        kv_tokenizer::TokenizerLimits::default(),
    )
    .unwrap();

    // A chat's second turn resends the first: its pieces come from the cache, and the
    // engine gets exactly the ids of encoding the whole chat.
    let mut messages = vec![
        json!({"role": "system", "content": text(600)}),
        json!({"role": "user", "content": text(300)}),
    ];
    let chat =
        |messages: &Vec<Value>| json!({"model": MODEL, "max_tokens": 2, "messages": messages});
    prompt_tokens(&stack, "/v1/chat/completions", &chat(&messages)).await;
    let before = metrics.tokenized_tokens("cache");
    messages.push(json!({"role": "assistant", "content": "a short answer"}));
    messages.push(json!({"role": "user", "content": "and a follow-up question"}));
    let tokens = prompt_tokens(&stack, "/v1/chat/completions", &chat(&messages)).await;
    let parsed: Vec<kv_tokenizer::ChatMessage> =
        serde_json::from_value(Value::Array(messages)).unwrap();
    let whole = tokenizer
        .encode_chat(&parsed, &kv_tokenizer::ChatOptions::default())
        .unwrap();
    assert_eq!(tokens, whole.len() as u64);
    let from_cache = metrics.tokenized_tokens("cache") - before;
    assert!(
        from_cache > 100,
        "{from_cache} of {tokens} tokens from the cache"
    );

    // Completions built from shared documents, each behind a BOS (as aiperf writes a
    // trace's blocks): the documents already seen are not encoded again.
    let docs = [
        "<|bos|>".to_owned() + &text(900),
        "<|bos|>".to_owned() + &text(700),
    ];
    let prompt =
        |tail: &str| json!({"model": MODEL, "max_tokens": 2, "prompt": docs.concat() + tail});
    prompt_tokens(&stack, "/v1/completions", &prompt("<|bos|>first question")).await;
    let before = metrics.tokenized_tokens("cache");
    let second = docs.concat() + "<|bos|>second question";
    let tokens = prompt_tokens(&stack, "/v1/completions", &prompt("<|bos|>second question")).await;
    assert_eq!(
        tokens,
        tokenizer.encode_completion(&second).unwrap().len() as u64
    );
    let from_cache = metrics.tokenized_tokens("cache") - before;
    assert!(
        from_cache > 300,
        "{from_cache} of {tokens} tokens from the cache"
    );
    stack.stop().await;
}

#[tokio::test]
async fn a_zero_cache_encodes_every_token() {
    let stack = Stack::start(1, 10.0, |_| {}, &["--tokenizer-cache-mib", "0"]).await;
    let metrics = stack.gateway().metrics().clone();
    let prompt = "<|bos|>".to_owned() + &text(500) + "<|bos|>question";
    let body = json!({"model": MODEL, "max_tokens": 2, "prompt": prompt});
    let first = prompt_tokens(&stack, "/v1/completions", &body).await;
    let second = prompt_tokens(&stack, "/v1/completions", &body).await;
    assert_eq!(first, second);
    assert_eq!(metrics.tokenized_tokens("cache"), 0);
    assert_eq!(metrics.tokenized_tokens("encoded"), first + second);
    stack.stop().await;
}
