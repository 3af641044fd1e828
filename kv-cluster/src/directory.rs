//! The worker directory: every worker registered in a namespace, first loaded, then
//! followed.
//!
//! Workers register a key `kv-router/{ns}/workers/{worker_id}` bound to a lease (see
//! [`crate::lease`] and `kv_events::discovery`). [`WorkerDirectory::connect_and_load`]
//! lists every key under the prefix, then [`WorkerDirectory::watch`] watches the
//! prefix from the revision after that snapshot, so no change between the two is
//! missed. What a participant does with a worker is its own business: the directory
//! hands each put, delete, rejected key and connection change to a [`Registrations`]
//! (the daemon updates its scheduler and indexer; a gateway keeps worker id →
//! registration).
//!
//! If etcd is unreachable at start-up, loading retries with exponential backoff
//! ([`retry_delays`]: 100 ms doubling to 5 s). If the watch fails later (etcd restarted,
//! network loss), the directory reports the loss, retries with the same backoff on a
//! fresh client, and on reconnect re-reads the whole prefix and reconciles: workers
//! that vanished meanwhile are deleted, every present one is put again. Every etcd
//! call is bounded by the connect timeout, so a dead endpoint is noticed instead of
//! waited on forever.

use crate::Error;
use crate::etcd::{EtcdConfig, RETRY_MAX, connect, retry_delays, wait_or_cancelled};
use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use kv_events::discovery::WorkerRegistration;
use kv_events::limits::{Limits, WithinLimits as _};
use kv_events::{Subjects, WorkerId};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// One valid registration, with where it came from in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// The etcd key.
    pub key: String,
    /// The registration record (its worker id matches the key's).
    pub registration: WorkerRegistration,
    /// The lease the key is bound to (0: none).
    pub lease_id: i64,
    /// The etcd revision of the key's last change.
    pub mod_revision: i64,
    /// The etcd revision that created the key (unchanged by later puts to it): the
    /// order in which workers registered, the same for every reader of the cluster.
    pub create_revision: i64,
}

/// A registration key or value the directory could not use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// The value is not a JSON registration: the decoder's message.
    Malformed(String),
    /// The key or the record is unusable: why, lowercase.
    Refused(String),
}

/// The directory's view of etcd, for readiness reporting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EtcdStatus {
    /// Connected and loaded or watching: what it is doing.
    Up(&'static str),
    /// A step failed and is being retried.
    Down {
        /// `connect`, `load` or `watch`.
        stage: &'static str,
        /// The error, with its causes.
        error: String,
    },
}

/// What a participant does with the registrations the directory sees. Calls come in
/// etcd's order, one at a time.
pub trait Registrations: Send {
    /// Why this participant cannot use `registration` (for example, a block size
    /// other than its own), or `Ok` (the default). A refused registration is treated
    /// like an invalid one: rejected, and absent from a resync's snapshot.
    ///
    /// # Errors
    /// The reason, lowercase.
    fn check(&self, registration: &WorkerRegistration) -> Result<(), String> {
        let _ = registration;
        Ok(())
    }
    /// A valid registration appeared, changed, or was read again by a resync.
    fn put(&mut self, worker: Registered) -> impl Future<Output = ()> + Send;
    /// The worker's key was deleted (or its lease expired), or a resync found it gone.
    /// May name a worker that was never put (its registration was rejected).
    fn delete(&mut self, worker_id: WorkerId) -> impl Future<Output = ()> + Send;
    /// A registration under the prefix was skipped (already logged).
    fn rejected(&mut self, key: &str, rejection: &Rejection);
    /// The connection to etcd changed.
    fn status(&mut self, status: EtcdStatus);
}

/// The registrations of one namespace, loaded at a revision; see the module docs.
pub struct WorkerDirectory {
    config: EtcdConfig,
    subjects: Subjects,
    limits: Limits,
    client: Client,
    revision: i64,
    workers: BTreeMap<WorkerId, WorkerRegistration>,
}

impl WorkerDirectory {
    /// Connects to etcd and loads every registration of `subjects`' namespace into
    /// `to`, retrying after [`retry_delays`] until it succeeds; each failure is logged and
    /// reported as [`EtcdStatus::Down`]. `None` when `shutdown` is cancelled first.
    /// A value longer than [`Limits::max_message_bytes`], or a registration over
    /// `limits` (a `dp_size` or KV capacity no engine has), is rejected like a
    /// malformed one, before anything is sized by it.
    pub async fn connect_and_load(
        config: EtcdConfig,
        subjects: Subjects,
        limits: Limits,
        to: &mut impl Registrations,
        shutdown: &CancellationToken,
    ) -> Option<Self> {
        let mut workers = BTreeMap::new();
        let mut delays = retry_delays();
        for attempt in 1u64.. {
            let (stage, error) = match connect(&config).await {
                Ok(mut client) => {
                    match resync(&mut client, &subjects, &limits, &mut workers, to, &config).await {
                        Ok(revision) => {
                            to.status(EtcdStatus::Up("connected; watching registrations"));
                            return Some(Self {
                                config,
                                subjects,
                                limits,
                                client,
                                revision,
                                workers,
                            });
                        }
                        Err(e) => ("load", e),
                    }
                }
                Err(e) => ("connect", e),
            };
            // The schedule never ends; RETRY_MAX is its last value anyway.
            let delay = delays.next().unwrap_or(RETRY_MAX);
            let error = error.to_string();
            warn!(attempt, stage, error, retry_in = ?delay, "etcd unavailable; not ready, retrying");
            to.status(EtcdStatus::Down { stage, error });
            if wait_or_cancelled(delay, shutdown).await {
                return None;
            }
        }
        None
    }

    /// The etcd revision of the last load; the watch continues after it.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The valid registrations at [`Self::revision`], by worker id.
    pub fn workers(&self) -> &BTreeMap<WorkerId, WorkerRegistration> {
        &self.workers
    }

    /// Watches the registrations from the loaded revision + 1 until `shutdown`,
    /// handing every change to `to`. When the watch fails it reports etcd lost and
    /// reconnects after [`retry_delays`] on a fresh client, resyncing before watching again.
    pub async fn watch(mut self, mut to: impl Registrations, shutdown: CancellationToken) {
        loop {
            let result = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = self.watch_once(&mut to) => r,
            };
            let error = match result {
                Ok(()) => Error::WatchEnded("etcd closed the watch stream".to_owned()),
                Err(e) => e,
            };
            let error = error.to_string();
            warn!(
                error,
                workers = self.workers.len(),
                "etcd watch lost; serving the last known workers while reconnecting"
            );
            to.status(EtcdStatus::Down {
                stage: "watch",
                error,
            });
            let mut delays = retry_delays();
            loop {
                let delay = delays.next().unwrap_or(RETRY_MAX);
                if wait_or_cancelled(delay, &shutdown).await {
                    return;
                }
                match self.reconnect(&mut to).await {
                    Ok(()) => {
                        to.status(EtcdStatus::Up("reconnected; watching registrations"));
                        info!(
                            workers = self.workers.len(),
                            "etcd watch re-established after resync"
                        );
                        break;
                    }
                    Err((stage, e)) => {
                        let error = e.to_string();
                        warn!(stage, error, "etcd still unavailable");
                        to.status(EtcdStatus::Down { stage, error });
                    }
                }
            }
        }
    }

    /// A fresh client and a resync; the stage that failed otherwise.
    async fn reconnect(
        &mut self,
        to: &mut impl Registrations,
    ) -> Result<(), (&'static str, Error)> {
        let mut fresh = connect(&self.config).await.map_err(|e| ("connect", e))?;
        let revision = resync(
            &mut fresh,
            &self.subjects,
            &self.limits,
            &mut self.workers,
            to,
            &self.config,
        )
        .await
        .map_err(|e| ("load", e))?;
        self.client = fresh;
        self.revision = revision;
        Ok(())
    }

    /// Follows the watch until it fails or etcd ends it (`Ok`). Starting the watch is
    /// bounded by the connect timeout.
    async fn watch_once(&mut self, to: &mut impl Registrations) -> Result<(), Error> {
        let prefix = self.subjects.etcd_worker_prefix();
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(self.revision + 1);
        let mut stream = bounded(
            "starting watch",
            self.config.connect_timeout,
            self.client.watch(prefix.as_str(), Some(options)),
        )
        .await?;
        to.status(EtcdStatus::Up("watching registrations"));
        while let Some(resp) = stream.message().await.map_err(|source| Error::EtcdCall {
            what: "reading watch",
            source,
        })? {
            if resp.canceled() {
                return Err(Error::WatchEnded(format!(
                    "watch canceled by etcd: {}",
                    resp.cancel_reason()
                )));
            }
            for event in resp.events() {
                let Some(kv) = event.kv() else { continue };
                let key = String::from_utf8_lossy(kv.key()).into_owned();
                match event.event_type() {
                    EventType::Put => {
                        if let Some(worker) = parse(&self.subjects, &self.limits, key, kv, to) {
                            let reg = worker.registration.clone();
                            self.workers.insert(reg.worker_id, reg);
                            to.put(worker).await;
                        }
                    }
                    EventType::Delete => {
                        if let Some(id) = self.subjects.worker_id_from_etcd_key(&key) {
                            self.workers.remove(&id);
                            to.delete(id).await;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// `call`, bounded by `timeout`, its failure named `what`.
async fn bounded<T>(
    what: &'static str,
    timeout: Duration,
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| Error::CallTimeout { what, timeout })?
        .map_err(|source| Error::EtcdCall { what, source })
}

/// Parses one registration key/value; `None` (after logging and telling `to`) for keys
/// or values that cannot be used.
fn parse(
    subjects: &Subjects,
    limits: &Limits,
    key: String,
    kv: &etcd_client::KeyValue,
    to: &mut impl Registrations,
) -> Option<Registered> {
    match registration(subjects, limits, &key, kv.value(), to) {
        Ok(registration) => Some(Registered {
            key,
            registration,
            lease_id: kv.lease(),
            mod_revision: kv.mod_revision(),
            create_revision: kv.create_revision(),
        }),
        Err(rejection) => {
            match &rejection {
                Rejection::Malformed(e) => {
                    error!(key, error = %e, "malformed worker registration skipped");
                }
                Rejection::Refused(reason) => error!(key, reason, "worker registration rejected"),
            }
            to.rejected(&key, &rejection);
            None
        }
    }
}

/// The registration at `key`, checked against the key, itself and `to`: what the
/// directory does with every value it reads from etcd (public for the fuzz harness).
///
/// # Errors
/// [`Rejection::Malformed`] for a value that is not a JSON registration,
/// [`Rejection::Refused`] for a key without a numeric worker id, a worker id that
/// differs from the key's, an invalid record, or one `to` refuses.
pub fn registration(
    subjects: &Subjects,
    limits: &Limits,
    key: &str,
    value: &[u8],
    to: &impl Registrations,
) -> Result<WorkerRegistration, Rejection> {
    let id = subjects
        .worker_id_from_etcd_key(key)
        .ok_or_else(|| Rejection::Refused("key does not end in a numeric worker id".into()))?;
    kv_events::limits::check_bytes(value.len(), limits)
        .map_err(|e| Rejection::Refused(e.to_string()))?;
    let registration: WorkerRegistration =
        serde_json::from_slice(value).map_err(|e| Rejection::Malformed(e.to_string()))?;
    if registration.worker_id != id {
        return Err(Rejection::Refused(format!(
            "value names worker {} but the key names worker {id}",
            registration.worker_id
        )));
    }
    registration
        .validate()
        .map_err(|e| Rejection::Refused(e.to_string()))?;
    registration
        .within(limits)
        .map_err(|e| Rejection::Refused(e.to_string()))?;
    to.check(&registration).map_err(Rejection::Refused)?;
    Ok(registration)
}

/// Reads every registration and reconciles `workers` (and `to`) with it: workers gone
/// from etcd are deleted, then every present one is put, in the order the workers
/// registered (key creation revision, then worker id) — the order a watch that saw
/// them arrive would have put them in, so every reader that loads the same snapshot
/// makes the same order-dependent choices (the daemon's adopted block size). Returns
/// the etcd revision of the snapshot, from which a watch must continue.
async fn resync(
    client: &mut Client,
    subjects: &Subjects,
    limits: &Limits,
    workers: &mut BTreeMap<WorkerId, WorkerRegistration>,
    to: &mut impl Registrations,
    config: &EtcdConfig,
) -> Result<i64, Error> {
    let prefix = subjects.etcd_worker_prefix();
    let resp = bounded(
        "listing worker registrations",
        config.connect_timeout,
        client.get(prefix.as_str(), Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
    let mut snapshot = BTreeMap::new();
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        if let Some(worker) = parse(subjects, limits, key, kv, to) {
            snapshot.insert(worker.registration.worker_id, worker);
        }
    }
    let gone: Vec<WorkerId> = workers
        .keys()
        .filter(|id| !snapshot.contains_key(id))
        .copied()
        .collect();
    for id in gone {
        workers.remove(&id);
        to.delete(id).await;
    }
    let mut present: Vec<Registered> = snapshot.into_values().collect();
    present.sort_by_key(|w| (w.create_revision, w.registration.worker_id));
    for worker in present {
        let reg = worker.registration.clone();
        workers.insert(reg.worker_id, reg);
        to.put(worker).await;
    }
    Ok(revision)
}
