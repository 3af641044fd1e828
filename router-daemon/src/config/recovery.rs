//! The gap recovery flags of `kv-router serve` (under the `Indexer` heading, so
//! `[indexer] recovery-…` in the TOML file): how recovery requests are sent, spaced,
//! bounded and given up, validated into [`RecoveryConfig`]. What the settings do:
//! `crate::durability::recovery`.

use super::error::ConfigError;
use crate::durability::RecoveryConfig;
use clap::Args;
use kv_events::recovery::ReplyLimits;
use std::time::Duration;

/// Recovery flags, flattened into [`super::index::IndexArgs`].
#[derive(Debug, Clone, Args)]
pub struct RecoveryArgs {
    /// Timeout of a recovery request (and of each further reply chunk), in ms.
    #[arg(long, env = "KV_ROUTER_RECOVERY_TIMEOUT_MS", default_value_t = 2000)]
    pub recovery_timeout_ms: u64,
    /// Attempts of one recovery before it is given up (spaced by the backoff).
    #[arg(long, env = "KV_ROUTER_RECOVERY_ATTEMPTS", default_value_t = 4)]
    pub recovery_attempts: u32,
    /// Recovery requests in flight at once (at most one per worker rank).
    #[arg(long, env = "KV_ROUTER_RECOVERY_CONCURRENCY", default_value_t = 16)]
    pub recovery_concurrency: usize,
    /// First delay between attempts, and between recoveries of a rank that did not
    /// close its gap, in ms; doubles up to --recovery-backoff-max-ms, plus up to
    /// 100% random jitter.
    #[arg(long, env = "KV_ROUTER_RECOVERY_BACKOFF_MIN_MS", default_value_t = 100)]
    pub recovery_backoff_min_ms: u64,
    /// Largest backoff delay before jitter, in ms.
    #[arg(
        long,
        env = "KV_ROUTER_RECOVERY_BACKOFF_MAX_MS",
        default_value_t = 30_000
    )]
    pub recovery_backoff_max_ms: u64,
    /// Recoveries in a row that did not close a rank's gap before the rank is
    /// degraded: its gaps are then skipped without asking until the cool-down ends
    /// or its publisher restarts.
    #[arg(long, env = "KV_ROUTER_RECOVERY_BUDGET", default_value_t = 8)]
    pub recovery_budget: u32,
    /// How long a degraded rank is not asked for recovery, in seconds.
    #[arg(
        long,
        env = "KV_ROUTER_RECOVERY_DEGRADED_COOLDOWN_SECS",
        default_value_t = 300
    )]
    pub recovery_degraded_cooldown_secs: u64,
    /// Most messages (chunks) in one recovery reply; a longer reply is refused.
    #[arg(
        long,
        env = "KV_ROUTER_RECOVERY_MAX_REPLY_CHUNKS",
        default_value_t = 4096
    )]
    pub recovery_max_reply_chunks: u32,
    /// Most payload bytes in one recovery reply; a larger reply is refused before
    /// the chunk that crosses it is decoded.
    #[arg(
        long,
        env = "KV_ROUTER_RECOVERY_MAX_REPLY_BYTES",
        default_value_t = 256 << 20
    )]
    pub recovery_max_reply_bytes: usize,
}

impl RecoveryArgs {
    /// The recovery settings these flags describe.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first bad flag.
    pub(crate) fn to_config(&self) -> Result<RecoveryConfig, ConfigError> {
        let invalid = |field: &'static str, reason: &str| ConfigError::Invalid {
            field,
            reason: reason.to_owned(),
        };
        for (field, value) in [
            ("recovery-timeout-ms", self.recovery_timeout_ms),
            ("recovery-attempts", u64::from(self.recovery_attempts)),
            ("recovery-concurrency", self.recovery_concurrency as u64),
            ("recovery-backoff-min-ms", self.recovery_backoff_min_ms),
            ("recovery-budget", u64::from(self.recovery_budget)),
            (
                "recovery-degraded-cooldown-secs",
                self.recovery_degraded_cooldown_secs,
            ),
            (
                "recovery-max-reply-chunks",
                u64::from(self.recovery_max_reply_chunks),
            ),
            (
                "recovery-max-reply-bytes",
                self.recovery_max_reply_bytes as u64,
            ),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        if self.recovery_backoff_max_ms < self.recovery_backoff_min_ms {
            return Err(invalid(
                "recovery-backoff-max-ms",
                "must be at least --recovery-backoff-min-ms",
            ));
        }
        Ok(RecoveryConfig {
            timeout: Duration::from_millis(self.recovery_timeout_ms),
            attempts: self.recovery_attempts,
            concurrency: self.recovery_concurrency,
            backoff_min: Duration::from_millis(self.recovery_backoff_min_ms),
            backoff_max: Duration::from_millis(self.recovery_backoff_max_ms),
            budget: self.recovery_budget,
            cooldown: Duration::from_secs(self.recovery_degraded_cooldown_secs),
            reply_limits: ReplyLimits {
                max_chunks: self.recovery_max_reply_chunks,
                max_bytes: self.recovery_max_reply_bytes,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> RecoveryArgs {
        kv_cluster::args::parse_flags::<RecoveryArgs, _, _>(
            std::iter::once("x").chain(args.iter().copied()),
        )
        .expect("flags parse")
    }

    #[test]
    fn defaults_are_the_documented_ones_and_flags_reach_their_fields() {
        assert_eq!(parse(&[]).to_config().unwrap(), RecoveryConfig::default());
        let config = parse(&[
            "--recovery-backoff-min-ms",
            "20",
            "--recovery-backoff-max-ms",
            "200",
            "--recovery-budget",
            "3",
            "--recovery-degraded-cooldown-secs",
            "60",
            "--recovery-max-reply-chunks",
            "10",
            "--recovery-max-reply-bytes",
            "1000",
        ])
        .to_config()
        .unwrap();
        assert_eq!(config.backoff_min, Duration::from_millis(20));
        assert_eq!(config.backoff_max, Duration::from_millis(200));
        assert_eq!(config.budget, 3);
        assert_eq!(config.cooldown, Duration::from_secs(60));
        assert_eq!(
            config.reply_limits,
            ReplyLimits {
                max_chunks: 10,
                max_bytes: 1000
            }
        );
    }

    #[test]
    fn bad_values_name_their_flag() {
        for (args, flag) in [
            (&["--recovery-attempts", "0"][..], "recovery-attempts"),
            (&["--recovery-budget", "0"][..], "recovery-budget"),
            (
                &["--recovery-max-reply-bytes", "0"][..],
                "recovery-max-reply-bytes",
            ),
            (
                &["--recovery-backoff-max-ms", "10"][..],
                "recovery-backoff-max-ms",
            ),
        ] {
            let err = parse(args).to_config().unwrap_err();
            assert!(err.to_string().contains(flag), "{err}");
        }
    }
}
