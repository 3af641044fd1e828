//! Cold start: list the registered workers and clear every engine's KV cache, so each
//! policy's pass starts from the same empty cluster.
//!
//! Without this the second policy would inherit the first one's warm caches and look
//! better than it is. Costs one etcd range read and one NATS request per worker.
//! A worker that answers `busy` still has requests in flight (there should be none:
//! every pass awaits all its requests); it is asked again after a backoff of
//! [`CLEAR_BACKOFF`], doubling, at most [`CLEAR_ATTEMPTS`] times.

use super::{ReplayError, ReplayTarget};
use crate::protocol::{ClearReply, OP_CLEAR};
use etcd_client::GetOptions;
use kv_events::discovery::WorkerRegistration;
use kv_events::{WorkerId, decode};
use std::time::Duration;

/// Clear requests sent to a busy worker before giving up.
pub const CLEAR_ATTEMPTS: u32 = 8;

/// Wait before the first retry of a busy worker; doubles per retry (up to ~13 s total).
pub const CLEAR_BACKOFF: Duration = Duration::from_millis(100);

/// Timeout of one clear request.
const CLEAR_TIMEOUT: Duration = Duration::from_secs(10);

/// The workers registered in etcd under the target's namespace, sorted by id.
/// Records that fail to parse or validate are skipped with a warning.
///
/// # Errors
/// [`ReplayError::Etcd`] if etcd cannot be read.
pub async fn list_workers(target: &ReplayTarget) -> Result<Vec<WorkerRegistration>, ReplayError> {
    let prefix = target.subjects.etcd_worker_prefix();
    let mut etcd = target.etcd.clone();
    let response = etcd
        .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
        .await?;
    let mut workers: Vec<WorkerRegistration> = response
        .kvs()
        .iter()
        .filter_map(|kv| {
            match serde_json::from_slice::<WorkerRegistration>(kv.value()) {
                Ok(reg) if reg.validate().is_ok() => Some(reg),
                Ok(reg) => {
                    tracing::warn!(worker = %reg.worker_id, "skipping invalid worker registration");
                    None
                }
                Err(err) => {
                    tracing::warn!(key = %String::from_utf8_lossy(kv.key()), %err, "skipping unreadable worker registration");
                    None
                }
            }
        })
        .collect();
    workers.sort_by_key(|w| w.worker_id);
    Ok(workers)
}

/// Clears every registered worker's KV cache; returns the registrations of the workers
/// cleared, sorted by id.
///
/// # Errors
/// [`ReplayError::NoWorkers`] if none is registered; [`ReplayError::Clear`] if a worker
/// does not answer, answers garbage, or stays busy for [`CLEAR_ATTEMPTS`] attempts.
pub async fn clear_all(target: &ReplayTarget) -> Result<Vec<WorkerRegistration>, ReplayError> {
    let workers = list_workers(target).await?;
    if workers.is_empty() {
        return Err(ReplayError::NoWorkers {
            prefix: target.subjects.etcd_worker_prefix(),
        });
    }
    let ids: Vec<WorkerId> = workers.iter().map(|w| w.worker_id).collect();
    futures::future::try_join_all(ids.iter().map(|id| clear_worker(target, *id))).await?;
    Ok(workers)
}

async fn clear_worker(target: &ReplayTarget, worker: WorkerId) -> Result<(), ReplayError> {
    let subject = target.subjects.engine(worker, OP_CLEAR);
    let mut backoff = CLEAR_BACKOFF;
    for attempt in 1..=CLEAR_ATTEMPTS {
        let request = async_nats::client::Request::new()
            .payload(bytes::Bytes::new())
            .timeout(Some(CLEAR_TIMEOUT));
        let reply = target
            .nats
            .send_request(subject.clone(), request)
            .await
            .map_err(|err| ReplayError::Clear {
                worker,
                reason: err.to_string(),
            })?;
        match decode::<ClearReply>(&reply.payload) {
            Ok(ClearReply::Cleared) => return Ok(()),
            Ok(ClearReply::Busy { active_requests }) => {
                tracing::info!(%worker, active_requests, attempt, "worker busy, retrying clear");
                if attempt < CLEAR_ATTEMPTS {
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                }
            }
            Err(err) => {
                return Err(ReplayError::Clear {
                    worker,
                    reason: format!("undecodable clear reply: {err}"),
                });
            }
        }
    }
    Err(ReplayError::Clear {
        worker,
        reason: format!("still busy after {CLEAR_ATTEMPTS} attempts"),
    })
}
