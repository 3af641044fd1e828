//! A deadline for a participant's whole shutdown sequence.
//!
//! Why: every participant stops in order (stop intake, drain, revoke the lease, flush
//! NATS, …), and most of those steps wait on NATS or etcd. When the servers are gone
//! — a cluster torn down before its routers, a network partition — the NATS client
//! reconnects forever and a drain, flush or server round trip never completes, so an
//! orderly shutdown without a deadline never ends (a SIGTERM'd `kv-router serve` once
//! sat for 30 minutes until SIGKILL). [`ShutdownBudget`] runs each waiting step
//! against one deadline for the whole sequence: once it passes, the step under way is
//! abandoned and every later one skipped, each with a `warn!` naming it, and
//! [`ShutdownBudget::finish`] returns [`ShutdownIncomplete`] listing them, so the
//! process exits with an error status instead of hanging. Steps that only cancel a
//! token or flip a flag need no budget and always run.
//!
//! Cost: one timer per step; nothing when the steps finish in time.
//!
//! The budget is `--shutdown-timeout-ms` ([`ShutdownArgs`]), shared by `kv-router
//! serve`, `kv-router relay` and the mock engines.

use crate::Error;
use clap::Args;
use std::time::Duration;
use tokio::time::Instant;
use tracing::warn;

/// The default shutdown budget (`--shutdown-timeout-ms`), in milliseconds: inside
/// Kubernetes' default 30 s termination grace period with room to spare.
pub const DEFAULT_SHUTDOWN_TIMEOUT_MS: u64 = 10_000;
/// The largest budget `--shutdown-timeout-ms` accepts, in milliseconds (1 hour).
pub const MAX_SHUTDOWN_TIMEOUT_MS: u64 = 3_600_000;

/// The shutdown budget flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub struct ShutdownArgs {
    /// Longest the whole orderly shutdown may take, in milliseconds (1 to 3600000);
    /// past it the remaining steps are skipped (each logged) and the process exits
    /// with an error status.
    #[arg(
        long,
        help_heading = "Shutdown",
        env = "KV_ROUTER_SHUTDOWN_TIMEOUT_MS",
        default_value_t = DEFAULT_SHUTDOWN_TIMEOUT_MS
    )]
    pub shutdown_timeout_ms: u64,
}

impl Default for ShutdownArgs {
    fn default() -> Self {
        Self {
            shutdown_timeout_ms: DEFAULT_SHUTDOWN_TIMEOUT_MS,
        }
    }
}

impl ShutdownArgs {
    /// The budget.
    ///
    /// # Errors
    /// [`Error::InvalidFlag`] for 0 or more than [`MAX_SHUTDOWN_TIMEOUT_MS`].
    pub fn budget(&self) -> Result<Duration, Error> {
        if (1..=MAX_SHUTDOWN_TIMEOUT_MS).contains(&self.shutdown_timeout_ms) {
            Ok(Duration::from_millis(self.shutdown_timeout_ms))
        } else {
            Err(Error::InvalidFlag {
                field: "shutdown-timeout-ms",
                reason: "must be 1 to 3600000 ms",
            })
        }
    }
}

/// A shutdown that did not finish within its budget: the steps abandoned or skipped,
/// in order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "shutdown did not complete within its {} ms budget; abandoned: {}",
    budget.as_millis(),
    abandoned.join(", ")
)]
pub struct ShutdownIncomplete {
    /// The budget of the whole sequence.
    pub budget: Duration,
    /// The steps abandoned when the deadline passed, then those skipped after it.
    pub abandoned: Vec<&'static str>,
}

/// One deadline for a whole shutdown sequence; see the module docs.
#[derive(Debug)]
pub struct ShutdownBudget {
    budget: Duration,
    deadline: Instant,
    abandoned: Vec<&'static str>,
}

impl ShutdownBudget {
    /// Starts the clock: the deadline is `budget` from now.
    pub fn start(budget: Duration) -> Self {
        let now = Instant::now();
        // A budget too far to represent is as good as none (30 years, as tokio's
        // own "far future").
        let far = Duration::from_secs(86_400 * 365 * 30);
        let deadline = now.checked_add(budget).unwrap_or_else(|| now + far);
        Self {
            budget,
            deadline,
            abandoned: Vec::new(),
        }
    }

    /// Runs `work`, the step named `step`, until it finishes or the deadline passes.
    /// `None` when it was abandoned at the deadline or skipped because the deadline
    /// had passed already (not polled at all then); both are logged and listed by
    /// [`Self::finish`]. An abandoned step's future is dropped: work it spawned goes
    /// on until its own task ends or the runtime stops.
    pub async fn step<T>(
        &mut self,
        step: &'static str,
        work: impl Future<Output = T>,
    ) -> Option<T> {
        if !self.abandoned.is_empty() || Instant::now() >= self.deadline {
            warn!(step, "shutdown budget spent; step skipped");
            self.abandoned.push(step);
            return None;
        }
        match tokio::time::timeout_at(self.deadline, work).await {
            Ok(done) => Some(done),
            Err(_) => {
                warn!(
                    step,
                    budget_ms = self.budget.as_millis(),
                    "shutdown budget spent during this step; abandoning it and skipping the rest"
                );
                self.abandoned.push(step);
                None
            }
        }
    }

    /// Ends the sequence.
    ///
    /// # Errors
    /// [`ShutdownIncomplete`] when a step was abandoned or skipped.
    pub fn finish(self) -> Result<(), ShutdownIncomplete> {
        if self.abandoned.is_empty() {
            Ok(())
        } else {
            Err(ShutdownIncomplete {
                budget: self.budget,
                abandoned: self.abandoned,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[tokio::test(start_paused = true)]
    async fn steps_in_time_complete_and_a_hung_step_abandons_the_rest() {
        let mut budget = ShutdownBudget::start(Duration::from_secs(10));
        let quick = budget
            .step("quick", async {
                tokio::time::sleep(Duration::from_secs(3)).await;
                7
            })
            .await;
        assert_eq!(quick, Some(7));

        let started = Instant::now();
        let hung = budget.step("hung", std::future::pending::<()>()).await;
        assert_eq!(hung, None);
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(7),
            "abandoned at the deadline of the whole sequence"
        );

        let polled = AtomicBool::new(false);
        let later = budget
            .step("later", async { polled.store(true, Ordering::Relaxed) })
            .await;
        assert_eq!(later, None);
        assert!(!polled.load(Ordering::Relaxed), "a skipped step never runs");

        let err = budget.finish().expect_err("incomplete");
        assert_eq!(err.abandoned, vec!["hung", "later"]);
        assert_eq!(
            err.to_string(),
            "shutdown did not complete within its 10000 ms budget; abandoned: hung, later"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_huge_budget_does_not_overflow() {
        let mut budget = ShutdownBudget::start(Duration::MAX);
        assert_eq!(budget.step("now", async { 1 }).await, Some(1));
        assert_eq!(budget.finish(), Ok(()));
    }

    #[test]
    fn the_flag_is_bounded() {
        let args = |ms| ShutdownArgs {
            shutdown_timeout_ms: ms,
        };
        assert_eq!(
            ShutdownArgs::default().budget().expect("valid"),
            Duration::from_secs(10)
        );
        assert_eq!(args(1).budget().expect("valid"), Duration::from_millis(1));
        for bad in [0, MAX_SHUTDOWN_TIMEOUT_MS + 1] {
            let err = args(bad).budget().expect_err("refused");
            assert!(err.to_string().contains("--shutdown-timeout-ms"), "{err}");
        }
    }
}
