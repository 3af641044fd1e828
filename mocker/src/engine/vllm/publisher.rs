//! One rank's vLLM-style ZMQ publisher: a PUB socket for live batches and a ROUTER
//! socket answering replay requests from a bounded buffer, as
//! `vllm.distributed.kv_events.ZmqEventPublisher` (0.28 and later) does.
//!
//! - live: `[topic, seq (8 bytes BE), payload]` per batch, `seq` from 0, +1 per batch;
//! - replay: a DEALER sends `["", start_seq (8 bytes BE)]`; the ROUTER answers one
//!   `["", topic, seq, payload]` per buffered batch with `seq >= start_seq`, then
//!   `["", "", ff×8, ""]`. Malformed requests are logged and ignored, as vLLM does.
//!
//! One task owns both sockets and the buffer (like vLLM's publisher thread), so seq
//! numbering, buffering and sending stay in one order without locks. The rank hands
//! it encoded payloads through an unbounded channel (a synchronous, non-blocking send,
//! safe under the rank's lock); the buffer keeps the last `buffer_steps` batches.
//! PUB drops batches for subscribers that are not connected, exactly as with vLLM; a
//! relay fills the hole from the replay socket.

use bytes::Bytes;
use kv_events::DpRank;
use std::collections::VecDeque;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The seq of the replay end marker (`-1` as a signed 64-bit integer).
const END_SEQ: [u8; 8] = [0xff; 8];

/// Why a rank's sockets could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("could not bind zmq socket {endpoint}: {source}")]
pub struct BindError {
    /// The endpoint tried.
    pub endpoint: String,
    /// The socket error.
    pub source: zeromq::ZmqError,
}

/// The endpoints one rank bound (ports resolved when 0 was asked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEndpoints {
    /// The PUB socket, `tcp://host:port`.
    pub publish: String,
    /// The replay ROUTER socket, `tcp://host:port`.
    pub replay: String,
}

/// Where and how one rank publishes.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// The PUB endpoint to bind, `tcp://host:port` (port 0: any free port).
    pub publish: String,
    /// The replay endpoint to bind.
    pub replay: String,
    /// The topic frame of every batch.
    pub topic: Bytes,
    /// Batches kept for replay.
    pub buffer_steps: usize,
}

/// The rank's handle: enqueue an encoded batch.
#[derive(Debug, Clone)]
pub struct VllmPublisher {
    dp_rank: DpRank,
    tx: mpsc::UnboundedSender<Bytes>,
}

impl VllmPublisher {
    /// Binds the rank's sockets and spawns the task that serves them until
    /// `shutdown`; returns the handle and the bound endpoints.
    ///
    /// # Errors
    /// [`BindError`] when a socket cannot bind.
    pub async fn start(
        dp_rank: DpRank,
        config: PublisherConfig,
        shutdown: CancellationToken,
    ) -> Result<(Self, RankEndpoints, tokio::task::JoinHandle<()>), BindError> {
        let mut publisher = PubSocket::new();
        let publish = bind(&mut publisher, &config.publish).await?;
        let mut router = RouterSocket::new();
        let replay = bind(&mut router, &config.replay).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let task = Task {
            publisher,
            router,
            topic: config.topic,
            buffer: VecDeque::new(),
            buffer_steps: config.buffer_steps.max(1),
            next_seq: 0,
        };
        let handle = tokio::spawn(task.run(rx, shutdown));
        Ok((
            Self { dp_rank, tx },
            RankEndpoints { publish, replay },
            handle,
        ))
    }

    /// The rank whose batches this publishes.
    pub fn dp_rank(&self) -> DpRank {
        self.dp_rank
    }

    /// Enqueues one encoded batch; it gets the next seq.
    pub fn send(&self, payload: Vec<u8>) {
        if self.tx.send(Bytes::from(payload)).is_err() {
            debug!(dp_rank = %self.dp_rank, "zmq publisher stopped, batch dropped");
        }
    }
}

async fn bind(socket: &mut impl Socket, endpoint: &str) -> Result<String, BindError> {
    socket
        .bind(endpoint)
        .await
        .map(|e| e.to_string())
        .map_err(|source| BindError {
            endpoint: endpoint.to_owned(),
            source,
        })
}

struct Task {
    publisher: PubSocket,
    router: RouterSocket,
    topic: Bytes,
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
    next_seq: u64,
}

fn message(frames: Vec<Bytes>) -> Option<ZmqMessage> {
    ZmqMessage::try_from(frames).ok()
}

impl Task {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Bytes>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                payload = rx.recv() => match payload {
                    Some(payload) => self.publish(payload).await,
                    None => break,
                },
                request = self.router.recv() => match request {
                    Ok(request) => self.replay(request.into_vec()).await,
                    Err(err) => warn!(%err, "zmq replay socket failed"),
                },
            }
        }
        // What the rank enqueued before it stopped still goes out.
        while let Ok(payload) = rx.try_recv() {
            self.publish(payload).await;
        }
    }

    async fn publish(&mut self, payload: Bytes) {
        let seq = self.next_seq;
        self.next_seq += 1;
        if self.buffer.len() == self.buffer_steps {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload.clone()));
        let frames = vec![self.topic.clone(), seq_frame(seq), payload];
        if let Some(msg) = message(frames)
            && let Err(err) = self.publisher.send(msg).await
        {
            warn!(seq, %err, "zmq publish failed");
        }
    }

    /// Answers `[identity, "", start_seq]`.
    async fn replay(&mut self, frames: Vec<Bytes>) {
        let [identity, delimiter, start]: [Bytes; 3] = match frames.try_into() {
            Ok(f) => f,
            Err(f) => {
                warn!(frames = f.len(), "invalid replay request ignored");
                return;
            }
        };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]).map(u64::from_be_bytes) else {
            warn!(bytes = start.len(), "replay request with a bad seq ignored");
            return;
        };
        if !delimiter.is_empty() {
            warn!("replay request without an empty delimiter ignored");
            return;
        }
        let replies: Vec<Vec<Bytes>> = self
            .buffer
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .map(|(seq, payload)| {
                vec![
                    identity.clone(),
                    Bytes::new(),
                    self.topic.clone(),
                    seq_frame(*seq),
                    payload.clone(),
                ]
            })
            .chain(std::iter::once(vec![
                identity.clone(),
                Bytes::new(),
                Bytes::new(),
                Bytes::from_static(&END_SEQ),
                Bytes::new(),
            ]))
            .collect();
        for frames in replies {
            if let Some(msg) = message(frames)
                && let Err(err) = self.router.send(msg).await
            {
                warn!(%err, "zmq replay reply failed");
                return;
            }
        }
    }
}

fn seq_frame(seq: u64) -> Bytes {
    Bytes::copy_from_slice(&seq.to_be_bytes())
}
