//! Error paths: missing and malformed files, bad templates, prompts over the limits.

use kv_tokenizer::{ChatMessage, ChatOptions, ModelTokenizer, TokenizerError, TokenizerLimits};
use std::path::PathBuf;

fn tokenizer_json() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer.json");
    std::fs::read_to_string(path).expect("test tokenizer.json")
}

#[test]
fn a_missing_tokenizer_json_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let err = ModelTokenizer::from_dir(dir.path(), TokenizerLimits::default()).unwrap_err();
    match &err {
        TokenizerError::Read { path, source } => {
            assert!(path.ends_with("tokenizer.json"));
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(err.to_string().starts_with("could not read "), "{err}");
}

#[test]
fn malformed_files_are_errors() {
    for bad in ["", "{", r#"{"model": 5}"#, "[1, 2]"] {
        let err =
            ModelTokenizer::from_parts(bad, None, None, TokenizerLimits::default()).unwrap_err();
        assert!(
            matches!(err, TokenizerError::MalformedTokenizer(_)),
            "{bad}: {err:?}"
        );
    }
    let err = ModelTokenizer::from_parts(
        &tokenizer_json(),
        Some("{oops"),
        None,
        TokenizerLimits::default(),
    )
    .unwrap_err();
    assert!(matches!(err, TokenizerError::MalformedConfig(_)), "{err:?}");
    assert!(
        err.to_string()
            .starts_with("malformed tokenizer_config.json: ")
    );
}

#[test]
fn a_template_that_does_not_parse_is_refused_at_load() {
    for bad in [
        "{% for m in messages %}",
        "{{ messages | }}",
        "{% if %}x{% endif %}",
    ] {
        let err = ModelTokenizer::from_parts(
            &tokenizer_json(),
            None,
            Some(bad),
            TokenizerLimits::default(),
        )
        .unwrap_err();
        assert!(
            matches!(err, TokenizerError::BadTemplate(_)),
            "{bad}: {err:?}"
        );
    }
}

#[test]
fn a_model_without_template_cannot_render_chats() {
    let t = ModelTokenizer::from_parts(
        &tokenizer_json(),
        Some("{}"),
        None,
        TokenizerLimits::default(),
    )
    .unwrap();
    assert!(!t.has_chat_template());
    let err = t
        .encode_chat(&[ChatMessage::new("user", "hi")], &ChatOptions::default())
        .unwrap_err();
    assert!(matches!(err, TokenizerError::NoChatTemplate));
    assert_eq!(err.to_string(), "the model has no chat template");
    // Completions still work.
    assert!(!t.encode_completion("hello").unwrap().is_empty());
}

#[test]
fn prompts_over_the_limits_are_errors() {
    let limits = TokenizerLimits {
        max_prompt_bytes: 64,
        max_prompt_tokens: 5,
    };
    let t = ModelTokenizer::from_parts(
        &tokenizer_json(),
        None,
        Some("{{ messages[0].content }}"),
        limits,
    )
    .unwrap();
    let err = t.encode_completion(&"x".repeat(65)).unwrap_err();
    assert!(
        matches!(err, TokenizerError::PromptTooLarge { bytes: 65, max: 64 }),
        "{err:?}"
    );
    let err = t
        .encode_completion("the router sends every request to the worker")
        .unwrap_err();
    assert!(
        matches!(err, TokenizerError::TooManyTokens { max: 5, .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().ends_with("is over the limit of 5 tokens"),
        "{err}"
    );
    let long_chat = [ChatMessage::new("user", "y".repeat(100))];
    let err = t
        .encode_chat(&long_chat, &ChatOptions::default())
        .unwrap_err();
    assert!(
        matches!(err, TokenizerError::PromptTooLarge { .. }),
        "{err:?}"
    );
    // Within the limits.
    assert_eq!(
        t.encode("hello", false).unwrap().len(),
        t.encode("hello", false).unwrap().len()
    );
}

#[test]
fn messages_with_unsupported_content_parts_do_not_decode() {
    let bad = r#"{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}"#;
    assert!(serde_json::from_str::<ChatMessage>(bad).is_err());
    let bad = r#"{"content": "no role"}"#;
    assert!(serde_json::from_str::<ChatMessage>(bad).is_err());
}
