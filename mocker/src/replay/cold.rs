//! Cold start: list the registered workers and clear every engine's KV cache, so each
//! policy's pass starts from the same empty cluster.
//!
//! Without this the second policy would inherit the first one's warm caches and look
//! better than it is. Costs one etcd range read and one NATS request per worker.
//! A worker whose engine serves no NATS clear subject (vLLM, or a mock in vLLM mode,
//! behind `kv-router relay`: NATS answers "no responders") is cleared over HTTP instead
//! (see the `http` module): vLLM's `POST /reset_prefix_cache` at the URL its registration
//! carries, then a wait until the engine's `AllBlocksCleared` KV event is on the
//! worker's events subject, which vLLM publishes only with its next engine step.
//! A worker that answers `busy` still has requests in flight (there should be none:
//! every pass awaits all its requests); it is asked again after a backoff of
//! [`CLEAR_BACKOFF`], doubling, at most [`CLEAR_ATTEMPTS`] times.

mod http;

use super::{ReplayError, ReplayTarget};
use crate::protocol::{ClearReply, OP_CLEAR};
use async_nats::{RequestError, RequestErrorKind};
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
    let http = kv_cluster::http::client()?;
    futures::future::try_join_all(workers.iter().map(|w| clear_worker(target, &http, w))).await?;
    Ok(workers)
}

async fn clear_worker(
    target: &ReplayTarget,
    http: &reqwest::Client,
    registration: &WorkerRegistration,
) -> Result<(), ReplayError> {
    let worker = registration.worker_id;
    let mut waits = backon::BackoffBuilder::build(
        backon::ExponentialBuilder::new()
            .with_min_delay(CLEAR_BACKOFF)
            .with_factor(2.0)
            .without_max_delay()
            .without_max_times(),
    );
    for attempt in 1..=CLEAR_ATTEMPTS {
        let reply = match clear_over_nats(target, worker).await {
            Err(err) if err.kind() == RequestErrorKind::NoResponders => {
                let Some(url) = &registration.url else {
                    return Err(ReplayError::Clear {
                        worker,
                        reason: "no engine answers its nats clear subject and its registration has no url".to_owned(),
                    });
                };
                http::clear(target, http, registration, url).await
            }
            Err(err) => Err(err.to_string()),
            Ok(reply) => Ok(reply),
        };
        match reply.map_err(|reason| ReplayError::Clear { worker, reason })? {
            ClearReply::Cleared => return Ok(()),
            ClearReply::Busy { active_requests } => {
                tracing::info!(%worker, active_requests, attempt, "worker busy, retrying clear");
                if attempt < CLEAR_ATTEMPTS {
                    // The schedule never ends (no max times).
                    tokio::time::sleep(waits.next().unwrap_or(CLEAR_BACKOFF)).await;
                }
            }
        }
    }
    Err(ReplayError::Clear {
        worker,
        reason: format!("still busy after {CLEAR_ATTEMPTS} attempts"),
    })
}

/// One clear request on the engine's NATS subject; an undecodable reply is an `Ok`
/// carrying nothing usable, reported as a [`RequestError`] of kind `Other`.
async fn clear_over_nats(
    target: &ReplayTarget,
    worker: WorkerId,
) -> Result<ClearReply, RequestError> {
    let request = async_nats::client::Request::new()
        .payload(bytes::Bytes::new())
        .timeout(Some(CLEAR_TIMEOUT));
    let reply = target
        .nats
        .send_request(target.subjects.engine(worker, OP_CLEAR), request)
        .await?;
    decode::<ClearReply>(&reply.payload).map_err(|err| {
        RequestError::with_source(
            RequestErrorKind::Other,
            format!("undecodable clear reply: {err}"),
        )
    })
}
