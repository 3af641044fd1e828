//! One connection's timers: what it is doing ([`Conn`]), noted by a wrapper of its
//! socket ([`Tracked`]: bytes received) and of its service (requests in flight, in
//! [`super::request`]), and the watchdog that closes it ([`drive`]).
//!
//! Why a watchdog of ours rather than hyper's timers: hyper has one, the header-read
//! timeout, started whenever it waits for a head, so it cannot tell an idle
//! keep-alive connection (which should stay open for minutes) from a slow head
//! (which should be cut in seconds). The watchdog knows both from the record.
//!
//! The watchdog runs in the connection's own task, polled after the connection
//! itself: every change to the record (bytes read, a request begun, an answer's body
//! dropped) happens while that task runs, so the watchdog re-reads the record at each
//! poll and needs no wake-up of its own; only the close token (the server's shutdown
//! or an eviction at the cap) comes from another task. Cost: a lock and a clock read
//! per read that returns bytes; one `Sleep`, reset only when the deadline moves.

use super::limits::ServerLimits;
use hyper::body::{Body, Incoming};
use hyper::server::conn::http1;
use hyper::service::HttpService;
use hyper_util::rt::TokioIo;
use std::fmt::Debug;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;
use tracing::debug;

/// What one connection is doing, shared by its socket and service wrappers, its
/// watchdog and the server's table of open connections.
pub(super) struct Conn {
    activity: Mutex<Activity>,
    header_read_timeout: Duration,
    idle_timeout: Duration,
    /// Cancelled to close the connection gracefully: by the server's shutdown (it is
    /// a child of that token) or to make room at the cap.
    pub(super) close: CancellationToken,
    /// The server's signal that an answer ended, for a connection waiting at the cap.
    answered: Arc<Notify>,
}

struct Activity {
    /// Requests whose answer has not been sent whole (0 or 1 on HTTP/1.1).
    in_flight: usize,
    /// A request has been answered: the connection is a kept-alive one.
    answered: bool,
    /// Bytes of the next request's head have arrived since the last answer.
    head_begun: bool,
    /// When the head being waited for must be complete: from accept for the first
    /// request, from its first byte for the next ones; none while a request is in
    /// flight.
    head_deadline: Option<Instant>,
    /// Since when nothing has happened: accept, the last bytes read or the end of
    /// the last answer, whichever is latest.
    quiet_since: Instant,
    /// When a graceful close was asked.
    closing_since: Option<Instant>,
    /// The current request's body missed a deadline (see [`super::request`]).
    body_timed_out: bool,
    /// The current (or last) request's body has not been read to its end.
    body_unread: bool,
}

/// How the watchdog closes a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Close {
    /// Drop it: a head missed its deadline, or a graceful close took too long.
    Now,
    /// Let hyper close it: at once when idle, else after the answer in flight.
    Graceful,
}

impl Conn {
    /// A connection accepted now, under `limits`, closed gracefully when `close` is
    /// cancelled, telling `answered` when each answer ends.
    pub(super) fn new(
        limits: &ServerLimits,
        close: CancellationToken,
        answered: Arc<Notify>,
    ) -> Arc<Self> {
        let now = Instant::now();
        Arc::new(Self {
            activity: Mutex::new(Activity {
                in_flight: 0,
                answered: false,
                head_begun: false,
                head_deadline: Some(now + limits.header_read_timeout),
                quiet_since: now,
                closing_since: None,
                body_timed_out: false,
                body_unread: false,
            }),
            header_read_timeout: limits.header_read_timeout,
            idle_timeout: limits.idle_timeout,
            close,
            answered,
        })
    }

    fn activity(&self) -> MutexGuard<'_, Activity> {
        // Nothing panics while holding the lock; a poisoned record is still sound.
        self.activity.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes arrived: with no request in flight they begin the next head.
    fn received(&self) {
        let now = Instant::now();
        let mut a = self.activity();
        a.quiet_since = now;
        if a.in_flight == 0 && !a.head_begun {
            a.head_begun = true;
            a.head_deadline
                .get_or_insert(now + self.header_read_timeout);
        }
    }

    /// A request's head was read, with a body to come unless `empty`; it is in
    /// flight until the guard is dropped (with its answer's body).
    pub(super) fn request_started(self: &Arc<Self>, empty: bool) -> InFlight {
        let mut a = self.activity();
        a.in_flight += 1;
        a.head_begun = false;
        a.head_deadline = None;
        a.body_timed_out = false;
        a.body_unread = !empty;
        InFlight(self.clone())
    }

    /// The current request's body was read to its end.
    pub(super) fn body_read(&self) {
        self.activity().body_unread = false;
    }

    /// The current request's body missed a deadline.
    pub(super) fn body_timed_out(&self) {
        self.activity().body_timed_out = true;
    }

    /// Whether the current request's body missed a deadline, and whether it is
    /// unread (not read to its end, for whatever reason).
    pub(super) fn body_state(&self) -> (bool, bool) {
        let a = self.activity();
        (a.body_timed_out, a.body_unread)
    }

    /// Whether the connection will close after the answer in flight.
    pub(super) fn is_closing(&self) -> bool {
        self.close.is_cancelled() || self.activity().closing_since.is_some()
    }

    /// Since when this kept-alive connection has been idle (an answer sent, no
    /// request in flight, no head begun), unless it is closing already: what the
    /// server closes first at the cap. A new connection is not idle but waiting for
    /// its first request (which may be in its socket already, not yet read); the
    /// header-read timeout bounds it.
    pub(super) fn idle_since(&self) -> Option<Instant> {
        if self.close.is_cancelled() {
            return None;
        }
        let a = self.activity();
        let idle = a.answered && a.in_flight == 0 && !a.head_begun && a.closing_since.is_none();
        idle.then_some(a.quiet_since)
    }

    fn closing(&self) {
        self.activity()
            .closing_since
            .get_or_insert_with(Instant::now);
    }

    /// When and how the watchdog closes the connection; none while a request is in
    /// flight.
    fn next_close(&self) -> Option<(Instant, Close)> {
        let a = self.activity();
        if a.in_flight > 0 {
            return None;
        }
        if let Some(since) = a.closing_since {
            // Time for hyper to flush the last answer's tail to a slow reader, from
            // the close asked or the end of that answer, whichever is later.
            let grace_from = since.max(a.quiet_since);
            return Some((grace_from + self.header_read_timeout, Close::Now));
        }
        let idle = (a.quiet_since + self.idle_timeout, Close::Graceful);
        Some(match a.head_deadline {
            Some(head) if head <= idle.0 => (head, Close::Now),
            _ => idle,
        })
    }
}

/// A request in flight on its connection; dropped with the answer's body.
pub(super) struct InFlight(Arc<Conn>);

impl Drop for InFlight {
    fn drop(&mut self) {
        {
            let mut a = self.0.activity();
            a.in_flight = a.in_flight.saturating_sub(1);
            a.answered = true;
            a.quiet_since = Instant::now();
        }
        self.0.answered.notify_one();
    }
}

/// A socket that notes in its [`Conn`] when bytes arrive.
pub(super) struct Tracked<IO> {
    io: IO,
    conn: Arc<Conn>,
}

impl<IO> Tracked<IO> {
    pub(super) fn new(io: IO, conn: Arc<Conn>) -> Self {
        Self { io, conn }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Tracked<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(read, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.conn.received();
        }
        read
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Tracked<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// How long a connection closed after an answer that left its request's body unread
/// (a body that missed its deadline, one over the size limit) goes on reading and
/// discarding what the client still sends, after the server's FIN, before the socket
/// is dropped: closing a socket with unread input sends a reset, which can destroy
/// the answer in the client's buffers before it reads it (RFC 9112 §9.6; nginx's
/// lingering close). The connection keeps its slot meanwhile.
const LINGER: Duration = Duration::from_secs(2);

/// Fires when [`Conn::next_close`]'s deadline passes.
struct Watchdog {
    conn: Arc<Conn>,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Future for Watchdog {
    type Output = Close;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Close> {
        // No deadline: a request is in flight, and the connection's own progress
        // (which polls this again) is what ends it.
        let Some((deadline, close)) = self.conn.next_close() else {
            return Poll::Pending;
        };
        ready!(poll_deadline(&mut self.sleep, deadline, cx));
        Poll::Ready(close)
    }
}

/// Polls the timer in `slot` for `deadline`: made at the first call, reset only when
/// the deadline moved.
pub(super) fn poll_deadline(
    slot: &mut Option<Pin<Box<Sleep>>>,
    deadline: Instant,
    cx: &mut Context<'_>,
) -> Poll<()> {
    let sleep = match slot {
        Some(sleep) => {
            if sleep.deadline() != deadline {
                sleep.as_mut().reset(deadline);
            }
            sleep
        }
        None => slot.insert(Box::pin(tokio::time::sleep_until(deadline))),
    };
    sleep.as_mut().poll(cx)
}

/// Drives `connection` until it ends: closed by the client, by hyper (an error, a
/// graceful close), or by the watchdog at one of `conn`'s deadlines. After a last
/// answer that left its request's body unread, the close lingers (see [`LINGER`]).
pub(super) async fn drive<IO, S>(
    mut connection: http1::Connection<TokioIo<Tracked<IO>>, S>,
    conn: &Arc<Conn>,
    remote: impl Debug,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: HttpService<Incoming> + Unpin,
    S::Future: Unpin,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    S::ResBody: 'static,
    <S::ResBody as Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut watchdog = Watchdog {
        conn: conn.clone(),
        sleep: None,
    };
    let mut asked = false;
    loop {
        let event = tokio::select! {
            biased;
            ended = std::future::poll_fn(|cx| connection.poll_without_shutdown(cx)) => {
                Event::Ended(ended)
            }
            () = conn.close.cancelled(), if !asked => {
                asked = true;
                Event::Close(Close::Graceful)
            }
            close = &mut watchdog => Event::Close(close),
        };
        match event {
            Event::Ended(Ok(())) => break,
            Event::Ended(Err(e)) => {
                // Malformed requests, resets: the client's doing.
                debug!(?remote, error = %e, "http connection closed");
                return;
            }
            Event::Close(Close::Now) => {
                debug!(?remote, "http connection closed: headers or close too slow");
                return;
            }
            Event::Close(Close::Graceful) => {
                debug!(
                    ?remote,
                    "http connection closing: idle, shutdown or room at the cap"
                );
                conn.closing();
                Pin::new(&mut connection).graceful_shutdown();
            }
        }
    }
    let linger = conn.activity().body_unread;
    let mut io = connection.into_parts().io.into_inner();
    let closed = tokio::time::timeout(LINGER, async {
        io.shutdown().await?;
        if linger {
            let mut sink = [0u8; 1024];
            while io.read(&mut sink).await? > 0 {}
        }
        io::Result::Ok(())
    });
    if let Ok(Err(e)) = closed.await {
        debug!(?remote, error = %e, "http connection closed");
    }
}

enum Event {
    Ended(hyper::Result<()>),
    Close(Close),
}
