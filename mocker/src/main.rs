//! `kv-mocker`: mock engines, trace replay and the local quickstart.

use anyhow::Result;
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "kv-mocker",
    version,
    about = "Mock engines, trace replay and quickstart for kv-router"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run M mock engine workers in this process until SIGINT/SIGTERM.
    Engines(Box<mocker::engine::EngineArgs>),
    /// Replay a Mooncake trace through a running router and engines, per policy.
    Replay(Box<mocker::replay::ReplayArgs>),
    /// Start NATS, etcd, the router and mock engines, replay the bundled trace, report.
    Quickstart(mocker::quickstart::QuickstartArgs),
    /// Simulate a trace offline under every policy, cluster size and speed-up; print a
    /// table, write a JSON report and PNG charts.
    Lab(Box<kv_lab::LabArgs>),
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    match &cli.command {
        // The quickstart's terminal shows steps and results; its detail goes to a file.
        Command::Quickstart(args) => mocker::quickstart::init_tracing(&args.out)?,
        _ => kv_cluster::process::init_tracing(),
    }
    match cli.command {
        Command::Engines(args) => {
            let shutdown = CancellationToken::new();
            let signal = shutdown.clone();
            tokio::spawn(async move {
                kv_cluster::process::shutdown_signal().await;
                signal.cancel();
            });
            mocker::engine::run_engines(*args, shutdown).await
        }
        Command::Replay(args) => {
            let report = mocker::replay::run_replay(*args).await?;
            println!("{}", report.render_table());
            Ok(())
        }
        Command::Quickstart(args) => mocker::quickstart::run(args).await,
        Command::Lab(args) => {
            // CPU-bound and multi-threaded on its own: keep it off the async workers.
            tokio::task::spawn_blocking(move || kv_lab::run(*args)).await??;
            Ok(())
        }
    }
}
