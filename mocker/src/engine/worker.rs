//! One mock worker's request intake: its generate, clear and KV event recovery
//! subscriptions.
//!
//! A worker owns `dp_size` [`Rank`]s. Generate requests are decoded and handed to the
//! rank named by their `dp_rank`; anything malformed is answered with an `error`
//! response (or logged, when there is no reply subject) — network input never panics.
//! Clear requests lock every rank at once so the cache is dropped only if the whole
//! worker is idle. Cost: one msgpack decode per message.

use super::journal::{self, WorkerJournal};
use super::outbox::Outbox;
use super::rank::Rank;
use crate::protocol::{ClearReply, GenerateRequest, GenerateResponse};
use async_nats::{Message, Subscriber};
use futures::StreamExt;
use kv_events::WorkerId;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// One worker: its id, ranks and outbox.
#[derive(Debug)]
pub(super) struct Worker {
    id: WorkerId,
    ranks: Vec<Arc<Rank>>,
    outbox: Outbox,
    journal: WorkerJournal,
}

impl Worker {
    /// A worker serving `ranks` (index = dp_rank), whose KV events `journal` records.
    pub fn new(
        id: WorkerId,
        ranks: Vec<Arc<Rank>>,
        outbox: Outbox,
        journal: WorkerJournal,
    ) -> Self {
        Self {
            id,
            ranks,
            outbox,
            journal,
        }
    }

    /// Answers generate, clear and recovery messages until `shutdown` or until a
    /// subscription ends, then unsubscribes.
    pub async fn serve(
        &self,
        mut generate: Subscriber,
        mut clear: Subscriber,
        mut recovery: Subscriber,
        shutdown: CancellationToken,
    ) {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                msg = generate.next() => match msg {
                    Some(msg) => self.handle_generate(msg),
                    None => break,
                },
                msg = clear.next() => match msg {
                    Some(msg) => self.handle_clear(msg),
                    None => break,
                },
                msg = recovery.next() => match msg {
                    Some(msg) => journal::answer(&self.journal, &self.outbox, msg),
                    None => break,
                },
            }
        }
        for sub in [&mut generate, &mut clear, &mut recovery] {
            if let Err(err) = sub.unsubscribe().await {
                debug!(worker_id = %self.id, %err, "unsubscribe failed");
            }
        }
    }

    /// Decodes a generate request and queues it on its rank.
    pub fn handle_generate(&self, msg: Message) {
        let Some(reply) = msg.reply else {
            warn!(worker_id = %self.id, "generate request without reply subject dropped");
            return;
        };
        let req: GenerateRequest = match kv_events::decode(&msg.payload) {
            Ok(req) => req,
            Err(err) => {
                let message = format!("malformed generate request: {err}");
                self.outbox
                    .send(reply, &GenerateResponse::Error { message });
                return;
            }
        };
        let Some(rank) = self.ranks.get(req.dp_rank.0 as usize) else {
            let message = format!(
                "dp_rank {} out of range (worker {} has dp_size {})",
                req.dp_rank,
                self.id,
                self.ranks.len()
            );
            self.outbox
                .send(reply, &GenerateResponse::Error { message });
            return;
        };
        rank.submit(req.into(), reply);
    }

    /// Clears every rank's cache if the whole worker is idle; replies `cleared` or
    /// `busy`. The body of a clear request is ignored.
    pub fn handle_clear(&self, msg: Message) {
        let reply = self.clear();
        match msg.reply {
            Some(subject) => self.outbox.send(subject, &reply),
            None => debug!(worker_id = %self.id, ?reply, "clear without reply subject"),
        }
    }

    /// Clears all ranks atomically (see [`super::rank::clear_all`]).
    pub fn clear(&self) -> ClearReply {
        super::rank::clear_all(&self.ranks)
    }
}
