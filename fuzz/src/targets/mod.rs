//! The fuzz targets: one per decoder of network input, each driving the decoder and
//! the pure step the process runs right after it. The list is in [`ALL`]; the crate
//! docs say where each input comes from.

mod edge;
mod recovery;
mod router;
mod seeds;

use crate::mutate::{Corpus, Format};

/// What a target made of one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Decoded (and applied, where the target applies).
    Accepted,
    /// Refused with this error text (must be non-empty: a clear error).
    Refused(String),
    /// Decoded and valid, but not applied: applying it needs a limit kv-router does
    /// not have yet (an open finding, named in the text). Counted apart, so a long run
    /// neither hides the finding nor takes the machine down with it.
    Skipped(String),
}

impl Verdict {
    fn of<E: std::fmt::Display>(result: Result<(), E>) -> Self {
        match result {
            Ok(()) => Verdict::Accepted,
            Err(e) => Verdict::Refused(e.to_string()),
        }
    }
}

/// Fresh state for one input: built before the input is metered, dropped after.
pub trait Harness {
    /// Decodes `input` and applies it to this state as the process would.
    fn feed(&mut self, input: &[u8]) -> Verdict;
}

/// One decoder under test.
pub struct Target {
    /// Short name, used on the command line and in reports.
    pub name: &'static str,
    /// What is decoded, from where, and what runs after it.
    pub about: &'static str,
    /// How inputs are encoded.
    pub format: Format,
    seeds: fn() -> Vec<Vec<u8>>,
    fresh: fn() -> Box<dyn Harness>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target").field("name", &self.name).finish()
    }
}

impl Target {
    /// The seed corpus (valid inputs, real captures where there are some).
    pub fn corpus(&self) -> Corpus {
        Corpus::new(self.format, (self.seeds)())
    }

    /// Fresh state for one input.
    pub fn fresh(&self) -> Box<dyn Harness> {
        (self.fresh)()
    }
}

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
