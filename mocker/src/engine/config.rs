//! Typed configuration of the engine service, grouped by concern: where NATS and etcd
//! are ([`ConnectionArgs`]), which workers run ([`FleetArgs`]), and how the service
//! paces itself ([`RuntimeArgs`]). The model's own knobs live in `engine_model`.
//!
//! Each group is a `clap::Args` struct so `kv-mocker engines` keeps flat flags (the
//! groups are flattened into [`super::EngineArgs`]), while library users — the
//! quickstart and integration tests — build the same structs directly (every group
//! implements `Default` with the CLI defaults). Validation is explicit
//! ([`RuntimeArgs::validate`], [`FleetArgs::worker_ids`]) and cheap.

use engine_model::ModelConfigError;
use kv_cluster::args::{EtcdArgs, NamespaceArgs, NatsArgs};
use kv_events::{Namespace, WorkerId};
use std::time::Duration;

/// Why an engine service configuration is unusable.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineConfigError {
    /// A knob of the engine model itself.
    #[error(transparent)]
    Model(#[from] ModelConfigError),
    /// `workers` was 0.
    #[error("at least one worker is required")]
    NoWorkers,
    /// `dp_size` was 0.
    #[error("dp size must be at least 1")]
    ZeroDpSize,
    /// Worker ids `first..first + workers` overflow `u64`.
    #[error("worker ids starting at {first} overflow with {workers} workers")]
    WorkerIdOverflow {
        /// The first worker id.
        first: u64,
        /// The number of workers.
        workers: u32,
    },
    /// `time_scale` was not a positive finite number.
    #[error("time scale must be positive and finite, got {0}")]
    BadTimeScale(f64),
    /// `lease_ttl_secs` was below the 2 s needed to renew at a third of it.
    #[error("lease ttl must be at least 2 seconds, got {0}")]
    LeaseTtlTooShort(u64),
    /// `metrics_interval_ms` was 0.
    #[error("metrics interval must be at least 1 ms")]
    ZeroMetricsInterval,
    /// `--zmq-port` or `--zmq-replay-port` + socket offset passes 65535.
    #[error("zmq port {base} + {offset} is past 65535")]
    ZmqPortOverflow {
        /// The base port.
        base: u16,
        /// Worker index × dp size + rank.
        offset: u64,
    },
    /// `--zmq-buffer-steps` was 0.
    #[error("zmq buffer steps must be at least 1")]
    ZeroBufferSteps,
    /// The role flags do not fit together (`--role`, `--kv-transfer`,
    /// `--bootstrap-port`); the message names the flag.
    #[error("{0}")]
    Placement(String),
    /// `--bootstrap-port` + worker index overflows a port number.
    #[error("bootstrap port {base} + {workers} workers is past 65535")]
    BootstrapPortOverflow {
        /// The base port.
        base: u16,
        /// Workers needing a port.
        workers: usize,
    },
    /// `--http-port` + worker index overflows a port number.
    #[error("http port {base} + {workers} workers is past 65535")]
    HttpPortOverflow {
        /// The base port.
        base: u16,
        /// Workers needing a port.
        workers: usize,
    },
}

/// Where the engines find NATS and etcd, and the namespace they serve: the NATS and
/// etcd flags (authentication, TLS) of every kv-router participant.
#[derive(Debug, Clone, clap::Args)]
pub struct ConnectionArgs {
    /// NATS servers, authentication and TLS.
    #[command(flatten)]
    pub nats: NatsArgs,
    /// etcd endpoints, authentication and TLS.
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Namespace of subjects and etcd keys, the cluster's one `--namespace`.
    #[command(flatten)]
    pub namespace: NamespaceArgs,
}

impl ConnectionArgs {
    /// Default TLS-less, unauthenticated flags for one NATS server at `nats_url` and
    /// one etcd endpoint, in `namespace` (the quickstart's and the tests' cluster).
    pub fn local(nats_url: &str, etcd_endpoint: &str, namespace: &Namespace) -> Self {
        Self {
            nats: NatsArgs {
                nats_url: vec![nats_url.to_owned()],
                ..NatsArgs::default()
            },
            etcd: EtcdArgs {
                etcd_endpoints: vec![etcd_endpoint.to_owned()],
                ..EtcdArgs::default()
            },
            namespace: NamespaceArgs {
                namespace: namespace.as_str().to_owned(),
            },
        }
    }
}

/// Which workers this process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct FleetArgs {
    /// Number of mock workers M in this process.
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// Worker id of the first worker; workers get ids `first .. first + M`.
    #[arg(long, default_value_t = 1)]
    pub first_worker_id: u64,
    /// Data-parallel ranks per worker; each rank has its own KV cache and batch.
    #[arg(long, default_value_t = 1)]
    pub dp_size: u32,
}

impl Default for FleetArgs {
    fn default() -> Self {
        Self {
            workers: 4,
            first_worker_id: 1,
            dp_size: 1,
        }
    }
}

impl FleetArgs {
    /// The worker ids, in order.
    ///
    /// # Errors
    /// [`EngineConfigError`] for zero workers, zero dp ranks or an id overflow.
    pub fn worker_ids(&self) -> Result<Vec<WorkerId>, EngineConfigError> {
        if self.workers == 0 {
            return Err(EngineConfigError::NoWorkers);
        }
        if self.dp_size == 0 {
            return Err(EngineConfigError::ZeroDpSize);
        }
        let overflow = EngineConfigError::WorkerIdOverflow {
            first: self.first_worker_id,
            workers: self.workers,
        };
        self.first_worker_id
            .checked_add(u64::from(self.workers) - 1)
            .ok_or(overflow)?;
        Ok((0..u64::from(self.workers))
            .map(|i| WorkerId(self.first_worker_id + i))
            .collect())
    }
}

/// How the service paces itself against the wall clock.
#[derive(Debug, Clone, Copy, PartialEq, clap::Args)]
pub struct RuntimeArgs {
    /// Model time runs this many times faster than wall-clock time: a step of `t` model
    /// ms takes `t / time_scale` wall ms.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// TTL of each worker's etcd lease, in seconds (renewed every TTL/3).
    #[arg(long, default_value_t = 10)]
    pub lease_ttl_secs: u64,
    /// Period of load-metrics publication, in wall-clock ms (not scaled by
    /// `time_scale`: it is about router freshness, which is wall-clock).
    #[arg(long, default_value_t = 100)]
    pub metrics_interval_ms: u64,
    /// Budget of the whole shutdown (`--shutdown-timeout-ms`, as `kv-router serve`).
    #[command(flatten)]
    pub shutdown: kv_cluster::shutdown::ShutdownArgs,
}

impl Default for RuntimeArgs {
    fn default() -> Self {
        Self {
            time_scale: 1.0,
            lease_ttl_secs: 10,
            metrics_interval_ms: 100,
            shutdown: Default::default(),
        }
    }
}

impl RuntimeArgs {
    /// Checks the pacing knobs.
    ///
    /// # Errors
    /// [`EngineConfigError`] naming the first bad knob.
    pub fn validate(&self) -> Result<(), EngineConfigError> {
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(EngineConfigError::BadTimeScale(self.time_scale));
        }
        if self.lease_ttl_secs < 2 {
            return Err(EngineConfigError::LeaseTtlTooShort(self.lease_ttl_secs));
        }
        if self.metrics_interval_ms == 0 {
            return Err(EngineConfigError::ZeroMetricsInterval);
        }
        Ok(())
    }

    /// Wall-clock duration of `model_ms` model milliseconds.
    pub fn wall_duration(&self, model_ms: f64) -> Duration {
        Duration::from_secs_f64((model_ms / self.time_scale / 1_000.0).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        assert_eq!(RuntimeArgs::default().validate(), Ok(()));
        assert_eq!(
            FleetArgs::default().worker_ids(),
            Ok(vec![WorkerId(1), WorkerId(2), WorkerId(3), WorkerId(4)])
        );
    }

    #[test]
    fn bad_knobs_are_named() {
        let r = RuntimeArgs::default();
        assert!(
            RuntimeArgs {
                time_scale: 0.0,
                ..r
            }
            .validate()
            .is_err()
        );
        assert!(
            RuntimeArgs {
                time_scale: f64::NAN,
                ..r
            }
            .validate()
            .is_err()
        );
        let f = FleetArgs {
            workers: 2,
            first_worker_id: u64::MAX,
            dp_size: 1,
        };
        assert!(matches!(
            f.worker_ids(),
            Err(EngineConfigError::WorkerIdOverflow { .. })
        ));
    }

    #[test]
    fn time_scale_shrinks_wall_time() {
        let r = RuntimeArgs {
            time_scale: 4.0,
            ..RuntimeArgs::default()
        };
        assert_eq!(r.wall_duration(100.0), Duration::from_millis(25));
    }
}
