//! [`LabError`], the one error of every lab study. It sits in its own module so each
//! study, the simulator and the report writers import it from a sibling instead of
//! reaching back up into the crate root.

use engine_model::ModelConfigError;
use engine_model::trace::{TraceBlockSizeMismatch, TraceError};
use kv_events::WorkerRank;
use std::path::PathBuf;

/// Why the lab could not run or report.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// The trace could not be loaded.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The engine block size cannot split the trace's blocks.
    #[error(transparent)]
    BlockSize(#[from] TraceBlockSizeMismatch),
    /// The trace was prepared for another block size than the engine model's.
    #[error("trace prepared for {trace}-token blocks but the engine uses {engine}")]
    BlockSizeMismatch {
        /// Block size the trace was mapped to, in tokens.
        trace: u32,
        /// The engine model's block size, in tokens.
        engine: u32,
    },
    /// An engine model knob is unusable.
    #[error("engine model: {0}")]
    Engine(#[from] ModelConfigError),
    /// The event lag is negative or not finite.
    #[error("event lag must be finite and >= 0 ms, got {0}")]
    EventLag(f64),
    /// No router replica, or several over a split fleet (the lab syncs whole
    /// requests' bookings only).
    #[error("router replicas: at least 1, and only 1 over a split fleet; got {0}")]
    Replicas(usize),
    /// The replica sync lag is negative or not finite.
    #[error("replica sync lag must be finite and >= 0 ms, got {0}")]
    SyncLag(f64),
    /// `kv-mocker lab swing --cell` names no robustness cell.
    #[error("unknown cell {0:?} (see `kv-mocker lab robustness` for the names)")]
    UnknownCell(String),
    /// The calibration sample interval is below 1 ms or not finite.
    #[error("calibration sample interval must be finite and >= 1 ms, got {0}")]
    SampleInterval(f64),
    /// A speed-up is not a finite number greater than 0.
    #[error("speed-up must be a finite number greater than 0, got {0}")]
    Speedup(f64),
    /// A worker speed or timing factor is not a finite number greater than 0.
    #[error("factor must be a finite number greater than 0, got {0}")]
    Factor(f64),
    /// A timing coefficient of the engines is negative or not finite.
    #[error("engine timing coefficients must be finite and >= 0 ms, got {0}")]
    Timing(f64),
    /// `--worker-speed` lists another number of speeds than a setting has workers.
    #[error(
        "--worker-speed gives {given} speeds but a setting has {workers} workers (give one speed for all, or one per worker)"
    )]
    WorkerSpeedCount {
        /// Speeds given.
        given: usize,
        /// Workers in the setting.
        workers: u32,
    },
    /// A split fleet leaves no prefill or no decode engine.
    #[error(
        "a split fleet needs at least one prefill and one decode engine: {prefill} prefill engines of {workers}"
    )]
    Split {
        /// Prefill engines asked for.
        prefill: u32,
        /// Engines in the setting.
        workers: u32,
    },
    /// `kv-mocker lab hybrid` was given no sliding-window group.
    #[error("lab hybrid needs --sliding-window-groups of at least 1")]
    NotHybrid,
    /// A setting has no workers, or no setting or policy was given.
    #[error("nothing to simulate: need at least one worker, setting and policy")]
    NoWorkers,
    /// The scheduler refused its configuration, a registration or a request.
    #[error("scheduler: {0}")]
    Scheduler(#[from] scheduler::SchedulerError),
    /// The scheduler chose a rank the lab does not simulate.
    #[error("scheduler chose unknown rank {0}")]
    NoRank(WorkerRank),
    /// A run did not produce a result (its thread panicked).
    #[error("a simulation run did not complete")]
    Incomplete,
    /// A report or chart file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A chart could not be drawn or encoded.
    #[error("chart: {0}")]
    Chart(String),
}
