//! The robustness study's cells, plan, flags and table.

use super::*;
use crate::LabArgs;
use crate::metrics::{RequestRecord, RunMetrics};
use crate::report::RunReport;
use crate::robustness_report::{CellRun, MATCHED, RobustnessReport, render};
use clap::Parser;

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    lab: LabArgs,
}

#[test]
fn default_cells_vary_one_constant_each() {
    let cells = default_cells();
    let router = crate::config::ROUTER_TIMING;
    assert_eq!(cells.len(), 1 + 2 * SHAPE_FACTORS.len() + 2);
    assert_eq!(cells[0].name, MATCHED);
    assert_eq!(cells[0].timing, router);
    let prefill_x4 = cells
        .iter()
        .find(|c| c.name == "prefill x4")
        .expect("prefill x4 cell");
    assert_eq!(
        prefill_x4.timing.prefill_ms_per_token,
        4.0 * router.prefill_ms_per_token
    );
    assert_eq!(prefill_x4.timing.step_base_ms, router.step_base_ms);
    let base_quarter = cells
        .iter()
        .find(|c| c.name == "step base x0.25")
        .expect("step base x0.25 cell");
    assert_eq!(base_quarter.timing.step_base_ms, router.step_base_ms / 4.0);
    assert_eq!(
        base_quarter.timing.prefill_ms_per_token,
        router.prefill_ms_per_token
    );
    assert!(cells.iter().any(|c| c.speeds == WorkerSpeeds::HalfSlow));
    assert!(cells.iter().any(|c| c.timing == DYNAMO_POLYNOMIAL));
}

#[test]
fn plan_covers_every_cell_setting_and_row_and_validates_first() {
    let settings = [1.0, 4.0].map(|s| Setting {
        workers: 8,
        speedup: Speedup::new(s).expect("valid"),
    });
    let base = SimConfig::default();
    let items = plan(&default_cells(), &settings, &rows(), &base).expect("valid plan");
    // Every row in every cell, except `@engine` in the mixed-speed fleet (one set of
    // constants cannot be right for both halves).
    assert_eq!(items.len(), default_cells().len() * 2 * rows().len() - 2);
    assert_eq!(items[0].row, "kv");
    let engine_rows: Vec<&str> = items
        .iter()
        .filter(|i| matches!(i.policy, LabPolicy::Tuned(_)))
        .map(|i| i.cell.as_str())
        .collect();
    assert_eq!(engine_rows.len(), (default_cells().len() - 1) * 2);
    assert!(!engine_rows.contains(&"half-slow fleet"));
    // Its router has the cell's engine constants; the others keep the router's.
    let quarter = items
        .iter()
        .find(|i| i.cell == "prefill x0.25")
        .expect("a prefill x0.25 run");
    assert_eq!(
        quarter.config.timing.prefill_ms_per_token,
        0.25 * base.timing.prefill_ms_per_token
    );
    // A per-worker list that does not fit the setting fails the plan, not a run.
    let odd = [Cell::new(
        "bad",
        base.timing,
        WorkerSpeeds::PerWorker(vec![Factor::ONE; 3]),
    )];
    assert!(matches!(
        plan(&odd, &settings, &rows(), &base),
        Err(LabError::WorkerSpeedCount { .. })
    ));
    assert!(matches!(
        plan(&default_cells(), &[], &rows(), &base),
        Err(LabError::NoWorkers)
    ));
}

#[test]
fn robustness_is_a_lab_subcommand_with_its_own_flags() {
    let cli = Cli::try_parse_from([
        "lab",
        "robustness",
        "--trace",
        "t.jsonl",
        "--speedup",
        "1,4",
        "--jobs",
        "2",
        "--delay-cap-ratio",
        "3",
        "--delay-cap",
        "false",
        "--reuse-credit",
        "6",
    ])
    .expect("valid subcommand");
    match cli.lab.command {
        Some(crate::LabCommand::Robustness(args)) => {
            assert_eq!(args.study.trace, Some(PathBuf::from("t.jsonl")));
            // The daemon's own predicted-ttft flags reach the lab's policy.
            let predicted_ttft = args.study.sim_config().predicted_ttft;
            assert!(!predicted_ttft.delay_cap.enabled);
            assert_eq!(predicted_ttft.delay_cap.max_ratio, 3.0);
            assert_eq!(predicted_ttft.credit.base, 6.0);
            assert_eq!(args.workers, vec![8]);
            assert_eq!(args.speedup.len(), 2);
            assert_eq!(args.jobs, Some(2));
        }
        other => panic!("not the robustness subcommand: {other:?}"),
    }
    // The plain sweep still parses, with its fleet flags.
    let sweep = Cli::try_parse_from(["lab", "--fleet", "half-slow", "--workers", "8"])
        .expect("plain sweep");
    assert!(sweep.lab.command.is_none());
    assert_eq!(sweep.lab.fleet.speeds(), WorkerSpeeds::HalfSlow);
    assert!(Cli::try_parse_from(["lab", "robustness", "--speedup", "0"]).is_err());
}

#[test]
fn row_and_cell_selection() {
    let cli = Cli::try_parse_from([
        "lab",
        "robustness",
        "--no-calibrated",
        "--cell",
        "prefill x4",
        "--cell",
        MATCHED,
    ])
    .expect("valid flags");
    let Some(crate::LabCommand::Robustness(args)) = cli.lab.command else {
        panic!("not the robustness subcommand");
    };
    let labels: Vec<String> = args.rows().into_iter().map(|r| r.label).collect();
    assert_eq!(labels, ["kv", "predicted-ttft", "predicted-ttft@engine",]);
    let cells: Vec<String> = args
        .selected_cells()
        .expect("known cells")
        .into_iter()
        .map(|c| c.name)
        .collect();
    // Study order, not flag order.
    assert_eq!(cells, [MATCHED, "prefill x4"]);
    let typo = Cli::try_parse_from(["lab", "robustness", "--cell", "prefill x3"])
        .expect("parses; the name is checked against the cells");
    let Some(crate::LabCommand::Robustness(args)) = typo.lab.command else {
        panic!("not the robustness subcommand");
    };
    assert!(matches!(
        args.selected_cells(),
        Err(LabError::UnknownCell(name)) if name == "prefill x3"
    ));
    // Without flags: every cell and the three default rows.
    let plain = Cli::try_parse_from(["lab", "robustness"]).expect("defaults");
    let Some(crate::LabCommand::Robustness(args)) = plain.lab.command else {
        panic!("not the robustness subcommand");
    };
    assert_eq!(args.rows(), rows());
    assert_eq!(args.selected_cells().expect("all"), default_cells());
}

fn run_with(cell: &str, row: &str, mean_ms: u64) -> CellRun {
    let setting = Setting {
        workers: 1,
        speedup: Speedup::new(1.0).expect("valid"),
    };
    let record = RequestRecord {
        arrival_ns: 0,
        prompt_tokens: 100,
        first_token_ns: Some(mean_ms * 1_000_000),
        finish_ns: Some(mean_ms * 1_000_000),
        output_tokens: 1,
        worker: Some(0),
        ..RequestRecord::default()
    };
    CellRun {
        cell: cell.into(),
        row: row.into(),
        run: RunReport {
            setting,
            policy: row.into(),
            metrics: RunMetrics::from_records(&[record], 1, 0),
            steps: 1,
            wall_ms: 1.0,
            calibration: Vec::new(),
            regret: None,
        },
    }
}

/// A report of `runs` on a one-request trace.
fn report_of(runs: Vec<CellRun>) -> RobustnessReport {
    RobustnessReport {
        trace: TraceInfo {
            name: "t".into(),
            requests: 1,
            span_ms: 0,
        },
        router_timing: crate::report::TimingInfo {
            step_base_ms: 9.0,
            prefill_ms_per_token: 0.06,
            decode_ms_per_seq: 0.04,
            kv_read_ms_per_token: 4e-5,
        },
        runs,
        wall_s: 0.0,
    }
}

#[test]
fn table_gives_ratios_to_the_baseline_and_the_gain_kept() {
    let report = report_of(vec![
        run_with(MATCHED, "kv", 1_000),
        run_with(MATCHED, "predicted-ttft", 800),
        run_with("prefill x4", "kv", 2_000),
        run_with("prefill x4", "predicted-ttft", 1_800),
    ]);
    let table = render(&report);
    // Matched: -20%, all of its own gain; prefill x4: -10%, half of it.
    assert!(
        table.contains(
            "| matched | 1000 / 1000 / 0.0% | 800 / 800 / 0.0% | -20% / -20% | 100% / 100% |"
        ),
        "{table}"
    );
    assert!(
        table.contains(
            "| prefill x4 | 2000 / 2000 / 0.0% | 1800 / 1800 / 0.0% | -10% / -10% | 50% / 50% |"
        ),
        "{table}"
    );
}

#[test]
fn the_gain_kept_is_measured_against_the_engines_own_constants_in_the_same_cell() {
    let report = report_of(vec![
        run_with(MATCHED, "kv", 1_000),
        run_with(MATCHED, "predicted-ttft", 800),
        run_with(MATCHED, "predicted-ttft@engine", 800),
        run_with("prefill x4", "kv", 2_000),
        run_with("prefill x4", "predicted-ttft", 1_800),
        run_with("prefill x4", "predicted-ttft@engine", 1_600),
        run_with("half-slow fleet", "kv", 1_000),
        run_with("half-slow fleet", "predicted-ttft", 900),
    ]);
    let table = render(&report);
    // prefill x4: -10% of the -20% the engines' constants give there.
    assert!(
        table.contains(
            "| prefill x4 | 2000 / 2000 / 0.0% | 1800 / 1800 / 0.0% | 1600 / 1600 / 0.0% \
             | -10% / -10% | 50% / 50% | -20% / -20% | 100% / 100% |"
        ),
        "{table}"
    );
    // No @engine run in the mixed fleet: against the matched cell's (-20%).
    assert!(
        table.contains(
            "| half-slow fleet | 1000 / 1000 / 0.0% | 900 / 900 / 0.0% | n/a \
             | -10% / -10% | 50% / 50% | n/a | n/a |"
        ),
        "{table}"
    );
}
