//! Parity with the reference implementation: the goldens in `tests/data/golden.json`
//! were produced by Hugging Face transformers' `apply_chat_template` and the Python
//! `tokenizers` package on the tiny tokenizer in `tests/data` (see
//! `tests/data/make_fixture.py`), i.e. what vLLM and SGLang compute.

use kv_tokenizer::{ChatMessage, ChatOptions, ModelTokenizer, TemplateValue, TokenizerLimits};
use serde::Deserialize;
use std::path::PathBuf;

#[derive(Deserialize)]
struct Golden {
    chat: Vec<ChatMessage>,
    chat_rendered: String,
    chat_ids: Vec<u32>,
    chat_rendered_no_generation_prompt: String,
    completion: String,
    completion_ids: Vec<u32>,
    completion_ids_no_special: Vec<u32>,
    unicode: String,
    unicode_ids: Vec<u32>,
    bos_id: u32,
    eos_id: u32,
}

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

fn golden() -> Golden {
    let text = std::fs::read_to_string(data_dir().join("golden.json")).expect("golden.json");
    serde_json::from_str(&text).expect("golden.json parses")
}

fn tokenizer() -> ModelTokenizer {
    ModelTokenizer::from_dir(data_dir(), TokenizerLimits::default()).expect("test tokenizer loads")
}

#[test]
fn chat_render_matches_transformers() {
    let (g, t) = (golden(), tokenizer());
    let rendered = t.render_chat(&g.chat, &ChatOptions::default()).unwrap();
    assert_eq!(rendered, g.chat_rendered);
    let no_gen = ChatOptions {
        add_generation_prompt: false,
        ..ChatOptions::default()
    };
    let rendered = t.render_chat(&g.chat[1..2], &no_gen).unwrap();
    assert_eq!(rendered, g.chat_rendered_no_generation_prompt);
}

#[test]
fn chat_encode_matches_vllm_without_a_second_bos() {
    let (g, t) = (golden(), tokenizer());
    let ids = t.encode_chat(&g.chat, &ChatOptions::default()).unwrap();
    assert_eq!(ids, g.chat_ids);
    // Exactly one BOS: the template's.
    assert_eq!(ids.iter().filter(|&&id| id == g.bos_id).count(), 1);
    assert_eq!(ids[0], g.bos_id);
}

#[test]
fn completion_encode_adds_special_tokens_like_vllm() {
    let (g, t) = (golden(), tokenizer());
    let ids = t.encode_completion(&g.completion).unwrap();
    assert_eq!(ids, g.completion_ids);
    assert_eq!(ids[0], g.bos_id);
    assert_eq!(
        t.encode(&g.completion, false).unwrap(),
        g.completion_ids_no_special
    );
    assert_eq!(t.encode(&g.unicode, false).unwrap(), g.unicode_ids);
}

#[test]
fn special_tokens_come_from_the_config_and_the_vocabulary() {
    let (g, t) = (golden(), tokenizer());
    let special = t.special_tokens();
    assert_eq!(special.bos_token.as_deref(), Some("<|bos|>"));
    assert_eq!(special.eos_token.as_deref(), Some("<|eos|>"));
    assert_eq!(special.pad_token.as_deref(), Some("<|pad|>"));
    assert_eq!(special.unk_token, None);
    assert_eq!(t.token_to_id("<|bos|>"), Some(g.bos_id));
    assert_eq!(t.token_to_id("<|eos|>"), Some(g.eos_id));
    assert_eq!(t.model_max_length(), Some(4096));
    assert!(t.has_chat_template());
}

#[test]
fn decode_round_trips_and_can_skip_special_tokens() {
    let (g, t) = (golden(), tokenizer());
    assert_eq!(t.decode(&g.unicode_ids, false).unwrap(), g.unicode);
    let with_bos = t.decode(&g.completion_ids, false).unwrap();
    assert_eq!(with_bos, format!("<|bos|>{}", g.completion));
    assert_eq!(t.decode(&g.completion_ids, true).unwrap(), g.completion);
}

#[test]
fn raise_exception_fails_the_render_with_the_template_message() {
    let t = tokenizer();
    let chat = [ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
    let err = t.render_chat(&chat, &ChatOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "chat template failed: roles must alternate user/assistant"
    );
    let chat = [ChatMessage::new("tool", "x")];
    let err = t.encode_chat(&chat, &ChatOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "chat template failed: unsupported role: tool"
    );
}

#[test]
fn content_parts_extras_and_tojson_reach_the_template() {
    let config = r#"{"bos_token": "<|bos|>", "chat_template":
        "{% for m in messages %}{{ m.role }}={{ m.content }}|{{ m.tool_calls | tojson }};{% endfor %}{{ tools | tojson }} {{ enable_thinking }}"}"#;
    let tokenizer_json = std::fs::read_to_string(data_dir().join("tokenizer.json")).unwrap();
    let t = ModelTokenizer::from_parts(
        &tokenizer_json,
        Some(config),
        None,
        TokenizerLimits::default(),
    )
    .unwrap();
    let chat: Vec<ChatMessage> = serde_json::from_str(
        r#"[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null,
             "tool_calls": [{"name": "f<x>", "arguments": {"z": 1, "a": "é"}}]}]"#,
    )
    .unwrap();
    let tool: TemplateValue =
        serde_json::from_str(r#"{"type": "function", "name": "f", "b": [], "a": {}}"#).unwrap();
    let options = ChatOptions {
        tools: Some(vec![tool]),
        template_kwargs: [("enable_thinking".to_owned(), TemplateValue::from(false))].into(),
        ..ChatOptions::default()
    };
    let rendered = t.render_chat(&chat, &options).unwrap();
    // Python's json.dumps(ensure_ascii=False): insertion order, no HTML escaping; and
    // Jinja2 prints Python's None and False.
    assert_eq!(
        rendered,
        "user=a\nb|null;assistant=None|[{\"name\": \"f<x>\", \"arguments\": {\"z\": 1, \"a\": \"é\"}}];\
         [{\"type\": \"function\", \"name\": \"f\", \"b\": [], \"a\": {}}] False"
    );
}

#[test]
fn a_chat_template_file_overrides_the_config() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(data_dir().join(f), dir.path().join(f)).unwrap();
    }
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{{ bos_token }}{{ messages | length }}\n",
    )
    .unwrap();
    let t = ModelTokenizer::from_dir(dir.path(), TokenizerLimits::default()).unwrap();
    let chat = [ChatMessage::new("user", "hi")];
    // Like Jinja2 (keep_trailing_newline=False), the final newline is dropped.
    assert_eq!(
        t.render_chat(&chat, &ChatOptions::default()).unwrap(),
        "<|bos|>1"
    );
}
