//! One NATS request to the router's route service, single or batch, with the
//! gateway's deadline and its errors mapped to what the client is told.

use crate::error::ApiError;
use async_nats::client::{RequestError, RequestErrorKind};
use async_nats::{Client, Message, Subject};
use kv_events::decode;
use kv_events::routing::{RouteBatchReply, RouteReply};
use serde::de::DeserializeOwned;
use std::time::Duration;

/// Sends route queries; cheap to clone.
#[derive(Clone)]
pub(super) struct Asker {
    nats: Client,
    route: Subject,
    route_batch: Subject,
    timeout: Duration,
    /// The router's `--max-message-bytes` as the gateway knows it (its own flag).
    max_message_bytes: usize,
}

impl Asker {
    /// Asks on `route` and `route_batch`, waiting at most `timeout` per request.
    pub(super) fn new(
        nats: Client,
        route: String,
        route_batch: String,
        timeout: Duration,
        max_message_bytes: usize,
    ) -> Self {
        Self {
            nats,
            route: route.into(),
            route_batch: route_batch.into(),
            timeout,
            max_message_bytes,
        }
    }

    /// Largest payload a batch may have, in bytes: what the NATS server takes (its
    /// `max_payload`, 1 MiB by default) and the router reads.
    pub(super) fn max_payload(&self) -> usize {
        match self.nats.server_info().max_payload {
            0 => self.max_message_bytes,
            server => server.min(self.max_message_bytes),
        }
    }

    /// Asks one encoded `RouteRequest`.
    ///
    /// # Errors
    /// 503 when no router answers, or not within the timeout; 500 for a reply that
    /// does not decode.
    pub(super) async fn single(&self, payload: Vec<u8>) -> Result<RouteReply, ApiError> {
        let reply = self.request(self.route.clone(), payload).await;
        decoded(reply.map_err(refused)?)
    }

    /// Asks one encoded `RouteBatchRequest`; `None` when nothing subscribes the batch
    /// subject (a router, or a stand-in, that serves only single queries).
    ///
    /// # Errors
    /// As [`Asker::single`].
    pub(super) async fn batch(
        &self,
        payload: Vec<u8>,
    ) -> Result<Option<RouteBatchReply>, ApiError> {
        match self.request(self.route_batch.clone(), payload).await {
            Ok(message) => decoded(message).map(Some),
            Err(e) if e.kind() == RequestErrorKind::NoResponders => Ok(None),
            Err(e) => Err(refused(e)),
        }
    }

    async fn request(&self, subject: Subject, payload: Vec<u8>) -> Result<Message, RequestError> {
        let request = async_nats::client::Request::new()
            .payload(payload.into())
            .timeout(Some(self.timeout));
        self.nats.send_request(subject, request).await
    }
}

fn refused(e: RequestError) -> ApiError {
    match e.kind() {
        RequestErrorKind::NoResponders => ApiError::unavailable("no router is answering"),
        RequestErrorKind::TimedOut => ApiError::unavailable("the router did not answer in time"),
        _ => ApiError::unavailable(format!("cannot reach the router: {e}")),
    }
}

fn decoded<T: DeserializeOwned>(reply: Message) -> Result<T, ApiError> {
    decode::<T>(&reply.payload)
        .map_err(|e| ApiError::internal(format!("malformed route reply: {e}")))
}
