//! Request bodies under `kv_cluster::http::serve`'s deadlines, over real loopback
//! sockets: a body trickled slower than its idle deadline, or too slowly in total,
//! is answered 408 with `Connection: close`, and its connection's slot goes to the
//! next client (the cap is 1 here). Deadlines are short so the tests are quick.

// Test helpers unwrap: a broken socket must fail the test loudly.
#![allow(clippy::unwrap_used)]

#[path = "http_server/common.rs"]
mod common;

use common::raw::{WAIT, read_answer, read_last_answer, trickle};
use common::{Server, limits};
use kv_cluster::http::BodyTimeouts;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

const MS: Duration = Duration::from_millis(1);
/// The head of a `POST /echo` announcing 100 bytes of body.
const HEAD: &[u8] = b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\n";

/// One server of capacity 1 with body deadlines `total` and `idle`; a client sends
/// [`HEAD`], then one body byte every `every`: it gets a 408 with `Connection:
/// close` and is closed, and a client waiting for the slot meanwhile is answered.
async fn slow_body_gets_408_and_frees_its_slot(total: Duration, idle: Duration, every: Duration) {
    let server = Server::start(kv_cluster::http::ServerLimits {
        body: BodyTimeouts { total, idle },
        ..limits(WAIT, WAIT, 1)
    })
    .await;
    let (mut read, mut write) = server.connect().await.into_split();
    write.write_all(HEAD).await.unwrap();
    let writer = trickle(write, vec![b'x'; 100], every);
    let waiting = server.livez_in_background();

    let answer = read_last_answer(&mut read).await;
    assert_eq!(answer.status(), 408, "{}{}", answer.head, answer.body);
    writer.abort();
    assert_eq!(waiting.await.unwrap(), 200, "the slot is free");
    server.stop().await;
}

#[tokio::test]
async fn a_body_pausing_longer_than_its_idle_deadline_gets_408() {
    // The first byte comes after 1 s (an interval ticks at once, then every 1 s):
    // more than the 300 ms idle deadline.
    slow_body_gets_408_and_frees_its_slot(WAIT, 300 * MS, 1000 * MS).await;
}

#[tokio::test]
async fn a_body_trickled_within_its_idle_deadline_gets_408_at_its_total_deadline() {
    // A byte every 100 ms never misses the 1 s idle deadline; all 100 would take 10 s.
    slow_body_gets_408_and_frees_its_slot(1000 * MS, 1000 * MS, 100 * MS).await;
}

/// A body that arrives in time is answered, and the connection stays open for more.
#[tokio::test]
async fn a_body_within_its_deadlines_is_read_whole() {
    let server = Server::start(kv_cluster::http::ServerLimits {
        body: BodyTimeouts {
            total: 2000 * MS,
            idle: 1000 * MS,
        },
        ..limits(WAIT, WAIT, 1)
    })
    .await;
    let mut stream = server.connect().await;
    for _ in 0..2 {
        stream.write_all(HEAD).await.unwrap();
        stream.write_all(&[b'x'; 50]).await.unwrap();
        tokio::time::sleep(300 * MS).await;
        stream.write_all(&[b'y'; 50]).await.unwrap();
        let answer = read_answer(&mut stream).await.expect("answered");
        assert_eq!((answer.status(), answer.body.as_str()), (200, "100"));
        assert_eq!(answer.header("connection"), None, "{}", answer.head);
    }
    server.stop().await;
}

/// An answer given without reading the body (413: over the size limit) says
/// `Connection: close`, since the server will not read the rest, and reaches a client
/// that goes on sending its body (the server stops writing and drains what arrives
/// before it closes; on loopback a reset would not destroy the answer anyway).
#[tokio::test]
async fn an_answer_that_leaves_the_body_unread_says_connection_close() {
    let router = common::routes().layer(axum::extract::DefaultBodyLimit::max(16));
    let server = Server::serving(router, limits(WAIT, WAIT, 4)).await;
    let mut stream = server.connect().await;
    let length = 1 << 20;
    stream
        .write_all(
            format!("POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: {length}\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
    // More body after the answer: unread by the server when it closes. (A reset
    // would end the writes early; the answer is what matters.)
    for _ in 0..8 {
        if stream.write_all(&[b'x'; 4096]).await.is_err() {
            break;
        }
        tokio::time::sleep(50 * MS).await;
    }
    let answer = read_answer(&mut stream).await.expect("the answer survives");
    assert_eq!(answer.status(), 413, "{}{}", answer.head, answer.body);
    assert_eq!(
        answer.header("connection"),
        Some("close"),
        "{}",
        answer.head
    );
    server.stop().await;
}
