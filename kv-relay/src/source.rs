//! One engine socket: a ZMQ SUB connection to the engine's PUB endpoint, sequence
//! checking, gap filling from the replay socket, and payload decoding. Emits
//! [`SourceMsg`]s in stream order to the relay's single publishing task.
//!
//! Per message: parse `[topic, seq, payload]` → [`SeqTracker::observe`] →
//! - in order: decode and forward;
//! - duplicate (already replayed): drop;
//! - gap `from..seq`: read `from..seq` from the replay socket ([`crate::replay`]:
//!   re-asked from the first missing batch when the engine's reply drops some) and
//!   forward it in order; if the engine no longer has some of it, or the read ends
//!   without it, ask for a reset of the socket's ranks ([`ResetReason::Gap`]) and go
//!   on from what follows (a picture with a hole could hide a removal of a block we
//!   would then believe cached);
//! - seq going backwards: the engine restarted, reset ([`ResetReason::Restart`]), then
//!   handle `seq` as a stream start (a gap from 0 unless it is 0).
//!
//! On connect (the first one, and every reconnect) the socket reads the engine's whole
//! replay buffer (from seq 0) before any live batch, so the engine's cached blocks
//! reach the router at once, not at the engine's next batch: an idle engine may
//! publish nothing for a long time. If the buffer still starts at seq 0 every batch
//! is forwarded; if it starts later, what it holds is, from its first batch. A read
//! that ends short (the engine kept dropping its reply, `--replay-max-requests`) is
//! logged and counted, and the relay goes live from there: the next live batch is a
//! gap, filled by the rule above. Live batches the read already covered are then
//! duplicates. A batch the engine publishes after the buffer was read but before the
//! subscription reached it is found missing, as a gap, at the next batch.
//!
//! A reconnect of the socket (the engine went away and came back) is treated like a
//! restart: the engine stream carries no process identity, so a reconnect cannot be
//! told apart from a new engine whose seq already passed ours. Undecodable payloads
//! are counted, logged with the endpoint and seq, and skipped; the stream goes on.
//! Connecting and reconnecting is [`crate::connect`]'s: tries at most
//! `--reconnect-max-backoff-ms` apart.

use crate::config::RankEndpoint;
use crate::connect::{Connected, SourceError, connect};
use crate::counters::RelayCounters;
use crate::frames::{SeqStep, SeqTracker, parse_live};
use crate::replay::{ReadOutcome, ReplayPolicy, ReplayRead, Round};
use bytes::Bytes;
use futures::StreamExt;
use kv_events::engines::{EngineBatch, decode_batch};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use zeromq::{SocketEvent, SocketRecv};

/// Why the ranks of a socket are cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetReason {
    /// The engine's seq went backwards.
    Restart,
    /// The socket reconnected.
    Reconnect,
    /// A gap could not be filled from the replay socket.
    Gap,
}

impl ResetReason {
    /// Label for logs and metrics.
    pub fn label(self) -> &'static str {
        match self {
            ResetReason::Restart => "restart",
            ResetReason::Reconnect => "reconnect",
            ResetReason::Gap => "gap",
        }
    }
}

/// What a socket task tells the publishing task, in stream order.
#[derive(Debug)]
pub enum SourceMsg {
    /// A decoded batch, in seq order.
    Batch {
        /// Index of the socket in the config.
        socket: usize,
        /// Engine seq of the batch.
        seq: u64,
        /// The batch.
        batch: EngineBatch,
    },
    /// Forget the socket's ranks: publish `cleared` for them.
    Reset {
        /// Index of the socket.
        socket: usize,
        /// Why.
        reason: ResetReason,
    },
    /// The socket is connected to the engine.
    Connected {
        /// Index of the socket.
        socket: usize,
    },
    /// The socket lost the engine.
    Disconnected {
        /// Index of the socket.
        socket: usize,
    },
}

/// One engine socket's reader.
pub struct Source {
    /// Index of the socket in the config.
    pub socket: usize,
    /// Endpoints.
    pub endpoint: RankEndpoint,
    /// ZMQ subscription prefix.
    pub topic: String,
    /// How the replay socket is read.
    pub replay: ReplayPolicy,
    /// Longest wait between two connection attempts.
    pub reconnect_max_backoff: Duration,
    /// Where to send what was read.
    pub tx: mpsc::Sender<SourceMsg>,
    /// Metrics.
    pub counters: RelayCounters,
}

impl Source {
    /// Connects (waiting as long as it takes for the engine to come up), reads until
    /// the engine goes away, connects again, and so on until `shutdown`.
    ///
    /// # Errors
    /// [`SourceError`] when the endpoint is unusable (not when the engine is down).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), SourceError> {
        let mut tracker = SeqTracker::new();
        let mut ever_connected = false;
        loop {
            let connected = connect(
                &self.endpoint.publish,
                &self.topic,
                self.reconnect_max_backoff,
                &shutdown,
            )
            .await?;
            let Some(Connected {
                mut socket,
                mut monitor,
            }) = connected
            else {
                return Ok(());
            };
            if ever_connected {
                info!(endpoint = %self.endpoint.publish, "engine socket reconnected; treating as a restart");
                tracker.reset();
                self.send(SourceMsg::Reset {
                    socket: self.socket,
                    reason: ResetReason::Reconnect,
                })
                .await;
            } else {
                info!(endpoint = %self.endpoint.publish, topic = %self.topic, "subscribed to engine kv events");
            }
            ever_connected = true;
            self.send(SourceMsg::Connected {
                socket: self.socket,
            })
            .await;
            // A read of the replay socket may take several requests: a shutdown does
            // not wait for it (nor for a gap's, below).
            if shutdown
                .run_until_cancelled(self.catch_up(&mut tracker))
                .await
                .is_none()
            {
                return Ok(());
            }
            loop {
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => return Ok(()),
                    event = monitor.next() => match event {
                        Some(SocketEvent::Disconnected(_)) | None => break,
                        Some(_) => {}
                    },
                    message = socket.recv() => match message {
                        Ok(message) => {
                            let handled = self.on_message(message.into_vec(), &mut tracker);
                            if shutdown.run_until_cancelled(handled).await.is_none() {
                                return Ok(());
                            }
                        }
                        // A peer error: the monitor reports the disconnect.
                        Err(e) => debug!(endpoint = %self.endpoint.publish, error = %e, "engine socket receive failed"),
                    },
                }
            }
            warn!(endpoint = %self.endpoint.publish, "engine socket disconnected");
            self.send(SourceMsg::Disconnected {
                socket: self.socket,
            })
            .await;
            // Dropping the socket stops its own reconnect task: `connect` reconnects.
            drop(socket);
        }
    }

    async fn send(&self, msg: SourceMsg) {
        // The publishing task outlives the sources; a send error means shutdown.
        let _ = self.tx.send(msg).await;
    }

    async fn on_message(&self, frames: Vec<Bytes>, tracker: &mut SeqTracker) {
        let frame = match parse_live(frames) {
            Ok(frame) => frame,
            Err(e) => {
                self.counters.frame("malformed");
                warn!(endpoint = %self.endpoint.publish, error = %e, "engine message with bad framing skipped");
                return;
            }
        };
        match tracker.observe(frame.seq) {
            SeqStep::Apply => self.deliver(frame.seq, &frame.payload, tracker).await,
            SeqStep::Duplicate => self.counters.frame("duplicate"),
            SeqStep::Gap { from } => self.fill(from, frame.seq, &frame.payload, tracker).await,
            SeqStep::Restarted => {
                warn!(endpoint = %self.endpoint.publish, seq = frame.seq, "engine seq went backwards: engine restarted");
                self.send(SourceMsg::Reset {
                    socket: self.socket,
                    reason: ResetReason::Restart,
                })
                .await;
                if frame.seq == 0 {
                    self.deliver(0, &frame.payload, tracker).await;
                } else {
                    self.fill(0, frame.seq, &frame.payload, tracker).await;
                }
            }
        }
    }

    /// Reads the engine's whole replay buffer right after the socket connected and
    /// delivers it (see the module docs); `tracker` is a fresh stream's.
    async fn catch_up(&self, tracker: &mut SeqTracker) {
        let Some(endpoint) = &self.endpoint.replay else {
            return;
        };
        let mut read = ReplayRead::new(endpoint, 0, None, self.replay);
        let (mut delivered, mut late_start) = (0u64, false);
        while let Some(round) = read.next_round().await {
            self.count_request(&round);
            if let Some(skipped) = &round.skipped {
                if delivered == 0 {
                    late_start = true;
                    warn!(endpoint = %self.endpoint.publish, first = skipped.end,
                        "the engine's replay buffer no longer starts at seq 0; applying it from its first batch");
                } else {
                    self.counters.gap("cleared");
                    self.reset_for_gap(skipped.start, skipped.end).await;
                }
            }
            delivered += round.batches.len() as u64;
            self.deliver_all(round.batches, tracker).await;
        }
        let requests = read.requests();
        let result = match read.outcome() {
            Some(ReadOutcome::Complete) if delivered == 0 => "empty",
            Some(ReadOutcome::Complete) if late_start => "partial",
            Some(ReadOutcome::Complete) => "complete",
            Some(ReadOutcome::Failed(reason)) => {
                warn!(endpoint = %self.endpoint.publish, %reason, "reading the engine's replay buffer at connect failed; waiting for its next batch");
                "failed"
            }
            Some(incomplete) => {
                self.missing(incomplete, requests, "at connect");
                "incomplete"
            }
            None => "failed", // The read is over once it yields no more rounds.
        };
        self.counters.connect_replay(result);
        info!(endpoint = %self.endpoint.publish, batches = delivered, requests, result, "engine replay buffer read at connect");
    }

    /// Fills `from..to` from the replay socket, then delivers live batch `to`.
    async fn fill(&self, from: u64, to: u64, live: &Bytes, tracker: &mut SeqTracker) {
        let mut cleared = false;
        let failure = match &self.endpoint.replay {
            Some(endpoint) => {
                let mut read = ReplayRead::new(endpoint, from, Some(to), self.replay);
                while let Some(round) = read.next_round().await {
                    self.count_request(&round);
                    if let Some(skipped) = &round.skipped {
                        self.clear(&mut cleared, skipped.start, skipped.end).await;
                    }
                    self.deliver_all(round.batches, tracker).await;
                }
                let requests = read.requests();
                match read.outcome() {
                    Some(ReadOutcome::Complete) => None,
                    Some(ReadOutcome::Failed(reason)) => Some(reason.clone()),
                    Some(incomplete) => {
                        self.missing(incomplete, requests, "for a gap");
                        Some("the read ended short".to_owned())
                    }
                    None => Some("the read ended short".to_owned()),
                }
            }
            None => Some("no --replay-endpoint".to_owned()),
        };
        match failure {
            None if !cleared => {
                self.counters.gap("filled");
                debug!(endpoint = %self.endpoint.publish, from, to, "gap filled from the replay socket");
            }
            None => {}
            Some(reason) => {
                let unread = tracker.last_applied().map_or(from, |a| a + 1).max(from);
                warn!(endpoint = %self.endpoint.publish, from = unread, to, %reason, "gap cannot be filled from the replay socket");
                // Even after a clear for an earlier part: what was applied since may
                // precede this hole.
                self.clear(&mut cleared, unread, to).await;
            }
        }
        self.deliver(to, live, tracker).await;
    }

    /// Clears the socket's ranks: batches `from..to` cannot be had. The gap is counted
    /// `cleared` once, however often it clears.
    async fn clear(&self, counted: &mut bool, from: u64, to: u64) {
        if !std::mem::replace(counted, true) {
            self.counters.gap("cleared");
        }
        self.reset_for_gap(from, to).await;
    }

    /// Asks for a reset of the socket's ranks: batches `from..to` cannot be had.
    async fn reset_for_gap(&self, from: u64, to: u64) {
        warn!(endpoint = %self.endpoint.publish, from, to, "the engine's batches in this range cannot be had; clearing the socket's ranks");
        self.send(SourceMsg::Reset {
            socket: self.socket,
            reason: ResetReason::Gap,
        })
        .await;
    }

    /// Logs and counts what a read that ended short left unread.
    fn missing(&self, outcome: &ReadOutcome, requests: u32, when: &str) {
        let known = outcome.known_missing();
        self.counters.replay_missing(known);
        if let ReadOutcome::Incomplete { next, seen, reason } = outcome {
            warn!(endpoint = %self.endpoint.publish, next, ?seen, known_missing = known, requests, %reason,
                "the engine's replay {when} ended short; going on from seq {next}: the next live batch fills the rest as a gap");
        }
    }

    fn count_request(&self, round: &Round) {
        self.counters.replay_request(round.stop.label());
        if let crate::replay::Stop::Failed(e) = &round.stop {
            debug!(endpoint = %self.endpoint.publish, error = %e, "replay request failed");
        }
    }

    async fn deliver_all(&self, batches: Vec<(u64, Bytes)>, tracker: &mut SeqTracker) {
        for (seq, payload) in batches {
            self.deliver(seq, &payload, tracker).await;
        }
    }

    async fn deliver(&self, seq: u64, payload: &[u8], tracker: &mut SeqTracker) {
        tracker.applied(seq);
        match decode_batch(payload) {
            Ok(batch) => {
                self.counters.frame("ok");
                self.send(SourceMsg::Batch {
                    socket: self.socket,
                    seq,
                    batch,
                })
                .await;
            }
            Err(e) => {
                self.counters.frame("malformed");
                warn!(endpoint = %self.endpoint.publish, seq, error = %e, "undecodable engine payload skipped");
            }
        }
    }
}
