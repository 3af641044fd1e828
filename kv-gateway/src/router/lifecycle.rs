//! The lifecycle publisher: one task sends every lifecycle message of the gateway, in
//! order (a `freed` must not overtake the `prefill_done` before it), and makes sure a
//! `freed` survives a NATS outage.
//!
//! Why: core NATS delivers at most once, to the subscribers the server knows when the
//! message arrives. When the NATS server restarts, the gateway may reconnect before
//! the router has re-subscribed to `{ns}.router.lifecycle`; the `freed` it buffered
//! during the outage (or sends right after) then reach no router, and the router holds
//! that load until its request TTL (`--request-ttl-ms`, 10 minutes by default). So
//! the task keeps the ids it freed in the last [`RECENT_WINDOW`] (at most
//! [`MAX_RECENT`]); after a reconnect it waits until a router answers a probe route
//! query (which proves the router is connected and subscribed again), then sends once
//! more every `freed` since shortly before the disconnect. `freed` is idempotent: a
//! router that already released the request ignores the repeat (counted as a rejected
//! lifecycle message).
//!
//! Each wake-up of the task publishes every message queued by then as one NATS
//! message (a [`LifecycleBatch`] of up to [`kv_events::limits::MAX_LIFECYCLE_BATCH`]; one message alone
//! keeps the single form): under load the frees of many requests travel together and
//! the router reads one NATS message for them. It never waits to fill a batch.
//! Routers older than the batch form refuse batches: upgrade routers first, or run
//! the gateway with `--lifecycle-batch 1` (each message on its own) until they are.
//!
//! Cost: one request id per `freed` of the last minute (~40 bytes each); after an
//! outage, one probe every 0.1–2 s until a router answers (for at most
//! [`ROUTER_PATIENCE`]), then one message per batch of recent `freed`s.

use async_nats::{Client, Event, Subject};
use backon::{ExponentialBuilder, Retryable as _};
use futures::FutureExt as _;
use futures::future::BoxFuture;
use kv_events::routing::{LifecycleBatch, LifecycleEvent, LifecycleMessage};
use kv_events::{RequestId, Subjects};
use std::collections::VecDeque;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{info, warn};

/// How long a sent `freed` is kept for a re-send after an outage.
pub const RECENT_WINDOW: Duration = Duration::from_secs(60);
/// Most `freed` ids kept for a re-send (the oldest go first).
pub const MAX_RECENT: usize = 1 << 17;
/// Messages published this long before a disconnect was noticed may have been lost
/// with the connection; they are re-sent too.
const BEFORE_DISCONNECT: Duration = Duration::from_secs(5);
/// How long the task waits for a router after a reconnect before giving up the
/// re-send (the router's TTL then frees what was lost).
pub const ROUTER_PATIENCE: Duration = Duration::from_secs(120);

/// Starts the publisher of `queue` on `subjects.lifecycle()`, told of the connection's
/// ups and downs by `connection`; it ends when `queue` closes.
pub(super) fn spawn(
    nats: Client,
    subjects: Subjects,
    max_batch: usize,
    queue: mpsc::UnboundedReceiver<LifecycleMessage>,
    connection: mpsc::UnboundedReceiver<Event>,
) {
    let publisher = Publisher {
        subject: subjects.lifecycle().into(),
        nats,
        subjects,
        recent: VecDeque::new(),
        disconnected_at: None,
        max_batch,
    };
    tokio::spawn(publisher.run(queue, connection));
}

struct Publisher {
    nats: Client,
    subjects: Subjects,
    subject: Subject,
    /// `freed` ids sent, with when, oldest first.
    recent: VecDeque<(Instant, RequestId)>,
    /// The first disconnect not yet covered by a re-send.
    disconnected_at: Option<Instant>,
    /// Most messages per NATS message (1 to [`kv_events::limits::MAX_LIFECYCLE_BATCH`]).
    max_batch: usize,
}

impl Publisher {
    async fn run(
        mut self,
        mut queue: mpsc::UnboundedReceiver<LifecycleMessage>,
        mut connection: mpsc::UnboundedReceiver<Event>,
    ) {
        let mut waiting: Option<BoxFuture<'static, bool>> = None;
        loop {
            tokio::select! {
                message = queue.recv() => match message {
                    Some(message) => {
                        let batch = drain_queued(message, &mut queue, self.max_batch);
                        self.send(&batch).await;
                    }
                    None => break,
                },
                Some(event) = connection.recv() => match event {
                    Event::Disconnected => {
                        self.disconnected_at.get_or_insert_with(Instant::now);
                    }
                    Event::Connected if self.disconnected_at.is_some() => {
                        waiting = Some(router_answers(self.nats.clone(), self.subjects.clone()).boxed());
                    }
                    _ => {}
                },
                answered = async {
                    match waiting.as_mut() {
                        Some(router) => router.await,
                        None => std::future::pending().await,
                    }
                } => {
                    waiting = None;
                    self.resend(answered).await;
                }
            }
        }
    }

    /// Publishes `messages` (in order) as one NATS message, noting every `freed`.
    async fn send(&mut self, messages: &[LifecycleMessage]) {
        let now = Instant::now();
        for message in messages {
            if message.event != LifecycleEvent::Freed {
                continue;
            }
            while self.recent.len() >= MAX_RECENT
                || self
                    .recent
                    .front()
                    .is_some_and(|(at, _)| now.duration_since(*at) > RECENT_WINDOW)
            {
                self.recent.pop_front();
            }
            self.recent.push_back((now, message.request_id.clone()));
        }
        // Fails only when the client is closed; the router then expires the bookings
        // by their TTL.
        if let Err(e) = self.publish(messages).await {
            warn!(messages = messages.len(), error = %e, "lifecycle messages not sent");
        }
    }

    /// One NATS message of `messages`: the single form for one, else a batch.
    async fn publish(
        &self,
        messages: &[LifecycleMessage],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let payload = LifecycleBatch::encode(messages)?;
        self.nats
            .publish(self.subject.clone(), payload.into())
            .await?;
        Ok(())
    }

    /// After a reconnect: if a router `answered`, sends again every `freed` since
    /// shortly before the disconnect.
    async fn resend(&mut self, answered: bool) {
        let Some(disconnected_at) = self.disconnected_at.take() else {
            return;
        };
        if !answered {
            warn!(
                patience_s = ROUTER_PATIENCE.as_secs(),
                "no router answered after the nats reconnect; freed messages of the outage are not re-sent (the router's request TTL frees them)"
            );
            return;
        }
        let since = disconnected_at
            .checked_sub(BEFORE_DISCONNECT)
            .unwrap_or(disconnected_at);
        let again: Vec<RequestId> = self
            .recent
            .iter()
            .filter(|(at, _)| *at >= since)
            .map(|(_, id)| id.clone())
            .collect();
        info!(
            freed = again.len(),
            "a router answers again after the nats reconnect; re-sending the outage's freed messages"
        );
        let again: Vec<LifecycleMessage> = again
            .into_iter()
            .map(|request_id| LifecycleMessage {
                request_id,
                event: LifecycleEvent::Freed,
            })
            .collect();
        for batch in again.chunks(self.max_batch) {
            if let Err(e) = self.publish(batch).await {
                warn!(error = %e, "freed messages not re-sent");
                return;
            }
        }
    }
}

/// `first` and every message already queued behind it, up to `max` in all, in order. Never waits for more: under load the queue fills
/// while the previous batch is published, at low load a batch is one message.
fn drain_queued(
    first: LifecycleMessage,
    queue: &mut mpsc::UnboundedReceiver<LifecycleMessage>,
    max: usize,
) -> Vec<LifecycleMessage> {
    let mut batch = vec![first];
    while batch.len() < max {
        match queue.try_recv() {
            Ok(message) => batch.push(message),
            Err(_) => break, // empty, or closed: the next `recv` ends the task
        }
    }
    batch
}

/// Whether a router answers a probe within [`ROUTER_PATIENCE`], asking with backoff.
async fn router_answers(nats: Client, subjects: Subjects) -> bool {
    let backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(2))
        .without_max_times()
        .with_total_delay(Some(ROUTER_PATIENCE));
    (|| async {
        if super::probe(&nats, &subjects).await {
            Ok(())
        } else {
            Err(())
        }
    })
    .retry(backoff)
    .await
    .is_ok()
}
