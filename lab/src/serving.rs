//! How a run's engines serve requests: all of them whole requests (*aggregated*, role
//! `both`), or split into prefill and decode engines (*disaggregated*, or
//! *conditional* when the router may keep a prompt on its decode engine). The KV
//! transfer between the two halves is the engine model's
//! ([`engine_model::KvTransferConfig`], `--transfer-ms-per-token`).
//!
//! Why in the lab: at an equal number of engines, a split fleet trades prefill
//! capacity (only the prefill engines compute prompts) and a transfer per request for
//! decode steps that no long prefill stalls. Which side wins depends on prompt length,
//! prefix reuse and load, so the lab replays the same trace through each layout
//! (`kv-mocker lab disagg`, [`crate::disagg`]).
//!
//! Cost: a role per engine.

use crate::error::LabError;
use kv_events::disaggregation::WorkerRole;
use scheduler::DisaggregationConfig;
use serde::{Deserialize, Serialize};

/// How a run's engines serve requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Serving {
    /// Every engine prefills and decodes whole requests (role `both`), as before
    /// disaggregation.
    #[default]
    Aggregated,
    /// The first `prefill_engines` engines prefill (role `prefill`), the rest decode
    /// (role `decode`); every request allows disaggregation.
    Split(SplitFleet),
}

/// A fleet split into prefill and decode engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitFleet {
    /// Engines in the `prefill` role (the first ones, by worker id); the rest decode.
    pub prefill_engines: u32,
    /// When the router keeps a prompt on its decode engine.
    pub mode: SplitMode,
}

/// When a split fleet's router prefills a prompt on its decode engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum SplitMode {
    /// Every prompt goes to a prefill engine, unless its decode engine already holds
    /// all of it (nothing left to prefill there).
    Disaggregated,
    /// Conditional disaggregation: the router's thresholds (`--disagg-*` flags) keep
    /// a prompt on its decode engine when the uncached part is short or the decode
    /// engine holds most of its prefix.
    Conditional,
}

/// The thresholds of [`SplitMode::Disaggregated`]: a prompt stays on its decode
/// engine only when nothing of it is left to prefill there (0 uncached tokens, or
/// every block held), so every other prompt is prefilled remotely.
pub const ALWAYS_REMOTE: DisaggregationConfig = DisaggregationConfig {
    max_local_prefill_tokens: 0,
    min_decode_overlap: 1.0,
};

impl SplitMode {
    /// The name in tables and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            SplitMode::Disaggregated => "disaggregated",
            SplitMode::Conditional => "conditional",
        }
    }
}

impl Serving {
    /// The role of each of `workers` engines, in worker order.
    ///
    /// # Errors
    /// [`LabError::Split`] when a split fleet leaves no prefill or no decode engine.
    pub fn roles(self, workers: u32) -> Result<Vec<WorkerRole>, LabError> {
        match self {
            Serving::Aggregated => Ok(vec![WorkerRole::Both; workers as usize]),
            Serving::Split(split) => {
                let prefill = split.prefill_engines;
                if prefill == 0 || prefill >= workers {
                    return Err(LabError::Split { prefill, workers });
                }
                Ok((0..workers)
                    .map(|i| {
                        if i < prefill {
                            WorkerRole::Prefill
                        } else {
                            WorkerRole::Decode
                        }
                    })
                    .collect())
            }
        }
    }

    /// The name in tables and reports: `aggregated`, or the mode with the split,
    /// `disaggregated 2P+6D`, `conditional 3P+5D`.
    pub fn label(self, workers: u32) -> String {
        match self {
            Serving::Aggregated => "aggregated".to_owned(),
            Serving::Split(split) => format!(
                "{} {}P+{}D",
                split.mode.as_str(),
                split.prefill_engines,
                workers.saturating_sub(split.prefill_engines)
            ),
        }
    }
}

#[cfg(test)]
#[path = "serving_tests.rs"]
mod tests;
