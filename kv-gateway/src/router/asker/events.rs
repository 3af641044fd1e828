//! Replica affinity's events: why a pin is let go, and the counters of
//! `kv_gateway_route_affinity_total`.

use async_nats::client::{RequestError, RequestErrorKind};
use prometheus::{IntCounter, IntCounterVec};

/// The counters of `kv_gateway_route_affinity_total`, one per `event`.
pub(super) struct Events {
    pub(super) pinned: IntCounter,
    gone: IntCounter,
    overloaded: IntCounter,
    timed_out: IntCounter,
    failed: IntCounter,
}

/// Why a pin is let go before its window has passed.
#[derive(Clone, Copy)]
pub(super) enum Release {
    /// NATS "no responders": the replica's subscription is gone.
    Gone,
    /// The replica answered `overloaded`.
    Overloaded,
    /// No answer within the affinity's patience, or the route timeout.
    TimedOut,
    /// Any other error of the request.
    Failed,
}

impl Release {
    pub(super) fn of(e: &RequestError) -> Self {
        match e.kind() {
            RequestErrorKind::NoResponders => Self::Gone,
            RequestErrorKind::TimedOut => Self::TimedOut,
            _ => Self::Failed,
        }
    }
}

impl Events {
    pub(super) fn new(counters: &IntCounterVec) -> Self {
        let event = |name: &str| counters.with_label_values(&[name]);
        Self {
            pinned: event("pinned"),
            gone: event("gone"),
            overloaded: event("overloaded"),
            timed_out: event("timed_out"),
            failed: event("failed"),
        }
    }

    pub(super) fn released(&self, why: Release) -> &IntCounter {
        match why {
            Release::Gone => &self.gone,
            Release::Overloaded => &self.overloaded,
            Release::TimedOut => &self.timed_out,
            Release::Failed => &self.failed,
        }
    }
}
