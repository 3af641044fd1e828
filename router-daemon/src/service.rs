//! A request-reply service of the daemon: the route, batch route, removals and
//! overlap services all answer this way — every subscription of the service feeds one
//! stream, handled at most `max_inflight` at a time, each reply published to the
//! request's inbox (with the service's headers), and at shutdown every subscription
//! drained so queries already received are answered.

use crate::metrics::counters::{MessageKind, Outcome};
use crate::state::RouterState;
use futures::StreamExt;
use kv_events::encode;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// How one request-reply service answers: its connection, concurrency, stop token,
/// the message kind it counts under, and the headers of its replies.
pub(crate) struct Service {
    /// Where replies are published.
    pub client: async_nats::Client,
    /// Most requests handled at once, over all the service's subscriptions.
    pub max_inflight: usize,
    /// Cancelled at shutdown (the subscriptions are then drained).
    pub intake: CancellationToken,
    /// What malformed requests are counted as.
    pub kind: MessageKind,
    /// Set on every reply when present ([`kv_events::ROUTER_ID_HEADER`]).
    pub headers: Option<async_nats::HeaderMap>,
}

/// Answers request-reply messages on `subscribers` with `handle`, at most
/// `service.max_inflight` at a time over all of them, until `service.intake` is
/// cancelled; messages already being handled are answered before this returns. A
/// message without a reply subject is counted as malformed under `service.kind` and
/// skipped.
pub(crate) async fn serve_requests<R, F, Fut>(
    state: Arc<RouterState>,
    subscribers: Vec<async_nats::Subscriber>,
    service: Service,
    handle: F,
) where
    R: serde::Serialize,
    F: Fn(Arc<RouterState>, bytes::Bytes) -> Fut,
    Fut: std::future::Future<Output = R>,
{
    let Service {
        client,
        max_inflight,
        intake,
        kind,
        headers,
    } = service;
    let (client, headers) = (&client, &headers);
    let messages = futures::stream::select_all(
        subscribers
            .into_iter()
            .map(|sub| Box::pin(crate::nats::drain_on_cancel(sub, intake.clone()))),
    );
    messages
        .for_each_concurrent(Some(max_inflight), |msg| {
            let state = state.clone();
            let handle = &handle;
            async move {
                let Some(reply_to) = msg.reply.clone() else {
                    state.counters.message(kind, Outcome::Malformed);
                    warn!(subject = %msg.subject, "request without a reply subject skipped");
                    return;
                };
                let reply = handle(state, msg.payload).await;
                let bytes = match encode(&reply) {
                    Ok(bytes) => bytes::Bytes::from(bytes),
                    Err(e) => {
                        warn!(subject = %msg.subject, error = %e, "failed to encode reply");
                        return;
                    }
                };
                let sent = match headers {
                    Some(headers) => {
                        client
                            .publish_with_headers(reply_to, headers.clone(), bytes)
                            .await
                    }
                    None => client.publish(reply_to, bytes).await,
                };
                if let Err(e) = sent {
                    warn!(subject = %msg.subject, error = %e, "failed to publish reply");
                }
            }
        })
        .await;
}
