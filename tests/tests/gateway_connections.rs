//! The gateway's client connections against the real stack (nats-server, etcd, the
//! router daemon, mock engines): request bodies sent a byte at a time no longer lock
//! normal clients out, and a kept-alive connection outlives the header-read timeout.
//! Raw HTTP/1.1 over sockets, so the tests see exactly what the gateway sends and
//! when it closes; short configured timeouts keep them quick.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

// The fixture is shared with gateway.rs, which uses all of it.
#[allow(dead_code)]
#[path = "gateway/fixture.rs"]
mod fixture;
// Raw HTTP/1.1 over sockets, shared with kv-cluster's server tests.
#[path = "../../kv-cluster/tests/http_server/raw.rs"]
mod raw;

use fixture::{MODEL, Stack};
use raw::{WAIT, read_answer, read_answer_then_idle_close, read_last_answer, trickle};
use serde_json::{Value, json};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// A completion request's JSON body, not streamed.
fn completion() -> String {
    json!({
        "model": MODEL,
        "prompt": (0..64).collect::<Vec<u32>>(),
        "max_tokens": 2,
    })
    .to_string()
}

/// The head of `POST /v1/completions` with a body of `length` bytes.
fn head(length: usize) -> Vec<u8> {
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n\
         Content-Length: {length}\r\n\r\n"
    )
    .into_bytes()
}

/// The stack with gateway `flags`, and a connection to its gateway.
async fn connected(flags: &[&str]) -> (Stack, TcpStream) {
    let stack = Stack::start(1, 10.0, |_| {}, flags).await;
    let stream = TcpStream::connect(stack.gateway().local_addr()).await;
    (stack, stream.unwrap())
}

/// Sends a [`completion`] request on `stream`.
async fn send_completion(stream: &mut TcpStream) {
    let body = completion();
    stream.write_all(&head(body.len())).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
}

/// Sends a [`completion`] request on `stream` and reads its answer (`None`: closed).
async fn complete_on(stream: &mut TcpStream) -> Option<raw::RawResponse> {
    send_completion(stream).await;
    read_answer(stream).await
}

/// Fault 1 of issue 24: connections that send headers, then a body byte now and then,
/// filled `--max-connections` and were never closed. Now each is answered 408 (OpenAI's
/// error JSON, `Connection: close`) at the body deadline and closed, and a normal
/// client waiting for a slot meanwhile gets its completion.
#[tokio::test]
async fn slow_bodies_are_cut_with_408_and_do_not_lock_out_a_normal_client() {
    let flags = [
        "--max-connections",
        "2",
        "--body-read-timeout-ms",
        "1500",
        "--body-idle-timeout-ms",
        "1000",
    ];
    let stack = Stack::start(1, 10.0, |_| {}, &flags).await;
    let addr = stack.gateway().local_addr();
    let mut attackers = Vec::new();
    for _ in 0..2 {
        let (read, mut write) = TcpStream::connect(addr).await.unwrap().into_split();
        write.write_all(&head(1000)).await.unwrap();
        // A byte every 200 ms: never 1 s apart, but 1,000 bytes would take 200 s.
        attackers.push((
            read,
            trickle(write, vec![b' '; 1000], Duration::from_millis(200)),
        ));
    }
    // Both attackers hold the two slots (the readiness probe's idle connection was
    // closed to make room) before the normal client comes.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let base = stack.base.clone();
    let normal = tokio::spawn(async move {
        kv_cluster::http::client()
            .expect("http client")
            .post(format!("{base}/v1/completions"))
            .header("content-type", "application/json")
            .body(completion())
            .send()
            .await?
            .json::<Value>()
            .await
    });

    for (mut read, writer) in attackers {
        let answer = read_last_answer(&mut read).await;
        assert_eq!(answer.status(), 408, "{}{}", answer.head, answer.body);
        let error: Value = serde_json::from_str(&answer.body).unwrap();
        assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
        assert_eq!(error["error"]["code"], 408, "{error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("1500 ms"), "{message}");
        writer.abort();
    }
    let done = tokio::time::timeout(WAIT, normal)
        .await
        .expect("the normal client is served")
        .unwrap()
        .unwrap();
    assert_eq!(done["object"], "text_completion", "{done}");
    assert_eq!(done["usage"]["completion_tokens"], 2, "{done}");
    stack.stop().await;
}

/// Keep-alive defaults caused failures: the header-read timeout (300 ms here) also
/// closed idle client connections, so a client reusing its pooled connection after a
/// pause had its request reset. Now a connection idle well past it serves its next
/// request, and answers advertise the idle timeout.
#[tokio::test]
async fn a_client_connection_idle_past_the_header_read_timeout_serves_its_next_request() {
    let (stack, mut stream) = connected(&["--header-read-timeout-ms", "300"]).await;
    for round in 0..2 {
        if round > 0 {
            tokio::time::sleep(Duration::from_millis(1200)).await;
        }
        let answer = complete_on(&mut stream)
            .await
            .unwrap_or_else(|| panic!("request {round} answered on the same connection"));
        assert_eq!(answer.status(), 200, "{}{}", answer.head, answer.body);
        assert_eq!(
            answer.header("keep-alive"),
            Some("timeout=600"),
            "{}",
            answer.head
        );
    }
    stack.stop().await;
}

/// `--idle-timeout-s` closes a connection left idle, between requests.
#[tokio::test]
async fn a_client_connection_idle_for_the_idle_timeout_is_closed() {
    let (stack, mut stream) = connected(&["--idle-timeout-s", "1"]).await;
    send_completion(&mut stream).await;
    let answer = read_answer_then_idle_close(&mut stream, "timeout=1").await;
    assert_eq!(answer.status(), 200, "{}{}", answer.head, answer.body);
    stack.stop().await;
}
