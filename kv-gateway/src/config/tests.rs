//! Flag parsing and validation of `kv-router gateway`.

use super::*;
use crate::limit::PromptTokens;
use kv_cluster::args::parse_flags;

fn parse(extra: &[&str]) -> GatewayArgs {
    let mut args = vec!["gateway"];
    args.extend_from_slice(extra);
    parse_flags::<GatewayArgs, _, _>(args).unwrap()
}

#[test]
fn the_model_name_defaults_to_the_model_directory() {
    let config = parse(&["--model-dir", "/models/Qwen3-8B"])
        .to_config()
        .unwrap();
    assert_eq!(config.model.served_model_name, "Qwen3-8B");
    assert_eq!(config.model.forward, PromptForward::Tokens);
    assert_eq!(config.model.engine_api, EngineApi::Vllm);
    assert_eq!(config.limits.max_retries, 2);
    assert!(config.model.disaggregation, "asked for unless turned off");
}

#[test]
fn disaggregation_is_turned_off_by_flag_and_needs_a_value() {
    let off = parse(&["--model-dir=/m/x", "--disaggregation", "false"]);
    assert!(!off.to_config().unwrap().model.disaggregation);
    let on = parse(&["--model-dir=/m/x", "--disaggregation=true"]);
    assert!(on.to_config().unwrap().model.disaggregation);
    let args = ["gateway", "--model-dir=/m/x", "--disaggregation", "no"];
    assert!(parse_flags::<GatewayArgs, _, _>(args).is_err());
}

#[test]
fn lifecycle_batches_default_to_the_bound_and_refuse_zero_or_more() {
    let default = parse(&["--model-dir=/m/x"]).to_config().unwrap();
    let max = kv_events::limits::MAX_LIFECYCLE_BATCH;
    assert_eq!(default.limits.lifecycle_batch, max);
    let single = parse(&["--model-dir=/m/x", "--lifecycle-batch", "1"]);
    assert_eq!(single.to_config().unwrap().limits.lifecycle_batch, 1);
    for bad in ["0".to_owned(), (max + 1).to_string(), "many".to_owned()] {
        let args = ["gateway", "--model-dir=/m/x", "--lifecycle-batch", &bad];
        assert!(parse_flags::<GatewayArgs, _, _>(args).is_err(), "{bad}");
    }
}

#[test]
fn route_grouping_defaults_and_bounds() {
    let default = parse(&["--model-dir=/m/x"]).to_config().unwrap();
    let grouping = default.limits.route_grouping;
    assert_eq!(
        (grouping.max, grouping.hold),
        (32, Duration::from_millis(2))
    );
    let off = parse(&[
        "--model-dir=/m/x",
        "--route-batch=1",
        "--route-batch-hold-ms=0",
    ]);
    let grouping = off.to_config().unwrap().limits.route_grouping;
    assert_eq!((grouping.max, grouping.hold), (1, Duration::ZERO));
    assert_eq!(
        default.limits.route_affinity,
        Some(crate::router::ReplicaAffinity {
            window: Duration::from_secs(1),
            patience: Duration::from_millis(250),
            target: crate::router::PinTarget::Lowest,
        }),
        "replica affinity on by default"
    );
    let answered = parse(&["--model-dir=/m/x", "--route-affinity-target=answered"]);
    assert_eq!(
        answered
            .to_config()
            .unwrap()
            .limits
            .route_affinity
            .map(|a| a.target),
        Some(crate::router::PinTarget::Answered)
    );
    let unpinned = parse(&["--model-dir=/m/x", "--route-affinity-ms=0"]);
    assert_eq!(unpinned.to_config().unwrap().limits.route_affinity, None);
    let patient = parse(&["--model-dir=/m/x", "--route-affinity-patience-ms=40"]);
    let patience = patient.to_config().unwrap().limits.route_affinity;
    assert_eq!(
        patience.map(|a| a.patience),
        Some(Duration::from_millis(40))
    );
    let impatient = [
        "gateway",
        "--model-dir=/m/x",
        "--route-affinity-patience-ms=0",
    ];
    assert!(
        parse_flags::<GatewayArgs, _, _>(impatient).is_err(),
        "a patience of 0 would let every pin go at once"
    );
    let max = crate::router::MAX_GROUP;
    for bad in ["0".to_owned(), (max + 1).to_string(), "all".to_owned()] {
        let args = ["gateway", "--model-dir=/m/x", "--route-batch", &bad];
        assert!(parse_flags::<GatewayArgs, _, _>(args).is_err(), "{bad}");
    }
}

#[test]
fn connection_timeouts_have_defaults_and_refuse_zero() {
    let config = parse(&["--model-dir", "/m/x"]).to_config().unwrap();
    assert_eq!(config.http.header_read_timeout, Duration::from_secs(5));
    assert_eq!(config.http.idle_timeout, Duration::from_secs(600));
    assert_eq!(config.http.body.total, Duration::from_secs(30));
    assert_eq!(config.http.body.idle, Duration::from_secs(5));
    assert_eq!(config.limits.engine_idle_timeout, Duration::from_secs(4));
    let config = parse(&[
        "--model-dir=/m/x",
        "--idle-timeout-s=7",
        "--body-read-timeout-ms=900",
        "--body-idle-timeout-ms=300",
        "--engine-idle-timeout-ms=1500",
    ])
    .to_config()
    .unwrap();
    assert_eq!(config.http.idle_timeout, Duration::from_secs(7));
    assert_eq!(config.http.body.total, Duration::from_millis(900));
    assert_eq!(config.http.body.idle, Duration::from_millis(300));
    assert_eq!(
        config.limits.engine_idle_timeout,
        Duration::from_millis(1500)
    );
    for flag in [
        "--idle-timeout-s",
        "--body-read-timeout-ms",
        "--body-idle-timeout-ms",
        "--engine-idle-timeout-ms",
    ] {
        let args = ["gateway", "--model-dir=/m/x", flag, "0"];
        assert!(parse_flags::<GatewayArgs, _, _>(args).is_err(), "{flag} 0");
    }
}

#[test]
fn local_tokenization_needs_a_model_directory() {
    let err = parse(&[]).to_config().unwrap_err().to_string();
    assert!(err.contains("--model-dir"), "{err}");
    let config = parse(&["--tokenize-via", "engine", "--served-model-name", "m"])
        .to_config()
        .unwrap();
    assert_eq!(config.model.served_model_name, "m");
    let err = parse(&["--tokenize-via", "engine"])
        .to_config()
        .unwrap_err()
        .to_string();
    assert!(err.contains("--served-model-name"), "{err}");
}

#[test]
fn render_tokenization_goes_to_the_engines_or_the_render_url() {
    let render = ["--tokenize-via", "render", "--served-model-name", "m"];
    let config = parse(&render).to_config().unwrap();
    assert_eq!(config.model.tokenize_via, TokenizeVia::Render);
    assert_eq!(config.model.render_url, None, "the engines by default");
    let config = parse(&[&render[..], &["--render-url", "http://render:8000/"]].concat())
        .to_config()
        .unwrap();
    assert_eq!(
        config.model.render_url.as_deref(),
        Some("http://render:8000")
    );
    let err = parse(&["--model-dir=/m/x", "--render-url=http://render:8000"])
        .to_config()
        .unwrap_err()
        .to_string();
    assert!(err.contains("--tokenize-via render"), "{err}");
    for bad in ["render:8000", "ftp://render", "http://render:8000/?x=1"] {
        let args = [&render[..], &["--render-url", bad]].concat();
        let parsed = parse_flags::<GatewayArgs, _, _>([&["gateway"][..], &args].concat());
        assert!(parsed.is_err(), "{bad}");
    }
}

#[test]
fn the_prompt_bound_is_the_engines_unless_given() {
    let config = parse(&["--model-dir", "/m/x"]).to_config().unwrap();
    let cores = std::thread::available_parallelism().unwrap();
    assert_eq!(
        config.model.tokenizer,
        TokenizerConfig {
            threads: cores,
            queue: 64,
            cache_bytes: 128 << 20,
        }
    );
    // No --max-prompt-tokens: the engines' context length, under the route bound.
    assert_eq!(
        config.limits.prompt,
        PromptLimitConfig {
            tokens: PromptTokens::FromEngines { ceiling: 1 << 20 },
            bytes: None,
        }
    );
    let config = parse(&["--model-dir", "/m/x", "--max-route-tokens", "4096"])
        .to_config()
        .unwrap();
    assert_eq!(
        config.limits.prompt.tokens,
        PromptTokens::FromEngines { ceiling: 4096 }
    );
    let config = parse(&["--model-dir", "/m/x", "--max-prompt-tokens", "1000"])
        .to_config()
        .unwrap();
    assert_eq!(
        config.limits.prompt.tokens,
        PromptTokens::Explicit(NonZeroUsize::new(1000).unwrap())
    );
    assert_eq!(config.limits.prompt.ceiling().max_prompt_bytes, 8000);
    let config = parse(&[
        "--model-dir",
        "/m/x",
        "--max-prompt-bytes",
        "5000",
        "--tokenizer-threads",
        "3",
        "--tokenizer-queue",
        "0",
    ])
    .to_config()
    .unwrap();
    assert_eq!(config.limits.prompt.ceiling().max_prompt_bytes, 5000);
    assert_eq!(config.model.tokenizer.threads.get(), 3);
    assert_eq!(config.model.tokenizer.queue, 0);
    for bad in [
        ["--max-prompt-bytes", "0"],
        ["--max-prompt-tokens", "0"],
        ["--max-prompt-tokens", "-1"],
        ["--tokenizer-threads", "0"],
    ] {
        let mut args = vec!["gateway", "--model-dir", "/m/x"];
        args.extend(bad);
        assert!(parse_flags::<GatewayArgs, _, _>(args).is_err(), "{bad:?}");
    }
}

#[test]
fn zero_timeouts_and_bad_namespaces_are_refused() {
    let base = ["--model-dir", "/m/x"];
    for extra in [
        &["--keep-alive-s", "0"][..],
        &["--route-timeout-ms", "0"][..],
        &["--namespace", "a.b"][..],
    ] {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        assert!(parse(&args).to_config().is_err(), "{extra:?}");
    }
}
