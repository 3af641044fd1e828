//! Lifecycle messages (frontend → router on `{ns}.router.lifecycle`), one at a time or
//! in a batch (see the parent module's docs for why batches exist and their cost).

use crate::ids::RequestId;
use serde::{Deserialize, Serialize};

/// A step in a routed request's life. Every one of them refreshes the request's
/// time-to-live in the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LifecycleEvent {
    /// The first output token was produced: prefill is over, the request now decodes.
    /// For a disaggregated request, the decode worker's first token: the KV transfer
    /// is over too, so the prefill half's booking is released.
    PrefillDone,
    /// A disaggregated request's prefill worker answered: its prefill tokens leave
    /// that worker's load, while the blocks it holds for the transfer stay booked
    /// until `prefill_done` ([`crate::disaggregation`]).
    RemotePrefillDone,
    /// The request is still running. Frontends send it for requests that may outlive
    /// the router's request TTL, so they are not expired by accident.
    KeepAlive,
    /// The request finished or was aborted; its load is released.
    Freed,
}

/// A lifecycle update for a previously routed request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LifecycleMessage {
    /// The id given in the [`super::RouteRequest`].
    pub request_id: RequestId,
    /// What happened.
    pub event: LifecycleEvent,
}

/// Several lifecycle messages in one NATS message, applied by the router in order,
/// as if each had arrived on its own.
///
/// On the wire a map `{"messages": [{request_id, event}, …]}` of at most
/// [`crate::limits::MAX_LIFECYCLE_BATCH`] messages (more: the whole batch is refused,
/// counted once as `over_limit`). Decoding also accepts a single
/// [`LifecycleMessage`] (`{request_id, event}`, what frontends before the batch form
/// send, and what a frontend sends with one message queued) as a batch of one. A map
/// with both forms' fields, or with neither, does not decode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "LifecycleWire")]
pub struct LifecycleBatch {
    /// The messages, in the order the frontend queued them.
    pub messages: Vec<LifecycleMessage>,
}

/// Either form of a lifecycle payload, as read from the wire.
#[derive(Deserialize)]
struct LifecycleWire {
    #[serde(default)]
    request_id: Option<RequestId>,
    #[serde(default)]
    event: Option<LifecycleEvent>,
    #[serde(default)]
    messages: Option<Vec<LifecycleMessage>>,
}

impl TryFrom<LifecycleWire> for LifecycleBatch {
    type Error = &'static str;

    fn try_from(wire: LifecycleWire) -> Result<Self, Self::Error> {
        let messages = match (wire.request_id, wire.event, wire.messages) {
            (None, None, Some(messages)) => messages,
            (Some(request_id), Some(event), None) => vec![LifecycleMessage { request_id, event }],
            _ => {
                return Err(
                    "a lifecycle payload carries either `messages` or `request_id` and `event`",
                );
            }
        };
        Ok(Self { messages })
    }
}

impl From<LifecycleMessage> for LifecycleBatch {
    fn from(message: LifecycleMessage) -> Self {
        Self {
            messages: vec![message],
        }
    }
}

impl LifecycleBatch {
    /// The payload to publish for `messages`, in order: the single-message form for
    /// one (which every router reads), the batch form otherwise.
    ///
    /// # Errors
    /// [`crate::CodecError`] when encoding fails (never for these types).
    pub fn encode(messages: &[LifecycleMessage]) -> Result<Vec<u8>, crate::CodecError> {
        #[derive(Serialize)]
        struct Batch<'a> {
            messages: &'a [LifecycleMessage],
        }
        match messages {
            [one] => crate::encode(one),
            many => crate::encode(&Batch { messages: many }),
        }
    }
}
