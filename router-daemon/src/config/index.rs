//! The index flags of `kv-router serve`: memory bound, approximate mode, gap
//! recovery and the optional JetStream path. They are validated into the indexer's
//! own [`IndexerConfig`] fields plus the daemon's
//! `crate::durability::DurabilityConfig`; what those settings do is documented in
//! `crate::durability`.
//!
//! The `--index-backend` flag is gone with the sharded backend it chose: the flag
//! and its config-file key (`[indexer] index-backend`) are refused by clap and the
//! file loader as unknown, and its environment variable, which nothing else would
//! notice, is refused by [`IndexArgs::apply`].

use super::error::ConfigError;
use crate::durability::{DurabilityConfig, JetStreamConfig};
use clap::{Args, ValueEnum};
use indexer::{IndexMode, IndexerConfig, Pruning};
use kv_events::Subjects;
use std::ffi::OsString;
use std::time::Duration;

/// The environment variable of the retired `--index-backend` flag.
const RETIRED_BACKEND_ENV: &str = "KV_ROUTER_INDEX_BACKEND";

/// Where the index's knowledge comes from, as a flag value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IndexModeArg {
    /// Engines publish KV events.
    KvEvents,
    /// Engines publish nothing: the router indexes its own routing decisions.
    Approximate,
}

/// Index, recovery and JetStream flags of `kv-router serve`.
#[derive(Debug, Clone, Args)]
pub struct IndexArgs {
    /// Most (worker, block) entries the index keeps, at the peak too; past it blocks
    /// never matched are pruned first, then the least recently matched. Unbounded
    /// when unset.
    #[arg(long, env = "KV_ROUTER_INDEX_MAX_BLOCKS")]
    pub index_max_blocks: Option<usize>,
    /// Entries left after a pruning pass, in percent of --index-max-blocks (1-99).
    #[arg(
        long,
        env = "KV_ROUTER_INDEX_PRUNE_TARGET_PERCENT",
        default_value_t = 90
    )]
    pub index_prune_target_percent: u8,
    /// kv-events: engines publish KV events. approximate: engines publish none; the
    /// router indexes each routing decision for --approximate-ttl-secs.
    #[arg(long, env = "KV_ROUTER_INDEX_MODE", default_value = "kv-events")]
    pub index_mode: IndexModeArg,
    /// approximate mode: how long a routed prompt is assumed cached, in seconds.
    #[arg(long, env = "KV_ROUTER_APPROXIMATE_TTL_SECS", default_value_t = 120)]
    pub approximate_ttl_secs: u64,
    /// How long a KV event batch from an unregistered worker, or of a newer epoch than
    /// its registration, waits for that registration before it is dropped, in ms.
    #[arg(long, env = "KV_ROUTER_EVENT_HOLD_MS", default_value_t = 5000)]
    pub event_hold_ms: u64,
    /// Most such batches held at once (over all workers); the oldest goes first.
    #[arg(long, env = "KV_ROUTER_EVENT_HOLD_BATCHES", default_value_t = 1024)]
    pub event_hold_batches: usize,
    /// Events buffered per worker rank while a gap in its events is recovered; past
    /// it a full dump is requested instead.
    #[arg(long, env = "KV_ROUTER_RECOVERY_BUFFER_EVENTS", default_value_t = 8192)]
    pub recovery_buffer_events: usize,
    /// Gap recovery: timeouts, attempts, backoff, budget, reply limits.
    #[command(flatten)]
    pub recovery: super::recovery::RecoveryArgs,
    /// Consume KV events from a JetStream stream (created if missing) and snapshot
    /// the index to a JetStream object store; a restart loads the snapshot and replays
    /// the stream from there. Off by default.
    #[arg(long, env = "KV_ROUTER_JETSTREAM")]
    pub jetstream: bool,
    /// JetStream stream capturing `{ns}.kv.events.>` (default `{ns}-kv-events`).
    #[arg(long, env = "KV_ROUTER_JETSTREAM_STREAM")]
    pub jetstream_stream: Option<String>,
    /// Durable consumer name: must differ between router replicas.
    #[arg(
        long,
        env = "KV_ROUTER_JETSTREAM_CONSUMER",
        default_value = "kv-router"
    )]
    pub jetstream_consumer: String,
    /// Object store bucket holding index snapshots (default `{ns}-kv-index`).
    #[arg(long, env = "KV_ROUTER_JETSTREAM_BUCKET")]
    pub jetstream_bucket: Option<String>,
    /// Snapshot the index after this many event batches from the stream.
    #[arg(
        long,
        env = "KV_ROUTER_JETSTREAM_SNAPSHOT_EVERY",
        default_value_t = 100_000
    )]
    pub jetstream_snapshot_every: u64,
    /// Stream retention: events older than this are discarded, in seconds (a snapshot
    /// must be taken more often than this for restarts to replay from it).
    #[arg(
        long,
        env = "KV_ROUTER_JETSTREAM_MAX_AGE_SECS",
        default_value_t = 86_400
    )]
    pub jetstream_max_age_secs: u64,
}

/// True for a JetStream stream / bucket / consumer name: 1-255 of `[A-Za-z0-9_-]`.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Refuses the retired `KV_ROUTER_INDEX_BACKEND` when `env` (the process
/// environment, or a test's map) still sets it.
///
/// # Errors
/// [`ConfigError::Invalid`] naming `index-backend`.
fn refuse_retired(env: impl Fn(&str) -> Option<OsString>) -> Result<(), ConfigError> {
    match env(RETIRED_BACKEND_ENV) {
        None => Ok(()),
        Some(_) => Err(ConfigError::Invalid {
            field: "index-backend",
            reason: format!(
                "was retired with the sharded index backend (the inline index is the only \
                 one); unset {RETIRED_BACKEND_ENV}"
            ),
        }),
    }
}

impl IndexArgs {
    /// Applies the index flags to `indexer` and builds the durability config.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first bad flag, or `index-backend` when
    /// the environment still sets the retired `KV_ROUTER_INDEX_BACKEND`.
    pub fn apply(
        &self,
        subjects: &Subjects,
        indexer: &mut IndexerConfig,
    ) -> Result<DurabilityConfig, ConfigError> {
        refuse_retired(|name| std::env::var_os(name))?;
        let invalid = |field: &'static str, reason: &str| ConfigError::Invalid {
            field,
            reason: reason.to_owned(),
        };
        if let Some(max_entries) = self.index_max_blocks {
            if max_entries < indexer.num_shards {
                return Err(invalid(
                    "index-max-blocks",
                    "must be at least one per shard",
                ));
            }
            if !(1..=99).contains(&self.index_prune_target_percent) {
                return Err(invalid("index-prune-target-percent", "must be 1 to 99"));
            }
            indexer.pruning = Pruning::LeastRecentlyMatched {
                max_entries,
                target_percent: self.index_prune_target_percent,
            };
        }
        indexer.mode = match self.index_mode {
            IndexModeArg::KvEvents => IndexMode::KvEvents,
            IndexModeArg::Approximate => {
                if self.approximate_ttl_secs == 0 {
                    return Err(invalid("approximate-ttl-secs", "must be at least 1"));
                }
                IndexMode::Approximate {
                    ttl: Duration::from_secs(self.approximate_ttl_secs),
                }
            }
        };
        if self.recovery_buffer_events == 0 {
            return Err(invalid("recovery-buffer-events", "must be at least 1"));
        }
        indexer.recovery_buffer_events = self.recovery_buffer_events;
        let recovery = self.recovery.to_config()?;
        let jetstream = if self.jetstream {
            if matches!(self.index_mode, IndexModeArg::Approximate) {
                return Err(invalid(
                    "jetstream",
                    "has no events to store in approximate mode",
                ));
            }
            let ns = subjects.namespace();
            let config = JetStreamConfig {
                stream: self
                    .jetstream_stream
                    .clone()
                    .unwrap_or_else(|| format!("{ns}-kv-events")),
                consumer: self.jetstream_consumer.clone(),
                bucket: self
                    .jetstream_bucket
                    .clone()
                    .unwrap_or_else(|| format!("{ns}-kv-index")),
                snapshot_every: self.jetstream_snapshot_every,
                max_age: Duration::from_secs(self.jetstream_max_age_secs),
            };
            for (field, name) in [
                ("jetstream-stream", &config.stream),
                ("jetstream-consumer", &config.consumer),
                ("jetstream-bucket", &config.bucket),
            ] {
                if !valid_name(name) {
                    return Err(invalid(field, "must be 1-255 of [A-Za-z0-9_-]"));
                }
            }
            if config.snapshot_every == 0 {
                return Err(invalid("jetstream-snapshot-every", "must be at least 1"));
            }
            if config.max_age.is_zero() {
                return Err(invalid("jetstream-max-age-secs", "must be at least 1"));
            }
            Some(config)
        } else {
            None
        };
        if self.event_hold_batches == 0 {
            return Err(invalid("event-hold-batches", "must be at least 1"));
        }
        Ok(DurabilityConfig {
            recovery,
            jetstream,
            hold: crate::publishers::HoldConfig {
                grace: Duration::from_millis(self.event_hold_ms),
                capacity: self.event_hold_batches,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::Namespace;

    fn apply(args: &[&str]) -> Result<(IndexerConfig, DurabilityConfig), ConfigError> {
        let cli = kv_cluster::args::parse_flags::<IndexArgs, _, _>(
            std::iter::once("x").chain(args.iter().copied()),
        )
        .expect("flags parse");
        let subjects = Subjects::new(Namespace::new("ns").expect("valid"));
        let mut indexer = IndexerConfig {
            num_shards: 2,
            ..IndexerConfig::default()
        };
        let durability = cli.apply(&subjects, &mut indexer)?;
        Ok((indexer, durability))
    }

    #[test]
    fn defaults_are_unbounded_kv_events_without_jetstream() {
        let (indexer, durability) = apply(&[]).unwrap();
        assert_eq!(indexer.pruning, Pruning::Unbounded);
        assert_eq!(indexer.mode, IndexMode::KvEvents);
        assert_eq!(
            durability.recovery,
            crate::durability::RecoveryConfig::default()
        );
        assert_eq!(durability.jetstream, None);
    }

    #[test]
    fn flags_map_to_typed_settings() {
        let (indexer, _) = apply(&[
            "--index-max-blocks",
            "1000",
            "--index-mode",
            "approximate",
            "--approximate-ttl-secs",
            "30",
        ])
        .unwrap();
        assert_eq!(
            indexer.pruning,
            Pruning::LeastRecentlyMatched {
                max_entries: 1000,
                target_percent: 90
            }
        );
        assert_eq!(
            indexer.mode,
            IndexMode::Approximate {
                ttl: Duration::from_secs(30)
            }
        );
        let (_, durability) = apply(&["--jetstream", "--jetstream-snapshot-every", "5"]).unwrap();
        let js = durability.jetstream.expect("enabled");
        assert_eq!(
            (js.stream.as_str(), js.bucket.as_str(), js.snapshot_every),
            ("ns-kv-events", "ns-kv-index", 5)
        );
    }

    #[test]
    fn bad_values_name_their_flag() {
        for (args, flag) in [
            (&["--index-max-blocks", "1"][..], "index-max-blocks"),
            (
                &["--jetstream", "--jetstream-stream", "a.b"][..],
                "jetstream-stream",
            ),
            (
                &["--jetstream", "--index-mode", "approximate"][..],
                "jetstream",
            ),
        ] {
            let err = apply(args).unwrap_err();
            assert!(err.to_string().contains(flag), "{err}");
        }
    }

    #[test]
    fn the_retired_backend_flag_is_refused() {
        let parsed =
            kv_cluster::args::parse_flags::<IndexArgs, _, _>(["x", "--index-backend", "inline"]);
        assert!(parsed.is_err(), "the flag is unknown");
        let set = |name: &str| (name == RETIRED_BACKEND_ENV).then(|| OsString::from("inline"));
        let err = refuse_retired(set).unwrap_err().to_string();
        assert!(
            err.contains("index-backend") && err.contains(RETIRED_BACKEND_ENV),
            "{err}"
        );
        assert!(refuse_retired(|_| None).is_ok());
    }
}
