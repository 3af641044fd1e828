//! A child process whose output we read: forward it with a `[label]` prefix, keep a
//! tail for error messages, and wait for a readiness line.
//!
//! Readiness is detected from the child's own log ("Server is ready", "kv-router
//! ready"), which is both faster and more honest than probing a port: the line is
//! printed after the service is usable. One reader task per output stream appends
//! lines to a bounded log (the last [`LOG_CAPACITY`] lines) and wakes waiters through a
//! `watch` channel, so waiting costs nothing until a line arrives.
//!
//! A child can also write its log to a file ([`ManagedProcess::log_to`]): the
//! quickstart keeps every child's output out of the terminal that way, in
//! `<out>/logs/<label>.log`, and quotes the file's last lines when something fails.
//! The file gets the lines already in the in-memory log and every later one, each
//! written under the log's lock, so none is lost or duplicated; writes are line-buffered
//! (one `write` per line), which is cheap next to what a child logs.
//!
//! Stopping is graceful (`SIGTERM`, then `SIGKILL` after a grace period). Dropping the
//! handle sends `SIGKILL` and reaps the child synchronously, so its ports and files are
//! released by the time the drop returns.

use crate::error::ProcessError;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::waitpid;
use nix::unistd::Pid;
use std::collections::VecDeque;
use std::fs::File;
use std::io::{LineWriter, Write};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;

/// Lines of output kept per process, for [`ManagedProcess::wait_for_line`] and error
/// tails. Readiness lines appear within the first few dozen lines, far below this.
pub const LOG_CAPACITY: usize = 4096;

/// Lines of output quoted in errors.
const TAIL_LINES: usize = 20;

/// Whether a child's output is copied to our stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Echo {
    /// Copy every line to our stderr, prefixed with `[label] `.
    Forward,
    /// Keep lines only in the in-memory log (they still appear in error tails).
    Quiet,
}

/// State shared between the handle and its reader tasks.
struct Shared {
    label: String,
    log: Mutex<LineLog>,
    /// Copy every line to our stderr ([`Echo::Forward`]).
    echo: bool,
    /// Bumped on every appended line and on every closed stream.
    changed: watch::Sender<u64>,
}

/// The last [`LOG_CAPACITY`] lines, with absolute line numbers so a waiter's cursor
/// stays valid as old lines are discarded.
struct LineLog {
    /// Absolute number of `lines[0]`.
    first: u64,
    lines: VecDeque<String>,
    /// Output streams (stdout, stderr) not yet at end of file.
    open_streams: usize,
    /// The file every line is also appended to, once [`ManagedProcess::log_to`] chose one.
    file: Option<LogFile>,
}

/// A log file and where it is.
struct LogFile {
    path: PathBuf,
    writer: LineWriter<File>,
}

impl LineLog {
    /// The first line at or after `cursor` containing `marker`, with its number.
    fn find_from(&self, cursor: u64, marker: &str) -> Option<(u64, String)> {
        let skip = usize::try_from(cursor.saturating_sub(self.first)).unwrap_or(usize::MAX);
        self.lines
            .iter()
            .enumerate()
            .skip(skip)
            .find(|(_, line)| line.contains(marker))
            .map(|(i, line)| (self.first + i as u64, line.clone()))
    }

    fn tail(&self) -> String {
        let skip = self.lines.len().saturating_sub(TAIL_LINES);
        let lines: Vec<&str> = self.lines.iter().skip(skip).map(String::as_str).collect();
        lines.join("\n")
    }
}

impl Shared {
    fn log(&self) -> MutexGuard<'_, LineLog> {
        // A reader task cannot panic while holding the lock (it only pushes strings),
        // and the log stays consistent even if one did, so recover from poisoning.
        self.log
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn push(&self, line: String) {
        if self.echo {
            eprintln!("[{}] {line}", self.label);
        }
        {
            let mut log = self.log();
            if let Some(file) = &mut log.file
                && let Err(err) = writeln!(file.writer, "{line}")
            {
                // A full disk must not stop the child: keep the in-memory tail only.
                tracing::warn!(process = %self.label, path = %file.path.display(), %err, "cannot write log file, no longer writing it");
                log.file = None;
            }
            log.lines.push_back(line);
            if log.lines.len() > LOG_CAPACITY {
                log.lines.pop_front();
                log.first += 1;
            }
        }
        self.changed.send_modify(|n| *n += 1);
    }

    fn close_stream(&self) {
        self.log().open_streams -= 1;
        self.changed.send_modify(|n| *n += 1);
    }
}

/// A spawned child process with captured output. Killed and reaped on drop.
pub struct ManagedProcess {
    child: Child,
    shared: Arc<Shared>,
    /// Absolute number of the first line [`Self::wait_for_line`] has not yet matched.
    cursor: u64,
}

impl std::fmt::Debug for ManagedProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManagedProcess")
            .field("label", &self.shared.label)
            .field("pid", &self.child.id())
            .finish()
    }
}

impl ManagedProcess {
    /// Spawns `command` in its own process group, with stdin closed and stdout and
    /// stderr captured line by line (program, arguments and environment are the
    /// caller's). `label` names it in forwarded lines (`[label] ...`) and errors. Must be
    /// called inside a tokio runtime.
    ///
    /// # Errors
    /// [`ProcessError::Spawn`] if the process cannot be started.
    pub fn spawn(
        label: impl Into<String>,
        command: std::process::Command,
        echo: Echo,
    ) -> Result<Self, ProcessError> {
        let label = label.into();
        let mut command = Command::from(command);
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            // Our `Drop` kills and reaps the child itself; tokio's kill-on-drop would
            // signal the pid again after it was reaped.
            .kill_on_drop(false);
        let mut child = command.spawn().map_err(|source| ProcessError::Spawn {
            label: label.clone(),
            source,
        })?;
        let (changed, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            label,
            log: Mutex::new(LineLog {
                first: 0,
                lines: VecDeque::new(),
                open_streams: 0,
                file: None,
            }),
            echo: echo == Echo::Forward,
            changed,
        });
        if let Some(stdout) = child.stdout.take() {
            spawn_reader(Arc::clone(&shared), stdout);
        }
        if let Some(stderr) = child.stderr.take() {
            spawn_reader(Arc::clone(&shared), stderr);
        }
        Ok(Self {
            child,
            shared,
            cursor: 0,
        })
    }

    /// The label given at spawn.
    pub fn label(&self) -> &str {
        &self.shared.label
    }

    /// The OS process id, or `None` once the process has been reaped.
    pub fn id(&self) -> Option<u32> {
        self.child.id()
    }

    /// Writes the child's output to `path` from now on, starting with the lines still
    /// in the in-memory log (the last `LOG_CAPACITY`, 4096); creates parent directories and
    /// truncates an existing file.
    ///
    /// # Errors
    /// [`ProcessError::Io`] if the directory or file cannot be created or written.
    pub fn log_to(&self, path: &Path) -> Result<(), ProcessError> {
        let io_error = |source| ProcessError::Io {
            context: format!(
                "writing the log of {} to {}",
                self.shared.label,
                path.display()
            ),
            source,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io_error)?;
        }
        let mut writer = LineWriter::new(File::create(path).map_err(io_error)?);
        let mut log = self.shared.log();
        for line in &log.lines {
            writeln!(writer, "{line}").map_err(io_error)?;
        }
        log.file = Some(LogFile {
            path: path.to_owned(),
            writer,
        });
        Ok(())
    }

    /// The file given to [`Self::log_to`], if any.
    pub fn log_path(&self) -> Option<PathBuf> {
        self.shared.log().file.as_ref().map(|f| f.path.clone())
    }

    /// The exit status if the process has exited, without waiting; `None` while it
    /// runs (or if its status cannot be read).
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits until an output line containing `marker` appears and returns that line.
    /// Lines matched by an earlier call are not matched again; lines printed before
    /// this call (but after spawn) are.
    ///
    /// # Errors
    /// [`ProcessError::Exited`] if the process closes its output first,
    /// [`ProcessError::Timeout`] after `timeout`. Both quote the last lines printed.
    pub async fn wait_for_line(
        &mut self,
        marker: &str,
        timeout: Duration,
    ) -> Result<String, ProcessError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changed = self.shared.changed.subscribe();
        loop {
            changed.borrow_and_update();
            {
                let log = self.shared.log();
                if let Some((number, line)) = log.find_from(self.cursor, marker) {
                    self.cursor = number + 1;
                    return Ok(line);
                }
                // Both readers are registered before `spawn` returns, so zero open
                // streams means end of file on both: the process has exited.
                if log.open_streams == 0 {
                    return Err(ProcessError::Exited {
                        label: self.shared.label.clone(),
                        marker: marker.to_owned(),
                        tail: log.tail(),
                    });
                }
            }
            // The sender lives in `self.shared`, so `changed()` cannot fail here.
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                return Err(ProcessError::Timeout {
                    label: self.shared.label.clone(),
                    marker: marker.to_owned(),
                    after: timeout,
                    tail: self.shared.log().tail(),
                });
            }
        }
    }

    /// The last lines the process printed, newline-separated.
    pub fn tail(&self) -> String {
        self.shared.log().tail()
    }

    /// Sends `SIGTERM`, waits up to `grace` for the process to exit, then sends
    /// `SIGKILL`. Returns the exit status.
    ///
    /// # Errors
    /// [`ProcessError::Signal`] if `SIGTERM` cannot be delivered for a reason other than
    /// the process being gone; [`ProcessError::Io`] if waiting fails.
    pub async fn stop(mut self, grace: Duration) -> Result<ExitStatus, ProcessError> {
        if let Some(pid) = self.pid() {
            match kill(pid, Signal::SIGTERM) {
                Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                Err(source) => {
                    return Err(ProcessError::Signal {
                        label: self.shared.label.clone(),
                        source,
                    });
                }
            }
        }
        let wait_error = |source| ProcessError::Io {
            context: format!("waiting for {} to exit", self.shared.label),
            source,
        };
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => status.map_err(wait_error),
            Err(_) => {
                tracing::warn!(process = %self.shared.label, ?grace, "did not exit after SIGTERM, killing");
                self.child.kill().await.map_err(wait_error)?;
                self.child.wait().await.map_err(wait_error)
            }
        }
    }

    /// Waits for the process to exit on its own.
    ///
    /// # Errors
    /// [`ProcessError::Io`] if waiting fails.
    pub async fn wait(&mut self) -> Result<ExitStatus, ProcessError> {
        self.child.wait().await.map_err(|source| ProcessError::Io {
            context: format!("waiting for {} to exit", self.shared.label),
            source,
        })
    }

    /// CPU seconds (user + system) the process has used so far, at the kernel's
    /// resolution (10 ms); `None` once it has exited or when `/proc` cannot be read.
    pub fn cpu_seconds(&self) -> Option<f64> {
        let stat = procfs::process::Process::new(self.pid()?.as_raw())
            .ok()?
            .stat()
            .ok()?;
        Some((stat.utime + stat.stime) as f64 / procfs::ticks_per_second() as f64)
    }

    fn pid(&self) -> Option<Pid> {
        self.child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .map(Pid::from_raw)
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        if let Some(pid) = self.pid() {
            // SIGKILL, then reap synchronously: the process dies within milliseconds and
            // its ports and open files are released before the caller continues. Errors
            // mean it is already gone (or reaped by tokio), which is the goal.
            let _ = self.child.start_kill();
            let _ = waitpid(pid, None);
        }
    }
}

/// Reads `stream` line by line into the shared log until end of file.
fn spawn_reader(shared: Arc<Shared>, stream: impl AsyncRead + Unpin + Send + 'static) {
    shared.log().open_streams += 1;
    tokio::spawn(async move {
        let mut reader = BufReader::new(stream);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&buf);
                    shared.push(line.trim_end_matches(['\n', '\r']).to_owned());
                }
            }
        }
        shared.close_stream();
    });
}

/// The first executable file named `binary` in the directories of `PATH`.
pub fn find_on_path(binary: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(binary))
        .find(|candidate| {
            candidate
                .metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

#[cfg(test)]
mod tests;
