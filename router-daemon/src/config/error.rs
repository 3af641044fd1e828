//! The daemon's configuration error: one type for every flag group of `serve`, so
//! each group's validation names the bad flag the same way. It imports nothing of
//! the groups, which all import it.

/// A configuration value of `serve` that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The namespace is not a valid subject token.
    #[error("invalid --namespace: {0}")]
    Namespace(#[from] kv_events::NamespaceError),
    /// A field is out of range.
    #[error("invalid --{field}: {reason}")]
    Invalid {
        /// The flag name.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A NATS or etcd flag is unusable.
    #[error(transparent)]
    Connection(#[from] kv_cluster::Error),
    /// The scheduler rejected its sub-config.
    #[error("invalid scheduler config: {0}")]
    Scheduler(scheduler::SchedulerError),
}

impl From<scheduler::SchedulerError> for ConfigError {
    /// A bad scheduler flag is named like every other `serve` flag
    /// ([`ConfigError::Invalid`]); anything else the scheduler refuses is
    /// [`ConfigError::Scheduler`].
    fn from(error: scheduler::SchedulerError) -> Self {
        match error {
            scheduler::SchedulerError::InvalidFlag { flag, reason } => ConfigError::Invalid {
                field: flag,
                reason,
            },
            other => ConfigError::Scheduler(other),
        }
    }
}
