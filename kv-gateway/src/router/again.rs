//! Asking a route query again of a live replica when the one holding it stalls.
//!
//! A query that waits out the patience may be held by a replica that stalled
//! (module `router::stalls` tells). It is then asked again of a replica that just
//! answered its ping, **under a fresh request id**, and the first answer of the two
//! wins; the other id is freed at once. Why a fresh id: the stalled replica may still
//! book the first query when it resumes, and the two bookings must not be one id's,
//! or the loser's `freed` would free the winner's. Why the loser's `freed` is safe:
//! a router that books the lost query late frees it when the `freed` comes, and one
//! that reads the `freed` first remembers the id and refuses the query
//! (docs/protocol.md, `LifecycleMessage`). Either way, nothing stays booked.
//!
//! Cost: one clone and encoding of the request, and one more query, per query asked
//! again; nothing for queries answered within the patience (one timer each).

use super::RouterClient;
use crate::error::ApiError;
use axum::http::StatusCode;
use kv_events::encode;
use kv_events::routing::{LifecycleEvent, RouteReply, RouteRequest};
use tracing::debug;

impl RouterClient {
    /// Asks `request` (through the grouper when grouping is on), and again of a live
    /// replica under a fresh id if it waits out the patience while a replica stalls
    /// (module docs). The reply's decision names the id that was booked.
    ///
    /// # Errors
    /// As [`RouterClient::route_request`].
    pub(super) async fn ask(&self, request: &RouteRequest) -> Result<RouteReply, ApiError> {
        let first = self.ask_once(request);
        let Some(stalls) = self.asker.stalls() else {
            return first.await;
        };
        let patience = stalls.patience();
        let mut first = std::pin::pin!(first);
        tokio::select! {
            biased;
            reply = &mut first => return reply,
            () = tokio::time::sleep(patience) => {}
        }
        let live = tokio::select! {
            biased;
            reply = &mut first => return reply,
            live = stalls.live_instead() => live,
        };
        let Some(live) = live else {
            return first.await;
        };
        let again = RouteRequest {
            request_id: self.request_id(),
            ..request.clone()
        };
        debug!(first = %request.request_id, again = %again.request_id, router = %live, "asking a slow route query again of a live replica");
        self.stall_events.asked_again.inc();
        let second = std::pin::pin!(self.ask_at(live, &again));
        let (reply, lost) = tokio::select! {
            reply = &mut first => (reply, &again.request_id),
            reply = second => {
                self.stall_events.again_answered.inc();
                (reply, &request.request_id)
            }
        };
        self.publish(lost, LifecycleEvent::Freed);
        reply
    }

    /// Asks `request` once, through the grouper when grouping is on; a query not
    /// answered in time is followed by its `freed`.
    async fn ask_once(&self, request: &RouteRequest) -> Result<RouteReply, ApiError> {
        let payload = encoded(request)?;
        let asked = match &self.grouper {
            Some(grouper) => grouper.ask(payload).await,
            None => self.asker.single(payload).await,
        };
        self.freed_if_unanswered(request, asked)
    }

    /// Asks `request` once of replica `router`.
    async fn ask_at(
        &self,
        router: kv_events::RouterId,
        request: &RouteRequest,
    ) -> Result<RouteReply, ApiError> {
        let asked = self.asker.single_at(router, encoded(request)?).await;
        self.freed_if_unanswered(request, asked)
    }

    /// Passes `asked` on; when it is a 503 (not answered in time), first publishes
    /// `freed` for the request: a router may have booked it all the same, its answer
    /// too late, and the `freed` lets that booking go (a router that never saw the
    /// query remembers the id and refuses it if it comes later).
    fn freed_if_unanswered(
        &self,
        request: &RouteRequest,
        asked: Result<RouteReply, ApiError>,
    ) -> Result<RouteReply, ApiError> {
        asked.inspect_err(|e| {
            if e.status == StatusCode::SERVICE_UNAVAILABLE {
                self.publish(&request.request_id, LifecycleEvent::Freed);
            }
        })
    }
}

/// `request` as sent on the route subject.
fn encoded(request: &RouteRequest) -> Result<Vec<u8>, ApiError> {
    encode(request).map_err(|e| ApiError::internal(format!("encoding route: {e}")))
}
