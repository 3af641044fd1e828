//! The fuzz targets: one per decoder of network input, each driving the decoder and
//! the pure step the process runs right after it. The list is in [`ALL`]; the crate
//! docs say where each input comes from.

mod edge;
mod recovery;
mod router;
mod seeds;
mod target;

pub use target::{Harness, Target, Verdict};

/// Every target, in report order.
pub static ALL: &[Target] = &[
    router::EVENTS,
    router::METRICS,
    router::ROUTE,
    router::ROUTE_BATCH,
    router::LIFECYCLE,
    router::BOOKINGS,
    router::SNAPSHOT_REQUEST,
    router::SNAPSHOT_REPLY,
    recovery::RECOVERY_REQUEST,
    recovery::RECOVERY_REPLY,
    recovery::INDEX_SNAPSHOT,
    edge::REGISTRATION,
    edge::ENGINE_BATCH,
    edge::RELAY_FRAMES,
    edge::GATEWAY_COMPLETION,
    edge::GATEWAY_CHAT,
    edge::ROUTE_REPLY,
];

/// The target called `name`.
pub fn by_name(name: &str) -> Option<&'static Target> {
    ALL.iter().find(|t| t.name == name)
}
