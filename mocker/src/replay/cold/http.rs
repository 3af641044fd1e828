//! Clearing an engine over HTTP as vLLM allows it, and knowing the router saw it.
//!
//! vLLM's `POST /reset_prefix_cache`:
//! - is a development endpoint, served only when vLLM runs with
//!   `VLLM_SERVER_DEV_MODE=1`: 404 otherwise;
//! - with requests running drops nothing and says so: 200 `{"success": false}` (0.32),
//!   409 or 500 in other versions;
//! - drops the cache at once but publishes `AllBlocksCleared` only with its **next
//!   engine step**, so a router fed by its KV events keeps the old picture until some
//!   request runs on the engine.
//!
//! So the cold start subscribes to the worker's KV events before the reset, and after
//! a 200 waits [`CLEARED_WAIT`] for a `Cleared` event of every dp rank. A rank still
//! silent is nudged with a one-token completion on that rank (vLLM's
//! `X-data-parallel-rank` header), which makes the engine step and stores no block (a
//! block is 16 tokens or more), and the wait goes on up to [`CLEARED_DEADLINE`]. The
//! router reads the same subject on its own subscription, so it has the event in order
//! with the worker's other events, applied within its intake latency (milliseconds)
//! of the cold start seeing it: not a barrier, but nothing the engine stores after the
//! reset can reach the router ahead of it.

use super::CLEAR_TIMEOUT;
use crate::protocol::ClearReply;
use crate::replay::ReplayTarget;
use futures::StreamExt;
use kv_events::discovery::WorkerRegistration;
use kv_events::{KvCacheEventData, KvEventBatch, decode};
use std::collections::BTreeSet;
use std::time::Duration;
use tokio::time::Instant;

/// How long the `Cleared` events may take before the silent ranks are nudged.
const CLEARED_WAIT: Duration = Duration::from_secs(1);

/// How long the `Cleared` events may take in all, nudges included.
const CLEARED_DEADLINE: Duration = Duration::from_secs(15);

/// Most bytes read of an engine's reply to the reset or to `/v1/models`.
const MAX_REPLY_BYTES: usize = 64 * 1024;

/// Clears the engine at `url` and waits until every dp rank's `Cleared` event is on
/// the worker's events subject. `Ok(Busy)` when the engine refused for running
/// requests (the caller retries).
///
/// # Errors
/// A message naming what failed: the endpoint missing (404: not in dev mode), another
/// status, or no `Cleared` event by the deadline.
pub(super) async fn clear(
    target: &ReplayTarget,
    http: &reqwest::Client,
    registration: &WorkerRegistration,
    url: &str,
) -> Result<ClearReply, String> {
    let worker = registration.worker_id;
    let subject = target.subjects.kv_events(worker);
    let mut events = target
        .nats
        .subscribe(subject.clone())
        .await
        .map_err(|e| format!("subscribing to {subject}: {e}"))?;
    // The server has the subscription before the engine can publish the event.
    tokio::time::timeout(CLEAR_TIMEOUT, target.nats.flush())
        .await
        .map_err(|_| format!("NATS did not confirm the subscription to {subject}"))?
        .map_err(|e| format!("subscribing to {subject}: {e}"))?;
    if !reset(http, url).await? {
        return Ok(ClearReply::Busy { active_requests: 0 });
    }
    let mut silent: BTreeSet<u32> = (0..registration.dp_size).collect();
    let started = Instant::now();
    let mut nudged = false;
    while !silent.is_empty() {
        let deadline = if nudged {
            started + CLEARED_DEADLINE
        } else {
            started + CLEARED_WAIT
        };
        match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(message)) => {
                let Ok(batch) = decode::<KvEventBatch>(&message.payload) else {
                    continue;
                };
                for event in &batch.events {
                    if matches!(event.data, KvCacheEventData::Cleared) {
                        silent.remove(&event.dp_rank.0);
                    }
                }
            }
            Ok(None) => return Err(format!("the subscription to {subject} ended")),
            Err(_) if !nudged => {
                nudged = true;
                nudge(http, url, &silent).await?;
            }
            Err(_) => {
                return Err(format!(
                    "{url} accepted the reset, but no AllBlocksCleared of dp ranks {silent:?} \
                     reached {subject} within {} s, even after a request on each",
                    CLEARED_DEADLINE.as_secs()
                ));
            }
        }
    }
    Ok(ClearReply::Cleared)
}

/// `POST {url}/reset_prefix_cache`: true if the engine took it, false if it refused
/// because requests are running.
async fn reset(http: &reqwest::Client, url: &str) -> Result<bool, String> {
    let endpoint = format!("{url}/reset_prefix_cache");
    let response = http
        .post(&endpoint)
        .timeout(CLEAR_TIMEOUT)
        .send()
        .await
        .map_err(|err| format!("POST {endpoint}: {err}"))?;
    let status = response.status().as_u16();
    let body = bounded_json(response).await;
    match status {
        200 => Ok(body["success"].as_bool() != Some(false)),
        409 | 500 => Ok(false),
        404 => Err(format!(
            "POST {endpoint} answered 404: vLLM serves it only when started with \
             VLLM_SERVER_DEV_MODE=1 (the mock engine with --vllm-dev-mode)"
        )),
        status => Err(format!("POST {endpoint} answered {status}")),
    }
}

/// A one-token completion on each of `ranks`, so the engine steps and publishes what
/// it holds.
async fn nudge(http: &reqwest::Client, url: &str, ranks: &BTreeSet<u32>) -> Result<(), String> {
    let models = format!("{url}/v1/models");
    let response = http
        .get(&models)
        .timeout(CLEAR_TIMEOUT)
        .send()
        .await
        .map_err(|err| format!("GET {models}: {err}"))?;
    let listing = bounded_json(response).await;
    let Some(model) = listing["data"][0]["id"].as_str() else {
        return Err(format!("GET {models} named no model"));
    };
    let body = serde_json::json!({"model": model, "prompt": [0], "max_tokens": 1});
    for rank in ranks {
        let endpoint = format!("{url}/v1/completions");
        let response = http
            .post(&endpoint)
            .header("X-data-parallel-rank", rank.to_string())
            .json(&body)
            .timeout(CLEAR_TIMEOUT)
            .send()
            .await
            .map_err(|err| format!("POST {endpoint} (nudge of dp rank {rank}): {err}"))?;
        if !response.status().is_success() {
            return Err(format!(
                "POST {endpoint} (nudge of dp rank {rank}) answered {}",
                response.status()
            ));
        }
    }
    Ok(())
}

/// The reply's JSON, read up to [`MAX_REPLY_BYTES`]; `Null` if it is longer, empty or
/// not JSON.
async fn bounded_json(mut response: reqwest::Response) -> serde_json::Value {
    let mut bytes = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        if bytes.len() + chunk.len() > MAX_REPLY_BYTES {
            return serde_json::Value::Null;
        }
        bytes.extend_from_slice(&chunk);
    }
    serde_json::from_slice(&bytes).unwrap_or_default()
}
