//! The flags of session affinity: whether a request's session id keeps it
//! on the session's last rank, the table's bounds and the margins. What it does:
//! `scheduler::sessions`.

use crate::SessionConfig;
use clap::{ArgAction, Args};
use std::time::Duration;

/// Session affinity flags, flattened into [`super::SchedulerArgs`].
#[derive(Debug, Clone, Args)]
pub struct SessionArgs {
    /// Prefer the rank that served a session's last request for requests that carry
    /// a session id (the gateway's `x-session-id` header), unless another rank is
    /// cheaper by the margin. Requests without one are unaffected.
    #[arg(long, env = "KV_ROUTER_SESSION_AFFINITY", default_value_t = true, action = ArgAction::Set)]
    pub session_affinity: bool,
    /// The table's bounds and the margins.
    #[command(flatten)]
    pub tuning: SessionTuningArgs,
}

/// Session affinity's bounds and margins, apart from whether it is on: the lab
/// flattens these alone (it turns affinity on per policy row).
#[derive(Debug, Clone, Args)]
pub struct SessionTuningArgs {
    /// Most sessions remembered per replica; the least recently used is forgotten
    /// first (about 170 bytes per session with UUID ids).
    #[arg(long, env = "KV_ROUTER_SESSION_CAPACITY", default_value_t = 65_536)]
    pub session_capacity: usize,
    /// A session unused this long is forgotten, in milliseconds.
    #[arg(long, env = "KV_ROUTER_SESSION_TTL_MS", default_value_t = 600_000)]
    pub session_ttl_ms: u64,
    /// `predicted-ttft`: leave the session's last rank only for one whose predicted
    /// TTFT is lower by more than this, in milliseconds.
    #[arg(long, env = "KV_ROUTER_SESSION_MARGIN_MS", default_value_t = 50.0)]
    pub session_margin_ms: f64,
    /// `kv`, `kv-normalized`: leave the session's last rank only for one whose cost
    /// is lower by more than this share of the last rank's cost, in [0, 1].
    #[arg(
        long,
        env = "KV_ROUTER_SESSION_RELATIVE_MARGIN",
        default_value_t = 0.25
    )]
    pub session_relative_margin: f64,
}

impl SessionArgs {
    /// The scheduler's session settings (validated with the rest of its config).
    pub fn to_config(&self) -> SessionConfig {
        self.tuning.to_config(self.session_affinity)
    }
}

impl SessionTuningArgs {
    /// The scheduler's session settings with affinity `enabled` or not.
    pub fn to_config(&self, enabled: bool) -> SessionConfig {
        SessionConfig {
            enabled,
            capacity: self.session_capacity,
            ttl: Duration::from_millis(self.session_ttl_ms),
            margin_ms: self.session_margin_ms,
            relative_margin: self.session_relative_margin,
        }
    }
}
