//! Every NATS subject and etcd key the system uses, derived from one namespace.
//!
//! | purpose | subject / key | pattern |
//! |---|---|---|
//! | KV events | `{ns}.kv.events.{worker_id}` | publish, [`crate::KvEventBatch`] |
//! | load metrics | `{ns}.kv.metrics.{worker_id}` | publish, [`crate::LoadMetrics`] |
//! | KV event recovery | `{ns}.kv.recovery.{worker_id}` | request, chunked reply, [`crate::recovery`] |
//! | routing | `{ns}.router.route` | request-reply, queue group `{ns}-router` |
//! | batch routing | `{ns}.router.route_batch` | request-reply, queue group `{ns}-router`, [`crate::routing::RouteBatchRequest`] |
//! | routing by one replica | `{ns}.router.at.{router_id}.route`, `….route_batch` | request-reply, plain subscription of that replica ([`ROUTER_ID_HEADER`]) |
//! | roll call | `{ns}.router.replicas` | request to every replica, one reply each, [`crate::replicas::RollCallReply`] |
//! | removals | `{ns}.router.removals` | request-reply, queue group `{ns}-router`, [`crate::routing::RemovalsQuery`] → [`crate::routing::RemovalsReply`] |
//! | overlap | `{ns}.router.overlap` | request-reply, queue group `{ns}-router`, [`crate::routing::overlap::OverlapQuery`] → [`crate::routing::overlap::OverlapReply`] |
//! | lifecycle | `{ns}.router.lifecycle` | publish, [`crate::routing::LifecycleMessage`] |
//! | replica sync | `{ns}.router.sequences` | publish, [`crate::replicas::SequenceSyncBatch`] |
//! | replica snapshot | `{ns}.router.sequences.snapshot` | request to every replica, chunked replies, [`crate::replicas::SnapshotRequest`] → [`crate::replicas::SnapshotReply`]s |
//! | engine requests | `{ns}.engine.{worker_id}.{op}` | request-reply (mock engine) |
//! | discovery | `kv-router/{ns}/workers/{worker_id}` | etcd key with a lease |
//! | worker id claim | `kv-router/{ns}/worker-ids/{worker_id}` | etcd key with a lease, written only if absent |
//!
//! Keeping them here means a subject is renamed in one place and documented once
//! (`docs/protocol.md`).

use crate::ids::WorkerId;
use crate::replicas::RouterId;
use std::fmt;

/// The NATS header a router replica sets on its route and batch route replies: its
/// [`RouterId`] as 16 lower-case hex digits. A frontend that wants its next queries
/// placed by the same replica (which has its earlier bookings at once, not a sync lag
/// later) sends them to [`Subjects::route_at`] / [`Subjects::route_batch_at`] of
/// that id.
pub const ROUTER_ID_HEADER: &str = "Kv-Router-Id";

/// A validated namespace: 1–64 characters of `[A-Za-z0-9_-]`, so it is a single NATS
/// subject token and a safe etcd path segment.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Namespace(String);

/// Why a namespace was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NamespaceError {
    /// The namespace was empty or longer than 64 characters.
    #[error("namespace must be 1 to 64 characters, got {0}")]
    Length(usize),
    /// The namespace contained a character outside `[A-Za-z0-9_-]`.
    #[error("namespace may only contain letters, digits, '_' and '-', found {0:?}")]
    Character(char),
}

impl Namespace {
    /// Validates and wraps a namespace.
    ///
    /// # Errors
    /// [`NamespaceError`] for an empty, over-long or non-token namespace.
    pub fn new(name: impl Into<String>) -> Result<Self, NamespaceError> {
        let name = name.into();
        if name.is_empty() || name.len() > 64 {
            return Err(NamespaceError::Length(name.len()));
        }
        if let Some(c) = name
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
        {
            return Err(NamespaceError::Character(c));
        }
        Ok(Self(name))
    }

    /// The namespace as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for Namespace {
    type Err = NamespaceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Namespace::new(s)
    }
}

/// Subject and key builder for one namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    ns: Namespace,
}

impl Subjects {
    /// Subjects under `ns`.
    pub fn new(ns: Namespace) -> Self {
        Self { ns }
    }

    /// The namespace.
    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }

    /// Where `worker` publishes its KV event batches.
    pub fn kv_events(&self, worker: WorkerId) -> String {
        format!("{}.kv.events.{worker}", self.ns)
    }

    /// Wildcard matching every worker's KV events.
    pub fn kv_events_all(&self) -> String {
        format!("{}.kv.events.*", self.ns)
    }

    /// Where `worker` publishes its load metrics.
    pub fn load_metrics(&self, worker: WorkerId) -> String {
        format!("{}.kv.metrics.{worker}", self.ns)
    }

    /// Where `worker` answers recovery requests for its KV events
    /// ([`crate::recovery::RecoveryRequest`] → [`crate::recovery::RecoveryChunk`]s).
    pub fn kv_recovery(&self, worker: WorkerId) -> String {
        format!("{}.kv.recovery.{worker}", self.ns)
    }

    /// Wildcard matching every worker's recovery subject.
    pub fn kv_recovery_all(&self) -> String {
        format!("{}.kv.recovery.*", self.ns)
    }

    /// What a JetStream stream must capture to hold every worker's KV events
    /// (`{ns}.kv.events.>`).
    pub fn kv_events_stream_filter(&self) -> String {
        format!("{}.kv.events.>", self.ns)
    }

    /// Wildcard matching every worker's load metrics.
    pub fn load_metrics_all(&self) -> String {
        format!("{}.kv.metrics.*", self.ns)
    }

    /// The routing request-reply subject.
    pub fn route(&self) -> String {
        format!("{}.router.route", self.ns)
    }

    /// The batch routing request-reply subject ([`crate::routing::RouteBatchRequest`]).
    pub fn route_batch(&self) -> String {
        format!("{}.router.route_batch", self.ns)
    }

    /// The routing subject of one replica alone (plain subscription, no queue group):
    /// what [`Self::route`] serves, placed by `router`. NATS answers "no responders"
    /// when that replica is gone.
    pub fn route_at(&self, router: RouterId) -> String {
        format!("{}.router.at.{router}.route", self.ns)
    }

    /// Every replica's own routing subject ([`Self::route_at`]) as one wildcard
    /// subject: for NATS permissions, and for an observer of the queries frontends pin
    /// to replicas (monitoring, tests); no router subscribes it.
    pub fn route_at_any(&self) -> String {
        format!("{}.router.at.*.route", self.ns)
    }

    /// Every replica's own batch routing subject ([`Self::route_batch_at`]) as one
    /// wildcard subject (NATS permissions).
    pub fn route_batch_at_any(&self) -> String {
        format!("{}.router.at.*.route_batch", self.ns)
    }

    /// The batch routing subject of one replica alone: [`Self::route_batch`], placed
    /// by `router`.
    pub fn route_batch_at(&self, router: RouterId) -> String {
        format!("{}.router.at.{router}.route_batch", self.ns)
    }

    /// The roll call: a request every router replica answers (plain subscription, no
    /// queue group), each with a [`crate::replicas::RollCallReply`] and its
    /// [`ROUTER_ID_HEADER`], whatever the request's payload. A frontend learns from
    /// one request which replicas are up, e.g. to pin to the lowest
    /// ([`Self::route_at`]).
    pub fn router_roll_call(&self) -> String {
        format!("{}.router.replicas", self.ns)
    }

    /// The removals request-reply subject: did an eviction race a route
    /// ([`crate::routing::RemovalsQuery`])?
    pub fn router_removals(&self) -> String {
        format!("{}.router.removals", self.ns)
    }

    /// The overlap request-reply subject: how much of a prefix does a rank hold now
    /// ([`crate::routing::overlap::OverlapQuery`])?
    pub fn router_overlap(&self) -> String {
        format!("{}.router.overlap", self.ns)
    }

    /// The NATS queue group router replicas join on [`Self::route`] and
    /// [`Self::route_batch`] (and [`Self::router_removals`], [`Self::router_overlap`]), so each query is answered by exactly one replica.
    pub fn route_queue_group(&self) -> String {
        format!("{}-router", self.ns)
    }

    /// Where frontends publish request lifecycle messages.
    pub fn lifecycle(&self) -> String {
        format!("{}.router.lifecycle", self.ns)
    }

    /// Where router replicas publish and receive the changes to the requests they
    /// booked (sequence sync).
    pub fn sequences(&self) -> String {
        format!("{}.router.sequences", self.ns)
    }

    /// Where a starting router replica asks every other replica (plain subscription,
    /// no queue group) for the requests it booked
    /// ([`crate::replicas::SnapshotRequest`] → [`crate::replicas::SnapshotReply`]s).
    pub fn sequences_snapshot(&self) -> String {
        format!("{}.router.sequences.snapshot", self.ns)
    }

    /// A request-reply subject served by one engine, e.g. `op = "generate"`.
    pub fn engine(&self, worker: WorkerId, op: &str) -> String {
        format!("{}.engine.{worker}.{op}", self.ns)
    }

    /// Wildcard matching every request subject served by engine `worker`.
    pub fn engine_ops(&self, worker: WorkerId) -> String {
        format!("{}.engine.{worker}.*", self.ns)
    }

    /// Wildcard matching every engine's request subjects.
    pub fn engine_all(&self) -> String {
        format!("{}.engine.*.*", self.ns)
    }

    /// The etcd prefix under which workers register (ends with `/`).
    pub fn etcd_worker_prefix(&self) -> String {
        format!("kv-router/{}/workers/", self.ns)
    }

    /// The etcd key of one worker's registration.
    pub fn etcd_worker_key(&self, worker: WorkerId) -> String {
        format!("{}{worker}", self.etcd_worker_prefix())
    }

    /// The etcd prefix of the worker id claims (ends with `/`). It is not under
    /// [`Self::etcd_worker_prefix`] (`worker-ids/` does not start with `workers/`), so
    /// the routers' directory watch never sees a claim.
    pub fn etcd_worker_id_prefix(&self) -> String {
        format!("kv-router/{}/worker-ids/", self.ns)
    }

    /// The etcd key of one worker id's claim: whoever holds it may publish and
    /// register as `worker`.
    pub fn etcd_worker_id_key(&self, worker: WorkerId) -> String {
        format!("{}{worker}", self.etcd_worker_id_prefix())
    }

    /// Parses the worker id out of a key under [`Self::etcd_worker_prefix`]; `None` for
    /// keys outside the prefix or with a non-numeric id.
    pub fn worker_id_from_etcd_key(&self, key: &str) -> Option<WorkerId> {
        key.strip_prefix(&self.etcd_worker_prefix())?
            .parse::<u64>()
            .ok()
            .map(WorkerId)
    }

    /// Parses the worker id out of an events or metrics subject (its last token).
    pub fn worker_id_from_subject(subject: &str) -> Option<WorkerId> {
        subject
            .rsplit('.')
            .next()?
            .parse::<u64>()
            .ok()
            .map(WorkerId)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_validation() {
        assert!(Namespace::new("prod-1_a").is_ok());
        assert_eq!(Namespace::new(""), Err(NamespaceError::Length(0)));
        assert_eq!(Namespace::new("a.b"), Err(NamespaceError::Character('.')));
        assert_eq!(Namespace::new("a*"), Err(NamespaceError::Character('*')));
        assert!(Namespace::new("x".repeat(65)).is_err());
    }

    #[test]
    fn subjects_and_keys() {
        let s = Subjects::new(Namespace::new("ns").unwrap());
        assert_eq!(s.kv_events(WorkerId(7)), "ns.kv.events.7");
        assert_eq!(s.kv_events_all(), "ns.kv.events.*");
        assert_eq!(s.kv_recovery(WorkerId(7)), "ns.kv.recovery.7");
        assert_eq!(s.kv_events_stream_filter(), "ns.kv.events.>");
        assert_eq!(s.load_metrics(WorkerId(7)), "ns.kv.metrics.7");
        assert_eq!(s.route(), "ns.router.route");
        assert_eq!(s.route_batch(), "ns.router.route_batch");
        assert_eq!(
            s.route_at(RouterId(0xab)),
            "ns.router.at.00000000000000ab.route"
        );
        assert_eq!(
            s.route_batch_at(RouterId(0xab)),
            "ns.router.at.00000000000000ab.route_batch"
        );
        assert_eq!(s.route_queue_group(), "ns-router");
        assert_eq!(s.lifecycle(), "ns.router.lifecycle");
        assert_eq!(s.sequences(), "ns.router.sequences");
        assert_eq!(s.sequences_snapshot(), "ns.router.sequences.snapshot");
        assert_eq!(s.engine(WorkerId(3), "generate"), "ns.engine.3.generate");
        assert_eq!(s.engine_ops(WorkerId(3)), "ns.engine.3.*");
        assert_eq!(s.engine_all(), "ns.engine.*.*");
        assert_eq!(s.kv_recovery_all(), "ns.kv.recovery.*");
        assert_eq!(s.etcd_worker_key(WorkerId(9)), "kv-router/ns/workers/9");
        assert_eq!(
            s.worker_id_from_etcd_key("kv-router/ns/workers/9"),
            Some(WorkerId(9))
        );
        assert_eq!(s.worker_id_from_etcd_key("kv-router/other/workers/9"), None);
        assert_eq!(s.worker_id_from_etcd_key("kv-router/ns/workers/x"), None);
        let claim = s.etcd_worker_id_key(WorkerId(9));
        assert_eq!(claim, "kv-router/ns/worker-ids/9");
        assert!(claim.starts_with(&s.etcd_worker_id_prefix()));
        // The directory's watch prefix must not see claims.
        assert!(!claim.starts_with(&s.etcd_worker_prefix()));
        assert_eq!(s.worker_id_from_etcd_key(&claim), None);
        assert_eq!(
            Subjects::worker_id_from_subject("ns.kv.events.12"),
            Some(WorkerId(12))
        );
        assert_eq!(Subjects::worker_id_from_subject("ns.kv.events.abc"), None);
    }
}
