//! Unit tests of the request bodies read and the engine bodies built.

use super::*;

fn whole(api: EngineApi, rank: u32) -> EngineTarget<'static> {
    EngineTarget::whole(api, DpRank(rank))
}

#[test]
fn the_output_bound_is_max_tokens_or_a_chats_max_completion_tokens() {
    let body = |v: Value| v.as_object().cloned().unwrap();
    let both = body(json!({"max_tokens": 7, "max_completion_tokens": 5}));
    assert_eq!(max_output_tokens(&both, true), Some(5));
    assert_eq!(max_output_tokens(&both, false), Some(7));
    let zero = body(json!({"max_tokens": 7, "max_completion_tokens": 0}));
    assert_eq!(max_output_tokens(&zero, true), Some(7));
    for none in [
        json!({}),
        json!({"max_tokens": null}),
        json!({"max_tokens": "9"}),
    ] {
        assert_eq!(max_output_tokens(&body(none.clone()), true), None, "{none}");
    }
}

#[test]
fn completion_prompts_are_one_text_or_one_list_of_ids() {
    let text = parse_completion(br#"{"model":"m","prompt":"hi","stream":true}"#).unwrap();
    assert_eq!(text.prompt, PromptInput::Text("hi".into()));
    assert!(text.stream && !text.include_usage);
    let ids = parse_completion(br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
    assert_eq!(ids.prompt, PromptInput::Tokens(vec![1, 2, 3]));
    let nested = parse_completion(br#"{"model":"m","prompt":[[4,5]]}"#).unwrap();
    assert_eq!(nested.prompt, PromptInput::Tokens(vec![4, 5]));
    for bad in [
        &br#"{"model":"m","prompt":["a","b"]}"#[..],
        br#"{"model":"m","prompt":[]}"#,
        br#"{"model":"m","prompt":[-1]}"#,
        br#"{"model":"m"}"#,
        br#"{"prompt":"x"}"#,
        br#"{"model":"m","prompt":"x","stream":"yes"}"#,
        br#"[1]"#,
        br#"{"model": "m", "prompt": "#,
    ] {
        let err = parse_completion(bad).unwrap_err();
        assert_eq!(err.status.as_u16(), 400, "{}", String::from_utf8_lossy(bad));
    }
}

#[test]
fn the_engine_gets_token_ids_streaming_with_usage_and_the_rank_its_way() {
    let request = parse_completion(
        br#"{"model":"m","prompt":"hi","max_tokens":7,"stream":false,"custom":1}"#,
    )
    .unwrap();
    let body = completion_for_engine(&request, Some(&[9, 8]), whole(EngineApi::Sglang, 3));
    assert_eq!(body["prompt"], json!([9, 8]));
    assert_eq!(body["stream"], json!(true));
    assert_eq!(body["stream_options"]["include_usage"], json!(true));
    assert_eq!(body["data_parallel_rank"], json!(3));
    assert_eq!(body["max_tokens"], json!(7));
    assert_eq!(body["custom"], json!(1), "unknown fields are forwarded");
    let vllm = completion_for_engine(&request, None, whole(EngineApi::Vllm, 3));
    assert_eq!(vllm["prompt"], json!("hi"));
    assert!(
        vllm.get("data_parallel_rank").is_none(),
        "vLLM takes a header"
    );
}

#[test]
fn a_chat_as_tokens_keeps_sampling_and_refuses_tools() {
    let chat = parse_chat(
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":5,"temperature":0.5,"stream":true,"stream_options":{"include_usage":true}}"#,
    )
    .unwrap();
    assert!(chat.stream && chat.include_usage);
    assert!(chat.options.add_generation_prompt);
    let body = chat_as_completion(&chat, &[1, 2], whole(EngineApi::Vllm, 0)).unwrap();
    assert_eq!(body["prompt"], json!([1, 2]));
    assert_eq!(body["max_tokens"], json!(5));
    assert_eq!(body["temperature"], json!(0.5));
    assert!(body.get("messages").is_none());
    let tools = parse_chat(
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}]}"#,
    )
    .unwrap();
    assert_eq!(tools.options.tools.as_ref().map(Vec::len), Some(1));
    let err = chat_as_completion(&tools, &[1], whole(EngineApi::Vllm, 0)).unwrap_err();
    assert!(err.message.contains("passthrough"), "{err}");
    for bad in [
        &br#"{"model":"m","messages":[]}"#[..],
        br#"{"model":"m","messages":[{"content":"no role"}]}"#,
    ] {
        assert_eq!(parse_chat(bad).unwrap_err().status.as_u16(), 400);
    }
}

#[test]
fn vllms_prefill_step_asks_for_one_token_and_a_remote_decode() {
    let request = parse_completion(
        br#"{"model":"m","prompt":"hi","max_tokens":7,"min_tokens":3,"stream":true,"stream_options":{"include_usage":true},"temperature":0.2}"#,
    )
    .unwrap();
    let target = EngineTarget {
        api: EngineApi::Vllm,
        dp_rank: DpRank(1),
        step: Step::VllmPrefill,
    };
    let body = completion_for_engine(&request, Some(&[5, 6]), target);
    assert_eq!(body["stream"], json!(false));
    assert!(body.get("stream_options").is_none());
    assert_eq!(body["max_tokens"], json!(1));
    assert!(
        body.get("min_tokens").is_none(),
        "it may not exceed max_tokens"
    );
    assert!(body.get("max_completion_tokens").is_none(), "not a chat");
    assert_eq!(body["prompt"], json!([5, 6]));
    assert_eq!(body["temperature"], json!(0.2));
    assert_eq!(
        body["kv_transfer_params"],
        json!({"do_remote_decode": true, "do_remote_prefill": false,
               "remote_engine_id": null, "remote_block_ids": null,
               "remote_host": null, "remote_port": null})
    );
    let chat = parse_chat(
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":9}"#,
    )
    .unwrap();
    let body = chat_for_engine(&chat, target);
    assert_eq!(body["max_tokens"], json!(1));
    assert_eq!(
        body["max_completion_tokens"],
        json!(1),
        "a chat's own bound"
    );
    let as_tokens = chat_as_completion(&chat, &[1], target).unwrap();
    assert_eq!(as_tokens["max_tokens"], json!(1));
    assert!(as_tokens.get("max_completion_tokens").is_none());
}

#[test]
fn vllms_decode_step_is_the_clients_request_with_the_prefill_answers_params() {
    let request = parse_completion(
        br#"{"model":"m","prompt":"hi","max_tokens":7,"stream":false,"kv_transfer_params":{"remote_host":"evil"}}"#,
    )
    .unwrap();
    let params = json!({"do_remote_prefill": true, "remote_block_ids": [1, 2],
                        "remote_engine_id": "e", "remote_host": "10.0.0.2",
                        "remote_port": 5600, "tp_size": 1});
    let params = params.as_object().unwrap();
    let target = EngineTarget {
        api: EngineApi::Vllm,
        dp_rank: DpRank(0),
        step: Step::VllmDecode(params),
    };
    let body = completion_for_engine(&request, None, target);
    assert_eq!(body["kv_transfer_params"], Value::Object(params.clone()));
    assert_eq!(body["max_tokens"], json!(7));
    assert_eq!(body["stream"], json!(true));
    assert_eq!(body["stream_options"]["include_usage"], json!(true));
    // A client's own transfer fields never reach an engine.
    let whole = completion_for_engine(&request, None, whole(EngineApi::Vllm, 0));
    assert!(whole.get("kv_transfer_params").is_none(), "{whole:?}");
}

#[test]
fn sglangs_halves_both_carry_the_bootstrap_and_only_the_decode_streams() {
    let chat = parse_chat(
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"bootstrap_room":1}"#,
    )
    .unwrap();
    let bootstrap = Bootstrap {
        host: "10.0.0.3".into(),
        port: 8998,
        room: (1 << 62) + 5,
    };
    let half = |step, rank| EngineTarget {
        api: EngineApi::Sglang,
        dp_rank: DpRank(rank),
        step,
    };
    let prefill = chat_for_engine(&chat, half(Step::SglangPrefill(&bootstrap), 1));
    let decode = chat_for_engine(&chat, half(Step::SglangDecode(&bootstrap), 2));
    for (body, rank) in [(&prefill, 1), (&decode, 2)] {
        assert_eq!(body["bootstrap_host"], json!("10.0.0.3"));
        assert_eq!(body["bootstrap_port"], json!(8998));
        assert_eq!(body["bootstrap_room"], json!((1u64 << 62) + 5));
        assert_eq!(body["data_parallel_rank"], json!(rank));
        assert_eq!(
            body["max_tokens"],
            json!(4),
            "SGLang's prefill decides alone"
        );
    }
    assert_eq!(prefill["stream"], json!(false));
    assert!(prefill.get("stream_options").is_none());
    assert_eq!(decode["stream"], json!(true));
    let whole = chat_for_engine(&chat, whole(EngineApi::Sglang, 0));
    assert!(whole.get("bootstrap_room").is_none(), "{whole:?}");
}
