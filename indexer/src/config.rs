//! [`IndexerConfig`]: how many shards the indexer runs and how deep their queues are.
//!
//! More shards spread event application over more cores (a worker's events always go
//! to the same shard) but make every query fan out to more tasks; queue capacities
//! bound memory and give backpressure to the KV event intake.

use crate::error::IndexerError;

/// Shard count and queue capacities of a [`crate::ShardedIndexer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexerConfig {
    /// Number of shard tasks, each owning one radix tree. At least 1.
    /// Default: the number of available cores (`std::thread::available_parallelism`),
    /// or 1 when that is unknown.
    pub num_shards: usize,
    /// Capacity of each shard's event queue, in messages (an event batch or a
    /// remove-worker command). Senders wait when it is full. At least 1; default 4096.
    pub event_queue_capacity: usize,
    /// Capacity of each shard's query queue, in pending prefix-match queries. At
    /// least 1; default 1024.
    pub query_queue_capacity: usize,
}

impl Default for IndexerConfig {
    fn default() -> Self {
        Self {
            num_shards: std::thread::available_parallelism().map_or(1, |n| n.get()),
            event_queue_capacity: 4096,
            query_queue_capacity: 1024,
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
        at_least_one("event_queue_capacity", self.event_queue_capacity)?;
        at_least_one("query_queue_capacity", self.query_queue_capacity)
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
            event_queue_capacity: 0,
            ..config.clone()
        };
        assert_eq!(
            bad.validate(),
            Err(IndexerError::InvalidConfig {
                field: "event_queue_capacity",
                reason: "must be at least 1"
            })
        );
        let bad = IndexerConfig {
            num_shards: 0,
            ..config
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("num_shards")
        );
    }
}
