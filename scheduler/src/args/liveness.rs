//! The flags of liveness from silence: how often engines publish load metrics
//! and after how many missed intervals a rank is deprioritized, then excluded. What
//! the rule does: `scheduler::liveness`.

use crate::LivenessConfig;
use clap::{ArgAction, Args};
use std::time::Duration;

/// Liveness flags, flattened into [`super::SchedulerArgs`].
#[derive(Debug, Clone, Args)]
pub struct LivenessArgs {
    /// Treat silence in a rank's load metrics as a sign it died: deprioritize it after
    /// --metrics-quiet-intervals, exclude it after --metrics-silent-intervals, until
    /// it reports again. false: the etcd lease is the only liveness signal. A rank
    /// that never reported metrics is judged by its lease alone either way.
    #[arg(long, env = "KV_ROUTER_METRICS_LIVENESS", default_value_t = true, action = ArgAction::Set)]
    pub metrics_liveness: bool,
    /// How often engines publish load metrics, in milliseconds (the relay's
    /// --metrics-interval-ms; the mock engines publish every 100 ms).
    #[arg(long, env = "KV_ROUTER_METRICS_INTERVAL_MS", default_value_t = 1000)]
    pub metrics_interval_ms: u64,
    /// Missed metric intervals after which a rank only gets requests no live rank
    /// can take.
    #[arg(long, env = "KV_ROUTER_METRICS_QUIET_INTERVALS", default_value_t = 3)]
    pub metrics_quiet_intervals: u32,
    /// Missed metric intervals after which a rank gets no requests at all (unless no
    /// rank reports: then the fault is taken to be the router's own feed).
    #[arg(long, env = "KV_ROUTER_METRICS_SILENT_INTERVALS", default_value_t = 10)]
    pub metrics_silent_intervals: u32,
}

impl LivenessArgs {
    /// The scheduler's liveness settings (validated with the rest of its config).
    pub fn to_config(&self) -> LivenessConfig {
        LivenessConfig {
            enabled: self.metrics_liveness,
            metrics_interval: Duration::from_millis(self.metrics_interval_ms),
            quiet_intervals: self.metrics_quiet_intervals,
            silent_intervals: self.metrics_silent_intervals,
        }
    }
}
