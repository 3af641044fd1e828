//! A server of `kv_cluster::http::serve` on a loopback port, to talk to with the
//! raw HTTP/1.1 of [`raw`].

// Each test file uses a part of these helpers.
#![allow(dead_code)]

use axum::Router;
use axum::body::Bytes;
use axum::routing::{get, post};
use kv_cluster::http::{BodyTimeouts, ServerLimits, serve};
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

#[path = "raw.rs"]
pub mod raw;

use raw::WAIT;

/// A request for `/health/livez`, kept alive.
pub const REQUEST: &[u8] = b"GET /health/livez HTTP/1.1\r\nHost: test\r\n\r\n";

/// Limits with the given header-read and idle timeouts and cap, and body deadlines
/// long enough not to matter.
pub fn limits(header_read: Duration, idle: Duration, max_connections: usize) -> ServerLimits {
    ServerLimits {
        header_read_timeout: header_read,
        idle_timeout: idle,
        body: BodyTimeouts {
            total: WAIT * 2,
            idle: WAIT * 2,
        },
        max_connections: NonZeroUsize::new(max_connections).unwrap(),
    }
}

/// `/health/livez` (`ok\n`) and `POST /echo` (the body's length).
pub fn routes() -> Router {
    Router::new()
        .route("/health/livez", get(|| async { "ok\n" }))
        .route(
            "/echo",
            post(|body: Bytes| async move { body.len().to_string() }),
        )
}

/// The two ends of [`held_routes`]' `GET /slow`.
pub struct Held {
    /// Told when the first request to `/slow` is being handled.
    pub entered: oneshot::Receiver<()>,
    /// Lets that request answer `done`.
    pub release: oneshot::Sender<()>,
}

/// [`routes`] and `GET /slow`, whose first request is held until released.
pub fn held_routes() -> (Router, Held) {
    let (entered_tx, entered) = oneshot::channel();
    let (release, release_rx) = oneshot::channel::<()>();
    let slot = Arc::new(Mutex::new(Some((entered_tx, release_rx))));
    let router = routes().route(
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
    (router, Held { entered, release })
}

pub struct Server {
    pub addr: SocketAddr,
    pub shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl Server {
    /// [`routes`] under `limits`.
    pub async fn start(limits: ServerLimits) -> Self {
        Self::serving(routes(), limits).await
    }

    pub async fn serving(router: Router, limits: ServerLimits) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(serve(listener, router, limits, shutdown.clone()));
        Self {
            addr,
            shutdown,
            task,
        }
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("the server stops")
            .unwrap();
    }

    /// The status of `GET /health/livez` on a new connection.
    pub async fn livez(&self) -> u16 {
        fetch(self.addr, "/health/livez").await.0
    }

    /// The status of `GET /health/livez` on a new connection, asked in a task of its
    /// own (to see it wait).
    pub fn livez_in_background(&self) -> JoinHandle<u16> {
        let addr = self.addr;
        tokio::spawn(async move { fetch(addr, "/health/livez").await.0 })
    }

    pub async fn connect(&self) -> TcpStream {
        TcpStream::connect(self.addr).await.unwrap()
    }
}

/// `GET http://{addr}{path}` on a connection of its own, within [`WAIT`]: the status
/// and the body.
pub async fn fetch(addr: SocketAddr, path: &str) -> (u16, String) {
    let (status, body) = kv_cluster::http::get_once(addr, path, WAIT).await.unwrap();
    (status.as_u16(), body)
}
