//! The daemon's NATS intake: every payload goes through the daemon's own handler
//! (`router_daemon::intake`, `lifecycle`, `replicas`) or its validation function, on
//! fresh state (a scheduler with two workers and one booked request, an empty index).

use super::seeds::{self, BLOCK_SIZE, BOOKED, OWN_ROUTER, WORKER};
use super::target::{Harness, Target, Verdict};
use crate::mutate::Format;
use indexer::{IndexerCounters, OrderedIndex, OverlapScores, ShardSettings};
use kv_events::discovery::WorkerRegistration;
use kv_events::limits::{Limits, WithinLimits, decode_within};
use kv_events::replicas::{SequenceSyncBatch, SnapshotReply, SnapshotRequest};
use kv_events::routing::{LifecycleMessage, RouteBatchRequest, RouteRequest};
use kv_events::{KvEventBatch, LoadMetrics, Namespace, Subjects, WorkerId, decode};
use router_daemon::counters::{Counters, MessageKind, Outcome};
use router_daemon::handlers::{
    self, Admission, AdmissionConfig, AdmissionMetrics, ReplicaConfig, SnapshotSummary,
    apply_reply, registrar,
};
use scheduler::{NoOverlap, ScheduleRequest, Scheduler, SchedulerConfig};
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::time::Instant;

/// Most requests per route batch (the daemon's `--max-route-batch` default).
const MAX_ROUTE_BATCH: usize = 256;

fn subjects() -> Subjects {
    // A constant, valid namespace.
    Subjects::new(Namespace::new("fuzz").unwrap_or_else(|e| panic!("namespace: {e}")))
}

fn registration(worker_id: WorkerId, dp_size: u32) -> WorkerRegistration {
    WorkerRegistration {
        worker_id,
        dp_size,
        block_size: BLOCK_SIZE,
        total_kv_blocks: 1000,
        url: None,
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    }
}

/// A scheduler with workers 7 (4 ranks) and 8 (1 rank).
pub fn scheduler() -> Scheduler {
    let mut scheduler = Scheduler::new(SchedulerConfig::default(), Some(7))
        .unwrap_or_else(|e| panic!("the default scheduler config is valid: {e}"));
    for reg in [registration(WORKER, 4), registration(WorkerId(8), 1)] {
        scheduler
            .add_worker(reg)
            .unwrap_or_else(|e| panic!("a valid registration: {e}"));
    }
    scheduler
}

/// The daemon's admission (scheduler, queue, replica sync) and counters.
struct Daemon {
    admission: Admission,
    counters: Counters,
}

impl Daemon {
    fn new() -> Self {
        let counters = Counters::unregistered();
        let mut scheduler = scheduler();
        let booked = ScheduleRequest::new(BOOKED, Vec::new(), 40, BLOCK_SIZE);
        if let Err(e) = scheduler.schedule(&booked, &NoOverlap, Instant::now()) {
            panic!("booking on a fresh scheduler: {e}");
        }
        let config = AdmissionConfig {
            replicas: ReplicaConfig {
                router_id: OWN_ROUTER,
                ..ReplicaConfig::default()
            },
            ..AdmissionConfig::default()
        };
        let admission = Admission::new(
            &config,
            scheduler,
            counters.metrics.queue.clone(),
            registrar::unregistered(AdmissionMetrics::new),
        );
        Self {
            admission,
            counters,
        }
    }
}

struct Events {
    counters: Counters,
    index: OrderedIndex,
    subject: String,
}

impl Harness for Events {
    fn feed(&mut self, input: &[u8]) -> Verdict {
        let error = decode_within::<KvEventBatch>(input, &Limits::default()).err();
        match handlers::decode_events(&self.counters, &Limits::default(), &self.subject, input) {
            Some(batch) => {
                let _needs = self.index.apply_batch(&batch);
                let hashes: Vec<_> = batch
                    .events
                    .iter()
                    .filter_map(|e| match &e.data {
                        kv_events::KvCacheEventData::Stored { blocks, .. } => {
                            blocks.first().map(|b| b.tokens_hash)
                        }
                        _ => None,
                    })
                    .collect();
                let _scores: OverlapScores = self.index.find_matches(&hashes);
                Verdict::Accepted
            }
            None => Verdict::Refused(error.map_or_else(
                || "batch published on another worker's subject".to_owned(),
                |e| e.to_string(),
            )),
        }
    }
}

/// An empty index shard, as one of the daemon's.
pub fn index() -> OrderedIndex {
    OrderedIndex::new(ShardSettings::default(), Arc::new(IndexerCounters::new()))
}

pub const EVENTS: Target = Target {
    name: "events",
    about: "KvEventBatch (msgpack, NATS kv.events.{worker}) → intake::decode_events → OrderedIndex::apply_batch, find_matches",
    format: Format::Msgpack,
    seeds: seeds::events,
    fresh: || {
        Box::new(Events {
            counters: Counters::unregistered(),
            index: index(),
            subject: subjects().kv_events(WORKER),
        })
    },
};

/// A daemon handler of one NATS message kind: `(admission, counters, limits,
/// subject, payload)`.
type HandleFn = fn(&Admission, &Counters, &Limits, &str, &[u8]);

/// Runs a daemon handler on a fresh daemon with the default [`Limits`], judging each
/// input by its decode error (if any, as a `T` within the limits) and by the counter
/// of `kind` the handler moves.
struct Handler<T> {
    daemon: Daemon,
    subject: String,
    kind: MessageKind,
    handle: HandleFn,
    message: std::marker::PhantomData<T>,
}

impl<T: DeserializeOwned + WithinLimits> Harness for Handler<T> {
    fn feed(&mut self, input: &[u8]) -> Verdict {
        let Daemon {
            admission,
            counters,
        } = &self.daemon;
        let limits = Limits::default();
        let error = decode_within::<T>(input, &limits)
            .err()
            .map(|e| e.to_string());
        let before = counters.messages(self.kind, Outcome::Ok);
        (self.handle)(admission, counters, &limits, &self.subject, input);
        match error {
            Some(e) => Verdict::Refused(e),
            None if counters.messages(self.kind, Outcome::Ok) > before => Verdict::Accepted,
            None => Verdict::Refused(format!("{:?} message counted as rejected", self.kind)),
        }
    }
}

fn handler<T: DeserializeOwned + WithinLimits + 'static>(
    subject: String,
    kind: MessageKind,
    handle: HandleFn,
) -> Box<dyn Harness> {
    Box::new(Handler::<T> {
        daemon: Daemon::new(),
        subject,
        kind,
        handle,
        message: std::marker::PhantomData,
    })
}

pub const METRICS: Target = Target {
    name: "metrics",
    about: "LoadMetrics (msgpack, NATS kv.metrics.{worker}) → intake::handle_metrics → Scheduler::update_load_metrics",
    format: Format::Msgpack,
    seeds: seeds::metrics,
    fresh: || {
        let subject = subjects().load_metrics(WORKER);
        handler::<LoadMetrics>(subject, MessageKind::Metrics, handlers::handle_metrics)
    },
};

pub const LIFECYCLE: Target = Target {
    name: "lifecycle",
    about: "LifecycleMessage (msgpack, NATS router.lifecycle) → lifecycle::handle_lifecycle → scheduler prefill_done / keep_alive / free",
    format: Format::Msgpack,
    seeds: seeds::lifecycle,
    fresh: || {
        let subject = subjects().lifecycle();
        handler::<LifecycleMessage>(subject, MessageKind::Lifecycle, handlers::handle_lifecycle)
    },
};

pub const BOOKINGS: Target = Target {
    name: "bookings",
    about: "SequenceSyncBatch or single-step SequenceSync (msgpack, NATS router.sequences, replica sharing) → replica_sync::sync::handle_sync → Scheduler::apply",
    format: Format::Msgpack,
    seeds: seeds::bookings,
    fresh: || {
        let subject = subjects().sequences();
        handler::<SequenceSyncBatch>(subject, MessageKind::Sequences, handlers::handle_sync)
    },
};

pub const SNAPSHOT_REPLY: Target = Target {
    name: "snapshot_reply",
    about: "SnapshotReply (msgpack, a peer replica's answer on our inbox) → replica_sync::snapshot::apply_reply → Scheduler::apply",
    format: Format::Msgpack,
    seeds: seeds::snapshot_reply,
    fresh: || {
        let subject = subjects().sequences_snapshot();
        handler::<SnapshotReply>(subject, MessageKind::SequenceSnapshot, |a, c, l, s, p| {
            apply_reply(a, c, l, s, p, &mut SnapshotSummary::default());
        })
    },
};

struct Decode<T>(std::marker::PhantomData<T>);

impl<T: DeserializeOwned> Harness for Decode<T> {
    fn feed(&mut self, input: &[u8]) -> Verdict {
        Verdict::of(decode::<T>(input).map(drop))
    }
}

pub const SNAPSHOT_REQUEST: Target = Target {
    name: "snapshot_request",
    about: "SnapshotRequest (msgpack, NATS router.sequences.snapshot) → decode (the answer depends only on the router id)",
    format: Format::Msgpack,
    seeds: seeds::snapshot_request,
    fresh: || Box::new(Decode::<SnapshotRequest>(std::marker::PhantomData)),
};

struct Route {
    scheduler: Scheduler,
}

impl Harness for Route {
    fn feed(&mut self, input: &[u8]) -> Verdict {
        let request: RouteRequest = match decode_within(input, &Limits::default()) {
            Ok(r) => r,
            Err(e) => return Verdict::Refused(e.to_string()),
        };
        let schedule = match handlers::schedule_request(request, BLOCK_SIZE) {
            Ok(s) => s,
            Err(reply) => return Verdict::Refused(format!("{reply:?}")),
        };
        Verdict::of(
            self.scheduler
                .schedule(&schedule, &NoOverlap, Instant::now())
                .map(drop),
        )
    }
}

pub const ROUTE: Target = Target {
    name: "route",
    about: "RouteRequest (msgpack, NATS router.route) → route::schedule_request (prompt hashing, validation) → Scheduler::schedule",
    format: Format::Msgpack,
    seeds: seeds::route,
    fresh: || {
        Box::new(Route {
            scheduler: scheduler(),
        })
    },
};

impl Route {
    fn batch(&mut self, input: &[u8]) -> Verdict {
        let batch: RouteBatchRequest = match decode_within(input, &Limits::default()) {
            Ok(b) => b,
            Err(e) => return Verdict::Refused(e.to_string()),
        };
        let count = batch.requests.len();
        if count == 0 || count > MAX_ROUTE_BATCH {
            return Verdict::Refused(format!("a batch holds 1 to {MAX_ROUTE_BATCH}, got {count}"));
        }
        let order = batch.order;
        let valid: Vec<(ScheduleRequest, NoOverlap)> = batch
            .requests
            .into_iter()
            .filter_map(|r| handlers::schedule_request(r, BLOCK_SIZE).ok())
            .map(|s| (s, NoOverlap))
            .collect();
        let results = self.scheduler.schedule_batch(&valid, order, Instant::now());
        if results.iter().any(Result::is_ok) {
            Verdict::Accepted
        } else {
            Verdict::Refused("no request of the batch was routed".into())
        }
    }
}

struct RouteBatch(Route);

impl Harness for RouteBatch {
    fn feed(&mut self, input: &[u8]) -> Verdict {
        self.0.batch(input)
    }
}

pub const ROUTE_BATCH: Target = Target {
    name: "route_batch",
    about: "RouteBatchRequest (msgpack, NATS router.route_batch) → count check → route::schedule_request per entry → Scheduler::schedule_batch",
    format: Format::Msgpack,
    seeds: seeds::route_batch,
    fresh: || {
        Box::new(RouteBatch(Route {
            scheduler: scheduler(),
        }))
    },
};
