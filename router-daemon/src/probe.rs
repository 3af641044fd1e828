//! `kv-router probe`: a health check client for containers and scripts.
//!
//! Docker `HEALTHCHECK`, systemd `ExecStartPost` or a shell loop can run
//! `kv-router probe ready` instead of needing curl in the image. It sends one
//! `GET` to the daemon's HTTP endpoint and exits 0 only on `200`, printing the body.

use clap::{Args, ValueEnum};
use std::time::Duration;

/// Which endpoint to probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProbeTarget {
    /// `/health/livez`: the process serves HTTP.
    Live,
    /// `/health/readyz`: connected, discovery loaded, recovery done.
    Ready,
}

impl ProbeTarget {
    pub(crate) fn path(self) -> &'static str {
        match self {
            ProbeTarget::Live => "/health/livez",
            ProbeTarget::Ready => "/health/readyz",
        }
    }
}

/// `kv-router probe` flags.
#[derive(Debug, Clone, Args)]
pub struct ProbeArgs {
    /// Endpoint to ask.
    #[arg(value_enum, default_value = "ready")]
    pub target: ProbeTarget,
    /// The daemon's HTTP address, `host:port`.
    #[arg(long, env = "KV_ROUTER_PROBE_ADDR", default_value = "127.0.0.1:9090")]
    pub addr: String,
    /// Give up after this many milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub timeout_ms: u64,
}

/// Runs the probe.
///
/// # Errors
/// When the endpoint does not answer `200` in time (the message says what it did).
pub async fn run(args: &ProbeArgs) -> anyhow::Result<()> {
    let (status, body) = kv_cluster::http::get_once(
        &args.addr,
        args.target.path(),
        Duration::from_millis(args.timeout_ms),
    )
    .await?;
    println!("{}", body.trim_end());
    if status.as_u16() == 200 {
        Ok(())
    } else {
        anyhow::bail!("{} answered http {}", args.target.path(), status.as_u16())
    }
}
