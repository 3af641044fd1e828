//! One engine socket: a ZMQ SUB connection to the engine's PUB endpoint, sequence
//! checking, gap filling from the replay socket, and payload decoding. Emits
//! [`SourceMsg`]s in stream order to the relay's single publishing task.
//!
//! Per message: parse `[topic, seq, payload]` → [`SeqTracker::observe`] →
//! - in order: decode and forward;
//! - duplicate (already replayed): drop;
//! - gap `from..seq`: fetch from the replay socket; if the engine still has every
//!   missing batch, forward them, else ask for a reset of the socket's ranks
//!   ([`ResetReason::Gap`]) and forward the longest run of replayed batches that ends
//!   right before `seq` (a contiguous suffix cannot hide a removal of a block we
//!   would then believe cached);
//! - seq going backwards: the engine restarted, reset ([`ResetReason::Restart`]), then
//!   handle `seq` as a stream start (a gap from 0 unless it is 0).
//!
//! On connect (the first one, and every reconnect) the socket reads the engine's whole
//! replay buffer (`["", seq 0]`) before any live batch, so the engine's cached blocks
//! reach the router at once, not at the engine's next batch: an idle engine may
//! publish nothing for a long time. If the buffer still starts at seq 0 every batch
//! is forwarded; if it starts later, the contiguous run that ends at its newest batch
//! is (what the gap rule below keeps). Live batches the replay already covered are
//! then duplicates; a failed read leaves the start to the gap rule. A batch the engine
//! publishes after the buffer was read but before the subscription reached it is
//! found missing, as a gap, at the next batch.
//!
//! A reconnect of the socket (the engine went away and came back) is treated like a
//! restart: the engine stream carries no process identity, so a reconnect cannot be
//! told apart from a new engine whose seq already passed ours. Undecodable payloads
//! are counted, logged with the endpoint and seq, and skipped; the stream goes on.
//! The zeromq SUB socket reconnects by itself (100 ms backoff doubling to 30 s).

use crate::config::RankEndpoint;
use crate::counters::RelayCounters;
use crate::frames::{SeqStep, SeqTracker, parse_live};
use crate::replay;
use bytes::Bytes;
use futures::StreamExt;
use kv_events::engines::{EngineBatch, decode_batch};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SubSocket};

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
    /// Replay time limit.
    pub replay_timeout: Duration,
    /// Where to send what was read.
    pub tx: mpsc::Sender<SourceMsg>,
    /// Metrics.
    pub counters: RelayCounters,
}

/// A socket task failed to start.
#[derive(Debug, thiserror::Error)]
#[error("engine socket {endpoint}: {source}")]
pub struct SourceError {
    /// The PUB endpoint.
    pub endpoint: String,
    /// The cause.
    pub source: zeromq::ZmqError,
}

impl Source {
    /// Connects (waiting as long as it takes for the engine to come up) and reads
    /// until `shutdown`.
    ///
    /// # Errors
    /// [`SourceError`] when the endpoint is unusable (not when the engine is down).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), SourceError> {
        let err = |source| SourceError {
            endpoint: self.endpoint.publish.clone(),
            source,
        };
        let mut options = SocketOptions::default();
        options.no_connect_timeout();
        let mut sub = SubSocket::with_options(options);
        let mut monitor = sub.monitor();
        sub.subscribe(&self.topic).await.map_err(err)?;
        tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            connected = sub.connect(&self.endpoint.publish) => connected.map_err(err)?,
        }
        info!(endpoint = %self.endpoint.publish, topic = %self.topic, "subscribed to engine kv events");
        let mut tracker = SeqTracker::new();
        let mut ever_connected = false;
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return Ok(()),
                event = monitor.next() => match event {
                    Some(SocketEvent::Connected(..)) => {
                        if ever_connected {
                            info!(endpoint = %self.endpoint.publish, "engine socket reconnected; treating as a restart");
                            tracker.reset();
                            self.send(SourceMsg::Reset { socket: self.socket, reason: ResetReason::Reconnect }).await;
                        }
                        ever_connected = true;
                        self.send(SourceMsg::Connected { socket: self.socket }).await;
                        self.catch_up(&mut tracker).await;
                    }
                    Some(SocketEvent::Disconnected(_)) => {
                        warn!(endpoint = %self.endpoint.publish, "engine socket disconnected");
                        self.send(SourceMsg::Disconnected { socket: self.socket }).await;
                    }
                    Some(_) => {}
                    None => return Ok(()),
                },
                message = sub.recv() => match message {
                    Ok(message) => self.on_message(message.into_vec(), &mut tracker).await,
                    // A peer error: the socket reconnects by itself.
                    Err(e) => debug!(endpoint = %self.endpoint.publish, error = %e, "engine socket receive failed"),
                },
            }
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
        let replayed = match replay::fetch(endpoint, 0, self.replay_timeout).await {
            Ok(batches) => batches,
            Err(e) => {
                self.counters.connect_replay("failed");
                warn!(error = %e, "reading the engine's replay buffer at connect failed; waiting for its next batch");
                return;
            }
        };
        let Some(newest) = replayed.iter().map(|(seq, _)| *seq).max() else {
            self.counters.connect_replay("empty");
            debug!(endpoint = %self.endpoint.publish, "the engine's replay buffer is empty");
            return;
        };
        let batches = match replay::covering(&replayed, 0, newest + 1) {
            Some(all) => {
                self.counters.connect_replay("complete");
                all
            }
            None => {
                self.counters.connect_replay("partial");
                warn!(endpoint = %self.endpoint.publish, newest, replayed = replayed.len(), "the engine's replay buffer no longer starts at seq 0; applying its newest contiguous run");
                contiguous_suffix(&replayed, newest + 1)
            }
        };
        info!(endpoint = %self.endpoint.publish, batches = batches.len(), newest, "engine replay buffer read at connect");
        for (seq, payload) in batches {
            self.deliver(seq, &payload, tracker).await;
        }
    }

    /// Fills `from..to` from the replay socket, then delivers live batch `to`.
    async fn fill(&self, from: u64, to: u64, live: &Bytes, tracker: &mut SeqTracker) {
        let replayed = match &self.endpoint.replay {
            Some(endpoint) => match replay::fetch(endpoint, from, self.replay_timeout).await {
                Ok(batches) => batches,
                Err(e) => {
                    warn!(error = %e, from, to, "replay failed");
                    Vec::new()
                }
            },
            None => Vec::new(),
        };
        if let Some(batches) = replay::covering(&replayed, from, to) {
            self.counters.gap("filled");
            debug!(endpoint = %self.endpoint.publish, from, to, "gap filled from the replay socket");
            for (seq, payload) in batches {
                self.deliver(seq, &payload, tracker).await;
            }
        } else {
            self.counters.gap("cleared");
            warn!(endpoint = %self.endpoint.publish, from, to, replayed = replayed.len(), "gap cannot be filled; clearing the socket's ranks");
            self.send(SourceMsg::Reset {
                socket: self.socket,
                reason: ResetReason::Gap,
            })
            .await;
            for (seq, payload) in contiguous_suffix(&replayed, to) {
                self.deliver(seq, &payload, tracker).await;
            }
        }
        self.deliver(to, live, tracker).await;
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

/// The longest run of consecutive seqs in `replayed` that ends at `to - 1`.
fn contiguous_suffix(replayed: &[(u64, Bytes)], to: u64) -> Vec<(u64, Bytes)> {
    let mut before: Vec<&(u64, Bytes)> = replayed.iter().filter(|(s, _)| *s < to).collect();
    before.sort_by_key(|(s, _)| *s);
    before.dedup_by_key(|(s, _)| *s);
    let mut start = before.len();
    let mut expected = to;
    while start > 0 && before[start - 1].0 + 1 == expected {
        start -= 1;
        expected -= 1;
    }
    before[start..].iter().map(|b| (*b).clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_run_ending_before_the_live_seq_is_kept() {
        let b = |s: u64| (s, Bytes::from(vec![s as u8]));
        let seqs = |v: Vec<(u64, Bytes)>| v.into_iter().map(|x| x.0).collect::<Vec<_>>();
        assert_eq!(
            seqs(contiguous_suffix(&[b(3), b(5), b(6), b(7), b(9)], 8)),
            vec![5, 6, 7]
        );
        assert!(
            contiguous_suffix(&[b(3), b(5)], 8).is_empty(),
            "7 is missing"
        );
        assert!(contiguous_suffix(&[], 8).is_empty());
    }
}
