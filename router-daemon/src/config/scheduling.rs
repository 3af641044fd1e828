//! The `serve` flags of scheduling and admission: the scheduler's own flags
//! (`scheduler::args`, declared once there and shared with the lab), the wait queue
//! and replica sync. Flattened into [`crate::ServeArgs`] and turned into
//! [`scheduler::SchedulerConfig`] and [`AdmissionConfig`] once, at start-up.

use super::error::ConfigError;
use crate::admission::AdmissionConfig;
use crate::queue::QueueConfig;
use crate::replicas::ReplicaConfig;
use clap::{ArgAction, Args};
use kv_events::RouterId;
use scheduler::SchedulerConfig;
use scheduler::args::SchedulerArgs;
use std::time::Duration;

/// Scheduling and admission flags.
#[derive(Debug, Clone, Args)]
pub struct SchedulingArgs {
    /// The policy and its knobs, liveness, calibration, sessions, load accounting
    /// and busy thresholds.
    #[command(flatten)]
    pub scheduler: SchedulerArgs,
    /// Most route requests waiting when every rank is busy; 0 answers overloaded at
    /// once. Must be below --max-inflight-routes (a waiting request holds a slot).
    #[arg(long, env = "KV_ROUTER_QUEUE_CAPACITY", default_value_t = 128)]
    pub queue_capacity: usize,
    /// Longest wait in the queue before answering overloaded, in milliseconds.
    #[arg(long, env = "KV_ROUTER_QUEUE_MAX_WAIT_MS", default_value_t = 5000)]
    pub queue_max_wait_ms: u64,
    /// This replica's id in sequence sync (default: random).
    #[arg(long, env = "KV_ROUTER_ROUTER_ID")]
    pub router_id: Option<u64>,
    /// Share booked load with the other replicas on the sequences subject.
    #[arg(long, env = "KV_ROUTER_REPLICA_SYNC", default_value_t = true, action = ArgAction::Set)]
    pub replica_sync: bool,
    /// At start-up, how long to collect the other replicas' in-flight bookings
    /// (answers to one snapshot request), in milliseconds; 0 skips the snapshot.
    /// Ends at once when no other replica runs.
    #[arg(
        long,
        env = "KV_ROUTER_REPLICA_SNAPSHOT_TIMEOUT_MS",
        default_value_t = 500
    )]
    pub replica_snapshot_timeout_ms: u64,
}

impl SchedulingArgs {
    /// The scheduler and admission configs these flags describe.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first bad flag or field.
    pub(crate) fn to_configs(&self) -> Result<(SchedulerConfig, AdmissionConfig), ConfigError> {
        let scheduler = self.scheduler.to_config()?;
        let admission = AdmissionConfig {
            queue: QueueConfig {
                capacity: self.queue_capacity,
                max_wait: Duration::from_millis(self.queue_max_wait_ms),
            },
            replicas: ReplicaConfig {
                router_id: self
                    .router_id
                    .map_or_else(|| ReplicaConfig::default().router_id, RouterId),
                sync: self.replica_sync,
                snapshot_timeout: Duration::from_millis(self.replica_snapshot_timeout_ms),
            },
        };
        Ok((scheduler, admission))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> SchedulingArgs {
        kv_cluster::args::parse_flags::<SchedulingArgs, _, _>(
            std::iter::once("kv-router").chain(args.iter().copied()),
        )
        .expect("flags parse")
    }

    #[test]
    fn defaults_are_the_scheduler_and_admission_defaults() {
        let (scheduler, admission) = parse(&[]).to_configs().unwrap();
        assert_eq!(scheduler, SchedulerConfig::default());
        assert_eq!(admission.queue, QueueConfig::default());
        assert!(admission.replicas.sync);
        assert_eq!(
            admission.replicas.snapshot_timeout,
            ReplicaConfig::default().snapshot_timeout
        );
        let (_, other) = parse(&[]).to_configs().unwrap();
        assert_ne!(
            admission.replicas.router_id, other.replicas.router_id,
            "random router ids"
        );
    }

    #[test]
    fn every_admission_flag_reaches_its_field() {
        let (_, admission) = parse(&[
            "--queue-capacity",
            "7",
            "--queue-max-wait-ms",
            "250",
            "--router-id",
            "42",
            "--replica-sync",
            "false",
            "--replica-snapshot-timeout-ms",
            "0",
        ])
        .to_configs()
        .unwrap();
        assert_eq!(admission.queue.capacity, 7);
        assert_eq!(admission.queue.max_wait, Duration::from_millis(250));
        assert_eq!(admission.replicas.router_id, RouterId(42));
        assert!(!admission.replicas.sync);
        assert_eq!(admission.replicas.snapshot_timeout, Duration::ZERO);
    }

    /// The scheduler's own flags are tested in `scheduler::args`; here, that its
    /// errors keep naming the flag the way every other `serve` flag does.
    #[test]
    fn scheduler_flag_errors_name_the_flag() {
        let err = parse(&["--policy", "round-robin", "--temperature", "1"])
            .to_configs()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid --temperature: applies to policy kv and kv-normalized, not round-robin"
        );
        let err = parse(&["--request-ttl-ms", "0"]).to_configs().unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid --request-ttl-ms: must be at least 1 ms"
        );
        let err = parse(&["--busy-decode-blocks", "0"])
            .to_configs()
            .unwrap_err();
        assert!(err.to_string().contains("busy.decode_blocks"), "{err}");
    }
}
