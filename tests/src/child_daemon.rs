//! The release `kv-router serve` binary as a child process, for the measurement tools
//! in `tests/examples/` (sizing, route throughput). Unlike the in-process daemon of
//! the end-to-end tests, a child process has its own resident set and CPU time,
//! which `/proc` reports without counting the load generator.

use crate::eventually;
use anyhow::Context;
use kv_events::{Subjects, WorkerId};
use std::time::Duration;
use testbed::{Echo, ManagedProcess, free_port};

/// The binary the tools run unless `KV_ROUTER_BIN` names another.
pub const DEFAULT_BIN: &str = "target/release/kv-router";

/// Starts `command` (running the binary `bin`) as the child `name`; returns it and
/// its pid once it logs "`name` ready" (within 60 s).
///
/// # Errors
/// When the binary cannot start or does not become ready.
pub async fn spawn_ready(
    name: &str,
    bin: &str,
    command: std::process::Command,
) -> anyhow::Result<(ManagedProcess, u32)> {
    let mut process = ManagedProcess::spawn(name, command, Echo::Quiet)
        .with_context(|| format!("starting {bin} (build it with cargo build --release)"))?;
    process
        .wait_for_line(&format!("{name} ready"), Duration::from_secs(60))
        .await?;
    let pid = process.id().with_context(|| format!("{name} has no pid"))?;
    Ok((process, pid))
}

/// A running `kv-router serve` child with its HTTP endpoint.
pub struct ChildDaemon {
    process: ManagedProcess,
    pid: u32,
    http: String,
    /// The binary that runs.
    pub bin: String,
}

impl ChildDaemon {
    /// Starts `kv-router serve` (`KV_ROUTER_BIN`, default [`DEFAULT_BIN`]) against
    /// `nats_url` and `etcd_endpoint` in `namespace` with `block_size` tokens per
    /// block, an HTTP endpoint on a free loopback port, and `extra` flags; returns
    /// once it logs that it is ready.
    ///
    /// # Errors
    /// When the binary cannot start or does not become ready within 60 s.
    pub async fn start(
        nats_url: &str,
        etcd_endpoint: &str,
        namespace: &str,
        block_size: u32,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let bin = std::env::var("KV_ROUTER_BIN").unwrap_or_else(|_| DEFAULT_BIN.into());
        let http = format!("127.0.0.1:{}", free_port()?);
        let mut command = std::process::Command::new(&bin);
        command
            .args([
                "serve",
                "--nats-url",
                nats_url,
                "--etcd-endpoints",
                etcd_endpoint,
                "--namespace",
                namespace,
                "--block-size",
                &block_size.to_string(),
                "--http-listen",
                &http,
                "--http-debug-listen",
                "off",
            ])
            .args(extra);
        let (process, pid) = spawn_ready("kv-router", &bin, command).await?;
        Ok(Self {
            process,
            pid,
            http,
            bin,
        })
    }

    /// The daemon's process id (for `perf record -p`).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Resident set size, in bytes (`/proc/PID/status` `VmRSS`).
    ///
    /// # Errors
    /// When `/proc` cannot be read or parsed.
    pub fn rss_bytes(&self) -> anyhow::Result<u64> {
        status_bytes(&self.pid.to_string(), "VmRSS:")
    }

    /// CPU time used so far (utime + stime), in seconds.
    ///
    /// # Errors
    /// When `/proc` cannot be read or parsed.
    pub fn cpu_seconds(&self) -> anyhow::Result<f64> {
        process_cpu_seconds(self.pid)
    }

    /// The value of the unlabelled (or fully labelled, e.g. `name{a="b"}`) sample
    /// `name` on `/metrics`.
    ///
    /// # Errors
    /// When the endpoint fails or does not export the sample.
    pub async fn metric(&self, name: &str) -> anyhow::Result<f64> {
        let (_, text) =
            kv_cluster::http::get_once(&self.http, "/metrics", Duration::from_secs(10)).await?;
        kv_cluster::http::metric_sample(&text, name, "")
            .with_context(|| format!("{name} not exported"))
    }

    /// Waits (up to 300 s) until the sum of the samples `names` reaches `at_least`.
    ///
    /// # Errors
    /// When it does not.
    pub async fn wait_for_sum(&self, names: &[&str], at_least: f64) -> anyhow::Result<()> {
        eventually(
            &format!("{names:?} to reach {at_least}"),
            Duration::from_secs(300),
            || async {
                let mut sum = 0.0;
                for name in names {
                    sum += self.metric(name).await.unwrap_or(0.0);
                }
                (sum >= at_least).then_some(())
            },
        )
        .await
    }

    /// Stops the daemon with SIGTERM (SIGKILL after 10 s).
    ///
    /// # Errors
    /// When it cannot be signalled.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.process.stop(Duration::from_secs(10)).await?;
        Ok(())
    }
}

/// Registers workers `ids` (dp_size 1, `total_kv_blocks` each) in etcd, each under a
/// lease of 600 s.
///
/// # Errors
/// etcd failures.
pub async fn register_workers(
    etcd: &mut etcd_client::Client,
    subjects: &Subjects,
    ids: std::ops::Range<u64>,
    block_size: u32,
    total_kv_blocks: u64,
) -> anyhow::Result<()> {
    for w in ids {
        let reg = kv_events::discovery::WorkerRegistration {
            worker_id: WorkerId(w),
            dp_size: 1,
            block_size,
            total_kv_blocks,
            url: None,
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        };
        crate::register_worker(etcd, subjects, &reg, 600).await?;
    }
    Ok(())
}

/// CPU time process `pid` used so far (utime + stime), in seconds.
///
/// # Errors
/// When `/proc` cannot be read or parsed.
pub fn process_cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised command name; utime and stime are the 14th
    // and 15th fields of the whole line.
    let rest = stat.rsplit_once(')').context("bad stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| -> anyhow::Result<u64> {
        Ok(fields.get(i).context("short stat line")?.parse()?)
    };
    // CLK_TCK is 100 on Linux for every architecture this runs on.
    Ok((field(11)? + field(12)?) as f64 / 100.0)
}

/// A size field (`VmRSS:`, `VmHWM:`, …) of `/proc/{process}/status` (`process`: a pid
/// or `self`), in bytes.
///
/// # Errors
/// When `/proc` cannot be read or has no such field.
pub fn status_bytes(process: &str, field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{process}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .with_context(|| format!("no {field}"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kib * 1024)
}
