//! One replayed request through an OpenAI-compatible gateway, as an application
//! would send it: the trace's prompt as deterministic token ids, streamed, timed by
//! the client.
//!
//! A Mooncake trace has no text, only one hash id per 512-token block, so the prompt
//! is made of token ids derived from those ids: token `i` of the block with hash id
//! `h` is the low 32 bits of xxh3 over `[low(h), high(h), i]`. Requests sharing a
//! prefix of hash ids share exactly that prefix of tokens, so the engines' prefix
//! caches (and the router's index, which hashes the tokens the gateway forwards) see
//! the trace's reuse. One hash per token costs about 10 ns, 0.1 ms for a 10k-token
//! prompt.
//!
//! The gateway answers with the worker it chose (`x-kv-router-worker-id`); the usage
//! chunk gives the prompt and cached tokens.

use super::TimeScale;
use super::report::{RequestOutcome, RouteFailure};
use crate::trace::{TRACE_BLOCK_SIZE, TraceRequest};
use eventsource_stream::Eventsource;
use futures::StreamExt;
use kv_events::WorkerId;
use serde_json::{Value, json};
use std::time::Duration;
use tokio::time::Instant;

/// A gateway to replay through.
#[derive(Debug, Clone)]
pub struct GatewayTarget {
    /// Base URL, e.g. `http://127.0.0.1:8080`.
    pub url: String,
    /// The model name it serves.
    pub model: String,
    /// The HTTP client.
    pub client: reqwest::Client,
}

/// The prompt of `request` as token ids, `input_length` of them (see the module
/// docs); a request whose `hash_ids` are too short gets tokens only for the blocks
/// its ids cover.
pub fn prompt_tokens(request: &TraceRequest) -> Vec<u32> {
    (0..request.input_length)
        .map_while(|t| {
            let h = *request.hash_ids.get((t / TRACE_BLOCK_SIZE) as usize)?;
            // Truncation is the point: the id's two 32-bit words, and a position < 512.
            let words = [h as u32, (h >> 32) as u32, (t % TRACE_BLOCK_SIZE) as u32];
            Some(kv_events::hash_block(&words).0 as u32)
        })
        .collect()
}

/// Replays `request` through `gateway` (streaming, with usage); never fails, every
/// problem is an outcome. Latencies are the client's, in model ms.
pub async fn replay_request(
    gateway: &GatewayTarget,
    request: &TraceRequest,
    time_scale: TimeScale,
    timeout: Duration,
) -> RequestOutcome {
    let arrival = Instant::now();
    let body = json!({
        "model": gateway.model,
        "prompt": prompt_tokens(request),
        "max_tokens": request.output_length.max(1),
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let sent = gateway
        .client
        .post(format!("{}/v1/completions", gateway.url))
        .json(&body)
        .timeout(timeout)
        .send()
        .await;
    let response = match sent {
        Ok(response) => response,
        Err(err) => {
            tracing::debug!(%err, "gateway unreachable");
            return RequestOutcome::RouteFailed(RouteFailure::Unreachable);
        }
    };
    match response.status().as_u16() {
        200 => {}
        429 => return RequestOutcome::RouteFailed(RouteFailure::Overloaded),
        503 => return RequestOutcome::RouteFailed(RouteFailure::NoWorkers),
        400 | 404 | 413 => return RequestOutcome::RouteFailed(RouteFailure::BadRequest),
        _ => return RequestOutcome::RouteFailed(RouteFailure::Internal),
    }
    let worker_id = response
        .headers()
        .get("x-kv-router-worker-id")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .map_or(WorkerId(0), WorkerId);
    let mut events = response.bytes_stream().eventsource();
    let mut first_token = None;
    let (mut prompt_tokens, mut cached_tokens) = (0, 0);
    while let Some(event) = events.next().await {
        let Ok(event) = event else {
            return RequestOutcome::Failed { worker_id };
        };
        if event.data == "[DONE]" {
            let finished = Instant::now();
            let Some(first) = first_token else {
                return RequestOutcome::Failed { worker_id };
            };
            return RequestOutcome::Completed {
                worker_id,
                ttft_ms: time_scale.to_model_ms(first - arrival),
                e2e_ms: time_scale.to_model_ms(finished - arrival),
                cached_tokens,
                prompt_tokens,
            };
        }
        let Ok(chunk) = serde_json::from_str::<Value>(&event.data) else {
            return RequestOutcome::Failed { worker_id };
        };
        if chunk.get("error").is_some() {
            return RequestOutcome::Failed { worker_id };
        }
        first_token.get_or_insert_with(Instant::now);
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
            cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
        }
    }
    RequestOutcome::Failed { worker_id }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(input_length: u64, hash_ids: Vec<u64>) -> TraceRequest {
        TraceRequest {
            timestamp_ms: 0,
            input_length,
            output_length: 1,
            hash_ids,
        }
    }

    #[test]
    fn shared_hash_ids_give_shared_token_prefixes_and_nothing_more() {
        let a = prompt_tokens(&request(1024 + 10, vec![7, 8, 9]));
        let b = prompt_tokens(&request(1024 + 300, vec![7, 8, 10]));
        let c = prompt_tokens(&request(600, vec![1, 8]));
        assert_eq!(a.len(), 1034);
        assert_eq!(a[..1024], b[..1024], "blocks 7 and 8 are shared");
        assert_ne!(a[1024..1034], b[1024..1034], "block 9 is not block 10");
        assert_ne!(a[..512], c[..512], "block 1 is not block 7");
        // An id names a block's content (Mooncake ids are prefix hashes).
        assert_eq!(a[512..600], c[512..600]);
        assert_eq!(prompt_tokens(&request(1024, vec![7, 8])), a[..1024]);
    }
}
