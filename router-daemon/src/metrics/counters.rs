//! Prometheus counters for what the daemon received, applied and rejected, and the
//! handle to every other daemon metric (`metrics::Metrics`).
//!
//! Metrics come from an injected [`prometheus::Registry`] (through a
//! [`Registrar`]) so that several daemons can run in one process (tests) without
//! clashing in a global registry; [`Counters::unregistered`] gives working counters
//! that nobody scrapes. The crate root re-exports this module as `counters`.

use super::Metrics;
use super::registrar::{self, Registrar};
use kv_events::limits::Refusal;
use prometheus::core::Desc;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Registry};
use std::sync::OnceLock;
use std::time::Instant;
use tracing::warn;

/// Message kinds the daemon consumes, used as the `kind` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageKind {
    /// KV event batches.
    Events,
    /// Load metrics.
    Metrics,
    /// Route requests.
    Route,
    /// Batch route requests (one count per batch; each entry is also observed by the
    /// route metrics).
    RouteBatch,
    /// Lifecycle messages.
    Lifecycle,
    /// etcd worker registrations.
    Registration,
    /// Sequence sync messages from peer router replicas.
    Sequences,
    /// Start-up snapshot requests from peer replicas and replies to our own.
    SequenceSnapshot,
    /// Removals queries (`{ns}.router.removals`).
    Removals,
    /// Overlap queries (`{ns}.router.overlap`).
    Overlap,
    /// Roll calls (`{ns}.router.replicas`).
    RollCall,
}

impl MessageKind {
    fn label(self) -> &'static str {
        match self {
            MessageKind::Events => "events",
            MessageKind::Metrics => "metrics",
            MessageKind::Route => "route",
            MessageKind::RouteBatch => "route_batch",
            MessageKind::Lifecycle => "lifecycle",
            MessageKind::Registration => "registration",
            MessageKind::Sequences => "sequences",
            MessageKind::SequenceSnapshot => "sequence_snapshot",
            MessageKind::Removals => "removals",
            MessageKind::Overlap => "overlap",
            MessageKind::RollCall => "roll_call",
        }
    }
}

/// Outcome of handling one message, used as the `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Decoded and applied.
    Ok,
    /// Could not be decoded (bad msgpack / JSON, wrong shape); skipped.
    Malformed,
    /// Decoded but refused (unknown request, invalid registration, ...).
    Rejected,
    /// Longer than `--max-message-bytes`; not decoded.
    TooLarge,
    /// Decoded, but a count or value is over its limit (`Limits` flags).
    OverLimit,
    /// KV events of a worker no registration names, dropped after their wait.
    Unregistered,
    /// KV events of a newer epoch than the worker registered, dropped after their wait.
    FutureEpoch,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Malformed => "malformed",
            Outcome::Rejected => "rejected",
            Outcome::TooLarge => "too_large",
            Outcome::OverLimit => "over_limit",
            Outcome::Unregistered => "unregistered",
            Outcome::FutureEpoch => "future_epoch",
        }
    }
}

/// Variants of [`MessageKind`] and of [`Outcome`] with a resolved handle (the last
/// one's index + 1; a variant added past them is counted through a label lookup).
const KINDS: usize = MessageKind::RollCall as usize + 1;
const OUTCOMES: usize = Outcome::FutureEpoch as usize + 1;

/// The daemon's counters, plus every other metric group in [`Counters::metrics`].
#[derive(Clone)]
pub struct Counters {
    messages: IntCounterVec,
    /// `messages`' handle per (kind, outcome), resolved at its first use: a label
    /// lookup hashes the label strings under the vector's lock, on every route and
    /// lifecycle message otherwise.
    handles: std::sync::Arc<[OnceLock<IntCounter>; KINDS * OUTCOMES]>,
    workers: IntGauge,
    /// Rate limiter of refusal log lines.
    refusal_log: std::sync::Arc<super::refusals::RefusalLog>,
    /// Routing, event, recovery, queue, load and connection metrics.
    pub metrics: Metrics,
}

impl Counters {
    /// Creates the counters and every other metric group through `r`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub(crate) fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            messages: r.counter_vec(
                "kv_router_messages_total",
                "Messages received by the daemon, by kind and outcome",
                &["kind", "outcome"],
            )?,
            handles: std::sync::Arc::new(std::array::from_fn(|_| OnceLock::new())),
            workers: r.gauge("kv_router_workers", "Workers currently registered in etcd")?,
            refusal_log: std::sync::Arc::default(),
            metrics: Metrics::new(r)?,
        })
    }

    /// Creates the counters and registers them in `registry`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub(crate) fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        Self::new(&Registrar::new(registry))
    }

    /// Counters that are not registered anywhere.
    pub fn unregistered() -> Self {
        registrar::unregistered(Self::new)
    }

    /// The descriptors of every metric (name, help, label names), sorted by name: what
    /// `/metrics` can export. Vectors without samples yet are included. Metric handles
    /// do not list their definitions, so this builds an unregistered twin of `self`
    /// (every `Counters` comes from `Counters::new`) and reads them from its
    /// registrar.
    pub fn descriptors(&self) -> Vec<Desc> {
        registrar::unregistered(|twin| Self::new(twin).map(|_| twin.descriptors()))
    }
    pub(crate) fn message(&self, kind: MessageKind, outcome: Outcome) {
        self.with_handle(kind, outcome, IntCounter::inc);
    }

    /// Messages counted so far for (kind, outcome).
    pub fn messages(&self, kind: MessageKind, outcome: Outcome) -> u64 {
        self.with_handle(kind, outcome, IntCounter::get)
    }

    /// `f` on the counter of (kind, outcome), resolved once.
    fn with_handle<R>(
        &self,
        kind: MessageKind,
        outcome: Outcome,
        f: impl FnOnce(&IntCounter) -> R,
    ) -> R {
        let resolve = || {
            self.messages
                .with_label_values(&[kind.label(), outcome.label()])
        };
        let (k, o) = (kind as usize, outcome as usize);
        match self.handles.get(k * OUTCOMES + o).filter(|_| o < OUTCOMES) {
            Some(cell) => f(cell.get_or_init(resolve)),
            None => f(&resolve()),
        }
    }

    /// Counts a refused message of `kind` from `subject` and logs it, rate-limited.
    pub(crate) fn refused(&self, kind: MessageKind, subject: &str, refusal: &Refusal) {
        let outcome = match refusal {
            Refusal::TooLarge { .. } => Outcome::TooLarge,
            Refusal::Malformed(_) => Outcome::Malformed,
            Refusal::OverLimit(_) => Outcome::OverLimit,
        };
        self.skipped(kind, outcome, subject, &refusal.to_string());
    }

    /// Counts a skipped message of `kind` from `subject` under `outcome`, and logs it
    /// with `detail`, at most once per `refusals::LOG_EVERY` per (kind, outcome).
    pub(crate) fn skipped(&self, kind: MessageKind, outcome: Outcome, subject: &str, detail: &str) {
        self.message(kind, outcome);
        if let Some(not_logged) =
            self.refusal_log
                .should_log(kind.label(), outcome.label(), Instant::now())
        {
            warn!(
                subject,
                kind = kind.label(),
                reason = outcome.label(),
                error = detail,
                not_logged,
                "message skipped"
            );
        }
    }

    /// Sets the registered-workers gauge.
    pub(crate) fn set_workers(&self, n: usize) {
        self.workers.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_kind_and_outcome_and_registers_once() {
        let registry = Registry::new();
        let c = Counters::register(&registry).unwrap();
        c.message(MessageKind::Events, Outcome::Malformed);
        c.message(MessageKind::Events, Outcome::Malformed);
        c.message(MessageKind::Route, Outcome::Ok);
        assert_eq!(c.messages(MessageKind::Events, Outcome::Malformed), 2);
        assert_eq!(c.messages(MessageKind::Route, Outcome::Ok), 1);
        assert_eq!(c.messages(MessageKind::Route, Outcome::Malformed), 0);
        assert!(
            Counters::register(&registry).is_err(),
            "double registration must fail"
        );
        let names: Vec<String> = registry
            .gather()
            .iter()
            .map(|f| f.name().to_owned())
            .collect();
        assert!(names.contains(&"kv_router_messages_total".to_owned()));
    }

    /// Every (kind, outcome) has a handle of its own, exported under its labels.
    #[test]
    fn each_kind_and_outcome_counts_under_its_own_labels() {
        use MessageKind as K;
        use Outcome as O;
        let kinds = [
            K::Events,
            K::Metrics,
            K::Route,
            K::RouteBatch,
            K::Lifecycle,
            K::Registration,
            K::Sequences,
            K::SequenceSnapshot,
            K::Removals,
            K::Overlap,
            K::RollCall,
        ];
        let outcomes = [
            O::Ok,
            O::Malformed,
            O::Rejected,
            O::TooLarge,
            O::OverLimit,
            O::Unregistered,
            O::FutureEpoch,
        ];
        let registry = Registry::new();
        let c = Counters::register(&registry).unwrap();
        for (i, &kind) in kinds.iter().enumerate() {
            for (j, &outcome) in outcomes.iter().enumerate() {
                for _ in 0..(i * outcomes.len() + j + 1) {
                    c.message(kind, outcome);
                }
            }
        }
        let families = registry.gather();
        let family = families
            .iter()
            .find(|f| f.name() == "kv_router_messages_total")
            .unwrap();
        assert_eq!(family.get_metric().len(), kinds.len() * outcomes.len());
        for m in family.get_metric() {
            let label = |name: &str| {
                let l = m.get_label().iter().find(|l| l.name() == name).unwrap();
                l.value().to_owned()
            };
            let i = kinds
                .iter()
                .position(|k| k.label() == label("kind"))
                .unwrap();
            let j = (outcomes.iter())
                .position(|o| o.label() == label("outcome"))
                .unwrap();
            let expected = (i * outcomes.len() + j + 1) as f64;
            assert_eq!(m.get_counter().value(), expected, "{i} {j}");
        }
    }
}
