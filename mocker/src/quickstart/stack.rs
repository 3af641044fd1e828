//! What the quickstart starts and stops: the executables it finds, the children it
//! spawns (each logging to its own file) and the order it stops them in.

use super::{STOP_GRACE, progress};
use anyhow::{Context, anyhow, bail};
use std::path::{Path, PathBuf};
use std::process::Command;
use testbed::{Echo, EtcdServer, ManagedProcess, NatsServer};

/// The executables the quickstart spawns.
pub(super) struct Binaries {
    pub(super) mocker: PathBuf,
    pub(super) router: PathBuf,
}

impl Binaries {
    /// `kv-mocker` (this executable unless `bin_dir` is given) and `kv-router` (next to
    /// it).
    pub(super) fn locate(bin_dir: Option<&Path>) -> anyhow::Result<Self> {
        let (mocker, dir) = match bin_dir {
            Some(dir) => (dir.join("kv-mocker"), dir.to_owned()),
            None => {
                let exe = std::env::current_exe().context("cannot locate this executable")?;
                let dir = exe
                    .parent()
                    .map(Path::to_owned)
                    .ok_or_else(|| anyhow!("{} has no parent directory", exe.display()))?;
                (exe, dir)
            }
        };
        if !mocker.is_file() {
            bail!("kv-mocker not found at {}", mocker.display());
        }
        let router = dir.join("kv-router");
        if !router.is_file() {
            let release = if dir.ends_with("debug") {
                ""
            } else {
                " --release"
            };
            bail!(
                "kv-router not found at {}; build it with `cargo build{release} -p kv-router`",
                router.display()
            );
        }
        Ok(Self { mocker, router })
    }
}

/// A command for a child of ours: logs at info unless the user chose a filter (the
/// ready lines are info logs), and no ANSI colours in forwarded lines.
pub(super) fn child_command(program: &Path) -> Command {
    let mut command = Command::new(program);
    if std::env::var_os("RUST_LOG").is_none() {
        command.env("RUST_LOG", "info");
    }
    command.env("NO_COLOR", "1");
    command
}

/// What the quickstart has started so far; stopped in reverse order.
pub(super) struct StartedProcesses {
    /// Where every child's log goes.
    pub(super) logs: PathBuf,
    pub(super) nats: Option<NatsServer>,
    pub(super) etcd: Option<EtcdServer>,
    /// The engines, relays, gateway and router, in start order.
    children: Vec<ManagedProcess>,
}

impl StartedProcesses {
    pub(super) fn new(logs: PathBuf) -> Self {
        Self {
            logs,
            nats: None,
            etcd: None,
            children: Vec::new(),
        }
    }

    /// Spawns a child whose output goes to `<logs>/<label>.log` only.
    pub(super) fn spawn(
        &mut self,
        label: &str,
        command: Command,
    ) -> anyhow::Result<&mut ManagedProcess> {
        let process = ManagedProcess::spawn(label, command, Echo::Quiet)?;
        process.log_to(&self.logs.join(format!("{label}.log")))?;
        self.children.push(process);
        // Just pushed, so the vector is not empty.
        self.children
            .last_mut()
            .ok_or_else(|| anyhow!("no child process to return"))
    }

    /// CPU seconds the children labelled `labels` have used so far, summed (those
    /// that have exited count 0).
    pub(super) fn cpu_seconds(&self, labels: &[String]) -> f64 {
        (self.children.iter())
            .filter(|c| labels.iter().any(|l| l == c.label()))
            .filter_map(ManagedProcess::cpu_seconds)
            .sum()
    }

    /// Stops the child labelled `label` (gracefully) and forgets it.
    pub(super) async fn stop_child(&mut self, label: &str) -> anyhow::Result<()> {
        let Some(at) = self.children.iter().position(|c| c.label() == label) else {
            return Ok(());
        };
        let child = self.children.remove(at);
        child
            .stop(STOP_GRACE)
            .await
            .with_context(|| format!("stopping {label}"))?;
        Ok(())
    }

    /// Runs `work` unless a child exits first: the engines, relays, gateway and router
    /// must live for the whole replay, so an early exit is an error naming the child.
    pub(super) async fn unless_a_child_exits<T>(
        &mut self,
        work: impl std::future::Future<Output = T>,
    ) -> anyhow::Result<T> {
        let exits = self.children.iter_mut().map(|child| {
            Box::pin(async move {
                let status = child.wait().await;
                (child.label().to_owned(), status)
            })
        });
        tokio::select! {
            output = work => Ok(output),
            ((label, status), _, _) = futures::future::select_all(exits) => {
                let status = status.map_or_else(|err| err.to_string(), |s| s.to_string());
                Err(anyhow!("{label} exited during the replay ({status})"))
            }
        }
    }

    /// Prints the last lines of the log of every child that has exited.
    pub(super) fn report_exited(&mut self) {
        for child in &mut self.children {
            let Some(status) = child.exit_status() else {
                continue;
            };
            let path = child
                .log_path()
                .map_or_else(|| "its output".to_owned(), |p| p.display().to_string());
            progress(&format!(
                "{} exited ({status}); last lines of {path}:",
                child.label()
            ));
            for line in child.tail().lines() {
                eprintln!("    {line}");
            }
        }
    }

    /// Stops the children in reverse start order (router, gateway, relays, engines),
    /// then etcd and nats, each gracefully; errors are reported and do not stop the
    /// rest.
    pub(super) async fn shutdown(self) {
        let StartedProcesses {
            nats,
            etcd,
            children,
            ..
        } = self;
        if nats.is_none() {
            return;
        }
        for process in children.into_iter().rev() {
            let label = process.label().to_owned();
            if let Err(err) = process.stop(STOP_GRACE).await {
                progress(&format!("cannot stop {label}: {err}"));
            }
        }
        if let Some(etcd) = etcd
            && let Err(err) = etcd.stop().await
        {
            progress(&format!("cannot stop etcd: {err}"));
        }
        if let Some(nats) = nats
            && let Err(err) = nats.stop().await
        {
            progress(&format!("cannot stop nats-server: {err}"));
        }
        progress("stopped every process it started");
    }
}
