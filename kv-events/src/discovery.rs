//! The worker registration record kept in etcd.
//!
//! A worker writes one key, `kv-router/{ns}/workers/{worker_id}` (see
//! [`crate::subjects::Subjects::etcd_worker_key`]), bound to an etcd lease that it keeps
//! alive. The value is this record as JSON, so operators can read it with `etcdctl`.
//! When the lease expires or is revoked, the key disappears and every router drops
//! the worker's cached blocks and in-flight load.

use crate::ids::WorkerId;
use serde::{Deserialize, Serialize};

/// What a worker tells the cluster about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRegistration {
    /// The worker's id; must match the id in the key.
    pub worker_id: WorkerId,
    /// Number of data-parallel ranks (ranks are `0..dp_size`); at least 1.
    pub dp_size: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV cache capacity of each rank, in blocks.
    pub total_kv_blocks: u64,
}

/// Why a registration record is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistrationError {
    /// `dp_size` was 0.
    #[error("worker {0} registered dp_size 0")]
    ZeroDpSize(WorkerId),
    /// `block_size` was 0.
    #[error("worker {0} registered block_size 0")]
    ZeroBlockSize(WorkerId),
}

impl WorkerRegistration {
    /// Checks the invariants a router relies on.
    ///
    /// # Errors
    /// [`RegistrationError`] naming the offending field.
    pub fn validate(&self) -> Result<(), RegistrationError> {
        if self.dp_size == 0 {
            return Err(RegistrationError::ZeroDpSize(self.worker_id));
        }
        if self.block_size == 0 {
            return Err(RegistrationError::ZeroBlockSize(self.worker_id));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_field() {
        let ok = WorkerRegistration {
            worker_id: WorkerId(1),
            dp_size: 2,
            block_size: 16,
            total_kv_blocks: 100,
        };
        assert!(ok.validate().is_ok());
        assert_eq!(
            WorkerRegistration { dp_size: 0, ..ok }.validate(),
            Err(RegistrationError::ZeroDpSize(WorkerId(1)))
        );
        assert_eq!(
            WorkerRegistration {
                block_size: 0,
                ..ok
            }
            .validate(),
            Err(RegistrationError::ZeroBlockSize(WorkerId(1)))
        );
    }
}
