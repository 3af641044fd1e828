//! The baseline a route is compared with: a bare NATS request-reply echo, answered
//! by a separate process (this binary re-run with `--echo-responder`) that serves
//! like the daemon's route subject — a queue-group subscription, at most
//! `MAX_INFLIGHT` messages handled at once, one publish per reply — and does
//! nothing else. Its round trip is the floor a route cannot go below on this
//! machine: client → nats-server → responder → nats-server → client.

use anyhow::Context;
use futures::StreamExt;
use integration_tests::child_daemon::process_cpu_seconds;
use std::time::Duration;
use testbed::{Echo, ManagedProcess};

/// The subject the echo responder serves.
pub const SUBJECT: &str = "bench.echo";
/// Its queue group, as the daemon's route subscription has one.
const QUEUE_GROUP: &str = "bench.echo.responders";
/// Messages handled concurrently: the daemon's default `--max-inflight-routes`.
const MAX_INFLIGHT: usize = 256;
/// The line the responder prints once its subscription is confirmed.
const READY: &str = "echo responder ready";

/// Serves the echo subject on `nats_url` until the process is killed.
///
/// # Errors
/// When NATS cannot be reached.
pub async fn respond(nats_url: &str) -> anyhow::Result<()> {
    let client = async_nats::connect(nats_url).await?;
    let subscriber = client.queue_subscribe(SUBJECT, QUEUE_GROUP.into()).await?;
    client.flush().await?;
    println!("{READY}");
    subscriber
        .for_each_concurrent(Some(MAX_INFLIGHT), |msg| {
            let client = client.clone();
            async move {
                if let Some(reply_to) = msg.reply
                    && let Err(e) = client.publish(reply_to, msg.payload).await
                {
                    eprintln!("echo reply failed: {e}");
                }
            }
        })
        .await;
    Ok(())
}

/// The responder as a child process.
pub struct Responder {
    process: ManagedProcess,
    pid: u32,
}

impl Responder {
    /// Starts this binary as an echo responder on `nats_url`; returns once it
    /// serves.
    ///
    /// # Errors
    /// When it cannot start or does not become ready within 30 s.
    pub async fn start(nats_url: &str) -> anyhow::Result<Self> {
        let mut command = std::process::Command::new(std::env::current_exe()?);
        command.args(["--echo-responder", nats_url]);
        let mut process = ManagedProcess::spawn("echo", command, Echo::Quiet)?;
        process
            .wait_for_line(READY, Duration::from_secs(30))
            .await?;
        let pid = process.id().context("echo responder has no pid")?;
        Ok(Self { process, pid })
    }

    /// CPU time the responder used so far, in seconds.
    ///
    /// # Errors
    /// When `/proc` cannot be read.
    pub fn cpu_seconds(&self) -> anyhow::Result<f64> {
        process_cpu_seconds(self.pid)
    }

    /// Stops the responder.
    ///
    /// # Errors
    /// When it does not stop.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.process.stop(Duration::from_secs(5)).await?;
        Ok(())
    }
}
