//! Worker id claims: how a publisher gets a worker id no other publisher in the
//! namespace uses, without an operator allocating numbers by hand.
//!
//! A claim is the etcd key `kv-router/{ns}/worker-ids/{worker_id}`
//! ([`Subjects::etcd_worker_id_key`]) whose JSON value, a [`ClaimHolder`], names the
//! holder (its stable name, e.g. the pod name, plus host and pid for humans). It is
//! bound to a lease of its own that lives as long as the process, separate from the
//! registration lease (which the relay revokes whenever its engine disconnects).
//!
//! The key is written by one etcd transaction: put only if the key does not exist
//! (`create_revision == 0`), else read it. Two claimants can never both succeed, and
//! there is no window between a read and a write.
//!
//! Which id:
//! - Without an explicit id, the id is derived from the name ([`derived_worker_id`]:
//!   xxh3 of the name, masked to 53 bits so JavaScript clients read the JSON number
//!   exactly), so a restarted pod gets its id back. If a *different* name holds it (a
//!   hash collision), the next candidate, derived from (name, attempt), is tried, up
//!   to [`MAX_PROBES`] candidates.
//! - An explicit id is claimed the same way; held by a different name, it is a
//!   start-up error naming the id and the holder.
//! - Held by the *same* name (the previous incarnation of the same pod, whose lease
//!   has not expired yet), the claimant waits for the key's deletion with an etcd
//!   watch (warning once with the holder and its lease), so the id stays stable
//!   across restarts. The wait lasts at most the old lease's TTL after a crash, and
//!   forever if a live process really holds the name (two pods must not share one).
//!
//! Keeping ([`WorkerIdClaim::keep_until`]): the lease is renewed every TTL/3. When a
//! renewal finds the lease gone (etcd was unreachable for longer than the TTL), the
//! key is taken again with the same create-only transaction; if someone else took it
//! meanwhile, the claim is lost and [`WorkerIdClaim::lost`] fires, so the publisher
//! stops. A process cut off from etcd but not from NATS keeps publishing until it
//! reaches etcd again; a new holder of its id can only appear in that window after
//! the TTL, and only by a hash collision or a second process with the same name.
//!
//! Cost: one lease grant and one transaction at start (one more per probed
//! candidate), then one small etcd round trip per TTL/3.

mod keep;

use crate::Error;
use crate::lease::{KeptLease, Renewal, bounded, checked_ttl, renew_period, ticks_every};
use etcd_client::{
    Client, Compare, CompareOp, EventType, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions,
};
use kv_events::{Subjects, WorkerId};
use serde::{Deserialize, Serialize};
use std::fmt;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Largest derived worker id: 2^53 − 1, the largest integer a JavaScript number (an
/// IEEE double) holds exactly, so JSON readers in any language see the same id.
/// Explicit ids are not limited.
pub const MAX_DERIVED_ID: u64 = (1 << 53) - 1;

/// How many derived candidates are tried before giving up: with 2^53 ids, needing
/// more than one means names collide by hash, needing 8 means something is wrong.
pub const MAX_PROBES: u32 = 8;

/// Longest worker name, in bytes: a Kubernetes pod name (a DNS subdomain) fits.
pub const MAX_NAME_BYTES: usize = 253;

/// Largest claim value read from etcd, in bytes; a larger one is reported as
/// unreadable rather than parsed.
const MAX_VALUE_BYTES: usize = 4096;

/// The `attempt`-th candidate worker id for `name` (attempt 0 is the first): xxh3-64
/// of the name's bytes seeded with the attempt, masked to [`MAX_DERIVED_ID`]. Stable
/// across versions and machines: changing it would move every worker to a new id.
pub fn derived_worker_id(name: &WorkerName, attempt: u32) -> WorkerId {
    let hash = xxhash_rust::xxh3::xxh3_64_with_seed(name.0.as_bytes(), u64::from(attempt));
    WorkerId(hash & MAX_DERIVED_ID)
}

/// A validated worker name: 1 to [`MAX_NAME_BYTES`] bytes without whitespace or
/// control characters (a pod name, a host name).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WorkerName(String);

impl WorkerName {
    /// Validates a name.
    ///
    /// # Errors
    /// [`Error::InvalidWorkerName`] when it is empty, too long, or holds whitespace
    /// or control characters.
    pub fn new(name: impl Into<String>) -> Result<Self, Error> {
        let name = name.into();
        let reason = if name.is_empty() {
            Some("is empty")
        } else if name.len() > MAX_NAME_BYTES {
            Some("is longer than 253 bytes")
        } else if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
            Some("contains whitespace or control characters")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(Error::InvalidWorkerName { name, reason }),
            None => Ok(Self(name)),
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The JSON value of a claim key: who holds the worker id. Only `name` decides (a
/// claimant waits for its own name and yields to others); `host` and `pid` are for
/// the humans reading `etcdctl get`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimHolder {
    /// The holder's stable name (`--worker-name`).
    pub name: String,
    /// The host it runs on, if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Its process id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

impl ClaimHolder {
    /// This process under `name`: the host from `$HOSTNAME` (if set) and its pid.
    pub fn this_process(name: &WorkerName) -> Self {
        Self {
            name: name.0.clone(),
            host: std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()),
            pid: Some(std::process::id()),
        }
    }
}

/// A claim key's current holder as read from etcd, for decisions and messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderSeen {
    /// The decoded value; `None` if it was oversized or not a [`ClaimHolder`].
    pub holder: Option<ClaimHolder>,
    /// The lease the key is bound to (0: none).
    pub lease_id: i64,
    /// The value's size, in bytes.
    pub bytes: usize,
}

impl HolderSeen {
    fn read(kv: &KeyValue) -> Self {
        let value = kv.value();
        let holder = (value.len() <= MAX_VALUE_BYTES)
            .then(|| serde_json::from_slice::<ClaimHolder>(value).ok())
            .flatten();
        Self {
            holder,
            lease_id: kv.lease(),
            bytes: value.len(),
        }
    }

    fn is(&self, name: &WorkerName) -> bool {
        self.holder.as_ref().is_some_and(|h| h.name == name.0)
    }
}

impl fmt::Display for HolderSeen {
    /// `"pod-a" (host h, pid 12, lease 0x1f)` or `an unreadable value of 5000 bytes
    /// (lease 0x1f)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.holder {
            Some(h) => {
                write!(f, "{:?} (", h.name)?;
                if let Some(host) = &h.host {
                    write!(f, "host {host}, ")?;
                }
                if let Some(pid) = h.pid {
                    write!(f, "pid {pid}, ")?;
                }
                write!(f, "lease {:#x})", self.lease_id)
            }
            None => write!(
                f,
                "an unreadable value of {} bytes (lease {:#x})",
                self.bytes, self.lease_id
            ),
        }
    }
}

/// What to claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The claimant's stable name.
    pub name: WorkerName,
    /// An explicit id (`--worker-id`), or `None` to derive one from the name.
    pub worker_id: Option<WorkerId>,
    /// TTL of the claim's lease, in seconds: how long a crashed holder blocks its
    /// id (and its own restart).
    pub ttl_secs: u64,
}

/// What one create-only transaction found.
enum Take {
    /// The key is ours.
    Taken,
    /// Someone holds it; `revision` is the store's revision at that read.
    Held { seen: HolderSeen, revision: i64 },
}

/// A worker id this process holds, with the lease that holds it. Keep it with
/// [`Self::keep_until`]; dropping it without does not delete the key (the lease
/// expires after its TTL).
pub struct WorkerIdClaim {
    client: Client,
    key: String,
    value: String,
    worker_id: WorkerId,
    ttl_secs: i64,
    lease: Option<KeptLease>,
    lost: CancellationToken,
}

impl WorkerIdClaim {
    /// Claims a worker id for `request.name` in `subjects`' namespace, as described
    /// in the module docs: waits (as long as it takes) while the same name holds the
    /// id, probes further derived ids while other names hold them.
    ///
    /// # Errors
    /// [`Error::TtlOutOfRange`] for a TTL of 0 or above `i64::MAX` seconds;
    /// [`Error::WorkerIdHeld`] when an explicit id is held by another name;
    /// [`Error::NoFreeWorkerId`] when [`MAX_PROBES`] derived ids are all held by other
    /// names; [`Error`] when etcd refuses, does not answer within
    /// [`crate::lease::ETCD_CALL_TIMEOUT`], or ends the watch.
    pub async fn acquire(
        mut client: Client,
        subjects: &Subjects,
        request: &ClaimRequest,
    ) -> Result<Self, Error> {
        let ttl_secs = checked_ttl(request.ttl_secs)?;
        let value = serde_json::to_string(&ClaimHolder::this_process(&request.name))?;
        let mut lease = KeptLease::grant(&mut client, ttl_secs).await?;
        let mut claim = Self {
            client,
            key: String::new(),
            value,
            worker_id: WorkerId(0),
            ttl_secs,
            lease: None,
            lost: CancellationToken::new(),
        };
        match claim.first_free(subjects, request, &mut lease).await {
            Ok(worker_id) => {
                info!(
                    worker_id = %worker_id,
                    name = %request.name,
                    key = %claim.key,
                    lease_id = lease.lease_id,
                    "worker id claimed"
                );
                claim.worker_id = worker_id;
                claim.lease = Some(lease);
                Ok(claim)
            }
            Err(e) => {
                KeptLease::revoke_id(&mut claim.client, lease.lease_id, "").await;
                Err(e)
            }
        }
    }

    /// The claimed worker id.
    pub fn worker_id(&self) -> WorkerId {
        self.worker_id
    }

    /// The claim's etcd key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Fires when the claim is lost (its lease expired and another holder took the
    /// key): stop publishing as this worker id. Never fires on an orderly stop.
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Tries the candidates in order; the first one taken is ours.
    async fn first_free(
        &mut self,
        subjects: &Subjects,
        request: &ClaimRequest,
        lease: &mut KeptLease,
    ) -> Result<WorkerId, Error> {
        let candidates: Vec<WorkerId> = match request.worker_id {
            Some(id) => vec![id],
            None => (0..MAX_PROBES)
                .map(|attempt| derived_worker_id(&request.name, attempt))
                .collect(),
        };
        for worker_id in candidates {
            self.key = subjects.etcd_worker_id_key(worker_id);
            match self.take_waiting_for_self(&request.name, lease).await? {
                None => return Ok(worker_id),
                Some(seen) if request.worker_id.is_some() => {
                    return Err(Error::WorkerIdHeld {
                        worker_id,
                        holder: seen.to_string(),
                    });
                }
                Some(seen) => {
                    info!(
                        worker_id = %worker_id,
                        name = %request.name,
                        holder = %seen,
                        "derived worker id held by another name; trying the next candidate"
                    );
                }
            }
        }
        Err(Error::NoFreeWorkerId {
            name: request.name.to_string(),
            attempts: MAX_PROBES,
        })
    }

    /// Takes [`Self::key`], waiting while `name` itself holds it; `Some(holder)` when
    /// another name holds it.
    async fn take_waiting_for_self(
        &mut self,
        name: &WorkerName,
        lease: &mut KeptLease,
    ) -> Result<Option<HolderSeen>, Error> {
        let mut warned = false;
        loop {
            let (seen, revision) = match self.take(lease.lease_id).await? {
                Take::Taken => return Ok(None),
                Take::Held { seen, revision } => (seen, revision),
            };
            if !seen.is(name) {
                return Ok(Some(seen));
            }
            if !warned {
                warn!(
                    key = %self.key,
                    holder = %seen,
                    "worker id held by this name's previous incarnation; waiting for its lease to end"
                );
                warned = true;
            }
            self.wait_for_change(revision, lease).await?;
        }
    }

    /// One create-only transaction on [`Self::key`] under `lease_id`.
    async fn take(&mut self, lease_id: i64) -> Result<Take, Error> {
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.key.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then([TxnOp::put(
                self.key.clone(),
                self.value.clone(),
                Some(PutOptions::new().with_lease(lease_id)),
            )])
            .or_else([TxnOp::get(self.key.clone(), None)]);
        let resp = bounded(self.client.txn(txn)).await?;
        if resp.succeeded() {
            return Ok(Take::Taken);
        }
        let revision = resp.header().map_or(0, |h| h.revision());
        let seen = resp
            .op_responses()
            .into_iter()
            .find_map(|op| match op {
                TxnOpResponse::Get(get) => get.kvs().first().map(HolderSeen::read),
                _ => None,
            })
            // Deleted between the compare and the get of the same transaction cannot
            // happen (a transaction is atomic); an empty answer is treated as
            // unreadable rather than trusted.
            .unwrap_or(HolderSeen {
                holder: None,
                lease_id: 0,
                bytes: 0,
            });
        Ok(Take::Held { seen, revision })
    }

    /// Waits until [`Self::key`] changes after `revision` (deleted or rewritten),
    /// renewing `lease` meanwhile.
    async fn wait_for_change(&mut self, revision: i64, lease: &mut KeptLease) -> Result<(), Error> {
        let options = WatchOptions::new().with_start_revision(revision + 1);
        let mut watch = bounded(self.client.watch(self.key.clone(), Some(options))).await?;
        let mut tick = ticks_every(renew_period(self.ttl_secs));
        loop {
            tokio::select! {
                message = watch.message() => {
                    let resp = message?.ok_or_else(|| {
                        Error::WatchEnded(format!("etcd closed the watch of {}", self.key))
                    })?;
                    if resp.canceled() {
                        return Err(Error::WatchEnded(format!(
                            "etcd cancelled the watch of {}: {}",
                            self.key,
                            resp.cancel_reason()
                        )));
                    }
                    let changed = resp.events().iter().any(|e| {
                        e.event_type() == EventType::Delete || e.kv().is_some()
                    });
                    if changed {
                        return Ok(());
                    }
                }
                _ = tick.tick() => {
                    if lease.renew(&mut self.client, &self.key).await == Renewal::Expired {
                        // Our own lease (not yet holding anything) lapsed: a new one.
                        *lease = KeptLease::grant(&mut self.client, self.ttl_secs).await?;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
