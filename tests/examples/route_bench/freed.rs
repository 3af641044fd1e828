//! The frontend's lifecycle publisher, built like the gateway's
//! (`kv-gateway/src/router/lifecycle.rs`): frontend tasks queue their `freed`s, and one
//! task publishes, at each wake-up, everything queued by then as one NATS message (a
//! `LifecycleBatch`, or the single form for one message), never waiting to fill a
//! batch. `--lifecycle single` publishes one NATS message per `freed` from the same
//! task instead, for daemons that predate the batch form.

use clap::ValueEnum;
use kv_events::limits::MAX_LIFECYCLE_BATCH;
use kv_events::routing::{LifecycleBatch, LifecycleMessage};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::mpsc;

/// How the frontend publishes its lifecycle messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum LifecycleForm {
    /// Everything queued at a wake-up in one NATS message, as the gateway does.
    Batch,
    /// One NATS message per lifecycle message (daemons before the batch form).
    Single,
}

/// What the publisher sent: lifecycle messages, and the NATS messages carrying them.
#[derive(Default)]
pub(crate) struct Sent {
    messages: AtomicU64,
    nats_messages: AtomicU64,
}

impl Sent {
    /// Prints how many lifecycle messages went out in how many NATS messages, as
    /// published in `form`.
    pub(crate) fn report(&self, form: LifecycleForm) {
        let messages = self.messages.load(Ordering::Relaxed);
        let nats_messages = self.nats_messages.load(Ordering::Relaxed);
        println!(
            "\nfreed: {messages} lifecycle messages in {nats_messages} NATS messages ({:.1} per message, `--lifecycle {form:?}`)",
            messages as f64 / nats_messages.max(1) as f64,
        );
    }
}

/// Starts the publisher on `subject`, counting into `sent`; it ends when every sender
/// is dropped.
pub(crate) fn spawn(
    nats: async_nats::Client,
    subject: String,
    form: LifecycleForm,
    sent: Arc<Sent>,
) -> mpsc::UnboundedSender<LifecycleMessage> {
    let (tx, mut queue) = mpsc::unbounded_channel::<LifecycleMessage>();
    tokio::spawn(async move {
        let mut batch = Vec::new();
        while let Some(first) = queue.recv().await {
            batch.clear();
            batch.push(first);
            while batch.len() < MAX_LIFECYCLE_BATCH
                && let Ok(message) = queue.try_recv()
            {
                batch.push(message);
            }
            let chunk = match form {
                LifecycleForm::Batch => batch.len(),
                LifecycleForm::Single => 1,
            };
            for messages in batch.chunks(chunk) {
                let payload = LifecycleBatch::encode(messages)?;
                nats.publish(subject.clone(), payload.into()).await?;
                sent.messages
                    .fetch_add(messages.len() as u64, Ordering::Relaxed);
                sent.nats_messages.fetch_add(1, Ordering::Relaxed);
            }
        }
        anyhow::Ok(())
    });
    tx
}
