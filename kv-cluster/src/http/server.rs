//! The one way every HTTP server of the cluster serves connections: the daemon's
//! operator endpoint (and its separate `/debug` listener), the gateway, the relay's
//! `/metrics` and the mock engine's OpenAI server all call [`serve`].
//!
//! Why not `axum::serve`: it sets no timer, so a client that connects and never sends
//! a request (slowloris) holds its connection, a task and a file descriptor forever;
//! and it accepts without limit. Why not hyper's own `header_read_timeout` either: hyper
//! starts it whenever it begins waiting for a request head, at accept *and* right
//! after each response, so it doubles as an idle keep-alive timeout of a few seconds,
//! far below the pools of common clients (aiohttp in aiperf 300 s, Go's `net/http`
//! and reqwest 90 s). A request written onto a connection the server is closing at
//! that moment fails with "connection reset", and clients do not resend a POST.
//!
//! [`serve`] is axum's accept loop with separate bounds, built from hyper's pieces
//! (no HTTP parsing of ours); [`ServerLimits`] holds them:
//!
//! - **Header-read timeout**: a new connection must deliver its first request's
//!   complete headers within it from accept; a keep-alive connection, from the first
//!   byte of its next request. Else it is closed without an answer.
//! - **Idle timeout**: a connection with no request in flight and no bytes received
//!   for this long is closed, gracefully: only between requests, never mid-answer.
//!   Answers on a connection that stays open carry `Keep-Alive: timeout=N` (seconds),
//!   so clients that read it (undici, browsers) expire their side first.
//! - **Request body deadlines** ([`super::BodyTimeouts`]): a body must arrive whole within
//!   a total deadline from its request's head, with no gap between chunks longer than
//!   an idle deadline. A handler reading the body then sees a [`super::BodyTimeout`] error;
//!   the answer is 408 with `Connection: close` (the handler's own 408, such as the
//!   gateway's OpenAI error JSON, or else a plain one in place of what it answered)
//!   and the connection closes, freeing its slot.
//! - **Connection cap** ([`ServerLimits::max_connections`]): at the cap, a new
//!   connection is accepted and the longest-idle connection (no request in flight,
//!   no head begun) is closed to make room, as nginx does; so idle pools cannot lock
//!   new clients out. When none is idle, the new connection waits until one is idle
//!   (and closes it) or ends, and further ones wait in the kernel's listen backlog
//!   (refused when it is full).
//!
//! A response after which the server closes carries `Connection: close` (hyper adds
//! it once keep-alive is off: a graceful close asked mid-request, an unread body).
//!
//! Shutdown: on `shutdown`, accepting stops, idle keep-alive connections are closed,
//! requests in flight finish, then [`serve`] returns. Dropping the [`serve`] future
//! instead cuts every connection at once (they run in a `JoinSet` it owns).
//!
//! Cost: per connection one tokio task, one watchdog timer (reset only when its
//! deadline moves) and one small shared record; per read that returns bytes a
//! clock read and an uncontended lock; per request one boxed future and, for a body
//! that is not empty, one timer; per server one semaphore and a table of open
//! connections, scanned only when a connection arrives at the cap.

use super::connection::{self, Conn, Tracked};
use super::limits::ServerLimits;
use super::request::Requests;
use axum::Router;
use axum::serve::Listener;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

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
    let open = Arc::new(Open::default());
    let mut tasks = JoinSet::new();
    let mut builder = http1::Builder::new();
    // Ours instead (see the module docs); hyper's would also time idle connections.
    builder.header_read_timeout(None);
    let requests = Requests::new(router, &limits);
    let mut at_cap = false;
    loop {
        while tasks.try_join_next().is_some() {}
        let (io, remote) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let permit = if let Ok(permit) = permits.clone().try_acquire_owned() {
            at_cap = false;
            permit
        } else {
            if !at_cap {
                warn!(
                    max_connections = limits.max_connections.get(),
                    "http connection limit reached; the longest-idle connection is \
                     closed for a new one, or it waits until one is idle or ends"
                );
                at_cap = true;
            }
            match open.make_room(&permits, &shutdown).await {
                Some(permit) => permit,
                None => break,
            }
        };
        let conn = Conn::new(&limits, shutdown.child_token(), open.answered.clone());
        let registered = open.insert(conn.clone());
        let connection = builder.serve_connection(
            TokioIo::new(Tracked::new(io, conn.clone())),
            requests.on(conn.clone()),
        );
        tasks.spawn(async move {
            connection::drive(connection, &conn, remote).await;
            drop(registered);
            drop(permit);
        });
    }
    drop(listener);
    // Each connection's close token is a child of `shutdown`: idle ones close now,
    // busy ones after their answer.
    while tasks.join_next().await.is_some() {}
}

/// The open connections, by a serial number, for closing the longest-idle one at
/// the cap.
#[derive(Default)]
struct Open {
    table: Mutex<(u64, HashMap<u64, Arc<Conn>>)>,
    /// Told when an answer ends (its connection may now be idle).
    answered: Arc<Notify>,
}

impl Open {
    fn insert(self: &Arc<Self>, conn: Arc<Conn>) -> Registered {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let id = table.0;
        table.0 += 1;
        table.1.insert(id, conn);
        Registered {
            open: self.clone(),
            id,
        }
    }

    /// A permit for a connection accepted at the cap: closes the longest-idle
    /// connection, or waits until one is idle (and closes it) or ends. `None` at
    /// shutdown.
    async fn make_room(
        &self,
        permits: &Arc<Semaphore>,
        shutdown: &CancellationToken,
    ) -> Option<OwnedSemaphorePermit> {
        loop {
            let answered = self.answered.notified();
            self.close_idlest();
            tokio::select! {
                () = shutdown.cancelled() => return None,
                // The semaphore is never closed.
                permit = permits.clone().acquire_owned() => return permit.ok(),
                () = answered => {}
            }
        }
    }

    /// Asks the connection idle for longest to close, if there is one.
    fn close_idlest(&self) {
        let table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let idlest = table
            .1
            .values()
            .filter_map(|conn| Some((conn.idle_since()?, conn)))
            .min_by_key(|(since, _)| *since);
        if let Some((since, conn)) = idlest {
            debug!(idle_for = ?since.elapsed(), "closing an idle connection to make room");
            conn.close.cancel();
        }
    }
}

/// Removes its connection from [`Open`] when the connection's task ends.
struct Registered {
    open: Arc<Open>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut table = self
            .open
            .table
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        table.1.remove(&self.id);
    }
}
