//! One recovery request over NATS: publish the [`RecoveryRequest`] with a private
//! reply inbox, collect the chunked reply within [`ReplyLimits`], reassemble it.

use futures::StreamExt;
use kv_events::recovery::{
    AssemblyError, ChunkAssembler, RecoveryReply, RecoveryRequest, ReplyLimits,
};
use std::time::Duration;

/// Why a recovery request got no usable reply.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchError {
    /// Nobody is subscribed to the worker's recovery subject.
    #[error("no publisher serves recovery on {0}")]
    NoResponders(String),
    /// The reply (or its next chunk) did not arrive in time.
    #[error("timed out waiting for a recovery reply on {0}")]
    Timeout(String),
    /// A chunk did not decode or did not fit the chunks before it, or the reply
    /// went past the [`ReplyLimits`] (refused before the chunk was decoded).
    #[error("recovery reply on {subject} refused: {error}")]
    Refused {
        /// The recovery subject.
        subject: String,
        /// What was wrong.
        error: AssemblyError,
    },
    /// The NATS client failed to subscribe or publish.
    #[error("nats error on {subject}: {reason}")]
    Nats {
        /// The recovery subject.
        subject: String,
        /// The client's error.
        reason: String,
    },
}

impl FetchError {
    /// Whether asking again may help: not when nobody serves the subject, nor when
    /// the reply was too large (it would be as large again).
    pub(crate) fn is_retryable(&self) -> bool {
        match self {
            FetchError::NoResponders(_) => false,
            FetchError::Refused { error, .. } => !error.is_oversized(),
            FetchError::Timeout(_) | FetchError::Nats { .. } => true,
        }
    }
}

/// A reassembled reply and what it cost on the wire.
#[derive(Debug)]
pub(crate) struct Fetched {
    /// The reply.
    pub reply: RecoveryReply,
    /// Payload bytes received, over all chunks.
    pub bytes: usize,
    /// Chunks received.
    pub chunks: u32,
}

/// Sends `request` to `subject` and collects the chunked reply; `timeout` applies to
/// the first chunk and to each following one; a reply past `limits` is refused
/// before the chunk that crosses them is decoded.
///
/// # Errors
/// [`FetchError`]; never panics on a malformed reply.
pub(crate) async fn fetch(
    nats: &async_nats::Client,
    subject: &str,
    request: &RecoveryRequest,
    timeout: Duration,
    limits: ReplyLimits,
) -> Result<Fetched, FetchError> {
    let nats_error = |e: &dyn std::fmt::Display| FetchError::Nats {
        subject: subject.to_owned(),
        reason: e.to_string(),
    };
    let payload = kv_events::encode(request).map_err(|e| nats_error(&e))?;
    let inbox = nats.new_inbox();
    let mut replies = nats
        .subscribe(inbox.clone())
        .await
        .map_err(|e| nats_error(&e))?;
    nats.publish_with_reply(subject.to_owned(), inbox, payload.into())
        .await
        .map_err(|e| nats_error(&e))?;
    let mut assembler = ChunkAssembler::with_limits(limits);
    let mut fetched_bytes = 0;
    let mut chunks = 0;
    loop {
        let message = tokio::time::timeout(timeout, replies.next())
            .await
            .map_err(|_| FetchError::Timeout(subject.to_owned()))?
            .ok_or_else(|| FetchError::Timeout(subject.to_owned()))?;
        if message.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
            return Err(FetchError::NoResponders(subject.to_owned()));
        }
        let pushed =
            assembler
                .push_payload(&message.payload)
                .map_err(|error| FetchError::Refused {
                    subject: subject.to_owned(),
                    error,
                })?;
        fetched_bytes += message.payload.len();
        chunks += 1;
        if let Some(reply) = pushed {
            return Ok(Fetched {
                reply,
                bytes: fetched_bytes,
                chunks,
            });
        }
    }
}
