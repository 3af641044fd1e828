//! `kv-router`: one binary for every process of a kv-router cluster.
//!
//! This crate only parses the command line and dispatches: `serve` (and `config`,
//! `probe`) to the daemon library `router-daemon`, `relay` to `kv-relay`, `gateway`
//! to `kv-gateway`, `security` to `kv-cluster`. It is the one crate that depends on
//! both edge crates, so the daemon library does not build the gateway and the relay
//! does not build the daemon; one image still ships one binary. The `serve`-like
//! subcommands read an optional TOML config file, layered below the environment
//! and the flags (`router_daemon::config::file`).
//!
//! The global allocator is mimalloc: a route allocates and frees a few dozen small
//! buffers (its decoded query, prompt hashes, booked-block maps, reply), and glibc's
//! malloc/free were ~11% of the route thread's profile (`docs/benchmarks.md`, "Issue
//! 29 item 1, round 31", for the A/B). Cost: a C library built by `cc`, and memory held
//! in mimalloc's per-thread pages.

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use router_daemon::config::{file as config_file, serve_command};
use router_daemon::{DaemonConfig, ServeArgs};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    Serve(Box<ServeArgs>),
    /// Ask a running daemon's HTTP endpoint for its health; exit 0 only on HTTP 200.
    /// For container health checks (the image needs no curl).
    Probe(router_daemon::probe::ProbeArgs),
    /// Show the effective configuration, or the reference of every setting.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Sidecar beside one vLLM or SGLang engine: relay its ZMQ KV events to NATS in
    /// kv-router's protocol and register it in etcd (see docs/engines.md).
    Relay(Box<kv_relay::RelayArgs>),
    /// OpenAI-compatible HTTP gateway: tokenize, ask the router over NATS, forward to
    /// the chosen engine, stream the answer back (see docs/gateway.md).
    Gateway(Box<kv_gateway::GatewayArgs>),
    /// Gateway API Inference Extension endpoint picker: an Envoy ext_proc server that
    /// tokenizes like the gateway and names the chosen pod to the proxy (see
    /// docs/epp.md).
    Epp(Box<kv_epp::EppArgs>),
    /// Generate access control for a secured cluster (see docs/security.md).
    #[command(subcommand)]
    Security(SecurityCommand),
}

#[derive(Subcommand)]
enum SecurityCommand {
    /// Print the nats-server `authorization` block giving each router, worker,
    /// frontend and operator user only the subjects its role needs.
    NatsUsers(Box<kv_cluster::security::cli::NatsUsersArgs>),
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Validate and print the effective `serve` configuration as TOML (config file <
    /// environment < these flags), each value annotated with its source.
    Print(Box<ServeArgs>),
    /// Print the Markdown reference of every setting (TOML key, flag, environment
    /// variable, default), as in docs/configuration.md.
    Reference,
}

/// Subcommands that take the `serve` settings, and so the config file.
const SERVE_LIKE: &[&[&str]] = &[&["serve"], &["config", "print"]];

fn main() -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    let result = runtime.block_on(run());
    // Every step of the orderly shutdown has finished or was abandoned at its
    // deadline by now; work left in a blocking thread (a DNS lookup of a client still
    // reconnecting) is not waited for, so the process always exits.
    runtime.shutdown_background();
    result
}

async fn run() -> Result<()> {
    kv_cluster::process::init_tracing();
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let (command, file) =
        config_file::with_config_file(Cli::command(), &serve_command(), &argv, SERVE_LIKE)?;
    let matches = command.get_matches_from(&argv);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match cli.command {
        Command::Serve(args) => {
            let config = validate(&args, file.as_ref())?;
            let registry = kv_cluster::metrics::process_registry();
            router_daemon::run(config, &registry, kv_cluster::process::shutdown_signal()).await
        }
        Command::Probe(args) => router_daemon::probe::run(&args).await,
        Command::Config(ConfigCommand::Print(args)) => {
            validate(&args, file.as_ref())?;
            let print = matches
                .subcommand_matches("config")
                .and_then(|m| m.subcommand_matches("print"));
            if let Some(print) = print {
                print!(
                    "{}",
                    config_file::effective_toml(&serve_command(), print, file.as_ref())
                );
            }
            Ok(())
        }
        Command::Config(ConfigCommand::Reference) => {
            print!("{}", config_file::reference_markdown(&serve_command()));
            Ok(())
        }
        Command::Relay(args) => {
            let config = kv_relay::RelayConfig::from_args(&args)?;
            let registry = kv_cluster::metrics::process_registry();
            kv_relay::run(config, &registry, kv_cluster::process::shutdown_signal()).await?;
            Ok(())
        }
        Command::Gateway(args) => Ok(kv_gateway::run(*args).await?),
        Command::Epp(args) => Ok(kv_epp::run(*args).await?),
        Command::Security(SecurityCommand::NatsUsers(args)) => {
            print!("{}", args.render()?);
            Ok(())
        }
    }
}

/// Validates the layered settings, saying where they came from when they fail.
fn validate(
    args: &ServeArgs,
    file: Option<&config_file::ConfigFile>,
) -> anyhow::Result<DaemonConfig> {
    use anyhow::Context;
    DaemonConfig::from_args(args).with_context(|| match file {
        Some(f) => format!(
            "invalid configuration (config file {}, environment, flags)",
            f.path().display()
        ),
        None => "invalid configuration (environment, flags)".to_owned(),
    })
}
