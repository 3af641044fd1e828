//! One request on a connection: counted in flight from its head to the end of its
//! answer's body ([`Tracking`]), its body read under deadlines ([`BodyTimeouts`]),
//! and its answer marked for what the connection does next (`Keep-Alive: timeout=N`
//! while it stays open; 408 and `Connection: close` after a body timed out).
//!
//! Why here rather than in each server's handlers: every server of the cluster
//! reads bodies through axum's extractors, which wait for the whole body with no
//! deadline; a client sending one byte now and then would hold its connection (and
//! a slot of the cap) forever. Cost per request: one boxed future; per body that is
//! not empty, one timer, reset only while the body is awaited.

use super::connection::{Conn, InFlight, poll_deadline};
use super::limits::{BodyTimeouts, ServerLimits};
use axum::Router;
use axum::body::Body;
use axum::http::header::{CONNECTION, HeaderName};
use axum::http::{HeaderValue, Request, Response, StatusCode};
use axum::response::IntoResponse;
use hyper::body::{Body as HttpBody, Bytes, Frame, Incoming, SizeHint};
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::time::{Instant, Sleep};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request body missed a deadline of [`BodyTimeouts`]. Axum's body extractors
/// report it as their rejection's source; find it with [`BodyTimeout::find`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BodyTimeout {
    /// The body did not arrive whole within [`BodyTimeouts::total`] of its head.
    #[error("the request body did not arrive whole within {} ms", .0.as_millis())]
    Total(Duration),
    /// No byte of the body arrived for [`BodyTimeouts::idle`].
    #[error("no byte of the request body arrived for {} ms", .0.as_millis())]
    Idle(Duration),
}

impl BodyTimeout {
    /// The body timeout in `error`'s chain of sources (such as an axum body
    /// extractor's rejection), if that is what it is about.
    pub fn find<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a Self> {
        std::iter::successors(Some(error), |e| e.source()).find_map(|e| e.downcast_ref())
    }
}

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

/// What the requests of every connection of a server share: its router, body
/// deadlines and `Keep-Alive` value.
#[derive(Clone)]
pub(super) struct Requests {
    router: TowerToHyperService<Router>,
    body: BodyTimeouts,
    /// `timeout=N`: the idle timeout, in seconds.
    keep_alive: Option<HeaderValue>,
}

impl Requests {
    /// The requests of `router` under `limits`.
    pub(super) fn new(router: Router, limits: &ServerLimits) -> Self {
        let seconds = limits.idle_timeout.as_secs().max(1);
        Self {
            router: TowerToHyperService::new(router),
            body: limits.body,
            keep_alive: HeaderValue::from_str(&format!("timeout={seconds}")).ok(),
        }
    }

    /// The service of the connection `conn`.
    pub(super) fn on(&self, conn: Arc<Conn>) -> Tracking {
        Tracking {
            requests: self.clone(),
            conn,
        }
    }
}

/// The service of one connection: the server's router, with its requests counted
/// in flight and their bodies under deadlines.
pub(super) struct Tracking {
    requests: Requests,
    conn: Arc<Conn>,
}

impl hyper::service::Service<Request<Incoming>> for Tracking {
    type Response = Response<AnswerBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<AnswerBody>, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let conn = self.conn.clone();
        let in_flight = conn.request_started(request.body().is_end_stream());
        let body = self.requests.body;
        let request = request.map(|incoming| Deadlines::new(incoming, body, conn.clone()));
        let answered = hyper::service::Service::call(&self.requests.router, request);
        let keep_alive = self.requests.keep_alive.clone();
        Box::pin(async move {
            let Ok(mut response) = answered.await;
            let (timed_out, unread) = conn.body_state();
            if timed_out && response.status() != StatusCode::REQUEST_TIMEOUT {
                // The handler answered what it made of the failed read (a 400): the
                // client's fault is its slowness.
                response = (
                    StatusCode::REQUEST_TIMEOUT,
                    "the request body did not arrive in time\n",
                )
                    .into_response();
            }
            if unread {
                // Answered before its body was read (it timed out, or the handler did
                // not want it): the rest would have to be drained first; close instead.
                let headers = response.headers_mut();
                headers.insert(CONNECTION, HeaderValue::from_static("close"));
                headers.remove(KEEP_ALIVE);
            } else if let Some(value) = keep_alive.filter(|_| !conn.is_closing()) {
                response.headers_mut().entry(KEEP_ALIVE).or_insert(value);
            }
            Ok(response.map(|body| AnswerBody {
                body,
                _in_flight: in_flight,
            }))
        })
    }
}

/// An answer's body, holding its request in flight until hyper drops it (sent
/// whole, or the connection gone).
pub(super) struct AnswerBody {
    body: Body,
    _in_flight: InFlight,
}

impl HttpBody for AnswerBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request body read under [`BodyTimeouts`]: after a deadline it yields a
/// [`BodyTimeout`] error, notes it in its connection, and ends.
struct Deadlines {
    body: Incoming,
    timeouts: BodyTimeouts,
    /// The total deadline, from the head.
    whole_by: Instant,
    /// When the last chunk arrived (or the head).
    last_chunk: Instant,
    sleep: Option<Pin<Box<Sleep>>>,
    conn: Arc<Conn>,
    timed_out: bool,
}

impl Deadlines {
    fn new(body: Incoming, timeouts: BodyTimeouts, conn: Arc<Conn>) -> Self {
        let now = Instant::now();
        Self {
            body,
            timeouts,
            whole_by: now + timeouts.total,
            last_chunk: now,
            sleep: None,
            conn,
            timed_out: false,
        }
    }

    /// The earlier deadline, and the error for missing it.
    fn next_deadline(&self) -> (Instant, BodyTimeout) {
        let idle = self.last_chunk + self.timeouts.idle;
        if self.whole_by <= idle {
            (self.whole_by, BodyTimeout::Total(self.timeouts.total))
        } else {
            (idle, BodyTimeout::Idle(self.timeouts.idle))
        }
    }
}

impl HttpBody for Deadlines {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.timed_out {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                self.last_chunk = Instant::now();
                if self.body.is_end_stream() {
                    self.conn.body_read();
                }
                return Poll::Ready(Some(Ok(frame)));
            }
            Poll::Ready(None) => {
                self.conn.body_read();
                return Poll::Ready(None);
            }
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Pending => {}
        }
        let (deadline, timeout) = self.next_deadline();
        ready!(poll_deadline(&mut self.sleep, deadline, cx));
        self.timed_out = true;
        self.conn.body_timed_out();
        Poll::Ready(Some(Err(Box::new(timeout))))
    }

    fn is_end_stream(&self) -> bool {
        self.timed_out || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
