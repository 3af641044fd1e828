//! The relay's single publishing task and its recovery responder.
//!
//! Every [`SourceMsg`] of every engine socket goes through one task, which translates
//! engine events ([`Translator`]), numbers them per (worker, dp_rank) in the shared
//! [`EventJournal`] (our own event ids and epoch, so the router's ordering and
//! recovery rules apply exactly as for any publisher), and publishes one
//! [`kv_events::KvEventBatch`] per engine batch on `{ns}.kv.events.{worker_id}`. One
//! task means one publication order. The recovery responder answers
//! `{ns}.kv.recovery.{worker_id}` from the same journal.
//!
//! Start: a `cleared` for every rank, so a router that saw an earlier run of this
//! worker starts from an empty picture. Socket resets (engine restart, reconnect,
//! unfillable gap) publish `cleared` for the socket's ranks. The task also tracks
//! which sockets are connected and reports "engine alive" (at least one) to the
//! lease task.

use crate::counters::RelayCounters;
use crate::facts::EngineFacts;
use crate::source::SourceMsg;
use crate::translate::{Skip, Translator};
use futures::StreamExt;
use kv_events::engines::LocalHashError;
use kv_events::journal::EventJournal;
use kv_events::{DpRank, KvCacheEventData, encode};
use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// The journal shared by the publishing task and the recovery responder.
pub type SharedJournal = Arc<Mutex<EventJournal>>;

fn lock(journal: &SharedJournal) -> std::sync::MutexGuard<'_, EventJournal> {
    // A panic while holding the lock cannot leave the journal half-updated in a way
    // that matters more than stopping the relay would; keep serving.
    journal.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The publishing task's state.
pub struct Publisher {
    /// Engine events → ours.
    pub translator: Translator,
    /// Numbering, ring buffer and held blocks.
    pub journal: SharedJournal,
    /// NATS client.
    pub nats: async_nats::Client,
    /// `{ns}.kv.events.{worker_id}`.
    pub subject: String,
    /// Rank of each socket's batches when they name none; with `shared`, every rank.
    pub socket_ranks: Vec<DpRank>,
    /// Sockets carry every rank.
    pub shared: bool,
    /// Registered ranks: `0..dp_size`.
    pub dp_size: u32,
    /// Metrics.
    pub counters: RelayCounters,
    /// "At least one engine socket is connected", for the lease task.
    pub alive: watch::Sender<bool>,
    /// The engine's KV cache facts: the block size is read from here, or learned
    /// from the first stored event and offered here.
    pub facts: watch::Sender<EngineFacts>,
}

/// Logs each kind of refused engine event once (every one is counted in
/// `kv_relay_engine_events_total`): once per reason, per block size for a block size
/// mismatch, per kind for an unsupported KV cache group. `no_change` is no refusal
/// and logged at debug.
#[derive(Default)]
struct RefusalLog {
    seen: HashSet<String>,
}

impl RefusalLog {
    fn log(&mut self, rank: DpRank, seq: u64, skip: &Skip) {
        let key = match skip {
            Skip::NoChange => {
                debug!(%rank, seq, "engine event changed nothing");
                return;
            }
            Skip::Hashing(LocalHashError::BlockSize { event, .. }) => format!("size {event}"),
            Skip::UnsupportedGroup(why) => format!("group {}", why.kind()),
            other => other.label().to_owned(),
        };
        if !self.seen.insert(key) {
            return;
        }
        let label = skip.label();
        if let Skip::Hashing(LocalHashError::BlockSize { event, expected }) = skip {
            error!(%rank, seq, event_block_size = event, block_size = expected,
                "engine event refused: its block_size {event} differs from the {expected} tokens in use (logged once per size)");
        } else {
            warn!(%rank, seq, outcome = label, reason = %skip,
                "engine event refused (counted in kv_relay_engine_events_total{{outcome=\"{label}\"}}; logged once per reason)");
        }
    }
}

impl Publisher {
    /// Publishes the start `cleared`s, then handles messages until every source has
    /// stopped; finally reports the engine as gone.
    pub async fn run(mut self, mut rx: mpsc::Receiver<SourceMsg>) {
        for rank in 0..self.dp_size {
            self.publish(vec![(DpRank(rank), KvCacheEventData::Cleared)])
                .await;
        }
        let mut connected = BTreeSet::new();
        let mut refusals = RefusalLog::default();
        while let Some(msg) = rx.recv().await {
            match msg {
                SourceMsg::Batch { socket, seq, batch } => {
                    let rank = batch.dp_rank.unwrap_or_else(|| self.socket_ranks[socket]);
                    if rank.0 >= self.dp_size {
                        self.counters.frame("bad_rank");
                        warn!(%rank, dp_size = self.dp_size, seq, "engine batch for a rank outside --dp-size skipped");
                        continue;
                    }
                    // Until the translator has a block size, a size from the metrics
                    // page reaches it before it translates, and one it learns from an
                    // event reaches the facts (and the registration) after; once it
                    // has one, nothing more is exchanged per batch.
                    let unsized_before = self.translator.block_size().is_none();
                    if unsized_before {
                        self.take_page_block_size();
                    }
                    let mut out = Vec::new();
                    for outcome in self.translator.apply_batch(rank, &batch.events) {
                        match outcome.result {
                            Ok(data) => {
                                self.counters.event(outcome.kind, "published");
                                out.extend(data.into_iter().map(|d| (rank, d)));
                            }
                            Err(skip) => {
                                self.counters.event(outcome.kind, skip.label());
                                refusals.log(rank, seq, &skip);
                            }
                        }
                    }
                    if unsized_before {
                        self.offer_event_block_size();
                    }
                    self.publish(out).await;
                }
                SourceMsg::Reset { socket, reason } => {
                    let ranks: Vec<DpRank> = if self.shared {
                        (0..self.dp_size).map(DpRank).collect()
                    } else {
                        vec![self.socket_ranks[socket]]
                    };
                    let mut out = Vec::new();
                    for rank in ranks {
                        self.counters.reset(reason.label());
                        out.push((rank, self.translator.clear(rank)));
                    }
                    self.publish(out).await;
                }
                SourceMsg::Connected { socket } => {
                    connected.insert(socket);
                    self.set_alive(&connected);
                }
                SourceMsg::Disconnected { socket } => {
                    connected.remove(&socket);
                    self.set_alive(&connected);
                }
            }
        }
        self.alive.send_replace(false);
    }

    /// Gives the translator the block size the metrics page stated, if any.
    fn take_page_block_size(&mut self) {
        if let Some(size) = self.facts.borrow().block_size {
            self.translator.learn_block_size(size);
        }
    }

    /// Offers the block size the translator learned from an event to the facts.
    fn offer_event_block_size(&self) {
        if let Some(size) = self.translator.block_size() {
            let learned = self
                .facts
                .send_if_modified(|f| f.block_size.is_none() && f.offer_block_size(size).is_none());
            if learned {
                info!(
                    block_size = size,
                    "block size learned from the engine's events"
                );
            }
        }
    }

    fn set_alive(&self, connected: &BTreeSet<usize>) {
        self.counters.set_connected(connected.len());
        self.alive.send_replace(!connected.is_empty());
    }

    /// Numbers and publishes `events` as one batch (nothing when empty).
    async fn publish(&self, events: Vec<(DpRank, KvCacheEventData)>) {
        if events.is_empty() {
            return;
        }
        let n = events.len();
        let batch = {
            let mut journal = lock(&self.journal);
            let recorded = events
                .into_iter()
                .map(|(rank, data)| journal.record(rank, data))
                .collect();
            journal.batch(recorded)
        };
        match encode(&batch) {
            Ok(bytes) => {
                if let Err(e) = self.nats.publish(self.subject.clone(), bytes.into()).await {
                    // The router recovers the missing ids from the journal.
                    warn!(subject = %self.subject, error = %e, "publishing kv events failed");
                } else {
                    self.counters.published(n);
                }
            }
            Err(e) => warn!(error = %e, "encoding kv events failed"),
        }
    }
}

/// Answers recovery requests from the journal until `shutdown`: each request's reply
/// chunks are published, in order, to its reply inbox.
pub async fn serve_recovery(
    subscriber: async_nats::Subscriber,
    nats: async_nats::Client,
    journal: SharedJournal,
    counters: RelayCounters,
    shutdown: CancellationToken,
) {
    let mut requests = std::pin::pin!(subscriber.take_until(shutdown.cancelled_owned()));
    while let Some(msg) = requests.next().await {
        let Some(reply) = msg.reply else {
            warn!(subject = %msg.subject, "recovery request without a reply inbox skipped");
            continue;
        };
        let chunks = lock(&journal).answer(&msg.payload);
        counters.recovery_request();
        for chunk in chunks {
            match encode(&chunk) {
                Ok(bytes) => {
                    if let Err(e) = nats.publish(reply.clone(), bytes.into()).await {
                        warn!(error = %e, "publishing a recovery reply failed");
                        break;
                    }
                }
                Err(e) => {
                    warn!(error = %e, "encoding a recovery reply failed");
                    break;
                }
            }
        }
    }
}
