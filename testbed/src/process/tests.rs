//! Unit tests of [`ManagedProcess`] against real `/bin/sh` children.
use super::*;

fn sh(script: &str) -> ManagedProcess {
    let mut command = std::process::Command::new("/bin/sh");
    command.args(["-c", script]);
    ManagedProcess::spawn("sh", command, Echo::Quiet).unwrap()
}

#[tokio::test]
async fn waits_for_marker_lines_in_order() {
    let mut p = sh("echo starting >&2; echo 'ready 1' >&2; echo 'ready 2' >&2; exec sleep 30");
    let first = p.wait_for_line("ready", Duration::from_secs(10)).await;
    assert_eq!(first.unwrap(), "ready 1");
    let second = p.wait_for_line("ready", Duration::from_secs(10)).await;
    assert_eq!(second.unwrap(), "ready 2");
    // Matched lines are not matched again; the process then times out.
    let err = p
        .wait_for_line("ready", Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(matches!(err, ProcessError::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("starting\nready 1\nready 2"));
    let status = p.stop(Duration::from_secs(10)).await.unwrap();
    assert!(!status.success(), "sleep was terminated by SIGTERM");
}

#[tokio::test]
async fn stdout_is_captured_too() {
    let mut p = sh("echo 'on stdout'; exec sleep 30");
    let line = p
        .wait_for_line("stdout", Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(line, "on stdout");
}

#[tokio::test]
async fn exit_before_marker_is_reported_with_tail() {
    let mut p = sh("echo 'fatal: address already in use' >&2; exit 3");
    let err = p
        .wait_for_line("listening", Duration::from_secs(10))
        .await
        .unwrap_err();
    assert!(matches!(err, ProcessError::Exited { .. }), "{err}");
    assert!(err.is_port_conflict());
    assert!(err.to_string().contains("fatal: address already in use"));
    assert_eq!(p.wait().await.unwrap().code(), Some(3));
}

#[tokio::test]
async fn stop_kills_a_process_that_ignores_sigterm() {
    let mut p = sh("trap '' TERM; echo armed; while :; do sleep 1; done");
    p.wait_for_line("armed", Duration::from_secs(10))
        .await
        .unwrap();
    let status = p.stop(Duration::from_millis(200)).await.unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9));
}

#[tokio::test]
async fn drop_kills_and_reaps() {
    let mut p = sh("echo up; exec sleep 30");
    p.wait_for_line("up", Duration::from_secs(10))
        .await
        .unwrap();
    let pid = p.pid().unwrap();
    drop(p);
    // Reaped: the pid no longer names a process of ours.
    assert_eq!(kill(pid, None), Err(nix::errno::Errno::ESRCH));
}

#[tokio::test]
async fn log_keeps_only_the_last_lines() {
    let mut p = sh(&format!(
        "i=0; while [ $i -lt {} ]; do echo line$i; i=$((i+1)); done; echo done",
        LOG_CAPACITY + 10
    ));
    p.wait_for_line("done", Duration::from_secs(30))
        .await
        .unwrap();
    let log = p.shared.log();
    assert_eq!(log.lines.len(), LOG_CAPACITY);
    assert_eq!(log.first, 11);
    assert_eq!(log.lines.front().map(String::as_str), Some("line11"));
}

#[tokio::test]
async fn log_file_gets_earlier_and_later_lines() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("logs/sh.log");
    let trigger = dir.path().join("go");
    // "after" is printed only once the file is set up, so it takes the live path.
    let mut p = sh(&format!(
        "echo before; while [ ! -e {} ]; do sleep 0.01; done; echo after; exec sleep 30",
        trigger.display()
    ));
    p.wait_for_line("before", Duration::from_secs(10))
        .await
        .unwrap();
    p.log_to(&path).unwrap();
    assert_eq!(p.log_path(), Some(path.clone()));
    std::fs::write(&trigger, "").unwrap();
    p.wait_for_line("after", Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "before\nafter\n");
    assert!(p.exit_status().is_none(), "still running");
    let _ = p.stop(Duration::from_secs(10)).await.unwrap();
}

#[tokio::test]
async fn exit_status_is_seen_without_waiting_forever() {
    let mut p = sh("exit 4");
    let status = p.wait().await.unwrap();
    assert_eq!(status.code(), Some(4));
    assert_eq!(p.exit_status().and_then(|s| s.code()), Some(4));
}

#[test]
fn finds_binaries_on_path() {
    assert!(find_on_path("sh").is_some());
    assert!(find_on_path("definitely-not-a-binary-7f3a").is_none());
}

#[tokio::test]
async fn cpu_time_is_the_childs_own() {
    // A child that spins until it has used a tenth of a second of CPU, then says so.
    let mut p = sh("while :; do t=$(cut -d' ' -f14,15 /proc/$$/stat); \
         [ $(( ${t% *} + ${t#* } )) -ge 10 ] && break; done; echo spun >&2; exec sleep 30");
    let idle = sh("exec sleep 30");
    p.wait_for_line("spun", Duration::from_secs(60))
        .await
        .unwrap();
    let spun = p.cpu_seconds().unwrap();
    assert!(spun >= 0.1, "{spun} s");
    assert!(idle.cpu_seconds().unwrap() < spun);
    let mut gone = sh("exit 0");
    gone.wait().await.unwrap();
    assert_eq!(
        gone.cpu_seconds(),
        None,
        "an exited child has no CPU time to read"
    );
}
