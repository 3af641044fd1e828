//! `kv-mocker lab replicas`: its flags, its plan of runs, and whole studies on a
//! trace of same-instant bursts, where replicas that book blind pile onto the same
//! engines and replicas that see each other at once do not.

use super::*;

fn parse(args: &[&str]) -> Result<ReplicaArgs, clap::Error> {
    crate::test_cli::parse_study("replicas", args, |command| match command {
        Some(crate::LabCommand::Replicas(args)) => args,
        other => panic!("not the replicas subcommand: {other:?}"),
    })
}

#[test]
fn defaults_are_one_to_eight_replicas_one_ms_apart_on_eight_engines() {
    let args = parse(&[]).expect("no flags");
    assert_eq!(args.counts(), vec![1, 2, 4, 8]);
    assert_eq!(args.sync_lag_ms, 1.0);
    assert_eq!((args.engines.as_slice(), args.speedup.len()), (&[8][..], 2));
    let base = args.study.sim_config();
    let items = args.plan(&base).expect("valid plan");
    assert_eq!(items.len(), 2 * 4);
    let rows: Vec<_> = items[..4].iter().map(|i| i.label.as_str()).collect();
    assert_eq!(
        rows,
        ["1 replica", "2 replicas", "4 replicas", "8 replicas"]
    );
    assert_eq!(items[3].config.replicas.count, 8);
    assert_eq!(
        items[0].config, base,
        "one replica is the lab's single router"
    );
}

#[test]
fn one_replica_is_always_the_first_row_and_zero_is_refused() {
    let args = parse(&["--replicas", "8,2,2"]).expect("parses");
    assert_eq!(args.counts(), vec![1, 2, 8]);
    let base = args.study.sim_config();
    let err = parse(&["--replicas", "0,2"])
        .expect("parses")
        .plan(&base)
        .unwrap_err();
    assert!(matches!(err, LabError::Replicas(0)), "{err}");
    let err = parse(&["--sync-lag-ms=-1"])
        .expect("parses")
        .plan(&base)
        .unwrap_err();
    assert!(matches!(err, LabError::SyncLag(_)), "{err}");
}

/// Ten bursts of 8 unrelated 2,000-token prompts, each burst's at one instant and 10
/// s after the last, on 8 engines under `kv`, with 1 and 8 replicas `lag_ms` apart.
fn burst_study(dir: &std::path::Path, lag_ms: &str) -> ReplicaReport {
    let trace = dir.join("trace.jsonl");
    let lines: Vec<String> = (0..80u64)
        .map(|i| {
            let first = 1_000 * i;
            format!(
                r#"{{"timestamp": {}, "input_length": 2000, "output_length": 2, "hash_ids": [{}, {}, {}, {}]}}"#,
                (i / 8) * 10_000,
                first,
                first + 1,
                first + 2,
                first + 3
            )
        })
        .collect();
    std::fs::write(&trace, lines.join("\n")).expect("trace written");
    let out = dir.join("out");
    let args = parse(&[
        "--trace",
        trace.to_str().expect("utf-8 path"),
        "--speedup",
        "1",
        "--replicas",
        "8",
        "--sync-lag-ms",
        lag_ms,
        "--policy",
        "kv",
        "--uncalibrated",
        "--jobs",
        "2",
        "--out",
        out.to_str().expect("utf-8 path"),
    ])
    .expect("parses");
    run_replicas(args).expect("study runs")
}

/// Mean TTFT of the rows `1 replica` and `8 replicas`, in model ms.
fn mean_ttft(report: &ReplicaReport) -> (f64, f64) {
    let setting = report.lab.settings()[0];
    let mean = |label: &str| {
        let m = &report.lab.run(setting, label).expect("a run").metrics;
        assert_eq!(m.completed, 80, "{label}");
        m.ttft_ms.expect("completed").mean
    };
    (mean("1 replica"), mean("8 replicas"))
}

#[test]
fn replicas_that_book_blind_pile_a_burst_onto_the_same_engines() {
    let dir = tempfile::tempdir().expect("temp dir");
    let report = burst_study(dir.path(), "1");
    let (one, eight) = mean_ttft(&report);
    // One replica spreads each burst over the 8 idle engines, one prompt each; 8
    // replicas each place their share seeing none of the others' bookings.
    assert!(
        eight > 1.3 * one,
        "1 replica {one} ms, 8 replicas {eight} ms"
    );
    let table = render(&report);
    assert!(
        table.contains("8 replicas") && table.contains("sync lag 1 ms"),
        "{table}"
    );
    let json: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("out/replicas.json")).expect("report written"),
    )
    .expect("valid JSON");
    assert_eq!(json["sync_lag_ms"], 1.0);
    assert_eq!(json["runs"][1]["policy"], "8 replicas");
}

#[test]
fn replicas_that_see_each_other_at_once_place_a_burst_as_one_does() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (one, eight) = mean_ttft(&burst_study(dir.path(), "0"));
    assert!(
        (eight - one).abs() <= 0.01 * one,
        "1 replica {one} ms, 8 replicas {eight} ms"
    );
}
