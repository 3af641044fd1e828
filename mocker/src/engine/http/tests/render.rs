//! vLLM's render endpoints on the mock engine: the ids they answer are the ids
//! `/tokenize` gives for the same text and the ids the generating endpoints prefill
//! for the same body, in vLLM's `GenerateRequest` shape; errors are vLLM's.

use super::{golden, sample, start, tokenizer_dir};
use serde_json::{Value, json};

/// The token ids of a `GenerateRequest`.
fn ids(generate_request: &Value) -> Vec<u64> {
    let ids = generate_request["token_ids"].as_array().expect("token_ids");
    ids.iter().map(|id| id.as_u64().expect("an id")).collect()
}

#[tokio::test]
async fn renders_answer_the_ids_tokenize_gives_and_generation_prefills() {
    let e = start(20.0, Some(tokenizer_dir())).await;
    let golden = golden();
    let completion = &golden["completion"];
    let (status, tokenized) = e
        .post("/tokenize", json!({"prompt": completion}), None)
        .await;
    assert_eq!(status, 200, "{tokenized}");

    let (status, r) = e
        .post(
            "/v1/completions/render",
            json!({"model": "kv-mocker", "prompt": completion}),
            None,
        )
        .await;
    assert_eq!(status, 200, "{r}");
    let list = r.as_array().expect("a list, one per prompt");
    assert_eq!(list.len(), 1, "{r}");
    let rendered = &list[0];
    assert_eq!(rendered["token_ids"], tokenized["tokens"]);
    assert_eq!(rendered["token_ids"], golden["completion_ids"]);
    assert!(
        rendered["request_id"]
            .as_str()
            .unwrap()
            .starts_with("cmpl-"),
        "{r}"
    );
    assert_eq!(
        rendered["sampling_params"]["max_tokens"], 16,
        "vLLM's default"
    );
    assert_eq!(rendered["model"], "kv-mocker");
    assert_eq!(rendered["stream"], false);
    assert_eq!(rendered["stream_options"], Value::Null);
    assert_eq!(rendered["features"], Value::Null);

    // The body's `add_special_tokens`, as vLLM reads it; token ids as they are.
    let body = json!({"prompt": completion, "add_special_tokens": false, "max_tokens": 3,
                      "stream": true, "stream_options": {"include_usage": true}});
    let (status, r) = e.post("/v1/completions/render", body, None).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r[0]["token_ids"], golden["completion_ids_no_special"]);
    assert_eq!(r[0]["sampling_params"]["max_tokens"], 3);
    assert_eq!(r[0]["stream"], true);
    assert_eq!(r[0]["stream_options"], json!({"include_usage": true}));
    let (status, r) = e
        .post("/v1/completions/render", json!({"prompt": [5, 6, 7]}), None)
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r[0]["token_ids"], json!([5, 6, 7]));

    // A chat: one object, the template's ids; the generating endpoint prefills exactly
    // as many, with or without the generation prompt.
    let chat = json!({"model": "kv-mocker", "messages": golden["chat"], "max_tokens": 2});
    let (status, r) = e
        .post("/v1/chat/completions/render", chat.clone(), None)
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["token_ids"], golden["chat_ids"]);
    assert!(
        r["request_id"].as_str().unwrap().starts_with("chatcmpl-"),
        "{r}"
    );
    assert_eq!(r["sampling_params"]["max_tokens"], 2);
    let mut no_header = chat.clone();
    no_header["add_generation_prompt"] = json!(false);
    let (status, shorter) = e
        .post("/v1/chat/completions/render", no_header.clone(), None)
        .await;
    assert_eq!(status, 200, "{shorter}");
    let (with, without) = (ids(&r), ids(&shorter));
    assert!(
        without.len() < with.len() && with.starts_with(&without),
        "the generation prompt is the assistant header at the end: {with:?} / {without:?}"
    );
    let prefilled = with.len() + without.len();
    for (body, rendered) in [(chat, with), (no_header, without)] {
        let (status, done) = e.post("/v1/chat/completions", body, None).await;
        assert_eq!(status, 200, "{done}");
        assert_eq!(done["usage"]["prompt_tokens"], rendered.len(), "{done}");
    }
    let mut kwargs = json!({"messages": golden["chat"], "max_completion_tokens": 4,
                            "chat_template_kwargs": {"enable_thinking": false}});
    let (status, r) = e
        .post("/v1/chat/completions/render", kwargs.clone(), None)
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        r["token_ids"], golden["chat_ids"],
        "the template ignores the variable"
    );
    assert_eq!(r["sampling_params"]["max_tokens"], 4);
    kwargs["add_special_tokens"] = json!(true);
    let (status, r) = e.post("/v1/chat/completions/render", kwargs, None).await;
    assert_eq!(status, 200, "{r}");
    assert_ne!(
        r["token_ids"], golden["chat_ids"],
        "special tokens added: {r}"
    );

    // Rendering schedules nothing: only the two chats generated above reached the
    // KV cache.
    let m = e.metrics().await;
    let queries = sample(&m, "vllm:prefix_cache_queries_total", "engine=\"0\"");
    assert_eq!(queries, Some(prefilled as f64), "{m}");
}

#[tokio::test]
async fn render_errors_are_vllms() {
    let e = start(20.0, Some(tokenizer_dir())).await;
    let user = |text: &str| json!([{"role": "user", "content": text}]);
    let cases = [
        (
            "/v1/completions/render",
            json!({"prompt": [1], "model": "other"}),
            404,
            "does not exist",
        ),
        (
            "/v1/completions/render",
            json!({"prompt": []}),
            400,
            "prompt is empty",
        ),
        (
            "/v1/completions/render",
            json!({"prompt": "x", "max_tokens": 2000}),
            400,
            "maximum context length is 1024",
        ),
        (
            "/v1/completions/render",
            json!({"prompt": 7}),
            400,
            "malformed request",
        ),
        (
            "/v1/chat/completions/render",
            json!({"messages": user("hi"), "model": "other"}),
            404,
            "does not exist",
        ),
        (
            "/v1/chat/completions/render",
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            400,
            "unsupported role",
        ),
        (
            "/v1/chat/completions/render",
            json!({"messages": user("hi"), "max_tokens": 1024}),
            400,
            "maximum context length is 1024",
        ),
        (
            "/v1/chat/completions/render",
            json!({"messages": "hi"}),
            400,
            "malformed request",
        ),
    ];
    for (path, body, status, needle) in cases {
        let (got, r) = e.post(path, body.clone(), None).await;
        assert_eq!(got, status, "{path} {body}: {r}");
        let message = r["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{path} {body}: {message}");
        assert_eq!(r["error"]["code"], status, "{r}");
    }
    assert_eq!(e.post_too_large("/v1/chat/completions/render").await, 413);
}
