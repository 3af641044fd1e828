//! What a target is: fresh state per input ([`Harness`]), its seeds and format, and
//! the [`Verdict`] on one input.

use crate::mutate::{Corpus, Format};

/// What a target made of one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Decoded (and applied, where the target applies).
    Accepted,
    /// Refused with this error text (must be non-empty: a clear error).
    Refused(String),
}

impl Verdict {
    pub(super) fn of<E: std::fmt::Display>(result: Result<(), E>) -> Self {
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
    /// Valid inputs: built from the wire types, or real captures.
    pub(super) seeds: fn() -> Vec<Vec<u8>>,
    /// Fresh state for one input.
    pub(super) fresh: fn() -> Box<dyn Harness>,
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
