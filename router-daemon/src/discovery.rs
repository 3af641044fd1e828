//! Worker discovery through etcd.
//!
//! Workers register a key `kv-router/{ns}/workers/{worker_id}` bound to a lease (see
//! `kv_events::discovery`). The daemon first loads every key under the prefix, then
//! watches the prefix from the revision after that snapshot, so no change between the
//! two is missed. A put adds (or updates) the worker in the scheduler; a delete —
//! including the one etcd generates when a lease expires — removes the worker from
//! the scheduler (dropping its in-flight requests) and from every indexer shard.
//!
//! If etcd is unreachable at start-up, [`connect_and_load`] retries with exponential
//! backoff ([`Backoff`]: 100 ms doubling to 5 s) while the daemon reports not ready.
//! If the watch fails later (etcd restarted, network loss), the daemon keeps routing to
//! the workers it knows, reports the loss (`kv_router_etcd_connected 0`, the `etcd`
//! readiness check), retries with the same backoff on a fresh client, and on reconnect
//! re-reads the whole prefix and reconciles: workers that vanished meanwhile are
//! removed. Every etcd call is bounded by the connect timeout, so a dead endpoint is
//! noticed instead of waited on forever.

use crate::config::EtcdConfig;
use crate::directory::DirectoryEntry;
use crate::metrics::counters::{MessageKind, Outcome};
use crate::state::RouterState;
use anyhow::Context;
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, WatchOptions};
use indexer::IndexerApi as _;
use kv_events::WorkerId;
use kv_events::discovery::WorkerRegistration;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// Workers the daemon currently knows, by id.
pub type KnownWorkers = BTreeMap<WorkerId, WorkerRegistration>;

/// Exponential backoff between etcd attempts: 100 ms, doubling, at most 5 s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    next: Duration,
}

impl Backoff {
    /// First delay.
    pub const INITIAL: Duration = Duration::from_millis(100);
    /// Largest delay.
    pub const MAX: Duration = Duration::from_secs(5);

    /// Starts at [`Backoff::INITIAL`].
    pub fn new() -> Self {
        Self {
            next: Self::INITIAL,
        }
    }

    /// The delay to wait now; the one after is doubled, up to [`Backoff::MAX`].
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        delay
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

/// Waits `delay` unless `shutdown` fires first; returns whether it was cancelled.
async fn wait_or_cancelled(delay: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(delay) => false,
    }
}

/// Connects to etcd and loads every registration, retrying with [`Backoff`] until it
/// succeeds. Each failure is logged, counted (`kv_router_etcd_errors_total`) and
/// reported in the readiness `etcd` check. Returns the client and the snapshot's
/// revision, or `None` when `shutdown` is cancelled first.
pub async fn connect_and_load(
    config: &EtcdConfig,
    state: &RouterState,
    known: &mut KnownWorkers,
    shutdown: &CancellationToken,
) -> Option<(Client, i64)> {
    let mut backoff = Backoff::new();
    for attempt in 1u64.. {
        let stage = match connect(config).await {
            Ok(mut client) => match resync(&mut client, state, known, config.connect_timeout).await
            {
                Ok(revision) => {
                    state.health.etcd_ok("connected; watching registrations");
                    return Some((client, revision));
                }
                Err(e) => ("load", e),
            },
            Err(e) => ("connect", e),
        };
        let (stage, error) = stage;
        let delay = backoff.next_delay();
        state.health.etcd_failed(stage, &format!("{error:#}"));
        warn!(attempt, stage, error = %format!("{error:#}"), retry_in = ?delay, "etcd unavailable; not ready, retrying");
        if wait_or_cancelled(delay, shutdown).await {
            return None;
        }
    }
    None
}

/// Connects to etcd (lazily: the first call finds out whether an endpoint answers).
///
/// # Errors
/// When the endpoints or options are invalid.
pub async fn connect(config: &EtcdConfig) -> anyhow::Result<Client> {
    let options = ConnectOptions::new()
        .with_connect_timeout(config.connect_timeout)
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
    Client::connect(&config.endpoints, Some(options))
        .await
        .with_context(|| format!("connecting to etcd at {:?}", config.endpoints))
}

/// Parses one registration key/value. Returns `None` (after counting and logging) for
/// keys or values that cannot be used.
fn parse_registration(state: &RouterState, key: &str, value: &[u8]) -> Option<WorkerRegistration> {
    let reject = |reason: String| {
        state
            .counters
            .message(MessageKind::Registration, Outcome::Rejected);
        error!(key, reason, "worker registration rejected");
    };
    let Some(id) = state.subjects.worker_id_from_etcd_key(key) else {
        reject("key does not end in a numeric worker id".into());
        return None;
    };
    let reg: WorkerRegistration = match serde_json::from_slice(value) {
        Ok(r) => r,
        Err(e) => {
            state
                .counters
                .message(MessageKind::Registration, Outcome::Malformed);
            error!(key, error = %e, "malformed worker registration skipped");
            return None;
        }
    };
    if reg.worker_id != id {
        reject(format!(
            "value names worker {} but the key names worker {id}",
            reg.worker_id
        ));
        return None;
    }
    if let Err(e) = reg.validate() {
        reject(e.to_string());
        return None;
    }
    if reg.block_size != state.block_size {
        reject(format!(
            "block_size {} differs from the router's {} tokens",
            reg.block_size, state.block_size
        ));
        return None;
    }
    Some(reg)
}

/// Where a registration came from in etcd.
#[derive(Debug, Clone, Copy)]
struct KeyMeta {
    lease_id: i64,
    mod_revision: i64,
}

impl KeyMeta {
    fn of(kv: &etcd_client::KeyValue) -> Self {
        Self {
            lease_id: kv.lease(),
            mod_revision: kv.mod_revision(),
        }
    }
}

fn add(state: &RouterState, known: &mut KnownWorkers, reg: WorkerRegistration, meta: KeyMeta) {
    let entry = DirectoryEntry {
        registration: reg.clone(),
        lease_id: meta.lease_id,
        mod_revision: meta.mod_revision,
    };
    if known.get(&reg.worker_id) == Some(&reg) {
        state.directory.upsert(entry);
        return;
    }
    if let Err(e) = state.scheduler().add_worker(reg.clone()) {
        state
            .counters
            .message(MessageKind::Registration, Outcome::Rejected);
        error!(worker_id = %reg.worker_id, error = %e, "worker registration rejected");
        return;
    }
    let (worker_id, dp_size, total_kv_blocks) = (reg.worker_id, reg.dp_size, reg.total_kv_blocks);
    known.insert(worker_id, reg);
    state.directory.upsert(entry);
    state
        .counters
        .message(MessageKind::Registration, Outcome::Ok);
    state.counters.set_workers(known.len());
    info!(worker_id = %worker_id, dp_size, total_kv_blocks, "worker registered");
    // New ranks may take requests waiting for room.
    state.admission.release_waiters();
}

async fn remove(state: &RouterState, known: &mut KnownWorkers, id: WorkerId) {
    let Some(reg) = known.remove(&id) else {
        return;
    };
    state.directory.remove(id);
    state.counters.metrics.route.forget_worker(id, reg.dp_size);
    state.scheduler().remove_worker(id);
    // Waiters pinned to a rank that left, or with no worker left, get their answer.
    state.admission.release_waiters();
    if let Err(e) = state.indexer.remove_worker(id).await {
        warn!(worker_id = %id, error = %e, "indexer could not drop the worker's blocks");
    }
    state.counters.set_workers(known.len());
    info!(worker_id = %id, "worker removed (key deleted or lease expired)");
}

/// Reads every registration and reconciles `known` with it. Returns the etcd revision
/// of the snapshot, from which a watch must continue.
///
/// # Errors
/// When etcd cannot be read within `timeout`.
pub async fn resync(
    client: &mut Client,
    state: &RouterState,
    known: &mut KnownWorkers,
    timeout: Duration,
) -> anyhow::Result<i64> {
    let prefix = state.subjects.etcd_worker_prefix();
    let resp = tokio::time::timeout(
        timeout,
        client.get(prefix.as_str(), Some(GetOptions::new().with_prefix())),
    )
    .await
    .map_err(|_| anyhow::anyhow!("no answer within {timeout:?}"))
    .and_then(|r| r.map_err(anyhow::Error::from))
    .context("listing worker registrations")?;
    let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
    let mut snapshot = BTreeMap::new();
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key());
        if let Some(reg) = parse_registration(state, &key, kv.value()) {
            snapshot.insert(reg.worker_id, (reg, KeyMeta::of(kv)));
        }
    }
    let gone: Vec<WorkerId> = known
        .keys()
        .filter(|id| !snapshot.contains_key(id))
        .copied()
        .collect();
    for id in gone {
        remove(state, known, id).await;
    }
    for (reg, meta) in snapshot.into_values() {
        add(state, known, reg, meta);
    }
    Ok(revision)
}

/// Watches the registration prefix from `revision + 1` until `shutdown`. When the
/// watch fails it keeps the known workers, reports etcd lost, and reconnects with
/// [`Backoff`] on a fresh client, resyncing before watching again.
pub async fn watch(
    config: EtcdConfig,
    mut client: Client,
    state: Arc<RouterState>,
    mut known: KnownWorkers,
    mut revision: i64,
    shutdown: CancellationToken,
) {
    loop {
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = watch_from(&mut client, &state, &mut known, revision, config.connect_timeout) => r,
        };
        let error = match result {
            Ok(()) => anyhow::anyhow!("etcd closed the watch stream"),
            Err(e) => e,
        };
        state.health.etcd_failed("watch", &format!("{error:#}"));
        warn!(error = %format!("{error:#}"), workers = known.len(), "etcd watch lost; serving the last known workers while reconnecting");
        let mut backoff = Backoff::new();
        loop {
            if wait_or_cancelled(backoff.next_delay(), &shutdown).await {
                return;
            }
            let attempt = match connect(&config).await {
                Ok(mut fresh) => {
                    match resync(&mut fresh, &state, &mut known, config.connect_timeout).await {
                        Ok(rev) => Ok((fresh, rev)),
                        Err(e) => Err(("load", e)),
                    }
                }
                Err(e) => Err(("connect", e)),
            };
            match attempt {
                Ok((fresh, rev)) => {
                    client = fresh;
                    revision = rev;
                    state.health.etcd_ok("reconnected; watching registrations");
                    info!(
                        workers = known.len(),
                        "etcd watch re-established after resync"
                    );
                    break;
                }
                Err((stage, e)) => {
                    state.health.etcd_failed(stage, &format!("{e:#}"));
                    warn!(stage, error = %format!("{e:#}"), "etcd still unavailable");
                }
            }
        }
    }
}

/// Follows the watch until it fails or etcd ends it (`Ok`). Starting the watch is
/// bounded by `timeout`.
async fn watch_from(
    client: &mut Client,
    state: &RouterState,
    known: &mut KnownWorkers,
    revision: i64,
    timeout: Duration,
) -> anyhow::Result<()> {
    let prefix = state.subjects.etcd_worker_prefix();
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1);
    let mut stream = tokio::time::timeout(timeout, client.watch(prefix.as_str(), Some(options)))
        .await
        .map_err(|_| anyhow::anyhow!("no answer within {timeout:?}"))
        .and_then(|r| r.map_err(anyhow::Error::from))
        .context("starting watch")?;
    state.health.etcd_ok("watching registrations");
    while let Some(resp) = stream.message().await.context("reading watch")? {
        if resp.canceled() {
            anyhow::bail!("watch canceled by etcd: {}", resp.cancel_reason());
        }
        for event in resp.events() {
            let Some(kv) = event.kv() else { continue };
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            match event.event_type() {
                EventType::Put => {
                    if let Some(reg) = parse_registration(state, &key, kv.value()) {
                        add(state, known, reg, KeyMeta::of(kv));
                    }
                }
                EventType::Delete => {
                    if let Some(id) = state.subjects.worker_id_from_etcd_key(&key) {
                        remove(state, known, id).await;
                    }
                }
            }
        }
    }
    Ok(())
}
