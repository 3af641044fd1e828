//! [`StudyArgs`]: the flags every lab study shares (the sweep, `robustness`, `swing`).
//!
//! Which trace, how much of it, and the simulation knobs that are not a study's
//! subject (event lag, seed, engine model). One flag group, so the studies cannot drift
//! apart in names, defaults or help text.

use crate::config::{DEFAULT_EVENT_LAG_MS, SimConfig};
use crate::error::LabError;
use engine_model::EngineModelConfig;
use engine_model::trace::{self, TraceRequest};
use scheduler::args::{DelayCapArgs, ReuseCreditArgs};
use scheduler::policy::predicted_ttft::PredictedTtftConfig;
use std::path::PathBuf;

/// Trace and simulation flags shared by every lab study.
#[derive(Debug, Clone, clap::Args)]
pub struct StudyArgs {
    /// Mooncake JSONL trace; default: the bundled 2,000-request conversation excerpt.
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,
    /// Simulate only the first N requests of the trace.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Delay between a step's end and its KV events reaching the index, in model ms.
    #[arg(long, default_value_t = DEFAULT_EVENT_LAG_MS)]
    pub event_lag_ms: f64,
    /// Seed of every random choice (tie-breaks, samplers).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// The engine model of every rank (block size, cache, batch limits).
    #[command(flatten)]
    pub engine: EngineModelConfig,
    /// `predicted-ttft`'s reuse credits, the daemon's own flags (`scheduler::args`),
    /// for every row of that policy; unset ones keep the scheduler's defaults. (Its
    /// step-time constants are the router's defaults, or the engines' own under
    /// `+tuned`: a study's subject, not a flag.)
    #[command(flatten)]
    pub reuse_credit: ReuseCreditArgs,
    /// `predicted-ttft`'s delay cap, the daemon's own flags.
    #[command(flatten)]
    pub delay_cap: DelayCapArgs,
}

impl StudyArgs {
    /// The trace's requests (cut to `--max-requests`) and a name for reports: the
    /// path, or the bundled excerpt's name.
    ///
    /// # Errors
    /// The trace's [`LabError`] (unreadable file, bad line, bundled excerpt corrupt).
    pub fn load_trace(&self) -> Result<(Vec<TraceRequest>, String), LabError> {
        let (mut requests, name) = match &self.trace {
            Some(path) => (trace::load_trace(path)?, path.display().to_string()),
            None => (
                trace::bundled_excerpt()?,
                trace::BUNDLED_EXCERPT_NAME.to_owned(),
            ),
        };
        if let Some(max) = self.max_requests {
            requests.truncate(max);
        }
        Ok((requests, name))
    }

    /// `predicted-ttft`'s defaults with the credit and delay cap flags applied.
    pub fn predicted_ttft_config(&self) -> PredictedTtftConfig {
        let mut config = PredictedTtftConfig::default();
        self.reuse_credit.apply(&mut config);
        self.delay_cap.apply(&mut config);
        config
    }

    /// The simulation these flags describe, engines at the router's constants and
    /// speed 1 (a study sets its own timing and speeds on top).
    pub fn sim_config(&self) -> SimConfig {
        SimConfig {
            engine: self.engine,
            event_lag_ms: self.event_lag_ms,
            seed: self.seed,
            predicted_ttft: self.predicted_ttft_config(),
            ..SimConfig::default()
        }
    }
}
