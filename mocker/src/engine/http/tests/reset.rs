//! vLLM's development endpoint `POST /reset_prefix_cache` on the mock engine: served
//! only in dev mode, refused while requests run, as vLLM 0.32 answers.

use super::{prompt, start, start_with};
use crate::engine::EngineHttpArgs;
use futures::StreamExt;
use serde_json::{Value, json};

/// `POST /reset_prefix_cache` is served only in dev mode (404 otherwise, as vLLM's
/// without `VLLM_SERVER_DEV_MODE=1`); it refuses (`{"success": false}`, nothing dropped)
/// while a request runs and drops the cache once the worker is idle: the repeated
/// prompt then hits nothing.
#[tokio::test]
async fn reset_prefix_cache_drops_an_idle_workers_cache_and_refuses_a_busy_one() {
    let e = start(1.0, None).await;
    let url = format!("{}/reset_prefix_cache", e.url);
    let response = e.http.post(url).send().await.expect("answered");
    assert_eq!(response.status(), 404, "not served without dev mode");

    let http = EngineHttpArgs {
        vllm_dev_mode: true,
        ..EngineHttpArgs::default()
    };
    let e = start_with(1.0, http).await;
    let body = json!({"prompt": prompt(40), "max_tokens": 1});
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    let (_, first) = e.post("/v1/completions", body.clone(), None).await;
    assert_eq!(cached(&first), 0);

    // ~30 decode steps of ~10 ms, streamed: running while its first chunk is read.
    let long = json!({"prompt": prompt(16), "max_tokens": 30, "stream": true});
    let mut stream = e.stream(&long).await;
    let mut seen = String::from_utf8(stream.next().await.expect("chunk").expect("bytes").to_vec())
        .expect("utf-8");
    let (status, busy) = e.post("/reset_prefix_cache", json!({}), None).await;
    assert_eq!((status, busy), (200, json!({"success": false})));
    let (_, warm) = e.post("/v1/completions", body.clone(), None).await;
    assert_eq!(cached(&warm), 32, "a refused reset drops nothing");

    // The request's finish is recorded before `[DONE]` is sent: idle once read.
    while let Some(bytes) = stream.next().await {
        seen.push_str(std::str::from_utf8(&bytes.expect("bytes")).expect("utf-8"));
    }
    assert!(seen.ends_with("data: [DONE]\n\n"), "{seen}");
    let (status, reply) = e.post("/reset_prefix_cache", json!({}), None).await;
    assert_eq!((status, reply), (200, json!({"success": true})));
    let (_, again) = e.post("/v1/completions", body, None).await;
    assert_eq!(cached(&again), 0, "the cache was dropped");
}
