//! The one error type of the scheduler crate.
//!
//! Every fallible scheduler operation returns [`SchedulerError`]. None of the variants
//! carry a backtrace or a boxed source, so building one costs at most a `String`
//! (a cloned request id or a config reason); the daemon maps them onto
//! `kv_events::routing::RouteErrorCode` at the wire edge.

use kv_events::discovery::RegistrationError;
use kv_events::{DpRank, RequestId, WorkerRank};

/// Why a scheduler operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    /// `schedule` was called while no (worker, dp_rank) is registered.
    #[error("no workers registered")]
    NoWorkers,
    /// Workers are registered, but the request excluded every one of them (a
    /// frontend's failover ran out of workers to try), or none is in its eligible
    /// set.
    #[error("every registered worker is excluded by the request or outside its eligible set")]
    AllExcluded,
    /// The request pinned a dp_rank that no registered worker has. Never answered by
    /// falling back to another rank.
    #[error("no registered worker has dp_rank {0}")]
    RankUnavailable(DpRank),
    /// Every rank the request may use is busy (see [`crate::BusyThresholds`]); the
    /// request may wait and be scheduled again when load frees. Nothing was booked.
    #[error("every eligible rank is busy")]
    AllBusy,
    /// A request with this id is already booked; ids must be unique among active
    /// requests (a frontend retry must use a new id: one it freed is refused for a
    /// while by a replica that did not hold it, [`SchedulerError::FreedBeforeRouted`]).
    #[error("request {0} is already active")]
    DuplicateRequest(RequestId),
    /// A frontend freed this request id before it was routed here (it gave up on the
    /// route query, or asked it again under another id), within
    /// [`crate::freed_early::REMEMBER_FOR`]: the query is stale and books nothing.
    #[error("request {0} was freed by its frontend before it was routed")]
    FreedBeforeRouted(RequestId),
    /// A frontend's request id ends with `#prefill`, the suffix reserved for the
    /// booking of a disaggregated request's prefill half
    /// (`kv_events::disaggregation::PREFILL_BOOKING_SUFFIX`).
    #[error("request id {0} ends with `#prefill`, which is reserved for prefill halves")]
    ReservedRequestId(RequestId),
    /// A lifecycle operation named a request that is not active (never routed here,
    /// already freed, expired, or dropped when its worker left).
    #[error("request {0} is not active")]
    UnknownRequest(RequestId),
    /// A booking (from another router replica) names a rank that is not registered
    /// here; it is refused rather than kept for a worker that may never appear.
    #[error("rank {0} is not registered")]
    UnregisteredRank(WorkerRank),
    /// A per-request override is out of range or names a knob the policy lacks.
    #[error("invalid override `{field}`: {reason}")]
    InvalidOverride {
        /// The knob, as named on the wire (e.g. `temperature`).
        field: &'static str,
        /// What is wrong with it, lowercase.
        reason: String,
    },
    /// A configuration value is out of range.
    #[error("invalid config field `{field}`: {reason}")]
    InvalidConfig {
        /// Dotted path of the offending field, e.g. `policy.kv.temperature`.
        field: &'static str,
        /// What is wrong with it, lowercase.
        reason: String,
    },
    /// A command-line flag cannot be used: given for a policy that lacks the knob,
    /// or out of range (see `scheduler::args`, feature `clap`).
    #[error("invalid --{flag}: {reason}")]
    InvalidFlag {
        /// The flag's long name, without `--`.
        flag: &'static str,
        /// What is wrong with it, lowercase.
        reason: String,
    },
    /// A worker registration record broke an invariant (e.g. `dp_size` 0).
    #[error("invalid worker registration: {0}")]
    InvalidRegistration(#[from] RegistrationError),
}
