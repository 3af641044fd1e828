//! The README's first command as a person sees it, on a short trace through the
//! gateway: the terminal shows the steps, the progress, the tables and the report's
//! path, with no colour codes when it is not a terminal; every process's log is in
//! `<out>/logs/`.
//!
//! Runs the real `kv-mocker quickstart` binary with real nats-server, etcd, mock
//! engines and `kv-router serve`, which `cargo test --workspace` builds next to it.

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

#[test]
fn quickstart_output_is_steps_progress_table_and_report_with_logs_in_files() {
    let out = tempfile::tempdir().expect("temporary directory");
    let output = Command::new(env!("CARGO_BIN_EXE_kv-mocker"))
        .args(["quickstart", "--max-requests", "40", "--time-scale", "20"])
        .args([
            "--policy",
            "kv",
            "--policy",
            "round-robin",
            "--workers",
            "4",
        ])
        .arg("--out")
        .arg(out.path())
        .arg("--bin-dir")
        .arg(bin_dir())
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .stdin(Stdio::null())
        .output()
        .expect("kv-mocker runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "quickstart failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );

    // Steps, in order, then the report's path.
    let steps = [
        "logs of every process go to",
        "nats-server ready at",
        "etcd ready at",
        "4 mock engines registered in etcd",
        "gateway ready at http://127.0.0.1:",
        "replaying 40 requests",
        "router ready (kv-router serve --policy kv)",
        "kv: 40/40 requests done",
        "router ready (kv-router serve --policy round-robin)",
        "round-robin: 40/40 requests done",
        "report written to",
        "stopped every process it started",
    ];
    let mut rest = stderr.as_ref();
    for step in steps {
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
        !stdout.contains('\u{1b}') && !stderr.contains('\u{1b}'),
        "colour codes on a non-terminal:\n{stderr}"
    );

    // The table, on stdout.
    let table: Vec<&str> = stdout.lines().collect();
    assert!(table[0].starts_with("policy"), "{stdout}");
    assert!(table.iter().any(|l| l.starts_with("kv ")), "{stdout}");
    assert!(
        table.iter().any(|l| l.starts_with("round-robin ")),
        "{stdout}"
    );
    // Every request went through the gateway and completed.
    let policy_table = table.iter().take_while(|l| !l.starts_with("(latencies"));
    let passes = policy_table.filter(|l| l.starts_with("kv ") || l.starts_with("round-robin "));
    for line in passes {
        let columns: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            columns[1..4],
            ["40", "40", "0"],
            "requests, completed, failed: {line}"
        );
    }
    assert!(
        table
            .iter()
            .any(|l| l.starts_with("gateway ") && l.contains("gateway share")),
        "the gateway's share of TTFT: {stdout}"
    );
    assert!(out.path().join("report.json").is_file());

    // Every process's log, in its file.
    let logs = out.path().join("logs");
    assert!(read(&logs.join("nats.log")).contains("Server is ready"));
    assert!(read(&logs.join("etcd.log")).contains("ready to serve client requests"));
    assert!(read(&logs.join("engines.log")).contains("kv-mocker engines ready"));
    assert!(read(&logs.join("router-kv.log")).contains("kv-router ready"));
    assert!(read(&logs.join("router-round-robin.log")).contains("kv-router ready"));
    assert!(read(&logs.join("gateway.log")).contains("kv-router gateway ready"));
    assert!(read(&logs.join("quickstart.log")).contains("starting pass from a cold cache"));
}
