//! `kv_cluster::http::serve` over real loopback sockets: connections that never
//! send a request (slowloris), headers sent a byte at a time, idle keep-alive
//! connections (kept past the header-read timeout, closed at the idle timeout, closed
//! first at the cap) and shutdown. Timeouts are short so the tests are quick; every
//! assertion is about what the server did (closed unanswered, answered after a slot
//! freed), never about how fast. Request bodies: `http_bodies.rs`.

// Test helpers unwrap: a broken socket must fail the test loudly.
#![allow(clippy::unwrap_used)]

#[path = "http_server/common.rs"]
mod common;

use axum::Router;
use axum::routing::get;
use common::raw::{
    WAIT, closed_now, read_answer, read_answer_then_idle_close, read_until_closed, trickle,
};
use common::{REQUEST, Server, limits};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const MS: Duration = Duration::from_millis(1);

#[tokio::test]
async fn idle_connections_are_closed_unanswered_after_the_header_read_timeout() {
    let server = Server::start(limits(300 * MS, WAIT, 1000)).await;
    let mut readers = Vec::new();
    for _ in 0..200 {
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        readers.push(tokio::spawn(
            async move { read_until_closed(&mut stream).await },
        ));
    }
    for reader in readers {
        assert_eq!(reader.await.unwrap(), b"", "closed without an answer");
    }
    assert_eq!(server.livez().await, 200, "a normal client is still served");
    server.stop().await;
}

#[tokio::test]
async fn headers_sent_a_byte_at_a_time_are_cut_at_the_header_read_timeout() {
    let server = Server::start(limits(300 * MS, WAIT, 16)).await;
    let (mut read, write) = server.connect().await.into_split();
    // One byte every 100 ms: the request would take about 4 s to arrive whole.
    let writer = trickle(write, REQUEST.to_vec(), 100 * MS);
    assert_eq!(read_until_closed(&mut read).await, b"", "never answered");
    writer.abort();
    assert_eq!(server.livez().await, 200);
    server.stop().await;
}

/// The header-read timeout of a kept-alive connection counts from the first byte of
/// its next head, not from the previous answer: a long pause is not a slow head.
#[tokio::test]
async fn a_keep_alive_connection_idle_past_the_header_read_timeout_serves_its_next_request() {
    let server = Server::start(limits(300 * MS, WAIT, 16)).await;
    let mut stream = server.connect().await;
    stream.write_all(REQUEST).await.unwrap();
    let first = read_answer(&mut stream).await.expect("answered");
    assert_eq!(first.status(), 200);
    assert_eq!(
        first.header("keep-alive"),
        Some("timeout=30"),
        "{}",
        first.head
    );
    tokio::time::sleep(1000 * MS).await;
    stream.write_all(REQUEST).await.unwrap();
    let second = read_answer(&mut stream)
        .await
        .expect("still open, answered");
    assert_eq!((second.status(), second.body.as_str()), (200, "ok\n"));
    server.stop().await;
}

/// ... but the next head, once begun, has the header-read timeout to arrive whole.
#[tokio::test]
async fn a_slow_next_head_on_a_keep_alive_connection_is_cut_at_the_header_read_timeout() {
    let server = Server::start(limits(300 * MS, WAIT, 16)).await;
    let (mut read, mut write) = server.connect().await.into_split();
    write.write_all(REQUEST).await.unwrap();
    assert_eq!(
        read_answer(&mut read).await.expect("answered").status(),
        200
    );
    let writer = trickle(write, REQUEST.to_vec(), 100 * MS);
    assert_eq!(read_until_closed(&mut read).await, b"", "never answered");
    writer.abort();
    server.stop().await;
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
    // A header-read timeout far beyond the wait: only the idle timeout can close it.
    let server = Server::start(limits(WAIT * 2, 300 * MS, 16)).await;
    let mut stream = server.connect().await;
    stream.write_all(REQUEST).await.unwrap();
    read_answer_then_idle_close(&mut stream, "timeout=1").await;
    server.stop().await;
}

/// The header-read timeout bounds waiting for a request, not answering it: a body
/// streamed for longer than the timeout (an SSE completion) arrives whole, and so
/// it does past the idle timeout.
#[tokio::test]
async fn an_answer_longer_than_the_header_read_and_idle_timeouts_is_not_cut() {
    let router = Router::new().route(
        "/stream",
        get(|| async {
            // Ten chunks 100 ms apart: about 1 s, against 200 ms timeouts.
            let chunks = futures::stream::unfold(1u32, |n| async move {
                if n > 10 {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                Some((Ok::<_, std::io::Error>(format!("chunk {n}\n")), n + 1))
            });
            axum::body::Body::from_stream(chunks)
        }),
    );
    let server = Server::serving(router, limits(200 * MS, 200 * MS, 4)).await;
    let (status, body) = common::fetch(server.addr, "/stream").await;
    assert_eq!(status, 200);
    assert_eq!(body.lines().count(), 10, "{body}");
    assert!(body.ends_with("chunk 10\n"), "{body}");
    server.stop().await;
}

#[tokio::test]
async fn connections_over_the_cap_wait_until_one_closes() {
    let server = Server::start(limits(1000 * MS, WAIT, 4)).await;
    // Four connections that send nothing take every slot (the listen backlog is
    // first in, first out, so they are accepted before the client below).
    let idle: Vec<std::net::TcpStream> = (0..4)
        .map(|_| {
            let s = std::net::TcpStream::connect(server.addr).unwrap();
            s.set_nonblocking(true).unwrap();
            s
        })
        .collect();
    assert_eq!(
        server.livez().await,
        200,
        "the fifth connection waits and is answered, not refused"
    );
    let freed = idle.iter().filter(|s| closed_now(s)).count();
    assert!(
        freed >= 1,
        "answered only once an idle connection freed its slot"
    );
    server.stop().await;
}

/// At the cap an idle keep-alive connection is closed for a new client, though
/// neither of its timeouts (far beyond the wait) has passed: idle pools cannot lock
/// new clients out.
#[tokio::test]
async fn at_the_cap_an_idle_keep_alive_connection_is_closed_for_a_new_one() {
    let server = Server::start(limits(WAIT * 2, WAIT * 2, 1)).await;
    let mut pooled = server.connect().await;
    pooled.write_all(REQUEST).await.unwrap();
    assert_eq!(
        read_answer(&mut pooled).await.expect("answered").status(),
        200
    );
    assert_eq!(server.livez().await, 200, "the new client is served");
    assert_eq!(
        read_until_closed(&mut pooled).await,
        b"",
        "closed between answers"
    );
    server.stop().await;
}

/// Making room at the cap never cuts an answer: a connection with a request in
/// flight keeps it, and is closed for the waiting client once it is answered.
#[tokio::test]
async fn at_the_cap_a_connection_is_closed_for_a_new_one_only_after_its_answer() {
    let (router, held) = common::held_routes();
    let server = Server::serving(router, limits(WAIT * 2, WAIT * 2, 1)).await;
    let mut busy = server.connect().await;
    busy.write_all(b"GET /slow HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    held.entered.await.unwrap();
    let waiting = server.livez_in_background();
    tokio::time::sleep(300 * MS).await;
    assert!(
        !waiting.is_finished(),
        "no room while the only slot is busy"
    );
    held.release.send(()).unwrap();
    let answer = read_answer(&mut busy).await.expect("answered whole");
    assert_eq!((answer.status(), answer.body.as_str()), (200, "done"));
    assert_eq!(waiting.await.unwrap(), 200, "then the new client");
    assert_eq!(
        read_until_closed(&mut busy).await,
        b"",
        "closed after its answer"
    );
    server.stop().await;
}

#[tokio::test]
async fn shutdown_lets_a_request_in_flight_finish() {
    let (router, held) = common::held_routes();
    let server = Server::serving(router, limits(5000 * MS, WAIT, 4)).await;
    let addr = server.addr;
    let request = tokio::spawn(async move { common::fetch(addr, "/slow").await });
    held.entered.await.unwrap();
    server.shutdown.cancel();
    held.release.send(()).unwrap();
    let (status, body) = request.await.unwrap();
    assert_eq!((status, body.as_str()), (200, "done"));
    server.stop().await;
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "no longer listening"
    );
}
