//! Python peers for the end-to-end tests: a venv per package set, created under the
//! target directory once and reused while its packages import.
//!
//! deploy/ensure-deps.sh installs python3 with venv, so a missing python3 fails the
//! test rather than skipping it.

use std::path::PathBuf;
use tokio::process::Command;

/// The python of a venv named `name` under `CARGO_TARGET_TMPDIR` that can import
/// `imports` (a comma-separated module list), pip-installing the pinned `packages`
/// when it cannot.
///
/// # Panics
/// When python3, venv creation or pip fails: a broken test environment.
pub async fn venv(target_tmpdir: &str, name: &str, packages: &[&str], imports: &str) -> PathBuf {
    let venv = PathBuf::from(target_tmpdir).join(name);
    let python = venv.join("bin/python");
    let ready = Command::new(&python)
        .args(["-c", &format!("import {imports}")])
        .output()
        .await
        .is_ok_and(|o| o.status.success());
    if ready {
        return python;
    }
    let status = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .await
        .expect("python3 runs (deploy/ensure-deps.sh installs it)");
    assert!(
        status.success(),
        "python3 -m venv {} failed",
        venv.display()
    );
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(packages)
        .status()
        .await
        .expect("pip runs");
    assert!(status.success(), "pip install {packages:?} failed");
    python
}

/// Runs `python script args…`, checks it exited 0, and parses the one JSON value it
/// printed on stdout.
///
/// # Panics
/// When the script fails or prints something else: the test's verdict, with the
/// script's output.
pub async fn run_json(
    python: &std::path::Path,
    script: &std::path::Path,
    args: &[&str],
) -> serde_json::Value {
    let output = Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .await
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{} failed: {stdout}\n{}",
        script.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{} printed no JSON ({e}): {stdout}", script.display()))
}
