//! The README's first command as a person sees it, on a short trace through the
//! gateway: the terminal shows the steps, the progress, the tables and the report's
//! path, with no colour codes when it is not a terminal; every process's log is in
//! `<out>/logs/`. Both engine paths: vLLM mode behind `kv-router relay` (the default)
//! and the self-registering NATS mode (`--engines nats`).
//!
//! Runs the real `kv-mocker quickstart` binary with real nats-server, etcd, mock
//! engines, `kv-router relay`, `kv-router serve` and `kv-router gateway`, which
//! `cargo test --workspace` builds next to it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// `kv-router` next to this package's `kv-mocker`.
fn bin_dir() -> PathBuf {
    let mocker = PathBuf::from(env!("CARGO_BIN_EXE_kv-mocker"));
    let dir = mocker
        .parent()
        .expect("binaries live in a directory")
        .to_owned();
    assert!(
        dir.join("kv-router").is_file(),
        "kv-router is not built next to kv-mocker in {}; run `cargo test --workspace`",
        dir.display()
    );
    dir
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// What one quickstart run printed and wrote.
struct Run {
    stdout: String,
    stderr: String,
    out: tempfile::TempDir,
}

/// `kv-mocker quickstart` on the first 100 requests at 20×, kv then round robin, 4
/// workers, plus `extra` flags.
fn quickstart(extra: &[&str]) -> Run {
    let out = tempfile::tempdir().expect("temporary directory");
    let output = Command::new(env!("CARGO_BIN_EXE_kv-mocker"))
        .args(["quickstart", "--max-requests", "100", "--time-scale", "20"])
        .args([
            "--policy",
            "kv",
            "--policy",
            "round-robin",
            "--workers",
            "4",
        ])
        .args(extra)
        .arg("--out")
        .arg(out.path())
        .arg("--bin-dir")
        .arg(bin_dir())
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .stdin(Stdio::null())
        .output()
        .expect("kv-mocker runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        output.status.success(),
        "quickstart failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    Run {
        stdout,
        stderr,
        out,
    }
}

/// The steps, in order, with `engines_step` where the engines join.
fn assert_steps(run: &Run, engines_step: &[&str]) {
    let stderr = &run.stderr;
    let steps = [
        &[
            "logs of every process go to",
            "nats-server ready at",
            "etcd ready at",
        ][..],
        engines_step,
        &[
            "gateway ready at http://127.0.0.1:",
            "replaying 100 requests",
            "router ready (kv-router serve --policy kv)",
            "kv: 100/100 requests done",
            "router ready (kv-router serve --policy round-robin)",
            "round-robin: 100/100 requests done",
            "report written to",
            "stopped every process it started",
        ],
    ];
    let mut rest = stderr.as_str();
    for step in steps.concat() {
        let at = rest
            .find(step)
            .unwrap_or_else(|| panic!("{step:?} missing or out of order in:\n{stderr}"));
        rest = &rest[at + step.len()..];
    }
    // Nothing but the quickstart's own lines: no child's log line reaches the terminal.
    for line in stderr.lines() {
        assert!(
            line.starts_with("quickstart: ") || line.contains("requests done"),
            "unexpected line on the terminal: {line:?}\n{stderr}"
        );
    }
    assert!(stderr.lines().count() <= 20, "too long:\n{stderr}");
    assert!(
        !run.stdout.contains('\u{1b}') && !stderr.contains('\u{1b}'),
        "colour codes on a non-terminal:\n{stderr}"
    );
}

/// The tables: every request of both passes went through the gateway and completed,
/// and kv routing found cached prefixes (the first 100 requests share some).
fn assert_tables(run: &Run) {
    let stdout = &run.stdout;
    let table: Vec<&str> = stdout.lines().collect();
    assert!(table[0].starts_with("policy"), "{stdout}");
    let policy_table = table.iter().take_while(|l| !l.starts_with("(latencies"));
    let passes: Vec<&&str> = policy_table
        .filter(|l| l.starts_with("kv ") || l.starts_with("round-robin "))
        .collect();
    assert_eq!(passes.len(), 2, "{stdout}");
    for line in passes {
        let columns: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            columns[1..4],
            ["100", "100", "0"],
            "requests, completed, failed: {line}"
        );
    }
    assert!(
        table
            .iter()
            .any(|l| l.starts_with("gateway ") && l.contains("gateway share")),
        "the gateway's share of TTFT: {stdout}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&read(&run.out.path().join("report.json"))).expect("json report");
    let kv = &report[0];
    assert_eq!(kv["policy"], "kv");
    assert_eq!(kv["completed"], 100);
    let hit_rate = kv["hit_rate"].as_f64().expect("hit rate");
    assert!(hit_rate > 0.0, "kv routing reused no cached prefix: {kv}");
}

/// Every process's log, in its file.
fn assert_logs(run: &Run) {
    let logs = run.out.path().join("logs");
    assert!(read(&logs.join("nats.log")).contains("Server is ready"));
    assert!(read(&logs.join("etcd.log")).contains("ready to serve client requests"));
    assert!(read(&logs.join("engines.log")).contains("kv-mocker engines ready"));
    assert!(read(&logs.join("router-kv.log")).contains("kv-router ready"));
    assert!(read(&logs.join("router-round-robin.log")).contains("kv-router ready"));
    assert!(read(&logs.join("gateway.log")).contains("kv-router gateway ready"));
    assert!(read(&logs.join("quickstart.log")).contains("starting pass from a cold cache"));
}

#[test]
fn quickstart_runs_vllm_mode_engines_behind_relays_by_default() {
    let run = quickstart(&[]);
    assert_steps(
        &run,
        &[
            "4 mock engines in vLLM mode, ZMQ KV events",
            "4 relays (kv-router relay) registered the engines in etcd",
        ],
    );
    assert_tables(&run);
    assert_logs(&run);
    let logs = run.out.path().join("logs");
    assert!(read(&logs.join("engines.log")).contains("kv_events=Vllm"));
    for i in 0..4 {
        let relay = read(&logs.join(format!("relay-{i}.log")));
        assert!(relay.contains("kv-router relay started"), "{relay}");
        // The relay claimed the id derived from its name (no collision among 4)...
        let name = kv_cluster::claim::WorkerName::new(format!("engine-{i}")).expect("a name");
        let id = kv_cluster::claim::derived_worker_id(&name, 0);
        let key = format!("worker registered key=kv-router/quickstart/workers/{id}");
        assert!(
            relay.contains(&key),
            "the relay registered its worker: {relay}"
        );
        // ...and registered the block size and capacity it read from the engine.
        assert!(
            relay.contains("block_size=512 total_kv_blocks=1024"),
            "the engine's facts: {relay}"
        );
        assert!(
            relay.contains("relay stopped"),
            "stopped gracefully: {relay}"
        );
    }
}

#[test]
fn quickstart_with_nats_engines_needs_no_relay() {
    let run = quickstart(&["--engines", "nats"]);
    assert_steps(&run, &["4 mock engines registered in etcd"]);
    assert_tables(&run);
    assert_logs(&run);
    let logs = run.out.path().join("logs");
    assert!(!logs.join("relay-0.log").exists());
}
