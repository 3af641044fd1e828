//! The single ordered path from the engines to NATS.
//!
//! Everything the engines publish — KV event batches, load metrics, generate responses
//! and clear replies — goes through one unbounded channel drained by one task. That
//! gives a total order: whatever a rank enqueues while holding its state lock is
//! published in that order, so event ids go out strictly increasing per (worker,
//! dp_rank), a `Cleared` can never overtake the `Stored` of an earlier step, and a
//! request's `Stored` events reach NATS before its `finished` reply. Enqueueing is a
//! synchronous, non-blocking send (safe under a `std` mutex); the price is that a NATS
//! stall buffers messages in memory instead of slowing the engines.

use async_nats::Subject;
use bytes::Bytes;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

/// One message to publish.
#[derive(Debug)]
struct Outgoing {
    subject: Subject,
    payload: Bytes,
}

/// A cloneable handle for enqueueing messages; the publisher stops after every handle
/// is dropped and the queue is drained.
#[derive(Debug, Clone)]
pub(super) struct Outbox {
    tx: mpsc::UnboundedSender<Outgoing>,
}

impl Outbox {
    /// Starts the publisher task on `client`.
    pub fn start(client: async_nats::Client) -> (Self, JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { tx }, tokio::spawn(publish_all(client, rx)))
    }

    /// Encodes `message` as msgpack and enqueues it for `subject`. Encoding failures
    /// (impossible for this crate's message types) are logged and the message dropped.
    pub fn send<T: Serialize + ?Sized>(&self, subject: impl Into<Subject>, message: &T) {
        let subject = subject.into();
        match kv_events::encode(message) {
            Ok(bytes) => {
                if self
                    .tx
                    .send(Outgoing {
                        subject,
                        payload: Bytes::from(bytes),
                    })
                    .is_err()
                {
                    debug!("outbox closed, message dropped");
                }
            }
            Err(err) => warn!(%subject, %err, "could not encode message"),
        }
    }
}

/// Publishes queued messages in order until the queue closes, then flushes.
async fn publish_all(client: async_nats::Client, mut rx: mpsc::UnboundedReceiver<Outgoing>) {
    while let Some(msg) = rx.recv().await {
        if let Err(err) = client.publish(msg.subject.clone(), msg.payload).await {
            warn!(subject = %msg.subject, %err, "nats publish failed");
        }
    }
    if let Err(err) = client.flush().await {
        warn!(%err, "nats flush failed");
    }
}
