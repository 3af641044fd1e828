//! The one way every HTTP server of the cluster serves connections: the daemon's
//! operator endpoint (and its separate `/debug` listener), the gateway, the relay's
//! `/metrics` and the mock engine's OpenAI server all call [`serve`].
//!
//! Why not `axum::serve`: it sets no timer, so hyper enforces no header-read timeout
//! and a client that connects and never sends a request (slowloris) holds its
//! connection, a task and a file descriptor forever; and it accepts without limit.
//! [`serve`] is axum's accept loop with both bounds, built from hyper's own pieces
//! (no HTTP parsing of ours):
//!
//! - **Header-read timeout** ([`ServerLimits::header_read_timeout`], hyper's
//!   `http1::Builder::header_read_timeout` on tokio's timer): a connection must
//!   deliver a request's complete headers within it, counted from when the server
//!   starts waiting for them: from accept, and on a keep-alive connection from the end
//!   of the previous response. So the same timeout bounds idle keep-alive
//!   connections. A timed-out connection is closed without an answer. It does not
//!   limit request bodies or responses: a long SSE stream is not cut.
//! - **Connection cap** ([`ServerLimits::max_connections`]): a permit is taken before
//!   each `accept`. At the cap the server stops accepting; new connections wait in
//!   the kernel's listen backlog (their requests are answered once a connection
//!   closes) and are refused by the kernel when the backlog is full.
//!
//! Shutdown: on `shutdown`, accepting stops, idle keep-alive connections are closed,
//! requests in flight finish (hyper's graceful shutdown), then [`serve`] returns.
//! Dropping the [`serve`] future instead cuts every connection at once (they run in
//! a `JoinSet` it owns).
//!
//! Cost: one tokio task and one timer per connection, one semaphore per server.

use axum::Router;
use axum::serve::Listener;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::fmt::Debug;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// Default [`ServerLimits::header_read_timeout`] of every server, in ms: a client
/// sends its headers in one packet, and clients' keep-alive pools (httpx, uvicorn's
/// server side) expire idle connections after 5 s too.
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 5_000;

/// How one HTTP server bounds its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// Longest a connection may take to deliver a request's headers, counted from
    /// accept or from the end of the previous response on the connection; so also
    /// the longest a keep-alive connection stays idle. Then it is closed unanswered.
    pub header_read_timeout: Duration,
    /// Most connections served at once; further ones wait in the listen backlog.
    pub max_connections: NonZeroUsize,
}

impl ServerLimits {
    /// The limits from their flag values: the timeout in milliseconds (flags refuse
    /// 0) and the cap.
    pub fn from_flags(header_read_timeout_ms: u64, max_connections: NonZeroUsize) -> Self {
        Self {
            header_read_timeout: Duration::from_millis(header_read_timeout_ms),
            max_connections,
        }
    }
}

/// Serves `router` over HTTP/1.1 on `listener` within `limits` until `shutdown` is
/// cancelled; then stops accepting, closes idle connections, waits for requests in
/// flight and returns. See the module docs for what each limit does. Accept errors
/// are handled by `listener` (axum's [`Listener`] logs them and backs off).
pub async fn serve<L>(
    mut listener: L,
    router: Router,
    limits: ServerLimits,
    shutdown: CancellationToken,
) where
    L: Listener,
    L::Addr: Debug,
{
    let permits = Arc::new(Semaphore::new(limits.max_connections.get()));
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let mut at_cap = false;
    loop {
        while connections.try_join_next().is_some() {}
        let permit = tokio::select! {
            () = shutdown.cancelled() => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                // The semaphore is never closed.
                Err(_) => break,
            },
        };
        let (io, remote) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let full = permits.available_permits() == 0;
        if full && !at_cap {
            warn!(
                max_connections = limits.max_connections.get(),
                "http connection limit reached; new connections wait until one closes"
            );
        }
        at_cap = full;
        let connection =
            builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(router.clone()));
        let connection = graceful.watch(connection);
        connections.spawn(async move {
            if let Err(e) = connection.await {
                // Timed-out headers, malformed requests, resets: the client's doing.
                debug!(?remote, error = %e, "http connection closed");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    while connections.join_next().await.is_some() {}
}
