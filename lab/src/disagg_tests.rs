//! `kv-mocker lab disagg`: its flags, its plan of runs, and a whole study on a small
//! trace file (table, `disagg.json`, charts).

use super::*;

fn parse(args: &[&str]) -> Result<DisaggArgs, clap::Error> {
    crate::test_cli::parse_study("disagg", args, |command| match command {
        Some(crate::LabCommand::Disagg(args)) => args,
        other => panic!("not the disagg subcommand: {other:?}"),
    })
}

#[test]
fn defaults_compare_three_splits_of_eight_engines_in_both_modes() {
    let args = parse(&[]).expect("no flags");
    assert_eq!((args.engines.as_slice(), args.speedup.len()), (&[8][..], 3));
    assert_eq!(args.policy, PolicyKind::PredictedTtft);
    assert_eq!(args.transfer, KvTransferConfig::default());
    // The router's own conditional thresholds and their defaults.
    assert_eq!(
        args.conditional.to_config(),
        DisaggregationConfig::default()
    );
    let items = args.plan(&SimConfig::default()).expect("valid plan");
    assert_eq!(items.len(), 3 * (1 + 3 * 2));
    let labels: Vec<String> = items[..7]
        .iter()
        .map(|i| i.config.serving.label(i.setting.workers))
        .collect();
    assert_eq!(
        labels,
        [
            "aggregated",
            "disaggregated 2P+6D",
            "conditional 2P+6D",
            "disaggregated 4P+4D",
            "conditional 4P+4D",
            "disaggregated 6P+2D",
            "conditional 6P+2D",
        ]
    );
}

#[test]
fn a_split_without_decode_engines_or_a_bad_transfer_is_refused_before_running() {
    let args = parse(&["--engines", "4", "--prefill-engines", "4"]).expect("parses");
    assert!(matches!(
        args.plan(&SimConfig::default()),
        Err(LabError::Split {
            prefill: 4,
            workers: 4
        })
    ));
    let args = parse(&["--transfer-ms-per-token=-1"]).expect("parses");
    let base = SimConfig {
        transfer: args.transfer,
        ..SimConfig::default()
    };
    assert!(matches!(
        args.plan(&base),
        Err(LabError::Engine(
            engine_model::ModelConfigError::BadTransferTime(_)
        ))
    ));
    let args = parse(&["--disagg-min-decode-overlap", "2"]).expect("parses");
    let base = SimConfig {
        conditional: args.conditional.to_config(),
        ..SimConfig::default()
    };
    let err = args.plan(&base).expect_err("a fraction above 1");
    assert!(err.to_string().contains("min_decode_overlap"), "{err}");
    assert!(parse(&["--mode", "sometimes"]).is_err());
    assert!(matches!(
        parse(&["--engines", "0"])
            .expect("parses")
            .plan(&SimConfig::default()),
        Err(LabError::NoWorkers)
    ));
}

#[test]
fn a_study_writes_its_table_report_and_charts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let trace = dir.path().join("trace.jsonl");
    // Four conversations of three turns, 2,000 tokens a turn, 16 tokens out.
    let lines: Vec<String> = (0..12u64)
        .map(|i| {
            let (turn, conv) = (i / 4, i % 4);
            let ids: Vec<String> = (0..4 * (turn + 1))
                .map(|b| (conv * 100 + b).to_string())
                .collect();
            format!(
                r#"{{"timestamp": {}, "input_length": {}, "output_length": 16, "hash_ids": [{}]}}"#,
                i * 500,
                2_000 * (turn + 1),
                ids.join(", ")
            )
        })
        .collect();
    std::fs::write(&trace, lines.join("\n")).expect("trace written");
    let out = dir.path().join("out");
    let args = parse(&[
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--engines",
        "3",
        "--prefill-engines",
        "1",
        "--speedup",
        "1,2",
        "--jobs",
        "2",
        "--out",
        out.to_str().expect("utf-8 path"),
        "--disagg-max-local-prefill-tokens",
        "2500",
    ])
    .expect("parses");
    let report = run_disagg(args).expect("study runs");
    assert_eq!(report.lab.runs.len(), 2 * 3);
    let table = render(&report);
    for label in ["aggregated", "disaggregated 1P+2D", "conditional 1P+2D"] {
        assert!(table.contains(label), "{label} missing from\n{table}");
    }
    let disaggregated = report
        .lab
        .run(report.lab.settings()[0], "disaggregated 1P+2D")
        .expect("a disaggregated run");
    assert_eq!(disaggregated.metrics.completed, 12);
    assert_eq!(disaggregated.metrics.requests_per_worker.len(), 3);
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("disagg.json")).expect("report written"))
            .expect("valid JSON");
    assert_eq!(json["routing_policy"], "predicted-ttft");
    assert_eq!(json["conditional"]["max_local_prefill_tokens"], 2_500);
    // Conditional keeps the first turns (2,000 tokens) on the decode engines.
    let conditional = &json["runs"][2];
    assert_eq!(conditional["policy"], "conditional 1P+2D");
    assert!(
        conditional["decisions"]["short_uncached"]
            .as_u64()
            .expect("count")
            >= 4
    );
    assert_eq!(
        json["config"]["transfer_ms_per_token"],
        engine_model::DEFAULT_TRANSFER_MS_PER_TOKEN
    );
    let runs = json["runs"].as_array().expect("runs");
    assert_eq!(runs[1]["policy"], "disaggregated 1P+2D");
    assert!(runs[1]["disaggregated"].as_u64().expect("count") > 0);
    assert!(runs[1]["transferred_blocks"].as_u64().expect("count") > 0);
    assert_eq!(runs[0]["disaggregated"], 0);
    for chart in charts::DISAGG_CHART_FILES {
        let bytes = std::fs::read(out.join(chart)).expect("chart written");
        assert!(bytes.starts_with(b"\x89PNG"), "{chart}");
    }
}
