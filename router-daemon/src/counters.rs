//! Prometheus counters for what the daemon received, applied and rejected.
//!
//! Metrics come from an injected [`prometheus::Registry`] so that several daemons can
//! run in one process (tests) without clashing in a global registry;
//! [`Counters::unregistered`] gives working counters that nobody scrapes.

use prometheus::{IntCounterVec, IntGauge, Opts, Registry};

/// Message kinds the daemon consumes, used as the `kind` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageKind {
    /// KV event batches.
    Events,
    /// Load metrics.
    Metrics,
    /// Route requests.
    Route,
    /// Lifecycle messages.
    Lifecycle,
    /// etcd worker registrations.
    Registration,
}

impl MessageKind {
    fn label(self) -> &'static str {
        match self {
            MessageKind::Events => "events",
            MessageKind::Metrics => "metrics",
            MessageKind::Route => "route",
            MessageKind::Lifecycle => "lifecycle",
            MessageKind::Registration => "registration",
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
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Malformed => "malformed",
            Outcome::Rejected => "rejected",
        }
    }
}

/// The daemon's counters.
#[derive(Clone)]
pub struct Counters {
    messages: IntCounterVec,
    workers: IntGauge,
}

impl Counters {
    /// Creates the counters and registers them in `registry`.
    ///
    /// # Errors
    /// A [`prometheus::Error`] if a metric of the same name is already registered.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let counters = Self::unregistered();
        registry.register(Box::new(counters.messages.clone()))?;
        registry.register(Box::new(counters.workers.clone()))?;
        Ok(counters)
    }

    /// Counters that are not registered anywhere.
    pub fn unregistered() -> Self {
        // The names and labels are static and valid, so construction cannot fail.
        #[allow(clippy::expect_used)]
        let messages = IntCounterVec::new(
            Opts::new(
                "kv_router_messages_total",
                "Messages received by the daemon, by kind and outcome",
            ),
            &["kind", "outcome"],
        )
        .expect("static metric definition is valid");
        #[allow(clippy::expect_used)]
        let workers = IntGauge::new("kv_router_workers", "Workers currently registered in etcd")
            .expect("static metric definition is valid");
        Self { messages, workers }
    }

    /// Counts one message.
    pub fn message(&self, kind: MessageKind, outcome: Outcome) {
        self.messages
            .with_label_values(&[kind.label(), outcome.label()])
            .inc();
    }

    /// Messages counted so far for (kind, outcome).
    pub fn messages(&self, kind: MessageKind, outcome: Outcome) -> u64 {
        self.messages
            .with_label_values(&[kind.label(), outcome.label()])
            .get()
    }

    /// Sets the registered-workers gauge.
    pub fn set_workers(&self, n: usize) {
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
}
