//! Raw HTTP/1.1 over a socket, for tests that must see exactly what a server sends
//! and when it closes: one answer off a kept-alive connection, everything until the
//! close, a request trickled a byte at a time. Used by `kv-cluster`'s server tests and
//! by the gateway's connection tests (`tests/tests/gateway_connections.rs`).

// Each test file uses a part of these helpers.
#![allow(dead_code)]

use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

/// Upper bound on anything the server should do (a closed connection, an answer).
pub const WAIT: Duration = Duration::from_secs(30);

/// One answer read off a kept-alive connection: its head (lowercased) and body.
pub struct RawResponse {
    pub head: String,
    pub body: String,
}

impl RawResponse {
    pub fn status(&self) -> u16 {
        self.head[9..12].parse().unwrap()
    }

    /// The value of header `name` (lowercase), if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    }
}

/// Reads one answer with a `Content-Length` body; `None` if the server closed the
/// connection first. Panics if nothing happens within [`WAIT`].
pub async fn read_answer(stream: &mut (impl AsyncRead + Unpin)) -> Option<RawResponse> {
    let mut raw = Vec::new();
    let end = loop {
        if let Some(at) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        if read_some(stream, &mut raw).await == 0 {
            return None;
        }
    };
    let head = String::from_utf8(raw[..end].to_vec())
        .unwrap()
        .to_lowercase();
    let answer = RawResponse {
        head,
        body: String::new(),
    };
    let length: usize = answer.header("content-length").unwrap().parse().unwrap();
    while raw.len() < end + length {
        assert_ne!(read_some(stream, &mut raw).await, 0, "cut mid-body");
    }
    let body = String::from_utf8(raw[end..end + length].to_vec()).unwrap();
    Some(RawResponse { body, ..answer })
}

async fn read_some(stream: &mut (impl AsyncRead + Unpin), raw: &mut Vec<u8>) -> usize {
    let mut buf = [0u8; 4096];
    let read = tokio::time::timeout(WAIT, stream.read(&mut buf))
        .await
        .expect("the server answers or closes");
    let n = read.unwrap_or(0);
    raw.extend_from_slice(&buf[..n]);
    n
}

/// Reads the connection's last answer: it must say `Connection: close` (and no
/// `Keep-Alive`), then the server must close the connection.
pub async fn read_last_answer(stream: &mut (impl AsyncRead + Unpin)) -> RawResponse {
    let answer = read_answer(stream)
        .await
        .expect("answered, not just closed");
    let (connection, keep_alive) = (answer.header("connection"), answer.header("keep-alive"));
    assert_eq!(
        (connection, keep_alive),
        (Some("close"), None),
        "{}",
        answer.head
    );
    assert_eq!(read_until_closed(stream).await, b"", "then closed");
    answer
}

/// Reads an answer advertising `Keep-Alive: {keep_alive}`, then waits for the server
/// to close the connection, idle, with nothing more sent.
pub async fn read_answer_then_idle_close(
    stream: &mut (impl AsyncRead + Unpin),
    keep_alive: &str,
) -> RawResponse {
    let answer = read_answer(stream).await.expect("answered");
    assert_eq!(
        answer.header("keep-alive"),
        Some(keep_alive),
        "{}",
        answer.head
    );
    assert_eq!(read_until_closed(stream).await, b"", "closed, nothing more");
    answer
}

/// Reads until the server closes the connection (end of stream or reset) and returns
/// what it sent; panics if it is still open after [`WAIT`].
pub async fn read_until_closed(stream: &mut (impl AsyncRead + Unpin)) -> Vec<u8> {
    let mut got = Vec::new();
    while read_some(stream, &mut got).await > 0 {}
    got
}

/// Writes `bytes` one at a time, `every` apart, then keeps the write side open
/// (closing it would end the connection) until aborted.
pub fn trickle(
    mut write: tokio::net::tcp::OwnedWriteHalf,
    bytes: Vec<u8>,
    every: Duration,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        for byte in bytes {
            tick.tick().await;
            if write.write_all(&[byte]).await.is_err() {
                return;
            }
        }
        std::future::pending::<()>().await;
        drop(write);
    })
}

/// Whether the server has closed `stream` already (a non-blocking look).
pub fn closed_now(stream: &std::net::TcpStream) -> bool {
    match stream.peek(&mut [0u8; 1]) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}
