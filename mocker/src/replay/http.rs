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
use engine_model::trace::{TRACE_BLOCK_SIZE, TraceRequest};
use eventsource_stream::Eventsource;
use futures::StreamExt;
use kv_events::WorkerId;
use serde_json::{Value, json};
use std::time::Duration;
use tokio::time::Instant;

/// How long the replay keeps an idle keep-alive connection to the gateway: half the
/// gateway's default header-read timeout (`--header-read-timeout-ms`, 5 s), which is
/// also how long the gateway keeps an idle connection before closing it.
///
/// Why below it: with reqwest's default of 90 s, a connection the gateway is closing
/// at its timeout can still be taken from the pool and a request written onto it; the
/// request then fails as "connection closed before message completed" (the
/// quickstart once counted 1 of 2,000 requests "unreachable" this way). reqwest does
/// not retry it: over HTTP/1 it only resends a request the connection dropped before
/// any byte was written, and a completion is not idempotent, so no client should
/// resend it blindly. Expiring our side first, with margin for timer and scheduling
/// skew on a loaded machine, means the pool never hands out a connection the server
/// may be closing. Costs one TCP connect per request after 2.5 s of idleness.
pub const POOL_IDLE_TIMEOUT: Duration =
    Duration::from_millis(kv_cluster::http::DEFAULT_HEADER_READ_TIMEOUT_MS / 2);

/// A gateway to replay through.
#[derive(Debug, Clone)]
pub struct GatewayTarget {
    /// Base URL, e.g. `http://127.0.0.1:8080`.
    pub url: String,
    /// The model name it serves.
    pub model: String,
    /// The HTTP client (see [`GatewayTarget::client`]).
    pub client: reqwest::Client,
}

impl GatewayTarget {
    /// A gateway at `url` serving `model`, with [`Self::client`].
    ///
    /// # Errors
    /// The HTTP client cannot be built (no TLS backend or resolver).
    pub fn new(url: String, model: String) -> reqwest::Result<Self> {
        Ok(Self {
            url,
            model,
            client: Self::client()?,
        })
    }

    /// The replay's HTTP client: idle connections expire after [`POOL_IDLE_TIMEOUT`],
    /// before the gateway closes them.
    ///
    /// # Errors
    /// The HTTP client cannot be built (no TLS backend or resolver).
    pub fn client() -> reqwest::Result<reqwest::Client> {
        kv_cluster::http::client_builder()
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .build()
    }
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

    /// A keep-alive server as the gateway's: a request arriving on a connection idle
    /// for the header-read timeout finds it closed (the server closes it at that
    /// instant); any other request gets `200 ok`. Returns the address and a count of
    /// accepted connections.
    async fn closing_server() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let idle_limit = Duration::from_millis(kv_cluster::http::DEFAULT_HEADER_READ_TIMEOUT_MS);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("bound").to_string();
        let accepted = std::sync::Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut last = Instant::now();
                    let mut buf = vec![0u8; 4096];
                    // One GET without a body per read: the client sends each in one write.
                    while let Ok(n) = socket.read(&mut buf).await {
                        if n == 0 || last.elapsed() >= idle_limit {
                            return;
                        }
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if socket.write_all(ok).await.is_err() {
                            return;
                        }
                        last = Instant::now();
                    }
                });
            }
        });
        (addr, accepted)
    }

    /// Two requests 5 s apart (the gateway's header-read timeout): the second is
    /// written onto the connection the server is closing by a client that keeps idle
    /// connections 90 s (reqwest's default), and fails; the replay's client has let
    /// the connection go and opens a new one.
    #[tokio::test(start_paused = true)]
    async fn the_replay_client_never_reuses_a_connection_the_gateway_is_closing() {
        let idle = Duration::from_millis(kv_cluster::http::DEFAULT_HEADER_READ_TIMEOUT_MS);
        let ninety = kv_cluster::http::client_builder()
            .pool_idle_timeout(Duration::from_secs(90))
            .build()
            .expect("client");
        let ours = GatewayTarget::client().expect("client");
        for (client, second_succeeds, connections) in [(ninety, false, 1), (ours, true, 2)] {
            let (addr, accepted) = closing_server().await;
            let url = format!("http://{addr}/");
            let first = client.get(&url).send().await.expect("first request");
            assert_eq!(first.text().await.expect("body"), "ok");
            tokio::time::advance(idle).await;
            let second = client.get(&url).send().await;
            assert_eq!(second.is_ok(), second_succeeds, "{second:?}");
            assert_eq!(
                accepted.load(std::sync::atomic::Ordering::SeqCst),
                connections
            );
        }
    }
}
