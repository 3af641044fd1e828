//! The mock engine's side of KV event ordering and recovery: one
//! [`EventJournal`] per worker, shared by its dp ranks.
//!
//! Every KV event a rank publishes is numbered and remembered by the worker's
//! journal (ring buffer of recent events plus the set of held blocks), and every
//! batch carries the worker's epoch: the time the engines started, in microseconds,
//! so a restarted engine is recognised. The worker answers
//! `{ns}.kv.recovery.{worker_id}` requests from the journal ([`answer`]): the missing
//! events, or a dump of its blocks, in chunks published to the request's reply inbox.
//!
//! Lock order: a rank's state lock, then the journal lock (recording happens while
//! the rank publishes); the recovery handler takes only the journal lock. Cost: one
//! short lock per published batch and per recovery request; the ring holds
//! [`kv_events::journal::JournalConfig::ring_capacity`] events per rank.

use super::outbox::Outbox;
use async_nats::Message;
use kv_events::journal::EventJournal;
use kv_events::{DpRank, KvCacheEventData, KvEventBatch};
use std::sync::{Arc, Mutex, MutexGuard};
use tracing::warn;

/// One worker's journal, shared by its ranks and its recovery handler.
#[derive(Debug, Clone)]
pub(super) struct WorkerJournal(Arc<Mutex<EventJournal>>);

impl WorkerJournal {
    /// Wraps a fresh journal.
    pub fn new(journal: EventJournal) -> Self {
        Self(Arc::new(Mutex::new(journal)))
    }

    /// Locks the journal. A poisoned lock is recovered: the journal is plain data and
    /// each of its methods leaves it consistent.
    pub fn lock(&self) -> MutexGuard<'_, EventJournal> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Numbers and records `events` of `dp_rank`; returns the batch to publish.
    pub fn record(&self, dp_rank: DpRank, events: Vec<KvCacheEventData>) -> KvEventBatch {
        self.lock().record_batch(dp_rank, events)
    }
}

/// Answers one recovery request: the reply chunks go, in order, to the request's
/// reply inbox through the outbox. A request without a reply subject is logged and
/// dropped; a malformed one gets an `error` chunk.
pub(super) fn answer(journal: &WorkerJournal, outbox: &Outbox, msg: Message) {
    let Some(reply) = msg.reply else {
        warn!(subject = %msg.subject, "recovery request without a reply subject dropped");
        return;
    };
    let chunks = journal.lock().answer(&msg.payload);
    for chunk in &chunks {
        outbox.send(reply.clone(), chunk);
    }
}
