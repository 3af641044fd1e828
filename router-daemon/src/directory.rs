//! [`RegistrationDirectory`]: the registrations discovery has accepted, with the etcd lease
//! and revision each came with, for operators (`GET /debug/workers`).
//!
//! Discovery is the only writer (on every accepted put and every delete); readers take
//! a copy. The map holds one small record per registered worker, and a write or a copy
//! holds its lock for O(workers) at most, never across an `.await`.

use kv_events::WorkerId;
use kv_events::discovery::WorkerRegistration;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

/// One registered worker as etcd last showed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DirectoryEntry {
    /// The registration value.
    pub registration: WorkerRegistration,
    /// The etcd lease the key is bound to (0: none, the key never expires).
    pub lease_id: i64,
    /// The etcd revision that last modified the key.
    pub mod_revision: i64,
}

/// Registered workers by id.
#[derive(Debug, Default)]
pub struct RegistrationDirectory {
    entries: Mutex<BTreeMap<WorkerId, DirectoryEntry>>,
}

impl RegistrationDirectory {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<WorkerId, DirectoryEntry>> {
        // Inserts and removes of whole entries cannot leave the map half-updated.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records (or replaces) a worker's entry.
    pub fn upsert(&self, entry: DirectoryEntry) {
        self.lock().insert(entry.registration.worker_id, entry);
    }
    pub(crate) fn remove(&self, id: WorkerId) -> Option<DirectoryEntry> {
        self.lock().remove(&id)
    }

    /// A copy of every entry, by worker id.
    pub fn snapshot(&self) -> Vec<DirectoryEntry> {
        self.lock().values().cloned().collect()
    }

    /// Number of workers.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64, lease_id: i64) -> DirectoryEntry {
        DirectoryEntry {
            registration: WorkerRegistration {
                worker_id: WorkerId(id),
                dp_size: 2,
                block_size: 16,
                total_kv_blocks: 100,
                url: None,
                epoch: 0,
                max_model_len: None,
                role: Default::default(),
                kv_transfer: None,
            },
            lease_id,
            mod_revision: 3,
        }
    }

    #[test]
    fn upsert_replaces_and_remove_forgets() {
        let d = RegistrationDirectory::new();
        d.upsert(entry(2, 10));
        d.upsert(entry(1, 11));
        d.upsert(entry(2, 12));
        let ids: Vec<(u64, i64)> = d
            .snapshot()
            .iter()
            .map(|e| (e.registration.worker_id.0, e.lease_id))
            .collect();
        assert_eq!(ids, vec![(1, 11), (2, 12)]);
        assert_eq!(d.remove(WorkerId(1)).map(|e| e.lease_id), Some(11));
        assert_eq!(d.len(), 1);
        assert!(d.remove(WorkerId(1)).is_none());
    }
}
