//! Allocation metering: the peak of live heap bytes while one input is handled.
//!
//! The binary that runs the harness installs [`peak_alloc::PeakAlloc`] as its global
//! allocator (one line, see `tests/decoders.rs`); this module reads its counters. The
//! counters are process-wide, so only one [`Meter`] exists at a time (a second one
//! waits), the harness handles inputs on one thread, and nothing else in the process
//! may allocate meanwhile: a test binary that meters runs its tests one at a time
//! ([`one_test_at_a_time`]).
//! [`Meter::new`] refuses to start when the allocator is not installed, so a run can
//! never pass by measuring nothing.

use peak_alloc::PeakAlloc;
use std::sync::{Mutex, MutexGuard};

/// Held by the one live [`Meter`].
static TURN: Mutex<()> = Mutex::new(());

/// Held by the one running test of a metering test binary.
static TEST: Mutex<()> = Mutex::new(());

/// Hold for the whole of a test in a binary that meters: a test building its input
/// while another is metered would count against it, so such tests run one at a time.
pub fn one_test_at_a_time() -> MutexGuard<'static, ()> {
    // A test that panicked left nothing to repair: the lock only orders tests.
    TEST.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Reads the counters of the installed [`PeakAlloc`]; one at a time per process.
#[derive(Debug)]
pub struct Meter {
    alloc: PeakAlloc,
    _turn: MutexGuard<'static, ()>,
}

/// Why metering cannot start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "peak_alloc::PeakAlloc is not the global allocator: add `#[global_allocator] static A: \
     peak_alloc::PeakAlloc = peak_alloc::PeakAlloc;` to the binary"
)]
pub struct NotInstalled;

impl Meter {
    /// A meter, after checking that an allocation moves the counters; waits while
    /// another meter lives.
    ///
    /// # Errors
    /// [`NotInstalled`] when [`PeakAlloc`] is not the global allocator.
    pub fn new() -> Result<Self, NotInstalled> {
        // A meter that panicked left nothing to repair: the lock only orders meters.
        let turn = TURN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let alloc = PeakAlloc;
        // The counters are process-wide: other threads (the test harness's) may free
        // memory during the probe, so a 1 MiB probe must move them by at least half
        // of it. Without the allocator installed they never move at all.
        const PROBE: usize = 1 << 20;
        let before = alloc.current_usage();
        let probe: Vec<u8> = Vec::with_capacity(PROBE);
        let during = alloc.current_usage();
        drop(std::hint::black_box(probe));
        if during < before.saturating_add(PROBE / 2) {
            return Err(NotInstalled);
        }
        Ok(Self { alloc, _turn: turn })
    }

    /// Runs `f` and returns its result with the peak of live heap bytes above the
    /// level at the start, in bytes.
    pub fn peak_of<R>(&self, f: impl FnOnce() -> R) -> (R, usize) {
        let base = self.alloc.current_usage();
        self.alloc.reset_peak_usage();
        let out = f();
        (out, self.alloc.peak_usage().saturating_sub(base))
    }
}
