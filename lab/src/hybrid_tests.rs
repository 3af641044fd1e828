//! `kv-mocker lab hybrid`: its flags, its plan of runs, and a whole study on a small
//! trace of prompts that share only a system prompt, where a group-blind router
//! over-claims on a hybrid engine.

use super::*;
use crate::RunMetrics;

fn parse(args: &[&str]) -> Result<HybridArgs, clap::Error> {
    crate::test_cli::parse_study("hybrid", args, |command| match command {
        Some(crate::LabCommand::Hybrid(args)) => args,
        other => panic!("not the hybrid subcommand: {other:?}"),
    })
}

#[test]
fn defaults_are_three_windows_of_128_tokens_on_eight_engines_of_equal_memory() {
    let args = parse(&[]).expect("no flags");
    assert_eq!(args.hybrid, HybridConfig::sliding(3, 128));
    assert_eq!((args.engines.as_slice(), args.speedup.len()), (&[8][..], 2));
    assert_eq!(args.policy, PolicyKind::PredictedTtft);
    let base = args.study.sim_config();
    let items = args.plan(&base).expect("valid plan");
    assert_eq!(items.len(), 2 * 3);
    let rows: Vec<_> = items[..3].iter().map(|i| i.label.as_str()).collect();
    assert_eq!(rows, ["group-aware", "group-blind", "dense"]);
    let blocks = base.engine.num_gpu_blocks;
    assert_eq!(items[0].config.engine.num_gpu_blocks, 4 * blocks);
    assert_eq!(items[0].config.router_groups, RouterGroups::All);
    assert_eq!(
        items[1].config.router_groups,
        RouterGroups::FullAttentionOnly
    );
    assert_eq!(items[1].config.hybrid, args.hybrid);
    assert_eq!(items[2].config, base);
    assert!(matches!(
        parse(&["--sliding-window-groups", "0"])
            .expect("parses")
            .plan(&base),
        Err(LabError::NotHybrid)
    ));
    assert!(matches!(
        parse(&["--sliding-window", "1"])
            .expect("parses")
            .plan(&base),
        Err(LabError::Engine(_))
    ));
}

/// Twelve prompts of 1,000 tokens, 10 s apart, sharing only their first 512 tokens
/// (a system prompt), on 2 engines: a hybrid engine keeps only the window before each
/// prompt's end, so the second prompt on an engine misses what its full-attention
/// group holds.
fn shared_prefix_study(dir: &std::path::Path) -> HybridReport {
    let trace = dir.join("trace.jsonl");
    let lines: Vec<String> = (0..12u64)
        .map(|i| {
            format!(
                r#"{{"timestamp": {}, "input_length": 1000, "output_length": 4, "hash_ids": [0, {}]}}"#,
                i * 10_000,
                100 + i
            )
        })
        .collect();
    std::fs::write(&trace, lines.join("\n")).expect("trace written");
    let out = dir.join("out");
    let args = parse(&[
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--engines",
        "2",
        "--speedup",
        "1",
        "--jobs",
        "2",
        "--policy",
        "kv",
        "--out",
        out.to_str().expect("utf-8 path"),
    ])
    .expect("parses");
    run_hybrid(args).expect("study runs")
}

fn metrics(report: &HybridReport, row: HybridRow) -> &RunMetrics {
    let setting = report.lab.settings()[0];
    &report
        .lab
        .run(setting, row.label())
        .expect("a run of the row")
        .metrics
}

#[test]
fn a_group_blind_router_over_claims_on_a_hybrid_fleet_and_a_dense_one_does_not() {
    let dir = tempfile::tempdir().expect("temp dir");
    let report = shared_prefix_study(dir.path());
    let table = render(&report);
    for row in HybridRow::ALL {
        assert!(table.contains(row.label()), "{}\n{table}", row.label());
        assert_eq!(metrics(&report, row).completed, 12, "{}", row.label());
    }
    // The blind index claims the 512-token system prompt where the engine lacks the
    // window before it.
    let blind = &metrics(&report, HybridRow::GroupBlind).prediction;
    assert!(blind.overclaimed_requests >= 1, "{blind:?}");
    assert!(blind.overclaimed_tokens >= 512, "{blind:?}");
    // On dense engines the index is exact.
    let dense = metrics(&report, HybridRow::Dense);
    assert_eq!(
        dense.prediction.overclaimed_tokens, 0,
        "{:?}",
        dense.prediction
    );
    assert!(dense.hit_rate.expect("completed") > 0.0);
    let json: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("out/hybrid.json")).expect("report written"),
    )
    .expect("valid JSON");
    assert_eq!(json["hybrid"]["sliding_window_groups"], 3);
    assert_eq!(json["hybrid"]["window_blocks"], 2);
    assert_eq!(json["runs"][1]["policy"], "group-blind");
    assert!(json["runs"][1]["prediction"]["overclaimed_tokens"].as_u64() >= Some(512));
}

/// The ordering the group-aware index must give: it claims exactly what the hybrid
/// engine reuses (the events reach it long before the next prompt), so it never
/// over-claims, where the blind one does.
#[test]
fn a_group_aware_router_claims_what_the_hybrid_engine_reuses() {
    let dir = tempfile::tempdir().expect("temp dir");
    let report = shared_prefix_study(dir.path());
    let aware = &metrics(&report, HybridRow::GroupAware).prediction;
    let blind = &metrics(&report, HybridRow::GroupBlind).prediction;
    assert_eq!(aware.overclaimed_tokens, 0, "{aware:?}");
    assert!(blind.overclaimed_tokens > aware.overclaimed_tokens);
    assert_eq!(metrics(&report, HybridRow::GroupAware).refused_events, 0);
}
