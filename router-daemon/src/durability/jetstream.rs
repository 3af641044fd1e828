//! The optional JetStream durability path (`--jetstream`).
//!
//! Publishers keep publishing KV events with core NATS; a JetStream stream whose
//! subjects cover `{ns}.kv.events.>` stores every one of them (the server captures
//! core publishes on covered subjects; no publisher change). The daemon then consumes
//! the stream with a durable pull consumer instead of a core subscription, and after
//! every `snapshot_every` batches it stores an [`StoredSnapshot`] — the index's
//! [`IndexSnapshot`] (tree dump plus event cursors) and the stream sequence it covers —
//! as one object in a JetStream object store (which chunks large objects). On start it
//! loads the latest snapshot, restores it, and (re)creates its consumer to deliver
//! from the sequence after it, so it reaches the state it had without asking any
//! publisher. If the stream no longer holds that sequence (retention), the daemon
//! replays what is left and falls back to the publisher resync of
//! [`super::recovery`].
//!
//! Costs, measured in `docs/benchmarks.md`: every event is stored once more by the
//! server (disk and, in a cluster, replication); a snapshot is about as large as a
//! dump of the index; a restart downloads one snapshot and replays the batches since.
//! Gap recovery from publishers stays active (a publisher's own losses before NATS are
//! not in the stream either).

use crate::durability::JetStreamConfig;
use crate::metrics::counters::{MessageKind, Outcome};
use crate::state::RouterState;
use async_nats::jetstream::{self, consumer, object_store, stream};
use futures::StreamExt;
use indexer::IndexerApi as _;
use kv_events::Subjects;
use kv_events::recovery::IndexSnapshot;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;
use tokio::io::AsyncReadExt;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// What the object store holds: an index snapshot and the last stream sequence
/// applied before it was taken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredSnapshot {
    /// Stream sequence of the last event batch the snapshot includes (0: none).
    pub stream_sequence: u64,
    /// The index.
    pub snapshot: IndexSnapshot,
}

/// Errors of the JetStream path; every one names the stream, bucket or consumer.
#[derive(Debug, thiserror::Error)]
pub enum JetStreamError {
    /// The stream could not be created or read.
    #[error("jetstream stream {stream}: {reason}")]
    Stream {
        /// The stream name.
        stream: String,
        /// The server's or client's error.
        reason: String,
    },
    /// The snapshot bucket could not be created, read or written.
    #[error("jetstream object store {bucket}: {reason}")]
    Store {
        /// The bucket name.
        bucket: String,
        /// The server's or client's error.
        reason: String,
    },
    /// The consumer could not be created or read.
    #[error("jetstream consumer {consumer}: {reason}")]
    Consumer {
        /// The consumer name.
        consumer: String,
        /// The server's or client's error.
        reason: String,
    },
}

/// A connected JetStream path: the stream and the snapshot bucket.
pub struct JetStreamPath {
    config: JetStreamConfig,
    stream: stream::Stream,
    store: object_store::ObjectStore,
    filter: String,
}

impl JetStreamPath {
    /// Creates (or opens) the stream and the snapshot bucket.
    ///
    /// # Errors
    /// [`JetStreamError`] when JetStream is not enabled on the server or a name is
    /// refused.
    pub async fn open(
        nats: &async_nats::Client,
        subjects: &Subjects,
        config: &JetStreamConfig,
    ) -> Result<Self, JetStreamError> {
        let js = jetstream::new(nats.clone());
        let filter = subjects.kv_events_stream_filter();
        let stream = js
            .get_or_create_stream(stream::Config {
                name: config.stream.clone(),
                subjects: vec![filter.clone()],
                max_age: config.max_age,
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(|e| JetStreamError::Stream {
                stream: config.stream.clone(),
                reason: e.to_string(),
            })?;
        let store_error = |e: &dyn std::fmt::Display| JetStreamError::Store {
            bucket: config.bucket.clone(),
            reason: e.to_string(),
        };
        let store = match js.get_object_store(&config.bucket).await {
            Ok(store) => store,
            Err(_) => js
                .create_object_store(object_store::Config {
                    bucket: config.bucket.clone(),
                    ..Default::default()
                })
                .await
                .map_err(|e| store_error(&e))?,
        };
        Ok(Self {
            config: config.clone(),
            stream,
            store,
            filter,
        })
    }

    fn object_name(&self) -> String {
        format!("index-{}", self.config.consumer)
    }

    /// The latest stored snapshot, if any. A snapshot that does not decode is logged
    /// and treated as missing (the daemon then rebuilds from the stream and publishers).
    ///
    /// # Errors
    /// [`JetStreamError::Store`] when the bucket cannot be read.
    pub async fn load_snapshot(&self) -> Result<Option<(StoredSnapshot, usize)>, JetStreamError> {
        let name = self.object_name();
        let mut object = match self.store.get(&name).await {
            Ok(object) => object,
            Err(e) if e.kind() == object_store::GetErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(JetStreamError::Store {
                    bucket: self.config.bucket.clone(),
                    reason: e.to_string(),
                });
            }
        };
        let mut bytes = Vec::new();
        object
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| JetStreamError::Store {
                bucket: self.config.bucket.clone(),
                reason: e.to_string(),
            })?;
        match kv_events::decode::<StoredSnapshot>(&bytes) {
            Ok(snapshot) => Ok(Some((snapshot, bytes.len()))),
            Err(e) => {
                warn!(bucket = %self.config.bucket, object = %name, error = %e, "malformed index snapshot ignored");
                Ok(None)
            }
        }
    }

    /// Stores `snapshot`, replacing the previous one. Returns its size in bytes.
    ///
    /// # Errors
    /// [`JetStreamError::Store`] when the bucket cannot be written.
    pub async fn save_snapshot(&self, snapshot: &StoredSnapshot) -> Result<usize, JetStreamError> {
        let store_error = |e: &dyn std::fmt::Display| JetStreamError::Store {
            bucket: self.config.bucket.clone(),
            reason: e.to_string(),
        };
        let bytes = kv_events::encode(snapshot).map_err(|e| store_error(&e))?;
        let len = bytes.len();
        self.store
            .put(self.object_name().as_str(), &mut bytes.as_slice())
            .await
            .map_err(|e| store_error(&e))?;
        Ok(len)
    }

    /// The first sequence the stream still holds.
    ///
    /// # Errors
    /// [`JetStreamError::Stream`] when the stream info cannot be read.
    pub async fn first_sequence(&self) -> Result<u64, JetStreamError> {
        let mut stream = self.stream.clone();
        let info = stream.info().await.map_err(|e| JetStreamError::Stream {
            stream: self.config.stream.clone(),
            reason: e.to_string(),
        })?;
        Ok(info.state.first_sequence)
    }

    /// Replaces this replica's durable consumer with one that delivers from
    /// `start_sequence` (from the beginning when `None`).
    ///
    /// # Errors
    /// [`JetStreamError::Consumer`] when the server refuses it.
    pub async fn consumer_from(
        &self,
        start_sequence: Option<u64>,
    ) -> Result<consumer::PullConsumer, JetStreamError> {
        // A consumer left by a previous run points past what this run has applied.
        let _ = self.stream.delete_consumer(&self.config.consumer).await;
        let deliver_policy = match start_sequence {
            Some(start_sequence) => consumer::DeliverPolicy::ByStartSequence { start_sequence },
            None => consumer::DeliverPolicy::All,
        };
        self.stream
            .create_consumer(consumer::pull::Config {
                durable_name: Some(self.config.consumer.clone()),
                deliver_policy,
                ack_policy: consumer::AckPolicy::None,
                filter_subject: self.filter.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| JetStreamError::Consumer {
                consumer: self.config.consumer.clone(),
                reason: e.to_string(),
            })
    }
}

/// How the daemon started on the JetStream path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JetStreamStart {
    /// Stream sequence of the restored snapshot (0: none was found).
    pub snapshot_sequence: u64,
    /// Size of the restored snapshot, in bytes.
    pub snapshot_bytes: usize,
    /// True when the stream no longer holds every batch after the snapshot: the
    /// publishers must be asked for their state as well.
    pub needs_resync: bool,
}

/// Loads the latest snapshot into the indexer and creates the consumer that
/// continues after it.
///
/// # Errors
/// [`JetStreamError`] from the server, or when the indexer stopped.
pub async fn restore(
    state: &RouterState,
    path: &JetStreamPath,
) -> Result<(JetStreamStart, consumer::PullConsumer), JetStreamError> {
    let started = Instant::now();
    let loaded = path.load_snapshot().await?;
    let (sequence, bytes) =
        match loaded {
            Some((stored, bytes)) => {
                let sequence = stored.stream_sequence;
                state.indexer.restore(stored.snapshot).await.map_err(|e| {
                    JetStreamError::Store {
                        bucket: path.config.bucket.clone(),
                        reason: e.to_string(),
                    }
                })?;
                (sequence, bytes)
            }
            None => (0, 0),
        };
    let first = path.first_sequence().await?;
    // The stream must still hold the batch right after the snapshot (or, without a
    // snapshot, its very first batch).
    let needs_resync = first > sequence + 1;
    let consumer = path.consumer_from(Some(sequence + 1)).await?;
    info!(
        stream = %path.config.stream,
        consumer = %path.config.consumer,
        snapshot_sequence = sequence,
        snapshot_bytes = bytes,
        first_stream_sequence = first,
        needs_resync,
        ms = started.elapsed().as_millis() as u64,
        "jetstream index snapshot restored"
    );
    Ok((
        JetStreamStart {
            snapshot_sequence: sequence,
            snapshot_bytes: bytes,
            needs_resync,
        },
        consumer,
    ))
}

/// Consumes the stream into the indexer until `stop`, snapshotting every
/// `snapshot_every` batches and once more when stopped (so a clean restart replays
/// nothing). `caught_up` fires once the consumer had nothing pending (the index
/// reflects every batch stored before start-up).
pub async fn consume(
    state: Arc<RouterState>,
    path: Arc<JetStreamPath>,
    consumer: consumer::PullConsumer,
    caught_up: oneshot::Sender<u64>,
    stop: CancellationToken,
) {
    let mut caught_up = Some(caught_up);
    let pending = match consumer.clone().info().await {
        Ok(info) => info.num_pending,
        Err(e) => {
            warn!(error = %e, "could not read the jetstream consumer; assuming it is behind");
            u64::MAX
        }
    };
    if pending == 0
        && let Some(tx) = caught_up.take()
    {
        let _ = tx.send(0);
    }
    let mut messages = match consumer.messages().await {
        Ok(m) => m,
        Err(e) => {
            warn!(error = %e, "could not consume the jetstream stream; kv event intake stopped");
            return;
        }
    };
    let mut applied = 0u64;
    let mut since_snapshot = 0u64;
    let mut last_sequence = 0u64;
    let mut uploading: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        let next = tokio::select! {
            () = stop.cancelled() => break,
            next = messages.next() => next,
        };
        let message = match next {
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                warn!(error = %e, "jetstream consumer error; continuing");
                continue;
            }
            None => {
                warn!(stream = %path.config.stream, "jetstream consumer ended; kv event intake stopped");
                break;
            }
        };
        let (sequence, pending) = match message.info() {
            Ok(info) => (info.stream_sequence, info.pending),
            Err(e) => {
                warn!(subject = %message.subject, error = %e, "jetstream message without metadata skipped");
                continue;
            }
        };
        if let Some(batch) = crate::intake::decode_events(
            &state.counters,
            &state.limits,
            &message.subject,
            &message.payload,
        ) {
            if let Err(e) = state.indexer.apply(batch).await {
                warn!(error = %e, "indexer refused events; stopping jetstream intake");
                return;
            }
            state.counters.message(MessageKind::Events, Outcome::Ok);
        }
        applied += 1;
        since_snapshot += 1;
        last_sequence = sequence;
        if pending == 0
            && let Some(tx) = caught_up.take()
        {
            let _ = tx.send(applied);
        }
        let idle = uploading.as_ref().is_none_or(|h| h.is_finished());
        if since_snapshot >= path.config.snapshot_every && idle {
            since_snapshot = 0;
            uploading = snapshot(&state, &path, sequence).await;
        }
    }
    if let Some(upload) = uploading {
        let _ = upload.await;
    }
    if since_snapshot > 0
        && let Some(upload) = snapshot(&state, &path, last_sequence).await
    {
        let _ = upload.await;
    }
}

/// Takes a snapshot covering the stream up to `sequence` and uploads it in the
/// background; `None` when the indexer could not be read.
async fn snapshot(
    state: &RouterState,
    path: &Arc<JetStreamPath>,
    sequence: u64,
) -> Option<tokio::task::JoinHandle<()>> {
    let snapshot = match state.indexer.snapshot().await {
        Ok(snapshot) => snapshot,
        Err(e) => {
            warn!(error = %e, "index snapshot not taken");
            return None;
        }
    };
    let stored = StoredSnapshot {
        stream_sequence: sequence,
        snapshot,
    };
    let path = path.clone();
    Some(tokio::spawn(async move {
        let started = Instant::now();
        match path.save_snapshot(&stored).await {
            Ok(bytes) => info!(
                stream_sequence = stored.stream_sequence,
                bytes,
                ms = started.elapsed().as_millis() as u64,
                "index snapshot stored"
            ),
            Err(e) => warn!(error = %e, "index snapshot not stored"),
        }
    }))
}
