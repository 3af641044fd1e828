//! The baseline a route is compared with: a bare NATS request-reply echo, answered
//! by a separate process (this binary re-run with `--echo-responder`) that serves
//! like the daemon's route subject — a queue-group subscription, at most
//! `MAX_INFLIGHT` messages handled at once, one publish per reply — and does
//! nothing else. Its round trip is the floor a route cannot go below on this
//! machine: client → nats-server → responder → nats-server → client.

use super::{Bench, Mode, ingest};
use anyhow::Context;
use futures::StreamExt;
use integration_tests::child_daemon::process_cpu_seconds;
use std::time::Duration;
use testbed::{Echo, ManagedProcess};
use tokio_util::sync::CancellationToken;

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

/// Echo and route alternated `rounds` times, one printed row per round.
async fn compare_with_echo(bench: &Bench, condition: &str) -> anyhow::Result<()> {
    let tasks = bench.args.concurrency;
    for round in 1..=bench.args.rounds {
        let echo = bench.measure(Mode::Echo, tasks).await?;
        let route = bench.measure(Mode::Single, tasks).await?;
        println!(
            "| {condition} | {round} | {tasks} | {:.0} | {:.2} ms | {:.2} ms | {:.1} µs | {:.0} | {:.2} ms | {:.2} ms | {:.1} µs | **{:.2}** | **{:.2}** | {} |",
            echo.per_s(),
            echo.p50(),
            echo.p99(),
            echo.cpu_us(),
            route.per_s(),
            route.p50(),
            route.p99(),
            route.cpu_us(),
            route.p50() / echo.p50(),
            route.p99() / echo.p99(),
            route.failed
        );
    }
    Ok(())
}

/// The `echo` section: echo and route compared idle, then under a flood of KV
/// events (`--ingest-blocks-per-s`); `next_event` continues the publishers' event ids.
pub async fn section(bench: &Bench, next_event: &mut Vec<u64>) -> anyhow::Result<()> {
    println!(
        "| ingest | round | in flight | echo/s | echo p50 | echo p99 | echo CPU per echo | routes/s | route p50 | route p99 | daemon CPU per route | p50 ratio | p99 ratio | failed |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    compare_with_echo(bench, "idle").await?;
    let stop = CancellationToken::new();
    let flood = tokio::spawn(ingest::flood(
        async_nats::connect(bench.nats_url.as_str()).await?,
        (*bench.subjects).clone(),
        std::mem::take(next_event),
        bench.args.ingest_blocks_per_s,
        stop.clone(),
    ));
    let label = format!("{} blocks/s", bench.args.ingest_blocks_per_s);
    let compared = compare_with_echo(bench, &label).await;
    stop.cancel();
    let flooded = flood.await??;
    *next_event = flooded.next_event;
    compared?;
    println!();
    println!(
        "ingest: {} blocks of KV events published in {:.1} s ({:.0} blocks/s)",
        flooded.blocks,
        flooded.elapsed.as_secs_f64(),
        flooded.blocks as f64 / flooded.elapsed.as_secs_f64()
    );
    Ok(())
}
