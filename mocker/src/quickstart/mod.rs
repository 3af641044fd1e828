//! `kv-mocker quickstart`: the README's first command, end to end on one machine.
//!
//! Starts a real nats-server and etcd on free loopback ports; the mock engines
//! (`kv-mocker engines`, this same executable) in vLLM mode, publishing vLLM 0.33's
//! ZMQ KV events, with one `kv-router relay` per worker that republishes them to NATS,
//! scrapes the worker's `/metrics` and registers it in etcd (or, with `--engines
//! nats`, engines that speak the router's protocol and register themselves; see
//! `engines`); `kv-router gateway`; and per policy the router daemon (`kv-router
//! serve`; `kv-router` is expected next to this executable). It replays the bundled
//! Mooncake excerpt once per policy (`predicted-ttft`, `kv`, then `round-robin`)
//! through the gateway from a cold cluster, prints the comparison table and writes
//! `<out>/report.json`. Everything it started is stopped in reverse order (router,
//! gateway, relays, engines, etcd, nats), also on error, Ctrl-C or SIGTERM.
//!
//! Each relay is one more process (a few MB, one NATS and one etcd connection, one
//! xxh3 per block of every event, a scrape every 100 ms); that is what a real vLLM
//! deployment runs, so the quickstart measures the path users take.
//!
//! The terminal is for a person: the steps (servers ready, engines registered, router
//! ready), a progress display per pass, the table and the report's path. Every
//! process's log, this one's included, goes to `<out>/logs/<process>.log`; when a
//! child dies, the quickstart quotes the last lines of its log.
//!
//! Defaults are sized so both passes take about a minute each on a 2-core machine: the
//! 2,000-request excerpt spans 669 s of trace time and runs at 10× (≈ 67 s per pass
//! plus the last requests' tail). 1,024 KV blocks of 512 tokens per worker (≈ 0.5 M
//! tokens, about what an 8B bf16 model leaves free on one 80 GB GPU) is well below the
//! excerpt's ≈ 39 k distinct blocks, so caches evict and where a prefix lands matters.

use crate::engine::ConnectionArgs;
use crate::replay::{self, Frontend, ReplayConfig, ReplayReport, ReplayTarget, TimeScale};
use anyhow::{Context, anyhow, bail};
use engine_model::render_table;
use engine_model::trace::{self, BUNDLED_EXCERPT_NAME, BlockMapping};
use gateway::{GATEWAY_HEADER, GatewayTotals};
use kv_cluster::args::TransferFlag;
use kv_events::Namespace;
use kv_events::routing::PolicyKind;
use stack::{Binaries, StartedProcesses};
use std::path::{Path, PathBuf};
use std::time::Duration;
use testbed::{EtcdServer, NatsServer, ProcessError};

mod engines;
mod fleet;
mod gateway;
mod relay;
mod routers;
mod stack;

pub use engines::Engines;

/// The namespace the quickstart's router and engines share.
pub const QUICKSTART_NAMESPACE: &str = "quickstart";

/// How long the engines and the router may take to log their ready lines.
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a child may take to exit after `SIGTERM` before it is killed.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(10);
/// Wall-clock limit for one replayed request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

const ENGINES_READY: &str = "kv-mocker engines ready";
const ROUTER_READY: &str = "kv-router ready";

/// `kv-mocker quickstart`: start NATS, etcd, mock engines (behind relays), the
/// gateway and the router, replay a trace per policy, print the comparison and write
/// a JSON report.
#[derive(Debug, Clone, clap::Args)]
pub struct QuickstartArgs {
    /// Mock engine workers to start (aggregated: each prefills and decodes).
    #[arg(long, default_value_t = 8)]
    pub workers: u32,
    /// Start a disaggregated fleet instead of `--workers`: this many prefill workers
    /// (with --decode-engines), each registered in the prefill role.
    #[arg(
        long,
        requires = "decode_engines",
        conflicts_with = "workers",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub prefill_engines: Option<u32>,
    /// The decode workers of a disaggregated fleet (with --prefill-engines).
    #[arg(
        long,
        requires = "prefill_engines",
        conflicts_with = "workers",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub decode_engines: Option<u32>,
    /// The transfer protocol of a disaggregated fleet: vllm (kv_transfer_params) or
    /// sglang (bootstrap rooms).
    #[arg(long, value_enum, default_value_t = TransferFlag::Vllm)]
    pub kv_transfer: TransferFlag,
    /// Mooncake JSONL trace; default: the bundled 2,000-request conversation excerpt.
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,
    /// Trace time runs this many times faster than wall clock (engines and replay).
    #[arg(long, default_value = "10")]
    pub time_scale: TimeScale,
    /// Replay only the first N requests of the trace.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Directory for `report.json`.
    #[arg(long, default_value = "target/quickstart")]
    pub out: PathBuf,
    /// Tokens per KV block of the engines and the router; must divide the trace's
    /// 512-token blocks (each trace block becomes `512 / block-size` engine blocks).
    #[arg(long, default_value_t = 512)]
    pub block_size: u32,
    /// KV cache capacity per worker, in blocks.
    #[arg(long, default_value_t = 1024)]
    pub num_gpu_blocks: u64,
    /// Routing policy to replay under; repeat for several passes, run in order.
    #[arg(long = "policy", value_name = "POLICY", default_values = ["predicted-ttft", "kv", "round-robin"])]
    pub policies: Vec<PolicyKind>,
    /// Directory holding the `kv-mocker` and `kv-router` executables; default: the
    /// directory of this executable.
    #[arg(long, value_name = "DIR")]
    pub bin_dir: Option<PathBuf>,
    /// How requests reach the engines: through `kv-router gateway` over HTTP, as an
    /// application would, or straight over NATS with the replay as the frontend.
    #[arg(long, value_enum, default_value_t = Via::Gateway)]
    pub via: Via,
    /// How the mock engines join: `vllm` (vLLM's ZMQ KV events, each worker behind
    /// its own `kv-router relay`) or `nats` (the router's protocol, self-registered).
    #[arg(long, value_enum, default_value_t = Engines::Vllm)]
    pub engines: Engines,
    /// Router daemons per pass, in one route queue group (each indexes every KV event
    /// and syncs its bookings to the others); above 1 the pass also reports the
    /// spread of the load the replicas booked per rank and their sync lag.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub router_replicas: u32,
    /// Gateways (`--via gateway`), each taking the replay's requests in turn, as
    /// behind a round-robin load balancer: a burst of the trace then reaches every
    /// gateway at once.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub gateways: u32,
}

/// The quickstart's frontend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Via {
    /// OpenAI requests to `kv-router gateway`, which routes and forwards them.
    Gateway,
    /// The replay routes over NATS itself and sends to the engines' NATS subjects.
    Nats,
}

/// Runs the quickstart (see the module docs).
///
/// # Errors
/// A missing `nats-server`, `etcd` or `kv-router`, a process that fails to start or
/// exits early, a replay error, an unwritable report or log directory, or an
/// interruption (Ctrl-C / SIGTERM).
pub async fn run(args: QuickstartArgs) -> anyhow::Result<()> {
    if let Err(err) = BlockMapping::new(args.block_size) {
        bail!("--block-size: {err}");
    }
    if (args.engines, args.via) == (Engines::Vllm, Via::Nats) {
        bail!("--via nats needs --engines nats: engines in vLLM mode take requests over HTTP only");
    }
    let (mut trace, trace_name) = match &args.trace {
        Some(path) => (trace::load_trace(path)?, path.display().to_string()),
        None => (trace::bundled_excerpt()?, BUNDLED_EXCERPT_NAME.to_owned()),
    };
    if let Some(max) = args.max_requests {
        trace.truncate(max);
    }
    let binaries = Binaries::locate(args.bin_dir.as_deref())?;
    let logs = logs_dir(&args.out);
    progress(&format!("logs of every process go to {}/", logs.display()));

    let mut stack = StartedProcesses::new(logs);
    let result = tokio::select! {
        result = run_stack(&args, &trace, &trace_name, &binaries, &mut stack) => result,
        () = kv_cluster::process::shutdown_signal() => Err(anyhow!("interrupted by Ctrl-C or SIGTERM")),
    };
    if let Err(err) = &result {
        // The error may be a child's: show the end of the log of any child that died.
        // Start-up errors already quote the child's last lines.
        if err.downcast_ref::<ProcessError>().is_none() {
            stack.report_exited();
        }
    }
    stack.shutdown().await;
    result
}

/// Installs the quickstart's own `tracing` subscriber: everything at `RUST_LOG`
/// (default `info`) to `<out>/logs/quickstart.log`, and only warnings and errors to
/// the terminal, with colour only when stderr is a terminal and `NO_COLOR` is unset.
/// The terminal is for the steps, the progress and the table; the detail is in the
/// file. Call once, instead of the binary's usual set-up.
///
/// # Errors
/// The log directory or file cannot be created, or a subscriber is already installed.
pub fn init_tracing(out: &Path) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    use tracing_subscriber::filter::{EnvFilter, LevelFilter};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{Layer, fmt};

    let logs = logs_dir(out);
    std::fs::create_dir_all(&logs)
        .with_context(|| format!("cannot create the log directory {}", logs.display()))?;
    let path = logs.join("quickstart.log");
    let file = std::fs::File::create(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    let file_filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::registry()
        .with(
            fmt::layer()
                .with_ansi(false)
                .with_writer(std::sync::Mutex::new(file))
                .with_filter(file_filter),
        )
        .with(
            fmt::layer()
                .with_ansi(colour)
                .with_writer(std::io::stderr)
                .with_filter(LevelFilter::WARN),
        )
        .try_init()
        .context("cannot install the tracing subscriber")
}

/// Where the children's logs go: `<out>/logs/<process>.log`.
pub fn logs_dir(out: &Path) -> PathBuf {
    out.join("logs")
}

/// Everything after validation: start the stack, replay, report.
async fn run_stack(
    args: &QuickstartArgs,
    trace: &[trace::TraceRequest],
    trace_name: &str,
    binaries: &Binaries,
    stack: &mut StartedProcesses,
) -> anyhow::Result<()> {
    let nats = stack.nats.insert(NatsServer::start().await?);
    nats.log_to(&stack.logs.join("nats.log"))?;
    let nats_url = nats.url();
    progress(&format!("nats-server ready at {nats_url}"));

    let etcd = stack.etcd.insert(EtcdServer::start().await?);
    etcd.log_to(&stack.logs.join("etcd.log"))?;
    let etcd_endpoint = etcd.endpoint();
    progress(&format!("etcd ready at {etcd_endpoint}"));

    let connection = [
        "--nats-url",
        &nats_url,
        "--etcd-endpoints",
        &etcd_endpoint,
        "--namespace",
        QUICKSTART_NAMESPACE,
    ];
    let namespace = Namespace::new(QUICKSTART_NAMESPACE)?;
    let target = ReplayTarget::connect(&ConnectionArgs::local(
        &nats_url,
        &etcd_endpoint,
        &namespace,
    ))
    .await?;
    engines::start(args, stack, binaries, &connection, &target).await?;

    let gateways = match args.via {
        Via::Gateway => gateway::start(stack, binaries, &connection, args.gateways).await?,
        Via::Nats => Vec::new(),
    };
    let span_s = trace.last().map_or(0.0, |r| r.timestamp_ms as f64 / 1000.0);
    let policies: Vec<String> = args.policies.iter().map(ToString::to_string).collect();
    progress(&format!(
        "replaying {} requests of {trace_name} ({span_s:.0} s of trace time, about {:.0} s per pass at {}x) under: {}",
        trace.len(),
        span_s / args.time_scale.get(),
        args.time_scale,
        policies.join(", ")
    ));
    let config = ReplayConfig {
        time_scale: args.time_scale,
        request_timeout: REQUEST_TIMEOUT,
        progress: true,
        frontend: if gateways.is_empty() {
            Frontend::Nats
        } else {
            Frontend::Gateways(gateways.clone())
        },
    };
    let mut report = ReplayReport::default();
    let (mut gateway_rows, mut replica_rows, mut replica_figures) = (vec![], vec![], vec![]);
    // Routers per pass, started with the pass's policy, as an operator would run
    // them; the engines and the gateway stay up, and each pass starts from cold caches.
    for &policy in &args.policies {
        let routers =
            routers::start(stack, binaries, &connection, policy, args.router_replicas).await?;
        let before = GatewayTotals::read(&gateways).await?;
        let mut figures = routers::ReplicaFigures::default();
        routers.read_start(stack, &mut figures);
        let pass = stack
            .unless_a_child_exits(async {
                tokio::select! {
                    pass = replay::replay_policy(&target, trace, policy, &config) => pass,
                    never = routers.sample_booked_load(&mut figures) => match never {},
                }
            })
            .await??;
        if !gateways.is_empty() {
            let after = GatewayTotals::read(&gateways).await?;
            gateway_rows.push(after.row(&before, policy.as_str()));
        }
        routers.read_end(stack, &mut figures).await?;
        report.policies.push(pass);
        routers.stop(stack).await?;
        replica_rows.push(figures.row(policy.as_str()));
        replica_figures.push(figures);
    }
    println!("{}", report.render_table());
    routers::report(replica_rows, &replica_figures, &args.out)?;
    if !gateway_rows.is_empty() {
        println!("{}", render_table(&GATEWAY_HEADER, gateway_rows));
        println!(
            "(as the gateway measured it, wall ms; gateway share = time before the first token\n not spent waiting for the engine: tokenize, route, forward; remote prefill = routed\n attempts whose prompt the router sent to a prefill worker; cache parity = engine\n answers whose cached prompt tokens agreed with the router's prediction, counting\n blocks a request booked on the same rank was still computing and blocks evicted\n after the route / had less (over-claim) / had more (under-claim))\n"
        );
    }
    let path = args.out.join("report.json");
    report.write_json(&path)?;
    progress(&format!("report written to {}", path.display()));
    Ok(())
}

pub(crate) fn progress(message: &str) {
    eprintln!("quickstart: {message}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: QuickstartArgs,
    }

    #[test]
    fn defaults_match_the_bundled_trace() {
        let args = Cli::parse_from(["quickstart"]).args;
        assert_eq!(args.workers, 8);
        assert_eq!(
            u64::from(args.block_size),
            engine_model::trace::TRACE_BLOCK_SIZE
        );
        assert_eq!(args.time_scale.get(), 10.0);
        assert_eq!(
            args.policies,
            vec![
                PolicyKind::PredictedTtft,
                PolicyKind::Kv,
                PolicyKind::RoundRobin
            ]
        );
        assert_eq!(args.out, PathBuf::from("target/quickstart"));
        assert!(args.trace.is_none());
        assert_eq!(args.engines, Engines::Vllm);
        assert_eq!(args.via, Via::Gateway);
        let nats = Cli::parse_from(["quickstart", "--engines", "nats"]).args;
        assert_eq!(nats.engines, Engines::Nats);
        assert!(Cli::try_parse_from(["quickstart", "--engines", "sglang"]).is_err());
    }

    #[tokio::test]
    async fn vllm_engines_cannot_take_requests_over_nats() {
        let args = Cli::parse_from(["quickstart", "--via", "nats"]).args;
        let err = run(args).await.unwrap_err();
        assert!(
            err.to_string().contains("--via nats needs --engines nats"),
            "{err}"
        );
    }

    /// `--prefill-engines N --decode-engines M` is a fleet of two groups, ids in
    /// order, each in its role (flags for the engines and each relay); without them
    /// one aggregated group of `--workers`.
    #[test]
    fn a_disaggregated_fleet_is_two_groups_in_their_roles() {
        let args = Cli::parse_from(["quickstart", "--workers", "3"]).args;
        let groups = fleet::groups(&args);
        assert_eq!(groups.len(), 1);
        assert_eq!((groups[0].workers, groups[0].first_worker_id), (3, 1));
        assert!(groups[0].role_flags(Some(9000)).is_empty());
        let flags = [
            "quickstart",
            "--prefill-engines",
            "2",
            "--decode-engines",
            "3",
        ];
        let args = Cli::parse_from(flags).args;
        let groups = fleet::groups(&args);
        let ids: Vec<_> = groups
            .iter()
            .map(|g| (g.workers, g.first_worker_id))
            .collect();
        assert_eq!(ids, [(2, 1), (3, 3)]);
        assert_eq!(
            groups[0].role_flags(None),
            ["--role", "prefill", "--kv-transfer", "vllm"]
        );
        assert_eq!(
            groups[1].role_flags(Some(9000)),
            ["--role", "decode", "--kv-transfer", "vllm"]
        );
        let sglang = Cli::parse_from([&flags[..], &["--kv-transfer", "sglang"]].concat()).args;
        let prefill = fleet::groups(&sglang)[0];
        assert!(prefill.bootstrap());
        assert_eq!(
            prefill.role_flags(Some(9001))[4..],
            ["--bootstrap-port", "9001"]
        );
        for bad in [
            &["quickstart", "--prefill-engines", "2"][..],
            &["quickstart", "--decode-engines", "2"],
            &[
                "quickstart",
                "--workers",
                "4",
                "--prefill-engines",
                "1",
                "--decode-engines",
                "1",
            ],
            &[
                "quickstart",
                "--prefill-engines",
                "0",
                "--decode-engines",
                "1",
            ],
        ] {
            assert!(Cli::try_parse_from(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn policies_and_time_scale_parse() {
        let args = Cli::parse_from([
            "quickstart",
            "--policy",
            "random",
            "--policy",
            "kv",
            "--time-scale",
            "2.5",
        ])
        .args;
        assert_eq!(args.policies, vec![PolicyKind::Random, PolicyKind::Kv]);
        assert_eq!(args.time_scale.get(), 2.5);
        assert!(Cli::try_parse_from(["quickstart", "--time-scale", "0"]).is_err());
        assert!(Cli::try_parse_from(["quickstart", "--policy", "fastest"]).is_err());
    }

    #[tokio::test]
    async fn wrong_block_size_is_rejected_before_starting_anything() {
        let mut args = Cli::parse_from(["quickstart"]).args;
        args.block_size = 48;
        let err = run(args).await.unwrap_err();
        assert!(
            err.to_string()
                .contains("--block-size: engine block size 48 tokens does not divide"),
            "{err}"
        );
    }

    #[test]
    fn missing_router_says_how_to_build_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("kv-mocker"), "").unwrap();
        let err = Binaries::locate(Some(dir.path())).err().unwrap();
        assert!(
            err.to_string()
                .contains("build it with `cargo build --release -p kv-router`"),
            "{err}"
        );
    }
}
