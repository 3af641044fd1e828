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
//! One door: every batch from the stream goes through the same
//! [`crate::intake::EventDoor`] as the core subscription's — decode, hold while its
//! worker (or its epoch) is not registered, apply — so a batch the core intake would
//! hold or drop is held or dropped here too. The consumer starts pulling only once
//! discovery has loaded (the stream keeps what arrives meanwhile), so a replay of many
//! batches meets the registrations instead of filling the hold. A snapshot covers the
//! stream up to just before the oldest batch still held, so a restart replays a held
//! batch instead of losing it (the batches after it that were applied come again and
//! are dropped as duplicates by the indexer's event ids).
//!
//! Costs, measured in `docs/benchmarks.md`: every event is stored once more by the
//! server (disk and, in a cluster, replication); a snapshot is about as large as a
//! dump of the index; a restart downloads one snapshot and replays the batches since.
//! Gap recovery from publishers stays active (a publisher's own losses before NATS are
//! not in the stream either).

use crate::durability::JetStreamConfig;
use crate::intake::EventDoor;
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
    pub(crate) async fn save_snapshot(
        &self,
        snapshot: &StoredSnapshot,
    ) -> Result<usize, JetStreamError> {
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
    pub(crate) async fn first_sequence(&self) -> Result<u64, JetStreamError> {
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
    pub(crate) async fn consumer_from(
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
pub(crate) struct JetStreamStart {
    /// Stream sequence of the restored snapshot (0: none was found).
    pub snapshot_sequence: u64,
    /// Size of the restored snapshot, in bytes.
    pub snapshot_bytes: usize,
    /// True when the stream no longer holds every batch after the snapshot: the
    /// publishers must be asked for their state as well.
    pub needs_resync: bool,
}

/// A restored JetStream path, ready to consume ([`consume`]).
pub(crate) struct Restored {
    /// What the restore found.
    pub start: JetStreamStart,
    path: JetStreamPath,
    consumer: consumer::PullConsumer,
    door: crate::intake::IntakeParts,
}

/// Loads the latest snapshot into the indexer and creates the consumer that
/// continues after it; its batches will go through a door made of `door`.
///
/// # Errors
/// [`JetStreamError`] from the server, or when the indexer stopped.
pub(crate) async fn restore(
    state: &RouterState,
    path: JetStreamPath,
    door: crate::intake::IntakeParts,
) -> Result<Restored, JetStreamError> {
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
    Ok(Restored {
        start: JetStreamStart {
            snapshot_sequence: sequence,
            snapshot_bytes: bytes,
            needs_resync,
        },
        path,
        consumer,
        door,
    })
}

/// Attempts at reading the consumer's pending count before [`consume`] gives up.
const INFO_ATTEMPTS: usize = 5;

/// How many batches the consumer has to deliver before it has caught up, read with
/// retries (each read bounded by the client's request timeout).
async fn pending_at_start(consumer: &consumer::PullConsumer) -> anyhow::Result<u64> {
    use backon::Retryable as _;
    let read = || async { consumer.clone().info().await.map(|info| info.num_pending) };
    let backoff = backon::ExponentialBuilder::default()
        .with_min_delay(std::time::Duration::from_millis(100))
        .with_max_delay(std::time::Duration::from_secs(2))
        .with_max_times(INFO_ATTEMPTS - 1);
    read.retry(backoff)
        .notify(|e, delay| warn!(error = %e, retry_in = ?delay, "could not read the jetstream consumer; retrying"))
        .await
        .map_err(anyhow::Error::from)
}

/// Where the consumer is: what a snapshot taken now may claim.
#[derive(Debug, Default)]
struct Position {
    /// Batches taken from the stream so far.
    taken: u64,
    /// Batches taken since the last snapshot.
    since_snapshot: u64,
    /// Stream sequence of the last batch taken.
    last: u64,
    /// Stream sequence the last snapshot covers.
    snapshotted: u64,
}

impl Position {
    /// The stream sequence a snapshot taken now covers: the last batch taken, or
    /// just before the oldest one `door` still holds (which is not in the index).
    fn covered(&self, door: &EventDoor<u64>) -> u64 {
        door.oldest_held()
            .map_or(self.last, |held| held.saturating_sub(1))
    }
}

/// Consumes the stream through the [`EventDoor`] until `stop`, snapshotting every
/// `snapshot_every` batches and once more when stopped (so a clean restart replays
/// nothing). `caught_up` fires once the consumer had nothing pending (every batch
/// stored before it started has been taken: applied, held or skipped) with the
/// number of batches taken. Ends without firing it when the consumer cannot be read
/// ([`INFO_ATTEMPTS`]) or its messages cannot be pulled.
pub(crate) async fn consume(
    state: Arc<RouterState>,
    restored: Restored,
    caught_up: oneshot::Sender<u64>,
    stop: CancellationToken,
) {
    let Restored {
        path,
        consumer,
        door,
        start,
    } = restored;
    let path = Arc::new(path);
    let mut caught_up = Some(caught_up);
    match pending_at_start(&consumer).await {
        Ok(0) => {
            if let Some(tx) = caught_up.take() {
                let _ = tx.send(0);
            }
        }
        Ok(_) => {}
        Err(e) => {
            warn!(error = %format!("{e:#}"), consumer = %path.config.consumer, "could not read the jetstream consumer; kv event intake stopped");
            return;
        }
    }
    let mut messages = match consumer.messages().await {
        Ok(m) => m,
        Err(e) => {
            warn!(error = %e, "could not consume the jetstream stream; kv event intake stopped");
            return;
        }
    };
    let mut door = EventDoor::new(door);
    let mut at = Position {
        last: start.snapshot_sequence,
        snapshotted: start.snapshot_sequence,
        ..Position::default()
    };
    let mut uploading: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        let next = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            wake = door.wake() => {
                if !door.handle(wake).await {
                    return;
                }
                continue;
            }
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
        if !door
            .take(&message.subject, &message.payload, sequence)
            .await
        {
            return;
        }
        at.taken += 1;
        at.since_snapshot += 1;
        at.last = sequence;
        if pending == 0
            && let Some(tx) = caught_up.take()
        {
            let _ = tx.send(at.taken);
        }
        let idle = uploading.as_ref().is_none_or(|h| h.is_finished());
        if at.since_snapshot >= path.config.snapshot_every && idle {
            at.since_snapshot = 0;
            at.snapshotted = at.covered(&door);
            uploading = snapshot(&state, &path, at.snapshotted).await;
        }
    }
    if let Some(upload) = uploading {
        let _ = upload.await;
    }
    let covered = at.covered(&door);
    if covered > at.snapshotted
        && let Some(upload) = snapshot(&state, &path, covered).await
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
