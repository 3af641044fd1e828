//! `kv-router`: the KV-cache-aware router daemon.

use anyhow::Result;
use clap::{Parser, Subcommand};
use router_daemon::{DaemonConfig, ServeArgs};

#[derive(Parser)]
#[command(
    name = "kv-router",
    version,
    about = "KV-cache-aware request router for LLM inference clusters"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve routing queries: consume KV events and metrics from NATS, discover
    /// workers in etcd, answer on the route subject.
    Serve(ServeArgs),
    /// Ask a running daemon's HTTP endpoint for its health; exit 0 only on HTTP 200.
    /// For container health checks (the image needs no curl).
    Probe(router_daemon::probe::ProbeArgs),
    /// Sidecar beside one vLLM or SGLang engine: relay its ZMQ KV events to NATS in
    /// kv-router's protocol and register it in etcd (see docs/engines.md).
    Relay(router_daemon::relay::RelayArgs),
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Serve(args) => {
            let config = DaemonConfig::from_args(&args)?;
            let registry = prometheus::Registry::new();
            router_daemon::run(config, &registry, shutdown_signal()).await
        }
        Command::Probe(args) => router_daemon::probe::run(&args).await,
        Command::Relay(args) => {
            let config = router_daemon::relay::RelayConfig::from_args(&args)?;
            let registry = prometheus::Registry::new();
            router_daemon::relay::run(config, &registry, shutdown_signal()).await
        }
    }
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
