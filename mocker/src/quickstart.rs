//! `kv-mocker quickstart`: the README's first command, end to end on one machine.
//!
//! Starts a real nats-server and etcd on free loopback ports, the mock engines
//! (`kv-mocker engines`, this same executable) and the router daemon (`kv-router
//! serve`, expected next to this executable), replays the bundled Mooncake excerpt once
//! per policy (`kv`, then `round-robin`) from a cold cluster, prints the comparison
//! table and writes `<out>/report.json`. Everything it started is stopped in reverse
//! order (router, engines, etcd, nats), also on error, Ctrl-C or SIGTERM.
//!
//! Defaults are sized so both passes take about a minute each on a 2-core machine: the
//! 2,000-request excerpt spans 669 s of trace time and runs at 10× (≈ 67 s per pass
//! plus the last requests' tail). 1,024 KV blocks of 512 tokens per worker (≈ 0.5 M
//! tokens, about what an 8B bf16 model leaves free on one 80 GB GPU) is well below the
//! excerpt's ≈ 39 k distinct blocks, so caches evict and where a prefix lands matters.

use crate::cluster::{Echo, EtcdServer, ManagedProcess, NatsServer};
use crate::replay::{self, ReplayConfig, ReplayTarget, TimeScale};
use crate::trace::{self, BUNDLED_EXCERPT_NAME, BlockMapping};
use anyhow::{Context, anyhow, bail};
use kv_events::Namespace;
use kv_events::routing::PolicyKind;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The namespace the quickstart's router and engines share.
pub const QUICKSTART_NAMESPACE: &str = "quickstart";

/// How long the engines and the router may take to log their ready lines.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a child may take to exit after `SIGTERM` before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Wall-clock limit for one replayed request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

const ENGINES_READY: &str = "kv-mocker engines ready";
const ROUTER_READY: &str = "kv-router ready";

/// `kv-mocker quickstart`: start NATS, etcd, mock engines and the router, replay a
/// trace per policy, print the comparison and write a JSON report.
#[derive(Debug, Clone, clap::Args)]
pub struct QuickstartArgs {
    /// Mock engine workers to start.
    #[arg(long, default_value_t = 8)]
    pub workers: u32,
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
}

/// Runs the quickstart (see the module docs).
///
/// # Errors
/// A missing `nats-server`, `etcd` or `kv-router`, a process that fails to start, a
/// replay error, an unwritable report, or an interruption (Ctrl-C / SIGTERM).
pub async fn run(args: QuickstartArgs) -> anyhow::Result<()> {
    if let Err(err) = BlockMapping::new(args.block_size) {
        bail!("--block-size: {err}");
    }
    let (mut trace, trace_name) = match &args.trace {
        Some(path) => (trace::load_trace(path)?, path.display().to_string()),
        None => (trace::bundled_excerpt()?, BUNDLED_EXCERPT_NAME.to_owned()),
    };
    if let Some(max) = args.max_requests {
        trace.truncate(max);
    }
    let binaries = Binaries::locate(args.bin_dir.as_deref())?;

    let mut stack = Stack::default();
    let result = tokio::select! {
        result = run_stack(&args, &trace, &trace_name, &binaries, &mut stack) => result,
        () = kv_cluster::process::shutdown_signal() => Err(anyhow!("interrupted by Ctrl-C or SIGTERM")),
    };
    if result.is_err() {
        // Show what the children said last: the error may be theirs.
        stack.set_echo(Echo::Forward);
    }
    stack.shutdown().await;
    result
}

/// Everything after validation: start the stack, replay, report.
async fn run_stack(
    args: &QuickstartArgs,
    trace: &[trace::TraceRequest],
    trace_name: &str,
    binaries: &Binaries,
    stack: &mut Stack,
) -> anyhow::Result<()> {
    progress("starting nats-server");
    let nats = stack.nats.insert(NatsServer::start().await?);
    let nats_url = nats.url();
    progress(&format!("nats-server ready at {nats_url}"));

    progress("starting etcd");
    let etcd = stack.etcd.insert(EtcdServer::start().await?);
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
    progress(&format!(
        "starting {} mock engines ({} KV blocks of {} tokens each, time scale {})",
        args.workers, args.num_gpu_blocks, args.block_size, args.time_scale
    ));
    let mut command = child_command(&binaries.mocker);
    command.arg("engines").args(connection).args([
        "--workers",
        &args.workers.to_string(),
        "--block-size",
        &args.block_size.to_string(),
        "--num-gpu-blocks",
        &args.num_gpu_blocks.to_string(),
        "--time-scale",
        &args.time_scale.to_string(),
    ]);
    let engines = stack
        .engines
        .insert(ManagedProcess::spawn("engines", command, Echo::Forward)?);
    engines.wait_for_line(ENGINES_READY, READY_TIMEOUT).await?;

    progress("starting the router (kv-router serve)");
    let mut command = child_command(&binaries.router);
    // The daemon's default policy; every replayed request names its pass's policy.
    command
        .arg("serve")
        .args(connection)
        .args(["--block-size", &args.block_size.to_string()]);
    let router = stack
        .router
        .insert(ManagedProcess::spawn("router", command, Echo::Forward)?);
    router.wait_for_line(ROUTER_READY, READY_TIMEOUT).await?;

    let namespace = Namespace::new(QUICKSTART_NAMESPACE)?;
    let target = ReplayTarget::connect(&nats_url, &[etcd_endpoint], namespace).await?;
    let span_s = trace.last().map_or(0.0, |r| r.timestamp_ms as f64 / 1000.0);
    let policies: Vec<String> = args.policies.iter().map(ToString::to_string).collect();
    progress(&format!(
        "replaying {} requests of {trace_name} ({span_s:.0} s of trace time, about {:.0} s per pass at {}x) under: {}",
        trace.len(),
        span_s / args.time_scale.get(),
        args.time_scale,
        policies.join(", ")
    ));
    // Keep the progress bars readable: children's logs stay in their tails (shown if
    // something fails) instead of interleaving with the bars.
    stack.set_echo(Echo::Quiet);
    let config = ReplayConfig {
        time_scale: args.time_scale,
        request_timeout: REQUEST_TIMEOUT,
        progress: true,
    };
    let report = replay::run_replay_with(&target, trace, &args.policies, &config).await?;
    println!("{}", report.render_table());
    let path = args.out.join("report.json");
    report.write_json(&path)?;
    progress(&format!("report written to {}", path.display()));
    Ok(())
}

/// The executables the quickstart spawns.
struct Binaries {
    mocker: PathBuf,
    router: PathBuf,
}

impl Binaries {
    /// `kv-mocker` (this executable unless `bin_dir` is given) and `kv-router` (next to
    /// it).
    fn locate(bin_dir: Option<&Path>) -> anyhow::Result<Self> {
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
                "kv-router not found at {}; build it with `cargo build{release} -p router-daemon`",
                router.display()
            );
        }
        Ok(Self { mocker, router })
    }
}

/// A command for a child of ours: logs at info unless the user chose a filter (the
/// ready lines are info logs), and no ANSI colours in forwarded lines.
fn child_command(program: &Path) -> Command {
    let mut command = Command::new(program);
    if std::env::var_os("RUST_LOG").is_none() {
        command.env("RUST_LOG", "info");
    }
    command.env("NO_COLOR", "1");
    command
}

/// What the quickstart has started so far; stopped in reverse order.
#[derive(Default)]
struct Stack {
    nats: Option<NatsServer>,
    etcd: Option<EtcdServer>,
    engines: Option<ManagedProcess>,
    router: Option<ManagedProcess>,
}

impl Stack {
    fn set_echo(&self, echo: Echo) {
        for process in [&self.engines, &self.router].into_iter().flatten() {
            process.set_echo(echo);
        }
    }

    /// Stops router, engines, etcd and nats, in that order, each gracefully; errors are
    /// reported and do not stop the rest.
    async fn shutdown(self) {
        let Stack {
            nats,
            etcd,
            engines,
            router,
        } = self;
        if nats.is_none() {
            return;
        }
        progress("stopping router, engines, etcd and nats-server");
        for process in [router, engines].into_iter().flatten() {
            let label = process.label().to_owned();
            if let Err(err) = process.stop(STOP_GRACE).await {
                eprintln!("quickstart: cannot stop {label}: {err}");
            }
        }
        if let Some(etcd) = etcd
            && let Err(err) = etcd.stop().await
        {
            eprintln!("quickstart: cannot stop etcd: {err}");
        }
        if let Some(nats) = nats
            && let Err(err) = nats.stop().await
        {
            eprintln!("quickstart: cannot stop nats-server: {err}");
        }
    }
}

fn progress(message: &str) {
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
        assert_eq!(u64::from(args.block_size), crate::trace::TRACE_BLOCK_SIZE);
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
                .contains("build it with `cargo build --release -p router-daemon`"),
            "{err}"
        );
    }
}
