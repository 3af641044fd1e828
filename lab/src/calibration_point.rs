//! [`CalibrationPoint`]: one rank's learned multipliers at one simulated instant.
//!
//! Plain data shared by the simulation (which samples it), the run reports and the
//! calibration studies, in a module of its own so that none of them has to import
//! another for it.

use scheduler::RankCalibration;
use serde::{Deserialize, Serialize};

/// One rank's calibration estimates at one simulated instant.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CalibrationPoint {
    /// Simulated time, in ms from the first arrival.
    pub at_ms: f64,
    /// The worker, numbered from 1 as in `--worker-speed`.
    pub worker: usize,
    /// Observations the rank's estimator took.
    pub samples: u64,
    /// Learned multiplier of the prefill cost per token.
    pub prefill: f64,
    /// Learned multiplier of the per-step cost (step base and decode together).
    pub per_step: f64,
}

impl CalibrationPoint {
    /// The point of `worker` at `at_ms` from the scheduler's report.
    pub fn new(at_ms: f64, worker: usize, c: &RankCalibration) -> Self {
        Self {
            at_ms,
            worker,
            samples: c.samples,
            prefill: c.scale.prefill,
            per_step: c.scale.step_base,
        }
    }
}
