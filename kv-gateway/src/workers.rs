//! Worker id → engine HTTP base URL, kept from the etcd worker directory
//! (`kv_cluster::directory`): the router answers with a worker id, and this is where
//! the gateway finds the engine behind it, and, in a disaggregated fleet, the worker's
//! role and how its KV is transferred ([`WorkerUrls::endpoint`]). It also keeps each worker's KV block size,
//! so the gateway can hash a prompt's blocks itself ([`WorkerUrls::block_size`]) when
//! the whole fleet agrees on one, as the router does, and each worker's context length
//! (`max_model_len`), whose smallest ([`WorkerUrls::max_model_len`]) bounds prompts
//! when `--max-prompt-tokens` is not given ([`crate::limit`]).
//!
//! Reads take a shared lock for one map lookup; the directory task is the only writer.
//! The smallest context length is recomputed on each put and delete (O(workers)) and
//! kept in an atomic, so a request reads it without the lock.
//! A registration without a URL (an engine registered by an older relay) is kept as
//! known-but-unreachable: routing to it fails over to another worker.

use kv_cluster::directory::{EtcdStatus, Registered, Registrations, Rejection};
use kv_events::WorkerId;
use kv_events::disaggregation::{KvTransfer, WorkerRole};
use kv_events::discovery::WorkerRegistration;
use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use tracing::{info, warn};

/// What the gateway keeps of one registered worker.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Worker {
    /// Engine base URL, without a trailing slash.
    url: Option<String>,
    /// Tokens per KV block.
    block_size: u32,
    /// The engine's context length, in tokens, if it published one.
    max_model_len: Option<u64>,
    /// Its role in a disaggregated fleet.
    role: WorkerRole,
    /// How a frontend joins its half of a disaggregated request to the other's.
    kv_transfer: Option<KvTransfer>,
}

/// How the gateway reaches one worker: its engine URL and, for a `prefill` or
/// `decode` worker, its role and KV transfer as registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEndpoint {
    /// Engine base URL, without a trailing slash.
    pub url: String,
    /// The worker's role (`both` unless it registered another).
    pub role: WorkerRole,
    /// The protocol (and, for an SGLang prefill worker, the bootstrap port) by which
    /// its half of a disaggregated request is joined to the other's.
    pub kv_transfer: Option<KvTransfer>,
}

/// The engine URLs of the registered workers. Cheap to clone; clones share the map.
#[derive(Debug, Clone, Default)]
pub struct WorkerUrls {
    inner: Arc<RwLock<HashMap<WorkerId, Worker>>>,
    /// The smallest `max_model_len` of the workers, in tokens; 0 while none publishes
    /// one (a registration's is never 0: `WorkerRegistration::validate`).
    min_max_model_len: Arc<AtomicU64>,
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

    /// The engine URL, role and KV transfer of `worker_id`; `None` when it is not
    /// registered or registered no URL.
    pub fn endpoint(&self, worker_id: WorkerId) -> Option<WorkerEndpoint> {
        let workers = self.read();
        let worker = workers.get(&worker_id)?;
        Some(WorkerEndpoint {
            url: worker.url.clone()?,
            role: worker.role,
            kv_transfer: worker.kv_transfer,
        })
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

    /// The registered block size of `worker_id`, in tokens; `None` when it is not
    /// registered.
    pub fn block_size_of(&self, worker_id: WorkerId) -> Option<u32> {
        self.read().get(&worker_id).map(|w| w.block_size)
    }

    /// The smallest context length (`max_model_len`, in tokens) among the registered
    /// workers that publish one; `None` when none does. One atomic load.
    pub fn max_model_len(&self) -> Option<NonZeroU64> {
        NonZeroU64::new(self.min_max_model_len.load(Ordering::Acquire))
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
        self.worker_urls().into_iter().map(|(_, url)| url).collect()
    }

    /// The workers that registered an engine URL, with it, in worker-id order (the
    /// endpoint picker maps pod addresses to worker ids with it). O(workers).
    pub fn worker_urls(&self) -> Vec<(WorkerId, String)> {
        let workers = self.read();
        let mut urls: Vec<_> = workers
            .iter()
            .filter_map(|(id, w)| Some((*id, w.url.clone()?)))
            .collect();
        urls.sort_unstable_by_key(|(id, _)| *id);
        urls
    }

    /// Adds or replaces the worker of `registration` (tests and tools; the directory
    /// calls it on puts).
    pub fn insert(&self, registration: &WorkerRegistration) {
        let worker = Worker {
            url: (registration.url.as_deref()).map(|u| u.trim_end_matches('/').to_owned()),
            block_size: registration.block_size,
            max_model_len: registration.max_model_len,
            role: registration.role,
            kv_transfer: registration.kv_transfer,
        };
        let mut workers = self.write();
        workers.insert(registration.worker_id, worker);
        self.store_min_max_model_len(&workers);
    }

    /// Forgets a worker.
    pub fn remove(&self, worker_id: WorkerId) {
        let mut workers = self.write();
        workers.remove(&worker_id);
        self.store_min_max_model_len(&workers);
    }

    /// Publishes the smallest context length of `workers` (called under the write
    /// lock, so stores happen in the order of the changes).
    fn store_min_max_model_len(&self, workers: &HashMap<WorkerId, Worker>) {
        let min = workers.values().filter_map(|w| w.max_model_len).min();
        self.min_max_model_len
            .store(min.unwrap_or(0), Ordering::Release);
    }
}

impl Registrations for WorkerUrls {
    async fn put(&mut self, worker: Registered) {
        let registration = worker.registration;
        if registration.url.is_none() {
            warn!(worker_id = %registration.worker_id, "worker registered without an engine url; the gateway cannot forward to it");
        } else {
            info!(worker_id = %registration.worker_id, url = registration.url.as_deref(),
                max_model_len = registration.max_model_len, role = %registration.role, "worker known");
        }
        self.insert(&registration);
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

    fn worker(id: u64, url: Option<&str>, block_size: u32) -> WorkerRegistration {
        WorkerRegistration {
            worker_id: WorkerId(id),
            dp_size: 1,
            block_size,
            total_kv_blocks: 100,
            url: url.map(str::to_owned),
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        }
    }

    #[test]
    fn urls_are_kept_per_worker_without_a_trailing_slash() {
        let urls = WorkerUrls::default();
        assert_eq!(urls.block_size(), None);
        urls.insert(&worker(2, Some("http://b:8000/"), 16));
        urls.insert(&worker(1, None, 16));
        assert_eq!(urls.block_size(), Some(16));
        assert_eq!(urls.block_size_of(WorkerId(1)), Some(16));
        assert_eq!(urls.block_size_of(WorkerId(9)), None);
        assert_eq!(urls.url(WorkerId(2)).as_deref(), Some("http://b:8000"));
        assert_eq!(urls.url(WorkerId(1)), None);
        assert_eq!(urls.any_url().as_deref(), Some("http://b:8000"));
        urls.insert(&worker(0, Some("http://a:8000"), 16));
        assert_eq!(urls.urls(), ["http://a:8000", "http://b:8000"], "by id");
        urls.remove(WorkerId(0));
        assert_eq!(urls.len(), 2);
        urls.remove(WorkerId(2));
        assert_eq!(urls.any_url(), None);
        assert!(!urls.is_empty());
        urls.insert(&worker(3, None, 32));
        assert_eq!(urls.block_size(), None, "the fleet disagrees");
    }

    #[test]
    fn a_workers_role_and_transfer_are_kept_with_its_url() {
        use kv_events::disaggregation::TransferProtocol;
        let urls = WorkerUrls::default();
        let transfer = KvTransfer {
            protocol: TransferProtocol::Sglang,
            bootstrap_port: Some(8998),
        };
        urls.insert(&WorkerRegistration {
            role: WorkerRole::Prefill,
            kv_transfer: Some(transfer),
            ..worker(4, Some("http://p:30000/"), 16)
        });
        urls.insert(&worker(5, Some("http://d:30000"), 16));
        urls.insert(&worker(6, None, 16));
        let prefill = urls.endpoint(WorkerId(4)).unwrap();
        assert_eq!(prefill.url, "http://p:30000");
        assert_eq!(prefill.role, WorkerRole::Prefill);
        assert_eq!(prefill.kv_transfer, Some(transfer));
        let both = urls.endpoint(WorkerId(5)).unwrap();
        assert_eq!((both.role, both.kv_transfer), (WorkerRole::Both, None));
        assert_eq!(urls.endpoint(WorkerId(6)), None, "no url");
        assert_eq!(urls.endpoint(WorkerId(7)), None, "unknown");
    }

    #[test]
    fn the_smallest_published_context_length_follows_puts_and_deletes() {
        let urls = WorkerUrls::default();
        let with_len = |id, len| WorkerRegistration {
            max_model_len: len,
            ..worker(id, Some("http://e:1"), 16)
        };
        urls.insert(&with_len(1, None));
        assert_eq!(urls.max_model_len(), None, "none published");
        urls.insert(&with_len(2, Some(8192)));
        urls.insert(&with_len(3, Some(4096)));
        assert_eq!(urls.max_model_len().map(NonZeroU64::get), Some(4096));
        urls.insert(&with_len(3, Some(16_384)));
        assert_eq!(
            urls.max_model_len().map(NonZeroU64::get),
            Some(8192),
            "a changed registration counts"
        );
        urls.remove(WorkerId(2));
        assert_eq!(urls.max_model_len().map(NonZeroU64::get), Some(16_384));
        urls.remove(WorkerId(3));
        assert_eq!(urls.max_model_len(), None, "back to none");
    }
}
