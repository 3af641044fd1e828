//! Failover whatever the engine does, and no booking left behind: an engine that
//! hangs, one that sends garbage before its first token, one that dies or falls
//! silent after it, and `freed` messages sent while no router is subscribed (a NATS
//! restart). The gateway, the router daemon, the mock engines, nats-server and etcd
//! are real; the misbehaving engine is a raw TCP server on loopback that answers every
//! request the same wrong way.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

// The fixture is shared with gateway.rs, which uses all of it.
#[allow(dead_code)]
#[path = "gateway/fixture.rs"]
mod fixture;

use fixture::{BLOCK, MODEL, Stack};
use futures::StreamExt;
use integration_tests::TestCluster;
use integration_tests::etcd_proxy::EtcdProxy;
use kv_events::WorkerId;
use serde_json::{Value, json};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

const WAIT: Duration = Duration::from_secs(20);

/// A valid first completion chunk, as vLLM streams it.
const CHUNK: &str = r#"{"id":"cmpl-bad","object":"text_completion","created":0,"model":"tiny","choices":[{"index":0,"text":" a","finish_reason":null}]}"#;

/// How the misbehaving engine answers every request.
#[derive(Clone, Copy)]
enum Misbehaviour {
    /// Reads the request and never answers.
    Hang,
    /// Answers 200 with an event stream whose first event is not JSON.
    Garbage,
    /// Sends one valid chunk, then closes the connection (no `[DONE]`).
    DieAfterFirstToken,
    /// Sends one valid chunk, then nothing, holding the connection open.
    SilentAfterFirstToken,
}

/// An engine on a loopback port that misbehaves as `how`; stopped on drop.
struct BadEngine {
    url: String,
    server: JoinHandle<()>,
}

impl Drop for BadEngine {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl BadEngine {
    async fn start(how: Misbehaviour) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let mut held = tokio::task::JoinSet::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.spawn(answer(socket, how));
            }
        });
        Self { url, server }
    }
}

/// Reads one request (headers and `content-length` body), then misbehaves.
async fn answer(mut socket: TcpStream, how: Misbehaviour) {
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    let body_start = loop {
        let Ok(n) = socket.read(&mut buf).await else {
            return;
        };
        if n == 0 {
            return;
        }
        request.extend_from_slice(&buf[..n]);
        if let Some(at) = request.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
    };
    let head = String::from_utf8_lossy(&request[..body_start]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while request.len() < body_start + length {
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => request.extend_from_slice(&buf[..n]),
        }
    }
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    let sent = match how {
        Misbehaviour::Hang => String::new(),
        Misbehaviour::Garbage => format!("{head}data: <html>not json</html>\n\n"),
        Misbehaviour::DieAfterFirstToken | Misbehaviour::SilentAfterFirstToken => {
            format!("{head}data: {CHUNK}\n\n")
        }
    };
    if socket.write_all(sent.as_bytes()).await.is_err() {
        return;
    }
    if matches!(how, Misbehaviour::DieAfterFirstToken) {
        let _ = socket.shutdown().await;
        return;
    }
    // Hold the connection until the gateway gives up on it.
    let _ = socket.read(&mut buf).await;
}

/// A stack of two good engines and worker 9 misbehaving as `how`, holding the two
/// prompts it returns, so the router sends either prompt to worker 9 first (until a
/// good engine has served it).
async fn stack_with(how: Misbehaviour, flags: &[&str]) -> (Stack, BadEngine, [Vec<u32>; 2]) {
    let mut stack = Stack::start(2, 10.0, |_| {}, flags).await;
    let bad = BadEngine::start(how).await;
    let prompts = [7000u32, 9000].map(|first| (first..first + 8 * BLOCK).collect::<Vec<u32>>());
    stack
        .add_engine_holding(WorkerId(9), bad.url.clone(), &prompts)
        .await;
    (stack, bad, prompts)
}

async fn all_freed(stack: &Stack) {
    integration_tests::eventually("every booking to be freed", WAIT, || async {
        (stack.booked() == 0).then_some(())
    })
    .await
    .unwrap();
}

/// POSTs a completion of `tokens` within a deadline far below the gateway's own
/// 600 s request timeout: a gateway that waits for a hung engine fails here.
async fn complete(stack: &Stack, tokens: &[u32], stream: bool) -> (u16, String, Option<String>) {
    let body = json!({"model": MODEL, "prompt": tokens, "max_tokens": 3, "stream": stream});
    let response = tokio::time::timeout(WAIT, stack.post("/v1/completions", body.to_string()))
        .await
        .expect("the gateway answers long before its request timeout");
    let worker = response
        .headers()
        .get(kv_gateway::flow::WORKER_HEADER)
        .map(|v| v.to_str().unwrap().to_owned());
    let status = response.status().as_u16();
    let text = tokio::time::timeout(WAIT, response.text())
        .await
        .expect("the body ends")
        .unwrap();
    (status, text, worker)
}

#[tokio::test]
async fn a_hung_engine_is_failed_over_after_the_first_token_timeout() {
    let flags = ["--first-token-timeout-ms", "500"];
    let (stack, _bad, prompts) = stack_with(Misbehaviour::Hang, &flags).await;
    for (stream, tokens) in [true, false].into_iter().zip(&prompts) {
        let (status, text, worker) = complete(&stack, tokens, stream).await;
        assert_eq!(status, 200, "{text}");
        assert_ne!(worker.as_deref(), Some("9"), "served by a good engine");
        assert!(!text.contains("error"), "{text}");
    }
    assert_eq!(
        stack.gateway().metrics().retries("first_token_timeout"),
        2,
        "one failover per request"
    );
    all_freed(&stack).await;
    stack.stop().await;
}

#[tokio::test]
async fn garbage_before_the_first_token_is_failed_over_not_sent_to_the_client() {
    let (stack, _bad, [tokens, _]) = stack_with(Misbehaviour::Garbage, &[]).await;
    let (status, text, worker) = complete(&stack, &tokens, true).await;
    assert_eq!(status, 200, "{text}");
    assert_ne!(worker.as_deref(), Some("9"));
    assert!(!text.contains("error") && !text.contains("html"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(stack.gateway().metrics().retries("engine_error"), 1);
    all_freed(&stack).await;
    stack.stop().await;
}

#[tokio::test]
async fn a_client_that_did_not_stream_is_failed_over_when_the_engine_dies_after_its_first_token() {
    let (stack, _bad, [first, second]) = stack_with(Misbehaviour::DieAfterFirstToken, &[]).await;
    let (status, text, worker) = complete(&stack, &first, false).await;
    assert_eq!(status, 200, "nothing had reached the client: {text}");
    assert_ne!(worker.as_deref(), Some("9"));
    let whole: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(whole["usage"]["completion_tokens"], 3, "{whole}");
    assert_eq!(stack.gateway().metrics().retries("engine_error"), 1);

    // A streaming client already has the first token: its stream ends with an error.
    let (status, text, worker) = complete(&stack, &second, true).await;
    assert_eq!(status, 200);
    assert_eq!(worker.as_deref(), Some("9"));
    assert!(text.contains(r#""type":"engine_error""#), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    all_freed(&stack).await;
    stack.stop().await;
}

#[tokio::test]
async fn an_engine_silent_after_its_first_token_ends_the_stream_after_the_idle_timeout() {
    let flags = ["--stream-idle-timeout-ms", "500"];
    let (stack, _bad, [first, second]) =
        stack_with(Misbehaviour::SilentAfterFirstToken, &flags).await;
    let (status, text, worker) = complete(&stack, &first, true).await;
    assert_eq!(status, 200);
    assert_eq!(worker.as_deref(), Some("9"));
    assert!(text.contains("sent nothing for 500 ms"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");

    // Not streamed: nothing reached the client, so a good engine answers instead.
    let (status, text, worker) = complete(&stack, &second, false).await;
    assert_eq!(status, 200, "{text}");
    assert_ne!(worker.as_deref(), Some("9"));
    all_freed(&stack).await;
    stack.stop().await;
}

/// The reviewer's case: NATS restarts, the gateway is back before the router has
/// subscribed again, and the `freed` of requests that end then reach no router. Here
/// the router reaches NATS through a proxy the test holds cut until the gateway's
/// `freed` have gone out, so the router is certain to miss them; without a re-send
/// it would hold their load for its 10-minute request TTL.
#[tokio::test]
async fn freed_messages_sent_while_no_router_listens_reach_it_after_a_nats_restart() {
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let nats_addr = format!("127.0.0.1:{}", cluster.nats_server.port());
    let mut proxy = EtcdProxy::new(nats_addr.parse().unwrap()).unwrap();
    proxy.restore().await.unwrap();
    let via_proxy = proxy.endpoint().replace("http://", "nats://");
    let mut stack = Stack::start_on(
        cluster,
        2,
        1.0,
        |args| args.nats.nats_url = vec![via_proxy],
        &[],
    )
    .await;

    let mut streams = Vec::new();
    for i in 0..3u32 {
        let prompt: Vec<u32> = (i * 1000..i * 1000 + 4 * BLOCK).collect();
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2000, "stream": true});
        let response = stack.post("/v1/completions", body.to_string()).await;
        assert_eq!(response.status(), 200);
        let mut chunks = response.bytes_stream();
        chunks.next().await.unwrap().unwrap();
        streams.push(chunks);
    }
    assert_eq!(stack.booked(), 3);

    // The router loses NATS first and stays away; NATS restarts under the gateway.
    proxy.cut().await;
    stack.cluster.nats_server.restart().await.unwrap();
    // The clients go away: the gateway frees the bookings while no router listens.
    drop(streams);

    proxy.restore().await.unwrap();
    all_freed(&stack).await;
    stack.stop().await;
}
