//! Worker discovery through etcd.
//!
//! Workers register a key `kv-router/{ns}/workers/{worker_id}` bound to a lease (see
//! `kv_events::discovery`). The daemon first loads every key under the prefix, then
//! watches the prefix from the revision after that snapshot, so no change between the
//! two is missed. A put adds (or updates) the worker in the scheduler; a delete —
//! including the one etcd generates when a lease expires — removes the worker from
//! the scheduler (dropping its in-flight requests) and from every indexer shard.
//!
//! If the watch fails (etcd restarted, network loss), the daemon keeps routing to the
//! workers it knows, retries with exponential backoff, and on reconnect re-reads the
//! whole prefix and reconciles: workers that vanished meanwhile are removed.

use crate::config::EtcdConfig;
use crate::counters::{MessageKind, Outcome};
use crate::state::RouterState;
use anyhow::Context;
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, WatchOptions};
use kv_events::WorkerId;
use kv_events::discovery::WorkerRegistration;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// Workers the daemon currently knows, by id.
pub type KnownWorkers = BTreeMap<WorkerId, WorkerRegistration>;

/// Connects to etcd.
///
/// # Errors
/// When no endpoint answers within the connect timeout.
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

fn add(state: &RouterState, known: &mut KnownWorkers, reg: WorkerRegistration) {
    if known.get(&reg.worker_id) == Some(&reg) {
        return;
    }
    if let Err(e) = state.scheduler().add_worker(reg) {
        state
            .counters
            .message(MessageKind::Registration, Outcome::Rejected);
        error!(worker_id = %reg.worker_id, error = %e, "worker registration rejected");
        return;
    }
    known.insert(reg.worker_id, reg);
    state
        .counters
        .message(MessageKind::Registration, Outcome::Ok);
    state.counters.set_workers(known.len());
    info!(worker_id = %reg.worker_id, dp_size = reg.dp_size, total_kv_blocks = reg.total_kv_blocks, "worker registered");
}

async fn remove(state: &RouterState, known: &mut KnownWorkers, id: WorkerId) {
    if known.remove(&id).is_none() {
        return;
    }
    state.scheduler().remove_worker(id);
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
/// When etcd cannot be read.
pub async fn resync(
    client: &mut Client,
    state: &RouterState,
    known: &mut KnownWorkers,
) -> anyhow::Result<i64> {
    let prefix = state.subjects.etcd_worker_prefix();
    let resp = client
        .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
        .await
        .context("listing worker registrations")?;
    let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
    let mut snapshot = KnownWorkers::new();
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key());
        if let Some(reg) = parse_registration(state, &key, kv.value()) {
            snapshot.insert(reg.worker_id, reg);
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
    for reg in snapshot.into_values() {
        add(state, known, reg);
    }
    Ok(revision)
}

/// Watches the registration prefix from `revision + 1` until `shutdown`, recovering
/// from etcd failures with backoff and a full resync.
pub async fn watch(
    mut client: Client,
    state: Arc<RouterState>,
    mut known: KnownWorkers,
    mut revision: i64,
    shutdown: CancellationToken,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = watch_from(&mut client, &state, &mut known, revision) => r,
        };
        if let Err(e) = result {
            warn!(error = %e, "etcd watch lost; serving the last known workers while reconnecting");
        }
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(10));
            match resync(&mut client, &state, &mut known).await {
                Ok(rev) => {
                    info!(
                        workers = known.len(),
                        "etcd watch re-established after resync"
                    );
                    revision = rev;
                    backoff = Duration::from_millis(100);
                    break;
                }
                Err(e) => warn!(error = %e, "etcd resync failed"),
            }
        }
    }
}

async fn watch_from(
    client: &mut Client,
    state: &RouterState,
    known: &mut KnownWorkers,
    revision: i64,
) -> anyhow::Result<()> {
    let prefix = state.subjects.etcd_worker_prefix();
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1);
    let mut stream = client
        .watch(prefix.as_str(), Some(options))
        .await
        .context("starting watch")?;
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
                        add(state, known, reg);
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
    anyhow::bail!("etcd closed the watch stream")
}
