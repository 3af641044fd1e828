//! `kv_cluster::http::serve` over real loopback sockets: connections that never
//! send a request (slowloris), headers sent a byte at a time, idle keep-alive
//! connections, and connections over the cap. Timeouts are short so the tests are
//! quick; every assertion is about what the server did (closed unanswered, answered
//! after a slot freed), never about how fast.

// Test helpers unwrap: a broken socket must fail the test loudly.
#![allow(clippy::unwrap_used)]

use axum::Router;
use axum::routing::get;
use kv_cluster::http::{ServerLimits, serve};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Upper bound on anything the server should do (a closed connection, an answer).
const WAIT: Duration = Duration::from_secs(30);
const REQUEST: &[u8] = b"GET /health/livez HTTP/1.1\r\nHost: test\r\n\r\n";

struct Server {
    addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl Server {
    /// A server of `/health/livez` only.
    async fn start(header_read_timeout: Duration, max_connections: usize) -> Self {
        let router = Router::new().route("/health/livez", get(|| async { "ok\n" }));
        Self::serving(router, header_read_timeout, max_connections).await
    }

    async fn serving(
        router: Router,
        header_read_timeout: Duration,
        max_connections: usize,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = ServerLimits {
            header_read_timeout,
            max_connections: NonZeroUsize::new(max_connections).unwrap(),
        };
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(serve(listener, router, limits, shutdown.clone()));
        Self {
            addr,
            shutdown,
            task,
        }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("the server stops")
            .unwrap();
    }

    async fn livez(&self) -> u16 {
        kv_cluster::http::get(&self.addr.to_string(), "/health/livez", WAIT)
            .await
            .unwrap()
            .status
    }
}

/// Reads until the server closes the connection (end of stream or reset) and returns
/// what it sent; panics if it is still open after [`WAIT`].
async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let read = tokio::time::timeout(WAIT, stream.read(&mut buf))
            .await
            .expect("the server closes the connection");
        match read {
            Ok(0) | Err(_) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// Whether the server has closed `stream` already (a non-blocking look).
fn closed_now(stream: &std::net::TcpStream) -> bool {
    match stream.peek(&mut [0u8; 1]) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

#[tokio::test]
async fn idle_connections_are_closed_unanswered_after_the_header_read_timeout() {
    let server = Server::start(Duration::from_millis(300), 1000).await;
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
    let server = Server::start(Duration::from_millis(300), 16).await;
    let stream = TcpStream::connect(server.addr).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let writer = tokio::spawn(async move {
        // One byte every 100 ms: the request would take about 4 s to arrive whole.
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        for byte in REQUEST {
            tick.tick().await;
            if write.write_all(&[*byte]).await.is_err() {
                return;
            }
        }
        // Keep the connection open for writing (dropping the half would end it).
        std::future::pending::<()>().await;
        drop(write);
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let n = tokio::time::timeout(WAIT, read.read(&mut buf))
            .await
            .expect("the server closes the connection")
            .unwrap_or(0);
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(got, b"", "the slow request is never answered");
    writer.abort();
    assert_eq!(server.livez().await, 200);
    server.stop().await;
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_after_its_answer() {
    let server = Server::start(Duration::from_millis(300), 16).await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    stream.write_all(REQUEST).await.unwrap();
    // The answer, then nothing: the connection stays idle until the server closes it.
    let got = String::from_utf8(read_until_closed(&mut stream).await).unwrap();
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(
        got.ends_with("\r\n\r\nok\n"),
        "one answer and no more: {got}"
    );
    server.stop().await;
}

/// The header-read timeout bounds waiting for a request, not answering it: a body
/// streamed for longer than the timeout (an SSE completion) arrives whole.
#[tokio::test]
async fn an_answer_longer_than_the_header_read_timeout_is_not_cut() {
    let router = Router::new().route(
        "/stream",
        get(|| async {
            // Ten chunks 100 ms apart: about 1 s, against a 200 ms timeout.
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
    let server = Server::serving(router, Duration::from_millis(200), 4).await;
    let answer = kv_cluster::http::get(&server.addr.to_string(), "/stream", WAIT)
        .await
        .unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body.lines().count(), 10, "{}", answer.body);
    assert!(answer.body.ends_with("chunk 10\n"), "{}", answer.body);
    server.stop().await;
}

#[tokio::test]
async fn connections_over_the_cap_wait_until_one_closes() {
    let server = Server::start(Duration::from_millis(1000), 4).await;
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
        "answered only once an idle connection timed out and freed its slot"
    );
    server.stop().await;
}

#[tokio::test]
async fn shutdown_lets_a_request_in_flight_finish() {
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let slot = std::sync::Arc::new(std::sync::Mutex::new(Some((entered_tx, release_rx))));
    let router = Router::new().route(
        "/slow",
        get(move || {
            let taken = slot.lock().unwrap().take();
            async move {
                if let Some((entered, release)) = taken {
                    entered.send(()).unwrap();
                    release.await.unwrap();
                }
                "done"
            }
        }),
    );
    let server = Server::serving(router, Duration::from_secs(5), 4).await;
    let addr = server.addr;
    let request =
        tokio::spawn(async move { kv_cluster::http::get(&addr.to_string(), "/slow", WAIT).await });
    entered_rx.await.unwrap();
    server.shutdown.cancel();
    release_tx.send(()).unwrap();
    let answer = request.await.unwrap().unwrap();
    assert_eq!((answer.status, answer.body.as_str()), (200, "done"));
    server.stop().await;
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "no longer listening"
    );
}
