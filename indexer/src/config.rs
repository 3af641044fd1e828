//! [`IndexerConfig`]: how many shards the indexer runs, how much it may buffer while
//! recovering a gap, and whether its memory is bounded.
//!
//! More shards let more writers apply events at once (a worker's events always go to
//! the same shard) but make every query visit more trees. The measurements are in
//! `docs/benchmarks.md`.

use crate::error::IndexerError;

/// The memory bound of each tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pruning {
    /// No bound: every block engines report stays indexed until they remove it.
    #[default]
    Unbounded,
    /// Keep at most `max_entries` (rank, block) entries: past it (or before a store
    /// that would pass it), forget leaves until `target_percent` of `max_entries`
    /// remain, blocks never matched first, then the least recently matched (see
    /// `tree/prune.rs`).
    LeastRecentlyMatched {
        /// Most (rank, block) entries kept, over the whole indexer (each of N shards
        /// gets `max_entries / N`). At least 1.
        max_entries: usize,
        /// Entries left after a pruning pass, in percent of `max_entries`; lower
        /// values prune less often but longer. 1 to 99; 90 is a good default.
        target_percent: u8,
    },
}

/// Where the index's knowledge of cached blocks comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IndexMode {
    /// Engines publish KV events; the index follows them exactly.
    #[default]
    KvEvents,
    /// Engines publish nothing: the owner reports each routing decision
    /// ([`crate::Indexer::record_routing`]) and the prompt's blocks are assumed cached
    /// on the chosen rank for `ttl` (see `approx.rs`).
    Approximate {
        /// How long a routed prompt is assumed to stay cached.
        ttl: std::time::Duration,
    },
}

/// Shard count, recovery buffer and memory bound of an indexer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexerConfig {
    /// Number of shards, each one radix tree behind a lock. At least 1.
    /// Default: the number of available cores (`std::thread::available_parallelism`),
    /// or 1 when that is unknown.
    pub num_shards: usize,
    /// Events buffered per worker rank while a gap in its `event_id`s is being
    /// recovered. Past it the buffer is dropped and a full dump is requested instead.
    /// At least 1; default 8192.
    pub recovery_buffer_events: usize,
    /// The memory bound. Default [`Pruning::Unbounded`].
    pub pruning: Pruning,
    /// KV events or approximate. Default [`IndexMode::KvEvents`].
    pub mode: IndexMode,
}

impl Default for IndexerConfig {
    fn default() -> Self {
        Self {
            num_shards: std::thread::available_parallelism().map_or(1, |n| n.get()),
            recovery_buffer_events: 8192,
            pruning: Pruning::Unbounded,
            mode: IndexMode::KvEvents,
        }
    }
}

impl IndexerConfig {
    /// Checks every field.
    ///
    /// # Errors
    /// [`IndexerError::InvalidConfig`] naming the first field that is 0.
    pub fn validate(&self) -> Result<(), IndexerError> {
        let at_least_one = |field, value: usize| {
            if value == 0 {
                Err(IndexerError::InvalidConfig {
                    field,
                    reason: "must be at least 1",
                })
            } else {
                Ok(())
            }
        };
        at_least_one("num_shards", self.num_shards)?;
        at_least_one("recovery_buffer_events", self.recovery_buffer_events)?;
        if let Pruning::LeastRecentlyMatched {
            max_entries,
            target_percent,
        } = self.pruning
        {
            if max_entries < self.num_shards {
                return Err(IndexerError::InvalidConfig {
                    field: "pruning.max_entries",
                    reason: "must be at least one entry per shard",
                });
            }
            if !(1..=99).contains(&target_percent) {
                return Err(IndexerError::InvalidConfig {
                    field: "pruning.target_percent",
                    reason: "must be between 1 and 99",
                });
            }
        }
        Ok(())
    }

    /// The settings of each shard's [`crate::OrderedIndex`].
    pub fn shard_settings(&self) -> ShardSettings {
        ShardSettings {
            pruning: self.shard_pruning(),
            recovery_buffer_events: self.recovery_buffer_events,
        }
    }

    /// The memory bound of one of the `num_shards` trees: `max_entries` split evenly.
    pub fn shard_pruning(&self) -> Pruning {
        match self.pruning {
            Pruning::Unbounded => Pruning::Unbounded,
            Pruning::LeastRecentlyMatched {
                max_entries,
                target_percent,
            } => Pruning::LeastRecentlyMatched {
                max_entries: (max_entries / self.num_shards.max(1)).max(1),
                target_percent,
            },
        }
    }
}

/// Per-shard settings of an [`crate::OrderedIndex`], derived from
/// [`IndexerConfig::shard_settings`]. Defined here rather than next to the ordered
/// index so that this module stays below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSettings {
    /// The tree's memory bound.
    pub pruning: Pruning,
    /// Events buffered per rank during a recovery before falling back to a dump.
    pub recovery_buffer_events: usize,
}

impl Default for ShardSettings {
    fn default() -> Self {
        Self {
            pruning: Pruning::Unbounded,
            recovery_buffer_events: 8192,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_zero_fields_are_named() {
        let config = IndexerConfig::default();
        assert!(config.num_shards >= 1);
        assert_eq!(config.validate(), Ok(()));
        let bad = IndexerConfig {
            recovery_buffer_events: 0,
            ..config.clone()
        };
        assert_eq!(
            bad.validate(),
            Err(IndexerError::InvalidConfig {
                field: "recovery_buffer_events",
                reason: "must be at least 1"
            })
        );
        let bad = IndexerConfig {
            num_shards: 0,
            ..config.clone()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("num_shards")
        );
        let bounded = |max_entries, target_percent| IndexerConfig {
            num_shards: 4,
            pruning: Pruning::LeastRecentlyMatched {
                max_entries,
                target_percent,
            },
            ..config.clone()
        };
        assert!(
            bounded(3, 90).validate().is_err(),
            "fewer entries than shards"
        );
        assert!(bounded(100, 100).validate().is_err());
        assert!(bounded(100, 0).validate().is_err());
        assert_eq!(bounded(100, 90).validate(), Ok(()));
        assert_eq!(
            bounded(100, 90).shard_pruning(),
            Pruning::LeastRecentlyMatched {
                max_entries: 25,
                target_percent: 90
            }
        );
    }
}
