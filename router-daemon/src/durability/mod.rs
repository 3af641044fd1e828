//! How the daemon keeps its index exact and bounded: gap recovery from publishers,
//! start-up resync, the optional JetStream durability path, and the index's
//! backend, memory bound and approximate mode.
//!
//! - [`recovery`]: serves the indexer's [`indexer::RecoveryNeed`]s over NATS
//!   request-reply (`{ns}.kv.recovery.{worker_id}`) and resyncs every registered
//!   worker at start-up.
//! - [`jetstream`]: optional (`--jetstream`): KV events are consumed from a JetStream
//!   stream with a durable consumer instead of a core subscription, and every K
//!   batches the index is snapshotted to an object store, so a restarted daemon loads
//!   the snapshot and replays the stream from its position.
//!
//! The flags are `crate::config::index::IndexArgs` (flattened into `kv-router
//! serve`), validated into the indexer's own [`indexer::IndexerConfig`] fields plus a
//! [`DurabilityConfig`]. `docs/architecture.md` compares the two recovery paths.

pub(crate) mod jetstream;
pub(crate) mod recovery;

use crate::state::RouterState;
use anyhow::Context;
use backon::ExponentialBuilder;
use indexer::IndexerApi as _;
use kv_events::recovery::ReplyLimits;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

/// How recovery requests are sent, spaced and bounded (`recovery::ranks` has the
/// pacing rules).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecoveryConfig {
    /// Timeout of the request and of each further reply chunk.
    pub timeout: Duration,
    /// Attempts of one recovery before giving up (at least 1).
    pub attempts: u32,
    /// Requests in flight at once (at least 1); at most one per rank.
    pub concurrency: usize,
    /// The first delay between attempts of one recovery, and between recoveries of a
    /// rank that did not close its hole; doubles up to `backoff_max`, each plus a
    /// random jitter of up to 100 %. Default 100 ms.
    pub backoff_min: Duration,
    /// The largest delay (before jitter). Default 30 s.
    pub backoff_max: Duration,
    /// Recoveries in a row that did not close a rank's hole before the rank is
    /// degraded: no more requests until `cooldown` ends or its publisher restarts
    /// (at least 1). Default 8: 13 to 25 s of tries at the default backoff.
    pub budget: u32,
    /// How long a degraded rank is left alone, and how long a failing streak is
    /// remembered without a new need. Default 5 min.
    pub cooldown: Duration,
    /// The most one reply may hold, checked before each chunk is decoded.
    pub reply_limits: ReplyLimits,
}

impl Default for RecoveryConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(2),
            attempts: 4,
            concurrency: 16,
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(30),
            budget: 8,
            cooldown: Duration::from_secs(300),
            reply_limits: ReplyLimits::default(),
        }
    }
}

impl RecoveryConfig {
    /// The exponential, jittered delays from `backoff_min` to `backoff_max`.
    fn backoff(&self) -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_min_delay(self.backoff_min)
            .with_max_delay(self.backoff_max)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
    }

    /// Delays between the attempts of one recovery: `attempts − 1` of them.
    pub(crate) fn attempt_backoff(&self) -> ExponentialBuilder {
        let retries = usize::try_from(self.attempts.saturating_sub(1)).unwrap_or(usize::MAX);
        self.backoff().with_max_times(retries)
    }

    /// How recoveries of one rank are spaced and bounded.
    pub(crate) fn pacing(&self) -> recovery::Pacing {
        recovery::Pacing {
            backoff: self.backoff(),
            budget: self.budget,
            cooldown: self.cooldown,
        }
    }
}

/// Names and cadence of the JetStream durability path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JetStreamConfig {
    /// Stream capturing `{ns}.kv.events.>`.
    pub stream: String,
    /// Durable consumer of this replica.
    pub consumer: String,
    /// Object store bucket for snapshots.
    pub bucket: String,
    /// Event batches between snapshots (at least 1).
    pub snapshot_every: u64,
    /// Stream retention.
    pub max_age: Duration,
}

/// Recovery and JetStream settings of the daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurabilityConfig {
    /// Gap recovery requests.
    pub recovery: RecoveryConfig,
    /// The JetStream path, when enabled.
    pub jetstream: Option<JetStreamConfig>,
    /// The wait of batches from unregistered workers or unregistered epochs.
    pub hold: crate::publishers::HoldConfig,
}

/// The KV event intake, as chosen by the config.
pub(crate) enum EventIntake {
    /// A core NATS subscription to `{ns}.kv.events.*`, already consuming.
    Core,
    /// The JetStream stream, restored from its snapshot; consumed from
    /// [`initial_recovery`] on, once discovery has loaded.
    JetStream(Box<jetstream::Restored>),
}

/// What every KV event intake needs: the indexer, counters, limits, the registered
/// publishers and the hold (`crate::intake::EventDoor`).
fn door_parts(config: &DurabilityConfig, state: &RouterState) -> crate::intake::IntakeParts {
    crate::intake::IntakeParts {
        indexer: state.indexer.clone(),
        counters: state.counters.clone(),
        limits: state.limits,
        publishers: state.publishers.subscribe(),
        hold: config.hold,
        subjects: state.subjects.clone(),
        removals: state.removals.clone(),
    }
}

/// Starts the KV event intake: a core subscription consuming on `tasks` (stopped by
/// `intake`), or — with `--jetstream` — the stream and its consumer after restoring
/// the latest snapshot, not consuming yet: the stream keeps what is published
/// meanwhile, and [`initial_recovery`] starts the consumer once the registrations are
/// known, so a long replay is not held for registrations still loading.
///
/// # Errors
/// A failed subscription, or a JetStream stream, bucket or consumer the server
/// refuses.
pub(crate) async fn start_event_intake(
    config: &DurabilityConfig,
    state: &Arc<RouterState>,
    nats: &async_nats::Client,
    tasks: &TaskTracker,
    intake: &CancellationToken,
) -> anyhow::Result<EventIntake> {
    let Some(js) = &config.jetstream else {
        let events = nats
            .subscribe(state.subjects.kv_events_all())
            .await
            .context("subscribing to kv events")?;
        tasks.spawn(crate::intake::serve_events(
            door_parts(config, state),
            events,
            intake.child_token(),
        ));
        return Ok(EventIntake::Core);
    };
    let path = jetstream::JetStreamPath::open(nats, &state.subjects, js)
        .await
        .context("opening the jetstream stream and snapshot bucket")?;
    let restored = jetstream::restore(state, path, door_parts(config, state))
        .await
        .context("restoring the index snapshot")?;
    Ok(EventIntake::JetStream(Box::new(restored)))
}

/// The initial recovery of the index, after discovery has loaded: nothing in
/// approximate mode; with JetStream, start consuming the stream on `tasks` (until
/// `intake`) and catch up with it (and resync from the publishers only if the stream
/// lost batches after the snapshot); otherwise resync every registered rank from its
/// publisher. Returns a summary for the readiness report.
///
/// # Errors
/// When the indexer stopped or the JetStream consumer ended before catching up.
pub(crate) async fn initial_recovery(
    state: &Arc<RouterState>,
    progress: &recovery::RecoveryProgress,
    event_intake: EventIntake,
    tasks: &TaskTracker,
    intake: &CancellationToken,
) -> anyhow::Result<String> {
    // The consumer runs in every mode; only an exact index waits for it to catch up.
    let caught_up = match event_intake {
        EventIntake::Core => None,
        EventIntake::JetStream(restored) => {
            let start = restored.start;
            let (tx, caught_up) = oneshot::channel();
            tasks.spawn(jetstream::consume(
                state.clone(),
                *restored,
                tx,
                intake.child_token(),
            ));
            Some((start, caught_up))
        }
    };
    if state.indexer.is_approximate() {
        return Ok("approximate mode: the index starts empty".to_owned());
    }
    let mut summary = String::new();
    let resync = match caught_up {
        None => true,
        Some((start, caught_up)) => {
            let replayed = caught_up
                .await
                .context("the jetstream consumer stopped before catching up")?;
            summary = format!(
                "snapshot at stream sequence {} ({} bytes) plus {replayed} batches replayed; ",
                start.snapshot_sequence, start.snapshot_bytes
            );
            start.needs_resync
        }
    };
    if resync {
        let done = recovery::resync_registered(state, progress).await?;
        info!(
            ranks = done.ranks,
            entries = done.entries,
            ms = done.elapsed.as_millis() as u64,
            "initial recovery from publishers done"
        );
        summary.push_str(&format!(
            "{} ranks resynced from their publishers, {} entries, {} ms",
            done.ranks,
            done.entries,
            done.elapsed.as_millis()
        ));
    } else {
        let entries = state.indexer.stats().await?.entries;
        summary.push_str(&format!("{entries} entries"));
    }
    Ok(summary)
}
