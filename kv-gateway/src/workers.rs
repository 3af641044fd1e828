//! Worker id → engine HTTP base URL, kept from the etcd worker directory
//! (`kv_cluster::directory`): the router answers with a worker id, and this is where
//! the gateway finds the engine behind it. It also keeps each worker's KV block size,
//! so the gateway can hash a prompt's blocks itself ([`WorkerUrls::block_size`]) when
//! the whole fleet agrees on one, as the router does.
//!
//! Reads take a shared lock for one map lookup; the directory task is the only writer.
//! A registration without a URL (an engine registered by an older relay) is kept as
//! known-but-unreachable: routing to it fails over to another worker.

use kv_cluster::directory::{EtcdStatus, Registered, Registrations, Rejection};
use kv_events::WorkerId;
use std::collections::HashMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use tracing::{info, warn};

/// What the gateway keeps of one registered worker.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Worker {
    /// Engine base URL, without a trailing slash.
    url: Option<String>,
    /// Tokens per KV block.
    block_size: u32,
}

/// The engine URLs of the registered workers. Cheap to clone; clones share the map.
#[derive(Debug, Clone, Default)]
pub struct WorkerUrls {
    inner: Arc<RwLock<HashMap<WorkerId, Worker>>>,
}

impl WorkerUrls {
    fn read(&self) -> RwLockReadGuard<'_, HashMap<WorkerId, Worker>> {
        // Writers only insert or remove one entry, so a poisoned map is still whole.
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, HashMap<WorkerId, Worker>> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The engine base URL of `worker_id` (no trailing slash), if it registered one.
    pub fn url(&self, worker_id: WorkerId) -> Option<String> {
        self.read().get(&worker_id).and_then(|w| w.url.clone())
    }

    /// The KV block size of the fleet, in tokens: `Some` when at least one worker is
    /// registered and all registered workers have the same one (the router adopts
    /// the same), `None` otherwise. O(workers) under a shared lock.
    pub fn block_size(&self) -> Option<u32> {
        let workers = self.read();
        let mut sizes = workers.values().map(|w| w.block_size);
        let first = sizes.next()?;
        sizes.all(|size| size == first).then_some(first)
    }

    /// Registered workers, with or without a URL.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Whether no worker is registered.
    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
    }

    /// Some worker's engine URL (the lowest id with one), for engine-side
    /// tokenization, which any engine of the model can do.
    pub fn any_url(&self) -> Option<String> {
        self.read()
            .iter()
            .filter_map(|(id, w)| Some((id, w.url.as_ref()?)))
            .min_by_key(|(id, _)| **id)
            .map(|(_, url)| url.clone())
    }

    /// The engine URLs of the workers that registered one, in worker-id order, for
    /// engine-side tokenization (which any engine of the model can do). O(workers).
    pub fn urls(&self) -> Vec<String> {
        let workers = self.read();
        let mut urls: Vec<_> = workers
            .iter()
            .filter_map(|(id, w)| Some((*id, w.url.clone()?)))
            .collect();
        urls.sort_unstable_by_key(|(id, _)| *id);
        urls.into_iter().map(|(_, url)| url).collect()
    }

    /// Adds or replaces a worker with blocks of `block_size` tokens (tests and tools;
    /// the directory calls it on puts).
    pub fn insert(&self, worker_id: WorkerId, url: Option<String>, block_size: u32) {
        let url = url.map(|u| u.trim_end_matches('/').to_owned());
        self.write().insert(worker_id, Worker { url, block_size });
    }

    /// Forgets a worker.
    pub fn remove(&self, worker_id: WorkerId) {
        self.write().remove(&worker_id);
    }
}

impl Registrations for WorkerUrls {
    async fn put(&mut self, worker: Registered) {
        let registration = worker.registration;
        if registration.url.is_none() {
            warn!(worker_id = %registration.worker_id, "worker registered without an engine url; the gateway cannot forward to it");
        } else {
            info!(worker_id = %registration.worker_id, url = registration.url.as_deref(), "worker known");
        }
        self.insert(
            registration.worker_id,
            registration.url,
            registration.block_size,
        );
    }

    async fn delete(&mut self, worker_id: WorkerId) {
        self.remove(worker_id);
        info!(worker_id = %worker_id, "worker gone");
    }

    fn rejected(&mut self, key: &str, rejection: &Rejection) {
        warn!(key, ?rejection, "worker registration skipped");
    }

    fn status(&mut self, status: EtcdStatus) {
        match status {
            EtcdStatus::Up(what) => info!(what, "etcd"),
            EtcdStatus::Down { stage, error } => warn!(stage, error, "etcd unavailable"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_kept_per_worker_without_a_trailing_slash() {
        let urls = WorkerUrls::default();
        assert_eq!(urls.block_size(), None);
        urls.insert(WorkerId(2), Some("http://b:8000/".into()), 16);
        urls.insert(WorkerId(1), None, 16);
        assert_eq!(urls.block_size(), Some(16));
        assert_eq!(urls.url(WorkerId(2)).as_deref(), Some("http://b:8000"));
        assert_eq!(urls.url(WorkerId(1)), None);
        assert_eq!(urls.any_url().as_deref(), Some("http://b:8000"));
        urls.insert(WorkerId(0), Some("http://a:8000".into()), 16);
        assert_eq!(urls.urls(), ["http://a:8000", "http://b:8000"], "by id");
        urls.remove(WorkerId(0));
        assert_eq!(urls.len(), 2);
        urls.remove(WorkerId(2));
        assert_eq!(urls.any_url(), None);
        assert!(!urls.is_empty());
        urls.insert(WorkerId(3), None, 32);
        assert_eq!(urls.block_size(), None, "the fleet disagrees");
    }
}
